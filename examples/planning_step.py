"""Plan a user's own training step: a plain-JAX Llama-style model (no zoo code), traced from shapes only.

The model: token embedding, pre-RMSNorm blocks (grouped-query attention with rotary position embeddings through
``jax.nn.dot_product_attention``, then a SwiGLU MLP), a final RMSNorm and an untied output head. Parameters are a
dict with the blocks as a list of dicts, stored in float32 (master weights) and cast to bfloat16 inside the loss,
where each layer uses them (mixed precision). The step is ``autopp.value_and_grad`` of the loss and an optax AdamW
update; the planner traces it from ``jax.ShapeDtypeStruct``s, so nothing is allocated, and a 70B model is planned on
a laptop.

From the command line (in the repository root; ``--step`` imports ``package.module`` from the current directory,
like ``python -m``, and calls the function with no arguments)::

    autopp plan --step examples.planning_step:llama_70b --global-batch 1024 --cluster 64x8xH100
    autopp simulate --step examples.planning_step:llama_70b --global-batch 1024 --cluster 64x8xH100 \\
        --tp 8 --pp 8 --dp 8 --microbatch-size 1 --schedule interleaved-1f1b --virtual-stages 5
    autopp plan --step examples.planning_step:tiny --global-batch 16 --cluster 1x8xH100 --out plan.json
    autopp show plan.json

From Python::

    from autopp.planner import plan_model
    from autopp.profiler import profile
    from examples.planning_step import llama_70b

    step, args, batch_argnums = llama_70b()
    prof = profile(step, *args, cluster="64x8xH100", batch_argnums=batch_argnums)
    plan = plan_model(prof, "64x8xH100", global_batch=1024)

``llama_70b()`` and ``tiny()`` return ``(step, args, batch_argnums)``: the step
``step(params, opt_state, batch) -> (params, opt_state, loss)``, its arguments as ``ShapeDtypeStruct``s at batch 1
(the planner scales the costs to each microbatch size) and which argument is the batch. ``init(key, shape)`` makes
real parameters for the same step (e.g. to run it with ``autopp.parallelize`` and a plan).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import optax

import autopp

COMPUTE_DTYPE = jnp.bfloat16
PARAM_DTYPE = jnp.float32


@dataclasses.dataclass(frozen=True)
class Shape:
    """The model's sizes."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    seq: int
    vocab: int
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


LLAMA_70B = Shape(layers=80, hidden=8192, heads=64, kv_heads=8, ffn=28672, seq=4096, vocab=32000)
TINY = Shape(layers=4, hidden=64, heads=4, kv_heads=2, ffn=128, seq=32, vocab=128)


def init(key: jax.Array, shape: Shape) -> dict:
    """float32 parameters: ``{"embed", "blocks": [{"attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w_gate",
    "w_up", "w_down"}, ...], "final_norm", "lm_head"}``."""
    h, hd = shape.hidden, shape.head_dim
    std, out_std = 0.02, 0.02 / math.sqrt(2 * shape.layers)

    def normal(k, dims, s):
        return (s * jax.random.normal(k, dims, jnp.float32)).astype(PARAM_DTYPE)

    k_embed, k_head, *k_blocks = jax.random.split(key, 2 + shape.layers)
    blocks = []
    for kb in k_blocks:
        kq, kk, kv, ko, kg, ku, kd = jax.random.split(kb, 7)
        blocks.append({
            "attn_norm": jnp.ones((h,), PARAM_DTYPE),
            "wq": normal(kq, (h, shape.heads * hd), std),
            "wk": normal(kk, (h, shape.kv_heads * hd), std),
            "wv": normal(kv, (h, shape.kv_heads * hd), std),
            "wo": normal(ko, (shape.heads * hd, h), out_std),
            "mlp_norm": jnp.ones((h,), PARAM_DTYPE),
            "w_gate": normal(kg, (h, shape.ffn), std),
            "w_up": normal(ku, (h, shape.ffn), std),
            "w_down": normal(kd, (shape.ffn, h), out_std),
        })
    return {"embed": normal(k_embed, (shape.vocab, h), std), "blocks": blocks,
            "final_norm": jnp.ones((h,), PARAM_DTYPE), "lm_head": normal(k_head, (h, shape.vocab), std)}


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """RMSNorm with float32 statistics, returned in ``x.dtype``."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (y * scale.astype(jnp.float32)).astype(x.dtype)


def rope(x: jax.Array, theta: float) -> jax.Array:
    """Rotary position embedding (rotate-half pairing) of ``(batch, seq, heads, head_dim)``, in float32."""
    _, s, _, hd = x.shape
    inv_freq = 1.0 / theta ** (jnp.arange(0, hd, 2, dtype=jnp.float32) / hd)
    angles = jnp.arange(s, dtype=jnp.float32)[:, None] * inv_freq[None, :]
    angles = jnp.concatenate([angles, angles], axis=-1)[:, None, :]
    x32 = x.astype(jnp.float32)
    x1, x2 = jnp.split(x32, 2, axis=-1)
    return (x32 * jnp.cos(angles) + jnp.concatenate([-x2, x1], axis=-1) * jnp.sin(angles)).astype(x.dtype)


def block(p: dict, x: jax.Array, shape: Shape) -> jax.Array:
    """One pre-norm block; the float32 weights are cast to bfloat16 here, where they are used."""
    p = jax.tree.map(lambda w: w.astype(COMPUTE_DTYPE), p)
    b, s, _ = x.shape
    hd = shape.head_dim
    y = rms_norm(x, p["attn_norm"], shape.norm_eps)
    q = rope((y @ p["wq"]).reshape(b, s, shape.heads, hd), shape.rope_theta)
    k = rope((y @ p["wk"]).reshape(b, s, shape.kv_heads, hd), shape.rope_theta)
    v = (y @ p["wv"]).reshape(b, s, shape.kv_heads, hd)
    attn = jax.nn.dot_product_attention(q, k, v, is_causal=True)  # grouped-query: kv_heads < heads
    x = x + attn.reshape(b, s, shape.heads * hd) @ p["wo"]
    y = rms_norm(x, p["mlp_norm"], shape.norm_eps)
    return x + (jax.nn.silu(y @ p["w_gate"]) * (y @ p["w_up"])) @ p["w_down"]


def loss_fn(params: dict, batch: dict, shape: Shape) -> jax.Array:
    """Mean next-token cross-entropy (logits and log-softmax in float32)."""
    x = params["embed"][batch["tokens"]].astype(COMPUTE_DTYPE)  # gather the rows, then cast them
    for p in params["blocks"]:
        x = block(p, x, shape)
    y = rms_norm(x, params["final_norm"], shape.norm_eps)
    logits = jnp.einsum("bsh,hv->bsv", y, params["lm_head"].astype(COMPUTE_DTYPE),
                        preferred_element_type=jnp.float32)
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, batch["targets"][..., None], axis=-1))


def make_step(shape: Shape, tx: optax.GradientTransformation):
    """``step(params, opt_state, batch) -> (params, opt_state, loss)``."""

    def loss(params, batch):
        return loss_fn(params, batch, shape)

    def step(params, opt_state, batch):
        loss_value, grads = autopp.value_and_grad(loss)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss_value

    return step


def abstract_step(shape: Shape, batch_size: int = 1):
    """``(step, (params, opt_state, batch), batch_argnums)`` with ``ShapeDtypeStruct`` arguments."""
    tx = optax.adamw(3e-4, b1=0.9, b2=0.95, weight_decay=0.1)
    params = jax.eval_shape(lambda: init(jax.random.key(0), shape))
    opt_state = jax.eval_shape(tx.init, params)
    tokens = jax.ShapeDtypeStruct((batch_size, shape.seq), jnp.int32)
    batch = {"tokens": tokens, "targets": tokens}
    return make_step(shape, tx), (params, opt_state, batch), (2,)


def llama_70b():
    """The Llama-2-70B shape (80 layers, hidden 8192, 64 heads, 8 KV heads, FFN 28672, sequence 4096, vocabulary
    32000) at batch 1: ``(step, args, batch_argnums)`` for ``autopp plan --step``."""
    return abstract_step(LLAMA_70B)


def tiny():
    """A 4-layer model of the same code at batch 1 (tests)."""
    return abstract_step(TINY)


if __name__ == "__main__":  # python examples/planning_step.py: plan the 70B shape for 64 nodes of 8 H100s
    from autopp.planner import plan_model
    from autopp.profiler import profile

    step, args, batch_argnums = llama_70b()
    print(plan_model(profile(step, *args, cluster="64x8xH100", batch_argnums=batch_argnums), "64x8xH100",
                     global_batch=1024))

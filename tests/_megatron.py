"""A GPT written as Megatron-LM's runs were, outside the zoo: the model the fidelity checks trace.

Parameters are fp32 master weights (a list of dicts), cast to the compute dtype (fp16 for the 2021 A100 runs, bf16
for the 2024 H100 runs) inside the loss where each layer uses them. A block is pre-LayerNorm attention with a fused
qkv projection whose columns are ordered head by head (Megatron's layout), then a 4h GeLU MLP; the head reuses the
word embeddings and the cross-entropy runs in fp32. Attention is either written out (scores, mask, softmax, as the
2021 code materialised it) or ``jax.nn.dot_product_attention`` (a fused flash kernel, as Transformer Engine runs it
in the 2024 code). Nothing here is tuned to the reference rows: the shapes, precision and layouts come from the
papers' tables, the rest from the cost model.
"""

from __future__ import annotations

import json
import math
import pathlib

import jax
import jax.numpy as jnp
import optax

import autopp

REFERENCE = pathlib.Path(__file__).resolve().parents[2] / "shared" / "reference"


def _ln(p, x):
    x32 = x.astype(jnp.float32)
    mean = x32.mean(-1, keepdims=True)
    var = jnp.square(x32 - mean).mean(-1, keepdims=True)
    y = (x32 - mean) * jax.lax.rsqrt(var + 1e-5) * p["scale"] + p["bias"]
    return y.astype(x.dtype)


class MegatronGPT:
    def __init__(self, *, layers: int, hidden: int, heads: int, seq: int, vocab: int, dtype: str,
                 fused_attention: bool):
        self.layers, self.hidden, self.heads, self.seq, self.vocab = layers, hidden, heads, seq, vocab
        self.dtype = jnp.dtype(dtype)
        self.fused_attention = fused_attention

    def abstract_params(self):
        h, f32 = self.hidden, jnp.float32

        def sds(*shape):
            return jax.ShapeDtypeStruct(shape, f32)

        def ln():
            return {"scale": sds(h), "bias": sds(h)}

        blocks = [{"ln1": ln(), "qkv_w": sds(h, 3 * h), "qkv_b": sds(3 * h), "out_w": sds(h, h), "out_b": sds(h),
                   "ln2": ln(), "fc_w": sds(h, 4 * h), "fc_b": sds(4 * h), "proj_w": sds(4 * h, h),
                   "proj_b": sds(h)} for _ in range(self.layers)]
        return {"wte": sds(self.vocab, h), "wpe": sds(self.seq, h), "blocks": blocks, "ln_f": ln()}

    def _cast(self, tree):
        return jax.tree.map(lambda w: w.astype(self.dtype), tree)

    def block(self, p, x):
        b, s, h = x.shape
        nh, hd = self.heads, h // self.heads
        p = self._cast(p)
        y = _ln(p["ln1"], x)
        qkv = (y @ p["qkv_w"] + p["qkv_b"]).reshape(b, s, nh, 3, hd)
        q, k, v = qkv[:, :, :, 0], qkv[:, :, :, 1], qkv[:, :, :, 2]
        if self.fused_attention:
            ctx = jax.nn.dot_product_attention(q, k, v, is_causal=True)
        else:
            scores = jnp.einsum("bqnd,bknd->bnqk", q, k) / math.sqrt(hd)
            mask = jnp.tril(jnp.ones((s, s), bool))
            scores = jnp.where(mask, scores.astype(jnp.float32), -10000.0)
            probs = jax.nn.softmax(scores, axis=-1).astype(self.dtype)
            ctx = jnp.einsum("bnqk,bknd->bqnd", probs, v)
        x = x + ctx.reshape(b, s, h) @ p["out_w"] + p["out_b"]
        y = _ln(p["ln2"], x)
        y = jax.nn.gelu(y @ p["fc_w"] + p["fc_b"], approximate=True)
        return x + y @ p["proj_w"] + p["proj_b"]

    def loss(self, params, batch):
        tokens = batch["tokens"]
        wte, wpe = self._cast((params["wte"], params["wpe"]))
        x = wte[tokens] + wpe[: tokens.shape[1]]
        for p in params["blocks"]:
            x = self.block(p, x)
        ln_f, wte = self._cast((params["ln_f"], params["wte"]))
        logits = (_ln(ln_f, x) @ wte.T).astype(jnp.float32)
        logp = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.take_along_axis(logp, batch["targets"][..., None], axis=-1).mean()

    def step_and_args(self, batch_size: int = 1):
        tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-4))  # Megatron's --clip-grad 1.0, Adam
        params = self.abstract_params()
        opt_state = jax.eval_shape(tx.init, params)
        tok = jax.ShapeDtypeStruct((batch_size, self.seq), jnp.int32)

        def step(params, opt_state, batch):
            loss, grads = autopp.value_and_grad(self.loss)(params, batch)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        return step, (params, opt_state, {"tokens": tok, "targets": tok})


def a100_rows() -> list[dict]:
    """Narayanan et al. 2021, Table 1 (A100 80GB, fp16, full recomputation, seq 2048, vocab 51200), with the
    microbatch sizes of the published run script (examples/academic_paper_scripts/sc21/run_table_1.sh)."""
    data = json.loads((REFERENCE / "gpt_a100_measured.json").read_text())
    mbs = {1.7: 16, 39.1: 4, 1008.0: 1}
    out = []
    for params_b, heads, h, layers, tp, pp, gpus, gb, tflops in data["rows"]:
        out.append(dict(name=f"{params_b}B", heads=heads, hidden=h, layers=layers, tp=tp, pp=pp, dp=gpus // (tp * pp),
                        gpus=gpus, global_batch=gb, tflops=tflops, seq=2048, vocab=51200, microbatch_size=mbs[params_b],
                        # torch DDP overlaps the gradient all-reduce with the backward; Megatron's "local" DDP (39B,
                        # 1T) all-reduces after the pipeline, in the script's fp16
                        overlap=("grad-reduce",) if params_b == 1.7 else ()))
    return out


def h100_rows() -> list[dict]:
    """Megatron-LM's 2024 H100 weak-scaling table (seq 4096, vocab 131072, bf16; gradient reduce, parameter gather and
    tensor-parallel communication overlapped; the overlap flags imply the distributed optimizer and sequence
    parallelism)."""
    data = json.loads((REFERENCE / "gpt_h100_measured.json").read_text())
    out = []
    for params_b, heads, h, layers, tp, pp, dp, gpus, gb, tflops, mfu in data["rows"]:
        out.append(dict(name=f"{params_b}B", heads=heads, hidden=h, layers=layers, tp=tp, pp=pp, dp=dp, gpus=gpus,
                        global_batch=gb, tflops=tflops, seq=4096, vocab=131072,
                        overlap=("grad-reduce", "param-gather", "tensor")))
    return out

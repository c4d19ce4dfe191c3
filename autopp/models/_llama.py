"""A plain-JAX Llama (Llama 2 architecture) with grouped-query attention.

Token embedding (no position embedding), pre-RMSNorm blocks (causal
self-attention with separate ``wq``/``wk``/``wv`` projections, rotary position
embeddings on q and k, grouped-query attention with ``kv_heads`` key/value
heads, then a SwiGLU MLP), a final RMSNorm and an untied ``lm_head``. No biases.

Rotary embeddings use the rotate-half convention (GPT-NeoX / Hugging Face):
dimension ``i`` of a head is paired with dimension ``i + head_dim / 2`` and the
pair is rotated by ``pos * rope_theta ** (-2i / head_dim)``. Meta's reference
code pairs ``(2i, 2i + 1)`` instead; the two are the same model up to a fixed
permutation of the ``wq``/``wk`` output columns.

The attention core is ``jax.nn.dot_product_attention(q, k, v, is_causal=True)``
in ``(B, s, heads, head_dim)`` layout, which handles ``kv_heads < heads``
natively (softmax(q k^T / sqrt(head_dim)) v, scores and softmax in float32).

Mixed precision: parameters are stored in ``param_dtype`` and cast to the
compute ``dtype`` where they are used (inside :meth:`Llama.embed`,
:meth:`Llama.block` and :meth:`Llama.head`, hence inside ``loss``), the usual
"float32 master weights, bfloat16 matmuls" set-up; gradients come back in
``param_dtype``. RMSNorm statistics, RoPE, the attention softmax and the
logits / log-softmax are computed in float32.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from autopp.models._lm import Params, TokenLM

_DTYPES = ("float32", "bfloat16", "float16")
_INIT_STD = 0.02


def _dtype_name(value: Any) -> str | None:
    """The canonical name of a dtype-like (``"bfloat16"``, ``jnp.bfloat16``, ``np.float32``), else None."""
    if isinstance(value, str):
        return value
    try:
        return jnp.dtype(value).name
    except (TypeError, ValueError):
        return None


@dataclasses.dataclass(frozen=True, kw_only=True)
class LlamaConfig:
    """Shape and numerics of a :class:`Llama`."""

    layers: int
    """Number of transformer blocks (l)."""

    hidden: int
    """Model width (h); must be divisible by ``heads`` with an even quotient (RoPE rotates pairs)."""

    heads: int
    """Number of query heads; head dim is ``hidden // heads``."""

    kv_heads: int
    """Number of key/value heads (grouped-query attention); must divide ``heads``.
    ``kv_heads == heads`` is multi-head attention, ``kv_heads == 1`` multi-query attention."""

    ffn: int
    """Intermediate size of the SwiGLU MLP (``w_gate`` and ``w_up`` are ``(hidden, ffn)``)."""

    seq: int
    """Sequence length (s) of :meth:`Llama.batch`; RoPE itself works for any length."""

    vocab: int
    """Vocabulary size (V)."""

    rope_theta: float = 10000.0
    """Base of the rotary embedding frequencies."""

    norm_eps: float = 1e-5
    """Epsilon added to the mean square in RMSNorm."""

    dtype: str = "float32"
    """Compute dtype of activations and matmuls: one of "float32", "bfloat16", "float16".
    RMSNorm statistics, RoPE, attention softmax and logits are computed in float32."""

    param_dtype: str = "float32"
    """Storage dtype of the parameters (one of the same names); they are cast to ``dtype`` where used."""

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "heads", "kv_heads", "ffn", "seq", "vocab"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(
                    f"LlamaConfig.{name} must be an int, got {name}={value!r}; pass an integer."
                )
            if value <= 0:
                raise ValueError(
                    f"LlamaConfig.{name} must be positive, got {name}={value}; use a value >= 1."
                )
        for name in ("rope_theta", "norm_eps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(
                    f"LlamaConfig.{name} must be a float, got {name}={value!r}; pass a positive number."
                )
            if not (math.isfinite(value) and value > 0):
                raise ValueError(
                    f"LlamaConfig.{name} must be positive and finite, got {name}={value!r}; "
                    f"use e.g. {name}={LlamaConfig.__dataclass_fields__[name].default!r}."
                )
            object.__setattr__(self, name, float(value))
        if self.hidden % self.heads != 0:
            raise ValueError(
                f"LlamaConfig.hidden must be divisible by heads, got hidden={self.hidden}, "
                f"heads={self.heads}; choose hidden as a multiple of heads "
                f"(e.g. hidden={self.heads * max(1, round(self.hidden / self.heads))})."
            )
        if (self.hidden // self.heads) % 2 != 0:
            suggestion = 2 * self.heads * max(1, round(self.hidden / (2 * self.heads)))
            raise ValueError(
                f"LlamaConfig head dim hidden // heads must be even for rotary embeddings, got "
                f"hidden={self.hidden}, heads={self.heads} (head dim {self.hidden // self.heads}); "
                f"choose hidden as a multiple of 2 * heads (e.g. hidden={suggestion})."
            )
        if self.heads % self.kv_heads != 0:
            divisors = [d for d in range(1, self.heads + 1) if self.heads % d == 0]
            raise ValueError(
                f"LlamaConfig.kv_heads must divide heads (each key/value head serves a group of query heads), "
                f"got kv_heads={self.kv_heads}, heads={self.heads}; use one of kv_heads={divisors}."
            )
        for name in ("dtype", "param_dtype"):
            value = getattr(self, name)
            canonical = _dtype_name(value)
            if canonical not in _DTYPES:
                raise ValueError(
                    f"LlamaConfig.{name} must be one of {_DTYPES}, got {name}={value!r}; "
                    "pass one of those names."
                )
            object.__setattr__(self, name, canonical)

    @property
    def head_dim(self) -> int:
        """``hidden // heads``."""
        return self.hidden // self.heads

    @property
    def num_params(self) -> int:
        """Exact number of parameters :meth:`Llama.init` creates."""
        h, l, hd = self.hidden, self.layers, self.head_dim
        q_out, kv_out = self.heads * hd, self.kv_heads * hd
        per_block = (
            h  # attn_norm
            + h * q_out + 2 * h * kv_out + q_out * h  # wq, wk, wv, wo
            + h  # mlp_norm
            + 3 * h * self.ffn  # w_gate, w_up, w_down
        )
        return self.vocab * h + l * per_block + h + h * self.vocab

    def forward_flops(self, batch_size: int) -> float:
        """Matmul FLOPs (``2 m n k`` each) of one forward pass over ``batch_size`` sequences.

        Per block: the q/k/v/o projections ``2 B s h (2 h_q + 2 h_kv)`` (``h_q = heads * head_dim``,
        ``h_kv = kv_heads * head_dim``), the two attention matmuls ``2 * 2 B s^2 h_q`` (the full
        ``s x s`` score matrix, as XLA computes it; the causal mask does not halve it) and the SwiGLU
        MLP ``3 * 2 B s h ffn``; plus the head ``2 B s h V``. Elementwise work is not counted.
        """
        b = _check_batch_size(batch_size)
        s, h, hd = self.seq, self.hidden, self.head_dim
        h_q, h_kv = self.heads * hd, self.kv_heads * hd
        block = (2 * b * s * h * (2 * h_q + 2 * h_kv)
                 + 2 * 2 * b * s * s * h_q
                 + 3 * 2 * b * s * h * self.ffn)
        head = 2 * b * s * h * self.vocab
        return float(self.layers * block + head)

    def flops_per_step(self, batch_size: int, recompute: bool = False) -> float:
        """Model FLOPs of one training step (forward + backward) on ``batch_size`` sequences.

        Each matmul of :meth:`forward_flops` costs twice as much again in the backward pass (the
        gradients with respect to both operands), so a step is ``3 *`` the forward. With full
        activation recomputation the blocks' forward runs twice: ``4 * blocks + 3 * head``.
        """
        fwd = self.forward_flops(batch_size)
        if not recompute:
            return 3.0 * fwd
        b, s, h = batch_size, self.seq, self.hidden
        head = 2.0 * b * s * h * self.vocab
        return 4.0 * (fwd - head) + 3.0 * head

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly dict; ``LlamaConfig(**cfg.to_dict()) == cfg``."""
        return dataclasses.asdict(self)

    def abstract_step(self, batch_size: int = 1, optimizer=None):
        """The zoo's training step for this model (``autopp.value_and_grad`` of the loss, then ``optimizer``,
        default AdamW) and its arguments as ``jax.ShapeDtypeStruct``s at ``batch_size`` sequences:
        ``(step, (params, opt_state, batch), batch_argnums)``, what the planner traces."""
        from autopp.models._train import abstract_training_step

        return abstract_training_step(Llama(self), batch_size, optimizer)


def _check_batch_size(batch_size: Any) -> int:
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size <= 0:
        raise ValueError(
            f"batch_size must be a positive int, got batch_size={batch_size!r}; pass B >= 1."
        )
    return batch_size


def _rms_norm(p: Params, x: jax.Array, eps: float) -> jax.Array:
    """``x / sqrt(mean(x^2) + eps) * scale`` in float32, returned in ``x.dtype``."""
    x32 = x.astype(jnp.float32)
    ms = jnp.mean(jnp.square(x32), axis=-1, keepdims=True)
    y = x32 * jax.lax.rsqrt(ms + eps) * p["scale"].astype(jnp.float32)
    return y.astype(x.dtype)


def _rope_tables(seq: int, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """float32 ``(cos, sin)`` of shape ``(seq, 1, head_dim)`` for the rotate-half convention.

    Computed in the trace (from an iota) rather than baked in as ``(seq, head_dim)`` constants."""
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    angles = jnp.arange(seq, dtype=jnp.float32)[:, None] * jnp.asarray(inv_freq, jnp.float32)[None, :]
    angles = jnp.concatenate([angles, angles], axis=-1)[:, None, :]  # (s, 1, hd)
    return jnp.cos(angles), jnp.sin(angles)


def _apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate ``(B, s, n, hd)`` pairs ``(i, i + hd/2)``; computed in float32, returned in ``x.dtype``."""
    x32 = x.astype(jnp.float32)
    x1, x2 = jnp.split(x32, 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return (x32 * cos + rotated * sin).astype(x.dtype)


class Llama(TokenLM):
    """Llama 2 as pure functions over a dict pytree of params.

    ``apply`` runs the blocks in an unrolled Python loop over ``params["blocks"]``
    (no ``lax.scan``) so that the traced computation can be split into pipeline
    stages between blocks. ``embed``, ``block`` and ``head`` are the pieces
    ``apply`` is made of.
    """

    def __init__(self, config: LlamaConfig) -> None:
        self.config = config

    def __repr__(self) -> str:
        return f"Llama({self.config!r})"

    @property
    def dtype(self) -> jnp.dtype:
        """Compute dtype."""
        return jnp.dtype(self.config.dtype)

    @property
    def param_dtype(self) -> jnp.dtype:
        """Storage dtype of the parameters."""
        return jnp.dtype(self.config.param_dtype)

    def init(self, key: jax.Array) -> Params:
        """Random params in ``param_dtype``: normal(0.02) weights, output projections (``wo``,
        ``w_down``) normal(0.02 / sqrt(2 * layers)), unit RMSNorm scales."""
        c, pdt = self.config, self.param_dtype
        h, hd = c.hidden, c.head_dim
        out_std = _INIT_STD / math.sqrt(2.0 * c.layers)

        def normal(k: jax.Array, shape: tuple[int, ...], std: float) -> jax.Array:
            return (std * jax.random.normal(k, shape, jnp.float32)).astype(pdt)

        def norm() -> Params:
            return {"scale": jnp.ones((h,), pdt)}

        k_embed, k_head, *k_blocks = jax.random.split(key, 2 + c.layers)
        blocks = []
        for kb in k_blocks:
            kq, kk, kv, ko, kg, ku, kd = jax.random.split(kb, 7)
            blocks.append({
                "attn_norm": norm(),
                "attn": {
                    "wq": normal(kq, (h, c.heads * hd), _INIT_STD),
                    "wk": normal(kk, (h, c.kv_heads * hd), _INIT_STD),
                    "wv": normal(kv, (h, c.kv_heads * hd), _INIT_STD),
                    "wo": normal(ko, (c.heads * hd, h), out_std),
                },
                "mlp_norm": norm(),
                "mlp": {
                    "w_gate": normal(kg, (h, c.ffn), _INIT_STD),
                    "w_up": normal(ku, (h, c.ffn), _INIT_STD),
                    "w_down": normal(kd, (c.ffn, h), out_std),
                },
            })
        return {
            "embed": normal(k_embed, (c.vocab, h), _INIT_STD),
            "blocks": blocks,
            "norm": norm(),
            "lm_head": normal(k_head, (h, c.vocab), _INIT_STD),
        }

    def init_abstract(self) -> Params:
        """The params of :meth:`init` as ``jax.ShapeDtypeStruct`` leaves."""
        return jax.eval_shape(self.init, jax.random.key(0))

    def embed(self, params: Params, tokens: jax.Array) -> jax.Array:
        """Token embedding: int ``(B, s)`` -> ``(B, s, h)`` in the compute dtype."""
        return params["embed"][tokens].astype(self.dtype)

    def block(self, p: Params, x: jax.Array) -> jax.Array:
        """One pre-RMSNorm Llama block: ``(B, s, h)`` -> ``(B, s, h)`` in the compute dtype."""
        c, dt = self.config, self.dtype
        b, s, _ = x.shape
        nh, nkv, hd = c.heads, c.kv_heads, c.head_dim
        x = x.astype(dt)

        a = {name: w.astype(dt) for name, w in p["attn"].items()}
        y = _rms_norm(p["attn_norm"], x, c.norm_eps)
        q = (y @ a["wq"]).reshape(b, s, nh, hd)
        k = (y @ a["wk"]).reshape(b, s, nkv, hd)
        v = (y @ a["wv"]).reshape(b, s, nkv, hd)
        cos, sin = _rope_tables(s, hd, c.rope_theta)
        q, k = _apply_rope(q, cos, sin), _apply_rope(k, cos, sin)
        # Causal GQA, scale 1/sqrt(hd); scores and softmax in float32.
        ctx = jax.nn.dot_product_attention(q, k, v, is_causal=True).reshape(b, s, nh * hd)
        x = x + ctx @ a["wo"]

        m = {name: w.astype(dt) for name, w in p["mlp"].items()}
        y = _rms_norm(p["mlp_norm"], x, c.norm_eps)
        y = jax.nn.silu(y @ m["w_gate"]) * (y @ m["w_up"])
        return x + y @ m["w_down"]

    def head(self, params: Params, x: jax.Array) -> jax.Array:
        """Final RMSNorm and the untied ``lm_head``: ``(B, s, h)`` -> float32 ``(B, s, V)`` logits."""
        y = _rms_norm(params["norm"], x, self.config.norm_eps)
        w = params["lm_head"].astype(self.dtype)
        return jnp.einsum("bsh,hv->bsv", y, w, preferred_element_type=jnp.float32)

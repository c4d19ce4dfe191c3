"""A plain-JAX GPT matching Megatron-LM's architecture.

Learned position embeddings, pre-LayerNorm blocks (causal multi-head
self-attention with a fused qkv projection, then a 4h GELU MLP), a final
LayerNorm, and logits tied to the input embedding (``x @ wte.T``).

The attention core is ``jax.nn.dot_product_attention(q, k, v, is_causal=True)``
on ``(B, s, heads, head_dim)`` arrays: softmax(q k^T / sqrt(head_dim)) v with a
causal mask, scores and softmax in float32. With the default implementation
(XLA, on every backend) it traces to two einsums (``dot_general``), a mask and a
softmax, so each block's jaxpr still holds exactly two attention matmuls.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp

from autopp.models._lm import Params, TokenLM

_DTYPES = ("float32", "bfloat16", "float16")
_LN_EPS = 1e-5
_INIT_STD = 0.02


@dataclasses.dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """Shape of a :class:`GPT`."""

    layers: int
    """Number of transformer blocks (l)."""

    hidden: int
    """Model width (h); must be divisible by ``heads``."""

    heads: int
    """Number of attention heads; head dim is ``hidden // heads``."""

    seq: int
    """Sequence length (s); also the number of learned position embeddings."""

    vocab: int
    """Vocabulary size (V)."""

    dtype: str = "float32"
    """Activation and matmul dtype: one of "float32", "bfloat16", "float16".
    LayerNorm statistics, attention softmax and logits are computed in float32."""

    param_dtype: str | None = None
    """Storage dtype of the parameters (same names); None: ``dtype``. With ``param_dtype="float32"`` and
    ``dtype="bfloat16"`` the model trains in mixed precision as users write it: float32 master weights, cast to
    bfloat16 where each layer uses them."""

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "heads", "seq", "vocab"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(
                    f"GPTConfig.{name} must be an int, got {name}={value!r}; pass an integer."
                )
            if value <= 0:
                raise ValueError(
                    f"GPTConfig.{name} must be positive, got {name}={value}; use a value >= 1."
                )
        if self.hidden % self.heads != 0:
            raise ValueError(
                f"GPTConfig.hidden must be divisible by heads, got hidden={self.hidden}, "
                f"heads={self.heads}; choose hidden as a multiple of heads "
                f"(e.g. hidden={self.heads * max(1, round(self.hidden / self.heads))})."
            )
        if self.dtype not in _DTYPES:
            raise ValueError(
                f"GPTConfig.dtype must be one of {_DTYPES}, got dtype={self.dtype!r}; "
                "pass one of those names."
            )
        if self.param_dtype is not None and self.param_dtype not in _DTYPES:
            raise ValueError(
                f"GPTConfig.param_dtype must be None or one of {_DTYPES}, got param_dtype={self.param_dtype!r}; "
                "pass one of those names."
            )

    @property
    def head_dim(self) -> int:
        """``hidden // heads``."""
        return self.hidden // self.heads

    @property
    def num_params(self) -> int:
        """Exact number of parameters :meth:`GPT.init` creates."""
        h, l = self.hidden, self.layers
        per_block = (
            2 * h  # ln1
            + h * 3 * h + 3 * h  # qkv
            + h * h + h  # attention output projection
            + 2 * h  # ln2
            + h * 4 * h + 4 * h  # fc
            + 4 * h * h + h  # proj
        )
        return self.vocab * h + self.seq * h + l * per_block + 2 * h

    def flops_per_step(self, batch_size: int, recompute: bool = False) -> float:
        """Model FLOPs of one training step (forward + backward) on ``batch_size``
        sequences, per Narayanan et al. 2021 (arXiv 2104.04473, eq. 3).

        Without recomputation: ``72 B s l h^2 (1 + s/(6h) + V/(12 l h))``; with full
        activation recomputation (an extra forward pass through the blocks):
        ``96 B s l h^2 (1 + s/(6h) + V/(16 l h))``.
        """
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size <= 0:
            raise ValueError(
                f"batch_size must be a positive int, got batch_size={batch_size!r}; pass B >= 1."
            )
        b, s, l, h, v = batch_size, self.seq, self.layers, self.hidden, self.vocab
        if recompute:
            return 96.0 * b * s * l * h * h * (1.0 + s / (6.0 * h) + v / (16.0 * l * h))
        return 72.0 * b * s * l * h * h * (1.0 + s / (6.0 * h) + v / (12.0 * l * h))

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly dict; ``GPTConfig(**cfg.to_dict()) == cfg``."""
        return dataclasses.asdict(self)

    def abstract_step(self, batch_size: int = 1, optimizer=None):
        """The zoo's training step for this model (``autopp.value_and_grad`` of the loss, then ``optimizer``,
        default AdamW) and its arguments as ``jax.ShapeDtypeStruct``s at ``batch_size`` sequences:
        ``(step, (params, opt_state, batch), batch_argnums)``, what the planner traces."""
        from autopp.models._train import abstract_training_step

        return abstract_training_step(GPT(self), batch_size, optimizer)


def _layer_norm(p: Params, x: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
    y = (x32 - mean) * jax.lax.rsqrt(var + _LN_EPS)
    y = y * p["scale"].astype(jnp.float32) + p["bias"].astype(jnp.float32)
    return y.astype(x.dtype)


class GPT(TokenLM):
    """Megatron-style GPT as pure functions over a dict pytree of params.

    ``apply`` runs the blocks in an unrolled Python loop (no ``lax.scan``) so that
    the traced computation can be split into pipeline stages between blocks.
    ``embed``, ``block`` and ``head`` are the pieces ``apply`` is made of.
    """

    def __init__(self, config: GPTConfig) -> None:
        self.config = config

    def __repr__(self) -> str:
        return f"GPT({self.config!r})"

    @property
    def dtype(self) -> jnp.dtype:
        return jnp.dtype(self.config.dtype)

    @property
    def param_dtype(self) -> jnp.dtype:
        return jnp.dtype(self.config.param_dtype or self.config.dtype)

    def _cast(self, tree):
        """Parameters in the compute dtype (a no-op unless ``param_dtype`` differs)."""
        dt = self.dtype
        return jax.tree.map(lambda w: w.astype(dt) if w.dtype != dt else w, tree)

    def init(self, key: jax.Array) -> Params:
        """Random params: normal(0.02) weights, output projections (``out_w``,
        ``proj_w``) normal(0.02 / sqrt(2 * layers)), zero biases, unit LN scales."""
        c, dt = self.config, self.param_dtype
        h = c.hidden
        out_std = _INIT_STD / math.sqrt(2.0 * c.layers)

        def normal(k: jax.Array, shape: tuple[int, ...], std: float) -> jax.Array:
            return (std * jax.random.normal(k, shape, jnp.float32)).astype(dt)

        def ln() -> Params:
            return {"scale": jnp.ones((h,), dt), "bias": jnp.zeros((h,), dt)}

        k_wte, k_wpe, *k_blocks = jax.random.split(key, 2 + c.layers)
        blocks = []
        for kb in k_blocks:
            k_qkv, k_out, k_fc, k_proj = jax.random.split(kb, 4)
            blocks.append({
                "ln1": ln(),
                "attn": {
                    "qkv_w": normal(k_qkv, (h, 3 * h), _INIT_STD),
                    "qkv_b": jnp.zeros((3 * h,), dt),
                    "out_w": normal(k_out, (h, h), out_std),
                    "out_b": jnp.zeros((h,), dt),
                },
                "ln2": ln(),
                "mlp": {
                    "fc_w": normal(k_fc, (h, 4 * h), _INIT_STD),
                    "fc_b": jnp.zeros((4 * h,), dt),
                    "proj_w": normal(k_proj, (4 * h, h), out_std),
                    "proj_b": jnp.zeros((h,), dt),
                },
            })
        return {
            "wte": normal(k_wte, (c.vocab, h), _INIT_STD),
            "wpe": normal(k_wpe, (c.seq, h), _INIT_STD),
            "blocks": blocks,
            "ln_f": ln(),
        }

    def init_abstract(self) -> Params:
        """The params of :meth:`init` as ``jax.ShapeDtypeStruct`` leaves."""
        return jax.eval_shape(self.init, jax.random.key(0))

    def embed(self, params: Params, tokens: jax.Array) -> jax.Array:
        """Token + position embedding: int ``(B, s)`` -> ``(B, s, h)``."""
        s = tokens.shape[-1]
        wte, wpe = self._cast((params["wte"], params["wpe"]))
        return wte[tokens] + wpe[:s]

    def block(self, p: Params, x: jax.Array) -> jax.Array:
        """One pre-LayerNorm transformer block: ``(B, s, h)`` -> ``(B, s, h)``."""
        c = self.config
        b, s, h = x.shape
        nh, hd = c.heads, c.head_dim
        p = self._cast(p)

        a = p["attn"]
        y = _layer_norm(p["ln1"], x)
        # The fused projection's columns are ordered head by head (q, k, v of head 0, then head 1, ...), as
        # Megatron-LM orders them: a contiguous split of the columns over a tensor-parallel group gives each
        # device whole heads.
        qkv = (y @ a["qkv_w"] + a["qkv_b"]).reshape(b, s, nh, 3, hd)
        q, k, v = qkv[:, :, :, 0], qkv[:, :, :, 1], qkv[:, :, :, 2]
        # Fused causal attention, scale 1/sqrt(hd); scores and softmax in float32.
        ctx = jax.nn.dot_product_attention(q, k, v, is_causal=True).reshape(b, s, h)
        x = x + ctx @ a["out_w"] + a["out_b"]

        m = p["mlp"]
        y = _layer_norm(p["ln2"], x)
        y = jax.nn.gelu(y @ m["fc_w"] + m["fc_b"], approximate=True)
        return x + y @ m["proj_w"] + m["proj_b"]

    def head(self, params: Params, x: jax.Array) -> jax.Array:
        """Final LayerNorm and tied-embedding logits: ``(B, s, h)`` -> float32 ``(B, s, V)``."""
        ln_f, wte = self._cast((params["ln_f"], params["wte"]))
        y = _layer_norm(ln_f, x)
        return jnp.einsum("bsh,vh->bsv", y, wte, preferred_element_type=jnp.float32)

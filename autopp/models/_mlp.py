"""A plain-JAX multilayer perceptron: params are a dict pytree of arrays."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

Params = dict[str, Any]
Batch = dict[str, jax.Array]


@dataclasses.dataclass(frozen=True, kw_only=True)
class MLPConfig:
    """Shape of an :class:`MLP`."""

    sizes: tuple[int, ...] = (64, 128, 128, 64, 8)
    """Layer widths: input dim, hidden dims..., output dim (at least 2 entries)."""

    def __post_init__(self) -> None:
        sizes = self.sizes
        if isinstance(sizes, (str, bytes)) or not hasattr(sizes, "__iter__"):
            raise TypeError(
                f"MLPConfig.sizes must be a sequence of ints, got {sizes!r}; "
                "pass e.g. sizes=(64, 128, 8)."
            )
        sizes = tuple(sizes)
        object.__setattr__(self, "sizes", sizes)
        if len(sizes) < 2:
            raise ValueError(
                f"MLPConfig.sizes must have at least 2 entries (input and output dim), "
                f"got sizes={sizes!r}; pass e.g. sizes=(64, 8)."
            )
        for i, n in enumerate(sizes):
            if isinstance(n, bool) or not isinstance(n, int):
                raise TypeError(
                    f"MLPConfig.sizes[{i}] must be an int, got {n!r}; "
                    "pass integer layer widths."
                )
            if n <= 0:
                raise ValueError(
                    f"MLPConfig.sizes[{i}] must be positive, got sizes={sizes!r}; "
                    "use layer widths >= 1."
                )

    @property
    def num_params(self) -> int:
        """Exact number of parameters :meth:`MLP.init` creates."""
        return sum(din * dout + dout for din, dout in zip(self.sizes[:-1], self.sizes[1:]))

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly dict; ``MLPConfig(**cfg.to_dict()) == cfg``."""
        return {"sizes": list(self.sizes)}


class MLP:
    """Dense layers with tanh between them (none after the last), MSE loss."""

    def __init__(self, config: MLPConfig | None = None) -> None:
        self.config = config if config is not None else MLPConfig()

    def __repr__(self) -> str:
        return f"MLP({self.config!r})"

    def init(self, key: jax.Array) -> Params:
        """``{"layers": [{"w": (din, dout), "b": (dout,)}, ...]}``, float32."""
        sizes = self.config.sizes
        keys = jax.random.split(key, len(sizes) - 1)
        layers = []
        for k, din, dout in zip(keys, sizes[:-1], sizes[1:]):
            w = jax.random.normal(k, (din, dout), jnp.float32) / jnp.sqrt(jnp.float32(din))
            layers.append({"w": w, "b": jnp.zeros((dout,), jnp.float32)})
        return {"layers": layers}

    def init_abstract(self) -> Params:
        """The params of :meth:`init` as ``jax.ShapeDtypeStruct`` leaves."""
        return jax.eval_shape(self.init, jax.random.key(0))

    def apply(self, params: Params, x: jax.Array) -> jax.Array:
        """``(B, din) -> (B, dout)``."""
        layers = params["layers"]
        for i, layer in enumerate(layers):
            x = x @ layer["w"] + layer["b"]
            if i < len(layers) - 1:
                x = jnp.tanh(x)
        return x

    def loss(self, params: Params, batch: Batch) -> jax.Array:
        """Mean squared error over all examples and outputs (a per-example mean,
        so the mean over equal-size microbatches equals the full-batch loss)."""
        pred = self.apply(params, batch["x"])
        return jnp.mean(jnp.square(pred - batch["y"]))

    def batch(self, key: jax.Array, batch_size: int) -> Batch:
        """Random ``{"x": (B, din), "y": (B, dout)}`` float32.

        ``y`` is a fixed smooth function of ``x`` (a random but fixed teacher), so
        training on a stream of these batches lowers the loss.
        """
        din, dout = self.config.sizes[0], self.config.sizes[-1]
        x = jax.random.normal(key, (batch_size, din), jnp.float32)
        teacher = jax.random.normal(jax.random.key(1234), (din, dout), jnp.float32)
        y = jnp.sin(x @ teacher / jnp.sqrt(jnp.float32(din)))
        return {"x": x, "y": y}

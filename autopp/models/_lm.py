"""What the zoo's token language models share: a stack of blocks between an embedding and a head, next-token
cross-entropy, random token batches."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

Params = dict[str, Any]
Batch = dict[str, jax.Array]


class TokenLM:
    """Mixin for a model with ``config`` (``seq``, ``vocab``), ``embed(params, tokens)``, ``block(p, x)`` per entry of
    ``params["blocks"]`` and ``head(params, x)`` returning float32 logits."""

    def apply(self, params: Params, tokens: jax.Array) -> jax.Array:
        """int ``(B, s)`` tokens -> float32 ``(B, s, V)`` logits."""
        x = self.embed(params, tokens)
        for block_params in params["blocks"]:
            x = self.block(block_params, x)
        return self.head(params, x)

    def loss(self, params: Params, batch: Batch) -> jax.Array:
        """Mean next-token cross-entropy over all ``B * s`` positions (log-softmax of the float32 logits)."""
        logits = self.apply(params, batch["tokens"])
        logp = jax.nn.log_softmax(logits, axis=-1)
        nll = -jnp.take_along_axis(logp, batch["targets"][..., None], axis=-1)[..., 0]
        return jnp.mean(nll)

    def batch(self, key: jax.Array, batch_size: int) -> Batch:
        """Random int32 ``{"tokens": (B, s), "targets": (B, s)}``; targets are the tokens shifted left by one,
        wrapping around (last target = first token)."""
        c = self.config
        tokens = jax.random.randint(key, (batch_size, c.seq), 0, c.vocab, dtype=jnp.int32)
        return {"tokens": tokens, "targets": jnp.roll(tokens, -1, axis=1)}

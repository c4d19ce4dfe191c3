"""The GPT case shared by test_baselines and test_metrics (one module, so that its cache is shared: the same
step function means JAX compiles its ``jax.jit`` once for both)."""

from __future__ import annotations

import functools

import jax

from autopp.models import GPT, GPTConfig
from tests._helpers import make_optimizer, make_step

CONFIG = GPTConfig(layers=2, hidden=32, heads=4, seq=16, vocab=64)


@functools.lru_cache(maxsize=None)
def jit_case(config: GPTConfig = CONFIG, batch_size: int = 8):
    """Like ``tests._helpers.model_case``, with the initialisation jitted (one program instead of one per eager
    operation); cached."""
    model, tx = GPT(config), make_optimizer()
    params = jax.jit(model.init)(jax.random.key(0))
    batch = jax.jit(model.batch, static_argnums=1)(jax.random.key(1), batch_size)
    return make_step(model, tx), (params, jax.jit(tx.init)(params)), batch

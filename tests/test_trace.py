"""Tracing helpers: inlining nested jit calls preserves the computation."""

import jax
import jax.numpy as jnp
import numpy as np

from autopp.core._trace import _inline_calls


def test_inline_calls_removes_nested_jit_and_keeps_values():
    @jax.jit
    def inner(x, w):
        return jnp.tanh(x @ w)

    def f(x, w):
        return jax.jit(lambda y: inner(y, w) * 2.0)(x).sum()

    x, w = jnp.arange(12.0).reshape(3, 4) / 10, jnp.ones((4, 2)) / 3
    closed = jax.make_jaxpr(f)(x, w)
    assert any(e.primitive.name in ("jit", "pjit") for e in closed.jaxpr.eqns)
    flat = _inline_calls(closed)
    assert not any(e.primitive.name in ("jit", "pjit") for e in flat.jaxpr.eqns)
    np.testing.assert_allclose(jax.core.eval_jaxpr(flat.jaxpr, flat.consts, x, w)[0], f(x, w), rtol=1e-6)

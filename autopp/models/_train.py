"""The standard training step the tests, demo, benchmarks and CLI share."""

from __future__ import annotations

from collections.abc import Callable

import optax


def make_train_step(loss_fn: Callable, tx: optax.GradientTransformation, *,
                    value_and_grad: Callable | None = None) -> Callable:
    """``train_step(params, opt_state, batch) -> (params, opt_state, loss)``: the gradient of ``loss_fn``
    with ``autopp.value_and_grad`` (or the given ``value_and_grad``, e.g. ``jax.value_and_grad`` for a
    plain-JAX reference), then the optax update."""
    if value_and_grad is None:
        from autopp import value_and_grad

    def train_step(params, opt_state, batch):
        loss, grads = value_and_grad(loss_fn)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return train_step

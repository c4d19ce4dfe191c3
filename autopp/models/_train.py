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


def abstract_training_step(model, batch_size: int, optimizer: optax.GradientTransformation | None = None):
    """``(step, (params, opt_state, batch), batch_argnums)`` for a zoo model: :func:`make_train_step` of its loss with
    ``optimizer`` (default AdamW), arguments as ``jax.ShapeDtypeStruct``s (nothing allocated)."""
    import jax

    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"abstract_step: batch_size must be a positive int, got {batch_size!r}.")
    tx = optimizer if optimizer is not None else optax.adamw(1e-4)
    params = model.init_abstract()
    opt_state = jax.eval_shape(tx.init, params)
    batch = jax.eval_shape(lambda: model.batch(jax.random.key(0), batch_size))
    return make_train_step(model.loss, tx), (params, opt_state, batch), (2,)

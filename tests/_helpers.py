"""Shared pieces of the tests: zoo steps and comparison against plain jax.jit."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

from autopp.models import GPT, MLP, GPTConfig, MLPConfig, make_train_step

# Adam's update g / (|g| + eps) turns fp32 summation-order noise in gradient components that are exactly
# zero in exact arithmetic (e.g. the key bias: softmax ignores a constant shift) into O(lr) parameter
# changes. eps = 1e-4 bounds |d update / d g| by 1/eps, so the comparison below tests the pipeline, not
# Adam's conditioning.
def make_optimizer():
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3, eps=1e-4))


def tiny_gpt() -> GPT:
    return GPT(GPTConfig(layers=4, hidden=32, heads=4, seq=16, vocab=64))


class ScannedGPT(GPT):
    """The zoo GPT with its blocks' parameters stacked along a leading layer axis and the blocks run by
    ``lax.scan``: the way many JAX models are written."""

    def init(self, key):
        params = super().init(key)
        params["blocks"] = jax.tree.map(lambda *xs: jnp.stack(xs), *params["blocks"])
        return params

    def apply(self, params, tokens):
        x = self.embed(params, tokens)
        x, _ = jax.lax.scan(lambda h, block_params: (self.block(block_params, h), None), x, params["blocks"])
        return self.head(params, x)


def tiny_scanned_gpt() -> ScannedGPT:
    return ScannedGPT(GPTConfig(layers=8, hidden=32, heads=4, seq=16, vocab=64))


def tiny_mlp() -> MLP:
    return MLP(MLPConfig(sizes=(16, 32, 32, 32, 32, 32, 32, 32, 8)))


def make_step(model, tx):
    return make_train_step(model.loss, tx)


def model_case(factory, batch_size):
    """A zoo model's training step (``make_optimizer``), its state (parameters, optimizer state) and a batch."""
    model, tx = factory(), make_optimizer()
    params = model.init(jax.random.key(0))
    return make_step(model, tx), (params, tx.init(params)), model.batch(jax.random.key(1), batch_size)


def gpt_case(batch_size=8):
    """The tiny GPT's training step, its state and a batch."""
    return model_case(tiny_gpt, batch_size)


def with_jit_reference(step, state, batch):
    """``(step, state, batch, result of 3 steps of plain jax.jit)``: what the pipelined step must equal."""
    return step, state, batch, run_steps(jax.jit(step), state, batch)[0]


def run_steps(step, state, batch, n=3):
    losses = []
    for _ in range(n):
        *state, loss = step(*state, batch)
        losses.append(loss)
    return tuple(state), losses


def assert_trees_close(actual, expected, rtol=1e-5, atol=1e-7):
    """Leaf-by-leaf allclose; the message names the failing pytree paths."""
    la, ta = jax.tree_util.tree_flatten_with_path(actual)
    le, te = jax.tree_util.tree_flatten_with_path(expected)
    assert ta == te, f"tree structures differ:\n{ta}\n{te}"
    failures = []
    for (path, a), (_, e) in zip(la, le):
        a, e = np.asarray(a), np.asarray(e)
        assert a.shape == e.shape and a.dtype == e.dtype, (jax.tree_util.keystr(path), a.shape, e.shape)
        if not np.allclose(a, e, rtol=rtol, atol=atol):
            err = np.max(np.abs(a - e) - rtol * np.abs(e))
            failures.append(f"{jax.tree_util.keystr(path)}: max excess error {err:.3g}")
    assert not failures, "\n".join(failures)


def scan_accumulation_step(model, tx, num_microbatches: int):
    """Plain-JAX gradient accumulation: the batch as microbatches under lax.scan, one jitted program."""

    def train_step(params, opt_state, batch):
        mbs = jax.tree.map(lambda x: x.reshape((num_microbatches, -1) + x.shape[1:]), batch)

        def body(carry, mb):
            loss_sum, grad_sum = carry
            loss, grads = jax.value_and_grad(model.loss)(params, mb)
            return (loss_sum + loss, jax.tree.map(jnp.add, grad_sum, grads)), None

        zeros = jax.tree.map(jnp.zeros_like, params)
        (loss, grads), _ = jax.lax.scan(body, (jnp.zeros((), jnp.float32), zeros), mbs)
        grads = jax.tree.map(lambda g: g / num_microbatches, grads)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss / num_microbatches

    return train_step


def microbatched_jit(model, tx, num_microbatches):
    """Plain ``jax.jit`` of the training step with the batch split into ``num_microbatches`` and the gradients
    accumulated under ``lax.scan`` (the benchmarks' baseline): the same split a pipelined step makes, written without
    autopp."""
    return jax.jit(scan_accumulation_step(model, tx, num_microbatches))


def assert_within_microbatch_noise(actual, expected, split, factor=2.0, atol=1e-7):
    """Leaf by leaf, ``|actual - expected| <= factor * |split - expected| + atol``: with Adam, rounding differences
    of near-zero gradients become lr-sized updates, so a pipelined step may differ from plain jit by what plain jit
    itself shows when it splits the batch into the same microbatches (``split``, e.g. from
    :func:`microbatched_jit`); twice that is allowed."""
    la, ta = jax.tree_util.tree_flatten_with_path(actual)
    le, te = jax.tree_util.tree_flatten_with_path(expected)
    ls, _ = jax.tree_util.tree_flatten(split)
    assert ta == te, f"tree structures differ:\n{ta}\n{te}"
    failures = []
    for (path, a), (_, e), m in zip(la, le, ls):
        a, e, m = np.asarray(a), np.asarray(e), np.asarray(m)
        excess = np.abs(a - e) - (factor * np.abs(m - e) + atol)
        if np.max(excess, initial=0) > 0:
            failures.append(f"{jax.tree_util.keystr(path)}: max excess error {np.max(excess):.3g}")
    assert not failures, "\n".join(failures)

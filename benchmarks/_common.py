"""Baselines and timing helpers shared by the benchmark suites."""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
import optax

from autopp.models import GPT, make_train_step


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


def train_step_fn(model, tx):
    return make_train_step(model.loss, tx)


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


def interleaved_medians(fns: dict, state: dict, batch, rounds: int) -> dict[str, float]:
    """Median wall time of one step of each function, alternating them round by round (noise hits all)."""
    times = {k: [] for k in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            t = time.perf_counter()
            out = fn(*state[name], batch)
            jax.block_until_ready(out)
            times[name].append(time.perf_counter() - t)
            state[name] = out[:-1]
    return {k: statistics.median(v) for k, v in times.items()}

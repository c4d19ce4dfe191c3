"""Residuals and gradient accumulators travel packed (:mod:`autopp.core._packing`): small ones concatenated per
dtype and layout, sliced back exactly; residuals a loop makes or reads stay buffers of their own."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.ad_checkpoint import checkpoint_name

import autopp
from autopp.core._packing import PACK_MAX_BYTES, plan_packing
from autopp.profiler._layer_stage import layer_graph, layer_stage_programs

from _helpers import assert_trees_close, run_steps


def test_small_values_pack_per_dtype_and_come_back_exactly():
    shapes_dtypes = [((4, 3), jnp.float32), ((5,), jnp.bfloat16), ((2, 2, 2), jnp.float32), ((), jnp.float32),
                     ((7,), jnp.int32), ((3,), jnp.bfloat16), ((PACK_MAX_BYTES // 4 + 1,), jnp.float32), ((6,), jnp.int32)]
    rng = np.random.default_rng(0)
    values = [jnp.asarray(rng.normal(size=s) * 100, d) for s, d in shapes_dtypes]
    avals = [jax.ShapeDtypeStruct(v.shape, v.dtype) for v in values]
    packing = plan_packing(avals, [None] * len(avals))
    # by hand: float32 {0, 2, 3}, bfloat16 {1, 5}, int32 {4, 7}; the one over PACK_MAX_BYTES alone
    assert sorted(packing.groups) == [(0, 2, 3), (1, 5), (4, 7)] and packing.loose == (6,)
    buffers = jax.jit(packing.pack)(values)
    assert len(buffers) == packing.num_buffers == 4
    assert [(b.shape, b.dtype) for b in buffers] == [(a.shape, a.dtype) for a in packing.buffer_avals()]
    for got, want in zip(jax.jit(packing.unpack)(buffers), values):
        assert got.shape == want.shape and got.dtype == want.dtype
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    # positions a caller keeps out of the packs stay loose; a group left with one member does too
    kept_out = plan_packing(avals, [None] * len(avals), keep_loose={0, 1})
    assert sorted(kept_out.groups) == [(2, 3), (4, 7)] and kept_out.loose == (0, 1, 5, 6)


def test_residuals_a_scan_makes_or_reads_travel_unpacked():
    """A stage with a ``lax.scan`` (3 iterations, a leading dimension no other value has) and a norm after it: the
    norm's small statistics are packed; every residual of the loop (per-iteration inputs and stacked outputs) is a
    buffer of its own, so the backward's loop reads it without a slice (a kernel) out of a pack. The stage's
    backward equals ``jax.vjp``."""
    num_iterations, batch, width = 3, 4, 8

    def f(stacked, scale, x):
        def body(h, w):
            return jnp.tanh(h @ w), None

        h, _ = jax.lax.scan(body, x, stacked)
        centred = h - h.mean(-1, keepdims=True)
        normed = centred * jax.lax.rsqrt((centred ** 2).mean(-1, keepdims=True) + 1e-6) * scale
        return (normed ** 2).sum()

    rng = np.random.default_rng(1)
    args = [jnp.asarray(rng.normal(size=s) * 0.5, jnp.float32)
            for s in ((num_iterations, width, width), (width,), (batch, width))]
    closed = jax.make_jaxpr(f)(*args)
    graph = layer_graph(closed, range(len(closed.jaxpr.eqns)), [True, True, True])
    position = [closed.jaxpr.invars.index(v) for v in graph.inputs]  # the stage reads its inputs in first-use order
    programs = layer_stage_programs(graph, is_param=[p < 2 for p in position])
    stage_args = [args[p] for p in position]

    packing = programs.packing
    packed = [packing.avals[i].shape for g in packing.groups for i in g]
    loose = [packing.avals[i].shape for i in packing.loose]
    assert len(packed) >= 2, "the norm's statistics should still be packed"
    assert not any(s and s[0] == num_iterations for s in packed), packed
    assert sum(1 for s in loose if s and s[0] == num_iterations) >= 2, loose

    # the stage's forward and backward against jax.vjp of f
    outs = programs.fwd(*stage_args)
    residuals = outs[len(graph.outputs):]
    forwarded = [stage_args[i] for i in programs.forwarded_inputs]
    acc = [jnp.zeros(a.shape, a.dtype) for a in programs.acc_packing.buffer_avals()]
    got = programs.bwd(*residuals, *forwarded, jnp.ones((), jnp.float32), *acc, jnp.asarray(True))
    by_position = dict(zip([p for p in position if p < 2], programs.acc_packing.unpack(got[:programs.num_acc])))
    by_position.update(zip([p for p in position if p >= 2], got[programs.num_acc:]))
    loss, vjp = jax.vjp(f, *args)
    np.testing.assert_allclose(float(outs[0]), float(loss), rtol=1e-6)
    for p, want in enumerate(vjp(jnp.ones_like(loss))):
        np.testing.assert_allclose(np.asarray(by_position[p]), np.asarray(want), rtol=1e-5, atol=1e-6)


def test_residuals_offloaded_to_host_by_a_checkpoint_policy_are_not_packed_with_device_ones():
    """``save_and_offload_only_these_names`` moves a named residual to host memory; packing it with device residuals
    failed to build a pipeline of two stages ("memory_space of all inputs passed to concatenate must be the same",
    a user trial). It travels loose, and the step equals jit."""
    policy = jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=["h"], names_which_can_be_offloaded=["g"], offload_src="device",
        offload_dst="pinned_host")

    @functools.partial(jax.checkpoint, policy=policy)
    def block(p, x):
        h = checkpoint_name(jnp.tanh(x @ p["a"]), "h")
        g = checkpoint_name(jnp.tanh(h @ p["b"]), "g")
        return x + jnp.tanh(g @ p["c"])

    def loss(params, batch):
        x = batch["x"]
        for p in params:
            x = block(p, x)
        return jnp.mean((x - batch["y"]) ** 2)

    tx = optax.sgd(0.1)

    def step(params, opt_state, batch):
        value, grads = autopp.value_and_grad(loss)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    keys = jax.random.split(jax.random.key(0), 12)
    params = [{n: 0.3 * jax.random.normal(keys[3 * i + j], (16, 16)) for j, n in enumerate("abc")} for i in range(4)]
    batch = {"x": jax.random.normal(keys[-1], (8, 16)), "y": jnp.zeros((8, 16))}
    state = (params, tx.init(params))
    pipelined = autopp.parallelize(step, num_stages=2, num_microbatches=4, devices=jax.devices()[:2])
    got, _ = run_steps(pipelined, state, batch)
    assert_trees_close(autopp.gather(got), run_steps(jax.jit(step), state, batch)[0], atol=1e-6)

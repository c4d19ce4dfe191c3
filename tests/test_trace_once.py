"""The first call of a parallelized step traces the user's step once, whichever source the plan comes from (the
counts given, a replayed plan, the planner): the profile reuses that trace, and the per-microbatch forward is
re-traced from the loss alone. Later calls with the same argument signature trace nothing; a new signature traces
once more."""

from __future__ import annotations

import dataclasses
import warnings

import jax
import numpy as np
import pytest

import autopp
from autopp.planner import plan_model
from autopp.profiler import Cluster, profile

from _helpers import assert_trees_close, model_case, run_steps, tiny_gpt, tiny_mlp


def _counted(step):
    calls = []

    def counted(*args):
        calls.append(1)
        return step(*args)

    return counted, calls


@pytest.mark.parametrize("source", ["counts", "planner", "replay-offline"])
def test_the_first_call_traces_the_step_once(source):
    factory = tiny_mlp if source != "replay-offline" else tiny_gpt
    step, state, batch = model_case(factory, 8)
    counted, calls = _counted(step)
    devices = jax.devices()[:2]
    if source == "counts":
        pipelined = autopp.parallelize(counted, num_stages=2, num_microbatches=2, devices=devices)
    elif source == "planner":
        pipelined = autopp.parallelize(counted, devices=devices)
    else:  # a plan made from a profile names its stages by layers: replaying it profiles the step (from the trace)
        cluster = Cluster.local(devices)
        plan = plan_model(profile(step, *state, batch, cluster=cluster), cluster, global_batch=8,
                          pipeline_degrees=(2,), time_limit_s=2)
        assert all(st.equations is None or st.layers is not None for st in plan.stages)
        plan = dataclasses.replace(plan, stages=tuple(dataclasses.replace(st, equations=None) for st in plan.stages))
        pipelined = autopp.parallelize(counted, plan=plan, devices=devices)
    assert pipelined.config.source == source.split("-")[0]
    got, _ = run_steps(pipelined, state, batch, n=2)
    assert len(calls) == 1, f"the step was traced {len(calls)} times on the first call (plan source {source})"
    assert_trees_close(got, run_steps(jax.jit(step), state, batch, n=2)[0], rtol=1e-5)
    half = jax.tree.map(lambda x: x[:4], batch)
    if source == "replay-offline":  # traced, then refused: the plan was made for a global batch of 8
        with pytest.raises(ValueError, match="global batch"):
            pipelined.plan_for(*state, half)
    else:
        pipelined.plan_for(*state, half)
    assert len(calls) == 2  # a new argument signature: one more trace


def test_a_batch_reduced_before_the_loss_re_traces_the_step():
    """When the loss reads a value computed from the batch outside it, the microbatch forward cannot be re-traced
    from the loss alone: the step is traced again at microbatch size (and the result still equals jit)."""
    step, state, batch = model_case(tiny_mlp, 8)

    def scaled(params, opt_state, b):
        b = jax.tree.map(lambda v: v * 1.0 if jax.numpy.issubdtype(v.dtype, jax.numpy.floating) else v, b)
        return step(params, opt_state, b)

    counted, calls = _counted(scaled)
    pipelined = autopp.parallelize(counted, num_stages=2, num_microbatches=2, devices=jax.devices()[:2])
    got, _ = run_steps(pipelined, state, batch, n=1)
    assert len(calls) == 2
    assert_trees_close(got, run_steps(jax.jit(scaled), state, batch, n=1)[0], rtol=1e-5)


def test_a_build_runs_no_full_garbage_collection_and_restores_the_thresholds(monkeypatch):
    """Tracing, slicing and lowering a step make enough objects to start full collections, each a walk over every
    object of the process; a build runs the young generations only and leaves the thresholds as it found them."""
    import gc

    import autopp._parallelize as parallelize_module

    step, state, batch = model_case(tiny_gpt, 8)
    building, full = [], []
    real_build = parallelize_module.Parallelized._build

    def build(self, args):
        building.append(1)
        try:
            return real_build(self, args)
        finally:
            building.clear()

    def note(phase, info):
        if phase == "start" and info["generation"] == 2 and building:
            full.append(1)

    monkeypatch.setattr(parallelize_module.Parallelized, "_build", build)
    before = gc.get_threshold()
    gc.set_threshold(50, 2, 2)  # would start full collections often
    gc.callbacks.append(note)
    try:
        autopp.parallelize(step, num_stages=2, num_microbatches=2, devices=jax.devices()[:2]).plan_for(*state, batch)
        assert gc.get_threshold() == (50, 2, 2)
    finally:
        gc.callbacks.remove(note)
        gc.set_threshold(*before)
    assert not full


# -- lax.scan bodies traced once and replayed per iteration -------------------------------------------------------
def _unrolled(fn, *args, replay):
    """``fn``'s jaxpr as autopp traces (``jax.disable_jit`` unrolls ``lax.scan``), with the scan bodies replayed or run
    by JAX's own unrolling (the reference: a Python loop over the iterations)."""
    import contextlib

    from autopp.core import _compat

    with (_compat.replaying_scans() if replay else contextlib.nullcontext()), jax.disable_jit():
        return jax.make_jaxpr(lambda *a: fn(*a))(*args)  # a new function each time: make_jaxpr caches by function


def _scan_cases():
    import jax.numpy as jnp
    from jax import lax

    def body_calls(counter, body):
        def counted(c, x):
            counter.append(1)
            return body(c, x)
        return counted

    w = jnp.ones((4, 4))

    def pytree(counter, outer, xs):  # dict carry, tuple xs, a closed-over tracer, ys a dict
        def body(c, x):
            h = jnp.tanh(c["h"] @ x[0] + outer) * x[1]
            return {"h": h, "n": c["n"] + 1}, {"h": h.sum(), "sq": h * h}
        return lax.scan(body_calls(counter, body), {"h": outer, "n": jnp.int32(0)}, xs)

    def reverse(counter, outer, xs):
        return lax.scan(body_calls(counter, lambda c, x: (c @ x[0], c.sum())), outer, xs, reverse=True)

    def no_xs(counter, outer, xs):
        return lax.scan(body_calls(counter, lambda c, _: (c * 2.0 + 1.0, None)), outer, None, length=5)

    def nested(counter, outer, xs):
        def body(c, x):
            inner, _ = lax.scan(lambda a, r: (a + r.sum(), None), c, x[0])
            return inner, inner.mean()
        return lax.scan(body_calls(counter, body), outer, xs)

    def weak_carry(counter, outer, xs):  # a Python float carry, strongly typed after the first iteration
        return lax.scan(body_calls(counter, lambda c, x: (c + x[1].sum(), c)), 0.0, xs)

    def keys(counter, outer, xs):
        ks = jax.random.split(jax.random.key(0), 3)
        return lax.scan(body_calls(counter, lambda c, k: (c + jax.random.normal(k, c.shape), None)), outer, ks)

    def fori_and_map(counter, outer, xs):
        y = lax.fori_loop(0, 3, lambda i, c: c @ w + i, outer)
        return lax.map(lambda x: x[0] @ y, xs)

    xs = (jnp.arange(48.0).reshape(3, 4, 4) / 48, jnp.ones((3, 4, 4)))
    return {"pytree": (pytree, 1), "reverse": (reverse, 1), "no_xs": (no_xs, 1), "nested": (nested, 1),
            "weak_carry": (weak_carry, 2), "keys": (keys, 1), "fori_and_map": (fori_and_map, None)}, xs


@pytest.mark.parametrize("case", ["pytree", "reverse", "no_xs", "nested", "weak_carry", "keys", "fori_and_map"])
def test_a_scan_body_traces_once_per_carry_type_into_the_same_jaxpr_as_jax_s_unrolling(case):
    """A ``lax.scan`` in a traced step is unrolled (so that the pipeline can cut between iterations); its body is
    traced once per carry type and replayed per iteration (``_compat.replaying_scans``), giving equation for
    equation the jaxpr JAX's own unrolling gives by running the body once per iteration."""
    import jax.numpy as jnp

    cases, xs = _scan_cases()
    fn, traces = cases[case]
    outer = jnp.full((4, 4), 0.5, jnp.float32)  # (a strongly typed carry: one trace)
    reference_calls, calls = [], []
    reference = _unrolled(lambda o, x: fn(reference_calls, o, x), outer, xs, replay=False)
    replayed = _unrolled(lambda o, x: fn(calls, o, x), outer, xs, replay=True)
    assert str(replayed) == str(reference)
    assert not any(e.primitive.name in ("scan", "while") for e in replayed.jaxpr.eqns)
    if traces is not None:
        assert len(reference_calls) == (5 if case == "no_xs" else 3)
        assert len(calls) == traces
    assert jax.lax.scan.__module__ == "jax._src.lax.control_flow.loops" and jax.lax.scan.__name__ == "scan"
    got = jax.core.eval_jaxpr(replayed.jaxpr, replayed.consts, outer, *xs)
    want = jax.jit(lambda o, x: fn([], o, x))(outer, xs)
    assert_trees_close(got, jax.tree.leaves(want), rtol=1e-6)


def test_a_scan_with_a_concrete_counter_or_a_python_branch_runs_jax_s_unrolling():
    """Where JAX's unrolling gives the body concrete values the replay would trace (a Python int counter, which may
    pick per-layer Python values; a body that branches in Python on its carry), ``lax.scan`` runs JAX's own, as
    before the replay."""
    import jax.numpy as jnp

    scales = [1.0, 2.0, 3.0, 4.0]

    def counter(x):  # a Python int carry picking a per-layer Python constant
        return jax.lax.scan(lambda c, r: ((c[0] * scales[c[1]] + r, c[1] + 1), None), (x, 0), jnp.ones((4, 3)))[0][0]

    def branch(x):  # a concrete float carry, tested in Python
        return jax.lax.scan(lambda c, r: ((c[0] + r if c[1] > 0 else c[0] - r, c[1]), None), (x, 1.0),
                            jnp.ones((4, 3)))[0][0]

    x = jnp.zeros(3, jnp.float32)
    for fn in (counter, branch):
        replayed = _unrolled(fn, x, replay=True)
        assert str(replayed) == str(_unrolled(fn, x, replay=False))
        got = jax.core.eval_jaxpr(replayed.jaxpr, replayed.consts, x)[0]
        np.testing.assert_allclose(got, np.full(3, 41.0 if fn is counter else 4.0))  # ((1 * 2 + 1) * 3 + 1) * 4 + 1


def test_flax_nn_scan_with_dropout_draws_each_layer_s_randomness_as_jit_does():
    """Flax Linen's ``nn.scan`` folds a per-layer count into its random keys, counted in Python each time the body
    runs. JAX's own unrolling ran the body once per layer and so counted differently from ``lax.scan`` under jit (a
    user trial measured 0.70 relative error in the parameters after 3 SGD steps with dropout); the body traced once
    and replayed draws what jit draws, and the pipelined step equals microbatched jit."""
    import flax.linen as nn
    import jax.numpy as jnp
    import optax

    hidden, layers, batch_size, num_microbatches = 16, 4, 8, 4

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x, _):
            return x + nn.Dropout(0.2, deterministic=False)(nn.gelu(nn.Dense(hidden)(x))), None

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            scanned = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True, "dropout": True},
                              length=layers)
            return nn.Dense(hidden)(scanned(name="layers")(x, None)[0])

    net = Net()
    x = jax.random.normal(jax.random.key(1), (batch_size, hidden))
    y = jax.random.normal(jax.random.key(2), (batch_size, hidden))
    params = net.init({"params": jax.random.key(0), "dropout": jax.random.key(0)}, x)
    tx = optax.sgd(0.1)

    def loss(p, key, b):
        return jnp.mean((net.apply(p, b["x"], rngs={"dropout": key}) - b["y"]) ** 2)

    def step(p, s, key, b):
        v, g = autopp.value_and_grad(loss)(p, key, b)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s, v

    def reference(p, s, key, b):  # the same step, the batch split into the same microbatches
        parts = [jax.tree.map(lambda a: a.reshape((num_microbatches, -1) + a.shape[1:])[i], b)
                 for i in range(num_microbatches)]
        outs = [jax.value_and_grad(loss)(p, key, part) for part in parts]
        g = jax.tree.map(lambda *gs: sum(gs) / num_microbatches, *[o[1] for o in outs])
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s, sum(o[0] for o in outs) / num_microbatches

    pipelined = autopp.parallelize(step, num_stages=2, num_microbatches=num_microbatches, devices=jax.devices()[:2])
    got = want = (params, tx.init(params))
    for i in range(3):
        key = jax.random.key(10 + i)
        with warnings.catch_warnings(record=True) as seen:  # every microbatch draws its dropout from the same key
            warnings.simplefilter("always")
            *got, _ = pipelined(*got, key, {"x": x, "y": y})
        assert i or any("draws random numbers for its examples from a key" in str(w.message) for w in seen)
        *want, _ = jax.jit(reference)(*want, key, {"x": x, "y": y})
    assert_trees_close(tuple(got), tuple(want), rtol=1e-6, atol=1e-6)


def test_a_value_that_escapes_a_scan_body_is_refused_naming_the_fix():
    """A loss that appends a value computed in a ``lax.scan`` body to a Python list (jax.jit refuses it with
    ``UnexpectedTracerError``) gets a ValueError saying to return it through the body's outputs or carry."""
    import jax.numpy as jnp
    import optax

    def loss(w, b):
        aux = []

        def body(h, wi):
            h = jnp.tanh(h @ wi)
            aux.append(jnp.mean(h ** 2))
            return h, None

        h, _ = jax.lax.scan(body, b, w)
        return jnp.mean(h ** 2) + 0.01 * sum(aux)

    tx = optax.sgd(0.1)

    def step(w, s, b):
        v, g = autopp.value_and_grad(loss)(w, b)
        u, s = tx.update(g, s, w)
        return optax.apply_updates(w, u), s, v

    w = jax.random.normal(jax.random.key(0), (4, 8, 8)) * 0.3
    pipelined = autopp.parallelize(step, num_stages=2, num_microbatches=2, devices=jax.devices()[:2])
    with pytest.raises(ValueError, match="escaped the body.*return the value as part of the body's output"):
        pipelined(w, tx.init(w), jax.random.normal(jax.random.key(1), (8, 8)))

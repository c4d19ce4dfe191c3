"""The first call of a parallelized step traces the user's step once, whichever source the plan comes from (the
counts given, a replayed plan, the planner): the profile reuses that trace, and the per-microbatch forward is
re-traced from the loss alone. Later calls with the same argument signature trace nothing; a new signature traces
once more."""

from __future__ import annotations

import dataclasses

import jax
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

"""autopp.parallelize without num_stages / num_microbatches / schedule: profile, plan (plan_local), run."""

import functools
import itertools
import random

import jax
import numpy as np
import pytest

import autopp
from autopp import Plan
from autopp.models import MLP, MLPConfig
from autopp.planner import _local
from autopp.planner._local import LayerCosts, evaluate, legal_layouts, plan_layers, stage_memory, uniform_split
from autopp.profiler._cluster import Cluster
from tests._helpers import assert_trees_close, make_optimizer, make_step, model_case, run_steps, tiny_gpt, tiny_mlp

MODELS = {"mlp": (tiny_mlp, 16), "gpt": (tiny_gpt, 8)}


@functools.lru_cache(maxsize=None)
def _setup(name):  # the profile cache lives in the temporary directory tests/conftest.py sets up
    step, state, batch = model_case(*MODELS[name])
    return step, state, batch, run_steps(jax.jit(step), state, batch)


@functools.lru_cache(maxsize=None)
def _auto(name, num_devices):
    step, state, batch, _ = _setup(name)
    pstep = autopp.parallelize(step, devices=jax.devices()[:num_devices])
    return pstep, pstep.plan_for(*state, batch)


@functools.lru_cache(maxsize=None)
def _auto_four_stages():
    """The automatic path with the planner held to 4 stages (left alone it picks one data-parallel stage for
    these tiny models), so that the layer -> equation mapping and the pipeline run are exercised."""
    step, state, batch, _ = _setup("gpt")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("autopp._parallelize.plan_local", functools.partial(_local.plan_local, num_stages=4))
        pstep = autopp.parallelize(step, devices=jax.devices())
        plan = pstep.plan_for(*state, batch)
    return pstep, plan


def _check_plan(plan, num_devices, batch_size, num_layers):
    assert plan.planner is not None and plan.predicted is not None
    assert plan.predicted.fits and plan.predicted.step_time_s > 0
    assert plan.predicted.step_time_s <= plan.planner.best_uniform_step_time_s * (1 + 1e-9)
    assert plan.planner.candidates >= 2 and plan.planner.wall_time_s > 0
    per = len(plan.stages[0].devices)
    assert per * plan.num_stages == num_devices
    assert plan.microbatch_size * plan.num_microbatches * per == batch_size
    layers = [st.layers for st in plan.stages]
    assert layers[0][0] == 0 and layers[-1][1] == num_layers - 1
    assert all(a[1] + 1 == b[0] for a, b in zip(layers, layers[1:]))
    assert all(st.recompute == "none" for st in plan.stages)


@pytest.mark.parametrize("num_devices", [pytest.param(8, marks=pytest.mark.slow), 4])  # 8: same paths, 2x longer
@pytest.mark.parametrize("name", ["gpt", "mlp"])
def test_auto_plan_trains_like_jit(name, num_devices):
    step, state, batch, (want_state, want_losses) = _setup(name)
    pstep, plan = _auto(name, num_devices)
    assert pstep.num_stages is None  # chosen per argument shape: the plan says what
    num_layers = {"gpt": 6, "mlp": 8}[name]
    _check_plan(plan, num_devices, batch["x" if name == "mlp" else "tokens"].shape[0], num_layers)
    got_state, got_losses = run_steps(pstep, state, batch)
    assert_trees_close(got_losses, want_losses)
    assert_trees_close(got_state, want_state)


def test_auto_plan_with_pipeline_stages_trains_like_jit():
    step, state, batch, (want_state, want_losses) = _setup("gpt")
    pstep, plan = _auto_four_stages()
    assert plan.num_stages == 4 and all(len(st.devices) == 2 for st in plan.stages)
    _check_plan(plan, 8, 8, 6)
    assert plan.schedule in ("1f1b", "gpipe")
    got_state, got_losses = run_steps(pstep, state, batch)
    assert_trees_close(got_losses, want_losses)
    assert_trees_close(got_state, want_state)


@pytest.mark.parametrize("which", ["one stage", "four stages"])
def test_auto_plan_round_trips_and_replays_bit_identically(which, tmp_path):
    step, state, batch, _ = _setup("gpt")
    pstep, plan = _auto("gpt", 8) if which == "one stage" else _auto_four_stages()
    path = tmp_path / "plan.json"
    plan.to_json(path)
    again = Plan.from_json(path)
    assert again == plan and again.to_json() == plan.to_json()
    replay = autopp.parallelize(step, plan=str(path))
    assert replay.plan_for(*state, batch) == plan
    got, _ = run_steps(replay, state, batch)
    want, _ = run_steps(pstep, state, batch)
    jax.tree.map(np.testing.assert_array_equal, got, want)


# -- plan_local against brute force over the same cost model ----------------------------------------------------

def _random_costs(rng, num_layers, cuttable=None):
    # Times are whole multiples of CP-SAT's 1e-7 s unit, so its integer model and the float brute force agree
    # exactly on which splits tie.
    return LayerCosts(
        forward_s=tuple(rng.randint(1, 40) * 1e-5 for _ in range(num_layers)),
        backward_s=tuple(rng.randint(1, 80) * 1e-5 for _ in range(num_layers)),
        param_bytes=tuple(rng.randint(1, 50) * 4096 for _ in range(num_layers)),
        grad_bytes=tuple(rng.randint(1, 50) * 4096 for _ in range(num_layers)),
        optimizer_bytes=tuple(rng.randint(1, 100) * 4096 for _ in range(num_layers)),
        activation_bytes=tuple(rng.randint(1, 400) * 65536 for _ in range(num_layers)),
        cut_bytes=tuple(rng.randint(1, 8) * 65536 for _ in range(num_layers - 1)),
        cuttable=tuple(cuttable or (True,) * (num_layers - 1)),
        step_flops=1e9, model_flops=9e8)


def _brute_force(costs, cluster, batch_size):
    """Every legal layout, every contiguous split: the fastest-bottleneck split (fewest cut bytes, then the
    lexicographically first) or the equal split when faster; the fastest layout, ties to the earlier one."""
    cap = cluster.device.memory_capacity
    allowed = [l for l in range(1, costs.num_layers) if costs.cuttable[l - 1]]
    best = None
    for layout in legal_layouts(costs, cluster.num_devices, batch_size):
        S = layout.num_stages
        fitting = []
        for cuts in itertools.combinations(allowed, S - 1):
            starts = (0,) + cuts
            if max(stage_memory(costs, layout, starts)) <= cap:
                fitting.append((evaluate(costs, cluster, layout, starts), starts))
        chosen = None
        if fitting:
            fastest = min(e.bottleneck_s for e, _ in fitting)
            ties = [(e.cut_bytes, starts, e) for e, starts in fitting if e.bottleneck_s <= fastest * (1 + 1e-9)]
            _, starts, e = min(ties, key=lambda t: (t[0], t[1]))
            chosen = (e.estimate.step_time_s, starts)
        uni = uniform_split(costs, S)
        if max(stage_memory(costs, layout, uni)) <= cap:
            t = evaluate(costs, cluster, layout, uni).estimate.step_time_s
            if chosen is None or t < chosen[0] * (1 - 1e-9):
                chosen = (t, uni)
        if chosen and (best is None or chosen[0] < best[0] * (1 - 1e-9)):
            best = (chosen[0], layout, chosen[1])
    return best


CASES = [  # (seed, layers, devices, batch, memory capacity in bytes or None, cuttable)
    (0, 6, 8, 16, None, None),
    (1, 7, 4, 8, None, None),
    (2, 5, 8, 32, None, (True, False, True, True)),
    (3, 6, 4, 16, 12e6, None),  # memory binds: some layouts and splits do not fit
    (4, 8, 8, 8, 10e6, None),
]


@pytest.mark.parametrize("seed,num_layers,num_devices,batch_size,capacity,cuttable", CASES)
def test_plan_local_equals_brute_force(seed, num_layers, num_devices, batch_size, capacity, cuttable):
    rng = random.Random(seed)
    costs = _random_costs(rng, num_layers, cuttable)
    cluster = Cluster.parse(f"1x{num_devices}xcpu")
    if capacity is not None:
        cluster = cluster.with_device_overrides(memory_capacity=int(capacity))
    plan = plan_layers(costs, cluster, num_devices, batch_size)
    t, layout, starts = _brute_force(costs, cluster, batch_size)
    got = (plan.num_stages, plan.num_microbatches, plan.schedule, plan.stage_starts)
    assert got == (layout.num_stages, layout.num_microbatches, layout.schedule, tuple(starts))
    assert plan.predicted.step_time_s == pytest.approx(t, rel=1e-12)
    assert plan.candidates == len(legal_layouts(costs, num_devices, batch_size))


def test_memory_bound_case_is_not_trivial():
    """In a memory-bound brute-force case some layouts fit only with an unequal split, some not at all."""
    costs = _random_costs(random.Random(3), 6)
    cap = 12e6
    allowed = range(1, 6)
    kinds = set()
    for l in legal_layouts(costs, 4, 16):
        uniform = max(stage_memory(costs, l, uniform_split(costs, l.num_stages))) <= cap
        some = any(max(stage_memory(costs, l, (0,) + c)) <= cap
                   for c in itertools.combinations(allowed, l.num_stages - 1))
        kinds.add((uniform, some))
    assert kinds == {(True, True), (False, True), (False, False)}
    plan = plan_layers(costs, Cluster.parse("1x4xcpu").with_device_overrides(memory_capacity=int(cap)), 4, 16)
    assert plan.predicted.fits and plan.predicted.peak_memory_bytes_per_gpu <= cap


def test_restricted_search_and_tie_break_order():
    costs = _random_costs(random.Random(5), 6)
    cluster = Cluster.parse("1x8xcpu")
    plan = plan_layers(costs, cluster, 8, 16, num_stages=2, num_microbatches=4)
    assert (plan.num_stages, plan.devices_per_stage, plan.num_microbatches) == (2, 4, 4)
    layouts = legal_layouts(costs, 8, 16)
    keys = [(l.num_stages, l.num_microbatches, ("1f1b", "gpipe").index(l.schedule)) for l in layouts]
    assert keys == sorted(keys)
    assert all((16 // l.num_microbatches) % l.devices_per_stage == 0 for l in layouts)


# -- errors ---------------------------------------------------------------------------------------------------

def test_no_legal_layout_says_why_and_what_to_change():
    costs = _random_costs(random.Random(0), 3)
    cluster = Cluster.parse("1x8xcpu")
    # 3 layers: at most 2 stages of 8 devices -> 4 devices per stage; a batch of 2 cannot split over 4.
    with pytest.raises(ValueError, match=r"no pipeline layout for batch size 2 on 8 device\(s\).*at most 2 stage.*"
                                         r"multiple of 4.*devices=jax.devices\(\)\[:2\]"):
        plan_layers(costs, cluster, 8, 2)


def test_model_that_fits_nowhere_says_why_and_what_to_change():
    costs = _random_costs(random.Random(0), 4)
    cluster = Cluster.parse("1x4xcpu").with_device_overrides(memory_capacity=1_000_000)
    with pytest.raises(ValueError, match=r"fits on no layout of 4 device\(s\).*needs .* GiB per device.*"
                                         r"Use more devices"):
        plan_layers(costs, cluster, 4, 8)


def test_parallelize_reports_an_unplannable_batch():
    model = MLP(MLPConfig(sizes=(4, 4)))  # one layer: one stage over all devices
    tx = make_optimizer()
    params = model.init(jax.random.key(0))
    batch = model.batch(jax.random.key(1), 2)
    step = autopp.parallelize(make_step(model, tx), devices=jax.devices()[:3])
    with pytest.raises(ValueError, match=r"cannot plan this step for 3 device\(s\): no pipeline layout for batch "
                                         r"size 2.*multiple of 3.*num_stages="):
        step.plan_for(params, tx.init(params), batch)

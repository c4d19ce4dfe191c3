"""``plan_model``: never slower than an enumeration of equal splits, CP-SAT stage split equal to brute force of the
same cost model, JSON round trip, infeasibility explained."""

from __future__ import annotations

import dataclasses
import itertools
import json

import pytest

from autopp.models import GPTConfig
from autopp.planner import Estimate, Plan, plan_model, simulate
from autopp.planner._search import _LayoutKey, _refine
from autopp.planner._simulate import _Layout, _layer_costs
from autopp.profiler import Cluster

# Plans in about a second. The slow links between nodes (10 Gbit/s) make data parallelism and FSDP across nodes
# expensive, so the best plan pipelines; the 51k-word head makes its stage the slowest under an equal split.
MODEL = GPTConfig(layers=12, hidden=2048, heads=16, seq=1024, vocab=51200, dtype="bfloat16")
CLUSTER = Cluster.parse("4x2xA100-40GB").with_device_overrides(inter_node_bandwidth=1.25e9)
BATCH = 32


@pytest.fixture(scope="module")
def plan():
    return plan_model(MODEL, CLUSTER, global_batch=BATCH)


def _uniform_estimates(model, cluster, global_batch):
    """Every equal-split layout of the documented search space, costed by the public ``simulate``."""
    n, dpn = cluster.num_devices, cluster.devices_per_node
    for tp in (1, 2, 4, 8):
        if dpn % tp or model.heads % tp:
            continue
        for pp in range(1, model.layers + 1):
            if n % (tp * pp) or model.layers % pp:
                continue
            dp = n // (tp * pp)
            if global_batch % dp:
                continue
            fsdps = {1, dp} | ({dpn // tp} if dp % (dpn // tp) == 0 else set())
            for mbs, fsdp, recompute in itertools.product((1, 2, 4, 8), fsdps, ("none", "full", "selective")):
                if (global_batch // dp) % mbs:
                    continue
                M = global_batch // (dp * mbs)
                for schedule, v in [("gpipe", 1), ("1f1b", 1), ("zb-h1", 1)] + [
                        ("interleaved-1f1b", v) for v in (2, 3, 4) if model.layers % (pp * v) == 0 and M % pp == 0]:
                    if pp == 1 and (schedule, v) != ("gpipe", 1):
                        continue
                    kw = dict(global_batch=global_batch, tp=tp, pp=pp, dp=dp, microbatch_size=mbs, schedule=schedule,
                              recompute=recompute, virtual_stages=v, fsdp=fsdp)
                    yield kw, simulate(model, cluster, **kw)


def test_plan_is_never_slower_than_the_best_equal_split(plan):
    feasible = [(e.step_time_s, kw) for kw, e in _uniform_estimates(MODEL, CLUSTER, BATCH) if e.fits]
    best_time, best_kw = min(feasible, key=lambda x: x[0])
    assert plan.predicted.step_time_s <= best_time * (1 + 1e-9), best_kw
    assert plan.planner.best_uniform_step_time_s == pytest.approx(best_time)
    assert plan.predicted.fits and plan.predicted.peak_memory_bytes_per_gpu <= 40e9


def test_uneven_split_beats_equal_split_when_the_head_is_heavy(plan):
    """The head costs about a block: the planner gives the last stage fewer blocks than an equal split."""
    assert plan.planner.solver_status == "OPTIMAL"
    blocks = [s.layers[1] - s.layers[0] + 1 for s in plan.stages]
    blocks[0] -= 1  # the embedding
    blocks[-1] -= 1  # the head
    assert len(set(blocks)) > 1 and blocks[-1] < max(blocks)
    assert plan.predicted.step_time_s < plan.planner.best_uniform_step_time_s


def test_plan_describes_a_consistent_layout(plan):
    n = CLUSTER.num_devices
    groups = {s.devices for s in plan.stages}
    assert sorted(d for g in groups for d in g) == list(range(n))  # every device in exactly one group
    for s in plan.stages:
        assert s.mesh_shape["data"] * s.mesh_shape["fsdp"] * s.mesh_shape["tensor"] == len(s.devices)
    layers = [i for s in plan.stages for i in range(s.layers[0], s.layers[1] + 1)]
    assert layers == list(range(MODEL.layers + 2))  # embed, blocks, head: each on exactly one stage
    dp = plan.stages[0].mesh_shape["data"] * plan.stages[0].mesh_shape["fsdp"]
    assert plan.microbatch_size * plan.num_microbatches * dp == BATCH
    assert plan.cluster == CLUSTER.to_dict()
    assert plan.planner.wall_time_s > 0 and plan.planner.candidates > 100


def test_plan_json_round_trip_is_exact(plan, tmp_path):
    path = tmp_path / "plan.json"
    plan.to_json(path)
    again = Plan.from_json(path)
    assert again == plan
    data = json.loads(path.read_text())
    assert set(data["predicted"]) == {f for f in Estimate.__dataclass_fields__}
    assert data["predicted"]["step_time_s"] == plan.predicted.step_time_s
    assert data["schema_version"] == 2 and data["planner"]["solver_status"] == "OPTIMAL"


@pytest.mark.parametrize("schedule, pp, mix_tensor, vocab", [
    ("1f1b", 3, False, 32768), ("gpipe", 2, False, 32768), ("zb-h1", 4, False, 32768), ("zb-h1", 2, True, 32768),
    ("1f1b", 3, True, 131072),  # the heavy head's stage takes 4 devices of tensor parallelism, the others 1
])
def test_stage_split_equals_brute_force_of_the_same_cost_model(schedule, pp, mix_tensor, vocab):
    """CP-SAT's blocks per stage, recomputation per stage (and tensor degree per stage, the stages' devices adding
    up to the cluster's), against every combination costed by the simulator's own per-stage time and memory (not
    the linear coefficients the solver sees)."""
    model = GPTConfig(layers=7, hidden=512, heads=8, seq=256, vocab=vocab, dtype="bfloat16")
    tp, dp = 2, 2
    cluster = Cluster.parse(f"{pp * tp * dp // 4}x4xA100-80GB")
    costs = _layer_costs(model, 2, cluster)
    modes = ("none", "full", "selective")
    key = _LayoutKey(tp, pp, dp, 1, 2, schedule, 1)
    tps = (1, 2, 4) if mix_tensor else (tp,)

    def layout_for(t, capacity):
        c = cluster.with_device_overrides(memory_capacity=int(capacity))
        return _Layout(model, c, costs, global_batch=16, tp=t, dp=dp, fsdp=1, microbatch_size=2, schedule=schedule,
                       virtual_stages=1, num_stages=pp)

    roomy = layout_for(tp, 80e9).stage_memory(0, 3, "none")[0]
    for cap in (80e9, roomy * 0.9):  # the second rules out keeping every activation on the first stage
        lay = {t: layout_for(t, cap) for t in tps}
        best = None
        for blocks in itertools.product(range(model.layers + 1), repeat=pp):
            if sum(blocks) != model.layers or any(b < 1 for b in blocks[1:-1]):
                continue
            for opts in itertools.product(itertools.product(tps, modes), repeat=pp):
                if sum(t for t, _ in opts) * dp != cluster.num_devices:
                    continue
                if all(lay[t].stage_memory(i, b, r)[0] <= cap for i, (b, (t, r)) in enumerate(zip(blocks, opts))):
                    worst = max(sum(lay[t].stage_time(i, b, r)[k] for k in "fb")
                                for i, (b, (t, r)) in enumerate(zip(blocks, opts)))
                    best = worst if best is None else min(best, worst)
        got = _refine(lay[tp], key, modes, time_limit_s=10.0, mix_tensor=mix_tensor)
        if best is None:
            assert got is None
            continue
        stage_lay = got.stage_layouts or (lay[tp],) * pp
        assert sum(s.tp for s in stage_lay) * dp == cluster.num_devices
        worst = max(sum(s.stage_time(i, b, r)[k] for k in "fb")
                    for i, (s, b, r) in enumerate(zip(stage_lay, got.stage_blocks, got.recompute)))
        assert worst == pytest.approx(best, rel=1e-5), (schedule, pp, cap)
        if vocab == 131072 and cap == 80e9:
            assert [s.tp for s in stage_lay] == [1, 1, 4]
        assert all(s.stage_memory(i, b, r)[0] <= cap
                   for i, (s, b, r) in enumerate(zip(stage_lay, got.stage_blocks, got.recompute)))


def test_infeasible_request_says_what_it_needs_and_what_would_fit():
    gpt3 = GPTConfig(layers=96, hidden=12288, heads=96, seq=2048, vocab=51200, dtype="bfloat16")
    with pytest.raises(ValueError) as info:
        plan_model(gpt3, "1x8xA100-40GB", global_batch=8, microbatch_sizes=(1,))
    msg = str(info.value)
    assert "least memory any option needs is" in msg and "A100-40GB has 37.3 GiB" in msg
    need = float(msg.split("needs is ")[1].split(" GiB")[0])
    # the least: full sharding over all 8 devices: weights, gradients and Adam state (18 bytes per parameter)
    assert need > 175e9 * 18 / 8 / 2**30
    assert "It would fit with" in msg and "x the nodes" in msg


@pytest.mark.parametrize("kwargs, match", [
    (dict(global_batch=0), r"global_batch must be a positive int"),
    (dict(global_batch=8, schedules=("pipedream",)), r"schedules=\('pipedream',\) must be a non-empty tuple of"),
    (dict(global_batch=8, recompute=()), r"recompute=\(\) must be a non-empty tuple"),
    (dict(global_batch=8, microbatch_sizes=[]), r"microbatch_sizes=\[\] must be a non-empty tuple"),
])
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        plan_model(MODEL, CLUSTER, **kwargs)
    with pytest.raises(TypeError, match=r"model must be an autopp.models.GPTConfig"):
        plan_model("gpt", CLUSTER, global_batch=8)


def test_stages_of_different_sizes_get_disjoint_devices_with_tensor_groups_inside_nodes():
    from autopp.planner._plan import PlannerStats
    from autopp.planner._search import _to_plan

    model = GPTConfig(layers=7, hidden=512, heads=8, seq=256, vocab=131072, dtype="bfloat16")
    cluster = Cluster.parse("3x4xA100-80GB")
    layout = _Layout(model, cluster, _layer_costs(model, 2, cluster), global_batch=16, tp=2, dp=2, fsdp=1,
                     microbatch_size=2, schedule="1f1b", virtual_stages=1, num_stages=3)
    got = _refine(layout, _LayoutKey(2, 3, 2, 1, 2, "1f1b", 1), ("none",), 10.0, mix_tensor=True)
    assert [s.tp for s in got.stage_layouts] == [1, 1, 4]
    stats = PlannerStats(wall_time_s=0.0, solver_status=got.status, optimality_gap=0.0, candidates=1,
                         best_uniform_step_time_s=1.0)
    plan = _to_plan(model, cluster, got, layout, stats)
    assert [len(s.devices) for s in plan.stages] == [2, 2, 8]
    assert sorted(d for s in plan.stages for d in s.devices) == list(range(12))
    for s in plan.stages:
        tp = s.mesh_shape["tensor"]
        for k in range(0, len(s.devices), tp):  # consecutive devices form a tensor group: one node each
            assert len({d // 4 for d in s.devices[k:k + tp]}) == 1
    assert Plan.from_json(plan.to_json()) == plan


def test_plan_for_a_traced_step_replays_and_matches_plain_jit(tmp_path):
    """plan_model of a step's Profile: pipeline x data parallelism over the profiled layers, replayable."""
    import jax

    import autopp
    from autopp.profiler import profile
    from tests._helpers import assert_trees_close, make_optimizer, make_step, run_steps, tiny_gpt

    model, tx = tiny_gpt(), make_optimizer()
    params = model.init(jax.random.key(0))
    state = (params, tx.init(params))
    batch = model.batch(jax.random.key(1), 8)
    step = make_step(model, tx)
    cluster = Cluster.local(jax.devices()[:4])
    prof = profile(step, *state, batch, cluster=cluster)
    # a cluster whose links are slow makes data parallelism expensive, so the plan pipelines
    slow = cluster.with_device_overrides(intra_node_bandwidth=1e6)
    plan = plan_model(dataclasses.replace(prof, cluster=slow), slow, global_batch=8)
    assert plan.model_fingerprint == prof.fingerprint and plan.num_stages > 1
    assert all(s.equations is None and s.layers is not None for s in plan.stages)
    plan.to_json(tmp_path / "plan.json")
    replay = autopp.parallelize(step, plan=str(tmp_path / "plan.json"), devices=jax.devices()[:4])
    got, _ = run_steps(replay, state, batch)
    reference, _ = run_steps(jax.jit(step), state, batch)
    assert_trees_close(got, reference)
    ran = replay.plan_for(*state, batch)
    assert [s.layers for s in ran.stages] == [s.layers for s in plan.stages]
    assert [s.devices for s in ran.stages] == [s.devices for s in plan.stages]
    with pytest.raises(ValueError, match=r"profile's times are for cpu devices but the cluster is"):
        plan_model(prof, "1x8xH100", global_batch=8)


def test_simulate_a_traced_step_agrees_with_its_plan():
    """simulate(Profile) of the layout plan_model(Profile) chose predicts the same step (equal split chosen) or a
    slower one (the planner's split beats the equal split)."""
    import jax

    from autopp.profiler import profile
    from tests._helpers import make_optimizer, make_step, tiny_mlp

    model, tx = tiny_mlp(), make_optimizer()
    params = model.init(jax.random.key(0))
    prof = profile(make_step(model, tx), params, tx.init(params), model.batch(jax.random.key(1), 64),
                   cluster="1x8xA100-80GB")
    plan = plan_model(prof, "1x8xA100-80GB", global_batch=64)
    d = plan.stages[0].mesh_shape["data"]
    est = simulate(prof, "1x8xA100-80GB", global_batch=64, tp=1, pp=plan.num_stages, dp=d,
                   microbatch_size=plan.microbatch_size, schedule=plan.schedule, recompute="none")
    if plan.planner.solver_status == "UNIFORM":
        assert est.step_time_s == pytest.approx(plan.predicted.step_time_s)
    else:
        assert est.step_time_s >= plan.predicted.step_time_s * (1 - 1e-9)
    with pytest.raises(ValueError, match=r"tp=2 is not modelled for a traced step"):
        simulate(prof, "1x8xA100-80GB", global_batch=64, tp=2, pp=1, dp=4, microbatch_size=1, recompute="none")

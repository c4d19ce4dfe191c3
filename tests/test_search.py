"""``plan_model``: never slower than an enumeration of equal splits, CP-SAT stage split equal to brute force of the
same cost model, JSON round trip, infeasibility explained."""

from __future__ import annotations

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


def test_stage_split_equals_brute_force_of_the_same_cost_model():
    """CP-SAT's blocks per stage and recomputation per stage, against every composition costed by the simulator's
    own per-stage time and memory (not the linear coefficients the solver sees)."""
    model = GPTConfig(layers=7, hidden=512, heads=8, seq=256, vocab=32768, dtype="bfloat16")
    cluster = Cluster.parse("1x8xA100-80GB")
    costs = _layer_costs(model, 2, cluster)
    modes = ("none", "full", "selective")
    for schedule, pp in (("1f1b", 3), ("gpipe", 2), ("zb-h1", 4)):
        layout = _Layout(model, cluster, costs, global_batch=16, tp=2, dp=8 // (2 * pp) or 1, fsdp=1,
                         microbatch_size=2, schedule=schedule, virtual_stages=1, num_stages=pp)
        # a capacity that rules out keeping every activation on the first stage
        roomy = layout.stage_memory(0, 3, "none")[0]
        for cap in (80e9, roomy * 0.9):
            layout.cluster = cluster.with_device_overrides(memory_capacity=int(cap))
            best = None
            for blocks in itertools.product(range(model.layers + 1), repeat=pp):
                if sum(blocks) != model.layers or any(b < 1 for b in blocks[1:-1]):
                    continue
                for rs in itertools.product(modes, repeat=pp):
                    if all(layout.stage_memory(i, b, r)[0] <= cap for i, (b, r) in enumerate(zip(blocks, rs))):
                        t = max(sum(layout.stage_time(i, b, r)[k] for k in "fb")
                                for i, (b, r) in enumerate(zip(blocks, rs)))
                        best = t if best is None else min(best, t)
            key = _LayoutKey(2, pp, layout.dp, 1, 2, schedule, 1)
            got = _refine(layout, key, modes, time_limit_s=5.0)
            bottleneck = max(sum(layout.stage_time(i, b, r)[k] for k in "fb")
                             for i, (b, r) in enumerate(zip(got.stage_blocks, got.recompute)))
            assert bottleneck == pytest.approx(best, rel=1e-5), (schedule, pp, cap)
            assert all(layout.stage_memory(i, b, r)[0] <= cap
                       for i, (b, r) in enumerate(zip(got.stage_blocks, got.recompute)))


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

"""Tests of ``autopp.planner._simulate.simulate``: validation, FLOP accounting, sanity, cache, Megatron-LM rows."""

from __future__ import annotations

import dataclasses
import json
import pathlib

import jax
import jax.numpy as jnp
import pytest

import autopp
from autopp.models._gpt import GPT, GPTConfig
from autopp.planner import _simulate
from autopp.planner._simulate import Estimate, clear_cache, simulate
from autopp.profiler import Cluster, profile
from autopp.planner._schedule import get_schedule, simulate_times

SMALL = GPTConfig(layers=4, hidden=64, heads=4, seq=32, vocab=128, dtype="bfloat16")
CLUSTER = "2x8xA100-80GB"
# Megatron-LM's 1.7B GPT (Narayanan et al. 2021, Table 1, first row).
GPT_1_7B = GPTConfig(layers=24, hidden=2304, heads=24, seq=2048, vocab=51200, dtype="bfloat16")
REFERENCE = pathlib.Path("/work/shared/reference/gpt_a100_measured.json")


def _kw(**over):
    kw = dict(global_batch=64, tp=2, pp=2, dp=4, microbatch_size=2)
    kw.update(over)
    return kw


# ---------------------------------------------------------------- validation


@pytest.mark.parametrize("over, match", [
    (dict(tp=2, pp=2, dp=2), r"tp\*pp\*dp = 2\*2\*2 = 8 .* 16 devices.*dp=4"),
    (dict(tp=3, pp=1, dp=5, global_batch=60), r"tp\*pp\*dp = 3\*1\*5 = 15 .* 16"),
    (dict(tp=16, pp=1, dp=1), r"tp=16 exceeds the 8 devices of a node.*tp <= 8"),
    (dict(tp=8, pp=2, dp=1, global_batch=2), r"tp=8 must divide the 4 attention heads; use one of 1, 2, 4"),
    (dict(tp=1, pp=8, dp=2, global_batch=4), r"4 layers do not split into pp\*virtual_stages = 8\*1"),
    (dict(global_batch=20), r"global_batch=20 is not divisible by microbatch_size\*dp = 2\*4 = 8"),
    (dict(global_batch=0), r"global_batch must be a positive int, got global_batch=0"),
    (dict(tp=-2), r"tp must be a positive int, got tp=-2"),
    (dict(pp=1.5), r"pp must be a positive int, got pp=1.5"),
    (dict(dp=True), r"dp must be a positive int, got dp=True"),
    (dict(microbatch_size=0), r"microbatch_size must be a positive int"),
    (dict(virtual_stages=0), r"virtual_stages must be a positive int"),
    (dict(schedule="pipedream"), r"unknown schedule 'pipedream'; use one of gpipe, 1f1b, interleaved-1f1b, zb-h1"),
    (dict(recompute="some"), r"unknown recompute 'some'; use one of none, full, selective"),
    (dict(virtual_stages=2), r"virtual_stages=2 needs schedule='interleaved-1f1b'"),
    (dict(schedule="interleaved-1f1b", virtual_stages=4), r"pp\*virtual_stages = 2\*4 = 8"),
    (dict(schedule="interleaved-1f1b", virtual_stages=2, global_batch=24, microbatch_size=2, dp=4, pp=2, tp=2),
     r"interleaved-1f1b needs the 3 microbatches per pipeline to be a multiple of pp=2"),
])
def test_invalid_layouts_raise(over, match):
    with pytest.raises(ValueError, match=match):
        simulate(SMALL, CLUSTER, **_kw(**over))


def test_invalid_model_and_cluster_types():
    with pytest.raises(TypeError, match="GPTConfig"):
        simulate({"layers": 4}, CLUSTER, **_kw())
    with pytest.raises(TypeError, match="Cluster or a string"):
        simulate(SMALL, 16, **_kw())
    with pytest.raises(ValueError, match="Cluster.parse"):
        simulate(SMALL, "2x8xZ9000", **_kw())


# ---------------------------------------------------------------- results


def test_estimate_fields_and_breakdown_add_up():
    e = simulate(SMALL, Cluster.parse(CLUSTER), **_kw())
    assert isinstance(e, Estimate)
    d = e.to_dict()
    assert set(d) == {f.name for f in dataclasses.fields(Estimate)}
    parts = e.compute_s + e.bubble_s + e.tp_comm_s + e.pp_comm_s + e.dp_comm_s + e.optimizer_s
    assert e.step_time_s == pytest.approx(parts, rel=1e-9)
    assert e.num_microbatches == 64 // (2 * 4)
    assert e.peak_memory_bytes_per_gpu == pytest.approx(e.param_bytes + e.optimizer_bytes + e.activation_bytes,
                                                        abs=4)
    assert e.fits and 0 < e.mfu < 1 and e.tflops_per_gpu > 0
    assert json.dumps(d)
    # A GPT instance is accepted as well as its config; a string cluster equals the parsed one.
    assert simulate(GPT(SMALL), CLUSTER, **_kw()) == e


def test_flops_match_megatron_formula_with_full_recompute():
    B, gpus = 512, 32
    e = simulate(GPT_1_7B, f"{gpus // 8}x8xA100-80GB", global_batch=B, tp=1, pp=1, dp=gpus, microbatch_size=1,
                 recompute="full")
    executed = e.tflops_per_gpu * 1e12 * e.step_time_s * gpus
    assert executed == pytest.approx(GPT_1_7B.flops_per_step(B, recompute=True), rel=0.02)
    model = e.mfu * e.step_time_s * gpus * 312e12
    assert model == pytest.approx(GPT_1_7B.flops_per_step(B, recompute=False), rel=0.02)


def test_more_microbatches_shrink_the_bubble():
    fractions = []
    for gb in (16, 32, 64, 128):
        e = simulate(SMALL, CLUSTER, **_kw(global_batch=gb, microbatch_size=1))
        fractions.append(e.bubble_s / e.step_time_s)
    assert all(a > b for a, b in zip(fractions, fractions[1:]))


def test_recompute_trades_time_for_memory():
    none = simulate(GPT_1_7B, "1x8xA100-80GB", global_batch=64, tp=2, pp=2, dp=2, microbatch_size=1,
                    recompute="none")
    sel = simulate(GPT_1_7B, "1x8xA100-80GB", global_batch=64, tp=2, pp=2, dp=2, microbatch_size=1,
                   recompute="selective")
    full = simulate(GPT_1_7B, "1x8xA100-80GB", global_batch=64, tp=2, pp=2, dp=2, microbatch_size=1,
                    recompute="full")
    assert full.activation_bytes < sel.activation_bytes < none.activation_bytes
    assert none.step_time_s < sel.step_time_s < full.step_time_s


def test_tensor_parallelism_halves_weight_memory():
    one = simulate(SMALL, CLUSTER, **_kw(tp=1, pp=2, dp=8))
    two = simulate(SMALL, CLUSTER, **_kw(tp=2, pp=2, dp=4))
    assert two.param_bytes == pytest.approx(one.param_bytes / 2, abs=2)
    assert two.optimizer_bytes == pytest.approx(one.optimizer_bytes / 2, abs=2)
    assert two.tp_comm_s > 0 == one.tp_comm_s


def test_memory_per_parameter_is_megatron_18_bytes():
    e = simulate(SMALL, "1x1xA100-80GB", global_batch=4, tp=1, pp=1, dp=1, microbatch_size=1)
    assert e.param_bytes + e.optimizer_bytes == 18 * SMALL.num_params


def test_schedules_order_bubbles_and_memory():
    kw = dict(global_batch=64, tp=1, pp=4, dp=4, microbatch_size=1)
    g = simulate(SMALL, CLUSTER, schedule="gpipe", **kw)
    f = simulate(SMALL, CLUSTER, schedule="1f1b", **kw)
    i = simulate(SMALL, "2x8xA100-80GB", schedule="interleaved-1f1b", virtual_stages=1, **kw)
    z = simulate(SMALL, CLUSTER, schedule="zb-h1", **kw)
    assert g.bubble_s == pytest.approx(f.bubble_s) and i == f
    assert g.activation_bytes > f.activation_bytes
    assert z.bubble_s < f.bubble_s
    cfg = dataclasses.replace(SMALL, layers=8)
    f8 = simulate(cfg, CLUSTER, schedule="1f1b", **kw)
    i8 = simulate(cfg, CLUSTER, schedule="interleaved-1f1b", virtual_stages=2, **kw)
    assert i8.bubble_s < f8.bubble_s


@pytest.mark.parametrize("schedule, pp, M, v", [
    ("gpipe", 4, 8, 1), ("1f1b", 4, 8, 1), ("1f1b", 3, 5, 1), ("zb-h1", 4, 8, 1), ("zb-h1", 3, 7, 1),
    ("interleaved-1f1b", 4, 8, 2), ("interleaved-1f1b", 2, 4, 3),
])
@pytest.mark.parametrize("f, b, w", [(1.0, 2.0, 1.0), (1.0, 3.0, 1.2), (1.0, 2.0, 0.5), (0.5, 3.0, 1.5)])
def test_bubble_closed_forms_match_event_simulation(schedule, pp, M, v, f, b, w):
    sched = get_schedule(schedule, pp * v, M, v)
    times = simulate_times(sched, f / v, b / v, w / v if schedule == "zb-h1" else None)
    makespan = max(end for _, end in times.values())
    assert M * (f + b) + _simulate._bubble_time(schedule, pp, v, f, b, w) == pytest.approx(makespan)


def test_short_profile_equals_full_depth_profile():
    """simulate profiles a two-block copy of the model; its layers equal the full model's."""
    cfg = dataclasses.replace(SMALL, layers=5)
    clear_cache()
    costs = _simulate._layer_costs(cfg, 2, Cluster.parse(CLUSTER))
    model = GPT(cfg)
    tokens = jax.ShapeDtypeStruct((2, cfg.seq), jnp.int32)
    full = profile(lambda p, b: autopp.grad(model.loss)(p, b), model.init_abstract(),
                   {"tokens": tokens, "targets": tokens}, cluster=CLUSTER)
    skip = {"index", "name"}

    def fields(lp):
        return {k: v for k, v in lp.to_dict().items() if k not in skip}

    assert fields(costs.embed) == fields(full.layers[0])
    assert fields(costs.head) == fields(full.layers[-1])
    for lp in full.layers[1:-1]:
        assert fields(costs.block) == fields(lp)


def test_profile_is_cached(monkeypatch):
    calls = []
    real = _simulate.profile

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(_simulate, "profile", counting)
    clear_cache()
    cfg = dataclasses.replace(SMALL, layers=8)
    first = simulate(cfg, CLUSTER, **_kw())
    assert len(calls) == 1
    for over in (dict(), dict(tp=1, pp=4, dp=4), dict(schedule="zb-h1"), dict(recompute="none")):
        simulate(cfg, "2x8xA100-80GB", **_kw(**over))
    simulate(cfg, "4x8xA100-80GB", **_kw(dp=8))  # same device kind, more nodes
    assert len(calls) == 1
    assert simulate(cfg, CLUSTER, **_kw()) == first
    simulate(cfg, CLUSTER, **_kw(microbatch_size=1))  # a new microbatch size profiles again
    assert len(calls) == 2
    simulate(cfg, "2x8xH100", **_kw())  # and so does a new device
    assert len(calls) == 3


# ---------------------------------------------------------------- Megatron-LM (Narayanan et al. 2021, Table 1)


def _rows():
    data = json.loads(REFERENCE.read_text())
    return [dict(zip(data["columns"], row)) for row in data["rows"]]


@pytest.mark.skipif(not REFERENCE.exists(), reason="reference data not present")
@pytest.mark.parametrize("index", [0, 1, 2], ids=["1.7B", "39.1B", "1T"])
def test_megatron_rows_within_10_percent(index):
    # Megatron's own layout, microbatch size 1, 1F1B, full recomputation; no per-row fitting.
    r = _rows()[index]
    cfg = GPTConfig(layers=r["layers"], hidden=r["hidden"], heads=r["heads"], seq=2048, vocab=51200,
                    dtype="bfloat16")
    tp, pp, gpus = r["tensor_parallel"], r["pipeline_parallel"], r["gpus"]
    e = simulate(cfg, f"{gpus // 8}x8xA100-80GB", global_batch=r["global_batch"], tp=tp, pp=pp,
                 dp=gpus // (tp * pp), microbatch_size=1, schedule="1f1b", recompute="full")
    assert e.fits
    assert e.tflops_per_gpu == pytest.approx(r["tflops_per_gpu"], rel=0.10)


def test_every_layout_of_an_odd_cluster_gives_a_finite_estimate():
    import math

    cfg = GPTConfig(layers=12, hidden=96, heads=12, seq=32, vocab=128, dtype="bfloat16")
    cluster = Cluster.parse("3x8xA100-80GB")
    n = 0
    for tp in (1, 2, 3, 4, 6):
        for pp in (1, 2, 3, 4, 6, 12):
            if 24 % (tp * pp):
                continue
            dp = 24 // (tp * pp)
            for schedule, v in (("gpipe", 1), ("1f1b", 1), ("zb-h1", 1), ("interleaved-1f1b", 2)):
                if cfg.layers % (pp * v):
                    continue
                for recompute in ("none", "full", "selective"):
                    e = simulate(cfg, cluster, global_batch=dp * pp * 2, tp=tp, pp=pp, dp=dp, microbatch_size=2,
                                 schedule=schedule, recompute=recompute, virtual_stages=v)
                    values = [x for x in e.to_dict().values() if not isinstance(x, bool)]
                    assert all(math.isfinite(x) and x >= 0 for x in values), e
                    assert e.step_time_s > 0 and e.tflops_per_gpu > 0
                    n += 1
    assert n > 50


def test_selective_recompute_flops_between_none_and_full():
    kw = dict(global_batch=64, tp=2, pp=2, dp=2, microbatch_size=1)
    flops = {}
    for mode in ("none", "selective", "full"):
        e = simulate(GPT_1_7B, "1x8xA100-80GB", recompute=mode, **kw)
        flops[mode] = e.tflops_per_gpu * e.step_time_s
    assert flops["none"] < flops["selective"] < flops["full"]

"""The CP-SAT stage assignment equals a brute-force optimum of the same cost model."""

import itertools

import numpy as np
import pytest

from autopp.planner._cpsat import _MEM_UNIT, _TIME_UNIT, assign_stages, evaluate


def brute_force(layer_time, layer_act, layer_static, num_stages, in_flight, cap):
    num_layers = len(layer_static)
    best = None
    for cuts in itertools.combinations(range(1, num_layers), num_stages - 1):
        starts = (0, *cuts)
        for ridx in itertools.product(range(len(layer_time)), repeat=num_stages):
            times, mems = evaluate(starts, ridx, layer_time, layer_act, layer_static, in_flight)
            if max(mems) <= cap and (best is None or max(times) < best):
                best = max(times)
    return best


@pytest.mark.parametrize("seed", range(12))
def test_cpsat_equals_brute_force(seed):
    rng = np.random.default_rng(seed)
    num_layers = int(rng.integers(4, 9))
    num_stages = int(rng.integers(1, min(4, num_layers) + 1))
    num_microbatches = int(rng.integers(1, 9))
    # Exact multiples of the model's units, so that integer scaling loses nothing.
    t_none = rng.integers(10, 100, num_layers) * _TIME_UNIT
    layer_time = [list(t_none), list(t_none + rng.integers(5, 40, num_layers) * _TIME_UNIT)]  # none, full
    a_none = rng.integers(5, 50, num_layers) * _MEM_UNIT
    layer_act = [list(a_none), list(np.maximum(1, a_none // 8) * 1.0)]
    layer_static = list(rng.integers(10, 60, num_layers) * _MEM_UNIT * 1.0)
    in_flight = [min(num_microbatches, num_stages - s) for s in range(num_stages)]
    total = sum(layer_static) + max(in_flight) * sum(a_none)
    cap = float(rng.uniform(0.15, 0.8) * total) // _MEM_UNIT * _MEM_UNIT
    expected = brute_force(layer_time, layer_act, layer_static, num_stages, in_flight, cap)
    got = assign_stages(layer_time, layer_act, layer_static, num_stages, in_flight, cap,
                        recompute_options=("none", "full"))
    if expected is None:
        assert got is None
        return
    assert got is not None and got.status == "OPTIMAL"
    assert got.bottleneck_s == pytest.approx(expected, rel=1e-9)
    assert max(got.stage_memory_bytes) <= cap
    assert len(got.stage_starts) == num_stages and got.stage_starts[0] == 0


def test_recompute_chosen_only_when_memory_needs_it():
    t = [[1e-3] * 6, [1.3e-3] * 6]
    act = [[4 * _MEM_UNIT] * 6, [_MEM_UNIT] * 6]
    static = [_MEM_UNIT] * 6
    roomy = assign_stages(t, act, static, 2, [2, 1], 1e9, recompute_options=("none", "full"))
    assert roomy.recompute == ("none", "none") and roomy.stage_starts == (0, 3)
    tight = assign_stages(t, act, static, 2, [2, 1], 20 * _MEM_UNIT, recompute_options=("none", "full"))
    assert "full" in tight.recompute and max(tight.stage_memory_bytes) <= 20 * _MEM_UNIT
    assert assign_stages(t, act, static, 2, [2, 1], 2 * _MEM_UNIT, recompute_options=("none", "full")) is None


def test_bad_arguments():
    with pytest.raises(ValueError, match=r"num_stages=5 must be between 1 and the 3 layers"):
        assign_stages([[1.0] * 3], [[1.0] * 3], [1.0] * 3, 5, [1] * 5, 1e9)
    with pytest.raises(ValueError, match=r"in_flight has 1 entries for 2 stages"):
        assign_stages([[1.0] * 3], [[1.0] * 3], [1.0] * 3, 2, [1], 1e9)


def brute_force_general(layer_time, layer_act, layer_static, num_stages, in_flight, cap, cuttable):
    num_layers = len(layer_static[0])
    allowed = [l for l in range(1, num_layers) if cuttable[l - 1]]
    best = None
    for cuts in itertools.combinations(allowed, num_stages - 1):
        starts = (0, *cuts)
        for ridx in itertools.product(range(len(layer_time)), repeat=num_stages):
            times, mems = evaluate(starts, ridx, layer_time, layer_act, layer_static, in_flight)
            if max(mems) <= cap and (best is None or max(times) < best):
                best = max(times)
    return best


@pytest.mark.parametrize("seed", range(12))
def test_per_option_memory_fractional_in_flight_and_forbidden_cuts_equal_brute_force(seed):
    """Options that change a layer's static bytes too (a tensor degree), chunks keeping a fraction of a microbatch
    in flight (interleaved schedules) and positions a stage may not begin at (inside a lax.scan)."""
    rng = np.random.default_rng(200 + seed)
    num_layers = int(rng.integers(4, 9))
    num_stages = int(rng.integers(1, min(4, num_layers) + 1))
    t = rng.integers(10, 100, num_layers) * _TIME_UNIT
    layer_time = [list(t), list(t + rng.integers(5, 40, num_layers) * _TIME_UNIT), list(t / 2)]
    a = rng.integers(4, 50, num_layers) * 4 * _MEM_UNIT
    layer_act = [list(a * 1.0), list(np.maximum(4, a // 8) * 1.0), list(a / 2.0)]
    st = rng.integers(10, 60, num_layers) * _MEM_UNIT * 1.0
    layer_static = [list(st), list(st), list(st * 2)]
    in_flight = [float(rng.choice([0.5, 1.0, 1.5, 2.0, 2.75])) for _ in range(num_stages)]
    cuttable = [bool(rng.random() < 0.75) for _ in range(num_layers - 1)]
    total = sum(st) * 2 + 3 * sum(a)
    cap = float(rng.uniform(0.1, 0.7) * total) // _MEM_UNIT * _MEM_UNIT
    expected = brute_force_general(layer_time, layer_act, layer_static, num_stages, in_flight, cap, cuttable)
    got = assign_stages(layer_time, layer_act, layer_static, num_stages, in_flight, cap,
                        recompute_options=("a", "b", "c"), cuttable=cuttable)
    if expected is None:
        assert got is None
        return
    assert got is not None and got.status == "OPTIMAL"
    assert got.bottleneck_s == pytest.approx(expected, rel=1e-9)
    assert max(got.stage_memory_bytes) <= cap
    assert all(cuttable[s - 1] for s in got.stage_starts[1:])


def test_many_layers_on_many_stages_solve_at_once():
    """Prefix sums keep the model at O(stages x options): 98 layers on 64 stages solve to the known optimum (how
    long that takes is a benchmark's question, not this test's)."""
    stages = 64
    got = assign_stages([[1.0] * 98], [[1.0] * 98], [1.0] * 98, stages, [1] * stages, 1e9)
    assert got.status == "OPTIMAL" and got.bottleneck_s == pytest.approx(2.0)

"""The CP-SAT stage assignment equals a brute-force optimum of the same cost model."""

import itertools

import numpy as np
import pytest

from autopp.planner._cpsat import _MEM_UNIT, _TIME_UNIT, assign_blocks, assign_stages, evaluate, evaluate_blocks


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


def brute_force_blocks(num_blocks, block_time, const_time, block_mem, const_mem, cap, lows, num_opts):
    best = None
    for blocks in itertools.product(*(range(lo, num_blocks + 1) for lo in lows)):
        if sum(blocks) != num_blocks:
            continue
        for ridx in itertools.product(range(num_opts), repeat=len(lows)):
            times, mems = evaluate_blocks(blocks, ridx, block_time, const_time, block_mem, const_mem)
            if max(mems) <= cap and (best is None or max(times) < best):
                best = max(times)
    return best


@pytest.mark.parametrize("seed", range(16))
def test_block_counts_equal_brute_force(seed):
    rng = np.random.default_rng(100 + seed)
    num_stages = int(rng.integers(1, 5))
    num_blocks = int(rng.integers(num_stages, 10))
    fast = rng.uniform(1, 2, num_stages)  # per-stage coefficients differ (first/last stage extras, in-flight counts)
    block_time = [[f, 1.3 * f, 1.1 * f] for f in fast]  # none, full, selective
    const_time = [[float(c)] * 3 for c in rng.uniform(0, 3, num_stages)]
    mem = rng.integers(4, 20, num_stages) * 64.0
    block_mem = [[m, m / 4, m / 2] for m in mem]
    const_mem = [[float(c)] * 3 for c in rng.integers(0, 5, num_stages) * 64.0]
    lows = [0 if s in (0, num_stages - 1) and num_stages > 1 else 1 for s in range(num_stages)]
    cap = float(rng.integers(5, 60)) * 64
    expected = brute_force_blocks(num_blocks, block_time, const_time, block_mem, const_mem, cap, lows, 3)
    got = assign_blocks(num_blocks, block_time, const_time, block_mem, const_mem, cap, min_blocks=lows,
                        recompute_options=("none", "full", "selective"))
    if expected is None:
        assert got is None
        return
    assert got is not None and got.status == "OPTIMAL"
    assert got.bottleneck_s == pytest.approx(expected, rel=1e-6)
    assert sum(got.stage_blocks) == num_blocks and all(n >= lo for n, lo in zip(got.stage_blocks, lows))
    ridx = [("none", "full", "selective").index(r) for r in got.recompute]
    _, mems = evaluate_blocks(got.stage_blocks, ridx, block_time, const_time, block_mem, const_mem)
    assert max(mems) <= cap


def test_block_counts_scale_to_many_stages():
    """Identical blocks make the model small: 96 blocks on 64 stages solve to the known optimum at once."""
    stages = 64
    got = assign_blocks(96, [[1.0]] * stages, [[0.0]] * stages, [[1.0]] * stages, [[0.0]] * stages, 1e9)
    assert got.status == "OPTIMAL" and got.bottleneck_s == pytest.approx(2.0) and got.wall_time_s < 5

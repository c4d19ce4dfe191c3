"""CP-SAT model: contiguous layers -> pipeline stages, with a recomputation choice per stage, under memory.

This is the core assignment the planner solves for each candidate layout; the outer choices (tensor /
data degrees, microbatches, schedule) enter through the per-layer times and memories given here.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence
from typing import Any

from ortools.sat.python import cp_model

_TIME_UNIT = 1e-7  # seconds per integer time unit in the model
_MEM_UNIT = 2**16  # bytes per integer memory unit


@dataclasses.dataclass(frozen=True, kw_only=True)
class StageAssignment:
    """The solver's answer."""

    stage_starts: tuple[int, ...]
    """Index of the first layer of each stage."""
    recompute: tuple[str, ...]
    """Recomputation option chosen per stage."""
    bottleneck_s: float
    """Time of the slowest stage (per microbatch, forward + backward) under the given costs."""
    stage_times_s: tuple[float, ...]
    """Time of each stage (per microbatch)."""
    stage_memory_bytes: tuple[float, ...]
    """Peak memory of each stage's devices."""
    status: str
    """Solver status (``OPTIMAL`` or ``FEASIBLE``)."""
    wall_time_s: float
    """Solver wall time."""
    gap: float
    """Relative gap between the objective and the solver's bound (0 when optimal)."""


def evaluate(stage_starts: Sequence[int], recompute_idx: Sequence[int], layer_time, layer_act, layer_static,
             in_flight: Sequence[int]) -> tuple[list[float], list[float]]:
    """Stage times and memories of an assignment (the same cost model the CP-SAT model encodes)."""
    num_layers = len(layer_static)
    bounds = list(stage_starts) + [num_layers]
    times, mems = [], []
    for s, r in enumerate(recompute_idx):
        ls = range(bounds[s], bounds[s + 1])
        times.append(sum(layer_time[r][l] for l in ls))
        mems.append(sum(layer_static[l] for l in ls) + in_flight[s] * sum(layer_act[r][l] for l in ls))
    return times, mems


def assign_stages(
    layer_time: Sequence[Sequence[float]],
    layer_act: Sequence[Sequence[float]],
    layer_static: Sequence[float],
    num_stages: int,
    in_flight: Sequence[int],
    capacity_bytes: float,
    *,
    recompute_options: Sequence[str] = ("none",),
    time_limit_s: float = 10.0,
    workers: int = 2,
) -> StageAssignment | None:
    """Minimise the slowest stage's time over contiguous stage splits and per-stage recomputation.

    ``layer_time[r][l]`` / ``layer_act[r][l]``: time per microbatch and activation bytes per in-flight
    microbatch of layer ``l`` under recomputation option ``r``; ``layer_static[l]``: bytes held regardless
    (parameters, gradients, optimizer state); ``in_flight[s]``: microbatches stage ``s`` keeps alive (1F1B:
    ``min(M, S - s)``). Every stage's memory must fit ``capacity_bytes``. Returns None when no split fits.
    """
    num_layers = len(layer_static)
    num_opts = len(recompute_options)
    if num_stages < 1 or num_stages > num_layers:
        raise ValueError(f"assign_stages: num_stages={num_stages} must be between 1 and the {num_layers} layers.")
    if len(in_flight) != num_stages:
        raise ValueError(f"assign_stages: in_flight has {len(in_flight)} entries for {num_stages} stages.")
    t0 = time.perf_counter()
    m = cp_model.CpModel()
    # Prefix sums per option: a stage [b_s, b_{s+1}) costs prefix[b_{s+1}] - prefix[b_s] (element constraints),
    # so the model has O(stages x options) variables whatever the number of layers.
    def prefix(values):
        out = [0]
        for v in values:
            out.append(out[-1] + v)
        return out

    t_pre = [prefix(max(0, round(layer_time[r][l] / _TIME_UNIT)) for l in range(num_layers)) for r in range(num_opts)]
    a_pre = [prefix(math.ceil(layer_act[r][l] / _MEM_UNIT) for l in range(num_layers)) for r in range(num_opts)]
    s_pre = prefix(math.ceil(b / _MEM_UNIT) for b in layer_static)
    cap = math.floor(capacity_bytes / _MEM_UNIT)

    bounds = [m.NewConstant(0)] + [m.NewIntVar(s, num_layers - num_stages + s, f"b{s}") for s in range(1, num_stages)]
    bounds.append(m.NewConstant(num_layers))
    for s in range(num_stages):
        m.Add(bounds[s + 1] >= bounds[s] + 1)

    def at(table, s, name):
        v = m.NewIntVar(0, table[-1], name)
        m.AddElement(bounds[s], table, v)
        return v

    static_at = [at(s_pre, s, f"S{s}") for s in range(num_stages + 1)]
    time_at = [[at(t_pre[r], s, f"T{r}_{s}") for s in range(num_stages + 1)] for r in range(num_opts)]
    act_at = [[at(a_pre[r], s, f"A{r}_{s}") for s in range(num_stages + 1)] for r in range(num_opts)]
    y = [[m.NewBoolVar(f"y{s}_{r}") for r in range(num_opts)] for s in range(num_stages)]
    bottleneck = m.NewIntVar(0, max(t[-1] for t in t_pre), "T")
    for s in range(num_stages):
        m.AddExactlyOne(y[s])
        for r in range(num_opts):
            m.Add(bottleneck >= time_at[r][s + 1] - time_at[r][s]).OnlyEnforceIf(y[s][r])
            m.Add(static_at[s + 1] - static_at[s] + in_flight[s] * (act_at[r][s + 1] - act_at[r][s]) <= cap
                  ).OnlyEnforceIf(y[s][r])
    # Redundant bounds that let the solver prove optimality quickly: the slowest stage is at least the
    # average stage and at least the slowest single layer (each at its cheapest option).
    cheapest = [min(t_pre[r][l + 1] - t_pre[r][l] for r in range(num_opts)) for l in range(num_layers)]
    m.Add(bottleneck * num_stages >= sum(cheapest))
    m.Add(bottleneck >= max(cheapest))
    m.Minimize(bottleneck)
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = time_limit_s
    solver.parameters.num_workers = workers
    solver.parameters.interleave_search = True  # workers take turns on one thread: the same plan every run
    status = solver.Solve(m)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None
    starts = [solver.Value(bounds[s]) for s in range(num_stages)]
    ridx = [next(r for r in range(num_opts) if solver.Value(y[s][r])) for s in range(num_stages)]
    times, mems = evaluate(starts, ridx, layer_time, layer_act, layer_static, in_flight)
    obj, bound = solver.ObjectiveValue(), solver.BestObjectiveBound()
    return StageAssignment(
        stage_starts=tuple(starts), recompute=tuple(recompute_options[r] for r in ridx), bottleneck_s=max(times),
        stage_times_s=tuple(times), stage_memory_bytes=tuple(mems), status=solver.StatusName(status),
        wall_time_s=time.perf_counter() - t0, gap=(obj - bound) / obj if obj else 0.0,
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class BlockAssignment:
    """The solver's answer for identical blocks: how many blocks each stage holds."""

    stage_blocks: tuple[int, ...]
    """Blocks per stage, in pipeline order."""
    recompute: tuple[str, ...]
    """Recomputation option chosen per stage."""
    bottleneck_s: float
    """Time of the slowest stage per microbatch under the given linear costs."""
    status: str
    """Solver status (``OPTIMAL`` or ``FEASIBLE``)."""
    wall_time_s: float
    """Solver wall time."""
    gap: float
    """Relative gap between the objective and the solver's bound (0 when optimal)."""


def evaluate_blocks(stage_blocks: Sequence[int], recompute_idx: Sequence[int], block_time, const_time, block_mem,
                    const_mem) -> tuple[list[float], list[float]]:
    """Stage times and memories of a block assignment (the cost model :func:`assign_blocks` encodes)."""
    times = [block_time[s][r] * n + const_time[s][r] for s, (n, r) in enumerate(zip(stage_blocks, recompute_idx))]
    mems = [block_mem[s][r] * n + const_mem[s][r] for s, (n, r) in enumerate(zip(stage_blocks, recompute_idx))]
    return times, mems


def assign_blocks(
    num_blocks: int,
    block_time: Sequence[Sequence[float]],
    const_time: Sequence[Sequence[float]],
    block_mem: Sequence[Sequence[float]],
    const_mem: Sequence[Sequence[float]],
    capacity_bytes: float,
    *,
    min_blocks: Sequence[int] | None = None,
    recompute_options: Sequence[Any] = ("none",),
    option_devices: Sequence[Sequence[int]] | None = None,
    total_devices: int | None = None,
    hint: tuple[Sequence[int], Sequence[int]] | None = None,
    time_limit_s: float = 10.0,
    workers: int = 2,
) -> BlockAssignment | None:
    """Split ``num_blocks`` identical blocks into contiguous stages, choosing a recomputation option per stage,
    to minimise the slowest stage's time under memory.

    When the blocks are identical (a transformer), a stage is described by its block count, so the model has
    O(stages x options) variables and constraints however deep the model and however many stages: stage ``s``
    with ``n`` blocks under option ``r`` takes ``block_time[s][r] * n + const_time[s][r]`` per microbatch and
    holds ``block_mem[s][r] * n + const_mem[s][r]`` bytes (per-stage coefficients carry what differs between
    stages: the embedding on the first, the head on the last, the microbatches each keeps in flight).
    ``min_blocks[s]`` (default 1) is the fewest blocks stage ``s`` may hold. The options are labelled by
    ``recompute_options`` (recomputation modes, or any labels such as (tensor degree, mode) pairs); with
    ``option_devices[s][o]``, option ``o`` of stage ``s`` occupies that many devices and the chosen options must
    occupy exactly ``total_devices`` (stages of different sizes). ``hint`` (blocks per stage, option index per
    stage) seeds the search with a known solution. Returns None when nothing fits.
    """
    num_stages = len(block_time)
    num_opts = len(recompute_options)
    lows = [1] * num_stages if min_blocks is None else list(min_blocks)
    if len(lows) != num_stages or any(len(x) != num_stages for x in (const_time, block_mem, const_mem)):
        raise ValueError(f"assign_blocks: give one row of coefficients per stage ({num_stages} stages).")
    if sum(lows) > num_blocks:
        raise ValueError(f"assign_blocks: {num_stages} stages need at least {sum(lows)} blocks; got {num_blocks}.")
    t0 = time.perf_counter()
    top = max(block_time[s][r] * num_blocks + const_time[s][r] for s in range(num_stages) for r in range(num_opts))
    unit = max(top, 1e-30) / 1e6  # times as integers with 1e-6 relative resolution
    mem_unit = max(1.0, capacity_bytes / 2**30)  # bytes per integer unit: about a billionth of the capacity
    cap = math.floor(capacity_bytes / mem_unit)
    tb = [[math.ceil(block_time[s][r] / unit) for r in range(num_opts)] for s in range(num_stages)]
    tc = [[math.ceil(const_time[s][r] / unit) for r in range(num_opts)] for s in range(num_stages)]
    mb = [[math.ceil(block_mem[s][r] / mem_unit) for r in range(num_opts)] for s in range(num_stages)]
    mc = [[math.ceil(const_mem[s][r] / mem_unit) for r in range(num_opts)] for s in range(num_stages)]
    m = cp_model.CpModel()
    n = [m.NewIntVar(lows[s], num_blocks, f"n{s}") for s in range(num_stages)]
    m.Add(sum(n) == num_blocks)
    y = [[m.NewBoolVar(f"y{s}_{r}") for r in range(num_opts)] for s in range(num_stages)]
    bottleneck = m.NewIntVar(0, max(tb[s][r] * num_blocks + tc[s][r] for s in range(num_stages)
                                    for r in range(num_opts)), "T")
    for s in range(num_stages):
        m.AddExactlyOne(y[s])
        for r in range(num_opts):
            # rounded up, so that what the solver accepts fits in exact arithmetic too
            m.Add(tb[s][r] * n[s] + tc[s][r] <= bottleneck).OnlyEnforceIf(y[s][r])
            m.Add(mb[s][r] * n[s] + mc[s][r] <= cap).OnlyEnforceIf(y[s][r])
    if option_devices is not None:
        m.Add(sum(option_devices[s][r] * y[s][r] for s in range(num_stages) for r in range(num_opts)) == total_devices)
    else:
        # Redundant: the slowest stage is at least the average of every stage at its cheapest option.
        m.Add(bottleneck * num_stages >= sum(min(tc[s]) for s in range(num_stages)) + min(map(min, tb)) * num_blocks)
    m.Minimize(bottleneck)
    if hint is not None:
        for s, (blocks_s, opt_s) in enumerate(zip(*hint)):
            m.AddHint(n[s], blocks_s)
            for r in range(num_opts):
                m.AddHint(y[s][r], r == opt_s)
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = time_limit_s
    solver.parameters.num_workers = workers
    solver.parameters.interleave_search = True  # workers take turns on one thread: the same plan every run
    status = solver.Solve(m)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None
    blocks = [solver.Value(v) for v in n]
    limit = solver.Value(bottleneck)
    chosen = [next(r for r in range(num_opts) if solver.Value(y[s][r])) for s in range(num_stages)]
    # The solver only cares about the slowest stage; every stage takes its fastest option (of the same size)
    # that fits in the solver's own integer terms, so that no stage recomputes needlessly.
    size = option_devices or [[0] * num_opts] * num_stages
    ridx = [min((r for r in range(num_opts) if tb[s][r] * blocks[s] + tc[s][r] <= limit
                 and mb[s][r] * blocks[s] + mc[s][r] <= cap and size[s][r] == size[s][chosen[s]]),
                key=lambda r: (tb[s][r] * blocks[s] + tc[s][r], r)) for s in range(num_stages)]
    times, _ = evaluate_blocks(blocks, ridx, block_time, const_time, block_mem, const_mem)
    obj, bound = solver.ObjectiveValue(), solver.BestObjectiveBound()
    return BlockAssignment(
        stage_blocks=tuple(blocks), recompute=tuple(recompute_options[r] for r in ridx), bottleneck_s=max(times),
        status=solver.StatusName(status), wall_time_s=time.perf_counter() - t0, gap=(obj - bound) / obj if obj else 0.0,
    )

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


def _per_option(values, num_opts: int) -> list[list[float]]:
    """``values`` per option: a list of lists as is, one list shared by every option."""
    if len(values) and isinstance(values[0], (list, tuple)):
        return [list(v) for v in values]
    return [list(values)] * num_opts


def evaluate(stage_starts: Sequence[int], recompute_idx: Sequence[int], layer_time, layer_act, layer_static,
             in_flight: Sequence[float]) -> tuple[list[float], list[float]]:
    """Stage times and memories of an assignment (the same cost model the CP-SAT model encodes)."""
    static = _per_option(layer_static, len(layer_time))
    num_layers = len(static[0])
    bounds = list(stage_starts) + [num_layers]
    times, mems = [], []
    for s, r in enumerate(recompute_idx):
        ls = range(bounds[s], bounds[s + 1])
        times.append(sum(layer_time[r][l] for l in ls))
        mems.append(sum(static[r][l] for l in ls) + in_flight[s] * sum(layer_act[r][l] for l in ls))
    return times, mems


def assign_stages(
    layer_time: Sequence[Sequence[float]],
    layer_act: Sequence[Sequence[float]],
    layer_static: Sequence[float] | Sequence[Sequence[float]],
    num_stages: int,
    in_flight: Sequence[float],
    capacity_bytes: float,
    *,
    recompute_options: Sequence[Any] = ("none",),
    cuttable: Sequence[bool] | None = None,
    hint: Sequence[int] | None = None,
    time_limit_s: float = 10.0,
    workers: int = 2,
) -> StageAssignment | None:
    """Minimise the slowest stage's time over contiguous stage splits and a per-stage option (recomputation).

    ``layer_time[r][l]`` / ``layer_act[r][l]``: time per microbatch and activation bytes per in-flight
    microbatch of layer ``l`` under option ``r``; ``layer_static[l]`` (or ``layer_static[r][l]``): bytes held
    regardless (parameters, gradients, optimizer state); ``in_flight[s]``: microbatches stage ``s`` keeps alive
    (1F1B: ``min(M, S - s)``; fractions allowed). Every stage's memory must fit ``capacity_bytes``.
    ``cuttable[l - 1]`` says whether a stage may begin at layer ``l`` (default: everywhere); ``hint`` (stage
    starts) seeds the search. Returns None when no split fits. Prefix sums per option make a stage's cost an
    element lookup, so the model has O(stages x options) variables however many layers there are.
    """
    num_opts = len(recompute_options)
    static = _per_option(layer_static, num_opts)
    num_layers = len(static[0])
    if num_stages < 1 or num_stages > num_layers:
        raise ValueError(f"assign_stages: num_stages={num_stages} must be between 1 and the {num_layers} layers.")
    if len(in_flight) != num_stages:
        raise ValueError(f"assign_stages: in_flight has {len(in_flight)} entries for {num_stages} stages.")
    t0 = time.perf_counter()
    # Fractional in-flight counts (interleaved chunks): scale activations so that the counts are integers.
    denom = 1
    while any(abs(k * denom - round(k * denom)) > 1e-9 for k in in_flight) and denom < 64:
        denom *= 2
    units = [int(round(k * denom)) for k in in_flight]
    m = cp_model.CpModel()

    def prefix(values):
        out = [0]
        for v in values:
            out.append(out[-1] + v)
        return out

    t_pre = [prefix(max(0, round(layer_time[r][l] / _TIME_UNIT)) for l in range(num_layers)) for r in range(num_opts)]
    a_pre = [prefix(math.ceil(layer_act[r][l] / denom / _MEM_UNIT) for l in range(num_layers))
             for r in range(num_opts)]
    s_pre = [prefix(math.ceil(b / _MEM_UNIT) for b in static[r]) for r in range(num_opts)]
    cap = math.floor(capacity_bytes / _MEM_UNIT)
    allowed = [l for l in range(1, num_layers) if cuttable is None or cuttable[l - 1]]
    bounds = [m.NewConstant(0)]
    for s in range(1, num_stages):
        dom = [l for l in allowed if s <= l <= num_layers - num_stages + s]
        if not dom:
            return None
        bounds.append(m.NewIntVarFromDomain(cp_model.Domain.FromValues(dom), f"b{s}"))
    bounds.append(m.NewConstant(num_layers))
    for s in range(num_stages):
        m.Add(bounds[s + 1] >= bounds[s] + 1)

    def at(table, s, name):
        v = m.NewIntVar(0, table[-1], name)
        m.AddElement(bounds[s], table, v)
        return v

    static_at = [[at(s_pre[r], s, f"S{r}_{s}") for s in range(num_stages + 1)] for r in range(num_opts)]
    time_at = [[at(t_pre[r], s, f"T{r}_{s}") for s in range(num_stages + 1)] for r in range(num_opts)]
    act_at = [[at(a_pre[r], s, f"A{r}_{s}") for s in range(num_stages + 1)] for r in range(num_opts)]
    y = [[m.NewBoolVar(f"y{s}_{r}") for r in range(num_opts)] for s in range(num_stages)]
    bottleneck = m.NewIntVar(0, max(t[-1] for t in t_pre), "T")
    for s in range(num_stages):
        m.AddExactlyOne(y[s])
        for r in range(num_opts):
            m.Add(bottleneck >= time_at[r][s + 1] - time_at[r][s]).OnlyEnforceIf(y[s][r])
            m.Add(static_at[r][s + 1] - static_at[r][s] + units[s] * (act_at[r][s + 1] - act_at[r][s]) <= cap
                  ).OnlyEnforceIf(y[s][r])
    # Redundant bounds that let the solver prove optimality quickly: the slowest stage is at least the
    # average stage and at least the slowest single layer (each at its cheapest option).
    cheapest = [min(t_pre[r][l + 1] - t_pre[r][l] for r in range(num_opts)) for l in range(num_layers)]
    m.Add(bottleneck * num_stages >= sum(cheapest))
    m.Add(bottleneck >= max(cheapest))
    m.Minimize(bottleneck)
    if hint is not None:
        for s in range(1, num_stages):
            m.AddHint(bounds[s], hint[s])
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = time_limit_s
    solver.parameters.num_workers = workers
    solver.parameters.interleave_search = True  # workers take turns on one thread: the same plan every run
    status = solver.Solve(m)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None
    starts = [solver.Value(bounds[s]) for s in range(num_stages)]
    limit = solver.Value(bottleneck)
    # The solver only cares about the slowest stage: every stage takes its fastest option that fits in the solver's
    # own integer terms, so that no stage recomputes needlessly.
    ends = starts[1:] + [num_layers]
    ridx = []
    for s in range(num_stages):
        a, b = starts[s], ends[s]
        ok = [r for r in range(num_opts) if t_pre[r][b] - t_pre[r][a] <= limit
              and s_pre[r][b] - s_pre[r][a] + units[s] * (a_pre[r][b] - a_pre[r][a]) <= cap]
        ridx.append(min(ok, key=lambda r: (t_pre[r][b] - t_pre[r][a], r)))
    times, mems = evaluate(starts, ridx, layer_time, layer_act, static, in_flight)
    obj, bound = solver.ObjectiveValue(), solver.BestObjectiveBound()
    return StageAssignment(
        stage_starts=tuple(starts), recompute=tuple(recompute_options[r] for r in ridx), bottleneck_s=max(times),
        stage_times_s=tuple(times), stage_memory_bytes=tuple(mems), status=solver.StatusName(status),
        wall_time_s=time.perf_counter() - t0, gap=(obj - bound) / obj if obj else 0.0,
    )

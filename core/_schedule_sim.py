"""Simulating a pipeline schedule (the IR of ``_schedule``): the lockstep
unit-cost run (:func:`simulate_ticks`) with the single linear issue order a
controller uses (:func:`dispatch_order`), and the timed discrete-event run with
per-stage durations (:func:`simulate_times`) that :func:`bubble_fraction` uses
to estimate pipeline idleness.  Pure Python, standard library only.
"""

from __future__ import annotations

from typing import Sequence

from autopp.core._schedule import Action, Schedule, _check_structure, _run_ticks, validate

__all__ = [
    "bubble_fraction",
    "dispatch_order",
    "simulate_ticks",
    "simulate_times",
]


def simulate_ticks(schedule: Schedule) -> dict[Action, int]:
    """Tick at which each action runs under unit cost and lockstep execution.

    At every tick each rank runs its next action if all its dependencies
    completed at earlier ticks.  Validates the schedule first.
    """
    _check_structure(schedule)
    return _run_ticks(schedule)


def dispatch_order(schedule: Schedule) -> list[tuple[int, Action]]:
    """A single linear order of ``(rank, action)`` respecting dependencies and
    each rank's row order: by tick, then by rank (see :func:`simulate_ticks`).
    """
    ticks = simulate_ticks(schedule)
    rank_of = {a: r for r, _, a in schedule.actions()}
    return sorted(((rank_of[a], a) for a in ticks), key=lambda ra: (ticks[ra[1]], ra[0]))


def _per_stage(name: str, value, num_stages: int) -> list[float]:
    values = list(value) if isinstance(value, Sequence) else [value] * num_stages
    if len(values) != num_stages:
        raise ValueError(f"{name} has {len(values)} entries for {num_stages} stages; give one per stage or a number")
    return [float(v) for v in values]


def _costs(schedule: Schedule, f_time, b_time, w_time) -> dict[str, list[float]]:
    """Per kind, the duration of each stage's action (``f_time`` etc. are numbers or one per stage)."""
    S = schedule.num_stages
    f, b = _per_stage("f_time", f_time, S), _per_stage("b_time", b_time, S)
    if not all(v > 0 for v in f):
        raise ValueError(f"f_time must be positive, got {f_time!r}")
    if not all(v >= 0 for v in b):  # (0: a stage with nothing to differentiate, a frozen teacher's)
        raise ValueError(f"b_time must be >= 0, got {b_time!r}")
    w = [x / 2.0 for x in b] if w_time is None else _per_stage("w_time", w_time, S)
    if not all(0 <= wi <= bi for wi, bi in zip(w, b)):
        raise ValueError(f"w_time must be in [0, b_time={b_time}], got {w_time!r}")
    return {"F": f, "B": b, "I": [bi - wi for bi, wi in zip(b, w)], "W": w}


def simulate_times(
    schedule: Schedule,
    f_time: float | Sequence[float] = 1.0,
    b_time: float | Sequence[float] = 2.0,
    w_time: float | Sequence[float] | None = None,
    *,
    send_time: float = 0.0,
) -> dict[Action, tuple[float, float]]:
    """``(start, end)`` of every action when each runs as soon as its rank is
    free and its dependencies are done (a discrete-event simulation of the schedule).

    Durations are numbers or one per stage: ``F`` costs ``f_time``, ``B``
    ``b_time``, ``I`` ``b_time - w_time`` and ``W`` ``w_time`` (half of
    ``b_time`` each when ``w_time`` is None).  A dependency on an action of
    another rank waits ``send_time`` more (the activation or gradient transfer).
    """
    costs = _costs(schedule, f_time, b_time, w_time)
    if not send_time >= 0:
        raise ValueError(f"send_time must be >= 0, got {send_time!r}")
    # Plain tuples instead of Actions on this hot path: the planner simulates schedules of 10^5 actions.
    S = schedule.num_stages
    rows = [[(a.stage, a.kind, a.microbatch) for a in row if a is not None] for row in schedule.rows]
    rank_of = {a: r for r, row in enumerate(rows) for a in row}

    def deps(a):
        s, kind, m = a
        if kind == "F":
            return ((s - 1, "F", m),) if s > 0 else ()
        if kind == "W":
            return ((s, "I", m),)
        if s + 1 < S:
            return ((s, "F", m), (s + 1, "I" if (s + 1, "I", m) in rank_of else "B", m))
        return ((s, "F", m),)

    needs = {a: deps(a) for a in rank_of}
    nxt = [0] * len(rows)
    free = [0.0] * len(rows)
    ends: dict[tuple, float] = {}
    starts: dict[tuple, float] = {}
    while len(ends) < len(rank_of):
        progressed = False
        for r, row in enumerate(rows):
            k = nxt[r]
            while k < len(row):
                a = row[k]
                start = free[r]
                for d in needs[a]:
                    done = ends.get(d)
                    if done is None:
                        break
                    if rank_of[d] != r:
                        done += send_time
                    if done > start:
                        start = done
                else:
                    starts[a] = start
                    free[r] = ends[a] = start + costs[a[1]][a[0]]
                    k += 1
                    continue
                break
            if k != nxt[r]:
                nxt[r] = k
                progressed = True
        if not progressed:
            validate(schedule)  # raises ScheduleError showing where it is stuck
            raise AssertionError("a valid schedule made no progress")
    return {a: (starts[key], ends[key]) for row in schedule.rows for a in row if a is not None
            for key in ((a.stage, a.kind, a.microbatch),)}


def bubble_fraction(
    schedule: Schedule,
    f_time: float | Sequence[float] = 1.0,
    b_time: float | Sequence[float] = 2.0,
    w_time: float | Sequence[float] | None = None,
) -> float:
    """Idle time / (ranks * makespan) under :func:`simulate_times`."""
    costs = _costs(schedule, f_time, b_time, w_time)
    times = simulate_times(schedule, f_time, b_time, w_time)
    makespan = max(end for _, end in times.values())
    busy = sum(costs[a.kind][a.stage] for a in times)
    total = schedule.num_ranks * makespan
    return (total - busy) / total

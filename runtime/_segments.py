"""Stages cut around their rolled scans, so that every stage's scan over layers is one program.

A model written with ``lax.scan`` over stacked layers runs on each pipeline stage as one rolled scan
(:mod:`autopp.core._reroll`), and the middle stages, which run the same iterations at other depths, are one
program. The first and the last stage hold more: the embedding before their iterations, the head and the loss
after them. Compiled whole, each of them is another copy of the layer's forward and backward, and compiling the
layer body is most of a scanned model's first call (on CPU a layer's scan body compiles in seconds).

:func:`segment_stages` cuts such a stage into *segments*: what comes before its rolled iterations, the iterations,
and what comes after them. The runtime runs each segment as a stage of its own on the stage's devices (a stage's
forward action becomes the segments' forwards in order, its backward their backwards in reverse, with the values
between them handed over in place), so the iterations of every stage compile as the middle stages' program, and
the embedding and the head as small programs of their own. The plan is not changed: its stages, devices and
schedule stay what they are; only the runtime's programs are smaller.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from jax.extend import core as jex_core

from autopp.core import Action, Schedule, batch_dependent_vars, find_scan_runs, stage_graphs
from autopp.profiler import split_at


@dataclasses.dataclass(frozen=True)
class Segments:
    """A split whose stages are the plan's stages cut into segments."""

    split: object
    """The segments as a :class:`~autopp.profiler.StageSplit` (one "stage" per segment)."""
    stage_of: tuple[int, ...]
    """The plan's stage each segment belongs to (non-decreasing)."""
    schedule: Schedule
    """The plan's schedule over the segments: each stage's F as its segments' F in order, its B, I and W in
    reverse order, on the stage's rank."""

    @property
    def num_segments(self) -> int:
        return len(self.stage_of)

    def per_segment(self, values: Sequence) -> list:
        """One value per segment from one per plan stage."""
        return [values[s] for s in self.stage_of]


def _out_stage(forward: jex_core.ClosedJaxpr, stage_eqns) -> list[int]:
    """The stage that emits each forward output: the last one that defines it."""
    defined_at = {}
    for s, ids in enumerate(stage_eqns):
        for i in ids:
            for v in forward.jaxpr.eqns[i].outvars:
                defined_at[v] = s
    last = len(stage_eqns) - 1
    return [last if isinstance(a, jex_core.Literal) else defined_at.get(a, last) for a in forward.jaxpr.outvars]


def segment_starts(forward: jex_core.ClosedJaxpr, batch_invars: Sequence[bool], diff_invars: Sequence[bool],
                   split) -> list[list[int]]:
    """Per stage of ``split``, the forward equations its segments begin with: the stage's own start, then, where
    the stage holds whole ``lax.scan`` iterations that roll into a scan and batch-dependent equations before or
    after them, the first batch-dependent equation of the iterations and the first one after them."""
    eqns = forward.jaxpr.eqns
    dep = batch_dependent_vars(forward.jaxpr, batch_invars)
    batch_dep = [any(v in dep for v in e.outvars) for e in eqns]
    graphs = stage_graphs(forward, split.stage_eqns, diff_invars, _out_stage(forward, split.stage_eqns))
    starts = []
    for ids, g in zip(split.stage_eqns, graphs):
        own = [i for i in ids if batch_dep[i]]
        cuts = [own[0]]
        runs = find_scan_runs(g.jaxpr)
        if runs:  # the stage's jaxpr holds its equations in order: equation j is forward equation ids[j]
            first = next((ids[j] for j in range(runs[0].start, runs[0].stop) if batch_dep[ids[j]]), None)
            after = next((ids[j] for j in range(runs[-1].stop, len(ids)) if batch_dep[ids[j]]), None)
            for c in (first, after):
                if c is not None and c > cuts[-1]:
                    cuts.append(c)
        starts.append(cuts)
    return starts


def expand_schedule(schedule: Schedule, stage_of: Sequence[int]) -> Schedule:
    """``schedule`` over segments: stage ``s``'s action on microbatch ``m`` becomes its segments' actions."""
    segments: dict[int, list[int]] = {}
    for v, s in enumerate(stage_of):
        segments.setdefault(s, []).append(v)
    rows = []
    for row in schedule.rows:
        new = []
        for a in row:
            if a is None:
                new.append(None)
                continue
            order = segments[a.stage] if a.kind == "F" else segments[a.stage][::-1]
            new.extend(Action(v, a.kind, a.microbatch) for v in order)
        rows.append(tuple(new))
    return Schedule(tuple(rows), num_stages=len(stage_of), num_microbatches=schedule.num_microbatches)


def segment_stages(forward: jex_core.ClosedJaxpr, batch_invars: Sequence[bool], diff_invars: Sequence[bool],
                   split, schedule: Schedule) -> Segments:
    """``split`` with each stage cut around its rolled scan iterations (:func:`segment_starts`); a split with
    nothing to cut comes back as it is, one segment per stage."""
    starts = segment_starts(forward, batch_invars, diff_invars, split)
    stage_of = tuple(s for s, cuts in enumerate(starts) for _ in cuts)
    if len(stage_of) == split.num_stages:
        return Segments(split, stage_of, schedule)
    segmented = split_at(forward, batch_invars, [c for cuts in starts for c in cuts])
    return Segments(segmented, stage_of, expand_schedule(schedule, stage_of))

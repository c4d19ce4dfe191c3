"""A measured timeline of one pipelined step: when each task ran on which devices.

:func:`run_with_timeline` runs a step normally (asynchronous dispatch, nothing serialised) while one watcher
thread per device group waits, in issue order, for each task's outputs on that group and stamps the moment
they are ready. A group runs its tasks one after another, so a task starts when the previous task of its group
has finished, its inputs are ready and the host has issued it; it ends when its outputs are ready. The result
exports to a Chrome/Perfetto trace (``chrome://tracing``, https://ui.perfetto.dev) and to a Gantt chart, with the
planner's predicted timeline beside the measured one when a plan with predicted stage times is given.
"""

from __future__ import annotations

import dataclasses
import json
import os
import queue
import re
import threading
import time
from collections.abc import Sequence
from typing import Any

import jax

from autopp.core import id_ranges

_ACTION = re.compile(r"^(\d+)([FBIW])(\d+)(\+(\d+)([FBIW])(\d+))?$")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TaskEvent:
    """One task of the step."""

    label: str
    """The task's label: a schedule action (``2F3``, ``1B0``, fused ``3F1+3B1``) or runtime work (``send 0->1 mb
    2``, ``post phase 0 stage 1``...)."""
    lane: str
    """The device group it ran on (``devices 0-1``), or for a transfer between processes the link into the group
    it delivers to (``link to devices 4-5``)."""
    start_s: float
    """Start, in seconds from the beginning of the step."""
    end_s: float
    """End, in seconds from the beginning of the step."""
    issued_s: float
    """When the host issued it."""

    @property
    def kind(self) -> str:
        """``F``, ``B``, ``I``, ``W``, ``FB`` (fused), ``send`` or ``other``."""
        m = _ACTION.match(self.label)
        if m:
            return "FB" if m.group(4) else m.group(2)
        if self.label.startswith("0F+0B all"):  # one stage: every microbatch's forward and backward in one program
            return "FB"
        return "send" if self.label.startswith(("send", "put")) else "other"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Timeline:
    """The measured timeline of one step."""

    events: tuple[TaskEvent, ...]
    """Every task, in issue order."""
    wall_s: float
    """Seconds from the first issue until every output was ready."""
    issue_s: float
    """Host seconds spent issuing the step's tasks."""
    critical_path_s: float
    """The longest chain of measured task durations through data dependencies and each group's order: what the
    step would take with no host overhead and no gaps."""

    def __repr__(self) -> str:
        lanes = self.lanes()
        return (f"Timeline({len(self.events)} tasks on {len(lanes)} lanes, wall {self.wall_s * 1e3:.4g} ms, host issue "
                f"{self.issue_s * 1e3:.4g} ms, critical path {self.critical_path_s * 1e3:.4g} ms, bubble fraction "
                f"{self.bubble_fraction():.3f}; .events has every task)")

    @property
    def overhead_s(self) -> float:
        """Wall time the critical path does not explain: host dispatch and runtime gaps."""
        return self.wall_s - self.critical_path_s

    def lanes(self) -> list[str]:
        """The lanes in device order (each group's link after it, the host last)."""
        return _in_device_order(e.lane for e in self.events)

    def bubble_fraction(self, kinds: Sequence[str] = ("F", "B", "I", "W", "FB")) -> float:
        """Idle share of the pipeline: 1 - (busy time of the schedule's actions) / (lanes x span of those
        actions), over the lanes that run actions; 0.0 when they span no measurable time (a step so short that
        every action had finished when the watchers looked)."""
        acts = [e for e in self.events if e.kind in kinds]
        if not acts:
            return 0.0
        lanes = {e.lane for e in acts}
        span = max(e.end_s for e in acts) - min(e.start_s for e in acts)
        if span <= 0:
            return 0.0
        busy = sum(e.end_s - e.start_s for e in acts)
        return 1.0 - busy / (len(lanes) * span)

    def to_chrome_trace(self, path: str | os.PathLike | None = None) -> dict[str, Any]:
        """The timeline in the Chrome trace event format (one thread per device group); written to ``path``
        when given."""
        lanes = {lane: i for i, lane in enumerate(self.lanes())}
        events = [{"name": "thread_name", "ph": "M", "pid": 0, "tid": i, "args": {"name": lane}}
                  for lane, i in lanes.items()]
        for e in self.events:
            events.append({"name": e.label, "cat": e.kind, "ph": "X", "pid": 0, "tid": lanes[e.lane],
                           "ts": e.start_s * 1e6, "dur": max(0.0, e.end_s - e.start_s) * 1e6,
                           "args": {"issued_us": e.issued_s * 1e6}})
        trace = {"traceEvents": events, "displayTimeUnit": "ms",
                 "otherData": {"wall_s": self.wall_s, "issue_s": self.issue_s,
                               "critical_path_s": self.critical_path_s}}
        if path is not None:
            with open(path, "w") as f:
                json.dump(trace, f)
        return trace

    def plot(self, path: str | os.PathLike, plan=None) -> None:
        """A Gantt chart PNG of the measured timeline; with a ``plan`` whose stages carry predicted times, the
        predicted timeline of its schedule is drawn below on the same time axis."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        colors = {"F": "#4C72B0", "B": "#DD8452", "FB": "#C44E52", "I": "#55A868", "W": "#8172B3",
                  "send": "#999999", "other": "#DDDDDD"}
        predicted = _predicted_events(plan) if plan is not None else []
        panels = [("measured", self.events)] + ([("predicted", predicted)] if predicted else [])
        fig, axes = plt.subplots(len(panels), 1, figsize=(12, 1.2 + 0.45 * sum(len({e.lane for e in ev})
                                                                               for _, ev in panels)),
                                 squeeze=False, sharex=True)  # one time axis: a 9x slower step shows as such
        for ax, (title, events) in zip(axes[:, 0], panels):
            lanes = _in_device_order(e.lane for e in events)
            for e in events:
                y = lanes.index(e.lane)
                ax.broken_barh([(e.start_s * 1e3, max(e.end_s - e.start_s, 0) * 1e3)], (y - 0.4, 0.8),
                               facecolors=colors.get(e.kind, "#DDDDDD"), edgecolor="white", linewidth=0.3)
            ax.set_yticks(range(len(lanes)), lanes)
            ax.invert_yaxis()
            ax.set_xlabel("ms")
            ax.set_title(title)
        handles = [matplotlib.patches.Patch(color=c, label=k) for k, c in colors.items()]
        axes[0, 0].legend(handles=handles, loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize="small",
                          frameon=False)  # beside the bars, not over a lane
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)


def _predicted_events(plan) -> list[TaskEvent]:
    """The plan's predicted timeline (event simulation of its schedule with its stages' predicted times)."""
    from autopp.core import Schedule, simulate_times

    if any(s.forward_time_s is None or s.backward_time_s is None for s in plan.stages):
        return []
    sched = Schedule.from_text(plan.schedule_text, num_stages=plan.num_stages, num_microbatches=plan.num_microbatches)
    times = simulate_times(sched, [s.forward_time_s for s in plan.stages], [s.backward_time_s for s in plan.stages])
    rank_of = {a: r for r, _, a in sched.actions()}
    lane = {r: "devices " + id_ranges(sorted(plan.stages[sched.rank_stages()[r][0]].devices))
            for r in range(sched.num_ranks)}
    return [TaskEvent(label=str(a), lane=lane[rank_of[a]], start_s=s, end_s=e, issued_s=0.0)
            for a, (s, e) in sorted(times.items(), key=lambda x: x[1])]


def _in_device_order(lanes) -> list[str]:
    """Distinct lanes ordered by their first device id (``devices 2-3`` before ``devices 10-11``, a group's link
    right after it), the host last."""
    def key(lane: str):
        digits = re.search(r"\d+", lane)
        return (digits is None, int(digits.group()) if digits else 0, lane.startswith("link"), lane)

    return sorted(dict.fromkeys(lanes), key=key)


def _lane(task) -> str:
    """Where a task runs: its devices' group; a send between stages (a transfer between processes too) on the link
    into its devices: it moves data while the group computes, and on the group's own lane it would wait for the
    group's earlier tasks and look as long as they; the host for a task on no device."""
    if not task.devices:
        return "host"
    if getattr(task.fn, "kind", None) == "cross" or task.label.startswith("send "):
        return "link to devices " + id_ranges(sorted(task.devices))
    return "devices " + id_ranges(sorted(task.devices))


def _donated_inputs(fn) -> list[bool]:
    """Per argument of a task's program, whether it donates the buffer (none for a transfer)."""
    source = getattr(fn, "lowered", None) or fn  # a program still compiling: its lowering says
    info = getattr(source, "args_info", None)
    if info is None:
        return []
    return [bool(a.donated) for a in jax.tree.leaves(info, is_leaf=lambda a: hasattr(a, "donated"))]


def _probe_of(aval):
    """``probe(x) -> arrays``: for an output a later task donates (a gradient accumulator handed on), one element of
    each of its shards read by a tiny program compiled now, issued right after the task: once the next task takes
    the buffer, the array can no longer be waited on, and the probe's result can."""
    sharding = getattr(aval, "sharding", None)
    if sharding is None or not hasattr(sharding, "shard_shape"):
        return None
    shape = sharding.shard_shape(aval.shape)
    programs = {d: _first_element.lower(jax.ShapeDtypeStruct(shape, aval.dtype,
                                                             sharding=jax.sharding.SingleDeviceSharding(d))).compile()
                for d in sharding.addressable_devices}

    def probe(x):
        return [programs[s.device](s.data) for s in x.addressable_shards if s.device in programs]

    return probe


@jax.jit
def _first_element(x):
    return x.reshape(-1)[:1]


def _watch_plan(executable) -> list[tuple[int | None, Any]]:
    """Per task, what its watcher waits on: (index of an output no later task donates, None), else (None, a probe
    of its first output), else (None, None) (a task with no outputs, or whose donated output a probe cannot read:
    it is stamped when the watcher reaches it)."""
    tasks = executable.tasks
    donated = set()
    for t in tasks:
        donated.update(t.donated)
        donated.update(i for i, d in zip(t.ins, _donated_inputs(t.fn)) if d)
    plan = []
    for t in tasks:
        kept = [j for j, o in enumerate(t.outs) if o not in donated]
        if kept or not t.outs:
            plan.append((kept[0] if kept else None, None))
        else:
            plan.append((None, _probe_of(executable.slot_avals.get(t.outs[0]))))
    return plan


def run_with_timeline(executable, flat_args: Sequence[Any]) -> tuple[list[Any], Timeline]:
    """Run one step of a built executable, recording its timeline; returns (outputs, timeline). Its programs are
    compiled first (a step waiting for its compilation would time that instead)."""
    tasks = executable.resolve().tasks
    lane_of = [_lane(t) for t in tasks]
    lanes = list(dict.fromkeys(lane_of))
    queues = {lane: queue.SimpleQueue() for lane in lanes}
    issued = [0.0] * len(tasks)
    ready = [0.0] * len(tasks)
    watched = _watch_plan(executable)  # the probes compile here, before the step

    def watch(q):
        while True:
            item = q.get()
            if item is None:
                return
            k, outs = item
            jax.block_until_ready(outs)
            ready[k] = time.perf_counter()

    threads = [threading.Thread(target=watch, args=(queues[lane],), daemon=True) for lane in lanes]
    for th in threads:
        th.start()

    def on_dispatch(k, outs):
        issued[k] = time.perf_counter()
        index, probe = watched[k]
        queues[lane_of[k]].put((k, outs[index] if index is not None else probe(outs[0]) if probe else ()))

    t0 = time.perf_counter()
    outputs = executable.run(flat_args, on_dispatch=on_dispatch)
    issue_end = time.perf_counter()
    jax.block_until_ready(outputs)
    for lane in lanes:
        queues[lane].put(None)
    for th in threads:
        th.join()
    wall_end = max([time.perf_counter()] + ready)
    # Starts: after the host issued the task, its inputs were ready and its group finished the previous task.
    producer = {}
    for k, t in enumerate(tasks):
        for o in t.outs:
            producer[o] = k
    last_in_lane: dict[str, int] = {}
    start = [0.0] * len(tasks)
    end = [0.0] * len(tasks)
    path = [0.0] * len(tasks)  # longest chain of durations ending with task k
    for k, t in enumerate(tasks):
        preds = [producer[i] for i in t.ins if i in producer]
        if lane_of[k] in last_in_lane:
            preds.append(last_in_lane[lane_of[k]])
        start[k] = max([issued[k]] + [end[p] for p in preds])
        end[k] = max(ready[k], start[k])  # a stamp can trail its task; never before the task could start
        path[k] = end[k] - start[k] + max([path[p] for p in preds], default=0.0)
        last_in_lane[lane_of[k]] = k
    events = tuple(TaskEvent(label=t.label, lane=lane_of[k], start_s=start[k] - t0, end_s=end[k] - t0,
                             issued_s=issued[k] - t0) for k, t in enumerate(tasks))
    wall_end = max([wall_end] + end)
    return outputs, Timeline(events=events, wall_s=wall_end - t0, issue_s=issue_end - t0,
                             critical_path_s=max(path, default=0.0))

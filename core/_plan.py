"""The plan: what a pipelined step will do (stages, devices, layouts, microbatches, schedule), what the planner
predicts for it, and how the planner found it."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from autopp.core._estimate import RECOMPUTE_MODES, SCHEDULES, Estimate, unit

SCHEMA_VERSION = 4
READABLE_SCHEMA_VERSIONS = (1, 2, 3, 4)
"""Versions :meth:`Plan.from_dict` reads (version 1 plans lack the layout, prediction and planner fields; version 2
plans the per-parameter layouts, ZeRO-1, sequence parallelism and the per-layer sharding reports; version 3 plans
the layers' equations)."""

MESH_AXES = ("data", "fsdp", "tensor")
"""Axes of a stage's sub-mesh: batch split (data), batch split with sharded state (FSDP/ZeRO-3), Megatron
tensor parallelism."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class StagePlan:
    """One pipeline stage."""

    index: int
    """Position in the pipeline (0 runs first in the forward pass)."""
    devices: tuple[int, ...]
    """Ids of the devices of this stage's sub-mesh."""
    mesh_shape: dict[str, int]
    """Axes of the stage's sub-mesh and their sizes, e.g. ``{"data": 2}``; ``devices`` lists the mesh in row-major
    order of ``data``, ``fsdp``, ``tensor`` (a tensor-parallel group is consecutive devices)."""
    equations: tuple[int, int] | None
    """First and last index (inclusive) of the loss's forward equations this stage computes (the
    first one, ``equations[0]``, is what a replayed plan splits at); None in a plan made offline from a model
    description, which is not traced."""
    num_equations: int | None
    """How many forward equations the stage runs (parameter-only ones shared with other stages included)."""
    flops: float
    """Forward FLOPs of one data replica's microbatch on this stage (the whole microbatch's over the stage's data
    degree)."""
    param_bytes: int
    """Bytes of the parameters this stage holds: each it reads (a block shared across depth, a tied embedding, on
    every stage that reads it, as the runtime keeps a copy and a gradient there)."""
    cut_bytes_after: int
    """Activation bytes a data replica sends to later stages per microbatch (0 for the last stage)."""
    layers: tuple[int, int] | None = None
    """First and last index (inclusive) of the profiler's layers on this stage (None when the stage was split
    by equations without layers)."""
    recompute: str = "none"
    """Activation recomputation on this stage: ``none``, ``full`` or ``selective``."""
    forward_time_s: float | None = None
    """Predicted seconds of one microbatch's forward on this stage (communication included), if predicted."""
    backward_time_s: float | None = None
    """Predicted seconds of one microbatch's backward on this stage (recomputation included), if predicted."""
    param_specs: dict[str, list] | None = None
    """Per parameter this stage reads (the loss's forward input index, as a string): its layout over the stage's
    ``tensor`` axis, one entry per dimension (``"tensor"`` where it is split, None elsewhere), as the sharding ILP
    chose it. None: the runtime's own rule (Megatron's column/row split read off the jaxpr)."""

    def __post_init__(self) -> None:
        unknown = sorted(set(self.mesh_shape) - set(MESH_AXES))
        if unknown:
            raise ValueError(f"stage {self.index}: unknown mesh axes {unknown}; a stage mesh has the axes {MESH_AXES}.")
        size = 1
        for n in self.mesh_shape.values():
            size *= n
        if size != len(self.devices):
            raise ValueError(f"stage {self.index}: mesh shape {self.mesh_shape} has {size} devices but the stage "
                             f"lists {len(self.devices)}; make the product of the axis sizes the device count.")
        if self.recompute not in RECOMPUTE_MODES:
            raise ValueError(f"stage {self.index}: unknown recompute {self.recompute!r}; use none, full or selective.")

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["devices"] = list(self.devices)
        for key in ("equations", "layers"):
            d[key] = None if d[key] is None else list(d[key])
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StagePlan:
        _check_fields(cls, data, "stage")
        d = dict(data)
        d["devices"] = tuple(d["devices"])
        for key in ("equations", "layers"):
            if d.get(key) is not None:
                d[key] = tuple(d[key])
        d["mesh_shape"] = dict(d["mesh_shape"])
        return cls(**d)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlannerStats:
    """How the planner found a plan."""

    wall_time_s: float
    """Seconds of planning (profiling included)."""
    solver_status: str
    """CP-SAT's status for the chosen plan's stage assignment (``OPTIMAL``, ``FEASIBLE``), or ``UNIFORM`` when
    the best plan is an equal split that the solver could not improve."""
    optimality_gap: float
    """Relative gap between CP-SAT's objective and its bound for that assignment (0 when optimal)."""
    candidates: int
    """Layouts (tensor, pipeline, data, FSDP degrees x microbatch size x schedule x recomputation) evaluated."""
    best_uniform_step_time_s: float
    """Predicted step time of the best equal-split layout found by enumeration (the plan is never slower)."""
    bounded: int = 0
    """Layouts not evaluated because a lower bound on their step time (their compute alone) showed they could not
    be among the best kept."""
    sharding_solves: int = 0
    """Intra-operator sharding ILPs solved (one per distinct layer, tensor degree and boundary layout)."""
    sharding_solve_s: float = 0.0
    """Seconds spent building and solving them."""
    sharding_max_gap: float = 0.0
    """Largest relative optimality gap among them (0 when every one was solved to optimality)."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True, kw_only=True)
class LayerSharding:
    """How one layer is laid out over its stage's tensor axis, and what that costs per microbatch."""

    index: int
    """The profiler's layer index."""
    name: str
    """The layer's name (``embed``, ``block 3``, ``head``, ...)."""
    params: dict[str, str]
    """Parameter (its pytree path) -> layout: ``R`` (replicated) or ``S(d)`` (split along dimension ``d``)."""
    collectives: list
    """``[kind, bytes, seconds, pass]`` per tensor-group collective of one microbatch (``pass``: forward or
    backward)."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _schedule_grid(text: str) -> list[list[str]]:
    return [line.split() for line in text.strip().splitlines()]


def _named_grid(plan: Plan) -> list[list[str]] | None:
    """The grid of the named schedule for ``plan``'s stages and microbatches (None: it cannot be built)."""
    from autopp.core._schedules import get_schedule

    try:
        return _schedule_grid(get_schedule(plan.schedule, len(plan.stages), plan.num_microbatches,
                                           virtual_stages=plan.virtual_stages).to_text())
    except ValueError:
        return None


@dataclasses.dataclass(frozen=True, kw_only=True)
class Plan:
    """A complete pipeline plan for one traced step on a set of devices."""

    model_fingerprint: str
    """Hash of the traced step (shapes, dtypes, operations); a plan only replays on the same step."""
    stages: tuple[StagePlan, ...]
    """The pipeline stages, in order."""
    num_microbatches: int
    """Microbatches per step; the batch is split along the leading dimension of each batch leaf."""
    schedule: str
    """Schedule name (``gpipe``, ``1f1b``, ...)."""
    schedule_text: str
    """The schedule as text, one row per rank (see :class:`autopp.runtime.Schedule`)."""
    loss_reduction: str
    """How microbatch losses and gradients combine: ``mean`` or ``sum``."""
    microbatch_size: int | None = None
    """Examples per microbatch per data-parallel replica (None when not fixed by the planner)."""
    virtual_stages: int = 1
    """Model chunks per device with ``interleaved-1f1b`` (1 otherwise)."""
    cluster: dict[str, Any] | None = None
    """The cluster the plan was made for (:meth:`autopp.Cluster.to_dict`), or None for the local devices."""
    predicted: Estimate | None = None
    """What the planner predicts for one step (step time, TFLOP/s and memory per device, ...)."""
    planner: PlannerStats | None = None
    """How the plan was found (None for a plan with fixed stage and microbatch counts)."""
    zero1: bool = False
    """Optimizer state sharded over each stage's data-parallel replicas (ZeRO-1, distributed optimizer)."""
    sequence_parallel: bool = False
    """Activations between layers split along their sequence over each stage's tensor axis."""
    layer_shardings: tuple[LayerSharding, ...] = ()
    """Per layer: its parameters' layouts and the tensor-parallel communication it costs (reports)."""
    layer_equations: tuple[tuple[int, int], ...] = ()
    """With ``sequence_parallel``: each profile layer's first and last (inclusive) forward equation, in the
    pipeline's per-microbatch forward; the activations that cross from one layer into the next are the ones split
    along their sequence. Empty otherwise (and in a plan made offline, which is completed when it is replayed)."""
    schema_version: int = SCHEMA_VERSION
    """Version of this plan's JSON layout."""

    def __post_init__(self) -> None:
        def bad(field, value, fix):
            raise ValueError(f"plan: {field}={value!r} is not valid; {fix}. Make the plan again with "
                             "step.plan_for(...) or autopp.planner.plan_model(...) rather than editing it by hand.")

        for field in ("num_microbatches", "virtual_stages"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                bad(field, value, "it must be a positive int")
        if self.microbatch_size is not None and (isinstance(self.microbatch_size, bool)
                                                 or not isinstance(self.microbatch_size, int)
                                                 or self.microbatch_size < 1):
            bad("microbatch_size", self.microbatch_size, "it must be a positive int or null")
        if self.schedule not in SCHEDULES + ("custom",):
            bad("schedule", self.schedule, f"use one of {', '.join(SCHEDULES)} (or custom)")
        if self.loss_reduction not in ("mean", "sum"):
            bad("loss_reduction", self.loss_reduction, "use mean or sum")
        for field in ("zero1", "sequence_parallel"):
            if not isinstance(getattr(self, field), bool):
                bad(field, getattr(self, field), "it must be true or false")
        if not self.stages or not all(isinstance(st, StagePlan) for st in self.stages):
            bad("stages", self.stages, "a plan has one or more stages")
        if not isinstance(self.schedule_text, str) or not isinstance(self.model_fingerprint, str):
            bad("schedule_text" if not isinstance(self.schedule_text, str) else "model_fingerprint",
                self.schedule_text if not isinstance(self.schedule_text, str) else self.model_fingerprint,
                "it must be text")
        if self.schedule != "custom" and _schedule_grid(self.schedule_text) != _named_grid(self):
            bad("schedule", self.schedule, f"schedule_text (what runs) is not {self.schedule}'s grid for "
                f"{len(self.stages)} stages and {self.num_microbatches} microbatches; name the schedule the text "
                "is, or custom")

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def to_dict(self) -> dict[str, Any]:
        """The plan as JSON-ready data (what :meth:`to_json` writes); ``Plan.from_dict(p.to_dict()) == p``."""
        return {
            "schema_version": self.schema_version,
            "model_fingerprint": self.model_fingerprint,
            "num_microbatches": self.num_microbatches,
            "microbatch_size": self.microbatch_size,
            "schedule": self.schedule,
            "virtual_stages": self.virtual_stages,
            "schedule_text": self.schedule_text,
            "loss_reduction": self.loss_reduction,
            "cluster": self.cluster,
            "predicted": None if self.predicted is None else self.predicted.to_dict(),
            "planner": None if self.planner is None else self.planner.to_dict(),
            "zero1": self.zero1,
            "sequence_parallel": self.sequence_parallel,
            "stages": [s.to_dict() for s in self.stages],
            "layer_shardings": [x.to_dict() for x in self.layer_shardings],
            "layer_equations": [list(r) for r in self.layer_equations],
        }

    def to_json(self, path: str | os.PathLike | None = None) -> str:
        """The plan as JSON text; also written to ``path`` when given."""
        text = json.dumps(self.to_dict(), indent=2)
        if path is not None:
            with open(path, "w") as f:
                f.write(text + "\n")
        return text

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Plan:
        """The plan :meth:`to_dict` made (checked: schema version, fields, stages); ValueError naming what is wrong."""
        if not isinstance(data, dict):
            raise ValueError(f"a plan must be a JSON object, got {type(data).__name__}.")
        version = data.get("schema_version")
        if version not in READABLE_SCHEMA_VERSIONS:
            raise ValueError(
                f"plan schema version {version!r} is not supported: this autopp reads version(s) "
                f"{', '.join(map(str, READABLE_SCHEMA_VERSIONS))}. Make the plan again with this version of autopp "
                "(step.plan_for(...).to_json(path) or `autopp plan ... --out plan.json`)."
            )
        _check_fields(cls, data, "plan")
        d = dict(data)
        d["schema_version"] = SCHEMA_VERSION  # read as the current version (missing fields take their defaults)
        d["stages"] = tuple(StagePlan.from_dict(st) for st in d["stages"])
        for key, kind in (("predicted", Estimate), ("planner", PlannerStats)):
            if d.get(key) is not None:
                _check_fields(kind, d[key], key)
                d[key] = kind(**d[key])
        shardings = []
        for x in d.get("layer_shardings") or ():
            _check_fields(LayerSharding, x, "layer sharding")
            shardings.append(LayerSharding(**x))
        d["layer_shardings"] = tuple(shardings)
        d["layer_equations"] = tuple(tuple(r) for r in d.get("layer_equations") or ())
        return cls(**d)

    @classmethod
    def from_json(cls, source: str | os.PathLike) -> Plan:
        """Read a plan from a JSON file path (or from JSON text)."""
        if isinstance(source, dict):
            raise TypeError("Plan.from_json takes a file path or JSON text, got a dict; use Plan.from_dict(data) "
                            "for a plan already parsed.")
        if not isinstance(source, (str, os.PathLike)):
            raise TypeError(f"Plan.from_json takes a file path or JSON text, got {type(source).__name__} "
                            f"{source!r:.60}; pass the path of a file written by plan.to_json(path).")
        text = str(source)
        origin = "the given text"
        if not text.lstrip().startswith("{"):
            origin = repr(text)
            try:
                with open(source) as f:
                    text = f.read()
            except OSError as e:
                raise ValueError(f"cannot read plan file {origin}: {e.strerror}.") from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(
                f"plan {origin} is not valid JSON ({e.msg} at line {e.lineno}, column {e.colno}); it may be "
                "truncated or edited by hand. Write it again with plan.to_json(path)."
            ) from None
        return cls.from_dict(data)

    def timeline(self, width: int = 100) -> str:
        """The predicted timeline as text, one line per device group: which stage's ``F``/``B``/``I``/``W`` runs
        in each of ``width`` time slices (the letter of the action covering most of the slice; ``.`` idle), from
        the event simulation of the schedule with each stage's predicted times. Empty when the plan has none."""
        from autopp.core._schedule import Schedule
        from autopp.core._schedule_sim import simulate_times

        if any(s.forward_time_s is None or s.backward_time_s is None for s in self.stages):
            return ""
        sched = Schedule.from_text(self.schedule_text, num_stages=self.num_stages,
                                   num_microbatches=self.num_microbatches)
        times = simulate_times(sched, [s.forward_time_s for s in self.stages],
                               [s.backward_time_s for s in self.stages])
        makespan = max(end for _, end in times.values())
        slot = makespan / width
        rank_of = {a: r for r, _, a in sched.actions()}
        cover = [[{} for _ in range(width)] for _ in range(sched.num_ranks)]
        for a, (start, end) in times.items():
            for k in range(int(start / slot), min(width, int(end / slot) + 1)):
                overlap = min(end, (k + 1) * slot) - max(start, k * slot)
                if overlap > 0:
                    cover[rank_of[a]][k][a.kind] = cover[rank_of[a]][k].get(a.kind, 0.0) + overlap
        lines = [f"predicted timeline: {makespan * 1e3:.4g} ms for the pipeline, {slot * 1e3:.3g} ms per column "
                 "(F forward, B backward, I/W input/weight gradient, . idle)"]
        for r, row in enumerate(cover):
            chars = "".join(max(c, key=c.get) if c and sum(c.values()) >= slot / 2 else "." for c in row)
            lines.append(f"  group {r:>3} |{chars}|")
        return "\n".join(lines)

    def __str__(self) -> str:
        mb = f" of {self.microbatch_size} example(s) per data-parallel replica" if self.microbatch_size else ""
        sched = self.schedule + (f" (v={self.virtual_stages})" if self.virtual_stages > 1 else "")
        lines = [f"pipeline: {self.num_stages} stage(s), {self.num_microbatches} microbatch(es){mb}, "
                 f"schedule {sched}, loss reduction {self.loss_reduction}"]
        if self.zero1:
            lines[0] += ", ZeRO-1 (optimizer state sharded over data)"
        if self.sequence_parallel:
            lines[0] += ", sequence parallel"
        if self.cluster is not None:
            lines[0] += f", cluster {self.cluster['num_nodes']}x{self.cluster['devices_per_node']}x" \
                        f"{self.cluster['device']['name']}"
        lines.append(f"{'stage':>5}  {'devices':<16} {'layout':<22} {'layers':>9} {'equations':>11}  "
                     f"{'recompute':<9}  {'fwd GFLOP/mb':>12}  {'params MB':>10}  {'sends MB/mb':>11}")
        for s in self.stages:
            eq = "-" if s.equations is None else f"{s.equations[0]}-{s.equations[1]}"
            layers = "-" if s.layers is None else f"{s.layers[0]}-{s.layers[1]}"
            layout = " ".join(f"{k}={v}" for k, v in s.mesh_shape.items() if v > 1) or "1 device"
            lines.append(
                f"{s.index:>5}  {id_ranges(s.devices):<16} {layout:<22} {layers:>9} {eq:>11}  {s.recompute:<9}  "
                f"{s.flops / 1e9:>12.4g}  {s.param_bytes / 1e6:>10.4g}  {s.cut_bytes_after / 1e6:>11.4g}"
            )
        if self.predicted is not None:
            e = self.predicted
            copies = e.update_copy_bytes  # (the update's new values set the peak, not the activations)
            rest = (e.peak_memory_bytes_per_gpu - e.param_bytes - e.optimizer_bytes
                    - (copies if copies else e.activation_bytes))
            fsdp = any(s.mesh_shape.get("fsdp", 1) > 1 for s in self.stages)
            div, name = unit(e.peak_memory_bytes_per_gpu, "bytes")
            rest_text = (f", {'gathered FSDP layers' if fsdp else 'other buffers'} {rest / div:.2f}"
                         if rest > 0.005 * div else "")
            if copies:
                rest_text = (f", the update's new parameters and state beside the caller's (not in donate_argnums) "
                             f"{copies / div:.2f}{rest_text} {name}; activations {e.activation_bytes / div:.2f} "
                             f"{name} are freed before it")
            fdiv, fname = unit(e.tflops_per_gpu * 1e12, "flop")
            lines.append(
                f"predicted: step {e.step_time_s:.4g} s, {e.tflops_per_gpu * 1e12 / fdiv:.4g} {fname}/s per device "
                f"executed (recomputation included), MFU "
                f"{'-' if e.mfu is None else f'{100 * e.mfu:.1f}% (model FLOPs)'}, "
                f"peak memory {e.peak_memory_bytes_per_gpu / div:.2f} {name} per device "
                f"({'fits' if e.fits else 'DOES NOT FIT'}: weights and gradients {e.param_bytes / div:.2f}, "
                f"optimizer state {e.optimizer_bytes / div:.2f}"
                f"{'' if copies else f', activations {e.activation_bytes / div:.2f}'}{rest_text}"
                f"{'' if copies else f' {name}'})")
            lines.append(
                f"  time: compute {e.compute_s:.4g} s, bubble {e.bubble_s:.4g}, tensor-parallel {e.tp_comm_s:.4g}, "
                f"FSDP {e.fsdp_comm_s:.4g}, pipeline sends {e.pp_comm_s:.4g}, data-parallel {e.dp_comm_s:.4g}, "
                f"optimizer {e.optimizer_s:.4g}" + (f", host dispatch {e.dispatch_s:.4g}" if e.dispatch_s else ""))
        if self.planner is not None:
            st = self.planner
            lines.append(
                f"planner: {st.wall_time_s:.2f} s, {st.candidates} layouts evaluated ({st.bounded} bounded out), "
                f"stage split {split_summary(self)}, best equal split {st.best_uniform_step_time_s:.4g} s")
        return "\n".join(lines)


def split_summary(plan: Plan) -> str:
    """How the plan's stage split was found, in words: CP-SAT's status and gap, or why the equal split stands."""
    st = plan.planner
    if st.solver_status != "UNIFORM":
        return f"{st.solver_status} (gap {100 * st.optimality_gap:.2g}%)"
    if plan.num_stages == 1:
        return "none (one stage)"
    return ("equal (UNIFORM: no CP-SAT split, balanced by compute and memory, came out faster under the whole cost "
            "model, which also weighs the schedule, sends and each stage's data-parallel reduction)")


def id_ranges(ids: tuple[int, ...]) -> str:
    """``0,1,2,3,8`` -> ``0-3,8``."""
    runs: list[list[int]] = []
    for i in ids:
        if runs and runs[-1][1] == i - 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def _check_fields(cls, data: dict, what: str) -> None:
    names = {f.name for f in dataclasses.fields(cls)}
    required = {f.name for f in dataclasses.fields(cls)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    missing = sorted(required - set(data))
    unknown = sorted(set(data) - names)
    if missing or unknown:
        raise ValueError(
            f"malformed {what} in plan: "
            + (f"missing field(s) {missing}" if missing else "")
            + ("; " if missing and unknown else "")
            + (f"unknown field(s) {unknown}" if unknown else "")
            + f". A {what} has the fields {sorted(names)}."
        )

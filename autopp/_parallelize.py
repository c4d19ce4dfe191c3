"""``autopp.parallelize``: trace -> split -> build the pipeline -> run."""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import time
from collections.abc import Callable, Sequence
from typing import Any, Generic, ParamSpec, TypeVar, overload

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex_core

from autopp._progress import phase
from autopp.core import (
    Plan,
    RECOMPUTE_MODES,
    SCHEDULE_NAMES,
    Schedule,
    StagePlan,
    TracedStep,
    batch_dependent_vars,
    check_array_leaves,
    check_batch_divisible,
    get_schedule,
    normalize_batch_argnums,
    trace_microbatch_forward,
    trace_step,
    validate,
)
from autopp.planner import CONFIG_FINGERPRINT, LocalPlan, plan_local
from autopp.profiler import Cluster, Profile, StageSplit, aval_bytes, profile, split_at, split_stages
from autopp.runtime import Executable, build_executable

_P = ParamSpec("_P")
_R = TypeVar("_R")

LOSS_REDUCTIONS = ("mean", "sum")
_ACTION_TOKEN = re.compile(r"\b\d+[FBIW]\d+\b")


def _check_layout(layout):
    if layout is None:
        return None
    many = layout if isinstance(layout, (list, tuple)) else [layout]
    for lay in many:
        if not isinstance(lay, dict):
            raise TypeError(f"autopp.parallelize: layout must be a dict such as {{'fsdp': 2}} or a list of them (one "
                            f"per device group), got {lay!r}.")
        unknown = sorted(set(lay) - {"data", "fsdp", "tensor"})
        if unknown:
            raise ValueError(f"autopp.parallelize: layout {lay} has unknown axes {unknown}; the axes are data, fsdp, "
                             "tensor.")
        for k, v in lay.items():
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"autopp.parallelize: layout {lay}: {k} must be a positive int, got {v!r}.")
    return [dict(x) for x in layout] if isinstance(layout, (list, tuple)) else dict(layout)


def _looks_like_text(schedule: str) -> bool:
    return bool(_ACTION_TOKEN.search(schedule))


def _parse_schedule_text(text: str) -> Schedule:
    try:
        sched = Schedule.from_text(text)
    except ValueError as e:
        raise ValueError(f"autopp.parallelize: the schedule text does not parse: {e}") from None
    validate(sched)
    return sched


def _check_count(name: str, value, allow_none=True) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"autopp.parallelize: {name} must be a positive int, got {value!r} ({type(value).__name__}).")
    if value <= 0:
        raise ValueError(f"autopp.parallelize: {name} must be a positive int, got {value}; use e.g. {name}=1.")


class Parallelized(Generic[_P, _R]):
    """A training step run as an MPMD pipeline. Call it like the step it wraps.

    With none of ``num_stages``, ``num_microbatches``, ``schedule`` and ``plan`` given, the first call for
    each argument shape profiles the step on the local device (``autopp.profiler.profile(..., measure=True)``)
    and plans the pipeline for ``devices`` (:func:`autopp.planner._local.plan_local`); ``num_stages`` is then
    None (the choice can differ between argument shapes): :meth:`plan_for` says what was chosen.
    """

    def __init__(self, step_fn: Callable[_P, _R], *, num_stages=None, num_microbatches=None, schedule=None,
                 devices=None, batch_argnums=None, loss_reduction=None, plan=None, virtual_stages=None,
                 recompute=None, layout=None):
        self._plan = None
        if isinstance(schedule, str) and _looks_like_text(schedule):
            schedule = _parse_schedule_text(schedule)
        self._auto = plan is None and num_stages is None and num_microbatches is None and schedule is None
        if plan is not None:
            self._plan = plan if isinstance(plan, Plan) else Plan.from_json(plan)
            given = [k for k, v in (("num_stages", num_stages), ("num_microbatches", num_microbatches),
                                    ("schedule", schedule), ("virtual_stages", virtual_stages),
                                    ("recompute", recompute), ("layout", layout)) if v is not None]
            if given:
                raise ValueError(
                    f"autopp.parallelize: pass either plan= or {', '.join(given)}, not both: a plan fixes the stages, "
                    "microbatches, schedule and recomputation. Drop the keyword(s) or the plan."
                )
            if loss_reduction is not None and loss_reduction != self._plan.loss_reduction:
                raise ValueError(
                    f"autopp.parallelize: loss_reduction={loss_reduction!r} contradicts the plan's "
                    f"{self._plan.loss_reduction!r}; drop loss_reduction= or make the plan again."
                )
            loss_reduction = self._plan.loss_reduction
            layout = [dict(st.mesh_shape) for st in self._plan.stages]
            if any(st.equations is None and st.layers is None for st in self._plan.stages):
                raise ValueError("autopp.parallelize: the plan's stages give neither equations nor layers, so it "
                                 "cannot be replayed; make it with step.plan_for(...) or plan_model(profile, ...).")
            num_microbatches = self._plan.num_microbatches
            schedule = Schedule.from_text(self._plan.schedule_text, num_stages=self._plan.num_stages,
                                          num_microbatches=num_microbatches)
            num_stages = schedule.num_ranks
            recompute = tuple(st.recompute for st in self._plan.stages)
        if loss_reduction is None:
            loss_reduction = "mean"
        _check_count("num_stages", num_stages)
        _check_count("num_microbatches", num_microbatches)
        if loss_reduction not in LOSS_REDUCTIONS:
            raise ValueError(
                f"autopp.parallelize: loss_reduction={loss_reduction!r} is not one of {LOSS_REDUCTIONS}; use "
                "'mean' when the loss is an average over examples, 'sum' when it is a sum."
            )
        if devices is None:
            devices = jax.devices()
        devices = list(devices)
        self._groups = None
        if devices and all(isinstance(g, (list, tuple)) for g in devices):  # one list per device group
            groups = [list(g) for g in devices]
            if any(not g for g in groups):
                raise ValueError(f"autopp.parallelize: devices has an empty device group: {devices}; give every "
                                 "group at least one device.")
            if num_stages is not None and num_stages != len(groups):
                raise ValueError(f"autopp.parallelize: num_stages={num_stages} but devices has {len(groups)} groups; "
                                 "drop num_stages= (the groups are the stages) or regroup the devices.")
            if plan is not None:
                raise ValueError("autopp.parallelize: a plan fixes each stage's devices; pass devices as a flat list "
                                 "(the devices the plan may use).")
            self._groups = groups
            num_stages = len(groups)
            self._auto = False
            devices = [d for g in groups for d in g]
        if not devices or not all(isinstance(d, jax.Device) for d in devices):
            raise TypeError(f"autopp.parallelize: devices must be a non-empty sequence of jax.Device (or of lists of "
                            f"them, one per stage), got {devices!r}.")
        if len(set(devices)) != len(devices):
            raise ValueError(f"autopp.parallelize: devices lists a device twice: {devices}.")
        if num_stages is not None and num_stages > len(devices):
            raise ValueError(
                f"autopp.parallelize: num_stages={num_stages} needs at least {num_stages} devices, but "
                f"{len(devices)} were given ({devices}); use num_stages <= {len(devices)} or pass more devices."
            )
        n_st = num_stages if num_stages is not None else len(devices)
        if self._auto:
            n_st = None
        elif self._plan is not None:
            by_id = {d.id: d for d in devices}
            missing = sorted({i for st in self._plan.stages for i in st.devices} - set(by_id))
            if missing:
                raise ValueError(
                    f"autopp.parallelize: the plan places stages on device id(s) {missing}, which are not among the "
                    f"devices given ({sorted(by_id)}); pass devices that include them, or make a plan for these."
                )
            self._plan_devices = [[by_id[i] for i in st.devices] for st in self._plan.stages]
        elif self._groups is None and len(devices) % n_st:
            raise ValueError(
                f"autopp.parallelize: {len(devices)} devices cannot be split evenly into {n_st} stages; pass "
                f"devices=jax.devices()[:{n_st * (len(devices) // n_st)}] or a num_stages that divides {len(devices)}."
            )
        if schedule is None and not self._auto:
            schedule = "1f1b"  # num_stages or num_microbatches given: the planner is not used
        if isinstance(schedule, str):
            name = schedule.strip().lower().replace("_", "-")
            if name not in SCHEDULE_NAMES:
                raise ValueError(
                    f"autopp.parallelize: unknown schedule {schedule!r}; valid names are {', '.join(SCHEDULE_NAMES)} "
                    "(or pass a Schedule object, or its text: one row of actions such as '0F0 0B0' per device group)."
                )
            schedule = name
        elif isinstance(schedule, Schedule):
            validate(schedule)
            if num_stages is not None and schedule.num_ranks != num_stages:
                raise ValueError(
                    f"autopp.parallelize: the schedule has {schedule.num_ranks} row(s) (device groups) but "
                    f"num_stages={num_stages}; drop num_stages= or give a schedule with {num_stages} rows.")
            if self._plan is None:
                n_st = schedule.num_ranks
                if self._groups is None and len(devices) % n_st:
                    raise ValueError(
                        f"autopp.parallelize: {len(devices)} devices cannot be split evenly into the schedule's "
                        f"{n_st} device groups; pass devices=jax.devices()[:{n_st * (len(devices) // n_st)}].")
        elif schedule is not None:
            raise TypeError(
                f"autopp.parallelize: schedule must be a name ({', '.join(SCHEDULE_NAMES)}), a Schedule or its text, "
                f"got {type(schedule).__name__}."
            )
        if virtual_stages is not None:
            _check_count("virtual_stages", virtual_stages)
            if schedule == "dualpipev" and virtual_stages != 2:
                raise ValueError(
                    f"autopp.parallelize: dualpipev runs 2 model chunks per device group, not "
                    f"virtual_stages={virtual_stages}; drop virtual_stages=.")
            if virtual_stages > 1 and schedule not in ("interleaved-1f1b", "dualpipev"):
                raise ValueError(
                    f"autopp.parallelize: virtual_stages={virtual_stages} needs schedule='interleaved-1f1b' (got "
                    f"{schedule!r}); drop virtual_stages= or use that schedule.")
        elif schedule in ("interleaved-1f1b", "dualpipev"):
            virtual_stages = 2
        if recompute is not None and not isinstance(recompute, str):
            recompute = tuple(recompute)
        if recompute is not None and not all(r in RECOMPUTE_MODES for r in
                                             ((recompute,) if isinstance(recompute, str) else recompute)):
            raise ValueError(f"autopp.parallelize: recompute={recompute!r} must be one of {', '.join(RECOMPUTE_MODES)}"
                             " or a tuple of them, one per stage (model chunk).")
        self._step_fn = step_fn
        self.num_stages = n_st
        self._virtual_stages = virtual_stages or 1
        self._recompute = recompute
        self._layout = _check_layout(layout)
        self._num_microbatches = num_microbatches
        self._schedule = schedule
        self.devices = devices
        self._batch_argnums = batch_argnums
        self.loss_reduction = loss_reduction
        self._cache: dict[Any, tuple[TracedStep, StageSplit, Executable, Plan]] = {}
        functools.update_wrapper(self, step_fn)

    # -- building --------------------------------------------------------------------------------
    @staticmethod
    def _batch_size(traced: TracedStep) -> int:
        sizes = [v.aval.shape[0] for v, b in zip(traced.jaxpr.jaxpr.invars, traced.batch_mask) if b and v.aval.shape]
        return math.gcd(*sizes) if sizes else 1

    def _microbatches_for(self, traced: TracedStep) -> int:
        if self._num_microbatches is not None:
            return self._num_microbatches
        if isinstance(self._schedule, Schedule):
            return self._schedule.num_microbatches
        batch = self._batch_size(traced)
        if self._schedule == "dualpipev":  # at least two microbatches per device group
            fits = [d for d in range(2 * self.num_stages, 4 * self.num_stages + 1) if batch % d == 0]
            if not fits:
                raise ValueError(
                    f"autopp.parallelize: dualpipev needs at least {2 * self.num_stages} microbatches (2 per device "
                    f"group) dividing the batch of {batch}; pass num_microbatches= or another batch size.")
            return min(fits)
        step = self.num_stages if self._schedule == "interleaved-1f1b" else 1  # a multiple of the groups
        fits = [d for d in range(step, 2 * self.num_stages + 1, step) if batch % d == 0]
        if not fits:
            raise ValueError(
                f"autopp.parallelize: interleaved-1f1b needs a microbatch count that is a multiple of the "
                f"{self.num_stages} device groups and divides the batch of {batch}; pass num_microbatches= or "
                "another batch size.")
        return max(fits)

    def _schedule_for(self, num_microbatches: int) -> tuple[str, Schedule]:
        if isinstance(self._schedule, Schedule):
            sched = self._schedule
            if sched.num_microbatches != num_microbatches:
                raise ValueError(
                    f"autopp.parallelize: the schedule has {sched.num_microbatches} microbatch(es) but the step "
                    f"uses num_microbatches={num_microbatches}; make them agree."
                )
            return "custom", sched
        v = self._virtual_stages
        return self._schedule, get_schedule(self._schedule, self.num_stages * v, num_microbatches, virtual_stages=v)

    def _stage_layouts(self, sched: Schedule, stage_devices) -> list[dict[str, int]]:
        """Mesh axis sizes of each stage (model chunk): the layout given for its device group."""
        lay = self._layout
        if self._plan is not None:
            per = lay
        elif lay is None or isinstance(lay, dict):
            per = [lay or {} for _ in stage_devices]
        else:
            if len(lay) != sched.num_ranks:
                raise ValueError(f"autopp.parallelize: layout has {len(lay)} entries for {sched.num_ranks} device "
                                 "groups; give one dict per group or one for all.")
            rank_of = sched.stage_to_rank()
            per = [lay[rank_of[c]] for c in range(sched.num_stages)]
        out = []
        for c, (given, devs) in enumerate(zip(per, stage_devices)):
            f, tp = given.get("fsdp", 1), given.get("tensor", 1)
            d = given.get("data", len(devs) // (f * tp))
            if d * f * tp != len(devs):
                raise ValueError(f"autopp.parallelize: layout {given} does not fit stage {c}'s {len(devs)} device(s): "
                                 f"data x fsdp x tensor must equal {len(devs)}; e.g. layout={{'fsdp': {len(devs)}}}.")
            out.append({"data": d, "fsdp": f, "tensor": tp})
        return out

    def _stage_recompute(self, num_chunks: int) -> tuple[str, ...]:
        r = self._recompute
        if r is None:
            return ("none",) * num_chunks
        if isinstance(r, str):
            return (r,) * num_chunks
        if len(r) != num_chunks:
            raise ValueError(f"autopp.parallelize: recompute has {len(r)} entries for {num_chunks} stages (model "
                             "chunks); give one per stage or a single mode.")
        return r

    def _build(self, args: tuple) -> tuple[TracedStep, StageSplit, Executable, Plan]:
        flat, tree = jax.tree_util.tree_flatten(args)
        try:
            key = (tree, tuple((np.shape(x), str(jax.numpy.result_type(x))) for x in flat))
        except Exception:  # noqa: BLE001 - a leaf that is not an array: say which and how to fix it
            check_array_leaves(args)
            raise
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        check_array_leaves(args)
        batch_argnums = normalize_batch_argnums(self._batch_argnums, len(args))
        with phase("tracing the step") as ph:
            traced = trace_step(self._step_fn, args, batch_argnums)
            ph.done("traced the step")
        made_offline = self._plan is not None and self._plan.model_fingerprint.startswith(CONFIG_FINGERPRINT)
        if self._plan is not None and not made_offline and traced.fingerprint != self._plan.model_fingerprint:
            raise ValueError(
                f"autopp.parallelize: the plan was made for another step (model fingerprint "
                f"{self._plan.model_fingerprint}, this step {traced.fingerprint}): the computation, shapes or "
                "dtypes differ. Make a new plan with step.plan_for(...) for these arguments."
            )
        sequence_vars = frozenset()
        if self._auto:
            local, prof, planning_s = self._plan_locally(args, traced)
            num_mb, name = local.num_microbatches, local.schedule
            sched = get_schedule(name, local.num_stages, num_mb)
        else:
            num_mb = self._microbatches_for(traced)
            name, sched = self._schedule_for(num_mb)
        if self._plan is not None:
            name = self._plan.schedule
        check_batch_divisible(traced, num_mb)
        forward = trace_microbatch_forward(self._step_fn, args, traced, num_mb)
        if self._auto:
            split = split_at(forward, traced.microbatched_grad_inputs,
                             _stage_start_equations(prof, traced, forward, local.stage_layers))
            per = local.devices_per_stage
            stage_devices = [self.devices[s * per:(s + 1) * per] for s in range(local.num_stages)]
        elif self._plan is not None:
            if all(st.equations is not None for st in self._plan.stages):
                starts = [st.equations[0] for st in self._plan.stages]
            else:  # a plan made from a profile (plan_model): its stages are given in profile layers
                prof = profile(self._step_fn, *args, cluster=Cluster.local(self.devices),
                               batch_argnums=self._batch_argnums)
                if made_offline:
                    _check_offline_plan(self._plan, prof, self._batch_size(traced))
                starts = _stage_start_equations(prof, traced, forward, [st.layers for st in self._plan.stages])
                if self._plan.sequence_parallel:
                    sequence_vars = _layer_boundary_activations(prof, traced, forward)
            split = split_at(forward, traced.microbatched_grad_inputs, starts)
            stage_devices = self._plan_devices
        else:
            split = split_stages(forward, traced.microbatched_grad_inputs, sched.num_stages)
            per = len(self.devices) // sched.num_ranks
            groups = self._groups or [self.devices[r * per:(r + 1) * per] for r in range(sched.num_ranks)]
            rank_of = sched.stage_to_rank()
            stage_devices = [groups[rank_of[c]] for c in range(sched.num_stages)]
        layouts = self._stage_layouts(sched, stage_devices)
        with phase(f"compiling the {sched.num_stages}-stage pipeline") as ph:
            planned = self._plan
            param_specs = None
            if planned is not None and any(st.param_specs is not None for st in planned.stages):
                param_specs = [None if st.param_specs is None else {int(k): v for k, v in st.param_specs.items()}
                               for st in planned.stages]
            exe = build_executable(traced, forward, split, stage_devices, num_microbatches=num_mb,
                                   loss_reduction=self.loss_reduction, schedule=sched,
                                   recompute=self._stage_recompute(sched.num_stages), layouts=layouts,
                                   param_specs=param_specs, zero1=bool(planned is not None and planned.zero1),
                                   sequence_vars=sequence_vars)
            ph.done(f"built {exe.num_programs} program(s) for {sched.num_stages} stage(s); they compile in the "
                    "background and the first step runs each as soon as it is ready")
        plan = self._make_plan(traced, forward, split, stage_devices, num_mb, name, sched)
        plan = dataclasses.replace(
            plan, virtual_stages=sched.num_stages // sched.num_ranks,
            stages=tuple(dataclasses.replace(st, recompute=r, mesh_shape={k: v for k, v in lay.items()
                                                                          if k == "data" or v > 1})
                         for st, r, lay in zip(plan.stages, self._stage_recompute(sched.num_stages), layouts)))
        if self._auto:
            stats = dataclasses.replace(local.plan.planner, wall_time_s=planning_s)
            plan = dataclasses.replace(
                plan, microbatch_size=local.microbatch_size, predicted=local.predicted,
                stages=tuple(dataclasses.replace(st, layers=local.stage_layers[st.index], recompute="none",
                                                 forward_time_s=p.forward_time_s, backward_time_s=p.backward_time_s)
                             for st, p in zip(plan.stages, local.plan.stages)),
                planner=stats)
        elif self._plan is not None:  # what the replayed plan says beyond the split (layers, prediction, ...)
            old = self._plan
            plan = dataclasses.replace(
                plan, microbatch_size=old.microbatch_size, virtual_stages=old.virtual_stages, cluster=old.cluster,
                predicted=old.predicted, planner=old.planner, zero1=old.zero1, sequence_parallel=old.sequence_parallel,
                layer_shardings=old.layer_shardings, model_fingerprint=old.model_fingerprint,
                stages=tuple(dataclasses.replace(st, layers=o.layers, param_specs=o.param_specs,
                                                 forward_time_s=o.forward_time_s, backward_time_s=o.backward_time_s)
                             for st, o in zip(plan.stages, old.stages)))
        self._cache[key] = (traced, split, exe, plan)
        return self._cache[key]

    def _plan_locally(self, args: tuple, traced: TracedStep) -> tuple[LocalPlan, Profile, float]:
        """Profile the step on the local device and plan it for ``self.devices``; also the seconds it took."""
        t0 = time.perf_counter()
        try:
            cluster = Cluster.local(self.devices)
        except ValueError as e:
            raise ValueError(f"autopp.parallelize: cannot plan for these devices: {e} Or skip the planner: pass "
                             "num_stages=, num_microbatches= and schedule=.") from None
        with phase("profiling the step's layers") as ph:
            prof = profile(self._step_fn, *args, measure=True, cluster=cluster, batch_argnums=self._batch_argnums)
            ph.done(f"profiled {len(prof.layers)} layers")
        if prof.fingerprint != traced.fingerprint:
            raise _internal(f"the profile traced another computation (fingerprint {prof.fingerprint}, the step "
                            f"{traced.fingerprint})")
        batch = self._batch_size(traced)
        try:
            with phase(f"planning for {len(self.devices)} device(s)") as ph:
                local = plan_local(prof, len(self.devices), batch)
                ph.done(f"planned {local.num_stages} stage(s), {local.num_microbatches} microbatch(es), "
                        f"{local.schedule}")
        except ValueError as e:
            raise ValueError(f"autopp.parallelize: cannot plan this step for {len(self.devices)} device(s): "
                             f"{str(e).removeprefix('plan_local: ')} Or fix the layout yourself with num_stages=, "
                             "num_microbatches= and schedule=.") from None
        return local, prof, time.perf_counter() - t0

    def _make_plan(self, traced, forward, split, stage_devices, num_mb, name, sched) -> Plan:
        spec = traced.spec
        fwd = forward.jaxpr
        users: dict[int, int] = {}
        for s, ids in enumerate(split.stage_eqns):
            for i in ids:
                for a in fwd.eqns[i].invars:
                    if not hasattr(a, "val") and a in fwd.invars:
                        users.setdefault(fwd.invars.index(a), s)
        stages = []
        for s, ids in enumerate(split.stage_eqns):
            owned = sum(aval_bytes(fwd.invars[k].aval) for k, st in users.items() if st == s and spec.diff_mask[k])
            stages.append(StagePlan(
                index=s,
                devices=tuple(d.id for d in stage_devices[s]),
                mesh_shape={"data": len(stage_devices[s])},
                equations=(split.stage_starts[s], (split.stage_starts[s + 1] if s + 1 < len(split.stage_starts)
                                                   else len(fwd.eqns)) - 1),
                num_equations=len(ids),
                flops=float(split.stage_costs[s]),
                param_bytes=int(owned),
                cut_bytes_after=int(split.cut_bytes[s]) if s < len(split.cut_bytes) else 0,
            ))
        return Plan(model_fingerprint=traced.fingerprint, stages=tuple(stages), num_microbatches=num_mb,
                    schedule=name, schedule_text=sched.to_text(), loss_reduction=self.loss_reduction)

    # -- public ----------------------------------------------------------------------------------
    def __call__(self, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        if kwargs:
            raise TypeError(
                f"autopp.parallelize: pass the step's arguments positionally (got keyword(s) {sorted(kwargs)}); "
                "the batch is found by position (batch_argnums)."
            )
        _, _, exe, _ = self._build(args)
        flat = jax.tree_util.tree_leaves(args)
        return jax.tree_util.tree_unflatten(exe.out_tree, exe.run(flat))

    def plan_for(self, *args) -> Plan:
        """The plan this step runs for arguments like ``args`` (arrays or ShapeDtypeStructs); runs nothing."""
        return self._build(args)[3]

    def trace(self, *args, trace_json: str | None = None, gantt_png: str | None = None):
        """Run one step like ``step(*args)`` while recording when each task ran on which devices; returns
        ``(outputs, timeline)`` (an :class:`autopp.runtime.Timeline`: events, wall time, host issue time, critical
        path, bubble fraction). ``trace_json`` writes a Chrome/Perfetto trace, ``gantt_png`` a Gantt chart with
        the plan's predicted timeline beside the measured one when the plan has stage times."""
        from autopp.runtime import run_with_timeline

        _, _, exe, plan = self._build(args)
        outputs, timeline = run_with_timeline(exe, jax.tree_util.tree_leaves(args))
        if trace_json is not None:
            timeline.to_chrome_trace(trace_json)
        if gantt_png is not None:
            timeline.plot(gantt_png, plan)
        return jax.tree_util.tree_unflatten(exe.out_tree, outputs), timeline

    def memory_report(self, *args) -> dict[int, int]:
        """Peak bytes per device id during a step with arguments like ``args``, by the runtime's accounting of
        the buffers it holds plus each program's XLA temporaries (``memory_analysis()``); compare with
        ``plan_for(*args).predicted.peak_memory_bytes_per_gpu``."""
        return self._build(args)[2].memory_report()

    def executable_for(self, *args) -> Executable:
        """The built instruction list, every program compiled (for inspection and benchmarks)."""
        return self._build(args)[2].resolve()


def _check_offline_plan(plan: Plan, prof: Profile, batch_size: int) -> None:
    """A plan made with ``plan_model`` (from a profile or a model description, at any traced batch size) names its
    stages by the profile's layers; it replays on a traced step with the same layers and parameters (its structure
    fingerprint) whose batch is the plan's global batch."""
    last = plan.stages[-1].layers[1] if plan.stages[-1].layers else None
    if plan.model_fingerprint != prof.structure_fingerprint and last == len(prof.layers) - 1:
        raise ValueError(
            "autopp.parallelize: the plan was made for another model (its layers or parameter shapes differ from "
            f"this step's: fingerprint {plan.model_fingerprint}, this step {prof.structure_fingerprint}); make the "
            "plan for this step: plan_model(autopp.profiler.profile(step, *args), cluster, global_batch=...).")
    if last != len(prof.layers) - 1:
        raise ValueError(
            f"autopp.parallelize: the plan was made offline for a model of {None if last is None else last + 1} "
            f"layers (embedding, blocks, head), but this step's profile has {len(prof.layers)} "
            f"({', '.join(lay.name for lay in prof.layers[:6])}{', ...' if len(prof.layers) > 6 else ''}); make the "
            "plan for this model's GPTConfig, or with plan_model(profile(step, ...), cluster).")
    mesh = plan.stages[0].mesh_shape
    replicas = mesh.get("data", 1) * mesh.get("fsdp", 1)
    if plan.microbatch_size is not None and plan.microbatch_size * plan.num_microbatches * replicas != batch_size:
        planned = plan.microbatch_size * plan.num_microbatches * replicas
        raise ValueError(
            f"autopp.parallelize: the plan was made for a global batch of {plan.microbatch_size} x "
            f"{plan.num_microbatches} microbatches x {replicas} data-parallel replicas = {planned} examples, but "
            f"this step's batch has {batch_size}; make the plan with global_batch={batch_size}.")


def _internal(what: str) -> RuntimeError:
    return RuntimeError(
        f"autopp internal error: {what}. Please report it; meanwhile pass num_stages=, num_microbatches= and "
        "schedule= to autopp.parallelize, which skips the planner.")


def _stage_start_equations(prof: Profile, traced: TracedStep, forward,
                           stage_layers: Sequence[tuple[int, int]]) -> list[int]:
    """The planner's stage boundaries (profile layers) as equations of the per-microbatch forward ``forward``.

    The profile's layers index equations of the full-batch forward (``traced.spec.forward``); the pipeline
    runs the forward re-traced at microbatch size. The two traces must have the same equations (only shapes
    differ), so an index means the same operation in both; a stage begins at its first layer's first
    batch-dependent equation.
    """
    full, small = traced.spec.forward.jaxpr.eqns, forward.jaxpr.eqns
    mask = traced.microbatched_grad_inputs
    if len(full) != len(small) or any(a.primitive is not b.primitive for a, b in zip(full, small)):
        first = next((i for i, (a, b) in enumerate(zip(full, small)) if a.primitive is not b.primitive),
                     min(len(full), len(small)))
        raise _internal(
            f"the loss's forward traced at the full batch ({len(full)} equations) and at microbatch size "
            f"({len(small)} equations) differ from equation {first} on, so the planner's layer boundaries cannot "
            "be placed in the pipeline's forward")
    ranges = []
    for lay in prof.layers:
        r = prof.graph.nodes[lay.index].get("eqn_range")
        if r is None:
            raise _internal(f"profile layer {lay.index} ({lay.name}) carries no equation range")
        ranges.append(tuple(r))
    dep = batch_dependent_vars(forward.jaxpr, mask)
    batch_eqns = [i for i, e in enumerate(small) if any(v in dep for v in e.outvars)]
    full_dep = batch_dependent_vars(traced.spec.forward.jaxpr, mask)
    if batch_eqns != [i for i, e in enumerate(full) if any(v in full_dep for v in e.outvars)]:
        raise _internal("the loss's forward traced at the full batch and at microbatch size depend on the batch at "
                        "different equations, so the planner's layer boundaries cannot be placed in the pipeline's "
                        "forward")
    starts = []
    for s, (first, _) in enumerate(stage_layers):
        a, b = ranges[first]
        if s == 0:
            starts.append(batch_eqns[0])
            continue
        eq = next((i for i in batch_eqns if a <= i < b), None)
        if eq is None or (starts and eq <= starts[-1]):
            raise _internal(f"stage {s} begins at profile layer {first} ({prof.layers[first].name}, equations "
                            f"{a}-{b - 1}), which has no batch-dependent equation after the previous stage's start")
        starts.append(eq)
    return starts


def _layer_boundary_activations(prof: Profile, traced: TracedStep, forward) -> frozenset:
    """The activations passed from one profile layer to the next in the per-microbatch forward ``forward``
    (batch-dependent floating values of rank >= 3, ``(batch, sequence, ...)``, defined before a layer's equations and
    read by them): what sequence parallelism splits along the sequence (their indices match the profile's, see
    :func:`_stage_start_equations`)."""
    eqns = forward.jaxpr.eqns
    dep = batch_dependent_vars(forward.jaxpr, traced.microbatched_grad_inputs)
    defined_at = {v: i for i, e in enumerate(eqns) for v in e.outvars}
    out = set()
    for lay in prof.layers[1:]:
        a, b = prof.graph.nodes[lay.index]["eqn_range"]
        for e in eqns[a:b]:
            for v in e.invars:
                if (not isinstance(v, jex_core.Literal) and defined_at.get(v, a) < a and v in dep
                        and len(v.aval.shape) >= 3 and jnp.issubdtype(v.aval.dtype, jnp.floating)):
                    out.add(v)
    return frozenset(out)


@overload
def parallelize(step_fn: Callable[_P, _R], /) -> Parallelized[_P, _R]: ...


@overload
def parallelize(
    *,
    num_stages: int | None = None,
    num_microbatches: int | None = None,
    schedule: str | Schedule | None = None,
    devices: Sequence[jax.Device] | Sequence[Sequence[jax.Device]] | None = None,
    batch_argnums: int | Sequence[int] | None = None,
    loss_reduction: str | None = None,
    plan: Plan | str | None = None,
    virtual_stages: int | None = None,
    recompute: str | Sequence[str] | None = None,
    layout: dict[str, int] | Sequence[dict[str, int]] | None = None,
) -> Callable[[Callable[_P, _R]], Parallelized[_P, _R]]: ...


def parallelize(step_fn=None, /, *, num_stages=None, num_microbatches=None, schedule=None, devices=None,
                batch_argnums=None, loss_reduction=None, plan=None, virtual_stages=None, recompute=None,
                layout=None):
    """Run a training step as an MPMD pipeline over ``devices``.

    The step must take its gradient with :func:`autopp.grad` / :func:`autopp.value_and_grad`. The loss's
    forward computation is split automatically into ``num_stages`` stages (balanced by FLOPs, cut where
    the fewest activation bytes cross; by measured layer times when planned, see below); each stage runs on
    ``len(devices) // num_stages`` devices; the batch (argument ``batch_argnums``, default the last
    positional one) is split into ``num_microbatches`` along axis 0 of every leaf, and microbatch losses and
    gradients are combined with ``loss_reduction`` (default ``"mean"``). Everything after the gradient runs
    on the stages that own the parameters. ``plan`` (a :class:`Plan` or a JSON path from ``plan.to_json``)
    replays a saved plan exactly: its stages, devices, microbatches and schedule; it is refused for another
    step or devices.

    With none of ``num_stages``, ``num_microbatches``, ``schedule`` and ``plan`` given, they are planned
    for ``devices`` on the first call (or :meth:`Parallelized.plan_for`) for each argument shape: the step is
    profiled with its layers timed on the local device (:func:`autopp.profiler.profile` with
    ``measure=True``, cached under ``$XDG_CACHE_HOME/autopp``), and
    :func:`autopp.planner._local.plan_local` picks the stage count (a divisor of the device count, each stage
    data-parallel over the rest), the microbatch count, the schedule (GPipe or 1F1B) and the stage split with
    the smallest predicted step time; the plan records the split in profile layers, the prediction and the
    planner's statistics. A ValueError says why when no layout is legal or fits the devices' memory.
    Giving only some of the three skips the planner; the others default to ``num_stages`` = number of devices,
    ``num_microbatches`` = the largest divisor of the batch size that is at most ``2 * num_stages``,
    ``schedule="1f1b"``. ``devices`` defaults to ``jax.devices()``.

    ``schedule`` is a name (``"gpipe"``, ``"1f1b"``, ``"interleaved-1f1b"`` with ``virtual_stages=v`` model
    chunks per device group (default 2), ``"zb-h1"``), a :class:`autopp.runtime.Schedule`, or its text (one row of
    actions such as ``0F0 1F0 1B0 0B0`` per device group; ``I``/``W`` split a backward into input and weight
    gradients). ``num_stages`` counts device groups; with several model chunks per group the model is split into
    ``num_stages * virtual_stages`` stages (chunk ``c`` on the group whose schedule row runs it). ``recompute``
    (``"none"``, ``"full"``, ``"selective"``, or one per stage) recomputes activations in the backward.

    Usable bare (``@autopp.parallelize``) or with keywords (``@autopp.parallelize(num_stages=4)``).
    """
    kwargs = dict(num_stages=num_stages, num_microbatches=num_microbatches, schedule=schedule, devices=devices,
                  batch_argnums=batch_argnums, loss_reduction=loss_reduction, plan=plan,
                  virtual_stages=virtual_stages, recompute=recompute, layout=layout)
    if step_fn is None:
        return lambda f: Parallelized(f, **kwargs)
    if not callable(step_fn):
        raise TypeError(f"autopp.parallelize: expected a callable training step, got {type(step_fn).__name__}.")
    return Parallelized(step_fn, **kwargs)

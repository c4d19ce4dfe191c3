"""``autopp.parallelize``: trace -> split -> build the pipeline -> run."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any, Generic, ParamSpec, TypeVar, overload

import jax
import numpy as np

from autopp._trace import (
    TracedStep,
    check_batch_divisible,
    normalize_batch_argnums,
    trace_microbatch_forward,
    trace_step,
)
from autopp.planner._plan import Plan, StagePlan
from autopp.profiler._partition import StageSplit, split_at, split_stages
from autopp.profiler._costs import aval_bytes
from autopp.runtime._executor import Executable, build_executable
from autopp.planner._schedule import SCHEDULE_NAMES, Schedule, get_schedule, validate

_P = ParamSpec("_P")
_R = TypeVar("_R")

LOSS_REDUCTIONS = ("mean", "sum")
RUNNABLE_SCHEDULES = ("gpipe", "1f1b")


def _check_count(name: str, value, allow_none=True) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"autopp.parallelize: {name} must be a positive int, got {value!r} ({type(value).__name__}).")
    if value <= 0:
        raise ValueError(f"autopp.parallelize: {name} must be a positive int, got {value}; use e.g. {name}=1.")


class Parallelized(Generic[_P, _R]):
    """A training step run as an MPMD pipeline. Call it like the step it wraps."""

    def __init__(self, step_fn: Callable[_P, _R], *, num_stages=None, num_microbatches=None, schedule=None,
                 devices=None, batch_argnums=None, loss_reduction=None, plan=None):
        self._plan = None
        if plan is not None:
            self._plan = plan if isinstance(plan, Plan) else Plan.from_json(plan)
            given = [k for k, v in (("num_stages", num_stages), ("num_microbatches", num_microbatches),
                                    ("schedule", schedule)) if v is not None]
            if given:
                raise ValueError(
                    f"autopp.parallelize: pass either plan= or {', '.join(given)}, not both: a plan fixes the stages, "
                    "microbatches and schedule. Drop the keyword(s) or the plan."
                )
            if loss_reduction is not None and loss_reduction != self._plan.loss_reduction:
                raise ValueError(
                    f"autopp.parallelize: loss_reduction={loss_reduction!r} contradicts the plan's "
                    f"{self._plan.loss_reduction!r}; drop loss_reduction= or make the plan again."
                )
            loss_reduction = self._plan.loss_reduction
            num_stages = self._plan.num_stages
            num_microbatches = self._plan.num_microbatches
            schedule = Schedule.from_text(self._plan.schedule_text, num_stages=num_stages,
                                          num_microbatches=num_microbatches)
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
        if not devices or not all(isinstance(d, jax.Device) for d in devices):
            raise TypeError(f"autopp.parallelize: devices must be a non-empty sequence of jax.Device, got {devices!r}.")
        if len(set(devices)) != len(devices):
            raise ValueError(f"autopp.parallelize: devices lists a device twice: {devices}.")
        if num_stages is not None and num_stages > len(devices):
            raise ValueError(
                f"autopp.parallelize: num_stages={num_stages} needs at least {num_stages} devices, but "
                f"{len(devices)} were given ({devices}); use num_stages <= {len(devices)} or pass more devices."
            )
        n_st = num_stages if num_stages is not None else len(devices)
        if self._plan is not None:
            by_id = {d.id: d for d in devices}
            missing = sorted({i for st in self._plan.stages for i in st.devices} - set(by_id))
            if missing:
                raise ValueError(
                    f"autopp.parallelize: the plan places stages on device id(s) {missing}, which are not among the "
                    f"devices given ({sorted(by_id)}); pass devices that include them, or make a plan for these."
                )
            self._plan_devices = [[by_id[i] for i in st.devices] for st in self._plan.stages]
        elif len(devices) % n_st:
            raise ValueError(
                f"autopp.parallelize: {len(devices)} devices cannot be split evenly into {n_st} stages; pass "
                f"devices=jax.devices()[:{n_st * (len(devices) // n_st)}] or a num_stages that divides {len(devices)}."
            )
        if schedule is None:
            schedule = "1f1b"
        if isinstance(schedule, str):
            if schedule not in SCHEDULE_NAMES:
                raise ValueError(
                    f"autopp.parallelize: unknown schedule {schedule!r}; valid names are {', '.join(SCHEDULE_NAMES)} "
                    "(or pass a Schedule object)."
                )
            if schedule not in RUNNABLE_SCHEDULES:
                raise ValueError(
                    f"autopp.parallelize: schedule {schedule!r} is not supported by the runtime yet; use one of "
                    f"{', '.join(RUNNABLE_SCHEDULES)}."
                )
        elif not isinstance(schedule, Schedule):
            raise TypeError(
                f"autopp.parallelize: schedule must be a name ({', '.join(SCHEDULE_NAMES)}) or a Schedule, got "
                f"{type(schedule).__name__}."
            )
        self._step_fn = step_fn
        self.num_stages = n_st
        self._num_microbatches = num_microbatches
        self._schedule = schedule
        self.devices = devices
        self._batch_argnums = batch_argnums
        self.loss_reduction = loss_reduction
        self._cache: dict[Any, tuple[TracedStep, StageSplit, Executable, Plan]] = {}
        functools.update_wrapper(self, step_fn)

    # -- building --------------------------------------------------------------------------------
    def _microbatches_for(self, traced: TracedStep) -> int:
        if self._num_microbatches is not None:
            return self._num_microbatches
        sizes = [v.aval.shape[0] for v, b in zip(traced.jaxpr.jaxpr.invars, traced.batch_mask) if b and v.aval.shape]
        batch = math.gcd(*sizes) if sizes else 1
        return max(d for d in range(1, 2 * self.num_stages + 1) if batch % d == 0)

    def _schedule_for(self, num_microbatches: int) -> tuple[str, Schedule]:
        if isinstance(self._schedule, Schedule):
            sched = self._schedule
            if sched.num_stages != self.num_stages or sched.num_microbatches != num_microbatches:
                raise ValueError(
                    f"autopp.parallelize: the schedule has {sched.num_stages} stage(s) and {sched.num_microbatches} "
                    f"microbatch(es) but the step uses num_stages={self.num_stages}, "
                    f"num_microbatches={num_microbatches}; make them agree."
                )
            if sched.num_ranks != self.num_stages:
                raise ValueError("autopp.parallelize: schedules with several stages per rank are not supported yet.")
            validate(sched)
            return "custom", sched
        return self._schedule, get_schedule(self._schedule, self.num_stages, num_microbatches)

    def _build(self, args: tuple) -> tuple[TracedStep, StageSplit, Executable, Plan]:
        flat, tree = jax.tree_util.tree_flatten(args)
        key = (tree, tuple((np.shape(x), str(jax.numpy.result_type(x))) for x in flat))
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        batch_argnums = normalize_batch_argnums(self._batch_argnums, len(args))
        traced = trace_step(self._step_fn, args, batch_argnums)
        if self._plan is not None and traced.fingerprint != self._plan.model_fingerprint:
            raise ValueError(
                f"autopp.parallelize: the plan was made for another step (model fingerprint "
                f"{self._plan.model_fingerprint}, this step {traced.fingerprint}): the computation, shapes or "
                "dtypes differ. Make a new plan with step.plan_for(...) for these arguments."
            )
        num_mb = self._microbatches_for(traced)
        name, sched = self._schedule_for(num_mb)
        if self._plan is not None:
            name = self._plan.schedule
        check_batch_divisible(traced, num_mb)
        forward = trace_microbatch_forward(self._step_fn, args, traced, num_mb)
        if self._plan is not None:
            split = split_at(forward, traced.microbatched_grad_inputs, [st.equations[0] for st in self._plan.stages])
            stage_devices = self._plan_devices
        else:
            split = split_stages(forward, traced.microbatched_grad_inputs, self.num_stages)
            per = len(self.devices) // self.num_stages
            stage_devices = [self.devices[s * per:(s + 1) * per] for s in range(self.num_stages)]
        exe = build_executable(traced, forward, split, stage_devices, num_microbatches=num_mb,
                               loss_reduction=self.loss_reduction, schedule=sched)
        plan = self._make_plan(traced, forward, split, stage_devices, num_mb, name, sched)
        self._cache[key] = (traced, split, exe, plan)
        return self._cache[key]

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

    def executable_for(self, *args) -> Executable:
        """The built instruction list (for inspection and benchmarks)."""
        return self._build(args)[2]


@overload
def parallelize(step_fn: Callable[_P, _R], /) -> Parallelized[_P, _R]: ...


@overload
def parallelize(
    *,
    num_stages: int | None = None,
    num_microbatches: int | None = None,
    schedule: str | Schedule | None = None,
    devices: Sequence[jax.Device] | None = None,
    batch_argnums: int | Sequence[int] | None = None,
    loss_reduction: str | None = None,
    plan: Plan | str | None = None,
) -> Callable[[Callable[_P, _R]], Parallelized[_P, _R]]: ...


def parallelize(step_fn=None, /, *, num_stages=None, num_microbatches=None, schedule=None, devices=None,
                batch_argnums=None, loss_reduction=None, plan=None):
    """Run a training step as an MPMD pipeline over ``devices``.

    The step must take its gradient with :func:`autopp.grad` / :func:`autopp.value_and_grad`. The loss's
    forward computation is split automatically into ``num_stages`` stages (balanced by FLOPs, cut where
    the fewest activation bytes cross); each stage runs on ``len(devices) // num_stages`` devices;
    the batch (argument ``batch_argnums``, default the last positional one) is split into
    ``num_microbatches`` along axis 0 of every leaf, and microbatch losses and gradients are combined
    with ``loss_reduction`` (default ``"mean"``). Everything after the gradient runs on the stages that own
    the parameters. ``plan`` (a :class:`Plan` or a JSON path from ``plan.to_json``) replays a saved plan
    exactly: its stages, devices, microbatches and schedule; it is refused for another step or devices.

    Defaults (until the planner chooses them): ``num_stages`` = number of devices, ``num_microbatches`` =
    the largest divisor of the batch size that is at most ``2 * num_stages``, ``schedule="1f1b"``,
    ``devices=jax.devices()``.

    Usable bare (``@autopp.parallelize``) or with keywords (``@autopp.parallelize(num_stages=4)``).
    """
    kwargs = dict(num_stages=num_stages, num_microbatches=num_microbatches, schedule=schedule, devices=devices,
                  batch_argnums=batch_argnums, loss_reduction=loss_reduction, plan=plan)
    if step_fn is None:
        return lambda f: Parallelized(f, **kwargs)
    if not callable(step_fn):
        raise TypeError(f"autopp.parallelize: expected a callable training step, got {type(step_fn).__name__}.")
    return Parallelized(step_fn, **kwargs)

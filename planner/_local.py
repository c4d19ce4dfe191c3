"""Planning for the local devices: what :func:`autopp.parallelize` runs when it is not told ``num_stages``,
``num_microbatches`` and ``schedule``.

It is :func:`~autopp.planner.plan_model` (the one cost model, the one CP-SAT splitter) on a profile whose layers
were measured on the local device, restricted to the layouts the runtime's host can drive cheaply on local
devices: ``S`` pipeline stages (a divisor of the devices), each data-parallel over ``N / S`` devices, any
microbatch count whose microbatches split evenly over a stage's devices, 1F1B or GPipe, no recomputation. The local
devices' host cost is charged: every program and transfer is issued from one Python thread
(:data:`DISPATCH_S` per instruction).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

from autopp.core import Estimate, Plan, divisors
from autopp.planner._search import plan_model
from autopp.profiler import Cluster, Profile

DISPATCH_S = 45e-6
"""Seconds the runtime's controller spends per instruction it dispatches (a stage program or a transfer), also
charged to every action's device time. Fitted on this project's 2-core development machine (8 CPU devices):
step times of the zoo MLP (compute negligible, batch 64) with 1F1B on 2, 4 and 8 stages and 4 to 32
microbatches (93 to 1043 instructions) against the instruction count give 45 us per instruction (an empty
jitted call alone costs 4 us there, 19 us with ten arguments; the rest is the executor's bookkeeping and
``jax.device_put``). It describes this runtime on local devices only: plans for other clusters pay none."""

RUNNABLE_SCHEDULES = ("1f1b", "gpipe")
"""Schedules the local planner searches, in tie-breaking order (1F1B keeps fewer microbatches in flight)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class LocalPlan:
    """What :func:`plan_local` chose."""

    num_stages: int
    """Pipeline stages."""
    devices_per_stage: int
    """Devices of each stage (data-parallel inside)."""
    num_microbatches: int
    """Microbatches per step."""
    microbatch_size: int
    """Examples per microbatch per device."""
    schedule: str
    """``1f1b`` or ``gpipe``."""
    stage_layers: tuple[tuple[int, int], ...]
    """First and last profile layer of each stage."""
    predicted: Estimate
    """The cost model's prediction."""
    solver_status: str
    """CP-SAT's status for the stage split, or ``UNIFORM`` for an equal split."""
    optimality_gap: float
    """CP-SAT's relative gap."""
    candidates: int
    """Layouts evaluated."""
    best_uniform_step_time_s: float
    """The best equal split's predicted step time."""
    wall_time_s: float
    """Seconds of planning."""
    plan: Plan
    """The plan itself."""

    @classmethod
    def of(cls, plan: Plan, wall_time_s: float) -> LocalPlan:
        """The choices ``plan`` (made by :func:`plan_local`) holds."""
        st = plan.planner
        return cls(
            num_stages=plan.num_stages, devices_per_stage=len(plan.stages[0].devices),
            num_microbatches=plan.num_microbatches, microbatch_size=plan.microbatch_size, schedule=plan.schedule,
            stage_layers=tuple(s.layers for s in plan.stages), predicted=plan.predicted,
            solver_status=st.solver_status, optimality_gap=st.optimality_gap, candidates=st.candidates,
            best_uniform_step_time_s=st.best_uniform_step_time_s, wall_time_s=wall_time_s, plan=plan)


def plan_local(profile: Profile, num_devices: int, batch_size: int, *,
               schedules: Sequence[str] = RUNNABLE_SCHEDULES, num_stages: int | None = None,
               num_microbatches: int | None = None, time_limit_s: float = 10.0,
               layout: dict[str, int] | None = None, stage_multiple: int = 1, zero1: bool = False) -> LocalPlan:
    """Choose stages, microbatches, schedule and stage split for ``num_devices`` devices of the profile's cluster
    from a profile of the step at batch size ``batch_size`` (measured on the local device for a plan that matches
    the hardware: ``profile(..., measure=True)``). ``num_stages`` / ``num_microbatches`` fix that choice;
    ``schedules`` limits the schedules tried. ``layout``: every stage's mesh as ``parallelize``'s (``{"tensor": 2}``,
    ``{"fsdp": 2}``; an axis left out is 1, ``data`` the rest of the stage's devices): only stage counts whose device
    groups it fits are tried, and the costs are those of that layout. Raises ValueError when no layout is legal or
    none fits the devices' memory. ``stage_multiple``: stage counts are multiples of it (the processes of a
    multi-process run, each of whose stages must stay within one process). ``zero1``: the optimizer state sharded
    over each stage's data axis (ZeRO-1)."""
    if not isinstance(profile, Profile):
        raise TypeError(f"plan_local: profile must be an autopp.profiler.Profile, got {type(profile).__name__}; "
                        "make one with autopp.profiler.profile(step, *args, measure=True).")
    for name, value in (("num_devices", num_devices), ("batch_size", batch_size)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"plan_local: {name} must be a positive int, got {value!r} ({type(value).__name__}).")
        if value < 1:
            raise ValueError(f"plan_local: {name} must be a positive int, got {value}; pass e.g. {name}=1.")
    unknown = [s for s in schedules if s not in RUNNABLE_SCHEDULES]
    if unknown or not schedules:
        raise ValueError(f"plan_local: schedules {list(schedules)} must be a non-empty selection of the runnable "
                         f"{RUNNABLE_SCHEDULES}; pass e.g. schedules=('1f1b',).")
    t0 = time.perf_counter()
    cluster = Cluster(num_nodes=1, devices_per_node=num_devices, device=profile.cluster.device)
    n = num_devices
    lay = dict(layout or {})
    tp, fsdp, data = lay.get("tensor", 1), lay.get("fsdp", 1), lay.get("data")
    stages = [S for S in divisors(n) if (num_stages is None or S == num_stages) and S <= pipeline_units(profile)
              and S % stage_multiple == 0]
    fitting = [S for S in stages if (n // S) % (tp * fsdp) == 0 and (data is None or n // S == data * fsdp * tp)]
    if layout and not fitting:
        raise ValueError(f"plan_local: layout {layout} fits no pipeline of {n} device(s) (every stage's devices must "
                         f"be data x fsdp x tensor, stage counts {stages}); give a layout whose axes multiply to a "
                         f"divisor of {n}, e.g. {{'tensor': {tp}}} with data left out, or pass num_stages=.")
    legal = [S for S in fitting if batch_size % (n // S // tp) == 0 and (
        num_microbatches is None or batch_size % (n // S // tp * num_microbatches) == 0)]
    if not legal:
        raise ValueError(_no_layout_message(profile, n, batch_size, num_stages, num_microbatches))
    # largest microbatches first: among layouts predicted equally fast (one stage, whose microbatches only save memory)
    # the fewest microbatches win (a one-stage step runs them as a loop, which XLA:CPU runs convolutions 5-40x slower
    # in: docs/limits.md)
    sizes = tuple(b for b in range(batch_size, 0, -1) if batch_size % b == 0)
    try:
        plan = plan_model(profile, cluster, global_batch=batch_size, schedules=tuple(schedules), recompute=("none",),
                          microbatch_sizes=sizes, pipeline_degrees=tuple(legal), tensor_degrees=(tp,),
                          max_virtual_stages=1, refine_top=4, time_limit_s=time_limit_s, dispatch_s=DISPATCH_S,
                          fsdp=fsdp > 1, fsdp_degrees=(fsdp,), zero1=bool(zero1), sequence_parallel=False,
                          num_microbatches=num_microbatches)
    except ValueError as e:
        msg = str(e)
        if "no layout" in msg or "fits" in msg:
            raise ValueError(msg.replace("plan_model:", "plan_local:", 1) + " Use more devices (more stages share out "
                             "the parameters and optimizer state) or a smaller model or batch.") from None
        raise
    if not plan.stages:
        raise ValueError(_no_layout_message(profile, n, batch_size, num_stages, num_microbatches))
    return LocalPlan.of(plan, time.perf_counter() - t0)


def _no_layout_message(profile: Profile, n: int, batch: int, num_stages, num_microbatches) -> str:
    units = pipeline_units(profile)
    stages = [S for S in divisors(n) if S <= units and (num_stages is None or S == num_stages)]
    fewer = most_devices_with_a_layout(n, units, batch, num_stages, num_microbatches)
    if not stages:
        return (f"plan_local: no pipeline layout on {n} device(s): the number of stages must divide {n} and be at "
                f"most the {units} layer(s) of the model" + (f" (num_stages={num_stages})" if num_stages else "")
                + f"; pass fewer devices, e.g. devices=jax.devices()[:{fewer}].")
    d = n // max(stages)
    return (f"plan_local: no pipeline layout for batch size {batch} on {n} device(s): the model can be cut into at "
            f"most {max(stages)} stage(s) that divide the devices evenly, so every stage has at least {d} devices "
            f"and a microbatch must split evenly over them (batch / microbatches a multiple of {d}"
            + (f", microbatches={num_microbatches}" if num_microbatches else "") + f"). Use a batch size that is a "
            f"multiple of {d}, or pass fewer devices, e.g. devices=jax.devices()[:{fewer}].")


def pipeline_units(profile: Profile) -> int:
    """The most stages a profile is cut into: its repeated blocks (all its layers when it has none), as
    :func:`~autopp.planner.plan_model` counts them."""
    return sum(1 for lay in profile.layers if lay.name.startswith("block")) or len(profile.layers)


def most_devices_with_a_layout(n: int, units: int, batch: int, num_stages=None, num_microbatches=None) -> int:
    """The most devices below ``n`` that a pipeline of at most ``units`` stages (``num_stages`` if given) lays out
    with the batch split evenly over each stage's devices (1 at least)."""
    for m in range(n - 1, 1, -1):
        for S in divisors(m):
            if S <= units and num_stages in (None, S) and batch % (m // S * (num_microbatches or 1)) == 0:
                return m
    return 1

"""The three plan sources of ``autopp.parallelize``, each a function from (config, traced step) to a complete
:class:`Plan` and the per-microbatch forward it splits:

* :func:`plan_from_counts`: the stage and microbatch counts and the schedule given (split balanced by FLOPs);
* :func:`plan_from_replay`: a saved plan (made by ``plan_for`` or offline by ``plan_model``), checked against the
  step and completed with its equations;
* :func:`plan_from_planner`: the step profiled on the local devices and planned for them.

A complete plan names every stage's devices, mesh, first and last forward equation and recomputation, the
schedule's text, and (with sequence parallelism) the layers' equations: everything :func:`autopp.runtime.build_executable`
needs, so a plan replays exactly what ran.
"""

from __future__ import annotations

import collections
import dataclasses
import difflib
import itertools
import re
import time
import warnings
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NamedTuple

from jax.extend import core as jex_core

from autopp._config import ParallelizeConfig
from autopp._microbatches import batch_size, counted_once, microbatch_forward, reductions, retracer
from autopp._progress import phase
from autopp.core import (
    SCHEDULE_NAMES,
    Plan,
    Schedule,
    StagePlan,
    TracedStep,
    batch_dependent_vars,
    get_schedule,
    moved_work_inputs,
    row_slice,
    sparse_batch_leaves,
    user_stacklevel,
)
from autopp.profiler import Cluster, Profile, StageSplit, aval_bytes, profile, split_at, split_stages

if TYPE_CHECKING:
    from autopp.planner import LocalPlan

_WHO = "autopp.parallelize"


class Sourced(NamedTuple):
    """A plan source's result."""

    plan: Plan
    """The complete plan."""
    forward: jex_core.ClosedJaxpr
    """The loss's forward traced at microbatch size: the program the plan's equations index."""
    output_reductions: tuple = ()
    """Per output of the loss: ``"mean"``, ``"sum"`` or None, as its program shows
    (:func:`autopp._microbatches.reductions`)."""


def _profile(step_fn: Callable, args: tuple, traced: TracedStep, config: ParallelizeConfig, **kwargs) -> Profile:
    """The step's profile on the local devices, from the trace already made. Batch leaves of different leading
    dimensions (a physics-informed network's 32 interior and 16 boundary points) leave the profile without a batch
    size (a global batch asked of it would be ambiguous); the runtime splits every leaf alike, so its plans count
    the batch in units of the dimensions' greatest common divisor (2 interior and 1 boundary point)."""
    prof = profile(step_fn, *args, cluster=Cluster.local(config.devices), batch_argnums=config.batch_argnums,
                   traced=traced, donated=config.donated_leaves(args), **kwargs)
    return prof if prof.batch_size is not None else dataclasses.replace(prof, batch_size=batch_size(traced))


# -- explicit counts -------------------------------------------------------------------------------------------


def _microbatches_for(config: ParallelizeConfig, traced: TracedStep) -> int:
    if config.num_microbatches is not None:
        return config.num_microbatches
    if isinstance(config.schedule, Schedule):
        return config.schedule.num_microbatches
    if config.schedule in (None, "1f1b", "gpipe") and sparse_batch_leaves(traced):
        return 1  # (a sparse array in the batch cannot be split into microbatches; its stages' devices split it)
    batch, n = batch_size(traced), config.num_stages
    if config.schedule == "dualpipev":  # at least two microbatches per device group
        fits = [d for d in range(2 * n, 4 * n + 1) if batch % d == 0]
        if not fits:
            raise ValueError(f"{_WHO}: dualpipev needs at least {2 * n} microbatches (2 per device group) dividing "
                             f"the batch of {batch}; pass num_microbatches= or another batch size.")
        return min(_split_evenly(fits, batch, config) or fits)
    step = n if config.schedule == "interleaved-1f1b" else 1  # a multiple of the groups
    fits = [d for d in range(step, 2 * n + 1, step) if batch % d == 0]
    if not fits:
        near = sorted({batch - batch % n, batch - batch % n + n} - {0})
        raise ValueError(f"{_WHO}: interleaved-1f1b needs a microbatch count that is a multiple of the {n} device "
                         f"groups and divides the batch, and no count does for a batch of {batch}: use a batch size "
                         f"that is a multiple of {n} (e.g. {' or '.join(map(str, near))}), or schedule='1f1b' for "
                         "this one.")
    return max(_split_evenly(fits, batch, config) or fits)


def _split_evenly(counts: list[int], batch: int, config: ParallelizeConfig) -> list[int]:
    """The microbatch counts of ``counts`` whose microbatches every device group's data x FSDP devices divide (its
    devices over its tensor degree): the others leave those devices repeating the same examples."""
    groups = config.group_devices(config.num_stages)
    lays = config.layout if isinstance(config.layout, tuple) else [config.layout or {}] * len(groups)
    if len(lays) != len(groups):
        return counts  # (refused with its own message when the stages are laid out)
    degrees = {max(1, len(g) // lay.get("tensor", 1)) for g, lay in zip(groups, lays)}
    return [m for m in counts if all((batch // m) % d == 0 for d in degrees)]


def _schedule_for(config: ParallelizeConfig, num_microbatches: int) -> tuple[str, Schedule]:
    sched = config.schedule
    if isinstance(sched, Schedule):  # (its microbatches agree with num_microbatches: ParallelizeConfig checks)
        return "custom", sched
    v = config.virtual_stages
    return sched, get_schedule(sched, config.num_stages * v, num_microbatches, virtual_stages=v)


def _stage_layouts(config: ParallelizeConfig, sched: Schedule, stage_devices) -> list[dict[str, int]]:
    """Mesh axis sizes of each stage (model chunk): the layout given for its device group."""
    lay = config.layout
    if lay is None or isinstance(lay, dict):
        per = [lay or {} for _ in stage_devices]
    else:
        if len(lay) != sched.num_ranks:
            raise ValueError(f"{_WHO}: layout has {len(lay)} entries for {sched.num_ranks} device groups; give one "
                             "dict per group or one for all.")
        rank_of = sched.stage_to_rank()
        per = [lay[rank_of[c]] for c in range(sched.num_stages)]
    out = []
    for c, (given, devs) in enumerate(zip(per, stage_devices)):
        f, tp = given.get("fsdp", 1), given.get("tensor", 1)
        d = given.get("data", len(devs) // (f * tp))
        if d * f * tp != len(devs):
            raise ValueError(f"{_WHO}: layout {given} does not fit stage {c}'s {len(devs)} device(s): data x fsdp x "
                             f"tensor must equal {len(devs)}; {_layout_fix(given, len(devs), sched.num_ranks)}.")
        out.append({"data": d, "fsdp": f, "tensor": tp})
    return out


def _layout_fix(given: dict[str, int], per_stage: int, num_groups: int) -> str:
    """How to make ``given`` fit stages of ``per_stage`` devices (``num_groups`` device groups)."""
    split = given.get("fsdp", 1) * given.get("tensor", 1)
    if per_stage % split == 0:  # only data is wrong: let it fill the rest
        return f"leave data out (it fills the rest): layout={ {k: v for k, v in given.items() if k != 'data'} }"
    total = per_stage * num_groups
    if split <= total and total % split == 0 and split > per_stage:
        return (f"fsdp x tensor = {split} needs {split} devices per stage, but {total} devices in {num_groups} "
                f"device groups give each {per_stage}: use num_stages <= {total // split}, or a smaller layout")
    sizes = [str(k) for k in range(1, per_stage + 1) if per_stage % k == 0]
    listed = sizes[0] if len(sizes) == 1 else f"{', '.join(sizes[:-1])} or {sizes[-1]}"
    return f"use an fsdp x tensor that divides {per_stage} ({listed}), or other device counts"


def _stage_recompute(config: ParallelizeConfig, num_chunks: int) -> tuple[str, ...]:
    r = config.recompute
    if r is None:
        return ("none",) * num_chunks
    if isinstance(r, str):
        return (r,) * num_chunks
    if len(r) != num_chunks:
        raise ValueError(f"{_WHO}: recompute has {len(r)} entries for {num_chunks} stages (model chunks); give one "
                         "per stage or a single mode.")
    return r


def _stage_plans(traced: TracedStep, forward, split: StageSplit, stage_devices, layouts, recompute
                 ) -> tuple[StagePlan, ...]:
    """One :class:`StagePlan` per stage of ``split``: devices, mesh, equations, FLOPs, the bytes of the parameters it
    holds (each it reads, a shared block on every stage that reads it; of a stacked parameter read by rows, a
    scan's, the rows the stage reads)."""
    spec, fwd = traced.spec, forward.jaxpr
    position = {v: k for k, v in enumerate(fwd.invars)}
    users: dict[int, set] = collections.defaultdict(set)  # parameter -> the stages that read (and hold) it
    rows: dict[tuple[int, int], set] = collections.defaultdict(set)  # (stage, parameter) -> rows it reads
    whole: set[int] = set()  # parameters read other than by rows
    for s, ids in enumerate(split.stage_eqns):
        for i in ids:
            for pos, a in enumerate(fwd.eqns[i].invars):
                if not isinstance(a, jex_core.Literal) and a in position:
                    users[position[a]].add(s)
                    row = row_slice(fwd.eqns[i]) if pos == 0 else None
                    if row is None:
                        whole.add(position[a])
                    else:
                        rows[(s, position[a])].add(row)
    stacked = {k for _, k in rows} - whole
    # the weights only work moved out of the loss reads (their gradients come from its backward alone), where that
    # work runs: the stage of the weights it reads, else the first its results go to (runtime/_placement.py)
    moved = moved_work_inputs(traced.jaxpr.jaxpr, traced.grad_index)
    results = range(len(fwd.invars) - spec.num_hoisted, len(fwd.invars))
    split_rows = traced.microbatched_grad_inputs
    # weights not differentiated (a frozen teacher, an EMA copy; not the batch, nor the moved work's results): held
    # whole where they are read, as the runtime places them
    frozen = {k for k in range(len(fwd.invars)) if not spec.diff_mask[k] and not split_rows[k] and k not in results}
    own = sum(aval_bytes(fwd.invars[k].aval) for k in moved if k in frozen)
    home = min((s for k in moved for s in users.get(k, ())), default=None)
    home = min((s for k in results for s in users.get(k, ())), default=0) if home is None else home
    stages = []
    for s, ids in enumerate(split.stage_eqns):
        owned = sum(aval_bytes(fwd.invars[k].aval) for k, st in users.items()  # (not the moved work's results)
                    if s in st and (spec.diff_mask[k] and k not in stacked or k in frozen) and k not in results)
        owned += own if s == home else 0
        owned += sum(aval_bytes(fwd.invars[k].aval) * len(rows[(s, k)]) // fwd.invars[k].aval.shape[0]
                     for k in stacked if spec.diff_mask[k])
        end = split.stage_starts[s + 1] if s + 1 < len(split.stage_starts) else len(fwd.eqns)
        # the forward is the whole microbatch; a plan's figures are per replica's microbatch, as plan_model's
        replicas = layouts[s].get("data", 1) * layouts[s].get("fsdp", 1)
        stages.append(StagePlan(
            index=s, devices=tuple(d.id for d in stage_devices[s]),
            mesh_shape={k: v for k, v in layouts[s].items() if k == "data" or v > 1},
            equations=(split.stage_starts[s], end - 1), num_equations=len(ids),
            flops=float(split.stage_costs[s]) / replicas, param_bytes=int(owned),
            cut_bytes_after=int(split.cut_bytes[s]) // replicas if s < len(split.cut_bytes) else 0,
            recompute=recompute[s]))
    return tuple(stages)


def plan_from_counts(config: ParallelizeConfig, step_fn: Callable, args: tuple, traced: TracedStep) -> Sourced:
    """The plan for the counts and schedule given: ``num_stages`` device groups of equal size (or the groups
    given), the model split into ``num_stages * virtual_stages`` stages balanced by FLOPs."""
    num_mb = _microbatches_for(config, traced)
    name, sched = _schedule_for(config, num_mb)
    forward = microbatch_forward(step_fn, args, traced, num_mb)
    reduction, kinds = reductions(config, traced, forward, num_mb, retracer(step_fn, args, traced))
    forward = counted_once(forward, traced, num_mb, reduction, kinds)
    groups = config.group_devices(sched.num_ranks)
    rank_of = sched.stage_to_rank()
    stage_devices = [groups[rank_of[c]] for c in range(sched.num_stages)]
    try:
        split = split_stages(forward, traced.microbatched_grad_inputs, sched.num_stages,  # groups of other sizes:
                             weights=[len(d) for d in stage_devices], refuse_unbalanced=True,  # FLOPs per device
                             diff_invars=traced.spec.diff_mask)
    except ValueError as e:
        raise _per_chunk(e, sched, name) from None
    stages = _stage_plans(traced, forward, split, stage_devices, _stage_layouts(config, sched, stage_devices),
                          _stage_recompute(config, sched.num_stages))
    plan = Plan(model_fingerprint=traced.plan_fingerprint, stages=stages, num_microbatches=num_mb, schedule=name,
                schedule_text=sched.to_text(), loss_reduction=reduction,
                virtual_stages=sched.num_stages // sched.num_ranks, zero1=bool(config.zero1))
    return Sourced(plan, forward, kinds)


def _per_chunk(error: ValueError, sched: Schedule, name: str) -> ValueError:
    """``split_stages``' refusal of too many stages, said in the keywords that set them when a schedule runs several
    model chunks per device group (interleaved-1f1b: ``virtual_stages``; dualpipev: 2)."""
    text = str(error)
    limit = (re.search(r"; use num_stages <= (\d+)\.", text)
             or re.search(r"Or use fewer stages: num_stages <= (\d+) ", text))  # (a scan that cannot be cut)
    chunks = sched.num_stages // sched.num_ranks
    if limit is None or chunks == 1:
        return error
    most = int(limit.group(1))
    groups = f"{sched.num_ranks} device group{'s' if sched.num_ranks > 1 else ''}"
    fix = (f"use num_stages <= {max(1, most // 2)} (dualpipev runs 2 model chunks per device group)" if
           name == "dualpipev" else
           f"give a schedule of at most {most} stages (the numbers its actions name), e.g. {sched.num_ranks} row(s) "
           f"of {most // sched.num_ranks} model chunks each" if name not in SCHEDULE_NAMES else
           f"use num_stages x virtual_stages <= {most} (here {sched.num_ranks} x {chunks})"
           + (f", e.g. virtual_stages={most // sched.num_ranks}" if most >= 2 * sched.num_ranks else
              ", e.g. schedule='1f1b' (one chunk per group)" if most >= sched.num_ranks else ""))
    split = f"{sched.num_stages} pipeline stages ({groups} x {chunks} model chunks each)"
    return ValueError(text.replace(f"{sched.num_stages} pipeline stages; use num_stages <= {most}.", f"{split}; {fix}.")
                      .replace(f"so {sched.num_stages} stages cannot balance", f"so {split} cannot balance")
                      .replace(f"Or use fewer stages: num_stages <= {most} ", f"Or {fix} "))


# -- a replayed plan -------------------------------------------------------------------------------------------


def plan_from_replay(config: ParallelizeConfig, step_fn: Callable, args: tuple, traced: TracedStep) -> Sourced:
    """The given plan, checked against the step and completed: stages named by profile layers (a plan made with
    ``plan_model``) get their equations, and a sequence-parallel plan its layers' equations."""
    from autopp.planner import CONFIG_FINGERPRINT  # the planner (and its solver) loads only when a plan needs it

    plan = config.plan
    offline = plan.model_fingerprint.startswith(CONFIG_FINGERPRINT)
    if not offline and plan.model_fingerprint not in (traced.plan_fingerprint, traced.fingerprint):
        raise ValueError(  # (the full fingerprint: plans made before the literal-free one)
            f"{_WHO}: the plan was made for another step (model fingerprint {plan.model_fingerprint}, this step "
            f"{traced.plan_fingerprint}): the computation, shapes or dtypes differ (the batch size, a layer, the "
            "optimizer; constants such as the learning rate may differ). Make a new plan with step.plan_for(...) for "
            "these arguments.")
    forward = microbatch_forward(step_fn, args, traced, plan.num_microbatches)
    _, kinds = reductions(config, traced, forward, plan.num_microbatches, retracer(step_fn, args, traced))
    by_layers = not all(st.equations is not None for st in plan.stages)
    layer_equations = plan.layer_equations
    if by_layers or (plan.sequence_parallel and not layer_equations):
        if any(st.layers is None for st in plan.stages):
            raise ValueError(f"{_WHO}: the plan is sequence-parallel but names neither its layers' equations nor its "
                             "stages' layers; make it again with plan_model(profile, ...) or step.plan_for(...).")
        _check_stage_layers(plan)
        prof = _profile(step_fn, args, traced, config)
        if offline:
            _check_offline_plan(plan, prof, batch_size(traced))
        _check_stage_layers(plan, len(prof.layers))
        ranges = _layer_ranges(prof, traced, forward)
        if plan.sequence_parallel:
            layer_equations = tuple((a, b - 1) for a, b in ranges)
    starts = (_stage_starts(ranges, traced, forward, [st.layers[0] for st in plan.stages], prof) if by_layers
              else [st.equations[0] for st in plan.stages])
    forward = counted_once(forward, traced, plan.num_microbatches, plan.loss_reduction, kinds)
    split = split_at(forward, traced.microbatched_grad_inputs, starts)
    by_id = {d.id: d for d in config.devices}
    stage_devices = [[by_id[i] for i in st.devices] for st in plan.stages]
    layouts = [{"data": 1, **st.mesh_shape} for st in plan.stages]
    fresh = _stage_plans(traced, forward, split, stage_devices, layouts, [st.recompute for st in plan.stages])
    if not by_layers:
        _check_stage_equations(plan, fresh)
        if all(st.layers is not None for st in plan.stages):
            _check_stage_layers(plan)
    stages = tuple(dataclasses.replace(new, mesh_shape=old.mesh_shape, layers=old.layers, param_specs=old.param_specs,
                                       forward_time_s=old.forward_time_s, backward_time_s=old.backward_time_s)
                   for new, old in zip(fresh, plan.stages))
    return Sourced(dataclasses.replace(plan, stages=stages, layer_equations=layer_equations), forward, kinds)


def _check_stage_equations(plan: Plan, fresh) -> None:
    """A plan's stages by equations: each ends where the next begins and the last at the forward's last equation
    (what its stages' starts make), as a plan made by autopp always is."""
    for old, new in zip(plan.stages, fresh):
        if tuple(old.equations) != tuple(new.equations):
            raise ValueError(
                f"{_WHO}: the plan's stage {old.index} has equations {list(old.equations)}, but the stages' starts "
                f"make it {list(new.equations)} (each stage ends where the next begins, the last at this step's last "
                "equation). Was the plan edited by hand? Make it again with step.plan_for(...), or edit only where "
                "stages begin, keeping the ranges consecutive.")


def _check_stage_layers(plan: Plan, num_layers: int | None = None) -> None:
    """A plan's stages name consecutive, non-overlapping ranges of profile layers from the first; with
    ``num_layers``, ranges that cover exactly the step's layers."""
    expected = 0
    for st in plan.stages:
        first, last = st.layers
        if first != expected or last < first or (num_layers is not None and last >= num_layers):
            cover = f"this step's {num_layers} profile layers (0-{num_layers - 1})" if num_layers else "the layers"
            raise ValueError(
                f"{_WHO}: the plan's stage {st.index} has layers {[first, last]}, but the stages' layers must be "
                f"consecutive ranges covering {cover} in order, stage {st.index} beginning at layer {expected}. "
                "Was the plan edited by hand? Make it again with step.plan_for(...) or plan_model(...).")
        expected = last + 1
    if num_layers is not None and expected != num_layers:
        raise ValueError(
            f"{_WHO}: the plan's stages cover layers 0-{expected - 1} of this step's {num_layers}; the last stage must "
            f"end at layer {num_layers - 1}. Make the plan again with step.plan_for(...) or plan_model(...).")


def _check_offline_plan(plan: Plan, prof: Profile, batch: int) -> None:
    """A plan made with ``plan_model`` (from a profile or a model description, at any traced batch size) names its
    stages by the profile's layers; it replays on a traced step with the same layers and parameters (its structure
    fingerprint) whose batch is the plan's global batch."""
    last = plan.stages[-1].layers[1] if plan.stages[-1].layers else None
    if plan.model_fingerprint != prof.structure_fingerprint and last == len(prof.layers) - 1:
        raise ValueError(
            f"{_WHO}: the plan was made for another model (its layers, parameter shapes or per-example input "
            f"shapes, such as the sequence length, differ from this step's: fingerprint {plan.model_fingerprint}, "
            f"this step {prof.structure_fingerprint}); make the plan for this "
            "step: plan_model(autopp.profiler.profile(step, *args), cluster, global_batch=...).")
    if last != len(prof.layers) - 1:
        raise ValueError(
            f"{_WHO}: the plan was made offline for a model of {None if last is None else last + 1} layers "
            f"(embedding, blocks, head), but this step's profile has {len(prof.layers)} "
            f"({', '.join(lay.name for lay in prof.layers[:6])}{', ...' if len(prof.layers) > 6 else ''}); make the "
            "plan for this step: `autopp plan --step module:function ...`, or plan_model(autopp.profiler.profile("
            "step, *args), cluster, global_batch=...) (a zoo model: its config).")
    mesh = plan.stages[0].mesh_shape
    replicas = mesh.get("data", 1) * mesh.get("fsdp", 1)
    if plan.microbatch_size is not None and plan.microbatch_size * plan.num_microbatches * replicas != batch:
        planned = plan.microbatch_size * plan.num_microbatches * replicas
        raise ValueError(
            f"{_WHO}: the plan was made for a global batch of {plan.microbatch_size} x {plan.num_microbatches} "
            f"microbatches x {replicas} data-parallel replicas = {planned} examples, but this step's batch has "
            f"{batch}; make the plan with global_batch={batch}.")


# -- the planner -----------------------------------------------------------------------------------------------


def plan_from_planner(config: ParallelizeConfig, step_fn: Callable, args: tuple, traced: TracedStep) -> Sourced:
    """The step profiled on the local devices (layers timed) and planned for ``config.devices``: stage count,
    microbatches, schedule and the split of profile layers with the smallest predicted step time."""
    t0 = time.perf_counter()
    try:
        Cluster.local(config.devices)
    except ValueError as e:
        raise ValueError(f"{_WHO}: cannot plan for these devices: {e} Or skip the planner: pass num_stages=, "
                         "num_microbatches= and schedule=.") from None
    with phase("profiling the step's layers") as ph:
        prof = _profile(step_fn, args, traced, config, measure=True)
        ph.done(f"profiled {len(prof.layers)} layers")
    local, config = _plan_local(config, prof, batch_size(traced))
    planning_s = time.perf_counter() - t0
    sched = get_schedule(local.schedule, local.num_stages, local.num_microbatches)
    forward = microbatch_forward(step_fn, args, traced, local.num_microbatches)
    ranges = _layer_ranges(prof, traced, forward)
    starts = _stage_starts(ranges, traced, forward, [first for first, _ in local.stage_layers], prof)
    reduction, kinds = reductions(config, traced, forward, local.num_microbatches, retracer(step_fn, args, traced))
    forward = counted_once(forward, traced, local.num_microbatches, reduction, kinds)
    split = split_at(forward, traced.microbatched_grad_inputs, starts)
    per = local.devices_per_stage
    stage_devices = [config.devices[s * per:(s + 1) * per] for s in range(local.num_stages)]
    layouts = _stage_layouts(config, sched, stage_devices)
    stages = _stage_plans(traced, forward, split, stage_devices, layouts, _stage_recompute(config, sched.num_stages))
    stages = tuple(dataclasses.replace(st, layers=local.stage_layers[st.index], forward_time_s=p.forward_time_s,
                                       backward_time_s=p.backward_time_s)
                   for st, p in zip(stages, local.plan.stages))
    plan = Plan(model_fingerprint=traced.plan_fingerprint, stages=stages, num_microbatches=local.num_microbatches,
                schedule=local.schedule, schedule_text=sched.to_text(), loss_reduction=reduction,
                microbatch_size=local.microbatch_size, predicted=local.predicted, zero1=local.plan.zero1,
                planner=dataclasses.replace(local.plan.planner, wall_time_s=planning_s))
    return Sourced(plan, forward, kinds)


def _plan_local(config: ParallelizeConfig, prof: Profile, batch: int) -> tuple[LocalPlan, ParallelizeConfig]:
    """The local plan, and the config it is for: one whose devices are the first of ``config``'s that split the
    batch evenly when all of them cannot (the last, smaller batch of an epoch), said in a warning."""
    from autopp.planner import most_devices_with_a_layout, pipeline_units, plan_local

    n = len(config.devices)
    layout, num_stages = config.layout, None
    if isinstance(layout, tuple):  # one per device group: as many groups (stages) as layouts
        if any(lay != layout[0] for lay in layout):
            raise ValueError(f"{_WHO}: the planner gives every stage the same mesh, but layout has {len(layout)} "
                             f"different ones ({list(layout)}); pass num_stages=, num_microbatches= and schedule= "
                             "with them, or one layout for all.")
        layout, num_stages = layout[0], len(layout)
    try:
        with phase(f"planning for {n} device(s)") as ph:
            processes = sorted({d.process_index for d in config.devices})
            local = plan_local(prof, n, batch, layout=layout, stage_multiple=len(processes),
                               num_microbatches=config.num_microbatches,
                               zero1=bool(config.zero1), **({} if num_stages is None else {"num_stages": num_stages}))
            ph.done(f"planned {local.num_stages} stage(s), {local.num_microbatches} microbatch(es), {local.schedule}")
    except ValueError as e:
        import jax

        fewer = most_devices_with_a_layout(n, pipeline_units(prof), batch, num_stages, config.num_microbatches)
        if ("no pipeline layout for batch size" in str(e) and not config.layout and jax.process_count() == 1
                and config.device_groups is None and 1 <= fewer < n):
            units = pipeline_units(prof)
            within = f"{units} stages or fewer (the model's repeated blocks: the most stages the planner cuts it into)"
            counts = f" in num_microbatches={config.num_microbatches}" if config.num_microbatches else ""
            warnings.warn(f"{_WHO}: a batch of {batch} does not split evenly{counts} over the devices of any pipeline "
                          f"of {within} on {n} device(s); this batch size runs on the first {fewer} (its results are "
                          "the same; the others idle). A batch size that splits over all of them uses them all, and so "
                          "may num_stages= with num_microbatches= (any stage count up to the layers').",
                          stacklevel=user_stacklevel())
            return _plan_local(dataclasses.replace(config, devices=tuple(config.devices[:fewer])), prof, batch)
        raise ValueError(f"{_WHO}: cannot plan this step for {n} device(s): {str(e).removeprefix('plan_local: ')} "
                         "Or fix the layout yourself with num_stages=, num_microbatches= and schedule=.") from None
    local = _fewer_if_faster(config, prof, batch, local)
    used = local.num_stages * local.devices_per_stage
    if used < n:
        config = dataclasses.replace(config, devices=tuple(config.devices[:used]))
    return _process_0_s(local), config


def _fewer_if_faster(config: ParallelizeConfig, prof: Profile, batch: int, local):
    """``local`` (the plan over all of ``config``'s devices), unless the batch splits over fewer of them for plain
    data parallelism and the cost model predicts that faster: a batch of 20 on 6 devices leaves pipelines of 3 stages
    x data 2 or 6 x 1, all bubble at one microbatch (a user trial: 2.2 ms a step against 1.3 ms on 5 devices).
    Then a warning, and the plan for the first devices."""
    import jax

    from autopp.planner import plan_local

    n = len(config.devices)
    if batch % n == 0 or config.layout or config.num_microbatches is not None or jax.process_count() > 1 or (
            config.device_groups is not None):
        return local
    m = max(d for d in range(1, n) if batch % d == 0)
    try:
        data_parallel = plan_local(prof, m, batch, zero1=bool(config.zero1))
    except ValueError:  # does not fit fewer devices
        return local
    ours, theirs = local.predicted.step_time_s, data_parallel.predicted.step_time_s
    if theirs >= ours:
        return local
    warnings.warn(f"{_WHO}: a batch of {batch} splits over at most {m} of the {n} devices for data parallelism; "
                  f"the best plan over all {n} ({local.num_stages} stage(s) x {local.devices_per_stage} device(s), "
                  f"{local.num_microbatches} microbatch(es)) is predicted at {ours * 1e3:.3g} ms a step, "
                  f"{m} devices at {theirs * 1e3:.3g} ms, so this step runs on the first {m} (the others idle). "
                  f"A batch size that is a multiple of {n} uses them all.", stacklevel=user_stacklevel())
    return data_parallel


_plans_agreed = itertools.count()


def _process_0_s(local):
    """In a multi-process run every process runs process 0's plan: each measured the layers on its own devices, and
    times that differ could make their plans differ."""
    import jax

    if jax.process_count() == 1:
        return local
    from autopp.core import distributed_client

    client, key = distributed_client(), f"autopp/local_plan/{next(_plans_agreed)}"
    if jax.process_index() == 0:
        client.key_value_set(key, local.plan.to_json())
        return local
    return type(local).of(Plan.from_json(client.blocking_key_value_get(key, 600_000)), local.wall_time_s)


# -- profile layers as equations of the pipeline's forward --------------------------------------------------------


def internal_error(what: str) -> RuntimeError:
    return RuntimeError(f"autopp internal error: {what}. Please report it; meanwhile pass num_stages=, "
                        "num_microbatches= and schedule= to autopp.parallelize, which skips the planner.")


def _layer_ranges(prof: Profile, traced: TracedStep, forward) -> list[tuple[int, int]]:
    """Each profile layer's equations ``[first, end)`` in the per-microbatch forward ``forward``.

    The profile's layers index equations of the full-batch forward (``traced.spec.forward``); the pipeline runs the
    forward re-traced at microbatch size. The two traces have the same equations (only shapes differ), but for a few
    that JAX writes otherwise at a size of 1 (``jnp.take_along_axis`` of one example: one gather, not a reshape and a
    gather): the traces are aligned by their primitives, and each index is read through the alignment."""
    full, small = traced.spec.forward.jaxpr.eqns, forward.jaxpr.eqns
    to_small = _aligned(full, small)
    mask = traced.microbatched_grad_inputs
    dep, full_dep = batch_dependent_vars(forward.jaxpr, mask), batch_dependent_vars(traced.spec.forward.jaxpr, mask)
    matched = {i: j for i, j in enumerate(to_small[:-1]) if j < to_small[i + 1]}  # (one alone: the next one's)
    if any(any(v in dep for v in small[j].outvars) != any(v in full_dep for v in full[i].outvars)
           for i, j in matched.items()):
        raise internal_error("the loss's forward traced at the full batch and at microbatch size depend on the batch "
                             "at different equations, so the planner's layer boundaries cannot be placed in the "
                             "pipeline's forward")
    ranges = []
    for lay in prof.layers:
        r = prof.graph.nodes[lay.index].get("eqn_range")
        if r is None:
            raise internal_error(f"profile layer {lay.index} ({lay.name}) carries no equation range")
        ranges.append((to_small[r[0]], to_small[r[1]]))
    return ranges


def _aligned(full, small) -> list[int]:
    """For each equation index of ``full`` (and its end, ``len(full)``), the index in ``small`` of the first
    equation at or after it that the two share (:class:`difflib.SequenceMatcher` over their primitives)."""
    if len(full) == len(small) and all(a.primitive is b.primitive for a, b in zip(full, small)):
        return list(range(len(full) + 1))
    names = ([e.primitive.name for e in full], [e.primitive.name for e in small])
    blocks = difflib.SequenceMatcher(None, *names, autojunk=False).get_matching_blocks()
    if sum(b.size for b in blocks) < 0.9 * max(len(full), len(small)):
        first = next((i for i, (a, b) in enumerate(zip(full, small)) if a.primitive is not b.primitive),
                     min(len(full), len(small)))
        raise internal_error(
            f"the loss's forward traced at the full batch ({len(full)} equations) and at microbatch size "
            f"({len(small)} equations) differ from equation {first} on, so the planner's layer boundaries cannot "
            "be placed in the pipeline's forward")
    to_small: list = [None] * len(full) + [len(small)]
    for b in blocks:
        to_small[b.a:b.a + b.size] = range(b.b, b.b + b.size)
    for i in range(len(full) - 1, -1, -1):  # an equation of the full trace alone: the next shared one's index
        if to_small[i] is None:
            to_small[i] = to_small[i + 1]
    return to_small


def _stage_starts(ranges: Sequence[tuple[int, int]], traced: TracedStep, forward, first_layers: Sequence[int],
                  prof: Profile) -> list[int]:
    """The forward equations where stages whose first profile layers are ``first_layers`` begin: each one's first
    batch-dependent equation (stage 0: the forward's first one)."""
    dep = batch_dependent_vars(forward.jaxpr, traced.microbatched_grad_inputs)
    batch_eqns = [i for i, e in enumerate(forward.jaxpr.eqns) if any(v in dep for v in e.outvars)]
    starts = [batch_eqns[0]]
    for s, first in enumerate(first_layers[1:], start=1):
        a, b = ranges[first]
        eq = next((i for i in batch_eqns if a <= i < b), None)
        if eq is None or eq <= starts[-1]:
            raise internal_error(f"stage {s} begins at profile layer {first} ({prof.layers[first].name}, equations "
                                 f"{a}-{b - 1}), which has no batch-dependent equation after the previous stage's "
                                 "start")
        starts.append(eq)
    return starts


SOURCES: dict[str, Callable[[ParallelizeConfig, Callable, tuple, TracedStep], Sourced]] = {
    "counts": plan_from_counts, "replay": plan_from_replay, "planner": plan_from_planner}
"""Plan source by :attr:`ParallelizeConfig.source`."""


def source_plan(config: ParallelizeConfig, step_fn: Callable, args: tuple, traced: TracedStep) -> Sourced:
    """The complete plan (and the forward it splits) from the source the config names."""
    return SOURCES[config.source](config, step_fn, args, traced)



"""Build a step's instruction list once, then run it: every program dispatched asynchronously.

The step is laid out as a list of tasks over a slot array (:mod:`autopp.runtime._step`, the schedule's actions
by :mod:`autopp.runtime._pipeline`); each task is ``(fn, input slots, output slots, slots to free)``, ``fn`` a
jitted program or a :class:`~autopp.runtime._tasks.Transfer`. Then the passes of :mod:`autopp.runtime._passes`
run, each from a task list to a task list: ``reuse_accumulators``, ``localize``, ``insert_frees``, ``compile``.
Running a step is one pass over the result (:class:`~autopp.runtime._executable.Executable`): no tracing, no
compilation after the first call, no host synchronisation; a buffer is dropped right after its last use.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax.extend import core as jex_core

from autopp.core import RECOMPUTE_MODES, Plan, Schedule, TracedStep, batch_dependent_vars, sparse_leaf_mask, weak_typed
from autopp.profiler import split_at

from autopp.runtime import _passes
from autopp.runtime._executable import Executable
from autopp.runtime._meshes import MESH_AXES, StageMeshes
from autopp.runtime._passes import Compiler
from autopp.runtime._placement import conds_as_selects
from autopp.runtime._rows import hold_by_rows, lay_out_row_inputs, row_outputs, row_sharding
from autopp.runtime._segments import segment_stages
from autopp.runtime._pipeline_config import PipelineConfig
from autopp.runtime._step import StepBuilder, analyse
from autopp.runtime._tasks import Program, Task, TaskList, Transfer

__all__ = ["MESH_AXES", "Executable", "PipelineConfig", "Program", "StageMeshes", "Task", "Transfer",
           "build_executable", "build_program", "build_split_executable", "sequence_boundary_activations"]


def build_program(traced, forward, split, stage_devices, *, num_microbatches, loss_reduction,
                  schedule, recompute: Sequence[str] | None = None,
                  layouts: Sequence[dict[str, int]] | None = None, param_specs: Sequence | None = None,
                  zero1: bool = False, sequence_vars=frozenset(), donated=frozenset(),
                  output_reductions: Sequence[str | None] = ()) -> tuple[Program, Compiler, StageMeshes]:
    """The step laid out as tasks, before any pass (arguments as :func:`build_split_executable`'s); with the compiler
    that lowered its programs (and started compiling them) and the stages' meshes."""
    recompute = tuple(recompute) if recompute is not None else ("none",) * split.num_stages
    if len(recompute) != split.num_stages or not set(recompute) <= set(RECOMPUTE_MODES):
        raise ValueError(f"recompute={recompute!r}: give one of 'none', 'full', 'selective' per stage "
                         f"({split.num_stages} stages).")
    stage_of = tuple(range(split.num_stages))
    if split.num_stages > 1 and not sequence_vars:  # (sequence parallelism keeps a stage's iterations unrolled)
        seg = segment_stages(forward, traced.microbatched_grad_inputs, traced.spec.diff_mask, split, schedule)
        if seg.num_segments > split.num_stages:
            split, stage_of, schedule = seg.split, seg.stage_of, seg.schedule
            stage_devices, recompute = seg.per_segment(stage_devices), tuple(seg.per_segment(recompute))
            layouts = None if layouts is None else seg.per_segment(layouts)
            param_specs = None if param_specs is None else seg.per_segment(param_specs)
    meshes = StageMeshes(stage_devices, layouts)
    rows, whole = None, []
    if split.num_stages > 1:
        rows = hold_by_rows(traced, forward, split.stage_eqns, _why_not_by_rows(meshes), report=whole,
                            refuse=_refuse_rows(zero1, sequence_vars), plan_stage=stage_of)
        _warn_whole_stacks(whole)
    user_traced, user_donated = traced, frozenset(donated)
    if rows is not None:  # the step over blocks of rows: parameter positions after a stacked one move
        traced, forward, donated = rows.traced, rows.forward, rows.donated(donated)
        if param_specs is not None:
            param_specs = [None if ps is None else {rows.forward_position(int(k)): v for k, v in ps.items()
                                                    if rows.forward_position(int(k)) is not None}
                           for ps in param_specs]
    if split.num_stages > 1:  # an update under lax.cond, each parameter's part on its stage
        traced = conds_as_selects(traced)
    config = PipelineConfig(num_microbatches=num_microbatches, loss_reduction=loss_reduction, schedule=schedule,
                            recompute=recompute, param_specs=None if param_specs is None else tuple(param_specs),
                            zero1=bool(zero1), sequence_vars=frozenset(sequence_vars),
                            donated=frozenset(donated), stage_of=stage_of,
                            output_reductions=tuple(output_reductions))
    step = analyse(traced, forward, split, meshes, config)
    compiler = Compiler()
    builder = StepBuilder(step, TaskList(compiler.lower))
    if rows is None:
        program = builder.build()
        _warn_fsdp_whole(meshes)
        _warn_batch_undivided(meshes, user_traced, num_microbatches)
        return program, compiler, meshes

    def shardings_of(stages):
        return [meshes.replicated[s] for s in stages]

    user_slots = lay_out_row_inputs(builder.tl, builder.input_slots, rows, user_traced, shardings_of, user_donated)
    program = builder.build()
    _warn_fsdp_whole(meshes)
    _warn_batch_undivided(meshes, user_traced, num_microbatches)
    return row_outputs(program, rows, user_slots, shardings_of), compiler, meshes


def _warn_fsdp_whole(meshes: StageMeshes) -> None:
    """FSDP cannot split a parameter none of whose dimensions its degree divides (JAX arrays shard evenly): say
    which stay whole on every device of their stage, with their optimizer state."""
    for loc, whole in sorted(meshes.fsdp_whole.items()):
        n = meshes.layouts[loc]["fsdp"]
        names = ", ".join(f"{name} {list(shape)}" for name, shape in list(whole.items())[:8])
        more = f" and {len(whole) - 8} more" if len(whole) > 8 else ""
        warnings.warn(
            f"autopp: fsdp={n} on stage {loc} leaves {len(whole)} of the values it would split whole on each of its "
            f"devices (a trained parameter with its gradient and optimizer state, a frozen input or a value the step "
            f"computes alone), since no dimension of theirs is divisible by {n}: {names}{more}. "
            f"Use sizes divisible by {n}, or a smaller fsdp degree that divides them.", stacklevel=3)


def _warn_batch_undivided(meshes: StageMeshes, traced: TracedStep, num_microbatches: int) -> None:
    """A microbatch that a stage's data-parallel devices do not divide runs whole on each of them (or on each of the
    part that divides it): they repeat the same work. Say so, with the batch sizes that divide. (A leaf of another
    length left whole, a sparse array's entries or row offsets, repeats no examples: not said.)"""
    sparse = sparse_leaf_mask(traced)
    dense = {v.aval.shape[0] // num_microbatches for v, b, s in zip(traced.jaxpr.jaxpr.invars, traced.batch_mask,
                                                                     sparse) if b and not s and v.aval.shape}
    for size, n in sorted({u for found in meshes.batch_undivided.values() for u in found
                           if not dense or u[0] in dense}):
        warnings.warn(
            f"autopp.parallelize: microbatches of {size} example(s) do not divide over a stage's {n} data-parallel "
            f"devices (data x fsdp), so those devices repeat the same examples instead of sharing them. Use a batch "
            f"size that is a multiple of num_microbatches x {n} = {num_microbatches * n}, or fewer microbatches.",
            stacklevel=3)


def _refuse_rows(zero1: bool, sequence_vars) -> str | None:
    """Why no stacked parameter is held by rows in this run, or None."""
    if jax.process_count() > 1:
        return "this is a multi-process run"
    if zero1:
        return "ZeRO-1 shards the optimizer state"
    return "sequence parallelism keeps the iterations unrolled" if sequence_vars else None


def _why_not_by_rows(meshes: StageMeshes):
    """``can_hold(stages)`` for :func:`hold_by_rows`: None when one array sharded by rows can hold a stack's blocks
    on those stages, else why not."""
    def can_hold(stages):
        if any(meshes.layouts[s]["tensor"] > 1 or meshes.layouts[s]["fsdp"] > 1 for s in stages):
            return "the stages that read them split parameters over a tensor or FSDP axis"
        if len({d for s in stages for d in meshes.devices[s]}) < sum(len(meshes.devices[s]) for s in stages):
            return ("several of their blocks would share devices (interleaved-1f1b and dualpipev put several model "
                    "chunks on one device group, and a stage whose blocks other work separates runs them as "
                    "segments of its own: a scan over time unrolled inside each block, say)")
        if row_sharding([meshes.replicated[s] for s in stages]) is None:
            return "the meshes of the stages that read them differ in shape"
        return None
    return can_hold


def _warn_whole_stacks(whole) -> None:
    """One warning per reason for the stacked parameters that stay whole (see docs/limits.md)."""
    by_reason: dict[str, list[str]] = {}
    for path, why in whole:
        by_reason.setdefault(why, []).append(path)
    for why, paths in by_reason.items():
        named = ", ".join(paths[:3]) + (f" and {len(paths) - 3} more" if len(paths) > 3 else "")
        warnings.warn(
            f"autopp.parallelize: the stacked parameter(s) {named} stay whole, with their optimizer state, on the "
            f"first stage that reads them, and every other stage that reads them holds a copy, because {why}. To "
            "divide them between the stages by rows, see docs/limits.md ('Stacked parameters').", stacklevel=8)


def build_split_executable(traced, forward, split, stage_devices, *, num_microbatches, loss_reduction,
                           schedule, recompute: Sequence[str] | None = None,
                     layouts: Sequence[dict[str, int]] | None = None, param_specs: Sequence | None = None,
                     zero1: bool = False, sequence_vars=frozenset(), donated=frozenset(),
                     output_reductions: Sequence[str | None] = ()) -> Executable:
    """Build the step's instruction list for a split of the forward (what :func:`build_executable` reads off a plan).
    ``forward`` is the loss's forward jaxpr at microbatch size;
    ``recompute`` gives each stage's recomputation mode (default none); ``layouts`` each stage's mesh axis sizes
    (``data``, ``fsdp``, ``tensor``; default all data); ``param_specs`` each stage's parameter layouts over its
    tensor axis from a plan (default: Megatron's rule); ``zero1`` shards optimizer state over the data axis;
    ``sequence_vars``: forward activations split along their sequence over the tensor axis (sequence parallelism);
    ``donated``: the step's flat inputs whose buffers the step may reuse for its results (``donate_argnums``);
    ``output_reductions``: per output of the loss, how its microbatch values combine where its program shows it
    (:func:`autopp.core.output_reductions`; the rest follow ``loss_reduction``)."""
    program, compiler, meshes = build_program(
        traced, forward, split, stage_devices, num_microbatches=num_microbatches, loss_reduction=loss_reduction,
        schedule=schedule, recompute=recompute, layouts=layouts, param_specs=param_specs, zero1=zero1,
        sequence_vars=sequence_vars, donated=donated, output_reductions=output_reductions)
    program = _passes.reuse_accumulators(program, compiler)
    program = _passes.localize(program, meshes.devices)
    program = _passes.insert_frees(program)
    program = _passes.compile(program, compiler)
    weak = [a.weak_type for a in traced.jaxpr.out_avals]
    if any(weak):  # a value computed from a Python scalar comes back weak-typed, as from jax.jit
        program = dataclasses.replace(program, outputs=tuple(
            (lambda env, fn=fn: weak_typed(fn(env))) if w else fn for fn, w in zip(program.outputs, weak)))
    return Executable(program, traced.out_tree)


def sequence_boundary_activations(forward: jex_core.ClosedJaxpr, traced: TracedStep,
                                  layer_equations: Sequence[tuple[int, int]]) -> frozenset:
    """The activations passed from one layer to the next in the per-microbatch forward ``forward`` (batch-dependent
    floating values of rank >= 3, ``(batch, sequence, ...)``, defined before a layer's equations and read by them):
    what sequence parallelism splits along the sequence. ``layer_equations``: each layer's first and last equation."""
    eqns = forward.jaxpr.eqns
    dep = batch_dependent_vars(forward.jaxpr, traced.microbatched_grad_inputs)
    defined_at = {v: i for i, e in enumerate(eqns) for v in e.outvars}
    out = set()
    for a, last in layer_equations[1:]:
        for e in eqns[a:last + 1]:
            for v in e.invars:
                if (not isinstance(v, jex_core.Literal) and defined_at.get(v, a) < a and v in dep
                        and len(v.aval.shape) >= 3 and jnp.issubdtype(v.aval.dtype, jnp.floating)):
                    out.add(v)
    return frozenset(out)


def build_executable(traced: TracedStep, plan: Plan, forward: jex_core.ClosedJaxpr,
                     devices: Sequence[jax.Device], donated=frozenset(),
                     output_reductions: Sequence[str | None] = ()) -> Executable:
    """The executable that runs a complete ``plan`` for ``traced`` on ``devices`` (which hold every device the plan
    names); ``forward`` is the loss's forward at microbatch size, the program the plan's equations index. Nothing
    is chosen here: every stage's devices, mesh, equations, recomputation and parameter layouts, the schedule and
    the sequence-parallel boundaries are read from the plan, so a replayed plan builds the same programs.
    ``donated``: indices of the step's flat inputs whose buffers the step may reuse for its results (the leaves of
    ``parallelize``'s ``donate_argnums``)."""
    if any(st.equations is None for st in plan.stages):
        raise ValueError("the plan's stages name no forward equations (a plan made offline); replay it with "
                         "autopp.parallelize(step, plan=plan), which completes it for the traced step.")
    by_id = {d.id: d for d in devices}
    stage_devices = [[by_id[i] for i in st.devices] for st in plan.stages]
    split = split_at(forward, traced.microbatched_grad_inputs, [st.equations[0] for st in plan.stages])
    sched = Schedule.from_text(plan.schedule_text, num_stages=plan.num_stages, num_microbatches=plan.num_microbatches)
    layouts = [{"data": st.mesh_shape.get("data", 1), "fsdp": st.mesh_shape.get("fsdp", 1),
                "tensor": st.mesh_shape.get("tensor", 1)} for st in plan.stages]
    param_specs = None
    if any(st.param_specs is not None for st in plan.stages):
        param_specs = [None if st.param_specs is None else {int(k): v for k, v in st.param_specs.items()}
                       for st in plan.stages]
    sequence_vars = frozenset()
    if plan.sequence_parallel:
        sequence_vars = sequence_boundary_activations(forward, traced, plan.layer_equations)
    return build_split_executable(traced, forward, split, stage_devices, num_microbatches=plan.num_microbatches,
                                  loss_reduction=plan.loss_reduction, schedule=sched,
                                  recompute=tuple(st.recompute for st in plan.stages), layouts=layouts,
                                  param_specs=param_specs, zero1=plan.zero1, sequence_vars=sequence_vars,
                                  donated=donated, output_reductions=output_reductions)

"""The traced step laid out as a task list: what each stage holds and computes (:func:`analyse`), and the tasks
of the whole step (:class:`StepBuilder`): step inputs placed at home, pre-processing, the pipeline
(:mod:`autopp.runtime._pipeline`), the gradients published on their owners, post-processing (optimizer,
metrics) and the outputs."""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex_core
from jax.sharding import NamedSharding

from autopp.core import (RECOMPUTE_POLICIES, batch_dependent_vars, check_gradient_not_split, constant_outputs,
                         eval_closed, eval_jaxpr_with, layer_checkpointed, reroll_scans, slice_jaxpr, stage_graphs,
                         twin_program, warn_unrecomputable)

from autopp.runtime._meshes import StageMeshes
from autopp.runtime._pipeline_config import (EXTREMES, PipelineConfig, concatenate_microbatches, extreme_identity,
                                             loops_slowly)
from autopp.runtime._passes import zeros_program
from autopp.runtime._placement import label_outer, place_outer
from autopp.runtime._tasks import Program, TaskList, assemble, place, put, sds, view
from autopp.runtime._tensor import tensor_specs, whole_weights

Literal = jex_core.Literal


def _vars(atoms):
    return [a for a in atoms if not isinstance(a, Literal)]


@dataclasses.dataclass(frozen=True, eq=False)
class Step:
    """The traced step read once against its stage split: where each forward output is made, each stage's
    graph, which stages use (and which one owns) each forward input, the parameters' tensor layouts, and which
    outer variable serves which parameter."""

    traced: Any
    forward: Any
    split: Any
    meshes: StageMeshes
    config: PipelineConfig
    out_stage: tuple[int, ...]
    """Stage that produces each forward output (loss, aux)."""
    graphs: list
    invar_pos: dict
    """Forward input variable -> its index."""
    users: dict
    """Forward input index -> the stages that read it."""
    owner: dict
    """Forward input index -> the first stage that reads it."""
    tensor_spec: dict
    """(stage, forward input index) -> the parameter's split over the stage's tensor axis."""
    label: dict
    """Outer variable -> the forward input (parameter) it serves."""
    opt_state: frozenset
    """Outer variables that are optimizer state."""
    constants: tuple[dict, dict] = ({}, {})
    """Aux outputs computed from sizes and constants (:func:`autopp.core.constant_outputs`): per microbatch, whole."""

    @property
    def jaxpr(self):
        return self.traced.jaxpr.jaxpr

    @property
    def grad(self):
        return self.traced.grad_eqn

    @property
    def spec(self):
        return self.traced.spec

    @property
    def fwd(self):
        return self.forward.jaxpr

    @property
    def mb_invar(self):
        return self.traced.microbatched_grad_inputs

    @property
    def diff_mask(self):
        return self.traced.spec.diff_mask

    @property
    def tensor_weights(self) -> frozenset:
        """Forward inputs a tensor axis splits: trained and frozen weights (:attr:`TracedStep.frozen_grad_inputs`)."""
        frozen = self.traced.frozen_grad_inputs
        return frozenset(v for v, k in self.invar_pos.items() if self.diff_mask[k] or frozen[k])

    def layout_of(self, loc: int, k: int | None, shape, var=None) -> NamedSharding:
        """Where a value of ``shape`` serving forward input ``k`` (a parameter: itself, its gradient, its optimizer
        state; None for anything else) lives on stage ``loc``; ``var`` (an outer variable) is sharded over the data
        axis too when it is optimizer state under ZeRO-1."""
        spec, same = None, k is not None and tuple(self.fwd.invars[k].aval.shape) == tuple(shape)
        if same:
            spec = self.tensor_spec.get((loc, k))
        zero = self.config.zero1 and var is not None and var in self.opt_state
        name = self.invar_name(k) if same and spec is None else None  # (FSDP may leave it whole: said by name)
        return self.meshes.state_sharding(loc, shape, spec, zero=zero, name=name)

    def aux_name(self, k) -> str:
        """Forward output ``k`` (1 + aux leaf index) as the user wrote it, e.g. ``aux['pred']``."""
        return self.spec.aux_names[k - 1]

    def concatenated_outputs(self) -> frozenset[int]:
        """Forward outputs (aux leaves) whose whole-batch value has the microbatches' values stacked along its
        leading dimension (per-example values: the whole batch's leading dimension is ``num_microbatches`` times
        the microbatch's, the rest equal), as the step traced at the whole batch shows; they are concatenated, the
        others averaged or summed."""
        return frozenset(k for k in range(1, len(self.fwd.outvars))
                         if _per_example(self.fwd.outvars[k].aval.shape, self.spec.forward.out_avals[k].shape,
                                         self.config.num_microbatches))

    def is_constant_output(self, k: int) -> bool:
        """Whether aux output ``k`` reads no input of the loss (a literal, ``jnp.float32(x.shape[0]) * 2``): the step
        returns the whole batch's value (:meth:`constant_output`), as ``jax.jit`` does."""
        return k > 0 and (isinstance(self.fwd.outvars[k], Literal) or k in self.constants[0])

    def constant_output(self, k):
        """The whole batch's value of forward output ``k``, which reads no input of the loss (a size read off the
        batch, ``x.shape[0]``, and what is computed from it, is the whole batch's, as under ``jax.jit``)."""
        whole, small = self.spec.forward.jaxpr.outvars[k], self.fwd.outvars[k]
        if isinstance(whole, Literal) or k in self.constants[1]:
            return whole.val if isinstance(whole, Literal) else self.constants[1][k]
        return (small.val if isinstance(small, Literal) else self.constants[0][k]) * (
            1 if self.config.reduction(k) == "mean" else self.config.num_microbatches)

    def invar_name(self, k) -> str:
        a = self.grad.invars[k]
        if not isinstance(a, Literal) and a in self.jaxpr.invars:
            return self.traced.leaf_paths[self.jaxpr.invars.index(a)]
        return f"loss argument #{k - self.spec.num_lifted}"


def _per_example(small, whole, num_microbatches: int) -> bool:
    """Whether a value of shape ``small`` per microbatch and ``whole`` for the whole batch is per example: the
    whole batch's leading dimension is ``num_microbatches`` times the microbatch's, the rest equal."""
    small, whole = tuple(small), tuple(whole)
    return small != whole and len(small) > 0 and whole[1:] == small[1:] and whole[0] == num_microbatches * small[0]


def analyse(traced, forward, split, meshes: StageMeshes, config: PipelineConfig) -> Step:
    spec, S, fwd = traced.spec, split.num_stages, forward.jaxpr
    diff_mask = list(spec.diff_mask)
    check_gradient_not_split(traced, config.num_microbatches)
    defined_at = {}
    for s, ids in enumerate(split.stage_eqns):
        for i in ids:
            for v in fwd.eqns[i].outvars:
                defined_at[v] = s  # later stages overwrite: the last definer emits it
    out_stage = []
    for k, a in enumerate(fwd.outvars):
        if isinstance(a, Literal):
            out_stage.append(S - 1)
        elif a in defined_at:
            out_stage.append(defined_at[a])
        else:
            raise ValueError(
                "autopp.parallelize: the loss function returns one of its inputs unchanged as "
                f"{'the loss' if k == 0 else spec.aux_names[k - 1]}; compute it inside the loss function "
                "(e.g. `x + 0`) or return it from the step directly (a PRNG key, e.g. Flax NNX's Rngs state: "
                "split it in the step, or pass the rngs to the model at call time and return only the rest).")
    names, constants = spec.aux_names, (constant_outputs(forward), constant_outputs(spec.forward))
    batch_dependent = batch_dependent_vars(fwd, traced.microbatched_grad_inputs)
    for k in range(1, len(fwd.outvars)):
        dt, small, whole = fwd.outvars[k].aval.dtype, fwd.outvars[k].aval.shape, spec.forward.out_avals[k].shape
        per_example = _per_example(small, whole, config.num_microbatches)
        if small != whole and not per_example:
            raise ValueError(
                f"autopp.parallelize: {names[k - 1]} has shape {whole} for the whole batch but {small} for a "
                f"microbatch; aux values are either the same shape for any batch (averaged or summed over the "
                "microbatches) or per example (leading dimension the batch's, concatenated). Put its batch axis "
                "first inside the loss (a value stacked per layer by a scan: jnp.moveaxis(v, 1, 0)), or compute it in "
                "the step outside the gradient.")
        key, a = jax.dtypes.issubdtype(dt, jax.dtypes.extended), fwd.outvars[k]  # (a key cannot be summed either)
        if ((config.reduction(k) == "mean" or key) and not per_example and config.num_microbatches > 1 and not jnp.issubdtype(dt, jnp.inexact)
                and not isinstance(a, Literal) and a in batch_dependent and k not in constants[0]):
            raise TypeError(
                f"autopp.parallelize: {names[k - 1]} has dtype {dt} and depends on the batch; aux values are "
                f"{'averaged' if config.reduction(k) == 'mean' else 'summed'} over microbatches, which needs a "
                + ("number. Return the key from the step outside the gradient." if key else "floating dtype. "
                   "A count over the examples (a sum, a bincount) is added up and a flag over them (jnp.any, "
                   "jnp.all) combined as jit does, but this value is neither. Return it per example (leading "
                   "dimension the batch's: the microbatches' values are concatenated) and reduce it in the step after "
                   "the gradient; or, for the average of the microbatches' values, as a float (.astype(jnp.float32))."))
    graphs = stage_graphs(forward, split.stage_eqns, diff_mask, out_stage)
    invar_pos = {v: k for k, v in enumerate(fwd.invars)}
    users: dict[int, list[int]] = collections.defaultdict(list)
    for g in graphs:
        for v in g.inputs:
            if v in invar_pos:
                users[invar_pos[v]].append(g.index)
    owner = {k: (users[k][0] if users[k] else 0) for k in range(len(fwd.invars))}
    tensor_spec: dict[tuple[int, int], tuple] = {}
    planned = config.param_specs
    for g in graphs:
        tp = meshes.layouts[g.index]["tensor"]
        if tp == 1:
            continue
        if planned is not None and planned[g.index] is not None:  # the plan's sharding solution
            for k, spec_ in planned[g.index].items():
                k = int(k)
                shape = fwd.invars[k].aval.shape
                spec_ = tuple(spec_)
                if len(spec_) != len(shape) or any(a == "tensor" and shape[d] % tp for d, a in enumerate(spec_)):
                    raise ValueError(
                        f"autopp.parallelize: the plan splits parameter #{k} {shape} as {spec_} over "
                        f"tensor={tp}, which does not divide it; the plan was made for another model.")
                if "tensor" in spec_:
                    tensor_spec[(g.index, k)] = spec_
            continue
        # trained and frozen weights (neither differentiated nor split with the batch: a LoRA base) split alike
        params = [v for v in g.inputs if v in invar_pos and (diff_mask[invar_pos[v]]
                                                             or traced.frozen_grad_inputs[invar_pos[v]])]
        specs = tensor_specs(g.jaxpr, params, tp)
        for v, spec_ in specs.items():
            tensor_spec[(g.index, invar_pos[v])] = spec_
        whole_weights(g.index, tp, [(traced.spec.input_name(invar_pos[v]), v.aval) for v in params if v not in specs],
                      [v.aval for v in params])
    label, opt_state = label_outer(traced)
    return Step(traced=traced, forward=forward, split=split, meshes=meshes, config=config,
                out_stage=tuple(out_stage), graphs=graphs, invar_pos=invar_pos, users=users, owner=owner,
                tensor_spec=tensor_spec, label=label, opt_state=frozenset(opt_state), constants=constants)


@dataclasses.dataclass(frozen=True, eq=False)
class _Unpack:
    """Gradients held in accumulator buffers ``slots``: ``packing`` (a :class:`autopp.core.Packing`) unpacks them
    into one gradient per parameter; None: one buffer, the gradient itself."""

    slots: tuple[int, ...]
    packing: Any

    def unpack(self, *buffers) -> tuple:
        return tuple(self.packing.unpack(buffers)) if self.packing is not None else buffers


def _evaluate(values, xs) -> list:
    """The values a program computes from its arguments ``xs`` (see :meth:`StepBuilder._arguments`): each
    accumulator group unpacked once, parts summed."""
    unpacked, out = {}, []
    for kind, spec in values:
        if kind == "slot":
            out.append(xs[spec])
            continue
        total = None
        for u, positions, i in spec:
            if u not in unpacked:
                unpacked[u] = u.unpack(*[xs[p] for p in positions])
            total = unpacked[u][i] if total is None else total + unpacked[u][i]
        out.append(total)
    return out


class StepBuilder:
    """Lays out the step's tasks (one :class:`TaskList`) as a :class:`Program` for the passes; ``avail``: (outer
    variable, stage) -> the slot holding it there."""

    def __init__(self, step: Step, tasks: TaskList):
        self.step = step
        self.tl = tasks
        self.jaxpr = step.jaxpr
        self.outer_consts = dict(zip(self.jaxpr.constvars, step.traced.jaxpr.consts))
        self.invar_index = {v: k for k, v in enumerate(self.jaxpr.invars)}
        self.avail: dict[tuple, int] = {}
        self.input_slots = [tasks.new_slot(sds(v.aval, None)) for v in self.jaxpr.invars]
        self.placed_input: dict[int, int] = {}
        self.placement = None
        self._seeds: dict[tuple, int] = {}
        self._twins: dict = {}
        self.derived: dict[tuple, tuple] = {}
        """(outer variable, stage) -> its value as parts computed inside the program that reads it: a tuple of
        (:class:`_Unpack`, index), summed (a gradient out of its stages' packed accumulators, see :meth:`publish`)."""

    def emit(self, fn, ins, n_out, label) -> list[int]:
        return self.tl.emit(fn, ins, n_out, label)

    def put(self, shardings, ins, label) -> list[int]:
        """Slots holding ``ins`` at ``shardings``: a value already laid out so (handed between segments of one
        stage, :mod:`autopp.runtime._segments`) is its own slot; the others move in one transfer task."""
        outs = list(ins)
        move = [j for j, (i, sh) in enumerate(zip(ins, shardings)) if self.tl.slot_avals[i].sharding != sh]
        if move:
            moved = self.tl.emit(put(self.tl.avals([ins[j] for j in move]), [shardings[j] for j in move]),
                                 [ins[j] for j in move], len(move), label)
            for j, slot in zip(move, moved):
                outs[j] = slot
        return outs

    def seed_slot(self, s, aval, value) -> int:
        """A constant on stage ``s`` made once at build time (a cotangent: the loss seed or zeros; the ``first``
        flag of the accumulating programs), shared by all microbatches."""
        key = (s, aval.shape, str(aval.dtype), value)
        if key not in self._seeds:
            self._seeds[key] = self.tl.const(jax.device_put(np.full(aval.shape, value, aval.dtype),
                                                            self.step.meshes.replicated[s]))
        return self._seeds[key]

    # -- values at locations ---------------------------------------------------------------------
    def need(self, v, loc: int) -> int:
        """Slot holding outer variable ``v`` on stage ``loc``, emitting the transfer if needed."""
        key = (v, loc)
        if key in self.avail:
            return self.avail[key]
        if isinstance(v, Literal):
            raise AssertionError("literals are inlined")
        pending = [l for (u, l) in self.derived if u is v and (u, l) not in self.avail]
        if pending:  # a gradient read as an array of its own: every pending one of its stage made by one program
            self._materialize(pending[0])
            if key in self.avail:
                return self.avail[key]
        st, meshes = self.step, self.step.meshes
        if v in self.outer_consts:
            s = self.tl.const(jax.device_put(self.outer_consts[v], meshes.replicated[loc]))
        elif v in self.invar_index:
            k = self.invar_index[v]
            if st.traced.batch_mask[k]:
                (s,) = self.put([meshes.batch_sharding(loc, v.aval.shape)], [self.input_slots[k]],
                                f"put batch {st.traced.leaf_paths[k]} -> stage {loc}")
            else:
                homes = self.placement.input_homes.get(k, frozenset())
                assert loc in homes, (v, loc, homes)
                src = self.placed_input[k]
                (s,) = self.emit(view(self.tl.slot_avals[src], meshes.replicated[loc], meshes.devices[loc]),
                                 [src], 1, f"view {st.traced.leaf_paths[k]} on stage {loc}")
        else:
            srcs = [l for (u, l) in self.avail if u is v]
            assert srcs, f"no location holds {v} (needed on stage {loc})"
            (s,) = self.put([meshes.replicated[loc]], [self.avail[(v, srcs[0])]], f"put {v} stage {srcs[0]} -> {loc}")
        self.avail[key] = s
        return s

    # -- outer programs -------------------------------------------------------------------------
    def outer_program(self, eqn_ids: list[int], loc: int, label: str, consumers_outside,
                      last_reader=lambda v, ids: False, dies_here=lambda v, ids, loc: False) -> None:
        outside = consumers_outside(set(eqn_ids))
        closed, ins, outs = slice_jaxpr(self.step.traced.jaxpr, eqn_ids, lambda v: v in outside, label)
        if not outs and not any(e.effects for e in closed.jaxpr.eqns):  # (a jax.debug.print runs for its effect)
            return
        sub, consts = closed.jaxpr, closed.consts
        # Gradients still in their packed accumulators are unpacked (and shared ones summed) inside this program.
        in_slots, values = self._arguments([self.derived[(v, loc)] if (v, loc) in self.derived
                                            and (v, loc) not in self.avail else v for v in ins], loc)
        # Donated step inputs (their placed slot, read by nothing after this program) are donated here: the update
        # writes the new parameters and optimizer state into the old ones' buffers.
        ids = set(eqn_ids)
        donate = {j for v, (kind, j) in zip(ins, values) if kind == "slot"
                  and self.placed_input.get(self.invar_index.get(v)) == in_slots[j] and last_reader(v, ids)}
        # So are values an earlier phase made that only this program reads (Adam's b1 * mu before a global norm is
        # known), where a result of their type is left to write into them.
        slot_var = {j: v for v, (kind, j) in zip(ins, values) if kind == "slot"}
        free = collections.Counter((o.aval.shape, o.aval.dtype) for o in outs)
        free.subtract((slot_var[j].aval.shape, slot_var[j].aval.dtype) for j in donate)
        for j, v in slot_var.items():
            key = (v.aval.shape, v.aval.dtype)
            if j not in donate and free[key] > 0 and self.avail.get((v, loc)) == in_slots[j] and dies_here(v, ids, loc):
                donate.add(j)
                free[key] -= 1
        donate = tuple(sorted(donate))
        # Results (new parameters, optimizer state) take the state layout of their stage, as the step's inputs do,
        # so that the next step finds them at home.
        st = self.step
        in_sh = tuple(self.tl.slot_avals[s].sharding for s in in_slots)
        out_sh = tuple(st.layout_of(loc, st.label.get(v), v.aval.shape, v) for v in outs)
        def outer(*xs):
            return tuple(jax.core.eval_jaxpr(sub, consts, *_evaluate(values, xs)))

        fn = jax.jit(outer, in_shardings=in_sh, out_shardings=out_sh, donate_argnums=donate)
        how = tuple(v if v[0] == "slot" else ("parts", tuple((None if u.packing is None else u.packing.structure(),
                                                              p, i) for u, p, i in v[1])) for v in values)
        fn = twin_program(self._twins, fn, closed, (how, donate), in_sh + out_sh)  # equal stages' updates: lowered once
        out_slots = self.tl.emit(fn, in_slots, len(outs), label, donated=[in_slots[j] for j in donate])
        for v, s in zip(outs, out_slots):
            self.avail[(v, loc)] = s

    def _arguments(self, items, loc) -> tuple[list[int], list]:
        """A program's argument slots (each once) and how it computes each of ``items`` from them: an outer
        variable (its slot on ``loc``) as ``("slot", position)``, derived parts (see :attr:`derived`) as
        ``("parts", ((unpack, argument positions, index), ...))``."""
        slots, position, values = [], {}, []

        def arg(slot):
            if slot not in position:
                position[slot] = len(slots)
                slots.append(slot)
            return position[slot]

        for item in items:
            if isinstance(item, tuple):
                values.append(("parts", tuple((u, tuple(arg(x) for x in u.slots), i) for u, i in item)))
            else:
                values.append(("slot", arg(self.need(item, loc))))
        return slots, values

    def _materialize(self, loc) -> None:
        """Every derived value on ``loc`` not yet held as an array, made by one program (laid out as the
        parameters they serve)."""
        st = self.step
        pending = [(v, parts) for (v, l), parts in self.derived.items() if l == loc and (v, l) not in self.avail]
        in_slots, values = self._arguments([parts for _, parts in pending], loc)
        fn = jax.jit(lambda *xs: tuple(_evaluate(values, xs)),
                     in_shardings=tuple(self.tl.slot_avals[s].sharding for s in in_slots),
                     out_shardings=tuple(st.layout_of(loc, st.label.get(v), v.aval.shape, v) for v, _ in pending))
        out_slots = self.emit(fn, in_slots, len(pending), f"gradients stage {loc}")
        for (v, _), s in zip(pending, out_slots):
            self.avail[(v, loc)] = s

    # -- the whole step -------------------------------------------------------------------------
    def build(self) -> Program:
        from autopp.runtime._pipeline import lay_out_pipeline

        st, jaxpr = self.step, self.jaxpr
        spec, grad = st.spec, st.grad
        if st.split.num_stages == 1:
            return self.build_single_program()
        # Requirements of the gradient equation's inputs.
        grad_in_required = [frozenset({st.owner[k]}) if st.diff_mask[k] else frozenset(st.users[k])
                            for k in range(len(grad.invars))]
        grad_out_loc = [st.out_stage[0]] + [st.out_stage[1 + j] for j in range(spec.num_aux)]
        grad_out_loc += [st.owner[k] for k in spec.diff_indices]
        anchors = {v: st.owner[k] for v, k in st.traced.zeroed_gradients}
        self.placement = pl = place_outer(jaxpr, st.traced.grad_index, grad_in_required, grad_out_loc,
                                          st.traced.batch_mask, anchors=anchors)
        # Step inputs: one slot per user leaf, placed at home at the start of every step.
        homed = [k for k in range(len(jaxpr.invars)) if not st.traced.batch_mask[k] and pl.input_homes.get(k)]
        shardings = [st.layout_of(next(iter(pl.input_homes[k])), st.label.get(jaxpr.invars[k]),
                                  jaxpr.invars[k].aval.shape, jaxpr.invars[k])
                     if len(pl.input_homes[k]) == 1 else st.meshes.multi(pl.input_homes[k]) for k in homed]
        if homed:
            ins = [self.input_slots[k] for k in homed]
            placed = self.emit(place(self.tl.avals(ins), shardings, [j for j, k in enumerate(homed)
                                                                     if k in st.config.donated]),
                               ins, len(homed), f"place {len(homed)} inputs at home")
            for k, s in zip(homed, placed):
                if len(pl.input_homes[k]) == 1:
                    self.avail[(jaxpr.invars[k], next(iter(pl.input_homes[k])))] = s
                self.placed_input[k] = s

        # Which outer variables are used where: consumers outside a program need its outputs.
        users_of = collections.defaultdict(set)
        for i, e in enumerate(jaxpr.eqns):
            for a in _vars(e.invars):
                users_of[a].add(i)
        step_outs = set(_vars(jaxpr.outvars))

        def consumers_outside(ids):
            def needed(v):  # a reader elsewhere, or one that also runs at another location (another program)
                return v in step_outs or any(i not in ids or len(pl.eqn_locs.get(i, ())) > 1 for i in users_of[v])
            return {v for i in ids for v in jaxpr.eqns[i].outvars if needed(v)}

        # Pre-processing (ancestors of the gradient), one program per location.
        pre_by_loc = collections.defaultdict(list)  # (by phase: a penalty's terms summed where their weights live)
        for (i, loc), ph in sorted(pl.phase.items()):
            if pl.region[i] == "pre":
                pre_by_loc[(ph, loc)].append(i)
        for ph, loc in sorted(pre_by_loc):
            label = f"pre stage {loc}" + (f" phase {ph}" if ph else "")
            self.outer_program(pre_by_loc[(ph, loc)], loc, label, consumers_outside)

        pipe = lay_out_pipeline(self)
        self.publish(pipe.reduced, pipe.acc, pipe.programs)

        # Post-processing (optimizer, metrics), by phase then location.
        post = collections.defaultdict(list)
        for (i, loc), ph in pl.phase.items():
            if pl.region[i] == "post":
                post[(ph, loc)].append(i)

        phases = collections.defaultdict(set)
        for (i, _), ph in pl.phase.items():
            phases[i].add(ph)

        def last_reader(v, ids):
            """Whether post-processing equations ``ids`` read step input ``v`` last (then they may donate it): ``v``
            is donated, on one stage, no step output, and its other readers ran before (preprocessing, the gradient,
            an earlier post phase: AdamW's decay reads the parameters before a global norm is known)."""
            k = self.invar_index.get(v)
            if k is None or k not in st.config.donated or v in step_outs or len(pl.input_homes.get(k, ())) != 1:
                return False
            now = min(ph for i in ids for ph in phases[i])
            return all(i in ids or i == st.traced.grad_index or pl.region.get(i) == "pre"
                       or (pl.region.get(i) == "post" and phases[i] and max(phases[i]) < now) for i in users_of[v])

        made_by = {v: i for i, e in enumerate(jaxpr.eqns) for v in e.outvars}

        def dies_here(v, ids, loc):
            """Whether a value an earlier post phase made at ``loc`` is read by post-processing equations ``ids``
            alone, each run at ``loc`` only (no other program or transfer reads it after them)."""
            return (v not in self.invar_index and v not in step_outs and pl.region.get(made_by.get(v)) == "post"
                    and all(i in ids and pl.eqn_locs.get(i) == frozenset({loc}) for i in users_of[v]))

        for key in sorted(post):
            ph, loc = key
            self.outer_program(sorted(post[key]), loc, f"post phase {ph} stage {loc}", consumers_outside,
                               last_reader, dies_here)

        # Outputs.
        outputs, output_slots = [], set()
        for j, (a, locs) in enumerate(zip(jaxpr.outvars, pl.out_locs)):
            if isinstance(a, Literal):
                val = jnp.asarray(a.val, dtype=a.aval.dtype)
                outputs.append(lambda env, val=val: val)
                continue
            if a in self.invar_index and (st.traced.batch_mask[self.invar_index[a]] or not locs):
                slot = self.input_slots[self.invar_index[a]]
            elif len(locs) == 1:
                (loc,) = locs
                slot = self.need(a, loc)
            else:
                parts = [self.need(a, loc) for loc in sorted(locs)]
                (slot,) = self.emit(assemble(self.tl.avals(parts), st.meshes.multi(frozenset(locs)), a.aval.shape),
                                    parts, 1, f"assemble step output {j}")
            outputs.append(lambda env, slot=slot: env[slot])
            output_slots.add(slot)
        return self.tl.program(self.input_slots, output_slots, outputs, pipe.accumulators)

    def publish(self, reduced: dict[int, int], acc: dict[int, list[int]], programs) -> None:
        """Publish the pipeline's loss, aux and gradients (shared parameters' contributions summed on the owner)."""
        st = self.step
        spec, grad, fwd = st.spec, st.grad, st.fwd
        for k, slot in reduced.items():
            self.avail[(grad.outvars[k], st.out_stage[k])] = slot
        # Each stage's gradients out of its accumulators (small ones are packed, see StagePrograms.acc_packing):
        # unpacked inside the program that reads them, on the same devices or after the packed buffer moved there.
        unpack = {s: _Unpack(tuple(acc[s]), pr.acc_packing) for s, pr in enumerate(programs) if pr.acc_packing.groups}
        unpacked: dict[int, list[int]] = {}
        sent: dict[tuple[int, int, int], _Unpack] = {}

        def part(s, idx, o, home):
            """Stage ``s``'s gradient of its ``idx``-th parameter as a part of a gradient on stage ``o`` (laid out
            there as ``home``): (unpack, index) where it is unpacked inside the program that reads it, else a slot."""
            if s not in unpack:  # nothing packed: the buffers are the gradients, in parameter order
                slot = acc[s][idx]
            elif st.meshes.devices[s] == st.meshes.devices[o]:
                return unpack[s], idx
            elif (packed := self._send_packed(s, idx, o, unpack[s], sent)) is not None:
                if not isinstance(packed, int):
                    return packed, idx
                slot = packed
            else:
                if s not in unpacked:
                    fn = jax.jit(unpack[s].unpack, out_shardings=tuple(unpack[s].packing.shardings))
                    unpacked[s] = self.emit(fn, acc[s], len(programs[s].param_idx), f"unpack gradients stage {s}")
                slot = unpacked[s][idx]
            if s != o:
                (slot,) = self.put([home], [slot], f"send shared grad {s}->{o}")
            return slot

        # Gradients: each on its owner, contributions of other stages (shared parameters) added.
        for j, k in enumerate(spec.diff_indices):
            outer = grad.outvars[1 + spec.num_aux + j]
            o = st.owner[k]
            home = st.layout_of(o, k, fwd.invars[k].aval.shape)
            parts = []
            for s in st.users[k]:
                pos = st.graphs[s].inputs.index(fwd.invars[k])
                if pos in programs[s].param_idx:
                    parts.append(part(s, programs[s].param_idx.index(pos), o, home))
            if not parts:
                aval = fwd.invars[k].aval
                parts = self.emit(zeros_program([aval], [home]), [], 1, f"zero grad {st.invar_name(k)}")
            if len(parts) == 1 and isinstance(parts[0], int):
                self.avail[(outer, o)] = parts[0]
            else:  # summed (and unpacked) inside the program that reads it
                self.derived[(outer, o)] = tuple(p if isinstance(p, tuple) else (_Unpack((p,), None), 0)
                                                 for p in parts)

    def _send_packed(self, s: int, idx: int, o: int, unpack: _Unpack, sent: dict):
        """Stage ``s``'s packed gradient of its ``idx``-th parameter for stage ``o``, with no program of its own: the
        packed buffer moves to ``o`` as it is (one transfer for all its gradients ``o`` reads) and is unpacked in the
        program there that reads it -> an :class:`_Unpack`; a gradient kept loose -> its accumulator slot (moved by
        the caller). None where the buffer cannot move as it is: ``o``'s mesh has another shape, or the stages span
        processes (a cross-process send may still read an accumulator the next backward writes)."""
        packing, meshes = unpack.packing, self.step.meshes
        group = next((g for g, members in enumerate(packing.groups) if idx in members), None)
        if group is None:
            return unpack.slots[len(packing.groups) + packing.loose.index(idx)]
        if (s, group, o) not in sent:
            src, dst = meshes.meshes[s], meshes.meshes[o]
            layout = packing.shardings[packing.groups[group][0]]
            processes = {d.process_index for d in meshes.devices[s] + meshes.devices[o]}
            if dst.shape != src.shape or getattr(layout, "mesh", None) != src or len(processes) > 1:
                return None
            (slot,) = self.put([NamedSharding(dst, layout.spec)], [unpack.slots[group]],
                               f"send packed grads {s}->{o}")
            sent[(s, group, o)] = _Unpack((slot,), dataclasses.replace(
                packing, groups=(packing.groups[group],), rows=(packing.rows[group],), loose=()))
        return sent[(s, group, o)]

    def build_single_program(self) -> Program:
        """One stage: the whole step is one program, the loss's microbatches a ``lax.scan`` inside it: gradient
        accumulation as one writes it by hand, so a one-stage plan costs what plain ``jax.jit`` with microbatching
        costs."""
        from autopp.runtime._pipeline import layer_starts_of
        st, jaxpr = self.step, self.jaxpr
        M, spec = st.config.num_microbatches, st.spec
        fwd, _, _ = reroll_scans(st.forward, name="forward")  # a scan over layers compiles as a scan, as under jit
        mean = st.config.loss_reduction == "mean"
        concatenated = st.concatenated_outputs()
        scale = (lambda o: o / M) if mean else (lambda o: o)  # noqa: E731
        mb_mask, diff_idx = list(st.mb_invar), spec.diff_indices
        batch_dependent = batch_dependent_vars(fwd.jaxpr, mb_mask)
        recompute = st.config.recompute[0]
        by_layer = layer_checkpointed(fwd, layer_starts_of(st)) if recompute == "full" else None
        unrecomputable = recompute == "selective" and warn_unrecomputable(fwd, recompute)
        unrolled = M > 1 and loops_slowly(fwd.jaxpr, st.meshes.replicated[0].mesh.devices.flat[0].platform)

        def accumulate(*invals):
            stacked = [x.reshape((M, x.shape[0] // M) + x.shape[1:]) for x, mb in zip(invals, mb_mask) if mb]

            def body(carry, mbs):
                it = iter(mbs)
                vals = [next(it) if mb else x for x, mb in zip(invals, mb_mask)]

                def loss_of(diff_vals):
                    v = list(vals)
                    for i, d in zip(diff_idx, diff_vals):
                        v[i] = d
                    outs = by_layer(v) if by_layer else eval_closed(fwd, *v)
                    return outs[0], outs[1:]

                if recompute == "selective" and not unrecomputable:
                    loss_of = jax.checkpoint(loss_of, policy=RECOMPUTE_POLICIES[recompute])
                (loss, aux), grads = jax.value_and_grad(loss_of, has_aux=True)([vals[i] for i in diff_idx])
                combined = [combine[k](c, a) for k, c, a in zip(kept, carry[1], [aux[k - 1] for k in kept])]
                loss, grads = jax.tree.map(jnp.add, (carry[0], carry[2]), (loss, grads))
                return (loss, combined, grads), [a for k, a in enumerate(aux, 1) if k in concatenated]

            # aux values kept whole: added up, or their maximum (minimum) taken, starting from its identity
            kept = [k for k in range(1, len(fwd.out_avals)) if k not in concatenated]
            combine = {k: EXTREMES.get(st.config.reduction(k), jnp.add) for k in kept}
            kept_init = [jnp.full(a.shape, extreme_identity(st.config.reduction(k), a.dtype), a.dtype)
                         if st.config.reduction(k) in EXTREMES else jnp.zeros(a.shape, a.dtype)
                         for k in kept for a in [fwd.out_avals[k]]]
            zeros = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype),
                                 ([fwd.out_avals[0]], [invals[i].aval for i in diff_idx]))
            carry, outs = (zeros[0][0], kept_init, zeros[1]), [None] * M
            for k in range(M if M == 1 or unrolled else 0):  # one microbatch after another in the program, no loop
                carry, outs[k] = body(carry, [x[k] for x in stacked])
            (loss, summed, grads), stacked_aux = ((carry, [jnp.stack(col) for col in zip(*outs)]) if M == 1 or unrolled
                                                  else jax.lax.scan(body, carry, stacked))
            summed, stacked_aux, aux = iter(summed), iter(stacked_aux), []
            for k in range(1, len(fwd.out_avals)):
                if k in concatenated:  # per-example values, the microbatches' in order
                    aux.append(concatenate_microbatches(next(stacked_aux), st.config.reduction(k)))
                elif st.is_constant_output(k):
                    next(summed)
                    aux.append(jnp.asarray(st.constant_output(k), fwd.out_avals[k].dtype))
                elif st.config.read_once(k, fwd.jaxpr.outvars[k] in batch_dependent):  # M equal values
                    total = next(summed)
                    aux.append(total / M if jnp.issubdtype(total.dtype, jnp.inexact) else total // M)
                else:
                    total = next(summed)
                    aux.append(total / M if st.config.reduction(k) == "mean" and M > 1 else total)
            return [scale(loss), *aux, *map(scale, grads)]

        traced = st.traced

        def whole(*flat):
            return tuple(eval_jaxpr_with(jaxpr, traced.jaxpr.consts, flat,
                                         lambda i, _, invals: accumulate(*invals) if i == traced.grad_index else None))

        in_sh = [st.meshes.batch_sharding(0, v.aval.shape) if b
                 else st.layout_of(0, st.label.get(v), v.aval.shape, v)
                 for v, b in zip(jaxpr.invars, traced.batch_mask)]
        # donated inputs (not the batch, nor an input the step returns as it is) give their buffers to the results
        returned = {v for v in jaxpr.outvars if not isinstance(v, Literal)}
        donate = tuple(k for k, v in enumerate(jaxpr.invars)
                       if k in st.config.donated and not traced.batch_mask[k] and v not in returned)
        fn = jax.jit(whole, in_shardings=tuple(in_sh),
                     out_shardings=tuple(st.layout_of(0, st.label.get(v), v.aval.shape, v)
                                         if not isinstance(v, Literal) else st.meshes.replicated[0]
                                         for v in jaxpr.outvars), donate_argnums=donate)
        placed = self.emit(place(self.tl.avals(self.input_slots), in_sh, donate), self.input_slots, len(in_sh),
                           f"place {len(in_sh)} inputs on stage 0")
        outs = self.tl.emit(fn, placed, len(jaxpr.outvars), f"0F+0B all {M} microbatches (scan) and update",
                            donated=[placed[k] for k in donate])
        return self.tl.program(self.input_slots, outs, [lambda env, slot=slot: env[slot] for slot in outs])

"""The schedule as tasks: each stage's programs, its per-step inputs split into microbatches, its gradient
accumulators, then every action of the schedule in dispatch order (forward, backward, fused forward+backward,
input and weight gradients) with the sends between stages, and the loss and aux reduced over microbatches."""

from __future__ import annotations

import collections
import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend import core as jex_core

from autopp.core import StagePrograms, batch_dependent_vars, dispatch_order
from autopp.profiler import group_layers

from autopp.runtime._passes import sum_program
from autopp.runtime._pipeline_config import EXTREMES, concatenate_microbatches
from autopp.runtime._tasks import Accumulators, reused_buffers
from autopp.runtime._tensor import activation_splits

Literal = jex_core.Literal


def stage_programs(step) -> list[StagePrograms]:
    """Each stage's forward, backward (and split backward) programs with the shardings of their values; a stage that
    runs an earlier stage's programs on other devices takes them mapped (its batch and residual layouts follow from
    its mesh's shape alone, as :class:`~autopp.core.StagePrograms` asks of twins)."""
    meshes, fwd, config = step.meshes, step.fwd, step.config
    seed = 1.0 / config.num_microbatches if config.loss_reduction == "mean" else 1.0
    loss_var = fwd.outvars[0]
    progs, twins = [], {}
    layer_starts = layer_starts_of(step) if "full" in config.recompute else frozenset()
    weights = step.tensor_weights
    for g in step.graphs:
        s = g.index
        rep = meshes.replicated[s]
        is_param = [v in step.invar_pos and step.diff_mask[step.invar_pos[v]] for v in g.inputs]
        in_sh, steady = [], []
        for v in g.inputs:
            mb = v not in step.invar_pos or step.mb_invar[step.invar_pos[v]]
            steady.append(not mb)  # the same for every microbatch: parameters, frozen weights, constants
            in_sh.append(meshes.batch_sharding(s, v.aval.shape) if mb
                         else step.layout_of(s, step.invar_pos.get(v), v.aval.shape))
        out_sh = [meshes.batch_sharding(s, v.aval.shape) if v not in fwd.outvars else rep for v in g.outputs]
        seeds = {i: seed for i, v in enumerate(g.outputs) if v is loss_var}
        grad_sh = [step.layout_of(s, step.invar_pos[v], v.aval.shape) for v, p in zip(g.inputs, is_param)
                   if p and g.diff_inputs[g.inputs.index(v)]]
        act_ct_sh = [meshes.batch_sharding(s, v.aval.shape)
                     for v, p, d in zip(g.inputs, is_param, g.diff_inputs) if d and not p]
        constraints = {}
        for e in g.jaxpr.eqns:
            for v in e.outvars:
                if v in config.sequence_vars:
                    sh = meshes.sequence_sharding(s, v.aval.shape)
                    if sh is not None:
                        constraints[v] = sh
        progs.append(StagePrograms(g, is_param=is_param, seed_of_output=seeds, in_shardings=in_sh,
                                   out_shardings_fwd=out_sh, grad_shardings=grad_sh, act_ct_shardings=act_ct_sh,
                                   residual_sharding=functools.partial(meshes.residual_sharding, s),
                                   flag_sharding=rep, recompute=config.recompute[s], constraints=constraints,
                                   twins=twins, layer_starts=layer_starts,
                                   split_dims=_split_dims(meshes, s, [v in weights for v in g.inputs]),
                                   steady_inputs=steady))
    return progs


def _split_dims(meshes, s, weights):
    """What a stage of a tensor axis computes split over it (:func:`autopp.runtime._tensor.activation_splits`), with
    its weights (``weights``: per stage input, trained or frozen) laid out as the rule lays them out."""
    t = meshes.layouts[s]["tensor"]
    return None if t == 1 else (lambda jaxpr, _: activation_splits(
        jaxpr, [v for v, w in zip(jaxpr.invars, weights) if w], t))


def layer_starts_of(step) -> frozenset[int]:
    """``id`` of each forward equation that begins a layer (:func:`autopp.profiler.group_layers`, as the planner
    sees them): where full recomputation checkpoints."""
    try:
        layers = group_layers(step.forward, step.mb_invar, step.diff_mask)
    except ValueError:  # nothing depends on the batch: one layer
        return frozenset()
    return frozenset(id(step.fwd.eqns[lay.eqn_range[0]]) for lay in layers)


@dataclasses.dataclass(eq=False)
class Pipeline:
    """The pipeline's slots while its tasks are laid out, and what it leaves: ``reduced`` (forward output index
    -> slot of its reduction over microbatches), ``acc`` (stage -> its final gradient accumulators) and
    ``accumulators`` (where each stage's accumulators start and end, for ``reuse_accumulators``)."""

    b: Any
    """The :class:`~autopp.runtime._step.StepBuilder` whose task list this appends to."""
    programs: list[StagePrograms]
    static_in: dict = dataclasses.field(default_factory=dict)
    """(stage, input position) -> slot of a per-step input that does not change across microbatches."""
    mb_slots: dict = dataclasses.field(default_factory=dict)
    """(stage, input position, microbatch) -> slot."""
    acc: dict = dataclasses.field(default_factory=dict)
    """Stage -> slots of its current gradient accumulators."""
    accumulators: list = dataclasses.field(default_factory=list)
    started: set = dataclasses.field(default_factory=set)
    """Stages whose first accumulating action is laid out."""
    act_at: dict = dataclasses.field(default_factory=dict)
    """(forward var, microbatch, stage) -> slot of an activation received there."""
    ct_parts: dict = dataclasses.field(default_factory=lambda: collections.defaultdict(list))
    """(forward var, microbatch) -> slots of its cotangent's parts received by its producer."""
    fwd_state: dict = dataclasses.field(default_factory=dict)
    """(stage, microbatch) -> (input slots, kept residuals) of a forward awaiting its backward."""
    w_state: dict = dataclasses.field(default_factory=dict)
    """(stage, microbatch) -> (W's backward arguments, stash) of an input gradient awaiting its weight gradient."""
    out_parts: dict = dataclasses.field(default_factory=lambda: collections.defaultdict(list))
    """Forward output index -> per-microbatch slots."""
    reduced: dict = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        st = self.b.step
        self.st, self.meshes, self.S, self.M = st, st.meshes, st.split.num_stages, st.config.num_microbatches
        self.loss_var = st.fwd.outvars[0]
        self.seed = 1.0 / self.M if st.config.loss_reduction == "mean" else 1.0
        self.producer_stage = {}
        for g in st.graphs:
            for v in g.outputs:
                self.producer_stage.setdefault(v, g.index)
        self.outvar_idx = {}
        for k, a in enumerate(st.fwd.outvars):
            if not isinstance(a, Literal):
                self.outvar_idx.setdefault(a, k)

    # -- before the schedule ----------------------------------------------------------------------
    def lay_out_inputs(self) -> None:
        """Each stage's per-step inputs: parameters and constants once, microbatched inputs split."""
        b, st, meshes, M = self.b, self.st, self.meshes, self.M
        grad = st.grad
        mb_inputs: dict[int, tuple[list[int], list[int]]] = {}  # stage -> (input positions, full-batch slots)
        for g in st.graphs:
            s = g.index
            mb_positions = []
            for pos, v in enumerate(g.inputs):
                if v not in st.invar_pos:
                    continue
                k = st.invar_pos[v]
                outer_v = grad.invars[k]
                if st.mb_invar[k]:
                    mb_positions.append(pos)
                elif isinstance(outer_v, Literal):
                    self.static_in[(s, pos)] = b.tl.const(jax.device_put(jnp.asarray(outer_v.val, outer_v.aval.dtype),
                                                                         st.layout_of(s, k, outer_v.aval.shape)))
                elif st.diff_mask[k] and st.owner[k] != s:
                    o = st.owner[k]
                    (slot,) = b.put([st.layout_of(s, k, outer_v.aval.shape)], [b.need(outer_v, o)],
                                    f"put shared parameter {st.invar_name(k)} stage {o} -> {s}")
                    self.static_in[(s, pos)] = slot
                else:
                    slot = b.need(outer_v, s)
                    want = st.layout_of(s, k, outer_v.aval.shape)
                    if b.tl.slot_avals[slot].sharding != want:  # e.g. computed before the gradient, replicated
                        (slot,) = b.put([want], [slot], f"lay out {st.invar_name(k)} on stage {s}")
                    self.static_in[(s, pos)] = slot
            if mb_positions:
                full = [b.need(grad.invars[st.invar_pos[g.inputs[p]]], s) for p in mb_positions]
                mb_inputs[s] = (mb_positions, full)

        for s, (mb_positions, full) in mb_inputs.items():
            g = st.graphs[s]
            shapes = [g.inputs[p].aval.shape for p in mb_positions]
            out_sh = [meshes.microbatch_sharding(s, sh) for sh in shapes for _ in range(M)]

            def split(*xs, M=M):
                return tuple(x.reshape((M, x.shape[0] // M) + x.shape[1:])[m] for x in xs for m in range(M))

            fn = jax.jit(split, out_shardings=tuple(out_sh))
            outs = b.emit(fn, full, len(mb_positions) * M, f"split microbatches stage {s}")
            for j, p in enumerate(mb_positions):
                for m in range(M):
                    self.mb_slots[(s, p, m)] = outs[j * M + m]

    def lay_out_accumulators(self) -> None:
        """Gradient accumulators: the first accumulating action of a stage ignores their contents (``first``)."""
        b = self.b
        for s, pr in enumerate(self.programs):
            if pr.param_idx:
                avals, shardings = pr.acc_packing.buffer_avals(), list(pr.acc_packing.buffer_shardings())
                self.acc[s] = b.emit(reused_buffers(avals, shardings), [], len(avals), f"gradient buffers stage {s}")
                self.accumulators.append((s, len(b.tl.tasks) - 1, tuple(self.acc[s])))
            else:
                self.acc[s] = []

    # -- pieces of actions -----------------------------------------------------------------------
    def flag(self, s) -> list[int]:
        """The ``first`` argument of stage ``s``'s next accumulating action."""
        if not self.programs[s].has_flag:
            return []
        first = s not in self.started
        self.started.add(s)
        return [self.b.seed_slot(s, jax.ShapeDtypeStruct((), jnp.bool_), first)]

    def input_slots(self, s, m) -> list[int]:
        """Stage ``s``'s forward arguments for microbatch ``m``: its inputs, then its row bases (constants)."""
        slots = []
        for pos, v in enumerate(self.st.graphs[s].inputs):
            if (s, pos) in self.static_in:
                slots.append(self.static_in[(s, pos)])
            elif (s, pos, m) in self.mb_slots:
                slots.append(self.mb_slots[(s, pos, m)])
            else:
                slots.append(self.act_at[(v, m, s)])
        row = jax.ShapeDtypeStruct((), jnp.int32)
        return slots + [self.b.seed_slot(s, row, base) for base in self.programs[s].row_bases]

    def ship_outputs(self, s, m, out_slots) -> None:
        st = self.st
        by_dest = collections.defaultdict(list)
        for v, slot in zip(st.graphs[s].outputs, out_slots):
            if v in self.outvar_idx and st.out_stage[self.outvar_idx[v]] == s:
                self.out_parts[self.outvar_idx[v]].append(slot)
            for t in range(s + 1, self.S):
                if v in st.graphs[t].inputs and self.producer_stage.get(v) == s:
                    by_dest[t].append((v, slot))
        for t, items in by_dest.items():
            shs = [self.meshes.batch_sharding(t, v.aval.shape) for v, _ in items]
            outs = self.b.put(shs, [sl for _, sl in items], f"send {s}->{t} mb {m}")
            for (v, _), o in zip(items, outs):
                self.act_at[(v, m, t)] = o

    def ship_input_cts(self, s, m, ct_slots) -> None:
        g = self.st.graphs[s]
        by_dest = collections.defaultdict(list)
        for i, slot in zip(self.programs[s].act_idx, ct_slots):
            v = g.inputs[i]
            by_dest[self.producer_stage[v]].append((v, slot))
        for t, items in by_dest.items():
            shs = [self.meshes.batch_sharding(t, v.aval.shape) for v, _ in items]
            outs = self.b.put(shs, [sl for _, sl in items], f"send grad {s}->{t} mb {m}")
            for (v, _), o in zip(items, outs):
                self.ct_parts[(v, m)].append(o)

    def output_cts(self, s, m) -> list[int]:
        g, b = self.st.graphs[s], self.b
        slots = []
        for i in self.programs[s].diff_out_idx:
            v = g.outputs[i]
            parts = list(self.ct_parts.pop((v, m), []))
            if v is self.loss_var:
                parts.append(b.seed_slot(s, v.aval, self.seed))
            if not parts:
                parts.append(b.seed_slot(s, v.aval, 0.0))
            if len(parts) == 1:
                slots.append(parts[0])
            else:
                (sl,) = b.emit(sum_program(len(parts), self.meshes.replicated[s]), parts, 1, f"sum grads {v}")
                slots.append(sl)
        return slots

    # -- the schedule -----------------------------------------------------------------------------
    def lay_out_actions(self) -> None:
        b, progs, acc = self.b, self.programs, self.acc
        schedule = self.st.config.schedule
        next_in_row = {}
        for row in schedule.rows:
            acts = [a for a in row if a is not None]
            for x, y in zip(acts, acts[1:]):
                next_in_row[x] = y
        fused = set()
        for _rank, act in dispatch_order(schedule):
            s, m = act.stage, act.microbatch
            pr, ps = progs[s], self.st.config.plan_stage(act.stage)  # (the plan's stage names the task)
            if act.kind == "F":
                ins = self.input_slots(s, m)
                nxt = next_in_row.get(act)
                n_o = len(pr.graph.outputs)
                if pr.can_fuse and nxt is not None and nxt.kind == "B" and nxt.stage == s and nxt.microbatch == m:
                    outs = b.emit(pr.fwd_bwd, ins + acc[s] + self.flag(s), n_o + len(acc[s]) + len(pr.act_idx),
                                  f"{ps}F{m}+{ps}B{m}")
                    self.ship_outputs(s, m, outs[:n_o])
                    acc[s] = outs[n_o:n_o + len(acc[s])]
                    self.ship_input_cts(s, m, outs[n_o + len(acc[s]):])
                    fused.add(nxt)
                    continue
                outs = b.emit(pr.fwd, ins, n_o + pr.num_kept, f"{ps}F{m}")
                self.fwd_state[(s, m)] = (ins, outs[n_o:])
                self.ship_outputs(s, m, outs[:n_o])
            elif act.kind == "B":
                if act in fused:
                    continue
                ins, kept = self.fwd_state.pop((s, m))
                forwarded = [ins[i] for i in pr.forwarded_inputs]
                cts = self.output_cts(s, m)
                outs = b.emit(pr.bwd, kept + forwarded + cts + acc[s] + self.flag(s),
                              len(acc[s]) + len(pr.act_idx), f"{ps}B{m}")
                acc[s] = outs[:len(acc[s])]
                self.ship_input_cts(s, m, outs[len(acc[s]):])
            elif act.kind == "I":
                ins, kept = self.fwd_state[(s, m)]
                forwarded = [ins[i] for i in pr.forwarded_inputs]
                args = kept + forwarded + self.output_cts(s, m)
                bwd_input = pr.bwd_input  # splits the backward, which sets num_stash
                n_ct = len(pr.act_idx)
                outs = (b.emit(bwd_input, args, n_ct + pr.num_stash, f"{ps}I{m}")
                        if n_ct + pr.num_stash else [])
                self.ship_input_cts(s, m, outs[:n_ct])
                self.w_state[(s, m)] = ([args[k] for k in pr.weight_args], outs[n_ct:])
            else:  # W
                self.fwd_state.pop((s, m))
                w_args, stash = self.w_state.pop((s, m))
                if acc[s]:
                    acc[s] = b.emit(pr.bwd_weight, w_args + stash + acc[s] + self.flag(s), len(acc[s]), f"{ps}W{m}")

    def reduce_outputs(self) -> None:
        """Loss and aux: reduce the per-microbatch values on the stage that produced them."""
        b, st = self.b, self.st
        concatenated = st.concatenated_outputs()
        batch_dependent = batch_dependent_vars(st.fwd, st.mb_invar)
        for k in range(1 + st.spec.num_aux):
            a = st.fwd.outvars[k]
            s = st.out_stage[k]
            first = self.outvar_idx.get(a) if not isinstance(a, Literal) else None
            if first is not None and first < k:  # the same value returned again (the loss in the aux): reduced once
                self.reduced[k] = self.reduced[first]
                continue
            if st.is_constant_output(k):
                self.reduced[k] = b.tl.const(jax.device_put(jnp.asarray(st.constant_output(k), a.aval.dtype),
                                                            self.meshes.replicated[s]))
                continue
            parts = self.out_parts[k]
            assert len(parts) == self.M, (k, len(parts))
            if st.config.read_once(k, a in batch_dependent):  # read off the parameters alone: every microbatch's
                fn = jax.jit(lambda x: (x,), out_shardings=(self.meshes.replicated[s],))
                (self.reduced[k],) = b.emit(fn, parts[:1], 1, f"aux {k - 1} stage {s}")
                continue
            if k in concatenated:  # per-example values: the whole batch's, in order
                fn = jax.jit(lambda *xs, m=st.config.reduction(k): (concatenate_microbatches(xs, m),),
                             out_shardings=(self.meshes.replicated[s],))
            elif st.config.reduction(k) in EXTREMES:  # a maximum (minimum) over examples: the microbatches' one
                fn = jax.jit(lambda *xs, op=EXTREMES[st.config.reduction(k)]: (functools.reduce(op, xs),),
                             out_shardings=(self.meshes.replicated[s],))
            else:
                fn = jax.jit(lambda *xs, mean=st.config.reduction(k) == "mean":  # (one microbatch: its value, any dtype)
                             (sum(xs[1:], xs[0]) / len(xs) if mean and len(xs) > 1 else sum(xs[1:], xs[0]),),
                             out_shardings=(self.meshes.replicated[s],))
            (self.reduced[k],) = b.emit(fn, parts, 1, f"reduce {'loss' if k == 0 else f'aux {k - 1}'} stage {s}")


def lay_out_pipeline(b) -> Pipeline:
    """Append the pipeline's tasks to step builder ``b``'s list."""
    pipe = Pipeline(b, stage_programs(b.step))
    pipe.lay_out_inputs()
    pipe.lay_out_accumulators()
    pipe.lay_out_actions()
    pipe.reduce_outputs()
    pipe.accumulators = [Accumulators(s, t, start, tuple(pipe.acc[s])) for s, t, start in pipe.accumulators]
    return pipe

"""Per-stage programs: a stage's slice of the forward jaxpr, its VJP, and the jitted F / B / FB programs."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax.extend import core as jex_core

from autopp.core import _compat
from autopp.core._jaxpr import (differentiable_vars, eqns_needed, eval_closed, eval_jaxpr_with, forward_with_vjp,
                               slice_jaxpr)
from autopp.core._packing import plan_packing
from autopp.core._remat import layer_checkpointed
from autopp.core._reroll import reroll_scans
from autopp.core._twins import DeviceMapped, device_map, twin_key

Literal = jex_core.Literal


def _loop_residuals(jaxpr, kept) -> set[int]:
    """Positions in ``kept`` of the residuals a loop makes or reads (a ``lax.scan``'s stacked outputs and
    per-iteration inputs): the backward's loop reads them again, and a loop's operand is a buffer of its own, so a
    residual sliced out of a pack there costs a kernel of its own (compiled, and launched every call) instead of
    fusing into its reader."""
    loops = [e for e in jaxpr.eqns if e.primitive.name in _LOOP_PRIMITIVES]
    touched = {v for e in loops for v in (*e.invars, *e.outvars) if _is_var(v)}
    return {k for k, r in enumerate(kept) if _is_var(r) and r in touched}


_LOOP_PRIMITIVES = ("scan", "while")


def _is_var(a) -> bool:
    return not isinstance(a, Literal)


@dataclasses.dataclass
class StageGraph:
    """The data flow of one stage's forward slice, in terms of forward-jaxpr variables."""

    index: int
    jaxpr: jex_core.Jaxpr
    """invars = ``inputs``, outvars = ``outputs``."""
    consts: list
    inputs: list
    """Forward invars and activations produced by earlier stages, in first-use order."""
    outputs: list
    """Activations for later stages, then the loss/aux outvars this stage produces."""
    diff_inputs: list[bool]
    diff_outputs: list[bool]


def stage_graphs(forward: jex_core.ClosedJaxpr, stage_eqns: Sequence[Sequence[int]],
                 diff_invars: Sequence[bool], out_stage: Sequence[int]) -> list[StageGraph]:
    """Slice the forward jaxpr into per-stage jaxprs.

    ``out_stage[k]`` is the stage that emits forward outvar k (loss, aux leaves).
    """
    jaxpr = forward.jaxpr
    const_of = dict(zip(jaxpr.constvars, forward.consts))
    invar_set = set(jaxpr.invars)
    diffable = differentiable_vars(jaxpr, diff_invars)
    diff_invar_set = {v for v, d in zip(jaxpr.invars, diff_invars) if d}
    num = len(stage_eqns)
    defined = []
    used = []
    for s in range(num):
        d, u = set(), []
        seen = set()
        for i in stage_eqns[s]:
            e = jaxpr.eqns[i]
            for a in e.invars:
                if _is_var(a) and a not in d and a not in seen:
                    seen.add(a)
                    u.append(a)
            d.update(e.outvars)
        defined.append(d)
        used.append(u)
    # Activation outputs: defined here and an input of a later stage that does not define it itself.
    act_out: list[list] = [[] for _ in range(num)]
    for t in range(num):
        for v in used[t]:
            if v in invar_set or v in const_of:
                continue
            producers = [s for s in range(t) if v in defined[s]]
            assert producers, f"forward variable {v} is used by stage {t} before it is defined"
            s = producers[-1]
            if v not in act_out[s]:
                act_out[s].append(v)
    graphs = []
    for s in range(num):
        outs = list(act_out[s])
        for k, a in enumerate(jaxpr.outvars):
            if out_stage[k] == s and _is_var(a) and a not in outs:
                outs.append(a)
        sub, ins, outs = slice_jaxpr(forward, stage_eqns[s], outs, f"stage {s}")
        # a parameter this stage reads only through stop_gradient gets no gradient here (the whole step's zero
        # gradients are found by autopp.core._zero_grads; this is the local, per-stage case, checked cheaply)
        carrying = {a for i in stage_eqns[s] if jaxpr.eqns[i].primitive.name != "stop_gradient"
                    for a in jaxpr.eqns[i].invars if _is_var(a)}
        graphs.append(StageGraph(
            index=s,
            jaxpr=sub.jaxpr,
            consts=list(sub.consts),
            inputs=ins,
            outputs=outs,
            diff_inputs=[(v in diff_invar_set and v in carrying) or (v in diffable and v not in invar_set)
                         for v in ins],
            diff_outputs=[v in diffable for v in outs],
        ))
    return graphs


def _steady_vars(jaxpr: jex_core.Jaxpr, steady_inputs: Sequence[bool]) -> set:
    """Values the same for every microbatch: computed, by equations without effects, from inputs that are
    (``steady_inputs``: parameters, frozen weights), constants and literals alone."""
    steady = {v for v, p in zip(jaxpr.invars, steady_inputs) if p} | set(jaxpr.constvars)
    for e in jaxpr.eqns:
        if not e.effects and all(not _is_var(a) or a in steady for a in e.invars):
            steady.update(e.outvars)
    return steady


RECOMPUTE_POLICIES = {
    "full": None,  # keep each layer's input; the backward re-runs a layer's forward before its backward
    # (:mod:`autopp.core._remat`; a stage without ``layer_starts`` is one layer)
    # keep the outputs of matmuls without batch dimensions (the linear layers); recompute the rest, notably the
    # attention core, whose einsums carry batch and head dimensions (Korthikanti et al. 2022's selective scheme)
    "selective": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}
"""``jax.checkpoint`` policy of each recomputation mode (``none``: no checkpoint)."""


class StagePrograms:
    """The jitted programs of one stage (``recompute``: ``none``, ``full`` or ``selective``, see
    :data:`RECOMPUTE_POLICIES`).

    * ``fwd(*inputs, *row_bases) -> (*outputs, *residuals)``: outputs as in :class:`StageGraph`; residuals are what
      the VJP keeps, minus residuals that are inputs (those are passed to ``bwd`` from the inputs). ``row_bases``
      (:attr:`row_bases`, int32 scalars; usually none) say where the stage's rows of each stacked input begin.
    * ``bwd(*residuals, *forwarded_inputs, *cotangents, *grad_acc, first) -> (*grad_acc, *input_cotangents)``:
      ``cotangents`` are one per differentiable output (already summed); ``grad_acc`` the gradient accumulators of the
      differentiable *parameter* inputs, small ones packed (:attr:`acc_packing`; donated); ``input_cotangents`` one
      per differentiable activation input.
      ``first`` (a boolean scalar, present when there are accumulators) starts the accumulation: the
      accumulators' contents are then ignored, not added, so any buffer of the right layout can start a step
      (the runtime reuses the previous step's accumulators instead of a program that makes zeros).
    * ``fwd_bwd(*inputs, *row_bases, *grad_acc, first) -> (*outputs, *grad_acc, *input_cotangents)``: both at once, for a
      stage whose differentiable outputs all have constant cotangents (the loss stage).
    * ``bwd_input(*residuals, *forwarded_inputs, *cotangents) -> (*input_cotangents, *stash)`` and
      ``bwd_weight(*w_args, *stash, *grad_acc, first) -> (*grad_acc)``: ``bwd`` split for zero-bubble schedules (an
      ``I`` and a ``W`` action): the input-gradient part is the slice of the backward that the input
      cotangents need; the weight-gradient part is the rest, reading ``stash`` (values the input part computed
      that it also needs: the output gradients of the stage's layers) and the ``bwd`` arguments listed in
      :attr:`weight_args` (positions among ``residuals, forwarded_inputs, cotangents``).

    ``constraints``: forward variable -> sharding, applied where the stage's forward defines the value (its
    cotangent takes the same layout): sequence parallelism's activations between layers.

    ``twins``: a dict shared by the stages of one step (key -> the stages that made their own programs). A stage
    whose programs equal an earlier stage's up to their devices (:mod:`autopp.core._twins`) takes that stage's
    programs as :class:`~autopp.core.DeviceMapped` ones instead of tracing and differentiating its own. Its
    ``residual_sharding(shape, dim=None)`` must then give, for each shape, the layout the earlier stage's gives on
    the mapped devices (checked for the shapes the programs use; a stage that fails the check makes its own programs).

    ``split_dims(jaxpr, params)``: ``{var: dim}`` of the values the forward (``jaxpr``, parameters ``params`` among its
    inputs) computes split over a model-parallel axis along ``dim``; a residual among them is kept so
    (``residual_sharding(shape, dim)``) instead of gathered whole. None: every residual laid out by its shape alone.

    ``layer_starts``: ``id`` of each forward equation that begins a layer: where ``recompute="full"`` checkpoints
    (:mod:`autopp.core._remat`).
    """

    def __init__(self, graph: StageGraph, *, is_param: Sequence[bool], seed_of_output: dict[int, float],
                 in_shardings, out_shardings_fwd, grad_shardings, act_ct_shardings, residual_sharding,
                 flag_sharding, recompute: str = "none", constraints: dict | None = None,
                 twins: dict | None = None, layer_starts: frozenset = frozenset(), split_dims=None,
                 steady_inputs: Sequence[bool] | None = None):
        own_kwargs = dict(is_param=is_param, seed_of_output=seed_of_output, in_shardings=in_shardings,
                          out_shardings_fwd=out_shardings_fwd, grad_shardings=grad_shardings,
                          act_ct_shardings=act_ct_shardings, residual_sharding=residual_sharding,
                          flag_sharding=flag_sharding, recompute=recompute, constraints=constraints,
                          layer_starts=layer_starts, split_dims=split_dims, steady_inputs=steady_inputs)
        steady_inputs = tuple(is_param if steady_inputs is None else steady_inputs)
        self.graph = graph
        g = graph
        self.diff_in_idx = [i for i, d in enumerate(g.diff_inputs) if d]
        self.param_idx = [i for i in self.diff_in_idx if is_param[i]]
        self.act_idx = [i for i in self.diff_in_idx if not is_param[i]]
        self.diff_out_idx = [i for i, d in enumerate(g.diff_outputs) if d]
        self.has_flag = bool(self.param_idx)
        """Whether the accumulating programs take the ``first`` flag (they do when the stage has parameters)."""
        self.seed_of_output = dict(seed_of_output)
        constraints = dict(constraints or {})
        closed = jex_core.ClosedJaxpr(g.jaxpr, g.consts)
        self.row_bases = []
        if not constraints:  # a constrained activation must keep its identity: leave the iterations unrolled
            closed, _, self.row_bases = reroll_scans(closed, name=f"stage {g.index}", relative_rows=True)
        """``row_bases``: the int32 values ``fwd`` and ``fwd_bwd`` take after the inputs, the least row the stage reads of
        each stacked input: whole ``lax.scan`` iterations run as one scan, and stages running the same iterations at
        other depths are one program (:mod:`autopp.core._reroll`)."""
        self._twin = None
        """(source stage's programs, device map, this stage's own programs on demand) of a twin stage."""
        keyed = None
        if twins is not None and not constraints:
            layers = tuple(i for i, e in enumerate(closed.jaxpr.eqns) if id(e) in layer_starts) \
                if recompute == "full" else ()
            flags = (tuple(g.diff_inputs), tuple(g.diff_outputs), tuple(is_param), steady_inputs,
                     tuple(sorted(self.seed_of_output.items())), len(self.row_bases), recompute, layers)
            keyed = twin_key(closed, flags, [*in_shardings, *out_shardings_fwd, *grad_shardings,
                                             *act_ct_shardings, flag_sharding])
            real = functools.cache(lambda: StagePrograms(graph, **own_kwargs))
            for source in twins.get(keyed[0], ()) if keyed is not None else ():  # one this stage's devices map from
                devmap = device_map(source._twin_devices, keyed[1])  # (None: another process's devices)
                if devmap is not None and self._become_twin(source, devmap, real, residual_sharding, grad_shardings,
                                                            act_ct_shardings):
                    return
        in_avals = [v.aval for v in g.inputs] + [jax.ShapeDtypeStruct((), jnp.int32)] * len(self.row_bases)
        n_in = len(in_avals)
        in_shardings = list(in_shardings) + [flag_sharding] * len(self.row_bases)

        def constrain(_, eqn, invals):  # lay the chosen activations out as planned (sequence parallelism)
            outs = _compat.bind_eqn(eqn, invals)
            many = eqn.primitive.multiple_results
            return [jax.lax.with_sharding_constraint(o, constraints[v]) if v in constraints else o
                    for v, o in zip(eqn.outvars, outs if many else [outs])]

        def evaluate(sub, inputs):
            if not constraints:
                return eval_closed(sub, *inputs)
            return eval_jaxpr_with(sub.jaxpr, sub.consts, inputs, constrain)

        if recompute == "full":  # one layer at a time, as Megatron-LM (layers begin at ``layer_starts``)
            run = layer_checkpointed(closed, layer_starts, evaluate)
        else:
            run = functools.partial(evaluate, closed)
        forward = forward_with_vjp(closed, self.diff_in_idx, self.diff_out_idx,
                                   recompute="none" if recompute == "full" else recompute,
                                   policy=RECOMPUTE_POLICIES.get(recompute), run=run)

        diff_in_idx, diff_out_idx = self.diff_in_idx, self.diff_out_idx

        def vjp_of(inputs):
            return forward(*inputs)

        holder = {}

        def fwd_full(*inputs):
            outs, vjp_fn = vjp_of(list(inputs))
            leaves, treedef = jax.tree_util.tree_flatten(vjp_fn)
            holder["treedef"] = treedef
            return (*outs, *leaves)

        traced = jax.make_jaxpr(fwd_full)(*[jax.ShapeDtypeStruct(a.shape, a.dtype) for a in in_avals])
        self._vjp_treedef = holder["treedef"]
        n_out = len(g.outputs)
        res_vars = traced.jaxpr.outvars[n_out:]
        in_pos = {v: i for i, v in enumerate(traced.jaxpr.invars)}
        # Residual k is a new value (kept), forward input ``forwarded[k]``, or a value computed from no input (a mask
        # or a fill broadcast from constants to the batch's shape) or from parameters alone (a tied embedding's
        # transpose, a weight's cast), made again by the backward instead of kept once per microbatch in flight.
        self.residual_source: list[tuple[str, int]] = []
        kept, remade = [], []
        steady = _steady_vars(traced.jaxpr, [i < len(steady_inputs) and steady_inputs[i] for i in range(len(in_avals))])
        for r in res_vars:
            if _is_var(r) and r in in_pos:
                self.residual_source.append(("input", in_pos[r]))
            elif _is_var(r) and r in steady and r not in traced.jaxpr.constvars:
                self.residual_source.append(("remade", len(remade)))
                remade.append(r)
            else:
                self.residual_source.append(("kept", len(kept)))
                kept.append(r)
        remake, remake_from = None, []
        if remade:
            remake, remake_ins, _ = slice_jaxpr(traced, eqns_needed(traced.jaxpr, remade), remade,
                                                f"stage {g.index} parameter and constant residuals")
            remake_from = [in_pos[v] for v in remake_ins]
        # a residual the forward computes split over a model-parallel axis keeps that split (``split_dims``)
        dims = split_dims(traced.jaxpr, [v for v, p in zip(traced.jaxpr.invars, is_param) if p]) if split_dims else {}
        self._residual_dims = [dims.get(r) if _is_var(r) else None for r in kept]
        packing = plan_packing([r.aval for r in kept], [residual_sharding(r.aval.shape, d)
                                                        for r, d in zip(kept, self._residual_dims)],
                               keep_loose=_loop_residuals(traced.jaxpr, kept))
        self.packing = packing
        """How the kept residuals travel from ``fwd`` to ``bwd``: small ones packed (:mod:`autopp.core._packing`)."""
        self.num_kept = packing.num_buffers
        """Residual buffers ``fwd`` returns after the outputs (packs, then residuals of their own)."""
        self.forwarded_inputs = sorted({i for kind, i in self.residual_source if kind == "input"} | set(remake_from))
        fwd_jaxpr = jex_core.ClosedJaxpr(
            _compat.new_jaxpr(traced.jaxpr.constvars, traced.jaxpr.invars, traced.jaxpr.outvars[:n_out] + kept,
                              traced.jaxpr.eqns, traced.jaxpr.effects, f"stage {g.index} forward"),
            traced.consts,
        )

        def fwd(*inputs):
            outs = eval_closed(fwd_jaxpr, *inputs)
            return (*outs[:n_out], *packing.pack(outs[n_out:]))

        treedef = self._vjp_treedef
        residual_source = self.residual_source
        forwarded = self.forwarded_inputs
        num_kept = self.num_kept
        act_idx, param_idx = self.act_idx, self.param_idx
        n_ct = len(diff_out_idx)
        seeds = [self.seed_of_output.get(i) for i in diff_out_idx]
        out_avals = [g.outputs[i].aval for i in diff_out_idx]

        acc_packing = plan_packing([g.inputs[i].aval for i in param_idx], list(grad_shardings))
        self.acc_packing = acc_packing
        """How the gradient accumulators are held between actions: small ones packed per dtype and layout, as the
        residuals are, so that a backward takes and returns a few buffers instead of one per parameter;
        ``acc_packing.unpack`` gives each parameter's gradient (in :attr:`param_idx` order)."""
        n_acc = self.num_acc = acc_packing.num_buffers

        def accumulate(grad_acc, first, by_input):
            # a select, not a multiply: a reused buffer may hold inf or nan. Selected before the add, so that XLA adds a
            # scatter's gradient (an embedding's) into the accumulator in place instead of into a new zeroed buffer.
            # (Packed ones are concatenated again: written back slice by slice they held half the temporaries, but a
            # 75-leaf Llama's 4-stage step took 10% longer.)
            accs = acc_packing.unpack(grad_acc)
            return acc_packing.pack([jnp.where(first, jnp.zeros_like(a), a) + by_input[i]
                                     for a, i in zip(accs, param_idx)])

        def apply_vjp(vjp_leaves, cts, grad_acc, first):
            vjp_fn = jax.tree_util.tree_unflatten(treedef, vjp_leaves)
            grads = vjp_fn(cts)
            by_input = dict(zip(diff_in_idx, grads))
            return (*accumulate(grad_acc, first, by_input), *[by_input[i] for i in act_idx])

        has_flag = self.has_flag

        def bwd(*args):
            kept_vals = packing.unpack(args[:num_kept])
            fwd_vals = dict(zip(forwarded, args[num_kept:num_kept + len(forwarded)]))
            cts = list(args[num_kept + len(forwarded):num_kept + len(forwarded) + n_ct])
            grad_acc = args[num_kept + len(forwarded) + n_ct:num_kept + len(forwarded) + n_ct + n_acc]
            first = args[-1] if has_flag else None
            remade = (eval_closed(remake, *[fwd_vals[i] for i in remake_from])
                      if remake is not None else [])
            leaves = [kept_vals[i] if kind == "kept" else fwd_vals[i] if kind == "input" else remade[i]
                      for kind, i in residual_source]
            return apply_vjp(leaves, cts, grad_acc, first)

        def fwd_bwd(*args):
            inputs = list(args[:n_in])
            grad_acc = args[n_in:n_in + n_acc]
            first = args[-1] if has_flag else None
            outs, vjp_fn = vjp_of(inputs)
            cts = [jnp.full(a.shape, s, a.dtype) for a, s in zip(out_avals, seeds)]
            grads = vjp_fn(cts)
            by_input = dict(zip(diff_in_idx, grads))
            return (*outs, *accumulate(grad_acc, first, by_input), *[by_input[i] for i in act_idx])

        self.can_fuse = all(s is not None for s in seeds)
        res_shardings = packing.buffer_shardings()
        self.fwd = jax.jit(fwd, in_shardings=tuple(in_shardings),
                           out_shardings=tuple(out_shardings_fwd) + res_shardings)
        acc_shardings = tuple(acc_packing.buffer_shardings())
        act_ct = tuple(act_ct_shardings)
        n_bwd_in = num_kept + len(forwarded) + n_ct + n_acc
        self.bwd = jax.jit(bwd, out_shardings=acc_shardings + act_ct,
                           donate_argnums=tuple(range(n_bwd_in - n_acc, n_bwd_in)))
        self._bwd_fn, self._acc_shardings, self._act_ct_shardings = bwd, acc_shardings, act_ct
        self._residual_sharding = residual_sharding
        self._bwd_in_avals = (packing.buffer_avals()
                              + [jax.ShapeDtypeStruct(in_avals[i].shape, in_avals[i].dtype) for i in forwarded]
                              + [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in out_avals]
                              + acc_packing.buffer_avals()
                              + ([jax.ShapeDtypeStruct((), jnp.bool_)] if has_flag else []))
        self._split = None
        flag_sh = (flag_sharding,) if has_flag else ()
        self.fwd_bwd = jax.jit(fwd_bwd, in_shardings=tuple(in_shardings) + acc_shardings + flag_sh,
                               out_shardings=tuple(out_shardings_fwd) + acc_shardings + act_ct,
                               donate_argnums=tuple(range(n_in, n_in + n_acc)))
        if keyed is not None:
            self._twin_devices = keyed[1]
            twins.setdefault(keyed[0], []).append(self)

    def _become_twin(self, source: StagePrograms, devmap: dict, real, residual_sharding, grad_shardings,
                     act_ct_shardings) -> bool:
        """Take ``source``'s programs on the devices ``devmap`` maps them to; False (nothing taken) when this
        stage lays out a residual unlike ``source``."""
        res_sh = tuple(residual_sharding(a.shape, d) for a, d in zip(source.packing.avals, source._residual_dims))
        if any(_compat.map_sharding(a, devmap) != b for a, b in zip(source.packing.shardings, res_sh)):
            return False
        not_shared = ("_bwd_input", "_bwd_weight", "_stash_shardings", "_twin_devices", "num_stash", "weight_args")
        for name, value in vars(source).items():  # what the programs are, apart from their devices
            if name not in vars(self) and name not in not_shared:
                setattr(self, name, value)
        self.packing = dataclasses.replace(source.packing, shardings=res_sh)
        self.acc_packing = dataclasses.replace(source.acc_packing, shardings=tuple(grad_shardings))
        self._residual_sharding = residual_sharding
        self._acc_shardings = tuple(self.acc_packing.buffer_shardings())
        self._act_ct_shardings = tuple(act_ct_shardings)
        self._bwd_fn = None
        self._split = None
        self._twin = (source, devmap, real)
        for name in ("fwd", "bwd", "fwd_bwd"):
            setattr(self, name, DeviceMapped(getattr(source, name), devmap, lambda name=name: getattr(real(), name)))
        return True

    def _split_backward(self):
        """Build ``bwd_input`` / ``bwd_weight`` (on first use: only zero-bubble schedules need them)."""
        if self._twin is not None:
            source, devmap, real = self._twin
            if source._split is None:
                source._split_backward()
            if all(_compat.map_sharding(sh, devmap) == self._residual_sharding(shape)
                   for shape, sh in source._stash_shardings):
                self._bwd_input = DeviceMapped(source._bwd_input, devmap, lambda: real().bwd_input)
                self._bwd_weight = DeviceMapped(source._bwd_weight, devmap, lambda: real().bwd_weight)
            else:  # a stash laid out otherwise here: this stage's own split
                self._bwd_input, self._bwd_weight = real().bwd_input, real().bwd_weight
            self.num_stash, self.weight_args, self._split = source.num_stash, source.weight_args, True
            return
        traced = jax.make_jaxpr(self._bwd_fn)(*self._bwd_in_avals)
        jaxpr = traced.jaxpr
        n_acc, n_flag = self.num_acc, int(self.has_flag)
        n_args = len(jaxpr.invars) - n_acc - n_flag
        acc_out, ct_out = jaxpr.outvars[:n_acc], jaxpr.outvars[n_acc:]

        input_ids = eqns_needed(jaxpr, ct_out)
        weight_ids = eqns_needed(jaxpr, acc_out, exclude=frozenset(input_ids))
        # equations kept for their effects alone (jax.debug.print in a custom_vjp's backward): with the input gradient,
        # or with the weight gradient on a stage that sends no input gradient (the runtime then runs no input pass)
        effects = [i for i, e in enumerate(jaxpr.eqns) if e.effects and i not in input_ids and i not in weight_ids]
        if effects:
            reads = [a for i in effects for a in jaxpr.eqns[i].invars]
            needed = eqns_needed(jaxpr, reads, exclude=frozenset(input_ids))
            if ct_out:
                input_ids = sorted(set(input_ids) | set(needed) | set(effects))
            else:
                weight_ids = sorted(set(weight_ids) | set(needed) | set(effects))
        made_by_input = {o for i in input_ids for o in jaxpr.eqns[i].outvars}
        used_by_weight = []
        for i in weight_ids:
            for a in jaxpr.eqns[i].invars:
                if _is_var(a) and a not in used_by_weight:
                    used_by_weight.append(a)
        for a in acc_out:
            if _is_var(a) and a not in used_by_weight:
                used_by_weight.append(a)
        stash = [v for v in used_by_weight if v in made_by_input]
        arg_vars = jaxpr.invars[:n_args]
        self.weight_args = [k for k, v in enumerate(arg_vars) if v in used_by_weight]
        acc_vars = jaxpr.invars[n_args:]  # the accumulators, then the flag
        input_jaxpr = jex_core.ClosedJaxpr(_compat.new_jaxpr(
            jaxpr.constvars, arg_vars, list(ct_out) + stash, [jaxpr.eqns[i] for i in input_ids], jaxpr.effects,
            f"stage {self.graph.index} input gradient"), traced.consts)
        weight_jaxpr = jex_core.ClosedJaxpr(_compat.new_jaxpr(
            jaxpr.constvars, [arg_vars[k] for k in self.weight_args] + stash + list(acc_vars), list(acc_out),
            [jaxpr.eqns[i] for i in weight_ids], jaxpr.effects, f"stage {self.graph.index} weight gradient"),
            traced.consts)
        self.num_stash = len(stash)
        stash_sh = tuple(self._residual_sharding(v.aval.shape) for v in stash)
        self._stash_shardings = [(v.aval.shape, sh) for v, sh in zip(stash, stash_sh)]
        self._bwd_input = jax.jit(lambda *a: tuple(eval_closed(input_jaxpr, *a)),
                                  out_shardings=self._act_ct_shardings + stash_sh)
        n_w = len(self.weight_args) + len(stash)
        self._bwd_weight = jax.jit(
            lambda *a: tuple(eval_closed(weight_jaxpr, *a)),
            out_shardings=self._acc_shardings, donate_argnums=tuple(range(n_w, n_w + n_acc)))
        self._split = True

    @property
    def bwd_input(self):
        if self._split is None:
            self._split_backward()
        return self._bwd_input

    @property
    def bwd_weight(self):
        if self._split is None:
            self._split_backward()
        return self._bwd_weight

"""Work in the loss that is the same for every microbatch, done once per step.

A loss may compute something heavy from the parameters (and other inputs that are not split with the batch) before
it reads the batch: an R-GCN or LightGCN encoder over the whole graph whose embeddings the batch's triples then score,
a hypernetwork's generated weights, an SVGP's Cholesky of the inducing points' kernel, an orthogonal
parametrisation's matrix exponential. Every microbatch computes the same value, and so does every stage that reads
it: the 2-stage, 4-microbatch R-GCN of the twelfth session's trials ran its encoder 16 times per step, 4484 ms
against jit's 602 ms.

:func:`hoist_batch_independent_work` takes that work out of the loss, as ``jax.jit`` of the whole batch computes it
once: the step computes it before the gradient (``x, vjp = jax.vjp(encoder, params)``), the loss reads ``x`` as one
more differentiated input, and after the gradient the step adds ``vjp(dloss/dx)`` to the parameters' gradients. The
gradient of ``x`` is summed over the microbatches as a parameter's is, so the result is the same sum jit computes;
the encoder's residuals are held from the first microbatch to the last, as jit holds them from its forward to its
backward. The runtime runs the encoder once, on the stage of the weights it reads (else on the one stage its
results go to, else the first), and sends its results where they are read; the profiler prices it once per step with the optimizer update.

Only heavy work is moved (:func:`hoisted_equations`): what contracts or solves (``dot_general``, convolutions,
factorisations, loops holding them) or reduces many values into each result (a segment sum over a graph's edges, a
weight penalty's sum), with what it reads and what is computed from it, when that is at least :data:`HOISTED_SHARE`
of the loss's work at the full batch or returns at most an eighth of the bytes it reads (a summary of the weights:
computed again for its backward, which then runs where the weights live). Work on a stack of layers the loss reads
row by row stays in the loss (the stack may be held by rows). Casting weights to bf16 or transposing them stays in
the loss, where each stage computes what it reads: moved, its result and its gradient would be held for the whole
step at the size of the weights. So does work whose results are larger than what it reads, or whose differentiated
results, held with their gradients, would be larger than what it reads and the weights' own gradients: a LoRA merge
``W + A @ B`` would hold a merged weight and its gradient per step for two thin factors (and at a real model's batch
it is a small share of the work anyway).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax.extend import core as jex_core
from jax.extend.core import Literal

from autopp.core import _compat
from autopp.core._jaxpr import ROW_READS, eval_jaxpr_with, forward_with_vjp

MOVED_WORK_SCOPE = "autopp_moved_work"
"""The named scope of the step's equations that compute the moved work and its backward (what the profiler prices
apart from the optimizer update: by its FLOPs, on the device group that runs it, with the results and residuals
it holds through the step)."""

HOISTED_SHARE = 0.05
"""The share of the loss's forward work (at the full batch) that batch-independent heavy work must reach to be
computed once per step: below it, recomputing it per microbatch costs less than holding its result and gradient."""

_HEAVY_PER_ELEMENT = 8.0
"""An equation whose work per output element reaches this (a contraction over at least 4 elements, a factorisation)
is heavy; elementwise work (1 per element), casts and layout changes are not."""

_CUBIC = frozenset({"cholesky", "lu", "qr", "eigh", "eig", "svd", "schur", "hessenberg", "tridiagonal"})


def _size(aval) -> int:
    return int(math.prod(getattr(aval, "shape", ())))


def eqn_flops(eqn) -> float:
    """A rough count of ``eqn``'s floating-point work: contractions at 2 per multiply-add, factorisations at n**3
    per matrix, loops by their length, everything else one per output element. Enough to tell heavy work from
    elementwise work; the profiler prices programs."""
    name = eqn.primitive.name
    out = sum(_size(v.aval) for v in eqn.outvars)
    if name == "dot_general":
        (contract, _), _ = eqn.params["dimension_numbers"]
        lhs = eqn.invars[0].aval.shape
        return 2.0 * out * math.prod(lhs[d] for d in contract)
    if name == "conv_general_dilated":
        rhs = eqn.invars[1].aval
        out_features = rhs.shape[eqn.params["dimension_numbers"].rhs_spec[0]]
        return 2.0 * out * _size(rhs) / max(out_features, 1)
    if name in ("bcoo_dot_general", "bcsr_dot_general") and eqn.outvars[0].aval.shape:  # (a sparse matrix's
        return 2.0 * _size(eqn.invars[0].aval) * out / eqn.outvars[0].aval.shape[0]  # entries times the columns)
    if name in _CUBIC or name == "triangular_solve":
        shape = eqn.invars[0].aval.shape
        n = shape[-1] if shape else 1
        batch = math.prod(shape[:-2]) if len(shape) > 2 else 1
        if name == "triangular_solve":
            return 1.0 * batch * n * n * (eqn.invars[1].aval.shape[-1] if eqn.invars[1].aval.shape else 1)
        return 1.0 * batch * n ** 3
    subs = list(jex_core.jaxprs_in_params(eqn.params))
    if subs:
        inner = [jaxpr_flops(s) for s in subs]
        if name == "cond":
            return max(inner)
        total = sum(inner)
        return total * eqn.params["length"] if name == "scan" else total
    return float(out)


def jaxpr_flops(jaxpr) -> float:
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    return sum(eqn_flops(e) for e in jaxpr.eqns)


def _bytes(vs) -> int:
    return sum(_size(v.aval) * v.aval.dtype.itemsize for v in vs if hasattr(v.aval, "dtype"))


_REDUCTIONS = {"reduce_sum": 0, "reduce_max": 0, "reduce_min": 0, "reduce_prod": 0, "argmax": 0, "argmin": 0,
               "scatter-add": 2, "scatter_add": 2}
"""Reductions, by the position of the operand they reduce (a segment sum's messages: ``scatter-add``'s updates)."""


def is_heavy(eqn) -> bool:
    """Work of at least :data:`_HEAVY_PER_ELEMENT` per output element, or a reduction of at least as many elements
    into each (a weight penalty's sum: a summary of the weights; a segment sum over a graph's edges into its nodes,
    LightGCN's propagation, at an average degree of 8)."""
    out = max(sum(_size(v.aval) for v in eqn.outvars), 1)
    operand = _REDUCTIONS.get(eqn.primitive.name)
    if operand is not None and len(eqn.invars) > operand:
        return _size(eqn.invars[operand].aval) >= _HEAVY_PER_ELEMENT * out
    return eqn_flops(eqn) >= _HEAVY_PER_ELEMENT * out


def hoisted_equations(forward: jex_core.ClosedJaxpr, same: Sequence[bool], *, decide: bool = True) -> list[int]:
    """Indices of ``forward``'s equations to compute once per step: those computed from inputs that are the same for
    every microbatch alone (``same``, per input: parameters, frozen weights, a graph passed whole; not the batch nor
    what the step computes from it) and constants, with no effects, that are heavy, read by heavy ones or computed
    from heavy ones, but not what the loss returns. Empty when there are none, or (``decide``) when they are less
    than :data:`HOISTED_SHARE` of the forward's work and no summary of what they read (:func:`_summary`)."""
    jaxpr = forward.jaxpr
    if not any(same):
        return []
    free = set(jaxpr.constvars) | {v for v, s in zip(jaxpr.invars, same) if s}
    independent: list[int] = []
    for i, e in enumerate(jaxpr.eqns):
        ins = [a for a in e.invars if not isinstance(a, Literal)]
        if not e.effects and all(a in free for a in ins):  # (nothing read: made from literals, sizes)
            free.update(e.outvars)
            independent.append(i)
    eqns = jaxpr.eqns
    heavy = {i for i in independent if is_heavy(eqns[i])}
    if not heavy:
        return []
    producer = {v: i for i in independent for v in eqns[i].outvars}
    down = set(heavy)  # the heavy work and what is computed from it (producers come first)
    for i in independent:
        if i not in down and any(not isinstance(a, Literal) and producer.get(a) in down for a in eqns[i].invars):
            down.add(i)
    chosen, stack = set(down), list(down)
    while stack:  # and what all of it reads
        i = stack.pop()
        for a in eqns[i].invars:
            j = None if isinstance(a, Literal) else producer.get(a)
            if j is not None and j not in chosen:
                chosen.add(j)
                stack.append(j)
    # What the loss returns stays in it (the loss's value, an aux statistic of the moved work's result), with what is
    # computed from it: a loss returning one of its inputs unchanged is refused.
    returned = {a for a in jaxpr.outvars if not isinstance(a, Literal)}
    dropped = set()
    for i in sorted(chosen):
        if any(v in returned for v in eqns[i].outvars) or any(
                not isinstance(a, Literal) and producer.get(a) in dropped for a in eqns[i].invars):
            dropped.add(i)
    ids = sorted(chosen - dropped)
    if decide and not _heavy_share(jaxpr, ids) and not _summary(jaxpr, ids):
        return []
    return ids


def _heavy_share(jaxpr, ids: Sequence[int]) -> bool:
    return sum(eqn_flops(jaxpr.eqns[i]) for i in ids) >= HOISTED_SHARE * jaxpr_flops(jaxpr)


def _summary(jaxpr, ids: Sequence[int]) -> bool:
    """Whether the work ``ids`` returns to the rest of the loss at most 1/:data:`_HEAVY_PER_ELEMENT` of the bytes it
    reads from the loss's inputs (a weight penalty, a norm of the weights): moved out, the stages that read its results
    no longer read, hold and differentiate every weight it reads."""
    made, chosen, given = {v for i in ids for v in jaxpr.eqns[i].outvars}, set(ids), set(jaxpr.invars)
    read_after = {a for i, e in enumerate(jaxpr.eqns) if i not in chosen for a in e.invars
                  if not isinstance(a, Literal)}
    inputs = {a for i in ids for a in jaxpr.eqns[i].invars if not isinstance(a, Literal) and a in given}
    return _HEAVY_PER_ELEMENT * _bytes(made & read_after) <= _bytes(inputs)


@dataclasses.dataclass(frozen=True)
class HoistedSplit:
    """``forward`` cut in two: ``work`` (the hoisted equations, over the inputs ``work_inputs`` reads, returning the
    values the rest reads) and ``rest`` (over ``forward``'s inputs, then those values)."""

    work: jex_core.ClosedJaxpr
    work_inputs: tuple[int, ...]
    rest: jex_core.ClosedJaxpr
    differentiable: tuple[bool, ...]
    """Per value of ``work``: whether it is inexact and computed from a differentiated input (its gradient is
    taken)."""


def split_forward(forward: jex_core.ClosedJaxpr, ids: Sequence[int], diff_mask: Sequence[bool]) -> HoistedSplit:
    jaxpr = forward.jaxpr
    chosen = set(ids)
    work_eqns = [jaxpr.eqns[i] for i in ids]
    rest_eqns = [e for i, e in enumerate(jaxpr.eqns) if i not in chosen]
    read_after = {a for e in rest_eqns for a in e.invars if not isinstance(a, Literal)}
    read_after |= {a for a in jaxpr.outvars if not isinstance(a, Literal)}
    values = [v for e in work_eqns for v in e.outvars if v in read_after]
    read = {a for e in work_eqns for a in e.invars if not isinstance(a, Literal)}
    work_inputs = tuple(k for k, v in enumerate(jaxpr.invars) if v in read)
    differentiated = {jaxpr.invars[k] for k in work_inputs if diff_mask[k]}
    for e in work_eqns:
        if any(not isinstance(a, Literal) and a in differentiated for a in e.invars):
            differentiated.update(e.outvars)
    differentiable = tuple(v in differentiated and jnp.issubdtype(v.aval.dtype, jnp.inexact) for v in values)
    work = jex_core.ClosedJaxpr(_compat.new_jaxpr(jaxpr.constvars, [jaxpr.invars[k] for k in work_inputs], values,
                                                  work_eqns, jex_core.no_effects, "hoisted"), forward.consts)
    rest = jex_core.ClosedJaxpr(_compat.new_jaxpr(jaxpr.constvars, [*jaxpr.invars, *values], jaxpr.outvars,
                                                  rest_eqns, jaxpr.effects, "loss"), forward.consts)
    return HoistedSplit(work, work_inputs, rest, differentiable)


def _rows_read(cut: HoistedSplit, invars) -> bool:
    """Whether an input the moved work reads is one the rest of the loss reads row by row (a stack of layers: rows
    taken for each layer of a scan, replayed or not)."""
    read = {invars[k] for k in cut.work_inputs}
    return any(e.primitive.name in ROW_READS | {"scan"} and any(a in read for a in e.invars)
               for e in cut.rest.jaxpr.eqns)


def hoist_batch_independent_work(closed: jex_core.ClosedJaxpr, grad_index: int, same: Sequence[bool],
                                 keep: Sequence = (), evaluate: Callable = eval_jaxpr_with):
    """``closed`` (a step whose equation ``grad_index`` is the gradient) with the loss's heavy batch-independent
    work (:func:`hoisted_equations`; ``same``: per input of the gradient equation, whether it is the same for every
    microbatch) computed once, before the gradient, and its backward after it. Returns (the new step, the index of
    its gradient equation, the new variables of ``keep`` (variables of ``closed`` read after the gradient)), or None
    when nothing is moved. ``evaluate(jaxpr, consts, args)``: how the moved work is evaluated into the step (the
    tracer inlines the calls in it, as it does the step's)."""
    eqn = closed.jaxpr.eqns[grad_index]
    spec = eqn.params["spec"]
    ids = hoisted_equations(spec.forward, same)
    if not ids:
        return None
    cut = split_forward(spec.forward, ids, spec.diff_mask)
    values, inputs = cut.work.jaxpr.outvars, cut.work.jaxpr.invars
    if (2 * _bytes(v for v, d in zip(values, cut.differentiable) if d)
            > _bytes(inputs) + _bytes(v for v, k in zip(inputs, cut.work_inputs) if spec.diff_mask[k])
            or _bytes(values) > _bytes(inputs)):
        return None  # results and their gradients, held per step, larger than what the work reads and the weights'
        # own gradients: a LoRA merge W + A @ B (a merged weight and its gradient for two thin factors)
    if _rows_read(cut, spec.forward.jaxpr.invars):
        return None  # (a penalty on a stack of layers the loss reads row by row: the stack may be held by rows, one
        # stage each, which work on the whole stack outside the loss would gather on every stage)
    rest_reads = {a for e in cut.rest.jaxpr.eqns for a in e.invars if not isinstance(a, Literal)}
    rest_reads |= {a for a in cut.rest.jaxpr.outvars if not isinstance(a, Literal)}
    invars = spec.forward.jaxpr.invars
    work_diff = [k for k in cut.work_inputs if spec.diff_mask[k]]
    # A weight only the moved work reads gets its gradient from the work's backward alone.
    diff_mask = tuple(d and (invars[k] in rest_reads or k not in work_diff) for k, d in enumerate(spec.diff_mask))
    diff_mask += cut.differentiable
    if not any(diff_mask):
        return None
    new_spec = dataclasses.replace(spec, forward=cut.rest, diff_mask=diff_mask,
                                   sunk_mask=spec.sunk_mask or spec.diff_mask, num_hoisted=len(cut.differentiable),
                                   returned_mask=spec.returned_mask or spec.diff_mask)
    head = 1 + spec.num_aux
    # Heavy work keeps its residuals from before the gradient to after it, as jit does; a summary of the weights (a
    # penalty) is computed again for its backward, which then reads the weights where they live.
    recompute = not _heavy_share(spec.forward.jaxpr, ids)

    positions = [j for j, k in enumerate(cut.work_inputs) if spec.diff_mask[k]]
    taken = [j for j, d in enumerate(cut.differentiable) if d]
    with_vjp = forward_with_vjp(cut.work, positions, taken, run=lambda vals: evaluate(cut.work.jaxpr, cut.work.consts,
                                                                                       vals))

    def gradient(i, e, invals):
        if i != grad_index:
            return None
        args = [invals[k] for k in cut.work_inputs]
        with jax.named_scope(MOVED_WORK_SCOPE):
            if positions and not recompute:
                values, backward = with_vjp(*args)
            else:
                values, backward = evaluate(cut.work.jaxpr, cut.work.consts, args), None
        outs = _compat.bind_eqn(e.replace(params={**e.params, "spec": new_spec},
                                          invars=[*e.invars, *cut.rest.jaxpr.invars[len(invars):]]),
                                [*invals, *values])
        grads = dict(zip(new_spec.diff_indices, outs[head:]))
        extra = {}
        if positions:
            with jax.named_scope(MOVED_WORK_SCOPE):
                backward = backward or with_vjp(*args)[1]  # (a summary: computed again for its backward)
                extra = dict(zip(work_diff, backward([grads[len(invars) + j] for j in taken])))
        result = list(outs[:head])
        for k in spec.diff_indices:
            g, x = grads.get(k), extra.get(k)
            result.append(x if g is None else g if x is None else g + x)
        return result

    jaxpr = closed.jaxpr
    keep = [v for v in keep if not isinstance(v, Literal)]
    probe = jaxpr.replace(outvars=[*jaxpr.outvars, *keep])
    try:
        new = jax.make_jaxpr(lambda *args: eval_jaxpr_with(probe, closed.consts, args, gradient))(
            *[jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in jaxpr.invars])
    except Exception:  # noqa: BLE001 - work JAX cannot take apart (a while_loop's result the loss stops the gradient
        return None    # of: the loss differentiates, its piece does not): left in the loss, computed per microbatch
    n = len(jaxpr.outvars)
    kept = new.jaxpr.outvars[n:]
    new = new.replace(jaxpr=new.jaxpr.replace(outvars=new.jaxpr.outvars[:n]))
    index = next(i for i, e in enumerate(new.jaxpr.eqns) if e.primitive is eqn.primitive)
    return new, index, kept


def moved_work_inputs(step: jex_core.Jaxpr, grad_index: int) -> set[int]:
    """Positions of the inputs of the step's gradient equation (``step.eqns[grad_index]``) that the work moved out of
    the loss reads (its weights, a graph passed whole), from the equations of :data:`MOVED_WORK_SCOPE`."""
    moved = [e for e in step.eqns[:grad_index] if MOVED_WORK_SCOPE in _compat.name_stack(e)]
    made = {v for e in moved for v in e.outvars}
    read = {a for e in moved for a in e.invars if not isinstance(a, Literal) and a not in made}
    return {k for k, a in enumerate(step.eqns[grad_index].invars) if not isinstance(a, Literal) and a in read}


def hoisted_like(forward: jex_core.ClosedJaxpr, spec, same: Sequence[bool], who: str) -> jex_core.ClosedJaxpr:
    """``forward`` (the loss traced again at another batch size) cut as ``spec``'s (the full batch's) was: the same
    equations moved out, the same values read back as its last inputs."""
    if not getattr(spec, "num_hoisted", 0):
        return forward
    ids = hoisted_equations(forward, same, decide=False)
    mask = (spec.returned_mask or spec.diff_mask)[:len(forward.jaxpr.invars)]
    cut = split_forward(forward, ids, mask) if ids else None
    full = spec.forward.jaxpr.invars[len(spec.forward.jaxpr.invars) - spec.num_hoisted:]
    if cut is None or [v.aval for v in cut.rest.jaxpr.invars[len(forward.jaxpr.invars):]] != [v.aval for v in full]:
        raise ValueError(
            f"{who}: the loss computes heavy work from the parameters alone (before it reads the batch), which autopp "
            "computes once per step, but at microbatch size that work differs from the full batch's. Compute it in "
            "the step, outside the loss, and pass it to the loss; or use num_microbatches=1.")
    return cut.rest

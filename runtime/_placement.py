"""Where each equation of the step *outside* the pipeline runs (pre-processing, optimizer, metrics).

Locations are stage indices. The rules:

* The gradient equation's inputs are required where the pipeline uses them; its outputs (loss,
  gradients) live where the pipeline leaves them.
* An equation that reads a value derived from the pipeline's outputs ("anchored") runs on the one
  location that already holds the most bytes of its anchored inputs; the others are transferred
  (e.g. the per-stage partial norms of ``clip_by_global_norm`` meet on one stage, and the resulting
  scalar is sent back to every stage).
* Every other equation (pre-processing that feeds the gradient, optimizer bookkeeping such as Adam's
  step count) is computed on every location that needs its result, and the step inputs it reads are
  kept on all of those locations, so that feeding the results back in moves nothing.
* Except work of the weights alone, not read from the batch: a reduction of one stage's weights (a weight
  penalty's terms) runs on that stage, and heavy work before the gradient (an encoder moved out of the loss,
  :mod:`autopp.core._hoist`) once, on the stage of the weights it reads, else on the one stage its results go to,
  else the first; their results travel. An equation that reads only a scalar of the anchored values (the
  penalty's cotangent broadcast to a weight's shape) is made where it is needed, and anchored equations weigh the
  weights' stages too, so a penalty's backward runs where its weights live.

:func:`label_outer` says which parameter each value outside the pipeline serves, and which values are optimizer
state: what decides their layout on the stage that holds them.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
from jax.extend import core as jex_core

from autopp.core import TracedStep, eval_closed, eval_jaxpr_with, is_heavy, value_and_grad_p
from autopp.profiler import aval_bytes, optimizer_state_owners

Literal = jex_core.Literal


def _vars(atoms):
    return [a for a in atoms if not isinstance(a, Literal)]


@dataclasses.dataclass
class OuterPlacement:
    """Placement of the step's non-pipeline equations."""

    eqn_locs: dict[int, frozenset[int]]
    """Per outer equation index (not the gradient equation): the locations that compute it."""
    region: dict[int, str]
    """Per outer equation: ``"pre"`` (before the pipeline) or ``"post"``."""
    phase: dict[tuple[int, int], int]
    """Per (equation, location): the phase, i.e. how many cross-location hops precede it."""
    input_homes: dict[int, frozenset[int]]
    """Per non-batch step input (flat index): the locations that keep it."""
    out_locs: list[frozenset[int] | None]
    """Per step output: locations that hold it (None: a literal or an unplaced input)."""


def place_outer(
    jaxpr: jex_core.Jaxpr,
    grad_index: int,
    grad_in_required: Sequence[frozenset[int]],
    grad_out_loc: Sequence[int],
    batch_mask: Sequence[bool],
    default_loc: int = 0,
    anchors: dict | None = None,
) -> OuterPlacement:
    """Where each outer equation runs. ``anchors``: more values that live at one location, as the gradients do
    (the zeros that stand for a frozen weight's gradient, at the weight's stage)."""
    eqns = jaxpr.eqns
    grad = eqns[grad_index]
    producer = {}
    for i, e in enumerate(eqns):
        for v in e.outvars:
            producer[v] = i
    # Ancestors of the gradient equation run before the pipeline.
    pre = set()
    stack = [producer[v] for v in _vars(grad.invars) if v in producer]
    while stack:
        i = stack.pop()
        if i in pre:
            continue
        pre.add(i)
        stack.extend(producer[v] for v in _vars(eqns[i].invars) if v in producer)

    avail: dict = {}  # var -> frozenset of locations that hold it (anchored values)
    for v, loc in [*zip(grad.outvars, grad_out_loc), *(anchors or {}).items()]:
        avail[v] = frozenset({loc})
    home = _homes(jaxpr, grad_index, grad_in_required)
    eqn_locs: dict[int, frozenset[int]] = {}
    # A reduction before the gradient of values computed from weights that live on one stage (a weight penalty's
    # terms, computed once per step: autopp.core._hoist) runs there: only its result travels, not every weight.
    # Heavy work of the weights alone (a whole-graph encoder, a hypernetwork: autopp.core._hoist) runs once, on the
    # stage of the weights it reads (else the one stage its results go to, else the first), its results sent there.
    from_grad = set(grad.outvars)  # (and after it, one not reading the gradients: the penalty's value returned)
    from_batch = {v for v, b in zip(jaxpr.invars, batch_mask) if b}
    feeds: dict = collections.defaultdict(set)  # where the gradient needs what each value before it goes into
    for v, locs in zip(grad.invars, grad_in_required):
        if not isinstance(v, Literal):
            feeds[v] |= set(locs)
    for i in sorted(pre, reverse=True):
        for v in _vars(eqns[i].invars):
            feeds[v] |= set().union(*(feeds[o] for o in eqns[i].outvars))
    for i, e in enumerate(eqns):
        if i == grad_index or any(v in from_grad for v in _vars(e.invars)):
            from_grad.update(e.outvars)
            continue
        if any(v in from_batch for v in _vars(e.invars)):
            from_batch.update(e.outvars)
            continue
        where = {home.get(v) for v in _vars(e.invars)} - {None}
        summary = (e.primitive.name in _SUMMARIES and home.get(e.invars[0]) is not None
                   and aval_bytes(e.invars[0].aval) >= 8 * sum(aval_bytes(v.aval) for v in e.outvars))
        if summary or i in pre and len(where) <= 1 and is_heavy(e):  # (else where its results go, if one stage)
            needed = set().union(*(feeds[o] for o in e.outvars))
            eqn_locs[i] = frozenset(where or (needed if len(needed) == 1 else {default_loc}))
            for v in e.outvars:
                avail[v] = eqn_locs[i]
    pinned = set(eqn_locs)
    anchored = set()
    for i, e in enumerate(eqns):
        if i == grad_index or i in pre:
            continue
        ins = [v for v in _vars(e.invars) if v in avail]
        small = sum(aval_bytes(v.aval) for v in ins)
        if not ins or small <= 64 and 8 * small <= sum(aval_bytes(v.aval) for v in e.outvars):
            continue  # (a scalar broadcast to a weight's shape, a penalty's backward: made where it is needed)
        weight = collections.Counter()
        for v in ins:
            for loc in avail[v]:
                weight[loc] += aval_bytes(v.aval) + 1
        for v in _vars(e.invars):  # (and values of weights that live on one stage: a penalty's backward goes there)
            if v not in avail and home.get(v) is not None:
                weight[home[v]] += aval_bytes(v.aval) + 1
        best = max(sorted(weight), key=lambda loc: weight[loc])
        eqn_locs[i] = frozenset({best})
        anchored.add(i)
        for v in e.outvars:
            avail[v] = eqn_locs[i]

    # Requirements flow backwards from anchored equations and the gradient's inputs.
    required: dict = collections.defaultdict(set)
    for v, locs in zip(grad.invars, grad_in_required):
        if not isinstance(v, Literal):
            required[v] |= set(locs)
    for v, loc in (anchors or {}).items():  # made where it lives
        required[v].add(loc)
    for i in anchored | pinned:
        for v in _vars(eqns[i].invars):
            if v not in avail:
                required[v] |= set(eqn_locs[i])
    floating = [i for i in range(len(eqns)) if i != grad_index and i not in anchored and i not in pinned]
    changed = True
    while changed:
        changed = False
        for i in reversed(floating):
            e = eqns[i]
            locs = set().union(*(required.get(v, set()) for v in e.outvars))
            if not locs:
                continue
            if frozenset(locs) != eqn_locs.get(i):
                eqn_locs[i] = frozenset(locs | eqn_locs.get(i, frozenset()))
                changed = True
            for v in _vars(e.invars):
                if v not in avail and not locs <= required[v]:
                    required[v] |= locs
                    changed = True
    # Equations nothing downstream requires (they only feed step outputs, e.g. Adam's count + 1 or the
    # carried PRNG key): computed wherever their inputs already are, so the output lands where the next
    # step will need the input again.
    where = {}
    for v in jaxpr.invars:
        if required.get(v):
            where[v] = frozenset(required[v])
    for i in floating:
        for v in eqns[i].outvars:
            if i in eqn_locs:
                where[v] = eqn_locs[i]
    # Constants (equations that read no step input or computed value, e.g. an update of jnp.zeros_like) go
    # where their readers run, placed after them.
    constant = set()
    for i in floating:
        if i not in eqn_locs and all(producer.get(v) in constant for v in _vars(eqns[i].invars)):
            constant.add(i)
    for i in floating:
        if i in eqn_locs or i in constant:
            continue
        e = eqns[i]
        locs = set().union(*(where.get(v, avail.get(v, frozenset())) for v in _vars(e.invars))) or {default_loc}
        eqn_locs[i] = frozenset(locs)
        for v in e.outvars:
            where[v] = eqn_locs[i]
        for v in _vars(e.invars):
            if v not in avail:
                required[v] |= locs
    for i in sorted(constant, reverse=True):
        e = eqns[i]
        eqn_locs[i] = frozenset(set().union(*(required.get(v, set()) for v in e.outvars)) or {default_loc})
        for v in e.outvars:
            where[v] = eqn_locs[i]
        for v in _vars(e.invars):
            required[v] |= eqn_locs[i]
    input_homes = {}
    for k, v in enumerate(jaxpr.invars):
        locs = frozenset(required.get(v, set()))
        if not batch_mask[k] and locs:
            input_homes[k] = locs
    for i in floating:
        for v in eqns[i].outvars:
            avail.setdefault(v, eqn_locs.get(i, frozenset()))

    # Phases: hops across locations before an equation can run there.
    phase: dict[tuple[int, int], int] = {}
    ready: dict[tuple, int] = {}

    def ready_at(v, loc):
        if (v, loc) in ready:
            return ready[(v, loc)]
        if v not in producer or producer[v] == grad_index:
            return 0
        src = [ready[(v, l)] for l in avail.get(v, ()) if (v, l) in ready]
        return (min(src) + 1) if src else 0

    for i, e in enumerate(eqns):
        if i == grad_index or i not in eqn_locs:
            continue
        for loc in sorted(eqn_locs[i]):
            p = max([ready_at(v, loc) for v in _vars(e.invars)], default=0)
            phase[(i, loc)] = p
            for v in e.outvars:
                ready[(v, loc)] = p
    _delay_local_work(eqns, pre | {grad_index}, eqn_locs, phase)
    out_locs = []
    for a in jaxpr.outvars:
        if isinstance(a, Literal):
            out_locs.append(None)
        elif a in avail and avail[a]:
            out_locs.append(avail[a])
        elif a in jaxpr.invars:
            k = jaxpr.invars.index(a)
            out_locs.append(input_homes.get(k))
        else:
            out_locs.append(frozenset({default_loc}))
    region = {i: ("pre" if i in pre else "post") for i in eqn_locs}
    return OuterPlacement(eqn_locs=eqn_locs, region=region, phase=phase, input_homes=input_homes,
                          out_locs=out_locs)


def _delay_local_work(eqns, fixed: set[int], eqn_locs: Mapping[int, frozenset[int]],
                      phase: dict[tuple[int, int], int]) -> None:
    """Move post-processing work that only its own location reads, and that makes values no smaller than what it
    reads, to the phase of its first reader (in place, in ``phase``). A phase hands its values to the next: an
    update split by a global norm computed ``b1 * mu``, ``b2 * nu`` and AdamW's ``wd * p`` before the norm was known
    and held them beside the state and parameters they came from until the next phase read them."""
    users = collections.defaultdict(list)
    for j, e in enumerate(eqns):
        for v in _vars(e.invars):
            users[v].append(j)
    last = collections.defaultdict(int)  # per location, its last phase
    for (_, loc), p in phase.items():
        last[loc] = max(last[loc], p)
    for i in range(len(eqns) - 1, -1, -1):
        e = eqns[i]
        locs = eqn_locs.get(i)
        if i in fixed or not locs or e.effects or sum(aval_bytes(v.aval) for v in e.outvars) < max(
                (aval_bytes(v.aval) for v in _vars(e.invars)), default=0):
            continue
        readers = [j for v in e.outvars for j in users[v]]
        if any(j in fixed or not eqn_locs.get(j) or not eqn_locs[j] <= locs for j in readers):
            continue  # (read elsewhere: it feeds a transfer, which its phase orders)
        for loc in locs:
            at = [phase[(j, loc)] for j in readers if (j, loc) in phase]
            phase[(i, loc)] = max(phase[(i, loc)], min(at, default=last[loc]))


_SUMMARIES = frozenset({"reduce_sum", "reduce_max", "reduce_min"})


def _homes(jaxpr: jex_core.Jaxpr, grad_index: int, grad_in_required: Sequence[frozenset[int]]) -> dict:
    """The one location each value computed outside the pipeline from weights comes from: a step input the gradient
    needs on one stage only, or a value computed from such inputs of one stage alone (``f * (w - w0) ** 2``)."""
    grad = jaxpr.eqns[grad_index]
    inputs = set(jaxpr.invars)
    home = {v: next(iter(locs)) for v, locs in zip(grad.invars, grad_in_required)
            if not isinstance(v, Literal) and v in inputs and len(locs) == 1}
    for i, e in enumerate(jaxpr.eqns):
        if i == grad_index:
            continue
        found = {home.get(v) for v in _vars(e.invars)} - {None}
        if len(found) == 1:
            home.update((v, next(iter(found))) for v in e.outvars)
    return home


_NOT_BOTH = frozenset({"while", "dot_general", "conv_general_dilated"})


def _not_both(jaxpr: jex_core.Jaxpr) -> bool:
    """Whether computing a branch that is not taken would cost or do too much: effects, loops that might not end on
    the other branch's values, matmuls (an evaluation every k steps would run every step)."""
    return any(e.effects or e.primitive.name in _NOT_BOTH or any(map(_not_both, jex_core.jaxprs_in_params(e.params)))
               for e in jaxpr.eqns)


def conds_as_selects(traced: TracedStep) -> TracedStep:
    """The step with each ``lax.cond`` after the gradient (an update taken every k steps, ``optax.MultiSteps``; one
    skipped on a non-finite gradient, ``optax.apply_if_finite``) computed as both branches and a select: one
    equation reading every parameter's gradient ran whole on one stage, which then held every parameter and its
    state (a user trial: 4.8x the peak memory of stage 0). As equations of their own, each parameter's part runs on
    its stage. Branches with effects, loops or matmuls stay a cond (:func:`_not_both`)."""
    jaxpr = traced.jaxpr.jaxpr
    derived = set(traced.grad_eqn.outvars)
    conds = set()
    for i, e in enumerate(jaxpr.eqns):
        if i > traced.grad_index and any(not isinstance(a, jex_core.Literal) and a in derived for a in e.invars):
            derived.update(e.outvars)
            if e.primitive.name == "cond" and not any(_not_both(b.jaxpr) for b in e.params["branches"]):
                conds.add(i)
    if not conds:
        return traced

    def both(i, eqn, invals):
        if i not in conds:
            return None
        index, *ops = invals
        branches = eqn.params["branches"]
        outs = [eval_closed(b, *ops) for b in branches]
        which = jnp.clip(index, 0, len(branches) - 1)
        return [jax.lax.select_n(which, *parts) for parts in zip(*outs)]

    avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype, weak_type=v.aval.weak_type) for v in jaxpr.invars]
    closed = jax.make_jaxpr(lambda *flat: eval_jaxpr_with(jaxpr, traced.jaxpr.consts, flat, both))(*avals)
    grad_index = next(i for i, e in enumerate(closed.jaxpr.eqns) if e.primitive is value_and_grad_p)
    return dataclasses.replace(traced, jaxpr=closed, grad_index=grad_index)


def label_outer(traced) -> tuple[dict, set]:
    """Which parameter each outer variable serves: the gradient equation's parameter inputs and gradients,
    the optimizer state of each parameter, and what the update computes from them (same shape); and which of
    them are optimizer state."""
    grad, spec, jaxpr = traced.grad_eqn, traced.spec, traced.jaxpr.jaxpr
    weights = [k for k, f in enumerate(traced.frozen_grad_inputs) if f or spec.diff_mask[k]]  # frozen ones too
    label = {}
    for k in weights:
        a = grad.invars[k]
        if not isinstance(a, Literal):
            label[a] = k
    outs = {1 + spec.num_aux + j: k for j, k in enumerate(spec.diff_indices)}
    for pos, k in outs.items():
        label[grad.outvars[pos]] = k
    zeroed = dict(traced.zeroed_gradients)  # a frozen weight's gradient the step still reads, as zeros
    label.update(zeroed)
    for i, k in optimizer_state_owners(jaxpr, traced.grad_index, outs, traced.batch_mask, zeroed).items():
        label.setdefault(jaxpr.invars[i], k)
    for i, e in enumerate(jaxpr.eqns):
        if i == traced.grad_index:
            continue
        for v in e.outvars:
            src = [label[a] for a in _vars(e.invars) if a in label and a.aval.shape == v.aval.shape]
            if src and v not in label:
                label[v] = src[0]
    # Optimizer state: labelled values that do not depend on a parameter itself (Adam's moments, and what an update
    # split into phases hands between them, ``b1 * mu`` before a global norm is known; the new parameter reads the
    # parameter). Under ZeRO-1 they are all sharded over data, so that a moment's buffer serves its next value.
    on_param = {grad.invars[k] for k in weights if not isinstance(grad.invars[k], Literal)}
    for i, e in enumerate(jaxpr.eqns):
        if i != traced.grad_index and any(a in on_param for a in _vars(e.invars)):
            on_param.update(e.outvars)
    grads = set(grad.outvars) | set(zeroed)
    return label, {v for v in label if v not in on_param and v not in grads}

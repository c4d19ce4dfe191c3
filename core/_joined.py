"""Examples joined with rows that are the same in every microbatch, followed through the loss.

Experience replay often runs one forward pass over ``[examples; replay rows]``: the replay rows are drawn in the step
and read whole by every microbatch. Row by row (a model applied to each row) that is as under ``jax.jit``; sliced
back apart (``z[:n]`` for the examples, ``z[n:]`` for the replay rows, DER++), each part is what it is alone: the
examples split with the batch, the replay rows the same in every microbatch. Combined across both (a sum or mean
over ``[examples; replay rows]``), every microbatch counts the replay rows again, which no combination of the
microbatches' losses undoes: :func:`follow_joined` says so there (:data:`~autopp.core._mixing.JOINED`).
"""

from __future__ import annotations

import threading
from fractions import Fraction

from jax.extend import core as jex_core

AFTER = "after"
"""A value computed from a combination across joined rows (its state is none: nothing more to say of it)."""
APART = "apart"
"""Key of :func:`follow_joined`'s dict holding the values computed from joined rows taken apart (the replay rows
alone, the same in every microbatch by their values, though they come out of the examples' forward)."""
_TOP = threading.local()


def new_joined(top: bool) -> dict:
    """The dict :func:`follow_joined` fills for one program; the outermost one is kept for :func:`sums_apart`."""
    joined: dict = {APART: set()}
    if top:
        _TOP.joined = joined
    return joined


def fractional(b) -> bool:
    """Whether a power of the batch size is a fractional one (its square root, by which no reduction divides)."""
    return isinstance(b, Fraction) and b.denominator != 1


def sums_apart(kinds: tuple, states: list, jaxpr, lost: list | None) -> tuple:
    """``kinds`` with each output that is a sum over the examples and reads rows taken apart from the examples' (a
    replay part summed) said as no combination: the microbatches' sums would count those rows in each, and the terms
    the step counts once are found by what reads the batch (``autopp.core.scale_batch_independent_terms``), which
    these rows do. A mean counts them as jit does (the microbatches' values averaged)."""
    apart = _TOP.__dict__.pop("joined", {}).get(APART, set())  # (the walk's, released with its program's variables)
    made = {v: (i, e) for i, e in enumerate(jaxpr.eqns) for v in e.outvars}
    kinds = list(kinds)
    for k, (v, kind) in enumerate(zip(jaxpr.outvars, kinds)):
        if kind == "sum" and not isinstance(v, jex_core.Literal) and v in apart:
            kinds[k], states[k] = None, None
            if lost is not None and v in made:
                lost.append((JOINED_SUM, made[v][1], made[v][0]))
    return tuple(kinds)


JOINED_SUM = ("adds up rows taken apart from the examples' (replay rows run through the model with the batch, then "
              "sliced off), which each microbatch counts again: run them through the model in a call of their own, "
              "or take their mean")


def _operands(me, ins: list) -> tuple[int, list, list]:
    """(axis, the operands split with the batch along it, those that do not depend on the batch) of a
    concatenation; ``ins``: each operand's (state, batch axes)."""
    axis = me.params["dimension"]
    return (axis, [k for k, (st, axes) in enumerate(ins) if st is not None and st[2] and axis in axes],
            [k for k, (st, axes) in enumerate(ins) if st == (0, 0, False) and axis not in axes])


def unfollowed_join(we, me, ins: list) -> bool:
    """Whether ``me`` joins the examples with rows the same in every microbatch in a way :func:`follow_joined` does
    not follow (two parts of the examples beside them): said at once as no combination."""
    if me.primitive.name != "concatenate":
        return False
    _, examples, whole = _operands(me, ins)
    return bool(examples and whole) and joined_parts(we, me, ins) is None


def joined_parts(we, me, ins: list):
    """(axis, the examples' rows at the whole batch, at the microbatch) of a concatenation of the examples (one
    operand split with the batch) with rows the same in every microbatch (operands that do not depend on it), or
    None."""
    if me.primitive.name != "concatenate":
        return None
    axis, examples, whole = _operands(me, ins)
    if len(examples) != 1 or len(examples) + len(whole) != len(ins):
        return None
    k = examples[0]

    def rows(eqn):
        start = sum(a.aval.shape[axis] for a in eqn.invars[:k])
        return start, start + eqn.invars[k].aval.shape[axis]

    return axis, rows(we), rows(me)


def _pieces(we, me, axis: int):
    """Per output of a slice or split along ``axis``: (its rows at the whole batch, at the microbatch); None for
    another equation."""
    name = me.primitive.name
    if name == "slice" and not any(s not in (None, 1) for s in (me.params.get("strides") or ())):
        return [tuple((e.params["start_indices"][axis], e.params["limit_indices"][axis]) for e in (we, me))]
    if name == "split" and me.params["axis"] == axis:
        def bounds(eqn):
            starts = [sum(eqn.params["sizes"][:i]) for i in range(len(eqn.params["sizes"]))]
            return [(s, s + n) for s, n in zip(starts, eqn.params["sizes"])]
        return list(zip(bounds(we), bounds(me)))
    return None


def follow_joined(joined: dict, we, me, ins: list, outs: list, out_axes: list) -> tuple[list, str | None]:
    """Follow the joined rows through equation ``me`` (``we`` at the whole batch): ``joined`` maps a variable of
    ``me``'s program to (axis, the examples' rows at the whole batch, at the microbatch), or to :data:`AFTER`.
    Returns the equation's output states (``outs``, changed where a part is sliced out or the rows are combined)
    and what happened: ``"joined"`` (the concatenation), ``"separated"`` (a slice of one part: the examples' rows
    stay the examples', the other rows are the same in every microbatch), ``"combined"`` (a combination across
    both parts: undetermined, said as :data:`~autopp.core._mixing.JOINED`), or None."""
    if any(not isinstance(a, jex_core.Literal) and a in joined[APART] for a in me.invars):
        joined[APART].update(me.outvars)
    read = [a for a in me.invars if not isinstance(a, jex_core.Literal) and a in joined]
    if not read:
        parts = joined_parts(we, me, ins)
        if parts is None:
            return outs, None
        joined.update((v, parts) for v in me.outvars)
        return outs, "joined"
    infos = [joined[a] for a in read]
    if any(info == AFTER for info in infos):
        joined.update((v, AFTER) for v in me.outvars)
        return outs, None
    axis, whole_rows, micro_rows = infos[0]
    pieces = _pieces(we, me, axis) if len(read) == 1 and me.invars[0] is read[0] else None
    if pieces is not None:
        outs = list(outs)
        for k, ((w0, w1), (m0, m1)) in enumerate(pieces):
            if (w0, w1) == whole_rows and (m0, m1) == micro_rows:
                continue  # the examples alone
            if w1 <= whole_rows[0] or w0 >= whole_rows[1]:
                if (m1 <= micro_rows[0] or m0 >= micro_rows[1]) and w1 - w0 == m1 - m0:
                    outs[k] = (0, 0, False)  # the other rows alone: the same in every microbatch
                    joined[APART].add(me.outvars[k])
                    continue
            joined[me.outvars[k]] = (axis, tuple(r - w0 for r in whole_rows), tuple(r - m0 for r in micro_rows))
        return outs, "separated"
    if all(axis in axes for axes in out_axes):  # row by row (a model applied to each row)
        joined.update((v, infos[0]) for v in me.outvars)
        return outs, None
    joined.update((v, AFTER) for v in me.outvars)
    return [None] * len(outs), "combined"


def after_joined(joined: dict, eqn) -> bool:
    return any(joined.get(v) == AFTER for v in eqn.outvars)

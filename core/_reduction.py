"""How a loss combines its examples, read off its program: is it a mean over the batch or a sum?

Microbatching a loss gives one value per microbatch. ``jax.jit`` of the step computes the loss once over the whole
batch; the microbatch values add up to that only if the loss is a *sum* over examples times factors that do not
depend on how many examples it sees (``sum(nll * w)`` with weights normalised in the step, ``sum(nll) / n`` with a
token count ``n`` taken from the whole batch), and average to it only if it is a *mean* (divided by a count of its
own examples: ``jnp.mean``, ``/ x.shape[0]``). A sum over examples divided by another sum over them (a masked token
mean inside the loss, ``sum(nll * mask) / mask.sum()``) is neither: :func:`output_reductions` calls it a
``"ratio"``, which averaged over microbatches differs from jit's whole-batch ratio when microbatches differ.

:func:`output_reductions` tells them apart from two traces of the same loss: at the whole batch and at one
microbatch. Walking both programs in step, every value gets a pair ``(s, b)``: ``s`` is how many times examples of
the batch were added up into it (0 for a per-example value, 1 after a sum over the batch axis) and ``b`` the power of
the batch size it is multiplied by, through literals that differ between the two traces exactly by the number of
microbatches (``jnp.mean``'s divisor: ``b = -1``). A loss of ``(1, -1)`` is a mean, ``(1, 0)`` a sum. A maximum
(minimum) over examples, through operations that keep order, is ``"max"`` (``"min"``): an aux value the runtime
combines by its maximum (a loss cannot be: its gradient is no combination of the microbatches'). Anything else (a
logarithm of a sum, programs that differ in structure between the two sizes) is left undetermined (None), and the
caller's ``loss_reduction`` stands; a statistic broadcast back is read on as if the step had passed it (and said).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Sequence
from fractions import Fraction

import numpy as np
from jax.extend import core as jex_core

from autopp.core._batch_parts import (FIRST, ORDER, PARTS, STRIDES, batch_parts, call_values, examples_blocks,
                                     indexes_the_batch, seed_values)
from autopp.core._joined import after_joined, follow_joined, fractional, new_joined, sums_apart, unfollowed_join
from autopp.core._mixing import (_ADD, _GUARD, _MIX_ALONG, _RANDOM, _MAX, _MIN, _MIXED, _RATIO, _RATIO_SUM, _READABLE,
                                 _SHARE, _TEST, CONTROL, DRAWS, note_choice, note_part, INDEXED, JOINED, PAIRS,
                                 POSITIONS, SIZE, SIZED, SPREAD, decides_by_statistic, loop_test, lost_reason,
                                 mixing_by_output, mixes, mixing_summary, settle_shares, share_rule, uses_size)

__all__ = ["CONTROL", "DRAWS", "FIRST", "INDEXED", "ORDER", "PAIRS", "PARTS", "POSITIONS", "SIZE", "SIZED",
           "SPREAD", "STRIDES", "STRUCTURE", "mixing_by_output", "mixing_summary", "output_reductions"]


_State = tuple  # (s, b, depends on a microbatched input); None: undetermined
STRUCTURE = -1  # in output_reductions' undetermined list: the programs at the two batch sizes differ in structure

# elementwise or layout operations that carry their operand's (s, b) unchanged
_CARRY = frozenset({
    "neg", "convert_element_type", "reshape", "broadcast_in_dim", "squeeze", "expand_dims", "transpose", "copy",
    "copy_p", "reduce_precision", "slice", "dynamic_slice", "gather", "rev", "real", "imag", "conj", "pjit_sharding",
    "sharding_constraint", "mesh_cast", "optimization_barrier", "abs", "reduce_max", "reduce_min", "stop_gradient"})
_CASTS = frozenset({"convert_element_type", "reshape", "squeeze", "expand_dims", "copy", "copy_p"})
_SAME = frozenset({"max", "min", "select_n", "concatenate", "stack", "clamp", "pad", "dynamic_update_slice"})
_ORDERED_REDUCE = frozenset({"reduce_max", "reduce_min", "argmax", "argmin", "reduce_prod", "reduce_and",
                             "reduce_or", "reduce_xor"})
_LIN = frozenset({"dot_general"})


class _Mismatch(Exception):
    """The two traces differ in structure: nothing can be said."""


def output_reductions(whole: jex_core.ClosedJaxpr, micro: jex_core.ClosedJaxpr, microbatched: Sequence[bool],
                      num_microbatches: int, mixing: list | None = None,
                      undetermined: list | None = None, lost: list | None = None,
                      microbatches_run: int | None = None, blocks: dict | None = None,
                      parts: list | None = None) -> tuple[str | None, ...]:
    """Per output of the loss's forward: ``"mean"`` when it is a mean over the batch's examples, ``"sum"`` when it is
    a sum over them, ``"ratio"`` for a sum divided by another, ``"mixed"`` for a sum plus a mean (no count of
    microbatches combines those), ``"max"`` / ``"min"`` for a maximum / minimum over
    them, None when none can be shown. ``mixing``: a list to which the equations that make one example's value
    depend on other examples of the batch are appended, as ``(why, equation)`` (``why``: :data:`PAIRS`,
    :data:`SPREAD`, :data:`ORDER` or :data:`DRAWS`): there each microbatch's loss differs from the whole batch's
    by more than how its examples are combined. ``whole`` and ``micro``: the same loss traced at the whole batch and
    at one of ``num_microbatches`` microbatches; ``microbatched``: per input, whether it is split. Each mixing entry
    also names the equation of ``micro``'s own program that holds it (its index there: an equation inside a call, a
    scan or a branch is found where that is). ``undetermined``: a list to which the positions of the outputs that
    depend on the split inputs but are none of those combinations are appended (a logarithm of a mean, a median, one
    example's value): their microbatches' values combine to no value over the whole batch; :data:`STRUCTURE` where
    the two programs differ in structure (a loop over the examples unrolled: nothing can be said of any output).
    ``lost``: a list to which the equations of ``micro``'s outermost program where a value depending on the batch
    stops being any of those combinations are appended, as ``(what it does, equation, its index)``: where a warning
    about an undetermined loss points. ``microbatches_run``: how many microbatches the step runs, where ``micro`` is
    traced at a larger fraction of the batch (it decides whether a k-th-example slice fits each microbatch).
    ``blocks``: a dict to which ``{output position: lengths}`` is added for each output whose leading axis holds
    several blocks of the examples in order (an aux of ``[chosen; rejected]`` concatenated, time-major rows
    ``[T * B]``), with each block's length in the whole batch: its microbatches' values interleave block by block
    into the whole batch's (read only when ``mixing`` is given). ``parts``: a list to which each addition of a mean
    or a sum over the examples to a term whose combination cannot be read is appended, as ``(kind, equation, index)``
    (a mixture of experts' load-balancing term added to a mean): that part is a ``kind`` whatever the rest is."""
    _MIXING.events, _MIXING.lost, _MIXING.depth, _MIXING.parts = mixing, lost, 0, parts
    _MIXING.microbatches, _MIXING.blocks = microbatches_run or num_microbatches, blocks
    try:
        states = _walk(whole.jaxpr, micro.jaxpr, list(whole.consts), list(micro.consts),
                       [(0, 0, bool(m)) for m in microbatched], num_microbatches)
    except _Mismatch:  # (whether an output depends on the batch is not known either)
        if undetermined is not None:
            undetermined.append(STRUCTURE)
        return (None,) * len(micro.jaxpr.outvars)
    finally:
        _MIXING.events = _MIXING.lost = _MIXING.microbatches = _MIXING.blocks = _MIXING.parts = None
    names = {-1: "mean", 0: "sum", _RATIO: "ratio", _MAX: "max", _MIN: "min", _MIXED: "mixed", _RATIO_SUM: "ratio+sum"}
    kinds = tuple("sum" if st == (0, 1, False)  # (a constant summed over the examples: ones(B).sum() * c)
                  else None if st is None or not st[2] or st[0] != 1 else names.get(st[1]) for st in states)
    kinds = sums_apart(kinds, states, micro.jaxpr, lost)  # (replay rows taken apart from the examples', summed)
    if lost is not None:  # an output that ends a function of a sum or mean (sqrt(mse.mean()), mean ** 2)
        made = {v: (i, e) for i, e in enumerate(micro.jaxpr.eqns) for v in e.outvars}
        for v, st, kind in zip(micro.jaxpr.outvars, states, kinds):
            if kind is None and st is not None and st[2] and v in made:
                i, e = made[v]
                lost.append((f"applies {_READABLE.get(e.primitive.name, e.primitive.name)} to a sum or mean over "
                             "the examples" if st[0] else "keeps a value of single examples (one example's, not a "
                             "mean or sum over them)", e, i))
    if undetermined is not None:
        undetermined.extend(k for k, (st, kind) in enumerate(zip(states, kinds)) if kind is None
                            and (st is None or st[2]))
    return kinds


def _walk(w: jex_core.Jaxpr, m: jex_core.Jaxpr, w_consts: list, m_consts: list, in_states: list,
          M: int, in_segments: list | None = None, in_positions: list | None = None, in_values=None) -> list:
    if len(w.eqns) != len(m.eqns) or len(w.invars) != len(m.invars) or len(in_states) != len(m.invars):
        raise _Mismatch
    env: dict = {}  # micro var -> (state, batch axes)
    for wv, mv, st in zip(w.invars, m.invars, in_states):
        env[mv] = (st, _batch_axes(wv, mv))
    for wv, mv, wc, mc in zip(w.constvars, m.constvars, w_consts, m_consts):
        env[mv] = (_const_state(wc, mc, M), _batch_axes(wv, mv))

    top = _MIXING.depth == 0
    _MIXING.depth += 1
    positions: dict = {}  # values computed from the examples' positions (jnp.arange along the batch axis) -> where
    segments: dict = {}  # values whose batch axis holds several segments of rows (autopp.core._batch_parts)
    firsts: dict = {}  # values read off a fixed number of examples (x[0]), not yet combined with the others'
    joined = new_joined(top)  # values of the examples joined with rows the same in every microbatch (core._joined)
    segments.update((v, g) for v, g in zip(m.invars, in_segments or ()) if g)
    seed_values(segments, w, m, w_consts, m_consts, in_values)  # (index arrays: constants, a call's operands)
    positions.update((v, p) for v, p in zip(m.invars, in_positions or ()) if p)  # (a call's operands')
    depends = {v for v, st in zip(m.invars, in_states) if st is None or st[2]}  # on the batch, whatever the state
    users, pending = {a: e for e in m.eqns for a in e.invars if not isinstance(a, jex_core.Literal)}, {}  # (a reader
    # of each value; the mixing said of examples' shares of a sum, held until they are summed: core._mixing)

    def read(wa, ma):
        if isinstance(ma, jex_core.Literal):
            if not isinstance(wa, jex_core.Literal):
                raise _Mismatch
            return _const_state(wa.val, ma.val, M), ()
        return env[ma]

    for at, (we, me) in enumerate(zip(w.eqns, m.eqns)):
        if top:
            _MIXING.top = at
        if we.primitive is not me.primitive or len(we.invars) != len(me.invars) or len(we.outvars) != len(me.outvars):
            raise _Mismatch
        ins = [read(a, b) for a, b in zip(we.invars, me.invars)]
        call = _is_call(me)
        if call:  # a call's body sees the segments of its operands, and its results get the body's
            _MIXING.call_in = [(None, None) if isinstance(a, jex_core.Literal) else (segments.get(a), positions.get(a))
                               for a in me.invars]
            _MIXING.call_values, _MIXING.call_out = call_values(we, me, segments), None  # (out: set by its walk)
        outs = _rule(we, me, ins, M)
        if (getattr(_MIXING, "parts", None) is not None and me.primitive.name in _ADD and outs == [None]
                and not any(ax for _, ax in ins)):  # (terms of the loss, not a statistic spread over the examples)
            _MIXING.parts.extend(("mean" if st[1] == -1 else "sum", me, _MIXING.top) for st, _ in ins
                                 if st is not None and st[2] and st[0] == 1 and st[1] in (-1, 0))
        _MIXING.__dict__.pop("call_in", None), _MIXING.__dict__.pop("call_values", None)  # (left unwalked)
        returned = _MIXING.__dict__.pop("call_out", None) if call else None
        positions.update((v, p) for v, (_, p) in zip(me.outvars, returned or ()) if p)  # (an argsort's indices)
        out_axes = [_batch_axes(wv, mv) for wv, mv in zip(we.outvars, me.outvars)]
        outs, joining = follow_joined(joined, we, me, ins, outs, out_axes)  # (replay rows beside the examples)
        for mv, st, axes in zip(me.outvars, outs, out_axes):
            env[mv] = (st, axes)
        read_batch = [a for a in me.invars if not isinstance(a, jex_core.Literal) and a in depends]
        if read_batch:
            depends.update(me.outvars)
        events = getattr(_MIXING, "events", None)
        if events is not None:
            by_position = _by_position(we, me, ins, out_axes, positions, _MIXING.top)  # (followed whatever else)
            why = (batch_parts(we, me, ins, out_axes, segments, getattr(_MIXING, "microbatches", None))
                   or (CONTROL if decides_by_statistic(we, me, ins, firsts) else None)
                   or mixes(me, ins, out_axes, _MIXING.__dict__.pop("recurrence", None) is me)
                   or by_position
                   or (SPREAD if any(out_axes) and any((env[a][0] is None or env[a][0][1] == _TEST)
                                                       and not env[a][1] and a not in firsts
                                                       for a in read_batch) else None)  # (x * tanh(x.mean(0)))
                   or (SIZE if any(o is not None and o[2] and not o[0] and fractional(o[1]) for o in outs)  # (sqrt(B)
                       and not any(st is not None and st[2] and fractional(st[1]) for st, _ in ins) else None)  # met)
                   or (SIZE if any(o is None for o in outs) and uses_size(me, ins, depends)
                       and not after_joined(joined, me)
                       and not any(a in positions for a in me.invars if not isinstance(a, jex_core.Literal))
                       else None))
            why = {"combined": JOINED, "separated": None}.get(joining, why)  # (a slice of one part: that part)
            if why == FIRST or any(not isinstance(a, jex_core.Literal) and a in firsts for a in me.invars):
                # some examples' values (x[0]): said where they meet the examples' own (nll / temp[0]); an aux that
                # is one example's value alone is said otherwise (no combination of the microbatches gives it)
                others = [(st, ax) for a, (st, ax) in zip(me.invars, ins)
                          if not isinstance(a, jex_core.Literal) and a not in firsts]
                if why != FIRST and (any(st is None or st[2] or ax for st, ax in others) or any(out_axes)):
                    why = why or FIRST  # (scaling the reduced loss, mean / w[0], counts too)
                else:
                    firsts.update((v, me) for v in me.outvars)
                    why = None if why == FIRST else why
            why = settle_shares(pending, me, outs, why, users, events, _MIXING.top)  # (held while summed)
            if why:
                events.append((why, me, _MIXING.top))
            if why == SPREAD:  # read on as each example's value, as if the statistic came from the step (as said)
                env.update((v, ((0, 0, True), ax)) for v, o, ax in zip(me.outvars, outs, out_axes) if o is None and ax)
            for v, (g, _) in zip(me.outvars, returned or ()):
                if g:
                    segments[v] = g
        lost = getattr(_MIXING, "lost", None)
        if (lost is not None and top and any(o is None for o in outs) and joining != "combined"
                and all(st is not None for st, _ in ins) and any(st[2] for st, _ in ins)):
            lost.append((lost_reason(me, [st for st, _ in ins]), me, at))

    events = getattr(_MIXING, "events", None)
    if top and events is not None:  # positions that reach an output as values: weights, masks by position
        events.extend(e for v in m.outvars if not isinstance(v, jex_core.Literal) for e in pending.get(v, ())
                      if e not in events)
        for v in m.outvars:
            if not isinstance(v, jex_core.Literal) and v in positions:
                events.append((POSITIONS, *positions[v]))
        if getattr(_MIXING, "blocks", None) is not None:
            _MIXING.blocks.update((k, examples_blocks(segments[v])) for k, v in enumerate(m.outvars)
                                  if not isinstance(v, jex_core.Literal) and v in segments and env[v][1][:1] == (0,)
                                  and examples_blocks(segments[v]))
    if not top:
        _MIXING.call_out = [(None, None) if isinstance(v, jex_core.Literal) else (segments.get(v), positions.get(v))
                            for v in m.outvars]
    _MIXING.depth -= 1
    return [read(wa, ma)[0] for wa, ma in zip(w.outvars, m.outvars)]


def _by_position(we, me, ins: list, out_axes: list, positions: dict, at_top: int) -> str | None:
    """Follow the values made from the examples' positions in the batch (``jnp.arange`` along the batch axis: a
    microbatch numbers its own examples from 0); :data:`POSITIONS` where one indexes an array that is not split with
    the batch (a row weight passed whole, read as ``w[jnp.arange(B)]``; document ids ``seg + 5 * arange(B)`` summed
    into a fixed number of segments), where a slice of such an array as long as the batch is read
    (``lax.dynamic_slice(w, (0,), (B,))``), or (by :func:`_walk`) where positions reach an output as values (weights
    or a padding mask by position, ``jnp.arange(B) < n_valid``). Indexing the batch's own arrays by them
    (``s[jnp.arange(B), last]``) is each example's own row."""
    name = me.primitive.name
    if name == "iota":
        if me.params.get("dimension") in out_axes[0]:
            positions.update((v, (me, at_top)) for v in me.outvars)
        return None
    if name == "dynamic_slice" and not ins[0][1] and out_axes[0]:
        return POSITIONS
    read = [k for k, a in enumerate(me.invars) if not isinstance(a, jex_core.Literal) and a in positions]
    if (name == "gather" or name.startswith("scatter")) and 1 not in read and indexes_the_batch(me, ins):
        return INDEXED  # x[idx] with idx from the batch: another example's position in the whole batch
    if not read:
        _fold_scalar(me, positions)
        return None
    at = _INDEX_OPERANDS_FROM.get(name)
    modulo = name == "rem" or name in ("pjit", "jit") and me.params.get("name") == "remainder"  # (jnp's %)
    divisor = _scalar_value(me.invars[1], positions) if modulo and len(me.invars) == 2 else None
    if divisor is not None and read == [0] and ins[0][1] and np.issubdtype(me.invars[0].aval.dtype, np.integer):
        k, d = int(divisor), ins[0][1][0]  # a position's parity (jnp.arange(B) % 2): the same in each
        rows = [me.invars[0].aval.shape[d], we.invars[0].aval.shape[d] // (getattr(_MIXING, "microbatches", 0) or 1)]
        if k > 0 and all(r % k == 0 for r in rows):  # microbatch as in the whole batch when k divides its size
            return None
    if at is None:  # arithmetic on positions: still positions (said where they were made: the jnp.arange)
        positions.update((v, positions[me.invars[read[0]]]) for v in me.outvars)
        return ORDER if name == "rev" and set(me.params["dimensions"]) & set(out_axes[0]) else None
    indexes = [k for k in read if k >= at and not (name.startswith("scatter") and k > at)]
    whole = not ins[0][1] and (not out_axes[0] or not name.startswith(("scatter", "dynamic_update")))
    return POSITIONS if indexes and whole else None


_SCALARS = "scalars"  # key of the positions dict holding scalars computed from literals alone (a divisor: jnp's %)


def _fold_scalar(me, positions: dict) -> None:
    """Evaluate a scalar equation of literals and such scalars (the divisor ``jnp.remainder`` makes of its ``2``)."""
    known = positions.setdefault(_SCALARS, {})
    if (me.effects or next(jex_core.jaxprs_in_params(me.params), None) is not None or len(me.outvars) != 1
            or getattr(me.outvars[0].aval, "shape", None) != () or me.primitive.name in _RANDOM):
        return
    values = [_scalar_value(a, positions) for a in me.invars]
    if all(v is not None for v in values):
        try:
            known[me.outvars[0]] = np.asarray(me.primitive.bind(*values, **me.params))
        except Exception:  # noqa: BLE001 - a primitive that cannot run on host scalars: not folded
            pass


def _scalar_value(a, positions: dict):
    literal = isinstance(a, jex_core.Literal)
    return (np.asarray(a.val) if np.ndim(a.val) == 0 else None) if literal else positions.get(_SCALARS, {}).get(a)


_MIXING = threading.local()  # .events: mixing equations (None: not recorded); .depth, .top: the walk's place


def _batch_axes(wv, mv) -> tuple[int, ...]:
    ws, ms = getattr(wv.aval, "shape", ()), getattr(mv.aval, "shape", ())
    if len(ws) != len(ms):
        raise _Mismatch
    return tuple(d for d, (a, b) in enumerate(zip(ws, ms)) if a != b)


def _const_state(wval, mval, M: int):
    """A literal or constant: batch-independent when equal in both traces, the batch size to the power +-1 when the
    whole batch's is M times (or 1/M times) the microbatch's, else undetermined."""
    try:
        a, b = np.asarray(wval), np.asarray(mval)
    except Exception:  # noqa: BLE001 - e.g. a key: no number to compare
        return (0, 0, False)
    if a.shape != b.shape:
        raise _Mismatch
    if a.dtype == object or not np.issubdtype(a.dtype, np.number):
        return (0, 0, False) if np.array_equal(a, b) else None
    if np.array_equal(a, b, equal_nan=np.issubdtype(a.dtype, np.inexact)):  # (a NaN literal: a masked fill)
        return (0, 0, False)
    if a.size != 1:
        return None
    x, y = float(a.reshape(())), float(b.reshape(()))
    if x != 0 and y != 0 and x / y > 0:  # the batch size to a power: B ** 2, 1 / B
        k = round(np.log(x / y) / np.log(M))
        if k and np.isclose(x / y, float(M) ** k, rtol=1e-6):
            return (0, k, False)
    return None


_EXTREME_OF = {"reduce_max": _MAX, "reduce_min": _MIN, "reduce_or": _MAX, "reduce_and": _MIN}  # (any, all)
# what keeps a maximum over examples the maximum of the microbatches' values: relabelling, slicing, widening
_STACKS = frozenset({"concatenate", "stack"})  # (maxima stacked into one vector: each entry combined by its maximum)
_KEEPS_ORDER = frozenset({"convert_element_type", "reshape", "broadcast_in_dim", "squeeze", "expand_dims",
                          "transpose", "copy", "copy_p", "slice", "pjit_sharding", "sharding_constraint",
                          "optimization_barrier", "stop_gradient", "reduce_precision"})


def _extreme(name: str, states: list, n_out: int) -> list:
    """The rule of an equation reading a maximum or minimum over examples: it stays one through operations that
    keep order (and a max of maxima, a constant added), else nothing can be said."""
    kinds = {st[1] for st in states if st[1] in (_MAX, _MIN)}
    others_constant = all(st[1] in (_MAX, _MIN) or st[:3] == (0, 0, False) for st in states)
    if len(kinds) != 1 or not others_constant:
        return [None] * n_out
    kind = kinds.pop()
    first = states[0][1] == kind
    alone = sum(st[1] == kind for st in states) == 1  # a constant added to it (not another maximum)
    if (name in _KEEPS_ORDER or name == "add" and alone or name == "sub" and first and alone or name in _STACKS
            or name in ("max", "reduce_max") and kind == _MAX or name in ("min", "reduce_min") and kind == _MIN):
        return [(1, kind, True)] + [(0, 0, False)] * (n_out - 1)
    return [None] * n_out


def _whole(x):
    """A power that :func:`_rule` gives as a fraction (of a square root), as an int where it is one."""
    return int(x) if isinstance(x, Fraction) and x.denominator == 1 else x


# operations whose operands from a position on are indices: where they read decides nothing of how the values they
# read combine examples (``s[jnp.arange(B), last]`` picks each example's value; the index arithmetic that wraps
# negative indices, ``i + B``, has no state of its own)
_INDEX_OPERANDS_FROM = {"gather": 1, "dynamic_slice": 1, "dynamic_update_slice": 2, "scatter-add": 1,
                        "scatter_add": 1, "scatter": 1, "scatter-max": 1, "scatter-min": 1, "scatter-mul": 1}


def _rule(we, me, ins: list, M: int) -> list:
    name = me.primitive.name
    n_out = len(me.outvars)
    at = _INDEX_OPERANDS_FROM.get(name)
    if at is not None:  # an index that depends on the batch still makes the result depend on it
        ins = [(st, ax) if k < at or (name.startswith("scatter") and k > at) else ((0, 0, st is None or st[2]), ax)
               for k, (st, ax) in enumerate(ins)]
    states = [st for st, _ in ins]
    if name in ("device_put", "optimization_barrier") and len(states) == n_out:  # each operand as it is (several
        return states  # at once in JAX's own solvers: a batched residual beside a scalar tolerance)
    if name == "select_n" and not ins[0][1] and me.invars[0].aval.dtype == np.bool_:
        # one flag for the whole value (a NaN guard: optax's where(isnan(mean) & ~any(isnan(x)), 0, mean)): what it
        # picks between decides, whatever the flag is made of
        data = states[1:]
        note_choice(getattr(_MIXING, "parts", None), me, data, getattr(_MIXING, "top", None))
        if states[0] is not None and states[0][1] == _TEST and any(st is None or st[0] for st in data):
            return [None]  # a mean chosen by a test of it (free bits: where(kl.mean() > c, kl.mean(), c))
        if all(st is not None and st[1] not in (_MAX, _MIN) for st in data):
            dep = any(st[2] for st in data) or states[0] is None or states[0][2]
            keys = {st[:2] for st in data if st[2] or st[:2] != (0, 0)}
            if (1, _RATIO) in keys and keys <= {(1, _RATIO), (1, 0), (1, -1)}:  # a ratio guarded against an empty
                return [(1, _RATIO, True)]  # count: where(n == 0, neg_sum, (pos + neg) / max(n, 1)), CenterNet's
            return [(*keys.pop(), dep) if len(keys) == 1 else ((0, 0, dep) if not keys else None)]
    if name == "div" and states[1] is not None and states[1][1] == _GUARD and states[0] is not None and (
            states[0][0] or states[0][:2] == (0, 0)):  # (a sum over a count guarded against zero: sum(nll * m) /
        return [(1, _RATIO, True) if states[0][0] else (0, _SHARE, True)]  # max(m.sum(), 1); each token over it)
    if name in _CASTS and len(states) == 1 and states[0] is not None and states[0][1] == _GUARD:
        return states  # (an integer count guarded, then made a float: max(valid.sum(), 1).astype(f32))
    if any(st is None or st[1] in (_TEST, _GUARD) for st in states):  # (a test of a mean, or a clamped sum, used
        return [None] * n_out  # otherwise: no combination)
    dep = any(st[2] for st in states)
    if name in ("gt", "ge", "lt", "le") and (1, -1, True) in states:  # a mean compared with a level
        return [(0, _TEST, True)]
    if any(st[1] in (_MAX, _MIN) for st in states) and name not in ("while", "scan", "cond"):  # (a loop's bound)
        return _extreme(name, states, n_out)
    if any(st[1] == _SHARE for st in states):  # examples' shares of a sum over them (t5x's nll * w / w.sum())
        return share_rule(me, ins, n_out, _CARRY, _dot)
    # a ratio (a mixture) goes on only scaled by, or added to, a constant; a ratio also added to a mean, which
    # averages exactly (BERT's masked-token mean plus its next-sentence loss's mean): a ratio still
    for odd in (_RATIO, _MIXED, _RATIO_SUM):
        if any(st[1] == odd for st in states):
            constant = all(st[1] == odd or st[:3] == (0, 0, False)  # (or a sum over a count from the step: DETR's
                           or name in _ADD and st[:2] in ((1, -1), (1, 0)) for st in states)  # boxes; mean + sum + sum)
            if constant and (name in _ADD or name == "mul" or name == "div" and states[0][1] == odd or name in _CARRY
                             or name in ("reduce_sum", "concatenate", "stack")):  # (weighted, stacked, summed)
                odd = _RATIO_SUM if odd == _RATIO and name in _ADD and (1, 0, True) in states else odd  # (beside a
                if odd == _RATIO and name in _ADD and (1, -1, True) in states:  # (ESMM's CVR ratio + CTR mean)
                    note_part(getattr(_MIXING, "parts", None), "beside a mean", me, getattr(_MIXING, "top", None))
                return [(1, odd, True)] + [(0, 0, dep)] * (n_out - 1)  # sum: neither combination is jit's)
            return [None] * n_out
    if name in _ADD:
        live = [st for st in states if st[2] or st[:2] != (0, 0)]
        # (a constant summed over the examples, the batch size times it, added to the examples' sum: nll_i - c summed)
        keys = {(1, 0) if st[:3] == (0, 1, False) and dep else st[:2] for st in live}
        if len(keys) > 1:
            # a batch-independent term added to a sum or a mean (a weight penalty; a KL scaled by the batch size,
            # kl / B): the dependent part decides (counted_once scales such a term to count as jit counts it)
            dependent = {st[:2] for st in live if st[2]}
            keys = dependent if len(dependent) == 1 and all(st[0] == 0 for st in live if not st[2]) else keys
            if keys == {(1, 0), (1, -1)} and all(st[2] for st in live):  # a sum plus a mean (a z-loss's .mean())
                return [(1, _MIXED, True)]
        return [(*keys.pop(), dep) if len(keys) == 1 else ((0, 0, dep) if not keys else None)]
    if name == "sign" and states[0][0] == 0:  # (a sign ignores a positive scale: FGSM's sign of a mean's gradient)
        return [(0, 0, dep)]
    if name in _SAME:
        if unfollowed_join(we, me, ins):  # (else followed: core._joined)
            return [None]  # (replay rows beside two parts of the examples: summed over, counted in each microbatch)
        data = states[1:] if name == "select_n" else states
        if name == "select_n" and states[0][:2] != (0, 0) or name in ("max", "min", "clamp") and (1, -1, True) in data:
            return [None]  # (a mean clamped to a level: free bits, jnp.maximum(kl.mean(), free))
        if name in ("max", "min", "clamp") and (1, 0, True) in data and (0, 0, False) in data:
            return [(1, _GUARD, True)]  # (a sum clamped to a level: a ratio's guard, else no combination)
        keys = {st[:2] for st in data if st[2] or st[:2] != (0, 0)}
        if name == "select_n":
            note_choice(getattr(_MIXING, "parts", None), me, data, getattr(_MIXING, "top", None))
        return [(*keys.pop(), dep) if len(keys) == 1 else ((0, 0, dep) if not keys else None)]
    if name in ("mul", "div"):
        if name == "mul" and any(isinstance(a, jex_core.Literal) and not np.any(np.asarray(a.val))
                                 for a in me.invars):
            return [(0, 0, False)]  # a term multiplied by zero (0.0 * extra.sum(), to keep an input read): none
        (s1, b1, _), (s2, b2, _) = states
        if name == "div":
            if s2:  # a ratio of sums (a masked mean inside the loss) is neither; an example's value over a sum
                return ([(1, _RATIO, True)] if s1 == 1 and s2 == 1 else [(0, _SHARE, True)]  # (its share of it)
                        if (s1, b1, s2, b2) == (0, 0, 1, 0) else [None])
            return [(s1, b1 - b2, dep)]
        return [(s1 + s2, b1 + b2, dep)] if s1 + s2 <= 1 else [None]
    if name == "integer_pow":  # (a square root squared, ``jnp.linalg.norm(r) ** 2``, is the sum again)
        s, b, _ = states[0]
        y = me.params["y"]
        if (s, b, y) == (1, 0, -1):  # one over a sum (jnp.reciprocal(m.sum()), m.sum() ** -1): a share of it
            return [(0, _SHARE, True)]
        return [(_whole(s * y), _whole(b * y), dep)] if s == 0 or y == 1 or s * y == 1 else [None]
    if name == "rsqrt" and states[0][0] == 0 and isinstance(states[0][1], int):  # (g * rsqrt(sum(g * g)))
        return [(0, _whole(Fraction(-states[0][1], 2)), dep)]
    if name == "sqrt":  # half of what its operand is: a norm over the examples, sqrt(sum(r * r))
        s, b, _ = states[0]
        return [(_whole(Fraction(s, 2)), _whole(Fraction(b, 2)), dep)] if isinstance(b, int) else [None]
    if name == "reduce_sum":
        (s, b, _), axes = states[0], ins[0][1]
        if set(me.params["axes"]) & set(axes):
            if s == 0 and not dep:  # a constant broadcast over the batch, summed: the batch size times it (the
                return [(0, b + 1, False)]  # denominator jnp.average makes of weights broadcast to the batch's shape)
            return [(1, b, dep)] if s == 0 else [None]
        return [(s, b, dep)]
    if name in _ORDERED_REDUCE:
        axes = ins[0][1]
        if set(me.params.get("axes", ())) & set(axes):  # a maximum over examples is no sum, but a maximum
            return [(1, _EXTREME_OF[name], dep)] if name in _EXTREME_OF and states[0][:2] == (0, 0) else [None]
        return ([states[0]] if name in _CARRY and not states[0][0]  # (the largest class of a per-class count is none)
                else [(0, 0, dep)] if states[0][:2] == (0, 0) else [None])
    if name in _CARRY and not (name == "abs" and states[0][0]):  # (|sum| of the examples is no sum of theirs)
        return [(*states[0][:2], dep)] + [(0, 0, dep)] * (n_out - 1)
    if name == "split":  # each piece what the operand is (a concatenation's transpose: [s, a]'s cotangent, trial RL)
        return [(*states[0][:2], dep)] * n_out
    if name in _MIX_ALONG:
        along = me.params.get(_MIX_ALONG[name])
        if any(along in ax for _, ax in ins):
            return [None] * n_out
    if name in _LIN:
        return [_dot(me, ins, dep)]
    if name in ("scatter-max", "scatter-min"):  # a maximum per segment over the examples (jax.ops.segment_max)
        (so, bo, do), oa = ins[0]
        (su, bu, _), ua = ins[2]
        if ua and not oa and not do and (so, bo, su, bu) == (0, 0, 0, 0):
            return [(1, _MAX if name == "scatter-max" else _MIN, dep)]
        return [(0, 0, dep)] if (so, bo, su, bu) == (0, 0, 0, 0) else [None]
    if name in ("scatter-add", "scatter_add"):
        return [_scatter_add(me, ins, dep)]
    sub = _sub_jaxprs(we, me)
    if sub is not None:
        return sub(ins, M)
    if all(st[:2] == (0, 0) for st in states):  # a per-example (or batch-independent) operation; one whose result
        # lost the batch axes of an input that depends on the batch combined its examples somehow: how, nothing shows
        batched = any(st[2] and ax for st, ax in ins)
        return [None if batched and not _batch_axes(wv, mv) else (0, 0, dep)
                for wv, mv in zip(we.outvars, me.outvars)]
    return [None] * n_out


def _dot(me, ins, dep):
    (lc, rc), _ = me.params["dimension_numbers"]
    (s1, b1, _), la = ins[0]
    (s2, b2, _), ra = ins[1]
    summed = bool(set(lc) & set(la)) or bool(set(rc) & set(ra))
    s = s1 + s2 + int(summed)
    return (s, b1 + b2, dep) if s <= 1 else None


def _scatter_add(me, ins, dep):
    (so, bo, do), oa = ins[0]
    (su, bu, du), ua = ins[2]
    # updates with a batch axis added into an array without one (a count per class, whether the batch decides the
    # updates or only where they go: .at[label].add(1.0)): their examples are added up; an array with one (a batched
    # scatter, vmap of segment_sum: zeros per example) keeps them apart
    s = su + int(bool(ua and not do and not oa))
    if s > 1 or (do and (so, bo) != (s, bu)):
        return None
    return (s, bu, dep)


def _sub_jaxprs(we, me):
    """The rule of an equation that runs inner programs (a call, a checkpoint, a custom derivative, a scan, a
    loop, a branch), or None."""
    name = me.primitive.name
    if name == "scan":
        return lambda ins, M: _scan(we, me, ins, M)
    if name == "cond":
        return lambda ins, M: _cond(we, me, ins, M)
    if name == "while":
        return lambda ins, M: _while(we, me, ins, M)
    wb, mb = _body(we), _body(me)
    if mb is None or wb is None:
        return None
    if len(mb.jaxpr.invars) != len(me.invars) or len(mb.jaxpr.outvars) != len(me.outvars):
        return None
    called, known = _MIXING.__dict__.pop("call_in", None) or (), _MIXING.__dict__.pop("call_values", None)
    return lambda ins, M: _walk(wb.jaxpr, mb.jaxpr, list(wb.consts), list(mb.consts), [st for st, _ in ins], M,
                                [g for g, _ in called], [p for _, p in called], known)


def _is_call(eqn) -> bool:
    """Whether an equation runs one inner program on its operands as they are (a call, a checkpoint, a custom
    derivative), whose results are that program's: :func:`_sub_jaxprs` walks it with its operands' segments."""
    body = _body(eqn)
    return (eqn.primitive.name not in ("scan", "cond", "while") and body is not None
            and len(body.jaxpr.invars) == len(eqn.invars) and len(body.jaxpr.outvars) == len(eqn.outvars))


def _body(eqn):
    for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        j = eqn.params.get(key)
        if j is None:
            continue
        if isinstance(j, jex_core.ClosedJaxpr):
            return j
        if isinstance(j, jex_core.Jaxpr):
            return jex_core.ClosedJaxpr(j, ())
    return None


def _scan(we, me, ins, M):
    nc, ncar = me.params["num_consts"], me.params["num_carry"]
    wb, mb = we.params["jaxpr"], me.params["jaxpr"]
    states = [st for st, _ in ins]
    carry = states[nc:nc + ncar]
    over_examples = any(st is not None and st[2] and 0 in ax for st, ax in ins[nc + ncar:])  # (chunks of tokens)
    outs = _walk(wb.jaxpr, mb.jaxpr, list(wb.consts), list(mb.consts), states, M)
    if outs[:ncar] != carry:  # a carry that accumulates over iterations: one more pass from the joined states
        _look_again(wb, mb, states[:nc], carry, outs[:ncar], states[nc + ncar:], M)
        carry = [_join(a, b) for a, b in zip(carry, outs[:ncar])]
        outs = _walk(wb.jaxpr, mb.jaxpr, list(wb.consts), list(mb.consts), states[:nc] + carry + states[nc + ncar:], M)
        if outs[:ncar] != carry:
            outs = [None] * len(me.outvars)
    if over_examples:  # a carry each iteration adds to sums the examples up (a constant: counts them); one it changes
        body = mb.jaxpr  # otherwise (an inner training loop's weights) is a recurrence over them, each microbatch
        made = {v: e for e in body.eqns for v in e.outvars}  # running fewer steps
        outs = list(outs)
        data = {v for v, (st, _) in zip(body.invars, ins) if st is None or st[2]}
        for k in range(ncar):
            carried, out = body.invars[nc + k], body.outvars[k]
            added = _added_to(made, out, carried, data)
            if added is not None:
                if outs[k] is not None and outs[k][0] == 0:
                    outs[k] = (1, outs[k][1], True) if added == "sum" else (0, 1, False)
            elif extreme := _extreme_of(made, out, carried):  # a running maximum (minimum) of the chunks' values
                outs[k] = (1, extreme, True) if outs[k] is None or outs[k][2] else outs[k]
            elif ((outs[k] is None or outs[k][2] and outs[k][1] not in (_MAX, _MIN)) and out is not carried
                  and we.outvars[k].aval.shape == me.outvars[k].aval.shape):
                _MIXING.recurrence = me
    return outs


def _source(made: dict, v):  # ``v`` through the casts that made it (a weakly typed zero's carry cast to a sum's type)
    while (not isinstance(v, jex_core.Literal) and v in made
           and made[v].primitive.name in ("convert_element_type", "copy", "copy_p")):
        v = made[v].invars[0]
    return v


def _added_to(made: dict, out, carried, data: set) -> str | None:
    """``"sum"`` where ``out`` (a loop body's carry out) is ``carried`` (its carry in) plus a value read from ``data``,
    ``"count"`` where what it adds reads none (a constant), seen through casts and through a call the addition sits
    in (a body under ``jax.checkpoint``); None where it is no such sum, or where what it adds reads the carried value
    (a running mean, ``m + (x - m) / n``: no sum of the examples)."""
    e = made.get(_source(made, out))
    if e is not None and _is_call(e):
        inner = _body(e).jaxpr
        inner_made = {v: q for q in inner.eqns for v in q.outvars}
        inner_out = inner.outvars[e.outvars.index(_source(made, out))]
        inner_data = {i for a, i in zip(e.invars, inner.invars) if _reads(made, a, data)}
        kinds = [_added_to(inner_made, inner_out, i, inner_data) for a, i in zip(e.invars, inner.invars)
                 if not isinstance(a, jex_core.Literal) and _source(made, a) is carried]
        return next((k for k in kinds if k is not None), None)
    if e is None or e.primitive.name not in ("add", "add_any"):
        return None
    rest = [a for a in e.invars if isinstance(a, jex_core.Literal) or _source(made, a) is not carried]
    if len(rest) != 1 or _reads(made, rest[0], {carried}):
        return None
    return "sum" if _reads(made, rest[0], data) else "count"


def _reads(made: dict, v, sources: set) -> bool:
    """Whether ``v`` is one of ``sources`` or is computed from one (inside a loop body: ``made`` its equations)."""
    stack, seen = [v], set()
    while stack:
        a = stack.pop()
        if not isinstance(a, jex_core.Literal) and a not in seen:
            if a in sources:
                return True
            seen.add(a)
            stack.extend(made[a].invars if a in made else ())
    return False


def _extreme_of(made: dict, out, carried) -> str | None:
    """:data:`_MAX` (:data:`_MIN`) where ``out`` is the maximum (minimum) of ``carried`` and another, else None."""
    e = made.get(_source(made, out))
    hit = e is not None and any(_source(made, a) is carried for a in e.invars if not isinstance(a, jex_core.Literal))
    return {"max": _MAX, "min": _MIN}.get(e.primitive.name) if hit else None


def _look_again(wb, mb, before, carry, carried, after, M) -> None:
    """Where a loop's carry becomes what no state describes (a statistic over the batch carried to the next step, a
    MAML inner loop's weights), walk its body once more from what the first iteration made of it, for the mixing it
    shows the second time round (the joined states, unknown, would hide it). Only the mixing is kept."""
    if getattr(_MIXING, "events", None) is None or all(a is None or _join(a, b) is not None
                                                       for a, b in zip(carry, carried)):
        return
    again = [b if _join(a, b) is None and b is not None else a for a, b in zip(carry, carried)]
    try:
        _walk(wb.jaxpr, mb.jaxpr, list(wb.consts), list(mb.consts), list(before) + again + list(after), M)
    except _Mismatch:
        pass


def _join(a, b):
    """The state of a value that is ``a`` or ``b`` (a loop's carry before and after an iteration): the same sum and
    power of the batch size, depending on the batch if either does (a state carried from zeros); else unknown."""
    if a is None or b is None:
        return None
    if a[:3] == (0, 0, False):  # a constant start (an accumulator's zeros): what the loop makes of it, checked by the
        return b                # pass from the joined states (a sum added to: a sum; otherwise unknown)
    if a[:2] != b[:2]:
        return None
    return (a[0], a[1], a[2] or b[2])


def _cond(we, me, ins, M):
    if ins[0][0][:2] != (0, 0):
        return [None] * len(me.outvars)
    states = [st for st, _ in ins[1:]]
    results = [_walk(wb.jaxpr, mb.jaxpr, list(wb.consts), list(mb.consts), states, M)
               for wb, mb in zip(we.params["branches"], me.params["branches"])]
    joined = []  # what either branch makes (a branch of constants, zeros for a skipped self-conditioning: the other's)
    for r in zip(*results):
        note_choice(getattr(_MIXING, "parts", None), me, r, getattr(_MIXING, "top", None))
        r = sorted(r, key=lambda st: st is not None and st[:3] != (0, 0, False))
        joined.append(functools.reduce(_join, r))
    return joined


def _while(we, me, ins, M):
    cn, bn = me.params["cond_nconsts"], me.params["body_nconsts"]
    wb, mb = we.params["body_jaxpr"], me.params["body_jaxpr"]
    states = [st for st, _ in ins]
    carry = states[cn + bn:]
    outs = _walk(wb.jaxpr, mb.jaxpr, list(wb.consts), list(mb.consts), states[cn:cn + bn] + carry, M)
    if outs != carry:
        _look_again(wb, mb, states[cn:cn + bn], carry, outs, [], M)
        for _ in range(len(carry)):  # more passes from the joined states, until they settle (a flag, then a count)
            carry = [_join(a, b) for a, b in zip(carry, outs)]
            outs = _walk(wb.jaxpr, mb.jaxpr, list(wb.consts), list(mb.consts), states[cn:cn + bn] + carry, M)
            if outs == carry:
                break
        outs = [a if a == b else None for a, b in zip(carry, outs)]
    if loop_test(we, me, ins)[0]:  # a number of iterations that depends on the batch: so does what the loop makes
        outs = [st if st is None else (*st[:2], True) for st in outs]
    return outs

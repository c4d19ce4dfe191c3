"""Where a loss takes parts of its batch by position: the rows of a batch axis followed through concatenations,
pads, reshapes, slices and splits, in the two traces :mod:`autopp.core._reduction` walks (the whole batch and one
microbatch).

A batch axis is a sequence of *segments*, each a pair ``(whole length, microbatch length)``: an examples segment
scales with the batch (``(B, b)``), a segment of other rows does not (a memory bank concatenated onto the batch,
``(K, K)``). ``jnp.concatenate([chosen, rejected])`` of two batch arrays is two examples segments; time-major rows
``[T, B] -> [T * B]`` are ``T``. A slice or a split that takes whole segments reads each microbatch's own rows of
them, as the whole batch's are read; one that takes part of an examples segment by position (``x[:n]`` of a batch
that is ``[chosen; rejected]``) reads other examples in each microbatch than in the whole batch.
"""

from __future__ import annotations

import math

import numpy as np
from jax import lax
from jax.extend import core as jex_core

ORDER, PARTS, STRIDES, FIRST, POSITIONS = "order", "parts", "strides", "first", "positions"
"""What :func:`batch_parts` finds: a window of the batch by position (``x[1:] - x[:-1]``), a part of its examples
by position (``x[:n]``, ``jnp.split``, ``x.reshape(2, -1)``), every k-th example in microbatches k does not divide,
a fixed number of them (``x[0]``, ``x[jnp.array([0, 5])]``), rows written at fixed positions (``x.at[:2].set(0)``;
also what :mod:`autopp.core._reduction` says of positions from ``jnp.arange`` used as values)."""


def _shape(a) -> tuple:
    return tuple(getattr(a.aval, "shape", ()))


def _examples_only(pieces) -> bool:
    return all(w != n for w, n in pieces)


def batch_parts(we, me, ins: list, out_axes: list, segments: dict, microbatches: int | None) -> str | None:
    """Follow the segments of the batch axes through equation ``me`` (``we``: the same in the whole batch's trace;
    ``ins``: per operand ``(state, batch axes)``; ``segments``: micro variable -> its first batch axis's segments,
    absent for one examples segment) and say where it takes parts of the batch by position: :data:`PARTS`,
    :data:`STRIDES` (``microbatches``: how many the step runs), :data:`ORDER`, :data:`FIRST` (a fixed number of
    examples: the caller says so where their values meet the others'), or None."""
    name = me.primitive.name
    values = segments.setdefault(_VALUES, {_FROM_IOTA: set()})
    _follow_values(we, me, values)

    def keep(out, pieces):
        pieces = tuple(p for p in pieces if p[0])
        if len(pieces) > 1:
            segments[out] = pieces

    dependent = [k for k, (st, ax) in enumerate(ins) if st is not None and st[2] and ax]
    if name in ("gather", "dynamic_slice") and 0 in dependent and microbatches:
        d = ins[0][1][0]
        rows = _rows_picked(we, me, d, values)
        picked = None if rows is None else _picked_segments(*rows, _operand_pieces(we, me, d, segments))
        if rows is not None and picked is None:  # rows picked by positions that are not each microbatch's own: fixed
            return FIRST if np.array_equal(*rows) else _misread(rows[0])  # ones (x[jnp.array([0, 5])]), or others
        if picked and out_axes[0][:1] == (_picks_axis(me, d),):
            keep(me.outvars[0], picked)  # (the halves swapped, [rejected; chosen], are two segments)
    if name.startswith("scatter") and ins[0][1] and microbatches:  # (into the batch's values, or a weight per row)
        rows = _rows_written(we, me, ins[0][1][0], values)
        if rows is not None and not _tiled(*rows, 0, _operand_pieces(we, me, ins[0][1][0], segments)):
            return POSITIONS  # rows written at fixed positions: nll.at[:2].set(0), each microbatch's own first two
    if name == "slice" and 0 in dependent and set(ins[0][1]) - set(out_axes[0]):
        return FIRST  # a number of examples that does not grow with the batch (x[0], x[:4])
    if not dependent or not me.outvars or not out_axes[0]:
        return None
    whole_in, micro_in = [_shape(a) for a in we.invars], [_shape(a) for a in me.invars]

    def pieces_of(k, d):  # operand k's segments along its axis d
        a = me.invars[k]
        got = None if isinstance(a, jex_core.Literal) else segments.get(a)
        if got is not None and ins[k][1][:1] == (d,):
            return got
        return ((whole_in[k][d], micro_in[k][d]),)

    indexed = name in ("gather", "dynamic_slice", "dynamic_update_slice") or name.startswith("scatter")
    for k, a in enumerate(me.invars):  # values made in the loss from literals alone, as long as the batch, that meet
        if (microbatches and k not in dependent and ins[k][1] and not isinstance(a, jex_core.Literal)
                and a in values and not (indexed and k) and a not in values[_FROM_IOTA]):  # (positions a gather
            # picks by: checked above; positions from jnp.arange: by autopp.core._reduction)
            d = ins[k][1][0]  # its examples (a padding mask concatenate([ones(B - 4), zeros(4)]), ones(B).at[0])
            peer = next((j for j in dependent if micro_in[j] == micro_in[k] and d in ins[j][1]), None)
            made = values[a]  # (a fill, an attention mask's -inf broadcast over [B, H, T, T]: not evaluated)
            if math.prod(whole_in[k]) > _MAX_WEIGHTS or isinstance(made, tuple) and len(made) == 3 and (
                    made[1].primitive.name == "broadcast_in_dim" and isinstance(made[1].invars[0], jex_core.Literal)):
                continue
            got = _value(we.invars[k], a, values)
            if got is not None and not _tiled(*got, d, pieces_of(k, d) if peer is None else pieces_of(peer, d)):
                return POSITIONS

    if name == "concatenate":
        d = me.params["dimension"]
        if d in out_axes[0]:
            keep(me.outvars[0], [p for k in range(len(me.invars)) for p in pieces_of(k, d)])
        else:  # along another axis (a class token broadcast to the batch, then the patches): the batch's segments
            b = out_axes[0][0]  # are those of the operand that has some
            keep(me.outvars[0], max((pieces_of(k, b) for k in dependent if b in ins[k][1]), key=len, default=()))
        return None
    if name == "pad" and 0 in dependent:
        d = out_axes[0][0]
        lo, hi, interior = me.params["padding_config"][d]
        if d in ins[0][1] and interior == 0 and lo >= 0 and hi >= 0:
            keep(me.outvars[0], [(lo, lo), *pieces_of(0, d), (hi, hi)])
        return None
    if name == "reshape" and len(ins[0][1]) == 1 and len(out_axes[0]) == 1:
        return _reshape(we, me, ins, out_axes, pieces_of(0, ins[0][1][0]), keep)
    if name in ("slice", "split") and ins[0][1]:
        return _cut(we, me, ins, out_axes, pieces_of, keep, microbatches)
    sized = {(whole_in[k][ins[k][1][0]], micro_in[k][ins[k][1][0]]): pieces_of(k, ins[k][1][0]) for k in dependent}
    for wv, mv, ax in zip(we.outvars, me.outvars, out_axes):  # an operation that keeps the axis's length keeps its
        pieces = sized.get((wv.aval.shape[ax[0]], mv.aval.shape[ax[0]])) if ax else None  # segments
        if pieces is not None:
            keep(mv, pieces)
    return None


_VALUES = "values"  # key of the segments dict holding (whole, microbatch) values made from positions alone
_FROM_IOTA = "iota"  # key of that dict holding the values made from jnp.arange
_MAX_VALUES = 1 << 16
_MAX_WEIGHTS = 1 << 14  # (weights or masks as long as the batch, compared only up to this size: each runs eagerly)


def _operand_pieces(we, me, d: int, segments) -> tuple:
    """The segments of the first operand's batch axis ``d`` (one examples segment when none are known)."""
    a = me.invars[0]
    got = None if isinstance(a, jex_core.Literal) else segments.get(a)
    return got or ((we.invars[0].aval.shape[d], a.aval.shape[d]),)


def _follow_values(we, me, values: dict) -> None:
    """Note the equations (in both traces) that make arrays from ``jnp.arange`` and literals alone: positions
    computed in the loss (``jnp.arange(n) + n - 1``, a fixed permutation by ``argsort``). They are evaluated only
    where a gather or a dynamic slice picks rows by them (:func:`_value`): each evaluation runs JAX eagerly."""
    name = me.primitive.name
    if me.effects or (name not in ("pjit", "jit") and next(jex_core.jaxprs_in_params(me.params), None) is not None):
        return  # (a jitted jnp function, argsort: run whole)
    if any(getattr(v.aval, "size", _MAX_VALUES + 1) > _MAX_VALUES for v in me.outvars) or "random" in name:
        return
    reads = [a for a in me.invars if not isinstance(a, jex_core.Literal)]
    if name == "iota" or all(a in values for a in reads):
        values.update((v, (we, me, k)) for k, v in enumerate(me.outvars))  # (of literals alone: x.at[-1], x[3])
        if name == "iota" or any(a in values[_FROM_IOTA] for a in reads):
            values[_FROM_IOTA].update(me.outvars)  # (positions: what autopp.core._reduction follows as such)


def seed_values(segments: dict, w: jex_core.Jaxpr, m: jex_core.Jaxpr, w_consts: list, m_consts: list,
                in_values: list | None) -> None:
    """Before a walk of ``m`` (``w``: the whole batch's), the values :func:`_value` knows: its small constants
    (``x[jnp.array([0, 5])]``) and what the caller's operands are known to be (``in_values``, from
    :func:`call_values`: ``jnp.take(x, 3)`` passes 3 into its jitted body)."""
    values = segments.setdefault(_VALUES, {_FROM_IOTA: set()})
    for mv, wc, mc in zip(m.constvars, w_consts, m_consts):
        dtype = getattr(mv.aval, "dtype", None)  # (numbers and flags, not a PRNG key's type)
        if isinstance(dtype, np.dtype) and dtype.kind in "iubf" and mv.aval.size <= _MAX_VALUES:
            values[mv] = lambda wc=wc, mc=mc: (np.asarray(wc), np.asarray(mc))  # (copied to the host where read)
    for v, got in zip(m.invars, in_values or ()):
        if got is not None:
            values[v] = got[0]
            if got[1]:
                values[_FROM_IOTA].add(v)


def call_values(we, me, segments: dict) -> list:
    """Per operand of a call, how to know its values in the body's walk (:func:`seed_values`), evaluated, as the
    caller's, only where the body picks rows by them, and whether they are made from ``jnp.arange``."""
    values = segments.setdefault(_VALUES, {_FROM_IOTA: set()})
    return [((lambda wa=wa, a=a: _value(wa, a, values)), not isinstance(a, jex_core.Literal)
             and a in values[_FROM_IOTA]) if isinstance(a, jex_core.Literal) or a in values else None
            for wa, a in zip(we.invars, me.invars)]


def _value(wa, a, values: dict):
    """The values of ``a`` (its counterpart in the whole batch's trace: ``wa``) in both traces (:func:`_follow_values`),
    or None where they are not known."""
    if isinstance(a, jex_core.Literal):
        return np.asarray(wa.val), np.asarray(a.val)
    got = values.get(a)
    if callable(got):  # (a call's operand, known in the caller's walk)
        values[a] = got = got()
    if got is None or len(got) == 2:
        return got
    we, me, k = got
    args = [_value(wb, b, values) for wb, b in zip(we.invars, me.invars)]
    values[a] = None  # (until evaluated: what cannot be is not tried again)
    if any(x is None for x in args):
        return None
    try:
        outs = []
        for e, j in ((we, 0), (me, 1)):
            out = e.primitive.bind(*[x[j] for x in args], **e.params)
            outs.append([np.asarray(o) for o in (out if e.primitive.multiple_results else [out])])
    except Exception:  # noqa: BLE001 - an operation that cannot run on host values: not followed
        return None
    values.update((v, (w, m)) for v, w, m in zip(me.outvars, *outs))
    return values[me.outvars[k]]


def _rows_picked(we, me, d: int, values: dict):
    """The rows along axis ``d`` of its operand that a gather (one index per output row) or a dynamic slice picks, in
    both traces, where they are known (:func:`_value`); else None."""
    if me.primitive.name == "dynamic_slice":
        starts = _value(we.invars[1 + d], me.invars[1 + d], values) if len(me.invars) > 1 + d else None
        if starts is None:
            return None
        return tuple(int(st) + np.arange(e.params["slice_sizes"][d]) for st, e in zip(starts, (we, me)))
    numbers = me.params["dimension_numbers"]
    got = _value(we.invars[1], me.invars[1], values) if tuple(numbers.start_index_map) == (d,) else None
    if got is None:
        return None
    w, m = (x.reshape(1, 1) if x.shape == (1,) else x for x in got)  # (one index alone: jnp.take(x, 3))
    if w.ndim != 2 or m.ndim != 2 or w.shape[1] != 1 or m.shape[1] != 1:
        return None
    return w[:, 0], m[:, 0]


def _picked_segments(whole, micro, pieces) -> list | None:
    """The segments of what a microbatch's gather picks (``micro``: the operand rows, of segments ``pieces``), where
    it reads what the whole batch's (``whole``) reads for it; else None. Each run of its picks from one segment of the
    examples stands, in the whole batch, for that run repeated in each microbatch's rows of the segment: a part of
    [chosen; rejected] (both swapped: two segments), pairs interleaved (``x[jnp.arange(n) * 2]``, partners
    ``x[jnp.arange(B) ^ 1]``); rows of other segments are the same in every microbatch. An offset window, a fixed
    permutation or fixed rows (``x[jnp.array([0, 5])]``) pick other examples' rows in each microbatch."""
    wc, mc = np.cumsum([0] + [w for w, _ in pieces]), np.cumsum([0] + [m for _, m in pieces])
    seg = np.searchsorted(mc, micro, side="right") - 1
    if len(micro) == 0 or np.any(seg < 0) or np.any(seg >= len(pieces)):
        return None
    offset = micro - mc[seg]
    want, runs, i = [], [], 0
    while i < len(micro):  # runs of rows of one segment
        k, j = seg[i], i
        while j + 1 < len(micro) and seg[j + 1] == k:
            j += 1
        (w, m), run = pieces[k], offset[i:j + 1]
        if w != m and (not m or w % m):
            return None
        copies = w // m if w != m else 1
        want.append(wc[k] + (np.arange(copies)[:, None] * m + run[None, :]).ravel())
        runs.append((len(run) * copies, len(run)))
        i = j + 1
    return runs if np.array_equal(whole, np.concatenate(want)) else None


def _misread(whole) -> str:
    """What picks that are not each microbatch's own read (``whole``: the whole batch's): a window of consecutive rows
    is a part by position (``z[jnp.arange(n) + n]`` where the microbatches do not hold the halves), rows a stride
    apart every k-th example (``z[jnp.arange(n) * 2]`` in microbatches of odd size), others an order."""
    steps = set(np.diff(whole).tolist()) if len(whole) > 1 else set()
    return PARTS if steps == {1} else STRIDES if len(steps) == 1 and steps.pop() > 1 else ORDER


def _tiled(whole, micro, d: int, pieces) -> bool:
    """Whether a value made from literals alone (``whole`` and ``micro``, its values in both traces; or the rows a
    scatter writes, as flags) holds along its batch axis ``d`` the same for each microbatch's rows of every segment
    of the examples as the whole batch's (a parity, a weight per position within a pair, every row written), and the
    same rows of the other segments; True where the shapes do not say (its other axes grow with the batch too) and
    where every row is the same in each trace."""
    whole, micro = np.moveaxis(whole, d, 0), np.moveaxis(micro, d, 0)
    wc, mc = np.cumsum([0] + [w for w, _ in pieces]), np.cumsum([0] + [m for _, m in pieces])
    if whole.shape[1:] != micro.shape[1:] or len(whole) != wc[-1] or len(micro) != mc[-1]:
        return True
    if all(len({np.ascontiguousarray(r).tobytes() for r in x}) <= 1 for x in (whole, micro)):
        return True  # the same in every row (a mean's cotangent 1 / B: its size, said elsewhere, not a position)
    for k, (w, m) in enumerate(pieces):
        ws, ms = whole[wc[k]:wc[k + 1]], micro[mc[k]:mc[k + 1]]
        if w != m and (not m or w % m):
            return False
        tiled = np.tile(ms, (w // m if w != m else 1,) + (1,) * (ms.ndim - 1))
        if ws.shape != tiled.shape or np.ascontiguousarray(ws).tobytes() != np.ascontiguousarray(tiled).tobytes():
            return False  # (bytes: NaN fills, jnp.var's, are equal)
    return True


def _picks_axis(me, d: int) -> int:
    """The output axis of a gather (a dynamic slice) that holds the rows it picks along operand axis ``d``."""
    if me.primitive.name == "dynamic_slice":
        return d
    offsets = me.params["dimension_numbers"].offset_dims
    return next(a for a in range(len(_shape(me.outvars[0])) + 1) if a not in offsets)


def _rows_written(we, me, d: int, values: dict):
    """Per trace, which rows along axis ``d`` of its destination a scatter writes (flags, moved to axis 0), where its
    indices are known (:func:`_value`) and the destination is small: the scatter run on zeros, with ones for its
    updates."""
    got = _value(we.invars[1], me.invars[1], values) if len(me.invars) == 3 else None
    if got is None or any(math.prod(_shape(e.invars[0])) > _MAX_VALUES for e in (we, me)):
        return None
    rows = []
    for e, index in zip((we, me), got):
        dest, updates = e.invars[0].aval, e.invars[2].aval
        try:
            out = lax.scatter(np.zeros(dest.shape, np.float32), index, np.ones(updates.shape, np.float32),
                              e.params["dimension_numbers"], mode=e.params["mode"])
        except Exception:  # noqa: BLE001 - a scatter that cannot run on host values: not followed
            return None
        out = np.asarray(out) != 0
        rows.append(out.any(axis=tuple(a for a in range(out.ndim) if a != d)))
    return tuple(rows)


def _reshape(we, me, ins, out_axes, pieces, keep) -> str | None:
    (d_in,), (d_out,) = ins[0][1], out_axes[0]
    w_in, m_in = _shape(we.invars[0]), _shape(me.invars[0])
    w_out, m_out = _shape(we.outvars[0]), _shape(me.outvars[0])
    order = me.params.get("dimensions")
    if order is not None:  # transposed first (lax.reshape's dimensions, vmap's rule for a per-example kernel)
        w_in, m_in, d_in = tuple(w_in[a] for a in order), tuple(m_in[a] for a in order), list(order).index(d_in)
    before_in, before_out = math.prod(m_in[:d_in]), math.prod(m_out[:d_out])
    if len(set(pieces)) == 1 and _examples_only(pieces):  # m equal blocks of the examples (one: the plain batch)
        blocks_in = before_in * len(pieces)
        if before_out > blocks_in or blocks_in % before_out:
            return PARTS  # the batch cut into a major and a minor part: [2B] -> [2, B]
        if before_out < blocks_in and math.prod(m_in[d_in + 1:]) % math.prod(m_out[d_out + 1:]):
            return PARTS  # rows merged across examples: [T, B, C] -> [B, T * C]
        m = blocks_in // before_out
        if w_out[d_out] % m == 0 and m_out[d_out] % m == 0:
            keep(me.outvars[0], [(w_out[d_out] // m, m_out[d_out] // m)] * m)
        return None
    if before_out != before_in:  # segments of other lengths: only rows merged into or split off each row scale them
        return PARTS
    scaled = [(w * w_out[d_out] / w_in[d_in], n * m_out[d_out] / m_in[d_in]) for w, n in pieces]
    if not all(float(w).is_integer() and float(n).is_integer() for w, n in scaled):
        return PARTS
    keep(me.outvars[0], [(int(w), int(n)) for w, n in scaled])
    return None


def _cut(we, me, ins, out_axes, pieces_of, keep, microbatches) -> str | None:
    whole_in, micro_in = _shape(we.invars[0]), _shape(me.invars[0])
    axes = set(ins[0][1]) & set(out_axes[0])  # (x[0:1]: one example's value, said elsewhere)
    if me.primitive.name == "slice":
        strides = me.params.get("strides") or (1,) * len(micro_in)
        cuts = [(d, me.params["start_indices"][d], me.params["limit_indices"][d], strides[d],
                 we.params["start_indices"][d], we.params["limit_indices"][d], me.outvars[0]) for d in axes]
    else:
        d = me.params["axis"]
        if d not in axes:  # along another axis (a fused projection's q, k, v): each piece keeps the batch's segments
            for out in me.outvars:
                keep(out, pieces_of(0, ins[0][1][0]))
            return None
        starts, wstarts = np.cumsum((0, *me.params["sizes"])), np.cumsum((0, *we.params["sizes"]))
        cuts = [(d, int(a), int(b), 1, int(wa), int(wb), out) for a, b, wa, wb, out
                in zip(starts, starts[1:], wstarts, wstarts[1:], me.outvars)] if d in axes else []
    for d, start, limit, stride, wstart, wlimit, out in cuts:
        n, big = micro_in[d], whole_in[d]
        pieces = pieces_of(0, d)
        if (start, limit, stride) == (0, n, 1):
            keep(out, pieces)
            continue
        if stride > 1:  # every k-th row: each microbatch's own when every segment holds whole k-tuples in each
            if start == wstart < stride and limit > n - stride and wlimit > big - stride:
                if all(w % stride == 0 and m % stride == 0 and (w == m or microbatches is None
                                                                or (w // microbatches) % stride == 0)
                       for w, m in pieces):
                    keep(out, [(w // stride, m // stride) for w, m in pieces])
                    continue
                if len(pieces) == 1:
                    return STRIDES
            return ORDER
        wc, mc = np.cumsum([0] + [w for w, _ in pieces]), np.cumsum([0] + [m for _, m in pieces])
        i, j = np.searchsorted(wc, wstart), np.searchsorted(wc, wlimit)
        if i < len(wc) and j < len(wc) and (wc[i], wc[j], mc[i], mc[j]) == (wstart, wlimit, start, limit):
            keep(out, pieces[i:j])  # whole segments: [chosen; rejected][:B] is chosen
            continue
        for i, (w, m) in enumerate(pieces):  # a part of one examples segment, in proportion: a part by position
            if (w != m and wc[i] <= wstart and wlimit <= wc[i + 1] and mc[i] <= start and limit <= mc[i + 1]
                    and (wlimit - wstart) * m == (limit - start) * w and (wstart - wc[i]) * m == (start - mc[i]) * w):
                return PARTS
        return ORDER
    return None


def across_examples(me) -> tuple[int, ...]:
    """The axes of its first operand along which an equation combines neighbouring or ranked elements: a top-k
    selection, a pooling window, an FFT's transformed axes, a convolution's spatial axes."""
    name, rank = me.primitive.name, len(getattr(me.invars[0].aval, "shape", ())) if me.invars else 0
    if name == "approx_top_k":
        return (me.params["reduction_dimension"] % rank,) if rank else ()
    if name.startswith("reduce_window") or name in ("select_and_scatter_add", "select_and_gather_add"):
        window, strides = me.params.get("window_dimensions", ()), me.params.get("window_strides", ())
        return tuple(d for d, (w, st) in enumerate(zip(window, strides)) if w > 1 or st > 1)
    if name == "fft":
        return tuple(range(rank - len(me.params["fft_lengths"]), rank))
    if name == "conv_general_dilated":  # spatial axes its window spans (its feature axis may hold examples apart in
        dn, kernel = me.params["dimension_numbers"], me.invars[1].aval.shape  # groups: vmap's per-example kernels)
        return tuple(d for k, d in enumerate(dn.lhs_spec[2:]) if kernel[dn.rhs_spec[2 + k]] > 1
                     or me.params["window_strides"][k] > 1 or me.params["lhs_dilation"][k] > 1)
    return ()


def indexes_the_batch(me, ins: list) -> bool:
    """Whether a gather picks rows along a batch axis of a value that depends on the batch, or a scatter puts values
    at rows along a batch axis of its destination (``jax.ops.segment_sum(h, ids, num_segments=len(h))``), by indices
    that depend on the batch (positions of other examples passed with the batch: ``v[batch["senders"]]``, a graph's
    edge list or node-to-graph ids counted over the whole batch)."""
    (op, op_axes), (ix, _) = ins[0], ins[1]
    by_batch = ix is None or ix[2]  # (None: wrapped by the batch's size, i + B)
    numbers = me.params["dimension_numbers"]
    if me.primitive.name == "gather":
        return op is not None and op[2] and by_batch and bool(set(op_axes) & set(numbers.start_index_map))
    return by_batch and bool(set(op_axes) & set(numbers.scatter_dims_to_operand_dims))


def examples_blocks(pieces) -> tuple[int, ...] | None:
    """The whole batch's length of each block of an output's leading axis, where it holds several blocks of the
    examples only (None otherwise): how its microbatches' values interleave into the whole batch's."""
    return tuple(int(w) for w, _ in pieces) if pieces and len(pieces) > 1 and _examples_only(pieces) else None


__all__ = ["FIRST", "ORDER", "PARTS", "POSITIONS", "STRIDES", "across_examples", "batch_parts", "call_values",
           "examples_blocks", "indexes_the_batch", "seed_values"]

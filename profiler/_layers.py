"""Group a forward jaxpr into layers: embedding, repeated blocks, head; with per-layer costs.

:func:`group_layers` cuts the loss's forward jaxpr into contiguous ranges of equations. It looks for
the model's repeated block (a tandem repeat of equation signatures: identical transformer blocks, or
blocks whose shapes differ but whose operations match), expands a ``lax.scan`` over stacked
parameters into one layer per iteration, and otherwise falls back to a cost-balanced split. Each
:class:`Layer` carries the forward FLOPs, the parameter bytes it reads, the bytes of the residuals
its backward pass saves (from the VJP of its own sub-jaxpr) and the bytes crossing its end.

Everything works on abstract values (``jax.ShapeDtypeStruct``); nothing is allocated.
"""

from __future__ import annotations

import dataclasses
import hashlib
import warnings
from collections.abc import Sequence

import jax
import numpy as np
from jax.extend import core as jex_core

from autopp.core import (
    eqn_signature,
    forward_with_vjp,
    inner_jaxpr,
    literal_signature,
    new_jaxpr,
    structure_signature,
)
from autopp.profiler._costs import ZERO, aval_bytes, eqn_cost, jaxpr_cost

__all__ = ["Layer", "group_layers", "repeated_fingerprints"]

_MATMULS = frozenset({"dot_general", "conv_general_dilated"})
_MAX_RESIDUAL_CACHE = 512
_residual_cache: dict[str, int] = {}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Layer:
    """One layer of a forward jaxpr: a contiguous range of its equations (or one iteration of a scan)."""

    index: int
    """Position of this layer in the list returned by :func:`group_layers` (0-based)."""

    name: str
    """``"embed"`` (what precedes the first repeated block), ``"block k"`` (k-th repeated block or
    scan iteration, 0-based), ``"head"`` (what follows the last block), ``"layer i"`` (anything else,
    and every layer of a cost-balanced split; ``i`` is :attr:`index`)."""

    eqn_range: tuple[int, int]
    """``(start, stop)``: the layer's equations are ``forward.jaxpr.eqns[start:stop]``. For a layer
    expanded from a ``lax.scan``, the scan equation's range ``(i, i + 1)``; see :attr:`iteration`."""

    iteration: int | None = None
    """For a layer expanded from a ``lax.scan`` over stacked parameters: which iteration (0-based,
    in execution order); ``None`` otherwise."""

    fingerprint: str
    """Hash (16 hex digits) of the layer's canonical structure: the primitives, parameters, shapes,
    dtypes and literals of its batch-dependent equations and their dataflow with variables renamed
    canonically (external inputs numbered by first use and tagged batch / parameter-derived /
    constant; the values leaving the layer marked). Parameter-only equations (casts, slices of stacked
    weights) are left out, so identical blocks share it, also between a scanned model and its unrolled
    twin; different shapes give different fingerprints."""

    flops: float
    """Forward FLOPs of the layer (multiply-add = 2) at the traced batch size."""

    transcendentals: float
    """Forward transcendental evaluations (exp, tanh, rsqrt, ...)."""

    bytes_accessed: float
    """Forward bytes read plus written, summed over the layer's equations."""

    param_bytes: int
    """Bytes of the parameters this layer reads and owns: a parameter read by several layers is
    counted in the first of them (for a scan iteration: its slice of the stacked parameters). Summed
    over all layers this is the bytes of every parameter the forward uses."""

    shared_param_bytes: int
    """Bytes of parameters this layer reads that an earlier layer owns (e.g. a tied embedding read
    again by the head)."""

    param_indices: tuple[int, ...]
    """Forward invar indices of the parameters counted in :attr:`param_bytes`."""

    shared_param_indices: tuple[int, ...]
    """Forward invar indices of the parameters counted in :attr:`shared_param_bytes`."""

    activation_bytes: int
    """Bytes of the residuals that the backward pass of this layer saves: the residuals of ``jax.vjp``
    of the layer's sub-jaxpr (its batch-dependent equations), excluding parameters and values computed
    from parameters only (weights, their transposes, broadcast biases). Saved inputs and batch-shaped
    constants (attention masks) count; scalar literals do not."""

    output_bytes: int
    """Bytes of batch-dependent values this layer produces that a later layer (or the forward's
    outputs, e.g. the loss) reads: what crosses the layer's end."""

    input_bytes: int
    """Bytes of batch-dependent values this layer reads that it does not produce (outputs of earlier
    layers and the batch inputs)."""

    reads_from: tuple[tuple[int, int], ...] = ()
    """``(producer layer index, bytes)`` for every earlier layer whose batch-dependent values this
    layer reads, from the actual dataflow (skip connections included): the edges of
    :func:`autopp.profiler.cost_graph`."""

    def to_dict(self) -> dict:
        """JSON-friendly dict of all fields (tuples become lists)."""
        d = dataclasses.asdict(self)
        d["eqn_range"] = list(self.eqn_range)
        d["param_indices"] = list(self.param_indices)
        d["shared_param_indices"] = list(self.shared_param_indices)
        d["reads_from"] = [list(e) for e in self.reads_from]
        return d


def repeated_fingerprints(layers: Sequence[Layer]) -> dict[str, list[int]]:
    """Fingerprints shared by two or more layers -> the indices of those layers (first-seen order)."""
    groups: dict[str, list[int]] = {}
    for layer in layers:
        groups.setdefault(layer.fingerprint, []).append(layer.index)
    return {fp: idx for fp, idx in groups.items() if len(idx) > 1}


# ----------------------------------------------------------------------------------------------------
# Signatures


def _weight(eqn) -> int:
    """1 + the number of nested equations (so a remat'd block weighs as much as its inlined twin)."""
    w = 1
    for s in jex_core.jaxprs_in_params(eqn.params):
        w += sum(_weight(e) for e in inner_jaxpr(s).eqns)
    return w


class _Interner:
    def __init__(self):
        self.ids: dict[str, int] = {}
        self.strs: list[str] = []

    def __call__(self, s: str) -> int:
        i = self.ids.get(s)
        if i is None:
            i = self.ids[s] = len(self.strs)
            self.strs.append(s)
        return i


def _canon(eqns, sig_ids, kind, escapes_of):
    """Canonical form of a list of equations.

    ``sig_ids[k]``: an id of equation k's signature; ``kind(var)``: 'b' / 'p' / 'c' for external
    inputs; ``escapes_of(defined)``: the atoms leaving the group, given the set of variables it
    defines. Returns ``(key, external vars in first-use order, escaping atoms)``.
    """
    pos: dict = {}
    ext: dict = {}
    items = []
    for k, e in enumerate(eqns):
        refs = []
        for a in e.invars:
            if isinstance(a, jex_core.Literal):
                refs.append(None)
            elif a in pos:
                refs.append(pos[a])
            else:
                if a not in ext:
                    ext[a] = (len(ext), kind(a))
                refs.append(ext[a])
        items.append((sig_ids[k], tuple(refs)))
        for j, v in enumerate(e.outvars):
            pos[v] = (k, j)
    escapes = escapes_of(pos)
    esc = []
    for a in escapes:
        if isinstance(a, jex_core.Literal):
            esc.append(("lit", literal_signature(a.val)))
        elif a in pos:
            esc.append(pos[a])
        else:
            if a not in ext:
                ext[a] = (len(ext), kind(a))
            esc.append(ext[a])
    esc = tuple(sorted(set(esc), key=repr))
    return (tuple(items), esc), list(ext), list(escapes)


# ----------------------------------------------------------------------------------------------------
# Analysis of the forward jaxpr

# Parameter-only operations that take a part of their first operand (a slice of stacked parameters).
_SLICING = frozenset({"slice", "dynamic_slice", "gather", "split"})


def _size(aval) -> int:
    return int(np.prod(getattr(aval, "shape", ()), dtype=np.int64))


def _param_flow(eqns, is_batch_var, src: dict) -> None:
    """Propagate parameter sources through the non-batch equations of ``eqns`` (in place).

    ``src`` maps a variable to a frozenset of ``(param index, token, fraction)``: the value derives
    from ``fraction`` of the parameter's bytes; ``token`` tells apart different slices of one parameter.
    """
    for k, e in enumerate(eqns):
        if any(not isinstance(a, jex_core.Literal) and is_batch_var(a) for a in e.invars):
            continue
        ins = [a for a in e.invars if not isinstance(a, jex_core.Literal) and a in src]
        if not ins:
            continue
        op0 = e.invars[0] if e.invars else None
        if e.primitive.name in _SLICING and op0 is not None and not isinstance(op0, jex_core.Literal) \
                and op0 in src and _size(op0.aval) > 0:
            for j, v in enumerate(e.outvars):
                f = _size(v.aval) / _size(op0.aval)
                src[v] = frozenset((i, (id(e), j, tok), fr * f) for i, tok, fr in src[op0])
            continue
        merged = src[ins[0]] if len(ins) == 1 else frozenset().union(*(src[a] for a in ins))
        for v in e.outvars:
            src[v] = merged


@dataclasses.dataclass
class _Unit:
    """A layer under construction: equations ``[start, stop)``, or one iteration of the scan at ``start``."""

    start: int
    stop: int
    kind: str  # "block", "other", "scan", "split"
    iteration: int | None = None


class _Analysis:
    def __init__(self, forward: jex_core.ClosedJaxpr, batch_invars, param_invars):
        jaxpr = forward.jaxpr
        n_in = len(jaxpr.invars)
        batch_invars = tuple(bool(b) for b in batch_invars)
        param_invars = tuple(bool(p) for p in param_invars)
        if len(batch_invars) != n_in or len(param_invars) != n_in:
            raise ValueError(
                f"group_layers: batch_invars ({len(batch_invars)}) and param_invars ({len(param_invars)}) "
                f"must have one entry per forward invar ({n_in})."
            )
        self.forward = forward
        self.jaxpr = jaxpr
        self.eqns = list(jaxpr.eqns)
        self.batch_invars = batch_invars
        n = len(self.eqns)
        dep = {v for v, b in zip(jaxpr.invars, batch_invars) if b}
        is_batch = np.zeros(n, bool)
        last_use: dict = {}
        for i, e in enumerate(self.eqns):
            for a in e.invars:
                if not isinstance(a, jex_core.Literal):
                    last_use[a] = i
                    if a in dep:
                        is_batch[i] = True
            if is_batch[i]:
                dep.update(e.outvars)
        self.outvar_set = {a for a in jaxpr.outvars if not isinstance(a, jex_core.Literal)}
        for a in self.outvar_set:
            last_use[a] = n
        self.dep = dep
        self.is_batch = is_batch
        self.last_use = last_use
        self.param_nbytes: dict[int, int] = {}
        src: dict = {}
        for i, (v, p, b) in enumerate(zip(jaxpr.invars, param_invars, batch_invars)):
            if p and not b:
                src[v] = frozenset(((i, None, 1.0),))
                self.param_nbytes[i] = aval_bytes(v.aval)
        _param_flow(self.eqns, dep.__contains__, src)
        self.param_src = src

        # Everything below is over the batch-dependent equations only ("positions").
        self.bidx = np.flatnonzero(is_batch)
        nb = len(self.bidx)
        self.nb = nb
        bounds = np.empty(nb + 1, dtype=np.int64)
        bounds[0] = 0
        bounds[1:] = self.bidx + 1
        if nb:
            bounds[nb] = n
        self.bounds = bounds  # position k <-> cut before equation bounds[k]
        pcons = np.zeros(nb, bool)
        for k, i in enumerate(self.bidx):
            pcons[k] = any(not isinstance(a, jex_core.Literal) and a not in dep and a in src
                           for a in self.eqns[i].invars)
        self.pcons_prefix = np.concatenate(([0], np.cumsum(pcons)))
        self.pcons = pcons
        # Bytes of batch-dependent values live across the cut before equation i (0 <= i <= n).
        diff = np.zeros(n + 2)
        for i in self.bidx:
            for v in self.eqns[i].outvars:
                lu = last_use.get(v, -1)
                if lu > i:
                    diff[i + 1] += aval_bytes(v.aval)
                    diff[lu + 1] -= aval_bytes(v.aval)
        self.cross = np.cumsum(diff)[: n + 1][bounds]  # per position
        self.sig_interner = _Interner()
        struct_interner = _Interner()
        beqns = [self.eqns[i] for i in self.bidx]
        self.sig_ids = np.array([self.sig_interner(eqn_signature(e)) for e in beqns], dtype=np.int64)
        struct_cache: dict[tuple, int] = {}
        struct_ids = []
        for e in beqns:
            if jex_core.jaxprs_in_params(e.params):
                struct_ids.append(struct_interner(structure_signature(e)))
            else:
                key = (e.primitive.name, len(e.invars), len(e.outvars))
                sid = struct_cache.get(key)
                if sid is None:
                    sid = struct_cache[key] = struct_interner(structure_signature(e))
                struct_ids.append(sid)
        self.struct_ids = np.array(struct_ids, dtype=np.int64)
        self.weights = np.array([_weight(e) for e in beqns], dtype=np.float64)
        self.wprefix = np.concatenate(([0.0], np.cumsum(self.weights)))
        self._fp_memo: dict = {}

    # -- classification --------------------------------------------------------------------------

    def kind(self, v) -> str:
        if v in self.dep:
            return "b"
        if v in self.param_src:
            return "p"
        return "c"

    def positions(self, start: int, stop: int) -> tuple[int, int]:
        """Batch-dependent equations inside the equation range ``[start, stop)``, as positions."""
        return int(np.searchsorted(self.bidx, start)), int(np.searchsorted(self.bidx, stop))

    def canon(self, k1: int, k2: int, ids=None):
        """Canonical form of the batch-dependent equations at positions ``[k1, k2)``."""
        ids = self.sig_ids if ids is None else ids
        eqns = [self.eqns[i] for i in self.bidx[k1:k2]]
        end = self.bounds[k2] if k2 < self.nb else len(self.eqns)
        last_use = self.last_use

        def escapes_of(pos):
            return [v for e in eqns for v in e.outvars if last_use.get(v, -1) >= end]

        return _canon(eqns, ids[k1:k2], self.kind, escapes_of)

    def fingerprint_of_key(self, key) -> str:
        fp = self._fp_memo.get(key)
        if fp is None:
            items, esc = key
            strs = self.sig_interner.strs
            text = repr(([(strs[s], r) for s, r in items], esc))
            fp = self._fp_memo[key] = hashlib.sha256(text.encode()).hexdigest()[:16]
        return fp

    # -- repeat detection --------------------------------------------------------------------------

    def find_repeat(self, lo: int, hi: int):
        """Best verified tandem repeat in positions ``[lo, hi)``: ``(start, period, copies)`` or None.

        Longest covered span (weighted by equations, nested ones included) first, then exact
        signatures over operation-only ones, then the smallest period.
        """
        if hi - lo < 2 or self.pcons_prefix[hi] - self.pcons_prefix[lo] < 2:
            return None
        best = None  # (coverage, start, period, copies)
        wpre = self.wprefix
        n = hi - lo
        for tier, ids in ((0, self.sig_ids), (1, self.struct_ids)):
            seg = ids[lo:hi]
            wseg = self.weights[lo:hi]
            for p in range(1, n // 2 + 1):
                m = seg[:-p] == seg[p:]
                if int(np.count_nonzero(m)) < p:
                    continue
                if best is not None:
                    maxwin = float(np.max(wpre[lo + p:hi + 1] - wpre[lo:hi - p + 1]))
                    if float(wseg[:-p][m].sum()) + maxwin <= best[0]:
                        continue  # ties keep the earlier candidate (exact tier, smaller period)
                d = np.diff(np.concatenate(([0], m.view(np.int8), [0])))
                starts = np.flatnonzero(d == 1)
                lens = np.flatnonzero(d == -1) - starts
                ok = lens >= p
                if not ok.any():
                    continue
                starts, lens = starts[ok] + lo, lens[ok]
                copies = (lens + p) // p
                cov = copies * (wpre[starts + p] - wpre[starts])
                for k in np.argsort(-cov, kind="stable"):
                    c = float(cov[k])
                    if best is not None and c <= best[0]:
                        break
                    got = self._place(int(starts[k]), int(starts[k] + lens[k] + p), p, int(copies[k]), ids)
                    if got is not None:
                        best = (c, got, p, int(copies[k]))
                        break
        return None if best is None else best[1:]

    def _place(self, a: int, e: int, p: int, copies: int, ids):
        """Phase of ``copies`` copies of period ``p`` in the periodic region ``[a, e)``: fewest bytes
        crossing the two ends, latest on ties. Returns the start if every copy reads parameters and
        all copies have the same canonical form, else None."""
        span = copies * p
        offs = np.arange(a, e - span + 1)
        cost = self.cross[offs] + self.cross[offs + span]
        # Ties go to the latest phase: in residual networks only unary operations after the residual
        # add (a bias, a post-norm) tie with the true boundary, and they end the block.
        s = int(offs[len(offs) - 1 - int(np.argmin(cost[::-1]))])
        cuts = np.arange(s, s + span + 1, p)
        if np.any(self.pcons_prefix[cuts[1:]] - self.pcons_prefix[cuts[:-1]] == 0):
            return None
        first = None
        for c in range(copies):
            key = self.canon(s + c * p, s + (c + 1) * p, ids)[0]
            if first is None:
                first = key
            elif key != first:
                return None
        return s

    def segment(self, lo: int, hi: int, kinds: list[str]) -> list[tuple[int, int]]:
        """Positions ``[lo, hi)`` as repeated blocks and what lies between them (searched recursively).
        Returns position ranges; appends "block" / "other" per range to ``kinds``."""
        if lo >= hi:
            return []
        rep = self.find_repeat(lo, hi)
        if rep is None:
            kinds.append("other")
            return [(lo, hi)]
        s, p, copies = rep
        out = self.segment(lo, s, kinds)
        out += [(s + c * p, s + (c + 1) * p) for c in range(copies)]
        kinds += ["block"] * copies
        out += self.segment(s + copies * p, hi, kinds)
        return out

    # -- scans ---------------------------------------------------------------------------------------

    def expandable_scan(self, i: int) -> bool:
        e = self.eqns[i]
        if e.primitive.name != "scan" or not self.is_batch[i]:
            return False
        nc, nk = e.params["num_consts"], e.params["num_carry"]
        xs = e.invars[nc + nk:]
        return any(not isinstance(a, jex_core.Literal) and a not in self.dep and a in self.param_src for a in xs)


# ----------------------------------------------------------------------------------------------------
# Residuals of the backward pass


def _eval_fn(eqns, ext_vars, out_atoms) -> jex_core.ClosedJaxpr:
    return jex_core.ClosedJaxpr(new_jaxpr((), list(ext_vars), list(out_atoms), list(eqns), frozenset(), "autopp layer"),
                                ())


def _residual_bytes(layer: jex_core.ClosedJaxpr, in_avals, in_kinds) -> int:
    """Bytes of the residuals of the layer's VJP (every input differentiated) other than parameters and values
    computed from parameters only (``in_kinds``: 'b' batch, 'p' parameter, 'c' constant, per input)."""
    sds = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in in_avals]
    forward = forward_with_vjp(layer, range(len(in_avals)))
    closed = jax.make_jaxpr(lambda *a: forward(*a)[1])(*sds)
    j = closed.jaxpr
    dep = {v for v, kd in zip(j.invars, in_kinds) if kd == "b"}
    par = {v for v, kd in zip(j.invars, in_kinds) if kd == "p"}
    for e in j.eqns:
        ins = [a for a in e.invars if not isinstance(a, jex_core.Literal)]
        if any(a in dep for a in ins):
            dep.update(e.outvars)
        elif any(a in par for a in ins):
            par.update(e.outvars)
    seen = set()
    total = 0
    for a in j.outvars:
        if isinstance(a, jex_core.Literal) or a in seen or (a in par and a not in dep):
            continue
        seen.add(a)
        total += aval_bytes(a.aval)
    return total


def _activation_bytes(fp: str, eqns, ext_vars, escapes, kind, fallback: int) -> int:
    hit = _residual_cache.get(fp)
    if hit is not None:
        return hit
    if not eqns:
        return 0
    try:
        val = _residual_bytes(_eval_fn(eqns, ext_vars, escapes), [v.aval for v in ext_vars],
                              [kind(v) for v in ext_vars])
    except Exception as err:  # noqa: BLE001 - e.g. a primitive without a VJP rule
        warnings.warn(f"autopp: could not trace the VJP of a layer ({type(err).__name__}: {err}); "
                      "counting the batch-dependent values it defines as its activations.", stacklevel=4)
        val = fallback
    if len(_residual_cache) >= _MAX_RESIDUAL_CACHE:
        _residual_cache.clear()
    _residual_cache[fp] = val
    return val


# ----------------------------------------------------------------------------------------------------
# Layers


def _balanced_units(an: _Analysis, num_layers: int) -> list[_Unit]:
    from autopp.profiler._partition import split_stages

    split = split_stages(an.forward, an.batch_invars, num_layers)
    bounds = [0]
    for stage in split.stage_eqns[:-1]:
        bounds.append(max(i for i in stage if an.is_batch[i]) + 1)
    bounds.append(len(an.eqns))
    return [_Unit(bounds[k], bounds[k + 1], "split") for k in range(num_layers)]


def _default_num_layers(an: _Analysis) -> int:
    count = sum(1 for k, i in enumerate(an.bidx) if an.pcons[k] and an.eqns[i].primitive.name in _MATMULS)
    return max(1, min(count, an.nb))


def _repeat_units(an: _Analysis) -> list[_Unit]:
    n = len(an.eqns)
    scans = [i for i in an.bidx if an.expandable_scan(int(i))]
    units: list[_Unit] = []
    lo_pos, lo_eqn = 0, 0
    for i in list(scans) + [None]:
        hi_pos = an.nb if i is None else int(np.searchsorted(an.bidx, i))
        hi_eqn = n if i is None else int(i)
        kinds: list[str] = []
        ranges = an.segment(lo_pos, hi_pos, kinds)
        segs = []
        for (k1, k2), kd in zip(ranges, kinds):
            segs.append(_Unit(int(an.bounds[k1]), int(an.bounds[k2]), kd))
        if segs:
            segs[0].start = lo_eqn
            segs[-1].stop = hi_eqn
        elif hi_eqn > lo_eqn:  # parameter-only equations before a scan
            segs = [_Unit(lo_eqn, hi_eqn, "other")]
        units += segs
        if i is not None:
            units += [_Unit(int(i), int(i) + 1, "scan", k) for k in range(an.eqns[i].params["length"])]
            lo_pos, lo_eqn = hi_pos + 1, int(i) + 1
    if not scans and all(u.kind == "other" for u in units):
        return []
    return units


def group_layers(forward: jex_core.ClosedJaxpr, batch_invars: Sequence[bool], param_invars: Sequence[bool], *,
                 num_layers: int | None = None) -> list[Layer]:
    """Group the equations of a loss's forward jaxpr into layers with per-layer costs.

    ``batch_invars`` / ``param_invars``: per forward invar, whether it derives from the batch (e.g.
    ``TracedStep.microbatched_grad_inputs``) / is a differentiated parameter (``GradSpec.diff_mask``).

    Without ``num_layers``: blocks are the longest tandem repeat in the sequence of batch-dependent
    equations (at least two copies, each reading parameters, all with one canonical form; exact
    signatures preferred, else operation-only signatures so that blocks of different widths are found
    too). What precedes them is ``"embed"``, what follows ``"head"`` (both searched again for repeats).
    Parameter-only equations belong to the layer of the next batch-dependent equation. A
    batch-dependent ``lax.scan`` whose scanned operands include parameters becomes one layer per
    iteration. With neither, the batch-dependent equations are split into one layer per
    parameter-consuming matmul, balanced by FLOPs and cut where few bytes cross
    (:func:`autopp.profiler.split_stages`).

    With ``num_layers``: exactly that many layers by that balanced split (a scan stays one equation).

    The layers' equation ranges are contiguous and cover all equations in order.
    """
    an = _Analysis(forward, batch_invars, param_invars)
    if not an.eqns or an.nb == 0:
        raise ValueError("group_layers: the forward jaxpr has no equation that depends on the batch.")
    if num_layers is not None:
        if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
            raise ValueError(f"group_layers: num_layers must be a positive int, got {num_layers!r}.")
        if num_layers > an.nb:
            raise ValueError(
                f"group_layers: the forward has only {an.nb} batch-dependent operation(s), so it cannot be "
                f"cut into num_layers={num_layers} layers; use num_layers <= {an.nb}."
            )
        units = _balanced_units(an, num_layers)
    else:
        units = _repeat_units(an) or _balanced_units(an, _default_num_layers(an))
    return _build_layers(an, units)


def _keys_reader(an: _Analysis, var_keys: dict):
    def keys_of(a, scale=1.0):
        if isinstance(a, jex_core.Literal) or a not in an.dep:
            return []
        if a in var_keys:
            return [(k, b * scale) for k, b in var_keys[a]]
        return [(a, aval_bytes(a.aval) * scale)]

    return keys_of


def _scan_body(an: _Analysis, i: int):
    """Fingerprint, cost and activation bytes of one iteration of the scan at equation ``i``."""
    e = an.eqns[i]
    body = e.params["jaxpr"]
    bj = body.jaxpr
    nc, nk = e.params["num_consts"], e.params["num_carry"]
    outer = list(e.invars)
    kinds = []
    for j, a in enumerate(outer):
        if nc <= j < nc + nk and e.outvars[j - nc] in an.dep:
            kinds.append("b")
        else:
            kinds.append("c" if isinstance(a, jex_core.Literal) else an.kind(a))
    dep = {v for v, kd in zip(bj.invars, kinds) if kd == "b"}
    src = {v: frozenset(((0, None, 1.0),)) for v, kd in zip(bj.invars, kinds) if kd == "p"}
    beqns = []
    for be in bj.eqns:
        if any(not isinstance(a, jex_core.Literal) and a in dep for a in be.invars):
            dep.update(be.outvars)
            beqns.append(be)
    _param_flow(bj.eqns, dep.__contains__, src)

    def kind(v):
        return "b" if v in dep else ("p" if v in src else "c")

    sig_ids = [an.sig_interner(eqn_signature(be)) for be in beqns]
    escapes = [a for a in bj.outvars if isinstance(a, jex_core.Literal) or a in dep]
    key, ext_vars, esc = _canon(beqns, sig_ids, kind, lambda pos: escapes)
    fp = an.fingerprint_of_key(key)
    fallback = sum(aval_bytes(v.aval) for be in beqns for v in be.outvars)
    act = _activation_bytes(fp, beqns, ext_vars, esc, kind, int(fallback))
    return fp, jaxpr_cost(bj), act


def _build_layers(an: _Analysis, units: list[_Unit]) -> list[Layer]:
    eqns = an.eqns
    # Keys of batch-dependent values: top-level vars; scan carries between iterations; per-iteration
    # slices of an expanded scan's stacked outputs. var_keys maps those outputs to their keys.
    var_keys: dict = {}
    keys_of = _keys_reader(an, var_keys)
    defs: list[dict] = []
    reads: list[dict] = []
    preads: list[set] = []  # (param index, token, fraction)
    info: list[tuple] = []
    scan_cache: dict[int, tuple] = {}
    block_no = 0
    for u in units:
        d: dict = {}
        r: dict = {}
        pr: set = set()
        if u.kind == "scan":
            i, k = u.start, u.iteration
            e = eqns[i]
            length = e.params["length"]
            nc, nk = e.params["num_consts"], e.params["num_carry"]
            consts, init, xs = e.invars[:nc], e.invars[nc:nc + nk], e.invars[nc + nk:]
            carry_out, ys = e.outvars[:nk], e.outvars[nk:]
            for a in consts:
                r.update(keys_of(a))
                if not isinstance(a, jex_core.Literal) and a not in an.dep:
                    pr.update(an.param_src.get(a, ()))
            for a in xs:
                r.update(keys_of(a, 1.0 / length))
                if not isinstance(a, jex_core.Literal) and a not in an.dep:
                    pr.update((idx, ("scan", i, k, tok), fr / length) for idx, tok, fr in an.param_src.get(a, ()))
            for j, (a, out) in enumerate(zip(init, carry_out)):
                if out not in an.dep:
                    continue
                if k == 0:
                    r.update(keys_of(a))
                else:
                    r[("carry", i, k - 1, j)] = aval_bytes(out.aval)
                d[out if k == length - 1 else ("carry", i, k, j)] = aval_bytes(out.aval)
            for j, out in enumerate(ys):
                if out in an.dep:
                    key = ("ys", i, k, j)
                    d[key] = aval_bytes(out.aval) / length
                    var_keys.setdefault(out, []).append((key, aval_bytes(out.aval) / length))
            if i not in scan_cache:
                scan_cache[i] = _scan_body(an, i)
            fp, cost, act = scan_cache[i]
            name = f"block {block_no}"
            block_no += 1
        else:
            cost = ZERO
            for idx in range(u.start, u.stop):
                cost = cost + eqn_cost(eqns[idx])
            k1, k2 = an.positions(u.start, u.stop)
            defined = set()
            fallback = 0.0
            for idx in an.bidx[k1:k2]:
                e = eqns[idx]
                for a in e.invars:
                    if isinstance(a, jex_core.Literal):
                        continue
                    if a in an.dep:
                        if a not in defined:
                            r.update(keys_of(a))
                    else:
                        pr.update(an.param_src.get(a, ()))
                for v in e.outvars:
                    for key, b in keys_of(v):
                        d[key] = b
                        fallback += b
                defined.update(e.outvars)
            key, ext_vars, escapes = an.canon(k1, k2)
            fp = an.fingerprint_of_key(key)
            beqns = [eqns[idx] for idx in an.bidx[k1:k2]]
            act = _activation_bytes(fp, beqns, ext_vars, escapes, an.kind, int(fallback))
            if u.kind == "block":
                name = f"block {block_no}"
                block_no += 1
            else:
                name = ""
        defs.append(d)
        reads.append(r)
        preads.append(pr)
        info.append((fp, cost, act, name))

    producer: dict = {}
    for li, d in enumerate(defs):
        for key in d:
            producer[key] = li
    consumed: list[set] = [set() for _ in units]
    for li, r in enumerate(reads):
        for key in r:
            src = producer.get(key)
            if src is not None and src != li:
                consumed[src].add(key)
    for a in an.outvar_set:
        for key, _ in keys_of(a):
            src = producer.get(key)
            if src is not None:
                consumed[src].add(key)

    claimed: dict[int, float] = {}
    layers = []
    last = len(units) - 1
    for li, u in enumerate(units):
        fp, cost, act, name = info[li]
        if not name:
            if u.kind == "split":
                name = f"layer {li}"
            elif li == 0 and last > 0:
                name = "embed"
            elif li == last and last > 0:
                name = "head"
            else:
                name = f"layer {li}"
        fracs: dict[int, float] = {}
        for idx, _, fr in preads[li]:
            fracs[idx] = min(1.0, fracs.get(idx, 0.0) + fr)
        own_b = shared_b = 0.0
        own_i, shared_i = [], []
        for idx in sorted(fracs):
            frac = fracs[idx]
            prev = claimed.get(idx, 0.0)
            own = min(frac, 1.0 - prev)
            if own < 1e-9:
                own = 0.0
            claimed[idx] = prev + own
            nb = an.param_nbytes.get(idx, 0)
            if own > 0:
                own_b += own * nb
                own_i.append(idx)
            if frac - own > 1e-9:
                shared_b += (frac - own) * nb
                shared_i.append(idx)
        edges: dict[int, float] = {}
        in_b = 0.0
        for key, b in reads[li].items():
            src = producer.get(key)
            if src == li:
                continue
            in_b += b
            if src is not None:
                edges[src] = edges.get(src, 0.0) + b
        out_b = sum(defs[li][key] for key in consumed[li])
        layers.append(Layer(
            index=li,
            name=name,
            eqn_range=(u.start, u.stop),
            iteration=u.iteration,
            fingerprint=fp,
            flops=float(cost.flops),
            transcendentals=float(cost.transcendentals),
            bytes_accessed=float(cost.bytes_accessed),
            param_bytes=int(round(own_b)),
            shared_param_bytes=int(round(shared_b)),
            param_indices=tuple(own_i),
            shared_param_indices=tuple(shared_i),
            activation_bytes=int(act),
            output_bytes=int(round(out_b)),
            input_bytes=int(round(in_b)),
            reads_from=tuple((src, int(round(b))) for src, b in sorted(edges.items())),
        ))
    return layers

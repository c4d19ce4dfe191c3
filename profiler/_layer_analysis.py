"""What :func:`autopp.profiler.group_layers` cuts by: the forward jaxpr's batch-dependent equations, the flow of
parameters through the parameter-only ones, canonical forms and fingerprints of equation ranges, and the search for
the model's repeated block (a tandem repeat of equation signatures)."""

from __future__ import annotations

import dataclasses
import hashlib

import numpy as np
from jax.extend import core as jex_core

from autopp.core import (FUSED_ATTENTION_SCOPE, differentiable_vars, eqn_signature, inner_jaxpr, literal_signature,
                         name_stack, structure_signature)
from autopp.profiler._costs import aval_bytes

__all__ = ["LayerAnalysis", "Unit", "canonical_form", "param_flow"]


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


def layer_signature(eqn) -> str:
    """:func:`autopp.core.eqn_signature`, and for an equation of a fused attention call its scope's name: a sliding
    window's mask is computed from constants, which signatures do not see, so a local and a global attention layer
    would otherwise be one layer, priced as whichever comes first (a user trial: Gemma-2's alternating layers)."""
    stack = name_stack(eqn)
    at = stack.find(FUSED_ATTENTION_SCOPE)
    sig = eqn_signature(eqn)
    return sig if at < 0 else sig + "@" + stack[at:].split("/", 1)[0].rstrip(")")


def canonical_form(eqns, sig_ids, kind, escapes_of):
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


def param_flow(eqns, is_batch_var, src: dict) -> None:
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
class Unit:
    """A layer under construction: equations ``[start, stop)``, or one iteration of the scan at ``start``."""

    start: int
    stop: int
    kind: str  # "block", "other", "scan", "split"
    iteration: int | None = None


class LayerAnalysis:
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
        # batch values that carry a cotangent (they depend on a parameter), the others the batch's data itself
        self.diffable = differentiable_vars(jaxpr, param_invars)
        self.is_batch = is_batch
        self.last_use = last_use
        self.param_nbytes: dict[int, int] = {}
        src: dict = {}
        for i, (v, p, b) in enumerate(zip(jaxpr.invars, param_invars, batch_invars)):
            if p and not b:
                src[v] = frozenset(((i, None, 1.0),))
                self.param_nbytes[i] = aval_bytes(v.aval)
        param_flow(self.eqns, dep.__contains__, src)
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
        self.sig_ids = np.array([self.sig_interner(layer_signature(e)) for e in beqns], dtype=np.int64)
        struct_cache: dict[tuple, int] = {}
        struct_ids = []
        for e in beqns:
            if next(jex_core.jaxprs_in_params(e.params), None) is not None:
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

        return canonical_form(eqns, ids[k1:k2], self.kind, escapes_of)

    def fingerprint_of_key(self, key, data_inputs: tuple = ()) -> str:
        """The fingerprint of a canonical key; ``data_inputs``: the positions of the external inputs that are the
        batch's data (read without a cotangent: no input gradient), which make a layer another program."""
        fp = self._fp_memo.get((key, data_inputs))
        if fp is None:
            items, esc = key
            strs = self.sig_interner.strs
            text = repr(([(strs[s], r) for s, r in items], esc)) + (f"data{data_inputs}" if data_inputs else "")
            fp = self._fp_memo[(key, data_inputs)] = hashlib.sha256(text.encode()).hexdigest()[:16]
        return fp

    def data_inputs(self, ext) -> tuple[int, ...]:
        """Positions, among a unit's external inputs ``ext`` (in first-use order), of the batch's data."""
        return tuple(k for k, v in enumerate(ext) if v in self.dep and v not in self.diffable)

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
        return None if best is None else self._finest(*best[1:])

    def _finest(self, s: int, p: int, copies: int) -> tuple[int, int, int]:
        """The same span as ``copies`` copies of a shorter period that divides ``p``, if the operations (not
        necessarily the shapes) repeat so: 48 blocks whose widths repeat every 24 are 48 blocks, not 2 of 24."""
        span = copies * p
        seg = self.struct_ids[s:s + span]
        for q in range(1, p):
            if p % q or not np.array_equal(seg[:-q], seg[q:]):
                continue
            cuts = np.arange(s, s + span + 1, q)
            if np.any(self.pcons_prefix[cuts[1:]] - self.pcons_prefix[cuts[:-1]] == 0):
                continue
            first = self.canon(s, s + q, self.struct_ids)[0]
            if all(self.canon(a, a + q, self.struct_ids)[0] == first for a in cuts[1:-1]):
                return s, q, span // q
        return s, p, copies

    def _place(self, a: int, e: int, p: int, copies: int, ids):
        """Phase of ``copies`` copies of period ``p`` in the periodic region ``[a, e)``: fewest bytes
        crossing the two ends, latest on ties. Returns the start if every copy reads parameters and
        all copies have the same canonical form, else None."""
        span = copies * p
        offs = np.arange(a, e - span + 1)
        cost = self.cross[offs] + self.cross[offs + span]
        # Ties go to the latest phase: in residual networks only unary operations after the residual
        # add (a bias, a post-norm) tie with the true boundary, and they end the block. A phase whose copies
        # differ is passed over for the next cheapest: a head that begins as a block does (a norm, a cast, a
        # matmul) extends the periodic region past the last block, and a phase shifted into it can tie with the
        # blocks' own boundary while its last copy ends inside the head (a user's model was found to have no
        # blocks at all, its attention then cut in two).
        for j in sorted(range(len(offs)), key=lambda j: (cost[j], -j)):
            s = int(offs[j])
            if self._copies_alike(s, p, copies, ids):
                return s
        return None

    def _copies_alike(self, s: int, p: int, copies: int, ids) -> bool:
        """Whether ``copies`` copies of period ``p`` from ``s`` each read parameters and have one canonical form."""
        cuts = np.arange(s, s + copies * p + 1, p)
        if np.any(self.pcons_prefix[cuts[1:]] - self.pcons_prefix[cuts[:-1]] == 0):
            return False
        first = self.canon(s, s + p, ids)[0]
        return all(self.canon(s + c * p, s + (c + 1) * p, ids)[0] == first for c in range(1, copies))

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
        # a block next to the repeat with the same operations but another dataflow in one of them (the first block
        # adds its auxiliary loss to a literal 0.0, the others to the running sum) is a block too
        while s - p >= lo and self._same_ops(s - p, s, p):
            s, copies = s - p, copies + 1
        while s + (copies + 1) * p <= hi and self._same_ops(s + copies * p, s, p):
            copies += 1
        out = self.segment(lo, s, kinds)
        out += [(s + c * p, s + (c + 1) * p) for c in range(copies)]
        kinds += ["block"] * copies
        out += self.segment(s + copies * p, hi, kinds)
        return out

    def _same_ops(self, a: int, s: int, p: int) -> bool:
        """Whether positions ``[a, a + p)`` run the operations of ``[s, s + p)`` (and read parameters)."""
        return (bool(np.array_equal(self.struct_ids[a:a + p], self.struct_ids[s:s + p]))
                and self.pcons_prefix[a + p] - self.pcons_prefix[a] > 0)

    # -- scans ---------------------------------------------------------------------------------------

    def expandable_scan(self, i: int) -> bool:
        e = self.eqns[i]
        if e.primitive.name != "scan" or not self.is_batch[i]:
            return False
        nc, nk = e.params["num_consts"], e.params["num_carry"]
        xs = e.invars[nc + nk:]
        return any(not isinstance(a, jex_core.Literal) and a not in self.dep and a in self.param_src for a in xs)

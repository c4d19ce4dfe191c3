"""Group a forward jaxpr into layers: embedding, repeated blocks, head; with per-layer costs.

:func:`group_layers` cuts the loss's forward jaxpr into contiguous ranges of equations. It looks for
the model's repeated block (a tandem repeat of equation signatures: identical transformer blocks, or
blocks whose shapes differ but whose operations match), expands a ``lax.scan`` over stacked
parameters into one layer per iteration, and otherwise falls back to a cost-balanced split. Each
:class:`Layer` carries the forward FLOPs, the parameter bytes it reads, the bytes of the residuals
its backward pass saves (from the VJP of the stage the runtime would cut for it, see
:mod:`autopp.profiler._residuals`) and the bytes crossing its end. The analysis it cuts by (batch
dependence, parameter flow, canonical forms, the repeat search) is :mod:`autopp.profiler._layer_analysis`.

Everything works on abstract values (``jax.ShapeDtypeStruct``); nothing is allocated.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
from jax.extend import core as jex_core

from autopp.profiler._costs import ZERO, aval_bytes, eqn_cost, jaxpr_cost
from autopp.profiler._layer_analysis import LayerAnalysis, Unit, canonical_form, layer_signature, param_flow
from autopp.profiler._residuals import activation_bytes

__all__ = ["Layer", "group_layers", "repeated_fingerprints"]

_MATMULS = frozenset({"dot_general", "conv_general_dilated"})


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

    param_fractions: tuple[float, ...] = ()
    """The part of each parameter in :attr:`param_indices` this layer owns (a scan iteration: its rows of the
    stacked parameter, ``1 / length``; a parameter a layer reads whole: 1). Empty: 1 for every one."""

    activation_bytes: int
    """Bytes of the residuals that the backward pass of this layer saves: the residuals of ``jax.vjp``
    of the layer's sub-jaxpr (its batch-dependent equations), excluding parameters and values computed
    from parameters only (weights, their transposes, broadcast biases). Saved inputs and batch-shaped
    constants (attention masks) count; scalar literals do not."""

    output_bytes: int
    """Bytes of batch-dependent values this layer produces that a later layer (or the forward's
    outputs, e.g. the loss) reads: what crosses the layer's end."""

    built_bytes: int = 0
    """Bytes of the values built from parameters alone (not a cast, transpose, shape or rows of one parameter: a weight
    made by ``jnp.kron`` or ``U @ V`` of factors, a weight-normalised ``g * v / |v|``) that the layer's backward reads.
    Not in :attr:`activation_bytes`: they do not scale with the microbatch."""

    input_bytes: int
    """Bytes of batch-dependent values this layer reads that it does not produce (outputs of earlier
    layers and the batch inputs)."""

    reads_from: tuple[tuple[int, int], ...] = ()
    """``(producer layer index, bytes)`` for every earlier layer whose batch-dependent values this
    layer reads, from the actual dataflow (skip connections included): the edges of
    :func:`autopp.profiler.cost_graph`."""

    crossing_bytes: int = 0
    """Bytes of batch-dependent values made by this layer or an earlier one that a later layer (or the forward's
    outputs) reads: what a stage boundary placed after this layer sends, skip connections included (a U-Net's
    encoder features, an encoder's output read by every cross-attention)."""

    def to_dict(self) -> dict:
        """JSON-friendly dict of all fields (tuples become lists)."""
        d = dataclasses.asdict(self)
        d["eqn_range"] = list(self.eqn_range)
        d["param_indices"] = list(self.param_indices)
        d["shared_param_indices"] = list(self.shared_param_indices)
        d["param_fractions"] = list(self.param_fractions)
        d["reads_from"] = [list(e) for e in self.reads_from]
        return d


def repeated_fingerprints(layers: Sequence[Layer]) -> dict[str, list[int]]:
    """Fingerprints shared by two or more layers -> the indices of those layers (first-seen order)."""
    groups: dict[str, list[int]] = {}
    for layer in layers:
        groups.setdefault(layer.fingerprint, []).append(layer.index)
    return {fp: idx for fp, idx in groups.items() if len(idx) > 1}




# ----------------------------------------------------------------------------------------------------
# Layers


def _balanced_units(an: LayerAnalysis, num_layers: int, exact: bool = True) -> list[Unit]:
    """``num_layers`` units balanced by FLOPs; unless ``exact``, none cut inside a fused attention call (a bound
    inside one moves to its end, and units that meet are merged): its scores would become a layer's output."""
    from autopp.profiler._partition import split_stages
    from autopp.profiler._strategies import _attention_regions

    split = split_stages(an.forward, an.batch_invars, num_layers)
    bounds = [0]
    for stage in split.stage_eqns[:-1]:
        bounds.append(max(i for i in stage if an.is_batch[i]) + 1)
    bounds.append(len(an.eqns))
    if not exact:
        spans = [(min(g), max(g)) for g in _attention_regions(an.forward.jaxpr)[0]]
        bounds = sorted({next((hi + 1 for lo, hi in spans if lo < b <= hi), b) for b in bounds})
    return [Unit(a, b, "split") for a, b in zip(bounds, bounds[1:])]


def _default_num_layers(an: LayerAnalysis) -> int:
    count = sum(1 for k, i in enumerate(an.bidx) if an.pcons[k] and an.eqns[i].primitive.name in _MATMULS)
    return max(1, min(count, an.nb))


def _repeat_units(an: LayerAnalysis) -> list[Unit]:
    n = len(an.eqns)
    scans = [i for i in an.bidx if an.expandable_scan(int(i))]
    units: list[Unit] = []
    lo_pos, lo_eqn = 0, 0
    for i in list(scans) + [None]:
        hi_pos = an.nb if i is None else int(np.searchsorted(an.bidx, i))
        hi_eqn = n if i is None else int(i)
        kinds: list[str] = []
        ranges = an.segment(lo_pos, hi_pos, kinds)
        segs = []
        for (k1, k2), kd in zip(ranges, kinds):
            segs.append(Unit(int(an.bounds[k1]), int(an.bounds[k2]), kd))
        if segs:
            segs[0].start = lo_eqn
            segs[-1].stop = hi_eqn
        elif hi_eqn > lo_eqn:  # parameter-only equations before a scan
            segs = [Unit(lo_eqn, hi_eqn, "other")]
        units += segs
        if i is not None:
            units += [Unit(int(i), int(i) + 1, "scan", k) for k in range(an.eqns[i].params["length"])]
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
    an = LayerAnalysis(forward, batch_invars, param_invars)
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
        units = _repeat_units(an) or _balanced_units(an, _default_num_layers(an), exact=False)
    return _build_layers(an, units)


def _keys_reader(an: LayerAnalysis, var_keys: dict):
    def keys_of(a, scale=1.0):
        if isinstance(a, jex_core.Literal) or a not in an.dep:
            return []
        if a in var_keys:
            return [(k, b * scale) for k, b in var_keys[a]]
        return [(a, aval_bytes(a.aval) * scale)]

    return keys_of


def _scan_body(an: LayerAnalysis, i: int):
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
    beqns, bids = [], []
    for j, be in enumerate(bj.eqns):
        if any(not isinstance(a, jex_core.Literal) and a in dep for a in be.invars):
            dep.update(be.outvars)
            beqns.append(be)
            bids.append(j)
    param_flow(bj.eqns, dep.__contains__, src)

    def kind(v):
        return "b" if v in dep else ("p" if v in src else "c")

    sig_ids = [an.sig_interner(layer_signature(be)) for be in beqns]
    escapes = [a for a in bj.outvars if isinstance(a, jex_core.Literal) or a in dep]
    key, _, _ = canonical_form(beqns, sig_ids, kind, lambda pos: escapes)
    fp = an.fingerprint_of_key(key)
    fallback = sum(aval_bytes(v.aval) for be in beqns for v in be.outvars)
    act = activation_bytes(fp, body, bids, kind, int(fallback))
    return fp, jaxpr_cost(bj), act


def _build_layers(an: LayerAnalysis, units: list[Unit]) -> list[Layer]:
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
            key, ext, _ = an.canon(k1, k2)
            # a layer reading the batch's data has no input gradient: another program than one reading activations
            fp = an.fingerprint_of_key(key, an.data_inputs(ext))
            act = activation_bytes(fp, an.forward, an.bidx[k1:k2], an.kind, int(fallback))
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

    # what crosses a boundary after each layer: every value from its producer up to its last reader
    last_reader: dict = {}
    for li, r in enumerate(reads):
        for key in r:
            last_reader[key] = li
    for a in an.outvar_set:
        for key, _ in keys_of(a):
            last_reader[key] = len(units)
    crossing = np.zeros(len(units) + 1)
    for li, d in enumerate(defs):
        for key, b in d.items():
            end = last_reader.get(key, li)
            if producer.get(key) == li and end > li:
                crossing[li] += b
                crossing[end] -= b
    crossing = np.cumsum(crossing)

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
        own_i, own_f, shared_i = [], [], []
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
                own_f.append(own)
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
            param_fractions=tuple(own_f),
            activation_bytes=int(act[0]),
            built_bytes=int(act[1]),
            output_bytes=int(round(out_b)),
            input_bytes=int(round(in_b)),
            reads_from=tuple((src, int(round(b))) for src, b in sorted(edges.items())),
            crossing_bytes=int(round(crossing[li])) if li < last else 0,
        ))
    return layers

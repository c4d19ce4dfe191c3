"""Activation memory of a layer: the bytes of the residuals its backward pass keeps, read off the VJP of the stage the
runtime would cut for the layer's batch-dependent equations (:func:`autopp.profiler._layer_stage.layer_graph` and the
one per-stage VJP, :func:`autopp.core.forward_with_vjp`)."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence

import jax
from jax.extend import core as jex_core

from autopp.core import forward_with_vjp
from autopp.profiler._costs import aval_bytes
from autopp.profiler._layer_stage import layer_graph

__all__ = ["activation_bytes", "residual_bytes"]

_MAX_RESIDUAL_CACHE = 512
_residual_cache: dict[str, tuple[int, int]] = {}


_VIEWS = frozenset({"convert_element_type", "transpose", "reshape", "squeeze", "expand_dims", "broadcast_in_dim",
                    "slice", "dynamic_slice", "copy", "copy_p"})
"""Equations whose result is a parameter seen another way (its cast, transpose, shape, rows): what a layer reads as
such is held with the parameter (a cast weight is made again from it), not as a value of its own."""


def residual_bytes(layer: jex_core.ClosedJaxpr, in_kinds: Sequence[str], built: Sequence[bool] = ()) -> tuple[int, int]:
    """Bytes of the residuals of the layer's VJP (every input differentiated) other than parameters and values
    computed from parameters only (``in_kinds``: 'b' batch, 'p' parameter, 'c' constant, per input); and the bytes of
    the inputs marked ``built`` (values the loss builds from parameters: :func:`activation_bytes`) that are
    residuals."""
    invars = layer.jaxpr.invars
    sds = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in invars]
    forward = forward_with_vjp(layer, range(len(invars)))
    closed = jax.make_jaxpr(lambda *a: forward(*a)[1])(*sds)
    j = closed.jaxpr
    dep = {v for v, kd in zip(j.invars, in_kinds) if kd == "b"}
    par = {v for v, kd in zip(j.invars, in_kinds) if kd == "p"}
    built_in = {v for v, b in zip(j.invars, built) if b}
    for e in j.eqns:
        ins = [a for a in e.invars if not isinstance(a, jex_core.Literal)]
        if any(a in dep for a in ins):
            dep.update(e.outvars)
        elif any(a in par for a in ins):
            par.update(e.outvars)
    seen = set()
    total = built_total = 0
    for a in j.outvars:
        if isinstance(a, jex_core.Literal) or a in seen:
            continue
        seen.add(a)
        if a in built_in:
            built_total += aval_bytes(a.aval)
        if a in par and a not in dep:
            continue
        total += aval_bytes(a.aval)
    return total, built_total


def _built(closed: jex_core.ClosedJaxpr, values) -> list[bool]:
    """Per value of ``closed``: whether it is built from parameters by equations other than views of one
    (:data:`_VIEWS`): a weight made by ``jnp.kron`` or ``U @ V`` of factors, a weight-normalised ``g * v / |v|``."""
    producer = {v: e for e in closed.jaxpr.eqns for v in e.outvars}

    def built(v):
        while v in producer:
            e = producer[v]
            if e.primitive.name not in _VIEWS:
                return True
            operand = e.invars[0] if e.invars else None  # (a dynamic slice's indices: a view of its operand)
            if operand is None or isinstance(operand, jex_core.Literal):
                return False
            v = operand
        return False

    return [built(v) for v in values]


def activation_bytes(fp: str, closed: jex_core.ClosedJaxpr, eqn_ids: Sequence[int], kind: Callable[[object], str],
                     fallback: int) -> tuple[int, int]:
    """Residual bytes of the layer made of equations ``eqn_ids`` (its batch-dependent ones) of ``closed`` (the loss's
    forward, or a scan's body), cached by the layer's fingerprint ``fp``; ``kind(var)`` is 'b' / 'p' / 'c' for the
    values it reads. ``fallback`` when the VJP cannot be traced (e.g. a primitive without a VJP rule). And the bytes of
    the values built from parameters (:func:`_built`) the layer's backward reads: held whole whatever the
    microbatch, not with the parameters."""
    hit = _residual_cache.get(fp)
    if hit is not None:
        return hit
    if not len(eqn_ids):
        return 0, 0
    try:
        graph = layer_graph(closed, eqn_ids, [False] * len(closed.jaxpr.invars))
        kinds = [kind(v) for v in graph.inputs]
        built = [k == "p" and b for k, b in zip(kinds, _built(closed, graph.inputs))]
        val = residual_bytes(jex_core.ClosedJaxpr(graph.jaxpr, graph.consts), kinds, built)
    except Exception as err:  # noqa: BLE001 - e.g. a primitive without a VJP rule
        warnings.warn(f"autopp: could not trace the VJP of a layer ({type(err).__name__}: {err}); "
                      "counting the batch-dependent values it defines as its activations.", stacklevel=4)
        val = fallback, 0
    if len(_residual_cache) >= _MAX_RESIDUAL_CACHE:
        _residual_cache.clear()
    _residual_cache[fp] = val
    return val

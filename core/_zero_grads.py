"""Differentiated inputs whose gradient is zero or unused, taken out of the gradient (a pass on the traced step).

A weight frozen with ``jax.lax.stop_gradient`` inside the loss has a zero gradient; one whose gradient the optimizer
drops (``optax.multi_transform`` with ``optax.set_to_zero()``) has an unused one. Under ``jax.jit`` XLA removes the
work either way. A pipeline that took them as parameters would run their backward and hold a gradient accumulator
per weight between steps. This pass makes them what they are, weights the loss reads without differentiating them
(as if left out of ``argnums``), and computes their gradient, where the step still reads it, as zeros.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.extend import core as jex_core

from autopp.core import _compat

Literal = jex_core.Literal


_INEXACT: dict = {}


def _inexact(v) -> bool:
    dtype = getattr(v.aval, "dtype", None)
    hit = _INEXACT.get(dtype)
    if hit is None:
        hit = _INEXACT[dtype] = dtype is not None and bool(jnp.issubdtype(dtype, jnp.inexact))
    return hit


def cotangent_vars(jaxpr: jex_core.Jaxpr, outvars) -> set:
    """Variables of ``jaxpr`` that may carry a nonzero cotangent when ``outvars`` are differentiated: float
    variables that reach one of them by a path not cut by ``stop_gradient``. Calls, ``jax.checkpoint`` and each
    branch of a ``lax.cond`` are followed into their bodies; any other equation (``scan``, ``while``,
    ``custom_vjp``, ``custom_jvp``...) passes cotangents from every float output to every float input (a path is
    assumed)."""
    ct = {v for v in outvars if not isinstance(v, Literal) and _inexact(v)}
    for eqn in reversed(jaxpr.eqns):
        if not any(o in ct for o in eqn.outvars) or eqn.primitive.name == "stop_gradient":
            continue
        hit = [o in ct for o in eqn.outvars]
        bodies = _bodies(eqn)
        if bodies and all(len(b.outvars) == len(eqn.outvars) and len(b.invars) <= len(eqn.invars) for b in bodies):
            reached = [False] * len(eqn.invars)
            for body in bodies:  # a path through any of them (any branch) passes a cotangent
                inner = cotangent_vars(body, [o for o, h in zip(body.outvars, hit) if h])
                skip = len(eqn.invars) - len(body.invars)  # a cond's branch index
                for j, b in enumerate(body.invars):
                    reached[skip + j] = reached[skip + j] or b in inner
        else:
            reached = [True] * len(eqn.invars)
        ct.update(a for a, r in zip(eqn.invars, reached) if r and not isinstance(a, Literal) and _inexact(a))
    return ct


def _bodies(eqn) -> list[jex_core.Jaxpr]:
    """The jaxprs an equation runs on its own operands (its last ones) to make its own results: a call's body, a
    ``jax.checkpoint``'s, each branch of a ``lax.cond``; none for other equations."""
    body = _compat.call_body(eqn)
    if body is not None:
        return [body.jaxpr]
    if eqn.primitive.name in ("remat2", "checkpoint"):
        inner = eqn.params.get("jaxpr")
        return [getattr(inner, "jaxpr", inner)] if inner is not None else []
    if eqn.primitive.name == "cond":
        return [b.jaxpr for b in eqn.params.get("branches", ())]
    return []


def _needed_after(jaxpr: jex_core.Jaxpr, start: int) -> set:
    """Variables that equations from ``start`` on, which lead to the outputs or have effects, read (outputs
    included)."""
    needed = {v for v in jaxpr.outvars if not isinstance(v, Literal)}
    for eqn in reversed(jaxpr.eqns[start:]):
        if eqn.effects or any(o in needed for o in eqn.outvars):
            needed.update(a for a in eqn.invars if not isinstance(a, Literal))
    return needed


def zero_gradient_inputs(closed: jex_core.ClosedJaxpr, grad_index: int) -> tuple[int, ...]:
    """Positions among the gradient equation's inputs of the differentiated float inputs whose gradient is zero
    (no path to the loss that ``stop_gradient`` does not cut) or read by nothing after the gradient."""
    eqn = closed.jaxpr.eqns[grad_index]
    spec = eqn.params["spec"]
    fwd = spec.forward.jaxpr
    reached = cotangent_vars(fwd, fwd.outvars[:1])
    needed = _needed_after(closed.jaxpr, grad_index + 1)
    grads = dict(zip(spec.diff_indices, eqn.outvars[1 + spec.num_aux:]))
    return tuple(k for k, g in grads.items()
                 if _inexact(fwd.invars[k]) and (fwd.invars[k] not in reached or g not in needed))


def _zeros(aval):
    """(equations, the value) of zeros of ``aval`` as ``jnp.zeros`` traces them (a literal for a scalar)."""
    made = jax.make_jaxpr(lambda: jnp.zeros(aval.shape, aval.dtype))()
    return list(made.jaxpr.eqns), made.jaxpr.outvars[0]


def freeze_zero_gradients(closed: jex_core.ClosedJaxpr, grad_index: int) -> tuple[jex_core.ClosedJaxpr, dict]:
    """``closed`` with :func:`zero_gradient_inputs` no longer differentiated: the gradient equation returns the
    others' gradients, and each of theirs that the step reads is zeros made right after it. Unchanged when there
    is none, or when no differentiated input would remain (the loss reads no weight at all). Second: the variable
    that now holds each zero gradient the step reads -> the gradient equation's input position it belongs to."""
    frozen = set(zero_gradient_inputs(closed, grad_index))
    eqn = closed.jaxpr.eqns[grad_index]
    spec = eqn.params["spec"]
    if not frozen or frozen >= set(spec.diff_indices):
        return closed, {}
    head = 1 + spec.num_aux
    needed = _needed_after(closed.jaxpr, grad_index + 1)
    kept_outs, made, swap, zeroed = list(eqn.outvars[:head]), [], {}, {}
    for k, g in zip(spec.diff_indices, eqn.outvars[head:]):
        if k not in frozen:
            kept_outs.append(g)
        elif g in needed:
            eqns, value = _zeros(g.aval)
            made += eqns
            swap[g] = value
            if not isinstance(value, Literal):
                zeroed[value] = k
    new_spec = dataclasses.replace(spec, diff_mask=tuple(d and k not in frozen for k, d in enumerate(spec.diff_mask)),
                                   sunk_mask=spec.sunk_mask or spec.diff_mask)
    grad_eqn = eqn.replace(outvars=kept_outs, params={**eqn.params, "spec": new_spec})

    def sub(vs):
        return [swap.get(a, a) if not isinstance(a, Literal) else a for a in vs]

    later = [e.replace(invars=sub(e.invars)) for e in closed.jaxpr.eqns[grad_index + 1:]]
    eqns = [*closed.jaxpr.eqns[:grad_index], grad_eqn, *made, *later]
    return closed.replace(jaxpr=closed.jaxpr.replace(eqns=eqns, outvars=sub(closed.jaxpr.outvars))), zeroed


__all__ = ["cotangent_vars", "freeze_zero_gradients", "zero_gradient_inputs"]

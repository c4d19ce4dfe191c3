"""Sharding annotations a user's step carries for a mesh of its own: dropped or refused while autopp traces it.

``jax.lax.with_sharding_constraint`` computes nothing (its result equals its operand); its sharding names devices
of the user's mesh, which no pipeline stage runs on, so autopp drops it and lays out each stage itself. A
``jax.shard_map`` runs its body per device of the mesh it names, with collectives over that mesh's axes: it cannot
run on a stage's sub-mesh, and is refused with the fix.
"""

from __future__ import annotations

import warnings

from jax.extend import core as jex_core

from autopp.core._warn import user_stacklevel

Literal = jex_core.Literal

CONSTRAINT_PRIMITIVES = frozenset({"sharding_constraint", "reshard"})
"""Primitives that only say how a value is laid out (identity on values)."""

SHARD_MAP_PRIMITIVES = frozenset({"shard_map"})


def _drop(jaxpr: jex_core.Jaxpr) -> tuple[jex_core.Jaxpr, int]:
    swap: dict = {}
    count = 0
    eqns = []

    def sub(vs):
        return [a if isinstance(a, Literal) else swap.get(a, a) for a in vs]

    for e in jaxpr.eqns:
        if e.primitive.name in CONSTRAINT_PRIMITIVES and len(e.invars) == len(e.outvars):
            swap.update(zip(e.outvars, sub(e.invars)))
            count += 1
            continue
        params, inner = _inner_dropped(e.params)
        count += inner
        eqns.append(e.replace(invars=sub(e.invars), params=params) if (swap or inner) else e)
    if not count:
        return jaxpr, 0
    return jaxpr.replace(eqns=eqns, outvars=sub(jaxpr.outvars)), count


def _inner_dropped(params: dict) -> tuple[dict, int]:
    out, count = {}, 0
    for k, v in params.items():
        new, n = _dropped_value(v)
        out[k], count = new, count + n
    return (out if count else params), count


def _dropped_value(v):
    if isinstance(v, jex_core.ClosedJaxpr):
        j, n = _drop(v.jaxpr)
        return (v.replace(jaxpr=j) if n else v), n
    if isinstance(v, jex_core.Jaxpr):
        return _drop(v)
    if isinstance(v, tuple) and any(isinstance(x, (jex_core.Jaxpr, jex_core.ClosedJaxpr)) for x in v):
        parts = [_dropped_value(x) for x in v]
        return tuple(p for p, _ in parts), sum(n for _, n in parts)
    return v, 0


def drop_sharding_constraints(closed: jex_core.ClosedJaxpr, who: str = "autopp.parallelize") -> jex_core.ClosedJaxpr:
    """``closed`` without ``with_sharding_constraint`` equations (at any depth: scans, checkpoints, calls), each one's
    result replaced by its operand; a warning says how many. Refuses a ``shard_map`` with the fix."""
    _refuse_shard_map(closed.jaxpr, who)
    jaxpr, count = _drop(closed.jaxpr)
    if not count:
        return closed
    warnings.warn(f"{who}: {count} sharding constraint(s) in the step (jax.lax.with_sharding_constraint) are dropped: "
                  "they lay values out on a mesh of your own, while autopp runs each pipeline stage on its own "
                  "sub-mesh and lays it out itself (layout={'tensor': t} or {'fsdp': f} for a split inside a stage). "
                  "Results are unchanged: a constraint computes nothing.", stacklevel=user_stacklevel())
    return closed.replace(jaxpr=jaxpr)


def _refuse_shard_map(jaxpr: jex_core.Jaxpr, who: str) -> None:
    for e in jaxpr.eqns:
        if e.primitive.name in SHARD_MAP_PRIMITIVES:
            mesh = e.params.get("mesh")
            axes = dict(zip(getattr(mesh, "axis_names", ()), getattr(mesh, "axis_sizes", ())))
            raise ValueError(
                f"{who}: the step calls jax.shard_map (over mesh axes {axes}): its body runs once per device of that "
                "mesh, with collectives over its axes, while autopp runs each pipeline stage on its own sub-mesh. "
                "Write that computation with plain jax.numpy inside the loss (layout={'tensor': t} splits matmuls "
                "over a stage's devices), or keep it outside the parallelized step.")
        for sub in jex_core.jaxprs_in_params(e.params):
            _refuse_shard_map(getattr(sub, "jaxpr", sub), who)


__all__ = ["drop_sharding_constraints"]

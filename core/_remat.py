"""Full recomputation one layer at a time.

Megatron-LM's full recomputation (``--recompute-granularity full``, one layer per checkpoint) keeps each layer's
input from the forward and runs the layer's forward again in the backward, just before the layer's backward: the
backward holds one layer's residuals at a time. :func:`layer_checkpointed` evaluates a stage's jaxpr that way: its
equations in segments, one per layer (a new segment at each equation that begins a layer, found by
:func:`autopp.profiler.group_layers`), each under ``jax.checkpoint``; a ``lax.scan`` over layers is a segment of its
own whose body is checkpointed, so that each iteration keeps its carry and recomputes itself. What the stage keeps
between its forward and backward is then the layers' inputs, as the planner's memory model assumes.
"""

from __future__ import annotations

from collections.abc import Callable, Collection

import jax
from jax.extend import core as jex_core

from autopp.core._compat import remat_refuses
from autopp.core._jaxpr import eval_closed, slice_jaxpr

Literal = jex_core.Literal


def _segments(jaxpr, start_ids: Collection[int]) -> list[tuple[int, int]]:
    cuts = {0, len(jaxpr.eqns)}
    for i, eqn in enumerate(jaxpr.eqns):
        if id(eqn) in start_ids:
            cuts.add(i)
        if eqn.primitive.name == "scan":
            cuts.update((i, i + 1))
    cuts = sorted(cuts)
    return [(a, b) for a, b in zip(cuts, cuts[1:]) if a < b]


def _checkpointed_scan(eqn, invals):
    """``eqn`` (a ``lax.scan``) bound again with its body under ``jax.checkpoint``."""
    p = eqn.params
    body, n_consts, n_carry = p["jaxpr"], p["num_consts"], p["num_carry"]
    consts, carry, xs = invals[:n_consts], invals[n_consts:n_consts + n_carry], invals[n_consts + n_carry:]

    @jax.checkpoint
    def run_body(*args):
        return eval_closed(body, *args)

    def step(c, x):
        outs = run_body(*consts, *c, *x)
        return list(outs[:n_carry]), list(outs[n_carry:])

    carry_out, ys = jax.lax.scan(step, list(carry), list(xs), length=p["length"], reverse=p["reverse"],
                                 unroll=p.get("unroll", 1))
    return [*carry_out, *ys]


def layer_checkpointed(closed: jex_core.ClosedJaxpr, starts: Collection,
                       evaluate: Callable | None = None) -> Callable[[list], list]:
    """``run(values) -> outputs`` evaluating ``closed`` with each layer under ``jax.checkpoint`` (see the module
    docstring). ``starts``: the equations (or their ``id``) that begin a layer; ``evaluate(closed, values)``
    evaluates one segment (default ``jax.core.eval_jaxpr``; the runtime's applies its sharding constraints)."""
    if evaluate is None:
        def evaluate(sub, vals):
            return eval_closed(sub, *vals)

    j = closed.jaxpr
    segments = _segments(j, {s if isinstance(s, int) else id(s) for s in starts})
    pieces = []
    for a, b in segments:
        needed = {v for e in j.eqns[b:] for v in e.invars if not isinstance(v, Literal)}
        needed.update(v for v in j.outvars if not isinstance(v, Literal))
        sub, ins, outs = slice_jaxpr(closed, range(a, b), lambda v, needed=needed: v in needed, "layer")
        scan = j.eqns[a] if b == a + 1 and j.eqns[a].primitive.name == "scan" else None
        pieces.append((sub, ins, outs, scan))

    def run(vals):
        env = dict(zip(j.constvars, closed.consts))
        env.update(zip(j.invars, vals))

        def read(v):
            return v.val if isinstance(v, Literal) else env[v]

        for sub, ins, outs, scan in pieces:
            if scan is not None:
                res = _checkpointed_scan(scan, [read(v) for v in scan.invars])
                res = [res[scan.outvars.index(v)] for v in outs]
            elif remat_refuses(sub.effects):  # an io_callback: run once and kept, as JAX cannot recompute it
                res = evaluate(sub, [read(v) for v in ins])
            else:
                res = jax.checkpoint(lambda *xs, sub=sub: evaluate(sub, list(xs)))(*[read(v) for v in ins])
            env.update(zip(outs, res))
        return [read(v) for v in j.outvars]

    return run

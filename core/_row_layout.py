"""Copies of the examples laid out in blocks, met by a loss input laid out per example.

A loss input with ``K`` rows per example (``K x B`` rows: a diffusion step's ``K`` noise draws per image, antithetic
pairs ``[t; 1 - t]``) is split into microbatches by rows, so its row ``r`` goes with example ``r // K``: the ``K``
rows of an example next to each other. The loss's own copies of the examples made by ``jnp.concatenate([x, x])`` or
``jnp.tile`` put copy ``k`` of example ``i`` at row ``k * B + i`` instead. Combined row by row with such an input,
each microbatch pairs its examples with other examples' rows, unlike ``jax.jit``: silently different values. Copies
made by ``jnp.repeat(x, K, axis=0)`` are laid out per example, as the split expects. :func:`block_copies_met` finds
the first place the loss combines the two layouts.
"""

from __future__ import annotations

from collections.abc import Sequence

from jax.extend import core as jex_core

__all__ = ["block_copies_met"]

_ROW_WISE = frozenset({"add", "sub", "mul", "div", "max", "min", "pow", "atan2", "select_n", "eq", "ne", "lt", "le",
                       "gt", "ge", "and", "or", "rem", "nextafter", "complex"})


def _leading(v) -> int | None:
    shape = getattr(getattr(v, "aval", None), "shape", ())
    return shape[0] if shape else None


def block_copies_met(jaxpr: jex_core.Jaxpr, batch_invars: Sequence[bool]) -> jex_core.JaxprEqn | None:
    """The first equation of ``jaxpr`` (the loss's forward over the whole batch) that combines row by row a value
    whose rows are copies of the examples laid out in blocks (a concatenation or tile along axis 0 of values of
    ``B`` rows) with one derived from a split input of as many rows laid out per example; None if there is none."""
    native: dict = {}  # value -> leading size of the split input its rows come from, row for row
    block: dict = {}  # value -> rows of one copy, for copies of the examples laid out in blocks
    for v, b in zip(jaxpr.invars, batch_invars):
        if b and _leading(v):
            native[v] = _leading(v)
    for e in jaxpr.eqns:
        ins = [a for a in e.invars if not isinstance(a, jex_core.Literal)]
        name, out = e.primitive.name, e.outvars[0] if e.outvars else None
        n = _leading(out)
        if n is None:
            continue
        if name == "concatenate" and e.params.get("dimension") == 0 and len(ins) > 1:
            sizes = {_leading(a) for a in ins}
            if len(sizes) == 1 and all(a in native or a in block for a in ins):
                block[out] = min(block.get(a, _leading(a)) for a in ins)
            continue
        if name == "tile" and ins and (ins[0] in native or ins[0] in block) and e.params["reps"][0] > 1:
            block[out] = block.get(ins[0], _leading(ins[0]))
            continue
        if name == "dot_general" and ins and _leading(ins[0]) == n:  # (a layer applied to each row: x @ w)
            (lhs_contract, _), (lhs_batch, _) = e.params["dimension_numbers"]
            tags = block if ins[0] in block else native
            if 0 not in lhs_contract and not lhs_batch and ins[0] in tags:
                tags[out] = tags[ins[0]]
            continue
        if name in _ROW_WISE or (len(ins) == 1 and all(_leading(o) == n for o in e.outvars)):
            rows = [a for a in ins if _leading(a) == n]
            blocks = [block[a] for a in rows if a in block]
            natives = [native[a] for a in rows if a in native and a not in block]
            if blocks and any(size != min(blocks) and size == n for size in natives):
                return e
            if blocks:
                for o in e.outvars:
                    block[o] = min(blocks)
            elif natives:
                for o in e.outvars:
                    native[o] = natives[0]
    return None


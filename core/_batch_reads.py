"""Loss inputs split with the batch that the loss reads against the batch's rows: a table indexed by fixed positions
past a microbatch's rows, positions of the batch's examples made from its size. Split by rows, a microbatch would read
other rows than jit reads, silently: both are refused, naming the leaf or the line."""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import numpy as np
from jax.extend import core as jex_core

from autopp.core import _compat
from autopp.core._jaxpr import eqns_needed, input_free_vars, slice_jaxpr

if TYPE_CHECKING:
    from autopp.core._trace import TracedStep

__all__ = ["refuse_batch_positions", "refuse_reads_past_rows"]


def refuse_reads_past_rows(mb_forward: jex_core.ClosedJaxpr, traced: TracedStep, num_microbatches: int,
                            who: str) -> None:
    """A batch leaf the loss indexes along its first axis by fixed positions past a microbatch's rows (a position
    table ``tab[arange(T)]`` whose length happens to be the batch size) is no per-example data: split, every
    microbatch would read clamped rows, silently unlike jit. Refused, naming the leaf."""
    jaxpr = mb_forward.jaxpr
    split = {v: k for k, (v, mb) in enumerate(zip(jaxpr.invars, traced.microbatched_grad_inputs)) if mb}
    gathers = [e for e in jaxpr.eqns if e.primitive.name == "gather" and e.invars[0] in split
               and 0 in e.params["dimension_numbers"].start_index_map and not isinstance(e.invars[1], jex_core.Literal)]
    if not gathers:
        return
    free = input_free_vars(jaxpr)
    outer = traced.jaxpr.jaxpr.invars
    for e in gathers:
        indices = e.invars[1]
        if indices not in free:
            continue
        sub, ins, _ = slice_jaxpr(mb_forward, eqns_needed(jaxpr, [indices]), [indices], "indices")
        if ins:
            continue
        (values,) = jax.core.eval_jaxpr(sub.jaxpr, sub.consts)
        rows = e.invars[0].aval.shape[0]
        reach = int(np.max(np.asarray(values)[..., e.params["dimension_numbers"].start_index_map.index(0)]))
        if reach >= rows:
            a = traced.grad_eqn.invars[split[e.invars[0]]]
            name = (traced.leaf_paths[outer.index(a)] if a in outer
                    else f"loss input {traced.spec.input_name(split[e.invars[0]])}")
            raise ValueError(
                f"{who}: the loss reads batch leaf {name} at fixed positions up to {reach} along its first axis, past "
                f"the {rows} rows of a microbatch ({num_microbatches} microbatches split it like the batch). If it is "
                "a table (positions, classes), not per-example data, whose length happens to be the batch size, pass "
                "it in another argument of the step (batch_argnums names the batch), or read it by the examples' own "
                "positions. If it holds the examples and the loss reads some of them by position (x[jnp.array([0, "
                "5])]: chosen examples, prototypes), each microbatch holds other rows there: pass "
                "num_microbatches=1, or pass those examples as an argument of their own.")


def refuse_batch_positions(mb_forward: jex_core.ClosedJaxpr, traced: TracedStep, who: str) -> None:
    """Positions of the batch's examples the step makes from its size alone (``permutation(key, B)`` for mixup) that
    the loss gathers the batch's rows by: split into microbatches like the batch, each microbatch's positions still
    count the whole batch's examples, so it reads clamped rows, silently unlike jit. Refused, naming the line."""
    jaxpr = mb_forward.jaxpr
    made = {v for k, v in enumerate(jaxpr.invars) if k in traced.shape_batched
            and jax.numpy.issubdtype(v.aval.dtype, jax.numpy.integer)}
    rows = {v for v, mb in zip(jaxpr.invars, traced.microbatched_grad_inputs) if mb} - made
    for e in jaxpr.eqns:
        ins = [a for a in e.invars if not isinstance(a, jex_core.Literal)]
        if e.primitive.name == "gather" and ins and ins[0] in rows and len(ins) > 1 and ins[1] in made \
                and 0 in e.params["dimension_numbers"].start_index_map:
            k = next(k for k, v in enumerate(jaxpr.invars) if v in made and v in _ancestors(jaxpr, ins[1]))
            made_at = {v: q for q in traced.jaxpr.jaxpr.eqns for v in q.outvars}.get(traced.grad_eqn.invars[k])
            raise ValueError(
                f"{who}: the loss gathers the batch's examples by positions the step makes from the batch's size "
                f"(loss input {traced.spec.input_name(k)}, {jaxpr.invars[k].aval.str_short()}"
                f"{', made at ' + _compat.user_line(made_at) if made_at is not None else ''}; a permutation for "
                "mixup, say): split into microbatches like the batch, each microbatch's positions still count the "
                "whole batch's examples, so it would read other rows, unlike jax.jit. Mix the examples in the step "
                "before the loss, or draw the positions inside the loss from the microbatch's own size.")
        for v in e.outvars:  # positions carried through casts, negative-index wrapping and broadcasts
            if any(a in made for a in ins) and jax.numpy.issubdtype(v.aval.dtype, jax.numpy.integer):
                made.add(v)
            elif any(a in rows for a in ins):
                rows.add(v)


def _ancestors(jaxpr, var) -> set:
    return set(jaxpr.invars) & ({var} | {a for i in eqns_needed(jaxpr, [var]) for a in jaxpr.eqns[i].invars
                                          if not isinstance(a, jex_core.Literal)})

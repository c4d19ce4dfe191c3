"""The ways a loss can make one example's value depend on other examples of its batch (what
:func:`autopp.core.output_reductions` records as mixing), said for a warning, and which outputs each reaches."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
from jax.extend import core as jex_core

from autopp.core._batch_parts import FIRST, ORDER, PARTS, POSITIONS, STRIDES, across_examples
from autopp.core._compat import user_line

__all__ = ["CALLBACK", "CONTROL", "DRAWS", "INDEXED", "PAIRS", "POSITIONS", "SIZE", "SIZED", "SPREAD",
           "decides_by_statistic", "loop_bounds", "loop_test", "lost_reason", "mixes", "mixing_by_output",
           "mixing_summary", "JOINED", "TIME"]

PAIRS, SPREAD, DRAWS, INDEXED = "pairs", "spread", "draws", "indexed"
CONTROL, SIZED, SIZE, JOINED, TIME = "control", "sized", "size", "joined", "time"
CALLBACK = "callback"
_CALLBACKS = frozenset({"pure_callback", "io_callback"})  # (what CALLBACK is said of)
_ADD = frozenset({"add", "sub", "add_any"})
_RANDOM = frozenset({"random_bits", "threefry2x32", "rng_bit_generator", "rng_uniform", "random_gamma"})
# operations that mix examples along an axis without adding them up into one value
_MIX_ALONG = {"cumsum": "axis", "cumprod": "axis", "cummax": "axis", "cummin": "axis", "cumlogsumexp": "axis",
              "sort": "dimension", "argsort": "dimension", "top_k": "axis"}
_RATIO = "ratio"  # the b of a sum over examples divided by another sum over them
_MIXED = "mixed"  # the b of a sum over examples added to a mean over them (no count of microbatches combines them)
_MAX, _MIN = "max", "min"  # the b of a maximum (minimum) over examples: the microbatches' maximum is the batch's
_TEST = "test"  # the b of a flag from comparing a mean over the examples with a level (kl.mean() > free)
_GUARD = "guard"  # the b of a sum over examples clamped to a level: a denominator's guard, max(mask.sum(), 1)
_SHARE = "share"  # the b of an example's value over a sum over the examples (t5x: nll * w / w.sum(), then summed)
_RATIO_SUM = "ratio+sum"  # the b of a ratio of sums plus a sum over a count from the step (DETR's class and box terms)
_MIXING_KINDS = {
    PAIRS: "pairs its examples (in-batch negatives, pairwise distances)",
    SPREAD: "spreads a statistic over its examples back over them (batch normalisation, a softmax or a count over "
            "the batch)",
    ORDER: "orders its examples (a sort, a top-k, a scan or a cumulative sum along the batch, a shifted slice of it, "
           "a window, a convolution or an FFT over neighbouring examples; where the batch's first axis is time, a "
           "time-major [T, B, ...] rollout, autopp splits time into microbatches: put the examples first, "
           "jnp.swapaxes(x, 0, 1))",
    TIME: "scans along the batch's first axis, carrying a state from row to row (a recurrence over the examples: an "
          "inner training loop over chunks of the batch runs fewer steps in each microbatch, for which use "
          "num_microbatches=1; where that axis is time, a time-major [T, B, ...] batch, note that autopp splits axis "
          "0 of every batch leaf into microbatches: put the examples first, jnp.swapaxes(x, 0, 1), and scan over "
          "axis 1 in the loss)",
    POSITIONS: "numbers its examples by their position in the batch (jnp.arange along the batch axis, or values "
               "as long as the batch made from constants, concatenate([ones(B - 4), zeros(4)]): each microbatch "
               "numbers its own from 0) as values (a weight or padding mask by position), to write rows "
               "at fixed positions (x.at[:2].set(0), x.at[-1]: each microbatch's own first or last rows) or to index "
               "an array not split with the batch (pass such per-example values, row weights, a padding mask, global "
               "document ids, with the batch)",
    PARTS: "takes parts of the batch by position or regroups its rows across examples (x[:n] and x[n:], jnp.split, "
           "x.reshape(2, -1): chosen and rejected sequences or two views of the examples concatenated into one batch; "
           "a transpose then a reshape that mixes examples), so each microbatch's parts hold other examples than the "
           "whole batch's (pass each part as a batch argument of its own, or interleave them and read the pairs with "
           "x.reshape(-1, 2, ...))",
    STRIDES: "reads every k-th example (x[0::2], pairs interleaved along the batch) in microbatches whose size k does "
             "not divide, so pairs straddle two microbatches (choose num_microbatches so that each microbatch holds a "
             "multiple of k examples)",
    FIRST: "reads some examples' values for all of them (x[0] or x[:k] of a batch array, a task id or a temperature "
           "taken from the first example: each microbatch reads its own first ones, which gives jit's values only "
           "where every example holds the same, a count repeated in each row; pass such a value to the loss as an "
           "argument of its own, computed in the step)",
    INDEXED: "picks or adds up other examples' rows by indices that come with the batch (an edge list or node-to-graph "
             "ids of graphs batched jraph-style, v[senders] or jax.ops.segment_sum(h, graph_id, num_segments=len(h)); "
             "negatives picked by index): each microbatch's indices still count the whole batch's positions, so they "
             "pick other rows or fall off its end (lay graphs out along the batch axis, padded, with indices local to "
             "each and jax.vmap, or pass the other examples' values with the batch)",
    CONTROL: "decides a branch or a loop's number of iterations by a value of its examples together (lax.cond or "
             "lax.switch on a batch mean or count, a while_loop until the batch's largest residual is small, a "
             "fori_loop whose trip count comes from the batch's maximum: each microbatch decides by its own examples; "
             "decide per example with jnp.where or jax.vmap, or compute the value in the step and pass it to the loss)",
    SIZED: "scales each example's value by the batch's size (an input gradient of the batch's mean, jax.grad of "
           "loss.mean() with respect to the inputs, is 1/B of each example's own: PGD or virtual adversarial steps "
           "taken inside the loss, where a microbatch's is num_microbatches times jit's; take the gradient of the "
           "sum, or of each example's loss under jax.vmap, or multiply it by x.shape[0])",
    SIZE: "uses the batch's size other than as a factor or divisor (jnp.log(x.shape[0]), its square root: LSQ's "
          "gradient scale 1 / sqrt(x.size * Qp), a Python `if` on it): each microbatch's program reads its own size "
          "(compute such a value in the step and pass it to the loss, or count per feature, x[0].size)",
    JOINED: "joins the examples with rows that are the same in every microbatch (a replay buffer's sample, a memory "
            "bank, constant rows padding a shift: concatenate([zeros(1), x[:-1]])) along the batch axis: a sum, mean "
            "or running total over both counts those rows in every microbatch, beside the "
            "microbatch's own examples. Combine the two parts apart, (nll(x).sum() + nll(replay).sum()) / n with n "
            "passed from the step, or a weighted mean of each part's mean: autopp adds the examples' part up over the "
            "microbatches and counts the other part once",
    CALLBACK: "hands its examples together to a host callback (jax.pure_callback, io_callback), which autopp cannot "
              "see into: each microbatch's call gets only its own examples. That gives jit's values where the "
              "callback computes each example's result from that example alone; where it reads them together (ranks "
              "or a scaler fitted on the rows it is given), compute its result in the step and pass it to the loss, "
              "or use num_microbatches=1",
    DRAWS: "draws random numbers for its examples from a key that is not split with the batch, so every microbatch "
           "draws the same ones (a dropout mask, a diffusion model's noise)",
}


def mixing_summary(mixing: list) -> str:
    """What the equations :func:`output_reductions` found mixing examples do, and where the user's code made them
    (two places per kind, and how many more)."""
    seen: dict[str, list[str]] = {}
    for why, eqn, *_ in mixing:
        lines = seen.setdefault(why, [])
        line = user_line(eqn)
        if line and line not in lines:
            lines.append(line)
    return "; ".join(_MIXING_KINDS[why] + (f" at {', '.join(lines[:2])}" if lines else "")
                     + (f" and {len(lines) - 2} more line(s)" if len(lines) > 2 else "") for why, lines in seen.items())


def mixing_by_output(mixing: list, micro: jex_core.ClosedJaxpr) -> dict[int, list]:
    """The entries of ``mixing`` (from :func:`output_reductions` of ``micro``) that each output of ``micro`` depends
    on, by output position (an output that depends on none is left out)."""
    jaxpr = micro.jaxpr
    need: dict = {}  # var -> bit mask of the outputs it reaches
    for k, v in enumerate(jaxpr.outvars):
        if not isinstance(v, jex_core.Literal):
            need[v] = need.get(v, 0) | 1 << k
    reach = [0] * len(jaxpr.eqns)
    for i in range(len(jaxpr.eqns) - 1, -1, -1):
        eqn = jaxpr.eqns[i]
        mask = 0
        for v in eqn.outvars:
            mask |= need.get(v, 0)
        reach[i] = mask
        if mask:
            for v in eqn.invars:
                if not isinstance(v, jex_core.Literal):
                    need[v] = need.get(v, 0) | mask
    out: dict[int, list] = {}
    for entry in mixing:
        mask = reach[entry[2]]
        for k in range(len(jaxpr.outvars)):
            if mask >> k & 1:
                out.setdefault(k, []).append(entry)
    return out




# reductions over the batch that a loop's test may make of per-example tests: "while any example is not done", with
# a body that keeps the finished ones as they are (each example's own iterations; see _updates_finished)
_ANY_OR_ALL = frozenset({"reduce_or", "reduce_and"})
# the same test written as a comparison of the examples' largest (smallest) value, or of a count of per-example
# flags with zero: ``jnp.max(residual) > tol``, ``jnp.sum(active) > 0`` (marks of _flow, resolved at the comparison)
_EXTREME, _COUNT = "extreme", "count"
_COMPARE = frozenset({"gt", "ge", "lt", "le", "eq", "ne"})


def decides_by_statistic(we, me, ins: list, firsts) -> bool:
    """Whether a ``lax.cond`` / ``lax.switch`` or a ``lax.while_loop`` (a ``fori_loop`` with a traced trip count)
    decides by a value of the batch's examples together: its branch index or a loop's test depends on a value that
    depends on the batch and has no batch axis (a mean, a count, a maximum over the examples, carried or computed in
    the test: ``max(|z|) > tol``), other than "any (all) examples" of per-example tests. ``we``/``me``: the equation
    in the whole batch's and the microbatch's program; ``ins``: its operands' ``(state, batch axes)``; ``firsts``:
    values read off the first examples (said otherwise)."""
    if me.primitive.name == "cond":
        st, ax = ins[0]
        v = me.invars[0]
        return not isinstance(v, jex_core.Literal) and not ax and (st is None or st[2]) and v not in firsts
    if me.primitive.name != "while":
        return False
    depends, joined = loop_test(we, me, ins, firsts)
    return joined or depends and _updates_finished(we, me, ins)


def _updates_finished(we, me, ins: list) -> bool:
    """Whether a ``while_loop`` that runs while any example is not done (its test "any" / "all" of per-example tests,
    written by hand: ``jax.vmap`` writes a per-example test instead) goes on updating the examples that are: a value
    with a batch axis that its body changes other than by a selection (``jnp.where(active, new, old)``), so that each
    example's iterations depend on the others' in its batch."""
    if not _any_or_all_test(we, me, ins):
        return False
    body, wbody = me.params["body_jaxpr"].jaxpr, we.params["body_jaxpr"].jaxpr
    carried = body.invars[me.params["body_nconsts"]:]
    return any(_batched(wv, mv) and mv is not old and mv.aval.dtype != bool and not _selected(mv, body)
               for wv, mv, old in zip(wbody.outvars, body.outvars, carried))  # (flags carried: done | converged)


def _any_or_all_test(we, me, ins: list) -> bool:
    """Whether a ``while_loop``'s test (``me``; ``we`` at the whole batch; ``ins``: its operands' ``(state, batch
    axes)``) is "any" / "all" of per-example tests: ``jnp.any(active)``, ``jnp.max(residual) > tol`` (its largest
    value computed in the test, or in the body and carried), ``jnp.sum(active) > 0``, a counter against the
    examples' largest count (``fori_loop(0, jnp.max(n), ...)``, the maximum carried unchanged)."""
    cond, wcond = me.params["cond_jaxpr"].jaxpr, we.params["cond_jaxpr"].jaxpr
    made = _made(cond, wcond)
    test = cond.outvars[0]
    while test in made and made[test][0].primitive.name in ("not", "convert_element_type"):
        test = made[test][0].invars[0]
    if _reduced_over_batch(test, made) in (_ANY_OR_ALL | {"reduce_max", "reduce_min"}):
        return True
    if test not in made or made[test][0].primitive.name not in _COMPARE:
        return False
    eqn = made[test][0]
    cn, bn = me.params["cond_nconsts"], me.params["body_nconsts"]
    body = me.params["body_jaxpr"].jaxpr
    carried = dict(zip(cond.invars[cn:], body.outvars))
    unchanged = {c for c, out, old, (st, ax) in zip(cond.invars[cn:], body.outvars, body.invars[bn:], ins[cn + bn:])
                 if out is old and st is not None and st[1] in (_MAX, _MIN) and not ax}  # (a maximum from outside)
    body_made = _made(body, we.params["body_jaxpr"].jaxpr)
    for k, a in enumerate(eqn.invars):
        if isinstance(a, jex_core.Literal):
            continue
        other = eqn.invars[1 - k]
        if a in unchanged:
            return True
        kind = _reduced_over_batch(a, made) or (_reduced_over_batch(carried[a], body_made) if a in carried else None)
        total = _count_total(a, made)
        if kind in ("reduce_max", "reduce_min") or total is not None and _against_count(eqn, k, other, total):
            return True
    return False


def _made(jaxpr, wjaxpr) -> dict:
    return {v: (e, w) for e, w in zip(jaxpr.eqns, wjaxpr.eqns) for v in e.outvars}


def _reduced_over_batch(v, made) -> str | None:
    """The name of the reduction over the examples (an operand's batch axis lost) that makes ``v`` (``made``: its
    program's equations by result, with the whole batch's twin), or None; a sum only of per-example flags."""
    if v not in made:
        return None
    e, w = made[v]
    name = e.primitive.name
    if not name.startswith("reduce_") or not _batched(w.invars[0], e.invars[0]) or _batched(w.outvars[0], e.outvars[0]):
        return None
    if name == "reduce_sum":
        src = made.get(e.invars[0], (None,))[0]
        if src is None or src.primitive.name != "convert_element_type" or src.invars[0].aval.dtype != bool:
            return None
    return name


def _count_total(v, made) -> float | None:
    """Where ``v`` counts per-example flags over the examples (``jnp.sum(done)``), or their fraction
    (``jnp.mean(done)``): how many it counts of (the flags' number; 1 for a fraction); else None."""
    e = made.get(v, (None,))[0]
    if e is not None and e.primitive.name == "div" and isinstance(e.invars[1], jex_core.Literal):
        total = _count_total(e.invars[0], made)
        return None if total is None or not float(e.invars[1].val) else total / float(e.invars[1].val)
    if _reduced_over_batch(v, made) != "reduce_sum":
        return None
    return float(np.prod(made[v][0].invars[0].aval.shape))


def _against_count(eqn, k: int, other, total: float) -> bool:
    """Whether comparison ``eqn`` of a count of flags (its operand ``k``, counting of ``total``) with ``other`` tests
    "any" / "none" / "all": the count against zero (``> 0``, ``!= 0``, ``== 0``, ``<= 0``), one (``>= 1``, ``< 1``)
    or all of them (``jnp.sum(done) < B``, ``jnp.mean(done) < 1.0``)."""
    if not isinstance(other, jex_core.Literal):
        return False
    name = eqn.primitive.name if k == 0 else {"gt": "lt", "lt": "gt", "ge": "le", "le": "ge"}.get(
        eqn.primitive.name, eqn.primitive.name)
    value = float(other.val)
    return (value == 0 and name in ("gt", "ne", "eq", "le") or value == 1 and total != 1 and name in ("ge", "lt")
            or value == total and name in ("lt", "ge", "eq", "ne"))


def _selected(v, jaxpr, depth: int = 0) -> bool:
    """Whether ``v`` of ``jaxpr`` is made by a selection (``select_n``, inside ``jnp.where``'s call too), or adds,
    scales or converts one (a per-example count of iterations, ``n + active``)."""
    e = next((e for e in jaxpr.eqns if v in e.outvars), None)
    if e is None or depth > 4:
        return False
    name = e.primitive.name
    if name == "select_n" or name == "convert_element_type" and e.invars[0].aval.dtype == bool:
        return True
    inner = e.params.get("jaxpr")
    if inner is not None:
        inner = getattr(inner, "jaxpr", inner)
        return _selected(inner.outvars[e.outvars.index(v)], inner, depth + 1)
    return name in ("add", "sub", "mul", "convert_element_type", "broadcast_in_dim", "reshape") and any(
        not isinstance(a, jex_core.Literal) and _selected(a, jaxpr, depth + 1) for a in e.invars)


def loop_bounds(me) -> set[int]:
    """The operands of a ``while_loop`` (equation ``me``) that its body carries unchanged and reads only in
    comparisons: a bound its counter is tested against (``fori_loop(0, jnp.max(n), ...)``), which spreads nothing
    over the examples. Empty for other equations."""
    if me.primitive.name != "while":
        return set()
    cn, bn = me.params["cond_nconsts"], me.params["body_nconsts"]
    body = me.params["body_jaxpr"].jaxpr
    return {cn + bn + j for j, (old, out) in enumerate(zip(body.invars[bn:], body.outvars)) if out is old
            and all(e.primitive.name in _COMPARE for e in body.eqns if old in e.invars)}


def loop_test(we, me, ins: list, firsts=()) -> tuple[bool, bool]:
    """Of a ``lax.while_loop``'s test (equation ``me``, ``we`` at the whole batch, operands' ``(state, batch axes)``
    ``ins``): whether it depends on the batch (then so does every value the loop carries out, through its number of
    iterations: per example where the test is per example, as ``jax.vmap`` writes it), and whether it depends on a
    value of the batch's examples together (see :func:`decides_by_statistic`)."""
    flags = [(st is None or st[2], (_EXTREME if st is not None and st[1] in (_MAX, _MIN) else True)
              if not ax and (st is None or st[2]) and v not in firsts else False)  # (a maximum: "any" if compared)
             if not isinstance(v, jex_core.Literal) else (False, False) for v, (st, ax) in zip(me.invars, ins)]
    cn, bn = me.params["cond_nconsts"], me.params["body_nconsts"]
    carry = flags[cn + bn:]
    for _ in range(3):  # what the body makes of the carry, until it settles (a residual's maximum carried)
        made = _flow(we.params["body_jaxpr"].jaxpr, me.params["body_jaxpr"].jaxpr, flags[cn:cn + bn] + carry)
        if made is None:
            return True, False
        joined = [(a[0] or b[0], a[1] or b[1]) for a, b in zip(carry, made)]
        if joined == carry:
            break
        carry = joined
    test = _flow(we.params["cond_jaxpr"].jaxpr, me.params["cond_jaxpr"].jaxpr, flags[:cn] + carry)
    return (True, False) if not test else (test[0][0], test[0][1] is True)  # (jnp.max of flags: "any")


def _flow(w, m, flags: list) -> list | None:
    """Per output of a program (``w`` at the whole batch, ``m`` at a microbatch): (depends on the batch, depends on a
    value of its examples together), from its inputs' (``flags``); an equation whose results lose an operand's batch
    axis (a reduction over the examples) makes the latter, except "any"/"all"."""
    if len(w.eqns) != len(m.eqns) or len(m.invars) != len(flags):
        return None
    env = dict(zip(m.invars, flags))
    made = _made(m, w)
    for we, me in zip(w.eqns, m.eqns):
        read = [env.get(a, (False, False)) for a in me.invars if not isinstance(a, jex_core.Literal)]
        dep, joined = any(d for d, _ in read), any(t for _, t in read)
        if joined and me.primitive.name in _COMPARE and _tests_each(me, env):
            joined = False  # the examples' largest value against a level: "any" / "all" of per-example tests
        elif dep and not joined and me.primitive.name not in _ANY_OR_ALL:
            batched_in = any(_batched(wa, ma) for wa, ma in zip(we.invars, me.invars)
                             if not isinstance(ma, jex_core.Literal) and env.get(ma, (False,))[0])
            joined = batched_in and not any(_batched(wv, mv) for wv, mv in zip(we.outvars, me.outvars))
            if joined and me.primitive.name in ("reduce_max", "reduce_min", "reduce_sum"):
                reduced = _reduced_over_batch(me.outvars[0], made)
                joined = ((_COUNT, _count_total(me.outvars[0], made)) if reduced == "reduce_sum" else _EXTREME
                          ) if reduced else joined
        elif (joined and me.primitive.name == "div" and not isinstance(me.invars[0], jex_core.Literal)
              and isinstance(env.get(me.invars[0], (0, 0))[1], tuple)
              and isinstance(me.invars[1], jex_core.Literal) and float(me.invars[1].val)):
            joined = (_COUNT, env[me.invars[0]][1][1] / float(me.invars[1].val))  # (a fraction: jnp.mean(done))
        env.update((v, (dep, joined)) for v in me.outvars)
    return [(False, False) if isinstance(v, jex_core.Literal) else env.get(v, (False, False)) for v in m.outvars]


def _tests_each(eqn, env) -> bool:
    """Whether comparison ``eqn`` tests a mark of :func:`_flow` (the examples' largest value, a count of flags)
    against a value that does not depend on the batch, as "any" / "all" of per-example tests does (a count only
    against zero, one or all of them: see :func:`_against_count`)."""
    for k, a in enumerate(eqn.invars):
        mark = None if isinstance(a, jex_core.Literal) else env.get(a, (False, False))[1]
        if mark != _EXTREME and not isinstance(mark, tuple):
            continue
        other = eqn.invars[1 - k]
        if not isinstance(other, jex_core.Literal) and env.get(other, (False,))[0]:
            return False
        return mark == _EXTREME or _against_count(eqn, k, other, mark[1])
    return False


def _batched(wv, mv) -> bool:
    return getattr(wv.aval, "shape", ()) != getattr(mv.aval, "shape", ())


def mixes(me, ins: list, out_axes: list, recurrence: bool = False) -> str | None:
    """Whether an equation makes one example's value depend on other examples of the batch: it pairs examples (an
    axis per example on both sides: in-batch similarities, pairwise distances), spreads a statistic over the batch's
    examples back over them (batch normalisation, a softmax over the batch), or orders them (a sort or cumulative
    sum along the batch), or draws numbers for each example from a key every microbatch reads whole.
    ``recurrence``: the equation is a loop over chunks of the examples carrying a state that is no sum of them (an
    inner training loop's weights: each microbatch runs fewer steps)."""
    bounds = loop_bounds(me)  # (fori_loop(0, jnp.max(n), ...): a count compared, not spread)
    dependent = [(st, ax) for k, (st, ax) in enumerate(ins) if st is not None and st[2] and k not in bounds]
    if me.primitive.name in _RANDOM:  # (a gamma draw's shape parameters may come with the batch: its key decides)
        keyed = dependent if me.primitive.name != "random_gamma" else [(st, ax) for st, ax in ins[:1]
                                                                        if st is None or st[2]]
        return DRAWS if any(out_axes) and not keyed else None
    if me.primitive.name in _ADD and any(out_axes) and scaled_apart(ins):
        return SIZED
    if me.primitive.name in _CALLBACKS and any(out_axes) and any(ax for _, ax in dependent):
        return CALLBACK
    if any(len(ax) >= 2 for ax in out_axes) and dependent and all(len(ax) < 2 for _, ax in ins):
        return PAIRS
    if any(out_axes) and any(isinstance(st[0], (int, Fraction)) and st[0] > 0 for st, _ in dependent):
        return SPREAD
    along = me.params.get(_MIX_ALONG.get(me.primitive.name, ""), None)
    if along is not None and any(along in ax for _, ax in dependent):
        return ORDER
    if me.primitive.name == "rev" and any(set(me.params["dimensions"]) & set(ax) for _, ax in dependent):
        return ORDER  # the batch reversed (jnp.flip(e, 0): each example paired with another)
    across = across_examples(me)  # the axes a window, a transform or a selection runs along
    if across and ins and ins[0][0] is not None and ins[0][0][2] and set(across) & set(ins[0][1]):
        return ORDER
    if recurrence:  # (a carried state, not a sum, of a loop over chunks of the examples: _scan says which)
        return TIME
    if me.primitive.name == "scan" and me.params["num_carry"]:  # a recurrence along the batch axis (time-major data)
        xs = ins[me.params["num_consts"] + me.params["num_carry"]:]  # giving a value per step (a sum carried over
        ys = out_axes[me.params["num_carry"]:]  # chunks of the examples is a sum, not an order)
        if any(st is not None and st[2] and 0 in ax for st, ax in xs) and any(0 in ax for ax in ys):
            return TIME
    return None


def lost_reason(eqn, states: list) -> str:
    """What an equation of the loss's outermost program does where no combination of the examples describes its
    result any more, for a warning that says where the loss's reduction could not be read."""
    name = eqn.primitive.name
    kinds = {st[1] for st in states}
    if kinds & {_MAX, _MIN}:
        return ("uses a maximum or minimum over the examples in arithmetic (each microbatch takes its own: for jit's "
                "value, compute it in the step and pass it to the loss)")
    if _RATIO in kinds:
        return "combines a ratio of sums over the examples with other values"
    if name == "while" or _has_while(eqn):
        return ("runs a lax.while_loop over values of all the examples together (an adaptive ODE solver's error "
                "norm, an iterative solver's stopping test)" + ("" if name == "while" else f", inside {name}"))
    if name == "concatenate":
        return _MIXING_KINDS[JOINED]
    if name in ("top_k", "sort", "argsort", "cumsum", "cummax", "cumlogsumexp"):
        return f"orders the examples ({name} along the batch)"
    if name == "div" and len(states) == 2 and isinstance(states[1][0], (int, Fraction)) and states[1][0] > 0:
        return ("divides by a sum over the examples (weights from a count of the examples per class or task: each "
                "microbatch counts its own; for jit's values compute the counts in the step and pass them to the loss)")
    if any(isinstance(st[0], (int, Fraction)) and st[0] > 0 for st in states):
        return f"applies {_READABLE.get(name, name)} to a sum or mean over the examples"
    return f"combines the examples through {name}, which autopp cannot see into (a custom kernel, a callback)"


_READABLE = {"integer_pow": "a power", "pow": "a power", "sqrt": "a square root", "rsqrt": "a reciprocal square root",
             "logistic": "a sigmoid", "is_finite": "a finiteness test", "log1p": "log1p", "expm1": "expm1",
             "max": "a clamp to a level (free bits on the batch's mean, jnp.maximum(kl.mean(), free); jnp.clip)",
             "min": "a clamp to a level (jnp.minimum(loss.mean(), cap); jnp.clip)", "clamp": "a clamp to a level",
             "select_n": "a choice by a test of it (jnp.where(kl.mean() > free, kl.mean(), free))",
             "custom_jvp_call": "a function with a derivative of its own (jax.nn.relu, a clamp)",
             "abs": "an absolute value (|sum(conf - correct)| per bin: a calibration error)",
             "reduce_max": "a maximum over another axis (the largest class count: max(bincount(pred)))",
             "reduce_min": "a minimum over another axis"}


def _has_while(eqn) -> bool:
    return any(e.primitive.name == "while" or _has_while(e)
               for sub in jex_core.jaxprs_in_params(eqn.params) for e in sub.eqns)


def uses_size(me, ins: list, depends: set) -> bool:
    """Whether an equation combines values of the batch with its size used other than as a power of it: a literal
    that differs between the two traces by no such power (``2.0 if x.shape[0] > 8 else 1.0``), or a function of the
    size (``jnp.log(B)``: a value of no known state that does not depend on the batch's values). A function of the
    size returned alone (an aux) is the whole batch's. A flag is not counted: ``jnp.var``'s guard that the count is
    positive, ``where(n - ddof > 0, ...)``, holds at both sizes."""
    reads_batch = any(not isinstance(a, jex_core.Literal) and a in depends for a in me.invars)
    return reads_batch and any(st is None and (isinstance(a, jex_core.Literal) or a not in depends)
                               and getattr(a.aval, "dtype", None) != np.bool_ for a, (st, _) in zip(me.invars, ins))


def settle_shares(pending: dict, me, outs: list, why, users: dict, events: list, at: int) -> str | None:
    """What to say of ``me`` (``why``: how it mixes the examples) where examples' shares of a sum over them are made
    (``nll * w / w.sum()``, the sum broadcast to be divided by): held in ``pending`` (per value) while they are carried
    and scaled, dropped once summed over the examples (a ratio of sums, said as one), said (appended to ``events``)
    where they are used otherwise (``log(e / e.sum())``: a statistic spread over the examples). ``users``: a reader
    of each value."""
    made = any(o is not None and o[1] == _SHARE for o in outs)
    if not pending and not made and me.primitive.name != "broadcast_in_dim":
        return why  # (most equations: no share anywhere yet)
    held = {id(e): e for a in me.invars if not isinstance(a, jex_core.Literal) for e in pending.get(a, ())}
    reader = users.get(me.outvars[0]) if me.primitive.name == "broadcast_in_dim" and me.outvars else None
    if made or reader is not None and reader.primitive.name == "div" and reader.invars[1] is me.outvars[0]:
        pending.update((v, [*held.values(), *([(why, me, at)] if why else [])]) for v in me.outvars)
        return None
    if not any(o is not None and o[:2] == (1, _RATIO) for o in outs):
        events.extend(e for e in held.values() if e not in events)
    return why


def scaled_apart(ins: list) -> bool:
    """Whether values of each example are added that scale with different powers of the batch size, one that
    depends on the batch scaled (an input gradient of the batch's mean, 1/B of each example's own, added to the
    inputs or to a small constant): each microbatch's is ``num_microbatches`` times jit's."""
    states = [st for st, _ in ins]
    return (all(st is not None and st[0] == 0 and not isinstance(st[1], str) for st in states)
            and len({st[1] for st in states}) > 1 and any(st[2] and st[1] != 0 for st in states))


def share_rule(me, ins: list, n_out: int, carry: frozenset, dot) -> list:
    """The rule of an equation reading examples' shares of a sum over them (``nll * w / w.sum()``, one over a sum,
    ``jnp.reciprocal(m.sum())``): summed over the examples (a ``reduce_sum``, a contraction, ``einsum('bt,bt->', nll,
    w / w.sum())``, a sum times one over another) it is a ratio of sums; scaled by per-example values, masked
    (``where(m > 0, share, 0)``), carried or summed within each example it stays shares; anything else is none.
    ``carry``: the operations that carry a value's state; ``dot``: a contraction's rule."""
    name, states = me.primitive.name, [st for st, _ in ins]
    shares = [k for k, st in enumerate(states) if st[1] == _SHARE]
    if len(shares) != 1:
        return [None] * n_out
    share_axes, others = ins[shares[0]][1], [st[:2] for k, st in enumerate(states) if k != shares[0]]
    if name == "reduce_sum" and set(me.params["axes"]) & set(share_axes):
        return [(1, _RATIO, True)]
    if name == "mul" and others == [(1, 0)] and not share_axes:
        return [(1, _RATIO, True)]  # (a sum times one over another)
    if name == "dot_general" and others == [(0, 0)]:
        return [(1, _RATIO, True) if dot(me, [((0, 0, True), ax) for _, ax in ins], True) == (1, 0, True)
                else (0, _SHARE, True)]
    keep = (name in carry or name in ("mul", "reduce_sum") or name == "div" and shares[0] == 0
            or name == "select_n" and shares[0] > 0)  # (a share as the numerator, or one of what a mask picks)
    if keep and all(k == (0, 0) for k in others):
        return [(0, _SHARE, True)] + [(0, 0, True)] * (n_out - 1)
    return [None] * n_out


def note_choice(parts: list | None, eqn, states, top) -> None:
    """A mean over the examples or a sum over them, chosen at run time (a ``lax.cond`` or ``jnp.where`` on a flag):
    appended to ``parts`` (:func:`autopp.core.output_reductions`'s) as a ``"choice"``, for which no reduction of the
    microbatches' losses is right."""
    if {(1, 0), (1, -1)} <= {st[:2] for st in states if st is not None and st[2]}:
        note_part(parts, "choice", eqn, top)


def note_part(parts: list | None, kind: str, eqn, top) -> None:
    """Append ``(kind, eqn, top)`` to :func:`autopp.core.output_reductions`' ``parts`` (if it collects them)."""
    if parts is not None:
        parts.append((kind, eqn, top))

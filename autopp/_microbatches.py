"""How a pipelined step's microbatches stand for plain ``jax.jit``'s whole batch: the loss's forward at microbatch
size, how the microbatches' losses and aux values combine (read off the loss's program, with the warnings where no
combination gives jit's value), and the loss's terms that count once per step."""

from __future__ import annotations

import math
import types
import warnings
from collections.abc import Callable

import jax.numpy as jnp
from jax.extend import core as jex_core

from autopp._config import ParallelizeConfig
from autopp.core import (
    CALLBACK,
    FIRST,
    STRUCTURE,
    TracedStep,
    batch_dependent_vars,
    block_copies_met,
    check_batch_divisible,
    differentiable_vars,
    mixing_by_output,
    mixing_summary,
    output_reductions,
    refuse_overwritten_by_gradient,
    scale_batch_independent_terms,
    sparse_leaf_mask,
    trace_microbatch_forward,
    user_line,
    user_stacklevel,
)

__all__ = ["batch_size", "counted_once", "microbatch_forward", "reductions", "retracer"]

_WHO = "autopp.parallelize"


def batch_size(traced: TracedStep) -> int:
    """The traced step's batch size (the common divisor of its batch leaves' leading dimensions, leaving out a sparse
    array's, which count stored entries, where other leaves count the examples)."""
    sizes = [v.aval.shape[0] for v, b in zip(traced.jaxpr.jaxpr.invars, traced.batch_mask) if b and v.aval.shape]
    sparse = sparse_leaf_mask(traced)
    dense = [v.aval.shape[0] for v, b, s in zip(traced.jaxpr.jaxpr.invars, traced.batch_mask, sparse)
             if b and not s and v.aval.shape]
    sizes = dense or sizes
    return math.gcd(*sizes) if sizes else 1


def microbatch_forward(step_fn: Callable, args: tuple, traced: TracedStep,
                       num_microbatches: int) -> jex_core.ClosedJaxpr:
    check_batch_divisible(traced, num_microbatches)
    refuse_overwritten_by_gradient(traced, num_microbatches)
    forward = trace_microbatch_forward(step_fn, args, traced, num_microbatches)
    if num_microbatches > 1:
        _warn_rows_not_examples(traced)
        met = block_copies_met(traced.spec.forward.jaxpr, traced.microbatched_grad_inputs)
        if met is not None:
            warnings.warn(
                f"{_WHO}: at {user_line(met) or 'an equation of the loss'} the loss lines up copies of its examples "
                "laid out in blocks (jnp.concatenate([x, x]) or jnp.tile: copy k of example i at row k * B + i) with "
                "a loss input of as many rows. autopp splits that input into microbatches by rows, as if the rows of "
                "each example were next to each other, so each microbatch pairs its examples with other examples' "
                "rows, unlike jax.jit. Lay the copies out per example: jnp.repeat(x, K, axis=0) in the loss, and each "
                "example's K values next to each other in the step (jnp.stack([t, 1 - t], axis=1).reshape(-1), not "
                "jnp.concatenate([t, 1 - t])).", stacklevel=user_stacklevel())
    return forward


def _reordered_rows(eqns, rows: set, size: int) -> set:
    """``rows`` (values whose axis 0 holds the batch's examples) and the values of as many rows that the step makes
    from them row by row or by reordering rows whole (``x0[jnp.argsort(x1 @ d)]``, a pairing by rank; a shuffle): row
    i is then some example's, read beside example i by the loss as jax.jit reads it, so a microbatch's rows are jit's.
    A transpose or a reshape along the batch axis, a concatenation of the batch with itself, are not followed."""
    rows = set(rows)
    for e in eqns:
        reads = [a for a in e.invars if not isinstance(a, jex_core.Literal) and a in rows]
        if not reads or e.primitive.name in ("transpose", "dot_general", "concatenate") and (
                e.primitive.name != "concatenate" or e.params.get("dimension") == 0):
            continue
        name, params = e.primitive.name, e.params
        keeps = (name in ("gather", "rev", "iota", "select_n", "convert_element_type", "dynamic_slice")
                 or name == "sort" and params.get("dimension") == 0 or name == "concatenate"
                 or name == "broadcast_in_dim" and params["broadcast_dimensions"][:1] == (0,)
                 or name == "reshape" and all(a.aval.shape[:1] == (size,) for a in reads)
                 or name.startswith("reduce_") and 0 not in params.get("axes", (0,))
                 or len(e.outvars) == 1 and all(getattr(a.aval, "shape", ()) in ((), e.outvars[0].aval.shape)
                                                for a in e.invars))  # (elementwise)
        if keeps:
            rows.update(v for v in e.outvars if getattr(v.aval, "shape", ())[:1] == (size,))
    return rows


def retracer(step_fn: Callable, args: tuple, traced: TracedStep) -> Callable[[int], jex_core.ClosedJaxpr]:
    return lambda k: trace_microbatch_forward(step_fn, args, traced, k)


def _warn_rows_not_examples(traced: TracedStep) -> None:
    """Loss inputs the step computes from the batch are split by rows into microbatches; say so where autopp cannot
    follow the batch's examples to their rows (a concatenation along the batch axis, a transpose then a flattening,
    a statistic over part of the batch): each microbatch then reads rows that are not its examples' (a user trial:
    ``concatenate([y, -y])`` read by its first rows, 1.2 against jit's 0.71). Followed as a batch split over devices
    would be (:func:`autopp.profiler.batch_dims`)."""
    from autopp.profiler import batch_dims

    outer = traced.jaxpr.jaxpr
    batch_leaves = {v for v, b in zip(outer.invars, traced.batch_mask) if b}
    loose = [k for k, (a, mb) in enumerate(zip(traced.grad_eqn.invars, traced.microbatched_grad_inputs))
             if mb and a not in batch_leaves and k not in traced.shape_batched]
    if not loose:
        return
    before_gradient = types.SimpleNamespace(eqns=outer.eqns[:traced.grad_index])
    dims = batch_dims(before_gradient, {v: 0 for v in batch_leaves if getattr(v.aval, "shape", ())})
    rows = _reordered_rows(before_gradient.eqns, {v for v, d in dims.items() if d == 0}, batch_size(traced))
    lost = [k for k in loose if traced.grad_eqn.invars[k] not in rows]
    sizes = {a.aval.shape[0] for a, mb in zip(traced.grad_eqn.invars, traced.microbatched_grad_inputs)
             if mb and getattr(a.aval, "shape", ())}
    if lost and len(sizes) > 1:  # (rows of one length throughout, examples drawn from the batch in the step: split
        # alike, each microbatch's rows read beside each other as jit reads them)
        shapes = ", ".join(f"{traced.spec.input_name(k)} {traced.grad_eqn.invars[k].aval.str_short()}"
                           for k in lost[:4])
        warnings.warn(
            f"{_WHO}: loss input(s) {shapes} that the step computes from the batch are split into microbatches by "
            "rows, but autopp cannot follow the batch's examples to those rows (a concatenation or a reshape along "
            "the batch axis, a transpose, a statistic over part of the batch): a microbatch then reads rows that are "
            "not its own examples', unlike jax.jit. Compute such values inside the loss, or keep the batch axis "
            "first and per example.", stacklevel=user_stacklevel())


def reductions(config: ParallelizeConfig, traced: TracedStep, forward: jex_core.ClosedJaxpr,
                num_microbatches: int, retrace: Callable[[int], jex_core.ClosedJaxpr] | None = None
                ) -> tuple[str, tuple]:
    """(how the microbatches' losses combine, per output of the loss how its values combine or None). Read off the
    loss's program (:func:`autopp.core.output_reductions`: a mean over its examples, or a sum) where it shows it;
    else the reduction given (or the replayed plan's); else ``"mean"``. A reduction given that the program
    contradicts would return ``num_microbatches`` times (or a ``num_microbatches``-th of) plain jit's loss, and
    is refused. ``retrace(k)``: the loss's forward traced at ``k`` microbatches, read instead of ``forward`` where
    microbatches hold one example each (at batch 1 JAX writes some programs otherwise: ``jnp.matmul`` drops a batch
    axis of size 1, so the two programs would not compare)."""
    n_out = len(forward.jaxpr.outvars)
    mixing: list = []
    undetermined: list = []
    factor = num_microbatches
    if retrace is not None and num_microbatches > 1 and batch_size(traced) == num_microbatches:
        factor = max((k for k in range(2, num_microbatches) if num_microbatches % k == 0), default=num_microbatches)
        try:
            forward = retrace(factor) if factor < num_microbatches else forward  # (its outputs are the same values')
        except ValueError as e:
            raise ValueError(
                f"{e}\n(num_microbatches={factor} above is where autopp compares the step: each of the "
                f"{num_microbatches} microbatches asked for holds one example, whose rows JAX broadcasts against "
                "arrays of the whole batch, so the step traces there but would not compute jit's values.)") from e
    lost: list = []
    blocks: dict = {}
    parts: list = []
    kinds = (output_reductions(traced.spec.forward, forward, traced.microbatched_grad_inputs, factor,
                               mixing, undetermined, lost, num_microbatches, blocks, parts) if num_microbatches > 1
             else (None,) * n_out)
    read = kinds[0]  # (as the program shows it, before what is said below)
    names = traced.spec.aux_names
    chosen = [e for e in mixing_by_output(parts, forward).get(0, []) if e[0] == "choice"] if parts else []
    if chosen and read is None:
        raise ValueError(
            f"{_WHO}: at {user_line(chosen[0][1]) or 'an equation of the loss'} the loss is a mean over its examples "
            "or a sum over them by a value it reads at run time (a lax.cond, lax.switch or jnp.where on a flag, a "
            f"task id): no loss_reduction is right for both, 'sum' adding the {num_microbatches} microbatches' means "
            f"({num_microbatches}x plain jax.jit's) and 'mean' averaging their sums (1/{num_microbatches} of it). "
            "Write the mean as a sum over a number of examples the step passes to the loss (e.sum() / n, with n = "
            "x.shape[0] or a count computed in the step), then pass loss_reduction='sum'.")
    beside = [e for e in mixing_by_output(parts, forward).get(0, []) if e[0] == "beside a mean"] if parts else []
    parts = [e for e in parts if e[0] in ("mean", "sum")]
    fixed = _fixed_batch_reshapes(forward.jaxpr, batch_size(traced), factor) if STRUCTURE in undetermined else []
    if fixed:
        e = fixed[0]
        warnings.warn(
            f"{_WHO}: at {user_line(e) or 'an equation of the loss'} the loss reshapes a value of "
            f"{e.invars[0].aval.shape[0]} examples (a microbatch's) to {tuple(e.params['new_sizes'])}: the whole "
            f"batch's size, {batch_size(traced)}, is written as a number, so each microbatch's values are regrouped "
            "across its examples and the loss and gradients differ from plain jax.jit's. Take the size from the "
            "array (x.reshape(x.shape[0], -1)).", stacklevel=user_stacklevel())
    elif STRUCTURE in undetermined and (picked := _rows_read_by_position(traced, forward)):
        e, k = picked[0]
        arg = traced.spec.input_name(k)
        warnings.warn(
            f"{_WHO}: at {user_line(e) or 'an equation of the loss'} the loss reads each row of {arg} "
            f"{traced.spec.forward.jaxpr.invars[k].aval.str_short()} (or of a value computed from it along its axis "
            "0) by its position along axis 0 (v[0] and v[1], or a, b = v), rows that a microbatch does not all hold, "
            "so that axis is not its examples' (views, channels or parts stacked first, "
            f"[2, batch, ...]); autopp splits axis 0 of each batch leaf into the {num_microbatches} microbatches, "
            "so each microbatch holds other rows than those positions name and the loss and gradients differ from "
            "plain jax.jit's. Put the examples first ([batch, 2, ...], read v[:, 0] and v[:, 1]), or pass each part "
            "as a batch leaf of its own.", stacklevel=user_stacklevel())
    elif STRUCTURE in undetermined:
        warnings.warn(
            f"{_WHO}: the loss's program is not the same at the whole batch and at a microbatch of 1/{factor} of it"
            + (f" (compared there: each of the {num_microbatches} microbatches holds one example)"
               if factor != num_microbatches else "") + ": "
            "it loops over the batch axis or branches on its size (a lax.fori_loop or Python loop over the examples "
            "or along axis 0 of the batch, an `if` on x.shape[0]), or reads rows at fixed positions that a "
            "microbatch may not hold (x[:4], x[5]: pass such rows to the loss as an argument of their own), so how "
            "its examples combine cannot be read, and "
            f"the microbatches' losses are {'added up' if config.loss_reduction == 'sum' else 'averaged'}. If axis 0 "
            "of the batch is not its examples' (time-major [time, batch, ...] data, looped over time), each "
            "microbatch is a stretch of time starting from the initial state, unlike jax.jit: put the examples first "
            "(loop over axis 1). A function of one example applied to each: write it with jax.vmap.",
            stacklevel=user_stacklevel())
    reached = mixing_by_output(mixing, forward) if mixing else {}
    if 0 in reached:  # one warning for a loss whose examples' values depend on other examples of the batch
        hedged = all(e[0] in (CALLBACK, FIRST) for e in reached[0])  # (their text says where the values are jit's)
        warnings.warn(
            f"{_WHO}: the loss {mixing_summary(reached[0])}. Each of the {num_microbatches} microbatches' losses sees "
            f"only its own examples, so {'otherwise ' if hedged else ''}the loss and gradients differ from plain "
            "jax.jit's over the whole batch (they are gradient accumulation's). For jit's values use "
            "num_microbatches=1 (a stage's data-parallel devices then compute over the whole batch, as jit does), or "
            "compute such values (statistics, random draws) in "
            "the step, outside the loss, and pass them in: a value without the batch's leading length reaches every "
            "microbatch whole, while one with it (negatives or a cache computed from the batch's examples) is split "
            "with the batch, so pairs across the whole batch need num_microbatches=1. A value passed in is not "
            "differentiated: one computed from the parameters (prototypes as means of embedded examples) keeps its "
            "gradient only with num_microbatches=1.", stacklevel=user_stacklevel())
    in_loss = set(map(id, reached.get(0, [])))
    aux_mixed = sorted(k for k in reached if k > 0 and not set(map(id, reached[k])) <= in_loss)
    if aux_mixed:  # mixing that only aux values see: the loss and gradients are jit's
        events = [e for k in aux_mixed for e in reached[k]]
        warnings.warn(
            f"{_WHO}: {', '.join(names[k - 1] for k in aux_mixed)} {mixing_summary(events)}. Each of the "
            f"{num_microbatches} microbatches computes it over its own examples only, so it differs from plain "
            "jax.jit's value over the whole batch (the loss and gradients do not). For jit's value, return what it is "
            "computed from per example (leading dimension the batch's: the microbatches' values are concatenated) and "
            "compute it in the step after the gradient.", stacklevel=user_stacklevel())
    given, kind = config.loss_reduction, kinds[0]
    if kind == "mixed":
        raise ValueError(
            f"{_WHO}: the loss adds a sum over its examples (divided by nothing of its own batch: a token count the "
            "step computes, say) to a mean over them (a term written with .mean(), such as a z-loss): adding the "
            f"{num_microbatches} microbatches' losses counts the mean {num_microbatches} times, averaging them "
            f"divides the sum by {num_microbatches}, so neither loss_reduction gives plain jax.jit's loss and "
            "gradients. Write both terms alike: the mean as a sum divided by a count the step computes (e.g. "
            "(z ** 2 * mask).sum() / count; terms over different inputs, labelled and unlabelled examples, each by "
            "its own: ce(lab).sum() / n_lab + (ce(unl) * m).sum() / n_unl, both counts passed to the loss), or the "
            "sum as a mean.")
    if kind == "ratio+sum" and given != "mean":
        raise ValueError(
            f"{_WHO}: the loss adds a ratio of sums over its examples (a masked mean inside the loss, sum(nll * w) / "
            "w.sum(), or t5x's tokens each over the count) to a sum over them divided by a count the step computes "
            f"(box losses over num_boxes): averaging the {num_microbatches} microbatches' losses divides that sum by "
            f"{num_microbatches}, adding them counts the ratio {num_microbatches} times, so neither loss_reduction "
            "gives plain jax.jit's loss and gradients, even when every microbatch holds as many counted tokens. For "
            "jit's values compute the ratio's count in the step too and pass it to the loss (sum(nll * w) / n_w with "
            "n_w = w.sum() over the whole batch), then pass loss_reduction='sum'. Where the ratio's denominator "
            "depends on the parameters (a Dice over the whole batch), only num_microbatches=1 gives jit's values. "
            "loss_reduction='mean' averages the microbatches' losses, their ratios averaged and that sum divided by "
            f"{num_microbatches}.")
    if kind == "ratio+sum" and num_microbatches > 1:  # (given "mean": as asked, and said)
        warnings.warn(
            f"{_WHO}: loss_reduction='mean' is given, and the loss adds a ratio of sums over its examples to a sum "
            f"over them divided by a count the step computes: averaging the {num_microbatches} microbatches' losses "
            f"divides that sum by {num_microbatches}, 1/{num_microbatches} of its part of plain jax.jit's loss and "
            "gradients. For jit's values compute the ratio's count in the step too, then pass "
            "loss_reduction='sum'.", stacklevel=user_stacklevel())
    undetermined = undetermined + [k for k in range(1, n_out) if kinds[k] in ("mixed", "ratio+sum")]  # (an aux:
    kinds = tuple(None if k in ("mixed", "ratio+sum") else k for k in kinds)  # said below; a loss averaged as asked:
    kind = "ratio" if kind == "ratio+sum" else kind  # gradient accumulation's)
    ratio = False
    if kind == "ratio":
        if given == "sum":
            raise ValueError(
                f"{_WHO}: loss_reduction='sum', but the loss divides a sum over its examples by another sum over them "
                f"(a masked token mean, sum(nll * mask) / mask.sum()): adding the {num_microbatches} microbatches' "
                f"ratios gives about {num_microbatches}x plain jax.jit's loss and gradients. For jit's whole-batch "
                "value, compute the count in the step and pass it to the loss (autopp.value_and_grad(loss)(params, "
                "batch, mask.sum()), then 'sum' is right; a count repeated in every row of the batch and read with "
                "b['n'].mean() is read as the microbatch's own mean, so pass it that way too); to average the "
                "microbatches' ratios, pass loss_reduction='mean'.")
        if given is None:
            warnings.warn(
                f"{_WHO}: the loss divides a sum over its examples by another sum over them (a masked token mean, "
                "sum(nll * mask) / mask.sum()); each microbatch's ratio is averaged, which is not plain jax.jit's "
                "whole-batch ratio when microbatches hold different numbers of counted tokens (and NaN for one that "
                "holds none). For jit's value, "
                "compute the count in the step and pass it to the loss (autopp.value_and_grad(loss)(params, batch, "
                "mask.sum()), or one the data pipeline computed, rather than repeated in every row of the batch and "
                "read with b['n'].mean(): that gives each microbatch's loss 1/num_microbatches of its share); to keep "
                "the average of microbatch ratios (gradient accumulation's), pass loss_reduction='mean'. Where the "
                "denominator depends on the parameters (a Dice loss over the whole batch), only num_microbatches=1 "
                "gives jit's value." + (
                    f" The loss also adds a mean over its examples to the ratio (at {user_line(beside[0][1])}): where "
                    "the ratio's count can come from the step, write that term over a count from the step too "
                    "(x.sum() / n_examples, with n_examples = x.shape[0] in the step), then pass "
                    "loss_reduction='sum'." if beside else ""),
                stacklevel=user_stacklevel())
        kind, ratio = None, True  # (averaged, as said: no refusal for reading a count from the step besides)
    elif kind in ("max", "min"):  # a loss that is a maximum over examples: its gradient is no combination of theirs
        if given is None and num_microbatches > 1:
            warnings.warn(
                f"{_WHO}: the loss is the {'maximum' if kind == 'max' else 'minimum'} of a value over its examples "
                f"(a worst-case loss): each of the {num_microbatches} microbatches takes its own, and their average "
                "is not plain jax.jit's (nor its gradient, which flows through one example of the whole batch). For "
                "jit's values use num_microbatches=1 (a stage's data-parallel devices then compute over the whole "
                "batch); loss_reduction='mean' keeps the average of the microbatches' values.",
                stacklevel=user_stacklevel())
        kind = None
    ratios = [k for k in range(1, n_out) if kinds[k] == "ratio"]
    if ratios:
        warnings.warn(
            f"{_WHO}: {', '.join(names[k - 1] for k in ratios)} divide(s) a sum over the loss's examples by another "
            "sum over them (a masked accuracy); each microbatch's ratio is averaged, which is not plain jax.jit's "
            "whole-batch ratio when microbatches hold different counts. For jit's value, return the numerator and "
            "the denominator as two aux values (each a sum: they are added up) and divide them after the step.",
            stacklevel=user_stacklevel())
    # the loss: a mean or a sum, or the reduction given; an aux value: also a maximum or minimum, and a ratio averaged
    kinds = (None if kinds[0] in ("ratio", "max", "min") else kinds[0],) + tuple(
        "mean" if k == "ratio" else k for k in kinds[1:])
    if kind is not None and given is not None and kind != given:
        how = ("it divides by its own number of examples, as jnp.mean does" if kind == "mean" else
               "it adds its examples up and divides by nothing that depends on its own batch size")
        wrong = (f"{num_microbatches}x" if given == "sum" else f"1/{num_microbatches} of")
        raise ValueError(
            f"{_WHO}: loss_reduction={given!r}, but the loss is a {kind} over its examples ({how}): "
            f"{'adding' if given == 'sum' else 'averaging'} the {num_microbatches} microbatches' losses would give "
            f"{wrong} plain jax.jit's loss and gradients. "
            + (f"The plan says loss_reduction {given!r}: make it again with plan_model(..., loss_reduction={kind!r}) "
               f"(autopp plan --loss-reduction {kind})." if config.source == "replay" else
               f"Drop loss_reduction= (it is read off the loss) or pass loss_reduction={kind!r}."))
    against = [e for e in mixing_by_output(parts, forward).get(0, []) if e[0] != given] if parts and given else []
    if read is None and against and not (config.source == "replay" and given == "mean"):
        part = "a mean over its examples (divided by their number" if against[0][0] == "mean" else (
            "a sum over its examples (divided by nothing of its own batch")
        raise ValueError(
            f"{_WHO}: loss_reduction={given!r}, but at {user_line(against[0][1]) or 'an equation of the loss'} the "
            f"loss adds {part}) to a term whose combination of the examples cannot be read (a function of "
            f"statistics of the batch, such as a mixture of experts' load-balancing term): "
            f"{'adding' if given == 'sum' else 'averaging'} the {num_microbatches} microbatches' losses gives "
            f"{f'{num_microbatches}x' if given == 'sum' else f'1/{num_microbatches} of'} that part of plain "
            f"jax.jit's loss and gradients. Pass loss_reduction={against[0][0]!r} (the other term is then "
            f"{'averaged' if against[0][0] == 'mean' else 'added up'} over the microbatches, as gradient "
            "accumulation does), or compute the statistics in the step and pass them to the loss."
            + (f" The plan says loss_reduction {given!r}: make it again with plan_model(..., "
               f"loss_reduction={against[0][0]!r})." if config.source == "replay" else ""))
    summed = [e for e in mixing_by_output(parts, forward).get(0, []) if e[0] == "sum"] if parts else []
    if given == "sum" and summed and not against and num_microbatches > 1:
        warnings.warn(
            f"{_WHO}: at {user_line(summed[0][1]) or 'an equation of the loss'} the loss adds a sum over its examples "
            "to a term whose combination of the examples cannot be read (a function of statistics of the batch, such "
            "as a mixture of experts' load-balancing term). With loss_reduction='sum' the "
            f"{num_microbatches} microbatches' values of that term are added up: {num_microbatches} times its weight "
            "in plain jax.jit's loss and gradients where it is built from means over each microbatch's examples, "
            f"about 1/{num_microbatches} of it where it multiplies two sums over them divided by the step's counts "
            "(a masked load-balancing term, E * sum(f * P)); each is computed over a microbatch. For jit's values "
            "compute its statistics in the step and pass them to the loss (the token fractions f, which take no "
            "gradient: the term is then a sum over the examples), or use num_microbatches=1; for a term of means, "
            "dividing it by num_microbatches in the loss averages the microbatches' terms (gradient accumulation's "
            "usual weight, still not the whole batch's).",
            stacklevel=user_stacklevel())
    reduction = given or kind or "mean"
    combined = "sum" if reduction == "sum" else "average"
    reads_batch = batch_dependent_vars(forward.jaxpr, traced.microbatched_grad_inputs) if undetermined else set()
    opaque = [names[k - 1] for k in undetermined if k > 0 and k not in aux_mixed  # (per-example values: concatenated)
              and not isinstance(forward.jaxpr.outvars[k], jex_core.Literal)  # (a value of sizes alone, jnp.log(B),
              and forward.jaxpr.outvars[k] in reads_batch  # is the whole batch's)
              and traced.spec.forward.out_avals[k].shape == forward.out_avals[k].shape
              and (combined == "sum" or jnp.issubdtype(forward.out_avals[k].dtype, jnp.inexact))]  # (else refused)
    if opaque:
        warnings.warn(
            f"{_WHO}: {', '.join(opaque)} depend(s) on the batch but {'is' if len(opaque) == 1 else 'are'} neither a "
            "mean, a sum, a maximum nor a minimum over the loss's examples (e.g. exp of a mean loss, a median, one "
            f"example's value): it comes back as the {combined} of the microbatches' values, which is not plain "
            "jax.jit's value over the whole batch. For jit's value, return what it is computed from as a mean or sum "
            "(or per example) and compute it in the step after the gradient (perplexity: jnp.exp(loss)).",
            stacklevel=user_stacklevel())
    read = {a for e in forward.jaxpr.eqns for a in e.invars if not isinstance(a, jex_core.Literal)}
    read |= {a for a in forward.jaxpr.outvars if not isinstance(a, jex_core.Literal)}
    whole = [k for k in traced.whole_batch_grad_inputs if forward.jaxpr.invars[k] in read]  # (one it never reads:
    # nothing to say)
    first = (mixing_by_output(lost, forward).get(0) or [None])[0] if lost and 0 in undetermined else None
    where = ("an operation autopp cannot see into combines them: a custom kernel, a callback; or a function of a "
             "mean, such as its square root" if first is None else
             f"at {user_line(first[1]) or 'an equation of the loss'} it {first[0]}")
    function_of = first is not None and (first[0].startswith("applies ") and "a sum or mean over the" in first[0]
                                         or first[0].startswith("divides by a sum over the examples")) and not (
        parts and mixing_by_output(parts, forward).get(0))  # (a mean plus an MoE term: the advice below says that)
    operands = [] if first is None else first[1].invars[1:2] if first[0].startswith("divides by") else first[1].invars
    on_params = differentiable_vars(forward.jaxpr, traced.spec.diff_mask) if operands else set()
    fix = ("use num_microbatches=1 (a stage's data-parallel devices then compute over the whole batch): that sum or "
           "mean depends on the parameters (an RMSE, sqrt(mse.mean())), so no per-microbatch form has jit's value; "
           "training on the mean itself (the MSE) needs none"
           if any(not isinstance(a, jex_core.Literal) and a in on_params for a in operands) else
           "compute that sum or mean in the step and pass it to the loss (a count that normalises it: mask.sum() in "
           "the step), or use num_microbatches=1 (a stage's data-parallel devices then compute over the whole batch)")
    if 0 in undetermined and 0 not in reached and given is None and not whole:  # (mixing: said above)
        warnings.warn(
            f"{_WHO}: the loss's program does not show whether it is a mean or a sum over its examples ({where}), "
            f"so the {num_microbatches} microbatches' losses are averaged (loss_reduction='mean'), "
            "which is plain jax.jit's loss and gradients only if it is a mean. "
            + (f"No reduction of the microbatches' losses is jit's there: for jit's values {fix}; "
               "loss_reduction='mean' keeps the average (gradient accumulation's meaning)." if function_of else
               "Pass loss_reduction='sum' if it adds its examples up (a kernel's sum); loss_reduction='mean' to keep "
               "the average, which a mean plus a function of means (an MoE load-balancing term, gradient "
               "accumulation's meaning) wants; num_microbatches=1 for jit's values whatever the loss is (a stage's "
               "data-parallel devices then compute over the whole batch)."),
            stacklevel=user_stacklevel())
    elif given == "sum" and function_of and not summed and 0 not in reached and num_microbatches > 1:
        warnings.warn(
            f"{_WHO}: loss_reduction='sum' is given, but {where}: adding the {num_microbatches} microbatches' losses "
            f"is not plain jax.jit's loss and gradients. For jit's values {fix}.", stacklevel=user_stacklevel())
    asked = given is None or config.source == "replay" and given == "mean"  # (a plan's default: not the user's word)
    if whole and asked and kind is None and num_microbatches > 1 and not ratio:  # (one microbatch: both are jit's)
        made = {v: e for e in traced.jaxpr.jaxpr.eqns for v in e.outvars}
        function_where = where
        where = "; ".join(f"{traced.grad_eqn.invars[k].aval.str_short()} made at {user_line(made[v])}"
                          if v in made else traced.grad_eqn.invars[k].aval.str_short()
                          for k in whole for v in [traced.grad_eqn.invars[k]])
        raise ValueError(
            f"{_WHO}: the loss reads {len(whole)} value(s) the step computes from the whole batch ({where}; e.g. a "
            "token count that normalises the loss, a count per task), and its program does not "
            "show whether it is a mean or a sum over its examples. Every microbatch's loss reads the step's value: "
            "when that value normalises the loss (sum(nll * mask) / mask.sum() over the whole batch), the step's loss "
            "is the sum of the microbatch losses, so pass loss_reduction=\"sum\"; when the loss averages its "
            "examples anyway (a temperature, a key, weights moved by a gradient over the whole batch), pass "
            "loss_reduction=\"mean\"."
            + (f" Here the reduction cannot be read because the loss {mixing_summary(reached[0])} (the warning above): "
               "loss_reduction=\"mean\" keeps that warning's meaning (gradient accumulation's); num_microbatches=1 "
               "gives jit's values." if 0 in reached else
               f" Here neither is jit's: {function_where} (a norm over the batch, say), which no reduction of the "
               f"microbatches' losses gives; for jit's values {fix}." if function_of else "")
            + (" The plan given says loss_reduction 'mean': make it with plan_model(..., loss_reduction=\"sum\") "
               "(autopp plan --loss-reduction sum)." if config.source == "replay" else ""))
    # a per-example aux whose leading axis holds several blocks of the examples: the block count, for the runtime to
    # interleave its microbatches' values as the whole batch's are ([chosen; rejected], time-major rows)
    kinds = tuple(blocks.get(k, kd) if k and kd is None else kd for k, kd in enumerate(kinds))
    return reduction, kinds


def _fixed_batch_reshapes(jaxpr: jex_core.Jaxpr, whole: int, factor: int) -> list:
    """The reshapes in the loss at microbatch size (``jaxpr``, inner programs included) of a value whose leading
    axis is a microbatch's ``whole // factor`` examples to a shape whose leading axis is the whole batch's ``whole``:
    a batch size written as a number (``g.reshape(BATCH_SIZE, -1)``)."""
    found = []
    for e in jaxpr.eqns:
        if (e.primitive.name == "reshape" and whole != whole // factor and getattr(e.invars[0].aval, "shape", ())[:1]
                == (whole // factor,) and tuple(e.params["new_sizes"])[:1] == (whole,)):
            found.append(e)
        for sub in jex_core.jaxprs_in_params(e.params):
            found += _fixed_batch_reshapes(sub, whole, factor)
    return found


def _rows_read_by_position(traced: TracedStep, forward: jex_core.ClosedJaxpr) -> list:
    """``(equation, input)`` where the loss reads every row of a batch input along axis 0 by its position, or of a
    value computed from it that keeps that axis (``v[0]`` and ``v[1]``, ``jax.vmap(f)(v)[1]``), and a microbatch
    (``forward``) reads a fixed row past its end (JAX clamps it: a ``dynamic_slice`` at a constant start): that axis
    is then not the examples' but views or parts stacked first. (A loop over the examples, ``x[i:i + 1]``, reads only
    rows a microbatch holds; ``x[5]`` reads one row of many.)"""
    found = []
    for jaxpr in (traced.spec.forward.jaxpr, forward.jaxpr):
        rows = {v: k for k, (v, split) in enumerate(zip(jaxpr.invars, traced.microbatched_grad_inputs)) if split}
        inputs = set(jaxpr.invars)  # (what depends on them: a start that does not is a constant)
        reads: dict = {}
        for e in jaxpr.eqns:
            if any(isinstance(a, jex_core.Var) and a in inputs for a in e.invars):
                inputs.update(e.outvars)
            read = [a for a in e.invars if isinstance(a, jex_core.Var) and a in rows and a.aval.shape]
            if not read:
                continue
            a = read[0]
            if e.primitive.name == "slice" and e.params["limit_indices"][0] - e.params["start_indices"][0] == 1:
                reads.setdefault(a, []).append((e, e.params["start_indices"][0]))
            elif (e.primitive.name == "dynamic_slice" and e.params["slice_sizes"][0] == 1
                  and not (isinstance(e.invars[1], jex_core.Var) and e.invars[1] in inputs)):
                reads.setdefault(a, []).append((e, None))
            elif e.outvars and any(b.aval.shape[:1] == getattr(e.outvars[0].aval, "shape", ())[:1] for b in read):
                rows.update((o, rows[a]) for o in e.outvars)  # (the axis kept: elementwise, a matmul, a vmap)
        found.append((rows, reads))
    (rows, whole), (_, micro) = found
    past_end = any(start is None for picks in micro.values() for _, start in picks)
    return [(picks[0][0], rows[a]) for a, picks in whole.items()
            if past_end and {start for _, start in picks} == set(range(a.aval.shape[0]))]


def counted_once(forward: jex_core.ClosedJaxpr, traced: TracedStep, num_microbatches: int,
                  loss_reduction: str, kinds: tuple = ()) -> jex_core.ClosedJaxpr:
    """``forward`` as the pipeline runs it: with ``loss_reduction="sum"``, the loss's terms that read no batch input (a
    weight penalty) scaled by ``1 / num_microbatches``, so that the microbatches' losses add up to the step's (the
    same equations, so a split of ``forward`` splits it); so too the terms of each aux value the microbatches add up
    (``kinds``, from :func:`reductions`: a counter carried in and added to, ``seen + mask.sum()``, counted once).
    With ``"mean"``, such terms that the batch's size scales (the per-datapoint ELBO's ``(nll.sum() + kl) / B``) are
    scaled to count once in the microbatches' average, as under jit."""
    if num_microbatches == 1:
        return forward
    summed = [k for k, kind in enumerate(kinds) if k and kind == "sum"]
    exact = [k for k in summed if jnp.issubdtype(forward.out_avals[k].dtype, jnp.inexact)]
    counted = [traced.spec.aux_names[k - 1] for k in summed if k not in exact and scale_batch_independent_terms(
        forward, traced.microbatched_grad_inputs, 0.0, traced.spec.forward, [k]) is not forward]
    if counted:  # (an integer term cannot be scaled by 1 / num_microbatches)
        warnings.warn(
            f"{_WHO}: {', '.join(counted)} add(s) a value that does not depend on the batch (a counter carried in the "
            f"step's state) to a sum over the examples, in integers: the {num_microbatches} microbatches' values are "
            f"added up, so it counts {num_microbatches} times. Return the sum alone and add it to the counter in the "
            "step (seen + aux['n']), or make the counter a float.", stacklevel=user_stacklevel())
    outputs = exact + ([0] if loss_reduction == "sum" else [])
    if outputs:
        forward = scale_batch_independent_terms(forward, traced.microbatched_grad_inputs, 1.0 / num_microbatches,
                                                traced.spec.forward, outputs)
    means = [k for k, kind in enumerate(kinds) if k and kind == "mean"
             and jnp.issubdtype(forward.out_avals[k].dtype, jnp.inexact)] + ([0] if loss_reduction == "mean" else [])
    if means:  # (a KL added to the examples' sum before dividing by the batch size)
        forward = scale_batch_independent_terms(forward, traced.microbatched_grad_inputs, 1.0 / num_microbatches,
                                                traced.spec.forward, means, mean=True)
    return forward

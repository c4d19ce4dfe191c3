"""The jaxpr toolkit every layer uses: dataflow sets, slicing a jaxpr, its forward with a VJP, and one signature of an
equation."""

from __future__ import annotations

import functools
import re
import warnings
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex_core

from autopp.core._compat import CALL_PRIMITIVE_NAMES, bind_eqn, new_jaxpr, remat_refuses, user_line
from autopp.core._warn import user_stacklevel

Literal = jex_core.Literal


# ---------------------------------------------------------------------------------------------------------
# Dataflow

def batch_dependent_vars(jaxpr: jex_core.Jaxpr, batch_invars: Sequence[bool]) -> set:
    """Variables whose value depends on a batch (microbatched) input."""
    dep = {v for v, b in zip(jaxpr.invars, batch_invars) if b}
    for eqn in jaxpr.eqns:
        if any(not isinstance(a, jex_core.Literal) and a in dep for a in eqn.invars):
            dep.update(eqn.outvars)
    return dep


def differentiable_vars(jaxpr: jex_core.Jaxpr, diff_invars: Sequence[bool]) -> set:
    """Float variables of the loss's forward (``jaxpr``, its output 0 the loss) that carry cotangents: they depend on
    a differentiated input and the loss reads them, both other than through ``lax.stop_gradient`` (a frozen stem's
    output, a weight read as a constant; AlphaFold's recycling passes, ``prev = stop_gradient(model(p, b, prev))``,
    whose work feeds the loss only through the ``stop_gradient``: they run no backward)."""
    dep = _depending(jaxpr, diff_invars)
    loss = jaxpr.outvars[0] if jaxpr.outvars else None
    read = {loss} if loss is not None and not isinstance(loss, jex_core.Literal) else set()
    for eqn in reversed(jaxpr.eqns):
        if eqn.primitive.name != "stop_gradient" and any(v in read for v in eqn.outvars):
            read.update(a for a in eqn.invars if not isinstance(a, jex_core.Literal))
    return {v for v in dep if v in read and jnp.issubdtype(v.aval.dtype, jnp.inexact)}


def _depending(jaxpr: jex_core.Jaxpr, flags: Sequence[bool]) -> set:
    """The float variables of ``jaxpr`` that depend on its inputs flagged in ``flags`` other than through
    ``lax.stop_gradient``, followed into calls, branches and loops (a recycling loop whose body stops the gradient
    of what it carries: its results do not depend on the parameters)."""
    dep = {v for v, d in zip(jaxpr.invars, flags) if d}
    for eqn in jaxpr.eqns:
        ins = [not isinstance(a, jex_core.Literal) and a in dep for a in eqn.invars]
        if eqn.primitive.name == "stop_gradient" or not any(ins):
            continue
        dep.update(v for v, d in zip(eqn.outvars, _outputs_depending(eqn, ins))
                   if d and jnp.issubdtype(v.aval.dtype, jnp.inexact))
    return dep


_CALLS = CALL_PRIMITIVE_NAMES | {"remat", "checkpoint"}  # (a custom_jvp's or
# custom_vjp's derivative is its own rule's, not its forward's: all its outputs depend on all its inputs)


def _outputs_depending(eqn, ins: list[bool]) -> list[bool]:
    """Per output of ``eqn``: whether it depends on its operands flagged in ``ins`` (see :func:`_depending`); all of
    them where the equation is none that this reads into."""
    name, p = eqn.primitive.name, eqn.params

    def through(inner, flags):
        inner = getattr(inner, "jaxpr", inner)
        got = _depending(inner, flags)
        return [not isinstance(v, jex_core.Literal) and v in got for v in inner.outvars]

    if name in _CALLS:
        inner = p.get("jaxpr", p.get("call_jaxpr"))
        if inner is not None and len(getattr(inner, "jaxpr", inner).invars) == len(ins):
            return through(inner, ins)
    elif name == "cond":  # (the branch index carries no gradient)
        return [any(col) for col in zip(*(through(b, ins[1:]) for b in p["branches"]))]
    elif name in ("scan", "while"):
        if name == "scan":
            body, head, carry, tail = p["jaxpr"], ins[:p["num_consts"]], \
                ins[p["num_consts"]:p["num_consts"] + p["num_carry"]], ins[p["num_consts"] + p["num_carry"]:]
        else:
            cn, bn = p["cond_nconsts"], p["body_nconsts"]
            body, head, carry, tail = p["body_jaxpr"], ins[cn:cn + bn], ins[cn + bn:], []
        for _ in range(len(carry) + 1):  # what the carry depends on, until it settles
            out = through(body, head + carry + tail)
            settled = [a or b for a, b in zip(carry, out)]
            if settled == carry:
                return carry + (out[len(carry):] if name == "scan" else [])
            carry = settled
    return [True] * len(eqn.outvars)


_LINEAR_UNARY = frozenset({"neg", "convert_element_type", "copy", "copy_p", "reshape", "squeeze", "reduce_precision",
                           "reduce_sum", "broadcast_in_dim", "transpose", "expand_dims"})


def scale_batch_independent_terms(closed: jex_core.ClosedJaxpr, microbatched: Sequence[bool],
                                  factor: float, whole: jex_core.ClosedJaxpr | None = None,
                                  outputs: Sequence[int] = (0,), mean: bool = False) -> jex_core.ClosedJaxpr:
    """The loss's forward with each term of the loss (output 0; or of each of ``outputs``: an aux value the
    microbatches add up, a counter carried in and added to, ``seen + mask.sum()``) that reads no microbatched input
    multiplied by ``factor``. A term is an operand of an addition or subtraction whose other
    operand depends on the batch, on the loss's linear path (sums, differences, products and quotients by values
    that do not depend on the batch, negation, casts, sums over axes, reshapes): ``nll.sum() + l2`` ->
    ``nll.sum() + l2 * factor``, and per task ``jnp.sum(jnp.exp(-s) * task_sums + s)`` -> ``... + s * factor``. With
    ``loss_reduction="sum"`` the step's loss is the microbatches' losses added up, so a weight penalty counted in
    each would count ``num_microbatches`` times; scaled by ``1 / num_microbatches`` it counts once, in the loss and
    in its gradient. A term that grows with the batch (``whole``: the loss traced at the whole batch, where
    ``closed`` is at a microbatch) is a sum over the examples and is left as it is: a constant broadcast to each
    example and summed (``jnp.sum(nll - log_det)``), or scaled by the batch size (``nll.sum() - B * log_det``).

    ``mean``: the step's loss (output 0) is the microbatches' losses averaged (``factor`` is ``1 / M``). A term
    then counts as jit counts it unless the batch's size scales it: a KL added to the examples' sum before the
    division by the batch size (the per-datapoint ELBO, ``(nll.sum() + kl) / B``) or divided by it (``nll.mean() +
    kl / B``) would count ``M`` times. Each such term is scaled by its value at the whole batch over its value at a
    microbatch, the batch sizes read off the two traces (``1 / M`` for these). Each rewritten equation becomes one
    call, so equation indices stay valid."""
    jaxpr = closed.jaxpr
    dep = batch_dependent_vars(jaxpr, microbatched)
    shaped, sized = _batch_sized_vars(whole.jaxpr, jaxpr) if whole is not None else (set(), set())
    if mean and (whole is None or not sized):
        return closed  # (nothing scales with the batch's size: every term counts as under jit)
    ratio_of = _value_ratios(whole, closed, shaped, sized) if mean else None
    num_microbatches = round(1 / factor) if mean else 1
    ratio = {v: 1.0 for k, v in enumerate(jaxpr.outvars) if k in outputs and not isinstance(v, Literal)}

    def depends(a) -> bool:
        return not isinstance(a, Literal) and a in dep

    def reach(a, r) -> None:  # (one ratio per value: reached on two paths with two, none)
        if not isinstance(a, Literal):
            ratio[a] = r if ratio.get(a, r) == r else None

    rewrite = {}
    for i in reversed(range(len(jaxpr.eqns))):
        e = jaxpr.eqns[i]
        if len(e.outvars) != 1 or e.outvars[0] not in ratio:
            continue
        name, ins, r = e.primitive.name, e.invars, ratio[e.outvars[0]]
        on = [depends(a) for a in ins]
        if mean and name in ("add", "sub", "add_any") and any(on):
            if not all(on):  # the term's value and its path to the loss, whole batch over a microbatch
                own = ratio_of(i, on.index(False))
                scale = (None if own is None or r is None else
                         own * r * (num_microbatches if e.outvars[0] in shaped else 1))  # (summed over examples)
                if scale is not None and not np.isclose(scale, 1.0, rtol=1e-9, atol=0):
                    rewrite[i] = (on.index(False), scale)
            for a, d in zip(ins, on):
                if d:
                    reach(a, r)
        elif not mean and name in ("add", "sub", "add_any") and (any(on) or any((i, k) in sized
                                                                                  for k in range(len(ins)))):
            on = [d or (i, k) in sized for k, d in enumerate(on)]  # (the batch's size: seen + x.shape[0])
            if not all(on) and e.outvars[0] not in shaped and (i, on.index(False)) not in sized:
                rewrite[i] = (on.index(False), factor)  # (added to each example, or growing with the batch: a sum)
            for a, d in zip(ins, on):
                if d:
                    reach(a, r)
        elif (name == "mul" and sum(on) == 1) or (name == "div" and on == [True, False]):
            k = on.index(True)
            other = ratio_of(i, 1 - k) if mean and r is not None else 1.0
            reach(ins[k], None if other is None or r is None else (r * other if name == "mul" else r / other))
        elif name in _LINEAR_UNARY and len(ins) == 1 and on[0]:
            reach(ins[0], r)
    if not rewrite:
        return closed
    eqns = list(jaxpr.eqns)
    for i, (pos, scale) in rewrite.items():
        e = eqns[i]

        def scaled(*xs, e=e, pos=pos, scale=scale):
            xs = list(xs)
            xs[pos] = xs[pos] * jnp.asarray(scale, xs[pos].dtype)
            return e.primitive.bind(*xs, **e.params)

        avals = [jax.ShapeDtypeStruct(a.aval.shape, a.aval.dtype, weak_type=getattr(a.aval, "weak_type", False))
                 for a in e.invars]
        (call,) = jax.make_jaxpr(jax.jit(scaled))(*avals).jaxpr.eqns
        eqns[i] = call.replace(invars=list(e.invars), outvars=list(e.outvars))
    new = new_jaxpr(jaxpr.constvars, jaxpr.invars, jaxpr.outvars, eqns, jaxpr.effects, "loss")
    return jex_core.ClosedJaxpr(new, closed.consts)


def _value_ratios(whole: jex_core.ClosedJaxpr, closed: jex_core.ClosedJaxpr, shaped: set, sized: set):
    """A function of ``(equation index, operand position)`` of ``closed`` (the loss at a microbatch; ``whole`` at the
    whole batch, the same program) giving the operand's value at the whole batch over its value at the microbatch,
    where it depends on the batch's size through products, quotients and powers of literals (``kl / B``: ``1 / M``;
    ``B``: ``M``); 1 where it does not depend on the size; None where the ratio cannot be read."""
    w, m = whole.jaxpr, closed.jaxpr
    made = {v: i for i, e in enumerate(m.eqns) for v in e.outvars}
    consts = {mv: (wc, mc) for mv, wc, mc in zip(m.constvars, whole.consts, closed.consts)}

    def literal(a, b):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        if a.shape != b.shape:
            return None
        if np.array_equal(a, b):
            return 1.0
        with np.errstate(divide="ignore", invalid="ignore"):
            q = np.ravel(a / b)
        return float(q[0]) if q.size and np.all(np.isfinite(q)) and np.allclose(q, q[0], rtol=1e-12) else None

    @functools.lru_cache(maxsize=None)
    def of_var(i: int, k: int, depth: int = 0):
        a, b = w.eqns[i].invars[k], m.eqns[i].invars[k]
        if isinstance(b, Literal):
            return literal(a.val, b.val) if isinstance(a, Literal) else None
        if b in consts:
            return literal(*consts[b])
        j = made.get(b)
        if j is None or not any((j, n) in sized for n in range(len(m.eqns[j].invars))) and b not in shaped:
            return 1.0  # (an input, or computed from nothing that depends on the batch's size)
        if depth > 16:
            return None
        e = m.eqns[j]
        parts = [of_var(j, n, depth + 1) for n in range(len(e.invars))]
        name = e.primitive.name
        if name in _LINEAR_UNARY:  # (the same value, recast or reshaped)
            return parts[0]
        if None in parts:
            return None
        if name == "mul":
            return parts[0] * parts[1]
        if name == "div":
            return parts[0] / parts[1] if parts[1] else None
        if name in ("add", "sub") and np.isclose(parts[0], parts[1], rtol=1e-12):
            return parts[0]
        if name == "integer_pow":
            return parts[0] ** e.params["y"]
        if name in ("sqrt", "rsqrt"):
            return parts[0] ** (0.5 if name == "sqrt" else -0.5) if parts[0] > 0 else None
        return None

    return of_var


def _batch_sized_vars(w: jex_core.Jaxpr, m: jex_core.Jaxpr) -> tuple[set, set]:
    """Of ``m`` (a program at a microbatch, ``w`` the same at the whole batch): the variables whose shapes differ from
    ``w``'s (a batch axis), and the operands ``(equation index, position)`` whose values depend on the batch's size
    (computed from such a variable, or from a literal or a constant that differs). Nothing where the two programs
    differ in structure (a loop over the examples)."""
    if len(w.eqns) != len(m.eqns) or any(a.primitive is not b.primitive for a, b in zip(w.eqns, m.eqns)):
        return set(), set()

    def shape(v):
        return getattr(v.aval, "shape", ())

    shaped = {mv for wv, mv in zip((*w.invars, *w.constvars), (*m.invars, *m.constvars)) if shape(wv) != shape(mv)}
    grows, operands = set(shaped), set()
    for i, (we, me) in enumerate(zip(w.eqns, m.eqns)):
        read = {(i, k) for k, (a, b) in enumerate(zip(we.invars, me.invars))
                if (b in grows if not isinstance(b, Literal) else not isinstance(a, Literal)
                    or not np.array_equal(np.asarray(a.val), np.asarray(b.val)))}
        operands |= read
        shaped.update(mv for wv, mv in zip(we.outvars, me.outvars) if shape(wv) != shape(mv))
        if read or any(v in shaped for v in me.outvars):
            grows.update(me.outvars)
    return shaped, operands


def eqns_needed(jaxpr: jex_core.Jaxpr, outvars, exclude=frozenset()) -> list[int]:
    """Indices, in order, of the equations that ``outvars`` are computed by (equations in ``exclude`` left out)."""
    want, ids = {v for v in outvars if not isinstance(v, Literal)}, []
    for i in reversed(range(len(jaxpr.eqns))):
        e = jaxpr.eqns[i]
        if i not in exclude and any(o in want for o in e.outvars):
            ids.append(i)
            want.update(a for a in e.invars if not isinstance(a, Literal))
    return ids[::-1]


def eval_jaxpr_with(jaxpr, consts, args, override: Callable | None = None):
    """Evaluate ``jaxpr`` equation by equation; ``override(index, eqn, invals)`` may return the outputs of an
    equation instead of binding it (None: bind as usual)."""
    env = dict(zip(jaxpr.constvars, jax_consts(consts)))
    env.update(zip(jaxpr.invars, args))

    def read(a):
        return a.val if isinstance(a, jex_core.Literal) else env[a]

    for i, eqn in enumerate(jaxpr.eqns):
        invals = [read(a) for a in eqn.invars]
        outs = override(i, eqn, invals) if override is not None else None
        if outs is None:
            outs = bind_eqn(eqn, invals)
            if not eqn.primitive.multiple_results:
                outs = [outs]
        env.update(zip(eqn.outvars, outs))
    return [read(a) for a in jaxpr.outvars]


def input_free_vars(jaxpr: jex_core.Jaxpr) -> set:
    """Variables computed from no input (from literals, constants and sizes), by equations without effects; the
    constants themselves included."""
    free = set(jaxpr.constvars)
    for e in jaxpr.eqns:
        if not e.effects and all(isinstance(a, Literal) or a in free for a in e.invars):
            free.update(e.outvars)
    return free


ROW_READS = frozenset({"slice", "squeeze", "dynamic_slice"})


def sink_parameter_work(closed: jex_core.ClosedJaxpr, diff_invars: Sequence[bool]) -> jex_core.ClosedJaxpr:
    """``closed`` with each equation of its prologue (before anything reads another input than the differentiated
    ones) that computes from parameters alone (a differentiated input, constants, literals: casting master weights
    to bf16, transposing a weight) moved down to just before its first reader. A step that casts its whole parameter
    tree at the top of the loss (``jax.tree.map(lambda w: w.astype(bf16), params)``, the usual Equinox/NNX idiom)
    then reads each block's weights inside the block, as a step that casts per block does: the profiler's layers
    own the parameters their blocks use and the sharding search sees each weight's matmul. Parameter work written
    inside the model stays where it is, and so do equations with effects and the rows a layer of an unrolled
    ``lax.scan`` takes of its stacked parameters (its header, which :func:`~autopp.core._reroll.reroll_scans` rolls
    back). The order stays topological, so the value is the same."""
    jaxpr = closed.jaxpr
    eqns = jaxpr.eqns
    param_only = {v for v, d in zip(jaxpr.invars, diff_invars) if d}
    neutral = set(jaxpr.constvars) | input_free_vars(jaxpr)
    other = {v for v, d in zip(jaxpr.invars, diff_invars) if not d}
    movable, prologue = [], True
    for e in eqns:
        ins = [a for a in e.invars if not isinstance(a, Literal)]
        if any(a in other for a in ins):
            other.update(e.outvars)
            prologue = False
        derived = (not e.effects and any(a in param_only for a in ins)
                   and all(a in param_only or a in neutral for a in ins))
        movable.append(prologue and derived and e.primitive.name not in ROW_READS)
        if derived:
            param_only.update(e.outvars)
    if not any(movable):
        return closed
    readers: dict = {}
    for i, e in enumerate(eqns):
        for a in e.invars:
            if not isinstance(a, Literal):
                readers.setdefault(a, []).append(i)
    key = list(range(len(eqns)))
    for i in range(len(eqns) - 1, -1, -1):
        if movable[i]:
            after = [key[j] for o in eqns[i].outvars for j in readers.get(o, ())]
            key[i] = min(after) if after else i
    order = sorted(range(len(eqns)), key=lambda i: (key[i], not movable[i], i))
    if order == list(range(len(eqns))):
        return closed
    return jex_core.ClosedJaxpr(new_jaxpr(jaxpr.constvars, jaxpr.invars, jaxpr.outvars, [eqns[i] for i in order],
                                          jaxpr.effects,
                                          getattr(jaxpr.debug_info, "func_name", None) or "autopp"),
                                closed.consts)


def constant_outputs(closed: jex_core.ClosedJaxpr) -> dict[int, np.ndarray]:
    """Output position -> value, for each output of ``closed`` computed from no input (from sizes and constants
    only, such as ``jnp.float32(x.shape[0]) * 2``); literal outputs excluded."""
    jaxpr = closed.jaxpr
    const_of = dict(zip(jaxpr.constvars, closed.consts))
    free = input_free_vars(jaxpr)
    wanted = {k: v for k, v in enumerate(jaxpr.outvars) if not isinstance(v, Literal) and v in free
              and v not in const_of}
    if not wanted:
        return {}
    sub, ins, _ = slice_jaxpr(closed, eqns_needed(jaxpr, wanted.values()), list(wanted.values()), "constants")
    if ins:  # (reads an input after all: leave it to the microbatches)
        return {}
    values = jax.core.eval_jaxpr(sub.jaxpr, sub.consts)
    return {k: np.asarray(x) for k, x in zip(wanted, values)}


# ---------------------------------------------------------------------------------------------------------
# Slicing and differentiating

def slice_jaxpr(closed: jex_core.ClosedJaxpr, eqn_ids: Sequence[int], outputs, name: str = "slice") -> tuple:
    """The one jaxpr slicer: a jaxpr of the equations ``eqn_ids`` of ``closed``.

    ``outputs``: the variables it returns, in order, or a predicate ``needed_outside(var)`` that picks them among the
    equations' results (in equation order). Its inputs are what the equations read from outside, in order of first
    use, then any output they do not define (passed through); constants of ``closed`` they read stay constants.
    Returns ``(ClosedJaxpr, input vars, output vars)``. The stages of a pipeline (:func:`autopp.core.stage_graphs`),
    a profiled layer and the runtime's programs outside the loss are all cut with it."""
    jaxpr = closed.jaxpr
    const_of = dict(zip(jaxpr.constvars, closed.consts))
    eqns = [jaxpr.eqns[i] for i in eqn_ids]
    defined, seen, ins = set(), set(), []
    for e in eqns:
        for a in e.invars:
            if not isinstance(a, Literal) and a not in defined and a not in seen:
                seen.add(a)
                ins.append(a)
        defined.update(e.outvars)
    outs = [v for e in eqns for v in e.outvars if outputs(v)] if callable(outputs) else list(outputs)
    for v in outs:
        if not isinstance(v, Literal) and v not in defined and v not in seen:
            seen.add(v)
            ins.append(v)
    consts = [v for v in ins if v in const_of]
    ins = [v for v in ins if v not in const_of]
    sub = new_jaxpr(consts, ins, outs, eqns, jaxpr.effects, name)
    return jex_core.ClosedJaxpr(sub, [const_of[v] for v in consts]), ins, outs


def jax_consts(consts: Sequence) -> list:
    """A closed jaxpr's constants as JAX arrays where JAX keeps them host-side as NumPy arrays (small arrays made
    in the traced function, ``jnp.array([0., 1.])``): evaluating the jaxpr hands them as they are to a
    ``custom_vjp``'s backward or a ``custom_jvp``'s rule, where indexing one with a traced index (``ts[i]`` in
    ``jax.experimental.ode.odeint``'s backward) fails, while under ``jax.jit`` that code sees a traced array.
    Scalars stay as they are (their weak types with them)."""
    return [jnp.asarray(c) if isinstance(c, np.ndarray) and c.ndim else c for c in consts]


def eval_closed(closed: jex_core.ClosedJaxpr, *args) -> list:
    """``jax.core.eval_jaxpr`` of a closed jaxpr, its constants as JAX arrays (:func:`jax_consts`)."""
    return jax.core.eval_jaxpr(closed.jaxpr, jax_consts(closed.consts), *args)


def forward_with_vjp(closed: jex_core.ClosedJaxpr, diff_positions: Sequence[int],
                     diff_outputs: Sequence[int] | None = None, *, recompute: str = "none", policy=None,
                     run: Callable | None = None):
    """The one per-stage VJP: ``f(*inputs) -> (outputs, vjp)`` for a jaxpr, differentiating the inputs at
    ``diff_positions``; ``vjp(cotangents)`` takes one cotangent per output in ``diff_outputs`` (default: every
    output) and returns the cotangents of the differentiated inputs, as a list. ``recompute`` ``"full"`` or
    ``"selective"`` wraps the forward in ``jax.checkpoint`` (with ``policy`` for the selective one), so the VJP keeps
    only what that policy saves. ``run(values) -> outputs`` evaluates the jaxpr (default: ``jax.core.eval_jaxpr``;
    the runtime passes one that applies sharding constraints)."""
    if run is None:
        def run(vals):
            return eval_closed(closed, *vals)
    refused = recompute != "none" and warn_unrecomputable(closed, recompute)

    def f(*xs):
        def of_diff(diff_vals):
            vals = list(xs)
            for i, d in zip(diff_positions, diff_vals):
                vals[i] = d
            outs = run(vals)
            chosen = outs if diff_outputs is None else [outs[k] for k in diff_outputs]
            return chosen, outs

        if recompute != "none" and not refused:
            of_diff = jax.checkpoint(of_diff, policy=policy)
        _, vjp_fn, outs = jax.vjp(of_diff, [xs[i] for i in diff_positions], has_aux=True)
        return outs, jax.tree_util.Partial(_call_vjp, vjp_fn)

    return f


def warn_unrecomputable(closed: jex_core.ClosedJaxpr, recompute: str) -> bool:
    """Whether ``closed`` has effects ``jax.checkpoint`` cannot recompute (an ``io_callback``); if so, say that it
    keeps its activations instead of the ``recompute`` asked for."""
    refused = remat_refuses(closed.effects)
    if refused:
        eqn = next((e for e in closed.jaxpr.eqns if remat_refuses(e.effects)), None)
        warnings.warn(
            f"autopp: recompute={recompute!r} leaves a stage's activations kept, because it calls an io_callback"
            f"{'' if eqn is None else ' at ' + user_line(eqn)}, which JAX cannot recompute (its effect would run "
            "twice): the stage runs as with recompute='none' and holds more memory than planned. Move the "
            "io_callback out of the loss (return the value as aux), or use jax.debug.callback.",
            stacklevel=user_stacklevel())
    return bool(refused)


def _call_vjp(vjp_fn, cotangents):
    """``vjp_fn`` (of a function of one list) on a list of cotangents: the list of input cotangents."""
    (grads,) = vjp_fn(list(cotangents))
    return grads


# ---------------------------------------------------------------------------------------------------------
# Signatures

_ADDR = re.compile(r" at 0x[0-9a-fA-F]+|0x[0-9a-fA-F]{6,}")
_jaxpr_str_cache: dict[int, tuple[object, str]] = {}


_aval_sig_cache: dict = {}


def _aval_sig(aval) -> str:
    shape = getattr(aval, "shape", None)
    dtype = getattr(aval, "dtype", None)
    if shape is None:
        return str(aval)
    key = (shape, dtype)
    try:
        hit = _aval_sig_cache.get(key)
    except TypeError:
        return f"{dtype}{list(shape)}"
    if hit is None:
        hit = _aval_sig_cache[key] = f"{dtype}{list(shape)}"
    return hit


def literal_signature(val) -> str:
    """A literal's value as text (small arrays by their bytes)."""
    try:
        arr = np.asarray(val)
        if arr.dtype != object and arr.size <= 64:
            return f"{arr.dtype}{list(arr.shape)}={arr.tobytes().hex()}"
    except Exception:  # noqa: BLE001 - fall back to the repr
        pass
    return _ADDR.sub("", repr(val))


def _jaxpr_str(j) -> str:
    hit = _jaxpr_str_cache.get(id(j))
    if hit is not None and hit[0] is j:
        return hit[1]
    s = _ADDR.sub("", str(j))
    if len(_jaxpr_str_cache) > 4096:
        _jaxpr_str_cache.clear()
    _jaxpr_str_cache[id(j)] = (j, s)
    return s


def _param_str(v) -> str:
    if isinstance(v, (jex_core.Jaxpr, jex_core.ClosedJaxpr)):
        return _jaxpr_str(v)
    if isinstance(v, (tuple, list)):
        return "(" + ",".join(_param_str(x) for x in v) + ")"
    if callable(v) and not isinstance(v, type):
        return getattr(v, "__qualname__", type(v).__name__)
    return _ADDR.sub("", repr(v))


def _atom_sig(a) -> str:
    if isinstance(a, jex_core.Literal):
        return f"{literal_signature(a.val)}:{_aval_sig(a.aval)}"
    return _aval_sig(a.aval)


_eqn_sig_cache: dict = {}


def eqn_signature(eqn, literal_values: bool = True) -> str:
    """What makes two equations the same computation: the primitive, its parameters (nested jaxprs as text), the
    types of its inputs (literal values included, unless ``literal_values`` is False) and outputs. Remembered per
    equation object (equations are immutable; the sliced and rerolled jaxprs of one build share them)."""
    key = (id(eqn), literal_values)
    hit = _eqn_sig_cache.get(key)
    if hit is not None and hit[0] is eqn:
        return hit[1]
    sig = _eqn_signature(eqn, literal_values)
    if len(_eqn_sig_cache) > 65536:
        _eqn_sig_cache.clear()
    _eqn_sig_cache[key] = (eqn, sig)
    return sig


def _eqn_signature(eqn, literal_values: bool) -> str:
    params = ",".join(f"{k}={_param_str(v)}" for k, v in sorted(eqn.params.items()))
    ins = ",".join(_atom_sig(a) if literal_values else _aval_sig(a.aval) for a in eqn.invars)
    outs = ",".join(_aval_sig(v.aval) for v in eqn.outvars)
    return f"{eqn.primitive.name}[{params}]({ins})->({outs})"


def structure_signature(eqn) -> str:
    """Shape-agnostic signature: the operation and its arity (and nested operations)."""
    subs = [inner_jaxpr(s) for s in jex_core.jaxprs_in_params(eqn.params)]
    inner = "".join("{" + " ".join(structure_signature(e) for e in s.eqns) + "}" for s in subs)
    return f"{eqn.primitive.name}/{len(eqn.invars)}/{len(eqn.outvars)}{inner}"


def inner_jaxpr(j) -> jex_core.Jaxpr:
    """The open jaxpr of a (closed) jaxpr parameter."""
    return j.jaxpr if isinstance(j, jex_core.ClosedJaxpr) else j


def without_host_prints(closed: jex_core.ClosedJaxpr) -> jex_core.ClosedJaxpr:
    """``closed`` without its ``jax.debug.print`` / ``jax.debug.callback`` equations (they return nothing), and with
    zeros for its ``io_callback`` results: timing a layer on random inputs must not run the user's callbacks on them
    (user trials saw prints of made-up values, counters advanced and logs written by the planner). Ones nested in a
    ``custom_vjp``'s backward still run."""
    eqns = [e for e in closed.jaxpr.eqns if not (e.primitive.name == "debug_callback" and not e.outvars)]
    j = closed.jaxpr
    if any(e.primitive.name == "io_callback" for e in eqns):  # its results (zeros here) feed the layer: traced again
        return jax.make_jaxpr(functools.partial(_zeros_for_io_callbacks, eqns, j, closed.consts))(
            *(jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in j.invars))
    if len(eqns) == len(j.eqns):
        return closed
    effects = set().union(*(e.effects for e in eqns))
    return jex_core.ClosedJaxpr(new_jaxpr(j.constvars, j.invars, j.outvars, eqns, effects, "measured layer"),
                                closed.consts)


def _zeros_for_io_callbacks(eqns, jaxpr, consts, *args):
    """``jaxpr`` evaluated with ``eqns`` (its equations less some), an ``io_callback``'s results zeros."""
    env = dict(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))

    def read(a):
        return a.val if isinstance(a, jex_core.Literal) else env[a]

    for eqn in eqns:
        if eqn.primitive.name == "io_callback":
            outs = [jnp.zeros(v.aval.shape, v.aval.dtype) for v in eqn.outvars]
        else:
            outs = bind_eqn(eqn, [read(a) for a in eqn.invars])
            outs = outs if eqn.primitive.multiple_results else [outs]
        env.update(zip(eqn.outvars, outs))
    return [read(a) for a in jaxpr.outvars]


def leaked_tracers(closed) -> list:
    """Tracers of finished traces held as constants by ``closed`` or the jaxprs inside it (a value that escaped a
    scan body traced once, through a Python list, and was used after the scan: JAX keeps it as a constant)."""
    found, seen, todo = [], set(), [closed]
    while todo:
        c = todo.pop()
        if id(c) in seen:
            continue
        seen.add(id(c))
        found += [x for x in c.consts if isinstance(x, jax.core.Tracer)]
        for e in c.jaxpr.eqns:
            for value in e.params.values():
                for sub in (value if isinstance(value, (tuple, list)) else (value,)):
                    sub = getattr(sub, "forward", sub)  # (the gradient marker's spec holds the loss's jaxpr)
                    if isinstance(sub, jex_core.ClosedJaxpr):
                        todo.append(sub)
    return found

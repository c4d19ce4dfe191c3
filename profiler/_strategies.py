"""Sharding strategies of one equation over a stage's ``tensor`` mesh axis, and the layer program they are read from.

The reference is Alpa's intra-operator pass (Zheng et al. 2022, section 4): every operation of the layer's
forward-and-backward program (:class:`LayerProgram`, built by :func:`layer_program`, which also finds the values
that carry the batch dimension and the fused attention regions) gets a list of *strategies*; a strategy says how
the operation's output is laid out over the ``t`` devices of the tensor axis and which layout it needs of each
input. The graph of one layer that connects them, where an edge between a producer and a consumer whose layouts
differ costs a collective (a *resharding*), is :mod:`autopp.profiler._strategy_graph`; the ILP
(:mod:`autopp.planner._sharding`) picks one strategy per operation.

A layout ("spec") of a value over the tensor axis is one of:

* ``R`` (:data:`REPLICATED`): every device holds the whole value;
* ``P`` (:data:`PARTIAL`): every device holds a value of the full shape, and the value is their sum (what a
  matmul whose contracted dimension is split leaves behind, before its all-reduce);
* ``d >= 0``: the value is split into ``t`` equal blocks along dimension ``d``.

Strategies are read off the jaxpr's dataflow, never off names: a ``dot_general`` may split a batch, a free
(output) or a contracted dimension of its operands; elementwise operations keep any split; ``reshape``,
``transpose``, ``broadcast_in_dim`` and slicing carry a split to the matching dimension; reductions keep splits of
other dimensions and turn a split of a summed dimension into ``P``; ``gather``/``scatter`` may split the table's
indexed dimension (a vocabulary-parallel embedding); calls with a body (``jit``, ``custom_jvp_call``, ...) keep a
split that passes through their body (:func:`eqn_strategies`).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence

import jax
import networkx as nx
from jax.extend import core as jex_core

from autopp.core import FUSED_ATTENTION_SCOPE, forward_with_vjp, name_stack
from autopp.profiler._kernels import attention_work

Literal = jex_core.Literal

REPLICATED = -1
"""Spec code: the value is whole on every device of the tensor axis."""
PARTIAL = -2
"""Spec code: every device holds a full-shape partial sum of the value."""


def spec_name(spec: int) -> str:
    """``R``, ``P`` or ``S(d)``."""
    return "R" if spec == REPLICATED else "P" if spec == PARTIAL else f"S({spec})"


@dataclasses.dataclass(frozen=True)
class Strategy:
    """One way to run an operation over the tensor axis."""

    out: int
    """Spec of the operation's results (all of them)."""
    ins: tuple[int | None, ...]
    """Spec each input must have (aligned with :attr:`OpNode.invars`; None: unconstrained)."""
    split: bool
    """Whether the operation's work is divided over the ``t`` devices."""
    outs: tuple[int, ...] | None = None
    """Spec of each of the node's outputs when they differ (a fused group, an attention region); None: ``out``."""
    members: tuple[bool, ...] = ()
    """For a fused group: whether each member equation's work is split (aligned with :attr:`OpNode.eqns`)."""
    internal: tuple[tuple[object, int, int], ...] = ()
    """For a fused group: reshardings between its own members, as ``(value, from spec, to spec)``."""
    defined: tuple[int, ...] = ()
    """For a fused group: the spec of every value its members define (aligned with :attr:`OpNode.defined`)."""


@dataclasses.dataclass
class LayerProgram:
    """A layer's forward and backward as one jaxpr ``f(*inputs, *cotangents) -> (*outputs, *input_grads)``."""

    closed: jex_core.ClosedJaxpr
    num_inputs: int
    """Inputs of the layer (the first ``num_inputs`` invars); the rest are cotangents of :attr:`ct_outputs`."""
    input_kinds: tuple[str, ...]
    """Per layer input: ``param`` (a differentiated parameter), ``batch`` (a differentiated batch-dependent
    activation), ``data`` (batch-dependent, not differentiated: the batch itself) or ``const``."""
    ct_outputs: tuple[int, ...]
    """Forward outputs that receive a cotangent input (the floating ones), in cotangent-invar order."""
    num_outputs: int
    """Forward outputs (the first ``num_outputs`` outvars); the rest are gradients of :attr:`grad_inputs`."""
    grad_inputs: tuple[int, ...]
    """Layer inputs whose gradients follow the outputs, in order."""
    backward_eqns: frozenset[int]
    """Equations that depend on a cotangent."""
    batch_vars: frozenset
    """Variables whose size scales with the batch (they carry its dimension, see :func:`batch_sized_vars`)."""
    dependent_eqns: frozenset
    """Equations that depend on a batch input or a cotangent (their work scales with the batch); the others only
    read parameters and constants (casts of master weights: once per step, not per microbatch)."""
    attention_regions: tuple[tuple[int, ...], ...]
    """Groups of equations inside one fused attention call (forward and backward)."""
    region_work: tuple[float, ...]
    """Per attention region, the fraction of its ``s x s`` score blocks a flash kernel computes (1 full, 0.5 causal,
    less for a sliding window: :func:`autopp.profiler._kernels.attention_work`)."""
    batch_dim_of: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)
    """Per variable of :attr:`batch_vars`, the dimension that carries the batch (data parallelism's, never the
    tensor axis's: a split of it there would depend on the batch the step was traced at)."""


def _float(aval) -> bool:
    return jax.numpy.issubdtype(aval.dtype, jax.numpy.inexact)


def layer_program(closed: jex_core.ClosedJaxpr, input_kinds: Sequence[str],
                  input_batch_dims: Sequence[int | None] | None = None, fused_attention: bool = True) -> LayerProgram:
    """The forward-and-backward program of a layer given as a closed jaxpr and the kind of each input.

    Parameters and batch-dependent floating inputs are differentiated; every floating output receives a
    cotangent as an input of the program (so that backward equations are exactly those depending on one).
    ``input_batch_dims``: the batch dimension of each batch-dependent input (default, or None for one: the leading
    one; a time-major sequence ``(T, B, H)`` has it second). ``fused_attention``: whether the device runs
    ``jax.nn.dot_product_attention`` as one fused kernel (:attr:`DeviceSpec.fused_attention`); if not, its
    equations are plain ones (no attention regions).
    """
    jaxpr = closed.jaxpr
    kinds = tuple(input_kinds)
    if len(kinds) != len(jaxpr.invars):
        raise ValueError(f"layer_program: {len(kinds)} input kinds for {len(jaxpr.invars)} inputs.")
    diff = [i for i, (v, k) in enumerate(zip(jaxpr.invars, kinds)) if k in ("param", "batch") and _float(v.aval)]
    ct_outputs = tuple(k for k, v in enumerate(jaxpr.outvars) if _float(v.aval))
    n_in = len(jaxpr.invars)

    forward = forward_with_vjp(closed, diff, ct_outputs)

    def fwd_bwd(*args):
        outs, vjp = forward(*args[:n_in])
        return (*outs, *vjp(list(args[n_in:])))

    avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in jaxpr.invars]
    avals += [jax.ShapeDtypeStruct(jaxpr.outvars[k].aval.shape, jaxpr.outvars[k].aval.dtype) for k in ct_outputs]
    prog = jax.make_jaxpr(fwd_bwd)(*avals)
    pj = prog.jaxpr
    cts = list(pj.invars[n_in:])
    dep = {v for v, k in zip(pj.invars, kinds) if k in ("batch", "data")} | set(cts)
    ct_dep = set(cts)
    backward, dependent = set(), set()
    for i, e in enumerate(pj.eqns):
        ins = [a for a in e.invars if not isinstance(a, Literal)]
        if any(a in ct_dep for a in ins):
            ct_dep.update(e.outvars)
            backward.add(i)
        if any(a in dep for a in ins):
            dep.update(e.outvars)
            dependent.add(i)
    regions, work = _attention_regions(pj) if fused_attention else ((), [])
    dims = list(input_batch_dims or ()) + [None] * len(kinds)
    starts = {v: (d if d is not None and d < len(v.aval.shape) else 0) for v, k, d in zip(pj.invars, kinds, dims)
              if k in ("batch", "data") and getattr(v.aval, "shape", ())}
    sized = batch_dims(pj, starts, {ct: pj.outvars[k] for ct, k in zip(cts, ct_outputs)})
    return LayerProgram(closed=prog, num_inputs=n_in, input_kinds=kinds, ct_outputs=ct_outputs,
                        num_outputs=len(jaxpr.outvars), grad_inputs=tuple(diff), backward_eqns=frozenset(backward),
                        batch_vars=frozenset(sized), dependent_eqns=frozenset(dependent), attention_regions=regions,
                        region_work=tuple(work), batch_dim_of=sized)


def batch_sized_vars(jaxpr, starts: dict, ct_of: dict) -> set:
    """The variables that carry the batch dimension (their size scales with the batch): the batch inputs (their
    leading dimension, ``starts``: var -> dim) and what operations carry that dimension to, followed through the
    program with the same rules as the sharding strategies (any dimension size allowed); a cotangent carries it
    where its forward output does (``ct_of``: cotangent -> output). A weight gradient (the batch contracted away) or
    a loss (reduced over it) does not."""
    return set(batch_dims(jaxpr, starts, ct_of))


def batch_dims(jaxpr, starts: dict, ct_of: dict | None = None) -> dict:
    """:func:`batch_sized_vars` with each variable's batch dimension: var -> dim."""
    ct_of = ct_of or {}
    _ANY_SIZE[0] = True
    try:
        spec = dict(starts)
        # with cotangents, a second pass knows their batch dimension from the forward's outputs
        for _ in range(2 if ct_of else 1):
            for ct, out in ct_of.items():
                if not isinstance(out, Literal) and spec.get(out, REPLICATED) >= 0:
                    spec[ct] = spec[out]
            for e in jaxpr.eqns:
                have = [None if isinstance(a, Literal) else spec.get(a, REPLICATED) for a in e.invars]
                if all(h is None or h < 0 for h in have):
                    continue
                best = None
                for st in eqn_strategies(e, 2):
                    if st.out < 0 and st.out != PARTIAL:
                        continue
                    # values without the batch dimension can be read any way (a parameter broadcast along it)
                    ok = all(h is None or r is None or h < 0 or h == r for h, r in zip(have, st.ins))
                    carried = sum(1 for h, r in zip(have, st.ins) if h is not None and h >= 0 and r == h)
                    if ok and carried and (best is None or carried > best[0]):
                        best = (carried, st)
                if best is not None and best[1].out >= 0:
                    for v in e.outvars:
                        spec[v] = best[1].out
        return {v: d for v, d in spec.items() if d >= 0}
    finally:
        _ANY_SIZE[0] = False


def _attention_regions(jaxpr) -> tuple[tuple[tuple[int, ...], ...], list[float]]:
    """Connected groups of equations under the fused-attention scope, and the fraction of each one's score blocks
    its kernel computes (read off the scope's name, :func:`autopp.core.fused_attention_scope`)."""
    marked = [i for i, e in enumerate(jaxpr.eqns) if FUSED_ATTENTION_SCOPE in name_stack(e)]
    if not marked:
        return (), []
    links = nx.Graph()
    links.add_nodes_from(marked)
    owner: dict = {}
    for i in marked:
        e = jaxpr.eqns[i]
        for a in list(e.invars) + list(e.outvars):
            if isinstance(a, Literal):
                continue
            if a in owner:
                links.add_edge(i, owner[a])
            else:
                owner[a] = i
    regions = tuple(sorted(tuple(sorted(g)) for g in nx.connected_components(links)))
    return regions, [_region_work(jaxpr, g) for g in regions]


_SCOPE = re.compile(FUSED_ATTENTION_SCOPE + r"(_causal)?(?:_window(-?\d+)x(-?\d+)_q(\d+)_k(\d+))?")


def _region_work(jaxpr, region) -> float:
    for i in region:
        m = _SCOPE.search(name_stack(jaxpr.eqns[i]))
        if m:
            window = (int(m.group(2)), int(m.group(3))) if m.group(2) is not None else None
            return attention_work(bool(m.group(1)), window, int(m.group(4) or 0), int(m.group(5) or 0))
    return 1.0


# ---------------------------------------------------------------------------------------------------------
# Strategies of one equation

ELEMENTWISE = frozenset({
    "add", "sub", "mul", "div", "max", "min", "pow", "integer_pow", "neg", "exp", "exp2", "log", "log1p", "expm1",
    "tanh", "logistic", "sqrt", "rsqrt", "cbrt", "erf", "erfc", "erf_inv", "abs", "sign", "select_n",
    "convert_element_type", "square", "sin", "cos", "tan", "asin", "acos", "atan", "atan2", "sinh", "cosh",
    "asinh", "acosh", "atanh", "stop_gradient", "copy", "copy_p", "clamp", "nextafter", "rem", "eq", "ne", "lt",
    "le", "gt", "ge", "and", "or", "not", "xor", "is_finite", "add_any", "floor", "ceil", "round",
    "reduce_precision", "shift_left", "shift_right_logical", "shift_right_arithmetic", "population_count",
    "real", "imag", "conj", "bitcast_convert_type", "optimization_barrier", "pvary", "mesh_cast", "reshard",
    "sharding_constraint", "device_put",
})
"""Operations applied element by element to operands of the output's shape (or scalars)."""

# Linear in all operands (a sum of partial sums is a partial sum); unary ones keep P.
_LINEAR_ALL = frozenset({"add", "sub", "add_any", "neg", "convert_element_type", "copy", "copy_p",
                         "reduce_precision", "stop_gradient", "optimization_barrier", "pvary"})
_LINEAR_FIRST = frozenset({"mul", "div"})  # linear in the first operand (and mul in either)
_SUM_REDUCTIONS = frozenset({"reduce_sum"})
_REDUCTIONS = frozenset({"reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or",
                         "argmax", "argmin", "reduce_xor"})
_CUMULATIVE = frozenset({"cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp"})
_NESTED_CALLS = frozenset({"pjit", "jit", "closed_call", "core_call", "custom_jvp_call", "custom_vjp_call",
                           "custom_vjp_call_jaxpr", "remat", "checkpoint", "remat_call"})


_ANY_SIZE = [False]
"""While True (see :func:`batch_sized_vars`), every dimension counts as splittable: the strategies then say where a
dimension *goes* (the batch dimension, whatever its size), not whether ``t`` divides it."""


def _splittable(shape, d: int, t: int) -> bool:
    if _ANY_SIZE[0]:
        return 0 <= d < len(shape)
    return 0 <= d < len(shape) and shape[d] >= t and shape[d] % t == 0


def _divides(t: int, n: int) -> bool:
    return _ANY_SIZE[0] or n % t == 0


def _shape(a) -> tuple:
    return tuple(getattr(a.aval, "shape", ()))


def _none_if_lit(a, spec):
    return None if isinstance(a, Literal) else spec


def _all(eqn, spec_of_input) -> tuple:
    return tuple(None if isinstance(a, Literal) else spec_of_input(a) for a in eqn.invars)


def reshape_dim(old: tuple, new: tuple, d: int, t: int) -> int | None:
    """Where a split of dimension ``d`` of ``old`` lands after a reshape to ``new`` (None: it does not survive):
    the dimension of ``new`` starting at the same flat offset, whose block structure matches (merging ``d`` with
    minor dimensions, or splitting ``d`` into a major factor that ``t`` divides)."""
    before = math.prod(old[:d])
    acc = 1
    for i, n in enumerate(new):
        if acc == before:
            size = old[d]
            if n == size and _divides(t, n):
                return i
            if n > size and n % size == 0 and _divides(t, size):  # merge d with minor dims: the major carries it
                return i
            if n < size and size % n == 0 and _divides(t, n):  # d splits into n x ...: the major factor carries it
                return i
            if n == 1 and not _ANY_SIZE[0]:
                acc *= n
                continue
            return None
        acc *= n
        if acc > before:
            return None
    return None


def eqn_strategies(eqn, t: int) -> list[Strategy]:
    """The strategies of one equation over ``t`` devices (at least the replicated one)."""
    name = eqn.primitive.name
    outs = eqn.outvars
    out_shape = _shape(outs[0]) if outs else ()
    rep = Strategy(REPLICATED, _all(eqn, lambda a: REPLICATED), False)
    strategies = [rep]
    if t == 1:
        return strategies

    def add(out, ins, split):
        s = Strategy(out, tuple(ins), split)
        if s not in strategies:
            strategies.append(s)

    if name == "dot_general":
        (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
        lhs, rhs = eqn.invars
        ls, rs = _shape(lhs), _shape(rhs)
        lfree = [i for i in range(len(ls)) if i not in lc and i not in lb]
        rfree = [i for i in range(len(rs)) if i not in rc and i not in rb]
        nb = len(lb)
        for i, (a, b) in enumerate(zip(lb, rb)):
            if _splittable(ls, a, t):
                add(i, (_none_if_lit(lhs, a), _none_if_lit(rhs, b)), True)
        for j, f in enumerate(lfree):
            if _splittable(ls, f, t):
                add(nb + j, (_none_if_lit(lhs, f), _none_if_lit(rhs, REPLICATED)), True)
        for j, g in enumerate(rfree):
            if _splittable(rs, g, t):
                add(nb + len(lfree) + j, (_none_if_lit(lhs, REPLICATED), _none_if_lit(rhs, g)), True)
        for a, b in zip(lc, rc):
            if _splittable(ls, a, t):
                add(PARTIAL, (_none_if_lit(lhs, a), _none_if_lit(rhs, b)), True)
        # linear in each operand: a partial operand gives a partial result
        add(PARTIAL, (_none_if_lit(lhs, PARTIAL), _none_if_lit(rhs, REPLICATED)), False)
        add(PARTIAL, (_none_if_lit(lhs, REPLICATED), _none_if_lit(rhs, PARTIAL)), False)
        return strategies

    if name in ELEMENTWISE:
        if len(outs) != 1:
            return strategies
        arrays = [a for a in eqn.invars if not isinstance(a, Literal) and _shape(a) == out_shape and out_shape]
        for d in range(len(out_shape)):
            if _splittable(out_shape, d, t):
                # an operand broadcast along d (size 1 there, or of lower rank) is needed whole
                add(d, [None if isinstance(a, Literal) else (
                    d if len(_shape(a)) == len(out_shape) and _shape(a)[d] == out_shape[d] else REPLICATED)
                    for a in eqn.invars], True)
        vars_ = [a for a in eqn.invars if not isinstance(a, Literal)]
        if name in _LINEAR_ALL and vars_ and all(_shape(a) == out_shape for a in vars_) and \
                not any(isinstance(a, Literal) for a in eqn.invars if name in ("add", "sub")):
            add(PARTIAL, [None if isinstance(a, Literal) else PARTIAL for a in eqn.invars], False)
        elif name in _LINEAR_FIRST and arrays:
            for k, a in enumerate(eqn.invars):
                if isinstance(a, Literal) or (name == "div" and k != 0):
                    continue
                add(PARTIAL, [None if isinstance(b, Literal) else (PARTIAL if j == k else REPLICATED)
                              for j, b in enumerate(eqn.invars)], False)
        return strategies

    if name == "broadcast_in_dim":
        x = eqn.invars[0]
        if isinstance(x, Literal):
            return strategies
        xs = _shape(x)
        bdims = eqn.params["broadcast_dimensions"]
        rest = [None] * (len(eqn.invars) - 1)
        for d in range(len(xs)):
            if _splittable(xs, d, t) and out_shape[bdims[d]] == xs[d]:
                add(int(bdims[d]), [d] + rest, True)
        add(PARTIAL, [PARTIAL] + rest, False)
        return strategies

    if name == "reshape":
        x = eqn.invars[0]
        xs = _shape(x)
        for d in range(len(xs)):
            if _splittable(xs, d, t):
                nd = reshape_dim(xs, out_shape, d, t)
                if nd is not None:
                    add(nd, [d] + [None] * (len(eqn.invars) - 1), True)
        add(PARTIAL, [PARTIAL] + [None] * (len(eqn.invars) - 1), False)
        return strategies

    if name == "transpose":
        perm = list(eqn.params["permutation"])
        xs = _shape(eqn.invars[0])
        for d in range(len(xs)):
            if _splittable(xs, d, t):
                add(perm.index(d), [d], True)
        add(PARTIAL, [PARTIAL], False)
        return strategies

    if name == "squeeze":
        xs = _shape(eqn.invars[0])
        gone = sorted(int(d) % max(1, len(xs)) for d in eqn.params["dimensions"])
        for d in range(len(xs)):
            if d not in gone and _splittable(xs, d, t):
                add(d - sum(1 for g in gone if g < d), [d], True)
        add(PARTIAL, [PARTIAL], False)
        return strategies

    if name in _REDUCTIONS:
        xs = _shape(eqn.invars[0])
        axes = tuple(int(a) for a in eqn.params.get("axes", ()))
        for d in range(len(xs)):
            if not _splittable(xs, d, t):
                continue
            if d not in axes:
                add(d - sum(1 for a in axes if a < d), [d] + [None] * (len(eqn.invars) - 1), True)
            elif name in _SUM_REDUCTIONS:
                add(PARTIAL, [d] + [None] * (len(eqn.invars) - 1), True)
        if name in _SUM_REDUCTIONS:
            add(PARTIAL, [PARTIAL], False)
        return strategies

    if name in _CUMULATIVE:
        xs = _shape(eqn.invars[0])
        axis = int(eqn.params.get("axis", 0))
        for d in range(len(xs)):
            if d != axis and _splittable(xs, d, t):
                add(d, [d], True)
        if name == "cumsum":
            add(PARTIAL, [PARTIAL], False)
        return strategies

    if name == "stack":  # operands of one shape stacked along a new axis of the result
        axis = int(eqn.params.get("axis", 0))
        xs = _shape(eqn.invars[0])
        for d in range(len(xs)):
            if _splittable(xs, d, t):
                add(d if d < axis else d + 1, [None if isinstance(a, Literal) else d for a in eqn.invars], True)
        if not any(isinstance(a, Literal) for a in eqn.invars):
            add(PARTIAL, [PARTIAL] * len(eqn.invars), False)
        return strategies

    if name == "unstack":  # the inverse: one result per index of ``axis``
        axis = int(eqn.params.get("axis", 0))
        xs = _shape(eqn.invars[0])
        for d in range(len(xs)):
            if d != axis and _splittable(xs, d, t):
                add(d if d < axis else d - 1, [d], True)
        add(PARTIAL, [PARTIAL], False)
        return strategies

    if name in ("slice", "rev", "pad", "dynamic_slice", "dynamic_update_slice", "concatenate", "split"):
        return _slicing_strategies(eqn, t, strategies, add)

    if name == "conv_general_dilated":
        return _conv_strategies(eqn, t, strategies, add)

    if name in _WINDOWED:  # dimensions the window does not span (size 1, stride 1, no padding or dilation) pass
        xs = _shape(eqn.invars[-1] if name.startswith("select_and") else eqn.invars[0])
        p = eqn.params
        for d in range(len(xs)):
            if (_splittable(xs, d, t) and p["window_dimensions"][d] == 1 and p["window_strides"][d] == 1
                    and tuple(p["padding"][d]) == (0, 0)
                    and all(p.get(k, (1,) * len(xs))[d] == 1 for k in ("base_dilation", "window_dilation"))):
                add(d, [None if isinstance(a, Literal) else d for a in eqn.invars], True)
        return strategies

    if name == "fft":  # the transform runs over the last len(fft_lengths) dimensions; the others pass
        xs = _shape(eqn.invars[0])
        for d in range(len(xs) - len(eqn.params["fft_lengths"])):
            if _splittable(xs, d, t):
                add(d, [d], True)
        return strategies

    if name == "gather":
        return _gather_strategies(eqn, t, strategies, add)

    if name.startswith("scatter"):
        return _scatter_strategies(eqn, t, strategies, add)

    subs = list(jex_core.jaxprs_in_params(eqn.params))
    if subs and name not in ("scan", "while", "cond") and len(outs) == 1:
        body = subs[0]
        for d in range(len(out_shape)):
            if not _splittable(out_shape, d, t):
                continue
            ins = [None if isinstance(a, Literal) else (d if _shape(a) == out_shape else REPLICATED)
                   for a in eqn.invars]
            if _passes_through(body, ins, d, t):
                add(d, ins, True)
    return strategies


_WINDOWED = frozenset({"reduce_window_sum", "reduce_window_max", "reduce_window_min", "select_and_scatter_add",
                       "select_and_gather_add"})


def _conv_strategies(eqn, t, strategies, add):
    """A convolution: the batch dimension (each example convolved alone), the kernel's output features (column
    parallel) or the input features it contracts (partial sums; the weight gradient contracts the batch so). Spatial
    dimensions would need halo exchanges and are not split."""
    lhs, rhs = eqn.invars
    dn = eqn.params["dimension_numbers"]
    ls, rs = _shape(lhs), _shape(rhs)
    if eqn.params.get("batch_group_count", 1) == 1 and _splittable(ls, dn.lhs_spec[0], t):
        add(dn.out_spec[0], (_none_if_lit(lhs, dn.lhs_spec[0]), _none_if_lit(rhs, REPLICATED)), True)
    if eqn.params.get("feature_group_count", 1) == 1:
        if _splittable(rs, dn.rhs_spec[0], t):
            add(dn.out_spec[1], (_none_if_lit(lhs, REPLICATED), _none_if_lit(rhs, dn.rhs_spec[0])), True)
        if _splittable(ls, dn.lhs_spec[1], t):
            add(PARTIAL, (_none_if_lit(lhs, dn.lhs_spec[1]), _none_if_lit(rhs, dn.rhs_spec[1])), True)
    add(PARTIAL, (_none_if_lit(lhs, PARTIAL), _none_if_lit(rhs, REPLICATED)), False)
    add(PARTIAL, (_none_if_lit(lhs, REPLICATED), _none_if_lit(rhs, PARTIAL)), False)
    return strategies


def _slicing_strategies(eqn, t, strategies, add):
    name = eqn.primitive.name
    x = eqn.invars[0]
    xs = _shape(x)
    outs = eqn.outvars
    n_in = len(eqn.invars)
    if name == "concatenate":
        dim = int(eqn.params["dimension"])
        for d in range(len(xs)):
            if d != dim and _splittable(xs, d, t):
                add(d, [None if isinstance(a, Literal) else d for a in eqn.invars], True)
        if not any(isinstance(a, Literal) for a in eqn.invars):
            add(PARTIAL, [PARTIAL] * n_in, False)
        return strategies
    if name == "split":
        axis = int(eqn.params["axis"])
        for d in range(len(xs)):
            if d != axis and _splittable(xs, d, t):
                add(d, [d], True)
        add(PARTIAL, [PARTIAL], False)
        return strategies
    if name == "dynamic_update_slice":
        upd = _shape(eqn.invars[1])
        for d in range(len(xs)):
            if _splittable(xs, d, t) and upd[d] == xs[d]:
                add(d, [d, None if isinstance(eqn.invars[1], Literal) else d] + [REPLICATED] * (n_in - 2), True)
        return strategies
    out_shape = _shape(outs[0])
    for d in range(len(xs)):
        if not _splittable(xs, d, t) or out_shape[d] != xs[d]:
            continue
        if name == "pad" and tuple(eqn.params["padding_config"][d]) != (0, 0, 0):
            continue
        if name == "rev" and d in eqn.params["dimensions"]:
            continue
        if name == "dynamic_slice":
            add(d, [d] + [REPLICATED] * (n_in - 1), True)
        elif name == "pad":
            add(d, [d, None if isinstance(eqn.invars[1], Literal) else REPLICATED], True)
        else:
            add(d, [d], True)
    if name in ("slice", "rev"):
        add(PARTIAL, [PARTIAL], False)
    return strategies


def _gather_strategies(eqn, t, strategies, add):
    operand, indices = eqn.invars[0], eqn.invars[1]
    dn = eqn.params["dimension_numbers"]
    os_, is_ = _shape(operand), _shape(indices)
    out_shape = _shape(eqn.outvars[0])
    slice_sizes = tuple(eqn.params["slice_sizes"])
    offset = list(dn.offset_dims)
    collapsed = set(dn.collapsed_slice_dims) | set(getattr(dn, "operand_batching_dims", ()))
    # output dims that are not offset dims follow the indices' dims (all but the last, the index vector)
    batch_out = [d for d in range(len(out_shape)) if d not in offset]
    idx_dims = list(range(len(is_) - 1))
    for k, od in zip(idx_dims, batch_out):
        if _splittable(is_, k, t) and not getattr(dn, "operand_batching_dims", ()):
            add(od, [REPLICATED, k], True)
    kept = [d for d in range(len(os_)) if d not in collapsed]
    for od, d in zip(offset, kept):
        if _splittable(os_, d, t) and slice_sizes[d] == os_[d]:
            add(od, [d, REPLICATED], True)
    for d in dn.collapsed_slice_dims:  # the indexed dimension split: each device gathers its rows, zeros elsewhere
        if _splittable(os_, d, t) and slice_sizes[d] == 1:
            add(PARTIAL, [d, REPLICATED], True)
    # a batched gather (vmap of dynamic_slice, a per-example crop): each example's slice from its own operand
    for ob, ib in zip(getattr(dn, "operand_batching_dims", ()), getattr(dn, "start_indices_batching_dims", ())):
        if ib in idx_dims and _splittable(os_, ob, t) and _splittable(is_, ib, t):
            add(batch_out[idx_dims.index(ib)], [ob, ib], True)
    return strategies


def _scatter_strategies(eqn, t, strategies, add):
    if len(eqn.invars) != 3:
        return strategies
    operand, indices, updates = eqn.invars
    dn = eqn.params["dimension_numbers"]
    os_, is_, us = _shape(operand), _shape(indices), _shape(updates)
    window = list(dn.update_window_dims)
    inserted = set(dn.inserted_window_dims) | set(getattr(dn, "operand_batching_dims", ()))
    kept = [d for d in range(len(os_)) if d not in inserted]
    lit = lambda a, s: None if isinstance(a, Literal) else s  # noqa: E731
    for ud, d in zip(window, kept):
        if _splittable(os_, d, t) and us[ud] == os_[d]:
            add(d, [lit(operand, d), REPLICATED, lit(updates, ud)], True)
    if eqn.primitive.name == "scatter-add" or eqn.primitive.name == "scatter_add":
        scatter_upd = [d for d in range(len(us)) if d not in window]
        for k, ud in zip(range(len(is_) - 1), scatter_upd):  # updates split by position: partial sums
            if _splittable(is_, k, t) and _splittable(us, ud, t):
                add(PARTIAL, [lit(operand, PARTIAL), k, lit(updates, ud)], True)
        for d in dn.inserted_window_dims:  # the table's indexed dimension split: each device adds its rows
            if _splittable(os_, d, t):
                add(d, [lit(operand, d), REPLICATED, lit(updates, REPLICATED)], True)
    # a batched scatter (vmap of dynamic_update_slice, a per-example cutmix): each example's update into its own
    scatter_upd = [d for d in range(len(us)) if d not in window]
    for ob, ib in zip(getattr(dn, "operand_batching_dims", ()), getattr(dn, "scatter_indices_batching_dims", ())):
        if ib < len(scatter_upd) and _splittable(os_, ob, t) and _splittable(is_, ib, t):
            add(ob, [lit(operand, ob), ib, lit(updates, scatter_upd[ib])], True)
    return strategies


def _passes_through(body, in_specs, d: int, t: int) -> bool:
    """Whether a called body, given inputs laid out as ``in_specs``, computes its single output split on ``d``
    with no resharding (each equation has a strategy matching the layouts its inputs arrive in)."""
    j = body.jaxpr if isinstance(body, jex_core.ClosedJaxpr) else body
    if len(j.outvars) != 1:
        return False
    spec = {v: (REPLICATED if s is None else s) for v, s in zip(j.invars, in_specs)}
    for c in j.constvars:
        spec[c] = REPLICATED
    for e in j.eqns:
        have = tuple(None if isinstance(a, Literal) else spec.get(a, REPLICATED) for a in e.invars)
        options = [s for s in eqn_strategies(e, t)
                   if all(h is None or r is None or h == r or (h == REPLICATED and r == REPLICATED)
                          for h, r in zip(have, s.ins))]
        if not options:
            return False
        best = max(options, key=lambda s: (s.split, s.out != PARTIAL))
        for v in e.outvars:
            spec[v] = best.out
    o = j.outvars[0]
    return not isinstance(o, Literal) and spec.get(o) == d

"""Analytic per-equation costs of a jaxpr: FLOPs, bytes read and written, output bytes."""

from __future__ import annotations

import dataclasses
import math
import warnings

import numpy as np
from jax.extend import core as jex_core

# Elementwise primitives that XLA's cost analysis counts as transcendental (one per output element).
TRANSCENDENTAL = frozenset(
    {"exp", "exp2", "log", "log1p", "expm1", "tanh", "logistic", "sin", "cos", "tan", "asin", "acos", "atan",
     "atan2", "sinh", "cosh", "asinh", "acosh", "atanh", "sqrt", "rsqrt", "cbrt", "pow", "erf", "erfc",
     "erf_inv", "lgamma", "digamma", "igamma", "random_gamma_grad", "bessel_i0e", "bessel_i1e"}
)
# Primitives that move or relabel data without arithmetic.
ZERO_FLOP = frozenset(
    {"reshape", "broadcast_in_dim", "squeeze", "expand_dims", "transpose", "convert_element_type", "slice",
     "dynamic_slice", "dynamic_update_slice", "concatenate", "pad", "gather", "scatter", "select_n", "iota",
     "copy", "copy_p", "rev", "stop_gradient", "bitcast_convert_type", "device_put", "sharding_constraint",
     "squeeze", "split", "argmax", "argmin", "sort", "clamp", "random_bits", "random_seed", "random_wrap",
     "random_unwrap", "threefry2x32", "shift_right_logical", "shift_left", "and", "or", "not", "xor", "eq",
     "ne", "lt", "le", "gt", "ge", "is_finite", "optimization_barrier", "pvary", "mesh_cast", "reshard",
     "empty", "full", "broadcast", "real", "imag", "conj", "population_count", "clz", "zeros_like"}
)
REDUCTIONS = frozenset({"reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or",
                        "reduce_precision", "argmax", "argmin", "cumsum", "cumprod", "cummax", "cumlogsumexp"})


@dataclasses.dataclass(frozen=True)
class OpCost:
    """The analytic cost of one equation (nested jaxprs included)."""

    flops: float
    """Floating-point operations (a multiply-add counts 2)."""
    transcendentals: float
    """Transcendental evaluations (exp, log, tanh, ...)."""
    bytes_accessed: float
    """Bytes read plus bytes written, counting each operand and result once."""
    output_bytes: float
    """Bytes of the equation's results."""

    def __add__(self, other: OpCost) -> OpCost:
        return OpCost(self.flops + other.flops, self.transcendentals + other.transcendentals,
                      self.bytes_accessed + other.bytes_accessed, self.output_bytes + other.output_bytes)

    def scale(self, k: float) -> OpCost:
        return OpCost(self.flops * k, self.transcendentals * k, self.bytes_accessed * k, self.output_bytes * k)


ZERO = OpCost(0.0, 0.0, 0.0, 0.0)
_warned: set[str] = set()


def aval_bytes(aval) -> int:
    shape = getattr(aval, "shape", None)
    dtype = getattr(aval, "dtype", None)
    if shape is None or dtype is None:
        return 0
    try:
        itemsize = np.dtype(dtype).itemsize
    except TypeError:  # extended dtypes (PRNG keys)
        itemsize = 8
    return int(math.prod(shape)) * itemsize


def _size(aval) -> int:
    return int(math.prod(getattr(aval, "shape", ())))


def _dot_flops(eqn) -> float:
    (lc, _), _ = eqn.params["dimension_numbers"]
    lhs = eqn.invars[0].aval
    contract = math.prod(lhs.shape[d] for d in lc)
    out = _size(eqn.outvars[0].aval)
    return 2.0 * out * contract


def _conv_flops(eqn) -> float:
    rhs = eqn.invars[1].aval
    out = eqn.outvars[0].aval
    dn = eqn.params["dimension_numbers"]
    rhs_spec = dn.rhs_spec  # (out feature dim, in feature dim, spatial...)
    kernel_in = rhs.shape[rhs_spec[1]]
    spatial = math.prod(rhs.shape[d] for d in rhs_spec[2:])
    return 2.0 * _size(out) * kernel_in * spatial / max(1, eqn.params.get("batch_group_count", 1))


def jaxpr_cost(jaxpr: jex_core.Jaxpr) -> OpCost:
    """Sum of :func:`eqn_cost` over a jaxpr."""
    total = ZERO
    for eqn in jaxpr.eqns:
        total = total + eqn_cost(eqn)
    return total


def _sub(param) -> jex_core.Jaxpr:
    return param.jaxpr if isinstance(param, jex_core.ClosedJaxpr) else param


def eqn_cost(eqn: jex_core.JaxprEqn) -> OpCost:
    """Analytic cost of one equation, recursing into nested jaxprs (scan counted ``length`` times)."""
    name = eqn.primitive.name
    in_bytes = sum(aval_bytes(v.aval) for v in eqn.invars if hasattr(v, "aval"))
    out_bytes = sum(aval_bytes(v.aval) for v in eqn.outvars)
    io = in_bytes + out_bytes
    out_size = sum(_size(v.aval) for v in eqn.outvars)

    if name == "scan":
        body = jaxpr_cost(_sub(eqn.params["jaxpr"]))
        return OpCost(body.flops * eqn.params["length"], body.transcendentals * eqn.params["length"],
                      body.bytes_accessed * eqn.params["length"], out_bytes)
    if name == "cond":
        branches = [jaxpr_cost(_sub(b)) for b in eqn.params["branches"]]
        worst = max(branches, key=lambda c: c.flops)
        return OpCost(worst.flops, worst.transcendentals, worst.bytes_accessed, out_bytes)
    if name == "while":
        body = jaxpr_cost(_sub(eqn.params["body_jaxpr"])) + jaxpr_cost(_sub(eqn.params["cond_jaxpr"]))
        if "while" not in _warned:
            _warned.add("while")
            warnings.warn("autopp cost model: lax.while_loop trip counts are unknown; counted once.", stacklevel=3)
        return OpCost(body.flops, body.transcendentals, body.bytes_accessed, out_bytes)
    subs = list(jex_core.jaxprs_in_params(eqn.params))
    if subs:  # jit, custom_jvp_call, custom_vjp_call, remat, autopp_value_and_grad, ...
        inner = ZERO
        for s in subs[:1] if name.startswith("custom") else subs:
            inner = inner + jaxpr_cost(_sub(s))
        if name == "autopp_value_and_grad":
            # forward + backward ~ 3x forward in FLOPs (two matmuls per forward matmul in the VJP).
            inner = inner.scale(3.0)
        return OpCost(inner.flops, inner.transcendentals, inner.bytes_accessed, out_bytes)

    if name == "dot_general":
        return OpCost(_dot_flops(eqn), 0.0, io, out_bytes)
    if name == "conv_general_dilated":
        return OpCost(_conv_flops(eqn), 0.0, io, out_bytes)
    if name in ZERO_FLOP:
        return OpCost(0.0, 0.0, io, out_bytes)
    if name in REDUCTIONS:
        in_size = sum(_size(v.aval) for v in eqn.invars if hasattr(v, "aval"))
        return OpCost(float(in_size), 0.0, io, out_bytes)
    if name in TRANSCENDENTAL:
        return OpCost(0.0, float(out_size), io, out_bytes)
    if name in {"add", "sub", "mul", "div", "neg", "max", "min", "abs", "sign", "floor", "ceil", "round",
                "add_any", "square", "integer_pow", "rem", "nextafter", "select_and_scatter_add",
                "reduce_window_sum", "exp2", "logistic"}:
        k = 1.0
        if name == "integer_pow":
            k = max(1.0, abs(eqn.params.get("y", 2)) - 1.0)
        return OpCost(k * out_size, 0.0, io, out_bytes)
    if name not in _warned:
        _warned.add(name)
        warnings.warn(
            f"autopp cost model: no rule for primitive {name!r}; counting one FLOP per output element.",
            stacklevel=3,
        )
    return OpCost(float(out_size), 0.0, io, out_bytes)


MATMUL_PRIMITIVES = frozenset({"dot_general", "conv_general_dilated"})


def _flatten_calls(jaxpr: jex_core.Jaxpr) -> list:
    """The jaxpr's equations with plain calls (``jit``) replaced by their bodies, recursively."""
    out = []
    for e in jaxpr.eqns:
        if e.primitive.name in ("jit", "pjit", "closed_call", "core_call"):
            body = e.params.get("jaxpr", e.params.get("call_jaxpr"))
            out.extend(_flatten_calls(body.jaxpr if isinstance(body, jex_core.ClosedJaxpr) else body))
        else:
            out.append(e)
    return out


def kernel_costs(jaxpr: jex_core.Jaxpr) -> list[tuple[str, OpCost]]:
    """The jaxpr as the kernels XLA would run, as ``(kind, cost)`` pairs.

    ``"matmul"``: one dot/convolution. ``"fused"``: a run of other equations between matmuls, fused into
    one kernel whose memory traffic is only what crosses its boundary (values read from outside the run,
    values used after it). ``"loop"``: a control-flow equation (scan, while, cond) with its nested costs.
    Plain calls (``jit``) are looked through.
    """
    eqns = _flatten_calls(jaxpr)
    last_use: dict = {}
    for i, e in enumerate(eqns):
        for a in e.invars:
            if not isinstance(a, jex_core.Literal):
                last_use[a] = i
    for a in jaxpr.outvars:
        if not isinstance(a, jex_core.Literal):
            last_use[a] = len(eqns)
    kernels: list[tuple[str, OpCost]] = []
    run: list[int] = []

    def close_run():
        if not run:
            return
        inside, read = set(), set()
        flops = trans = 0.0
        traffic = out_bytes = 0
        for i in run:
            c = eqn_cost(eqns[i])
            flops += c.flops
            trans += c.transcendentals
            for a in eqns[i].invars:
                if not isinstance(a, jex_core.Literal) and a not in inside and a not in read:
                    read.add(a)
                    traffic += aval_bytes(a.aval)
            inside.update(eqns[i].outvars)
        for i in run:
            for v in eqns[i].outvars:
                if last_use.get(v, -1) > run[-1]:
                    traffic += aval_bytes(v.aval)
                    out_bytes += aval_bytes(v.aval)
        kernels.append(("fused", OpCost(flops, trans, float(traffic), float(out_bytes))))
        run.clear()

    for i, e in enumerate(eqns):
        if e.primitive.name in MATMUL_PRIMITIVES:
            close_run()
            kernels.append(("matmul", eqn_cost(e)))
        elif e.primitive.name in ("scan", "while", "cond"):
            close_run()
            kernels.append(("loop", eqn_cost(e)))
        else:
            run.append(i)
    close_run()
    return kernels

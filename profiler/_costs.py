"""Analytic per-equation costs of a jaxpr: FLOPs, bytes read and written, output bytes.

Every primitive the zoo models, the examples and their optax training steps trace to has an explicit rule
(:data:`COSTED_PRIMITIVES`, :func:`has_cost_rule`). The conventions, close to XLA's own cost analysis:

* ``dot_general`` / ``conv_general_dilated`` / ``ragged_dot_general``: a multiply-add is 2 FLOPs.
* Elementwise arithmetic (:data:`ELEMENTWISE`): one FLOP per output element (``integer_pow``: one per multiply).
* Transcendentals (:data:`TRANSCENDENTAL`): one transcendental per output element and no FLOPs.
* Reductions and scans (:data:`REDUCTIONS`: ``reduce_*``, ``arg*``, ``cum*``): one FLOP per input element.
* Windowed reductions (:data:`WINDOWED`): one FLOP per window element of each output.
* Combining scatters (:data:`SCATTER_COMBINE`): one FLOP per update element.
* Data movement, relabelling, comparisons, bit logic, PRNG bit hashing and collectives that only move data
  (:data:`ZERO_FLOP`): no FLOPs, their bytes only.
* Calls (:data:`CALLS`: jit, remat/checkpoint, custom_jvp/vjp, ...): the cost of the body they run; ``scan``
  ``length`` times its body, ``cond`` its most expensive branch, ``while`` its body once (with a warning),
  ``shard_map`` its per-device body times the devices it runs on.

Bytes accessed are each operand and result once. Any other primitive is priced as one FLOP per output
element (or as the jaxprs it holds), with one warning per primitive name per process.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Callable

import jax
import numpy as np
from jax.extend import core as jex_core

# Elementwise primitives that XLA's cost analysis counts as transcendental (one per output element).
TRANSCENDENTAL = frozenset(
    {"exp", "exp2", "log", "log1p", "expm1", "tanh", "logistic", "sin", "cos", "tan", "asin", "acos", "atan",
     "atan2", "sinh", "cosh", "asinh", "acosh", "atanh", "sqrt", "rsqrt", "cbrt", "pow", "erf", "erfc",
     "erf_inv", "lgamma", "digamma", "igamma", "igammac", "igamma_grad_a", "random_gamma_grad", "polygamma",
     "zeta", "regularized_incomplete_beta", "bessel_i0e", "bessel_i1e"}
)
# Primitives that move or relabel data without floating-point arithmetic (comparisons, bit logic and the
# integer hashing of PRNG bits included; a collective's communication is priced elsewhere).
ZERO_FLOP = frozenset(
    {"reshape", "broadcast_in_dim", "broadcast_to", "squeeze", "expand_dims", "transpose",
     "convert_element_type", "slice", "dynamic_slice", "dynamic_update_slice", "concatenate", "stack",
     "unstack", "split", "tile", "pad", "gather", "scatter", "select_n", "iota", "copy", "copy_p", "rev",
     "stop_gradient", "bitcast_convert_type", "device_put", "sharding_constraint", "layout_constraint",
     "optimization_barrier", "pvary", "mesh_cast", "reshard", "empty", "empty2", "full", "broadcast", "zeros_like",
     "real", "imag", "conj", "complex",
     "shift_right_logical", "shift_right_arithmetic", "shift_left", "and", "or", "not", "xor", "eq", "ne",
     "lt", "le", "gt", "ge", "lt_to", "le_to", "is_finite", "population_count", "clz",
     "random_bits", "random_seed", "random_wrap", "random_unwrap", "random_split", "random_fold_in",
     "random_clone", "threefry2x32", "threefry4x32", "philox2x32", "philox4x32", "iota_2x32_shape",
     "rng_bit_generator", "rng_uniform",
     "all_gather", "all_gather_invariant", "all_to_all", "ragged_all_to_all", "ppermute", "pbroadcast",
     "axis_index", "psend", "precv"}
)
# Elementwise arithmetic: one FLOP per output element (integer_pow: one per multiply).
ELEMENTWISE = frozenset(
    {"add", "sub", "mul", "div", "neg", "max", "min", "abs", "sign", "floor", "ceil", "round", "add_any",
     "square", "integer_pow", "rem", "nextafter", "clamp", "reduce_precision", "mulhi"}
)
# One FLOP per input element (reductions, arg-reductions, cumulative scans, reducing collectives).
REDUCTIONS = frozenset({"reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or",
                        "reduce_xor", "argmax", "argmin", "cumsum", "cumprod", "cummax", "cummin",
                        "cumlogsumexp", "psum", "psum_invariant", "pmax", "pmin", "reduce_scatter",
                        "psum_scatter", "unreduced_psum"})
# Windowed reductions (pooling and its derivatives): one FLOP per window element of each output.
WINDOWED = frozenset({"reduce_window_sum", "reduce_window_max", "reduce_window_min", "reduce_window",
                      "select_and_gather_add", "select_and_scatter_add", "select_and_scatter"})
# Scatters that combine each update with the operand: one FLOP per update element.
SCATTER_COMBINE = frozenset({"scatter-add", "scatter_add", "scatter-sub", "scatter_sub", "scatter-mul",
                             "scatter_mul", "scatter-min", "scatter_min", "scatter-max", "scatter_max"})
# Calls: priced as the jaxpr they run (custom_jvp/vjp: the primal body only; the derivative rules show up as
# ordinary equations once differentiated).
CALLS = frozenset({"jit", "pjit", "closed_call", "core_call", "call", "remat2", "remat", "checkpoint",
                   "custom_jvp_call", "custom_jvp_call_jaxpr", "custom_vjp_call", "custom_vjp_call_jaxpr",
                   "custom_vmap_call", "composite", "run_state"})
CONTROL_FLOW = frozenset({"scan", "cond", "while"})

# Each cumlogsumexp element is an exp and a log (log(cumsum(exp(x))) evaluated stably).
_CUMLOGSUMEXP_TRANSCENDENTALS = 2.0
# random_gamma (Marsaglia-Tsang with rejection, accepting ~97% of proposals): per sample about a normal and a
# uniform draw, a cube, a few multiply-adds and comparisons, and log/sqrt evaluations.
_GAMMA_FLOPS, _GAMMA_TRANSCENDENTALS = 20.0, 4.0
# autopp.value_and_grad: forward + backward ~ 3x forward (two matmuls per forward matmul in the VJP).
_VALUE_AND_GRAD_FACTOR = 3.0


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


_ITEMSIZE: dict = {}  # dtype -> bytes per element (a profile asks hundreds of thousands of times)


def aval_bytes(aval) -> int:
    """Bytes of an array of ``aval``'s shape and dtype (0 for a value without both, a token say)."""
    shape = getattr(aval, "shape", None)
    dtype = getattr(aval, "dtype", None)
    if shape is None or dtype is None:
        return 0
    itemsize = _ITEMSIZE.get(dtype)
    if itemsize is None:
        try:
            itemsize = np.dtype(dtype).itemsize
        except TypeError:  # extended dtypes (PRNG keys)
            itemsize = 8
        _ITEMSIZE[dtype] = itemsize
    return int(math.prod(shape)) * itemsize


def _size(aval) -> int:
    return int(math.prod(getattr(aval, "shape", ())))


def _in_size(eqn) -> int:
    return sum(_size(v.aval) for v in eqn.invars if hasattr(v, "aval"))


def _out_size(eqn) -> int:
    return sum(_size(v.aval) for v in eqn.outvars)


def _out_bytes(eqn) -> int:
    return sum(aval_bytes(v.aval) for v in eqn.outvars)


def _io_bytes(eqn) -> int:
    return sum(aval_bytes(v.aval) for v in eqn.invars if hasattr(v, "aval")) + _out_bytes(eqn)


def _arith(eqn, flops: float, transcendentals: float = 0.0) -> OpCost:
    """An equation that reads its operands once and writes its results once."""
    return OpCost(float(flops), float(transcendentals), _io_bytes(eqn), _out_bytes(eqn))


def _dot_flops(eqn) -> float:
    (lc, _), _ = eqn.params["dimension_numbers"]
    lhs = eqn.invars[0].aval
    contract = math.prod(lhs.shape[d] for d in lc)
    out = _size(eqn.outvars[0].aval)
    return 2.0 * out * contract


def _conv_flops(eqn) -> float:
    """2 multiply-adds per (output element, input feature, kernel tap) pair that reads a real input element: taps
    landing on padding, or between the elements an ``lhs_dilation`` spreads out (the input gradient of a strided
    convolution), are not work, as XLA's own cost analysis counts them."""
    lhs, rhs = eqn.invars[0].aval, eqn.invars[1].aval
    out = eqn.outvars[0].aval
    dn = eqn.params["dimension_numbers"]
    kernel_in = rhs.shape[dn.rhs_spec[1]]  # rhs_spec: (out feature dim, in feature dim, spatial...)
    p = eqn.params
    n = len(dn.lhs_spec) - 2
    taps = 1
    for k in range(n):
        taps *= _valid_taps(lhs.shape[dn.lhs_spec[2 + k]], out.shape[dn.out_spec[2 + k]], rhs.shape[dn.rhs_spec[2 + k]],
                            p["window_strides"][k], p["padding"][k][0], (p.get("lhs_dilation") or (1,) * n)[k],
                            (p.get("rhs_dilation") or (1,) * n)[k])
    # (a batch-grouped convolution, the weight gradient of a grouped one, has the group count in its output's
    # features already: each output feature still reads kernel_in inputs per tap)
    per_position = _size(out) / max(1, math.prod(out.shape[d] for d in dn.out_spec[2:]))
    return 2.0 * per_position * kernel_in * taps


def _valid_taps(size: int, out: int, kernel: int, stride: int, pad_lo: int, lhs_dil: int, rhs_dil: int) -> int:
    """(output position, kernel tap) pairs of one spatial dimension that read an input element."""
    at = np.arange(out)[:, None] * stride + np.arange(kernel)[None, :] * rhs_dil - pad_lo
    return int(np.count_nonzero((at >= 0) & (at <= (size - 1) * lhs_dil) & (at % lhs_dil == 0)))


def _fft(eqn) -> OpCost:
    """A fast Fourier transform of ``n`` points (``n`` the product of ``fft_lengths``) costs 5 n log2 n flops complex
    and half that real (the Cooley-Tukey radix-2 count, FFTW's convention for its benchmarks' "mflops"), once per
    transform the operand holds. XLA's cost analysis counts 8 n times the product of the lengths' log2 instead."""
    lengths = eqn.params["fft_lengths"]
    n = math.prod(lengths)
    if n <= 1:
        return _arith(eqn, 0.0)
    transforms = max(_in_size(eqn), _out_size(eqn)) / n
    real = eqn.params["fft_type"] in (jax.lax.FftType.RFFT, jax.lax.FftType.IRFFT)
    return _arith(eqn, transforms * (2.5 if real else 5.0) * n * math.log2(n))


def _ragged_dot_flops(eqn) -> float:
    """``ragged_dot_general`` (grouped matmul, e.g. MoE): every lhs row meets one group's matrix, so 2 * m * k * n
    in all three modes. When the ragged lhs dimension is contracted the result has a group dimension, each group
    contracting only its own rows: divide by the group count."""
    dn = eqn.params["ragged_dot_dimension_numbers"]
    (lc, _), _ = dn.dot_dimension_numbers
    lhs = eqn.invars[0].aval
    contract = math.prod(lhs.shape[d] for d in lc)
    flops = 2.0 * _size(eqn.outvars[0].aval) * contract
    if any(d in lc for d in dn.lhs_ragged_dimensions):
        group_sizes = eqn.invars[2].aval
        flops /= max(1, group_sizes.shape[-1] if group_sizes.shape else 1)
    return flops


def jaxpr_cost(jaxpr: jex_core.Jaxpr) -> OpCost:
    """Sum of :func:`eqn_cost` over a jaxpr."""
    total = ZERO
    for eqn in jaxpr.eqns:
        total = total + eqn_cost(eqn)
    return total


def _sub(param) -> jex_core.Jaxpr:
    return param.jaxpr if isinstance(param, jex_core.ClosedJaxpr) else param


def forget_warnings() -> None:
    """Warn again about what the cost model cannot price (one warning per primitive per profile, not per process)."""
    _warned.clear()


def _warn_once(key: str, message: str, stacklevel: int) -> None:
    """Warn once per ``key`` (a primitive name) per process; ``stacklevel`` counted from the caller."""
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, stacklevel=stacklevel + 1)


# --- rules: each takes the equation, returns its OpCost -------------------------------------------------


def _sparse_dot_flops(eqn, dense_at: int) -> float:
    """A sparse-dense product (``bcoo_dot_general``: data, indices, dense; ``bcsr_dot_general``: data, indices,
    index pointers, dense): a multiply and an add for each stored entry and each column of the dense operand that
    is neither contracted nor batched."""
    (_, rc), (_, rb) = eqn.params["dimension_numbers"]
    dense = eqn.invars[dense_at - 1].aval.shape
    free = math.prod(n for d, n in enumerate(dense) if d not in rc and d not in rb)
    return 2.0 * eqn.invars[0].aval.size * free


def _zero_flop(eqn) -> OpCost:
    return _arith(eqn, 0.0)


def _tag(eqn) -> OpCost:
    """An identity that only labels a value (``checkpoint_name``): XLA emits nothing for it."""
    return OpCost(0.0, 0.0, 0, _out_bytes(eqn))


def _elementwise(eqn) -> OpCost:
    k = 1.0
    if eqn.primitive.name == "integer_pow":
        k = max(1.0, abs(eqn.params.get("y", 2)) - 1.0)
    return _arith(eqn, k * _out_size(eqn))


def _transcendental(eqn) -> OpCost:
    return _arith(eqn, 0.0, _out_size(eqn))


def _reduction(eqn) -> OpCost:
    n = _in_size(eqn)
    trans = _CUMLOGSUMEXP_TRANSCENDENTALS * n if eqn.primitive.name == "cumlogsumexp" else 0.0
    return _arith(eqn, n, trans)


def _windowed(eqn) -> OpCost:
    window = math.prod(eqn.params.get("window_dimensions", ()))
    name = eqn.primitive.name
    if name in ("select_and_scatter_add", "select_and_scatter"):
        # One select per window element of each source value, then the scatter's adds.
        source = _size(eqn.invars[0].aval)
        return _arith(eqn, source * (window + 1))
    per = 1.0
    if name == "reduce_window":  # a generic reducer: its jaxpr's equations per window element
        per = max(1.0, float(len(_sub(eqn.params["jaxpr"]).eqns)))
    return _arith(eqn, per * window * _out_size(eqn))


def _scatter_combine(eqn) -> OpCost:
    updates = eqn.invars[2].aval if len(eqn.invars) > 2 else eqn.outvars[0].aval
    return _arith(eqn, _size(updates))


def _reduce(eqn) -> OpCost:
    """The generic ``lax.reduce``: its reducer runs once per element of the (first) operand."""
    comp = eqn.params.get("jaxpr")
    per = max(1.0, float(len(_sub(comp).eqns))) if comp is not None else 1.0
    return _arith(eqn, per * _size(eqn.invars[0].aval))


def _sort(eqn) -> OpCost:
    """A comparison sort: about ``n log2 n`` comparisons along the sorted dimension, per sorted row."""
    aval = eqn.invars[0].aval
    dim = aval.shape[eqn.params.get("dimension", len(aval.shape) - 1)] if aval.shape else 1
    return _arith(eqn, _size(aval) * max(1, math.ceil(math.log2(max(dim, 2)))))


def _top_k(eqn) -> OpCost:
    k = eqn.params.get("k", 1)
    if eqn.primitive.name == "approx_top_k":
        return _arith(eqn, _in_size(eqn))
    return _arith(eqn, _size(eqn.invars[0].aval) * max(1, math.ceil(math.log2(max(k, 2)))))


def _random_gamma(eqn) -> OpCost:
    n = _out_size(eqn)
    return _arith(eqn, _GAMMA_FLOPS * n, _GAMMA_TRANSCENDENTALS * n)


def _dot(eqn) -> OpCost:
    return _arith(eqn, _dot_flops(eqn))


def _conv(eqn) -> OpCost:
    return _arith(eqn, _conv_flops(eqn))


def _ragged_dot(eqn) -> OpCost:
    return _arith(eqn, _ragged_dot_flops(eqn))


def _scan(eqn) -> OpCost:
    body = jaxpr_cost(_sub(eqn.params["jaxpr"]))
    n = eqn.params["length"]
    return OpCost(body.flops * n, body.transcendentals * n, body.bytes_accessed * n, _out_bytes(eqn))


def _cond(eqn) -> OpCost:
    branches = [jaxpr_cost(_sub(b)) for b in eqn.params["branches"]]
    worst = max(branches, key=lambda c: c.flops)
    return OpCost(worst.flops, worst.transcendentals, worst.bytes_accessed, _out_bytes(eqn))


def _while(eqn) -> OpCost:
    body = jaxpr_cost(_sub(eqn.params["body_jaxpr"])) + jaxpr_cost(_sub(eqn.params["cond_jaxpr"]))
    _warn_once("while", "autopp cost model: lax.while_loop trip counts are unknown; its body and condition "
                        "are counted once.", stacklevel=3)
    return OpCost(body.flops, body.transcendentals, body.bytes_accessed, _out_bytes(eqn))


def _call(eqn) -> OpCost:
    name = eqn.primitive.name
    if name.startswith("custom"):
        body = eqn.params.get("call_jaxpr", eqn.params.get("fun_jaxpr"))
        subs = [_sub(body)] if body is not None else list(jex_core.jaxprs_in_params(eqn.params))[:1]
    else:
        subs = list(jex_core.jaxprs_in_params(eqn.params))
    inner = ZERO
    for s in subs:
        inner = inner + jaxpr_cost(_sub(s))
    return OpCost(inner.flops, inner.transcendentals, inner.bytes_accessed, _out_bytes(eqn))


def _shard_map(eqn) -> OpCost:
    """The body runs once per device of the manual mesh axes, on per-device shapes."""
    mesh = eqn.params.get("mesh")
    axes = eqn.params.get("newly_manual_axes", eqn.params.get("manual_axes"))
    shape = dict(getattr(mesh, "shape", {}) or {})
    if axes is None:
        axes = shape.keys()
    devices = math.prod(shape.get(a, 1) for a in axes)
    inner = jaxpr_cost(_sub(eqn.params["jaxpr"])).scale(devices)
    return OpCost(inner.flops, inner.transcendentals, inner.bytes_accessed, _out_bytes(eqn))


def _pallas_call(eqn) -> OpCost:
    """A Pallas kernel: the user's ``cost_estimate`` where given; else its body's arithmetic once per grid point, and
    its operands and results moved through device memory once (the body's reads and writes of its blocks are
    on-chip)."""
    est = eqn.params.get("cost_estimate")
    if est is not None:
        return OpCost(float(est.flops), float(est.transcendentals), int(est.bytes_accessed), _out_bytes(eqn))
    grid = tuple(getattr(eqn.params.get("grid_mapping"), "grid", ()) or ())
    if not all(isinstance(g, int) for g in grid):
        _warn_once("pallas_call grid", "autopp cost model: a Pallas kernel's grid is not static; counting its body "
                                       "once.", stacklevel=3)
        grid = ()
    inner = jaxpr_cost(_sub(eqn.params["jaxpr"])).scale(math.prod(grid))
    return OpCost(inner.flops, inner.transcendentals, _io_bytes(eqn), _out_bytes(eqn))


def _matrices(aval) -> tuple[int, int, int]:
    """(how many matrices, rows, columns) of an operand whose last two dimensions are its matrices'."""
    *batch, m, n = aval.shape
    return math.prod(batch), m, n


def _lu(eqn) -> OpCost:
    """LU with partial pivoting of an m x n matrix (k = min(m, n)): 2 (mnk - (m + n) k^2 / 2 + k^3 / 3) FLOPs, 2n^3/3
    for a square one (Golub and Van Loan, Matrix Computations, 4th ed., section 3.2)."""
    b, m, n = _matrices(eqn.invars[0].aval)
    k = min(m, n)
    return _arith(eqn, b * 2.0 * (m * n * k - (m + n) * k * k / 2 + k ** 3 / 3))


def _triangular_solve(eqn) -> OpCost:
    """A triangular system of order m with k right-hand sides: m^2 k FLOPs (Golub and Van Loan, section 3.1)."""
    b, m, _ = _matrices(eqn.invars[0].aval)
    rhs = eqn.invars[1].aval.shape
    k = rhs[-1] if eqn.params.get("left_side") else rhs[-2]
    return _arith(eqn, b * float(m * m * k))


def _householder(m: int, n: int) -> float:
    """Householder QR's R of an m x n matrix: 2 k^2 (M - k / 3) FLOPs (k, M = the lesser and greater of m, n; Golub
    and Van Loan, section 5.2.2); forming the thin Q from its reflectors costs as much again (section 5.1.6)."""
    k, big = min(m, n), max(m, n)
    return 2.0 * k * k * (big - k / 3)


def _qr(eqn) -> OpCost:
    b, m, n = _matrices(eqn.invars[0].aval)
    full_q = 4.0 * (m * m * n - m * n * n + n ** 3 / 3) if eqn.params.get("full_matrices") and m > n else 0.0
    return _arith(eqn, b * (2 * _householder(m, n) + full_q))


def _svd(eqn) -> OpCost:
    """Golub-Reinsch SVD of an m x n matrix, m >= n (Golub and Van Loan, 4th ed., figure 8.6.1): singular values
    4mn^2 - 4n^3/3 FLOPs; with the thin U and V 14mn^2 + 8n^3; with the full U and V 4m^2 n + 8mn^2 + 9n^3."""
    b, m, n = _matrices(eqn.invars[0].aval)
    m, n = max(m, n), min(m, n)
    if not eqn.params.get("compute_uv", True):
        flops = 4.0 * m * n * n - 4.0 * n ** 3 / 3
    elif eqn.params.get("full_matrices", True):
        flops = 4.0 * m * m * n + 8.0 * m * n * n + 9.0 * n ** 3
    else:
        flops = 14.0 * m * n * n + 8.0 * n ** 3
    return _arith(eqn, b * flops)


def _eig(eqn, vectors: float, values: float) -> OpCost:
    b, n, _ = _matrices(eqn.invars[0].aval)
    wanted = eqn.primitive.name == "eigh" or any(eqn.params.get(k) for k in ("compute_left_eigenvectors",
                                                                               "compute_right_eigenvectors"))
    return _arith(eqn, b * (vectors if wanted else values) * n ** 3)


def _tridiagonal_solve(eqn) -> OpCost:
    """The Thomas algorithm: about 8 FLOPs per unknown and right-hand side."""
    rhs = eqn.invars[3].aval.shape
    return _arith(eqn, 8.0 * math.prod(rhs))


def _custom_linear_solve(eqn) -> OpCost:
    """``lax.custom_linear_solve`` (``jnp.linalg.solve``, ``jax.scipy.sparse.linalg.cg``): its forward runs the
    ``solve`` jaxpr; the others (matvec, the transposed solve) run only in the derivative, as equations of its own."""
    body = eqn.params["jaxprs"].solve
    inner = jaxpr_cost(_sub(body)) if body is not None else ZERO
    return OpCost(inner.flops, inner.transcendentals, inner.bytes_accessed, _out_bytes(eqn))


def _value_and_grad(eqn) -> OpCost:
    """``autopp.value_and_grad``'s marker: the loss forward (held in ``spec.forward``), forward + backward."""
    inner = jaxpr_cost(eqn.params["spec"].forward.jaxpr).scale(_VALUE_AND_GRAD_FACTOR)
    return OpCost(inner.flops, inner.transcendentals, inner.bytes_accessed, _out_bytes(eqn))


_RULES: dict[str, Callable[[jex_core.JaxprEqn], OpCost]] = {}
for _names, _rule in ((ZERO_FLOP, _zero_flop), (ELEMENTWISE, _elementwise), (TRANSCENDENTAL, _transcendental),
                      (REDUCTIONS, _reduction), (WINDOWED, _windowed), (SCATTER_COMBINE, _scatter_combine),
                      (CALLS, _call)):
    for _n in _names:
        _RULES.setdefault(_n, _rule)
_RULES.update({
    "dot_general": _dot, "conv_general_dilated": _conv, "ragged_dot_general": _ragged_dot,
    "scan": _scan, "cond": _cond, "while": _while, "shard_map": _shard_map,
    "autopp_value_and_grad": _value_and_grad, "reduce": _reduce, "sort": _sort, "top_k": _top_k,
    "approx_top_k": _top_k, "random_gamma": _random_gamma, "name": _tag, "fft": _fft,
    # host callbacks (jax.debug.print, pure_callback, io_callback): no device arithmetic, their operands cross
    "debug_callback": _zero_flop, "debug_print": _zero_flop, "pure_callback": _zero_flop, "io_callback": _zero_flop,
    # a Pallas kernel, and the loads and stores of references (a kernel's blocks, mutable arrays): no arithmetic
    "pallas_call": _pallas_call, "get": _zero_flop, "swap": _zero_flop,
    "addupdate": lambda e: _arith(e, math.prod(e.invars[1].aval.shape)),  # (ref += value: one add per element)
    # dense linear algebra, by the textbook counts (the LAPACK or cuSOLVER call XLA's cost analysis counts as 0)
    "lu": _lu, "cholesky": lambda e: _arith(e, _matrices(e.invars[0].aval)[0] * _matrices(e.invars[0].aval)[1] ** 3
                                            / 3.0),
    "triangular_solve": _triangular_solve, "qr": _qr, "svd": _svd, "tridiagonal_solve": _tridiagonal_solve,
    # a symmetric eigensolver with vectors about 9n^3 (4n^3/3 for the values); a general one 25n^3 (10n^3)
    # (Golub and Van Loan, sections 8.3 and 7.5.6)
    "eigh": lambda e: _eig(e, 9.0, 4.0 / 3.0), "eig": lambda e: _eig(e, 25.0, 10.0),
    "lu_pivots_to_permutation": _zero_flop, "custom_linear_solve": _custom_linear_solve,
    # which platform's branch of a cond JAX's own functions take (jnp.diagonal, slogdet's LU): a scalar, no arithmetic
    "platform_index": _zero_flop,
    # jax.experimental.sparse: a product reads each stored entry once per output column; layout changes move data
    "bcoo_dot_general": lambda e: _arith(e, _sparse_dot_flops(e, 3)),
    "bcsr_dot_general": lambda e: _arith(e, _sparse_dot_flops(e, 4)),
    "bcoo_dot_general_sampled": lambda e: _arith(e, 2.0 * _out_size(e) * math.prod(
        e.invars[0].aval.shape[d] for d in e.params["dimension_numbers"][0][0])),
    "bcoo_reduce_sum": lambda e: _arith(e, e.invars[0].aval.size), "bcoo_multiply_dense": lambda e: _arith(
        e, e.invars[0].aval.size),
    **{name: _zero_flop for name in ("bcoo_transpose", "bcoo_todense", "bcoo_fromdense", "bcoo_sort_indices",
                                     "bcoo_sum_duplicates", "bcoo_extract", "bcoo_broadcast_in_dim", "bcoo_reshape",
                                     "bcoo_concatenate", "bcoo_squeeze", "bcoo_slice", "bcoo_dynamic_slice",
                                     "bcoo_gather", "bcoo_rev", "bcsr_todense", "bcsr_fromdense", "bcsr_extract")},
})
del _names, _rule, _n

COSTED_PRIMITIVES = frozenset(_RULES)
"""Names of the primitives :func:`eqn_cost` has an explicit rule for; any other is priced generically (one FLOP
per output element, or the jaxprs it holds) with one warning per name."""


def has_cost_rule(name: str) -> bool:
    """Whether :func:`eqn_cost` prices primitive ``name`` by an explicit rule (no generic fallback, no warning)."""
    return name in COSTED_PRIMITIVES


def eqn_cost(eqn: jex_core.JaxprEqn) -> OpCost:
    """Analytic cost of one equation, recursing into nested jaxprs (scan counted ``length`` times)."""
    name = eqn.primitive.name
    rule = _RULES.get(name)
    if rule is not None:
        return rule(eqn)
    subs = list(jex_core.jaxprs_in_params(eqn.params))
    if subs:  # an unknown call-like primitive: price what it runs
        _warn_once(name, f"autopp cost model: no rule for primitive {name!r}; counting the cost of the "
                         f"{len(subs)} jaxpr(s) it holds.", stacklevel=2)
        return _call(eqn)
    _warn_once(name, f"autopp cost model: no rule for primitive {name!r}; counting one FLOP per output element.",
               stacklevel=2)
    return _arith(eqn, _out_size(eqn))


MATMUL_PRIMITIVES = frozenset({"dot_general", "conv_general_dilated"})
TAKES_PART = frozenset({"slice", "dynamic_slice"})
"""Primitives that read only the part of their first operand they return: fused into a kernel, they read that part
(a scan iteration's row of the stacked parameters, not the whole stack)."""


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
    one kernel whose memory traffic is only what crosses its boundary (values read from outside the run, only
    the parts of them slices take where slices are all that read them; values used after it). A control-flow
    equation (scan, while, cond) is the kernels its body runs (:func:`loop_kernels`). Plain calls (``jit``) are
    looked through.
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
        inside, read, parts = set(), set(), {}
        flops = trans = 0.0
        traffic = out_bytes = 0
        for i in run:
            e = eqns[i]
            c = eqn_cost(e)
            flops += c.flops
            trans += c.transcendentals
            for pos, a in enumerate(e.invars):
                if isinstance(a, jex_core.Literal) or a in inside:
                    continue
                if pos == 0 and e.primitive.name in TAKES_PART:
                    parts[a] = parts.get(a, 0) + aval_bytes(e.outvars[0].aval)
                elif a not in read:
                    read.add(a)
                    traffic += aval_bytes(a.aval)
            inside.update(e.outvars)
        traffic += sum(min(b, aval_bytes(a.aval)) for a, b in parts.items() if a not in read)
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
            kernels.extend(loop_kernels(e))
        else:
            run.append(i)
    close_run()
    return kernels


def loop_kernels(eqn) -> list[tuple[str, OpCost]]:
    """The kernels of one control-flow equation, as :func:`kernel_costs` gives them: a ``scan``'s body's, each with
    the cost of all its iterations (one launch each, as XLA:CPU, where layers are measured, runs a loop's body), a
    ``while_loop``'s body and condition once (its trip count is unknown, as in :func:`eqn_cost`), the ``cond``
    branch with the most FLOPs."""
    name = eqn.primitive.name
    if name == "scan":
        n = int(eqn.params["length"])
        return [(kind, cost.scale(n)) for kind, cost in kernel_costs(_sub(eqn.params["jaxpr"]))]
    if name == "while":
        return kernel_costs(_sub(eqn.params["body_jaxpr"])) + kernel_costs(_sub(eqn.params["cond_jaxpr"]))
    branches = [kernel_costs(_sub(b)) for b in eqn.params["branches"]]
    return max(branches, key=lambda ks: sum(c.flops for _, c in ks))

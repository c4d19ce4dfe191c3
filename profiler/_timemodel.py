"""Analytic time model: roofline op times and alpha-beta collective times on a :class:`Cluster`."""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any

from autopp.profiler._cluster import Cluster
from autopp.profiler._costs import OpCost
from autopp.profiler._devices import DeviceSpec, get_device

TRANSCENDENTAL_FP32_FLOPS = 16.0
"""FP32 FLOPs one transcendental (exp, log, tanh, ...) is charged: the special-function units issue 16 results
per SM per clock (CUDA C++ Programming Guide, arithmetic instruction throughput) against 128 FP32 lanes doing
2 FLOPs each on Hopper, so one transcendental takes the issue time of 16 FP32 FLOPs (8 on A100: conservative)."""

COLLECTIVE_KINDS = ("all-reduce", "all-gather", "reduce-scatter", "send-recv")
"""Collectives :func:`collective_time` models."""


def _spec(device: Any, who: str) -> DeviceSpec:
    if isinstance(device, DeviceSpec):
        return device
    if isinstance(device, str):
        return get_device(device)
    raise TypeError(f"{who}: device must be a DeviceSpec or a kind name, got {device!r} ({type(device).__name__}); "
                    "pass e.g. get_device('H100').")


def _nonneg(who: str, name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{who}: {name} must be a finite number >= 0, got {value!r}.")
    return float(value)


def op_time(cost: OpCost, device: DeviceSpec | str, dtype: Any = "bfloat16") -> float:
    """Seconds one operation takes on ``device``: a roofline plus the launch floor.

    ``max(compute, memory) + kernel_launch_floor`` with
    ``compute = flops / (peak(dtype) * matmul_efficiency)
    + transcendentals * TRANSCENDENTAL_FP32_FLOPS / (peak_fp32 * matmul_efficiency)`` and
    ``memory = bytes_accessed / (hbm_bandwidth * memory_efficiency)``. ``dtype`` picks the peak (see
    :meth:`DeviceSpec.peak_flops`). Every call pays one launch floor, so time a fused group of equations by
    summing their costs first rather than summing per-equation times.
    """
    if not isinstance(cost, OpCost):
        raise TypeError(f"op_time: cost must be an OpCost (see autopp.profiler.eqn_cost), got {type(cost).__name__}.")
    spec = _spec(device, "op_time")
    flops = _nonneg("op_time", "cost.flops", cost.flops)
    trans = _nonneg("op_time", "cost.transcendentals", cost.transcendentals)
    nbytes = _nonneg("op_time", "cost.bytes_accessed", cost.bytes_accessed)
    compute = (flops / spec.peak_flops(dtype)
               + trans * TRANSCENDENTAL_FP32_FLOPS / spec.peak_flops_fp32) / spec.matmul_efficiency
    memory = nbytes / (spec.hbm_bandwidth * spec.memory_efficiency)
    return max(compute, memory) + spec.kernel_launch_floor


def collective_time(kind: str, bytes: float, group_size: int, cluster: Cluster, *,  # noqa: A002
                    spans_nodes: bool) -> float:
    """Seconds for one collective over ``group_size`` devices in the alpha-beta (ring) model.

    ``bytes`` is the full buffer on each device: the array reduced (all-reduce), the gathered result
    (all-gather), the input before scattering (reduce-scatter), or the message (send-recv). With ``n``
    devices, bandwidth ``bw`` and latency ``alpha``:

    - all-reduce: ``2 (n-1)/n * bytes / bw + 2 (n-1) alpha``
    - all-gather, reduce-scatter: ``(n-1)/n * bytes / bw + (n-1) alpha``
    - send-recv: ``bytes / bw + alpha``

    ``bw``/``alpha`` are the device's intra-node figures when the group stays inside one node
    (``spans_nodes=False``) and its inter-node figures otherwise (the slowest link of a ring sets its pace).
    A group of one device, or zero bytes, takes 0 s. The bandwidths are datasheet peaks: scale them with
    ``cluster.with_device_overrides(...)`` to calibrate against measured bus bandwidth.
    """
    who = "collective_time"
    if not isinstance(kind, str):
        raise TypeError(f"{who}: kind must be a string, one of {', '.join(COLLECTIVE_KINDS)}; got {kind!r}.")
    squashed = kind.strip().lower().replace("_", "").replace("-", "")
    canon = {k.replace("-", ""): k for k in COLLECTIVE_KINDS}.get(squashed)
    if canon is None:
        raise ValueError(f"{who}: unknown collective {kind!r}; valid kinds are {', '.join(COLLECTIVE_KINDS)}.")
    if not isinstance(cluster, Cluster):
        raise TypeError(f"{who}: cluster must be a Cluster, got {type(cluster).__name__}; pass e.g. "
                        "Cluster.parse('2x8xH100').")
    nbytes = _nonneg(who, "bytes", bytes)
    if isinstance(group_size, bool) or not isinstance(group_size, numbers.Integral) or group_size < 1:
        raise ValueError(f"{who}: group_size must be a positive int, got {group_size!r}; pass e.g. group_size=8.")
    n = int(group_size)
    if n > cluster.num_devices:
        raise ValueError(f"{who}: group_size={n} exceeds the {cluster.num_devices} devices of the cluster ({cluster}).")
    if not isinstance(spans_nodes, bool):
        raise TypeError(f"{who}: spans_nodes must be True or False, got {spans_nodes!r}.")
    if not spans_nodes and n > cluster.devices_per_node:
        raise ValueError(
            f"{who}: a group of {n} devices cannot stay inside one node of {cluster.devices_per_node} devices "
            f"({cluster}); pass spans_nodes=True or group_size <= {cluster.devices_per_node}."
        )
    if spans_nodes and cluster.num_nodes == 1:
        raise ValueError(f"{who}: spans_nodes=True but the cluster has one node ({cluster}); pass spans_nodes=False.")
    return ring_seconds(canon, nbytes, n, cluster, spans_nodes)


def ring_seconds(kind: str, nbytes: float, n: int, cluster: Cluster, spans_nodes: bool) -> float:
    """:func:`collective_time` without argument checks, for the planner's inner loops (``kind`` canonical)."""
    if n == 1 or nbytes == 0:
        return 0.0
    dev = cluster.device
    bw, alpha = ((dev.inter_node_bandwidth * dev.inter_node_efficiency, dev.inter_node_latency) if spans_nodes
                 else (dev.intra_node_bandwidth * dev.intra_node_efficiency, dev.intra_node_latency))
    if kind == "all-reduce":
        return 2 * (n - 1) / n * nbytes / bw + 2 * (n - 1) * alpha
    if kind in ("all-gather", "reduce-scatter"):
        return (n - 1) / n * nbytes / bw + (n - 1) * alpha
    return nbytes / bw + alpha


@dataclasses.dataclass(frozen=True, kw_only=True)
class KernelTimeModel:
    """Time of a computation as the sum of its kernels (see :func:`autopp.profiler.kernel_costs`).

    A matmul of ``F`` FLOPs takes ``max(F / flops_per_s, bytes / bytes_per_s) + matmul_floor_s * F / (F +
    matmul_floor_flops)`` (the fixed cost of a large matmul, e.g. waking a thread pool, which small ones do
    not pay); a fused run of other operations ``max(flops / flops_per_s, bytes / bytes_per_s) +
    transcendentals / transcendentals_per_s + fused_floor_s``. Six constants per device and dtype: from the
    device table by default, or fitted to measurements with :meth:`calibrate`.
    """

    device: str
    """Device kind these constants describe."""
    flops_per_s: float
    """Achievable FLOP/s of matmuls (and of the arithmetic in fused kernels)."""
    bytes_per_s: float
    """Achievable memory bytes/s."""
    transcendentals_per_s: float
    """Achievable transcendental evaluations per second (exp, tanh, ...)."""
    matmul_floor_s: float
    """Fixed cost of one matmul kernel."""
    fused_floor_s: float
    """Fixed cost of one fused elementwise/reduction kernel."""
    matmul_floor_flops: float = 0.0
    """Matmul size (FLOPs) at which half of ``matmul_floor_s`` is paid; 0: every matmul pays all of it."""
    calibrated: bool = False
    """Whether the constants were fitted to measurements."""
    half_flops_per_s: float | None = None
    """Achievable FLOP/s of bfloat16/float16 matmuls on tensor cores (None: ``flops_per_s``)."""
    tf32_flops_per_s: float | None = None
    """Achievable FLOP/s of float32 matmuls that may use TF32 tensor cores (None: ``flops_per_s``)."""
    fp32_flops_per_s: float | None = None
    """Achievable FLOP/s of float32 matmuls at full precision and of the arithmetic of fused elementwise kernels
    (CUDA cores; None: ``flops_per_s``)."""
    attention_flops_per_s: float | None = None
    """Achievable FLOP/s of a fused (flash) attention kernel in bf16/fp16 (None: ``flops_per_s``)."""
    fp8_flops_per_s: float | None = None
    """Achievable FLOP/s of matmuls of float8 operands (None: ``half_flops_per_s``, as XLA converts them)."""
    int8_ops_per_s: float | None = None
    """Achievable operations/s of matmuls of int8 operands on integer tensor cores (None: ``fp32_flops_per_s``)."""
    loop_launches: bool = True
    """Whether a loop's body's kernels pay their fixed cost on every iteration (:attr:`DeviceSpec.loop_launches`)."""

    def __post_init__(self):
        for f in ("flops_per_s", "bytes_per_s", "transcendentals_per_s", "matmul_floor_s", "fused_floor_s",
                  "matmul_floor_flops", "half_flops_per_s", "tf32_flops_per_s", "fp32_flops_per_s",
                  "attention_flops_per_s", "fp8_flops_per_s", "int8_ops_per_s"):
            v = getattr(self, f)
            if v is None and f in ("half_flops_per_s", "tf32_flops_per_s", "fp32_flops_per_s",
                                   "attention_flops_per_s", "fp8_flops_per_s", "int8_ops_per_s"):
                continue
            if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v) or v < 0 or (
                    v == 0 and f.endswith("per_s")):
                raise ValueError(f"KernelTimeModel.{f} must be a positive finite number, got {v!r}.")

    @classmethod
    def from_device(cls, device: DeviceSpec | str, dtype: Any = "bfloat16") -> KernelTimeModel:
        """Rates from the device table: each matmul at the peak of its operand dtype (``dtype`` sets the rate of
        kernels that name none) times ``matmul_efficiency``, fused attention at ``attention_efficiency``, memory
        at ``memory_efficiency`` of the HBM bandwidth."""
        spec = _spec(device, "KernelTimeModel.from_device")
        eff = spec.matmul_efficiency
        return cls(device=spec.name, flops_per_s=spec.peak_flops(dtype) * eff,
                   bytes_per_s=spec.hbm_bandwidth * spec.memory_efficiency,
                   transcendentals_per_s=spec.peak_flops_fp32 * eff / TRANSCENDENTAL_FP32_FLOPS,
                   matmul_floor_s=spec.kernel_launch_floor, fused_floor_s=spec.kernel_launch_floor,
                   half_flops_per_s=spec.peak_flops("bfloat16") * eff,
                   tf32_flops_per_s=spec.peak_flops("tf32") * eff, fp32_flops_per_s=spec.peak_flops_fp32 * eff,
                   attention_flops_per_s=spec.peak_flops("bfloat16") * spec.attention_efficiency,
                   fp8_flops_per_s=spec.peak_flops("float8") * eff,
                   int8_ops_per_s=(spec.peak_ops_int8 or spec.peak_flops_fp32) * eff,
                   loop_launches=spec.loop_launches)

    def matmul_rate(self, dtype: str | None) -> float:
        """FLOP/s of a matmul whose operands are ``dtype`` (``tf32``: float32 allowed to use TF32)."""
        if dtype in ("bfloat16", "float16"):
            return self.half_flops_per_s or self.flops_per_s
        if dtype in ("tf32",):
            return self.tf32_flops_per_s or self.flops_per_s
        if dtype == "float8":
            return self.fp8_flops_per_s or self.half_flops_per_s or self.flops_per_s
        if dtype == "int8":
            return self.int8_ops_per_s or self.fp32_flops_per_s or self.flops_per_s
        if dtype in ("float32", "float64", "int32"):
            return self.fp32_flops_per_s or self.flops_per_s
        return self.flops_per_s

    def kernel_time(self, kind: str, cost: OpCost, dtype: str | None = None, *, work: float = 1.0,
                    floor: bool = True, launches: int = 1, iterations: int = 1) -> float:
        """Seconds of one kernel: ``matmul`` at :meth:`matmul_rate`, ``attention`` (a fused flash kernel executing
        ``work`` FLOPs per counted FLOP) at ``attention_flops_per_s`` for 16-bit operands, anything else at
        the fused rate (memory-bound). ``floor=False`` leaves out the per-kernel fixed cost; ``launches``: the
        kernels ``cost`` is the sum of, each paying it, ``iterations`` times where loops launch per iteration."""
        launches = launches * (iterations if self.loop_launches else 1)
        if kind == "attention":
            rate = (self.attention_flops_per_s or self.matmul_rate(dtype)) if dtype in ("bfloat16", "float16", None) \
                else self.matmul_rate(dtype)
            body = max(cost.flops * work / rate, cost.bytes_accessed / self.bytes_per_s)
            return body + (self.matmul_floor_s if floor else 0.0)
        if kind == "matmul":
            body = max(cost.flops / self.matmul_rate(dtype), cost.bytes_accessed / self.bytes_per_s)
            if not floor:
                return body
            each = cost.flops / launches
            scale = each / (each + self.matmul_floor_flops) if self.matmul_floor_flops else 1.0
            return body + self.matmul_floor_s * scale * launches
        body = max(cost.flops / (self.fp32_flops_per_s or self.flops_per_s), cost.bytes_accessed / self.bytes_per_s)
        return body + cost.transcendentals / self.transcendentals_per_s + (self.fused_floor_s * launches if floor
                                                                           else 0.0)

    def time(self, kernels) -> float:
        """Seconds for a list of ``(kind, OpCost)`` kernels."""
        return sum(self.kernel_time(kind, cost) for kind, cost in kernels)

    def scaled_time(self, kernels, scale: float = 1.0) -> float:
        """Seconds per microbatch for a list of :class:`~autopp.profiler._kernels.ScaledKernel` at ``scale`` times
        the traced batch (kernels that run once per step left out: see :meth:`per_step_time`)."""
        return sum(self.kernel_time(k.kind, k.at(scale), k.dtype, work=k.work, launches=k.launches,
                                    iterations=k.iterations) for k in kernels if not k.per_step)

    def per_step_time(self, kernels) -> float:
        """Seconds of the kernels that run once per step (parameter-only work, e.g. casting master weights)."""
        return sum(self.kernel_time(k.kind, k.at(1.0), k.dtype, work=k.work, launches=k.launches,
                                    iterations=k.iterations) for k in kernels if k.per_step)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def calibrate(cls, device: str, samples, *, starts: int = 8) -> KernelTimeModel:
        """Fit the six constants to ``samples``: pairs of (kernels, measured seconds).

        Minimises the mean absolute log error (Nelder-Mead in log space from several starts).
        """
        import numpy as np
        from scipy.optimize import minimize

        samples = [(list(k), float(t)) for k, t in samples if t > 0]
        if len(samples) < 6:
            raise ValueError(f"KernelTimeModel.calibrate needs at least 6 measured samples, got {len(samples)}.")
        # Every sample's kernels in two flat arrays (matmuls; everything else) with the sample each belongs to:
        # one objective evaluation is a few vector operations, not a Python loop over samples (Nelder-Mead
        # evaluates it ~10^4 times).
        mm = np.array([(c.flops, c.bytes_accessed, i) for i, (kernels, _) in enumerate(samples)
                       for k, c in kernels if k == "matmul"], dtype=np.float64).reshape(-1, 3)
        fu = np.array([(c.flops, c.bytes_accessed, c.transcendentals, i) for i, (kernels, _) in enumerate(samples)
                       for k, c in kernels if k != "matmul"], dtype=np.float64).reshape(-1, 4)
        mm_of, fu_of = mm[:, 2].astype(np.intp), fu[:, 3].astype(np.intp)
        log_measured = np.log([t for _, t in samples])
        num_samples = len(samples)

        def predict(logp):
            P, W, T, fm, fe, f0 = np.exp(np.clip(logp, lo, hi))
            per_mm = np.maximum(mm[:, 0] / P, mm[:, 1] / W) + fm * mm[:, 0] / (mm[:, 0] + f0)
            per_fu = np.maximum(fu[:, 0] / P, fu[:, 1] / W) + fu[:, 2] / T + fe
            return (np.bincount(mm_of, per_mm, minlength=num_samples)
                    + np.bincount(fu_of, per_fu, minlength=num_samples))

        def objective(logp):
            return float(np.mean(np.abs(np.log(predict(logp)) - log_measured)))

        # Physically sensible ranges (rates per second, floors in seconds, FLOPs); a constant the samples do
        # not constrain (e.g. no memory-bound kernel) settles at a bound instead of running off to infinity.
        lo = np.log([1e6, 1e6, 1e4, 1e-12, 1e-12, 1.0])
        hi = np.log([1e18, 1e16, 1e16, 1.0, 1.0, 1e15])
        rng = np.random.default_rng(0)
        x0 = np.log([1e11, 1e10, 1e9, 1e-5, 1e-6, 1e7])
        best = None
        for s in range(starts):
            start = x0 + (rng.normal(0.0, 1.5, 6) if s else 0.0)
            r = minimize(objective, start, method="Nelder-Mead", options={"maxiter": 3000, "xatol": 1e-4, "fatol": 1e-7})
            if best is None or r.fun < best.fun:
                best = r
        for _ in range(3):  # Nelder-Mead restarted from its own optimum escapes a collapsed simplex
            r = minimize(objective, best.x, method="Nelder-Mead", options={"maxiter": 3000, "xatol": 1e-6, "fatol": 1e-9})
            if r.fun < best.fun:
                best = r
        P, W, T, fm, fe, f0 = (float(x) for x in np.exp(np.clip(best.x, lo, hi)))
        try:
            loops = get_device(device).loop_launches
        except (ValueError, TypeError):  # (a device the table does not know: as GPUs do)
            loops = True
        return cls(device=device, flops_per_s=P, bytes_per_s=W, transcendentals_per_s=T, matmul_floor_s=fm,
                   fused_floor_s=fe, matmul_floor_flops=f0, calibrated=True, loop_launches=loops)

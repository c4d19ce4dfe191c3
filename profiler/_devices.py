"""Accelerator specs for the planner's time model: peak FLOP/s, memory, interconnect, efficiencies.

Every datasheet number in :data:`DEVICE_KINDS` carries its public source in a comment. All rates are
per device, dense (no 2:4 sparsity), in SI units: FLOP/s, bytes/s, bytes, seconds.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
from collections.abc import Mapping
from typing import Any

import numpy as np

# Units and an example value for each numeric field, used in error messages.
_NUMERIC_FIELDS: dict[str, tuple[str, str]] = {
    "peak_flops_bf16": ("FLOP/s", "989e12"),
    "peak_flops_tf32": ("FLOP/s", "494.5e12"),
    "peak_flops_fp32": ("FLOP/s", "67e12"),
    "hbm_bandwidth": ("bytes/s", "3.35e12"),
    "memory_capacity": ("bytes", "80e9"),
    "intra_node_bandwidth": ("bytes/s", "450e9"),
    "inter_node_bandwidth": ("bytes/s", "50e9"),
    "intra_node_latency": ("seconds", "2e-6"),
    "inter_node_latency": ("seconds", "8e-6"),
    "kernel_launch_floor": ("seconds", "2e-6"),
}
_EFFICIENCY_FIELDS = ("matmul_efficiency", "memory_efficiency", "attention_efficiency", "intra_node_efficiency",
                      "inter_node_efficiency")

# dtype name -> which peak applies. float16 runs at the bf16 tensor-core rate on every GPU in the table.
# Integer and boolean element-wise work runs on the CUDA cores at about the fp32 rate.
_DTYPE_PEAK = {
    "bfloat16": "peak_flops_bf16",
    "float16": "peak_flops_bf16",
    "tf32": "peak_flops_tf32",
    "float32": "peak_flops_fp32",
    "float64": "peak_flops_fp64",
    **{t: "peak_flops_fp32" for t in ("bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32",
                                      "uint64")},
    # matmuls of float8 operands (FP8 tensor cores where the device has them)
    **{t: "peak_flops_fp8" for t in ("float8", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
                                     "float8_e5m2fnuz", "float8_e4m3b11fnuz", "float8_e4m3", "float8_e3m4")},
}


def _dtype_name(dtype: Any) -> str:
    if isinstance(dtype, str):
        name = dtype.strip().lower()
        return {"bf16": "bfloat16", "fp16": "float16", "f16": "float16", "fp32": "float32", "f32": "float32",
                "tensorfloat32": "tf32"}.get(name, name)
    try:
        return np.dtype(dtype).name
    except TypeError as e:
        raise TypeError(
            f"dtype must be a dtype or a name like 'bfloat16', got {dtype!r} ({type(dtype).__name__}); "
            f"use one of {', '.join(sorted(_DTYPE_PEAK))}."
        ) from e


@dataclasses.dataclass(frozen=True, kw_only=True)
class DeviceSpec:
    """One accelerator's peak rates, memory, interconnect and achievable-efficiency factors."""

    name: str
    """Device kind, e.g. ``"H100"`` (a key of :data:`DEVICE_KINDS` for table devices)."""
    peak_flops_bf16: float
    """Dense bf16/fp16 tensor-core peak, FLOP/s (a multiply-add counts 2)."""
    peak_flops_tf32: float
    """Dense TF32 tensor-core peak (float32 matmuls with TF32 allowed), FLOP/s."""
    peak_flops_fp32: float
    """Non-tensor-core FP32 peak (CUDA cores), FLOP/s."""
    hbm_bandwidth: float
    """Device-memory (HBM) bandwidth, bytes/s."""
    memory_capacity: int
    """Device-memory capacity, bytes (decimal GB as the datasheet states, so slightly under the GiB reality)."""
    intra_node_bandwidth: float
    """Bandwidth one device can send to its node peers (NVLink), bytes/s, one direction."""
    inter_node_bandwidth: float
    """Bandwidth one device can send to other nodes (its InfiniBand NIC), bytes/s, one direction."""
    intra_node_latency: float
    """Per-message (per ring step) latency inside a node, alpha in the alpha-beta model, seconds."""
    inter_node_latency: float
    """Per-message (per ring step) latency between nodes, seconds."""
    kernel_launch_floor: float
    """Least time any operation takes (launch and tail of one kernel), seconds."""
    matmul_efficiency: float = 0.75
    """Fraction of peak FLOP/s that large operations achieve, in (0, 1]."""
    memory_efficiency: float = 0.85
    """Fraction of peak HBM bandwidth that bandwidth-bound operations achieve, in (0, 1]."""
    attention_efficiency: float = 0.5
    """Fraction of the bf16 peak that a fused (flash) attention kernel achieves on the FLOPs it executes, in
    (0, 1]."""
    intra_node_efficiency: float = 1.0
    """Fraction of ``intra_node_bandwidth`` NCCL's ring collectives achieve (their bus bandwidth), in (0, 1]."""
    inter_node_efficiency: float = 1.0
    """Fraction of ``inter_node_bandwidth`` NCCL's collectives across nodes achieve, in (0, 1]."""
    source: str = ""
    """Where the numbers come from (datasheets, measurements, overrides)."""
    peak_flops_fp64: float | None = None
    """FP64 peak of matrix work (FP64 tensor cores where the device has them, as cuBLAS's DGEMM uses), FLOP/s; None
    where it is not known (float64 work is then refused)."""
    peak_flops_fp8: float | None = None
    """FP8 tensor-core peak, dense, FLOP/s (matmuls whose operands are float8: e4m3, e5m2); None where the device has
    no FP8 tensor cores: XLA then converts the operands to a 16-bit type and the matmul runs at the bf16 peak."""
    peak_ops_int8: float | None = None
    """INT8 tensor-core peak, dense, operations/s (matmuls of int8 operands); None: they run at the fp32 rate."""
    fused_attention: bool = True
    """Whether ``jax.nn.dot_product_attention`` runs as one fused (flash) kernel, with no ``s x s`` scores in memory
    (cuDNN's on GPUs); where not, its equations are priced, and its scores kept, as written."""
    loop_launches: bool = True
    """Whether a loop launches its body's kernels again on every iteration, each paying ``kernel_launch_floor`` (XLA's
    GPU while loop runs its body's kernels per iteration [LAUNCH]); where not, each of the body's kernels pays it once
    per loop."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.strip():
            raise TypeError(f"DeviceSpec.name must be a non-empty string, got {self.name!r}; pass e.g. name='H100'.")
        if not isinstance(self.source, str):
            raise TypeError(f"DeviceSpec.source must be a string, got {self.source!r} ({type(self.source).__name__}).")
        for field, (unit, example) in _NUMERIC_FIELDS.items():
            value = self._number(field, f"a positive number of {unit}", f"{field}={example}")
            if not value > 0:
                raise ValueError(
                    f"DeviceSpec({self.name!r}).{field} must be a positive number of {unit}, got {value!r}; "
                    f"pass e.g. {field}={example}."
                )
            if field == "memory_capacity":
                if value != int(value):
                    raise ValueError(
                        f"DeviceSpec({self.name!r}).memory_capacity must be a whole number of bytes, got {value!r}; "
                        "pass e.g. memory_capacity=80e9 or 80 * 2**30."
                    )
                value = int(value)
            else:
                value = float(value)
            object.__setattr__(self, field, value)
        for flag in ("fused_attention", "loop_launches"):
            if not isinstance(getattr(self, flag), bool):
                raise TypeError(f"DeviceSpec({self.name!r}).{flag} must be True or False, got "
                                f"{getattr(self, flag)!r}.")
        for field, example in (("peak_flops_fp64", "67e12"), ("peak_flops_fp8", "1979e12"),
                               ("peak_ops_int8", "1979e12")):
            if getattr(self, field) is None:
                continue
            value = self._number(field, "a positive number per second or None", f"{field}={example}")
            if not value > 0:
                raise ValueError(f"DeviceSpec({self.name!r}).{field} must be a positive number per second or "
                                 f"None, got {value!r}; pass e.g. {field}={example}.")
            object.__setattr__(self, field, float(value))
        for field in _EFFICIENCY_FIELDS:
            value = self._number(field, "a fraction in (0, 1]", f"{field}=0.8")
            if not 0 < value <= 1:
                raise ValueError(
                    f"DeviceSpec({self.name!r}).{field} must be a fraction of peak in (0, 1], got {value!r}; "
                    f"pass e.g. {field}=0.8."
                )
            object.__setattr__(self, field, float(value))

    def _number(self, field: str, what: str, example: str) -> float:
        value = getattr(self, field)
        if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
            raise TypeError(
                f"DeviceSpec({self.name!r}).{field} must be {what}, got {value!r} ({type(value).__name__}); "
                f"pass e.g. {example}."
            )
        if not math.isfinite(value):
            raise ValueError(f"DeviceSpec({self.name!r}).{field} must be finite, got {value!r}; pass e.g. {example}.")
        return value

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    def peak_flops(self, dtype: Any = "bfloat16") -> float:
        """Peak FLOP/s for ``dtype``: bfloat16/float16 -> tensor cores, ``"tf32"`` -> TF32 tensor cores,
        float32 -> CUDA cores (pass ``"tf32"`` when float32 matmuls may use TF32), integers/bool -> fp32 rate,
        float8 (``"float8"`` or a float8 dtype) -> FP8 tensor cores, or the bf16 peak on a device without them (XLA
        converts the operands). The matmul rate of int8 operands is :attr:`peak_ops_int8`."""
        name = _dtype_name(dtype)
        field = _DTYPE_PEAK.get(name)
        if field == "peak_flops_fp8" and self.peak_flops_fp8 is None:
            field = "peak_flops_bf16"
        if field is None or getattr(self, field) is None:
            raise ValueError(
                f"DeviceSpec({self.name!r}) has no peak rate for dtype {name!r}; use one of "
                f"{', '.join(sorted(k for k, f in _DTYPE_PEAK.items() if getattr(self, f) is not None))}, or give "
                f"the device one: get_device({self.name!r}).with_overrides({field or 'peak_flops_fp64'}=...)."
            )
        return getattr(self, field)

    def with_overrides(self, **fields: Any) -> DeviceSpec:
        """A validated copy with ``fields`` replaced, e.g. ``spec.with_overrides(matmul_efficiency=0.6)``."""
        valid = self.field_names()
        unknown = [k for k in fields if k not in valid]
        if unknown:
            raise TypeError(
                f"DeviceSpec.with_overrides: unknown field(s) {', '.join(map(repr, unknown))}; valid fields are "
                f"{', '.join(valid)}."
            )
        changed = {k: v for k, v in fields.items() if getattr(self, k) != v}
        if changed and "source" not in fields:
            note = ", ".join(f"{k}={v!r}" for k, v in changed.items())
            source = f"{self.source}; overridden: {note}" if self.source else f"overridden: {note}"
            fields = {**fields, "source": source}
        return dataclasses.replace(self, **fields)

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly dict; ``DeviceSpec.from_dict(spec.to_dict()) == spec``."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> DeviceSpec:
        if not isinstance(data, Mapping):
            raise TypeError(f"DeviceSpec.from_dict needs a mapping (from to_dict()), got {type(data).__name__}.")
        valid = cls.field_names()
        unknown = [k for k in data if k not in valid]
        if unknown:
            raise ValueError(
                f"DeviceSpec.from_dict: unknown key(s) {', '.join(map(repr, unknown))}; valid keys are "
                f"{', '.join(valid)}."
            )
        required = [f.name for f in dataclasses.fields(cls)
                    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
        missing = [k for k in required if k not in data]
        if missing:
            raise ValueError(
                f"DeviceSpec.from_dict: missing key(s) {', '.join(missing)}; pass a dict made by DeviceSpec.to_dict()."
            )
        return cls(**data)


# Datasheets cited below:
# [A100]  NVIDIA A100 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/a100/): BF16 312 TFLOPS dense
#         (624 sparse), TF32 156 dense, FP32 19.5, FP64 Tensor Core 19.5 (FP64 9.7), INT8 624 TOPS dense (1,248
#         sparse), no FP8; 40GB HBM2 at 1,555 GB/s,
#         80GB HBM2e at 2,039 GB/s (SXM);
#         NVLink 600 GB/s (bidirectional, i.e. 300 GB/s each way).
# [DGXA100] NVIDIA DGX A100 datasheet: 8x single-port ConnectX-6 VPI, 200 Gb/s HDR InfiniBand, one per GPU.
# [H100]  NVIDIA H100 Tensor Core GPU datasheet, SXM column: BF16 1,979 TFLOPS *with sparsity* -> 989 dense,
#         TF32 989 sparse -> 494.5 dense, FP32 67, FP64 Tensor Core 67 (FP64 34), FP8 3,958 TFLOPS sparse -> 1,979
#         dense, INT8 3,958 TOPS sparse -> 1,979 dense; 80GB HBM3 at 3.35 TB/s;
#         NVLink 900 GB/s (bidirectional).
# [DGXH100] NVIDIA DGX H100 datasheet: 8x single-port ConnectX-7, 400 Gb/s NDR InfiniBand, one per GPU.
# [H200]  NVIDIA H200 datasheet, SXM column: same compute as H100 SXM; 141GB HBM3e at 4.8 TB/s; NVLink 900 GB/s.
#         DGX H200 uses the DGX H100 network (8x ConnectX-7, 400 Gb/s per GPU).
# [B200]  NVIDIA DGX B200 datasheet: 72 PFLOPS FP8 training for 8 GPUs (sparse) -> 4.5 PFLOPS FP8 sparse,
#         2.25 PFLOPS BF16 dense per GPU; 1,440 GB HBM3e total (180 GB per GPU) at 64 TB/s (8 TB/s per GPU;
#         the HGX B200 page lists 7.7 TB/s); NVLink 5 at 14.4 TB/s total (1.8 TB/s bidirectional per GPU);
#         networking 8x single-port ConnectX-7 VPI at up to 400 Gb/s (ConnectX-8 at 800 Gb/s is DGX B300, not B200).
#         HGX B200 per-GPU table: TF32 2.2 PFLOPS sparse -> 1.1 dense, FP32 75 TFLOPS, FP64/FP64 Tensor Core 37,
#         FP8/FP6 Tensor Core 9 PFLOPS sparse -> 4.5 dense, INT8 Tensor Core 9 POPS sparse -> 4.5 dense.
# [MAMF]  Maximum achievable bf16 matmul FLOPS, best shape, measured with mamf-finder.py (Stas Bekman,
#         github.com/stas00/ml-engineering, compute/accelerator): A100 SXM 267.9/312 = 85.9%,
#         H100 SXM 794.5/989 = 80.3%, B200 SXM 1745/2250 = 77.6%. Training shapes are rarely the best shape,
#         so matmul_efficiency is MAMF minus about 5 points.
# [HBMEFF] NVIDIA developer forum, "Trouble to reach peak bandwidth of A100" (2025): a tuned read kernel reaches 88%
#         of the 2.04 TB/s datasheet figure, and the best kernels in a cited GTC talk reach about 90%;
#         memory_efficiency = 0.85 leaves a little for imperfect access patterns.
# [NCCL]  NCCL's own cost model, src/graph/tuning.cc (hwLat): per ring step 0.6 us (LL) to 3.4 us (Simple) over
#         NVLink and 2.7 us (LL) to 14 us (Simple) over the network, plus 6.6-8.4 us per collective (baseLat).
#         We use 2 us in a node and 8 us across nodes, inside those ranges.
# [NCCLBW] Measured NCCL bus bandwidth (nccl-tests), stated by NCCL's maintainers: A100 NVLink3 about 230 GB/s of
#         the 300 GB/s line rate (github.com/NVIDIA/nccl-tests/issues/149), H100 NVLink4 about 370 GB/s of 450 for
#         ring collectives, "protocol overhead (~20%)" (nccl-tests/issues/212); HDR InfiniBand about 24 GB/s of
#         25 per NIC (github.com/NVIDIA/nccl/issues/412); NDR 46-49 GB/s of 50 (nccl-tests/issues/290, /267).
# [FA]    Flash attention at head dim 128, sequence 2048-4096, causal, counting the FLOPs the kernel executes
#         (causal blocks skipped, the backward's recomputation counted): FlashAttention-2 on A100, forward and
#         backward together 155-173 TFLOP/s = 50-55% of 312 (Dao 2023, arXiv 2307.08691, Fig. 4); cuDNN's fused
#         attention on H100, forward 484-518 TFLOP/s causal, backward 465-499 non-causal = 47-52% of 989
#         (Shah et al. 2024, arXiv 2407.08608, Figs. 5-6).
# [LAUNCH] A CUDA kernel launch costs a few microseconds of host and device overhead (NVIDIA Technical Blog,
#         "Getting Started with CUDA Graphs", 2019); XLA batches many launches into command buffers, so 2 us.

_GPU_LATENCIES = dict(intra_node_latency=2e-6, inter_node_latency=8e-6, kernel_launch_floor=2e-6)  # [NCCL] [LAUNCH]

_A100_COMMON = dict(
    peak_flops_bf16=312e12,  # [A100]
    peak_flops_tf32=156e12,  # [A100]
    peak_flops_fp32=19.5e12,  # [A100]
    peak_flops_fp64=19.5e12,  # [A100] FP64 Tensor Core
    peak_ops_int8=624e12,  # [A100] INT8 Tensor Core 1,248 TOPS sparse (no FP8 tensor cores: fp8 runs at bf16)
    intra_node_bandwidth=300e9,  # [A100] NVLink3 600 GB/s bidirectional
    inter_node_bandwidth=25e9,  # [DGXA100] HDR 200 Gb/s per GPU
    matmul_efficiency=0.80,  # [MAMF] 85.9%
    memory_efficiency=0.85,  # [HBMEFF]
    attention_efficiency=0.52,  # [FA] FlashAttention-2, A100, causal, head dim 128
    intra_node_efficiency=0.77,  # [NCCLBW] 230 of 300 GB/s
    inter_node_efficiency=0.96,  # [NCCLBW] 24 of 25 GB/s
    **_GPU_LATENCIES,
)
_HOPPER_COMPUTE = dict(
    peak_flops_bf16=989e12,  # [H100]
    peak_flops_tf32=494.5e12,  # [H100]
    peak_flops_fp32=67e12,  # [H100]
    peak_flops_fp64=67e12,  # [H100] FP64 Tensor Core (H200: the same die)
    peak_flops_fp8=1979e12,  # [H100] FP8 Tensor Core 3,958 TFLOPS sparse
    peak_ops_int8=1979e12,  # [H100] INT8 Tensor Core 3,958 TOPS sparse
    intra_node_bandwidth=450e9,  # [H100] NVLink4 900 GB/s bidirectional
    inter_node_bandwidth=50e9,  # [DGXH100] NDR 400 Gb/s per GPU
    matmul_efficiency=0.75,  # [MAMF] 80.3%
    memory_efficiency=0.85,  # [HBMEFF]
    attention_efficiency=0.50,  # [FA] cuDNN fused attention, H100, causal forward / backward
    intra_node_efficiency=0.82,  # [NCCLBW] 370 of 450 GB/s
    inter_node_efficiency=0.94,  # [NCCLBW] 47 of 50 GB/s
    **_GPU_LATENCIES,
)

_TABLE = (
    DeviceSpec(
        name="A100-40GB",
        hbm_bandwidth=1.555e12,  # [A100] 1,555 GB/s
        memory_capacity=40 * 10**9,  # [A100]
        source="NVIDIA A100 datasheet (SXM4 40GB); DGX A100 datasheet (HDR 200 Gb/s per GPU); "
               "efficiencies: ml-engineering MAMF table, NVIDIA forum HBM measurements; latencies: NCCL tuning.cc",
        **_A100_COMMON,
    ),
    DeviceSpec(
        name="A100-80GB",
        hbm_bandwidth=2.039e12,  # [A100] 2,039 GB/s (SXM; the PCIe card has 1,935)
        memory_capacity=80 * 10**9,  # [A100]
        source="NVIDIA A100 datasheet (SXM4 80GB); DGX A100 datasheet (HDR 200 Gb/s per GPU); "
               "efficiencies: ml-engineering MAMF table, NVIDIA forum HBM measurements; latencies: NCCL tuning.cc",
        **_A100_COMMON,
    ),
    DeviceSpec(
        name="H100",
        hbm_bandwidth=3.35e12,  # [H100] 3.35 TB/s
        memory_capacity=80 * 10**9,  # [H100]
        source="NVIDIA H100 datasheet (SXM5); DGX H100 datasheet (NDR 400 Gb/s per GPU); "
               "efficiencies: ml-engineering MAMF table, NVIDIA forum HBM measurements; latencies: NCCL tuning.cc",
        **_HOPPER_COMPUTE,
    ),
    DeviceSpec(
        name="H200",
        hbm_bandwidth=4.8e12,  # [H200] 4.8 TB/s
        memory_capacity=141 * 10**9,  # [H200] 141 GB
        source="NVIDIA H200 datasheet (SXM); DGX H200 network as DGX H100 (NDR 400 Gb/s per GPU); "
               "efficiencies: ml-engineering MAMF table, NVIDIA forum HBM measurements; latencies: NCCL tuning.cc",
        **_HOPPER_COMPUTE,
    ),
    DeviceSpec(
        name="B200",
        peak_flops_bf16=2.25e15,  # [B200] 72 PF FP8 sparse / 8 GPUs / 2 (sparsity) / 2 (FP8 -> BF16)
        peak_flops_tf32=1.1e15,  # [B200] HGX B200: 2.2 PF sparse
        peak_flops_fp32=75e12,  # [B200] HGX B200
        peak_flops_fp64=37e12,  # [B200] HGX B200 FP64/FP64 Tensor Core
        peak_flops_fp8=4.5e15,  # [B200] HGX B200 FP8/FP6 Tensor Core 9 PFLOPS sparse
        peak_ops_int8=4.5e15,  # [B200] HGX B200 INT8 Tensor Core 9 POPS sparse
        hbm_bandwidth=8e12,  # [B200] 64 TB/s / 8
        memory_capacity=180 * 10**9,  # [B200] 1,440 GB / 8
        intra_node_bandwidth=900e9,  # [B200] NVLink5 1.8 TB/s bidirectional
        inter_node_bandwidth=50e9,  # [B200] ConnectX-7 400 Gb/s per GPU
        matmul_efficiency=0.72,  # [MAMF] 77.6%
        memory_efficiency=0.85,  # [HBMEFF]
        attention_efficiency=0.50,  # [FA] as H100 (no published B200 measurement at hand)
        intra_node_efficiency=0.82,  # [NCCLBW] NVLink protocol overhead as on H100
        inter_node_efficiency=0.94,  # [NCCLBW] ConnectX-7 as DGX H100
        source="NVIDIA DGX B200 datasheet (8 GPUs; ConnectX-7 400 Gb/s per GPU) and HGX B200 per-GPU table; "
               "efficiencies: ml-engineering MAMF table, NVIDIA forum HBM measurements; latencies: NCCL tuning.cc",
        **_GPU_LATENCIES,
    ),
    # A deliberately conservative host default, not a datasheet: one AVX2 core at 3 GHz peaks at
    # 2 FMA units x 8 fp32 lanes x 2 FLOP x 3e9 = 96 GFLOP/s, and XLA:CPU gains nothing from bf16; one DDR4-3200
    # channel moves 25.6 GB/s. Cluster.local() replaces memory_capacity with this machine's RAM per device.
    DeviceSpec(
        name="cpu",
        peak_flops_bf16=1e11,
        peak_flops_tf32=1e11,
        peak_flops_fp32=1e11,
        peak_flops_fp64=5e10,  # 4 fp64 lanes of an AVX2 register against 8 fp32: half
        hbm_bandwidth=2e10,
        memory_capacity=8 * 10**9,
        intra_node_bandwidth=1e10,  # host memcpy between CPU devices of one process
        inter_node_bandwidth=1.25e9,  # 10 Gb/s Ethernet
        intra_node_latency=1e-5,
        inter_node_latency=5e-5,
        kernel_launch_floor=5e-6,
        matmul_efficiency=0.5,
        memory_efficiency=0.7,
        # XLA:CPU has no fused attention kernel: dot_product_attention lowers to XLA's reference implementation,
        # which computes and keeps the scores (jax.nn.dot_product_attention's implementation="xla")
        fused_attention=False,
        # XLA:CPU compiles a loop's body into the loop (no dispatch per kernel and iteration): 0.1 us per iteration of
        # a scan over two 8 x 8 matmuls and a tanh on this repository's 2-core machine, jax 0.10 (docs/limits.md)
        loop_launches=False,
        source="conservative host default (one AVX2 core, one DDR4 channel, 10 GbE); calibrate with with_overrides",
    ),
)

DEVICE_KINDS: Mapping[str, DeviceSpec] = types.MappingProxyType({spec.name: spec for spec in _TABLE})
"""The built-in device table, keyed by canonical kind name."""

DEVICE_ALIASES: Mapping[str, str] = types.MappingProxyType({
    "a100-40g": "A100-40GB", "a100-sxm4-40gb": "A100-40GB", "a100-sxm-40gb": "A100-40GB",
    "a100-80g": "A100-80GB", "a100-sxm4-80gb": "A100-80GB", "a100-sxm-80gb": "A100-80GB",
    "h100-sxm": "H100", "h100-sxm5": "H100", "h100-80gb": "H100", "h100-sxm5-80gb": "H100",
    "h200-sxm": "H200", "h200-141gb": "H200",
    "b200-sxm": "B200", "b200-180gb": "B200",
    "host": "cpu",
})
"""Other spellings accepted by :func:`get_device` (lower case, ``-`` separated) -> canonical kind name."""


def _normalize(name: str) -> str:
    return "-".join(name.strip().lower().replace("_", "-").split())


_LOOKUP = {**{_normalize(k): k for k in DEVICE_KINDS}, **DEVICE_ALIASES}


def get_device(name: str) -> DeviceSpec:
    """The table spec for a device kind, case-insensitively, aliases included (``"h100-sxm"`` -> ``H100``)."""
    if isinstance(name, DeviceSpec):
        return name
    if not isinstance(name, str):
        raise TypeError(
            f"get_device needs a device kind name, got {name!r} ({type(name).__name__}); "
            f"use one of {', '.join(DEVICE_KINDS)}."
        )
    key = _normalize(name)
    if key in _LOOKUP:
        return DEVICE_KINDS[_LOOKUP[key]]
    starting = sorted({_LOOKUP[k] for k in _LOOKUP if k.startswith(key)}) if key else []
    close = starting or [_LOOKUP[k] for k in difflib.get_close_matches(key, list(_LOOKUP), n=1)]
    hint = f" Did you mean {' or '.join(map(repr, close))}?" if close else ""
    raise ValueError(
        f"Unknown device kind {name!r}; valid kinds are {', '.join(DEVICE_KINDS)} (aliases: "
        f"{', '.join(DEVICE_ALIASES)}).{hint} For another device, build a DeviceSpec or start from the closest "
        "kind: get_device('H100').with_overrides(name=..., hbm_bandwidth=...)."
    )

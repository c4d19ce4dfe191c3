"""What a plan is predicted to do (:class:`Estimate`) and the names every part of the planner shares."""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any

from autopp.core._schedules import SCHEDULE_NAMES

SCHEDULES: tuple[str, ...] = SCHEDULE_NAMES
"""Pipeline schedules the cost model describes: every schedule the runtime runs (:func:`autopp.planner.plan_model`
searches all but ``dualpipev`` by default)."""

RECOMPUTE_MODES = ("none", "full", "selective")
"""Activation recomputation modes: keep every residual; keep only each layer's inputs (the backward re-runs the
forward); drop the attention core's residuals (Korthikanti et al. 2022) and re-run it."""

OVERLAPS = ("grad-reduce", "param-gather", "tensor")
"""Communication the cost model may hide behind compute: the data-parallel gradient reduction behind the last
microbatch's backward (bucketed, as Megatron's ``--overlap-grad-reduce`` and XLA's asynchronous collectives do);
parameter gathers behind compute: FSDP's behind the previous layer's (prefetching), ZeRO-1's gather of the updated
parameters behind the next step's first forward (Megatron's ``--overlap-param-gather``); and tensor-parallel
collectives behind their matmuls (collective matmul, Megatron's ``--tp-comm-overlap``, XLA's windowed einsum)."""

DEFAULT_OVERLAP = ("grad-reduce", "param-gather")
"""What XLA overlaps by itself on GPUs: asynchronous all-gathers and reductions that do not feed the next operation;
a tensor-parallel collective feeds the next matmul, so it is exposed unless collective matmul is enabled."""


def positive_int(who: str, name: str, value: Any, example: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:
        raise ValueError(f"{who}: {name} must be a positive int, got {name}={value!r}; pass e.g. {name}={example}.")
    return int(value)


def unit(value: float, kind: str) -> tuple[float, str]:
    """(divisor, name) of the largest unit ``value`` is at least 1 of: binary for ``"bytes"`` (``B``, ``KiB`` ..
    ``TiB``), decimal for ``"flop"`` (``FLOP``, ``kFLOP`` .. ``PFLOP``), so a small model's figures do not print as
    ``0.00 GiB``. A breakdown prints every part in the unit of its total."""
    base, names = (1024, ("B", "KiB", "MiB", "GiB", "TiB")) if kind == "bytes" else (
        1000, ("FLOP", "kFLOP", "MFLOP", "GFLOP", "TFLOP", "PFLOP"))
    k = 0
    while k + 1 < len(names) and abs(value) >= base ** (k + 1):
        k += 1
    return float(base ** k), names[k]


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Estimate:
    """What :func:`simulate` predicts for one training step of a plan."""

    step_time_s: float
    """Seconds per training step (one global batch)."""
    tflops_per_gpu: float
    """TFLOP/s per GPU counting the FLOPs the plan executes: the traced step's forward and backward FLOPs plus the
    forward FLOPs recomputation repeats (for Megatron's GPT with full recomputation of the blocks:
    ``96 B s l h^2 (1 + s/(6h) + V/(16 l h))``), over step time and GPU count."""
    mfu: float | None
    """Model FLOPs utilisation: model FLOPs (forward + backward, no recomputation; causal attention counted whole,
    as Megatron-LM's and PaLM's formulas count it) / (step time x GPUs x the device's dense bf16 peak); None on the
    host CPU, whose table entry is a conservative default, not a datasheet peak."""
    peak_memory_bytes_per_gpu: int
    """Bytes of device memory the most loaded GPU needs (weights, gradients, optimizer state, activations)."""
    fits: bool
    """Whether ``peak_memory_bytes_per_gpu`` fits the device's memory."""
    compute_s: float
    """Seconds the slowest pipeline stage computes (all microbatches, forward + backward + recomputation)."""
    bubble_s: float
    """Seconds of pipeline bubble (the schedule's fill and drain at the slowest stage's pace)."""
    tp_comm_s: float
    """Seconds of tensor-parallel collectives (the resharding the sharding solution implies) on the slowest stage
    that compute does not hide."""
    fsdp_comm_s: float
    """Exposed seconds of FSDP (ZeRO-3) weight gathers and gradient reduce-scatters on the slowest stage (the part
    the stage's compute does not hide; 0 without FSDP)."""
    pp_comm_s: float
    """Seconds of stage-to-stage sends and the tied-embedding gradient all-reduce (not overlapped)."""
    dp_comm_s: float
    """Exposed seconds of the data-parallel gradient all-reduce (the part not hidden behind other stages'
    backward passes)."""
    optimizer_s: float
    """Seconds of the optimizer update (memory-bound)."""
    num_microbatches: int
    """Microbatches per pipeline per step: ``global_batch / (microbatch_size * dp)``."""
    param_bytes: int
    """Bytes of parameters and their gradients on the most loaded GPU (dtypes as traced)."""
    optimizer_bytes: int
    """Bytes of optimizer state on the most loaded GPU (as the traced update keeps it, e.g. Adam's moments)."""
    activation_bytes: int
    """Bytes of activations kept for the backward on the most loaded GPU, at peak."""
    dispatch_s: float = 0.0
    """Seconds the host spends issuing the step's programs beyond what the devices hide (local devices only)."""
    update_copy_bytes: int = 0
    """Bytes of new parameters and optimizer state the update writes beside the old ones, which the step's caller
    still holds (arguments not in ``donate_argnums``), less the gradients it frees, on the most loaded GPU: nonzero
    when they, not the activations (freed by then), set the peak."""

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly dict of every field."""
        return dataclasses.asdict(self)



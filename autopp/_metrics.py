"""Metrics while training: one log line per step, in the form torchtitan and Levanter print.

``step 3 | loss 5.5432 | 41.2 ms | 24.8k tok/s | 0.31 TFLOP/s/dev | mfu - | mem 12.3 MiB``

:class:`MetricsLogger` wraps any step callable (an ``autopp.parallelize`` step, an SPMD baseline, a ``jax.jit``
function). A logged step blocks until the step's outputs are ready, so that the time is the step's and not the
dispatch's: with ``every=1`` the host cannot queue the next step while this one runs (for autopp's pipeline the
host issues a step's tasks ahead of the devices; blocking costs that overlap across step boundaries, a few
percent where dispatch dominates). ``every=k`` blocks once per ``k`` steps and reports their average time.
"""

from __future__ import annotations

import dataclasses
import math
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np


def known_peak_flops(devices: Sequence[jax.Device], dtype: Any = "bfloat16") -> float | None:
    """Peak FLOP/s of one of ``devices`` when their kind is in the device table with a datasheet figure; None
    for CPUs (the table's ``cpu`` entry is a conservative placeholder, not this machine's peak) and unknown
    kinds, so that no MFU is made up."""
    from autopp.profiler import Cluster

    try:
        device = Cluster.local(list(devices)).device
    except (ValueError, TypeError):
        return None
    if device.name == "cpu":
        return None
    return float(device.peak_flops(dtype))


def _si(x: float) -> str:
    for div, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= div:
            return f"{x / div:.1f}{suffix}"
    return f"{x:.1f}"


def format_bytes(n: int | None) -> str:
    """``12.3 MiB``; ``-`` for None."""
    if n is None:
        return "-"
    for div, unit in ((2**40, "TiB"), (2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if n >= div:
            return f"{n / div:.1f} {unit}"
    return f"{n} B"


@dataclasses.dataclass(frozen=True)
class StepMetrics:
    """What one logged step measured."""

    step: int
    """1-based index of the step (calls of the wrapped step)."""
    loss: float
    step_time_s: float
    """Seconds per step: wall time from the end of the previous logged step (or this call's start) to this step's
    outputs being ready, divided by the steps in between."""
    tokens_per_s: float
    """``tokens_per_step / step_time_s``."""
    tflops_per_device: float | None
    """``flops_per_step / step_time_s / num_devices / 1e12``; None without a FLOP count."""
    mfu: float | None
    """``flops_per_step / (step_time_s * num_devices * peak)``; None where the devices' peak is not known."""
    peak_memory_bytes: int | None
    """Peak bytes on the most loaded device; None where it cannot be read."""

    def line(self) -> str:
        tf = "-" if self.tflops_per_device is None else f"{self.tflops_per_device:.3g}"
        mfu = "-" if self.mfu is None else f"{self.mfu * 100:.1f}%"
        return (f"step {self.step} | loss {self.loss:.4f} | {self.step_time_s * 1e3:.1f} ms | "
                f"{_si(self.tokens_per_s)} tok/s | {tf} TFLOP/s/dev | mfu {mfu} | "
                f"mem {format_bytes(self.peak_memory_bytes)}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def tokens_in(batch) -> int:
    """Tokens in a batch: the elements of its first integer leaf of rank >= 2 (``tokens``: batch x sequence),
    else the leading dimension of its first leaf (examples)."""
    leaves = jax.tree_util.tree_leaves(batch)
    if not leaves:
        raise ValueError("autopp.metrics: the batch has no array leaves to count tokens in; pass tokens_per_step=.")
    for x in leaves:
        if np.ndim(x) >= 2 and np.issubdtype(np.dtype(jax.numpy.result_type(x)), np.integer):
            return int(math.prod(np.shape(x)))
    shape = np.shape(leaves[0])
    if not shape:
        raise ValueError("autopp.metrics: the batch's first leaf is a scalar; pass tokens_per_step=.")
    return int(shape[0])


def _positive_number(name: str, value, integer: bool = False):
    kind = (int, np.integer) if integer else (int, float, np.integer, np.floating)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, kind) or value <= 0:
        raise ValueError(f"autopp.metrics: {name} must be a positive {'int' if integer else 'number'}, got "
                         f"{value!r}.")
    return value


class MetricsLogger:
    """Wraps ``step`` (called like it, returning what it returns) and logs a :class:`StepMetrics` line every
    ``every`` steps to ``sink`` (default ``print``; e.g. ``logging.getLogger("train").info``). ``history`` keeps
    the logged :class:`StepMetrics`.

    * ``loss``: the output leaf at ``loss_index`` of the step's flat outputs (default: the one leaf named
      ``loss``, a dict key or attribute, when there is one, as in ``{"loss": ..., "lr": ...}``; else the last, as in
      ``(params, opt_state, loss)``);
    * ``tokens_per_step``: default :func:`tokens_in` of the batch argument (``batch_argnums``, default the last);
    * ``flops_per_step``: default the step's FLOPs (forward + backward + update) by
      :func:`autopp.profiler.profile` of the step function (``step.__wrapped__`` for autopp and baseline steps),
      computed on the first call; for a ``jax.jit`` step that takes its gradient with ``jax.value_and_grad``, XLA's
      count (``step.lower(*args).cost_analysis()``); for anything else TFLOP/s and MFU show ``-`` (one warning)
      unless ``flops_per_step=`` is given;
    * ``devices``: the devices the step runs on (default ``step.devices``, else those holding the step's outputs,
      e.g. one for a ``jax.jit`` step on one device; ``jax.devices()`` when no output is an array): the divisor
      of TFLOP/s per device, and the kind whose peak gives MFU (``peak_flops``, default
      :func:`known_peak_flops`; CPUs have none, so ``mfu -``);
    * peak memory: ``max(step.memory_report(*args).values())`` for autopp steps, ``step.peak_memory_bytes(*args)``
      for baselines, otherwise the devices' ``memory_stats()["peak_bytes_in_use"]`` where the backend keeps it.
    """

    def __init__(self, step: Callable, *, every: int = 1, sink: Callable[[str], Any] | None = print,
                 loss_index: int | None = None, tokens_per_step: int | None = None, flops_per_step: float | None = None,
                 devices: Sequence[jax.Device] | None = None, peak_flops: float | None = None,
                 batch_argnums: int | None = None):
        if not callable(step):
            raise TypeError(f"autopp.metrics: expected a callable step, got {type(step).__name__}.")
        self.every = _positive_number("every", every, integer=True)
        self.tokens_per_step = _positive_number("tokens_per_step", tokens_per_step, integer=True)
        self.flops_per_step = _positive_number("flops_per_step", flops_per_step)
        self.peak_flops = _positive_number("peak_flops", peak_flops)
        if loss_index is not None and (isinstance(loss_index, bool) or not isinstance(loss_index, (int, np.integer))):
            raise TypeError(f"autopp.metrics: loss_index must be an int or None, got {loss_index!r}.")
        if batch_argnums is not None and (isinstance(batch_argnums, bool) or
                                          not isinstance(batch_argnums, (int, np.integer))):
            raise TypeError(f"autopp.metrics: batch_argnums must be an int, got {batch_argnums!r}.")
        self.step = step
        self.sink = sink
        self.loss_index = None if loss_index is None else int(loss_index)
        self._loss_at: dict = {}  # output structure -> the loss's flat position (loss_index=None)
        self.batch_argnums = batch_argnums
        given = devices if devices is not None else getattr(step, "devices", None)
        self._devices_from_outputs = given is None  # read off the first outputs
        self.devices = list(given) if given is not None else jax.devices()
        if self.peak_flops is None:
            self.peak_flops = known_peak_flops(self.devices)
        self.history: list[StepMetrics] = []
        self._calls = 0
        self._last_end: float | None = None
        self._since = 0
        self._memory: dict[Any, int | None] = {}

    def _flops(self, args) -> float | None:
        if self.flops_per_step is None:
            from autopp.profiler import profile

            fn = getattr(self.step, "__wrapped__", self.step)
            try:
                self.flops_per_step = float(profile(fn, *args, batch_argnums=self.batch_argnums).total_flops)
            except ValueError as e:
                self.flops_per_step = _xla_flops(self.step, args)
                if self.flops_per_step is None:
                    self.flops_per_step = 0.0  # counted once: TFLOP/s and MFU show "-" from here on
                    warnings.warn(f"autopp.metrics: cannot count the step's FLOPs ({e}), and it is not a jax.jit "
                                  "function XLA can count; TFLOP/s and MFU are left out. Pass flops_per_step= to "
                                  "have them.", stacklevel=3)
        return self.flops_per_step or None

    def _peak_memory(self, args) -> int | None:
        flat, tree = jax.tree_util.tree_flatten(args)
        key = (tree, tuple(np.shape(x) for x in flat))
        if key not in self._memory:
            if hasattr(self.step, "memory_report"):
                self._memory[key] = int(max(self.step.memory_report(*args).values()))
            elif hasattr(self.step, "peak_memory_bytes"):
                self._memory[key] = int(self.step.peak_memory_bytes(*args))
            else:
                self._memory[key] = None
        if self._memory[key] is not None:
            return self._memory[key]
        stats = [d.memory_stats() for d in self.devices]
        peaks = [s["peak_bytes_in_use"] for s in stats if s and "peak_bytes_in_use" in s]
        return int(max(peaks)) if peaks else None

    def _loss_position(self, out, treedef) -> int:
        if self.loss_index is not None:
            return self.loss_index
        hit = self._loss_at.get(treedef)
        if hit is None:
            named = [k for k, (path, _) in enumerate(jax.tree_util.tree_flatten_with_path(out)[0])
                     if path and getattr(path[-1], "key", getattr(path[-1], "name", None)) == "loss"]
            hit = self._loss_at[treedef] = named[0] if len(named) == 1 else -1
        return hit

    def __call__(self, *args):
        if self._last_end is None:
            self._last_end = time.perf_counter()
        out = self.step(*args)
        self._calls += 1
        self._since += 1
        if self._calls % self.every:
            return out
        jax.block_until_ready(out)
        end = time.perf_counter()
        dt = (end - self._last_end) / self._since
        self._since = 0
        leaves, treedef = jax.tree_util.tree_flatten(out)
        if self._devices_from_outputs:
            self._devices_from_outputs = False
            held = {d for x in leaves if isinstance(x, jax.Array) for d in x.devices()}
            if held:
                self.devices = sorted(held, key=lambda d: d.id)
        try:
            loss = float(leaves[self._loss_position(out, treedef)])
        except (IndexError, TypeError) as e:
            raise ValueError(f"autopp.metrics: loss_index={self.loss_index} does not name a scalar among the step's "
                             f"{len(leaves)} output leaves ({e}); pass the loss's index.") from None
        argnum = len(args) - 1 if self.batch_argnums is None else self.batch_argnums
        tokens = self.tokens_per_step or tokens_in(args[argnum])
        flops = self._flops(args)
        n = len(self.devices)
        m = StepMetrics(
            step=self._calls, loss=loss, step_time_s=dt, tokens_per_s=tokens / dt,
            tflops_per_device=None if flops is None else flops / dt / n / 1e12,
            mfu=None if flops is None or self.peak_flops is None else flops / (dt * n * self.peak_flops),
            peak_memory_bytes=self._peak_memory(args))
        self.history.append(m)
        if self.sink is not None:
            self.sink(m.line())
        self._last_end = time.perf_counter()  # the next step's time starts after this bookkeeping
        return out


def _xla_flops(step, args) -> float | None:
    """XLA's own FLOP count (``Lowered.cost_analysis()``) of a ``jax.jit`` step for ``args``; None for anything
    else."""
    lower = getattr(step, "lower", None)
    if lower is None:
        return None
    try:
        analysis = lower(*args).cost_analysis()
    except Exception:  # noqa: BLE001 - not lowerable for these arguments (or no analysis on this backend)
        return None
    if isinstance(analysis, (list, tuple)):
        analysis = analysis[0] if analysis else None
    flops = (analysis or {}).get("flops")
    return float(flops) if flops and flops > 0 else None


def log_metrics(step: Callable, *, every: int = 1, sink: Callable[[str], Any] | None = print,
                loss_index: int | None = None, tokens_per_step: int | None = None, flops_per_step: float | None = None,
                devices: Sequence[jax.Device] | None = None, peak_flops: float | None = None,
                batch_argnums: int | None = None) -> MetricsLogger:
    """:class:`MetricsLogger` of ``step`` (the keywords are its own):
    ``step = autopp.metrics.log_metrics(autopp.parallelize(train_step))``."""
    return MetricsLogger(step, every=every, sink=sink, loss_index=loss_index, tokens_per_step=tokens_per_step,
                         flops_per_step=flops_per_step, devices=devices, peak_flops=peak_flops,
                         batch_argnums=batch_argnums)

"""Baselines and timing helpers shared by the benchmark suites."""

from __future__ import annotations

import statistics
import time

import jax

from autopp.models import make_train_step
from tests._helpers import ScannedGPT, scan_accumulation_step  # the tests' baselines are the benchmarks' too

__all__ = ["ScannedGPT", "interleaved_medians", "scan_accumulation_step", "train_step_fn"]


def train_step_fn(model, tx):
    return make_train_step(model.loss, tx)


def interleaved_medians(fns: dict, state: dict, batch, rounds: int) -> dict[str, float]:
    """Median wall time of one step of each function, alternating them round by round (noise hits all)."""
    times = {k: [] for k in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            t = time.perf_counter()
            out = fn(*state[name], batch)
            jax.block_until_ready(out)
            times[name].append(time.perf_counter() - t)
            state[name] = out[:-1]
    return {k: statistics.median(v) for k, v in times.items()}

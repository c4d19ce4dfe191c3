"""Measured layer profiles: the runtime's programs of a one-layer stage, timed with XLA on the local device, cached
as JSON."""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax.extend import core as jex_core

from autopp.core import without_host_prints
from autopp.profiler._costs import OpCost
from autopp.profiler._layer_stage import layer_graph, layer_stage_programs

CACHE_VERSION = 5
"""Version 5: the kernel lists a calibration fits (:func:`~autopp.profiler._costs.kernel_costs`) hold a loop's body's
kernels once per iteration, where version 4's held one kernel per loop (fitted together, the old lists' few kernels
for a loop's long time pushed the fitted launch floors up: 27.6 us per fused kernel on this machine's CPU). Version 4:
times of the runtime's stage programs (:class:`autopp.core.StagePrograms`) with small gradient
accumulators packed too, and a scanned layer reading its rows relative to a row base; version 3 packed only the
residuals between forward and backward, version 2 packed nothing, version 1 timed a plain ``jit`` of the layer's
VJP."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class LayerMeasurement:
    """What XLA measured for one layer on the local device: the programs the runtime runs for a stage holding just
    this layer (no recomputation)."""

    forward_s: float
    """Median wall time of the stage's forward program (``StagePrograms.fwd``: the outputs and the residuals the
    backward keeps; one call, inputs resident on the device)."""
    backward_s: float
    """Median wall time of the stage's backward program (``StagePrograms.bwd``: the VJP from the kept residuals,
    accumulating the parameters' gradients)."""

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _example(aval, key):
    if jnp.issubdtype(aval.dtype, jnp.floating):
        return jax.random.normal(key, aval.shape, aval.dtype) * 0.02
    return jnp.zeros(aval.shape, aval.dtype)


def _median_time(call, repeats: int) -> float:
    """Median seconds of ``call()`` (which returns what to wait for), after two warm-up calls (the first compiles)."""
    jax.block_until_ready(call())
    jax.block_until_ready(call())
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(call())
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def measure_layer(closed: jex_core.ClosedJaxpr, diff: Sequence[bool] | None = None, repeats: int = 7,
                  device=None, *, is_param: Sequence[bool] | None = None) -> LayerMeasurement:
    """Compile and time the runtime's forward and backward programs of a stage made of the layer ``closed``, on
    ``device`` (default: the first local device).

    ``diff`` marks the inputs the backward differentiates (default: every floating input); ``is_param`` the
    differentiated inputs that are parameters, whose gradients the backward accumulates (default: none, every
    cotangent is returned as an activation's would be). Inputs are random (floating) or zeros; every differentiable
    output's cotangent is ones.
    """
    device = device or jax.local_devices()[0]
    closed = without_host_prints(closed)  # timed on random inputs: not the user's prints
    invars = closed.jaxpr.invars
    if diff is None:
        diff = [jnp.issubdtype(v.aval.dtype, jnp.floating) for v in invars]
    param_of = dict(zip(invars, is_param if is_param is not None else [False] * len(invars)))
    graph = layer_graph(closed, range(len(closed.jaxpr.eqns)), diff)
    progs = layer_stage_programs(graph, [bool(param_of.get(v, False)) for v in graph.inputs], device)
    keys = jax.random.split(jax.random.key(0), max(1, len(graph.inputs)))
    args = jax.device_put([_example(v.aval, k) for v, k in zip(graph.inputs, keys)]
                          + [jnp.int32(base) for base in progs.row_bases], device)

    fwd_out = progs.fwd(*args)
    kept = list(fwd_out[len(graph.outputs):])
    forwarded = [args[i] for i in progs.forwarded_inputs]
    cts = jax.device_put([jnp.ones(graph.outputs[i].aval.shape, graph.outputs[i].aval.dtype)
                          for i in progs.diff_out_idx], device)
    n_acc = progs.num_acc
    flag = [jax.device_put(jnp.asarray(True), device)] if progs.has_flag else []
    acc = [jax.device_put(jnp.zeros(a.shape, a.dtype), device) for a in progs.acc_packing.buffer_avals()]

    def backward():
        nonlocal acc
        out = progs.bwd(*kept, *forwarded, *cts, *acc, *flag)
        acc = list(out[:n_acc])  # the accumulators are donated: the next call takes the ones this one returned
        return out

    return LayerMeasurement(forward_s=_median_time(lambda: progs.fwd(*args), repeats),
                            backward_s=_median_time(backward, repeats))


class ProfileCache:
    """A JSON file of layer measurements keyed by device kind, JAX version and layer fingerprint."""

    def __init__(self, path: str | None = None):
        self.path = path or os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")),
                                         "autopp", "profiles.json")
        self._data = None

    @staticmethod
    def key(device_kind: str, fingerprint: str) -> str:
        return f"{device_kind}|jax-{jax.__version__}|{fingerprint}"

    def _load(self) -> dict:
        if self._data is None:
            try:
                with open(self.path) as f:
                    data = json.load(f)
                self._data = data.get("entries", {}) if data.get("version") == CACHE_VERSION else {}
            except (FileNotFoundError, json.JSONDecodeError):
                self._data = {}
        return self._data

    def get(self, device_kind: str, fingerprint: str) -> LayerMeasurement | None:
        entry = self._load().get(self.key(device_kind, fingerprint))
        if not entry:
            return None
        return LayerMeasurement(**{f.name: entry[f.name] for f in dataclasses.fields(LayerMeasurement)})

    def samples(self, device_kind: str) -> list[tuple[list, float]]:
        """Every cached (kernels, seconds) pair for ``device_kind`` under this JAX version."""
        prefix = f"{device_kind}|jax-{jax.__version__}|"
        out = []
        for key, entry in self._load().items():
            if not key.startswith(prefix) or "kernels" not in entry:
                continue
            times = {"forward": entry["forward_s"], "forward_backward": entry["forward_s"] + entry["backward_s"]}
            for which, ks in entry["kernels"].items():
                out.append(([(k[0], OpCost(*k[1:])) for k in ks], times[which]))
        return out

    def put(self, device_kind: str, fingerprint: str, m: LayerMeasurement, kernels: dict | None = None) -> None:
        """Store a measurement; ``kernels`` maps ``"forward"``/``"forward_backward"`` to the layer's kernels
        (lists of ``(kind, OpCost)``) so that later calibrations can use it without re-tracing."""
        entry = m.to_dict()
        if kernels:
            entry["kernels"] = {k: [[kind, c.flops, c.transcendentals, c.bytes_accessed, c.output_bytes]
                                    for kind, c in v] for k, v in kernels.items()}
        self._load()[self.key(device_kind, fingerprint)] = entry
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        tmp = f"{self.path}.{os.getpid()}.tmp"  # processes sharing the cache (a multi-process run) write their own
        with open(tmp, "w") as f:
            json.dump({"version": CACHE_VERSION, "entries": self._data}, f, indent=1, sort_keys=True)
        os.replace(tmp, self.path)

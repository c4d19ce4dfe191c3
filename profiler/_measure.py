"""Measured layer profiles: compile one layer's forward and backward with XLA, time them, cache as JSON."""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex_core

from autopp.core import forward_with_vjp
from autopp.profiler._costs import OpCost

Literal = jex_core.Literal
CACHE_VERSION = 1


@dataclasses.dataclass(frozen=True, kw_only=True)
class LayerMeasurement:
    """What XLA measured for one layer on the local device."""

    forward_s: float
    """Median wall time of the jitted forward (one call, inputs resident on the device)."""
    backward_s: float
    """Median wall time of the jitted backward (the VJP, recomputing nothing it was not given)."""
    forward_temp_bytes: int
    """XLA's temporary buffer size for the forward (``memory_analysis().temp_size_in_bytes``)."""
    backward_temp_bytes: int
    """XLA's temporary buffer size for the backward."""
    residual_bytes: int
    """Bytes the forward hands to the backward (outputs of the forward-with-residuals program)."""

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _example(aval, key):
    if jnp.issubdtype(aval.dtype, jnp.floating):
        return jax.random.normal(key, aval.shape, aval.dtype) * 0.02
    if jnp.issubdtype(aval.dtype, jnp.integer):
        return jnp.zeros(aval.shape, aval.dtype)
    return jnp.zeros(aval.shape, aval.dtype)


def _median_time(fn, args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def measure_layer(closed: jex_core.ClosedJaxpr, diff: Sequence[bool] | None = None, repeats: int = 7,
                  device=None) -> LayerMeasurement:
    """Compile and time a layer's forward and backward on ``device`` (default: the first local device).

    ``diff`` marks the inputs the backward differentiates (default: every floating input).
    """
    device = device or jax.devices()[0]
    avals = [v.aval for v in closed.jaxpr.invars]
    keys = jax.random.split(jax.random.key(0), max(1, len(avals)))
    args = jax.device_put([_example(a, k) for a, k in zip(avals, keys)], device)
    if diff is None:
        diff = [jnp.issubdtype(a.dtype, jnp.floating) for a in avals]
    diff = [i for i, d in enumerate(diff) if d]
    out_avals = closed.out_avals

    def run(*xs):
        return jax.core.eval_jaxpr(closed.jaxpr, closed.consts, *xs)

    forward_with_residuals = forward_with_vjp(closed, diff)

    fwd = jax.jit(run)
    fwd_c = fwd.lower(*args).compile()
    with_res = jax.jit(forward_with_residuals)
    outs, vjp = with_res(*args)
    cts = [jnp.ones(a.shape, a.dtype) if jnp.issubdtype(a.dtype, jnp.floating) else np.zeros(a.shape, jax.dtypes.float0)
           for a in out_avals]
    bwd = jax.jit(lambda vjp, cts: vjp(cts))
    bwd_c = bwd.lower(vjp, cts).compile()
    res_jaxpr = jax.make_jaxpr(lambda *xs: jax.tree.leaves(forward_with_residuals(*xs)[1]))(*avals).jaxpr
    inputs = set(res_jaxpr.invars)
    residual_bytes = sum(int(np.prod(v.aval.shape)) * v.aval.dtype.itemsize for v in res_jaxpr.outvars
                         if isinstance(v, jex_core.Var) and v not in inputs)
    f_mem, b_mem = fwd_c.memory_analysis(), bwd_c.memory_analysis()
    return LayerMeasurement(
        forward_s=_median_time(fwd_c, args, repeats),
        backward_s=_median_time(bwd_c, (vjp, cts), repeats),
        forward_temp_bytes=int(getattr(f_mem, "temp_size_in_bytes", 0) or 0),
        backward_temp_bytes=int(getattr(b_mem, "temp_size_in_bytes", 0) or 0),
        residual_bytes=int(residual_bytes),
    )


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
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"version": CACHE_VERSION, "entries": self._data}, f, indent=1, sort_keys=True)
        os.replace(tmp, self.path)

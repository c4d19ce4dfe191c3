"""autopp: automatic MPMD pipeline parallelism for JAX training steps.

The public surface: :func:`parallelize`, :func:`grad`, :func:`value_and_grad`, :class:`Plan`,
:class:`Cluster`, :func:`gather` (a pipelined step's outputs onto one device, for plain JAX), and the submodules :mod:`autopp.checkpoint` (save and restore training states),
:mod:`autopp.distributed` (multi-host runs), :mod:`autopp.models` (the model zoo), :mod:`autopp.baselines`
(SPMD baselines) and :mod:`autopp.metrics` (per-step metrics).

Everything is imported on first use (PEP 562): ``import autopp`` costs little more than ``import jax``, and
``autopp.distributed.initialize`` works after a bare ``import autopp``.
"""

from __future__ import annotations

import importlib as _importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> the module that defines it
_ATTRS = {
    "parallelize": "autopp._parallelize",
    "Parallelized": "autopp._parallelize",
    "gather": "autopp._parallelize",
    "Plan": "autopp.core",
    "StagePlan": "autopp.core",
    "grad": "autopp.core",
    "value_and_grad": "autopp.core",
    "Cluster": "autopp.profiler",
}
# submodules reachable as attributes after a bare ``import autopp``
_SUBMODULES = ("baselines", "checkpoint", "distributed", "metrics", "models")
# the layers under the public face: resolvable the same way, not part of ``__all__``
_PACKAGES = ("core", "planner", "profiler", "runtime")

__all__ = sorted([*_ATTRS, *_SUBMODULES])

if TYPE_CHECKING:
    from autopp import baselines, checkpoint, core, distributed, metrics, models, planner, profiler, runtime
    from autopp._parallelize import Parallelized, gather, parallelize
    from autopp.core import Plan, StagePlan, grad, value_and_grad
    from autopp.profiler import Cluster


def __getattr__(name: str) -> Any:
    if name in _ATTRS:
        value = getattr(_importlib.import_module(_ATTRS[name]), name)
    elif name in _SUBMODULES or name in _PACKAGES:
        value = _importlib.import_module(f"{__name__}.{name}")
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    dunders = (n for n in globals() if n.startswith("__"))
    return sorted({*dunders, *__all__, *_PACKAGES})

"""SPMD baselines: the same training step as one ``jax.jit`` program with hand-written shardings.

``data_parallel(step)``, ``fsdp(step)`` (ZeRO-3), ``tensor_parallel(step, tensor=t)`` (Megatron-style, x data
parallelism over the rest), or ``spmd(step, layout={"data": d, "fsdp": f, "tensor": t})``; each returns an
:class:`SpmdStep`, called like the step. ``autopp compare`` measures them against autopp's plan.
"""

from autopp._baselines import (
    BASELINES,
    SpmdLayout,
    SpmdStep,
    baseline,
    data_parallel,
    fsdp,
    spmd,
    tensor_parallel,
)

__all__ = ["BASELINES", "SpmdLayout", "SpmdStep", "baseline", "data_parallel", "fsdp", "spmd", "tensor_parallel"]

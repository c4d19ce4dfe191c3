"""autopp: automatic MPMD pipeline parallelism for JAX training steps.

The public surface: :func:`parallelize`, :func:`grad`, :func:`value_and_grad`, :class:`Plan`,
:class:`Cluster`, and :mod:`autopp.checkpoint` (save and restore training states).
"""

from autopp import checkpoint
from autopp.core import Plan, StagePlan, grad, value_and_grad
from autopp._parallelize import Parallelized, parallelize
from autopp.profiler import Cluster

__version__ = "0.1.0"

__all__ = ["Cluster", "Parallelized", "Plan", "StagePlan", "checkpoint", "grad", "parallelize", "value_and_grad"]

"""autopp: automatic MPMD pipeline parallelism for JAX training steps.

The public surface: :func:`parallelize`, :func:`grad`, :func:`value_and_grad`, :class:`Plan`.
"""

from autopp._grad import grad, value_and_grad
from autopp._parallelize import Parallelized, parallelize
from autopp.planner._plan import Plan, StagePlan

__version__ = "0.1.0"

__all__ = ["Parallelized", "Plan", "StagePlan", "grad", "parallelize", "value_and_grad"]

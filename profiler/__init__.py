"""Costs of a traced step: per-op FLOPs and bytes (``autopp.profiler``)."""

from autopp.profiler._costs import OpCost, aval_bytes, eqn_cost, jaxpr_cost

__all__ = ["OpCost", "aval_bytes", "eqn_cost", "jaxpr_cost"]

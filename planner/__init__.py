"""Plans: stages, microbatches, schedule (``autopp.planner``)."""

from autopp.planner._plan import Plan, StagePlan

__all__ = ["Plan", "StagePlan"]

"""Plans: stages, microbatches, schedule (``autopp.planner``)."""

from autopp.planner._cpsat import StageAssignment, assign_stages
from autopp.planner._plan import Plan, StagePlan
from autopp.planner._simulate import RECOMPUTE_MODES, SCHEDULES, Estimate, clear_cache, simulate

__all__ = ["Estimate", "Plan", "RECOMPUTE_MODES", "SCHEDULES", "StageAssignment", "StagePlan", "assign_stages",
           "clear_cache", "simulate"]

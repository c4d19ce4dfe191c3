"""Plans: stages, layouts, microbatches, schedule (``autopp.planner``)."""

from autopp.planner._cpsat import BlockAssignment, StageAssignment, assign_blocks, assign_stages
from autopp.planner._plan import Plan, PlannerStats, StagePlan
from autopp.planner._search import plan_model
from autopp.planner._simulate import RECOMPUTE_MODES, SCHEDULES, Estimate, clear_cache, simulate

__all__ = ["BlockAssignment", "Estimate", "Plan", "PlannerStats", "RECOMPUTE_MODES", "SCHEDULES", "StageAssignment",
           "StagePlan", "assign_blocks", "assign_stages", "clear_cache", "plan_model", "simulate"]

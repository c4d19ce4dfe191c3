"""Plans: stages, layouts, microbatches, schedule (``autopp.planner``)."""

from autopp.planner._cpsat import BlockAssignment, StageAssignment, assign_blocks, assign_stages
from autopp.planner._plan import Plan, PlannerStats, StagePlan
from autopp.planner._schedule import Schedule, bubble_fraction, get_schedule, simulate_times
from autopp.planner._search import plan_model
from autopp.planner._simulate import RECOMPUTE_MODES, SCHEDULES, Estimate, clear_cache, simulate

__all__ = ["BlockAssignment", "Estimate", "Plan", "PlannerStats", "RECOMPUTE_MODES", "SCHEDULES", "StageAssignment",
           "Schedule", "StagePlan", "assign_blocks", "assign_stages", "bubble_fraction", "clear_cache", "get_schedule",
           "plan_model", "simulate", "simulate_times"]

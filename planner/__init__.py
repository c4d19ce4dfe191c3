"""Plans: stages, layouts, microbatches, schedule (``autopp.planner``)."""

from autopp.planner._cpsat import StageAssignment, assign_stages
from autopp.planner._estimate import DEFAULT_OVERLAP, OVERLAPS, RECOMPUTE_MODES, SCHEDULES, Estimate
from autopp.planner._plan import LayerSharding, Plan, PlannerStats, StagePlan
from autopp.planner._schedule import Schedule, bubble_fraction, get_schedule, simulate_times
from autopp.planner._search import plan_model
from autopp.planner._simulate import clear_cache, simulate

__all__ = ["DEFAULT_OVERLAP", "Estimate", "LayerSharding", "OVERLAPS", "Plan", "PlannerStats", "RECOMPUTE_MODES",
           "SCHEDULES", "StageAssignment", "Schedule", "StagePlan", "assign_stages", "bubble_fraction", "clear_cache",
           "get_schedule", "plan_model", "simulate", "simulate_times"]

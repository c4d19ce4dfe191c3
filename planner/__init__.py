"""Plans: stages, layouts, sharding, microbatches, schedule, recomputation (``autopp.planner``)."""

from autopp.core import (
    DEFAULT_OVERLAP,
    OVERLAPS,
    RECOMPUTE_MODES,
    SCHEDULES,
    Estimate,
    LayerSharding,
    Plan,
    PlannerStats,
    Schedule,
    StagePlan,
    bubble_fraction,
    get_schedule,
    simulate_times,
)
from autopp.planner._cpsat import StageAssignment, assign_stages
from autopp.planner._local import LocalPlan, most_devices_with_a_layout, pipeline_units, plan_local
from autopp.planner._search import CONFIG_FINGERPRINT, DEFAULT_MICROBATCH_SIZES, plan_model
from autopp.planner._simulate import clear_cache, simulate

__all__ = ["CONFIG_FINGERPRINT", "DEFAULT_MICROBATCH_SIZES", "DEFAULT_OVERLAP", "Estimate", "LayerSharding",
           "LocalPlan", "OVERLAPS", "Plan", "PlannerStats", "RECOMPUTE_MODES", "SCHEDULES", "StageAssignment",
           "Schedule", "StagePlan", "assign_stages", "bubble_fraction", "clear_cache", "get_schedule",
           "most_devices_with_a_layout", "pipeline_units", "plan_local",
           "plan_model", "simulate", "simulate_times"]

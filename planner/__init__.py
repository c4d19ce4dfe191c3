"""Plans: stage split, microbatches, schedule (``autopp.planner``)."""

from autopp.planner._plan import Plan, StagePlan
from autopp.planner._split import StageSplit, split_stages

__all__ = ["Plan", "StagePlan", "StageSplit", "split_stages"]

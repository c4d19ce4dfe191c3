"""Pipeline runtime: schedules, stage programs, executor (``autopp.runtime``)."""

from autopp.planner._schedule import (
    SCHEDULE_NAMES,
    Action,
    Schedule,
    ScheduleError,
    bubble_fraction,
    dispatch_order,
    get_schedule,
    gpipe,
    interleaved_1f1b,
    one_f_one_b,
    simulate_times,
    validate,
    zb_h1,
)

from autopp.runtime._timeline import TaskEvent, Timeline, run_with_timeline

__all__ = ["TaskEvent", "Timeline", "run_with_timeline",
           "SCHEDULE_NAMES", "Action", "Schedule", "ScheduleError", "bubble_fraction", "dispatch_order",
           "get_schedule", "gpipe", "interleaved_1f1b", "one_f_one_b", "simulate_times", "validate", "zb_h1"]

"""Pipeline runtime: schedules, stage programs, executor (``autopp.runtime``)."""

from autopp.core import (
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

from autopp.runtime._executable import steps_started
from autopp.runtime._executor import Executable, StageMeshes, build_executable
from autopp.runtime._tensor import tensor_specs
from autopp.runtime._timeline import TaskEvent, Timeline, run_with_timeline

__all__ = ["Executable", "StageMeshes", "TaskEvent", "Timeline", "build_executable", "run_with_timeline",
           "steps_started", "tensor_specs",
           "SCHEDULE_NAMES", "Action", "Schedule", "ScheduleError", "bubble_fraction", "dispatch_order",
           "get_schedule", "gpipe", "interleaved_1f1b", "one_f_one_b", "simulate_times", "validate", "zb_h1"]

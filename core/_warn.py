"""Warnings that point at the user's line."""

from __future__ import annotations

import os
import sys

_PACKAGES = ("autopp", "autopp.core", "autopp.planner", "autopp.profiler", "autopp.runtime")


def user_stacklevel() -> int:
    """``warnings.warn``'s ``stacklevel``, for a warning issued by the caller of this function, that names the first
    frame outside autopp's packages (the user's call of the step, ``plan_for``, ``profile``...), however deep inside
    autopp the warning is issued."""
    roots = tuple(os.path.dirname(sys.modules[m].__file__) + os.sep for m in _PACKAGES if m in sys.modules)
    frame, level = sys._getframe(2), 2  # the function calling warnings.warn is level 1
    while frame is not None and frame.f_code.co_filename.startswith(roots):
        frame, level = frame.f_back, level + 1
    return level


__all__ = ["user_stacklevel"]

"""Warnings and errors that point at the user's code."""

from __future__ import annotations

import inspect
import os
import re
import sys
from collections.abc import Callable, Sequence

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


def concrete_value_error(error: Exception, step_fn: Callable, leaf_paths: Sequence[str], who: str) -> TypeError:
    """JAX's refusal of a step that uses an argument's value in Python (``if train:``), said of the user's step and
    argument (JAX names autopp's flattened step and ``leaves[k]``)."""
    try:
        positional = [q.name for q in inspect.signature(step_fn).parameters.values()
                      if q.kind in (q.POSITIONAL_ONLY, q.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):  # (a callable without a signature)
        positional = []

    def named(path):  # args[1] -> train (args[1])
        k = int(re.match(r"args\[(\d+)\]", path)[1])
        return f"{positional[k]}{path[len(f'args[{k}]'):]} ({path})" if k < len(positional) else path

    names = [named(leaf_paths[int(k)]) for k in re.findall(r"leaves\[(\d+)\]", str(error))
             if int(k) < len(leaf_paths)]
    code = getattr(step_fn, "__code__", None)
    where = f" ({code.co_filename}:{code.co_firstlineno})" if code is not None else ""
    what = f"the value of {', '.join(dict.fromkeys(names))}" if names else "an argument's value"
    return TypeError(
        f"{who}: the step {getattr(step_fn, '__name__', type(step_fn).__name__)}{where} uses {what} in Python (an "
        "`if` on it, int() or bool() of it, a shape made from it), but the step is traced once per signature with "
        "abstract arguments, as jax.jit traces it. Use it as an array (jnp.where(train, a, b), lax.cond), or make one "
        "parallelized step per value with the value bound in Python (functools.partial(step, train=True)). "
        f"JAX's message: {str(error).splitlines()[0]}")


__all__ = ["concrete_value_error", "user_stacklevel"]

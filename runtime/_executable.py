"""A built step and the one loop that runs it: every task issued asynchronously, in order, each buffer dropped
right after its last use; no tracing, no compilation after the first call, no host synchronisation."""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from autopp.core import InternalFloatingPointError
from autopp.profiler import aval_bytes

from autopp.runtime._passes import _Deferred
from autopp.runtime._tasks import Program, Transfer


def _bytes_per_device(aval) -> dict[int, int]:
    sharding = getattr(aval, "sharding", None)
    if sharding is None:
        return {}
    n = aval_bytes(jax.ShapeDtypeStruct(sharding.shard_shape(aval.shape), aval.dtype))
    return {d.id: n for d in sharding.device_set}


def _steps(tasks) -> list[tuple]:
    """What the run loop reads per task, precomputed: (callable, input slots, output slots, slots to free)."""
    return [(t.fn.call if isinstance(t.fn, Transfer) else t.fn, t.ins, t.outs, t.frees) for t in tasks]


def _observed(fn, k, on_dispatch):
    def issue(*xs):
        res = fn(*xs)
        on_dispatch(k, tuple(res))
        return res
    return issue


def _issue(env: list, steps) -> None:
    """The run loop. A task that raises is named on the exception (``autopp_task``: its index)."""
    k = -1
    try:
        for k, (fn, ins, outs, frees) in enumerate(steps):
            res = fn(*[env[i] for i in ins])
            for o, r in zip(outs, res):
                env[o] = r
            for f in frees:
                env[f] = None
    except Exception as e:
        try:
            e.autopp_task = k
        except AttributeError:  # (an exception type that takes no attributes)
            pass
        raise


class _Invalid(Exception):
    """A task's output holds a NaN (or an inf) under ``jax_debug_nans`` (``jax_debug_infs``)."""


def _checked(fn, k):
    """``fn`` that checks its outputs as ``jax_debug_nans`` / ``jax_debug_infs`` ask (JAX checks a program it calls
    itself, not every executable autopp runs: one loaded from the compilation cache went unchecked)."""
    def run(*xs):
        res = fn(*xs)
        for r in res:
            if isinstance(r, jax.Array) and r.is_fully_addressable and jnp.issubdtype(r.dtype, jnp.inexact):
                if jax.config.jax_debug_nans and bool(jnp.isnan(r).any()):
                    raise _Invalid("nan")
                if jax.config.jax_debug_infs and bool(jnp.isinf(r).any()):
                    raise _Invalid("inf")
        return res
    return run


def _invalid_value(kind: str, labels, k: int, fallback: str) -> FloatingPointError:
    task = labels[k] if 0 <= k < len(labels) else fallback
    return FloatingPointError(
        f"invalid value ({kind}) encountered in {task} (autopp.parallelize, jax_debug_nans: the outputs of every "
        "stage's programs are checked, so a NaN that the loss masks later, with jnp.where, raises too; run the step "
        "with jax.jit to find the operation that made it).")


class Executable:
    """A built step: call :meth:`run` with the flat step inputs. Its programs may still be compiling when it
    is built; the first step waits for each as it reaches it, and :meth:`resolve` waits for all."""

    def __init__(self, program: Program, out_tree):
        self.tasks = list(program.tasks)
        self.num_slots = program.num_slots
        self.input_slots = list(program.input_slots)
        self.const_slots = list(program.const_slots)
        self.output_fns = list(program.outputs)
        self.out_tree = out_tree
        self.description = program.describe()
        self._plain = _steps(self.tasks)
        self._deferred = any(isinstance(t.fn, _Deferred) for t in self.tasks)
        self.num_programs = len({id(t.fn) for t in self.tasks
                                 if isinstance(t.fn, (_Deferred, jax.stages.Compiled))})
        """Distinct programs (compiled, loaded onto other devices or still compiling)."""
        self.num_compiled = program.num_compiled if program.num_compiled is not None else self.num_programs
        """How many of them XLA compiles (programs equal up to their devices compile once)."""
        self.slot_avals = dict(program.slot_avals)
        """Type (shape, dtype, sharding where known) of every slot's value."""
        inputs = set(program.input_slots)
        self.slot_bytes: dict[int, dict[int, int]] = {s: _bytes_per_device(a) for s, a in program.slot_avals.items()
                                                      if s not in inputs}
        """Bytes per device id of each slot's buffer (the step inputs' slots excluded)."""

    def compiling(self) -> int:
        """How many distinct programs are still compiling (the first step waits for each as it reaches it)."""
        if not self._deferred:
            return 0
        return len({id(t.fn.future) for t in self.tasks if isinstance(t.fn, _Deferred) and not t.fn.future.done()})

    def resolve(self) -> Executable:
        """Wait until every program is compiled and point the tasks at the compiled programs (a compilation
        error is raised here). Returns ``self``."""
        if self._deferred:
            self.tasks = [dataclasses.replace(t, fn=t.fn.get()) if isinstance(t.fn, _Deferred) else t
                          for t in self.tasks]
            self._plain = _steps(self.tasks)
            self._deferred = False
        return self

    def run(self, flat_args: Sequence[Any], on_dispatch: Callable[[int, tuple], None] | None = None):
        """Run one step. ``on_dispatch(task index, outputs)``, if given, is called after each task is issued
        (for :func:`autopp.runtime.run_with_timeline`)."""
        _steps_started[0] += 1
        env: list[Any] = [None] * self.num_slots
        for slot, value in self.const_slots:
            env[slot] = value
        for slot, value in zip(self.input_slots, flat_args):
            env[slot] = value
        steps = self._plain
        if on_dispatch is not None:
            steps = [(_observed(fn, k, on_dispatch), ins, outs, frees)
                     for k, (fn, ins, outs, frees) in enumerate(steps)]
        checking = jax.config.jax_debug_nans or jax.config.jax_debug_infs
        try:
            _issue(env, [(_checked(fn, k), ins, outs, frees) for k, (fn, ins, outs, frees) in enumerate(steps)]
                   if checking else steps)
        except InternalFloatingPointError as e:  # JAX's own check of a program's outputs, said as jit says it
            raise _invalid_value(e.ty, self.description, getattr(e, "autopp_task", -1), e.name) from None
        except _Invalid as e:
            raise _invalid_value(e.args[0], self.description, getattr(e, "autopp_task", -1), "") from None
        if self._deferred:
            self.resolve()
        return [fn(env) for fn in self.output_fns]

    def release(self) -> dict[int, int]:
        """Drop the gradient accumulators kept between steps for the next one (the next step makes new ones, as
        the first did); returns the bytes per device id freed. The step stays usable."""
        freed: dict[int, int] = collections.defaultdict(int)
        for task in self.tasks:
            pool = task.fn.pool if isinstance(task.fn, Transfer) else None
            if pool:
                for slot in task.outs:
                    for dev, n in self.slot_bytes.get(slot, {}).items():
                        freed[dev] += n
                pool.clear()
        return _this_process(freed)

    def held_between_steps(self) -> dict[int, int]:
        """Bytes per device id the executable holds now, between steps: its constants and the gradient
        accumulators kept for the next step (held once a step has run, until :meth:`release` frees them). Every
        device the step uses has an entry, 0 where nothing stays (as :meth:`memory_report` has one per device)."""
        held = {dev: 0 for per_device in self.slot_bytes.values() for dev in per_device}
        slots = [s for s, _ in self.const_slots]
        slots += [o for t in self.tasks if isinstance(t.fn, Transfer) and t.fn.pool for o in t.outs]
        for slot in slots:
            for dev, n in self.slot_bytes.get(slot, {}).items():
                held[dev] += n
        return _this_process(held)

    def memory_report(self, between_steps: bool = False) -> dict[int, int]:
        """Peak bytes per device id over one step, by the runtime's own accounting: every buffer the instruction
        list holds (placed inputs, constants, activations, residuals, gradient accumulators, results) from the
        task that makes it to the task after which it is dropped, plus each program's XLA temporaries
        (``memory_analysis().temp_size_in_bytes``) while it runs. The step's own inputs are not counted (the
        caller holds them); their placed copies are. ``between_steps=True``: what stays allocated between steps
        instead (:meth:`held_between_steps`). In a multi-process run, each process reports its own devices (it
        neither compiles nor holds the others' programs and buffers)."""
        if between_steps:
            return self.held_between_steps()
        self.resolve()
        live: dict[int, int] = collections.defaultdict(int)
        peak: dict[int, int] = collections.defaultdict(int)

        def add(slot, sign):
            for dev, n in self.slot_bytes.get(slot, {}).items():
                live[dev] += sign * n

        for slot, _ in self.const_slots:
            add(slot, 1)
        gone: set = set()  # donated slots: their buffers became the donating task's outputs
        for task in self.tasks:
            for d in task.donated:
                if d not in gone:
                    gone.add(d)
                    add(d, -1)
            for o in task.outs:
                add(o, 1)
            temp = 0
            analysis = getattr(task.fn, "memory_analysis", None)
            if analysis is not None:
                stats = analysis()
                temp = stats.temp_size_in_bytes if stats is not None else 0
            for dev in task.devices or live:
                peak[dev] = max(peak[dev], live[dev] + temp)  # XLA's analysis of an SPMD program is per device
            for f in task.frees:
                if f not in gone:
                    add(f, -1)
        return _this_process(peak)

    def describe(self) -> list[str]:
        return [t.label for t in self.tasks]


def _this_process(per_device: dict[int, int]) -> dict[int, int]:
    """``per_device`` restricted to this process's devices, by device id."""
    local = {d.id for d in jax.local_devices()} if jax.process_count() > 1 else None
    return dict(sorted((d, n) for d, n in per_device.items() if local is None or d in local))


_steps_started = [0]


def steps_started() -> int:
    """Steps this process has started, over every executable (a multi-process run's watchdog compares them)."""
    return _steps_started[0]

"""``autopp.parallelize``: the step traced once per argument signature -> a complete plan from one of three sources
(:mod:`autopp._plan_sources`) -> the executable built from (trace, plan) (:func:`autopp.runtime.build_executable`)
-> run."""

from __future__ import annotations

import collections
import contextlib
import functools
import gc
import os
import threading
import warnings
from collections.abc import Callable, Sequence
from typing import Any, Generic, NamedTuple, ParamSpec, TypeVar, overload

import jax
import numpy as np

from autopp._compile_cache import use_compilation_cache
from autopp._config import ParallelizeConfig
from autopp._plan_sources import source_plan
from autopp._progress import phase
from autopp.core import (Plan, Schedule, TracedStep, check_array_leaves, is_tracer, is_weak,
                         normalize_batch_argnums, outside_the_context_mesh, trace_step, user_stacklevel)
from autopp.runtime import Executable, build_executable

_P = ParamSpec("_P")
_R = TypeVar("_R")


@contextlib.contextmanager
def _young_collections_only():
    """Python's garbage collector without full collections while a step is built. Tracing, slicing and lowering a
    step make hundreds of thousands of objects, enough to start full collections, each a walk over every object of
    the process (JAX's modules included): two took 0.15-0.3 s of a 4.6 s first call of a 32-layer scanned GPT on 4
    stages (2-core CPU), where the young generations, still collected, hold the build's garbage."""
    young, middle, old = gc.get_threshold()
    gc.set_threshold(young, middle, 1 << 30)
    try:
        yield
    finally:
        gc.set_threshold(young, middle, old)


def _no_context_mesh(method):
    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        with outside_the_context_mesh():
            return method(*args, **kwargs)
    return wrapper


class Built(NamedTuple):
    """What one argument signature of a :class:`Parallelized` step is run with."""

    traced: TracedStep
    """The step traced once, at the arguments' shapes."""
    plan: Plan
    """The complete plan it runs."""
    forward: Any
    """The loss's forward at microbatch size (a ClosedJaxpr): the program the plan's equations index."""
    executable: Executable
    """The runtime's instruction list for the plan."""
    donated: tuple[int, ...] = ()
    """Flat indices of the donated arguments' leaves."""


class Parallelized(Generic[_P, _R]):
    """A training step run as an MPMD pipeline. Call it like the step it wraps.

    The first call for each argument signature traces the step (once), takes a complete plan from the source the
    keywords name (:attr:`config`'s ``source``: the counts given, a replayed plan, or the planner, which profiles
    the step on the local device and plans it for ``devices``) and builds the executable from the trace and the
    plan. With the planner, ``num_stages`` is None (the choice can differ between argument shapes): :meth:`plan_for`
    says what was chosen.
    """

    def __init__(self, step_fn: Callable[_P, _R], config: ParallelizeConfig):
        if not isinstance(config, ParallelizeConfig):
            raise TypeError(f"autopp.parallelize: expected a ParallelizeConfig, got {type(config).__name__}.")
        self._step_fn = step_fn
        self.config = config
        self.num_stages = config.num_stages if config.source == "counts" else (
            config.plan.num_stages if config.plan is not None else None)
        self.devices = list(config.devices)
        self.loss_reduction = config.loss_reduction
        self._cache: dict[Any, Built] = {}
        self._checked: set[int] = set()  # builds whose first step ran (multi-process: inputs checked alike)
        self._last: Built | None = None  # the build the last step ran
        self._building = threading.Lock()  # threads whose first calls race make one build, not one each
        functools.update_wrapper(self, step_fn)

    def __copy__(self) -> Parallelized:
        new = object.__new__(type(self))
        new.__dict__.update(self.__dict__)  # the same builds: the copy shares the compiled programs
        return new

    def __reduce__(self):
        raise TypeError("autopp.parallelize: a pipelined step holds its devices and compiled programs, so it cannot be "
                        "pickled or deep-copied. Save its plan instead (step.plan_for(*args).to_json(path)) and make "
                        "the step again with autopp.parallelize(step_fn, plan=path); copy.copy shares the compiled "
                        "state.")

    def __deepcopy__(self, memo):
        self.__reduce__()

    def _lookup(self, args: tuple) -> tuple[Built, list]:
        """The build for ``args``' signature (made on its first call) and ``args``' flat leaves: the arguments
        are flattened once per call."""
        flat, tree = jax.tree_util.tree_flatten(args)
        if flat and (is_tracer(flat[0]) or is_tracer(flat[-1])):
            raise TypeError("autopp.parallelize: the pipelined step was called inside a JAX transformation (jax.jit, "
                            "vmap, grad, eval_shape, ...): its arguments are traced values. Call it outside them; it "
                            "compiles its own programs (to plan without running, use step.plan_for(...)).")
        try:
            key = (tree, *map(_leaf_signature, flat))
        except Exception:  # noqa: BLE001 - a leaf that is not an array: say which and how to fix it
            check_array_leaves(args)
            raise
        hit = self._cache.get(key)
        if hit is None:
            _check_arity(self._step_fn, args)
            with self._building:
                hit = self._cache.get(key)  # (another thread's, made while this one waited)
                if hit is None:
                    with _young_collections_only():
                        hit = self._cache[key] = self._build(args)
        return hit, flat

    def _build(self, args: tuple) -> Built:
        check_array_leaves(args)
        _check_launched_processes_joined()
        use_compilation_cache(self.config.compilation_cache)
        with phase("tracing the step") as ph:
            traced = trace_step(self._step_fn, args, normalize_batch_argnums(self.config.batch_argnums, len(args)))
            ph.done("traced the step")
        plan, forward, reductions = source_plan(self.config, self._step_fn, args, traced)
        with phase(f"compiling the {plan.num_stages}-stage pipeline") as ph:
            donated = _usable_donations(self.config.donated_leaves(args), traced)
            exe = build_executable(traced, plan, forward, self.config.devices, donated=donated,
                                   output_reductions=reductions)
            ph.done(f"built {exe.num_programs} program(s) for {plan.num_stages} stage(s); they compile in the "
                    "background and the first step runs each as soon as it is ready")
        return Built(traced, plan, forward, exe, tuple(sorted(donated)))

    # -- public ----------------------------------------------------------------------------------
    @_no_context_mesh
    def __call__(self, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        if kwargs:
            raise TypeError(
                f"autopp.parallelize: pass the step's arguments positionally (got keyword(s) {sorted(kwargs)}); "
                "the batch is found by position (batch_argnums)."
            )
        built, flat = self._lookup(args)
        if id(built) not in self._checked:  # a signature's first step: the same inputs on every process
            _check_runnable(flat, "step")
            if jax.process_count() > 1:
                from autopp._distributed import check_same_inputs

                check_same_inputs(flat, built.traced.leaf_paths, built.traced.batch_mask)
            self._checked.add(id(built))
        self._start(built, flat)
        exe = built.executable
        pending = exe.compiling()
        if pending:  # the first step waits for compilation as it reaches each program: said, with the time
            with phase(f"first step: issuing its tasks as their programs compile ({pending} of {exe.num_compiled} "
                       "still compiling)") as ph:
                outputs = exe.run(flat)
                ph.done(f"first step issued ({exe.num_compiled} program(s) compiled)")
            return jax.tree_util.tree_unflatten(exe.out_tree, outputs)
        return jax.tree_util.tree_unflatten(exe.out_tree, exe.run(flat))

    def _start(self, built: Built, flat: list) -> None:
        """Before a step runs: donated leaves must be distinct arrays; a step of another signature than the last
        frees the accumulators the last one kept (one signature's at a time: a short last batch per epoch would
        otherwise keep a second set of gradient buffers for good)."""
        if any(x.is_deleted() if isinstance(x, jax.Array) else isinstance(x, jax.ShapeDtypeStruct) for x in flat):
            _check_runnable(flat, "step")  # (shapes without values after a first step: said as on the first)
            # a deleted array: XLA would crash on it (a user trial)
            gone = [p for p, x in zip(built.traced.leaf_paths, flat) if isinstance(x, jax.Array) and x.is_deleted()]
            raise RuntimeError(
                f"autopp.parallelize: {len(gone)} argument leaf(s) have been deleted ({', '.join(gone[:4])}"
                f"{' ...' if len(gone) > 4 else ''}): donated to an earlier call (donate_argnums) or deleted. Pass the "
                "step's latest outputs instead; nothing was run.")
        if built.donated:
            _check_donated_distinct(built, flat)
        last, self._last = self._last, built
        if last is not None and last is not built:
            last.executable.release()

    @_no_context_mesh
    def plan_for(self, *args) -> Plan:
        """The plan this step runs for arguments like ``args`` (arrays or ShapeDtypeStructs); runs nothing."""
        return self._lookup(args)[0].plan

    @_no_context_mesh
    def trace(self, *args, trace_json: str | None = None, gantt_png: str | None = None):
        """Run one step like ``step(*args)`` while recording when each task ran on which devices; returns
        ``(outputs, timeline)`` (an :class:`autopp.runtime.Timeline`: events, wall time, host issue time, critical
        path, bubble fraction). ``trace_json`` writes a Chrome/Perfetto trace, ``gantt_png`` a Gantt chart with
        the plan's predicted timeline below the measured one when the plan has stage times. It is a real step:
        its outputs are the step's, and arguments named in ``donate_argnums`` are consumed as by a call."""
        from autopp.runtime import run_with_timeline

        for name, path in (("trace_json", trace_json), ("gantt_png", gantt_png)):  # before the step consumes
            folder = None if path is None else os.path.dirname(os.path.abspath(os.fspath(path)))  # donated inputs
            if folder is not None and not os.path.isdir(folder):
                raise ValueError(f"Parallelized.trace: {name}={path!r} is in a folder that does not exist ({folder}); "
                                 "create it or write elsewhere. Nothing was run.")
            if path is not None and os.path.isdir(path):
                raise ValueError(f"Parallelized.trace: {name}={path!r} is a folder; give the file to write, e.g. "
                                 f"{os.path.join(os.fspath(path), 'step.png' if name == 'gantt_png' else 'step.json')!r}. "
                                 "Nothing was run.")
        built, flat = self._lookup(args)
        _check_runnable(flat, "Parallelized.trace")
        plan, exe = built.plan, built.executable
        self._start(built, flat)
        outputs, timeline = run_with_timeline(exe, flat)
        if trace_json is not None:
            timeline.to_chrome_trace(trace_json)
        if gantt_png is not None:
            timeline.plot(gantt_png, plan)
        return jax.tree_util.tree_unflatten(exe.out_tree, outputs), timeline

    @_no_context_mesh
    def memory_report(self, *args, between_steps: bool = False) -> dict[int, int]:
        """Peak bytes per device id during a step with arguments like ``args``, by the runtime's accounting of
        the buffers it holds plus each program's XLA temporaries (``memory_analysis()``); compare with
        ``plan_for(*args).predicted.peak_memory_bytes_per_gpu`` (a plan the planner made: one from explicit counts
        carries no prediction, its ``predicted`` is None). ``between_steps=True``: the bytes per device the step
        holds now, between steps, instead, whatever signature ``args`` have: the constants of every signature built
        and, once a step has run, the gradient accumulators kept for the next (none before the first step or after
        :meth:`release`; a step of another signature takes them over)."""
        executable = self._lookup(args)[0].executable
        if not between_steps:
            return executable.memory_report()
        held: dict[int, int] = {}
        for built in self._cache.values():
            for dev, n in built.executable.held_between_steps().items():
                held[dev] = held.get(dev, 0) + n
        return dict(sorted(held.items()))

    def release(self) -> dict[int, int]:
        """Free the gradient accumulators kept between steps (for every argument signature built); the next step
        allocates new ones, as the first did. Returns the bytes freed per device id. The compiled programs stay.
        (A step of another signature than the last frees the last one's by itself.)"""
        freed: dict[int, int] = {}
        for built in self._cache.values():
            for dev, n in built.executable.release().items():
                freed[dev] = freed.get(dev, 0) + n
        return dict(sorted(freed.items()))

    @_no_context_mesh
    def executable_for(self, *args) -> Executable:
        """The built instruction list, every program compiled (for inspection and benchmarks)."""
        return self._lookup(args)[0].executable.resolve()



def _check_launched_processes_joined() -> None:
    """A process started by ``autopp launch`` (which sets ``$AUTOPP_NUM_PROCESSES``) that never joined the run would
    train alone on its own devices, as would every other: refuse, naming the missing call."""
    launched = os.environ.get("AUTOPP_NUM_PROCESSES", "")
    if launched.isdigit() and int(launched) > 1 and jax.process_count() == 1:
        raise ValueError(
            f"autopp.parallelize: this process was started as one of {launched} (autopp launch sets "
            "$AUTOPP_NUM_PROCESSES) but has not joined them, so each would train alone on its own devices. Call "
            "autopp.distributed.initialize() first thing in the program, before any other JAX call.")


def _check_donated_distinct(built: Built, flat: list) -> None:
    """Refuse, before anything runs, a donated argument whose leaves share an array (its buffer would be consumed
    twice: the step would fail midway, having consumed others), or one that an argument not donated passes too
    (the step would read a buffer it consumed, as ``jax.jit`` refuses ``f(donate(a), a)``)."""
    arrays = [flat[i] for i in built.donated if isinstance(flat[i], jax.Array)]
    if not arrays:
        return
    donated_ids = {id(flat[i]): i for i in built.donated}
    donated = set(built.donated)
    for i, x in enumerate(flat):
        if id(x) in donated_ids and i not in donated and isinstance(x, jax.Array):
            names = built.traced.leaf_paths
            raise ValueError(
                f"autopp.parallelize: {names[donated_ids[id(x)]]}, which the step donates (donate_argnums), is the "
                f"same array as {names[i]}, which it does not: the step would read a buffer it consumed. Pass a copy "
                "to one of them (e.g. jnp.array(x, copy=True)), or do not donate that argument. Nothing was run.")
    if len({id(x) for x in arrays}) == len(arrays):
        return
    first: dict[int, int] = {}
    for i in built.donated:
        if isinstance(flat[i], jax.Array) and first.setdefault(id(flat[i]), i) != i:
            names = built.traced.leaf_paths
            raise ValueError(
                f"autopp.parallelize: {names[first[id(flat[i])]]} and {names[i]} are the same array, in arguments "
                "the step donates (donate_argnums): its buffer would be consumed twice. Give each leaf an array of "
                "its own (e.g. jnp.array(x, copy=True)), or do not donate that argument. Nothing was run.")


def _check_runnable(flat, who: str) -> None:
    abstract = sum(isinstance(x, jax.ShapeDtypeStruct) for x in flat)
    if abstract:
        raise TypeError(f"autopp.parallelize: {who}(...) runs the step, but {abstract} argument leaf(s) are "
                        "jax.ShapeDtypeStruct (shapes without values). Pass arrays; to plan or size a step without "
                        "running it, use step.plan_for(...) or step.memory_report(...), which take either.")


def _check_arity(step_fn, args) -> None:
    """The step called with arguments its signature does not take: said as such (tracing it would fail later, on
    whichever leaf the missing argument shifted into the batch's place)."""
    import inspect

    try:
        signature = inspect.signature(step_fn)
    except (TypeError, ValueError):  # no signature to read (a builtin, a C function): tracing will tell
        return
    try:
        signature.bind(*args)
    except TypeError as e:
        raise TypeError(f"autopp.parallelize: the step {getattr(step_fn, '__name__', step_fn)}{signature} was given "
                        f"{len(args)} positional argument(s): {e}. Pass the step's arguments, as it takes them, to "
                        "the call (and to plan_for, memory_report, trace).") from None


def _usable_donations(donated: frozenset[int], traced) -> frozenset[int]:
    """The donated leaves whose buffers a result of the step can take, as ``jax.jit`` decides: each donated input, in
    order, takes a result of its shape and dtype that no earlier one took. The others are left to the caller, with
    jit's warning (a step that returns no new parameters: deleting them would lose them)."""
    if not donated:
        return donated
    free = collections.Counter((a.shape, a.dtype) for a in traced.jaxpr.out_avals)
    in_avals = traced.jaxpr.in_avals
    usable, unusable = set(), []
    for i in sorted(donated):
        key = (in_avals[i].shape, in_avals[i].dtype)
        if free[key] > 0:
            free[key] -= 1
            usable.add(i)
        else:
            unusable.append(in_avals[i].str_short())
    if unusable:
        warnings.warn(f"autopp.parallelize: some donated buffers were not usable (no result of the step has their "
                      "shape and dtype), so they are left to the caller, as jax.jit leaves them: "
                      f"{', '.join(unusable)}. Donate only arguments the step returns new values of (donate_argnums).",
                      stacklevel=user_stacklevel())
    return frozenset(usable)


def _leaf_signature(x) -> tuple:
    """A step argument's shape, dtype and weak type (a Python float takes the dtype of what it meets, as in
    ``jax.jit``), the part of the signature a build depends on (fast for arrays)."""
    if isinstance(x, jax.Array) and getattr(x, "weak_type", None) is False:  # (typed PRNG keys have none)
        return x.shape, x.dtype, False
    return np.shape(x), jax.numpy.result_type(x), is_weak(x)


@overload
def parallelize(step_fn: Callable[_P, _R], /) -> Parallelized[_P, _R]: ...


@overload
def parallelize(
    *,
    num_stages: int | None = None,
    num_microbatches: int | None = None,
    schedule: str | Schedule | None = None,
    devices: Sequence[jax.Device] | Sequence[Sequence[jax.Device]] | None = None,
    batch_argnums: int | Sequence[int] | None = None,
    loss_reduction: str | None = None,
    plan: Plan | str | None = None,
    virtual_stages: int | None = None,
    recompute: str | Sequence[str] | None = None,
    layout: dict[str, int] | Sequence[dict[str, int]] | None = None,
    compilation_cache: str | bool | None = None,
    donate_argnums: int | Sequence[int] | None = None,
    zero1: bool | None = None,
) -> Callable[[Callable[_P, _R]], Parallelized[_P, _R]]: ...


def parallelize(step_fn=None, /, *, num_stages=None, num_microbatches=None, schedule=None, devices=None,
                batch_argnums=None, loss_reduction=None, plan=None, virtual_stages=None, recompute=None,
                layout=None, compilation_cache=None, donate_argnums=None, zero1=None):
    """Run a training step as an MPMD pipeline over ``devices``.

    The step must take its gradient with :func:`autopp.grad` / :func:`autopp.value_and_grad`. The loss's
    forward computation is split automatically into ``num_stages`` stages (balanced by FLOPs, cut where
    the fewest activation bytes cross; by measured layer times when planned, see below); each stage runs on
    ``len(devices) // num_stages`` devices; the batch (argument ``batch_argnums``, default the last
    positional one) is split into ``num_microbatches`` along axis 0 of every leaf, and microbatch losses and
    gradients are combined with ``loss_reduction``: ``"mean"`` or ``"sum"``, by default read off the loss's program
    (a loss divided by its own number of examples is averaged, one that adds them up summed; ``"mean"`` where it
    cannot be told), so that the step returns what ``jax.jit`` of it does. Everything after the gradient runs
    on the stages that own the parameters. ``plan`` (a :class:`Plan` or a JSON path from ``plan.to_json``)
    replays a saved plan exactly: its stages, devices, microbatches and schedule; it is refused for another
    step or devices.

    With none of ``num_stages``, ``schedule`` and ``plan`` given, they are planned (a ``num_microbatches`` given is
    kept) for ``devices`` on the first call (or :meth:`Parallelized.plan_for`) for each argument shape: the step is
    profiled with its layers timed on the local device (:func:`autopp.profiler.profile` with
    ``measure=True``, cached under ``$XDG_CACHE_HOME/autopp``), and
    :func:`autopp.planner._local.plan_local` picks the stage count (a divisor of the device count, each stage
    data-parallel over the rest), the microbatch count, the schedule (GPipe or 1F1B) and the stage split with
    the smallest predicted step time; the plan records the split in profile layers, the prediction and the
    planner's statistics. A ValueError says why when no layout is legal or fits the devices' memory.
    Giving ``num_stages`` or ``schedule`` skips the planner; the others default to ``num_stages`` = number of devices,
    ``num_microbatches`` = the largest divisor of the batch size that is at most ``2 * num_stages``,
    ``schedule="1f1b"``. ``devices`` defaults to ``jax.devices()``, split into equal groups, or is one list of
    devices per group. ``layout`` gives each stage's mesh, ``{"data": d, "fsdp": f, "tensor": t}`` with
    ``d * f * t`` its device count (one dict for all groups or one per group): FSDP shards parameters, gradients
    and optimizer state (ZeRO-3), tensor splits matmuls as Megatron does (read off the jaxpr); ``zero1=True``
    shards the optimizer state over the data axis too (ZeRO-1: parameters and gradients stay whole there). The step
    returns
    each parameter and optimizer state on its stage's devices; :func:`gather` puts them on one device for plain
    JAX.

    ``schedule`` is a name (``"gpipe"``, ``"1f1b"``, ``"interleaved-1f1b"`` with ``virtual_stages=v`` model
    chunks per device group (default 2), ``"zb-h1"``, ``"dualpipev"``: two chunks per group), a
    :class:`autopp.runtime.Schedule`, or its text (one row of
    actions such as ``0F0 1F0 1B0 0B0`` per device group; ``I``/``W`` split a backward into input and weight
    gradients). ``num_stages`` counts device groups; with several model chunks per group the model is split into
    ``num_stages * virtual_stages`` stages (chunk ``c`` on the group whose schedule row runs it). ``recompute``
    (``"none"``, ``"full"``, ``"selective"``, or one per stage) recomputes activations in the backward.

    Compiled stage programs persist in JAX's persistent compilation cache, so a second process on the same plan
    loads them instead of compiling: ``compilation_cache`` is its directory (default: JAX's configured one, else
    ``$XDG_CACHE_HOME/autopp/xla``; ``False`` leaves JAX's configuration alone).

    ``donate_argnums`` (as for ``jax.jit``): positional arguments whose buffers the step may reuse for its results,
    typically the parameters and optimizer state (``donate_argnums=(0, 1)`` for ``step(params, opt_state, batch)``);
    the caller must not use them after the call. Each stage's update then writes the new state into the old one's
    buffers instead of holding both. The batch is never donated.

    Usable bare (``@autopp.parallelize``) or with keywords (``@autopp.parallelize(num_stages=4)``).
    """
    config = ParallelizeConfig(num_stages=num_stages, num_microbatches=num_microbatches, schedule=schedule,
                               devices=devices, batch_argnums=batch_argnums, loss_reduction=loss_reduction, plan=plan,
                               virtual_stages=virtual_stages, recompute=recompute, layout=layout,
                               compilation_cache=compilation_cache, donate_argnums=donate_argnums, zero1=zero1)
    if step_fn is None:
        return lambda f: _wrap(f, config)
    return _wrap(step_fn, config)


def _wrap(step_fn, config: ParallelizeConfig) -> Parallelized:
    if not callable(step_fn):
        raise TypeError(f"autopp.parallelize: expected a callable training step, got {type(step_fn).__name__}.")
    return Parallelized(step_fn, config)


def gather(tree, device: jax.Device | jax.sharding.Sharding | None = None):
    """``tree`` with every ``jax.Array`` leaf on ``device`` (default: the first device), for plain JAX after a
    pipelined step: the step returns each parameter and optimizer state on its own stage's devices (where the next
    step wants it), and ``jax.jit``, eager operations or a Flax/Equinox module merged from such leaves refuse
    arrays on different devices. ``device`` may also be a ``jax.sharding.Sharding`` (e.g. replicated over a mesh
    for evaluation). Other leaves are returned as they are. In a multi-process run use
    :func:`autopp.distributed.gather`, which brings a value held by another process to every process."""
    if jax.process_count() > 1:
        raise ValueError("autopp.gather moves arrays between this process's devices; in a multi-process run use "
                         "autopp.distributed.gather(x) for each output, which fetches values other processes hold.")
    target = jax.devices()[0] if device is None else device
    if not isinstance(target, (jax.Device, jax.sharding.Sharding)):
        raise TypeError(f"autopp.gather: device must be a jax.Device or a jax.sharding.Sharding, got "
                        f"{type(target).__name__} {target!r:.60}; pass e.g. device=jax.devices()[0].")
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    moved = iter(jax.device_put([x for x in leaves if isinstance(x, jax.Array)], target))
    return jax.tree_util.tree_unflatten(treedef, [next(moved) if isinstance(x, jax.Array) else x for x in leaves])

"""The passes from the laid-out step to the one that runs: each takes a :class:`Program` and returns one.

``reuse_accumulators`` (gradient buffers handed from one step to the next), ``localize`` (a process's own tasks
in a multi-process run), ``insert_frees`` (a buffer dropped right after its last use) and ``compile`` (every
jitted program compiling, programs equal up to their devices once). :class:`Compiler` lowers programs while the
step is laid out and starts compiling each at once, so compilation overlaps the rest of the build.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import hashlib
import os
import threading
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from autopp.core import (DeviceMapped, device_free_key, device_list, is_local, lowered_devices, map_sharding, retarget,
                         serialize_compiled)

from autopp.runtime._tasks import Program, Task, give_back, sds


# -- compilations that other devices can reuse -------------------------------------------------------------
_from_cache = threading.local()


def _note_cache_hit(event: str, **_) -> None:
    if event == "/jax/compilation_cache/cache_hits":  # recorded by the thread that compiles
        _from_cache.hit = True


_listening = []


@dataclasses.dataclass(eq=False)
class CompiledProgram:
    """A compiled program and what loads it onto other devices (:meth:`serialized_form`)."""

    compiled: Any
    key: Any = None
    """The program's device-free key (where its serialized form is stored)."""
    serialized: bytes | None = b""
    """The executable as compiled in this or an earlier process; ``b""``: not serialized yet; None: no complete
    serialized form exists (JAX's persistent cache served the program and no earlier process stored its
    serialized form), so other devices compile it."""

    def serialized_form(self) -> bytes | None:
        """The serialized executable, made (and stored for later processes) on first use; None if there is none."""
        if self.serialized == b"":
            try:
                self.serialized = serialize_compiled(self.compiled)
            except Exception:  # noqa: BLE001 - not serializable (callbacks, effects): other devices compile it
                self.serialized = None
                return None
            _store(_store_path(self.key), self.serialized)
        return self.serialized


def _store_path(key) -> str | None:
    """Where the serialized executable of a program with device-free ``key`` is kept between processes: beside
    JAX's persistent compilation cache, when one is configured."""
    base = jax.config.jax_compilation_cache_dir
    if not base or key is None or not isinstance(key, tuple):
        return None
    ident = repr((key, jax.__version__, jax.devices()[0].device_kind, os.environ.get("XLA_FLAGS", "")))
    return os.path.join(base, "autopp-serialized", hashlib.sha256(ident.encode()).hexdigest())


def _store(path: str | None, data: bytes) -> None:
    if path is None:
        return
    try:  # written whole, then renamed: a concurrent reader sees all of it or nothing
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except OSError:
        pass


def compile_reusable(lowered, key) -> CompiledProgram:
    """Compile ``lowered`` through JAX (so its persistent compilation cache serves it when configured). Loading it
    onto other devices needs a complete serialized form: this compilation's own (made when first needed and then
    stored beside the cache), or, when JAX's cache served the program, the one an earlier process stored (a
    program loaded from serialized form serializes incompletely on CPU, see
    :func:`autopp.core.serialize_compiled`)."""
    if not _listening:
        jax.monitoring.register_event_listener(_note_cache_hit)
        _listening.append(True)
    _from_cache.hit = False
    compiled = lowered.compile()
    if not _from_cache.hit:
        return CompiledProgram(compiled, key)
    try:
        with open(_store_path(key), "rb") as f:
            return CompiledProgram(compiled, key, f.read())
    except (OSError, TypeError):
        return CompiledProgram(compiled, key, None)


def _mapped_aval(aval, devmap):
    sharding = getattr(aval, "sharding", None)
    return aval if sharding is None else sds(aval, map_sharding(sharding, devmap))


class MappedLowered:
    """What the build reads of a lowered program (its devices, argument and output types) for ``source``'s program
    on the devices ``devmap`` maps its own to (a :class:`~autopp.core.DeviceMapped` program): nothing is traced or
    lowered for it. It compiles as ``source`` does, and the executable is loaded onto its devices; ``real()``
    lowers the program for its own devices, for when that cannot be done."""

    def __init__(self, source, devmap: dict, real):
        self.source, self._real = source, real
        self.mapped_devices = device_list(devmap[d] for d in lowered_devices(source))
        self.args_info, self.out_tree = source.args_info, source.out_tree
        self.out_info = jax.tree.map(lambda a: _mapped_aval(a, devmap), source.out_info)

    def compile(self):
        return self._real().compile()

    def as_text(self) -> str:
        return self._real().as_text()


_in_flight: dict[Any, concurrent.futures.Future] = {}
"""Device-free key -> its compilation while it runs, whichever :class:`Compiler` started it: a step built again
(another signature, a replayed plan) while the first build still compiles waits for those compilations instead of
compiling the same programs beside them (and reading JAX's persistent cache entries while they are being written,
which JAX reports as unreadable: it writes them in place)."""
_in_flight_lock = threading.Lock()


def _forget(key, future) -> None:
    with _in_flight_lock:
        if _in_flight.get(key) is future:
            del _in_flight[key]


class Compiler:
    """Lowers each distinct (program, input types) once and starts compiling it on a thread pool (XLA compiles
    without the GIL); a program equal up to its devices to one already compiling (here or in another build of this
    process) is not compiled again (the ``compile`` pass loads that executable onto its devices), nor is another
    process's."""

    def __init__(self):
        self._lowered: dict[tuple, Any] = {}  # (program id, input types) -> lowered
        self._keep_alive: list = []  # keeps program ids unique while building
        self._keys: dict[int, Any] = {}  # id(lowered) -> its device-free key (None: no key)
        self._compiling: dict[Any, concurrent.futures.Future] = {}  # device-free key (or id) -> compilation
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None

    def lower(self, fn, in_avals):
        key = (id(fn), tuple(in_avals))
        lowered = self._lowered.get(key)
        if lowered is None:
            lowered = self._lowered[key] = (self._lower_mapped(fn, in_avals) if isinstance(fn, DeviceMapped)
                                            else fn.lower(*in_avals))
            self._keep_alive.append(fn)
            key = self._key(lowered)
            if key not in self._compiling and is_local(lowered):  # another process's stage: not compiled here
                self._compiling[key] = self._submit(lowered)
        return lowered

    def _lower_mapped(self, fn: DeviceMapped, in_avals):
        """A program of another stage on this stage's devices: the source lowered for the arguments mapped back to
        its devices (once for all stages that run it), read as this stage's (:class:`MappedLowered`)."""
        inverse = {b: a for a, b in fn.devmap.items()}
        try:
            source_avals = [_mapped_aval(a, inverse) for a in in_avals]
        except (KeyError, TypeError):  # an argument on other devices or of a layout not mapped: lower its own
            return fn.real().lower(*in_avals)
        source = self.lower(fn.source, source_avals)
        devices = lowered_devices(source)
        if devices is None or any(d not in fn.devmap for d in devices):  # (a program without arguments, e.g. an
            return fn.real().lower(*in_avals)  # empty backward, lowers on the default device, which no map names)
        return MappedLowered(source, fn.devmap, lambda: fn.real().lower(*in_avals))

    def future(self, lowered) -> concurrent.futures.Future:
        """The compilation of ``lowered`` or of a program equal to it up to devices (started now if none is)."""
        key = self._key(lowered)
        if key not in self._compiling:  # its equal was another process's: compile it here
            self._compiling[key] = self._submit(lowered)
        return self._compiling[key]

    @property
    def num_compiled(self) -> int:
        return len(self._compiling)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)  # queued compilations still run; the threads end after them
            self._pool = None

    def _key(self, lowered):
        if isinstance(lowered, MappedLowered):
            return self._key(lowered.source)
        if id(lowered) not in self._keys:
            self._keys[id(lowered)] = device_free_key(lowered)
        key = self._keys[id(lowered)]
        return key if key is not None else id(lowered)

    def _submit(self, lowered) -> concurrent.futures.Future:
        key = self._key(lowered)
        shared = isinstance(key, tuple)  # (not an id: a program without a device-free key is this build's alone)
        with _in_flight_lock:
            running = _in_flight.get(key) if shared else None
            if running is not None:
                return running
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1)
            future = self._pool.submit(compile_reusable, lowered, key)
            if shared:
                _in_flight[key] = future
        if shared:
            future.add_done_callback(lambda f: _forget(key, f))
        return future


def retarget_or_none(program: CompiledProgram, lowered):
    """:func:`autopp.core.retarget` of ``program`` onto ``lowered``'s devices, or None where it reports that the
    executable cannot serve them (``ValueError``: callbacks or effects, another device count, no complete
    serialized form). Anything else propagates."""
    try:
        return retarget(program.compiled, lowered, serialized=program.serialized_form)
    except ValueError:
        return None


class _Deferred:
    """A program still compiling (a future of :func:`compile_reusable`): calling it waits for the executable,
    moves it onto the lowered program's devices if it was compiled for others, and runs it."""

    __slots__ = ("compiled", "future", "lowered")

    def __init__(self, future: concurrent.futures.Future, lowered):
        self.future, self.lowered, self.compiled = future, lowered, None

    def get(self):
        if self.compiled is None:
            moved = retarget_or_none(self.future.result(), self.lowered)
            self.compiled = moved if moved is not None else self.lowered.compile()  # not movable: compile here
        return self.compiled

    def __call__(self, *args):
        return self.get()(*args)


# -- the passes -----------------------------------------------------------------------------------------
def reuse_accumulators(program: Program, compiler: Compiler) -> Program:
    """Hand each stage's final gradient accumulators, once the step is done with them, to the next step's
    start, so that no program makes zeros and no zero fill runs (the first accumulation ignores the
    buffers' contents): a ``give back`` task per stage at the end of the list. Between steps the reused buffers
    stay allocated (the size of the stage's parameters); the step's peak is unchanged, as they are live through
    it anyway.

    Two kinds of stage start from a compiled zero program instead: one whose gradients the step returns
    (the caller owns them), and one whose gradients another process receives (a shared parameter's
    contribution: a cross-process send may still be reading the buffer when the next step's backward
    takes it over)."""
    tasks = list(program.tasks)
    for acc in program.accumulators:
        final, task = set(acc.end), tasks[acc.task]
        if final & program.output_slots or _sent_to_other_processes(program, final):
            avals = [program.slot_avals[i] for i in acc.start]
            fn = zeros_program(avals, [a.sharding for a in avals])
            tasks[acc.task] = dataclasses.replace(task, fn=fn, label=f"zero gradients stage {acc.stage}",
                                                  lowered=compiler.lower(fn, []))
            continue
        tasks.append(Task(give_back(task.fn), tuple(acc.end), (), f"keep gradient buffers stage {acc.stage}",
                          devices=task.devices))
    return dataclasses.replace(program, tasks=tuple(tasks))


def _sent_to_other_processes(program: Program, slots: set[int]) -> bool:
    for task in program.tasks:
        for slot, dst in zip(task.ins, getattr(task.fn, "shardings", ())):
            src = getattr(program.slot_avals[slot], "sharding", None) if slot in slots else None
            if src is not None and ({d.process_index for d in src.device_set}
                                    != {d.process_index for d in dst.device_set}):
                return True
    return False


def localize(program: Program, stage_devices: Sequence[Sequence[jax.Device]], processes=None) -> Program:
    """In a multi-process run, the tasks this process issues: its own, and every cross-process transfer (in the
    same order on every process); see :mod:`autopp.runtime._multiprocess`. ``processes``: a
    :class:`~autopp.runtime._multiprocess.Processes` (default: this run's). The program itself with one process."""
    from autopp.runtime._multiprocess import Processes, localize_tasks

    processes = processes if processes is not None else Processes.current()
    if processes.count == 1:
        return program
    return localize_tasks(program, stage_devices, processes)


def insert_frees(program: Program) -> Program:
    """Each slot freed by the task that reads it last (or, never read, by the task that makes it); constants and
    outputs are never freed."""
    last = {}
    for t, task in enumerate(program.tasks):
        for i in task.ins:
            last[i] = t
        for o in task.outs:
            last.setdefault(o, t)
    keep = program.kept
    frees = collections.defaultdict(list)
    for slot, t in last.items():
        if slot not in keep:
            frees[t].append(slot)
    return dataclasses.replace(program, tasks=tuple(dataclasses.replace(task, frees=tuple(frees.get(t, ())))
                                                    for t, task in enumerate(program.tasks)))


def compile(program: Program, compiler: Compiler) -> Program:  # noqa: A001 - the pass's name
    """Point each task at its program. Each distinct (program, input types) compiles once, concurrently,
    from the moment it was lowered; programs equal up to their devices (equal stages on other devices)
    compile once and the others load that executable onto their own devices
    (:func:`autopp.core.retarget`). Nothing waits here: a task whose program is still compiling waits
    when the first step reaches it (:class:`_Deferred`), so the first step's early tasks run while the
    later programs compile."""
    deferred: dict[int, _Deferred] = {}
    tasks = []
    for task in program.tasks:
        if task.lowered is not None:
            d = deferred.get(id(task.lowered))
            if d is None:
                d = deferred[id(task.lowered)] = _Deferred(compiler.future(task.lowered), task.lowered)
            task = dataclasses.replace(task, fn=d, lowered=None)
        tasks.append(task)
    compiler.close()
    return dataclasses.replace(program, tasks=tuple(tasks), num_compiled=compiler.num_compiled)


def zeros_program(avals, shardings):
    return jax.jit(lambda: tuple(jnp.zeros(a.shape, a.dtype) for a in avals), out_shardings=tuple(shardings))


def sum_program(n, sharding):
    return jax.jit(lambda *xs: (sum(xs[1:], xs[0]),), out_shardings=(sharding,))

"""The step as a list of tasks over a slot array, and the transfers among them.

A :class:`Task` reads input slots, writes output slots and drops the slots after which nothing reads them.
Its ``fn`` is a jitted program (compiled by the ``compile`` pass), or a :class:`Transfer`: a move, placement or
hand-over of arrays that runs no XLA program of its own and knows, when made, the types it produces.
:class:`TaskList` appends tasks while the step is laid out; :class:`Program` is the finished list, which the
passes of :mod:`autopp.runtime._passes` take and return.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from autopp.core import copy_shards, same_shard_positions


@dataclasses.dataclass(frozen=True)
class Task:
    fn: Callable
    """A jitted program (before ``compile``), a compiled or compiling program (after), or a :class:`Transfer`."""
    ins: tuple[int, ...]
    outs: tuple[int, ...]
    label: str
    frees: tuple[int, ...] = ()
    """Slots dropped after the task (set by ``insert_frees``)."""
    devices: frozenset[int] = frozenset()
    """Ids of the devices the task's outputs live on (where it runs, for a timeline)."""
    processes: frozenset[int] = frozenset()
    """In a multi-process run: the processes that issue the task (every one for a cross-process transfer)."""
    lowered: Any = None
    """The lowered program of a jitted ``fn`` for the task's input types (None for a transfer, and after
    ``compile``)."""
    donated: tuple[int, ...] = ()
    """Input slots whose buffers the program donates to its outputs (arguments given in ``donate_argnums``): dead
    once the task starts."""


@dataclasses.dataclass(frozen=True, eq=False)
class Transfer:
    """A task's work that is no XLA program: ``call(*arrays) -> arrays``. ``out_avals``: the types (with
    shardings) of what it returns, known when it is made."""

    kind: str
    """``put``, ``place``, ``place local``, ``view``, ``assemble``, ``buffers``, ``give back`` or ``cross``."""
    call: Callable[..., Sequence[Any]]
    out_avals: tuple = ()
    shardings: tuple = ()
    """Destination shardings, one per input (``put``, ``place``)."""
    pool: list | None = None
    """``buffers``: the buffers a ``give back`` task returned last (at most one list)."""

    def __call__(self, *xs):
        return self.call(*xs)


@dataclasses.dataclass(frozen=True)
class Accumulators:
    """A stage's gradient accumulators: made by task ``task`` into slots ``start``, final in slots ``end``."""

    stage: int
    task: int
    start: tuple[int, ...]
    end: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Program:
    """A step's task list and what running it needs: the state the passes hand on."""

    tasks: tuple[Task, ...]
    num_slots: int
    slot_avals: Mapping[int, Any]
    """Type (with sharding where known) of every slot's value."""
    input_slots: tuple[int, ...]
    """Where the step's flat inputs go."""
    const_slots: tuple[tuple[int, Any], ...]
    """(slot, value) set before every step (never freed)."""
    output_slots: frozenset[int]
    """Slots the step returns (never freed)."""
    outputs: tuple[Callable, ...]
    """``env -> value`` of each flat step output."""
    accumulators: tuple[Accumulators, ...] = ()
    num_compiled: int | None = None
    """How many programs XLA compiles (set by ``compile``)."""

    @property
    def kept(self) -> frozenset[int]:
        """Slots no task frees: constants and outputs."""
        return frozenset(s for s, _ in self.const_slots) | self.output_slots

    def describe(self) -> list[str]:
        return [t.label for t in self.tasks]


def sds(aval_like, sharding) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(aval_like.shape, aval_like.dtype, sharding=sharding,
                                weak_type=getattr(aval_like, "weak_type", False))


class TaskList:
    """Appends tasks while the step is laid out: slots, their types and constants. Jitted programs are lowered
    (``lower(fn, in_avals) -> Lowered``, which also starts compiling them) to learn what they return."""

    def __init__(self, lower: Callable[[Any, list], Any]):
        self.tasks: list[Task] = []
        self.slot_avals: dict[int, Any] = {}
        self.const_slots: list[tuple[int, Any]] = []
        self.num_slots = 0
        self._lower = lower

    def new_slot(self, aval=None) -> int:
        self.num_slots += 1
        if aval is not None:
            self.slot_avals[self.num_slots - 1] = aval
        return self.num_slots - 1

    def avals(self, slots) -> list:
        return [self.slot_avals[i] for i in slots]

    def emit(self, fn, ins, n_out, label, donated=()) -> list[int]:
        """Append a task; a jitted program is lowered now for its input types. ``donated``: the input slots the
        program donates (it was jitted with their positions in ``donate_argnums``); by default read off the lowered
        program (a backward's gradient accumulators)."""
        lowered = None
        if isinstance(fn, Transfer):
            out_avals = list(fn.out_avals)
        else:
            lowered = self._lower(fn, self.avals(ins))
            out_avals = jax.tree.leaves(lowered.out_info)
            assert all(a.sharding is not None for a in out_avals), f"{label}: every output needs a sharding"
            if not donated:
                flags = [getattr(a, "donated", False) for a in jax.tree.leaves(lowered.args_info)]
                donated = [slot for slot, flag in zip(ins, flags) if flag] if len(flags) == len(ins) else ()
        assert len(out_avals) == n_out, (label, len(out_avals), n_out)
        outs = [self.new_slot(a) for a in out_avals]
        self.tasks.append(Task(fn, tuple(ins), tuple(outs), label, devices=devices_of(out_avals),
                               lowered=lowered, donated=tuple(donated)))
        return outs

    def const(self, value) -> int:
        """A slot holding ``value`` (a device array made at build time) in every step."""
        s = self.new_slot(jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=value.sharding))
        self.const_slots.append((s, value))
        return s

    def program(self, input_slots, output_slots, outputs, accumulators=()) -> Program:
        return Program(tasks=tuple(self.tasks), num_slots=self.num_slots, slot_avals=dict(self.slot_avals),
                       input_slots=tuple(input_slots), const_slots=tuple(self.const_slots),
                       output_slots=frozenset(output_slots), outputs=tuple(outputs),
                       accumulators=tuple(accumulators))


def devices_of(avals) -> frozenset[int]:
    return frozenset(d.id for a in avals if getattr(a, "sharding", None) is not None for d in a.sharding.device_set)


# -- transfers ---------------------------------------------------------------------------------------
def sharding_matcher(expected) -> Callable[[int, Any], bool]:
    """``matches(i, x)``: whether ``x`` is a ``jax.Array`` laid out as ``expected[i]``. A step's outputs carry their
    program's sharding objects, so after one equality test per new object the test is one of identity (~0.1 us
    against ~50 us for comparing two NamedShardings)."""
    expected = list(expected)
    seen = [None] * len(expected)  # per position: the last sharding object found equal to the expected one

    def matches(i, x) -> bool:
        got = getattr(x, "sharding", None) if isinstance(x, jax.Array) else None
        if got is None:
            return False
        if got is seen[i]:
            return True
        if got == expected[i]:
            seen[i] = got
            return True
        return False

    return matches


def delete_unless_shared(x, copies) -> None:
    """Delete donated array ``x`` once ``copies`` of it are made, unless one of them holds one of its buffers
    (``jax.device_put`` onto a device that already has the array may reuse its buffer instead of copying). A deleted
    or unreadable ``x`` is left alone."""
    try:
        if x.is_deleted():
            return
        mine = {s.data.unsafe_buffer_pointer() for s in x.addressable_shards}
        if any(s.data.unsafe_buffer_pointer() in mine for y in copies for s in y.addressable_shards):
            return
    except Exception:  # noqa: BLE001 - a backend without raw pointers: keep it
        return
    x.delete()


def place(in_avals, shardings, donated=()) -> Transfer:
    """Many step inputs placed by one task: only those not already where they belong move, in one transfer call
    (after the first step, parameters and optimizer state are the previous step's outputs, already at home). An
    input at a position in ``donated`` (the caller gave its buffer up, ``donate_argnums``) that moved is deleted
    once its copy is made, as ``jax.jit`` deletes a donated argument: the first step's fresh parameters no longer
    stay alive beside their placed copies."""
    shardings, donated = list(shardings), frozenset(donated)
    at_home = sharding_matcher(shardings)

    def call(*xs):
        move = [i for i, x in enumerate(xs) if not at_home(i, x)]
        if not move:
            return xs
        out = list(xs)
        for i, y in zip(move, jax.device_put([xs[i] for i in move], [shardings[i] for i in move])):
            out[i] = y
        for i in move:
            if i in donated and isinstance(xs[i], jax.Array) and out[i] is not xs[i]:
                delete_unless_shared(xs[i], [out[i]])
        return out

    return Transfer("place", call, tuple(sds(a, sh) for a, sh in zip(in_avals, shardings)), tuple(shardings))


def view(in_aval, sharding, devices) -> Transfer:
    """The shards of a value placed over several stages that lie on one stage's ``devices``, as an array of
    ``sharding``."""
    devset = set(devices)

    def call(x):
        bufs = [s.data for s in x.addressable_shards if s.device in devset]
        return (jax.make_array_from_single_device_arrays(x.shape, sharding, bufs),)

    return Transfer("view", call, (sds(in_aval, sharding),))


def assemble(in_avals, sharding, shape) -> Transfer:
    """One array of ``sharding`` (over several stages' devices) from parts on each stage."""
    me = jax.process_index()

    def call(*parts):
        by_device = {}
        for p in parts:  # parts on stages that share devices hold the same value there
            if p is None:  # multi-process: a part on another process
                continue
            if not p.sharding.is_fully_replicated:  # split on its stage (a value laid out as a parameter, FSDP)
                p = jax.device_put(p, jax.sharding.NamedSharding(p.sharding.mesh, jax.sharding.PartitionSpec()))
            for s in p.addressable_shards:
                by_device.setdefault(s.device, s.data)
        bufs = [by_device[d] for d in sharding.mesh.devices.flat if d.process_index == me]
        return (jax.make_array_from_single_device_arrays(shape, sharding, bufs),)

    return Transfer("assemble", call, (sds(in_avals[0], sharding),))


def put(in_avals, shardings) -> Transfer:
    """A transfer of several arrays to ``shardings``. Where every source holds its shards in the same places
    of its device list as the destination (a stage's output sent to an equal-layout stage), the shards are
    copied device to device by one runtime call (~12 us for 3 arrays, against ~90 us for ``jax.device_put``);
    otherwise, or if the inputs' shardings are not the ones the build saw, ``jax.device_put`` reshards. Typed PRNG
    keys (an extended dtype, which that runtime call does not take) always go through ``jax.device_put``."""
    shardings = list(shardings)
    sources = None
    if in_avals and jax.process_count() == 1 and all(
            getattr(a, "sharding", None) is not None and not jax.dtypes.issubdtype(a.dtype, jax.dtypes.extended)
            and same_shard_positions(a.sharding, sh, a.shape) for a, sh in zip(in_avals, shardings)):
        sources = [a.sharding for a in in_avals]

    if sources is None:
        def call(*xs):
            return jax.device_put(list(xs), shardings)
    else:
        as_built = sharding_matcher(sources)

        def call(*xs):
            if all(as_built(i, x) for i, x in enumerate(xs)):
                return copy_shards(xs, shardings)
            return jax.device_put(list(xs), shardings)

    return Transfer("put", call, tuple(sds(a, sh) for a, sh in zip(in_avals, shardings)), tuple(shardings))


def on_host(x) -> bool:
    """Whether ``x`` is in host memory: a numpy array (or scalar), or an array of the CPU backend that this process
    holds whole (typed PRNG keys excluded: numpy cannot hold them). ``np.asarray`` of such an array copies nothing."""
    if not isinstance(x, jax.Array):
        return True
    return (x.is_fully_addressable and all(d.platform == "cpu" for d in x.devices())
            and not jax.dtypes.issubdtype(x.dtype, jax.dtypes.extended))


def reused_buffers(avals, shardings) -> Transfer:
    """Buffers for ``avals`` at ``shardings``: the ones a :func:`give_back` task returned last, else (the first
    step, or after a step that failed) zeros put from the host, which costs no compilation."""
    pool: list[list] = []
    shardings = list(shardings)

    def call():
        if pool:
            kept = pool.pop()
            if not any(map(_failed, kept)):
                return kept
        return jax.device_put([np.zeros(a.shape, a.dtype) for a in avals], shardings)

    return Transfer("buffers", call, tuple(sds(a, sh) for a, sh in zip(avals, shardings)), tuple(shardings),
                    pool=pool)


def _failed(x) -> bool:
    """Whether ``x`` is a buffer whose computation failed (a host callback raised in the step that made it): reusing it
    would fail every later step. Checked without waiting: one still being computed counts as sound."""
    if not x.is_ready():
        return False
    try:
        x.block_until_ready()
    except Exception:  # noqa: BLE001 - the error of the step that made it, already raised to the caller
        return True
    return False


def give_back(buffers: Transfer) -> Transfer:
    """A task that returns its inputs to ``buffers`` (a :func:`reused_buffers` transfer) for the next step."""
    pool = buffers.pool

    def call(*xs):
        pool[:] = [list(xs)]
        return ()

    return Transfer("give back", call)

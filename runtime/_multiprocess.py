"""The instruction list of one process in a multi-process run (JAX's multi-controller runtime).

Every process builds the same flat task list; :func:`localize` then keeps, once at build time, what this process
issues:

* a task whose outputs live on this process's devices (programs, placement, views of inputs);
* every transfer between processes, issued by *every* process in the same order. A cross-process
  ``jax.device_put`` is matched with its peer by call order, so processes that neither send nor receive make the
  call too (with an empty array; nothing moves for them). It also only moves data between shardings of the same
  layout over the same number of devices, so the sender first reshards locally to a layout the receiver can
  mirror (the receiver's, on as many of its own devices) or the receiver takes the sender's layout on as many of
  its devices and reshards locally afterwards.

Step inputs: every process passes the same full host values (the usual multi-controller convention); each
places only what its own stages need. Step outputs held by another process come back as ``jax.Array``\\ s with
no addressable shards; scalar outputs (loss, metrics) are sent to every process at the end of the step.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from autopp.core import prng_impl
from autopp.runtime._tasks import Program, Task, Transfer, put, sds


@dataclasses.dataclass(frozen=True)
class Processes:
    """The processes of a run as :func:`localize_tasks` sees them: this one (``me``), how many, and the process
    of each device."""

    me: int
    count: int
    of: Callable[[jax.Device], int] = lambda d: d.process_index

    @classmethod
    def current(cls) -> Processes:
        return cls(jax.process_index(), jax.process_count())

    def of_sharding(self, sharding) -> frozenset[int] | None:
        if sharding is None:
            return None
        return frozenset(self.of(d) for d in sharding.device_set)


def _empty(aval, sharding) -> jax.Array:
    """A global array with no shard on this process: the stand-in for a value another process holds (a typed PRNG
    key: for its raw data, which is what crosses)."""
    if _is_key(aval):
        raw = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(aval.shape, aval.dtype))
        return jax.make_array_from_single_device_arrays(tuple(raw.shape), sharding, [], dtype=raw.dtype)
    return jax.make_array_from_single_device_arrays(tuple(aval.shape), sharding, [], dtype=aval.dtype)


def _is_key(aval) -> bool:
    return jax.dtypes.issubdtype(aval.dtype, jax.dtypes.extended)


def mirror(src: NamedSharding, dst: NamedSharding) -> tuple[NamedSharding, NamedSharding]:
    """(sharding the sender sends from, sharding the receiver receives into): the same layout over the same
    number of devices, the first on the sender's devices, the second on the receiver's."""
    src_devs, dst_devs = list(src.mesh.devices.flat), list(dst.mesh.devices.flat)
    if len(src_devs) >= len(dst_devs):
        mesh = Mesh(np.array(src_devs[:len(dst_devs)]).reshape(dst.mesh.devices.shape), dst.mesh.axis_names)
        return NamedSharding(mesh, dst.spec), dst
    mesh = Mesh(np.array(dst_devs[:len(src_devs)]).reshape(src.mesh.devices.shape), src.mesh.axis_names)
    return src, NamedSharding(mesh, src.spec)


@dataclasses.dataclass(frozen=True)
class _Leg:
    index: int
    """Input (and output) position in the task."""
    sender: int
    receiver: int
    send: NamedSharding
    recv: NamedSharding
    dst: NamedSharding
    empty: Any
    """Stand-in for the sent value on processes other than the sender."""
    view: NamedSharding | None = None
    """For an input spanning processes: the sharding of its shards on the sender, taken before sending."""
    copy: bool = False
    """Send a copy: a later program of the step donates the value (a parameter updated in place), and a transfer
    across processes does not keep the buffer it reads alive."""


def _local_view(x, view: NamedSharding | None):
    if view is None:
        return x
    devs = set(view.device_set)
    return jax.make_array_from_single_device_arrays(x.shape, view, [s.data for s in x.addressable_shards
                                                                    if s.device in devs])


def _cross_put(legs: list[_Leg], me: int, in_avals=None) -> Transfer:
    """One batched cross-process transfer; output ``i`` is what leg(s) of input ``i`` deliver here, else input
    ``i`` itself."""
    pre = [k for k, leg in enumerate(legs) if leg.sender == me]
    post = [k for k, leg in enumerate(legs) if leg.receiver == me and leg.recv != leg.dst]
    mine = {leg.index: k for k, leg in enumerate(legs) if leg.receiver == me}
    pairs: dict[tuple[int, int], list[int]] = {}
    for k, leg in enumerate(legs):
        pairs.setdefault((leg.sender, leg.receiver), []).append(k)
    groups = list(pairs.values())
    in_flight: list = []  # the sender's handles of its last sends: a send whose handle is dropped may not arrive
    keys = {k: prng_impl(in_avals[legs[k].index].dtype) for k in range(len(legs))
            if in_avals and _is_key(in_avals[legs[k].index])}

    def cross(*xs):
        sent = [leg.empty for leg in legs]
        if pre:  # sender-local reshard to the mirrored layout (a no-op when it already is)
            ins = [_local_view(xs[legs[k].index], legs[k].view) for k in pre]
            for k, y in zip(pre, jax.device_put(ins, [legs[k].send for k in pre],
                                                may_alias=[None if not legs[k].copy else False for k in pre])):
                sent[k] = jax.random.key_data(y) if k in keys else y  # a typed key crosses as its raw data
        got = [None] * len(legs)
        for group in groups:  # one call per (sender, receiver): calls mixing pairs do not all arrive
            for k, y in zip(group, jax.device_put([sent[k] for k in group], [legs[k].recv for k in group])):
                got[k] = jax.random.wrap_key_data(y, impl=keys[k]) if k in keys else y
        for k in range(len(legs)):
            if legs[k].receiver == me:
                _pending.append(jax.random.key_data(got[k]) if k in keys else got[k])
        _bound_pending()
        if post:  # receiver-local reshard to where the value is used
            for k, y in zip(post, jax.device_put([got[k] for k in post], [legs[k].dst for k in post])):
                got[k] = y
        # the sender keeps both the handles and the buffers it sends from (a reshard's or a copy's, which nothing
        # else holds) until this transfer runs again
        in_flight[:] = [got[k] for k in range(len(legs)) if legs[k].sender == me] + [sent[k] for k in pre]
        return [got[mine[i]] if i in mine else x for i, x in enumerate(xs)]

    return Transfer("cross", cross, tuple(in_avals or ()))


_pending: collections.deque = collections.deque()
"""Values received from other processes, oldest first, until they have arrived."""
MAX_PENDING_RECEIVES = 8
"""Receives from other processes the host lets run ahead of their arrival. Programs that read a value still on its
way queue on their devices behind it, and a device's queue is bounded: with more receives in flight the host
thread was seen to block inside a program's call before issuing a send the other process waited for, and both
waited for ever (``interleaved-1f1b`` with 4 virtual stages across 2 processes: it hangs at 32 and finishes at 16).
Waiting for the oldest receive beyond this bound keeps the host from filling a queue."""


def _bound_pending() -> None:
    """Wait for the oldest receives while more than :data:`MAX_PENDING_RECEIVES` are still on their way."""
    while _pending and _pending[0].is_ready():
        _pending.popleft()
    while len(_pending) > MAX_PENDING_RECEIVES:
        _pending.popleft().block_until_ready()
        while _pending and _pending[0].is_ready():
            _pending.popleft()


def _place_local(in_avals, shardings) -> Transfer:
    """Place step inputs on this process's devices: a sharding that spans processes gets its local shards only
    (no collective: every process passes the same host value)."""
    shardings = list(shardings)

    def place(*xs):
        out = list(xs)
        move = []
        for i, (x, sh) in enumerate(zip(xs, shardings)):
            if isinstance(x, jax.Array) and x.sharding == sh:
                continue
            if sh.is_fully_addressable:
                move.append(i)
            else:
                host = np.asarray(x)
                out[i] = jax.make_array_from_callback(host.shape, sh, lambda idx, host=host: host[idx])
        if move:
            for i, y in zip(move, jax.device_put([xs[i] for i in move], [shardings[i] for i in move])):
                out[i] = y
        return out

    return Transfer("place local", place, tuple(sds(a, sh) for a, sh in zip(in_avals, shardings)), tuple(shardings))




def localize_tasks(program: Program, stage_devices: Sequence[Sequence[jax.Device]],
                   processes: Processes) -> Program:
    """``program``'s tasks (before frees and compilation) reduced to what process ``processes.me`` issues; see
    the module docstring. Programs of other processes are dropped, so they are not compiled here."""
    me, n, of = processes.me, processes.count, processes.of
    everyone = frozenset(range(n))
    for s, devs in enumerate(stage_devices):
        procs = sorted({of(d) for d in devs})
        if len(procs) > 1:
            raise ValueError(
                f"autopp: stage {s} has devices on processes {procs} ({[d.id for d in devs]}); in a multi-process "
                "run each stage's devices must belong to one process. Give each stage devices of one process "
                "(e.g. num_stages a multiple of jax.process_count(), or a plan whose stages stay within a process).")
    local_ids = {d.id for d in jax.devices() if of(d) == me}
    first_device = {}
    for d in jax.devices():
        first_device.setdefault(of(d), d)
    avals = program.slot_avals
    tasks = list(program.tasks)
    donated = {slot for t in tasks for slot in t.donated}

    # Scalar outputs (loss, metrics) held by some processes only: sent to the others at the end of the step.
    for slot in sorted(program.output_slots):
        aval = avals[slot]
        sharding = getattr(aval, "sharding", None)
        if aval.shape != () or sharding is None or processes.of_sharding(sharding) == everyone:
            continue
        holders = processes.of_sharding(sharding)
        owner = min(holders)
        own = NamedSharding(Mesh(np.array([d for d in sharding.mesh.devices.flat if of(d) == owner]),
                                 ("stages",)), P())
        legs = []
        for q in sorted(everyone - holders):
            dst = NamedSharding(Mesh(np.array([first_device[q]]), ("stages",)), P())
            send, recv = mirror(own, dst)
            legs.append(_Leg(0, owner, q, send, recv, dst, _empty(aval, send) if owner != me else None,
                             view=own if sharding != own else None))
        tasks.append(Task(_cross_put(legs, me, [aval]), (slot,), (slot,), f"send scalar output to processes "
                          f"{sorted(everyone - holders)}", devices=frozenset(d.id for d in sharding.device_set)))

    kept: list[Task] = []
    for task in tasks:
        kind = task.fn.kind if isinstance(task.fn, Transfer) else None
        if kind == "put":
            local, legs = [], []
            for i, (slot, dst) in enumerate(zip(task.ins, task.fn.shardings)):
                src = getattr(avals[slot], "sharding", None)
                sp, dp = processes.of_sharding(src), processes.of_sharding(dst)
                if sp is None or sp == dp:  # from a host value, or within one process
                    if me in dp:
                        local.append(i)
                    continue
                assert len(sp) == 1 and len(dp) == 1, (task.label, sp, dp)
                send, recv = mirror(src, dst)
                sender = next(iter(sp))
                legs.append(_Leg(i, sender, next(iter(dp)), send, recv, dst,
                                 _empty(avals[slot], send) if sender != me else None, copy=slot in donated))
            if local:
                kept.append(Task(put([avals[task.ins[i]] for i in local], [task.fn.shardings[i] for i in local]),
                                 tuple(task.ins[i] for i in local), tuple(task.outs[i] for i in local), task.label,
                                 devices=task.devices, processes=frozenset({me})))
            if legs:
                pos = [leg.index for leg in legs]
                legs = [dataclasses.replace(leg, index=k) for k, leg in enumerate(legs)]
                kept.append(Task(_cross_put(legs, me, [avals[task.outs[i]] for i in pos]),
                                 tuple(task.ins[i] for i in pos), tuple(task.outs[i] for i in pos),
                                 f"{task.label} (cross-process)", devices=task.devices, processes=everyone))
        elif kind == "place":
            local = [i for i, sh in enumerate(task.fn.shardings) if any(d.id in local_ids for d in sh.device_set)]
            if local:
                kept.append(Task(_place_local([avals[task.ins[i]] for i in local],
                                              [task.fn.shardings[i] for i in local]),
                                 tuple(task.ins[i] for i in local), tuple(task.outs[i] for i in local), task.label,
                                 devices=task.devices, processes=frozenset({me})))
        elif kind == "cross":
            kept.append(dataclasses.replace(task, processes=everyone))
        elif task.devices & local_ids:
            kept.append(dataclasses.replace(task, processes=frozenset({me})))

    # Outputs another process holds: stand-ins (global arrays without local shards).
    produced = {o for task in kept for o in task.outs} | set(program.input_slots) | {s for s, _ in program.const_slots}
    consts = list(program.const_slots)
    for slot in sorted(program.output_slots - produced):
        consts.append((slot, _empty(avals[slot], avals[slot].sharding)))
    return dataclasses.replace(program, tasks=tuple(kept), const_slots=tuple(consts))

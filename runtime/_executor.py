"""Build a step's instruction list once, then run it: every program dispatched asynchronously.

The builder turns (traced step, stage split, schedule, devices) into a flat list of tasks over a slot
array. Each task is ``(fn, input slots, output slots, slots to free)``; ``fn`` is a jitted program, a
``jax.device_put`` or a placement helper. Running a step is one pass over that list: no tracing, no
compilation after the first call, no host synchronisation; a buffer is dropped right after its last use.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import functools
import os
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex_core

from autopp.core import (
    RECOMPUTE_MODES,
    RECOMPUTE_POLICIES,
    Schedule,
    StagePrograms,
    copy_shards,
    device_free_key,
    dispatch_order,
    eval_jaxpr_with,
    is_local,
    new_jaxpr,
    retarget,
    same_shard_positions,
    stage_graphs,
)
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from autopp.runtime._placement import place_outer
from autopp.profiler import aval_bytes, optimizer_state_owners
from autopp.runtime._tensor import tensor_specs

Literal = jex_core.Literal


@dataclasses.dataclass(frozen=True)
class Task:
    fn: Callable
    ins: tuple[int, ...]
    outs: tuple[int, ...]
    label: str
    frees: tuple[int, ...] = ()
    devices: frozenset[int] = frozenset()
    """Ids of the devices the task's outputs live on (where it runs, for a timeline)."""
    processes: frozenset[int] = frozenset()
    """In a multi-process run: the processes that issue the task (every one for a cross-process transfer)."""


def _vars(atoms):
    return [a for a in atoms if not isinstance(a, Literal)]


MESH_AXES = ("data", "fsdp", "tensor")


class StageMeshes:
    """The devices of each stage, its mesh (axes ``data``, ``fsdp``, ``tensor``) and the shardings the runtime
    uses on them: the batch over ``data`` x ``fsdp``; parameters, their gradients and optimizer state sharded
    over ``fsdp`` (ZeRO-3: XLA gathers a weight where a program needs it whole and reduce-scatters its gradient)."""

    def __init__(self, stage_devices: Sequence[Sequence[jax.Device]],
                 layouts: Sequence[dict[str, int]] | None = None):
        self.devices = [tuple(d) for d in stage_devices]
        self.layouts = []
        for s, devs in enumerate(self.devices):
            lay = dict(layouts[s]) if layouts is not None and layouts[s] else {}
            lay.setdefault("fsdp", 1)
            lay.setdefault("tensor", 1)
            lay.setdefault("data", len(devs) // (lay["fsdp"] * lay["tensor"]))
            self.layouts.append(lay)
        self.meshes = [Mesh(np.array(d).reshape([lay[a] for a in MESH_AXES]), MESH_AXES)
                       for d, lay in zip(self.devices, self.layouts)]
        self.replicated = [NamedSharding(m, P()) for m in self.meshes]
        self._multi: dict[frozenset[int], NamedSharding] = {}

    def batch_sharding(self, loc: int, shape) -> NamedSharding:
        """Leading dim over the stage's data and FSDP axes when it divides evenly (else over as many as divide),
        else replicated."""
        lay = self.layouts[loc]
        if len(shape) >= 1:
            for axes in (("data", "fsdp"), ("data",), ("fsdp",)):
                n = int(np.prod([lay[a] for a in axes]))
                if n > 1 and shape[0] % n == 0:
                    return NamedSharding(self.meshes[loc], P(axes if len(axes) > 1 else axes[0]))
        return self.replicated[loc]

    def sequence_sharding(self, loc: int, shape) -> NamedSharding | None:
        """Sequence parallelism: the batch dimension as :meth:`batch_sharding` lays it out, the second (sequence)
        dimension over the tensor axis; None when the stage has no tensor axis or it does not divide the sequence."""
        t = self.layouts[loc]["tensor"]
        if t == 1 or len(shape) < 2 or shape[1] % t:
            return None
        batch = self.batch_sharding(loc, shape).spec
        return NamedSharding(self.meshes[loc], P(batch[0] if len(batch) else None, "tensor"))

    def state_sharding(self, loc: int, shape, tensor_spec=None, zero: bool = False) -> NamedSharding:
        """Parameters, gradients and optimizer state on stage ``loc``: ``tensor_spec`` (the parameter's split over
        the tensor axis, from the plan or Megatron's column/row rule, see :mod:`autopp.runtime._tensor`), and the
        largest other dimension that the FSDP axis divides sharded over it; with ``zero`` (optimizer state under
        ZeRO-1) the largest remaining dimension the data axis divides is sharded over it too; replicated without
        any."""
        spec = list(tensor_spec) if tensor_spec is not None else [None] * len(shape)
        for axis, on in (("fsdp", True), ("data", zero)):
            n_axis = self.layouts[loc][axis]
            if not on or n_axis == 1:
                continue
            dims = [i for i, n in enumerate(shape) if n % n_axis == 0 and spec[i] is None]
            if dims:
                spec[max(dims, key=lambda i: (shape[i], -i))] = axis
        while spec and spec[-1] is None:
            spec.pop()
        return NamedSharding(self.meshes[loc], P(*spec)) if spec else self.replicated[loc]

    def multi(self, locs: frozenset[int]) -> NamedSharding:
        """Replicated over the devices of several stages (one value kept on all of them)."""
        if locs not in self._multi:  # stages may share devices (several model chunks per device group)
            devs = list(dict.fromkeys(d for loc in sorted(locs) for d in self.devices[loc]))
            self._multi[locs] = NamedSharding(Mesh(np.array(devs), ("stages",)), P())
        return self._multi[locs]


def _sds(aval_like, sharding) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(aval_like.shape, aval_like.dtype, sharding=sharding,
                                weak_type=getattr(aval_like, "weak_type", False))


def _place(shardings):
    """One task placing many step inputs: only those not already where they belong move, in one transfer call
    (after the first step, parameters and optimizer state are the previous step's outputs, already at home)."""
    shardings = list(shardings)

    def place(*xs):
        move = [i for i, (x, sh) in enumerate(zip(xs, shardings))
                if not (isinstance(x, jax.Array) and x.sharding == sh)]
        if not move:
            return xs
        out = list(xs)
        for i, y in zip(move, jax.device_put([xs[i] for i in move], [shardings[i] for i in move])):
            out[i] = y
        return out

    place.out_avals = lambda avals: [_sds(a, sh) for a, sh in zip(avals, shardings)]
    place.shardings = shardings
    return place


def _extract(loc_sharding, loc_devices):
    devset = set(loc_devices)

    def extract(x):
        bufs = [s.data for s in x.addressable_shards if s.device in devset]
        return (jax.make_array_from_single_device_arrays(x.shape, loc_sharding, bufs),)

    extract.out_avals = lambda avals: [_sds(avals[0], loc_sharding)]
    return extract


def _assemble(sharding, shape):
    me = jax.process_index()

    def assemble(*parts):
        by_device = {}
        for p in parts:  # parts on stages that share devices hold the same value there
            if p is None:  # multi-process: a part on another process
                continue
            for s in p.addressable_shards:
                by_device.setdefault(s.device, s.data)
        bufs = [by_device[d] for d in sharding.mesh.devices.flat if d.process_index == me]
        return (jax.make_array_from_single_device_arrays(shape, sharding, bufs),)

    assemble.out_avals = lambda avals: [_sds(avals[0], sharding)]
    return assemble


def _put(shardings):
    """A transfer of several arrays to ``shardings``. Where every source holds its shards in the same places
    of its device list as the destination (a stage's output sent to an equal-layout stage), the shards are
    copied device to device by one runtime call (~12 us for 3 arrays, against ~90 us for ``jax.device_put``);
    otherwise, or if the inputs' shardings are not the ones the build saw, ``jax.device_put`` reshards."""
    shardings = list(shardings)
    sources: list = []

    def put(*xs):
        if sources and all(getattr(x, "sharding", None) == src for x, src in zip(xs, sources)):
            return copy_shards(xs, shardings)
        return jax.device_put(list(xs), shardings)

    def out_avals(avals):
        if jax.process_count() == 1 and all(
                getattr(a, "sharding", None) is not None and same_shard_positions(a.sharding, sh, a.shape)
                for a, sh in zip(avals, shardings)):
            sources[:] = [a.sharding for a in avals]
        return [_sds(a, sh) for a, sh in zip(avals, shardings)]

    put.out_avals = out_avals
    put.shardings = shardings
    return put


@dataclasses.dataclass
class PipelineConfig:
    num_microbatches: int
    loss_reduction: str
    schedule: Schedule
    recompute: tuple[str, ...]
    """Recomputation mode of each stage."""
    param_specs: tuple | None = None
    """Per stage: ``{forward input index: spec}`` (a tuple with ``"tensor"`` where the parameter is split over the
    stage's tensor axis) from a plan, or None for Megatron's rule (:mod:`autopp.runtime._tensor`)."""
    zero1: bool = False
    """Optimizer state sharded over each stage's data axis too (ZeRO-1)."""
    sequence_vars: frozenset = frozenset()
    """Forward activations laid out along their sequence (second) dimension over the stage's tensor axis (sequence
    parallelism: the values between layers); their cotangents follow."""


class _Deferred:
    """A program still compiling (a future of :meth:`jax.stages.Lowered.compile`): calling it waits for the
    executable, moves it onto the lowered program's devices if it was compiled for others, and runs it."""

    __slots__ = ("compiled", "future", "lowered")

    def __init__(self, future: concurrent.futures.Future, lowered):
        self.future, self.lowered, self.compiled = future, lowered, None

    def get(self):
        if self.compiled is None:
            done = self.future.result()
            try:
                self.compiled = retarget(done, self.lowered)
            except Exception:  # noqa: BLE001 - an executable that cannot move is compiled where it runs
                self.compiled = self.lowered.compile()
        return self.compiled

    def __call__(self, *args):
        return self.get()(*args)


class Executable:
    """A built step: call :meth:`run` with the flat step inputs. Its programs may still be compiling when it
    is built; the first step waits for each as it reaches it, and :meth:`resolve` waits for all."""

    def __init__(self, tasks, num_slots, input_slots, const_slots, output_fns, out_tree, description):
        self.tasks = tasks
        self.num_slots = num_slots
        self.input_slots = input_slots
        self.const_slots = const_slots
        self.output_fns = output_fns
        self.out_tree = out_tree
        self.description = description
        self._plain = [(t.fn, t.ins, t.outs, t.frees) for t in tasks]
        self._deferred = any(isinstance(t.fn, _Deferred) for t in tasks)
        self.num_programs = len({id(t.fn) for t in tasks if isinstance(t.fn, (_Deferred, jax.stages.Compiled))})
        """Distinct programs (compiled, loaded onto other devices or still compiling)."""
        self.num_compiled = self.num_programs
        """How many of them XLA compiles (set by the builder: programs equal up to their devices compile once)."""
        self.slot_bytes: dict[int, dict[int, int]] = {}
        """Bytes per device id of each slot's buffer (set by the builder; the step inputs' slots excluded)."""

    def resolve(self) -> Executable:
        """Wait until every program is compiled and point the tasks at the compiled programs (a compilation
        error is raised here). Returns ``self``."""
        if self._deferred:
            self.tasks = [dataclasses.replace(t, fn=t.fn.get()) if isinstance(t.fn, _Deferred) else t
                          for t in self.tasks]
            self._plain = [(t.fn, t.ins, t.outs, t.frees) for t in self.tasks]
            self._deferred = False
        return self

    def run(self, flat_args: Sequence[Any], on_dispatch: Callable[[int, tuple], None] | None = None):
        """Run one step. ``on_dispatch(task index, outputs)``, if given, is called after each task is issued
        (for :func:`autopp.runtime.run_with_timeline`)."""
        if on_dispatch is not None:
            return self._run_observed(flat_args, on_dispatch)
        env: list[Any] = [None] * self.num_slots
        for slot, value in self.const_slots:
            env[slot] = value
        for slot, value in zip(self.input_slots, flat_args):
            env[slot] = value
        for fn, ins, outs_slots, frees in self._plain:
            res = fn(*[env[i] for i in ins])
            for o, r in zip(outs_slots, res):
                env[o] = r
            for f in frees:
                env[f] = None
        if self._deferred:
            self.resolve()
        return [fn(env) for fn in self.output_fns]

    def memory_report(self) -> dict[int, int]:
        """Peak bytes per device id over one step, by the runtime's own accounting: every buffer the instruction
        list holds (placed inputs, constants, activations, residuals, gradient accumulators, results) from the
        task that makes it to the task after which it is dropped, plus each program's XLA temporaries
        (``memory_analysis().temp_size_in_bytes``) while it runs. The step's own inputs are not counted (the
        caller holds them); their placed copies are."""
        self.resolve()
        live: dict[int, int] = collections.defaultdict(int)
        peak: dict[int, int] = collections.defaultdict(int)

        def add(slot, sign):
            for dev, n in self.slot_bytes.get(slot, {}).items():
                live[dev] += sign * n

        for slot, _ in self.const_slots:
            add(slot, 1)
        for task in self.tasks:
            for o in task.outs:
                add(o, 1)
            temp = 0
            analysis = getattr(task.fn, "memory_analysis", None)
            if analysis is not None:
                stats = analysis()
                temp = stats.temp_size_in_bytes if stats is not None else 0
            for dev in task.devices or live:
                peak[dev] = max(peak[dev], live[dev] + temp // max(1, len(task.devices)))
            for f in task.frees:
                add(f, -1)
        return dict(sorted(peak.items()))

    def _run_observed(self, flat_args, on_dispatch):
        env: list[Any] = [None] * self.num_slots
        for slot, value in self.const_slots:
            env[slot] = value
        for slot, value in zip(self.input_slots, flat_args):
            env[slot] = value
        for k, (fn, ins, outs_slots, frees) in enumerate(self._plain):
            res = fn(*[env[i] for i in ins])
            on_dispatch(k, tuple(res))
            for o, r in zip(outs_slots, res):
                env[o] = r
            for f in frees:
                env[f] = None
        if self._deferred:
            self.resolve()
        return [fn(env) for fn in self.output_fns]


class _Builder:
    def __init__(self, traced, forward, split, meshes: StageMeshes, config: PipelineConfig):
        self.traced = traced
        self.forward = forward
        self.jaxpr = traced.jaxpr.jaxpr
        self.outer_consts = dict(zip(self.jaxpr.constvars, traced.jaxpr.consts))
        self.grad = traced.grad_eqn
        self.spec = traced.spec
        self.split = split
        self.meshes = meshes
        self.config = config
        self.S = split.num_stages
        self.M = config.num_microbatches
        self.tasks: list[Task] = []
        self.num_slots = 0
        self.avail: dict[tuple, int] = {}
        self.const_slots: list[tuple[int, Any]] = []
        self.protected: set[int] = set()
        self.slot_aval: dict[int, jax.ShapeDtypeStruct] = {}
        self._seed_cache: dict[tuple, int] = {}
        self.pending: list[tuple[int, int]] = []  # (task index, program index)
        self.lowered: dict[tuple, tuple[int, Any]] = {}  # (program id, input types) -> (index, lowered)
        self._keep_alive: list = []  # keeps program ids unique while building
        self._compiling: dict[Any, concurrent.futures.Future] = {}  # device-free program key -> compile
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._program_keys: dict[int, Any] = {}  # id(lowered) -> its device-free key (lowered kept by self.lowered)

    # -- slots and tasks ---------------------------------------------------------------------
    def new_slot(self) -> int:
        self.num_slots += 1
        return self.num_slots - 1

    def emit(self, fn, ins, n_out, label) -> list[int]:
        """Append a task; jitted programs are lowered now (to learn their outputs) and compiled later."""
        in_avals = [self.slot_aval[i] for i in ins]
        if hasattr(fn, "out_avals"):
            out_avals = fn.out_avals(in_avals)
        else:
            out_avals = self.lower_for(len(self.tasks), fn, in_avals)
            assert all(a.sharding is not None for a in out_avals), f"{label}: every output needs a sharding"
        assert len(out_avals) == n_out, (label, len(out_avals), n_out)
        outs = [self.new_slot() for _ in range(n_out)]
        for o, a in zip(outs, out_avals):
            self.slot_aval[o] = a
        devices = frozenset(d.id for a in out_avals if getattr(a, "sharding", None) is not None
                            for d in a.sharding.device_set)
        self.tasks.append(Task(fn, tuple(ins), tuple(outs), label, devices=devices))
        return outs

    def lower_for(self, t: int, fn, in_avals) -> list:
        """Lower jitted ``fn`` for task ``t`` (once per input types), start compiling it; its output avals."""
        key = (id(fn), tuple(in_avals))
        if key not in self.lowered:
            lowered = fn.lower(*in_avals)
            self.lowered[key] = (len(self.lowered), lowered)
            self._compile_early(lowered)
            self._keep_alive.append(fn)
        index, lowered = self.lowered[key]
        self.pending.append((t, index))
        return jax.tree.leaves(lowered.out_info)

    def const(self, value) -> int:
        s = self.new_slot()
        self.const_slots.append((s, value))
        self.slot_aval[s] = jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=value.sharding)
        self.protected.add(s)
        return s

    def _compile_early(self, lowered) -> None:
        """Start compiling a program as soon as it is lowered (XLA compiles without the GIL, so this overlaps
        the rest of the build), unless an equal program on other devices already is: that one is reused."""
        key = self._program_keys.setdefault(id(lowered), device_free_key(lowered))
        if key is not None and key in self._compiling:
            return
        if not is_local(lowered):  # another process's stage (multi-process runs): not compiled here
            return
        self._compiling[key if key is not None else id(lowered)] = self._submit(lowered)

    def _submit(self, lowered) -> concurrent.futures.Future:
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1)
        return self._pool.submit(lowered.compile)

    def compile(self) -> None:
        """Point each task at its program. Each distinct (program, input types) compiles once, concurrently,
        from the moment it was lowered; programs equal up to their devices (equal stages on other devices)
        compile once and the others load that executable onto their own devices
        (:func:`autopp.core.retarget`). Nothing waits here: a task whose program is still compiling waits
        when the first step reaches it (:class:`_Deferred`), so the first step's early tasks run while the
        later programs compile."""
        programs = [lo for _, lo in sorted(self.lowered.values(), key=lambda x: x[0])]
        deferred: list[_Deferred] = []
        for lo in programs:
            key = self._program_keys[id(lo)]
            future = self._compiling.get(key if key is not None else id(lo))
            if future is None:  # its equal was another process's: compile it here
                self._compiling[key if key is not None else id(lo)] = future = self._submit(lo)
            deferred.append(_Deferred(future, lo))
        if self._pool is not None:
            self._pool.shutdown(wait=False)  # queued compilations still run; the threads end after them
            self._pool = None
        self.num_compiled = len(self._compiling)
        for t, index in self.pending:
            self.tasks[t] = dataclasses.replace(self.tasks[t], fn=deferred[index])
        self.pending = []

    # -- the forward split ----------------------------------------------------------------------
    def analyse(self):
        spec, S = self.spec, self.S
        fwd = self.forward.jaxpr
        self.fwd = fwd
        self.mb_invar = list(self.traced.microbatched_grad_inputs)
        self.diff_mask = list(spec.diff_mask)
        # Where each forward outvar (loss, aux) is produced.
        defined_at = {}
        for s, ids in enumerate(self.split.stage_eqns):
            for i in ids:
                for v in fwd.eqns[i].outvars:
                    defined_at[v] = s  # later stages overwrite: the last definer emits it
        self.out_stage = []
        for k, a in enumerate(fwd.outvars):
            if isinstance(a, Literal):
                self.out_stage.append(S - 1)
            elif a in defined_at:
                self.out_stage.append(defined_at[a])
            else:
                raise ValueError(
                    "autopp.parallelize: the loss function returns one of its inputs unchanged as "
                    f"{'the loss' if k == 0 else f'aux leaf {k - 1}'}; compute it inside the loss function "
                    "(e.g. `x + 0`) or return it from the step directly."
                )
        for k in range(1, len(fwd.outvars)):
            dt = fwd.outvars[k].aval.dtype
            if self.config.loss_reduction == "mean" and not jnp.issubdtype(dt, jnp.inexact):
                raise TypeError(
                    f"autopp.parallelize: aux leaf {k - 1} has dtype {dt}; with loss_reduction='mean' aux "
                    "values are averaged over microbatches, which needs a floating dtype. Return it as a "
                    "float (e.g. .astype(jnp.float32)) or use loss_reduction='sum'."
                )
        self.graphs = stage_graphs(self.forward, self.split.stage_eqns, self.diff_mask, self.out_stage)
        invar_pos = {v: k for k, v in enumerate(fwd.invars)}
        self.invar_pos = invar_pos
        # Owner of each forward input: the first stage that uses it.
        self.users: dict[int, list[int]] = collections.defaultdict(list)
        for g in self.graphs:
            for v in g.inputs:
                if v in invar_pos:
                    self.users[invar_pos[v]].append(g.index)
        self.owner = {k: (self.users[k][0] if self.users[k] else 0) for k in range(len(fwd.invars))}
        self.tensor_spec: dict[tuple[int, int], tuple] = {}
        planned = self.config.param_specs
        for g in self.graphs:
            tp = self.meshes.layouts[g.index]["tensor"]
            if tp == 1:
                continue
            if planned is not None and planned[g.index] is not None:  # the plan's sharding solution
                for k, spec_ in planned[g.index].items():
                    k = int(k)
                    shape = fwd.invars[k].aval.shape
                    spec_ = tuple(spec_)
                    if len(spec_) != len(shape) or any(a == "tensor" and shape[d] % tp for d, a in enumerate(spec_)):
                        raise ValueError(
                            f"autopp.parallelize: the plan splits parameter #{k} {shape} as {spec_} over "
                            f"tensor={tp}, which does not divide it; the plan was made for another model.")
                    if "tensor" in spec_:
                        self.tensor_spec[(g.index, k)] = spec_
                continue
            params = [v for v in g.inputs if v in invar_pos and self.diff_mask[invar_pos[v]]]
            for v, spec_ in tensor_specs(g.jaxpr, params, tp).items():
                self.tensor_spec[(g.index, invar_pos[v])] = spec_
        self.label_outer()

    def layout_of(self, loc: int, k: int | None, shape, var=None) -> NamedSharding:
        """Where a value of ``shape`` serving forward input ``k`` (a parameter: itself, its gradient, its optimizer
        state; None for anything else) lives on stage ``loc``; ``var`` (an outer variable) is sharded over the data
        axis too when it is optimizer state under ZeRO-1."""
        spec = None
        if k is not None and tuple(self.fwd.invars[k].aval.shape) == tuple(shape):
            spec = self.tensor_spec.get((loc, k))
        zero = self.config.zero1 and var is not None and var in self.opt_state
        return self.meshes.state_sharding(loc, shape, spec, zero=zero)

    def label_outer(self) -> None:
        """Which parameter each outer variable serves: the gradient equation's parameter inputs and gradients,
        the optimizer state of each parameter, and what the update computes from them (same shape)."""
        grad, spec, jaxpr = self.grad, self.spec, self.jaxpr
        label = {}
        for k in spec.diff_indices:
            a = grad.invars[k]
            if not isinstance(a, Literal):
                label[a] = k
        outs = {1 + spec.num_aux + j: k for j, k in enumerate(spec.diff_indices)}
        for pos, k in outs.items():
            label[grad.outvars[pos]] = k
        for i, k in optimizer_state_owners(jaxpr, self.traced.grad_index, outs, self.traced.batch_mask).items():
            label.setdefault(jaxpr.invars[i], k)
        for i, e in enumerate(jaxpr.eqns):
            if i == self.traced.grad_index:
                continue
            for v in e.outvars:
                src = [label[a] for a in _vars(e.invars) if a in label and a.aval.shape == v.aval.shape]
                if src and v not in label:
                    label[v] = src[0]
        self.label = label
        # Optimizer state: labelled step inputs and results that do not depend on a parameter itself (Adam's
        # moments; the updated parameter reads the parameter).
        on_param = {grad.invars[k] for k in spec.diff_indices if not isinstance(grad.invars[k], Literal)}
        for i, e in enumerate(jaxpr.eqns):
            if i != self.traced.grad_index and any(a in on_param for a in _vars(e.invars)):
                on_param.update(e.outvars)
        io = set(jaxpr.invars) | set(_vars(jaxpr.outvars))
        grads = set(grad.outvars)
        self.opt_state = {v for v in label if v in io and v not in on_param and v not in grads}

    def _invar_name(self, k) -> str:
        a = self.grad.invars[k]
        if not isinstance(a, Literal) and a in self.jaxpr.invars:
            return self.traced.leaf_paths[self.jaxpr.invars.index(a)]
        return f"loss argument #{k - self.spec.num_lifted}"

    # -- values at locations ---------------------------------------------------------------------
    def need(self, v, loc: int) -> int:
        """Slot holding outer variable ``v`` on stage ``loc``, emitting the transfer if needed."""
        key = (v, loc)
        if key in self.avail:
            return self.avail[key]
        if isinstance(v, Literal):
            raise AssertionError("literals are inlined")
        if v in self.outer_consts:
            s = self.const(jax.device_put(self.outer_consts[v], self.meshes.replicated[loc]))
        elif v in self.invar_index:
            k = self.invar_index[v]
            if self.traced.batch_mask[k]:
                (s,) = self.emit(_put([self.meshes.batch_sharding(loc, v.aval.shape)]), [self.input_slot[k]], 1,
                                 f"put batch {self.traced.leaf_paths[k]} -> stage {loc}")
            else:
                homes = self.placement.input_homes.get(k, frozenset())
                assert loc in homes, (v, loc, homes)
                (s,) = self.emit(_extract(self.meshes.replicated[loc], self.meshes.devices[loc]),
                                 [self.placed_input[k]], 1, f"view {self.traced.leaf_paths[k]} on stage {loc}")
        else:
            srcs = [l for (u, l) in self.avail if u is v]
            assert srcs, f"no location holds {v} (needed on stage {loc})"
            (s,) = self.emit(_put([self.meshes.replicated[loc]]), [self.avail[(v, srcs[0])]], 1,
                             f"put {v} stage {srcs[0]} -> {loc}")
        self.avail[key] = s
        return s

    # -- outer programs -------------------------------------------------------------------------
    def outer_program(self, eqn_ids: list[int], loc: int, label: str, consumers_outside) -> None:
        eqns = [self.jaxpr.eqns[i] for i in eqn_ids]
        defined = set()
        ins = []
        for e in eqns:
            for a in _vars(e.invars):
                if a not in defined and a not in ins:
                    ins.append(a)
            defined.update(e.outvars)
        outside = consumers_outside(set(eqn_ids))
        outs = [v for e in eqns for v in e.outvars if v in outside]
        if not outs:
            return
        const_ins = [v for v in ins if v in self.outer_consts]
        ins = [v for v in ins if v not in self.outer_consts]
        sub = new_jaxpr(const_ins, ins, outs, eqns, self.jaxpr.effects, label)
        consts = [self.outer_consts[v] for v in const_ins]
        in_slots = [self.need(v, loc) for v in ins]
        # Results (new parameters, optimizer state) take the state layout of their stage, as the step's inputs do,
        # so that the next step finds them at home.
        fn = jax.jit(lambda *xs: tuple(jax.core.eval_jaxpr(sub, consts, *xs)),
                     in_shardings=tuple(self.slot_aval[s].sharding for s in in_slots),
                     out_shardings=tuple(self.layout_of(loc, self.label.get(v), v.aval.shape, v) for v in outs))
        out_slots = self.emit(fn, in_slots, len(outs), label)
        for v, s in zip(outs, out_slots):
            self.avail[(v, loc)] = s

    # -- the whole step -------------------------------------------------------------------------
    def build(self) -> Executable:
        self.analyse()
        if self.S == 1:
            return self.build_single_program()
        spec, grad = self.spec, self.grad
        jaxpr = self.jaxpr
        self.invar_index = {v: k for k, v in enumerate(jaxpr.invars)}
        # Requirements of the gradient equation's inputs.
        grad_in_required = []
        for k in range(len(grad.invars)):
            if self.diff_mask[k]:
                grad_in_required.append(frozenset({self.owner[k]}))
            else:
                grad_in_required.append(frozenset(self.users[k]))
        num_aux = spec.num_aux
        grad_out_loc = [self.out_stage[0]] + [self.out_stage[1 + j] for j in range(num_aux)]
        grad_out_loc += [self.owner[k] for k in spec.diff_indices]
        self.placement = place_outer(jaxpr, self.traced.grad_index, grad_in_required, grad_out_loc,
                                     self.traced.batch_mask)
        pl = self.placement
        # Step inputs: one slot per user leaf, placed at home at the start of every step.
        self.input_slot = [self.new_slot() for _ in jaxpr.invars]
        for slot, v in zip(self.input_slot, jaxpr.invars):
            self.slot_aval[slot] = _sds(v.aval, None)
        self.placed_input = {}
        homed = [k for k in range(len(jaxpr.invars)) if not self.traced.batch_mask[k] and pl.input_homes.get(k)]
        shardings = [self.layout_of(next(iter(pl.input_homes[k])), self.label.get(jaxpr.invars[k]),
                                    jaxpr.invars[k].aval.shape, jaxpr.invars[k])
                     if len(pl.input_homes[k]) == 1 else self.meshes.multi(pl.input_homes[k]) for k in homed]
        if homed:
            placed = self.emit(_place(shardings), [self.input_slot[k] for k in homed], len(homed),
                               f"place {len(homed)} inputs at home")
            for k, s in zip(homed, placed):
                if len(pl.input_homes[k]) == 1:
                    self.avail[(jaxpr.invars[k], next(iter(pl.input_homes[k])))] = s
                self.placed_input[k] = s

        # Which outer variables are used where: consumers outside a program need its outputs.
        users_of = collections.defaultdict(set)
        for i, e in enumerate(jaxpr.eqns):
            for a in _vars(e.invars):
                users_of[a].add(i)
        step_outs = set(_vars(jaxpr.outvars))

        def consumers_outside(ids):
            def needed(v):
                return v in step_outs or bool(users_of[v] - ids)
            return {v for i in ids for v in jaxpr.eqns[i].outvars if needed(v)}

        # Pre-processing (ancestors of the gradient), one program per location.
        pre_by_loc = collections.defaultdict(list)
        for i in sorted(pl.eqn_locs):
            if pl.region[i] == "pre":
                for loc in pl.eqn_locs[i]:
                    pre_by_loc[loc].append(i)
        for loc in sorted(pre_by_loc):
            self.outer_program(pre_by_loc[loc], loc, f"pre stage {loc}", consumers_outside)

        self.build_pipeline()

        # Post-processing (optimizer, metrics), by phase then location.
        post = collections.defaultdict(list)
        for (i, loc), ph in pl.phase.items():
            if pl.region[i] == "post":
                post[(ph, loc)].append(i)
        for key in sorted(post):
            ph, loc = key
            self.outer_program(sorted(post[key]), loc, f"post phase {ph} stage {loc}", consumers_outside)

        # Outputs.
        outputs = []
        self.output_slots = set()
        for a, locs in zip(jaxpr.outvars, pl.out_locs):
            if isinstance(a, Literal):
                val = jnp.asarray(a.val, dtype=a.aval.dtype)
                outputs.append(lambda env, val=val: val)
            elif a in self.invar_index and (self.traced.batch_mask[self.invar_index[a]] or not locs):
                k = self.invar_index[a]
                slot = self.input_slot[k]
                outputs.append(lambda env, slot=slot: env[slot])
                self.output_slots.add(slot)
            elif len(locs) == 1:
                (loc,) = locs
                slot = self.need(a, loc)
                outputs.append(lambda env, slot=slot: env[slot])
                self.output_slots.add(slot)
            else:
                parts = [self.need(a, loc) for loc in sorted(locs)]
                (slot,) = self.emit(_assemble(self.meshes.multi(frozenset(locs)), a.aval.shape), parts, 1,
                                    f"assemble output {a}")
                outputs.append(lambda env, slot=slot: env[slot])
                self.output_slots.add(slot)
        self.reuse_accumulators()
        self.localize()
        self.insert_frees()
        self.compile()
        return self.executable(outputs)

    def executable(self, outputs) -> Executable:
        exe = Executable(self.tasks, self.num_slots, self.input_slot, self.const_slots, outputs,
                         self.traced.out_tree, self.describe())
        inputs = set(self.input_slot)
        exe.slot_bytes = {s: _bytes_per_device(a) for s, a in self.slot_aval.items() if s not in inputs}
        exe.num_compiled = self.num_compiled
        return exe

    # -- the pipeline ---------------------------------------------------------------------------
    def build_pipeline(self):
        S, M, spec, grad, fwd = self.S, self.M, self.spec, self.grad, self.fwd
        meshes = self.meshes
        seed = 1.0 / M if self.config.loss_reduction == "mean" else 1.0
        loss_var = fwd.outvars[0]
        progs: list[StagePrograms] = []
        producer_stage = {}
        for g in self.graphs:
            for v in g.outputs:
                producer_stage.setdefault(v, g.index)
        self.producer_stage = producer_stage
        for g in self.graphs:
            s = g.index
            rep = meshes.replicated[s]
            is_param = [v in self.invar_pos and self.diff_mask[self.invar_pos[v]] for v in g.inputs]
            in_sh = []
            for v in g.inputs:
                mb = v not in self.invar_pos or self.mb_invar[self.invar_pos[v]]
                in_sh.append(meshes.batch_sharding(s, v.aval.shape) if mb
                             else self.layout_of(s, self.invar_pos.get(v), v.aval.shape))
            out_sh = [meshes.batch_sharding(s, v.aval.shape) if v not in fwd.outvars else rep for v in g.outputs]
            seeds = {i: seed for i, v in enumerate(g.outputs) if v is loss_var}
            grad_sh = [self.layout_of(s, self.invar_pos[v], v.aval.shape) for v, p in zip(g.inputs, is_param)
                       if p and g.diff_inputs[g.inputs.index(v)]]
            act_ct_sh = [meshes.batch_sharding(s, v.aval.shape)
                         for v, p, d in zip(g.inputs, is_param, g.diff_inputs) if d and not p]
            constraints = {}
            for e in g.jaxpr.eqns:
                for v in e.outvars:
                    if v in self.config.sequence_vars:
                        sh = meshes.sequence_sharding(s, v.aval.shape)
                        if sh is not None:
                            constraints[v] = sh
            progs.append(StagePrograms(g, is_param=is_param, seed_of_output=seeds, in_shardings=in_sh,
                                       out_shardings_fwd=out_sh, grad_shardings=grad_sh, act_ct_shardings=act_ct_sh,
                                       residual_sharding=functools.partial(meshes.batch_sharding, s),
                                       flag_sharding=rep, recompute=self.config.recompute[s],
                                       constraints=constraints))
        self.progs = progs

        # Per-step inputs of each stage that do not change across microbatches.
        static_in: dict[tuple[int, int], int] = {}  # (stage, input position) -> slot
        mb_slots: dict[tuple[int, int, int], int] = {}  # (stage, input position, microbatch) -> slot
        mb_inputs: dict[int, tuple[list[int], list[int]]] = {}  # stage -> (input positions, full-batch slots)
        for g in self.graphs:
            s = g.index
            mb_positions = []
            for pos, v in enumerate(g.inputs):
                if v not in self.invar_pos:
                    continue
                k = self.invar_pos[v]
                outer_v = grad.invars[k]
                if self.mb_invar[k]:
                    mb_positions.append(pos)
                elif isinstance(outer_v, Literal):
                    static_in[(s, pos)] = self.const(jax.device_put(jnp.asarray(outer_v.val, outer_v.aval.dtype),
                                                                    self.layout_of(s, k, outer_v.aval.shape)))
                elif self.diff_mask[k] and self.owner[k] != s:
                    o = self.owner[k]
                    (slot,) = self.emit(_put([self.layout_of(s, k, outer_v.aval.shape)]), [self.need(outer_v, o)],
                                        1, f"put shared parameter {self._invar_name(k)} stage {o} -> {s}")
                    static_in[(s, pos)] = slot
                else:
                    slot = self.need(outer_v, s)
                    want = self.layout_of(s, k, outer_v.aval.shape)
                    if self.slot_aval[slot].sharding != want:  # e.g. computed before the gradient, replicated
                        (slot,) = self.emit(_put([want]), [slot], 1, f"lay out {self._invar_name(k)} on stage {s}")
                    static_in[(s, pos)] = slot
            if mb_positions:
                full = [self.need(grad.invars[self.invar_pos[g.inputs[p]]], s) for p in mb_positions]
                mb_inputs[s] = (mb_positions, full)

        for s, (mb_positions, full) in mb_inputs.items():
            g = self.graphs[s]
            shapes = [g.inputs[p].aval.shape for p in mb_positions]
            out_sh = [meshes.batch_sharding(s, sh) for sh in shapes for _ in range(M)]

            def split(*xs, M=M):
                return tuple(x.reshape((M, x.shape[0] // M) + x.shape[1:])[m] for x in xs for m in range(M))

            fn = jax.jit(split, out_shardings=tuple(out_sh))
            outs = self.emit(fn, full, len(mb_positions) * M, f"split microbatches stage {s}")
            for j, p in enumerate(mb_positions):
                for m in range(M):
                    mb_slots[(s, p, m)] = outs[j * M + m]

        # Gradient accumulators: the first accumulating action of a stage ignores their contents (``first``).
        acc: dict[int, list[int]] = {}
        self.acc_start: dict[int, tuple[int, list[int]]] = {}  # stage -> (its accumulators' task, slots)
        for s, pr in enumerate(progs):
            if pr.param_idx:
                g = self.graphs[s]
                avals = [g.inputs[i].aval for i in pr.param_idx]
                ks = [self.invar_pos[g.inputs[i]] for i in pr.param_idx]
                shardings = [self.layout_of(s, k, a.shape) for k, a in zip(ks, avals)]
                acc[s] = self.emit(_reused_buffers(avals, shardings), [], len(avals), f"gradient buffers stage {s}")
                self.acc_start[s] = (len(self.tasks) - 1, acc[s])
            else:
                acc[s] = []
        started: set[int] = set()

        def flag(s) -> list[int]:
            """The ``first`` argument of stage ``s``'s next accumulating action."""
            if not progs[s].has_flag:
                return []
            first = s not in started
            started.add(s)
            return [self.seed_slot(s, jax.ShapeDtypeStruct((), jnp.bool_), first)]

        act_at: dict[tuple[Any, int, int], int] = {}  # (fwd var, microbatch, stage) -> slot
        ct_parts: dict[tuple[Any, int], list[int]] = collections.defaultdict(list)  # (var, mb) -> slots
        fwd_state: dict[tuple[int, int], tuple[list[int], list[int]]] = {}  # (s, m) -> (input slots, kept residuals)
        w_state: dict[tuple[int, int], tuple[list[int], list[int]]] = {}  # (s, m) -> (W's bwd arguments, stash)
        out_parts: dict[int, list[int]] = collections.defaultdict(list)  # fwd outvar index -> per-mb slots
        outvar_idx = {}
        for k, a in enumerate(fwd.outvars):
            if not isinstance(a, Literal):
                outvar_idx.setdefault(a, k)

        def input_slots(s, m):
            g = self.graphs[s]
            slots = []
            for pos, v in enumerate(g.inputs):
                if (s, pos) in static_in:
                    slots.append(static_in[(s, pos)])
                elif (s, pos, m) in mb_slots:
                    slots.append(mb_slots[(s, pos, m)])
                else:
                    slots.append(act_at[(v, m, s)])
            return slots

        def ship_outputs(s, m, out_slots):
            g = self.graphs[s]
            by_dest = collections.defaultdict(list)
            for v, slot in zip(g.outputs, out_slots):
                if v in outvar_idx and self.out_stage[outvar_idx[v]] == s:
                    out_parts[outvar_idx[v]].append(slot)
                for t in range(s + 1, S):
                    if v in self.graphs[t].inputs and producer_stage.get(v) == s:
                        by_dest[t].append((v, slot))
            for t, items in by_dest.items():
                shs = [meshes.batch_sharding(t, v.aval.shape) for v, _ in items]
                outs = self.emit(_put(shs), [sl for _, sl in items], len(items), f"send {s}->{t} mb {m}")
                for (v, _), o in zip(items, outs):
                    act_at[(v, m, t)] = o

        def ship_input_cts(s, m, ct_slots):
            pr, g = progs[s], self.graphs[s]
            by_dest = collections.defaultdict(list)
            for i, slot in zip(pr.act_idx, ct_slots):
                v = g.inputs[i]
                by_dest[producer_stage[v]].append((v, slot))
            for t, items in by_dest.items():
                shs = [meshes.batch_sharding(t, v.aval.shape) for v, _ in items]
                outs = self.emit(_put(shs), [sl for _, sl in items], len(items), f"send grad {s}->{t} mb {m}")
                for (v, _), o in zip(items, outs):
                    ct_parts[(v, m)].append(o)

        def output_cts(s, m):
            pr, g = progs[s], self.graphs[s]
            slots = []
            for i in pr.diff_out_idx:
                v = g.outputs[i]
                parts = list(ct_parts.pop((v, m), []))
                if v is loss_var:
                    parts.append(self.seed_slot(s, v.aval, seed))
                if not parts:
                    parts.append(self.seed_slot(s, v.aval, 0.0))
                if len(parts) == 1:
                    slots.append(parts[0])
                else:
                    (sl,) = self.emit(_sum_program(len(parts), meshes.replicated[s]), parts, 1, f"sum grads {v}")
                    slots.append(sl)
            return slots

        order = dispatch_order(self.config.schedule)
        rows = self.config.schedule.rows
        next_in_row = {}
        for r, row in enumerate(rows):
            acts = [a for a in row if a is not None]
            for a, b in zip(acts, acts[1:]):
                next_in_row[a] = b
        fused = set()
        for rank, act in order:
            s, m = act.stage, act.microbatch
            pr = progs[s]
            if act.kind == "F":
                ins = input_slots(s, m)
                nxt = next_in_row.get(act)
                if pr.can_fuse and nxt is not None and nxt.kind == "B" and nxt.stage == s and nxt.microbatch == m:
                    outs = self.emit(pr.fwd_bwd, ins + acc[s] + flag(s),
                                     len(pr.graph.outputs) + len(acc[s]) + len(pr.act_idx),
                                     f"{s}F{m}+{s}B{m}")
                    n_o = len(pr.graph.outputs)
                    ship_outputs(s, m, outs[:n_o])
                    acc[s] = outs[n_o:n_o + len(acc[s])]
                    ship_input_cts(s, m, outs[n_o + len(acc[s]):])
                    fused.add(nxt)
                    continue
                outs = self.emit(pr.fwd, ins, len(pr.graph.outputs) + pr.num_kept, f"{s}F{m}")
                n_o = len(pr.graph.outputs)
                fwd_state[(s, m)] = (ins, outs[n_o:])
                ship_outputs(s, m, outs[:n_o])
            elif act.kind == "B":
                if act in fused:
                    continue
                ins, kept = fwd_state.pop((s, m))
                forwarded = [ins[i] for i in pr.forwarded_inputs]
                cts = output_cts(s, m)
                outs = self.emit(pr.bwd, kept + forwarded + cts + acc[s] + flag(s), len(acc[s]) + len(pr.act_idx),
                                 f"{s}B{m}")
                acc[s] = outs[:len(acc[s])]
                ship_input_cts(s, m, outs[len(acc[s]):])
            elif act.kind == "I":
                ins, kept = fwd_state[(s, m)]
                forwarded = [ins[i] for i in pr.forwarded_inputs]
                args = kept + forwarded + output_cts(s, m)
                bwd_input = pr.bwd_input
                n_ct = len(pr.act_idx)
                outs = (self.emit(bwd_input, args, n_ct + pr.num_stash, f"{s}I{m}")
                        if n_ct + pr.num_stash else [])
                ship_input_cts(s, m, outs[:n_ct])
                w_state[(s, m)] = ([args[k] for k in pr.weight_args], outs[n_ct:])
            else:  # W
                fwd_state.pop((s, m))
                w_args, stash = w_state.pop((s, m))
                if acc[s]:
                    acc[s] = self.emit(pr.bwd_weight, w_args + stash + acc[s] + flag(s), len(acc[s]), f"{s}W{m}")

        reduced = {}
        # Loss and aux: reduce the per-microbatch values on the stage that produced them.
        for k in range(1 + spec.num_aux):
            a = fwd.outvars[k]
            s = self.out_stage[k]
            if isinstance(a, Literal):
                reduced[k] = self.const(jax.device_put(jnp.asarray(a.val, a.aval.dtype), meshes.replicated[s]))
                continue
            parts = out_parts[k]
            assert len(parts) == M, (k, len(parts))
            mean = self.config.loss_reduction == "mean"
            fn = jax.jit(lambda *xs, mean=mean: (sum(xs[1:], xs[0]) / len(xs) if mean else sum(xs[1:], xs[0]),),
                         out_shardings=(meshes.replicated[s],))
            (sl,) = self.emit(fn, parts, 1, f"reduce {'loss' if k == 0 else f'aux {k - 1}'} stage {s}")
            reduced[k] = sl

        self.finish_pipeline(reduced, acc)
        self.acc_end = acc

    def finish_pipeline(self, reduced: dict[int, int], acc: dict[int, list[int]]) -> None:
        """Publish the loss, aux and gradients (summing shared parameters' contributions on their owner)."""
        spec, grad, fwd, progs = self.spec, self.grad, self.fwd, self.progs
        for k, slot in reduced.items():
            self.avail[(grad.outvars[k], self.out_stage[k])] = slot
        # Gradients: each on its owner, contributions of other stages (shared parameters) added.
        for j, k in enumerate(spec.diff_indices):
            outer = grad.outvars[1 + spec.num_aux + j]
            o = self.owner[k]
            contrib = []
            for s in self.users[k]:
                pos = self.graphs[s].inputs.index(fwd.invars[k])
                if pos not in progs[s].param_idx:
                    continue
                slot = acc[s][progs[s].param_idx.index(pos)]
                home = self.layout_of(o, k, fwd.invars[k].aval.shape)
                if s != o:
                    (slot,) = self.emit(_put([home]), [slot], 1, f"send shared grad {s}->{o}")
                contrib.append(slot)
            home = self.layout_of(o, k, fwd.invars[k].aval.shape)
            if not contrib:
                aval = fwd.invars[k].aval
                contrib = self.emit(_zeros_program([aval], [home]), [], 1, f"zero grad {self._invar_name(k)}")
            if len(contrib) > 1:
                contrib = self.emit(_sum_program(len(contrib), home), contrib, 1,
                                    f"sum shared grad {self._invar_name(k)}")
            self.avail[(outer, o)] = contrib[0]

    def build_single_program(self) -> Executable:
        """One stage: the whole step is one program, the loss's microbatches a ``lax.scan`` inside it.

        This is exactly gradient accumulation as one would write it by hand, so a one-stage plan costs
        what plain ``jax.jit`` with microbatching costs.
        """
        M, spec, jaxpr, fwd = self.M, self.spec, self.jaxpr, self.forward
        mean = self.config.loss_reduction == "mean"
        mb_mask, diff_idx = self.mb_invar, spec.diff_indices

        def accumulate(*invals):
            stacked = [x.reshape((M, x.shape[0] // M) + x.shape[1:]) for x, mb in zip(invals, mb_mask) if mb]

            def body(carry, mbs):
                it = iter(mbs)
                vals = [next(it) if mb else x for x, mb in zip(invals, mb_mask)]

                def loss_of(diff_vals):
                    v = list(vals)
                    for i, d in zip(diff_idx, diff_vals):
                        v[i] = d
                    outs = jax.core.eval_jaxpr(fwd.jaxpr, fwd.consts, *v)
                    return outs[0], outs[1:]

                if self.config.recompute[0] != "none":
                    loss_of = jax.checkpoint(loss_of, policy=RECOMPUTE_POLICIES[self.config.recompute[0]])
                (loss, aux), grads = jax.value_and_grad(loss_of, has_aux=True)([vals[i] for i in diff_idx])
                return jax.tree.map(jnp.add, carry, (loss, aux, grads)), None

            zeros = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype),
                                 ([fwd.out_avals[0]], list(fwd.out_avals[1:]), [invals[i].aval for i in diff_idx]))
            (loss, aux, grads), _ = jax.lax.scan(body, (zeros[0][0], zeros[1], zeros[2]), stacked)
            outs = [loss, *aux, *grads]
            return [o / M for o in outs] if mean else outs

        def whole(*flat):
            grad_index = self.traced.grad_index
            return tuple(eval_jaxpr_with(jaxpr, self.traced.jaxpr.consts, flat,
                                         lambda i, _, invals: accumulate(*invals) if i == grad_index else None))

        in_sh = [self.meshes.batch_sharding(0, v.aval.shape) if b
                 else self.layout_of(0, self.label.get(v), v.aval.shape, v)
                 for v, b in zip(jaxpr.invars, self.traced.batch_mask)]
        fn = jax.jit(whole, in_shardings=tuple(in_sh),
                     out_shardings=tuple(self.layout_of(0, self.label.get(v), v.aval.shape, v)
                                         if not isinstance(v, Literal) else self.meshes.replicated[0]
                                         for v in jaxpr.outvars))
        self.input_slot = [self.new_slot() for _ in jaxpr.invars]
        for slot, v in zip(self.input_slot, jaxpr.invars):
            self.slot_aval[slot] = _sds(v.aval, None)
        placed = self.emit(_place(in_sh), self.input_slot, len(in_sh), f"place {len(in_sh)} inputs on stage 0")
        outs = self.emit(fn, placed, len(jaxpr.outvars), f"0F+0B all {M} microbatches (scan) and update")
        self.output_slots = set(outs)
        outputs = [lambda env, slot=slot: env[slot] for slot in outs]
        self.localize()
        self.insert_frees()
        self.compile()
        return self.executable(outputs)

    def reuse_accumulators(self) -> None:
        """Hand each stage's final gradient accumulators, once the step is done with them, to the next step's
        start, so that no program makes zeros and no zero fill runs (the first accumulation ignores the
        buffers' contents). Between steps the reused buffers stay allocated (the size of the stage's
        parameters); the step's peak is unchanged, as they are live through it anyway.

        Two kinds of stage start from a compiled zero program instead: one whose gradients the step returns
        (the caller owns them), and one whose gradients another process receives (a shared parameter's
        contribution: a cross-process send may still be reading the buffer when the next step's backward
        takes it over)."""
        for s, (t, start) in self.acc_start.items():
            final = self.acc_end[s]
            task = self.tasks[t]
            if set(final) & self.output_slots or self._sent_to_other_processes(set(final)):
                avals = [self.slot_aval[i] for i in start]
                fn = _zeros_program(avals, [a.sharding for a in avals])
                self.lower_for(t, fn, [])
                self.tasks[t] = dataclasses.replace(task, fn=fn, label=f"zero gradients stage {s}")
                continue
            self.tasks.append(Task(_give_back(task.fn), tuple(final), (), f"keep gradient buffers stage {s}",
                                   devices=task.devices))

    def _sent_to_other_processes(self, slots: set[int]) -> bool:
        for task in self.tasks:
            shardings = getattr(task.fn, "shardings", None)
            for slot, dst in zip(task.ins, shardings or ()):
                src = getattr(self.slot_aval[slot], "sharding", None) if slot in slots else None
                if src is not None and ({d.process_index for d in src.device_set}
                                        != {d.process_index for d in dst.device_set}):
                    return True
        return False

    def seed_slot(self, s, aval, value) -> int:
        """A constant on stage ``s`` made once at build time (a cotangent: the loss seed or zeros; the ``first``
        flag of the accumulating programs), shared by all microbatches."""
        cache = self._seed_cache
        key = (s, aval.shape, str(aval.dtype), value)
        if key not in cache:
            cache[key] = self.const(jax.device_put(np.full(aval.shape, value, aval.dtype), self.meshes.replicated[s]))
        return cache[key]

    def localize(self) -> None:
        """In a multi-process run, keep what this process issues (:mod:`autopp.runtime._multiprocess`)."""
        if jax.process_count() > 1:
            from autopp.runtime._multiprocess import localize

            localize(self)

    def insert_frees(self):
        last = {}
        for t, task in enumerate(self.tasks):
            for i in task.ins:
                last[i] = t
            for o in task.outs:
                last.setdefault(o, t)
        keep = self.protected | self.output_slots
        frees = collections.defaultdict(list)
        for slot, t in last.items():
            if slot not in keep:
                frees[t].append(slot)
        self.tasks = [dataclasses.replace(task, frees=tuple(frees.get(t, ()))) for t, task in enumerate(self.tasks)]

    def describe(self) -> list[str]:
        return [t.label for t in self.tasks]


def _bytes_per_device(aval) -> dict[int, int]:
    sharding = getattr(aval, "sharding", None)
    if sharding is None:
        return {}
    n = aval_bytes(jax.ShapeDtypeStruct(sharding.shard_shape(aval.shape), aval.dtype))
    return {d.id: n for d in sharding.device_set}


def _zeros_program(avals, shardings):
    return jax.jit(lambda: tuple(jnp.zeros(a.shape, a.dtype) for a in avals), out_shardings=tuple(shardings))


def _reused_buffers(avals, shardings):
    """Buffers for ``avals`` at ``shardings``: the ones :func:`_give_back` returned last, else (the first step)
    zeros put from the host, which costs no compilation."""
    pool: list[list] = []

    def buffers():
        if pool:
            return pool.pop()
        return jax.device_put([np.zeros(a.shape, a.dtype) for a in avals], list(shardings))

    buffers.out_avals = lambda _: [_sds(a, sh) for a, sh in zip(avals, shardings)]
    buffers.pool = pool
    return buffers


def _give_back(buffers):
    """A task that returns its inputs to ``buffers`` (a :func:`_reused_buffers` task) for the next step."""

    def give_back(*xs):
        buffers.pool[:] = [list(xs)]
        return ()

    return give_back


def _sum_program(n, sharding):
    return jax.jit(lambda *xs: (sum(xs[1:], xs[0]),), out_shardings=(sharding,))


def build_executable(traced, forward, split, stage_devices, *, num_microbatches, loss_reduction,
                     schedule, recompute: Sequence[str] | None = None,
                     layouts: Sequence[dict[str, int]] | None = None, param_specs: Sequence | None = None,
                     zero1: bool = False, sequence_vars=frozenset()) -> Executable:
    """Build the step's instruction list. ``forward`` is the loss's forward jaxpr at microbatch size;
    ``recompute`` gives each stage's recomputation mode (default none); ``layouts`` each stage's mesh axis sizes
    (``data``, ``fsdp``, ``tensor``; default all data); ``param_specs`` each stage's parameter layouts over its
    tensor axis from a plan (default: Megatron's rule); ``zero1`` shards optimizer state over the data axis;
    ``sequence_vars``: forward activations split along their sequence over the tensor axis (sequence parallelism)."""
    meshes = StageMeshes(stage_devices, layouts)
    recompute = tuple(recompute) if recompute is not None else ("none",) * split.num_stages
    if len(recompute) != split.num_stages or not set(recompute) <= set(RECOMPUTE_MODES):
        raise ValueError(f"recompute={recompute!r}: give one of 'none', 'full', 'selective' per stage "
                         f"({split.num_stages} stages).")
    config = PipelineConfig(num_microbatches=num_microbatches, loss_reduction=loss_reduction, schedule=schedule,
                            recompute=recompute, param_specs=None if param_specs is None else tuple(param_specs),
                            zero1=bool(zero1), sequence_vars=frozenset(sequence_vars))
    return _Builder(traced, forward, split, meshes, config).build()

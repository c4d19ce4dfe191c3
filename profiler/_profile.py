"""``autopp.profiler.profile``: a traced step's per-layer costs, memory and times for a cluster."""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import jax
import networkx as nx
import numpy as np
from jax.extend import core as jex_core

from autopp.core import (
    MOVED_WORK_SCOPE,
    TracedStep,
    differentiable_vars,
    eqn_signature,
    forward_with_vjp,
    moved_work_inputs,
    name_stack,
    normalize_batch_argnums,
    trace_step,
    unit,
)
from autopp.profiler._cluster import Cluster
from autopp.profiler._costs import aval_bytes, eqn_cost, forget_warnings, kernel_costs
from autopp.profiler._graph import cost_graph
from autopp.profiler._kernels import ScaledKernel, program_kernels
from autopp.profiler._layer_stage import layer_graph
from autopp.profiler._layers import Layer, group_layers
from autopp.profiler._measure import ProfileCache, measure_layer
from autopp.profiler._optstate import optimizer_state_owners
from autopp.profiler._strategies import LayerProgram, batch_dims, layer_program
from autopp.profiler._timemodel import KernelTimeModel

Literal = jex_core.Literal


@dataclasses.dataclass(frozen=True, kw_only=True)
class LayerProfile:
    """Costs, memory and time of one layer of the loss (per step, full batch)."""

    index: int
    """Position of the layer in the forward computation."""
    name: str
    """Readable name (``embed``, ``block 3``, ``head``, ...)."""
    fingerprint: str
    """Structural hash; identical blocks share it and are costed once."""
    flops: float
    """Forward FLOPs (transcendentals included)."""
    backward_flops: float
    """FLOPs of the layer's VJP (input and weight gradients)."""
    param_bytes: int
    """Bytes of the parameters the layer owns."""
    grad_bytes: int
    """Bytes of their gradients."""
    optimizer_bytes: int
    """Bytes of the optimizer state the step keeps for those parameters (read off the optax update)."""
    activation_bytes: int
    """Bytes the backward pass keeps from the forward (VJP residuals) without recomputation."""
    recompute_activation_bytes: int
    """Bytes kept with full recomputation: only the layer's inputs."""
    output_bytes: int
    """Bytes of activations the layer hands to later layers."""
    forward_time_s: float
    """Forward time on the cluster's device (roofline model, or measured when ``measure=True``)."""
    backward_time_s: float
    """Backward time on the cluster's device."""
    measured: bool
    """Whether the times were measured on the local device."""
    param_inputs: tuple[int | None, ...] = ()
    """Per input of the layer's program (:attr:`Profile.programs`): the forward input (parameter) it is, or None
    for an activation or constant."""
    row_fractions: tuple[tuple[int, float], ...] = ()
    """Parameters the layer owns some rows of (a scan iteration: its rows of a stacked parameter), as (forward input,
    fraction of the parameter): what a stage holds when the runtime divides the stack by rows."""
    crossing_bytes: int = 0
    """Bytes a stage boundary after this layer sends per traced batch: the values of this layer and earlier ones
    that later layers read (skip connections included; :attr:`output_bytes` counts only this layer's)."""
    built_bytes: int = 0
    """Bytes of the weights the layer builds from parameters alone and its backward reads (``jnp.kron`` or ``U @ V``
    of factors; :attr:`autopp.profiler.Layer.built_bytes`): held whole while its stage computes, whatever the
    microbatch."""

    @property
    def time_s(self) -> float:
        """Forward plus backward time."""
        return self.forward_time_s + self.backward_time_s

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["time_s"] = self.time_s
        return d


@dataclasses.dataclass(frozen=True)
class MovedWork:
    """Work the trace took out of the loss as the same for every microbatch (``autopp.core._hoist``: a whole-graph
    encoder, a hypernetwork, an orthogonal parametrisation's solve): the step computes it once, before the
    microbatches, and its backward after them, on one device group."""

    kernels: tuple[ScaledKernel, ...]
    """Kernels of its forward and backward, at the traced size, unsharded (nothing in them scales with the batch)."""
    flops: float
    """FLOPs of its forward and backward."""
    held_bytes: int
    """Bytes of its results and of its residuals, held from before the first microbatch to after the last."""
    transient_bytes: int
    """Bytes of the largest value it computes and does not hold (a temporary of its forward or its backward)."""
    param_bytes: int
    """Bytes of the trained weights only it reads (a hypernetwork's generator): no layer holds them."""
    state_bytes: int
    """Bytes of those weights, their gradients and optimizer state."""
    input_bytes: int
    """Bytes of the other inputs only it reads (a graph's adjacency passed whole), held where it runs."""
    home_layer: int
    """The layer whose device group runs it: the first that reads a weight it reads, else the first that reads its
    results (the runtime's placement, ``runtime/_placement.py``)."""
    result_inputs: tuple[int, ...] = ()
    """The loss's inputs that are its results (sent to the layers that read them; no parameters)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Profile:
    """The profile of one training step."""

    layers: tuple[LayerProfile, ...]
    """Layers of the loss, in forward order."""
    graph: nx.DiGraph = dataclasses.field(repr=False)
    """One node per layer (its costs), one edge per dependency with the bytes that cross it."""
    cluster: Cluster
    """The cluster the times are for."""
    time_model: KernelTimeModel
    """The kernel time model used (calibrated to local measurements when ``measure=True``)."""
    total_flops: float
    """FLOPs of the whole step: forward, backward and update."""
    forward_flops: float
    """FLOPs of the loss's forward pass."""
    backward_flops: float
    """FLOPs of the loss's backward pass."""
    update_flops: float
    """FLOPs outside the gradient (optimizer update, metrics, pre-processing)."""
    param_bytes: int
    """Bytes of all differentiated parameters."""
    fingerprint: str
    """Hash of the traced step."""
    batch_size: int | None = None
    """Examples per step the step was traced with (the leading dimension of its batch leaves); what a plan's
    microbatch size scales the batch-proportional costs from. None when the batch leaves disagree."""
    programs: Mapping[str, LayerProgram] = dataclasses.field(default_factory=dict, repr=False, compare=False)
    """Per distinct layer fingerprint: the layer's forward-and-backward program (what the sharding ILP and the
    cost model read)."""
    state_bytes: Mapping[int, tuple[int, int, int]] = dataclasses.field(default_factory=dict, repr=False,
                                                                        compare=False)
    """Per differentiated forward input (parameter): bytes of the parameter, of its gradient and of the optimizer
    state the step keeps for it, from the trace (e.g. fp32 master weights, fp32 gradients, Adam's fp32 moments);
    per frozen one (read by the loss, neither differentiated nor split with the batch: a LoRA base), its bytes and
    two zeros."""
    structure_fingerprint: str = ""
    """Hash of what does not change with the batch size: the layers' names, the parameters' shapes and dtypes, and
    the other inputs' shapes past the batch dimension (sequence length, ...) and dtypes. A plan made from this
    profile (at any batch size) replays on the same step at the plan's global batch."""
    param_names: Mapping[int, str] = dataclasses.field(default_factory=dict, repr=False, compare=False)
    """Per differentiated forward input: the pytree path of the step argument it is (``args[0]['blocks'][3]...``)."""
    update_kernels: tuple[ScaledKernel, ...] = dataclasses.field(default=(), repr=False, compare=False)
    """Kernels of everything the step computes outside the loss's gradient (the optimizer update), at the traced
    size, unsharded, but the moved work's."""
    moved: MovedWork | None = dataclasses.field(default=None, repr=False, compare=False)
    """Work moved out of the loss, computed once per step (None: none)."""
    update_copies: tuple[float, float] = dataclasses.field(default=(0.0, 0.0), compare=False)
    """Shares of the parameters' bytes (of all :attr:`state_bytes`' first parts) and of the optimizer state's bytes
    whose step inputs are not donated: the update writes their new values beside the old ones, which the caller
    still holds. ``(0, 0)``: the update runs in place (every parameter and its state donated, as Megatron-LM
    updates them)."""

    def table(self) -> str:
        """Each layer's costs, one row per layer ("trained MB": the layer's differentiated parameters; frozen weights
        passed in, such as a quantized base model, are counted where a plan's memory is)."""
        return format_profile_table(self)

    def __str__(self) -> str:  # print(profile): the table, not the dataclass with its graph
        return self.table()

    def __reduce__(self):
        raise TypeError("Profile: a profile holds the traced step's layer programs (jaxprs), which do not pickle. Plan "
                        "in the process that profiled (plan_model(profile, cluster, ...)) and save the plan "
                        "(plan.to_json(path)), or profile the step again where it is needed (autopp plan --step "
                        "package.module:function plans a step in one command).")

    def __copy__(self):
        return self  # (frozen)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready summary (what ``autopp profile --json`` prints): the totals, :attr:`update_copies`, the moved
        work's totals (``None``: none) and each layer's costs; not the programs, which do not serialise."""
        return {
            "cluster": self.cluster.to_dict(),
            "time_model": self.time_model.to_dict(),
            "total_flops": self.total_flops,
            "forward_flops": self.forward_flops,
            "backward_flops": self.backward_flops,
            "update_flops": self.update_flops,
            "param_bytes": self.param_bytes,
            "fingerprint": self.fingerprint,
            "batch_size": self.batch_size,
            "update_copies": list(self.update_copies),
            "moved": None if self.moved is None else {
                k: getattr(self.moved, k) for k in ("flops", "held_bytes", "transient_bytes", "param_bytes",
                                                     "state_bytes", "input_bytes", "home_layer")},
            "layers": [l.to_dict() for l in self.layers],
        }


@dataclasses.dataclass(frozen=True)
class LayerSource:
    """One distinct layer: its forward as a closed jaxpr, the kind of each input, and its forward-and-backward
    program."""

    closed: jex_core.ClosedJaxpr
    inputs: tuple
    """The loss-forward variables feeding the layer (aligned with ``closed``'s invars)."""
    kinds: tuple[str, ...]
    """Per input: ``param`` (differentiated, not batch-dependent), ``batch`` (a differentiated activation), ``data``
    (batch-dependent, not differentiated: the batch itself) or ``const``."""
    program: LayerProgram

    @property
    def diff(self) -> list[bool]:
        return [k in ("param", "batch") and jax.numpy.issubdtype(v.aval.dtype, jax.numpy.inexact)
                for k, v in zip(self.kinds, self.closed.jaxpr.invars)]


def _scan_iteration(forward: jex_core.ClosedJaxpr, lay: Layer, kind_of) -> tuple:
    """One iteration of the ``lax.scan`` at ``lay.eqn_range[0]`` as a closed jaxpr over (consts, carry, slices)."""
    e = forward.jaxpr.eqns[lay.eqn_range[0]]
    body = e.params["jaxpr"]
    nc, nk = e.params["num_consts"], e.params["num_carry"]
    outer = list(e.invars)
    kinds = []
    for j, a in enumerate(outer):
        if isinstance(a, Literal):
            kinds.append("const")
        elif nc <= j < nc + nk:  # a carry is batch-dependent when the scan's result for it is
            kinds.append("batch" if kind_of(e.outvars[j - nc]) == "batch" else kind_of(a))
        else:
            kinds.append(kind_of(a))
    return body, tuple(outer), tuple(kinds)


def layer_sources(traced: TracedStep, layers: Sequence[Layer], fused_attention: bool = True) -> dict[str, LayerSource]:
    """Per distinct layer fingerprint: the layer's forward, input kinds and forward-and-backward program.
    Identical blocks are analysed once; a layer made of one ``lax.scan`` iteration is that iteration's body.
    ``fused_attention``: the device's (:attr:`DeviceSpec.fused_attention`)."""
    spec = traced.spec
    forward = spec.forward
    fwd = forward.jaxpr
    batch = {v for v, b in zip(fwd.invars, traced.microbatched_grad_inputs) if b}
    for e in fwd.eqns:
        if any(not isinstance(a, Literal) and a in batch for a in e.invars):
            batch.update(e.outvars)
    diffable = differentiable_vars(fwd, spec.diff_mask) | {v for v, d in zip(fwd.invars, spec.diff_mask) if d}
    dims = batch_dims(fwd, {v: 0 for v, b in zip(fwd.invars, traced.microbatched_grad_inputs)
                            if b and getattr(v.aval, "shape", ())})  # a time-major sequence: its second

    def kind_of(v) -> str:
        floating = jax.numpy.issubdtype(v.aval.dtype, jax.numpy.inexact)
        if v in batch:
            return "batch" if v in diffable and floating else "data"
        return "param" if v in diffable and floating else "const"

    out = {}
    for lay in layers:
        if lay.fingerprint in out:
            continue
        if lay.iteration is not None:
            closed, ins, kinds = _scan_iteration(forward, lay, kind_of)
            e = fwd.eqns[lay.eqn_range[0]]
            xs_from = e.params["num_consts"] + e.params["num_carry"]  # a scanned operand loses its leading axis
            in_dims = [None if isinstance(v, Literal) or v not in dims else
                       (dims[v] - 1 if dims[v] >= 1 else None) if j >= xs_from else dims[v] for j, v in enumerate(ins)]
        else:
            graph = layer_graph(forward, range(*lay.eqn_range), spec.diff_mask)  # the runtime's slice of it
            closed, ins = jex_core.ClosedJaxpr(graph.jaxpr, graph.consts), graph.inputs
            kinds = tuple(kind_of(v) for v in ins)
            in_dims = [dims.get(v) for v in ins]
        out[lay.fingerprint] = LayerSource(closed=closed, inputs=tuple(ins), kinds=kinds,
                                           program=layer_program(closed, kinds, in_dims, fused_attention))
    return out


def layer_programs(traced: TracedStep, layers: Sequence[Layer]) -> dict[str, tuple]:
    """Per distinct layer fingerprint: (forward ClosedJaxpr, forward-and-backward ClosedJaxpr, differentiated input
    mask, backward FLOPs)."""
    out = {}
    for fp, src in layer_sources(traced, layers).items():
        out[fp] = (src.closed, src.program.closed, src.diff, _backward_flops(src.program))
    return out


def _backward_flops(program: LayerProgram) -> float:
    j = program.closed.jaxpr
    return sum(_flops(eqn_cost(j.eqns[i])) for i in program.backward_eqns)


def _traced_batch_size(traced: TracedStep) -> int | None:
    dims = {v.aval.shape[0] for v, b in zip(traced.jaxpr.jaxpr.invars, traced.batch_mask)
            if b and getattr(v.aval, "shape", ())}
    return dims.pop() if len(dims) == 1 else None


_RELAYOUTS = frozenset({"transpose", "reshape", "squeeze", "expand_dims", "convert_element_type", "copy"})


def _moved_ids(traced: TracedStep) -> set[int]:
    """The step's equations of the work moved out of the loss and of its backward (:data:`MOVED_WORK_SCOPE`)."""
    return {i for i, e in enumerate(traced.jaxpr.jaxpr.eqns)
            if i != traced.grad_index and MOVED_WORK_SCOPE in name_stack(e)}


def update_kernels(traced: TracedStep) -> tuple[ScaledKernel, ...]:
    """The kernels of the step outside its gradient equation (optimizer update, metrics) but the moved work's:
    nothing in them scales with the batch once the gradient is taken."""
    outer = traced.jaxpr.jaxpr
    moved = _moved_ids(traced)
    ids = [i for i in range(len(outer.eqns)) if i != traced.grad_index and i not in moved]
    return tuple(program_kernels(outer, ids, is_batch=lambda v: False))


def moved_work(traced: TracedStep, layer_reads: Mapping[int, set[int]], opt_state: float,
               per_byte: bool = False) -> MovedWork | None:
    """The moved work of ``traced`` (None: none). ``layer_reads``: per layer, the loss inputs it reads;
    ``opt_state``: the optimizer state bytes of the weights only the moved work reads, or (``per_byte``) the bytes per
    byte of a trained parameter to give them, where no state was found for them."""
    ids = sorted(_moved_ids(traced))
    if not ids:
        return None
    outer, g = traced.jaxpr.jaxpr, traced.grad_index
    kernels = tuple(program_kernels(outer, ids, is_batch=lambda v: True))  # (scale 1: the traced size, once)
    made_before = [v for i in ids if i < g for v in outer.eqns[i].outvars]
    read_later = {a for e in outer.eqns[g:] for a in e.invars if not isinstance(a, Literal)}
    read_later |= {a for a in outer.outvars if not isinstance(a, Literal)}
    first_inputs = len(traced.grad_eqn.invars) - traced.spec.num_hoisted
    results = {a for a in traced.grad_eqn.invars[first_inputs:] if not isinstance(a, Literal)}  # (inputs of the
    # loss, held where it reads them)
    held_vars = {v for v in made_before if v in read_later and v not in results}
    held = sum(aval_bytes(v.aval) for v in held_vars)
    moved = set(ids)  # (what its backward hands on, the weights' gradients, is counted with them)
    handed = {a for i, e in enumerate(outer.eqns) if i > g and i not in moved for a in e.invars
              if not isinstance(a, Literal)} | {a for a in outer.outvars if not isinstance(a, Literal)}
    for i in reversed(ids):  # (and what becomes them by a relayout XLA folds into its producer: dW.T)
        e = outer.eqns[i]
        if i > g and e.primitive.name in _RELAYOUTS and any(v in handed for v in e.outvars):
            handed.update(a for a in e.invars if not isinstance(a, Literal))
    transient = max((aval_bytes(v.aval) for i in ids for v in outer.eqns[i].outvars
                     if v not in held_vars and not (i > g and v in handed)), default=0)
    grad_eqn, spec = traced.grad_eqn, traced.spec
    weights = moved_work_inputs(outer, g)
    trained = spec.returned_mask or spec.diff_mask  # (trained, but not differentiated by the loss: read by it alone)
    only_here = [k for k in weights if k < len(trained) and trained[k] and not spec.diff_mask[k]]
    own = sum(aval_bytes(grad_eqn.invars[k].aval) for k in only_here)
    in_layers = set().union(*layer_reads.values()) if layer_reads else set()  # (other inputs only it reads: a graph's
    fixed = sum(aval_bytes(grad_eqn.invars[k].aval) for k in weights  # adjacency passed whole)
                if not (k < len(trained) and trained[k]) and k not in in_layers)
    home = min((l for l, r in layer_reads.items() if r & weights), default=None)
    if home is None:
        home = min((l for l, r in layer_reads.items() if r & set(range(first_inputs, len(grad_eqn.invars)))),
                   default=0)
    return MovedWork(kernels=kernels, flops=sum(_flops(k.at(1.0)) for k in kernels), held_bytes=int(held),
                     transient_bytes=int(transient), param_bytes=int(own),
                     state_bytes=int(own * (2 + opt_state) if per_byte else 2 * own + opt_state),
                     input_bytes=int(fixed), home_layer=home,
                     result_inputs=tuple(range(first_inputs, len(grad_eqn.invars))))


def profile(step_fn: Callable, *example_args, cluster: Cluster | str | None = None, measure: bool = False,
            batch_argnums=None, dtype=None, cache: ProfileCache | None = None, progress=None,
            traced: TracedStep | None = None, donated: Collection[int] | None = None) -> Profile:
    """Profile ``step_fn`` (a step written for :func:`autopp.parallelize`, with ``autopp.grad`` inside).

    ``example_args`` may be arrays or ``jax.ShapeDtypeStruct``s: nothing is allocated unless ``measure``.
    Times are for ``cluster`` (a :class:`Cluster` or a string such as ``"128x8xH100"``; default: the
    local devices) by the roofline model; with ``measure=True`` each distinct layer is compiled and
    timed on the first local device (cached in a JSON file), the local device model is calibrated to
    the measurements, and measured times are reported. ``traced``: the step already traced at ``example_args``
    (by :func:`autopp.core.trace_step`), which the profile then reuses instead of tracing it again. ``donated``: the
    indices of the step's flat inputs whose buffers it may reuse (the leaves of ``donate_argnums``); the update of a
    parameter or state not among them writes a new copy beside the old (:attr:`Profile.update_copies`). None (the
    default): the update runs in place.
    """
    forget_warnings()  # each profile says what it cannot price
    if isinstance(cluster, str):
        cluster = Cluster.parse(cluster)
    elif cluster is None:
        cluster = Cluster.local()
    elif not isinstance(cluster, Cluster):
        raise TypeError(f"profile: cluster must be a Cluster or a string like '128x8xH100', got {cluster!r}.")
    if measure and cluster.device.name != Cluster.local().device.name:
        raise ValueError(
            f"profile: measure=True times layers on the local {Cluster.local().device.name} devices, but the "
            f"cluster is {cluster}; profile the local cluster (cluster=None) or use measure=False."
        )
    args = tuple(example_args)
    if traced is None:
        traced = trace_step(step_fn, args, normalize_batch_argnums(batch_argnums, len(args), "profile"), "profile")
    spec = traced.spec
    forward = spec.forward
    fwd = forward.jaxpr
    batch_invars = traced.microbatched_grad_inputs
    layers = group_layers(forward, batch_invars, spec.diff_mask)
    if dtype is None:
        dtype = _dominant_float_dtype(fwd)
    device = cluster.device

    # Programs and (optionally) measurements: once per distinct layer structure.
    sources = layer_sources(traced, layers, device.fused_attention)
    cache = cache or (ProfileCache() if measure else None)
    by_fp: dict[str, tuple] = {}
    for lay in layers:
        if lay.fingerprint in by_fp:
            continue
        src = sources[lay.fingerprint]
        m = None
        if measure:
            m = cache.get(device.name, lay.fingerprint)
            if m is None:
                if progress:
                    progress(f"measuring {lay.name}")
                m = measure_layer(src.closed, src.diff, is_param=[k == "param" for k in src.kinds])
                both = _ones_vjp(src.closed, src.diff)
                cache.put(device.name, lay.fingerprint, m, kernels={
                    "forward": kernel_costs(src.closed.jaxpr), "forward_backward": kernel_costs(both.jaxpr)})
        by_fp[lay.fingerprint] = (src, _backward_flops(src.program), m)
    time_model = KernelTimeModel.from_device(device, dtype)
    if measure:
        samples = cache.samples(device.name)
        if len(samples) >= 6:
            time_model = KernelTimeModel.calibrate(device.name, samples)

    # Optimizer state: each leaf belongs to the parameter whose update reads it.
    grad_eqn = traced.grad_eqn
    diff_idx = spec.diff_indices
    param_of_out = {1 + spec.num_aux + j: k for j, k in enumerate(diff_idx)}
    owners = optimizer_state_owners(traced.jaxpr.jaxpr, traced.grad_index, param_of_out, traced.batch_mask,
                                    dict(traced.zeroed_gradients))
    step_invars = traced.jaxpr.jaxpr.invars
    param_step_inputs = {step_invars.index(a) for a in grad_eqn.invars if not isinstance(a, Literal) and a in step_invars}
    opt_bytes_of_param: dict[int, int] = {}
    for i, k in owners.items():
        if i not in param_step_inputs:
            opt_bytes_of_param[k] = opt_bytes_of_param.get(k, 0) + aval_bytes(step_invars[i].aval)
    # state found for the moved work's results (sent values, no parameters) is the state of the weights only that work
    # reads, whose gradients its backward hands on: it goes with them (a hypernetwork's generator under Adam)
    moved_opt = sum(opt_bytes_of_param.pop(k, 0) for k in range(len(grad_eqn.invars) - spec.num_hoisted,
                                                                 len(grad_eqn.invars)))

    times: dict[str, tuple[float, float]] = {}
    for fp, (src, _, m) in by_fp.items():
        if m is not None:
            times[fp] = (m.forward_s, m.backward_s)
        else:
            times[fp] = program_times(src.program, time_model)
    fwd_index = {v: k for k, v in enumerate(fwd.invars)}
    frozen = {k for k, f in enumerate(traced.frozen_grad_inputs) if f}  # held like parameters, nothing else
    out_layers = []
    layer_reads: dict[int, set[int]] = {}
    for lay in layers:
        src, bwd_flops, m = by_fp[lay.fingerprint]
        fractions = lay.param_fractions or (1.0,) * len(lay.param_indices)  # a scan iteration: its rows' part
        opt = int(round(sum(opt_bytes_of_param.get(k, 0) * f for k, f in zip(lay.param_indices, fractions))))
        f_t, b_t = times[lay.fingerprint]
        inputs = _layer_inputs(forward, lay, layers, sources)
        layer_reads[lay.index] = {fwd_index[v] for v in inputs if v in fwd_index}
        out_layers.append(LayerProfile(
            index=lay.index, name=lay.name, fingerprint=lay.fingerprint, flops=lay.flops + lay.transcendentals,
            backward_flops=bwd_flops, param_bytes=lay.param_bytes, grad_bytes=lay.param_bytes, optimizer_bytes=opt,
            activation_bytes=lay.activation_bytes, recompute_activation_bytes=lay.input_bytes,
            output_bytes=lay.output_bytes, forward_time_s=f_t, backward_time_s=b_t, measured=m is not None,
            param_inputs=tuple(fwd_index.get(v) if v in fwd_index and (
                kind == "param" and spec.diff_mask[fwd_index[v]] or fwd_index[v] in frozen) else None
                for v, kind in zip(inputs, src.kinds)),
            row_fractions=tuple((k, f) for k, f in zip(lay.param_indices, fractions) if f < 1.0),
            crossing_bytes=lay.crossing_bytes, built_bytes=lay.built_bytes,
        ))
    graph = cost_graph(layers)
    for lp in out_layers:
        graph.nodes[lp.index].update(lp.to_dict())
    update_work = update_kernels(traced)
    with_state = [k for k in diff_idx if opt_bytes_of_param.get(k)]
    moved = moved_work(traced, layer_reads, moved_opt if moved_opt else sum(
        opt_bytes_of_param[k] for k in with_state) / max(1, sum(aval_bytes(fwd.invars[k].aval) for k in with_state)),
        per_byte=not moved_opt)
    update = sum(_flops(k.at(1.0)) for k in update_work) + (moved.flops if moved else 0.0)  # every equation
    # outside the gradient's, once
    forward_flops = sum(l.flops for l in out_layers)
    backward_flops = sum(l.backward_flops for l in out_layers)
    state = {k: (aval_bytes(fwd.invars[k].aval), aval_bytes(fwd.invars[k].aval), opt_bytes_of_param.get(k, 0))
             for k in diff_idx}
    state.update({k: (aval_bytes(fwd.invars[k].aval), 0, opt_bytes_of_param.get(k, 0)) for k in sorted(frozen)})
    copies = (0.0, 0.0) if donated is None else _update_copies(traced, owners, param_step_inputs, state,
                                                               frozenset(donated))
    return Profile(
        layers=tuple(out_layers), graph=graph, cluster=cluster, time_model=time_model,
        total_flops=forward_flops + backward_flops + update, forward_flops=forward_flops,
        backward_flops=backward_flops, update_flops=update,
        param_bytes=sum(aval_bytes(fwd.invars[k].aval) for k in diff_idx
                        if not moved or k not in moved.result_inputs) + (moved.param_bytes if moved else 0),
        fingerprint=traced.fingerprint,
        batch_size=_traced_batch_size(traced), programs={fp: src.program for fp, (src, _, _) in by_fp.items()},
        state_bytes=state, update_kernels=update_work, moved=moved, param_names=_param_names(traced),
        structure_fingerprint=_structure_fingerprint(out_layers, fwd, diff_idx), update_copies=copies,
    )


def _update_copies(traced: TracedStep, owners: Mapping[int, int], param_step_inputs: set[int],
                   state: Mapping[int, tuple[int, int, int]], donated: frozenset[int]) -> tuple[float, float]:
    """:attr:`Profile.update_copies`: the shares of the parameters' and of the optimizer state's bytes whose step
    inputs are not in ``donated`` (step input ``i`` is state of parameter ``owners[i]``)."""
    step_invars = traced.jaxpr.jaxpr.invars
    diff = set(traced.spec.diff_indices)
    params = new_params = 0
    for k, (b, _, _) in state.items():
        a = traced.grad_eqn.invars[k]
        if not isinstance(a, Literal) and a in step_invars:  # (not a value the step computes: moved work's results)
            params += b
            new_params += b if k in diff and step_invars.index(a) not in donated else 0
    new_state = sum(aval_bytes(step_invars[i].aval) for i, k in owners.items()
                    if i not in param_step_inputs and i not in donated and k in state)
    opt = sum(b[2] for b in state.values())
    return (new_params / params if params else 0.0, min(1.0, new_state / opt) if opt else 0.0)


def _structure_fingerprint(layers, fwd, diff_idx) -> str:
    import hashlib

    h = hashlib.sha256()
    h.update(repr([l.name for l in layers]).encode())
    h.update(repr([fwd.invars[k].aval.str_short() for k in diff_idx]).encode())
    # the other inputs (the batch) by their per-example shape: a plan made at one sequence length, image size or
    # feature width does not replay at another, whatever the batch size
    diff = set(diff_idx)
    h.update(repr([(v.aval.shape[1:], str(v.aval.dtype)) for k, v in enumerate(fwd.invars)
                   if k not in diff and hasattr(v.aval, "shape")]).encode())
    return "layers:" + h.hexdigest()[:16]


def _param_names(traced: TracedStep) -> dict[int, str]:
    """Differentiated forward input -> the step argument's pytree path feeding it."""
    step_in = {v: k for k, v in enumerate(traced.jaxpr.jaxpr.invars)}
    out = {}
    for k in traced.spec.diff_indices:
        a = traced.grad_eqn.invars[k]
        if not isinstance(a, Literal) and a in step_in:
            out[k] = traced.leaf_paths[step_in[a]]
    return out


def program_times(program: LayerProgram, time_model: KernelTimeModel) -> tuple[float, float]:
    """Forward and backward seconds of a layer's program on one device at the traced batch: its kernels (matmuls at
    their operand dtype's peak, fused attention as one flash kernel, the rest fused and memory-bound)."""
    j = program.closed.jaxpr
    kw = dict(is_batch=program.batch_vars.__contains__, dependent=program.dependent_eqns.__contains__,
              regions=program.attention_regions, work=program.region_work, backward_eqns=program.backward_eqns)
    fwd_ids = [i for i in range(len(j.eqns)) if i not in program.backward_eqns]
    bwd_ids = sorted(program.backward_eqns)
    fwd, bwd = program_kernels(j, fwd_ids, **kw), program_kernels(j, bwd_ids, **kw)
    return (time_model.scaled_time(fwd) + time_model.per_step_time(fwd),
            time_model.scaled_time(bwd) + time_model.per_step_time(bwd))


def _layer_inputs(forward, lay: Layer, layers, sources) -> tuple:
    """The loss-forward variables feeding this layer's program, in its input order (a layer sharing its
    fingerprint with an earlier one reads the same positions of its own equations)."""
    src = sources[lay.fingerprint]
    if lay.iteration is not None:
        return tuple(forward.jaxpr.eqns[lay.eqn_range[0]].invars)
    first = next(l for l in layers if l.fingerprint == lay.fingerprint)
    if first.index == lay.index:
        return src.inputs
    # map by position: the k-th distinct value read from outside in equation order
    fwd = forward.jaxpr
    ins, defined = [], set()
    for i in range(*lay.eqn_range):
        for a in fwd.eqns[i].invars:
            if not isinstance(a, Literal) and a not in defined and a not in ins:
                ins.append(a)
        defined.update(fwd.eqns[i].outvars)
    consts = set(forward.jaxpr.constvars)
    ins = [v for v in ins if v not in consts]
    if len(ins) == len(src.inputs):
        return tuple(ins)
    # another count (the first layer computes a value the others read from outside, a graph's degrees): match the
    # two layers' equations and read each input where the matched equation reads it
    a = [fwd.eqns[i] for i in range(*first.eqn_range)]
    b = [fwd.eqns[i] for i in range(*lay.eqn_range)]
    matcher = difflib.SequenceMatcher(None, [eqn_signature(e) for e in a], [eqn_signature(e) for e in b],
                                      autojunk=False)
    to = {}
    for block in matcher.get_matching_blocks():
        for k in range(block.size):
            for x, y in zip(a[block.a + k].invars, b[block.b + k].invars):
                if not isinstance(x, Literal) and not isinstance(y, Literal):
                    to.setdefault(x, y)
    return tuple(to.get(v, v) for v in src.inputs)


def _ones_vjp(closed: jex_core.ClosedJaxpr, diff: Sequence[bool]) -> jex_core.ClosedJaxpr:
    """Forward plus backward of a layer with cotangents of ones (what measured samples are paired with)."""

    avals = [v.aval for v in closed.jaxpr.invars]
    forward = forward_with_vjp(closed, [i for i, d in enumerate(diff) if d])

    def fwd_bwd(*xs):
        outs, vjp = forward(*xs)
        cts = [jax.numpy.ones_like(o) if jax.numpy.issubdtype(o.dtype, jax.numpy.inexact)
               else np.zeros(o.shape, jax.dtypes.float0) for o in outs]
        return outs, vjp(cts)

    return jax.make_jaxpr(fwd_bwd)(*[jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals])


def _flops(c) -> float:
    return c.flops + c.transcendentals


def _dominant_float_dtype(jaxpr) -> str:
    counts: dict[str, int] = {}
    for v in jaxpr.invars:
        if jax.numpy.issubdtype(v.aval.dtype, jax.numpy.floating):
            counts[str(v.aval.dtype)] = counts.get(str(v.aval.dtype), 0) + aval_bytes(v.aval)
    return max(counts, key=counts.get) if counts else "float32"


def format_profile_table(p: Profile) -> str:
    lines = [f"profile on {p.cluster}",
             f"{'layer':>5}  {'name':<12} {'GFLOP fwd':>10} {'GFLOP bwd':>10} {'time ms':>9} {'trained MB':>10} "
             f"{'optim MB':>9} {'activ MB':>9} {'out MB':>8}  fingerprint"]
    for l in p.layers:
        lines.append(f"{l.index:>5}  {l.name:<12} {l.flops / 1e9:>10.3f} {l.backward_flops / 1e9:>10.3f} "
                     f"{l.time_s * 1e3:>9.3f} {l.param_bytes / 1e6:>10.2f} {l.optimizer_bytes / 1e6:>9.2f} "
                     f"{l.activation_bytes / 1e6:>9.2f} {l.output_bytes / 1e6:>8.2f}  {l.fingerprint[:10]}")
    lines.append(f"{'total':>5}  {'':<12} {p.forward_flops / 1e9:>10.3f} {p.backward_flops / 1e9:>10.3f} "
                 f"{sum(l.time_s for l in p.layers) * 1e3:>9.3f} {p.param_bytes / 1e6:>10.2f} "
                 f"{sum(l.optimizer_bytes for l in p.layers) / 1e6:>9.2f} "
                 f"{sum(l.activation_bytes for l in p.layers) / 1e6:>9.2f}")
    div, name = unit(p.total_flops, "flop")
    lines.append(f"whole step: {p.total_flops / div:.4g} {name} (forward {p.forward_flops / div:.4g}, backward "
                 f"{p.backward_flops / div:.4g}, update {p.update_flops / div:.4g})")
    return "\n".join(lines)

"""Every use of JAX internals lives here, so that a JAX upgrade touches one file.

Supported JAX range: ``>=0.10,<0.11`` (tested with 0.10.2).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import re
import sys
import threading

import jax
import numpy as np
from jax.extend import core as jex_core
from jax.interpreters import mlir

SUPPORTED_JAX = (">=0.10", "<0.11")

# Primitives whose body is an ordinary call with no semantics of its own: inlined when tracing.
CALL_PRIMITIVE_NAMES = frozenset({"jit", "pjit", "closed_call", "core_call", "remat_call"})


def call_body(eqn) -> jex_core.ClosedJaxpr | None:
    """The called jaxpr of a plain call equation (``jit`` and friends), or None."""
    if eqn.primitive.name not in CALL_PRIMITIVE_NAMES:
        return None
    body = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
    if body is None:
        return None
    if isinstance(body, jex_core.Jaxpr):
        body = jex_core.ClosedJaxpr(body, ())
    return body


def register_fallback_lowering(primitive, impl) -> None:
    """Lower ``primitive`` by tracing ``impl`` (so a traced step can still be jitted whole)."""
    mlir.register_lowering(primitive, mlir.lower_fun(impl, multiple_results=primitive.multiple_results))


def _internal_floating_point_error():
    from jax._src.api_util import InternalFloatingPointError

    return InternalFloatingPointError


InternalFloatingPointError = _internal_floating_point_error()
"""What a compiled program raises under ``jax_debug_nans`` (``.name``, ``.ty``); ``jax.jit`` turns it into a
``FloatingPointError`` naming the operation."""


def refuse_batching(primitive, message: str) -> None:
    """Make ``jax.vmap`` of ``primitive`` raise ``ValueError(message)`` instead of JAX's "Batching rule ... not
    implemented"."""
    from jax._src.interpreters import batching

    def rule(*args, **params):
        raise ValueError(message)

    batching.primitive_batchers[primitive] = rule


def refuse_checkify(primitive, message: str) -> None:
    """Make ``jax.experimental.checkify.checkify`` of a function that binds ``primitive`` raise
    ``ValueError(message)`` (checkify cannot see inside it: its checks would be lost silently)."""
    from jax._src import checkify

    def rule(error, enabled_errors, *invals, **params):
        raise ValueError(message)

    checkify.error_checks[primitive] = rule


def is_tracer(x) -> bool:
    return isinstance(x, jax.core.Tracer)


def new_jaxpr(constvars, invars, outvars, eqns, effects, name: str = "autopp") -> jex_core.Jaxpr:
    """A jaxpr over existing equations (a slice of another), with the debug info JAX expects."""
    info = jex_core.DebugInfo(name, name, tuple(f"in{i}" for i in range(len(invars))),
                              tuple(f"out{i}" for i in range(len(outvars))))
    return jex_core.Jaxpr(constvars, invars, outvars, eqns, effects, debug_info=info)


# -- one compile for programs that differ only in their devices ------------------------------------------
_MODULE_NAME = re.compile(r"^module @[\w.$-]+", re.MULTILINE)


def lowered_devices(lowered):
    """The devices a lowered program runs on (a ``DeviceList``), or None. A stand-in for a lowered program (the
    runtime's programs mapped onto other devices) gives them as ``mapped_devices``."""
    mapped = getattr(lowered, "mapped_devices", None)
    if mapped is not None:
        return mapped
    return getattr(getattr(lowered, "_lowering", None), "_device_list", None)


def device_list(devices):
    """``devices`` as the ``DeviceList`` JAX's executables are made for."""
    from jax._src.interpreters import pxla

    return pxla._create_device_list(tuple(devices))


def device_free_key(lowered) -> tuple | None:
    """A key equal for two lowered programs that differ only in the devices they run on (same StableHLO,
    same number of devices, same platform), or None when that cannot be told. Shardings in StableHLO name
    logical device positions, so stages with equal programs and layouts on different devices share a key."""
    try:
        lowering = lowered._lowering
        devices = lowering._device_list
        text = lowered.as_text()
    except Exception:  # noqa: BLE001 - other lowering kinds simply compile on their own
        return None
    if devices is None:
        return None
    body = _MODULE_NAME.sub("module", text, count=1)
    # jit drops unused arguments from the module, so the Python-side signature is part of the key.
    kept = tuple(sorted(lowering.compile_args.get("kept_var_idx", ())))
    signature = (str(jax.tree.structure(lowered.args_info)), str(lowered.out_tree), kept)
    return (devices[0].platform, len(devices), hashlib.sha256(body.encode()).hexdigest(), signature)


def is_local(lowered) -> bool:
    """Whether a lowered program runs on this process's devices only (always, in a single-process run)."""
    devices = lowered_devices(lowered)
    if devices is None or jax.process_count() == 1:
        return True
    me = jax.process_index()
    return all(d.process_index == me for d in devices)


def map_sharding(sharding, devmap):
    """``sharding`` with each device ``d`` replaced by ``devmap[d]`` (NamedSharding, SingleDeviceSharding; TypeError
    for others, KeyError for a device ``devmap`` does not name)."""
    from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding

    if isinstance(sharding, SingleDeviceSharding):
        return SingleDeviceSharding(devmap[sharding._device], memory_kind=sharding.memory_kind)
    if isinstance(sharding, NamedSharding):
        mesh = sharding.mesh
        devices = np.empty(mesh.devices.shape, dtype=object)
        devices.flat[:] = [devmap[d] for d in mesh.devices.flat]
        new_mesh = Mesh(devices, mesh.axis_names, axis_types=mesh.axis_types)
        return NamedSharding(new_mesh, sharding.spec, memory_kind=sharding.memory_kind)
    raise TypeError(f"no device mapping for {type(sharding).__name__}")


def serialize_compiled(compiled) -> bytes:
    """The serialized executable of ``compiled`` (what :func:`retarget` loads onto other devices). Only an
    executable compiled in this process serializes completely: on CPU, one loaded from serialized form (JAX's
    persistent compilation cache, or :func:`retarget`) serializes without its compiled functions, and what is
    loaded from that fails when run ("Function ... not found")."""
    unloaded = compiled._executable._unloaded_executable
    if unloaded is None:
        raise ValueError("executable without an unloaded form")
    return unloaded.backend.serialize_executable(unloaded.xla_executable)


def retarget(compiled, lowered, serialized=None):
    """``lowered`` compiled by reusing ``compiled`` (the same program, maybe on other devices): the executable
    is loaded for ``lowered``'s devices instead of compiled again (~40 ms instead of ~1 s on CPU); ``compiled``
    itself when the devices are the same. ``serialized``: the executable's serialized form from
    :func:`serialize_compiled` of a fresh compilation of the same program, or a function returning it (called
    only when the devices differ; returning None: there is none); default: ``compiled`` serialized now. Raises
    ValueError when the executable cannot be moved; the caller then compiles."""
    from jax._src import compiler

    source = compiled._executable
    unloaded = source._unloaded_executable
    if unloaded is None or unloaded.host_callbacks or unloaded.ordered_effects or unloaded.unordered_effects:
        raise ValueError("executable with callbacks or effects")
    target_devices = lowered_devices(lowered)
    if target_devices == unloaded.device_list:
        return compiled
    if len(target_devices) != len(unloaded.device_list):
        raise ValueError("device counts differ")
    if callable(serialized):
        serialized = serialized()
        if serialized is None:
            raise ValueError("no complete serialized form of the executable")
    devmap = dict(zip(unloaded.device_list, target_devices))
    backend = unloaded.backend
    options = compiler.get_compile_options(
        num_replicas=1, num_partitions=len(target_devices),
        device_assignment=np.array(list(target_devices), dtype=object).reshape(1, -1), backend=backend)
    options.executable_build_options.use_spmd_partitioning = len(target_devices) > 1
    if serialized is None:
        serialized = backend.serialize_executable(unloaded.xla_executable)
    loaded = backend.deserialize_executable(serialized, target_devices, options)
    moved = dataclasses.replace(
        unloaded, xla_executable=loaded, device_list=target_devices,
        input_shardings=[map_sharding(s, devmap) for s in unloaded.input_shardings],
        output_shardings=[map_sharding(s, devmap) for s in unloaded.output_shardings])
    params = compiled._params
    return type(compiled)(moved.load(), list(params.const_args), lowered.args_info, lowered.out_tree,
                          compiled._no_kwargs, params.in_types, params.out_types)


# -- device-to-device copies without jax.device_put's Python dispatch --------------------------------------
def same_shard_positions(source, dest, shape) -> bool:
    """Whether ``source`` and ``dest`` put the same slice of an array of ``shape`` at each position of their
    device lists (so shards can be copied position by position, with no resharding)."""
    try:
        if source.num_devices != dest.num_devices or not (source.is_fully_addressable and dest.is_fully_addressable):
            return False
        src_map, dst_map = source.devices_indices_map(tuple(shape)), dest.devices_indices_map(tuple(shape))
        return all(src_map[a] == dst_map[b]
                   for a, b in zip(source._internal_device_list, dest._internal_device_list))
    except Exception:  # noqa: BLE001 - shardings this cannot read take the general path
        return False


def remat_refuses(effects) -> list:
    """The effects among ``effects`` that ``jax.checkpoint`` cannot recompute (an ``io_callback``'s), as JAX decides."""
    from jax._src import effects as jax_effects

    return list(jax_effects.remat_allowed_effects.filter_not_in(effects))


def weak_typed(x):
    """``x`` (a ``jax.Array``) as JAX's weak-typed array of the same buffers (what a value computed from a Python
    scalar is under ``jax.jit``), without a copy; ``x`` itself if it is weak already or no ``jax.Array``."""
    from jax._src import array

    if not isinstance(x, array.ArrayImpl) or x.weak_type:
        return x
    return array.ArrayImpl(x.aval.update(weak_type=True), x.sharding, x._arrays, committed=x._committed,
                           _skip_checks=True)


def copy_shards(xs, shardings) -> list:
    """Copy each array's shards to the devices of its destination sharding, position by position (the
    shardings must satisfy :func:`same_shard_positions`): the runtime call ``jax.device_put`` ends in."""
    from jax._src.lib import xla_client as xc

    reuse = xc.ArrayCopySemantics.REUSE_INPUT
    return xc.batched_copy_array_to_devices_with_sharding(
        list(xs), [s._internal_device_list for s in shardings], list(shardings), [reuse] * len(xs))


# -- source information (name stacks) through re-interpretation --------------------------------------------
def bind_eqn(eqn, invals):
    """Bind ``eqn``'s primitive to ``invals`` as ``jax.core.eval_jaxpr`` does, keeping the equation's name
    stack and traceback, so that a re-traced jaxpr keeps its named scopes (e.g. :data:`FUSED_ATTENTION_SCOPE`)."""
    from jax._src import source_info_util

    name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
    with source_info_util.user_context(eqn.source_info.traceback, name_stack=name_stack), eqn.ctx.manager:
        return eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(eqn.params))


def custom_vjp_backward(eqn) -> jex_core.ClosedJaxpr | None:
    """The backward of a ``jax.custom_vjp`` call (an equation ``custom_vjp_call``) traced as one program:
    ``[*residuals, *cotangents]`` -> one cotangent per primal input (the closed-over constants excluded; a symbolic
    zero or None as zeros). None where it cannot be traced (a backward that raises, an integer output)."""
    from jax._src import ad_util

    params = eqn.params
    num_consts = params["num_consts"]
    in_avals = [v.aval for v in eqn.invars]
    try:
        fwd_jaxpr, _ = params["fwd_jaxpr_thunk"].call_wrapped(*([True] * (len(in_avals) - num_consts)))
        _, res_tree, input_fwds = params["out_trees"]()
        produced = iter(v.aval for v in fwd_jaxpr.outvars)
        res_avals = [next(produced) if f is None else in_avals[f] for f in input_fwds]
        if res_tree.num_leaves != len(res_avals) or not all(
                jax.numpy.issubdtype(v.aval.dtype, jax.numpy.inexact) for v in eqn.outvars):
            return None
        primal_avals = in_avals[num_consts:]

        def backward(*args):
            cts = params["bwd"].call_wrapped(*args)
            return [jax.numpy.zeros(a.shape, a.dtype) if ct is None or isinstance(ct, ad_util.Zero) else ct
                    for ct, a in zip(cts, primal_avals)]

        specs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in [*res_avals, *(v.aval for v in eqn.outvars)]]
        return jax.make_jaxpr(backward)(*specs)
    except Exception:  # noqa: BLE001 - a backward this cannot trace is left unread
        return None


def name_stack(eqn) -> str:
    """The equation's name stack as text (``jvp(autopp_fused_attention)/...``)."""
    return str(eqn.source_info.name_stack)


def user_line(eqn) -> str:
    """Where the user's code made the equation: ``file.py:12:8 (function)``. Where that is inside an installed
    library (a Flax or Equinox layer: ``equinox/nn/_dropout.py``), the innermost line of the user's own code that
    called it, with the library's line after it: ``train.py:30:8 (loss; in equinox/nn/_dropout.py:95)``."""
    from jax._src import source_info_util

    innermost = source_info_util.summarize(eqn.source_info)
    frames = list(source_info_util.user_frames(eqn.source_info.traceback))
    if not frames or not _installed(frames[0].file_name):
        return innermost
    own = next((f for f in frames if not _installed(f.file_name)), None)
    if own is None:
        return innermost
    library = frames[0].file_name
    for marker in ("site-packages/", "dist-packages/"):
        library = library.split(marker, 1)[-1]
    where = source_info_util._summarize_frame(own)
    return f"{where[:-1]}; in {library}:{frames[0].start_line})" if where.endswith(")") else where


def _installed(file_name: str) -> bool:
    return "site-packages" in file_name or "dist-packages" in file_name


# -- fused attention -------------------------------------------------------------------------------------------
FUSED_ATTENTION_SCOPE = "autopp_fused_attention"
"""Named scope autopp puts around every ``jax.nn.dot_product_attention`` call while it traces a step: the cost
model prices the equations under it (forward and backward) as one fused (flash) attention kernel, as cuDNN's
fused attention runs it on GPUs, with no ``s x s`` tensor in memory. The scope is metadata only: the traced
program computes exactly what the call computes."""


def _replayed(fn, cache: dict, args, kwargs):
    """``fn(*args, **kwargs)``, traced once per signature: its jaxpr is cached by the arguments' shapes and dtypes
    and the other (hashable) arguments, and replayed equation by equation into the current trace. A model with 96
    identical attention calls traces ``jax.nn.dot_product_attention``'s Python once, not 96 times (``parallelize``
    traces with ``jax.disable_jit``, so JAX's own jit cache does not apply). Arguments that are neither arrays nor
    hashable fall back to calling ``fn``."""
    flat, tree = jax.tree_util.tree_flatten((args, kwargs))
    is_array = [hasattr(x, "shape") and hasattr(x, "dtype") for x in flat]
    try:
        key = (tree, tuple((tuple(x.shape), str(x.dtype), bool(getattr(x, "weak_type", False))) if a else x
                           for x, a in zip(flat, is_array)))
        hash(key)
    except TypeError:
        return fn(*args, **kwargs)
    hit = cache.get(key)
    if hit is None:
        def flat_fn(*arrays):
            it = iter(arrays)
            leaves = [next(it) if a else x for x, a in zip(flat, is_array)]
            a_, k_ = jax.tree_util.tree_unflatten(tree, leaves)
            out = fn(*a_, **k_)
            out_flat, out_tree = jax.tree_util.tree_flatten(out)
            flat_fn.out_tree = out_tree
            return out_flat

        avals = [jax.ShapeDtypeStruct(x.shape, x.dtype, weak_type=bool(getattr(x, "weak_type", False)))
                 for x, a in zip(flat, is_array) if a]
        closed = jax.make_jaxpr(flat_fn)(*avals)
        hit = cache[key] = (closed, flat_fn.out_tree)
    closed, out_tree = hit
    return jax.tree_util.tree_unflatten(out_tree, _replay(closed, [x for x, a in zip(flat, is_array) if a]))


def _replay(closed, args) -> list:
    """``closed`` applied to ``args`` in the current trace, equation by equation (:func:`bind_eqn`)."""
    env = dict(zip(closed.jaxpr.constvars, closed.consts))
    env.update(zip(closed.jaxpr.invars, args))

    def read(v):
        return v.val if isinstance(v, jex_core.Literal) else env[v]

    for eqn in closed.jaxpr.eqns:
        outs = bind_eqn(eqn, [read(v) for v in eqn.invars])
        env.update(zip(eqn.outvars, outs if eqn.primitive.multiple_results else [outs]))
    return [read(v) for v in closed.jaxpr.outvars]


def fused_attention_scope(args, kwargs) -> str:
    """The scope name of one ``dot_product_attention(*args, **kwargs)`` call: :data:`FUSED_ATTENTION_SCOPE`, then
    ``_causal`` for ``is_causal=True``, then ``_window{left}x{right}_q{T}_k{S}`` for a ``local_window_size`` (query
    ``i`` sees keys ``i - left`` to ``i + right``; ``T`` and ``S`` the query and key lengths), which the cost model
    reads to price only the score blocks a flash kernel computes."""
    scope = FUSED_ATTENTION_SCOPE + ("_causal" if kwargs.get("is_causal") else "")
    window = kwargs.get("local_window_size")
    query, key = (args[i] if len(args) > i else kwargs.get(name) for i, name in enumerate(("query", "key")))
    if window is not None and query is not None and key is not None:
        left, right = (window, window) if isinstance(window, int) else tuple(window)
        scope += f"_window{int(left)}x{int(right)}_q{np.shape(query)[-3]}_k{np.shape(key)[-3]}"
    return scope


class marking_fused_attention:
    """While active, ``jax.nn.dot_product_attention`` runs under :data:`FUSED_ATTENTION_SCOPE` (``causal``
    appended for ``is_causal=True``). Re-entrant; restores the function on exit."""

    _depth = 0
    _original = None

    def __enter__(self):
        cls = type(self)
        if cls._depth == 0:
            original = jax.nn.dot_product_attention
            cls._original = original

            cache: dict = {}

            def dot_product_attention(*args, **kwargs):
                with jax.named_scope(fused_attention_scope(args, kwargs)):
                    return _replayed(original, cache, args, kwargs)

            dot_product_attention.__wrapped__ = original
            dot_product_attention.__doc__ = original.__doc__
            jax.nn.dot_product_attention = dot_product_attention
        cls._depth += 1
        return self

    def __exit__(self, *exc):
        cls = type(self)
        cls._depth -= 1
        if cls._depth == 0:
            jax.nn.dot_product_attention = cls._original
            cls._original = None
        return False


# -- lax.scan unrolled by replay ---------------------------------------------------------------------------------
def _scan_by_replay(f, init, xs, length, reverse):
    """What ``lax.scan`` under ``jax.disable_jit`` gives (the iterations unrolled: each reads its rows of ``xs`` by
    ``index_in_dim``, the ``ys`` stacked by ``concatenate``), with ``f`` traced once per carry type and replayed per
    iteration instead of run in Python per iteration: a 32-layer model's forward traces in about 0.1 s instead of
    0.28 s (measured on this repository's scanned GPT). None where that does not apply (a leaf that is not an array,
    lengths that disagree, a concrete integer carry, a body that does not trace abstractly): the caller then runs
    JAX's own."""
    from jax._src.lax import slicing
    from jax._src.lax.control_flow import loops

    init_flat, init_tree = jax.tree_util.tree_flatten(init)
    xs_flat, xs_tree = jax.tree_util.tree_flatten(xs)
    try:
        avals = [jax.typeof(x) for x in init_flat + xs_flat]
    except TypeError:
        return None
    if not all(type(a) is jax.core.ShapedArray for a in avals) or not all(a.shape for a in avals[len(init_flat):]):
        return None
    if any(not is_tracer(x) and not np.issubdtype(a.dtype, np.inexact) for x, a in zip(init_flat, avals)):
        return None  # a concrete integer carry (fori_loop's counter) stays concrete in JAX's unrolling: static indices
    n = length if length is not None else (xs_flat[0].shape[0] if xs_flat else None)
    if not n or any(x.shape[0] != n for x in xs_flat):
        return None
    x_avals = [jax.ShapeDtypeStruct(a.shape[1:], a.dtype) for a in avals[len(init_flat):]]

    def carry_type(carry_avals):
        return tuple((tuple(a.shape), a.dtype, bool(a.weak_type)) for a in carry_avals)

    def trace(key):
        def flat_body(*leaves):
            carry = jax.tree_util.tree_unflatten(init_tree, list(leaves[:len(init_flat)]))
            out_carry, y = f(carry, jax.tree_util.tree_unflatten(xs_tree, list(leaves[len(init_flat):])))
            carry_leaves, carry_tree = jax.tree_util.tree_flatten(out_carry)
            y_leaves, y_tree = jax.tree_util.tree_flatten(y)
            flat_body.trees = (carry_tree, y_tree, len(carry_leaves))
            return carry_leaves + y_leaves

        try:
            closed = jax.make_jaxpr(flat_body)(*(jax.ShapeDtypeStruct(s, d, weak_type=w) for s, d, w in key), *x_avals)
        except Exception:  # noqa: BLE001 -- JAX's own unrolling reports what is wrong with the body, as before
            return None
        if flat_body.trees[0] != init_tree:  # a carry that changes structure: JAX's unrolling says so
            return None
        return closed, flat_body.trees

    # every carry type the iterations go through (weak types settle after one), traced before anything is replayed
    traced: dict = {}
    key = carry_type(avals[:len(init_flat)])
    while key not in traced:
        traced[key] = hit = trace(key)
        if hit is None:
            return None
        key = carry_type(hit[0].out_avals[:hit[1][2]])
    carry, ys = list(init_flat), []
    for i in (reversed(range(n)) if reverse else range(n)):
        key = carry_type([jax.typeof(c) for c in carry])
        hit = traced.get(key) or trace(key)  # (a constant carry the replay hands back concrete, typed otherwise)
        if hit is None:
            return None
        closed, (carry_tree, y_tree, num_carry) = traced[key] = hit
        out = _replay(closed, carry + [slicing.index_in_dim(x, i, keepdims=False) for x in xs_flat])
        carry, y = out[:num_carry], out[num_carry:]
        ys.append(y)
    if reverse:
        ys.reverse()
    stacked = [loops._stack(list(column)) for column in zip(*ys)]
    return jax.tree_util.tree_unflatten(carry_tree, carry), jax.tree_util.tree_unflatten(y_tree, stacked)


def _exclude_from_user_lines() -> None:
    """Leave this module's frames out of the source lines JAX reports for equations (``lax.scan`` called through
    :class:`replaying_scans` names the user's line, not the wrapper's)."""
    from jax._src import source_info_util

    source_info_util.register_exclusion(__file__)


_exclude_from_user_lines()
_loss_frames = threading.local()  # .stack: (trace frame, positions of the differentiated inputs) per loss traced


@contextlib.contextmanager
def tracing_loss(leaves, differentiated):
    """While the loss is traced from ``leaves`` (its inputs' tracers, in order; ``differentiated``: per leaf, whether
    it is a parameter the gradient is taken of), a ``lax.scan`` inside it can tell parameters from data
    (:func:`_scans_data`)."""
    frame = next((x._trace.frame for x in leaves if is_tracer(x) and hasattr(getattr(x, "_trace", None), "frame")),
                 None)
    stack = _loss_frames.__dict__.setdefault("stack", [])
    stack.append((frame, frozenset(i for i, d in enumerate(differentiated) if d)))
    try:
        yield
    finally:
        stack.pop()
        _loss_frames.traced = True


def _before_the_loss() -> bool:
    """Whether a step is being traced (:class:`replaying_scans` with ``steps=True``) that has not reached its loss
    yet: its work feeds the loss (a sampler drawing negatives from the parameters) and is not split into stages."""
    return (getattr(_loss_frames, "step", False) and not getattr(_loss_frames, "stack", None)
            and not getattr(_loss_frames, "traced", False))


def _scans_data(xs_flat) -> bool:
    """Whether a ``lax.scan`` in the loss being traced runs over data: a scanned operand computed from an input of the
    loss that is not a parameter (a recurrence over time, over examples), the others such or constants (an index
    scanned beside the data), none of them a parameter or made from parameters alone (the blocks of a model stacked
    by layer: those are unrolled, to be split into stages). Inside a ``jax.checkpoint``'ed function the operands are
    followed to the checkpoint's arguments (:func:`_linking_remat`).
    False where that cannot be told (no loss traced, operands of another trace)."""
    stack = getattr(_loss_frames, "stack", None)
    if not stack or not xs_flat or stack[-1][0] is None:
        return False
    frame, params = stack[-1]
    data = False
    for x in xs_flat:
        positions = _loss_inputs(x, frame)
        if positions is None or (positions and positions <= params):
            return False
        data = data or bool(positions)
    return data


def _loss_inputs(x, frame) -> set | None:
    """The positions of the loss's inputs ``x`` is computed from, traced in ``frame`` (empty for a constant); None
    where that cannot be told (a tracer of another trace that no checkpoint links to the loss's)."""
    from jax._src.interpreters import batching

    while isinstance(x, batching.BatchTracer):  # a scan per example under jax.vmap: its batched operand's
        x = x.val
    if not is_tracer(x):  # a constant scanned beside the data (jnp.arange(n), a node's index)
        return set()
    own = getattr(getattr(x, "_trace", None), "frame", None)
    link = frame if own is frame else next((m for f, m in getattr(_loss_frames, "links", ()) if f is own), None)
    try:
        positions, _ = own.find_progenitors(x)
    except Exception:  # noqa: BLE001 - JAX internals changed: unroll, as before
        return None
    if link is None or positions is None:
        return None
    if own is frame:
        return set(positions)
    found: set = set()
    for i in positions:  # the checkpoint's arguments, followed into the trace that called it
        outer = _loss_inputs(link[own.invars[i]], frame) if own.invars[i] in link else None
        if outer is None:
            return None
        found |= outer
    return found


def _linking_remat(original):
    """``jax.checkpoint``'s tracing of its function (``_trace_to_jaxpr``, called by every checkpointed function, also
    one decorated before autopp traces), wrapped so that while a loss is traced by :class:`replaying_scans`, the
    function's arguments are linked to the values they were called with: a scan over time inside a checkpointed
    layer is then told from a scan over stacked layers (:func:`_scans_data`). The values are read from the caller's
    ``args_flat``; where JAX's internals differ, nothing is linked (the scan is unrolled, as before)."""
    @functools.wraps(original)
    def trace(fun, in_tree, in_avals, debug):
        outer = sys._getframe(1).f_locals.get("args_flat")
        if (threading.get_ident() not in replaying_scans._inside or not getattr(_loss_frames, "stack", None)
                or not isinstance(outer, (list, tuple)) or len(outer) != len(in_avals)):
            return original(fun, in_tree, in_avals, debug)
        links = _loss_frames.__dict__.setdefault("links", [])

        def linked(*args, **kwargs):
            inner = jax.tree_util.tree_leaves((args, kwargs))
            own = next((x._trace.frame for x in inner if is_tracer(x) and hasattr(x._trace, "frame")), None)
            if own is not None and len(inner) == len(outer):
                links.append((own, {x.val: o for x, o in zip(inner, outer) if getattr(x, "_trace", None)
                                    and getattr(x._trace, "frame", None) is own}))
            return fun(*args, **kwargs)

        depth = len(links)
        try:
            return original(functools.wraps(fun)(linked), in_tree, in_avals, debug)
        finally:
            del links[depth:]

    return trace


class LoopCounter(int):
    """A Python integer carried by ``lax.scan`` unrolled under ``jax.disable_jit`` (``fori_loop``'s counter, an
    ``int`` in a scan's carry): it stays concrete, so indices by it stay static (a layer's rows of stacked
    parameters), but it answers what the body may ask of the int32 array ``jax.jit`` would hand it
    (``i.astype(jnp.float32)``, ``i.dtype``), and arithmetic on it keeps it one."""

    dtype = np.dtype(np.int32)
    shape, ndim, size = (), 0, 1

    def astype(self, dtype):
        return jax.numpy.asarray(int(self), dtype)


def _counted(op):
    def method(self, *other):
        out = op(int(self), *other)
        return LoopCounter(out) if type(out) is int else out
    return method


for _name in ("__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__floordiv__", "__rfloordiv__",
              "__mod__", "__rmod__", "__neg__", "__abs__", "__pow__", "__lshift__", "__rshift__", "__and__", "__or__",
              "__xor__"):
    setattr(LoopCounter, _name, _counted(getattr(int, _name)))


class replaying_scans:
    """While active (with ``jax.disable_jit``, which unrolls ``lax.scan``), ``lax.scan`` called on a thread inside
    the block traces its body once and replays it per iteration (:func:`_scan_by_replay`): the same equations as
    JAX's unrolling, in a fraction of the time. Re-entrant; restores ``lax.scan`` when the last block exits. Other
    threads keep JAX's own."""

    _inside: dict = {}  # thread id -> depth
    _original = _remat_trace = None

    def __init__(self, steps: bool = False):
        self.steps = steps  # (tracing a step: its loops before the loss stay loops, see _before_the_loss)

    def __enter__(self):
        from jax._src import ad_checkpoint
        from jax._src.lax import control_flow  # (its scan: what a callback's vmap_method="sequential" loops by)
        from jax._src.lax.control_flow import loops

        cls = type(self)
        if threading.get_ident() not in cls._inside:
            _loss_frames.traced, _loss_frames.step = False, self.steps
        if not cls._inside:
            original = cls._original = (loops.scan, jax.lax.scan, control_flow.scan)
            cls._remat_trace = ad_checkpoint._trace_to_jaxpr
            inside = cls._inside

            @functools.wraps(original[0])
            def scan(f, init, xs=None, length=None, reverse=False, unroll=1, _split_transpose=False):
                if threading.get_ident() in inside and jax.config.jax_disable_jit:
                    # over time or examples in the loss, or in the step before the loss (a sampler): kept one scan
                    if _before_the_loss() or _scans_data(jax.tree_util.tree_leaves(xs)):
                        with jax.disable_jit(False):
                            return original[0](f, init, xs, length, reverse, unroll, _split_transpose)
                    out = _scan_by_replay(f, init, xs, length, reverse)
                    if out is not None:
                        return out
                    init = jax.tree_util.tree_map(lambda x: LoopCounter(x) if type(x) is int else x, init)
                return original[0](f, init, xs, length, reverse, unroll, _split_transpose)

            loops.scan = jax.lax.scan = control_flow.scan = scan
            ad_checkpoint._trace_to_jaxpr = _linking_remat(cls._remat_trace)
        me = threading.get_ident()
        cls._inside[me] = cls._inside.get(me, 0) + 1
        return self

    def __exit__(self, *exc):
        from jax._src import ad_checkpoint
        from jax._src.lax import control_flow
        from jax._src.lax.control_flow import loops

        cls = type(self)
        me = threading.get_ident()
        cls._inside[me] -= 1
        if not cls._inside[me]:
            del cls._inside[me]
        if not cls._inside:
            loops.scan, jax.lax.scan, control_flow.scan = cls._original
            ad_checkpoint._trace_to_jaxpr = cls._remat_trace
            cls._original = cls._remat_trace = None
        return False


# -- multi-controller runtime --------------------------------------------------------------------------------
def distributed_client():
    """The client of ``jax.distributed``'s coordination service (its key-value store), once initialized."""
    from jax._src import distributed as jax_distributed

    return jax_distributed.global_state.client


def prng_impl(dtype):
    """The PRNG implementation of a typed key dtype (``key<fry>``), for ``jax.random.wrap_key_data``."""
    return dtype._impl

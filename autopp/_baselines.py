"""SPMD baselines: the layouts users write by hand with ``jax.jit`` shardings, for the same training step.

A baseline runs the whole step as one ``jax.jit`` program over a ``(data, fsdp, tensor)`` mesh of the devices
(the mesh :class:`autopp.runtime._executor.StageMeshes` builds for one pipeline stage):

* the batch (every leaf of the batch argument(s)) is split along axis 0 over ``data`` x ``fsdp``;
* with ``fsdp`` > 1 every other leaf (parameters, optimizer state) is sharded over ``fsdp`` on its largest
  dimension that ``fsdp`` divides (ZeRO-3: XLA gathers a weight where it is needed whole and reduce-scatters its
  gradient);
* with ``tensor`` > 1 the parameters get Megatron's column/row split, read off the loss's forward jaxpr by
  :func:`autopp.runtime._tensor.tensor_specs` (zoo GPT: ``qkv_w``, ``fc_w`` by columns, ``out_w``, ``proj_w`` by
  rows), and each optimizer-state leaf of a parameter (found by :func:`autopp.profiler._optstate
  .optimizer_state_owners`) keeps that parameter's split;
* the step's outputs that mirror an argument (``(params, opt_state, loss)`` returns the first two) keep that
  argument's shardings, so the next step starts where this one ended; anything else is replicated.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from autopp._config import check_layout_axes
from autopp.core import abstract_leaf

BASELINES = ("data-parallel", "fsdp", "tensor-parallel")
"""The named baseline layouts (:func:`baseline`)."""


@dataclasses.dataclass(frozen=True)
class SpmdLayout:
    """Mesh axis sizes of an SPMD baseline; their product is the device count."""

    data: int = 1
    fsdp: int = 1
    tensor: int = 1

    @property
    def num_devices(self) -> int:
        return self.data * self.fsdp * self.tensor

    def to_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)

    def __str__(self) -> str:
        return " x ".join(f"{k} {v}" for k, v in self.to_dict().items() if v > 1) or "1 device"


def _resolve_layout(layout: dict[str, int] | SpmdLayout | None, n: int, owner: str) -> SpmdLayout:
    if layout is None:
        return SpmdLayout(data=n)
    if isinstance(layout, SpmdLayout):
        given = layout.to_dict()
    elif isinstance(layout, dict):
        given = dict(layout)
    else:
        raise TypeError(f"{owner}: layout must be a dict such as {{'data': 4, 'tensor': 2}} or an SpmdLayout, got "
                        f"{layout!r} ({type(layout).__name__}).")
    check_layout_axes(given, owner)
    f, t = int(given.get("fsdp", 1)), int(given.get("tensor", 1))
    if "data" not in given:
        if n % (f * t):
            raise ValueError(f"{owner}: fsdp x tensor = {f} x {t} = {f * t} does not divide the {n} devices; use "
                             f"degrees whose product divides {n}, or pass devices=jax.devices()[:{f * t}].")
        given["data"] = n // (f * t)
    lay = SpmdLayout(data=int(given["data"]), fsdp=f, tensor=t)
    if lay.num_devices != n:
        raise ValueError(f"{owner}: layout {lay.to_dict()} needs data x fsdp x tensor = {lay.num_devices} devices but "
                         f"{n} were given; pass devices=jax.devices()[:{lay.num_devices}] or change the layout.")
    return lay


class SpmdStep:
    """A training step run as one ``jax.jit`` program with the shardings of an :class:`SpmdLayout`.

    Call it like the step. :meth:`shardings_for` gives the input shardings it places the arguments with,
    :meth:`compiled_for` the compiled program (``memory_analysis()``, ``cost_analysis()``),
    :meth:`peak_memory_bytes` the per-device bytes XLA reports for it.
    """

    def __init__(self, step_fn: Callable, *, layout: dict[str, int] | SpmdLayout | None = None,
                 devices: Sequence[jax.Device] | None = None, batch_argnums: int | Sequence[int] | None = None,
                 name: str | None = None):
        owner = "autopp.baselines"
        if not callable(step_fn):
            raise TypeError(f"{owner}: expected a callable training step, got {type(step_fn).__name__}.")
        devices = list(jax.devices() if devices is None else devices)
        if not devices or not all(isinstance(d, jax.Device) for d in devices):
            raise TypeError(f"{owner}: devices must be a non-empty sequence of jax.Device, got {devices!r}.")
        if len(set(devices)) != len(devices):
            raise ValueError(f"{owner}: devices lists a device twice: {devices}.")
        self.layout = _resolve_layout(layout, len(devices), owner)
        self.devices = devices
        self.name = name or str(self.layout)
        self._step_fn = step_fn
        self._batch_argnums = batch_argnums
        from autopp.runtime import StageMeshes

        self._meshes = StageMeshes([devices], [self.layout.to_dict()])
        self.mesh = self._meshes.meshes[0]
        self._cache: dict[Any, tuple[Any, Any, Any]] = {}
        functools.update_wrapper(self, step_fn)

    # -- shardings -------------------------------------------------------------------------------
    def _tensor_specs(self, args: tuple) -> dict[int, tuple]:
        """Megatron specs per flat argument index: the parameters the rule splits and their optimizer state."""
        from autopp.core import normalize_batch_argnums, trace_step
        from autopp.profiler import optimizer_state_owners
        from autopp.runtime import tensor_specs

        try:
            traced = trace_step(self._step_fn, args, normalize_batch_argnums(self._batch_argnums, len(args)))
        except ValueError as e:
            raise ValueError(f"autopp.baselines: a tensor-parallel baseline reads Megatron's split off the step, "
                             f"which must take its gradient with autopp.value_and_grad / autopp.grad: {e}") from None
        spec, jaxpr = traced.spec, traced.jaxpr.jaxpr
        fwd = spec.forward.jaxpr
        params = [fwd.invars[k] for k in spec.diff_indices]
        by_var = tensor_specs(fwd, params, self.layout.tensor)
        if not by_var:
            raise ValueError(f"autopp.baselines: tensor={self.layout.tensor} splits no parameter of this step (no "
                             "matmul weight has a dimension it divides); use a tensor degree that divides the "
                             "model's widths (e.g. the hidden size and the heads), or another baseline.")
        step_index = {v: i for i, v in enumerate(jaxpr.invars)}
        grad = traced.grad_eqn
        out: dict[int, tuple] = {}
        for k in spec.diff_indices:
            a = grad.invars[k]
            if fwd.invars[k] in by_var and not hasattr(a, "val") and a in step_index:
                out[step_index[a]] = by_var[fwd.invars[k]]
        param_of_out = {1 + spec.num_aux + j: k for j, k in enumerate(spec.diff_indices)}
        for i, k in optimizer_state_owners(jaxpr, traced.grad_index, param_of_out, traced.batch_mask).items():
            if i not in out and fwd.invars[k] in by_var and jaxpr.invars[i].aval.shape == fwd.invars[k].aval.shape:
                out[i] = by_var[fwd.invars[k]]
        return out

    def _build(self, args: tuple):
        flat, tree = jax.tree_util.tree_flatten(args)
        key = (tree, tuple((np.shape(x), str(jax.numpy.result_type(x))) for x in flat))
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        from autopp.core import normalize_batch_argnums

        argnums = normalize_batch_argnums(self._batch_argnums, len(args))
        paths = jax.tree_util.tree_flatten_with_path(args)[0]
        is_batch = [p[0].idx in argnums for p, _ in paths]
        specs = self._tensor_specs(args) if self.layout.tensor > 1 else {}
        split = self.layout.data * self.layout.fsdp
        shardings = []
        for (path, x), b, i in zip(paths, is_batch, range(len(flat))):
            shape = np.shape(x)
            if b:
                if not shape or (split > 1 and shape[0] % split):
                    raise ValueError(
                        f"autopp.baselines: batch leaf args{jax.tree_util.keystr(path)} has shape {shape}; its leading "
                        f"dimension must be divisible by data x fsdp = {split} ({self.layout}); use a batch size "
                        f"that is a multiple of {split} or another layout.")
                shardings.append(self._meshes.batch_sharding(0, shape))
            else:
                shardings.append(self._meshes.state_sharding(0, shape, specs.get(i)))
        in_tree = jax.tree_util.tree_unflatten(tree, shardings)
        abstract = [abstract_leaf(x, sharding=sh) for x, sh in zip(flat, shardings)]
        out_shape = jax.eval_shape(self._step_fn, *jax.tree_util.tree_unflatten(tree, abstract))
        out_tree = self._out_shardings(args, in_tree, out_shape)
        jitted = jax.jit(self._step_fn, in_shardings=tuple(in_tree), out_shardings=out_tree)
        compiled = jitted.lower(*jax.tree_util.tree_unflatten(tree, abstract)).compile()
        self._cache[key] = (in_tree, compiled, tree)
        return self._cache[key]

    def _out_shardings(self, args, in_tree, out_shape):
        """Output ``j`` keeps argument ``j``'s shardings when it has the same structure and shapes; else replicated."""
        replicated = self._meshes.replicated[0]

        def same(a, o):
            sa, ta = jax.tree_util.tree_flatten(a)
            so, to = jax.tree_util.tree_flatten(o)
            return ta == to and [np.shape(x) for x in sa] == [tuple(x.shape) for x in so]

        if isinstance(out_shape, (tuple, list)):
            out = [in_tree[j] if j < len(args) and same(args[j], o) else jax.tree.map(lambda _: replicated, o)
                   for j, o in enumerate(out_shape)]
            return type(out_shape)(out)
        return jax.tree.map(lambda _: replicated, out_shape)

    def shardings_for(self, *args) -> tuple:
        """The NamedShardings (a tree like ``args``) the arguments are placed with."""
        return self._build(args)[0]

    def compiled_for(self, *args):
        """The compiled program for arguments like ``args`` (arrays or ShapeDtypeStructs): the one calls run."""
        return self._build(args)[1]

    def peak_memory_bytes(self, *args) -> int:
        """Bytes per device the compiled program needs (XLA's ``memory_analysis()``: arguments, outputs and
        temporaries, less the outputs aliased to arguments)."""
        m = self.compiled_for(*args).memory_analysis()
        return int(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes)

    def __call__(self, *args, **kwargs):
        if kwargs:
            raise TypeError(f"autopp.baselines: pass the step's arguments positionally (got keyword(s) "
                            f"{sorted(kwargs)}); the batch is found by position (batch_argnums).")
        in_tree, compiled, _ = self._build(args)
        flat, tree = jax.tree_util.tree_flatten(args)
        shard = jax.tree_util.tree_leaves(in_tree)
        move = [i for i, (x, s) in enumerate(zip(flat, shard)) if not (isinstance(x, jax.Array) and x.sharding == s)]
        if move:  # single-device arrays go through the host: XLA would compile a slicing program per shape
            src = [np.asarray(flat[i]) if isinstance(flat[i], jax.Array) and len(flat[i].sharding.device_set) == 1
                   else flat[i] for i in move]
            for i, y in zip(move, jax.device_put(src, [shard[i] for i in move])):
                flat[i] = y
        return compiled(*jax.tree_util.tree_unflatten(tree, flat))

    def __repr__(self) -> str:
        return f"SpmdStep({self.name}: {self.layout}, {len(self.devices)} devices)"


def spmd(step_fn: Callable, *, layout: dict[str, int] | SpmdLayout | None = None,
         devices: Sequence[jax.Device] | None = None, batch_argnums: int | Sequence[int] | None = None) -> SpmdStep:
    """``step_fn`` as one ``jax.jit`` program over a ``{"data": d, "fsdp": f, "tensor": t}`` mesh of ``devices``
    (default ``jax.devices()``; ``data`` defaults to the devices left over). See the module docstring."""
    return SpmdStep(step_fn, layout=layout, devices=devices, batch_argnums=batch_argnums)


def data_parallel(step_fn: Callable, *, devices: Sequence[jax.Device] | None = None,
                  batch_argnums: int | Sequence[int] | None = None) -> SpmdStep:
    """Pure data parallelism: the batch split over all devices, parameters and optimizer state replicated."""
    return SpmdStep(step_fn, layout={"fsdp": 1, "tensor": 1}, devices=devices, batch_argnums=batch_argnums,
                    name="data-parallel")


def fsdp(step_fn: Callable, *, devices: Sequence[jax.Device] | None = None,
         batch_argnums: int | Sequence[int] | None = None) -> SpmdStep:
    """FSDP (ZeRO-3) over all devices: the batch split over them, every parameter and optimizer-state leaf sharded
    on its largest dimension the device count divides."""
    n = len(list(jax.devices() if devices is None else devices))
    return SpmdStep(step_fn, layout={"data": 1, "fsdp": n, "tensor": 1}, devices=devices,
                    batch_argnums=batch_argnums, name="fsdp")


def tensor_parallel(step_fn: Callable, *, tensor: int = 2, devices: Sequence[jax.Device] | None = None,
                    batch_argnums: int | Sequence[int] | None = None) -> SpmdStep:
    """Megatron-style tensor parallelism over ``tensor`` devices x data parallelism over the rest."""
    if isinstance(tensor, bool) or not isinstance(tensor, (int, np.integer)) or tensor < 1:
        raise ValueError(f"autopp.baselines.tensor_parallel: tensor must be a positive int, got {tensor!r}; pass e.g. "
                         "tensor=2.")
    return SpmdStep(step_fn, layout={"fsdp": 1, "tensor": int(tensor)}, devices=devices, batch_argnums=batch_argnums,
                    name="tensor-parallel")


def baseline(name: str, step_fn: Callable, *, devices: Sequence[jax.Device] | None = None,
             tensor: int | None = None, batch_argnums: int | Sequence[int] | None = None) -> SpmdStep:
    """The baseline called ``name`` (one of :data:`BASELINES`); ``tensor`` (default 2) only for
    ``"tensor-parallel"``."""
    if tensor is not None and name != "tensor-parallel":
        raise ValueError(f"autopp.baselines: tensor={tensor!r} applies to the tensor-parallel baseline only, not "
                         f"{name!r}; drop tensor=.")
    if name == "data-parallel":
        return data_parallel(step_fn, devices=devices, batch_argnums=batch_argnums)
    if name == "fsdp":
        return fsdp(step_fn, devices=devices, batch_argnums=batch_argnums)
    if name == "tensor-parallel":
        return tensor_parallel(step_fn, tensor=2 if tensor is None else tensor, devices=devices,
                               batch_argnums=batch_argnums)
    raise ValueError(f"autopp.baselines: unknown baseline {name!r}; use one of {', '.join(BASELINES)}.")

"""The devices of each pipeline stage as a mesh (axes ``data``, ``fsdp``, ``tensor``) and the shardings the runtime
places values with on them."""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

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
        self.fsdp_whole: dict[int, dict[str, tuple]] = {}
        """Stage -> {parameter: shape} of the parameters its FSDP axis leaves whole (no dimension divides)."""
        self.batch_undivided: dict[int, set[tuple[int, int]]] = {}
        """Stage -> {(a microbatch input's leading length, its data x FSDP devices)} where those devices do not divide
        it (:meth:`microbatch_sharding`)."""

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

    def microbatch_sharding(self, loc: int, shape) -> NamedSharding:
        """:meth:`batch_sharding` of one microbatch of a per-step input; where the stage's data x FSDP devices do not
        divide it (some of them, or all, then repeat the same examples) it is recorded in :attr:`batch_undivided`."""
        n = self.layouts[loc]["data"] * self.layouts[loc]["fsdp"]
        if n > 1 and len(shape) >= 1 and shape[0] % n:
            self.batch_undivided.setdefault(loc, set()).add((shape[0], n))
        return self.batch_sharding(loc, shape)

    def residual_sharding(self, loc: int, shape, dim: int | None = None) -> NamedSharding:
        """A value stage ``loc`` keeps from its forward for its backward: laid out as the batch, and over the tensor
        axis along ``dim`` where the forward computes it split so (it is not gathered to be kept)."""
        base, t = self.batch_sharding(loc, shape), self.layouts[loc]["tensor"]
        spec = list(base.spec) + [None] * (len(shape) - len(base.spec))
        if dim is None or t == 1 or shape[dim] % t or spec[dim] is not None:
            return base
        spec[dim] = "tensor"
        return NamedSharding(self.meshes[loc], P(*spec))

    def sequence_sharding(self, loc: int, shape) -> NamedSharding | None:
        """Sequence parallelism: the batch dimension as :meth:`batch_sharding` lays it out, the second (sequence)
        dimension over the tensor axis; None when the stage has no tensor axis or it does not divide the sequence."""
        t = self.layouts[loc]["tensor"]
        if t == 1 or len(shape) < 2 or shape[1] % t:
            return None
        batch = self.batch_sharding(loc, shape).spec
        return NamedSharding(self.meshes[loc], P(batch[0] if len(batch) else None, "tensor"))

    def state_sharding(self, loc: int, shape, tensor_spec=None, zero: bool = False,
                       name: str | None = None) -> NamedSharding:
        """Parameters, gradients and optimizer state on stage ``loc``: ``tensor_spec`` (the parameter's split over
        the tensor axis, from the plan or Megatron's column/row rule, see :mod:`autopp.runtime._tensor`), and the
        largest other dimension that the FSDP axis divides sharded over it; with ``zero`` (optimizer state under
        ZeRO-1) the largest remaining dimension the data axis divides is sharded over it too; replicated without
        any. A parameter (``name``) that FSDP cannot shard (no dimension divides) is recorded in
        :attr:`fsdp_whole`."""
        spec = list(tensor_spec) if tensor_spec is not None else [None] * len(shape)
        for axis, on in (("fsdp", True), ("data", zero)):
            n_axis = self.layouts[loc][axis]
            if not on or n_axis == 1:
                continue
            dims = [i for i, n in enumerate(shape) if n % n_axis == 0 and spec[i] is None]
            if dims:
                spec[max(dims, key=lambda i: (shape[i], -i))] = axis
            elif axis == "fsdp" and name is not None and math.prod(shape) > 1:
                self.fsdp_whole.setdefault(loc, {})[name] = tuple(shape)
        while spec and spec[-1] is None:
            spec.pop()
        return NamedSharding(self.meshes[loc], P(*spec)) if spec else self.replicated[loc]

    def multi(self, locs: frozenset[int]) -> NamedSharding:
        """Replicated over the devices of several stages (one value kept on all of them)."""
        if locs not in self._multi:  # stages may share devices (several model chunks per device group)
            devs = list(dict.fromkeys(d for loc in sorted(locs) for d in self.devices[loc]))
            self._multi[locs] = NamedSharding(Mesh(np.array(devs), ("stages",)), P())
        return self._multi[locs]

"""Small residuals handed from a stage's forward to its backward as a few packed buffers instead of one each.

The host spends about 3 us per output buffer of a program call (the runtime's array objects; measured in
``docs/runtime.md``) and about 0.7 us per input, whatever its size, while a forward of a few layers keeps dozens
of small residuals (norm statistics, rotary tables, masks, per-head values). Residuals of at most
:data:`PACK_MAX_BYTES` per device are therefore concatenated, per dtype and layout, into one buffer by the forward
program and sliced back by the backward program. Larger residuals stay separate: their kernels dwarf the dispatch
cost, and packing them would add a copy. Residuals a ``lax.scan`` makes or reads also stay separate (the stage
program chooses them): the backward's loop takes them as operands, where a slice out of a pack cannot fuse into its
reader and becomes a kernel of its own, compiled once and launched every call (21 such slices took 0.35 s of
XLA's CPU compile time for a scanned GPT stage, more than the host time packing saves in hundreds of steps).

Packing keeps every shard on its device: a replicated residual is packed flat, one laid out along its leading
dimension over ``n`` devices is reshaped to ``(n, -1)`` (each row one device's shard) and packed along the second
dimension, so neither packing nor unpacking moves data between devices.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

PACK_MAX_BYTES = 256 * 1024
"""Largest residual (bytes per device) that is packed. Copying it into and out of the pack costs two passes over
its bytes: under 0.4 us at an A100's 1.56 TB/s of HBM bandwidth (NVIDIA A100 datasheet), well below the ~3 us
of host time a separate output buffer costs per call, so packing never loses on a GPU; larger residuals belong
to kernels long enough to hide their dispatch."""


@dataclasses.dataclass(frozen=True)
class ResidualPacking:
    """How a stage's kept residuals travel: ``groups`` of residual positions packed into one buffer each (in
    order), then the ``loose`` positions as buffers of their own."""

    avals: tuple
    """Each residual's type (shape, dtype)."""
    shardings: tuple
    """Each residual's sharding."""
    groups: tuple[tuple[int, ...], ...]
    loose: tuple[int, ...]
    rows: tuple[int, ...]
    """Per group: 1 for a replicated pack, else the number of devices its leading dimension is split over."""

    @property
    def num_buffers(self) -> int:
        return len(self.groups) + len(self.loose)

    def structure(self) -> tuple:
        """The packing without its devices (equal for two stages that pack equal residuals alike)."""
        return (tuple((tuple(a.shape), str(a.dtype)) for a in self.avals), self.groups, self.loose, self.rows)

    def buffer_shardings(self) -> tuple:
        return tuple(self.shardings[g[0]] for g in self.groups) + tuple(self.shardings[i] for i in self.loose)

    def buffer_avals(self) -> list[jax.ShapeDtypeStruct]:
        out = []
        for g, n in zip(self.groups, self.rows):
            cols = sum(int(np.prod(self.avals[i].shape, dtype=np.int64)) // n for i in g)
            dtype = self.avals[g[0]].dtype
            out.append(jax.ShapeDtypeStruct((cols,) if n == 1 else (n, cols), dtype))
        out += [jax.ShapeDtypeStruct(self.avals[i].shape, self.avals[i].dtype) for i in self.loose]
        return out

    def pack(self, values: Sequence) -> list:
        """The residuals as buffers (inside the forward program)."""
        out = []
        for g, n in zip(self.groups, self.rows):
            parts = [values[i].reshape(-1) if n == 1 else values[i].reshape(n, -1) for i in g]
            out.append(jnp.concatenate(parts, axis=0 if n == 1 else 1))
        return out + [values[i] for i in self.loose]

    def unpack(self, buffers: Sequence) -> list:
        """The residuals from the buffers (inside the backward program)."""
        values: list = [None] * len(self.avals)
        for buf, g, n in zip(buffers, self.groups, self.rows):
            at = 0
            for i in g:
                shape = self.avals[i].shape
                width = int(np.prod(shape, dtype=np.int64)) // n
                part = buf[at:at + width] if n == 1 else buf[:, at:at + width]
                values[i] = part.reshape(shape)
                at += width
        for buf, i in zip(buffers[len(self.groups):], self.loose):
            values[i] = buf
        return values


def _rows(sharding, shape) -> int | None:
    """1 for a replicated layout, ``n`` for the leading dimension split over ``n`` devices (and nothing else
    split), else None (not packed)."""
    if not isinstance(sharding, NamedSharding):
        return 1 if sharding is None or sharding.is_fully_replicated else None
    spec = tuple(sharding.spec)
    if all(s is None for s in spec):
        return 1
    if len(shape) == 0 or any(s is not None for s in spec[1:]):
        return None
    axes = spec[0] if isinstance(spec[0], tuple) else (spec[0],)
    n = int(np.prod([sharding.mesh.shape[a] for a in axes]))
    return n if shape[0] % n == 0 else None


def plan_packing(avals: Sequence, shardings: Sequence, max_bytes: int = PACK_MAX_BYTES,
                 keep_loose: Collection[int] = ()) -> ResidualPacking:
    """Group residuals of at most ``max_bytes`` per device by (dtype, sharding, layout); a group of one stays
    loose, and so do the positions in ``keep_loose`` (residuals whose unpacking would not fuse into their reader)."""
    by_key: dict = {}
    loose = []
    for i, (a, sh) in enumerate(zip(avals, shardings)):
        if jax.dtypes.issubdtype(a.dtype, jax.dtypes.extended):  # a typed PRNG key: no bytes to concatenate
            loose.append(i)
            continue
        if str(getattr(a, "memory_space", "Device")).rsplit(".", 1)[-1].lower() not in ("device", "any"):
            loose.append(i)  # offloaded to host memory by a checkpoint policy: concatenated only with its own kind
            continue
        n = _rows(sh, a.shape)
        size = int(np.prod(a.shape, dtype=np.int64)) * np.dtype(a.dtype).itemsize
        if n is None or size // max(n, 1) > max_bytes or size == 0 or i in keep_loose:
            loose.append(i)
            continue
        by_key.setdefault((np.dtype(a.dtype).name, sh, n), []).append(i)
    groups, rows = [], []
    for (_, _, n), members in by_key.items():
        if len(members) < 2:
            loose.extend(members)
        else:
            groups.append(tuple(members))
            rows.append(n)
    return ResidualPacking(tuple(avals), tuple(shardings), tuple(groups), tuple(sorted(loose)), tuple(rows))

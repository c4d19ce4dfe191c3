"""Stages that run one program on different devices, traced and lowered once.

The middle stages of a deep model, and the scan segments of a scanned one (:mod:`autopp.core._reroll`), run the
same computation with the same layouts on other devices. XLA already compiles such programs once (the runtime
loads the executable onto the other devices, :func:`autopp.core.retarget`), but each stage used to be traced,
differentiated and lowered on its own: about 1 s of the 32-layer scanned GPT's 6 s first call on 4 stages on
CPU.

:func:`twin_key` says, before a stage's programs are made, what they are up to their devices: the stage's forward
jaxpr as text (variables named by position), its constants, which inputs are parameters, the loss seeds, the
recomputation mode and every sharding it is given as (mesh shape, axis names, partition spec), with the devices
kept apart. A stage whose key matches an earlier stage's, with a consistent one-to-one map between their devices
(:func:`device_map`), takes that stage's programs as :class:`DeviceMapped` programs: the runtime lowers the source
once and reads the mapped stage's devices and types off it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, SingleDeviceSharding

from autopp.core._jaxpr import _jaxpr_str, literal_signature

_CONST_HASH_BYTES = 1 << 20
"""Constants up to this size are compared by value (hashed); larger ones by identity."""


class DeviceMapped:
    """Another stage's jitted program, run on this stage's devices: ``source`` with each device ``d`` replaced by
    ``devmap[d]``. ``real()`` makes this stage's own jitted program, for when the source's executable cannot be
    loaded onto these devices (callbacks, effects, no serialized form)."""

    __slots__ = ("devmap", "real", "source")

    def __init__(self, source, devmap: dict, real: Callable[[], Any]):
        self.source, self.devmap, self.real = source, devmap, real

    def __repr__(self) -> str:
        return f"DeviceMapped({getattr(self.source, '__name__', self.source)!r}, {len(self.devmap)} devices)"


def _sharding_key(sharding) -> tuple[tuple, tuple] | None:
    """(the sharding without its devices, its devices in mesh order), or None when it is of a kind not mapped."""
    if isinstance(sharding, NamedSharding):
        mesh = sharding.mesh
        return (("named", mesh.axis_names, mesh.devices.shape, tuple(mesh.axis_types), sharding.spec,
                 sharding.memory_kind), tuple(mesh.devices.flat))
    if isinstance(sharding, SingleDeviceSharding):
        return ("single", sharding.memory_kind), tuple(sharding.device_set)
    return None


def _const_key(c) -> tuple:
    if jax.dtypes.issubdtype(getattr(c, "dtype", None), jax.dtypes.extended):  # a typed PRNG key: by its bits
        return ("key", str(c.dtype), _const_key(jax.random.key_data(c)))
    nbytes = getattr(c, "nbytes", None)
    if nbytes is None or nbytes > _CONST_HASH_BYTES or (isinstance(c, jax.Array) and not c.is_fully_addressable):
        return ("id", id(c))
    arr = np.asarray(c)
    if arr.dtype == object:
        return ("id", id(c))
    if arr.size <= 64:
        return ("value", literal_signature(arr))
    return ("hash", str(arr.dtype), arr.shape, hashlib.sha256(arr.tobytes()).hexdigest())


def twin_key(closed, flags: Sequence, shardings: Sequence) -> tuple[tuple, tuple] | None:
    """(key, devices) of a stage's programs: stages with equal keys make the same programs up to their devices,
    ``devices`` listing each sharding's devices in order (so that two stages' lists pair them up). ``closed``: the
    stage's forward as it will be differentiated; ``flags``: everything else its programs depend on that is no
    sharding (hashable); ``shardings``: every sharding the programs are given. None when a sharding is of a kind
    that is not mapped."""
    parts, devices = [], []
    for sh in shardings:
        k = _sharding_key(sh)
        if k is None:
            return None
        parts.append(k[0])
        devices.append(k[1])
    jaxpr = closed.jaxpr
    effects = tuple(sorted(map(str, jaxpr.effects)))
    key = (_jaxpr_str(jaxpr), tuple(_const_key(c) for c in closed.consts), effects, tuple(flags), tuple(parts))
    return key, tuple(devices)


def device_map(source_devices: tuple, devices: tuple) -> dict | None:
    """The one-to-one map from a source stage's devices to a twin's (both as :func:`twin_key` lists them; the same
    devices map to themselves: model chunks of one device group), or None when they do not pair up consistently or
    are not all this process's."""
    devmap: dict = {}
    for src, dst in zip(source_devices, devices):
        if len(src) != len(dst):
            return None
        for a, b in zip(src, dst):
            if devmap.setdefault(a, b) != b:
                return None
    if len(set(devmap.values())) != len(devmap):
        return None
    me = jax.process_index()
    if any(d.process_index != me for pair in devmap.items() for d in pair):
        return None
    return devmap


def twin_program(cache: dict, fn, closed, flags: Sequence, shardings: Sequence):
    """``fn`` (a jitted program of ``closed``, see :func:`twin_key`), or, when ``cache`` holds an earlier program equal
    to it up to its devices, that one as a :class:`DeviceMapped` program on ``fn``'s devices (lowered once)."""
    twin = twin_key(closed, flags, shardings)
    if twin is None:
        return fn
    key, devices = twin
    source, source_devices = cache.setdefault(key, (fn, devices))
    devmap = None if source is fn else device_map(source_devices, devices)
    return fn if devmap is None else DeviceMapped(source, devmap, lambda: fn)

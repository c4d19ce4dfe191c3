"""The cluster a plan targets: nodes x devices per node x one device kind."""

from __future__ import annotations

import dataclasses
import numbers
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

from autopp.profiler._devices import DEVICE_KINDS, DeviceSpec, get_device

_EXPECTED_FORM = (
    "expected NODESxDEVICESxKIND, e.g. '128x8xH100' (or DEVICESxKIND for one node, e.g. '8xH100'), "
    f"with KIND one of {', '.join(DEVICE_KINDS)}"
)
_THREE = re.compile(r"^([+-]?\d+)\s*x\s*([+-]?\d+)\s*x\s*(.*)$", re.IGNORECASE)
_TWO = re.compile(r"^([+-]?\d+)\s*x\s*(.*)$", re.IGNORECASE)


def _check_count(owner: str, name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{owner}: {name} must be a positive int, got {value!r} ({type(value).__name__}); "
                        f"pass e.g. {name}=8.")
    if value <= 0:
        raise ValueError(f"{owner}: {name} must be a positive int, got {value}; pass e.g. {name}=1.")
    return int(value)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Cluster:
    """``num_nodes`` nodes of ``devices_per_node`` identical devices each."""

    num_nodes: int
    """Number of nodes (hosts); devices in different nodes talk over the inter-node network."""
    devices_per_node: int
    """Devices in each node; devices in one node talk over the intra-node fabric (NVLink)."""
    device: DeviceSpec
    """What every device is (a kind name such as ``"H100"`` is looked up with :func:`get_device`)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "num_nodes", _check_count("Cluster", "num_nodes", self.num_nodes))
        object.__setattr__(self, "devices_per_node", _check_count("Cluster", "devices_per_node", self.devices_per_node))
        if isinstance(self.device, str):
            object.__setattr__(self, "device", get_device(self.device))
        elif not isinstance(self.device, DeviceSpec):
            raise TypeError(
                f"Cluster.device must be a DeviceSpec or a kind name, got {self.device!r} "
                f"({type(self.device).__name__}); pass e.g. device='H100' or device=get_device('H100')."
            )

    @property
    def num_devices(self) -> int:
        return self.num_nodes * self.devices_per_node

    @property
    def memory_per_device(self) -> int:
        """Bytes of device memory on each device."""
        return self.device.memory_capacity

    @property
    def shorthand(self) -> str:
        """``"128x8xH100"``; ``Cluster.parse(c.shorthand)`` rebuilds ``c`` when its device is a table entry."""
        return f"{self.num_nodes}x{self.devices_per_node}x{self.device.name}"

    def __str__(self) -> str:
        nodes = "node" if self.num_nodes == 1 else "nodes"
        devices = "device" if self.num_devices == 1 else "devices"
        return f"{self.num_nodes} {nodes} x {self.devices_per_node} {self.device.name} ({self.num_devices} {devices})"

    @classmethod
    def parse(cls, text: str) -> Cluster:
        """``"128x8xH100"`` (nodes x devices per node x kind) or ``"8xH100"`` (one node); case and spaces free."""
        if not isinstance(text, str):
            raise TypeError(f"Cluster.parse needs a string, got {text!r} ({type(text).__name__}); {_EXPECTED_FORM}.")
        stripped = text.strip()
        if not stripped:
            raise ValueError(f"Cluster.parse: empty cluster string {text!r}; {_EXPECTED_FORM}.")
        m = _THREE.match(stripped)
        if m:
            nodes, per_node, kind = m.group(1), m.group(2), m.group(3).strip()
        else:
            m = _TWO.match(stripped)
            if not m:
                raise ValueError(f"Cluster.parse: cannot read {text!r}; {_EXPECTED_FORM}.")
            nodes, per_node, kind = "1", m.group(1), m.group(2).strip()
        if not kind or re.fullmatch(r"[+-]?\d+", kind):
            raise ValueError(f"Cluster.parse: {text!r} has no device kind; {_EXPECTED_FORM}.")
        if not kind[0].isalpha():
            raise ValueError(f"Cluster.parse: cannot read {text!r}; {_EXPECTED_FORM}.")
        for label, value in (("node count", nodes), ("devices per node", per_node)):
            if int(value) <= 0:
                raise ValueError(
                    f"Cluster.parse: {label} in {text!r} must be a positive integer, got {int(value)}; "
                    f"{_EXPECTED_FORM}."
                )
        try:
            device = get_device(kind)
        except ValueError as e:
            raise ValueError(f"Cluster.parse: in {text!r}: {e}") from None
        return cls(num_nodes=int(nodes), devices_per_node=int(per_node), device=device)

    @classmethod
    def local(cls, devices: Sequence[Any] | None = None, *, kind: str | DeviceSpec | None = None) -> Cluster:
        """The cluster made of ``devices`` (default ``jax.devices()``): one node per JAX process.

        The device kind comes from ``device_kind`` (GPUs) or ``platform`` (``cpu``); pass ``kind`` to name it
        yourself. A CPU spec gets this machine's RAM shared among the local CPU devices as its memory capacity.
        """
        import jax

        if devices is None:
            devices = jax.devices()
        devices = list(devices)
        if not devices or not all(isinstance(d, jax.Device) for d in devices):
            raise TypeError(
                f"Cluster.local: devices must be a non-empty sequence of jax.Device, got {devices!r}; "
                "pass e.g. devices=jax.devices()."
            )
        per_process: dict[int, int] = {}
        for d in devices:
            per_process[d.process_index] = per_process.get(d.process_index, 0) + 1
        if len(set(per_process.values())) != 1:
            raise ValueError(
                f"Cluster.local: the devices are spread unevenly over processes ({per_process}, process -> count); "
                "pass the same number of devices from every process."
            )
        kinds = {(d.platform, d.device_kind) for d in devices}
        if kind is None:
            if len(kinds) != 1:
                raise ValueError(
                    f"Cluster.local: the devices mix kinds {sorted(kinds)}; a Cluster has one device kind. "
                    "Pass devices of one kind."
                )
            platform, device_kind = next(iter(kinds))
            name = table_kind(platform, device_kind)
            if name is None:
                raise ValueError(
                    f"Cluster.local: no table entry for {platform} device kind {device_kind!r}; pass kind= with the "
                    f"closest of {', '.join(DEVICE_KINDS)}, e.g. Cluster.local(kind=get_device('H100')"
                    ".with_overrides(name=..., hbm_bandwidth=...))."
                )
            spec = get_device(name)
        else:
            spec = get_device(kind)
        per_node = next(iter(per_process.values()))
        if spec.name == "cpu":
            ram = _physical_memory()
            if ram:
                spec = spec.with_overrides(memory_capacity=ram // per_node,
                                           source=f"{spec.source}; memory: this machine's RAM / {per_node} devices")
        return cls(num_nodes=len(per_process), devices_per_node=per_node, device=spec)

    def with_device_overrides(self, **fields: Any) -> Cluster:
        """A copy whose device has ``fields`` replaced (see :meth:`DeviceSpec.with_overrides`)."""
        return dataclasses.replace(self, device=self.device.with_overrides(**fields))

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly dict; ``Cluster.from_dict(c.to_dict()) == c``."""
        return {"num_nodes": self.num_nodes, "devices_per_node": self.devices_per_node,
                "device": self.device.to_dict()}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Cluster:
        """Inverse of :meth:`to_dict`; ``device`` may also be a kind name."""
        if not isinstance(data, Mapping):
            raise TypeError(f"Cluster.from_dict needs a mapping (from to_dict()), got {type(data).__name__}.")
        keys = ("num_nodes", "devices_per_node", "device")
        unknown = [k for k in data if k not in keys]
        missing = [k for k in keys if k not in data]
        if unknown or missing:
            raise ValueError(
                f"Cluster.from_dict: expected keys {', '.join(keys)}; unknown {unknown or 'none'}, "
                f"missing {missing or 'none'}. Pass a dict made by Cluster.to_dict()."
            )
        device = data["device"]
        if isinstance(device, Mapping):
            device = DeviceSpec.from_dict(device)
        return cls(num_nodes=data["num_nodes"], devices_per_node=data["devices_per_node"], device=device)


def table_kind(platform: str, device_kind: str) -> str | None:
    """The :data:`DEVICE_KINDS` name for a JAX device's ``platform`` and ``device_kind``, or None if not in the table.

    PCIe and NVL cards (lower clocks and bandwidth) and Grace superchips (GH200, GB200) are not SXM parts,
    so they map to None rather than to the SXM entry.
    """
    if platform == "cpu":
        return "cpu"
    s = device_kind.upper()
    if re.search(r"PCIE|\bNVL\b", s):
        return None
    # The lookbehind keeps GH200 / GB200 from matching H200 / B200.
    if re.search(r"(?<![A-Z])B200", s):
        return "B200"
    if re.search(r"(?<![A-Z])H200", s):
        return "H200"
    if re.search(r"(?<![A-Z])H100", s):
        return "H100"
    if re.search(r"(?<![A-Z])A100", s):
        if "80GB" in s:
            return "A100-80GB"
        if "40GB" in s:
            return "A100-40GB"
    return None


def _physical_memory() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None

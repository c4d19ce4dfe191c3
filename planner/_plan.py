"""The plan: what a pipelined step will do (stages, devices, microbatches, schedule)."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

SCHEMA_VERSION = 1


@dataclasses.dataclass(frozen=True, kw_only=True)
class StagePlan:
    """One pipeline stage."""

    index: int
    """Position in the pipeline (0 runs first in the forward pass)."""
    devices: tuple[int, ...]
    """Ids of the devices of this stage's sub-mesh."""
    mesh_shape: dict[str, int]
    """Axes of the stage's sub-mesh and their sizes, e.g. ``{"data": 2}``."""
    equations: tuple[int, int]
    """First and last index (inclusive) of the loss's forward equations this stage computes (the
    first one, ``equations[0]``, is what a replayed plan splits at)."""
    num_equations: int
    """How many forward equations the stage runs (parameter-only ones shared with other stages included)."""
    flops: float
    """Forward FLOPs of one microbatch-sized batch on this stage (the balanced quantity)."""
    param_bytes: int
    """Bytes of the parameters this stage owns."""
    cut_bytes_after: int
    """Activation bytes sent to later stages per microbatch (0 for the last stage)."""

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["devices"] = list(self.devices)
        d["equations"] = list(self.equations)
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StagePlan:
        _check_fields(cls, data, "stage")
        d = dict(data)
        d["devices"] = tuple(d["devices"])
        d["equations"] = tuple(d["equations"])
        d["mesh_shape"] = dict(d["mesh_shape"])
        return cls(**d)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Plan:
    """A complete pipeline plan for one traced step on a set of devices."""

    model_fingerprint: str
    """Hash of the traced step (shapes, dtypes, operations); a plan only replays on the same step."""
    stages: tuple[StagePlan, ...]
    """The pipeline stages, in order."""
    num_microbatches: int
    """Microbatches per step; the batch is split along the leading dimension of each batch leaf."""
    schedule: str
    """Schedule name (``gpipe``, ``1f1b``, ...)."""
    schedule_text: str
    """The schedule as text, one row per rank (see :class:`autopp.runtime.Schedule`)."""
    loss_reduction: str
    """How microbatch losses and gradients combine: ``mean`` or ``sum``."""
    schema_version: int = SCHEMA_VERSION
    """Version of this plan's JSON layout."""

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema_version": self.schema_version,
            "model_fingerprint": self.model_fingerprint,
            "num_microbatches": self.num_microbatches,
            "schedule": self.schedule,
            "schedule_text": self.schedule_text,
            "loss_reduction": self.loss_reduction,
            "stages": [s.to_dict() for s in self.stages],
        }

    def to_json(self, path: str | os.PathLike | None = None) -> str:
        """The plan as JSON text; also written to ``path`` when given."""
        text = json.dumps(self.to_dict(), indent=2)
        if path is not None:
            with open(path, "w") as f:
                f.write(text + "\n")
        return text

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Plan:
        if not isinstance(data, dict):
            raise ValueError(f"a plan must be a JSON object, got {type(data).__name__}.")
        version = data.get("schema_version")
        if version != SCHEMA_VERSION:
            raise ValueError(
                f"plan schema version {version!r} is not supported: this autopp reads version {SCHEMA_VERSION}. "
                "Make the plan again with this version of autopp (step.plan_for(...).to_json(path))."
            )
        _check_fields(cls, data, "plan")
        d = dict(data)
        d["stages"] = tuple(StagePlan.from_dict(st) for st in d["stages"])
        return cls(**d)

    @classmethod
    def from_json(cls, source: str | os.PathLike) -> Plan:
        """Read a plan from a JSON file path (or from JSON text)."""
        text = str(source)
        origin = "the given text"
        if not text.lstrip().startswith("{"):
            origin = repr(text)
            try:
                with open(source) as f:
                    text = f.read()
            except OSError as e:
                raise ValueError(f"cannot read plan file {origin}: {e.strerror}.") from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(
                f"plan {origin} is not valid JSON ({e.msg} at line {e.lineno}, column {e.colno}); it may be "
                "truncated or edited by hand. Write it again with plan.to_json(path)."
            ) from None
        return cls.from_dict(data)

    def __str__(self) -> str:
        lines = [
            f"pipeline: {self.num_stages} stage(s), {self.num_microbatches} microbatch(es), "
            f"schedule {self.schedule}, loss reduction {self.loss_reduction}",
            f"{'stage':>5}  {'devices':<16} {'equations':>13}  {'GFLOP/mb':>9}  {'params MB':>9}  {'sends MB/mb':>11}",
        ]
        for s in self.stages:
            eq = f"{s.equations[0]}-{s.equations[1]}"
            lines.append(
                f"{s.index:>5}  {','.join(map(str, s.devices)):<16} {eq:>13}  {s.flops / 1e9:>9.4f}  "
                f"{s.param_bytes / 1e6:>9.3f}  {s.cut_bytes_after / 1e6:>11.3f}"
            )
        return "\n".join(lines)


def _check_fields(cls, data: dict, what: str) -> None:
    names = {f.name for f in dataclasses.fields(cls)}
    required = {f.name for f in dataclasses.fields(cls)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    missing = sorted(required - set(data))
    unknown = sorted(set(data) - names)
    if missing or unknown:
        raise ValueError(
            f"malformed {what} in plan: "
            + (f"missing field(s) {missing}" if missing else "")
            + ("; " if missing and unknown else "")
            + (f"unknown field(s) {unknown}" if unknown else "")
            + f". A {what} has the fields {sorted(names)}."
        )

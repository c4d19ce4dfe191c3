"""The plan: what a pipelined step will do (stages, devices, microbatches, schedule)."""

from __future__ import annotations

import dataclasses
import json
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
    """First and last index (inclusive) of the loss's forward equations this stage computes."""
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

    def to_json(self, path: str | None = None) -> str:
        text = json.dumps(self.to_dict(), indent=2)
        if path is not None:
            with open(path, "w") as f:
                f.write(text + "\n")
        return text

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

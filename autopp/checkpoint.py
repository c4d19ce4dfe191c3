"""Checkpoints of a training state (orbax-checkpoint), restorable under any plan.

``save(directory, step, state)`` writes the state a pipelined step returns (its arrays may live on any
stages' devices and shardings) as one step directory; ``restore(directory, like=state)`` reads the latest
(or ``step=``) back as host arrays, or into ``shardings=``, for a step with any other plan. Each leaf's
shape, dtype and checksum are recorded and checked: a tree that does not match is refused naming the leaf,
and damaged files raise :class:`CheckpointCorruptedError` instead of restoring wrong values.
"""

from autopp._checkpoint import (
    CheckpointCorruptedError,
    Checkpointer,
    all_steps,
    latest_step,
    metadata,
    restore,
    save,
)

__all__ = ["CheckpointCorruptedError", "Checkpointer", "all_steps", "latest_step", "metadata", "restore", "save"]

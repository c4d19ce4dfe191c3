"""How a step's pipeline is laid out: microbatches, schedule, recomputation and layouts per stage, as the runtime
reads them off a plan (:func:`autopp.runtime._executor.build_program`)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax.extend.core import jaxprs_in_params

from autopp.core import Schedule

EXTREMES = {"max": jnp.maximum, "min": jnp.minimum}
"""How the microbatches' values of an aux output that is a maximum (minimum) over examples combine."""


def extreme_identity(kind: str, dtype):
    """The value that ``EXTREMES[kind]`` leaves any other unchanged: -inf for a maximum of floats, the least integer
    for one of integers (and the converse for a minimum)."""
    if jnp.issubdtype(dtype, jnp.inexact):
        return -jnp.inf if kind == "max" else jnp.inf
    if dtype == jnp.bool_:
        return kind != "max"
    info = jnp.iinfo(dtype)
    return info.min if kind == "max" else info.max


def loops_slowly(jaxpr, platform: str) -> bool:
    """Whether one stage's microbatches run one after another in its program rather than as a ``lax.scan``: a
    convolution net on CPU devices, whose convolutions' backward XLA:CPU runs 5-40x slower inside a loop (user trials
    COST and VISION: a UNet at data 4, jit with a scan over 4 microbatches 494.5 ms, as a Python loop 55.4 ms)."""
    def convolves(j) -> bool:
        return any(e.primitive.name == "conv_general_dilated"
                   or any(convolves(sub) for sub in jaxprs_in_params(e.params)) for e in j.eqns)

    return platform == "cpu" and convolves(jaxpr)


def concatenate_microbatches(parts, blocks) -> jnp.ndarray:
    """The whole batch's value of a per-example output from its microbatches' values (a list, or one array with the
    microbatches along axis 0): concatenated, or with ``blocks`` (each block's length in the whole batch: the
    output's leading axis holds several blocks of the examples, ``[chosen; rejected]``) block by block: every
    microbatch's block 0, then every microbatch's block 1, ..."""
    stacked = jnp.stack(parts) if isinstance(parts, (list, tuple)) else parts
    rest = stacked.shape[2:]
    if not isinstance(blocks, tuple):
        return stacked.reshape((-1,) + rest)
    cuts = [0]
    for length in blocks:
        cuts.append(cuts[-1] + length // stacked.shape[0])
    return jnp.concatenate([stacked[:, a:b].reshape((-1,) + rest) for a, b in zip(cuts, cuts[1:])])


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    """What the runtime lays out for one plan (the rest of the plan is the split and the stages' meshes)."""

    num_microbatches: int
    loss_reduction: str
    schedule: Schedule
    recompute: tuple[str, ...]
    """Recomputation mode of each stage."""
    param_specs: tuple | None = None
    """Per stage: ``{forward input index: spec}`` (a tuple with ``"tensor"`` where the parameter is split over the
    stage's tensor axis) from a plan, or None for Megatron's rule (:mod:`autopp.runtime._tensor`)."""
    zero1: bool = False
    """Optimizer state sharded over each stage's data axis too (ZeRO-1)."""
    sequence_vars: frozenset = frozenset()
    """Forward activations laid out along their sequence (second) dimension over the stage's tensor axis (sequence
    parallelism: the values between layers); their cotangents follow."""
    donated: frozenset = frozenset()
    """The step's flat inputs whose buffers its results may reuse (``donate_argnums``); their last readers donate."""
    stage_of: tuple[int, ...] = ()
    """The plan's stage of each of the runtime's stages, where the runtime cut stages into segments
    (:mod:`autopp.runtime._segments`); empty: the same stages. Tasks are labelled with the plan's stages."""
    output_reductions: tuple = ()
    """Per output of the loss: ``"mean"``, ``"sum"``, for an aux value also ``"max"`` or ``"min"`` (as its program
    shows), or None (as :attr:`loss_reduction`); for a per-example aux whose leading axis holds several blocks of the
    examples in order (``[chosen; rejected]`` concatenated, time-major rows), each block's length in the whole batch
    (a tuple, see :func:`concatenate_microbatches`)."""

    def reduction(self, k: int) -> str:  # how the microbatches' values of the loss's output k combine (0: the loss)
        return (self.output_reductions[k] if k < len(self.output_reductions) else None) or self.loss_reduction

    def read_once(self, k: int, dependent: bool) -> bool:
        """Whether every microbatch's value of aux output ``k`` is the step's: it reads no batch input (``dependent``:
        whether it does) and no batch size (a constant summed over the examples, ``"sum"``, is added up)."""
        return k > 0 and not dependent and (self.output_reductions[k:k + 1] or (None,))[0] != "sum"

    def plan_stage(self, s: int) -> int:
        return self.stage_of[s] if self.stage_of else s

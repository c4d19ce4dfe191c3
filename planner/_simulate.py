"""``simulate``: step time, throughput and memory of a layout (tensor x pipeline x data, FSDP, ZeRO-1, sequence
parallelism, schedule, recomputation) for a traced training step on a cluster.

The model is the traced program's: :mod:`autopp.planner._costmodel` (per-layer sharding by the intra-operator
ILP, per-kernel dtypes, fused attention, batch scaling, the schedule's event simulation, data-parallel
reductions, the optimizer's traffic). A model description (the zoo's ``GPTConfig``, ``LlamaConfig``, or anything
with an ``abstract_step()`` method returning ``(step, args, batch_argnums)``) is traced to that program first: the
same path as a user's own step.
"""

from __future__ import annotations

import collections
import dataclasses
import warnings
from collections.abc import Sequence
from typing import Any

from autopp.planner._chunks import chunk_split
from autopp.planner._costmodel import Layout, StepModel
from autopp.core import (DEFAULT_OVERLAP, OVERLAPS, RECOMPUTE_MODES, SCHEDULES, Estimate, divisors, positive_int,
                         user_stacklevel)
from autopp.profiler import Cluster, Profile, profile

__all__ = ["Estimate", "RECOMPUTE_MODES", "SCHEDULES", "OVERLAPS", "DEFAULT_OVERLAP", "as_profile", "clear_cache",
           "simulate", "step_model"]

_PROFILES: dict[tuple, Profile] = {}
_MODELS: dict[tuple, StepModel] = {}


def clear_cache() -> None:
    """Forget the cached profiles and cost models (the next call traces and solves again)."""
    _PROFILES.clear()
    _MODELS.clear()


def as_cluster(cluster: Any, who: str) -> Cluster:
    if isinstance(cluster, str):
        return Cluster.parse(cluster)
    if not isinstance(cluster, Cluster):
        raise TypeError(f"{who}: cluster must be a Cluster or a string like '4x8xA100-80GB', got {cluster!r}.")
    return cluster


def as_profile(model: Any, cluster: Cluster, who: str, *, microbatch_size: int = 1) -> Profile:
    """The profile of ``model``: a :class:`Profile` as it is, or a model description traced through its
    ``abstract_step()`` (cached per description and device)."""
    if isinstance(model, Profile):
        if cluster.device.name != model.cluster.device.name and any(l.measured for l in model.layers):
            raise ValueError(
                f"{who}: the profile's layer times were measured on {model.cluster.device.name} devices but the cluster "
                f"is {cluster}; profile the step without measure=True to plan for another device.")
        return model
    config = getattr(model, "config", None) if not hasattr(model, "abstract_step") else model
    if config is None or not callable(getattr(config, "abstract_step", None)):
        raise TypeError(
            f"{who}: model must be the Profile of a traced step (autopp.profiler.profile(step, *args, cluster=...)) or "
            f"a model description with abstract_step() such as autopp.models.GPTConfig or LlamaConfig, got "
            f"{type(model).__name__}.")
    key = (config, microbatch_size, cluster.device)
    hit = _PROFILES.get(key)
    if hit is None:
        step, args, batch_argnums = config.abstract_step(batch_size=microbatch_size)
        hit = _PROFILES[key] = profile(step, *args, cluster=cluster, batch_argnums=batch_argnums)
        if len(_PROFILES) > 16:
            _PROFILES.pop(next(iter(_PROFILES)))
    return hit


def step_model(prof: Profile, cluster: Cluster, overlap: Sequence[str] = DEFAULT_OVERLAP,
               dispatch_s: float = 0.0) -> StepModel:
    """The (cached) cost model of ``prof`` on ``cluster``."""
    key = (id(prof), prof.fingerprint, cluster, tuple(sorted(overlap)), dispatch_s)
    hit = _MODELS.get(key)
    if hit is None or hit.profile is not prof:
        hit = _MODELS[key] = StepModel(prof, cluster, overlap=overlap, dispatch_s=dispatch_s)
        if len(_MODELS) > 32:
            _MODELS.pop(next(iter(_MODELS)))
    return hit


def fp32_warning(prof: Profile, cluster: Cluster, who: str) -> None:
    """Warn when most of a step's matmul work (matmuls and convolutions) is float32 on a GPU (priced at TF32, half
    the bf16 rate)."""
    if cluster.device.name == "cpu":
        return
    from autopp.profiler import eqn_cost, matmul_dtype

    copies = collections.Counter(lay.fingerprint for lay in prof.layers)  # a program serves every layer like it
    total = f32 = f8 = 0.0
    for fp, prog in prof.programs.items():
        for e in prog.closed.jaxpr.eqns:
            if e.primitive.name in ("dot_general", "conv_general_dilated"):
                c = eqn_cost(e).flops * copies.get(fp, 1)
                total += c
                kind = matmul_dtype(e)
                f32 += c if kind in ("tf32", "float32") else 0.0
                f8 += c if kind == "float8" else 0.0
    if total and f32 / total > 0.5:
        advice = ("For mixed precision, cast the parameters to bfloat16 inside the loss (zoo models: dtype='bfloat16')."
                  if not f8 else
                  f"{100 * f8 / total:.0f}% are float8 (FP8 tensor cores); the gradients of float8 matmuls that return "
                  "float32 multiply float32 cotangents: FP8 recipes cast the cotangents to float8 (e5m2) in a "
                  "jax.custom_vjp.")
        warnings.warn(
            f"{who}: {100 * f32 / total:.0f}% of the step's matmul FLOPs are float32, priced at the TF32 rate of "
            f"{cluster.device.name} ({cluster.device.peak_flops('tf32') / 1e12:.0f} TFLOP/s, half of bf16). {advice}",
            stacklevel=3)


def _split_by(sm: StepModel, tensor: int, sequence_parallel: bool) -> float:
    """The fraction of the parameter bytes that a tensor degree splits (0 where it divides none of the weights)."""
    whole, split = sm.params(1, sequence_parallel), sm.params(tensor, sequence_parallel)
    total = whole.chunk_state(0, len(sm.layers))[0]
    return 1.0 - split.chunk_state(0, len(sm.layers))[0] / total if total else 0.0


def check_layout(prof: Profile, cluster: Cluster, *, global_batch: int, tp: int, pp: int, dp: int,
                 microbatch_size: int, schedule: str, recompute: str, virtual_stages: int, fsdp: int,
                 who: str = "simulate") -> tuple[Layout, list[tuple[int, int]]]:
    """Validate a layout against the cluster and the profile; returns it and its equal split."""
    global_batch = positive_int(who, "global_batch", global_batch, 512)
    tp, pp, dp = positive_int(who, "tp", tp), positive_int(who, "pp", pp), positive_int(who, "dp", dp)
    mbs = positive_int(who, "microbatch_size", microbatch_size)
    v = positive_int(who, "virtual_stages", virtual_stages)
    fsdp = positive_int(who, "fsdp", fsdp)
    if dp % fsdp:
        raise ValueError(f"{who}: fsdp={fsdp} must divide dp={dp} (FSDP shards the state over part of the "
                         f"data-parallel group); use one of {', '.join(map(str, divisors(dp)))}.")
    if not isinstance(schedule, str) or schedule.strip().lower().replace("_", "-") not in SCHEDULES:
        raise ValueError(f"{who}: unknown schedule {schedule!r}; use one of {', '.join(SCHEDULES)}.")
    schedule = schedule.strip().lower().replace("_", "-")
    if not isinstance(recompute, str) or recompute not in RECOMPUTE_MODES:
        raise ValueError(f"{who}: unknown recompute {recompute!r}; use one of {', '.join(RECOMPUTE_MODES)}.")
    n = cluster.num_devices
    if tp * pp * dp != n:
        hint = (f" (e.g. dp={n // (tp * pp)} for tp={tp}, pp={pp})" if n % (tp * pp) == 0
                else f" (tp*pp must divide {n})")
        raise ValueError(f"{who}: tp*pp*dp = {tp}*{pp}*{dp} = {tp * pp * dp} but the cluster ({cluster}) has {n} "
                         f"devices; choose degrees whose product is {n}{hint}.")
    if tp > cluster.devices_per_node:
        raise ValueError(f"{who}: tp={tp} exceeds the {cluster.devices_per_node} devices of a node; a "
                         f"tensor-parallel group stays inside a node, so use tp <= {cluster.devices_per_node}.")
    if v > 1 and schedule != "interleaved-1f1b":
        raise ValueError(f"{who}: virtual_stages={v} needs schedule='interleaved-1f1b' (got {schedule!r}); "
                         "pass virtual_stages=1 or that schedule.")
    if global_batch % (mbs * dp):
        raise ValueError(f"{who}: global_batch={global_batch} is not divisible by microbatch_size*dp = {mbs}*{dp} "
                         f"= {mbs * dp}; use a global batch that is a multiple of {mbs * dp}.")
    M = global_batch // (mbs * dp)
    if schedule == "interleaved-1f1b" and M % pp:
        raise ValueError(f"{who}: interleaved-1f1b needs the {M} microbatches per pipeline to be a multiple of "
                         f"pp={pp}; change global_batch or microbatch_size so that global_batch/(microbatch_size*dp) "
                         f"is a multiple of {pp}.")
    if schedule == "dualpipev" and M < 2 * pp:
        raise ValueError(f"{who}: dualpipev needs at least 2*pp = {2 * pp} microbatches per pipeline, got {M}.")
    layout = Layout(tensor=tp, pipeline=pp, data=dp, fsdp=fsdp, microbatch_size=mbs, schedule=schedule,
                    virtual_stages=v)
    chunks = layout.num_chunks
    split = chunk_split(prof, chunks)
    if split is None:
        blocks = sum(1 for l in prof.layers if l.name.startswith("block"))
        what = f"{blocks} blocks" if blocks else f"{len(prof.layers)} layers"
        raise ValueError(f"{who}: the model's {what} cannot fill pp*virtual_stages = {pp}*{v} = {chunks} stages (each "
                         f"needs one); choose pp*virtual_stages <= {blocks or len(prof.layers)}.")
    return layout, split


def simulate(model: Any, cluster: Cluster | str, *, global_batch: int, tp: int, pp: int, dp: int,
             microbatch_size: int, schedule: str = "1f1b", recompute: str = "full", virtual_stages: int = 1,
             fsdp: int = 1, zero1: bool = False, sequence_parallel: bool = False,
             overlap: Sequence[str] = DEFAULT_OVERLAP) -> Estimate:
    """Predict step time, throughput and per-device memory of training ``model`` on ``cluster`` with ``tp``-way
    tensor, ``pp``-way pipeline and ``dp``-way data parallelism, the repeated blocks split equally over the
    ``pp * virtual_stages`` model chunks (see :mod:`autopp.planner._costmodel` for the model).

    ``model``: the :class:`~autopp.profiler.Profile` of a traced step (any batch size: costs scale to
    ``microbatch_size``), or a model description with ``abstract_step()`` (``autopp.models.GPTConfig``,
    ``LlamaConfig``). ``cluster``: a :class:`Cluster` or a string such as ``"64x8xA100-80GB"``. ``schedule``: one
    of :data:`SCHEDULES`; ``recompute``: one of :data:`RECOMPUTE_MODES` (applied to the repeated blocks).
    ``fsdp`` (divides ``dp``) shards parameters, gradients and optimizer state ZeRO-3 style over that many
    replicas; ``zero1`` shards the optimizer state over the rest; ``sequence_parallel`` splits the activations
    between layers along their sequence over the tensor group. ``overlap``: the communication hidden behind compute
    (:data:`OVERLAPS`; default what XLA overlaps by itself).
    """
    who = "simulate"
    cluster = as_cluster(cluster, who)
    prof = as_profile(model, cluster, who)
    if isinstance(overlap, str):
        overlap = (overlap,)
    layout, split = check_layout(prof, cluster, global_batch=global_batch, tp=tp, pp=pp, dp=dp,
                                 microbatch_size=microbatch_size, schedule=schedule, recompute=recompute,
                                 virtual_stages=virtual_stages, fsdp=fsdp, who=who)
    if not isinstance(zero1, bool) or not isinstance(sequence_parallel, bool):
        raise TypeError(f"{who}: zero1 and sequence_parallel must be True or False, got zero1={zero1!r}, "
                        f"sequence_parallel={sequence_parallel!r}.")
    fp32_warning(prof, cluster, who)
    layout = dataclasses.replace(layout, zero1=zero1, sequence_parallel=sequence_parallel)
    sm = step_model(prof, cluster, tuple(overlap))
    if tp > 1 and _split_by(sm, tp, sequence_parallel) < 1e-9:
        splits = [t for t in divisors(cluster.devices_per_node)
                  if t > 1 and _split_by(sm, t, sequence_parallel) >= 1e-9]
        warnings.warn(
            f"{who}: tp={tp} splits none of the step's weights (it divides no head count, width or vocabulary that "
            "a matmul splits by, or splitting them is priced slower than keeping them whole): each of the tensor "
            f"group's {tp} devices holds and computes the whole model, as predicted. Tensor degrees that split "
            f"weights here: {splits or 'none'}.", stacklevel=user_stacklevel())
    M = global_batch // (layout.microbatch_size * dp)
    exact = M * layout.num_chunks <= 20_000
    return sm.evaluate(layout, global_batch, split, [recompute] * layout.num_chunks, exact=exact).estimate

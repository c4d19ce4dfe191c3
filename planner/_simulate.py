"""``simulate``: step time, throughput and memory of a 3D-parallel (tensor x pipeline x data) training plan.

The simulator answers "how fast would this layout train this model on that cluster?" without running it.
Per-layer costs come from :func:`autopp.profiler.profile` of the model's loss step (traced abstractly at the
requested microbatch size, timed by the device table's roofline model); the layout adds, analytically:

* **Tensor parallelism** (Megatron-LM's split, Shoeybi et al. 2019): the matmuls, the attention core and the
  vocabulary-parallel embedding/head divide by ``tp``; the LayerNorms and residual adds are replicated
  (:data:`REPLICATED_BYTES_PER_ELEMENT` bytes of memory traffic per ``mbs*s*h`` element and dtype byte, forward;
  twice that backward). Each block all-reduces its ``mbs*s*h`` activations twice in the forward and twice in the
  backward (plus twice again in the recomputed forward with full recomputation); the embedding all-reduces its
  output (forward) and the head its input gradient (backward). A tensor-parallel group stays inside a node.
* **Pipeline parallelism**: stage ``i`` gets ``layers/pp`` consecutive blocks (the embedding on the first stage,
  the head and loss on the last). The slowest stage's forward ``f`` and backward ``b`` per microbatch set the
  pace; the pipeline takes ``M (f + b)`` plus the schedule's bubble, in closed form (checked against
  :func:`autopp.planner._schedule.simulate_times` in the tests): GPipe and 1F1B ``(pp-1)(f+b)``, interleaved 1F1B
  ``(pp-1)(f+b)/v``, ZB-H1 ``(pp-1) max(f + b - 2w, b - w)`` with ``w`` the weight-gradient half of the
  backward (Qi et al. 2023's ``(p-1)(T_F + T_B - T_W)`` while ``W <= F``; the input-gradient chain otherwise). Activations (and their gradients) cross a stage boundary as ``mbs*s*h`` elements with Megatron's
  scatter/gather optimisation: ``1/tp`` of the message goes over the inter-node link (the pipeline spans
  nodes whenever the cluster has more than one), then an all-gather inside the node; with ``v`` interleaved
  chunks a rank sends ``v`` times per microbatch each way. Sends are not overlapped. The tied word-embedding
  gradient is all-reduced between the first and last stage once per step.
* **Data parallelism**: the gradients of a stage's ``1/tp`` parameter shard are all-reduced in fp32
  (:data:`GRAD_REDUCE_BYTES`: Megatron-LM accumulates and reduces bf16 models' gradients in fp32) over the ``dp``
  replicas, hierarchically: reduce-scatter inside the node over the replicas there, all-reduce of the shard
  across nodes (every GPU uses its own NIC, as NCCL's multi-channel rings do), all-gather inside the node.
  A stage's reduction starts after its last backward; in the 1F1B cooldown stage ``i`` finishes ``i``
  backward slots before stage 0, so its reduction hides behind the later stages' backwards; what sticks out
  past the end of the pipeline is exposed (in practice stage 0's whole share). No overlap *within* a stage's
  backward is assumed (Megatron-LM 2021 reduces after the backward pass).
* **FSDP** (ZeRO-3, Rajbhandari et al. 2020) over ``fsdp`` of the ``dp`` replicas: weights, gradients and
  optimizer state are divided by ``fsdp``; every microbatch all-gathers the stage's weights for the forward and
  again for the backward and reduce-scatters the fp32 gradients; prefetching hides this traffic behind the
  stage's compute, and only what exceeds it is exposed. The replicas of a shard (``dp/fsdp``) all-reduce it once
  per step as above. Two gathered blocks and one block's gradients are held unsharded.
* **Optimizer**: mixed-precision Adam, memory-bound: :data:`ADAM_BYTES_PER_PARAM` bytes of HBM traffic per
  parameter of the GPU's shard at the time model's bandwidth.
* **Memory per GPU**: weights in the model dtype, fp32 gradients, an fp32 master copy (when the weights are
  narrower than fp32) and Adam's fp32 ``m`` and ``v``: 18 bytes per parameter for bf16 (Megatron-LM without a
  distributed optimizer), divided by ``tp`` (the last stage also keeps the tied word embeddings for the head).
  Activations: per layer from the profile (VJP residuals), the replicated part (the two LayerNorm inputs) whole
  and the rest ``/tp``, times the stage's layers, times the microbatches in flight on the stage (1F1B:
  ``min(M, pp - i)`` on stage ``i``; ZB-H1: ``min(M, pp)`` on every stage, its deferred weight gradients keeping
  activations alive; GPipe: ``M``; interleaved: Megatron's warm-up count of model chunks,
  ``(v-1) pp + 2 (pp-i-1) + 1``, each ``1/v`` of the stage).
  With full recomputation a block keeps only its input, plus one block's full activations while it recomputes;
  with selective recomputation (Korthikanti et al. 2022: recompute only the attention core, QK^T, softmax and
  the attention-weighted sum) the block keeps only its VJP residuals that are not shaped like the ``s x s``
  attention scores (read off ``jax.vjp`` of one block: about Megatron's ``34 s b h`` bytes for GPT in bf16,
  the same as the paper's count) and its backward re-runs the
  attention core (its time: two ``b*heads*s*s*head_dim`` matmuls plus a memory-bound softmax over
  :data:`SOFTMAX_BYTES_PER_SCORE` bytes per score, on the time model).

The embedding and head are never recomputed (as in Megatron-LM), so with full recomputation the FLOPs the plan
executes equal the model FLOPs plus one more forward of the blocks: for Megatron's GPT exactly
``96 B s l h^2 (1 + s/(6h) + V/(16 l h))``.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any

import jax
import jax.numpy as jnp

from autopp.models._gpt import GPT, GPTConfig
from autopp.profiler._cluster import Cluster
from autopp.profiler._costs import OpCost
from autopp.profiler._profile import Profile, profile
from autopp.profiler._timemodel import KernelTimeModel, collective_time

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1")
"""Pipeline schedules :func:`simulate` models."""

RECOMPUTE_MODES = ("none", "full", "selective")
"""Activation recomputation modes :func:`simulate` models."""

GRAD_REDUCE_BYTES = 4
"""Bytes per gradient element in the data-parallel reduction (fp32, as Megatron-LM does for bf16 models)."""

ADAM_BYTES_PER_PARAM = 30
"""HBM bytes one mixed-precision Adam update moves per parameter: read the fp32 gradient (4), read and write the
fp32 master weight, ``m`` and ``v`` (24), write the bf16 weight (2)."""

REPLICATED_BYTES_PER_ELEMENT = 10
"""Memory traffic, in units of ``mbs*s*h`` elements, of a block's tensor-parallel-replicated forward work: two
LayerNorms (read x, write y) and two residual adds (read two, write one); the backward moves twice that."""

SOFTMAX_BYTES_PER_SCORE = 11
"""Bytes per attention score a recomputed softmax moves (fp32 scores written and read, the causal mask read,
bf16 probabilities written)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Estimate:
    """What :func:`simulate` predicts for one training step of a plan."""

    step_time_s: float
    """Seconds per training step (one global batch)."""
    tflops_per_gpu: float
    """TFLOP/s per GPU counting the FLOPs the plan executes, recomputation included (for Megatron's GPT with
    full recomputation: ``96 B s l h^2 (1 + s/(6h) + V/(16 l h))``), over step time and GPU count."""
    mfu: float
    """Model FLOPs utilisation: model FLOPs (forward + backward, no recomputation) / (step time x GPUs x the
    device's dense bf16 peak)."""
    peak_memory_bytes_per_gpu: int
    """Bytes of device memory the most loaded GPU needs (weights, gradients, optimizer state, activations)."""
    fits: bool
    """Whether ``peak_memory_bytes_per_gpu`` fits the device's memory."""
    compute_s: float
    """Seconds the slowest pipeline stage computes (all microbatches, forward + backward + recomputation)."""
    bubble_s: float
    """Seconds of pipeline bubble (the schedule's fill and drain at the slowest stage's pace)."""
    tp_comm_s: float
    """Seconds of tensor-parallel all-reduces on the slowest stage (not overlapped)."""
    fsdp_comm_s: float
    """Exposed seconds of FSDP (ZeRO-3) weight gathers and gradient reduce-scatters on the slowest stage (the part
    the stage's compute does not hide; 0 without FSDP)."""
    pp_comm_s: float
    """Seconds of stage-to-stage sends and the tied-embedding gradient all-reduce (not overlapped)."""
    dp_comm_s: float
    """Exposed seconds of the data-parallel gradient all-reduce (the part not hidden behind other stages'
    backward passes)."""
    optimizer_s: float
    """Seconds of the optimizer update (memory-bound)."""
    num_microbatches: int
    """Microbatches per pipeline per step: ``global_batch / (microbatch_size * dp)``."""
    param_bytes: int
    """Bytes of weights (model dtype) and fp32 gradients on the most loaded GPU."""
    optimizer_bytes: int
    """Bytes of optimizer state on the most loaded GPU: fp32 master weights (for narrower dtypes), Adam m and v."""
    activation_bytes: int
    """Bytes of activations kept for the backward on the most loaded GPU, at peak."""

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly dict of every field."""
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class _LayerCosts:
    """Per-microbatch costs of the three kinds of layer, read off a profile."""

    profile: Profile
    embed: Any
    block: Any
    head: Any
    non_attention_residual_bytes: int
    """Bytes of a block's VJP residuals (``jax.vjp`` of one block) not shaped like the ``s x s`` attention scores:
    what a block keeps with selective recomputation."""


_CACHE: dict[tuple, _LayerCosts] = {}


def clear_cache() -> None:
    """Forget the cached profiles (the next :func:`simulate` for each model profiles again)."""
    _CACHE.clear()


def _layer_costs(config: GPTConfig, microbatch_size: int, cluster: Cluster) -> _LayerCosts:
    key = (config, microbatch_size, cluster.device)
    hit = _CACHE.get(key)
    if hit is not None:
        return hit
    # The blocks are identical, so a two-block copy of the model has the same embedding, block and head
    # profiles as the full depth (checked in the tests) and traces in a fraction of the time.
    short = dataclasses.replace(config, layers=min(config.layers, 2))
    model = GPT(short)

    def step(params, batch):
        from autopp import grad
        return grad(model.loss)(params, batch)

    tokens = jax.ShapeDtypeStruct((microbatch_size, config.seq), jnp.int32)
    prof = profile(step, model.init_abstract(), {"tokens": tokens, "targets": tokens},
                   cluster=Cluster(num_nodes=1, devices_per_node=1, device=cluster.device))
    names = [l.name for l in prof.layers]
    if len(prof.layers) != short.layers + 2 or names[0] != "embed" or names[-1] != "head" or not all(
            n.startswith("block") for n in names[1:-1]):
        raise RuntimeError(f"simulate: unexpected layer structure of the GPT profile: {names}; expected "
                           "embed, block 0..., head.")
    # VJP residuals not shaped like the (s x s) attention scores: what selective recomputation keeps.
    x = jax.ShapeDtypeStruct((microbatch_size, config.seq, config.hidden), jnp.dtype(config.dtype))
    params = model.init_abstract()["blocks"][0]
    residuals = jax.eval_shape(lambda p, x: jax.tree_util.tree_leaves(jax.vjp(model.block, p, x)[1]), params, x)
    s = config.seq
    kept = sum(math.prod(r.shape) * jnp.dtype(r.dtype).itemsize for r in residuals
               if not (len(r.shape) >= 2 and tuple(r.shape[-2:]) == (s, s)))
    costs = _LayerCosts(profile=prof, embed=prof.layers[0], block=prof.layers[1], head=prof.layers[-1],
                        non_attention_residual_bytes=int(kept))
    _CACHE[key] = costs
    return costs


def _bubble_time(schedule: str, pp: int, v: int, f: float, b: float, w: float) -> float:
    """Idle time of a pipeline of ``pp`` ranks beyond ``M (f + b)``, with per-microbatch forward ``f``, backward
    ``b`` (of which ``w`` is the weight gradient) per rank (a chunk costs ``f/v``, ``b/v`` when interleaved)."""
    if schedule in ("gpipe", "1f1b"):
        return (pp - 1) * (f + b)
    if schedule == "interleaved-1f1b":
        return (pp - 1) * (f + b) / v
    return (pp - 1) * max(f + b - 2 * w, b - w)  # zb-h1


def _positive_int(name: str, value: Any, example: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:
        raise ValueError(f"simulate: {name} must be a positive int, got {name}={value!r}; pass e.g. {name}={example}.")
    return int(value)


def _divisors_hint(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def simulate(model: GPTConfig, cluster: Cluster | str, *, global_batch: int, tp: int, pp: int, dp: int,
             microbatch_size: int, schedule: str = "1f1b", recompute: str = "full",
             virtual_stages: int = 1, fsdp: int = 1) -> Estimate:
    """Predict step time, throughput and per-GPU memory of training ``model`` on ``cluster`` with ``tp``-way
    tensor, ``pp``-way pipeline and ``dp``-way data parallelism (see the module docstring for the model).

    ``model`` is a :class:`~autopp.models.GPTConfig` (or a :class:`~autopp.models.GPT`); ``cluster`` a
    :class:`Cluster` or a string such as ``"64x8xA100-80GB"``. ``schedule`` is one of :data:`SCHEDULES`
    (``virtual_stages`` > 1 only with ``"interleaved-1f1b"``), ``recompute`` one of :data:`RECOMPUTE_MODES`.
    ``fsdp`` (a divisor of ``dp``) shards parameters, gradients and optimizer state ZeRO-3 style over that many of
    the data-parallel replicas.

    ``model`` may also be a traced step: the :class:`~autopp.profiler.Profile` of any training step (times for the
    cluster's device). Its layers are not known to be Megatron blocks, so only pipeline x data layouts are
    modelled (``tp=1``, ``fsdp=1``, ``recompute="none"``, GPipe or 1F1B), with the layers split into ``pp``
    stages of equal layer counts and the cost model of :mod:`autopp.planner._local`. The first call for a (model, microbatch size, device) profiles the model (about a second); later calls use
    the cached profile.
    """
    if isinstance(model, GPT):
        model = model.config
    if isinstance(model, Profile):
        return _simulate_profile(model, cluster, global_batch=global_batch, tp=tp, pp=pp, dp=dp,
                                 microbatch_size=microbatch_size, schedule=schedule, recompute=recompute,
                                 virtual_stages=virtual_stages, fsdp=fsdp)
    if not isinstance(model, GPTConfig):
        raise TypeError(f"simulate: model must be an autopp.models.GPTConfig (or GPT) or the Profile of a traced "
                        f"step, got {type(model).__name__}; "
                        "pass e.g. GPTConfig(layers=24, hidden=2304, heads=24, seq=2048, vocab=51200, "
                        "dtype='bfloat16').")
    if isinstance(cluster, str):
        cluster = Cluster.parse(cluster)
    elif not isinstance(cluster, Cluster):
        raise TypeError(f"simulate: cluster must be a Cluster or a string like '4x8xA100-80GB', got {cluster!r}.")
    global_batch = _positive_int("global_batch", global_batch, 512)
    tp = _positive_int("tp", tp)
    pp = _positive_int("pp", pp)
    dp = _positive_int("dp", dp)
    mbs = _positive_int("microbatch_size", microbatch_size)
    v = _positive_int("virtual_stages", virtual_stages)
    fsdp = _positive_int("fsdp", fsdp)
    if dp % fsdp:
        raise ValueError(f"simulate: fsdp={fsdp} must divide dp={dp} (FSDP shards the state over part of the "
                         f"data-parallel group); use one of {_divisors_hint(dp)}.")
    if not isinstance(schedule, str) or schedule.strip().lower().replace("_", "-") not in SCHEDULES:
        raise ValueError(f"simulate: unknown schedule {schedule!r}; use one of {', '.join(SCHEDULES)}.")
    schedule = schedule.strip().lower().replace("_", "-")
    if not isinstance(recompute, str) or recompute not in RECOMPUTE_MODES:
        raise ValueError(f"simulate: unknown recompute {recompute!r}; use one of {', '.join(RECOMPUTE_MODES)}.")
    n = cluster.num_devices
    if tp * pp * dp != n:
        raise ValueError(f"simulate: tp*pp*dp = {tp}*{pp}*{dp} = {tp * pp * dp} but the cluster ({cluster}) has {n} "
                         f"devices; choose degrees whose product is {n} (e.g. dp={n // (tp * pp)} for tp={tp}, "
                         f"pp={pp})." if n % (tp * pp) == 0 else
                         f"simulate: tp*pp*dp = {tp}*{pp}*{dp} = {tp * pp * dp} but the cluster ({cluster}) has {n} "
                         f"devices; choose degrees whose product is {n} (tp*pp must divide {n}).")
    if tp > cluster.devices_per_node:
        raise ValueError(f"simulate: tp={tp} exceeds the {cluster.devices_per_node} devices of a node; a "
                         f"tensor-parallel group stays inside a node, so use tp <= {cluster.devices_per_node}.")
    if model.heads % tp:
        raise ValueError(f"simulate: tp={tp} must divide the {model.heads} attention heads; use one of "
                         f"{_divisors_hint(model.heads)}.")
    if v > 1 and schedule != "interleaved-1f1b":
        raise ValueError(f"simulate: virtual_stages={v} needs schedule='interleaved-1f1b' (got {schedule!r}); "
                         "pass virtual_stages=1 or that schedule.")
    if model.layers % (pp * v):
        raise ValueError(f"simulate: {model.layers} layers do not split into pp*virtual_stages = {pp}*{v} = {pp * v} "
                         f"equal stages; choose pp*virtual_stages among {_divisors_hint(model.layers)}.")
    if global_batch % (mbs * dp):
        raise ValueError(f"simulate: global_batch={global_batch} is not divisible by microbatch_size*dp = {mbs}*{dp} "
                         f"= {mbs * dp}; use a global batch that is a multiple of {mbs * dp}.")
    M = global_batch // (mbs * dp)
    if schedule == "interleaved-1f1b" and M % pp:
        raise ValueError(f"simulate: interleaved-1f1b needs the {M} microbatches per pipeline to be a multiple of "
                         f"pp={pp}; change global_batch or microbatch_size so that global_batch/(microbatch_size*dp) "
                         f"is a multiple of {pp}.")

    costs = _layer_costs(model, mbs, cluster)
    per_stage = model.layers // pp
    return _estimate(model, cluster, costs, global_batch=global_batch, tp=tp, dp=dp, fsdp=fsdp, microbatch_size=mbs,
                     schedule=schedule, virtual_stages=v, stage_blocks=[per_stage] * pp,
                     stage_recompute=[recompute] * pp)


def _simulate_profile(prof: Profile, cluster, *, global_batch, tp, pp, dp, microbatch_size, schedule, recompute,
                      virtual_stages, fsdp) -> Estimate:
    from autopp.planner._local import LayerCosts, Layout, evaluate, uniform_split

    if isinstance(cluster, str):
        cluster = Cluster.parse(cluster)
    elif not isinstance(cluster, Cluster):
        raise TypeError(f"simulate: cluster must be a Cluster or a string like '4x8xA100-80GB', got {cluster!r}.")
    if cluster.device != prof.cluster.device:
        raise ValueError(f"simulate: the profile's times are for {prof.cluster.device.name} devices but the cluster is "
                         f"{cluster}; profile the step for it: autopp.profiler.profile(step, *args, "
                         f"cluster={cluster.shorthand!r}).")
    for name, value, only in (("tp", tp, 1), ("fsdp", fsdp, 1), ("virtual_stages", virtual_stages, 1),
                              ("recompute", recompute, "none")):
        if value != only:
            raise ValueError(f"simulate: {name}={value!r} is not modelled for a traced step (its layers are not known "
                             f"to be Megatron blocks); use {name}={only!r}, or describe the model as a GPTConfig.")
    if schedule not in ("gpipe", "1f1b"):
        raise ValueError(f"simulate: schedule {schedule!r} is not modelled for a traced step; use 'gpipe' or '1f1b'.")
    global_batch = _positive_int("global_batch", global_batch, 512)
    pp, dp, mbs = _positive_int("pp", pp), _positive_int("dp", dp), _positive_int("microbatch_size", microbatch_size)
    if pp * dp != cluster.num_devices:
        raise ValueError(f"simulate: pp*dp = {pp}*{dp} = {pp * dp} but the cluster ({cluster}) has "
                         f"{cluster.num_devices} devices; choose degrees whose product is {cluster.num_devices}.")
    if global_batch % (mbs * dp):
        raise ValueError(f"simulate: global_batch={global_batch} is not divisible by microbatch_size*dp = {mbs}*{dp} "
                         f"= {mbs * dp}; use a global batch that is a multiple of {mbs * dp}.")
    costs = LayerCosts.from_profile(prof)
    if pp > costs.num_layers:
        raise ValueError(f"simulate: pp={pp} exceeds the profile's {costs.num_layers} layers; use pp <= "
                         f"{costs.num_layers}.")
    layout = Layout(num_stages=pp, devices_per_stage=dp, num_microbatches=global_batch // (mbs * dp),
                    schedule=schedule, batch_size=global_batch)
    return evaluate(costs, cluster, layout, uniform_split(costs, pp)).estimate


def _estimate(model: GPTConfig, cluster: Cluster, costs: _LayerCosts, *, global_batch: int, tp: int, dp: int,
              fsdp: int, microbatch_size: int, schedule: str, virtual_stages: int, stage_blocks: list[int],
              stage_recompute: list[str], exact: bool = False) -> Estimate:
    """The estimate of a validated layout whose stage ``i`` holds ``stage_blocks[i]`` transformer blocks (stage 0
    also the embedding, the last also the head) and recomputes them as ``stage_recompute[i]`` says. With
    ``exact``, the pipeline's makespan comes from the discrete-event simulation of the schedule
    (:func:`autopp.planner._schedule.simulate_times`) with each stage's own forward and backward times instead of
    the closed form at the slowest stage's pace."""
    layout = _Layout(model, cluster, costs, global_batch=global_batch, tp=tp, dp=dp, fsdp=fsdp,
                     microbatch_size=microbatch_size, schedule=schedule, virtual_stages=virtual_stages,
                     num_stages=len(stage_blocks))
    return layout.estimate(stage_blocks, stage_recompute, exact=exact)


class _Layout:
    """The cost model of one (tp, pp, dp, fsdp, microbatch size, schedule) layout: each stage's time and memory as
    a function of its block count and recomputation mode, and the step's estimate."""

    def __init__(self, model: GPTConfig, cluster: Cluster, costs: _LayerCosts, *, global_batch: int, tp: int,
                 dp: int, fsdp: int, microbatch_size: int, schedule: str, virtual_stages: int, num_stages: int):
        self.model, self.cluster, self.costs = model, cluster, costs
        self.tp, self.dp, self.fsdp, self.mbs, self.schedule = tp, dp, fsdp, microbatch_size, schedule
        self.v, self.pp = virtual_stages, num_stages
        pp, v, mbs = num_stages, virtual_stages, microbatch_size
        self.M = global_batch // (mbs * dp)
        tm: KernelTimeModel = costs.profile.time_model
        self.tm = tm
        dpn = cluster.devices_per_node
        self.itemsize = itemsize = jnp.dtype(model.dtype).itemsize
        s, h = model.seq, model.hidden
        elems = mbs * s * h
        act_msg = elems * itemsize  # one (mbs, s, h) activation in the model dtype
        emb, blk, head = costs.embed, costs.block, costs.head

        # ---- tensor parallelism: per-microbatch compute and communication of each layer kind ----
        rep_fwd = (1 - 1 / tp) * REPLICATED_BYTES_PER_ELEMENT * elems * itemsize / tm.bytes_per_s
        self.blk_f = blk.forward_time_s / tp + rep_fwd
        self.blk_b = blk.backward_time_s / tp + 2 * rep_fwd
        self.ar = ar = collective_time("all-reduce", act_msg, tp, cluster, spans_nodes=False) if tp > 1 else 0.0
        # Selective recomputation re-runs the attention core: QK^T and PV matmuls and the softmax.
        heads_local = model.heads // tp
        attn_core = OpCost(4.0 * mbs * heads_local * s * s * model.head_dim, 0.0,
                           itemsize * mbs * heads_local * s * (2 * s + 3 * model.head_dim), 0.0)
        softmax = OpCost(5.0 * mbs * heads_local * s * s, mbs * heads_local * s * s,
                         SOFTMAX_BYTES_PER_SCORE * mbs * heads_local * s * s, 0.0)
        attn_recompute = tm.kernel_time("matmul", attn_core) + tm.kernel_time("fused", softmax)
        # Per recomputation mode: extra backward time and communication per block, extra FLOPs per block.
        self.recompute_cost = {"none": (0.0, 0.0, 0.0), "full": (self.blk_f, 2 * ar, blk.flops),
                               "selective": (attn_recompute, 0.0, (attn_core.flops + softmax.flops) * tp)}
        self.emb_f, self.emb_b = emb.forward_time_s / tp, emb.backward_time_s / tp
        self.head_f, self.head_b = head.forward_time_s / tp, head.backward_time_s / tp

        # ---- parameters per GPU (before FSDP sharding) ----
        self.blk_params = blk.param_bytes / itemsize / tp
        self.emb_params = emb.param_bytes / itemsize / tp
        # the last stage also holds a tied copy of the word embeddings for the head
        self.head_params = (head.param_bytes / itemsize + (model.vocab * h if pp > 1 else 0)) / tp

        # ---- FSDP (ZeRO-3) inside the data-parallel group ----
        self.fsdp_spans = fsdp * tp > dpn

        # ---- pipeline transfers ----
        p2p = 0.0
        if pp > 1:
            p2p = collective_time("send-recv", act_msg / tp, 2, cluster, spans_nodes=cluster.num_nodes > 1)
            if tp > 1:
                p2p += collective_time("all-gather", act_msg, tp, cluster, spans_nodes=False)
            p2p *= v  # each of a rank's v model chunks receives (and sends) every microbatch
        self.p2p = p2p

        # ---- memory per GPU ----
        self.weight_b = itemsize + 4  # weights + fp32 gradients
        self.opt_b = (4 if itemsize < 4 else 0) + 8  # fp32 master copy + Adam m, v
        replicated_act = 2 * act_msg  # the two LayerNorm inputs (no sequence parallelism)
        blk_act_tp = min(blk.activation_bytes, replicated_act) + max(0, blk.activation_bytes - replicated_act) / tp
        kept = min(costs.non_attention_residual_bytes, blk.activation_bytes)
        # per mode: bytes a block keeps per microbatch in flight, working bytes while it recomputes
        self.keep = {"full": (blk.recompute_activation_bytes, blk_act_tp),
                     "selective": (min(kept, replicated_act) + max(0, kept - replicated_act) / tp, 0.0),
                     "none": (blk_act_tp, 0.0)}
        # FSDP holds two gathered blocks (the one computing, the one prefetched) and one block's full gradients.
        self.fsdp_working = 2 * self.blk_params * (itemsize + GRAD_REDUCE_BYTES) if fsdp > 1 else 0.0

    def fsdp_comm(self, params: float) -> float:
        """Per microbatch: all-gather the stage's weights for the forward and again for the backward,
        reduce-scatter the fp32 gradients (prefetching overlaps it with the stage's compute)."""
        if self.fsdp == 1:
            return 0.0
        f, c, spans = self.fsdp, self.cluster, self.fsdp_spans
        return (2 * collective_time("all-gather", params * self.itemsize, f, c, spans_nodes=spans)
                + collective_time("reduce-scatter", params * GRAD_REDUCE_BYTES, f, c, spans_nodes=spans))

    def stage_params(self, i: int, n: int) -> float:
        """Parameters (elements) on a GPU of stage ``i`` holding ``n`` blocks, before FSDP sharding."""
        return (n * self.blk_params + (self.emb_params if i == 0 else 0.0)
                + (self.head_params if i == self.pp - 1 else 0.0))

    def stage_time(self, i: int, n: int, recompute: str) -> dict[str, float]:
        """Per-microbatch times of stage ``i`` with ``n`` blocks: compute ``fc``/``bc``, ZB-H1's weight-gradient
        part ``wc``, tensor-parallel ``tpc``, exposed FSDP ``fsdp``, and the rank's busy ``f``/``b`` in total."""
        first, last = i == 0, i == self.pp - 1
        rec_t, rec_comm, _ = self.recompute_cost[recompute]
        fc = n * self.blk_f + (self.emb_f if first else 0.0) + (self.head_f if last else 0.0)
        bc = n * (self.blk_b + rec_t) + (self.emb_b if first else 0.0) + (self.head_b if last else 0.0)
        wc = n * self.costs.block.backward_time_s / self.tp / 2
        tpc_f = n * 2 * self.ar + (self.ar if first else 0.0)
        tpc_b = n * (2 * self.ar + rec_comm) + (self.ar if last else 0.0)
        fs = max(0.0, self.fsdp_comm(self.stage_params(i, n)) - (fc + bc))
        return dict(fc=fc, bc=bc, wc=wc, tpc=tpc_f + tpc_b, fsdp=fs, f=fc + tpc_f + self.p2p + fs / 2,
                    b=bc + tpc_b + self.p2p + fs / 2)

    def in_flight(self, i: int) -> float:
        """Microbatches' worth of stage-i activations held at stage i's peak."""
        M, pp, v = self.M, self.pp, self.v
        if self.schedule == "gpipe":
            return M
        if self.schedule == "interleaved-1f1b" and v > 1:
            return min((v - 1) * pp + 2 * (pp - i - 1) + 1, M * v) / v
        if self.schedule == "zb-h1":  # warm-up forwards plus up to i deferred weight gradients (Qi et al. 2023)
            return min(M, pp)
        return min(M, pp - i)

    def stage_memory(self, i: int, n: int, recompute: str) -> tuple[float, float, float, float]:
        """Peak bytes on a GPU of stage ``i`` with ``n`` blocks: (total, weights + gradients, optimizer state,
        activations)."""
        emb, head = self.costs.embed, self.costs.head
        blk_keep, working = self.keep[recompute]
        n_mb = self.in_flight(i)
        act = n_mb * n * blk_keep + (working if n else 0.0)
        if i == 0:
            act += n_mb * emb.activation_bytes / self.tp
        if i == self.pp - 1:
            act += max(1.0, n_mb) * head.activation_bytes / self.tp
        params = self.stage_params(i, n)
        weights = params * self.weight_b / self.fsdp + self.fsdp_working
        opt = params * self.opt_b / self.fsdp
        return weights + opt + act, weights, opt, act

    def grad_reduce_time(self, params: float) -> float:
        """Seconds to all-reduce the fp32 gradients of ``params`` elements (a GPU's FSDP shard of them) over the
        ``dp / fsdp`` replicas holding the same shard, hierarchically when they span nodes."""
        cluster, fsdp = self.cluster, self.fsdp
        replicas = self.dp // fsdp
        if replicas == 1:
            return 0.0
        dp_local = max(1, min(replicas, cluster.devices_per_node // (self.tp * fsdp)))  # replicas inside one node
        dp_nodes = -(-replicas // dp_local)  # nodes the replica group spans
        nbytes = params / fsdp * GRAD_REDUCE_BYTES
        if dp_nodes == 1:
            return collective_time("all-reduce", nbytes, replicas, cluster, spans_nodes=False)
        t = collective_time("all-reduce", nbytes / dp_local, dp_nodes, cluster, spans_nodes=True)
        if dp_local > 1:
            t += (collective_time("reduce-scatter", nbytes, dp_local, cluster, spans_nodes=False)
                  + collective_time("all-gather", nbytes, dp_local, cluster, spans_nodes=False))
        return t

    def estimate(self, stage_blocks: list[int], stage_recompute: list[str], exact: bool = False,
                 stage_layouts: list[_Layout] | None = None) -> Estimate:
        """The step's estimate. ``stage_layouts[i]`` (default: this layout for every stage) costs stage ``i``:
        stages may differ in tensor degree (same pipeline, data and FSDP degrees, microbatches and schedule);
        their device counts must add up to the cluster's."""
        pp, v, M, dp, fsdp = self.pp, self.v, self.M, self.dp, self.fsdp
        cluster, model, itemsize = self.cluster, self.model, self.itemsize
        emb, blk, head = self.costs.embed, self.costs.block, self.costs.head
        lay = stage_layouts or [self] * pp
        stages = [lay[i].stage_time(i, n, r) for i, (n, r) in enumerate(zip(stage_blocks, stage_recompute))]
        slow = max(range(pp), key=lambda i: stages[i]["f"] + stages[i]["b"])
        st = stages[slow]
        f, b = st["f"], st["b"]
        compute_s = M * (st["fc"] + st["bc"])
        if exact and pp > 1:
            from autopp.planner._schedule import get_schedule, simulate_times

            sched = get_schedule(self.schedule, pp * v, M, virtual_stages=v)
            chunk = lambda key: [stages[c % pp][key] / v for c in range(pp * v)]  # noqa: E731 (chunk c on rank c % pp)
            times = simulate_times(sched, chunk("f"), chunk("b"), chunk("wc") if self.schedule == "zb-h1" else None)
            bubble = max(end for _, end in times.values()) - M * (f + b)
        else:
            bubble = _bubble_time(self.schedule, pp, v, f, b, st["wc"])
        tp_comm_s = M * st["tpc"]
        fsdp_comm_s = M * st["fsdp"]
        pp_comm_s = M * 2 * lay[slow].p2p  # each microbatch's forward and backward send (0 without pipelining)
        if pp > 1:  # tied word-embedding gradient between the first and last stage, once per step
            pp_comm_s += collective_time("all-reduce", emb.param_bytes / lay[0].tp * GRAD_REDUCE_BYTES / itemsize, 2,
                                         cluster, spans_nodes=cluster.num_nodes > 1)

        # ---- data-parallel reduction of each FSDP shard over its replicas, optimizer ----
        params = [lay[i].stage_params(i, n) for i, n in enumerate(stage_blocks)]
        b_slot = b  # stage i's last backward ends i slots before stage 0's
        dp_comm_s = max(0.0, max(lay[i].grad_reduce_time(params[i]) - i * b_slot for i in range(pp)))
        optimizer_s = max(params) / fsdp * ADAM_BYTES_PER_PARAM / self.tm.bytes_per_s
        step = compute_s + bubble + tp_comm_s + fsdp_comm_s + pp_comm_s + dp_comm_s + optimizer_s

        peak, weights, opt, act = max(lay[i].stage_memory(i, n, r)
                                      for i, (n, r) in enumerate(zip(stage_blocks, stage_recompute)))

        # ---- FLOPs ----
        mb_total = M * dp  # microbatches per step over all replicas
        model_flops = mb_total * sum(l.flops + l.backward_flops for l in (emb, head)) + mb_total * model.layers * (
            blk.flops + blk.backward_flops)
        extra = mb_total * sum(n * lay[i].recompute_cost[r][2]
                               for i, (n, r) in enumerate(zip(stage_blocks, stage_recompute)))
        dev = cluster.device
        return Estimate(
            step_time_s=step,
            tflops_per_gpu=(model_flops + extra) / step / cluster.num_devices / 1e12,
            mfu=model_flops / (step * cluster.num_devices * dev.peak_flops("bfloat16")),
            peak_memory_bytes_per_gpu=int(peak), fits=bool(peak <= dev.memory_capacity),
            compute_s=compute_s, bubble_s=bubble, tp_comm_s=tp_comm_s, fsdp_comm_s=fsdp_comm_s,
            pp_comm_s=pp_comm_s, dp_comm_s=dp_comm_s, optimizer_s=optimizer_s, num_microbatches=M,
            param_bytes=int(weights), optimizer_bytes=int(opt), activation_bytes=int(act),
        )

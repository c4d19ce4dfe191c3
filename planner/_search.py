"""``plan_model``: the best training plan for a model on a cluster, in seconds.

The search decomposes the way the cost model does. The outer choices are few and discrete: tensor degree
(divisors of the node size that divide the heads), pipeline degree, data degree (the rest of the devices), FSDP
degree inside the data-parallel group (none, a node's worth, all), microbatch size, schedule (with its virtual
stages) and recomputation. Every combination is costed with an equal split by :func:`simulate`'s closed form
(about 0.1 ms each). The most promising layouts are then refined by CP-SAT (:func:`assign_blocks`): blocks per
stage (the first stage also holds the embedding, the last the head, so equal splits are rarely best) and a
recomputation mode per stage, under each stage's memory. The refined and the equal splits of those layouts are
ranked by the discrete-event simulation of their schedule with each stage's own times, and the fastest that fits
becomes the plan. An equal split of every layout is among the candidates, so the plan is never predicted slower
than the best equal split.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import time
from autopp.models._gpt import GPT, GPTConfig
from autopp.planner._cpsat import assign_blocks
from autopp.planner._plan import Plan, PlannerStats, StagePlan
from autopp.planner._schedule import get_schedule
from autopp.planner._simulate import (
    RECOMPUTE_MODES,
    SCHEDULES,
    Estimate,
    _Layout,
    _layer_costs,
    _positive_int,
)
from autopp.profiler._cluster import Cluster
from autopp.profiler._devices import DEVICE_KINDS
from autopp.profiler._profile import Profile

DEFAULT_MICROBATCH_SIZES = (1, 2, 4, 8)
"""Microbatch sizes searched by default (Megatron-LM's published runs use 1 to 8 for large models)."""


@dataclasses.dataclass(frozen=True)
class _LayoutKey:
    tp: int
    pp: int
    dp: int
    fsdp: int
    mbs: int
    schedule: str
    v: int


@dataclasses.dataclass
class _Candidate:
    key: _LayoutKey
    stage_blocks: tuple[int, ...]
    recompute: tuple[str, ...]
    estimate: Estimate
    status: str = "UNIFORM"
    gap: float = 0.0
    stage_layouts: tuple[_Layout, ...] | None = None
    """Each stage's layout when their tensor degrees differ (None: the key's layout for every stage)."""


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


CONFIG_FINGERPRINT = "gpt-config:"
"""How the fingerprint of a plan made from a model description (not a traced step) begins."""


def model_fingerprint(config: GPTConfig) -> str:
    """A plan made offline for a model description is tied to it by this hash of its configuration."""
    text = json.dumps(config.to_dict(), sort_keys=True)
    return CONFIG_FINGERPRINT + hashlib.sha256(text.encode()).hexdigest()[:16]


def _even_split(blocks: int, stages: int) -> tuple[int, ...]:
    base, extra = divmod(blocks, stages)
    # the extra blocks go to the middle stages (the first and last also hold the embedding and the head)
    order = sorted(range(stages), key=lambda s: (s in (0, stages - 1), s))
    counts = [base] * stages
    for s in order[:extra]:
        counts[s] += 1
    return tuple(counts)


def plan_model(model: GPTConfig | GPT | Profile, cluster: Cluster | str, *, global_batch: int,
               schedules: tuple[str, ...] = SCHEDULES, recompute: tuple[str, ...] = RECOMPUTE_MODES,
               microbatch_sizes: tuple[int, ...] = DEFAULT_MICROBATCH_SIZES,
               pipeline_degrees: tuple[int, ...] | None = None,
               max_virtual_stages: int = 4,
               refine_top: int = 12, mixed_top: int = 3, time_limit_s: float = 5.0) -> Plan:
    """The fastest plan the cost model of :func:`~autopp.planner.simulate` finds for training ``model`` with
    ``global_batch`` sequences per step on ``cluster`` (see the module docstring for the search).

    ``schedules``, ``recompute``, ``microbatch_sizes`` and ``pipeline_degrees`` (e.g. ``(1,)`` for the best plan
    without pipelining) restrict the search; ``refine_top`` layouts get a CP-SAT
    stage assignment (each within ``time_limit_s``), and the best ``mixed_top`` of those one
    where stages may also differ in tensor degree.

    ``model`` may also be a traced step: the :class:`~autopp.profiler.Profile` of any training step
    (``autopp.profiler.profile(step, *args, cluster=cluster)``, times for the cluster's device; with
    ``measure=True`` on the local devices). Its layers are not known to be Megatron blocks, so its plan is
    pipeline x data parallelism with a CP-SAT split of the profiled layers
    (:func:`autopp.planner._local.plan_local`: stage count, microbatches, GPipe/1F1B);
    ``parallelize(step, plan=...)`` replays it on matching devices.

    Raises ValueError when no layout fits the devices' memory, saying how much the least demanding one needs
    and what would make it fit.
    """
    t0 = time.perf_counter()
    if isinstance(model, GPT):
        model = model.config
    if isinstance(model, Profile):
        return _plan_profile(model, cluster, global_batch, t0)
    if not isinstance(model, GPTConfig):
        raise TypeError(
            f"plan_model: model must be an autopp.models.GPTConfig (or GPT) or the Profile of a traced step, got "
            f"{type(model).__name__}; for your own training step pass "
            "autopp.profiler.profile(step, *example_args, cluster=cluster).")
    if isinstance(cluster, str):
        cluster = Cluster.parse(cluster)
    elif not isinstance(cluster, Cluster):
        raise TypeError(f"plan_model: cluster must be a Cluster or a string like '128x8xH100', got {cluster!r}.")
    global_batch = _positive_int("global_batch", global_batch, 512)
    for name, values, valid in (("schedules", schedules, SCHEDULES), ("recompute", recompute, RECOMPUTE_MODES)):
        bad = [v for v in values if v not in valid] if isinstance(values, (tuple, list)) and values else [values]
        if bad:
            raise ValueError(f"plan_model: {name}={values!r} must be a non-empty tuple of {', '.join(valid)} "
                             f"(not {bad}); e.g. {name}={valid[:2]!r}.")
    if not isinstance(microbatch_sizes, (tuple, list)) or not microbatch_sizes:
        raise ValueError(f"plan_model: microbatch_sizes={microbatch_sizes!r} must be a non-empty tuple of positive "
                         "ints, e.g. (1, 2, 4).")
    for m in microbatch_sizes:
        _positive_int("microbatch_sizes entry", m)
    if pipeline_degrees is not None:
        if not isinstance(pipeline_degrees, (tuple, list)) or not pipeline_degrees:
            raise ValueError(f"plan_model: pipeline_degrees={pipeline_degrees!r} must be None or a non-empty tuple of "
                             "positive ints, e.g. (1,) for no pipelining.")
        for d in pipeline_degrees:
            _positive_int("pipeline_degrees entry", d)

    L, n, dpn = model.layers, cluster.num_devices, cluster.devices_per_node
    candidates = 0
    uniform: list[_Candidate] = []  # the best equal split (over recomputation) of each layout
    least_memory: tuple[float, _LayoutKey | None] = (math.inf, None)
    layouts: dict[_LayoutKey, _Layout] = {}
    for tp in [d for d in _divisors(dpn) if model.heads % d == 0]:
        for pp in [p for p in range(1, L + 1) if n % (tp * p) == 0
                   and (pipeline_degrees is None or p in pipeline_degrees)]:
            dp = n // (tp * pp)
            if global_batch % dp:
                continue
            fsdps = sorted({1, dp} | ({dpn // tp} if tp < dpn and dp % (dpn // tp) == 0 else set()))
            for mbs in [b for b in microbatch_sizes if (global_batch // dp) % b == 0]:
                M = global_batch // (dp * mbs)
                costs = _layer_costs(model, mbs, cluster)
                for schedule in (schedules if pp > 1 else schedules[:1]):
                    vs = [1]
                    if schedule == "interleaved-1f1b":
                        vs = [v for v in range(2, max_virtual_stages + 1) if L % (pp * v) == 0 and M % pp == 0]
                    for v in vs:
                        for fsdp in fsdps:
                            key = _LayoutKey(tp, pp, dp, fsdp, mbs, schedule, v)
                            layout = _Layout(model, cluster, costs, global_batch=global_batch, tp=tp, dp=dp,
                                             fsdp=fsdp, microbatch_size=mbs, schedule=schedule, virtual_stages=v,
                                             num_stages=pp)
                            layouts[key] = layout
                            blocks = _even_split(L, pp)
                            best = None
                            for r in recompute:
                                est = layout.estimate(list(blocks), [r] * pp)
                                candidates += 1
                                least_memory = min(least_memory, (est.peak_memory_bytes_per_gpu, key),
                                                   key=lambda x: x[0])
                                if est.fits and L % (pp * v) == 0 and (best is None or est.step_time_s <
                                                                       best.estimate.step_time_s):
                                    best = _Candidate(key, blocks, (r,) * pp, est)
                            if best is not None:
                                uniform.append(best)
    # Layouts whose blocks do not divide evenly get no equal split but may still be refined.
    uneven = [key for key in layouts if L % (key.pp * key.v) and key.v == 1]

    uniform.sort(key=lambda c: c.estimate.step_time_s)
    pool: list[_Candidate] = []
    refine = [c.key for c in uniform if c.key.pp > 1 and c.key.v == 1][:refine_top]
    refine += [k for k in sorted(uneven, key=lambda k: (k.tp, k.pp, k.mbs))
               if k.pp > 1][:max(0, refine_top - len(refine))]
    for key in dict.fromkeys(refine):
        refined = _refine(layouts[key], key, recompute, time_limit_s)
        if refined is not None:
            candidates += 1
            pool.append(refined)
    # The best few refined layouts may also give their stages different tensor degrees (stages of different
    # sizes); that model is larger, so it starts from the equal-degree answer and gets a shorter time limit.
    fits = sorted((c for c in pool if c.estimate.fits), key=lambda c: c.estimate.step_time_s)
    for c in fits[:mixed_top]:
        if len(_tensor_options(model, cluster, c.key)) > 1:
            mixed = _refine(layouts[c.key], c.key, recompute, min(time_limit_s, 1.0), mix_tensor=True, start=c)
            if mixed is not None:
                candidates += 1
                pool.append(mixed)
    for c in uniform[:refine_top]:  # the best equal splits, re-ranked by the same event simulation
        pool.append(dataclasses.replace(c, estimate=layouts[c.key].estimate(list(c.stage_blocks),
                                                                              list(c.recompute), exact=True)))
    pool = [c for c in pool if c.estimate.fits]
    if not pool:
        raise ValueError(_infeasible_message(model, cluster, global_batch, least_memory))
    best = min(pool, key=lambda c: (c.estimate.step_time_s, c.key.pp, c.key.tp))
    stats = PlannerStats(wall_time_s=time.perf_counter() - t0, solver_status=best.status,
                         optimality_gap=best.gap, candidates=candidates,
                         best_uniform_step_time_s=uniform[0].estimate.step_time_s if uniform else math.inf)
    return _to_plan(model, cluster, best, layouts[best.key], stats)


def _tensor_options(model: GPTConfig, cluster: Cluster, key: _LayoutKey) -> list[int]:
    """Tensor degrees a stage of this layout may take: half, the same as, or twice the layout's, powers of two
    that divide the node and the heads (so that stages placed in decreasing tensor degree keep every tensor
    group inside a node)."""
    dpn = cluster.devices_per_node
    if dpn & (dpn - 1) or key.tp & (key.tp - 1) or key.pp == 1:
        return [key.tp]
    return [d for d in (key.tp // 2, key.tp, key.tp * 2) if d >= 1 and dpn % d == 0 and model.heads % d == 0]


def _refine(layout: _Layout, key: _LayoutKey, recompute: tuple[str, ...], time_limit_s: float, *,
            mix_tensor: bool = False, start: _Candidate | None = None) -> _Candidate | None:
    """CP-SAT blocks per stage and recomputation per stage for one layout, and with ``mix_tensor`` a tensor degree
    per stage (the stages' devices adding up to the cluster), seeded with ``start``; the exact estimate of its
    answer."""
    pp, L = key.pp, layout.model.layers
    model, cluster = layout.model, layout.cluster
    by_tp = {}
    for tp in (_tensor_options(model, cluster, key) if mix_tensor else [key.tp]):
        by_tp[tp] = layout if tp == key.tp else _Layout(
            model, cluster, layout.costs, global_batch=layout.M * key.mbs * key.dp, tp=tp, dp=key.dp, fsdp=key.fsdp,
            microbatch_size=key.mbs, schedule=key.schedule, virtual_stages=key.v, num_stages=pp)
    options = [(tp, r) for tp in by_tp for r in recompute]
    nbar = max(1, -(-L // pp))
    block_time, const_time, block_mem, const_mem = [], [], [], []
    for i in range(pp):
        bt, ct, bm, cm = [], [], [], []
        for tp, r in options:
            lay = by_tp[tp]
            t0, t1 = lay.stage_time(i, 0, r), lay.stage_time(i, nbar, r)
            m0, m1 = lay.stage_memory(i, 0, r)[0], lay.stage_memory(i, nbar, r)[0]
            ct.append(t0["f"] + t0["b"])
            bt.append((t1["f"] + t1["b"] - ct[-1]) / nbar)  # secant: exact unless FSDP traffic is partly hidden
            cm.append(m0)
            bm.append((m1 - m0) / nbar)
        block_time.append(bt)
        const_time.append(ct)
        block_mem.append(bm)
        const_mem.append(cm)
    lows = [0 if i in (0, pp - 1) else 1 for i in range(pp)]
    devices = [[tp * key.dp for tp, _ in options]] * pp if len(by_tp) > 1 else None
    hint = None if start is None else (start.stage_blocks, [options.index((key.tp, r)) for r in start.recompute])
    got = assign_blocks(L, block_time, const_time, block_mem, const_mem, cluster.device.memory_capacity,
                        min_blocks=lows, recompute_options=options, option_devices=devices,
                        total_devices=cluster.num_devices if devices else None, hint=hint, time_limit_s=time_limit_s)
    if got is None:
        return None
    stage_tp = tuple(tp for tp, _ in got.recompute)
    modes = tuple(r for _, r in got.recompute)
    est = layout.estimate(list(got.stage_blocks), list(modes), exact=True,
                          stage_layouts=[by_tp[tp] for tp in stage_tp])
    return _Candidate(key, got.stage_blocks, modes, est, status=got.status, gap=got.gap,
                      stage_layouts=None if set(stage_tp) == {key.tp} else tuple(by_tp[tp] for tp in stage_tp))


def _infeasible_message(model: GPTConfig, cluster: Cluster, global_batch: int,
                        least: tuple[float, _LayoutKey | None]) -> str:
    need, key = least
    cap = cluster.device.memory_capacity
    msg = (f"plan_model: no layout of {model.num_params / 1e9:.3g}B-parameter GPT (global batch {global_batch}) fits "
           f"{cluster}: the least memory any option needs is {need / 2**30:.1f} GiB per device")
    if key is not None:
        msg += (f" (tp={key.tp}, pp={key.pp}, dp={key.dp}, fsdp={key.fsdp}, microbatch size {key.mbs}, "
                f"{key.schedule}, full recomputation)")
    msg += f", but a {cluster.device.name} has {cap / 2**30:.1f} GiB."
    bigger = [name for name, spec in DEVICE_KINDS.items() if spec.memory_capacity >= need]
    fixes = []
    if bigger:
        fixes.append(f"a device with more memory ({', '.join(bigger)})")
    for factor in (2, 4, 8, 16):
        more = dataclasses.replace(cluster, num_nodes=cluster.num_nodes * factor)
        if _least_memory(model, more, global_batch * factor) <= cap:
            fixes.append(f"{factor}x the nodes ({more.shorthand}, with the global batch scaled to "
                         f"{global_batch * factor} so each replica keeps its share)")
            break
    fixes.append("a smaller model or shorter sequences")
    return msg + " It would fit with " + ", or ".join(fixes) + "."


def _least_memory(model: GPTConfig, cluster: Cluster, global_batch: int) -> float:
    """The least peak memory per device over the layouts with the most sharding (a quick feasibility probe)."""
    tp = max(d for d in _divisors(cluster.devices_per_node) if model.heads % d == 0)
    best = math.inf
    for pp in [p for p in range(1, model.layers + 1) if cluster.num_devices % (tp * p) == 0]:
        dp = cluster.num_devices // (tp * pp)
        if global_batch % dp:
            continue
        layout = _Layout(model, cluster, _layer_costs(model, 1, cluster), global_batch=global_batch, tp=tp, dp=dp,
                         fsdp=dp, microbatch_size=1, schedule="1f1b", virtual_stages=1, num_stages=pp)
        est = layout.estimate(list(_even_split(model.layers, pp)), ["full"] * pp)
        best = min(best, est.peak_memory_bytes_per_gpu)
    return best


def _to_plan(model: GPTConfig, cluster: Cluster, best: _Candidate, layout: _Layout, stats: PlannerStats) -> Plan:
    key = best.key
    costs = layout.costs
    itemsize = layout.itemsize
    lay = best.stage_layouts or (layout,) * key.pp
    # Device groups in decreasing tensor degree, so that each group starts at a multiple of its tensor degree
    # and every tensor-parallel group stays inside a node; the pipeline order is the stages' own.
    offsets, at = {}, 0
    for g in sorted(range(key.pp), key=lambda g: -lay[g].tp):
        offsets[g] = at
        at += lay[g].tp * key.dp
    # Interleaved schedules run v model chunks per device group: chunk c (a stage of the plan) on group c % pp.
    num_chunks = key.pp * key.v
    chunk_blocks = [n // key.v for n in best.stage_blocks for _ in range(key.v)] if key.v > 1 else best.stage_blocks
    times = [lay[i].stage_time(i, n, r) for i, (n, r) in enumerate(zip(best.stage_blocks, best.recompute))]
    stages = []
    first = 0
    for c, blocks in enumerate(chunk_blocks):
        group = c % key.pp
        has_embed, has_head = c == 0, c == num_chunks - 1
        last = first + blocks + has_embed + has_head - 1  # layers: 0 = embed, 1..L = blocks, L + 1 = head
        flops = (blocks * costs.block.flops + (costs.embed.flops if has_embed else 0.0)
                 + (costs.head.flops if has_head else 0.0))
        g = lay[group]
        params = (blocks * g.blk_params + (g.emb_params if has_embed else 0.0) + (g.head_params if has_head else 0.0))
        stages.append(StagePlan(
            index=c, devices=tuple(range(offsets[group], offsets[group] + g.tp * key.dp)),
            mesh_shape={"data": key.dp // key.fsdp, "fsdp": key.fsdp, "tensor": g.tp},
            equations=None, num_equations=None, flops=float(flops), param_bytes=int(params * g.tp * itemsize),
            cut_bytes_after=0 if has_head else key.mbs * model.seq * model.hidden * itemsize,
            layers=(first, last), recompute=best.recompute[group],
            forward_time_s=times[group]["f"] / key.v, backward_time_s=times[group]["b"] / key.v,
        ))
        first = last + 1
    sched = get_schedule(key.schedule, key.pp * key.v, layout.M, virtual_stages=key.v)
    return Plan(model_fingerprint=model_fingerprint(model), stages=tuple(stages), num_microbatches=layout.M,
                schedule=key.schedule, schedule_text=sched.to_text(), loss_reduction="mean",
                microbatch_size=key.mbs, virtual_stages=key.v, cluster=cluster.to_dict(), predicted=best.estimate,
                planner=stats)


def _plan_profile(prof: Profile, cluster: Cluster | str, global_batch: int, t0: float) -> Plan:
    """:func:`plan_model` for a traced step's profile (pipeline x data parallelism, see :mod:`planner._local`)."""
    from autopp.planner._local import plan_local

    if isinstance(cluster, str):
        cluster = Cluster.parse(cluster)
    if cluster.device != prof.cluster.device:
        raise ValueError(f"plan_model: the profile's times are for {prof.cluster.device.name} devices but the "
                         f"cluster is {cluster}; profile the step for this cluster: autopp.profiler.profile(step, *args, "
                         f"cluster={cluster.shorthand!r}).")
    global_batch = _positive_int("global_batch", global_batch, 512)
    local = plan_local(dataclasses.replace(prof, cluster=cluster), cluster.num_devices, global_batch)
    d = local.devices_per_stage
    stages = []
    for s, (first, last) in enumerate(local.stage_layers):
        layers = prof.layers[first:last + 1]
        stages.append(StagePlan(
            index=s, devices=tuple(range(s * d, (s + 1) * d)), mesh_shape={"data": d, "fsdp": 1, "tensor": 1},
            equations=None, num_equations=None,
            flops=float(sum(l.flops for l in layers)) / local.num_microbatches,
            param_bytes=int(sum(l.param_bytes for l in layers)),
            cut_bytes_after=0 if s == local.num_stages - 1 else int(layers[-1].output_bytes / local.num_microbatches),
            layers=(first, last), recompute="none"))
    sched = get_schedule(local.schedule, local.num_stages, local.num_microbatches)
    stats = PlannerStats(wall_time_s=time.perf_counter() - t0, solver_status=local.solver_status,
                         optimality_gap=local.optimality_gap, candidates=local.candidates,
                         best_uniform_step_time_s=local.best_uniform_step_time_s)
    return Plan(model_fingerprint=prof.fingerprint, stages=tuple(stages), num_microbatches=local.num_microbatches,
                schedule=local.schedule, schedule_text=sched.to_text(), loss_reduction="mean",
                microbatch_size=local.microbatch_size, cluster=cluster.to_dict(), predicted=local.predicted,
                planner=stats)

"""``plan_model``: the best training plan for a traced step (or a model description) on a cluster, in seconds.

The search decomposes the way the cost model does (:mod:`autopp.planner._costmodel`):

1. **Per layer, the sharding.** Each distinct layer's intra-operator ILP (:mod:`autopp.planner._sharding`) is
   solved once per tensor degree and boundary layout (replicated, or sequence-parallel), by its fingerprint: a
   96-block GPT solves three layers (embedding, block, head), not ninety-eight.
2. **The outer choices, screened.** Every tensor degree (a divisor of the node size), pipeline degree, data degree
   (the rest), FSDP degree (none, a node's worth, all), ZeRO-1, sequence parallelism, microbatch size, schedule
   (interleaved with its virtual stages) and recomputation mode is costed with the equal split of the blocks by
   the closed forms. Bound before evaluating: the layouts are taken in order of a lower bound on their step time
   (their compute alone, :meth:`~autopp.planner._costmodel.StepModel.lower_bound`), a layout whose bound cannot
   enter the best kept is skipped, and one whose memory does not fit is dropped before its time is priced.
3. **The stage split, by CP-SAT.** The most promising layouts get a CP-SAT stage assignment
   (:func:`~autopp.planner._cpsat.assign_stages`): where each stage begins and its recomputation mode, under
   each stage's memory, minimising the slowest stage.
4. **Ranking.** The refined and equal splits of those layouts are ranked by the discrete-event simulation of
   their schedule with each stage's own times; the fastest that fits is the plan, so a plan is never predicted
   slower than the best equal split.

A request nothing fits raises a ValueError saying what the least demanding option needs and what would fit; a layer
that fits no strategy on its own is named.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import numbers
import time
import warnings
from collections.abc import Sequence
from typing import Any

from autopp.planner._chunks import chunk_split, even_layers
from autopp.planner._costmodel import Evaluation, Layout, StepModel
from autopp.planner._cpsat import assign_stages
from autopp.core import (
    DEFAULT_OVERLAP,
    LayerSharding,
    Plan,
    PlannerStats,
    RECOMPUTE_MODES,
    SCHEDULES,
    StagePlan,
    divisors,
    get_schedule,
    positive_int,
)
from autopp.planner._simulate import as_cluster, as_profile, fp32_warning, step_model
from autopp.profiler import Cluster, DEVICE_KINDS, Profile, spec_name

DEFAULT_MICROBATCH_SIZES = (1, 2, 4, 8)
"""Microbatch sizes searched by default (Megatron-LM's published runs use 1 to 16); larger ones too where a
microbatch's work does not grow with its size (:func:`_with_larger_microbatches`)."""

CONFIG_FINGERPRINT = "layers:"
"""How the fingerprint of a plan made by :func:`plan_model` begins: it names the step's layers and parameter shapes
(not its batch size), so the plan replays on the same step at the plan's global batch."""

PLANNED_SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1")
"""Schedules :func:`plan_model` searches by default (``dualpipev`` on request)."""


@dataclasses.dataclass
class _Candidate:
    layout: Layout
    split: tuple[tuple[int, int], ...]
    recompute: tuple[str, ...]
    evaluation: Evaluation
    status: str = "UNIFORM"
    gap: float = 0.0

    @property
    def step(self) -> float:
        return self.evaluation.estimate.step_time_s


def plan_model(model: Any, cluster: Cluster | str, *, global_batch: int,
               schedules: Sequence[str] = PLANNED_SCHEDULES, recompute: Sequence[str] = RECOMPUTE_MODES,
               microbatch_sizes: Sequence[int] = DEFAULT_MICROBATCH_SIZES,
               pipeline_degrees: Sequence[int] | None = None, tensor_degrees: Sequence[int] | None = None,
               max_virtual_stages: int = 4, overlap: Sequence[str] = DEFAULT_OVERLAP, refine_top: int = 8,
               time_limit_s: float = 5.0, dispatch_s: float = 0.0, fsdp: bool = True, zero1: bool = True,
               sequence_parallel: bool = True, num_microbatches: int | None = None,
               loss_reduction: str = "mean", fsdp_degrees: Sequence[int] | None = None) -> Plan:
    """The fastest plan the cost model finds for training ``model`` with ``global_batch`` examples per step on
    ``cluster`` (see the module docstring for the search).

    ``model``: the :class:`~autopp.profiler.Profile` of a traced step (``autopp.profiler.profile(step, *args,
    cluster=...)``, traced at any batch size, from arrays or ``ShapeDtypeStruct``s), or a model description with
    ``abstract_step()`` (``autopp.models.GPTConfig``, ``LlamaConfig``). ``schedules``, ``recompute``,
    ``microbatch_sizes``, ``pipeline_degrees`` (e.g. ``(1,)`` for the best plan without pipelining) and
    ``tensor_degrees`` restrict the search; ``refine_top`` layouts get a CP-SAT stage split (each within
    ``time_limit_s``). ``overlap``: communication the runtime hides behind compute (see
    :data:`~autopp.core._estimate.OVERLAPS`). ``dispatch_s``: host seconds per issued program (local
    devices only). ``fsdp``, ``zero1`` and ``sequence_parallel`` say whether those layouts are searched;
    ``fsdp_degrees`` restricts the FSDP degrees tried (with ``fsdp=True``; 1 is no FSDP).
    ``num_microbatches`` fixes the microbatches per step. ``loss_reduction``: ``"mean"`` (the loss averages over
    examples) or ``"sum"``, written into the plan for ``parallelize(plan=...)`` (it does not change the costs).

    Raises ValueError when no layout fits the devices' memory, saying how much the least demanding one needs and
    what would make it fit.
    """
    t0 = time.perf_counter()
    who = "plan_model"
    cluster = as_cluster(cluster, who)
    global_batch = positive_int(who, "global_batch", global_batch, 512)
    for name, values, valid in (("schedules", schedules, SCHEDULES), ("recompute", recompute, RECOMPUTE_MODES)):
        bad = [v for v in values if v not in valid] if isinstance(values, (tuple, list)) and values else [values]
        if bad:
            raise ValueError(f"{who}: {name}={values!r} must be a non-empty tuple of {', '.join(valid)} "
                             f"(not {bad}); e.g. {name}={tuple(valid[:2])!r}.")
    if loss_reduction not in ("mean", "sum"):
        raise ValueError(f"{who}: loss_reduction={loss_reduction!r} must be 'mean' (the loss averages over examples) "
                         "or 'sum' (it adds them up, or reads a value computed from the whole batch).")
    refine_top = positive_int(who, "refine_top", refine_top, 8)
    max_virtual_stages = positive_int(who, "max_virtual_stages", max_virtual_stages, 4)
    if num_microbatches is not None:
        num_microbatches = positive_int(who, "num_microbatches", num_microbatches, 8)
    if (isinstance(time_limit_s, bool) or not isinstance(time_limit_s, numbers.Real)
            or not time_limit_s > 0 or not math.isfinite(time_limit_s)):
        raise ValueError(f"{who}: time_limit_s must be a positive number of seconds for each CP-SAT stage split, "
                         f"got time_limit_s={time_limit_s!r}; pass e.g. time_limit_s=5.0.")
    for name, values in (("microbatch_sizes", microbatch_sizes), ("pipeline_degrees", pipeline_degrees),
                         ("tensor_degrees", tensor_degrees), ("fsdp_degrees", fsdp_degrees)):
        if values is None and name != "microbatch_sizes":
            continue
        if not isinstance(values, (tuple, list)) or not values:
            raise ValueError(f"{who}: {name}={values!r} must be a non-empty tuple of positive ints, e.g. (1, 2, 4).")
        for v in values:
            positive_int(who, f"{name} entry", v)
    prof = as_profile(model, cluster, who)
    fp32_warning(prof, cluster, who)
    sm = step_model(prof, cluster, tuple(overlap), dispatch_s)
    _check_layers_fit(sm, cluster)

    n, dpn = cluster.num_devices, cluster.devices_per_node
    blocks = sum(1 for l in prof.layers if l.name.startswith("block")) or len(prof.layers)
    by_default = microbatch_sizes is DEFAULT_MICROBATCH_SIZES and num_microbatches is None
    if by_default:
        microbatch_sizes = _with_larger_microbatches(sm, global_batch)
    tps = [t for t in divisors(dpn) if tensor_degrees is None or t in tensor_degrees]
    # Every layout family (degrees, microbatch size, schedule, virtual stages, sequence parallelism) with its
    # memory-only options in the order tried: recomputation and FSDP only cost time, so the first (FSDP degree,
    # mode) that fits is the fastest of them in the closed form.
    families: list[list[tuple[Layout, list, str]]] = []
    for tp in tps:
        for pp in divisors(n // tp) if n % tp == 0 else []:
            if pp > blocks or (pipeline_degrees is not None and pp not in pipeline_degrees):
                continue
            dp = n // (tp * pp)
            if global_batch % dp:
                continue
            fsdps = sorted({1, dp} | ({dpn // tp} if tp < dpn and dp % (dpn // tp) == 0 else set())) if fsdp else [1]
            if fsdp_degrees is not None:
                fsdps = [f for f in sorted(set(fsdp_degrees)) if dp % f == 0 and (fsdp or f == 1)]
            sizes = microbatch_sizes
            if num_microbatches is not None:
                sizes = [global_batch // (dp * num_microbatches)] if global_batch % (dp * num_microbatches) == 0 else []
            elif by_default:  # and each replica's batch in a few microbatch counts: sizes no power of two divides
                per = global_batch // dp  # (125 per replica: 1 microbatch of 125, not 125 of 1; trial PLANS6)
                counts = {*_MICROBATCH_COUNTS, pp, 2 * pp, 4 * pp}
                sizes = sorted(set(sizes) | {per // c for c in counts if per % c == 0})
            # GPipe takes as long as 1F1B in the closed form and holds more microbatches: screen it only alone
            screen_schedules = [s for s in schedules if s != "gpipe" or "1f1b" not in schedules]
            for mbs in [b for b in sizes if b >= 1 and (global_batch // dp) % b == 0]:
                M = global_batch // (dp * mbs)
                for schedule in (screen_schedules if pp > 1 else ("1f1b",)):
                    vs = [1]
                    if schedule == "interleaved-1f1b":
                        vs = [v for v in range(2, max_virtual_stages + 1) if pp * v <= blocks and M % pp == 0]
                    if schedule == "dualpipev" and M < 2 * pp:
                        continue
                    for v in vs:
                        for sp in ((False, True) if tp > 1 and sequence_parallel else (False,)):
                            options = []
                            for f_deg in fsdps:
                                layout = Layout(tensor=tp, pipeline=pp, data=dp, fsdp=f_deg,
                                                zero1=dp // f_deg > 1 and zero1, microbatch_size=mbs,
                                                schedule=schedule, virtual_stages=v, sequence_parallel=sp)
                                split = chunk_split(prof, layout.num_chunks) or even_layers(len(prof.layers), layout.num_chunks)
                                if split is None:
                                    break
                                options += [(layout, split, r) for r in _by_memory(recompute)]
                            if options:
                                families.append(options)
    if not families:
        raise ValueError(_no_layout_message(cluster, global_batch, blocks, tps, pipeline_degrees, microbatch_sizes,
                                            num_microbatches))
    # Screen the families in order of their lower bound (compute alone); skip an option that cannot enter the
    # layouts kept for the exact simulation and the CP-SAT split (the refine_top best, and the refine_top best
    # pipelined ones), which the bound proves without evaluating it.
    bounds = [[sm.lower_bound(lay, global_batch, split, r) for lay, split, r in options] for options in families]
    screened: list[_Candidate] = []
    least = (math.inf, None)  # least memory any equal split needs, for the error
    evaluated = bounded = 0
    kept_all: list[float] = []  # negated steps of the refine_top best (a max-heap)
    kept_refinable: list[float] = []

    def kth(heap):
        return -heap[0] if len(heap) >= refine_top else math.inf

    def keep(heap, step):
        heapq.heappush(heap, -step)
        if len(heap) > refine_top:
            heapq.heappop(heap)

    capacity = cluster.device.memory_capacity
    for k in sorted(range(len(families)), key=lambda k: min(bounds[k])):
        options = families[k]
        first = options[0][0]
        refinable = first.pipeline > 1 and first.schedule != "dualpipev"
        best, skipped = None, False
        for (layout, split, r), lb in zip(options, bounds[k]):
            if lb >= kth(kept_all) and (not refinable or lb >= kth(kept_refinable)):
                skipped = True
                bounded += 1
                continue
            need = sm.peak_memory(layout, global_batch, split, r)
            if need < least[0]:
                least = (need, (layout, r))
            if need > capacity:
                continue
            ev = sm.evaluate(layout, global_batch, split, [r] * layout.num_chunks, exact=False)
            evaluated += 1
            if ev.estimate.fits:  # the same memory model: always
                best = _Candidate(layout, tuple(split), (r,) * layout.num_chunks, ev)
                break
        if best is not None:
            screened.append(best)
            keep(kept_all, best.step)
            if refinable:
                keep(kept_refinable, best.step)
        elif not skipped and first.schedule in ("1f1b", "gpipe", "zb-h1") and first.pipeline > 1:
            # nothing fits the equal split: the CP-SAT split may still find room
            layout, split, _ = options[-1]
            screened.append(_Candidate(layout, tuple(split), ("full",) * layout.pipeline, None))
    fitting = sorted((c for c in screened if c.evaluation is not None), key=lambda c: c.step)
    pool: list[_Candidate] = []
    for c in fitting[:refine_top]:  # the best equal splits, ranked by the event simulation of their schedule
        pool.append(dataclasses.replace(c, evaluation=_exact(sm, c.layout, global_batch, c.split, c.recompute)))
    to_refine = [c for c in fitting if c.layout.pipeline > 1 and c.layout.schedule != "dualpipev"][:refine_top]
    to_refine += [c for c in screened if c.evaluation is None][:max(0, refine_top - len(to_refine))]
    best_uniform = pool[0].step if pool else math.inf
    for c in to_refine:
        refined = _refine(sm, c.layout, global_batch, recompute, time_limit_s, hint=c.split)
        if refined is not None:
            evaluated += 1
            pool.append(refined)
    pool = [c for c in pool if c.evaluation.estimate.fits]
    if not pool:
        raise ValueError(_infeasible_message(prof, cluster, global_batch, least))
    best_uniform = min((c.step for c in pool if c.status == "UNIFORM"), default=best_uniform)
    # among plans the model cannot tell apart, the fewest stages, tensor devices and microbatches (larger
    # microbatches launch fewer kernels and run larger matmuls, which this model does not price)
    fastest = min(c.step for c in pool)
    best = min((c for c in pool if c.step <= fastest * (1 + 1e-9)),
               key=lambda c: (c.layout.pipeline, c.layout.tensor, -c.layout.microbatch_size, c.step))
    stats = PlannerStats(wall_time_s=time.perf_counter() - t0, solver_status=best.status,
                         optimality_gap=best.gap, candidates=evaluated, bounded=bounded,
                         best_uniform_step_time_s=best_uniform,
                         sharding_solves=len(sm.solve_stats),
                         sharding_solve_s=sum(x[5] for x in sm.solve_stats),
                         sharding_max_gap=max((x[4] for x in sm.solve_stats), default=0.0))
    plan = to_plan(sm, best.layout, global_batch, best.split, best.recompute, best.evaluation, stats)
    _warn_batch_caps_data(global_batch, n, best.layout, who)
    if best.layout.schedule not in schedules and not any(o[0][0].pipeline > 1 for o in families):  # one stage left
        warnings.warn(
            f"{who}: no pipelined layout could use schedules={tuple(schedules)!r}, so the plan has one stage: "
            "interleaved-1f1b needs the microbatches per pipeline a multiple of the pipeline degree and at least "
            "two blocks per device group; dualpipev at least twice as many microbatches as device groups; every "
            "schedule a pipeline degree the blocks fill. Add '1f1b' or 'zb-h1', or a larger global batch.",
            stacklevel=3)
    return plan if loss_reduction == "mean" else dataclasses.replace(plan, loss_reduction=loss_reduction)


def _with_larger_microbatches(sm: StepModel, global_batch: int) -> tuple[int, ...]:
    """:data:`DEFAULT_MICROBATCH_SIZES`, and each larger power of two up to the global batch while doubling a
    microbatch costs less than :data:`_LARGER_WHILE` times its work: fewer, larger microbatches then run the batch
    faster, where the pipeline's bubble allows. Per-microbatch work that reads or writes whole weights (an embedding
    table's gradient scattered into a dense copy of it) barely grows with the size: a recommendation model with 26
    tables of 10M rows was planned at 4096 microbatches of 8, 48.6 s a step, where microbatches of 32768 take 0.375 s
    (a user trial). Matmuls too small for the device at 8 examples grow less than 2x: a ViT-L/16 on 8 H100s was
    planned at 4 microbatches of 8, 41.3 ms, where 1 of 32 takes 33.4 ms (trial PLANS5; 16 cost 1.74x 8)."""
    base = sm.profile.batch_size or 1

    def step_work(size: int) -> float:
        arr = sm.arrays(1, False, size / base, "none")
        return sum(arr.values["f"]) + sum(arr.values["b"])

    sizes, size = list(DEFAULT_MICROBATCH_SIZES), DEFAULT_MICROBATCH_SIZES[-1]
    work = step_work(size) if 2 * size <= global_batch else 0.0
    while 2 * size <= global_batch:
        doubled = step_work(2 * size)
        if doubled >= _LARGER_WHILE * work:
            break
        size, work = 2 * size, doubled
        sizes.append(size)
    return tuple(sizes)


_MICROBATCH_COUNTS = (1, 2, 4, 8, 16, 32)
"""Microbatch counts whose size (each replica's batch divided by them) is searched beside the sizes, by default."""

_LARGER_WHILE = 1.9
"""A doubled microbatch that costs less than this many times the work is worth trying (5% less per example)."""


def _warn_batch_caps_data(global_batch: int, num_devices: int, layout: Layout, who: str) -> None:
    """The data-parallel degree divides both the global batch and the device count. When their common factor leaves
    at most an eighth of the devices to data parallelism and the plan uses all of it, the batch size, not speed,
    bounded the plan (a global batch of 1001 on 64 devices: pipeline x tensor only): say so, with sizes that don't."""
    cap = math.gcd(global_batch, num_devices)
    if cap * 8 > num_devices or layout.data < cap:
        return
    lower, upper = global_batch // num_devices * num_devices, -(-global_batch // num_devices) * num_devices
    sizes = f"{lower} or {upper}" if lower else f"{upper}"
    warnings.warn(f"{who}: global_batch={global_batch} has only the factor {cap} in common with the {num_devices} "
                  f"devices, so the data-parallel degree (which divides both) can be at most {cap}; the plan's is "
                  f"{layout.data}, with pipeline {layout.pipeline} x tensor {layout.tensor}. A global batch that is a "
                  f"multiple of {num_devices} (e.g. {sizes}) leaves the planner free to choose data parallelism.",
                  stacklevel=3)


def _by_memory(modes: Sequence[str]) -> list[str]:
    """Recomputation modes from the fastest (keeps the most) to the leanest."""
    order = {"none": 0, "selective": 1, "full": 2}
    return sorted(modes, key=lambda m: order.get(m, 3))


def _exact(sm: StepModel, layout: Layout, global_batch: int, split, recompute) -> Evaluation:
    M = global_batch // (layout.microbatch_size * layout.data)
    exact = M * layout.num_chunks <= 40_000
    return sm.evaluate(layout, global_batch, split, recompute, exact=exact)


def _refine(sm: StepModel, layout: Layout, global_batch: int, recompute: Sequence[str], time_limit_s: float,
            hint=None) -> _Candidate | None:
    """CP-SAT stage split and per-stage recomputation for one layout (one chunk per device group), then its exact
    estimate."""
    prof = sm.profile
    P = layout.pipeline
    if layout.num_chunks != P:
        return None
    M = global_batch // (layout.microbatch_size * layout.data)
    scale = layout.microbatch_size / prof.batch_size
    t, sp = layout.tensor, layout.sequence_parallel
    in_flight = sm._in_flight(layout, M, exact=True)
    times, acts = [], []
    for r in recompute:
        arr = sm.arrays(t, sp, scale, r)
        times.append([arr.values["f"][i] + arr.values["b"][i] + arr.values["tp_f"][i] + arr.values["tp_b"][i]
                      + 2 * sm.dispatch_s for i in range(len(prof.layers))])
        acts.append(list(arr.values["act"]))
    pr = sm.params(t, sp)
    replicas = layout.data // layout.fsdp
    static = [(o[0] + o[1]) / layout.fsdp + o[2] / layout.fsdp / (replicas if layout.zero1 else 1) for o in pr.owned]
    cuttable = _cuttable(prof)
    starts_hint = [a for a, _ in hint] if hint is not None and len(hint) == P else None
    capacity = sm.cluster.device.memory_capacity
    for _ in range(8):
        got = assign_stages(times, acts, static, P, in_flight, capacity, recompute_options=tuple(recompute),
                            cuttable=cuttable, hint=starts_hint, time_limit_s=time_limit_s, workers=1)
        if got is None:
            return None
        ends = list(got.stage_starts[1:]) + [len(prof.layers)]
        split = tuple((a, b - 1) for a, b in zip(got.stage_starts, ends))
        ev = _exact(sm, layout, global_batch, split, got.recompute)
        if ev.estimate.fits:
            return _Candidate(layout, split, tuple(got.recompute), ev, status=got.status, gap=got.gap)
        # The CP-SAT model's memory is linear per layer; the exact model also holds the recomputed layer's residuals
        # and copies of parameters shared with another stage. Solve again below what this answer needs in CP-SAT's
        # terms, so that it and anything as large are excluded.
        capacity = min(capacity, max(got.stage_memory_bytes)) - 1
    return None


def _cuttable(prof: Profile) -> list[bool]:
    """Where a stage may begin: anywhere but inside a ``lax.scan`` (consecutive layers of one equation)."""
    ranges = [prof.graph.nodes[l.index].get("eqn_range") for l in prof.layers]
    return [ranges[l] is None or ranges[l - 1] is None or tuple(ranges[l]) != tuple(ranges[l - 1])
            for l in range(1, len(prof.layers))]


def _gib(nbytes: float) -> str:
    """Bytes in the unit that shows them: GiB, MiB or KiB."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20)):
        if nbytes >= size / 10:
            return f"{nbytes / size:.3g} {unit}"
    return f"{nbytes / 2**10:.3g} KiB"


def _check_layers_fit(sm: StepModel, cluster: Cluster) -> None:
    """A layer whose parameters alone exceed a device's memory even split over a whole node's tensor group fits no
    strategy: name it."""
    cap = cluster.device.memory_capacity
    state = sm.profile.state_bytes
    t = cluster.devices_per_node
    for lay in sm.profile.layers:
        own = sum(sum(state[k]) for k in set(lay.param_inputs) if k is not None)
        if own / t > cap:
            raise ValueError(
                f"plan_model: layer {lay.index} ({lay.name}) holds {_gib(own)} of parameters, gradients and "
                f"optimizer state; even split over a node's {t} devices that is {_gib(own / t)} per device, "
                f"more than a {cluster.device.name}'s {_gib(cap)}, and pipeline or data parallelism cannot "
                "split one layer further. Use devices with more memory, or a narrower layer.")


def _no_layout_message(cluster: Cluster, global_batch: int, blocks: int, tps, pipeline_degrees, microbatch_sizes,
                       num_microbatches) -> str:
    """Why the search has no layout to try at all (divisibility and the restrictions given, not memory)."""
    n = cluster.num_devices
    degrees = sorted({(tp, pp, n // (tp * pp)) for tp in tps if n % tp == 0 for pp in divisors(n // tp)
                      if pp <= blocks and (pipeline_degrees is None or pp in pipeline_degrees)})
    msg = f"plan_model: no layout of {cluster} can run a global batch of {global_batch}"
    if not tps:
        return (msg + f": no tensor degree in tensor_degrees divides a node's {cluster.devices_per_node} devices; "
                f"use some of {divisors(cluster.devices_per_node)}.")
    if not degrees:
        return (msg + f": no pipeline degree (pipeline_degrees={pipeline_degrees!r}, at most the step's {blocks} "
                f"layers) times a tensor degree in {list(tps)} divides its {n} devices. Widen pipeline_degrees "
                "or tensor_degrees.")
    data = sorted({dp for _, _, dp in degrees})
    if not any(global_batch % dp == 0 for dp in data):
        fits = [global_batch - global_batch % dp for dp in data if global_batch >= dp]
        hint = f" (e.g. {max(fits)})" if fits else ""
        return (msg + f": global_batch={global_batch} is not divisible by any data-parallel degree the layouts "
                f"allow ({data}); use a global batch that is a multiple of one of them{hint}.")
    if num_microbatches is not None:
        return (msg + f" in num_microbatches={num_microbatches}: no data-parallel degree dp in {data} leaves "
                f"{global_batch} / (dp x {num_microbatches}) a whole microbatch; choose num_microbatches dividing "
                "global_batch / dp, or leave it to the search.")
    return (msg + f": no microbatch size in microbatch_sizes={tuple(microbatch_sizes)!r} divides the batch of a "
            f"data-parallel replica (global_batch / dp for dp in {data}), or the schedules asked for need more "
            "microbatches than that leaves. Add microbatch size 1, or use a larger or rounder global batch.")


def _infeasible_message(prof: Profile, cluster: Cluster, global_batch: int, least) -> str:
    need, what = least
    cap = cluster.device.memory_capacity
    params = sum(v[0] for v in prof.state_bytes.values())
    msg = (f"plan_model: no layout of the step ({_gib(params)} of parameters, global batch {global_batch}) "
           f"fits {cluster}: the least memory any option needs is {_gib(need)} per device")
    if what is not None:
        lay, r = what
        msg += (f" (tp={lay.tensor}, pp={lay.pipeline}, dp={lay.data}, fsdp={lay.fsdp}, microbatch size "
                f"{lay.microbatch_size}, {lay.schedule}, recompute {r})")
    msg += f", but a {cluster.device.name} has {_gib(cap)}."
    bigger = [name for name, spec in DEVICE_KINDS.items() if spec.memory_capacity >= need]
    fixes = []
    if bigger:
        fixes.append(f"a device with more memory ({', '.join(bigger)})")
    fixes.append("more nodes (more pipeline stages or FSDP shards share the state)")
    fixes.append("a smaller model or shorter sequences")
    return msg + " It would fit with " + ", or ".join(fixes) + "."


def to_plan(sm: StepModel, layout: Layout, global_batch: int, split, recompute, evaluation: Evaluation,
            stats: PlannerStats | None) -> Plan:
    """The :class:`Plan` of a layout and split: stages with devices, mesh, layers, recomputation and each
    parameter's layout over the tensor axis; per-layer sharding reports; the prediction."""
    prof = sm.profile
    t, d = layout.tensor, layout.data
    groups = sm.chunk_groups(layout)
    per_group = t * d
    M = global_batch // (layout.microbatch_size * d)
    sp = layout.sequence_parallel
    scale = layout.microbatch_size / prof.batch_size
    stages = []
    for c, ((a, b), r) in enumerate(zip(split, recompute)):
        g = groups[c]
        layers = prof.layers[a:b + 1]
        specs: dict[str, list] = {}
        for i in range(a, b + 1):
            lay = prof.layers[i]
            lc = sm.layer_cost(lay.fingerprint, t, sm.boundary(lay.fingerprint, t, sp))
            for pos, k in enumerate(lay.param_inputs):
                if k is None or str(k) in specs:
                    continue
                spec = lc.param_specs.get(pos, -1)
                shape = prof.programs[lay.fingerprint].closed.jaxpr.invars[pos].aval.shape
                specs[str(k)] = [("tensor" if spec == dim else None) for dim in range(len(shape))]
        stages.append(StagePlan(
            index=c, devices=tuple(range(g * per_group, (g + 1) * per_group)),
            mesh_shape={"data": d // layout.fsdp, "fsdp": layout.fsdp, "tensor": t},
            equations=None, num_equations=None,
            flops=float(sum(l.flops for l in layers)) * scale,
            param_bytes=_read_param_bytes(prof, layers),
            cut_bytes_after=0 if c == len(split) - 1 else int(prof.layers[b].crossing_bytes * scale),
            layers=(a, b), recompute=r,
            forward_time_s=evaluation.stage_forward_s[c], backward_time_s=evaluation.stage_backward_s[c],
            param_specs=specs,
        ))
    sched = get_schedule(layout.schedule, layout.num_chunks, M,
                         virtual_stages=layout.virtual_stages if layout.schedule == "interleaved-1f1b" else 1)
    return Plan(model_fingerprint=prof.structure_fingerprint, stages=tuple(stages), num_microbatches=M,
                schedule=layout.schedule, schedule_text=sched.to_text(), loss_reduction="mean",
                microbatch_size=layout.microbatch_size, virtual_stages=layout.virtual_stages,
                cluster=sm.cluster.to_dict(), predicted=evaluation.estimate, planner=stats,
                zero1=layout.zero1, sequence_parallel=sp, layer_shardings=_layer_reports(sm, layout, scale))


def _layer_reports(sm: StepModel, layout: Layout, scale: float) -> tuple[LayerSharding, ...]:
    """Per layer: its parameters' layouts and the tensor-parallel collectives of one microbatch."""
    prof = sm.profile
    t, sp = layout.tensor, layout.sequence_parallel
    out = []
    names = prof.param_names
    for lay in prof.layers:
        lc = sm.layer_cost(lay.fingerprint, t, sm.boundary(lay.fingerprint, t, sp))
        params = {}
        for pos, k in enumerate(lay.param_inputs):
            if k is not None:
                params[names.get(k, f"param {k}")] = spec_name(lc.param_specs.get(pos, -1))
        comm = [[c.kind, c.batch_bytes * scale + c.fixed_bytes, c.seconds(scale, t, sm.cluster),
                 "backward" if c.backward else "forward"] for c in lc.collectives]
        out.append(LayerSharding(index=lay.index, name=lay.name, params=params, collectives=comm))
    return tuple(out)


def _read_param_bytes(prof, layers) -> int:
    """Bytes of the parameters ``layers`` read: of a stacked parameter read by rows (a scan's), those rows; with the
    weights only work moved out of the loss reads where that work runs."""
    rows: dict[int, float] = {}
    for lay in layers:
        for k, frac in lay.row_fractions:
            rows[k] = rows.get(k, 0.0) + frac
    results = set(prof.moved.result_inputs) if prof.moved else set()  # (values sent to it: no parameters)
    read = {k for lay in layers for k in lay.param_inputs if k is not None and k not in results}
    whole = {k for lay in layers for k in lay.param_inputs if k is not None and k not in dict(lay.row_fractions)}
    own = prof.moved.param_bytes if prof.moved and any(lay.index == prof.moved.home_layer for lay in layers) else 0
    return own + int(sum(prof.state_bytes[k][0] * (1.0 if k in whole else min(1.0, rows.get(k, 1.0))) for k in read))

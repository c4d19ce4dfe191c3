"""The cost model of a training step on a cluster, read off the traced program.

Everything starts from a :class:`~autopp.profiler.Profile`: the step's layers, each distinct layer's
forward-and-backward program, the bytes of every parameter, gradient and optimizer-state leaf, and the update's
kernels, all traced at one batch size (``profile.batch_size``). A :class:`Layout` adds the parallel degrees; the
model then prices, per layer and microbatch, on one device:

* **Tensor parallelism and sequence parallelism**: the layer's sharding over the ``tensor`` axis is the solution of
  the intra-operator ILP (:mod:`autopp.planner._sharding`, solved once per distinct layer, tensor degree and
  boundary layout): its kernels with each operation's share of the work, and the collectives its resharding
  implies. ``sequence_parallel`` makes the activations between layers split along their sequence dimension
  instead of replicated.
* **Kernels**: matmuls at their operand dtype's peak (bf16/fp16 tensor cores, float32 as TF32 unless the trace asks
  for full precision), fused attention as one flash kernel, everything else fused between matmuls and
  memory-bound (:func:`autopp.profiler._kernels.program_kernels`); times from the device table's rates
  (:class:`~autopp.profiler._timemodel.KernelTimeModel`), or measured on the local device.
* **Batch scaling**: a microbatch of ``m`` examples per data-parallel replica scales every batch-proportional cost
  (activation bytes, FLOPs of batch-dependent operations) by ``m / profile.batch_size``; parameter traffic does not
  scale.
* **Recomputation** (per stage, of the repeated blocks; every layer when the model has none): ``full`` keeps only
  each layer's inputs and re-runs its forward (and its forward collectives) in the backward; ``selective`` drops the
  residuals of an unfused attention core and re-runs it.
* **Data parallelism** over ``data`` replicas of each stage, of which ``fsdp`` shard parameters, gradients and
  optimizer state (ZeRO-3: each microbatch gathers the stage's parameters for the forward and again for the
  backward and reduce-scatters the gradients); the remaining replicas all-reduce each shard's gradients once per
  step, hierarchically when they span nodes; ``zero1`` shards the optimizer state over them too (Megatron's
  distributed optimizer: a reduce-scatter of the gradients and an all-gather of the updated parameters instead of
  the all-reduce).
* **Pipeline**: stages (``pipeline x virtual_stages`` model chunks, chunk ``c`` on device group ``c % pipeline``,
  or the V of DualPipeV) run the schedule's discrete-event simulation with each stage's own forward and backward
  times; a dependency between device groups waits for the activation's transfer over the link between them (inside
  a node or across nodes). Activations in flight per stage are counted from the schedule's own order of actions.
* **Step**: the pipeline's makespan, plus each group's gradient reduction that sticks out past it, plus the
  optimizer update (the traced update's memory traffic per parameter byte, at the device's bandwidth, over the
  parameters each device updates), plus the gradient all-reduce of parameters shared between device groups (a
  tied embedding).
* **Overlap** (:data:`~autopp.core._estimate.OVERLAPS`): what is hidden behind compute is only what XLA and JAX
  hide on GPUs by default (:data:`~autopp.core._estimate.DEFAULT_OVERLAP`) unless the caller says more.
* **Local devices**: ``dispatch_s`` charges the runtime's host cost per issued program (the host issues every
  program from one thread); zero for a cluster one does not run on.

Memory per device: the parameters, gradients and optimizer state of every parameter its stages use (divided by
the tensor split of the parameter, by ``fsdp``, and the optimizer state also by the replicas with ``zero1``), plus
each stage's activations per microbatch in flight, plus what recomputation or FSDP holds transiently.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence

from autopp.core import (
    DEFAULT_OVERLAP,
    Estimate,
    OVERLAPS,
    RECOMPUTE_MODES,
    SCHEDULES,
    Schedule,
    simulate_times,
)
from autopp.planner._chunks import LayerSums, ParamState, cached_schedule, chunk_split, even_layers, live_microbatches
from autopp.planner._sharding import LEAN_NS_PER_MB, LayerCost, layer_cost, solve
from autopp.profiler import Cluster, KernelTimeModel, Profile, REPLICATED, boundary_options, build_graph, ring_seconds

STAGE_INSTRUCTIONS = 12
"""Instructions the runtime issues per stage and step besides forwards, backwards and activation transfers
(gradient buffers, shared parameters, the optimizer's programs, result assembly), when dispatch is charged."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Layout:
    """The parallel degrees and schedule of a plan (the stage split and recomputation come separately)."""

    tensor: int = 1
    """Tensor-parallel devices per stage (inside one node)."""
    pipeline: int = 1
    """Device groups of the pipeline."""
    data: int = 1
    """Data-parallel replicas of each stage (the FSDP shards included)."""
    fsdp: int = 1
    """Of the ``data`` replicas, how many shard parameters, gradients and optimizer state (ZeRO-3); divides
    ``data``."""
    zero1: bool = False
    """Shard the optimizer state over the remaining ``data / fsdp`` replicas (distributed optimizer)."""
    microbatch_size: int = 1
    """Examples per microbatch per data-parallel replica."""
    schedule: str = "1f1b"
    """One of :data:`~autopp.core._estimate.SCHEDULES`."""
    virtual_stages: int = 1
    """Model chunks per device group (``interleaved-1f1b``; ``dualpipev`` always has 2)."""
    sequence_parallel: bool = False
    """Activations between layers split along their sequence dimension over the tensor axis."""

    @property
    def devices(self) -> int:
        return self.tensor * self.pipeline * self.data

    @property
    def num_chunks(self) -> int:
        return self.pipeline * (2 if self.schedule == "dualpipev" else self.virtual_stages)


@dataclasses.dataclass(frozen=True)
class LayerTerms:
    """One layer per microbatch on one device under a layout and recomputation mode."""

    f: float
    """Forward compute (seconds)."""
    b: float
    """Backward compute, recomputation included."""
    w: float
    """The weight-gradient part of ``b`` (what zero-bubble schedules defer)."""
    tp_f: float
    """Exposed tensor-parallel communication of the forward."""
    tp_b: float
    """Exposed tensor-parallel communication of the backward (and of a recomputed forward)."""
    act: float
    """Bytes kept per microbatch in flight."""
    transient: float
    """Bytes held while the layer's backward runs, beyond ``act`` (the recomputed residuals)."""
    extra_flops: float
    """FLOPs recomputation adds per microbatch (per replica, whole layer)."""
    per_step: float = 0.0
    """Seconds of parameter-only work that runs once per step, not per microbatch (casting master weights)."""


@dataclasses.dataclass(frozen=True)
class Evaluation:
    """The cost model's verdict on a layout with a stage split."""

    estimate: Estimate
    stage_forward_s: tuple[float, ...]
    """Per model chunk: forward of one microbatch (communication included)."""
    stage_backward_s: tuple[float, ...]
    """Per model chunk: backward of one microbatch (recomputation and communication included)."""
    group_memory_bytes: tuple[float, ...]
    """Peak bytes per device of each device group."""


class StepModel:
    """The cost model of one profiled step on one cluster (caches each layer's sharding solutions)."""

    def __init__(self, profile: Profile, cluster: Cluster, *, overlap: Sequence[str] = DEFAULT_OVERLAP,
                 dispatch_s: float = 0.0, time_model: KernelTimeModel | None = None):
        if profile.batch_size is None:
            raise ValueError("the profiled step's batch leaves have different leading dimensions, so a microbatch size "
                             "cannot scale its costs; trace the step with every batch leaf's first dimension equal to "
                             "the batch size.")
        unknown = [o for o in overlap if o not in OVERLAPS]
        if unknown:
            raise ValueError(f"overlap: unknown kinds {unknown}; choose among {', '.join(OVERLAPS)}.")
        self.profile, self.cluster = profile, cluster
        self.overlap = frozenset(overlap)
        self.dispatch_s = float(dispatch_s)
        if time_model is None:
            time_model = (profile.time_model if profile.time_model.device == cluster.device.name
                          else KernelTimeModel.from_device(cluster.device))
        self.tm = time_model
        self.layers = profile.layers
        blocks = [l.index for l in self.layers if l.name.startswith("block")]
        self.recomputable = frozenset(blocks) if blocks else frozenset(l.index for l in self.layers)
        self._solutions: dict[tuple, LayerCost] = {}
        self._terms: dict[tuple, LayerTerms] = {}
        self._graph_parts: dict[str, dict] = {}
        self.solve_stats: list[tuple[str, int, int, str, float, float]] = []
        """(fingerprint, tensor degree, boundary, status, gap, seconds) of every ILP solved."""

    # -- one layer ---------------------------------------------------------------------------------------
    def boundary(self, fingerprint: str, tensor: int, sequence_parallel: bool) -> int:
        """The layout of the activations entering and leaving a layer: replicated, or split along the first
        non-batch dimension the tensor degree divides (the sequence) with sequence parallelism."""
        if not sequence_parallel or tensor == 1:
            return REPLICATED
        opts = boundary_options(self.profile.programs[fingerprint], tensor)
        return opts[1] if len(opts) > 1 else REPLICATED

    def layer_cost(self, fingerprint: str, tensor: int, boundary: int) -> LayerCost:
        key = (fingerprint, tensor, boundary)
        hit = self._solutions.get(key)
        if hit is None:
            graph = build_graph(self.profile.programs[fingerprint], tensor, boundary,
                                cache=self._graph_parts.setdefault(fingerprint, {}))
            # solved for one example per microbatch, whatever batch the step was traced at
            # sequence parallelism is there to save activation memory: its layout keeps the fewest bytes first
            sol = solve(graph, self.tm, self.cluster, scale=1.0 / self.profile.batch_size,
                        memory_ns_per_mb=1.0 if boundary == REPLICATED else LEAN_NS_PER_MB)
            hit = self._solutions[key] = layer_cost(sol)
            self.solve_stats.append((fingerprint, tensor, boundary, sol.status, sol.gap, sol.wall_time_s))
        return hit

    def terms(self, index: int, tensor: int, sequence_parallel: bool, scale: float, recompute: str) -> LayerTerms:
        lay = self.layers[index]
        mode = recompute if index in self.recomputable else "none"
        # identical layers (one fingerprint) have identical terms
        key = (lay.fingerprint, lay.measured, tensor, sequence_parallel, scale, mode)
        hit = self._terms.get(key)
        if hit is not None:
            return hit
        lc = self.layer_cost(lay.fingerprint, tensor, self.boundary(lay.fingerprint, tensor, sequence_parallel))
        tm, cluster = self.tm, self.cluster
        if lay.measured and tensor == 1:  # the measurement at the traced batch, scaled as the kernels' times are
            f = lay.forward_time_s * _batch_shape(tm, lc.forward, scale)  # (launches do not shrink with the batch)
            b = lay.backward_time_s * _batch_shape(tm, lc.backward, scale)
        else:
            f, b = tm.scaled_time(lc.forward, scale), tm.scaled_time(lc.backward, scale)
        tp_f = sum(c.seconds(scale, tensor, cluster) for c in lc.collectives if not c.backward)
        tp_b = sum(c.seconds(scale, tensor, cluster) for c in lc.collectives if c.backward)
        w = b / 2
        extra_flops = 0.0
        transient = 0.0
        act = lc.residual_bytes * scale
        if mode == "full":
            b, tp_b = b + f, tp_b + tp_f
            extra_flops = lay.flops * scale
            transient = act
            act = lc.input_bytes * scale
        elif mode == "selective" and lc.core_forward:
            b += tm.scaled_time(lc.core_forward, scale)
            extra_flops = sum(k.at(scale).flops for k in lc.core_forward) * tensor
            act = (lc.residual_bytes - lc.core_residual_bytes) * scale
        if "tensor" in self.overlap:  # collective matmul: communication hides behind the matmuls it feeds
            tp_f, tp_b = max(0.0, tp_f - f), max(0.0, tp_b - b)
        per_step = tm.per_step_time(lc.forward) + tm.per_step_time(lc.backward)
        hit = self._terms[key] = LayerTerms(f=f, b=b, w=w, tp_f=tp_f, tp_b=tp_b, act=act, transient=transient,
                                            extra_flops=extra_flops, per_step=per_step)
        return hit

    def param_share(self, index: int, tensor: int, sequence_parallel: bool) -> dict[int, float]:
        """Forward input (parameter) -> the fraction of it one device of the tensor group holds, for the parameters
        layer ``index`` reads."""
        key = ("share", index, tensor, sequence_parallel)
        hit = self._terms.get(key)
        if hit is not None:
            return hit
        lay = self.layers[index]
        lc = self.layer_cost(lay.fingerprint, tensor, self.boundary(lay.fingerprint, tensor, sequence_parallel))
        out = {}
        for pos, k in enumerate(lay.param_inputs):
            if k is not None:
                spec = lc.param_specs.get(pos, REPLICATED)
                out.setdefault(k, 1.0 / tensor if spec >= 0 else 1.0)
        self._terms[key] = out
        return out

    def arrays(self, tensor: int, sequence_parallel: bool, scale: float, mode: str) -> LayerSums:
        """Per-layer terms (see :class:`LayerTerms`) as prefix sums, for a layout's tensor degree, boundary, batch
        scale and recomputation mode."""
        key = ("arrays", tensor, sequence_parallel, scale, mode)
        hit = self._terms.get(key)
        if hit is None:
            terms = [self.terms(i, tensor, sequence_parallel, scale, mode) for i in range(len(self.layers))]
            hit = self._terms[key] = LayerSums(terms)
        return hit

    def params(self, tensor: int, sequence_parallel: bool) -> ParamState:
        """Per-layer bytes of the parameter state each layer owns (the first layer reading a parameter), and the
        parameters read by later layers too."""
        key = ("params", tensor, sequence_parallel)
        hit = self._terms.get(key)
        if hit is None:
            hit = self._terms[key] = ParamState(self, tensor, sequence_parallel)
        return hit

    # -- a whole step --------------------------------------------------------------------------------------
    def chunk_groups(self, layout: Layout) -> list[int]:
        """Device group of each model chunk."""
        P = layout.pipeline
        if layout.schedule == "dualpipev":
            return [c if c < P else 2 * P - 1 - c for c in range(2 * P)]
        return [c % P for c in range(layout.num_chunks)]

    def evaluate(self, layout: Layout, global_batch: int, chunk_layers: Sequence[tuple[int, int]],
                 chunk_recompute: Sequence[str], *, exact: bool = True, schedule: Schedule | None = None) -> Evaluation:
        """Predict one step. ``chunk_layers[c]``: first and last layer (inclusive) of model chunk ``c``;
        ``chunk_recompute[c]``: its recomputation mode. With ``exact`` the pipeline's makespan and the activations
        in flight come from the schedule itself (its discrete-event simulation and its order of actions); otherwise
        from closed forms at the slowest stage's pace (fast, for screening)."""
        prof, cluster = self.profile, self.cluster
        L = layout
        t, P, d = L.tensor, L.pipeline, L.data
        C = L.num_chunks
        if len(chunk_layers) != C or len(chunk_recompute) != C:
            raise ValueError(f"evaluate: {C} model chunks, got {len(chunk_layers)} layer ranges and "
                             f"{len(chunk_recompute)} recomputation modes.")
        if global_batch % (L.microbatch_size * d):
            raise ValueError(f"global_batch={global_batch} is not a multiple of microbatch_size * data = "
                             f"{L.microbatch_size} * {d}.")
        M = global_batch // (L.microbatch_size * d)
        scale = L.microbatch_size / prof.batch_size
        groups = self.chunk_groups(L)
        members = self._members(L)  # per device group: its chunks
        sp = L.sequence_parallel
        arr = [self.arrays(t, sp, scale, mode) for mode in chunk_recompute]
        span = [(a, b + 1) for a, b in chunk_layers]
        f = [x.sum("f", *ab) + x.sum("tp_f", *ab) for x, ab in zip(arr, span)]
        bw = [x.sum("b", *ab) + x.sum("tp_b", *ab) for x, ab in zip(arr, span)]
        w = [x.sum("w", *ab) for x, ab in zip(arr, span)]
        compute = [x.sum("f", *ab) + x.sum("b", *ab) for x, ab in zip(arr, span)]
        tp = [x.sum("tp_f", *ab) + x.sum("tp_b", *ab) for x, ab in zip(arr, span)]
        pr = self.params(t, sp)
        f_sh = L.fsdp
        replicas = d // f_sh
        group_state = self._group_state(L, span, groups)

        # FSDP: every microbatch gathers a chunk's parameters for its forward and backward and reduce-scatters its
        # gradients; prefetching hides what the chunk's compute covers
        fsdp_exposed = [0.0] * C
        if f_sh > 1:
            spans = f_sh * t > cluster.devices_per_node
            for c, (a, b) in enumerate(span):
                pb, gb, _ = pr.chunk_state(a, b)
                comm = (2 * ring_seconds("all-gather", pb, f_sh, cluster, spans_nodes=spans)
                        + ring_seconds("reduce-scatter", gb, f_sh, cluster, spans_nodes=spans))
                hidden = compute[c] if "param-gather" in self.overlap else 0.0
                fsdp_exposed[c] = max(0.0, comm - hidden)
                f[c] += fsdp_exposed[c] / 2
                bw[c] += fsdp_exposed[c] / 2

        # pipeline: activation transfers between device groups
        group_devices = t * d
        send = 0.0
        for c in range(C - 1):
            g0, g1 = groups[c], groups[c + 1]
            if g0 == g1:
                continue
            nbytes = self.layers[chunk_layers[c][1]].crossing_bytes * scale / (t if sp else 1)
            spans = cluster.num_nodes > 1 and (g0 * group_devices) // cluster.devices_per_node != (
                g1 * group_devices) // cluster.devices_per_node
            send = max(send, ring_seconds("send-recv", nbytes, 2, cluster, spans_nodes=spans))
        dispatch = self.dispatch_s
        if dispatch and C > 1:  # every action is a program the host issues (one program for a single stage)
            f = [x + dispatch for x in f]
            bw = [x + dispatch for x in bw]
        in_flight = self._in_flight(L, M, exact)
        if exact and C > 1:
            sched = schedule or cached_schedule(L.schedule, C, M, L.virtual_stages, P)
            wt = w if L.schedule in ("zb-h1", "dualpipev") else None
            times = simulate_times(sched, f, bw, wt, send_time=send)
            plain = simulate_times(sched, f, bw, wt, send_time=0.0) if send else times
            makespan = max(e for _, e in times.values())
            pp_comm = makespan - max(e for _, e in plain.values())
            ends = [0.0] * P
            chunk_end = [0.0] * C  # when each model chunk's last backward (or weight gradient) ends
            rank_of = {a: r for r, row in enumerate(sched.rows) for a in row if a is not None}
            for a, (_, e) in times.items():
                ends[rank_of[a]] = max(ends[rank_of[a]], e)
                if a.kind in ("B", "W"):
                    chunk_end[a.stage] = max(chunk_end[a.stage], e)
        else:
            per_group_f = [sum(f[c] for c in members[g]) for g in range(P)]
            per_group_b = [sum(bw[c] for c in members[g]) for g in range(P)]
            slow = max(range(P), key=lambda g: per_group_f[g] + per_group_b[g])
            fs, bs = per_group_f[slow], per_group_b[slow]
            v = C // P
            if P == 1:
                bubble = 0.0
            elif L.schedule in ("gpipe", "1f1b"):
                bubble = (P - 1) * (fs + bs)
            elif L.schedule == "interleaved-1f1b":
                bubble = (P - 1) * (fs + bs) / v
            else:  # zero-bubble: the input-gradient chain (Qi et al. 2023)
                ws = sum(w[c] for c in members[slow])
                bubble = (P - 1) * max(fs + bs - 2 * ws, bs - ws)
            pp_comm = 2 * (P - 1) * send  # the fill and the drain wait for transfers; the steady state overlaps them
            makespan = M * (fs + bs) + bubble + pp_comm + (dispatch if C == 1 else 0.0)
            # in the cool-down, group g finishes its last backward g backward-slots before group 0; its chunks one
            # chunk-backward apart, the first chunk last
            ends = [makespan - g * bs / v for g in range(P)]
            chunk_end = [0.0] * C
            for g in range(P):
                mine = members[g]
                for k, c in enumerate(sorted(mine, reverse=True)):
                    chunk_end[c] = ends[g] - (len(mine) - 1 - k) * (bw[c] if k else 0.0)
        # the host issues every program from one thread: the pipeline takes at least that long
        if C == 1:
            chunk_end = list(ends)
        if dispatch and C > 1:
            controller = dispatch * (2 * C * M + 2 * (C - 1) * M + STAGE_INSTRUCTIONS * C)
            if controller > makespan:
                ends = [e + controller - makespan for e in ends]
                chunk_end = [e + controller - makespan for e in chunk_end]
                makespan = controller

        # data-parallel reduction and the optimizer, per device group
        finish = []
        dp_exposed = 0.0
        update_s = []
        ratio = self._update_ratio
        # parameter-only work (casting master weights) runs once per step before a group's first microbatch
        per_step = [sum(arr[c].sum("per_step", *span[c]) for c in members[g]) for g in range(P)]
        shift = max(per_step)
        ends = [e + shift for e in ends]
        chunk_end = [e + shift for e in chunk_end]
        makespan += shift
        for g in range(P):
            pb, gb, _ = group_state[g]
            rkey = ("reduce", gb, pb, replicas, t, f_sh, L.zero1)
            hit = self._terms.get(rkey)
            if hit is None:
                hit = self._terms[rkey] = self._grad_reduce(gb / f_sh, gb / f_sh, replicas, t, f_sh, L.zero1)
            red, gather = hit
            mine = sorted(members[g], key=lambda c: chunk_end[c])
            if "grad-reduce" in self.overlap:
                # bucket by bucket: a chunk's gradients are reduced from the start of its last backward (each
                # chunk's share in turn, as its buckets fill), behind whatever the group still computes
                share = [pr.chunk_state(*span[c])[1] for c in mine]
                total = sum(share) or 1.0
                clock = 0.0
                for c, s_ in zip(mine, share):
                    clock = max(clock, chunk_end[c] - bw[c]) + red * s_ / total
                red = max(0.0, clock - ends[g])
            if "param-gather" in self.overlap:  # ZeRO-1's gather of the updated parameters, layer by layer during
                first_f = min((f[c] for c in members[g]), default=0.0)  # the next step's forward
                gather = max(0.0, gather - first_f)
            red += gather
            upd = ratio * gb / f_sh / (replicas if L.zero1 else 1) / self.tm.bytes_per_s  # (trained: gradients')
            update_s.append(upd)
            finish.append(ends[g] + red + upd)
            dp_exposed = max(dp_exposed, ends[g] + red - makespan)
        shared = pr.shared_reduce(span, groups, self.cluster, rows=self._by_rows(L)) if P > 1 else 0.0
        # work moved out of the loss: computed before the first microbatch that reads it, its backward after the last
        step = max(finish) + shared + self._moved_s
        pp_comm += shared

        mem, details = self._memory(L, span, members, arr, in_flight, group_state)

        model_flops = (prof.forward_flops + prof.backward_flops) * global_batch / prof.batch_size + (
            prof.moved.flops if prof.moved else 0.0)
        extra = sum(x.sum("extra", *ab) for x, ab in zip(arr, span)) * M * d
        n = layout.devices
        worst = max(range(P), key=lambda g: mem[g])
        # the breakdown is the busiest device group's (its parts then add up to no more than the step)
        busiest = max(members, key=lambda mine: sum(compute[c] + tp[c] + fsdp_exposed[c] for c in mine))
        comp = M * sum(compute[c] for c in busiest) + shift + self._moved_s  # (work once per step is compute)
        tp_s = M * sum(tp[c] for c in busiest)
        fsdp_s = M * sum(fsdp_exposed[c] for c in busiest)
        issued = dispatch if C == 1 else 2 * M * dispatch * len(busiest)  # (the host's part of the makespan)
        dev = cluster.device
        est = Estimate(
            step_time_s=step,
            tflops_per_gpu=(model_flops + extra) / step / n / 1e12,
            mfu=None if dev.name == "cpu" else model_flops / (step * n * dev.peak_flops("bfloat16")),
            peak_memory_bytes_per_gpu=int(math.ceil(mem[worst])),
            fits=bool(mem[worst] <= dev.memory_capacity),
            compute_s=comp,
            bubble_s=_above_rounding(makespan - (comp - self._moved_s) - tp_s - fsdp_s - (pp_comm - shared) - issued,
                                     makespan),
            tp_comm_s=tp_s, fsdp_comm_s=fsdp_s, pp_comm_s=pp_comm, dp_comm_s=max(0.0, dp_exposed),
            optimizer_s=max(update_s), num_microbatches=M,
            param_bytes=int(details[worst][0]), optimizer_bytes=int(details[worst][1]),
            activation_bytes=int(details[worst][2]), update_copy_bytes=int(details[worst][3]),
            dispatch_s=max(0.0, makespan - M * max(f[c] + bw[c] for c in range(C))) if dispatch else 0.0,
        )
        return Evaluation(estimate=est, stage_forward_s=tuple(f), stage_backward_s=tuple(bw),
                          group_memory_bytes=tuple(mem))

    def peak_memory(self, layout: Layout, global_batch: int, chunk_layers: Sequence[tuple[int, int]],
                    recompute: str) -> float:
        """The most bytes any device holds in :meth:`evaluate`'s closed form with every chunk recomputing
        ``recompute`` (its ``peak_memory_bytes_per_gpu`` with ``exact=False``), without pricing time."""
        L = layout
        M = global_batch // (L.microbatch_size * L.data)
        arr = self.arrays(L.tensor, L.sequence_parallel, L.microbatch_size / self.profile.batch_size, recompute)
        span = [(a, b + 1) for a, b in chunk_layers]
        groups = self.chunk_groups(L)
        mem, _ = self._memory(L, span, self._members(L), [arr] * L.num_chunks, self._in_flight(L, M, False),
                              self._group_state(L, span, groups))
        return max(mem)

    def _group_state(self, L: Layout, span, groups) -> list[tuple[float, float, float]]:
        """Per device group: (parameter, gradient, optimizer) bytes per device before FSDP and ZeRO-1."""
        rows = self._by_rows(L)
        key = ("group_state", L.tensor, L.sequence_parallel, tuple(span), tuple(groups), rows)
        hit = self._terms.get(key)
        if hit is None:
            hit = self._terms[key] = self.params(L.tensor, L.sequence_parallel).group_state(span, groups, L.pipeline,
                                                                                          rows=rows)
        return hit

    def _by_rows(self, L: Layout) -> bool:
        """Whether the runtime may divide stacked parameters by rows under ``L`` (``runtime/_rows.py``): one process
        (one node), no tensor, FSDP or ZeRO-1 split, no sequence parallelism."""
        return (self.cluster.num_nodes == 1 and L.tensor == 1 and L.fsdp == 1 and not L.zero1
                and not L.sequence_parallel)

    def _memory(self, L: Layout, span, members, arr, in_flight, group_state) -> tuple[list[float], list[tuple]]:
        """Bytes per device of each group, and (parameters and gradients, optimizer state, activations, the update's
        new copies where they set the peak, else 0) of each."""
        pr = self.params(L.tensor, L.sequence_parallel)
        f_sh = L.fsdp
        replicas = L.data // f_sh
        mem, details = [], []
        for g, mine in enumerate(members):
            act = transient = 0.0
            built = [self.layers[i].built_bytes for c in mine for i in range(*span[c])]
            for c in mine:
                act += in_flight[c] * arr[c].sum("act", *span[c])
                transient = max(transient, arr[c].max("transient", *span[c]))
            if built and max(built):  # weights built in the loss: made by a stage's programs, held while they run
                transient += sum(built) + max(built)  # (the largest one's gradient beside them)
            pb, gb, ob = group_state[g]
            static_w = (pb + gb) / f_sh
            static_o = ob / f_sh / (replicas if L.zero1 else 1)
            working = 0.0
            if f_sh > 1:  # two gathered layers (the one computing, the one prefetched) and one layer's gradients
                working = 3 * max(pr.layer_bytes(i) for c in mine for i in range(*span[c]))
            # the update, after the microbatches: new values of what the caller keeps (not donated) beside the old,
            # less the gradients it frees
            new_p, new_o = self.profile.update_copies
            copies = ((new_p * pb - gb) / f_sh + new_o * static_o) if new_p or new_o else 0.0
            moved = self.profile.moved
            if moved is not None and any(a <= moved.home_layer < b for a, b in (span[c] for c in mine)):
                static_w += moved.state_bytes + moved.input_bytes  # (its own weights and inputs: "weights")
                act += moved.held_bytes  # results and residuals, held through the step
                transient = max(transient, moved.transient_bytes)
                if new_p or new_o:
                    copies += (new_p - 1) * moved.param_bytes + new_o * (moved.state_bytes - 2 * moved.param_bytes)
            copies = copies if copies > act + transient + working else 0.0
            mem.append(static_w + static_o + max(act + transient + working, copies))
            details.append((static_w, static_o, act + transient, copies))
        return mem, details

    def lower_bound(self, layout: Layout, global_batch: int, chunk_layers: Sequence[tuple[int, int]],
                    recompute: str) -> float:
        """A lower bound on :meth:`evaluate`'s closed-form step time for this split with every chunk recomputing
        ``recompute``, from compute alone (no communication, memory or schedule simulation): the busiest device
        group's compute for all microbatches, the closed form's fill and drain at that group's pace, and the
        once-per-step parameter-only work. Ranks layouts before they are evaluated; a layout whose bound exceeds
        what is already found need not be."""
        L = layout
        M = global_batch // (L.microbatch_size * L.data)
        arr = self.arrays(L.tensor, L.sequence_parallel, L.microbatch_size / self.profile.batch_size, recompute)
        spans = [(a, b + 1) for a, b in chunk_layers]
        compute = [arr.sum("f", a, b) + arr.sum("b", a, b) for a, b in spans]
        members = self._members(L)
        busiest = max(sum(compute[c] for c in mine) for mine in members)
        P = L.pipeline
        fill = 0.0
        if P > 1 and L.schedule in ("gpipe", "1f1b", "interleaved-1f1b"):
            fill = (P - 1) * busiest / (L.num_chunks // P)
        per_step = max(sum(arr.sum("per_step", *spans[c]) for c in mine) for mine in members)
        return M * busiest + fill + per_step + self._moved_s

    # -- pieces ------------------------------------------------------------------------------------------------
    def _in_flight(self, L: Layout, M: int, exact: bool) -> list[float]:
        """Microbatches whose activations each chunk keeps at its peak."""
        C, P = L.num_chunks, L.pipeline
        if C == 1:
            return [1.0]  # one program, a lax.scan over microbatches
        if exact:
            return list(live_microbatches(L.schedule, C, M, L.virtual_stages, P))
        groups = self.chunk_groups(L)
        v = C // P
        if L.schedule == "gpipe":
            return [float(M)] * C
        if L.schedule == "interleaved-1f1b":
            return [min((v - 1) * P + 2 * (P - groups[c] - 1) + 1, M * v) / v for c in range(C)]
        if L.schedule in ("zb-h1", "dualpipev"):
            return [float(min(M, P))] * C
        return [float(min(M, P - groups[c])) for c in range(C)]

    def _members(self, L: Layout) -> list[list[int]]:
        """Per device group, its model chunks in order."""
        key = ("members", L.schedule, L.pipeline, L.num_chunks)
        hit = self._terms.get(key)
        if hit is None:
            hit = [[] for _ in range(L.pipeline)]
            for c, g in enumerate(self.chunk_groups(L)):
                hit[g].append(c)
            self._terms[key] = hit
        return hit

    @functools.cached_property
    def _moved_s(self) -> float:
        """Seconds of the work moved out of the loss (forward and backward), once per step on one device, unsharded:
        each data-parallel replica computes it whole."""
        moved = self.profile.moved
        return 0.0 if moved is None else self.tm.scaled_time(moved.kernels) + self.tm.per_step_time(moved.kernels)

    @functools.cached_property
    def _update_ratio(self) -> float:
        return self._update_bytes_per_param_byte()

    def _update_bytes_per_param_byte(self) -> float:
        """Memory traffic of the traced update per byte of parameters (e.g. 7 for Adam over fp32 parameters: read
        parameter, gradient and both moments, write parameter and moments)."""
        total = sum(k.at(1.0).bytes_accessed for k in self.profile.update_kernels)
        pbytes = sum(v[0] for v in self.profile.state_bytes.values() if v[1]) or 1  # (trained parameters)
        return total / pbytes

    def _grad_reduce(self, grad_bytes: float, param_bytes: float, replicas: int, t: int, fsdp: int,
                     zero1: bool) -> tuple[float, float]:
        """Seconds to reduce a device's gradient shard over the ``replicas`` holding the same shard, hierarchically
        when they span nodes (reduce-scatter in the node, all-reduce across nodes, all-gather in the node), and to
        gather the updated parameters back: with ``zero1`` a reduce-scatter of the gradients, then an all-gather of
        the parameters (the second number); without, an all-reduce and nothing."""
        if replicas == 1:
            return 0.0, 0.0
        cluster = self.cluster
        local = max(1, min(replicas, cluster.devices_per_node // (t * fsdp)))
        nodes = -(-replicas // local)

        def allreduce_like(nbytes, kind):
            if nodes == 1:
                return ring_seconds(kind, nbytes, replicas, cluster, spans_nodes=False)
            inter = ring_seconds(kind, nbytes / local, nodes, cluster, spans_nodes=True)
            if local > 1:
                intra = ring_seconds("reduce-scatter" if kind != "all-gather" else "all-gather", nbytes, local,
                                        cluster, spans_nodes=False)
                if kind == "all-reduce":
                    intra *= 2
                return inter + intra
            return inter

        if zero1:
            return allreduce_like(grad_bytes, "reduce-scatter"), allreduce_like(param_bytes, "all-gather")
        return allreduce_like(grad_bytes, "all-reduce"), 0.0


def _batch_shape(tm, kernels, scale: float) -> float:
    """A layer's time at ``scale`` times the traced batch over its time at the traced batch, by the kernel model:
    what does not shrink with the batch (a kernel's launch, a loop's launches per iteration, reading weights) keeps
    a measured time from being scaled as if all of it did. ``scale`` where the model gives no time."""
    at_traced = tm.scaled_time(kernels, 1.0)
    return tm.scaled_time(kernels, scale) / at_traced if at_traced > 0 else scale


def _above_rounding(x: float, scale: float) -> float:
    """``x`` (a difference of sums of seconds), or 0 where it is negative or rounding error next to ``scale``."""
    return x if x > 1e-9 * scale else 0.0


__all__ = ["Evaluation", "LayerTerms", "Layout", "RECOMPUTE_MODES", "SCHEDULES", "StepModel", "chunk_split",
           "even_layers"]  # the chunk split re-exported: what the cost model evaluates layouts over


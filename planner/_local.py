"""Planning for the local devices: choose stages, microbatches, schedule and the stage split from a measured profile.

:func:`plan_local` is what :func:`autopp.parallelize` runs when it is not told ``num_stages``,
``num_microbatches`` and ``schedule``. It searches every layout the runtime can execute on ``N`` devices:

* ``S`` pipeline stages, ``S`` a divisor of ``N`` and at most the number of places the model can be cut;
  each stage gets ``d = N / S`` devices and is data-parallel inside (parameters replicated);
* ``M`` microbatches, ``M`` a divisor of the batch size ``B`` whose microbatch ``B / M`` splits evenly over
  the ``d`` devices of a stage (otherwise the runtime replicates the microbatch on every device of the stage,
  which the cost model below does not describe);
* the schedules 1F1B and GPipe.

Cost model (all times from the profile: per-layer forward and backward measured on one local device for the
full batch):

* an action (the forward or the backward of one microbatch on one stage) takes the stage's layer times scaled
  by the examples each device processes, ``B / (M d)`` out of ``B``, plus :data:`DISPATCH_S`;
* a stage split is chosen by :func:`autopp.planner.assign_stages` (CP-SAT: minimise the slowest stage under
  per-device memory; no recomputation: not modelled here); among the splits as fast as its answer the one
  moving the fewest activation bytes (then the lexicographically first) is taken, so that the plan does not
  depend on which of several equal optima the solver happens to return. An equal split of the layers is
  evaluated too and kept when it is predicted faster;
* the pipeline's time is the discrete-event simulation of the schedule
  (:func:`autopp.planner._schedule.simulate_times`) with per-stage action times; a cross-stage dependency
  waits for the activation (or its gradient) to be sent: the largest cut's bytes per device over the device's
  link (:func:`autopp.profiler.collective_time`, ``send-recv``). The runtime dispatches every program and
  transfer from one Python thread, so the pipeline takes at least :data:`DISPATCH_S` per instruction it issues
  (``2 S M`` forwards and backwards, ``2 (S - 1) M`` transfers and :data:`STAGE_INSTRUCTIONS` per stage); a
  one-stage plan is one program (a ``lax.scan`` over microbatches);
* after its last backward each stage all-reduces its gradients over its ``d`` devices (ring model,
  ``collective_time``) and updates its parameters (memory-bound: parameters, gradients and optimizer state read
  and written once at the device's memory bandwidth);
* memory per device: the stage's parameters, gradients and optimizer state, plus its layers' activations (VJP
  residuals) per microbatch in flight (GPipe ``M``, 1F1B ``min(M, S - s)`` on stage ``s``, one for a one-stage
  plan), which must fit the device's memory.

The layout with the smallest predicted step time wins; near-ties (relative 1e-9) go to fewer stages, then fewer
microbatches, then the schedule listed first (1F1B: it keeps fewer microbatches in flight).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence

from autopp.planner._cpsat import assign_stages
from autopp.planner._schedule import get_schedule, simulate_times
from autopp.planner._simulate import Estimate
from autopp.profiler._cluster import Cluster
from autopp.profiler._profile import Profile
from autopp.profiler._timemodel import collective_time

DISPATCH_S = 45e-6
"""Seconds the runtime's controller spends per instruction it dispatches (a stage program or a transfer), also
charged to every action's device time. Fitted on this project's 2-core development machine (8 CPU devices):
step times of the zoo MLP (compute negligible, batch 64) with 1F1B on 2, 4 and 8 stages and 4 to 32
microbatches (93 to 1043 instructions) against the instruction count give 45 us per instruction (an empty
jitted call alone costs 4 us there, 19 us with ten arguments; the rest is the executor's bookkeeping and
``jax.device_put``)."""

STAGE_INSTRUCTIONS = 12
"""Instructions per stage and step besides forwards, backwards and activation transfers (gradient buffers,
shared parameters, the optimizer's programs, result assembly): the same fit gives 0.54 ms per stage, i.e. about
12 x :data:`DISPATCH_S`."""

RUNNABLE_SCHEDULES = ("1f1b", "gpipe")
"""Schedules this cost model describes, in tie-breaking order (the runtime also runs interleaved 1F1B and
ZB-H1; choosing them, recomputation and FSDP/tensor stages locally is not modelled yet)."""

_TIE = 1e-9


@dataclasses.dataclass(frozen=True, kw_only=True)
class LayerCosts:
    """Per-layer costs of a step, full batch on one device: the planner's input (built from a :class:`Profile`
    by :meth:`from_profile`, or directly)."""

    forward_s: tuple[float, ...]
    """Forward time of each layer for the whole batch on one device."""
    backward_s: tuple[float, ...]
    """Backward time of each layer for the whole batch on one device."""
    param_bytes: tuple[int, ...]
    """Bytes of the parameters each layer owns (replicated on every device of its stage)."""
    grad_bytes: tuple[int, ...]
    """Bytes of their gradients."""
    optimizer_bytes: tuple[int, ...]
    """Bytes of the optimizer state of those parameters."""
    activation_bytes: tuple[int, ...]
    """Bytes each layer keeps for its backward (VJP residuals) for the whole batch."""
    cut_bytes: tuple[int, ...]
    """Per position ``l`` (1 <= l < layers, stored at index ``l - 1``): bytes of activations crossing a cut
    before layer ``l`` for the whole batch (skip connections included)."""
    cuttable: tuple[bool, ...]
    """Per position ``l`` (index ``l - 1``): whether a stage may begin at layer ``l`` (not inside a
    ``lax.scan``)."""
    step_flops: float
    """FLOPs of the whole step (forward, backward, update)."""
    model_flops: float
    """FLOPs of the loss's forward and backward (for MFU)."""

    def __post_init__(self) -> None:
        n = len(self.forward_s)
        if n == 0:
            raise ValueError("LayerCosts: the model has no layers; profile a step with autopp.grad inside.")
        for name in ("backward_s", "param_bytes", "grad_bytes", "optimizer_bytes", "activation_bytes"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"LayerCosts: {name} has {len(getattr(self, name))} entries for {n} layers; "
                                 "give one per layer.")
        for name in ("cut_bytes", "cuttable"):
            if len(getattr(self, name)) != n - 1:
                raise ValueError(f"LayerCosts: {name} has {len(getattr(self, name))} entries for {n} layers; "
                                 "give one per position between two layers (layers - 1).")

    @property
    def num_layers(self) -> int:
        return len(self.forward_s)

    @property
    def static_bytes(self) -> tuple[int, ...]:
        """Bytes each layer holds whatever the microbatching: parameters, gradients, optimizer state."""
        return tuple(p + g + o for p, g, o in zip(self.param_bytes, self.grad_bytes, self.optimizer_bytes))

    @classmethod
    def from_profile(cls, profile: Profile, cuttable: Sequence[bool] | None = None) -> LayerCosts:
        """The planner's view of a profile; ``cuttable`` (one per position between layers) defaults to every
        position except those inside a ``lax.scan`` (consecutive layers on one equation)."""
        layers = profile.layers
        n = len(layers)
        if cuttable is None:
            ranges = [profile.graph.nodes[l.index].get("eqn_range") for l in layers]
            cuttable = [ranges[l] is None or ranges[l - 1] is None or tuple(ranges[l]) != tuple(ranges[l - 1])
                        for l in range(1, n)]
        cross = [0] * (n + 1)
        for u, v, data in profile.graph.edges(data=True):
            for l in range(u + 1, v + 1):
                cross[l] += int(data.get("bytes", 0))
        return cls(
            forward_s=tuple(l.forward_time_s for l in layers), backward_s=tuple(l.backward_time_s for l in layers),
            param_bytes=tuple(l.param_bytes for l in layers), grad_bytes=tuple(l.grad_bytes for l in layers),
            optimizer_bytes=tuple(l.optimizer_bytes for l in layers),
            activation_bytes=tuple(l.activation_bytes for l in layers),
            cut_bytes=tuple(cross[1:n]), cuttable=tuple(bool(c) for c in cuttable),
            step_flops=float(profile.total_flops), model_flops=float(profile.forward_flops + profile.backward_flops),
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class Layout:
    """One point of the search space."""

    num_stages: int
    """Pipeline stages ``S``."""
    devices_per_stage: int
    """Devices of each stage ``d = N / S`` (data-parallel inside the stage)."""
    num_microbatches: int
    """Microbatches ``M`` per step."""
    schedule: str
    """``1f1b`` or ``gpipe``."""
    batch_size: int
    """Examples per step ``B``."""

    @property
    def examples_per_device(self) -> float:
        """Examples of one microbatch each device of a stage processes: ``B / (M d)``."""
        return self.batch_size / (self.num_microbatches * self.devices_per_stage)

    def in_flight(self) -> tuple[int, ...]:
        """Microbatches whose activations each stage keeps at its peak."""
        S, M = self.num_stages, self.num_microbatches
        if S == 1:
            return (1,)  # one program, a lax.scan over microbatches: one microbatch's residuals at a time
        if self.schedule == "gpipe":
            return (M,) * S
        return tuple(min(M, S - s) for s in range(S))


@dataclasses.dataclass(frozen=True, kw_only=True)
class SplitEvaluation:
    """The cost model's verdict on one layout with one stage split."""

    estimate: Estimate
    """Predicted step time and its breakdown, memory of the most loaded device."""
    stage_times_s: tuple[float, ...]
    """Forward plus backward time of one microbatch on each stage (dispatch included)."""
    stage_memory_bytes: tuple[float, ...]
    """Peak memory of each stage's devices."""
    bottleneck_s: float
    """The slowest stage's forward plus backward time for the whole batch on one device (what CP-SAT minimises)."""
    cut_bytes: int
    """Activation bytes of all cuts together, whole batch (the tie-breaker among equally fast splits)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class LocalPlan:
    """What :func:`plan_local` chose."""

    num_stages: int
    """Pipeline stages."""
    devices_per_stage: int
    """Devices of each stage (data-parallel inside the stage)."""
    num_microbatches: int
    """Microbatches per step."""
    microbatch_size: int
    """Examples of one microbatch on one device: ``batch / (num_microbatches * devices_per_stage)``."""
    schedule: str
    """Schedule name (``1f1b`` or ``gpipe``)."""
    stage_layers: tuple[tuple[int, int], ...]
    """First and last (inclusive) profile layer of each stage."""
    predicted: Estimate
    """Predicted step time, its breakdown and the memory of the most loaded device."""
    stage_times_s: tuple[float, ...]
    """Predicted forward plus backward time of one microbatch on each stage."""
    stage_memory_bytes: tuple[float, ...]
    """Predicted peak memory of each stage's devices."""
    solver_status: str
    """CP-SAT's status for the chosen split (``OPTIMAL``, ``FEASIBLE``), or ``UNIFORM`` when an equal split of the
    layers was predicted faster than the solver's."""
    optimality_gap: float
    """CP-SAT's relative gap for the chosen split (0 when optimal or uniform)."""
    candidates: int
    """Layouts (stages x microbatches x schedule) evaluated."""
    best_uniform_step_time_s: float
    """Predicted step time of the best layout with an equal split of the layers (inf when none fits)."""
    wall_time_s: float
    """Seconds :func:`plan_local` took (profiling not included)."""

    @property
    def stage_starts(self) -> tuple[int, ...]:
        """First layer of each stage."""
        return tuple(a for a, _ in self.stage_layers)


# -- the search space ---------------------------------------------------------------------------------------

def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def _unit_starts(costs: LayerCosts) -> list[int]:
    """Layers a stage may begin at (layer 0 always)."""
    return [0] + [l for l in range(1, costs.num_layers) if costs.cuttable[l - 1]]


def legal_layouts(costs: LayerCosts, num_devices: int, batch_size: int, *,
                  schedules: Sequence[str] = RUNNABLE_SCHEDULES, num_stages: int | None = None,
                  num_microbatches: int | None = None) -> list[Layout]:
    """Every layout the runtime can execute, in tie-breaking order (fewer stages, fewer microbatches, schedule
    order); ``num_stages`` / ``num_microbatches`` restrict the search to that value."""
    units = len(_unit_starts(costs))
    out = []
    for S in _divisors(num_devices):
        if S > units or (num_stages is not None and S != num_stages):
            continue
        d = num_devices // S
        for M in _divisors(batch_size):
            if (batch_size // M) % d or (num_microbatches is not None and M != num_microbatches):
                continue
            for name in schedules:
                out.append(Layout(num_stages=S, devices_per_stage=d, num_microbatches=M, schedule=name,
                                  batch_size=batch_size))
    return out


def uniform_split(costs: LayerCosts, num_stages: int) -> tuple[int, ...]:
    """Stage starts of an equal split: the places a stage may begin, shared out as evenly as their count allows."""
    starts = _unit_starts(costs)
    return tuple(starts[(s * len(starts)) // num_stages] for s in range(num_stages))


# -- the cost model -----------------------------------------------------------------------------------------

def _bounds(costs: LayerCosts, starts: Sequence[int]) -> list[tuple[int, int]]:
    ends = list(starts[1:]) + [costs.num_layers]
    return list(zip(starts, ends))


def stage_memory(costs: LayerCosts, layout: Layout, starts: Sequence[int]) -> list[float]:
    """Peak bytes per device of each stage: parameters, gradients, optimizer state, activations in flight."""
    static, act = costs.static_bytes, costs.activation_bytes
    scale = layout.examples_per_device / layout.batch_size
    return [sum(static[a:b]) + k * scale * sum(act[a:b])
            for (a, b), k in zip(_bounds(costs, starts), layout.in_flight())]


def evaluate(costs: LayerCosts, cluster: Cluster, layout: Layout, starts: Sequence[int]) -> SplitEvaluation:
    """Predict one step of ``layout`` with stages beginning at layers ``starts`` (the model of the module doc)."""
    S, M, d, B = layout.num_stages, layout.num_microbatches, layout.devices_per_stage, layout.batch_size
    if len(starts) != S or starts[0] != 0 or list(starts) != sorted(set(starts)) or starts[-1] >= costs.num_layers:
        raise ValueError(f"evaluate: stage starts {list(starts)} do not split {costs.num_layers} layers into {S} "
                         "stages; give S increasing layer indices beginning with 0.")
    dev = cluster.device
    bounds = _bounds(costs, starts)
    scale = layout.examples_per_device / B
    f = [sum(costs.forward_s[a:b]) * scale + DISPATCH_S for a, b in bounds]
    bw = [sum(costs.backward_s[a:b]) * scale + DISPATCH_S for a, b in bounds]
    mem = stage_memory(costs, layout, starts)
    cuts = [costs.cut_bytes[a - 1] for a in starts[1:]]
    per_node = cluster.devices_per_node
    if S == 1:
        pipeline = M * (f[0] + bw[0]) - (2 * M - 1) * DISPATCH_S  # one program: one dispatch
        ends = [pipeline]
        compute, pp_comm = pipeline, 0.0
    else:
        send = 0.0
        if cuts:
            send = max(collective_time("send-recv", c / (M * d), 2, cluster,
                                       spans_nodes=(a * d) // per_node != (a * d - 1) // per_node
                                       and cluster.num_nodes > 1)
                       for c, a in zip(cuts, range(1, S)))
        sched = get_schedule(layout.schedule, S, M)
        times = simulate_times(sched, f, bw, send_time=send)
        plain = simulate_times(sched, f, bw, send_time=0.0)
        makespan = max(e for _, e in times.values())
        pp_comm = makespan - max(e for _, e in plain.values())
        controller = DISPATCH_S * (2 * S * M + 2 * (S - 1) * M + STAGE_INSTRUCTIONS * S)
        pipeline = max(makespan, controller)
        ends = [0.0] * S
        for a, (_, e) in times.items():
            ends[a.stage] = max(ends[a.stage], e + pipeline - makespan)
        compute = max(M * (fs + bs) for fs, bs in zip(f, bw))
    reduce, update = [], []
    for s, (a, b) in enumerate(bounds):
        grads = sum(costs.grad_bytes[a:b])
        spans = cluster.num_nodes > 1 and (s * d) // per_node != ((s + 1) * d - 1) // per_node
        reduce.append(collective_time("all-reduce", grads, d, cluster, spans_nodes=spans))
        state = sum(costs.static_bytes[a:b])
        update.append(2 * state / (dev.hbm_bandwidth * dev.memory_efficiency))
    reduced = max(e + r for e, r in zip(ends, reduce))
    step = max(e + r + u for e, r, u in zip(ends, reduce, update))
    dp_comm = max(0.0, reduced - pipeline)
    worst = max(range(S), key=lambda s: mem[s])
    a, b = bounds[worst]
    n = S * d
    estimate = Estimate(
        step_time_s=step,
        tflops_per_gpu=costs.step_flops / step / n / 1e12,
        mfu=costs.model_flops / (step * n * dev.peak_flops_bf16),
        peak_memory_bytes_per_gpu=int(math.ceil(mem[worst])),
        fits=mem[worst] <= dev.memory_capacity,
        compute_s=compute, bubble_s=max(0.0, pipeline - compute - pp_comm), tp_comm_s=0.0, fsdp_comm_s=0.0,
        pp_comm_s=pp_comm, dp_comm_s=dp_comm, optimizer_s=max(0.0, step - pipeline - dp_comm),
        num_microbatches=M,
        param_bytes=int(sum(costs.param_bytes[a:b]) + sum(costs.grad_bytes[a:b])),
        optimizer_bytes=int(sum(costs.optimizer_bytes[a:b])),
        activation_bytes=int(math.ceil(mem[worst] - sum(costs.static_bytes[a:b]))),
    )
    full = [sum(costs.forward_s[a:b]) + sum(costs.backward_s[a:b]) for a, b in bounds]
    return SplitEvaluation(estimate=estimate, stage_times_s=tuple(x + y for x, y in zip(f, bw)),
                           stage_memory_bytes=tuple(mem), bottleneck_s=max(full), cut_bytes=int(sum(cuts)))


# -- the stage split ----------------------------------------------------------------------------------------

def fewest_bytes_split(costs: LayerCosts, layout: Layout, capacity: float,
                       max_stage_s: float) -> tuple[int, ...] | None:
    """Among splits whose every stage takes at most ``max_stage_s`` (whole batch, one device, forward plus backward)
    and fits ``capacity``, the one whose cuts carry the fewest bytes, lexicographically first among those; None
    when there is none. Dynamic programming over (stage, first layer)."""
    S = layout.num_stages
    starts = _unit_starts(costs)
    U = len(starts)
    edges = starts + [costs.num_layers]
    t_pre, s_pre, a_pre = [0.0], [0.0], [0.0]
    for l in range(costs.num_layers):
        t_pre.append(t_pre[-1] + costs.forward_s[l] + costs.backward_s[l])
        s_pre.append(s_pre[-1] + costs.static_bytes[l])
        a_pre.append(a_pre[-1] + costs.activation_bytes[l])
    scale = layout.examples_per_device / layout.batch_size
    in_flight = layout.in_flight()
    cap_t = max_stage_s * (1 + _TIE) + 1e-15

    def ok(s: int, i: int, j: int) -> bool:  # stage s = units i..j-1
        a, b = edges[i], edges[j]
        return (t_pre[b] - t_pre[a] <= cap_t
                and s_pre[b] - s_pre[a] + in_flight[s] * scale * (a_pre[b] - a_pre[a]) <= capacity)

    inf = math.inf
    # best[s][i]: fewest bytes to place units i..U-1 on stages s..S-1, stage s beginning at unit i.
    best = [[inf] * (U + 1) for _ in range(S)]
    nxt = [[-1] * (U + 1) for _ in range(S)]
    for i in range(U):
        if ok(S - 1, i, U):
            best[S - 1][i] = 0.0
    for s in range(S - 2, -1, -1):
        for i in range(U):
            for j in range(i + 1, U - (S - 2 - s)):
                if best[s + 1][j] == inf or not ok(s, i, j):
                    continue
                c = costs.cut_bytes[edges[j] - 1] + best[s + 1][j]
                if c < best[s][i]:  # strict: the smallest j wins ties (lexicographically first starts)
                    best[s][i], nxt[s][i] = c, j
    if best[0][0] == inf:
        return None
    out, i = [0], 0
    for s in range(S - 1):
        i = nxt[s][i]
        out.append(edges[i])
    return tuple(out)


def _merged(costs: LayerCosts) -> tuple[list[list[float]], list[float], list[int]]:
    """Per unit (layers between two places a stage may begin): time, static bytes, activation bytes."""
    starts = _unit_starts(costs)
    ends = starts[1:] + [costs.num_layers]
    static = costs.static_bytes
    t = [sum(costs.forward_s[a:b]) + sum(costs.backward_s[a:b]) for a, b in zip(starts, ends)]
    return [t], [float(sum(static[a:b])) for a, b in zip(starts, ends)], [
        sum(costs.activation_bytes[a:b]) for a, b in zip(starts, ends)]


# -- the search ---------------------------------------------------------------------------------------------

def plan_layers(costs: LayerCosts, cluster: Cluster, num_devices: int, batch_size: int, *,
                schedules: Sequence[str] = RUNNABLE_SCHEDULES, num_stages: int | None = None,
                num_microbatches: int | None = None, time_limit_s: float = 10.0) -> LocalPlan:
    """:func:`plan_local` on plain per-layer costs (see the module doc for the search space and cost model);
    ``cluster`` supplies the device (memory, links) and must have at least ``num_devices`` devices."""
    t0 = time.perf_counter()
    n = num_devices
    for name, value in (("num_devices", n), ("batch_size", batch_size)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"plan_local: {name} must be a positive int, got {value!r} ({type(value).__name__}).")
        if value < 1:
            raise ValueError(f"plan_local: {name} must be a positive int, got {value}; pass e.g. {name}=1.")
    if n > cluster.num_devices:
        raise ValueError(f"plan_local: num_devices={n} exceeds the {cluster.num_devices} devices of {cluster}; "
                         f"profile with a cluster of at least {n} devices.")
    unknown = [s for s in schedules if s not in RUNNABLE_SCHEDULES]
    if unknown or not schedules:
        raise ValueError(f"plan_local: schedules {list(schedules)} must be a non-empty selection of the runnable "
                         f"{RUNNABLE_SCHEDULES}; pass e.g. schedules=('1f1b',).")
    layouts = legal_layouts(costs, n, batch_size, schedules=schedules, num_stages=num_stages,
                            num_microbatches=num_microbatches)
    if not layouts:
        raise ValueError(_no_layout_message(costs, n, batch_size, num_stages, num_microbatches))
    capacity = cluster.device.memory_capacity
    unit_time, unit_static, unit_act = _merged(costs)
    loose: dict[int, object] = {}  # per S: CP-SAT without memory pressure (its bottleneck is a lower bound)
    solved: dict[tuple, object] = {}
    best = None  # (evaluation, layout, starts, status, gap)
    best_uniform = math.inf
    smallest_memory = None  # (bytes, layout) of the least memory-hungry layout (equal split), for the error
    for layout in layouts:
        S = layout.num_stages
        scale = layout.examples_per_device / layout.batch_size
        in_flight = layout.in_flight()
        if S not in loose:
            # Nothing in flight and room for every parameter: the fastest split regardless of memory.
            loose[S] = assign_stages(unit_time, [unit_act], unit_static, S, [0] * S, sum(unit_static) + 1,
                                     time_limit_s=time_limit_s)
        sol = loose[S]
        split = fewest_bytes_split(costs, layout, capacity, sol.bottleneck_s) if sol is not None else None
        if split is None:
            key = (S, in_flight, scale)
            if key not in solved:
                solved[key] = assign_stages(unit_time, [[a * scale for a in unit_act]], unit_static, S,
                                            list(in_flight), capacity, time_limit_s=time_limit_s)
            sol = solved[key]
            if sol is not None:
                split = fewest_bytes_split(costs, layout, capacity, sol.bottleneck_s)
        candidates = []
        if split is not None:
            candidates.append((evaluate(costs, cluster, layout, split), split, sol.status, sol.gap))
        uni = uniform_split(costs, S)
        uni_eval = evaluate(costs, cluster, layout, uni)
        if uni_eval.estimate.fits:
            best_uniform = min(best_uniform, uni_eval.estimate.step_time_s)
            if not candidates or uni_eval.estimate.step_time_s < candidates[0][0].estimate.step_time_s * (1 - _TIE):
                candidates = [(uni_eval, uni, "UNIFORM", 0.0)]
        if not candidates:
            need = max(stage_memory(costs, layout, uni))
            if smallest_memory is None or need < smallest_memory[0]:
                smallest_memory = (need, layout)
            continue
        cand = candidates[0]
        if best is None or cand[0].estimate.step_time_s < best[0].estimate.step_time_s * (1 - _TIE):
            best = (cand[0], layout, cand[1], cand[2], cand[3])
    if best is None:
        need, lay = smallest_memory
        raise ValueError(
            f"plan_local: the step fits on no layout of {n} device(s) with {capacity / 2**30:.3g} GiB each: the "
            f"least memory-hungry one ({lay.num_stages} stage(s), {lay.num_microbatches} microbatch(es), "
            f"{lay.schedule}) needs {need / 2**30:.3g} GiB per device with an equal split of its layers. Use more "
            "devices (more stages share out the parameters and optimizer state) or a smaller model or batch.")
    ev, layout, split, status, gap = best
    bounds = _bounds(costs, split)
    return LocalPlan(
        num_stages=layout.num_stages, devices_per_stage=layout.devices_per_stage,
        num_microbatches=layout.num_microbatches,
        microbatch_size=layout.batch_size // (layout.num_microbatches * layout.devices_per_stage),
        schedule=layout.schedule, stage_layers=tuple((a, b - 1) for a, b in bounds), predicted=ev.estimate,
        stage_times_s=ev.stage_times_s, stage_memory_bytes=ev.stage_memory_bytes, solver_status=status,
        optimality_gap=float(gap), candidates=len(layouts), best_uniform_step_time_s=best_uniform,
        wall_time_s=time.perf_counter() - t0,
    )


def plan_local(profile: Profile, num_devices: int, batch_size: int, *,
               schedules: Sequence[str] = RUNNABLE_SCHEDULES, num_stages: int | None = None,
               num_microbatches: int | None = None, cuttable: Sequence[bool] | None = None,
               time_limit_s: float = 10.0) -> LocalPlan:
    """Choose stages, microbatches, schedule and stage split for ``num_devices`` devices of the profile's cluster
    from a profile of the step at batch size ``batch_size`` (measured on the local device for a plan that
    matches the hardware: ``profile(..., measure=True)``).

    ``num_stages`` / ``num_microbatches`` fix that choice; ``schedules`` limits the schedules tried;
    ``cuttable`` (one flag per position between two layers) forbids stage boundaries (default: inside a
    ``lax.scan``). Raises ValueError when no layout is legal or none fits the devices' memory.
    """
    if not isinstance(profile, Profile):
        raise TypeError(f"plan_local: profile must be an autopp.profiler.Profile, got {type(profile).__name__}; "
                        "make one with autopp.profiler.profile(step, *args, measure=True).")
    costs = LayerCosts.from_profile(profile, cuttable)
    return plan_layers(costs, profile.cluster, num_devices, batch_size, schedules=schedules,
                       num_stages=num_stages, num_microbatches=num_microbatches, time_limit_s=time_limit_s)


def _no_layout_message(costs: LayerCosts, n: int, batch: int, num_stages, num_microbatches) -> str:
    units = len(_unit_starts(costs))
    stages = [S for S in _divisors(n) if S <= units and (num_stages is None or S == num_stages)]
    if not stages:
        return (f"plan_local: no pipeline layout on {n} device(s): the number of stages must divide {n} and be at "
                f"most the {units} place(s) the model can be cut" + (f" (num_stages={num_stages})" if num_stages
                                                                      else "") + "; pass fewer devices, e.g. "
                f"devices=jax.devices()[:{max(S for S in _divisors(n) if S <= units)}].")
    d = n // max(stages)
    return (f"plan_local: no pipeline layout for batch size {batch} on {n} device(s): the model can be cut into at "
            f"most {max(stages)} stage(s) that divide the devices evenly, so every stage has at least {d} devices "
            f"and a microbatch must split evenly over them (batch / microbatches a multiple of {d}"
            + (f", microbatches={num_microbatches}" if num_microbatches else "") + f"). Use a batch size that is a "
            f"multiple of {d}, or pass fewer devices, e.g. devices=jax.devices()[:{max(stages)}].")

"""The intra-operator sharding ILP of one layer (CP-SAT), and the layer's costs under its solution.

:func:`solve` picks one strategy per node of a :class:`~autopp.profiler._strategy_graph.StrategyGraph` minimising the
layer's per-microbatch time on one device of the tensor group: each node's compute (its roofline time, divided by
``t`` when the strategy splits it) plus, on every edge, the collective that turns the producer's layout into the
one the consumer needs (all-gather, all-reduce, reduce-scatter, all-to-all; free when a replicated value is only
sliced locally), on the link inside a node. A parameter node also receives its gradient: the gradient must end in
the parameter's own layout. Memory breaks ties (a megabyte of parameters, or of residuals the backward keeps, on
each device weighs as a nanosecond), except that under sequence parallelism residuals come first
(:data:`LEAN_NS_PER_MB`).

The ILP has one boolean per (node, strategy) and, per edge, one non-negative cost variable bounded below by
``cost(a, b) * (producer gives a + consumer needs b - 1)`` for every pair of layouts with a positive cost. A layer
is solved once per distinct structure (fingerprint), tensor degree and boundary layout; :func:`brute_force` solves
small graphs by enumeration (tests).

:func:`layer_cost` turns a solution into what the step's cost model needs: the layer's forward and backward
kernels (per device, split into batch-proportional and fixed parts), its collectives, the bytes its backward keeps
(with and without the attention core), its parameters' layouts and their bytes per device.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from collections.abc import Sequence

from ortools.sat.python import cp_model

from jax.extend import core as jex_core

from autopp.profiler import (
    Cluster,
    KernelTimeModel,
    OpCost,
    OpNode,
    PARTIAL,
    REPLICATED,
    ScaledKernel,
    StrategyGraph,
    aval_bytes,
    eqn_cost,
    matmul_dtype,
    output_spec,
    program_kernels,
    ring_seconds,
    spec_name,
)

Literal = jex_core.Literal
_NS = 1e-9
_MB = 2**20
LEAN_NS_PER_MB = 1e5
"""The weight of activation memory in a sequence-parallel layer's sharding ILP: a megabyte of residuals kept per
device outweighs 100 us, more than any collective of the layer takes to move it (so the layout keeps the fewest
bytes, the fastest among those)."""


@dataclasses.dataclass(frozen=True)
class ShardingSolution:
    """The chosen strategy of every node of a strategy graph."""

    graph: StrategyGraph
    choice: tuple[int, ...]
    """Index into ``graph.nodes[k].strategies`` per node."""
    objective_s: float
    """The ILP's objective: the layer's time per microbatch under its cost model (compute plus resharding, traced
    batch) plus memory at the solve's weight (a nanosecond per megabyte by default, :data:`LEAN_NS_PER_MB` under
    sequence parallelism): not a time then; :func:`layer_cost` gives the layer's times."""
    status: str
    """CP-SAT status (``OPTIMAL``, ``FEASIBLE``) or ``TRIVIAL`` (t = 1) or ``ENUMERATED``."""
    gap: float
    """Relative optimality gap."""
    wall_time_s: float
    """Seconds to build and solve."""

    def spec_of(self, var) -> int:
        """The layout of a program variable."""
        g = self.graph
        k = g.producer[var]
        node = g.nodes[k]
        return output_spec(g, node, node.strategies[self.choice[k]], var)


def reshard_kind(src: int, dst: int) -> str | None:
    """The collective that turns layout ``src`` into ``dst`` (None: nothing to do)."""
    if src == dst or dst == PARTIAL or src == REPLICATED:
        return None  # same layout; a partial sum or a split of a replicated value is a local operation
    if src == PARTIAL:
        return "all-reduce" if dst == REPLICATED else "reduce-scatter"
    return "all-gather" if dst == REPLICATED else "all-to-all"  # a split becomes whole, or split elsewhere


def collective_seconds(kind: str, nbytes: float, t: int, cluster: Cluster) -> float:
    """Time of a tensor-group collective over ``t`` devices of one node (``nbytes``: the whole value)."""
    if t == 1 or nbytes <= 0:
        return 0.0
    if kind == "all-to-all":  # each device keeps 1/t of its block and sends the rest: (t-1)/t of bytes/t
        dev = cluster.device
        return ((t - 1) / t * nbytes / t / (dev.intra_node_bandwidth * dev.intra_node_efficiency)
                + (t - 1) * dev.intra_node_latency)
    return ring_seconds(kind, nbytes, t, cluster, False)


class _Scale:
    """Bytes and FLOPs at ``scale`` times the traced batch: batch-sized values and batch-dependent equations scale,
    the rest does not."""

    def __init__(self, graph: StrategyGraph, scale: float):
        self.prog, self.scale = graph.program, scale

    def bytes(self, v) -> float:
        return aval_bytes(v.aval) * (self.scale if v in self.prog.batch_vars else 1.0)

    def flops(self, i: int) -> float:
        return self.scale if i in self.prog.dependent_eqns else 1.0


def _eqn_seconds(eqn, i: int, tm: KernelTimeModel, sc: _Scale) -> float:
    c = eqn_cost(eqn)
    io = sum(sc.bytes(a) for a in eqn.invars if not isinstance(a, Literal)) + sum(sc.bytes(v) for v in eqn.outvars)
    c = OpCost(c.flops * sc.flops(i), c.transcendentals * sc.flops(i), io, 0.0)
    if eqn.primitive.name in ("dot_general", "conv_general_dilated"):
        return tm.kernel_time("matmul", c, matmul_dtype(eqn), floor=False)
    return tm.kernel_time("fused", c, None, floor=False)


def node_seconds(graph: StrategyGraph, node: OpNode, strategy, tm: KernelTimeModel, cluster: Cluster,
                 scale: float = 1.0) -> float:
    """Compute time of a node under a strategy at ``scale`` times the traced batch (its work divided by t where
    split), plus the reshardings inside a fused group."""
    t = graph.t
    sc = _Scale(graph, scale)
    if node.kind == "group":
        j = graph.program.closed.jaxpr
        ext, outs = set(node.invars), set(node.outvars)
        flops = trans = traffic = 0.0
        for i, split in zip(node.eqns, strategy.members):
            e = j.eqns[i]
            share = 1.0 / t if split else 1.0
            c = eqn_cost(e)
            flops += c.flops * share * sc.flops(i)
            trans += c.transcendentals * share * sc.flops(i)
            traffic += share * (sum(sc.bytes(a) for a in e.invars if not isinstance(a, Literal) and a in ext)
                                + sum(sc.bytes(v) for v in e.outvars if v in outs))
        sec = tm.kernel_time("fused", OpCost(flops, trans, traffic, 0.0), None, floor=False)
        for var, a, b in strategy.internal:
            kind = reshard_kind(a, b)
            if kind is not None:
                sec += collective_seconds(kind, sc.bytes(var), t, cluster)
        return sec
    if node.kind not in ("op", "attention"):
        return 0.0
    j = graph.program.closed.jaxpr
    if node.kind == "attention":
        region = next(r for r, g in enumerate(graph.program.attention_regions) if g == node.eqns)
        fwd = [i for i in node.eqns if i not in graph.program.backward_eqns]
        bwd = [i for i in node.eqns if i in graph.program.backward_eqns]
        total = 0.0
        for part in (fwd, bwd):
            if part:
                ks = program_kernels(j, part, is_batch=lambda v: True, dependent=lambda i: True,
                                     regions=[tuple(part)],
                                     work=[graph.program.region_work[region]],
                                     backward_eqns=graph.program.backward_eqns)
                total += sum(tm.kernel_time(k.kind, k.at(scale), k.dtype, work=k.work, floor=False) for k in ks)
    else:
        total = _eqn_seconds(j.eqns[node.eqns[0]], node.eqns[0], tm, sc)
    return total / t if strategy.split else total


def _residuals(prog) -> set:
    """What the backward keeps: forward values (and layer inputs) read by backward equations, not an attention
    region's internals read inside it (a fused kernel recomputes those)."""
    j = prog.closed.jaxpr
    region_of = {i: r for r, eqs in enumerate(prog.attention_regions) for i in eqs}
    internal = {v for eqs in prog.attention_regions for i in eqs for v in j.eqns[i].outvars}
    forward = {v for i, e in enumerate(j.eqns) if i not in prog.backward_eqns for v in e.outvars}
    forward.update(j.invars[:prog.num_inputs])
    return {a for i in prog.backward_eqns for a in j.eqns[i].invars
            if not isinstance(a, Literal) and a in forward and not (a in internal and i in region_of)}


def kept_values(graph: StrategyGraph) -> dict[int, list]:
    """Node index -> the batch-sized residuals it defines (:func:`_residuals`), whose bytes per device follow the
    node's strategy (split values keep ``1/t`` of them)."""
    prog = graph.program
    read = {v for v in _residuals(prog) if v in prog.batch_vars}
    out: dict[int, list] = {}
    for k, node in enumerate(graph.nodes):
        mine = [v for v in (node.defined if node.kind == "group" else node.outvars) if v in read]
        if mine:
            out[k] = mine
    return out


def _spec_under(graph: StrategyGraph, node: OpNode, strategy, var) -> int:
    if node.kind == "group":
        return strategy.defined[node.defined.index(var)]
    return output_spec(graph, node, strategy, var)


class _Costs:
    """Integer costs (nanoseconds) of a graph's nodes and edges. ``memory_ns_per_mb``: what a megabyte of
    residuals kept on each device weighs against time (see :func:`solve`); a parameter's megabyte weighs a
    nanosecond."""

    def __init__(self, graph: StrategyGraph, tm: KernelTimeModel, cluster: Cluster, scale: float = 1.0,
                 memory_ns_per_mb: float = 1.0):
        self.graph, t = graph, graph.t
        self.node: list[list[int]] = []
        sc = _Scale(graph, scale)
        kept = kept_values(graph)
        for k, node in enumerate(graph.nodes):
            row = []
            full = None
            for s in node.strategies:
                if node.kind == "group":
                    sec = node_seconds(graph, node, s, tm, cluster, scale)
                else:
                    if full is None:
                        full = node_seconds(graph, node, dataclasses.replace(s, split=False), tm, cluster, scale)
                    sec = full / t if s.split else full
                mem = 0.0
                if node.kind == "param":
                    mem = aval_bytes(node.outvars[0].aval) / (t if s.out >= 0 else 1)
                kept_bytes = sum(sc.bytes(v) / (t if _spec_under(graph, node, s, v) >= 0 else 1)
                                 for v in kept.get(k, ()))
                row.append(int(round(sec / _NS)) + int(round(mem / _MB))
                           + int(round(kept_bytes / _MB * memory_ns_per_mb)))
            self.node.append(row)
        self.var_bytes = {v: int(sc.bytes(v)) for v in graph.producer}
        self._cache: dict = {}
        self.t, self.cluster = t, cluster

    def edge(self, src: int, dst: int, nbytes: int) -> int:
        key = (src, dst, nbytes)
        hit = self._cache.get(key)
        if hit is None:
            kind = reshard_kind(src, dst)
            # one more nanosecond per collective: of two layouts that move the same bytes, the one with fewer
            # collectives wins (a norm's scale stays whole rather than gathered forward and scattered backward)
            hit = 0 if kind is None else int(round(collective_seconds(kind, nbytes, self.t, self.cluster) / _NS)) + 1
            self._cache[key] = hit
        return hit


def _edges(graph: StrategyGraph):
    """(var, producer, consumer node, position) for every read of a produced value."""
    for var, uses in graph.consumers.items():
        if var not in graph.producer:
            continue
        for n, pos in uses:
            yield var, graph.producer[var], n, pos


def _backward_vars(graph: StrategyGraph) -> set:
    prog = graph.program
    j = prog.closed.jaxpr
    out = set(j.invars[prog.num_inputs:])
    for i in prog.backward_eqns:
        out.update(j.eqns[i].outvars)
    return out


def _reads(graph: StrategyGraph) -> dict:
    """``(var, in backward pass) -> [(producer, consumer node, position)]``: a value resharded to one layout is
    resharded once per pass, however many operations of that pass read it (the forward and the backward are
    separate programs, so a backward read reshards again)."""
    bwd_vars = _backward_vars(graph)
    out: dict = {}
    for var, p, n, pos in _edges(graph):
        node = graph.nodes[n]
        if node.kind == "attention":
            backward = var in bwd_vars
        elif node.kind in ("param", "input"):
            backward = True
        elif node.kind == "output":
            backward = False
        else:
            backward = node.backward
        out.setdefault((var, backward), []).append((p, n, pos))
    return out


def total_seconds(graph: StrategyGraph, choice: Sequence[int], tm: KernelTimeModel, cluster: Cluster,
                  costs: _Costs | None = None, scale: float = 1.0) -> float:
    """The ILP's objective for an assignment, in seconds (memory tie-break included), at ``scale`` times the traced
    batch."""
    costs = costs or _Costs(graph, tm, cluster, scale)
    total = sum(costs.node[k][c] for k, c in enumerate(choice))
    for (var, _), uses in _reads(graph).items():
        p = uses[0][0]
        a = output_spec(graph, graph.nodes[p], graph.nodes[p].strategies[choice[p]], var)
        needs = {graph.nodes[n].strategies[choice[n]].ins[pos] for _, n, pos in uses}
        total += sum(costs.edge(a, b, costs.var_bytes[var]) for b in needs if b is not None)
    return total * _NS


def solve(graph: StrategyGraph, tm: KernelTimeModel, cluster: Cluster, *, scale: float = 1.0,
          time_limit_s: float = 10.0, workers: int = 1, memory_ns_per_mb: float = 1.0) -> ShardingSolution:
    """The cheapest strategy per node (CP-SAT), with costs at ``scale`` times the traced batch. The residuals the
    backward keeps weigh ``memory_ns_per_mb`` nanoseconds per megabyte on each device (a parameter's megabyte weighs
    one): by default memory only breaks ties; :data:`LEAN_NS_PER_MB` makes the layout keep the fewest activation
    bytes first (sequence parallelism as Megatron-LM lays it out: every value the backward keeps is split, and a
    norm's output is gathered again in the backward rather than kept whole)."""
    t0 = time.perf_counter()
    nodes = graph.nodes
    costs = _Costs(graph, tm, cluster, scale, memory_ns_per_mb)
    if graph.t == 1 or all(len(n.strategies) == 1 for n in nodes):
        choice = tuple(0 for _ in nodes)
        return ShardingSolution(graph, choice, total_seconds(graph, choice, tm, cluster, costs), "TRIVIAL", 0.0,
                                time.perf_counter() - t0)
    m = cp_model.CpModel()
    x = [[m.NewBoolVar("") for _ in n.strategies] for n in nodes]
    objective = []
    for k, row in enumerate(costs.node):
        m.AddExactlyOne(x[k])
        for i, c in enumerate(row):
            if c:
                objective.append(c * x[k][i])
    for (var, _), uses in _reads(graph).items():
        p = uses[0][0]
        node = nodes[p]
        give: dict[int, list[int]] = {}
        for i, st in enumerate(node.strategies):
            give.setdefault(output_spec(graph, node, st, var), []).append(i)
        nbytes = costs.var_bytes[var]
        needs = []  # per consumer: layout -> its strategies needing it
        for _, n, pos in uses:
            need: dict = {}
            for i, st in enumerate(nodes[n].strategies):
                if st.ins[pos] is not None:
                    need.setdefault(st.ins[pos], []).append(i)
            needs.append((n, need))
        targets = {b for _, need in needs for b in need}
        cost = {(a, b): costs.edge(a, b, nbytes) for a in give for b in targets}
        if not any(cost.values()):
            continue
        if len(uses) == 1:
            n, need = needs[0]
            if len(give) == 1 or len(need) == 1:  # one side fixed: the cost is linear in the other's choice
                for (a, b), c in cost.items():
                    if c:
                        ks, xs = (give[a], x[p]) if len(need) == 1 else (need[b], x[n])
                        objective.extend(c * xs[k] for k in ks)
                continue
            # the pair (producer gives a, consumer needs b) as booleans whose marginals are the two choices: the
            # tightest linear relaxation of a pairwise cost (the local marginal polytope)
            full = dict(need)
            w = {(a, b): m.NewBoolVar("") for a in give for b in full}
            for a, ks in give.items():
                m.Add(sum(w[a, b] for b in full) == sum(x[p][k] for k in ks))
            for b, ks in full.items():
                m.Add(sum(w[a, b] for a in give) == sum(x[n][k] for k in ks))
            objective.extend(c * w[ab] for ab, c in cost.items() if c)
            continue
        # several readers in one pass: the value is resharded to a layout once if any reader needs it
        for b in targets:
            if not any(cost[a, b] for a in give):
                continue
            u = m.NewBoolVar("")
            for n, need in needs:
                if b in need:
                    m.Add(u >= sum(x[n][k] for k in need[b]))
            for a, ks in give.items():
                c = cost[a, b]
                if not c:
                    continue
                if len(give) == 1:
                    objective.append(c * u)
                else:
                    w = m.NewBoolVar("")
                    m.Add(w >= sum(x[p][k] for k in ks) + u - 1)
                    objective.append(c * w)
    m.Minimize(sum(objective))
    for row in x:  # hint: everything replicated (always feasible)
        for i, var in enumerate(row):
            m.AddHint(var, i == 0)
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = time_limit_s
    solver.parameters.num_workers = workers
    # The marginal-polytope encoding makes the LP relaxation tight: with the LP at every node and no presolve,
    # one worker proves optimality in tens of milliseconds where the default presolve alone takes seconds.
    solver.parameters.cp_model_presolve = False
    solver.parameters.linearization_level = 2
    status = solver.Solve(m)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        raise RuntimeError(f"sharding ILP: CP-SAT returned {solver.StatusName(status)} for a model that always has "
                           "a solution (everything replicated); this is a bug in autopp.")
    choice = tuple(next(i for i, var in enumerate(row) if solver.Value(var)) for row in x)
    obj, bound = solver.ObjectiveValue(), solver.BestObjectiveBound()
    return ShardingSolution(graph, choice, total_seconds(graph, choice, tm, cluster, costs), solver.StatusName(status),
                            (obj - bound) / obj if obj else 0.0, time.perf_counter() - t0)


def brute_force(graph: StrategyGraph, tm: KernelTimeModel, cluster: Cluster, *, scale: float = 1.0,
                limit: int = 2_000_000, memory_ns_per_mb: float = 1.0) -> ShardingSolution:
    """The cheapest assignment by enumerating every combination of strategies (small graphs only)."""
    t0 = time.perf_counter()
    costs = _Costs(graph, tm, cluster, scale, memory_ns_per_mb)
    sizes = [len(n.strategies) for n in graph.nodes]
    if math.prod(sizes) > limit:
        raise ValueError(f"brute_force: {math.prod(sizes)} combinations exceed limit={limit}.")
    best, best_choice = math.inf, None
    for choice in itertools.product(*[range(n) for n in sizes]):
        c = total_seconds(graph, choice, tm, cluster, costs)
        if c < best - 1e-15:
            best, best_choice = c, choice
    return ShardingSolution(graph, tuple(best_choice), best, "ENUMERATED", 0.0, time.perf_counter() - t0)


# ---------------------------------------------------------------------------------------------------------
# The layer's costs under a solution


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective a layer runs per microbatch over its tensor group."""

    kind: str
    """``all-reduce``, ``all-gather``, ``reduce-scatter`` or ``all-to-all``."""
    batch_bytes: float
    """Bytes of the whole value at the traced batch that scale with the batch."""
    fixed_bytes: float
    """Bytes that do not (a parameter's gradient or a weight)."""
    backward: bool
    """Whether it runs in the backward pass."""
    what: str = ""
    """The value it moves (for reports)."""

    def seconds(self, scale: float, t: int, cluster: Cluster) -> float:
        return collective_seconds(self.kind, self.batch_bytes * scale + self.fixed_bytes, t, cluster)


@dataclasses.dataclass(frozen=True)
class LayerCost:
    """One layer per microbatch on one device of a tensor group of ``t``, at the traced batch (scale with
    :meth:`ScaledKernel.at` and the ``*_bytes`` pairs)."""

    t: int
    boundary: int
    """Layout of the activations entering and leaving the layer."""
    forward: tuple[ScaledKernel, ...]
    backward: tuple[ScaledKernel, ...]
    collectives: tuple[Collective, ...]
    residual_bytes: float
    """Batch-proportional bytes the backward keeps from the forward, per device (no recomputation)."""
    core_residual_bytes: float
    """Of those, the bytes of an unfused attention core (``s x s`` scores and probabilities): what selective
    recomputation drops."""
    core_forward: tuple[ScaledKernel, ...]
    """The attention core's forward kernels (selective recomputation re-runs them in the backward)."""
    input_bytes: float
    """Batch-proportional bytes of the layer's activation inputs per device (what full recomputation keeps)."""
    param_specs: dict
    """Layer input index -> layout of that parameter over the tensor axis."""
    param_bytes: dict
    """Layer input index -> bytes of that parameter per device."""
    solution: ShardingSolution

    @property
    def param_bytes_total(self) -> float:
        return float(sum(self.param_bytes.values()))


def layer_cost(solution: ShardingSolution) -> LayerCost:
    g = solution.graph
    prog = g.program
    j = prog.closed.jaxpr
    t = g.t
    spec = {v: solution.spec_of(v) for v in g.producer}
    for k, n in enumerate(g.nodes):  # the values inside a fused group
        if n.kind == "group":
            st = n.strategies[solution.choice[k]]
            for v, sp in zip(n.defined, st.defined):
                spec.setdefault(v, sp)
    share: dict[int, float] = {}
    for k, n in enumerate(g.nodes):
        st = n.strategies[solution.choice[k]]
        if n.kind == "group":
            for i, split in zip(n.eqns, st.members):
                share[i] = 1.0 / t if split else 1.0
        else:
            for i in n.eqns:
                share[i] = 1.0 / t if st.split else 1.0

    def eqn_share(i):
        return share.get(i, 1.0)

    def var_share(v):
        return 1.0 / t if spec.get(v, REPLICATED) >= 0 else 1.0

    is_batch = prog.batch_vars.__contains__
    fwd_ids = [i for i in range(len(j.eqns)) if i not in prog.backward_eqns]
    bwd_ids = [i for i in range(len(j.eqns)) if i in prog.backward_eqns]
    # Forward values computed from the batch whose batch dimension the strategies do not follow (tokens permuted by a
    # batch-dependent order, a mixture of experts' dispatched tokens [experts, capacity, d]) still grow with it: their
    # bytes scale, held whole on every device of the group (a user trial: MoE activations priced at 1/200).
    untracked = {v for i in fwd_ids if i in prog.dependent_eqns for v in j.eqns[i].outvars if not is_batch(v)}

    def scales(v) -> bool:
        return is_batch(v) or v in untracked

    kw = dict(is_batch=scales, dependent=prog.dependent_eqns.__contains__, eqn_share=eqn_share,
              var_share=var_share, regions=prog.attention_regions, work=prog.region_work,
              backward_eqns=prog.backward_eqns)
    forward = tuple(program_kernels(j, fwd_ids, **kw))
    backward = tuple(program_kernels(j, bwd_ids, **kw))
    collectives = []
    for (var, bwd), uses in _reads(g).items():
        needs = {g.nodes[n].strategies[solution.choice[n]].ins[pos] for _, n, pos in uses}
        for b in sorted(x for x in needs if x is not None):
            kind = reshard_kind(spec[var], b)
            if kind is None:
                continue
            nbytes = aval_bytes(var.aval)
            collectives.append(Collective(kind, nbytes if is_batch(var) else 0.0, 0.0 if is_batch(var) else nbytes,
                                          bwd, f"{var.aval.str_short()} {spec_name(spec[var])}->{spec_name(b)}"))
    for k, n in enumerate(g.nodes):
        if n.kind != "group":
            continue
        for var, a, b in n.strategies[solution.choice[k]].internal:
            kind = reshard_kind(a, b)
            if kind is not None:
                nbytes = aval_bytes(var.aval)
                collectives.append(Collective(kind, nbytes if is_batch(var) else 0.0,
                                              0.0 if is_batch(var) else nbytes, n.backward,
                                              f"{var.aval.str_short()} inside a fused group"))
    residuals = _residuals(prog)
    region_internal = {v for eqs in prog.attention_regions for i in eqs for v in j.eqns[i].outvars}
    extra = 0.0
    for eqs in prog.attention_regions:  # a flash kernel keeps its output and the softmax statistics
        outs = [v for i in eqs if i not in prog.backward_eqns for v in j.eqns[i].outvars
                if v not in region_internal or any(v in j.eqns[x].invars for x in range(len(j.eqns))
                                                    if x not in eqs)]
        for o in outs[:1]:
            shape = o.aval.shape
            extra += (aval_bytes(o.aval) + 4 * math.prod(shape[:-1])) * var_share(o)
    residual_bytes = extra + sum(aval_bytes(v.aval) * var_share(v) for v in residuals if scales(v))
    core = _attention_core(j, fwd_ids, prog)
    core_residuals = [v for v in residuals if v in core["vars"] and is_batch(v)]
    core_bytes = sum(aval_bytes(v.aval) * var_share(v) for v in core_residuals)
    core_forward = tuple(program_kernels(j, sorted(core["eqns"]), **kw)) if core["eqns"] else ()
    input_bytes = sum(aval_bytes(v.aval) * var_share(v) for v, kind in zip(j.invars, prog.input_kinds)
                      if kind in ("batch", "data"))
    params = {i: spec[v] for i, (v, kind) in enumerate(zip(j.invars, prog.input_kinds)) if kind == "param"}
    pbytes = {i: aval_bytes(j.invars[i].aval) * var_share(j.invars[i]) for i in params}
    return LayerCost(t=t, boundary=g.boundary_in, forward=forward, backward=backward,
                     collectives=tuple(collectives), residual_bytes=float(residual_bytes),
                     core_residual_bytes=float(core_bytes), core_forward=core_forward, input_bytes=float(input_bytes),
                     param_specs=params, param_bytes=pbytes, solution=solution)


def _attention_core(j, fwd_ids, prog) -> dict:
    """An unfused attention core: forward equations downstream of a matmul of two activations (the scores) and
    upstream of the next one (probabilities times values), and the values they define."""
    batch = prog.batch_vars
    params = {v for v, k in zip(j.invars, prog.input_kinds) if k == "param"}
    region_eqns = {i for g in prog.attention_regions for i in g}
    act_mm = [i for i in fwd_ids if i not in region_eqns and j.eqns[i].primitive.name == "dot_general"
              and all(a in batch and a not in params for a in j.eqns[i].invars if not isinstance(a, Literal))]
    eqns, vars_ = set(), set()
    pos = {i: k for k, i in enumerate(fwd_ids)}
    for a_idx, b_idx in zip(act_mm[::2], act_mm[1::2]):
        # equations between the two (in order) that descend from the first's output and feed the second
        down = set(j.eqns[a_idx].outvars)
        chain = [a_idx]
        for i in fwd_ids[pos[a_idx] + 1: pos[b_idx]]:
            if any(a in down for a in j.eqns[i].invars if not isinstance(a, Literal)):
                down.update(j.eqns[i].outvars)
                chain.append(i)
        if not any(a in down for a in j.eqns[b_idx].invars if not isinstance(a, Literal)):
            continue
        eqns.update(chain)
        vars_.update(v for i in chain for v in j.eqns[i].outvars)
    return {"eqns": eqns, "vars": vars_}

"""The strategy graph of one layer: the decisions of the intra-operator sharding ILP and the values that connect them.

:func:`build_graph` turns a :class:`~autopp.profiler._strategies.LayerProgram` into :class:`OpNode` s, each with
its list of strategies (:mod:`autopp.profiler._strategies`): a matmul is a node of its own; the other equations
connected by their values form *fused groups* (what XLA fuses into one kernel), one layout choice each, their
members' strategies following by propagation; a *fused attention region* (``jax.nn.dot_product_attention``, marked
at trace time, see :data:`autopp.core.FUSED_ATTENTION_SCOPE`) is one node: split by heads (keys and values split
too only when their heads divide), by batch, or replicated; the layer's parameters, activation inputs and outputs
are nodes too, with the boundary layouts of :func:`boundary_options`. An edge between a producer and a consumer
whose layouts differ costs a collective (a *resharding*); the ILP (:mod:`autopp.planner._sharding`) picks one
strategy per node.

Sequence parallelism (Korthikanti et al. 2022) is not a special case: the norm and elementwise operations between
two tensor-parallel matmuls simply take the strategy that splits the sequence dimension, and the all-reduce after
a row-parallel matmul becomes a reduce-scatter (``P`` to a split) followed later by an all-gather (a split to
``R``).
"""

from __future__ import annotations

import dataclasses
import math

import networkx as nx
from jax.extend import core as jex_core

from autopp.profiler._costs import aval_bytes
from autopp.profiler._strategies import (
    PARTIAL,
    REPLICATED,
    LayerProgram,
    Strategy,
    _float,
    _shape,
    _splittable,
    eqn_strategies,
)

Literal = jex_core.Literal


@dataclasses.dataclass
class OpNode:
    """A decision of the ILP: one equation, a fused attention region, or a program input."""

    index: int
    kind: str
    """``op`` (a matmul), ``group`` (a fused group of other equations connected by their values: one layout
    choice for all of them, their strategies following by propagation), ``attention`` (a fused attention region),
    ``param`` (a parameter input, which also receives its gradient), ``input`` (an activation input, also
    receiving its gradient), ``const``, or ``output`` (a forward output, which also produces its cotangent
    input)."""
    eqns: tuple[int, ...]
    """Equation indices of the program this node runs (empty for inputs and outputs)."""
    invars: tuple
    """Values the node reads (program variables), aligned with each strategy's ``ins``."""
    outvars: tuple
    """Values the node defines."""
    strategies: list[Strategy]
    backward: bool = False
    """Whether the node belongs to the backward pass (depends on a cotangent)."""
    defined: tuple = ()
    """For a fused group: every value its members define (its outputs and its internal values)."""
    ref: int | None = None
    """For ``param``/``input``/``const``: the program invar index; for ``output``: the forward output index."""


@dataclasses.dataclass
class StrategyGraph:
    """Every decision of one layer's sharding ILP and the values that connect them."""

    program: LayerProgram
    t: int
    """Devices of the tensor axis."""
    nodes: list[OpNode]
    producer: dict
    """Variable -> index of the node that defines it."""
    consumers: dict
    """Variable -> list of ``(node index, position in the node's invars)``."""
    boundary_in: int
    """Spec of the layer's batch-dependent activation inputs (and of their gradients)."""
    boundary_out: int
    """Spec of the layer's forward outputs (and of their cotangents)."""
    node_of_eqn: dict[int, int]


def dual(spec: int) -> int:
    """The layout of the gradient of a value laid out as ``spec``: a split stays, replicated and partial values
    get whole gradients."""
    return spec if spec >= 0 else REPLICATED


def boundary_options(program: LayerProgram, t: int) -> list[int]:
    """Specs the layer's activation inputs and outputs may take: replicated, or split along a non-leading
    dimension that every batch-dependent floating input and output has and ``t`` divides (the sequence, for a
    transformer's residual stream: sequence parallelism)."""
    j = program.closed.jaxpr
    shapes = [_shape(v) for v, k in zip(j.invars[:program.num_inputs], program.input_kinds)
              if k == "batch" and _float(v.aval)]
    shapes += [_shape(j.outvars[k]) for k in program.ct_outputs if _shape(j.outvars[k])]
    opts = [REPLICATED]
    if t > 1 and shapes:
        rank = min(len(s) for s in shapes)
        for d in range(1, rank):
            if all(_splittable(s, d, t) for s in shapes):
                opts.append(d)
    return opts


def build_graph(program: LayerProgram, t: int, boundary_in: int = REPLICATED,
                boundary_out: int | None = None, *, cache: dict | None = None) -> StrategyGraph:
    """The strategy graph of ``program`` over ``t`` devices with the given boundary layouts (a layer's batch
    inputs arrive as ``boundary_in``; its forward outputs leave as ``boundary_out``, default the same).
    ``cache``: a dict kept per program across calls, for the fused groups' strategies (they do not depend on the
    boundary)."""
    if boundary_out is None:
        boundary_out = boundary_in
    j = program.closed.jaxpr
    n_in = program.num_inputs
    nodes: list[OpNode] = []
    producer: dict = {}
    grad_of_input = {program.grad_inputs[k]: j.outvars[program.num_outputs + k]
                     for k in range(len(program.grad_inputs))}

    # the values' batch dimensions that are the batch's own (not merged with another: tokens of a flattened
    # batch x sequence split by sequence positions, whatever the batch)
    sizes = [_shape(v)[program.batch_dim_of[v]] for v, kind in zip(j.invars[:n_in], program.input_kinds)
             if kind in ("batch", "data") and v in program.batch_dim_of]
    batch = min(sizes, default=None)
    bdim = {v: d for v, d in program.batch_dim_of.items() if _shape(v)[d] == batch}

    def new(kind, eqns, invars, outvars, strategies, backward=False, ref=None):
        if kind in ("op", "group", "attention"):
            strategies = _off_batch(invars, outvars, strategies, bdim)
        node = OpNode(len(nodes), kind, tuple(eqns), tuple(invars), tuple(outvars), strategies, backward, ref)
        nodes.append(node)
        for v in outvars:
            producer[v] = node.index
        return node

    # Inputs: parameters (receiving their gradient in the same layout), activations, constants.
    for i, (v, kind) in enumerate(zip(j.invars[:n_in], program.input_kinds)):
        g = grad_of_input.get(i)
        reads = () if g is None or isinstance(g, Literal) else (g,)
        shape = _shape(v)
        if kind == "param":
            specs = [REPLICATED] + [d for d in range(len(shape)) if _splittable(shape, d, t)]
        elif kind == "batch" and _float(v.aval) and shape:
            specs = [boundary_in if boundary_in == REPLICATED or _splittable(shape, boundary_in, t) else REPLICATED]
        else:
            specs = [REPLICATED]
        new(kind if kind in ("param", "const") else "input", (), reads, (v,),
            [Strategy(s, (dual(s),) * len(reads) if kind != "param" else (s,) * len(reads), False) for s in specs],
            ref=i)
    # Forward outputs, each producing its cotangent input.
    ct_vars = dict(zip(program.ct_outputs, j.invars[n_in:]))
    for k in range(program.num_outputs):
        o = j.outvars[k]
        if isinstance(o, Literal):
            continue
        spec = boundary_out if (boundary_out >= 0 and _splittable(_shape(o), boundary_out, t)) else REPLICATED
        ct = ct_vars.get(k)
        new("output", (), (o,), (ct,) if ct is not None else (), [Strategy(dual(spec), (spec,), False)], ref=k)
    # Equations: a matmul is a node of its own, a fused attention region is one node, and the other equations
    # connected by their values form fused groups (what XLA fuses into one kernel), one layout choice each.
    node_of_eqn: dict[int, int] = {}
    region_of: dict[int, int] = {}
    for r, g in enumerate(program.attention_regions):
        for i in g:
            region_of[i] = r
    groups = _fused_groups(j, region_of, program.backward_eqns)
    group_of = {i: k for k, g in enumerate(groups) for i in g}
    done_regions: set[int] = set()
    done_groups: set[int] = set()
    used_by: dict = {}
    for i, e in enumerate(j.eqns):
        for a in e.invars:
            if not isinstance(a, Literal):
                used_by.setdefault(a, set()).add(i)
    program_outs = {a for a in j.outvars if not isinstance(a, Literal)}
    for i, e in enumerate(j.eqns):
        r = region_of.get(i)
        if r is not None:
            if r in done_regions:
                continue
            done_regions.add(r)
            eqs = program.attention_regions[r]
            invars, outvars, strategies = _attention_node(j, eqs, t)
            node = new("attention", eqs, invars, outvars, strategies,
                       backward=any(x in program.backward_eqns for x in eqs))
            for x in eqs:
                node_of_eqn[x] = node.index
            continue
        k = group_of.get(i)
        if k is not None:
            if k in done_groups:
                continue
            done_groups.add(k)
            members = groups[k]
            inside = set(members)
            ext_in = []
            for x in members:
                for a in j.eqns[x].invars:
                    if not isinstance(a, Literal) and a not in ext_in and not any(
                            a in j.eqns[y].outvars for y in members if y < x):
                        ext_in.append(a)
            outs = [v for x in members for v in j.eqns[x].outvars
                    if v in program_outs or used_by.get(v, set()) - inside]
            key = ("group", t, members)
            strategies = None if cache is None else cache.get(key)
            if strategies is None:
                strategies = _group_strategies(j, members, ext_in, outs, t, program.dependent_eqns)
                if cache is not None:
                    cache[key] = strategies
            node = new("group", members, ext_in, outs, strategies,
                       backward=any(x in program.backward_eqns for x in members))
            node.defined = tuple(v for x in members for v in j.eqns[x].outvars)
            for x in members:
                node_of_eqn[x] = node.index
            continue
        node = new("op", (i,), [a for a in e.invars if not isinstance(a, Literal)], e.outvars,
                   _var_strategies(e, eqn_strategies(e, t)), backward=i in program.backward_eqns)
        node_of_eqn[i] = node.index
    consumers: dict = {}
    for node in nodes:
        for pos, v in enumerate(node.invars):
            consumers.setdefault(v, []).append((node.index, pos))
    return StrategyGraph(program=program, t=t, nodes=nodes, producer=producer, consumers=consumers,
                         boundary_in=boundary_in, boundary_out=boundary_out, node_of_eqn=node_of_eqn)


ANCHORS = frozenset({"dot_general", "conv_general_dilated"})
"""Equations that are nodes of their own; every other equation joins a fused group."""


def _fused_groups(j, region_of: dict, backward: frozenset = frozenset()) -> list[tuple[int, ...]]:
    """Connected groups of non-matmul equations outside attention regions (connected through a value one of them
    defines and another reads, both in the forward or both in the backward pass), in program order."""
    free = [i for i, e in enumerate(j.eqns) if e.primitive.name not in ANCHORS and i not in region_of]
    links = nx.Graph()
    links.add_nodes_from(free)
    defined_by = {}
    for i in free:
        for v in j.eqns[i].outvars:
            defined_by[v] = i
    for i in free:
        for a in j.eqns[i].invars:
            if not isinstance(a, Literal) and a in defined_by and (i in backward) == (defined_by[a] in backward):
                links.add_edge(i, defined_by[a])
    return sorted((tuple(sorted(g)) for g in nx.connected_components(links)), key=lambda g: g[0])


_REDUCE_WEIGHT = {"all-reduce": 2.0, "all-gather": 1.0, "reduce-scatter": 1.0}


def _costly(src: int, dst: int) -> str | None:
    if src == dst or dst == PARTIAL or src == REPLICATED:
        return None
    if src == PARTIAL:
        return "all-reduce" if dst == REPLICATED else "reduce-scatter"
    return "all-gather" if dst == REPLICATED else "all-to-all"


def _group_strategies(j, members: tuple[int, ...], ext_in: list, outs: list, t: int,
                      dependent: frozenset = frozenset()) -> list[Strategy]:
    """One strategy per layout ``sigma`` of the group's largest values (replicated, partial, or split along one of
    their dimensions). Replicated: every member replicated. Otherwise the members' strategies follow by propagation:
    a forward pass gives each member, in order, the strategy that keeps its largest outputs convertible to
    ``sigma`` for free, matches what its consumers inside the group prefer and needs the fewest bytes resharded
    (preferring one that splits its work); a backward pass then collects what each value's consumers prefer, and
    the forward pass runs again with that lookahead. Mismatches left inside the group become internal reshardings;
    the layouts its inputs need become the group's."""
    sizes = [(math.prod(_shape(v)), _shape(v)) for x in members for v in j.eqns[x].outvars]
    main = max(sizes)[1] if sizes else ()
    sigmas = [PARTIAL] + [d for d in range(len(main)) if _splittable(main, d, t)]
    per_eqn = {x: eqn_strategies(j.eqns[x], t) for x in members}
    ext_pos = {v: k for k, v in enumerate(ext_in)}
    defined = [v for x in members for v in j.eqns[x].outvars]
    rep = Strategy(REPLICATED, (REPLICATED,) * len(ext_in), False, outs=(REPLICATED,) * len(outs),
                   members=(False,) * len(members), internal=(), defined=(REPLICATED,) * len(defined))
    found: list[Strategy] = [rep]

    def natural(v, sigma):
        """The layout a value of the group's rank would take under sigma: split along the same dimension."""
        shape = _shape(v)
        if shape == main:
            return sigma
        if sigma >= 0 and len(shape) == len(main) and _splittable(shape, sigma, t):
            return sigma
        return None

    def forward(sigma, prefer):
        spec: dict = {}
        need = [None] * len(ext_in)
        internal, splits = [], []
        for x in members:
            e = j.eqns[x]
            best = None
            for st in per_eqn[x]:
                pen = 0.0
                for a, r in zip(e.invars, st.ins):
                    if r is None or isinstance(a, Literal):
                        continue
                    nbytes = aval_bytes(a.aval)
                    if a in spec:
                        kind = _costly(spec[a], r)
                        if kind is not None:
                            pen += _REDUCE_WEIGHT.get(kind, 1.0 / t) * nbytes
                    else:
                        k = ext_pos[a]
                        if need[k] is not None and _costly(need[k], r) is not None:
                            pen += nbytes
                        elif _shape(a) == main and _costly(sigma, r) is not None:
                            pen += nbytes
                        elif need[k] is None and a in prefer and r != prefer[a]:
                            pen += 0.01 * nbytes  # read an input the way the group's consumers would like it
                for v in e.outvars:
                    if _shape(v) == main and _costly(st.out, sigma) is not None:
                        pen += 2.0 * aval_bytes(v.aval)
                    elif v in prefer and _costly(st.out, prefer[v]) is not None:
                        pen += aval_bytes(v.aval)
                    elif v in prefer and st.out != prefer[v]:
                        pen += 0.01 * aval_bytes(v.aval)
                    elif v not in prefer and natural(v, sigma) is not None and st.out != natural(v, sigma):
                        pen += 0.01 * aval_bytes(v.aval)
                if x in dependent:  # splitting the batch's work pays; splitting a constant or a weight cast does not
                    if not st.split and t > 1:
                        pen += 0.1 * sum(aval_bytes(v.aval) for v in e.outvars)
                elif st.split:
                    pen += 1e-3
                if best is None or pen < best[0]:
                    best = (pen, st)
            st = best[1]
            splits.append(st.split)
            for a, r in zip(e.invars, st.ins):
                if r is None or isinstance(a, Literal):
                    continue
                if a in spec:
                    if _costly(spec[a], r) is not None:
                        internal.append((a, spec[a], r))
                else:
                    k = ext_pos[a]
                    if need[k] is None:
                        need[k] = r
                    elif _costly(need[k], r) is not None:
                        internal.append((a, need[k], r))
            for v in e.outvars:
                spec[v] = st.out
        return spec, need, internal, splits

    def backward(sigma, spec):
        """What each value's consumers inside the group prefer, given the current assignment."""
        prefer: dict = {}
        for x in reversed(members):
            e = j.eqns[x]
            want = [prefer.get(v, natural(v, sigma) if natural(v, sigma) is not None else spec.get(v))
                    for v in e.outvars]
            options = [st for st in per_eqn[x] if all(w is None or _costly(st.out, w) is None for w in want)]
            if not options:
                continue
            have = [None if isinstance(a, Literal) else spec.get(a) for a in e.invars]
            st = max(options, key=lambda st: (sum(h is not None and r is not None and _costly(h, r) is None
                                                  for h, r in zip(have, st.ins)), st.split))
            for a, r in zip(e.invars, st.ins):
                if r is not None and not isinstance(a, Literal) and a not in prefer:
                    prefer[a] = r
        return prefer

    for sigma in sigmas:
        prefer: dict = {}
        for _ in range(2):
            spec, need, internal, splits = forward(sigma, prefer)
            prefer = backward(sigma, spec)
        spec, need, internal, splits = forward(sigma, prefer)
        out_specs = tuple(spec[v] for v in outs)
        cand = Strategy(out_specs[0] if out_specs else REPLICATED,
                        tuple(REPLICATED if r is None else r for r in need), any(splits), outs=out_specs,
                        members=tuple(splits), internal=tuple(internal), defined=tuple(spec[v] for v in defined))
        if cand not in found:
            found.append(cand)
    return found


def _off_batch(invars, outvars, strategies: list[Strategy], bdim: dict) -> list[Strategy]:
    """``strategies`` without those that split a value along its batch dimension: over a tensor group every device
    takes the whole microbatch (splitting it is data parallelism, the data axis's), and whether the batch dimension
    divides by the tensor degree depends only on the batch the step was traced at (a user trial's MoE traced at batch
    4 was planned otherwise than at batch 1, with a split its microbatches of 2 cannot take)."""
    if not bdim:
        return strategies

    def splits_batch(st: Strategy) -> bool:
        outs = st.outs if st.outs is not None else (st.out,) * len(outvars)
        pairs = list(zip(invars, st.ins)) + list(zip(outvars, outs))
        return any(r is not None and r >= 0 and not isinstance(v, Literal) and bdim.get(v) == r for v, r in pairs)

    return [st for st in strategies if not splits_batch(st)] or strategies[:1]


def _var_strategies(eqn, strategies: list[Strategy]) -> list[Strategy]:
    """Strategies re-indexed to the equation's non-literal inputs (node invars), duplicates merged."""
    keep = [k for k, a in enumerate(eqn.invars) if not isinstance(a, Literal)]
    out: list[Strategy] = []
    for s in strategies:
        ns = Strategy(s.out, tuple(s.ins[k] for k in keep), s.split)
        if ns not in out:
            out.append(ns)
    return out


def _attention_node(j, eqns: tuple[int, ...], t: int):
    """Inputs, outputs and strategies of a fused attention region (``jax.nn.dot_product_attention``: q, k, v in
    ``(batch, seq, heads, head_dim)``; its output and the query's gradient shaped like q; k and v and their
    gradients shaped ``(batch, kv_seq, kv_heads, head_dim)``)."""
    inside = set(eqns)
    defined, reads = set(), []
    for i in eqns:
        for a in j.eqns[i].invars:
            if not isinstance(a, Literal) and a not in defined and a not in reads:
                reads.append(a)
        defined.update(j.eqns[i].outvars)
    reads = [a for a in reads if a not in defined]
    used_outside = set()
    for i, e in enumerate(j.eqns):
        if i not in inside:
            used_outside.update(a for a in e.invars if not isinstance(a, Literal))
    used_outside.update(a for a in j.outvars if not isinstance(a, Literal))
    outs = [v for i in eqns for v in j.eqns[i].outvars if v in used_outside]
    fwd_out = [v for v in outs if len(_shape(v)) == 4]
    q_shape = _shape(fwd_out[0]) if fwd_out else None
    rep = Strategy(REPLICATED, (REPLICATED,) * len(reads), False)
    strategies = [rep]
    if q_shape is None or t == 1:
        return reads, outs, strategies
    kv = [a for a in reads + outs if len(_shape(a)) == 4 and _shape(a) != q_shape]
    kv_shape = _shape(kv[0]) if kv else q_shape
    for d in (0, 2):  # batch, heads (keys and values split too when their heads divide, else replicated)
        if not _splittable(q_shape, d, t):
            continue
        kv_split = _splittable(kv_shape, d, t)

        def spec(a, out):
            s = _shape(a)
            if len(s) != 4:
                return REPLICATED if not out else REPLICATED
            if s == q_shape:
                return d
            return d if kv_split else (PARTIAL if out else REPLICATED)

        ins = tuple(spec(a, False) for a in reads)
        strategies.append(Strategy(d, ins, True, outs=tuple(spec(a, True) for a in outs)))
    return reads, outs, strategies


def output_spec(graph: StrategyGraph, node: OpNode, strategy: Strategy, var) -> int:
    """The spec ``var`` (an output of ``node``) has under ``strategy``."""
    if strategy.outs is not None:
        return strategy.outs[node.outvars.index(var)]
    return strategy.out


def var_bytes(v) -> int:
    return aval_bytes(v.aval)

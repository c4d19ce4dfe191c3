"""Dataflow over a forward jaxpr, and its split into contiguous groups (layers or pipeline stages)
balanced by cost and cut where few bytes cross."""

from __future__ import annotations

import bisect
import collections
import dataclasses
import itertools
import math
from collections.abc import Sequence

from jax.extend import core as jex_core

from autopp.core import batch_dependent_vars, differentiable_vars, eqn_signature, row_slice, user_line
from autopp.profiler._costs import aval_bytes, eqn_cost


@dataclasses.dataclass(frozen=True)
class StageSplit:
    """Which forward equations each stage runs."""

    stage_eqns: tuple[tuple[int, ...], ...]
    """Per stage, indices into the forward jaxpr's equations, in order. Equations that depend only on
    parameters (casts, transposes of a tied embedding) appear in every stage that uses their result."""
    stage_costs: tuple[float, ...]
    """Per stage, the forward FLOPs of its batch-dependent equations (what was balanced counts the backward too, where
    there is one: see :func:`split_stages`)."""
    cut_bytes: tuple[int, ...]
    """Per cut between stage k and k+1, bytes of activations that cross it (per microbatch-sized batch)."""
    stage_starts: tuple[int, ...] = ()
    """Per stage, the forward equation its batch-dependent range begins with (enough to rebuild the split)."""

    @property
    def num_stages(self) -> int:
        return len(self.stage_eqns)

    def to_dict(self) -> dict:
        return {"stage_eqns": [list(s) for s in self.stage_eqns], "stage_costs": list(self.stage_costs),
                "cut_bytes": list(self.cut_bytes), "stage_starts": list(self.stage_starts)}


def _min_bottleneck(costs: list[float], num_stages: int, weights: Sequence[float] | None = None) -> float:
    """Smallest achievable maximum stage cost for ``num_stages`` contiguous non-empty stages; with ``weights``
    (e.g. each stage's devices), of the stage cost per unit of weight."""
    if weights is None:
        lo, hi = max(costs), sum(costs)
    else:
        lo, hi = 0.0, sum(costs) / min(weights)

    def feasible(cap: float) -> bool:
        if weights is None:
            count, acc = 1, 0.0
            for c in costs:
                if acc + c > cap:
                    count, acc = count + 1, c
                else:
                    acc += c
            return count <= num_stages
        i = 0  # each stage in order takes as much as its share of the cap holds
        for w in weights:
            acc = 0.0
            while i < len(costs) and acc + costs[i] <= cap * w:
                acc += costs[i]
                i += 1
        return i == len(costs)

    for _ in range(100):
        if hi - lo <= 1e-9 * max(1.0, hi):
            break
        mid = (lo + hi) / 2
        if feasible(mid):
            hi = mid
        else:
            lo = mid
    return hi


def _min_cross_partition(costs, cross, num_stages, cap, weights=None):
    """DP over cut positions: stage costs <= cap (times the stage's weight, with ``weights``), minimising the summed
    bytes of all cuts.

    ``cross[i]`` is the cost of a cut before element i (1 <= i < n). Returns cut positions
    ``0 = c_0 < c_1 < ... < c_S = n`` or None if infeasible.
    """
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = math.inf
    # dp[k][j]: best cost for the first j elements split into k stages (j is a cut position).
    prev = [inf] * (n + 1)
    prev[0] = 0.0
    parents = []
    for k in range(1, num_stages + 1):
        stage_cap = cap * (1.0 if weights is None else weights[k - 1])
        cur = [inf] * (n + 1)
        par = [-1] * (n + 1)
        window = collections.deque()  # indices i with increasing prev[i], candidates for the start
        lo = 0
        for j in range(1, n + 1):
            i_new = j - 1
            if prev[i_new] < inf:
                while window and prev[window[-1]] >= prev[i_new]:
                    window.pop()
                window.append(i_new)
            while prefix[j] - prefix[lo] > stage_cap * (1 + 1e-12) and lo < j:
                lo += 1
            while window and window[0] < lo:
                window.popleft()
            if window:
                i = window[0]
                cur[j] = prev[i] + (cross[j] if j < n else 0.0)
                par[j] = i
        parents.append(par)
        prev = cur
    if prev[n] == inf:
        return None
    cuts = [n]
    j = n
    for k in range(num_stages - 1, -1, -1):
        j = parents[k][j]
        cuts.append(j)
    return cuts[::-1]


_HASH_MOD = (1 << 61) - 1
_HASH_BASE = 1_000_003


def _repeating_partition(problem: _CutProblem, num_stages: int, cap: float) -> list[int] | None:
    """Cuts (as :func:`_min_cross_partition`) with every stage's cost <= ``cap`` whose middle stages (all but
    the first and the last, at least two) run the same sequence of equations, fewest crossing bytes first; None
    if there are none. Such stages (e.g. one transformer block each, starting at the same point of a block) are
    equal programs on different devices: they compile once and run alike."""
    if num_stages < 4:
        return None
    costs, cross, n = problem.costs, problem.cross, len(problem.costs)
    eqns = problem.forward.jaxpr.eqns
    ids: dict[tuple, int] = {}
    sig = [ids.setdefault(eqn_signature(eqns[i]), len(ids) + 1) for i in problem.seq]
    prefix_hash, power, prefix = [0], [1], [0.0]
    for k, c in zip(sig, costs):
        prefix_hash.append((prefix_hash[-1] * _HASH_BASE + k) % _HASH_MOD)
        power.append(power[-1] * _HASH_BASE % _HASH_MOD)
        prefix.append(prefix[-1] + c)

    def slice_hash(a, b):
        return (prefix_hash[b] - prefix_hash[a] * power[b - a]) % _HASH_MOD

    middle = num_stages - 2
    # The first and the last stage each cost <= cap, so the equal middle stages share at least the rest.
    least = (prefix[n] - 2 * cap) / middle
    slack = cap * 1e-12
    best: tuple | None = None
    for c1 in range(1, n):
        if prefix[c1] > cap + slack:
            break
        shortest = max(1, bisect.bisect_left(prefix, prefix[c1] + least - slack) - c1)
        longest = bisect.bisect_right(prefix, prefix[c1] + cap + slack) - 1 - c1
        for length in range(shortest, longest + 1):
            end = c1 + middle * length
            if end >= n:
                break
            if prefix[n] - prefix[end] > cap + slack:
                continue
            first = slice_hash(c1, c1 + length)
            if any(slice_hash(c1 + k * length, c1 + (k + 1) * length) != first for k in range(1, middle)):
                continue
            cuts = [0] + [c1 + k * length for k in range(middle + 1)] + [n]
            stage_max = max(prefix[b] - prefix[a] for a, b in itertools.pairwise(cuts))
            key = (sum(cross[c] for c in cuts[1:-1]), stage_max)
            if best is None or key < best[0]:
                best = (key, cuts)
    return best[1] if best is not None else None


@dataclasses.dataclass(frozen=True)
class _CutProblem:
    """The batch-dependent equations in order (``seq``), their costs, and the bytes crossing each cut."""

    forward: jex_core.ClosedJaxpr
    seq: list[int]
    costs: list[float]
    """What is balanced: forward FLOPs, times :data:`_WITH_BACKWARD` for an equation with a backward."""
    cross: list[float]
    flops: list[float]
    """Forward FLOPs (what a stage reports)."""


def _cut_problem(forward: jex_core.ClosedJaxpr, batch_invars: Sequence[bool],
                 diff_invars: Sequence[bool] | None = None) -> _CutProblem:
    jaxpr = forward.jaxpr
    eqns = jaxpr.eqns
    dep = batch_dependent_vars(jaxpr, batch_invars)
    seq = [i for i, e in enumerate(eqns) if any(v in dep for v in e.outvars)]
    pos = {eq: k for k, eq in enumerate(seq)}
    flops = []
    for i in seq:
        c = eqn_cost(eqns[i])
        flops.append(c.flops + c.transcendentals + 1.0)
    # what is balanced: an equation that carries a cotangent runs a backward too (about twice its forward, a matmul's
    # input and weight gradients); one that does not (a frozen teacher's forward, preprocessing) runs once
    carried = differentiable_vars(jaxpr, diff_invars) if diff_invars is not None else None
    costs = [f if carried is not None and not any(v in carried for v in eqns[i].outvars) else _WITH_BACKWARD * f
             for i, f in zip(seq, flops)]
    n = len(seq)
    # Bytes crossing a cut before seq position k: batch-dependent values defined before k, used at or after k.
    last_use: dict = {}
    for i in seq:
        for a in eqns[i].invars:
            if not isinstance(a, jex_core.Literal) and a in dep:
                last_use[a] = pos[i]
    for a in jaxpr.outvars:
        if not isinstance(a, jex_core.Literal) and a in dep:
            last_use[a] = n
    diff = [0.0] * (n + 2)
    for i in seq:
        for v in eqns[i].outvars:
            if v in last_use and last_use[v] > pos[i]:
                b = aval_bytes(v.aval)
                diff[pos[i] + 1] += b
                diff[last_use[v] + 1] -= b
    cross = [0.0] * (n + 1)
    acc = 0.0
    for k in range(n + 1):
        acc += diff[k]
        cross[k] = acc
    # Where a scan iteration begins (its rows of the stacked weights read just before it): a cut there keeps each
    # stage's iterations whole, which the runtime needs to roll them back into a scan and to hold the stack by rows;
    # a cut inside an iteration that moves as few bytes costs a thousandth of a byte more, so ties go to the boundary.
    inputs = set(jaxpr.invars)
    headers = [i for i, e in enumerate(eqns) if row_slice(e) is not None and e.invars[0] in inputs]
    if headers:
        for k in range(1, n):
            if bisect.bisect_right(headers, seq[k - 1]) == bisect.bisect_right(headers, seq[k]):
                cross[k] += _INSIDE_ITERATION
    return _CutProblem(forward, seq, costs, cross, flops)


_WITH_BACKWARD = 3.0
"""Cost of an equation with a backward, in units of its forward FLOPs: the forward, then the gradients of its inputs
and weights (a matmul's two backward matmuls, Narayanan et al. 2021's 3x)."""

_INSIDE_ITERATION = 1e-3
"""Bytes added to a cut's crossing bytes when it falls inside a scan iteration (a tie-break, see _cut_problem)."""


def _split_at(problem: _CutProblem, cuts: Sequence[int]) -> StageSplit:
    """The split whose stage k runs batch-dependent equations ``seq[cuts[k]:cuts[k+1]]``; parameter-only
    equations go (duplicated) to every stage that uses their results."""
    jaxpr = problem.forward.jaxpr
    eqns, seq, num_stages = jaxpr.eqns, problem.seq, len(cuts) - 1
    stage_of = {}
    for s in range(num_stages):
        for k in range(cuts[s], cuts[s + 1]):
            stage_of[seq[k]] = s
    # an equation run for its effect (jax.debug.print, a callback) computes nothing a stage needs: it runs where it
    # stands in the program, on the stage of the batch-dependent equation before it (the first stage if none is)
    effectful = [i for i, e in enumerate(eqns) if e.effects and i not in stage_of]
    used = {a for e in eqns for a in e.invars if not isinstance(a, jex_core.Literal)} if effectful else set()
    used |= {a for a in jaxpr.outvars if not isinstance(a, jex_core.Literal)} if effectful else set()
    for i in effectful:
        if not any(o in used for o in eqns[i].outvars):
            at = bisect.bisect_left(seq, i)
            stage_of[i] = stage_of[seq[at - 1]] if at else 0
    needed_at: dict = collections.defaultdict(set)
    for a in jaxpr.outvars:
        if not isinstance(a, jex_core.Literal):
            needed_at[a].add(num_stages - 1)
    placement: dict[int, set[int]] = {}
    for i in range(len(eqns) - 1, -1, -1):
        e = eqns[i]
        stages = {stage_of[i]} if i in stage_of else set().union(*(needed_at.get(v, set()) for v in e.outvars))
        if not stages:
            continue  # dead code
        placement[i] = stages
        for a in e.invars:
            if not isinstance(a, jex_core.Literal):
                needed_at[a] |= stages
    stage_eqns = tuple(tuple(i for i in range(len(eqns)) if s in placement.get(i, ())) for s in range(num_stages))
    stage_costs = tuple(sum(problem.flops[k] for k in range(cuts[s], cuts[s + 1])) for s in range(num_stages))
    cut_bytes = tuple(int(problem.cross[cuts[s]]) for s in range(1, num_stages))
    stage_starts = tuple(seq[cuts[s]] for s in range(num_stages))
    return StageSplit(stage_eqns=stage_eqns, stage_costs=stage_costs, cut_bytes=cut_bytes, stage_starts=stage_starts)


_CALL_NAMES = {"remat2": "jax.checkpoint", "checkpoint": "jax.checkpoint", "custom_vjp_call": "jax.custom_vjp",
               "custom_jvp_call": "jax.custom_jvp (or lax.custom_root, which makes one)", "pjit": "jax.jit",
               "jit": "jax.jit", "cond": "lax.cond/lax.switch", "while": "lax.while_loop",
               "custom_linear_solve": "lax.custom_linear_solve (jnp.linalg.solve, jax.scipy.sparse.linalg.cg)"}
"""Primitives that wrap a sub-computation, as the user wrote them."""


def _wraps(eqn) -> bool:
    """Whether the equation runs a sub-computation (a call a stage boundary cannot cut)."""
    return next(jex_core.jaxprs_in_params(eqn.params), None) is not None


def _mapped(eqns) -> bool:
    """Whether one of ``eqns`` is a scan without a carry (``lax.map``: a function mapped over the examples)."""
    return any(e.primitive.name == "scan" and e.params.get("num_carry") == 0 for e in eqns)


def _uncuttable(calls, mapped: bool = False) -> str:
    """What to do about the model's work sitting inside calls a stage boundary cannot cut (``mapped``: one is a
    ``lax.map``)."""
    fixes = []
    if "jax.checkpoint" in calls:
        fixes.append("apply jax.checkpoint to each layer instead of the whole loss, or leave it out and use "
                     "parallelize's recompute='full'")
    if "lax.cond/lax.switch" in calls:
        fixes.append("compute the layers outside the cond and put only what differs between its branches inside "
                     "it (a loss head, say), or select with jnp.where")
    if "scan" in calls:  # (a scan over data: over stacked parameters it is unrolled, one layer per iteration)
        fixes.append("a scan over time steps or inner iterations runs whole on one stage, so keep the layers outside "
                     "it (a recurrent layer per scan, each its own call), "
                     + ("map a function of one example over the batch with jax.vmap rather than a scan without a carry "
                        "(lax.map, or lax.scan(f, None, xs)), " if mapped
                        else "") + "and write a fixed number of steps that read per-step inputs (a sampler's noise, "
                     "batch first) as lax.fori_loop(0, n, lambda i, x: step(x, noise[:, i]), x), whose steps are split "
                     "across stages")
    if not fixes or set(calls) - {"jax.checkpoint", "lax.cond/lax.switch", "scan"}:
        fixes.append("call the layers outside it, one call per layer at most")
    return "To pipeline the model, " + "; ".join(fixes) + "."


def split_stages(
    forward: jex_core.ClosedJaxpr,
    batch_invars: Sequence[bool],
    num_stages: int,
    *,
    balance_tolerance: float = 0.05,
    weights: Sequence[float] | None = None,
    refuse_unbalanced: bool = False,
    diff_invars: Sequence[bool] | None = None,
) -> StageSplit:
    """Assign the forward equations to ``num_stages`` contiguous stages.

    Stages are balanced by FLOPs (the bottleneck stage is within ``balance_tolerance`` of the best
    possible), per unit of ``weights`` when given (each stage's device count: a group of 3 devices takes 3 times the
    FLOPs of a group of 1). Among such splits, one whose middle stages repeat the same equations is preferred (a model
    of repeated layers: those stages compile once, see :func:`_repeating_partition`), then the one moving the
    fewest activation bytes. ``diff_invars`` (the differentiated inputs): an equation that carries a cotangent counts
    with its backward (:data:`_WITH_BACKWARD` times its FLOPs), one that does not (a frozen teacher's forward) once;
    without it every equation counts once. ``refuse_unbalanced``: raise ValueError when one call a stage boundary
    cannot cut (``lax.cond``, ``jax.checkpoint``, ...) holds more than half the work (a pipeline of such a loss: one
    stage doing most of it alone).
    """
    problem = _cut_problem(forward, batch_invars, diff_invars)
    if len(problem.seq) < num_stages:
        wrapped = sorted({_CALL_NAMES.get(e.primitive.name, e.primitive.name) for i in problem.seq
                          for e in [forward.jaxpr.eqns[i]] if _wraps(e)})
        why = f" Its batch-dependent work sits inside {', '.join(wrapped)} call(s), which a stage boundary " \
            f"cannot cut. {_uncuttable(wrapped, _mapped(forward.jaxpr.eqns[i] for i in problem.seq))}" \
            if wrapped else ""
        raise ValueError(
            f"autopp: the loss has only {len(problem.seq)} operation(s) that depend on the batch, so it cannot "
            f"be split into {num_stages} pipeline stages; use num_stages <= {max(1, len(problem.seq))}.{why}"
        )
    total = sum(problem.costs)
    heaviest = max(range(len(problem.seq)), key=problem.costs.__getitem__)
    eqn = forward.jaxpr.eqns[problem.seq[heaviest]]
    if (refuse_unbalanced and num_stages > 1 and problem.costs[heaviest] > max(0.5, 1.5 / num_stages) * total
            and _wraps(eqn)):  # (two recurrent layers' scans, 53% and 47% of the work, on two stages: balanced enough)
        name = _CALL_NAMES.get(eqn.primitive.name, eqn.primitive.name)
        where = user_line(eqn)
        inputs = {v: k for k, v in enumerate(forward.jaxpr.invars)}
        frozen = eqn.primitive.name == "scan" and diff_invars is not None and any(
            a in inputs and not batch_invars[inputs[a]] and not diff_invars[inputs[a]] and len(a.aval.shape) >= 2
            for a in eqn.invars[eqn.params["num_consts"] + eqn.params["num_carry"]:])
        frozen_advice = (" It scans over stacked weights the loss does not differentiate (a frozen teacher's layers "
                         "passed as an argument of their own), which autopp reads as a loop over data: pass them "
                         "with the parameters, read behind jax.lax.stop_gradient (optax.set_to_zero keeps them "
                         "fixed), and the scan is split by layer like the model's.") if frozen else ""
        raise ValueError(
            f"autopp: one {name} call{f' at {where}' if where else ''} holds {problem.costs[heaviest] / total:.0%} of "
            f"the loss's work, and a stage boundary cannot cut inside it: whichever stage runs it would do that share "
            f"alone, so {num_stages} stages cannot balance. {_uncuttable([name], _mapped([eqn]))} Or use fewer stages: "
            f"num_stages <= {max(1, int(1.5 * total / problem.costs[heaviest]))} (a solver's or a loop's iterations "
            f"run on one stage, beside the work before and after it).{frozen_advice}")
    if weights is not None and len(set(weights)) == 1:
        weights = None
    bottleneck = _min_bottleneck(problem.costs, num_stages, weights)
    cap = bottleneck * (1 + balance_tolerance)
    cuts = (_repeating_partition(problem, num_stages, cap) if weights is None else None) or \
        _min_cross_partition(problem.costs, problem.cross, num_stages, cap, weights)
    while cuts is None and weights is not None:  # every stage needs an equation: a light stage may take more
        cap *= 1.25
        cuts = _min_cross_partition(problem.costs, problem.cross, num_stages, cap, weights)
    assert cuts is not None, "the minimal bottleneck must admit a partition"
    return _split_at(problem, cuts)


def split_at(forward: jex_core.ClosedJaxpr, batch_invars: Sequence[bool], stage_starts: Sequence[int]) -> StageSplit:
    """The split whose stages begin at the given forward equations (a saved plan's ``stage_starts``)."""
    problem = _cut_problem(forward, batch_invars)
    pos = {eq: k for k, eq in enumerate(problem.seq)}
    bad = [i for i in stage_starts if i not in pos]
    if bad or list(stage_starts) != sorted(set(stage_starts)) or not stage_starts or pos.get(stage_starts[0]) != 0:
        raise ValueError(
            f"autopp: stage starts {list(stage_starts)} do not describe a split of this loss (stage 0 must start "
            f"at equation {problem.seq[0] if problem.seq else None}, starts must increase and be batch-dependent "
            "equations); the plan was made for another computation."
        )
    return _split_at(problem, [pos[i] for i in stage_starts] + [len(problem.seq)])

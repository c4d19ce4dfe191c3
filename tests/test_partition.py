"""The forward's split into pipeline stages: balanced within the tolerance, repeated middle stages preferred,
then the fewest crossing bytes; checked against exhaustive searches of the same cost vectors."""

from __future__ import annotations

import itertools
import math

import jax
import pytest

from autopp.core import eqn_signature
from autopp.core._trace import trace_step
from autopp.models import MLP, MLPConfig
from autopp.profiler import _partition
from autopp.profiler._partition import split_stages

from _helpers import make_optimizer, make_step, tiny_gpt, tiny_mlp


def _problem(factory):
    model, tx = factory(), make_optimizer()
    params = model.init(jax.random.key(0))
    args = (params, tx.init(params), model.batch(jax.random.key(1), 8))
    traced = trace_step(make_step(model, tx), args, (2,))
    forward, batch_mask = traced.spec.forward, traced.microbatched_grad_inputs
    return forward, batch_mask, _partition._cut_problem(forward, batch_mask)


def _exact_bottleneck(costs, num_stages):
    """Smallest maximum stage cost by dynamic programming over every cut position (not bisection)."""
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    best = [[math.inf] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, num_stages + 1):
        for j in range(1, n + 1):
            best[k][j] = min((max(best[k - 1][i], prefix[j] - prefix[i]) for i in range(k - 1, j)), default=math.inf)
    return best[num_stages][n], prefix


def _signature_slices(problem, a, b):
    eqns = problem.forward.jaxpr.eqns
    return [eqn_signature(eqns[i]) for i in problem.seq[a:b]]


def test_gpt_middle_stages_repeat_and_the_choice_matches_an_exhaustive_search():
    forward, batch_mask, problem = _problem(tiny_gpt)
    n, tolerance = len(problem.costs), 0.05
    bottleneck, prefix = _exact_bottleneck(problem.costs, 4)
    cap = bottleneck * (1 + tolerance)
    split = split_stages(forward, batch_mask, 4, balance_tolerance=tolerance)
    pos = {eq: k for k, eq in enumerate(problem.seq)}
    cuts = [pos[i] for i in split.stage_starts] + [n]
    assert max(split.stage_costs) <= cap
    assert _signature_slices(problem, cuts[1], cuts[2]) == _signature_slices(problem, cuts[2], cuts[3])
    # Every split whose two middle stages run the same equations and whose stages all fit under the cap.
    candidates = []
    for c1 in range(1, n):
        for length in range(1, (n - c1) // 2 + 1):
            c = [0, c1, c1 + length, c1 + 2 * length, n]
            if c[3] >= n or max(prefix[b] - prefix[a] for a, b in itertools.pairwise(c)) > cap:
                continue
            if _signature_slices(problem, c[1], c[2]) == _signature_slices(problem, c[2], c[3]):
                candidates.append(sum(problem.cross[k] for k in c[1:4]))
    assert candidates and sum(problem.cross[k] for k in cuts[1:4]) == min(candidates)


@pytest.mark.parametrize("num_stages", [2, 3])
def test_too_few_stages_to_repeat_take_the_fewest_bytes(num_stages):
    forward, batch_mask, problem = _problem(tiny_gpt)
    bottleneck, prefix = _exact_bottleneck(problem.costs, num_stages)
    cap = bottleneck * 1.05
    assert _partition._repeating_partition(problem, num_stages, cap) is None
    split = split_stages(forward, batch_mask, num_stages)
    pos = {eq: k for k, eq in enumerate(problem.seq)}
    chosen = sum(problem.cross[pos[i]] for i in split.stage_starts[1:])
    n = len(problem.costs)
    exhaustive = min(sum(problem.cross[k] for k in c)
                     for c in itertools.combinations(range(1, n), num_stages - 1)
                     if max(prefix[b] - prefix[a] for a, b in zip((0, *c), (*c, n))) <= cap)
    assert chosen == exhaustive


def test_no_repetition_within_the_tolerance_falls_back_to_the_fewest_bytes():
    """The MLP's layers differ in width, so no two middle stages can run the same equations."""
    forward, batch_mask, problem = _problem(lambda: MLP(MLPConfig(sizes=(16, 24, 40, 56, 72, 88, 8))))
    bottleneck = _partition._min_bottleneck(problem.costs, 4)
    assert _partition._repeating_partition(problem, 4, bottleneck * 1.05) is None
    split = split_stages(forward, batch_mask, 4)
    pos = {eq: k for k, eq in enumerate(problem.seq)}
    expected = _partition._min_cross_partition(problem.costs, problem.cross, 4, bottleneck * 1.05)
    assert [pos[i] for i in split.stage_starts] == expected[:-1]


def test_uniform_mlp_repeats_whole_layers():
    forward, batch_mask, problem = _problem(tiny_mlp)
    split = split_stages(forward, batch_mask, 4)
    pos = {eq: k for k, eq in enumerate(problem.seq)}
    c = [pos[i] for i in split.stage_starts] + [len(problem.costs)]
    assert c[2] - c[1] == c[3] - c[2] > 0
    assert _signature_slices(problem, c[1], c[2]) == _signature_slices(problem, c[2], c[3])


@pytest.mark.parametrize("weights", [(1, 3), (3, 1), (1, 2, 1), (2, 1, 1, 4)])
def test_stages_weighted_by_their_devices_against_an_exhaustive_search(weights):
    """Device groups of other sizes: the least bottleneck of FLOPs per device over every contiguous split equals the
    weighted bisection, and the split the DP returns is within the tolerance of it."""
    costs = [3.0, 1.0, 4.0, 1.0, 5.0, 9.0, 2.0, 6.0, 5.0, 3.0]
    n, S = len(costs), len(weights)
    best = min(max(sum(costs[a:b]) / w for (a, b), w in zip(itertools.pairwise((0, *cuts, n)), weights))
               for cuts in itertools.combinations(range(1, n), S - 1))
    got = _partition._min_bottleneck(costs, S, list(weights))
    assert got == pytest.approx(best, rel=1e-6)
    cuts = _partition._min_cross_partition(costs, [0.0] * (n + 1), S, got * 1.05, list(weights))
    assert cuts is not None
    assert max(sum(costs[a:b]) / w for (a, b), w in zip(itertools.pairwise(cuts), weights)) <= got * 1.05 + 1e-9


def test_a_group_of_more_devices_gets_more_of_the_model():
    """``devices=[[d0], [d1, d2, d3]]``: the 3-device group's stage takes about 3 times the FLOPs of the other,
    and the step equals plain jit."""
    import autopp
    from _helpers import assert_trees_close, run_steps
    import optax

    model, tx = tiny_mlp(), optax.sgd(0.1)
    params = model.init(jax.random.key(0))
    state, batch = (params, tx.init(params)), model.batch(jax.random.key(1), 24)
    step = make_step(model, tx)
    devices = jax.devices()
    pipelined = autopp.parallelize(step, num_stages=2, num_microbatches=2, devices=[devices[:1], devices[1:4]])
    stages = pipelined.plan_for(*state, batch).stages
    per_device = [s.flops for s in stages]  # a plan's FLOPs are a data replica's, here one device's
    assert stages[1].flops * 3 > 1.5 * stages[0].flops  # the stage's share of the whole microbatch
    assert max(per_device) / min(per_device) < 1.6  # equal shares up to whole layers (8 of them)
    got, _ = run_steps(pipelined, state, batch)
    want, _ = run_steps(jax.jit(step), state, batch)
    assert_trees_close(got, want, rtol=0, atol=1e-6)


def test_a_frozen_teacher_counts_its_forward_only():
    """Knowledge distillation (user trial DISTILL): a student and an equal frozen teacher of 8 tanh layers each. The
    student's layers run a backward (about 3 times their forward FLOPs), the teacher's only their forward, so 2 stages
    balance at 16 forward-layers of work each (8 x 3 + 8 = 32 in all), by hand: stage 0 takes 5-6 of the student's
    layers, not all 8 (before: the split balanced forward FLOPs, stage 0 held the whole student, 24 units against
    the teacher's 8). The step still equals plain jit."""
    import autopp
    import jax.numpy as jnp
    import optax
    from _helpers import assert_trees_close

    D, L = 32, 8

    def init(key):
        return [jax.random.normal(k, (D, D)) / D ** 0.5 for k in jax.random.split(key, L)]

    def apply(ws, x):
        for w in ws:
            x = jnp.tanh(x @ w)
        return x

    def loss(student, teacher, x):
        s, t = apply(student, x), apply(teacher, x)
        return jnp.sum(jax.nn.softmax(t) * (jax.nn.log_softmax(t) - jax.nn.log_softmax(s)), -1).mean()

    tx = optax.sgd(0.1)

    def step(student, opt, teacher, x):
        value, g = autopp.value_and_grad(loss)(student, teacher, x)
        u, opt = tx.update(g, opt, student)
        return optax.apply_updates(student, u), opt, value

    student, teacher = init(jax.random.key(0)), init(jax.random.key(1))
    x = jax.random.normal(jax.random.key(2), (16, D))
    pipelined = autopp.parallelize(step, num_stages=2, num_microbatches=4, devices=jax.devices()[:2])
    plan = pipelined.plan_for(student, tx.init(student), teacher, x)
    layer = 2 * 16 // 4 * D * D  # one layer's matmul FLOPs per microbatch
    student_layers_on_0 = plan.stages[0].flops / layer
    assert 4.5 <= student_layers_on_0 <= 6.5, plan

    def run(fn):
        state = (student, tx.init(student))
        for _ in range(3):
            *state, value = fn(*state, teacher, x)
        return state, value

    got, want = run(pipelined), run(jax.jit(step))
    assert_trees_close(got, want, atol=1e-6)

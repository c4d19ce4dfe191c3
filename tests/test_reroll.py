"""A stage's unrolled ``lax.scan`` iterations are rolled back into one scan (:mod:`autopp.core._reroll`): the rolled
jaxpr computes what the unrolled one computes and what ``jax.jit`` of the user's scan computes, runs that are not a
scan's data flow stay unrolled, and a pipelined scan-over-layers model trains like plain jit with each stage's
whole iterations compiled as one scan."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import autopp
import autopp.core._stage
import autopp.runtime._step
from autopp.core import eval_jaxpr_with, slice_jaxpr
from autopp.core._reroll import find_scan_runs, reroll_scans
from autopp.models import make_train_step
from tests._helpers import assert_trees_close, run_steps, tiny_scanned_gpt

W = jax.random.normal(jax.random.key(0), (6, 8, 8)) * 0.4
B = jax.random.normal(jax.random.key(1), (6, 8))
X = jax.random.normal(jax.random.key(2), (4, 8))
SCALE = jnp.float32(0.5)


def _unrolled(f, *args):
    """``f``'s jaxpr as autopp traces it: ``disable_jit`` runs each ``lax.scan`` as a Python loop."""
    with jax.disable_jit():
        return jax.make_jaxpr(f)(*args)


def _scans(closed):
    return [e for e in closed.jaxpr.eqns if e.primitive.name == "scan"]


def _eval(closed, *args):
    return jax.core.eval_jaxpr(closed.jaxpr, closed.consts, *args)


def _stacked_outputs(w, b, x, s):
    """A scan with a closed-over scale (a constant of every iteration), two carries and a stacked output read after
    the loop."""
    def body(carry, p):
        h, total = carry
        h = jnp.tanh(h @ p[0] + p[1]) * s
        return (h, total + jnp.sum(h)), jnp.mean(h, axis=0)

    (h, total), ys = jax.lax.scan(body, (x, jnp.float32(0)), (w, b))
    return jnp.sum(h) + total + jnp.sum(ys[::2] ** 2)


def _reverse(w, b, x, s):
    h, ys = jax.lax.scan(lambda h, p: (jnp.tanh(h @ p[0] + p[1]), jnp.sum(h) * s), x, (w, b), reverse=True)
    return jnp.sum(h) + ys[1] - ys[4]


@pytest.mark.parametrize("f", [_stacked_outputs, _reverse], ids=["stacked-outputs", "reverse"])
def test_rolled_back_equals_the_unrolled_jaxpr_and_jit(f):
    unrolled = _unrolled(f, W, B, X, SCALE)
    rolled, runs, _ = reroll_scans(unrolled)
    assert [(r.count, r.step) for r in runs] == [(6, -1 if f is _reverse else 1)]
    (scan,) = _scans(rolled)
    assert scan.params["length"] == 6 and scan.params["reverse"] == (f is _reverse)
    # one iteration's equations, not six: the body holds the one matmul
    assert sum(e.primitive.name == "dot_general" for e in rolled.jaxpr.eqns) == 0
    assert sum(e.primitive.name == "dot_general" for e in scan.params["jaxpr"].jaxpr.eqns) == 1
    expected = jax.jit(f)(W, B, X, SCALE)
    np.testing.assert_allclose(_eval(rolled, W, B, X, SCALE)[0], expected, rtol=1e-6)
    np.testing.assert_allclose(_eval(unrolled, W, B, X, SCALE)[0], expected, rtol=1e-6)
    # and its gradient, which is what a stage's backward takes
    g_rolled = jax.grad(lambda *a: _eval(rolled, *a)[0], argnums=(0, 1, 2))(W, B, X, SCALE)
    g_jit = jax.jit(jax.grad(f, argnums=(0, 1, 2)))(W, B, X, SCALE)
    for a, e in zip(g_rolled, g_jit):
        np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-6)


def test_only_whole_iterations_of_a_slice_are_rolled():
    """A stage that begins inside iteration 1 and ends inside iteration 4 rolls iterations 2 and 3 only."""
    unrolled = _unrolled(_stacked_outputs, W, B, X, SCALE)
    runs = find_scan_runs(unrolled.jaxpr)
    (run,) = runs
    cut_from, cut_to = run.start + run.period + 5, run.start + 4 * run.period + 3
    later = {a for e in unrolled.jaxpr.eqns[cut_to:] for a in e.invars
             if not isinstance(a, jax.extend.core.Literal)} | set(unrolled.jaxpr.outvars)
    sub, ins, _ = slice_jaxpr(unrolled, range(cut_from, cut_to), lambda v: v in later, "stage")
    rolled, (part,), _ = reroll_scans(sub)
    assert (part.count, part.first_row) == (2, 2)
    seen = {}

    def record(_, eqn, invals):  # the values the slice's equations read, from a run of the whole jaxpr
        seen.update((a, v) for a, v in zip(eqn.invars, invals) if not isinstance(a, jax.extend.core.Literal))

    eval_jaxpr_with(unrolled.jaxpr, unrolled.consts, (W, B, X, SCALE), record)
    args = [seen[v] for v in ins]
    for a, e in zip(_eval(rolled, *args), _eval(sub, *args)):
        np.testing.assert_allclose(a, e, rtol=1e-6, atol=1e-7)


def test_a_loop_that_is_not_a_scan_stays_unrolled():
    """Iteration k reads iteration k - 2's result: equal equations, but not a scan's data flow."""
    def two_back(w, x):
        prev, h = x, x
        for k in range(5):
            prev, h = h, jnp.tanh(h @ jax.lax.index_in_dim(w, k, keepdims=False)) + prev
        return h

    unrolled = _unrolled(two_back, W, X)
    assert find_scan_runs(unrolled.jaxpr) == []
    assert reroll_scans(unrolled)[0] is unrolled


def test_a_kept_variable_leaves_its_run_unrolled():
    unrolled = _unrolled(_stacked_outputs, W, B, X, SCALE)
    (run,) = find_scan_runs(unrolled.jaxpr)
    inside = unrolled.jaxpr.eqns[run.start + 2 * run.period + run.header_length].outvars[0]
    assert find_scan_runs(unrolled.jaxpr, keep={inside}) == []


@pytest.mark.parametrize("num_stages, schedule", [(1, "1f1b"), (2, "1f1b"), (4, "zb-h1")])
def test_a_scanned_model_trains_like_jit_with_its_iterations_rolled(monkeypatch, num_stages, schedule):
    runs_of = {}
    original = reroll_scans

    def spy(closed, **kwargs):
        out, runs, bases = original(closed, **kwargs)
        runs_of[kwargs["name"]] = runs
        return out, runs, bases

    monkeypatch.setattr(autopp.core._stage, "reroll_scans", spy)  # each stage's programs
    monkeypatch.setattr(autopp.runtime._step, "reroll_scans", spy)  # the one-stage program
    model, tx = tiny_scanned_gpt(), optax.sgd(0.1)
    params = model.init(jax.random.key(0))
    state, batch = (params, tx.init(params)), model.batch(jax.random.key(1), 16)
    step = make_train_step(model.loss, tx)
    pipelined = autopp.parallelize(step, num_stages=num_stages, num_microbatches=4, schedule=schedule,
                                   devices=jax.devices()[:num_stages])
    got, got_losses = run_steps(pipelined, state, batch)
    want, want_losses = run_steps(jax.jit(step), state, batch)
    assert_trees_close(got, want, rtol=0, atol=1e-6)
    np.testing.assert_allclose(got_losses, want_losses, rtol=1e-6)
    # every stage runs its whole iterations as one scan; together they cover all but the iterations a cut splits
    if num_stages == 1:
        assert [(r.count, r.first_row) for r in runs_of["forward"]] == [(8, 0)]
        return
    # the first and the last stage run as segments (embedding | iterations, iterations | head): one program
    # name per segment, one rolled run per plan stage, in a segment of its own
    assert sorted(runs_of) == [f"stage {s}" for s in range(num_stages + 2)]
    rolled = [r for runs in runs_of.values() for r in runs]
    assert len(rolled) == num_stages and all(r.count >= 2 for r in rolled)
    assert sum(r.count for r in rolled) >= 8 - (num_stages - 1)
    assert not runs_of["stage 0"] and not runs_of[f"stage {num_stages + 1}"]


@pytest.mark.parametrize("layout, recompute", [({"fsdp": 2}, ("full", "selective")), ({"tensor": 2}, ("none", "none"))])
def test_a_scanned_model_with_sharded_stages_trains_like_jit(layout, recompute):
    """Rolled iterations read their rows of stacked parameters that are sharded (FSDP, tensor) and recomputed (the
    stack stays whole on such stages, with a warning that says so)."""
    model, tx = tiny_scanned_gpt(), optax.sgd(0.1)
    params = model.init(jax.random.key(0))
    state, batch = (params, tx.init(params)), model.batch(jax.random.key(1), 16)
    step = make_train_step(model.loss, tx)
    pipelined = autopp.parallelize(step, num_stages=2, num_microbatches=4, layout=layout, recompute=recompute,
                                   devices=jax.devices()[:4])
    with pytest.warns(UserWarning, match="stay whole.*split parameters over a tensor or FSDP axis"):
        got, _ = run_steps(pipelined, state, batch)
    want, _ = run_steps(jax.jit(step), state, batch)
    assert_trees_close(got, want, rtol=0, atol=1e-6)


def test_segments_of_a_schedule_run_in_order_on_their_stages_rank():
    """A stage cut into segments runs its segments' forwards in order and their backwards in reverse, where the
    plan's schedule runs the stage (written by hand for 1F1B on 2 stages, each cut in two)."""
    from autopp.core import Schedule
    from autopp.runtime._segments import expand_schedule

    plan = Schedule.from_text("0F0 0F1 0B0 0B1\n1F0 1B0 1F1 1B1", num_stages=2, num_microbatches=2)
    got = expand_schedule(plan, (0, 0, 1, 1))
    assert got.to_text() == ("0F0 1F0 0F1 1F1 1B0 0B0 1B1 0B1\n"
                             "2F0 3F0 3B0 2B0 2F1 3F1 3B1 2B1")
    assert got.num_stages == 4 and got.stage_to_rank() == {0: 0, 1: 0, 2: 1, 3: 1}


def test_every_stage_of_a_scanned_model_runs_its_iterations_as_one_program(monkeypatch):
    """Issue 15 (the first call at depth): the first and the last stage are cut around their rolled iterations
    (:mod:`autopp.runtime._segments`), so every stage's iterations run as the middle stages' program. XLA compiles
    two programs with a loop in all (the iterations' forward and backward), where a stage compiled whole made one
    forward and one backward per distinct stage (six for four stages); the step still equals plain jit."""
    from autopp.runtime import _passes

    texts = []
    real = _passes.compile_reusable

    def spy(lowered, key):
        texts.append(lowered.as_text())
        return real(lowered, key)

    monkeypatch.setattr(_passes, "compile_reusable", spy)
    model, tx = tiny_scanned_gpt(), optax.sgd(0.1)
    params = model.init(jax.random.key(0))
    state, batch = (params, tx.init(params)), model.batch(jax.random.key(1), 16)
    step = make_train_step(model.loss, tx)
    pipelined = autopp.parallelize(step, num_stages=4, num_microbatches=4, schedule="1f1b",
                                   devices=jax.devices()[:4])
    got, got_losses = run_steps(pipelined, state, batch)
    want, want_losses = run_steps(jax.jit(step), state, batch)
    assert_trees_close(got, want, rtol=0, atol=1e-6)
    np.testing.assert_allclose(got_losses, want_losses, rtol=1e-6)
    assert sum("stablehlo.while" in t for t in texts) == 2
    # tasks are named by the plan's stages: stage 0's forward is two tasks (embedding, iterations), the last
    # stage's iterations run forward and backward around its fused head
    labels = pipelined.executable_for(*state, batch).description
    assert labels.count("0F0") == 2 and labels.count("0B0") == 2
    assert labels.count("3F0") == 1 and labels.count("3F0+3B0") == 1 and labels.count("3B0") == 1
    assert pipelined.plan_for(*state, batch).num_stages == 4

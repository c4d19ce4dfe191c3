"""Zero-bubble schedules at run time: the backward split into input-gradient (I) and weight-gradient (W) tasks."""

import jax
import pytest

import autopp
from autopp.runtime import Schedule, zb_h1
from tests._helpers import (
    assert_trees_close, gpt_case, make_optimizer, make_step, run_steps, tiny_mlp, with_jit_reference,
)


@pytest.fixture(scope="module")
def case():
    return with_jit_reference(*gpt_case())


@pytest.mark.parametrize("num_stages, num_microbatches", [(2, 4), pytest.param(4, 8, marks=pytest.mark.slow), (4, 2)])
def test_zb_h1_equals_plain_jit(case, num_stages, num_microbatches):
    step, state, batch, reference = case
    pipelined = autopp.parallelize(step, num_stages=num_stages, num_microbatches=num_microbatches,
                                   schedule=zb_h1(num_stages, num_microbatches), devices=jax.devices()[:num_stages])
    got, _ = run_steps(pipelined, state, batch)
    assert_trees_close(got, reference)
    labels = [t.label for t in pipelined.executable_for(*state, batch).tasks]
    # every stage after the first sends input gradients (I); every stage accumulates weight gradients (W)
    for s in range(num_stages):
        assert sum(lab == f"{s}W{m}" for lab in labels for m in range(num_microbatches)) == num_microbatches
        assert sum(lab == f"{s}I{m}" for lab in labels for m in range(num_microbatches)) == (
            num_microbatches if s > 0 else 0)


def test_input_and_weight_parts_do_the_backward_work_once(case):
    """XLA's own FLOP count: I + W of a stage equal its fused backward B (no part computed twice)."""
    step, state, batch, _ = case

    def flops(schedule, labels):
        pipelined = autopp.parallelize(step, num_stages=2, num_microbatches=4, schedule=schedule,
                                       devices=jax.devices()[:2])
        return {t.label: t.fn.cost_analysis()["flops"] for t in pipelined.executable_for(*state, batch).tasks
                if t.label in labels}

    split = flops(zb_h1(2, 4), {"1I0", "1W0"})
    # microbatch 0's backward does not follow its forward directly, so it is not fused with it
    whole = flops(Schedule.from_text("0F0 0F1 0F2 0F3 0B0 0B1 0B2 0B3\n1F0 1F1 1B0 1B1 1F2 1B2 1F3 1B3", 2, 4),
                  {"1B0"})
    assert split["1I0"] > 0 and split["1W0"] > 0
    assert split["1I0"] + split["1W0"] == pytest.approx(whole["1B0"], rel=0.02)


def test_text_schedule_with_input_and_weight_actions_runs():
    model, tx = tiny_mlp(), make_optimizer()
    params = model.init(jax.random.key(0))
    state = (params, tx.init(params))
    batch = model.batch(jax.random.key(1), 8)
    step = make_step(model, tx)
    text = ("0F0 0F1 0I0 0W0 0I1 0W1\n"
            "1F0 1I0 1F1 1I1 1W0 1W1")
    pipelined = autopp.parallelize(step, num_stages=2, num_microbatches=2, schedule=Schedule.from_text(text, 2, 2),
                                   devices=jax.devices()[:2])
    got, _ = run_steps(pipelined, state, batch)
    reference, _ = run_steps(jax.jit(step), state, batch)
    assert_trees_close(got, reference)

"""Peak memory per device after a step: the runtime's accounting against XLA's own analysis and the plan."""

import jax
import numpy as np
import pytest

import autopp
from tests._helpers import gpt_case


@pytest.fixture(scope="module")
def case():
    return gpt_case()


def _nbytes(tree):
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def test_one_stage_equals_xla_memory_analysis_of_its_program(case):
    step, state, batch = case
    pipelined = autopp.parallelize(step, num_stages=1, num_microbatches=4, devices=jax.devices()[:1])
    report = pipelined.memory_report(*state, batch)
    (program,) = [t.fn for t in pipelined.executable_for(*state, batch).tasks if "scan" in t.label]
    m = program.memory_analysis()
    # the placed inputs (arguments), the results and XLA's temporaries of the one program (XLA pads small buffers)
    assert set(report) == {0}
    assert report[0] == pytest.approx(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes,
                                      rel=0.01)


def test_pipeline_stages_hold_their_share(case):
    step, state, batch = case
    pipelined = autopp.parallelize(step, num_stages=4, num_microbatches=4, devices=jax.devices()[:4])
    report = pipelined.memory_report(*state, batch)
    plan = pipelined.plan_for(*state, batch)
    assert set(report) == {0, 1, 2, 3}
    for st in plan.stages:
        (dev,) = st.devices
        # parameters, Adam's two moments, the new values and the gradients at least
        assert report[dev] >= 3 * st.param_bytes
    whole = _nbytes(state) * 2  # every parameter and optimizer state, before and after the update
    m = jax.jit(step).lower(*state, batch).compile().memory_analysis()
    unpipelined = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
    assert max(report.values()) < unpipelined
    assert sum(report.values()) > whole / 2
    assert np.isfinite(sum(report.values()))


def test_each_program_s_donated_inputs_are_the_bytes_xla_aliases(case):
    """The backward programs update their gradient accumulators in place (donated, aliased by XLA to their results):
    the runtime lists those inputs as donated, so ``memory_report`` counts each accumulator once while a backward runs
    (it used to count the old and the new buffer). The donated bytes of every program are what XLA's own analysis
    says its results alias."""
    step, state, batch = case
    pipelined = autopp.parallelize(step, num_stages=4, num_microbatches=4, devices=jax.devices()[:4])
    exe = pipelined.executable_for(*state, batch)
    checked = 0
    for task in exe.tasks:
        analysis = getattr(task.fn, "memory_analysis", None)
        if analysis is None:
            continue
        donated = sum(sum(exe.slot_bytes[s].values()) for s in task.donated)
        assert donated == pytest.approx(analysis().alias_size_in_bytes, rel=0.01, abs=64), task.label
        checked += bool(donated) and "B" in task.label.split()[0]
    assert checked >= 4 * 4 - 1  # every microbatch's backward on every stage (the last's may be its fused forward)

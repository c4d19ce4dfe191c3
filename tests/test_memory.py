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

"""Every schedule the runtime runs, on the zoo GPT, equals plain jax.jit: interleaved 1F1B with several model
chunks per device group, zero-bubble, schedules written as text, recomputation per stage."""

import jax
import pytest

import autopp
from autopp.models import GPT, GPTConfig
from autopp.runtime import Schedule
from tests._helpers import (
    assert_trees_close, assert_within_microbatch_noise, gpt_case, make_optimizer, make_step, microbatched_jit,
    run_steps, tiny_gpt, with_jit_reference,
)


@pytest.fixture(scope="module")
def case():
    return with_jit_reference(*gpt_case())


@pytest.mark.parametrize("groups, virtual_stages, num_microbatches, devices", [
    pytest.param(2, 2, 2, 2, marks=pytest.mark.slow), (2, 2, 4, 4), (2, 3, 4, 2), (4, 2, 4, 4),
])
def test_interleaved_1f1b_equals_plain_jit(case, groups, virtual_stages, num_microbatches, devices):
    step, state, batch, reference = case
    pipelined = autopp.parallelize(step, num_stages=groups, virtual_stages=virtual_stages, schedule="interleaved-1f1b",
                                   num_microbatches=num_microbatches, devices=jax.devices()[:devices])
    got, _ = run_steps(pipelined, state, batch)
    assert_trees_close(got, reference)
    plan = pipelined.plan_for(*state, batch)
    assert plan.num_stages == groups * virtual_stages and plan.virtual_stages == virtual_stages
    per = devices // groups
    for chunk in plan.stages:  # chunk c runs on device group c % groups
        g = chunk.index % groups
        assert chunk.devices == tuple(d.id for d in jax.devices()[g * per:(g + 1) * per])
    # the parameters of a chunk live on its group's devices
    placed = {d.id for leaf in jax.tree.leaves(got[0]) for d in leaf.sharding.device_set}
    assert placed <= {d.id for d in jax.devices()[:devices]}


@pytest.mark.parametrize("groups, num_microbatches, devices",
                         [(2, 4, 2), pytest.param(3, 8, 3, marks=pytest.mark.slow)])  # 3 groups: the same paths
def test_dualpipev_equals_plain_jit(case, groups, num_microbatches, devices):
    step, state, batch, reference = case
    pipelined = autopp.parallelize(step, num_stages=groups, schedule="dualpipev", num_microbatches=num_microbatches,
                                   devices=jax.devices()[:devices])
    got, _ = run_steps(pipelined, state, batch)
    assert_trees_close(got, reference)
    plan = pipelined.plan_for(*state, batch)
    assert plan.num_stages == 2 * groups and plan.schedule == "dualpipev"
    per = devices // groups
    for chunk in plan.stages:  # the V: group g runs stages g and 2 * groups - 1 - g
        g = min(chunk.index, 2 * groups - 1 - chunk.index)
        assert chunk.devices == tuple(d.id for d in jax.devices()[g * per:(g + 1) * per])
    kinds = {a.kind for _, _, a in Schedule.from_text(plan.schedule_text).actions()}
    assert kinds == {"F", "B", "I", "W"}  # whole backwards and zero-bubble split ones


def test_dualpipev_default_microbatches_and_errors(case):
    step, state, batch, _ = case
    pipelined = autopp.parallelize(step, num_stages=2, schedule="dualpipev", devices=jax.devices()[:2])
    assert pipelined.plan_for(*state, batch).num_microbatches == 4  # the fewest: two per device group
    with pytest.raises(ValueError, match="virtual_stages=3"):
        autopp.parallelize(step, num_stages=2, schedule="dualpipev", virtual_stages=3)
    with pytest.raises(ValueError, match="num_microbatches >= 2 \\* num_ranks"):
        autopp.parallelize(step, num_stages=4, schedule="dualpipev", num_microbatches=4,
                           devices=jax.devices()[:4]).plan_for(*state, batch)


def test_schedule_given_as_text_runs_and_round_trips(case):
    step, state, batch, reference = case
    text = "0F0 1F0 0F1 1F1 1B0 0B0 1B1 0B1\n2F0 3F0 3B0 2B0 2F1 3F1 3B1 2B1"
    # two device groups, each running two consecutive chunks; the chunks' data flows 0 -> 1 -> 2 -> 3
    sched = Schedule.from_text(text)
    assert Schedule.from_text(sched.to_text()) == sched
    pipelined = autopp.parallelize(step, schedule=text, devices=jax.devices()[:2])
    got, _ = run_steps(pipelined, state, batch)
    split, _ = run_steps(microbatched_jit(tiny_gpt(), make_optimizer(), 2), state, batch)  # 2 microbatches
    assert_within_microbatch_noise(got, reference, split)
    plan = pipelined.plan_for(*state, batch)
    assert plan.schedule_text == sched.to_text() and [s.devices for s in plan.stages] == [(0,), (0,), (1,), (1,)]


RECOMPUTE_KW = dict(num_stages=4, num_microbatches=4, schedule="gpipe", devices=jax.devices()[:4])


def _kept_bytes(pipelined, state, batch):
    """What each of the first three stages' forward hands to its backward: outputs and residuals."""
    return {t.label: sum(o.size * o.dtype.itemsize for o in jax.tree.leaves(t.fn.out_info))
            for t in pipelined.executable_for(*state, batch).tasks if t.label in ("0F0", "1F0", "2F0")}


@pytest.fixture(scope="module")
def kept_without_recompute(case):
    step, state, batch, _ = case
    return _kept_bytes(autopp.parallelize(step, **RECOMPUTE_KW), state, batch)


@pytest.mark.parametrize("recompute", [pytest.param("full", marks=pytest.mark.slow),
                                       pytest.param("selective", marks=pytest.mark.slow),
                                       ("full", "none", "selective", "none")])  # the last has every mode
def test_recomputation_equals_plain_jit_and_keeps_less(case, kept_without_recompute, recompute):
    step, state, batch, reference = case
    pipelined = autopp.parallelize(step, recompute=recompute, **RECOMPUTE_KW)
    got, _ = run_steps(pipelined, state, batch)
    assert_trees_close(got, reference)
    modes = (recompute,) * 4 if isinstance(recompute, str) else recompute
    assert tuple(s.recompute for s in pipelined.plan_for(*state, batch).stages) == modes
    less = _kept_bytes(pipelined, state, batch)
    for s, mode in enumerate(modes[:3]):
        if mode == "none":
            assert less[f"{s}F0"] == kept_without_recompute[f"{s}F0"]
        else:
            assert less[f"{s}F0"] < kept_without_recompute[f"{s}F0"]


def test_full_recomputation_keeps_each_layers_input():
    """Full recomputation as Megatron-LM runs it, one layer per checkpoint (what the planner's memory model assumes):
    a stage's forward keeps each of its layers' inputs for the backward, which runs one layer's forward again just
    before its backward. Hand count for an 8-layer GPT on 2 stages: as many ``[microbatch, seq, hidden]`` float32
    values as blocks whose weights stage 0 holds (the embedding's input is the stage's own input). It used to keep
    the stage's inputs only, and the backward then held the whole stage's residuals at once."""
    cfg = GPTConfig(layers=8, hidden=32, heads=4, seq=16, vocab=64)
    model, tx = GPT(cfg), make_optimizer()
    params = model.init(jax.random.key(0))
    state, batch = (params, tx.init(params)), model.batch(jax.random.key(1), 8)
    step = make_step(model, tx)
    pipelined = autopp.parallelize(step, num_stages=2, num_microbatches=4, schedule="gpipe", recompute="full",
                                   devices=jax.devices()[:2])
    got, _ = run_steps(pipelined, state, batch)
    assert_trees_close(got, run_steps(jax.jit(step), state, batch)[0])
    stage0 = jax.devices()[0]
    blocks = sum(all(leaf.sharding.device_set == {stage0} for leaf in jax.tree.leaves(b)) for b in got[0]["blocks"])
    assert 0 < blocks < cfg.layers
    (fwd,) = [t for t in pipelined.executable_for(*state, batch).tasks if t.label == "0F0"]
    outs = jax.tree.leaves(fwd.fn.out_info)
    activation = 2 * cfg.seq * cfg.hidden * 4  # microbatch of 2
    kept = sum(o.size * o.dtype.itemsize for o in outs) - activation  # less the activation sent to stage 1
    assert kept == blocks * activation, (kept, blocks, [(o.shape, o.dtype) for o in outs])


def test_bad_schedule_arguments():
    step = make_step(tiny_gpt(), make_optimizer())
    with pytest.raises(ValueError, match=r"virtual_stages=2 needs schedule='interleaved-1f1b'"):
        autopp.parallelize(step, num_stages=2, virtual_stages=2)
    with pytest.raises(ValueError, match=r"the schedule has 2 row\(s\) \(device groups\) but num_stages=4"):
        autopp.parallelize(step, num_stages=4, schedule="0F0 0B0\n1F0 1B0")
    with pytest.raises(ValueError, match=r"recompute='most' must be one of none, full, selective"):
        autopp.parallelize(step, num_stages=2, recompute="most")
    with pytest.raises(ValueError, match=r"unknown schedule 'pipedream'"):
        autopp.parallelize(step, num_stages=2, schedule="pipedream")
    with pytest.raises(ValueError, match=r"1B0.*before"):  # backward before its forward: the grid is printed
        autopp.parallelize(step, schedule="0F0 0B0\n1B0 1F0")


def test_stages_of_different_sizes_equal_plain_jit(case):
    """Device groups of 1 + 2 + 4 + 1 devices: each stage data-parallel over its own group."""
    step, state, batch, reference = case
    d = jax.devices()
    groups = [d[:1], d[1:3], d[3:7], d[7:8]]
    pipelined = autopp.parallelize(step, devices=groups, num_microbatches=2)
    got, _ = run_steps(pipelined, state, batch)
    assert_trees_close(got, reference)
    plan = pipelined.plan_for(*state, batch)
    assert [len(s.devices) for s in plan.stages] == [1, 2, 4, 1]
    assert [s.mesh_shape for s in plan.stages] == [{"data": 1}, {"data": 2}, {"data": 4}, {"data": 1}]
    exe = pipelined.executable_for(*state, batch)
    # activations travel between groups of different sizes: the receiver's layout
    sends = [t for t in exe.tasks if t.label.startswith("send 1->2")]
    assert sends and all(t.devices == frozenset(x.id for x in groups[2]) for t in sends)
    with pytest.raises(ValueError, match=r"num_stages=2 but devices has 4 groups"):
        autopp.parallelize(step, devices=groups, num_stages=2)

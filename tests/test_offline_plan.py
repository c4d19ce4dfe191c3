"""A plan made offline from a model description (``plan_model(GPTConfig, cluster)``) replays on the traced step
of that model when its devices are local."""

from __future__ import annotations

import dataclasses

import jax
import pytest

import autopp
from autopp.planner import plan_model
from autopp.profiler import Cluster

from _helpers import assert_trees_close, gpt_case, run_steps, tiny_gpt, with_jit_reference


@pytest.fixture(scope="module")
def case():
    return with_jit_reference(*gpt_case())


@pytest.fixture(scope="module")
def offline_plan():
    plan = plan_model(tiny_gpt().config, Cluster.local(jax.devices()[:4]), global_batch=8, pipeline_degrees=(2,),
                      time_limit_s=2)
    return autopp.Plan.from_json(plan.to_json())  # as read back from a file


def test_config_plan_replays_and_equals_jit(case, offline_plan):
    step, state, batch, reference = case
    assert offline_plan.model_fingerprint.startswith("layers:") and offline_plan.num_stages >= 2
    pipelined = autopp.parallelize(step, plan=offline_plan)
    got, _ = run_steps(pipelined, state, batch)
    assert_trees_close(got, reference)
    replayed = pipelined.plan_for(*state, batch)
    assert [s.layers for s in replayed.stages] == [s.layers for s in offline_plan.stages]
    assert [s.devices for s in replayed.stages] == [s.devices for s in offline_plan.stages]
    assert replayed.schedule_text == offline_plan.schedule_text


def test_config_plan_for_another_model_or_batch_is_refused(case, offline_plan):
    step, state, batch, _ = case
    deeper = plan_model(dataclasses.replace(tiny_gpt().config, layers=6), Cluster.local(jax.devices()[:4]),
                        global_batch=8, pipeline_degrees=(2,), time_limit_s=2)
    with pytest.raises(ValueError, match="made offline for a model of 8 layers"):
        autopp.parallelize(step, plan=deeper).plan_for(*state, batch)
    half = jax.tree.map(lambda x: x[:4], batch)
    with pytest.raises(ValueError, match="global_batch=4"):
        autopp.parallelize(step, plan=offline_plan).plan_for(*state, half)


def test_config_plan_for_another_sequence_length_is_refused(case, offline_plan):
    """The same model and batch size at half the sequence length: the plan's memory and times were for 16 tokens."""
    step, state, batch, _ = case
    shorter = jax.tree.map(lambda x: x[:, :8], batch)
    with pytest.raises(ValueError, match="per-example input shapes, such as the sequence length"):
        autopp.parallelize(step, plan=offline_plan).plan_for(*state, shorter)


@pytest.mark.parametrize("edit", ["overlapping", "gap", "reversed"])
def test_config_plan_with_hand_edited_stage_layers_is_refused(case, offline_plan, edit):
    """Stage layers overlapping the next stage's, leaving a gap or reversed: refused naming the stage (before, an
    IndexError or an internal error); a plan whose layers run past the step's is another model's (tested above)."""
    step, state, batch, _ = case
    stages = list(offline_plan.stages)
    first, last = stages[0].layers
    nxt_first, nxt_last = stages[1].layers
    if edit == "reversed":
        stages[0] = dataclasses.replace(stages[0], layers=(last, first))
    elif edit == "overlapping":
        stages[1] = dataclasses.replace(stages[1], layers=(nxt_first - 1, nxt_last))
    else:
        stages[1] = dataclasses.replace(stages[1], layers=(nxt_first + 1, nxt_last))
    edited = dataclasses.replace(offline_plan, stages=tuple(stages))
    with pytest.raises(ValueError, match=r"stage \d has layers .* consecutive ranges.*edited by hand"):
        autopp.parallelize(step, plan=edited).plan_for(*state, batch)


def test_printed_plan_names_zero1_sequence_parallel_and_all_of_its_peak(offline_plan):
    """The header says what the stage table cannot (ZeRO-1, sequence parallelism), and the memory parts add up to
    the peak printed beside them."""
    e = offline_plan.predicted
    assert e.mfu is None and "MFU -," in str(offline_plan)  # the host CPU has no datasheet peak
    plain = str(dataclasses.replace(offline_plan, zero1=False, sequence_parallel=False))
    assert "ZeRO-1" not in plain and "sequence parallel" not in plain and "other buffers" not in plain
    extra = 2**30  # e.g. the FSDP working set, which is in the peak but in none of the three parts
    shown = str(dataclasses.replace(offline_plan, zero1=True, sequence_parallel=True,
                                    predicted=dataclasses.replace(e, peak_memory_bytes_per_gpu=e.peak_memory_bytes_per_gpu
                                                                  + extra)))
    assert "ZeRO-1 (optimizer state sharded over data), sequence parallel" in shown.splitlines()[0]
    rest = e.peak_memory_bytes_per_gpu + extra - e.param_bytes - e.optimizer_bytes - e.activation_bytes
    assert f"other buffers {rest / 2**30:.2f} GiB" in shown


def test_a_step_with_a_frozen_teacher_plans_offline():
    """Distillation from a teacher behind ``stop_gradient`` (trial PLANS3): the teacher's layer has no backward, and
    the schedule simulator refused a stage whose backward takes no time ("b_time must be positive"), so
    ``plan_model`` (``autopp plan``) crashed where the same step with the teacher trained planned. A stage may
    have nothing to differentiate; the plan's prediction is no less than the teacher's forward alone."""
    import jax.numpy as jnp
    import optax

    from autopp.models import make_train_step
    from autopp.profiler import profile

    def mlp(sizes):
        return [{"w": jax.ShapeDtypeStruct((a, b), jnp.bfloat16)} for a, b in zip(sizes, sizes[1:])]

    def apply(layers, x):
        for layer in layers[:-1]:
            x = jax.nn.relu(x @ layer["w"])
        return x @ layers[-1]["w"]

    def loss(p, b):
        t = jax.lax.stop_gradient(apply(p["teacher"], b["x"]))
        return optax.softmax_cross_entropy(apply(p["student"], b["x"]), jax.nn.softmax(t)).mean()

    params = {"teacher": mlp([256] + [2048] * 8 + [100]), "student": mlp([256] + [256] * 4 + [100])}
    tx = optax.sgd(0.1)
    prof = profile(make_train_step(loss, tx), params, jax.eval_shape(tx.init, params),
                   {"x": jax.ShapeDtypeStruct((1, 256), jnp.bfloat16)}, cluster="1x8xH100")
    assert any(lay.backward_flops == 0 and lay.flops > 0 for lay in prof.layers)
    plan = plan_model(prof, "1x8xH100", global_batch=64)
    teacher_flops = sum(2 * a * b for a, b in zip([256] + [2048] * 8, [2048] * 8 + [100])) * 64
    assert plan.predicted.step_time_s > teacher_flops / 8 / 989e12  # (H100's dense bf16 peak over 8 devices)

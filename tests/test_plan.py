"""Plans: JSON round trip, exact replay, and clear errors for plans that do not fit."""

import dataclasses
import json

import jax
import numpy as np
import optax
import pytest

import autopp
from autopp import Plan
from tests._helpers import assert_trees_close, make_optimizer, make_step, run_steps, tiny_gpt, tiny_mlp


@pytest.fixture(scope="module")
def mlp_case():
    model = tiny_mlp()
    tx = make_optimizer()
    params = model.init(jax.random.key(0))
    state = (params, tx.init(params))
    batch = model.batch(jax.random.key(1), 16)
    step = make_step(model, tx)
    return step, state, batch


def test_json_round_trip_is_exact(mlp_case, tmp_path):
    step, state, batch = mlp_case
    plan = autopp.parallelize(step, num_stages=4, num_microbatches=4, schedule="gpipe",
                              devices=jax.devices()[:4]).plan_for(*state, batch)
    path = tmp_path / "plan.json"
    plan.to_json(path)
    again = Plan.from_json(path)
    assert again == plan
    assert again.to_json() == plan.to_json()
    assert Plan.from_json(plan.to_json()) == plan


def test_replayed_plan_runs_the_same_pipeline(mlp_case, tmp_path):
    step, state, batch = mlp_case
    original = autopp.parallelize(step, num_stages=4, num_microbatches=4, schedule="1f1b",
                                  devices=jax.devices()[4:])
    plan = original.plan_for(*state, batch)
    plan.to_json(tmp_path / "plan.json")
    replay = autopp.parallelize(step, plan=str(tmp_path / "plan.json"))
    assert replay.plan_for(*state, batch) == plan
    got, _ = run_steps(replay, state, batch)
    want, _ = run_steps(original, state, batch)
    jax.tree.map(np.testing.assert_array_equal, got, want)  # same programs, same order: bit-identical
    reference, _ = run_steps(jax.jit(step), state, batch)
    assert_trees_close(got, reference)
    assert {d.id for leaf in jax.tree.leaves(got[0]) for d in leaf.sharding.device_set} <= {4, 5, 6, 7}


def test_plan_for_another_step_is_refused(mlp_case):
    step, state, batch = mlp_case
    plan = autopp.parallelize(step, num_stages=2, devices=jax.devices()[:2]).plan_for(*state, batch)
    gpt = tiny_gpt()
    tx = make_optimizer()
    params = gpt.init(jax.random.key(0))
    other = autopp.parallelize(make_step(gpt, tx), plan=plan)
    with pytest.raises(ValueError, match=r"plan was made for another step \(model fingerprint"):
        other(params, tx.init(params), gpt.batch(jax.random.key(1), 8))
    bigger_batch = jax.tree.map(lambda x: np.concatenate([x, x]), batch)
    with pytest.raises(ValueError, match=r"plan was made for another step"):
        autopp.parallelize(step, plan=plan)(*state, bigger_batch)


def test_a_plan_replays_after_a_change_of_learning_rate(mlp_case):
    """A learning rate (any literal) changes no operation, shape or dtype: the plan still fits the step, and runs it
    as jit does. Before: refused as made for another step."""
    from autopp.models import make_train_step

    step, state, batch = mlp_case
    plan = autopp.parallelize(step, num_stages=2, devices=jax.devices()[:2]).plan_for(*state, batch)
    model, tx = tiny_mlp(), optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(5e-4, eps=1e-4))
    params = state[0]
    slower = make_train_step(model.loss, tx)
    replay = autopp.parallelize(slower, plan=plan)
    got, _ = run_steps(replay, (params, tx.init(params)), batch)
    want, _ = run_steps(jax.jit(slower), (params, tx.init(params)), batch)
    assert_trees_close(got, want)
    faster = make_train_step(model.loss, optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(1e-2, eps=1e-4)))
    assert autopp.parallelize(faster, plan=plan).plan_for(params, tx.init(params), batch).stages == plan.stages


def test_plan_on_missing_devices_is_refused(mlp_case):
    step, state, batch = mlp_case
    plan = autopp.parallelize(step, num_stages=2, devices=jax.devices()[6:]).plan_for(*state, batch)
    with pytest.raises(ValueError, match=r"on 2 devices, id\(s\) 6-7; ids 6-7 are not among the 4 devices "
                                         r"given \(0-3\)"):
        autopp.parallelize(step, plan=plan, devices=jax.devices()[:4])
    with pytest.raises(ValueError, match=r"; id 7 is not among the 7 devices given \(0-6\)"):  # (it said "7 are")
        autopp.parallelize(step, plan=plan, devices=jax.devices()[:7])
    # a plan for a cluster of 1024 devices names the missing ones as runs (it used to list 1016 ids, 5,194 characters)
    big = dataclasses.replace(plan, stages=tuple(dataclasses.replace(st, devices=tuple(range(512 * st.index, 512 * (
        st.index + 1))), mesh_shape={"data": 512}) for st in plan.stages))
    with pytest.raises(ValueError, match=r"on 1024 devices, id\(s\) 0-1023; ids 8-1023 are not among the 8 devices "
                                         r"given \(0-7\)\.") as refused:
        autopp.parallelize(step, plan=big, devices=jax.devices())
    assert len(str(refused.value)) < 400
    # exactly as many devices, named: the plan runs on them in its order (a plan made offline for 1x2 devices, or
    # on devices 6-7, on devices 2-3), the same computation
    moved = autopp.parallelize(step, plan=plan, devices=jax.devices()[2:4])
    replayed = moved.plan_for(*state, batch)
    assert [st.devices for st in replayed.stages] == [(2,), (3,)]
    got, _ = run_steps(moved, state, batch)
    assert {d.id for x in jax.tree.leaves(got[0]) for d in x.devices()} <= {2, 3}
    assert_trees_close(got, run_steps(autopp.parallelize(step, plan=plan), state, batch)[0])


def test_plan_with_conflicting_keywords_is_refused(mlp_case):
    step, state, batch = mlp_case
    plan = autopp.parallelize(step, num_stages=2, devices=jax.devices()[:2]).plan_for(*state, batch)
    with pytest.raises(ValueError, match=r"either plan= or num_stages, schedule, not both"):
        autopp.parallelize(step, plan=plan, num_stages=2, schedule="gpipe")
    with pytest.raises(ValueError, match=r"loss_reduction='sum' contradicts the plan's 'mean'"):
        autopp.parallelize(step, plan=plan, loss_reduction="sum")


def test_corrupted_and_unknown_version_plans(mlp_case, tmp_path):
    step, state, batch = mlp_case
    plan = autopp.parallelize(step, num_stages=2, devices=jax.devices()[:2]).plan_for(*state, batch)
    path = tmp_path / "plan.json"
    text = plan.to_json()
    path.write_text(text[: len(text) // 2])
    with pytest.raises(ValueError, match=r"is not valid JSON .* line \d+"):
        autopp.parallelize(step, plan=str(path))
    data = json.loads(text)
    data["schema_version"] = 99
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"schema version 99 is not supported: this autopp reads version\(s\) 1, 2"):
        Plan.from_json(path)
    data["schema_version"] = 2
    del data["stages"][0]["devices"]
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"malformed stage in plan: missing field\(s\) \['devices'\]"):
        Plan.from_json(path)
    with pytest.raises(ValueError, match=r"cannot read plan file"):
        Plan.from_json(tmp_path / "nope.json")


@pytest.mark.parametrize("field, value, message", [
    ("num_microbatches", "two", "num_microbatches='two' is not valid; it must be a positive int"),
    ("num_microbatches", -1, "num_microbatches=-1 is not valid"),
    ("schedule", "fastest", "schedule='fastest' is not valid; use one of gpipe"),
    ("loss_reduction", "max", "loss_reduction='max' is not valid; use mean or sum"),
    ("zero1", "yes", "zero1='yes' is not valid; it must be true or false"),
    ("schedule", "gpipe", "schedule='gpipe' is not valid; schedule_text \\(what runs\\) is not gpipe's grid"),
])
def test_edited_plan_fields_are_checked_on_load(mlp_case, field, value, message):
    """A hand-edited value fails when the plan is read, naming the field, not later inside JAX."""
    step, state, batch = mlp_case
    data = json.loads(autopp.parallelize(step, num_stages=2, devices=jax.devices()[:2]).plan_for(*state, batch)
                      .to_json())
    data[field] = value
    with pytest.raises(ValueError, match=message):
        Plan.from_json(json.dumps(data))


def test_from_json_takes_a_path_or_text_only(mlp_case):
    step, state, batch = mlp_case
    plan = autopp.parallelize(step, num_stages=2, devices=jax.devices()[:2]).plan_for(*state, batch)
    with pytest.raises(TypeError, match="got a dict; use Plan.from_dict"):
        Plan.from_json(plan.to_dict())
    for fd in (0, 123):  # not file descriptors (0 would read a plan from stdin)
        with pytest.raises(TypeError, match="takes a file path or JSON text, got int"):
            Plan.from_json(fd)
    assert Plan.from_dict(json.loads(plan.to_json())) == plan


def test_a_planned_plan_and_its_replay_report_the_same_per_microbatch_figures():
    """A plan's per-stage FLOPs and sends are per data replica's microbatch, whether ``plan_model`` made it from a
    profile or a replay completed it from the traced step (a user trial saw the replay's 4x larger at data 4)."""
    from autopp.planner import plan_model
    from autopp.profiler import Cluster, profile

    model = tiny_gpt()
    tx = make_optimizer()
    params = model.init(jax.random.key(0))
    state, batch = (params, tx.init(params)), model.batch(jax.random.key(1), 16)
    step = make_step(model, tx)
    cluster = Cluster.local(jax.devices()[:8])
    plan = plan_model(profile(step, *state, batch, cluster=cluster), cluster, global_batch=16, pipeline_degrees=(2,),
                      tensor_degrees=(1,), microbatch_sizes=(2,), fsdp=False, time_limit_s=2)
    assert plan.stages[0].mesh_shape["data"] == 4
    replayed = autopp.parallelize(step, plan=plan).plan_for(*state, batch)
    for planned, completed in zip(plan.stages, replayed.stages):
        assert completed.flops == pytest.approx(planned.flops, rel=0.05)
        assert completed.cut_bytes_after == pytest.approx(planned.cut_bytes_after, rel=0.05)


@pytest.mark.parametrize("field, value, message", [
    ("equations", [0, 5], r"stage 0 has equations \[0, 5\], but the stages' starts make it \[0, \d+\]"),
    ("layers", [0, 0], r"stage 1 has layers \[\d+, \d+\], but the stages' layers must be consecutive"),
])
def test_an_edited_stage_range_is_refused_on_replay(mlp_case, field, value, message):
    """A stage's equations or layers edited so that the stages leave a gap (a user trial: stage 0 set to equations
    0-5 ran 0-99 as before, silently; layers 0-0 left a layer unassigned in the printout) is refused, naming it;
    the unedited plan replays."""
    step, state, batch = mlp_case
    plan = autopp.parallelize(step, num_stages=2, devices=jax.devices()[:2]).plan_for(*state, batch)
    data = json.loads(plan.to_json())
    for st, layers in zip(data["stages"], ([0, 3], [4, 7])):  # as a planned plan names them too
        st["layers"] = layers
    replayed = autopp.parallelize(step, plan=Plan.from_json(json.dumps(data)), devices=jax.devices()[:2])
    assert [st.equations for st in replayed.plan_for(*state, batch).stages] == [st.equations for st in plan.stages]
    data["stages"][0][field] = value
    with pytest.raises(ValueError, match=r"(?s)" + message + r".*edited by hand"):
        autopp.parallelize(step, plan=Plan.from_json(json.dumps(data)),
                           devices=jax.devices()[:2]).plan_for(*state, batch)


def test_the_report_says_why_an_equal_split_stands():
    """``UNIFORM (gap 0%)`` read as a solver that found nothing to improve on a split of visibly unequal stages (a user
    trial: an encoder-decoder whose encoder layers cost 2.2x its decoder's); the report now says what the status
    means, and a one-stage plan says it has no split."""
    from autopp.core._plan import PlannerStats, split_summary

    stats = PlannerStats(wall_time_s=1.0, solver_status="UNIFORM", optimality_gap=0.0, candidates=3,
                         best_uniform_step_time_s=0.5)
    two = dataclasses.replace(_a_plan(2), planner=stats)
    assert "no CP-SAT split, balanced by compute and memory, came out faster" in str(two)
    assert "gap" not in split_summary(two)
    assert split_summary(dataclasses.replace(_a_plan(1), planner=stats)) == "none (one stage)"
    solved = dataclasses.replace(two, planner=dataclasses.replace(stats, solver_status="OPTIMAL", optimality_gap=0.01))
    assert split_summary(solved) == "OPTIMAL (gap 1%)"


def _a_plan(num_stages):
    model, tx = tiny_mlp(), make_optimizer()
    params = model.init(jax.random.key(0))
    return autopp.parallelize(make_step(model, tx), num_stages=num_stages, num_microbatches=2,
                              devices=jax.devices()[:num_stages]).plan_for(params, tx.init(params),
                                                                          model.batch(jax.random.key(1), 8))


def test_a_block_shared_across_depth_counts_on_every_stage_that_holds_it():
    """One block's weights applied at every depth (ALBERT): each stage keeps a copy and a gradient for it, as
    memory_report shows; the plan's parameter bytes said 0 for every stage but the first (a trial), unlike the
    planner's own plans."""
    import jax.numpy as jnp

    w = jax.random.normal(jax.random.key(0), (16, 16)) / 4

    def loss(p, x):
        for _ in range(8):
            x = jnp.tanh(x @ p["shared"])
        return jnp.mean(x ** 2)

    def step(p, x):
        return jax.tree.map(lambda a, g: a - 0.1 * g, p, autopp.grad(loss)(p, x))

    x = jax.random.normal(jax.random.key(1), (8, 16))
    plan = autopp.parallelize(step, num_stages=4, num_microbatches=2, devices=jax.devices()[:4]).plan_for({"shared": w},
                                                                                                          x)
    assert [st.param_bytes for st in plan.stages] == [w.nbytes] * 4


def test_a_one_program_plan_has_no_bubble_and_says_its_host_dispatch(mlp_case):
    """A plan of one stage and one program (planned on one local device) reported the host's dispatch time as
    "bubble" (trial AUDIO: 16% of a predicted step). A one-stage pipeline has none: the breakdown names it as the
    host's, and the parts add up to the step."""
    step, state, batch = mlp_case
    plan = autopp.parallelize(step, devices=jax.devices()[:1]).plan_for(*state, batch)
    e = plan.predicted
    assert plan.num_stages == 1 and e.dispatch_s > 0
    assert e.bubble_s == 0.0
    assert f"host dispatch {e.dispatch_s:.4g}" in str(plan)
    assert e.compute_s + e.dispatch_s + e.optimizer_s == pytest.approx(e.step_time_s, rel=0.05)


def test_a_frozen_teachers_weights_are_counted_where_they_are_read():
    """Trials KD and MAE: a frozen teacher passed beside the student (not differentiated) was left out of the plan
    table's "params MB": a stage running only teacher layers read 0 MB where it holds about 1 MB. The table counts
    every weight a stage reads: over the stages, the teacher's and the student's bytes, each once (hand count)."""
    import jax.numpy as jnp

    def mlp(sizes, key):
        keys = jax.random.split(key, len(sizes) - 1)
        return [{"w": jax.random.normal(k, (a, b)) / np.sqrt(a), "b": jnp.zeros(b)}
                for k, a, b in zip(keys, sizes[:-1], sizes[1:])]

    def apply(layers, x):
        for layer in layers[:-1]:
            x = jnp.tanh(x @ layer["w"] + layer["b"])
        return x @ layers[-1]["w"] + layers[-1]["b"]

    teacher, student = mlp([32] + [128] * 6 + [10], jax.random.key(1)), mlp([32, 16, 10], jax.random.key(2))
    tx = optax.sgd(0.1)

    def loss(sp, tp, batch):
        target = jax.nn.softmax(jax.lax.stop_gradient(apply(tp, batch["x"])))
        return -(target * jax.nn.log_softmax(apply(sp, batch["x"]))).sum(-1).mean()

    def step(sp, opt, tp, batch):
        value, grads = autopp.value_and_grad(loss)(sp, tp, batch)
        updates, opt = tx.update(grads, opt, sp)
        return optax.apply_updates(sp, updates), opt, value

    batch = {"x": jax.random.normal(jax.random.key(3), (16, 32))}
    plan = autopp.parallelize(step, num_stages=2, num_microbatches=4, devices=jax.devices()[:2]).plan_for(
        student, tx.init(student), teacher, batch)
    nbytes = sum(a.nbytes for a in jax.tree.leaves((teacher, student)))
    assert nbytes <= sum(st.param_bytes for st in plan.stages) <= nbytes * 1.01
    assert min(st.param_bytes for st in plan.stages) > 0.2 * nbytes

"""Bad input to autopp.parallelize: a ValueError/TypeError that names the offending value and the fix."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import autopp
from autopp.models import make_train_step
from tests._helpers import assert_trees_close, make_optimizer, make_step, tiny_mlp


@pytest.fixture(scope="module")
def mlp_setup():
    model = tiny_mlp()
    tx = make_optimizer()
    params = model.init(jax.random.key(0))
    return model, make_step(model, tx), (params, tx.init(params)), model.batch(jax.random.key(1), 16)


def test_step_without_autopp_grad(mlp_setup):
    model, _, state, batch = mlp_setup

    def step(params, batch):
        return jax.grad(model.loss)(params, batch)

    with pytest.raises(ValueError, match=r"(?s)no gradient with autopp.grad.*Replace jax.grad"):
        autopp.parallelize(step, num_stages=2, devices=jax.devices()[:2])(state[0], batch)


def test_batch_not_divisible(mlp_setup):
    model, step, state, batch = mlp_setup
    with pytest.raises(ValueError, match=r"(?s)num_microbatches=3.*args\[2\]\['x'\]: leading dimension 16.*e\.g\. 2"):
        autopp.parallelize(step, num_stages=2, num_microbatches=3, devices=jax.devices()[:2])(*state, batch)


def test_more_stages_than_devices(mlp_setup):
    _, step, _, _ = mlp_setup
    with pytest.raises(ValueError, match=r"(?s)num_stages=4 needs at least 4 devices, but 2 were given"):
        autopp.parallelize(step, num_stages=4, devices=jax.devices()[:2])


def test_uneven_devices(mlp_setup):
    _, step, _, _ = mlp_setup
    with pytest.raises(ValueError, match=r"(?s)8 devices cannot be split evenly into 3 stages"):
        autopp.parallelize(step, num_stages=3, devices=jax.devices())


def test_unknown_schedule_lists_valid_names(mlp_setup):
    _, step, _, _ = mlp_setup
    with pytest.raises(ValueError, match=r"(?s)unknown schedule 'pipedream'.*gpipe.*1f1b"):
        autopp.parallelize(step, num_stages=2, schedule="pipedream", devices=jax.devices()[:2])


@pytest.mark.parametrize("name", ["num_stages", "num_microbatches"])
@pytest.mark.parametrize("value", [0, -2])
def test_non_positive_counts(mlp_setup, name, value):
    _, step, _, _ = mlp_setup
    with pytest.raises(ValueError, match=rf"(?s){name} must be a positive int, got {value}"):
        autopp.parallelize(step, **{name: value})


def test_non_int_counts(mlp_setup):
    _, step, _, _ = mlp_setup
    with pytest.raises(TypeError, match=r"(?s)num_stages must be a positive int, got 2.5"):
        autopp.parallelize(step, num_stages=2.5)


def test_batch_leaf_not_an_array(mlp_setup):
    _, step, state, batch = mlp_setup
    bad = dict(batch, y=[[0.0] * 8] * 16)
    with pytest.raises(TypeError, match=r"(?s)args\[2\]\['y'\]\[0\]\[0\]: float.*and 120 more.*jnp.asarray"):
        autopp.parallelize(step, num_stages=2, devices=jax.devices()[:2])(*state, bad)


def test_unknown_loss_reduction(mlp_setup):
    _, step, _, _ = mlp_setup
    with pytest.raises(ValueError, match=r"(?s)loss_reduction='avg' is not one of \('mean', 'sum'\)"):
        autopp.parallelize(step, loss_reduction="avg")


def test_two_gradients_rejected(mlp_setup):
    model, _, state, batch = mlp_setup

    def step(params, batch):
        return autopp.grad(model.loss)(params, batch), autopp.value_and_grad(model.loss)(params, batch)

    with pytest.raises(ValueError, match=r"(?s)takes 2 gradients with autopp.grad / autopp.value_and_grad "
                                         r"\(autopp.grad\(loss\), autopp.value_and_grad\(loss\)\); exactly one is "
                                         r"supported.*jax.grad on the whole batch: the pipelined loss may read"):
        autopp.parallelize(step, num_stages=2, devices=jax.devices()[:2])(state[0], batch)


def test_a_gradient_under_vmap_is_refused_with_the_fix(mlp_setup):
    """autopp.grad under jax.vmap in a parallelized step raised JAX's "Batching rule for 'autopp_value_and_grad' not
    implemented" (a user trial); outside parallelize it is jax.grad, and vmaps as that."""
    model, _, state, batch = mlp_setup

    def step(params, batch):
        halves = jax.tree.map(lambda a: a.reshape(2, a.shape[0] // 2, *a.shape[1:]), batch)
        return jax.tree.map(lambda g: g.mean(0), jax.vmap(lambda b: autopp.grad(model.loss)(params, b))(halves))

    jax.jit(step)(state[0], batch)
    with pytest.raises(ValueError, match=r"called under jax.vmap in the step.*num_microbatches="):
        autopp.parallelize(step, num_stages=2, devices=jax.devices()[:2])(state[0], batch)


def test_per_task_gradients_under_vmap_are_pointed_to_the_whole_batch(mlp_setup):
    """``jax.vmap(autopp.grad)`` over two tasks' losses (MGDA's per-task gradients, trial MTL) was told that per-task
    gradients are jax.grad's inside the loss, where they are each microbatch's (MGDA weights [0.0575, 0.9425] for
    jit's [0.0009, 0.9991]). The refusal names the two ways that give jit's: jax.grad on the whole batch in the step,
    or a copy of the shared weights per task."""
    model, _, state, batch = mlp_setup

    def step(params, batch):
        scales = jnp.array([1.0, 2.0])  # two tasks: the same loss at two scales
        return jax.vmap(lambda c: autopp.grad(lambda p, b: c * model.loss(p, b))(params, batch))(scales)

    jax.jit(step)(state[0], batch)
    with pytest.raises(ValueError, match=r"(?s)\(PCGrad, MGDA, GradNorm\).*jax.grad in the step on the whole batch"
                                         r".*its own copy of the shared weights"):
        autopp.parallelize(step, num_stages=2, devices=jax.devices()[:2])(state[0], batch)


def test_gradient_accumulation_written_as_a_scan_is_pointed_at_num_microbatches(mlp_setup):
    """A user who accumulates gradients over microbatches with ``lax.scan`` takes one gradient per iteration; the
    refusal now says that autopp accumulates itself (a user trial found it said only to call it once), and that a
    loop of optimizer steps (PPO's epochs of minibatch updates, trial RL, told to drop the loop) is several steps."""
    model, _, state, batch = mlp_setup

    def step(params, batch):
        chunks = jax.tree.map(lambda x: x.reshape(2, -1, *x.shape[1:]), batch)

        def body(acc, chunk):
            return jax.tree.map(jnp.add, acc, autopp.grad(model.loss)(params, chunk)), None

        return jax.lax.scan(body, jax.tree.map(jnp.zeros_like, params), chunks)[0]

    with pytest.raises(ValueError, match=r"(?s)summing gradients over microbatches is what autopp does.*a loop of "
                                         r"optimizer steps \(PPO's minibatches\) is several steps"):
        autopp.parallelize(step, num_stages=2, devices=jax.devices()[:2])(state[0], batch)


def test_grad_of_integer_input_is_type_error(mlp_setup):
    def step(n, batch):
        return autopp.grad(lambda n, b: jnp.sum(b) * n)(n, batch)

    with pytest.raises(TypeError, match=r"(?s)int32.*allow_int=True"):
        autopp.parallelize(step, num_stages=1, devices=jax.devices()[:1])(jnp.int32(2), jnp.ones((4, 2)))


def test_a_loss_input_that_does_not_split_by_example_is_rejected(mlp_setup):
    """One more row than the batch (it grows with the batch, so it is no whole-batch value, but not by examples); the
    message names it as the loss's second argument."""
    model, _, state, batch = mlp_setup

    def step(params, batch):
        padded = jnp.concatenate([batch["x"], batch["x"][:1]])
        return autopp.grad(lambda p, x, b: model.loss(p, b) + jnp.sum(x) * 0)(params, padded, batch)

    with pytest.raises(ValueError, match=r"(?s)do not scale with the batch.*loss input args\[1\] \(computed in the "
                                         r"step from the batch\).*no leading dimension divisible by 2"):
        autopp.parallelize(step, num_stages=2, num_microbatches=2, devices=jax.devices()[:2])(state[0], batch)


def test_batch_leaf_without_a_batch_axis_is_warned_about(mlp_setup):
    """A per-feature weight vector in the batch is split along axis 0 like the examples; the step still traces at
    microbatch size here (its mean does not change), so the warning is all the user sees. It also names the layout it
    is wrong for that a user trial (RECSYS) took for right: multi-hot ids flattened with their example indices."""
    model, _, state, batch = mlp_setup
    weighted = {**batch, "w": jnp.linspace(0.5, 1.5, 64)}

    def step(params, batch):
        return autopp.grad(lambda p, b: model.loss(p, b) * jnp.mean(b["w"]))(params, batch)

    with pytest.warns(UserWarning, match=r"(?s)different leading dimensions \(args\[1\]\['w'\]: 64, "
                                         r"args\[1\]\['x'\]: 16.*move such a leaf to another argument.*"
                                         r"multi-hot ids flattened .* pad such values per example"):
        autopp.parallelize(step, num_stages=2, num_microbatches=2, devices=jax.devices()[:2],
                           loss_reduction="mean").plan_for(state[0], weighted)


def test_batch_leaves_of_other_lengths_are_not_warned_about_at_one_microbatch(mlp_setup):
    """At one microbatch nothing is split, so the warning about leaves split alike (which a sparse batch and
    jraph-style graphs got at ``num_microbatches=1``, user trials CTRL and GNN) says nothing true."""
    model, _, state, batch = mlp_setup
    weighted = {**batch, "w": jnp.linspace(0.5, 1.5, 64)}

    def step(params, batch):
        return autopp.grad(lambda p, b: model.loss(p, b) * jnp.mean(b["w"]))(params, batch)

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        got = autopp.parallelize(step, num_stages=2, num_microbatches=1, devices=jax.devices()[:2])(state[0],
                                                                                                     weighted)
    assert not [str(w.message) for w in seen if "leading dimensions" in str(w.message)]
    want = jax.jit(step)(state[0], weighted)
    for a, b in zip(jax.tree.leaves(autopp.gather(got)), jax.tree.leaves(want)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_a_leaf_without_the_batch_s_length_is_named_as_such(mlp_setup):
    """A count of shape (1,) in a batch of 16 at 2 microbatches: the refusal advised "a num_microbatches that divides
    the batch size (e.g. 1)", as if the batch were of size 1 (user trial NOISE6). It says the leaf is not the batch's
    length and where such a leaf belongs."""
    model, _, state, batch = mlp_setup
    counted = {**batch, "n": jnp.ones((1,))}

    def step(params, batch):
        return autopp.grad(lambda p, b: model.loss(p, b) * b["n"][0])(params, batch)

    with pytest.raises(ValueError, match=r"(?s)args\[1\]\['n'\]: leading dimension 1\nTheir leading dimension is "
                                         r"not the batch's \(16 in most leaves\).*belongs in another argument") as e:
        autopp.parallelize(step, num_stages=2, num_microbatches=2, devices=jax.devices()[:2])(state[0], counted)
    assert "e.g. 1" not in str(e.value)


def test_batches_of_several_sizes_are_told_a_count_that_splits_them_all(mlp_setup):
    """16 labelled and 48 unlabelled examples at 3 microbatches: the refusal took the labelled leaves for leaves
    without a batch axis (user trial SEMISUP). It names a count that splits both, 2."""
    model, _, state, batch = mlp_setup
    unlabelled = jnp.ones((48, 16))

    def step(params, batch, extra):
        return autopp.grad(lambda p, b, u: model.loss(p, b) + 0.1 * jnp.mean(u @ p["layers"][0]["w"]))(params, batch,
                                                                                                     extra)

    with pytest.raises(ValueError, match=r"(?s)divides every batch leaf's leading dimension \(e\.g\. 2\)") as e:
        autopp.parallelize(step, num_stages=2, num_microbatches=3, devices=jax.devices()[:2],
                           batch_argnums=(1, 2))(state[0], batch, unlabelled)
    assert "not the batch's" not in str(e.value)


def test_step_that_fails_only_at_microbatch_size_says_so(mlp_setup):
    model, _, state, batch = mlp_setup
    scaled = {**batch, "scale": jnp.ones((16,))}  # per feature (16 inputs, as many as examples: no warning)

    def step(params, batch):
        return autopp.grad(lambda p, b: model.loss(p, {**b, "x": b["x"] * b["scale"]}))(params, batch)

    with pytest.raises(
            ValueError, match=r"(?s)traces at the full batch but fails at microbatch size .*num_microbatches=2.*"
                              r"Incompatible shapes.*belongs in another argument"):
        autopp.parallelize(step, num_stages=2, num_microbatches=2, devices=jax.devices()[:2]).plan_for(state[0],
                                                                                                        scaled)


def test_keyword_arguments_rejected(mlp_setup):
    _, step, state, batch = mlp_setup
    with pytest.raises(TypeError, match=r"(?s)positionally.*batch"):
        autopp.parallelize(step, num_stages=1, devices=jax.devices()[:1])(*state, batch=batch)


def test_a_launched_process_that_never_joined_is_refused(mlp_setup, monkeypatch):
    """Under `autopp launch -n 2` without autopp.distributed.initialize(), each process would train alone."""
    _, step, state, batch = mlp_setup
    monkeypatch.setenv("AUTOPP_NUM_PROCESSES", "2")
    with pytest.raises(ValueError, match=r"started as one of 2 .* Call autopp.distributed.initialize\(\) first"):
        autopp.parallelize(step, num_stages=2, devices=jax.devices()[:2])(*state, batch)


@pytest.mark.parametrize("counts, message", [
    (dict(num_microbatches=3, schedule="interleaved-1f1b"), r"num_microbatches=3: interleaved 1F1B needs .* e\.g\. "
                                                            r"num_microbatches=2 or 4\."),
    (dict(num_microbatches=3, schedule="dualpipev"), r"dualpipev needs num_microbatches >= 2 \* num_ranks.*at least 4"),
    (dict(num_microbatches=4, num_stages=2, recompute=("full",)), r"recompute has 1 entries for 2 stages"),
    (dict(num_microbatches=4, schedule="interleaved-1f1b", recompute=("full", "none")),
     r"recompute has 2 entries for 4 stages \(model chunks: 2 device groups x 2\)"),
    (dict(schedule="0F0 0F1 1F0 1F1 1B0 1B1 0B0 0B1", num_microbatches=4, num_stages=1),
     r"the schedule has 2 microbatch\(es\) but num_microbatches=4"),
    (dict(schedule="0F0 0F1 3F0 3B0 3F1 3B1 0B0 0B1\n1F0 2F0 1F1 2F1 2B0 1B0 2B1 1B1", virtual_stages=3),
     r"fixes its own model chunks per device group \(here 2\); drop virtual_stages=3"),
])
def test_count_and_schedule_mistakes_are_refused_at_parallelize(counts, message):
    """Refused when parallelize() is called, naming the value and a fix, not at the first step."""
    with pytest.raises(ValueError, match=message):
        autopp.parallelize(lambda p, b: p, devices=jax.devices()[:2], **counts)


@pytest.mark.parametrize("value", [True, 1])
def test_recompute_that_is_not_a_mode_is_refused_naming_the_modes(value):
    with pytest.raises(TypeError, match=r"recompute=(True|1) \((bool|int)\) must be a mode name, one of none, "
                                        r"full, selective \(e\.g\. recompute='full' for True\)"):
        autopp.parallelize(lambda p, b: p, num_stages=2, recompute=value, devices=jax.devices()[:2])


def test_a_custom_schedule_may_repeat_its_chunks_as_virtual_stages():
    text = "0F0 0F1 3F0 3B0 3F1 3B1 0B0 0B1\n1F0 2F0 1F1 2F1 2B0 1B0 2B1 1B1"
    step = autopp.parallelize(lambda p, b: p, schedule=text, virtual_stages=2, devices=jax.devices()[:2])
    assert step.config.schedule.num_stages == 4


def test_batch_argnums_that_miss_the_batch_is_named(mlp_setup):
    """``batch_argnums`` pointing at an argument the loss does not read (a momentum optimizer's state): refused
    naming it."""
    model, _, (params, _), batch = mlp_setup
    tx = optax.sgd(0.1, momentum=0.9)
    step, state = make_step(model, tx), (params, tx.init(params))
    with pytest.raises(ValueError, match=r"(?s)reads nothing from the batch argument\(s\) batch_argnums=\(1,\) "
                                         r"\(args\[1\]\).*by default the last argument, 2"):
        autopp.parallelize(step, num_stages=2, num_microbatches=2, batch_argnums=1,
                           devices=jax.devices()[:2])(*state, batch)


def test_numpy_counts_single_devices_and_mesh_arrays(mlp_setup):
    """NumPy integers are counts like ints (they used to be refused with "num_stages must be a positive int, got
    np.int64(2)"); one Device is a list of one; a 2-D array of devices (a mesh's) is refused naming .tolist()."""
    import numpy as np

    _, step, state, batch = mlp_setup
    *want, _ = jax.jit(step)(*state, batch)
    piped = autopp.parallelize(step, num_stages=np.int64(2), num_microbatches=np.int32(2), devices=jax.devices()[:2])
    assert piped.config.num_stages == 2 and type(piped.config.num_stages) is int
    *got, _ = piped(*state, batch)
    assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.allclose(a, b, rtol=1e-5, atol=1e-7)), got, want))
    one = autopp.parallelize(step, num_stages=1, devices=jax.devices()[3])
    assert one.devices == [jax.devices()[3]]
    with pytest.raises(TypeError, match=r"devices is a 2-D array of devices .*devices\.tolist\(\)"):
        autopp.parallelize(step, devices=np.array(jax.devices()).reshape(4, 2))


def test_a_step_inside_a_jax_transformation_or_pickled_is_refused(mlp_setup):
    """Called under jax.jit / eval_shape (before or after its first call), the step says so instead of failing in
    its build ("'sharding' attribute is not available on traced array") or while issuing; pickling and deepcopy
    say what to save instead, and copy.copy shares the compiled programs."""
    import copy
    import pickle

    _, step, state, batch = mlp_setup
    piped = autopp.parallelize(step, num_stages=2, num_microbatches=2, devices=jax.devices()[:2])
    for call in (lambda: jax.jit(piped)(*state, batch), lambda: jax.eval_shape(piped, *state, batch)):
        with pytest.raises(TypeError, match=r"called inside a JAX transformation .*Call it outside them"):
            call()
    piped(*state, batch)
    with pytest.raises(TypeError, match=r"called inside a JAX transformation"):
        jax.jit(piped)(*state, batch)
    for save in (pickle.dumps, copy.deepcopy):
        with pytest.raises(TypeError, match=r"cannot be pickled or deep-copied\. Save its plan instead"):
            save(piped)
    twin = copy.copy(piped)
    assert twin._cache is piped._cache
    twin(*state, batch)


def test_too_many_model_chunks_are_refused_in_the_keywords_that_set_them(mlp_setup):
    """interleaved-1f1b and dualpipev cut the model into several chunks per device group: a model with too few
    operations for them is refused naming virtual_stages (or dualpipev's 2 chunks), not only num_stages (which the
    user had set within the limit), and the suggested setting does plan."""
    import re

    _, step, state, batch = mlp_setup
    with pytest.raises(ValueError, match=r"cannot be split into 32 pipeline stages \(4 device groups x 8 model chunks "
                                         r"each\); use num_stages x virtual_stages <= \d+ \(here 4 x 8\)") as refused:
        autopp.parallelize(step, num_stages=4, schedule="interleaved-1f1b", virtual_stages=8, num_microbatches=4,
                           devices=jax.devices()[:4]).plan_for(*state, batch)
    suggested = int(re.search(r"e\.g\. virtual_stages=(\d+)", str(refused.value)).group(1))
    plan = autopp.parallelize(step, num_stages=4, schedule="interleaved-1f1b", virtual_stages=suggested,
                              num_microbatches=4, devices=jax.devices()[:4]).plan_for(*state, batch)
    assert plan.num_stages == 4 * suggested
    from autopp.models import MLP, MLPConfig

    small = MLP(MLPConfig(sizes=(4, 4, 4)))  # 9 operations: fewer than dualpipev's 2 x 8 chunks
    params = small.init(jax.random.key(0))
    tx = make_optimizer()
    with pytest.raises(ValueError, match=r"\(8 device groups x 2 model chunks each\); use num_stages <= 4 \(dualpipev "
                                         r"runs 2 model chunks per device group\)"):
        autopp.parallelize(make_step(small, tx), num_stages=8, schedule="dualpipev", num_microbatches=16).plan_for(
            params, tx.init(params), small.batch(jax.random.key(1), 16))


def test_a_scan_too_heavy_for_the_model_chunks_is_refused_naming_them():
    """A scan over time holding most of the loss's work cannot be cut: with dualpipev's 2 model chunks per device
    group, ``num_stages=2`` asks for 4 stages, and the refusal said "4 stages cannot balance ... use num_stages <= 2",
    the setting given (trial WORLD). It names the chunks, and its fix plans."""
    def loss(p, b):
        hs = jax.lax.scan(lambda h, x: (jnp.tanh(h @ p["w"] + x), h), jnp.zeros_like(b["x"][:, 0]),
                          jnp.swapaxes(b["x"], 0, 1))[1]
        return jnp.mean((hs @ p["o"] - jnp.swapaxes(b["y"], 0, 1)) ** 2)

    def step(p, b):
        loss_value, g = autopp.value_and_grad(loss)(p, b)
        return jax.tree.map(lambda a, d: a - 0.1 * d, p, g), loss_value

    p = {"w": jnp.eye(8) * 0.5, "o": jnp.ones((8, 1))}
    b = {"x": jnp.ones((8, 6, 8)), "y": jnp.ones((8, 6, 1))}
    with pytest.raises(ValueError, match=r"so 4 pipeline stages \(2 device groups x 2 model chunks each\) cannot "
                                         r"balance\..* Or use num_stages <= 1 \(dualpipev runs 2 model chunks per "
                                         r"device group\)"):
        autopp.parallelize(step, num_stages=2, schedule="dualpipev", num_microbatches=4,
                           devices=jax.devices()[:2]).plan_for(p, b)
    assert autopp.parallelize(step, num_stages=1, num_microbatches=4,
                              devices=jax.devices()[:1]).plan_for(p, b).num_stages == 1


V_SCHEDULE = "0F0 0F1 3F0 3B0 3F1 3B1 0B0 0B1\n1F0 2F0 1F1 2F1 2B0 1B0 2B1 1B1"  # 2 rows, 4 stages (a user trial's)


@pytest.mark.parametrize("kw, message", [
    # the schedule's rows decide the stage count: said before counting devices
    (dict(num_stages=3, devices=2), r"schedule has 2 row\(s\) \(device groups\) but num_stages=3"),
    # its rows are device groups, and the advice must not be a num_stages the schedule refuses
    (dict(devices=3), r"cannot be split evenly into the schedule's 2 rows \(device groups\); pass a multiple of 2 "
                      r"devices, e\.g\. devices=jax\.devices\(\)\[:2\], or a schedule with a number of rows"),
    (dict(schedule=V_SCHEDULE.lower(), devices=2), r"actions are written in upper case \('0F0'"),
    (dict(schedule="0F0 0F1 1F0 1F1 1B0 1B1 0B0 0B1\nrank 1 |", devices=2), r"rank 1 runs no action"),
], ids=["rows-vs-num_stages", "rows-vs-devices", "lower-case", "empty-row"])
def test_a_text_schedule_s_refusals_name_its_rows(mlp_setup, kw, message):
    _, step, _, _ = mlp_setup
    kw = {"schedule": V_SCHEDULE, **kw}
    kw["devices"] = jax.devices()[:kw["devices"]]
    with pytest.raises(ValueError, match=r"(?s)" + message):
        autopp.parallelize(step, **kw)


def test_a_text_schedule_of_more_stages_than_the_loss_has_says_how_many(mlp_setup):
    """The advice for a text schedule is a schedule with fewer stages (virtual_stages= is refused for one)."""
    model, step, state, batch = mlp_setup
    many = " ".join([f"{s}F0" for s in range(200)] + [f"{s}B0" for s in reversed(range(200))])
    with pytest.raises(ValueError, match=r"(?s)cannot be split into 200 pipeline stages \(1 device group x 200 model "
                                         r"chunks each\); give a schedule of at most \d+ stages"):
        autopp.parallelize(step, schedule=many, devices=jax.devices()[:1]).plan_for(*state, batch)


def test_a_call_with_an_argument_missing_names_the_signature(mlp_setup):
    """``step.memory_report(params, opt_state)`` (the batch forgotten) used to fail on "args[1][0].count: a scalar has
    no batch dimension" (a user trial): the missing argument shifted the optimizer state into the batch's place."""
    _, step, state, batch = mlp_setup
    pipelined = autopp.parallelize(step, num_stages=2, devices=jax.devices()[:2])
    with pytest.raises(TypeError, match=r"the step train_step\(params, opt_state, batch\) was given 2 positional "
                                        r"argument\(s\): missing a required argument: 'batch'"):
        pipelined.memory_report(*state)


def test_shapes_without_values_are_refused_by_a_running_call_and_taken_by_plan_for(mlp_setup):
    """``ShapeDtypeStruct``s plan (``plan_for``) but cannot run: a call or a trace with them says so (it failed with a
    raw JAX error, a user trial)."""
    _, step, state, batch = mlp_setup
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), (*state, batch))
    pipelined = autopp.parallelize(step, num_stages=2, devices=jax.devices()[:2])
    assert pipelined.plan_for(*abstract).num_stages == 2
    for run in (pipelined, pipelined.trace):
        with pytest.raises(TypeError, match=r"runs the step, but \d+ argument leaf\(s\) are jax.ShapeDtypeStruct"):
            run(*abstract)
    # after a real step of the same signature too (it raised JAX's InvalidInputException there, a user trial)
    pipelined(*state, batch)
    for run in (pipelined, pipelined.trace):
        with pytest.raises(TypeError, match=r"runs the step, but \d+ argument leaf\(s\) are jax.ShapeDtypeStruct"):
            run(*abstract)


def test_a_batch_no_interleaved_microbatch_count_divides(mlp_setup):
    """interleaved-1f1b's microbatch count is a multiple of the device groups: for a batch of 7 on 2 groups none
    divides it, and the message says so and what to change (it said "pass num_microbatches=", which no count
    satisfies, a user trial)."""
    model, step, state, _ = mlp_setup
    pipelined = autopp.parallelize(step, num_stages=2, schedule="interleaved-1f1b", devices=jax.devices()[:2])
    with pytest.raises(ValueError, match=r"no count does for a batch of 7: use a batch size that is a multiple of 2 "
                                         r"\(e\.g\. 6 or 8\), or schedule='1f1b'"):
        pipelined.plan_for(*state, model.batch(jax.random.key(1), 7))


def test_a_value_made_in_the_step_with_the_batch_on_another_axis_is_named(mlp_setup):
    """Noise drawn in the step as (layers, batch, features) reaches every microbatch whole; the message says which
    loss input it is, as the loss's third argument, and how to lay it out (it blamed a batch leaf without a batch axis,
    a user trial)."""
    model, _, state, batch = mlp_setup
    tx = make_optimizer()

    def loss(params, batch, noise):
        return model.loss(params, batch) + (noise[0] * batch["x"][:, :1]).mean()

    def step(params, opt_state, batch):
        noise = jax.random.normal(jax.random.key(0), (3, batch["x"].shape[0], 1))
        value, grads = autopp.value_and_grad(loss)(params, batch, noise)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    with pytest.raises(ValueError, match=r"(?s)fails at microbatch size.*passed to every microbatch whole: loss input "
                                         r"args\[2\] of shape \(3, 16, 1\) \(batch axis 1\).*jnp.moveaxis"):
        autopp.parallelize(step, num_stages=2, num_microbatches=4, devices=jax.devices()[:2]).plan_for(*state, batch)


def test_a_table_in_the_batch_as_long_as_the_batch_is_refused():
    """A position table ``[T, d]`` put in the batch, read by ``arange(T)``, with ``T`` equal to the batch size: split
    like the batch, every microbatch would read clamped rows (a user trial: 2.4e-3 from jit after 3 steps, silently).
    Refused, naming the leaf; a per-example read of it (row 0 of each microbatch) is not."""
    tx = optax.sgd(0.1)
    B = T = 8

    def loss(w, batch):
        table = batch["table"][jnp.arange(T)]  # [T, 4]
        return jnp.mean((batch["x"] @ w + table[None]) ** 2)

    def step(w, opt_state, batch):
        value, grads = autopp.value_and_grad(loss)(w, batch)
        updates, opt_state = tx.update(grads, opt_state, w)
        return optax.apply_updates(w, updates), opt_state, value

    w = jnp.ones((4, 4)) * 0.1
    batch = {"x": jnp.ones((B, T, 4)), "table": jnp.arange(T * 4.0).reshape(T, 4)}
    pipelined = autopp.parallelize(step, num_stages=2, num_microbatches=4, devices=jax.devices()[:2])
    with pytest.raises(ValueError, match=r"reads batch leaf args\[2\]\['table'\] at fixed positions up to 7 along its "
                                         r"first axis, past the 2 rows of a microbatch.*another argument"):
        pipelined.plan_for(w, tx.init(w), batch)

    def first_row(w, batch):  # row 0 of each microbatch: within its rows
        return jnp.mean((batch["x"] @ w + batch["table"][jnp.zeros((1,), jnp.int32)]) ** 2)

    def step_first_row(w, opt_state, batch):
        value, grads = autopp.value_and_grad(first_row)(w, batch)
        updates, opt_state = tx.update(grads, opt_state, w)
        return optax.apply_updates(w, updates), opt_state, value

    with pytest.warns(UserWarning, match="reads some examples' values for all of them"):  # (not refused: warned,
        autopp.parallelize(step_first_row, num_stages=2, num_microbatches=4, devices=jax.devices()[:2]).plan_for(
            w, tx.init(w), batch)  # as each microbatch's row 0 is not the whole batch's, since the eighteenth session)


@pytest.mark.parametrize("check", ["check", "debug_check", "automatic"])
def test_checkify_of_a_step_is_refused_where_it_cannot_see(mlp_setup, check):
    """checkify does not see inside the loss autopp traces: a debug_check and checkify's automatic NaN checks there
    were lost silently (a trial: jit reported "nan generated by primitive: log", autopp nothing), and checkify.check
    raised JAX's "not functionalized" error although the step was checkified."""
    from jax.experimental import checkify

    model, _, state, batch = mlp_setup

    def loss(params, batch):
        if check != "automatic":
            getattr(checkify, check)(jnp.all(jnp.isfinite(batch["x"])), "x is not finite")
        return model.loss(params, batch)

    def step(params, batch):
        return autopp.grad(loss)(params, batch)

    errors = checkify.all_checks if check == "automatic" else checkify.user_checks
    with pytest.raises(ValueError, match=r"checkify does not see inside the loss .* Check in the step"):
        autopp.parallelize(checkify.checkify(step, errors=errors), num_stages=2,
                           devices=jax.devices()[:2])(state[0], batch)


@pytest.mark.filterwarnings("ignore:autopp.parallelize. the loss reads some examples")  # (its NaN from x[0, 0])
def test_debug_nans_raises_a_floating_point_error_naming_the_task(mlp_setup):
    """With jax_debug_nans a NaN in a stage's program leaked JAX's internal exception (``InternalFloatingPointError
    ('jit', 'nan')``, no FloatingPointError subclass, naming nothing: a trial); it is jit's exception type, naming
    the pipeline's task."""
    model, _, state, batch = mlp_setup

    def loss(params, batch):
        return model.loss(params, batch) + jnp.log(batch["x"][0, 0] - 1e9)  # nan: the log of a negative number

    def step(params, batch):
        return autopp.grad(loss)(params, batch)

    pipelined = autopp.parallelize(step, num_stages=2, devices=jax.devices()[:2], loss_reduction="mean")
    jax.block_until_ready(pipelined(state[0], batch))  # built (and compiled) before the check is on
    jax.config.update("jax_debug_nans", True)
    try:
        with pytest.raises(FloatingPointError, match=r"invalid value \(nan\) encountered in .*jax_debug_nans"):
            jax.block_until_ready(pipelined(state[0], batch))
    finally:
        jax.config.update("jax_debug_nans", False)


def test_a_fixed_number_of_the_batch_s_examples_is_refused_for_what_it_is(mlp_setup):
    """A loss on the first 8 examples (x[:8]) keeps its size whatever the batch: it was refused as reading nothing
    from the batch, with advice to change batch_argnums, which was right (a trial)."""
    model, _, state, batch = mlp_setup

    def step(params, batch):
        return autopp.grad(model.loss)(params, jax.tree.map(lambda a: a[:2], batch))

    with pytest.raises(ValueError, match=r"keep their size when the batch grows .*slice a fraction of the batch"):
        autopp.parallelize(step, num_stages=2, num_microbatches=2, devices=jax.devices()[:2])(state[0], batch)


def test_a_replay_buffer_taken_as_the_batch_is_said_to_be(mlp_setup):
    """A DQN step ``step(params, idx, buffer)`` keeps its replay buffer on the device as the last argument, which
    autopp takes as the batch (trial RL); the loss reads the rows the indices pick, a fixed number. The refusal said to
    slice a fraction of the batch; it says which arguments it took as the batch and to name the indices' instead,
    which then runs as jit."""
    model, _, state, batch = mlp_setup
    idx = jnp.arange(8)

    def step(params, idx, buffer):
        return autopp.grad(model.loss)(params, jax.tree.map(lambda a: a[idx], buffer))

    with pytest.raises(ValueError, match=r"(?s)from the batch \(batch_argnums=\(2,\)\).*a replay buffer's rows picked "
                                         r"by indices.*name it in batch_argnums"):
        autopp.parallelize(step, num_stages=2, num_microbatches=2, devices=jax.devices()[:2])(state[0], idx, batch)
    got = autopp.parallelize(step, num_stages=2, num_microbatches=2, devices=jax.devices()[:2], batch_argnums=1)(
        state[0], idx, batch)
    assert_trees_close(got, jax.jit(step)(state[0], idx, batch), rtol=1e-6, atol=1e-7)


def test_a_python_branch_on_an_argument_names_the_step_and_the_argument(mlp_setup):
    """``if train:`` on an argument of the step (user trial LEAK): jit names the user's function and ``train``; autopp
    named its own flattened step (``flat_step at core/_trace.py``) and ``leaves[9]``. It names the step, its line and
    the argument, and says what to do instead (parallelize has no static_argnums)."""
    model, _, state, batch = mlp_setup

    def gated_step(params, train, batch):
        loss, grads = autopp.value_and_grad(model.loss)(params, batch)
        if train:
            params = jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)
        return params, loss

    with pytest.raises(jax.errors.ConcretizationTypeError, match=r"train"):  # what jit says, the independent truth
        jax.jit(gated_step)(state[0], True, batch)
    line = gated_step.__code__.co_firstlineno
    with pytest.raises(TypeError, match=rf"(?s)the step gated_step \(.*test_errors.py:{line}\) uses the value of "
                                        r"train \(args\[1\]\) in Python.*jnp.where.*functools.partial"):
        autopp.parallelize(gated_step, num_stages=2, num_microbatches=2, devices=jax.devices()[:2])(state[0], True,
                                                                                                     batch)


class _Box:  # a pytree node flattened without keys (as Equinox's State is)
    def __init__(self, value):
        self.value = value


jax.tree_util.register_pytree_node(_Box, lambda b: ((b.value,), None), lambda _, xs: _Box(xs[0]))


def test_an_aux_leaf_of_a_node_without_keys_is_named_by_the_node_s_type():
    """An Equinox ``State`` returned unchanged as aux was refused naming its leaf ``aux[<flat index 0>]`` (trial
    STATE): nothing said which leaf. A node flattened without keys is named by its type."""
    def loss(p, state, b):
        x, y = b
        return jnp.mean((jnp.tanh(x @ p["w"]) - y) ** 2), {"state": state}

    def step(p, state, b):
        (value, aux), g = autopp.value_and_grad(loss, has_aux=True)(p, state, b)
        return jax.tree.map(lambda a, d: a - 0.1 * d, p, g), aux["state"], value

    p = {"w": jnp.eye(4)}
    b = (jnp.ones((8, 4)), jnp.zeros((8, 4)))
    with pytest.raises(ValueError, match=r"returns one of its inputs unchanged as aux\['state'\]\[<_Box leaf 0>\]"):
        autopp.parallelize(step, num_stages=2, num_microbatches=2, devices=jax.devices()[:2])(p, _Box(jnp.ones(3)), b)


def test_a_gradient_of_rows_gathered_in_the_step_is_refused_naming_them_as_the_gradients_are():
    """A gradient with respect to embedding rows the step gathers by the batch's ids (a sparse update scattered by
    hand) is refused, as it would be per microbatch; the refusal numbered flattened leaves, "loss argument #2, loss
    argument #3", where the loss had three arguments and its #2 was not differentiated (trial KGE). It names them
    as the gradients come back."""
    def loss(dense, rows, r):
        return jnp.mean(jnp.sum(jnp.tanh(rows["h"] @ dense["w"]) * dense["rel"][r] * rows["t"], -1) ** 2)

    def step(p, b):
        rows = {"h": p["ent"][b["h"]], "t": p["ent"][b["t"]]}
        value, (gd, gr) = autopp.value_and_grad(loss, argnums=(0, 1))({"rel": p["rel"], "w": p["w"]}, rows, b["r"])
        ent = p["ent"].at[b["h"]].add(-0.1 * gr["h"]).at[b["t"]].add(-0.1 * gr["t"])
        return {"ent": ent, "rel": p["rel"] - 0.1 * gd["rel"], "w": p["w"] - 0.1 * gd["w"]}, value

    k = jax.random.split(jax.random.key(0), 6)
    p = {"ent": jax.random.normal(k[0], (50, 8)), "rel": jax.random.normal(k[1], (5, 8)),
         "w": jax.random.normal(k[2], (8, 8))}
    b = {"h": jax.random.randint(k[3], (16,), 0, 50), "r": jax.random.randint(k[4], (16,), 0, 5),
         "t": jax.random.randint(k[5], (16,), 0, 50)}
    with pytest.raises(ValueError, match=r"with respect to the loss's inputs computed from the batch in the step whose "
                                         r"gradients are grads\[1\]\['h'\], grads\[1\]\['t'\], which is split"):
        autopp.parallelize(step, num_stages=2, num_microbatches=4, devices=jax.devices()[:2])(p, b)


def test_parameters_stacked_per_example_are_named_with_the_fix():
    """Personalised heads stacked per client, ``[C, H, K]``, vmapped with the clients' data (trial FED): the step fails
    at microbatch size, and the refusal's hints were about batch leaves and grouped examples. It names the
    parameter with the batch's leading dimension and the fix (an index per example, read as ``heads[ids]``)."""
    c, n, d, h, k = 4, 4, 6, 16, 3
    params = {"w1": 0.3 * jax.random.normal(jax.random.key(0), (d, h)),
              "heads": 0.3 * jax.random.normal(jax.random.key(3), (c, h, k))}
    batch = {"x": jax.random.normal(jax.random.key(1), (c, n, d)),
             "y": jax.random.randint(jax.random.key(2), (c, n), 0, k)}

    def loss(p, b):
        def one(head, x, y):
            return optax.softmax_cross_entropy_with_integer_labels(jnp.tanh(x @ p["w1"]) @ head, y).mean()
        return jax.vmap(one)(p["heads"], b["x"], b["y"]).mean()

    tx = optax.sgd(0.5)
    piped = autopp.parallelize(make_train_step(loss, tx), num_stages=2, num_microbatches=4, devices=jax.devices()[:2])
    with pytest.raises(ValueError, match=r"(?s)Parameters with the batch's leading dimension.*args\[0\]\['heads'\]"
                                         r".*heads\[ids\]"):
        piped(params, tx.init(params), batch)


def _two_stage(loss, tx, num_microbatches=4):
    """``make_train_step(loss, tx)`` on 2 stages x ``num_microbatches``."""
    return autopp.parallelize(make_train_step(loss, tx), num_stages=2, num_microbatches=num_microbatches,
                              devices=jax.devices()[:2])


def test_a_count_in_the_batch_dict_is_refused_with_where_it_goes():
    """A count of positives put in the batch's dict (``batch["npos"] = y.sum()``, trial REC) cannot be split; the
    refusal names the leaf and says to pass such a count as an argument of the step of its own."""
    params = {"w": jnp.ones((4, 1))}
    batch = {"x": jnp.ones((8, 4)), "y": jnp.arange(8.0) % 2}
    batch["npos"] = batch["y"].sum()

    def loss(p, b):
        return jnp.sum(jax.nn.softplus(-(b["x"] @ p["w"])[:, 0]) * b["y"]) / b["npos"]

    tx = optax.sgd(0.1)
    piped = _two_stage(loss, tx, 2)
    with pytest.raises(TypeError, match=r"(?s)args\[2\]\['npos'\]: a scalar has no batch dimension.*a count over the "
                                        r"batch, a setting\) to an argument of the step of their own"):
        piped(params, tx.init(params), batch)


def test_a_trained_weight_per_example_is_named_with_the_fix():
    """A self-adaptive PINN trains one weight per collocation point, ``lam[B]``, multiplied with the points' residuals
    (trial ODE): the refusal said only "mul got incompatible shapes (32,), (8,)". It names the parameter and the fix."""
    b = 32
    params = {"w": jax.random.normal(jax.random.key(0), (2, 16)) / 2, "v": jax.random.normal(jax.random.key(1), (16,)),
              "lam": jnp.ones(b)}
    points = jax.random.uniform(jax.random.key(2), (b, 2))

    def loss(p, x):
        r = jnp.tanh(x @ p["w"]) @ p["v"] - jnp.sin(x[:, 0])
        return jnp.mean(p["lam"] * r ** 2)

    tx = optax.sgd(0.1)
    piped = _two_stage(loss, tx)
    with pytest.raises(ValueError, match=r"(?s)incompatible shapes.*Parameters with the batch's leading dimension.*"
                                         r"args\[0\]\['lam'\].*self-adaptive PINN.*heads\[ids\]"):
        piped(params, tx.init(params), points)


def test_a_weight_per_example_passed_apart_is_named_when_a_bias_is_as_long():
    """Residual-based attention keeps a weight per collocation point, ``lam[B]``, passed as its own step argument; the
    refusal's hint "add their argument to batch_argnums" was left out where a bias is as long as the batch (width 32,
    batch 32: taken for optimizer state shaped like a parameter, trial ODE). The loss reads it, so it is named, and
    the parameters as long as it are not."""
    b, h = 32, 32
    params = {"w": jax.random.normal(jax.random.key(0), (1, h)), "b": jnp.zeros(h), "v": jnp.ones((h, 1)) / h}
    batch = {"x": jax.random.uniform(jax.random.key(1), (b, 1)), "f": jnp.ones(b)}
    tx = optax.sgd(0.1)

    def loss(p, bt, lam):
        r = (jnp.tanh(bt["x"] @ p["w"] + p["b"]) @ p["v"])[:, 0] - bt["f"]
        return jnp.mean((lam * r) ** 2)

    def step(p, o, lam, bt):
        value, g = autopp.value_and_grad(loss)(p, bt, lam)
        updates, o = tx.update(g, o, p)
        return optax.apply_updates(p, updates), o, lam, value

    piped = autopp.parallelize(step, num_stages=2, num_microbatches=4, devices=jax.devices()[:2])
    with pytest.raises(ValueError, match=r"(?s)Leaves outside batch_argnums=\(3,\) with the batch's leading "
                                         r"dimension, kept whole: args\[2\]") as info:
        piped(params, tx.init(params), jnp.ones(b), batch)
    assert "Parameters with the batch's leading dimension" not in str(info.value)


def test_weights_the_size_of_the_batch_are_not_named_as_per_example():
    """A loss that fails at microbatch size for another reason (a reshape to the full batch) with weights whose first
    dimension equals the batch size (trial CTC: width 32, batch 32) is not told they are per-example parameters."""
    b, d = 32, 32
    params = {"w": jax.random.normal(jax.random.key(0), (d, d)) / 6}
    batch = {"x": jax.random.normal(jax.random.key(1), (b, 2, d)), "y": jax.random.normal(jax.random.key(2), (b, 2, d))}

    def loss(p, bt):
        return jnp.mean(((bt["x"] @ p["w"]).reshape(b * 2, d) - bt["y"].reshape(-1, d)) ** 2)

    tx = optax.sgd(0.5)
    piped = autopp.parallelize(make_train_step(loss, tx), num_stages=2, num_microbatches=4, devices=jax.devices()[:2])
    with pytest.raises(ValueError, match="fails at microbatch size") as info:
        piped(params, tx.init(params), batch)
    assert "Parameters with the batch's leading dimension" not in str(info.value)


def test_replay_rows_concatenated_in_the_step_are_named_with_the_fix():
    """A replay sample concatenated to the batch in the step (16 + 8 rows, trial NOISE12) cannot be split; the
    refusal's advice was about keeping the batch axis first. It says what the rows are and the two forms that run."""
    params = {"w": jax.random.normal(jax.random.key(0), (12, 5)) / 4}
    replay = (jax.random.normal(jax.random.key(1), (8, 12)), jnp.arange(8) % 5)
    batch = (jax.random.normal(jax.random.key(2), (16, 12)), jnp.arange(16) % 5)
    tx = optax.sgd(0.1)

    def loss(p, x, y):
        return optax.softmax_cross_entropy_with_integer_labels(x @ p["w"], y).mean()

    def step(p, s, rep, b):
        value, grads = autopp.value_and_grad(loss)(p, jnp.concatenate([b[0], rep[0]]), jnp.concatenate([b[1], rep[1]]))
        updates, s = tx.update(grads, s, p)
        return optax.apply_updates(p, updates), s, value

    piped = autopp.parallelize(step, num_stages=2, num_microbatches=4, devices=jax.devices()[:2])
    with pytest.raises(ValueError, match=r"(?s)examples plus a fixed number of other rows.*nll\(replay\)"):
        piped(params, tx.init(params), replay, batch)


@pytest.mark.parametrize("mapped", [False, True])
def test_a_scan_holding_the_work_gets_advice_that_fits(mapped):
    """One recurrent layer applied per example with ``jax.vmap`` (trial NOISE12) holds the loss's work in one scan,
    and 2 stages are refused: the advice said to map over the batch with jax.vmap rather than lax.map, which the code
    already did. That advice is given where the scan is a ``lax.map`` over the examples, and says what one is (a scan
    without a carry: trial ODE's teacher-forced ``lax.scan(f, None, xs)`` was told "rather than lax.map")."""
    b, t, d, h = 16, 10, 6, 16
    params = {"wx": 0.3 * jax.random.normal(jax.random.key(0), (d, h)),
              "wh": 0.2 * jax.random.normal(jax.random.key(2), (h, h)),
              "wo": 0.3 * jax.random.normal(jax.random.key(3), (h, 3))}
    batch = (jax.random.normal(jax.random.key(1), (b, t, d)), jnp.arange(b) % 3)

    def loss(p, bt):
        def one(xs):
            return jax.lax.scan(lambda hs, xt: (jnp.tanh(xt @ p["wx"] + hs @ p["wh"]), None), jnp.zeros(h), xs)[0]
        final = jax.lax.map(one, bt[0]) if mapped else jax.vmap(one)(bt[0])
        return optax.softmax_cross_entropy_with_integer_labels(final @ p["wo"], bt[1]).mean()

    tx = optax.sgd(0.1)
    piped = autopp.parallelize(make_train_step(loss, tx), num_stages=2, num_microbatches=4, devices=jax.devices()[:2])
    with pytest.raises(ValueError, match="holds") as info:
        piped(params, tx.init(params), batch)
    assert ("jax.vmap rather than a scan without a carry (lax.map" in str(info.value)) == mapped, str(info.value)


def test_a_rollout_s_bootstrap_observation_in_the_batch_is_pointed_out_of_it():
    """A PPO rollout stores T + 1 observations beside T rewards (trial RL): refused as a leaf without a batch axis,
    whose advice (another argument) then failed at microbatch size. The refusal names the leaf with one row more and
    the split that works: its first T rows in the batch, the last one apart. That runs as jit."""
    import optax

    t, n, d, a = 16, 4, 6, 3
    ks = jax.random.split(jax.random.key(0), 6)
    params = {"w": jax.random.normal(ks[0], (d, 16)) * 0.4, "wp": jax.random.normal(ks[1], (16, a)) * 0.3,
              "wv": jax.random.normal(ks[2], (16, 1)) * 0.3}
    roll = {"obs": jax.random.normal(ks[3], (t + 1, n, d)), "act": jax.random.randint(ks[4], (t, n), 0, a),
            "rew": jax.random.normal(ks[5], (t, n))}
    tx = optax.sgd(0.1)

    def net(p, x):
        h = jnp.tanh(x @ p["w"])
        return h @ p["wp"], (h @ p["wv"])[..., 0]

    def loss(p, obs, act, ret):
        logits, v = net(p, obs)
        logp = jnp.take_along_axis(jax.nn.log_softmax(logits), act[..., None], -1)[..., 0]
        return -(logp * jax.lax.stop_gradient(ret - v)).mean() + 0.5 * ((v - ret) ** 2).mean()

    def returns(p, obs, last_obs, rew):  # one-step bootstrapped returns from the next observation's value
        v_next = jnp.concatenate([net(p, obs[1:])[1], net(p, last_obs[None])[1]])
        return jax.lax.stop_gradient(rew + 0.99 * v_next)

    def whole(p, o, roll):
        ret = returns(p, roll["obs"][:-1], roll["obs"][-1], roll["rew"])
        value, g = autopp.value_and_grad(loss)(p, roll["obs"][:-1], roll["act"], ret)
        u, o = tx.update(g, o, p)
        return optax.apply_updates(p, u), o, value

    with pytest.raises(ValueError, match=r"one row more than the batch \(args\[2\]\['obs'\].*obs\[:-1\] in the "
                                         r"batch, obs\[-1\] apart"):
        autopp.parallelize(whole, num_stages=2, num_microbatches=4, devices=jax.devices()[:2])(
            params, tx.init(params), roll)

    def ragged(p, o, batch):  # ragged rows' offsets in the batch (trial SPARSE: given only the rollout's advice)
        lengths = batch["row_splits"][1:] - batch["row_splits"][:-1]
        value, g = autopp.value_and_grad(lambda p, x: (net(p, x)[1] * lengths).mean())(p, batch["x"])
        return optax.apply_updates(p, tx.update(g, o, p)[0]), o, value

    with pytest.raises(ValueError, match=r"ragged rows' offsets \(row_splits, B \+ 1 of them\): pass each example's"):
        autopp.parallelize(ragged, num_stages=2, num_microbatches=4, devices=jax.devices()[:2])(
            params, tx.init(params), {"x": roll["obs"][0], "row_splits": jnp.arange(n + 1) * 2})

    def split(p, o, last_obs, roll):  # the advice
        ret = returns(p, roll["obs"], last_obs, roll["rew"])
        value, g = autopp.value_and_grad(loss)(p, roll["obs"], roll["act"], ret)
        u, o = tx.update(g, o, p)
        return optax.apply_updates(p, u), o, value

    args = (params, tx.init(params), roll["obs"][-1], {**roll, "obs": roll["obs"][:-1]})
    want = jax.jit(whole)(params, tx.init(params), roll)
    got = autopp.parallelize(split, num_stages=2, num_microbatches=4, devices=jax.devices()[:2])(*args)
    np.testing.assert_allclose(float(got[2]), float(want[2]), rtol=1e-6)
    for x, y in zip(jax.tree.leaves(autopp.gather(got[0])), jax.tree.leaves(want[0])):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-6)


def test_a_key_last_in_the_step_s_arguments_names_the_argument_that_looks_like_the_batch():
    """diffusers' ``train_step(unet, text, opt_state, batch, rng)`` (trial NOISE16): the default batch, the last
    argument, is a key, and the refusal did not say it took the last argument, nor which one to name. It says both;
    ``batch_argnums=3`` runs as jit."""
    import optax

    params = {"w": jnp.ones((8, 1)) * 0.1}
    text = jnp.ones((5, 8))  # a frozen table, not the batch
    batch = {"x": jnp.arange(128.0).reshape(16, 8) / 128, "y": jnp.ones((16, 1))}
    tx = optax.sgd(0.1)

    def step(p, txt, o, b, rng):
        noise = jax.random.normal(rng, b["x"].shape) * 0.0
        value, g = autopp.value_and_grad(lambda q, bb: jnp.mean((bb["x"] @ q["w"] + txt.sum() * 0 - bb["y"]) ** 2))(
            p, {**b, "x": b["x"] + noise})
        u, o = tx.update(g, o, p)
        return optax.apply_updates(p, u), o, value

    args = (params, text, tx.init(params), batch, jax.random.key(0))
    with pytest.raises(TypeError, match=r"args\[4\] is the step's last argument.*args\[3\] looks like the batch \(its "
                                        r"leaves all have 16 rows\): pass batch_argnums=3"):
        autopp.parallelize(step, num_stages=2, num_microbatches=4, devices=jax.devices()[:2])(*args)
    want = jax.jit(step)(*args)
    got = autopp.parallelize(step, num_stages=2, num_microbatches=4, devices=jax.devices()[:2], batch_argnums=3)(*args)
    np.testing.assert_allclose(float(got[2]), float(want[2]), rtol=1e-6)


def test_a_failure_at_the_compared_fraction_says_why_it_is_not_the_count_asked_for():
    """Teacher logits passed beside the batch, outside batch_argnums, with 4 examples in 4 microbatches (trial KD):
    at one example per microbatch JAX broadcasts its rows against the whole batch's logits, so autopp compares the
    step at 2 microbatches, where it fails. The refusal said "divided by num_microbatches=2" for a step asked at 4;
    it now says why."""
    import optax

    tx = optax.sgd(0.1)

    def loss(w, logits, batch):
        return ((batch["x"] @ w - logits) ** 2).mean()

    def step(w, opt, logits, batch):
        value, grads = autopp.value_and_grad(loss)(w, logits, batch)
        updates, opt = tx.update(grads, opt, w)
        return optax.apply_updates(w, updates), opt, value

    w = jnp.ones((8, 3))
    args = (w, tx.init(w), jnp.ones((4, 3)), {"x": jnp.ones((4, 8))})
    with pytest.raises(ValueError, match=r"(?s)divided by num_microbatches=2\).*batch_argnums.*num_microbatches=2 "
                                         r"above is where autopp compares the step: each of the 4 microbatches asked "
                                         r"for holds one example"):
        autopp.parallelize(step, num_stages=2, num_microbatches=4, devices=jax.devices()[:2], batch_argnums=3)(*args)


def test_a_frozen_stack_scanned_as_an_argument_of_its_own_is_refused_with_the_fix():
    """A frozen teacher written as a ``lax.scan`` over stacked layers and passed as an argument of its own (trial KD):
    not differentiated, its scan was read as a loop over data and refused at 4 stages with advice about time steps
    and samplers. The refusal now says what it scans and the fix, which runs: the stack with the parameters, read
    behind ``stop_gradient``, split by layer, jit's values (SGD leaves it as it is)."""
    import numpy as np
    import optax

    depth, width = 8, 32

    def init(key):
        ks = jax.random.split(key, 4)
        return {"inp": jax.random.normal(ks[0], (16, width)) / 4,
                "stack": {"w1": jax.random.normal(ks[1], (depth, width, width)) / np.sqrt(width),
                          "w2": jax.random.normal(ks[2], (depth, width, width)) / np.sqrt(width)},
                "out": jax.random.normal(ks[3], (width, 8)) / np.sqrt(width)}

    def apply(p, x):
        h = x @ p["inp"]
        if p["stack"]:
            h, _ = jax.lax.scan(lambda h, q: (h + jnp.tanh(h @ q["w1"]) @ q["w2"], None), h, p["stack"])
        return h @ p["out"]

    def kl(teacher_logits, student_logits):
        t = jax.lax.stop_gradient(teacher_logits)
        return (jax.nn.softmax(t) * (jax.nn.log_softmax(t) - jax.nn.log_softmax(student_logits))).sum(-1).mean()

    tx = optax.sgd(0.05)

    def apart(sp, opt, tp, b):
        value, grads = autopp.value_and_grad(lambda s, t, b: kl(apply(t, b["x"]), apply(s, b["x"])))(sp, tp, b)
        updates, opt = tx.update(grads, opt, sp)
        return optax.apply_updates(sp, updates), opt, value

    def within(p, opt, b):  # the advice: the teacher with the parameters, behind stop_gradient
        value, grads = autopp.value_and_grad(lambda p, b: kl(apply(jax.lax.stop_gradient(p["teacher"]), b["x"]),
                                                             apply(p["student"], b["x"])))(p, b)
        updates, opt = tx.update(grads, opt, p)
        return optax.apply_updates(p, updates), opt, value

    teacher = init(jax.random.key(1))
    student = {"inp": teacher["inp"] * 0.5, "stack": {}, "out": teacher["out"] * 0.5}  # (no layers: the teacher's
    batch = {"x": jax.random.normal(jax.random.key(3), (16, 16))}  # scan is the loss's work)
    with pytest.raises(ValueError, match=r"(?s)scans over stacked weights the loss does not differentiate.*behind "
                                         r"jax\.lax\.stop_gradient"):
        autopp.parallelize(apart, num_stages=4, num_microbatches=4, devices=jax.devices()[:4])(
            student, tx.init(student), teacher, batch)
    params = {"teacher": teacher, "student": student}
    want = jax.jit(within)(params, tx.init(params), batch)
    got = autopp.parallelize(within, num_stages=4, num_microbatches=4, devices=jax.devices()[:4])(
        params, tx.init(params), batch)
    for a, b in zip(jax.tree.leaves((want[0], want[2])), jax.tree.leaves((autopp.gather(got[0]), got[2]))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)

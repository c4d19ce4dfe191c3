"""autopp.parallelize against plain jax.jit of the same step (no microbatching)."""

import functools
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import autopp
from autopp.models import make_train_step
from tests._helpers import assert_trees_close, make_optimizer, make_step, model_case, run_steps, tiny_gpt, tiny_mlp

MODELS = {"mlp": (tiny_mlp, 16), "gpt": (tiny_gpt, 8)}


@functools.lru_cache(maxsize=None)
def _setup(name):
    factory, batch_size = MODELS[name]
    model = factory()
    tx = make_optimizer()
    params = model.init(jax.random.key(0))
    state = (params, tx.init(params))
    batch = model.batch(jax.random.key(1), batch_size)
    step = make_step(model, tx)
    expected = run_steps(jax.jit(step), state, batch)
    return model, step, state, batch, expected


# The MLP runs the whole grid; the GPT (the same runtime paths, 3x the compile time) a spread of it.
_GPT_IN_DEFAULT_RUN = {(1, 1, "gpipe"), (4, 8, "1f1b"), (8, 4, "gpipe")}
_GRID = [pytest.param(name, stages, mbs, schedule, id=f"{name}-{stages}-{mbs}-{schedule}",
                      marks=() if name == "mlp" or (stages, mbs, schedule) in _GPT_IN_DEFAULT_RUN else pytest.mark.slow)
         for name in ("mlp", "gpt") for stages in (1, 2, 4, 8) for mbs in (1, 4, 8) for schedule in ("gpipe", "1f1b")]


@pytest.mark.parametrize("model_name, num_stages, num_microbatches, schedule", _GRID)
def test_matches_plain_jit(model_name, num_stages, num_microbatches, schedule):
    model, step, state, batch, (expected_state, expected_losses) = _setup(model_name)
    pstep = autopp.parallelize(step, num_stages=num_stages, num_microbatches=num_microbatches,
                               schedule=schedule, devices=jax.devices()[:num_stages])
    got_state, got_losses = run_steps(pstep, state, batch)
    assert_trees_close(got_losses, expected_losses)
    assert_trees_close(got_state, expected_state)
    plan = pstep.plan_for(*state, batch)
    assert plan.num_stages == num_stages and plan.num_microbatches == num_microbatches


def test_tied_embedding_is_shared_and_summed():
    model, step, state, batch, (expected_state, _) = _setup("gpt")
    pstep = autopp.parallelize(step, num_stages=4, num_microbatches=4, devices=jax.devices()[:4])
    exe = pstep.executable_for(*state, batch)
    labels = exe.description
    # wte lives on stage 0 and is sent to the last stage each step; its gradient comes back, in the last stage's
    # packed accumulator as it is, and is unpacked and summed inside stage 0's update program (which unpacks stage
    # 0's accumulators too): no program of its own on either stage.
    assert any("put shared parameter" in l and "wte" in l for l in labels), labels
    assert "send packed grads 3->0" in labels, labels
    assert not any("sum shared grad" in l or "unpack gradients" in l for l in labels), labels
    got_state, _ = run_steps(pstep, state, batch)
    assert_trees_close(got_state, expected_state)
    assert got_state[0]["wte"].sharding.device_set == {jax.devices()[0]}


def test_tied_embedding_between_stages_of_other_mesh_shapes():
    """The last stage's packed accumulator cannot move to stage 0 as it is when their meshes differ (data 2 against
    fsdp 2): the contribution is unpacked on the last stage and sent as an array of its own, and the step still
    equals jit."""
    model, tx = tiny_gpt(), optax.sgd(0.1)  # SGD: the strict check (Adam would turn rounding into lr-sized steps)
    params = model.init(jax.random.key(0))
    state, batch, step = (params, tx.init(params)), model.batch(jax.random.key(1), 8), make_step(model, tx)
    d = jax.devices()
    pstep = autopp.parallelize(step, devices=[d[:2], d[2:4]], layout=[{"data": 2}, {"fsdp": 2}],
                               num_microbatches=4)
    labels = pstep.executable_for(*state, batch).description
    assert "unpack gradients stage 1" in labels and "send shared grad 1->0" in labels, labels
    assert not any("send packed grads" in l for l in labels), labels
    got, _ = run_steps(pstep, state, batch)
    assert_trees_close(got, run_steps(jax.jit(step), state, batch)[0], rtol=1e-6, atol=1e-6)


def test_masked_token_mean_over_the_whole_batch():
    """Padding masks that differ between microbatches: a loss normalised by the step's token count (computed in the
    step, outside the loss) is exactly plain jit's masked token mean under loss_reduction="sum", which is read off the
    loss by default (it adds its examples up); "mean" given is refused, as it would average the microbatches' losses
    (a quarter of jit's). Before, the default was "mean" and such a step was refused."""
    model, tx = tiny_gpt(), optax.sgd(0.5)
    params = model.init(jax.random.key(0))
    batch = model.batch(jax.random.key(1), 8)
    keep = jnp.linspace(0.1, 1.0, 8)[:, None]  # example 0 keeps ~10% of its tokens, example 7 all
    batch["mask"] = (jax.random.uniform(jax.random.key(2), batch["tokens"].shape) < keep).astype(jnp.float32)

    def masked_sum(params, batch, num_tokens):
        logp = jax.nn.log_softmax(model.apply(params, batch["tokens"]), axis=-1)
        nll = -jnp.take_along_axis(logp, batch["targets"][..., None], axis=-1)[..., 0]
        return jnp.sum(nll * batch["mask"]) / num_tokens

    def step(params, opt_state, batch):
        loss, grads = autopp.value_and_grad(masked_sum)(params, batch, jnp.sum(batch["mask"]))
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    state = (params, tx.init(params))
    expected, expected_losses = run_steps(jax.jit(step), state, batch)
    kw = dict(num_stages=2, num_microbatches=4, devices=jax.devices()[:2])
    for reduction in ("sum", None):
        got, losses = run_steps(autopp.parallelize(step, loss_reduction=reduction, **kw), state, batch)
        assert_trees_close(losses, expected_losses, rtol=1e-6, atol=1e-6)
        assert_trees_close(got, expected, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match=r"(?s)loss_reduction='mean', but the loss is a sum over its examples.*"
                                         r"1/4 of plain jax.jit's loss.*pass loss_reduction='sum'"):
        autopp.parallelize(step, loss_reduction="mean", **kw)(*state, batch)


def test_gradients_and_aux_match_jax():
    """has_aux, argnums over two arguments, a dict batch, and returning grads and aux directly."""
    model = tiny_gpt()
    params = model.init(jax.random.key(0))
    head = {"scale": jnp.full((), 0.5)}
    batch = model.batch(jax.random.key(2), 8)

    def loss_fn(params, head, batch):
        logits = model.apply(params, batch["tokens"]) * head["scale"]
        logp = jax.nn.log_softmax(logits)
        nll = -jnp.take_along_axis(logp, batch["targets"][..., None], -1).mean()
        acc = (logits.argmax(-1) == batch["targets"]).mean()
        return nll, {"accuracy": acc, "logit_mean": logits.mean()}

    def step(params, head, batch, grad_fn):
        (loss, aux), grads = grad_fn(loss_fn, argnums=(0, 1), has_aux=True)(params, head, batch)
        return loss, aux, grads

    expected = jax.jit(lambda p, h, b: step(p, h, b, jax.value_and_grad))(params, head, batch)
    pstep = autopp.parallelize(lambda p, h, b: step(p, h, b, autopp.value_and_grad), num_stages=4,
                               num_microbatches=4, devices=jax.devices()[:4])
    got = pstep(params, head, batch)
    assert_trees_close(got, expected, atol=1e-6)


def test_grad_with_aux_and_sum_reduction():
    model = tiny_mlp()
    params = model.init(jax.random.key(0))
    batch = model.batch(jax.random.key(1), 16)

    def loss_fn(params, batch):
        err = model.apply(params, batch["x"]) - batch["y"]
        return jnp.sum(err ** 2), jnp.sum(jnp.abs(err))

    def step(params, batch, grad_fn):
        grads, aux = grad_fn(loss_fn, has_aux=True)(params, batch)
        return grads, aux

    expected = jax.jit(lambda p, b: step(p, b, jax.grad))(params, batch)
    pstep = autopp.parallelize(lambda p, b: step(p, b, autopp.grad), num_stages=2, num_microbatches=4,
                               loss_reduction="sum", devices=jax.devices()[:2])
    assert_trees_close(pstep(params, batch), expected, rtol=1e-5, atol=1e-6)


def test_grad_is_jax_grad_outside_parallelize():
    f = lambda x, y: jnp.sum(jnp.sin(x) * y) ** 2
    x, y = jnp.arange(3.0), jnp.ones(3)
    for argnums in (0, 1, (0, 1)):
        np.testing.assert_array_equal(autopp.grad(f, argnums)(x, y), jax.grad(f, argnums)(x, y))
        a, b = autopp.value_and_grad(f, argnums)(x, y), jax.value_and_grad(f, argnums)(x, y)
        jax.tree.map(np.testing.assert_array_equal, a, b)
    g = lambda x: (jnp.sum(x ** 2), x * 2)
    jax.tree.map(np.testing.assert_array_equal, autopp.grad(g, has_aux=True)(x), jax.grad(g, has_aux=True)(x))
    jax.tree.map(np.testing.assert_array_equal, jax.jit(autopp.grad(f))(x, y), jax.grad(f)(x, y))


def test_decorator_forms_keep_signature():
    model = tiny_mlp()
    tx = make_optimizer()
    step = make_step(model, tx)
    bare = autopp.parallelize(step)
    with_kw = autopp.parallelize(num_stages=2, devices=jax.devices()[:2])(step)
    assert inspect.signature(bare) == inspect.signature(step)
    assert inspect.signature(with_kw) == inspect.signature(step)
    assert bare.__name__ == step.__name__ == "train_step"

    @autopp.parallelize
    def decorated(params, batch):
        return autopp.grad(model.loss)(params, batch)

    params = model.init(jax.random.key(0))
    batch = model.batch(jax.random.key(1), 16)
    assert_trees_close(decorated(params, batch), jax.jit(jax.grad(model.loss))(params, batch), atol=1e-6)


def test_pytree_structure_and_placement_of_results():
    model, step, state, batch, _ = _setup("mlp")
    pstep = autopp.parallelize(step, num_stages=4, num_microbatches=4, devices=jax.devices()[:4])
    out = pstep(*state, batch)
    assert jax.tree.structure(out) == jax.tree.structure(jax.eval_shape(step, *state, batch))
    # Each layer's parameters stay on the stage that computes that layer: several stages hold parameters.
    devices = {next(iter(leaf.sharding.device_set)) for leaf in jax.tree.leaves(out[0])}
    assert len(devices) >= 3
    # Feeding the results back moves no parameter or optimizer state: placement returns the same arrays.
    exe = pstep.executable_for(*state, batch)
    env_inputs = jax.tree.leaves(out[:2])
    place_tasks = [t for t in exe.tasks if t.label.startswith("place")]
    assert place_tasks
    leaf_of_slot = dict(zip(exe.input_slots, jax.tree.leaves((*out[:2], batch))))
    for t in place_tasks:
        x = leaf_of_slot[t.ins[0]]
        assert t.fn(x)[0] is x, t.label
    assert len(env_inputs) > 0


def test_no_recompilation_on_second_call():
    model, step, state, batch, _ = _setup("gpt")
    pstep = autopp.parallelize(step, num_stages=4, num_microbatches=4, devices=jax.devices()[:4])
    out = pstep(*state, batch)
    compiles = []

    def listener(event, duration, **kw):
        if "compile" in event or "trace" in event:
            compiles.append(event)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        out = pstep(*out[:2], batch)
        out = pstep(*out[:2], batch)
        jax.block_until_ready(out)
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert compiles == []


def test_global_norm_clipping_crosses_stages():
    """clip_by_global_norm needs the norm over all stages' gradients: a tight threshold makes it bind."""
    model = tiny_mlp()
    tx = optax.chain(optax.clip_by_global_norm(1e-3), optax.sgd(1.0))
    params = model.init(jax.random.key(0))
    state = (params, tx.init(params))
    batch = model.batch(jax.random.key(1), 16)

    def step(params, opt_state, batch):
        loss, grads = autopp.value_and_grad(model.loss)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, optax.tree.norm(grads)

    expected = jax.jit(step)(*state, batch)
    got = autopp.parallelize(step, num_stages=4, num_microbatches=2, devices=jax.devices()[:4])(*state, batch)
    assert float(expected[2]) > 1e-2  # the clip is active
    assert_trees_close(got, expected, atol=1e-7)


@pytest.mark.parametrize("model_name", ["mlp", "gpt"])
def test_data_parallel_inside_stages(model_name):
    """8 devices, 4 stages: each stage is a 2-device sub-mesh with the microbatch split over its data axis."""
    model, step, state, batch, (expected_state, expected_losses) = _setup(model_name)
    pstep = autopp.parallelize(step, num_stages=4, num_microbatches=2, devices=jax.devices())
    got_state, got_losses = run_steps(pstep, state, batch)
    assert_trees_close(got_losses, expected_losses)
    assert_trees_close(got_state, expected_state)
    plan = pstep.plan_for(*state, batch)
    assert [s.devices for s in plan.stages] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert all(len(leaf.sharding.device_set) == 2 for leaf in jax.tree.leaves(got_state[0]))


def test_a_microbatch_the_data_axis_does_not_divide_is_named():
    """12 examples in 4 microbatches over stages of 2 data-parallel devices: each microbatch (3 examples) cannot be
    split evenly, so both devices run all of it. The step is still right (equal to jit), but that used to happen
    silently; it is now said, with the batch sizes that divide (a multiple of 4 x 2). Left to choose the count, autopp
    takes one whose microbatches divide."""
    import warnings

    model = tiny_mlp()
    tx = make_optimizer()
    step = make_step(model, tx)
    params = model.init(jax.random.key(0))
    state = (params, tx.init(params))
    for size, undivided in ((12, True), (16, False)):
        batch = model.batch(jax.random.key(1), size)
        pstep = autopp.parallelize(make_step(model, tx), num_stages=2, num_microbatches=4, devices=jax.devices()[:4])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = pstep(*state, batch)
        said = [str(w.message) for w in caught if "do not divide" in str(w.message)]
        if undivided:
            assert said == ["autopp.parallelize: microbatches of 3 example(s) do not divide over a stage's 2 "
                            "data-parallel devices (data x fsdp), so those devices repeat the same examples instead "
                            "of sharing them. Use a batch size that is a multiple of num_microbatches x 2 = 8, or "
                            "fewer microbatches."]
        else:
            assert said == []
        assert_trees_close(got, jax.jit(step)(*state, batch))
    # left to choose, the microbatch count is the largest (up to 2 x stages) whose microbatches divide over data
    batch = model.batch(jax.random.key(1), 12)
    chosen = autopp.parallelize(make_step(model, tx), num_stages=2, devices=jax.devices()[:4])
    assert chosen.plan_for(*state, batch).num_microbatches == 3  # (4 before: microbatches of 3 over 2 devices)

def test_custom_text_schedule():
    """A schedule written by hand as text (rank rows of F/B actions) runs and matches plain jax.jit."""
    from autopp.runtime import Schedule

    model, step, state, batch, (expected_state, expected_losses) = _setup("mlp")
    text = """
        0F0 0F1 0F2 0B0 0F3 0B1 0B2 0B3
        1F0 1B0 1F1 1F2 1B1 1B2 1F3 1B3
    """
    schedule = Schedule.from_text(text)
    pstep = autopp.parallelize(step, num_stages=2, num_microbatches=4, schedule=schedule, devices=jax.devices()[:2])
    got_state, got_losses = run_steps(pstep, state, batch)
    assert_trees_close(got_losses, expected_losses)
    assert_trees_close(got_state, expected_state)
    assert pstep.plan_for(*state, batch).schedule_text == schedule.to_text()
    bad = Schedule.from_text("0F0 0B0 0F1 0B1\n1B0 1F0 1F1 1B1")
    with pytest.raises(ValueError, match=r"1B0"):
        autopp.parallelize(step, num_stages=2, num_microbatches=2, schedule=bad, devices=jax.devices()[:2])(*state, batch)


def test_skip_connection_across_stages():
    """A value used two stages later (a long skip connection) is sent directly, and its gradient gets
    contributions from both later stages, summed on the producer."""
    k = jax.random.split(jax.random.key(3), 6)
    params = {f"w{i}": jax.random.normal(k[i], (16, 16)) * 0.3 for i in range(6)}
    batch = {"x": jax.random.normal(jax.random.key(4), (8, 16)), "y": jax.random.normal(jax.random.key(5), (8, 16))}

    def loss_fn(p, b):
        h1 = jnp.tanh(b["x"] @ p["w0"])
        h = h1
        for i in range(1, 6):
            h = jnp.tanh(h @ p[f"w{i}"])
            if i in (2, 4):
                h = h + h1  # h1 is read by the middle stage and by the last one
        return jnp.mean((h - b["y"]) ** 2)

    def step(p, b, vg):
        return vg(loss_fn)(p, b)

    expected = jax.jit(lambda p, b: step(p, b, jax.value_and_grad))(params, batch)
    pstep = autopp.parallelize(lambda p, b: step(p, b, autopp.value_and_grad), num_stages=3, num_microbatches=4,
                               devices=jax.devices()[:3])
    labels = pstep.executable_for(params, batch).description
    assert any(l.startswith("send 0->2") for l in labels), labels
    assert any(l.startswith("sum grads") for l in labels), labels
    assert_trees_close(pstep(params, batch), expected, atol=1e-6)


def test_preprocessing_rng_and_metrics_outside_the_loss():
    """Work before the gradient (a PRNG split, batch normalisation, a parameter cast) and after it (a metric
    over all stages' gradients) is placed on the stages that need it; a key used by several stages lives
    on all of them, and feeding results back moves nothing."""
    k = jax.random.split(jax.random.key(7), 4)
    params = {f"w{i}": jax.random.normal(k[i], (16, 16)) * 0.3 for i in range(4)}
    batch = {"x": jax.random.normal(jax.random.key(8), (8, 16)), "y": jax.random.normal(jax.random.key(9), (8, 16))}

    def loss_fn(p, x, y, key):
        # Feature-wise masks (shared by all examples), so that microbatching does not change what is drawn.
        keep = [jax.random.bernoulli(kk, 0.8, x.shape[-1:]) for kk in jax.random.split(key, 4)]
        h = x
        for i in range(4):
            h = jnp.tanh(h @ p[f"w{i}"]) * keep[i] / 0.8  # dropout on every layer, i.e. on every stage
        return jnp.mean((h - y) ** 2)

    def step(p, key, b, vg):
        key, sub = jax.random.split(key)
        x = (b["x"] - b["x"].mean(axis=1, keepdims=True)) / (b["x"].std(axis=1, keepdims=True) + 1e-5)
        p32 = jax.tree.map(lambda w: w.astype(jnp.float32), p)
        loss, grads = vg(loss_fn)(p32, x, b["y"], sub)
        new_p = jax.tree.map(lambda w, g: w - 0.1 * g, p, grads)
        return new_p, key, loss, optax.tree.norm(grads)

    ref = jax.jit(lambda p, key, b: step(p, key, b, jax.value_and_grad))
    pstep = autopp.parallelize(lambda p, key, b: step(p, key, b, autopp.value_and_grad), num_stages=4,
                               num_microbatches=2, devices=jax.devices()[:4])
    key = jax.random.key(0)
    want_p, want_key, got_p, got_key = params, key, params, key
    for _ in range(2):
        want_p, want_key, want_loss, want_norm = ref(want_p, want_key, batch)
        got_p, got_key, got_loss, got_norm = pstep(got_p, got_key, batch)
        assert_trees_close((got_p, got_loss, got_norm), (want_p, want_loss, want_norm), atol=1e-6)
        assert (jax.random.key_data(got_key) == jax.random.key_data(want_key)).all()
    assert len(got_key.sharding.device_set) == 4  # the key is kept on every stage that draws from it
    exe = pstep.executable_for(got_p, got_key, batch)
    leaf_of_slot = dict(zip(exe.input_slots, jax.tree.leaves((got_p, got_key, batch))))
    for t in exe.tasks:
        if t.label.startswith("place"):
            x = leaf_of_slot[t.ins[0]]
            assert t.fn(x)[0] is x, t.label


def test_threads_racing_to_a_first_call_make_one_build(monkeypatch):
    """Three threads calling a new step at once used to build it three times (a user trial: 36 compilations
    against 27); now the others wait for the first build and take it. Every thread's result equals jit's."""
    import threading

    from autopp._parallelize import Parallelized

    step, state, batch = model_case(tiny_mlp, 8)
    pipelined = autopp.parallelize(step, num_stages=2, num_microbatches=2, devices=jax.devices()[:2])
    builds, real = [], Parallelized._build

    def counted(self, args):
        builds.append(1)
        return real(self, args)

    monkeypatch.setattr(Parallelized, "_build", counted)
    results = [None] * 3
    start = threading.Barrier(3)

    def run(i):
        start.wait()
        results[i] = jax.block_until_ready(pipelined(*state, batch))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(builds) == 1
    want = jax.jit(step)(*state, batch)
    for got in results:
        assert_trees_close(got, want, rtol=1e-5)


def test_a_convolution_net_on_one_stage_runs_its_microbatches_as_jit():
    """A convolution net on one CPU stage runs its microbatches one after another in its program instead of a
    ``lax.scan`` (inside which XLA:CPU runs a convolution's backward 5-40x slower; user trials COST and VISION). The
    step, its per-example aux and its maximum aux equal plain jit's (SGD, <= 1e-6), at 1 and 4 microbatches."""
    keys = jax.random.split(jax.random.key(0), 4)
    params = {"c1": jax.random.normal(keys[0], (3, 3, 3, 8)) * 0.2, "c2": jax.random.normal(keys[1], (3, 3, 8, 8)) * 0.1,
              "head": jax.random.normal(keys[2], (8, 4)) * 0.1}
    x = jax.random.normal(keys[3], (16, 8, 8, 3))
    y = jnp.arange(16) % 4

    def loss(p, batch):
        h = batch["x"]
        for name in ("c1", "c2"):
            h = jax.nn.relu(jax.lax.conv_general_dilated(h, p[name], (1, 1), "SAME",
                                                         dimension_numbers=("NHWC", "HWIO", "NHWC")))
        logits = h.mean((1, 2)) @ p["head"]
        nll = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
        return nll.mean(), {"pred": logits.argmax(-1), "worst": nll.max()}

    tx = optax.sgd(0.1)

    def make(value_and_grad):
        return make_train_step(loss, tx, value_and_grad=functools.partial(value_and_grad, has_aux=True))

    want = jax.jit(make(jax.value_and_grad))(params, tx.init(params), {"x": x, "y": y})
    for m in (1, 4):
        pipelined = autopp.parallelize(make(autopp.value_and_grad), num_stages=1, num_microbatches=m,
                                       devices=jax.devices()[:1])
        got = pipelined(params, tx.init(params), {"x": x, "y": y})
        assert_trees_close(autopp.gather(got), want, rtol=1e-6, atol=1e-6)

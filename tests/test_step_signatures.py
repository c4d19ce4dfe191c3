"""Steps a user may write that are not the zoo's ``(params, opt_state, batch) -> (params, opt_state, loss)``: a weakly
typed learning rate, integer leaves under ``allow_int``, a frozen parameter whose update is a constant, per-example
and constant aux values, and what is refused. Each is compared with plain ``jax.jit`` of the same step."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import autopp
from tests._helpers import assert_trees_close


def init(key, dtype=jnp.float32):
    k1, k2, k3 = jax.random.split(key, 3)
    return {"emb": (jax.random.normal(k1, (6, 8)) * 0.5).astype(dtype),
            "w": (jax.random.normal(k2, (8, 16)) * 0.3).astype(dtype),
            "head": (jax.random.normal(k3, (16, 4)) * 0.3).astype(dtype)}


def logits(p, x):
    h = jnp.tanh(p["emb"][x].mean(1) @ p["w"])
    return h @ p["head"]


def nll(p, batch):
    x, y = batch
    return -jnp.take_along_axis(jax.nn.log_softmax(logits(p, x).astype(jnp.float32)), y[:, None], 1)[:, 0]


BATCH = (jax.random.randint(jax.random.key(1), (16, 5), 0, 6), jax.random.randint(jax.random.key(2), (16,), 0, 4))


def both(make):
    """``make(value_and_grad)`` under plain jit and under autopp (2 stages, 4 microbatches)."""
    return (jax.jit(make(jax.value_and_grad)),
            autopp.parallelize(make(autopp.value_and_grad), num_stages=2, num_microbatches=4,
                               devices=jax.devices()[:2]))


@pytest.mark.parametrize("lr", [0.1, jnp.asarray(0.1)], ids=["python float", "weak array"])
def test_a_weakly_typed_learning_rate_keeps_bfloat16_parameters(lr):
    """``p - lr * g`` with bf16 parameters stays bf16 under jit (``lr`` takes the parameters' dtype); a second step
    reuses the first one's build."""

    def make(vag):
        def step(p, lr, batch):
            loss, g = vag(lambda q, b: nll(q, b).mean())(p, batch)
            return jax.tree.map(lambda a, b: a - lr * b, p, g), loss
        return step

    params = init(jax.random.key(0), jnp.bfloat16)
    plain, pipelined = both(make)
    want, _ = plain(params, lr, BATCH)
    got, _ = pipelined(params, lr, BATCH)
    assert {a.dtype for a in jax.tree.leaves(got)} == {jnp.dtype(jnp.bfloat16)}
    assert_trees_close(jax.tree.map(lambda a: a.astype(jnp.float32), got),
                       jax.tree.map(lambda a: a.astype(jnp.float32), want), rtol=0, atol=2e-2)
    pipelined(got, lr, BATCH)
    assert len(pipelined._cache) == 1


def test_a_learning_rate_fed_back_between_steps_stays_weak_and_keeps_the_parameters_dtype():
    """A learning rate decayed in the step and fed back (``lr * 0.9``, the first call given the Python float 0.1)
    came back strongly typed float32 from autopp (a trial), so from the second step on the bf16 parameters became
    float32 (twice the memory, a second build, losses drifting from jit's). It comes back weak, as from jit."""

    def make(vag):
        def step(p, lr, batch):
            loss, g = vag(lambda q, b: nll(q, b).mean())(p, batch)
            return jax.tree.map(lambda a, b: a - lr * b, p, g), lr * 0.9, loss
        return step

    params = init(jax.random.key(0), jnp.bfloat16)
    results = []
    for fn in both(make):
        state = (params, 0.1)
        for _ in range(3):
            *state, loss = fn(*state, BATCH)
        results.append((state, loss))
    (want, l_want), (got, l_got) = results
    assert got[1].weak_type and want[1].weak_type
    assert {a.dtype for a in jax.tree.leaves(got[0])} == {jnp.dtype(jnp.bfloat16)}
    assert_trees_close(jax.tree.map(lambda a: a.astype(jnp.float32), (got, l_got)),
                       jax.tree.map(lambda a: a.astype(jnp.float32), (want, l_want)), rtol=0, atol=2e-2)


def test_integer_leaves_under_allow_int_get_float0_gradients():
    """An int32 counter among the differentiated parameters (read by the loss or not): jit's gradient for it is
    float0 zeros, and the float leaves' gradients are the loss's."""

    def make(vag):
        def step(p, batch):
            def loss(q, b):
                return nll(q["net"], b).mean() * (1.0 + 0.0 * q["count"].astype(jnp.float32))
            value, g = vag(loss, allow_int=True)(p, batch)
            return {"net": jax.tree.map(lambda a, b: a - 0.1 * b, p["net"], g["net"]), "count": p["count"] + 1}, \
                g["count"], value
        return step

    params = {"net": init(jax.random.key(0)), "count": jnp.int32(3)}
    plain, pipelined = both(make)
    want, want_count_grad, want_loss = plain(params, BATCH)
    got, got_count_grad, got_loss = pipelined(params, BATCH)
    assert got_count_grad.dtype == want_count_grad.dtype == jax.dtypes.float0
    assert got_count_grad.shape == want_count_grad.shape
    assert int(got["count"]) == 4
    assert_trees_close(got["net"], want["net"], rtol=0, atol=1e-6)
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-6)


def test_a_frozen_parameter_whose_update_is_a_constant():
    """``optax.multi_transform`` with ``set_to_zero`` for the embedding and the head (owned by the first and the
    last stage): the update is a zeros constant, placed where the parameter lives."""
    labels = {"emb": "frozen", "w": "train", "head": "frozen"}
    tx = optax.multi_transform({"train": optax.sgd(0.1), "frozen": optax.set_to_zero()}, labels)

    def make(vag):
        def step(p, o, batch):
            loss, g = vag(lambda q, b: nll(q, b).mean())(p, batch)
            u, o = tx.update(g, o, p)
            return optax.apply_updates(p, u), o, loss
        return step

    params = init(jax.random.key(0))
    plain, pipelined = both(make)
    want = plain(params, tx.init(params), BATCH)
    got = pipelined(params, tx.init(params), BATCH)
    assert_trees_close(got, want, rtol=0, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(got[0]["head"]), np.asarray(params["head"]))


@pytest.mark.parametrize("num_stages", [1, 2])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_aux_values_per_example_and_constant_are_the_whole_batchs(num_stages, reduction):
    """Per-example aux (float and int) comes back for the whole batch, in order; a constant read off the batch's
    shape is the whole batch's, and a plain constant is itself, under either reduction."""

    def loss(p, b):
        per_example = nll(p, b)
        preds = jnp.argmax(logits(p, b[0]), -1)
        total = per_example.mean() if reduction == "mean" else per_example.sum()
        return total, {"nll": per_example, "pred": preds, "n": jnp.float32(b[0].shape[0]), "lr": 0.1,
                       "accuracy": (preds == b[1]).mean() if reduction == "mean" else (preds == b[1]).sum()}

    def make(vag):
        def step(p, batch):
            (value, aux), g = vag(loss, has_aux=True)(p, batch)
            return jax.tree.map(lambda a, b: a - 0.1 * b, p, g), value, aux
        return step

    params = init(jax.random.key(0))
    pipelined = autopp.parallelize(make(autopp.value_and_grad), num_stages=num_stages, num_microbatches=4,
                                   loss_reduction=reduction, devices=jax.devices()[:num_stages])
    want = jax.jit(make(jax.value_and_grad))(params, BATCH)
    got = pipelined(params, BATCH)
    assert got[2]["nll"].shape == (16,) and got[2]["pred"].dtype == want[2]["pred"].dtype
    assert float(got[2]["n"]) == 16.0 and float(got[2]["lr"]) == pytest.approx(0.1)
    assert_trees_close(got, want, rtol=1e-6, atol=1e-6)


def test_a_gradient_with_respect_to_a_batch_input_is_refused():
    def step(w, x):
        return autopp.grad(lambda w_, x_: jnp.tanh(x_ @ w_).mean(), argnums=(0, 1))(w, x)

    with pytest.raises(ValueError, match=r"args\[1\], which is split into microbatches.*jax.grad outside"):
        autopp.parallelize(step, num_stages=2, num_microbatches=4, devices=jax.devices()[:2])(
            jnp.ones((8, 4)), jnp.ones((16, 8)))


def test_batch_argnums_naming_the_parameters_is_refused_before_the_microbatch_trace():
    """``batch_argnums=0`` on a step whose argument 0 is the parameters: the parameters would be split into
    microbatches and differentiated. A user trial got a shape error from the trace at microbatch size; the refusal now
    comes first, names the leaves and says batch_argnums names the wrong argument."""
    def loss(p, b):
        return jnp.mean((jnp.tanh(b["x"] @ p["w"]) * p["scale"] - b["y"]) ** 2)

    def step(p, b):
        value, g = autopp.value_and_grad(loss)(p, b)
        return jax.tree.map(lambda a, d: a - 0.1 * d, p, g), value

    params = {"w": jnp.ones((16, 16)), "scale": jnp.ones((16,))}
    batch = {"x": jnp.ones((16, 16)), "y": jnp.ones((16, 16))}
    with pytest.raises(ValueError, match=r"args\[0\]\['scale'\], args\[0\]\['w'\], which is split into "
                                         r"microbatches.*batch_argnums=\(0,\).*names the wrong argument"):
        autopp.parallelize(step, num_stages=2, num_microbatches=4, batch_argnums=0,
                           devices=jax.devices()[:2])(params, batch)


def test_a_loss_checkpointed_whole_says_why_it_cannot_be_cut():
    def step(p, batch):
        return autopp.grad(jax.checkpoint(lambda q, b: nll(q, b).mean()))(p, batch)

    with pytest.raises(ValueError, match="inside jax.checkpoint call.*each layer"):
        autopp.parallelize(step, num_stages=2, num_microbatches=4, devices=jax.devices()[:2])(
            init(jax.random.key(0)), BATCH)


def test_per_example_prng_keys_split_through_the_layers_cross_stages():
    """Dropout keys in the batch, split once per layer: a typed key (and a raw one, which ``split`` wraps) is an
    activation that crosses the stage boundaries. SGD equals plain jit (each example keeps its own key)."""
    k = jax.random.split(jax.random.key(3), 4)
    params = {f"w{i}": jax.random.normal(k[i], (8, 8)) * 0.4 for i in range(4)}

    def loss(p, batch):
        def one(x, key):
            for i in range(4):
                key, sub = jax.random.split(key)
                x = jnp.where(jax.random.bernoulli(sub, 0.7, x.shape), jnp.tanh(x @ p[f"w{i}"]) / 0.7, 0.0) + x
            return x.sum()
        return jnp.mean(jax.vmap(one)(batch["x"], batch["key"]) ** 2)

    def make(vag):
        def step(p, batch):
            value, g = vag(loss)(p, batch)
            return jax.tree.map(lambda a, b: a - 0.05 * b, p, g), value
        return step

    x = jax.random.normal(jax.random.key(4), (16, 8))
    plain, pipelined = both(make)
    for keys in (jax.random.split(jax.random.key(5), 16), jax.random.split(jax.random.PRNGKey(5), 16)):
        want = plain(params, {"x": x, "key": keys})
        got = pipelined(params, {"x": x, "key": keys})
        assert_trees_close(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.filterwarnings("ignore:autopp.parallelize. the loss reads some examples")  # (the batch's x[0, 0])
@pytest.mark.parametrize("predicate", ["argument", "batch"])
def test_a_cond_around_the_whole_model_says_why_it_cannot_be_pipelined(predicate):
    """The model inside ``lax.cond``: one operation a stage boundary cannot cut. With the predicate a step argument
    the loss has too few operations; with a batch-dependent one a few tiny ones sit outside it, and the split would
    leave one stage with all the work. Both are refused, naming the cond and what to move out of it."""
    def loss(p, flag, batch):
        x, y = batch
        pred = flag > 0 if predicate == "argument" else x[0, 0] % 2 == 0
        per = jax.lax.cond(pred, lambda: nll(p, batch), lambda: 2.0 * nll(p, batch))
        return per.mean()

    def step(p, flag, batch):
        return autopp.grad(loss)(p, flag, batch)

    with pytest.raises(ValueError, match=r"lax.cond/lax.switch call.*compute the layers outside the cond"):
        autopp.parallelize(step, num_stages=2, num_microbatches=4, batch_argnums=2, devices=jax.devices()[:2])(
            init(jax.random.key(0)), jnp.int32(1), BATCH)


def test_a_batch_leaf_without_a_batch_axis_is_named_with_the_fix():
    batch = {"x": jnp.ones((16, 8)), "key": jax.random.PRNGKey(0)}  # a raw key: shape (2,)

    def step(w, b):
        return autopp.grad(lambda w_, b_: jnp.tanh(b_["x"] @ w_).mean())(w, b)

    with pytest.raises(ValueError, match=r"(?s)args\[1\]\['key'\]: leading dimension 2.*belongs in another argument"):
        autopp.parallelize(step, num_stages=2, num_microbatches=4, devices=jax.devices()[:2])(jnp.ones((8, 4)), batch)


@pytest.mark.parametrize("argnums", [(1, 0), (2, 0, 1)])
def test_gradients_come_back_in_the_order_of_argnums(argnums):
    """``argnums=(1, 0)`` returns the gradient of argument 1 first, as ``jax.value_and_grad`` does. autopp used to
    return them in the arguments' order (a user trial: the two gradients swapped silently; of different shapes, the
    update then failed far from the cause). Parameters of three shapes, so a swap cannot go unnoticed; SGD, 3 steps,
    against plain jit (<= 1e-6)."""
    tx = optax.sgd(0.1)
    params = init(jax.random.key(0))
    names = ("emb", "w", "head")

    def loss(emb, w, head, batch):
        return nll({"emb": emb, "w": w, "head": head}, batch).mean()

    def make(value_and_grad):
        def step(params, opt_state, batch):
            value, grads = value_and_grad(loss, argnums=argnums)(*(params[k] for k in names), batch)
            grads = {k: jnp.zeros_like(v) for k, v in params.items()} | {names[a]: g for a, g in zip(argnums, grads)}
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, value
        return step

    plain, pipelined = both(make)
    state, want = (params, tx.init(params)), (params, tx.init(params))
    for _ in range(3):
        *state, got_loss = pipelined(*state, BATCH)
        *want, want_loss = plain(*want, BATCH)
        np.testing.assert_allclose(got_loss, want_loss, rtol=1e-6)
    assert_trees_close(state[0], want[0], rtol=1e-6, atol=1e-6)


@pytest.mark.filterwarnings("ignore:autopp cost model")  # (a while_loop's trip count: priced once, said elsewhere)
def test_a_solver_holding_the_work_is_named_at_its_line():
    """A conjugate-gradient solve per example holds most of the loss's work (user trial META: 83% on 2 stages): the
    refusal named ``custom_linear_solve`` with no line and offered only ``num_stages=1``. It names what the user
    called (``jax.scipy.sparse.linalg.cg``), the line, and fewer stages."""
    w = jax.random.normal(jax.random.key(0), (32, 32)) * 0.1

    def loss(w, x):
        a = w @ w.T + jnp.eye(32)
        sol = jax.vmap(lambda r: jax.scipy.sparse.linalg.cg(lambda v: a @ v, r, maxiter=50)[0])(x)
        return jnp.mean(sol ** 2)

    def step(w, x):
        return autopp.grad(loss)(w, x)

    line = loss.__code__.co_firstlineno + 2
    with pytest.raises(ValueError, match=rf"(?s)one lax.custom_linear_solve \(jnp.linalg.solve, "
                                         rf"jax.scipy.sparse.linalg.cg\) call at .*test_step_signatures.py:{line}.*"
                                         r"Or use fewer stages"):
        autopp.parallelize(step, num_stages=2, num_microbatches=2, devices=jax.devices()[:2])(w, jnp.ones((8, 32)))

"""What a step returns and learns is what ``jax.jit`` of the same step gives, for steps whose meaning depends on
how the batch is split (a user trial's findings): a weight penalty under ``loss_reduction="sum"``, loss inputs the
step makes from the batch's shape alone, aux values computed from sizes. SGD in fp32, compared to 1e-6."""

from __future__ import annotations

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import autopp

B, T, V, H = 16, 8, 32, 16
TX = optax.sgd(0.05)


def _params(key):
    k = jax.random.split(key, 4)
    return {"embed": jax.random.normal(k[0], (V, H)) * 0.3, "pos": jax.random.normal(k[1], (T, H)) * 0.3,
            "w": jax.random.normal(k[2], (H, H)) * 0.3, "head": jax.random.normal(k[3], (H, V)) * 0.3}


def _batch(key):
    x = jax.random.randint(key, (B, T), 0, V)
    return {"x": x, "y": jnp.roll(x, -1, axis=1)}


def _nll(params, x, y, pos=None, keep=None):
    h = params["embed"][x] + (params["pos"] if pos is None else params["pos"][pos])
    h = jnp.tanh(h @ params["w"])
    if keep is not None:
        h = h * keep
    logp = jax.nn.log_softmax(h @ params["head"])
    return -jnp.take_along_axis(logp, y[..., None], axis=-1)[..., 0]


def _sgd_step(loss, n_out=0):
    """A step around ``loss(params, batch, *extra)``; ``n_out``: aux returned too."""
    def step(params, opt_state, batch):
        out, grads = autopp.value_and_grad(loss, has_aux=bool(n_out))(params, batch)
        updates, opt_state = TX.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, out
    return step


def _run(step, steps=3, **kw):
    """Results of ``steps`` steps under jit and parallelized with ``kw``."""
    params = _params(jax.random.key(0))
    results = []
    for fn in (jax.jit(step), autopp.parallelize(step, devices=jax.devices()[:2], **kw)):
        state = (params, TX.init(params))
        for i in range(steps):
            *state, out = fn(*state, _batch(jax.random.key(1 + i)))
        results.append((autopp.gather(state[0]), out))
    return results


def _assert_equal(a, b, tol=1e-6):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(x, np.float64), np.asarray(y, np.float64), rtol=tol, atol=tol)


@pytest.mark.parametrize("combine", ["plus", "scaled"])
def test_a_weight_penalty_counts_once_under_sum_reduction(combine):
    """``loss_reduction="sum"`` adds the microbatches' losses; a term that reads no batch (an L2 penalty) would count
    once per microbatch. Before: the loss at 4 microbatches was the data term plus 4x the penalty."""
    def loss(params, batch):
        data = _nll(params, batch["x"], batch["y"]).sum()
        l2 = sum(jnp.sum(p ** 2) for p in jax.tree.leaves(params))
        return data + l2 if combine == "plus" else (0.5 * l2 + data) * 0.25 - 1.0

    (p_jit, l_jit), (p_pp, l_pp) = _run(_sgd_step(loss), num_stages=2, num_microbatches=4, loss_reduction="sum")
    _assert_equal(l_jit, l_pp)
    _assert_equal(p_jit, p_pp)


def test_loss_inputs_made_from_the_batch_s_shape_are_split_with_it():
    """Position ids broadcast to the batch's shape and per-example dropout keys split to its size carry no data from
    the batch; they are microbatched all the same, each microbatch reading its rows as under jit. Before: the trace
    at microbatch size failed (shapes (4, 8, 16) and (16, 8, 16) do not broadcast)."""
    def loss(params, batch, pos, keys):
        keep = jax.vmap(lambda k: jax.random.bernoulli(k, 0.8, (T, H)))(keys) / 0.8
        return _nll(params, batch["x"], batch["y"], pos=pos, keep=keep).mean()

    def step(params, opt_state, batch):
        b, t = batch["x"].shape
        pos = jnp.broadcast_to(jnp.arange(t), (b, t))
        keys = jax.random.split(jax.random.key(7), b)
        out, grads = autopp.value_and_grad(loss)(params, batch, pos, keys)
        updates, opt_state = TX.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, out

    (p_jit, l_jit), (p_pp, l_pp) = _run(step, num_stages=2, num_microbatches=4)
    _assert_equal(l_jit, l_pp)
    _assert_equal(p_jit, p_pp)


def test_aux_values_computed_from_sizes_are_the_whole_batch_s():
    """An aux value made from the batch's size (``x.shape[0]`` and arithmetic on it) reads no input: the step returns
    the whole batch's value, as jit does, not the microbatches' mean. Before: ``jnp.float32(n) * 2`` came back as
    8 (jit: 32) and an integer size was refused under ``"mean"``."""
    def loss(params, batch):
        n = batch["x"].shape[0]
        return _nll(params, batch["x"], batch["y"]).mean(), {"n": n, "twice": jnp.float32(n) * 2.0,
                                                             "ones": jnp.ones(n).sum()}

    (_, (l_jit, aux_jit)), (_, (l_pp, aux_pp)) = _run(_sgd_step(loss, n_out=1), steps=1, num_stages=2,
                                                      num_microbatches=4)
    _assert_equal(l_jit, l_pp)
    assert {k: float(v) for k, v in aux_pp.items()} == {k: float(v) for k, v in aux_jit.items()} == {
        "n": 16.0, "twice": 32.0, "ones": 16.0}


def test_a_loss_returning_a_pair_without_has_aux_is_told_to_pass_has_aux():
    def loss(params, batch):
        return _nll(params, batch["x"], batch["y"]).mean(), {"acc": jnp.float32(0.5)}

    params = _params(jax.random.key(0))
    step = autopp.parallelize(_sgd_step(loss), num_stages=2, num_microbatches=2, devices=jax.devices()[:2])
    with pytest.raises(TypeError, match="real scalar loss, got a tuple.*pass has_aux=True"):
        step(params, TX.init(params), _batch(jax.random.key(1)))


def test_the_planner_counts_a_weight_penalty_once_too(monkeypatch):
    """The same with the stages and microbatches planned (the planner's layers are placed in the pipeline's forward
    before the penalty is scaled): 2 stages x 4 microbatches, as jit."""
    import functools

    from autopp.planner import _local

    monkeypatch.setattr("autopp.planner.plan_local", functools.partial(_local.plan_local, num_stages=2,
                                                                       num_microbatches=4))

    def loss(params, batch):
        return _nll(params, batch["x"], batch["y"]).sum() + 0.1 * sum(jnp.sum(p ** 2) for p in jax.tree.leaves(params))

    (p_jit, l_jit), (p_pp, l_pp) = _run(_sgd_step(loss), loss_reduction="sum")
    _assert_equal(l_jit, l_pp)
    _assert_equal(p_jit, p_pp)


def test_an_offline_plan_for_a_summed_loss_replays():
    """A step whose loss divides by a count over the whole batch needs ``loss_reduction="sum"``; a plan made for it
    by ``plan_model(..., loss_reduction="sum")`` (``autopp plan --loss-reduction sum``) says so and replays equal to
    jit. Before, every offline plan said "mean", which such a step refuses, so none could be replayed."""
    from autopp.planner import plan_model
    from autopp.profiler import Cluster, profile

    def loss(params, batch, count):
        return (_nll(params, batch["x"], batch["y"]) * batch["mask"]).sum() / count

    def step(params, opt_state, batch):  # the whole batch's masked token mean
        out, grads = autopp.value_and_grad(loss)(params, batch, batch["mask"].sum())
        updates, opt_state = TX.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, out

    def batch_at(i):
        b = _batch(jax.random.key(1 + i))
        return {**b, "mask": (jax.random.uniform(jax.random.key(50 + i), (B, T)) < 0.7).astype(jnp.float32)}

    params = _params(jax.random.key(0))
    cluster = Cluster.local(jax.devices()[:2])
    prof = profile(step, params, TX.init(params), batch_at(0), cluster=cluster)
    with pytest.raises(ValueError, match="loss_reduction"):
        plan_model(prof, cluster, global_batch=B, loss_reduction="avg")
    plan = plan_model(prof, cluster, global_batch=B, pipeline_degrees=(2,), microbatch_sizes=(4,),
                      loss_reduction="sum")
    assert plan.loss_reduction == "sum" and plan.num_microbatches == 4
    with pytest.raises(ValueError, match="--loss-reduction sum"):
        autopp.parallelize(step, plan=dataclasses.replace(plan, loss_reduction="mean"),
                           devices=jax.devices()[:2])(params, TX.init(params), batch_at(0))
    results = []
    for fn in (jax.jit(step), autopp.parallelize(step, plan=plan, devices=jax.devices()[:2])):
        state = (params, TX.init(params))
        for i in range(3):
            *state, out = fn(*state, batch_at(i))
        results.append((autopp.gather(state[0]), out))
    _assert_equal(results[0][1], results[1][1])
    _assert_equal(results[0][0], results[1][0])


def test_a_non_array_argument_of_the_loss_is_static_as_under_jax_grad():
    """``value_and_grad(loss)(params, batch, "mean")``: a string (any non-array) outside argnums is passed through as
    ``jax.grad`` does (it used to fail with jit's "non-array argument" error); inside argnums it is refused."""
    def loss(params, batch, mode):
        nll = _nll(params, batch["x"], batch["y"])
        return nll.mean() if mode == "mean" else nll.sum()

    def step(params, opt_state, batch):
        out, grads = autopp.value_and_grad(loss)(params, batch, "mean")
        updates, opt_state = TX.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, out

    (p_jit, l_jit), (p_pp, l_pp) = _run(step, num_stages=2, num_microbatches=4)
    _assert_equal(l_jit, l_pp)
    _assert_equal(p_jit, p_pp)

    def bad(params, opt_state, batch):
        return autopp.value_and_grad(lambda p, m: loss(p, batch, m), argnums=1)(params, "mean")

    params = _params(jax.random.key(0))
    with pytest.raises(TypeError, match="str"):
        autopp.parallelize(bad, num_stages=2, num_microbatches=4, devices=jax.devices()[:2])(
            params, TX.init(params), _batch(jax.random.key(1)))


def test_python_numbers_passed_to_the_loss_stay_python_numbers_as_under_jax_grad():
    """``value_and_grad(loss)(params, batch, 0.5, train=True)``: a Python number or bool outside argnums is passed
    through as ``jax.grad`` passes it, so the loss may branch on it (``if train and rate > 0``); it raised
    ``TracerBoolConversionError`` (a user trial). Inside argnums a Python float is still differentiated."""
    def loss(params, batch, rate, scale=np.float32(1.0), train=False):
        nll = _nll(params, batch["x"], batch["y"])
        if train and rate > 0:
            nll = nll * (1 - rate) * scale
        return nll.mean()

    def step(params, opt_state, batch):
        out, grads = autopp.value_and_grad(loss)(params, batch, 0.5, np.float32(2.0), train=True)
        updates, opt_state = TX.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, out

    (p_jit, l_jit), (p_pp, l_pp) = _run(step, num_stages=2, num_microbatches=4)
    _assert_equal(l_jit, l_pp)
    _assert_equal(p_jit, p_pp)

    def by_a_float(params, opt_state, batch):
        return autopp.grad(lambda t, p: loss(p, batch, 0.5, train=True) * t, argnums=0)(2.0, params)

    params = _params(jax.random.key(0))
    got = autopp.parallelize(by_a_float, num_stages=2, num_microbatches=4, devices=jax.devices()[:2])(
        params, TX.init(params), _batch(jax.random.key(1)))
    np.testing.assert_allclose(got, jax.jit(by_a_float)(params, TX.init(params), _batch(jax.random.key(1))),
                               rtol=1e-6)


@pytest.mark.parametrize("num_stages", [1, 2])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_an_aux_read_off_the_parameters_is_the_step_s_value(num_stages, reduction):
    """An aux that reads no batch input (a weight norm, a normalised vector kept for power iteration) is the same in
    every microbatch; the step returns it as jit does. Before (trial K): under ``"sum"`` it came back
    ``num_microbatches`` times jit's value (a unit vector of norm 4 at 4 microbatches)."""
    def loss(params, batch):
        nll = _nll(params, batch["x"], batch["y"])
        w = params["w"][:, 0]
        aux = {"norm": jnp.sum(params["w"] ** 2), "u": w / jnp.linalg.norm(w), "count": jnp.int32(params["w"].ndim)}
        return (nll.mean() if reduction == "mean" else nll.sum()), aux

    (p_jit, (l_jit, aux_jit)), (p_pp, (l_pp, aux_pp)) = _run(
        _sgd_step(loss, n_out=1), num_stages=num_stages, num_microbatches=4, loss_reduction=reduction)
    _assert_equal((l_jit, aux_jit), (l_pp, aux_pp))
    assert aux_pp["count"].dtype == jnp.int32 and int(aux_pp["count"]) == 2
    _assert_equal(p_jit, p_pp)


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_a_typed_key_kept_for_the_backward(recompute):
    """A typed PRNG key (``jax.random.key``) that a stage keeps for its backward (a ``jax.checkpoint``-ed layer with
    feature-wise dropout redraws its mask there): the residuals are packed by dtype, and a key has no bytes to pack.
    Before (trial K): ``TypeError: Cannot interpret 'key<fry>' as a data type`` with 2 stages. The mask is the same
    for every example, so the step equals jit's."""
    def layer(w, h, key):
        return jnp.tanh(h @ w) * jax.random.bernoulli(key, 0.9, h.shape[1:]) / 0.9

    def loss(params, batch, key):
        h = params["embed"][batch["x"]] + params["pos"]
        for i, name in enumerate(("w", "w", "head")):
            h = jax.checkpoint(layer)(params[name], h, jax.random.fold_in(key, i)) if name == "w" else h @ params[name]
        logp = jax.nn.log_softmax(h)
        return -jnp.take_along_axis(logp, batch["y"][..., None], axis=-1).mean()

    def step(params, opt_state, batch):
        out, grads = autopp.value_and_grad(loss)(params, batch, jax.random.key(3))
        updates, opt_state = TX.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, out

    (p_jit, l_jit), (p_pp, l_pp) = _run(step, num_stages=2, num_microbatches=4, recompute=recompute)
    _assert_equal(l_jit, l_pp)
    _assert_equal(p_jit, p_pp)


def test_debug_callbacks_fire_in_every_stage_and_in_the_update():
    """``jax.debug.callback`` (what ``jax.debug.print`` is) computes nothing a stage needs, so the stage split and
    the update's placement used to drop it with 2 stages (trial K: nothing printed, no warning). In the loss it now
    fires once per microbatch with that microbatch's value, as a 1-stage run does; in the step, once, with jit's."""
    seen = {"loss": [], "step": []}

    def loss(params, batch):
        h = params["embed"][batch["x"]] + params["pos"]
        jax.debug.callback(lambda v: seen["loss"].append(float(v)), h.mean())
        return _nll(params, batch["x"], batch["y"]).mean()

    def step(params, opt_state, batch):
        out, grads = autopp.value_and_grad(loss)(params, batch)
        jax.debug.callback(lambda v: seen["step"].append(float(v)), optax.tree.norm(grads))
        updates, opt_state = TX.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, out

    params, batch = _params(jax.random.key(0)), _batch(jax.random.key(1))
    jax.block_until_ready(jax.jit(step)(params, TX.init(params), batch))
    jax.effects_barrier()
    want_step = seen["step"][:]
    seen["loss"].clear(), seen["step"].clear()
    jax.block_until_ready(autopp.parallelize(step, num_stages=2, num_microbatches=4, devices=jax.devices()[:2])(
        params, TX.init(params), batch))
    jax.effects_barrier()
    h = np.asarray(params["embed"])[np.asarray(batch["x"])] + np.asarray(params["pos"])
    np.testing.assert_allclose(sorted(seen["loss"]), sorted(h.reshape(4, -1).mean(axis=1)), rtol=1e-5)
    np.testing.assert_allclose(seen["step"], want_step, rtol=1e-5)


@pytest.mark.parametrize("schedule", ["zb-h1", "dualpipev"])
def test_callbacks_in_a_custom_vjp_backward_fire_under_split_backward_passes(schedule):
    """A ``jax.debug.callback`` in a ``custom_vjp`` backward computes nothing the input or weight gradient needs: the
    zero-bubble split of the backward dropped it (a trial: 0 of 12 calls under zb-h1, 8 under dualpipev, 12 under
    1f1b), also on the first stage, which runs no input-gradient pass. Once per layer and microbatch, as 1f1b."""
    count = {"bwd": 0}

    @jax.custom_vjp
    def layer(w, x):
        return jnp.tanh(x @ w)

    def layer_fwd(w, x):
        y = jnp.tanh(x @ w)
        return y, (w, x, y)

    def layer_bwd(res, g):
        w, x, y = res
        jax.debug.callback(lambda: count.__setitem__("bwd", count["bwd"] + 1))
        gy = g * (1 - y ** 2)
        return x.T @ gy, gy @ w.T

    layer.defvjp(layer_fwd, layer_bwd)

    def loss(p, batch):
        h = batch["x"]
        for name in ("a", "b", "c"):
            h = layer(p[name], h)
        return jnp.mean((h - batch["y"]) ** 2)

    def step(p, batch):
        return jax.tree.map(lambda a, g: a - 0.1 * g, p, autopp.grad(loss)(p, batch))

    keys = jax.random.split(jax.random.key(0), 5)
    p = {n: jax.random.normal(k, (8, 8)) / 3 for n, k in zip("abc", keys)}
    batch = {"x": jax.random.normal(keys[3], (8, 8)), "y": jax.random.normal(keys[4], (8, 8))}
    pipelined = autopp.parallelize(step, num_stages=2, num_microbatches=4, schedule=schedule,
                                   devices=jax.devices()[:2])
    got = pipelined(p, batch)
    jax.block_until_ready(got)
    jax.effects_barrier()
    assert count["bwd"] == 3 * 4
    count["bwd"] = 0
    want = jax.jit(step)(p, batch)
    jax.effects_barrier()
    assert count["bwd"] == 3
    for a, b in zip(jax.tree.leaves(autopp.gather(got)), jax.tree.leaves(want)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_a_next_key_handed_back_as_aux(reduction):
    """A loss that splits its PRNG key and hands the next key back as aux: the key reads no batch input, so every
    microbatch makes the same one and the step returns it, as jit does. Before (trial K): refused under "mean" as not
    a float, a raw ``add does not accept dtype key<fry>`` under "sum"."""
    def loss(params, batch, key):
        key, sub = jax.random.split(key)
        keep = jax.random.bernoulli(sub, 0.9, (H,)) / 0.9
        nll = _nll(params, batch["x"], batch["y"], keep=keep)
        return (nll.mean() if reduction == "mean" else nll.sum()), key

    def step(params, opt_state, key, batch):
        (out, key), grads = autopp.value_and_grad(loss, has_aux=True)(params, batch, key)
        updates, opt_state = TX.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, key, out

    params, batch = _params(jax.random.key(0)), _batch(jax.random.key(1))
    want = jax.jit(step)(params, TX.init(params), jax.random.key(5), batch)
    got = autopp.parallelize(step, num_stages=2, num_microbatches=4, devices=jax.devices()[:2],
                             loss_reduction=reduction)(params, TX.init(params), jax.random.key(5), batch)
    assert (jax.random.key_data(got[2]) == jax.random.key_data(want[2])).all()
    _assert_equal((autopp.gather(got[0]), got[3]), (want[0], want[3]))


def test_state_updated_on_two_stages_from_a_batch_statistic():
    """A non-trained input the last stage reads (a class prior for logit adjustment) updated in the step by a whole-
    batch statistic of an input the first stage reads (``x.mean()``). The update runs on both stages; the statistic's
    program left it out of its outputs because its only reader was the same equation on its own stage (a user trial:
    ``AssertionError: no location holds Var``, on the second call, with the outputs fed back). SGD with momentum,
    3 steps, against plain jit (<= 1e-6)."""
    ks = jax.random.split(jax.random.key(0), 8)
    params = {"layers": [{"w": jax.random.normal(ks[i], (16 if i == 0 else 32, 32)) * 0.2, "b": jnp.zeros(32)}
                         for i in range(6)],
              "head": {"w": jax.random.normal(ks[6], (32, 8)) * 0.2, "b": jnp.zeros(8)}}
    stats = {"prior": jnp.full((8,), 1 / 8)}
    x, y = jax.random.normal(ks[7], (16, 16)), jax.random.randint(ks[5], (16,), 0, 8)
    tx = optax.sgd(0.1, momentum=0.9)

    def loss(params, stats, x, y):
        h = x
        for lp in params["layers"]:
            h = jnp.tanh(h @ lp["w"] + lp["b"])
        logits = h @ params["head"]["w"] + params["head"]["b"] + jnp.log(stats["prior"])
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], 1))

    def make(value_and_grad):
        def step(params, opt_state, stats, x, y):
            value, grads = value_and_grad(loss)(params, stats, x, y)
            updates, opt_state = tx.update(grads, opt_state, params)
            prior = stats["prior"] * (1 + 0.01 * x.mean())
            return optax.apply_updates(params, updates), opt_state, {"prior": prior}, value
        return step

    plain = jax.jit(make(jax.value_and_grad))
    pipelined = autopp.parallelize(make(autopp.value_and_grad), num_stages=2, num_microbatches=4,
                                   devices=jax.devices()[:2], batch_argnums=(3, 4))
    got = want = (params, tx.init(params), stats)
    for _ in range(3):
        *got, got_loss = pipelined(*got, x, y)
        *want, want_loss = plain(*want, x, y)
        np.testing.assert_allclose(got_loss, want_loss, rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6), tuple(got), tuple(want))


@pytest.mark.parametrize("per_example", [False, True], ids=["batch", "vmap"])
def test_autopp_grad_inside_the_loss_is_jax_grad(per_example):
    """A gradient penalty written with ``autopp.grad`` inside the loss (the README: outside ``parallelize`` these are
    JAX's functions; inside the loss they are too). It used to be taken for a second marked gradient: "Differentiation
    rule for 'autopp_value_and_grad' not implemented", or its batching rule under ``vmap`` (a user trial). SGD, 3
    steps, against plain jit's accumulation over the same microbatches (<= 1e-6)."""
    tx, M = optax.sgd(0.1), 4
    params = {"w1": jax.random.normal(jax.random.key(0), (8, 16)) * 0.3,
              "w2": jax.random.normal(jax.random.key(1), (16, 1)) * 0.3}
    x = jax.random.normal(jax.random.key(2), (16, 8))

    def make(grad):
        def loss(p, x):
            def score(xx):
                return (jnp.tanh(xx @ p["w1"]) @ p["w2"]).sum()
            gx = jax.vmap(grad(score))(x) if per_example else grad(score)(x)
            return jnp.mean(jnp.tanh(x @ p["w1"]) ** 2) + 0.1 * jnp.mean(gx ** 2)
        return loss

    def pipelined_step(params, opt_state, x):
        value, grads = autopp.value_and_grad(make(autopp.grad))(params, x)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    def plain_step(params, opt_state, x):
        values, grads = jax.vmap(jax.value_and_grad(make(jax.grad)), in_axes=(None, 0))(params, x.reshape(M, -1, 8))
        updates, opt_state = tx.update(jax.tree.map(lambda g: g.mean(0), grads), opt_state, params)
        return optax.apply_updates(params, updates), opt_state, values.mean()

    pipelined = autopp.parallelize(pipelined_step, num_stages=2, num_microbatches=M, devices=jax.devices()[:2])
    got = want = (params, tx.init(params))
    for _ in range(3):
        *got, got_loss = pipelined(*got, x)
        *want, want_loss = jax.jit(plain_step)(*want, x)
        np.testing.assert_allclose(got_loss, want_loss, rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6), got[0], want[0])


def _plain_accumulation(loss, M, batch_keys):
    """``(value, grads)`` of ``loss(params, *others, batch)`` as the pipeline defines it: the mean of the losses of
    ``M`` microbatches of ``batch`` (the leaves named in ``batch_keys`` split), every other argument read whole."""
    def value_and_grad(params, *others_and_batch):
        *others, batch = others_and_batch
        mbs = {k: v.reshape((M, -1) + v.shape[1:]) if k in batch_keys else v for k, v in batch.items()}
        axes = {k: 0 if k in batch_keys else None for k in batch}
        values, grads = jax.vmap(jax.value_and_grad(loss), in_axes=(None, *[None] * len(others), axes))(
            params, *others, mbs)
        return values.mean(), jax.tree.map(lambda g: g.mean(0), grads)
    return value_and_grad


@pytest.mark.parametrize("case", ["statistic", "gan"])
def test_a_loss_input_computed_from_the_whole_batch_is_read_whole(case):
    """A value the step computes from the whole batch before the loss and the loss reads: a batch statistic, or a
    discriminator
    updated by ``jax.grad`` over the whole batch before the generator's loss reads it (a user trial's GAN). It used
    to be split into microbatches with the batch, then refused ("the loss inputs do not scale with the batch"); the
    step traced at twice the batch shows it does not grow, so every microbatch reads the step's value, as under
    jax.jit. SGD, 3 steps, against plain jit's accumulation over the same microbatches (<= 1e-6)."""
    M, B = 4, 16
    tx = optax.sgd(0.1)
    k = jax.random.split(jax.random.key(0), 6)
    x = jax.random.normal(k[0], (B, 12))
    params = {"w1": jax.random.normal(k[1], (12, 16)) * 0.3, "w2": jax.random.normal(k[2], (16, 1)) * 0.3}
    disc = {"w": jax.random.normal(k[3], (1, 8)) * 0.3, "v": jax.random.normal(k[4], (8, 1)) * 0.3}

    def gen(p, x):
        return jnp.tanh(jnp.tanh(x @ p["w1"]) @ p["w2"])

    def critic(d, y):
        return jnp.tanh(y @ d["w"]) @ d["v"]

    if case == "statistic":
        def loss(p, mu, batch):
            return jnp.mean((gen(p, batch["x"] - mu) - 0.5) ** 2)

        def make(value_and_grad):
            def step(params, disc, opt_state, batch):
                value, grads = value_and_grad(loss)(params, batch["x"].mean(0), batch)
                updates, opt_state = tx.update(grads, opt_state, params)
                return optax.apply_updates(params, updates), disc, opt_state, value
            return step
    else:
        def loss(p, d, batch):
            return jnp.mean(jax.nn.softplus(-critic(d, gen(p, batch["x"]))))

        def make(value_and_grad):
            def step(params, disc, opt_state, batch):
                fake = jax.lax.stop_gradient(gen(params, batch["x"]))
                dg = jax.grad(lambda d: jnp.mean(jax.nn.softplus(critic(d, fake))))(disc)  # whole batch
                disc = jax.tree.map(lambda a, g: a - 0.1 * g, disc, dg)
                value, grads = value_and_grad(loss)(params, disc, batch)
                updates, opt_state = tx.update(grads, opt_state, params)
                return optax.apply_updates(params, updates), disc, opt_state, value
            return step

    plain = jax.jit(make(lambda f: _plain_accumulation(f, M, {"x"})))
    pipelined = autopp.parallelize(make(autopp.value_and_grad), num_stages=2, num_microbatches=M,
                                   devices=jax.devices()[:2])
    got = want = (params, disc, tx.init(params))
    for _ in range(3):
        *got, got_loss = pipelined(*got, {"x": x})
        *want, want_loss = plain(*want, {"x": x})
        np.testing.assert_allclose(got_loss, want_loss, rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6), tuple(got), tuple(want))


def test_one_value_returned_twice_in_the_aux():
    """``return loss, {"loss": loss, ...}`` (t5x's and Flax's metrics habit) and one array under two names: each
    output of the same value took the first one's microbatch parts, and the second was left with none
    (``AssertionError: (1, 0)`` at 2 stages, a user trial). SGD, 2 steps, against plain jit's accumulation."""
    M, tx = 4, optax.sgd(0.1)
    params = {"w1": jax.random.normal(jax.random.key(0), (8, 16)) * 0.3,
              "w2": jax.random.normal(jax.random.key(1), (16, 1)) * 0.3}
    batch = {"x": jax.random.normal(jax.random.key(2), (16, 8))}

    def loss(p, batch):
        h = jnp.tanh(batch["x"] @ p["w1"])
        value = jnp.mean((h @ p["w2"]) ** 2)
        return value, {"loss": value, "h": h, "h_again": h, "scale": jnp.abs(h).mean()}

    def make(value_and_grad):
        def step(params, opt_state, batch):
            (value, aux), grads = value_and_grad(loss, has_aux=True)(params, batch)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, value, aux
        return step

    def plain_vag(f, has_aux):
        def vag(params, batch):
            mbs = jax.tree.map(lambda v: v.reshape((M, -1) + v.shape[1:]), batch)
            (values, aux), grads = jax.vmap(jax.value_and_grad(f, has_aux=True), in_axes=(None, 0))(params, mbs)
            aux = {k: v.reshape((-1,) + v.shape[2:]) if k.startswith("h") else v.mean(0) for k, v in aux.items()}
            return (values.mean(), aux), jax.tree.map(lambda g: g.mean(0), grads)
        return vag

    pipelined = autopp.parallelize(make(autopp.value_and_grad), num_stages=2, num_microbatches=M,
                                   devices=jax.devices()[:2])
    plain = jax.jit(make(plain_vag))
    got = want = (params, tx.init(params))
    for _ in range(2):
        *got, got_loss, got_aux = pipelined(*got, batch)
        *want, want_loss, want_aux = plain(*want, batch)
        np.testing.assert_allclose(got_loss, want_loss, rtol=1e-6)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6), got_aux, want_aux)
    np.testing.assert_allclose(got_aux["loss"], got_loss, rtol=0)


@pytest.mark.parametrize("num_stages", [1, 2])
def test_integer_aux_with_one_microbatch(num_stages):
    """With one microbatch nothing is combined: an integer aux (each token's chosen class, a count) comes back as jit
    returns it, dtype included. Before, it was refused as "averaged over microbatches" (a user trial: a planner that
    picks one microbatch made a step that ran with two fail)."""
    def loss(params, batch):
        nll = _nll(params, batch["x"], batch["y"])
        return nll.mean(), {"choice": jnp.argmax(params["embed"][batch["x"]], -1), "count": (nll > 3.0).sum()}

    (p_jit, (l_jit, aux_jit)), (p_pp, (l_pp, aux_pp)) = _run(_sgd_step(loss, n_out=1), num_stages=num_stages,
                                                             num_microbatches=1)
    assert {k: v.dtype for k, v in aux_pp.items()} == {k: v.dtype for k, v in aux_jit.items()}
    _assert_equal((l_jit, aux_jit), (l_pp, aux_pp))
    _assert_equal(p_jit, p_pp)


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_training_only_the_head_over_four_stages(schedule):
    """Frozen blocks passed outside ``argnums``, only the head trained (linear probing): the middle stages have
    nothing to differentiate, and their (empty) backward programs are equal stages'. It crashed building them
    (``KeyError: CpuDevice(id=0)``: a program without arguments lowers on the default device, a user trial); now it
    trains as jit, the frozen blocks returned bit for bit."""
    Vt, Tt, D = 64, 16, 32
    k = jax.random.split(jax.random.key(0), 7)
    frozen = {"embed": jax.random.normal(k[0], (Vt, D)) * 0.1, "pos": jax.random.normal(k[1], (Tt, D)) * 0.1,
              "blocks": [{"w": jax.random.normal(k[2 + i], (D, D)) * 0.1, "unused": jnp.ones((D,))}
                         for i in range(4)]}
    head = {"w": jax.random.normal(k[6], (D, Vt)) * 0.1}

    def loss(frozen, head, batch):
        h = frozen["embed"][batch["x"]] + frozen["pos"]
        for block in frozen["blocks"]:
            h = h + jnp.tanh(h @ block["w"])
        logp = jax.nn.log_softmax(h @ head["w"])
        return -jnp.take_along_axis(logp, batch["y"][..., None], axis=-1).mean()

    def step(frozen, head, opt_state, batch):
        value, grads = autopp.value_and_grad(loss, argnums=1)(frozen, head, batch)
        updates, opt_state = TX.update(grads, opt_state, head)
        return frozen, optax.apply_updates(head, updates), opt_state, value

    def batch_at(i):
        x = jax.random.randint(jax.random.key(10 + i), (16, Tt), 0, Vt)
        return {"x": x, "y": jnp.roll(x, -1, axis=1)}

    results = []
    for fn in (jax.jit(step), autopp.parallelize(step, num_stages=4, num_microbatches=8, schedule=schedule,
                                                 devices=jax.devices()[:4])):
        state = (frozen, head, TX.init(head))
        for i in range(3):
            *state, out = fn(*state, batch_at(i))
        results.append((autopp.gather(state[0]), autopp.gather(state[1]), out))
    _assert_equal(results[0][1:], results[1][1:])
    assert all((np.asarray(a) == np.asarray(b)).all()
               for a, b in zip(jax.tree.leaves(results[1][0]), jax.tree.leaves(frozen)))


def test_step_code_that_runs_only_at_the_full_batch_feeds_the_loss_rows():
    """GRPO-style advantages: rewards normalised within groups of 8 examples in the step, before the loss. At 4
    microbatches of 4 examples the step cannot run at microbatch size (``reshape(-1, 8)``), and it was refused; the
    runtime runs that code on the whole batch and splits the advantages by rows, so the loss alone is traced at
    those rows (a user trial). Equals jit."""
    def loss(params, x, y, adv):
        return (_nll(params, x, y).mean(-1) * adv).mean()

    def step(params, opt_state, batch):
        r = batch["y"].sum(-1).astype(jnp.float32).reshape(-1, 8)
        adv = ((r - r.mean(1, keepdims=True)) / (r.std(1, keepdims=True) + 1e-6)).reshape(-1)
        out, grads = autopp.value_and_grad(loss)(params, batch["x"], batch["y"], adv)
        updates, opt_state = TX.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, out

    (p_jit, l_jit), (p_pp, l_pp) = _run(step, num_stages=2, num_microbatches=4)
    _assert_equal(l_jit, l_pp)
    _assert_equal(p_jit, p_pp)


def test_a_whole_batch_value_as_long_as_the_batch_is_refused_with_the_keepdims_fix():
    """A mean over the batch per feature, ``[H]`` with ``H`` equal to the batch size, looks per example and keeps its
    shape per microbatch: refused, and the message now says to give it a leading axis of 1, which runs as jit."""
    assert H == B

    def loss(params, x, y, baseline):
        return (_nll(params, x, y) - baseline.sum()).mean()

    def step_with(keepdims):
        def step(params, opt_state, batch):
            baseline = jax.lax.stop_gradient(params["embed"][batch["x"]].mean((0, 1), keepdims=keepdims))
            out, grads = autopp.value_and_grad(loss)(params, batch["x"], batch["y"], baseline)
            updates, opt_state = TX.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, out
        return step

    with pytest.raises(ValueError, match=r"keepdims=True"):
        _run(step_with(False), num_stages=2, num_microbatches=2)
    (p_jit, l_jit), (p_pp, l_pp) = _run(step_with(True), num_stages=2, num_microbatches=2)
    _assert_equal(l_jit, l_pp)
    _assert_equal(p_jit, p_pp)


@pytest.mark.parametrize("prepare, misaligned", [
    (lambda b: jnp.concatenate([b["y"], b["y"]]).astype(jnp.float32), True),  # 2B rows: B of them are copies
    (lambda b: b["x"].T.reshape(-1).astype(jnp.float32), True),  # positions first, then examples
    (lambda b: b["y"].reshape(2, -1).mean(0).astype(jnp.float32), True),  # a statistic over half the batch
    (lambda b: (b["y"][:, :-1] * 2).astype(jnp.float32), False),  # per example
    (lambda b: jnp.cumsum(b["y"], axis=1).astype(jnp.float32), False),  # along positions, per example
    # rows paired by rank (minibatch OT flow matching's coupling) and shuffled: row i is read beside example i, as
    # jit reads it (a false warning in trial DIFF, whose advice, the coupling inside the loss, gave 1.9243 for 2.1533)
    (lambda b: b["y"][jnp.argsort(b["y"][:, 0])][jnp.argsort(jnp.argsort(b["y"][:, 1]))].astype(jnp.float32), False),
    (lambda b: b["y"][jax.random.permutation(jax.random.key(3), b["y"].shape[0])].astype(jnp.float32), False),
])
def test_loss_inputs_whose_rows_are_not_the_examples_are_warned_about(prepare, misaligned):
    """A loss input the step computes from the batch is split by rows; where autopp cannot follow the examples to
    those rows, each microbatch reads rows that are not its own examples' (a user trial: ``concatenate([y, -y])``
    read by its first rows gave loss 1.23 against jit's 0.71, silently). Said in a warning, which names the input as
    the loss's argument; per-example values are not."""
    def loss(params, x, y, extra):
        return _nll(params, x, y).mean() + 0.0 * extra.sum()

    def step(params, opt_state, batch):
        out, grads = autopp.value_and_grad(loss)(params, batch["x"], batch["y"], prepare(batch))
        updates, opt_state = TX.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, out

    params = _params(jax.random.key(0))
    pipelined = autopp.parallelize(step, num_stages=2, num_microbatches=4, devices=jax.devices()[:2])
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        pipelined.plan_for(params, TX.init(params), _batch(jax.random.key(1)))
    said = [w for w in record if "cannot follow the batch's examples" in str(w.message)]
    assert bool(said) == misaligned, [str(w.message)[:200] for w in record]
    # named as the loss reads it: its fourth argument (it was "loss input(s) #3", a position among flattened inputs)
    assert all("loss input(s) args[3] float32[" in str(w.message) for w in said), [str(w.message) for w in said]


def test_examples_drawn_from_the_batch_in_the_step_are_split_alike():
    """Importance sampling by per-example gradient norms: the step draws half the batch's rows (x[idx], y[idx] and
    their weights) and the loss reads only those, so every loss input is split by rows of the same length, each
    microbatch's read beside each other as jit reads them. It warned that a microbatch reads rows that are not its
    own examples' (trial DPSGD), with values equal to jit's; its advice, the gather inside the loss, gave 0.5687 for
    2.0800."""
    def loss(params, x, y, w):
        return jnp.mean(w * _nll(params, x, y).mean(1))

    def step(params, opt_state, batch):
        idx = jax.random.choice(jax.random.key(2), batch["x"].shape[0], (batch["x"].shape[0] // 2,))
        out, grads = autopp.value_and_grad(loss)(params, batch["x"][idx], batch["y"][idx],
                                                 1.0 + (batch["y"][idx, 0] % 3).astype(jnp.float32))
        updates, opt_state = TX.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, out

    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        (p_jit, l_jit), (p_pp, l_pp) = _run(step, num_stages=2, num_microbatches=4)
    assert not [str(w.message) for w in record if "autopp" in str(w.message)]
    _assert_equal(l_jit, l_pp)
    _assert_equal(p_jit, p_pp)


@pytest.mark.parametrize("name", ["MultiSteps", "apply_if_finite"])
def test_an_update_under_lax_cond_runs_on_each_parameter_s_stage(name):
    """optax.MultiSteps and apply_if_finite update under lax.cond: the one equation read every gradient, so it ran
    whole on stage 0, which then held every parameter and its state (a trial: 4.8x the peak memory of the other
    stages). Both branches computed and selected, each parameter's part runs on its stage; equal to jit (SGD),
    a non-finite gradient skipped as jit skips it."""
    inner = optax.sgd(0.1)
    tx = optax.MultiSteps(inner, 2) if name == "MultiSteps" else optax.apply_if_finite(inner, 3)

    def loss(p, b):
        h = b["x"]
        for k in sorted(p):
            h = jnp.tanh(h @ p[k])
        return jnp.mean((h - b["y"]) ** 2)

    def step(p, s, b):
        value, g = autopp.value_and_grad(loss)(p, b)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s, value

    keys = jax.random.split(jax.random.key(0), 6)
    params = {f"w{i}": jax.random.normal(keys[i], (8, 8)) / 3 for i in range(4)}
    batches = [{"x": jax.random.normal(keys[4], (8, 8)), "y": jax.random.normal(keys[5], (8, 8))} for _ in range(3)]
    batches[1] = {"x": batches[1]["x"].at[0, 0].set(jnp.nan), "y": batches[1]["y"]}  # a non-finite gradient
    pipelined = autopp.parallelize(step, num_stages=4, num_microbatches=2, devices=jax.devices()[:4])
    got = want = (params, tx.init(params))
    for b in batches:
        *got, _ = pipelined(*got, b)
        *want, _ = jax.jit(step)(*want, b)
    for k in params:
        assert got[0][k].devices() == {jax.devices()[int(k[1])]}, k  # on its own stage's device
    for a, c in zip(jax.tree.leaves(autopp.gather(got)), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(c), rtol=1e-6, atol=1e-6)


def test_positions_made_from_the_batch_size_that_gather_its_rows_are_refused():
    """Mixup inside the loss with a permutation the step made from the batch's size: split by rows like the batch,
    each microbatch's positions counted the whole batch's examples and read clamped rows (a trial: loss 2.445 for
    jit's 2.421, silently). Refused with the line and the fix; mixing in the step before the loss runs as jit."""
    def loss(p, x, y, perm):
        mixed = 0.6 * x + 0.4 * x[perm]
        return jnp.mean((jnp.tanh(mixed @ p) - y) ** 2)

    def in_loss(p, batch):
        perm = jax.random.permutation(jax.random.key(3), batch["x"].shape[0])
        return autopp.grad(loss)(p, batch["x"], batch["y"], perm)

    def in_step(p, batch):
        perm = jax.random.permutation(jax.random.key(3), batch["x"].shape[0])
        mixed = 0.6 * batch["x"] + 0.4 * batch["x"][perm]
        return autopp.grad(lambda p, x, y: jnp.mean((jnp.tanh(x @ p) - y) ** 2))(p, mixed, batch["y"])

    p = jax.random.normal(jax.random.key(0), (8, 8)) / 3
    batch = {"x": jax.random.normal(jax.random.key(1), (16, 8)), "y": jax.random.normal(jax.random.key(2), (16, 8))}
    with pytest.raises(ValueError, match=r"gathers the batch's examples by positions the step makes .*int32\[4\], "
                                         r"made at .*test_step_semantics.py.*Mix the examples in the step"):
        autopp.parallelize(in_loss, num_stages=2, num_microbatches=4, devices=jax.devices()[:2])(p, batch)
    got = autopp.parallelize(in_step, num_stages=2, num_microbatches=4, devices=jax.devices()[:2])(p, batch)
    np.testing.assert_allclose(got, jax.jit(in_step)(p, batch), rtol=1e-6, atol=1e-6)


def test_a_per_example_random_crop_in_the_step_is_followed_to_its_rows():
    """A random crop per example (vmap of dynamic_slice with per-example keys), the most common augmentation, warned
    that a microbatch read rows that were not its examples' (a trial): the batch axis was lost through the batched
    gather. It is followed, no warning, and the step is jit's."""
    def crop(key, image):
        i, j = jax.random.randint(key, (2,), 0, 5)
        return jax.lax.dynamic_slice(image, (i, j), (8, 8))

    def step(p, images, labels, key):
        x = jax.vmap(crop)(jax.random.split(key, images.shape[0]), images).reshape(images.shape[0], -1)

        def loss(p, x, y):
            return jnp.mean((jnp.tanh(x @ p["w1"]) @ p["w2"] - y) ** 2)

        return jax.tree.map(lambda a, g: a - 0.1 * g, p, autopp.grad(loss)(p, x, labels))

    keys = jax.random.split(jax.random.key(0), 4)
    p = {"w1": jax.random.normal(keys[0], (64, 16)) / 8, "w2": jax.random.normal(keys[1], (16, 4)) / 4}
    images, labels = jax.random.normal(keys[2], (16, 12, 12)), jax.random.normal(keys[3], (16, 4))
    pipelined = autopp.parallelize(step, num_stages=2, num_microbatches=4, devices=jax.devices()[:2],
                                   batch_argnums=(1, 2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = pipelined(p, images, labels, jax.random.key(7))
    want = jax.jit(step)(p, images, labels, jax.random.key(7))
    for a, b in zip(jax.tree.leaves(autopp.gather(got)), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)


def _io_logger(logged: list):
    """``log(h)``: an ``io_callback`` that appends ``h``'s mean to ``logged`` on the host and returns zero."""
    from jax.experimental import io_callback

    def on_host(v):
        logged.append(float(v))
        return np.float32(0)

    return lambda h: io_callback(on_host, jax.ShapeDtypeStruct((), jnp.float32), jax.lax.stop_gradient(h.mean()))


def test_the_planner_times_layers_without_running_the_user_s_prints():
    """Left to plan, parallelize times each distinct layer on random inputs: the loss's jax.debug.callback ran there
    too (a trial: 14 calls for 4, of made-up values, before the first step), and an io_callback (a trial: 20 calls of
    a logger). The timed layers leave them out (an io_callback's results are zeros there)."""
    seen, logged = [], []
    log = _io_logger(logged)

    def loss(p, b):
        h = b["x"]
        for w in p:
            h = jnp.tanh(h @ w)
            jax.debug.callback(lambda v: seen.append(float(v)), h.mean())
            h = h + log(h)
        return jnp.mean((h - b["y"]) ** 2)

    def step(p, b):
        return jax.tree.map(lambda a, g: a - 0.1 * g, p, autopp.grad(loss)(p, b))

    keys = jax.random.split(jax.random.key(0), 5)
    p = [jax.random.normal(k, (24, 24)) / 5 for k in keys[:3]]  # a width no other test times (the profile cache)
    b = {"x": jax.random.normal(keys[3], (16, 24)), "y": jax.random.normal(keys[4], (16, 24))}
    pipelined = autopp.parallelize(step, devices=jax.devices()[:4])
    plan = pipelined.plan_for(p, b)
    jax.effects_barrier()
    assert seen == [] and logged == []
    jax.block_until_ready(pipelined(p, b))
    jax.effects_barrier()
    assert len(seen) == len(logged) == 3 * plan.num_microbatches


@pytest.mark.parametrize("recompute", ["full", "selective"])
def test_recomputation_of_a_stage_that_calls_an_io_callback_keeps_it(recompute):
    """recompute="full" or "selective" with an io_callback in the loss failed inside autopp's own jax.checkpoint
    (NotImplementedError: effects not supported in partial-eval; a trial). JAX cannot recompute it (its effect
    would run twice): that part runs once and keeps its activations, with a warning under "selective" (the whole
    stage is kept), and the step is jit's, the callback called once per layer and microbatch."""
    logged = []
    log = _io_logger(logged)

    def loss(p, b):
        h = b["x"]
        for w in p:
            h = jnp.tanh(h @ w)
            log(h)
        return jnp.mean((h - b["y"]) ** 2)

    def make(grad):
        return lambda p, b: jax.tree.map(lambda a, g: a - 0.1 * g, p, grad(loss)(p, b))

    keys = jax.random.split(jax.random.key(0), 6)
    p = [jax.random.normal(k, (16, 16)) / 4 for k in keys[:4]]
    b = {"x": jax.random.normal(keys[4], (8, 16)), "y": jax.random.normal(keys[5], (8, 16))}
    want = jax.jit(make(jax.grad))(p, b)
    jax.effects_barrier()
    logged.clear()
    pipelined = autopp.parallelize(make(autopp.grad), num_stages=2, num_microbatches=2, recompute=recompute,
                                   devices=jax.devices()[:2])
    if recompute == "selective":
        with pytest.warns(UserWarning, match=r"recompute='selective' leaves a stage's activations kept.*io_callback"):
            got = pipelined(p, b)
    else:
        got = pipelined(p, b)
    jax.effects_barrier()
    assert len(logged) == 4 * 2
    for x, y in zip(jax.tree.leaves(autopp.gather(got)), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6, atol=1e-6)


def test_a_cond_whose_branch_multiplies_matrices_stays_a_cond():
    """Both branches of a cond after the gradient are computed only when that is cheap: one that evaluates the model
    every k steps (a matmul) would run it every step; it stays one cond, and the step is jit's."""
    from autopp.core import trace_step
    from autopp.runtime._placement import conds_as_selects

    def step(p, count, x):
        g = autopp.grad(lambda p, x: jnp.mean(jnp.tanh(x @ p) ** 2))(p, x)
        new = p - 0.1 * g
        probe = jax.lax.cond(count % 10 == 0, lambda: jnp.mean(x @ new), lambda: 0.0)
        return new, probe

    args = (jnp.eye(4), jnp.int32(0), jnp.ones((8, 4)))
    traced = trace_step(step, args, (2,))
    assert conds_as_selects(traced) is traced
    got = autopp.parallelize(step, num_stages=2, num_microbatches=2, devices=jax.devices()[:2],
                             batch_argnums=2)(*args)
    for a, b in zip(jax.tree.leaves(autopp.gather(got)), jax.tree.leaves(jax.jit(step)(*args))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)


def _annealed_in_the_loss(params, batch):  # a fori_loop's counter read as an array (a step size annealed by it)
    def refine(i, h):
        return h + jnp.tanh(h @ params["w"]) * 0.5 ** (i + 1).astype(jnp.float32)
    h = jax.lax.fori_loop(0, 3, refine, params["embed"][batch["x"]])
    logp = jax.nn.log_softmax(h @ params["head"])
    return -jnp.take_along_axis(logp, batch["y"][..., None], axis=-1).mean()


def _counter_in_a_scan_carry(params, batch):  # an int counter in a scan's carry, cast to scale each step
    def body(c, _):
        h, i = c
        return (h + jnp.tanh(h @ params["w"]) / (1 + i).astype(h.dtype), i + 1), None
    h = jax.lax.scan(body, (params["embed"][batch["x"]], 0), None, length=3)[0][0]
    logp = jax.nn.log_softmax(h @ params["head"])
    return -jnp.take_along_axis(logp, batch["y"][..., None], axis=-1).mean()


@pytest.mark.parametrize("loss", [_annealed_in_the_loss, _counter_in_a_scan_carry], ids=lambda f: f.__name__.strip("_"))
def test_a_loop_counter_read_as_an_array_runs_as_jit(loss):
    """``jax.jit`` hands a ``fori_loop``'s body its counter as an int32 array, and a scan's int carry too; autopp's
    trace handed a Python int, so ``i.astype(jnp.float32)`` (an annealed Langevin step size, a residual flow's term
    index) failed with ``AttributeError: 'int' object has no attribute 'astype'`` (trial FLOWEBM), in the loss and
    in the step alike. The counter stays concrete (static indices) and answers as the array."""
    def step(params, opt_state, batch):  # (the same loop in the step, outside the gradient, too)
        shift = jax.lax.fori_loop(0, 2, lambda i, s: s + i.astype(jnp.float32) * 1e-3, jnp.float32(0.0))
        out, grads = autopp.value_and_grad(loss)(params, batch)
        updates, opt_state = TX.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, out + shift

    (p_jit, l_jit), (p_pp, l_pp) = _run(step, num_stages=2, num_microbatches=4)
    _assert_equal(l_jit, l_pp)
    _assert_equal(p_jit, p_pp)


def test_a_sampler_in_the_step_before_the_loss_stays_one_loop():
    """Short-run Langevin sampling of negatives in the step, before the gradient (an energy-based model's contrastive
    divergence), was unrolled step by step: 60 steps made the first call 14.5 s for jit's 1.9 s (trial FLOWEBM). The
    step's work before its loss is not split into stages, so its loops stay loops, as jit keeps them; the values
    are jit's."""
    from autopp.core import trace_step

    def energy(params, x):
        return jnp.tanh(x @ params["w"]).sum(-1)

    def loss(params, positives, negatives):
        return energy(params, positives).mean() - energy(params, negatives).mean()

    def step(params, opt_state, batch):
        x = params["embed"][batch["x"]].mean(1)
        grad_x = jax.grad(lambda v: energy(params, v).sum())
        negatives = jax.lax.stop_gradient(jax.lax.fori_loop(0, 60, lambda i, v: v - 0.01 * grad_x(v), x * 0.5))
        value, grads = autopp.value_and_grad(loss)(params, x, negatives)
        updates, opt_state = TX.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    params = _params(jax.random.key(0))
    traced = trace_step(step, (params, TX.init(params), _batch(jax.random.key(1))), (2,))
    loops = [e for e in traced.jaxpr.jaxpr.eqns if e.primitive.name in ("scan", "while")]
    assert len(loops) == 1 and len(traced.jaxpr.jaxpr.eqns) < 100, len(traced.jaxpr.jaxpr.eqns)
    (p_jit, l_jit), (p_pp, l_pp) = _run(step, num_stages=2, num_microbatches=4)
    _assert_equal(l_jit, l_pp)
    _assert_equal(p_jit, p_pp)


def test_negatives_drawn_per_chunk_of_examples_in_the_step_are_split_with_the_batch():
    """PyTorch-BigGraph's chunked negatives: the step draws ``[B // C, K]`` negatives, one row per chunk of ``C``
    consecutive examples, and the loss scores each chunk against its row. The array was read whole by every
    microbatch, and the step failed at microbatch size (trial KGE: "Size of label 'n' for operand 1 (2) does not
    match previous terms (4)"), with advice about grouped examples that did not apply. A value whose leading
    dimension divides the batch's and grows with it is split with the batch, as one of the batch's own length is."""
    C, K = 4, 3

    def loss(params, batch, negatives):
        q = jnp.tanh(params["embed"][batch["x"][:, 0]] @ params["w"]).reshape(-1, C, H)
        positive = jnp.sum(q * params["embed"][batch["y"][:, 0]].reshape(-1, C, H), -1)
        negative = jnp.einsum("ncd,nkd->nck", q, params["embed"][negatives])
        return -jnp.mean(jax.nn.log_softmax(jnp.concatenate([positive[..., None], negative], -1))[..., 0])

    def step(params, opt_state, batch):
        negatives = jax.random.randint(jax.random.key(7), (batch["x"].shape[0] // C, K), 0, V)
        value, grads = autopp.value_and_grad(loss)(params, batch, negatives)
        updates, opt_state = TX.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    for m in (2, 4):
        (p_jit, l_jit), (p_pp, l_pp) = _run(step, num_stages=2, num_microbatches=m)
        _assert_equal(l_jit, l_pp)
        _assert_equal(p_jit, p_pp)

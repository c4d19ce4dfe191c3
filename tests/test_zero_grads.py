"""Weights frozen inside the step (``jax.lax.stop_gradient``, ``optax.set_to_zero``) are not differentiated: no
backward work and no gradient accumulators for them, as for weights left out of ``argnums``; the step still equals
plain ``jax.jit``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import autopp
from autopp.core._trace import trace_step
from autopp.core._zero_grads import zero_gradient_inputs

from _helpers import assert_trees_close, run_steps

LAYERS, DIM, RANK = 4, 32, 4


def _params(key=0):
    ks = jax.random.split(jax.random.key(key), 3 * LAYERS)
    return [{"w": 0.3 * jax.random.normal(ks[3 * i], (DIM, DIM)),
             "a": 0.1 * jax.random.normal(ks[3 * i + 1], (DIM, RANK)),
             "b": 0.1 * jax.random.normal(ks[3 * i + 2], (RANK, DIM))} for i in range(LAYERS)]


def _batch(n=16):
    return {"x": jax.random.normal(jax.random.key(7), (n, DIM)), "y": jax.random.normal(jax.random.key(8), (n, DIM))}


def _lora_loss(params, batch, freeze=jax.lax.stop_gradient):
    x = batch["x"]
    for p in params:
        x = jnp.tanh(x @ (freeze(p["w"]) + p["a"] @ p["b"]))
    return jnp.mean((x - batch["y"]) ** 2)


def _step(loss, tx):
    def step(params, opt_state, batch):
        value, grads = autopp.value_and_grad(loss)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value
    return step


def _argnums_step(tx):
    """The same LoRA step with the base left out of ``argnums``: what a frozen base must cost."""
    def loss(base, adapters, batch):
        return _lora_loss([{"w": w, **a} for w, a in zip(base, adapters)], batch, freeze=lambda w: w)

    def step(params, opt_state, batch):
        base, adapters = [p["w"] for p in params], [{"a": p["a"], "b": p["b"]} for p in params]
        value, grads = autopp.value_and_grad(loss, argnums=1)(base, adapters, batch)
        grads = [{"w": jnp.zeros_like(p["w"]), **g} for p, g in zip(params, grads)]
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value
    return step


def _pipelined(step):
    return autopp.parallelize(step, num_stages=4, num_microbatches=4, devices=jax.devices()[:4])


def _held(step, state, batch):
    return sum(step.memory_report(*state, batch, between_steps=True).values())


def _frozen_positions(step, state, batch):
    """Paths of the step's arguments that the loss reads as frozen weights."""
    traced = trace_step(step, (*state, batch), (2,))
    names = dict(zip(traced.jaxpr.jaxpr.invars, traced.leaf_paths))
    return sorted(names[traced.grad_eqn.invars[k]] for k, f in enumerate(traced.frozen_grad_inputs) if f)


@pytest.mark.parametrize("tx", [optax.sgd(0.1), optax.adamw(1e-2, weight_decay=0.1)], ids=["sgd", "adamw"])
def test_stop_gradient_weights_hold_no_accumulators(tx):
    params, batch = _params(), _batch()
    state = (params, tx.init(params))
    step = _step(_lora_loss, tx)
    pipelined = _pipelined(step)
    got, losses = run_steps(pipelined, state, batch)
    want, want_losses = run_steps(jax.jit(step), state, batch)
    assert_trees_close(autopp.gather(got), want, atol=1e-6)  # adamw's decay still moves the frozen base, as in jit
    np.testing.assert_allclose(losses, want_losses, rtol=1e-6)
    reference = _pipelined(_argnums_step(tx))
    run_steps(reference, state, batch, n=1)
    assert _held(pipelined, got, batch) == _held(reference, state, batch) > 0
    assert _frozen_positions(step, state, batch) == sorted(f"args[0][{i}]['w']" for i in range(LAYERS))
    # the frozen weight and what its update keeps stay on its stage's device (they were computed on every stage:
    # the update of a weight without a gradient read the step count, which every stage holds)
    for i, layer in enumerate(got[0]):
        assert {n: layer[n].devices() for n in layer} == {n: {jax.devices()[i]} for n in layer}, i
        for leaf in jax.tree.leaves(got[1]):
            if leaf.shape == (DIM, DIM):
                assert len(leaf.devices()) == 1


def test_weights_whose_gradient_the_optimizer_drops_are_not_differentiated():
    labels = [{"w": "frozen", "a": "trained", "b": "trained"} for _ in range(LAYERS)]
    tx = optax.multi_transform({"trained": optax.sgd(0.1), "frozen": optax.set_to_zero()}, labels)
    params, batch = _params(), _batch()
    state = (params, tx.init(params))
    step = _step(lambda p, b: _lora_loss(p, b, freeze=lambda w: w), tx)
    pipelined = _pipelined(step)
    got, _ = run_steps(pipelined, state, batch)
    want, _ = run_steps(jax.jit(step), state, batch)
    assert_trees_close(autopp.gather(got), want, atol=1e-6)
    for g, p in zip(autopp.gather(got)[0], params):
        np.testing.assert_array_equal(g["w"], p["w"])
    sgd = optax.sgd(0.1)
    reference, ref_state = _pipelined(_argnums_step(sgd)), (params, sgd.init(params))
    run_steps(reference, ref_state, batch, n=1)
    assert _held(pipelined, got, batch) == _held(reference, ref_state, batch) > 0


def test_gradients_read_before_they_are_dropped_or_passing_around_stop_gradient_stay():
    """A global-norm clip reads every gradient before ``set_to_zero`` drops some, and a straight-through estimator
    (``w + stop_gradient(round(w) - w)``) has an identity path around ``stop_gradient``: both keep their weights
    differentiated, and the step equals jit."""
    labels = [{"w": "frozen", "a": "trained", "b": "trained"} for _ in range(LAYERS)]
    clipped = optax.chain(optax.clip_by_global_norm(0.05),
                          optax.multi_transform({"trained": optax.sgd(0.1), "frozen": optax.set_to_zero()}, labels))

    def ste(w):
        return w + jax.lax.stop_gradient(jnp.round(w * 8) / 8 - w)

    params, batch = _params(), _batch()
    for tx, freeze in ((clipped, lambda w: w), (optax.sgd(0.1), ste)):
        state = (params, tx.init(params))
        step = _step(lambda p, b, freeze=freeze: _lora_loss(p, b, freeze=freeze), tx)
        assert _frozen_positions(step, state, batch) == []
        got, _ = run_steps(_pipelined(step), state, batch)
        assert_trees_close(autopp.gather(got), run_steps(jax.jit(step), state, batch)[0], atol=1e-6)


def test_stop_gradient_is_followed_into_calls_and_assumed_absent_elsewhere():
    """A ``stop_gradient`` inside a jitted helper, a ``jax.checkpoint`` or every branch of a ``lax.cond`` is seen; one
    inside a ``custom_jvp`` or ``custom_vjp`` is not looked for, so the weight stays differentiated (a zero
    gradient computed, never a wrong one); a branch without it keeps the weight differentiated."""
    def loss_with(wrap):
        def loss(p, batch):
            frozen = wrap(lambda w: jax.lax.stop_gradient(w) * 2.0)(p["w"])
            return jnp.mean((batch["x"] @ (frozen + p["a"] @ p["b"])) ** 2)
        return loss

    p, batch = _params()[0], _batch()
    cond = lambda f: lambda w: jax.lax.cond(w.sum() > 0, f, f, w)  # noqa: E731
    one_branch = lambda f: lambda w: jax.lax.cond(w.sum() > 0, f, lambda v: v * 2.0, w)  # noqa: E731

    def by_vjp(f):
        g = jax.custom_vjp(f)
        g.defvjp(lambda w: (f(w), None), lambda _, ct: (jnp.zeros_like(ct),))
        return g

    def custom(f):
        g = jax.custom_jvp(f)
        g.defjvp(lambda primals, tangents: (f(*primals), jnp.zeros_like(tangents[0])))
        return g

    for wrap, want in ((jax.jit, ("w",)), (jax.checkpoint, ("w",)), (cond, ("w",)), (one_branch, ()),
                       (custom, ()), (by_vjp, ())):
        def step(p, batch, loss=loss_with(wrap)):
            return autopp.grad(loss)(p, batch)
        traced = trace_step(step, (p, batch), (1,))
        names = ["a", "b", "w", "x", "y"]  # the loss's flat inputs: dict keys sorted
        assert tuple(names[k] for k, f in enumerate(traced.frozen_grad_inputs) if f) == want, wrap
        assert zero_gradient_inputs(traced.jaxpr, traced.grad_index) == ()  # already frozen: nothing more
        grads = jax.jit(step)(p, batch)
        if want or wrap is not one_branch:
            np.testing.assert_allclose(grads["w"], 0.0)


def test_the_profile_holds_a_stop_gradient_weight_with_its_optimizer_state_and_no_gradient():
    """Hand count: each frozen 32x32 fp32 base is 4096 bytes held, no gradient, and AdamW's two moments of it
    (8192 bytes), which the update still keeps; each adapter 512 bytes with its gradient and moments."""
    from autopp.profiler import profile

    tx = optax.adamw(1e-2, weight_decay=0.1)
    params, batch = _params(), _batch()
    prof = profile(_step(_lora_loss, tx), params, tx.init(params), batch)
    held = sorted(prof.state_bytes.values())
    assert held == sorted([(4096, 0, 8192)] * LAYERS + [(512, 512, 1024)] * 2 * LAYERS), held


def test_a_stage_that_reads_a_weight_only_behind_stop_gradient_keeps_no_gradient_for_it():
    """``h = block(w, h) + block(stop_gradient(w), h)``: the weight is trained, but where the stage split puts the
    second read on another stage, that stage's reads carry no cotangent. It held a gradient accumulator for the
    weight there (a user trial: 25,096 bytes between steps on 4 stages against 16,904 for the model without the
    second read); now it holds what the model without it holds, and the step equals jit."""
    sg = jax.lax.stop_gradient

    def block(p, x):
        return jnp.tanh(x @ p["w"] + p["b"])

    def loss_with(both):
        def loss(params, batch):
            h = batch["x"]
            for i, p in enumerate(params):
                h = block(p, h) + (block(jax.tree.map(sg, p), h) if both and i < 2 else 0)
            return jnp.mean((h - batch["y"]) ** 2)
        return loss

    ks = jax.random.split(jax.random.key(3), LAYERS)
    params = [{"w": 0.3 * jax.random.normal(k, (DIM, DIM)), "b": jnp.zeros((DIM,))} for k in ks]
    batch, tx = _batch(32), optax.sgd(0.1)
    state = (params, tx.init(params))
    held = {}
    for both in (False, True):
        step = _step(loss_with(both), tx)
        pipelined = _pipelined(step)
        got, _ = run_steps(pipelined, state, batch)
        assert_trees_close(autopp.gather(got), run_steps(jax.jit(step), state, batch)[0], atol=1e-6)
        held[both] = _held(pipelined, got, batch)
    assert held[True] == held[False], held


def test_a_frozen_weight_and_what_the_stage_computes_from_it_alone_are_not_kept_per_microbatch():
    """``stop_gradient(w) + a @ b`` depends on weights alone: each stage kept it once per microbatch in flight (a user
    trial: an NNX LoRA model's stage at 1.8x the peak of the same model with the base's gradients dropped instead).
    The backward makes it again: over 8 GPipe microbatches a stage's peak is no higher than over 2."""
    tx = optax.sgd(0.1)
    params, batch = _params(), _batch(32)
    state = (params, tx.init(params))
    peaks = {}
    for m in (2, 8):
        pipelined = autopp.parallelize(_step(_lora_loss, tx), num_stages=4, num_microbatches=m, schedule="gpipe",
                                       devices=jax.devices()[:4])
        peaks[m] = pipelined.memory_report(*state, batch)
    assert all(peaks[8][d] <= peaks[2][d] for d in peaks[2]), peaks


def _recycled(frozen_where):
    """AlphaFold's recycling: passes of the model behind ``stop_gradient`` feed the last, trained pass."""
    def model(p, x, prev):
        return jnp.tanh(x @ p["inp"] + jnp.tanh(prev) @ p["rec"]) @ p["out"]

    def loss(p, b):
        prev = jnp.zeros((b["x"].shape[0], 16))
        for _ in range(3):
            prev = (jax.lax.stop_gradient(model(p, b["x"], prev)) if frozen_where == "outputs"
                    else model(jax.lax.stop_gradient(p), b["x"], prev))
        return jnp.mean((model(p, b["x"], prev) - b["y"]) ** 2)

    def step(p, opt_state, b):
        value, g = autopp.value_and_grad(loss)(p, b)
        return jax.tree.map(lambda a, d: a - 0.1 * d, p, g), opt_state, value
    return step


def test_passes_behind_stop_gradient_on_their_outputs_run_no_backward():
    """``prev = stop_gradient(model(p, b, prev))`` (what AlphaFold and OpenFold write) was taken for work with a
    backward: the passes before the ``stop_gradient`` depend on the parameters, though the loss reads them only
    through it. They were priced at three times their forward in the stage split, and the stage holding them ran a
    backward of zeros and held what it needs (trial PROTEIN: 410 KB against 258 KB). The stages are now those of the
    same model written ``model(stop_gradient(p), ...)``, and the values jit's."""
    k = jax.random.split(jax.random.key(0), 5)
    p = {"inp": jax.random.normal(k[0], (8, 16)) * 0.3, "rec": jax.random.normal(k[1], (16, 16)) * 0.3,
         "out": jax.random.normal(k[2], (16, 16)) * 0.3}
    b = {"x": jax.random.normal(k[3], (16, 8)), "y": jax.random.normal(k[4], (16, 16))}
    flops = {}
    for where in ("outputs", "parameters"):
        step = autopp.parallelize(_recycled(where), num_stages=2, num_microbatches=4, devices=jax.devices()[:2])
        flops[where] = [s.flops for s in step.plan_for(p, (), b).stages]
        got = step(p, (), b)
        want = jax.jit(_recycled(where))(p, (), b)
        assert_trees_close((autopp.gather(got[0]), got[2]), (want[0], want[2]), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(flops["outputs"], flops["parameters"], rtol=1e-3)  # (the stop_gradient itself)


@pytest.mark.filterwarnings("ignore:autopp cost model")
def test_a_recycling_loop_with_a_sampled_count_is_priced_without_a_backward():
    """Recycling with a count drawn in the step (a ``while_loop`` whose body stops the gradient of what it carries)
    was priced with a backward, so three stages were refused: "one lax.while_loop call holds 51% of the loss's
    work" (trial PROTEIN), though the loop runs forward only. Its results do not depend on the parameters; it
    runs on 3 stages, as jit."""
    def model(p, x, prev):
        return jnp.tanh(x @ p["inp"] + jnp.tanh(prev) @ p["rec"]) @ p["out"]

    def loss(p, b, n):
        def recycle(i, prev):
            return jax.lax.stop_gradient(model(p, b["x"], model(p, b["x"], prev)))
        prev = jax.lax.fori_loop(0, n, recycle, jnp.zeros((b["x"].shape[0], 16)))
        return jnp.mean((model(p, b["x"], prev) - b["y"]) ** 2)

    def step(p, key, b):
        key, sub = jax.random.split(key)
        value, g = autopp.value_and_grad(loss)(p, b, jax.random.randint(sub, (), 1, 4))
        return jax.tree.map(lambda a, d: a - 0.1 * d, p, g), key, value

    k = jax.random.split(jax.random.key(0), 5)
    p = {"inp": jax.random.normal(k[0], (8, 16)) * 0.3, "rec": jax.random.normal(k[1], (16, 16)) * 0.3,
         "out": jax.random.normal(k[2], (16, 16)) * 0.3}
    b = {"x": jax.random.normal(k[3], (16, 8)), "y": jax.random.normal(k[4], (16, 16))}
    got = autopp.parallelize(step, num_stages=3, num_microbatches=4, devices=jax.devices()[:3])(p, jax.random.key(1), b)
    want = jax.jit(step)(p, jax.random.key(1), b)
    assert_trees_close((autopp.gather(got[0]), got[2]), (want[0], want[2]), rtol=1e-6, atol=1e-6)

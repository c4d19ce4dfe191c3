"""How microbatch losses combine is read off the loss's program: a mean over its examples is averaged, a sum added up,
so the step returns and learns what ``jax.jit`` of the same step does without ``loss_reduction=`` (a user trial:
weights or a token count normalised over the whole batch in the step, a temperature or key taken from the batch).
The truth is plain jit (SGD in fp32, to 1e-6), and for the program analysis the loss evaluated on the whole batch
against its microbatches' values."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import autopp
from autopp.core import output_reductions

B, T, V, H, M = 16, 8, 32, 16, 4
TX = optax.sgd(0.05)


def _params(key):
    k = jax.random.split(key, 3)
    return {"embed": jax.random.normal(k[0], (V, H)) * 0.3, "w": jax.random.normal(k[1], (H, H)) * 0.3,
            "head": jax.random.normal(k[2], (H, V)) * 0.3}


def _batch(i):
    x = jax.random.randint(jax.random.key(10 + i), (B, T), 0, V)
    keep = jnp.linspace(0.1, 1.0, B)[:, None]  # examples keep different numbers of tokens
    mask = (jax.random.uniform(jax.random.key(50 + i), (B, T)) < keep).astype(jnp.float32)
    return {"x": x, "y": jnp.roll(x, -1, axis=1), "mask": mask, "temp": jnp.full((B,), 1.5)}


def _nll(params, batch):
    h = jnp.tanh(params["embed"][batch["x"]] @ params["w"])
    logp = jax.nn.log_softmax(h @ params["head"])
    return -jnp.take_along_axis(logp, batch["y"][..., None], axis=-1)[..., 0]


# -- the program analysis against the loss evaluated on the whole batch and on its microbatches ------------------

def _losses():
    """name -> (loss(x, w), whole-batch inputs w, what the program shows)."""
    count = jnp.float32(B * T * 0.6)
    return {
        "jnp.mean": (lambda x, w: (x ** 2).mean(), (), "mean"),
        "a sum": (lambda x, w: jnp.tanh(x).sum(), (), "sum"),
        "divided by x.shape[0]": (lambda x, w: (x ** 2).sum() / x.shape[0], (), "mean"),
        "divided by a fixed number": (lambda x, w: (x ** 2).sum() / 100.0, (), "sum"),
        "divided by the whole batch's count": (lambda x, w: (x ** 2).sum() / w[0], (count,), "sum"),
        "a mean plus a penalty": (lambda x, w: (x ** 2).mean() + (w[0] ** 2).sum(), (jnp.ones(3),), "mean"),
        "a sum plus a penalty": (lambda x, w: (x ** 2).sum() + (w[0] ** 2).sum(), (jnp.ones(3),), "sum"),
        "a scan's mean": (lambda x, w: jax.lax.scan(lambda c, _: (jnp.tanh(c), None), x, None, length=3)[0].mean(),
                          (), "mean"),
        "a masked mean inside": (lambda x, w: (x.sum(-1) * (x[:, 0] > 0)).sum() / (x[:, 0] > 0).sum(), (), "ratio"),
        "a logarithm of a sum": (lambda x, w: jnp.log(jnp.exp(x).sum()), (), None),
        "a maximum over examples": (lambda x, w: x.max(), (), None),
    }


@pytest.mark.parametrize("name", list(_losses()))
def test_the_program_shows_how_a_loss_combines_its_examples(name):
    fn, extra, want = _losses()[name]
    x = jax.random.normal(jax.random.key(0), (B, T))
    whole = jax.make_jaxpr(fn)(x, extra)
    micro = jax.make_jaxpr(fn)(x[: B // M], extra)
    microbatched = [True] + [False] * len(jax.tree.leaves(extra))
    got = output_reductions(whole, micro, microbatched, M)[0]
    assert got == want
    jitted = jax.jit(fn)
    parts = [float(jitted(x[i * B // M:(i + 1) * B // M], extra)) for i in range(M)]
    truth = float(jitted(x, extra))
    if got == "mean":
        np.testing.assert_allclose(np.mean(parts), truth, rtol=1e-5)
    elif got == "sum":  # (a term without the batch, a penalty, counts once: the runtime scales it by 1 / M)
        penalty = float(jitted(jnp.zeros_like(x[: B // M]), extra))
        np.testing.assert_allclose(np.sum(parts) - (M - 1) * penalty, truth, rtol=1e-5)
    else:  # neither combination is the whole batch's value
        assert not np.isclose(np.mean(parts), truth, rtol=1e-4) and not np.isclose(np.sum(parts), truth, rtol=1e-4)


# -- steps: the default combines as jit does ----------------------------------------------------------------------

def _step(loss, extra=lambda batch: (), has_aux=False):
    def step(params, opt_state, batch):
        out, grads = autopp.value_and_grad(loss, has_aux=has_aux)(params, batch, *extra(batch))
        updates, opt_state = TX.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, out
    return step


def _run(step, **kw):
    params = _params(jax.random.key(0))
    results = []
    for fn in (jax.jit(step), autopp.parallelize(step, num_stages=2, num_microbatches=M, devices=jax.devices()[:2],
                                                 **kw)):
        state = (params, TX.init(params))
        for i in range(3):
            *state, out = fn(*state, _batch(i))
        results.append((autopp.gather(state[0]), out))
    return results


def _assert_equal(a, b, tol=1e-6):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(x, np.float64), np.asarray(y, np.float64), rtol=tol, atol=tol)


STEPS = {  # name -> (step, what the program shows)
    # token weights normalised over the whole batch in the step: sum(nll * w) is a sum
    "weights normalised in the step": (_step(lambda p, b, w: (_nll(p, b) * w).sum(),
                                             lambda b: (b["mask"] / b["mask"].sum(),)), "sum"),
    # a token count read off the batch's shape in the step and passed to the loss: the whole batch's
    "a size read in the step": (_step(lambda p, b, n: _nll(p, b).sum() / n, lambda b: (b["x"].size,)), "sum"),
    # ... and closed over by a loss that closes over the batch too: the step is traced again per microbatch, where
    # the size is the microbatch's, so the loss is a mean
    "a size read in the step, closed over": (
        lambda p, o, b: _step(lambda p, _: _nll(p, b).sum() / b["x"].size)(p, o, b), "mean"),
    # a temperature taken from the batch in the step: the loss still averages its examples
    "a temperature from the batch": (_step(lambda p, b, t: (_nll(p, b) / t).mean(), lambda b: (b["temp"][0],)),
                                     "mean"),
}


@pytest.mark.parametrize("name", list(STEPS))
def test_microbatch_losses_combine_as_the_loss_does_by_default(name):
    """Before, each of these ran under the default "mean": the first two returned a quarter of jit's loss (params
    off by 1.6e-3 after 3 steps, silently) and the third was refused with advice ("sum") that gave 4x jit's."""
    step, kind = STEPS[name]
    (p_jit, l_jit), (p_pp, l_pp) = _run(step)
    _assert_equal(l_jit, l_pp)
    _assert_equal(p_jit, p_pp)
    wrong = "sum" if kind == "mean" else "mean"
    with pytest.raises(ValueError, match=f"loss_reduction='{wrong}', but the loss is a {kind} over its examples.*"
                                         f"pass loss_reduction='{kind}'"):
        _run(step, loss_reduction=wrong)


def test_each_aux_value_combines_as_its_program_shows():
    """Under a summed loss, an accuracy (a mean) is averaged and a token count (a sum, an integer) added up, as jit
    returns them; a per-example value is concatenated."""
    def loss(p, b, w):
        nll = _nll(p, b)
        return (nll * w).sum(), {"acc": (nll < 3.0).mean(), "tokens": (b["mask"] > 0).sum(), "per": nll.sum(1)}

    step = _step(loss, lambda b: (b["mask"] / b["mask"].sum(),), has_aux=True)
    (p_jit, out_jit), (p_pp, out_pp) = _run(step)
    assert out_pp[1]["tokens"].dtype == out_jit[1]["tokens"].dtype
    _assert_equal(out_jit, out_pp)
    _assert_equal(p_jit, p_pp)


def test_a_masked_mean_inside_the_loss_is_averaged_with_a_warning():
    """A ratio of two sums over a microbatch's examples is neither a mean nor a sum: the default averages the
    microbatches' ratios (gradient accumulation's meaning) and says how to get jit's whole-batch value."""
    step = _step(lambda p, b: (_nll(p, b) * b["mask"]).sum() / b["mask"].sum())
    with pytest.warns(UserWarning, match=r"(?s)divides a sum over its examples by another sum.*mask.sum\(\)"):
        (p_jit, l_jit), (p_pp, l_pp) = _run(step)
    assert not np.isclose(float(l_jit), float(l_pp), rtol=1e-4)  # the microbatches keep different token counts
    _run(step, loss_reduction="mean")  # chosen: no warning (the suite turns autopp's warnings into errors)

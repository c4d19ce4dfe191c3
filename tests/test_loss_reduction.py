"""How microbatch losses combine is read off the loss's program: a mean over its examples is averaged, a sum added up,
so the step returns and learns what ``jax.jit`` of the same step does without ``loss_reduction=`` (a user trial:
weights or a token count normalised over the whole batch in the step, a temperature or key taken from the batch).
The truth is plain jit (SGD in fp32, to 1e-6), and for the program analysis the loss evaluated on the whole batch
against its microbatches' values."""

from __future__ import annotations

import re
import warnings

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
        "a maximum over examples": (lambda x, w: x.max(), (), "max"),
        "a minimum of magnitudes, shifted": (lambda x, w: (jnp.abs(x).min(axis=1) + w[0]).min(), (jnp.float32(2),),
                                             "min"),
        "a maximum over examples, negated": (lambda x, w: -x.max(), (), None),
        "a maximum over examples, squared": (lambda x, w: x.max() ** 2, (), None),
        "a maximum less a minimum": (lambda x, w: x.max() - x.min(), (), None),
        "a maximum less another": (lambda x, w: x.max() - (2 * x).max(), (), None),
        "a batch statistic broadcast back": (lambda x, w: ((x - x.mean(0)) ** 2).mean(), (), None),
        # a segment sum per example (vmap: a graph per example) adds no examples together (it read as a batch sum)
        "a per-example segment sum": (lambda x, w: (jax.vmap(lambda r: jax.ops.segment_sum(r, jnp.arange(T) % 3, 3))(x)
                                                    ** 2).mean(), (), "mean"),
        # user trials: a squared norm over the examples (a PINN's residual) read as no combination (a false warning);
        # each example's value picked by an index array (the last valid frame of a CTC/RNN-T loss), whose negative
        # indices JAX wraps with the batch size, likewise; a masked-token ratio plus a mean (BERT's MLM + NSP) read
        # as no combination instead of a ratio; a sum over examples divided by their maximum length
        "a squared norm over the examples": (lambda x, w: jnp.linalg.norm(x) ** 2 / x.shape[0], (), "mean"),
        "each example's value at an index": (lambda x, w: (x[jnp.arange(x.shape[0]), jnp.argmax(x, 1)] ** 2).mean(),
                                             (), "mean"),
        "a masked mean plus a mean": (lambda x, w: (x.sum(-1) * (x[:, 0] > 0)).sum() / (x[:, 0] > 0).sum()
                                      + (x ** 2).mean(), (), "ratio"),
        "a sum over a maximum": (lambda x, w: (x ** 2).sum() / (jnp.abs(x).max() * x.shape[0]), (), None),
        # (a user trial: t5x's tokens each over the count, then summed, read as a statistic spread over the examples)
        "shares of a count, summed": (lambda x, w: jnp.sum(x.sum(-1) * (x[:, 0] > 0) / (x[:, 0] > 0).sum()), (),
                                      "ratio"),
        "shares of a sum, squared": (lambda x, w: jnp.sum((x[:, 0] ** 2 / (x[:, 0] ** 2).sum()) ** 2), (), None),
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
    elif got in ("max", "min"):
        np.testing.assert_allclose(np.max(parts) if got == "max" else np.min(parts), truth, rtol=1e-6)
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


@pytest.mark.parametrize("stages", [2, 1])
@pytest.mark.parametrize("summed", [False, True])
def test_an_aux_maximum_or_minimum_over_examples_is_the_batch_s(stages, summed):
    """A trial's fp8 amax (a maximum over the batch, returned as aux to scale the next step) came back as the mean of
    the microbatches' maxima (3.25 for jit's 10), or their sum under a summed loss; the largest and smallest error
    too. They are combined by their maximum (minimum), on a pipeline and in the one-stage program alike."""
    def loss(p, b, *w):
        nll = _nll(p, b)
        main = (nll * w[0]).sum() if summed else nll.mean()
        return main, {"max": nll.max(), "min": nll.min(axis=1).min(), "amax": jnp.abs(nll).max().astype(jnp.bfloat16),
                      "imax": b["x"].max(), "mean": nll.mean()}

    step = _step(loss, (lambda b: (b["mask"] / b["mask"].sum(),)) if summed else (lambda b: ()), has_aux=True)
    params = _params(jax.random.key(0))
    results = []
    for fn in (jax.jit(step), autopp.parallelize(step, num_stages=stages, num_microbatches=M,
                                                 devices=jax.devices()[:stages])):
        state = (params, TX.init(params))
        *state, out = fn(*state, _batch(0))
        results.append(out)
    (l_jit, aux_jit), (l_pp, aux_pp) = results
    parts = [float(jnp.max(_nll(params, jax.tree.map(lambda v: v[i * B // M:(i + 1) * B // M], _batch(0)))))
             for i in range(M)]
    assert np.mean(parts) < float(aux_jit["max"]) * 0.999  # the mean of the maxima is not the maximum
    assert aux_pp["imax"].dtype == aux_jit["imax"].dtype and aux_pp["amax"].dtype == aux_jit["amax"].dtype
    _assert_equal((l_jit, aux_jit), (l_pp, aux_pp))


def test_one_microbatch_reads_a_whole_batch_count_without_loss_reduction():
    """A count taken over the whole batch in the step, with one microbatch, was refused as ambiguous (mean or sum?);
    with one microbatch both are jit's."""
    step = _step(lambda p, b, n: (_nll(p, b) * b["mask"]).sum() / n, lambda b: (b["mask"].sum(),))
    params = _params(jax.random.key(0))
    outs = []
    for fn in (jax.jit(step), autopp.parallelize(step, num_stages=2, num_microbatches=1, devices=jax.devices()[:2])):
        outs.append(fn(params, TX.init(params), _batch(0)))
    _assert_equal(outs[0], outs[1])
    odd = _step(lambda p, b, n: jnp.sqrt(((_nll(p, b) * b["mask"]) ** 2).sum()) / n, lambda b: (b["mask"].sum(),))
    with pytest.raises(ValueError, match=r"computes from the whole batch \(float32\[\] made at .*test_loss_reduction"):
        _run(odd)  # 4 microbatches of a loss that is neither a mean nor a sum: which one is meant cannot be told


def test_a_statistics_term_beside_a_sum_under_sum_is_said_to_be_added_up():
    """A token sum over the step's count plus a function of the batch's means (an MoE load-balancing term): the
    default refuses and says "sum" when the count normalises the loss; under "sum" the term was added once per
    microbatch silently (trial MOE: 3.87392 for jit's 3.57099 at 4 microbatches). It is said, and its advice (the term
    over num_microbatches) gives the microbatches' average of the term: a jit step accumulating the same
    microbatches' losses by hand."""
    term = lambda p, b: 0.1 * _nll(p, b).mean() ** 2  # noqa: E731 (a function of a mean over the examples)

    def loss(p, b, n, scale=1.0):
        return (_nll(p, b) * b["mask"]).sum() / n + term(p, b) * scale

    with pytest.warns(UserWarning, match=r"(?s)adds a sum over its examples to a term whose combination.*added up: "
                                         r"4 times its weight"):
        _run(_step(loss, lambda b: (b["mask"].sum(),)), loss_reduction="sum")
    advised = _step(lambda p, b, n: loss(p, b, n, 1 / M), lambda b: (b["mask"].sum(),))

    def accumulated(params, opt_state, batch):  # the truth: the microbatches' losses summed by hand, under jit
        n = batch["mask"].sum()
        parts = [jax.tree.map(lambda v: v[i * B // M:(i + 1) * B // M], batch) for i in range(M)]
        value, grads = jax.value_and_grad(lambda p: sum(loss(p, b, n, 1 / M) for b in parts))(params)
        updates, opt_state = TX.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    params = _params(jax.random.key(0))
    with pytest.warns(UserWarning, match="added up"):
        piped = autopp.parallelize(advised, num_stages=2, num_microbatches=M, devices=jax.devices()[:2],
                                   loss_reduction="sum")
        got = piped(params, TX.init(params), _batch(0))
    want = jax.jit(accumulated)(params, TX.init(params), _batch(0))
    _assert_equal((autopp.gather(got[0]), got[2]), (want[0], want[2]))


def test_a_masked_load_balancing_term_is_said_to_come_back_small_and_its_fix_is_jit_s():
    """A Switch-style load-balancing term over the real tokens, ``E * sum(f * P)`` with ``f`` and ``P`` sums over the
    tokens divided by the step's count (trial LMTRICKS): under "sum" the warning said the term came back
    num_microbatches times its weight and advised dividing it, where each microbatch's product of two sums is about
    1/M**2 of the whole batch's (0.2617 for jit's 1.0178). The warning says both cases; its fix, the token fractions
    ``f`` computed in the step (they take no gradient), gives jit's values without a word."""
    def router(p, b):  # each token's probabilities over H "experts", and its choice
        probs = jax.nn.softmax(jnp.tanh(p["embed"][b["x"]] @ p["w"]), -1)
        return probs, jax.nn.one_hot(jnp.argmax(probs, -1), H)

    def masked(p, b, n):
        probs, chosen = router(p, b)
        f = (chosen * b["mask"][..., None]).sum((0, 1)) / n
        lb = H * jnp.sum(f * (probs * b["mask"][..., None]).sum((0, 1)) / n)
        return (_nll(p, b) * b["mask"]).sum() / n + 0.1 * lb

    def fractions(b, p):  # the fix: f from the step, over the whole batch (a leading axis of 1: read whole)
        _, chosen = router(p, b)
        return (chosen * b["mask"][..., None]).sum((0, 1))[None] / b["mask"].sum()

    def fixed(p, b, n, f):
        probs, _ = router(p, b)
        return (_nll(p, b) * b["mask"]).sum() / n + 0.1 * H * jnp.sum(f[0] * (probs * b["mask"][..., None]).sum((0, 1))
                                                                     / n)

    with pytest.warns(UserWarning, match=r"(?s)added up: 4 times its weight.*about 1/4 of it where it multiplies two "
                                         r"sums.*token fractions f"):
        _run(_step(masked, lambda b: (b["mask"].sum(),)), loss_reduction="sum")

    def step(params, opt_state, batch):
        f = jax.lax.stop_gradient(fractions(batch, params))
        value, grads = autopp.value_and_grad(fixed)(params, batch, batch["mask"].sum(), f)
        updates, opt_state = TX.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        (p_jit, l_jit), (p_pp, l_pp) = _run(step, loss_reduction="sum")
    assert not [str(w.message) for w in seen if "autopp" in str(w.message)]
    _assert_equal((p_jit, l_jit), (p_pp, l_pp), tol=2e-6)


def test_a_count_per_task_from_the_step_is_a_whole_batch_value_like_a_scalar_count():
    """Counts of several tasks are a vector the step computes from the whole batch: a loss normalised by them plus a
    term whose combination cannot be read was averaged silently, dividing the counted part by the microbatches (trial
    MTL: 0.5630 for jit's 2.1440), where the same count as a scalar is refused with the choice. Both are refused;
    the vector count with "sum" and a loss of sums over it gives jit's values."""
    counts = lambda b: (jnp.stack([b["mask"].sum(), b["mask"][:, :2].sum()]),)  # noqa: E731 (two tasks' counts)

    def tasks(p, b, n):
        nll = _nll(p, b)
        return (nll * b["mask"]).sum() / n[0] + (nll[:, :2] * b["mask"][:, :2]).sum() / n[1]

    odd = _step(lambda p, b, n: tasks(p, b, n) + jnp.sqrt(_nll(p, b).var()), counts)
    with pytest.warns(UserWarning, match="spreads a statistic"), pytest.raises(
            ValueError, match=r"computes from the whole batch \(float32\[2\] made at .*test_loss_reduction"):
        _run(odd)
    (p_jit, l_jit), (p_pp, l_pp) = _run(_step(tasks, counts), loss_reduction="sum")
    _assert_equal(l_jit, l_pp)
    _assert_equal(p_jit, p_pp)


_RATIO_FORMS = {
    "ratio": lambda p, b: (_nll(p, b) * b["mask"]).sum() / b["mask"].sum(),
    # t5x's compute_weighted_cross_entropy with loss_normalizing_factor=NUM_REAL_TARGET_TOKENS: each token divided
    # by the count, then summed; and the weights normalised first
    "t5x": lambda p, b: jnp.sum(_nll(p, b) * b["mask"] / jnp.sum(b["mask"])),
    "weights normalised": lambda p, b: jnp.sum(_nll(p, b) * (b["mask"] / b["mask"].sum())),
    # (trial SHARE: each ran at 4x under "sum", silently or with the generic warning)
    "times a reciprocal": lambda p, b: jnp.sum(_nll(p, b) * b["mask"]) * jnp.reciprocal(b["mask"].sum()),
    "times a power -1": lambda p, b: jnp.sum(_nll(p, b) * b["mask"]) * b["mask"].sum() ** -1,
    "guarded shares": lambda p, b: jnp.sum(_nll(p, b) * b["mask"] / jnp.maximum(b["mask"].sum(), 1.0)),
    "masked shares": lambda p, b: jnp.sum(jnp.where(b["mask"] > 0, _nll(p, b) / b["mask"].sum(), 0.0)),
    "contracted shares": lambda p, b: jnp.einsum("bt,bt->", _nll(p, b), b["mask"] / b["mask"].sum()),
    # (trial MTL: an integer count guarded, then cast, got the generic warning, whose "sum" advice ran at 4x silently)
    "guarded integer count": lambda p, b: (_nll(p, b) * b["mask"]).sum() / jnp.maximum((b["mask"] > 0).sum(), 1),
    "clipped integer count": lambda p, b: (_nll(p, b) * b["mask"]).sum() / jnp.clip((b["mask"] > 0).sum(), 1),
}


@pytest.mark.parametrize("form", list(_RATIO_FORMS))
def test_loss_reduction_sum_of_a_ratio_inside_the_loss_is_refused(form):
    """A masked mean inside the loss with loss_reduction="sum" added up the microbatches' ratios: 4x jit's loss and
    gradients, silently (a trial: 9.17 for jit's 2.30). Written as t5x writes it (each token over the count, then
    summed) it ran at 4.0x jit's loss (13.656 for 3.414) with a warning that called it gradient accumulation's."""
    step = _step(_RATIO_FORMS[form])
    with pytest.raises(ValueError, match=r"loss_reduction='sum', but the loss divides a sum .* about 4x"):
        _run(step, loss_reduction="sum")


@pytest.mark.parametrize("form", [f for f in _RATIO_FORMS if f != "ratio"])
def test_a_ratio_written_as_shares_of_the_count_is_a_ratio(form):
    """The t5x forms under the default: the masked-token-mean warning and its advice (it warned that the loss spreads
    a statistic over its examples, whose advice, num_microbatches=1, gives up the pipeline). A loss input that the loss
    never reads (a count computed in the step and not used) changes nothing: it made the step refuse with advice to
    pass "sum"."""
    step = _step(_RATIO_FORMS[form])
    with pytest.warns(UserWarning, match=r"(?s)divides a sum over its examples by another sum.*mask.sum\(\)") as rec:
        (p_jit, l_jit), (p_pp, l_pp) = _run(step)
    assert not any("spreads a statistic" in str(w.message) for w in rec)
    assert not np.isclose(float(l_jit), float(l_pp), rtol=1e-4)  # the microbatches' ratios averaged, as said
    unused = _step(lambda p, b, n: _RATIO_FORMS[form](p, b), lambda b: (b["mask"].sum(),))
    with pytest.warns(UserWarning, match=r"divides a sum over its examples by another sum"):
        _run(unused)
    # the advice: the count from the step, each token over it, summed: jit's values
    passed = _step(lambda p, b, n: jnp.sum(_nll(p, b) * b["mask"] / n), lambda b: (b["mask"].sum(),))
    (p_jit, l_jit), (p_pp, l_pp) = _run(passed, loss_reduction="sum")
    _assert_equal(l_jit, l_pp)
    _assert_equal(p_jit, p_pp)


def test_a_share_of_a_sum_used_otherwise_than_summed_still_warns():
    """Examples' shares of a sum over the batch fed to a logarithm or a square (a softmax over the batch) are a
    statistic spread over the examples, said as before, whether or not the loss is passed a count it does not read."""
    for loss in (lambda p, b: -jnp.mean(jnp.log(jnp.exp(-_nll(p, b)[:, 0]) / jnp.exp(-_nll(p, b)[:, 0]).sum())),
                 lambda p, b: jnp.sum((_nll(p, b)[:, 0] / _nll(p, b)[:, 0].sum()) ** 2)):
        with pytest.warns(UserWarning, match=r"spreads a statistic over its examples"):
            _run(_step(loss))
        # with a count from the step that the loss never reads: the same (it was refused, as if the count could
        # normalise the loss, with advice to pass loss_reduction="sum")
        with pytest.warns(UserWarning, match=r"spreads a statistic over its examples"):
            _run(_step(lambda p, b, n: loss(p, b), lambda b: (b["mask"].sum(),)))


def test_an_aux_ratio_is_averaged_with_a_warning_under_a_summed_loss():
    """A masked accuracy returned as aux under a loss normalised by a whole-batch count was summed over microbatches
    (0.53 for jit's 0.13): it is averaged, with a warning that says how to get jit's value."""
    def loss(p, b, w):
        nll = _nll(p, b)
        return (nll * w).sum(), {"acc": ((nll < 3.0) * b["mask"]).sum() / b["mask"].sum()}

    step = _step(loss, lambda b: (b["mask"] / b["mask"].sum(),), has_aux=True)
    with pytest.warns(UserWarning, match=r"(?s)aux\['acc'\] divide.*numerator and the denominator"):
        (p_jit, (l_jit, a_jit)), (p_pp, (l_pp, a_pp)) = _run(step)
    _assert_equal(p_jit, p_pp)
    assert abs(float(a_pp["acc"]) - float(a_jit["acc"])) < 0.05  # averaged ratios: near jit's, not 4x


def _mixing_losses():
    """name -> (loss, what the warning names): losses whose examples' values depend on other examples."""
    def clip(p, b):
        e = jnp.tanh(p["embed"][b["x"]].mean(1) @ p["w"])
        logits = e @ (e @ p["w"]).T  # in-batch negatives: every example against every other
        return optax.softmax_cross_entropy_with_integer_labels(logits, jnp.arange(e.shape[0])).mean()

    def batch_norm(p, b):
        h = p["embed"][b["x"]].mean(1) @ p["w"]
        h = (h - h.mean(0)) / jnp.sqrt(h.var(0) + 1e-5)
        return ((h @ p["head"]) ** 2).mean()

    def ranked(p, b):
        s = (p["embed"][b["x"]].mean(1) @ p["w"]).sum(1)
        return (jnp.sort(s) * jnp.linspace(0, 1, s.shape[0])).mean()

    def noised(p, b, key):
        x = p["embed"][b["x"]].mean(1)
        return ((jnp.tanh((x + jax.random.normal(key, x.shape)) @ p["w"]) @ p["head"]) ** 2).mean()

    def reweighted(p, b):  # a trial's residual-adaptive weights: jax.nn.softmax over the batch of stopped errors,
        e = ((p["embed"][b["x"]].mean(1) @ p["w"]) ** 2).sum(1)  # whose max went through stop_gradient unread
        return (jax.nn.softmax(jax.lax.stop_gradient(e)) * e.shape[0] * e).mean()

    def hardest(p, b):  # online hard-example mining (user trial NOISE3: 0.1092 for jit's 0.1104, silently)
        nll = _nll(p, b).mean(1)
        return jax.lax.top_k(nll, nll.shape[0] // 2)[0].mean()

    def smoothed(p, b):  # a window over neighbouring examples (trial NOISE3: silent with loss_reduction='mean')
        e = (p["embed"][b["x"]].mean(1) @ p["w"]).sum(1)
        return (jax.lax.reduce_window(e, 0.0, jax.lax.add, (3,), (1,), "SAME") ** 2).mean()

    def spectral(p, b):  # an FFT over the batch axis (trial NOISE3: 0.447 for jit's 1.41, silently)
        e = (p["embed"][b["x"]].mean(1) @ p["w"]).sum(1)
        return jnp.abs(jnp.fft.fft(e)).mean()

    return {"hard-example mining": (hardest, "orders its examples"), "a window over the batch": (smoothed, "orders"),
            "an FFT over the batch": (spectral, "orders its examples"),
            "in-batch negatives": (clip, "pairs its examples"),
            "batch normalisation": (batch_norm, "spreads a statistic"),
            "softmax weights over the batch": (reweighted, "spreads a statistic"),
            "a ranking over the batch": (ranked, "orders its examples"),
            "noise from one key": (noised, "draws random numbers for its examples from a key")}


@pytest.mark.parametrize("name", list(_mixing_losses()))
def test_a_loss_that_mixes_its_examples_warns_where(name):
    """CLIP's in-batch negatives, BatchNorm and batch-hard mining ran per microbatch silently (a trial: CLIP's loss
    2.00 for jit's 3.92, a batch-hard triplet loss 0 with no gradient at all), and a diffusion model's noise drawn
    in the loss from a key it was passed was the same for every microbatch: a warning names what mixes the examples
    and the line; with one microbatch the step is jit's."""
    loss, words = _mixing_losses()[name]
    step = _step(loss, (lambda b: (jax.random.key(3),)) if name == "noise from one key" else (lambda b: ()))
    with pytest.warns(UserWarning, match=rf"(?s)the loss {words}.* at .*test_loss_reduction.py.*num_microbatches=1"):
        (p_jit, l_jit), (p_pp, l_pp) = _run(step)
    assert not np.isclose(float(l_jit), float(l_pp), rtol=1e-4)  # per microbatch: not jit's
    params = _params(jax.random.key(0))
    outs = [fn(params, TX.init(params), _batch(0)) for fn in (
        jax.jit(step), autopp.parallelize(step, num_stages=2, num_microbatches=1, devices=jax.devices()[:2]))]
    _assert_equal(outs[0], outs[1])


def test_counts_and_flags_over_the_examples_combine_as_jit_s():
    """A trial's confusion counts written as scatter-adds (``.at[label].add(1.0)``, ``jnp.bincount``, a segment sum of
    ones) came back averaged over the microbatches (8 for jit's 32), and flags over the examples (``jnp.any``,
    ``jnp.all``) were refused with advice (a float cast) that gave 0.75 for jit's True. Counts are added up, flags
    combined by or / and, maxima and minima per segment (``jax.ops.segment_max``: summed, with a warning, before the
    eighth session's trials) by their maximum and minimum."""
    C = 4

    def loss(p, b):
        nll = _nll(p, b)
        pred = jnp.argmax(nll, axis=1) % C  # an int per example, decided by the batch
        return nll.mean(), {"at_add": jnp.zeros(C).at[pred].add(1.0), "bincount": jnp.bincount(pred, length=C),
                            "segment_sum": jax.ops.segment_sum(jnp.ones(pred.shape[0]), pred, num_segments=C),
                            "any": (nll > 4.2).any(), "all": (nll > 0.5).all(), "none": (nll > 99.0).any(),
                            # a maximum / minimum per segment (a trial's per-document maxima: summed, -inf poisoned)
                            "segment_max": jax.ops.segment_max(nll.max(1), pred, num_segments=C + 2),
                            "segment_min": jax.ops.segment_min(nll.min(1), pred, num_segments=C + 2)}

    (p_jit, (l_jit, a_jit)), (p_pp, (l_pp, a_pp)) = _run(_step(loss, has_aux=True))
    assert np.isneginf(a_jit["segment_max"][C:]).all() and np.isfinite(a_jit["segment_max"][:C]).any()
    assert a_jit["any"] and not a_jit["none"] and float(a_jit["at_add"].sum()) == B  # (the flags differ over examples)
    assert {k: v.dtype for k, v in a_pp.items()} == {k: v.dtype for k, v in a_jit.items()}
    _assert_equal((l_jit, a_jit), (l_pp, a_pp))
    _assert_equal(p_jit, p_pp)


def test_an_aux_value_no_combination_of_the_microbatches_gives_is_named():
    """Perplexity (exp of a mean), a top-k over the batch and one example's value came back as the average of the
    microbatches' values with no word (a trial: perplexity 5.04e6 for jit's 6.59e5), and a statistic over the batch
    only an aux used warned that the loss and gradients differ (they do not). Both warnings name the aux (the top-k as
    an ordering of the examples, since 2026-12-06)."""
    def loss(p, b):
        nll = _nll(p, b)
        return nll.mean(), {"ppl": jnp.exp(nll.mean()), "first": nll[0, 0], "top": jax.lax.top_k(nll.sum(1), 2)[0],
                            "acc": (nll < 3.0).mean()}

    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        (p_jit, (l_jit, a_jit)), (p_pp, (l_pp, a_pp)) = _run(_step(loss, has_aux=True))
    texts = [str(w.message) for w in record]
    assert any(re.search(r"aux\['first'\], aux\['ppl'\] depend\(s\) on the batch", t) for t in texts), texts
    assert any(re.search(r"aux\['top'\] orders its examples \(a sort, a top-k", t) for t in texts), texts
    assert not np.isclose(float(a_jit["ppl"]), float(a_pp["ppl"]), rtol=1e-3)
    _assert_equal((p_jit, l_jit, a_jit["acc"]), (p_pp, l_pp, a_pp["acc"]))

    def spread(p, b):
        nll = _nll(p, b)
        return nll.mean(), nll.sum(1).std()

    with pytest.warns(UserWarning, match=r"(?s)aux spreads a statistic.*the loss and gradients do not") as record:
        (p_jit, _), (p_pp, _) = _run(_step(spread, has_aux=True))
    assert not any("the loss spreads" in str(w.message) for w in record)
    _assert_equal(p_jit, p_pp)


def test_a_summed_loss_is_read_as_a_sum_with_one_example_per_microbatch():
    """At one example per microbatch JAX writes ``h @ h.transpose(0, 2, 1)`` without the batch axis (``jnp.matmul``
    drops one of size 1), so the two programs did not compare and the default averaged a summed loss: 1/16 of jit's
    loss and gradients, silently (a trial's two-tower model and VLM). The programs read are now at two examples."""
    def loss(p, b):
        h = p["embed"][b["x"]] @ p["w"]
        h = jax.nn.softmax(h @ h.transpose(0, 2, 1), -1) @ h
        return ((h.mean(1) @ p["head"] - 1.0) ** 2).sum()

    step = _step(loss)
    params = _params(jax.random.key(0))
    outs = []
    for fn in (jax.jit(step), autopp.parallelize(step, num_stages=2, num_microbatches=B, devices=jax.devices()[:2])):
        state = (params, TX.init(params))
        *state, out = fn(*state, _batch(0))
        outs.append((autopp.gather(state[0]), out))
    _assert_equal(outs[0], outs[1], tol=2e-5)


def test_a_loss_whose_combination_cannot_be_read_is_averaged_with_a_warning():
    """A sum over the examples made inside a custom kernel (a trial's Pallas cross-entropy) was averaged with no word:
    a quarter of jit's loss and gradients. Where the program does not show a mean or a sum (here a callback that
    adds the examples up, and a root of a sum), the default still averages, and says so with the fix; an aux value
    alike (a count from a callback came back as the microbatches' mean, a quarter of jit's)."""
    def callback_sum(p, b):
        per = _nll(p, b).sum(1)
        def host_sum(v):  # on the host, in numpy: JAX called from a callback can deadlock the dispatching thread
            return np.asarray(np.sum(np.asarray(v)), np.float32)

        total = jax.pure_callback(host_sum, jax.ShapeDtypeStruct((), jnp.float32), jax.lax.stop_gradient(per))
        return per.mean(), {"total": total}

    for loss, has_aux in ((lambda p, b: jnp.sqrt((_nll(p, b) ** 2).sum()), False), (callback_sum, True)):
        with pytest.warns(UserWarning, match=r"does not show whether it is a mean or a sum|aux\['total'\] depend"):
            _run(_step(loss, has_aux=has_aux))
    with pytest.warns(UserWarning, match=r"loss_reduction='sum' is given, but .* square root .* num_microbatches=1"):
        (p_jit, l_jit), (p_pp, l_pp) = _run(_step(lambda p, b: jnp.sqrt((_nll(p, b) ** 2).sum())),
                                            loss_reduction="sum")
    assert not np.isclose(float(l_jit), float(l_pp), rtol=1e-3)  # neither combination is jit's: the warning says so


def test_a_recurrence_along_the_batch_axis_is_named():
    """Time-major data ([time, batch, ...]) scanned over time, axis 0, which autopp splits: each microbatch is a
    stretch of time from the initial state, and the loss differs from jit's with no word (a trial's GRU and SSM:
    1.599 for jit's 1.748). Unrolled, the programs at the two batch sizes differ; a warning says what that means."""
    def recurrence(p, b):
        x = p["embed"][b["x"]].mean(1)
        h = jax.lax.scan(lambda c, xt: (jnp.tanh(c @ p["w"] + xt),) * 2, jnp.zeros(x.shape[1:]), x)[1]
        return ((h @ p["head"]) ** 2).mean()

    def prefix(p, b):
        x = p["embed"][b["x"]].mean(1) @ p["w"]
        return ((jax.lax.associative_scan(jnp.add, jnp.tanh(x)) @ p["head"]) ** 2).mean()

    def gae(p, b):  # PureJaxRL's GAE over a time-major rollout: the next values shifted in time, a reverse scan
        v = (jnp.tanh(p["embed"][b["x"]].mean(1) @ p["w"]) @ p["head"]).mean(1)  # (trial PREFOPT: warned as an
        nv = jax.lax.stop_gradient(jnp.concatenate([v[1:], v[-1:]]))  # order and a replay buffer, with no word of
        adv = jax.lax.scan(lambda c, d: (d + 0.9 * c,) * 2, 0.0, nv - jax.lax.stop_gradient(v), reverse=True)[1]
        return ((v - jax.lax.stop_gradient(adv + v)) ** 2).mean()  # time-major data)

    # the scan carried along axis 0 says what a time-major batch needs (it said "orders its examples", with advice
    # that did not fit: a trial's GRU over [T, B] windows)
    for loss, said in ((recurrence, r"(?s)scans along the batch's first axis.*time-major.*jnp.swapaxes"),
                       (prefix, r"(?s)loops over the batch axis.*time-major|orders its examples"),
                       (gae, r"(?s)time-major \[T, B, ...\] rollout.*jnp.swapaxes")):
        with pytest.warns(UserWarning, match=said):
            (p_jit, l_jit), (p_pp, l_pp) = _run(_step(loss))
        assert not np.isclose(float(l_jit), float(l_pp), rtol=1e-4)


def test_ordinary_losses_and_aux_values_run_as_jit_without_a_word():
    """Warnings a trial saw on steps whose values are jit's: the loss logged as ``stop_gradient(loss)``, aux values
    stacked into a vector (``jnp.stack``, a primitive of its own), and a cross-entropy summed over chunks of the
    flattened tokens by a ``lax.scan`` (it read as an order of the examples, at a line of autopp's own)."""
    def logged(p, b):
        nll = _nll(p, b)
        return nll.mean(), {"m": jax.lax.stop_gradient(nll.mean()), "v": jnp.stack([nll.mean(), (nll < 3).mean()])}

    def chunked(p, b):
        h = jnp.tanh(p["embed"][b["x"]] @ p["w"]).reshape(-1, H)
        y = b["y"].reshape(-1)

        def body(total, xs):
            return total + optax.softmax_cross_entropy_with_integer_labels(xs[0] @ p["head"], xs[1]).sum(), None

        total, _ = jax.lax.scan(body, 0.0, (h.reshape(-1, 32, H), y.reshape(-1, 32)))
        return total / h.shape[0]

    for loss, has_aux in ((logged, True), (chunked, False)):
        _assert_quiet_and_jit_s(_step(loss, has_aux=has_aux))


def test_a_sum_plus_a_mean_in_the_loss_is_refused():
    """A masked loss divided by a token count the step computes (a sum) plus a z-loss written with ``.mean()``: no
    count of microbatches combines them, but ``loss_reduction="sum"`` ran it silently (a trial: 4.01 for jit's 3.88,
    parameters off by 5.7e-4), and without it the refusal advised "mean", which it then refused too."""
    def loss(p, b, count):
        logits = jnp.tanh(p["embed"][b["x"]] @ p["w"]) @ p["head"]
        nll = optax.softmax_cross_entropy_with_integer_labels(logits, b["y"])
        return (nll * b["mask"]).sum() / count + 1e-2 * (jax.nn.logsumexp(logits, -1) ** 2).mean()

    step = _step(loss, lambda b: (b["mask"].sum(),))
    for reduction in (None, "sum", "mean"):
        with pytest.raises(ValueError, match=r"adds a sum over its examples .* to a mean over them .* Write both"):
            _run(step, loss_reduction=reduction)


def test_a_mean_plus_two_sums_is_refused_as_a_sum_plus_a_mean_is():
    """A VQ-VAE loss ported from PyTorch's ``reduction="sum"``: a mean reconstruction plus a codebook and a
    commitment term each summed. With the mean first and two sums after, ``loss_reduction="sum"`` ran it silently
    (trial VQ: 6.3231 for jit's 2.5875), "mean" was refused with the advice to pass "sum", and without it the loss
    was averaged with a warning. Refused in every case, as the sums first and the mean last are."""
    def loss(p, b):
        h = jnp.tanh(p["embed"][b["x"]] @ p["w"])
        rec = (h @ p["head"]) ** 2
        return rec.mean() + 0.01 * jnp.sum((h - 0.5) ** 2) + 0.0025 * jnp.sum((h + 0.5) ** 2)

    step = _step(loss)
    for reduction in (None, "sum", "mean"):
        with pytest.raises(ValueError, match=r"adds a sum over its examples .* to a mean over them .* Write both"):
            _run(step, loss_reduction=reduction)


def test_a_statistic_over_the_batch_carried_by_a_scan_is_named():
    """A recurrent cell that carries ``h.mean(0)`` (a statistic over the batch) to its next step: written as a Python
    loop it was named as spreading a statistic over the examples; as a ``lax.scan`` (kept one scan since scans over
    data are) the carry read as unknown and only a mean-or-sum warning came, whose advice silenced it."""
    def loss(p, b):
        x = jnp.swapaxes(p["embed"][b["x"]], 0, 1)  # (time, batch, hidden), scanned over time

        def cell(carry, xt):
            h, stat = carry
            h = jnp.tanh(xt @ p["w"] + h + stat)
            return (h, h.mean(0)), h

        _, hs = jax.lax.scan(cell, (jnp.zeros(x.shape[1:]), jnp.zeros(x.shape[2:])), x)
        return ((hs @ p["head"]) ** 2).mean()

    step, params = _step(loss), _params(jax.random.key(0))
    pipelined = autopp.parallelize(step, num_stages=1, num_microbatches=M, devices=jax.devices()[:1],
                                   loss_reduction="mean")
    with pytest.warns(UserWarning, match=r"the loss spreads a statistic over its examples .* at .*test_loss_reduction"):
        l_pp = pipelined(params, TX.init(params), _batch(0))[2]
    l_jit = jax.jit(step)(params, TX.init(params), _batch(0))[2]
    assert not np.isclose(float(l_jit), float(l_pp), rtol=1e-4)


def test_a_loss_whose_reduction_cannot_be_read_is_named_where():
    """A trial's CTC loss normalised by the longest label of its batch, ``sum / (lengths.max() * B)``, was averaged
    with a warning that blamed a custom kernel or a callback (there was none): it names the line and the maximum,
    and the fix. Averaged, the loss is not jit's (each microbatch divides by its own maximum)."""
    def loss(p, b):
        nll = _nll(p, b)
        return nll.sum() / (b["mask"].sum(1).max() * nll.shape[0])

    with pytest.warns(UserWarning, match=r"(?s)does not show whether it is a mean or a sum .*test_loss_reduction.py"
                                         r".* maximum or minimum over the examples .*pass it to the loss") as record:
        (p_jit, l_jit), (p_pp, l_pp) = _run(_step(loss))
    assert not any("custom kernel" in str(w.message) for w in record)
    assert not np.isclose(float(l_jit), float(l_pp), rtol=1e-4)


def test_examples_numbered_by_position_to_index_a_whole_array_are_named():
    """A trial's row weights passed beside the batch and read by ``w[jnp.arange(B)]`` in the loss gave 1.58 for jit's
    4.60 with no word (each microbatch read rows 0..3), and document ids ``seg + 5 * arange(B)`` summed into a fixed
    number of segments as an aux collided across microbatches (13 slots for jit's 31). Both warn, naming the use;
    the row weights passed with the batch give jit's values without a warning."""
    def loss(p, b, w):
        nll = _nll(p, b).mean(1)
        ids = (b["x"][:, 0] % 2) + 2 * jnp.arange(nll.shape[0])
        return (nll * w[jnp.arange(nll.shape[0])]).mean(), jax.ops.segment_sum(nll, ids, num_segments=2 * B)

    weights = jnp.linspace(0.2, 2.0, B)
    with pytest.warns(UserWarning) as record:
        (_, (l_jit, a_jit)), (_, (l_pp, a_pp)) = _run(_step(loss, lambda b: (weights,), has_aux=True))
    texts = [str(w.message) for w in record]
    assert any(t.startswith("autopp.parallelize: the loss numbers its examples by their position") for t in texts)
    assert any(t.startswith("autopp.parallelize: aux numbers its examples by their position") for t in texts)
    assert not np.isclose(float(l_jit), float(l_pp), rtol=1e-4)

    def split_with_the_batch(p, b):
        return (_nll(p, b).mean(1) * b["w"][jnp.arange(b["x"].shape[0])]).mean()

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        params = _params(jax.random.key(0))
        batch = {**_batch(0), "w": weights}
        step = _step(split_with_the_batch)
        outs = [fn(params, TX.init(params), batch) for fn in (
            jax.jit(step), autopp.parallelize(step, num_stages=2, num_microbatches=M, devices=jax.devices()[:2]))]
    _assert_equal(outs[0], outs[1])


def _assert_quiet_and_jit_s(step, prefix="autopp", what=""):
    """The step on 2 stages x M microbatches warns nothing that names ``prefix`` and equals plain jit's (SGD)."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        (p_jit, out_jit), (p_pp, out_pp) = _run(step)
    assert not [str(w.message) for w in seen if prefix in str(w.message)], what
    _assert_equal((p_jit, out_jit), (p_pp, out_pp), tol=2e-6)


def _warning_texts(loss, extra=lambda b: ()):
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        (p_jit, l_jit), (p_pp, l_pp) = _run(_step(loss, extra))
    texts = [str(w.message) for w in record if "autopp" in str(w.message)]
    return texts, float(l_jit), float(l_pp)


@pytest.mark.parametrize("name", ["worst case", "padding by position", "weights by position", "flipped negatives",
                                  "a slice of a whole array", "a root mean square"])
def test_losses_that_differ_from_jit_per_microbatch_warn_what_they_do(name):
    """A trial's losses whose microbatches' values average to something else than jit's ran silently: the maximum of
    the examples' losses (2.09 for jit's 2.42), a padding mask or weights by position (``jnp.arange(B) < n``:
    2.65 for 1.71), negatives from the batch reversed (``jnp.flip``), the first B rows of an array not split with the
    batch (``lax.dynamic_slice``); and ``sqrt(mse.mean())`` named no line. Each warns, saying what it does."""
    weights = jnp.linspace(0.2, 2.0, B)
    cases = {
        "worst case": (lambda p, b: _nll(p, b).mean(1).max(), "is the maximum of a value over its examples"),
        "padding by position": (lambda p, b: jnp.where(jnp.arange(b["x"].shape[0]) < 12, _nll(p, b).mean(1),
                                                       0.0).sum() / 12,
                                "numbers its examples by their position"),
        "weights by position": (lambda p, b: ((1 + jnp.arange(b["x"].shape[0]) / b["x"].shape[0])
                                              * _nll(p, b).mean(1)).mean(), "numbers its examples by their position"),
        "flipped negatives": (lambda p, b: (_nll(p, b).mean(1) * jnp.flip(_nll(p, b).mean(1), 0)).mean(),
                              "orders its examples"),
        "a slice of a whole array": (lambda p, b, w: (_nll(p, b).mean(1)
                                                      * jax.lax.dynamic_slice(w, (0,), (b["x"].shape[0],))).mean(),
                                     "numbers its examples by their position"),
        "a root mean square": (lambda p, b: jnp.sqrt((_nll(p, b) ** 2).mean()), "applies a square root"),
    }
    loss, words = cases[name]
    texts, l_jit, l_pp = _warning_texts(loss, (lambda b: (weights,)) if name == "a slice of a whole array" else
                                        (lambda b: ()))
    assert any(words in t for t in texts), texts
    assert not np.isclose(l_jit, l_pp, rtol=1e-6)


def test_a_nan_guard_on_the_loss_is_read_through():
    """optax's ranking losses guard their mean (``where(isnan(mean) & ~any(isnan(x)), 0, mean)``) and users guard
    theirs (``where(isfinite(m), m, 0)``): a trial's equal values came with a warning that the loss used a maximum over
    its examples. Read as the mean they guard: no warning, jit's values."""
    def guarded(p, b):
        nll = _nll(p, b).mean(1)
        m = nll.mean()
        m = jnp.where(jnp.isnan(m) & ~jnp.any(jnp.isnan(nll)), 0.0, m)
        return jnp.where(jnp.isfinite(m), m, 0.0)

    texts, l_jit, l_pp = _warning_texts(guarded)
    assert texts == [] and np.isclose(l_jit, l_pp, rtol=1e-6)


def _pair_logits(p, b):
    """Each example's score (a sequence log-probability's stand-in) for the DPO tests below."""
    return -_nll(p, b).mean(1)


def _dpo(chosen, rejected):
    return -jax.nn.log_sigmoid(0.5 * (chosen - rejected)).mean()


@pytest.mark.parametrize("name", ["halves sliced", "jnp.split", "reshape(2, -1)", "odd strides", "regrouped rows"])
def test_parts_of_the_batch_taken_by_position_warn_what_they_do(name):
    """DPO and DINO written as many codebases write them (user trial DISTILL): chosen and rejected sequences (or two
    views) concatenated into one batch, then its halves taken. Each microbatch's halves hold other examples than the
    whole batch's, so the loss pairs other examples: with ``jnp.split`` and ``x.reshape(2, -1)`` that ran silently
    (DPO's first loss 0.6839 for jit's 0.6972), with ``x[:n]`` it warned of a sort or a scan. Pairs interleaved and
    read as ``x[0::2]`` / ``x[1::2]`` are right when each microbatch holds whole pairs, and straddle microbatches
    when it holds an odd number of examples (here 3 of 24, parameters off by 6.5e-2 in the trial)."""
    def halves(p, b):
        s = _pair_logits(p, b)
        n = s.shape[0] // 2
        return _dpo(s[:n], s[n:])

    def split(p, b):
        return _dpo(*jnp.split(_pair_logits(p, b), 2))

    def reshaped(p, b):
        s = _pair_logits(p, b).reshape(2, -1)
        return _dpo(s[0], s[1])

    def strided(p, b):
        s = _pair_logits(p, b)
        return _dpo(s[0::2], s[1::2])

    def regrouped(p, b):  # rows of several examples after a transpose (user trial NOISE4: 0.34471 for 0.34411)
        h = jnp.tanh(p["embed"][b["x"]] @ p["w"])
        rows = h.transpose(1, 0, 2).reshape(h.shape[0], -1)
        return jnp.log1p((rows ** 2).mean(-1)).mean()

    loss, words, kw = {"regrouped rows": (regrouped, "regroups its rows across examples", {}),
                       "halves sliced": (halves, "takes parts of the batch by position", {}),
                       "jnp.split": (split, "takes parts of the batch by position", {}),
                       "reshape(2, -1)": (reshaped, "takes parts of the batch by position", {}),
                       "odd strides": (strided, "reads every k-th example", {"num_microbatches": 8})}[name]
    step = _step(loss)
    params = _params(jax.random.key(0))
    batch = _batch(0) if name != "odd strides" else jax.tree.map(lambda a, b: jnp.concatenate([a, b[:8]]), _batch(0),
                                                                  _batch(1))  # 24 examples: 8 microbatches of 3
    want = jax.jit(step)(params, TX.init(params), batch)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        pipelined = autopp.parallelize(step, num_stages=2, devices=jax.devices()[:2], **{"num_microbatches": M, **kw})
        got = pipelined(params, TX.init(params), batch)
    texts = [str(w.message) for w in record if "autopp" in str(w.message)]
    assert any(words in t for t in texts), texts
    assert not np.isclose(float(want[-1]), float(got[-1]), rtol=1e-5)


def test_pairs_read_as_they_stand_in_each_microbatch_run_as_jit_without_a_word():
    """What the warnings above must not catch: chosen and rejected passed as two batch arrays and concatenated for one
    forward pass (TRL's ``concatenated_forward``), then split back into halves; pairs interleaved and read by strides
    that divide each microbatch (DPO's variant B in the trial, which warned falsely that it ordered its examples);
    time-major values flattened to [T * B] rows and reshaped back; the split inside ``jax.checkpoint``; views of
    unequal sizes ([B] + [2B]) concatenated and split back; a batch padded and cut back; pairs signed by parity
    (``jnp.arange(B) % 2``, which each microbatch of whole pairs numbers alike); the pair through a fused projection
    split along its features (q, k, v); two views through a class token joined along the tokens. Each equals jit
    (SGD, <= 1e-6)."""
    def concatenated(p, b):
        rejected = jax.tree.map(lambda a: jnp.flip(a, -1) if a.ndim > 1 else a, b)  # each example's own other half
        both = jax.tree.map(lambda c, r: jnp.concatenate([c, r]), b, rejected)
        s = _pair_logits(p, both)
        chosen, other = jnp.split(s, 2)
        return _dpo(chosen, other) + 0.1 * _dpo(s[:b["x"].shape[0]], s[b["x"].shape[0]:])

    def strided(p, b):
        s = _pair_logits(p, b)
        return _dpo(s[0::2], s[1::2])

    def time_major(p, b):
        h = p["embed"][b["x"]].swapaxes(0, 1)  # [T, B, H]
        t, n = h.shape[:2]
        y = jnp.tanh(h.reshape(t * n, H) @ p["w"]).reshape(t, n, H)
        return (y.swapaxes(0, 1) @ p["head"]).var(-1).mean()

    def checkpointed(p, b):  # the same split inside jax.checkpoint (trial NOISE3: warned of parts by position)
        rejected = jax.tree.map(lambda a: jnp.flip(a, -1) if a.ndim > 1 else a, b)
        both = jax.tree.map(lambda c, r: jnp.concatenate([c, r]), b, rejected)
        return jax.checkpoint(lambda s: _dpo(*jnp.split(s, 2)))(_pair_logits(p, both))

    def unequal(p, b):  # a view of each example and two crops of it, concatenated and split back ([B] + [2B])
        crops = jax.tree.map(lambda a: jnp.concatenate([jnp.roll(a, 1, -1), jnp.roll(a, 2, -1)])
                             if a.ndim > 1 else jnp.concatenate([a, a]), b)
        s = _pair_logits(p, jax.tree.map(lambda a, c: jnp.concatenate([a, c]), b, crops))
        n = b["x"].shape[0]
        return ((s[:n] - s[n:].reshape(2, n).mean(0)) ** 2).mean() + 0.1 * jnp.split(s, [n])[1].mean()

    def padded(p, b):  # the batch padded by 3 rows and the padding cut off again
        return (_pair_logits(p, jax.tree.map(lambda a: jnp.pad(a, [(0, 3)] + [(0, 0)] * (a.ndim - 1)), b))[:-3]
                ** 2).mean()

    def parity(p, b):  # interleaved pairs signed by the parity of their position, in microbatches of whole pairs
        s = _pair_logits(p, b)
        return -jax.nn.log_sigmoid(jnp.where(jnp.arange(s.shape[0]) % 2 == 0, 1.0, -1.0) * s).mean()

    def fused_qkv(p, b):  # the pair through a fused projection split along its features (trial PREFOPT: the
        rejected = jax.tree.map(lambda a: jnp.flip(a, -1) if a.ndim > 1 else a, b)  # split lost the pair's halves,
        both = jax.tree.map(lambda c, r: jnp.concatenate([c, r]), b, rejected)  # warned as parts by position)
        q, k, v = jnp.split(jnp.tile(p["embed"][both["x"]], 3), 3, axis=-1)
        s = (jnp.tanh(q * k + v) @ p["head"]).mean((1, 2))
        return _dpo(*jnp.split(s, 2))

    def class_token(p, b):  # two views concatenated through a ViT whose class token is broadcast to the batch and
        views = jnp.concatenate([b["x"], jnp.flip(b["x"], -1)])  # joined to the patches along the tokens (DINO,
        h = p["embed"][views]  # trial VISION: the join lost the views' halves, warned as parts by position)
        cls = jnp.broadcast_to(p["w"][:1][None], (h.shape[0], 1, H))
        s = (jnp.concatenate([cls, h], 1).mean(1) @ p["head"]).mean(1)
        return _dpo(*jnp.split(s, 2))

    def by_index(p, b):  # the halves read back by positions computed in the loss (trial NOISE19's spellings)
        rejected = jax.tree.map(lambda a: jnp.flip(a, -1) if a.ndim > 1 else a, b)
        s = _pair_logits(p, jax.tree.map(lambda c, r: jnp.concatenate([c, r]), b, rejected))
        n = s.shape[0] // 2
        return _dpo(jnp.take(s, jnp.arange(n)), s[jnp.arange(n) + n]) + 0.1 * _dpo(
            jax.lax.dynamic_slice_in_dim(s, n, n), s[jnp.concatenate([jnp.arange(n) + n, jnp.arange(n)])][n:])

    for loss in (concatenated, strided, time_major, checkpointed, unequal, padded, parity, fused_qkv, class_token,
                 by_index):
        _assert_quiet_and_jit_s(_step(loss), what=loss.__name__)


def test_halves_read_back_by_positions_that_mix_them_are_warned():
    """Positions computed in the loss that pick other examples' rows in each microbatch than in the whole batch
    (trial NOISE19, each silent before: 0.610273 for jit's 0.614482 and the like): an index one row off the second
    half, a dynamic slice at an offset that straddles the halves, a fixed permutation by argsort. They are read as
    the rows they pick, as a slice's bounds are, and warned about (values differ): a window of consecutive rows as a
    part by position (since the eighteenth session; an order before), a permutation as an order."""
    def pairs(p, b):
        rejected = jax.tree.map(lambda a: jnp.flip(a, -1) if a.ndim > 1 else a, b)
        s = _pair_logits(p, jax.tree.map(lambda c, r: jnp.concatenate([c, r]), b, rejected))
        return s, s.shape[0] // 2

    def off_by_one(p, b):
        s, n = pairs(p, b)
        return _dpo(s[:n], s[jnp.arange(n) + n - 1])

    def straddling(p, b):
        s, n = pairs(p, b)
        return _dpo(s[:n], jax.lax.dynamic_slice_in_dim(s, n - 2, n))

    def permuted(p, b):
        s, n = pairs(p, b)
        return _dpo(s[:n], s[n:][jnp.argsort(jnp.sin(jnp.arange(n) * 1.7))])

    for loss, said in ((off_by_one, "takes parts of the batch"), (straddling, "takes parts of the batch"),
                       (permuted, "orders its examples")):
        with pytest.warns(UserWarning, match=said):
            (p_jit, l_jit), (p_pp, l_pp) = _run(_step(loss))
        assert not np.isclose(float(l_jit), float(l_pp), rtol=1e-5), loss.__name__


def _features(p, b):
    return jnp.tanh(p["embed"][b["x"]] @ p["w"]).mean(1)  # [B, H]


def _prototypes(pick):
    def loss(p, b):
        e = _features(p, b)
        return jax.nn.logsumexp(e @ pick(e).T, -1).mean()
    return loss


def _nll_rows(change):
    return lambda p, b: change(_nll(p, b).mean(1)).mean()


@pytest.mark.parametrize("name", ["rows by a constant array", "rows by a numpy array", "jnp.take of rows",
                                  "a row by a scalar", "jnp.take of a row", "first rows written",
                                  "rows written by a constant array", "rows scaled by jnp.arange", "last row written"])
def test_rows_picked_or_written_at_fixed_positions_are_warned(name):
    """Rows of the batch picked or written at fixed positions in the loss (trial NOISE20, each silent before): each
    microbatch picks or writes its own rows at those positions, past its end JAX clamps them (or fills NaN), so
    prototypes taken as ``e[jnp.array([0, 5, 10, 15])]`` gave 4.8273 for jit's 4.8349 and ``nll.at[:2].set(0)``
    9.6109 for 15.6199. The positions are known values (constants, literals, ``jnp.arange``), so the rows are
    compared with the whole batch's: warned, as some examples read for all (picked) or by position (written)."""
    cases = {
        "rows by a constant array": (_prototypes(lambda e: e[jnp.array([0, 5, 10, 15])]), "reads some examples'"),
        "rows by a numpy array": (_prototypes(lambda e: e[np.array([0, 5, 10, 15])]), "reads some examples'"),
        "jnp.take of rows": (_prototypes(lambda e: jnp.take(e, jnp.array([0, 5, 10, 15]), axis=0)),
                             "reads some examples'"),
        "a row by a scalar": (_prototypes(lambda e: e[jnp.int32(3)][None]), "reads some examples'"),
        "jnp.take of a row": (_prototypes(lambda e: jnp.take(e, 3, axis=0)[None]), "reads some examples'"),
        "first rows written": (_nll_rows(lambda n: n.at[:2].set(0.0)), "write rows at fixed positions"),
        "rows written by a constant array": (_nll_rows(lambda n: n.at[jnp.array([0, 6])].set(0.0)),
                                             "write rows at fixed positions"),
        "rows scaled by jnp.arange": (_nll_rows(lambda n: n.at[jnp.arange(2)].multiply(3.0)),
                                      "write rows at fixed positions"),
        "last row written": (_nll_rows(lambda n: n.at[-1].set(0.0)), "write rows at fixed positions"),
    }
    loss, words = cases[name]
    texts, l_jit, l_pp = _warning_texts(loss)
    assert len(texts) == 1 and words in texts[0], texts
    assert not np.isclose(l_jit, l_pp, rtol=1e-5)


@pytest.mark.parametrize("name", ["a padding mask by concatenation", "a weight written into ones",
                                  "a mask written into zeros", "a row dropped by a pad", "a row weighted by an update"])
def test_weights_by_position_made_from_literals_are_warned(name):
    """Per-row weights or masks the loss makes from literals alone, as long as the batch (trial NOISE21, silent before;
    with ``jnp.arange`` they were warned): each microbatch makes its own, so a padding mask
    ``concatenate([ones(B - 4), zeros(4)])`` in microbatches of 4 is all zeros (NaN for jit's 2.1792), and
    ``ones(B).at[0].set(2)`` weights each microbatch's first example (2.5652 for 2.1491). Their values are known in
    both traces and compared with the whole batch's: warned, as numbers by position."""
    def ratio(w):  # a masked mean by the mask's own count
        return lambda p, b: (_nll(p, b).mean(1) * w(b["x"].shape[0])).sum() / w(b["x"].shape[0]).sum()

    cases = {
        "a padding mask by concatenation": ratio(lambda n: jnp.concatenate([jnp.ones(n - 4), jnp.zeros(4)])),
        "a weight written into ones": _nll_rows(lambda nll: nll * jnp.ones(nll.shape[0]).at[0].set(2.0)),
        "a mask written into zeros": _nll_rows(lambda nll: jnp.where(
            jnp.zeros(nll.shape[0], bool).at[:2].set(True), 0.0, nll)),
        "a row dropped by a pad": _nll_rows(lambda nll: nll * jnp.pad(jnp.ones(nll.shape[0] - 1), (1, 0))),
        "a row weighted by an update": _nll_rows(lambda nll: nll * jax.lax.dynamic_update_slice(
            jnp.ones(nll.shape[0]), jnp.array([3.0]), (0,))),
    }
    texts, l_jit, l_pp = _warning_texts(cases[name])
    assert len(texts) == 1 and "numbers its examples by their position" in texts[0], texts
    assert not np.isclose(l_jit, l_pp, rtol=1e-5)


def test_weights_the_same_in_each_microbatch_made_from_literals_run_silent():
    """Weights made from literals that repeat with each microbatch's rows (a weight per position within a pair,
    ``jnp.tile``; ones written everywhere), and a target written into a constant at each example's own row
    (``.at[jnp.arange(B), label]``, whose positions index, not weigh), are each microbatch's own: no warning, jit's
    values."""
    def paired(p, b):
        nll = _nll(p, b).mean(1)
        return (nll * jnp.tile(jnp.array([1.0, 0.5]), nll.shape[0] // 2)).mean()

    def uniform(p, b):
        nll = _nll(p, b).mean(1)
        return (nll * jnp.zeros(nll.shape[0]).at[:].set(2.0)).mean()

    def smoothed(p, b):  # label smoothing written into a constant by each example's position (trial NOISE22)
        n, label = b["x"].shape[0], b["x"][:, 0]
        target = jnp.full((n, V), 0.1 / V).at[jnp.arange(n), label].add(0.9)
        return -(target * jax.nn.log_softmax(_features(p, b) @ p["head"])).sum(-1).mean()

    for loss in (paired, uniform, smoothed):
        _assert_quiet_and_jit_s(_step(loss), what=loss.__name__)


def test_picks_that_straddle_microbatches_say_how():
    """Rows picked by computed positions that are not each microbatch's own (trial NOISE21): pairs a stride apart in
    microbatches of odd size are said as every k-th example, with the advice on num_microbatches, and a window of
    consecutive rows as a part by position (both were said as an order: a sort, a top-k, a scan ...)."""
    def strided(z):
        n = z.shape[0] // 2
        return ((z[jnp.arange(n) * 2] - z[jnp.arange(n) * 2 + 1]) ** 2).mean()

    def halves(z):
        n = z.shape[0] // 2
        return ((z[jnp.arange(n)] - z[jnp.arange(n) + n]) ** 2).mean()

    z = jax.random.normal(jax.random.key(0), (12, T))
    for fn, want in ((strided, "strides"), (halves, "parts")):
        mixing = []
        output_reductions(jax.make_jaxpr(fn)(z), jax.make_jaxpr(fn)(z[:3]), [True], 4, mixing)
        assert want in {e[0] for e in mixing} and "order" not in {e[0] for e in mixing}, (fn.__name__, mixing)


def test_pairs_interleaved_read_by_computed_positions_run_silent():
    """Anchors in the even rows and positives in the odd ones, read by positions computed from ``jnp.arange``
    (trial NOISE20: jit's values, 0.971383 both, with a warning that the loss orders its examples): each microbatch
    reads its own pairs, as ``e[::2]`` does. Silent, jit's values; a partner swap ``e[jnp.arange(B) ^ 1]`` too."""
    def strided(p, b):
        e = _features(p, b)
        n = e.shape[0] // 2
        return ((e[jnp.arange(n) * 2] - e[jnp.arange(n) * 2 + 1]) ** 2).sum(-1).mean()

    def taken(p, b):
        e = _features(p, b)
        return ((jnp.take(e, jnp.arange(0, e.shape[0], 2), 0) - jnp.take(e, jnp.arange(1, e.shape[0], 2), 0))
                ** 2).sum(-1).mean()

    def partners(p, b):
        e = _features(p, b)
        return (e * e[jnp.arange(e.shape[0]) ^ 1]).sum(-1).mean()

    for loss in (strided, taken, partners):
        _assert_quiet_and_jit_s(_step(loss), what=loss.__name__)


def test_a_host_function_per_example_by_a_sequential_vmap_is_read_as_per_example():
    """DETR's matching per image by a host solver, ``jax.pure_callback(..., vmap_method="sequential")`` under
    ``jax.vmap`` (trial DETECT): JAX loops over the examples by ``lax.scan``, which autopp's tracing unrolled (JAX's
    callback rule calls the scan its own module imports), so the whole batch's program and a microbatch's differed and
    a false warning said the loss looped over the batch axis (19.85756 both). The loop stays a scan over the
    examples: no warning, jit's values."""
    def nearest(cost):  # each example's best column, on the host
        return np.argmin(np.asarray(cost), -1).astype(np.int32)

    def per_example(h):
        cost = jnp.abs(h[:, None] - h[None, :] - 1.0)  # [H, H]
        pick = jax.pure_callback(nearest, jax.ShapeDtypeStruct((H,), jnp.int32), jax.lax.stop_gradient(cost),
                                 vmap_method="sequential")
        return jnp.abs(h[pick] - h).sum()

    def loss(p, b):
        return jax.vmap(per_example)(_features(p, b)).mean()

    _assert_quiet_and_jit_s(_step(loss))


def test_views_stacked_before_the_examples_are_named_as_such():
    """Two views stacked as one batch leaf ``[2, B, ...]`` and read as ``v[0]``, ``v[1]`` (trial NOISE19): autopp
    split the views into the microbatches, a loss of 0 for jit's 3.18, with a warning about a loop over the batch
    axis; so too through ``jax.vmap`` over the views (trial NOISE20). It now names the leaf read by position along
    axis 0, and its advice, the examples first (``v[:, 0]``), gives jit's values without a warning."""
    x = _batch(0)["x"]

    def distance(p, a, b):
        return ((_pair_logits(p, {"x": a, "y": a}) - _pair_logits(p, {"x": b, "y": b})) ** 2).mean()

    def stacked(p, b):
        return distance(p, b["views"][0], b["views"][1])

    def examples_first(p, b):
        return distance(p, b["views"][:, 0], b["views"][:, 1])

    def mapped(p, b):  # (the views through jax.vmap, then read by position)
        z = jax.vmap(lambda v: _pair_logits(p, {"x": v, "y": v}))(b["views"])
        return ((z[0] - z[1]) ** 2).mean()

    params = _params(jax.random.key(0))
    pair = (x, (x + 1) % V)
    for loss, views in ((stacked, jnp.stack(pair)), (mapped, jnp.stack(pair)), (examples_first, jnp.stack(pair, 1))):
        step = _step(loss)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            outs = [fn(params, TX.init(params), {"views": views}) for fn in (jax.jit(step), autopp.parallelize(
                step, num_stages=2, num_microbatches=2, devices=jax.devices()[:2]))]
        texts = [str(w.message) for w in seen if "autopp" in str(w.message)]
        if loss is not examples_first:
            assert len(texts) == 1 and "reads each row of args[1]['views'] int32[2,16,8]" in texts[0]
            assert "test_loss_reduction.py" in texts[0] and "[batch, 2, ...]" in texts[0], texts
            assert not np.isclose(float(outs[0][2]), float(outs[1][2]), rtol=1e-3)
        else:
            assert texts == []
            _assert_equal(outs[0], outs[1])


def test_a_solver_per_example_is_read_as_per_example():
    """Each example solving its own system with ``jax.scipy.sparse.linalg.cg`` under ``vmap`` (user trial META):
    JAX's solver passes its residuals and a scalar tolerance through one ``device_put``, which the walk read as
    combining the examples, and a per-example mean got the warning that its reduction could not be read. Each
    operand of a ``device_put`` is now its own value: no warning, jit's values."""
    def solved(p, b):
        a = p["w"] @ p["w"].T + jnp.eye(H)
        h = p["embed"][b["x"]].mean(1)
        sol = jax.vmap(lambda r: jax.scipy.sparse.linalg.cg(lambda v: a @ v, r, maxiter=20)[0])(h)
        return jnp.mean(jnp.sum((sol @ p["head"]) ** 2, -1))

    _assert_quiet_and_jit_s(_step(solved), prefix="autopp.parallelize")  # (the solver's loop is priced once: said)


@pytest.mark.parametrize("stages", [2, 1])
def test_per_example_aux_of_blocks_comes_back_in_jit_s_order(stages):
    """An aux whose leading axis holds several blocks of the examples came back in microbatch order (user trial
    NOISE3, silently): DPO's log-probabilities of ``[chosen; rejected]`` concatenated as ``[c0; r0; c1; r1 ...]``
    instead of ``[c; r]`` (off by up to 3.59), and a time-major per-token value ``[T * B]`` likewise. Both come back as
    jit's (one stage runs its microbatches in one program, several stages reduce them apart: both checked)."""
    def loss(p, b):
        rejected = jax.tree.map(lambda a: jnp.flip(a, -1) if a.ndim > 1 else a, b)
        both = jax.tree.map(lambda c, r: jnp.concatenate([c, r]), b, rejected)
        s = _pair_logits(p, both)
        per_token = _nll(p, b).swapaxes(0, 1).reshape(-1)  # [T * B], time-major
        chosen = s[:s.shape[0] // 2]
        views = jnp.concatenate([jnp.repeat(chosen, 2), chosen])  # blocks of unequal lengths: [2B] + [B]
        return _dpo(*jnp.split(s, 2)), {"logp": s, "tokens": per_token, "views": views}

    step = _step(loss, has_aux=True)
    params = _params(jax.random.key(0))
    want = jax.jit(step)(params, TX.init(params), _batch(0))
    got = autopp.parallelize(step, num_stages=stages, num_microbatches=M, devices=jax.devices()[:stages])(
        params, TX.init(params), _batch(0))
    assert got[-1][1]["logp"].shape == (2 * B,) and got[-1][1]["tokens"].shape == (T * B,)
    assert got[-1][1]["views"].shape == (3 * B,)
    _assert_equal(autopp.gather(got), want)


def test_pairs_grouped_by_reshape_in_odd_microbatches_are_refused_with_the_fix():
    """Interleaved pairs read as ``s.reshape(-1, 2)`` in microbatches of 3 examples cannot be traced; the refusal
    blamed only a batch leaf without a batch axis (user trial NOISE3). It names the grouping and the fix, with the
    counts that trace (trial NERF: patches of rays read as ``depth.reshape(-1, 4, 4)``), and the first of those runs
    as jit."""
    def paired(p, b):
        s = _pair_logits(p, b).reshape(-1, 2)
        return _dpo(s[:, 0], s[:, 1])

    step = _step(paired)
    params = _params(jax.random.key(0))
    batch = jax.tree.map(lambda a, b: jnp.concatenate([a, b[:8]]), _batch(0), _batch(1))  # 8 microbatches of 3
    jax.jit(step)(params, TX.init(params), batch)  # (jit runs it)
    with pytest.raises(ValueError, match=r"(?s)fails at microbatch size.*groups consecutive examples.*"
                                         r"choose num_microbatches so\. It traces at num_microbatches=6 or 4\.$"):
        autopp.parallelize(step, num_stages=2, num_microbatches=8, devices=jax.devices()[:2])(
            params, TX.init(params), batch)
    got = autopp.parallelize(step, num_stages=2, num_microbatches=6, devices=jax.devices()[:2])(
        params, TX.init(params), batch)
    _assert_equal(autopp.gather(got), jax.jit(step)(params, TX.init(params), batch))


@pytest.mark.parametrize("reduce", ["sum", "mean"])
def test_a_weight_read_through_stop_gradient_leaves_the_loss_readable(reduce):
    """A frozen table read as ``stop_gradient(p["embed"])[ids]`` (user trial RECSYS): the weight is frozen after the
    loss's program was made, and the microbatch's program, made later, kept its lookup in another order, so the two
    did not compare: a summed loss came back averaged (12.83 for jit's 51.31) with a warning about loops over the
    examples, and a mean got that warning too. Both are read as they are and equal jit, without a word."""
    def loss(p, b):
        h = jnp.tanh(jax.lax.stop_gradient(p["embed"])[b["x"]] @ p["w"])
        nll = -jnp.take_along_axis(jax.nn.log_softmax(h @ p["head"]), b["y"][..., None], axis=-1)
        return nll.sum() if reduce == "sum" else nll.mean()

    _assert_quiet_and_jit_s(_step(loss))


def test_negatives_picked_by_indices_from_the_batch_warn():
    """A BPR loss whose negative is another example's row, picked by indices passed with the batch (``v[negidx]``,
    user trial RECSYS): each microbatch's indices still counted the whole batch's positions, clamped onto its own
    rows (0.6988 for jit's 0.6856), silently. It warns; the same written with ``jnp.roll`` warned already."""
    def loss(p, b):
        e = p["embed"][b["x"]].mean(1) @ p["w"]
        return -jax.nn.log_sigmoid((e * (e[b["neg"]] - e)).sum(1)).mean()

    step = _step(loss)
    params = _params(jax.random.key(0))
    batch = {**_batch(0), "neg": (jnp.arange(B) + 5) % B}
    want = jax.jit(step)(params, TX.init(params), batch)
    with pytest.warns(UserWarning, match=r"other examples. rows by indices that come with the batch .*test_loss_red"):
        got = autopp.parallelize(step, num_stages=2, num_microbatches=M, devices=jax.devices()[:2])(
            params, TX.init(params), batch)
    assert not np.isclose(float(want[-1]), float(got[-1]), rtol=1e-5)


def test_convolutions_of_each_example_run_as_jit_without_a_word():
    """What the warnings on windows along the batch must not catch (user trial NOISE4): a kernel per example applied
    under ``jax.vmap`` (a hypernetwork: JAX's rule puts the examples into the feature groups, after a reshape that
    transposes), and ``jax.scipy.signal.convolve`` of [batch, time] with a kernel of size 1 along the batch."""
    def hyper(p, b):
        h = jnp.tanh(p["embed"][b["x"]] @ p["w"])  # [B, T, H]
        kernels = jnp.tanh(h.mean(1) @ p["w"])[:, None, :, None] * jnp.ones((1, 3, 1, 4))  # [B, 3, H, 4]
        conv = jax.vmap(lambda x, k: jax.lax.conv_general_dilated(
            x[None], k, (1,), "SAME", dimension_numbers=("NWC", "WIO", "NWC"))[0])
        return (conv(h, kernels) ** 2).mean()

    def smoothed(p, b):
        s = (jnp.tanh(p["embed"][b["x"]] @ p["w"]) ** 2).sum(-1)  # [B, T]
        return (jax.scipy.signal.convolve(s, jnp.ones((1, 3)) / 3, mode="same") ** 2).mean()

    for loss in (hyper, smoothed):
        _assert_quiet_and_jit_s(_step(loss), what=loss.__name__)


def test_multi_task_losses_combine_as_jit_or_warn_what_they_do():
    """Multi-task losses (user trial MULTITASK) and horizon weights (trial TIMESERIES):
    - per-task sums with a learned log-variance each (Kendall et al.), ``jnp.sum(exp(-s) * sums / n + s)``, counts
      from the step: ``s`` was counted once per microbatch under the sum it is read as (7.326 for jit's 6.726); it
      counts once and the step is jit's;
    - ``jnp.average`` with weights broadcast to the batch's shape warned that it divides by a sum over the examples
      (its denominator is the batch size times the weights): no warning, jit's;
    - per-task masked means weighted (``2 * ratio``, ``jnp.sum(w * jnp.stack(ratios))``) got the generic warning,
      whose ``loss_reduction='sum'`` then ran silently (34.85 for 7.95): the ratio warning, and 'sum' refused;
    - a value read off the first example (``b["temp"][0]``: 2.242 for jit's 3.272) ran silently: it warns."""
    s0 = jnp.array([0.1, -0.2])

    def uncertain(p, b, n):
        nll = _nll(p, b)
        sums = jnp.stack([nll[:, :T // 2].sum(), nll[:, T // 2:].sum()])
        return jnp.sum(jnp.exp(-p["s"]) * sums / n + p["s"])

    def averaged(p, b):
        e = _nll(p, b)
        return jnp.average(e, weights=jnp.broadcast_to(jnp.linspace(1.0, 2.0, T), e.shape))

    params = {**_params(jax.random.key(0)), "s": s0}
    for loss, extra in ((uncertain, lambda b: (b["x"].size,)), (averaged, lambda b: ())):
        step = _step(loss, extra)
        want = jax.jit(step)(params, TX.init(params), _batch(0))
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            got = autopp.parallelize(step, num_stages=2, num_microbatches=M, devices=jax.devices()[:2])(
                params, TX.init(params), _batch(0))
        assert not [str(w.message) for w in seen if "autopp" in str(w.message)], loss.__name__
        _assert_equal(autopp.gather(got), want)

    def ratio(p, b, t):
        nll, mask = _nll(p, b), b["mask"]
        return (nll[:, t] * mask[:, t]).sum() / jnp.maximum(mask[:, t].sum(), 1.0)

    def doubled(p, b):
        return 2.0 * ratio(p, b, 0)

    def stacked(p, b):
        return jnp.sum(jnp.array([1.0, 0.5]) * jnp.stack([ratio(p, b, 0), ratio(p, b, 1)]))

    def first(p, b):
        return (_nll(p, b) / b["temp"][0]).mean()

    def first_after(p, b):  # the reduced loss scaled by it (trial NOISE5: silent)
        return _nll(p, b).mean() / b["temp"][:2].mean()

    for loss, words in ((doubled, "divides a sum over its examples by another"), (stacked, "divides a sum over its "
                        "examples by another"), (first, "reads some examples' values for all of them"),
                        (first_after, "reads some examples' values for all of them")):
        texts, l_jit, l_pp = _warning_texts(loss)
        assert any(words in t for t in texts), (loss.__name__, texts)
        if loss not in (first, first_after):
            plain = _params(jax.random.key(0))
            with pytest.raises(ValueError, match="loss_reduction='sum', but the loss divides a sum"):
                autopp.parallelize(_step(loss), num_stages=2, num_microbatches=M, devices=jax.devices()[:2],
                                   loss_reduction="sum")(plain, TX.init(plain), _batch(0))


def test_a_chunked_cross_entropy_summed_in_a_checkpointed_scan_carry_is_a_sum():
    """Cross-entropy over the flattened tokens in chunks of a fixed size, each chunk's sum added into a
    ``lax.scan`` carry under ``jax.checkpoint`` and divided by a token count from the step (a production form, user
    trial LMLOSS): refused as unreadable, though the same with ``lax.map`` ran. The addition is followed into the
    checkpointed body: a sum, equal to jit without a word."""
    def loss(p, b, n):
        h = jnp.tanh(p["embed"][b["x"]] @ p["w"]).reshape(-1, 8, H)

        def chunk(total, part):
            hh, yy, mm = part
            logits = hh @ p["head"]
            nll = jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, yy[:, None], -1)[:, 0]
            return total + jnp.sum(nll * mm), None

        total, _ = jax.lax.scan(jax.checkpoint(chunk), jnp.float32(0), (h, b["y"].reshape(-1, 8),
                                                                         b["mask"].reshape(-1, 8)))
        return total / n

    _assert_quiet_and_jit_s(_step(loss, lambda b: (b["mask"].sum(),)))


def _kl(params):  # a term of the parameters alone (a KL to the prior, a log-prior)
    return 0.5 * jnp.sum(params["w"] ** 2) + 0.1 * jnp.sum(jnp.abs(params["head"]))


_PER_DATAPOINT = {  # user trial BAYES: KL / log-prior terms the batch's size scales
    "(nll.sum() + kl) / B": lambda p, b: (_nll(p, b).mean(1).sum() + _kl(p)) / b["x"].shape[0],
    "(nll.sum() + kl) / len(x)": lambda p, b: (_nll(p, b).mean(1).sum() + _kl(p)) / len(b["x"]),
    "-(loglik.sum() + logprior) / B": lambda p, b: -(-_nll(p, b).mean(1).sum() - _kl(p)) / b["x"].shape[0],
    "nll.mean() + kl / B": lambda p, b: _nll(p, b).mean() + _kl(p) / b["x"].shape[0],
    "jnp.mean(nll + kl / B)": lambda p, b: jnp.mean(_nll(p, b).mean(1) + _kl(p) / b["x"].shape[0]),
    "nll.mean() + kl / (N / B)": lambda p, b: _nll(p, b).mean() + _kl(p) / (1000.0 / b["x"].shape[0]),
    "nll.mean() + kl / N": lambda p, b: _nll(p, b).mean() + _kl(p) / 1000.0,  # (no size: unchanged)
    "aux (nll.sum() + kl) / B": lambda p, b: (_nll(p, b).mean(), (_nll(p, b).mean(1).sum() + _kl(p)) / len(b["x"])),
}


@pytest.mark.parametrize("name", list(_PER_DATAPOINT))
def test_a_term_the_batch_size_scales_counts_once_as_under_jit(name):
    """A term of the parameters alone added to the examples' sum before dividing by the batch size (the per-datapoint
    ELBO, ``(nll.sum() + kl) / B``, and MAP's log-prior) was counted once per microbatch, silently: the trial's loss
    84.50 for jit's 22.81 at 4 microbatches; ``nll.mean() + kl / B`` warned that the loss did not show a mean or a
    sum, and ``loss_reduction="mean"`` did not help; ``jnp.mean(nll + kl / B)`` warned of "a custom kernel". Each
    such term is scaled by its value at the whole batch over a microbatch's, so it counts as jit counts it, in the
    loss, the gradients and an aux value alike, without a word."""
    fn = _PER_DATAPOINT[name]
    has_aux = name.startswith("aux")

    def step(params, opt_state, batch):
        out, grads = autopp.value_and_grad(fn, has_aux=has_aux)(params, batch)
        updates, opt_state = TX.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, out

    params = _params(jax.random.key(0))
    want = jax.jit(step)(params, TX.init(params), _batch(0))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        got = autopp.parallelize(step, num_stages=2, num_microbatches=M, devices=jax.devices()[:2])(
            params, TX.init(params), _batch(0))
    assert not [str(w.message) for w in seen if "autopp" in str(w.message)]
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves((autopp.gather(got[0]), *got[1:]))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("form", ["switch", "where"])
def test_a_loss_that_is_a_mean_or_a_sum_by_a_flag_is_refused_with_the_fix(form):
    """One task a step, picked by an id the step is given (trial SHARE2): a token sum over the step's count, or a mean
    over the examples. No reduction is right for both: "sum" gave 4x jit's mean (4.46557 for 1.11639) and "mean"
    1/4 of its sum, silently. Refused whatever is given, naming the line; the fix (the mean as a sum over a count the
    step passes, then "sum") gives jit's values for either task."""
    def make(fixed):
        def loss(p, b, n, n_ex, task):
            nll = _nll(p, b)
            summed = lambda: (nll * b["mask"]).sum() / n  # noqa: E731
            mean = (lambda: nll.sum(1).sum() / n_ex) if fixed else (lambda: nll.sum(1).mean())  # noqa: E731
            if form == "switch":
                return jax.lax.switch(task, [summed, mean])
            return jnp.where(task == 0, summed(), mean())

        def step(params, opt_state, batch, task):
            value, grads = autopp.value_and_grad(loss)(params, batch, batch["mask"].sum(), batch["x"].shape[0], task)
            updates, opt_state = TX.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, value
        return step

    params = _params(jax.random.key(0))
    for given in (None, "sum", "mean"):
        with pytest.raises(ValueError, match=r"test_loss_reduction.* is a mean over its examples or a sum over them "
                                             r"by a value it reads at run time.*loss_reduction='sum'"):
            autopp.parallelize(make(False), num_stages=2, num_microbatches=M, devices=jax.devices()[:2],
                               loss_reduction=given, batch_argnums=(2,))(params, TX.init(params), _batch(0), jnp.int32(1))
    piped = autopp.parallelize(make(True), num_stages=2, num_microbatches=M, devices=jax.devices()[:2],
                               loss_reduction="sum", batch_argnums=(2,))
    for task in (0, 1):
        want = jax.jit(make(True))(params, TX.init(params), _batch(0), jnp.int32(task))
        got = piped(params, TX.init(params), _batch(0), jnp.int32(task))
        _assert_equal((want[0], want[2]), (autopp.gather(got[0]), got[2]))


@pytest.mark.parametrize("summed", [True, False], ids=["sum", "mean"])
def test_a_weakly_typed_scalar_weight_beside_a_penalty_is_read_as_the_loss_is(summed):
    """A learned scale made by ``jnp.array(0.0)`` (weakly typed) added to a Gaussian NLL and a weight penalty (trial
    STATS): the loss retraced at microbatch size took the scale strongly typed, so its program differed from the whole
    batch's ("loops over the batch axis or branches on its size", falsely), and a summed NLL was averaged: 38.58 for
    jit's 58.41. Now read as the sum (or mean) it is: jit's values, without a word."""
    def loss(p, b):
        nll = 0.5 * (_nll(p, b) / jnp.exp(p["log_sigma"])) ** 2 + p["log_sigma"]
        data = nll.sum() if summed else nll.mean()
        return data + p["log_sigma"] + 1e-3 * jnp.sum(p["w"] ** 2)

    params = {**_params(jax.random.key(0)), "log_sigma": jnp.array(0.0)}
    assert params["log_sigma"].weak_type
    step = _step(loss)
    want = jax.jit(step)(params, TX.init(params), _batch(0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = autopp.parallelize(step, num_stages=2, num_microbatches=M, devices=jax.devices()[:2])(
            params, TX.init(params), _batch(0))
    _assert_equal((want[0], want[2]), (autopp.gather(got[0]), got[2]))


def test_a_sum_over_a_function_of_the_microbatch_s_count_is_said_under_sum_too():
    """A token sum over the square root of the microbatch's own count (trial SHARE2): the default warning advised
    "sum" (61.32 for jit's 31.12, silently, when followed). The warning now says no reduction is jit's and gives the
    fix (the count from the step), which gives jit's values; "sum" given warns."""
    inside = _step(lambda p, b: (_nll(p, b) * b["mask"]).sum() / jnp.sqrt(b["mask"].sum()))
    with pytest.warns(UserWarning, match=r"No reduction of the microbatches' losses is jit's.*mask.sum\(\) in the "
                                         r"step") as rec:
        _run(inside)
    assert not any("Pass loss_reduction='sum'" in str(w.message) for w in rec)
    with pytest.warns(UserWarning, match=r"loss_reduction='sum' is given, but at .*test_loss_reduction"):
        _run(inside, loss_reduction="sum")
    passed = _step(lambda p, b, n: (_nll(p, b) * b["mask"]).sum() / jnp.sqrt(n), lambda b: (b["mask"].sum(),))
    (p_jit, l_jit), (p_pp, l_pp) = _run(passed, loss_reduction="sum")
    _assert_equal((p_jit, l_jit), (p_pp, l_pp))


def test_a_ratio_beside_a_mean_is_told_both_terms_in_one_round():
    """ESMM's masked CVR ratio beside its CTR mean (trial REC): the ratio warning's advice (the count from the step)
    was then refused until the mean too was written over a count, which the first warning did not say. It says so,
    and the advice followed whole gives jit's values."""
    ratio = _step(lambda p, b: _nll(p, b).mean() + (_nll(p, b) * b["mask"]).sum() / b["mask"].sum())
    with pytest.warns(UserWarning, match=r"(?s)divides a sum over its examples by another.*also adds a mean over its "
                                         r"examples to the ratio.*x.shape\[0\] in the step"):
        _run(ratio)
    both = _step(lambda p, b, n_ex, n: _nll(p, b).sum() / n_ex + (_nll(p, b) * b["mask"]).sum() / n,
                 lambda b: (b["x"].size, b["mask"].sum()))
    (p_jit, l_jit), (p_pp, l_pp) = _run(both, loss_reduction="sum")
    _assert_equal((p_jit, l_jit), (p_pp, l_pp))


def test_a_function_of_a_mean_of_the_model_s_errors_is_told_one_microbatch():
    """An RMSE, ``sqrt(mse.mean())`` (trial GRAPHT): the warning's fix was to compute that mean in the step, which a
    mean of the model's errors cannot be. It names one microbatch, which gives jit's values."""
    rmse = _step(lambda p, b: jnp.sqrt((_nll(p, b) ** 2).mean()))
    with pytest.warns(UserWarning, match=r"use num_microbatches=1 .*depends on the parameters") as rec:
        _run(rmse)
    assert not any("compute that sum or mean in the step" in str(w.message) for w in rec)
    params = _params(jax.random.key(0))
    want = jax.jit(rmse)(params, TX.init(params), _batch(0))
    got = autopp.parallelize(rmse, num_stages=2, num_microbatches=1, devices=jax.devices()[:2])(
        params, TX.init(params), _batch(0))
    _assert_equal((want[0], want[2]), (autopp.gather(got[0]), got[2]))

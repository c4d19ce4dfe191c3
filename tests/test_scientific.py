"""Scientific-ML training steps from a user trial: a neural ODE through ``jax.experimental.ode.odeint``, a
physics-informed network whose interior and boundary points are batches of different sizes, sparse matrices, and a
step that draws its points from a key. The truth is plain ``jax.jit`` of the same step (SGD, <= 1e-6)."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import autopp
from autopp.profiler import profile
from tests._helpers import assert_trees_close

TX = optax.sgd(0.01)


def _sgd_step(loss):
    def step(p, o, *batch):
        value, grads = autopp.value_and_grad(loss)(p, *batch)
        updates, o = TX.update(grads, o, p)
        return optax.apply_updates(p, updates), o, value
    return step


def _mlp(key, sizes):
    keys = jax.random.split(key, len(sizes) - 1)
    return [{"w": jax.random.normal(k, (a, b)) / np.sqrt(a), "b": jnp.zeros(b)}
            for k, a, b in zip(keys, sizes[:-1], sizes[1:])]


def _net(p, x):
    for layer in p[:-1]:
        x = jnp.tanh(x @ layer["w"] + layer["b"])
    return x @ p[-1]["w"] + p[-1]["b"]


@pytest.mark.filterwarnings("ignore:autopp cost model. lax.while_loop trip counts")  # (odeint's loop: said once)
def test_a_custom_vjp_backward_indexing_a_constant_of_the_loss_runs_on_one_stage():
    """``odeint``'s backward indexes the time grid with a traced index (``ts[i]`` in a loop). A grid the loss makes
    (``jnp.array([0., 1.])``) reached it as a NumPy array when autopp evaluated the loss's program, and the step failed
    with ``TracerArrayConversionError`` on one stage and while profiling (jit runs it); its constants are JAX arrays
    now. The minimal form (a custom_vjp whose backward does ``ts[i]`` in a fori_loop) equals jit on one and two
    stages, and an ODE trained through ``odeint`` on one stage equals jit."""
    @jax.custom_vjp
    def scale(x, ts):
        return x * ts[-1]

    def scale_fwd(x, ts):
        return scale(x, ts), ts

    def scale_bwd(ts, g):
        s = jax.lax.fori_loop(0, ts.shape[0], lambda i, a: a + 0 * ts[i], ts[-1])
        return g * s, jnp.zeros_like(ts)

    scale.defvjp(scale_fwd, scale_bwd)
    p = _mlp(jax.random.key(0), [8, 16, 8])

    def loss(p, batch):
        x, y = batch
        h = scale(jnp.tanh(x @ p[0]["w"]), jnp.array([0.5, 2.0]))  # a constant made in the loss
        return jnp.mean((h @ p[1]["w"] - y) ** 2)

    batch = (jax.random.normal(jax.random.key(1), (8, 8)), jax.random.normal(jax.random.key(2), (8, 8)))
    step = _sgd_step(loss)
    want = jax.jit(step)(p, TX.init(p), batch)
    for stages in (1, 2):
        got = autopp.parallelize(step, num_stages=stages, num_microbatches=2,
                                 devices=jax.devices()[:stages])(p, TX.init(p), batch)
        assert_trees_close(autopp.gather(got[0]), want[0], rtol=1e-6, atol=1e-6)

    from jax.experimental.ode import odeint

    q = _mlp(jax.random.key(3), [4, 16, 4])

    def ode_loss(q, batch):
        x0, y = batch
        ys = odeint(lambda x, t, q: _net(q, x), x0, jnp.array([0.0, 1.0]), q, rtol=1e-6, atol=1e-6)
        return jnp.mean((ys[-1] - y) ** 2)

    ode_batch = (jax.random.normal(jax.random.key(4), (8, 4)), jax.random.normal(jax.random.key(5), (8, 4)))
    step = _sgd_step(ode_loss)
    want = jax.jit(step)(q, TX.init(q), ode_batch)
    got = autopp.parallelize(step, num_stages=1, num_microbatches=1, devices=jax.devices()[:1])(q, TX.init(q),
                                                                                                  ode_batch)
    assert_trees_close(got[0], want[0], rtol=1e-5, atol=1e-6)
    prof = profile(step, q, TX.init(q), ode_batch)  # (failed the same way while costing the layers)
    assert prof.total_flops > 0


def _pinn():
    p = _mlp(jax.random.key(0), [2, 16, 16, 1])

    def u(p, x):
        return _net(p, x[None])[0, 0]

    def loss(p, interior, boundary):
        lap = jax.vmap(lambda x: jnp.trace(jax.hessian(u, argnums=1)(p, x)))(interior)
        residual = lap - jnp.sin(interior[:, 0])
        edge = jax.vmap(lambda x: u(p, x))(boundary)
        return jnp.mean(residual ** 2) + jnp.mean(edge ** 2)

    interior = jax.random.uniform(jax.random.key(1), (32, 2))
    boundary = jax.random.uniform(jax.random.key(2), (16, 2)).at[:, 0].set(0.0)
    return p, loss, interior, boundary


def test_a_pinn_with_interior_and_boundary_batches_of_different_sizes_is_planned():
    """32 interior and 16 boundary points: explicit microbatch counts split both alike, but a planned step was refused
    ("batch leaves have different leading dimensions": the profile had no batch size to scale costs from). The plan
    counts the batch in units that split every leaf alike (gcd: 16 units of 2 interior and 1 boundary point), as the
    runtime splits it; the planned step equals jit."""
    p, loss, interior, boundary = _pinn()
    step = _sgd_step(loss)
    want = jax.jit(step)(p, TX.init(p), interior, boundary)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        planned = autopp.parallelize(step, devices=jax.devices()[:2], batch_argnums=(2, 3))
        got = planned(p, TX.init(p), interior, boundary)
    assert_trees_close(autopp.gather(got[0]), want[0], rtol=1e-6, atol=1e-6)
    num_microbatches = planned.plan_for(p, TX.init(p), interior, boundary).num_microbatches
    assert 16 % num_microbatches == 0
    # (the leaves are split alike only where there is more than one microbatch: then the warning says how)
    assert any("different leading dimensions" in str(w.message) for w in seen) == (num_microbatches > 1)


@pytest.mark.parametrize("n_batch", [1, 0])
def test_a_sparse_batch_is_refused_with_the_reason_and_runs_whole(n_batch):
    """A BCOO feature batch split into microbatches failed inside JAX ("indices batch dimensions not compatible",
    blamed on a leaf without a batch axis): a sparse array's shape is static metadata its leaves do not carry. The
    refusal names the sparse array and the fixes; with one microbatch the step equals jit, without the warning about
    leaves of different lengths (nothing is split). Without a batch dimension (``n_batch=0``: data and indices have a
    row per stored entry, an odd number here) it was refused as a batch of odd size, "e.g. 1" (user trial CTRL)."""
    from jax.experimental import sparse

    p = _mlp(jax.random.key(0), [8, 8, 1])
    dense = jnp.where(jax.random.uniform(jax.random.key(1), (16, 8)) < 0.3, 1.0, 0.0).at[0, 0].set(1.0)
    x = sparse.BCOO.fromdense(dense, n_batch=n_batch, nse=int((dense != 0).sum()) | 1)
    y = jax.random.normal(jax.random.key(2), (16, 1))

    def loss(p, batch):
        x, y = batch
        h = jnp.tanh(x @ p[0]["w"] + p[0]["b"])
        return jnp.mean((h @ p[1]["w"] - y) ** 2)

    step = _sgd_step(loss)
    with pytest.raises(ValueError, match=r"(?s)batch holds a sparse array \(a BCOO in args\[2\]\).*todense"):
        autopp.parallelize(step, num_stages=2, num_microbatches=2, devices=jax.devices()[:2])(p, TX.init(p), (x, y))
    want = jax.jit(step)(p, TX.init(p), (x, y))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        got = autopp.parallelize(step, num_stages=2, num_microbatches=1, devices=jax.devices()[:2])(p, TX.init(p),
                                                                                                     (x, y))
    assert not [str(w.message) for w in seen if "leading dimensions" in str(w.message)]
    assert_trees_close(autopp.gather(got[0]), want[0], rtol=1e-6, atol=1e-6)


def test_a_sparse_batch_whose_entries_divide_is_refused_too():
    """A BCOO batch of ratings (an AutoRec recommender, user trial SPARSE) whose stored entries divide into the
    microbatches was split along them, each microbatch keeping the whole (users, items) shape: each trained on a
    quarter of the ratings (loss 18.70 for jit's 67.12; silent with ``loss_reduction="mean"``). It is refused as a
    sparse batch whatever the reduction, and left to the defaults the step runs it as one microbatch, as jit."""
    from jax.experimental import sparse

    dense = jnp.where(jax.random.uniform(jax.random.key(1), (16, 12)) < 0.3, 1.0 + jnp.arange(12.0), 0.0)
    ratings = {"r": sparse.BCOO.fromdense(dense, nse=64)}
    p = _mlp(jax.random.key(0), [12, 8, 12])

    def loss(p, batch):
        x = batch["r"].todense()
        return jnp.sum((x != 0) * (_net(p, x) - x) ** 2) / x.shape[0]

    step = _sgd_step(loss)
    for given in ({}, {"loss_reduction": "mean"}):
        with pytest.raises(ValueError, match=r"(?s)batch holds a sparse array \(a BCOO in args\[2\]\['r'\]\).*"
                                             r"batch_argnums"):
            autopp.parallelize(step, num_stages=2, num_microbatches=4, devices=jax.devices()[:2], **given)(
                p, TX.init(p), ratings)
    want = jax.jit(step)(p, TX.init(p), ratings)
    defaults = autopp.parallelize(step, num_stages=2, devices=jax.devices()[:2])
    got = defaults(p, TX.init(p), ratings)
    assert defaults.plan_for(p, TX.init(p), ratings).num_microbatches == 1
    assert_trees_close(autopp.gather(got[0]), want[0], rtol=1e-6, atol=1e-6)


def test_a_fixed_adjacency_in_the_batch_does_not_count_as_examples():
    """A fixed BCOO adjacency kept in the batch dict beside 8 examples (trial NOISE18): its 65 stored entries were
    counted with the examples, so the planned step took a batch of gcd(8, 65) = 1 and left 3 of 4 devices idle, and
    2 data-parallel devices were said to repeat "microbatches of 65 example(s)". The batch size is the examples'; the
    step runs as jit without a word, and the refusal at more microbatches names the array's key."""
    from jax.experimental import sparse

    adj = sparse.BCOO.fromdense(jnp.eye(6) + jnp.eye(6, k=1), nse=65)
    p = _mlp(jax.random.key(0), [3, 8, 1])

    def loss(p, b):
        h = jax.vmap(lambda x: adj_of(b) @ x)(b["x"])
        return jnp.mean((_net(p, h)[..., 0] - b["y"]) ** 2)

    def adj_of(b):
        return b["adj"]

    batch = {"x": jax.random.normal(jax.random.key(1), (8, 6, 3)), "y": jax.random.normal(jax.random.key(2), (8, 6)),
             "adj": adj}
    step = _sgd_step(loss)
    want = jax.jit(step)(p, TX.init(p), batch)
    for kw in ({}, {"num_stages": 2, "num_microbatches": 1}):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            pipelined = autopp.parallelize(step, devices=jax.devices()[:4], **kw)
            got = pipelined(p, TX.init(p), batch)
        assert not [str(w.message) for w in seen if "autopp" in str(w.message)], kw
        assert_trees_close(autopp.gather(got[0]), want[0], rtol=1e-6, atol=1e-6)
    plan = autopp.parallelize(step, devices=jax.devices()[:4]).plan_for(p, TX.init(p), batch)
    assert sum(len(stage.devices) for stage in plan.stages) == 4  # (none idle)
    with pytest.raises(ValueError, match=r"a BCOO in args\[2\]\['adj'\]"):
        autopp.parallelize(step, num_stages=2, num_microbatches=2, devices=jax.devices()[:2])(p, TX.init(p), batch)


def test_a_step_that_draws_its_points_from_a_key_is_told_how_to_pass_them():
    """A PINN drawing all its points in the step from a key was refused twice in a circle: the key as the batch
    ("a scalar has no batch dimension ... set batch_argnums"), then ``batch_argnums=()`` ("pass the batch's position
    (by default the last argument, 2)", the key again). Both now say to draw the points before the step."""
    p, loss, _, _ = _pinn()

    def step(p, o, key):
        interior = jax.random.uniform(key, (32, 2))
        value, grads = autopp.value_and_grad(loss)(p, interior, interior[:16])
        updates, o = TX.update(grads, o, p)
        return optax.apply_updates(p, updates), o, value

    with pytest.raises(TypeError, match="PRNG key has no batch dimension .*draw them before the step"):
        autopp.parallelize(step, num_stages=2, devices=jax.devices()[:2])(p, TX.init(p), jax.random.key(7))
    with pytest.raises(ValueError, match=r"batch_argnums=\(\) names no batch argument.*draw them before the step"):
        autopp.parallelize(step, num_stages=2, devices=jax.devices()[:2], batch_argnums=())(
            p, TX.init(p), jax.random.key(7))

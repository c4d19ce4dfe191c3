"""Models as written: Flax NNX, Flax Linen, Equinox and scan-over-layers steps train under parallelize (>= 2
stages, 1F1B) exactly like under plain jax.jit, and a scan over layers is split across stages by iteration."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import autopp
from autopp.core._trace import trace_step
from autopp.profiler import split_at, split_stages
from _helpers import assert_trees_close, make_optimizer, run_steps

HIDDEN, BATCH = 16, 16


def _data(din=8, dout=4):
    x = jax.random.normal(jax.random.key(1), (BATCH, din))
    y = jax.random.normal(jax.random.key(2), (BATCH, dout))
    return x, y


def _mse(pred, y):
    return jnp.mean((pred - y) ** 2)


def _step_for(loss_fn, tx):
    def train_step(params, opt_state, batch):
        loss, grads = autopp.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return jax.tree.map(lambda p, u: p + u, params, updates), opt_state, loss

    return train_step


def _assert_trains_like_jit(loss_fn, params, batch, num_stages, num_microbatches=4):
    """3 steps under parallelize (1F1B) equal 3 steps of plain jax.jit (fp32, rtol 1e-5); returns the
    pipeline's traced step and stage split."""
    tx = make_optimizer()
    step = _step_for(loss_fn, tx)
    state = (params, tx.init(params))
    expected, expected_losses = run_steps(jax.jit(step), state, batch)
    piped = autopp.parallelize(step, num_stages=num_stages, num_microbatches=num_microbatches, schedule="1f1b",
                               devices=jax.devices()[:num_stages])
    actual, losses = run_steps(piped, state, batch)
    assert_trees_close(losses, expected_losses)
    assert_trees_close(actual, expected)
    traced, plan, forward = piped._lookup((*state, batch))[0][:3]  # built by the first step: cached
    # the split the runtime builds: the stages start at the plan's first equations
    return traced, split_at(forward, traced.microbatched_grad_inputs, [st.equations[0] for st in plan.stages])


def _stage_iterations(traced, split, stacked_shape):
    """Per stage, the scan iterations whose slice of a stacked parameter (shape ``stacked_shape``) it reads.

    autopp traces the loss with the scan unrolled: iteration k reads ``stacked[k]`` (a slice equation), and
    parameter-only equations are placed in exactly the stages that use them.
    """
    fwd = traced.spec.forward.jaxpr
    stacked = {v for v in fwd.invars if v.aval.shape == stacked_shape}
    assert stacked
    return [sorted({fwd.eqns[i].params["start_indices"][0] for i in ids
                    if fwd.eqns[i].primitive.name == "slice" and fwd.eqns[i].invars[0] in stacked})
            for ids in split.stage_eqns]


def _assert_split_by_iteration(ranges, length):
    """Stages hold contiguous, ordered iteration ranges covering every iteration; >= 2 stages hold some (a range
    may share its first iteration with the previous stage's last when a cut falls inside an iteration)."""
    nonempty = [r for r in ranges if r]
    assert len(nonempty) >= 2, ranges
    for r in nonempty:
        assert r == list(range(r[0], r[-1] + 1)), ranges
    for a, b in zip(nonempty, nonempty[1:]):
        assert b[0] in (a[-1], a[-1] + 1), ranges
    assert sorted({k for r in nonempty for k in r}) == list(range(length)), ranges


# ---------------------------------------------------------------- Flax NNX


def test_flax_nnx():
    nnx = pytest.importorskip("flax.nnx")

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.inp = nnx.Linear(8, HIDDEN, rngs=rngs)
            self.blocks = nnx.List([nnx.Linear(HIDDEN, HIDDEN, rngs=rngs) for _ in range(3)])
            self.norm = nnx.LayerNorm(HIDDEN, rngs=rngs)
            self.out = nnx.Linear(HIDDEN, 4, rngs=rngs)

        def __call__(self, x):
            x = nnx.relu(self.inp(x))
            for block in self.blocks:
                x = x + nnx.gelu(block(x))
            return self.out(self.norm(x))

    graphdef, state = nnx.split(Model(nnx.Rngs(0)))

    def loss_fn(state, batch):
        x, y = batch
        return _mse(nnx.merge(graphdef, state)(x), y)

    _assert_trains_like_jit(loss_fn, state, _data(), num_stages=2)


def test_an_nnx_state_with_a_non_array_variable_is_refused_with_a_filtered_split_that_trains():
    """A module holding a non-array variable (a run name): its whole state is refused naming the leaf, and the split
    the message suggests (the parameters off with a filter, the rest closed over) trains as jit does."""
    nnx = pytest.importorskip("flax.nnx")

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.inp, self.out = nnx.Linear(8, HIDDEN, rngs=rngs), nnx.Linear(HIDDEN, 4, rngs=rngs)
            self.run_name = nnx.Variable("tiny")

        def __call__(self, x):
            return self.out(nnx.relu(self.inp(x)))

    model = Model(nnx.Rngs(0))
    _, whole = nnx.split(model)
    with pytest.raises(TypeError, match=r"(?s)run_name.*nnx.split\(model, nnx.Param, \.\.\.\)"):
        autopp.parallelize(lambda s, b: s, num_stages=1)(whole, _data())
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss_fn(p, batch):
        x, y = batch
        return _mse(nnx.merge(graphdef, p, rest)(x), y)

    _assert_trains_like_jit(loss_fn, params, _data(), num_stages=2)


def test_gathered_state_is_an_ordinary_module_after_training():
    """The trained state comes back on its stages' devices (two device sets here, which jit and eager code refuse to
    mix); autopp.gather puts it on one device, or on a sharding, and the merged module evaluates as jit's does."""
    nnx = pytest.importorskip("flax.nnx")
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    graphdef, state = nnx.split(nnx.Sequential(nnx.Linear(8, HIDDEN, rngs=nnx.Rngs(0)), nnx.relu,
                                               nnx.Linear(HIDDEN, 4, rngs=nnx.Rngs(1))))

    def loss_fn(state, batch):
        x, y = batch
        return _mse(nnx.merge(graphdef, state)(x), y)

    tx, batch = optax.sgd(0.1), _data()
    step = _step_for(loss_fn, tx)
    expected, _ = run_steps(jax.jit(step), (state, tx.init(state)), batch)
    got, _ = run_steps(autopp.parallelize(step, num_stages=2, num_microbatches=4, devices=jax.devices()[:2]),
                       (state, tx.init(state)), batch)
    assert len({frozenset(x.sharding.device_set) for x in jax.tree.leaves(got[0])}) == 2
    evaluate = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x))
    want = evaluate(expected[0], batch[0])
    gathered = autopp.gather(got[0])
    assert all(x.sharding.device_set == {jax.devices()[0]} for x in jax.tree.leaves(gathered))
    np.testing.assert_allclose(evaluate(gathered, batch[0]), want, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(nnx.merge(graphdef, gathered)(batch[0]), want, rtol=1e-6, atol=1e-6)  # eager
    replicated = NamedSharding(Mesh(np.array(jax.devices()[:4]), ("d",)), PartitionSpec())
    on_four = autopp.gather((got[0], "a label"), replicated)
    assert on_four[1] == "a label" and all(x.sharding == replicated for x in jax.tree.leaves(on_four[0]))
    with pytest.raises(TypeError, match="device must be a jax.Device or a jax.sharding.Sharding, got int"):
        autopp.gather(got[0], 0)


def test_flax_nnx_scan_over_layers():
    nnx = pytest.importorskip("flax.nnx")
    layers = 4

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.norm = nnx.LayerNorm(HIDDEN, rngs=rngs)
            self.lin = nnx.Linear(HIDDEN, HIDDEN, rngs=rngs)

        def __call__(self, x):
            return x + nnx.gelu(self.lin(self.norm(x)))

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.inp = nnx.Linear(8, HIDDEN, rngs=rngs)

            @nnx.split_rngs(splits=layers)
            @nnx.vmap(in_axes=(0,), out_axes=0)
            def make_blocks(rngs):
                return Block(rngs)

            self.blocks = make_blocks(rngs)
            self.out = nnx.Linear(HIDDEN, 4, rngs=rngs)

        def __call__(self, x):
            @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
            def apply_blocks(x, block):
                return block(x)

            return self.out(apply_blocks(self.inp(x), self.blocks))

    graphdef, state = nnx.split(Model(nnx.Rngs(0)))

    def loss_fn(state, batch):
        x, y = batch
        return _mse(nnx.merge(graphdef, state)(x), y)

    built = _assert_trains_like_jit(loss_fn, state, _data(), num_stages=2)
    _assert_split_by_iteration(_stage_iterations(*built, (layers, HIDDEN, HIDDEN)), layers)


# ---------------------------------------------------------------- Flax Linen


def _linen_model(layers: int):
    """MaxText's layout: Dense layers around rematerialised blocks scanned over stacked parameters."""
    nn = pytest.importorskip("flax.linen")

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x, _):
            y = nn.Dense(2 * HIDDEN)(nn.LayerNorm()(x))
            return x + nn.Dense(HIDDEN)(nn.gelu(y)), None

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            blocks = nn.scan(nn.remat(Block), variable_axes={"params": 0}, split_rngs={"params": True},
                             length=layers)
            x, _ = blocks()(nn.Dense(HIDDEN)(x), None)
            return nn.Dense(4)(x)

    return Model()


def test_flax_linen_nn_scan():
    # model.apply as written; a Linen model without nn.scan takes the same path minus the scan.
    layers = 4
    model = _linen_model(layers)
    x, y = _data()
    params = model.init(jax.random.key(0), x)

    def loss_fn(params, batch):
        x, y = batch
        return _mse(model.apply(params, x), y)

    built = _assert_trains_like_jit(loss_fn, params, (x, y), num_stages=2)
    stacked = (layers, HIDDEN, 2 * HIDDEN)
    assert stacked in [a.shape for a in jax.tree.leaves(params)]
    _assert_split_by_iteration(_stage_iterations(*built, stacked), layers)


# ---------------------------------------------------------------- Equinox


def test_equinox():
    eqx = pytest.importorskip("equinox")

    class Model(eqx.Module):
        norm: eqx.nn.LayerNorm
        mlp: eqx.nn.MLP  # holds its activation functions as (non-array) leaves
        out: eqx.nn.Linear

        def __init__(self, key):
            k1, k2 = jax.random.split(key)
            self.norm = eqx.nn.LayerNorm(8)
            self.mlp = eqx.nn.MLP(8, HIDDEN, HIDDEN, depth=3, activation=jax.nn.gelu, key=k1)
            self.out = eqx.nn.Linear(HIDDEN, 4, key=k2)

        def __call__(self, x):
            return self.out(self.mlp(self.norm(x)))

    model = Model(jax.random.key(0))
    params, static = eqx.partition(model, eqx.is_inexact_array)

    def loss_fn(params, batch):
        x, y = batch
        return _mse(jax.vmap(eqx.combine(params, static))(x), y)

    _assert_trains_like_jit(loss_fn, params, _data(), num_stages=2)

    # The module itself (function leaves included) is refused with the partition pattern as the fix.
    step = _step_for(loss_fn, make_optimizer())
    with pytest.raises(TypeError, match=r"eqx.partition.*eqx.combine"):
        autopp.parallelize(step, num_stages=2, num_microbatches=4).plan_for(model, (), _data())


# ---------------------------------------------------------------- jax.lax.scan over layers


def _scan_case(layers):
    k = jax.random.split(jax.random.key(0), 3)
    params = {"w_in": jax.random.normal(k[0], (8, HIDDEN)) * 0.3,
              "blocks": {"w": jax.random.normal(k[1], (layers, HIDDEN, HIDDEN)) * 0.3,
                         "b": jnp.zeros((layers, HIDDEN))},
              "w_out": jax.random.normal(k[2], (HIDDEN, 4)) * 0.3}

    def loss_fn(params, batch):
        x, y = batch

        def block(h, p):
            return h + jnp.tanh(h @ p["w"] + p["b"]), None

        h, _ = jax.lax.scan(block, jnp.tanh(x @ params["w_in"]), params["blocks"])
        return _mse(h @ params["w_out"], y)

    return loss_fn, params


def test_lax_scan_over_layers_trains_like_jit():
    layers = 4
    loss_fn, params = _scan_case(layers)
    built = _assert_trains_like_jit(loss_fn, params, _data(), num_stages=2)
    _assert_split_by_iteration(_stage_iterations(*built, (layers, HIDDEN, HIDDEN)), layers)


@pytest.mark.parametrize("layers,num_stages", [(4, 2), (6, 4), (5, 3), (4, 3)])
def test_lax_scan_split_by_iteration_range(layers, num_stages):
    # The split alone (as parallelize makes it), without compiling the stages.
    loss_fn, params = _scan_case(layers)
    tx = make_optimizer()
    traced = trace_step(_step_for(loss_fn, tx), (params, tx.init(params), _data()), (2,))
    split = split_stages(traced.spec.forward, traced.microbatched_grad_inputs, num_stages)
    ranges = _stage_iterations(traced, split, (layers, HIDDEN, HIDDEN))
    _assert_split_by_iteration(ranges, layers)
    if layers % num_stages == 0:  # equal iterations per stage (the input and output projections are small)
        assert [len(r) for r in ranges] == [layers // num_stages] * num_stages, ranges

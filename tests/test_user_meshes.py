"""Steps written for a mesh of the user's own (a user trial): a context mesh (``jax.set_mesh``) is set aside while the
pipeline runs, sharding constraints are dropped with a warning, ``shard_map`` and explicit-axis meshes are refused
with the fix. Each runs as plain jit does or says why not."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import autopp

from _helpers import assert_trees_close


def _params():
    k = jax.random.split(jax.random.key(0), 3)
    return {"w0": jax.random.normal(k[0], (16, 16)), "w1": jax.random.normal(k[1], (16, 16)),
            "w2": jax.random.normal(k[2], (16, 1))}


def _batch():
    k = jax.random.split(jax.random.key(1), 2)
    return {"x": jax.random.normal(k[0], (16, 16)), "y": jax.random.normal(k[1], (16, 1))}


def _step(middle=lambda h: h):
    def loss(p, b):
        h = middle(jnp.tanh(b["x"] @ p["w0"]))
        return jnp.mean((jnp.tanh(h @ p["w1"]) @ p["w2"] - b["y"]) ** 2)

    def step(p, b):
        value, grads = autopp.value_and_grad(loss)(p, b)
        return jax.tree.map(lambda a, g: a - 0.05 * g, p, grads), value
    return step


def _pipelined(step, stages=2):
    return autopp.parallelize(step, num_stages=stages, num_microbatches=4, devices=jax.devices()[:stages])


def _two_steps(fn):
    p, b = _params(), _batch()
    for _ in range(2):
        p, loss = fn(p, b)
    return autopp.gather(p), loss


def test_a_step_called_under_an_auto_context_mesh_runs_as_jit():
    """It failed with JAX's raw "Received incompatible devices ... jit's context mesh" from the runtime."""
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
    step = _step()
    with jax.set_mesh(mesh):
        got = _two_steps(_pipelined(step))
        want = _two_steps(jax.jit(step))
    assert_trees_close(got, want, atol=1e-6)


def test_an_explicit_axis_context_mesh_is_refused_with_the_fix():
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
    with jax.set_mesh(mesh), pytest.raises(ValueError, match=r"(?s)explicit axes \['data'\].*outside the `with "
                                                              r"jax.set_mesh"):
        _pipelined(_step())(_params(), _batch())


@pytest.mark.parametrize("wrap", [lambda f: f, jax.checkpoint], ids=["plain", "checkpointed"])
def test_sharding_constraints_are_dropped_with_a_warning(wrap):
    """A constraint computes nothing, but named the user's 8 devices inside a 2-device stage's program."""
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
    constrain = wrap(functools.partial(jax.lax.with_sharding_constraint, shardings=NamedSharding(mesh, P("data"))))
    step = _step(constrain)
    with pytest.warns(UserWarning, match=r"sharding constraint\(s\) in the step .* are dropped") as record:
        got = _two_steps(_pipelined(step, stages=4))
    assert {w.filename for w in record if "are dropped" in str(w.message)} == {__file__}
    assert_trees_close(got, _two_steps(jax.jit(step)), atol=1e-6)


def test_shard_map_in_the_loss_is_refused_with_the_fix():
    mesh = jax.make_mesh((2,), ("x",), devices=jax.devices()[:2], axis_types=(AxisType.Auto,))
    matmul = jax.shard_map(lambda a, w: jax.lax.psum(a @ w, "x"), mesh=mesh, in_specs=(P(None, "x"), P("x", None)),
                           out_specs=P())

    def step(p, b):
        return autopp.grad(lambda p, b: jnp.mean(matmul(b["x"], p["w0"]) ** 2))(p, b)

    with pytest.raises(ValueError, match=r"(?s)calls jax.shard_map \(over mesh axes \{'x': 2\}\).*plain jax.numpy"):
        _pipelined(step)(_params(), _batch())


def test_a_bare_partition_spec_constraint_under_the_context_mesh_is_dropped_too():
    """``with_sharding_constraint(x, PartitionSpec("data"))`` needs the context mesh while the step is traced: the
    step is traced under it (and the constraint dropped), then run without it. It failed with JAX's "requires a
    non-empty mesh in context" (a user trial)."""
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
    step = _step(lambda h: jax.lax.with_sharding_constraint(h, P("data")))
    with jax.set_mesh(mesh):
        with pytest.warns(UserWarning, match=r"sharding constraint\(s\) in the step .* are dropped"):
            got = _two_steps(_pipelined(step))
        want = _two_steps(jax.jit(step))
    assert_trees_close(got, want, atol=1e-6)

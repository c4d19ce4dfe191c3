"""FSDP (ZeRO-3) stages: parameters, gradients and optimizer state sharded over a stage's fsdp axis; the step
equals plain jax.jit and the planned shardings are the arrays' own."""

import jax
import pytest
from jax.sharding import PartitionSpec as P

import autopp
from tests._helpers import (
    assert_trees_close, gpt_case, make_optimizer, make_step, run_steps, tiny_gpt, with_jit_reference,
)


@pytest.fixture(scope="module")
def case():
    return with_jit_reference(*gpt_case())


def _expected_spec(shape, fsdp):
    """The runtime's rule: the largest dimension fsdp divides (the first of equal ones) is sharded."""
    dims = [i for i, n in enumerate(shape) if n % fsdp == 0]
    if not dims:
        return P()
    dim = max(dims, key=lambda i: (shape[i], -i))
    return P(*([None] * dim + ["fsdp"]))


@pytest.mark.parametrize("num_stages, layout", [(2, {"fsdp": 2}), (2, {"data": 2, "fsdp": 2}), (1, {"fsdp": 4}),
                                                (4, [{"fsdp": 2}, {"data": 2}, {"fsdp": 2}, {"data": 1, "fsdp": 2}])])
def test_fsdp_stages_equal_plain_jit_with_the_planned_shardings(case, num_stages, layout):
    step, state, batch, reference = case
    per = 4 if isinstance(layout, dict) and layout.get("data") == 2 else (4 if num_stages == 1 else 2)
    devices = jax.devices()[:num_stages * per]
    pipelined = autopp.parallelize(step, num_stages=num_stages, num_microbatches=2, layout=layout, devices=devices)
    got, _ = run_steps(pipelined, state, batch)
    assert_trees_close(got, reference)
    plan = pipelined.plan_for(*state, batch)
    layouts = layout if isinstance(layout, list) else [layout] * num_stages
    for st, lay in zip(plan.stages, layouts):
        assert st.mesh_shape.get("fsdp", 1) == lay.get("fsdp", 1)
    params, opt_state = got[0], got[1]
    sharded = 0
    for leaf in jax.tree.leaves(params) + [x for x in jax.tree.leaves(opt_state) if x.ndim]:
        stage = next(st for st in plan.stages if {d.id for d in leaf.sharding.device_set} == set(st.devices))
        f = stage.mesh_shape.get("fsdp", 1)
        want = _expected_spec(leaf.shape, f) if f > 1 else P()
        assert leaf.sharding.spec == want, (leaf.shape, leaf.sharding, stage.index)
        sharded += want != P()
    assert sharded > 0
    # each device holds only its shard of a sharded parameter
    big = max(jax.tree.leaves(params), key=lambda x: x.size)
    if big.sharding.spec != P():
        assert all(s.data.size < big.size for s in big.addressable_shards)


def test_fsdp_plan_replays(case, tmp_path):
    step, state, batch, reference = case
    original = autopp.parallelize(step, num_stages=2, num_microbatches=2, layout={"fsdp": 2},
                                  devices=jax.devices()[:4])
    plan = original.plan_for(*state, batch)
    plan.to_json(tmp_path / "plan.json")
    replay = autopp.parallelize(step, plan=str(tmp_path / "plan.json"), devices=jax.devices()[:4])
    got, _ = run_steps(replay, state, batch)
    assert_trees_close(got, reference)
    assert [s.mesh_shape for s in replay.plan_for(*state, batch).stages] == [{"data": 1, "fsdp": 2}] * 2


def test_bad_layouts():
    step = make_step(tiny_gpt(), make_optimizer())
    with pytest.raises(ValueError, match=r"data x fsdp x tensor must equal 2"):
        _, state, batch = gpt_case()
        autopp.parallelize(step, num_stages=2, layout={"tensor": 4}, devices=jax.devices()[:4])(*state, batch)
    with pytest.raises(ValueError, match=r"unknown axes \['model'\]"):
        autopp.parallelize(step, num_stages=2, layout={"model": 2})
    with pytest.raises(TypeError, match=r"layout must be a dict"):
        autopp.parallelize(step, num_stages=2, layout="fsdp")

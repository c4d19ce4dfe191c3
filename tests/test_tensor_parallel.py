"""Tensor-parallel stages: Megatron's column/row split read off the step, equal to plain jax.jit, with the
parameters and their optimizer state laid out as planned (checked on the arrays' own shardings)."""

import jax
import pytest
from jax.sharding import PartitionSpec as P

import autopp
from autopp.runtime._tensor import tensor_specs
from tests._helpers import (assert_within_microbatch_noise, gpt_case, make_optimizer,
                           microbatched_jit, run_steps, tiny_gpt, with_jit_reference)

# Megatron-LM's split of a GPT block: fused qkv and the MLP's first matmul by columns (their biases with them),
# the attention output and the MLP's second matmul by rows; LayerNorms and the other biases whole.
MEGATRON = {"qkv_w": P(None, "tensor"), "qkv_b": P("tensor"), "out_w": P("tensor"), "out_b": P(),
            "fc_w": P(None, "tensor"), "fc_b": P("tensor"), "proj_w": P("tensor"), "proj_b": P(),
            "scale": P(), "bias": P()}


@pytest.fixture(scope="module")
def case():
    return with_jit_reference(*gpt_case())


def test_the_rule_finds_megatrons_split_in_a_block():
    model = tiny_gpt()
    params = model.init(jax.random.key(0))["blocks"][0]
    x = jax.ShapeDtypeStruct((2, 16, 32), "float32")
    with jax.disable_jit():  # as autopp traces a step: nested calls inlined
        closed = jax.make_jaxpr(model.block)(params, x)
    leaves, _ = jax.tree_util.tree_flatten_with_path(params)
    names = {v: jax.tree_util.keystr(p).split("'")[-2] for (p, _), v in zip(leaves, closed.jaxpr.invars)}
    specs = tensor_specs(closed.jaxpr, list(names), 2)
    for v, name in names.items():
        spec = list(specs.get(v, ()))
        while spec and spec[-1] is None:
            spec.pop()
        assert P(*spec) == MEGATRON[name], name


@pytest.mark.parametrize("num_stages, layout, num_devices", [
    (2, {"tensor": 2}, 4), (1, {"tensor": 2, "fsdp": 2}, 4), (2, [{"tensor": 4}, {"data": 2, "tensor": 2}], 8),
])
def test_tensor_parallel_stages_equal_plain_jit(case, num_stages, layout, num_devices):
    step, state, batch, reference = case
    pipelined = autopp.parallelize(step, num_stages=num_stages, num_microbatches=2, layout=layout,
                                   devices=jax.devices()[:num_devices])
    got, _ = run_steps(pipelined, state, batch)
    split, _ = run_steps(microbatched_jit(tiny_gpt(), make_optimizer(), 2), state, batch)
    assert_within_microbatch_noise(got, reference, split)
    plan = pipelined.plan_for(*state, batch)
    layouts = layout if isinstance(layout, list) else [layout] * num_stages
    for st, lay in zip(plan.stages, layouts):
        assert st.mesh_shape["tensor"] == lay["tensor"]
    params, opt_state = got[0], got[1]
    adam = [s for s in jax.tree.leaves(opt_state, is_leaf=lambda x: hasattr(x, "mu")) if hasattr(s, "mu")][0]
    for tree in (params["blocks"], adam.mu["blocks"], adam.nu["blocks"]):
        for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
            want = MEGATRON[jax.tree_util.keystr(path).split("'")[-2]]
            spec = tuple(a for a in leaf.sharding.spec)
            tensor_dims = tuple(i for i, a in enumerate(spec) if a == "tensor")
            assert tensor_dims == tuple(i for i, a in enumerate(want) if a == "tensor"), (path, leaf.sharding)


@pytest.mark.parametrize("schedule, kw", [
    ("zb-h1", {}),
    pytest.param("1f1b", {"recompute": ("none", "full", "selective", "none")}, marks=pytest.mark.slow),
])  # recomputation per stage: also tests/test_schedules_run.py
def test_mixed_stage_sizes_and_layouts(case, schedule, kw):
    """1 + 2 + 4 + 1 devices: a plain stage, a tensor-parallel one, tensor x FSDP, a plain one."""
    step, state, batch, reference = case
    d = jax.devices()
    groups = [d[:1], d[1:3], d[3:7], d[7:8]]
    layout = [{}, {"tensor": 2}, {"tensor": 2, "fsdp": 2}, {}]
    pipelined = autopp.parallelize(step, devices=groups, layout=layout, num_microbatches=2, schedule=schedule, **kw)
    got, _ = run_steps(pipelined, state, batch)
    split, _ = run_steps(microbatched_jit(tiny_gpt(), make_optimizer(), 2), state, batch)
    assert_within_microbatch_noise(got, reference, split)
    plan = pipelined.plan_for(*state, batch)
    assert [s.mesh_shape for s in plan.stages] == [{"data": 1}, {"data": 1, "tensor": 2},
                                                   {"data": 1, "fsdp": 2, "tensor": 2}, {"data": 1}]

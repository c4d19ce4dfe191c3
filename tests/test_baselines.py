"""SPMD baselines (autopp.baselines): each layout equals plain jax.jit, with the arrays laid out as planned."""

import jax
import pytest
from jax.sharding import PartitionSpec as P

from autopp import baselines
from tests._helpers import assert_trees_close, run_steps, with_jit_reference
from tests._spmd_cases import CONFIG, jit_case

# Megatron-LM's split of a GPT block (as in test_tensor_parallel): qkv and fc by columns, out and proj by rows.
TENSOR_DIM = {"qkv_w": 1, "qkv_b": 0, "fc_w": 1, "fc_b": 0, "out_w": 0, "proj_w": 0}


@pytest.fixture(scope="module")
def case():
    return with_jit_reference(*jit_case(CONFIG, 8))


def _adam(opt_state):
    return [s for s in jax.tree.leaves(opt_state, is_leaf=lambda x: hasattr(x, "mu")) if hasattr(s, "mu")][0]


def _spec(leaf) -> tuple:
    spec = tuple(leaf.sharding.spec)
    while spec and spec[-1] is None:
        spec = spec[:-1]
    return spec


@pytest.mark.parametrize("name", baselines.BASELINES)
def test_baseline_equals_plain_jit_with_the_planned_shardings(case, name):
    step, state, batch, reference = case
    base = baselines.baseline(name, step)
    got, losses = run_steps(base, state, batch)
    assert_trees_close(got, reference)  # fp32, rtol 1e-5
    shardings = base.shardings_for(*state, batch)
    params, adam = got[0], _adam(got[1])
    for tree in (params, adam.mu, adam.nu):  # outputs keep the input layout: state and moments as planned
        for leaf, want in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings[0])):
            assert leaf.sharding.is_equivalent_to(want, leaf.ndim), (name, leaf.sharding, want)
    assert jax.tree.leaves(shardings[2])[0].spec == P(("data", "fsdp"))  # the batch over every replica
    blocks = jax.tree_util.tree_leaves_with_path(params["blocks"])
    for path, leaf in blocks:
        key = jax.tree_util.keystr(path).split("'")[-2]
        spec = _spec(leaf)
        if name == "data-parallel":
            assert spec == (), (path, spec)
        elif name == "fsdp":  # the largest dimension 8 divides
            dims = [i for i, n in enumerate(leaf.shape) if n % 8 == 0]
            assert spec.index("fsdp") == max(dims, key=lambda i: (leaf.shape[i], -i)), (path, spec)
        else:
            want = TENSOR_DIM.get(key)
            assert (spec.index("tensor") if "tensor" in spec else None) == want, (path, spec)
    assert base.layout.num_devices == 8 and base.peak_memory_bytes(*state, batch) > 0


def test_fsdp_holds_less_state_than_data_parallel(case):
    step, state, batch, _ = case
    dp, fs = baselines.data_parallel(step), baselines.fsdp(step)
    mem = {b.name: b.compiled_for(*state, batch).memory_analysis().argument_size_in_bytes for b in (dp, fs)}
    assert mem["fsdp"] < mem["data-parallel"] / 4


def test_bad_layouts_are_refused_with_the_fix(case):
    step, state, batch, _ = case
    with pytest.raises(ValueError, match="unknown axes"):
        baselines.spmd(step, layout={"pipe": 2})
    with pytest.raises(ValueError, match="needs data x fsdp x tensor = 4"):
        baselines.spmd(step, layout={"data": 2, "tensor": 2}, devices=jax.devices()[:8])
    with pytest.raises(ValueError, match="tensor=4 applies to the tensor-parallel baseline only"):
        baselines.baseline("fsdp", step, tensor=4)
    with pytest.raises(ValueError, match="unknown baseline"):
        baselines.baseline("zero-2", step)
    with pytest.raises(ValueError, match="tensor=5 splits no parameter"):  # 5 divides none of 32, 96, 128, 64
        baselines.tensor_parallel(step, tensor=5, devices=jax.devices()[:5]).shardings_for(*state, batch)
    odd = {k: v[:6] for k, v in batch.items()}
    with pytest.raises(ValueError, match="divisible by data x fsdp = 8"):
        baselines.data_parallel(step)(*state, odd)

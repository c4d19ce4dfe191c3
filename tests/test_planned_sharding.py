"""The runtime executes the sharding the planner chose: a plan of 2 stages x tensor 2 x data 2 on 8 CPU devices, made
by ``plan_model`` from the traced step, replays with every parameter laid out as planned and equals plain
``jax.jit`` over 3 SGD steps (the zoo Llama, and a Llama-style model written here)."""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import autopp
from autopp.models import Llama, LlamaConfig, make_train_step
from autopp.planner import Plan, plan_model
from autopp.profiler import Cluster, profile
from tests._helpers import assert_trees_close, run_steps


def _rms(x, scale):
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + 1e-5) * scale).astype(x.dtype)


def _rope(x):
    b, s, n, d = x.shape
    freq = 1.0 / (10000.0 ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
    ang = jnp.arange(s, dtype=jnp.float32)[:, None] * freq[None]
    cos, sin = jnp.cos(ang)[None, :, None], jnp.sin(ang)[None, :, None]
    x1, x2 = x[..., ::2].astype(jnp.float32), x[..., 1::2].astype(jnp.float32)
    out = jnp.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1).reshape(b, s, n, d)
    return out.astype(x.dtype)


class MyLlama:
    """A Llama-style model as a user writes it: list-of-dict parameters, RMSNorm, RoPE, GQA through
    ``jax.nn.dot_product_attention``, SwiGLU, an untied head."""

    def __init__(self, layers=2, hidden=128, heads=8, kv_heads=4, ffn=256, seq=32, vocab=128, cast=None):
        self.layers, self.hidden, self.heads, self.kv, self.ffn, self.seq, self.vocab = (
            layers, hidden, heads, kv_heads, ffn, seq, vocab)
        self.cast = cast  # mixed precision: fp32 parameters cast to bf16 at the top of the loss ("top") or per block

    def init(self, key):
        h, hd = self.hidden, self.hidden // self.heads
        keys = iter(jax.random.split(key, 4 + 7 * self.layers))

        def w(*shape):
            return 0.05 * jax.random.normal(next(keys), shape, jnp.float32)

        blocks = [{"norm1": jnp.ones((h,)), "wq": w(h, h), "wk": w(h, self.kv * hd), "wv": w(h, self.kv * hd),
                   "wo": w(h, h), "norm2": jnp.ones((h,)), "w1": w(h, self.ffn), "w3": w(h, self.ffn),
                   "w2": w(self.ffn, h)} for _ in range(self.layers)]
        return {"embed": w(self.vocab, h), "blocks": blocks, "norm": jnp.ones((h,)), "out": w(h, self.vocab)}

    def loss(self, params, batch):
        tokens = batch["tokens"]
        b, s = tokens.shape
        hd = self.hidden // self.heads
        bf16 = functools.partial(jax.tree.map, lambda w: w.astype(jnp.bfloat16))
        if self.cast == "top":
            params = bf16(params)
        x = params["embed"][tokens]
        for p in params["blocks"]:
            if self.cast == "block":
                p = bf16(p)
            y = _rms(x, p["norm1"])
            q = _rope((y @ p["wq"]).reshape(b, s, self.heads, hd))
            k = _rope((y @ p["wk"]).reshape(b, s, self.kv, hd))
            v = (y @ p["wv"]).reshape(b, s, self.kv, hd)
            x = x + jax.nn.dot_product_attention(q, k, v, is_causal=True).reshape(b, s, -1) @ p["wo"]
            y = _rms(x, p["norm2"])
            x = x + (jax.nn.silu(y @ p["w1"]) * (y @ p["w3"])) @ p["w2"]
        logits = _rms(x, params["norm"]) @ params["out"]
        logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        return -jnp.take_along_axis(logp, batch["targets"][..., None], axis=-1).mean()

    def batch(self, key, n):
        tokens = jax.random.randint(key, (n, self.seq), 0, self.vocab)
        return {"tokens": tokens, "targets": jnp.roll(tokens, -1, axis=1)}


def _case(which):
    model = Llama(LlamaConfig(layers=2, hidden=128, heads=8, kv_heads=4, ffn=256, seq=32, vocab=128)) \
        if which == "zoo" else MyLlama()
    tx = optax.sgd(0.05)
    params = model.init(jax.random.key(0))
    return make_train_step(model.loss, tx), (params, tx.init(params)), model.batch(jax.random.key(1), 16)


def test_parameters_cast_at_the_top_of_the_loss_are_planned_as_cast_per_block():
    """Mixed precision written as one ``jax.tree.map`` cast of the whole parameter tree at the top of the loss (the
    usual Equinox/NNX idiom) is profiled and planned as the same casts written per block: each block owns its
    weights and the tensor split is Megatron's. Before, every cast read its parameter ahead of the first block, so
    the first layer owned every parameter, the plan put all of them on stage 0 and split none."""
    tx = optax.sgd(0.05)
    cluster = Cluster.local(jax.devices()[:8])
    profiles, plans = {}, {}
    for cast in ("top", "block"):
        model = MyLlama(cast=cast)
        params = model.init(jax.random.key(0))
        step = make_train_step(model.loss, tx)
        profiles[cast] = profile(step, params, tx.init(params), model.batch(jax.random.key(1), 16), cluster=cluster)
        plans[cast] = plan_model(profiles[cast], cluster, global_batch=16, pipeline_degrees=(2,),
                                 tensor_degrees=(2,), schedules=("1f1b",), recompute=("none",))
    top, block = profiles["top"], profiles["block"]
    assert [l.name for l in top.layers] == [l.name for l in block.layers]
    assert [l.param_bytes for l in top.layers] == [l.param_bytes for l in block.layers]
    names = top.param_names
    blocks = [l for l in top.layers if l.name.startswith("block")]
    block_bytes = sum(x.nbytes for x in jax.tree.leaves(MyLlama().init(jax.random.key(0))["blocks"][0]))
    assert [l.param_bytes for l in blocks] == [block_bytes] * 2
    assert [st.param_bytes for st in plans["top"].stages] == [st.param_bytes for st in plans["block"].stages]
    assert min(st.param_bytes for st in plans["top"].stages) > 0
    specs = {names[int(k)]: spec for st in plans["top"].stages for k, spec in st.param_specs.items()}
    for b in range(2):
        for w in ("wq", "w1", "w3"):  # column-parallel: the output dimension split
            assert specs[f"args[0]['blocks'][{b}]['{w}']"][1] == "tensor", (w, specs)
        for w in ("wo", "w2"):  # row-parallel: the contraction dimension split
            assert specs[f"args[0]['blocks'][{b}]['{w}']"][0] == "tensor", (w, specs)


@pytest.mark.parametrize("which", ["zoo", "test-written"])
def test_planned_tensor_parallel_layout_runs_as_planned_and_equals_jit(which):
    step, state, batch = _case(which)
    devices = jax.devices()[:8]
    cluster = Cluster.local(devices)
    prof = profile(step, *state, batch, cluster=cluster)
    plan = plan_model(prof, cluster, global_batch=16, pipeline_degrees=(2,), tensor_degrees=(2,),
                      schedules=("1f1b",), recompute=("none",))
    assert plan.num_stages == 2
    assert all(st.mesh_shape == {"data": 2, "fsdp": 1, "tensor": 2} for st in plan.stages)
    split = [(k, spec) for st in plan.stages for k, spec in st.param_specs.items() if "tensor" in spec]
    assert len(split) >= 4, f"the plan splits too few parameters over the tensor axis to test anything: {split}"
    plan = Plan.from_json(plan.to_json())  # what runs is what was saved
    reference = run_steps(jax.jit(step), state, batch)[0]
    pipelined = autopp.parallelize(step, plan=plan, devices=devices)
    got, _ = run_steps(pipelined, state, batch)
    assert_trees_close(got, reference, rtol=1e-6, atol=1e-7)

    # every parameter is laid out as planned: its tensor split, on its stage's devices
    names = prof.param_names
    leaves = dict(jax.tree_util.tree_leaves_with_path(got[0]))
    by_name = {f"args[0]{jax.tree_util.keystr(p)}": leaf for p, leaf in leaves.items()}
    checked = 0
    for st in plan.stages:
        devs = {d.id for d in np.asarray(devices)[list(st.devices)]}
        for k, spec in st.param_specs.items():
            leaf = by_name[names[int(k)]]
            if {d.id for d in leaf.sharding.device_set} != devs:
                continue  # a parameter read by two stages lives on its first (the owner)
            got_spec = tuple(leaf.sharding.spec) + (None,) * (leaf.ndim - len(leaf.sharding.spec))
            want = tuple("tensor" if a == "tensor" else None for a in spec)
            assert tuple("tensor" if a == "tensor" else None for a in got_spec) == want, (names[int(k)], got_spec,
                                                                                         spec)
            checked += 1
    assert checked >= len(by_name) - 2
    assert math.isfinite(float(plan.predicted.step_time_s))


def test_planned_zero1_shards_optimizer_state_over_data_and_equals_jit():
    """A plan with ZeRO-1 (the distributed optimizer): the optimizer state (SGD's momentum, linear like SGD itself,
    so the strict tolerance holds) lives sharded over the data axis, the parameters do not, and 3 steps equal plain
    jit."""
    model = Llama(LlamaConfig(layers=2, hidden=128, heads=8, kv_heads=4, ffn=256, seq=32, vocab=128))
    tx = optax.sgd(0.05, momentum=0.9)
    params = model.init(jax.random.key(0))
    step, state, batch = make_train_step(model.loss, tx), (params, tx.init(params)), model.batch(jax.random.key(1), 16)
    devices = jax.devices()[:8]
    cluster = Cluster.local(devices)
    prof = profile(step, *state, batch, cluster=cluster)
    plan = plan_model(prof, cluster, global_batch=16, pipeline_degrees=(2,), tensor_degrees=(1,),
                      schedules=("1f1b",), recompute=("none",), fsdp=False, zero1=True)
    assert plan.zero1 and all(st.mesh_shape == {"data": 4, "fsdp": 1, "tensor": 1} for st in plan.stages)
    assert plan.predicted.optimizer_bytes * 4 == pytest.approx(
        plan_model(prof, cluster, global_batch=16, pipeline_degrees=(2,), tensor_degrees=(1,), schedules=("1f1b",),
                   recompute=("none",), fsdp=False, zero1=False).predicted.optimizer_bytes, rel=0.02)
    plan = Plan.from_json(plan.to_json())
    reference = run_steps(jax.jit(step), state, batch)[0]
    got, _ = run_steps(autopp.parallelize(step, plan=plan, devices=devices), state, batch)
    assert_trees_close(got, reference, rtol=1e-6, atol=1e-7)

    def data_split(leaf):
        return any(a == "data" or (isinstance(a, tuple) and "data" in a) for a in leaf.sharding.spec)

    momentum = [x for x in jax.tree.leaves(got[1]) if getattr(x, "ndim", 0) >= 1]
    assert momentum and all(data_split(x) for x in momentum if any(n % 4 == 0 for n in x.shape))
    assert not any(data_split(x) for x in jax.tree.leaves(got[0]))


def test_planned_sequence_parallelism_splits_the_activations_between_layers(monkeypatch):
    """A plan with sequence parallelism: the activations passed between layers inside each stage are laid out along
    the sequence over the tensor axis (and their cotangents with them), and 3 SGD steps equal plain jit."""
    step, state, batch = _case("zoo")
    devices = jax.devices()[:8]
    cluster = Cluster.local(devices)
    prof = profile(step, *state, batch, cluster=cluster)
    plan = plan_model(prof, cluster, global_batch=16, pipeline_degrees=(2,), tensor_degrees=(2,),
                      schedules=("1f1b",), recompute=("none",))
    plan = Plan.from_json(dataclasses.replace(plan, sequence_parallel=True).to_json())
    applied = []
    real = jax.lax.with_sharding_constraint

    def spy(x, sharding):
        applied.append((tuple(x.shape), tuple(sharding.spec), dict(sharding.mesh.shape)))
        return real(x, sharding)

    monkeypatch.setattr(jax.lax, "with_sharding_constraint", spy)
    reference = run_steps(jax.jit(step), state, batch)[0]
    got, _ = run_steps(autopp.parallelize(step, plan=plan, devices=devices), state, batch)
    assert_trees_close(got, reference, rtol=1e-6, atol=1e-7)
    # the microbatch (16 / num_microbatches examples, split over the 2 data replicas) x 32 positions x hidden 128: the
    # embedding's and each block's output, the sequence split over the stage's 2 tensor devices
    boundary = {(shape, spec) for shape, spec, mesh in applied if mesh["tensor"] == 2}
    assert boundary == {((16 // plan.num_microbatches, 32, 128), (("data", "fsdp"), "tensor"))}, boundary
    assert len(applied) >= 3  # embedding -> block 0 -> block 1 -> head, wherever the stage boundary falls

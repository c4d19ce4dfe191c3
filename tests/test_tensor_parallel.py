"""Tensor-parallel stages: Megatron's column/row split read off the step, equal to plain jax.jit, with the
parameters and their optimizer state laid out as planned (checked on the arrays' own shardings)."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import autopp
from autopp.runtime._tensor import tensor_specs
from tests._helpers import (assert_trees_close, assert_within_microbatch_noise, gpt_case, make_optimizer, make_step,
                           microbatched_jit, run_steps, tiny_gpt, with_jit_reference)

# Megatron-LM's split of a GPT block: fused qkv and the MLP's first matmul by columns (their biases with them),
# the attention output and the MLP's second matmul by rows; LayerNorms and the other biases whole.
MEGATRON = {"qkv_w": P(None, "tensor"), "qkv_b": P("tensor"), "out_w": P("tensor"), "out_b": P(),
            "fc_w": P(None, "tensor"), "fc_b": P("tensor"), "proj_w": P("tensor"), "proj_b": P(),
            "scale": P(), "bias": P()}


@pytest.fixture(scope="module")
def case():
    return with_jit_reference(*gpt_case())


@pytest.mark.parametrize("frozen", [False, True])
def test_the_rule_finds_megatrons_split_in_a_block(frozen):
    """Megatron's split of a GPT block's weights; the same for weights behind ``jax.lax.stop_gradient`` (``frozen``:
    they stayed whole on every device of the tensor group, a user trial: 1.66x the memory of data parallelism)."""
    model = tiny_gpt()
    params = model.init(jax.random.key(0))["blocks"][0]
    x = jax.ShapeDtypeStruct((2, 16, 32), "float32")
    block = (lambda p, x: model.block(jax.tree.map(jax.lax.stop_gradient, p), x)) if frozen else model.block
    with jax.disable_jit():  # as autopp traces a step: nested calls inlined
        closed = jax.make_jaxpr(block)(params, x)
    leaves, _ = jax.tree_util.tree_flatten_with_path(params)
    names = {v: jax.tree_util.keystr(p).split("'")[-2] for (p, _), v in zip(leaves, closed.jaxpr.invars)}
    specs = tensor_specs(closed.jaxpr, list(names), 2)
    for v, name in names.items():
        spec = list(specs.get(v, ()))
        while spec and spec[-1] is None:
            spec.pop()
        assert P(*spec) == MEGATRON[name], name


def _llama_block(x, p, heads, kv_heads, rope):
    """A Llama block written here: RMSNorm, rotary q/k, grouped-query attention (key/value heads repeated),
    SwiGLU MLP; ``rope``: "interleaved" (GPT-J / Meta pairs, ``jnp.stack``) or "half" (rotate half)."""
    b, t, h = x.shape
    hd = h // heads

    def norm(y, w):
        return y * jax.lax.rsqrt((y * y).mean(-1, keepdims=True) + 1e-6) * w

    def rotary(y):
        ang = jnp.arange(t)[:, None] * (1.0 / 10000 ** (jnp.arange(0, hd, 2) / hd))[None]
        cos, sin = jnp.cos(ang)[None, :, None], jnp.sin(ang)[None, :, None]
        if rope == "interleaved":
            y1, y2 = y[..., ::2], y[..., 1::2]
            return jnp.stack([y1 * cos - y2 * sin, y1 * sin + y2 * cos], -1).reshape(y.shape)
        y1, y2 = jnp.split(y, 2, axis=-1)
        return jnp.concatenate([y1 * cos - y2 * sin, y1 * sin + y2 * cos], -1)

    y = norm(x, p["attn_norm"])
    q = rotary((y @ p["wq"]).reshape(b, t, heads, hd))
    k = jnp.repeat(rotary((y @ p["wk"]).reshape(b, t, kv_heads, hd)), heads // kv_heads, axis=2)
    v = jnp.repeat((y @ p["wv"]).reshape(b, t, kv_heads, hd), heads // kv_heads, axis=2)
    a = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k) / hd ** 0.5, -1)
    x = x + jnp.einsum("bhqk,bkhd->bqhd", a, v).reshape(b, t, h) @ p["wo"]
    y = norm(x, p["mlp_norm"])
    return x + (jax.nn.silu(y @ p["w_gate"]) * (y @ p["w_up"])) @ p["w_down"]


@pytest.mark.parametrize("rope, kv_heads, tp", [("interleaved", 4, 2), ("half", 4, 2), ("interleaved", 2, 4),
                                                ("half", 2, 4)])
def test_the_rule_finds_megatrons_split_in_a_llama_block(rope, kv_heads, tp):
    """Megatron-LM's layout for a Llama block written here: q/k/v and gate/up by columns, o and down by rows; with
    fewer key/value heads than tensor devices, k and v whole (Megatron replicates such heads). Before, a rotary
    embedding through ``jnp.stack`` lost the heads' split, and every later matmul was split the other way round."""
    h, heads, ffn = 32, 4, 64
    shapes = {"attn_norm": (h,), "wq": (h, h), "wk": (h, kv_heads * h // heads), "wv": (h, kv_heads * h // heads),
              "wo": (h, h), "mlp_norm": (h,), "w_gate": (h, ffn), "w_up": (h, ffn), "w_down": (ffn, h)}
    params = {k: jax.ShapeDtypeStruct(s, "float32") for k, s in shapes.items()}
    with jax.disable_jit():
        closed = jax.make_jaxpr(lambda x, p: _llama_block(x, p, heads, kv_heads, rope))(
            jax.ShapeDtypeStruct((2, 8, h), "float32"), params)
    names = dict(zip(closed.jaxpr.invars[1:], sorted(shapes)))  # a dict's leaves come in key order
    specs = tensor_specs(closed.jaxpr, list(names), tp)
    got = {name: P(*specs.get(v, ())) for v, name in names.items()}
    kv = P(None, "tensor") if kv_heads % tp == 0 else P()
    want = {"attn_norm": P(), "mlp_norm": P(), "wq": P(None, "tensor"), "wk": kv, "wv": kv, "wo": P("tensor", None),
            "w_gate": P(None, "tensor"), "w_up": P(None, "tensor"), "w_down": P("tensor", None)}
    assert got == want


def test_heads_that_do_not_divide_keep_the_attention_whole_and_the_mlp_megatron_s():
    """2 heads over tensor 4: q/k/v stay whole, and so does the output projection (a whole attention's output split
    by columns would split the residual stream and turn the MLP the other way round: gate/up by rows, down by
    columns, as it used to)."""
    h, heads, ffn = 32, 2, 64
    shapes = {"attn_norm": (h,), "wq": (h, h), "wk": (h, h), "wv": (h, h), "wo": (h, h), "mlp_norm": (h,),
              "w_gate": (h, ffn), "w_up": (h, ffn), "w_down": (ffn, h)}
    params = {k: jax.ShapeDtypeStruct(s, "float32") for k, s in shapes.items()}
    with jax.disable_jit():
        closed = jax.make_jaxpr(lambda x, p: _llama_block(x, p, heads, heads, "half"))(
            jax.ShapeDtypeStruct((2, 8, h), "float32"), params)
    names = dict(zip(closed.jaxpr.invars[1:], sorted(shapes)))
    specs = tensor_specs(closed.jaxpr, list(names), 4)
    got = {name: P(*specs.get(v, ())) for v, name in names.items()}
    assert got == {"attn_norm": P(), "mlp_norm": P(), "wq": P(), "wk": P(), "wv": P(), "wo": P(),
                   "w_gate": P(None, "tensor"), "w_up": P(None, "tensor"), "w_down": P("tensor", None)}


def test_stacked_attention_weights_whose_heads_do_not_divide_stay_whole():
    """Layers reading rows of stacked weights (``w[i]``, an unrolled ``lax.scan``) with 2 heads over tensor 4: the
    stacked q/k/v/o stay whole, as a loop's weights do, and the stacked MLP weights are split Megatron's way."""
    h, heads, ffn, n = 32, 2, 64, 2
    shapes = {"attn_norm": (n, h), "wq": (n, h, h), "wk": (n, h, h), "wv": (n, h, h), "wo": (n, h, h),
              "mlp_norm": (n, h), "w_gate": (n, h, ffn), "w_up": (n, h, ffn), "w_down": (n, ffn, h)}
    params = {k: jax.ShapeDtypeStruct(s, "float32") for k, s in shapes.items()}

    def layers(x, p):
        for i in range(n):
            x = _llama_block(x, {k: w[i] for k, w in p.items()}, heads, heads, "half")
        return x

    with jax.disable_jit():
        closed = jax.make_jaxpr(layers)(jax.ShapeDtypeStruct((2, 8, h), "float32"), params)
    names = dict(zip(closed.jaxpr.invars[1:], sorted(shapes)))
    specs = tensor_specs(closed.jaxpr, list(names), 4)
    got = {name: P(*specs.get(v, ())) for v, name in names.items()}
    assert got == {"attn_norm": P(), "mlp_norm": P(), "wq": P(), "wk": P(), "wv": P(), "wo": P(),
                   "w_gate": P(None, None, "tensor"), "w_up": P(None, None, "tensor"),
                   "w_down": P(None, "tensor", None)}


def test_layers_scanned_over_stacked_weights_are_split_as_a_loop_s():
    """``lax.scan`` over stacked MLP weights (Linen ``nn.scan``, Equinox ``filter_vmap`` stacks) with tensor 2: each
    stack is split one dimension further in than a layer's weight, Megatron's way (it used to stay whole), and the
    steps equal plain jit with SGD."""
    import optax

    L, H = 4, 32
    keys = jax.random.split(jax.random.key(0), 3)
    params = {"w1": jax.random.normal(keys[0], (L, H, 4 * H)) * 0.1,
              "w2": jax.random.normal(keys[1], (L, 4 * H, H)) * 0.1, "head": jax.random.normal(keys[2], (H, 8)) * 0.1}

    def loss(p, batch):
        x, y = batch
        h, _ = jax.lax.scan(lambda x, w: (x + jax.nn.gelu(x @ w["w1"]) @ w["w2"], None), x,
                            {"w1": p["w1"], "w2": p["w2"]})
        return jnp.mean((h @ p["head"] - y) ** 2)

    tx = optax.sgd(0.1)

    def step(p, opt_state, batch):
        value, grads = autopp.value_and_grad(loss)(p, batch)
        updates, opt_state = tx.update(grads, opt_state, p)
        return optax.apply_updates(p, updates), opt_state, value

    batch = (jax.random.normal(jax.random.key(1), (8, H)), jax.random.normal(jax.random.key(2), (8, 8)))
    state = (params, tx.init(params))
    reference, ref_losses = run_steps(jax.jit(step), state, batch)
    pipelined = autopp.parallelize(step, num_stages=1, num_microbatches=2, layout={"tensor": 2},
                                   devices=jax.devices()[:2])
    got, losses = run_steps(pipelined, state, batch)
    assert_trees_close(losses, ref_losses, rtol=1e-6, atol=1e-7)
    assert_trees_close(autopp.gather(got[0]), reference[0], rtol=1e-6, atol=1e-7)
    specs = {k: tuple(got[0][k].sharding.spec) for k in ("w1", "w2")}
    assert specs["w1"][:3] == (None, None, "tensor") and specs["w2"][:2] == (None, "tensor"), specs


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


def test_a_tensor_parallel_stage_keeps_its_backward_s_values_split():
    """What a stage keeps from its forward for its backward (attention scores, the MLP's hidden units) is computed
    split over the tensor axis; it used to leave the forward laid out over the data axis only, so XLA gathered it
    first (28 all-gathers in a user trial's stage) and tensor parallelism saved no activation memory (26.93 against
    27.18 MiB per device without it). Now the forward gathers nothing, the runtime's accounting of a device's peak
    drops with the tensor degree, and the step still equals jit."""
    import re

    import optax

    from autopp.models import GPT, GPTConfig

    model = GPT(GPTConfig(layers=2, hidden=64, heads=4, seq=128, vocab=128))
    tx = optax.sgd(0.1)
    step = make_step(model, tx)
    params = model.init(jax.random.key(0))
    state, batch = (params, tx.init(params)), model.batch(jax.random.key(1), 8)
    peak, gathers = {}, {}
    for tp in (1, 2):
        pipelined = autopp.parallelize(make_step(model, tx), num_stages=2, num_microbatches=2,
                                       layout={"tensor": tp}, devices=jax.devices()[:2 * tp])
        peak[tp] = pipelined.memory_report(*state, batch)[0]
        forward = next(t for t in pipelined.executable_for(*state, batch).tasks if t.label == "0F0")
        gathers[tp] = len(re.findall(r" all-gather(-start)?\(", forward.fn.as_text()))
        if tp == 2:
            got = run_steps(pipelined, state, batch)[0]
    assert gathers == {1: 0, 2: 0}
    assert peak[2] < 0.7 * peak[1], peak
    assert_trees_close(autopp.gather(got), run_steps(jax.jit(step), state, batch)[0])


def test_frozen_weights_are_split_on_tensor_parallel_stages():
    """Weights left out of ``argnums`` (a frozen body; only per-layer biases train) on 2 stages of tensor 2: they are
    split as trained weights would be, so a stage holds about what data parallelism holds, and the step trains as
    jit does. Before, they stayed whole on every device of the group (a user trial: 1.66x data parallelism's
    peak)."""
    import optax

    D, F = 64, 256
    k = jax.random.split(jax.random.key(0), 8)
    body = [{"w1": jax.random.normal(k[i], (D, F)) * 0.05, "w2": jax.random.normal(k[4 + i], (F, D)) * 0.05}
            for i in range(4)]
    biases = [jnp.zeros((F,)) for _ in range(4)]
    tx = optax.sgd(0.1)

    def loss(body, biases, batch):
        h = batch["x"]
        for b, c in zip(body, biases):
            h = h + jnp.tanh(h @ b["w1"] + c) @ b["w2"]
        return jnp.mean((h - batch["y"]) ** 2)

    def step(body, biases, opt_state, batch):
        value, grads = autopp.value_and_grad(loss, argnums=1)(body, biases, batch)
        updates, opt_state = tx.update(grads, opt_state, biases)
        return body, optax.apply_updates(biases, updates), opt_state, value

    batch = {"x": jax.random.normal(k[0], (16, 8, D)), "y": jax.random.normal(k[1], (16, 8, D))}
    args = (body, biases, tx.init(biases), batch)
    peaks = {}
    for name, layout in (("tensor", {"tensor": 2}), ("data", {"data": 2})):
        pipelined = autopp.parallelize(step, num_stages=2, num_microbatches=4, layout=layout,
                                       devices=jax.devices()[:4])
        peaks[name] = max(pipelined.memory_report(*args).values())
        if name == "tensor":
            _, got, _, got_loss = pipelined(*args)
            _, want, _, want_loss = jax.jit(step)(*args)
            assert_trees_close((autopp.gather(got), got_loss), (want, want_loss), rtol=1e-6, atol=1e-6)
    assert peaks["tensor"] <= 1.3 * peaks["data"], peaks  # (1.40x before)


def test_tables_an_explicit_tensor_layout_leaves_whole_are_said():
    """Two embedding tables read by gathers beside a small MLP (trial RECSYS2), ``layout={"tensor": 2}``: the tensor
    rule splits only the MLP's weights, so every device of the tensor group held both tables (91.59 MiB per device,
    as without tensor parallelism), without a word. Said, naming the tables; jit's values (SGD)."""
    import warnings

    import numpy as np
    import optax

    tx = optax.sgd(0.1)
    keys = jax.random.split(jax.random.key(0), 4)
    params = {"users": jax.random.normal(keys[0], (12000, 16)) * 0.1, "items": jax.random.normal(keys[1], (8000, 16)),
              "w1": jax.random.normal(keys[2], (32, 32)) * 0.2, "w2": jax.random.normal(keys[3], (32, 1)) * 0.2}
    batch = {"u": jnp.arange(8) * 7, "i": jnp.arange(8) * 5, "y": jnp.linspace(0.0, 1.0, 8)[:, None]}

    def loss(p, b):
        h = jnp.concatenate([p["users"][b["u"]], p["items"][b["i"]]], -1)
        return jnp.mean((jnp.tanh(h @ p["w1"]) @ p["w2"] - b["y"]) ** 2)

    def step(p, opt, b):
        value, grads = autopp.value_and_grad(loss)(p, b)
        updates, opt = tx.update(grads, opt, p)
        return optax.apply_updates(p, updates), opt, value

    want = jax.jit(step)(params, tx.init(params), batch)
    with pytest.warns(UserWarning, match=r"tensor=2 leaves 1\.2 of stage 0's 1\.2 MiB of weights whole .*"
                                         r"args\[0\]\['users'\] float32\[12000,16\].*layout=\{'fsdp'"):
        got = autopp.parallelize(step, num_stages=1, num_microbatches=2, devices=jax.devices()[:2],
                                 layout={"tensor": 2})(params, tx.init(params), batch)
    for a, b in zip(jax.tree.leaves((want[0], want[2])), jax.tree.leaves((autopp.gather(got[0]), got[2]))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)
    with warnings.catch_warnings():  # (a stage whose matmuls hold most of its weights: nothing said)
        warnings.simplefilter("error")
        small = {**params, "users": params["users"][:100], "items": params["items"][:100]}
        autopp.parallelize(step, num_stages=1, num_microbatches=2, devices=jax.devices()[:2],
                           layout={"tensor": 2}).plan_for(small, tx.init(small), {**batch, "u": batch["u"] % 100,
                                                                                  "i": batch["i"] % 100})

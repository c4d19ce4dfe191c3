"""Tests for autopp.models, each checked against an independent truth."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from autopp.models import GPT, MLP, GPTConfig, MLPConfig

TINY = dict(layers=2, hidden=8, heads=2, seq=4, vocab=11)


def _leaf_count(tree) -> int:
    return sum(int(np.prod(leaf.shape)) for leaf in jax.tree_util.tree_leaves(tree))


# ---------------------------------------------------------------- numpy reference


def _np_layer_norm(p, x):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + 1e-5) * p["scale"] + p["bias"]


def _np_gelu_tanh(x):
    return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x**3)))


def _np_softmax(z):
    z = z - z.max(-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(-1, keepdims=True)


def _np_gpt_logits(params, tokens, heads):
    """Straightforward float64 per-example, per-head loops; no code shared with GPT."""
    p = jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64), params)
    B, s = tokens.shape
    h = p["wte"].shape[1]
    d = h // heads
    out = np.zeros((B, s, p["wte"].shape[0]))
    for b in range(B):
        x = np.stack([p["wte"][tokens[b, t]] + p["wpe"][t] for t in range(s)])
        for blk in p["blocks"]:
            y = _np_layer_norm(blk["ln1"], x)
            qkv = (y @ blk["attn"]["qkv_w"] + blk["attn"]["qkv_b"]).reshape(s, heads, 3, d)  # head by head
            q, k, v = (qkv[:, :, j].reshape(s, h) for j in range(3))
            ctx = np.zeros((s, h))
            for n in range(heads):
                sl = slice(n * d, (n + 1) * d)
                for t in range(s):
                    # attend to positions 0..t only
                    sc = np.array([q[t, sl] @ k[u, sl] for u in range(t + 1)]) / np.sqrt(d)
                    w = _np_softmax(sc)
                    ctx[t, sl] = sum(w[u] * v[u, sl] for u in range(t + 1))
            x = x + ctx @ blk["attn"]["out_w"] + blk["attn"]["out_b"]
            y = _np_layer_norm(blk["ln2"], x)
            y = _np_gelu_tanh(y @ blk["mlp"]["fc_w"] + blk["mlp"]["fc_b"])
            x = x + y @ blk["mlp"]["proj_w"] + blk["mlp"]["proj_b"]
        out[b] = _np_layer_norm(p["ln_f"], x) @ p["wte"].T
    return out


def _random_params(model, seed=0):
    """Params of the right structure with O(1) values everywhere (biases, LN scales
    included) so that a wrong bias, scale or layout shows in the output."""
    rng = np.random.default_rng(seed)
    shapes = model.init_abstract()
    return jax.tree_util.tree_map(
        lambda a: jnp.asarray(rng.normal(0.0, 0.5, a.shape), jnp.float32), shapes
    )


# ---------------------------------------------------------------- GPT
# Compilation dominates the run time, so models, params and jitted functions are
# built once per module and shared.


class _Jitted:
    def __init__(self, model, key=0):
        self.model = model
        self.apply = jax.jit(model.apply)
        self.loss = jax.jit(model.loss)
        self.grad = jax.jit(jax.grad(model.loss))
        self.params = jax.jit(model.init)(jax.random.key(key))


@pytest.fixture(scope="module")
def tiny():
    return _Jitted(GPT(GPTConfig(**TINY)))


@pytest.fixture(scope="module")
def small():
    return _Jitted(GPT(GPTConfig(layers=4, hidden=64, heads=4, seq=16, vocab=97)))


def test_gpt_forward_matches_numpy_reference(tiny):
    params = _random_params(tiny.model)
    tokens = np.random.default_rng(1).integers(0, TINY["vocab"], (2, TINY["seq"]))
    got = np.asarray(tiny.apply(params, jnp.asarray(tokens, jnp.int32)))
    want = _np_gpt_logits(params, tokens, TINY["heads"])
    assert got.dtype == np.float32 and got.shape == (2, TINY["seq"], TINY["vocab"])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_gpt_loss_matches_numpy_cross_entropy(tiny):
    params = _random_params(tiny.model, seed=3)
    batch = tiny.model.batch(jax.random.key(2), 2)
    logits = _np_gpt_logits(params, np.asarray(batch["tokens"]), TINY["heads"])
    logz = np.log(np.exp(logits).sum(-1))
    picked = np.take_along_axis(logits, np.asarray(batch["targets"])[..., None], -1)[..., 0]
    np.testing.assert_allclose(float(tiny.loss(params, batch)), (logz - picked).mean(), rtol=1e-5)


def test_gpt_num_params_equals_init_leaf_sizes(tiny, small):
    for jitted in (tiny, small):
        assert jitted.model.config.num_params == _leaf_count(jitted.params)
        abstract = jitted.model.init_abstract()
        assert jax.tree_util.tree_structure(abstract) == jax.tree_util.tree_structure(jitted.params)
        for a, p in zip(jax.tree_util.tree_leaves(abstract), jax.tree_util.tree_leaves(jitted.params)):
            assert isinstance(a, jax.ShapeDtypeStruct)
            assert a.shape == p.shape and a.dtype == p.dtype


@pytest.mark.parametrize(
    "cfg", [dict(layers=3, hidden=12, heads=3, seq=5, vocab=7), dict(layers=1, hidden=4, heads=1, seq=1, vocab=2)]
)
def test_gpt_num_params_equals_abstract_leaf_sizes(cfg):
    assert GPTConfig(**cfg).num_params == _leaf_count(GPT(GPTConfig(**cfg)).init_abstract())


def test_gpt_param_layout_and_init_statistics(small):
    params = small.params
    assert len(params["blocks"]) == 4
    blk = params["blocks"][0]
    assert blk["attn"]["qkv_w"].shape == (64, 192) and blk["attn"]["qkv_b"].shape == (192,)
    assert blk["mlp"]["fc_w"].shape == (64, 256) and blk["mlp"]["proj_w"].shape == (256, 64)
    assert params["wte"].shape == (97, 64) and params["wpe"].shape == (16, 64)
    assert float(jnp.std(blk["attn"]["qkv_w"])) == pytest.approx(0.02, rel=0.1)
    assert float(jnp.std(blk["mlp"]["proj_w"])) == pytest.approx(0.02 / math.sqrt(8), rel=0.1)
    assert float(jnp.std(blk["attn"]["out_w"])) == pytest.approx(0.02 / math.sqrt(8), rel=0.1)
    np.testing.assert_array_equal(blk["ln1"]["scale"], 1.0)
    np.testing.assert_array_equal(blk["attn"]["qkv_b"], 0.0)


def test_gpt_initial_loss_is_near_log_vocab(small):
    loss = small.loss(small.params, small.model.batch(jax.random.key(1), 4))
    assert abs(float(loss) - math.log(97)) < 0.1


def test_gpt_attention_is_causal(tiny):
    params = _random_params(tiny.model)
    tokens = jnp.array([[1, 2, 3, 4], [5, 6, 7, 8]], jnp.int32)
    base = tiny.apply(params, tokens)
    for t in range(TINY["seq"]):
        changed = tiny.apply(params, tokens.at[:, t].set((tokens[:, t] + 5) % TINY["vocab"]))
        np.testing.assert_array_equal(changed[:, :t], base[:, :t])
        # the check above must be able to fail: position t itself does change
        assert not np.allclose(changed[:, t], base[:, t])


def test_gpt_tied_embedding_gradient_sums_input_and_output_uses(tiny):
    model, params = tiny.model, tiny.params
    batch = model.batch(jax.random.key(1), 2)

    @jax.jit
    def untied_loss(wte_in, wte_out):
        x = model.embed({**params, "wte": wte_in}, batch["tokens"])
        for blk in params["blocks"]:
            x = model.block(blk, x)
        logits = model.head({**params, "wte": wte_out}, x)
        logp = jax.nn.log_softmax(logits, -1)
        return -jnp.mean(jnp.take_along_axis(logp, batch["targets"][..., None], -1))

    wte = params["wte"]
    g_in, g_out = jax.jit(jax.grad(untied_loss, argnums=(0, 1)))(wte, wte)
    g_tied = tiny.grad(params, batch)["wte"]
    assert float(jnp.abs(g_in).max()) > 0 and float(jnp.abs(g_out).max()) > 0
    np.testing.assert_allclose(g_tied, g_in + g_out, rtol=1e-5, atol=1e-8)
    assert not np.allclose(g_tied, g_out, rtol=1e-5, atol=1e-8)


def test_gpt_loss_is_mean_over_microbatches(tiny):
    batch = tiny.model.batch(jax.random.key(1), 8)
    micro = [jax.tree_util.tree_map(lambda a: a[i : i + 2], batch) for i in range(0, 8, 2)]
    mean_micro = np.mean([float(tiny.loss(tiny.params, mb)) for mb in micro])
    np.testing.assert_allclose(mean_micro, float(tiny.loss(tiny.params, batch)), rtol=1e-6)


def test_gpt_batch_targets_are_next_tokens(tiny):
    batch = tiny.model.batch(jax.random.key(0), 2)
    assert batch["tokens"].shape == (2, 4) and batch["tokens"].dtype == jnp.int32
    assert batch["targets"].dtype == jnp.int32
    np.testing.assert_array_equal(batch["targets"][:, :-1], batch["tokens"][:, 1:])
    assert int(batch["tokens"].min()) >= 0 and int(batch["tokens"].max()) < TINY["vocab"]


def test_gpt_bfloat16_params_give_float32_logits(tiny):
    model = GPT(GPTConfig(**TINY, dtype="bfloat16"))
    assert all(leaf.dtype == jnp.bfloat16 for leaf in jax.tree_util.tree_leaves(model.init_abstract()))
    params = jax.tree_util.tree_map(lambda a: a.astype(jnp.bfloat16), tiny.params)
    logits = jax.jit(model.apply)(params, model.batch(jax.random.key(1), 2)["tokens"])
    assert logits.dtype == jnp.float32 and bool(jnp.isfinite(logits).all())


def test_flops_per_step_matches_hand_computed_formula():
    cfg = GPTConfig(**TINY)  # B=3, s=4, l=2, h=8, V=11
    # 72*3*4*2*64 = 110592; 1 + 4/48 + 11/192 = 219/192  ->  576 * 219
    assert cfg.flops_per_step(3) == pytest.approx(126144.0, rel=1e-12)
    # 96*3*4*2*64 = 147456; 1 + 4/48 + 11/256 = 865/768  ->  192 * 865
    assert cfg.flops_per_step(3, recompute=True) == pytest.approx(166080.0, rel=1e-12)


def test_gpt_config_to_dict_round_trips():
    cfg = GPTConfig(**TINY, dtype="bfloat16")
    assert cfg.to_dict() == {**TINY, "dtype": "bfloat16", "param_dtype": None}
    assert GPTConfig(**cfg.to_dict()) == cfg


@pytest.mark.parametrize(
    "overrides, field",
    [
        (dict(layers=0), "layers"),
        (dict(hidden=-8), "hidden"),
        (dict(heads=0), "heads"),
        (dict(seq=0), "seq"),
        (dict(vocab=0), "vocab"),
        (dict(hidden=10, heads=4), "hidden"),
        (dict(dtype="float64x"), "dtype"),
    ],
)
def test_bad_gpt_config_raises_naming_field(overrides, field):
    with pytest.raises(ValueError, match=field) as err:
        GPTConfig(**{**TINY, **overrides})
    for value in overrides.values():
        assert str(value) in str(err.value)


# ---------------------------------------------------------------- MLP


@pytest.fixture(scope="module")
def mlp():
    return _Jitted(MLP(MLPConfig(sizes=(5, 7, 3))))


def test_mlp_loss_matches_numpy(mlp):
    params = mlp.params
    batch = mlp.model.batch(jax.random.key(1), 8)
    p = jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64), params)
    x, y = np.asarray(batch["x"], np.float64), np.asarray(batch["y"], np.float64)
    hidden = np.tanh(x @ p["layers"][0]["w"] + p["layers"][0]["b"])
    pred = hidden @ p["layers"][1]["w"] + p["layers"][1]["b"]
    np.testing.assert_allclose(float(mlp.loss(params, batch)), ((pred - y) ** 2).mean(), rtol=1e-5)


def test_mlp_params_shapes_and_count():
    cfg = MLPConfig()
    params = jax.jit(MLP(cfg).init)(jax.random.key(0))
    assert [layer["w"].shape for layer in params["layers"]] == [(64, 128), (128, 128), (128, 64), (64, 8)]
    assert all(leaf.dtype == jnp.float32 for leaf in jax.tree_util.tree_leaves(params))
    assert cfg.num_params == _leaf_count(params)
    assert float(jnp.std(params["layers"][0]["w"])) == pytest.approx(1 / 8, rel=0.1)
    batch = MLP(cfg).batch(jax.random.key(1), 4)
    assert batch["x"].shape == (4, 64) and batch["y"].shape == (4, 8)


def test_mlp_loss_is_mean_over_microbatches(mlp):
    batch = mlp.model.batch(jax.random.key(1), 8)
    micro = [jax.tree_util.tree_map(lambda a: a[i : i + 4], batch) for i in (0, 4)]
    mean_micro = np.mean([float(mlp.loss(mlp.params, mb)) for mb in micro])
    np.testing.assert_allclose(mean_micro, float(mlp.loss(mlp.params, batch)), rtol=1e-6)


def test_mlp_config_to_dict_round_trips():
    cfg = MLPConfig(sizes=(3, 4, 5))
    assert cfg.to_dict() == {"sizes": [3, 4, 5]}
    assert MLPConfig(**cfg.to_dict()) == cfg


@pytest.mark.parametrize("sizes", [(8,), (8, 0, 2), (8, -1)])
def test_bad_mlp_config_raises_naming_field(sizes):
    with pytest.raises(ValueError, match="sizes"):
        MLPConfig(sizes=sizes)

"""The zoo Llama (and the zoo GPT's fused attention), each checked against an independent reference."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.extend import core as jex_core

import autopp
from autopp.models import GPT, GPTConfig, Llama, LlamaConfig, make_train_step
from tests._helpers import assert_trees_close, run_steps

TINY = dict(layers=2, hidden=32, heads=4, kv_heads=2, ffn=64, seq=16, vocab=64)


def _leaf_count(tree) -> int:
    return sum(int(np.prod(leaf.shape)) for leaf in jax.tree_util.tree_leaves(tree))


def _random_params(model, seed=0, std=0.3):
    """Params of the right structure with O(std) values and RMSNorm scales around 1, so that a wrong
    scale, projection or layout shows in the output."""
    rng = np.random.default_rng(seed)

    def leaf(path, a):
        name = jax.tree_util.keystr(path)
        mean = 1.0 if "scale" in name else 0.0
        return jnp.asarray(rng.normal(mean, std, a.shape), jnp.float32)

    return jax.tree_util.tree_map_with_path(leaf, model.init_abstract())


def _all_eqns(jaxpr):
    """The equations of ``jaxpr`` and of every jaxpr nested in their params (jit, custom_jvp, ...)."""
    for e in jaxpr.eqns:
        yield e
        for v in e.params.values():
            for item in v if isinstance(v, (tuple, list)) else (v,):
                if isinstance(item, jex_core.ClosedJaxpr):
                    yield from _all_eqns(item.jaxpr)
                elif isinstance(item, jex_core.Jaxpr):
                    yield from _all_eqns(item)


def _dots(fn, *args):
    return [e for e in _all_eqns(jax.make_jaxpr(fn)(*args).jaxpr) if e.primitive.name == "dot_general"]


def _dot_flops(eqn) -> int:
    (lc, _), _ = eqn.params["dimension_numbers"]
    return 2 * math.prod(eqn.outvars[0].aval.shape) * math.prod(eqn.invars[0].aval.shape[d] for d in lc)


# ---------------------------------------------------------------- numpy reference


def _np_rms_norm(scale, x, eps):
    return x / np.sqrt((x**2).mean(-1, keepdims=True) + eps) * scale


def _np_softmax(z):
    z = z - z.max(-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(-1, keepdims=True)


def _np_rope(x, theta):
    """Rotate-half RoPE as complex multiplication: ``(x_i + j x_{i+d/2}) * exp(j pos theta^(-2i/d))``."""
    s, d = x.shape[1], x.shape[-1]
    freq = theta ** (-np.arange(d // 2) * 2.0 / d)
    rot = np.exp(1j * np.arange(s)[:, None] * freq[None, :])[None, :, None, :]  # (1, s, 1, d/2)
    z = (x[..., : d // 2] + 1j * x[..., d // 2 :]) * rot
    return np.concatenate([z.real, z.imag], axis=-1)


def _np_llama_logits(params, tokens, cfg: LlamaConfig):
    """float64 numpy: explicit RoPE, GQA by repeating each kv head over its query group, explicit
    causal mask and softmax. No code shared with Llama."""
    p = jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64), params)
    B, s = tokens.shape
    nh, nkv = cfg.heads, cfg.kv_heads
    d = cfg.hidden // nh
    causal = np.tril(np.ones((s, s), bool))
    x = p["embed"][tokens]  # (B, s, h)
    for blk in p["blocks"]:
        a = blk["attn"]
        y = _np_rms_norm(blk["attn_norm"]["scale"], x, cfg.norm_eps)
        q = (y @ a["wq"]).reshape(B, s, nh, d)
        k = (y @ a["wk"]).reshape(B, s, nkv, d)
        v = (y @ a["wv"]).reshape(B, s, nkv, d)
        q, k = _np_rope(q, cfg.rope_theta), _np_rope(k, cfg.rope_theta)
        k, v = np.repeat(k, nh // nkv, axis=2), np.repeat(v, nh // nkv, axis=2)  # query head n -> kv head n // G
        scores = np.einsum("bqnd,bknd->bnqk", q, k) / np.sqrt(d)
        scores = np.where(causal, scores, -np.inf)
        ctx = np.einsum("bnqk,bknd->bqnd", _np_softmax(scores), v).reshape(B, s, nh * d)
        x = x + ctx @ a["wo"]
        m = blk["mlp"]
        y = _np_rms_norm(blk["mlp_norm"]["scale"], x, cfg.norm_eps)
        gate = y @ m["w_gate"]
        x = x + (gate / (1.0 + np.exp(-gate)) * (y @ m["w_up"])) @ m["w_down"]
    return _np_rms_norm(p["norm"]["scale"], x, cfg.norm_eps) @ p["lm_head"]


def _np_cross_entropy(logits, targets):
    zmax = logits.max(-1, keepdims=True)
    logz = np.log(np.exp(logits - zmax).sum(-1)) + zmax[..., 0]
    return (logz - np.take_along_axis(logits, targets[..., None], -1)[..., 0]).mean()


# ---------------------------------------------------------------- Llama numerics


@pytest.fixture(scope="module")
def tiny():
    return Llama(LlamaConfig(**TINY))


def test_llama_loss_matches_numpy_reference(tiny):
    params = _random_params(tiny)
    batch = tiny.batch(jax.random.key(2), 3)
    tokens, targets = np.asarray(batch["tokens"]), np.asarray(batch["targets"])
    want_logits = _np_llama_logits(params, tokens, tiny.config)
    got_logits = np.asarray(jax.jit(tiny.apply)(params, batch["tokens"]))
    assert got_logits.dtype == np.float32 and got_logits.shape == (3, TINY["seq"], TINY["vocab"])
    np.testing.assert_allclose(got_logits, want_logits, rtol=1e-4, atol=1e-4 * np.abs(want_logits).max())
    got = float(jax.jit(tiny.loss)(params, batch))
    np.testing.assert_allclose(got, _np_cross_entropy(want_logits, targets), rtol=1e-5)


@pytest.mark.parametrize("kv_heads", [1, 4])
def test_llama_mqa_and_mha_match_numpy_reference(kv_heads):
    cfg = LlamaConfig(**{**TINY, "layers": 1, "kv_heads": kv_heads, "rope_theta": 500.0, "norm_eps": 1e-3})
    model = Llama(cfg)
    params = _random_params(model, seed=5)
    batch = model.batch(jax.random.key(4), 2)
    logits = _np_llama_logits(params, np.asarray(batch["tokens"]), cfg)
    want = _np_cross_entropy(logits, np.asarray(batch["targets"]))
    np.testing.assert_allclose(float(jax.jit(model.loss)(params, batch)), want, rtol=1e-5)


def test_llama_attention_is_causal(tiny):
    params = _random_params(tiny, seed=1)
    apply = jax.jit(tiny.apply)
    tokens = tiny.batch(jax.random.key(3), 2)["tokens"]
    base = apply(params, tokens)
    for t in (0, 5, TINY["seq"] - 1):
        changed = apply(params, tokens.at[:, t].set((tokens[:, t] + 7) % TINY["vocab"]))
        np.testing.assert_array_equal(changed[:, :t], base[:, :t])
        assert not np.allclose(changed[:, t], base[:, t])


def test_llama_initial_loss_is_near_log_vocab(tiny):
    params = jax.jit(tiny.init)(jax.random.key(0))
    loss = float(jax.jit(tiny.loss)(params, tiny.batch(jax.random.key(1), 4)))
    assert abs(loss - math.log(TINY["vocab"])) < 0.1


def test_llama_batch_targets_are_next_tokens(tiny):
    batch = tiny.batch(jax.random.key(0), 2)
    assert batch["tokens"].shape == (2, TINY["seq"]) and batch["tokens"].dtype == jnp.int32
    np.testing.assert_array_equal(batch["targets"][:, :-1], batch["tokens"][:, 1:])
    np.testing.assert_array_equal(batch["targets"][:, -1], batch["tokens"][:, 0])


# ---------------------------------------------------------------- Llama params, dtypes, FLOPs


@pytest.mark.parametrize("cfg", [TINY, dict(layers=3, hidden=24, heads=6, kv_heads=3, ffn=40, seq=5, vocab=7),
                                 dict(layers=1, hidden=2, heads=1, kv_heads=1, ffn=1, seq=1, vocab=2)])
def test_llama_num_params_and_init_abstract_match_init(cfg):
    model = Llama(LlamaConfig(**cfg))
    params = jax.jit(model.init)(jax.random.key(0))
    assert model.config.num_params == _leaf_count(params)
    abstract = model.init_abstract()
    assert jax.tree_util.tree_structure(abstract) == jax.tree_util.tree_structure(params)
    for a, p in zip(jax.tree_util.tree_leaves(abstract), jax.tree_util.tree_leaves(params)):
        assert isinstance(a, jax.ShapeDtypeStruct)
        assert a.shape == p.shape and a.dtype == p.dtype == jnp.float32


def test_llama_param_layout_and_init_statistics():
    model = Llama(LlamaConfig(layers=4, hidden=64, heads=8, kv_heads=2, ffn=160, seq=8, vocab=97))
    params = jax.jit(model.init)(jax.random.key(0))
    assert set(params) == {"embed", "blocks", "norm", "lm_head"} and len(params["blocks"]) == 4
    blk = params["blocks"][0]
    assert set(blk) == {"attn_norm", "attn", "mlp_norm", "mlp"}
    shapes = {k: v.shape for k, v in {**blk["attn"], **blk["mlp"]}.items()}
    assert shapes == {"wq": (64, 64), "wk": (64, 16), "wv": (64, 16), "wo": (64, 64),
                      "w_gate": (64, 160), "w_up": (64, 160), "w_down": (160, 64)}
    assert params["embed"].shape == (97, 64) and params["lm_head"].shape == (64, 97)
    assert params["norm"]["scale"].shape == (64,) and blk["attn_norm"]["scale"].shape == (64,)
    np.testing.assert_array_equal(blk["mlp_norm"]["scale"], 1.0)
    assert float(jnp.std(blk["attn"]["wq"])) == pytest.approx(0.02, rel=0.1)
    assert float(jnp.std(blk["mlp"]["w_down"])) == pytest.approx(0.02 / math.sqrt(8), rel=0.1)


def test_llama_mixed_precision_float32_params_bfloat16_matmuls():
    model = Llama(LlamaConfig(**TINY, dtype="bfloat16", param_dtype="float32"))
    params = jax.jit(model.init)(jax.random.key(0))
    assert all(leaf.dtype == jnp.float32 for leaf in jax.tree_util.tree_leaves(params))
    assert all(leaf.dtype == jnp.float32 for leaf in jax.tree_util.tree_leaves(model.init_abstract()))
    batch = model.batch(jax.random.key(1), 2)
    dots = _dots(model.loss, params, batch)
    # 9 per block (q, k, v, the 2 attention matmuls, o, gate, up, down) + the head, all on bfloat16 operands.
    assert len(dots) == 9 * TINY["layers"] + 1
    assert all(v.aval.dtype == jnp.bfloat16 for e in dots for v in e.invars), [
        [v.aval for v in e.invars] for e in dots]
    # The logits matmul accumulates into float32.
    assert dots[-1].outvars[0].aval.dtype == jnp.float32
    loss, grads = jax.jit(jax.value_and_grad(model.loss))(params, batch)
    assert loss.dtype == jnp.float32 and bool(jnp.isfinite(loss))
    assert all(g.dtype == jnp.float32 for g in jax.tree_util.tree_leaves(grads))
    f32_loss = jax.jit(Llama(LlamaConfig(**TINY)).loss)(params, batch)
    np.testing.assert_allclose(float(loss), float(f32_loss), rtol=2e-2)


def test_llama_storage_and_compute_dtypes():
    bf16 = Llama(LlamaConfig(**TINY, dtype="bfloat16", param_dtype="bfloat16"))
    assert all(leaf.dtype == jnp.bfloat16 for leaf in jax.tree_util.tree_leaves(bf16.init_abstract()))
    f32 = Llama(LlamaConfig(**TINY))
    dots = _dots(f32.loss, f32.init_abstract(), f32.batch(jax.random.key(0), 1))
    assert [v.aval.dtype for e in dots for v in e.invars] == [jnp.float32] * 2 * (9 * TINY["layers"] + 1)


def test_llama_flops_per_step_matches_hand_count_and_traced_matmuls():
    cfg = LlamaConfig(**TINY)
    b, s, h, hd, f, v, l = 3, 16, 32, 8, 64, 64, 2
    per_block = (2 * b * s * h * 4 * hd * 2   # wq, wo: h x (4 heads * 8)
                 + 2 * b * s * h * 2 * hd * 2  # wk, wv: h x (2 kv heads * 8)
                 + 2 * (2 * b * 4 * s * s * hd)  # scores and probs @ v, 4 query heads
                 + 3 * 2 * b * s * h * f)  # w_gate, w_up, w_down
    head = 2 * b * s * h * v
    assert cfg.forward_flops(b) == l * per_block + head
    assert cfg.flops_per_step(b) == 3 * (l * per_block + head)
    assert cfg.flops_per_step(b, recompute=True) == 4 * l * per_block + 3 * head
    # The matmuls JAX actually traces for value_and_grad of the loss: exactly 3x the forward ones.
    model = Llama(cfg)
    batch = model.batch(jax.random.key(0), b)
    assert sum(map(_dot_flops, _dots(model.loss, model.init_abstract(), batch))) == cfg.forward_flops(b)
    traced = sum(map(_dot_flops, _dots(jax.value_and_grad(model.loss), model.init_abstract(), batch)))
    assert traced == cfg.flops_per_step(b)
    with pytest.raises(ValueError, match="batch_size=0"):
        cfg.flops_per_step(0)


# ---------------------------------------------------------------- config validation


def test_llama_config_defaults_and_round_trip():
    cfg = LlamaConfig(**TINY, dtype=jnp.bfloat16, rope_theta=500000)
    assert cfg.dtype == "bfloat16" and cfg.param_dtype == "float32" and cfg.norm_eps == 1e-5
    assert cfg.rope_theta == 500000.0 and isinstance(cfg.rope_theta, float)
    assert cfg.head_dim == 8
    assert cfg.to_dict() == {**TINY, "rope_theta": 500000.0, "norm_eps": 1e-5, "dtype": "bfloat16",
                             "param_dtype": "float32"}
    assert LlamaConfig(**cfg.to_dict()) == cfg


@pytest.mark.parametrize(
    "overrides, error, names",
    [
        (dict(kv_heads=3), ValueError, ("kv_heads", "3", "heads=4")),
        (dict(hidden=30), ValueError, ("hidden", "30")),
        (dict(hidden=12), ValueError, ("hidden=12", "even")),  # head dim 3: RoPE needs pairs
        (dict(dtype="float64x"), ValueError, ("dtype", "float64x")),
        (dict(param_dtype="int8"), ValueError, ("param_dtype", "int8")),
        (dict(dtype=jnp.float64), ValueError, ("dtype",)),
        (dict(layers=0), ValueError, ("layers", "0")),
        (dict(kv_heads=0), ValueError, ("kv_heads", "0")),
        (dict(ffn=-1), ValueError, ("ffn", "-1")),
        (dict(layers=2.0), TypeError, ("layers", "2.0")),
        (dict(seq=True), TypeError, ("seq", "True")),
        (dict(rope_theta=0.0), ValueError, ("rope_theta", "0.0")),
        (dict(norm_eps="1e-5"), TypeError, ("norm_eps", "1e-5")),
    ],
)
def test_bad_llama_config_raises_naming_value(overrides, error, names):
    with pytest.raises(error) as err:
        LlamaConfig(**{**TINY, **overrides})
    for name in names:
        assert name in str(err.value)


# ---------------------------------------------------------------- GPT with fused attention


def _old_gpt_block(model, p, x):
    """The zoo GPT block as it was before jax.nn.dot_product_attention: explicit einsums, mask, softmax."""
    c = model.config
    b, s, h = x.shape
    nh, hd = c.heads, c.hidden // c.heads

    def ln(q, y):
        mean = y.mean(-1, keepdims=True)
        var = jnp.square(y - mean).mean(-1, keepdims=True)
        return (y - mean) * jax.lax.rsqrt(var + 1e-5) * q["scale"] + q["bias"]

    a = p["attn"]
    qkv = ln(p["ln1"], x) @ a["qkv_w"] + a["qkv_b"]
    qkv = qkv.reshape(b, s, nh, 3, hd)  # the columns ordered head by head, q, k, v within each
    q, k, v = qkv[:, :, :, 0], qkv[:, :, :, 1], qkv[:, :, :, 2]
    scores = jnp.einsum("bqnd,bknd->bnqk", q, k, preferred_element_type=jnp.float32) / math.sqrt(hd)
    scores = jnp.where(jnp.tril(jnp.ones((s, s), dtype=bool)), scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1)
    x = x + jnp.einsum("bnqk,bknd->bqnd", probs, v).reshape(b, s, h) @ a["out_w"] + a["out_b"]
    m = p["mlp"]
    y = jax.nn.gelu(ln(p["ln2"], x) @ m["fc_w"] + m["fc_b"], approximate=True)
    return x + y @ m["proj_w"] + m["proj_b"]


def test_gpt_fused_attention_matches_hand_written_attention():
    model = GPT(GPTConfig(layers=2, hidden=32, heads=4, seq=16, vocab=64))
    params = _random_params(model, seed=7)
    batch = model.batch(jax.random.key(8), 3)

    @jax.jit
    def old_loss(params, batch):
        x = model.embed(params, batch["tokens"])
        for blk in params["blocks"]:
            x = _old_gpt_block(model, blk, x)
        logp = jax.nn.log_softmax(model.head(params, x), axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp, batch["targets"][..., None], axis=-1))

    np.testing.assert_allclose(float(jax.jit(model.loss)(params, batch)), float(old_loss(params, batch)), rtol=1e-5)
    grads, old_grads = jax.jit(jax.grad(model.loss))(params, batch), jax.jit(jax.grad(old_loss))(params, batch)
    assert_trees_close(grads, old_grads, rtol=1e-4, atol=1e-6)
    # Still exactly two attention matmuls per block next to the four projections.
    assert len(_dots(model.loss, params, batch)) == 6 * 2 + 1


# ---------------------------------------------------------------- end to end


def test_llama_pipelined_sgd_matches_plain_jit():
    model = Llama(LlamaConfig(**TINY))
    tx = optax.sgd(0.5)
    params = model.init(jax.random.key(0))
    state = (params, tx.init(params))
    batch = model.batch(jax.random.key(1), 4)
    step = make_train_step(model.loss, tx)  # autopp.value_and_grad: jax.value_and_grad outside parallelize
    (expected_state, expected_losses) = run_steps(jax.jit(step), state, batch, n=2)
    pstep = autopp.parallelize(step, num_stages=2, num_microbatches=2, schedule="1f1b", devices=jax.devices()[:2])
    got_state, got_losses = run_steps(pstep, state, batch, n=2)
    assert float(expected_losses[1]) < float(expected_losses[0])  # the step does train
    assert_trees_close(got_losses, expected_losses, rtol=1e-5)
    assert_trees_close(got_state, expected_state, rtol=1e-5)
    plan = pstep.plan_for(*state, batch)
    assert plan.num_stages == 2 and plan.num_microbatches == 2

"""Layer grouping of forward jaxprs (autopp.profiler._layers / _graph), checked against hand counts."""

from __future__ import annotations

import functools
import json
import math
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autopp
from autopp.core._trace import trace_step
from autopp.models import GPT, MLP, GPTConfig, MLPConfig
from autopp.profiler._costs import jaxpr_cost
from autopp.profiler._graph import cost_graph, format_layer_table, graph_from_json, graph_to_json
from autopp.profiler._layers import Layer, group_layers, repeated_fingerprints

B, S, H, NH, V, L = 8, 16, 32, 4, 64, 4


def _gpt(layers=L, hidden=H, heads=NH, seq=S, vocab=V):
    return GPT(GPTConfig(layers=layers, hidden=hidden, heads=heads, seq=seq, vocab=vocab))


def _batch(b=B, s=S):
    return {"tokens": jax.ShapeDtypeStruct((b, s), jnp.int32), "targets": jax.ShapeDtypeStruct((b, s), jnp.int32)}


def _traced(loss, params, batch):
    """Forward jaxpr of ``loss`` as autopp traces it (blocks inlined, Python loops unrolled)."""
    tr = trace_step(lambda p, b: autopp.grad(loss)(p, b), (params, batch), batch_argnums=(1,))
    return tr.spec.forward, tr.microbatched_grad_inputs, tr.spec.diff_mask


def _made(loss, params, batch):
    """Forward jaxpr from plain jax.make_jaxpr (keeps lax.scan as one equation)."""
    fwd = jax.make_jaxpr(loss)(params, batch)
    n_p, n_b = len(jax.tree.leaves(params)), len(jax.tree.leaves(batch))
    return fwd, [False] * n_p + [True] * n_b, [True] * n_p + [False] * n_b


def _group(loss, params, batch, trace=_traced, **kw):
    fwd, batch_mask, param_mask = trace(loss, params, batch)
    return group_layers(fwd, batch_mask, param_mask, **kw), fwd


def _nbytes(tree) -> int:
    return sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def _gpt_loss_with(model, body):
    """The zoo GPT's loss with the blocks replaced by ``body(params, x) -> x``."""
    def loss(params, batch):
        x = body(params, model.embed(params, batch["tokens"]))
        logp = jax.nn.log_softmax(model.head(params, x), axis=-1)
        return jnp.mean(-jnp.take_along_axis(logp, batch["targets"][..., None], axis=-1)[..., 0])

    return loss


def _scan_gpt(model, layers=L):
    """Scan-over-layers twin of ``model``: block params stacked on a leading axis, applied by lax.scan."""
    def body(params, x):
        return jax.lax.scan(lambda h, p: (model.block(p, h), None), x, params["blocks"])[0]

    params = dict(model.init_abstract())
    params["blocks"] = jax.tree.map(lambda *xs: jax.ShapeDtypeStruct((layers, *xs[0].shape), xs[0].dtype),
                                    *params["blocks"])
    return _gpt_loss_with(model, body), params


def _dot_flops_in(fwd, layer: Layer) -> float:
    """Independent count: 2 * output size * contracted size over the dot_generals of a layer's range."""
    total = 0.0
    for e in fwd.jaxpr.eqns[slice(*layer.eqn_range)]:
        if e.primitive.name == "dot_general":
            (lc, _), _ = e.params["dimension_numbers"]
            total += 2 * math.prod(e.outvars[0].aval.shape) * math.prod(e.invars[0].aval.shape[d] for d in lc)
    return total


@pytest.fixture(scope="module")
def gpt_layers():
    model = _gpt()
    layers, fwd = _group(model.loss, model.init_abstract(), _batch())
    return model, layers, fwd


def test_gpt_blocks_identical(gpt_layers):
    _, layers, fwd = gpt_layers
    # Design: embed (prologue) + L blocks + head (final LN, logits, loss).
    assert len(layers) == L + 2
    assert [l.name for l in layers] == ["embed"] + [f"block {k}" for k in range(L)] + ["head"]
    assert [l.index for l in layers] == list(range(L + 2))
    blocks = layers[1:-1]
    assert len({b.fingerprint for b in blocks}) == 1
    assert layers[0].fingerprint != blocks[0].fingerprint != layers[-1].fingerprint
    assert repeated_fingerprints(layers) == {blocks[0].fingerprint: list(range(1, L + 1))}
    # Contiguous ranges covering every equation; FLOPs add up to the whole forward.
    assert layers[0].eqn_range[0] == 0 and layers[-1].eqn_range[1] == len(fwd.jaxpr.eqns)
    assert all(a.eqn_range[1] == b.eqn_range[0] for a, b in zip(layers, layers[1:]))
    assert sum(l.flops for l in layers) == pytest.approx(jaxpr_cost(fwd.jaxpr).flops)
    # Blocks are whole: each holds exactly the block's six matmuls (4 projections + 2 attention).
    for b in blocks:
        names = [e.primitive.name for e in fwd.jaxpr.eqns[slice(*b.eqn_range)]]
        assert names.count("dot_general") == 6
    assert json.loads(json.dumps(layers[1].to_dict()))["eqn_range"] == list(layers[1].eqn_range)


def test_block_flops_match_hand_count(gpt_layers):
    _, layers, fwd = gpt_layers
    b, s, h, nh = B, S, H, NH
    matmul = (2 * b * s * h * 3 * h      # qkv projection
              + 2 * b * s * s * h        # attention scores q k^T
              + 2 * b * s * s * h        # probabilities x V
              + 2 * b * s * h * h        # output projection
              + 2 * b * s * h * 4 * h * 2)  # MLP up and down
    # Elementwise work per block: 2 LayerNorms (~10 ops/element), bias and residual adds, GELU (~8
    # ops/element of the 4h hidden), softmax (~6 ops/score) and the causal mask.
    elementwise_bound = (b * s * (2 * 10 * h + 3 * h + h + 4 * h + h + 2 * h + 8 * 4 * h)
                         + 6 * b * nh * s * s + 2 * s * s)
    for blk in layers[1:-1]:
        assert _dot_flops_in(fwd, blk) == matmul
        assert matmul <= blk.flops <= matmul + elementwise_bound
        # rsqrt per LayerNorm row (x2), exp per attention score, tanh per GELU element.
        assert blk.transcendentals == 2 * b * s + b * nh * s * s + b * s * 4 * h


def test_param_bytes(gpt_layers):
    model, layers, _ = gpt_layers
    h, f32 = H, 4
    for blk in layers[1:-1]:
        assert blk.param_bytes == f32 * (12 * h * h + 13 * h)
        assert blk.shared_param_bytes == 0 and len(blk.param_indices) == 12
    embed, head = layers[0], layers[-1]
    assert embed.param_bytes == f32 * (V * h + S * h)  # wte + wpe
    assert head.param_bytes == f32 * 2 * h  # final LayerNorm
    assert head.shared_param_bytes == f32 * V * h  # tied wte, owned by the embedding
    assert head.shared_param_indices == tuple(i for i in embed.param_indices if i in head.shared_param_indices)
    assert len(head.shared_param_indices) == 1
    assert sum(l.param_bytes for l in layers) == _nbytes(model.init_abstract())
    assert sum(l.param_bytes for l in layers) == f32 * model.config.num_params


def _compare(unrolled, scanned, fields=("flops", "transcendentals", "param_bytes", "activation_bytes",
                                        "output_bytes", "input_bytes", "fingerprint")):
    assert len(unrolled) == len(scanned)
    for u, s in zip(unrolled, scanned):
        assert u.name == s.name
        for f in fields:
            assert getattr(u, f) == getattr(s, f), (u.name, f, getattr(u, f), getattr(s, f))


def test_scan_over_layers_equals_unrolled():
    model = _gpt()
    scan_loss, scan_params = _scan_gpt(model)
    unrolled, _ = _group(model.loss, model.init_abstract(), _batch(), trace=_made)
    scanned, fwd = _group(scan_loss, scan_params, _batch(), trace=_made)
    scan_idx = [i for i, e in enumerate(fwd.jaxpr.eqns) if e.primitive.name == "scan"]
    assert len(scan_idx) == 1
    blocks = scanned[1:-1]
    assert [b.iteration for b in blocks] == list(range(L))
    assert all(b.eqn_range == (scan_idx[0], scan_idx[0] + 1) for b in blocks)
    assert scanned[0].iteration is None and scanned[-1].iteration is None
    _compare(unrolled, scanned)
    assert unrolled[1].param_bytes == 4 * (12 * H * H + 13 * H)
    # Expanded iterations carry the body's cost, not length x; the total matches the scan equation.
    assert sum(l.flops for l in scanned[:-1]) + scanned[-1].flops == pytest.approx(jaxpr_cost(fwd.jaxpr).flops)
    assert sum(l.param_bytes for l in scanned) == _nbytes(scan_params)
    g = cost_graph(scanned)
    assert [g.edges[k, k + 1]["bytes"] for k in range(L + 1)] == [B * S * H * 4] * (L + 1)


def test_scan_under_autopp_tracing_equals_unrolled():
    # autopp traces with jax.disable_jit(), which runs lax.scan as a Python loop over slices of the
    # stacked parameters; per-iteration slices must still be attributed to their block.
    model = _gpt()
    scan_loss, scan_params = _scan_gpt(model)
    unrolled, _ = _group(model.loss, model.init_abstract(), _batch())
    scanned, _ = _group(scan_loss, scan_params, _batch())
    _compare(unrolled, scanned)


def test_different_widths_give_different_fingerprints():
    model = _gpt()
    params = model.init_abstract()
    widths = [(k + 1) * H for k in range(L)]  # MLP width per block: h, 2h, 3h, 4h (the zoo uses 4h)
    for blk, w in zip(params["blocks"], widths):
        f32 = functools.partial(jax.ShapeDtypeStruct, dtype=jnp.float32)
        blk["mlp"] = {"fc_w": f32((H, w)), "fc_b": f32((w,)), "proj_w": f32((w, H)), "proj_b": f32((H,))}
    layers, fwd = _group(model.loss, params, _batch())
    uniform, _ = _group(model.loss, model.init_abstract(), _batch())
    assert len(layers) == L + 2  # blocks found by their operations although shapes differ
    blocks = layers[1:-1]
    assert len({b.fingerprint for b in blocks}) == L
    assert repeated_fingerprints(layers) == {}
    assert blocks[-1].fingerprint == uniform[1].fingerprint  # same shapes as the zoo block
    for blk, w in zip(blocks, widths):
        assert blk.param_bytes == 4 * (2 * H + 3 * H * H + 3 * H + H * H + H + 2 * H + 2 * H * w + w + H)
        assert _dot_flops_in(fwd, blk) == 2 * B * S * H * (3 * H + H + 2 * w) + 4 * B * S * S * H


def _user_model(layers, seq=16, hidden=32, heads=4, vocab=64):
    """A user's model whose head starts with the blocks' own first operations (an RMS norm, a cast to bf16, a
    matmul of fp32 master weights cast too), fused q/k/v split with ``jnp.split``, ``dot_product_attention``."""
    bf16, f32 = jnp.bfloat16, jnp.float32

    def rms(g, x):
        return g * x * jax.lax.rsqrt((x * x).mean(-1, keepdims=True) + 1e-6)

    def block(p, x):
        b, t, _ = x.shape
        q, k, v = jnp.split(rms(p["g1"], x).astype(bf16) @ p["qkv"].astype(bf16), 3, -1)
        heads_of = lambda z: z.reshape(b, t, heads, hidden // heads)  # noqa: E731
        a = jax.nn.dot_product_attention(heads_of(q), heads_of(k), heads_of(v), is_causal=True)
        x = x + (a.reshape(b, t, hidden) @ p["o"].astype(bf16)).astype(f32)
        y = rms(p["g2"], x).astype(bf16)
        return x + (jax.nn.gelu(y @ p["w1"].astype(bf16)) @ p["w2"].astype(bf16)).astype(f32)

    def loss(params, batch):
        x = params["emb"][batch["tok"]]
        for p in params["blocks"]:
            x = block(p, x)
        logits = (rms(params["gf"], x).astype(bf16) @ params["out"].astype(bf16)).astype(f32)
        return -jnp.take_along_axis(jax.nn.log_softmax(logits), batch["y"][..., None], -1).mean()

    sds = lambda *shape: jax.ShapeDtypeStruct(shape, f32)  # noqa: E731
    blk = {"qkv": sds(hidden, 3 * hidden), "o": sds(hidden, hidden), "w1": sds(hidden, 4 * hidden),
           "w2": sds(4 * hidden, hidden), "g1": sds(hidden), "g2": sds(hidden)}
    params = {"emb": sds(vocab, hidden), "out": sds(hidden, vocab), "gf": sds(hidden), "blocks": [blk] * layers}
    tokens = jax.ShapeDtypeStruct((2, seq), jnp.int32)
    return loss, params, {"tok": tokens, "y": tokens}


def test_blocks_are_found_when_the_head_begins_as_a_block_does():
    """The periodic region of the user model's blocks runs past the last block into the head, and the cheapest phase
    of the copies (tied with the blocks' boundary) ended inside the head, so no blocks were found at all; the forward
    was cut by FLOPs instead, through the attention (a user trial: a layer output the size of the full score matrix,
    and a 32-layer model at sequence 32768 refused as needing 286 GiB per device)."""
    found, _ = _group(*_user_model(4))
    assert [lay.name for lay in found] == ["embed", *(f"block {i}" for i in range(4)), "head"]
    assert len({lay.fingerprint for lay in found[1:-1]}) == 1


def test_layers_cut_by_flops_keep_a_fused_attention_whole():
    """With no repeated blocks (one block), the forward is cut by FLOPs, never inside a fused attention call:
    before, two layers ended on the scores and the probabilities (2 x 4 heads x 256^2 x 4 and x 2 bytes)."""
    from autopp.core import FUSED_ATTENTION_SCOPE, name_stack

    found, fwd = _group(*_user_model(1, seq=256))
    scores = 2 * 4 * 256 * 256
    assert all(lay.output_bytes < scores for lay in found), [lay.output_bytes for lay in found]
    fused = [i for i, e in enumerate(fwd.jaxpr.eqns) if FUSED_ATTENTION_SCOPE in name_stack(e)]
    assert fused and len({next(k for k, lay in enumerate(found) if lay.eqn_range[0] <= i < lay.eqn_range[1])
                          for i in fused}) == 1


def test_graph_edges_follow_dataflow(gpt_layers):
    _, layers, _ = gpt_layers
    g = cost_graph(layers)
    assert set(g.nodes) == set(range(L + 2))
    assert set(g.edges) == {(k, k + 1) for k in range(L + 1)}  # a chain: only the residual stream
    assert all(g.edges[k, k + 1]["bytes"] == B * S * H * 4 for k in range(L + 1))
    assert g.nodes[1]["fingerprint"] == layers[1].fingerprint and g.nodes[1]["eqn_range"] == list(layers[1].eqn_range)
    for blk in layers[1:-1]:
        assert blk.output_bytes == blk.input_bytes == B * S * H * 4
    assert layers[-1].output_bytes == 4  # the float32 loss


def test_graph_has_skip_connection_edges():
    model = _gpt()

    def body(params, x0):
        x = x0
        for bp in params["blocks"]:
            x = model.block(bp, x)
        return x + x0  # long skip from the embedding to the head

    layers, _ = _group(_gpt_loss_with(model, body), model.init_abstract(), _batch())
    assert len(layers) == L + 2
    g = cost_graph(layers)
    assert set(g.edges) == {(k, k + 1) for k in range(L + 1)} | {(0, L + 1)}
    assert g.edges[0, L + 1]["bytes"] == B * S * H * 4
    assert layers[0].output_bytes == B * S * H * 4  # one value, read by two layers, counted once
    assert layers[-1].input_bytes == 2 * B * S * H * 4 + B * S * 4  # two streams + int32 targets
    # a stage boundary after block k sends the stream and the embedding the head adds back (plus the targets the
    # loss reads, made by no layer): the planner's send bytes, which used to count only the last layer's output
    act = B * S * H * 4
    assert [l.crossing_bytes for l in layers] == [act] + [2 * act] * L + [0]


def test_planned_sends_include_skip_connections_as_the_runtime_s():
    """``plan_model``'s bytes sent after each stage equal what the runtime's own split of the same plan sends, for a
    model whose embedding skips to the head (before: the skip was left out, 2x too few bytes)."""
    import optax

    from autopp.models import make_train_step
    from autopp.planner import plan_model
    from autopp.profiler import Cluster, profile

    model = _gpt(layers=4, hidden=32, heads=4, seq=16, vocab=64)

    def body(params, x0):
        x = x0
        for bp in params["blocks"]:
            x = model.block(bp, x)
        return x + x0

    tx = optax.sgd(0.1)
    step = make_train_step(_gpt_loss_with(model, body), tx)
    params = model.init(jax.random.key(0))
    state, batch = (params, tx.init(params)), model.batch(jax.random.key(1), 8)
    cluster = Cluster.local(jax.devices()[:4])
    prof = profile(step, *state, batch, cluster=cluster)
    plan = plan_model(prof, cluster, global_batch=8, pipeline_degrees=(4,), tensor_degrees=(1,),
                      microbatch_sizes=(2,), schedules=("1f1b",), recompute=("none",))
    replayed = autopp.parallelize(step, plan=plan, devices=jax.devices()[:4]).plan_for(*state, batch)
    sends = [st.cut_bytes_after for st in plan.stages]
    assert sends == [st.cut_bytes_after for st in replayed.stages]
    assert all(x >= 2 * 2 * 16 * 32 * 4 for x in sends[:-1])  # stream + skip, microbatch of 2


def test_graph_json_round_trip(gpt_layers):
    _, layers, _ = gpt_layers
    g = cost_graph(layers)
    text = json.dumps(graph_to_json(g))
    back = graph_from_json(json.loads(text))
    assert dict(back.nodes(data=True)) == dict(g.nodes(data=True))
    assert sorted(back.edges(data=True)) == sorted(g.edges(data=True))
    assert back.is_directed()


def test_activation_bytes_of_linear_blocks():
    # y = x @ W: the backward pass needs x (for dW) and W (for dx, a parameter): exactly B*d*4 bytes.
    d, n = 24, 3

    def loss(params, batch):
        x = batch["x"]
        for w in params["w"]:
            x = x @ w
        return jnp.mean(jnp.square(x @ params["out"] - batch["y"]))

    params = {"w": [jax.ShapeDtypeStruct((d, d), jnp.float32)] * n, "out": jax.ShapeDtypeStruct((d, 1), jnp.float32)}
    batch = {"x": jax.ShapeDtypeStruct((B, d), jnp.float32), "y": jax.ShapeDtypeStruct((B, 1), jnp.float32)}
    layers, fwd = _group(loss, params, batch)
    dots = [l for l in layers if any(e.primitive.name == "dot_general" for e in fwd.jaxpr.eqns[slice(*l.eqn_range)])]
    assert len(dots) == n + 1
    # the first reads the batch's data (no input gradient), the others activations: one program for those
    assert len({l.fingerprint for l in dots[1:n]}) == 1 and dots[0].fingerprint != dots[1].fingerprint
    assert all(l.activation_bytes == B * d * 4 for l in dots)
    assert [l.param_bytes for l in dots] == [d * d * 4] * n + [d * 4]


def test_gpt_block_activation_bounds(gpt_layers):
    _, layers, fwd = gpt_layers
    blk = layers[1]
    # At least: the block input, softmax probabilities, and the MLP hidden activations.
    lower = B * S * H * 4 + B * NH * S * S * 4 + B * S * 4 * H * 4
    # At most: every batch-dependent value the block computes, plus its input.
    upper = B * S * H * 4 + sum(math.prod(v.aval.shape) * v.aval.dtype.itemsize
                                for e in fwd.jaxpr.eqns[slice(*blk.eqn_range)] for v in e.outvars)
    assert lower <= blk.activation_bytes <= upper
    assert layers[0].activation_bytes < blk.activation_bytes


def test_fallback_without_repeats_and_explicit_num_layers():
    model = MLP(MLPConfig(sizes=(16, 64, 8)))  # two different dense layers: nothing repeats
    batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), model.batch(jax.random.key(0), 4))
    fwd, bm, pm = _traced(model.loss, model.init_abstract(), batch)
    total = jaxpr_cost(fwd.jaxpr).flops
    layers = group_layers(fwd, bm, pm)
    assert [l.name for l in layers] == ["layer 0", "layer 1"]  # one per parameter-consuming matmul
    assert [l.param_bytes for l in layers] == [4 * (16 * 64 + 64), 4 * (64 * 8 + 8)]
    for k in (1, 3, 5):
        got = group_layers(fwd, bm, pm, num_layers=k)
        assert len(got) == k
        assert got[0].eqn_range[0] == 0 and got[-1].eqn_range[1] == len(fwd.jaxpr.eqns)
        assert all(a.eqn_range[1] == b.eqn_range[0] for a, b in zip(got, got[1:]))
        assert sum(l.flops for l in got) == pytest.approx(total)
        assert sum(l.param_bytes for l in got) == 4 * model.config.num_params
    gpt = _gpt()
    split, _ = _group(gpt.loss, gpt.init_abstract(), _batch(), num_layers=3)
    assert [l.name for l in split] == ["layer 0", "layer 1", "layer 2"]
    with pytest.raises(ValueError):
        group_layers(fwd, bm, pm, num_layers=0)


def test_format_layer_table(gpt_layers):
    _, layers, _ = gpt_layers
    table = format_layer_table(layers)
    lines = table.splitlines()
    assert lines[0].split() == ["layer", "name", "GFLOP", "param", "MB", "activation", "MB", "output", "MB",
                                "fingerprint"]
    assert len(lines) == 2 + len(layers) + 2
    assert lines[-1].startswith("total")
    total_flops = float(lines[-1].split()[3])
    assert total_flops == pytest.approx(sum(l.flops for l in layers) / 1e9, abs=1e-3)
    total_mb = float(lines[-1].split()[4])
    assert total_mb == pytest.approx(sum(l.param_bytes for l in layers) / 1e6, abs=1e-3)
    # Columns are aligned: the right-aligned GFLOP column ends at the same offset on every row.
    end = lines[0].index("GFLOP") + len("GFLOP")
    assert all(line[end - 1] != " " for line in lines[2:-2])
    assert "block 3" in table and layers[1].fingerprint[:8] in table


def test_gpt3_175b_grouping_is_fast():
    cfg = dict(layers=96, hidden=12288, heads=96, seq=2048, vocab=51200)
    model = _gpt(**cfg)
    t0 = time.perf_counter()
    fwd, bm, pm = _traced(model.loss, model.init_abstract(), _batch(1, 2048))
    t1 = time.perf_counter()
    layers = group_layers(fwd, bm, pm)
    t2 = time.perf_counter()
    print(f"\nGPT-3 175B: trace {t1 - t0:.2f} s, {len(fwd.jaxpr.eqns)} equations grouped in {t2 - t1:.3f} s")
    assert t2 - t1 < 5.0
    assert len(layers) == 98
    reps = repeated_fingerprints(layers)
    assert list(reps.values()) == [list(range(1, 97))]
    h = cfg["hidden"]
    assert all(l.param_bytes == 4 * (12 * h * h + 13 * h) for l in layers[1:-1])


def test_blocks_whose_widths_repeat_are_one_layer_each():
    """Blocks alike in their operations, with feed-forward widths that repeat every 3, are one layer each (6 + the
    embedding and the head), as blocks of all-different widths are; before, the exact repeat won: 2 layers of 3
    blocks, too coarse to pipeline and slow to plan."""
    widths = [32, 48, 64] * 2

    def loss(params, batch):
        x = params["embed"][batch["tokens"]]
        for p in params["blocks"]:
            x = x + jax.nn.gelu(x @ p["w1"]) @ p["w2"]
        logp = jax.nn.log_softmax(x @ params["out"], axis=-1)
        return -jnp.take_along_axis(logp, batch["targets"][..., None], axis=-1).mean()

    sds = jax.ShapeDtypeStruct
    params = {"embed": sds((V, H), jnp.float32), "out": sds((H, V), jnp.float32),
              "blocks": [{"w1": sds((H, f), jnp.float32), "w2": sds((f, H), jnp.float32)} for f in widths]}
    layers, _ = _group(loss, params, _batch())
    assert [l.name for l in layers] == ["embed"] + [f"block {k}" for k in range(6)] + ["head"]
    assert [l.param_bytes for l in layers[1:-1]] == [2 * H * f * 4 for f in widths]


@pytest.mark.parametrize("start", ["literal", "list"])
def test_a_running_auxiliary_loss_keeps_every_block_a_layer(start):
    """A mixture-of-experts step sums each block's auxiliary loss into a running total that starts at 0.0: the first
    block adds its loss to a literal, the others to the sum, so its dataflow differs in one operation. It is a block
    all the same, as when the losses are collected in a list and summed after the loop (the independent truth here);
    it used to be merged into the embedding ("embed" = embedding + block 0, 4 blocks named "block 0-3")."""
    def loss(params, batch):
        x = params["embed"][batch["tokens"]]
        total, parts = 0.0, []
        for p in params["blocks"]:
            h = jax.nn.gelu(x @ p["w1"])
            aux = jnp.mean(jax.nn.softmax(h, axis=-1) ** 2)
            x = x + h @ p["w2"]
            if start == "literal":
                total = total + aux
            else:
                parts.append(aux)
        total = total if start == "literal" else sum(parts)
        logp = jax.nn.log_softmax(x @ params["out"], axis=-1)
        return -jnp.take_along_axis(logp, batch["targets"][..., None], axis=-1).mean() + 0.01 * total

    sds = jax.ShapeDtypeStruct
    params = {"embed": sds((V, H), jnp.float32), "out": sds((H, V), jnp.float32),
              "blocks": [{"w1": sds((H, 64), jnp.float32), "w2": sds((64, H), jnp.float32)} for _ in range(5)]}
    layers, _ = _group(loss, params, _batch())
    assert [l.name for l in layers] == ["embed"] + [f"block {k}" for k in range(5)] + ["head"]
    assert [l.param_bytes for l in layers[1:-1]] == [2 * H * 64 * 4] * 5
    assert layers[0].param_bytes == V * H * 4

"""The intra-operator sharding ILP (:mod:`autopp.planner._sharding` over the strategy graphs of
:mod:`autopp.profiler._strategy_graph`).

1. The CP-SAT solution is optimal: on small layer programs it costs what exhaustive enumeration of the same strategy
   graph finds (every combination when there are few enough, else a neighbourhood of the ILP's choice: some nodes
   free, some binary, the rest fixed), it costs what it claims, and a cost change moves it.
2. At realistic sizes it finds Megatron-LM's tensor-parallel layout for transformer blocks (the zoo's GPT and Llama,
   MHA and GQA, and a Llama-style block written here), with the replicated and the sequence-parallel boundary.
3. It proves optimality quickly.
4. Its forward communication at t=8 is Megatron's, computed by hand from the config (GPT; also the Llama blocks).

Everything is traced abstractly (``jax.ShapeDtypeStruct``): nothing of realistic size is allocated.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
import random
import re

import jax
import jax.numpy as jnp
import optax
import pytest

import autopp
from autopp.core import _compat
from autopp.models import GPTConfig, LlamaConfig
from autopp.planner._costmodel import StepModel
from autopp.planner._sharding import brute_force, solve, total_seconds
from autopp.planner._simulate import as_profile
from autopp.profiler import Cluster, profile
from autopp.profiler._strategies import REPLICATED, layer_program, spec_name
from autopp.profiler._strategy_graph import boundary_options, build_graph
from autopp.profiler._timemodel import KernelTimeModel

S = jax.ShapeDtypeStruct
BF16 = jnp.bfloat16
CLUSTER = "1x8xH100"


@functools.cache
def _cluster() -> Cluster:
    return Cluster.parse(CLUSTER)


@functools.cache
def _tm() -> KernelTimeModel:
    return KernelTimeModel.from_device(_cluster().device)


# ---------------------------------------------------------------------------------------------------------
# 1. The ILP equals brute force on small instances

def dense(x, w, b):
    return jax.nn.relu(x @ w + b)


def mlp(x, w1, w2):
    return jax.nn.relu(x @ w1) @ w2


def norm_matmul(x, scale, w):
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + 1e-5) * scale.astype(jnp.float32)
    return y.astype(x.dtype) @ w


def einsum_attention(x, wq, wk):
    q, k = x @ wq, x @ wk
    s = jnp.einsum("bqd,bkd->bqk", q, k)
    p = jax.nn.softmax(s.astype(jnp.float32), axis=-1).astype(x.dtype)
    return jnp.einsum("bqk,bkd->bqd", p, x)


def fused_attention(q, k, v, wo):
    b, s, n, d = q.shape
    return jax.nn.dot_product_attention(q, k, v, is_causal=True).reshape(b, s, n * d) @ wo


def _trace(f, args, fused=False):
    if fused:  # as autopp does while tracing a step: the call becomes one fused-attention region
        with _compat.marking_fused_attention():
            return jax.make_jaxpr(f)(*args)
    return jax.make_jaxpr(f)(*args)


# name -> (function, argument shapes, input kinds, fused attention)
PROGRAMS = {
    "dense": (dense, [S((4096, 4096), BF16), S((4096, 16384), BF16), S((16384,), BF16)],
              ["batch", "param", "param"], False),
    "dense_data": (dense, [S((4096, 4096), BF16), S((4096, 16384), BF16), S((16384,), BF16)],
                   ["data", "param", "param"], False),
    "mlp": (mlp, [S((4096, 4096), BF16), S((4096, 16384), BF16), S((16384, 4096), BF16)],
            ["batch", "param", "param"], False),
    "norm_matmul": (norm_matmul, [S((4096, 4096), BF16), S((4096,), jnp.float32), S((4096, 4096), BF16)],
                    ["batch", "param", "param"], False),
    "norm_matmul_data": (norm_matmul, [S((4096, 4096), BF16), S((4096,), jnp.float32), S((4096, 4096), BF16)],
                         ["data", "param", "param"], False),
    "einsum_attention": (einsum_attention, [S((4, 1024, 512), BF16), S((512, 512), BF16), S((512, 512), BF16)],
                         ["batch", "param", "param"], False),
    "fused_attention": (fused_attention, [S((2, 1024, 8, 64), BF16)] * 3 + [S((512, 512), BF16)],
                        ["batch", "batch", "batch", "param"], True),
}


@functools.cache
def _program(name):
    f, args, kinds, fused = PROGRAMS[name]
    return layer_program(_trace(f, args, fused), kinds)


def _graph(name, t, boundary):
    prog = _program(name)
    opts = boundary_options(prog, t)
    spec = REPLICATED if boundary == "R" else opts[-1]
    assert boundary == "R" or spec != REPLICATED, f"{name}: no split boundary at t={t} ({opts})"
    return build_graph(prog, t, spec)


def _combinations(graph) -> int:
    return math.prod(len(n.strategies) for n in graph.nodes)


def _sub_graph(graph, keep):
    """The same graph with node k restricted to strategies ``keep[k]``."""
    nodes = [dataclasses.replace(n, strategies=[n.strategies[i] for i in ks]) for n, ks in zip(graph.nodes, keep)]
    return dataclasses.replace(graph, nodes=nodes)


def _neighbourhood(graph, choice, cap, seed=0):
    """A sub-graph holding ``choice`` with at most ``cap`` combinations: nodes in a seeded random order get all their
    strategies, else {replicated, chosen}, else only the chosen one, while the product stays under ``cap``."""
    rng = random.Random(seed)
    keep = [[c] for c in choice]
    order = list(range(len(graph.nodes)))
    rng.shuffle(order)
    prod = 1
    for k in order:
        for cand in (list(range(len(graph.nodes[k].strategies))), sorted({0, choice[k]})):
            size = prod // len(keep[k]) * len(cand)
            if size <= cap:
                prod, keep[k] = size, cand
                break
    return _sub_graph(graph, keep), prod


# (program, t, boundary): every combination enumerated (each under 50k)
FULL_CASES = [
    ("dense", 2, "R"),
    ("dense", 4, "split"),
    ("dense_data", 2, "R"),
    ("dense_data", 4, "split"),
    ("norm_matmul_data", 2, "R"),
    ("fused_attention", 4, "split"),
]

# (program, t, boundary): a neighbourhood of the ILP's choice enumerated
NEIGHBOURHOOD_CASES = [
    ("mlp", 2, "R"),
    ("mlp", 4, "split"),
    ("norm_matmul", 4, "split"),
    ("einsum_attention", 2, "R"),
    ("einsum_attention", 4, "split"),
    ("fused_attention", 2, "R"),
]


@pytest.mark.parametrize("name,t,boundary", FULL_CASES, ids=[f"{n}-t{t}-{b}" for n, t, b in FULL_CASES])
def test_ilp_equals_brute_force(name, t, boundary):
    cl, tm = _cluster(), _tm()
    graph = _graph(name, t, boundary)
    n = _combinations(graph)
    assert n <= 100_000, f"{name}: {n} combinations, too many to enumerate in a unit test"
    sol = solve(graph, tm, cl)
    ref = brute_force(graph, tm, cl, limit=100_000)
    assert sol.status == "OPTIMAL"
    assert sol.objective_s == pytest.approx(ref.objective_s, rel=1e-9, abs=0)
    assert total_seconds(graph, sol.choice, tm, cl) == pytest.approx(sol.objective_s, rel=1e-12, abs=0)
    # not a trivial instance: sharding pays (the everything-replicated assignment costs more)
    assert sol.objective_s < total_seconds(graph, [0] * len(graph.nodes), tm, cl)


@pytest.mark.parametrize("name,t,boundary", NEIGHBOURHOOD_CASES,
                         ids=[f"{n}-t{t}-{b}" for n, t, b in NEIGHBOURHOOD_CASES])
def test_ilp_equals_brute_force_on_a_neighbourhood(name, t, boundary):
    """Too many combinations to enumerate: enumerate a sub-graph holding the ILP's choice instead. Its optimum is
    the ILP's objective (else the ILP missed a cheaper assignment), and the ILP solves the sub-graph optimally too."""
    cl, tm = _cluster(), _tm()
    graph = _graph(name, t, boundary)
    full = solve(graph, tm, cl)
    assert full.status == "OPTIMAL"
    assert total_seconds(graph, full.choice, tm, cl) == pytest.approx(full.objective_s, rel=1e-12, abs=0)
    sub, n = _neighbourhood(graph, full.choice, cap=15_000)
    assert n == _combinations(sub) and n >= 5_000, n
    ref = brute_force(sub, tm, cl, limit=15_000)
    assert ref.objective_s == pytest.approx(full.objective_s, rel=1e-9, abs=0)
    sol = solve(sub, tm, cl)
    assert sol.objective_s == pytest.approx(ref.objective_s, rel=1e-9, abs=0)
    assert sol.objective_s < total_seconds(graph, [0] * len(graph.nodes), tm, cl)


def test_a_slower_link_changes_the_answer():
    """Not vacuous: on H100's NVLink the dense layer is column-parallel; with a link 450x slower the cheapest layout
    replicates both parameters, and the ILP still equals enumeration."""
    tm = _tm()
    graph = _graph("dense_data", 2, "R")
    params = [k for k, n in enumerate(graph.nodes) if n.kind == "param"]
    out = {}
    for label, cl in (("nvlink", _cluster()), ("slow", _cluster().with_device_overrides(intra_node_bandwidth=1e9))):
        sol, ref = solve(graph, tm, cl), brute_force(graph, tm, cl, limit=100_000)
        assert sol.objective_s == pytest.approx(ref.objective_s, rel=1e-9, abs=0)
        out[label] = (sol, tuple(graph.nodes[k].strategies[sol.choice[k]].out for k in params))
    (fast, fast_specs), (slow, slow_specs) = out["nvlink"], out["slow"]
    assert fast_specs == (1, 0)  # w (in, out) split by columns, its bias with it
    assert slow_specs == (REPLICATED, REPLICATED)
    assert fast.choice != slow.choice
    assert slow.objective_s > fast.objective_s


def test_everything_replicated_is_communication_free():
    cl = _cluster().with_device_overrides(intra_node_bandwidth=1e6)
    graph = _graph("dense_data", 2, "R")
    choice = tuple(0 for _ in graph.nodes)
    fast = _cluster()
    # the replicated assignment does not depend on the link
    assert total_seconds(graph, choice, _tm(), cl) == pytest.approx(total_seconds(graph, choice, _tm(), fast))


# ---------------------------------------------------------------------------------------------------------
# 2. Megatron's layout at realistic sizes

GPT = GPTConfig(layers=2, hidden=4096, heads=32, seq=2048, vocab=32000, dtype="bfloat16", param_dtype="float32")


def _llama(kv_heads):
    return LlamaConfig(layers=2, hidden=4096, heads=32, kv_heads=kv_heads, ffn=11008, seq=2048, vocab=32000,
                       dtype="bfloat16", param_dtype="float32")


# A Llama-style model written here: RMSNorm, interleaved-pair (Meta-style) RoPE, GQA through
# jax.nn.dot_product_attention, SwiGLU; parameters a list of dicts in float32, cast to bfloat16 inside the loss.
MY = dict(layers=2, hidden=2048, heads=16, kv_heads=8, ffn=5632, seq=2048, vocab=32000)


def _my_params():
    h, hd, f = MY["hidden"], MY["hidden"] // MY["heads"], MY["ffn"]
    f32 = jnp.float32
    block = {"attn_norm": S((h,), f32), "wq": S((h, MY["heads"] * hd), f32), "wk": S((h, MY["kv_heads"] * hd), f32),
             "wv": S((h, MY["kv_heads"] * hd), f32), "wo": S((MY["heads"] * hd, h), f32), "mlp_norm": S((h,), f32),
             "w_gate": S((h, f), f32), "w_up": S((h, f), f32), "w_down": S((f, h), f32)}
    return [{"embed": S((MY["vocab"], h), f32)}, *[dict(block) for _ in range(MY["layers"])],
            {"norm": S((h,), f32), "out": S((h, MY["vocab"]), f32)}]


def _rms(x, scale):
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + 1e-6) * scale).astype(x.dtype)


def _rope(x):
    """Meta's convention: dimensions (2i, 2i+1) of a head rotate together."""
    b, s, n, hd = x.shape
    inv = 1.0 / (10000.0 ** (jnp.arange(0, hd, 2, dtype=jnp.float32) / hd))
    ang = jnp.arange(s, dtype=jnp.float32)[:, None] * inv[None, :]  # (s, hd/2)
    cos, sin = jnp.cos(ang)[None, :, None, :], jnp.sin(ang)[None, :, None, :]
    xr = x.astype(jnp.float32).reshape(b, s, n, hd // 2, 2)
    x0, x1 = xr[..., 0], xr[..., 1]
    out = jnp.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], axis=-1)
    return out.reshape(b, s, n, hd).astype(x.dtype)


def _my_block(p, x):
    b, s, h = x.shape
    nh, nkv = MY["heads"], MY["kv_heads"]
    hd = h // nh
    p = {k: v.astype(BF16) if k not in ("attn_norm", "mlp_norm") else v for k, v in p.items()}
    y = _rms(x, p["attn_norm"])
    q = _rope((y @ p["wq"]).reshape(b, s, nh, hd))
    k = _rope((y @ p["wk"]).reshape(b, s, nkv, hd))
    v = (y @ p["wv"]).reshape(b, s, nkv, hd)
    x = x + jax.nn.dot_product_attention(q, k, v, is_causal=True).reshape(b, s, h) @ p["wo"]
    y = _rms(x, p["mlp_norm"])
    return x + (jax.nn.silu(y @ p["w_gate"]) * (y @ p["w_up"])) @ p["w_down"]


def _my_loss(params, batch):
    embed, *blocks, head = params
    x = embed["embed"].astype(BF16)[batch["tokens"]]
    for p in blocks:
        x = _my_block(p, x)
    logits = jnp.einsum("bsh,hv->bsv", _rms(x, head["norm"]), head["out"].astype(BF16),
                        preferred_element_type=jnp.float32)
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, batch["targets"][..., None], axis=-1))


_MY_TX = optax.adamw(3e-4, weight_decay=0.1)


def _my_step(params, opt_state, batch):
    loss, grads = autopp.value_and_grad(_my_loss)(params, batch)
    updates, opt_state = _MY_TX.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


MODELS = {
    "gpt": GPT,
    "llama-mha": _llama(32),
    "llama-gqa8": _llama(8),
    "llama-gqa4": _llama(4),
    "my-llama": "my-llama",
}


@functools.cache
def _model(name):
    """(profile, step model, the first block's layer profile, the block's parameter names by program input)."""
    cl = _cluster()
    if name == "my-llama":
        params = _my_params()
        opt_state = jax.eval_shape(_MY_TX.init, params)
        batch = {"tokens": S((1, MY["seq"]), jnp.int32), "targets": S((1, MY["seq"]), jnp.int32)}
        prof = profile(_my_step, params, opt_state, batch, cluster=cl, batch_argnums=(2,))
    else:
        prof = as_profile(MODELS[name], cl, "test_sharding")
    sm = StepModel(prof, cl)
    blocks = [lay for lay in prof.layers if lay.name.startswith("block")]
    assert len(blocks) == 2, [lay.name for lay in prof.layers]
    block = blocks[0]
    names = {}
    for pos, k in enumerate(block.param_inputs):
        if k is not None:
            keys = [key for key in re.findall(r"\['(\w+)'\]", prof.param_names[k]) if key != "blocks"]
            names[pos] = "/".join(keys)
    return prof, sm, block, names


def _block_cost(name, t, sp):
    _, sm, block, names = _model(name)
    boundary = sm.boundary(block.fingerprint, t, sequence_parallel=sp)
    if sp:
        assert boundary == 1, f"sequence-parallel boundary {spec_name(boundary)}"  # (batch, seq, hidden): the seq
    lc = sm.layer_cost(block.fingerprint, t, boundary)
    return lc, {names[pos]: spec for pos, spec in lc.param_specs.items()}


def _megatron(name, t):
    """The parameter specs of Megatron-LM's tensor parallelism (column-parallel in, row-parallel out)."""
    col, row = 1, 0
    if name == "gpt":
        return {"attn/qkv_w": col, "attn/qkv_b": 0, "attn/out_w": row, "mlp/fc_w": col, "mlp/fc_b": 0,
                "mlp/proj_w": row}
    if name == "my-llama":
        kv = col if MY["kv_heads"] % t == 0 else REPLICATED
        return {"wq": col, "wk": kv, "wv": kv, "wo": row, "w_gate": col, "w_up": col, "w_down": row}
    kv = col if MODELS[name].kv_heads % t == 0 else REPLICATED
    return {"attn/wq": col, "attn/wk": kv, "attn/wv": kv, "attn/wo": row, "mlp/w_gate": col, "mlp/w_up": col,
            "mlp/w_down": row}


MEGATRON_CASES = [(m, t, sp) for m in ("gpt", "llama-mha", "llama-gqa8", "my-llama") for t in (2, 8)
                  for sp in (False, True)] + [("llama-gqa4", 8, sp) for sp in (False, True)]


@pytest.mark.parametrize("name,t,sp", MEGATRON_CASES,
                         ids=[f"{m}-t{t}-{'sp' if sp else 'R'}" for m, t, sp in MEGATRON_CASES])
def test_megatron_layout_is_found(name, t, sp):
    lc, specs = _block_cost(name, t, sp)
    want = _megatron(name, t)
    got = {k: specs[k] for k in want}
    others = {k: spec_name(v) for k, v in sorted(specs.items()) if k not in want}
    print(f"{name} t={t} {'sequence-parallel' if sp else 'replicated'} boundary: other parameters {others}")
    assert got == want, (
        "not Megatron's layout: " + ", ".join(f"{k}={spec_name(got[k])} (want {spec_name(want[k])})"
                                             for k in want if got[k] != want[k])
        + f"; all: {{{', '.join(f'{k}: {spec_name(v)}' for k, v in sorted(specs.items()))}}}")
    # a norm scale / bias is a vector: replicated or split along its only dimension (1/t of it per device, gathered
    # in the forward, its gradient reduce-scattered instead of all-reduced: the same traffic), never partial
    for k, v in others.items():
        assert v in ("R", "S(0)"), (k, v)


@pytest.mark.parametrize("name,t", [("my-llama", 2), ("my-llama", 8), ("gpt", 8)])
def test_sequence_parallel_keeps_every_activation_split(name, t):
    """Sequence parallelism (Korthikanti et al. 2022) divides every activation a layer keeps for its backward by
    the tensor degree: the norms run on sequence shards and their outputs are gathered again in the backward, not
    kept whole. The independent truth: the unsplit layer's residual bytes over ``t``. Without sequence parallelism
    the norms' values are kept whole."""
    unsplit, _ = _block_cost(name, 1, False)
    lc, _ = _block_cost(name, t, True)
    print(f"{name} t={t}: residuals {lc.residual_bytes / 2**20:.2f} MiB per device, unsplit "
          f"{unsplit.residual_bytes / 2**20:.2f} MiB")
    assert lc.residual_bytes == pytest.approx(unsplit.residual_bytes / t, rel=1e-6)
    whole, _ = _block_cost(name, t, False)
    assert whole.residual_bytes > 1.2 * unsplit.residual_bytes / t


# ---------------------------------------------------------------------------------------------------------
# 3. Optimality is proven, quickly

@pytest.mark.parametrize("name,t,sp", [("gpt", 8, False), ("my-llama", 8, True)])
def test_block_ilp_is_optimal_and_fast(name, t, sp):
    lc, _ = _block_cost(name, t, sp)
    sol = lc.solution
    nodes = len(sol.graph.nodes)
    print(f"{name} t={t} sp={sp}: {nodes} nodes, status {sol.status}, gap {sol.gap:.2e}, "
          f"wall {sol.wall_time_s:.3f} s")
    assert sol.status == "OPTIMAL"
    assert sol.gap == pytest.approx(0.0, abs=1e-9)
    assert sol.wall_time_s < 10.0


# ---------------------------------------------------------------------------------------------------------
# 4. Megatron's communication volume, by hand

def _forward_activation_collectives(lc):
    """The forward's batch-dependent collectives as a multiset of (kind, bytes), an all-reduce counted as the
    reduce-scatter and all-gather it is made of (the same bytes on the same ring: with the replicated boundary the
    solver may keep the residual stream sequence-split inside the block, as sequence parallelism does)."""
    out = collections.Counter()
    for c in lc.collectives:
        if c.backward or not c.batch_bytes:
            continue
        for kind in (("reduce-scatter", "all-gather") if c.kind == "all-reduce" else (c.kind,)):
            out[kind, c.batch_bytes] += 1
    return out


def _describe(lc):
    return "; ".join(f"{c.kind} {c.what}" for c in lc.collectives if not c.backward and c.batch_bytes)


def _activation_bytes(name):
    """One microbatch's (batch, seq, hidden) activation in bfloat16, from the config."""
    if name == "my-llama":
        return 1 * MY["seq"] * MY["hidden"] * 2
    c = MODELS[name]
    return 1 * c.seq * c.hidden * 2


FORWARD_CASES = [
    pytest.param("gpt", False, id="gpt-R"),
    pytest.param("gpt", True, id="gpt-sp"),
    pytest.param("llama-mha", False, id="llama-mha-R"),
    pytest.param("llama-mha", True, id="llama-mha-sp"),
    pytest.param("llama-gqa8", False, id="llama-gqa8-R"),
    pytest.param("my-llama", False, id="my-llama-R"),
]


@pytest.mark.parametrize("name,sp", FORWARD_CASES)
def test_forward_collectives_are_megatrons(name, sp):
    """At t=8, Megatron's forward moves the (batch, seq, hidden) activation exactly twice per block: an all-reduce
    after the attention's and the MLP's row-parallel matmul (replicated boundary), or an all-gather before each
    column-parallel matmul and a reduce-scatter after each row-parallel one (sequence-parallel boundary)."""
    lc, _ = _block_cost(name, 8, sp)
    n = _activation_bytes(name)
    want = collections.Counter({("all-gather", n): 2, ("reduce-scatter", n): 2})
    got = _forward_activation_collectives(lc)
    assert got == want, f"forward collectives: {_describe(lc)}"

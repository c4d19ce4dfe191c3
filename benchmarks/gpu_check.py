"""The one prepared script for a lent GPU (the ``device`` tool's H200): measurements no CPU can make.

``python -m benchmarks.gpu_check OUT_DIR`` runs each part in its own process (a clean allocator peak per part) and
writes ``OUT_DIR/<part>.json``; ``--small`` runs the same code at toy sizes on any backend (a dry run on CPU).

Parts:

- ``llama_jit`` / ``llama_autopp``: a bf16-compute Llama of about 1.1B parameters (TinyLlama's shape: 22 layers,
  hidden 2048, 32 heads, 4 KV heads, FFN 5632, vocab 32000, seq 2048; fp32 master weights, AdamW), one step on one
  GPU, as plain ``jax.jit`` (parameters and optimizer state donated) and as ``autopp.parallelize`` on one stage:
  first-call and median step time, model FLOP/s and MFU against the bf16 datasheet peak, autopp's
  ``memory_report`` against XLA's ``memory_analysis()`` and the allocator's measured peak.
- ``gpt_layers``: Megatron-LM's 1.7B GPT of ``../shared/reference/gpt_h100_measured.json`` (24 layers, hidden 2048,
  16 heads, seq 4096, vocab 131072, bf16 compute, fp32 master weights) written as the fidelity tests write it: the
  profiler's per-layer times measured on this GPU against its analytical times for the same device, and the whole
  jitted step's time against ``simulate``'s prediction.
- ``kernels``: the 1.7B model's matmul shapes, its attention (XLA's lowering and cuDNN's fused kernel) and its
  float32 cross-entropy over 131072 words, each timed alone with a wait per call (the host's latency included).
- ``hopper``: the same kernels and one block (cuDNN attention) at 1, 2 and 4 sequences, timed with calls queued
  (device time): what the figures in docs/benchmarks.md quote.
- ``gpt_step``: the 1.7B model's whole jitted step with cuDNN attention at 2 and 4 sequences.
- ``update``: the optimizer update alone (SGD, AdamW, AdamW with clipping): XLA's ``bytes accessed`` and the time.
- ``llama_probe``: the 1.1B Llama's step under autopp and under jit with and without donation, and autopp's one
  program called directly.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

PARTS = ("llama_jit", "llama_autopp", "kernels", "gpt_layers", "hopper", "gpt_step", "update", "llama_probe")
BF16_PEAK = 989e12  # NVIDIA H100/H200 SXM datasheet: 1,979 TFLOPS bf16 with sparsity -> 989 dense


def _timed(fn, *args, repeats=5, warmup=2):
    import jax

    for _ in range(warmup):
        out = fn(*args)
        jax.block_until_ready(out)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _peak_bytes():
    import jax

    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use")


def _llama(small):
    from autopp.models import Llama, LlamaConfig

    if small:
        cfg = LlamaConfig(layers=2, hidden=64, heads=4, kv_heads=2, ffn=128, seq=32, vocab=256, dtype="bfloat16")
        return Llama(cfg), 2
    cfg = LlamaConfig(layers=22, hidden=2048, heads=32, kv_heads=4, ffn=5632, seq=2048, vocab=32000,
                      dtype="bfloat16", param_dtype="float32")
    return Llama(cfg), 4


def _llama_args(model, batch):
    import jax
    import optax

    tx = optax.adamw(1e-4)
    params = model.init(jax.random.key(0))
    opt_state = tx.init(params)
    data = model.batch(jax.random.key(1), batch)
    return tx, params, opt_state, data


def _tree_bytes(tree):
    import jax

    return int(sum(x.nbytes for x in jax.tree.leaves(tree)))


def part_llama(small, use_autopp):
    import jax

    import autopp
    from autopp.models import make_train_step

    model, batch = _llama(small)
    tx, params, opt_state, data = _llama_args(model, batch)
    arg_bytes = _tree_bytes((params, opt_state, data))
    flops = model.config.flops_per_step(batch)
    out = {"model": model.config.to_dict(), "batch": batch, "params": model.config.num_params,
           "arg_bytes": arg_bytes, "model_flops_per_step": flops, "device": str(jax.devices()[0].device_kind)}
    t = time.perf_counter()
    if use_autopp:
        step = autopp.parallelize(make_train_step(model.loss, tx), num_stages=1, num_microbatches=1,
                                  devices=jax.devices()[:1])
    else:
        step = jax.jit(make_train_step(model.loss, tx, value_and_grad=jax.value_and_grad), donate_argnums=(0, 1))
        compiled = step.lower(params, opt_state, data).compile()
        ma = compiled.memory_analysis()
        out["xla_memory"] = {k: int(getattr(ma, k)) for k in (
            "argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes", "temp_size_in_bytes")}
        ca = compiled.cost_analysis()
        ca = ca[0] if isinstance(ca, (list, tuple)) else ca
        out["xla_flops"] = float(ca.get("flops", 0.0))
    params, opt_state, loss = step(params, opt_state, data)
    jax.block_until_ready(loss)
    out["first_call_s"] = time.perf_counter() - t  # trace, compile and run (jit: lower + compile + run)
    if use_autopp:
        out["memory_report"] = {str(k): v for k, v in step.memory_report(params, opt_state, data).items()}
    times = []
    for _ in range(6):
        t = time.perf_counter()
        params, opt_state, loss = step(params, opt_state, data)
        jax.block_until_ready((params, loss))
        times.append(time.perf_counter() - t)
    out["step_times_s"] = times
    out["step_s"] = statistics.median(times)
    out["loss"] = float(loss)
    out["model_tflops"] = flops / out["step_s"] / 1e12
    out["mfu"] = flops / out["step_s"] / BF16_PEAK
    out["peak_bytes_in_use"] = _peak_bytes()
    return out


def _megatron(small):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from tests._megatron import MegatronGPT

    if small:
        return MegatronGPT(layers=2, hidden=64, heads=4, seq=64, vocab=512, dtype="bfloat16",
                           fused_attention=True), 2
    return MegatronGPT(layers=24, hidden=2048, heads=16, seq=4096, vocab=131072, dtype="bfloat16",
                       fused_attention=True), 2


def part_gpt_layers(small):
    """The profiler's per-layer times measured on this device against its analytical times, and ``simulate``'s step
    against the jitted step (attention as the model writes it)."""
    from autopp.planner import simulate
    from autopp.profiler import Cluster, profile

    model, mbs = _megatron(small)
    step, args = model.step_and_args(mbs)
    local = Cluster.local()
    analytic = profile(step, *args, cluster=local)
    measured = profile(step, *args, measure=True)
    out = {"device": local.device.name, "microbatch_size": mbs, "layers": []}
    for a, m in zip(analytic.layers, measured.layers):
        if any(d["name"] == a.name for d in out["layers"]) or (a.name.startswith("block") and a.index > 2):
            continue
        out["layers"].append({"name": a.name, "flops": a.flops, "backward_flops": a.backward_flops,
                              "analytic_fwd_s": a.forward_time_s, "analytic_bwd_s": a.backward_time_s,
                              "measured_fwd_s": m.forward_time_s, "measured_bwd_s": m.backward_time_s})
    est = simulate(analytic, local, global_batch=mbs, tp=1, pp=1, dp=1, microbatch_size=mbs, recompute="none")
    out["predicted_step_s"] = est.step_time_s
    out["predicted_peak_bytes"] = est.peak_memory_bytes_per_gpu

    # the whole step, jitted, at the same microbatch (one microbatch per step)
    run, flops = _megatron_step(model, mbs)
    out["jit_step_s"] = _timed(run, repeats=5)
    out["reference_model_flops"] = flops
    out["jit_model_tflops"] = flops / out["jit_step_s"] / 1e12
    out["peak_bytes_in_use"] = _peak_bytes()
    return out


def part_kernels(small):
    import jax
    import jax.numpy as jnp

    b, s, h, nh, V = (2, 64, 64, 4, 512) if small else (2, 4096, 2048, 16, 131072)
    M = b * s
    key = jax.random.key(0)
    out = {"matmuls": [], "attention": [], "cross_entropy": {}}
    for name, (m, k, n) in {"qkv": (M, h, 3 * h), "out": (M, h, h), "fc": (M, h, 4 * h), "proj": (M, 4 * h, h),
                            "head": (M, h, V), "square8192": (8192, 8192, 8192) if not small else (64, 64, 64)
                            }.items():
        x = jax.random.normal(key, (m, k), jnp.bfloat16)
        w = jax.random.normal(key, (k, n), jnp.bfloat16)
        f = jax.jit(lambda x, w: x @ w)
        t = _timed(f, x, w, repeats=10)
        out["matmuls"].append({"name": name, "m": m, "k": k, "n": n, "s": t, "tflops": 2 * m * k * n / t / 1e12})
    hd = h // nh
    q, k_, v = (jax.random.normal(kk, (b, s, nh, hd), jnp.bfloat16) for kk in jax.random.split(key, 3))
    causal_fwd_flops = 4 * b * nh * s * s * hd / 2  # two s x s matmuls, half the blocks (causal)
    for impl in (None, "cudnn"):
        try:
            def loss(q, k, v, impl=impl):
                return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=impl).astype(
                    jnp.float32).sum()

            fwd = jax.jit(lambda q, k, v, impl=impl: jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                                                                   implementation=impl))
            both = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
            tf, tb = _timed(fwd, q, k_, v, repeats=10), _timed(both, q, k_, v, repeats=10)
            out["attention"].append({"implementation": impl or "xla (default)", "fwd_s": tf, "fwd_bwd_s": tb,
                                     "fwd_tflops_causal": causal_fwd_flops / tf / 1e12,
                                     "fwd_bwd_tflops_causal_3x": 3 * causal_fwd_flops / tb / 1e12})
        except Exception as e:  # noqa: BLE001 - cuDNN's kernel may be missing; record why
            out["attention"].append({"implementation": impl or "xla (default)", "error": repr(e)[:400]})
    logits = jax.random.normal(key, (b, s, V), jnp.float32)
    tgt = jax.random.randint(key, (b, s), 0, V)

    def ce(logits):
        logp = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.take_along_axis(logp, tgt[..., None], axis=-1).mean()

    tf = _timed(jax.jit(ce), logits, repeats=10)
    tb = _timed(jax.jit(jax.grad(ce)), logits, repeats=10)
    nbytes = logits.nbytes
    out["cross_entropy"] = {"logits_bytes": nbytes, "fwd_s": tf, "fwd_bwd_s": tb,
                            "fwd_bytes_per_s_1read": nbytes / tf, "fwd_bwd_bytes_per_s_1read_1write": 2 * nbytes / tb}
    x = jax.random.normal(key, (256 * 1024 * 1024,) if not small else (1024,), jnp.float32)
    t = _timed(jax.jit(lambda x: x * 2.0 + 1.0), x, repeats=10)
    out["copy_bytes_per_s"] = 2 * x.nbytes / t
    return out


def _queued(fn, *args, n=30):
    """Seconds per call of ``fn(*args)`` with ``n`` calls queued before one wait: the device's time, not the host's
    dispatch latency (which a wait per call adds to every sub-millisecond kernel)."""
    import jax

    jax.block_until_ready(fn(*args))
    jax.block_until_ready(fn(*args))
    t = time.perf_counter()
    for _ in range(n):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t) / n


def part_hopper(small):
    """The 1.7B model's kernels and its block, each timed with calls queued (device time), attention as cuDNN's
    fused kernel: what its layers cost on a Hopper GPU, against the cost model's analytical times."""
    import functools

    import jax
    import jax.numpy as jnp

    h, nh, V, s = (64, 4, 512, 64) if small else (2048, 16, 131072, 4096)
    key = jax.random.key(0)
    out = {"matmuls": [], "attention": [], "blocks": [], "cross_entropy": [], "embedding_backward": []}
    for mbs in (1, 2, 4):
        T = mbs * s
        shapes = {"qkv": (T, h, 3 * h), "out": (T, h, h), "fc": (T, h, 4 * h), "proj": (T, 4 * h, h),
                  "head": (T, h, V), "fc_dW": (h, T, 4 * h), "proj_dX": (T, h, 4 * h)}
        for name, (m, k, n) in shapes.items():
            if name == "head" and mbs == 4:
                continue
            x = jax.random.normal(key, (m, k), jnp.bfloat16)
            w = jax.random.normal(key, (k, n), jnp.bfloat16)
            t = _queued(jax.jit(lambda x, w: x @ w), x, w)
            out["matmuls"].append({"name": name, "mbs": mbs, "m": m, "k": k, "n": n, "s": t,
                                   "tflops": 2 * m * k * n / t / 1e12})
    sq = 64 if small else 8192
    x = jax.random.normal(key, (sq, sq), jnp.bfloat16)
    t = _queued(jax.jit(lambda x: x @ x), x)
    out["matmuls"].append({"name": "square", "m": sq, "k": sq, "n": sq, "s": t, "tflops": 2 * sq**3 / t / 1e12})
    hd = h // nh
    cudnn = functools.partial(jax.nn.dot_product_attention, implementation="cudnn")
    for mbs in (1, 2, 4):
        q, k_, v = (jax.random.normal(kk, (mbs, s, nh, hd), jnp.bfloat16) for kk in jax.random.split(key, 3))
        fwd = jax.jit(lambda q, k, v: cudnn(q, k, v, is_causal=True))
        both = jax.jit(jax.grad(lambda q, k, v: cudnn(q, k, v, is_causal=True).astype(jnp.float32).sum(),
                                argnums=(0, 1, 2)))
        causal_fwd_flops = 4 * mbs * nh * s * s * hd / 2
        try:
            tf, tb = _queued(fwd, q, k_, v), _queued(both, q, k_, v)
            out["attention"].append({"mbs": mbs, "fwd_s": tf, "fwd_bwd_s": tb,
                                     "fwd_tflops_causal": causal_fwd_flops / tf / 1e12,
                                     "bwd_tflops_causal_2.5x": 2.5 * causal_fwd_flops / (tb - tf) / 1e12})
        except Exception as e:  # noqa: BLE001
            out["attention"].append({"mbs": mbs, "error": repr(e)[:400]})
    model, _ = _megatron(small)
    params = jax.tree.map(lambda a: jax.random.normal(key, a.shape, a.dtype) * 0.02,
                          model.abstract_params()["blocks"][0])
    original = jax.nn.dot_product_attention
    for mbs in (1, 2, 4):
        xin = jax.random.normal(key, (mbs, s, h), jnp.bfloat16)
        try:
            jax.nn.dot_product_attention = cudnn
            fwd = jax.jit(model.block)

            def fwd_bwd(p, x):
                y, vjp = jax.vjp(model.block, p, x)
                return vjp(jnp.ones_like(y))

            both = jax.jit(fwd_bwd)
            tf, tb = _queued(fwd, params, xin), _queued(both, params, xin)
            out["blocks"].append({"mbs": mbs, "fwd_s": tf, "fwd_bwd_s": tb})
        except Exception as e:  # noqa: BLE001
            out["blocks"].append({"mbs": mbs, "error": repr(e)[:400]})
        finally:
            jax.nn.dot_product_attention = original
    for mbs in (1, 2):
        logits = jax.random.normal(key, (mbs, s, V), jnp.float32)
        tgt = jax.random.randint(key, (mbs, s), 0, V)

        def ce(logits, tgt=tgt):
            logp = jax.nn.log_softmax(logits, axis=-1)
            return -jnp.take_along_axis(logp, tgt[..., None], axis=-1).mean()

        tf, tb = _queued(jax.jit(ce), logits), _queued(jax.jit(jax.grad(ce)), logits)
        out["cross_entropy"].append({"mbs": mbs, "logits_bytes": logits.nbytes, "fwd_s": tf, "fwd_bwd_s": tb})
        table = jax.random.normal(key, (V, h), jnp.float32)
        tok = jax.random.randint(key, (mbs, s), 0, V)
        emb_bwd = jax.jit(jax.grad(lambda t, tok=tok: t.astype(jnp.bfloat16)[tok].astype(jnp.float32).sum()))
        out["embedding_backward"].append({"mbs": mbs, "table_bytes": table.nbytes, "s": _queued(emb_bwd, table)})
    x = jax.random.normal(key, (256 * 1024 * 1024,) if not small else (1024,), jnp.float32)
    t = _queued(jax.jit(lambda x: x * 2.0 + 1.0), x)
    out["copy_bytes_per_s"] = 2 * x.nbytes / t
    return out


def _megatron_step(model, mbs):
    """``(run, flops)``: ``run()`` runs one jitted step of ``model`` (AdamW with clipping, as Megatron-LM's runs; state
    donated) on ``mbs`` random sequences and returns its loss; ``flops``: the step's model FLOPs by the reference
    table's formula."""
    import jax
    import jax.numpy as jnp
    import optax

    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-4))
    key = jax.random.key(0)
    _, args = model.step_and_args(mbs)
    params = jax.tree.map(lambda a: jax.random.normal(key, a.shape, a.dtype) * 0.02, args[0])
    tok = jax.random.randint(key, (mbs, model.seq), 0, model.vocab, dtype=jnp.int32)
    batch = {"tokens": tok, "targets": jnp.roll(tok, -1, axis=1)}

    def plain(params, opt_state, batch):
        loss, grads = jax.value_and_grad(model.loss)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    fn = jax.jit(plain, donate_argnums=(0, 1))
    state = [params, tx.init(params)]

    def run():
        state[0], state[1], loss = fn(state[0], state[1], batch)
        return loss

    b, s, l, h, V = mbs, model.seq, model.layers, model.hidden, model.vocab
    return run, 72 * b * s * l * h * h * (1 + s / (6 * h) + V / (12 * l * h))



def part_gpt_step(small):
    """The 1.7B model's whole step (AdamW, clip), jitted, with cuDNN's fused attention, at 2 and 4 sequences of 4096
    tokens (one microbatch): Megatron-LM's H100 row runs 4 per GPU per step."""
    import functools

    import jax

    model, _ = _megatron(small)
    jax.nn.dot_product_attention = functools.partial(jax.nn.dot_product_attention, implementation="cudnn")
    out = {"steps": []}
    for mbs in (2, 4):
        run, flops = _megatron_step(model, mbs)
        t = _queued(run, n=8)
        out["steps"].append({"mbs": mbs, "step_s": t, "model_tflops": flops / t / 1e12})
        del run
    out["peak_bytes_in_use"] = _peak_bytes()
    return out


def part_update(small):
    """The 1.7B model's optimizer update alone (AdamW, with and without clipping by the global norm), jitted with the
    parameters and moments donated: XLA's own ``bytes accessed`` and the time, per byte of parameters."""
    import jax
    import optax

    model, _ = _megatron(small)
    key = jax.random.key(0)
    params = jax.tree.map(lambda a: jax.random.normal(key, a.shape, a.dtype) * 0.02, model.abstract_params())
    pbytes = _tree_bytes(params)
    out = {"param_bytes": pbytes, "updates": []}
    for name, tx in (("sgd", optax.sgd(1e-3)), ("adamw", optax.adamw(1e-4)),
                     ("clip+adamw", optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-4)))):
        state = [params, tx.init(params)]
        grads = jax.tree.map(lambda x: x * 0.5, params)

        def upd(p, o, g, tx=tx):
            u, o = tx.update(g, o, p)
            return optax.apply_updates(p, u), o

        fn = jax.jit(upd, donate_argnums=(0, 1))
        ca = fn.lower(state[0], state[1], grads).compile().cost_analysis()
        ca = ca[0] if isinstance(ca, (list, tuple)) else ca

        def run(fn=fn, state=state, grads=grads):
            state[0], state[1] = fn(state[0], state[1], grads)
            return state[0]

        t = _queued(run, n=10)
        out["updates"].append({"name": name, "xla_bytes_accessed_per_param_byte": float(ca["bytes accessed"]) / pbytes,
                               "s": t, "bytes_per_s_at_xla_bytes": float(ca["bytes accessed"]) / t})
        params = state[0]
        del state
    return out


def part_llama_probe(small):
    """Where a one-stage autopp step's time goes beside jit's: the step, the host's issue time, the stage's one
    program called directly; jit with and without donation."""
    import jax

    import autopp
    from autopp.models import make_train_step

    model, batch = _llama(small)
    tx, params, opt_state, data = _llama_args(model, batch)
    out = {"leaves": len(jax.tree.leaves((params, opt_state, data)))}
    step = autopp.parallelize(make_train_step(model.loss, tx), num_stages=1, num_microbatches=1,
                              devices=jax.devices()[:1])
    jits = {"jit_donated": jax.jit(make_train_step(model.loss, tx, value_and_grad=jax.value_and_grad),
                                   donate_argnums=(0, 1)),
            "jit_not_donated": jax.jit(make_train_step(model.loss, tx, value_and_grad=jax.value_and_grad))}
    state = [params, opt_state]
    del params, opt_state  # one copy of the state alive: a step that does not donate holds two while it runs
    for name, fn in (("autopp", step), *jits.items()):
        issue, total = [], []
        for i in range(6):
            jax.block_until_ready(state)
            t = time.perf_counter()
            state[0], state[1], loss = fn(state[0], state[1], data)
            t1 = time.perf_counter()
            jax.block_until_ready((state, loss))
            if i >= 2:
                issue.append(t1 - t)
                total.append(time.perf_counter() - t)
        out[name] = {"issue_s": statistics.median(issue), "step_s": statistics.median(total),
                     "peak_bytes_in_use_so_far": _peak_bytes()}
        if name == "autopp":
            exe = step.executable_for(state[0], state[1], data)
            prog = [t.fn for t in exe.tasks if "scan" in t.label][0]
            times = []
            for i in range(4):
                flat = jax.tree.leaves((state[0], state[1], data))
                t = time.perf_counter()
                res = prog(*flat)
                jax.block_until_ready(res)
                times.append(time.perf_counter() - t)
                del flat
                state[0], state[1] = jax.tree.unflatten(jax.tree.structure((state[0], state[1])),
                                                        list(res[:len(jax.tree.leaves(state))]))
                del res
            out["autopp_program_alone_s"] = statistics.median(times[1:])
    return out


def run_part(part, small):
    if part == "update":
        return part_update(small)
    if part == "llama_probe":
        return part_llama_probe(small)
    if part == "hopper":
        return part_hopper(small)
    if part == "gpt_step":
        return part_gpt_step(small)
    if part == "kernels":
        return part_kernels(small)
    if part == "llama_jit":
        return part_llama(small, use_autopp=False)
    if part == "llama_autopp":
        return part_llama(small, use_autopp=True)
    if part == "gpt_layers":
        return part_gpt_layers(small)
    raise ValueError(f"unknown part {part!r}; one of {PARTS}")


def main(argv):
    small = "--small" in argv
    argv = [a for a in argv if a != "--small"]
    out_dir = argv[0]
    if len(argv) > 1:  # one part, in this process
        part = argv[1]
        t = time.perf_counter()
        try:
            result = run_part(part, small)
        except Exception as e:  # noqa: BLE001 - write what failed; the driver goes on with the next part
            import traceback

            result = {"error": repr(e)[:2000], "traceback": traceback.format_exc()[-4000:]}
        result["wall_s"] = time.perf_counter() - t
        with open(os.path.join(out_dir, f"{part}.json"), "w") as f:
            json.dump(result, f, indent=1, default=str)
        print(part, json.dumps(result, default=str)[:3000], flush=True)
        return
    budget = float(os.environ.get("GPU_CHECK_BUDGET_S", "400"))
    start = time.perf_counter()
    parts = os.environ.get("GPU_CHECK_PARTS")
    for part in parts.split(",") if parts else PARTS:
        left = budget - (time.perf_counter() - start)
        if left < 30:
            print(f"skipping {part}: {left:.0f} s of the budget left", flush=True)
            continue
        cmd = [sys.executable, "-m", "benchmarks.gpu_check", out_dir, part] + (["--small"] if small else [])
        try:
            subprocess.run(cmd, timeout=left, check=False)
        except subprocess.TimeoutExpired:
            print(f"{part}: timed out after {left:.0f} s", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])

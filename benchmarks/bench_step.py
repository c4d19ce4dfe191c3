"""Step time of autopp against plain jax.jit with the same microbatching (lax.scan accumulation).

Run: ``pytest benchmarks/bench_step.py -s`` (prints the ratio table; pytest-benchmark's own table times
the autopp step).
"""

import jax
import optax
import pytest

import autopp
from autopp.models import GPT, GPTConfig
from benchmarks._common import interleaved_medians, scan_accumulation_step, train_step_fn

CONFIG = GPTConfig(layers=4, hidden=256, heads=8, seq=128, vocab=1024)
BATCH, MICROBATCHES, ROUNDS = 16, 4, 15


@pytest.mark.parametrize("num_stages", [1, 4])
def test_step_time_vs_plain_jit(benchmark, num_stages):
    model = GPT(CONFIG)
    tx = optax.adamw(1e-4)
    params = model.init(jax.random.key(0))
    opt_state = tx.init(params)
    batch = model.batch(jax.random.key(1), BATCH)
    devices = jax.devices()[:num_stages]
    pipelined = autopp.parallelize(train_step_fn(model, tx), num_stages=num_stages,
                                   num_microbatches=MICROBATCHES, schedule="1f1b", devices=devices)
    plain = jax.jit(scan_accumulation_step(model, tx, MICROBATCHES))
    state = {"autopp": (params, opt_state), "plain": jax.device_put((params, opt_state), devices[0])}
    fns = {"autopp": pipelined, "plain": plain}
    interleaved_medians(fns, state, batch, rounds=2)  # compile and warm up
    med = interleaved_medians(fns, state, batch, rounds=ROUNDS)
    ratio = med["autopp"] / med["plain"]
    benchmark.extra_info.update(plain_ms=med["plain"] * 1e3, autopp_ms=med["autopp"] * 1e3, ratio=ratio)
    print(f"\n[step] GPT {CONFIG.to_dict()} batch {BATCH}, {MICROBATCHES} microbatches, {num_stages} stage(s) on "
          f"{num_stages} CPU device(s): plain jit {med['plain'] * 1e3:.1f} ms, autopp {med['autopp'] * 1e3:.1f} ms, "
          f"ratio {ratio:.3f}")

    p_state = [state["autopp"]]

    def one_step():
        out = pipelined(*p_state[0], batch)
        jax.block_until_ready(out)
        p_state[0] = out[:-1]

    benchmark.pedantic(one_step, rounds=5, iterations=1)


def test_scanned_model_memory_by_rows(benchmark, monkeypatch):
    """Peak bytes per device (``memory_report``) of a 32-layer GPT written with ``lax.scan`` on 4 stages (AdamW):
    its stacked parameters held by rows (each stage its rows, their gradient and moments), against the same step with
    the stack kept whole on its first stage (the rewrite switched off, as before it existed) and against the same
    model written as a Python loop."""
    import autopp.runtime._executor as executor
    from benchmarks._common import ScannedGPT

    config = GPTConfig(layers=32, hidden=64, heads=4, seq=32, vocab=256)
    tx = optax.adamw(1e-4)

    def peaks(model):
        params = model.init(jax.random.key(0))
        args = (params, tx.init(params), model.batch(jax.random.key(1), 32))
        step = autopp.parallelize(train_step_fn(model, tx), num_stages=4, num_microbatches=8, schedule="1f1b",
                                  devices=jax.devices()[:4])
        return step.executable_for(*args).memory_report()

    rows, loop = peaks(ScannedGPT(config)), peaks(GPT(config))
    with monkeypatch.context() as m:
        m.setattr(executor, "hold_by_rows", lambda *a, **k: None)
        whole = peaks(ScannedGPT(config))
    fmt = lambda p: " / ".join(f"{p[d] / 1e6:.1f}" for d in sorted(p))  # noqa: E731
    ratio = max(rows.values()) / max(whole.values())
    benchmark.extra_info.update(rows=rows, whole=whole, loop=loop, ratio=ratio)
    print(f"\n[memory] 32-layer lax.scan GPT, 4 stages, AdamW, peak MB per device: by rows {fmt(rows)}, stack whole "
          f"{fmt(whole)} (largest {ratio:.2f}x); as a Python loop {fmt(loop)}")
    benchmark.pedantic(lambda: None, rounds=1, iterations=1)


def test_tensor_parallel_stage_memory(benchmark):
    """Peak bytes per device (``memory_report``) of the zoo GPT (hidden 64, seq 128, batch 8, 2 microbatches) on
    2 stages, tensor 2 against no tensor parallelism: what a stage keeps for its backward is split over the tensor
    axis as its forward computes it."""
    config = GPTConfig(layers=2, hidden=64, heads=4, seq=128, vocab=128)
    model, tx = GPT(config), optax.sgd(0.1)
    params = model.init(jax.random.key(0))
    args = (params, tx.init(params), model.batch(jax.random.key(1), 8))
    peak = {tp: autopp.parallelize(train_step_fn(model, tx), num_stages=2, num_microbatches=2, layout={"tensor": tp},
                                   devices=jax.devices()[:2 * tp]).memory_report(*args)[0] for tp in (1, 2)}
    ratio = peak[2] / peak[1]
    benchmark.extra_info.update(peak=peak, ratio=ratio)
    print(f"\n[memory] zoo GPT hidden 64, seq 128, 2 stages: peak per device tensor 2 {peak[2] / 2**20:.2f} MiB vs "
          f"none {peak[1] / 2**20:.2f} MiB: {ratio:.2f}x")
    benchmark.pedantic(lambda: None, rounds=1, iterations=1)

"""Multi-host: cross-process activation transfer throughput and step time against one process.

Run: ``pytest benchmarks/bench_multihost.py -s``. Starts 2 local processes of 4 CPU devices each
(``autopp launch``): process 0's 4 devices send batch-sharded float32 arrays of 1, 8 and 64 MB to process 1's
(MB/s, as received), then both run the zoo GPT (hidden 64, seq 32, vocab 256, 4 layers; batch 32, 8 microbatches)
as 4 stages of 2 devices with 1F1B. The baseline is the same plan in this one process on 8 devices, measured in the
same run. Both processes share this machine's cores, so the ratio includes that contention.
"""

from __future__ import annotations

import io
import json
import os
import statistics
import sys
import tempfile
import time

import jax
import optax

from autopp.models import GPT, GPTConfig, make_train_step

CONFIG = GPTConfig(layers=4, hidden=64, heads=4, seq=32, vocab=256)
BATCH, MICROBATCHES = 32, 8


def bench_case():
    model = GPT(CONFIG)
    tx = optax.adamw(1e-4)
    params = model.init(jax.random.key(0))
    return make_train_step(model.loss, tx), (params, tx.init(params)), model.batch(jax.random.key(1), BATCH)


def bench_plan(devices) -> dict:
    return dict(num_stages=4, num_microbatches=MICROBATCHES, schedule="1f1b", devices=list(devices[:8]))


def test_multihost_vs_single_process(benchmark):
    import autopp
    from autopp._launch import launch

    with tempfile.TemporaryDirectory() as out_dir:
        log = io.StringIO()
        worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_multihost_worker.py")
        code = launch([sys.executable, worker, out_dir], 2, 4, out=log)
        assert code == 0, log.getvalue()[-4000:]
        results = [json.load(open(os.path.join(out_dir, f"multihost.{p}.json"))) for p in range(2)]

    step_fn, state, batch = bench_case()
    step = autopp.parallelize(step_fn, **bench_plan(jax.devices()))
    times = []
    for _ in range(12):
        t = time.perf_counter()
        *state, loss = step(*state, batch)
        float(loss)
        times.append(time.perf_counter() - t)
    single = statistics.median(times[2:])
    multi = max(r["step_s"] for r in results)
    benchmark.extra_info.update(transfer_mb_s=results[1]["transfer_mb_s"], multi_step_s=multi, single_step_s=single,
                                ratio=multi / single)
    benchmark.pedantic(lambda: float(step(*state, batch)[-1]), rounds=3, iterations=1)
    print("\ncross-process transfer (4 -> 4 devices): "
          + ", ".join(f"{mb} MB: {v:.0f} MB/s" for mb, v in results[1]["transfer_mb_s"].items()))
    print(f"step: 2 processes x 4 devices {multi * 1e3:.1f} ms, 1 process x 8 devices {single * 1e3:.1f} ms, "
          f"ratio {multi / single:.2f}x")

"""Profiling GPT-3 175B abstractly (ShapeDtypeStructs, nothing allocated) for 128x8 H100.

Run: ``pytest benchmarks/bench_profile.py -s`` (goal: <= 3 s per profile on this machine).
"""

import jax
import optax

from autopp.models import GPT, GPTConfig
from autopp.profiler import Cluster
from autopp.profiler._profile import profile
from benchmarks._common import train_step_fn

GPT3 = GPTConfig(layers=96, hidden=12288, heads=96, seq=2048, vocab=51200, dtype="bfloat16")


def test_profile_gpt3_175b(benchmark):
    model = GPT(GPT3)
    tx = optax.adamw(1e-4)
    params = model.init_abstract()
    opt_state = jax.eval_shape(tx.init, params)
    batch = {"tokens": jax.ShapeDtypeStruct((1, GPT3.seq), "int32"),
             "targets": jax.ShapeDtypeStruct((1, GPT3.seq), "int32")}
    cluster = Cluster.parse("128x8xH100")
    step = train_step_fn(model, tx)
    result = {}

    def run():
        result["profile"] = profile(step, params, opt_state, batch, cluster=cluster)

    benchmark.pedantic(run, rounds=3, iterations=1)
    prof = result["profile"]
    t = benchmark.stats.stats.median
    expected = GPT3.flops_per_step(1)
    print(f"\n[profile] GPT-3 175B for {cluster}: {len(prof.layers)} layers, "
          f"{len({l.fingerprint for l in prof.layers})} distinct, whole step {prof.total_flops / 1e15:.3f} PFLOP "
          f"(Megatron formula without recompute: {expected / 1e15:.3f} PFLOP), median {t:.2f} s (goal <= 3 s)")

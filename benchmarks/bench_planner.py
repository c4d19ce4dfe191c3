"""Planner wall time and the predicted gain of pipelining, for published model sizes.

Run: ``pytest benchmarks/bench_planner.py -s``. Goals on this 2-core machine: GPT-3 175B on 128x8xH100 planned in
<= 10 s, a 1T GPT (Megatron-LM's 1008B: 128 layers, hidden 25600, 160 heads) on 384x8xA100-80GB in <= 30 s, each
from a cold start (the per-layer cost graph is profiled inside the timed call).
"""

import pytest

from autopp.models import GPTConfig
from autopp.planner import clear_cache, plan_model

GPT3 = GPTConfig(layers=96, hidden=12288, heads=96, seq=2048, vocab=51200, dtype="bfloat16")
GPT_1T = GPTConfig(layers=128, hidden=25600, heads=160, seq=2048, vocab=51200, dtype="bfloat16")


def _plan_cold(benchmark, model, cluster, global_batch, **kwargs):
    result = {}

    def run():
        result["plan"] = plan_model(model, cluster, global_batch=global_batch, **kwargs)

    benchmark.pedantic(run, setup=clear_cache, rounds=1, iterations=1)
    return result["plan"], benchmark.stats.stats.median


def _summary(plan) -> str:
    s = plan.stages[0]
    e = plan.predicted
    return (f"{len({st.devices for st in plan.stages})} pipeline groups x {dict(s.mesh_shape)}, "
            f"{plan.num_microbatches} microbatches of {plan.microbatch_size}, {plan.schedule}"
            f"{f' v={plan.virtual_stages}' if plan.virtual_stages > 1 else ''}, recompute "
            f"{sorted({st.recompute for st in plan.stages})}: step {e.step_time_s:.3f} s, "
            f"{e.tflops_per_gpu:.1f} TFLOP/s/GPU, MFU {100 * e.mfu:.1f}%, {e.peak_memory_bytes_per_gpu / 2**30:.1f} GiB")


@pytest.mark.parametrize("name, model, cluster, global_batch, goal_s", [
    ("GPT-3 175B", GPT3, "128x8xH100", 1536, 10.0),
    ("GPT 1T", GPT_1T, "384x8xA100-80GB", 3072, 30.0),
])
def test_planner_wall_time(benchmark, name, model, cluster, global_batch, goal_s):
    plan, seconds = _plan_cold(benchmark, model, cluster, global_batch)
    benchmark.extra_info.update(goal_s=goal_s, candidates=plan.planner.candidates,
                                step_time_s=plan.predicted.step_time_s)
    print(f"\n[planner] {name} on {cluster}, global batch {global_batch}: planned in {seconds:.2f} s "
          f"(goal <= {goal_s:.0f} s), {plan.planner.candidates} layouts, stage split {plan.planner.solver_status}; "
          f"{_summary(plan)}")


def test_pipelining_gain_gpt3_on_1024_h100(benchmark):
    """The best plan against the best plan without pipelining (pp = 1: tensor, data and FSDP only)."""
    best, seconds = _plan_cold(benchmark, GPT3, "128x8xH100", 1536)
    flat = plan_model(GPT3, "128x8xH100", global_batch=1536, pipeline_degrees=(1,))
    gain = flat.predicted.step_time_s / best.predicted.step_time_s
    benchmark.extra_info.update(predicted_speedup_over_pp1=gain)
    print(f"\n[planner] GPT-3 175B on 128x8xH100: best {_summary(best)}\n"
          f"          best without pipelining {_summary(flat)}\n"
          f"          predicted speedup of the best plan over pp=1: {gain:.2f}x")

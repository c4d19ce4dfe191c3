"""Runtime overhead where host work dominates, measured timelines, and first-call cost.

Run: ``pytest benchmarks/bench_runtime.py -s``. The zoo GPT at hidden 64, seq 32, vocab 256 (4 layers, 4 heads),
batch 32, 8 microbatches, on CPU devices; the baseline is plain ``jax.jit`` of the same step with ``lax.scan``
gradient accumulation over the same microbatches, measured in the same run. Goals (issue 5): step time
<= 1.3x the baseline and host time to issue one step <= 20 ms for 4 stages on 4 devices; first call (trace,
split, compile) <= 1.5x the baseline's first call.
"""

import os
import statistics
import subprocess
import sys
import textwrap
import time

import jax
import optax
import pytest

import autopp
from autopp.models import GPT, GPTConfig
from autopp.planner import bubble_fraction
from benchmarks._common import interleaved_medians, scan_accumulation_step, train_step_fn

CONFIG = GPTConfig(layers=4, hidden=64, heads=4, seq=32, vocab=256)
BATCH, MICROBATCHES, ROUNDS = 32, 8, 30


def _setup(num_stages, schedule="1f1b", virtual_stages=None, config=CONFIG):
    model = GPT(config)
    tx = optax.adamw(1e-4)
    params = model.init(jax.random.key(0))
    opt_state = tx.init(params)
    batch = model.batch(jax.random.key(1), BATCH)
    devices = jax.devices()[:num_stages]
    pipelined = autopp.parallelize(train_step_fn(model, tx), num_stages=num_stages, num_microbatches=MICROBATCHES,
                                   schedule=schedule, virtual_stages=virtual_stages, devices=devices)
    return model, tx, params, opt_state, batch, devices, pipelined


@pytest.mark.parametrize("num_stages", [4, 8])
def test_overhead_and_step_time(benchmark, num_stages):
    model, tx, params, opt_state, batch, devices, pipelined = _setup(num_stages)
    plain = jax.jit(scan_accumulation_step(model, tx, MICROBATCHES))
    state = {"autopp": (params, opt_state), "plain": jax.device_put((params, opt_state), devices[0])}
    fns = {"autopp": pipelined, "plain": plain}
    interleaved_medians(fns, state, batch, rounds=2)
    med = interleaved_medians(fns, state, batch, rounds=ROUNDS)
    exe = pipelined.executable_for(*state["autopp"], batch)
    flat = jax.tree.leaves((*state["autopp"], batch))
    issue, issue_cpu, walls, overheads, paths = [], [], [], [], []
    for _ in range(ROUNDS):
        t, c = time.perf_counter(), time.thread_time()
        out = exe.run(flat)
        issue_cpu.append(time.thread_time() - c)  # the host thread's own work, not its waits for a core
        issue.append(time.perf_counter() - t)
        jax.block_until_ready(out)
    for _ in range(ROUNDS // 3):
        out, timeline = pipelined.trace(*state["autopp"], batch)
        jax.block_until_ready(out)
        walls.append(timeline.wall_s)
        paths.append(timeline.critical_path_s)
        overheads.append(timeline.overhead_s)
    ratio = med["autopp"] / med["plain"]
    figures = dict(plain_ms=med["plain"] * 1e3, autopp_ms=med["autopp"] * 1e3, ratio=ratio,
                   issue_ms=statistics.median(issue) * 1e3, issue_cpu_ms=statistics.median(issue_cpu) * 1e3,
                   tasks=len(exe.tasks),
                   traced_wall_ms=statistics.median(walls) * 1e3, critical_path_ms=statistics.median(paths) * 1e3,
                   overhead_ms=statistics.median(overheads) * 1e3)
    benchmark.extra_info.update(figures)
    print(f"\n[runtime] {num_stages} stages, 1F1B, {MICROBATCHES} microbatches, {num_stages} CPU devices: "
          f"plain jit {figures['plain_ms']:.2f} ms, autopp {figures['autopp_ms']:.2f} ms (ratio {ratio:.2f}, goal "
          f"<= 1.3 for 4 stages); host issue {figures['issue_ms']:.2f} ms wall, {figures['issue_cpu_ms']:.2f} ms of "
          f"the host thread's CPU time, for {len(exe.tasks)} tasks (goal <= 20 ms); traced step {figures['traced_wall_ms']:.2f} ms, critical path {figures['critical_path_ms']:.2f} "
          f"ms, overhead (wall - critical path) {figures['overhead_ms']:.2f} ms")
    benchmark.pedantic(lambda: jax.block_until_ready(exe.run(flat)), rounds=5, iterations=1)


HEAVY = GPTConfig(layers=4, hidden=256, heads=8, seq=128, vocab=1024)


def _stage_times(timeline, num_stages):
    """Median forward, backward and weight-gradient time of each stage from the measured timeline (a fused F+B
    is split 1:2, the usual ratio of a backward to its forward)."""
    import re

    f, b, w = ([[] for _ in range(num_stages)] for _ in range(3))
    for e in timeline.events:
        m = re.match(r"^(\d+)([FBIW])\d+(\+)?", e.label)
        if not m:
            continue
        s, d = int(m.group(1)), e.end_s - e.start_s
        if m.group(3):
            f[s].append(d / 3)
            b[s].append(2 * d / 3)
        elif m.group(2) == "F":
            f[s].append(d)
        elif m.group(2) == "B":
            b[s].append(d)
        elif m.group(2) == "I":
            b[s].append(d)  # I + W make the backward; W is added below
        else:
            w[s].append(d)
    med = [statistics.median(x) if x else 0.0 for x in (*f, *b, *w)]
    fs, bs, ws = med[:num_stages], med[num_stages:2 * num_stages], med[2 * num_stages:]
    tiny = 1e-9  # a stamp can make an action look instantaneous; the event simulation needs positive times
    return [max(x, tiny) for x in fs], [max(bi + wi, tiny) for bi, wi in zip(bs, ws)], (ws if any(ws) else None)


@pytest.mark.parametrize("bound", ["host", "compute"])
@pytest.mark.parametrize("schedule, virtual_stages", [("1f1b", None), ("zb-h1", None), ("interleaved-1f1b", 2),
                                                     ("dualpipev", None)])
def test_bubble_fraction_from_the_timeline(benchmark, schedule, virtual_stages, bound):
    """Measured idle share of the device groups against the schedule's theory at each stage's measured action
    times. ``host``: the tiny GPT on 4 groups (dispatch-bound); ``compute``: the bench_step GPT (hidden 256) on
    2 groups, one per core of this machine, where the actions dominate."""
    groups = 4 if bound == "host" else 2
    model, tx, params, opt_state, batch, devices, pipelined = _setup(
        groups, schedule, virtual_stages, config=CONFIG if bound == "host" else HEAVY)
    state = (params, opt_state)
    for _ in range(2):
        jax.block_until_ready(pipelined(*state, batch))
    plan = pipelined.plan_for(*state, batch)
    from autopp.runtime import Schedule

    sched = Schedule.from_text(plan.schedule_text, plan.num_stages, plan.num_microbatches)
    measured, theory = [], []
    for _ in range(ROUNDS // 3 if bound == "host" else 4):
        out, timeline = pipelined.trace(*state, batch)
        measured.append(timeline.bubble_fraction())
        f, b, w = _stage_times(timeline, plan.num_stages)
        theory.append(bubble_fraction(sched, f, b, w))
    measured, theory = statistics.median(measured), statistics.median(theory)
    benchmark.extra_info.update(measured=measured, theory=theory)
    print(f"\n[bubble] {bound}-bound, {schedule}{f' v={virtual_stages}' if virtual_stages else ''}, {groups} "
          f"groups, {MICROBATCHES} microbatches: measured {measured:.3f}, theory at the measured stage times "
          f"{theory:.3f}")
    benchmark.pedantic(lambda: jax.block_until_ready(pipelined(*state, batch)), rounds=1, iterations=1)


_FIRST_CALL = textwrap.dedent("""
    import os, sys, time
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    import jax, optax
    import autopp
    from autopp.models import GPT, GPTConfig
    from benchmarks._common import scan_accumulation_step, train_step_fn
    model = GPT(GPTConfig(layers=4, hidden=64, heads=4, seq=32, vocab=256))
    tx = optax.adamw(1e-4)
    params = model.init(jax.random.key(0)); opt_state = tx.init(params); batch = model.batch(jax.random.key(1), 32)
    jax.block_until_ready((params, opt_state, batch))
    parallelize = autopp.parallelize  # import autopp's modules (lazy since issue 14) before the clock, as jax's are
    t = time.perf_counter()
    if sys.argv[1] == "plain":
        out = jax.jit(scan_accumulation_step(model, tx, 8))(params, opt_state, batch)
    else:
        step = parallelize(train_step_fn(model, tx), num_stages=4, num_microbatches=8, schedule="1f1b",
                           devices=jax.devices()[:4])
        out = step(params, opt_state, batch)
    jax.block_until_ready(out)
    print(time.perf_counter() - t)
""")


def test_first_call(benchmark):
    """Trace + split + compile + first step, each in a fresh process (no JAX caches shared)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def first(kind):
        out = subprocess.run([sys.executable, "-c", _FIRST_CALL, kind], capture_output=True, text=True, cwd=root,
                             check=True, env={**os.environ, "PYTHONPATH": root})
        return float(out.stdout.strip().splitlines()[-1])

    times = {"plain": [], "autopp": []}
    for _ in range(3):
        for kind in times:
            times[kind].append(first(kind))
    med = {k: statistics.median(v) for k, v in times.items()}
    ratio = med["autopp"] / med["plain"]
    benchmark.extra_info.update(plain_s=med["plain"], autopp_s=med["autopp"], ratio=ratio)
    print(f"\n[first call] 4 stages, 8 microbatches: plain jit {med['plain']:.2f} s, autopp {med['autopp']:.2f} s, "
          f"ratio {ratio:.2f} (goal <= 1.5)")
    benchmark.pedantic(lambda: None, rounds=1, iterations=1)

"""The ``autopp`` command line."""

from __future__ import annotations

import argparse
import os
import sys
import time


def _use_cpu_devices(n: int) -> None:
    """Make sure the CPU backend has at least ``n`` devices (must run before JAX initialises a backend)."""
    import jax

    if jax.config.jax_num_cpu_devices >= n:
        return
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()
    try:
        jax.config.update("jax_num_cpu_devices", n)
    except RuntimeError as e:  # the backend already started with fewer devices
        raise ValueError(f"autopp: {n} CPU devices are needed but JAX already started with "
                         f"{len(jax.devices('cpu'))}: {e}") from None


def _positive(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def demo_batch(key, batch_size: int, seq: int, vocab: int):
    """Sequences t, t+k, t+2k, ... (mod vocab) with random start t and stride k: learnable next tokens."""
    import jax
    import jax.numpy as jnp

    k1, k2 = jax.random.split(key)
    start = jax.random.randint(k1, (batch_size, 1), 0, vocab)
    stride = jax.random.randint(k2, (batch_size, 1), 1, 8)
    pos = jnp.arange(seq + 1)[None, :]
    seqs = (start + stride * pos) % vocab
    return {"tokens": seqs[:, :-1].astype(jnp.int32), "targets": seqs[:, 1:].astype(jnp.int32)}


def cmd_demo(args) -> int:
    _use_cpu_devices(args.devices)
    import jax
    import optax

    import autopp
    from autopp.models import GPT, GPTConfig, make_train_step

    devices = jax.devices()[: args.devices]
    config = GPTConfig(layers=args.layers, hidden=args.hidden, heads=args.heads, seq=args.seq, vocab=args.vocab)
    model = GPT(config)
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(args.learning_rate))

    step = autopp.parallelize(make_train_step(model.loss, tx), num_stages=args.stages, num_microbatches=args.microbatches,
                              schedule=args.schedule, devices=devices)
    params = model.init(jax.random.key(0))
    opt_state = tx.init(params)
    print(f"autopp demo: GPT {config.to_dict()} ({config.num_params / 1e6:.2f}M parameters), batch {args.batch_size}, "
          f"{len(devices)} {devices[0].platform.upper()} devices")
    batch = demo_batch(jax.random.key(1), args.batch_size, args.seq, args.vocab)
    t0 = time.perf_counter()
    plan = step.plan_for(params, opt_state, batch)
    print(f"traced, split and compiled in {time.perf_counter() - t0:.1f} s")
    print(plan)
    print("schedule (one row per stage):")
    for line in plan.schedule_text.splitlines():
        print("  " + line)
    first = last = None
    for i in range(args.steps):
        batch = demo_batch(jax.random.key(100 + i), args.batch_size, args.seq, args.vocab)
        t = time.perf_counter()
        params, opt_state, loss = step(params, opt_state, batch)
        loss = float(loss)  # waits for the step
        dt = time.perf_counter() - t
        first = loss if first is None else first
        last = loss
        print(f"step {i + 1:>3}  loss {loss:8.4f}  step time {dt * 1e3:8.1f} ms")
    print(f"loss {first:.4f} -> {last:.4f} ({'down' if last < first else 'NOT down'})")
    return 0 if last < first else 1


def _model_step(args):
    """The zoo model named on the command line, its abstract training state and step (AdamW)."""
    import jax
    import jax.numpy as jnp
    import optax

    from autopp.models import GPT, MLP, GPTConfig, MLPConfig, make_train_step

    if args.model == "gpt":
        config = GPTConfig(layers=args.layers, hidden=args.hidden, heads=args.heads, seq=args.seq, vocab=args.vocab,
                           dtype=args.dtype)
        model = GPT(config)
        batch = {"tokens": jax.ShapeDtypeStruct((args.batch_size, args.seq), jnp.int32),
                 "targets": jax.ShapeDtypeStruct((args.batch_size, args.seq), jnp.int32)}
    else:
        config = MLPConfig(sizes=tuple(args.sizes))
        model = MLP(config)
        batch = {"x": jax.ShapeDtypeStruct((args.batch_size, config.sizes[0]), jnp.float32),
                 "y": jax.ShapeDtypeStruct((args.batch_size, config.sizes[-1]), jnp.float32)}
    tx = optax.adamw(1e-4)
    params = model.init_abstract()
    opt_state = jax.eval_shape(tx.init, params)
    return config, make_train_step(model.loss, tx), (params, opt_state, batch)


def _add_model_flags(p) -> None:
    p.add_argument("--model", choices=("gpt", "mlp"), default="gpt")
    p.add_argument("--layers", type=_positive, default=4)
    p.add_argument("--hidden", type=_positive, default=256)
    p.add_argument("--heads", type=_positive, default=8)
    p.add_argument("--seq", type=_positive, default=128)
    p.add_argument("--vocab", type=_positive, default=1024)
    p.add_argument("--dtype", default="bfloat16", help="GPT parameter/activation dtype (default bfloat16)")
    p.add_argument("--sizes", type=_positive, nargs="+", default=[64, 128, 128, 64, 8], help="MLP layer widths")
    p.add_argument("--batch-size", type=_positive, default=1, help="global batch (default 1)")


def _parse_overrides(items) -> dict:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--override expects FIELD=VALUE (e.g. matmul_efficiency=0.6), got {item!r}.")
        try:
            out[key.strip()] = float(value)
        except ValueError:
            raise ValueError(f"--override {item!r}: {value!r} is not a number.") from None
    return out


def cmd_profile(args) -> int:
    import json

    if args.measure:
        _use_cpu_devices(1)
    from autopp.profiler import Cluster, profile

    cluster = Cluster.parse(args.cluster) if args.cluster else Cluster.local()
    if args.override:
        cluster = cluster.with_device_overrides(**_parse_overrides(args.override))
    config, step, state = _model_step(args)
    progress = None
    if args.measure and not args.json and sys.stderr.isatty():
        from rich.console import Console

        console = Console(stderr=True)
        status = console.status("profiling")
        status.start()
        progress = status.update
    t = time.perf_counter()
    try:
        prof = profile(step, *state, cluster=cluster, measure=args.measure, progress=progress)
    finally:
        if progress:
            status.stop()
    elapsed = time.perf_counter() - t
    if args.json:
        out = prof.to_dict()
        out["model"] = config.to_dict()
        out["profile_seconds"] = elapsed
        print(json.dumps(out, indent=1))
    else:
        print(f"{args.model} {config.to_dict()}, batch {args.batch_size}")
        print(prof.table())
        print(f"profiled in {elapsed:.2f} s")
    return 0


def _gpt_and_cluster(args, command: str):
    """The GPT described by the model flags and the --cluster (with --override) of ``command``."""
    from autopp.models import GPTConfig
    from autopp.profiler import Cluster

    if args.model != "gpt":
        raise ValueError(f"autopp {command} models GPTs only for now; use --model gpt.")
    config = GPTConfig(layers=args.layers, hidden=args.hidden, heads=args.heads, seq=args.seq, vocab=args.vocab,
                       dtype=args.dtype)
    cluster = Cluster.parse(args.cluster)
    if args.override:
        cluster = cluster.with_device_overrides(**_parse_overrides(args.override))
    return config, cluster


def cmd_plan(args) -> int:
    from autopp.planner import plan_model

    config, cluster = _gpt_and_cluster(args, "plan")
    kwargs = {}
    if args.schedules:
        kwargs["schedules"] = tuple(args.schedules)
    if args.recompute:
        kwargs["recompute"] = tuple(args.recompute)
    if args.microbatch_sizes:
        kwargs["microbatch_sizes"] = tuple(args.microbatch_sizes)
    plan = plan_model(config, cluster, global_batch=args.global_batch, **kwargs)
    if args.out:
        plan.to_json(args.out)
    if args.json:
        print(plan.to_json())
        return 0
    print(f"gpt {config.to_dict()} ({config.num_params / 1e9:.3g}B parameters) on {cluster}, global batch "
          f"{args.global_batch}")
    print(plan)
    if args.out:
        print(f"plan written to {args.out} (autopp show {args.out})")
    return 0


def cmd_simulate(args) -> int:
    import json

    from autopp.planner import simulate

    config, cluster = _gpt_and_cluster(args, "simulate")
    dp = args.dp if args.dp is not None else cluster.num_devices // (args.tp * args.pp)
    est = simulate(config, cluster, global_batch=args.global_batch, tp=args.tp, pp=args.pp, dp=dp,
                   microbatch_size=args.microbatch_size, schedule=args.schedule, recompute=args.recompute,
                   virtual_stages=args.virtual_stages, fsdp=args.fsdp)
    if args.json:
        print(json.dumps({"model": config.to_dict(), "cluster": cluster.to_dict(),
                          "layout": {"tp": args.tp, "pp": args.pp, "dp": dp, "microbatch_size": args.microbatch_size,
                                     "schedule": args.schedule, "recompute": args.recompute,
                                     "virtual_stages": args.virtual_stages, "fsdp": args.fsdp},
                          "predicted": est.to_dict()}, indent=1))
        return 0
    print(f"gpt {config.to_dict()} on {cluster}, global batch {args.global_batch}")
    print(f"layout: tp {args.tp} x pp {args.pp} x dp {dp} (FSDP over {args.fsdp}), microbatch {args.microbatch_size} "
          f"({est.num_microbatches} per step), {args.schedule}"
          f"{f' v={args.virtual_stages}' if args.virtual_stages > 1 else ''}, recompute {args.recompute}")
    print(f"step time      {est.step_time_s:10.3f} s   (compute {est.compute_s:.3f}, bubble {est.bubble_s:.3f}, "
          f"tp {est.tp_comm_s:.3f}, fsdp {est.fsdp_comm_s:.3f}, pp {est.pp_comm_s:.3f}, dp {est.dp_comm_s:.3f}, optimizer {est.optimizer_s:.3f})")
    print(f"TFLOP/s/GPU    {est.tflops_per_gpu:10.1f}     MFU {est.mfu * 100:.1f}%")
    print(f"memory/GPU     {est.peak_memory_bytes_per_gpu / 2**30:10.2f} GiB ({'fits' if est.fits else 'DOES NOT FIT'} "
          f"in {cluster.memory_per_device / 2**30:.0f} GiB)")
    return 0


def cmd_show(args) -> int:
    from autopp.planner import Plan
    from autopp.runtime import Schedule

    plan = Plan.from_json(args.plan)
    print(f"plan {args.plan} (schema {plan.schema_version}, model fingerprint {plan.model_fingerprint})")
    print(plan)
    timeline = plan.timeline()
    if timeline:
        print(timeline)
    sched = Schedule.from_text(plan.schedule_text, num_stages=plan.num_stages, num_microbatches=plan.num_microbatches)
    if args.grid or not timeline:
        print("schedule:")
        print(sched)
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="autopp", description="Automatic MPMD pipeline parallelism for JAX.")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="train the zoo GPT as a pipeline on CPU devices and print what happens")
    demo.add_argument("--devices", type=_positive, default=8, help="CPU devices to use (default 8)")
    demo.add_argument("--stages", type=_positive, default=4, help="pipeline stages (default 4)")
    demo.add_argument("--microbatches", type=_positive, default=8, help="microbatches per step (default 8)")
    demo.add_argument("--schedule", default="1f1b", help="gpipe or 1f1b (default 1f1b)")
    demo.add_argument("--steps", type=_positive, default=30, help="training steps (default 30)")
    demo.add_argument("--batch-size", type=_positive, default=32)
    demo.add_argument("--layers", type=_positive, default=4)
    demo.add_argument("--hidden", type=_positive, default=64)
    demo.add_argument("--heads", type=_positive, default=4)
    demo.add_argument("--seq", type=_positive, default=32)
    demo.add_argument("--vocab", type=_positive, default=128)
    demo.add_argument("--learning-rate", type=float, default=3e-3)
    demo.set_defaults(func=cmd_demo)
    prof = sub.add_parser("profile", help="per-layer FLOPs, time and memory of a zoo model's training step")
    _add_model_flags(prof)
    prof.add_argument("--cluster", default=None, help="target cluster, e.g. 128x8xH100 (default: local devices)")
    prof.add_argument("--override", action="append", metavar="FIELD=VALUE",
                      help="override a device field, e.g. --override matmul_efficiency=0.6 (repeatable)")
    prof.add_argument("--measure", action="store_true", help="compile and time each distinct layer locally")
    prof.add_argument("--json", action="store_true", help="machine-readable output")
    prof.set_defaults(func=cmd_profile)
    sim = sub.add_parser("simulate", help="predict step time, TFLOP/s and memory of a GPT layout on a cluster")
    _add_model_flags(sim)
    sim.add_argument("--global-batch", type=_positive, required=True)
    sim.add_argument("--cluster", required=True, help="e.g. 128x8xH100")
    sim.add_argument("--tp", type=_positive, default=1)
    sim.add_argument("--pp", type=_positive, default=1)
    sim.add_argument("--dp", type=_positive, default=None, help="default: devices / (tp * pp)")
    sim.add_argument("--microbatch-size", type=_positive, default=1)
    sim.add_argument("--schedule", default="1f1b")
    sim.add_argument("--recompute", default="full")
    sim.add_argument("--virtual-stages", type=_positive, default=1)
    sim.add_argument("--fsdp", type=_positive, default=1, help="FSDP (ZeRO-3) degree inside dp (default 1)")
    sim.add_argument("--override", action="append", metavar="FIELD=VALUE", help="override a device field")
    sim.add_argument("--json", action="store_true")
    sim.set_defaults(func=cmd_simulate)
    plan = sub.add_parser("plan", help="find the fastest layout for a GPT on a cluster (CP-SAT + simulator)")
    _add_model_flags(plan)
    plan.add_argument("--global-batch", type=_positive, required=True)
    plan.add_argument("--cluster", required=True, help="e.g. 128x8xH100")
    plan.add_argument("--schedules", nargs="+", default=None, help="restrict the schedules searched")
    plan.add_argument("--recompute", nargs="+", default=None, help="restrict the recomputation modes searched")
    plan.add_argument("--microbatch-sizes", type=_positive, nargs="+", default=None,
                      help="microbatch sizes searched (default 1 2 4 8)")
    plan.add_argument("--override", action="append", metavar="FIELD=VALUE", help="override a device field")
    plan.add_argument("--out", default=None, help="write the plan's JSON here")
    plan.add_argument("--json", action="store_true", help="print the plan's JSON")
    plan.set_defaults(func=cmd_plan)
    show = sub.add_parser("show", help="print a saved plan: stages, memory, predicted timeline")
    show.add_argument("plan", help="path of a plan's JSON (plan.to_json(path))")
    show.add_argument("--grid", action="store_true", help="also print the schedule grid")
    show.set_defaults(func=cmd_show)
    from autopp import _compare

    _compare.add_parser(sub, _add_model_flags, _positive)
    from autopp import _launch

    _launch.add_parser(sub, _positive)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, TypeError) as e:
        if os.environ.get("AUTOPP_DEBUG"):
            raise
        print(f"autopp {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

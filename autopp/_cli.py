"""The ``autopp`` command line."""

from __future__ import annotations

import argparse
import gc
import math
import os
import sys
import time

from autopp._cli_show import cmd_show


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
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
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

    if args.devices % args.stages:
        raise SystemExit(f"autopp demo: --stages {args.stages} does not divide --devices {args.devices} (each stage gets "
                         f"devices / stages of them); use --devices {args.stages * max(1, args.devices // args.stages)} "
                         f"or --stages that divides {args.devices}.")
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
    print(f"traced and split in {time.perf_counter() - t0:.1f} s (the programs compile during the first step)")
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


_DTYPES = ("float32", "bfloat16", "float16")
_ZOO_DEFAULTS = {"layers": 4, "hidden": 256, "heads": 8, "seq": 128, "vocab": 1024, "dtype": "bfloat16",
                 "param_dtype": "float32", "sizes": [64, 128, 128, 64, 8]}
"""The zoo models' shape flags when not given."""
_LLAMA_ONLY = ("kv_heads", "ffn", "rope_theta")
_STEP_FORM = "package.module:function (e.g. examples.planning_step:llama_70b)"


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def _llama_ffn(hidden: int) -> int:
    """Llama's SwiGLU width rule: 2/3 of 4 h, rounded up to a multiple of 256."""
    return 256 * math.ceil(8 * hidden / 3 / 256)


def _zoo_config(args, command: str, *, dtype: str = "bfloat16"):
    """``(kind, config)`` of the zoo model the flags describe (``--model``, default gpt); ``dtype``: the compute
    dtype when ``--dtype`` is not given."""
    from autopp.models import GPTConfig, LlamaConfig, MLPConfig

    kind = args.model or "gpt"
    value = {k: getattr(args, k, None) for k in (*_ZOO_DEFAULTS, *_LLAMA_ONLY)}
    if kind != "llama":
        given = [_flag(k) for k in _LLAMA_ONLY if value[k] is not None]
        if given:
            raise ValueError(f"{', '.join(given)} describe a Llama; add --model llama (the model is {kind}).")
    if kind != "mlp" and value["sizes"] is not None:
        raise ValueError(f"--sizes describes the MLP; add --model mlp (the model is {kind}).")
    for k, default in _ZOO_DEFAULTS.items():
        if value[k] is None:
            value[k] = dtype if k == "dtype" else default
    if kind == "mlp":
        return kind, MLPConfig(sizes=tuple(value["sizes"]))
    shape = {k: value[k] for k in ("layers", "hidden", "heads", "seq", "vocab", "dtype", "param_dtype")}
    if kind == "gpt":
        return kind, GPTConfig(**shape)
    extra = {"kv_heads": value["kv_heads"] or value["heads"], "ffn": value["ffn"] or _llama_ffn(value["hidden"])}
    if value["rope_theta"] is not None:
        extra["rope_theta"] = value["rope_theta"]
    return kind, LlamaConfig(**shape, **extra)


def _check_step_alone(args) -> None:
    """With ``--step`` the step's own arguments give the shapes: no zoo flags."""
    given = [_flag(k) for k in (*_ZOO_DEFAULTS, *_LLAMA_ONLY) if getattr(args, k, None) is not None]
    if given:
        raise ValueError(f"{', '.join(given)} describe a zoo model (--model); with --step {args.step} the step's own "
                         "arguments give the shapes and dtypes: drop them.")


def _user_code_location(e: BaseException) -> str:
    """`` (raised at FILE:LINE in FUNC ...)`` when ``e`` (or what it was raised from) came out of the user's own code
    (the step's module, a model library it calls) rather than from autopp's checks, whose messages say what to fix;
    else ''."""
    import traceback

    import autopp
    from autopp import core, planner, profiler, runtime

    ours = tuple(os.path.dirname(m.__file__) + os.sep for m in (autopp, core, planner, profiler, runtime))
    libraries = tuple({os.path.realpath(p) + os.sep for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)})
    for err in (e.__cause__, e):
        if err is None or err.__traceback__ is None:
            continue
        frames = traceback.extract_tb(err.__traceback__)
        if not frames or frames[-1].filename.startswith(ours):
            continue
        user = [f for f in frames if not f.filename.startswith(ours)
                and not os.path.realpath(f.filename).startswith(libraries)]
        if user:
            f = user[-1]
            return (f" (raised at {f.filename}:{f.lineno} in {f.name}; AUTOPP_DEBUG=1 shows the whole "
                    "traceback)")
    return ""


def _what(value) -> str:
    """``int 42``, ``dict {'w': ...}``: a value's type and (shortened) repr, for error messages."""
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 40 else text[:37] + '...'}"


def load_step(spec: str):
    """Import ``package.module:function`` (the current directory first on the path, as ``python -m`` does), call the
    function with no arguments and check what it returns: ``(step, args, batch_argnums)`` (None: the last
    argument is the batch)."""
    import importlib
    import inspect

    where = f"--step {spec!r}"
    module_name, sep, attr = (spec or "").partition(":")
    module_name, attr = module_name.strip(), attr.strip()
    if not sep or not module_name or not attr:
        raise ValueError(f"{where}: expected {_STEP_FORM}: a module importable from the current directory, a colon, "
                         "and a function of it that returns (step, args) or (step, args, batch_argnums).")
    if module_name.endswith(".py") or "/" in module_name or "\\" in module_name:
        dotted = module_name.removesuffix(".py").replace("/", ".").replace("\\", ".").strip(".")
        raise ValueError(f"{where}: {module_name!r} is a file path; name the module as Python imports it, e.g. "
                         f"--step {dotted}:{attr} (expected {_STEP_FORM}).")
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        missing = e.name or ""
        if missing and (module_name == missing or module_name.startswith(missing + ".")):
            raise ValueError(f"{where}: no module named {module_name!r} in the current directory ({cwd}) or the "
                             f"installed packages; expected {_STEP_FORM}, run from the directory that holds the "
                             "package.") from None
        raise ValueError(f"{where}: importing {module_name!r} failed: {e} (a module it imports is not "
                         "installed).") from None
    fn = module
    for part in attr.split("."):
        if not hasattr(fn, part):
            names = sorted(n for n, v in vars(module).items()
                           if not n.startswith("_") and inspect.isfunction(v) and v.__module__ == module.__name__)
            listed = f"; its functions: {', '.join(names)}" if names else ""
            raise ValueError(f"{where}: module {module_name!r} has no attribute {attr!r}{listed} (expected "
                             f"{_STEP_FORM}).")
        fn = getattr(fn, part)
    if not callable(fn):
        raise ValueError(f"{where}: {module_name}.{attr} is {_what(fn)}, not a function; expected "
                         f"{_STEP_FORM}, a function returning (step, args) or (step, args, batch_argnums).")
    try:
        inspect.signature(fn).bind()
    except TypeError:
        raise ValueError(f"{where}: {module_name}.{attr} needs arguments, but --step calls it with none; give "
                         "every parameter a default, or wrap it in a function without parameters.") from None
    except ValueError:  # no signature (a builtin): just call it
        pass
    try:
        out = fn()
    except (ValueError, TypeError) as e:  # say whose error it is (others keep their traceback)
        kind = TypeError if isinstance(e, TypeError) else ValueError
        raise kind(f"{where}: {module_name}.{attr}() raised {type(e).__name__}: {e}") from e
    expected = ("expected (step, args) or (step, args, batch_argnums): the training step, a tuple of its "
                "positional arguments (arrays or jax.ShapeDtypeStruct pytrees) and which of them is the batch")
    if not isinstance(out, (tuple, list)) or len(out) not in (2, 3):
        what = f"a {len(out)}-tuple" if isinstance(out, (tuple, list)) else _what(out)
        raise ValueError(f"{where}: {module_name}.{attr}() returned {what}; {expected}.")
    step, step_args = out[0], out[1]
    batch_argnums = out[2] if len(out) == 3 else None
    if not callable(step):
        raise ValueError(f"{where}: the first element {module_name}.{attr}() returned (the step) is {_what(step)}, "
                         f"not a function; {expected}.")
    if not isinstance(step_args, (tuple, list)) or not step_args:
        raise ValueError(f"{where}: the second element {module_name}.{attr}() returned (the step's arguments) is "
                         f"{'empty' if isinstance(step_args, (tuple, list)) else _what(step_args)}, not a non-empty "
                         f"tuple of the step's positional arguments; {expected}.")
    if batch_argnums is not None and not (
            (isinstance(batch_argnums, int) and not isinstance(batch_argnums, bool))
            or (isinstance(batch_argnums, (tuple, list)) and batch_argnums
                and all(isinstance(a, int) and not isinstance(a, bool) for a in batch_argnums))):
        raise ValueError(f"{where}: batch_argnums {batch_argnums!r} ({module_name}.{attr}() returned third) must be "
                         "an int or a tuple of ints naming the batch argument(s), or None for the last one.")
    return step, tuple(step_args), batch_argnums


def _profile_user_step(args, cluster, **kwargs):
    """The :class:`~autopp.profiler.Profile` of ``--step`` on ``cluster``, and a one-line description."""
    from autopp.profiler import profile

    step, step_args, batch_argnums = load_step(args.step)
    t = time.perf_counter()
    prof = profile(step, *step_args, cluster=cluster, batch_argnums=batch_argnums, **kwargs)
    what = (f"step {args.step} ({prof.param_bytes / 2**30:.3g} GiB of parameters, {len(prof.layers)} layers, traced "
            f"at batch {prof.batch_size}; profiled in {time.perf_counter() - t:.1f} s)")
    return prof, what


def _describe(kind: str, config) -> str:
    n = config.num_params
    return f"{kind} {config.to_dict()} ({n / 1e9:.3g}B parameters)" if n >= 1e8 else \
        f"{kind} {config.to_dict()} ({n / 1e6:.3g}M parameters)"


def _model_step(args):
    """The zoo model named on the command line, its abstract training state and step (AdamW)."""
    from autopp.models import MLP, make_train_step

    kind, config = _zoo_config(args, args.command)
    if kind == "mlp":
        import jax
        import jax.numpy as jnp
        import optax

        model = MLP(config)
        batch = {"x": jax.ShapeDtypeStruct((args.batch_size, config.sizes[0]), jnp.float32),
                 "y": jax.ShapeDtypeStruct((args.batch_size, config.sizes[-1]), jnp.float32)}
        tx = optax.adamw(1e-4)
        params = model.init_abstract()
        return kind, config, make_train_step(model.loss, tx), (params, jax.eval_shape(tx.init, params), batch), None
    step, state, batch_argnums = config.abstract_step(batch_size=args.batch_size)
    return kind, config, step, state, batch_argnums


def _add_model_flags(p, models=("gpt", "llama"), *, mlp: bool = False, batch_size: bool = False,
                     step: bool = True) -> None:
    """The flags that say what is modelled: ``--model`` and its shape, or (``step``) ``--step``."""
    which = p.add_mutually_exclusive_group() if step else p
    which.add_argument("--model", choices=models, default=None, help="zoo model (default gpt)")
    if step:
        which.add_argument("--step", default=None, metavar="MODULE:FUNCTION",
                           help="your own training step instead of a zoo model: package.module:function, imported "
                                "from the current directory (as python -m does) and called with no arguments; it "
                                "returns (step, args) or (step, args, batch_argnums), args arrays or "
                                "jax.ShapeDtypeStruct pytrees")
    p.add_argument("--layers", type=_positive, default=None, help="blocks (default 4)")
    p.add_argument("--hidden", type=_positive, default=None, help="model width (default 256)")
    p.add_argument("--heads", type=_positive, default=None, help="attention (query) heads (default 8)")
    p.add_argument("--seq", type=_positive, default=None, help="sequence length (default 128)")
    p.add_argument("--vocab", type=_positive, default=None, help="vocabulary size (default 1024)")
    if "llama" in models:
        p.add_argument("--kv-heads", type=_positive, default=None,
                       help="llama: key/value heads of grouped-query attention (default: --heads)")
        p.add_argument("--ffn", type=_positive, default=None,
                       help="llama: SwiGLU width (default: 8/3 of --hidden rounded up to a multiple of 256)")
        p.add_argument("--rope-theta", type=float, default=None, help="llama: rotary embedding base (default 10000)")
    p.add_argument("--dtype", choices=_DTYPES, default=None,
                   help="compute (activation and matmul) dtype (default bfloat16)")
    p.add_argument("--param-dtype", choices=_DTYPES, default=None,
                   help="parameter storage dtype (default float32: mixed precision, float32 master weights cast to "
                        "--dtype where used)")
    if mlp:
        p.add_argument("--sizes", type=_positive, nargs="+", default=None,
                       help="MLP layer widths (default 64 128 128 64 8)")
    if batch_size:
        p.add_argument("--batch-size", type=_positive, default=None,
                       help="global batch of a zoo model (default 1; --step: the step's own arguments give it)")


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


def _cluster(args):
    """``--cluster`` with its ``--override``s (None: the local devices)."""
    from autopp.profiler import Cluster

    cluster = Cluster.parse(args.cluster) if args.cluster is not None else Cluster.local()  # "" is refused
    if args.override:
        cluster = cluster.with_device_overrides(**_parse_overrides(args.override))
    return cluster


def _planning_model(args, command: str, cluster, *, dtype: str = "bfloat16"):
    """What ``plan``/``simulate``/``compare`` model: the zoo config of the flags (traced by the planner) or the
    profile of ``--step``; with a description and a JSON-friendly summary."""
    if args.step:
        _check_step_alone(args)
        prof, what = _profile_user_step(args, cluster)
        return prof, what, {"step": args.step, "param_bytes": prof.param_bytes, "traced_batch_size": prof.batch_size}
    kind, config = _zoo_config(args, command, dtype=dtype)
    return config, _describe(kind, config), {"model": kind, **config.to_dict()}


def cmd_profile(args) -> int:
    import json

    if args.measure:
        _use_cpu_devices(1)
    from autopp.profiler import profile

    cluster = _cluster(args)
    if args.step:
        _check_step_alone(args)
        if args.batch_size is not None:
            raise ValueError(f"--batch-size describes a zoo model's batch; with --step {args.step} the step's own "
                             "arguments give it: drop --batch-size, or change the batch your function returns.")
        step, state, batch_argnums = load_step(args.step)
        what, summary = f"step {args.step}", {"step": args.step}
    else:
        args.batch_size = args.batch_size or 1
        kind, config, step, state, batch_argnums = _model_step(args)
        what, summary = f"{kind} {config.to_dict()}, batch {args.batch_size}", config.to_dict()
    progress = None
    if args.measure and not args.json and sys.stderr.isatty():
        from rich.console import Console

        console = Console(stderr=True)
        status = console.status("profiling")
        status.start()
        progress = status.update
    t = time.perf_counter()
    try:
        prof = profile(step, *state, cluster=cluster, measure=args.measure, progress=progress,
                       batch_argnums=batch_argnums)
    finally:
        if progress:
            status.stop()
    elapsed = time.perf_counter() - t
    if args.json:
        out = prof.to_dict()
        out["model"] = summary
        out["profile_seconds"] = elapsed
        print(json.dumps(out, indent=1))
    else:
        print(what if not args.step else f"{what} (traced at batch {prof.batch_size})")
        print(prof.table())
        print(f"profiled in {elapsed:.2f} s")
    return 0


def cmd_plan(args) -> int:
    from autopp.planner import plan_model

    cluster = _cluster(args)
    if args.out:  # before planning, which may take minutes
        folder = os.path.dirname(os.path.abspath(args.out))
        if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
            raise ValueError(f"--out {args.out}: the folder {folder} does not exist or cannot be written; create it "
                             "or write the plan elsewhere.")
    t = time.perf_counter()
    model, what, _ = _planning_model(args, "plan", cluster)
    kwargs = {}
    for name in ("schedules", "recompute", "microbatch_sizes", "pipeline_degrees", "tensor_degrees"):
        if getattr(args, name):
            kwargs[name] = tuple(getattr(args, name))
    if args.time_limit is not None:
        kwargs["time_limit_s"] = args.time_limit
    if args.loss_reduction is not None:
        kwargs["loss_reduction"] = args.loss_reduction
    plan = plan_model(model, cluster, global_batch=args.global_batch, **kwargs)
    elapsed = time.perf_counter() - t
    if args.out:
        plan.to_json(args.out)
    if args.json:
        print(plan.to_json())
        return 0
    print(f"{what} on {cluster}, global batch {args.global_batch}")
    print(plan)
    print(f"planned in {elapsed:.1f} s (tracing and profiling included)")
    if args.out:
        print(f"plan written to {args.out} (autopp show {args.out})")
    return 0


def cmd_simulate(args) -> int:
    import json

    from autopp.core import unit
    from autopp.planner import simulate

    cluster = _cluster(args)
    model, what, summary = _planning_model(args, "simulate", cluster)
    if args.dp is None and cluster.num_devices % (args.tp * args.pp):
        raise ValueError(f"tp*pp = {args.tp}*{args.pp} = {args.tp * args.pp} does not divide the "
                         f"{cluster.num_devices} devices of {cluster}; choose degrees whose product divides it.")
    dp = args.dp if args.dp is not None else cluster.num_devices // (args.tp * args.pp)
    est = simulate(model, cluster, global_batch=args.global_batch, tp=args.tp, pp=args.pp, dp=dp,
                   microbatch_size=args.microbatch_size, schedule=args.schedule, recompute=args.recompute,
                   virtual_stages=args.virtual_stages, fsdp=args.fsdp, zero1=args.zero1,
                   sequence_parallel=args.sequence_parallel)
    if args.json:
        print(json.dumps({"model": summary, "cluster": cluster.to_dict(),
                          "layout": {"tp": args.tp, "pp": args.pp, "dp": dp, "microbatch_size": args.microbatch_size,
                                     "schedule": args.schedule, "recompute": args.recompute,
                                     "virtual_stages": args.virtual_stages, "fsdp": args.fsdp, "zero1": args.zero1,
                                     "sequence_parallel": args.sequence_parallel},
                          "predicted": est.to_dict()}, indent=1))
        return 0
    extras = "".join(f", {x}" for x, on in (("ZeRO-1", args.zero1), ("sequence parallel", args.sequence_parallel))
                     if on)
    print(f"{what} on {cluster}, global batch {args.global_batch}")
    print(f"layout: tp {args.tp} x pp {args.pp} x dp {dp} (FSDP over {args.fsdp}{extras}), microbatch "
          f"{args.microbatch_size} ({est.num_microbatches} per step), {args.schedule}"
          f"{f' v={args.virtual_stages}' if args.virtual_stages > 1 else ''}, recompute {args.recompute}")
    print(f"step time      {est.step_time_s:10.4g} s   (compute {est.compute_s:.4g}, bubble {est.bubble_s:.4g}, "
          f"tp {est.tp_comm_s:.4g}, fsdp {est.fsdp_comm_s:.4g}, pp {est.pp_comm_s:.4g}, dp {est.dp_comm_s:.4g}, "
          f"optimizer {est.optimizer_s:.4g})")
    fdiv, fname = unit(est.tflops_per_gpu * 1e12, "flop")
    mdiv, mname = unit(est.peak_memory_bytes_per_gpu, "bytes")
    print(f"{fname + '/s/GPU':<14} {est.tflops_per_gpu * 1e12 / fdiv:10.4g}     MFU "
          f"{'-' if est.mfu is None else f'{est.mfu * 100:.3g}%'}")
    print(f"memory/GPU     {est.peak_memory_bytes_per_gpu / mdiv:10.2f} {mname} ({'fits' if est.fits else 'DOES NOT FIT'} "
          f"in {cluster.memory_per_device / 2**30:.1f} GiB)")
    return 0


def _add_cluster_flags(p, *, required: bool = True) -> None:
    p.add_argument("--cluster", required=required, default=None,
                   help="target cluster NODESxDEVICESxKIND (or DEVICESxKIND: one node), e.g. 128x8xH100"
                   + ("" if required else " (default: local devices)"))
    p.add_argument("--override", action="append", metavar="FIELD=VALUE",
                   help="override a device field, e.g. --override matmul_efficiency=0.6 (repeatable)")


_COMPARE_HELP = ("autopp's plan against SPMD baselines (data parallel, FSDP, tensor parallel): measured on local "
                 "devices or predicted for a cluster")
"""``autopp compare``'s line in ``autopp --help`` (its parser is built only for that command: see :func:`main`)."""


def _subcommand(argv: list[str]) -> str | None:
    """The subcommand ``argv`` names: its first word that is not an option (the top-level parser has none that take
    a value)."""
    return next((a for a in argv if not a.startswith("-")), None)


def main(argv=None) -> int:
    """Run the ``autopp`` command line. Everything that imports JAX (the commands, ``compare``'s parser) is imported
    after the arguments are parsed, so that ``autopp --help`` and argument errors answer at once."""
    parser = argparse.ArgumentParser(prog="autopp", description="Automatic MPMD pipeline parallelism for JAX.")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="train the zoo GPT as a pipeline on CPU devices and print what happens")
    demo.add_argument("--devices", type=_positive, default=8, help="CPU devices to use (default 8)")
    demo.add_argument("--stages", type=_positive, default=4, help="pipeline stages (default 4)")
    demo.add_argument("--microbatches", type=_positive, default=8, help="microbatches per step (default 8)")
    demo.add_argument("--schedule", default="1f1b",
                      help="gpipe, 1f1b, interleaved-1f1b, zb-h1 or dualpipev (default 1f1b)")
    demo.add_argument("--steps", type=_positive, default=30, help="training steps (default 30)")
    demo.add_argument("--batch-size", type=_positive, default=32, help="(default 32)")
    demo.add_argument("--layers", type=_positive, default=4, help="(default 4)")
    demo.add_argument("--hidden", type=_positive, default=64, help="(default 64)")
    demo.add_argument("--heads", type=_positive, default=4, help="(default 4)")
    demo.add_argument("--seq", type=_positive, default=32, help="(default 32)")
    demo.add_argument("--vocab", type=_positive, default=128, help="(default 128)")
    demo.add_argument("--learning-rate", type=float, default=3e-3, help="AdamW learning rate (default 3e-3)")
    demo.set_defaults(func=cmd_demo)
    prof = sub.add_parser("profile", help="per-layer FLOPs, time and memory of a training step (zoo model or "
                                          "--step)")
    _add_model_flags(prof, ("gpt", "llama", "mlp"), mlp=True, batch_size=True)
    _add_cluster_flags(prof, required=False)
    prof.add_argument("--measure", action="store_true", help="compile and time each distinct layer locally")
    prof.add_argument("--json", action="store_true", help="machine-readable output")
    prof.set_defaults(func=cmd_profile)
    sim = sub.add_parser("simulate", help="predict step time, TFLOP/s and memory of a layout on a cluster "
                                          "(zoo model or --step)")
    _add_model_flags(sim)
    sim.add_argument("--global-batch", type=_positive, required=True, help="examples (sequences) per step")
    _add_cluster_flags(sim)
    sim.add_argument("--tp", type=_positive, default=1, help="tensor-parallel degree (default 1)")
    sim.add_argument("--pp", type=_positive, default=1, help="pipeline stages (default 1)")
    sim.add_argument("--dp", type=_positive, default=None, help="default: devices / (tp * pp)")
    sim.add_argument("--microbatch-size", type=_positive, default=1, help="sequences per microbatch (default 1)")
    sim.add_argument("--schedule", default="1f1b", help="pipeline schedule (default 1f1b)")
    sim.add_argument("--recompute", default="full", help="none, selective or full (default full)")
    sim.add_argument("--virtual-stages", type=_positive, default=1,
                     help="model chunks per stage with interleaved-1f1b (default 1)")
    sim.add_argument("--fsdp", type=_positive, default=1, help="FSDP (ZeRO-3) degree inside dp (default 1)")
    sim.add_argument("--zero1", action="store_true", help="shard the optimizer state over the data-parallel "
                                                          "replicas (ZeRO-1)")
    sim.add_argument("--sequence-parallel", action="store_true",
                     help="split the activations between layers along the sequence over the tensor group")
    sim.add_argument("--json", action="store_true")
    sim.set_defaults(func=cmd_simulate)
    plan = sub.add_parser("plan", help="find the fastest layout on a cluster (zoo model or --step; sharding ILP, "
                                       "CP-SAT stage split, schedule simulation)")
    _add_model_flags(plan)
    plan.add_argument("--global-batch", type=_positive, required=True, help="examples (sequences) per step")
    _add_cluster_flags(plan)
    plan.add_argument("--schedules", nargs="+", default=None, help="restrict the schedules searched")
    plan.add_argument("--recompute", nargs="+", default=None, help="restrict the recomputation modes searched")
    plan.add_argument("--microbatch-sizes", type=_positive, nargs="+", default=None,
                      help="microbatch sizes searched (default 1 2 4 8)")
    plan.add_argument("--pipeline-degrees", type=_positive, nargs="+", default=None,
                      help="restrict the pipeline degrees searched")
    plan.add_argument("--tensor-degrees", type=_positive, nargs="+", default=None,
                      help="restrict the tensor degrees searched (divisors of a node's devices)")
    plan.add_argument("--time-limit", type=float, default=None,
                      help="seconds CP-SAT may spend per stage split (default 5)")
    plan.add_argument("--loss-reduction", choices=("mean", "sum"), default=None,
                      help="how the step's loss combines examples, as parallelize's loss_reduction (default mean)")
    plan.add_argument("--out", default=None, help="write the plan's JSON here")
    plan.add_argument("--json", action="store_true", help="print the plan's JSON")
    plan.set_defaults(func=cmd_plan)
    show = sub.add_parser("show", help="print a saved plan: stages, memory, predicted timeline, per-layer sharding, "
                                       "planner statistics")
    show.add_argument("plan", help="path of a plan's JSON (plan.to_json(path))")
    show.add_argument("--grid", action="store_true", help="also print the schedule grid")
    show.set_defaults(func=cmd_show)
    argv = sys.argv[1:] if argv is None else list(argv)
    if _subcommand(argv) == "compare":  # its module imports JAX: only for this command
        from autopp import _compare

        _compare.add_parser(sub, _add_model_flags, _positive)
    else:  # listed in `autopp --help` without importing it
        sub.add_parser("compare", help=_COMPARE_HELP)
    from autopp import _launch

    _launch.add_parser(sub, _positive)
    args = parser.parse_args(argv)
    # The analyses (trace, profile, plan) run for seconds over a large traced program: Python's cyclic garbage
    # collector walks it again and again for about 10% of their time, to free some megabytes (GPT-3 175B planned:
    # 5 MB more at most). It is paused while they run.
    paused = args.command in ("plan", "simulate", "profile") and gc.isenabled()
    if paused:
        gc.disable()
    try:
        return args.func(args)
    except (ValueError, TypeError) as e:
        if os.environ.get("AUTOPP_DEBUG"):
            raise
        print(f"autopp {args.command}: error: {e}{_user_code_location(e)}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # the reader stopped early (``autopp show plan.json | head``): nothing left to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so that the exit's flush does not fail
        return 0
    finally:
        if paused:
            gc.enable()


if __name__ == "__main__":
    sys.exit(main())

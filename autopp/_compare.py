"""``autopp compare``: autopp's plan against the SPMD baselines (:mod:`autopp.baselines`) for one model and batch.

On the local devices every layout runs for real (:func:`compare_local`): steady-state step time (median of
interleaved timed steps after a warm-up that compiles), TFLOP/s per device from the step's FLOPs
(:func:`autopp.profiler.profile`: forward + backward + optimizer update, the same count for every layout), MFU
where the devices' peak is known (not on CPUs), peak memory per device (autopp: ``step.memory_report``; a
baseline: XLA's ``memory_analysis()`` of its program).

For a target cluster (:func:`compare_cluster`) every row is predicted by the same cost model: autopp's row is
:func:`autopp.planner.plan_model`'s plan, each baseline :func:`autopp.planner.simulate` with ``pp=1`` and the
baseline's degrees (data parallel: ``dp = devices``; FSDP: ``fsdp = dp = devices``; tensor parallel:
``tp`` inside a node x ``dp`` over the rest), with the microbatch size (gradient accumulation), recomputation
and, for tensor parallelism, the degree a user would tune: the fastest that fits.

Speedup is against the fastest baseline (that fits, when predicted).
"""

from __future__ import annotations

import dataclasses
import json
import warnings
import statistics
import time
from collections.abc import Sequence
from typing import Any

import jax

from autopp._baselines import BASELINES
from autopp._metrics import format_bytes, known_peak_flops

from autopp.planner import DEFAULT_MICROBATCH_SIZES as MICROBATCH_SIZES


@dataclasses.dataclass(frozen=True)
class CompareRow:
    """One layout's step time, throughput and memory."""

    name: str
    """``"autopp"`` or a baseline name (:data:`autopp.baselines.BASELINES`)."""
    layout: str
    """What runs: mesh degrees, pipeline stages, microbatches, recomputation."""
    step_time_s: float
    tflops_per_device: float
    mfu: float | None
    """None where the devices' peak FLOP/s is not known (CPUs)."""
    peak_memory_bytes: int
    """Peak bytes on the most loaded device."""
    fits: bool
    speedup: float | None = None
    """Fastest baseline's step time / this row's (None when no baseline fits)."""
    simulate_kwargs: dict[str, Any] | None = None
    """Predicted baselines: the :func:`autopp.planner.simulate` keywords that give this row."""


@dataclasses.dataclass(frozen=True)
class Comparison:
    """The rows of ``autopp compare``."""

    rows: tuple[CompareRow, ...]
    mode: str
    """``"measured"`` (local devices) or ``"predicted"`` (a target cluster)."""
    model: dict[str, Any]
    cluster: str
    global_batch: int
    reference: str | None
    """The baseline the speedups are relative to."""

    def table(self) -> str:
        head = ("layout", "configuration", "step time", "TFLOP/s/dev", "MFU", "peak mem/dev", "speedup")
        body = []
        for r in self.rows:
            body.append((r.name, r.layout, _seconds(r.step_time_s), f"{r.tflops_per_device:.3g}",
                         "-" if r.mfu is None else f"{r.mfu * 100:.1f}%",
                         format_bytes(r.peak_memory_bytes) + ("" if r.fits else " (does not fit)"),
                         "-" if r.speedup is None else f"{r.speedup:.2f}x"))
        widths = [max(len(row[i]) for row in (head, *body)) for i in range(len(head))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in (head, *body)]
        lines.insert(1, "  ".join("-" * w for w in widths))
        ref = f"speedup vs {self.reference} (the fastest baseline{' that fits' if self.mode == 'predicted' else ''})" \
            if self.reference else "no baseline fits: no speedup"
        return "\n".join(lines + [f"{self.mode}; {ref}"])

    def markdown(self) -> str:
        """The table as Markdown (for the README)."""
        out = ["| layout | configuration | step time | TFLOP/s/dev | MFU | peak mem/dev | speedup |",
               "| --- | --- | --- | --- | --- | --- | --- |"]
        for r in self.rows:
            out.append(f"| {r.name} | {r.layout} | {_seconds(r.step_time_s)} | {r.tflops_per_device:.3g} | "
                       f"{'-' if r.mfu is None else f'{r.mfu * 100:.1f}%'} | {format_bytes(r.peak_memory_bytes)}"
                       f"{'' if r.fits else ' (does not fit)'} | {'-' if r.speedup is None else f'{r.speedup:.2f}x'} |")
        return "\n".join(out)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    def plot(self, path: str) -> None:
        """A bar chart (PNG) of step time and TFLOP/s per device per layout."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        names = [r.name for r in self.rows]
        colors = ["tab:orange" if n == "autopp" else "tab:blue" for n in names]
        fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
        for ax, values, label in ((axes[0], [r.step_time_s for r in self.rows], "step time (s)"),
                                  (axes[1], [r.tflops_per_device for r in self.rows], "TFLOP/s per device")):
            bars = ax.bar(names, values, color=colors)
            for bar, r in zip(bars, self.rows):
                if not r.fits:
                    bar.set_hatch("//")
            ax.set_ylabel(label)
            ax.tick_params(axis="x", labelrotation=15)
        fig.suptitle(f"{self.mode} on {self.cluster}, global batch {self.global_batch}"
                     + ("" if all(r.fits for r in self.rows) else " (hatched: does not fit)"))
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)


def _seconds(s: float) -> str:
    return f"{s:.3f} s" if s >= 1 else f"{s * 1e3:.1f} ms"


def _with_speedups(rows: list[CompareRow], mode: str) -> tuple[list[CompareRow], str | None]:
    base = [r for r in rows if r.name != "autopp" and r.fits]
    if not base:
        return rows, None
    best = min(base, key=lambda r: r.step_time_s)
    return [dataclasses.replace(r, speedup=best.step_time_s / r.step_time_s if r.fits else None) for r in rows], \
        best.name


def _microbatches(count: int, size: int | None) -> str:
    return f"{count} microbatch{'es' if count != 1 else ''}" + (f" of {size}" if size else "")


def _params(n: int) -> str:
    return f"{n / 1e9:.4g}B" if n >= 1e9 else f"{n / 1e6:.4g}M"


def describe_plan(plan) -> str:
    """``4 stages x (data 2), 1f1b, 8 x mb 4, recompute none, ZeRO-1``: a plan in one line (an interleaved plan:
    ``4 device groups (16 stages) x ...``)."""
    meshes = []
    for st in plan.stages:
        m = " x ".join(f"{k} {v}" for k, v in st.mesh_shape.items() if v > 1 or k == "data")
        if m not in meshes:
            meshes.append(m)
    rec = sorted({st.recompute for st in plan.stages})
    sched = plan.schedule + (f" v={plan.virtual_stages}" if plan.virtual_stages > 1 else "")
    stages = plan.num_stages // max(1, plan.virtual_stages) if plan.virtual_stages > 1 else plan.num_stages
    mb = _microbatches(plan.num_microbatches, plan.microbatch_size)
    sched = f"{sched}, " if stages > 1 else ""  # one stage: plain gradient accumulation, no schedule
    extras = "".join(f", {name}" for name, on in (("ZeRO-1", plan.zero1), ("sequence parallel",
                                                                         plan.sequence_parallel)) if on)
    what = (f"{stages} device groups ({plan.num_stages} stages)" if plan.virtual_stages > 1
            else f"{stages} stage{'s' if stages != 1 else ''}")  # as `autopp show` counts the stages
    return f"{what} x ({' | '.join(meshes)}), {sched}{mb}, recompute {'/'.join(rec)}{extras}"


# -- measured ------------------------------------------------------------------------------------------------------
def compare_local(model, global_batch: int, *, devices: Sequence[jax.Device] | None = None, steps: int = 5,
                  tensor: int = 2, parallelize_kwargs: dict[str, Any] | None = None,
                  optimizer=None) -> Comparison:
    """Measure autopp (``autopp.parallelize(step, devices=devices, **parallelize_kwargs)``: planned when no counts
    are given) and every baseline on ``devices`` (default ``jax.devices()``) for the zoo ``model`` (a
    :class:`~autopp.models.GPTConfig`, :class:`~autopp.models.LlamaConfig` or the model itself) with ``global_batch``
    sequences and AdamW:
    one warm-up step each (it compiles), then ``steps`` rounds, each timing one step of every layout in turn
    (noise hits all); the median per layout."""
    import optax

    import autopp
    from autopp import baselines
    from autopp.models import GPT, GPTConfig, Llama, LlamaConfig, make_train_step
    from autopp.profiler import profile

    if isinstance(model, GPTConfig):
        model = GPT(model)
    elif isinstance(model, LlamaConfig):
        model = Llama(model)
    if not isinstance(model, (GPT, Llama)):
        raise TypeError(f"compare: model must be a zoo GPT or Llama (or its config), got {type(model).__name__}.")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"compare: steps must be a positive int, got {steps!r}.")
    devices = list(jax.devices() if devices is None else devices)
    tx = optimizer or optax.adamw(1e-4)
    step_fn = make_train_step(model.loss, tx)
    params = jax.jit(model.init)(jax.random.key(0))  # one program each, not one per eager operation
    state = (params, jax.jit(tx.init)(params))
    batch = jax.jit(model.batch, static_argnums=1)(jax.random.key(1), global_batch)

    steps_by_name: dict[str, Any] = {"autopp": autopp.parallelize(step_fn, devices=devices,
                                                                  **(parallelize_kwargs or {}))}
    for name in BASELINES:
        steps_by_name[name] = baselines.baseline(name, step_fn, devices=devices,
                                                 tensor=tensor if name == "tensor-parallel" else None)
    flops = profile(step_fn, *state, batch).total_flops
    peak = known_peak_flops(devices, model.config.dtype)

    current = {}
    for name, fn in steps_by_name.items():  # warm-up: trace, plan, compile
        out = fn(*state, batch)
        jax.block_until_ready(out)
        current[name] = tuple(out[:-1])
    times: dict[str, list[float]] = {k: [] for k in steps_by_name}
    for _ in range(steps):
        for name, fn in steps_by_name.items():
            t = time.perf_counter()
            out = fn(*current[name], batch)
            jax.block_until_ready(out)
            times[name].append(time.perf_counter() - t)
            current[name] = tuple(out[:-1])

    rows = []
    n = len(devices)
    for name, fn in steps_by_name.items():
        t = statistics.median(times[name])
        if name == "autopp":
            layout = describe_plan(fn.plan_for(*state, batch))
            mem = int(max(fn.memory_report(*state, batch).values()))
        else:
            layout = str(fn.layout)
            mem = fn.peak_memory_bytes(*state, batch)
        rows.append(CompareRow(name=name, layout=layout, step_time_s=t, tflops_per_device=flops / t / n / 1e12,
                               mfu=None if peak is None else flops / (t * n * peak), peak_memory_bytes=mem,
                               fits=True))
    rows, ref = _with_speedups(rows, "measured")
    from autopp.profiler import Cluster

    try:
        cluster = str(Cluster.local(devices))
    except ValueError:
        cluster = f"{n} local devices"
    return Comparison(rows=tuple(rows), mode="measured", model=model.config.to_dict(), cluster=cluster,
                      global_batch=global_batch, reference=ref)


# -- predicted -----------------------------------------------------------------------------------------------------
def _baseline_degrees(name: str, config, cluster, tensor: int | None) -> list[dict[str, int]]:
    n = cluster.num_devices
    if name == "data-parallel":
        return [{"tp": 1, "dp": n, "fsdp": 1}]
    if name == "fsdp":
        return [{"tp": 1, "dp": n, "fsdp": n}]
    if tensor is not None:
        return [{"tp": tensor, "dp": n // tensor, "fsdp": 1}]
    heads = getattr(config, "heads", None)  # a traced step's profile: any degree the sharding ILP can use
    tps = [t for t in range(2, cluster.devices_per_node + 1)
           if cluster.devices_per_node % t == 0 and (heads is None or heads % t == 0) and n % t == 0]
    if not tps:
        what = f" and the {heads} heads" if heads is not None else ""
        raise ValueError(f"compare: no tensor-parallel degree > 1 divides the {cluster.devices_per_node} devices "
                         f"of a node{what}; there is no tensor-parallel baseline.")
    return [{"tp": t, "dp": n // t, "fsdp": 1} for t in tps]


def predict_baseline(name: str, config, cluster, global_batch: int, *, tensor: int | None = None) -> CompareRow:
    """The baseline ``name`` on ``cluster`` as :func:`autopp.planner.simulate` predicts it (``pp=1``), tuned over
    microbatch size, recomputation (and the tensor degree when ``tensor`` is None): the fastest that fits, else
    the one needing the least memory."""
    from autopp.planner import simulate
    from autopp.planner import RECOMPUTE_MODES

    best = None
    for deg in _baseline_degrees(name, config, cluster, tensor):
        for mbs in MICROBATCH_SIZES:
            if global_batch % (mbs * deg["dp"]):
                continue
            for rec in RECOMPUTE_MODES:
                # the SPMD baselines as users write them: no ZeRO-1, no sequence parallelism
                kw = dict(global_batch=global_batch, tp=deg["tp"], pp=1, dp=deg["dp"], fsdp=deg["fsdp"],
                          zero1=False, sequence_parallel=False, microbatch_size=mbs, schedule="1f1b",
                          recompute=rec)
                with warnings.catch_warnings():  # (a baseline's tensor degree that splits nothing is priced so)
                    warnings.filterwarnings("ignore", message=r"simulate: tp=\d+ splits none")
                    est = simulate(config, cluster, **kw)
                rank = (not est.fits, est.step_time_s if est.fits else est.peak_memory_bytes_per_gpu)
                if best is None or rank < best[0]:
                    best = (rank, kw, est)
    if best is None:
        dp = _baseline_degrees(name, config, cluster, tensor)[0]["dp"]
        raise ValueError(f"compare: global batch {global_batch} does not split over the {dp} data-parallel replicas "
                         f"of the {name} baseline; use a multiple of {dp}.")
    _, kw, est = best
    parts = [f"tp {kw['tp']}"] if kw["tp"] > 1 else []
    parts += [f"fsdp {kw['fsdp']}"] if kw["fsdp"] > 1 else [f"dp {kw['dp']}"]
    layout = f"{' x '.join(parts)}, {_microbatches(est.num_microbatches, kw['microbatch_size'])}, recompute " \
             f"{kw['recompute']}"
    return CompareRow(name=name, layout=layout, step_time_s=est.step_time_s, tflops_per_device=est.tflops_per_gpu,
                      mfu=est.mfu, peak_memory_bytes=est.peak_memory_bytes_per_gpu, fits=est.fits,
                      simulate_kwargs=kw)


def compare_cluster(model, cluster, global_batch: int, *, tensor: int | None = None) -> Comparison:
    """Predict autopp's plan (:func:`autopp.planner.plan_model`) and every baseline (:func:`predict_baseline`)
    for ``model`` on ``cluster`` (a :class:`~autopp.Cluster` or a string like ``"128x8xH100"``): a zoo model or
    its config (``GPTConfig``, ``LlamaConfig``, anything with ``abstract_step()``) or the
    :class:`~autopp.profiler.Profile` of a traced step (made for ``cluster``'s device)."""
    from autopp.planner import plan_model
    from autopp.profiler import Cluster
    from autopp.profiler import Profile

    if isinstance(model, Profile) or hasattr(model, "abstract_step"):
        config = model
    else:
        config = getattr(model, "config", model)
    if isinstance(config, Profile):
        described = {"fingerprint": config.structure_fingerprint, "param_bytes": config.param_bytes,
                     "traced_batch_size": config.batch_size}
    else:
        described = config.to_dict()
    if isinstance(cluster, str):
        cluster = Cluster.parse(cluster)
    plan = plan_model(config, cluster, global_batch=global_batch)
    est = plan.predicted
    rows = [CompareRow(name="autopp", layout=describe_plan(plan), step_time_s=est.step_time_s,
                       tflops_per_device=est.tflops_per_gpu, mfu=est.mfu,
                       peak_memory_bytes=est.peak_memory_bytes_per_gpu, fits=est.fits)]
    rows += [predict_baseline(name, config, cluster, global_batch, tensor=tensor) for name in BASELINES]
    rows, ref = _with_speedups(rows, "predicted")
    return Comparison(rows=tuple(rows), mode="predicted", model=described, cluster=cluster.shorthand,
                      global_batch=global_batch, reference=ref)


# -- command line --------------------------------------------------------------------------------------------------
def add_parser(sub, add_model_flags, positive) -> None:
    """The ``compare`` subcommand (model flags shared with ``simulate``/``plan``: ``add_model_flags``)."""
    p = sub.add_parser("compare", help="autopp's plan against SPMD baselines (data parallel, FSDP, tensor "
                                       "parallel): measured on local devices or predicted for a cluster")
    add_model_flags(p, batch_size=True)
    p.set_defaults(batch_size=None, func=cmd_compare)
    for action in p._actions:  # the shared flags' help, with this command's defaults
        if action.dest == "dtype":
            action.help = "compute dtype (default: float32 locally, bfloat16 for a target cluster)"
        elif action.dest == "batch_size":
            action.help = "same as --global-batch"
        elif action.dest == "step":
            action.help += " (with a target --cluster only, not 'local': predicted, so its arguments may be abstract)"
    p.add_argument("--global-batch", type=positive, default=None, help="sequences per step (or --batch-size)")
    p.add_argument("--cluster", default="local",
                   help="'local' (measure on this machine's devices; default) or a target such as 128x8xH100 "
                        "(predict)")
    p.add_argument("--override", action="append", metavar="FIELD=VALUE",
                   help="target cluster: override a device field, e.g. --override matmul_efficiency=0.6")
    p.add_argument("--devices", type=positive, default=None,
                   help="local: devices to use (default all; on CPU 8 CPU devices are made)")
    p.add_argument("--steps", type=positive, default=None, help="local: timed steps per layout (default 5)")
    p.add_argument("--tensor", type=positive, default=None,
                   help="tensor degree of the tensor-parallel baseline (default: 2 locally; predicted: tuned)")
    p.add_argument("--stages", type=positive, default=None, help="local: autopp's stages (default: planned)")
    p.add_argument("--microbatches", type=positive, default=None,
                   help="local: autopp's microbatches (default: planned)")
    p.add_argument("--schedule", default=None, help="local: autopp's schedule (default: planned)")
    p.add_argument("--plot", default=None, metavar="PNG", help="write a bar chart of the table here")
    p.add_argument("--json", action="store_true", help="machine-readable output")


def cmd_compare(args) -> int:
    from autopp._cli import _planning_model, _use_cpu_devices, _zoo_config

    if args.global_batch is not None and args.batch_size is not None and args.global_batch != args.batch_size:
        raise ValueError(f"autopp compare: --global-batch {args.global_batch} and --batch-size {args.batch_size} "
                         "disagree; pass one of them.")
    batch = args.global_batch or args.batch_size
    if batch is None:
        raise ValueError("autopp compare: pass --global-batch (sequences per step), e.g. --global-batch 16.")
    local = args.cluster.strip().lower() == "local"
    if local:
        if args.step:
            raise ValueError(f"autopp compare: --step {args.step} needs a target --cluster (e.g. --cluster 2x8xH100): "
                             "locally every layout runs for real, which compare does for the zoo models only.")
        if args.override:
            raise ValueError("autopp compare: --override applies to a target --cluster; the local devices are "
                             "measured.")
        kind, config = _zoo_config(args, "compare", dtype="float32")
        what = f"{kind} {config.to_dict()} ({_params(config.num_params)} parameters)"
        n = args.devices or 8
        _use_cpu_devices(n)
        devices = jax.devices()
        if args.devices is not None:
            if args.devices > len(devices):
                raise ValueError(f"autopp compare: --devices {args.devices} but only {len(devices)} "
                                 f"{devices[0].platform} devices are here; use --devices <= {len(devices)}.")
            devices = devices[: args.devices]
        kw = {k: v for k, v in (("num_stages", args.stages), ("num_microbatches", args.microbatches),
                                ("schedule", args.schedule)) if v is not None}
        result = compare_local(config, batch, devices=devices, steps=args.steps or 5,
                               tensor=args.tensor or 2, parallelize_kwargs=kw)
    else:
        given = [f for f, v in (("--devices", args.devices), ("--steps", args.steps), ("--stages", args.stages),
                                ("--microbatches", args.microbatches), ("--schedule", args.schedule))
                 if v is not None]
        if given:
            raise ValueError(f"autopp compare: {', '.join(given)} apply to --cluster local only (a target cluster "
                             "is predicted: autopp's layout is planned, the baselines tuned); drop them.")
        from autopp._cli import _parse_overrides
        from autopp.profiler import Cluster

        cluster = Cluster.parse(args.cluster)
        if args.override:
            cluster = cluster.with_device_overrides(**_parse_overrides(args.override))
        model, what, summary = _planning_model(args, "compare", cluster, dtype="bfloat16")
        result = compare_cluster(model, cluster, batch, tensor=args.tensor)
        if args.step:
            result = dataclasses.replace(result, model=summary)
    if args.plot:
        result.plot(args.plot)
    if args.json:
        print(result.to_json())
        return 0
    print(f"{what}, global batch {batch}, on {result.cluster}")
    print(result.table())
    if args.plot:
        print(f"bar chart written to {args.plot}")
    return 0

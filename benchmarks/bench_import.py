"""The front door: what ``import autopp`` and ``autopp --help`` cost in a cold process, against ``import jax``.

Run: ``pytest benchmarks/bench_import.py -s``. Each figure is the median of interleaved rounds of fresh interpreters
(so that load drifts hit every command alike); every command's time includes the interpreter's own start-up.

* ``import autopp`` against ``import jax``: goal <= 1.3x. ``import autopp`` imports the package's names on first
  use (PEP 562); what the first ``autopp.parallelize`` costs is printed too, for information.
* ``autopp --help`` and ``autopp plan --help`` against ``import jax``: the command line parses its arguments before
  it imports JAX, so help and argument errors answer at once.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ROUNDS = int(os.environ.get("AUTOPP_BENCH_IMPORT_ROUNDS", "7"))
IMPORT_GOAL = 1.3


def _cli() -> list[str]:
    """The ``autopp`` console script next to this interpreter, else the module."""
    script = Path(sys.executable).parent / "autopp"
    return [str(script)] if script.exists() else [sys.executable, "-m", "autopp._cli"]


def _wall(argv: list[str]) -> float:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    t = time.perf_counter()
    res = subprocess.run(argv, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    dt = time.perf_counter() - t
    assert res.returncode == 0, f"{argv} failed:\n{res.stderr[-4000:]}"
    return dt


def _interleaved_medians(commands: dict[str, list[str]], rounds: int) -> dict[str, float]:
    """Median wall time of each command in fresh processes, one of each per round. One untimed run of each first, so
    that every command finds the same warm file-system cache and bytecode."""
    for argv in commands.values():
        _wall(argv)
    times: dict[str, list[float]] = {k: [] for k in commands}
    for _ in range(rounds):
        for name, argv in commands.items():
            times[name].append(_wall(argv))
    return {k: statistics.median(v) for k, v in times.items()}


def test_import_autopp_vs_import_jax(benchmark):
    py = sys.executable
    commands = {"jax": [py, "-c", "import jax"],
                "autopp": [py, "-c", "import autopp"],
                "autopp.parallelize": [py, "-c", "import autopp; autopp.parallelize"]}
    out: dict[str, float] = {}
    benchmark.pedantic(lambda: out.update(_interleaved_medians(commands, ROUNDS)), rounds=1, iterations=1)
    ratio = out["autopp"] / out["jax"]
    first_use = out["autopp.parallelize"] / out["jax"]
    benchmark.extra_info.update(jax_s=out["jax"], autopp_s=out["autopp"], parallelize_s=out["autopp.parallelize"],
                                ratio=ratio, goal=IMPORT_GOAL)
    print(f"\n[import] cold processes, median of {ROUNDS} interleaved rounds: `import autopp` {out['autopp']:.3f} s, "
          f"`import jax` {out['jax']:.3f} s: ratio {ratio:.2f} (goal <= {IMPORT_GOAL})\n"
          f"[import] `import autopp; autopp.parallelize` (first use: JAX and the runtime, planner and profiler) "
          f"{out['autopp.parallelize']:.3f} s: {first_use:.2f}x `import jax`")


def test_cli_help_vs_import_jax(benchmark):
    cli = _cli()
    commands = {"jax": [sys.executable, "-c", "import jax"],
                "autopp --help": [*cli, "--help"],
                "autopp plan --help": [*cli, "plan", "--help"]}
    out: dict[str, float] = {}
    benchmark.pedantic(lambda: out.update(_interleaved_medians(commands, ROUNDS)), rounds=1, iterations=1)
    benchmark.extra_info.update(jax_s=out["jax"], help_s=out["autopp --help"], plan_help_s=out["autopp plan --help"])
    print(f"\n[import] cold processes, median of {ROUNDS} interleaved rounds: `autopp --help` "
          f"{out['autopp --help']:.3f} s ({out['autopp --help'] / out['jax']:.2f}x), `autopp plan --help` "
          f"{out['autopp plan --help']:.3f} s ({out['autopp plan --help'] / out['jax']:.2f}x), `import jax` "
          f"{out['jax']:.3f} s")

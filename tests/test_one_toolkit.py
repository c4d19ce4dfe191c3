"""One jaxpr toolkit serves the profiler and the runtime: the profiler times the runtime's own stage programs
(:class:`autopp.core.StagePrograms` of a one-layer stage, sliced by :func:`autopp.core.stage_graphs`), both built on
the one per-stage VJP (:func:`autopp.core.forward_with_vjp`), and no module outside core builds jaxprs or takes a
VJP of its own."""

from __future__ import annotations

import ast
import collections
import pathlib
import sys

import jax
import pytest

import autopp
import autopp.core
import autopp.runtime  # noqa: F401 - loads the runtime modules whose imported names are patched
from autopp.profiler import profile
from autopp.profiler._measure import ProfileCache
from tests._helpers import model_case, run_steps, tiny_mlp

ROOT = pathlib.Path(__file__).resolve().parents[1]
SOURCE_DIRS = ("autopp", "core", "profiler", "planner", "runtime")
TOOLKIT = ("stage_graphs", "forward_with_vjp")


@pytest.fixture
def calls(monkeypatch):
    """Counting wrappers around the toolkit's functions, under every name an autopp module imported them by, and
    around ``StagePrograms.__init__``. Yields the counter (function name -> calls); ``clear()`` it between phases."""
    counter: collections.Counter = collections.Counter()

    def counting(name, fn):
        def wrapper(*args, **kwargs):
            counter[name] += 1
            return fn(*args, **kwargs)

        return wrapper

    patched = set()
    for name in TOOLKIT:
        original = getattr(autopp.core, name)
        wrapper = counting(name, original)
        for module in list(sys.modules.values()):
            if getattr(module, "__name__", "").startswith("autopp") and getattr(module, name, None) is original:
                monkeypatch.setattr(module, name, wrapper)
                patched.add(f"{module.__name__}.{name}")
    init = autopp.core.StagePrograms.__init__
    monkeypatch.setattr(autopp.core.StagePrograms, "__init__", counting("StagePrograms", init))
    # the runtime's and the profiler's callers are among the patched names (else the test would prove nothing)
    assert "autopp.core._stage.forward_with_vjp" in patched, patched
    for package in ("autopp.runtime.", "autopp.profiler."):
        assert any(p.startswith(package) and p.endswith(".stage_graphs") for p in patched), patched
    return counter


def test_profiler_and_runtime_share_the_slicer_and_the_vjp(calls, tmp_path):
    step, state, batch = model_case(tiny_mlp, 8)

    # (a) a measured profile: each distinct layer timed as the runtime's programs of a one-layer stage
    prof = profile(step, *state, batch, measure=True, cache=ProfileCache(str(tmp_path / "profiles.json")))
    assert all(l.measured and l.forward_time_s > 0 and l.backward_time_s > 0 for l in prof.layers)
    distinct = len({l.fingerprint for l in prof.layers})
    profiled = dict(calls)
    assert profiled.get("StagePrograms", 0) == distinct  # one stage per distinct layer, measured
    calls.clear()

    # (b) a two-stage pipelined run
    pipelined = autopp.parallelize(step, num_stages=2, num_microbatches=2, schedule="1f1b",
                                   devices=jax.devices()[:2])
    run_steps(pipelined, state, batch, n=1)
    ran = dict(calls)
    assert ran.get("StagePrograms", 0) == 2  # one per stage

    # the per-stage slicer and the per-stage VJP, the same functions on both paths
    for name in ("stage_graphs", "forward_with_vjp"):
        assert profiled.get(name, 0) > 0, f"the profiler does not call core.{name}: {profiled}"
        assert ran.get(name, 0) > 0, f"the runtime does not call core.{name}: {ran}"


def _sources():
    for folder in SOURCE_DIRS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            yield path.relative_to(ROOT).as_posix(), ast.parse(path.read_text(), str(path))


def _called_names(tree):
    """(line, name, owner) of every call: ``f(...)`` (owner None) or ``mod.f(...)`` (owner ``mod``)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Name):
                yield node.lineno, f.id, None
            elif isinstance(f, ast.Attribute):
                yield node.lineno, f.attr, f.value.id if isinstance(f.value, ast.Name) else None


def _vjp_calls(tree):
    """Lines calling JAX's VJP: ``jax.vjp(...)``, or ``vjp(...)`` / ``linear_transpose(...)`` imported from jax."""
    from_jax = {a.asname or a.name for node in ast.walk(tree)
                if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "jax"
                for a in node.names if a.name in ("vjp", "linear_transpose")}
    for line, name, owner in _called_names(tree):
        if (owner == "jax" and name in ("vjp", "linear_transpose")) or (owner is None and name in from_jax):
            yield line, name


def test_only_core_builds_jaxprs_and_takes_vjps():
    sources = list(_sources())
    assert len(sources) > 40
    builders = {"Jaxpr", "DebugInfo", "new_jaxpr"}
    bad_build = [f"{path}:{line} {name}" for path, tree in sources if not path.startswith("core/")
                 for line, name, _ in _called_names(tree) if name in builders]
    bad_vjp = [f"{path}:{line} {name}" for path, tree in sources if path != "core/_jaxpr.py"
               for line, name in _vjp_calls(tree)]
    assert not bad_vjp, "VJPs taken outside core._jaxpr (use core.forward_with_vjp):\n" + "\n".join(bad_vjp)
    assert not bad_build, "jaxprs built outside core (slice with core.stage_graphs / core.slice_jaxpr):\n" + \
        "\n".join(bad_build)


def test_the_scans_catch_a_violation():
    tree = ast.parse("import jax\nfrom jax import vjp as v\nfrom autopp.core import new_jaxpr\n"
                     "def f(g, x):\n    jax.vjp(g, x)\n    v(g, x)\n    vjp = 1\n    new_jaxpr([], [], [], [], set())\n")
    assert list(_vjp_calls(tree)) == [(5, "vjp"), (6, "v")]
    assert [(line, name) for line, name, _ in _called_names(tree) if name == "new_jaxpr"] == [(8, "new_jaxpr")]

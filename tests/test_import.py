"""The front door: ``import autopp`` imports nothing heavy (everything resolves on first use, PEP 562), every public
name resolves after a bare ``import autopp``, and ``autopp --help`` answers without importing JAX.

Each check runs in a fresh interpreter (this process has imported everything already). No timings here: those are
in ``benchmarks/bench_import.py``.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
HEAVY = ("orbax", "matplotlib", "rich", "ortools", "networkx", "optax")
"""Libraries that must load only when the feature that needs them is used."""
PUBLIC = ("Cluster", "Parallelized", "Plan", "StagePlan", "baselines", "checkpoint", "distributed", "gather", "grad",
          "metrics", "models", "parallelize", "value_and_grad")


def _run(code: str) -> dict:
    """Run ``code`` in a fresh interpreter; it prints one JSON object as its last line."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), AUTOPP_PROGRESS="0")
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-4000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def _loaded(names) -> str:
    """Code for a list of the top-level packages among ``names`` that are in ``sys.modules``."""
    return f"sorted({{m.split('.')[0] for m in sys.modules}} & set({list(names)!r}))"


def test_import_autopp_imports_nothing_heavy():
    out = _run(f"import sys, json\nimport autopp\nprint(json.dumps({_loaded(HEAVY)}))")
    assert out == [], f"`import autopp` imports {out}: import them where they are used"


def test_public_names_resolve_after_a_bare_import():
    out = _run("""
import sys, json
import autopp
init = autopp.distributed.initialize                 # attribute access, no `import autopp.distributed`
save = autopp.checkpoint.save
from autopp import _distributed, _checkpoint
light = """ + _loaded(("orbax", "matplotlib", "rich", "ortools", "networkx", "optax")) + """
import autopp.core, autopp._parallelize
print(json.dumps(dict(
    initialize=init is _distributed.initialize,
    save=save is _checkpoint.save,
    parallelize=autopp.parallelize is autopp._parallelize.parallelize,
    plan=autopp.Plan is autopp.core.Plan,
    value_and_grad=autopp.value_and_grad is autopp.core.value_and_grad,
    all=[n for n in autopp.__all__ if getattr(autopp, n, None) is None],
    light=light)))
""")
    assert out == dict(initialize=True, save=True, parallelize=True, plan=True, value_and_grad=True, all=[],
                       light=[]), out


def test_using_the_api_does_not_load_the_display_and_storage_libraries():
    """rich (the progress display, only on a terminal), matplotlib (Gantt charts) and orbax (checkpoints) load only
    when those features are used, even after every public name is resolved."""
    out = _run("import sys, json\nimport autopp\n[getattr(autopp, n) for n in autopp.__all__]\n"
               f"print(json.dumps({_loaded(('orbax', 'matplotlib', 'rich'))}))")
    assert out == []


def test_dir_lists_the_public_names():
    import autopp

    assert sorted(autopp.__all__) == sorted(PUBLIC)
    listed = dir(autopp)
    assert set(PUBLIC) <= set(listed), set(PUBLIC) - set(listed)
    assert {"core", "profiler", "planner", "runtime", "__version__"} <= set(listed)
    assert all(hasattr(autopp, n) for n in listed)


def test_unknown_names_are_attribute_errors():
    import autopp

    with pytest.raises(AttributeError, match="no attribute 'paralellize'"):
        autopp.paralellize  # noqa: B018
    assert not hasattr(autopp, "_no_such_thing")


def test_from_import_resolves_lazily():
    from autopp import Plan, distributed, parallelize
    from autopp.core import Plan as CorePlan

    assert Plan is CorePlan and callable(parallelize) and callable(distributed.initialize)


@pytest.mark.parametrize("argv", [["--help"], ["plan", "--help"], ["show", "--help"]])
def test_cli_help_does_not_import_jax(argv):
    out = _run(f"""
import sys, json, contextlib, io
from autopp._cli import main
buf = io.StringIO()
with contextlib.redirect_stdout(buf):
    try:
        main({argv!r})
    except SystemExit as e:
        code = e.code
print(json.dumps(dict(code=code, text=buf.getvalue(), loaded={_loaded(("jax", *HEAVY))})))
""")
    assert out["code"] == 0 and out["text"].startswith("usage: autopp")
    assert out["loaded"] == [], f"`autopp {' '.join(argv)}` imports {out['loaded']}"
    if argv == ["--help"]:
        for command in ("demo", "profile", "simulate", "plan", "show", "compare", "launch"):
            assert command in out["text"]

"""The architecture, read from the source with ``ast``: data flows one way (core <- profiler <- planner, core <-
runtime, everything <- the public face), packages meet only through each other's public names, JAX internals stay in
one module, and no module outgrows one role (700 lines)."""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SOURCE_DIRS = {"autopp": "autopp", "core": "autopp.core", "profiler": "autopp.profiler",
               "planner": "autopp.planner", "runtime": "autopp.runtime"}
MAX_LINES = 700

# What each package may import (besides itself, JAX and third-party libraries).
ALLOWED = {
    "autopp.core": set(),
    "autopp.profiler": {"autopp.core"},
    "autopp.planner": {"autopp.core", "autopp.profiler"},
    "autopp.runtime": {"autopp.core", "autopp.profiler"},
    "autopp": {"autopp.core", "autopp.profiler", "autopp.planner", "autopp.runtime"},
}


def _modules():
    for folder, package in SOURCE_DIRS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            yield path, package


def _package_of(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "autopp":
        return None
    if len(parts) > 1 and parts[1] in ("core", "profiler", "planner", "runtime"):
        return f"autopp.{parts[1]}"
    return "autopp"


def _imports(path: pathlib.Path):
    """(line, module, names) of every absolute import in the file, nested ones included."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield node.lineno, a.name, ()
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.lineno, node.module, tuple(a.name for a in node.names)


MODULES = list(_modules())


def test_the_tree_is_read():
    names = {p.relative_to(ROOT).as_posix() for p, _ in MODULES}
    assert {"core/_trace.py", "core/_schedule.py", "profiler/_profile.py", "planner/_search.py",
            "runtime/_executor.py", "autopp/_parallelize.py"} <= names
    assert len(MODULES) > 40


@pytest.mark.parametrize("path", [p for p, _ in MODULES], ids=lambda p: p.relative_to(ROOT).as_posix())
def test_module_size(path):
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES, f"{path.relative_to(ROOT)} has {lines} lines (at most {MAX_LINES}): split it by role"


def _flow_violations(modules, root=ROOT) -> list[str]:
    bad = []
    for path, package in modules:
        for line, module, _ in _imports(path):
            target = _package_of(module)
            if target is not None and target != package and target not in ALLOWED[package]:
                bad.append(f"{path.relative_to(root)}:{line} ({package}) imports {module}")
    return bad


def _private_violations(modules, root=ROOT) -> list[str]:
    bad = []
    for path, package in modules:
        for line, module, names in _imports(path):
            target = _package_of(module)
            if target is None or target == package:
                continue
            private_names = [n for n in names if n.startswith("_")]
            if any(part.startswith("_") for part in module.split(".")) or private_names:
                bad.append(f"{path.relative_to(root)}:{line} imports {module} {private_names or ''}".rstrip())
    return bad


def test_imports_follow_the_data_flow():
    bad = _flow_violations(MODULES)
    assert not bad, "imports against the data flow:\n" + "\n".join(bad)


def test_packages_meet_through_public_names():
    bad = _private_violations(MODULES)
    assert not bad, "imports of another package's private names:\n" + "\n".join(bad)


def test_jax_internals_stay_in_the_compat_module():
    bad = [f"{path.relative_to(ROOT)}:{line} imports {module}"
           for path, _ in MODULES for line, module, _ in _imports(path)
           if module.startswith("jax._src") and path.relative_to(ROOT).as_posix() != "core/_compat.py"]
    assert not bad, "\n".join(bad)


def test_the_runtime_does_not_search_or_simulate():
    """The runtime runs a plan; it does not make one (the plan types live in core)."""
    bad = [f"{path.relative_to(ROOT)}:{line} imports {module}"
           for path, package in MODULES if package == "autopp.runtime"
           for line, module, _ in _imports(path) if module.startswith("autopp.planner")]
    assert not bad, "\n".join(bad)


def test_a_violation_is_caught(tmp_path):
    """The checks can fail: a profiler module importing the face, and the planner's private module."""
    bad = tmp_path / "_bad.py"
    bad.write_text("import jax\nfrom autopp.core import Plan\n\n\ndef f():\n"
                   "    from autopp._parallelize import parallelize\n"
                   "    from autopp.planner._search import plan_model\n")
    modules = [(bad, "autopp.profiler")]
    assert _flow_violations(modules, tmp_path) == [
        "_bad.py:6 (autopp.profiler) imports autopp._parallelize",
        "_bad.py:7 (autopp.profiler) imports autopp.planner._search"]
    assert _private_violations(modules, tmp_path) == ["_bad.py:6 imports autopp._parallelize",
                                                      "_bad.py:7 imports autopp.planner._search"]

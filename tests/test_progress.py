"""The progress display of a step's first call: phase lines on a terminal, silence otherwise."""

import io

import jax
import jax.numpy as jnp
import pytest
from rich.console import Console

import autopp
from autopp import _progress


@pytest.fixture(autouse=True)
def _no_progress_env(monkeypatch):
    for name in (_progress.ENV, "FORCE_COLOR", "TTY_COMPATIBLE"):
        monkeypatch.delenv(name, raising=False)


def _tiny_case():
    def loss(params, batch):
        h = jnp.tanh(batch["x"] @ params["w1"])
        return jnp.mean((h @ params["w2"] - batch["y"]) ** 2)

    def step(params, batch):
        l, g = autopp.value_and_grad(loss)(params, batch)
        return jax.tree.map(lambda p, d: p - 0.1 * d, params, g), l

    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    params = {"w1": jax.random.normal(k1, (8, 8)), "w2": jax.random.normal(k2, (8, 1))}
    batch = {"x": jax.random.normal(k3, (4, 8)), "y": jnp.ones((4, 1))}
    return step, params, batch


def test_first_call_shows_phases_on_a_terminal_and_nothing_otherwise(capsys, monkeypatch):
    step, params, batch = _tiny_case()
    quiet = autopp.parallelize(step, num_stages=1, num_microbatches=2, devices=jax.devices()[:1])
    quiet(params, batch)  # stderr is pytest's capture, not a terminal
    assert capsys.readouterr().err == ""

    from autopp.runtime._executable import Executable

    pending, real = [], Executable.compiling
    monkeypatch.setattr(Executable, "compiling", lambda self: pending.append(real(self)) or pending[-1])
    out = io.StringIO()
    with _progress.use_console(Console(file=out, force_terminal=True, width=120)):
        shown = autopp.parallelize(step, num_stages=2, num_microbatches=2, devices=jax.devices()[:2])
        shown(params, batch)
        text = out.getvalue()
        assert "traced the step" in text and "compiling the 2-stage pipeline" in text
        assert "built" in text and "program(s) for 2 stage(s)" in text
        # the first step's wait for compilation has a line of its own when there is one (a user trial saw none)
        assert ("first step issued" in text) == (pending[0] > 0), (pending, text)
        shown(params, batch)  # built already: nothing more to show
        assert out.getvalue() == text
        monkeypatch.setenv(_progress.ENV, "0")
        with _progress.phase("opted out"):
            pass
        assert "opted out" not in out.getvalue()
    assert capsys.readouterr().err == ""


def test_phases_nest_report_failures_and_can_be_forced_on(capsys, monkeypatch):
    out = io.StringIO()
    with _progress.use_console(Console(file=out, force_terminal=True, width=120)):
        with _progress.phase("profiling") as outer:
            with _progress.phase("planning") as inner:
                inner.update("planning for 8 devices")
                inner.done("planned 4 stages")
            outer.done("profiled 12 layers")
        with pytest.raises(RuntimeError), _progress.phase("compiling"):
            raise RuntimeError("boom")
    text = out.getvalue()
    assert text.index("planned 4 stages") < text.index("profiled 12 layers") < text.index("compiling failed")
    assert _progress._progress is None  # the live display is closed, even after a failure

    with _progress.phase("quiet phase"):
        pass
    assert capsys.readouterr().err == ""
    monkeypatch.setenv(_progress.ENV, "1")  # forced on: plain lines on a non-terminal stderr
    with _progress.phase("forced phase"):
        pass
    err = capsys.readouterr().err
    assert "✓ forced phase" in err and "\x1b" not in err


def test_silent_phases_do_not_import_rich():
    """Off a terminal nothing is shown, and rich is not even imported (a fresh interpreter: this one has it)."""
    import os
    import pathlib
    import subprocess
    import sys

    code = ("import sys\nfrom autopp._progress import phase\n"
            "with phase('tracing') as p:\n    p.update('still tracing')\n    p.done('traced')\n"
            "print('rich' in sys.modules)")
    env = {k: v for k, v in os.environ.items() if k not in (_progress.ENV, "FORCE_COLOR", "TTY_COMPATIBLE")}
    env["PYTHONPATH"] = str(pathlib.Path(__file__).resolve().parents[1])
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "False" and res.stderr == ""

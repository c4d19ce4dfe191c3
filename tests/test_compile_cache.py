"""The persistent compilation cache: a second process on the same plan loads every stage program instead of
compiling it, including the equal middle stages loaded onto other devices, and computes the same step."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

import autopp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_PROCESS = textwrap.dedent("""
    import json, os, sys, time
    import jax
    jax.config.update("jax_num_cpu_devices", 8)
    import numpy as np
    sys.path.insert(0, os.path.join(sys.argv[2], "tests"))
    from _helpers import gpt_case
    import autopp
    events = {}
    jax.monitoring.register_event_listener(lambda e, **_: events.__setitem__(e, events.get(e, 0) + 1))
    step, state, batch = gpt_case(8)
    pipelined = autopp.parallelize(step, num_stages=4, num_microbatches=4, devices=jax.devices()[:4],
                                   compilation_cache=sys.argv[1])
    losses = []
    for _ in range(2):
        *state, loss = pipelined(*state, batch)
        losses.append(float(loss))
    exe = pipelined.executable_for(*state, batch)
    print(json.dumps(dict(losses=losses, hits=events.get("/jax/compilation_cache/cache_hits", 0),
                          misses=events.get("/jax/compilation_cache/cache_misses", 0),
                          programs=exe.num_programs, compiled=exe.num_compiled,
                          params=[np.asarray(x).tolist() for x in jax.tree.leaves(state[0])[:3]])))
""")


def _process(cache_dir):
    env = {k: v for k, v in os.environ.items()  # the tests' own cache (tests/conftest.py) stays out of this one
           if k not in ("AUTOPP_COMPILATION_CACHE", "JAX_COMPILATION_CACHE_DIR",
                        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS")}
    out = subprocess.run([sys.executable, "-c", _PROCESS, str(cache_dir), ROOT], capture_output=True, text=True,
                         env=env, cwd=ROOT, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_second_process_loads_every_program_from_the_cache(tmp_path):
    first = _process(tmp_path)
    assert first["hits"] == 0 and first["misses"] >= first["compiled"]
    assert first["compiled"] < first["programs"]  # equal middle stages compile once, then load onto their devices
    stored = os.listdir(tmp_path / "autopp-serialized")
    assert len(stored) >= 1
    second = _process(tmp_path)
    assert second["misses"] == 0 and second["hits"] >= second["compiled"]
    # The programs loaded from the cache (those moved onto other devices too) compute what the first process did.
    assert second["losses"] == first["losses"] and second["params"] == first["params"]


def test_compilation_cache_argument_is_checked():
    with pytest.raises(TypeError, match="compilation_cache must be a directory"):
        autopp.parallelize(lambda *a: a, num_stages=1, compilation_cache=3)
    with pytest.raises(ValueError, match="names no directory"):
        autopp.parallelize(lambda *a: a, num_stages=1, compilation_cache="")

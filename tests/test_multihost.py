"""Multi-process runs (JAX's multi-controller runtime on local CPU processes, 127.0.0.1, free ports only): the
same plans give what plain jax.jit gives; a lost process stops the others with an error naming it."""

from __future__ import annotations

import contextlib
import functools
import io
import os
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

import autopp
from autopp._launch import free_port, launch, process_env
from _helpers import gpt_case, run_steps

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "_multihost_worker.py")
sys.path.insert(0, HERE)
import _multihost_worker as worker_plans  # noqa: E402  (only its plan table: importing it initializes nothing)


@functools.lru_cache(maxsize=None)
def _reference() -> tuple[list[float], dict[str, np.ndarray]]:
    """Losses and parameters after :data:`STEPS` steps of plain ``jax.jit`` in this process: what every plan's
    multi-process run must give, as the single-process pipelines do (tests/test_parallelize.py,
    tests/test_schedules_run.py)."""
    step_fn, state, batch = gpt_case()
    state, losses = run_steps(jax.jit(step_fn), state, batch, n=worker_plans.STEPS)
    losses = [float(x) for x in losses]
    params = {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(state[0])[0]}
    params.update({"opt" + jax.tree_util.keystr(p): np.asarray(x)
                   for p, x in jax.tree_util.tree_flatten_with_path(state[1])[0]})
    return losses, params


def _run(num_processes: int, devices_per_process: int, plans: list[str], tmp_path) -> str:
    out = io.StringIO()
    code = launch([sys.executable, WORKER, str(tmp_path), *plans], num_processes, devices_per_process, out=out)
    assert code == 0, _tails(out.getvalue(), num_processes)
    return out.getvalue()


def _tails(text: str, num_processes: int, chars: int = 2500) -> str:
    """The end of each process's own lines (``[k] ...``): a failure shows every process's last words, not only those
    of the processes that wrote last (a run once failed with process 0's output cut off)."""
    lines = text.splitlines()
    parts = []
    for k in range(num_processes):
        mine = "\n".join(line for line in lines if line.startswith(f"[{k}]"))
        parts.append(f"--- process {k} ---\n{mine[-chars:]}")
    rest = "\n".join(line for line in lines if not line.startswith("["))
    return "\n".join(parts) + (f"\n--- launcher ---\n{rest[-chars:]}" if rest else "")


def _check(name: str, num_processes: int, tmp_path) -> None:
    losses, params = _reference()
    seen = set()
    for p in range(num_processes):
        got = np.load(tmp_path / f"{name}.{p}.npz")
        np.testing.assert_allclose(got["__losses__"], losses, rtol=1e-5, err_msg=f"{name}: loss on process {p}")
        for key in got.files:
            if key != "__losses__":
                np.testing.assert_allclose(got[key], params[key], rtol=1e-5, atol=1e-7,
                                           err_msg=f"{name}: {key} on process {p}")
                seen.add(key)
    weights = {k for k in params if not k.startswith("opt")}
    assert seen == weights, f"{name}: parameters held by no process: {sorted(weights - seen)}"
    if name == "even":  # autopp.distributed.gather of the whole state: every parameter and optimizer state leaf
        # (Adam's step count is replicated over both processes) on every process
        for p in range(num_processes):
            got = np.load(tmp_path / f"{name}.{p}.gathered.npz")
            assert set(got.files) == set(params)
            for key in got.files:
                np.testing.assert_allclose(got[key], params[key], rtol=1e-5, atol=1e-7,
                                           err_msg=f"{name}: gathered {key} on process {p}")


@pytest.fixture(scope="module", autouse=True)
def _not_inside_multiprocess():
    if jax.process_count() != 1:
        pytest.skip("these tests start their own processes")


def test_two_processes_of_four_devices(tmp_path):
    """2 x 4: 4 stages of 2 devices with 1F1B, a plan with three stages on process 0 (2, 1, 1 devices) and one
    of 4 devices on process 1 (transfers between stages of different sizes and layouts), and a planned one."""
    out = _run(2, 4, ["even", "uneven", "auto", "extras", "interleaved"], tmp_path)
    assert out.count("watchdog threads alive once stopped: []") == 2, out[-3000:]
    # SGD with the state donated and a typed PRNG key in it (a crash on the second step, and in the first, before);
    # interleaved 1F1B with 4 virtual stages, every chunk boundary across processes (a hang before)
    for name, case in (("extras", worker_plans.extras_case), ("interleaved", worker_plans.interleaved_case)):
        step_fn, state, batch = case()
        final, want = run_steps(jax.jit(step_fn), state, batch, n=worker_plans.STEPS + 1)
        for p in range(2):
            np.testing.assert_allclose(np.load(tmp_path / f"{name}.{p}.npy"), [float(x) for x in want], rtol=1e-5)
            if name == "extras":
                np.testing.assert_array_equal(np.load(tmp_path / f"extras.{p}.key.npy"),
                                              jax.random.key_data(final[2]))
    _check("even", 2, tmp_path)
    # autopp.checkpoint across processes: the gathered state saved by process 0, restored on both, runs the step
    # after as plain jit does (it used to refuse both, while its message advised exactly this)
    step_fn, state, batch = gpt_case()
    _, want = run_steps(jax.jit(step_fn), state, batch, n=worker_plans.STEPS + 1)
    for p in range(2):
        np.testing.assert_allclose(np.load(tmp_path / f"even.{p}.resumed.npy"), float(want[-1]), rtol=1e-5)
    assert sorted(os.listdir(tmp_path / "ckpt")) == [str(worker_plans.STEPS)]
    assert out.count("ungathered state refused: autopp.checkpoint.save: ") == 2, out[-3000:]
    assert "held partly by other processes" in out and "autopp.distributed.gather(state)" in out
    _check("uneven", 2, tmp_path)
    _check("auto", 2, tmp_path)  # no counts: planned (it used to pick one stage over both processes, then refuse it)
    # memory_report: each process reports its own devices, as the same plan in one process does for them (it used
    # to report the other process's devices too, without the programs and buffers it does not hold)
    step_fn, state, batch = gpt_case()
    single = autopp.parallelize(step_fn, **worker_plans.plan_kwargs("even", jax.devices()[:8]))
    want = single.memory_report(*state, batch)
    got = np.concatenate([np.load(tmp_path / f"even.{p}.memory.npy") for p in range(2)])
    np.testing.assert_allclose(got, [want[d.id] for d in jax.devices()[:8]], rtol=0.02)
    # Transfers between processes overlap compute: in the traced steps of the even plan, receives from the other
    # process complete while the receiving stage computes another microbatch's forward or backward.
    overlaps = [np.load(tmp_path / f"even.{p}.overlaps.npy") for p in range(2)]
    assert sum(int(o.sum()) for o in overlaps) > 0, overlaps


def test_four_processes_of_two_devices(tmp_path):
    """4 x 2: one stage per process, 1F1B. Beyond the 2-process test: transfers that processes neither sending nor
    receiving must issue too, and the loss sent to three processes."""
    _run(4, 2, ["even"], tmp_path)
    _check("even", 4, tmp_path)


@pytest.mark.slow
def test_four_processes_of_uneven_stages(tmp_path):
    """4 x 2 with stages of 2, 1, 2, 1 devices (stages of different sizes across processes; the 2-process test's
    uneven plan covers the same transfers between layouts)."""
    _run(4, 2, ["uneven4"], tmp_path)
    _check("uneven4", 4, tmp_path)


def test_cpu_collectives_are_checked(monkeypatch):
    with pytest.raises(ValueError, match="cpu_collectives='nccl'"):
        autopp.distributed.initialize("127.0.0.1:1", 2, 0, cpu_collectives="nccl")
    monkeypatch.setenv("AUTOPP_CPU_COLLECTIVES", "nccl")
    with pytest.raises(ValueError, match="AUTOPP_CPU_COLLECTIVES='nccl'"):
        autopp.distributed.initialize("127.0.0.1:1", 2, 0)
    assert not autopp.distributed.is_initialized()


@contextlib.contextmanager
def _two_workers(tmp_path, plan: str):
    """Two worker processes of one device each, started by hand (as on a cluster), with a 5 s failure bound; those
    still running at the end are killed."""
    coordinator = f"127.0.0.1:{free_port()}"
    procs = []
    try:
        for i in range(2):
            env = process_env(i, 2, coordinator, 1)
            env["AUTOPP_FAILURE_TIMEOUT"] = "5"
            procs.append(subprocess.Popen([sys.executable, WORKER, str(tmp_path), plan], env=env,
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        yield procs
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


def test_lost_process_stops_the_others(tmp_path):
    """Process 1 dies after a step; process 0, blocked in the next step's transfers, exits non-zero within the
    bound with an error naming process 1."""
    with _two_workers(tmp_path, "die") as procs:
        died = procs[1].wait(timeout=240)
        t_dead = time.monotonic()
        assert died == -9, procs[1].stdout.read()[-3000:]
        code = procs[0].wait(timeout=60)
        elapsed = time.monotonic() - t_dead
        text = procs[0].stdout.read()
    assert code == autopp.distributed.LOST_PROCESS_EXIT_CODE, text[-3000:]
    assert "process 1 of 2 is lost" in text, text[-3000:]
    assert elapsed <= 60, elapsed


def test_different_inputs_on_two_processes_are_refused(tmp_path):
    """Each process must pass the same host values; another batch on process 1 is refused on the first step, naming
    the leaves that differ (it used to train on a mixture of the two batches, with no error)."""
    out = io.StringIO()
    code = launch([sys.executable, WORKER, str(tmp_path), "batchdiff"], 2, 1, out=out)
    text = out.getvalue()
    assert code != 0, text[-3000:]
    assert "the step's inputs on process" in text and "args[2]['tokens']" in text, text[-3000:]


def test_a_process_that_ends_steps_early_stops_the_others(tmp_path):
    """Process 1 runs one step fewer and ends normally; process 0, in a step that needs it, stops within the bound
    naming it and the steps each ran (it used to wait for ever: a finished peer is not a lost one)."""
    with _two_workers(tmp_path, "fewer") as procs:
        code = procs[0].wait(timeout=240)
        text = procs[0].stdout.read()
    assert code == autopp.distributed.LOST_PROCESS_EXIT_CODE, text[-3000:]
    assert (f"process 1 of 2 ended after {worker_plans.STEPS - 1} step(s), but process 0 is in step "
            f"{worker_plans.STEPS}") in text, text[-3000:]


@pytest.mark.parametrize("plan", ["fewergather", "gather0"])
def test_a_gather_its_peers_never_reach_stops_the_run(tmp_path, plan):
    """A gather its peers never reach waited for ever (trial MHOST): process 1 gathering after one step fewer than
    process 0 runs, or process 0 gathering alone (the "save from rank 0" habit), while process 1 ends. Process 0
    now stops within the bound, naming the mismatch."""
    with _two_workers(tmp_path, plan) as procs:
        code = procs[0].wait(timeout=240)
        text = procs[0].stdout.read()
    assert code == autopp.distributed.LOST_PROCESS_EXIT_CODE, text[-3000:]
    said = (f"process 1 called autopp.distributed.gather after {worker_plans.STEPS - 1} step(s), but process 0 is in "
            f"step {worker_plans.STEPS}" if plan == "fewergather" else
            "process 0 is in autopp.distributed.gather, but process 1 ended without calling it")
    assert said in text, text[-3000:]


@pytest.mark.parametrize("raiser", [0, 1])
def test_an_error_in_one_process_stops_the_run_at_once(tmp_path, raiser):
    """A process that raises prints its traceback and exits with status 1 without waiting for its peers (nor in
    JAX's shutdown barrier, which would wait for them); the peer, blocked in the next step's transfers, stops naming
    it. Process 0 is also the coordinator, whose key-value store ends with it."""
    out = io.StringIO()
    t0 = time.monotonic()
    code = launch([sys.executable, WORKER, str(tmp_path), f"raise{raiser}"], 2, 1, out=out)
    elapsed = time.monotonic() - t0
    text = out.getvalue()
    assert code == 1, text[-3000:]
    assert f"RuntimeError: process {raiser} raised on purpose" in text, text[-3000:]
    assert f"autopp launch: process {raiser} exited with status 1" in text, text[-3000:]
    assert f"process {raiser} of 2 stopped with an error" in text, text[-3000:]
    assert elapsed < 60, (elapsed, text[-3000:])


def test_sigterm_to_launch_stops_its_processes():
    """A scheduler's or `timeout`'s SIGTERM to `autopp launch` stops the processes it started (they run in their own
    sessions, so nothing else would)."""
    import signal

    child = "import os, time; print('pid', os.getpid(), flush=True); time.sleep(120)"
    launcher = subprocess.Popen(
        [sys.executable, "-c", "import sys; from autopp._launch import launch; "
                               f"sys.exit(launch([sys.executable, '-c', {child!r}], 2, grace_s=1.0))"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    pids = []
    try:
        while len(pids) < 2:
            line = launcher.stdout.readline()
            assert line, "launch ended before its processes started"
            if " pid " in line:
                pids.append(int(line.split()[-1]))
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(timeout=30) == 128 + signal.SIGTERM
        deadline = time.monotonic() + 10
        alive = list(pids)
        while alive and time.monotonic() < deadline:
            alive = [p for p in alive if _running(p)]
            time.sleep(0.1)
        assert not alive, f"still running after launch was terminated: {alive}"
    finally:
        launcher.kill()
        for p in pids:
            if _running(p):
                os.kill(p, 9)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie waiting to be reaped by nobody is not running
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False

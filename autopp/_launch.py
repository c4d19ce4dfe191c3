"""``autopp launch``: run one program as N local processes of a multi-process run (for development and tests).

Each process gets the environment :func:`autopp.distributed.initialize` reads (coordinator on 127.0.0.1 at a free
port, process count and id, CPU devices per process); their output is streamed with a ``[i]`` prefix, and when one
process fails the others are stopped.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import TextIO

LOST_PROCESS_EXIT_CODE = 17
"""Exit status of a process that stops because a peer was lost or failed (:mod:`autopp.distributed`'s watchdog)."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_env(process_id: int, num_processes: int, coordinator: str, devices_per_process: int | None = None,
                base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of process ``process_id`` of a local run."""
    env = dict(os.environ if base is None else base)
    env.update(AUTOPP_COORDINATOR=coordinator, AUTOPP_NUM_PROCESSES=str(num_processes),
               AUTOPP_PROCESS_ID=str(process_id), PYTHONUNBUFFERED="1")
    env.pop("AUTOPP_TRANSFER_ADDRESS", None)  # each process picks a free port of its own
    if devices_per_process is not None:
        env["AUTOPP_LOCAL_DEVICES"] = str(devices_per_process)
        env["JAX_NUM_CPU_DEVICES"] = str(devices_per_process)
        env.setdefault("JAX_PLATFORMS", "cpu")
    return env


def _stream(pipe, prefix: str, out: TextIO, lock: threading.Lock) -> None:
    for line in iter(pipe.readline, ""):
        with lock:
            out.write(prefix + line)
            out.flush()
    pipe.close()


def _stop(proc: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM, then SIGKILL after ``grace_s`` (JAX's preemption notifier catches SIGTERM and keeps running)."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


def launch(command: Sequence[str], num_processes: int, devices_per_process: int | None = None, *,
           port: int | None = None, grace_s: float = 3.0, out: TextIO | None = None) -> int:
    """Run ``command`` as ``num_processes`` local processes; returns 0 when all succeed, else the exit status of
    the first that failed (the others are then stopped)."""
    if not command:
        raise ValueError("autopp launch: no command given; e.g. `autopp launch -n 2 -- python train.py`.")
    if not isinstance(num_processes, int) or num_processes < 1:
        raise ValueError(f"autopp launch: -n {num_processes!r}; give a positive number of processes.")
    if devices_per_process is not None and (not isinstance(devices_per_process, int) or devices_per_process < 1):
        raise ValueError(f"autopp launch: --devices-per-process {devices_per_process!r}; give a positive integer.")
    if port is not None and not 0 < port < 65536:
        raise ValueError(f"autopp launch: --port {port}; give a TCP port between 1 and 65535 (or none: a free one).")
    if shutil.which(command[0]) is None:
        raise ValueError(f"autopp launch: cannot run {command[0]!r}: no such program (not a path to an executable "
                         "file, nor on PATH); e.g. `autopp launch -n 2 -- python train.py`.")
    out = out or sys.stdout
    coordinator = f"127.0.0.1:{port or free_port()}"
    lock = threading.Lock()
    procs: list[subprocess.Popen] = []
    readers = []
    previous_handler = None
    if threading.current_thread() is threading.main_thread():  # SIGTERM (a scheduler, `timeout`) stops them too
        def on_terminate(signum, _frame):
            raise SystemExit(128 + signum)

        previous_handler = signal.signal(signal.SIGTERM, on_terminate)
    try:
        for i in range(num_processes):
            p = subprocess.Popen(list(command), env=process_env(i, num_processes, coordinator, devices_per_process),
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                                 start_new_session=True)
            procs.append(p)
            t = threading.Thread(target=_stream, args=(p.stdout, f"[{i}] ", out, lock), daemon=True)
            t.start()
            readers.append(t)
        failed: tuple[int, int] | None = None
        while failed is None and any(p.poll() is None for p in procs):
            for i, p in enumerate(procs):
                code = p.poll()
                if code not in (None, 0):
                    failed = (i, code)
                    break
            else:
                time.sleep(0.1)
        if failed is None:
            failed = next(((i, p.returncode) for i, p in enumerate(procs) if p.returncode), None)
        if failed is not None and failed[1] == LOST_PROCESS_EXIT_CODE:
            # a process that stopped because a peer was lost or failed: name the peer that failed first, if one
            # exits with its own status within the grace time
            deadline = time.monotonic() + grace_s + 2.0
            while time.monotonic() < deadline:
                cause = next(((i, p.returncode) for i, p in enumerate(procs)
                              if p.poll() not in (None, 0, LOST_PROCESS_EXIT_CODE)), None)
                if cause is not None:
                    failed = cause
                    break
                if all(p.poll() is not None for p in procs):
                    break
                time.sleep(0.1)
        if failed is not None:
            i, code = failed
            with lock:
                out.write(f"autopp launch: process {i} exited with status {code}; stopping the others.\n")
                out.flush()
    finally:
        for p in procs:
            _stop(p, grace_s)
        for t in readers:
            t.join(timeout=5)
        if previous_handler is not None:
            signal.signal(signal.SIGTERM, previous_handler)
    return 0 if failed is None else (failed[1] if failed[1] > 0 else 128 - failed[1])


def add_parser(sub, positive) -> None:
    """Register ``autopp launch`` on the CLI's subcommands."""
    import argparse

    p = sub.add_parser("launch", help="run a program as N local processes of a multi-process (multi-host) run",
                       description="Start N local processes on 127.0.0.1 that call autopp.distributed.initialize(); "
                                   "stream their output prefixed [i]; stop all when one fails.")
    p.add_argument("-n", "--num-processes", type=positive, required=True, help="number of processes")
    p.add_argument("--devices-per-process", type=positive, default=None, help="CPU devices of each process")
    p.add_argument("--port", type=positive, default=None, help="coordinator port (default: a free one)")
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="the command after --, e.g. -- python train.py")
    p.set_defaults(func=_cmd_launch)


def _cmd_launch(args) -> int:
    cmd = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    return launch(cmd, args.num_processes, args.devices_per_process, port=args.port)

"""Multi-host runs on JAX's multi-controller runtime (``jax.distributed``).

Every process runs the same program. :func:`initialize` connects the process to the others, enables the
cross-process ``jax.device_put`` transfers the runtime uses between stages on different processes, and starts a
watchdog: a process that stops answering makes the others exit with an error naming it, instead of hanging.

autopp's steps need no collective that spans processes: a stage's devices belong to one process, and what crosses
processes goes by ``jax.device_put``. On CPU, JAX's cross-process collectives (gloo) would also carry every
collective *inside* a process (a data-parallel stage's gradient all-reduce, over TCP), so by default they are left
off and XLA's in-process collectives serve the stages. Pass ``cpu_collectives="gloo"`` when your own code runs
collectives across processes on CPU (``jax.experimental.multihost_utils``, a ``jit`` over every process's devices).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import socket
import sys
import threading
import time

import jax

from autopp._launch import LOST_PROCESS_EXIT_CODE
from autopp.core import distributed_client

_HEARTBEAT_PREFIX = "autopp/heartbeat/"
_DONE_PREFIX = "autopp/done/"
_FAILED_PREFIX = "autopp/failed/"
_GATHER_PREFIX = "autopp/gathering/"  # per process: "gathers:steps started:1 inside one, else 0" (_gathering)
DEFAULT_FAILURE_TIMEOUT_S = 20.0
"""A peer silent for this long is declared lost (override: ``failure_timeout_s`` or $AUTOPP_FAILURE_TIMEOUT)."""
CPU_COLLECTIVES = (None, "gloo", "mpi")
"""Values of ``initialize(cpu_collectives=)``."""

_state: dict = {}


def _env_int(names: tuple[str, ...]) -> int | None:
    for name in names:
        text = os.environ.get(name)
        if text not in (None, ""):
            try:
                return int(text)
            except ValueError:
                raise ValueError(f"autopp.distributed: ${name}={text!r} is not an integer; unset it or "
                                 "give a whole number.") from None
    return None


def _default_transfer_address(coordinator_address: str | None) -> str:
    """The address this process serves cross-process transfers on: loopback when the coordinator is local,
    else this host's address, at a port that is free now (port 0 is not resolved before peers learn it)."""
    host = (coordinator_address or "").rsplit(":", 1)[0].strip("[]")
    if host not in ("127.0.0.1", "localhost"):
        host = socket.gethostbyname(socket.gethostname())
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return f"{host}:{s.getsockname()[1]}"


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, *, local_device_count: int | None = None,
               transfer_address: str | None = None, failure_timeout_s: float | None = None,
               initialization_timeout_s: int = 120, cpu_collectives: str | None = None) -> None:
    """Join this process to a multi-process run; call it first thing, before any other JAX call.

    Arguments default to the environment: ``$AUTOPP_COORDINATOR`` / ``$JAX_COORDINATOR_ADDRESS``,
    ``$AUTOPP_NUM_PROCESSES`` / ``$JAX_NUM_PROCESSES``, ``$AUTOPP_PROCESS_ID`` / ``$JAX_PROCESS_ID``, and
    otherwise JAX's cluster detection (SLURM, Open MPI, ...). ``local_device_count`` (or
    ``$AUTOPP_LOCAL_DEVICES``) sets the number of CPU devices of this process. ``transfer_address`` (or
    ``$AUTOPP_TRANSFER_ADDRESS``) is the ``host:port`` this process receives stage-to-stage transfers on (default:
    loopback when the coordinator is, else this host's address, on a free port; port 0 does not work). A peer that sends no heartbeat
    for ``failure_timeout_s`` (or ``$AUTOPP_FAILURE_TIMEOUT``; default 20 s) is declared lost: this process
    prints which one and exits with status 17. ``cpu_collectives`` (or ``$AUTOPP_CPU_COLLECTIVES``): ``None``
    (default: no collective spans processes on CPU; autopp's steps need none, and its stages' own collectives then
    stay inside their process), ``"gloo"`` or ``"mpi"`` (JAX's ``jax_cpu_collectives_implementation``, for code of
    your own that runs collectives across processes on CPU; every collective then goes through it).
    """
    if _state.get("initialized"):
        raise RuntimeError("autopp.distributed.initialize was already called in this process.")
    coordinator_address = (coordinator_address or os.environ.get("AUTOPP_COORDINATOR")
                           or os.environ.get("JAX_COORDINATOR_ADDRESS") or None)
    if num_processes is None:
        num_processes = _env_int(("AUTOPP_NUM_PROCESSES", "JAX_NUM_PROCESSES"))
    if process_id is None:
        process_id = _env_int(("AUTOPP_PROCESS_ID", "JAX_PROCESS_ID"))
    if local_device_count is None:
        local_device_count = _env_int(("AUTOPP_LOCAL_DEVICES",))
    if failure_timeout_s is None:
        text = os.environ.get("AUTOPP_FAILURE_TIMEOUT")
        failure_timeout_s = float(text) if text else DEFAULT_FAILURE_TIMEOUT_S
    for name, value in (("num_processes", num_processes), ("local_device_count", local_device_count)):
        if value is not None and (not isinstance(value, int) or value < 1):
            raise ValueError(f"autopp.distributed.initialize: {name}={value!r}; give a positive integer.")
    if process_id is not None and num_processes is not None and not 0 <= process_id < num_processes:
        raise ValueError(f"autopp.distributed.initialize: process_id={process_id!r} is not in "
                         f"[0, {num_processes}); give a process id below num_processes.")
    if coordinator_address is not None and ":" not in coordinator_address:
        raise ValueError(f"autopp.distributed.initialize: coordinator_address={coordinator_address!r}; give "
                         "'host:port', e.g. '127.0.0.1:12345'.")
    source = "cpu_collectives"
    if cpu_collectives is None and os.environ.get("AUTOPP_CPU_COLLECTIVES"):
        cpu_collectives, source = os.environ["AUTOPP_CPU_COLLECTIVES"], "$AUTOPP_CPU_COLLECTIVES"
    if cpu_collectives not in CPU_COLLECTIVES:
        raise ValueError(f"autopp.distributed.initialize: {source}={cpu_collectives!r}; give one of "
                         f"{', '.join(map(repr, CPU_COLLECTIVES))} (None: no collective across processes on CPU).")
    if not failure_timeout_s > 0:
        raise ValueError(f"autopp.distributed.initialize: failure_timeout_s={failure_timeout_s!r}; give a "
                         "positive number of seconds.")

    if local_device_count is not None:
        jax.config.update("jax_num_cpu_devices", local_device_count)
    jax.config.update("jax_cpu_collectives_implementation", cpu_collectives)
    jax.config.update("jax_cross_host_transfer_socket_address",
                      transfer_address or os.environ.get("AUTOPP_TRANSFER_ADDRESS")
                      or _default_transfer_address(coordinator_address))
    # JAX's own heartbeat is the backstop (it aborts without naming the peer): ours fires first.
    jax.distributed.initialize(coordinator_address, num_processes, process_id,
                               initialization_timeout=initialization_timeout_s,
                               heartbeat_timeout_seconds=int(failure_timeout_s) + 15)
    _state["initialized"] = True
    if jax.process_count() > 1:
        _start_watchdog(float(failure_timeout_s))


def is_initialized() -> bool:
    """Whether :func:`initialize` ran in this process."""
    return bool(_state.get("initialized"))


def _client():
    return distributed_client()


def barrier(name: str, timeout_s: float = 600.0) -> None:
    """Wait until every process has reached the barrier ``name`` (each name used once per run)."""
    _client().wait_at_barrier(name, int(timeout_s * 1000))


def _lost(message: str) -> None:
    sys.stderr.write(f"autopp.distributed: {message}\n")
    sys.stderr.flush()
    os._exit(LOST_PROCESS_EXIT_CODE)  # the main thread may be blocked inside a transfer that never completes


def _start_watchdog(timeout_s: float) -> None:
    """Heartbeats through the coordinator's key-value store; a peer whose heartbeat stops changing for
    ``timeout_s`` (and that did not finish) is lost. When the coordinator itself is gone, the store stops
    answering: that is reported as losing process 0."""
    client = _client()
    me, n = jax.process_index(), jax.process_count()
    stop = threading.Event()
    interval = min(1.0, timeout_s / 5)
    last_ok = [time.monotonic()]
    seen: dict[int, tuple[str, float]] = {}  # peer -> (its last heartbeat, when it last changed)
    finished: set[int] = set()  # peers that ended normally

    def processes(prefix: str) -> set[int]:
        return {int(k.rsplit("/", 1)[1]) for k, _ in client.key_value_dir_get(prefix)}

    def steps_done() -> dict[int, int]:  # finished peer -> the steps it started
        return {int(k.rsplit("/", 1)[1]): int(v) if v.isdigit() else 0
                for k, v in client.key_value_dir_get(_DONE_PREFIX)}

    from autopp.runtime import steps_started
    short: dict[int, float] = {}  # finished peer that started fewer steps than this process -> when first seen
    stuck: dict[str, float] = {}  # what is wrong about a gather -> when first seen

    def beat() -> None:
        count = 0
        while not stop.is_set():
            count += 1
            try:
                client.key_value_set(f"{_HEARTBEAT_PREFIX}{me}", str(count), allow_overwrite=True)
                beats = dict(client.key_value_dir_get(_HEARTBEAT_PREFIX))
                done, failed = processes(_DONE_PREFIX), processes(_FAILED_PREFIX) - {me}
                gathering = dict(client.key_value_dir_get(_GATHER_PREFIX))
            except Exception:  # noqa: BLE001 - the coordinator is unreachable; the monitor reports it
                stop.wait(interval)
                continue
            now = time.monotonic()
            last_ok[0] = now
            finished.update(done)
            if done - {me}:
                mine = steps_started()
                for p, theirs in steps_done().items():
                    if p == me or theirs >= mine:
                        continue
                    short.setdefault(p, now)
                    if now - short[p] > timeout_s and not stop.is_set():  # this step needs it: it never ends
                        _lost(f"process {p} of {n} ended after {theirs} step(s), but process {me} is in step {mine}, "
                              "which needs it; every process must run the same steps (the same loop over the same "
                              f"inputs). Stopping process {me}.")
            wrong = _gather_mismatches(me, done - {me}, gathering, steps_started())
            for key in set(stuck) - set(wrong):  # (resolved: a peer that was slow to reach the gather)
                del stuck[key]
            for why in wrong:
                stuck.setdefault(why, now)
                if now - stuck[why] > timeout_s and not stop.is_set():  # (a gather never ends without its peers)
                    _lost(f"{why}. Stopping process {me}.")
            if failed and not stop.is_set():
                _lost(f"process {min(failed)} of {n} stopped with an error (its traceback is in its output); "
                      f"stopping process {me}.")
            for p in range(n):
                if p == me or p in done or stop.is_set():
                    continue
                value = beats.get(f"{_HEARTBEAT_PREFIX}{p}", "")
                if p not in seen or seen[p][0] != value:
                    seen[p] = (value, now)
                elif now - seen[p][1] > timeout_s:
                    _lost(f"process {p} of {n} is lost (no heartbeat for {timeout_s:g} s); stopping process {me}.")
            stop.wait(interval)

    def monitor() -> None:
        while not stop.wait(interval):
            if time.monotonic() - last_ok[0] > timeout_s and me != 0:
                _lost(f"process 0 of {n} (the coordinator) is lost (unreachable for {timeout_s:g} s); "
                      f"stopping process {me}.")

    def finish() -> None:  # registered after JAX's shutdown hook, so it runs before it
        if stop.is_set():
            return
        try:
            client.key_value_set(f"{_DONE_PREFIX}{me}", str(steps_started()), allow_overwrite=True)
        except Exception:  # noqa: BLE001
            pass
        # A peer's death can end this process's work early (a transfer from it fails or is cut short): wait,
        # within the bound, until every peer has finished too or the heartbeat thread has named the lost one.
        deadline = time.monotonic() + timeout_s + 3 * interval
        while time.monotonic() < deadline:
            try:
                done = processes(_DONE_PREFIX)
            except Exception:  # noqa: BLE001 - the coordinator is gone; the monitor thread reports it
                done = set()
            if done >= set(range(n)):
                break
            time.sleep(interval)
        stop.set()
        # the watchdog's threads must be out of the coordinator's client before JAX shuts it down: a call in
        # flight then aborts the process ("terminate called after throwing ...") after its work is done
        for thread in threads:
            if thread is not threading.current_thread():
                thread.join(timeout=timeout_s + 2 * interval)

    previous_hook = sys.excepthook

    def excepthook(exc_type, exc, tb) -> None:
        """An uncaught error: its traceback at once; then, unless a peer turns out lost (its loss may have caused
        the error: the heartbeat thread then names it and exits), tell the peers this process failed (they stop,
        naming it, instead of waiting for its transfers) and exit without JAX's shutdown barrier, which would wait
        for those peers."""
        previous_hook(exc_type, exc, tb)
        sys.stderr.flush()
        start = time.monotonic()
        time.sleep(1.5 * interval)  # heartbeats sent before the error are seen within one poll of the store
        before = {p: seen.get(p, ("", 0.0))[0] for p in range(n)}
        deadline = start + timeout_s + 3 * interval
        while time.monotonic() < deadline:  # until every running peer has beaten since (a lost one never does)
            if all(p in finished or seen.get(p, ("", 0.0))[0] != before[p] for p in range(n) if p != me):
                break
            time.sleep(interval / 4)
        stop.set()
        try:
            client.key_value_set(f"{_FAILED_PREFIX}{me}", "1", allow_overwrite=True)
            if me == 0:  # the store ends with the coordinator: let the peers read it first (elsewhere, leave at
                time.sleep(2 * interval)  # once, before the coordinator's exit makes JAX abort this process)
        except Exception:  # noqa: BLE001 - the coordinator is gone
            pass
        sys.stdout.flush()
        os._exit(1)

    threads = [threading.Thread(target=target, name=f"autopp-watchdog-{target.__name__}", daemon=True)
               for target in (beat, monitor)]
    for thread in threads:
        thread.start()
    atexit.register(finish)
    sys.excepthook = excepthook
    _state["stop_watchdog"] = finish
    _state["failure_timeout_s"] = timeout_s


def _gather_mismatches(me: int, done: set[int], gathering: dict[str, str], mine: int) -> list[str]:
    """What keeps a gather from ending, as this process sees it: ``done``, the peers that ended; ``gathering``, the
    store's entries of :func:`_gathering` (per process: its gathers, the steps it started, whether it is inside one);
    ``mine``: the steps this process started. A peer that gathers after fewer steps than this process runs (a data
    loader that ran out on one process), or one that ended while this process gathers (a gather called on process 0
    alone)."""
    inside = {p: steps for p, (_, steps, now) in _gather_entries(gathering).items() if now}
    wrong = []
    for p, theirs in sorted(inside.items()):
        if p != me and me not in inside and theirs < mine:
            wrong.append(f"process {p} called autopp.distributed.gather after {theirs} step(s), but process {me} is "
                         f"in step {mine}, which needs it; every process must run the same steps before gathering")
    if me in inside:
        for p in sorted(done - set(inside)):
            wrong.append(f"process {me} is in autopp.distributed.gather, but process {p} ended without calling it; "
                         "gather is a collective: every process calls it with the same values in the same order "
                         "(not only the one that saves)")
    return wrong


def _gather_entries(gathering: dict[str, str]) -> dict[int, tuple[int, int, bool]]:
    out = {}
    for k, v in gathering.items():
        parts = v.split(":")
        if len(parts) == 3 and all(x.isdigit() for x in parts):
            out[int(k.rsplit("/", 1)[1])] = (int(parts[0]), int(parts[1]), parts[2] == "1")
    return out


@contextlib.contextmanager
def _gathering():
    """Around :func:`gather`: tells the peers, through the store, that this process is in its gather number ``k``
    after how many steps, and waits until every peer has reached gather ``k`` (for twice ``failure_timeout_s``), so
    that a gather its peers do not make raises, naming them, instead of pairing its transfers with a step's."""
    client = _client() if _state.get("stop_watchdog") is not None and not _state.get("gathering") else None
    if client is None:
        yield
        return
    from autopp.runtime import steps_started

    me, n, steps = jax.process_index(), jax.process_count(), steps_started()
    count = _state["gathers"] = _state.get("gathers", 0) + 1
    key = f"{_GATHER_PREFIX}{me}"
    _state["gathering"] = True
    client.key_value_set(key, f"{count}:{steps}:1", allow_overwrite=True)
    try:
        wait_s = 2 * _state["failure_timeout_s"]  # (the watchdog names a mismatch it sees after one)
        deadline = time.monotonic() + wait_s
        while True:
            entries = _gather_entries(dict(client.key_value_dir_get(_GATHER_PREFIX)))
            behind = [p for p in range(n) if p != me and entries.get(p, (0, 0, False))[0] < count]
            if not behind:
                break
            if time.monotonic() > deadline:
                done = {int(k.rsplit("/", 1)[1]) for k, _ in client.key_value_dir_get(_DONE_PREFIX)}
                raise RuntimeError(
                    f"autopp.distributed.gather: process(es) {', '.join(map(str, behind))} of {n} did not call "
                    f"gather number {count} within {wait_s:g} s "
                    f"({'it ended' if set(behind) <= done else 'still running'}); process {me} called it after "
                    f"{steps} step(s). gather is a collective: every process calls it with the same values in the "
                    "same order, after the same steps (not only the one that saves).")
            time.sleep(0.02)
        late = {p: e[1] for p, e in entries.items() if p != me and e[0] == count and e[1] != steps}
        if late:
            raise RuntimeError(
                f"autopp.distributed.gather: process {me} called gather number {count} after {steps} step(s), but "
                + ", ".join(f"process {p} after {s}" for p, s in sorted(late.items()))
                + "; every process must run the same steps before gathering.")
        yield
    finally:
        _state["gathering"] = False
        try:
            client.key_value_set(key, f"{count}:{steps}:0", allow_overwrite=True)
        except Exception:  # noqa: BLE001 - the coordinator is gone; the watchdog reports it
            pass


def shutdown() -> None:
    """Leave the run: stop the watchdog (peers no longer expect heartbeats) and shut ``jax.distributed`` down."""
    if not _state.get("initialized"):
        return
    finish = _state.pop("stop_watchdog", None)
    if finish is not None:
        finish()
    jax.distributed.shutdown()
    _state.clear()


def gather(x):
    """``x`` (a step output, or a pytree of them: the parameters, the optimizer state) as NumPy arrays on every
    process (a typed PRNG key as its raw data, ``jax.random.key_data``).

    Scalar step outputs (the loss, metrics) already are on every process: ``float(loss)`` works everywhere.
    This fetches any other output (e.g. a parameter) from the process that holds it; every process must call
    it with the same output, in the same order, as for any collective. An output held by one process travels by
    cross-process ``jax.device_put`` (no collective); one whose every process holds a whole copy (a replicated
    counter, such as Adam's step count) is read locally; one split over several processes needs JAX's
    ``process_allgather`` (``initialize(cpu_collectives="gloo")`` on CPU). A process that gathers after fewer steps
    than its peers run, or while a peer has ended without gathering, is stopped by the watchdog within
    ``failure_timeout_s``, naming the mismatch (instead of waiting for ever).
    """
    with _gathering():
        return _gather(x)


def _gather(x):
    import numpy as np

    leaves, tree = jax.tree_util.tree_flatten(x)
    if tree.num_leaves != 1 or tree.num_nodes != 1:
        return jax.tree_util.tree_unflatten(tree, [_gather(leaf) for leaf in leaves])
    if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.extended):
        x = jax.random.key_data(x)  # a typed PRNG key: its raw data (NumPy has no key dtype)
    if not isinstance(x, jax.Array) or jax.process_count() == 1:
        return np.asarray(x)
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    holders = sorted({d.process_index for d in x.sharding.device_set})
    if len(holders) > 1:
        local = _local_copy(x)
        if local is not None:
            return local
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    owner, me = holders[0], jax.process_index()
    first = {}
    for d in jax.devices():
        first.setdefault(d.process_index, d)

    def on(process):  # the whole value on one device of ``process``
        return NamedSharding(Mesh(np.array([first[process]]), ("gather",)), PartitionSpec())

    if me == owner:
        here = jax.device_put(x, on(owner))  # gathered onto one device of its own process
    else:
        here = jax.make_array_from_single_device_arrays(x.shape, on(owner), [], dtype=x.dtype)
    mine = here
    for q in range(jax.process_count()):  # one send per receiver, issued by every process in the same order
        if q != owner:
            got = jax.device_put(here, on(q))
            if q == me:
                mine = got
    return np.asarray(mine)


def _local_copy(x):
    """``x`` as a NumPy array from this process's own shards, when they cover all of it (else None)."""
    import numpy as np

    out = np.empty(x.shape, x.dtype)
    covered = np.zeros(x.shape, bool)
    for shard in x.addressable_shards:
        out[shard.index] = np.asarray(shard.data)
        covered[shard.index] = True
    return out if covered.all() else None


_input_checks = [0]
_CHECKED_BYTES = 256 * 2**20
"""Bytes of step inputs on devices the first-step check reads at most (host values and the batch always)."""


def check_same_inputs(leaves, names, batch_mask) -> None:
    """Every process must pass the same host values: on a signature's first step, each process publishes a digest of
    its inputs (host values, the batch, and device arrays up to :data:`_CHECKED_BYTES` in all) and compares the
    others'. Raises ValueError naming the inputs that differ (a batch drawn from another seed on each process would
    otherwise train on a mixture, with no error)."""
    import hashlib

    import numpy as np

    me, n = jax.process_index(), jax.process_count()
    budget, digests = _CHECKED_BYTES, []
    for x, is_batch in zip(leaves, batch_mask):
        on_device = isinstance(x, jax.Array)
        if on_device and (not x.is_fully_addressable or (not is_batch and x.nbytes > budget)):
            digests.append("-")
            continue
        if on_device and not is_batch:
            budget -= x.nbytes
        if on_device and jax.dtypes.issubdtype(x.dtype, jax.dtypes.extended):
            x = jax.random.key_data(x)
        a = np.ascontiguousarray(np.asarray(x))
        digests.append(hashlib.blake2b(a.tobytes() + repr((a.shape, str(a.dtype))).encode(), digest_size=8).hexdigest())
    client, check = distributed_client(), _input_checks[0]
    _input_checks[0] += 1
    client.key_value_set(f"autopp/inputs/{check}/{me}", ",".join(digests))
    for p in range(n):
        if p == me:
            continue
        theirs = client.blocking_key_value_get(f"autopp/inputs/{check}/{p}", 600_000).split(",")
        differ = [names[i] for i, (a, b) in enumerate(zip(digests, theirs)) if a != b and "-" not in (a, b)]
        if differ:
            raise ValueError(
                f"autopp.parallelize: the step's inputs on process {me} differ from process {p}'s at "
                f"{', '.join(differ[:6])}{f' and {len(differ) - 6} more' if len(differ) > 6 else ''}. Every process "
                "passes the same host "
                "values (the whole batch and the same initial state; each process feeds its own stages): draw them "
                "from the same seed or read the same files on every process.")

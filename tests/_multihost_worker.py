"""One process of the multi-host tests (started by tests/test_multihost.py, via ``autopp launch`` or directly).

``python tests/_multihost_worker.py OUT_DIR PLAN [PLAN ...]``: runs each named plan of :data:`PLANS` on the tiny
GPT for :data:`STEPS` steps and writes ``OUT_DIR/<plan>.<process>.npz`` (losses as seen here, and the parameters
this process holds, by leaf path). Plan ``die`` runs one step of a 2-stage plan, then process 1 kills itself and
the others try another step (which can never finish); ``raise0`` / ``raise1``: process 0 / 1 raises instead;
``fewer``: process 1 runs one step fewer and ends normally; ``fewergather``: the same, then every process gathers the
parameters; ``gather0``: only process 0 gathers them; ``batchdiff``: process 1 passes another batch.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


import autopp.distributed  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402

import autopp  # noqa: E402
from _helpers import gpt_case  # noqa: E402

STEPS = 2


def stage_groups(devices, sizes):
    """``devices`` split into consecutive groups of ``sizes`` (one group per stage)."""
    groups, k = [], 0
    for n in sizes:
        groups.append(list(devices[k:k + n]))
        k += n
    return groups


def plan_kwargs(name: str, devices) -> dict:
    """The ``parallelize`` arguments of a named plan over ``devices`` (8 of them: the multi-process run's, or a
    single process's for the reference)."""
    if name == "even":  # 4 stages of 2 devices, 1F1B
        return dict(num_stages=4, num_microbatches=4, schedule="1f1b", devices=list(devices))
    if name == "uneven":  # stages of 2, 1, 1 and 4 devices (2 x 4 processes: three stages on process 0)
        return dict(num_microbatches=2, schedule="1f1b", devices=stage_groups(devices, (2, 1, 1, 4)))
    if name == "uneven4":  # stages of 2, 1, 2 and 1 devices (4 x 2 processes: one stage each, some devices idle)
        return dict(num_microbatches=2, schedule="1f1b",
                    devices=[list(devices[0:2]), [devices[2]], list(devices[4:6]), [devices[6]]])
    if name == "auto":  # planned: stages within processes, process 0's plan on every process
        return dict(devices=list(devices))
    if name in ("die", "raise0", "raise1", "fewer", "fewergather", "gather0", "batchdiff"):
        return dict(num_stages=2, num_microbatches=2, schedule="1f1b", devices=list(devices))
    raise ValueError(f"unknown plan {name!r}")


def extras_case():
    """SGD on the tiny GPT with the whole state donated (the tied embedding crosses processes each step while the
    update donates it) and a typed PRNG key in the state (it crosses as its raw data): step, state, batch."""
    import optax

    from autopp.models import GPT, GPTConfig

    model, tx = GPT(GPTConfig(layers=4, hidden=32, heads=4, seq=16, vocab=64)), optax.sgd(0.1)

    def step(params, opt_state, key, batch):
        key, sub = jax.random.split(key)
        noisy = {**batch, "tokens": jax.random.permutation(sub, batch["tokens"], axis=1, independent=False)}
        loss, grads = autopp.value_and_grad(model.loss)(params, noisy)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, key, loss

    params = model.init(jax.random.key(0))
    return step, (params, tx.init(params), jax.random.key(7)), model.batch(jax.random.key(1), 8)


def interleaved_case():
    """8 tanh layers under interleaved 1F1B with 4 virtual stages on 2 device groups: every chunk boundary crosses
    processes (it hung before the host bounded the receives in flight): step, state, batch."""
    import jax.numpy as jnp

    def loss(params, batch):
        x = batch[0]
        for p in params:
            x = jnp.tanh(x @ p["w"] + p["b"])
        return jnp.mean((x - batch[1]) ** 2)

    def step(params, batch):
        value, grads = autopp.value_and_grad(loss)(params, batch)
        return jax.tree.map(lambda p, g: p - 0.5 * g, params, grads), value

    params = [dict(w=jax.random.normal(k, (32, 32)) / 6, b=jnp.zeros(32)) for k in jax.random.split(jax.random.key(0), 8)]
    return step, (params,), (jax.random.normal(jax.random.key(1), (16, 32)), jax.random.normal(jax.random.key(2), (16, 32)))


def run(name: str, out_dir: str) -> None:
    if name in ("extras", "interleaved"):
        step_fn, state, batch = (extras_case if name == "extras" else interleaved_case)()
        step = autopp.parallelize(step_fn, num_stages=4, num_microbatches=4, donate_argnums=(0, 1)) \
            if name == "extras" else autopp.parallelize(step_fn, num_stages=2, num_microbatches=8,
                                                        schedule="interleaved-1f1b", virtual_stages=4)
        losses = []
        for _ in range(STEPS + 1):
            *state, loss = step(*state, batch)
            losses.append(float(loss))
        np.save(os.path.join(out_dir, f"{name}.{jax.process_index()}.npy"), np.array(losses))
        if name == "extras":  # the whole state gathered, the typed key (held by both processes) as its raw data
            np.save(os.path.join(out_dir, f"{name}.{jax.process_index()}.key.npy"),
                    autopp.distributed.gather(state[2]))
        return
    step_fn, state, batch = gpt_case()
    step = autopp.parallelize(step_fn, **plan_kwargs(name, jax.devices()))
    me = jax.process_index()
    if name == "batchdiff" and me == 1:  # another batch on process 1: refused on the first step
        batch = jax.tree.map(lambda x: (x + 1) % 16, batch)
    losses = []
    for i in range(STEPS - (name in ("fewer", "fewergather") and me == 1)):
        *state, loss = step(*state, batch)
        losses.append(float(loss))  # scalar outputs are on every process
        if name == "die" and i == 0:
            print(f"step 0 done, loss {losses[0]:.4f}", flush=True)
            if me == 1:
                os.kill(os.getpid(), signal.SIGKILL)
        if name.startswith("raise") and i == 0 and me == int(name[-1]):
            raise RuntimeError(f"process {me} raised on purpose")
    if name == "fewergather" or name == "gather0" and me == 0:
        autopp.distributed.gather(state[0])
    held = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(state[0])[0]:
        if leaf.addressable_shards:
            held[jax.tree_util.keystr(path)] = np.asarray(leaf.addressable_shards[0].data) if not \
                leaf.is_fully_addressable else np.asarray(leaf)
    np.savez(os.path.join(out_dir, f"{name}.{me}.npz"), __losses__=np.array(losses), **held)
    if name == "even":  # peak bytes of this process's devices, in the order of its local devices
        report = step.memory_report(*state, batch)
        assert sorted(report) == sorted(d.id for d in jax.local_devices()), report
        np.save(os.path.join(out_dir, f"{name}.{me}.memory.npy"),
                np.array([report[d.id] for d in jax.local_devices()], dtype=np.int64))
    if name == "even":  # the whole state, wherever it is held, gathered to every process as one tree
        params, opt_state = autopp.distributed.gather((state[0], state[1]))
        leaves = {jax.tree_util.keystr(path): leaf for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]}
        leaves.update({"opt" + jax.tree_util.keystr(path): leaf
                       for path, leaf in jax.tree_util.tree_flatten_with_path(opt_state)[0]})
        np.savez(os.path.join(out_dir, f"{name}.{me}.gathered.npz"), **leaves)
        # a checkpoint of the gathered state (process 0 writes it), restored on every process, runs the next step
        directory = os.path.join(out_dir, "ckpt")
        try:  # the state as the step returns it: partly held by the other process
            autopp.checkpoint.save(directory, STEPS, (state[0], state[1]))
        except ValueError as e:
            print(f"ungathered state refused: {e}", flush=True)
        if me:  # the others come late: their check for earlier steps must not see process 0's write of this one
            time.sleep(1.0)
        autopp.checkpoint.save(directory, STEPS, (params, opt_state))
        restored = autopp.checkpoint.restore(directory, like=(params, opt_state))
        assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves((params,
                                                                                                 opt_state))))
        *_, resumed = step(*restored, batch)
        np.save(os.path.join(out_dir, f"{name}.{me}.resumed.npy"), np.array(float(resumed)))
    if name == "even" and jax.process_count() == 2:  # the 2-process test checks that transfers overlap compute
        np.save(os.path.join(out_dir, f"{name}.{me}.overlaps.npy"),
                np.array(receives_during_compute(step, state, batch), dtype=np.int64))


def receives_during_compute(step, state, batch, steps: int = 3) -> list[int]:
    """Per traced step: how many of this process's receives from another process completed while the receiving
    stage was computing another action (a forward or backward that started before the arrival and ended after)."""
    import re

    counts = []
    for _ in range(steps):
        (*state, _), timeline = step.trace(*state, batch)
        n = 0
        for r in timeline.events:
            m = re.match(r"^send (?:grad )?\d+->(\d+) mb (\d+) \(cross-process\)$", r.label)
            if not m or r.lane.startswith("devices"):
                continue
            stage, mb = m.group(1), m.group(2)
            n += any(c.kind in ("F", "B", "FB") and c.label.startswith(stage) and not c.label.endswith(mb)
                     and c.start_s < r.end_s < c.end_s for c in timeline.events)
        counts.append(n)
    return counts


if __name__ == "__main__":
    autopp.distributed.initialize()  # before anything starts JAX's backend
    for plan in sys.argv[2:]:
        run(plan, sys.argv[1])
    from autopp._distributed import _state

    _state["stop_watchdog"]()  # what runs at exit, before JAX's shutdown
    # the watchdog's threads must have left the coordinator's client before JAX's shutdown (else ~30% of processes
    # aborted at exit, after their work)
    alive = sorted(t.name for t in threading.enumerate() if t.name.startswith("autopp-watchdog") and t.is_alive())
    print(f"watchdog threads alive once stopped: {alive}", flush=True)
    autopp.distributed.shutdown()
    print("worker done", flush=True)

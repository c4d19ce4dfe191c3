"""The runtime's passes, each a function from a task list to a task list, on a small pipeline (the tiny MLP as 4
stages of one device, 2 microbatches, 1F1B), checked against truths computed here by hand; and the one run loop's
hook."""

from __future__ import annotations

import concurrent.futures
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autopp
from autopp.core import device_free_key
from autopp.runtime import _executor, _multiprocess, _passes
from autopp.runtime._tasks import Program, Transfer

from _helpers import assert_trees_close, model_case, run_steps, tiny_mlp

NUM_STAGES = 4


@pytest.fixture(scope="module")
def built():
    """(program before any pass, its compiler, stage devices, executable, flat step inputs)."""
    captured = []
    real = _executor.build_program

    def capture(*args, **kwargs):
        result = real(*args, **kwargs)
        captured.append(result)
        return result

    step, state, batch = model_case(tiny_mlp, 8)
    pipelined = autopp.parallelize(step, num_stages=NUM_STAGES, num_microbatches=2, schedule="1f1b",
                                   devices=jax.devices()[:NUM_STAGES])
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_executor, "build_program", capture)
        exe = pipelined.executable_for(*state, batch)
    ((program, compiler, meshes),) = captured
    return program, compiler, meshes.devices, exe, jax.tree.leaves((*state, batch))


def _accumulating(label: str, s: int) -> bool:
    return re.fullmatch(rf"{s}[BW]\d+|{s}F\d+\+{s}B\d+", label) is not None


def test_the_program_is_laid_out_before_any_pass(built):
    program, *_ = built
    assert isinstance(program, Program)
    assert not any(t.frees for t in program.tasks)
    assert not any(t.label.startswith("keep gradient buffers") for t in program.tasks)
    jitted = [t for t in program.tasks if not isinstance(t.fn, Transfer)]
    assert jitted and all(t.lowered is not None for t in jitted)
    assert all(t.lowered is None for t in program.tasks if isinstance(t.fn, Transfer))


def test_reuse_accumulators_hands_each_stage_its_final_accumulators(built):
    program, compiler, *_ = built
    tasks_before = program.tasks
    after = _passes.reuse_accumulators(program, compiler)
    assert program.tasks is tasks_before  # a new program; the old one is untouched
    assert after.tasks[:len(program.tasks)] == program.tasks  # nothing returned, so every stage reuses
    added = after.tasks[len(program.tasks):]
    assert [t.label for t in added] == [f"keep gradient buffers stage {s}" for s in range(NUM_STAGES)]
    for s, keep in enumerate(added):
        (start,) = [t for t in program.tasks if t.label == f"gradient buffers stage {s}"]
        assert keep.fn.kind == "give back" and start.fn.kind == "buffers"
        # By hand: the final accumulators are made by the stage's last accumulating action, and follow the
        # buffers' types one to one.
        last = [t for t in program.tasks if _accumulating(t.label, s)][-1]
        assert set(keep.ins) <= set(last.outs)
        assert [program.slot_avals[i] for i in keep.ins] == [program.slot_avals[i] for i in start.outs]
        # The give back returns them to the pool the buffers task takes from.
        saved = list(start.fn.pool)
        keep.fn(*"abc")
        assert start.fn.pool == [["a", "b", "c"]]
        start.fn.pool[:] = saved


def test_insert_frees_frees_every_slot_after_its_last_use_and_nothing_before(built):
    program, compiler, *_ = built
    program = _passes.reuse_accumulators(program, compiler)
    after = _passes.insert_frees(program)
    assert [t.label for t in after.tasks] == [t.label for t in program.tasks]
    # By hand: walking the list backwards, the first task seen reading a slot is its last reader; a slot nothing
    # reads is last used by the task that makes it.
    kept = {s for s, _ in program.const_slots} | set(program.output_slots)
    last_reader = {}
    for t in reversed(range(len(program.tasks))):
        for slot in program.tasks[t].ins:
            last_reader.setdefault(slot, t)
    maker = {o: t for t, task in enumerate(program.tasks) for o in task.outs}
    last_use = {slot: last_reader.get(slot, maker.get(slot)) for slot in {*last_reader, *maker} - kept}
    expected = {t: sorted(s for s, u in last_use.items() if u == t) for t in range(len(program.tasks))}
    assert {t: sorted(task.frees) for t, task in enumerate(after.tasks)} == expected
    freed, live = set(), set(program.input_slots) | kept
    for task in after.tasks:
        assert not set(task.ins) & freed, f"{task.label} reads a freed slot"
        assert set(task.ins) <= live, f"{task.label} reads a slot nothing made"
        live |= set(task.outs)
        assert not set(task.frees) & freed and not set(task.frees) & kept
        freed |= set(task.frees)
    made = {o for t in program.tasks for o in t.outs} - kept
    assert made <= freed  # no buffer outlives the step


def _two_processes(monkeypatch, program, stage_devices, me):
    """``program`` localized for process ``me`` of two: devices 0-1 on process 0, 2-3 on process 1."""
    monkeypatch.setattr(_multiprocess, "_empty", lambda aval, sharding: ("stand-in", aval.shape))
    procs = _multiprocess.Processes(me, 2, of=lambda d: 0 if d.id < 2 else 1)
    return _passes.localize(program, stage_devices, procs)


def _is_subsequence(part, whole) -> bool:
    it = iter(whole)
    return all(any(x == y for y in it) for x in part)


def test_localize_keeps_local_tasks_and_the_same_transfers_on_both_processes(built, monkeypatch):
    program, compiler, stage_devices, *_ = built
    program = _passes.reuse_accumulators(program, compiler)
    assert _passes.localize(program, stage_devices) is program  # one process: nothing to do
    local = {p: _two_processes(monkeypatch, program, stage_devices, p) for p in (0, 1)}
    labels = [t.label for t in program.tasks]
    cross = {p: [t.label for t in local[p].tasks if t.processes == {0, 1}] for p in (0, 1)}
    assert cross[0] == cross[1]  # issued by both, in the same order
    # By hand: the stage-1 -> stage-2 sends (process 0 -> 1) and their cotangents back cross processes, and the
    # loss (on the last stage) goes to process 0.
    sends = [f"send 1->2 mb {m} (cross-process)" for m in range(2)]
    sends += [f"send grad 2->1 mb {m} (cross-process)" for m in range(2)]
    assert set(sends) <= set(cross[0])
    assert "send scalar output to processes [0]" in cross[0]
    devices_of = {0: {0, 1}, 1: {2, 3}}
    for p in (0, 1):
        mine = [t for t in local[p].tasks if t.processes == {p}]
        assert all(t.devices <= devices_of[p] for t in mine if not isinstance(t.fn, Transfer))
        # Every program of this process's stages is kept, in order, and no other's.
        programs = [t.label for t in program.tasks if not isinstance(t.fn, Transfer)]
        ours = [t.label for t in program.tasks if not isinstance(t.fn, Transfer) and t.devices <= devices_of[p]]
        assert [t.label for t in local[p].tasks if not isinstance(t.fn, Transfer)] == ours
        assert set(ours) < set(programs)
        stripped = [t.label.removesuffix(" (cross-process)") for t in local[p].tasks
                    if not t.label.startswith("send scalar")]
        stripped = [x for k, x in enumerate(stripped) if k == 0 or stripped[k - 1] != x]  # a put split in two
        assert _is_subsequence(stripped, labels)
        other = 1 - p
        other_stage_programs = [t for t in program.tasks
                                if not isinstance(t.fn, Transfer) and t.devices <= devices_of[other]]
        assert not {t.label for t in other_stage_programs} & {t.label for t in local[p].tasks}


def test_compile_points_every_program_at_one_deferred_compilation(built):
    program, compiler, *_ = built
    program = _passes.insert_frees(_passes.reuse_accumulators(program, compiler))
    after = _passes.compile(program, compiler)
    by_lowered = {}
    for before, task in zip(program.tasks, after.tasks):
        assert (task.label, task.ins, task.outs, task.frees) == (before.label, before.ins, before.outs, before.frees)
        if isinstance(before.fn, Transfer):
            assert task.fn is before.fn
        else:
            assert isinstance(task.fn, _passes._Deferred) and task.lowered is None
            assert by_lowered.setdefault(id(before.lowered), task.fn) is task.fn
    assert len(set(map(id, by_lowered.values()))) == len(by_lowered)
    assert 1 <= after.num_compiled <= len(by_lowered)


def test_the_run_loop_hook_sees_every_task_once_in_order(built):
    *_, exe, flat = built
    expected = jax.block_until_ready(exe.run(flat))
    seen = []
    got = exe.run(flat, on_dispatch=lambda k, outs: seen.append((k, len(outs))))
    assert seen == [(k, len(t.outs)) for k, t in enumerate(exe.tasks)]
    jax.tree.map(np.testing.assert_array_equal, jax.block_until_ready(got), expected)


def test_steps_accumulate_into_the_buffers_the_previous_step_gave_back(built):
    *_, exe, flat = built
    starts = {k: t for k, t in enumerate(exe.tasks) if t.label.startswith("gradient buffers stage")}
    jax.block_until_ready(exe.run(flat))
    pooled = {k: list(t.fn.pool[0]) for k, t in starts.items()}
    handed = {}
    jax.block_until_ready(exe.run(flat, on_dispatch=lambda k, outs: handed.update({k: outs}) if k in starts else None))
    for k in starts:
        assert all(a is b for a, b in zip(handed[k], pooled[k], strict=True))


# -- deferred compilation and retarget --------------------------------------------------------------------
def _deferred():
    x = jax.device_put(np.ones((4,), np.float32), jax.devices()[1])
    lowered = jax.jit(lambda v: v * 2).lower(x)
    source = jax.jit(lambda v: v * 2).lower(jax.device_put(np.ones((4,), np.float32), jax.devices()[0]))
    future = concurrent.futures.Future()
    future.set_result(_passes.compile_reusable(source, device_free_key(source)))
    return _passes._Deferred(future, lowered), x


def test_deferred_compiles_when_retarget_reports_the_programs_differ(monkeypatch):
    def not_movable(compiled, lowered, **_):
        raise ValueError("executable with callbacks or effects")

    monkeypatch.setattr(_passes, "retarget", not_movable)
    deferred, x = _deferred()
    np.testing.assert_array_equal(np.asarray(deferred(x)), np.full((4,), 2.0))
    assert isinstance(deferred.compiled, jax.stages.Compiled)


def test_an_unexpected_error_from_retarget_propagates(monkeypatch):
    def broken(compiled, lowered, **_):
        raise RuntimeError("boom")

    monkeypatch.setattr(_passes, "retarget", broken)
    deferred, x = _deferred()
    with pytest.raises(RuntimeError, match="boom"):
        deferred(x)
    assert deferred.compiled is None


def test_retarget_moves_the_executable():
    deferred, x = _deferred()
    out = deferred(x)
    assert out.devices() == {jax.devices()[1]}
    np.testing.assert_array_equal(np.asarray(out), np.full((4,), 2.0))


def test_builds_share_the_compilations_still_running(monkeypatch):
    """A program equal up to its devices to one another build of this process is still compiling waits for that
    compilation (and is loaded onto its own devices) instead of compiling beside it; a build after it has finished
    compiles again (JAX's persistent cache, when configured, serves it)."""
    import threading

    import jax.numpy as jnp
    from jax.sharding import SingleDeviceSharding

    release, compiled_keys = threading.Event(), []
    real = _passes.compile_reusable

    def held(lowered, key):
        compiled_keys.append(key)
        assert release.wait(120)
        return real(lowered, key)

    monkeypatch.setattr(_passes, "compile_reusable", held)
    fn = jax.jit(lambda v: jnp.tanh(v) * 2)
    on = [jax.ShapeDtypeStruct((8,), jnp.float32, sharding=SingleDeviceSharding(d)) for d in jax.devices()[:2]]
    first, second = _passes.Compiler(), _passes.Compiler()
    try:
        lowered_a, lowered_b = first.lower(fn, [on[0]]), second.lower(fn, [on[1]])
        running = first.future(lowered_a)
        assert second.future(lowered_b) is running and not running.done()
    finally:
        release.set()
    x = jax.device_put(np.arange(8.0, dtype=np.float32), jax.devices()[1])
    out = _passes._Deferred(second.future(lowered_b), lowered_b)(x)
    assert out.devices() == {jax.devices()[1]}
    np.testing.assert_allclose(np.asarray(out), np.tanh(np.arange(8.0)) * 2, rtol=1e-6)
    assert len(compiled_keys) == 1
    third = _passes.Compiler()
    assert third.future(third.lower(fn, [on[0]])) is not running  # finished: no longer shared
    first.close(), second.close(), third.close()


def test_per_example_typed_keys_in_the_batch_are_split_into_microbatches():
    """Typed PRNG keys per example in the batch are split into microbatches like any batch leaf; the noise they draw
    equals plain jit's gradient accumulation over the same microbatches (SGD, <= 1e-6)."""
    import optax

    from autopp.models import make_train_step

    tx, M = optax.sgd(0.1), 4
    params = {"w1": jax.random.normal(jax.random.key(0), (8, 16)) * 0.3,
              "w2": jax.random.normal(jax.random.key(1), (16, 8)) * 0.3}

    def loss(p, batch):
        noise = jax.vmap(lambda k: jax.random.normal(k, (8,)))(batch["keys"])
        h = jnp.tanh((batch["x"] + 0.1 * noise) @ p["w1"])
        return jnp.mean((jnp.tanh(h @ p["w2"]) - batch["x"]) ** 2)

    batch = {"x": jax.random.normal(jax.random.key(2), (8, 8)), "keys": jax.random.split(jax.random.key(3), 8)}
    state = (params, tx.init(params))

    def plain(params, opt_state, batch):
        mbs = jax.tree.map(lambda x: x.reshape((M, -1) + x.shape[1:]), batch)
        losses, grads = jax.vmap(jax.value_and_grad(loss), in_axes=(None, 0))(params, mbs)
        updates, opt_state = tx.update(jax.tree.map(lambda g: g.mean(0), grads), opt_state, params)
        return optax.apply_updates(params, updates), opt_state, losses.mean()

    pipelined = autopp.parallelize(make_train_step(loss, tx), num_stages=2, num_microbatches=M,
                                   schedule="1f1b", devices=jax.devices()[:2])
    got, got_losses = run_steps(pipelined, state, batch)
    want, want_losses = run_steps(jax.jit(plain), state, batch)
    assert_trees_close(got, want, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(got_losses, want_losses, rtol=1e-6, atol=1e-6)


def test_gradient_buffers_of_a_failed_step_are_not_reused():
    """A step whose host callback raised leaves its gradient buffers in an error state; handed to the next step they
    failed every later step ("Error dispatching computation ... CpuCallback error", a user trial: 2-4 runs in 8)
    until ``release()``. The pool now gives fresh zeros instead of a failed buffer."""
    from autopp.runtime._tasks import give_back, reused_buffers

    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    aval = jax.ShapeDtypeStruct((4,), jnp.float32, sharding=sharding)
    buffers = reused_buffers([aval], [sharding])
    (first,) = buffers()

    def fail(x):
        raise ValueError("a host callback failed")

    @jax.jit
    def slow(x):  # still running when the callback's program is dispatched: its failure lands in the result
        m = jnp.ones((600, 600)) * 1e-3
        for _ in range(40):
            m = jnp.tanh(m @ m)
        return x + m[0, :4]

    broken = jax.jit(lambda x: jax.pure_callback(fail, jax.ShapeDtypeStruct((4,), jnp.float32), x))(slow(first))
    with pytest.raises(Exception, match="a host callback failed"):
        broken.block_until_ready()
    give_back(buffers)(broken)
    (again,) = buffers()
    assert again is not broken
    np.testing.assert_array_equal(again, np.zeros(4, np.float32))
    give_back(buffers)(again)
    assert buffers()[0] is again  # a sound buffer is reused

"""Gradient accumulators: a step reuses the previous step's buffers (no zero program), and a reused buffer's
contents never reach the gradients."""

from __future__ import annotations

import gc

import jax
import numpy as np

import autopp

from _helpers import assert_trees_close, model_case, run_steps, tiny_gpt, tiny_mlp


def _pipelined(step, schedule="1f1b", num_stages=4):
    return autopp.parallelize(step, num_stages=num_stages, num_microbatches=4, schedule=schedule,
                              devices=jax.devices()[:num_stages])


def _buffer_tasks(exe):
    return [t for t in exe.tasks if t.label.startswith("gradient buffers stage")]


def test_steps_reuse_gradient_buffers_and_compile_no_zero_program():
    step, state, batch = model_case(tiny_gpt, 8)
    pipelined = _pipelined(step)
    got, _ = run_steps(pipelined, state, batch)
    assert_trees_close(got, run_steps(jax.jit(step), state, batch)[0])
    exe = pipelined.executable_for(*state, batch)
    labels = exe.description
    assert not [label for label in labels if "zero gradients" in label]
    starts = _buffer_tasks(exe)
    assert len(starts) == 4 and len([label for label in labels if label.startswith("keep gradient buffers")]) == 4
    # After a step each stage's pool holds its accumulators: arrays of the planned layout, not deleted.
    for task in starts:
        (pooled,) = task.fn.pool
        assert [x.sharding for x in pooled] == [a.sharding for a in task.fn.out_avals]
        assert not any(x.is_deleted() for x in pooled)


def test_garbage_in_a_reused_buffer_does_not_reach_the_gradients():
    """Fill every pooled accumulator with nan and inf: the first accumulation must overwrite, not add."""
    for schedule in ("1f1b", "zb-h1"):
        step, state, batch = model_case(tiny_mlp, 8)
        pipelined = _pipelined(step, schedule)
        jax.block_until_ready(pipelined(*state, batch))
        for task in _buffer_tasks(pipelined.executable_for(*state, batch)):
            (pooled,) = task.fn.pool
            poison = [np.full(x.shape, np.nan if k % 2 else np.inf, x.dtype) for k, x in enumerate(pooled)]
            task.fn.pool[:] = [jax.device_put(poison, [x.sharding for x in pooled])]
        got = pipelined(*state, batch)
        expected = jax.jit(step)(*state, batch)
        assert_trees_close(got, expected)


def test_a_step_that_returns_its_gradients_starts_from_zeros_each_step():
    """Returned gradients belong to the caller: a later step never writes into them. A stage whose accumulators are
    themselves returned compiles a zero program instead of reusing them; one whose small accumulators are packed
    returns unpacked copies, and reuses its packs."""
    model = tiny_mlp()

    @jax.jit
    def reference(params, batch):
        return jax.value_and_grad(model.loss)(params, batch)

    def step(params, batch):
        return autopp.value_and_grad(model.loss)(params, batch)

    params = model.init(jax.random.key(0))
    batch = model.batch(jax.random.key(1), 8)
    pipelined = _pipelined(step)
    returned = []
    for _ in range(3):
        loss, grads = pipelined(params, batch)
        want_loss, want_grads = reference(params, batch)
        np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
        returned.append((grads, want_grads))
        params = jax.tree.map(lambda p, g: np.asarray(p) - 0.1 * np.asarray(g), params, want_grads)
    for grads, want_grads in returned:  # read after the later steps ran: none of them wrote into these
        assert_trees_close(grads, want_grads)
    labels = pipelined.executable_for(params, batch).description
    for s in range(4):
        unpacked = f"gradients stage {s}" in labels  # the program that unpacks the returned gradients
        assert (f"zero gradients stage {s}" in labels) == (not unpacked), (s, labels)
        assert (f"keep gradient buffers stage {s}" in labels) == unpacked, (s, labels)



def _live_arrays() -> dict[int, int]:
    """id -> bytes of every array JAX holds (no reference kept)."""
    gc.collect()
    return {id(x): x.nbytes for x in jax.live_arrays()}


def test_release_frees_the_kept_accumulators_and_the_step_goes_on():
    """``release()`` drops the gradient accumulators kept between steps: the bytes it reports equal the
    parameters' bytes (one accumulator per parameter, one device per stage), ``memory_report(between_steps=True)``
    falls by them, so does what JAX itself holds on the stages' devices (``jax.live_arrays``), and the steps after
    it still equal plain jit."""
    step, state, batch = model_case(tiny_mlp, 8)
    pipelined = _pipelined(step)
    devices = jax.devices()[:4]
    *state1, _ = pipelined(*state, batch)
    *state2, _ = pipelined(*state1, batch)
    params_bytes = sum(x.nbytes for x in jax.tree.leaves(state[0]))
    held = pipelined.memory_report(*state, batch, between_steps=True)
    assert sum(held.values()) >= params_bytes
    del state1
    live_before = _live_arrays()
    freed = pipelined.release()
    live_after = _live_arrays()
    assert not set(live_after) - set(live_before)
    assert sum(n for k, n in live_before.items() if k not in live_after) == params_bytes
    assert sum(freed.values()) == params_bytes and set(freed) <= {d.id for d in devices}
    after = pipelined.memory_report(*state, batch, between_steps=True)
    assert {d: held[d] - after.get(d, 0) for d in held} == {d: freed.get(d, 0) for d in held}
    assert pipelined.release() == {}  # nothing left to free
    # The next steps make new accumulators (as the first step did) and still equal plain jit.
    *state3, loss3 = pipelined(*state2, batch)
    ref = jax.jit(step)
    *ref_state, _ = ref(*state, batch)
    *ref_state, _ = ref(*ref_state, batch)
    *ref_state, ref_loss = ref(*ref_state, batch)
    assert_trees_close((tuple(state3), loss3), (tuple(ref_state), ref_loss))
    assert sum(pipelined.memory_report(*state, batch, between_steps=True).values()) == sum(held.values())


def test_a_step_of_another_batch_size_frees_the_last_ones_accumulators():
    """Each argument signature has its own accumulators; a step of another signature frees the last one's, so a
    short last batch per epoch does not keep a second set of gradient buffers for good (it used to: 3 extra sets
    after 4 batch sizes). ``memory_report(between_steps=True)`` after steps at batch sizes 8, 4, 16 and 8 again: one
    set of accumulators is held (as after the first step), and the report says so whatever batch size it is asked
    with (a user trial: asked with another signature than the last step's, it said 2 bytes per device while a set of
    accumulators was held); each step equals plain jit."""
    step, state, batch = model_case(tiny_mlp, 16)
    pipelined = _pipelined(step)
    params_bytes = sum(x.nbytes for x in jax.tree.leaves(state[0]))

    def batch_of(n):
        return jax.tree.map(lambda x: x[:n], batch)

    ref = jax.jit(step)
    want = state
    *state, _ = pipelined(*state, batch_of(8))
    *want, _ = ref(*want, batch_of(8))
    held_one = sum(pipelined.memory_report(*state, batch_of(8), between_steps=True).values())
    assert held_one >= params_bytes
    for n in (4, 16, 8):
        *state, loss = pipelined(*state, batch_of(n))
        *want, want_loss = ref(*want, batch_of(n))
        assert_trees_close((tuple(state), loss), (tuple(want), want_loss))
        for _ in range(2):  # (the first asks may build a signature not stepped yet: its constants count from then)
            held = {m: sum(pipelined.memory_report(*state, batch_of(m), between_steps=True).values())
                    for m in (4, 8, 16)}
        assert len(set(held.values())) == 1 and params_bytes <= held[n] < held_one + params_bytes, held


def test_between_steps_reports_every_device_of_the_step():
    """A one-stage step held nothing between steps and ``memory_report(between_steps=True)`` returned ``{}`` (a
    user trial: code indexing it by device got a ``KeyError``), where a multi-stage step reports every device: the
    same devices as the peak report, 0 where nothing stays."""
    step, state, batch = model_case(tiny_mlp, 8)
    for stages in (1, 2):
        pipelined = autopp.parallelize(step, num_stages=stages, num_microbatches=2, devices=jax.devices()[:stages])
        pipelined(*state, batch)
        peak = pipelined.memory_report(*state, batch)
        held = pipelined.memory_report(*state, batch, between_steps=True)
        assert set(held) == set(peak) == set(range(stages)), (stages, held, peak)

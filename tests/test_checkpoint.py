"""autopp.checkpoint: a pipelined run checkpointed under one plan continues under another; damaged
checkpoints are reported and never spoil the ones before them."""

import hashlib
import os

import jax
import numpy as np
import pytest

import autopp
from autopp.checkpoint import CheckpointCorruptedError
from tests._helpers import assert_trees_close, gpt_case, run_steps


def test_resume_under_another_plan_matches_uninterrupted_run(tmp_path):
    step, state, batch = gpt_case()
    devices = jax.devices()
    plan_a = autopp.parallelize(step, num_stages=4, num_microbatches=4, schedule="1f1b", devices=devices[:4])
    expected, _ = run_steps(plan_a, state, batch, n=4)
    reference, _ = run_steps(jax.jit(step), state, batch, n=4)

    stopped, _ = run_steps(plan_a, state, batch, n=2)
    assert stopped[0]["wte"].sharding.device_set <= set(devices[:4])
    autopp.checkpoint.save(tmp_path, 2, stopped)
    assert autopp.checkpoint.latest_step(tmp_path) == 2

    # Plan B: another stage count, schedule, microbatch count and other devices.
    plan_b = autopp.parallelize(step, num_stages=2, num_microbatches=2, schedule="gpipe", devices=devices[4:])
    restored = autopp.checkpoint.restore(tmp_path, like=state)
    assert_trees_close(restored, stopped, rtol=0, atol=0)
    resumed, _ = run_steps(plan_b, restored, batch, n=2)
    assert resumed[0]["wte"].sharding.device_set <= set(devices[4:])
    assert_trees_close(resumed, expected)
    assert_trees_close(resumed, reference)

    # Straight into the shardings of a device the step does not use; the values are the same.
    on_dev = autopp.checkpoint.restore(tmp_path, like=state, shardings=jax.sharding.SingleDeviceSharding(devices[7]))
    assert on_dev[0]["wte"].sharding.device_set == {devices[7]}
    assert_trees_close(on_dev, stopped, rtol=0, atol=0)


def _state():
    rng = np.random.default_rng(0)
    return {"w": rng.standard_normal((64, 256), np.float32), "b": np.zeros(5, np.float32), "count": np.int32(3)}


def _files(step_dir):
    out = {}
    for root, _, names in os.walk(step_dir):
        for n in names:
            with open(os.path.join(root, n), "rb") as f:
                out[os.path.relpath(os.path.join(root, n), step_dir)] = hashlib.sha256(f.read()).hexdigest()
    return out


def _largest_array_file(step_dir):
    files = [os.path.join(r, n) for r, _, ns in os.walk(os.path.join(step_dir, "state")) for n in ns
             if os.sep + "d" + os.sep in os.path.join(r, n)]
    return max(files, key=os.path.getsize)


@pytest.mark.parametrize("damage", ["overwrite", "truncate", "metadata"])
def test_corrupted_checkpoint_is_reported_and_the_previous_one_restores(tmp_path, damage):
    state = _state()
    newer = {**state, "w": state["w"] + 1}
    autopp.checkpoint.save(tmp_path, 1, state)
    before = _files(tmp_path / "1")
    autopp.checkpoint.save(tmp_path, 2, newer)
    assert _files(tmp_path / "1") == before  # saving step 2 left step 1's files untouched

    path = _largest_array_file(tmp_path / "2") if damage != "metadata" else tmp_path / "2" / "autopp" / "metadata"
    with open(path, "rb") as f:
        data = bytearray(f.read())
    if damage == "overwrite":  # same length, a few bytes flipped: the storage layer does not notice
        mid = len(data) // 2
        data[mid:mid + 8] = bytes(b ^ 1 for b in data[mid:mid + 8])
    else:
        data = data[:len(data) // 2]
    with open(path, "wb") as f:
        f.write(data)

    with pytest.raises(CheckpointCorruptedError, match=r"step 2 in .*2 is damaged.*restore\(\.\.\., step=1\)"):
        autopp.checkpoint.restore(tmp_path, like=state)
    assert autopp.checkpoint.latest_step(tmp_path) == 2
    assert_trees_close(autopp.checkpoint.restore(tmp_path, step=1, like=state), state, rtol=0, atol=0)


def test_interrupted_save_is_ignored_and_bad_requests_are_explained(tmp_path):
    state = _state()
    autopp.checkpoint.save(tmp_path, 1, state)
    # A save killed before orbax renamed its temporary directory: not a checkpoint.
    (tmp_path / "2.orbax-checkpoint-tmp").mkdir()
    (tmp_path / "2.orbax-checkpoint-tmp" / "partial").write_bytes(b"\0" * 10)
    assert autopp.checkpoint.all_steps(tmp_path) == [1]
    assert_trees_close(autopp.checkpoint.restore(tmp_path, like=state), state, rtol=0, atol=0)
    autopp.checkpoint.save(tmp_path, 2, state)
    assert autopp.checkpoint.all_steps(tmp_path) == [1, 2]

    with pytest.raises(ValueError, match=r"leaf \['w'\] was saved as float32\[64, 256\] but like asks for "
                                         r"float32\[64, 255\]"):
        autopp.checkpoint.restore(tmp_path, like={**state, "w": np.zeros((64, 255), np.float32)})
    with pytest.raises(ValueError, match=r"saved but not in like: \['count'\]"):
        autopp.checkpoint.restore(tmp_path, like={"w": state["w"], "b": state["b"]})
    with pytest.raises(ValueError, match=r"step numbers must increase"):
        autopp.checkpoint.save(tmp_path, 2, state)
    with pytest.raises(ValueError, match=r"no checkpoint for step 5; it has steps \[1, 2\]"):
        autopp.checkpoint.restore(tmp_path, step=5)
    with pytest.raises(ValueError, match="there is no directory"):
        autopp.checkpoint.restore(tmp_path / "missing")
    afile = tmp_path / "afile"
    afile.write_text("not a checkpoint")
    with pytest.raises(ValueError, match="afile is a file; give the directory"):
        autopp.checkpoint.restore(afile)
    with pytest.raises(ValueError, match="afile is a file, not a directory"):
        autopp.checkpoint.save(afile / "run", 1, state)
    with pytest.raises(ValueError, match="directory='' names no directory"):
        autopp.checkpoint.save("", 1, state)
    flat = autopp.checkpoint.restore(tmp_path)
    assert sorted(flat) == ["['b']", "['count']", "['w']"]


def test_a_donated_state_is_named_not_saved(tmp_path):
    import jax

    state = jax.tree.map(jax.numpy.asarray, _state())
    jax.jit(lambda s: jax.tree.map(lambda x: x + 1, s), donate_argnums=0)(state)  # consumes `state`
    with pytest.raises(ValueError, match=r"deleted, e.g. \['b'\].*donated to a step.*Save the state the step "
                                         r"returned"):
        autopp.checkpoint.save(tmp_path, 1, state)


def test_python_numbers_restore_against_eval_shape_and_empty_leaves_round_trip(tmp_path):
    """A state with a Python step counter and learning rate restores with ``like=jax.eval_shape(...)`` (whose leaves
    are JAX's int32 / float32, where numpy saved int64 / float64), and a zero-size leaf (which orbax does not store)
    comes back with its shape and dtype. Before: a dtype mismatch error, and an orbax error naming ``leaf_00001``."""
    state = {"w": jax.numpy.arange(3.0), "empty": jax.numpy.zeros((0, 4), jax.numpy.bfloat16), "epoch": 5, "lr": 0.1}
    autopp.checkpoint.save(tmp_path, 1, state)
    back = autopp.checkpoint.restore(tmp_path, like=jax.eval_shape(lambda: state))
    assert back["epoch"] == 5 and isinstance(back["epoch"], int) and back["lr"] == 0.1
    assert back["empty"].shape == (0, 4) and back["empty"].dtype == jax.numpy.bfloat16
    np.testing.assert_array_equal(back["w"], np.arange(3.0))
    placed = autopp.checkpoint.restore(tmp_path, like=state, shardings=jax.sharding.SingleDeviceSharding(
        jax.devices()[1]))
    assert placed["empty"].shape == (0, 4) and placed["empty"].devices() == {jax.devices()[1]}
    with pytest.raises(ValueError, match=r"\['w'\] was saved as float32\[3\] but like asks for int32\[3\]"):
        autopp.checkpoint.restore(tmp_path, like={**state, "w": jax.numpy.arange(3)})

"""Programs equal up to their devices compile once and are loaded onto the other devices."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import autopp
from autopp.core import _compat, _stage
from autopp.runtime import _executor, _passes

from _helpers import assert_trees_close, model_case, run_steps, tiny_gpt, tiny_mlp, tiny_scanned_gpt


def _layer(x, w):
    return jnp.tanh(x @ w).sum(axis=0)


def test_retarget_single_device_program_runs_on_the_other_device():
    devs = jax.devices()
    x, w = np.arange(48.0).reshape(6, 8) / 50, np.eye(8) * 0.5 + 0.01
    fn = jax.jit(_layer)
    lowered = [fn.lower(jax.device_put(x, d), jax.device_put(w, d)) for d in devs[:3]]
    keys = {_compat.device_free_key(lo) for lo in lowered}
    assert len(keys) == 1 and None not in keys
    source = lowered[0].compile()
    for d, lo in zip(devs[1:3], lowered[1:]):
        moved = _compat.retarget(source, lo)
        out = moved(jax.device_put(x, d), jax.device_put(w, d))
        assert out.devices() == {d}
        np.testing.assert_allclose(np.asarray(out), np.asarray(_layer(x, w)), rtol=1e-6)
    assert _compat.retarget(source, lowered[0]) is source


def test_retarget_sharded_program_keeps_its_layout_on_other_devices():
    devs = jax.devices()
    x, w = np.arange(64.0).reshape(8, 8) / 70, np.eye(8) * 0.3 + 0.02

    def lower_on(ds):
        mesh = Mesh(np.array(ds).reshape(2, 2), ("data", "tensor"))
        xs = jax.device_put(x, NamedSharding(mesh, P("data", None)))
        ws = jax.device_put(w, NamedSharding(mesh, P(None, "tensor")))
        return jax.jit(lambda a, b: jnp.tanh(a @ b)).lower(xs, ws), (xs, ws), mesh

    lo_a, _, _ = lower_on(devs[0:4])
    lo_b, args_b, mesh_b = lower_on(devs[4:8])
    assert _compat.device_free_key(lo_a) == _compat.device_free_key(lo_b)
    moved = _compat.retarget(lo_a.compile(), lo_b)
    out = moved(*args_b)
    assert out.sharding.mesh.devices.tolist() == mesh_b.devices.tolist()
    assert out.sharding.spec == lo_b.compile().output_shardings.spec
    np.testing.assert_allclose(np.asarray(out), np.tanh(x @ w), rtol=1e-6)


def test_different_programs_have_different_keys():
    x = jax.device_put(np.ones((4, 4)), jax.devices()[0])
    a = jax.jit(lambda v: v * 2).lower(x)
    b = jax.jit(lambda v: v * 3).lower(x)
    c = jax.jit(lambda v: v * 2).lower(jax.device_put(np.ones((4, 4)), jax.devices()[1:3][0]))
    assert _compat.device_free_key(a) != _compat.device_free_key(b)
    assert _compat.device_free_key(a) == _compat.device_free_key(c)


# the scanned GPT on the same 4-stage plan: tests/test_reroll.py checks that all its stages share two loop programs
@pytest.mark.parametrize("factory", [tiny_mlp, tiny_gpt, pytest.param(tiny_scanned_gpt, marks=pytest.mark.slow)])
def test_equal_middle_stages_compile_once_and_equal_jit(monkeypatch, factory):
    """The split repeats the middle stages (the GPT's start inside a block, at the same point of each block),
    so their forward, backward and optimizer programs compile once and load onto the other stage's device. With
    the blocks under ``lax.scan`` the stages read their rows of the stacked parameters relative to a row base they
    take as an argument, so the middle stages are again one program."""
    compiles = []
    real = _compat.retarget

    def counting(compiled, lowered, **kw):
        moved = real(compiled, lowered, **kw)
        compiles.append(moved is not compiled)
        return moved

    monkeypatch.setattr(_passes, "retarget", counting)  # the runtime calls the name it imported
    step, state, batch = model_case(factory, 16)
    expected, _ = run_steps(jax.jit(step), state, batch)
    pipelined = autopp.parallelize(step, num_stages=4, num_microbatches=4, schedule="1f1b",
                                   devices=jax.devices()[:4])
    actual, _ = run_steps(pipelined, state, batch)
    assert_trees_close(actual, expected, rtol=1e-5)
    assert sum(compiles) >= 3, f"moved {sum(compiles)} programs; stage 2's F, B and post phase equal stage 1's"
    exe = pipelined.executable_for(*state, batch)
    assert isinstance(exe, _executor.Executable)
    if factory is tiny_scanned_gpt:  # also equal programs on one device: the sums of each stacked gradient's parts
        assert exe.num_compiled <= exe.num_programs - sum(compiles)
    else:
        assert exe.num_programs - sum(compiles) == exe.num_compiled


def _recording_builds(monkeypatch):
    """Record every program the build lowers ((fn, lowered) pairs) and count the stages whose programs are traced
    and differentiated (``forward_with_vjp``: once per stage that makes its own programs)."""
    lowerings, vjps = [], []
    real_lower, real_vjp = _passes.Compiler.lower, _stage.forward_with_vjp

    def lower(self, fn, in_avals):
        lowered = real_lower(self, fn, in_avals)
        lowerings.append((fn, lowered))
        return lowered

    def vjp(*args, **kwargs):
        vjps.append(1)
        return real_vjp(*args, **kwargs)

    monkeypatch.setattr(_passes.Compiler, "lower", lower)
    monkeypatch.setattr(_stage, "forward_with_vjp", vjp)
    return lowerings, vjps


def test_twin_keys_tell_programs_apart_and_pair_devices_one_to_one():
    from jax.sharding import SingleDeviceSharding

    from autopp.core import _twins

    devs = jax.devices()

    def closed(c):
        return jax.make_jaxpr(lambda x: jnp.tanh(x * c))(np.ones(4, np.float32))

    def key(c, *shardings):
        return _twins.twin_key(closed(c), ("flags",), shardings)

    c = np.arange(4.0, dtype=np.float32)
    mesh_a, mesh_b = Mesh(np.array(devs[0:2]), ("data",)), Mesh(np.array(devs[2:4]), ("data",))
    (ka, da), (kb, db) = key(c, NamedSharding(mesh_a, P("data"))), key(c.copy(), NamedSharding(mesh_b, P("data")))
    assert ka == kb and da != db  # the same program on other devices (equal constants, other objects)
    assert _twins.device_map(da, db) == {devs[0]: devs[2], devs[1]: devs[3]}
    assert key(c + 1, NamedSharding(mesh_b, P("data")))[0] != ka  # another constant
    assert key(c, NamedSharding(mesh_b, P()))[0] != ka  # another layout
    assert key(c, SingleDeviceSharding(devs[0]))[0] != ka
    assert _twins.device_map(da, da) == {devs[0]: devs[0], devs[1]: devs[1]}  # another chunk on the same devices
    assert _twins.device_map(((devs[0], devs[1]),), ((devs[2], devs[2]),)) is None  # not one-to-one
    assert _twins.device_map(((devs[0],), (devs[0],)), ((devs[2],), (devs[3],))) is None  # inconsistent


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_equal_stages_are_traced_and_lowered_once(monkeypatch, schedule):
    """The GPT's middle stages run one program on different devices: the later one takes the earlier one's
    programs mapped onto its devices, so it is neither differentiated nor lowered. What the build reads off a
    mapped program (devices, output types) is what lowering it for real gives, and the step equals plain jit."""
    lowerings, vjps = _recording_builds(monkeypatch)
    step, state, batch = model_case(tiny_gpt, 16)
    expected, _ = run_steps(jax.jit(step), state, batch)
    pipelined = autopp.parallelize(step, num_stages=4, num_microbatches=4, schedule=schedule,
                                   devices=jax.devices()[:4])
    actual, _ = run_steps(pipelined, state, batch)
    assert_trees_close(actual, expected, rtol=1e-5)

    every = {id(lo): (fn, lo) for fn, lo in lowerings if isinstance(lo, _passes.MappedLowered)}
    # the equal middle stages' optimizer updates ("outer" programs) are lowered once too
    assert {getattr(fn.source, "__name__", None) for fn, _ in every.values()} >= {"outer"}
    mapped = {k: v for k, v in every.items() if getattr(v[0].source, "__name__", None) != "outer"}
    assert mapped, "no stage took another stage's programs"
    twin_stages = {id(fn.devmap) for fn, _ in mapped.values()}  # one device map per twin stage
    assert len(vjps) == 4 - len(twin_stages) and len(twin_stages) >= 1, (len(vjps), len(twin_stages))
    kinds = {"fwd", "bwd", "fwd_bwd"} | ({"<lambda>"} if schedule == "zb-h1" else set())
    assert {getattr(fn.source, "__name__", None) for fn, _ in mapped.values()} <= kinds
    for fn, lo in every.values():
        real = lo._real()  # the twin's own program, lowered now: the truth the stand-in must match
        assert _compat.device_free_key(real) == _compat.device_free_key(lo.source)
        assert list(_compat.lowered_devices(real)) == list(lo.mapped_devices)
        assert set(lo.mapped_devices).isdisjoint(_compat.lowered_devices(lo.source))
        want, got = jax.tree.leaves(real.out_info), jax.tree.leaves(lo.out_info)
        assert [(a.shape, a.dtype, a.sharding) for a in want] == [(a.shape, a.dtype, a.sharding) for a in got]
    assert len(vjps) == 4  # lowering the twins for real made their own programs, once per stage


def test_a_stage_maps_from_the_first_equal_stage_whose_devices_it_can_use(monkeypatch):
    """Eight one-device stages of the tiny GPT: stages 3 and 5 run stage 1's programs. With stage 1 taken for another
    process's (its device refused as a source, as ``device_map`` refuses devices of other processes), stage 3 makes
    its own programs and stage 5 takes stage 3's instead; the step still equals plain jit."""
    real_map, maps = _stage.device_map, []
    foreign = jax.devices()[1]

    def device_map(source_devices, devices):
        if any(foreign in group for group in source_devices):
            return None
        devmap = real_map(source_devices, devices)
        maps.append(devmap)
        return devmap

    monkeypatch.setattr(_stage, "device_map", device_map)
    step, state, batch = model_case(tiny_gpt, 16)
    expected, _ = run_steps(jax.jit(step), state, batch)
    pipelined = autopp.parallelize(step, num_stages=8, num_microbatches=4, schedule="1f1b", devices=jax.devices())
    actual, _ = run_steps(pipelined, state, batch)
    assert_trees_close(actual, expected, rtol=1e-5)
    devs = jax.devices()
    assert {devs[3]: devs[5]} in maps, [{a.id: b.id for a, b in m.items()} for m in maps if m]


def test_mapped_programs_that_cannot_be_loaded_compile_their_own(monkeypatch):
    """When an executable cannot be moved onto a twin stage's devices, the twin makes, lowers and compiles its own
    programs, and the step still equals plain jit."""
    _, vjps = _recording_builds(monkeypatch)
    monkeypatch.setattr(_passes, "retarget_or_none", lambda program, lowered: None)
    step, state, batch = model_case(tiny_gpt, 16)
    expected, _ = run_steps(jax.jit(step), state, batch)
    pipelined = autopp.parallelize(step, num_stages=4, num_microbatches=4, schedule="1f1b",
                                   devices=jax.devices()[:4])
    pipelined.executable_for(*state, batch)  # every program compiled
    assert len(vjps) == 4  # three stages built their programs, the twin its own when it had to compile
    actual, _ = run_steps(pipelined, state, batch)
    assert_trees_close(actual, expected, rtol=1e-5)


def test_shard_copies_only_between_mirrored_layouts():
    from jax.sharding import SingleDeviceSharding

    devs = jax.devices()
    mesh_a = Mesh(np.array(devs[0:2]), ("data",))
    mesh_b = Mesh(np.array(devs[2:4]), ("data",))
    shape = (4, 6)
    same = _compat.same_shard_positions
    assert same(SingleDeviceSharding(devs[0]), SingleDeviceSharding(devs[5]), shape)
    assert same(NamedSharding(mesh_a, P("data")), NamedSharding(mesh_b, P("data")), shape)
    assert not same(NamedSharding(mesh_a, P("data")), NamedSharding(mesh_b, P(None, "data")), shape)
    assert not same(NamedSharding(mesh_a, P("data")), SingleDeviceSharding(devs[2]), shape)
    x = jax.device_put(np.arange(24.0).reshape(shape), NamedSharding(mesh_a, P("data")))
    dest = NamedSharding(mesh_b, P("data"))
    (y,) = _compat.copy_shards([x], [dest])
    assert y.sharding == dest
    np.testing.assert_array_equal(np.asarray(y), np.arange(24.0).reshape(shape))
    for shard in y.addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), np.asarray(x)[shard.index])


def test_first_step_runs_programs_as_they_finish_compiling():
    """The build does not wait for compilation: its tasks hold deferred programs until the first step reaches
    them; after that step every task holds a compiled program, and results equal plain jit."""
    step, state, batch = model_case(tiny_mlp, 16)
    pipelined = autopp.parallelize(step, num_stages=2, num_microbatches=2, schedule="1f1b",
                                   devices=jax.devices()[:2])
    exe = pipelined._lookup((*state, batch))[0].executable
    deferred = [t for t in exe.tasks if isinstance(t.fn, _passes._Deferred)]
    assert deferred and exe.num_programs == len({id(t.fn) for t in deferred})
    got = pipelined(*state, batch)
    assert not [t for t in exe.tasks if isinstance(t.fn, _passes._Deferred)]
    assert all(isinstance(t.fn, jax.stages.Compiled) for t in exe.tasks if t.label in ("0F0", "1F0+1B0", "0B0"))
    assert_trees_close(got, jax.jit(step)(*state, batch))


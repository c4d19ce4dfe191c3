"""autopp.profiler.profile: whole-step FLOPs against XLA's cost analysis, memory, clusters, bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import autopp
from autopp.models import GPT, MLP, GPTConfig, MLPConfig, make_train_step
from autopp.profiler import Cluster
from autopp.profiler._profile import profile


def _step(model, tx):
    return make_train_step(model.loss, tx)


def _xla_step(model, tx):
    return make_train_step(model.loss, tx, value_and_grad=jax.value_and_grad)


CASES = {
    "gpt-small": (GPT(GPTConfig(layers=2, hidden=32, heads=4, seq=16, vocab=64)), 4),
    "gpt-wide": (GPT(GPTConfig(layers=3, hidden=64, heads=4, seq=32, vocab=128)), 8),
    "mlp": (MLP(MLPConfig()), 32),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_whole_step_flops_match_xla(name):
    model, batch_size = CASES[name]
    tx = optax.adamw(1e-3)
    params = model.init_abstract()
    opt_state = jax.eval_shape(tx.init, params)
    batch = jax.eval_shape(lambda: model.batch(jax.random.key(0), batch_size))
    prof = profile(_step(model, tx), params, opt_state, batch, cluster="1x8xH100")
    xla = jax.jit(_xla_step(model, tx)).lower(params, opt_state, batch).cost_analysis()
    expected = xla["flops"] + xla.get("transcendentals", 0.0)
    assert prof.total_flops == pytest.approx(expected, rel=0.05)
    assert prof.forward_flops > 0 and prof.backward_flops > prof.forward_flops


def test_param_bytes_exact_and_per_layer():
    model, batch_size = CASES["gpt-wide"]
    tx = optax.adamw(1e-3)
    params = model.init_abstract()
    prof = profile(_step(model, tx), params, jax.eval_shape(tx.init, params),
                   jax.eval_shape(lambda: model.batch(jax.random.key(0), batch_size)), cluster="1x8xA100-80GB")
    total = sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(params))
    assert prof.param_bytes == total
    assert sum(l.param_bytes for l in prof.layers) == total
    # AdamW keeps two moments per parameter (plus a scalar count, which belongs to no parameter).
    assert sum(l.optimizer_bytes for l in prof.layers) == 2 * total
    h = model.config.hidden
    blocks = [l for l in prof.layers if l.name.startswith("block")]
    assert len(blocks) == model.config.layers
    assert len({l.fingerprint for l in blocks}) == 1
    assert all(l.param_bytes == 4 * (12 * h * h + 13 * h) for l in blocks)
    assert all(l.activation_bytes > 0 and l.recompute_activation_bytes < l.activation_bytes for l in blocks)
    assert all(l.time_s > 0 for l in prof.layers)
    assert prof.graph.number_of_nodes() == len(prof.layers)
    # print(profile) is the table (a user trial printed the dataclass, its networkx graph included)
    assert str(prof) == prof.table() and str(prof).startswith("profile on") and "DiGraph" not in repr(prof)
    assert len(str(prof).splitlines()) == len(prof.layers) + 4  # two header lines, the rows, two totals


def test_faster_device_predicts_less_time():
    model, batch_size = CASES["gpt-wide"]
    tx = optax.sgd(1e-3)
    params = model.init_abstract()
    args = (params, jax.eval_shape(tx.init, params), jax.eval_shape(lambda: model.batch(jax.random.key(0), batch_size)))
    a100 = profile(_step(model, tx), *args, cluster="1x8xA100-80GB")
    h100 = profile(_step(model, tx), *args, cluster="1x8xH100")
    assert sum(l.time_s for l in h100.layers) < sum(l.time_s for l in a100.layers)
    assert h100.total_flops == a100.total_flops


@pytest.mark.parametrize("bad", ["128x8", "axbxH100", "0x8xH100", "8xFOO", ""])
def test_bad_cluster_strings(bad):
    model, batch_size = CASES["mlp"]
    with pytest.raises(ValueError):
        profile(_step(model, optax.sgd(1.0)), model.init_abstract(), (), jax.ShapeDtypeStruct((4, 64), jnp.float32),
                cluster=bad)


def test_cluster_is_exported():
    assert autopp.Cluster is Cluster
    assert Cluster.parse("128x8xH100").num_devices == 1024


def test_measured_profile_uses_json_cache(tmp_path, monkeypatch):
    import json

    from autopp.profiler import _profile as profile_module
    from autopp.profiler._measure import ProfileCache

    model = GPT(GPTConfig(layers=2, hidden=32, heads=4, seq=16, vocab=64))
    tx = optax.sgd(1e-2)
    params = model.init(jax.random.key(0))
    args = (params, tx.init(params), model.batch(jax.random.key(1), 4))
    cache = ProfileCache(str(tmp_path / "profiles.json"))
    prof = profile(_step(model, tx), *args, measure=True, cache=cache)
    assert all(l.measured and l.forward_time_s > 0 and l.backward_time_s > 0 for l in prof.layers)
    assert prof.time_model.calibrated  # embed, block, head: 6 (kernels, seconds) samples
    data = json.loads((tmp_path / "profiles.json").read_text())
    keys = sorted(data["entries"])
    assert len(keys) == len({l.fingerprint for l in prof.layers}) == 3
    assert all(k.startswith(f"cpu|jax-{jax.__version__}|") for k in keys)
    # the times of the runtime's stage programs, nothing else measured
    assert all(set(e) == {"forward_s", "backward_s", "kernels"} for e in data["entries"].values())

    def no_measuring(*a, **k):
        raise AssertionError("measured again despite the cache")

    monkeypatch.setattr(profile_module, "measure_layer", no_measuring)
    again = profile(_step(model, tx), *args, measure=True, cache=ProfileCache(str(tmp_path / "profiles.json")))
    assert [l.forward_time_s for l in again.layers] == [l.forward_time_s for l in prof.layers]


def test_measure_refuses_a_remote_cluster():
    model, batch_size = CASES["mlp"]
    tx = optax.sgd(1.0)
    params = model.init_abstract()
    with pytest.raises(ValueError, match=r"measure=True times layers on the local"):
        profile(_step(model, tx), params, jax.eval_shape(tx.init, params),
                jax.eval_shape(lambda: model.batch(jax.random.key(0), batch_size)), cluster="2x8xH100", measure=True)


def test_calibration_recovers_known_constants():
    from autopp.profiler._costs import OpCost
    from autopp.profiler._timemodel import KernelTimeModel

    truth = KernelTimeModel(device="cpu", flops_per_s=2e11, bytes_per_s=1.5e10, transcendentals_per_s=1e9,
                            matmul_floor_s=2e-4, fused_floor_s=3e-6, matmul_floor_flops=2e7)
    rng = np.random.default_rng(0)
    samples = []
    for _ in range(40):
        kernels = []
        for _ in range(rng.integers(1, 12)):
            if rng.random() < 0.4:
                f = float(10 ** rng.uniform(5, 10))
                kernels.append(("matmul", OpCost(f, 0.0, f / 50, 0.0)))
            else:
                kernels.append(("fused", OpCost(float(10 ** rng.uniform(3, 7)), float(10 ** rng.uniform(2, 6)),
                                                float(10 ** rng.uniform(4, 8)), 0.0)))
        samples.append((kernels, truth.time(kernels)))
    fitted = KernelTimeModel.calibrate("cpu", samples[:30])
    errors = [abs(fitted.time(k) - t) / t for k, t in samples[30:]]
    assert max(errors) < 0.02, errors


def test_kernel_costs_fuse_elementwise_runs():
    from autopp.profiler._costs import kernel_costs

    def f(x, w, v):
        y = jnp.tanh(x @ w) * 2.0 + 1.0  # one matmul, then one fused run
        return (y @ v).sum()

    j = jax.make_jaxpr(f)(jnp.ones((8, 16)), jnp.ones((16, 32)), jnp.ones((32, 4)))
    kinds = [k for k, _ in kernel_costs(j.jaxpr)]
    assert kinds == ["matmul", "fused", "matmul", "fused"], kinds
    fused = kernel_costs(j.jaxpr)[1][1]
    # Crossing the run's boundary: reads x@w (8x32 f32), writes y (8x32 f32); the intermediates stay inside.
    assert fused.bytes_accessed == 2 * 8 * 32 * 4
    assert fused.transcendentals == 8 * 32


@pytest.mark.parametrize("name, per_param_byte", [("sgd", 3), ("adamw", 7), ("clip+adamw", 8)])
def test_update_traffic_is_fused(name, per_param_byte):
    """The optimizer update is priced as the kernels XLA fuses it into: SGD reads parameter and gradient and writes
    the parameter (3 bytes per parameter byte); AdamW reads parameter, gradient and both moments and writes the
    three (7); clipping by the global norm adds one read of the gradients, for the reduction the update waits for
    (8). Hand-counted; XLA's own ``cost_analysis()`` of these updates compiled for an H200 gives 3.0, 7.0 and 8.0
    (docs/benchmarks.md, ``benchmarks/gpu_check.py update``)."""
    from autopp.core import trace_step
    from autopp.profiler._profile import update_kernels

    tx = {"sgd": optax.sgd(0.1), "adamw": optax.adamw(1e-3),
          "clip+adamw": optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))}[name]
    params = {"w": jax.ShapeDtypeStruct((256, 512), jnp.float32), "b": jax.ShapeDtypeStruct((1024, 64), jnp.float32)}
    param_bytes = (256 * 512 + 1024 * 64) * 4

    def loss(p, x):  # (the b term reads the batch: a sum of the weight alone would be computed once per step, outside
        return jnp.sum((x @ p["w"]) ** 2) + jnp.sum(p["b"] * jnp.mean(x))  # the loss, its gradient no array)

    def step(p, o, x):
        g = autopp.grad(loss)(p, x)
        u, o = tx.update(g, o, p)
        return optax.apply_updates(p, u), o

    opt_state = jax.eval_shape(tx.init, params)
    traced = trace_step(step, (params, opt_state, jax.ShapeDtypeStruct((8, 256), jnp.float32)), (2,))
    traffic = sum(k.at(1.0).bytes_accessed for k in update_kernels(traced))
    assert traffic / param_bytes == pytest.approx(per_param_byte, abs=0.01)


def test_cli_profile_json(capsys):
    import json

    from autopp._cli import main

    assert main(["profile", "--model", "gpt", "--layers", "2", "--hidden", "64", "--heads", "4", "--seq", "32",
                 "--vocab", "128", "--cluster", "4x8xH100", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["cluster"]["num_nodes"] == 4 and len(out["layers"]) == 4
    assert out["total_flops"] > out["forward_flops"] > 0
    assert main(["profile", "--cluster", "4x8"]) == 2
    assert "NODESxDEVICESxKIND" in capsys.readouterr().err
    # A device override reaches the time model: half the memory bandwidth, no faster.
    args = ["profile", "--layers", "2", "--hidden", "64", "--heads", "4", "--seq", "32", "--vocab", "128",
            "--cluster", "1x8xH100", "--json"]
    assert main(args) == 0
    base = json.loads(capsys.readouterr().out)
    assert main(args + ["--override", "hbm_bandwidth=1.675e12"]) == 0
    slow = json.loads(capsys.readouterr().out)
    assert slow["cluster"]["device"]["hbm_bandwidth"] == 1.675e12
    assert sum(l["time_s"] for l in slow["layers"]) > sum(l["time_s"] for l in base["layers"])
    assert main(args + ["--override", "no_such_field=1"]) == 2
    assert "no_such_field" in capsys.readouterr().err


def test_a_scanned_model_is_priced_as_its_unrolled_twin():
    """A ``lax.scan`` over stacked blocks and the same blocks as a Python loop: each iteration reads its row of the
    stacked parameters (not the whole stack) and owns its rows' optimizer state, so every block's time and bytes
    equal the unrolled block's, and the optimizer state sums to AdamW's two moments per parameter."""
    from tests._helpers import ScannedGPT

    config = GPTConfig(layers=6, hidden=256, heads=4, seq=16, vocab=64)
    tx = optax.adamw(1e-3)
    blocks = {}
    for name, model in (("scan", ScannedGPT(config)), ("loop", GPT(config))):
        params = jax.eval_shape(model.init, jax.random.key(0))
        prof = profile(_step(model, tx), params, jax.eval_shape(tx.init, params),
                       jax.eval_shape(lambda: model.batch(jax.random.key(0), 4)), cluster="1x8xH100")
        total = sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(params))
        assert sum(l.optimizer_bytes for l in prof.layers) == pytest.approx(2 * total, rel=1e-6)
        blocks[name] = [l for l in prof.layers if l.name.startswith("block")]
        assert len(blocks[name]) == config.layers
    for s, u in zip(blocks["scan"], blocks["loop"]):
        assert s.fingerprint == u.fingerprint
        assert s.param_bytes == u.param_bytes and s.optimizer_bytes == pytest.approx(u.optimizer_bytes, rel=1e-6)
        assert s.forward_time_s == pytest.approx(u.forward_time_s, rel=0.02)
        assert s.backward_time_s == pytest.approx(u.backward_time_s, rel=0.02)


def test_a_profile_refuses_pickling_with_what_to_do_instead():
    """A profile holds jaxprs, which do not pickle: pickle used to fail naming a JAX internal
    ("Can't pickle local object '_effect_free_abstract_eval...'"); it now says what to save instead. copy.copy of
    the frozen profile is the profile."""
    import copy
    import pickle

    model, batch_size = CASES["gpt-small"]
    tx = optax.sgd(0.1)
    params = model.init_abstract()
    prof = profile(_step(model, tx), params, jax.eval_shape(tx.init, params),
                   jax.eval_shape(lambda: model.batch(jax.random.key(0), batch_size)), cluster="1x8xA100-80GB")
    with pytest.raises(TypeError, match=r"Profile: a profile holds .* do not pickle\. .*plan\.to_json\(path\)"):
        pickle.dumps(prof)
    with pytest.raises(TypeError, match=r"Profile: a profile holds"):
        copy.deepcopy(prof)
    assert copy.copy(prof) is prof

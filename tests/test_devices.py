"""Device table, cluster strings and the analytic time model, against datasheet and hand-computed values."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import pytest

from autopp.profiler._cluster import Cluster, table_kind
from autopp.profiler._costs import OpCost, eqn_cost
from autopp.profiler._devices import DEVICE_KINDS, DeviceSpec, get_device
from autopp.profiler._kernels import matmul_dtype
from autopp.profiler._timemodel import COLLECTIVE_KINDS, KernelTimeModel, collective_time, op_time

GB = 1e9
TB = 1e12


# -- cluster strings --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, nodes, per_node, kind, total", [
    ("128x8xH100", 128, 8, "H100", 1024),
    ("8xH100", 1, 8, "H100", 8),
    ("  2 X 4 x h100-sxm ", 2, 4, "H100", 8),
    ("16x8xa100-80gb", 16, 8, "A100-80GB", 128),
    ("4X8XB200", 4, 8, "B200", 32),
    ("1x1xCPU", 1, 1, "cpu", 1),
])
def test_parse(text, nodes, per_node, kind, total):
    c = Cluster.parse(text)
    assert (c.num_nodes, c.devices_per_node, c.device.name, c.num_devices) == (nodes, per_node, kind, total)
    assert c.memory_per_device == DEVICE_KINDS[kind].memory_capacity
    assert Cluster.parse(c.shorthand) == c
    assert Cluster.from_dict(json.loads(json.dumps(c.to_dict()))) == c


def test_str():
    assert str(Cluster.parse("128x8xH100")) == "128 nodes x 8 H100 (1024 devices)"
    assert str(Cluster.parse("8xh200")) == "1 node x 8 H200 (8 devices)"


@pytest.mark.parametrize("text", ["128x8", "axbxH100", "0x8xH100", "8x0xH100", "-2x8xH100", "8xFOO", "", "   ",
                                  "2x3x4xH100", "H100", "8x", "x8xH100"])
def test_parse_malformed(text):
    with pytest.raises(ValueError) as info:
        Cluster.parse(text)
    msg = str(info.value)
    assert repr(text) in msg
    if text == "8xFOO":
        assert "'FOO'" in msg and all(k in msg for k in ("A100-40GB", "H100", "B200", "cpu"))
    else:
        assert "NODESxDEVICESxKIND" in msg and "128x8xH100" in msg


def test_parse_rejects_non_string():
    with pytest.raises(TypeError, match="string"):
        Cluster.parse(128)


def test_cluster_validates():
    assert Cluster(num_nodes=2, devices_per_node=8, device="h100") == Cluster.parse("2x8xH100")
    with pytest.raises(ValueError, match="num_nodes"):
        Cluster(num_nodes=0, devices_per_node=8, device="H100")
    with pytest.raises(ValueError, match="devices_per_node"):
        Cluster(num_nodes=1, devices_per_node=-8, device="H100")
    with pytest.raises(TypeError, match="num_nodes"):
        Cluster(num_nodes=1.5, devices_per_node=8, device="H100")
    with pytest.raises(TypeError, match="DeviceSpec"):
        Cluster(num_nodes=1, devices_per_node=8, device=42)
    with pytest.raises(ValueError, match="unknown"):
        Cluster.from_dict({"num_nodes": 1, "devices_per_node": 8, "device": "H100", "gpus": 8})


def test_from_dict_accepts_kind_name():
    assert Cluster.from_dict({"num_nodes": 2, "devices_per_node": 8, "device": "H100"}) == Cluster.parse("2x8xH100")


# -- local devices ---------------------------------------------------------------------------------------------

def test_local_cpu():
    c = Cluster.local()
    assert c.num_nodes == 1 and c.num_devices == len(jax.devices()) == 8
    assert c.device.name == "cpu"
    assert 0 < c.memory_per_device
    half = Cluster.local(jax.devices()[:4])
    assert half.num_devices == 4
    assert half.memory_per_device == 2 * c.memory_per_device  # RAM shared among fewer devices
    named = Cluster.local(kind="H100")
    assert named.device == get_device("H100") and named.num_devices == 8


def test_local_rejects_bad_devices():
    with pytest.raises(TypeError, match="jax.Device"):
        Cluster.local([])
    with pytest.raises(TypeError, match="jax.Device"):
        Cluster.local(["cuda:0"])


@pytest.mark.parametrize("platform, device_kind, expected", [
    ("gpu", "NVIDIA A100-SXM4-40GB", "A100-40GB"),
    ("gpu", "NVIDIA A100-SXM4-80GB", "A100-80GB"),
    ("gpu", "NVIDIA H100 80GB HBM3", "H100"),
    ("gpu", "NVIDIA H200", "H200"),
    ("gpu", "NVIDIA B200", "B200"),
    ("cpu", "cpu", "cpu"),
    ("gpu", "NVIDIA A100 80GB PCIe", None),
    ("gpu", "NVIDIA H100 PCIe", None),
    ("gpu", "NVIDIA H100 NVL", None),
    ("gpu", "NVIDIA GH200 480GB", None),
    ("gpu", "NVIDIA GB200", None),
    ("gpu", "Tesla V100-SXM2-16GB", None),
])
def test_table_kind(platform, device_kind, expected):
    assert table_kind(platform, device_kind) == expected


# -- device table ----------------------------------------------------------------------------------------------

def test_table_has_required_kinds():
    assert {"A100-40GB", "A100-80GB", "H100", "H200", "B200", "cpu"} <= set(DEVICE_KINDS)
    for spec in DEVICE_KINDS.values():
        assert spec.source
        assert 0 < spec.matmul_efficiency <= 1 and 0 < spec.memory_efficiency <= 1
        assert spec.inter_node_bandwidth < spec.intra_node_bandwidth
        assert spec.inter_node_latency > spec.intra_node_latency


# Datasheet numbers, written here independently of the table (decimal units; Gb/s InfiniBand = bits).
@pytest.mark.parametrize("kind, field, value", [
    ("A100-40GB", "peak_flops_bf16", 312 * TB),
    ("A100-40GB", "peak_flops_fp32", 19.5 * TB),
    ("A100-40GB", "hbm_bandwidth", 1555 * GB),
    ("A100-40GB", "memory_capacity", 40 * GB),
    ("A100-40GB", "intra_node_bandwidth", 600 * GB / 2),  # NVLink3 600 GB/s bidirectional
    ("A100-40GB", "inter_node_bandwidth", 200e9 / 8),  # HDR 200 Gb/s per GPU
    ("A100-80GB", "hbm_bandwidth", 2039 * GB),
    ("A100-80GB", "memory_capacity", 80 * GB),
    ("H100", "peak_flops_bf16", 1979 * TB / 2),  # datasheet lists 1,979 with sparsity
    ("H100", "peak_flops_fp32", 67 * TB),
    ("H100", "hbm_bandwidth", 3.35 * TB),
    ("H100", "memory_capacity", 80 * GB),
    ("H100", "intra_node_bandwidth", 900 * GB / 2),
    ("H100", "inter_node_bandwidth", 400e9 / 8),  # NDR 400 Gb/s per GPU
    ("H200", "peak_flops_bf16", 1979 * TB / 2),
    ("H200", "hbm_bandwidth", 4.8 * TB),
    ("H200", "memory_capacity", 141 * GB),
    ("B200", "peak_flops_bf16", 72e15 / 8 / 2 / 2),  # DGX B200: 72 PF FP8 sparse for 8 GPUs
    ("B200", "hbm_bandwidth", 64 * TB / 8),
    ("B200", "memory_capacity", 1440 * GB / 8),
    ("B200", "intra_node_bandwidth", 1.8 * TB / 2),
    ("B200", "inter_node_bandwidth", 400e9 / 8),
    ("A100-80GB", "peak_flops_fp64", 19.5 * TB),  # FP64 Tensor Core (DGEMM's rate)
    ("H100", "peak_flops_fp64", 67 * TB),
    ("H200", "peak_flops_fp64", 67 * TB),
    ("B200", "peak_flops_fp64", 37 * TB),  # HGX B200: FP64/FP64 Tensor Core
    ("H100", "peak_flops_fp8", 3958 * TB / 2),  # datasheet: FP8 3,958 TFLOPS with sparsity
    ("H200", "peak_flops_fp8", 3958 * TB / 2),
    ("B200", "peak_flops_fp8", 9e15 / 2),  # HGX B200 per GPU: FP8/FP6 9 PFLOPS sparse
    ("A100-80GB", "peak_ops_int8", 1248 * TB / 2),  # INT8 1,248 TOPS sparse
    ("H100", "peak_ops_int8", 3958 * TB / 2),
    ("B200", "peak_ops_int8", 9e15 / 2),
])
def test_datasheet_values(kind, field, value):
    assert getattr(DEVICE_KINDS[kind], field) == pytest.approx(value, rel=1e-3)


def test_h200_is_h100_compute():
    h100, h200 = get_device("H100"), get_device("H200")
    for f in ("peak_flops_bf16", "peak_flops_tf32", "peak_flops_fp32", "intra_node_bandwidth"):
        assert getattr(h100, f) == getattr(h200, f)


@pytest.mark.parametrize("name, kind", [("h100", "H100"), ("H100-SXM", "H100"), ("h100_sxm", "H100"),
                                        (" H200 ", "H200"), ("a100-40gb", "A100-40GB"), ("CPU", "cpu"),
                                        ("b200", "B200")])
def test_get_device_aliases(name, kind):
    assert get_device(name) is DEVICE_KINDS[kind]


def test_get_device_unknown():
    with pytest.raises(ValueError) as info:
        get_device("TPUv9")
    msg = str(info.value)
    assert "'TPUv9'" in msg and all(k in msg for k in DEVICE_KINDS)
    with pytest.raises(TypeError):
        get_device(100)


def test_table_is_read_only():
    with pytest.raises(TypeError):
        DEVICE_KINDS["H100"] = get_device("A100-40GB")
    with pytest.raises(dataclasses.FrozenInstanceError):
        get_device("H100").hbm_bandwidth = 1.0


# -- overrides -------------------------------------------------------------------------------------------------

def test_with_overrides():
    h100 = get_device("H100")
    slow = h100.with_overrides(matmul_efficiency=0.5, hbm_bandwidth=3e12)
    assert (slow.matmul_efficiency, slow.hbm_bandwidth) == (0.5, 3e12)
    assert slow.peak_flops_bf16 == h100.peak_flops_bf16
    assert h100.matmul_efficiency != 0.5  # original untouched
    assert "matmul_efficiency=0.5" in slow.source
    assert h100.with_overrides() == h100
    assert DeviceSpec.from_dict(slow.to_dict()) == slow
    c = Cluster.parse("2x8xH100").with_device_overrides(inter_node_bandwidth=25e9)
    assert c.device.inter_node_bandwidth == 25e9 and c.num_devices == 16


def test_with_overrides_unknown_field():
    with pytest.raises(TypeError) as info:
        get_device("H100").with_overrides(hbm_bw=1e12)
    msg = str(info.value)
    assert "'hbm_bw'" in msg and "hbm_bandwidth" in msg and "matmul_efficiency" in msg


@pytest.mark.parametrize("field, value", [("hbm_bandwidth", 0), ("peak_flops_bf16", -1e12),
                                          ("intra_node_latency", 0.0), ("memory_capacity", -80e9),
                                          ("matmul_efficiency", 1.5), ("memory_efficiency", 0),
                                          ("inter_node_bandwidth", float("inf")), ("memory_capacity", 1.5)])
def test_with_overrides_bad_values(field, value):
    with pytest.raises(ValueError) as info:
        get_device("H100").with_overrides(**{field: value})
    assert field in str(info.value) and "pass e.g." in str(info.value)


@pytest.mark.parametrize("value", ["fast", True, None])
def test_with_overrides_bad_types(value):
    with pytest.raises(TypeError, match="hbm_bandwidth"):
        get_device("H100").with_overrides(hbm_bandwidth=value)


def test_from_dict_rejects_unknown_and_missing():
    d = get_device("H100").to_dict()
    with pytest.raises(ValueError, match="'speed'"):
        DeviceSpec.from_dict({**d, "speed": 1})
    del d["hbm_bandwidth"]
    with pytest.raises(ValueError, match="hbm_bandwidth"):
        DeviceSpec.from_dict(d)


# -- op_time ---------------------------------------------------------------------------------------------------

# A made-up device so the expected times below do not depend on the table's choices.
TOY = DeviceSpec(name="toy", peak_flops_bf16=100e12, peak_flops_tf32=50e12, peak_flops_fp32=10e12,
                 hbm_bandwidth=1e12, memory_capacity=10**10, intra_node_bandwidth=100e9, inter_node_bandwidth=10e9,
                 intra_node_latency=1e-6, inter_node_latency=1e-5, kernel_launch_floor=1e-6,
                 matmul_efficiency=0.5, memory_efficiency=0.8, source="test")


def test_op_time_compute_bound_matmul():
    n = 8192  # bf16 [n, n] @ [n, n]
    cost = OpCost(flops=2.0 * n**3, transcendentals=0.0, bytes_accessed=3.0 * n * n * 2, output_bytes=n * n * 2.0)
    # compute 1.0995e12 / (100e12 * 0.5) = 21.99 ms; memory 4.03e8 / 0.8e12 = 0.50 ms; + 1 us floor
    assert op_time(cost, TOY) == pytest.approx(21.990233e-3 + 1e-6, rel=1e-6)
    # Same cost on the table's H100 at its own efficiencies: still compute-bound.
    h100 = get_device("H100")
    t = op_time(cost, h100)
    assert t == pytest.approx(2.0 * n**3 / (989e12 * h100.matmul_efficiency) + h100.kernel_launch_floor, rel=1e-9)
    assert t > 3.0 * n * n * 2 / (h100.hbm_bandwidth * h100.memory_efficiency)


def test_op_time_memory_bound_elementwise():
    n = 2**26  # bf16 a + b
    cost = OpCost(flops=float(n), transcendentals=0.0, bytes_accessed=3.0 * n * 2, output_bytes=2.0 * n)
    # memory 402,653,184 B / (1e12 * 0.8) = 503.316 us  >>  compute 6.7e7 / 50e12 = 1.34 us
    assert op_time(cost, TOY) == pytest.approx(503.31648e-6 + 1e-6, rel=1e-6)


def test_op_time_transcendentals_dtype_and_floor():
    exp = OpCost(flops=0.0, transcendentals=2.0**20, bytes_accessed=0.0, output_bytes=0.0)
    # 16 fp32 FLOPs each: 2^20 * 16 / (10e12 * 0.5) = 3.3554 us
    assert op_time(exp, TOY) == pytest.approx(3.3554432e-6 + 1e-6, rel=1e-6)
    mm = OpCost(flops=1e12, transcendentals=0.0, bytes_accessed=0.0, output_bytes=0.0)
    assert op_time(mm, TOY, "float32") == pytest.approx(1e12 / 5e12 + 1e-6)
    assert op_time(mm, TOY, "tf32") == pytest.approx(1e12 / 25e12 + 1e-6)
    assert op_time(mm, TOY, jnp.bfloat16) == op_time(mm, TOY, "bfloat16") == op_time(mm, TOY, "float16")
    assert op_time(OpCost(0.0, 0.0, 0.0, 0.0), TOY) == 1e-6
    assert op_time(mm, "H100") == op_time(mm, get_device("H100"))
    with pytest.raises(ValueError, match="float64"):
        op_time(mm, TOY, "float64")
    with pytest.raises(TypeError, match="OpCost"):
        op_time((1e12, 0, 0, 0), TOY)
    with pytest.raises(ValueError, match="flops"):
        op_time(OpCost(-1.0, 0.0, 0.0, 0.0), TOY)


def test_op_time_from_traced_matmul():
    a = jnp.zeros((4096, 4096), jnp.bfloat16)
    (eqn,) = jax.make_jaxpr(jnp.matmul)(a, a).jaxpr.eqns
    cost = eqn_cost(eqn)
    assert cost.flops == 2 * 4096**3
    assert op_time(cost, TOY) == pytest.approx(2 * 4096**3 / 50e12 + 1e-6, rel=1e-6)


# -- collective_time -------------------------------------------------------------------------------------------

TOY_CLUSTER = Cluster(num_nodes=2, devices_per_node=8, device=TOY)  # NVLink 100 GB/s, 1 us; network 10 GB/s, 10 us


@pytest.mark.parametrize("kind, n, spans, expected", [
    ("all-reduce", 8, False, 2 * 7 / 8 * 1e9 / 100e9 + 14 * 1e-6),  # 17.514 ms
    ("all-reduce", 16, True, 2 * 15 / 16 * 1e9 / 10e9 + 30 * 1e-5),  # 187.8 ms
    ("all-gather", 8, False, 7 / 8 * 1e9 / 100e9 + 7 * 1e-6),
    ("reduce-scatter", 16, True, 15 / 16 * 1e9 / 10e9 + 15 * 1e-5),
    ("send-recv", 2, False, 1e9 / 100e9 + 1e-6),
    ("send-recv", 2, True, 1e9 / 10e9 + 1e-5),
    ("all-reduce", 1, False, 0.0),
    ("all-gather", 1, True, 0.0),
])
def test_collective_time_hand_computed(kind, n, spans, expected):
    assert collective_time(kind, 1e9, n, TOY_CLUSTER, spans_nodes=spans) == pytest.approx(expected, rel=1e-9)


def test_collective_time_literals():
    assert collective_time("all-reduce", 1e9, 8, TOY_CLUSTER, spans_nodes=False) == pytest.approx(17.514e-3)
    assert collective_time("all-reduce", 1e9, 16, TOY_CLUSTER, spans_nodes=True) == pytest.approx(187.8e-3)


@pytest.mark.parametrize("kind", COLLECTIVE_KINDS)
def test_across_nodes_slower(kind):
    c = Cluster.parse("2x8xH100")
    n = 2 if kind == "send-recv" else 8
    inside = collective_time(kind, 2**34, n, c, spans_nodes=False)
    across = collective_time(kind, 2**34, n, c, spans_nodes=True)
    assert 0 < inside < across
    # At 16 GiB the bandwidth terms dominate; they differ by the ratio of the achieved link bandwidths:
    # NVLink 450 GB/s and InfiniBand 50 GB/s on H100, each at the bus efficiency NCCL reaches on it.
    dev = c.device
    expected = (dev.intra_node_bandwidth * dev.intra_node_efficiency) / (
        dev.inter_node_bandwidth * dev.inter_node_efficiency)
    assert 5 < expected < 10
    assert across / inside == pytest.approx(expected, rel=0.01)


def test_collective_time_validates():
    with pytest.raises(ValueError) as info:
        collective_time("broadcast", 1e6, 8, TOY_CLUSTER, spans_nodes=False)
    assert "'broadcast'" in str(info.value) and all(k in str(info.value) for k in COLLECTIVE_KINDS)
    assert collective_time("AllReduce", 1e9, 8, TOY_CLUSTER, spans_nodes=False) == \
        collective_time("all_reduce", 1e9, 8, TOY_CLUSTER, spans_nodes=False)
    with pytest.raises(ValueError, match="spans_nodes=True"):
        collective_time("all-reduce", 1e6, 16, TOY_CLUSTER, spans_nodes=False)
    with pytest.raises(ValueError, match="exceeds"):
        collective_time("all-reduce", 1e6, 32, TOY_CLUSTER, spans_nodes=True)
    with pytest.raises(ValueError, match="one node"):
        collective_time("all-reduce", 1e6, 4, Cluster.parse("8xH100"), spans_nodes=True)
    with pytest.raises(ValueError, match="group_size"):
        collective_time("all-reduce", 1e6, 0, TOY_CLUSTER, spans_nodes=False)
    with pytest.raises(ValueError, match="bytes"):
        collective_time("all-reduce", -1, 8, TOY_CLUSTER, spans_nodes=False)
    with pytest.raises(TypeError, match="Cluster"):
        collective_time("all-reduce", 1e6, 8, get_device("H100"), spans_nodes=False)
    assert collective_time("all-reduce", 0, 8, TOY_CLUSTER, spans_nodes=False) == 0.0


def test_float64_has_a_rate_where_the_device_states_one():
    """float64 work is priced at the FP64 rate (a float64 step planned by itself on CPU failed with "no peak rate for
    dtype 'float64'", a user trial); a device without that figure says how to give it one."""
    assert get_device("H100").peak_flops("float64") == 67 * TB
    assert get_device("cpu").peak_flops("float64") == get_device("cpu").peak_flops_fp32 / 2
    toy = DeviceSpec(name="toy", peak_flops_bf16=1e12, peak_flops_tf32=1e12, peak_flops_fp32=1e12, hbm_bandwidth=1e9,
                     memory_capacity=10**9, intra_node_bandwidth=1e9, inter_node_bandwidth=1e9,
                     intra_node_latency=1e-6, inter_node_latency=1e-6, kernel_launch_floor=1e-6)
    with pytest.raises(ValueError, match=r"no peak rate for dtype 'float64'.*with_overrides\(peak_flops_fp64=\.\.\.\)"):
        toy.peak_flops("float64")
    assert toy.with_overrides(peak_flops_fp64=5e11).peak_flops("float64") == 5e11
    with pytest.raises(ValueError, match="peak_flops_fp64 must be a positive number"):
        toy.with_overrides(peak_flops_fp64=-1.0)


@pytest.mark.parametrize("kind, dtype, rate", [
    ("H100", jnp.float8_e4m3fn, 1979 * TB), ("H100", jnp.float8_e5m2, 1979 * TB), ("H100", jnp.int8, 1979 * TB),
    ("A100-80GB", jnp.float8_e4m3fn, 312 * TB),  # no FP8 tensor cores: XLA converts to 16 bits, the bf16 rate
    ("A100-80GB", jnp.int8, 624 * TB), ("cpu", jnp.int8, None)])
def test_low_precision_matmuls_run_at_their_tensor_core_rate(kind, dtype, rate):
    """float8 and int8 matmuls (a trial's fp8 training step and int8 quantized training) were priced at the fp32
    CUDA-core rate, 32x too slow on H100: slower than plain float32, steering the planner away from fp8."""
    m = k = n = 4096
    eqn = jax.make_jaxpr(lambda a, b: jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())),
                                                          preferred_element_type=jnp.float32))(
        jax.ShapeDtypeStruct((m, k), dtype), jax.ShapeDtypeStruct((k, n), dtype)).jaxpr.eqns[0]
    spec = get_device(kind)
    tm = KernelTimeModel.from_device(spec, "float32")
    cost = eqn_cost(eqn)
    assert cost.flops == 2 * m * n * k
    rate = rate or spec.peak_flops_fp32  # a device without integer tensor cores: the fp32 rate
    assert tm.kernel_time("matmul", cost, matmul_dtype(eqn), floor=False) == pytest.approx(
        max(cost.flops / (rate * spec.matmul_efficiency), cost.bytes_accessed / tm.bytes_per_s), rel=1e-9)

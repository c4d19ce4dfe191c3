"""Costs of a traced step: per-op FLOPs and bytes, kernels, layers and their programs, sharding strategies, cost
graph, devices and clusters (``autopp.profiler``)."""

from autopp.profiler._cluster import Cluster
from autopp.profiler._costs import OpCost, aval_bytes, eqn_cost, jaxpr_cost
from autopp.profiler._devices import DEVICE_ALIASES, DEVICE_KINDS, DeviceSpec, get_device
from autopp.profiler._graph import cost_graph, format_layer_table, graph_from_json, graph_to_json
from autopp.profiler._kernels import ATTENTION, ScaledKernel, matmul_dtype, program_kernels
from autopp.profiler._layers import Layer, group_layers, repeated_fingerprints
from autopp.profiler._optstate import optimizer_state_owners
from autopp.profiler._partition import StageSplit, split_at, split_stages
from autopp.profiler._profile import LayerProfile, MovedWork, Profile, profile
from autopp.profiler._strategies import PARTIAL, REPLICATED, LayerProgram, batch_dims, layer_program, spec_name
from autopp.profiler._strategy_graph import OpNode, StrategyGraph, boundary_options, build_graph, output_spec
from autopp.profiler._timemodel import (
    COLLECTIVE_KINDS,
    TRANSCENDENTAL_FP32_FLOPS,
    KernelTimeModel,
    collective_time,
    op_time,
    ring_seconds,
)

__all__ = [name for name in dir() if not name.startswith("_")]

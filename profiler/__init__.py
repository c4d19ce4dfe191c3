"""Costs of a traced step: per-op FLOPs and bytes, layers, cost graph, devices and clusters
(``autopp.profiler``)."""

from autopp.profiler._cluster import Cluster
from autopp.profiler._costs import OpCost, aval_bytes, eqn_cost, jaxpr_cost
from autopp.profiler._graph import cost_graph, format_layer_table, graph_from_json, graph_to_json
from autopp.profiler._partition import StageSplit, split_stages
from autopp.profiler._layers import Layer, group_layers, repeated_fingerprints
from autopp.profiler._devices import DEVICE_ALIASES, DEVICE_KINDS, DeviceSpec, get_device
from autopp.profiler._timemodel import COLLECTIVE_KINDS, TRANSCENDENTAL_FP32_FLOPS, collective_time, op_time

__all__ = [
    "COLLECTIVE_KINDS",
    "Cluster",
    "DEVICE_ALIASES",
    "DEVICE_KINDS",
    "DeviceSpec",
    "OpCost",
    "TRANSCENDENTAL_FP32_FLOPS",
    "aval_bytes",
    "collective_time",
    "eqn_cost",
    "get_device",
    "jaxpr_cost",
    "op_time",
    "Layer",
    "Profile",
    "LayerProfile",
    "cost_graph",
    "format_layer_table",
    "graph_from_json",
    "graph_to_json",
    "group_layers",
    "profile",
    "repeated_fingerprints",
    "split_stages",
    "StageSplit",
]

from autopp.profiler._profile import LayerProfile, Profile, profile  # noqa: E402

"""The layers of a forward pass as a cost graph: nodes carry per-layer costs, edges the bytes between layers."""

from __future__ import annotations

from collections.abc import Sequence

import networkx as nx

from autopp.profiler._layers import Layer

__all__ = ["cost_graph", "format_layer_table", "graph_from_json", "graph_to_json"]

_EDGES_KEY = "edges"


def cost_graph(layers: Sequence[Layer]) -> nx.DiGraph:
    """One node per layer (keyed by :attr:`Layer.index`; attributes: :meth:`Layer.to_dict`), one edge
    per data dependency between layers with attribute ``bytes``: the bytes of batch-dependent values
    flowing from the producer to the consumer (from the actual dataflow, so skip connections that
    bypass layers are edges too)."""
    graph = nx.DiGraph()
    for layer in layers:
        graph.add_node(layer.index, **layer.to_dict())
    for layer in layers:
        for src, nbytes in layer.reads_from:
            graph.add_edge(src, layer.index, bytes=int(nbytes))
    return graph


def graph_to_json(graph: nx.DiGraph) -> dict:
    """JSON-serialisable dict (``networkx.node_link_data``, edges under ``"edges"``)."""
    data = nx.node_link_data(graph, edges=_EDGES_KEY)
    return _plain(data)


def graph_from_json(data: dict) -> nx.DiGraph:
    """Inverse of :func:`graph_to_json`."""
    return nx.node_link_graph(data, directed=True, multigraph=False, edges=_EDGES_KEY)


def _plain(x):
    if isinstance(x, dict):
        return {str(k) if not isinstance(k, (str, int, float, bool)) and k is not None else k: _plain(v)
                for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if hasattr(x, "item") and not isinstance(x, (str, bytes)):  # numpy scalars
        return x.item()
    return x


def format_layer_table(layers: Sequence[Layer]) -> str:
    """Aligned text table: layer, name, GFLOP, param MB, activation MB, output MB, fingerprint (8
    hex digits); a totals row at the end. MB = 10^6 bytes; GFLOP = 10^9 forward FLOPs."""
    header = ("layer", "name", "GFLOP", "param MB", "activation MB", "output MB", "fingerprint")
    rows = []
    for layer in layers:
        rows.append((str(layer.index), layer.name, f"{layer.flops / 1e9:.3f}", f"{layer.param_bytes / 1e6:.3f}",
                     f"{layer.activation_bytes / 1e6:.3f}", f"{layer.output_bytes / 1e6:.3f}",
                     layer.fingerprint[:8]))
    rows.append(("total", f"{len(layers)} layers", f"{sum(l.flops for l in layers) / 1e9:.3f}",
                 f"{sum(l.param_bytes for l in layers) / 1e6:.3f}",
                 f"{sum(l.activation_bytes for l in layers) / 1e6:.3f}",
                 f"{sum(l.output_bytes for l in layers) / 1e6:.3f}", ""))
    widths = [max(len(r[c]) for r in [header, *rows]) for c in range(len(header))]
    left = {0, 1, 6}

    def fmt(r):
        return "  ".join(r[c].ljust(widths[c]) if c in left else r[c].rjust(widths[c])
                         for c in range(len(header))).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([fmt(header), rule, *(fmt(r) for r in rows[:-1]), rule, fmt(rows[-1])])

"""One layer as the runtime runs it: the stage the runtime would cut for the layer's equations
(:func:`autopp.core.stage_graphs`, the runtime's one slicing function) and that stage's jitted programs
(:class:`autopp.core.StagePrograms`, built on the one per-stage VJP, :func:`autopp.core.forward_with_vjp`) on one
device. The profiler reads a layer's program, residuals and measured times off these, so that what it costs is what
the runtime executes."""

from __future__ import annotations

from collections.abc import Sequence

import jax
from jax.extend import core as jex_core

from autopp.core import StageGraph, StagePrograms, stage_graphs

__all__ = ["layer_graph", "layer_stage_programs"]


def layer_graph(closed: jex_core.ClosedJaxpr, eqn_ids: Sequence[int], diff_invars: Sequence[bool]) -> StageGraph:
    """The stage of the equations ``eqn_ids`` of ``closed``, as the runtime slices a stage holding exactly them:
    every other equation goes to a stage before (those ahead of the last chosen one; none may read a value the
    chosen ones define) or after it. Its inputs are what the equations read from outside (constants closed over), in
    first-use order; its outputs what later equations or the jaxpr's outputs read."""
    jaxpr = closed.jaxpr
    chosen = sorted(set(int(i) for i in eqn_ids))
    last = chosen[-1] if chosen else -1
    chosen_set = set(chosen)
    before = [i for i in range(last) if i not in chosen_set]
    after = list(range(last + 1, len(jaxpr.eqns)))
    stage_of: dict = {}
    for s, ids in enumerate((before, chosen, after)):
        for i in ids:
            for v in jaxpr.eqns[i].outvars:
                stage_of[v] = s
    out_stage = [2 if isinstance(a, jex_core.Literal) else stage_of.get(a, 2) for a in jaxpr.outvars]
    return stage_graphs(closed, [before, chosen, after], list(diff_invars), out_stage)[1]


def layer_stage_programs(graph: StageGraph, is_param: Sequence[bool], device=None,
                         recompute: str = "none") -> StagePrograms:
    """The runtime's programs of a one-layer stage, laid out on one ``device`` (default: the first local device).
    ``is_param``: per input of ``graph``, whether it is a parameter (its gradient accumulates across microbatches)
    rather than an activation (its cotangent goes to the stage before)."""
    sharding = jax.sharding.SingleDeviceSharding(device or jax.devices()[0])
    is_param = list(is_param)
    n_grads = sum(1 for p, d in zip(is_param, graph.diff_inputs) if p and d)
    n_act_cts = sum(1 for p, d in zip(is_param, graph.diff_inputs) if d and not p)
    return StagePrograms(graph, is_param=is_param, seed_of_output={}, in_shardings=[sharding] * len(graph.inputs),
                         out_shardings_fwd=[sharding] * len(graph.outputs), grad_shardings=[sharding] * n_grads,
                         act_ct_shardings=[sharding] * n_act_cts, residual_sharding=lambda shape, dim=None: sharding,
                         flag_sharding=sharding, recompute=recompute)

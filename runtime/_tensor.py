"""Megatron-style tensor parallelism read off a stage's forward jaxpr.

Walking the equations in order, the rule tracks which activation dimension is split over the ``tensor`` axis:

* a matmul (``dot_general``) of an unsplit activation with a 2-D parameter is *column-parallel*: the parameter's
  output dimension is split, and so is the result's last dimension;
* a matmul whose activation is split on the contracted dimension is *row-parallel*: the parameter's input
  dimension is split and the result is whole (XLA inserts the all-reduce);
* elementwise operations keep the split (a 1-D parameter added along a split dimension, a bias, is split the
  same way); ``reshape`` carries it to the outer factor of a split dimension (hidden -> heads x head_dim) and
  back; ``transpose`` permutes it; ``split``/``slice`` along it keep it when every piece divides, and
  ``concatenate``/``stack`` of pieces split alike keep it (rotary embeddings); a batched
  ``dot_general`` of two activations split on the same batch dimension (attention per head), or of one split
  there and one whole (key/value heads repeated for grouped queries), keeps it on that batch dimension; reductions
  over other dimensions keep it; a column-parallel result whose heads do not divide over the axis (2 key/value
  heads, tensor 4) leaves its weight whole instead, as Megatron-LM replicates such heads;
* any other operation with one result shaped like a split input keeps the split (a nested ``jit`` of a
  ``jnp.where``, a ``custom_jvp`` activation). A result of split values that no rule follows is *unknown*: a
  matmul of an unknown activation with a parameter leaves the parameter whole (rather than guess column-parallel and
  turn every later matmul of the stage the other way round) and makes a whole result.

Only the parameters' specs are returned: XLA's SPMD partitioner derives every other layout, and any choice is
numerically the same computation, so the rule only decides where communication happens (for a GPT block:
``qkv_w``/``fc_w`` column-parallel, ``out_w``/``proj_w`` row-parallel, as Megatron-LM does).
"""

from __future__ import annotations

import math
import warnings

from jax.extend import core as jex_core

from autopp.core import user_stacklevel
from autopp.profiler import aval_bytes

Literal = jex_core.Literal

_ELEMENTWISE = {
    "add", "sub", "mul", "div", "max", "min", "pow", "integer_pow", "neg", "exp", "log", "tanh", "logistic", "sqrt",
    "rsqrt", "erf", "abs", "sign", "select_n", "convert_element_type", "square", "exp2", "log1p", "expm1", "sin",
    "cos", "stop_gradient", "copy", "copy_p", "erf_inv", "clamp", "nextafter", "atan2", "rem",
}
_REDUCE = {"reduce_sum", "reduce_max", "reduce_min", "argmax", "argmin", "reduce_prod"}


def tensor_specs(jaxpr: jex_core.Jaxpr, params, tp: int) -> dict:
    """``{param var: spec}`` (a tuple with ``"tensor"`` at the split dimension, None elsewhere) for the
    parameters (a set of the jaxpr's invars) the rule splits over ``tp`` devices. A layer of stacked parameters
    (a ``lax.scan`` over layers, unrolled in a stage) reads its row, ``w[i]``: the row's split is the stack's, one
    dimension further in."""
    return _walk(jaxpr, params, tp)[0]


WHOLE_WEIGHTS_WARNED = 1 << 20
"""Bytes of weights a tensor group holds whole, per stage, from which an explicit tensor layout is warned about
(when they are also most of the stage's weights): below, small models' tables and norms, as Megatron-LM keeps."""


def whole_weights(stage: int, tp: int, whole: list, weights: list) -> None:
    """Warn where the tensor rule leaves most of a stage's weights whole (``whole``: (name, aval) of those, of
    ``weights``' avals): an embedding table read by a gather is no matmul's weight, so ``layout={"tensor": 2}`` holds
    it on every device of the tensor group (a trial's two tables of 100k and 50k rows: 91.59 MiB per device, as
    without tensor parallelism, where a plan from the planner splits them by columns, 37 MiB)."""
    kept, total = sum(aval_bytes(a) for _, a in whole), sum(aval_bytes(a) for a in weights)
    if kept < WHOLE_WEIGHTS_WARNED or 2 * kept <= total:
        return
    largest = sorted(whole, key=lambda w: -aval_bytes(w[1]))[:3]
    warnings.warn(
        f"autopp.parallelize: tensor={tp} leaves {kept / 2**20:.1f} of stage {stage}'s {total / 2**20:.1f} MiB of "
        f"weights whole on each device of its tensor group ({', '.join(f'{n} {a.str_short()}' for n, a in largest)}"
        f"{', ...' if len(whole) > 3 else ''}): autopp's tensor rule splits the weights of matmuls, and these are "
        "read otherwise (an embedding table by a gather). A plan from the planner splits such tables (autopp."
        "parallelize(step) without counts, or plan_model), and layout={'fsdp': ...} divides every weight.",
        stacklevel=user_stacklevel())


def activation_splits(jaxpr: jex_core.Jaxpr, params, tp: int) -> dict:
    """``{var: dim}``: the activations the rule computes split over ``tp`` devices along ``dim`` (attention's heads,
    the MLP's hidden units), under the parameter layouts :func:`tensor_specs` gives the same jaxpr; the layout the
    values a stage keeps for its backward take (whole, they would be gathered first)."""
    return {v: d for v, d in _walk(jaxpr, params, tp)[1].items() if v.aval.shape[d] % tp == 0}


def _walk(jaxpr: jex_core.Jaxpr, params, tp: int) -> tuple[dict, dict]:
    params = set(params)
    split: dict = {}  # activation var -> dim split over tensor
    rows: dict = {}  # a row of a stacked parameter (or of a row) -> (the parameter, dimensions dropped in front)
    specs: dict = {}
    alias: dict = {}  # a parameter cast to another dtype (or behind stop_gradient) -> the parameter
    spread: dict = {}  # a parameter broadcast to an activation's rank -> (the parameter, its dims' positions)
    lost: set = set()  # values computed from split ones whose split the rules could not follow
    held: set = set()  # heads kept whole (they do not divide) and what is computed from them up to the next matmul
    column_of: dict = {}  # a column-parallel matmul's result -> its weight

    def dim_of(a):
        return None if isinstance(a, Literal) else split.get(a)

    def is_param(a) -> bool:
        return not isinstance(a, Literal) and (a in params or a in rows)

    def decide(p, dim):
        base, off = (p, 0) if p in params else rows.get(p, (None, 0))
        if base is None:
            return None
        dim += off
        if base not in specs and base.aval.shape[dim] % tp == 0:
            spec = [None] * len(base.aval.shape)
            spec[dim] = "tensor"
            specs[base] = tuple(spec)
        spec = specs.get(base)
        return spec if spec is not None and spec[dim] == "tensor" else None

    def row_of(eqn, name, outs, ins) -> bool:
        """``w[i]`` of a stacked parameter: a one-row slice of its leading dimensions, then the squeeze."""
        a = ins[0]
        if not is_param(a):
            return False
        base, off = (a, 0) if a in params else rows[a]
        shape, out = a.aval.shape, outs[0].aval.shape
        if name in ("slice", "dynamic_slice") and len(out) == len(shape) and out[1:] == shape[1:]:
            rows[outs[0]] = (base, off)
            return True
        if name == "squeeze" and tuple(eqn.params["dimensions"]) == (0,) and shape[0] == 1:
            rows[outs[0]] = (base, off + 1)
            return True
        return False

    def visit(eqn, name, outs, ins) -> bool:
        """Record what ``eqn`` splits; True for a matmul with a 2-D parameter (its result is whole unless it
        is column-parallel)."""
        if name in ("convert_element_type", "stop_gradient") and is_param(ins[0]):
            alias[outs[0]] = ins[0]
            return False
        if name in ("slice", "dynamic_slice", "squeeze") and row_of(eqn, name, outs, ins):
            return False
        if name == "broadcast_in_dim" and is_param(ins[0]):
            spread[outs[0]] = (ins[0], tuple(eqn.params["broadcast_dimensions"]))
            return False
        if name == "dot_general":
            (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
            lhs, rhs = ins
            for act, w, ac, wc, ab in ((lhs, rhs, lc, rc, lb), (rhs, lhs, rc, lc, rb)):
                if not is_param(w) or len(w.aval.shape) != 2 or ab:
                    continue
                if act in lost or act in held:  # split unknown, or heads kept whole: the weight stays whole
                    return True
                d = dim_of(act)
                free_w = [i for i in range(2) if i not in wc][0]
                if d is not None and d in ac:  # row-parallel
                    decide(w, wc[list(ac).index(d)])
                elif d is None and decide(w, free_w) is not None:  # column-parallel
                    out_dims = len(outs[0].aval.shape)
                    # result dims: batch, lhs free, rhs free: the weight's free dim is last when it is the rhs
                    split[outs[0]] = out_dims - 1 if w is rhs else len(lb) + 0
                    column_of[outs[0]] = rows.get(w, (w,))[0]  # the parameter (a row: its stack)
                return True
            dl, dr = dim_of(lhs), dim_of(rhs)
            if dl is not None and dl in lb and (dr is None and rhs not in lost or dr in rb and
                                                list(lb).index(dl) == list(rb).index(dr)):
                split[outs[0]] = list(lb).index(dl)  # batch dims lead the result (per head; a whole side repeats)
            elif dr is not None and dr in rb and dl is None and lhs not in lost:
                split[outs[0]] = list(rb).index(dr)
            return False
        if name in _ELEMENTWISE:
            shape = outs[0].aval.shape
            dims = set()
            for a in ins:
                d = dim_of(a)
                if d is not None:
                    dims.add(d - len(a.aval.shape) + len(shape))
            if len(dims) == 1:
                (d,) = dims
                split[outs[0]] = d
                for a in ins:  # a parameter broadcast along the split dimension (a bias)
                    if isinstance(a, Literal):
                        continue
                    if a in spread:
                        param, positions = spread[a]
                        at = d - len(shape) + len(a.aval.shape)
                        if at in positions and param.aval.shape[positions.index(at)] == shape[d]:
                            decide(param, positions.index(at))
                    elif is_param(a):
                        k = d - len(shape) + len(a.aval.shape)
                        if 0 <= k < len(a.aval.shape) and a.aval.shape[k] == shape[d]:
                            decide(a, k)
            return False
        if name == "broadcast_in_dim":
            d = dim_of(ins[0])
            if d is not None:
                split[outs[0]] = eqn.params["broadcast_dimensions"][d]
            return False
        if name == "transpose":
            d = dim_of(ins[0])
            if d is not None:
                split[outs[0]] = list(eqn.params["permutation"]).index(d)
            return False
        if name == "reshape":
            d = dim_of(ins[0])
            if d is not None:
                new = _reshape_dim(ins[0].aval.shape, outs[0].aval.shape, d, tp)
                if new is not None:
                    split[outs[0]] = new
                elif ins[0] in column_of:  # e.g. 2 key/value heads over tensor=4: that weight stays whole
                    specs.pop(column_of.pop(ins[0]), None)
                    del split[ins[0]]
                    held.add(outs[0])
            return False
        if name == "squeeze":
            d = dim_of(ins[0])
            gone = sorted(int(x) % max(1, len(ins[0].aval.shape)) for x in eqn.params["dimensions"])
            if d is not None and d not in gone:
                split[outs[0]] = d - sum(1 for x in gone if x < d)
            return False
        if name in ("concatenate", "stack"):  # along another dimension than the split one, pieces split alike
            dims = {dim_of(a) for a in ins}
            if len(dims) == 1 and None not in dims:
                (d,) = dims
                if name == "stack":  # a new dimension at ``axis``
                    split[outs[0]] = d + (d >= eqn.params["axis"])
                elif d != eqn.params["dimension"]:
                    split[outs[0]] = d
            return False
        if name in ("split", "slice"):
            d = dim_of(ins[0])
            if d is not None:
                for o in outs:
                    if o.aval.shape[d] % tp == 0 and (name == "split" or o.aval.shape[d] == ins[0].aval.shape[d]):
                        split[o] = d
            return False
        if name in _REDUCE:
            d = dim_of(ins[0])
            axes = eqn.params.get("axes", ())
            if d is not None and d not in axes:
                split[outs[0]] = d - sum(1 for a in axes if a < d)
            return False
        # Anything else with one result shaped like a split input (a nested jit of a jnp.where, a custom_jvp
        # activation) keeps the split: the layout is only a choice of where XLA communicates.
        if len(outs) == 1:
            same = {dim_of(a) for a in ins if not isinstance(a, Literal) and a.aval.shape == outs[0].aval.shape}
            same.discard(None)
            if len(same) == 1:
                split[outs[0]] = same.pop()
        return False

    for eqn in jaxpr.eqns:
        outs = eqn.outvars
        ins = [alias.get(a, a) if not isinstance(a, Literal) else a for a in eqn.invars]
        matmul = visit(eqn, eqn.primitive.name, outs, ins)
        # a result of split (or already unknown) values whose split the rules could not follow: unknown, so that
        # no later matmul takes it for whole and splits its weight the wrong way (e.g. wo column-parallel after
        # a rotary embedding the rules do not read, then every later matmul of the stage the other way round)
        if not matmul and not any(o in split for o in outs) and \
                any(not isinstance(a, Literal) and (a in split or a in lost) for a in ins):
            lost.update(outs)
        elif not matmul and not any(o in split for o in outs) and \
                any(not isinstance(a, Literal) and a in held for a in ins):
            # attention over heads kept whole stays whole up to the output projection, which stays whole too
            # (else it would go column-parallel and split the residual stream, turning the MLP the other way round)
            held.update(outs)
    return specs, split


def _reshape_dim(old: tuple, new: tuple, d: int, tp: int) -> int | None:
    """Where split dim ``d`` of ``old`` lands in ``new``: the same prefix size, and the split factor's multiple."""
    before = math.prod(old[:d])
    size = old[d]
    acc = 1
    for i, n in enumerate(new):
        if acc == before:
            # dims i.. of new cover old[d] (a split into factors, or a merge starting at d)
            if n % tp == 0 and (size % n == 0 or n % size == 0):
                return i
            return None
        acc *= n
        if acc > before:
            return None
    return None

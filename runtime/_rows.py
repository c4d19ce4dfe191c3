"""Stacked parameters held by rows: each pipeline stage keeps only the rows of a ``lax.scan``'s stacked weights that
its iterations read, with their gradient and optimizer state, and runs their update.

A model written with ``lax.scan`` over stacked layers (MaxText, Flax ``nn.scan``, Equinox) traces to a forward whose
iteration ``r`` reads row ``r`` of each stacked parameter (``slice`` of that row, then ``squeeze``); the stage split
gives each stage a contiguous range of iterations. :func:`hold_by_rows` rewrites the traced step so that each such
parameter is one input *per stage* (a block of rows) instead of one input read by every stage:

* the forward's row reads read their block (the loss's forward, at the whole batch and at the microbatch size);
* the gradient equation differentiates the blocks, so each stage's gradient (and accumulator) is its block's;
* the step's other equations (the optimizer) run per block where they act row by row: element-wise equations on
  blocks, reductions over the row axis as per-block partial reductions and one combine (a global norm), and the
  optimizer state read together with a block (Adam's moments) becomes blocks of its own; any other equation reads
  the blocks concatenated (correct, and on one stage);
* a step output made of blocks (the new parameters and moments) is one array again, sharded by rows over the
  stages' devices without a copy, and such an array given back to the next step is read block by block in place.

Nothing else in the runtime knows: it sees a step whose parameters each belong to one stage. The rewrite applies
when every stage that holds a block has a mesh of the same shape that keeps parameters replicated (no tensor, FSDP
or ZeRO-1 split) and the blocks are equally long, so that one row-sharded array holds them all.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import numpy as np
from jax import lax
from jax.extend import core as jex_core
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from autopp.core import TracedStep, bind_eqn, read_rows, row_slice, value_and_grad_p
from autopp.runtime._tasks import Program, Transfer, delete_unless_shared, on_host, sds

Literal = jex_core.Literal

ELEMENTWISE = frozenset({
    "add", "add_any", "sub", "mul", "div", "rem", "max", "min", "neg", "abs", "sign", "floor", "ceil", "round",
    "sqrt", "rsqrt", "cbrt", "exp", "exp2", "log", "log1p", "expm1", "tanh", "logistic", "sin", "cos", "erf",
    "integer_pow", "pow", "square", "convert_element_type", "select_n", "clamp", "eq", "ne", "lt", "le", "gt", "ge",
    "and", "or", "not", "xor", "is_finite", "copy", "copy_p", "reduce_precision", "nextafter", "stop_gradient",
    "atan2", "reciprocal"})
"""Equations that act element by element: on blocks of rows they run block by block."""

COMBINE = {"reduce_sum": lax.add, "reduce_max": lax.max, "reduce_min": lax.min, "reduce_and": lax.bitwise_and,
           "reduce_or": lax.bitwise_or}
"""Reductions and how partial results over blocks combine when the row axis is among the reduced ones."""


@dataclasses.dataclass(frozen=True)
class RowsLayout:
    """Where a step's stacked values are held by rows: what the runtime reads to map the user's arrays to blocks."""

    traced: TracedStep
    """The step over blocks: each stacked input (parameter, optimizer state) replaced by its blocks, in place."""
    forward: jex_core.ClosedJaxpr
    """The loss's forward at microbatch size over blocks (the equations keep their positions)."""
    inputs: tuple[tuple[int, tuple[int, int] | None], ...]
    """Per input of :attr:`traced`: (the user's flat input, its rows ``(start, stop)`` or None for all of it)."""
    outputs: tuple[tuple[int, ...], ...]
    """Per flat output of the user's step: the outputs of :attr:`traced` that make it (one, or one per block)."""
    input_layouts: dict
    """Per user's flat input held by rows: its layout, ``(stages, rows)``: the stage that holds each block and the
    block's rows, in row order."""
    output_layouts: dict
    """Per user's flat output made of blocks: its layout."""
    forward_split: dict
    """The positions (among the loss's inputs, before the rewrite) of the parameters held by rows: their blocks."""

    def forward_position(self, k: int) -> int | None:
        """Where the loss's input ``k`` is after the rewrite (None: it became blocks)."""
        if k in self.forward_split:
            return None
        return k + sum(n - 1 for j, n in self.forward_split.items() if j < k)

    def donated(self, user_donated) -> frozenset[int]:
        """The inputs of :attr:`traced` donated when the user's flat inputs ``user_donated`` are."""
        return frozenset(i for i, (k, _) in enumerate(self.inputs) if k in user_donated)


class _Blocks:
    """A value of the interpreted step held as blocks: ``layout`` is ``(stages, rows)``."""

    def __init__(self, parts, layout):
        self.parts, self.layout = list(parts), layout


# -- where the forward reads stacked rows ------------------------------------------------------------------
def _uses(jaxpr: jex_core.Jaxpr) -> dict:
    """Per variable: the (equation, operand position) pairs that read it."""
    uses: dict = {}
    for i, e in enumerate(jaxpr.eqns):
        for pos, a in enumerate(e.invars):
            if not isinstance(a, Literal):
                uses.setdefault(a, []).append((i, pos))
    return uses


def _row_reads(forward: jex_core.Jaxpr, k: int, stage_of: dict[int, int] | None, uses: dict):
    """Per use of forward input ``k``: (equation, row, stage) when every use is one row's slice (a scan iteration's
    header); None otherwise; ``"cut"`` when one of them is on two stages (a stage boundary inside an iteration)."""
    v = forward.invars[k]
    if v in forward.outvars or v not in uses:
        return None
    reads, cut = [], False
    for i, pos in uses[v]:
        row = row_slice(forward.eqns[i]) if pos == 0 else None
        if row is None:
            return None
        cut = cut or (stage_of is not None and i not in stage_of)
        reads.append((i, row, stage_of.get(i) if stage_of is not None else None))
    return "cut" if cut else reads


def _unequal(reads, length: int, row_stages: dict, plan_stage: Sequence[int] | None = None) -> str:
    """Why a stack read by several stages in unequal blocks stays whole (``row_stages``: (length, row) -> the stages
    reading that row of any stack of the scan), counted by the plan's stages (``plan_stage``: each segment's)."""
    named = (lambda s: s) if plan_stage is None else (lambda s: plan_stage[s])
    counts = [sum(1 for _, _, s in reads if named(s) == st) for st in sorted({named(s) for _, _, s in reads})]
    pieces = [sum(1 for _, _, s in reads if s == seg) for seg in sorted({s for _, _, s in reads})]
    if len(pieces) > len(counts):  # a stage cut into segments around its scanned iterations reads them in pieces
        counts = (f"{counts} by stage, {pieces} by the segments the stages are cut into around the iterations that "
                  "read its rows (a scan's, or a Python loop's over p[i])")
    split = [row for row in range(length) if len({named(s) for s in row_stages.get((length, row), ())}) > 1]
    inside = (f"; the stage split puts a boundary inside iteration {split[0]}, whose parameters are read on stages "
              f"{sorted({named(s) for s in row_stages[(length, split[0])]})}") if split else ""
    return (f"the stages read unequal numbers of the stack's {length} rows ({counts}{inside}); stages that read "
            "equally many of its rows hold it by rows")


def _blocks_of(reads, length: int):
    """(stages, rows) of contiguous, equally long row ranges, one per stage in row order (a reversed scan's stages
    run them backwards); None otherwise."""
    by_stage: dict[int, set] = {}
    for _, row, s in reads:
        by_stage.setdefault(s, set()).add(row)
    stages = sorted(by_stage, key=lambda s: min(by_stage[s]))
    rows, start = [], 0
    for s in stages:
        got = sorted(by_stage[s])
        if got != list(range(start, start + len(got))):
            return None
        rows.append((start, start + len(got)))
        start += len(got)
    sizes = {b - a for a, b in rows}
    if start != length or len(sizes) != 1:
        return None
    return tuple(stages), tuple(rows)


# -- the step outside the loss, block by block -------------------------------------------------------------
def _bind(e, ins):
    out = bind_eqn(e, ins)
    return list(out) if e.primitive.multiple_results else [out]


def _whole(x):
    return lax.concatenate(x.parts, 0) if isinstance(x, _Blocks) else x


def _apply(e, ins):
    """Equation ``e`` on ``ins`` (some held as blocks): block by block where it acts row by row, else on the
    blocks concatenated. Whole operands read together with blocks are sliced."""
    blocks = [x for x in ins if isinstance(x, _Blocks)]
    if not blocks:
        return _bind(e, ins)
    layout = blocks[0].layout
    rows = layout[1]
    shape = tuple(e.outvars[0].aval.shape) if e.outvars else None
    name = e.primitive.name
    if name in ELEMENTWISE and all(x.layout == layout for x in blocks) and len(e.outvars) == 1:
        per, ok = [], True
        for a, x in zip(e.invars, ins):
            if isinstance(x, _Blocks):
                per.append(x.parts)
            elif np.ndim(x) == 0:
                per.append([x] * len(rows))
            elif tuple(np.shape(x)) == shape:
                per.append([lax.slice_in_dim(x, lo, hi, axis=0) for lo, hi in rows])
            else:
                ok = False
                break
        if ok:
            return [_Blocks([_bind(e, list(args))[0] for args in zip(*per)], layout)]
    if name in COMBINE and len(ins) == 1:
        axes = tuple(e.params["axes"])
        parts = [_bind(e, [p])[0] for p in ins[0].parts]
        if 0 in axes:
            return [functools.reduce(COMBINE[name], parts)]
        return [_Blocks(parts, layout)]
    return _bind(e, [_whole(x) for x in ins])


def _interpret(traced: TracedStep, spec, split_in: dict[int, tuple], grad_split: dict[int, tuple]):
    """The step with the inputs ``split_in`` (outer input index -> layout) given as blocks and the gradient equation
    over ``spec`` (whose forward takes the blocks of the gradient inputs ``grad_split``, positions -> layout): its
    closed jaxpr and, per outer output, the layout it comes out in (or None)."""
    closed = traced.jaxpr
    j = closed.jaxpr
    in_avals = []
    for k, v in enumerate(j.invars):
        rows = split_in[k][1] if k in split_in else [None]
        in_avals += [jax.ShapeDtypeStruct(tuple(v.aval.shape) if r is None else (r[1] - r[0],) + tuple(v.aval.shape[1:]),
                                          v.aval.dtype, weak_type=v.aval.weak_type) for r in rows]
    out_layouts: list = []

    def fn(*flat):
        env, it = dict(zip(j.constvars, closed.consts)), iter(flat)
        for k, v in enumerate(j.invars):
            env[v] = _Blocks([next(it) for _ in split_in[k][1]], split_in[k]) if k in split_in else next(it)

        def read(a):
            return a.val if isinstance(a, Literal) else env[a]

        for i, e in enumerate(j.eqns):
            ins = [read(a) for a in e.invars]
            if i == traced.grad_index:
                flat_ins = []
                for pos, x in enumerate(ins):
                    if pos in grad_split:
                        flat_ins += x.parts if isinstance(x, _Blocks) else \
                            [lax.slice_in_dim(x, lo, hi, axis=0) for lo, hi in grad_split[pos][1]]
                    else:
                        flat_ins.append(_whole(x))
                res = iter(value_and_grad_p.bind(*flat_ins, spec=spec))
                outs = [next(res) for _ in range(1 + spec.num_aux)]
                for pos in traced.spec.diff_indices:
                    outs.append(_Blocks([next(res) for _ in grad_split[pos][1]], grad_split[pos])
                                if pos in grad_split else next(res))
            else:
                outs = _apply(e, ins)
            env.update(zip(e.outvars, outs))
        flat_out = []
        out_layouts.clear()
        for a in j.outvars:
            x = read(a)
            out_layouts.append(x.layout if isinstance(x, _Blocks) else None)
            flat_out += x.parts if isinstance(x, _Blocks) else [x]
        return flat_out

    return jax.make_jaxpr(fn)(*in_avals), out_layouts


def _sliced(traced: TracedStep, split_in: dict[int, tuple], grad_split: dict[int, tuple]) -> dict:
    """The whole values :func:`_interpret` slices to meet blocks, with the blocks' layout, found without tracing (its
    element-wise and reduction rules on which values are blocks)."""
    j, spec = traced.jaxpr.jaxpr, traced.spec
    layout_of = {v: split_in[k] for k, v in enumerate(j.invars) if k in split_in}
    grads = traced.grad_eqn.outvars[1 + spec.num_aux:]
    layout_of.update({g: grad_split[k] for k, g in zip(spec.diff_indices, grads) if k in grad_split})
    sliced: dict = {}
    for i, e in enumerate(j.eqns):
        ins = [a for a in e.invars if not isinstance(a, Literal)]
        layouts = {layout_of[a] for a in ins if a in layout_of}
        if i == traced.grad_index or len(layouts) != 1:
            continue
        (layout,) = layouts
        name, shape = e.primitive.name, tuple(e.outvars[0].aval.shape) if e.outvars else None
        if name in ELEMENTWISE and len(e.outvars) == 1:
            whole = [a for a in ins if a not in layout_of and a.aval.shape]
            if all(tuple(a.aval.shape) == shape for a in whole):
                sliced.update({a: layout for a in whole})
                layout_of[e.outvars[0]] = layout
        elif name in COMBINE and 0 not in tuple(e.params["axes"]):
            layout_of[e.outvars[0]] = layout
    return sliced


def _sources(traced: TracedStep, sliced: dict) -> dict[int, tuple]:
    """The step inputs the sliced whole values come from through element-wise equations (optimizer state read with a
    block: Adam's moments), to hold by rows as well, with their layout (not the loss's inputs: a parameter held
    whole stays whole)."""
    j = traced.jaxpr.jaxpr
    producer = {v: i for i, e in enumerate(j.eqns) for v in e.outvars}
    loss_inputs = {a for a in traced.grad_eqn.invars if not isinstance(a, Literal)}
    index = {v: k for k, v in enumerate(j.invars) if v not in loss_inputs}
    found: dict[int, tuple] = {}
    stack, seen = list(sliced.items()), set()
    while stack:
        v, layout = stack.pop()
        if v in seen:
            continue
        seen.add(v)
        if v in index:
            k = index[v]
            if not traced.batch_mask[k] and v.aval.shape and v.aval.shape[0] == layout[1][-1][1]:
                found.setdefault(k, layout)
        elif v in producer and producer[v] != traced.grad_index:
            e = j.eqns[producer[v]]
            if e.primitive.name in ELEMENTWISE:
                stack += [(a, layout) for a in e.invars if not isinstance(a, Literal) and a.aval.shape]
    return found


# -- the rewrite -------------------------------------------------------------------------------------------
def hold_by_rows(traced: TracedStep, forward: jex_core.ClosedJaxpr, stage_eqns: Sequence[Sequence[int]],
                 can_hold=lambda stages: None, refuse: str | None = None,
                 report: list | None = None, plan_stage: Sequence[int] | None = None) -> RowsLayout | None:
    """The step rewritten to hold its stacked parameters by rows (see the module docstring), for the stage split
    ``stage_eqns`` (each stage's equations of ``forward``, the loss's forward at microbatch size); None when no
    parameter qualifies. ``can_hold(stages)``: None when one array can be sharded by rows over those stages' devices,
    else why not. ``refuse``: hold none, for this reason. ``report``: gets ``(leaf path, reason)`` for each stacked
    parameter read by several stages that stays whole; ``plan_stage``: the plan's stage of each of ``stage_eqns``'
    (segments of a stage cut around its scanned iterations), which reasons name."""
    spec, grad = traced.spec, traced.grad_eqn
    outer = traced.jaxpr.jaxpr
    if not any(row_slice(e) is not None for e in forward.jaxpr.eqns):  # no scan over stacked inputs
        return None
    stage_of: dict[int, int] = {}
    for s, ids in enumerate(stage_eqns):
        for i in ids:
            stage_of[i] = -1 if i in stage_of else s  # an equation on two stages is no block's
    stage_of = {i: s for i, s in stage_of.items() if s >= 0}
    grad_split: dict[int, tuple] = {}
    split_in: dict[int, tuple] = {}
    mb = traced.microbatched_grad_inputs
    outer_index = {v: k for k, v in enumerate(outer.invars)}
    uses, whole_uses = _uses(forward.jaxpr), _uses(spec.forward.jaxpr)
    all_reads = {k: _row_reads(forward.jaxpr, k, stage_of, uses) for k in spec.diff_indices}
    row_stages: dict[tuple, set] = {}  # (stack length, row) -> the stages reading that row of any stack
    for k, reads in all_reads.items():
        for _, row, st in (reads if isinstance(reads, list) else ()):
            row_stages.setdefault((forward.jaxpr.invars[k].aval.shape[0], row), set()).add(st)
    for k in spec.diff_indices:
        a = grad.invars[k]
        if mb[k] or isinstance(a, Literal) or a not in outer_index or sum(b is a for b in grad.invars) != 1:
            continue
        reads = all_reads[k]
        if not reads or _row_reads(spec.forward.jaxpr, k, None, whole_uses) is None:
            continue
        if reads != "cut" and len({st for _, _, st in reads}) < 2:
            continue  # one stage reads all of it: it holds it anyway
        length = forward.jaxpr.invars[k].aval.shape[0]
        layout = None if reads == "cut" else _blocks_of(reads, length)
        why = refuse or ("a stage boundary falls inside the work on one of its rows (a scan's iteration, a Python "
                         "loop's p[i])" if reads == "cut" else
                         _unequal(reads, length, row_stages, plan_stage) if layout is None else can_hold(layout[0]))
        if why is not None:
            if report is not None and (reads == "cut" or len({row for _, row, _ in reads}) == len(reads)):
                report.append((traced.leaf_paths[outer_index[a]], why))  # (a row read twice: no scan's stack but a
            continue  # vector of per-task values, s[t], held whole without a word)
        grad_split[k] = layout
        split_in[outer_index[a]] = layout
    if not grad_split:
        return None
    mb_forward = read_rows(forward, {k: lay[1] for k, lay in grad_split.items()})
    mask = []
    for k, d in enumerate(spec.diff_mask):
        mask += [d] * (len(grad_split[k][1]) if k in grad_split else 1)
    new_spec = dataclasses.replace(
        spec, forward=read_rows(spec.forward, {k: lay[1] for k, lay in grad_split.items()}), diff_mask=tuple(mask),
        loss_fn=None, num_lifted=spec.num_lifted + sum(len(lay[1]) - 1 for k, lay in grad_split.items()
                                                      if k < spec.num_lifted))
    for _ in range(8):  # optimizer state read with blocks becomes blocks too, until nothing more is sliced
        more = {k: lay for k, lay in _sources(traced, _sliced(traced, split_in, grad_split)).items()
                if k not in split_in}
        if not more:
            break
        split_in.update(more)
    closed, out_layouts = _interpret(traced, new_spec, split_in, grad_split)
    grad_index = next(i for i, e in enumerate(closed.jaxpr.eqns) if e.primitive is value_and_grad_p)
    inputs, batch_mask, paths = [], [], []
    for k in range(len(outer.invars)):
        for r in (split_in[k][1] if k in split_in else (None,)):
            inputs.append((k, r))
            batch_mask.append(traced.batch_mask[k])
            paths.append(traced.leaf_paths[k] + ("" if r is None else f"[{r[0]}:{r[1]}]"))
    outputs, n = [], 0
    for lay in out_layouts:
        count = len(lay[1]) if lay else 1
        outputs.append(tuple(range(n, n + count)))
        n += count
    # the loss's inputs held by rows are one input per block now: what is said by their positions moves with them
    moved, at = {}, 0
    for k in range(len(spec.diff_mask)):
        moved[k] = tuple(range(at, at + (len(grad_split[k][1]) if k in grad_split else 1)))
        at += len(moved[k])
    step = dataclasses.replace(traced, jaxpr=closed, grad_index=grad_index, batch_mask=tuple(batch_mask),
                               leaf_paths=tuple(paths),
                               shape_batched=tuple(j for k in traced.shape_batched for j in moved[k]),
                               whole_batch_arrays=tuple(j for k in traced.whole_batch_arrays for j in moved[k]))
    return RowsLayout(traced=step, forward=mb_forward, inputs=tuple(inputs), outputs=tuple(outputs),
                      input_layouts=dict(split_in),
                      output_layouts={o: lay for o, lay in enumerate(out_layouts) if lay is not None},
                      forward_split={k: len(lay[1]) for k, lay in grad_split.items()})


# -- the user's arrays and the blocks ----------------------------------------------------------------------
def row_sharding(block_shardings: Sequence[NamedSharding]) -> NamedSharding | None:
    """One sharding that holds a stacked array's blocks by rows over the stages' meshes (each block replicated over
    its stage's mesh, the meshes of one shape); None when there is none."""
    meshes = [s.mesh for s in block_shardings]
    if any(tuple(s.spec) for s in block_shardings) or len({(m.axis_names, m.devices.shape) for m in meshes}) != 1:
        return None
    devs = [d for m in meshes for d in m.devices.flat]
    if len(set(devs)) != len(devs):
        return None
    mesh = Mesh(np.stack([m.devices for m in meshes]), ("rows", *meshes[0].axis_names))
    return NamedSharding(mesh, P("rows"))


def block_reader(sharding: NamedSharding, block_shardings: Sequence[NamedSharding], donated: bool = False):
    """``read(x)``: the blocks of stacked array ``x`` on their stages, its shards taken in place when ``x`` is held by
    rows as ``sharding`` (the previous step's result), else after one transfer to that layout. An ``x`` in host memory
    (the first step's, from ``init``, on the CPU backend) is split on the host and each block put on its stage: JAX's
    on-device split compiles a slicing program per distinct leaf shape (~0.25 s each on 2 cores, measured), and the
    host's blocks need no array assembled from shards. ``donated``: an ``x`` moved to the row layout on its devices is
    then deleted (one in host memory is left to the caller: the blocks may alias it)."""
    n, seen = len(block_shardings), []
    devices = [list(bs.mesh.devices.flat) for bs in block_shardings]
    local = all(bs.is_fully_addressable for bs in block_shardings)

    def read(x):
        got = getattr(x, "sharding", None)
        if not (seen and got is seen[0]):
            if got != sharding:
                if local and on_host(x):
                    arr, rows = np.asarray(x), x.shape[0] // n
                    # (blocks put from a view of x's host buffer may alias it: a donated x is left to the caller)
                    return jax.device_put([arr[k * rows:(k + 1) * rows] for k in range(n)], list(block_shardings))
                moved = jax.device_put(x, sharding)
                if donated:
                    delete_unless_shared(x, [moved])
                x = moved
            else:
                seen[:] = [got]  # outputs of this step carry one sharding object: then one identity test
        by_device = {s.device: s.data for s in x.addressable_shards}
        shape = (x.shape[0] // n,) + tuple(x.shape[1:])
        return [jax.make_array_from_single_device_arrays(shape, bs, [by_device[d] for d in devs])
                for bs, devs in zip(block_shardings, devices)]

    return read


def block_joiner(sharding: NamedSharding, block_shardings: Sequence[NamedSharding]):
    """``join(blocks)``: one array of ``sharding`` (by rows over the stages) from its blocks, without a copy where each
    block is on its stage (an update the rules could not run by rows may leave one elsewhere: it moves)."""
    seen: list = [None] * len(block_shardings)
    order = list(sharding.mesh.devices.flat)

    def join(blocks):
        by_device = {}
        for j, (b, want) in enumerate(zip(blocks, block_shardings)):
            if b.sharding is not seen[j]:
                if b.sharding != want:
                    b = jax.device_put(b, want)
                else:
                    seen[j] = b.sharding
            for s in b.addressable_shards:
                by_device[s.device] = s.data
        shape = (sum(b.shape[0] for b in blocks),) + tuple(blocks[0].shape[1:])
        return jax.make_array_from_single_device_arrays(shape, sharding, [by_device[d] for d in order])

    return join


def lay_out_row_inputs(tasks, input_slots: list, rows: RowsLayout, user_traced: TracedStep,
                       shardings_of, donated=frozenset()) -> list[int]:
    """The slots of the user's flat inputs, and the first tasks of the step: each stacked input into its blocks
    (``input_slots``, the rewritten step's input slots, are pointed at them). ``shardings_of(stages)``: each block's
    sharding; ``donated``: the user's donated flat inputs (a stacked one copied into blocks is deleted, as
    ``jax.jit`` deletes a donated argument). Returns the user's input slots."""
    positions: dict[int, list[int]] = {}
    for pos, (k, _) in enumerate(rows.inputs):
        positions.setdefault(k, []).append(pos)
    user_slots = []
    for k, v in enumerate(user_traced.jaxpr.jaxpr.invars):
        pos = positions[k]
        if k not in rows.input_layouts:
            user_slots.append(input_slots[pos[0]])
            continue
        stages, blocks = rows.input_layouts[k]
        block_shardings = shardings_of(stages)
        slot = tasks.new_slot(sds(v.aval, None))
        block = (blocks[0][1] - blocks[0][0],) + tuple(v.aval.shape[1:])
        fn = Transfer("rows", block_reader(row_sharding(block_shardings), block_shardings, donated=k in donated),
                      tuple(sds(jax.ShapeDtypeStruct(block, v.aval.dtype), sh) for sh in block_shardings))
        for p, out in zip(pos, tasks.emit(fn, [slot], len(pos), f"rows of {user_traced.leaf_paths[k]}")):
            input_slots[p] = out
        user_slots.append(slot)
    return user_slots


def row_outputs(program: Program, rows: RowsLayout, user_slots, shardings_of) -> Program:
    """``program`` (of the rewritten step) taking the user's flat inputs and returning the user's flat outputs: an
    output made of blocks is one array held by rows over the stages."""
    outs = program.outputs

    def joined(ix, stages):
        block_shardings = shardings_of(stages)
        join = block_joiner(row_sharding(block_shardings), block_shardings)
        return lambda env: join([outs[i](env) for i in ix])

    outputs = tuple(joined(ix, rows.output_layouts[o][0]) if o in rows.output_layouts else outs[ix[0]]
                    for o, ix in enumerate(rows.outputs))
    return dataclasses.replace(program, input_slots=tuple(user_slots), outputs=outputs)


__all__ = ["RowsLayout", "block_joiner", "block_reader", "hold_by_rows", "lay_out_row_inputs", "row_outputs",
           "row_sharding"]

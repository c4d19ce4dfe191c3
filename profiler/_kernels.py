"""The kernels a program runs, with per-kernel dtypes, sharding and batch scaling.

:func:`program_kernels` groups a program's equations the way XLA fuses them on a GPU: each matmul is its own
kernel, a fused attention region (``jax.nn.dot_product_attention``) is one flash-attention kernel, and every run
of other equations between two of those is one fused kernel whose memory traffic is what crosses its boundary.
Each kernel's cost is split into a part that scales with the batch (activations) and a part that does not
(parameters), so that a profile traced at one batch size prices any microbatch size; and each equation may be
divided over a tensor-parallel group (its share of the work and of every value it touches, from a sharding
solution).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np
from jax.extend import core as jex_core

from autopp.profiler._costs import REDUCTIONS, OpCost, aval_bytes, eqn_cost

Literal = jex_core.Literal
_ZERO = OpCost(0.0, 0.0, 0.0, 0.0)

MATMUL = "matmul"
FUSED = "fused"
ATTENTION = "attention"

FLASH_BACKWARD_MATMULS = 5.0 / 4.0
"""A flash-attention backward runs five ``s x s`` matmuls where the unfused backward runs four: it recomputes the
scores ``Q K^T`` from the saved log-sum-exp instead of storing them (Dao 2023, FlashAttention-2, Algorithm 2)."""

VIEWS = frozenset({"broadcast_in_dim", "reshape", "squeeze", "expand_dims", "transpose", "convert_element_type"})
"""Parameter-only operations XLA fuses into the kernel that reads their result (it reads the operand instead)."""

EPILOGUE = frozenset({
    "convert_element_type", "transpose", "reshape", "broadcast_in_dim", "add", "add_any", "sub", "mul", "div", "max",
    "min", "neg", "tanh", "logistic", "exp", "erf", "integer_pow", "square", "select_n", "copy",
})
"""Element-wise operations a matmul kernel applies to its result on the way out (bias, activation, scale, cast,
layout, accumulation)."""

CAUSAL_WORK = 0.5
"""Fraction of the ``s x s`` blocks a causal flash-attention kernel computes: the blocks above the diagonal are
skipped (Dao 2023, section 3.1.1), so a causal kernel does about half the matmul work of the full one."""


FLASH_BLOCK = 128
"""Query and key block edge of a flash-attention kernel: FlashAttention-2 computes the scores in 128 x 128 blocks
at head dims 64-128 on A100/H100 (Dao 2023, section 3.1, and its kernels' tile sizes); a block with any score
inside a sliding window is computed whole, one with none is skipped."""


def attention_work(causal: bool, window: tuple[int, int] | None = None, q_len: int = 0, k_len: int = 0) -> float:
    """Fraction of the ``s x s`` score blocks a flash-attention kernel computes: :data:`CAUSAL_WORK` for a causal
    call, 1 for a full one, and for a sliding window (query ``i`` sees keys ``i - left`` to ``i + right``, and none
    after ``i`` when causal) the share of :data:`FLASH_BLOCK`-square blocks that hold a visible score."""
    if window is None or q_len <= 0 or k_len <= 0:
        return CAUSAL_WORK if causal else 1.0
    left, right = window
    b = FLASH_BLOCK
    nq, nk = -(-q_len // b), -(-k_len // b)
    touched = 0
    for a in range(nq):
        first, last = a * b, min(q_len, (a + 1) * b) - 1  # the block's queries
        lo, hi = max(0, first - left), min(k_len - 1, last + right)
        if causal:
            hi = min(hi, last)
        if hi >= lo:
            touched += hi // b - lo // b + 1
    return touched / (nq * nk)


@dataclasses.dataclass(frozen=True)
class ScaledKernel:
    """One kernel: its cost at the traced batch, split into a batch-proportional part and a fixed part."""

    kind: str
    """``matmul``, ``fused`` or ``attention``."""
    dtype: str | None
    """Operand dtype that sets a matmul's or attention kernel's peak (``bfloat16``, ``float16``, ``tf32``,
    ``float32``); None for fused elementwise kernels."""
    batch: OpCost
    """Cost that scales with the batch size."""
    fixed: OpCost = _ZERO
    """Cost that does not (e.g. reading a weight)."""
    work: float = 1.0
    """Executed FLOPs per counted FLOP (flash attention: recomputation and causal block skipping)."""
    per_step: bool = False
    """A kernel of parameter-only equations (casting master weights to the compute dtype, transposing weights):
    the same for every microbatch, so it runs once per step, before the microbatches (as XLA hoists it out of a
    gradient-accumulation loop, and as autopp's runtime runs it per stage and step)."""

    launches: int = 1
    """Kernels this one stands for, each paying the fixed cost of a launch."""
    iterations: int = 1
    """Times it runs per execution of its program: a loop's trip count for its body's kernels (each iteration
    launches them again on devices whose loops launch per iteration, :attr:`DeviceSpec.loop_launches`)."""

    def at(self, scale: float) -> OpCost:
        """The cost at ``scale`` times the traced batch."""
        b, f = self.batch, self.fixed
        return OpCost(b.flops * scale + f.flops, b.transcendentals * scale + f.transcendentals,
                      b.bytes_accessed * scale + f.bytes_accessed, b.output_bytes * scale + f.output_bytes)


def matmul_dtype(eqn) -> str:
    """The peak a matmul runs at: its operands' dtype; float32 operands run as TF32 unless the equation asks for
    ``Precision.HIGHEST`` (XLA's default precision lets cuBLAS use TF32 tensor cores for float32 on Ampere and
    later)."""
    dts = [str(a.aval.dtype) for a in eqn.invars if hasattr(a, "aval")]
    if dts and all(d.startswith("float8") for d in dts):
        return "float8"  # FP8 tensor cores
    if dts and all(d in ("int8", "uint8") for d in dts):
        return "int8"  # integer tensor cores
    widest = max(dts, key=lambda d: np.dtype(d).itemsize if d in ("float16", "bfloat16", "float32", "float64")
                 else 0, default="float32")
    if widest in ("bfloat16", "float16"):
        return widest
    if widest in ("float32", "float64"):
        prec = eqn.params.get("precision")
        text = str(prec).upper() if prec is not None else ""
        return "float32" if "HIGHEST" in text else "tf32"
    return "float32"


def _row_pad(e) -> bool:
    """Whether ``e`` pads along axis 0 only, with zeros (a slice's transpose: a row placed in a stack)."""
    if e.primitive.name != "pad" or not isinstance(e.invars[1], Literal) or e.invars[1].val != 0:
        return False
    config = e.params["padding_config"]
    return all(i == 0 for _, _, i in config) and all(lo == hi == 0 for lo, hi, _ in config[1:])


def program_kernels(jaxpr: jex_core.Jaxpr, eqn_ids: Sequence[int], *, is_batch: Callable[[object], bool],
                    dependent: Callable[[int], bool] | None = None,
                    eqn_share: Callable[[int], float] = lambda i: 1.0,
                    var_share: Callable[[object], float] = lambda v: 1.0,
                    regions: Sequence[tuple[int, ...]] = (), work: Sequence[float] = (),
                    backward_eqns: frozenset[int] = frozenset(),
                    used_after: Callable[[object, int], bool] | None = None) -> list[ScaledKernel]:
    """The kernels of the equations ``eqn_ids`` (in order) of ``jaxpr``.

    ``is_batch(var)``: whether a value's size scales with the batch. ``dependent(i)``: whether equation ``i`` depends
    on the batch (its FLOPs scale; default: it reads a batch-sized value); the others read only parameters and
    constants and form ``per_step`` kernels of their own. ``eqn_share(i)``: the fraction of equation ``i``'s
    work one device does (1/t when split over a tensor group); ``var_share(v)``: the fraction of value ``v`` one
    device holds. ``regions``: groups of equation indices that are one fused attention call each (``work``: the
    fraction of each one's score blocks its kernel computes, :func:`attention_work`; 1 when not given);
    ``backward_eqns`` tells a region's forward part from its backward part.
    ``used_after(v, i)``: whether ``v`` is read after equation ``i`` outside the run (default: by any later
    equation of the jaxpr, or by its outputs).
    """
    ids = list(eqn_ids)
    eqns = jaxpr.eqns
    region_of = {i: r for r, g in enumerate(regions) for i in g}
    work = list(work) + [1.0] * (len(regions) - len(work))
    last_use: dict = {}
    for i, e in enumerate(eqns):
        for a in _reads(e):
            last_use[a] = i
    for a in jaxpr.outvars:
        if not isinstance(a, Literal):
            last_use[a] = len(eqns)
    if used_after is None:
        def used_after(v, i):
            return last_use.get(v, -1) > i

    if dependent is None:
        def dependent(i):
            return any(is_batch(a) for a in _reads(eqns[i]))

    # Values XLA never materialises: constants generated in the kernel that reads them (iota, a broadcast literal,
    # a mask computed from them) and views of parameters (a bias broadcast to the activation's shape): reading one
    # costs what reading its source costs; a slice of a parameter (a scan iteration's row of the stacked weights)
    # costs its own bytes, the part of the source the reading kernel takes.
    source: dict = {}
    producer = {v: e for e in eqns for v in e.outvars}
    for i, e in enumerate(eqns):
        if _row_pad(e) and not is_batch(e.outvars[0]) and not isinstance(e.invars[0], Literal):
            # A row's gradient padded to the whole stack (the transpose of a scan iteration's slice of stacked
            # weights): the scan's backward writes that row in place, so the padded value is the row (and the
            # reshape that gave it its leading axis of 1 is a relabelling).
            row = e.invars[0]
            made = producer.get(row)
            if made is not None and made.primitive.name in ("reshape", "expand_dims", "broadcast_in_dim") and \
                    not isinstance(made.invars[0], Literal) and made.invars[0].aval.size == row.aval.size:
                source[row] = source.get(made.invars[0], made.invars[0])
            source[e.outvars[0]] = source.get(row, row)
            continue
        if dependent(i) or i in region_of:
            continue
        ins = _reads(e)
        if all(a in source and source[a] is None for a in ins):
            for v in e.outvars:
                source[v] = None  # made from literals only: free
        elif e.primitive.name in VIEWS and len(ins) == 1:
            for v in e.outvars:
                source[v] = source.get(ins[0], ins[0])
        elif e.primitive.name == "slice" and len(ins) == 1:  # a row of stacked weights: reading it reads that row
            for v in e.outvars:
                source[v] = v
    views = {i for i, e in enumerate(eqns) if e.outvars and all(v in source for v in e.outvars)}

    def nbytes(v) -> tuple[float, float]:
        if v in source:
            v = source[v]
            if v is None:
                return (0.0, 0.0)
        b = aval_bytes(v.aval) * var_share(v)
        return (b, 0.0) if is_batch(v) else (0.0, b)

    kernels: list[ScaledKernel] = []
    run: list[int] = []

    def cost_pair(i, e) -> tuple[OpCost, OpCost]:
        c = eqn_cost(e)
        share = eqn_share(i)
        scaled = OpCost(c.flops * share, c.transcendentals * share, 0.0, 0.0)
        return (scaled, _ZERO) if dependent(i) else (_ZERO, scaled)

    ids = [i for i in ids if i not in views]
    # parameter-only equations: their own kernels, once per step
    hoisted = [i for i in ids if not dependent(i) and i not in region_of]
    hoisted_set = set(hoisted)
    if hoisted:
        # Element-wise chains fuse (an optimizer update reads each parameter, gradient and moment once and writes
        # each result once); a value that needs a finished reduction (clipping's global norm) starts a new kernel,
        # since no kernel waits for a reduction over the whole grid that it is still computing.
        for group in _reduction_bounded(hoisted, eqns):
            fixed = [0.0, 0.0, 0.0, 0.0]
            for i in group:
                c = eqn_cost(eqns[i])
                share = eqn_share(i)
                fixed[0] += c.flops * share
                fixed[1] += c.transcendentals * share
            inside: set = set()
            read: set = set()
            for i in group:
                for a in _reads(eqns[i]):
                    if a not in inside and a not in read:
                        read.add(a)
                        fixed[2] += sum(nbytes(a))
                inside.update(eqns[i].outvars)
            members = set(group)
            read_outside = {a for j in range(group[0], group[-1] + 1) if j not in members for a in _reads(eqns[j])}
            for i in group:
                for v in eqns[i].outvars:
                    if used_after(v, group[-1]) or v in read_outside:
                        fixed[2] += sum(nbytes(v))
                        fixed[3] += sum(nbytes(v))
            kernels.append(ScaledKernel(FUSED, None, _ZERO, OpCost(*fixed), per_step=True))
    ids = [i for i in ids if i not in hoisted_set]

    def add_traffic(members, inside: set, b: list, f: list) -> None:
        """Add to ``b``/``f`` (batch and fixed [flops, transcendentals, bytes accessed, output bytes]) what the fused
        kernel of ``members`` reads from outside (``inside``: values already in the kernel) and writes for later."""
        read = set()
        picked = _only_picked(eqns, members)
        for x in members:
            for a in _reads(eqns[x]):
                if a in picked:  # rows a gather picks (an embedding lookup): their bytes, not the table's
                    if eqns[x].invars[0] is a:
                        for v in eqns[x].outvars:
                            xb, xf = nbytes(v)
                            b[2] += xb
                            f[2] += xf
                elif a not in inside and a not in read:
                    read.add(a)
                    xb, xf = nbytes(a)
                    b[2] += xb
                    f[2] += xf
            inside.update(eqns[x].outvars)
        end = members[-1]
        for x in members:
            for v in eqns[x].outvars:
                if used_after(v, end):
                    xb, xf = nbytes(v)
                    b[2] += xb
                    f[2] += xf
                    b[3] += xb
                    f[3] += xf

    def close_run():
        if not run:
            return
        b, f = [0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]
        for i in run:
            cb, cf = cost_pair(i, eqns[i])
            b[0] += cb.flops
            b[1] += cb.transcendentals
            f[0] += cf.flops
            f[1] += cf.transcendentals
        add_traffic(run, set(), b, f)
        kernels.append(ScaledKernel(FUSED, None, OpCost(*b), OpCost(*f)))
        run.clear()

    # Epilogue fusion: element-wise work that directly consumes a matmul's result (a bias, an activation, a cast, a
    # transpose, an accumulation into a gradient buffer) runs inside the matmul kernel, as cuBLAS epilogues and XLA's
    # GEMM rewriter fuse it: the intermediate never goes to memory, and the kernel is as slow as the slower of its
    # FLOPs and its memory traffic.
    epi: list[int] = []
    chain: set = set()
    host: list = []  # [kernel index, matmul equation index]

    def close_epilogue():
        if not epi:
            return
        k_idx, mm = host
        e_mm = eqns[mm]
        k = kernels[k_idx]
        b, f = list(dataclasses.astuple(k.batch)), list(dataclasses.astuple(k.fixed))
        inside = set(e_mm.outvars)
        end = epi[-1]
        for v in e_mm.outvars:  # the matmul's result is written only if something after the epilogue reads it
            if not any(v in set(_reads(eqns[x])) for x in range(end + 1, len(eqns))) and v not in jaxpr.outvars:
                xb, xf = nbytes(v)
                b[2] -= xb
                f[2] -= xf
                b[3] -= xb
                f[3] -= xf
        add_traffic(epi, inside, b, f)
        kernels[k_idx] = dataclasses.replace(k, batch=OpCost(*b), fixed=OpCost(*f))
        epi.clear()

    def end_epilogue():
        close_epilogue()
        chain.clear()
        host.clear()

    done_regions: set[int] = set()
    for i in ids:
        e = eqns[i]
        if host and not run and e.primitive.name in EPILOGUE and any(a in chain for a in _reads(e)):
            epi.append(i)
            chain.update(e.outvars)
            continue
        if e.primitive.name not in ("dot_general", "conv_general_dilated"):
            end_epilogue()
        r = region_of.get(i)
        if r is not None:
            if r in done_regions:
                continue
            done_regions.add(r)
            close_run()
            part = [x for x in regions[r] if x in set(ids)]
            kernels.append(_attention_kernel(jaxpr, part, regions[r], is_batch, eqn_share, var_share, work[r],
                                             backward=bool(part) and part[0] in backward_eqns))
            continue
        if e.primitive.name in ("dot_general", "conv_general_dilated"):
            end_epilogue()
            close_run()
            cb, cf = cost_pair(i, e)
            io_b = io_f = 0.0
            for a in list(_reads(e)) + list(e.outvars):
                xb, xf = nbytes(a)
                io_b += xb
                io_f += xf
            out_b = sum(nbytes(v)[0] for v in e.outvars)
            out_f = sum(nbytes(v)[1] for v in e.outvars)
            kernels.append(ScaledKernel(MATMUL, matmul_dtype(e), OpCost(cb.flops, 0.0, io_b, out_b),
                                        OpCost(cf.flops, 0.0, io_f, out_f)))
            host[:] = [len(kernels) - 1, i]
            chain.update(e.outvars)
        elif e.primitive.name in ("scan", "while", "cond"):
            close_run()
            kernels.extend(_loop_kernels(e, is_batch, eqn_share(i)))
        else:
            run.append(i)
    end_epilogue()
    close_run()
    return kernels


def _loop_kernels(eqn, is_batch: Callable[[object], bool], share: float) -> list[ScaledKernel]:
    """The kernels a control-flow equation runs: its body's (:func:`program_kernels`), each run once per iteration of
    a ``scan`` (a ``while_loop``'s trip count is unknown: once, as :func:`eqn_cost` counts it; a ``cond``: the
    branch with the most FLOPs), so each pays its launch per iteration where loops launch so and its matmuls run at
    the matmul rate. Inside the body a value scales with the batch where it is computed from one that does and is no
    larger than the iteration's largest such input: a recurrent cell's weight-sized gradient contribution, computed
    from the examples, is read and written whatever their number."""
    name = eqn.primitive.name
    if name == "scan":
        bodies, operands, times = [eqn.params["jaxpr"]], eqn.invars, int(eqn.params["length"])
    elif name == "while":
        n = eqn.params["cond_nconsts"]
        bodies, operands, times = [eqn.params["body_jaxpr"]], eqn.invars[n:], 1
    else:
        bodies, operands, times = list(eqn.params["branches"]), eqn.invars[1:], 1
    options = []
    for closed in bodies:
        body = getattr(closed, "jaxpr", closed)
        scales = {v for v, a in zip(body.invars, operands) if not isinstance(a, Literal) and is_batch(a)}
        cap = max((v.aval.size for v in scales if hasattr(v.aval, "size")), default=0)
        for e in body.eqns:
            if any(a in scales for a in _reads(e)):
                scales.update(v for v in e.outvars if getattr(v.aval, "size", 0) <= cap)
        options.append(program_kernels(body, range(len(body.eqns)), is_batch=scales.__contains__))
    chosen = max(options, key=lambda ks: sum(k.at(1.0).flops for k in ks))
    return [ScaledKernel(k.kind, k.dtype, k.batch.scale(times * share), k.fixed.scale(times * share), k.work,
                         launches=k.launches, iterations=k.iterations * times) for k in chosen]


def _reduction_bounded(ids: Sequence[int], eqns) -> list[list[int]]:
    """``ids`` cut into runs such that no equation reads a reduction (:data:`REDUCTIONS`) made earlier in its own
    run: the kernels XLA can fuse a chain of parameter-only work into."""
    groups: list[list[int]] = [[]]
    reduced: set = set()
    for i in ids:
        e = eqns[i]
        if groups[-1] and any(a in reduced for a in _reads(e)):
            groups.append([])
            reduced = set()
        groups[-1].append(i)
        if e.primitive.name in REDUCTIONS:
            reduced.update(e.outvars)
    return [g for g in groups if g]


def _reads(e):
    return [a for a in e.invars if not isinstance(a, Literal)]


_PICKS = frozenset({"gather", "dynamic_slice"})


def _only_picked(eqns, members) -> set:
    """Values the kernel of ``members`` reads only as the operand a gather or a dynamic slice picks from (an
    embedding table): it reads the rows picked, not the whole value (XLA's cost analysis counts the whole operand)."""
    picked, whole = set(), set()
    for x in members:
        e = eqns[x]
        for k, a in enumerate(_reads(e)):
            (picked if e.primitive.name in _PICKS and k == 0 and e.invars[0] is a else whole).add(a)
    return picked - whole


def _attention_kernel(jaxpr, eqn_ids, region, is_batch, eqn_share, var_share, blocks: float,
                      backward: bool) -> ScaledKernel:
    """One flash-attention kernel for a region's forward (or backward) equations: the matmul FLOPs of that part at
    the operand dtype, memory traffic only for what crosses the whole region (no ``s x s`` tensor; the values the
    unfused backward would read from the forward are recomputed inside the kernel)."""
    eqns = jaxpr.eqns
    inside = set(region)
    flops_b = flops_f = 0.0
    dtype = None
    defined = set()
    for i in region:
        defined.update(eqns[i].outvars)
    for i in eqn_ids:
        e = eqns[i]
        if e.primitive.name == "dot_general":
            c = eqn_cost(e).flops * eqn_share(i)
            if any(is_batch(a) for a in _reads(e)):
                flops_b += c
            else:
                flops_f += c
            d = matmul_dtype(e)
            if dtype is None or d in ("bfloat16", "float16"):
                dtype = d
    reads, writes = set(), set()
    for i in eqn_ids:
        for a in _reads(eqns[i]):
            if a not in defined:
                reads.add(a)
    part_defined = {v for i in eqn_ids for v in eqns[i].outvars}
    users = set()
    for k, e in enumerate(eqns):
        if k not in inside:
            users.update(_reads(e))
    users.update(a for a in jaxpr.outvars if not isinstance(a, Literal))
    writes.update(v for v in part_defined if v in users)
    traffic_b = traffic_f = out_b = 0.0
    for a in reads | writes:
        b = aval_bytes(a.aval) * var_share(a)
        if is_batch(a):
            traffic_b += b
        else:
            traffic_f += b
    for a in writes:
        out_b += aval_bytes(a.aval) * var_share(a)
    work = blocks * (FLASH_BACKWARD_MATMULS if backward else 1.0)
    return ScaledKernel(ATTENTION, dtype or "float32", OpCost(flops_b, 0.0, traffic_b, out_b),
                        OpCost(flops_f, 0.0, traffic_f, 0.0), work=work)

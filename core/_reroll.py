"""Rolling a stage's unrolled ``lax.scan`` iterations back into a scan.

autopp traces a step with ``jax.disable_jit()``, where JAX runs ``lax.scan`` as a Python loop: iteration ``k``
first takes its slice of every scanned input (``slice`` of row ``k`` then ``squeeze``: the iteration's *header*),
then runs the body. A stage that holds several whole iterations therefore holds the same equations several times,
and compiling them unrolled costs time proportional to the iterations. :func:`reroll_scans` finds such runs of
iterations in a stage's jaxpr and writes each back as one ``lax.scan`` over the rows it covers, so XLA compiles the
body once. The result computes the same values: the body is the first iteration's equations, the carry is what
one iteration hands to the next, and values that later equations read from inside the run come out as the scan's
stacked outputs.

A run is rolled only when its data flow is a scan's: every iteration reads the same outside values, the previous
iteration's results (the carry) and its own rows; nothing else. Anything else (an iteration reading one two steps
back, a value of the run that must keep its identity, such as a sharding constraint's target) leaves the run
unrolled, as before.

With ``relative_rows`` a program reads its rows of each stacked input relative to a row base it takes as an int32
argument, instead of at fixed rows: two pipeline stages that run the same iterations at different depths are then
one program, compiled once.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection

import jax
from jax.extend import core as jex_core

from autopp.core import _compat
from autopp.core._jaxpr import eqn_signature, literal_signature

Literal = jex_core.Literal


@dataclasses.dataclass(frozen=True)
class _Header:
    pos: int
    """Index of the header's first equation."""
    length: int
    """Number of equations in the header (two per scanned input)."""
    row: int
    sources: tuple
    """The scanned inputs (stacked variables), in slicing order."""


@dataclasses.dataclass(frozen=True)
class ScanRun:
    """Iterations ``start, start + period, ...`` (``count`` of them) of one scan, found in a jaxpr."""

    start: int
    period: int
    count: int
    first_row: int
    step: int
    """+1 for a forward scan, -1 for ``reverse=True``."""
    header_length: int
    sources: tuple
    consts: tuple
    """Outside variables the body reads (the same in every iteration)."""
    carries: tuple
    """(relative equation, output) of each carried value; its initial value is ``inits[i]``."""
    inits: tuple
    carry_in_slots: dict
    """(relative equation, input position) -> carry index (the slots of the first iteration that read an init)."""
    ys: tuple
    """(relative equation, output) of values read after the run, stacked over the iterations."""

    @property
    def stop(self) -> int:
        return self.start + self.period * self.count

    @property
    def low(self) -> int:
        """The least row the run reads."""
        return self.first_row if self.step == 1 else self.first_row - self.count + 1


def row_slice(eqn):
    """The row ``k`` if ``eqn`` is ``slice`` of one whole row along axis 0 (``index_in_dim``'s first half)."""
    if eqn.primitive.name != "slice" or isinstance(eqn.invars[0], Literal):
        return None
    shape = eqn.invars[0].aval.shape
    start, limit, strides = eqn.params["start_indices"], eqn.params["limit_indices"], eqn.params.get("strides")
    if not shape or strides not in (None, (1,) * len(shape)):
        return None
    if limit[0] != start[0] + 1 or any(s != 0 for s in start[1:]) or tuple(limit[1:]) != tuple(shape[1:]):
        return None
    return start[0]


def _headers(eqns) -> list[_Header]:
    headers, i = [], 0
    while i + 1 < len(eqns):
        row = row_slice(eqns[i])
        nxt = eqns[i + 1]
        if row is None or nxt.primitive.name != "squeeze" or nxt.invars[0] is not eqns[i].outvars[0] \
                or tuple(nxt.params["dimensions"]) != (0,):
            i += 1
            continue
        start, sources = i, []
        while i + 1 < len(eqns) and row_slice(eqns[i]) == row and eqns[i + 1].primitive.name == "squeeze" \
                and eqns[i + 1].invars[0] is eqns[i].outvars[0] and tuple(eqns[i + 1].params["dimensions"]) == (0,):
            sources.append(eqns[i].invars[0])
            i += 2
        headers.append(_Header(start, i - start, row, tuple(sources)))
    return headers


def _block_signature(eqns, start, period, header_length, cache):
    sig = []
    for j in range(start, start + period):
        if j - start < header_length:
            e = eqns[j]
            sig.append(e.primitive.name + str(e.invars[0].aval) + str(e.outvars[0].aval))
            continue
        s = cache.get(j)
        if s is None:  # literal values are compared by _analyse: a literal may be the carry's initial value
            s = cache[j] = eqn_signature(eqns[j], literal_values=False)
        sig.append(s)
    return sig


def _candidates(eqns) -> list[tuple[list[_Header], int]]:
    """Chains of consecutive equal iterations: (headers, period)."""
    headers, cache, chains = _headers(eqns), {}, []
    chain: list[_Header] = []
    for a, b in zip(headers, headers[1:] + [None]):
        ok = False
        if b is not None and b.sources == a.sources and b.length == a.length and abs(b.row - a.row) == 1:
            period = b.pos - a.pos
            if b.pos + period <= len(eqns) and (len(chain) < 2 or (
                    period == a.pos - chain[-2].pos and b.row - a.row == a.row - chain[-2].row)):
                ok = _block_signature(eqns, a.pos, period, a.length, cache) == \
                    _block_signature(eqns, b.pos, period, b.length, cache)
        if ok:
            if not chain:
                chain.append(a)
            chain.append(b)
        else:
            if len(chain) >= 2:
                chains.append((chain, chain[1].pos - chain[0].pos))
            chain = []
    return chains


def _init_key(a):
    return ("literal", literal_signature(a.val)) if isinstance(a, Literal) else ("var", id(a))


def _analyse(eqns, chain: list[_Header], period: int, used_after: set, keep: Collection) -> ScanRun | None:
    """The run's data flow, or None when it is not a scan's."""
    start, count, hl = chain[0].pos, len(chain), chain[0].length
    where = {}  # var -> (block, relative equation, output)
    for b in range(count):
        for r in range(period):
            for o, v in enumerate(eqns[start + b * period + r].outvars):
                where[v] = (b, r, o)
    if any(v in where for v in keep):
        return None
    consts, carries, inits, carry_in = [], [], [], {}
    for r in range(hl, period):
        for slot in range(len(eqns[start + r].invars)):
            kinds = []
            for b in range(count):
                a = eqns[start + b * period + r].invars[slot]
                if isinstance(a, Literal):
                    kinds.append(("literal", literal_signature(a.val), a))
                    continue
                w = where.get(a)
                if w is None:
                    kinds.append(("outside", a))
                elif w[0] == b:
                    kinds.append(("inner", w[1], w[2]))
                elif w[0] == b - 1:
                    kinds.append(("carry", w[1], w[2]))
                else:
                    return None
            first, rest = kinds[0], kinds[1:]
            if first[0] == "literal" and all(k[:2] == first[:2] for k in rest):
                pass
            elif first[0] == "inner":
                if any(k != first for k in rest) or (first[1] < hl and first[1] % 2 == 0):
                    return None  # (an iteration reads its rows through the header's squeeze only)
            elif first[0] == "outside" and all(k == first for k in rest):
                if first[1] not in consts:
                    consts.append(first[1])
            elif first[0] in ("outside", "literal") and all(k[0] == "carry" and k == rest[0] for k in rest):
                key, init = rest[0][1:], first[-1]
                if key[0] < hl:
                    return None
                if key in carries:
                    if _init_key(inits[carries.index(key)]) != _init_key(init):
                        return None
                else:
                    carries.append(key)
                    inits.append(init)
                carry_in[(r, slot)] = carries.index(key)
            else:
                return None
    ys = []
    for v, (b, r, o) in where.items():
        if v in used_after:
            if r < hl:
                return None
            if not (b == count - 1 and (r, o) in carries) and (r, o) not in ys:
                ys.append((r, o))
    return ScanRun(start=start, period=period, count=count, first_row=chain[0].row,
                   step=chain[1].row - chain[0].row, header_length=hl, sources=chain[0].sources,
                   consts=tuple(consts), carries=tuple(carries), inits=tuple(inits), carry_in_slots=carry_in,
                   ys=tuple(ys))


def find_scan_runs(jaxpr: jex_core.Jaxpr, keep: Collection = ()) -> list[ScanRun]:
    """The runs of at least two whole, equal scan iterations in ``jaxpr`` whose data flow is a scan's. ``keep``:
    variables that must stay visible (a run that defines one is left alone)."""
    eqns = jaxpr.eqns
    runs = []
    for chain, period in _candidates(eqns):
        stop = chain[0].pos + period * len(chain)
        used_after = {a for e in eqns[stop:] for a in e.invars if not isinstance(a, Literal)}
        used_after.update(a for a in jaxpr.outvars if not isinstance(a, Literal))
        run = _analyse(eqns, chain, period, used_after, set(keep))
        if run is not None:
            runs.append(run)
    return runs


def _run_scan(eqns, run: ScanRun, read, env, rows) -> None:
    """Evaluate ``run`` as one ``lax.scan``, writing the values later equations read into ``env``; ``rows(x, k, n)``
    reads rows ``k, ..., k + n - 1`` of ``x``."""
    first = eqns[run.start:run.start + run.period]
    header, body_eqns = first[:run.header_length], first[run.header_length:]
    row_vars = [header[i + 1].outvars[0] for i in range(0, run.header_length, 2)]
    xs = [rows(src, run.low, run.count) for src in run.sources]
    consts = [read(v) for v in run.consts]

    def body(carry, rows):
        local = dict(zip(run.consts, consts))
        local.update(zip(row_vars, rows))

        def get(r, slot, a):
            c = run.carry_in_slots.get((r, slot))
            if c is not None:
                return carry[c]
            return a.val if isinstance(a, Literal) else local[a]

        for r, e in enumerate(body_eqns, start=run.header_length):
            outs = _compat.bind_eqn(e, [get(r, k, a) for k, a in enumerate(e.invars)])
            local.update(zip(e.outvars, outs if e.primitive.multiple_results else [outs]))
        out = lambda key: local[first[key[0]].outvars[key[1]]]  # noqa: E731
        return [out(k) for k in run.carries], [out(k) for k in run.ys]

    inits = [jax.numpy.asarray(read(v), dtype=v.aval.dtype) for v in run.inits]
    final, ys = jax.lax.scan(body, inits, xs, reverse=run.step == -1)
    last = run.start + run.period * (run.count - 1)
    for key, val in zip(run.carries, final):
        env[eqns[last + key[0]].outvars[key[1]]] = val
    for key, stacked in zip(run.ys, ys):
        for b in range(run.count):
            if b == run.count - 1 and key in run.carries:
                continue
            index = b if run.step == 1 else run.count - 1 - b
            env[eqns[run.start + b * run.period + key[0]].outvars[key[1]]] = stacked[index]


def reroll_scans(closed: jex_core.ClosedJaxpr, keep: Collection = (), name: str = "rerolled",
                 relative_rows: bool = False) -> tuple[jex_core.ClosedJaxpr, list[ScanRun], list[int]]:
    """``closed`` with each run of :func:`find_scan_runs` written as one ``lax.scan`` (same values), the runs, and the
    row bases.

    ``relative_rows``: the rows a program reads of each stacked input are read relative to an extra int32 input, the
    least row it reads (one input per distinct such row, appended after the others in increasing order; the third
    result lists the values to pass). Two stages that run the same iterations of a scan at different depths are then the same
    program: the middle stages of a scanned model compile once. Without it (or with nothing to roll or read by rows)
    the inputs are unchanged and the third result is empty; with nothing to change ``closed`` itself is returned."""
    jaxpr = closed.jaxpr
    runs = find_scan_runs(jaxpr, keep)
    bases: dict = {}
    if relative_rows:
        invars, read_rows_of = set(jaxpr.invars), {}
        for e in jaxpr.eqns:
            k = row_slice(e)
            if k is not None and e.invars[0] in invars:
                read_rows_of.setdefault(e.invars[0], set()).add(k)
        # an input read whole (a stage's block of rows) needs no base: read as it is, it is the same in every stage,
        # and a scan over it keeps no copy of it for the backward (JAX forwards a scanned input as its residual)
        bases = {x: min(ks) for x, ks in read_rows_of.items() if ks != set(range(x.aval.shape[0]))}
    distinct = sorted(set(bases.values()))  # one input per distinct least row (usually one for all)
    if not runs and not bases:
        return closed, [], []
    at = {r.start: r for r in runs}
    eqns = jaxpr.eqns

    def evaluate(*args):
        env = dict(zip(jaxpr.constvars, closed.consts))
        env.update(zip(jaxpr.invars, args))
        base_of = {x: args[len(jaxpr.invars) + distinct.index(k)] for x, k in bases.items()}

        def read(a):
            return a.val if isinstance(a, Literal) else env[a]

        def rows(x, k, n):
            if x in base_of:
                return jax.lax.dynamic_slice_in_dim(read(x), base_of[x] + (k - bases[x]), n, axis=0)
            if not isinstance(x, Literal) and k == 0 and n == x.aval.shape[0]:
                return read(x)
            return jax.lax.slice_in_dim(read(x), k, k + n, axis=0)

        i = 0
        while i < len(eqns):
            run = at.get(i)
            if run is not None:
                _run_scan(eqns, run, read, env, rows)
                i = run.stop
                continue
            e = eqns[i]
            k = row_slice(e)
            if k is not None and e.invars[0] in base_of:
                env[e.outvars[0]] = rows(e.invars[0], k, 1)
            else:
                outs = _compat.bind_eqn(e, [read(a) for a in e.invars])
                env.update(zip(e.outvars, outs if e.primitive.multiple_results else [outs]))
            i += 1
        return [read(a) for a in jaxpr.outvars]

    avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype, weak_type=getattr(v.aval, "weak_type", False))
             for v in jaxpr.invars] + [jax.ShapeDtypeStruct((), jax.numpy.int32)] * len(distinct)
    traced = jax.make_jaxpr(evaluate)(*avals)
    out = jex_core.ClosedJaxpr(
        _compat.new_jaxpr(traced.jaxpr.constvars, traced.jaxpr.invars, traced.jaxpr.outvars, traced.jaxpr.eqns,
                          traced.jaxpr.effects, name), traced.consts)
    return out, runs, distinct


def read_rows(closed: jex_core.ClosedJaxpr, split: dict[int, tuple]) -> jex_core.ClosedJaxpr:
    """``closed`` with each input ``k`` in ``split`` (its blocks' rows) replaced by one input per block, each row a scan
    iteration reads (:func:`row_slice`) read from its block; the equations keep their positions (what
    ``runtime/_rows.py`` holds by rows)."""
    j = closed.jaxpr
    invars, block_of = [], {}
    for k, v in enumerate(j.invars):
        if k not in split:
            invars.append(v)
            continue
        blocks = [jex_core.Var(v.aval.update(shape=(b - a,) + tuple(v.aval.shape[1:]))) for a, b in split[k]]
        block_of[v] = (blocks, split[k])
        invars += blocks
    eqns = []
    for e in j.eqns:
        a0 = e.invars[0] if e.invars else None
        if a0 is not None and not isinstance(a0, Literal) and a0 in block_of:
            blocks, rows = block_of[a0]
            row = row_slice(e)
            b = next(n for n, (lo, hi) in enumerate(rows) if lo <= row < hi)
            lo = rows[b][0]
            start, limit = tuple(e.params["start_indices"]), tuple(e.params["limit_indices"])
            e = e.replace(invars=[blocks[b], *e.invars[1:]],
                          params=dict(e.params, start_indices=(start[0] - lo,) + start[1:],
                                      limit_indices=(limit[0] - lo,) + limit[1:]))
        eqns.append(e)
    return jex_core.ClosedJaxpr(_compat.new_jaxpr(j.constvars, invars, j.outvars, eqns, j.effects, "rows"), closed.consts)

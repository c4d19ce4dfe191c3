"""Per-chunk accounting for the cost model (:mod:`autopp.planner._costmodel`): the equal split of a profile's layers
into model chunks, sums of per-layer terms over a chunk, the parameter state (parameters, gradients, optimizer state)
each chunk and device group holds, and the microbatches a schedule keeps live per chunk."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING

from autopp.core import Schedule, get_schedule
from autopp.profiler import Cluster, Profile, ring_seconds

if TYPE_CHECKING:
    from autopp.planner._costmodel import LayerTerms, StepModel

__all__ = ["LayerSums", "ParamState", "cached_schedule", "chunk_split", "even_layers", "live_microbatches"]


class LayerSums:
    """Per-layer terms with prefix sums."""

    _FIELDS = ("f", "b", "w", "tp_f", "tp_b", "act", "transient", "extra")

    def __init__(self, terms: Sequence[LayerTerms]):
        self.values = {}
        self.prefix = {}
        names = dict(f="f", b="b", w="w", tp_f="tp_f", tp_b="tp_b", act="act", transient="transient",
                     extra="extra_flops", per_step="per_step")
        for key, attr in names.items():
            vals = [getattr(x, attr) for x in terms]
            self.values[key] = vals
            acc = [0.0]
            for v in vals:
                acc.append(acc[-1] + v)
            self.prefix[key] = acc

    def sum(self, key: str, a: int, b: int) -> float:
        """Sum over layers ``a .. b-1``."""
        p = self.prefix[key]
        return p[b] - p[a]

    def max(self, key: str, a: int, b: int) -> float:
        return max(self.values[key][a:b], default=0.0)


class ParamState:
    """Bytes per device of the parameter state (parameter, gradient, optimizer state) under a tensor layout: per
    layer for the parameters it owns (the first layer reading one), plus the parameters later layers read again."""

    def __init__(self, model: StepModel, tensor: int, sp: bool):
        state = model.profile.state_bytes
        n = len(model.layers)
        self.owned = [[0.0, 0.0, 0.0] for _ in range(n)]
        self.users: dict[int, list[int]] = {}
        self.bytes_of: dict[int, tuple[float, float, float]] = {}
        for i in range(n):
            for k, share in model.param_share(i, tensor, sp).items():
                if k not in self.users:
                    self.users[k] = []
                    pb, gb, ob = state[k]
                    self.bytes_of[k] = (pb * share, gb * share, ob * share)
                    for j in range(3):
                        self.owned[i][j] += self.bytes_of[k][j]
                self.users[k].append(i)
        self.shared = {k: u for k, u in self.users.items() if len(set(u)) > 1}
        self.rows: dict[int, dict[int, float]] = {}
        """Stacked parameters read by rows (scan iterations): per parameter, each reading layer's fraction."""
        for i, lay in enumerate(model.layers):
            for k, frac in lay.row_fractions:
                if k in self.bytes_of:
                    self.rows.setdefault(k, {})[i] = frac
        self.prefix = [[0.0] * (n + 1) for _ in range(3)]
        for j in range(3):
            for i in range(n):
                self.prefix[j][i + 1] = self.prefix[j][i] + self.owned[i][j]
        self._layer = [sum(self.bytes_of[k][0] for k in model.param_share(i, tensor, sp)) for i in range(n)]

    def layer_bytes(self, i: int) -> float:
        """Parameter bytes layer ``i`` reads (per device)."""
        return self._layer[i]

    def chunk_state(self, a: int, b: int) -> tuple[float, float, float]:
        """(parameter, gradient, optimizer) bytes of the parameters layers ``a .. b-1`` read."""
        out = [self.prefix[j][b] - self.prefix[j][a] for j in range(3)]
        for k, users in self.shared.items():
            if users[0] < a and any(a <= u < b for u in users):
                out[0] += self.bytes_of[k][0]
                out[1] += self.bytes_of[k][1]
        return tuple(out)

    def by_rows(self, spans, groups) -> dict[int, dict[int, float]]:
        """The stacked parameters the runtime divides by rows under this split (``runtime/_rows.py``: the chunks that
        read one read equally many rows, each on a device group of its own): per parameter, each group's fraction."""
        out = {}
        for k, fracs in self.rows.items():
            per_chunk = {c: sum(f for i, f in fracs.items() if a <= i < b) for c, (a, b) in enumerate(spans)}
            reading = [c for c, f in per_chunk.items() if f > 0]
            equal = len({round(per_chunk[c], 9) for c in reading}) == 1
            if len(reading) < 2 or not equal or len({groups[c] for c in reading}) != len(reading):
                continue
            out[k] = {groups[c]: per_chunk[c] for c in reading}
        return out

    def group_state(self, spans, groups, P, rows: bool = False) -> list[tuple[float, float, float]]:
        """Per device group: the state of every parameter its chunks read, the optimizer state only where the
        parameter's owner is (a copy elsewhere receives the value and sends back its gradient). ``rows``: the runtime
        divides stacked parameters by rows where it can (:meth:`by_rows`): each group holds its rows' state."""
        out = [[0.0, 0.0, 0.0] for _ in range(P)]
        for (a, b), g in zip(spans, groups):
            for j in range(3):
                out[g][j] += self.prefix[j][b] - self.prefix[j][a]
        divided = self.by_rows(spans, groups) if rows else {}
        for k, users in self.shared.items():
            owner_g = next(g for (a, b), g in zip(spans, groups) if a <= users[0] < b)
            others = {g for (a, b), g in zip(spans, groups) for u in users if a <= u < b} - {owner_g}
            if k in divided:  # instead of the whole state on the owner and copies elsewhere: each group its rows
                for j in range(3):
                    out[owner_g][j] -= self.bytes_of[k][j]
                for g, frac in divided[k].items():
                    for j in range(3):
                        out[g][j] += frac * self.bytes_of[k][j]
                continue
            for g in others:
                out[g][0] += self.bytes_of[k][0]
                out[g][1] += self.bytes_of[k][1]
        return [tuple(x) for x in out]

    def shared_reduce(self, spans, groups, cluster: Cluster, rows: bool = False) -> float:
        """All-reduce of each shared parameter's gradient between the device groups reading it, once per step (none
        for a stack divided by rows)."""
        total = 0.0
        divided = self.by_rows(spans, groups) if rows else {}
        for k, users in self.shared.items():
            if k in divided:
                continue
            gs = {g for (a, b), g in zip(spans, groups) for u in users if a <= u < b}
            if len(gs) > 1:
                total += ring_seconds("all-reduce", self.bytes_of[k][1], len(gs), cluster,
                                         spans_nodes=cluster.num_nodes > 1)
        return total


@functools.lru_cache(maxsize=256)
def cached_schedule(name: str, chunks: int, M: int, v: int, P: int) -> Schedule:
    return get_schedule(name, chunks, M, virtual_stages=v if name == "interleaved-1f1b" else 1)


@functools.lru_cache(maxsize=256)
def live_microbatches(name: str, chunks: int, M: int, v: int, P: int) -> tuple[float, ...]:
    """Per chunk, the most microbatches whose forward ran and whose backward (its weight-gradient half, when split)
    has not, walking each rank's actions in order."""
    sched = cached_schedule(name, chunks, M, v, P)
    peak = [0] * chunks
    for row in sched.rows:
        live = [0] * chunks
        for a in row:
            if a is None:
                continue
            if a.kind == "F":
                live[a.stage] += 1
                peak[a.stage] = max(peak[a.stage], live[a.stage])
            elif a.kind in ("B", "W"):
                live[a.stage] -= 1
    return tuple(float(p) for p in peak)


def chunk_split(profile: Profile, chunks: int) -> list[tuple[int, int]] | None:
    """The equal split of a profile's layers into ``chunks`` model chunks: the repeated blocks evenly (what precedes
    them with the first chunk, what follows with the last), or the layers evenly when there are no blocks. Blocks
    that do not divide evenly give the middle chunks one more each first: the first chunk also holds the embedding,
    the last the head (Llama 3 405B's 126 layers over 16 stages: Meta gave its first and last stages one layer fewer).
    None when there are fewer blocks than chunks."""
    layers = profile.layers
    blocks = [l.index for l in layers if l.name.startswith("block")]
    if blocks:
        if len(blocks) < chunks:
            return None
        base, extra = divmod(len(blocks), chunks)
        counts = [base] * chunks
        for c in (list(range(1, chunks - 1)) + [0, chunks - 1] if chunks > 2 else list(range(chunks)))[:extra]:
            counts[c] += 1
        out, at = [], 0
        for c in range(chunks):
            first = 0 if c == 0 else blocks[at]
            at += counts[c]
            last = len(layers) - 1 if c == chunks - 1 else blocks[at] - 1
            out.append((first, last))
        return out
    return even_layers(len(layers), chunks)


def even_layers(num_layers: int, chunks: int) -> list[tuple[int, int]] | None:
    """``num_layers`` layers in ``chunks`` contiguous runs of equal counts (the first ones one longer when they do not
    divide), as (first, last) pairs; None when there are fewer layers than chunks."""
    if num_layers < chunks:
        return None
    base, extra = divmod(num_layers, chunks)
    out, at = [], 0
    for c in range(chunks):
        size = base + (1 if c < extra else 0)
        out.append((at, at + size - 1))
        at += size
    return out

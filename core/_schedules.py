"""The named pipeline schedules, built as :class:`~autopp.core._schedule.Schedule`
grids: :func:`gpipe`, :func:`one_f_one_b`, :func:`interleaved_1f1b`,
:func:`zb_h1`, :func:`dualpipe_v`, and :func:`get_schedule` to build one by
name (one of :data:`SCHEDULE_NAMES`).  Pure Python, standard library only.
"""

from __future__ import annotations

from collections import deque

from autopp.core._schedule import Action, Schedule, _check_count

__all__ = [
    "SCHEDULE_NAMES",
    "dualpipe_v",
    "get_schedule",
    "gpipe",
    "interleaved_1f1b",
    "one_f_one_b",
    "zb_h1",
]


def gpipe(num_stages: int, num_microbatches: int) -> Schedule:
    """GPipe: rank s = stage s runs all forwards, then all backwards."""
    S = _check_count("num_stages", num_stages)
    M = _check_count("num_microbatches", num_microbatches)
    rows = [
        tuple(Action(s, "F", m) for m in range(M)) + tuple(Action(s, "B", m) for m in range(M))
        for s in range(S)
    ]
    return Schedule(tuple(rows), S, M)


def one_f_one_b(num_stages: int, num_microbatches: int) -> Schedule:
    """PipeDream-Flush 1F1B: rank s = stage s warms up with
    ``min(S - s - 1, M)`` forwards, alternates one F / one B, then drains."""
    S = _check_count("num_stages", num_stages)
    M = _check_count("num_microbatches", num_microbatches)
    rows = []
    for s in range(S):
        warmup = min(S - s - 1, M)
        row = [Action(s, "F", m) for m in range(warmup)]
        for k in range(M - warmup):
            row.append(Action(s, "F", warmup + k))
            row.append(Action(s, "B", k))
        row.extend(Action(s, "B", m) for m in range(M - warmup, M))
        rows.append(tuple(row))
    return Schedule(tuple(rows), S, M)


def interleaved_1f1b(num_ranks: int, num_microbatches: int, virtual_stages: int) -> Schedule:
    """Megatron-LM interleaved 1F1B.

    Rank r hosts ``virtual_stages`` model chunks, stages ``r, r+P, r+2P, ...``
    (``P = num_ranks``); ``num_stages = P * virtual_stages``.  Microbatches go
    round in groups of P through the chunks; rank r warms up with
    ``(V-1)*P + 2*(P-r-1)`` forwards (capped at ``M*V``), then alternates one
    forward / one backward.  Requires ``num_microbatches % num_ranks == 0``.
    With ``virtual_stages == 1`` this is plain :func:`one_f_one_b`.
    """
    P = _check_count("num_ranks", num_ranks)
    M = _check_count("num_microbatches", num_microbatches)
    V = _check_count("virtual_stages", virtual_stages)
    if M % P != 0:
        raise ValueError(
            f"interleaved 1F1B needs num_microbatches divisible by num_ranks, "
            f"got num_microbatches={M}, num_ranks={P}"
        )
    if V == 1:
        return one_f_one_b(P, M)
    total = M * V

    def chunk_and_mb(k: int, forward: bool) -> tuple[int, int]:
        chunk = (k // P) % V
        if not forward:
            chunk = V - 1 - chunk
        mb = (k // (P * V)) * P + k % P
        return chunk, mb

    rows = []
    for r in range(P):
        warmup = min((V - 1) * P + 2 * (P - r - 1), total)

        def fwd(k: int) -> Action:
            chunk, mb = chunk_and_mb(k, True)
            return Action(chunk * P + r, "F", mb)

        def bwd(k: int) -> Action:
            chunk, mb = chunk_and_mb(k, False)
            return Action(chunk * P + r, "B", mb)

        row = [fwd(k) for k in range(warmup)]
        steady = total - warmup
        for k in range(steady):
            row.append(fwd(warmup + k))
            row.append(bwd(k))
        row.extend(bwd(k) for k in range(steady, total))
        rows.append(tuple(row))
    return Schedule(tuple(rows), P * V, M)


def zb_h1(num_stages: int, num_microbatches: int) -> Schedule:
    """Zero-bubble ZB-H1 (Qi et al., 2023, "Zero Bubble Pipeline Parallelism").

    Like 1F1B with each B split into I (input gradient, on the critical path)
    and W (weight gradient, deferrable).  Rank s warms up with
    ``min(S - s - 1, M)`` forwards, then runs F, I pairs; rank s keeps up to
    ``s`` weight-gradient passes pending, running the oldest W once more than
    ``s`` are pending, and drains the rest at the end.  Deferred W's fill the
    cooldown bubbles; at most ``min(S, M)`` microbatches hold activations on
    any rank (F done, W not), 1F1B's rank 0 count, but on every rank: a later
    rank keeps more microbatches than under 1F1B (S - s there), and what a
    microbatch waiting for its W keeps (the layers' inputs and output
    gradients) can exceed its forward's residuals. A user trial (4 stages, 8
    microbatches, a tanh MLP) measured per-device peaks of 1.0x, 1.5x, 2.1x and
    4.75x 1F1B's, the largest 1.83x 1F1B's largest.
    """
    S = _check_count("num_stages", num_stages)
    M = _check_count("num_microbatches", num_microbatches)
    rows = []
    for s in range(S):
        warmup = min(S - s - 1, M)
        row = [Action(s, "F", m) for m in range(warmup)]
        pending: deque[int] = deque()

        def backward(m: int) -> None:
            row.append(Action(s, "I", m))
            pending.append(m)
            if len(pending) > s:
                row.append(Action(s, "W", pending.popleft()))

        for k in range(M - warmup):
            row.append(Action(s, "F", warmup + k))
            backward(k)
        for m in range(M - warmup, M):
            backward(m)
        row.extend(Action(s, "W", m) for m in pending)
        rows.append(tuple(row))
    return Schedule(tuple(rows), S, M)


def dualpipe_v(num_ranks: int, num_microbatches: int) -> Schedule:
    """DualPipeV (DeepSeek's "cut-in-half" DualPipe, 2025): two model chunks per rank placed in a V.

    Rank ``r`` hosts stages ``r`` and ``2P-1-r`` (``P = num_ranks``, ``2P`` stages), so the first and last
    stages share rank 0 and each microbatch goes down the ranks and back up. Per rank the actions follow
    DualPipeV's eight phases: forwards of chunk 0, paired chunk-0/chunk-1 forwards, zero-bubble backward of
    chunk 1, the steady F0 B1 F1 B0 phase (overlapped pairs in DualPipe; here run one after the other),
    cooldown backwards and the deferred weight gradients. Backwards that DualPipeV splits into input and
    weight gradients are ``I`` + ``W``; the others are whole ``B``. Requires ``num_microbatches >=
    2 * num_ranks``.
    """
    P = _check_count("num_ranks", num_ranks)
    M = _check_count("num_microbatches", num_microbatches)
    if M < 2 * P:
        raise ValueError(
            f"dualpipev needs num_microbatches >= 2 * num_ranks, got num_microbatches={M}, num_ranks={P}; "
            f"use at least {2 * P} microbatches."
        )
    rows = []
    for r in range(P):
        stage = (r, 2 * P - 1 - r)
        next_mb = {(c, k): 0 for c in (0, 1) for k in "FB"}
        deferred: deque[Action] = deque()
        row: list[Action] = []

        def forward(c: int) -> None:
            row.append(Action(stage[c], "F", next_mb[c, "F"]))
            next_mb[c, "F"] += 1

        def backward(c: int, split: bool) -> None:
            m = next_mb[c, "B"]
            next_mb[c, "B"] += 1
            if split:
                row.append(Action(stage[c], "I", m))
                deferred.append(Action(stage[c], "W", m))
            else:
                row.append(Action(stage[c], "B", m))

        def weight() -> None:
            row.append(deferred.popleft())

        for _ in range(2 * (P - r - 1)):  # 1: forwards of chunk 0
            forward(0)
        for _ in range(r + 1):  # 2: chunk 0 and chunk 1 forwards
            forward(0)
            forward(1)
        for _ in range(P - r - 1):  # 3: zero-bubble backward of chunk 1, its weight gradient, a forward
            backward(1, split=True)
            weight()
            forward(1)
        for _ in range(M - 2 * P + r + 1):  # 4: steady state
            forward(0)
            backward(1, split=False)
            forward(1)
            backward(0, split=False)
        for _ in range(P - r - 1):  # 5
            backward(1, split=False)
            forward(1)
            backward(0, split=False)
        split = False
        steps = r + 1
        for i in range(steps):  # 6: the second half of these backwards defers its weight gradients
            if i == steps // 2 and r % 2 == 1:
                split = True
            backward(1, split)
            if i == steps // 2 and r % 2 == 0:
                split = True
            backward(0, split)
        for _ in range(P - r - 1):  # 7
            weight()
            backward(0, split=True)
        while deferred:  # 8
            weight()
        rows.append(tuple(row))
    return Schedule(tuple(rows), 2 * P, M)


SCHEDULE_NAMES: tuple[str, ...] = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "dualpipev")


def get_schedule(
    name: str, num_stages: int, num_microbatches: int, virtual_stages: int = 1
) -> Schedule:
    """Build a schedule by name (one of :data:`SCHEDULE_NAMES`).

    ``num_stages`` counts model chunks (stages). For ``"interleaved-1f1b"``
    ``num_ranks = num_stages // virtual_stages``; ``"dualpipev"`` puts two chunks on each
    rank (``num_ranks = num_stages // 2``; ``virtual_stages`` is 1 or 2). The other
    schedules put one stage on each rank and accept only ``virtual_stages == 1``.
    """
    key = name.strip().lower().replace("_", "-") if isinstance(name, str) else name
    if key not in SCHEDULE_NAMES:
        raise ValueError(
            f"unknown schedule {name!r}; valid names: {', '.join(SCHEDULE_NAMES)}"
        )
    S = _check_count("num_stages", num_stages)
    M = _check_count("num_microbatches", num_microbatches)
    V = _check_count("virtual_stages", virtual_stages)
    if key == "interleaved-1f1b":
        if S % V != 0:
            raise ValueError(
                f"num_stages ({S}) must be a multiple of virtual_stages ({V}) "
                f"for interleaved-1f1b"
            )
        return interleaved_1f1b(S // V, M, V)
    if key == "dualpipev":
        if V not in (1, 2) or S % 2:
            raise ValueError(
                f"dualpipev runs 2 stages per rank: num_stages ({S}) must be even and virtual_stages 2 "
                f"(got {V})"
            )
        return dualpipe_v(S // 2, M)
    if V != 1:
        raise ValueError(
            f"virtual_stages={V} is only meaningful for 'interleaved-1f1b', not {key!r}"
        )
    if key == "gpipe":
        return gpipe(S, M)
    if key == "1f1b":
        return one_f_one_b(S, M)
    return zb_h1(S, M)

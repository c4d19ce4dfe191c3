"""Pipeline schedules as a tiny IR.

A :class:`Schedule` is a grid: one row per pipeline *rank* (a device group),
each row the ordered list of :class:`Action` s that rank executes.  An action
names a pipeline *stage*, a kind and a microbatch:

* ``F`` forward,
* ``B`` full backward (input and weight gradients together),
* ``I`` input-gradient backward and ``W`` weight-gradient backward; an ``I``
  plus a ``W`` together replace the ``B`` of a (stage, microbatch).

Text form: ``"2F0"`` is stage 2, forward, microbatch 0.  A schedule is written
one line per rank, actions separated by spaces, ``-`` for an idle slot::

    0F0 0F1 0B0 0B1
    -   1F0 1B0 1F1 1B1

Idle slots (``None`` in :attr:`Schedule.rows`) are placeholders for display;
execution (validation, :func:`dispatch_order`, the simulations) ignores them
and is driven by the order of the actions in each row and by the data
dependencies:

* ``F(s, m)`` needs ``F(s-1, m)``;
* ``B(s, m)`` / ``I(s, m)`` need ``F(s, m)`` and the input-gradient of the
  next stage, ``B(s+1, m)`` or ``I(s+1, m)`` (the last stage needs only its
  own forward);
* ``W(s, m)`` needs ``I(s, m)``.

:func:`validate` checks a schedule (completeness, placement, order, deadlock
freedom) and raises :class:`ScheduleError` with the whole grid and the failing
actions marked; :func:`dependencies` names what an action waits for.  The
named generators (:func:`gpipe`, :func:`one_f_one_b`, ..., :func:`get_schedule`)
live in ``_schedules``; the simulations (:func:`simulate_ticks`,
:func:`dispatch_order`, :func:`simulate_times`, :func:`bubble_fraction`) in
``_schedule_sim``.

Pure Python, standard library only.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Collection, Iterator, Optional, Sequence

__all__ = [
    "KINDS",
    "Action",
    "Schedule",
    "ScheduleError",
    "dependencies",
    "validate",
]

#: The action kinds: forward, full backward, input-grad backward, weight-grad backward.
KINDS: tuple[str, ...] = ("F", "B", "I", "W")

_EXPECTED_FORM = "<stage><F|B|I|W><microbatch>"
# Canonical non-negative integers only (no leading zeros, ASCII digits), so
# that parse(str(a)) == a and str(parse(t)) == t.
_ACTION_RE = re.compile(r"(0|[1-9][0-9]*)([FBIW])(0|[1-9][0-9]*)")
_RANK_LABEL_RE = re.compile(r"rank\s+([0-9]+)\s*\|(.*)")

#: At most this many individual problems are spelled out in an error message.
_MAX_LISTED = 12


# ---------------------------------------------------------------------------
# Action
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Action:
    """One unit of pipeline work: ``kind`` of ``stage`` on ``microbatch``."""

    stage: int
    kind: str
    microbatch: int

    def __post_init__(self) -> None:
        for name in ("stage", "microbatch"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(
                    f"Action.{name} must be an int, got {type(value).__name__} {value!r}"
                )
            if value < 0:
                raise ValueError(f"Action.{name} must be >= 0, got {value}")
        if self.kind not in KINDS:
            raise ValueError(
                f"Action.kind must be one of {', '.join(KINDS)}, got {self.kind!r}"
            )

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"

    @classmethod
    def parse(cls, text: str) -> "Action":
        """Parse the canonical text form, e.g. ``"1B3"``; strict (no spaces,
        no leading zeros)."""
        if not isinstance(text, str):
            raise TypeError(f"Action.parse expects a str, got {type(text).__name__}")
        match = _ACTION_RE.fullmatch(text)
        if match is None:
            raise ValueError(
                f"malformed action {text!r}: expected the form {_EXPECTED_FORM}, "
                f"e.g. '2F0' or '1B3'"
            )
        stage, kind, microbatch = match.groups()
        return cls(int(stage), kind, int(microbatch))

    @property
    def is_forward(self) -> bool:
        return self.kind == "F"

    @property
    def is_backward(self) -> bool:
        """True for B, I and W."""
        return self.kind != "F"


# ---------------------------------------------------------------------------
# Schedule
# ---------------------------------------------------------------------------


def _check_count(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    if value <= 0:
        raise ValueError(f"{name} must be positive, got {value}")
    return value


@dataclass(frozen=True)
class Schedule:
    """Per-rank ordered actions of a pipeline schedule.

    ``rows[r]`` is what rank ``r`` runs, in order; ``None`` is an idle slot
    (display only).  A rank may host several stages (interleaved schedules)
    but a stage lives on exactly one rank.
    """

    rows: tuple[tuple[Optional[Action], ...], ...]
    num_stages: int
    num_microbatches: int

    def __post_init__(self) -> None:
        if isinstance(self.rows, (str, bytes)):
            raise TypeError("Schedule.rows must be a sequence of rows, not a string")
        rows = []
        for r, row in enumerate(self.rows):
            if isinstance(row, (str, bytes)):
                raise TypeError(f"Schedule.rows[{r}] must be a sequence of actions, not a string")
            row = tuple(row)
            for i, a in enumerate(row):
                if a is not None and not isinstance(a, Action):
                    raise TypeError(
                        f"Schedule.rows[{r}][{i}] must be an Action or None, "
                        f"got {type(a).__name__} {a!r}"
                    )
            rows.append(row)
        object.__setattr__(self, "rows", tuple(rows))
        _check_count("num_stages", self.num_stages)
        _check_count("num_microbatches", self.num_microbatches)

    # -- basic queries -----------------------------------------------------

    @property
    def num_ranks(self) -> int:
        return len(self.rows)

    def actions(self) -> Iterator[tuple[int, int, Action]]:
        """Yield ``(rank, slot, action)`` for every non-idle slot."""
        for r, row in enumerate(self.rows):
            for i, a in enumerate(row):
                if a is not None:
                    yield r, i, a

    def stage_to_rank(self) -> dict[int, int]:
        """Map each stage that appears in the schedule to the rank running it.

        Raises :class:`ScheduleError` (a ``ValueError``) if a stage has actions
        on more than one rank.
        """
        problems, marks = _spread_stages(self)
        if problems:
            raise ScheduleError(self, problems, marks)
        return {a.stage: r for r, _, a in self.actions()}

    def rank_stages(self) -> list[list[int]]:
        """Stages hosted by each rank, sorted."""
        return [sorted({a.stage for a in row if a is not None}) for row in self.rows]

    # -- text --------------------------------------------------------------

    def to_text(self) -> str:
        """One line per rank, actions separated by single spaces, ``-`` for idle.

        An empty row is written ``rank N |`` so that it survives the round trip.
        """
        lines = []
        for r, row in enumerate(self.rows):
            if row:
                lines.append(" ".join("-" if a is None else str(a) for a in row))
            else:
                lines.append(f"rank {r} |")
        return "\n".join(lines)

    @classmethod
    def from_text(
        cls,
        text: str,
        num_stages: Optional[int] = None,
        num_microbatches: Optional[int] = None,
    ) -> "Schedule":
        """Parse :meth:`to_text` output (or the :meth:`__str__` grid).

        Blank lines and extra whitespace are ignored, ``#`` starts a comment.
        A line may carry a ``rank N |`` label, which must match its position.
        ``num_stages`` / ``num_microbatches`` default to one more than the
        largest stage / microbatch mentioned.
        """
        if not isinstance(text, str):
            raise TypeError(f"Schedule.from_text expects a str, got {type(text).__name__}")
        rows: list[tuple[Optional[Action], ...]] = []
        for lineno, raw in enumerate(text.splitlines(), start=1):
            line = raw.split("#", 1)[0].strip()
            if not line:
                continue
            label = _RANK_LABEL_RE.fullmatch(line)
            if label is not None:
                if int(label.group(1)) != len(rows):
                    raise ValueError(
                        f"line {lineno}: labelled rank {label.group(1)} but it is row "
                        f"{len(rows)} of the schedule: {raw.strip()!r}"
                    )
                line = label.group(2)
            row: list[Optional[Action]] = []
            for token in line.split():
                if token == "-":
                    row.append(None)
                    continue
                if token.startswith("[") and token.endswith("]"):  # error markers
                    token = token[1:-1]
                try:
                    row.append(Action.parse(token))
                except ValueError as e:
                    raise ValueError(f"line {lineno}: {e}") from None
            rows.append(tuple(row))
        all_actions = [a for row in rows for a in row if a is not None]
        if num_stages is None:
            if not all_actions:
                raise ValueError("cannot infer num_stages from a schedule with no actions")
            num_stages = max(a.stage for a in all_actions) + 1
        if num_microbatches is None:
            if not all_actions:
                raise ValueError("cannot infer num_microbatches from a schedule with no actions")
            num_microbatches = max(a.microbatch for a in all_actions) + 1
        return cls(tuple(rows), num_stages, num_microbatches)

    def to_grid(self, marks: Collection[tuple[int, int]] = ()) -> str:
        """Aligned grid, one line per rank labelled ``rank N |``.

        ``marks`` is a collection of ``(rank, slot)`` positions to highlight;
        marked cells are shown as ``[1B0]``.
        """
        marks = set(marks)
        cells = [["-" if a is None else str(a) for a in row] for row in self.rows]
        width = max((len(c) for row in cells for c in row), default=1)
        label_width = len(str(max(self.num_ranks - 1, 0)))
        lines = []
        for r, row in enumerate(cells):
            parts = []
            for i, c in enumerate(row):
                if marks:
                    c = f"[{c}]" if (r, i) in marks else f" {c} "
                    parts.append(c.ljust(width + 2))
                else:
                    parts.append(c.ljust(width))
            lines.append((f"rank {r:>{label_width}} | " + " ".join(parts)).rstrip())
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.to_grid()


# ---------------------------------------------------------------------------
# Errors and validation
# ---------------------------------------------------------------------------


class ScheduleError(ValueError):
    """An invalid schedule.  The message states the problems in words and
    then shows the whole grid with the offending actions marked ``[..]``."""

    def __init__(
        self,
        schedule: Schedule,
        problems: Sequence[str],
        marks: Collection[tuple[int, int]] = (),
    ) -> None:
        self.schedule = schedule
        self.problems = list(problems)
        self.marks = set(marks)
        listed = self.problems[:_MAX_LISTED]
        text = "; ".join(listed)
        if len(self.problems) > len(listed):
            text += f"; ... and {len(self.problems) - len(listed)} more"
        grid = schedule.to_grid(self.marks)
        header = (
            f"schedule ({schedule.num_ranks} ranks, {schedule.num_stages} stages, "
            f"{schedule.num_microbatches} microbatches):"
        )
        super().__init__(f"{text}\n{header}\n{grid}")


def _spread_stages(schedule: Schedule) -> tuple[list[str], set[tuple[int, int]]]:
    ranks_of: dict[int, list[int]] = {}
    for r, _, a in schedule.actions():
        lst = ranks_of.setdefault(a.stage, [])
        if r not in lst:
            lst.append(r)
    problems, marks = [], set()
    for stage in sorted(ranks_of):
        ranks = ranks_of[stage]
        if len(ranks) > 1:
            problems.append(
                f"stage {stage} is spread over ranks {', '.join(map(str, ranks))} "
                f"(a stage must run all its actions on one rank)"
            )
            for r, i, a in schedule.actions():
                if a.stage == stage and r != ranks[0]:
                    marks.add((r, i))
    return problems, marks


def _grad_kind(present: Collection[Action], stage: int, microbatch: int) -> str:
    return "I" if Action(stage, "I", microbatch) in present else "B"


def dependencies(schedule: Schedule, action: Action) -> tuple[Action, ...]:
    """The actions ``action`` needs done first (see the module docstring).

    The input gradient of stage ``s+1`` is its ``I`` if the schedule has one,
    else its ``B``.
    """
    present = {a for _, _, a in schedule.actions()}
    return _deps(action, schedule.num_stages, present)


def _deps(action: Action, num_stages: int, present: Collection[Action]) -> tuple[Action, ...]:
    s, m = action.stage, action.microbatch
    if action.kind == "F":
        return (Action(s - 1, "F", m),) if s > 0 else ()
    if action.kind == "W":
        return (Action(s, "I", m),)
    # B or I
    if s + 1 < num_stages:
        return (Action(s, "F", m), Action(s + 1, _grad_kind(present, s + 1, m), m))
    return (Action(s, "F", m),)


def _check_structure(schedule: Schedule) -> None:
    """Range, duplicates, placement, completeness, same-rank order."""
    S, M = schedule.num_stages, schedule.num_microbatches

    # 1. out of range
    problems, marks = [], set()
    for r, i, a in schedule.actions():
        bad = []
        if a.stage >= S:
            bad.append(f"stage {a.stage} is out of range [0, {S})")
        if a.microbatch >= M:
            bad.append(f"microbatch {a.microbatch} is out of range [0, {M})")
        if bad:
            problems.append(f"out of range: rank {r} slot {i} runs {a}: " + " and ".join(bad))
            marks.add((r, i))
    if problems:
        raise ScheduleError(schedule, problems, marks)

    # an empty row: a device group that would hold no stage and sit idle
    empty = [r for r, row in enumerate(schedule.rows) if not any(a is not None for a in row)]
    if empty:
        raise ScheduleError(schedule, [f"rank {r} runs no action: every row (device group) must run at least one "
                                       "stage; drop the row or move stages onto it" for r in empty], set())

    # 2. duplicates
    where: dict[Action, list[tuple[int, int]]] = {}
    for r, i, a in schedule.actions():
        where.setdefault(a, []).append((r, i))
    problems, marks = [], set()
    for a, places in where.items():
        if len(places) > 1:
            spots = ", ".join(f"rank {r} slot {i}" for r, i in places)
            problems.append(f"duplicate: {a} appears {len(places)} times ({spots})")
            marks.update(places)
    if problems:
        raise ScheduleError(schedule, problems, marks)

    # 3. one rank per stage
    problems, marks = _spread_stages(schedule)
    if problems:
        raise ScheduleError(schedule, problems, marks)

    # 4. completeness: one F, and one B or one I+W, per (stage, microbatch)
    problems, marks = [], set()
    for s in range(S):
        for m in range(M):
            has = {k: Action(s, k, m) in where for k in KINDS}
            if not has["F"]:
                problems.append(f"missing: {Action(s, 'F', m)} (forward of stage {s}, microbatch {m})")
            if has["B"] and (has["I"] or has["W"]):
                extra = [str(Action(s, k, m)) for k in ("I", "W") if has[k]]
                problems.append(
                    f"conflicting backward for stage {s}, microbatch {m}: "
                    f"{Action(s, 'B', m)} together with {' and '.join(extra)} "
                    f"(use either B or I+W)"
                )
                for k in ("B", "I", "W"):
                    if has[k]:
                        marks.update(where[Action(s, k, m)])
            elif has["I"] and not has["W"]:
                problems.append(f"missing: {Action(s, 'W', m)} (weight gradient to go with {Action(s, 'I', m)})")
                marks.update(where[Action(s, "I", m)])
            elif has["W"] and not has["I"]:
                problems.append(f"missing: {Action(s, 'I', m)} (input gradient to go with {Action(s, 'W', m)})")
                marks.update(where[Action(s, "W", m)])
            elif not (has["B"] or has["I"]):
                problems.append(
                    f"missing: backward of stage {s}, microbatch {m} "
                    f"({Action(s, 'B', m)}, or {Action(s, 'I', m)} and {Action(s, 'W', m)})"
                )
    if problems:
        raise ScheduleError(schedule, problems, marks)

    # 5. same-rank order: B/I after own F, W after own I
    problems, marks = [], set()
    for r, i, a in schedule.actions():
        if a.kind in ("B", "I"):
            before = Action(a.stage, "F", a.microbatch)
            what = "forward"
        elif a.kind == "W":
            before = Action(a.stage, "I", a.microbatch)
            what = "input-gradient backward"
        else:
            continue
        (rb, ib), = where[before]
        if rb == r and ib > i:
            problems.append(
                f"rank {r} runs {a} (slot {i}) before its {what} {before} (slot {ib})"
            )
            marks.update({(r, i), (rb, ib)})
    if problems:
        raise ScheduleError(schedule, problems, marks)


def _run_ticks(schedule: Schedule) -> dict[Action, int]:
    """Lockstep simulation; raises ScheduleError on deadlock."""
    S = schedule.num_stages
    present = {a for _, _, a in schedule.actions()}
    location = {a: (r, i) for r, i, a in schedule.actions()}
    queues = [[(i, a) for i, a in enumerate(row) if a is not None] for row in schedule.rows]
    pos = [0] * len(queues)
    deps = {a: _deps(a, S, present) for a in present}
    done: dict[Action, int] = {}
    remaining = len(present)
    tick = 0
    while remaining:
        ready = []
        for r, q in enumerate(queues):
            if pos[r] < len(q):
                a = q[pos[r]][1]
                if all(d in done for d in deps[a]):
                    ready.append((r, a))
        if not ready:
            problems, marks = [], set()
            for r, q in enumerate(queues):
                if pos[r] >= len(q):
                    continue
                i, a = q[pos[r]]
                marks.add((r, i))
                for d in deps[a]:
                    if d in done:
                        continue
                    if d in location:
                        owner = location[d][0]
                        later = " (later in its own row)" if owner == r else ""
                        problems.append(
                            f"rank {r} waits at {a} for {d} which rank {owner} has not run{later}"
                        )
                    else:
                        problems.append(f"rank {r} waits at {a} for {d} which no rank runs")
            problems[0] = "deadlock: " + problems[0]
            raise ScheduleError(schedule, problems, marks)
        for r, a in ready:
            done[a] = tick
            pos[r] += 1
        remaining -= len(ready)
        tick += 1
    return done


def validate(schedule: Schedule) -> None:
    """Raise :class:`ScheduleError` unless ``schedule`` is complete and runs.

    Checks, in order: actions in range, no duplicates, each stage on one rank,
    exactly one F and one B (or I+W) per (stage, microbatch), no backward
    before its own forward (or W before its I) on a rank, no deadlock.
    """
    if not isinstance(schedule, Schedule):
        raise TypeError(f"validate expects a Schedule, got {type(schedule).__name__}")
    _check_structure(schedule)
    _run_ticks(schedule)

"""What ``autopp.parallelize`` was asked for: one frozen, validated :class:`ParallelizeConfig`.

Every keyword of :func:`autopp.parallelize` is checked here once, at the call, so a mistake is reported where it
was made (never at the first step), and the rest of the face reads normalized values: a flat device tuple, the
device groups when given, a parsed schedule, a :class:`Plan` object. Which of the three plan sources runs
(:attr:`ParallelizeConfig.source`) follows from the keywords given.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Sequence

import jax
import numpy as np

from autopp.core import RECOMPUTE_MODES, SCHEDULE_NAMES, Plan, Schedule, get_schedule, validate

LOSS_REDUCTIONS = ("mean", "sum")
"""How microbatch losses and gradients combine."""
LAYOUT_AXES = ("data", "fsdp", "tensor")
"""The axes a ``layout`` may size."""

_ACTION_TOKEN = re.compile(r"\b\d+[FBIW]\d+\b")
_WHO = "autopp.parallelize"


def _set(obj, name: str, value) -> None:
    object.__setattr__(obj, name, value)


def _check_count(name: str, value) -> int | None:
    """``value`` as a Python int (a NumPy integer is one), or None."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{_WHO}: {name} must be a positive int, got {value!r} ({type(value).__name__}).")
    if value <= 0:
        raise ValueError(f"{_WHO}: {name} must be a positive int, got {value}; use e.g. {name}=1.")
    return int(value)


def _check_donate_argnums(value) -> tuple[int, ...]:
    if value is None:
        return ()
    items = (value,) if isinstance(value, (int, np.integer)) and not isinstance(value, bool) else value
    try:
        items = tuple(items)
    except TypeError:
        raise TypeError(f"{_WHO}: donate_argnums must be an int or a sequence of ints, got {value!r} "
                        f"({type(value).__name__}).") from None
    for i in items:
        if isinstance(i, bool) or not isinstance(i, (int, np.integer)):
            raise TypeError(f"{_WHO}: donate_argnums must hold ints (argument positions), got {i!r} in {value!r}.")
        if i < 0:
            raise ValueError(f"{_WHO}: donate_argnums={value!r} holds {i}; give non-negative positions, e.g. "
                             "donate_argnums=(0, 1) for step(params, opt_state, batch).")
    return tuple(sorted({int(i) for i in items}))


def check_layout_axes(layout: dict, who: str) -> None:
    """``layout`` sizes only the axes data, fsdp and tensor, each with a positive int; else a ValueError naming
    ``who``."""
    unknown = sorted(set(layout) - set(LAYOUT_AXES))
    if unknown:
        raise ValueError(f"{who}: layout {layout} has unknown axes {unknown}; the axes are data, fsdp, tensor.")
    for k, v in layout.items():
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"{who}: layout {layout}: {k} must be a positive int, got {v!r}.")


def _id_ranges(ids: Sequence[int], most: int = 6) -> str:
    """Sorted device ids as runs (``0-7, 16-23``), at most ``most`` runs shown."""
    runs: list[list[int]] = []
    for i in ids:
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    shown = ", ".join(f"{a}-{b}" if b > a else f"{a}" for a, b in runs[:most])
    return shown + (f" and {len(runs) - most} more run(s)" if len(runs) > most else "")


def _check_layout(layout):
    if layout is None:
        return None
    many = layout if isinstance(layout, (list, tuple)) else [layout]
    for lay in many:
        if not isinstance(lay, dict):
            raise TypeError(f"{_WHO}: layout must be a dict such as {{'fsdp': 2}} or a list of them (one per device "
                            f"group), got {lay!r}.")
        check_layout_axes(lay, _WHO)
    return tuple(dict(x) for x in layout) if isinstance(layout, (list, tuple)) else dict(layout)


def _parse_schedule(schedule):
    """A name (normalized), a validated :class:`Schedule` (text parsed), or None."""
    if schedule is None:
        return None
    if isinstance(schedule, Schedule):
        validate(schedule)
        return schedule
    if not isinstance(schedule, str):
        raise TypeError(f"{_WHO}: schedule must be a name ({', '.join(SCHEDULE_NAMES)}), a Schedule or its text, got "
                        f"{type(schedule).__name__}.")
    if _ACTION_TOKEN.search(schedule):
        try:
            parsed = Schedule.from_text(schedule)
        except ValueError as e:
            raise ValueError(f"{_WHO}: the schedule text does not parse: {e}") from None
        validate(parsed)
        return parsed
    name = schedule.strip().lower().replace("_", "-")
    if name not in SCHEDULE_NAMES and _ACTION_TOKEN.search(schedule.upper()):
        raise ValueError(f"{_WHO}: the schedule text's actions are written in upper case ('0F0', '1B2', '0I1', "
                         f"'0W1'), got {schedule[:40]!r}; write them so.")
    if name not in SCHEDULE_NAMES:
        raise ValueError(f"{_WHO}: unknown schedule {schedule!r}; valid names are {', '.join(SCHEDULE_NAMES)} (or "
                         "pass a Schedule object, or its text: one row of actions such as '0F0 0B0' per device group).")
    return name


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class ParallelizeConfig:
    """The keywords of :func:`autopp.parallelize`, validated and normalized (see its docstring for the meaning)."""

    num_stages: int | None = None
    """Device groups of the pipeline; None when the planner chooses (or a plan or schedule fixes it)."""
    num_microbatches: int | None = None
    """Microbatches per step; None for the default (or the planner's, or the plan's)."""
    schedule: str | Schedule | None = None
    """A schedule name (normalized, e.g. ``interleaved-1f1b``) or a validated :class:`Schedule` (text is parsed);
    ``1f1b`` when only counts are given; None with the planner or a plan."""
    devices: Sequence[jax.Device] | Sequence[Sequence[jax.Device]] | None = None
    """All devices the step may use, as a flat tuple (default ``jax.devices()``); given as a list of lists, the
    lists are the device groups (:attr:`device_groups`)."""
    device_groups: tuple[tuple[jax.Device, ...], ...] | None = None
    """The devices of each device group when given explicitly (then they are the stages), else None."""
    batch_argnums: int | Sequence[int] | None = None
    """Positional arguments that hold the batch (default: the last one)."""
    loss_reduction: str | None = None
    """``mean`` or ``sum``: how microbatch losses combine into the step's. None (the default): read off the loss's
    program for each argument signature (a loss that divides by its own batch size, as ``jnp.mean`` does, is a mean;
    one that adds its examples up, a sum; ``"mean"`` where it cannot be told), or the replayed plan's. Given, it
    must agree with what the loss's program shows."""
    plan: Plan | str | None = None
    """A plan to replay (a JSON path or text is read into a :class:`Plan`)."""
    virtual_stages: int | None = None
    """Model chunks per device group (2 by default for ``interleaved-1f1b`` and ``dualpipev``, else 1)."""
    recompute: str | tuple[str, ...] | None = None
    """One recompute mode for every stage, or one per stage (model chunk); None for ``none``."""
    layout: dict[str, int] | tuple[dict[str, int], ...] | None = None
    """Mesh axis sizes (``data``, ``fsdp``, ``tensor``) for every device group, or one dict per group."""
    compilation_cache: str | os.PathLike | bool | None = None
    """Where compiled stage programs persist for the next process (JAX's persistent compilation cache): a
    directory; None uses JAX's configured directory, else ``$XDG_CACHE_HOME/autopp/xla`` (unless the environment
    sets ``AUTOPP_COMPILATION_CACHE=0``); False leaves JAX's configuration alone. See :mod:`autopp._compile_cache`."""

    donate_argnums: tuple[int, ...] = ()
    """Positional arguments whose buffers the step may reuse for its results (as ``jax.jit``'s); given as an int,
    a sequence of ints or None (none)."""
    zero1: bool | None = None
    """ZeRO-1: the optimizer state sharded over each stage's data axis (parameters and gradients stay replicated
    over it); None for off (or the replayed plan's)."""

    def __post_init__(self) -> None:
        _set(self, "donate_argnums", _check_donate_argnums(self.donate_argnums))
        plan = self.plan
        if plan is not None and not isinstance(plan, Plan):
            plan = Plan.from_json(plan)
            _set(self, "plan", plan)
        _set(self, "schedule", _parse_schedule(self.schedule))
        for name in ("num_stages", "num_microbatches", "virtual_stages"):
            _set(self, name, _check_count(name, getattr(self, name)))
        if plan is not None:
            self._check_replay(plan)
        if self.loss_reduction is None and plan is not None:
            _set(self, "loss_reduction", plan.loss_reduction)
        if self.loss_reduction is not None and self.loss_reduction not in LOSS_REDUCTIONS:
            raise ValueError(f"{_WHO}: loss_reduction={self.loss_reduction!r} is not one of {LOSS_REDUCTIONS}; use "
                             "'mean' when the loss is an average over examples, 'sum' when it is a sum.")
        self._normalize_devices()
        if self.source == "counts":
            self._check_counts()
        elif self.source == "planner" and self.virtual_stages is not None:
            raise ValueError(f"{_WHO}: virtual_stages={self.virtual_stages} needs schedule='interleaved-1f1b' (the "
                             "planner chooses among single-chunk schedules); pass the schedule and num_stages too, "
                             "or drop virtual_stages=.")
        recompute = self.recompute
        if recompute is not None and not isinstance(recompute, str):
            if not isinstance(recompute, (tuple, list)):
                raise TypeError(f"{_WHO}: recompute={recompute!r} ({type(recompute).__name__}) must be a mode name, "
                                f"one of {', '.join(RECOMPUTE_MODES)} (e.g. recompute='full' for True), or a tuple "
                                "of them, one per stage (model chunk).")
            recompute = tuple(recompute)
            _set(self, "recompute", recompute)
        if recompute is not None and not all(r in RECOMPUTE_MODES for r in
                                             ((recompute,) if isinstance(recompute, str) else recompute)):
            raise ValueError(f"{_WHO}: recompute={recompute!r} must be one of {', '.join(RECOMPUTE_MODES)} or a tuple "
                             "of them, one per stage (model chunk).")
        _set(self, "layout", _check_layout(self.layout))
        if self.zero1 is not None and not isinstance(self.zero1, bool):
            raise TypeError(f"{_WHO}: zero1 must be True or False, got {self.zero1!r} ({type(self.zero1).__name__}).")
        cache = self.compilation_cache
        if cache is not None and not isinstance(cache, (bool, str, os.PathLike)):
            raise TypeError(f"{_WHO}: compilation_cache must be a directory (str or path), True, False or None, got "
                            f"{cache!r} ({type(cache).__name__}).")
        if isinstance(cache, (str, os.PathLike)) and not os.fspath(cache):
            raise ValueError(f"{_WHO}: compilation_cache='' names no directory; give a directory, or False to leave "
                             "JAX's compilation cache as configured.")

    def donated_leaves(self, args: tuple) -> frozenset[int]:
        """Indices of the flat leaves of ``args`` that belong to the arguments ``donate_argnums`` names."""
        bad = [i for i in self.donate_argnums if i >= len(args)]
        if bad:
            raise ValueError(f"{_WHO}: donate_argnums={self.donate_argnums} names argument(s) {bad}, but the step "
                             f"was called with {len(args)} positional argument(s); donate only arguments it takes.")
        out, start = set(), 0
        for i, a in enumerate(args):
            n = len(jax.tree_util.tree_leaves(a))
            if i in self.donate_argnums:
                out.update(range(start, start + n))
            start += n
        return frozenset(out)

    @property
    def source(self) -> str:
        """Which plan source runs: ``replay`` (a plan given), ``planner`` (no stage count, schedule, groups or plan
        given; a microbatch count given is kept), else ``counts``."""
        if self.plan is not None:
            return "replay"
        if self.num_stages is None and self.schedule is None and self.device_groups is None:
            return "planner"
        return "counts"

    def _check_replay(self, plan: Plan) -> None:
        given = [k for k in ("num_stages", "num_microbatches", "schedule", "virtual_stages", "recompute", "layout",
                             "zero1") if getattr(self, k) is not None]
        if given:
            raise ValueError(f"{_WHO}: pass either plan= or {', '.join(given)}, not both: a plan fixes the stages, "
                             "microbatches, schedule and recomputation. Drop the keyword(s) or the plan.")
        if self.loss_reduction is not None and self.loss_reduction != plan.loss_reduction:
            raise ValueError(f"{_WHO}: loss_reduction={self.loss_reduction!r} contradicts the plan's "
                             f"{plan.loss_reduction!r}; drop loss_reduction= or make the plan again with "
                             f"plan_model(..., loss_reduction={self.loss_reduction!r}) (autopp plan --loss-reduction "
                             f"{self.loss_reduction}).")
        if any(st.equations is None and st.layers is None for st in plan.stages):
            raise ValueError(f"{_WHO}: the plan's stages give neither equations nor layers, so it cannot be "
                             "replayed; make it with step.plan_for(...) or plan_model(profile, ...).")

    def _normalize_devices(self) -> None:
        given = self.devices
        if isinstance(given, jax.Device):  # one device
            given = [given]
        elif isinstance(given, np.ndarray) and given.ndim > 1:
            raise TypeError(f"{_WHO}: devices is a {given.ndim}-D array of devices (a mesh's devices?); pass "
                            "devices.tolist() for one device group per row, or list(devices.flat) for one list.")
        devices = list(jax.devices() if given is None else given)
        if devices and all(isinstance(g, (list, tuple)) for g in devices):  # one list per device group
            groups = [tuple(g) for g in devices]
            if any(not g for g in groups):
                raise ValueError(f"{_WHO}: devices has an empty device group: {devices}; give every group at least "
                                 "one device.")
            if self.num_stages is not None and self.num_stages != len(groups):
                raise ValueError(f"{_WHO}: num_stages={self.num_stages} but devices has {len(groups)} groups; drop "
                                 "num_stages= (the groups are the stages) or regroup the devices.")
            if self.plan is not None:
                raise ValueError(f"{_WHO}: a plan fixes each stage's devices; pass devices as a flat list (the "
                                 "devices the plan may use).")
            _set(self, "device_groups", tuple(groups))
            _set(self, "num_stages", len(groups))
            devices = [d for g in groups for d in g]
        if not devices or not all(isinstance(d, jax.Device) for d in devices):
            raise TypeError(f"{_WHO}: devices must be a non-empty sequence of jax.Device (or of lists of them, one "
                            f"per stage), got {devices!r}.")
        if len(set(devices)) != len(devices):
            raise ValueError(f"{_WHO}: devices lists a device twice: {devices}.")
        _set(self, "devices", tuple(devices))
        if (isinstance(self.schedule, Schedule) and self.num_stages is not None
                and self.schedule.num_ranks != self.num_stages):  # the schedule's rows first: they decide
            raise ValueError(
                f"{_WHO}: the schedule has {self.schedule.num_ranks} row(s) (device groups) but "
                f"num_stages={self.num_stages}; drop num_stages= or give a schedule with {self.num_stages} rows.")
        if self.num_stages is not None and self.num_stages > len(devices):
            raise ValueError(
                f"{_WHO}: num_stages={self.num_stages} needs at least {self.num_stages} devices, but {len(devices)} "
                f"were given ({devices}); use num_stages <= {len(devices)} or pass more devices"
                + ("" if devices[0].platform != "cpu" or len(jax.devices()) > len(devices) else
                   " (on a CPU-only machine, jax.config.update('jax_num_cpu_devices', 8) before JAX is first used "
                   "makes 8)") + ".")
        if self.plan is not None:
            planned = {i for st in self.plan.stages for i in st.devices}
            missing = sorted(planned - {d.id for d in devices})
            if missing and given is not None and len(planned) == len(devices):  # as many devices, named: run there
                new_id = dict(zip(sorted(planned), (d.id for d in devices)))  # (the plan's order kept)
                _set(self, "plan", dataclasses.replace(self.plan, stages=tuple(
                    dataclasses.replace(st, devices=tuple(new_id[i] for i in st.devices)) for st in self.plan.stages)))
                missing = []
            if missing:
                raise ValueError(
                    f"{_WHO}: the plan places stages on {len(planned)} devices, id(s) {_id_ranges(sorted(planned))}; "
                    f"{'id' if len(missing) == 1 else 'ids'} {_id_ranges(missing)} "
                    f"{'is' if len(missing) == 1 else 'are'} not among the {len(devices)} devices given "
                    f"({_id_ranges(sorted(d.id for d in devices))}). Pass devices that include them, or exactly "
                    f"{len(planned)} devices (the plan then runs on them in its order), or make a plan for these "
                    "(autopp.parallelize(step) without a plan plans for the devices it is given).")

    def _check_counts(self) -> None:
        devices, schedule = self.devices, self.schedule
        if schedule is None:
            schedule = "1f1b"  # num_stages or num_microbatches given: the planner is not used
            _set(self, "schedule", schedule)
        if isinstance(schedule, Schedule):
            if self.num_stages is not None and schedule.num_ranks != self.num_stages:
                raise ValueError(
                    f"{_WHO}: the schedule has {schedule.num_ranks} row(s) (device groups) but "
                    f"num_stages={self.num_stages}; drop num_stages= or give a schedule with {self.num_stages} rows.")
            _set(self, "num_stages", schedule.num_ranks)
        elif self.num_stages is None:
            _set(self, "num_stages", len(devices))
        n = self.num_stages
        if self.device_groups is None and len(devices) % n:
            if isinstance(schedule, Schedule):
                raise ValueError(
                    f"{_WHO}: {len(devices)} devices cannot be split evenly into the schedule's {n} rows (device "
                    f"groups); pass a multiple of {n} devices, e.g. devices=jax.devices()[:{n * (len(devices) // n)}], "
                    f"or a schedule with a number of rows that divides {len(devices)}.")
            raise ValueError(
                f"{_WHO}: {len(devices)} devices cannot be split evenly into {n} stages; pass "
                f"devices=jax.devices()[:{n * (len(devices) // n)}] or a num_stages that divides {len(devices)}.")
        v = self.virtual_stages
        if v is not None:
            if schedule == "dualpipev" and v != 2:
                raise ValueError(f"{_WHO}: dualpipev runs 2 model chunks per device group, not virtual_stages={v}; "
                                 "drop virtual_stages=.")
            if isinstance(schedule, Schedule):
                if v != schedule.num_stages // schedule.num_ranks:
                    raise ValueError(f"{_WHO}: a schedule given as text or a Schedule fixes its own model chunks per "
                                     f"device group (here {schedule.num_stages // schedule.num_ranks}); drop "
                                     f"virtual_stages={v}.")
            elif v > 1 and schedule not in ("interleaved-1f1b", "dualpipev"):
                raise ValueError(f"{_WHO}: virtual_stages={v} needs schedule='interleaved-1f1b' (got {schedule!r}); "
                                 "drop virtual_stages= or use that schedule.")
        elif schedule in ("interleaved-1f1b", "dualpipev"):
            _set(self, "virtual_stages", 2)
        else:
            _set(self, "virtual_stages", 1)
        self._check_schedule_now()

    def _check_schedule_now(self) -> None:
        """With the microbatch count given, build the schedule and check the recompute list now, at
        ``parallelize()``, not at the first step."""
        schedule, n, v, m = self.schedule, self.num_stages, self.virtual_stages, self.num_microbatches
        chunks = schedule.num_stages if isinstance(schedule, Schedule) else n * v
        if isinstance(self.recompute, tuple) and len(self.recompute) != chunks:
            raise ValueError(f"{_WHO}: recompute has {len(self.recompute)} entries for {chunks} stages (model chunks: "
                             f"{n} device groups x {chunks // n}); give one per stage or a single mode.")
        if isinstance(schedule, Schedule) and m is not None and schedule.num_microbatches != m:
            raise ValueError(f"{_WHO}: the schedule has {schedule.num_microbatches} microbatch(es) but "
                             f"num_microbatches={m}; make them agree (or drop num_microbatches=).")
        if m is None or isinstance(schedule, Schedule):
            return
        try:
            get_schedule(schedule, n * v, m, virtual_stages=v)
        except ValueError as e:
            step = n if schedule == "interleaved-1f1b" else 1
            near = sorted({max(step, m - m % step), m - m % step + step} - {m})
            msg = str(e).rstrip(".")
            hint = "" if "use " in msg else f"; e.g. num_microbatches={' or '.join(str(x) for x in near if x != m)}"
            raise ValueError(f"{_WHO}: schedule={schedule!r} with num_stages={n} and num_microbatches={m}: "
                             f"{msg}{hint}.") from None

    def group_devices(self, num_groups: int) -> list[tuple[jax.Device, ...]]:
        """The devices of each of ``num_groups`` device groups: the groups given, or consecutive equal slices."""
        if self.device_groups is not None:
            return list(self.device_groups)
        per = len(self.devices) // num_groups
        return [self.devices[r * per:(r + 1) * per] for r in range(num_groups)]

"""Progress display for the slow phases of a pipelined step's first call: tracing, profiling, planning,
compiling.

While a phase runs, a spinner shows its description and the elapsed time; when it ends, one line says what
it did and how long it took. Shown on stderr when it is a terminal (or a Jupyter notebook), silent otherwise.
The environment variable ``AUTOPP_PROGRESS`` overrides that: ``0`` (or ``false``/``off``/``no``) turns it off,
``1`` (or ``true``/``on``/``yes``) prints the finished phases' lines even when stderr is not a terminal.

    with phase("compiling the pipeline") as p:
        exe = build()
        p.done(f"compiled {n} programs")
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # rich is imported only when progress is shown
    from rich.console import Console
    from rich.progress import Progress

ENV = "AUTOPP_PROGRESS"
_OFF = ("0", "false", "off", "no")
_ON = ("1", "true", "on", "yes")

_override: Console | None = None
_progress: Progress | None = None  # the live display while a phase runs (nested phases add rows to it)


class Phase:
    """A running phase: :meth:`update` changes the description shown, :meth:`done` the line printed at its end."""

    def __init__(self, description: str, progress: Progress | None = None, task=None):
        self.description = description
        self.summary: str | None = None
        self._progress, self._task = progress, task

    def update(self, description: str) -> None:
        self.description = description
        if self._progress is not None:
            from rich.markup import escape

            self._progress.update(self._task, description=escape(description))

    def done(self, summary: str) -> None:
        """What to print when the phase ends (default: its description)."""
        self.summary = summary


def _console() -> Console | None:
    """The console to show progress on, or None when progress is off."""
    mode = os.environ.get(ENV, "").strip().lower()
    if mode in _OFF:
        return None
    if _override is not None:
        return _override
    isatty = getattr(sys.stderr, "isatty", None)
    # rich's Jupyter check needs IPython's get_ipython: without IPython loaded, skip importing rich at all
    if not ((isatty is not None and isatty()) or mode in _ON or "IPython" in sys.modules):
        return None
    from rich.console import Console

    console = Console(stderr=True)
    if (isatty is not None and isatty()) or console.is_jupyter:
        return console
    if mode in _ON:  # a log file or pipe: whole lines, not wrapped at rich's default 80 columns
        return Console(stderr=True, width=200, soft_wrap=True)
    return None


@contextlib.contextmanager
def use_console(console: Console | None) -> Iterator[None]:
    """Show progress on ``console`` (e.g. ``rich.console.Console(file=..., force_terminal=True)``) inside the
    block, whether or not stderr is a terminal (``AUTOPP_PROGRESS=0`` still turns it off); None restores the
    default."""
    global _override
    old, _override = _override, console
    try:
        yield
    finally:
        _override = old


@contextlib.contextmanager
def phase(description: str) -> Iterator[Phase]:
    """Show ``description`` with a spinner while the block runs, then a line with the time it took."""
    global _progress
    outer = _progress is None
    console = _console() if outer else _progress.console
    if console is None:
        yield Phase(description)
        return
    from rich.markup import escape
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    live = outer and (console.is_terminal or console.is_jupyter)  # else only the finished phases' lines
    if live:
        _progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                             console=console, transient=True)
        _progress.start()
    progress = _progress
    task = progress.add_task(escape(description), total=None) if progress is not None else None
    handle = Phase(description, progress, task)
    t0 = time.perf_counter()
    ok = False
    try:
        yield handle
        ok = True
    finally:
        if progress is not None:
            progress.remove_task(task)
        took = f"[dim]{time.perf_counter() - t0:.1f} s[/dim]"
        if ok:
            console.print(f"[green]✓[/green] {escape(handle.summary or handle.description)}  {took}", highlight=False)
        else:
            console.print(f"[red]✗[/red] {escape(handle.description)} failed  {took}", highlight=False)
        if live:
            progress.stop()
            _progress = None

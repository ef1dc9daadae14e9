"""One progress display for long work (profile, synth, fit, solve, evaluate), on stderr.

On a terminal it is a rich bar, transient (gone when the work ends). Anywhere else (a CI
job's log, a pipe) rich draws nothing live, so the same calls print a plain line at most
every ``log_every`` seconds instead, and a last one when the work ends; work shorter than
that prints nothing, so short runs and their captured output stay clean. ``--json`` runs
pass ``enabled=False``.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Iterator

# Seconds between two plain progress lines when stderr is not a terminal.
LOG_EVERY = 30.0

Advance = Callable[..., None]


@contextlib.contextmanager
def progress_bar(
    enabled: bool, what: str, total: int, *, unit: str = "", log_every: float = LOG_EVERY
) -> Iterator[Advance]:
    """Yield ``advance(n=1, detail="")``, which counts ``n`` more of ``total`` done.

    Args:
        enabled: False draws and prints nothing.
        what: the label ("fitting", "solve (ceo)").
        total: the amount of work, in ``unit``s (rows, layers, prompts).
        unit: the unit's name, shown after the count ("layers").
        log_every: seconds between plain lines when stderr is not a terminal.

    ``detail`` is a short text shown after the count (e.g. a rate), the latest one given.
    """
    if not enabled:
        yield lambda n=1, detail="": None
        return
    from rich.console import Console

    console = Console(stderr=True)
    if console.is_terminal:
        with _rich_bar(console, what, total, unit) as advance:
            yield advance
    else:
        with _log_lines(what, total, unit, log_every) as advance:
            yield advance


@contextlib.contextmanager
def _rich_bar(console, what: str, total: int, unit: str) -> Iterator[Advance]:
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    columns = (
        TextColumn(what), BarColumn(), MofNCompleteColumn(), TextColumn(unit),
        TextColumn("{task.fields[detail]}"), TimeElapsedColumn(), TimeRemainingColumn(),
    )  # fmt: skip
    with Progress(*columns, console=console, transient=True) as bar:
        task = bar.add_task(what, total=total, detail="")

        def advance(n: int = 1, detail: str | None = None) -> None:
            if detail is None:
                bar.advance(task, n)
            else:
                bar.update(task, advance=n, detail=detail)

        yield advance


class _LogLines:
    """Plain progress lines on stderr, at most one every ``log_every`` seconds."""

    def __init__(self, what: str, total: int, unit: str, log_every: float):
        self.what, self.total, self.unit, self.log_every = what, total, unit, log_every
        self.start = self.last = time.monotonic()
        self.done, self.detail, self.lines = 0, "", 0

    def advance(self, n: int = 1, detail: str | None = None) -> None:
        self.done += n
        if detail is not None:
            self.detail = detail
        now = time.monotonic()
        if now - self.last >= self.log_every:
            self.last = now
            self.line(now)

    def line(self, now: float) -> None:
        unit = f" {self.unit}" if self.unit else ""
        share = f" ({100 * self.done / self.total:.0f}%)" if self.total else ""
        detail = f"  {self.detail}" if self.detail else ""
        seconds = now - self.start
        print(
            f"{self.what}: {self.done}/{self.total}{unit}{share}{detail}  {seconds:.0f} s",
            file=sys.stderr,
            flush=True,
        )
        self.lines += 1


@contextlib.contextmanager
def _log_lines(what: str, total: int, unit: str, log_every: float) -> Iterator[Advance]:
    log = _LogLines(what, total, unit, log_every)
    yield log.advance
    if log.lines:  # the work outlasted one interval: say where it ended
        log.line(time.monotonic())

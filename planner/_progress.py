"""One progress bar for streaming work (fit, synth, evaluate): rich, on stderr, transient."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator


@contextlib.contextmanager
def progress_bar(enabled: bool, what: str, total: int) -> Iterator[Callable[[int], None]]:
    """Yield ``advance(n)``; draws a bar labelled ``what`` on stderr when ``enabled``.

    The bar is transient (gone when the work ends) and drawn only on a terminal, so logs and
    ``--json`` output stay clean.
    """
    if not enabled:
        yield lambda n: None
        return
    from rich.console import Console
    from rich.progress import Progress

    with Progress(console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(what, total=total)
        yield lambda n: bar.advance(task, n)

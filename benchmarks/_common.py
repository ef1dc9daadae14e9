"""Helpers shared by the benchmark scripts (run as ``python benchmarks/<name>.py``)."""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import sys
from collections.abc import Callable, Collection
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


def peak_rss_mib() -> float:
    """This process's peak resident set size in MiB (VmHWM: unlike ru_maxrss it is not
    inherited from the parent across fork and exec)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        pass
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


def emit_json(report: dict, out: str | Path | None = None, **dumps_kwargs) -> None:
    """Print ``report`` as indented JSON; also write it to ``out`` when given."""
    text = json.dumps(report, indent=2, **dumps_kwargs)
    print(text)
    if out:
        Path(out).write_text(text + "\n")


def run(main: Callable[[], object]) -> None:
    """Run a benchmark's ``main`` and exit with its status (an int; anything else, such as
    the report ``profile_overhead`` returns, is success); a moeplan error or a missing or
    unreadable file is one line on stderr and exit 2, not a traceback."""
    from planner.errors import MoeplanError

    try:
        status = main()
    except (MoeplanError, OSError) as e:
        what = f"{type(e).__name__}: {e}" if isinstance(e, OSError) else str(e)
        print(f"{Path(sys.argv[0]).name}: error: {what}", file=sys.stderr)
        sys.exit(2)
    sys.exit(status if isinstance(status, int) and not isinstance(status, bool) else 0)


class ArgumentParser(argparse.ArgumentParser):
    """The benchmarks' argument parser: ``--help`` shows the whole module docstring as it is
    written, and a bad argument is one line, ``script.py: error: ...``, and exit 2 (plain
    argparse prints its usage lines first)."""

    def __init__(self, doc: str | None, **kwargs) -> None:
        kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
        super().__init__(description=doc, **kwargs)

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def _int(text: str) -> int:
    try:
        return int(text.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None


def bounded_int(least: int) -> Callable[[str], int]:
    """An argparse ``type``: an integer of at least ``least``."""

    def parse(text: str) -> int:
        value = _int(text)
        if value < least:
            raise argparse.ArgumentTypeError(f"must be at least {least}, got {value}")
        return value

    return parse


positive_int = bounded_int(1)
positive_int.__doc__ = "An argparse ``type``: an integer of at least 1."
nonnegative_int = bounded_int(0)
nonnegative_int.__doc__ = "An argparse ``type``: an integer of at least 0."


def comma_list(item: Callable[[str], T]) -> Callable[[str], list[T]]:
    """An argparse ``type``: comma-separated values, each parsed by ``item`` (which raises
    ``argparse.ArgumentTypeError`` naming a bad one); blanks between commas are dropped,
    and at least one value is needed."""

    def parse(text: str) -> list[T]:
        parts = [p.strip() for p in text.split(",") if p.strip()]
        if not parts:
            raise argparse.ArgumentTypeError(f"{text!r} names no value (comma-separated)")
        return [item(p) for p in parts]

    return parse


def int_list(least: int | None = None) -> Callable[[str], list[int]]:
    """An argparse ``type``: comma-separated integers, each at least ``least`` when given."""
    return comma_list(_int if least is None else bounded_int(least))


def float_list(least: float | None = None) -> Callable[[str], list[float]]:
    """An argparse ``type``: comma-separated finite numbers, each at least ``least`` when
    given."""

    def item(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not math.isfinite(value) or (least is not None and value < least):
            floor = "" if least is None else f" of at least {least:g}"
            raise argparse.ArgumentTypeError(f"{text!r} is not a finite number{floor}")
        return value

    return comma_list(item)


def choice_list(choices: Collection[str]) -> Callable[[str], list[str]]:
    """An argparse ``type``: comma-separated names, each one of ``choices``."""

    def item(text: str) -> str:
        if text not in choices:
            raise argparse.ArgumentTypeError(
                f"unknown name {text!r}; choose from {', '.join(choices)}"
            )
        return text

    return comma_list(item)


def seed_range(text: str) -> tuple[int, int]:
    """An argparse ``type``: ``A:B`` with 0 <= A < B."""
    try:
        lo, hi = (int(part) for part in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be A:B, got {text!r}") from None
    if not 0 <= lo < hi:
        raise argparse.ArgumentTypeError(f"must be A:B with 0 <= A < B, got {text!r}")
    return lo, hi


def output_path(text: str) -> str:
    """An argparse ``type`` for ``--out FILE``: refused before any work unless its folder
    exists and is writable (and the path is no folder itself)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("the path is empty")
    path = Path(text)
    folder = path.parent
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a folder; give a file path")
    if not folder.is_dir():
        raise argparse.ArgumentTypeError(f"folder {str(folder)!r} of {text} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"folder {str(folder)!r} of {text} is not writable")
    return text


def add_gather_shape(parser: argparse.ArgumentParser) -> None:
    """The row gather's shape options of ``rebatch_speed`` and ``rebatch_tune``: ``--tokens``
    T, ``--hidden`` H and ``--ep`` E (16384 x 4096 rows over 8 devices by default)."""
    parser.add_argument(
        "--tokens", type=positive_int, default=16384, help="rows T, at least 1 (default 16384)"
    )
    parser.add_argument(
        "--hidden", type=positive_int, default=4096, help="row width H, at least 1 (default 4096)"
    )
    parser.add_argument(
        "--ep", type=positive_int, default=8, help="EP size (devices), at least 1 (default 8)"
    )


def add_out_option(parser: argparse.ArgumentParser) -> None:
    """``--out FILE``: also write the report's JSON there, its folder checked before any work
    (:func:`output_path`)."""
    parser.add_argument(
        "--out", type=output_path, default=None, help="also write the JSON here (default: no)"
    )


def gather_bytes(read_rows: int, written_rows: int, hidden: int, element_size: int) -> int:
    """Bytes a row gather moves, read plus written: the source rows it reads, the rows it
    writes (padding rows are written but not read) and its int64 index, one entry per
    written row."""
    return (read_rows + written_rows) * hidden * element_size + written_rows * 8


def time_cuda(fn: Callable[[], object], repeats: int) -> float:
    """Median milliseconds of ``fn`` over ``repeats`` calls on the current CUDA stream, timed
    with CUDA events after one warm-up call."""
    import statistics

    import torch

    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(repeats):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)

"""Helpers shared by the benchmark scripts (run as ``python benchmarks/<name>.py``)."""

from __future__ import annotations

import json
import resource
import sys
from collections.abc import Callable
from pathlib import Path


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

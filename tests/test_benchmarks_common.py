"""benchmarks/_common.run: a benchmark's exit status."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from planner.errors import InputError

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "_common.py"


def _run():
    spec = importlib.util.spec_from_file_location("benchmarks_common", _PATH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.run


@pytest.mark.parametrize(
    ("returned", "code"), [(None, 0), (0, 0), (3, 3), ({"overhead_pct": 2.5}, 0)]
)
def test_a_benchmark_exits_with_its_status(returned, code):
    """profile_overhead's main returns its report: sys.exit(report) printed the dict to
    stderr and exited 1 after a run that had succeeded."""
    with pytest.raises(SystemExit) as done:
        _run()(lambda: returned)
    assert done.value.code == code


def test_a_moeplan_error_is_one_line_and_exit_2(capsys):
    def fails():
        raise InputError("bad input")

    with pytest.raises(SystemExit) as done:
        _run()(fails)
    assert done.value.code == 2
    assert capsys.readouterr().err.strip().endswith("error: bad input")

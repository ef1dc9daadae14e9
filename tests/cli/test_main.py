"""The console script: user errors are one line and a non-zero exit, never a traceback."""

from __future__ import annotations

import subprocess
import sys

from planner.cli.main import main


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "planner.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_missing_trace_is_one_line_without_traceback(tmp_path):
    r = _run("trace", "info", str(tmp_path / "missing"))
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines() == [
        f"moeplan: error: {tmp_path / 'missing'}: no such trace file or directory"
    ]


def test_usage_error_exits_non_zero(capsys):
    assert main(["trace", "info"]) == 2
    assert "Missing argument" in capsys.readouterr().err
    assert main(["no-such-command"]) == 2


def test_help_lists_the_stages(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for command in ("profile", "trace"):
        assert command in out

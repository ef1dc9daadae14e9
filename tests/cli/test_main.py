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


def test_paths_and_names_print_as_given_not_as_markup(tmp_path, capsys):
    # "[v2]" was swallowed as a style tag; "[/x]" raised rich's MarkupError after writing
    for name in ("runs[v2]", "mk[/x]"):
        out = tmp_path / name / "t"
        args = ["trace", "synth", "--out", str(out), "--layers", "2", "--experts", "4"]
        args += ["--top-k", "1", "--vocab", "50", "--tokens", "200", "--requests", "4"]
        assert main([*args, "--model", "org/[/bold]m"]) == 0
        assert f"wrote {out}:" in capsys.readouterr().out
        assert main(["trace", "info", str(out)]) == 0
        assert "org/[/bold]m" in capsys.readouterr().out
    assert main(["trace", "info", str(tmp_path / "x[/y]")]) == 2
    assert "x[/y]: no such trace" in capsys.readouterr().err


def test_running_out_of_memory_is_one_line(monkeypatch, capsys):
    """Sizes too large for the machine (``trace synth --layers 100000``) end in one line."""
    import numpy as np

    import planner.trace.synth as synth

    def too_big(*args, **kwargs):
        np.empty(1 << 50, np.float64)  # numpy's own MemoryError, as a real run raises it

    monkeypatch.setattr(synth, "timed_synthesize", too_big)
    assert main(["trace", "synth", "--out", "never"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("moeplan: error: not enough memory (Unable to"), err

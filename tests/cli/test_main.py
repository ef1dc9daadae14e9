"""The console script: user errors are one line and a non-zero exit, never a traceback."""

from __future__ import annotations

import subprocess
import sys

from planner.cli.main import main
from tests.conftest import child_env


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "planner.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=child_env(),
    )


def test_missing_trace_is_one_line_without_traceback(tmp_path):
    r = _run("trace", "info", str(tmp_path / "missing"))
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines() == [
        f"moeplan: error: {tmp_path / 'missing'}: no such trace file or directory"
    ]


def test_usage_error_exits_non_zero(capsys):
    # one line like every other error (click printed usage, a hint and the error on four)
    assert main(["trace", "info"]) == 2
    assert capsys.readouterr().err == (
        "moeplan: error: Missing argument 'path'. (see moeplan trace info --help)\n"
    )
    assert main(["fit", "t", "--holdout", "half"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("moeplan: error: Invalid value for '--holdout'") and err.count("\n") == 1
    assert main(["no-such-command"]) == 2
    assert capsys.readouterr().err == (
        "moeplan: error: No such command 'no-such-command'. (see moeplan --help)\n"
    )


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


def test_what_the_machine_refuses_is_one_line(tmp_path, capsys):
    """A legal name that the temporary name makes too long (any OSError: a full or read-only
    disk alike) was a traceback."""
    out = tmp_path / ("a" * 250)
    args = [
        "trace",
        "synth",
        "--out",
        str(out),
        "--layers",
        "1",
        "--tokens",
        "100",
        "--requests",
        "2",
    ]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "File name too long" in err[0], err
    assert not out.exists()


def test_interrupts_and_sigterm_say_what_was_kept(monkeypatch, capsys):
    import planner.cli.main as cli_main
    import planner.trace.synth as synth

    # typer turns Ctrl-C in a command into Exit(130): it printed a blank line, nothing more
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(synth, "timed_synthesize", interrupted)
    assert main(["trace", "synth", "--out", "never"]) == 130
    assert "moeplan: interrupted; no output was half-written" in capsys.readouterr().err
    monkeypatch.setattr(
        synth, "timed_synthesize", lambda *a, **k: cli_main._raise_terminated(15, None)
    )
    assert main(["trace", "synth", "--out", "never"]) == 143
    assert "moeplan: terminated; no output was half-written" in capsys.readouterr().err


def test_ctrl_c_while_the_command_line_loads_is_one_line(monkeypatch, capsys):
    # the console script imports torch and the solvers first: a Ctrl-C there printed the
    # interpreter's traceback
    import types

    import pytest

    from planner.cli import entry

    class Loading(types.ModuleType):
        def __getattr__(self, name):
            raise KeyboardInterrupt

    monkeypatch.setitem(sys.modules, "planner.cli.main", Loading("planner.cli.main"))
    with pytest.raises(SystemExit) as stop:
        entry.run()
    assert stop.value.code == 130
    assert capsys.readouterr().err == "moeplan: interrupted while starting; nothing was written\n"


def test_compare_table_explains_a_plan_above_the_token_bound():
    # The bound is per token id (the best any token table can do); the n-gram table chooses
    # per context and can pass it, where the caption says why the gap is negative.
    from rich.console import Console

    from planner.cli.solve import comparison_table

    def caption(gap: float) -> str:
        result = {
            "rows": [{"method": "metis", "lar_balanced": 0.15, "gap_to_bound": gap}],
            "oracle_bound": 0.15 + gap,
            "lar_vanilla": 0.1,
            "best_baseline": "metis",
            "requests": 20,
        }
        console = Console(width=400, record=True)
        console.print(comparison_table(result, "t"))
        return console.export_text()

    assert "passed the best any token table could do" in caption(-0.005)
    assert "passed the best" not in caption(0.01)

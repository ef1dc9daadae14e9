"""The console script: user errors are one line and a non-zero exit, never a traceback."""

from __future__ import annotations

import subprocess
import sys

import pytest

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
    for command in ("profile", "trace", "fit", "solve", "compare", "export", "evaluate"):
        assert command in out, command


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


def _tiny_trace(tmp_path, name="t"):
    out = tmp_path / name
    args = ["trace", "synth", "--out", str(out), "--layers", "2", "--experts", "4", "--top-k"]
    args += ["1", "--vocab", "50", "--tokens", "200", "--requests", "4"]
    assert main(args) == 0
    return out


def test_json_stays_json_when_colour_is_forced(tmp_path):
    """rich's print_json coloured --json output whenever FORCE_COLOR was set (CI jobs set
    it), even into a pipe: the output was not JSON."""
    import json

    trace = _tiny_trace(tmp_path)
    r = subprocess.run(
        [sys.executable, "-m", "planner.cli.main", "trace", "info", str(trace), "--json"],
        capture_output=True, text=True, timeout=120, env=child_env(FORCE_COLOR="1"),
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["tokens"] == 200


def test_bare_group_prints_its_help_as_it_reads(capsys):
    """`moeplan` alone printed the whole help squashed into one 'error' line."""
    assert main([]) == 2
    err = capsys.readouterr().err
    assert err.startswith("Usage: moeplan") and err.count("\n") > 5
    assert main(["trace"]) == 2
    assert capsys.readouterr().err.startswith("Usage: moeplan trace")


def test_deep_config_and_options_are_one_line(tmp_path, capsys):
    """Deeply nested TOML or JSON was a RecursionError traceback."""
    import sys

    # at Python's default limit: mypy, run in this process by tests/test_types.py, raises
    # it, and 1000 levels then parse
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(1000)
    try:
        deep = tmp_path / "deep.toml"
        deep.write_text("[solve]\nseed = " + "[" * 1000 + "]" * 1000 + "\n")
        assert main(["--config", str(deep), "trace", "info", "x"]) == 2
        assert "not valid TOML (nested too deeply)" in capsys.readouterr().err
        opts = '{"ceo":' + "[" * 1000 + "]" * 1000 + "}"
        args = ["solve", str(tmp_path / "i"), "--out", str(tmp_path / "o"), "--ep", "2"]
        args += ["--options", opts]
        assert main(args) == 2
        assert "--options is not JSON (nested too deeply)" in capsys.readouterr().err
    finally:
        sys.setrecursionlimit(limit)


def test_config_that_is_empty_or_not_a_file(capsys):
    """--config "" was ignored silently; /dev/null was 'no such file'."""
    assert main(["--config", "", "trace", "info", "x"]) == 2
    assert capsys.readouterr().err == "moeplan: error: --config is empty; name a TOML file\n"
    assert main(["--config", "/dev/null", "trace", "info", "x"]) == 2
    assert "is not a regular file" in capsys.readouterr().err


def test_a_name_the_terminal_cannot_encode_is_escaped(tmp_path):
    """With an ascii stdout the summary naming 'plän' raised UnicodeEncodeError after the
    trace had been written."""
    out = tmp_path / "plän.parquet"
    args = ["trace", "synth", "--out", str(out), "--layers", "2", "--experts", "4", "--top-k"]
    args += ["1", "--vocab", "50", "--tokens", "200", "--requests", "4"]
    r = subprocess.run(  # run(), the console script's entry, reads sys.argv[1:]
        [sys.executable, "-c", "from planner.cli.main import run; run()", *args],
        capture_output=True, text=True, timeout=120, env=child_env(PYTHONIOENCODING="ascii"),
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "pl\\xe4n.parquet" in r.stdout and "Traceback" not in r.stderr


def test_solve_refuses_options_it_would_not_use(tmp_path, capsys):
    """--options for another method than --method was accepted without even being checked,
    and --chain-passes with vanilla did nothing."""
    base = ["solve", str(tmp_path / "i"), "--out", str(tmp_path / "o"), "--ep", "2"]
    assert main([*base, "--method", "metis", "--options", '{"ceo": {"variant": "x"}}']) == 2
    assert "--options sets 'ceo' but solve runs --method metis" in capsys.readouterr().err
    assert main([*base, "--method", "vanilla", "--chain-passes", "2"]) == 2
    assert "--chain-passes does not apply to --method vanilla" in capsys.readouterr().err


@pytest.mark.parametrize(
    "args, flag",
    [
        (["profile", "--model", "M", "--prompts", "P", "--out", ""], "--out"),
        (["profile", "--model", "", "--prompts", "P", "--out", "o"], "--model"),
        (["trace", "synth", "--out", ""], "--out"),
        (["trace", "synth", "--out", "", "--force"], "--out"),
        (["trace", "ingest", "sglang", "D", "--out", ""], "--out"),
        (["trace", "split", "T", "--fit-out", "", "--heldout-out", "h"], "--fit-out"),
        (["trace", "split", "T", "--fit-out", "f", "--heldout-out", ""], "--heldout-out"),
        (["trace", "shuffle", "T", "--out", ""], "--out"),
        (["trace", "info", "T", "--plot", ""], "--plot"),
        (["fit", "T", "--out", ""], "--out"),
        (["fit", "T", "--out", "p", "--embeddings", ""], "--embeddings"),
        (["solve", "P", "--ep", "2", "--out", ""], "--out"),
        (["compare", "P", "H", "--ep", "2", "--plot", ""], "--plot"),
        # inputs: "" read the folder the command ran in, as a plan or trace where it was one
        (["trace", "info", ""], "{path}"),
        (["trace", "ingest", "sglang", "D", "", "--out", "o"], "{dumps}"),
        (["trace", "split", "", "--fit-out", "f", "--heldout-out", "h"], "{path}"),
        (["trace", "shuffle", "", "--out", "o"], "{path}"),
        (["fit", "", "--out", "p"], "{trace}"),
        (["solve", "", "--ep", "2", "--out", "o"], "{predictor}"),
        (["solve", "P", "--ep", "2", "--out", "o", "--align-to", ""], "--align-to"),
        (["compare", "", "H", "--ep", "2"], "{predictor}"),
        (["compare", "P", "", "--ep", "2"], "{heldout}"),
        (["compare", "P", "H", "--ep", "2", "--fitting", ""], "--fitting"),
        (["export", "", "--out", "b"], "{plan}"),
        (["export", "", "--verify"], "{plan}"),
        (["evaluate", "", "H"], "{plan}"),
        (["evaluate", "P", ""], "{heldout}"),
        (["evaluate", "P", "H", "--against", ""], "--against"),
    ],
)
def test_an_empty_path_is_named_not_taken_for_the_current_directory(
    args, flag, tmp_path, monkeypatch, capsys
):
    """Path("") is ".": `profile --out ''` wrote its parts into the folder it ran in, `trace
    synth --out ''` said ".: already exists", `split` that the two sides were nested, and
    `trace info --plot ''` drew nothing without a word."""
    monkeypatch.chdir(tmp_path)
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err == f"moeplan: error: {flag} is empty; give a path\n"
    assert not any(tmp_path.iterdir())

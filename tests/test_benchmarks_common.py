"""benchmarks/_common: a benchmark's exit status, the shared argument types, and the scripts'
one-line refusal of bad arguments before any work."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from planner.errors import InputError
from tests.conftest import child_env, load_script

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
_PATH = BENCHMARKS / "_common.py"


def _common():
    return load_script(_PATH, "benchmarks_common")


def _run():
    return _common().run


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


# The argument types ---------------------------------------------------------------------


def _refused(parse, text: str) -> str:
    with pytest.raises(argparse.ArgumentTypeError) as refused:
        parse(text)
    return str(refused.value)


def test_positive_and_nonnegative_int():
    common = _common()
    assert common.positive_int("1") == 1
    assert common.positive_int(" 16384 ") == 16384
    assert common.nonnegative_int("0") == 0
    for text in ("0", "-1", "abc", "1.5", ""):
        assert _refused(common.positive_int, text)
    for text in ("-1", "x"):
        assert _refused(common.nonnegative_int, text)
    assert "at least 1" in _refused(common.positive_int, "0")


def test_int_list():
    common = _common()
    assert common.int_list(least=1)("250000, 1000000") == [250000, 1000000]
    assert common.int_list(least=1)("8,,32") == [8, 32]  # blanks dropped
    assert common.int_list()("-3,0") == [-3, 0]
    assert "at least 1" in _refused(common.int_list(least=1), "1000,-5")
    assert "at least 0" in _refused(common.int_list(least=0), "0,-1")
    for text in ("abc", "1,x", "", ","):
        assert _refused(common.int_list(least=1), text)


def test_float_list():
    common = _common()
    assert common.float_list(least=0)("0,0.0005, 0.005") == [0.0, 0.0005, 0.005]
    for text in ("x", "-0.1", "nan", "inf", ""):
        assert _refused(common.float_list(least=0), text)


def test_choice_list():
    common = _common()
    ngram = common.choice_list(("top1", "routed"))
    assert ngram("top1") == ["top1"]
    assert ngram("top1, routed") == ["top1", "routed"]
    message = _refused(ngram, "top1,bogus")
    assert "'bogus'" in message and "top1, routed" in message
    assert _refused(ngram, "")
    assert _refused(common.choice_list({"bf16": 1, "fp32": 2}), "fp16")


def test_output_path(tmp_path):
    common = _common()
    out = str(tmp_path / "report.json")
    assert common.output_path(out) == out
    assert "does not exist" in _refused(common.output_path, str(tmp_path / "no" / "x.json"))
    assert "folder" in _refused(common.output_path, str(tmp_path))
    assert _refused(common.output_path, "")


def test_the_parser_shows_the_whole_docstring_and_errs_in_one_line(capsys):
    parser = _common().ArgumentParser("First line.\n\n    second  paragraph, as written\n")
    parser.add_argument("--repeats", type=_common().positive_int, help="runs (default 3)")
    assert "    second  paragraph, as written" in parser.format_help()
    with pytest.raises(SystemExit) as done:
        parser.parse_args(["--repeats", "0"])
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "error: argument --repeats: must be at least 1" in err


def test_gather_bytes_counts_rows_read_and_written_and_the_index():
    # rebatch: 10 rows read, 16 written (6 padding), 16 int64 index entries
    assert _common().gather_bytes(10, 16, 4, 2) == (10 + 16) * 4 * 2 + 16 * 8


# The scripts ----------------------------------------------------------------------------


def _bad_counts(tmp_path: Path) -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "counts.parquet"
    pq.write_table(pa.table({"token_id": [1], "expert": [0], "count": [3]}), path)
    return str(path)


# (script, arguments, what the one line says). Each is refused before any work; before, each
# was a traceback, or was accepted (a wrong measurement, or an error after minutes of work).
BAD_ARGUMENTS = [
    ("evaluate_speed.py", ["--tokens", "abc"], "--tokens"),
    ("evaluate_speed.py", ["--tokens", "1000,-5"], "at least 1"),
    ("evaluate_speed.py", ["--tokens", "1000", "--out", "{tmp}/missing/x.json"], "--out"),
    ("fit_throughput.py", ["--scaling", "abc"], "--scaling"),
    ("solve_speed.py", ["--ep", "x"], "--ep"),
    (
        "solve_speed.py",
        ["--occurrences", "2000", "--ep", "2", "--methods", "vanilla,bogus"],
        "unknown solver method 'bogus'",
    ),
    ("solve_speed.py", ["--occurrences", "2000", "--ep", "2", "--methods", "ceo:bogus"], "ceo:"),
    (
        "solve_speed.py",
        ["--occurrences", "2000", "--ep", "2", "--methods", "vanilla", "--full"]
        + ["--model-layers", "0"],
        "--model-layers",
    ),
    ("solve_quality.py", ["--seed", "-1"], "--seed"),
    ("solve_quality.py", ["--counts", "{counts}"], "model, domain, layer"),
    ("replan_moves.py", ["--costs", "x"], "--costs"),
    ("solve_fuzz.py", ["--seeds", "5:2"], "--seeds"),
    ("solve_fuzz.py", ["--out", "{tmp}/missing/x.json"], "--out"),
    ("token_packing.py", ["--seeds", "x"], "--seeds"),
    ("token_packing.py", ["--out", "{tmp}/missing/x.json"], "--out"),
    (
        "compare_traces.py",
        ["--sources", "synth-mixtral", "--seeds", "0", "--ep", "2", "--ngram", "bogus"],
        "top1, routed",
    ),
    (
        "compare_traces.py",
        ["--sources", "synth-mixtral,bogus", "--seeds", "0", "--ep", "2", "--ngram", "top1"],
        "unknown name 'bogus'",
    ),
    ("rebatch_speed.py", ["--tokens", "64", "--hidden", "8", "--dtypes", "fp16"], "fp16"),
    ("bundle_size.py", ["--repeats", "0"], "--repeats"),
    (
        "profile_overhead.py",
        ["--max-prompts", "0", "--repeats", "1", "--max-length", "16"],
        "--max-prompts",
    ),
]


@pytest.mark.parametrize(
    ("script", "args", "says"),
    BAD_ARGUMENTS,
    ids=[f"{s} {' '.join(a)}" for s, a, _ in BAD_ARGUMENTS],
)
def test_a_bad_argument_is_one_line_and_exit_2_before_any_work(tmp_path, script, args, says):
    counts = _bad_counts(tmp_path)
    args = [a.format(tmp=tmp_path, counts=counts) for a in args]
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), *args],
        capture_output=True, text=True, timeout=120, env=child_env(), cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith(f"{script}: error: "), done.stderr
    assert says in done.stderr
    assert done.stdout == ""  # no report: refused before the work


_HELP_PROBE = """
import pathlib, runpy, sys

benchmarks = pathlib.Path(sys.argv[1])
sys.path.insert(0, str(benchmarks))
import _common


class Parsed(Exception):
    pass


def parse_args(self, args=None, namespace=None):
    raise Parsed(self)


_common.ArgumentParser.parse_args = parse_args
for script in sorted(benchmarks.glob("[!_]*.py")):
    sys.argv = [str(script)]
    try:
        runpy.run_path(str(script), run_name="__main__")
        print(script.name, "never-parsed", 0)
    except Parsed as parsed:
        parser = parsed.args[0]
        bare = [a.option_strings[-1] for a in parser._actions if a.option_strings and not a.help]
        print(script.name, ",".join(bare) or "ok", (parser.description or "").count("\\n"))
"""


def test_every_option_of_every_benchmark_has_help():
    """``--help`` showed the module docstring's first line only, and many options with no
    word on their values or default."""
    done = subprocess.run(
        [sys.executable, "-c", _HELP_PROBE, str(BENCHMARKS)],
        capture_output=True, text=True, timeout=120, env=child_env(),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    rows = [line.split() for line in done.stdout.strip().splitlines()]
    assert [r[0] for r in rows] == sorted(p.name for p in BENCHMARKS.glob("[!_]*.py"))
    for name, bare, doc_lines in rows:
        assert bare == "ok", f"{name}: options without help: {bare}"
        assert int(doc_lines) > 3, f"{name}: the description is not the whole docstring"

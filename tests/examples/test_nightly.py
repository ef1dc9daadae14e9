"""examples/nightly_replan.sh: fresh traces in, the serving bundle replaced only when better."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from planner._io import exchange_paths
from planner.cli.main import main
from planner.trace.synth import SynthConfig, synthesize
from tests.conftest import child_env

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "examples" / "nightly_replan.sh"
SYNTH = SynthConfig(
    num_layers=3, num_experts=8, top_k=2, vocab_size=300, num_tokens=3000, num_requests=40,
    affinity=0.8, layer_correlation=0.5, num_domains=2, seed=11,
)  # fmt: skip


def _nightly(
    fresh: Path, deployed: Path, work: Path, python: str = sys.executable, **env_extra: str
) -> subprocess.CompletedProcess:
    # this checkout's moeplan (child_env puts it first on the path), whatever is installed
    moeplan = fresh.parent / f"moeplan-{work.name}"
    moeplan.write_text(
        f"#!/bin/sh\nexec {shlex.quote(sys.executable)} -c "
        "'from planner.cli.entry import run; run()' \"$@\"\n"
    )
    moeplan.chmod(0o755)
    env = child_env(
        METHOD="kmeans", JOBS="1", FORMATS="moeplan", MOEPLAN=str(moeplan), PYTHON=python,
        **env_extra,
    )  # fmt: skip
    return subprocess.run(
        ["bash", str(SCRIPT), str(fresh), str(deployed), str(work)],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip


def _python_whose_swap_exits(status: int, path: Path) -> Path:
    """A PYTHON for the script whose one-step swap exits with ``status`` (3: the system
    cannot swap; 1: as a Python that cannot import planner does), and runs the rest."""
    path.write_text(
        f'#!/bin/sh\ncase "$2" in *exchange_paths*) exit {status} ;; esac\n'
        f'exec {shlex.quote(sys.executable)} "$@"\n'
    )
    path.chmod(0o755)
    return path


def _files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


@pytest.fixture(scope="module")
def deployed(tmp_path_factory):
    """A fresh trace, and the default deployment (vanilla) exported as the serving bundle."""
    d = tmp_path_factory.mktemp("nightly")
    fresh = synthesize(SYNTH, d / "fresh")
    assert main(["fit", str(fresh), "--out", str(d / "pred"), "--json"]) == 0
    solve = ["solve", str(d / "pred"), "--ep", "4", "--method", "vanilla", "--json"]
    assert main([*solve, "--out", str(d / "plan")]) == 0
    assert main(["export", str(d / "plan"), "--out", str(d / "serving"), "--json"]) == 0
    return d, fresh, d / "serving"


def test_a_better_plan_is_rolled_out_then_kept(deployed):
    d, fresh, serving = deployed
    a, b = d / "swap-a", d / "swap-b"
    a.mkdir(), b.mkdir()
    assert exchange_paths(a, b), "renameat2 RENAME_EXCHANGE works here: the one-step rollout"
    before = _files(serving)
    run = _nightly(fresh, Path(f"{serving}//"), d / "work1")  # a path as typed
    assert run.returncode == 0, run.stderr
    last = run.stdout.strip().splitlines()[-1]
    assert last.startswith(f"rolled out to {serving} (swapped in one step;") and "better" in last
    assert _files(serving / ".." / "serving.previous") == before  # kept whole beside it
    assert not list(d.glob("serving.incoming*"))
    assert main(["export", "--verify", str(serving), "--json"]) == 0
    # the same traffic again: the new plan is level with the one now serving, and stays
    now = _files(serving)
    again = _nightly(fresh, serving, d / "work2")
    assert again.returncode == 0, again.stderr
    assert again.stdout.strip().splitlines()[-1].startswith(f"kept {serving}")
    assert "not better than the deployed plan" in again.stderr
    assert _files(serving) == now


def test_a_failed_step_leaves_the_serving_bundle_alone(deployed, tmp_path):
    d, _, serving = deployed
    now = _files(serving)
    other = synthesize(SynthConfig(**{**SYNTH.__dict__, "model": "other/model"}), tmp_path / "t")
    run = _nightly(other, serving, tmp_path / "work")
    assert run.returncode == 2
    assert "fingerprints differ" in run.stderr
    assert _files(serving) == now
    run = _nightly(other, Path(f"{serving}//"), serving / "work")
    assert run.returncode == 2 and "lies inside the deployed bundle" in run.stderr
    assert _files(serving) == now and not (serving / "work").exists()
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("a user's file")
    run = _nightly(other, serving, busy)
    assert run.returncode == 2 and "is not empty" in run.stderr
    assert (busy / "keep.txt").read_text() == "a user's file"


def test_the_rollout_takes_two_renames_where_no_swap_is_supported(deployed, tmp_path):
    d, fresh, _ = deployed
    serving = tmp_path / "serving"
    assert main(["export", str(d / "plan"), "--out", str(serving), "--json"]) == 0
    before = _files(serving)
    python = _python_whose_swap_exits(3, tmp_path / "python-without-swap")  # "not supported"
    run = _nightly(fresh, serving, tmp_path / "work", python=str(python))
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip().splitlines()[-1].startswith(f"rolled out to {serving} (two renames;")
    assert "cannot import planner" not in run.stderr
    assert _files(tmp_path / "serving.previous") == before
    assert not list(tmp_path.glob("serving.incoming*"))
    assert main(["export", "--verify", str(serving), "--json"]) == 0


def test_a_failed_copy_leaves_nothing_beside_the_serving_bundle(deployed, tmp_path):
    """A copy that failed (a full disk) left a half-written serving.incoming beside the
    bundle and the copy's raw errors, with no line of the script's own; and a PYTHON that
    cannot import planner fell back to two renames without a word."""
    d, fresh, _ = deployed
    serving = tmp_path / "serving"
    assert main(["export", str(d / "plan"), "--out", str(serving), "--json"]) == 0
    before = _files(serving)
    shims = tmp_path / "shims"
    shims.mkdir()
    (shims / "cp").write_text('#!/bin/sh\n/bin/cp "$@"\necho "cp: no space left" >&2\nexit 1\n')
    (shims / "cp").chmod(0o755)
    path = f"{shims}{os.pathsep}{os.environ['PATH']}"
    run = _nightly(fresh, serving, tmp_path / "work", PATH=path)
    assert run.returncode == 2
    assert run.stderr.strip().splitlines()[-1].startswith("nightly_replan.sh: could not copy")
    assert _files(serving) == before
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("serving")) == [
        "serving",
        "serving.lock",
    ]
    python = _python_whose_swap_exits(1, tmp_path / "python-without-planner")  # no import
    run = _nightly(fresh, serving, tmp_path / "work2", python=str(python))
    assert run.returncode == 0, run.stderr
    assert "cannot import planner" in run.stderr
    assert run.stdout.strip().splitlines()[-1].startswith(f"rolled out to {serving} (two renames;")

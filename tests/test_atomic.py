"""planner._io.atomic_path: a failed or refused write leaves the destination as it was."""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path

import numpy as np
import pytest

from planner import _io
from planner._io import atomic_path, check_output, read_json_object
from planner.cli.main import main
from planner.errors import InputError
from tests.conftest import FLAME_TRACE, require


def test_a_directory_never_replaces_a_file_nor_a_file_a_directory(tmp_path):
    kept = tmp_path / "f"
    kept.write_text("keep")
    refused = "exists and is a file; a directory cannot replace it"
    with pytest.raises(InputError, match=refused), atomic_path(kept) as tmp:
        tmp.mkdir()
        (tmp / "part-00000.parquet").write_text("x")
    folder = tmp_path / "d"
    folder.mkdir()
    (folder / "notes.txt").write_text("keep")
    refused = "is a directory; a file cannot replace it"
    with pytest.raises(InputError, match=refused), atomic_path(folder) as tmp:
        tmp.write_text("x")
    assert kept.read_text() == "keep" and (folder / "notes.txt").read_text() == "keep"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d", "f"]  # no temporaries left


def test_a_directory_replaces_an_earlier_one(tmp_path):
    dest = tmp_path / "d"
    for text in ("old", "new"):
        with atomic_path(dest) as tmp:
            tmp.mkdir()
            (tmp / "x").write_text(text)
    assert (dest / "x").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"]


def test_outputs_that_could_not_be_written_are_refused_before_the_work(tmp_path, capsys):
    # check_output runs before a command's work: a path under a file, or a directory
    # artifact's path that is a symbolic link, would fail only once the work is done
    afile = tmp_path / "f"
    afile.write_text("keep")
    for marker in (None, "plan.json"):
        with pytest.raises(InputError, match=f"{afile} is a file, not a directory"):
            check_output(afile / "sub" / "out", marker=marker, what="thing")
    (tmp_path / "target").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "target")
    with pytest.raises(InputError, match="is a symbolic link; give the plan directory itself"):
        check_output(tmp_path / "link", marker="plan.json", what="plan")
    # a link to a file was told to give "the plan directory itself" (the file)
    (tmp_path / "filelink").symlink_to(afile)
    with pytest.raises(InputError, match="filelink: exists and is a file; a plan is a directory"):
        check_output(tmp_path / "filelink", marker="plan.json", what="plan")
    # "" is the current directory: it said "the command reads its input ... there"
    for marker in (None, "plan.json"):
        with pytest.raises(
            InputError, match="^the output path is empty; give the path of the plan$"
        ):
            check_output("", marker=marker, what="plan")
    # every command that writes goes through it: e.g. fit and trace synth, in one line
    for args in (
        ["fit", str(require(FLAME_TRACE)), "--out", str(afile / "pred")],
        ["trace", "synth", "--out", str(afile / "t"), "--tokens", "100", "--requests", "4"],
    ):
        assert main(args) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "is a file, not a directory" in err[0], err
    assert afile.read_text() == "keep"


def test_an_output_in_a_directory_that_cannot_be_written_is_refused_before_the_work(
    tmp_path, capsys
):
    """--out or --plot where no file can be made failed only once the work was done, with
    the name of the atomic write's temporary file ('[Errno 13] Permission denied:
    /sys/.plan.x8f3.tmp')."""
    places = [tmp_path / "ro" / "sub"]
    (tmp_path / "ro").mkdir()
    (tmp_path / "ro").chmod(0o555)
    if os.geteuid() == 0:  # root writes anywhere: a file system that takes no new files
        places = [Path(p) / "sub" for p in ("/proc", "/sys") if Path(p).is_dir()]
    if not places:
        pytest.skip("no directory here refuses a new file")
    try:
        for place in places:
            for marker in (None, "plan.json"):
                with pytest.raises(InputError, match=f"{place}/out: cannot write in "):
                    check_output(place / "out", marker=marker, what="thing")
        args = ["trace", "synth", "--out", str(places[0] / "t"), "--tokens", "100"]
        assert main([*args, "--requests", "4"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "cannot write in" in err[0] and ".tmp" not in err[0], err
        assert list(tmp_path.rglob("*moeplan-probe*")) == []
    finally:
        (tmp_path / "ro").chmod(0o755)


def test_a_file_output_never_replaces_a_device_or_a_pipe(tmp_path, capsys):
    # the rename of the atomic write would put a regular file in its place (as root,
    # `export --out /dev/null` replaced /dev/null)
    fifo = tmp_path / "fifo.png"
    os.mkfifo(fifo)
    for dest in (fifo, Path(os.devnull)):
        with pytest.raises(InputError, match="exists and is not a regular file"):
            check_output(dest, marker=None, what="placement file")
    args = ["trace", "info", str(require(FLAME_TRACE)), "--plot", str(fifo)]
    assert main(args) == 2
    assert "is not a regular file" in capsys.readouterr().err
    assert stat.S_ISFIFO(fifo.stat().st_mode)


def test_read_only_files_and_directories_are_never_replaced(tmp_path, capsys):
    # even with --force and as root: a synthetic trace replaced the read-only real one
    real = tmp_path / "real.parquet"
    args = ["trace", "synth", "--tokens", "100", "--requests", "4", "--out", str(real)]
    assert main(args) == 0
    before = real.read_bytes()
    real.chmod(0o444)
    assert main([*args, "--seed", "3", "--force"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("moeplan: error:") and "is read-only, so it is not replaced" in err
    assert real.read_bytes() == before
    parts = tmp_path / "parts"
    parts.mkdir()
    (parts / "part-00000.parquet").write_bytes(before)
    parts.chmod(0o555)
    try:
        with pytest.raises(InputError, match="is read-only, so it is not replaced"):
            check_output(parts, marker="part-*.parquet", what="trace")
    finally:
        parts.chmod(0o755)


def test_no_output_is_written_into_a_moeplan_artifact(tmp_path):
    # a bundle's checksums cover its engine files: one rewritten from another plan made the
    # bundle fail verification
    from planner.export.bundle import MANIFEST_FILE
    from planner.predict.predictor import MANIFEST
    from planner.solve.plan import PLAN_FILE

    assert {MANIFEST, PLAN_FILE} == set(_io._ARTIFACT_MARKERS)
    assert MANIFEST_FILE == _io._BUNDLE_MANIFEST
    for name, body, what in (
        (MANIFEST, "{}", "predictor"),
        (PLAN_FILE, "{}", "plan"),
        (MANIFEST_FILE, json.dumps({"format": "moeplan-bundle"}), "moeplan bundle"),
    ):
        d = tmp_path / what.replace(" ", "_")
        d.mkdir()
        (d / name).write_text(body)
        for marker in (None, "plan.json"):
            with pytest.raises(InputError, match=f"is inside the {what} {d}"):
                check_output(d / "x.json", marker=marker, what="thing")
    # a project's own manifest.json (not a bundle's) is no artifact
    project = tmp_path / "web"
    project.mkdir()
    (project / MANIFEST_FILE).write_text('{"name": "site"}')
    assert check_output(project / "x.json", marker=None, what="thing") == project / "x.json"


def test_deeply_nested_json_is_one_line_error(tmp_path):
    # json's decoder recurses per level: a RecursionError traceback before
    path = tmp_path / "predictor.json"
    path.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(InputError, match="nested too deeply"):
        read_json_object(path, "predictor.json")


def test_replacing_a_directory_leaves_other_files_beside_it(tmp_path):
    # the backup was a fixed name, '.out.old', whose contents were deleted
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "a").write_text("old")
    mine = tmp_path / ".out.old"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    with atomic_path(tmp_path / "out") as tmp:
        tmp.mkdir()
        (tmp / "a").write_text("new")
    assert (tmp_path / "out" / "a").read_text() == "new"
    assert (mine / "notes.txt").read_text() == "keep"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".out.old", "out"]


def test_an_output_under_a_dangling_link_is_refused_before_the_work(tmp_path, capsys):
    """solve --out DIR/gone/plan, with gone a link to nothing, solved every layer and then
    failed with a FileExistsError traceback when the plan was saved."""
    (tmp_path / "gone").symlink_to(tmp_path / "nowhere")
    for marker in (None, "plan.json"):
        with pytest.raises(InputError, match="gone is a symbolic link to .*which does not exist"):
            check_output(tmp_path / "gone" / "plan", marker=marker, what="plan")
    args = ["trace", "synth", "--out", str(tmp_path / "gone" / "t"), "--tokens", "100"]
    assert main([*args, "--requests", "4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "which does not exist" in err[0], err
    assert not (tmp_path / "nowhere").exists()


def test_written_files_get_the_usual_permissions(tmp_path):
    # safetensors writes 0600: a bundle exported by one user could not be read by another's
    # serving engine. Atomic writes give every file the mode of a new file under the umask.
    import safetensors.numpy

    expected = 0o666 & ~_io._umask()
    with atomic_path(tmp_path / "one.safetensors") as tmp:
        safetensors.numpy.save_file({"a": np.zeros(3)}, str(tmp))
    with atomic_path(tmp_path / "dir") as tmp:
        (tmp / "sub").mkdir(parents=True)
        safetensors.numpy.save_file({"a": np.zeros(3)}, str(tmp / "sub" / "t.safetensors"))
    for f in (tmp_path / "one.safetensors", tmp_path / "dir" / "sub" / "t.safetensors"):
        assert f.stat().st_mode & 0o777 == expected


def test_an_artifact_replaces_a_directory_only_if_it_holds_nothing_else(tmp_path):
    # A project that happens to hold a manifest.json or a plan.json is not a bundle or a plan:
    # replacing it deleted the user's other files. Nor are notes beside an earlier artifact.
    import json

    from planner.export.bundle import check_bundle_output
    from planner.predict.predictor import check_destination
    from planner.solve.plan import check_plan_output
    from planner.trace.io import check_trace_output

    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "manifest.json").write_text('{"name": "web app"}')
    (proj / "plan.json").write_text("{}")
    (proj / "predictor.json").write_text("{}")
    (proj / "part-00000.parquet").write_text("")
    (proj / "src.py").write_text("precious")
    for check in (check_bundle_output, check_plan_output, check_destination):
        with pytest.raises(InputError, match=r"holds .* (besides .* own files|not a moeplan)"):
            check(proj)
    with pytest.raises(InputError, match=r"holds .*predictor\.json.* besides a trace's own"):
        check_trace_output(proj)
    assert (proj / "src.py").read_text() == "precious"
    # An earlier bundle with the engine files its manifest lists may be replaced; one with a
    # file it does not list may not.
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    manifest = {"files": {"tables.safetensors": {}, "sglang_expert_location.json": {}}}
    manifest["format"] = "moeplan-bundle"
    (bundle / "manifest.json").write_text(json.dumps(manifest))
    (bundle / "tables.safetensors").write_text("")
    (bundle / "sglang_expert_location.json").write_text("{}")
    assert check_bundle_output(bundle) == bundle
    (bundle / "NOTES.txt").write_text("mine")
    with pytest.raises(InputError, match="holds NOTES.txt besides a moeplan bundle's own files"):
        check_bundle_output(bundle)
    # a manifest.json that is not a bundle's is never replaced, even where it lists the files
    # beside it (a web app's "files" list) or stands alone (a browser extension's)
    for text, others in [('{"name": "pwa", "files": ["index.html"]}', ["index.html"]),
                         ('{"name": "ext", "manifest_version": 3}', []), ("{not json", [])]:  # fmt: skip
        app = tmp_path / f"app{len(text)}"
        app.mkdir()
        (app / "manifest.json").write_text(text)
        for name in others:
            (app / name).write_text("<html>")
        with pytest.raises(InputError, match="holds a manifest.json that is not a moeplan bundle"):
            check_bundle_output(app)
        assert (app / "manifest.json").read_text() == text
    plan = tmp_path / "plan"
    plan.mkdir()
    (plan / "plan.json").write_text("{}")
    (plan / "tables.npz").write_text("")
    assert check_plan_output(plan) == plan


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="renameat2 is Linux's")
def test_a_directory_is_swapped_in_one_step(tmp_path, monkeypatch):
    """Two renames (old away, new in) left no output at all if the process was killed between
    them; on Linux the two directories are exchanged in one call, with no os.replace."""
    dest = tmp_path / "plan"
    dest.mkdir()
    (dest / "plan.json").write_text("old")

    def no_two_step(*args):
        raise AssertionError("os.replace used to replace a directory")

    monkeypatch.setattr(_io.os, "replace", no_two_step)
    with atomic_path(dest) as tmp:
        tmp.mkdir()
        (tmp / "plan.json").write_text("new")
    assert (dest / "plan.json").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan"]  # the old one removed


def test_the_current_directory_is_never_an_artifact_output(tmp_path, monkeypatch, capsys):
    # `export --out .` inside an old bundle failed on the swap with a raw errno line and left
    # a backup folder in the bundle, which then refused every later export to it
    from planner.export.bundle import check_bundle_output

    inner = tmp_path / "old" / "sub"
    inner.mkdir(parents=True)
    monkeypatch.chdir(inner)
    for path in (".", "..", str(inner)):
        with pytest.raises(InputError, match="is the current directory or holds it"):
            check_bundle_output(path)
    assert sorted(p.name for p in (tmp_path / "old").iterdir()) == ["sub"]


def test_a_backup_folder_is_removed_when_the_old_output_cannot_be_moved(tmp_path, monkeypatch):
    dest = tmp_path / "plan"
    dest.mkdir()
    (dest / "plan.json").write_text("old")
    monkeypatch.setattr(_io, "exchange_paths", lambda a, b: False)  # the two-step path

    def busy(src, dst):
        raise OSError(16, "Device or resource busy")

    monkeypatch.setattr(_io.os, "replace", busy)
    with pytest.raises(OSError), atomic_path(dest) as tmp:
        tmp.mkdir()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan"]
    assert (dest / "plan.json").read_text() == "old"


def test_folders_made_for_an_output_that_failed_are_removed(tmp_path):
    # a refused input left the empty folders of its output behind (trace split's s/)
    dest = tmp_path / "a" / "b" / "out.json"
    with pytest.raises(InputError), atomic_path(dest) as tmp:
        tmp.write_text("{}")
        raise InputError("refused")
    assert not (tmp_path / "a").exists()
    # a folder another output landed in meanwhile is kept
    with pytest.raises(InputError), atomic_path(dest) as tmp:
        (tmp_path / "a" / "b" / "other").write_text("x")
        raise InputError("refused")
    assert (tmp_path / "a" / "b" / "other").exists()
    with atomic_path(dest) as tmp:
        tmp.write_text("{}")
    assert json.loads(dest.read_text()) == {}


def test_signals_wait_for_the_end_of_a_deferred_block():
    import signal

    from planner._io import signals_deferred

    seen: list[str] = []
    previous = signal.signal(signal.SIGTERM, lambda *_: seen.append("handled"))
    try:
        with signals_deferred():
            os.kill(os.getpid(), signal.SIGTERM)
            seen.append("block done")
        seen.append("after")
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert seen == ["block done", "handled", "after"]


def test_split_commits_both_sides_with_signals_held(tmp_path, monkeypatch):
    # Ctrl-C between the two sides' renames left a new held-out side next to an old
    # fitting side; both renames now happen inside signals_deferred
    import contextlib

    from planner.predict import split as split_module
    from planner.trace.synth import SynthConfig, synthesize

    events: list[str] = []
    real_replace = os.replace

    @contextlib.contextmanager
    def watched():
        events.append("hold")
        yield
        events.append("release")

    def replace(a, b):
        events.append(f"rename {Path(b).name}")
        real_replace(a, b)

    trace = tmp_path / "t"
    synthesize(SynthConfig(num_layers=2, num_tokens=400, num_requests=8), trace)
    monkeypatch.setattr(split_module, "signals_deferred", watched)
    monkeypatch.setattr(os, "replace", replace)
    split_module.split_trace(trace, tmp_path / "fit", tmp_path / "held", 0.5, seed=0)
    renames = [e for e in events if e in ("rename fit", "rename held")]
    assert sorted(renames) == ["rename fit", "rename held"]
    assert events.index("hold") < events.index(renames[0])
    assert events.index(renames[-1]) < events.index("release")


def test_a_mount_point_is_refused_before_the_work(tmp_path, monkeypatch):
    """The atomic swap renames the old directory away, which a mount point refuses (EBUSY):
    a solve into a mounted --out failed only after the work, naming a temporary path."""
    from planner._io import check_output

    mounted = tmp_path / "mnt"
    mounted.mkdir()
    real = os.path.ismount
    monkeypatch.setattr(os.path, "ismount", lambda p: Path(p) == mounted or real(p))
    with pytest.raises(InputError, match="is a mount point, which cannot be replaced"):
        check_output(mounted, marker="plan.json", what="plan")
    assert check_output(mounted / "plan", marker="plan.json", what="plan") == mounted / "plan"


def test_a_write_that_fails_names_its_output(tmp_path):
    """A full disk said "[Errno 28] No space left on device" and nothing of which output;
    the old file stays and the message names it (errors that name a path keep theirs)."""
    kept = tmp_path / "plan.json"
    kept.write_text("keep")
    with (
        pytest.raises(
            OSError, match=r"^\[Errno 28\] No space left on device \(writing .*plan.json\)$"
        ),
        atomic_path(kept),
    ):
        raise OSError(28, "No space left on device")
    detail = "Error writing bytes to file. Detail: [errno 28] No space left on device"
    with pytest.raises(OSError, match=r"\(writing .*plan.json\)$"), atomic_path(kept):
        raise OSError(detail)  # pyarrow's: no errno of its own
    with pytest.raises(FileNotFoundError, match="gone.txt'$"), atomic_path(kept):
        (tmp_path / "gone.txt").read_text()
    assert kept.read_text() == "keep"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"]

"""planner._io.atomic_path: a failed or refused write leaves the destination as it was."""

from __future__ import annotations

import pytest

from planner._io import atomic_path
from planner.errors import InputError


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

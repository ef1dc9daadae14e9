"""``trace info``: counts and skewness, on a hand-made trace and on the real FLAME-MoE one."""

from __future__ import annotations

import io
import json
import tracemalloc

import numpy as np
import pytest

from planner.cli.main import main
from planner.trace import TraceBatch, TraceMeta, write_trace
from planner.trace.info import render_summary, trace_summary
from tests.conftest import FLAME_TRACE, require


def test_summary_counts_and_skewness(tmp_path):
    meta = TraceMeta("m", num_layers=2, num_experts=4, top_k=1, vocab_size=10)
    # Layer 0: every token to expert 0 -> skew = 4 (max 4 / mean 1). Layer 1: even -> 1.
    experts = np.array([[[0], [0]], [[0], [1]], [[0], [2]], [[0], [3]]])
    batch = TraceBatch.from_arrays(
        [0, 0, 1, 1], [0, 1, 0, 1], [3, 3, 4, 5], experts, np.ones((4, 2, 1))
    )
    path = write_trace(tmp_path / "t.parquet", meta, batch)
    s = trace_summary(path)
    assert s["tokens"] == 4 and s["requests"] == 2 and s["distinct_tokens"] == 3
    assert s["skewness_per_layer"] == [4.0, 1.0]


def test_memory_does_not_follow_vocab_size(tmp_path):
    # token ids are int32: a vocabulary of 2**31 ids is legal metadata; a [V] array is 2 GiB
    meta = TraceMeta("m", num_layers=1, num_experts=2, top_k=1, vocab_size=2**31)
    batch = TraceBatch.from_arrays(
        [0, 0, 0], [0, 1, 2], [2**31 - 1, 7, 7], np.array([[[0]], [[1]], [[1]]]), np.ones((3, 1, 1))
    )
    path = write_trace(tmp_path / "t.parquet", meta, batch)
    tracemalloc.start()
    try:
        s = trace_summary(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert s["distinct_tokens"] == 2 and s["vocab_size"] == 2**31
    assert peak < 64 * 2**20, peak


def test_cli_info_on_real_trace(capsys):
    path = require(FLAME_TRACE)
    assert main(["trace", "info", str(path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["model"] == "CMU-FLAME/FLAME-MoE-290M-1.3B"
    assert out["tokens"] == 2048 and out["requests"] == 32
    assert len(out["skewness_per_layer"]) == 8
    assert all(1.2 < s < 2.0 for s in out["skewness_per_layer"])  # README: about 1.4-1.9
    assert main(["trace", "info", str(path)]) == 0
    assert "skewness" in capsys.readouterr().out


def test_cli_error_is_one_line(tmp_path, capsys):
    assert main(["trace", "info", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"moeplan: error: {tmp_path / 'nope'}: no such trace file or directory"]


def test_zero_row_trace_info_is_strict_json(tmp_path, capsys):
    meta = TraceMeta("m", num_layers=2, num_experts=4, top_k=1, vocab_size=10)
    empty = TraceBatch.from_arrays([], [], [], np.zeros((0, 2, 1)), np.ones((0, 2, 1)))
    path = write_trace(tmp_path / "t.parquet", meta, empty)
    assert main(["trace", "info", str(path), "--json"]) == 0
    out = capsys.readouterr().out
    s = json.loads(out, parse_constant=lambda c: pytest.fail(f"non-strict JSON constant {c}"))
    assert s["tokens"] == 0 and s["skewness_per_layer"] == [None, None]
    assert main(["trace", "info", str(path)]) == 0
    assert "L0:n/a" in capsys.readouterr().out


def test_user_text_is_not_read_as_rich_markup(tmp_path):
    from rich.console import Console

    meta = TraceMeta("org/[/bold]m", num_layers=2, num_experts=4, top_k=1, vocab_size=10)
    batch = TraceBatch.from_arrays([0], [0], [1], np.zeros((1, 2, 1)), np.ones((1, 2, 1)))
    folder = tmp_path / "[red]runs"
    folder.mkdir()
    path = write_trace(folder / "t.parquet", meta, batch)
    buf = io.StringIO()
    Console(file=buf, width=200, markup=True).print(render_summary(trace_summary(path)))
    text = buf.getvalue()
    assert "org/[/bold]m" in text and "[red]runs" in text


def test_load_counts_do_not_copy_the_whole_batch_as_int64():
    # A 48-layer top-8 trace's 65536-row batch is 50 MB of int16 experts; the load counts
    # had made an int64 copy of it (and more): 400 MB of `trace info`'s 1.4 GB peak.
    from planner.trace.info import LoadAccumulator

    meta = TraceMeta("m", num_layers=64, num_experts=128, top_k=8, vocab_size=100)
    rng = np.random.default_rng(0)
    t = 4096
    experts = np.argsort(rng.random((t, 64, 128)), axis=2)[:, :, :8].astype(np.int16)
    batch = TraceBatch.from_arrays(
        np.zeros(t, np.int64), np.arange(t), np.zeros(t, np.int32), experts, np.ones(experts.shape)
    )
    acc = LoadAccumulator(meta)
    tracemalloc.start()
    try:
        acc.add(batch)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    want = np.stack([np.bincount(experts[:, layer].ravel(), minlength=128) for layer in range(64)])
    np.testing.assert_array_equal(acc.load, want)
    assert peak < experts.nbytes, (peak, experts.nbytes)


def test_summary_reads_wide_traces_in_smaller_batches(tmp_path, batch_rows_asked):
    # pyarrow holds several copies of a batch while decoding the list columns: 65536 rows
    # of a 48-layer top-8 trace took 0.7 GB; batches are sized by their expert cells.
    from planner.trace.io import WIDE_BATCH_CELLS

    meta = TraceMeta("m", num_layers=48, num_experts=128, top_k=8, vocab_size=100)
    experts = np.tile(np.arange(8, dtype=np.int16), (3, 48, 1))
    batch = TraceBatch.from_arrays([0, 0, 1], [0, 1, 0], [1, 2, 3], experts, np.ones((3, 48, 8)))
    path = write_trace(tmp_path / "t.parquet", meta, batch)
    s = trace_summary(path)
    assert s["tokens"] == 3 and s["expert_load"][0][:9] == [3] * 8 + [0]
    assert batch_rows_asked and all(
        rows * 48 * 8 <= WIDE_BATCH_CELLS for rows in batch_rows_asked
    ), batch_rows_asked


def test_a_gap_in_the_part_numbering_is_said(tmp_path, capsys):
    """A trace directory with part-00001 deleted was read without a word (its requests cut
    short counted as whole); `trace info` and `fit` now say which parts the numbering skips.
    """
    from planner.trace.synth import SynthConfig, synthesize

    config = SynthConfig(num_layers=2, num_experts=4, top_k=1, vocab_size=50, num_tokens=3000,
                         num_requests=12, seed=0)  # fmt: skip
    whole = synthesize(config, tmp_path / "t", rows_per_part=1000)
    assert trace_summary(whole)["missing_parts"] == []
    assert main(["fit", str(whole), "--out", str(tmp_path / "p0")]) == 0
    assert "numbering" not in capsys.readouterr().out
    assert (
        "missing_parts" not in json.loads((tmp_path / "p0" / "predictor.json").read_text())["fit"]
    )
    (whole / "part-00001.parquet").unlink()
    s = trace_summary(whole)
    assert s["missing_parts"] == ["part-00001.parquet"] and s["tokens"] == 2000
    text = io.StringIO()
    from rich.console import Console

    Console(file=text, width=200).print(render_summary(s))
    assert "skips part-00001.parquet: a part lost or removed?" in text.getvalue()
    capsys.readouterr()
    assert main(["fit", str(whole), "--out", str(tmp_path / "p1")]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "note: the numbering of the trace's parts skips part-00001.parquet" in out
    (whole / "part-00000.parquet").unlink()  # a gap of several parts is one entry
    assert trace_summary(whole)["missing_parts"] == ["part-00000.parquet to part-00001.parquet"]

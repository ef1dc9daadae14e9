"""Trace schema v1: write-then-read round trips and the errors a bad trace must raise."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from planner.errors import InputError, MismatchError, SchemaError
from planner.trace import (
    TraceBatch,
    TraceMeta,
    TraceWriter,
    arrow_schema,
    open_trace,
    write_trace,
)
from planner.trace import io as trace_io
from tests.conftest import FLAME_TRACE, OLMOE_COUNTS, random_batch, require


def _assert_same(a, b):
    np.testing.assert_array_equal(a.request_id, b.request_id)
    np.testing.assert_array_equal(a.position, b.position)
    np.testing.assert_array_equal(a.token_id, b.token_id)
    np.testing.assert_array_equal(a.experts, b.experts)
    np.testing.assert_array_equal(a.weights, b.weights)


def test_single_file_round_trip(tmp_path, small_meta):
    batch = random_batch(small_meta, 123)
    path = write_trace(tmp_path / "t.parquet", small_meta, batch)
    trace = open_trace(path)
    assert trace.meta == small_meta
    assert trace.num_rows == 123
    back = trace.read_all()
    _assert_same(batch, back)
    assert back.experts.dtype == np.int16 and back.weights.dtype == np.float16
    # The on-disk schema is exactly DESIGN.md's.
    schema = pq.ParquetFile(path).schema_arrow
    assert schema.field("experts").type == pa.list_(pa.int16(), 6)
    assert schema.field("weights").type == pa.list_(pa.float16(), 6)
    meta_json = json.loads(schema.metadata[b"moeplan"])
    assert meta_json["schema_version"] == 1
    assert meta_json["moe_layer_indices"] == [1, 2, 3]


def test_directory_round_trip_streams_in_chunks(tmp_path, small_meta):
    writer = TraceWriter(tmp_path / "tr", small_meta)
    batches = [random_batch(small_meta, n, seed=i) for i, n in enumerate([50, 7, 200])]
    paths = [writer.write(b) for b in batches]
    assert [p.name for p in paths] == [
        "part-00000.parquet",
        "part-00001.parquet",
        "part-00002.parquet",
    ]
    trace = open_trace(tmp_path / "tr")
    chunks = list(trace.iter_batches(batch_rows=16))
    assert max(len(c) for c in chunks) <= 16
    from planner.trace import TraceBatch

    _assert_same(TraceBatch.concat(batches), TraceBatch.concat(chunks))
    # A second writer continues the numbering instead of overwriting.
    assert TraceWriter(tmp_path / "tr", small_meta).write(batches[0]).name == "part-00003.parquet"


def test_extra_columns_are_kept_and_ignored(tmp_path, small_meta):
    batch = random_batch(small_meta, 20)
    batch.extras["domain"] = np.array(["a", "b"] * 10)
    path = write_trace(tmp_path / "t.parquet", small_meta, batch)
    trace = open_trace(path)
    assert trace.extra_columns() == ["domain"]
    assert list(trace.read_all(extras=("domain",)).extras["domain"][:2]) == ["a", "b"]
    assert trace.read_all().extras == {}


def test_not_a_trace(tmp_path):
    plain = tmp_path / "plain.parquet"
    pq.write_table(pa.table({"x": [1, 2]}), plain)
    with pytest.raises(SchemaError, match="no 'moeplan' metadata"):
        open_trace(plain)
    junk = tmp_path / "junk.parquet"
    junk.write_text("hello")
    with pytest.raises(SchemaError, match="not a Parquet file"):
        open_trace(junk)
    with pytest.raises(InputError, match="no such trace"):
        open_trace(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(InputError, match="no part-"):
        open_trace(tmp_path / "empty")


def test_counts_table_is_not_a_trace():
    with pytest.raises(SchemaError, match="counts table"):
        open_trace(require(OLMOE_COUNTS))


@pytest.mark.parametrize("separators", [(", ", ": "), (",", ":")])
def test_counts_metadata_is_named_however_its_json_is_spaced(tmp_path, separators):
    """A counts table's metadata written as compact JSON was read as a trace's and refused
    as one that 'lacks model' (a byte match looked for '"schema": "counts"')."""
    meta = {"schema": "counts", "schema_version": 1, "num_layers": 1, "num_experts": 4,
            "top_k": 2, "vocab_size": 10}  # fmt: skip
    table = pa.table(
        {"layer": [0], "token_id": [1], "expert": [2], "count": [3]},
        metadata={b"moeplan": json.dumps(meta, separators=separators).encode()},
    )
    pq.write_table(table, tmp_path / "c.parquet")
    with pytest.raises(SchemaError, match="this is a token-expert counts table, not a v1 trace"):
        open_trace(tmp_path / "c.parquet")


def test_parts_from_different_models(tmp_path, small_meta):
    d = tmp_path / "tr"
    TraceWriter(d, small_meta).write(random_batch(small_meta, 10))
    other = TraceMeta("test/other", 3, 8, 2, 50)
    write_trace(d / "part-00001.parquet", other, random_batch(other, 10))
    with pytest.raises(MismatchError, match="different model"):
        open_trace(d)
    TraceWriter(tmp_path / "tr2", small_meta).write(random_batch(small_meta, 3))
    with pytest.raises(MismatchError, match="refusing"):
        TraceWriter(tmp_path / "tr2", other)


def test_numbered_parts_are_read_in_number_order(tmp_path, small_meta):
    # hand-numbered parts: part-9 comes before part-10 (text order had it after)
    d = tmp_path / "tr"
    d.mkdir()
    first, second = random_batch(small_meta, 5), random_batch(small_meta, 7)
    write_trace(d / "part-9.parquet", small_meta, first)
    write_trace(d / "part-10.parquet", small_meta, second)
    ids = open_trace(d).read_all().request_id
    assert ids.tolist() == first.request_id.tolist() + second.request_id.tolist()


def test_ids_and_shapes_must_agree_with_metadata(tmp_path, small_meta):
    batch = random_batch(small_meta, 10)
    bad = batch.select(np.arange(10))
    bad.experts = bad.experts.copy()
    bad.experts[3, 1, 0] = 8  # num_experts is 8
    table = bad.to_table(small_meta)
    pq.write_table(table, tmp_path / "bad.parquet")
    with pytest.raises(SchemaError, match="expert id 8 outside"):
        open_trace(tmp_path / "bad.parquet").read_all()
    with pytest.raises(SchemaError, match="expert id 8"):
        write_trace(tmp_path / "bad2.parquet", small_meta, bad)
    assert not (tmp_path / "bad2.parquet").exists()

    bad_tok = batch.select(np.arange(10))
    bad_tok.token_id = bad_tok.token_id.copy()
    bad_tok.token_id[0] = 50
    pq.write_table(bad_tok.to_table(small_meta), tmp_path / "badtok.parquet")
    with pytest.raises(SchemaError, match="token id 50"):
        open_trace(tmp_path / "badtok.parquet").read_all()

    # List width disagreeing with num_layers * top_k.
    wide = TraceMeta("test/tiny", 3, 8, 3, 50)
    table = random_batch(wide, 5).to_table(wide)
    table = table.replace_schema_metadata({b"moeplan": small_meta.to_json().encode()})
    pq.write_table(table, tmp_path / "wide.parquet")
    with pytest.raises(SchemaError, match="9 entries per row"):
        open_trace(tmp_path / "wide.parquet")


@pytest.mark.parametrize(
    "change, message",
    [
        ({"top_k": 9}, "exceeds num_experts"),
        ({"num_layers": 0}, "positive integer"),
        ({"moe_layer_indices": (0, 1)}, "moe_layer_indices has 2"),
        ({"moe_layer_indices": (3, 1, 5)}, "must increase"),
        ({"moe_layer_indices": (1, 1, 5)}, "must increase"),
        ({"moe_layer_indices": (-1, 1, 5)}, "non-negative integers"),
        ({"moe_layer_indices": (0.5, 1, 5)}, "non-negative integers"),
        ({"moe_layer_indices": ("0", "1", "2")}, "non-negative integers"),
        ({"model": 7}, "model=7 must be a string"),
        ({"schema_version": 2}, "not supported"),
        ({"schema_version": "1"}, "schema_version '1' is not supported"),
        ({"num_layers": True}, "num_layers=True must be a positive integer"),
        ({"vocab_size": 2**31 + 1}, r"exceeds 2\*\*31 \(token ids are int32\)"),
    ],
)
def test_metadata_validation(change, message):
    kwargs = {"model": "m", "num_layers": 3, "num_experts": 8, "top_k": 2, "vocab_size": 5} | change
    with pytest.raises(SchemaError, match=message):
        TraceMeta(**kwargs)


def test_meta_json_round_trip(small_meta):
    assert TraceMeta.from_json(small_meta.to_json()) == small_meta
    assert arrow_schema(small_meta).metadata[b"moeplan"] == small_meta.to_json().encode()
    with pytest.raises(SchemaError, match="lacks"):
        TraceMeta.from_json('{"model": "x"}')


def test_meta_from_numpy_integers_writes(tmp_path, small_meta):
    """Sizes taken from arrays (np.int64) passed validation, then write_trace failed with
    json's 'Object of type int64 is not JSON serializable' traceback."""
    sizes = ("num_layers", "num_experts", "top_k", "vocab_size")
    meta = dataclasses.replace(small_meta, **{n: np.int64(getattr(small_meta, n)) for n in sizes})
    assert all(type(getattr(meta, n)) is int for n in sizes) and meta == small_meta
    write_trace(tmp_path / "t.parquet", meta, random_batch(meta, 10))
    assert open_trace(tmp_path / "t.parquet").meta == small_meta


@pytest.mark.parametrize("batch_rows", [True, 0, 2.5, 10**20])
def test_iter_batches_refuses_a_batch_size_that_is_not_a_positive_integer(
    tmp_path, small_meta, batch_rows
):
    """True read one row at a time, 2.5 two rows, 0 was pyarrow's ValueError traceback."""
    trace = open_trace(write_trace(tmp_path / "t.parquet", small_meta, random_batch(small_meta, 9)))
    with pytest.raises(InputError, match="batch_rows"):
        next(trace.iter_batches(batch_rows))
    assert [len(b) for b in trace.iter_batches(np.int64(5))] == [5, 4]


def test_real_flame_trace_reads_as_v1():
    trace = open_trace(require(FLAME_TRACE))
    m = trace.meta
    assert (m.num_layers, m.num_experts, m.top_k, m.vocab_size) == (8, 64, 6, 50304)
    assert m.moe_layer_indices == tuple(range(2, 10))
    batch = trace.read_all()
    assert len(batch) == 2048 and len(trace.request_ids()) == 32
    # Weights are descending within each layer, as the schema promises.
    assert (np.diff(batch.weights.astype(np.float32), axis=-1) <= 0).all()
    # Experts within a layer are distinct.
    s = np.sort(batch.experts, axis=-1)
    assert (np.diff(s, axis=-1) > 0).all()


def _with_column(table: pa.Table, name: str, values: pa.Array) -> pa.Table:
    i = table.schema.get_field_index(name)
    return table.set_column(i, pa.field(name, values.type), values).replace_schema_metadata(
        table.schema.metadata
    )


@pytest.mark.parametrize("statistics", [True, False])
def test_nulls_in_trace_columns_are_refused(tmp_path, small_meta, statistics):
    batch = random_batch(small_meta, 20)
    table = batch.to_table(small_meta)
    rid = pa.array([None] + batch.request_id[1:].tolist(), pa.int64())
    path = tmp_path / "null_rid.parquet"
    pq.write_table(_with_column(table, "request_id", rid), path, write_statistics=statistics)
    with pytest.raises(SchemaError, match="column request_id holds"):
        list(open_trace(path).iter_batches())
    # A null expert inside a list.
    experts = table.column("experts").combine_chunks()
    values = experts.values.to_pylist()
    values[4] = None
    nulled = pa.FixedSizeListArray.from_arrays(pa.array(values, pa.int16()), small_meta.row_width)
    path = tmp_path / "null_expert.parquet"
    pq.write_table(_with_column(table, "experts", nulled), path, write_statistics=statistics)
    with pytest.raises(SchemaError, match="column experts holds"):
        list(open_trace(path).iter_batches(weights=False, validate=False))


def test_request_ids_refuse_nulls_that_no_statistics_count(tmp_path, small_meta, capsys):
    # trace info, split, fit and compare read the two columns directly: a null became NaN
    # and int(NaN) a ValueError traceback
    from planner.cli.main import main

    batch = random_batch(small_meta, 20)
    table = batch.to_table(small_meta)
    rid = pa.array([0, None] + batch.request_id[2:].tolist(), pa.int64())
    path = tmp_path / "t.parquet"
    pq.write_table(_with_column(table, "request_id", rid), path, write_statistics=False)
    with pytest.raises(SchemaError, match="column request_id holds nulls"):
        open_trace(path).request_ids()
    assert main(["trace", "info", str(path)]) == 2
    assert "Traceback" not in capsys.readouterr().err


def test_a_profile_settings_file_nested_too_deep_is_not_a_traceback(tmp_path, small_meta):
    trace = tmp_path / "t"
    trace.mkdir()
    pq.write_table(random_batch(small_meta, 20).to_table(small_meta), trace / "part-00000.parquet")
    (trace / "profile.json").write_text("[" * 200_000)
    assert open_trace(trace).request_ids().size > 0  # not a profile's settings: the trace decides


def test_cli_info_refuses_nulls_in_one_line(tmp_path, small_meta, capsys):
    from planner.cli.main import main

    batch = random_batch(small_meta, 20)
    table = batch.to_table(small_meta)
    path = tmp_path / "t.parquet"
    rid = pa.array(batch.request_id[:-1].tolist() + [None], pa.int64())
    pq.write_table(_with_column(table, "request_id", rid), path)
    assert main(["trace", "info", str(path), "--json"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "request_id holds 1 null(s)" in err[0]


@pytest.mark.parametrize(("column", "compression"), [("weights", "NONE"), ("request_id", "zstd")])
def test_damaged_column_data_is_one_line_naming_the_file(
    tmp_path, small_meta, capsys, column, compression
):
    """A page that does not decode: pyarrow raised ArrowInvalid (trace info and split printed a
    traceback) or an OSError whose message did not name the file."""
    from planner.cli.main import main

    path = tmp_path / "t.parquet"
    table = random_batch(small_meta, 300).to_table(small_meta)
    pq.write_table(table, path, compression=compression)
    group = pq.ParquetFile(path).metadata.row_group(0)
    chunk = next(
        group.column(c)
        for c in range(group.num_columns)
        if group.column(c).path_in_schema.split(".")[0] == column
    )
    end = (chunk.dictionary_page_offset or chunk.data_page_offset) + chunk.total_compressed_size
    data = bytearray(path.read_bytes())
    data[end - 16 : end] = b"\xff" * 16  # the chunk's last bytes: its last page's data
    path.write_bytes(bytes(data))
    with pytest.raises(SchemaError, match="t.parquet: unreadable Parquet data"):
        list(open_trace(path).iter_batches())
    if column == "request_id":
        with pytest.raises(SchemaError, match="t.parquet: unreadable Parquet data"):
            open_trace(path).request_ids()
    assert main(["trace", "info", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{path}: unreadable Parquet data" in err[0]


def test_repeated_experts_and_negative_positions_are_refused(tmp_path, small_meta):
    batch = random_batch(small_meta, 20)
    batch.experts[3, 1, 1] = batch.experts[3, 1, 0]
    with pytest.raises(SchemaError, match="routes twice to one expert at MoE layer 1"):
        batch.validate(small_meta)
    pq.write_table(batch.to_table(small_meta), tmp_path / "dup.parquet")
    with pytest.raises(SchemaError, match="routes twice"):
        open_trace(tmp_path / "dup.parquet").read_all()
    batch = random_batch(small_meta, 20)
    batch.position[5] = -3
    with pytest.raises(SchemaError, match="negative position -3"):
        write_trace(tmp_path / "neg.parquet", small_meta, batch)
    assert not (tmp_path / "neg.parquet").exists()


@pytest.mark.parametrize(
    ("value", "why"),
    [(np.nan, "are not all finite"), (np.inf, "are not all finite"), (0.9, "not in descending")],
)
def test_gate_weights_must_be_finite_and_descending(tmp_path, small_meta, value, why, monkeypatch):
    """DESIGN.md: weights descending within each layer. NaN, inf or a rank-1 weight above
    rank 0's passed validation and were written and read back."""
    batch = random_batch(small_meta, 20)
    batch.weights[:, :, 0], batch.weights[:, :, 1] = 0.6, 0.4
    batch.validate(small_meta)  # ties pass: batch.weights[.., 1] = 0.6 would too
    batch.weights[7, 2, 1] = value
    with pytest.raises(SchemaError, match=f"position {batch.position[7]}, MoE layer 2 .*{why}"):
        batch.validate(small_meta)
    with pytest.raises(SchemaError, match=why):
        write_trace(tmp_path / "w.parquet", small_meta, batch)
    assert not (tmp_path / "w.parquet").exists()
    pq.write_table(batch.to_table(small_meta), tmp_path / "w.parquet")
    with pytest.raises(SchemaError, match=why):
        open_trace(tmp_path / "w.parquet").read_all()
    # stages that skip the weights column (fit, evaluate, compare) check each part's first
    # rows (a trace written in another order was fitted with the wrong top-1 experts) ...
    with pytest.raises(SchemaError, match=why):
        list(open_trace(tmp_path / "w.parquet").iter_batches(weights=False))
    # ... and only those: a bad row past them is left to trace info / split
    monkeypatch.setattr(trace_io, "WEIGHT_SAMPLE_ROWS", 7)
    assert sum(len(b) for b in open_trace(tmp_path / "w.parquet").iter_batches(weights=False)) == 20
    # negative weights are compared as values (the fast path orders float16 bits)
    batch.weights[:, :, 0], batch.weights[:, :, 1] = -0.25, -0.5
    batch.validate(small_meta)
    batch.weights[7, 2] = (-0.5, -0.25)
    with pytest.raises(
        SchemaError, match=f"position {batch.position[7]}, MoE layer 2 .*descending"
    ):
        batch.validate(small_meta)


def test_a_repeated_occurrence_is_refused_by_every_stage_that_reads_a_trace(
    tmp_path, small_meta, capsys, monkeypatch
):
    """Two runs' parts put in one directory, both numbering requests from 0: every row was
    counted twice by fit and evaluate. DESIGN.md: one row per token occurrence."""
    from planner.cli.main import main
    from planner.evaluate import EvalConfig, evaluate_bundle
    from planner.export import Bundle

    merged = tmp_path / "merged"
    merged.mkdir()
    batch = random_batch(small_meta, 40, requests=3)
    write_trace(merged / "part-00000.parquet", small_meta, batch)
    write_trace(merged / "part-00001.parquet", small_meta, random_batch(small_meta, 40, seed=1))
    first = int(batch.request_id[0])
    want = f"request {first} has more than one row at position 0"
    with pytest.raises(SchemaError, match=want):
        open_trace(merged).request_ids()
    bundle = Bundle.from_arrays(
        small_meta, ep_size=2, ngram_order=1,
        expert_to_device=[[0] * 4 + [1] * 4] * 3,
        token_to_device=np.zeros((3, 50), int), token_confidence=np.ones((3, 50)),
        ngram_to_device=np.zeros((3, 2), int), ngram_confidence=np.zeros((3, 2)),
    )  # fmt: skip
    with pytest.raises(SchemaError, match=want):
        evaluate_bundle(bundle, open_trace(merged), EvalConfig(batch_tokens=8))
    # compare refuses it before it solves (it solved the first method, then refused)
    from planner.evaluate.compare import compare_methods
    from planner.predict.fit import fit_predictor
    from planner.solve.pipeline import PlanConfig

    predictor = fit_predictor(merged / "part-00000.parquet").predictor

    def no_solve(*args, **kwargs):
        raise AssertionError("solved before the held-out trace was checked")

    monkeypatch.setattr("planner.evaluate.compare.make_plan", no_solve)
    with pytest.raises(SchemaError, match=want):
        compare_methods(predictor, open_trace(merged), ["vanilla"], PlanConfig("vanilla", 2))
    for argv in (
        ["trace", "info", str(merged)],
        ["trace", "split", str(merged), "--holdout", "0.5", "--fit-out", str(tmp_path / "a"),
         "--heldout-out", str(tmp_path / "b")],
        ["fit", str(merged), "--out", str(tmp_path / "pred")],
    ):  # fmt: skip
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and want in err[0], (argv, err)
    assert not any((tmp_path / n).exists() for n in ("a", "b", "pred"))
    # distinct request ids make the same rows one trace
    shifted = random_batch(small_meta, 40, seed=1)
    shifted.request_id += 10
    write_trace(merged / "part-00001.parquet", small_meta, shifted)
    assert (
        open_trace(merged).request_ids().size
        == np.unique(batch.request_id).size + np.unique(shifted.request_id).size
    )


@pytest.mark.parametrize("spread", [1, 2**59])
def test_repeated_occurrence_found_with_either_key(spread):
    """Ids whose (request, position) pairs fit one int64 key are sorted as keys; wider ones
    (request ids 4 * 2**59 apart) by a two-column sort. Both name the smallest repeated pair."""
    from planner.trace.io import _repeated_occurrence

    rid = np.array([5, 5, 5, 9, 9, 9], np.int64) * spread
    pos = np.array([0, 1, 2, 3, 4, 5], np.int32)
    assert _repeated_occurrence(rid, pos) is None
    rid, pos = np.append(rid, [9 * spread, 5 * spread]), np.append(pos, [4, 2]).astype(np.int32)
    assert _repeated_occurrence(rid, pos) == (5 * spread, 2)
    assert _repeated_occurrence(rid[:1], pos[:1]) is None


def test_repeated_expert_check_with_a_wide_top_k():
    from planner.trace.io import _repeated_expert

    rng = np.random.default_rng(0)
    experts = np.argsort(rng.random((50, 2, 64)), axis=-1)[..., :20].astype(np.int16)
    assert _repeated_expert(experts) is None
    experts[7, 1, 19] = experts[7, 1, 2]
    assert _repeated_expert(experts) == (7, 1)
    assert _repeated_expert(experts[:, :, :6]) is None


def test_from_arrays_refuses_ids_beyond_int32(small_meta):
    batch = random_batch(small_meta, 4)
    with pytest.raises(SchemaError, match="token id 8589934599 does not fit"):
        TraceBatch.from_arrays(
            batch.request_id, batch.position, [2**33 + 7] * 4, batch.experts, batch.weights
        )
    with pytest.raises(SchemaError, match="position -2147483649 does not fit"):
        TraceBatch.from_arrays(
            batch.request_id, [-(2**31) - 1] * 4, batch.token_id, batch.experts, batch.weights
        )


def test_parts_recording_other_layers(tmp_path, small_meta):
    import dataclasses

    d = tmp_path / "tr"
    TraceWriter(d, small_meta).write(random_batch(small_meta, 10))
    other = dataclasses.replace(small_meta, moe_layer_indices=(1, 3, 5))
    assert other.moe_layer_indices != small_meta.moe_layer_indices
    with pytest.raises(MismatchError, match=r"holds a trace of other MoE layers \(MoE layer 1"):
        TraceWriter(d, other)  # appending parts of other layers
    write_trace(d / "part-00001.parquet", other, random_batch(other, 10))
    with pytest.raises(
        MismatchError,
        match=r"part of other MoE layers: MoE layer 1 is model layer 3 in part-00001\.parquet and 2 in part-00000",
    ):
        open_trace(d)


def test_a_duplicated_column_or_deeply_nested_metadata_is_one_line(tmp_path, small_meta):
    table = random_batch(small_meta, 5).to_table(small_meta)
    pq.write_table(
        table.append_column("experts", table.column("experts")), tmp_path / "dup.parquet"
    )
    with pytest.raises(SchemaError, match="experts appear twice"):
        open_trace(tmp_path / "dup.parquet")
    deep = table.replace_schema_metadata({b"moeplan": b"[" * 100_000 + b"]" * 100_000})
    pq.write_table(deep, tmp_path / "deep.parquet")
    with pytest.raises(SchemaError, match="not valid JSON"):
        open_trace(tmp_path / "deep.parquet")


def test_parts_of_another_vocabulary_say_so(tmp_path, small_meta):
    d = tmp_path / "tr"
    write_trace(d / "part-00000.parquet", small_meta, random_batch(small_meta, 10))
    other = dataclasses.replace(small_meta, vocab_size=small_meta.vocab_size + 1)
    write_trace(d / "part-00001.parquet", other, random_batch(other, 10))
    with pytest.raises(MismatchError, match=rf"V={small_meta.vocab_size + 1}\) than"):
        open_trace(d)


def test_from_arrays_refuses_what_its_casts_would_change():
    """Expert 65539 was written as expert 3 and position 1.9 as 1, each passing validation."""
    w = np.array([[[0.6, 0.4]]])
    with pytest.raises(SchemaError, match="expert id 65539 does not fit the trace's int16"):
        TraceBatch.from_arrays([0], [1], [3], np.array([[[65539, 1]]]), w)
    with pytest.raises(SchemaError, match="position 1.9 is not a whole number"):
        TraceBatch.from_arrays([0], [1.9], [3], np.array([[[0, 1]]]), w)
    with pytest.raises(SchemaError, match="token id must be integers, got dtype <U1"):
        TraceBatch.from_arrays([0], [1], ["a"], np.array([[[0, 1]]]), w)
    b = TraceBatch.from_arrays([0], [1.0], [3], np.array([[[2.0, 1.0]]]), w)  # whole floats
    assert b.position.tolist() == [1] and b.experts.tolist() == [[[2, 1]]]
    empty = TraceBatch.from_arrays(
        np.zeros(0), np.zeros(0), np.zeros(0), np.zeros((0, 1, 2)), np.zeros((0, 1, 2))
    )
    assert len(empty) == 0


def test_trace_metadata_checks_its_scalars_before_using_them(tmp_path):
    """num_layers was used to build the default layer indices before it was checked: a
    string was a TypeError, 10**30 an OverflowError, 3*10**7 a 90 s stall; a non-string
    source passed until export crashed on it."""
    for bad, match in (("2", "num_layers='2' must be a positive integer"),
                       (10**30, "is more than 65535 MoE layers")):  # fmt: skip
        with pytest.raises(SchemaError, match=match):
            TraceMeta("m", num_layers=bad, num_experts=4, top_k=2, vocab_size=10)
    with pytest.raises(SchemaError, match="source=5 must be a string"):
        TraceMeta("m", num_layers=2, num_experts=4, top_k=2, vocab_size=10, source=5)


def test_an_extra_column_named_like_a_required_one_with_a_dot(tmp_path):
    """The footer's null check took the first dotted word: an extra column 'token_id.orig'
    with a null was reported as a null token_id and the valid trace refused."""
    import pyarrow as pa

    meta = TraceMeta("m", num_layers=2, num_experts=4, top_k=2, vocab_size=10)
    path = write_trace(tmp_path / "t.parquet", meta, random_batch(meta, 4, seed=0))
    table = pq.read_table(path)
    table = table.append_column("token_id.orig", pa.array(["a", None, "b", "c"]))
    pq.write_table(table, tmp_path / "dot.parquet")
    assert len(open_trace(tmp_path / "dot.parquet").read_all()) == 4

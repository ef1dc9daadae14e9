"""SGLang per_token dumps -> v1 traces: logical ids, request segmentation, and clear refusals."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from planner.cli.main import main
from planner.errors import InputError, MismatchError, SchemaError
from planner.trace import open_trace
from planner.trace.ingest_sglang import convert_sglang, ingest_sglang, segment_starts
from tests.trace.fixtures import make_sglang_dump as fixture


@pytest.fixture
def dump_dir(tmp_path):
    directory = tmp_path / "dumps"
    fixture.write(directory)
    return directory


def _check_against_expected(batch, expected):
    np.testing.assert_array_equal(batch.request_id, expected["request_id"])
    np.testing.assert_array_equal(batch.position, expected["position"])
    np.testing.assert_array_equal(batch.token_id, expected["token_id"])
    np.testing.assert_array_equal(batch.experts, expected["experts"])


def test_ingest_recovers_logical_experts_and_requests(dump_dir, tmp_path):
    _, expected = fixture.build()
    # numpy sizes are sizes (they were refused)
    stats = ingest_sglang(
        [dump_dir], tmp_path / "t.parquet", model="tiny", vocab_size=np.int64(100),
        rows_per_part=np.int32(1000),
    )  # fmt: skip
    trace = open_trace(tmp_path / "t.parquet")
    m = trace.meta
    assert (m.model, m.num_layers, m.num_experts, m.top_k, m.vocab_size) == ("tiny", 3, 6, 2, 100)
    assert m.moe_layer_indices == fixture.MOE_LAYERS
    assert "uniform 1/k" in m.source
    batch = trace.read_all()
    _check_against_expected(batch, expected)
    # Physical ids really differ from logical ones: the map was needed.
    assert (expected["physical_to_logical"] != np.arange(fixture.NUM_PHYSICAL) % 6).any()
    np.testing.assert_array_equal(batch.weights, np.full((18, 3, 2), 0.5, np.float16))
    assert stats.records == 6 and stats.duplicate_records == 1
    assert stats.dropped_tokens == 1 and stats.tokens == 18 and stats.requests == 8
    assert stats.num_physical_experts == 8 and not stats.vocab_inferred


def test_committed_dump_files_load_with_weights_only():
    """The binary fixture in tests/trace/fixtures/ was written by make_sglang_dump.py."""
    _, expected = fixture.build()
    meta, batch, _ = convert_sglang([fixture.COMMITTED], vocab_size=100)
    _check_against_expected(batch, expected)
    assert meta.num_experts == 6


def test_files_given_one_by_one_equal_the_directory(dump_dir):
    files = sorted(dump_dir.iterdir())
    _, by_dir, _ = convert_sglang([dump_dir])
    _, by_file, _ = convert_sglang(files[::-1])  # order of arguments does not matter
    for column in ("request_id", "position", "token_id", "experts", "weights"):
        np.testing.assert_array_equal(
            getattr(by_dir, column), getattr(by_file, column), err_msg=column
        )


def test_vocab_inferred_and_unknown_tokens(dump_dir):
    _, expected = fixture.build()
    meta, _, stats = convert_sglang([dump_dir])
    assert stats.vocab_inferred and meta.vocab_size == int(expected["token_id"].max()) + 1
    small = int(np.sort(expected["token_id"])[-3])  # ids >= small become -1
    _, batch, stats = convert_sglang([dump_dir], vocab_size=small)
    assert stats.unknown_tokens == int((expected["token_id"] >= small).sum()) > 0
    assert (batch.token_id == -1).sum() == stats.unknown_tokens


def test_negative_ids_count_as_unknown_where_the_vocab_is_inferred(tmp_path, capsys):
    """They were written as -1 while the summary said 0 unknown tokens."""
    dumps, _ = fixture.build()
    good = next(iter(dumps.values()))
    r0 = good["records"][0]
    ids = [-5] * 3 + list(r0["input_ids"][3:])
    path = _save(tmp_path / "neg.pt", dict(good, records=[dict(r0, input_ids=ids)]))
    _, batch, stats = convert_sglang([path])
    assert stats.vocab_inferred and stats.unknown_tokens == 3 == (batch.token_id == -1).sum()
    assert main(["trace", "ingest", "sglang", str(path), "--out", str(tmp_path / "t")]) == 0
    assert "3 tokens had negative ids" in " ".join(capsys.readouterr().out.split())


def test_skip_decode(dump_dir):
    _, batch, _ = convert_sglang([dump_dir], skip_decode=True)
    assert len(batch) == 16 and 7 not in batch.request_id


def test_segment_rules():
    pos = np.array([0, 1, 2, 0, 1, 5, 6])
    # extend_seq_lens wins when it sums to the token count (and its segments' positions rise)
    assert segment_starts(pos, np.array([3, 4]), 1).tolist() == [1, 0, 0, 1, 0, 0, 0]
    assert segment_starts(pos, np.array([2, 5]), 1).tolist() == [1, 0, 0, 1, 0, 1, 0]
    # otherwise positions decide
    assert segment_starts(pos, None, 1).tolist() == [1, 0, 0, 1, 0, 1, 0]
    assert segment_starts(pos, np.array([3]), 3).tolist() == [1, 0, 0, 1, 0, 1, 0]
    # lengths whose int64 sum wraps round to T are no segmentation: positions decide
    assert segment_starts(pos, np.array([2**63 - 1, 2**63 - 1, 9]), 1).tolist() == [
        1,
        0,
        0,
        1,
        0,
        1,
        0,
    ]
    # a decode pass is one token per request even where positions look consecutive
    assert segment_starts(np.array([4, 5, 9]), None, 2).tolist() == [1, 1, 1]


def test_directory_output_in_parts(dump_dir, tmp_path):
    out = tmp_path / "tr"
    ingest_sglang([dump_dir], out, rows_per_part=5)
    trace = open_trace(out)
    assert trace.part_rows == [5, 5, 5, 3]
    with pytest.raises(InputError, match="already exists"):
        ingest_sglang([dump_dir], out)


def _save(path, obj):
    torch.save(obj, path)
    return path


def test_refusals_are_one_line_errors(tmp_path, dump_dir):
    dumps, _ = fixture.build()
    name, good = next(iter(dumps.items()))  # rank 0's dump
    text = tmp_path / "notes.pt"
    text.write_text("hello")
    with pytest.raises(SchemaError, match="not a torch.save file"):
        convert_sglang([text])
    with pytest.raises(SchemaError, match="'stat' mode"):
        convert_sglang([_save(tmp_path / "s.pt", {"rank": 0, "logical_count": torch.zeros(2, 3)})])
    with pytest.raises(SchemaError, match="not an SGLang per_token dump"):
        convert_sglang([_save(tmp_path / "o.pt", {"weights": torch.zeros(2)})])
    with pytest.raises(InputError, match="no such"):
        convert_sglang([tmp_path / "missing.pt"])
    with pytest.raises(InputError, match="holds no"):
        convert_sglang([_mkdir(tmp_path / "e")])
    # Inconsistent shapes within a record.
    bad = dict(good, records=[dict(good["records"][0], positions=[0, 1])])
    with pytest.raises(SchemaError, match="disagree"):
        convert_sglang([_save(tmp_path / "b.pt", bad)])
    # Physical id beyond the map.
    topk = good["records"][0]["topk_ids_of_layer"].clone()
    topk[1, 0, 0] = 8
    bad = dict(good, records=[dict(good["records"][0], topk_ids_of_layer=topk)])
    with pytest.raises(SchemaError, match="outside the map's 8 slots"):
        convert_sglang([_save(tmp_path / "p.pt", bad)])
    topk[1, 0, 0] = -7  # only -1 marks padding: another negative id is no token to drop
    bad = dict(good, records=[dict(good["records"][0], topk_ids_of_layer=topk)])
    with pytest.raises(SchemaError, match="expert id -7 outside the map's 8 slots"):
        convert_sglang([_save(tmp_path / "n.pt", bad)])
    # Every id beyond the map, with more slots per token than logical experts: the ids are
    # what is wrong (the count of logical experts was named instead).
    topk = torch.full_like(topk, 99)
    bad = dict(good, records=[dict(good["records"][0], topk_ids_of_layer=topk)])
    with pytest.raises(SchemaError, match="expert id 99 outside the map's 8 slots"):
        convert_sglang([_save(tmp_path / "all.pt", bad)])
    # A map that does not match the recording repeats a logical expert (slots 2i, 2i+1 -> i).
    p2l = torch.arange(8).repeat(4, 1) // 2
    bad = dict(good, last_physical_to_logical_map=p2l)
    with pytest.raises(SchemaError, match="twice"):
        convert_sglang([_save(tmp_path / "m.pt", bad)])
    # Two files recorded under different placements.
    rolled = torch.roll(good["last_physical_to_logical_map"], 1, 1)
    other = dict(good, last_physical_to_logical_map=rolled)
    with pytest.raises(MismatchError, match="differs"):
        convert_sglang([dump_dir / name, _save(tmp_path / "r.pt", other)])
    # Only padding.
    rec = good["records"][3]  # the IDLE pass has no tokens
    with pytest.raises(SchemaError, match="no recorded tokens"):
        convert_sglang([_save(tmp_path / "i.pt", dict(good, records=[rec]))])


def _mkdir(path):
    path.mkdir()
    return path


class _Opaque:
    pass


def test_objects_outside_weights_only_are_refused(tmp_path):
    path = tmp_path / "x.pt"
    torch.save({"records": [_Opaque()]}, path)
    with pytest.raises(SchemaError, match="weights_only=True"):
        convert_sglang([path])


def test_cli_ingest(dump_dir, tmp_path, capsys):
    out = tmp_path / "t"
    assert main(["trace", "ingest", "sglang", str(dump_dir), "--out", str(out),
                 "--vocab-size", "100", "--model", "m", "--json"]) == 0  # fmt: skip
    summary = json.loads(capsys.readouterr().out)
    assert summary["tokens"] == 18 and summary["num_physical_experts"] == 8
    assert open_trace(out).meta.model == "m"
    # A --vocab-size smaller than the dumps' ids: the summary says how many became unknown.
    _, expected = fixture.build()
    small = int(np.sort(expected["token_id"])[-3])
    assert main(["trace", "ingest", "sglang", str(dump_dir), "--out", str(tmp_path / "s"),
                 "--vocab-size", str(small)]) == 0  # fmt: skip
    unknown = int((expected["token_id"] >= small).sum())
    assert f"{unknown} tokens had ids outside [0, {small})" in capsys.readouterr().out
    # An empty model name is refused (it names the model every later artifact must match).
    assert main(["trace", "ingest", "sglang", str(dump_dir), "--out", str(tmp_path / "e"),
                 "--model", " "]) == 2  # fmt: skip
    assert "must be a non-empty name" in capsys.readouterr().err
    assert not (tmp_path / "e").exists()
    text = tmp_path / "notes.pt"
    text.write_text("hello")
    assert main(["trace", "ingest", "sglang", str(text), "--out", str(tmp_path / "u")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"moeplan: error: {text}: not a torch.save file (expected an SGLang per_token dump)"
    ]


def test_force_never_replaces_the_input_dumps(tmp_path):
    """--out naming the dump directory, a dump file or their parent is refused; nothing lost."""
    dumps = tmp_path / "dumps"
    fixture.write(dumps)
    before = sorted(p.name for p in dumps.iterdir())
    one = sorted(dumps.iterdir())[0]
    # and a path inside the dump directory (it was accepted: the directory given was not
    # counted as an input, only the dump files found in it)
    for out in (dumps, one, tmp_path, dumps / "x"):
        with pytest.raises(InputError, match="reads its input"):
            ingest_sglang([dumps], out, overwrite=True)
    assert sorted(p.name for p in dumps.iterdir()) == before
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "notes.txt").write_text("keep")
    with pytest.raises(InputError, match="not a trace"):
        ingest_sglang([dumps], notes, overwrite=True)
    assert (notes / "notes.txt").read_text() == "keep"
    # Nor another Parquet file, where one file is asked for: a counts table, a user's data.
    table = tmp_path / "counts.parquet"
    table.write_bytes(b"PAR1 not a trace")
    with pytest.raises(InputError, match="exists and is not a trace"):
        ingest_sglang([dumps], table, overwrite=True)
    assert table.read_bytes() == b"PAR1 not a trace"
    # An earlier trace is still replaced with --force.
    out = tmp_path / "t"
    ingest_sglang([dumps], out, vocab_size=100)
    ingest_sglang([dumps], out, vocab_size=200, overwrite=True)
    assert open_trace(out).meta.vocab_size == 200


def test_cli_force_onto_the_input_is_one_line(dump_dir, capsys):
    args = ["trace", "ingest", "sglang", str(dump_dir), "--out", str(dump_dir), "--force"]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "reads its input" in err[0]
    assert len(list(dump_dir.glob("*.pt"))) == 3


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda good, r0: dict(good, records=[dict(r0, forward_pass_id="abc")]), "forward_pass_id is 'abc'"),
        (lambda good, r0: dict(good, records=[dict(r0, forward_pass_id=None)]), "forward_pass_id is None"),
        (lambda good, r0: dict(good, records=[dict(r0, rank=None)]), "rank is None"),
        (
            lambda good, r0: dict(good, last_physical_to_logical_map=torch.zeros((4, 0), dtype=torch.int64)),
            r"shape \(4, 0\)",
        ),
        (
            lambda good, r0: dict(good, records=[r0, dict(good["records"][1], topk_ids_of_layer=good["records"][1]["topk_ids_of_layer"][:, :, :4].clone())]),
            "record 1: topk_ids_of_layer has 4 columns per token, record 0 has 8",
        ),
        (
            lambda good, r0: dict(good, records=[dict(r0, input_ids=[2**33 + 7] * len(r0["input_ids"]))]),
            "input_ids value 8589934599 does not fit",
        ),
        (
            lambda good, r0: dict(good, records=[dict(r0, positions=[2**31 + i for i in range(len(r0["positions"]))])]),
            "positions value .* does not fit",
        ),
        # ragged lists were a ValueError traceback
        (lambda good, r0: dict(good, records=[dict(r0, input_ids=[[1], [2, 3]] + r0["input_ids"][2:])]), "input_ids is a ragged list"),
        (lambda good, r0: dict(good, records=[dict(r0, extend_seq_lens=[[3], [4, 1]])]), "extend_seq_lens is a ragged list"),
        (lambda good, r0: dict(good, last_physical_to_logical_map=[[0, 1], [0]]), "last_physical_to_logical_map is a ragged list"),
        # uint64 ids past int64 wrapped to -1 and were written as unknown tokens
        (
            lambda good, r0: dict(good, records=[dict(r0, input_ids=torch.from_numpy(np.full(len(r0["input_ids"]), 2**64 - 1, np.uint64)))]),
            "input_ids value 18446744073709551615 does not fit",
        ),
        # numpy has no bfloat16: a TypeError traceback
        (
            lambda good, r0: dict(good, records=[dict(r0, topk_ids_of_layer=torch.as_tensor(r0["topk_ids_of_layer"]).to(torch.bfloat16))]),
            "topk_ids_of_layer has shape .* and dtype torch.bfloat16, expected a 3-d integer",
        ),
        # the file was not named
        (
            lambda good, r0: dict(good, last_physical_to_logical_map=torch.as_tensor(good["last_physical_to_logical_map"]) + 500_000),
            r"bad.pt: num_experts=50000\d does not fit int16",
        ),
    ],
)  # fmt: skip
def test_malformed_records_are_one_line_errors(tmp_path, change, message):
    dumps, _ = fixture.build()
    good = next(iter(dumps.values()))
    path = _save(tmp_path / "bad.pt", change(good, good["records"][0]))
    with pytest.raises(SchemaError, match=message):
        convert_sglang([path])
    assert main(["trace", "ingest", "sglang", str(path), "--out", str(tmp_path / "t")]) == 2
    assert not (tmp_path / "t").exists()


def test_sequence_lengths_that_contradict_the_positions_give_way(tmp_path):
    # one segment of 7 over positions 0 1 2 0 1 2 3: ingest wrote request 0 twice at
    # positions 0-2, a trace every other command refused
    pos = np.array([0, 1, 2, 0, 1, 2, 3])
    assert segment_starts(pos, np.array([7]), 1).tolist() == [1, 0, 0, 1, 0, 0, 0]
    dumps, _ = fixture.build()
    name, good = next(iter(dumps.items()))
    r0 = good["records"][0]
    n = len(r0["positions"])
    assert n >= 4
    positions = list(range(2)) + list(range(n - 2))  # two requests, lengths saying one
    record = dict(r0, positions=positions, extend_seq_lens=[n])
    path = _save(tmp_path / name, dict(good, records=[record]))
    out = tmp_path / "t.parquet"
    assert main(["trace", "ingest", "sglang", str(path), "--out", str(out)]) == 0
    batch = open_trace(out).read_all()
    assert np.unique(batch.request_id).size == 2
    open_trace(out).request_ids()  # one row per occurrence


def test_topk_widths_differing_between_files_are_refused(tmp_path):
    dumps, _ = fixture.build()
    (name0, d0), (name1, d1) = list(dumps.items())[:2]
    narrow = dict(d1, records=[
        dict(r, topk_ids_of_layer=r["topk_ids_of_layer"][:, :, :4].clone()) for r in d1["records"]
    ])  # fmt: skip
    with pytest.raises(MismatchError, match="4 columns per token"):
        convert_sglang([_save(tmp_path / name0, d0), _save(tmp_path / name1, narrow)])


def test_cli_huge_token_ids_are_refused_not_wrapped(tmp_path, capsys):
    dumps, _ = fixture.build()
    good = next(iter(dumps.values()))
    r0 = good["records"][0]
    path = _save(tmp_path / "big.pt", dict(good, records=[dict(r0, input_ids=[2**33 + 7] * 7)]))
    assert main(["trace", "ingest", "sglang", str(path), "--out", str(tmp_path / "t.parquet")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "does not fit the trace's int32 column" in err[0]
    assert not (tmp_path / "t.parquet").exists()


def test_a_second_recording_by_the_same_rank_is_not_a_replica(tmp_path):
    """Two recordings of the same traffic by one rank (a replay after a restart: the pass
    ids start again) were dropped as tensor-parallel replicas, halving the tokens."""
    dumps, _ = fixture.build()
    name, one = next(iter(dumps.items()))
    first = _save(tmp_path / name, one)
    again = _save(tmp_path / name.replace("1700000000.0", "1700009999.0"), one)
    _, single, _ = convert_sglang([first], vocab_size=100)
    _, twice, stats = convert_sglang([first, again], vocab_size=100)
    assert len(twice) == 2 * len(single) and stats.duplicate_records == 0


def test_a_dump_file_named_twice_is_read_once(tmp_path):
    """Since a rank's repeated records are all kept, a file named twice (a directory and
    one of its files, or the same path again) had its tokens counted twice."""
    dumps, _ = fixture.build()
    name, one = next(iter(dumps.items()))
    first = _save(tmp_path / name, one)
    _, single, _ = convert_sglang([first], vocab_size=100)
    _, again, _ = convert_sglang([first, tmp_path, tmp_path / "." / name], vocab_size=100)
    assert len(again) == len(single)

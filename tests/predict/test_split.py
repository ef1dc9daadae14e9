"""Request-level split and binomial thinning."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planner.errors import InputError
from planner.predict.split import RequestSplit, check_fraction, thin_counts
from tests.predict.conftest import random_counts


@settings(max_examples=60, deadline=None)
@given(
    request_id=st.lists(st.integers(0, 30), min_size=2, max_size=200),
    fraction=st.floats(0.01, 0.99),
    seed=st.integers(0, 5),
)
def test_a_request_is_never_on_both_sides(request_id, fraction, seed):
    rid = np.array(request_id, np.int64)
    if np.unique(rid).size < 2:
        with pytest.raises(InputError):
            RequestSplit.make(rid, fraction, seed)
        return
    split = RequestSplit.make(rid, fraction, seed)
    held = split.heldout_mask(rid)
    for r in np.unique(rid):
        assert held[rid == r].all() or not held[rid == r].any()
    # Both sides are non-empty and the held-out count follows the fraction.
    n = np.unique(rid).size
    assert 1 <= split.heldout_ids.size <= n - 1
    assert split.heldout_ids.size == min(max(round(fraction * n), 1), n - 1)
    # Same seed, same split; the chunking of the trace does not matter.
    again = RequestSplit.make(rid[::-1], fraction, seed)
    np.testing.assert_array_equal(again.heldout_ids, split.heldout_ids)


def test_seed_changes_the_split():
    rid = np.arange(1000)
    a = RequestSplit.make(rid, 0.5, 0).heldout_ids
    b = RequestSplit.make(rid, 0.5, 1).heldout_ids
    assert a.size == b.size == 500 and not np.array_equal(a, b)


@pytest.mark.parametrize("bad", [0, 1, 1.5, -0.2, "x"])
def test_fraction_outside_open_interval_is_refused(bad):
    with pytest.raises(InputError):
        check_fraction(bad)


def test_thinning_conserves_counts_and_follows_fraction(small_meta):
    counts = random_counts(small_meta, 300, seed=0, max_count=200)
    fit, held = thin_counts(counts, 0.3, seed=4)
    for a, b, c in zip(fit.by_layer, held.by_layer, counts.by_layer, strict=True):
        assert ((a + b) != c).nnz == 0
        assert a.data.min() > 0 and b.data.min() > 0  # zeros eliminated
    share = held.total_activations() / counts.total_activations()
    assert abs(share - 0.3) < 0.02
    fit2, _ = thin_counts(counts, 0.3, seed=4)
    assert all((x != y).nnz == 0 for x, y in zip(fit.by_layer, fit2.by_layer, strict=True))


def _domains_and_requests(path):
    from planner.trace import open_trace

    batch = open_trace(path).read_all(extras=("domain",))
    return np.asarray(batch.extras["domain"]).astype(str), batch.request_id


def test_split_by_domain_holds_out_whole_domains(tmp_path, exact_trace):
    from planner.predict.split import split_trace_by_domain, trace_domains
    from planner.trace import open_trace

    path, _ = exact_trace
    assert trace_domains(open_trace(path)) == ["0", "1"]
    s = split_trace_by_domain(path, tmp_path / "fit", tmp_path / "held", ["1"])
    fit_dom, fit_req = _domains_and_requests(tmp_path / "fit")
    held_dom, held_req = _domains_and_requests(tmp_path / "held")
    assert set(held_dom) == {"1"} and set(fit_dom) == {"0"}
    assert not set(fit_req.tolist()) & set(held_req.tolist())
    assert s["fit_tokens"] + s["heldout_tokens"] == open_trace(path).num_rows
    assert s["heldout_requests"] == np.unique(held_req).size
    assert s["heldout_domains"] == ["1"] and s["kind"] == "domain"


def test_split_by_domain_refuses_bad_requests_and_writes_nothing(tmp_path, exact_trace):
    from planner.predict.split import split_trace_by_domain

    path, _ = exact_trace
    for domains, message in ((["7"], "no domain '7'"), (["0", "1"], "every domain"), ([], "given")):
        with pytest.raises(InputError, match=message):
            split_trace_by_domain(path, tmp_path / "fit", tmp_path / "held", domains)
        assert not (tmp_path / "fit").exists() and not (tmp_path / "held").exists()


def test_split_refuses_a_parquet_file_name_for_a_side(tmp_path, exact_trace):
    """Each side is a directory of parts (it may carry the embeddings): --fit-out a.parquet
    made a directory named a.parquet, which reads as a file name."""
    from planner.predict.split import split_trace, split_trace_by_domain

    path, _ = exact_trace
    with pytest.raises(InputError, match=r"a\.parquet: a split writes each side as a directory"):
        split_trace(path, tmp_path / "a.parquet", tmp_path / "held", 0.5, 0)
    with pytest.raises(InputError, match=r"b\.parquet: a split writes"):
        split_trace_by_domain(path, tmp_path / "fit", tmp_path / "b.parquet", ["1"])
    assert not list(tmp_path.iterdir())


def test_split_by_domain_refuses_a_request_of_two_domains(tmp_path, exact_trace):
    """Whole requests are held out: a request whose rows name two domains would otherwise
    land on both sides, its held-out tokens fitted on."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from planner.predict.split import split_trace_by_domain, trace_domains
    from planner.trace import open_trace

    path, _ = exact_trace
    part = open_trace(path).parts[0]
    table = pq.read_table(part)
    domain = np.asarray(table.column("domain")).astype(str)
    rid = np.asarray(table.column("request_id"))
    first = np.flatnonzero(rid == rid[0])
    other = next(d for d in trace_domains(open_trace(path)) if d != domain[0])
    domain[first[-1]] = other  # the last row of the first request in another domain
    column = pa.array(domain.tolist()).cast(table.schema.field("domain").type)
    mixed = table.set_column(table.column_names.index("domain"), "domain", column)
    pq.write_table(mixed.replace_schema_metadata(table.schema.metadata), tmp_path / "m.parquet")
    with pytest.raises(InputError, match="has rows of domain .* needs one domain"):
        split_trace_by_domain(tmp_path / "m.parquet", tmp_path / "f", tmp_path / "h", [other])
    assert not (tmp_path / "f").exists() and not (tmp_path / "h").exists()


def test_a_domain_named_with_surrounding_spaces_can_be_held_out(tmp_path, exact_trace):
    # the names given were stripped, the column's were not: "code " could not be held out
    import pyarrow as pa
    import pyarrow.parquet as pq

    from planner.predict.split import split_trace_by_domain, trace_domains
    from planner.trace import open_trace

    path, _ = exact_trace
    table = pq.read_table(open_trace(path).parts[0])
    domain = np.char.add(np.asarray(table.column("domain")).astype(str), " ")  # "0 ", "1 "
    column = pa.array(domain.tolist())
    spaced = table.set_column(table.column_names.index("domain"), "domain", column)
    pq.write_table(spaced.replace_schema_metadata(table.schema.metadata), tmp_path / "s.parquet")
    assert trace_domains(open_trace(tmp_path / "s.parquet")) == ["0", "1"]
    for name in ("1 ", "1"):
        s = split_trace_by_domain(
            tmp_path / "s.parquet", tmp_path / "f", tmp_path / "h", [name], overwrite=True
        )
        assert s["heldout_domains"] == ["1"] and s["heldout_tokens"] > 0 and s["fit_tokens"] > 0


def test_requests_without_a_domain_are_named_in_messages(tmp_path, exact_trace):
    # a prompt file where some prompts carry no domain records '' for them; messages listed
    # the domains as "the trace's domains are , 1", a blank name
    import pyarrow as pa
    import pyarrow.parquet as pq

    from planner.predict.split import format_domains, split_trace_by_domain
    from planner.trace import open_trace

    path, _ = exact_trace
    table = pq.read_table(open_trace(path).parts[0])
    domain = np.asarray(table.column("domain")).astype(str)
    column = pa.array(np.where(domain == "0", "", domain).tolist())  # domain 0 -> none
    blank = table.set_column(table.column_names.index("domain"), "domain", column)
    pq.write_table(blank.replace_schema_metadata(table.schema.metadata), tmp_path / "b.parquet")
    assert format_domains(["", "1"]) == "'', 1"
    with pytest.raises(
        InputError, match=r"no domain 'x' to hold out; the trace's domains are '', 1$"
    ):
        split_trace_by_domain(tmp_path / "b.parquet", tmp_path / "f", tmp_path / "h", ["x"])


def test_split_by_domain_needs_a_domain_column(tmp_path):
    from planner.predict.split import split_trace_by_domain
    from planner.trace import TraceMeta

    from .conftest import chain_batch, write_batch

    meta = TraceMeta("test/nodomain", num_layers=2, num_experts=4, top_k=1, vocab_size=10)
    path = write_batch(
        tmp_path / "t.parquet", meta, chain_batch(meta, np.arange(8), np.repeat([0, 1], 4))
    )
    with pytest.raises(InputError, match="no 'domain' column"):
        split_trace_by_domain(path, tmp_path / "fit", tmp_path / "held", ["a"])


def test_trace_split_cli_by_domain_and_its_one_line_errors(tmp_path, exact_trace, capsys):
    from planner.cli.main import main

    path, _ = exact_trace
    fit, held = str(tmp_path / "fit"), str(tmp_path / "held")
    base = ["trace", "split", str(path), "--fit-out", fit, "--heldout-out", held]
    assert main([*base, "--heldout-domain", "0"]) == 0
    assert "held out domain(s) 0 of 0, 1" in capsys.readouterr().out
    for extra, message in (
        (["--heldout-domain", "0", "--holdout", "0.3"], "--holdout is for a random split"),
        (["--heldout-domain", "0", "--seed", "3"], "--seed is for a random split"),
        (["--seed", "3", "--heldout-domain", "0", "--holdout", "0.3"], "--holdout and --seed are"),
        (["--heldout-domain", "9"], "no domain '9'"),
    ):
        capsys.readouterr()
        out = [a + "2" if a in (fit, held) else a for a in base]
        assert main([*out, *extra]) == 2
        err = capsys.readouterr().err
        assert err.startswith("moeplan: error:") and message in err and err.count("\n") == 1


def test_a_config_files_random_split_settings_stand_down_for_a_domain_split(
    tmp_path, exact_trace, capsys
):
    # the example's [trace.split] table sets holdout and seed; --heldout-domain still works
    from planner.cli.main import main

    path, _ = exact_trace
    cfg = tmp_path / "moeplan.toml"
    cfg.write_text("[trace.split]\nholdout = 0.5\nseed = 0\n")
    args = ["--config", str(cfg), "trace", "split", str(path), "--heldout-domain", "1"]
    assert (
        main([*args, "--fit-out", str(tmp_path / "f"), "--heldout-out", str(tmp_path / "h")]) == 0
    )
    assert "held out domain(s) 1 of 0, 1" in capsys.readouterr().out


def test_a_config_files_domain_stands_down_for_a_typed_random_split(tmp_path, exact_trace, capsys):
    from planner.cli.main import main

    path, _ = exact_trace
    cfg = tmp_path / "moeplan.toml"
    cfg.write_text('[trace.split]\nheldout-domain = "1"\n')
    for n, typed in enumerate((["--holdout", "0.5"], ["--seed", "3"])):
        fit, held = tmp_path / f"f{n}", tmp_path / f"h{n}"
        args = ["--config", str(cfg), "trace", "split", str(path), *typed]
        assert main([*args, "--fit-out", str(fit), "--heldout-out", str(held)]) == 0
        assert "held out domain" not in capsys.readouterr().out


def test_a_part_without_the_domain_column(tmp_path, exact_trace):
    # A part lacking a column the other parts have: split by domain names the part; split by
    # request keeps every column, null in the rows of the part that lacked it (it used to
    # fail on the first such part, then dropped the column).
    import shutil

    from planner.predict.split import split_trace, split_trace_by_domain
    from planner.trace import open_trace

    from .conftest import chain_batch, write_batch

    path, _ = exact_trace
    d = tmp_path / "mixed"
    if path.is_dir():
        shutil.copytree(path, d)
    else:
        d.mkdir()
        shutil.copy(path, d / "part-00000.parquet")
    meta = open_trace(d).meta
    write_batch(d / "part-99999.parquet", meta, chain_batch(meta, np.arange(6), np.full(6, 10**6)))
    with pytest.raises(InputError, match="part-99999.parquet: has no 'domain' column while"):
        split_trace_by_domain(d, tmp_path / "fit", tmp_path / "held", ["1"])
    assert not (tmp_path / "fit").exists() and not (tmp_path / "held").exists()
    s = split_trace(d, tmp_path / "fit", tmp_path / "held", 0.5, 0)
    assert s["fit_tokens"] + s["heldout_tokens"] == open_trace(d).num_rows
    assert "domain" in open_trace(tmp_path / "fit").extra_columns()


def _with_domain(tmp_path, exact_trace, name: str, domain: list, extra: dict | None = None):
    """The exact trace's first part, its domain column replaced by ``domain`` (an Arrow
    array of the values, one per row) and ``extra`` columns added, split into two parts."""
    import pyarrow.parquet as pq

    from planner.trace import open_trace

    path, _ = exact_trace
    table = pq.read_table(open_trace(path).parts[0])
    table = table.set_column(table.column_names.index("domain"), "domain", domain)
    for col, values in (extra or {}).items():
        table = table.append_column(col, values)
    table = table.replace_schema_metadata(pq.read_table(open_trace(path).parts[0]).schema.metadata)
    out = tmp_path / name
    out.mkdir()
    half = table.num_rows // 2
    rid = table.column("request_id").to_numpy()
    while half < table.num_rows and rid[half] == rid[half - 1]:  # whole requests per part
        half += 1
    pq.write_table(table.slice(0, half), out / "part-00000.parquet")
    pq.write_table(table.slice(half), out / "part-00001.parquet")
    return out, table


def test_a_null_domain_is_refused_and_an_integer_domain_matches_in_every_part(
    tmp_path, exact_trace
):
    """Read as numpy, an int domain column with a null in a batch came as floats: domain 1
    was "1.0" there, so --heldout-domain 1 left those requests on the fitting side; a null
    of a string column was a domain named "None"."""
    import pyarrow as pa

    from planner.errors import SchemaError
    from planner.predict.split import split_trace_by_domain
    from planner.trace import open_trace

    path, _ = exact_trace
    rows = open_trace(path).read_all(extras=("domain",))
    ints = np.asarray(rows.extras["domain"]).astype(np.int64) % 2
    with_null = pa.array([None if i == len(ints) - 1 else int(v) for i, v in enumerate(ints)],
                         pa.int32())  # fmt: skip
    src, _ = _with_domain(tmp_path, exact_trace, "nulls", with_null)
    with pytest.raises(SchemaError, match="domain column holds nulls"):
        split_trace_by_domain(src, tmp_path / "f", tmp_path / "h", ["1"])
    strs = pa.array([None if i == 0 else str(v) for i, v in enumerate(ints)])
    src, _ = _with_domain(tmp_path, exact_trace, "strnulls", strs)
    with pytest.raises(SchemaError, match="domain column holds nulls"):
        split_trace_by_domain(src, tmp_path / "f", tmp_path / "h", ["None"])
    assert not (tmp_path / "f").exists() and not (tmp_path / "h").exists()


def test_split_writes_extra_columns_back_with_their_types_and_nulls(tmp_path, exact_trace):
    """Extra columns went through numpy and were written with guessed types: an int column
    with a null became doubles with NaN in that part (int32 in the other)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from planner.predict.split import split_trace_by_domain
    from planner.trace import open_trace

    path, _ = exact_trace
    t = open_trace(path).read_all(extras=("domain",))
    n = len(t.request_id)
    domain = pa.array(np.asarray(t.extras["domain"]).astype(np.int64) % 2, pa.int32())
    score = pa.array([None if i % 3 == 0 else i for i in range(n)], pa.int64())
    src, table = _with_domain(tmp_path, exact_trace, "typed", domain, {"score": score})
    split_trace_by_domain(src, tmp_path / "f", tmp_path / "h", ["1"])
    got = {}
    for side in ("f", "h"):
        for part in sorted((tmp_path / side).glob("part-*.parquet")):
            out = pq.read_table(part)
            assert out.schema.field("domain").type == pa.int32()
            assert out.schema.field("score").type == pa.int64()
            for r, p, v in zip(out.column("request_id").to_pylist(), out.column("position").to_pylist(),
                               out.column("score").to_pylist(), strict=True):  # fmt: skip
                got[(r, p)] = v
    want = dict(zip(zip(table.column("request_id").to_pylist(), table.column("position").to_pylist(), strict=True),
                    table.column("score").to_pylist(), strict=True))  # fmt: skip
    assert got == want  # every row's value, nulls included, on one side or the other


def test_split_keeps_a_column_only_some_parts_have(tmp_path):
    """An extra column of only some parts was dropped from every output part (a later
    --heldout-domain on either side then failed); it is carried, null where it was absent."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from planner.predict.split import split_trace
    from planner.trace import TraceMeta, write_trace
    from tests.conftest import random_batch

    meta = TraceMeta("test/parts", num_layers=2, num_experts=4, top_k=2, vocab_size=20)
    src = tmp_path / "src"
    src.mkdir()
    for i in range(2):
        b = random_batch(meta, 40, seed=i, requests=4)
        b.request_id[:] += 10 * i  # distinct requests per part
        if i == 1:
            b.extras["domain"] = np.where(b.request_id % 2 == 0, 7, 8).astype(np.int32)
        write_trace(src / f"part-{i:05d}.parquet", meta, b)
    split_trace(src, tmp_path / "f", tmp_path / "h", 0.5, seed=0)
    seen = []
    for side in ("f", "h"):
        for part in sorted((tmp_path / side).glob("part-*.parquet")):
            t = pq.read_table(part)
            assert t.schema.field("domain").type == pa.int32()
            seen += list(
                zip(t.column("request_id").to_pylist(), t.column("domain").to_pylist(), strict=True)
            )
    assert {d for r, d in seen if r < 10} == {None}
    assert {d for r, d in seen if r >= 10} == {7, 8}


def test_a_split_replaces_an_existing_trace_only_with_force(tmp_path, exact_trace, capsys):
    """`trace split` replaced an existing --fit-out without a word, a recorded trace with
    its profile.json among them (a mistyped path lost a profiling run); as `trace synth`
    and `ingest`, it now asks for --force."""
    from planner.cli.main import main

    path, _ = exact_trace
    fit, held = tmp_path / "f", tmp_path / "h"
    args = ["trace", "split", str(path), "--fit-out", str(fit), "--heldout-out", str(held)]
    assert main(args) == 0
    (fit / "profile.json").write_text('{"finished": true}')
    capsys.readouterr()
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith(
        "f: already exists; choose another path or pass --force (overwrite=True from Python)"
    )
    assert (fit / "profile.json").exists()
    assert main([*args, "--force"]) == 0 and not (fit / "profile.json").exists()


def test_split_reads_wide_traces_in_smaller_batches(tmp_path, monkeypatch, batch_rows_asked):
    # one part per batch and side; 65536 rows of a 48-layer top-8 trace took a split to
    # 1.0 GB in pyarrow's decoding, so batches are sized by their expert cells
    from planner.predict.split import split_trace
    from planner.trace import TraceBatch, TraceMeta, write_trace
    from planner.trace.io import WIDE_BATCH_CELLS, open_trace

    meta = TraceMeta("m", num_layers=48, num_experts=128, top_k=8, vocab_size=100)
    t = 12
    experts = np.tile(np.arange(8, dtype=np.int16), (t, 48, 1))
    batch = TraceBatch.from_arrays(
        np.arange(t) // 2, np.arange(t) % 2, np.arange(t), experts, np.ones((t, 48, 8))
    )
    path = write_trace(tmp_path / "t.parquet", meta, batch)
    out = split_trace(path, tmp_path / "a", tmp_path / "b", 0.5)
    assert out["fit_tokens"] + out["heldout_tokens"] == t
    assert batch_rows_asked and all(
        rows * 48 * 8 <= WIDE_BATCH_CELLS for rows in batch_rows_asked
    ), batch_rows_asked
    monkeypatch.undo()
    assert open_trace(tmp_path / "a").num_rows + open_trace(tmp_path / "b").num_rows == t


def _rows(path, extras=()):
    from planner.trace import open_trace

    return open_trace(path).read_all(extras=extras)


def _as_sorted(batch):
    key = np.lexsort((batch.position, batch.request_id))
    return [getattr(batch, f)[key] for f in ("request_id", "position", "token_id", "experts")]


def test_shuffle_keeps_every_row_and_each_request_together(tmp_path, exact_trace, monkeypatch):
    import planner.predict.split as split

    path, _ = exact_trace
    s = split.shuffle_requests(path, tmp_path / "mixed", seed=3)
    before, after = _rows(path, ("domain",)), _rows(tmp_path / "mixed", ("domain",))
    assert s["tokens"] == len(before) == len(after)
    assert s["requests"] == np.unique(before.request_id).size
    for a, b in zip(_as_sorted(before), _as_sorted(after), strict=True):
        np.testing.assert_array_equal(a, b)
    # each request's rows in one run, in position order; the requests in another order
    runs = after.request_id[np.r_[True, after.request_id[1:] != after.request_id[:-1]]]
    assert runs.size == s["requests"]
    for r in runs[:20]:
        assert np.all(np.diff(after.position[after.request_id == r]) > 0)
    first_seen = before.request_id[np.sort(np.unique(before.request_id, return_index=True)[1])]
    assert not np.array_equal(runs, first_seen)
    # the domain column travels with its rows
    key_a = np.lexsort((before.position, before.request_id))
    key_b = np.lexsort((after.position, after.request_id))
    np.testing.assert_array_equal(
        np.asarray(before.extras["domain"])[key_a], np.asarray(after.extras["domain"])[key_b]
    )
    # the same seed gives the same order, another seed another; a trace read in blocks of
    # a few rows (one pass a block) comes out the same
    split.shuffle_requests(path, tmp_path / "again", seed=3)
    np.testing.assert_array_equal(_rows(tmp_path / "again").request_id, after.request_id)
    split.shuffle_requests(path, tmp_path / "other", seed=4)
    assert not np.array_equal(_rows(tmp_path / "other").request_id, after.request_id)
    from planner.trace import open_trace

    meta = open_trace(path).meta
    monkeypatch.setattr(split, "SHUFFLE_CELLS", 7 * meta.num_layers * meta.top_k)
    split.shuffle_requests(path, tmp_path / "blocks", seed=3)
    assert len(open_trace(tmp_path / "blocks").parts) == -(-len(before) // 7)
    blocks = _rows(tmp_path / "blocks")
    for f in ("request_id", "position", "token_id", "experts", "weights"):
        np.testing.assert_array_equal(getattr(blocks, f), getattr(after, f))


def test_trace_shuffle_cli_and_its_one_line_errors(tmp_path, exact_trace, capsys):
    from planner.cli.main import main

    path, _ = exact_trace
    out = tmp_path / "mixed"
    assert main(["trace", "shuffle", str(path), "--out", str(out), "--seed", "1"]) == 0
    assert "in a random order ->" in capsys.readouterr().out
    for args, message in (
        ([str(path), "--out", str(out)], "already exists; choose another path or pass --force"),
        ([str(path), "--out", str(tmp_path / "m.parquet")], "give a name without .parquet"),
        ([str(path), "--out", str(out), "--force", "--seed", "-1"], "must be an integer in"),
        ([str(tmp_path / "missing"), "--out", str(tmp_path / "x")], "missing"),
    ):
        capsys.readouterr()
        assert main(["trace", "shuffle", *args]) == 2
        err = capsys.readouterr().err
        assert err.startswith("moeplan: error:") and message in err and err.count("\n") == 1
    assert main(["trace", "shuffle", str(path), "--out", str(out), "--force"]) == 0
    assert not (tmp_path / "x").exists() and not (tmp_path / "m.parquet").exists()

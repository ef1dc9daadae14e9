"""Token-expert counts: the streaming accumulator, sorted merges and counts tables."""

from __future__ import annotations

import dataclasses
import json
from collections import Counter

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from planner.errors import InputError, SchemaError
from planner.predict import counts as counts_module
from planner.predict.counts import (
    CountsAccumulator,
    CountsSelection,
    SortedKeyCounter,
    TokenExpertCounts,
    counts_from_triples,
    merge_sorted_counts,
    read_counts_table,
    write_counts_table,
)
from planner.trace import TraceMeta
from tests.conftest import OLMOE_COUNTS, random_batch, require
from tests.predict.conftest import random_counts


def naive_counts(token_id, experts, rank0_only=False):
    c = Counter()
    for t in range(token_id.shape[0]):
        if token_id[t] < 0:
            continue
        for layer in range(experts.shape[1]):
            for e in experts[t, layer, :1] if rank0_only else experts[t, layer]:
                c[(layer, int(token_id[t]), int(e))] += 1
    return c


def as_counter(mats) -> Counter:
    c = Counter()
    for layer, m in enumerate(mats):
        coo = m.tocoo()
        for j, e, v in zip(coo.row, coo.col, coo.data, strict=True):
            c[(layer, int(j), int(e))] += int(v)
    return c


@pytest.mark.parametrize("wide", [False, True])
@pytest.mark.parametrize("vocab", [50, 3_000_000])
def test_accumulator_matches_naive_counting(small_meta, vocab, wide, monkeypatch):
    # keys are j * N + e per layer: uint32 unless V x N >= 2**32, which no test vocabulary
    # reaches, so the uint64 keys are forced
    if wide:
        monkeypatch.setattr(counts_module, "_key_dtype", lambda max_key: np.uint64)
    meta = TraceMeta(
        "test/acc", small_meta.num_layers, small_meta.num_experts, small_meta.top_k, vocab
    )
    acc = CountsAccumulator(meta, buffer_keys=150)  # forces many flushes and merges
    assert acc._counters[0].dtype == (np.uint64 if wide else np.uint32)
    batches = [random_batch(meta, 97, seed=s) for s in range(5)]
    batches[2].token_id[:10] = -1  # unknown tokens are skipped
    for b in batches:
        acc.add(b.token_id, b.experts)
    got = acc.result()
    tok = np.concatenate([b.token_id for b in batches])
    ex = np.concatenate([b.experts for b in batches])
    assert as_counter(got.by_layer) == naive_counts(tok, ex)
    assert as_counter(got.top1_by_layer) == naive_counts(tok, ex, rank0_only=True)
    assert acc.unknown_tokens == 10
    for m in got.by_layer:
        assert m.has_canonical_format and m.dtype == np.int64
    # Row sums are k x occurrences of the token.
    occ = np.bincount(tok[tok >= 0], minlength=vocab)
    np.testing.assert_array_equal(got.token_activations()[0], meta.top_k * occ)


@pytest.mark.parametrize("vocab", [50, 3_000_000])
@pytest.mark.parametrize("take", [1, 3, 100])  # 100: more than any token's experts
def test_top_counts_match_naive_counting(small_meta, vocab, take):
    meta = TraceMeta(
        "test/top", small_meta.num_layers, small_meta.num_experts, small_meta.top_k, vocab
    )
    acc = CountsAccumulator(meta, buffer_keys=150, top1=False)
    batches = [random_batch(meta, 97, seed=s) for s in range(4)]
    for b in batches:
        acc.add(b.token_id, b.experts)
    got = acc.top_counts(take)
    naive = naive_counts(
        np.concatenate([b.token_id for b in batches]),
        np.concatenate([b.experts for b in batches]),
    )
    for layer in range(meta.num_layers):
        rows: dict[int, list[int]] = {}
        for (lay, j, _), c in naive.items():
            if lay == layer:
                rows.setdefault(j, []).append(c)
        hosted = sum(sum(sorted(cs, reverse=True)[:take]) for cs in rows.values())
        total = sum(sum(cs) for cs in rows.values())
        assert got[layer].tolist() == [hosted, total]


def test_merge_sorted_counts_random():
    rng = np.random.default_rng(0)
    for _ in range(200):
        a = np.unique(rng.integers(0, 40, rng.integers(0, 25))).astype(np.uint64)
        b = np.unique(rng.integers(0, 40, rng.integers(0, 25))).astype(np.uint64)
        ca, cb = rng.integers(1, 9, a.size), rng.integers(1, 9, b.size)
        keys, counts = merge_sorted_counts(a, ca, b, cb)
        want = Counter(dict(zip(a.tolist(), ca.tolist(), strict=True)))
        want.update(dict(zip(b.tolist(), cb.tolist(), strict=True)))
        assert keys.tolist() == sorted(want)
        assert counts.tolist() == [want[x] for x in sorted(want)]


def test_merge_sorted_counts_overwrite_a_matches_the_copying_merge():
    rng = np.random.default_rng(3)
    for _ in range(100):
        a = np.unique(rng.integers(0, 60, rng.integers(1, 30))).astype(np.uint32)
        b = np.unique(rng.integers(0, 60, rng.integers(1, 30))).astype(np.uint32)
        ca, cb = rng.integers(1, 9, a.size).astype(np.int32), rng.integers(1, 9, b.size)
        kept = ca.copy()
        want = merge_sorted_counts(a, ca, b, cb.astype(np.int32))
        np.testing.assert_array_equal(ca, kept)  # the default leaves a's counts alone
        got = merge_sorted_counts(a, ca, b, cb.astype(np.int32), overwrite_a=True)
        np.testing.assert_array_equal(got[0], want[0])
        np.testing.assert_array_equal(got[1], want[1])
        assert got[1].dtype == np.int32


def test_sorted_key_counter_widens_its_counts_before_they_could_overflow(monkeypatch):
    # int32 counts while at most NARROW_MAX keys were fed, int64 (same values) after
    monkeypatch.setattr(SortedKeyCounter, "NARROW_MAX", 500)
    rng = np.random.default_rng(4)
    chunks = [rng.integers(0, 50, 200).astype(np.uint32) for _ in range(5)]
    counter = SortedKeyCounter(np.uint32, capacity=150)
    dtypes = []
    for c in chunks:
        counter.add_keys(c)
        dtypes.append(counter.counts.dtype)
    keys, counts = counter.result()
    # flushes at the 2nd..5th chunk: 200, 400, 600, 800 keys fed
    assert dtypes == [np.int32] * 3 + [np.int64] * 2 and counts.dtype == np.int64
    want = Counter(np.concatenate(chunks).tolist())
    assert keys.tolist() == sorted(want)
    assert counts.tolist() == [want[x] for x in sorted(want)]
    # handed over: the counter is empty again
    assert counter.result()[0].size == 0


def test_sorted_key_counter_narrow_and_wide_keys_agree():
    rng = np.random.default_rng(1)
    chunks = [rng.integers(0, 1000, 300) for _ in range(6)]
    narrow, wide = (
        SortedKeyCounter(np.uint32, capacity=50),
        SortedKeyCounter(np.uint64, capacity=50),
    )
    for c in chunks:
        narrow.add_keys(c.astype(np.uint32))
        wide.add_keys(c.astype(np.uint64))
    kn, cn = narrow.result()
    kw, cw = wide.result()
    want = Counter(np.concatenate(chunks).tolist())
    assert kn.tolist() == kw.tolist() == sorted(want)
    assert cn.tolist() == cw.tolist() == [want[x] for x in sorted(want)]


def test_counts_table_round_trip(tmp_path, small_meta):
    counts = random_counts(small_meta, 60, seed=2)
    path = write_counts_table(tmp_path / "c.parquet", counts)
    back = read_counts_table(path)
    assert back.meta.fingerprint() != ""  # model name comes from the metadata
    assert (back.meta.num_layers, back.meta.num_experts, back.meta.top_k, back.meta.vocab_size) == (
        small_meta.num_layers, small_meta.num_experts, small_meta.top_k, small_meta.vocab_size,
    )  # fmt: skip
    assert as_counter(back.by_layer) == as_counter(counts.by_layer)
    assert back.top1_by_layer is None


def test_a_counts_table_keeps_the_model_layers_of_its_moe_layers(tmp_path, small_meta):
    """A trace's counts written as a table were read back as model layers 0..L-1: a plan
    fitted on FLAME-MoE's counts (MoE layers at model layers 2-9) was refused against
    FLAME-MoE's own trace ("MoE layer 0 is model layer 0 in the bundle and 2 in the trace")."""
    layers = tuple(range(2, 2 + small_meta.num_layers))
    meta = dataclasses.replace(small_meta, moe_layer_indices=layers)
    counts = random_counts(meta, 60, seed=2)
    back = read_counts_table(write_counts_table(tmp_path / "c.parquet", counts))
    assert back.meta.moe_layer_indices == layers
    assert back.meta.layer_mismatch(meta, ("counts", "trace")) is None
    for bad in ([5, 3], [1], ["a", 2], -1):
        declared = json.loads(pq.read_schema(tmp_path / "c.parquet").metadata[b"moeplan"])
        declared["moe_layer_indices"] = bad
        table = pq.read_table(tmp_path / "c.parquet")
        table = table.replace_schema_metadata({"moeplan": json.dumps(declared)})
        pq.write_table(table, tmp_path / "bad.parquet")
        with pytest.raises(SchemaError, match="moe_layer_indices must be num_layers increasing"):
            read_counts_table(tmp_path / "bad.parquet")


def test_damaged_counts_table_names_the_file(tmp_path, small_meta):
    """A page that does not decode was an OSError without the file's name."""
    counts = random_counts(small_meta, 400, seed=3)
    path = write_counts_table(tmp_path / "c.parquet", counts)  # zstd
    group = pq.ParquetFile(path).metadata.row_group(0)
    chunk = next(group.column(c) for c in range(group.num_columns)
                 if group.column(c).path_in_schema == "count")  # fmt: skip
    end = (chunk.dictionary_page_offset or chunk.data_page_offset) + chunk.total_compressed_size
    data = bytearray(path.read_bytes())
    data[end - 16 : end] = b"\xff" * 16
    path.write_bytes(bytes(data))
    with pytest.raises(SchemaError, match="c.parquet: unreadable Parquet data"):
        read_counts_table(path)


def _olmoe_like(tmp_path):
    """A small table in the layout of the real OLMoE export (model/domain, model layer ids)."""
    rows = {
        "model": ["org/OLMoE-1B-7B-x"] * 5 + ["org/Other"] * 2,
        "domain": ["arxiv", "arxiv", "github", "github", "book", "arxiv", "arxiv"],
        "layer": [0, 15, 0, 15, 15, 0, 0],
        "token_id": [5, 5, 7, 7, 2, 1, 1],
        "expert": [3, 2, 3, 9, 4, 0, 1],
        "count": [8, 8, 16, 16, 8, 1, 1],
    }
    # OLMoE routes top-8: each OLMoE (domain, layer, token) above also activated experts
    # 40-46 as often (counts of real top-k routing; see _check_top_k)
    for i in range(5):
        for key in ("model", "domain", "layer", "token_id", "count"):
            rows[key] += [rows[key][i]] * 7
        rows["expert"] += list(range(40, 47))
    table = pa.table({
        "model": pa.array(rows["model"]).dictionary_encode(),
        "domain": pa.array(rows["domain"]).dictionary_encode(),
        "layer": pa.array(rows["layer"], pa.int16()),
        "token_id": pa.array(rows["token_id"], pa.int32()),
        "expert": pa.array(rows["expert"], pa.int16()),
        "count": pa.array(rows["count"], pa.int32()),
    })  # fmt: skip
    path = tmp_path / "olmoe_like.parquet"
    pq.write_table(table.replace_schema_metadata({"source": "test"}), path)
    return path


def test_real_layout_selection_and_layer_mapping(tmp_path):
    path = _olmoe_like(tmp_path)
    with pytest.raises(InputError, match="several models"):
        read_counts_table(path)
    with pytest.raises(InputError, match="matches none"):
        read_counts_table(path, CountsSelection(model="nothing"))
    with pytest.raises(InputError, match="available: arxiv, book, github"):
        read_counts_table(path, CountsSelection(model="OLMoE", domains=("wiki",)))
    with pytest.raises(InputError, match="--num-experts"):
        read_counts_table(path, CountsSelection(model="Other"))
    c = read_counts_table(path, CountsSelection(model="olmoe"))  # substring, any case
    assert c.meta.moe_layer_indices == (0, 15)
    assert (c.meta.num_experts, c.meta.top_k, c.meta.vocab_size) == (64, 8, 50304)
    assert c.domains == ("arxiv", "book", "github")
    assert c.by_layer[1][7, 9] == 16 and c.by_layer[0][5, 3] == 8
    arxiv = read_counts_table(path, CountsSelection(model="OLMoE", domains=("arxiv",)))
    assert arxiv.total_activations() == 8 * 16
    # A domain with counts at model layer 15 only still maps it to MoE layer 1.
    book = read_counts_table(path, CountsSelection(model="OLMoE", domains=("book",)))
    assert book.meta.moe_layer_indices == (0, 15) and book.by_layer[1][2, 4] == 8
    assert book.meta.fingerprint() == arxiv.meta.fingerprint()
    other = read_counts_table(
        path, CountsSelection(model="Other", num_experts=4, top_k=1, vocab_size=10)
    )
    assert other.meta.num_layers == 1


@pytest.mark.parametrize(
    "column, values, message",
    [
        # the layer column was read before its type was checked: ValueError/TypeError
        ("layer", pa.array(["a", "b", "c"]), "column layer is string, expected integers"),
        ("layer", pa.nulls(3, pa.int16()), "column layer holds 3 null value"),
        # a list cast to strings: ArrowNotImplementedError
        ("domain", pa.array([[1], [2], [3]]), "column domain is list<.*>, expected names"),
        ("model", pa.array([[1], [2], [3]]), "column model is list<.*>, expected names"),
        # a null domain became a domain "None" that no --domain could select
        ("domain", pa.array(["a", None, "b"]), "column domain holds 1 null value"),
        ("model", pa.array(["m", None, "m"]), "column model holds 1 null value"),
    ],
)
def test_counts_name_and_layer_columns_of_the_wrong_kind_are_one_line(
    tmp_path, column, values, message
):
    import json

    table = pa.table({
        "layer": pa.array([0, 0, 1], pa.int16()), "token_id": pa.array([1, 2, 3], pa.int32()),
        "expert": pa.array([0, 1, 2], pa.int16()), "count": pa.array([2, 2, 2], pa.int64()),
    })  # fmt: skip
    if column in table.column_names:
        table = table.set_column(table.column_names.index(column), column, values)
    else:
        table = table.append_column(column, values)
    meta = {"schema": "counts", "num_experts": 4, "top_k": 2, "vocab_size": 5}
    path = tmp_path / "c.parquet"
    pq.write_table(table.replace_schema_metadata({"moeplan": json.dumps(meta)}), path)
    with pytest.raises(SchemaError, match=message):
        read_counts_table(path, CountsSelection(model="m" if column == "model" else None))


def test_numpy_shapes_and_sizes_reach_the_saved_predictor(tmp_path):
    # they passed the checks, then the save failed ("int64 is not JSON serializable") after
    # the work
    from planner.predict.fit import FitConfig, fit_predictor
    from planner.predict.predictor import Predictor

    table = pa.table({
        "layer": pa.array([0, 0, 1, 1], pa.int16()), "token_id": pa.array([1, 2, 3, 1], pa.int32()),
        "expert": pa.array([0, 1, 2, 3], pa.int16()), "count": pa.array([2, 2, 2, 2], pa.int64()),
    })  # fmt: skip
    pq.write_table(table, tmp_path / "c.parquet")
    shapes = CountsSelection(num_experts=np.int64(4), top_k=np.int64(1), vocab_size=np.int64(5))
    config = FitConfig(counts=shapes, ep_size=np.int64(2), ngram_order=np.int64(1), progress=False)
    fit_predictor(tmp_path / "c.parquet", config).predictor.save(tmp_path / "p")
    assert Predictor.load(tmp_path / "p").meta.num_experts == 4


def test_rows_of_count_zero_are_dropped_and_the_fitted_predictor_loads(tmp_path):
    # A table may list a (token, expert) pair with count 0; kept as an explicit zero it
    # was saved into the predictor, whose loader refuses non-positive counts, so `fit`
    # wrote a predictor nothing could read.
    from planner.predict.affinity import TokenExpertAffinity

    table = pa.table({
        "layer": pa.array([0, 0, 0, 0], pa.int16()),
        "token_id": pa.array([1, 1, 1, 2], pa.int32()),
        "expert": pa.array([0, 1, 2, 3], pa.int16()),
        "count": pa.array([3, 3, 0, 2], pa.int32()),
    })  # fmt: skip
    path = tmp_path / "zeros.parquet"
    pq.write_table(table, path)
    c = read_counts_table(path, CountsSelection(num_experts=4, top_k=1, vocab_size=5))
    assert c.by_layer[0].nnz == 3 and c.by_layer[0].data.min() > 0
    aff = TokenExpertAffinity().fit(c)
    back = TokenExpertAffinity.from_tensors(
        c.meta, aff.to_tensors(), fallback=aff.fallback_, confident_threshold=0.5
    )
    ids = np.arange(5)
    np.testing.assert_array_equal(back.predict_topk(ids, 0), aff.predict_topk(ids, 0))


def test_counts_that_top_k_routing_cannot_give_are_refused(tmp_path, small_meta):
    """A k too large for the counts (an expert counted more often than its token occurred
    at that k) is refused; the counts' own k reads."""
    path = write_counts_table(tmp_path / "c.parquet", random_counts(small_meta, 60, seed=3))
    assert read_counts_table(path).meta.top_k == 2
    with pytest.raises(InputError, match=r"tokens break this there\)$") as caught:
        read_counts_table(path, CountsSelection(top_k=3))
    assert "is --top-k 3 the model's?" in str(caught.value)


def test_counts_out_of_range_ids_are_refused(tmp_path):
    path = _olmoe_like(tmp_path)
    with pytest.raises(SchemaError, match="token_id 7 outside"):
        read_counts_table(path, CountsSelection(model="OLMoE", vocab_size=6))
    # a negative layer without num_layers metadata: the error named neither file nor column
    table = pq.read_table(path)
    layers = table.column("layer").to_numpy().copy()
    layers[0] = -3
    table = table.set_column(table.schema.get_field_index("layer"), "layer", pa.array(layers))
    pq.write_table(table, path)
    with pytest.raises(SchemaError, match="olmoe_like.parquet: layer -3 is negative"):
        read_counts_table(path, CountsSelection(model="OLMoE"))


def test_counts_meta_mismatch_is_refused(small_meta):
    with pytest.raises(SchemaError):
        TokenExpertCounts(small_meta, ())


def test_real_olmoe_counts_read():
    path = require(OLMOE_COUNTS)
    c = read_counts_table(path, CountsSelection(model="Mixtral", domains=("arxiv",)))
    assert (c.meta.num_experts, c.meta.top_k, c.meta.vocab_size) == (8, 2, 32000)
    assert c.meta.moe_layer_indices == (0, 7, 15)
    # Each layer holds k activations per token occurrence: ~209k tokens per domain.
    per_layer = c.token_activations().sum(axis=1)
    assert (per_layer == per_layer[0]).all() and per_layer[0] % 2 == 0


@pytest.mark.parametrize(
    ("meta", "message"),
    [
        (b"[1]", "must be a JSON object, not list"),
        (b'{"schema": "counts", "num_layers": "x"}', "num_layers='x' must be a positive integer"),
        (b'{"schema": "counts", "num_experts": 0}', "num_experts=0 must be a positive integer"),
        (b'{"schema": "counts", "top_k": true}', "top_k=True must be a positive integer"),
        (b'{"schema": "counts", "model": 3}', "model=3 must be a string"),
    ],
)
def test_malformed_counts_metadata_is_a_schema_error(tmp_path, small_meta, meta, message):
    arrays = [np.array(a) for a in ([0, 1], [3, 4], [1, 2], [5, 6])]
    counts = counts_from_triples(small_meta, *arrays)
    path = write_counts_table(tmp_path / "c.parquet", counts)
    table = pq.read_table(path)
    pq.write_table(table.replace_schema_metadata({b"moeplan": meta}), path)
    with pytest.raises(SchemaError, match=message):
        read_counts_table(path)


def test_a_table_without_domains_names_the_flag_given(tmp_path, small_meta):
    """`fit TABLE --eval-domain x` on a table without a domain column said "drop --domain",
    a flag the user had not given."""
    from planner.predict.fit import FitConfig, fit_predictor

    path = write_counts_table(tmp_path / "c.parquet", random_counts(small_meta, 60, seed=2))
    with pytest.raises(InputError, match="no 'domain' column; drop --eval-domain$"):
        fit_predictor(path, FitConfig(eval_domains=("x",), progress=False))
    with pytest.raises(InputError, match="no 'domain' column; drop --domain$"):
        read_counts_table(path, CountsSelection(domains=("x",)))

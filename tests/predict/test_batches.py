"""The fitting batches' token mix: cut in trace order, bounded, saved with the predictor."""

from __future__ import annotations

import json

import numpy as np
import pytest

from planner.errors import InputError, SchemaError
from planner.predict.batches import BatchMix, BatchMixAccumulator, MixedBatchAccumulator
from planner.predict.fit import FitConfig, fit_predictor
from planner.predict.predictor import MANIFEST, Predictor


def test_rows_are_cut_in_order_across_chunks() -> None:
    acc = BatchMixAccumulator(vocab_size=10, batch_tokens=4)
    acc.add(np.array([1, 1, 2]))
    acc.add(np.array([3, 5, 5, -1, 5, 9]))  # -1 (unknown) fills a slot, has no row
    mix = acc.result()
    dense = mix.counts.toarray()
    assert dense.shape == (3, 10)
    np.testing.assert_array_equal(dense[0], np.bincount([1, 1, 2, 3], minlength=10))
    np.testing.assert_array_equal(dense[1], np.bincount([5, 5, 5], minlength=10))
    np.testing.assert_array_equal(dense[2], np.bincount([9], minlength=10))  # the short tail
    freq = mix.token_batch_freq(np.array([5, 1, 0]))
    np.testing.assert_array_equal(freq.toarray(), [[0, 3, 0], [2, 0, 0], [0, 0, 0]])


def test_long_traces_keep_a_bounded_evenly_spaced_subset() -> None:
    acc = BatchMixAccumulator(vocab_size=1000, batch_tokens=2, max_batches=8)
    acc.add(np.repeat(np.arange(1000), 2))  # batch i holds token i twice
    mix = acc.result()
    assert 1 <= mix.num_batches <= 8 and mix.stride > 1
    kept = np.flatnonzero(mix.counts.sum(axis=0))
    assert kept[0] == 0 and np.all(np.diff(kept) % mix.stride == 0)
    assert kept[-1] > 800  # spread over the whole trace, not its head


def test_tensors_round_trip_and_malformed_are_refused() -> None:
    acc = BatchMixAccumulator(vocab_size=7, batch_tokens=3)
    acc.add(np.array([0, 6, 6, 2, 2, 2, 1]))
    mix = acc.result()
    back = BatchMix.from_tensors(mix.to_tensors(), 7)
    np.testing.assert_array_equal(back.counts.toarray(), mix.counts.toarray())
    assert (back.batch_tokens, back.stride) == (3, 1)
    with pytest.raises(SchemaError, match="expected"):
        BatchMix.from_tensors(mix.to_tensors(), 8)
    bad = mix.to_tensors()
    del bad["settings"]
    with pytest.raises(SchemaError, match="malformed"):
        BatchMix.from_tensors(bad, 7)


def test_predictor_keeps_the_mix_and_version_2_still_loads(exact_trace, tmp_path) -> None:
    path, _ = exact_trace
    pred = fit_predictor(path, FitConfig(holdout=0.3)).predictor
    assert pred.batches is not None and pred.batches.num_batches >= 1
    # every fitting row with a known token is counted once
    assert pred.batches.counts.sum() == pred.affinity.token_frequency().sum()
    out = pred.save(tmp_path / "pred")
    back = Predictor.load(out)
    np.testing.assert_array_equal(back.batches.counts.toarray(), pred.batches.counts.toarray())
    # a version-2 predictor (no batches file) loads, without a mix
    manifest = json.loads((out / MANIFEST).read_text())
    manifest["format_version"] = 2
    del manifest["batches"]
    del manifest["files"]["batches.safetensors"]
    (out / MANIFEST).write_text(json.dumps(manifest))
    assert Predictor.load(out).batches is None


def test_batch_tokens_must_be_positive(exact_trace) -> None:
    path, _ = exact_trace
    with pytest.raises(InputError, match="batch_tokens"):
        fit_predictor(path, FitConfig(batch_tokens=0))
    small = fit_predictor(path, FitConfig(batch_tokens=500)).predictor.batches
    assert small.batch_tokens == 500 and small.counts.sum(axis=1).max() <= 500


def _mixed_by_hand(tokens, requests, seed, batch_tokens):
    """The rows put in the accumulator's request order (each request's rows in arrival
    order), cut into batches: dense [G, V] counts."""
    ids = np.unique(requests)
    order = ids[np.random.default_rng(seed).permutation(ids.size)]
    rows = np.concatenate([tokens[requests == r] for r in order])
    batches = [rows[i : i + batch_tokens] for i in range(0, rows.size, batch_tokens)]
    return np.stack([np.bincount(b[b >= 0], minlength=20) for b in batches])


def test_mixed_batches_are_the_requests_in_a_random_order() -> None:
    rng = np.random.default_rng(0)
    requests = np.repeat([3, 8, 9, 14, 20, 21], [5, 2, 7, 4, 6, 3])  # trace order, contiguous
    tokens = rng.integers(-1, 20, requests.size)
    ids, lengths = np.unique(requests, return_counts=True)
    acc = MixedBatchAccumulator(20, ids, lengths, seed=4, batch_tokens=4)
    for chunk in np.array_split(np.arange(requests.size), 5):  # chunks of any size
        acc.add(tokens[chunk], requests[chunk])
    mix = acc.result()
    expected = _mixed_by_hand(tokens, requests, 4, 4)
    expected = expected[expected.sum(axis=1) > 0]  # (a batch of unknown tokens only: no row)
    np.testing.assert_array_equal(mix.counts.toarray(), expected)
    assert mix.counts.sum() == np.sum(tokens >= 0)
    with pytest.raises(InputError, match="none of the requests"):
        acc.add(np.array([1]), np.array([5]))


def test_a_trace_served_one_domain_at_a_time_is_mixed(exact_trace) -> None:
    """Fitted with --mixed-batches, a batch holds several requests' rows where in trace order
    it held a run of consecutive requests; both keep every fitting row."""
    path, _ = exact_trace
    ordered = fit_predictor(path, FitConfig(batch_tokens=512, holdout=0.3))
    mixed = fit_predictor(path, FitConfig(batch_tokens=512, holdout=0.3, mixed_batches=True))
    assert ordered.predictor.fit_info["batches"]["order"] == "trace"
    assert mixed.predictor.fit_info["batches"]["order"] == "mixed"
    a, b = ordered.predictor.batches.counts, mixed.predictor.batches.counts
    assert ordered.predictor.batches.stride == mixed.predictor.batches.stride == 1
    np.testing.assert_array_equal(np.asarray(a.sum(axis=0)), np.asarray(b.sum(axis=0)))
    assert a.shape == b.shape and (a != b).nnz > 0
    again = fit_predictor(path, FitConfig(batch_tokens=512, holdout=0.3, mixed_batches=True))
    assert (again.predictor.batches.counts != b).nnz == 0  # seeded


def test_batch_spread_is_the_mean_total_variation_from_all_batches() -> None:
    from scipy import sparse

    from planner.predict.batches import MIN_SPREAD_BATCHES, batch_spread

    rng = np.random.default_rng(0)
    counts = np.stack([np.bincount(rng.integers(0, 20 + 30 * (g % 2), 100), minlength=50)
                       for g in range(6)])  # fmt: skip
    p, q = counts / 100, counts.sum(axis=0) / counts.sum()
    expected = np.mean(0.5 * np.abs(p - q).sum(axis=1))
    assert batch_spread(BatchMix(sparse.csr_array(counts), 100)) == pytest.approx(expected)
    # a shorter last batch is left out, and too few full batches give no figure
    short = np.vstack([counts, np.eye(50, dtype=int)[0] * 7])
    assert batch_spread(BatchMix(sparse.csr_array(short), 100)) == pytest.approx(expected)
    few = counts[: MIN_SPREAD_BATCHES - 1]
    assert batch_spread(BatchMix(sparse.csr_array(few), 100)) is None


def _two_domain_trace(tmp_path):
    """200 requests of 20 tokens: the first 100 use tokens 0-9, the last 100 tokens 10-19."""
    from planner.trace import TraceBatch, TraceMeta, write_trace

    rng = np.random.default_rng(1)
    meta = TraceMeta("m", num_layers=2, num_experts=4, top_k=1, vocab_size=100)
    request = np.repeat(np.arange(200), 20)
    tokens = rng.integers(0, 10, request.size) + 10 * (request >= 100)
    experts = (tokens[:, None, None] % 4 + np.zeros((1, 2, 1), int)).astype(np.int16)
    batch = TraceBatch.from_arrays(
        request, np.tile(np.arange(20), 200), tokens, experts, np.ones((request.size, 2, 1))
    )
    return write_trace(tmp_path / "t.parquet", meta, batch)


def test_fit_says_when_the_trace_order_batches_are_far_from_mixed(tmp_path) -> None:
    from planner.predict.batches import ORDER_NOTE_RATIO
    from planner.predict.report import batch_order_note, render_fit_summary
    from planner.predict.split import shuffle_requests

    path = _two_domain_trace(tmp_path)
    info = fit_predictor(path, FitConfig(batch_tokens=200)).predictor.fit_info
    spread = info["batches"]["spread"]
    assert spread["trace"] > ORDER_NOTE_RATIO * spread["mixed"]
    assert "fit with --mixed-batches" in render_fit_summary(info, "p").plain
    # fitted mixed, nothing to say; the same requests already shuffled spread alike
    mixed = fit_predictor(path, FitConfig(batch_tokens=200, mixed_batches=True))
    assert mixed.predictor.fit_info["batches"]["spread"] == spread
    assert batch_order_note(mixed.predictor.fit_info["batches"]) is None
    shuffle_requests(path, tmp_path / "shuffled", seed=5)
    served = fit_predictor(tmp_path / "shuffled", FitConfig(batch_tokens=200)).predictor
    ratio = served.fit_info["batches"]["spread"]["trace"] / spread["mixed"]
    assert 0.8 < ratio < 1.2 and batch_order_note(served.fit_info["batches"]) is None
    assert batch_order_note({"order": "trace", "spread": {"trace": None, "mixed": None}}) is None

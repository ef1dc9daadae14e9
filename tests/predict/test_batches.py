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

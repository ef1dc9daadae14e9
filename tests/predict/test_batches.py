"""The fitting batches' token mix: cut in trace order, bounded, saved with the predictor."""

from __future__ import annotations

import json

import numpy as np
import pytest

from planner.errors import InputError, SchemaError
from planner.predict.batches import BatchMix, BatchMixAccumulator
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

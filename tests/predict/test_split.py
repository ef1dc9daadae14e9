"""Request-level split and binomial thinning."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planner.errors import InputError
from planner.predict.counts import counts_from_triples
from planner.predict.split import RequestSplit, check_fraction, thin_counts


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
    rng = np.random.default_rng(0)
    n = 300
    counts = counts_from_triples(
        small_meta,
        rng.integers(0, small_meta.num_layers, n),
        rng.integers(0, small_meta.vocab_size, n),
        rng.integers(0, small_meta.num_experts, n),
        rng.integers(1, 200, n),
    )
    fit, held = thin_counts(counts, 0.3, seed=4)
    for a, b, c in zip(fit.by_layer, held.by_layer, counts.by_layer, strict=True):
        assert ((a + b) != c).nnz == 0
        assert a.data.min() > 0 and b.data.min() > 0  # zeros eliminated
    share = held.total_activations() / counts.total_activations()
    assert abs(share - 0.3) < 0.02
    fit2, _ = thin_counts(counts, 0.3, seed=4)
    assert all((x != y).nnz == 0 for x, y in zip(fit.by_layer, fit2.by_layer, strict=True))

"""Distribution-only predictor (MoE-GPS): MLE, moving averages, error rate, skewness."""

from __future__ import annotations

import numpy as np
import pytest

from planner.errors import InputError
from planner.predict.distribution import (
    DistributionPredictor,
    batch_load,
    empirical_distribution,
    error_rate,
)
from planner.trace.info import load_skewness


def test_error_rate_is_mean_abs_error_over_uniform_share():
    p_hat = np.array([[0.5, 0.25, 0.25, 0.0]])
    p = np.array([[0.25, 0.25, 0.25, 0.25]])
    # |diff| = [0.25, 0, 0, 0.25]; mean 0.125; divided by 1/N = 0.25 -> 0.5 (the L1 distance).
    np.testing.assert_allclose(error_rate(p_hat, p), [0.5])
    with pytest.raises(InputError):
        error_rate(p_hat, p[:, :3])


def test_mle_is_the_size_weighted_running_mean():
    loads = [np.array([[3, 1], [0, 4]]), np.array([[1, 3], [2, 2]]), np.array([[0, 0], [6, 0]])]
    d = DistributionPredictor().fit(loads)
    np.testing.assert_allclose(d.predict(), empirical_distribution(sum(loads)))
    np.testing.assert_allclose(d.predict()[0], [0.5, 0.5])
    assert d.batches_ == 3


def test_exponential_moving_average_follows_recent_batches():
    first, second = np.array([[10, 0]]), np.array([[0, 10]])
    d = DistributionPredictor(momentum=0.25).fit([first, second])
    np.testing.assert_allclose(d.predict(), [[0.75, 0.25]])
    with pytest.raises(InputError):
        DistributionPredictor(momentum=1.5).partial_fit(first)


def test_error_is_near_zero_for_huge_samples_and_grows_for_small_ones():
    rng = np.random.default_rng(0)
    p = rng.dirichlet(np.ones(16), size=3)  # [L=3, N=16]

    def sample(tokens: int) -> np.ndarray:
        return np.stack([rng.multinomial(tokens, row) for row in p])

    fitted = DistributionPredictor().partial_fit(sample(2_000_000))
    big = error_rate(fitted.predict(), empirical_distribution(sample(2_000_000))).mean()
    small = error_rate(fitted.predict(), empirical_distribution(sample(200))).mean()
    assert big < 0.01
    assert small > 10 * big and small > 0.1


def test_skewness_and_batch_load():
    experts = np.array([[[0, 1], [2, 3]], [[0, 2], [2, 1]]], np.int16)  # [T=2, L=2, k=2]
    load = batch_load(experts, 4)
    np.testing.assert_array_equal(load, [[2, 1, 1, 0], [0, 1, 2, 1]])
    np.testing.assert_allclose(load_skewness(load), [2.0, 2.0])


def test_fit_feeds_trace_batches_to_a_moving_average(exact_trace):
    from planner.predict.fit import FitConfig, fit_predictor
    from planner.trace.io import open_trace

    path, _ = exact_trace
    mle = fit_predictor(path, FitConfig()).predictor.distribution
    trace = open_trace(path)
    rows = list(trace.iter_batches(5000, weights=False))
    total = sum(batch_load(r.experts, trace.meta.num_experts) for r in rows)
    np.testing.assert_allclose(mle.predict(), empirical_distribution(total))
    last = fit_predictor(path, FitConfig(distribution_momentum=1.0, batch_rows=5000))
    want = empirical_distribution(batch_load(rows[-1].experts, trace.meta.num_experts))
    np.testing.assert_allclose(last.predictor.distribution.predict(), want)
    assert last.predictor.distribution.batches_ == len(rows)

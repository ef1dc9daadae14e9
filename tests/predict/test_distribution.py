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


def test_fit_feeds_runtime_batches_to_a_moving_average(exact_trace):
    """The moving average steps over runtime batches of --batch-tokens fitting rows in trace
    order, whatever chunks the trace is read in (it stepped over the reading chunks, so
    --batch-rows, a memory setting, changed the estimate)."""
    from planner.predict.fit import FitConfig, fit_predictor
    from planner.trace.io import open_trace

    path, _ = exact_trace
    mle = fit_predictor(path, FitConfig()).predictor.distribution
    trace = open_trace(path)
    experts = np.concatenate([r.experts for r in trace.iter_batches(5000, weights=False)])
    n = trace.meta.num_experts
    np.testing.assert_allclose(mle.predict(), empirical_distribution(batch_load(experts, n)))
    size = 3500  # not a divisor of the rows, nor of the reading chunks
    assert len(experts) % size and len(experts) > 2 * size
    cuts = range(0, len(experts), size)
    want = DistributionPredictor(momentum=0.3).fit(
        batch_load(experts[i : i + size], n) for i in cuts
    )
    for chunk in (5000, 777):
        got = fit_predictor(
            path, FitConfig(distribution_momentum=0.3, batch_rows=chunk, batch_tokens=size)
        ).predictor.distribution
        np.testing.assert_allclose(got.predict(), want.predict())
        assert got.batches_ == len(cuts)
    last = fit_predictor(path, FitConfig(distribution_momentum=1.0, batch_tokens=size))
    np.testing.assert_allclose(
        last.predictor.distribution.predict(),
        empirical_distribution(batch_load(experts[cuts[-1] :], n)),
    )


def test_saved_tensors_of_a_wrong_shape_are_named_in_the_error():
    """The message names the tensor whose shape is wrong (it printed the probabilities'
    shape, the expected one, when the load was the wrong one)."""
    from planner.errors import SchemaError

    d = DistributionPredictor().fit([np.array([[3, 1], [0, 4]])])
    tensors = d.to_tensors()
    DistributionPredictor.from_tensors(tensors, None, (2, 2))
    bad = tensors | {"load": tensors["load"][:1]}
    with pytest.raises(SchemaError, match=r"'load' has shape \(1, 2\), expected \(2, 2\)"):
        DistributionPredictor.from_tensors(bad, None, (2, 2))
    bad = tensors | {"probabilities": tensors["probabilities"].T[:, :1]}
    with pytest.raises(SchemaError, match=r"'probabilities' has shape \(2, 1\)"):
        DistributionPredictor.from_tensors(bad, None, (2, 2))

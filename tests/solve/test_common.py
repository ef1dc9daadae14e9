"""The shared pieces every solver uses: gains, expert repair, token rebalancing."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from planner.solve import common
from planner.solve.ceo import sample_balanced
from tests.solve.instances import random_problem


def test_place_experts_is_exact() -> None:
    rng = np.random.default_rng(0)
    score = rng.random((3, 6))
    x = common.place_experts(score, 2)
    assert np.bincount(x, minlength=3).tolist() == [2, 2, 2]
    best = max(
        sum(score[d, k] for k, d in enumerate(labels))
        for labels in itertools.product(range(3), repeat=6)
        if np.bincount(labels, minlength=3).tolist() == [2, 2, 2]
    )
    assert score[x, np.arange(6)].sum() == pytest.approx(best)


def test_repair_moves_only_what_it_must() -> None:
    score = np.array([[5.0, 4.0, 3.0, 0.0], [0.0, 0.0, 1.0, 2.0]])
    x = common.repair_expert_counts(np.array([0, 0, 0, 1]), score, 2)
    assert np.bincount(x, minlength=2).tolist() == [2, 2]
    np.testing.assert_array_equal(x, [0, 0, 1, 1])  # the least attached expert (2) moves
    balanced = np.array([1, 0, 1, 0])
    np.testing.assert_array_equal(common.repair_expert_counts(balanced, score, 2), balanced)


def test_rebalance_keeps_the_priority_tokens() -> None:
    problem = random_problem(100, 8, 2, seed=3)
    x = np.arange(8) // 4
    gain = common.device_gains(problem, x)
    everyone_on_0 = np.zeros(problem.num_tokens, dtype=np.int64)
    t = common.rebalance_tokens(problem, everyone_on_0, gain, priority=problem.token_freq)
    loads = np.bincount(t, weights=problem.token_freq, minlength=2)
    assert loads.max() <= problem.capacity + problem.load_slack
    assert t[np.argmax(problem.token_freq)] == 0  # the top-priority token stayed


def test_rebalance_places_afresh_where_the_evicted_tokens_do_not_fit() -> None:
    from planner.solve.problem import LayerProblem

    # a token heavier than the cap (20 > 18.7) was stacked with kept tokens on a partly
    # filled device (loads 6 and 28), where it can fill a device alone (14 and 20)
    freq = np.array([20.0, 3, 3, 3, 3, 2])
    w = np.zeros((6, 4))
    w[0, 2:] = 20.0
    w[1:, :2] = freq[1:, None]
    problem = LayerProblem(w, freq, 2)
    gain = common.device_gains(problem, np.array([0, 0, 1, 1]))
    t = common.rebalance_tokens(problem, np.array([1, 1, 1, 0, 0, 0]), gain, priority=-freq)
    assert sorted(np.bincount(t, weights=freq, minlength=2).tolist()) == [14.0, 20.0]
    # beta 1: keeping each device's first tokens left 27 and 37 where 32 and 32 exist
    freq = np.array([15.0, 10, 10, 17, 12])
    problem = LayerProblem(np.ones((5, 2)), freq, 2, beta=1.0)
    gain = common.device_gains(problem, np.array([0, 1]))
    t = common.rebalance_tokens(problem, np.array([0, 0, 1, 1, 1]), gain, priority=freq)
    assert np.bincount(t, weights=freq, minlength=2).tolist() == [32.0, 32.0]


def test_device_gains_and_expert_scores_agree() -> None:
    problem = random_problem(50, 8, 4, seed=2)
    rng = np.random.default_rng(0)
    x = rng.permutation(np.arange(8) // 2)
    t = rng.integers(0, 4, problem.num_tokens)
    dense = problem.affinity.toarray()
    np.testing.assert_allclose(common.device_gains(problem, x), dense @ np.eye(4)[x])
    np.testing.assert_allclose(common.expert_scores(problem, t), np.eye(4)[t].T @ dense)
    local = common.device_gains(problem, x)[np.arange(50), t].sum()
    assert local == pytest.approx(common.expert_scores(problem, t)[x, np.arange(8)].sum())


def test_balanced_sampling_fills_every_device_exactly() -> None:
    rng = np.random.default_rng(0)
    prob = rng.dirichlet(np.ones(4), size=12)
    prob[:, 3] = 0.0  # no mass on a device must not break the balance
    labels = sample_balanced(rng, prob, 20, np.ones(12), 3.0)
    for row in labels:
        assert np.bincount(row, minlength=4).tolist() == [3, 3, 3, 3]


def test_improves_by_a_margin_relative_to_the_best_either_sign():
    """alternating kept a new best where obj > best * (1 + 1e-12): below a negative best
    (the penalty mode's objectives) that accepted a slightly worse placement; polish and
    the chain polish added an absolute 1e-12 that did not make up for it below -1."""
    assert common.improves(1.0, -np.inf) and common.improves(-5.0, -np.inf)
    for best in (-1000.0, -1.0, -0.5, 0.0, 0.5, 1000.0):
        assert not common.improves(best, best)
        slightly_worse = best - 1e-13 * max(1.0, abs(best))
        assert not common.improves(slightly_worse, best), best
        assert common.improves(best + 1e-9 * max(1.0, abs(best)), best), best
    # the old alternating rule took -1000.0000000001 over -1000
    assert -1000.0000000001 > -1000.0 * (1 + 1e-12)
    assert not common.improves(-1000.0000000001, -1000.0)

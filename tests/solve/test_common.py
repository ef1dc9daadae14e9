"""The shared pieces every solver uses: token assignment, expert repair, polish."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from scipy import sparse
from scipy.optimize import linprog

from planner.solve import common
from planner.solve.ceo import sample_balanced
from tests.solve.instances import random_problem


def lp_bound(gain: np.ndarray, freq: np.ndarray, capacity: float) -> float:
    """Optimum of the LP relaxation of the capacitated token assignment."""
    j, e = gain.shape
    a_eq = sparse.kron(sparse.eye(j), np.ones((1, e)))
    a_ub = sparse.kron(np.ones((1, j)), sparse.eye(e)).multiply(np.repeat(freq, e)[None, :])
    res = linprog(-gain.ravel(), A_ub=a_ub, b_ub=np.full(e, capacity), A_eq=a_eq, b_eq=np.ones(j),
                  bounds=(0, 1), method="highs")  # fmt: skip
    assert res.status == 0
    return -res.fun


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_assignment_is_near_the_lp_bound_and_within_capacity(seed: int) -> None:
    problem = random_problem(600, 16, 4, top_k=4, seed=seed, noise=0.3)
    x = np.random.default_rng(seed).permutation(np.arange(16) // 4)
    gain = common.device_gains(problem, x)
    t = common.assign_tokens(gain, problem.token_freq, problem.capacity).token_to_device
    value = gain[np.arange(t.size), t].sum()
    bound = lp_bound(gain, problem.token_freq, problem.capacity)
    assert value <= bound + 1e-6
    assert value >= 0.99 * bound
    loads = np.bincount(t, weights=problem.token_freq, minlength=4)
    assert loads.max() <= problem.capacity + 1e-9


def test_token_that_fits_nowhere_goes_to_the_emptiest_device() -> None:
    gain = np.array([[5.0, 0.0], [1.0, 0.0], [0.0, 1.0]])
    freq = np.array([10.0, 3.0, 3.0])
    t = common.assign_tokens(gain, freq, 6.0).token_to_device
    loads = np.bincount(t, weights=freq, minlength=2)
    # the heavy token exceeds the cap alone; the slack rule bounds every load
    assert loads.max() <= 6.0 + freq.max()
    assert sorted(loads.tolist()) in ([6.0, 10.0], [3.0, 13.0])


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


def test_polish_never_lowers_the_objective() -> None:
    problem = random_problem(300, 16, 4, top_k=4, seed=5, noise=0.2)
    rng = np.random.default_rng(1)
    for _ in range(3):
        x = rng.permutation(np.arange(16) // 4)
        t = common.assign_for_problem(problem, common.device_gains(problem, x)).token_to_device
        before = common.evaluate(problem, x, t).objective
        x2, t2, _ = common.polish(problem, x, t)
        assert np.bincount(x2, minlength=4).tolist() == [4] * 4
        assert common.evaluate(problem, x2, t2).objective >= before - 1e-9


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

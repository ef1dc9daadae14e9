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


def _token_major_prices(gain, freq, room, prices, sweeps, damping=0.5):
    """dual_prices as first written, token by token ([J, E]): the reference it must equal."""
    num_tokens, e = gain.shape
    price = np.asarray(prices, np.float64).copy()
    rows, devices = np.arange(num_tokens), np.arange(e)
    scale = float(np.max(gain / freq[:, None], initial=1.0))
    for _ in range(sweeps):
        adjusted = gain - freq[:, None] * price[None, :]
        first = adjusted.argmax(axis=1)
        best = adjusted[rows, first]
        adjusted[rows, first] = -np.inf
        second = adjusted.max(axis=1)
        other = np.where(first[:, None] == devices[None, :], second[:, None], best[:, None])
        threshold = (gain - other) / freq[:, None]
        tj, td = np.nonzero(threshold > 0)
        tv = threshold[tj, td]
        order = np.lexsort((-tv, td))
        td, tv, load = td[order], tv[order], freq[tj[order]]
        csum = np.cumsum(load)
        before = np.concatenate(([0.0], csum))[np.searchsorted(td, devices)]
        over = np.flatnonzero(csum - before[td] > room[td])
        new = np.zeros(e)
        if over.size:
            dev, first_over = np.unique(td[over], return_index=True)
            new[dev] = tv[over[first_over]]
        step = np.where(np.isfinite(room), new, 0.0) - price
        price = price + damping * step
        if np.abs(step).max() <= 1e-7 * scale:
            break
    return price


@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("e", [2, 3, 8, 32])
def test_dual_prices_equal_the_token_major_reference_bit_for_bit(e: int, ties: bool) -> None:
    # plans must not change with how the sweeps are laid out in memory
    rng = np.random.default_rng(e)
    for _ in range(5):
        j = int(rng.integers(1, 800))
        if ties:  # small integer gains: many rows with tied best devices
            gain = rng.integers(0, 3, size=(j, e)).astype(np.float64)
        else:
            gain = rng.random((j, e)) * rng.integers(1, 50, size=(j, 1))
        freq = rng.integers(1, 20, size=j).astype(np.float64)
        room = np.full(e, freq.sum() / e * rng.choice([0.6, 1.1]))
        prices = rng.random(e) * rng.choice([0.0, 1.0])
        got = common.dual_prices(gain, freq, room, prices=prices, sweeps=12)
        want = _token_major_prices(gain, freq, room, prices, sweeps=12)
        assert np.array_equal(got, want)


def test_best_two_is_argmax_max_and_runner_up() -> None:
    rng = np.random.default_rng(3)
    values = rng.integers(0, 4, size=(6, 500)).astype(np.float64)  # ties in most columns
    before = values.copy()
    first, best, second = common._best_two(values)
    assert np.array_equal(values, before)  # left as it was
    np.testing.assert_array_equal(first, values.argmax(axis=0))
    np.testing.assert_array_equal(best, values.max(axis=0))
    np.testing.assert_array_equal(second, np.sort(values, axis=0)[-2])

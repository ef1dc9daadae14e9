"""The fast paths of the solver kernels give the same results as the plain code, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest

from planner.solve import assign, common, polish
from tests.solve.instances import random_problem


def _values(rng: np.random.Generator, kind: int, m: int) -> np.ndarray:
    if kind == 0:  # few distinct values: long runs of ties
        return rng.integers(-3, 4, m).astype(np.float64)
    if kind == 1:  # ratios, as the dual prices' thresholds
        return rng.integers(1, 30, m) / rng.integers(1, 30, m)
    if kind == 2:  # values equal but for their last bits
        v = rng.integers(1, 5, m).astype(np.float64)
        return v + rng.integers(0, 3, m) * 1e-14 * v
    if kind == 3:  # zeros of both signs, infinities, denormals
        pool = [0.0, -0.0, np.inf, -np.inf, 1.0, -1.0, 5e-324, -5e-324, 1 + 1e-15]
        return rng.choice(pool, m)
    return rng.standard_normal(m)


@pytest.mark.parametrize("kind", range(5))
def test_descending_within_groups_is_lexsort(kind: int) -> None:
    rng = np.random.default_rng(kind)
    for _ in range(40):
        m, groups = int(rng.integers(0, 3000)), int(rng.integers(1, 40))
        group = rng.integers(0, groups, m)
        if rng.random() < 0.5:
            group = np.sort(group)  # as dual_prices' devices
        value = _values(rng, kind, m)
        want = np.lexsort((-value, group))
        assert np.array_equal(assign.descending_within_groups(group, value, groups), want)
        keyed = assign._keyed_order(group, value, groups)
        assert keyed is not None and np.array_equal(keyed, want)


def test_keyed_order_declines_nans() -> None:
    value = np.array([1.0, np.nan, 0.5])
    assert assign._keyed_order(np.zeros(3, dtype=np.int64), value, 1) is None
    order = assign.descending_within_groups(np.zeros(3, dtype=np.int64), value, 1)
    assert np.array_equal(order, np.lexsort((-value, np.zeros(3))))


@pytest.mark.parametrize("e", [2, 4, 8])
def test_swap_pairs_scored_together_equal_pair_by_pair(e: int) -> None:
    problem = random_problem(700, 32, e, top_k=4, seed=e, noise=0.3)
    rng = np.random.default_rng(e)
    for _ in range(3):
        x = rng.permutation(np.arange(32) // (32 // e))
        gain = common.device_gains(problem, x)
        prices = common.assign_for_problem(problem, gain).prices
        adjusted = gain - problem.token_freq[:, None] * prices[None, :]
        top = np.argsort(-adjusted, axis=1, kind="stable")[:, :3]
        top_values = np.take_along_axis(adjusted, top, axis=1)
        values = (adjusted, top, top_values, top_values[:, 0])
        pull = common.expert_scores(problem, adjusted.argmax(axis=1))
        members = [np.flatnonzero(x == d) for d in range(e)]
        pairs = [(p, q) for p in range(e) for q in range(p + 1, e)]
        m = min(problem.experts_per_device, 4)
        tried = polish._drawn_experts(members, pull, pairs, m)
        apart = polish._score_pairs(problem, values, pairs, tried, m, chunk=1 << 20)
        together = polish._score_pairs_together(problem, values, pairs, tried, m)
        for (rows_a, delta_a), (rows_t, delta_t) in zip(apart, together, strict=True):
            assert rows_a == rows_t
            if rows_a:
                assert delta_a.tobytes() == delta_t.tobytes()

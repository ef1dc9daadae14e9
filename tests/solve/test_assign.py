"""Token assignment within device capacities (planner.solve.assign)."""

from __future__ import annotations

import itertools
import warnings

import numpy as np
import pytest
from scipy import sparse
from scipy.optimize import linprog

from planner.solve import assign
from planner.solve.common import device_gains
from planner.solve.problem import SolverConfig
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
    gain = device_gains(problem, x)
    t = assign.assign_tokens(gain, problem.token_freq, problem.capacity).token_to_device
    value = gain[np.arange(t.size), t].sum()
    bound = lp_bound(gain, problem.token_freq, problem.capacity)
    assert value <= bound + 1e-6
    assert value >= 0.99 * bound
    loads = np.bincount(t, weights=problem.token_freq, minlength=4)
    assert loads.max() <= problem.capacity + 1e-9


def test_token_that_fits_nowhere_goes_to_the_emptiest_device() -> None:
    gain = np.array([[5.0, 0.0], [1.0, 0.0], [0.0, 1.0]])
    freq = np.array([10.0, 3.0, 3.0])
    t = assign.assign_tokens(gain, freq, 6.0).token_to_device
    loads = np.bincount(t, weights=freq, minlength=2)
    # the heavy token exceeds the cap alone; the slack rule bounds every load
    assert loads.max() <= 6.0 + freq.max()
    assert sorted(loads.tolist()) in ([6.0, 10.0], [3.0, 13.0])


@pytest.mark.parametrize("seed", range(4))
def test_tiny_assignment_the_cap_cannot_hold_is_optimal_with_the_heavy_token_alone(
    seed: int,
) -> None:
    # a token heavier than the cap: no assignment meets it, and the exact path then solves
    # the ILP's first fallback (that token fills a device alone, every other device within
    # the cap) to its optimum, not the greedy; no other device is let over the cap
    rng = np.random.default_rng(seed)
    gain = rng.integers(0, 6, (6, 3)).astype(float)
    freq = np.array([7.0, 2.0, 2.0, 1.0, 1.0, 1.0])
    cap = 1.1 * freq.sum() / 3  # 5.13 < 7
    t = assign.assign_tokens(gain, freq, cap).token_to_device
    rows = np.arange(6)

    def heavy_alone(c) -> bool:
        loads = np.bincount(c, weights=freq, minlength=3)
        return all(loads[d] <= cap or list(c).count(d) == 1 for d in range(3))

    best = max(
        gain[rows, np.array(c)].sum()
        for c in itertools.product(range(3), repeat=6)
        if heavy_alone(c)
    )
    assert gain[rows, t].sum() == best
    assert heavy_alone(t)


def test_tiny_assignment_falls_back_to_the_slack_rule_when_heavy_tokens_cannot_sit_alone() -> None:
    # three tokens heavier than the cap on two devices: one device must share, so the last
    # fallback (every device within cap + the heaviest token) applies
    gain = np.array([[3.0, 0.0], [0.0, 3.0], [1.0, 1.0], [2.0, 0.0]])
    freq = np.array([4.0, 4.0, 4.0, 1.0])
    cap = 1.1 * freq.sum() / 2  # 7.15: no two heavy tokens share a device within it
    t = assign.assign_tokens(gain, freq, cap).token_to_device
    loads = np.bincount(t, weights=freq, minlength=2)
    assert loads.max() <= cap + freq.max()
    assert t[0] == 0 and t[1] == 1


def test_heavy_fill_loads_clip_at_each_device_room_and_keep_full_devices_full() -> None:
    loads = assign.heavy_fill_loads(np.array([5.0, 1.0]), np.array([3.0, 0.0]))
    assert loads.tolist() == [[3.0, 5.0], [1.0, 1.0]]


def test_tokens_heavier_than_any_room_go_where_they_gain_most_among_the_emptiest() -> None:
    # At large EP the hottest tokens outweigh a device's capacity (a Zipf head at EP 256).
    # Each still takes a device with the most room, but of those the one holding its
    # experts, not the first by index: the result must not depend on the devices' labels.
    rng = np.random.default_rng(0)
    e, j = 16, 400
    freq = np.concatenate([[500.0, 400.0, 300.0], rng.integers(1, 4, j - 3).astype(float)])
    home = rng.integers(0, e, j)
    gain = np.where(np.arange(e)[None, :] == home[:, None], freq[:, None], 0.0)
    cap = 1.1 * freq.sum() / e  # about 110: the three hot tokens fit nowhere
    values = []
    for perm in (np.arange(e), rng.permutation(e), rng.permutation(e)):
        g = gain[:, perm]
        t = assign.assign_tokens(g, freq, cap).token_to_device
        assert [g[i, t[i]] for i in range(3)] == [500.0, 400.0, 300.0]  # each on its home
        values.append(g[np.arange(j), t].sum())
    assert values[0] == values[1] == values[2]


def test_light_tokens_that_fit_nowhere_take_the_emptiest_device_they_gain_most_on() -> None:
    # The regret greedy's overflow rule: heaviest first, each to a device with the most room
    # and, among devices level on room, to the one it gains most on (not the first by index).
    gain = np.array([[0.0, 1.0, 5.0, 2.0], [3.0, 0.0, 0.0, 9.0], [4.0, 0.0, 0.0, 1.0]])
    freq = np.array([2.0, 1.0, 3.0])
    for perm in (np.arange(4), np.array([2, 0, 3, 1])):
        room = np.array([1.0, 0.0, 1.0, 1.0])[perm]
        out = np.full(3, -1)
        assign._place_overflow(np.arange(3), gain[:, perm], freq, room, out, tol=1e-9)
        # token 2 (heaviest) takes device 0 of {0, 2, 3}; then token 0 takes 2 of {2, 3};
        # then token 1 takes 3, the only device left with the most room
        assert perm[out].tolist() == [2, 3, 0]
        assert np.allclose(room, np.array([-2.0, 0.0, -1.0, 0.0])[perm])


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
        got = assign.dual_prices(gain, freq, room, prices=prices, sweeps=12)
        want = _token_major_prices(gain, freq, room, prices, sweeps=12)
        assert np.array_equal(got, want)


def test_best_two_is_argmax_max_and_runner_up() -> None:
    rng = np.random.default_rng(3)
    values = rng.integers(0, 4, size=(6, 500)).astype(np.float64)  # ties in most columns
    before = values.copy()
    first, best, second = assign._best_two(values)
    assert np.array_equal(values, before)  # left as it was
    np.testing.assert_array_equal(first, values.argmax(axis=0))
    np.testing.assert_array_equal(best, values.max(axis=0))
    np.testing.assert_array_equal(second, np.sort(values, axis=0)[-2])


def test_one_device_over_its_capacity_takes_every_token() -> None:
    # Before: the one device's price ran to infinity (there is no second device to prefer),
    # then to NaN, and placing the heavy tokens failed with "max() arg is an empty sequence".
    rng = np.random.default_rng(1)
    gain = rng.integers(0, 4, (40, 1)).astype(float)
    freq = rng.integers(1, 20, 40).astype(float)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no inf - inf on the way
        result = assign.assign_tokens(gain, freq, 0.6 * freq.sum(), sweeps=30)
    assert (result.token_to_device == 0).all() and np.array_equal(result.prices, [0.0])


@pytest.mark.parametrize("scale", [1e-12, 1e-9, 2.0**-40])
def test_loads_and_gains_given_as_tiny_shares_stay_within_the_cap(scale: float) -> None:
    """Frequencies given as shares: an absolute tolerance of 1e-9 (and HiGHS's, on the exact
    path) let every token of 1e-9 fit anywhere, so a device took 3x its cap. Loads and gains
    below 1 are now scaled up by a power of two first: as good an assignment as the counts'."""
    for j in (40, 300):  # the exact 0-1 program and the greedy
        problem = random_problem(j, 16, 4, seed=5)
        gain = device_gains(problem, np.arange(16) // 4)
        freq, cap = problem.token_freq, problem.capacity
        counts = assign.assign_tokens(gain, freq, cap).token_to_device
        shares = assign.assign_tokens(gain * scale, freq * scale, cap * scale).token_to_device
        loads = np.bincount(shares, weights=freq, minlength=4)
        assert loads.max() <= cap * (1 + 1e-9)
        rows = np.arange(j)
        assert gain[rows, shares].sum() == pytest.approx(gain[rows, counts].sum(), rel=1e-3)


def test_small_layers_where_the_cap_cannot_be_met_keep_the_balance_the_greedy_reaches():
    """Tiny layers are assigned exactly; where no assignment met the cap (beta 1, a token of
    50 against a cap of 50.5) the exact path went straight to the slack rule (cap + the
    heaviest token) and let a device reach 86, and the baselines 80-99, where the greedy
    keeps every device within 52 at 98% of the locality. It now tries the greedy's load
    first, as the ILP does."""
    from planner.solve.registry import solve_layer

    p = random_problem(31, 8, 4, seed=2, beta=1.0)
    gain = device_gains(p, np.arange(8) // 2)
    exact = assign.assign_tokens(gain, p.token_freq, p.capacity, sweeps=10)
    greedy = assign.assign_tokens(gain, p.token_freq, p.capacity, sweeps=10, exact=False)

    def heaviest(t):
        return np.bincount(t, weights=p.token_freq, minlength=4).max()

    assert heaviest(exact.token_to_device) <= heaviest(greedy.token_to_device)
    for method in ("metis", "kmeans", "alternating"):
        assert heaviest(solve_layer(p, method, SolverConfig(seed=0)).token_to_device) < 60


# 8 tokens on 12 experts at EP 4 (a fuzz instance): beta 1.1 caps a device at 26.675 and no
# packing of these loads meets it (the best peak is 27)
PACKED_W = np.array([
    [9.94, 0.15, 1.79, 0.30, 0.44, 0.10, 0.71, 0.13, 0.45, 0.06, 2.44, 0.24],
    [3.02, 4.81, 0.00, 0.95, 7.22, 0.06, 0.10, 4.82, 7.95, 0.50, 1.05, 2.44],
    [0.39, 5.45, 5.46, 8.45, 1.10, 1.20, 7.61, 9.69, 6.61, 0.01, 0.07, 0.29],
    [0.00, 2.77, 1.48, 0.03, 3.68, 0.07, 5.55, 0.15, 0.19, 2.84, 8.98, 3.49],
    [2.54, 0.00, 6.63, 0.00, 3.17, 7.07, 0.47, 0.00, 3.35, 0.67, 5.12, 0.16],
    [0.00, 6.48, 0.04, 0.20, 4.12, 8.60, 7.91, 5.15, 4.68, 0.29, 0.41, 3.03],
    [1.20, 7.99, 1.59, 0.00, 0.00, 9.34, 0.43, 6.07, 1.26, 4.11, 0.72, 7.29],
    [4.64, 0.69, 0.43, 0.72, 0.11, 0.28, 3.67, 0.04, 0.00, 0.89, 2.07, 2.64],
])  # fmt: skip
PACKED_A = np.array([15.0, 9.0, 18.0, 6.0, 15.0, 3.0, 19.0, 12.0])


def test_the_greedy_that_overflows_by_packing_works_within_the_exact_paths_peak() -> None:
    """Where a few tokens fit nowhere by packing (none heavier than the cap), the exact path
    raises every device's cap to the least peak any assignment reaches (27 here); the
    greedy kept the other devices within the cap and scored this placement 110.95 against
    the exact path's 130.17 at the same peak, so CEO's search, which scores its samples with
    the greedy, passed it by."""
    from planner.solve.problem import LayerProblem

    p = LayerProblem(PACKED_W, PACKED_A, 4)
    x = np.array([0, 1, 2, 3, 2, 1, 0, 3, 3, 0, 2, 1])
    gain = device_gains(p, x)
    exact = assign.assign_tokens(gain, p.token_freq, p.capacity, sweeps=10).token_to_device
    greedy = assign.assign_tokens(
        gain, p.token_freq, p.capacity, sweeps=10, exact=False
    ).token_to_device

    def loads(t):
        return np.bincount(t, weights=p.token_freq, minlength=4)

    def value(t):
        return gain[np.arange(t.size), t].sum()

    assert loads(exact).max() == loads(greedy).max() == 27.0
    assert value(greedy) == pytest.approx(value(exact))


def test_a_token_heavier_than_the_cap_alone_does_not_raise_the_others_caps() -> None:
    # one token over the cap sits alone on its device (the heavy-fill rule): the greedy keeps
    # every other device within the cap, as the ILP's heavy-fill program does
    p = random_problem(400, 8, 4, top_k=2, seed=2, clusters=4, noise=0.1, zipf=1.5, max_freq=500)
    assert p.token_freq.max() > p.capacity
    gain = device_gains(p, np.arange(8) // 2)
    t = assign.assign_tokens(gain, p.token_freq, p.capacity, exact=False).token_to_device
    heavy = int(p.token_freq.argmax())
    loads = np.bincount(t, weights=p.token_freq, minlength=4)
    assert p.token_freq[t == t[heavy]].sum() == p.token_freq[heavy]
    assert np.delete(loads, t[heavy]).max() <= p.capacity * (1 + 1e-9)


@pytest.mark.parametrize("j", [40, 300])  # the exact 0-1 program and the greedy
def test_gains_in_other_units_than_the_loads_give_the_same_assignment(j: int) -> None:
    """Gains of 1e-8 against loads of 1-10 (affinities in other units than the frequencies):
    the exchanges' and moves' absolute tolerances took every gain for noise. Gains below 1
    are scaled up by their own power of two; the prices come back in the caller's units."""
    problem = random_problem(j, 16, 4, seed=5)
    gain = device_gains(problem, np.arange(16) // 4)
    freq, cap = problem.token_freq, problem.capacity
    counts = assign.assign_tokens(gain, freq, cap, exact=j < 100)
    scale = 2.0**-27  # about 7e-9, exact in binary
    small = assign.assign_tokens(gain * scale, freq, cap, exact=j < 100)
    rows = np.arange(j)
    value = gain[rows, small.token_to_device].sum()
    assert value == pytest.approx(gain[rows, counts.token_to_device].sum(), rel=1e-4)
    np.testing.assert_array_equal(small.prices, counts.prices * scale)
    again = assign.assign_tokens(gain * scale, freq, cap, prices=small.prices, exact=False)
    warm = assign.assign_tokens(gain, freq, cap, prices=counts.prices, exact=False)
    np.testing.assert_array_equal(again.token_to_device, warm.token_to_device)


def test_where_the_program_finds_nothing_below_the_slack_rule_the_greedy_is_kept(
    monkeypatch,
) -> None:
    # the program gives up within its node limit under every room but the slack rule's
    # (cap + the heaviest token): the greedy's own answer, within its peak, is kept rather
    # than the slack rule's program, which had let a device go from 29.5 to 42.2 (cap 29.2)
    from planner.solve.problem import LayerProblem

    p = LayerProblem(PACKED_W, PACKED_A, 4)
    gain = device_gains(p, np.array([0, 1, 2, 3, 2, 1, 0, 3, 3, 0, 2, 1]))
    exact_program = assign._assign_exact
    slack = p.capacity + PACKED_A.max()

    def only_at_the_slack_rule(gain, freq, room, heavy_fill=False):
        return exact_program(gain, freq, room, heavy_fill) if room.min() >= slack else None

    monkeypatch.setattr(assign, "_assign_exact", only_at_the_slack_rule)
    t = assign.assign_tokens(gain, p.token_freq, p.capacity, sweeps=10).token_to_device
    greedy = assign.assign_tokens(
        gain, p.token_freq, p.capacity, sweeps=10, exact=False
    ).token_to_device
    np.testing.assert_array_equal(t, greedy)
    assert np.bincount(t, weights=PACKED_A, minlength=4).max() == 27.0


def test_an_overflow_is_relieved_only_where_every_device_comes_within_the_cap() -> None:
    a = np.array([6.0, 6.0, 7.0, 4.0, 5.0, 3.0])
    start = np.array([0, 0, 1, 1, 2, 2])
    gain = np.zeros((6, 3))
    gain[np.arange(6), start] = 1.0
    # loads 12, 11, 8 at a cap of 11: device 0's 6 traded for device 2's 5
    t = start.copy()
    assert assign._relieve_overflow(gain, a, np.full(3, 11.0), t, np.arange(6), 1e-9, None)
    assert np.bincount(t, weights=a, minlength=3).max() <= 11.0
    assert (t[2:4] == 1).all() and gain[np.arange(6), t].sum() == 4.0
    # at a cap of 10 (31 in all) no plan meets it: the plan stays as it was, since chasing
    # a lower peak under the slack rule had cost 35% of a layer's local activations
    t = start.copy()
    assert not assign._relieve_overflow(gain, a, np.full(3, 10.0), t, np.arange(6), 1e-9, None)
    assert (t == start).all()


def test_the_greedy_moves_tokens_that_fit_nowhere_back_within_the_cap() -> None:
    # 60 tokens at beta 1 on 8 devices (cap 88): the greedy's tokens that fit nowhere had
    # taken a device to 91; moved and traded back, every device within 88
    p = random_problem(60, 16, 8, top_k=4, seed=1, zipf=0.5, beta=1.0)
    gain = device_gains(p, np.arange(16) // 2)
    t = assign.assign_tokens(gain, p.token_freq, p.capacity).token_to_device
    assert np.bincount(t, weights=p.token_freq, minlength=8).max() <= p.capacity


def test_a_few_tokens_a_device_over_the_cap_take_the_exact_programs_assignment() -> None:
    # 100 tokens at beta 1.1 on 32 devices: the greedy (and its relief) left a device at
    # 1.026 of the cap, token imbalance 1.13, with 1861 local activations; the program
    # finds a plan within the cap with 1954
    p = random_problem(100, 64, 32, top_k=4, seed=39, zipf=0.3, beta=1.1)
    gain = device_gains(p, np.arange(64) // 2)
    a = p.token_freq
    greedy = assign.assign_tokens(gain, a, p.capacity).token_to_device
    assert np.bincount(greedy, weights=a, minlength=32).max() > p.capacity
    t = assign.within_cap(gain, a, p.capacity, greedy)
    assert np.bincount(t, weights=a, minlength=32).max() <= p.capacity
    assert gain[np.arange(100), t].sum() > gain[np.arange(100), greedy].sum()
    # within the cap already, or few enough tokens for the exact path: left as it is
    fitted = assign.within_cap(gain, a, 2 * p.capacity, greedy)
    assert fitted is greedy

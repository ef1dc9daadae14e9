"""CEO's enumeration of every balanced expert placement where they are few (planner/solve/ceo.py)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from scipy import sparse

from planner.solve import ceo
from planner.solve.common import assign_for_problem, canonical_labels, device_gains, objective
from planner.solve.expert_balance import ExpertLimit
from planner.solve.problem import LayerProblem, SolverConfig
from planner.solve.registry import solve_layer
from tests.solve.instances import random_problem


@pytest.mark.parametrize("n,e", [(4, 2), (6, 3), (8, 2), (8, 4), (9, 3), (16, 2)])
def test_every_balanced_placement_once(n: int, e: int) -> None:
    placements = ceo.balanced_placements(n, e)
    assert placements.shape == (ceo.placement_count(n, e), n)
    assert (np.stack([np.bincount(x, minlength=e) for x in placements]) == n // e).all()
    canonical = {canonical_labels(x, e).tobytes() for x in placements}
    assert len(canonical) == len(placements)  # no partition twice
    # each row is already its partition's canonical labelling
    assert all((canonical_labels(x, e) == x).all() for x in placements)
    if e**n <= 20_000:  # and no partition left out: every labelling, brute force
        every = {
            canonical_labels(np.array(x), e).tobytes()
            for x in itertools.product(range(e), repeat=n)
            if (np.bincount(x, minlength=e) == n // e).all()
        }
        assert every == canonical


def test_placement_counts() -> None:
    assert ceo.placement_count(16, 2) == 6435
    assert ceo.placement_count(8, 4) == 105
    assert ceo.placement_count(8, 8) == 1
    assert ceo.placement_count(64, 2) > 10**17


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_two_device_bound_bounds_the_assignment_and_is_tight(seed: int) -> None:
    # heavy head, light tail; one token heavier than the others by far
    problem = random_problem(120, 8, 2, top_k=2, seed=seed, clusters=2, noise=0.3)
    # and six load-free rows (n-gram contexts), which go to their better device
    problem = problem.with_load_free_rows(sparse.csr_matrix(problem.affinity[:6] * 0.5), np.ones(6))
    placements = ceo.balanced_placements(8, 2)
    bound = ceo.two_device_bound(problem, placements)
    for x, b in zip(placements, bound, strict=True):
        gain = device_gains(problem, x)
        best = objective(problem, gain, assign_for_problem(problem, gain).token_to_device)
        # the fractional optimum: at or above the whole tokens' best, by one split token
        assert b >= best - 1e-9
        assert b - best <= np.abs(gain[:, 0] - gain[:, 1]).max() + 1e-9


def test_the_bound_knows_both_caps() -> None:
    # every token prefers device 0: the cap on device 1 is never reached, the one on 0 is
    problem = random_problem(60, 4, 2, top_k=1, seed=3)
    x = np.array([0, 0, 1, 1])
    w = problem.affinity.toarray()
    w[:, 2:] = 0.0
    w[:, 0] += 1.0
    skewed = LayerProblem(sparse.csr_matrix(w), problem.token_freq, 2)
    bound = ceo.two_device_bound(skewed, x[None, :])[0]
    gain = device_gains(skewed, x)
    assert bound < gain[:, 0].sum()  # not every token may go to device 0
    assert bound >= objective(skewed, gain, assign_for_problem(skewed, gain).token_to_device)


@pytest.mark.parametrize("n,e,tokens", [(8, 2, 300), (8, 4, 300), (16, 2, 120)])
def test_ceo_reaches_the_best_placement_where_it_enumerates(n: int, e: int, tokens: int) -> None:
    problem = random_problem(tokens, n, e, top_k=2, seed=5, noise=0.4)
    placement = solve_layer(problem, "ceo", SolverConfig(seed=0))
    assert placement.info["enumerated"] and not placement.info["search_cut_by_budget"]
    best = -np.inf  # every placement with the shared assignment (its quick form: 6435 of them)
    for x in ceo.balanced_placements(n, e):
        gain = device_gains(problem, x)
        t = assign_for_problem(problem, gain, exact=False).token_to_device
        best = max(best, objective(problem, gain, t))
    assert placement.objective >= best - 1e-9


def test_what_is_enumerated() -> None:
    # few placements: any device count and balance rule
    assert ceo.enumerable(random_problem(50, 8, 4, seed=0), 1.0)
    assert ceo.enumerable(random_problem(50, 8, 4, seed=0, balance="penalty"), None)
    # more on two devices: under the token cap, and only where the bounds fit the budget
    sixteen = random_problem(50, 16, 2, seed=0)
    assert ceo.enumerable(sixteen, None) and ceo.enumerable(sixteen, 3e6)
    assert not ceo.enumerable(sixteen, 1e5)
    assert not ceo.enumerable(random_problem(50, 16, 2, seed=0, balance="penalty"), None)
    # never a search space beyond the screen, nor more devices with many placements
    assert not ceo.enumerable(random_problem(50, 64, 2, seed=0), None)
    assert not ceo.enumerable(random_problem(50, 16, 4, seed=0), None)


def test_enumeration_is_an_option_and_keeps_to_the_expert_cap() -> None:
    problem = random_problem(300, 16, 2, top_k=2, seed=6, zipf=1.4)
    searched = solve_layer(
        problem, "ceo", SolverConfig(seed=0, options={"ceo": {"enumerate": False}})
    )
    assert not searched.info["enumerated"] and searched.info["iterations"] > 0
    capped = solve_layer(problem, "ceo", SolverConfig(seed=0, expert_beta=1.05))
    assert capped.info["enumerated"]
    limit = ExpertLimit.of(problem, 1.05)
    assert limit is not None and limit.allows(capped.expert_to_device)

"""The token assignment priced per fitting batch (planner.solve.batch_prices)."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import sparse

from planner.errors import InputError
from planner.solve.batch_prices import batch_priced, batch_priced_tokens
from planner.solve.common import assign_for_problem, batch_overflow, device_gains, net_objective
from planner.solve.problem import LayerProblem, SolverConfig
from planner.solve.registry import SOLVERS, solve_layer
from tests.solve.instances import random_problem


def one_domain_a_batch(seed: int, batches: int = 4) -> LayerProblem:
    """Four token clusters, each using its own four experts most; a fitting batch holds one
    cluster's tokens (as a trace profiled one prompt domain at a time)."""
    base = random_problem(400, 16, 4, top_k=4, seed=seed, clusters=4, noise=0.3)
    j = np.arange(base.num_tokens)
    batch_freq = sparse.csr_matrix((base.token_freq, (j, j % batches)), shape=(j.size, batches))
    return base.with_options(batch_freq=batch_freq)


def device_loads(problem: LayerProblem, t: np.ndarray) -> np.ndarray:
    return np.bincount(t, weights=problem.token_freq, minlength=problem.ep_size)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_less_is_taken_back_and_the_total_cap_holds(seed: int) -> None:
    problem = one_domain_a_batch(seed)
    x = np.arange(16) // 4  # each cluster's experts on one device: every batch wants one
    gain = device_gains(problem, x)
    shared = assign_for_problem(problem, gain).token_to_device
    priced = batch_priced_tokens(problem, gain, shared)
    lost, lost_priced = batch_overflow(problem, gain, shared), batch_overflow(problem, gain, priced)
    assert lost > 0.3 * problem.total_activations
    assert lost_priced < 0.5 * lost
    # what the runtime keeps rises by far more than the plain objective falls
    before, after = net_objective(problem, gain, shared), net_objective(problem, gain, priced)
    assert after > 1.1 * before
    slack = problem.token_freq.max()  # the shared assignment's slack rule
    assert device_loads(problem, priced).max() <= problem.capacity + slack
    # deterministic, and the default start is the shared assignment
    np.testing.assert_array_equal(batch_priced_tokens(problem, gain), priced)


def test_never_worse_than_the_assignment_it_starts_from() -> None:
    problem = one_domain_a_batch(3)
    rng = np.random.default_rng(3)
    for _ in range(3):
        x = rng.permutation(np.arange(16) // 4)
        gain = device_gains(problem, x)
        t = assign_for_problem(problem, gain).token_to_device
        for rounds in (0, 1, 30):
            priced = batch_priced_tokens(problem, gain, t, rounds=rounds)
            assert net_objective(problem, gain, priced) >= net_objective(problem, gain, t)
        np.testing.assert_array_equal(batch_priced_tokens(problem, gain, t, rounds=0), t)


def test_nothing_to_take_back_changes_nothing() -> None:
    base = random_problem(200, 8, 2, top_k=2, seed=5)
    gain = device_gains(base, np.arange(8) // 4)
    t = assign_for_problem(base, gain).token_to_device
    np.testing.assert_array_equal(batch_priced_tokens(base, gain, t), t)  # no batches
    # one batch: the plan's own cap is the batch's, so no batch is over it
    one = base.with_options(batch_freq=sparse.csr_matrix(base.token_freq[:, None]))
    np.testing.assert_array_equal(batch_priced_tokens(one, gain, t), t)
    # penalty mode has no cap to take back from
    penalty = one_domain_a_batch(0).with_options(balance="penalty")
    gain = device_gains(penalty, np.arange(16) // 4)
    t = assign_for_problem(penalty, gain).token_to_device
    np.testing.assert_array_equal(batch_priced_tokens(penalty, gain, t), t)
    placement = SOLVERS["kmeans"](base, SolverConfig(seed=0))
    assert batch_priced(base, placement) is placement


@pytest.mark.parametrize("method", ["ceo", "metis", "kmeans", "alternating", "ilp"])
def test_every_method_ends_with_it_and_keeps_its_placement(method: str) -> None:
    problem = one_domain_a_batch(1)
    options = {"ceo": {"effort": 3e5}, "ilp": {"max_variables": 2000}}
    on = solve_layer(
        problem, method, SolverConfig(seed=0, time_limit=20, options=options, batch_prices=True)
    )
    off = solve_layer(problem, method, SolverConfig(seed=0, time_limit=20, options=options))
    if method != "ilp":  # (the ILP stops at its time limit: its placement may differ)
        np.testing.assert_array_equal(on.expert_to_device, off.expert_to_device)
    gain = device_gains(problem, on.expert_to_device)
    assert net_objective(problem, gain, on.token_to_device) >= net_objective(
        problem, gain, batch_priced_tokens(problem, gain, off.token_to_device, rounds=0)
    )
    if not np.array_equal(on.token_to_device, off.token_to_device):
        assert on.info["batch_priced"] is True
    assert "batch_priced" not in off.info


def test_vanilla_stays_the_default_deployment() -> None:
    problem = one_domain_a_batch(0)
    on = solve_layer(problem, "vanilla", SolverConfig(seed=0, batch_prices=True))
    off = solve_layer(problem, "vanilla", SolverConfig(seed=0))
    np.testing.assert_array_equal(on.token_to_device, off.token_to_device)


def test_the_switch_is_a_bool() -> None:
    with pytest.raises(InputError, match="batch_prices"):
        SolverConfig(batch_prices=1)
    assert SolverConfig().to_json()["batch_prices"] is False  # off unless asked for
    assert SolverConfig(batch_prices=True).to_json()["batch_prices"] is True

"""What the runtime's per-batch cap takes back, and CEO placing experts for it."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from scipy import sparse

from planner.errors import InputError
from planner.solve.common import batch_overflow, device_gains, token_confidence
from planner.solve.problem import LayerProblem, SolverConfig
from planner.solve.registry import get_solver
from tests.solve.instances import random_problem


def overflow_by_hand(problem: LayerProblem, gain: np.ndarray, t: np.ndarray) -> float:
    """The same quantity, one (batch, device) at a time, most confident token first."""
    e, act, freq = problem.ep_size, problem.token_activations, problem.occurrences
    conf = token_confidence(problem, gain, t)
    b = problem.batch_freq.toarray()
    lost = 0.0
    for g in range(b.shape[1]):
        cap = problem.beta * b[:, g].sum() / e
        for d in range(e):
            kept = 0.0
            for j in sorted(np.flatnonzero((t == d) & (b[:, g] > 0)), key=lambda j: -conf[j]):
                evicted = min(b[j, g], max(kept + b[j, g] - cap, 0.0))
                kept += b[j, g]
                own = gain[j, d]
                lost += evicted * max((own - (act[j] - own) / (e - 1)) / freq[j], 0.0)
    return lost


@pytest.mark.parametrize("seed", [0, 1])
def test_matches_a_per_batch_reference(seed: int) -> None:
    base = random_problem(300, 16, 4, top_k=4, seed=seed, noise=0.3)
    rng = np.random.default_rng(seed)
    # 5 batches, each token's occurrences spread over a few of them
    share = rng.dirichlet(np.full(5, 0.3), base.num_tokens)
    batch_freq = sparse.csr_matrix(np.round(share * base.token_freq[:, None]))
    problem = base.with_options(batch_freq=batch_freq)
    x = rng.permutation(np.arange(16) // 4)
    gain = device_gains(problem, x)
    t = rng.integers(0, 4, base.num_tokens)
    assert batch_overflow(problem, gain, t) == pytest.approx(overflow_by_hand(problem, gain, t))
    # rows selected together with their batches; none without batches or without a cap
    sub = problem.select_tokens(np.arange(0, 300, 2))
    assert sub.batch_freq.shape == (150, 5)
    assert batch_overflow(base, gain, t) == 0.0
    assert batch_overflow(problem.with_options(balance="penalty"), gain, t) == 0.0


def test_load_free_rows_that_stand_for_occurrences_are_charged() -> None:
    # n-gram context rows: no load on the capacity, but occurrences the runtime cap sees
    base = random_problem(200, 8, 2, top_k=2, seed=4)
    rng = np.random.default_rng(4)
    rows = rng.gamma(0.5, 1.0, (6, 8))
    rows[:, 4:] = 0.0  # all six prefer device 0
    rows *= 2.0 * base.total_freq / rows.sum()  # standing for as many occurrences as the tokens
    occ = rows.sum(axis=1) / 2.0  # top-2: two activations per occurrence
    share = rng.dirichlet(np.ones(3), base.num_tokens)
    token_batches = np.round(share * base.token_freq[:, None])
    sizes = token_batches.sum(axis=0) / base.total_freq
    w = sparse.vstack([base.affinity, sparse.csr_matrix(rows)])
    freq = np.concatenate([base.token_freq, np.zeros(6)])
    charged = LayerProblem(
        w, freq, 2, row_occurrences=np.concatenate([base.token_freq, occ]),
        batch_freq=sparse.csr_matrix(np.vstack([0.5 * token_batches, 0.5 * np.outer(occ, sizes)])),
    )  # fmt: skip
    assert charged.capacity == pytest.approx(base.capacity)
    x = np.arange(8) // 4
    gain = device_gains(charged, x)
    t = gain.argmax(axis=1)  # every row on its best device (as the n-gram table sends them)
    lost = batch_overflow(charged, gain, t)
    assert lost > 0.05 * base.total_activations
    assert lost == pytest.approx(overflow_by_hand(charged, gain, t))
    # the same rows without occurrences cost nothing when evicted
    free = charged.with_options(row_occurrences=None)
    assert batch_overflow(free, gain, t) < lost
    with pytest.raises(InputError, match="row_occurrences"):
        charged.with_options(row_occurrences=np.ones(3))


def test_one_batch_within_the_cap_loses_nothing() -> None:
    problem = random_problem(200, 8, 2, top_k=2, seed=3)
    problem = problem.with_options(batch_freq=sparse.csr_matrix(problem.token_freq[:, None]))
    x = np.arange(8) // 4
    gain = device_gains(problem, x)
    t = get_solver("kmeans")(problem, SolverConfig(seed=0)).token_to_device
    assert batch_overflow(problem, gain, t) == 0.0  # the plan's own cap is this batch's cap


def test_a_beta_so_large_the_batch_caps_overflow_loses_nothing_quietly() -> None:
    """beta = 1e308 (``moeplan solve --beta 1e308``): the batch caps overflow to infinity,
    which is no cap, but numpy printed an overflow warning on stderr."""
    problem = random_problem(200, 8, 2, top_k=2, seed=3, beta=1e308)
    problem = problem.with_options(batch_freq=sparse.csr_matrix(problem.token_freq[:, None]))
    gain = device_gains(problem, np.arange(8) // 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert batch_overflow(problem, gain, np.zeros(200, dtype=np.int64)) == 0.0


def two_domain_problem(batch_freq: bool) -> LayerProblem:
    """Domain A's tokens use experts 0 and 1, domain B's 2 and 3; a batch is one domain.

    Keeping each domain's experts together is slightly more local (the small second-expert
    weight), but then every batch's tokens all want one device.
    """
    rows = []
    for first, second in ((0, 1), (1, 0), (2, 3), (3, 2)):
        for _ in range(20):
            w = np.zeros(4)
            w[first], w[second] = 1.0, 0.2
            rows.append(w)
    w = np.array(rows) * 10
    freq = np.full(80, 10.0)
    domain = np.repeat([0, 0, 1, 1], 20)
    batches = sparse.csr_matrix((freq, (np.arange(80), domain)), shape=(80, 2))
    return LayerProblem(w, freq, 2, batch_freq=batches if batch_freq else None)


def test_ceo_spreads_each_batchs_experts_when_batch_aware() -> None:
    problem = two_domain_problem(batch_freq=True)
    aware = get_solver("ceo")(problem, SolverConfig(seed=0, options={"ceo": {"effort": 2e6}}))
    x = aware.expert_to_device
    assert x[0] != x[1] and x[2] != x[3]  # every batch can use both devices
    assert aware.info["batch_overflow"] == pytest.approx(0.0)
    blind = get_solver("ceo")(
        problem, SolverConfig(seed=0, options={"ceo": {"effort": 2e6, "batch_aware": False}})
    )
    y = blind.expert_to_device
    assert y[0] == y[1] and y[2] == y[3]  # the plain objective keeps domains together
    assert blind.objective > aware.objective
    gain = device_gains(problem, y)
    assert batch_overflow(problem, gain, blind.token_to_device) > 0.2 * problem.total_activations


@pytest.mark.parametrize("method", ["metis", "kmeans", "alternating"])
def test_baselines_choose_among_their_candidates_as_ceo_does(method, monkeypatch) -> None:
    """METIS' partitions, k-means' clusterings and alternating's iterations were chosen by
    the plain objective, while CEO chose net of what the batch cap takes back (the balanced
    LAR plans are judged by): the baselines now choose the same way."""
    import importlib

    from planner.solve.common import net_objective

    module = importlib.import_module(f"planner.solve.{method}")
    problem = two_domain_problem(batch_freq=True)
    seen: list[tuple[float, np.ndarray]] = []

    def recording(p, gain, t, effort=None):
        value = net_objective(p, gain, t, effort)
        seen.append((value, np.asarray(t).copy()))
        return value

    monkeypatch.setattr(module, "net_objective", recording)
    options = {"kmeans": {"n_init": 8, "evaluate": 8}, "metis": {"ncuts": 3}}
    result = get_solver(method)(problem, SolverConfig(seed=0, options=options))
    assert seen, f"{method} chose without net_objective"
    best = max(v for v, _ in seen)
    gain = device_gains(problem, result.expert_to_device)
    assert net_objective(problem, gain, result.token_to_device) >= best - 1e-9


def test_ceo_screens_the_kmeans_clusterings_beside_its_search() -> None:
    """CEO screens the k-means baseline's clusterings (same defaults and seed) with its own
    candidates, so a start its search did not reach still competes; with clusterings 0
    it screens only its own."""
    from planner.solve.common import net_objective

    problem = random_problem(400, 32, 4, top_k=4, seed=1, noise=0.3)
    small = {"effort": 2e5}  # a short search
    with_k = get_solver("ceo")(problem, SolverConfig(seed=0, options={"ceo": small}))
    without = get_solver("ceo")(
        problem, SolverConfig(seed=0, options={"ceo": small | {"clusterings": 0}})
    )
    km = get_solver("kmeans")(problem, SolverConfig(seed=0))
    assert with_k.info["clusterings_screened"] == 3 and without.info["clusterings_screened"] == 0

    def net(p):
        return net_objective(problem, device_gains(problem, p.expert_to_device), p.token_to_device)

    assert net(with_k) >= max(net(without), net(km)) - 1e-6

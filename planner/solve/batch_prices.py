"""The token assignment priced per fitting batch: less for the runtime's cap to take back.

The runtime caps every batch: a device keeps at most ``beta * B / E`` of a batch's B tokens,
the most confident first, and sends the rest elsewhere (DESIGN.md's balanced LAR;
:func:`planner.solve.common.batch_overflow` counts what that costs on the fitting batches).
The shared assignment (:func:`planner.solve.common.assign_for_problem`) balances each
device's load over the whole fitting trace only. Where batches are not a random mix of
requests (one prompt domain at a time, as in the example model's trace), a token table
balanced in total still crowds one device within a batch, and the cap then takes back a
large share of what was local on paper: 0.4-13% of a layer's local activations on the
example's fitting batches under CEO's plan at EP 4.

:func:`batch_priced_tokens` relaxes the per-batch caps into prices (a Lagrangian
relaxation, solved by subgradient steps). ``mu [G, E] >= 0`` is a price per batch g and
device d and occurrence; a token j on device d is charged ``sum_g occ[j, g] * mu[g, d]``
(load-free rows, the n-gram term's contexts, are not: they go where the n-gram table sends
them, and only fill the batches),
and the shared assignment (total cap, warm-started device prices) is solved again with
the charged gains. After each round the prices move towards the loads,

    mu[g, d] <- max(0, mu[g, d] + step * unit * (load[g, d] / cap[g] - 1)),

``unit`` being the mean activations an occurrence carries, so that ``step`` is a share of
what one evicted occurrence can lose. Of the ``rounds`` assignments (the unpriced one
first), the one with the best objective net of the take-back
(:func:`planner.solve.common.net_objective`, with the true gains) is kept: on the fitting
batches it is never worse than the shared assignment.

With ``SolverConfig.batch_prices`` (``moeplan solve|compare --batch-prices``; off by
default) every method but ``vanilla`` ends with it
(:func:`planner.solve.registry.solve_layer`), so it changes no method's placement and the
comparison stays one of placements. It plans the token table for the batches the fitting
trace was served in, and pays only where the served batches are made up alike. On the
example model held out by request (``benchmarks/compare_traces.py --sources example
--batch-prices --mixed-heldout``, 18 cases; ``benchmarks/RESULTS.md``, session 56) every
method's balanced LAR rose by 1.8-2.4% on average with the held-out requests served in
trace order, one prompt domain after another as they were profiled, and fell by 2.7-3.7%
with the same requests served in a random order (batches mixing the domains), as real
serving mostly does. Hence off by default: use it where traffic will arrive as it was
profiled (an offline job running a dataset in order, say). ``step`` 0.1 and 30 rounds were
chosen on the example's fitting side at EP 4 (0.05-0.5 and 20-60 rounds were within 0.3% of
each other); the subgradient has not converged by then, and need not: the best iterate is
kept.
"""

from __future__ import annotations

import time

import numpy as np
from scipy import sparse

from planner.solve.assign import assign_tokens
from planner.solve.common import assign_for_problem, device_gains, finish, improves, net_objective
from planner.solve.effort import Effort, charge
from planner.solve.problem import LayerPlacement, LayerProblem

ROUNDS = 30  # priced assignments after the unpriced one
STEP = 0.1  # subgradient step, in units of one occurrence's mean activations
SWEEPS = 10  # dual-price sweeps of each priced assignment (warm-started)


def batch_priced_tokens(
    problem: LayerProblem,
    gain: np.ndarray,
    token_to_device: np.ndarray | None = None,
    *,
    rounds: int = ROUNDS,
    step: float = STEP,
    effort: Effort | None = None,
) -> np.ndarray:
    """[J] token -> device, the shared assignment priced per fitting batch (module doc).

    Args:
        problem: the layer; its fitting batches (``problem.batch_freq``) set the prices.
        gain: [J, E] device gains of the placement (:func:`~planner.solve.common.device_gains`).
        token_to_device: [J] the assignment to improve on (default: the shared one for
            ``gain``); it is returned unchanged where nothing beats it.
        rounds: priced assignments tried.
        step: subgradient step (module doc).
        effort: a work meter to charge (:mod:`planner.solve.effort`).

    Without batches, in penalty mode (no cap), on one device, or where no batch exceeds its
    cap, the assignment is returned as it is: there is nothing to take back.
    """
    if token_to_device is None:
        token_to_device = assign_for_problem(problem, gain, effort=effort).token_to_device
    t = np.asarray(token_to_device, dtype=np.int64)
    entries, e = problem.batch_entries, problem.ep_size
    if entries is None or entries[0].size == 0 or problem.balance != "cap" or e == 1:
        return t
    rows, batch, occ, cap = entries
    g = cap.size

    def batch_loads(t: np.ndarray) -> np.ndarray:  # [G, E] occurrences of each batch on each device
        return np.bincount(batch * e + t[rows], weights=occ, minlength=g * e).reshape(g, e)

    load = batch_loads(t)
    if not np.any(load > cap[:, None] * (1 + 1e-12)):
        return t
    best_t, best = t, net_objective(problem, gain, t, effort)
    # Only token rows are charged: a load-free row (an n-gram context,
    # :mod:`planner.solve.ngram_term`) goes where the n-gram table will send it, its best
    # device, whatever the prices; its occurrences still fill the batches it is in.
    charged = problem.token_freq[rows] > 0
    occurrences = sparse.csr_matrix(
        (occ[charged], (rows[charged], batch[charged])), shape=(problem.num_tokens, g)
    )
    total = float(problem.occurrences.sum())
    unit = float(problem.token_activations.sum()) / total if total > 0 else 0.0
    with np.errstate(divide="ignore", invalid="ignore"):
        inv_cap = np.where(cap > 0, 1.0 / cap, 0.0)[:, None]
    mu = np.zeros((g, e))
    prices = None
    for _ in range(rounds):
        mu = np.maximum(0.0, mu + step * unit * (load * inv_cap - 1.0))
        charge(effort, "batch_prices", entries=occ.size * e + gain.size)
        priced = gain - occurrences @ mu
        result = assign_tokens(
            priced, problem.token_freq, problem.capacity, prices=prices, sweeps=SWEEPS,
            exact=False, effort=effort,
        )  # fmt: skip
        t, prices = result.token_to_device, result.prices
        score = net_objective(problem, gain, t, effort)
        if improves(score, best):
            best_t, best = t, score
        load = batch_loads(t)
    return best_t


def batch_priced(problem: LayerProblem, placement: LayerPlacement) -> LayerPlacement:
    """``placement`` with its tokens re-assigned by :func:`batch_priced_tokens`
    (``info["batch_priced"]``); the same object where that changes nothing."""
    gain = device_gains(problem, placement.expert_to_device)
    t = batch_priced_tokens(problem, gain, placement.token_to_device)
    if np.array_equal(t, placement.token_to_device):
        return placement
    return finish(
        problem, placement.method, placement.expert_to_device, seed=placement.seed,
        started=time.perf_counter() - placement.seconds, token_to_device=t,
        info=placement.info | {"batch_priced": True},
    )  # fmt: skip

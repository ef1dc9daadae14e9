"""Sem-MoE's model-data co-scheduling solver (paper 001 §3.3, App. B Algorithm 1).

Alternating optimisation between expert placement (tokens fixed) and token placement
(experts fixed), as the paper describes it:

1. Initial token clusters from the tokens' affinity to experts: a balanced spherical
   k-means of the tokens' routing distributions (:func:`cluster_tokens`).
2. Expert step, tokens fixed. Experts are visited hottest first (by routed activations).
   An expert's score for device d aggregates its affinity to the tokens on d (activations
   it receives from them, ``M[d, k]``) with weight ``w_token`` and its affinity to the
   experts already on d (co-activation, ``C[k, l] = sum_j W[j,k] W[j,l] / act_j``) with
   weight ``w_expert``; the score is divided by ``1 + load_penalty x (device expert load /
   mean)``, so hot experts spread out; saturated devices (N/E experts) are masked. Then
   refinement trials: pick two devices at random and swap the pair of their experts that
   raises the aggregated affinity score most, if one does; until no swap between any two
   devices helps, or ``swap_rounds`` trials. (The paper swaps "if it improves the affinity
   score" and gives no count; searching each chosen pair of devices whole ends the
   baseline at a swap-local optimum of its own score.)
3. Token step, experts fixed. A token's score for device d aggregates its token-expert
   affinity (activations local on d) with its token-token affinity (similarity of its
   expert profile to the activation profile of the tokens currently on d, weight
   ``w_token_token``); tokens are placed on these scores by the shared capacity assignment,
   which is what keeps the token load balanced.
4. Repeat; the best placement by the objective net of what the runtime's per-batch cap
   takes back (:func:`planner.solve.common.net_objective`, as every method chooses) is
   kept. The final tokens come from the shared assignment on the true gains
   (:func:`planner.solve.common.finish`).
"""

from __future__ import annotations

import time

import numpy as np
from scipy import sparse

from planner.solve.assign import assign_tokens
from planner.solve.common import (
    assign_for_problem,
    check_options,
    device_gains,
    expert_scores,
    finish,
    improves,
    net_objective,
    place_experts,
)
from planner.solve.problem import LayerPlacement, LayerProblem, SolverConfig

DEFAULTS: dict[str, object] = {
    "iterations": 10,
    "w_token": 1.0,  # expert-token affinity weight
    "w_expert": 0.5,  # expert-expert (co-activation) affinity weight
    "w_token_token": 0.25,  # token-token affinity weight in the token step
    "load_penalty": 0.5,  # expert-load adjustment of the expert scores
    "swap_rounds": 5000,  # most device-pair swap trials after each expert step
    "init_rounds": 10,  # balanced spherical k-means rounds of the initial token clusters
}
KINDS = {"init_rounds": "count+"}  # the initial clusters take at least one round


def solve(problem: LayerProblem, config: SolverConfig) -> LayerPlacement:
    started = time.perf_counter()
    opts = check_options("alternating", config.for_method("alternating"), DEFAULTS, KINDS)
    deadline = config.deadline(started)
    rng = np.random.default_rng(config.seed)
    e, per = problem.ep_size, problem.experts_per_device
    coact = coactivation(problem)
    t = cluster_tokens(problem, rng, rounds=int(opts["init_rounds"]), deadline=deadline)
    prices = None
    best: tuple[float, np.ndarray | None, np.ndarray] = (-np.inf, None, t)
    x: np.ndarray | None
    iterations = 0
    for iterations in range(1, int(opts["iterations"]) + 1):  # noqa: B007
        if deadline is not None and time.perf_counter() > deadline:
            iterations -= 1  # this one did not run
            break
        scores = expert_scores(problem, t)
        x = _expert_step(problem, scores, coact, opts)
        x = _swap_refine(x, scores, coact, opts, rng, e, deadline)
        gain = device_gains(problem, x)
        share = scores / np.maximum(scores.sum(axis=1, keepdims=True), 1e-300)  # [E, N]
        token_token = problem.affinity @ share.T  # [J, E]
        combined = float(opts["w_token"]) * gain + float(opts["w_token_token"]) * token_token
        result = assign_for_problem(problem, combined, prices=prices, sweeps=10)
        t_new, prices = result.token_to_device, result.prices
        obj = net_objective(problem, gain, t_new)  # as CEO chooses (the batch cap netted)
        if improves(obj, best[0]):
            best = (obj, x, t_new)
        if (t_new == t).all():
            t = t_new
            break
        t = t_new
    _, x, _ = best
    if x is None:  # not a single iteration ran (time limit): the clustering's best experts
        x = place_experts(expert_scores(problem, t), per)
    info = {"iterations": iterations}
    return finish(problem, "alternating", x, seed=config.seed, started=started, info=info)


def cluster_tokens(
    problem: LayerProblem,
    rng: np.random.Generator,
    *,
    rounds: int = 10,
    deadline: float | None = None,
) -> np.ndarray:
    """Initial token clusters by their affinity to experts: balanced spherical k-means.

    Token j's profile is its routing distribution (row of W, unit length); E centroids are
    seeded by k-means++ among the heaviest rows (weighted by :attr:`row_mass`, the
    frequency of a token row), then ``rounds`` times: tokens go to their most similar
    centroid under the capacity assignment (so clusters stay balanced), centroids become the
    mass-weighted mean profile of their tokens; after the first round, only until
    ``deadline`` (a ``time.perf_counter()`` value) if one is given. Returns token_to_device
    [J] int64.
    """
    w, freq, e = problem.affinity, problem.token_freq, problem.ep_size
    row_mass = problem.row_mass
    norms = np.sqrt(np.asarray(w.multiply(w).sum(axis=1)).ravel())
    unit = sparse.diags(np.divide(1.0, norms, out=np.zeros_like(norms), where=norms > 0)) @ w
    seeds_from = problem.heaviest_rows(2048)
    pool = unit[seeds_from].toarray()
    pool_mass = row_mass[seeds_from]
    if pool_mass.sum() <= 0:  # no row has activations (W = 0): every seed equally likely
        pool_mass = np.ones(seeds_from.size)
    pool_w = pool_mass / pool_mass.sum()
    # greedy k-means++: of a few distance-weighted draws, keep the one that covers most
    trials = 2 + int(np.log(e))
    chosen = [int(rng.choice(seeds_from.size, p=pool_w))]
    dist = np.clip(1.0 - pool @ pool[chosen[0]], 0.0, None)
    for _ in range(1, e):
        mass = dist * pool_w
        if mass.sum() <= 0:
            chosen.append(int(rng.integers(seeds_from.size)))
            continue
        picks = rng.choice(seeds_from.size, size=trials, p=mass / mass.sum())
        new = np.minimum(dist[None, :], np.clip(1.0 - pool[picks] @ pool.T, 0.0, None))
        best = int((new * pool_w).sum(axis=1).argmin())
        chosen.append(int(picks[best]))
        dist = new[best]
    centroids = pool[chosen]  # [E, N]
    t = np.zeros(problem.num_tokens, dtype=np.int64)
    prices = None
    for round_ in range(max(1, rounds)):
        if round_ and deadline is not None and time.perf_counter() > deadline:
            break
        similarity = np.asarray(unit @ centroids.T) * row_mass[:, None]  # [J, E]
        result = assign_tokens(similarity, freq, problem.capacity, prices=prices, sweeps=4)
        t_new, prices = result.token_to_device, result.prices
        summed = (
            sparse.csr_matrix((row_mass, (t_new, np.arange(t_new.size))), shape=(e, t_new.size))
            @ unit
        )
        centroids = np.asarray(summed.todense()) if sparse.issparse(summed) else np.asarray(summed)
        centroids /= np.maximum(np.linalg.norm(centroids, axis=1, keepdims=True), 1e-300)
        if (t_new == t).all():
            break
        t = t_new
    return t_new


def coactivation(problem: LayerProblem) -> np.ndarray:
    """C [N, N]: ``sum_j W[j,k] W[j,l] / act_j`` (expected co-routed pairs), zero diagonal."""
    act = problem.token_activations
    inv = np.divide(1.0, np.sqrt(act), out=np.zeros_like(act), where=act > 0)
    scaled = sparse.diags(inv) @ problem.affinity
    c = (scaled.T @ scaled).toarray()
    np.fill_diagonal(c, 0.0)
    return c


def _expert_step(
    problem: LayerProblem, scores: np.ndarray, coact: np.ndarray, opts: dict
) -> np.ndarray:
    """Hot experts first, each to its best load-adjusted unsaturated device. [N] int64."""
    e, per = problem.ep_size, problem.experts_per_device
    load = problem.expert_load
    mean_load = max(load.sum() / e, 1e-300)
    w_tok, w_exp, gamma = (
        float(opts["w_token"]),
        float(opts["w_expert"]),
        float(opts["load_penalty"]),
    )
    x = np.full(problem.num_experts, -1, dtype=np.int64)
    counts = np.zeros(e, dtype=np.int64)
    member_affinity = np.zeros((e, problem.num_experts))
    device_load = np.zeros(e)
    for k in np.argsort(-load, kind="stable"):
        score = w_tok * scores[:, k] + w_exp * member_affinity[:, k]
        score = score / (1.0 + gamma * device_load / mean_load)
        score[counts >= per] = -np.inf
        d = int(score.argmax())
        x[k] = d
        counts[d] += 1
        member_affinity[d] += coact[k]
        device_load[d] += load[k]
    return x


def _swap_refine(
    x: np.ndarray,
    scores: np.ndarray,
    coact: np.ndarray,
    opts: dict,
    rng: np.random.Generator,
    e: int,
    deadline: float | None = None,
) -> np.ndarray:
    """Swap refinement: pick two devices at random and swap the pair of their experts
    that raises the aggregated affinity score most, if any does.

    Device pairs are visited in random order, every pair once a pass; refinement stops
    after a pass with no improving swap (no single swap helps), after ``swap_rounds``
    trials, or where ``deadline`` passes first. Each trial scores every expert pair of the
    two devices at once, so a pass tries all N^2/2 swaps."""
    if e < 2:
        return x
    x = x.copy()
    w_tok, w_exp = float(opts["w_token"]), float(opts["w_expert"])
    # member_affinity[d, k] = sum of coact[k, l] over experts l on device d.
    member_affinity = np.stack([coact[x == d].sum(axis=0) for d in range(e)])
    pairs = np.array([(p, q) for p in range(e) for q in range(p + 1, e)], dtype=np.int64)
    order = np.empty(0, dtype=np.int64)
    stale = 0  # trials since the last swap: a whole pass of them ends the refinement
    for trial in range(int(opts["swap_rounds"])):
        if stale >= len(pairs) or (deadline is not None and time.perf_counter() > deadline):
            break
        if trial % len(pairs) == 0:  # a pass: every pair of devices once, in random order
            order = rng.permutation(len(pairs))
        p, q = pairs[order[trial % len(pairs)]]
        stale += 1
        on_p, on_q = np.flatnonzero(x == p), np.flatnonzero(x == q)
        to_q = w_tok * (scores[q, on_p] - scores[p, on_p]) + w_exp * (
            member_affinity[q, on_p] - member_affinity[p, on_p]
        )  # each expert of p moved to q ...
        to_p = w_tok * (scores[p, on_q] - scores[q, on_q]) + w_exp * (
            member_affinity[p, on_q] - member_affinity[q, on_q]
        )  # ... each of q moved to p, less the pair's own co-activation counted on both
        delta = to_q[:, None] + to_p[None, :] - 2.0 * w_exp * coact[np.ix_(on_p, on_q)]
        i, j = np.unravel_index(int(delta.argmax()), delta.shape)
        if delta[i, j] > 1e-12:
            a, b = int(on_p[i]), int(on_q[j])
            x[a], x[b] = q, p
            member_affinity[p] += coact[b] - coact[a]
            member_affinity[q] += coact[a] - coact[b]
            stale = 0
    return x

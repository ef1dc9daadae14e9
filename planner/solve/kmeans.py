"""Balanced two-stage ("2D") k-means baseline (paper 000 §3.4 compares against it).

Stage 1 clusters the experts by their token-affinity profiles into E groups of exactly N/E.
Expert k's profile is column k of ``diag(sqrt(a_j)) P`` scaled to unit length, where
``P[j, k] = W[j, k] / sum_k W[j, k]`` is token j's routing distribution: the inner product
of two profiles is then ``sum_j a_j P[j, k] P[j, l]``, how often the two experts serve the
same token occurrence (``profile="raw"`` uses W's columns instead; on the real OLMoE counts
that loses 2-6% LAR, so it is not the default). Distances between profiles only need the
[N, N] Gram matrix, so the profiles are embedded exactly by its eigendecomposition (rank
<= N) and k-means runs in that N-dimensional space. Balance is exact: every assignment step solves a linear
assignment of experts to E x (N/E) centroid slots (``scipy.optimize.linear_sum_assignment``
on an [N, N] cost), then centroids are re-averaged; greedy k-means++ seeding, ``n_init``
restarts.

Stage 2 places the tokens on the expert groups with the shared capacity assignment of
:mod:`planner.solve.common`, like every other solver; the ``evaluate`` distinct clusterings
with the lowest within-group distance are each completed so, and the best final objective
is kept.
"""

from __future__ import annotations

import time

import numpy as np
from scipy import sparse
from scipy.optimize import linear_sum_assignment

from planner.errors import InputError
from planner.solve.common import (
    assign_for_problem,
    canonical_labels,
    check_options,
    device_gains,
    finish,
    net_objective,
)
from planner.solve.problem import LayerPlacement, LayerProblem, SolverConfig

DEFAULTS: dict[str, object] = {
    "n_init": 16,  # k-means restarts (greedy k-means++ seeding each)
    "evaluate": 3,  # lowest-inertia distinct clusterings scored with the token assignment
    "max_iter": 50,  # assignment/update rounds per restart
    "profile": "coactivation",  # "coactivation" (frequency-weighted routing shares) or "raw"
}
KINDS = {"n_init": "count+", "evaluate": "count+", "max_iter": "count+"}  # common.check_options
PROFILES = ("coactivation", "raw")


def solve(problem: LayerProblem, config: SolverConfig) -> LayerPlacement:
    started = time.perf_counter()
    opts = check_options("kmeans", config.for_method("kmeans"), DEFAULTS, KINDS)
    if opts["profile"] not in PROFILES:
        raise InputError(f"kmeans: profile={opts['profile']!r} is not one of {', '.join(PROFILES)}")
    deadline = config.deadline(started)
    runs, restarts, distinct = clusterings(problem, config.seed, opts, deadline)
    # the lowest-inertia distinct clusterings go through the shared token assignment
    best = None
    for inertia, labels, iters in runs:
        gain = device_gains(problem, labels)
        t = assign_for_problem(problem, gain).token_to_device
        obj = net_objective(problem, gain, t)  # as CEO chooses (the batch cap netted)
        if best is None or obj > best[0]:
            best = (obj, labels, t, inertia, iters)
    assert best is not None, "kmeans: n_init and evaluate must be at least 1"
    _, labels, t, inertia, iters = best
    info = {
        "inertia": None if np.isnan(inertia) else float(inertia),
        "iterations": int(iters),
        "n_init": int(opts["n_init"]),
        "restarts_run": restarts,  # fewer than n_init where the time limit stopped them
        "distinct_clusterings": distinct,
    }
    return finish(
        problem, "kmeans", labels, seed=config.seed, started=started, token_to_device=t, info=info
    )


def clusterings(
    problem: LayerProblem, seed: int, opts: dict, deadline: float | None = None
) -> tuple[list[tuple[float, np.ndarray, int]], int, int]:
    """Stage 1: the ``opts["evaluate"]`` lowest-inertia distinct balanced clusterings of the
    experts from ``opts["n_init"]`` restarts (fewer where ``deadline`` passes).

    Returns ([(inertia, labels [N], iterations)] best first, restarts run, distinct
    clusterings found). CEO screens the same clusterings among its candidates.
    """
    rng = np.random.default_rng(seed)
    runs: dict[bytes, tuple[float, np.ndarray, int]] = {}
    restarts = 0
    if problem.experts_per_device == 1 or problem.ep_size == 1:
        # every balanced clustering is a relabelling of every other (as in CEO): no restarts
        contiguous = np.arange(problem.num_experts) // problem.experts_per_device
        runs[b""] = (float("nan"), contiguous, 0)
    else:
        features = expert_profiles(problem, str(opts["profile"]))
        for _ in range(int(opts["n_init"])):
            if runs and deadline is not None and time.perf_counter() > deadline:
                break
            restarts += 1
            labels, inertia, iters = balanced_kmeans(
                features, problem.ep_size, rng, max_iter=int(opts["max_iter"]), deadline=deadline
            )
            runs.setdefault(
                canonical_labels(labels, problem.ep_size).tobytes(), (inertia, labels, iters)
            )
    best = sorted(runs.values(), key=lambda r: r[0])[: int(opts["evaluate"])]
    return best, restarts, len(runs)


def expert_profiles(problem: LayerProblem, profile: str = "coactivation") -> np.ndarray:
    """[N, N] exact Euclidean embedding of the unit-length expert profiles (see module doc)."""
    w = problem.affinity
    if profile == "coactivation":
        act = problem.token_activations
        row = np.divide(np.sqrt(problem.row_mass), act, out=np.zeros_like(act), where=act > 0)
        w = sparse.diags(row) @ w
    norms = np.sqrt(np.asarray(w.multiply(w).sum(axis=0)).ravel())
    scaled = w @ sparse.diags(np.divide(1.0, norms, out=np.zeros_like(norms), where=norms > 0))
    gram = (scaled.T @ scaled).toarray()
    values, vectors = np.linalg.eigh((gram + gram.T) / 2)
    return vectors * np.sqrt(np.clip(values, 0.0, None))[None, :]


def balanced_kmeans(
    features: np.ndarray,
    parts: int,
    rng: np.random.Generator,
    *,
    max_iter: int = 50,
    deadline: float | None = None,
) -> tuple[np.ndarray, float, int]:
    """Exactly balanced k-means: [N, D] points into ``parts`` groups of N / parts.

    Stops after ``max_iter`` rounds, when no label changes, or after the first round that
    ends past ``deadline`` (a ``time.perf_counter()`` value; with thousands of experts a
    round's [N, N] linear assignment takes seconds).

    Returns (labels [N] int64, inertia = sum of squared distances to the group means, rounds).
    """
    n = features.shape[0]
    per = n // parts
    centroids = _kmeanspp(features, parts, rng)
    labels = np.full(n, -1, dtype=np.int64)
    dist = np.empty((n, parts))
    rounds = 0
    for rounds in range(1, max_iter + 1):  # noqa: B007
        for c in range(parts):  # column by column: an [N, E, D] difference is N x E x D floats
            dist[:, c] = ((features - centroids[c]) ** 2).sum(-1)
        rows, slots = linear_sum_assignment(np.repeat(dist, per, axis=1))
        new = np.empty(n, dtype=np.int64)
        new[rows] = slots // per
        if (new == labels).all():
            break
        labels = new
        centroids = np.stack([features[labels == c].mean(axis=0) for c in range(parts)])
        if deadline is not None and time.perf_counter() > deadline:
            break
    inertia = float(((features - centroids[labels]) ** 2).sum())
    return labels, inertia, rounds


def _kmeanspp(features: np.ndarray, parts: int, rng: np.random.Generator) -> np.ndarray:
    """Greedy k-means++ seeding: each new centre is the best of a few d^2-weighted draws."""
    n = features.shape[0]
    trials = 2 + int(np.log(parts))
    chosen = [int(rng.integers(n))]
    d2 = ((features - features[chosen[0]]) ** 2).sum(-1)
    for _ in range(1, parts):
        total = d2.sum()
        if total <= 0:
            chosen.append(int(rng.integers(n)))
            continue
        picks = rng.choice(n, size=trials, p=d2 / total)
        new_d2 = np.minimum(
            d2[None, :], ((features[None, :, :] - features[picks][:, None, :]) ** 2).sum(-1)
        )
        best = int(new_d2.sum(axis=1).argmin())
        chosen.append(int(picks[best]))
        d2 = new_d2[best]
    return features[chosen].copy()

"""Generated co-placement instances for the solver tests."""

from __future__ import annotations

import numpy as np
from scipy import sparse

from planner.solve.problem import LayerProblem


def random_problem(
    num_tokens: int,
    num_experts: int,
    ep_size: int,
    *,
    top_k: int = 2,
    seed: int = 0,
    clusters: int | None = None,
    noise: float = 0.0,
    zipf: float = 1.0,
    max_freq: int = 50,
    **kwargs,
) -> LayerProblem:
    """Routing counts of ``num_tokens`` tokens with Zipf-like frequencies.

    Each token prefers ``top_k`` experts: drawn from its hidden cluster's experts when
    ``clusters`` is given (experts and tokens split into that many groups), else from all
    experts. Each occurrence routes to the preferred set, each slot replaced by a uniformly
    random expert with probability ``noise``; W counts (token, expert) pairs.
    """
    rng = np.random.default_rng(seed)
    freq = np.maximum(1, np.round(max_freq / np.arange(1, num_tokens + 1) ** zipf)).astype(int)
    rng.shuffle(freq)
    rows, cols = [], []
    for j in range(num_tokens):
        if clusters:
            size = num_experts // clusters
            home = j % clusters
            pool = np.arange(home * size, (home + 1) * size)
        else:
            pool = np.arange(num_experts)
        preferred = rng.choice(pool, size=min(top_k, pool.size), replace=False)
        for _ in range(freq[j]):
            chosen = preferred.copy()
            swap = rng.random(chosen.size) < noise
            chosen[swap] = rng.integers(0, num_experts, swap.sum())
            rows.extend([j] * chosen.size)
            cols.extend(chosen.tolist())
    w = sparse.csr_matrix((np.ones(len(rows)), (rows, cols)), shape=(num_tokens, num_experts))
    w.sum_duplicates()
    return LayerProblem(w, freq.astype(float), ep_size, **kwargs)

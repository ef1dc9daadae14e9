"""How far a token's fitted routing carries over to its next occurrences: the shrinkage m.

A plan's token confidence is the share of a token's *fitting* activations that are local
on its device. For a token seen a few times that share is optimistic: the device was
chosen to fit those few occurrences. Runtime compares the token confidence with the
n-gram table's (Algorithm 2: the more confident table wins) and the per-batch cap keeps
the most confident tokens, so an optimistic token table takes tokens from a better
n-gram prediction and from the cap.

The fix is the usual empirical-Bayes shrinkage. A token seen ``a`` times has its routing
profile (share of its activations per expert) pulled towards the layer's average profile
by ``a / (a + m)``; m, one number per layer, is how many occurrences it takes before a
token's own profile is worth as much as the average. For a device share (a linear function
of the profile) the same shrinkage gives::

    confidence' = base + a / (a + m) * (confidence - base)

with ``base`` the share of the layer's routed activations on the token's device (what an
uninformative token gets). m = 0 trusts every token fully (the uncalibrated table).

m is estimated at fit time without any held-out data: the fitting requests are split in
two folds (A and B, by request), and m is the grid value whose shrunk fold-A profiles
best predict fold-B profiles (squared error, weighted by the token's fold-B occurrences,
over tokens seen in both folds). The average profile they are pulled towards is fold A's,
as the plan's ``base`` comes from the data the plan was fitted on. (It was both folds'
until 2026-11-29, which let fold B move the prior it was then predicted with. On the
example m is the same either way; on FLAME-MoE, fitted whole, layer 0's m fell from 4096
to 1024, and held out by request every method's plans moved: ``benchmarks/RESULTS.md``.)
Fold B is counted at 8 evenly spaced layers at most; the other layers take the nearest
sampled layer's m. On the real FLAME-MoE prefill trace m is at or near the top of the grid
at every layer (1024-4096: a token's identity says little there beyond the layer
average); on the example model it is 0.25-1 (tokens route consistently).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from scipy import sparse

# Candidate m, in occurrences. The largest stands for "a token's own profile is not worth
# trusting until it has been seen thousands of times".
SHRINKAGE_GRID = (
    0.0,
    0.25,
    0.5,
    1.0,
    2.0,
    4.0,
    8.0,
    16.0,
    32.0,
    64.0,
    128.0,
    256.0,
    1024.0,
    4096.0,
)

# Seed offset of the two folds' request split (independent of a --holdout split's seed).
FOLD_SEED_OFFSET = 7919
# Fold B is counted at this many evenly spaced layers at most (its cost is then a few
# percent of the fit at DeepSeek-V3's 58 layers); the others take the nearest one's m.
MAX_SAMPLED_LAYERS = 8


def sampled_layers(num_layers: int) -> np.ndarray:
    """[S] sorted layer indices the shrinkage is estimated at (all of them when L <= 8)."""
    if num_layers <= MAX_SAMPLED_LAYERS:
        return np.arange(num_layers)
    return np.unique(np.linspace(0, num_layers - 1, MAX_SAMPLED_LAYERS).round().astype(np.int64))


def spread_to_layers(values: np.ndarray, sampled: np.ndarray, num_layers: int) -> np.ndarray:
    """[L] each layer's value from the nearest sampled layer (the lower one on a tie)."""
    layers = np.arange(num_layers)
    nearest = np.abs(layers[:, None] - np.asarray(sampled)[None, :]).argmin(axis=1)
    return np.asarray(values, np.float64)[nearest]


def estimate_shrinkage(
    fold_a: Sequence[sparse.sparray], fold_b: Sequence[sparse.sparray], top_k: int
) -> np.ndarray:
    """[L] float64 m per layer from two folds' token-expert counts ([V, N] per layer each).

    Layers without a token seen in both folds get m = 0 (nothing to calibrate with).
    """
    out = np.zeros(len(fold_a), np.float64)
    grid = np.asarray(SHRINKAGE_GRID, np.float64)
    for layer, (counts_a, counts_b) in enumerate(zip(fold_a, fold_b, strict=True)):
        a_cnt = sparse.csr_array(counts_a, dtype=np.float64)
        b_cnt = sparse.csr_array(counts_b, dtype=np.float64)
        acts_a = np.asarray(a_cnt.sum(axis=1)).ravel()
        acts_b = np.asarray(b_cnt.sum(axis=1)).ravel()
        both = np.flatnonzero((acts_a > 0) & (acts_b > 0))
        if both.size == 0:
            continue
        # the layer's average profile, from fold A alone: with fold B in it, a heavy token
        # seen only in fold B moved the prior that fold B then judged (m 8 -> 1)
        total = np.asarray(a_cnt.sum(axis=0)).ravel()
        mean = total / total.sum()
        pa = sparse.csr_array(sparse.diags_array(1.0 / acts_a[both]) @ a_cnt[both])
        pb = sparse.csr_array(sparse.diags_array(1.0 / acts_b[both]) @ b_cnt[both])
        mm = float(mean @ mean)
        pa_mean, pb_mean = pa @ mean, pb @ mean
        # <pB - mean, pA - mean> and |pA - mean|^2 per token: the loss of shrinkage s is
        # sum_j w_j (|pB - mean|^2 - 2 s_j cross_j + s_j^2 spread_j); the first term is constant.
        cross = np.asarray(pa.multiply(pb).sum(axis=1)).ravel() - pa_mean - pb_mean + mm
        spread = np.asarray(pa.multiply(pa).sum(axis=1)).ravel() - 2.0 * pa_mean + mm
        occ_a = acts_a[both] / top_k
        weight = acts_b[both] / top_k
        s = occ_a[None, :] / (occ_a[None, :] + grid[:, None])  # [grid, tokens]
        loss = (weight * (s * s * spread - 2.0 * s * cross)).sum(axis=1)
        out[layer] = grid[int(np.argmin(loss))]
    return out


def shrink_confidence(
    confidence: np.ndarray, base: np.ndarray, occurrences: np.ndarray, m: float
) -> np.ndarray:
    """``base + a / (a + m) * (confidence - base)``, elementwise, clipped to [0, 1].

    Rows with ``occurrences == 0`` (nothing fitted) keep their confidence.
    """
    conf = np.asarray(confidence, np.float64)
    a = np.asarray(occurrences, np.float64)
    if m <= 0:
        return conf.copy()
    weight = a / (a + m)
    out = np.where(a > 0, base + weight * (conf - base), conf)
    return out.clip(0.0, 1.0)


def discounted_share(occurrences: np.ndarray, m: float) -> float:
    """Share of the token occurrences the shrinkage discounts: ``sum a m/(a+m) / sum a``.

    0 when every token's own routing is trusted (m = 0, or tokens seen far more than m
    times); near 1 when a token's identity says little beyond the layer average (m far
    above the typical count). The n-gram term (:mod:`planner.solve.ngram_term`) uses it to
    weigh the n-gram table against the token table.
    """
    a = np.asarray(occurrences, np.float64)
    total = float(a.sum())
    if m <= 0 or total <= 0:
        return 0.0
    return float((a * m / (a + m)).sum() / total)


def unseen_share(occurrences: np.ndarray) -> float:
    """Good-Turing estimate of the share of new traffic's token occurrences whose token the
    fitting data never saw: tokens seen exactly once over all occurrences (N1 / N).

    ``occurrences`` [J] are each fitting token's whole occurrence counts. On a synthetic
    DeepSeek-V3-shaped trace split by request it gives 0.201 where the held-out half's
    unseen share is 0.204; on the example's (the main job's split) 0.037 against 0.068.
    """
    a = np.asarray(occurrences, np.float64)
    total = float(a.sum())
    return float((a == 1).sum() / total) if total > 0 else 0.0

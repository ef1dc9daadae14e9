"""The held-out report of ``moeplan fit``: every figure is computed here, in one place.

For each held-out (token occurrence, MoE layer) pair the predicted expert set P is compared
with the routed set R (both of size k for a top-k prediction):

- precision = sum |P & R| / sum |P|, recall = sum |P & R| / sum |R|, F1 their harmonic
  mean, micro-averaged over (occurrence, layer) pairs: per layer, and over all layers for
  "overall" (token-occurrence weighted). With |P| = |R| = k the three coincide; the
  *confident set* (experts that received at least ``confident_threshold`` of the token's
  fitted occurrences, variable size) is reported beside it and separates precision from
  recall, as in paper 000 App. A.1.
- exact-set accuracy = share of pairs with P == R; top-1 accuracy = share whose predicted
  top-1 (the token's most frequent rank-0 expert; the neural predictor's largest logit)
  is the routed rank-0 expert.
- each figure for all held-out tokens, tokens seen in fitting, and unseen tokens (which
  use the fallback: nearest known token by embedding, else the layer's global top-k; with
  embeddings, the unseen tokens' figures under the global fallback are reported too).
- unseen share = share of held-out occurrences whose token was absent from fitting.
- kurtosis (paper 000 App. A.1): Pearson kurtosis ``m4 / m2**2`` (normal = 3, no excess
  subtracted, ``scipy.stats.kurtosis(x, fisher=False)``) of each token's vector of routed
  counts over the N experts, over tokens with at least 2 occurrences in the *fitting*
  data; summarised per layer by median and mean. A token always routed to the same k of
  N experts scores ``(1 - 3p(1-p)) / (p(1-p))`` with p = k/N (8.77 for 6 of 64).
- distribution-only error rate (paper 004 §3.2.1): the fitted multinomial against the
  held-out empirical load distribution; expert-load skewness = max / mean of the pooled
  held-out load (MoE-GPS averages it over batches of 512 tokens, which reads higher).
- the n-gram device table of the contiguous placement on ``ep_size`` devices: held-out
  accuracy of the top-1 expert's device, and the local activation rate it alone gives
  (indicative: solve fits the table of its own placement).
- prediction cost: wall time per token to predict every layer's set, table and neural.

Counts tables lose which experts were routed together in one occurrence: precision and
recall are computed from hit mass (held-out activations of (token, expert) pairs that
the prediction contains), while exact-set and top-1 accuracy are not computable and are
reported as null with the reason.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from scipy import sparse

from planner.predict.affinity import TokenExpertAffinity
from planner.predict.counts import TokenExpertCounts
from planner.predict.distribution import (
    DistributionPredictor,
    batch_load,
    empirical_distribution,
    error_rate,
)
from planner.predict.neural import NeuralPredictor
from planner.predict.ngram import (
    MAX_TABLE_CELLS,
    NgramDeviceTable,
    NgramEvaluation,
    TopOneTransitions,
    contiguous_placement,
    fit_ngram_device_table,
)
from planner.trace.info import load_skewness
from planner.trace.io import TraceBatch

NOT_FROM_COUNTS = (
    "not computable from a counts table: it keeps (token, expert) totals, not which k "
    "experts one occurrence was routed to, nor their rank"
)
# Tokens used to time a predictor's lookups.
_COST_TOKENS = 4096


def _r(x) -> float | None:
    return None if x is None or not np.isfinite(x) else round(float(x), 6)


@dataclass
class SetScores:
    """Per-layer sums behind precision, recall, F1, exact-set and top-1 accuracy.

    Attributes (each [L] float64): ``occurrences`` evaluated at the layer (weights for
    counts tables; the "overall" figure sums (occurrence, layer) pairs), ``hits`` =
    sum |P & R|, ``pred_size`` = sum |P|, ``routed_size`` = sum |R|, ``exact`` / ``top1``
    = pairs with P == R / right top-1. ``exact_and_top1=False`` reports the last two as
    None (not computable from counts).
    """

    num_layers: int
    exact_and_top1: bool = True
    occurrences: np.ndarray = field(init=False)
    hits: np.ndarray = field(init=False)
    pred_size: np.ndarray = field(init=False)
    routed_size: np.ndarray = field(init=False)
    exact: np.ndarray = field(init=False)
    top1: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        for name in ("occurrences", "hits", "pred_size", "routed_size", "exact", "top1"):
            setattr(self, name, np.zeros(self.num_layers))

    def add(
        self, layer: int, occurrences, hits, pred_size, routed_size, exact=0.0, top1=0.0
    ) -> None:
        self.occurrences[layer] += occurrences
        self.hits[layer] += hits
        self.pred_size[layer] += pred_size
        self.routed_size[layer] += routed_size
        self.exact[layer] += exact
        self.top1[layer] += top1

    def to_dict(self) -> dict:
        def ratio(num: np.ndarray, den: np.ndarray) -> dict:
            per = [_r(a / b) if b > 0 else None for a, b in zip(num, den, strict=True)]
            total = den.sum()
            return {"per_layer": per, "overall": _r(num.sum() / total) if total > 0 else None}

        p = ratio(self.hits, self.pred_size)
        r = ratio(self.hits, self.routed_size)

        def f1(a, b):
            return None if a is None or b is None or a + b == 0 else round(2 * a * b / (a + b), 6)

        out: dict[str, Any] = {
            "occurrences": {
                "per_layer": [_r(x) for x in self.occurrences],
                "overall": _r(self.occurrences.sum()),
            },
            "precision": p,
            "recall": r,
            "f1": {
                "per_layer": [
                    f1(a, b) for a, b in zip(p["per_layer"], r["per_layer"], strict=True)
                ],
                "overall": f1(p["overall"], r["overall"]),
            },
        }
        if self.exact_and_top1:
            out["exact_set"] = ratio(self.exact, self.occurrences)
            out["top1"] = ratio(self.top1, self.occurrences)
        else:
            out["exact_set"] = out["top1"] = None
        return out


def pearson_kurtosis_rows(counts: sparse.csr_array, rows: np.ndarray) -> np.ndarray:
    """[len(rows)] Pearson kurtosis of each selected row of ``counts`` [V, N] over all N columns.

    Zeros count as values. Rows with zero variance give NaN.
    """
    sub = sparse.csr_array(counts[rows]).astype(np.float64)
    n = sub.shape[1]
    nnz_row = np.diff(sub.indptr)
    row_of = np.repeat(np.arange(sub.shape[0]), nnz_row)
    s1 = np.bincount(row_of, weights=sub.data, minlength=sub.shape[0])
    mu = s1 / n
    d = sub.data - mu[row_of]
    zeros = n - nnz_row
    m2 = (np.bincount(row_of, weights=d**2, minlength=sub.shape[0]) + zeros * mu**2) / n
    m4 = (np.bincount(row_of, weights=d**4, minlength=sub.shape[0]) + zeros * mu**4) / n
    return np.divide(m4, m2**2, out=np.full(m2.shape, np.nan), where=m2 > 0)


def kurtosis_summary(counts: TokenExpertCounts, min_occurrences: int = 2) -> dict:
    """Per-layer median / mean Pearson kurtosis of per-token activation counts."""
    m = counts.meta
    acts = counts.token_activations()
    medians, means, totals = [], [], []
    every = []
    for layer, mat in enumerate(counts.by_layer):
        rows = np.flatnonzero(acts[layer] >= min_occurrences * m.top_k)
        k = pearson_kurtosis_rows(mat, rows)
        k = k[np.isfinite(k)]
        every.append(k)
        medians.append(_r(np.median(k)) if k.size else None)
        means.append(_r(k.mean()) if k.size else None)
        totals.append(int(k.size))
    allk = np.concatenate(every) if every else np.zeros(0)
    return {
        "definition": "Pearson (normal = 3) kurtosis of each token's routed counts over the "
        f"experts, tokens with >= {min_occurrences} occurrences in the fitting data",
        "median": {"per_layer": medians, "overall": _r(np.median(allk)) if allk.size else None},
        "mean": {"per_layer": means, "overall": _r(allk.mean()) if allk.size else None},
        "tokens": {"per_layer": totals, "overall": int(allk.size)},
    }


def _nanmean(x: np.ndarray) -> float | None:
    """Mean of the finite values (layers with load), None without any (and no warning)."""
    x = x[np.isfinite(x)]
    return _r(x.mean()) if x.size else None


def distribution_summary(
    distribution: DistributionPredictor, heldout_load: np.ndarray, fit_load: np.ndarray
) -> dict:
    err = error_rate(distribution.predict(), empirical_distribution(heldout_load))
    # a layer without held-out activations has no empirical distribution to compare with
    err[np.asarray(heldout_load).sum(axis=1) == 0] = np.nan
    skew_h, skew_f = load_skewness(heldout_load), load_skewness(fit_load)
    return {
        "error_rate": {"per_layer": [_r(x) for x in err], "overall": _nanmean(err)},
        "skewness_heldout": {
            "per_layer": [_r(x) for x in skew_h],
            "overall": _nanmean(skew_h),
        },
        "skewness_fit": {"per_layer": [_r(x) for x in skew_f], "overall": _nanmean(skew_f)},
        "heldout_activations": int(heldout_load.sum()),
    }


def prediction_cost_us(
    predict_all_layers: Callable[[np.ndarray], object], token_ids: np.ndarray, repeats: int = 3
) -> float:
    """Best-of-``repeats`` wall time per token (µs) of predicting every layer's set for ``token_ids``."""
    token_ids = np.asarray(token_ids)[:_COST_TOKENS]
    if token_ids.size == 0:
        return float("nan")
    predict_all_layers(token_ids[:16])  # warm-up (lazy tables, allocator)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        predict_all_layers(token_ids)
        best = min(best, time.perf_counter() - t0)
    return best / token_ids.size * 1e6


def _table_all_layers(affinity: TokenExpertAffinity) -> Callable[[np.ndarray], np.ndarray]:
    def run(ids: np.ndarray) -> np.ndarray:
        return np.stack(
            [affinity.predict_topk(ids, layer) for layer in range(affinity.meta_.num_layers)],
            axis=1,
        )

    return run


@dataclass
class HeldoutParts:
    """What a held-out report evaluates (the fitted pieces of a predictor)."""

    affinity: TokenExpertAffinity
    distribution: DistributionPredictor
    fit_counts: TokenExpertCounts
    transitions: TopOneTransitions | None = None
    neural: NeuralPredictor | None = None
    ep_size: int = 8
    ngram_order: int = 2


def _new_scores(big_l: int, exact_and_top1: bool) -> dict[str, SetScores]:
    return {s: SetScores(big_l, exact_and_top1) for s in ("all", "seen", "unseen")}


def _set_overlap(pred: np.ndarray, routed: np.ndarray) -> np.ndarray:
    """[T] |P & R| for sets ``pred`` [T, kp] and ``routed`` [T, k] (distinct within rows)."""
    return (pred[:, :, None] == routed[:, None, :]).any(axis=2).sum(axis=1)


class TraceEvaluator:
    """Accumulates the held-out report over trace batches (call :meth:`add`, then :meth:`report`)."""

    def __init__(self, parts: HeldoutParts):
        self.parts = parts
        m = self.meta = parts.affinity.meta_
        big_l = m.num_layers
        self.table = _new_scores(big_l, True)
        self.confident = SetScores(big_l, exact_and_top1=False)
        self.global_unseen = SetScores(big_l) if parts.affinity.fallback_ == "embedding" else None
        self._global = parts.affinity.without_embedding_fallback() if self.global_unseen else None
        self.neural = _new_scores(big_l, True) if parts.neural is not None else None
        self.load = np.zeros((big_l, m.num_experts), np.int64)
        self.tokens = 0
        self.unseen = 0
        self._cost_ids: list[np.ndarray] = []
        self.ngram: NgramEvaluation | None = None
        self._ngram_table: NgramDeviceTable | None = None
        self._ngram_reason = _ngram_unavailable_reason(parts, m.num_experts, m.num_layers)
        if self._ngram_reason is None:
            assert parts.transitions is not None  # else a reason was given
            self._placement = contiguous_placement(big_l, m.num_experts, parts.ep_size)
            self._ngram_table = fit_ngram_device_table(
                parts.transitions, self._placement, parts.ep_size, parts.ngram_order
            )
            self.ngram = NgramEvaluation(
                parts.ngram_order, parts.ep_size, np.zeros(big_l, np.int64),
                np.zeros(big_l, np.int64), np.zeros(big_l, np.int64), m.top_k,
            )  # fmt: skip

    def add(self, batch: TraceBatch) -> None:
        """Score held-out rows (only ``token_id`` [T] and ``experts`` [T, L, k] are read)."""
        aff, k = self.parts.affinity, self.meta.top_k
        tok = batch.token_id.astype(np.int64)
        t = tok.shape[0]
        if t == 0:
            return
        seen = (tok >= 0) & aff.seen_[np.maximum(tok, 0)]
        masks = {"all": np.ones(t, bool), "seen": seen, "unseen": ~seen}
        self.tokens += t
        self.unseen += int((~seen).sum())
        if sum(x.size for x in self._cost_ids) < _COST_TOKENS:
            self._cost_ids.append(tok)
        neural_pred = None
        if self.parts.neural is not None:
            uniq, inv = np.unique(tok, return_inverse=True)
            neural_pred = self.parts.neural.predict_topk(uniq)[inv]  # [T, L, k]
        for layer in range(self.meta.num_layers):
            routed = batch.experts[:, layer]
            pred, top1 = aff.predict_topk(tok, layer), aff.predict_top1(tok, layer)
            self._score(self.table, layer, pred, routed, masks, top1)
            if neural_pred is not None:
                assert self.neural is not None  # both exist iff parts.neural is set
                pred = neural_pred[:, layer]
                self._score(self.neural, layer, pred, routed, masks, pred[:, 0])
            if self.global_unseen is not None and (~seen).any():
                assert self._global is not None  # built together with global_unseen
                pred, top1 = (
                    self._global.predict_topk(tok, layer),
                    self._global.predict_top1(tok, layer),
                )
                self._score(
                    {"unseen": self.global_unseen}, layer, pred, routed, {"unseen": ~seen}, top1
                )
            share = aff.routed_share(tok, routed, layer)
            size = aff.confident_size(tok, layer)
            hits = (share >= aff.confident_threshold).sum()
            self.confident.add(layer, t, hits, size.sum(), k * t)
        self.load += batch_load(batch.experts, self.meta.num_experts)
        if self.ngram is not None:
            assert self._ngram_table is not None  # built together with ngram
            self.ngram.add(self._ngram_table, batch.experts, self._placement)

    def _score(
        self,
        scores: dict[str, SetScores],
        layer: int,
        pred: np.ndarray,
        routed: np.ndarray,
        masks: dict[str, np.ndarray],
        top1_pred: np.ndarray,
    ) -> None:
        """Add predicted sets ``pred`` [T, k] and top-1 ``top1_pred`` [T] vs ``routed`` [T, k]."""
        k = self.meta.top_k
        hits = _set_overlap(pred, routed)
        exact = hits == k
        top1 = top1_pred == routed[:, 0]
        for name, mask in masks.items():
            n = int(mask.sum())
            if n:
                scores[name].add(
                    layer, n, hits[mask].sum(), k * n, k * n, exact[mask].sum(), top1[mask].sum()
                )

    def report(self) -> dict:
        parts = self.parts
        ids = np.concatenate(self._cost_ids) if self._cost_ids else np.zeros(0, np.int64)
        unseen_share = self.unseen / self.tokens if self.tokens else None
        return _assemble(
            parts,
            heldout_tokens=self.tokens,
            unseen_share={
                "per_layer": [_r(unseen_share)] * self.meta.num_layers,
                "overall": _r(unseen_share),
            },
            table={n: s.to_dict() for n, s in self.table.items()},
            confident=self.confident.to_dict(),
            global_unseen=self.global_unseen.to_dict() if self.global_unseen else None,
            neural={n: s.to_dict() for n, s in self.neural.items()} if self.neural else None,
            heldout_load=self.load,
            ngram=self.ngram.summary()
            if self.ngram is not None
            else {"available": False, "reason": self._ngram_reason},
            cost_ids=ids,
        )


def _ngram_unavailable_reason(parts: HeldoutParts, n: int, big_l: int) -> str | None:
    if parts.transitions is None:
        return "no inter-layer information (counts tables keep no per-token routing path)"
    if n % parts.ep_size:
        return f"ep_size {parts.ep_size} does not divide num_experts {n}"
    if big_l <= parts.ngram_order:
        return (
            f"the model has {big_l} MoE layers, not more than the n-gram order {parts.ngram_order}"
        )
    cells = parts.ep_size ** (parts.ngram_order + 1)
    if cells > MAX_TABLE_CELLS:
        return (
            f"{parts.ep_size} devices at order {parts.ngram_order} make {cells:.3g} (context, "
            f"device) cells, more than {MAX_TABLE_CELLS:.3g}; lower --ep-size or --ngram-order"
        )
    return None


def _hit_mass(
    keys: np.ndarray, data: np.ndarray, rows: np.ndarray, pred: np.ndarray, n: int
) -> np.ndarray:
    """[U] held-out activations of ``rows`` [U] on the experts ``pred`` [U, k].

    ``keys`` [nnz] = sorted ``row * N + expert`` of the held-out counts, ``data`` their counts.
    """
    q = rows[:, None] * n + pred.astype(np.int64)
    pos = np.minimum(np.searchsorted(keys, q), keys.size - 1)
    return np.where(keys[pos] == q, data[pos], 0).sum(axis=1).astype(np.float64)


def evaluate_counts(parts: HeldoutParts, heldout: TokenExpertCounts) -> dict:
    """The held-out report for counts: hit-mass precision/recall (see the module docstring)."""
    aff = parts.affinity
    m = aff.meta_
    big_l, n, k, v = m.num_layers, m.num_experts, m.top_k, m.vocab_size
    table, neural = _new_scores(big_l, False), (_new_scores(big_l, False) if parts.neural else None)
    confident = SetScores(big_l, exact_and_top1=False)
    global_unseen = SetScores(big_l, False) if aff.fallback_ == "embedding" else None
    glob = aff.without_embedding_fallback() if global_unseen else None
    unseen_per_layer, mass_per_layer = np.zeros(big_l), np.zeros(big_l)
    all_tokens = np.flatnonzero(heldout.token_activations().sum(axis=0) > 0)
    neural_pred = parts.neural.predict_topk(all_tokens) if parts.neural else None
    for layer, mat in enumerate(heldout.by_layer):
        rows = np.flatnonzero(np.diff(mat.indptr) > 0)
        if rows.size == 0:
            continue
        keys = np.repeat(np.arange(v, dtype=np.int64), np.diff(mat.indptr)) * n + mat.indices
        occ = np.asarray(mat.sum(axis=1)).ravel()[rows].astype(np.float64) / k  # [U]
        seen = aff.seen_[rows]
        masks = {"all": np.ones(rows.size, bool), "seen": seen, "unseen": ~seen}
        unseen_per_layer[layer] = occ[~seen].sum()
        mass_per_layer[layer] = occ.sum()

        def add(scores: dict[str, SetScores], hits: np.ndarray, layer=layer, occ=occ, masks=masks):
            for name, mask in masks.items():
                if mask.any():
                    o = occ[mask].sum()
                    scores[name].add(layer, o, hits[mask].sum(), k * o, k * o)

        add(table, _hit_mass(keys, mat.data, rows, aff.predict_topk(rows, layer), n))
        if neural_pred is not None:
            assert neural is not None  # both exist iff parts.neural is set
            pred = neural_pred[np.searchsorted(all_tokens, rows), layer]
            add(neural, _hit_mass(keys, mat.data, rows, pred, n))
        if global_unseen is not None and (~seen).any():
            assert glob is not None  # built together with global_unseen
            un = rows[~seen]
            o = occ[~seen].sum()
            hits = _hit_mass(keys, mat.data, un, glob.predict_topk(un, layer), n).sum()
            global_unseen.add(layer, o, hits, k * o, k * o)
        # Confident set: held-out mass on pairs whose fitted share clears the threshold.
        pair_rows = np.repeat(np.arange(v, dtype=np.int64), np.diff(mat.indptr))
        share = aff.routed_share(pair_rows, mat.indices[:, None], layer)[:, 0]
        hits = mat.data[share >= aff.confident_threshold].sum()
        size = aff.confident_size(rows, layer).astype(np.float64)
        confident.add(layer, occ.sum(), hits, (size * occ).sum(), k * occ.sum())
    share = np.divide(
        unseen_per_layer, mass_per_layer, out=np.full(big_l, np.nan), where=mass_per_layer > 0
    )
    return _assemble(
        parts,
        heldout_tokens=float(mass_per_layer.mean()) if big_l else 0.0,
        unseen_share={
            "per_layer": [_r(x) for x in share],
            "overall": _r(unseen_per_layer.sum() / mass_per_layer.sum())
            if mass_per_layer.sum()
            else None,
        },
        table={name: s.to_dict() for name, s in table.items()},
        confident=confident.to_dict(),
        global_unseen=global_unseen.to_dict() if global_unseen else None,
        neural={name: s.to_dict() for name, s in neural.items()} if neural else None,
        heldout_load=heldout.load(),
        ngram={"available": False, "reason": _ngram_unavailable_reason(parts, n, big_l)},
        cost_ids=all_tokens,
        exact_top1_reason=NOT_FROM_COUNTS,
    )


def _assemble(
    parts: HeldoutParts,
    *,
    heldout_tokens: float,
    unseen_share: dict,
    table: dict,
    confident: dict,
    global_unseen: dict | None,
    neural: dict | None,
    heldout_load: np.ndarray,
    ngram: dict,
    cost_ids: np.ndarray,
    exact_top1_reason: str | None = None,
) -> dict:
    aff = parts.affinity
    cost = {"table_us_per_token": _r(prediction_cost_us(_table_all_layers(aff), cost_ids))}
    if parts.neural is not None:
        cost["neural_us_per_token"] = _r(prediction_cost_us(parts.neural.predict_topk, cost_ids))
    neural_out = None
    if neural is not None:
        assert parts.neural is not None  # neural scores come only from parts.neural
        neural_out = {**neural, "train": parts.neural.train_log_}
    out = {
        "heldout_tokens": _r(heldout_tokens),
        "layers": list(aff.meta_.moe_layer_indices),
        "unseen_share": unseen_share,
        "fallback": aff.fallback_,
        "table": table,
        "table_confident": {"threshold": aff.confident_threshold, **confident},
        "unseen_with_global_fallback": global_unseen,
        "neural": neural_out,
        "kurtosis": kurtosis_summary(parts.fit_counts),
        "distribution": distribution_summary(
            parts.distribution, heldout_load, parts.fit_counts.load()
        ),
        "ngram": ngram,
        "cost": {
            **cost,
            "batch_tokens": int(min(cost_ids.size, _COST_TOKENS)),
            "note": "best-of-3 wall time per token to predict every layer's top-k for one "
            "batch of held-out tokens on this machine's CPU (table: numpy lookups; neural: "
            "torch, 1 thread)",
        },
    }
    if exact_top1_reason is not None:
        out["exact_set_and_top1"] = exact_top1_reason
    return out

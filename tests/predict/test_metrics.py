"""The held-out report: figures checked on data whose true affinity is known."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.stats
from scipy import sparse

from planner.predict.affinity import TokenExpertAffinity
from planner.predict.counts import counts_from_triples
from planner.predict.distribution import DistributionPredictor
from planner.predict.fit import FitConfig, fit_predictor
from planner.predict.metrics import HeldoutParts, evaluate_counts, pearson_kurtosis_rows
from planner.predict.split import RequestSplit
from planner.trace import TraceMeta
from planner.trace.io import open_trace
from tests.predict.conftest import chain_batch, twin_trace, write_batch


def overall(block, metric):
    return block[metric]["overall"]


def test_kurtosis_matches_scipy_on_a_hand_case():
    dense = np.array([
        [5, 0, 0, 0, 5, 0, 0, 0],
        [1, 1, 1, 1, 1, 1, 1, 1],  # no variance: NaN
        [9, 1, 0, 0, 0, 0, 3, 0],
        [0, 0, 0, 0, 0, 0, 0, 0],
        [2, 2, 0, 1, 0, 0, 0, 7],
    ])  # fmt: skip
    got = pearson_kurtosis_rows(sparse.csr_array(dense), np.array([0, 2, 4, 1]))
    want = scipy.stats.kurtosis(dense[[0, 2, 4]], axis=1, fisher=False)
    np.testing.assert_allclose(got[:3], want)
    assert np.isnan(got[3])


def test_exact_affinity_gives_perfect_scores_on_seen_tokens(exact_trace):
    path, _ = exact_trace
    report = fit_predictor(path, FitConfig(holdout=0.5, seed=1)).report
    seen = report["table"]["seen"]
    for metric in ("precision", "recall", "f1", "exact_set", "top1"):
        assert overall(seen, metric) == 1.0
        assert all(x == 1.0 for x in seen[metric]["per_layer"])
    conf = report["table_confident"]
    assert overall(conf, "precision") == 1.0 and overall(conf, "recall") <= 1.0
    # Unseen tokens fall back to the global top-k: far from perfect.
    assert overall(report["table"]["unseen"], "precision") < 0.5
    # Every token concentrates on exactly k of N experts: kurtosis of a 0/c vector with
    # k nonzeros of N, (1 - 3p(1-p)) / (p(1-p)) with p = k/N.
    p = 2 / 16
    assert report["kurtosis"]["median"]["overall"] == pytest.approx(
        (1 - 3 * p * (1 - p)) / (p * (1 - p))
    )


def test_unseen_share_matches_the_trace(exact_trace):
    path, _ = exact_trace
    report = fit_predictor(path, FitConfig(holdout=0.5, seed=1)).report
    batch = open_trace(path).read_all()
    split = RequestSplit.make(batch.request_id, 0.5, 1)
    held = split.heldout_mask(batch.request_id)
    fit_tokens = set(batch.token_id[~held].tolist())
    want = np.mean([t not in fit_tokens for t in batch.token_id[held]])
    assert report["unseen_share"]["overall"] == pytest.approx(want, abs=1e-6)
    assert report["split"]["heldout_requests"] == split.heldout_ids.size


def test_routing_independent_of_the_token_scores_at_chance(random_trace):
    path, gen = random_trace
    report = fit_predictor(path, FitConfig(holdout=0.5, seed=0)).report
    chance = gen.config.top_k / gen.config.num_experts  # uniform expert popularity
    for subset in ("all", "seen"):
        assert overall(report["table"][subset], "precision") == pytest.approx(chance, abs=0.02)
    assert overall(report["table"]["all"], "exact_set") < 0.05
    assert overall(report["table"]["all"], "top1") == pytest.approx(1 / 16, abs=0.02)
    # Uniform load: the distribution-only estimate is close, skewness near 1.
    assert report["distribution"]["error_rate"]["overall"] < 0.15
    assert report["distribution"]["skewness_heldout"]["overall"] < 1.2


def test_constructed_unseen_share_and_ngram(tmp_path, small_meta):
    """Held-out requests: half their tokens were fitted, half never seen (exact share 0.5)."""
    rid = np.repeat(np.arange(10), 20)
    split = RequestSplit.make(np.arange(10), 0.5, seed=7)
    held = split.heldout_mask(rid)
    tokens = np.arange(rid.size) % 10  # fitted vocabulary 0..9
    pos_in_req = np.arange(rid.size) % 20
    tokens[held & (pos_in_req >= 10)] = 20 + pos_in_req[held & (pos_in_req >= 10)]
    path = write_batch(tmp_path / "t.parquet", small_meta, chain_batch(small_meta, tokens, rid))
    report = fit_predictor(path, FitConfig(holdout=0.5, seed=7, ep_size=8, ngram_order=1)).report
    assert report["unseen_share"]["overall"] == 0.5
    assert overall(report["table"]["seen"], "exact_set") == 1.0
    assert overall(report["table"]["seen"], "top1") == 1.0
    # The chain makes layer l's top-1 a function of layer l-1's, so with one expert per
    # device (E = N) the 1-gram device table is exact, even for unseen tokens.
    ngram = report["ngram"]
    assert ngram["order"] == 1 and ngram["ep_size"] == 8
    assert ngram["top1_device_accuracy"]["per_layer"][0] is None
    assert ngram["top1_device_accuracy"]["overall"] == 1.0


def test_counts_report_uses_hit_mass():
    meta = TraceMeta("test/c", num_layers=1, num_experts=4, top_k=2, vocab_size=5)
    # Fitted: token 0 -> {0, 1}; token 1 -> {2, 3}.
    fit = counts_from_triples(
        meta, *map(np.array, ([0, 0, 0, 0], [0, 0, 1, 1], [0, 1, 2, 3], [3, 3, 1, 1]))
    )
    # Held-out: token 0 occurs 4 times routed {0:4, 1:2, 3:2}; token 1 once {2:1, 0:1};
    # token 4 (unseen) once {0:1, 1:1}.
    held = counts_from_triples(
        meta,
        *map(
            np.array, ([0] * 7, [0, 0, 0, 1, 1, 4, 4], [0, 1, 3, 2, 0, 0, 1], [4, 2, 2, 1, 1, 1, 1])
        ),
    )
    aff = TokenExpertAffinity().fit(fit)
    dist = DistributionPredictor().partial_fit(fit.load())
    report = evaluate_counts(HeldoutParts(aff, dist, fit), held)
    # Hits: token 0: 4 + 2 = 6 of 8; token 1: 1 of 2; token 4 -> global top-2 = {0, 1}
    # (fitted load 3, 3, 1, 1): 2 of 2. Precision = 9 / 12.
    assert overall(report["table"]["all"], "precision") == pytest.approx(9 / 12)
    assert overall(report["table"]["seen"], "precision") == pytest.approx(7 / 10)
    assert overall(report["table"]["unseen"], "precision") == 1.0
    assert report["unseen_share"]["overall"] == pytest.approx(1 / 6, abs=1e-6)
    assert (
        report["table"]["all"]["exact_set"] is None
        and "not computable" in report["exact_set_and_top1"]
    )


def test_embedding_fallback_recovers_twins_of_unseen_tokens(tmp_path):
    from planner.predict.affinity import load_embeddings

    trace_dir = twin_trace(tmp_path / "twins")
    emb = str(trace_dir / "embeddings.safetensors")
    with_emb = fit_predictor(trace_dir, FitConfig(holdout=0.5, embeddings=emb)).report
    assert with_emb["unseen_share"]["overall"] == 1.0
    for metric in ("precision", "exact_set", "top1"):
        assert overall(with_emb["table"]["unseen"], metric) == 1.0
    without = fit_predictor(trace_dir, FitConfig(holdout=0.5, auto_embeddings=False)).report
    assert overall(without["table"]["unseen"], "precision") < 0.5
    assert with_emb["unseen_with_global_fallback"] == without["table"]["unseen"]
    assert load_embeddings(emb, 100).shape == (100, 32)

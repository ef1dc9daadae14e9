"""Token shrinkage (planner.predict.reliability): estimated from two folds, saved, applied."""

from __future__ import annotations

import json

import numpy as np
import pytest
from scipy import sparse

from planner.errors import SchemaError
from planner.predict.fit import FitConfig, fit_predictor
from planner.predict.predictor import MANIFEST, Predictor
from planner.predict.reliability import (
    SHRINKAGE_GRID,
    discounted_share,
    estimate_shrinkage,
    sampled_layers,
    shrink_confidence,
    spread_to_layers,
    unseen_share,
)
from tests.conftest import FLAME_TRACE, require
from tests.predict.conftest import synth_trace


def _fold(rows: list[dict[int, int]], n: int = 8) -> sparse.csr_array:
    dense = np.zeros((len(rows), n))
    for j, row in enumerate(rows):
        for e, c in row.items():
            dense[j, e] = c
    return sparse.csr_array(dense)


def test_consistent_tokens_are_trusted_and_random_ones_are_not():
    rng = np.random.default_rng(0)
    v, n, k, occ = 300, 8, 2, 6
    own = np.stack([rng.choice(n, k, replace=False) for _ in range(v)])

    def counts(consistent: bool) -> sparse.csr_array:
        dense = np.zeros((v, n))
        for j in range(v):
            for _ in range(occ):
                experts = own[j] if consistent else rng.choice(n, k, replace=False)
                dense[j, experts] += 1
        return sparse.csr_array(dense)

    m = estimate_shrinkage([counts(True)], [counts(True)], k)
    assert m.tolist() == [0.0]
    m = estimate_shrinkage([counts(False)], [counts(False)], k)
    assert m[0] >= 256
    # Nothing seen in both folds: nothing to calibrate, m = 0.
    a, b = _fold([{0: 2}, {}]), _fold([{}, {1: 2}])
    assert estimate_shrinkage([a], [b], 2).tolist() == [0.0]


def test_tokens_seen_only_in_fold_b_do_not_move_the_prior():
    """The prior (the layer's average profile) came from both folds, so a heavy token seen
    only in fold B shifted the mean that fold B's tokens were then predicted with (m went
    from 8 or 16 to 1 on such instances). It is fold A's now: such a token changes nothing."""
    rng = np.random.default_rng(0)
    v, n, k = 60, 8, 2
    changed = 0
    for _ in range(5):
        own = np.stack([rng.choice(n, k, replace=False) for _ in range(v)])
        p_consistent = rng.uniform(0.3, 0.9)

        def counts(own=own, p_consistent=p_consistent) -> np.ndarray:
            dense = np.zeros((v + 1, n))
            for j in range(v):
                for _ in range(rng.integers(1, 5)):
                    ex = own[j] if rng.random() < p_consistent else rng.choice(n, k, replace=False)
                    dense[j, ex] += 1
            return dense

        a, b = counts(), counts()
        m = estimate_shrinkage([sparse.csr_array(a)], [sparse.csr_array(b)], k)
        b[v, [0, 1]] = 2000  # row v: a heavy token fold A never saw
        m_heavy = estimate_shrinkage([sparse.csr_array(a)], [sparse.csr_array(b)], k)
        assert m_heavy.tolist() == m.tolist()
        changed += m.tolist() != [0.0]
    assert changed  # the instances calibrate something


def test_shrink_confidence_formula():
    conf = np.array([0.9, 0.9, 0.9, 0.7])
    base = np.array([0.25, 0.25, 0.25, 0.5])
    a = np.array([1.0, 3.0, 0.0, 1.0])
    out = shrink_confidence(conf, base, a, 1.0)
    np.testing.assert_allclose(out, [0.25 + 0.5 * 0.65, 0.25 + 0.75 * 0.65, 0.9, 0.5 + 0.1])
    np.testing.assert_array_equal(shrink_confidence(conf, base, a, 0.0), conf)
    assert max(SHRINKAGE_GRID) > 1000  # "never trust" is on the grid


def test_discounted_share():
    a = np.array([1.0, 3.0])
    # sum a m / (a + m) / sum a with m = 1: (1/2 + 3/4) / 4
    assert discounted_share(a, 1.0) == pytest.approx(1.25 / 4)
    assert discounted_share(a, 0.0) == 0.0
    assert discounted_share(np.zeros(2), 4.0) == 0.0
    assert discounted_share(a, 4096.0) > 0.99  # m far above every count: all discounted
    assert discounted_share(a * 1e6, 0.25) < 1e-6  # every token seen far more than m


def test_unseen_share_is_good_turing():
    # N1 / N: two tokens seen once among 1 + 1 + 2 + 5 occurrences
    assert unseen_share(np.array([1.0, 1.0, 2.0, 5.0])) == pytest.approx(2 / 9)
    assert unseen_share(np.array([2.0, 3.0])) == 0.0
    assert unseen_share(np.zeros(3)) == 0.0 and unseen_share(np.ones(4)) == 1.0
    # on a Zipf vocabulary, held out by request: close to the share of new tokens
    rng = np.random.default_rng(0)
    p = 1.0 / np.arange(1, 20001) ** 1.1
    fit, held = (rng.choice(p.size, 30000, p=p / p.sum()) for _ in range(2))
    new = float(np.mean(~np.isin(held, fit)))
    assert unseen_share(np.bincount(fit)) == pytest.approx(new, abs=0.02)


def test_fit_estimates_shrinkage_per_layer(exact_trace, random_trace, tmp_path):
    exact = fit_predictor(exact_trace[0], FitConfig()).predictor
    random = fit_predictor(random_trace[0], FitConfig()).predictor
    layers = exact.meta.num_layers
    assert exact.token_shrinkage.shape == (layers,)
    assert (exact.token_shrinkage <= 0.5).all()  # routing fixed by the token
    assert (random.token_shrinkage >= 64).all()  # routing independent of the token
    assert exact.fit_info["token_shrinkage"] == exact.token_shrinkage.tolist()
    off = fit_predictor(exact_trace[0], FitConfig(token_reliability=False)).predictor
    assert off.token_shrinkage is None
    # Saved in the manifest; a bad value there is refused in one line.
    out = random.save(tmp_path / "pred")
    np.testing.assert_array_equal(Predictor.load(out).token_shrinkage, random.token_shrinkage)
    manifest = json.loads((out / MANIFEST).read_text())
    for bad in ([1.0], "x", [-1.0] * layers):
        (out / MANIFEST).write_text(json.dumps(manifest | {"token_shrinkage": bad}))
        with pytest.raises(SchemaError, match="token_shrinkage"):
            Predictor.load(out)
    # A version-3 predictor (no shrinkage) still loads, uncalibrated.
    old = {k: v for k, v in manifest.items() if k != "token_shrinkage"} | {"format_version": 3}
    (out / MANIFEST).write_text(json.dumps(old))
    assert Predictor.load(out).token_shrinkage is None


def test_deep_models_count_fold_b_at_eight_layers(synth_dir):
    assert sampled_layers(6).tolist() == list(range(6))
    assert sampled_layers(58).tolist() == [0, 8, 16, 24, 33, 41, 49, 57]
    spread = spread_to_layers(np.array([1.0, 2.0, 3.0]), np.array([0, 4, 8]), 9)
    assert spread.tolist() == [1, 1, 1, 2, 2, 2, 2, 3, 3]  # ties go to the lower layer
    path, _ = synth_trace(synth_dir, "deep", num_layers=12, affinity=1.0, layer_correlation=0.0)
    fitted = fit_predictor(path, FitConfig()).predictor
    assert fitted.token_shrinkage.shape == (12,) and (fitted.token_shrinkage <= 0.5).all()


def test_the_shrinkage_folds_halve_the_fitting_requests() -> None:
    """The folds were drawn over every request of the trace: with --holdout 0.9 on FLAME-MoE
    (32 requests, 3 fitting), seed 15 put all 3 fitting requests in one fold, no token was
    in both, and every layer got m = 0 (full trust in each token's own routing) where the
    neighbouring seeds estimate m = 32-4096."""
    config = FitConfig(holdout=0.9, seed=15, progress=False)
    result = fit_predictor(require(FLAME_TRACE), config)
    assert (np.asarray(result.predictor.token_shrinkage) > 0).any()

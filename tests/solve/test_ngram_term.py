"""The n-gram term: layers solved in order, each placement also chosen for its n-gram table."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from planner.cli.main import main
from planner.errors import InputError
from planner.predict.fit import FitConfig, fit_predictor
from planner.predict.ngram import ngram_context_affinity
from planner.predict.reliability import discounted_share, unseen_share
from planner.solve import ngram_term
from planner.solve.ngram_term import UNPLACED_FROM, NgramTerm
from planner.solve.pipeline import PlanConfig, layer_problems, make_plan, unplaced_share
from planner.trace.synth import SynthConfig, synthesize

# Routing that follows the previous layer's experts (layer_correlation), which an n-gram
# table can learn, plus token affinity.
SYNTH = SynthConfig(
    num_layers=4, num_experts=8, top_k=2, vocab_size=400, num_tokens=4000, num_requests=40,
    affinity=0.5, layer_correlation=0.6, expert_zipf=0.0, num_domains=2, seed=11,
)  # fmt: skip


@pytest.fixture(scope="module")
def predictor(tmp_path_factory):
    d = tmp_path_factory.mktemp("ngram_term")
    return fit_predictor(synthesize(SYNTH, d / "trace"), FitConfig()).predictor


def ngram_fit_rate(predictor, plan) -> float:
    """Local share of the n-gram table's predictions on the fitting data, layers >= n."""
    local = total = 0.0
    for layer in range(plan.ngram_order, plan.expert_to_device.shape[0]):
        rows = ngram_context_affinity(
            predictor.transitions, plan.expert_to_device, layer, plan.ep_size, plan.ngram_order
        )
        per_device = rows.toarray() @ np.eye(plan.ep_size)[plan.expert_to_device[layer]]
        local += per_device.max(axis=1).sum()
        total += per_device.sum()
    return local / total


def test_runs_are_fixed_contiguous_and_short():
    term = NgramTerm.__new__(NgramTerm)  # runs() reads no field
    assert [len(r) for r in term.runs(58)] == [15, 15, 14, 14]
    assert term.runs(6) == [list(range(6))]
    assert sum(term.runs(100), []) == list(range(100))
    assert max(len(r) for r in term.runs(100)) <= ngram_term.RUN_LAYERS


def test_extend_appends_load_free_context_rows(predictor):
    problems = layer_problems(predictor, 4)
    placed = np.zeros((4, 8), np.int64)
    placed[0], placed[1] = np.arange(8) % 4, np.arange(8) // 2
    term = NgramTerm(predictor.transitions, order=2, weight=0.5)
    p = problems[2]
    ext = term.extend(p, 2, placed, run_start=0)
    rows = ngram_context_affinity(predictor.transitions, placed, 2, 4, 2).toarray()
    rows = rows[rows.sum(axis=1) > 0]
    assert ext.num_tokens == p.num_tokens + rows.shape[0] and rows.shape[0] <= 16
    np.testing.assert_allclose(ext.affinity[p.num_tokens :].toarray(), 0.5 * rows)
    assert (ext.token_freq[p.num_tokens :] == 0).all()
    assert ext.capacity == pytest.approx(p.capacity)
    # no full context inside the run: the problem itself
    assert term.extend(p, 2, placed, run_start=1) is p
    assert term.extend(problems[1], 1, placed, run_start=0) is problems[1]
    with pytest.raises(InputError, match="weight"):
        NgramTerm(predictor.transitions, order=2, weight=0.0)


def test_layer_weight_follows_token_reliability(predictor):
    plain = NgramTerm(predictor.transitions, order=2, weight=0.5)
    assert plain.layer_weight(2, 100.0, 100.0) == 0.5  # no shrinkage known: the weight
    term = NgramTerm(predictor.transitions, order=2, weight=0.5, unreliable=(0, 0, 1.0, 0.5))
    assert term.layer_weight(1, 100.0, 100.0) == 0.5  # u = 0: tokens carry over
    assert term.layer_weight(2, 100.0, 100.0) == pytest.approx(1.0)  # u = 1, routed: 2w
    assert term.layer_weight(2, 400.0, 100.0) == pytest.approx(2.0)  # top-1 rows, k = 4
    assert term.layer_weight(3, 100.0, 100.0) == pytest.approx(0.75)  # halfway
    assert term.layer_weight(2, 100.0, 0.0) == 0.5
    # extend() scales the context rows by the layer's factor
    problems = layer_problems(predictor, 4)
    placed = np.zeros((4, 8), np.int64)
    placed[0], placed[1] = np.arange(8) % 4, np.arange(8) // 2
    p = problems[2]
    base = plain.extend(p, 2, placed, run_start=0).affinity[p.num_tokens :].toarray()
    ctx = base.sum() / 0.5
    expect = term.layer_weight(2, float(p.token_activations.sum()), ctx) / 0.5
    scaled = term.extend(p, 2, placed, run_start=0).affinity[p.num_tokens :].toarray()
    np.testing.assert_allclose(scaled, expect * base)
    assert expect > 1.9


def test_context_rows_take_the_ngram_tables_share_of_the_batches(predictor):
    problems = layer_problems(predictor, 4)
    p = problems[2]
    assert p.batch_freq is not None
    placed = np.zeros((4, 8), np.int64)
    placed[0], placed[1] = np.arange(8) % 4, np.arange(8) // 2
    j = p.num_tokens
    top1 = ngram_context_affinity(predictor.transitions, placed, 2, 4, 2, "top1").toarray()
    occ = top1[top1.sum(axis=1) > 0].sum(axis=1)  # tokens seen per context
    # u = 0.75: the n-gram table makes about 3 in 4 of the runtime's choices at layer 2
    term = NgramTerm(predictor.transitions, order=2, weight=0.5, unreliable=(0, 0, 0.75, 0))
    ext = term.extend(p, 2, placed, run_start=0)
    np.testing.assert_allclose(ext.occurrences[j:], occ)
    np.testing.assert_array_equal(ext.occurrences[:j], p.token_freq)
    assert occ.sum() == pytest.approx(p.total_freq)  # every fitting token has a context
    b, b0 = ext.batch_freq.toarray(), p.batch_freq.toarray()
    np.testing.assert_allclose(b[:j], 0.25 * b0)
    sizes = b0.sum(axis=0) / p.total_freq
    np.testing.assert_allclose(b[j:], 0.75 * np.outer(occ, sizes))
    np.testing.assert_allclose(b.sum(axis=0), b0.sum(axis=0))  # same batches, same caps
    assert (ext.token_freq[j:] == 0).all()
    # where the token table makes most choices (or no shrinkage is known) the batches stay
    # the token rows'
    for unreliable in (None, (0, 0, 0.25, 0)):
        term = NgramTerm(predictor.transitions, order=2, weight=0.5, unreliable=unreliable)
        kept = term.extend(p, 2, placed, 0)
        np.testing.assert_allclose(kept.batch_freq.toarray(), np.vstack([b0, 0 * b[j:]]))
        np.testing.assert_allclose(kept.occurrences[j:], occ)
    # tokens the token table cannot place (unseen, no neighbour) go by the n-gram table
    # whatever u says: their share of the batches goes to the contexts, from UNPLACED_FROM
    for unreliable, unplaced, share in (
        (None, 0.2, 0.2), ((0, 0, 0.25, 0), 0.2, 0.2), ((0, 0, 0.75, 0), 0.2, 0.75),
        ((0, 0, 0.75, 0), 0.9, 0.9), (None, UNPLACED_FROM, UNPLACED_FROM),
        ((0, 0, 0.25, 0), 0.09, 0.0), ((0, 0, 0.75, 0), 0.09, 0.75),
    ):  # fmt: skip
        term = NgramTerm(
            predictor.transitions, order=2, weight=0.5, unreliable=unreliable,
            unplaced=(0.0, 0.0, unplaced, 0.0),
        )  # fmt: skip
        assert term.batch_share(2) == share and term.batch_share(3) == 0.0
        b = term.extend(p, 2, placed, 0).batch_freq.toarray()
        np.testing.assert_allclose(b[:j], (1 - share) * b0)
        np.testing.assert_allclose(b[j:], share * np.outer(occ, sizes))
    with pytest.raises(InputError, match="unplaced"):
        NgramTerm(predictor.transitions, order=2, unplaced=(0.0, 1.5, 0.0, 0.0))
    for bad in (-0.1, 1.5, float("nan")):  # such shares were used as given
        with pytest.raises(InputError, match="unreliable"):
            NgramTerm(predictor.transitions, order=2, unreliable=(0.0, bad, 0.0, 0.0))


def test_plans_weigh_the_term_by_the_predictors_shrinkage(predictor, monkeypatch):
    seen, unplaced = [], []
    original = NgramTerm.extend

    def spy(self, problem, layer, placed, run_start):
        seen.append(self.unreliable)
        unplaced.append(self.unplaced)
        return original(self, problem, layer, placed, run_start)

    monkeypatch.setattr(NgramTerm, "extend", spy)
    plan = make_plan(predictor, PlanConfig("vanilla", ep_size=4), progress=False)
    assert seen and len(seen[0]) == 4 and all(0 <= u <= 1 for u in seen[0])
    assert plan.config["ngram_unreliable"] == pytest.approx(seen[0], abs=1e-4)
    problems = layer_problems(predictor, 4)
    assert seen[0][3] == pytest.approx(
        discounted_share(problems[3].token_freq, float(predictor.token_shrinkage[3]))
    )
    # no embeddings: every unseen token is left to the n-gram table, at the Good-Turing share
    share = unseen_share(problems[0].token_freq)
    assert 0 < share < 1 and unplaced[0] == pytest.approx((share,) * 4)
    assert plan.config["ngram_unplaced"] == pytest.approx(unplaced[0], abs=1e-4)


def test_term_raises_the_ngram_tables_fit_and_reports_on_token_rows(predictor):
    alone = make_plan(predictor, PlanConfig("ceo", ep_size=4, ngram_weight=0), progress=False)
    joint = make_plan(predictor, PlanConfig("ceo", ep_size=4), progress=False)
    assert ngram_fit_rate(predictor, joint) > ngram_fit_rate(predictor, alone) + 0.01
    for layer, report in enumerate(joint.reports):
        assert ("ngram_term" in report["info"]) == (layer >= 2)
        assert 0 < report["local_rate"] <= 1 and report["token_imbalance"] <= 1.1 + 1e-6
    info = joint.reports[3]["info"]["ngram_term"]
    assert 0 < info["contexts"] <= 16 and 0 < info["local_rate"] <= 1
    assert joint.token_to_device.shape == alone.token_to_device.shape == (4, 400)
    assert joint.config["ngram_weight"] == ngram_term.DEFAULT_WEIGHT


def test_plan_does_not_depend_on_jobs_with_several_runs(predictor, monkeypatch):
    monkeypatch.setattr(ngram_term, "RUN_LAYERS", 2)  # runs [0, 1], [2, 3]
    config = PlanConfig("kmeans", ep_size=4, ngram_order=1, seed=2)
    a = make_plan(predictor, config, progress=False)
    b = make_plan(predictor, PlanConfig(**(config.__dict__ | {"jobs": 2})), progress=False)
    np.testing.assert_array_equal(a.expert_to_device, b.expert_to_device)
    np.testing.assert_array_equal(a.token_to_device, b.token_to_device)
    # layer 2 starts the second run: no placed predecessor, no term; layers 1 and 3 have one
    assert ["ngram_term" in r["info"] for r in a.reports] == [False, True, False, True]


@pytest.mark.parametrize("weight", ["-1", "nan", "1e308"])
def test_bad_weight_is_one_line_error(predictor, tmp_path, capsys, weight: str):
    """1e308 was taken: the weighted context rows overflowed, numpy warned on stderr and,
    after the first layers were solved, a later layer's 'affinity holds non-finite values'."""
    with pytest.raises(InputError, match="ngram_weight"):
        PlanConfig(ngram_weight=float(weight))
    predictor.save(tmp_path / "pred")
    args = ["solve", str(tmp_path / "pred"), "--ep", "4", "--out", str(tmp_path / "plan")]
    assert main([*args, "--ngram-weight", weight]) == 2
    err = capsys.readouterr().err
    assert err.startswith("moeplan: error: ngram_weight=") and err.count("\n") == 1
    assert not (tmp_path / "plan").exists()


def test_unplaced_share_counts_only_tokens_no_neighbour_places(predictor):
    problems = layer_problems(predictor, 4)
    share = unseen_share(problems[0].token_freq)
    assert unplaced_share(predictor, problems) == pytest.approx((share,) * 4)
    lent = copy.deepcopy(predictor)  # input embeddings lend unseen tokens a known neighbour
    aff = lent.affinity
    unseen = np.flatnonzero(~aff.seen_)
    aff.nearest_known_[unseen] = np.flatnonzero(aff.seen_)[0]
    assert unplaced_share(lent, problems) == (0.0,) * 4
    aff.nearest_known_[unseen[: unseen.size // 4]] = -1  # a quarter with no neighbour
    got = unplaced_share(lent, problems)
    assert got == pytest.approx((share * (unseen.size // 4) / unseen.size,) * 4)

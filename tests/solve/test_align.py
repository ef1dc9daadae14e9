"""Aligning a new plan's device labels to a deployed plan (planner.solve.align)."""

from __future__ import annotations

import dataclasses
import itertools
import json

import numpy as np
import pytest

from planner.cli.main import main
from planner.errors import MismatchError
from planner.evaluate import evaluate_bundle
from planner.export import bundle_from_plan
from planner.predict.fit import FitConfig, fit_predictor
from planner.predict.split import split_trace
from planner.solve.align import (
    align_plan,
    device_maps,
    experts_moved,
    relabel,
    relabel_ngram,
)
from planner.solve.pipeline import PlanConfig, make_plan
from planner.solve.plan import Plan
from planner.trace import open_trace
from planner.trace.synth import SynthConfig, synthesize

SYNTH = SynthConfig(
    num_layers=4, num_experts=8, top_k=2, vocab_size=300, num_tokens=5000, num_requests=50,
    affinity=0.8, layer_correlation=0.5, num_domains=2, seed=3,
)  # fmt: skip


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    d = tmp_path_factory.mktemp("align")
    trace = synthesize(SYNTH, d / "trace")
    split_trace(trace, d / "fit", d / "held", 0.5, seed=0)
    predictor = fit_predictor(d / "fit", FitConfig()).predictor
    deployed = make_plan(predictor, PlanConfig("kmeans", ep_size=4, seed=1), progress=False)
    fresh = make_plan(predictor, PlanConfig("ceo", ep_size=4, seed=2), progress=False)
    return d, deployed, fresh


def relabelled(plan, sigma):
    """``plan`` with every layer's devices renamed by ``sigma`` [L, E] (a test's own copy of
    the transformation, built row by row from the context definition)."""
    e, n = plan.ep_size, plan.ngram_order
    big_l = plan.expert_to_device.shape[0]
    dev = np.zeros_like(plan.ngram_to_device)
    conf = np.zeros_like(plan.ngram_confidence)
    for layer in range(big_l):
        for row in range(e**n):
            digits = [(row // e ** (n - 1 - j)) % e for j in range(n)]
            if layer >= n:
                new_row = 0
                for j, c in enumerate(digits):
                    new_row = new_row * e + int(sigma[layer - n + j][c])
            else:
                new_row = row
            dev[layer, new_row] = sigma[layer][plan.ngram_to_device[layer, row]]
            conf[layer, new_row] = plan.ngram_confidence[layer, row]
    rows = np.arange(big_l)[:, None]
    return dataclasses.replace(
        plan,
        expert_to_device=sigma[rows, plan.expert_to_device.astype(np.int64)],
        token_to_device=sigma[rows, plan.token_to_device.astype(np.int64)],
        ngram_to_device=dev,
        ngram_confidence=conf,
    )


def test_a_relabelled_plan_aligns_back_to_itself_exactly(plans):
    _, deployed, _ = plans
    rng = np.random.default_rng(0)
    sigma = np.stack([rng.permutation(4) for _ in range(4)])
    shuffled = relabelled(deployed, sigma)
    assert experts_moved(shuffled.expert_to_device, deployed.expert_to_device).sum() > 0
    back = align_plan(shuffled, deployed.expert_to_device, deployed.fingerprint)
    for name in ("expert_to_device", "token_to_device", "ngram_to_device", "ngram_confidence"):
        np.testing.assert_array_equal(getattr(back, name), getattr(deployed, name), err_msg=name)
    assert back.config["aligned"]["experts_moved"] == 0
    assert all(r["experts_moved"] == 0 for r in back.reports)


def test_relabel_ngram_matches_the_row_by_row_definition():
    rng = np.random.default_rng(1)
    e, n, big_l = 3, 2, 4
    table = rng.random((big_l, e**n))
    sigma = np.stack([rng.permutation(e) for _ in range(big_l)])
    got = relabel_ngram(table, sigma, n)
    for layer in range(n, big_l):
        for row in range(e**n):
            a, b = row // e, row % e
            assert got[layer, sigma[layer - 2][a] * e + sigma[layer - 1][b]] == table[layer, row]
    np.testing.assert_array_equal(got[:n], table[:n])


def test_aligned_plan_scores_the_same_and_moves_fewer_experts(plans):
    d, deployed, fresh = plans
    aligned = align_plan(fresh, deployed.expert_to_device, deployed.fingerprint)
    before = experts_moved(fresh.expert_to_device, deployed.expert_to_device)
    after = experts_moved(aligned.expert_to_device, deployed.expert_to_device)
    assert (after <= before).all() and after.sum() < before.sum()
    assert aligned.config["aligned"] == {
        "experts_moved": int(after.sum()),
        "experts_moved_unaligned": int(before.sum()),
        "experts": 32,
    }
    assert [r["experts_moved"] for r in aligned.reports] == after.tolist()
    held = open_trace(d / "held")
    a = evaluate_bundle(bundle_from_plan(fresh), held)["overall"]
    b = evaluate_bundle(bundle_from_plan(aligned), held)["overall"]
    for key in ("lar", "lar_token", "lar_ngram", "token_imbalance", "expert_load_imbalance"):
        assert b[key] == pytest.approx(a[key], abs=1e-12), key
    # the runtime cap's overflow breaks ties between devices by id: close, not always equal
    assert b["lar_balanced"] == pytest.approx(a["lar_balanced"], abs=2e-3)


def test_alignment_is_optimal_per_layer():
    rng = np.random.default_rng(2)
    x = np.stack([rng.permutation(np.repeat(np.arange(4), 3)) for _ in range(5)])
    ref = np.stack([rng.permutation(np.repeat(np.arange(4), 3)) for _ in range(5)])
    sigma = device_maps(x, ref, 4)
    best = experts_moved(relabel(x, sigma), ref)
    for layer in range(5):
        brute = min(
            int((np.array(p)[x[layer]] != ref[layer]).sum())
            for p in itertools.permutations(range(4))
        )
        assert best[layer] == brute


def test_a_reference_of_another_model_or_ep_size_is_refused(plans):
    _, deployed, fresh = plans
    with pytest.raises(MismatchError, match="fingerprint"):
        align_plan(fresh, deployed.expert_to_device, "another-model")
    with pytest.raises(MismatchError, match="shape"):
        align_plan(fresh, deployed.expert_to_device[:2], deployed.fingerprint)
    ep2 = np.tile(np.arange(8) % 2, (4, 1))  # a placement of EP 2: devices 0-1 only
    with pytest.raises(MismatchError, match="EP 4"):
        align_plan(fresh, ep2, deployed.fingerprint)
    with pytest.raises(MismatchError, match="EP 4"):  # a device id no placement has
        align_plan(fresh, deployed.expert_to_device - 1, deployed.fingerprint)


def test_cli_solve_align_to_a_plan_or_bundle(plans, tmp_path, capsys):
    d, _, _ = plans
    pred, old, bundle = tmp_path / "pred", tmp_path / "old", tmp_path / "bundle"
    assert main(["fit", str(d / "fit"), "--out", str(pred), "--json"]) == 0
    solve = ["solve", str(pred), "--ep", "4", "--method", "kmeans"]
    assert main([*solve, "--seed", "1", "--out", str(old)]) == 0
    assert main(["export", str(old), "--out", str(bundle)]) == 0
    capsys.readouterr()
    new = tmp_path / "new"
    assert main([*solve, "--seed", "5", "--out", str(new), "--align-to", str(bundle)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    aligned = Plan.load(new).config["aligned"]
    assert f"{aligned['experts_moved']} of 32 experts change device" in out
    moved = experts_moved(Plan.load(new).expert_to_device, Plan.load(old).expert_to_device)
    assert moved.sum() == aligned["experts_moved"] <= aligned["experts_moved_unaligned"]
    args = [*solve, "--out", str(tmp_path / "x"), "--json", "--align-to", str(old)]
    assert main(args) == 0
    assert json.loads(capsys.readouterr().out)["aligned"]["experts"] == 32
    for align_to, out_dir, message in (
        (bundle, tmp_path / "bad", "is a plan of EP 4, not 2"),
        (tmp_path, tmp_path / "bad", "neither a plan"),
        (old, old, "reads its input"),
    ):
        ep = "2" if "EP 4" in message else "4"
        args = ["solve", str(pred), "--ep", ep, "--out", str(out_dir), "--align-to", str(align_to)]
        assert main(args) == 2
        assert message in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()
    other = synthesize(dataclasses.replace(SYNTH, model="other"), tmp_path / "o")
    assert main(["fit", str(other), "--out", str(tmp_path / "opred"), "--json"]) == 0
    capsys.readouterr()
    args = ["solve", str(tmp_path / "opred"), "--ep", "4", "--out", str(tmp_path / "bad")]
    assert main([*args, "--align-to", str(bundle)]) == 2
    assert "fingerprints differ" in capsys.readouterr().err

"""predictor -> plan -> bundle -> held-out metrics, and the CLI commands that chain them."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from planner.cli.main import main
from planner.errors import InputError, MismatchError
from planner.evaluate import evaluate_bundle
from planner.evaluate.compare import compare_methods, unseen_tokens
from planner.export import bundle_from_plan, load_tables
from planner.predict.fit import FitConfig, fit_predictor
from planner.predict.reliability import unseen_share
from planner.predict.split import RequestSplit, split_trace, split_trace_by_domain
from planner.solve.pipeline import PlanConfig, make_plan
from planner.solve.plan import Plan
from planner.solve.problem import SolverConfig
from planner.trace import TraceBatch, open_trace, write_trace
from planner.trace.synth import SynthConfig, synthesize

# Strong planted affinity: a good plan keeps most activations local.
SYNTH = SynthConfig(
    num_layers=3, num_experts=8, top_k=2, vocab_size=300, num_tokens=6000, num_requests=60,
    affinity=0.9, layer_correlation=0.3, expert_zipf=0.0, num_domains=2, seed=5,
)  # fmt: skip


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    d = tmp_path_factory.mktemp("pipeline")
    trace = synthesize(SYNTH, d / "trace")
    summary = split_trace(trace, d / "fit", d / "held", 0.5, seed=0)
    predictor = fit_predictor(d / "fit", FitConfig()).predictor
    return d, trace, summary, predictor


def test_split_is_by_request_and_matches_fit_holdout(pipeline):
    d, trace, summary, _ = pipeline
    fit_ids = set(open_trace(d / "fit").request_ids().tolist())
    held_ids = set(open_trace(d / "held").request_ids().tolist())
    assert not fit_ids & held_ids and len(fit_ids | held_ids) == 60
    assert summary["fit_tokens"] + summary["heldout_tokens"] == open_trace(trace).num_rows
    # `fit --holdout 0.5 --seed 0` holds out exactly the same requests.
    same = RequestSplit.make(open_trace(trace).request_ids(), 0.5, 0)
    assert set(same.heldout_ids.tolist()) == held_ids


def test_plan_covers_the_vocabulary_and_beats_vanilla(pipeline, tmp_path):
    d, _, _, predictor = pipeline
    plan = make_plan(predictor, PlanConfig("ceo", ep_size=4), progress=False)
    assert plan.token_to_device.shape == (3, 300) and plan.ngram_order == 2
    assert plan.ngram_to_device.shape == (3, 16)
    plan.save(tmp_path / "plan")
    again = Plan.load(tmp_path / "plan")
    np.testing.assert_array_equal(again.expert_to_device, plan.expert_to_device)
    bundle = load_tables(tmp_path / "plan")
    assert bundle == bundle_from_plan(plan)
    ov = evaluate_bundle(bundle, open_trace(d / "held"))["overall"]
    assert ov["lar_balanced"] > 1.8 * ov["lar_vanilla"]
    assert ov["lar_balanced"] <= ov["oracle_bound"] + 1e-9
    assert ov["token_imbalance_balanced"] <= 1.1 + 4 / 4096 + 1e-9


def test_same_seed_same_plan_any_jobs(pipeline, monkeypatch):
    """Layers solved apart (no n-gram term: with it the 3 layers are one run, solved in this
    process whatever jobs says) reach the worker pool with jobs=2."""
    from planner.solve import plan as plan_module

    _, _, _, predictor = pipeline
    used, pool = [], plan_module._worker_pool
    monkeypatch.setattr(plan_module, "_worker_pool", lambda n: (used.append(n), pool(n))[1])
    config = PlanConfig("kmeans", ep_size=4, seed=1, ngram_weight=0.0)
    a = make_plan(predictor, config, progress=False)
    assert used == []
    b = make_plan(predictor, dataclasses.replace(config, jobs=2), progress=False)
    assert used == [2]
    np.testing.assert_array_equal(a.expert_to_device, b.expert_to_device)
    np.testing.assert_array_equal(a.token_to_device, b.token_to_device)


def test_compare_rows_and_ratios(pipeline):
    d, _, _, predictor = pipeline
    fitting = open_trace(d / "fit")
    result = compare_methods(
        predictor,
        open_trace(d / "held"),
        ["ceo", "metis", "vanilla"],
        PlanConfig(ep_size=4),
        fitting=fitting,
    )
    rows = {r["method"]: r for r in result["rows"]}
    # The same plans scored on the requests they were fitted on (vanilla is deterministic).
    vanilla = make_plan(predictor, PlanConfig("vanilla", ep_size=4), progress=False)
    on_fit = evaluate_bundle(bundle_from_plan(vanilla), fitting)["overall"]["lar_balanced"]
    assert rows["vanilla"]["lar_balanced_fitting"] == pytest.approx(on_fit)
    assert rows["ceo"]["lar_balanced_fitting"] > rows["vanilla"]["lar_balanced_fitting"]
    alone = compare_methods(predictor, open_trace(d / "held"), ["vanilla"], PlanConfig(ep_size=4))
    assert "lar_balanced_fitting" not in alone["rows"][0]
    assert result["best_baseline"] == "metis"
    assert rows["metis"]["ratio_to_best_baseline"] == 1.0
    assert rows["ceo"]["lar_balanced"] > rows["vanilla"]["lar_balanced"]
    for r in rows.values():
        assert r["gap_to_bound"] == pytest.approx(
            result["oracle_bound"] - r["lar_balanced"], abs=1e-6
        )
    # Paired bootstrap over the held-out requests: none for the best baseline itself; an
    # interval around the point ratio for the others.
    assert result["requests"] == len(open_trace(d / "held").request_ids())
    assert rows["metis"]["ratio_ci90"] is None
    for name in ("ceo", "vanilla"):
        low, high = rows[name]["ratio_ci90"]
        assert low <= rows[name]["ratio_to_best_baseline"] <= high
    assert rows["vanilla"]["ratio_ci90"][1] < 1  # vanilla is worse on every resample


def test_unseen_tokens_flags_traffic_unlike_the_fitting_trace(pipeline, tmp_path, capsys):
    d, trace, _, predictor = pipeline
    seen = predictor.affinity.seen_
    expected = unseen_share(predictor.affinity.token_counts_[seen])
    # by request: a few new tokens, about as many as the fitting counts predict
    held = open_trace(d / "held").read_all().token_id
    by_request = unseen_tokens(predictor, open_trace(d / "held"))
    assert by_request["heldout"] == pytest.approx(float(np.mean(~seen[held])), abs=1e-4)
    assert by_request["expected"] == pytest.approx(expected, abs=1e-4)
    assert 0 < by_request["heldout"] < 0.05 and not by_request["shifted"]
    assert unseen_tokens(predictor, open_trace(d / "fit"))["heldout"] == 0.0
    # a whole domain held out: its own tokens were never seen, and the trace is flagged
    split_trace_by_domain(trace, tmp_path / "fit", tmp_path / "held", ["0"])
    other = fit_predictor(tmp_path / "fit", FitConfig()).predictor
    shifted = unseen_tokens(other, open_trace(tmp_path / "held"))
    assert shifted["heldout"] > 0.2 > 0.05 > shifted["expected"] and shifted["shifted"]
    result = compare_methods(
        other, open_trace(tmp_path / "held"), ["vanilla"], PlanConfig(ep_size=4)
    )
    assert result["unseen_tokens"] == shifted
    # the CLI says so under the table, in one note
    other.save(tmp_path / "pred")
    capsys.readouterr()
    args = ["compare", str(tmp_path / "pred"), str(tmp_path / "held"), "--ep", "4"]
    assert main([*args, "--methods", "vanilla"]) == 0
    assert "tokens the predictor never saw" in capsys.readouterr().err
    # no known token ids on one side: nothing to measure, no claim either way
    batch = open_trace(d / "held").read_all()
    unknown = TraceBatch.from_arrays(
        batch.request_id, batch.position, np.full(len(batch), -1), batch.experts, batch.weights
    )
    write_trace(tmp_path / "unk", open_trace(d / "held").meta, unknown)
    blind = unseen_tokens(predictor, open_trace(tmp_path / "unk"))
    assert blind["heldout"] is None and not blind["shifted"]
    fitted_blind = fit_predictor(tmp_path / "unk", FitConfig()).predictor
    blind = unseen_tokens(fitted_blind, open_trace(d / "held"))
    assert blind == {"heldout": 1.0, "expected": None, "shifted": False}


def test_errors(pipeline):
    d, _, _, predictor = pipeline
    with pytest.raises(InputError, match="must divide the 8 experts"):
        make_plan(predictor, PlanConfig(ep_size=3), progress=False)
    with pytest.raises(InputError, match="unknown solver"):
        PlanConfig(method="magic")
    other = synthesize(SynthConfig(**(SYNTH.__dict__ | {"model": "other"})), d / "other.parquet")
    with pytest.raises(MismatchError):
        compare_methods(predictor, open_trace(other), ["vanilla"], PlanConfig(ep_size=4))


def test_plan_config_numpy_numbers_reach_plan_json_and_bools_are_refused(pipeline, tmp_path):
    """A numpy ep_size was refused as 'does not divide' by the Plan, other numpy numbers
    passed, then plan.json failed with a JSON TypeError traceback; a bool was taken as 1."""
    _, _, _, predictor = pipeline
    config = PlanConfig(
        "ceo", ep_size=np.int64(4), seed=np.uint64(1), jobs=np.int32(1), beta=np.float32(1.1),
        time_limit=np.float64(30), ngram_order=np.int64(2), ngram_weight=np.float32(0.5),
        chain_passes=np.int64(1), ngram_defer=np.bool_(True), expert_beta=np.float32(2),
    )  # fmt: skip
    make_plan(predictor, config, progress=False).save(tmp_path / "plan")
    saved = Plan.load(tmp_path / "plan")
    assert saved.ep_size == 4 and saved.config["chain_passes"] == 1
    for name in ("ep_size", "jobs", "ngram_order", "chain_passes", "beta", "ngram_weight"):
        with pytest.raises(InputError, match=f"{name}=True"):
            PlanConfig(**{name: True})
    with pytest.raises(InputError, match="time_limit=True"):
        SolverConfig(time_limit=True)


def test_cli_chain(pipeline, tmp_path, capsys):
    d, _, _, _ = pipeline
    pred, plan, bundle = tmp_path / "pred", tmp_path / "plan", tmp_path / "bundle"
    assert main(["fit", str(d / "fit"), "--out", str(pred), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["fit"]["batches"]["order"] == "trace"
    mixed = ["fit", str(d / "fit"), "--out", str(tmp_path / "mixed"), "--mixed-batches"]
    assert main([*mixed, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["fit"]["batches"]["order"] == "mixed"
    assert (
        main(["solve", str(pred), "--ep", "2", "--method", "metis", "--out", str(plan), "--json"])
        == 0
    )
    reports = json.loads(capsys.readouterr().out)["reports"]
    assert len(reports) == 3 and all(r["method"] == "metis" for r in reports)
    assert Plan.load(plan).config["batch_prices"] is False
    priced = tmp_path / "priced"
    args = ["solve", str(pred), "--ep", "2", "--method", "metis", "--out", str(priced)]
    assert main([*args, "--batch-prices", "--json"]) == 0
    capsys.readouterr()
    assert Plan.load(priced).config["batch_prices"] is True
    vanilla = ["solve", str(pred), "--ep", "2", "--method", "vanilla", "--batch-prices"]
    assert main([*vanilla, "--out", str(tmp_path / "v")]) == 2
    assert "--batch-prices does not apply to --method vanilla" in capsys.readouterr().err
    np.testing.assert_array_equal(
        Plan.load(priced).expert_to_device, Plan.load(plan).expert_to_device
    )
    assert main(["export", str(plan), "--out", str(bundle), "--format", "moeplan,sglang"]) == 0
    assert main(["evaluate", str(bundle), str(d / "held"), "--json"]) == 0
    capsys.readouterr()
    assert (
        main(
            [
                "compare",
                str(pred),
                str(d / "held"),
                "--ep",
                "2",
                "--methods",
                "vanilla,kmeans,vanilla",  # a method named twice runs once
                "--json",
            ]
        )
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    assert [r["method"] for r in out["rows"]] == ["vanilla", "kmeans"]
    held, fit = str(d / "held"), str(d / "fit")
    args = ["compare", str(pred), held, "--ep", "2", "--methods", "kmeans", "--fitting", fit]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "fit. bal." in out and "relabelling" not in out
    # at one expert a device the caption says that only the token tables differ
    assert main(["compare", str(pred), held, "--ep", "8", "--methods", "ceo,vanilla"]) == 0
    assert "relabelling" in " ".join(capsys.readouterr().out.split())
    other = synthesize(SynthConfig(**(SYNTH.__dict__ | {"model": "other"})), tmp_path / "o")
    assert main(args[:-1] + [str(other)]) == 2
    assert "fitting trace" in capsys.readouterr().err
    assert main(["solve", str(pred), "--ep", "3", "--out", str(tmp_path / "bad")]) == 2
    assert "must divide" in capsys.readouterr().err
    for options, message in (
        ('{"cheo": {}}', "--options names no solver 'cheo'"),
        (
            '{"ceo": {"samples": "x"}}',
            "ceo: samples='x' must be an integer in [1, 2**31 - 1] or null",
        ),
        ("[1]", "--options must be a JSON object"),
    ):
        args = ["solve", str(pred), "--ep", "2", "--out", str(tmp_path / "bad"), "--options"]
        assert main([*args, options]) == 2
        assert message in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()
    assert main(["compare", str(pred), held, "--ep", "2", "--batch-tokens", "-1"]) == 2
    assert "batch_tokens=-1 must be an integer in [1, 2**40]" in capsys.readouterr().err


def test_token_confidence_is_calibrated_by_the_predictor_shrinkage(pipeline):
    """m = 0 keeps the solver's local shares; a huge m leaves each seen token its device's
    share of the layer's routed load; devices and experts do not change."""
    import dataclasses

    _, _, _, predictor = pipeline
    cfg = PlanConfig("kmeans", ep_size=4, ngram_weight=0.0)
    layers = predictor.meta.num_layers
    trusted = dataclasses.replace(predictor, token_shrinkage=np.zeros(layers))
    doubted = dataclasses.replace(predictor, token_shrinkage=np.full(layers, 1e9))
    raw = make_plan(dataclasses.replace(predictor, token_shrinkage=None), cfg, progress=False)
    full = make_plan(trusted, cfg, progress=False)
    none = make_plan(doubted, cfg, progress=False)
    np.testing.assert_array_equal(raw.token_confidence, full.token_confidence)
    np.testing.assert_array_equal(raw.token_to_device, none.token_to_device)
    seen = predictor.affinity.seen_
    for layer in range(layers):
        load = predictor.affinity.load_[layer].astype(float)
        share = np.bincount(raw.expert_to_device[layer], weights=load, minlength=4) / load.sum()
        expect = share[raw.token_to_device[layer][seen]]
        np.testing.assert_allclose(none.token_confidence[layer][seen], expect, atol=2e-3)
    assert (
        none.config["token_shrinkage"] == [1e9] * layers and raw.config["token_shrinkage"] is None
    )


def test_ngram_table_defers_to_reliable_tokens(pipeline, tmp_path, capsys):
    """ngram_defer weighs each layer's n-gram confidences by u (at least MIN_NGRAM_SCALE) and
    changes nothing else; without token shrinkage there is nothing to weigh by."""
    import dataclasses

    from planner.predict.reliability import discounted_share
    from planner.solve.pipeline import MIN_NGRAM_SCALE, layer_problems

    _, _, _, predictor = pipeline
    cfg = PlanConfig("kmeans", ep_size=4)
    defer = make_plan(predictor, cfg, progress=False)
    paper = make_plan(predictor, dataclasses.replace(cfg, ngram_defer=False), progress=False)
    for name in ("expert_to_device", "token_to_device", "token_confidence", "ngram_to_device"):
        np.testing.assert_array_equal(getattr(defer, name), getattr(paper, name))
    u = [
        discounted_share(p.token_freq, float(m))
        for p, m in zip(layer_problems(predictor, 4), predictor.token_shrinkage, strict=True)
    ]
    assert defer.config["ngram_unreliable"] == [round(x, 4) for x in u]
    scale = np.maximum(u, MIN_NGRAM_SCALE)[:, None]
    expect = (paper.ngram_confidence.astype(np.float64) * scale).astype(np.float16)
    np.testing.assert_array_equal(defer.ngram_confidence, expect)
    assert paper.ngram_confidence[2].max() > 0 and (scale < 1).all()
    assert (defer.ngram_confidence[2] < paper.ngram_confidence[2]).any()
    # every token trusted (u = 0): the n-gram table keeps a small positive confidence, so it
    # still decides for tokens whose token-table confidence is 0
    trusted = dataclasses.replace(predictor, token_shrinkage=np.zeros(3))
    low = make_plan(trusted, cfg, progress=False).ngram_confidence
    full = make_plan(trusted, dataclasses.replace(cfg, ngram_defer=False), progress=False)
    full_conf = full.ngram_confidence.astype(np.float64)
    assert ((low > 0) == (full_conf > 0)).all() and (full_conf[2:] > 0).any()
    np.testing.assert_allclose(low, full_conf * MIN_NGRAM_SCALE, rtol=2e-3)
    # no shrinkage fitted: the fitted table as it is
    raw = make_plan(dataclasses.replace(predictor, token_shrinkage=None), cfg, progress=False)
    np.testing.assert_array_equal(raw.ngram_confidence, paper.ngram_confidence)
    # the CLI switch
    d, _, _, _ = pipeline
    pred = tmp_path / "pred"
    assert main(["fit", str(d / "fit"), "--out", str(pred), "--json"]) == 0
    for flag, on in (("--ngram-defer", True), ("--no-ngram-defer", False)):
        out = tmp_path / f"plan{on}"
        args = ["solve", str(pred), "--ep", "4", "--method", "kmeans", "--out", str(out)]
        assert main([*args, flag, "--json"]) == 0
        assert Plan.load(out).config["ngram_defer"] is on
    capsys.readouterr()


def test_outputs_never_replace_inputs_or_other_directories(pipeline, tmp_path, capsys):
    """solve/export/fit/split refuse an --out that is their input, holds it, or is a
    directory of something else; a file never replaces a directory. Nothing is touched."""
    d, _, _, _ = pipeline
    pred, plan, mine = tmp_path / "pred", tmp_path / "plan", tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    assert main(["fit", str(d / "fit"), "--out", str(pred)]) == 0
    assert main(["solve", str(pred), "--ep", "2", "--method", "vanilla", "--out", str(plan)]) == 0
    capsys.readouterr()
    refused = [
        (["solve", str(pred), "--ep", "2", "--out", str(pred)], "reads its input"),
        (["solve", str(pred), "--ep", "2", "--out", str(tmp_path)], "reads its input"),
        (["solve", str(pred), "--ep", "2", "--out", str(mine)], "not a plan"),
        (["solve", str(pred), "--ep", "2", "--out", str(mine / "notes.txt")], "is a file"),
        (["export", str(plan), "--out", str(plan)], "reads its input"),
        (["export", str(plan), "--out", str(pred)], "not a moeplan bundle"),
        (["export", str(plan), "--out", str(plan), "--format", "sglang"], "reads its input"),
        (["export", str(plan), "--out", str(plan / "plan.json"), "--format", "sglang"],
         "reads its input"),
        (["export", str(plan), "--out", str(mine), "--format", "sglang"], "is a directory"),
        (["fit", str(d / "fit"), "--out", str(d / "fit")], "reads its input"),
        (["fit", str(d / "fit"), "--out", str(plan)], "not a predictor"),
        (["trace", "split", str(d / "fit"), "--fit-out", str(d / "fit"), "--heldout-out",
          str(tmp_path / "h")], "reads its input"),
        (["trace", "split", str(d / "fit"), "--fit-out", str(tmp_path / "f"), "--heldout-out",
          str(tmp_path / "f")], "give two paths"),
        (["trace", "split", str(d / "fit"), "--fit-out", str(tmp_path / "f"), "--heldout-out",
          str(tmp_path / "f" / "h")], "are nested"),
        (["trace", "split", str(d / "fit"), "--fit-out", str(tmp_path / "f" / "g"),
          "--heldout-out", str(tmp_path / "f")], "are nested"),
        (["trace", "split", str(d / "fit"), "--fit-out", str(mine), "--heldout-out",
          str(tmp_path / "h")], "not a trace"),
    ]  # fmt: skip
    before = {p: sorted(x.name for x in p.iterdir()) for p in (pred, plan, mine, d / "fit")}
    for args, message in refused:
        assert main(args) == 2, args
        assert message in capsys.readouterr().err, args
    assert {p: sorted(x.name for x in p.iterdir()) for p in before} == before
    assert (mine / "notes.txt").read_text() == "keep"
    assert not (tmp_path / "f").exists() and not (tmp_path / "h").exists()
    # an earlier output of the same kind is still replaced
    assert main(["solve", str(pred), "--ep", "2", "--method", "kmeans", "--out", str(plan)]) == 0


def test_an_output_inside_its_input_is_refused(pipeline, tmp_path, capsys):
    """`solve PRED --out PRED/plan` was allowed, and a later `fit --out PRED` (an earlier
    predictor, so replaced) deleted the plan with it; so for every directory artifact."""
    d, _, _, _ = pipeline
    pred, plan = tmp_path / "pred", tmp_path / "plan"
    assert main(["fit", str(d / "fit"), "--out", str(pred)]) == 0
    assert main(["solve", str(pred), "--ep", "2", "--method", "vanilla", "--out", str(plan)]) == 0
    capsys.readouterr()
    before = {p: sorted(x.name for x in p.iterdir()) for p in (pred, plan, d / "fit")}
    for args in (
        ["solve", str(pred), "--ep", "2", "--method", "vanilla", "--out", str(pred / "plan")],
        ["export", str(plan), "--out", str(plan / "bundle")],
        ["fit", str(d / "fit"), "--out", str(d / "fit" / "pred")],
        ["trace", "split", str(d / "fit"), "--fit-out", str(d / "fit" / "f"),
         "--heldout-out", str(tmp_path / "h")],
    ):  # fmt: skip
        assert main(args) == 2, args
        err = capsys.readouterr().err.strip()
        assert err.startswith("moeplan: error:") and "reads its input" in err, args
        assert "\n" not in err
    assert {p: sorted(x.name for x in p.iterdir()) for p in before} == before
    assert not (tmp_path / "h").exists()


def test_a_trace_of_unknown_tokens_plans_with_every_method(pipeline, tmp_path, capsys):
    """Every token id -1 (a tokenizer the trace did not record): no token rows to place, but
    the n-gram tables still fit. Every method then gives the default deployment, no error."""
    d, path, _, _ = pipeline
    trace = open_trace(path)
    batch = trace.read_all()
    unknown = TraceBatch.from_arrays(
        batch.request_id, batch.position, np.full(len(batch), -1), batch.experts, batch.weights
    )
    write_trace(tmp_path / "unk", trace.meta, unknown)
    assert main(["fit", str(tmp_path / "unk"), "--out", str(tmp_path / "pred")]) == 0
    for method in ("ceo", "metis", "kmeans", "alternating", "ilp", "vanilla"):
        out = tmp_path / f"plan-{method}"
        args = ["solve", str(tmp_path / "pred"), "--ep", "2", "--method", method]
        assert main([*args, "--out", str(out), "--jobs", "1", "--json"]) == 0, method
        reports = Plan.load(out).reports
        assert all(r["method"] == method for r in reports)
        assert "no token load" in reports[0]["info"]["degenerate"]
    capsys.readouterr()
    assert main(["evaluate", str(tmp_path / "plan-ceo"), str(tmp_path / "unk"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["overall"]["lar"] > 0


def test_fit_refuses_a_counts_table_of_zeros(tmp_path, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq

    meta = {"schema": "counts", "schema_version": 1, "num_layers": 1, "num_experts": 4,
            "top_k": 1, "vocab_size": 10}  # fmt: skip
    table = pa.table({
        "layer": pa.array([0, 0], pa.int16()), "token_id": pa.array([1, 2], pa.int32()),
        "expert": pa.array([0, 3], pa.int16()), "count": pa.array([0, 0], pa.int64()),
    }).replace_schema_metadata({b"moeplan": json.dumps(meta).encode()})  # fmt: skip
    pq.write_table(table, tmp_path / "zeros.parquet")
    assert main(["fit", str(tmp_path / "zeros.parquet"), "--out", str(tmp_path / "p")]) == 2
    assert "no routed activations to fit on" in capsys.readouterr().err
    assert not (tmp_path / "p").exists()


def test_evaluate_edges_huge_hidden_size_and_an_empty_trace(pipeline, tmp_path, capsys):
    d, path, _, _ = pipeline
    plan = tmp_path / "plan"
    assert main(["fit", str(d / "fit"), "--out", str(tmp_path / "pred")]) == 0
    assert main(["solve", str(tmp_path / "pred"), "--ep", "2", "--method", "vanilla",
                 "--out", str(plan)]) == 0  # fmt: skip
    capsys.readouterr()
    hidden = 2**31  # the largest taken; bytes in Python ints, exact
    args = ["evaluate", str(plan), str(d / "held"), "--json", "--dtype-bytes", "2"]
    assert main([*args, "--hidden-size", str(hidden)]) == 0
    overall = json.loads(capsys.readouterr().out)["overall"]
    assert overall["all_to_all_bytes"] == overall["remote_activations"] * hidden * 2 * 2
    # a size past it is one line (a 300-digit one overflowed the table's float: a traceback)
    assert main([*args[:-3], "--hidden-size", "1" + "0" * 310]) == 2
    assert "must be an integer in [0, 2**31]" in capsys.readouterr().err
    meta = open_trace(path).meta
    empty = TraceBatch.from_arrays([], [], [], np.zeros((0, meta.num_layers, meta.top_k)),
                                   np.zeros((0, meta.num_layers, meta.top_k)))  # fmt: skip
    write_trace(tmp_path / "empty", meta, empty)
    png = tmp_path / "e.png"
    # an empty held-out trace is refused in one line (as compare does), no plot drawn
    assert main(["evaluate", str(plan), str(tmp_path / "empty"), "--plot", str(png)]) == 2
    assert "holds no tokens" in capsys.readouterr().err and not png.exists()


def test_batch_prices_keep_the_placement_and_other_traces_score_every_plan(pipeline, tmp_path):
    """``PlanConfig.batch_prices`` re-assigns tokens only (the experts stay where the method
    put them) and is recorded; ``compare_methods(also=...)`` scores every plan on more traces."""
    d, _, _, predictor = pipeline
    off = make_plan(predictor, PlanConfig("kmeans", ep_size=4, seed=1), progress=False)
    on = make_plan(
        predictor, PlanConfig("kmeans", ep_size=4, seed=1, batch_prices=True), progress=False
    )
    np.testing.assert_array_equal(on.expert_to_device, off.expert_to_device)
    assert on.config["batch_prices"] is True and off.config["batch_prices"] is False
    with pytest.raises(InputError, match="batch_prices=1"):
        PlanConfig(batch_prices=1)
    held = open_trace(d / "held")
    result = compare_methods(
        predictor, held, ["kmeans", "vanilla"], PlanConfig(ep_size=4), also={"again": held}
    )
    for row in result["rows"]:
        assert row["lar_balanced_again"] == pytest.approx(row["lar_balanced"])


def test_compare_mixed_scores_the_held_out_requests_shuffled(pipeline, tmp_path, capsys):
    """`compare --mixed` scores every plan on the held-out requests in the order
    `trace shuffle --seed S` writes them (S = --seed), in batches of --batch-tokens."""
    from planner.predict.split import shuffle_requests

    d, _, _, predictor = pipeline
    pred = tmp_path / "pred"
    predictor.save(pred)
    held = str(d / "held")
    args = ["compare", str(pred), held, "--ep", "4", "--methods", "kmeans,vanilla"]
    args += ["--batch-tokens", "256", "--seed", "2"]
    assert main([*args, "--mixed", "--json"]) == 0
    rows = {r["method"]: r for r in json.loads(capsys.readouterr().out)["rows"]}
    shuffle_requests(held, tmp_path / "mixed", seed=2)
    from planner.evaluate import EvalConfig

    config = dataclasses.replace(PlanConfig("kmeans", ep_size=4), seed=2)
    bundle = bundle_from_plan(make_plan(predictor, config, progress=False))
    by_256 = EvalConfig(batch_tokens=256)
    mixed = evaluate_bundle(bundle, open_trace(tmp_path / "mixed"), by_256)["overall"]
    in_order = evaluate_bundle(bundle, open_trace(held), by_256)["overall"]
    assert rows["kmeans"]["lar_balanced_mixed"] == pytest.approx(mixed["lar_balanced"])
    assert rows["kmeans"]["lar_balanced"] == pytest.approx(in_order["lar_balanced"])
    # the held-out trace serves its two domains apart; mixed, the cap binds less
    assert mixed["lar_balanced"] != pytest.approx(in_order["lar_balanced"])
    assert main([*args, "--mixed"]) == 0
    assert "bal. mixed" in capsys.readouterr().out
    assert main(args) == 0
    assert "bal. mixed" not in capsys.readouterr().out
    other = synthesize(SynthConfig(**(SYNTH.__dict__ | {"model": "other"})), tmp_path / "o")
    bad = ["compare", str(pred), str(other), "--ep", "4", "--methods", "vanilla", "--mixed"]
    assert main(bad) == 2
    err = capsys.readouterr().err
    assert err.startswith("moeplan: error:") and "held-out trace" in err and err.count("\n") == 1


def test_compare_says_when_another_plan_is_best_served_mixed(capsys):
    from planner.cli.solve import MIXED_NOTE_MARGIN, _note_mixed_winner

    def rows(mixed_b: float) -> list[dict]:
        return [
            {"method": "ceo", "lar_balanced": 0.46, "lar_balanced_mixed": 0.50},
            {"method": "kmeans", "lar_balanced": 0.45, "lar_balanced_mixed": mixed_b},
            {"method": "vanilla", "lar_balanced": 0.30, "lar_balanced_mixed": 0.90},
        ]

    _note_mixed_winner(rows(0.50 * (1 + MIXED_NOTE_MARGIN / 2)))  # within the noise
    assert capsys.readouterr().err == ""
    _note_mixed_winner(rows(0.52))
    err = " ".join(capsys.readouterr().err.split())
    assert "served mixed the best plan is kmeans's (0.520 against ceo's 0.500)" in err
    assert "--mixed-batches" in err
    _note_mixed_winner(rows(0.52)[1:])  # one solved plan: nothing to choose between
    assert capsys.readouterr().err == ""

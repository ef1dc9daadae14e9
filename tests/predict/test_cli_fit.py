"""``moeplan fit`` end to end: traces, counts tables, JSON output and one-line errors."""

from __future__ import annotations

import json

import numpy as np
import pytest

from planner.cli.main import main
from planner.predict.predictor import Predictor
from planner.trace import TraceMeta
from tests.conftest import FLAME_TRACE, OLMOE_COUNTS, require
from tests.predict.conftest import chain_batch, twin_trace, write_batch


def run_json(capsys, args) -> dict:
    capsys.readouterr()
    assert main(args) == 0
    return json.loads(capsys.readouterr().out)


def test_fit_trace_json_and_table(exact_trace, tmp_path, capsys):
    path, _ = exact_trace
    out = tmp_path / "pred"
    data = run_json(capsys, ["fit", str(path), "--out", str(out), "--holdout", "0.5", "--json"])
    assert data["report"]["table"]["seen"]["precision"]["overall"] == 1.0
    assert data["fit"]["split"]["kind"] == "request"
    assert Predictor.load(out).report == data["report"]
    args = [
        "fit",
        str(path),
        "--out",
        str(out),
        "--holdout",
        "0.5",
        "--neural",
        "--neural-budget",
        "1",
    ]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "held-out token->expert prediction" in text and "predictor saved to" in text
    assert "NN P" in text and "neural" in text and "µs/token" in text
    assert "token shrinkage m per layer 0 0 0 0" in " ".join(text.split())  # wrapped
    # Without a hold-out: no report.
    data = run_json(capsys, ["fit", str(path), "--out", str(out), "--json"])
    assert data["report"] is None


def test_the_neural_predictor_is_the_same_for_the_same_seed(exact_trace, tmp_path, capsys):
    # Its budget is steps, not seconds: two runs (on a machine of any speed) give one predictor.
    path, _ = exact_trace
    args = ["fit", str(path), "--holdout", "0.5", "--neural", "--neural-steps", "40", "--json"]
    first = run_json(capsys, [*args, "--out", str(tmp_path / "a")])
    second = run_json(capsys, [*args, "--out", str(tmp_path / "b")])
    train = first["report"]["neural"]["train"]
    assert train["steps"] == 40 and train["stopped_by"] == "steps"
    a, b = (Predictor.load(tmp_path / d).neural.to_tensors() for d in "ab")
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    assert first["report"]["neural"]["all"] == second["report"]["neural"]["all"]
    # A clock budget that stops it early says so.
    main([*args[:-1], "--neural-steps", "100000", "--neural-budget", "0.2",
          "--out", str(tmp_path / "c")])  # fmt: skip
    text = " ".join(capsys.readouterr().out.split())
    assert "stopped by --neural-budget" in text


def test_embeddings_next_to_the_trace_are_used(tmp_path, capsys):
    trace_dir = twin_trace(tmp_path / "trace")
    args = ["fit", str(trace_dir), "--out", str(tmp_path / "p"), "--holdout", "0.5", "--json"]
    data = run_json(capsys, args)
    assert data["fit"]["embeddings"].endswith("embeddings.safetensors")
    report = data["report"]
    assert report["fallback"] == "embedding" and report["unseen_share"]["overall"] == 1.0
    assert report["table"]["unseen"]["precision"]["overall"] == 1.0
    assert report["unseen_with_global_fallback"]["precision"]["overall"] < 0.5
    report = run_json(capsys, [*args, "--no-embeddings"])["report"]
    assert report["fallback"] == "global" and report["unseen_with_global_fallback"] is None


def test_a_split_carries_the_embeddings_to_both_sides(tmp_path, capsys):
    # `trace split` then `fit` on a side: the side has the model's embeddings as the trace did
    trace_dir = twin_trace(tmp_path / "trace")
    fit_side, held_side = tmp_path / "fit", tmp_path / "held"
    assert main(["trace", "split", str(trace_dir), "--fit-out", str(fit_side),
                 "--heldout-out", str(held_side)]) == 0  # fmt: skip
    source = (trace_dir / "embeddings.safetensors").read_bytes()
    for side in (fit_side, held_side):
        assert (side / "embeddings.safetensors").read_bytes() == source
    data = run_json(capsys, ["fit", str(fit_side), "--out", str(tmp_path / "p"), "--json"])
    assert data["fit"]["embeddings"] == str(fit_side / "embeddings.safetensors")


@pytest.mark.parametrize(
    "args, message",
    [
        (["--holdout", "1.5"], "strictly between 0 and 1"),
        (["--holdout", "0"], "strictly between 0 and 1"),
        (["--embeddings", "EMB"], "disagrees with the vocabulary"),
        (["--domain", "arxiv"], "apply to counts tables only"),
        (["--holdout", "0.5", "--ep-size", "0"], "ep_size=0 must be a positive integer"),
        (["--holdout", "0.5", "--ngram-order", "9"], "ngram_order=9 must be 1, 2 or 3"),
        # these changed nothing without a report (fit --ep-size 3 of 8 experts passed silently)
        (["--ep-size", "3"], "--ep-size set the held-out report's n-gram figure; add --holdout"),
        (
            ["--ep-size", "4", "--ngram-order", "1"],
            "--ep-size and --ngram-order set the held-out report's n-gram figure; add --holdout",
        ),
        # these were ignored without --neural
        (
            ["--neural-steps", "40"],
            "--neural-steps set the neural predictor's training; add --neural",
        ),
        (["--neural-budget", "1"], "--neural-budget set the neural predictor's training; add"),
    ],
)
def test_one_line_errors(exact_trace, tmp_path, capsys, args, message):
    path, _ = exact_trace
    np.save(tmp_path / "emb.npy", np.zeros((3, 4), np.float32))
    args = [a.replace("EMB", str(tmp_path / "emb.npy")) for a in args]
    capsys.readouterr()
    assert main(["fit", str(path), "--out", str(tmp_path / "p"), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("moeplan: error:") and message in err and "\n" not in err


def test_inputs_and_outputs_that_are_not_what_they_should_be(exact_trace, tmp_path, capsys):
    path, _ = exact_trace
    (tmp_path / "junk.parquet").write_text("not parquet")
    (tmp_path / "file").write_text("x")
    for args, message in [
        ([str(tmp_path / "junk.parquet"), "--out", str(tmp_path / "p")], "not a Parquet file"),
        ([str(tmp_path / "missing"), "--out", str(tmp_path / "p")], "no such"),
        ([str(path), "--out", str(tmp_path / "file")], "is a file"),
    ]:
        capsys.readouterr()
        assert main(["fit", *args]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1


def test_real_flame_trace(tmp_path, capsys):
    path = require(FLAME_TRACE)
    data = run_json(
        capsys, ["fit", str(path), "--out", str(tmp_path / "p"), "--holdout", "0.8", "--json"]
    )
    report = data["report"]
    assert report["split"]["heldout_requests"] == 26  # 0.8 of 32 requests
    assert report["layers"] == [2, 3, 4, 5, 6, 7, 8, 9]
    assert 0.0 < report["unseen_share"]["overall"] < 1.0
    assert report["ngram"]["top1_device_accuracy"]["overall"] > 0.125  # above chance on 8 devices
    # Real prefill routing: a token's identity says little beyond the layer average, so
    # the token confidences are shrunk hard (m >= 32 occurrences at every layer; the
    # folds halve the 6 fitting requests, so the estimate is coarse: 32-4096 a layer).
    assert min(data["fit"]["token_shrinkage"]) >= 32


def test_real_counts_thinning_and_cross_domain(tmp_path, capsys):
    path = require(OLMOE_COUNTS)
    base = ["fit", str(path), "--model", "Mixtral", "--json"]
    thin = run_json(capsys, [*base, "--out", str(tmp_path / "a"), "--holdout", "0.5"])["report"]
    assert thin["split"]["kind"] == "thinning"
    assert thin["table"]["all"]["top1"] is None and thin["ngram"]["available"] is False
    p = thin["table"]["all"]["precision"]["overall"]
    assert 2 / 8 < p <= 1.0  # better than chance for top-2 of 8
    cross = run_json(
        capsys,
        [*base, "--out", str(tmp_path / "b"), "--domain", "arxiv", "--eval-domain", "github"],
    )["report"]
    assert cross["split"] == {
        "kind": "domain",
        "fit_domains": ["arxiv"],
        "eval_domains": ["github"],
    }
    assert cross["unseen_share"]["overall"] > thin["unseen_share"]["overall"]
    capsys.readouterr()
    assert (
        main([*base, "--out", str(tmp_path / "c"), "--domain", "arxiv", "--eval-domain", "arxiv"])
        == 2
    )


def test_a_top_k_larger_than_the_models_is_refused(tmp_path, capsys):
    """Mixtral routes top-2; `--top-k 4` went through: every token's occurrences halved and
    its predicted top-4 filled with experts the model never chose. Real counts of top-k
    routing never count an expert more often than its token occurred."""
    path = require(OLMOE_COUNTS)
    base = ["fit", str(path), "--model", "Mixtral", "--domain", "arxiv"]
    capsys.readouterr()
    assert main([*base, "--top-k", "4", "--out", str(tmp_path / "p")]) == 2
    err = capsys.readouterr().err.strip()
    assert "is --top-k 4 the model's?" in err and "\n" not in err
    assert not (tmp_path / "p").exists()
    assert main([*base, "--top-k", "2", "--out", str(tmp_path / "q")]) == 0


def test_a_config_files_holdout_stands_down_for_eval_domain(tmp_path, capsys):
    # the example's [fit] table sets holdout = 0.5; a cross-domain fit with it still runs,
    # while --holdout typed beside --eval-domain is still refused
    path = require(OLMOE_COUNTS)
    cfg = tmp_path / "moeplan.toml"
    cfg.write_text("[fit]\nholdout = 0.5\nseed = 0\n")
    base = ["fit", str(path), "--model", "Mixtral", "--domain", "arxiv", "--eval-domain", "github"]
    report = run_json(capsys, ["--config", str(cfg), *base, "--out", str(tmp_path / "a"), "--json"])
    assert report["report"]["split"]["kind"] == "domain"
    capsys.readouterr()
    assert main([*base, "--out", str(tmp_path / "b"), "--holdout", "0.5"]) == 2
    assert "choose either --holdout" in capsys.readouterr().err
    assert not (tmp_path / "b").exists()
    assert main([*base, "--out", str(tmp_path / "c"), "--mixed-batches"]) == 2
    assert "a counts table has no batches to mix" in capsys.readouterr().err
    assert not (tmp_path / "c").exists()


def test_a_config_files_eval_domain_stands_down_for_a_typed_holdout(tmp_path, capsys):
    # the command line wins over the file the other way round too
    path = require(OLMOE_COUNTS)
    cfg = tmp_path / "moeplan.toml"
    cfg.write_text('[fit]\neval-domain = "github"\n')
    args = ["--config", str(cfg), "fit", str(path), "--model", "Mixtral", "--holdout", "0.5"]
    report = run_json(capsys, [*args, "--out", str(tmp_path / "a"), "--json"])
    assert report["report"]["split"]["kind"] == "thinning"


def test_a_vocabulary_too_large_for_memory_is_refused_before_the_pass(tmp_path, capsys):
    """vocab_size 2**31 (the schema's largest) had fit killed for memory, without a word."""
    meta = TraceMeta("test/huge-vocab", num_layers=32, num_experts=8, top_k=8, vocab_size=2**31)
    tokens = np.array([0, 5, 2**31 - 1])
    path = write_batch(tmp_path / "t.parquet", meta, chain_batch(meta, tokens, np.zeros(3)))
    assert main(["fit", str(path), "--out", str(tmp_path / "p")]) == 2
    err = capsys.readouterr().err.strip()
    assert "vocab_size=2147483648 needs at least" in err and "\n" not in err
    assert not (tmp_path / "p").exists()


def test_a_counts_table_vocabulary_too_large_for_memory_is_refused(tmp_path, capsys):
    """The same for a counts table (--vocab-size 2**31): its [V+1] row pointers per layer were
    built while the rows were read, and fit was killed for memory."""
    path = require(OLMOE_COUNTS)
    args = ["fit", str(path), "--model", "OLMoE", "--vocab-size", str(2**31)]
    assert main([*args, "--out", str(tmp_path / "p")]) == 2
    err = capsys.readouterr().err.strip()
    assert f"{path}: vocab_size=2147483648 needs at least" in err and "\n" not in err
    assert not (tmp_path / "p").exists()


def test_neural_on_unknown_tokens_only_says_why(tmp_path, capsys):
    """It said 'no token occurrences to train on' of a trace with 40 of them, all id -1."""
    meta = TraceMeta("test/unknown", num_layers=2, num_experts=8, top_k=2, vocab_size=50)
    batch = chain_batch(meta, np.full(40, -1), np.arange(40) // 10)
    path = write_batch(tmp_path / "t.parquet", meta, batch)
    assert main(["fit", str(path), "--out", str(tmp_path / "p"), "--neural"]) == 2
    err = capsys.readouterr().err.strip()
    assert "no occurrence of a known token" in err and "\n" not in err


def test_fit_reads_a_wide_model_in_smaller_chunks_and_fits_the_same(tmp_path, batch_rows_asked):
    """A fixed 65536-row chunk made fit's peak follow the model's width (a Qwen3-30B-shaped
    trace of 60k tokens, 48 layers x top-8: 1.53 GB, 1.19 GB in chunks of
    ``batch_rows_for``); the predictor is the same whatever the chunk."""
    from planner.predict.fit import FitConfig, fit_predictor
    from planner.trace.io import batch_rows_for
    from planner.trace.synth import SynthConfig, synthesize

    trace = synthesize(
        SynthConfig(num_layers=48, num_experts=16, top_k=8, vocab_size=500, num_tokens=3000,
                    num_requests=30, seed=2),
        tmp_path / "wide",
    )  # fmt: skip
    auto = fit_predictor(trace, FitConfig(holdout=0.5)).predictor
    wide = batch_rows_for(auto.meta)
    assert wide < 65536 and set(batch_rows_asked[-2:]) == {wide}  # the fitting pass and the scoring
    fixed = fit_predictor(trace, FitConfig(holdout=0.5, batch_rows=700)).predictor
    for name, table in auto.affinity.to_tensors().items():
        np.testing.assert_array_equal(table, fixed.affinity.to_tensors()[name], err_msg=name)


def _small_counts(path, rows: int, drop: str | None = None) -> str:
    """A counts table in the OLMoE export's layout (no moeplan metadata) of Mixtral's shape
    (top-2: each token's two rows count two distinct experts once), ``rows`` rows."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    token = np.arange(rows) // 2
    expert = np.random.default_rng(0).integers(0, 8, rows) // 2 * 2 + np.arange(rows) % 2
    table = pa.table({
        "model": pa.array(["Mixtral-8x7B"] * rows).dictionary_encode(),
        "domain": pa.array(np.where(token % 2, "book", "arxiv")).dictionary_encode(),
        "layer": pa.array(np.zeros(rows, np.int16)),
        "token_id": pa.array(token.astype(np.int32)),
        "expert": pa.array(expert.astype(np.int16)),
        "count": pa.array(np.ones(rows, np.int32)),
    })  # fmt: skip
    if drop:
        table = table.drop_columns([drop])
    pq.write_table(table, path)
    return str(path)


@pytest.mark.parametrize(
    "rows, drop, args, message",
    [
        # it said the table held "counts of several models ()"
        (0, None, [], "the counts table holds no rows"),
        # it said "not a v1 trace (no 'moeplan' metadata in the Parquet schema)"
        (40, "count", [], "a token-expert counts table lacks column(s) count"),
        # blank filters read every domain or every model
        (40, None, ["--domain", ","], "--domain ',' names no domain"),
        (40, None, ["--domain", "arxiv", "--eval-domain", " "], "--eval-domain ' ' names no"),
        (40, None, ["--model", ""], "--model is empty; name the model to read"),
    ],
)
def test_counts_tables_that_say_nothing_are_named(tmp_path, capsys, rows, drop, args, message):
    path = _small_counts(tmp_path / "c.parquet", rows, drop)
    capsys.readouterr()
    assert main(["fit", path, "--out", str(tmp_path / "p"), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("moeplan: error:") and message in err and "\n" not in err
    assert not (tmp_path / "p").exists()
    if not drop and rows:  # the same table with real filters fits
        args = ["--domain", "arxiv", "--eval-domain", "book"]
        assert main(["fit", path, "--out", str(tmp_path / "q"), *args]) == 0

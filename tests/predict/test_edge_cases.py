"""Edge cases and bad input of ``moeplan fit`` and the predictor: clear one-line errors, no
tracebacks, nothing of the user's lost, no silently wrong numbers."""

from __future__ import annotations

import io
import json
import shutil
import warnings

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from rich.console import Console
from safetensors.numpy import load_file, save_file

from planner._io import sha256_file
from planner.cli.main import main
from planner.errors import InputError, MismatchError, SchemaError
from planner.predict.affinity import TokenExpertAffinity, load_embeddings
from planner.predict.batches import BatchMix, BatchMixAccumulator
from planner.predict.counts import write_counts_table
from planner.predict.distribution import DistributionPredictor
from planner.predict.fit import FitConfig, fit_predictor
from planner.predict.metrics import distribution_summary
from planner.predict.neural import NeuralConfig
from planner.predict.ngram import (
    TopOneTransitions,
    contiguous_placement,
    fit_ngram_device_table,
    ngram_context_affinity,
)
from planner.predict.predictor import MANIFEST, REPORT, Predictor, load_predictor
from planner.predict.report import render_report
from planner.predict.split import RequestSplit, thin_counts
from planner.trace.io import open_trace
from tests.predict.conftest import random_counts, synth_trace


@pytest.fixture(scope="module")
def saved(exact_trace, tmp_path_factory):
    """A predictor directory with every part (report, transitions, batches, neural)."""
    path, _ = exact_trace
    cfg = FitConfig(holdout=0.3, neural=True, neural_config=NeuralConfig(max_steps=5))
    out = tmp_path_factory.mktemp("edge") / "pred"
    fit_predictor(path, cfg).predictor.save(out)
    return out


def _copy(saved, tmp_path):
    return shutil.copytree(saved, tmp_path / "pred")


def _edit_manifest(pred, edit) -> None:
    manifest = json.loads((pred / MANIFEST).read_text())
    edit(manifest)
    (pred / MANIFEST).write_text(json.dumps(manifest))


def _edit_tensors(pred, name: str, edit) -> None:
    """Rewrite ``name`` with ``edit`` applied and its checksum updated (a consistent edit)."""
    tensors = dict(load_file(str(pred / name)))
    edit(tensors)
    save_file(tensors, str(pred / name))
    _edit_manifest(pred, lambda m: m["files"][name].update(sha256=sha256_file(pred / name)))


def _fails_one_line(capsys, args: list[str], message: str) -> None:
    capsys.readouterr()
    assert main(args) == 2
    err = capsys.readouterr().err.strip()  # (a progress bar may leave a blank line first)
    assert err.startswith("moeplan: error:") and message in err and "\n" not in err, err


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda m: m.update(files=["affinity.safetensors"]), "'files' must map the names"),
        (lambda m: m["files"].update({"affinity.safetensors": "abc"}), "'files' must map"),
        (lambda m: m.update(affinity=[1]), "'affinity' must be a JSON object"),
        (lambda m: m.update(distribution="x"), "'distribution' must be a JSON object"),
        (lambda m: m["affinity"].update(confident_threshold="abc"), "'abc' is not a number"),
        (lambda m: m["affinity"].update(confident_threshold=None), "None is not a number"),
        (lambda m: m["distribution"].update(momentum="fast"), r"momentum 'fast' must lie in"),
    ],
    ids=[
        "files-list", "files-entry", "affinity-list", "distribution-str",
        "threshold-str", "threshold-null", "momentum-str",
    ],
)  # fmt: skip
def test_manifest_sections_of_the_wrong_type_are_refused(saved, tmp_path, edit, message):
    # Before: AttributeError / TypeError / ValueError tracebacks, or a bad momentum kept.
    pred = _copy(saved, tmp_path)
    _edit_manifest(pred, edit)
    with pytest.raises(SchemaError, match=message):
        load_predictor(pred)


def test_manifest_files_outside_the_directory_are_refused(saved, tmp_path):
    # Before: a listed "../x" with its right checksum was read from outside the predictor.
    pred = _copy(saved, tmp_path)
    (tmp_path / "x").write_text("x")
    _edit_manifest(
        pred, lambda m: m["files"].update({"../x": {"sha256": sha256_file(tmp_path / "x")}})
    )
    with pytest.raises(SchemaError, match="files"):
        load_predictor(pred)


def test_a_report_that_is_not_json_is_refused(saved, tmp_path):
    pred = _copy(saved, tmp_path)
    (pred / REPORT).write_text("{not json")
    _edit_manifest(pred, lambda m: m["files"][REPORT].update(sha256=sha256_file(pred / REPORT)))
    with pytest.raises(SchemaError, match="not valid JSON"):
        load_predictor(pred)


def test_neural_predictor_of_another_shape_or_dtype_is_refused(saved, tmp_path):
    # Before: top_k 9 of 8 experts loaded and failed at prediction time (RuntimeError), and
    # float64 features loaded and failed in the first matmul.
    pred = _copy(saved, tmp_path)
    _edit_manifest(pred, lambda m: m["neural"].update(top_k=m["model"]["num_experts"] + 1))
    with pytest.raises(MismatchError, match="neural"):
        load_predictor(pred)
    shutil.rmtree(pred)
    pred = _copy(saved, tmp_path)
    _edit_tensors(
        pred,
        "neural.safetensors",
        lambda t: t.update(features=t["features"].astype(np.float64)),
    )
    with pytest.raises(SchemaError, match="float32"):
        load_predictor(pred)


def test_token_shrinkage_must_hold_numbers(saved, tmp_path):
    pred = _copy(saved, tmp_path)
    _edit_manifest(pred, lambda m: m.update(token_shrinkage=["1"] * len(m["token_shrinkage"])))
    with pytest.raises(SchemaError, match="token_shrinkage"):
        load_predictor(pred)


@pytest.mark.parametrize(
    "name, edit, message",
    [
        ("affinity.safetensors", lambda t: t.update(data=np.full(t["data"].shape, np.nan)),
         "affinity data holds float64, expected integers"),
        ("affinity.safetensors", lambda t: t.update(data=t["data"] + 0.5),
         "affinity data holds float64, expected integers"),
        ("distribution.safetensors", lambda t: t.update(batches=np.zeros(0, np.int64)),
         "batches must be one non-negative integer"),
        ("distribution.safetensors", lambda t: t.update(probabilities=3 * t["probabilities"]),
         "probabilities must sum to 1"),
        ("distribution.safetensors", lambda t: t.update(load=-t["load"]),
         "load must hold non-negative integer counts"),
        ("batches.safetensors", lambda t: t.update(indices=t["indices"] + 10**6),
         r"indices must be < \d+"),
        ("batches.safetensors", lambda t: t.update(indices=t["indices"] - 10**6),
         "indices must be >= 0"),
        # the routed expert of every tuple -1: read as the last expert by numpy indexing
        ("transitions.safetensors", lambda t: t["keys"].__setitem__((slice(None), 3), -1),
         "negative routed expert"),
        # a context expert -1 at the last layer, which has previous layers
        ("transitions.safetensors", lambda t: t["keys"].__setitem__((-1, 2), -1),
         "expert -1 where the layer has a previous layer"),
    ],
    ids=[
        "affinity-nan", "affinity-fraction", "distribution-batches", "distribution-sum",
        "distribution-negative", "batches-index-high", "batches-index-negative",
        "transitions-routed", "transitions-context",
    ],
)  # fmt: skip
def test_tensors_edited_consistently_are_refused(saved, tmp_path, name, edit, message):
    # Before: ValueError/IndexError tracebacks, silently wrong tables, or (batch mix with an
    # index out of range) a segmentation fault at the first use of the loaded predictor.
    pred = _copy(saved, tmp_path)
    _edit_tensors(pred, name, edit)
    with pytest.raises(SchemaError, match=message):
        Predictor.load(pred)


def test_batch_mix_indices_are_checked_on_load():
    mix = BatchMixAccumulator(vocab_size=5, batch_tokens=2)
    mix.add(np.array([0, 1, 4, 4]))
    tensors = mix.result().to_tensors()
    tensors["indices"] = tensors["indices"] + 7
    with pytest.raises(SchemaError, match="malformed"):
        BatchMix.from_tensors(tensors, 5)


@pytest.mark.parametrize("batch_tokens", [0, -3])
def test_batch_accumulator_refuses_a_non_positive_batch(batch_tokens):
    # Before: accepted, and the first add() never returned.
    with pytest.raises(InputError, match="batch_tokens"):
        BatchMixAccumulator(vocab_size=5, batch_tokens=batch_tokens)


def test_negative_seeds_are_one_line_errors(exact_trace, tmp_path, capsys):
    # Before: numpy's ValueError traceback ("expected non-negative integer") for a split,
    # and torch's overflow for a seed beyond 2**64 with --neural.
    path, _ = exact_trace
    fit = ["fit", str(path), "--out", str(tmp_path / "p")]
    _fails_one_line(capsys, [*fit, "--holdout", "0.5", "--seed", "-1"], "seed -1")
    _fails_one_line(capsys, [*fit, "--seed", str(2**70), "--neural"], "seed")
    split = ["trace", "split", str(path), "--fit-out", str(tmp_path / "a")]
    _fails_one_line(capsys, [*split, "--heldout-out", str(tmp_path / "b"), "--seed", "-2"], "seed")
    with pytest.raises(InputError, match="seed"):
        RequestSplit.make(np.arange(4), 0.5, seed=-5)
    with pytest.raises(InputError, match="seed"):
        thin_counts(None, 0.5, seed=-5)  # type: ignore[arg-type]


def test_an_empty_npy_file_is_an_error_not_an_abort(exact_trace, tmp_path, capsys):
    # Before: np.load raised EOFError, which click turns into "Aborted!" and exit code 1/130.
    path, _ = exact_trace
    (tmp_path / "emb.npy").write_bytes(b"")
    args = [
        "fit",
        str(path),
        "--out",
        str(tmp_path / "p"),
        "--embeddings",
        str(tmp_path / "emb.npy"),
    ]
    _fails_one_line(capsys, args, "not a .npy array")


def test_embeddings_inside_the_output_directory_are_not_deleted(
    saved, exact_trace, tmp_path, capsys
):
    # Before: the old predictor directory was replaced, deleting the embeddings it was given.
    path, gen = exact_trace
    pred = _copy(saved, tmp_path)
    emb = pred / "emb.npy"
    np.save(emb, np.random.default_rng(0).normal(size=(gen.config.vocab_size, 4)).astype("f4"))
    before = emb.read_bytes()
    args = ["fit", str(path), "--out", str(pred), "--embeddings", str(emb)]
    _fails_one_line(capsys, args, "reads its input")
    assert emb.read_bytes() == before


def _counts_table(path, count, meta_extra=None, count_type=None):
    meta = {"schema": "counts", "schema_version": 1, "num_layers": 1, "num_experts": 4,
            "top_k": 2, "vocab_size": 10} | (meta_extra or {})  # fmt: skip
    n = len(count)
    table = pa.table({
        "layer": pa.array([0] * n, pa.int16()),
        "token_id": pa.array([1 + i // 4 for i in range(n)], pa.int32()),
        "expert": pa.array([i % 4 for i in range(n)], pa.int16()),
        "count": pa.array(count, count_type or pa.int64()),
    }).replace_schema_metadata({b"moeplan": json.dumps(meta).encode()})  # fmt: skip
    pq.write_table(table, path)
    return path


@pytest.mark.parametrize(
    "count, count_type, message",
    [
        ([1.5, 2.0], pa.float64(), "not an integer"),  # before: silently truncated to 1
        ([float("nan"), 2.0], pa.float64(), "not an integer"),  # before: "negative count -9.2e18"
        ([None, 2], None, "null"),  # before: the same misleading "negative count"
        (["3", "2"], pa.string(), "expected integers"),  # before: parsed as numbers
        ([2**63 + 5, 1], pa.uint64(), "beyond int64"),  # before: "negative count"
        ([2**62] * 4, None, "2**62"),  # before: the int64 sums wrapped to 0 (or garbage)
    ],
    ids=["fraction", "nan", "null", "string", "uint64", "overflow"],
)
def test_counts_tables_with_bad_counts_are_refused(tmp_path, capsys, count, count_type, message):
    path = _counts_table(tmp_path / "c.parquet", count, count_type=count_type)
    _fails_one_line(capsys, ["fit", str(path), "--out", str(tmp_path / "p")], message)


def test_report_renders_without_heldout_tokens(tmp_path, capsys):
    # Thinning a tiny table can leave nothing held out: the predictor was saved, then the
    # text report crashed on the unmeasured prediction cost (TypeError traceback).
    path = _counts_table(tmp_path / "c.parquet", [1, 1])
    seed = next(
        s
        for s in range(100)
        if fit_predictor(path, FitConfig(holdout=0.5, seed=s)).report["heldout_tokens"] == 0
    )
    capsys.readouterr()
    args = ["fit", str(path), "--out", str(tmp_path / "p"), "--holdout", "0.5"]
    assert main([*args, "--seed", str(seed)]) == 0
    assert "table - µs/token" in capsys.readouterr().out
    report = fit_predictor(path, FitConfig(holdout=0.5, seed=seed)).report
    # no held-out activations: no distribution error to report (was 100% against uniform)
    assert report["distribution"]["error_rate"]["per_layer"] == [None]
    Console(file=io.StringIO()).print(render_report(report))


def test_distribution_summary_of_an_empty_heldout_layer():
    dist = DistributionPredictor().partial_fit(np.array([[4, 0], [1, 1]]))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # before: "Mean of empty slice" RuntimeWarning
        out = distribution_summary(dist, np.zeros((2, 2), np.int64), np.array([[4, 0], [1, 1]]))
        assert out["skewness_heldout"]["overall"] is None
        assert out["error_rate"]["per_layer"] == [None, None]
        out = distribution_summary(dist, np.array([[1, 1], [0, 0]]), np.array([[4, 0], [1, 1]]))
    # only layer 0 has held-out load: its error (|1 - .5| + |0 - .5|) / 2 * 2 = 1.0
    assert out["error_rate"] == {"per_layer": [1.0, None], "overall": 1.0}


def test_library_calls_with_odd_arguments_raise_input_errors(saved):
    p = load_predictor(saved)
    m = p.meta
    for layer in (1.5, "0"):  # before: TypeError (tuple indices) after int() let 1.5 through
        with pytest.raises(InputError, match="layer"):
            p.affinity.predict_topk(np.array([1]), layer)
    with pytest.raises(InputError, match="layer"):
        p.affinity.layer_tables(m.num_layers)  # before: IndexError
    e2d = contiguous_placement(m.num_layers, m.num_experts, 2)
    for layer in (-1, m.num_layers):  # before: -1 silently empty, L an IndexError
        with pytest.raises(InputError, match="layer"):
            ngram_context_affinity(p.transitions, e2d, layer, 2, 2)
    with pytest.raises(InputError, match="order"):
        fit_ngram_device_table(p.transitions, e2d, 2, order=2.0)  # before: TypeError
    with pytest.raises(InputError, match="backoff"):
        fit_ngram_device_table(p.transitions, e2d, 2, backoff="x")  # before: TypeError
    with pytest.raises(InputError, match="finite"):  # before: NaN probabilities, garbage load
        DistributionPredictor().partial_fit(np.full((2, 2), np.nan))
    with pytest.raises(InputError):  # before: ZeroDivisionError
        DistributionPredictor().partial_fit(np.zeros((2, 0)))
    with pytest.raises(InputError, match="momentum"):  # before: ValueError
        DistributionPredictor("fast").partial_fit(np.ones((2, 2)))
    with pytest.raises(InputError, match="confident_threshold"):  # before: ValueError
        TokenExpertAffinity(confident_threshold="x").fit(None)  # type: ignore[arg-type]
    with pytest.raises(InputError, match="ngram_order"):  # before: accepted, TypeError later
        fit_predictor("unused", FitConfig(ngram_order=2.0))  # type: ignore[arg-type]


def test_transitions_of_a_real_fit_pass_the_new_checks(exact_trace):
    # The checks accept what the accumulator writes, at every layer and context order.
    path, _ = exact_trace
    t = fit_predictor(path, FitConfig(ngram_routed=True)).predictor.transitions
    again = TopOneTransitions(t.keys, t.counts, t.layer_offsets, t.num_experts)
    assert again.num_layers == t.num_layers


def test_an_ngram_figure_too_large_to_hold_is_reported_unavailable(synth_dir):
    # Before: --ep-size 256 --ngram-order 3 asked numpy for 256**4 float64 cells (32 GiB)
    # and ended in a MemoryError traceback.
    path, _ = synth_trace(synth_dir, "wide", num_experts=256, num_tokens=400, num_requests=8)
    report = fit_predictor(path, FitConfig(holdout=0.5, ep_size=256, ngram_order=3)).report
    assert report["ngram"]["available"] is False
    assert "lower --ep-size or --ngram-order" in report["ngram"]["reason"]


def test_model_flag_must_match_a_counts_table_without_a_model_column(tmp_path, capsys):
    # Before: --model was ignored for such a table, so the predictor silently held another
    # model's counts (named after the table's metadata or file).
    meta = {"model": "Mixtral-8x7B-test"}
    path = _counts_table(tmp_path / "c.parquet", [3, 3], meta_extra=meta)
    out = ["--out", str(tmp_path / "p")]
    _fails_one_line(capsys, ["fit", str(path), "--model", "OLMoE", *out], "records model")
    plain = _counts_table(tmp_path / "plain.parquet", [3, 3])
    _fails_one_line(capsys, ["fit", str(plain), "--model", "OLMoE", *out], "records no model")
    assert main(["fit", str(path), "--model", "mixtral", *out]) == 0  # a substring, any case
    assert load_predictor(tmp_path / "p").meta.model == "Mixtral-8x7B-test"


def test_bfloat16_embeddings_are_read(tmp_path):
    # A model checkpoint's embed_tokens is usually bfloat16, a dtype numpy lacks. Before:
    # "TypeError: data type 'bfloat16' not understood" (a traceback from `moeplan fit`).
    import torch
    from safetensors.torch import save_file as save_torch

    weight = torch.randn(6, 4).to(torch.bfloat16)
    save_torch({"model.embed_tokens.weight": weight}, str(tmp_path / "e.safetensors"))
    emb = load_embeddings(tmp_path / "e.safetensors", 6)
    assert emb.dtype == np.float32
    np.testing.assert_array_equal(emb, weight.float().numpy())


def test_embeddings_of_another_model_are_refused(exact_trace, tmp_path, capsys):
    # `moeplan profile --save-embeddings` records the model's fingerprint; before, a file
    # recording another model's was used for the nearest-token fallback all the same.
    path, gen = exact_trace
    v = gen.config.vocab_size
    emb = np.random.default_rng(0).normal(size=(v, 4)).astype(np.float32)
    other = {"model": "other/model", "fingerprint": "0123456789abcdef"}
    save_file({"embeddings": emb}, str(tmp_path / "other.safetensors"), metadata=other)
    args = ["fit", str(path), "--out", str(tmp_path / "p")]
    _fails_one_line(capsys, [*args, "--embeddings", str(tmp_path / "other.safetensors")], "other")
    meta = open_trace(path).meta
    same = {"model": meta.model, "fingerprint": meta.fingerprint()}
    save_file({"embeddings": emb}, str(tmp_path / "same.safetensors"), metadata=same)
    assert main([*args, "--embeddings", str(tmp_path / "same.safetensors")]) == 0


def test_a_wrong_embeddings_file_is_refused_before_the_pass(exact_trace, tmp_path, monkeypatch):
    # Before: the shape, dtype and model of the embeddings were checked only after the pass
    # over the whole trace.
    import torch
    from safetensors.torch import save_file as save_torch

    import planner.predict.fit as fit

    path, gen = exact_trace
    v = gen.config.vocab_size
    other = {"model": "other/model", "fingerprint": "0123456789abcdef"}
    save_file({"e": np.zeros((v, 4), np.float32)}, str(tmp_path / "other.safetensors"), other)
    save_file({"e": np.zeros((v, 4), np.int32)}, str(tmp_path / "int.safetensors"))
    np.save(tmp_path / "short.npy", np.zeros((v - 1, 4), np.float32))
    save_torch({"e": torch.zeros(v, 4, dtype=torch.bfloat16)}, str(tmp_path / "bf16.safetensors"))

    def no_pass(*args, **kwargs):
        raise AssertionError("the pass over the trace started")

    monkeypatch.setattr(fit, "CountsAccumulator", no_pass)
    cases = {"other.safetensors": "other/model", "int.safetensors": "not floating point",
             "short.npy": "disagrees with the vocabulary"}  # fmt: skip
    for name, message in cases.items():
        with pytest.raises((InputError, MismatchError), match=message):
            fit_predictor(path, FitConfig(embeddings=str(tmp_path / name)))
    # a good file passes the check (and the pass starts)
    with pytest.raises(AssertionError, match="pass over the trace started"):
        fit_predictor(path, FitConfig(embeddings=str(tmp_path / "bf16.safetensors")))


def test_numpy_numbers_in_the_configs_reach_the_saved_predictor(exact_trace, tmp_path, small_meta):
    """A numpy seed, fraction, threshold or momentum passed the checks, then saving the
    predictor failed with json's 'Object of type int64 is not JSON serializable'
    traceback; numpy batch sizes and neural settings were refused."""
    path, _ = exact_trace
    neural = NeuralConfig(
        max_steps=np.int64(3), batch_size=np.int32(64), lr=np.float32(0.01),
        time_budget_s=np.float32(60), seed=np.uint64(1),
    )  # fmt: skip
    cfg = FitConfig(
        holdout=np.float32(0.3), seed=np.int64(2), confident_threshold=np.float32(0.5),
        distribution_momentum=np.float64(0.5), batch_rows=np.int64(5000),
        batch_tokens=np.int32(512), neural=True, neural_config=neural,
    )  # fmt: skip
    fit_predictor(path, cfg).predictor.save(tmp_path / "pred")
    back = load_predictor(tmp_path / "pred")
    assert back.fit_info["seed"] == 2 and back.affinity.confident_threshold == 0.5
    assert back.neural is not None and back.neural.config.max_steps == 3
    counts = write_counts_table(tmp_path / "c.parquet", random_counts(small_meta, 60, seed=2))
    result = fit_predictor(counts, FitConfig(holdout=np.float32(0.5), seed=np.int64(2)))
    result.predictor.save(tmp_path / "counts-pred")
    assert load_predictor(tmp_path / "counts-pred").fit_info["split"]["fraction"] == 0.5


def test_a_path_for_the_embeddings_reaches_the_saved_predictor(tmp_path, exact_trace):
    """FitConfig(embeddings=Path(...)) fitted, then saving failed: a Path is not JSON."""
    path, gen = exact_trace
    emb = tmp_path / "emb.npy"
    np.save(emb, np.random.default_rng(0).normal(size=(gen.config.vocab_size, 4)))
    fit_predictor(path, FitConfig(embeddings=emb, progress=False)).predictor.save(tmp_path / "p")
    assert load_predictor(tmp_path / "p").fit_info["embeddings"] == str(emb)


def test_the_fallback_ranks_experts_by_the_unknown_tokens_routing_too(tmp_path):
    """The layer's most popular experts (the fallback of unknown and unseen tokens) came from
    the known tokens' counts only: a trace of 196 unknown occurrences routed to experts 6 and
    7 and 4 known ones routed to 0 and 1 predicted 0 and 1 for every unknown token (held-out
    precision 0 where 6 and 7 give 1)."""
    from planner.trace import TraceBatch, TraceMeta
    from planner.trace.io import write_trace

    meta = TraceMeta(model="test/unk", num_layers=2, num_experts=8, top_k=2, vocab_size=50,
                     moe_layer_indices=(0, 1), source="tests")  # fmt: skip
    rows = 400
    request = np.repeat(np.arange(8), rows // 8)
    position = np.tile(np.arange(rows // 8), 8).astype(np.int32)
    experts = np.broadcast_to(np.array([6, 7]), (rows, 2, 2)).copy()
    weights = np.broadcast_to(np.array([0.6, 0.4]), (rows, 2, 2))
    token = np.full(rows, -1)
    token[::50], experts[::50] = 3, [0, 1]  # one known occurrence a request
    path = write_trace(tmp_path / "t.parquet", meta,
                       TraceBatch.from_arrays(request, position, token, experts, weights))  # fmt: skip
    result = fit_predictor(path, FitConfig(holdout=0.5, seed=1, progress=False))
    affinity = result.predictor.affinity
    assert affinity.global_topk_.tolist() == [[6, 7], [6, 7]]
    assert affinity.global_top1_.tolist() == [6, 6]
    assert affinity.predict_topk(np.array([-1, 10]), 0).tolist() == [[6, 7], [6, 7]]
    assert result.report["table"]["unseen"]["precision"]["overall"] == 1.0
    result.predictor.save(tmp_path / "p")
    back = load_predictor(tmp_path / "p").affinity
    assert back.global_topk_.tolist() == [[6, 7], [6, 7]] and back.global_top1_.tolist() == [6, 6]
    # The confident set of a token with no row follows the same routing: its share of
    # experts 6 and 7 was 0 (known tokens only), so the report's cP and cR read 0 where the
    # top-k fallback's precision reads 1.
    share = back.routed_share(np.array([-1]), np.array([[6, 7]]), 0)
    np.testing.assert_allclose(share, [[196 / 200, 196 / 200]])
    assert back.confident_size(np.array([-1, 10]), 0).tolist() == [2, 2]
    confident = result.report["table_confident"]
    assert confident["precision"]["overall"] == 1.0 and confident["recall"]["overall"] == 1.0

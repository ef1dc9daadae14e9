"""The saved predictor directory: round trip, versioning, corruption, fingerprints."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from planner.errors import InputError, MismatchError, SchemaError
from planner.predict.fit import FitConfig, fit_predictor
from planner.predict.neural import NeuralConfig
from planner.predict.ngram import contiguous_placement, fit_ngram_device_table
from planner.predict.predictor import MANIFEST, Predictor, load_predictor
from planner.trace import TraceMeta


@pytest.fixture(scope="module")
def fitted(exact_trace):
    path, _ = exact_trace
    cfg = FitConfig(holdout=0.3, neural=True, neural_config=NeuralConfig(max_steps=30))
    return fit_predictor(path, cfg).predictor


def test_round_trip(fitted, tmp_path):
    out = fitted.save(tmp_path / "pred")
    back = Predictor.load(out)
    m = fitted.meta
    assert back.meta == m and back.fingerprint == fitted.fingerprint
    ids = np.arange(-1, m.vocab_size)
    for layer in range(m.num_layers):
        np.testing.assert_array_equal(
            back.affinity.predict_topk(ids, layer), fitted.affinity.predict_topk(ids, layer)
        )
        np.testing.assert_array_equal(
            back.affinity.predict_top1(ids, layer), fitted.affinity.predict_top1(ids, layer)
        )
    np.testing.assert_array_equal(back.distribution.predict(), fitted.distribution.predict())
    np.testing.assert_array_equal(back.transitions.keys, fitted.transitions.keys)
    np.testing.assert_array_equal(back.neural.predict_topk(ids), fitted.neural.predict_topk(ids))
    assert back.report == json.loads(json.dumps(fitted.report))
    assert back.fit_info["split"]["kind"] == "request"
    # The n-gram tables solve will build are identical from either copy.
    e2d = contiguous_placement(m.num_layers, m.num_experts, 4)
    a = fit_ngram_device_table(fitted.transitions, e2d, 4)
    b = fit_ngram_device_table(back.transitions, e2d, 4)
    np.testing.assert_array_equal(a.to_device, b.to_device)
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["format"] == "moeplan-predictor" and manifest["format_version"] == 4
    np.testing.assert_array_equal(back.token_shrinkage, fitted.token_shrinkage)
    assert back.token_shrinkage.shape == (m.num_layers,)
    assert manifest["fingerprint"] == m.fingerprint()
    # Saving again over a predictor replaces it.
    fitted.save(out)


def test_wrong_version_and_corrupt_files_are_refused(fitted, tmp_path):
    out = fitted.save(tmp_path / "pred")
    manifest = json.loads((out / MANIFEST).read_text())
    (out / MANIFEST).write_text(json.dumps(manifest | {"format_version": 1}))
    with pytest.raises(SchemaError, match="format_version 1"):
        Predictor.load(out)
    (out / MANIFEST).write_text(json.dumps(manifest | {"format": "other"}))
    with pytest.raises(SchemaError, match="format"):
        Predictor.load(out)
    (out / MANIFEST).write_text("{not json")
    with pytest.raises(SchemaError, match="JSON"):
        Predictor.load(out)
    (out / MANIFEST).write_text(json.dumps(manifest))
    data = bytearray((out / "affinity.safetensors").read_bytes())
    data[-1] ^= 0xFF
    (out / "affinity.safetensors").write_bytes(bytes(data))
    with pytest.raises(SchemaError, match="checksum"):
        Predictor.load(out)
    out = fitted.save(tmp_path / "pred2")
    (out / "distribution.safetensors").unlink()
    with pytest.raises(SchemaError, match="missing"):
        Predictor.load(out)
    with pytest.raises(InputError, match="not a predictor"):
        Predictor.load(tmp_path)


def test_fingerprint_mismatch(fitted, tmp_path):
    out = fitted.save(tmp_path / "pred")
    m = fitted.meta
    load_predictor(out, m)  # same model: fine
    other = TraceMeta("another/model", m.num_layers, m.num_experts, m.top_k, m.vocab_size)
    with pytest.raises(MismatchError, match="fingerprint"):
        load_predictor(out, other)
    # the same shapes recorded at other model layers: the fingerprint is equal, the data not
    shifted = dataclasses.replace(m, moe_layer_indices=tuple(i + 1 for i in m.moe_layer_indices))
    assert shifted.fingerprint() == m.fingerprint()
    with pytest.raises(MismatchError, match="MoE layer 0 is model layer .* in the predictor"):
        load_predictor(out, shifted)


def test_destination_must_be_a_directory_it_may_replace(fitted, tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(InputError, match="is a file"):
        fitted.save(tmp_path / "file")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "keep.txt").write_text("x")
    with pytest.raises(InputError, match="not a predictor"):
        fitted.save(tmp_path / "busy")
    assert (tmp_path / "busy" / "keep.txt").read_text() == "x"


def test_manifest_values_past_any_range_are_one_line(tmp_path):
    # deeply nested JSON (RecursionError), an integer past float's range (OverflowError)
    # and threads beyond int32 (torch's ValueError) were tracebacks
    from planner.predict.distribution import DistributionPredictor

    deep = tmp_path / "deep"
    deep.mkdir()
    (deep / "predictor.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(SchemaError, match="not valid JSON"):
        Predictor.load(deep)
    for bad, message in (
        ({"lr": 10**400}, "lr must be finite numbers"),
        ({"threads": 10**30}, r"threads=10+ must be an integer in \[1, 4096\]"),
    ):
        with pytest.raises(InputError, match=message):
            NeuralConfig(**bad)
    for load in ([[0.6, 0.4]], np.array([[2**63, 1]], np.uint64)):  # truncated / wrapped
        with pytest.raises(InputError, match="whole counts"):
            DistributionPredictor().partial_fit(np.asarray(load))

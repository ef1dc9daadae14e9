"""``moeplan export`` / ``evaluate`` as a user runs them: files written, verified, errors one line."""

from __future__ import annotations

import json

import numpy as np
import pytest

from planner.cli.main import main
from planner.export import Bundle, save_bundle
from planner.trace import TraceMeta, write_trace
from tests.conftest import random_batch


@pytest.fixture
def plan_and_trace(tmp_path):
    meta = TraceMeta(
        "test/m", num_layers=3, num_experts=8, top_k=2, vocab_size=40, moe_layer_indices=(1, 2, 3)
    )
    rng = np.random.default_rng(0)
    bundle = Bundle.from_arrays(
        meta, ep_size=4, ngram_order=1,
        expert_to_device=np.stack([rng.permutation(np.arange(8) // 2) for _ in range(3)]),
        token_to_device=rng.integers(0, 4, (3, 40)), token_confidence=rng.random((3, 40)),
        ngram_to_device=rng.integers(0, 4, (3, 4)), ngram_confidence=rng.random((3, 4)),
        method="test", seed=3,
    )  # fmt: skip
    plan = save_bundle(bundle, tmp_path / "plan")
    trace = write_trace(tmp_path / "held.parquet", meta, random_batch(meta, 200))
    return plan, trace


def test_export_all_formats_and_verify(tmp_path, plan_and_trace, capsys):
    plan, _ = plan_and_trace
    out = tmp_path / "bundle"
    assert (
        main(
            [
                "export",
                str(plan),
                "--out",
                str(out),
                "--format",
                "moeplan,sglang,vllm-ascend,trtllm",
            ]
        )
        == 0
    )
    names = {p.name for p in out.iterdir()}
    assert {"tables.safetensors", "manifest.json", "sglang_expert_location.json"} <= names
    assert any(n.endswith(".yaml") for n in names) and any("vllm" in n for n in names)
    capsys.readouterr()
    assert main(["export", "--verify", str(out), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] and report["ep_size"] == 4
    # verify writes nothing: an --out beside it is refused, not silently ignored
    assert main(["export", "--verify", str(out), "--out", str(tmp_path / "v")]) == 2
    assert "--verify checks PLAN where it is and writes nothing" in capsys.readouterr().err
    # nor is anything written into the bundle (an engine file there broke its checksums)
    stray = out / "sglang_expert_location.json"
    assert main(["export", str(plan), "--out", str(stray), "--format", "sglang"]) == 2
    assert f"is inside the moeplan bundle {out}" in capsys.readouterr().err
    assert main(["export", "--verify", str(out)]) == 0

    single = tmp_path / "sglang.json"
    assert main(["export", str(plan), "--out", str(single), "--format", "sglang"]) == 0
    p2l = json.loads(single.read_text())["physical_to_logical_map"]
    assert len(p2l) == 4 and sorted(p2l[1]) == list(range(8))  # model layers 0..3, MoE 1..3
    # a format named twice is named once: "sglang,sglang" counted two engine formats and
    # wrote a bundle directory named twice.json
    twice = tmp_path / "twice.json"
    assert main(["export", str(plan), "--out", str(twice), "--format", "sglang, sglang"]) == 0
    assert twice.is_file() and json.loads(twice.read_text()) == json.loads(single.read_text())


def test_verify_refuses_a_corrupt_bundle(tmp_path, plan_and_trace, capsys):
    plan, _ = plan_and_trace
    tables = plan / "tables.safetensors"
    data = bytearray(tables.read_bytes())
    data[-3] ^= 0xFF
    tables.write_bytes(bytes(data))
    assert main(["export", "--verify", str(plan)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "sha256" in err[0]


def test_evaluate_prints_metrics(plan_and_trace, capsys):
    plan, trace = plan_and_trace
    assert main(["evaluate", str(plan), str(trace), "--json", "--hidden-size", "16"]) == 0
    report = json.loads(capsys.readouterr().out)
    ov = report["overall"]
    assert ov["tokens"] == 200 and 0 <= ov["lar_balanced"] <= 1
    assert ov["all_to_all_bytes"] == ov["remote_activations"] * 16 * 2 * 2
    assert [r["model_layer"] for r in report["per_layer"]] == [1, 2, 3]


@pytest.mark.parametrize(
    "args, message",
    [
        (["export", "PLAN", "--out", "X", "--format", "onnx"], "unknown --format"),
        (["export", "PLAN"], "--out is required"),
        (["evaluate", "PLAN", "TRACE", "--slack", "0.5"], "slack=0.5 must be a number >= 1"),
        (["evaluate", "PLAN", "TRACE", "--slack", "nan"], "slack=nan must be a number >= 1"),
        (["evaluate", "PLAN", "TRACE", "--batch-tokens", "0"], "batch_tokens=0 must be an integer"),
        (["evaluate", "PLAN", "TRACE", "--plot", "X"], "the file name must end in .png"),
        # "" is ".": --plot "" drew nothing without a word, --out "" said "is required"
        (["evaluate", "PLAN", "TRACE", "--plot", ""], "--plot is empty; give a path"),
        (["export", "PLAN", "--out", ""], "--out is empty; give a path"),
    ],
)
def test_user_errors(plan_and_trace, tmp_path, capsys, args, message):
    plan, trace = plan_and_trace
    args = [
        str(plan)
        if a == "PLAN"
        else str(trace)
        if a == "TRACE"
        else str(tmp_path / "x")
        if a == "X"
        else a
        for a in args
    ]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]


def test_a_full_disk_while_writing_the_tables_is_one_line(plan_and_trace, tmp_path, capsys,
                                                           monkeypatch):  # fmt: skip
    """safetensors reports a full disk as a SafetensorError, not an OSError: export printed
    a 49-line traceback (the earlier bundle survived)."""
    import safetensors
    import safetensors.numpy

    plan, _ = plan_and_trace
    out = tmp_path / "b"
    assert main(["export", str(plan), "--out", str(out)]) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    capsys.readouterr()

    def full(*args, **kwargs):
        raise safetensors.SafetensorError(
            "Error while serializing: I/O error: No space left on device (os error 28)"
        )

    monkeypatch.setattr(safetensors.numpy, "save_file", full)
    assert main(["export", str(plan), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"moeplan: error: {out}: cannot be written (") and err.count("\n") == 1
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_options_export_would_ignore_are_refused(plan_and_trace, tmp_path, capsys):
    """--verify ignored --format (even an unknown one) and --num-model-layers; a moeplan
    bundle alone ignored --num-model-layers; a single engine file was written under any
    name, then refused as 'not a sglang file' when exported to again."""
    plan, _ = plan_and_trace
    bundle = tmp_path / "b"
    assert main(["export", str(plan), "--out", str(bundle)]) == 0
    capsys.readouterr()
    for extra in (["--format", "nonsense"], ["--num-model-layers", "-5"]):
        assert main(["export", "--verify", str(bundle), *extra]) == 2
        assert f"drop {extra[0]}" in capsys.readouterr().err
    assert main(["export", str(plan), "--out", str(tmp_path / "c"), "--num-model-layers", "4"]) == 2
    assert "--num-model-layers sizes the engine files" in capsys.readouterr().err
    assert (
        main(["export", str(plan), "--out", str(tmp_path / "placement"), "--format", "sglang"]) == 2
    )
    assert "a sglang file is named *.json" in capsys.readouterr().err
    assert not (tmp_path / "placement").exists()
    # SGLang parses a path as a file only if it ends in ".json", case and all
    upper = tmp_path / "placement.JSON"
    assert main(["export", str(plan), "--out", str(upper), "--format", "sglang"]) == 2
    assert "a sglang file is named *.json (lower case" in capsys.readouterr().err
    assert not upper.exists()
    out = tmp_path / "placement.json"
    for _ in range(2):  # and again over its own file
        assert main(["export", str(plan), "--out", str(out), "--format", "sglang",
                     "--num-model-layers", "4"]) == 0  # fmt: skip
        # the usage names the file written, not the bundle's default name
        printed = " ".join(capsys.readouterr().out.split())  # rich wraps long lines
        assert f"--init-expert-location {out.resolve()}" in printed

"""Edge cases and bad input of ``moeplan export`` and the bundle load / verify path: one-line
errors (never a traceback or a hang), verify agreeing with load, edited plans refused."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from planner.cli.main import main
from planner.errors import InputError, SchemaError
from planner.export import EnginePlacement, load_bundle_arrays, save_bundle, verify_bundle
from planner.solve.plan import Plan
from tests.export.conftest import (
    HAND_META,
    HAND_PERMUTATION,
    edit_manifest,
    make_bundle,
    rewrite_tables,
)


def _one_line_error(capsys, rc: int, match: str) -> None:
    err = capsys.readouterr().err.strip()
    assert rc == 2, err
    assert err.startswith("moeplan: error:") and len(err.splitlines()) == 1, err
    assert match in err, err


# ---------------------------------------------------------------------------------------
# Bundle manifest


def test_verify_refuses_nan_metrics_as_load_does(tmp_path, hand_bundle):
    path = save_bundle(hand_bundle, tmp_path / "b")
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["metrics"]["lar"] = float("nan")  # json writes NaN, json.loads reads it back
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(SchemaError, match="metrics are not plain JSON"):
        load_bundle_arrays(path)
    report = verify_bundle(path)
    assert not report["ok"] and "metrics are not plain JSON" in report["error"]


def test_a_seed_of_true_is_refused(tmp_path, hand_bundle):
    """Bundle(seed=True) was kept and saved as '"seed": true', which load then refused."""
    with pytest.raises(SchemaError, match="seed=True must be an integer or None"):
        dataclasses.replace(hand_bundle, seed=True)


@pytest.mark.parametrize(
    ("name", "value"),
    [("ep_size", True), ("ep_size", 4.7), ("ep_size", None), ("ngram_order", True),
     ("ngram_order", 2.5), ("seed", True), ("seed", 0.5)],
)  # fmt: skip
def test_from_arrays_refuses_what_is_not_an_integer(hand_bundle, name, value):
    """from_arrays passed its sizes through int(): ep_size=4.7 was E = 4, True was 1, None a
    TypeError traceback."""
    from planner.export import Bundle

    arrays = hand_bundle.tables() | {"ep_size": 4, "ngram_order": 2, "seed": 0}
    with pytest.raises(SchemaError, match=f"{name}={value!r} must be"):
        Bundle.from_arrays(HAND_META, **(arrays | {name: value}))
    numpy = {"ep_size": np.int64(4), "ngram_order": np.uint8(2), "seed": np.uint64(0)}
    assert Bundle.from_arrays(HAND_META, **(arrays | numpy)).manifest()["seed"] == 0


def test_deeply_nested_manifest_is_one_schema_error(tmp_path, hand_bundle, capsys):
    path = save_bundle(hand_bundle, tmp_path / "b")
    (path / "manifest.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(SchemaError, match="nested too deeply"):
        load_bundle_arrays(path)
    report = verify_bundle(path)  # never raises for a bad bundle
    assert not report["ok"] and "nested too deeply" in report["error"]
    _one_line_error(capsys, main(["export", "--verify", str(path)]), "nested too deeply")


# ---------------------------------------------------------------------------------------
# Engine files: the number of model layers


def test_engine_placement_refuses_an_absurd_number_of_model_layers():
    with pytest.raises(InputError, match="more than 4096 decoder layers"):
        EnginePlacement(HAND_PERMUTATION, 4, (1, 3), 10**8)
    with pytest.raises(InputError, match="must be an integer"):
        EnginePlacement(HAND_PERMUTATION, 4, (1, 3), 4.5)
    assert EnginePlacement(HAND_PERMUTATION, 4, (1, 3), 4096).num_model_layers == 4096


def test_export_refuses_huge_num_model_layers_before_writing(tmp_path, hand_bundle, capsys):
    plan = save_bundle(hand_bundle, tmp_path / "plan")
    out = tmp_path / "out"
    argv = ["export", str(plan), "--out", str(out), "--format", "moeplan,sglang"]
    _one_line_error(capsys, main([*argv, "--num-model-layers", "100000"]), "decoder layers")
    assert not out.exists()
    single = tmp_path / "sglang.json"
    rc = main(["export", str(plan), "--out", str(single), "--format", "sglang",
               "--num-model-layers", "100000"])  # fmt: skip
    _one_line_error(capsys, rc, "decoder layers")
    assert not single.exists()


def test_export_refuses_a_manifest_whose_moe_layers_reach_absurdly_far(
    tmp_path, hand_bundle, capsys
):
    """moe_layer_indices are not in the fingerprint; the default number of model layers
    (last index + 1) must not make the SGLang file billions of rows long."""
    path = save_bundle(hand_bundle, tmp_path / "b")
    rewrite_tables(path, keep_layout=False)  # a bundle written before the header's copy
    edit_manifest(path, moe_layer_indices=[1, 100_000])
    out = tmp_path / "sglang.json"
    rc = main(["export", str(path), "--out", str(out), "--format", "sglang"])
    _one_line_error(capsys, rc, "decoder layers")
    assert not out.exists()


def test_a_single_engine_file_replaces_only_a_file_of_its_kind(tmp_path, hand_bundle, capsys):
    """`export --format sglang --out prompts.jsonl` replaced the user's prompts with JSON:
    a single engine file may replace an empty file or one named like its format only."""
    plan = save_bundle(hand_bundle, tmp_path / "plan")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"text": "keep me"}\n')
    for fmt, out in (("sglang", prompts), ("trtllm", prompts), ("vllm-ascend", prompts)):
        rc = main(["export", str(plan), "--out", str(out), "--format", fmt])
        _one_line_error(capsys, rc, "exists and is not a")
    assert prompts.read_text() == '{"text": "keep me"}\n'
    # Named like the format but not one of its files (a model's config.json, an unrelated
    # YAML): refused too, before the write.
    config = tmp_path / "config.json"
    config.write_text('{"model_type": "mixtral", "num_local_experts": 8}')
    other_yaml = tmp_path / "opts.yaml"
    other_yaml.write_text("moe_config:\n  load_balancer: lb.yaml\n")
    for fmt, out in (("sglang", config), ("vllm-ascend", config), ("trtllm", other_yaml)):
        rc = main(["export", str(plan), "--out", str(out), "--format", fmt])
        _one_line_error(capsys, rc, f"exists and is not an earlier {fmt} file")
    assert "mixtral" in config.read_text() and "lb.yaml" in other_yaml.read_text()
    # An earlier file of the format (any name), or an empty file, is replaced.
    for fmt, name in (("sglang", "old.json"), ("trtllm", "old.yml"), ("trtllm", "empty.yaml")):
        out = tmp_path / name
        if name == "empty.yaml":
            out.write_text("")
        else:
            assert main(["export", str(plan), "--out", str(out), "--format", fmt]) == 0
            out.write_text(out.read_text().replace("[", "[ "))  # edited by hand, still the format
        assert main(["export", str(plan), "--out", str(out), "--format", fmt]) == 0
        assert out.read_text() != "" and "[ " not in out.read_text()
    capsys.readouterr()


# ---------------------------------------------------------------------------------------
# Plans handed to export / evaluate


def _save_plan(path: Path) -> Path:
    b = make_bundle()
    model = json.loads(HAND_META.to_json())
    Plan(
        model=model, fingerprint=HAND_META.fingerprint(), ep_size=b.ep_size, method="test",
        seed=0, config={}, expert_to_device=b.expert_to_device,
        token_to_device=b.token_to_device, token_confidence=b.token_confidence,
        ngram_order=b.ngram_order, ngram_to_device=b.ngram_to_device,
        ngram_confidence=b.ngram_confidence,
        reports=[{"local_rate": 0.5, "token_imbalance": 1.0}] * HAND_META.num_layers,
    ).save(path)  # fmt: skip
    return path


def _edit_plan(path: Path, edit) -> None:
    meta = json.loads((path / "plan.json").read_text())
    meta = edit(meta) or meta
    (path / "plan.json").write_text(json.dumps(meta))


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda m: m.pop("model") and None, "model must be a JSON object (missing)"),
        (lambda m: m.pop("seed") and None, "seed must be an integer >= 0 (missing)"),
        (lambda m: m.update(seed=None), "seed must be an integer >= 0 (None)"),
        (lambda m: m.update(ngram_order="2"), "ngram_order must be an integer"),
        (lambda m: m.update(reports=[{}, {}]), "lacks numeric local_rate"),
        (lambda m: [1, 2], "not a JSON object"),
    ],
)
def test_a_malformed_plan_is_one_line(tmp_path, capsys, edit, message):
    plan = _save_plan(tmp_path / "plan")
    assert main(["export", str(plan), "--out", str(tmp_path / "ok")]) == 0  # as saved
    capsys.readouterr()
    _edit_plan(plan, edit)
    out = tmp_path / "bundle"
    _one_line_error(capsys, main(["export", str(plan), "--out", str(out)]), message)
    assert not out.exists()


def test_a_plan_whose_model_was_edited_is_refused(tmp_path, capsys):
    """As for a bundle's manifest: the stored fingerprint must match the model fields, or
    the plan would be exported as another model's."""
    plan = _save_plan(tmp_path / "plan")
    _edit_plan(plan, lambda m: m["model"].update(model="other/model"))
    out = tmp_path / "bundle"
    rc = main(["export", str(plan), "--out", str(out)])
    _one_line_error(capsys, rc, "does not match its model fields")
    assert not out.exists()


def test_plan_and_its_bundle_export_the_same_tables(tmp_path):
    """The checks above change nothing for a valid plan."""
    plan = _save_plan(tmp_path / "plan")
    assert main(["export", str(plan), "--out", str(tmp_path / "bundle")]) == 0
    got, want = load_bundle_arrays(tmp_path / "bundle"), make_bundle()
    for name, arr in want.tables().items():
        assert np.array_equal(getattr(got, name), arr), name


def test_a_directory_that_is_neither_plan_nor_bundle_says_both(tmp_path, capsys):
    """`export PREDICTOR` said only that manifest.json was missing from a "bundle"."""
    other = tmp_path / "pred"
    other.mkdir()
    (other / "predictor.json").write_text("{}")
    for args in (["export", str(other), "--out", str(tmp_path / "b")],
                 ["evaluate", str(other), str(tmp_path)]):  # fmt: skip
        rc = main(args)
        _one_line_error(capsys, rc, "neither a plan (no plan.json, from `moeplan solve`) nor a")

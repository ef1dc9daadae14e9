"""Bundle v1: construction checks, save/load round trip, corruption, verify, compatibility."""

from __future__ import annotations

import dataclasses
import hashlib
import json

import numpy as np
import pytest
import safetensors.numpy

import planner
from planner.errors import InputError, MismatchError, SchemaError
from planner.export import (
    FORMAT_VERSION,
    Bundle,
    check_compatible,
    load_bundle_arrays,
    permutation_from_placement,
    save_bundle,
    verify_bundle,
)
from planner.export import bundle as bundle_mod
from planner.trace import TraceMeta
from tests.export.conftest import (
    HAND_EXPERT_TO_DEVICE,
    HAND_META,
    HAND_PERMUTATION,
    edit_manifest,
    make_bundle,
    rewrite_tables,
)

# ---------------------------------------------------------------------------------------
# Placement helper


def test_permutation_from_placement_hand_case():
    assert permutation_from_placement(HAND_EXPERT_TO_DEVICE, 4).tolist() == (
        HAND_PERMUTATION.tolist()
    )
    assert permutation_from_placement(np.array([[1, 0, 1, 0]]), 2).tolist() == [[1, 3, 0, 2]]


def test_permutation_from_placement_refuses_unbalanced():
    with pytest.raises(SchemaError, match="layer 0: device 0 hosts 3 experts"):
        permutation_from_placement(np.array([[0, 0, 0, 1]]), 2)


# ---------------------------------------------------------------------------------------
# Construction


def test_bundle_from_arrays_casts_and_freezes(hand_bundle):
    assert hand_bundle.expert_to_device.dtype == np.int16
    assert hand_bundle.token_confidence.dtype == np.float16
    assert hand_bundle.expert_permutation.tolist() == HAND_PERMUTATION.tolist()
    assert hand_bundle.ngram_to_device.shape == (2, 16)
    with pytest.raises(ValueError):
        hand_bundle.token_to_device[0, 0] = 1  # read-only
    with pytest.raises(dataclasses.FrozenInstanceError):
        hand_bundle.ep_size = 2  # type: ignore[misc]


def _replace(bundle: Bundle, **changes) -> Bundle:
    fields = {f.name: getattr(bundle, f.name) for f in dataclasses.fields(bundle)}
    return Bundle(**(fields | changes))


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"token_confidence": np.zeros((2, 12), np.float32)}, "token_confidence is float32"),
        ({"token_to_device": np.zeros((2, 11), np.int16)}, r"token_to_device has shape \[2, 11\]"),
        ({"ngram_to_device": np.zeros((2, 8), np.int16)}, r"expected \[2, 16\]"),
        ({"token_to_device": np.full((2, 12), 4, np.int16)}, "device id 4, outside"),
        ({"token_confidence": np.full((2, 12), 1.5, np.float16)}, "confidence 1.5"),
        ({"ngram_confidence": np.full((2, 16), np.nan, np.float16)}, "NaN"),
        ({"ep_size": 3}, "not divisible by ep_size=3"),
        ({"ngram_order": 0}, "ngram_order=0"),
    ],
)
def test_bundle_refuses_bad_tables(hand_bundle, changes, message):
    with pytest.raises(SchemaError, match=message):
        _replace(hand_bundle, **changes)


def test_bundle_refuses_capacity_violation(hand_bundle):
    e2d = hand_bundle.expert_to_device.copy()
    e2d[1, 0] = 0  # device 0 now has 3 experts in layer 1, device 3 only 1
    with pytest.raises(SchemaError, match="layer 1: device 0 hosts 3 experts, expected N/E"):
        _replace(hand_bundle, expert_to_device=e2d)


def test_bundle_refuses_inconsistent_permutation(hand_bundle):
    perm = hand_bundle.expert_permutation.copy()
    perm[0, [0, 2]] = perm[0, [2, 0]]  # swaps experts between devices 0 and 1
    with pytest.raises(SchemaError, match="layer 0: slot 0 .* but expert_to_device puts it"):
        _replace(hand_bundle, expert_permutation=perm)
    perm = hand_bundle.expert_permutation.copy()
    perm[1, 0] = perm[1, 1]
    with pytest.raises(SchemaError, match="layer 1: expert_permutation is not a permutation"):
        _replace(hand_bundle, expert_permutation=perm)


def test_bundle_refuses_unserialisable_metrics(hand_bundle):
    with pytest.raises(SchemaError, match="metrics"):
        _replace(hand_bundle, metrics={"x": float("nan")})


def test_from_arrays_refuses_out_of_int16_range():
    with pytest.raises(SchemaError, match="token_to_device values span"):
        Bundle.from_arrays(
            HAND_META, ep_size=4, expert_to_device=HAND_EXPERT_TO_DEVICE,
            token_to_device=np.full((2, 12), 40000), token_confidence=np.zeros((2, 12)),
            ngram_to_device=np.zeros((2, 16), int), ngram_confidence=np.zeros((2, 16)),
            ngram_order=2,
        )  # fmt: skip


# ---------------------------------------------------------------------------------------
# Save / load


def test_round_trip(tmp_path, hand_bundle):
    path = save_bundle(hand_bundle, tmp_path / "b")
    assert sorted(p.name for p in path.iterdir()) == ["manifest.json", "tables.safetensors"]
    loaded = load_bundle_arrays(path)
    assert loaded == hand_bundle
    for name, arr in loaded.tables().items():
        assert arr.dtype == hand_bundle.tables()[name].dtype
        np.testing.assert_array_equal(arr, hand_bundle.tables()[name])
    assert loaded.meta.fingerprint() == HAND_META.fingerprint()
    assert loaded.meta.moe_layer_indices == (1, 3)
    assert (loaded.method, loaded.seed, loaded.metrics) == ("test", 0, hand_bundle.metrics)


def test_saved_bytes_are_exact_and_deterministic(tmp_path, hand_bundle):
    a = save_bundle(hand_bundle, tmp_path / "a")
    b = save_bundle(hand_bundle, tmp_path / "b")
    for name in ("tables.safetensors", "manifest.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes()
    raw = safetensors.numpy.load_file(a / "tables.safetensors")
    assert {k: str(v.dtype) for k, v in raw.items()} == {
        "expert_to_device": "int16", "expert_permutation": "int16",
        "token_to_device": "int16", "token_confidence": "float16",
        "ngram_to_device": "int16", "ngram_confidence": "float16",
    }  # fmt: skip
    manifest = json.loads((a / "manifest.json").read_text())
    assert manifest["format"] == "moeplan-bundle"
    assert manifest["format_version"] == FORMAT_VERSION == 1
    assert manifest["model"] == {
        "model": "test/hand", "num_layers": 2, "num_experts": 8, "top_k": 2, "vocab_size": 12,
    }  # fmt: skip
    assert manifest["fingerprint"] == HAND_META.fingerprint()
    assert manifest["created_by"].startswith("moeplan ")
    sha = hashlib.sha256((a / "tables.safetensors").read_bytes()).hexdigest()
    assert manifest["files"]["tables.safetensors"]["sha256"] == sha


def test_save_replaces_atomically_and_a_failed_save_keeps_the_old(tmp_path, monkeypatch):
    path = save_bundle(make_bundle(seed=1), tmp_path / "b")
    before = {p.name: p.read_bytes() for p in path.iterdir()}

    def boom(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(bundle_mod.safetensors.numpy, "save_file", boom)
    with pytest.raises(OSError, match="disk full"):
        save_bundle(make_bundle(seed=2), path)
    assert {p.name: p.read_bytes() for p in path.iterdir()} == before
    assert [p.name for p in tmp_path.iterdir()] == ["b"]  # no temp left behind
    monkeypatch.undo()
    save_bundle(make_bundle(seed=2), path)
    assert load_bundle_arrays(path) == make_bundle(seed=2)


def test_corrupted_tables_fail_sha256(tmp_path, hand_bundle):
    path = save_bundle(hand_bundle, tmp_path / "b")
    data = bytearray((path / "tables.safetensors").read_bytes())
    data[-3] ^= 0x01
    (path / "tables.safetensors").write_bytes(bytes(data))
    with pytest.raises(SchemaError) as err:
        load_bundle_arrays(path)
    assert str(err.value) == (
        f"bundle {path}: tables.safetensors sha256 mismatch (file changed or corrupt)"
    )


def test_wrong_format_version_names_both_versions(tmp_path, hand_bundle):
    path = save_bundle(hand_bundle, tmp_path / "b")
    edit_manifest(path, format_version=2)
    with pytest.raises(SchemaError, match="format_version 2 is not supported.*reads version 1"):
        load_bundle_arrays(path)
    edit_manifest(path, format_version=1, format="something-else")
    with pytest.raises(SchemaError, match="format is 'something-else'"):
        load_bundle_arrays(path)


def test_wrong_dtype_names_the_tensor(tmp_path, hand_bundle):
    path = save_bundle(hand_bundle, tmp_path / "b")
    rewrite_tables(path, token_confidence=np.zeros((2, 12), np.float32))
    with pytest.raises(SchemaError, match="tensor token_confidence is float32, expected float16"):
        load_bundle_arrays(path)


def test_a_dtype_numpy_cannot_read_is_refused_in_one_line(tmp_path, hand_bundle):
    # bfloat16 written by torch: safetensors' numpy loader raises TypeError on it
    torch = pytest.importorskip("torch")
    import safetensors.torch

    path = save_bundle(hand_bundle, tmp_path / "b")
    tables = {k: torch.from_numpy(np.array(v)) for k, v in
              safetensors.numpy.load_file(path / "tables.safetensors").items()}  # fmt: skip
    tables["token_confidence"] = tables["token_confidence"].to(torch.bfloat16)
    safetensors.torch.save_file(tables, path / "tables.safetensors")
    data = (path / "tables.safetensors").read_bytes()
    manifest = json.loads((path / "manifest.json").read_text())
    entry = manifest["files"]["tables.safetensors"]
    entry["sha256"], entry["bytes"] = hashlib.sha256(data).hexdigest(), len(data)
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(SchemaError, match="token_confidence is BF16.*int16 and float16"):
        load_bundle_arrays(path)
    report = verify_bundle(path)
    assert not report["ok"] and "token_confidence is BF16" in report["error"]


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"seed": "0"}, "seed='0' must be an integer"),
        ({"seed": 1.5}, "seed=1.5 must be an integer"),
        ({"metrics": [1]}, "metrics must be a JSON object"),
        ({"format_version": True}, "format_version True is not supported"),
        ({"format_version": 1.0}, "format_version 1.0 is not supported"),
        ({"ep_size": True}, "mistypes ep_size"),
        ({"method": 5}, "method=5 must be a string"),
        # refused before E**n is computed: 2**(10**12) did not finish
        ({"ngram_order": 10**12}, "n-gram columns is too many"),
    ],
)
def test_verify_refuses_what_load_refuses(tmp_path, hand_bundle, changes, message):
    path = save_bundle(hand_bundle, tmp_path / "b")
    edit_manifest(path, **changes)
    with pytest.raises(SchemaError, match=message):
        load_bundle_arrays(path)
    report = verify_bundle(path)
    assert not report["ok"] and message in report["error"]


def test_an_edited_file_size_is_refused(tmp_path, hand_bundle):
    path = save_bundle(hand_bundle, tmp_path / "b")
    files = json.loads((path / "manifest.json").read_text())["files"]
    files["tables.safetensors"]["bytes"] = 7  # the checksum left as it was
    edit_manifest(path, files=files)
    message = "manifest gives tables.safetensors 7 bytes but it holds"
    with pytest.raises(SchemaError, match=message):
        load_bundle_arrays(path)
    assert message in verify_bundle(path)["error"]


def test_capacity_violation_on_disk(tmp_path, hand_bundle):
    path = save_bundle(hand_bundle, tmp_path / "b")
    e2d = hand_bundle.expert_to_device.copy()
    e2d[1, 0] = 0
    rewrite_tables(path, expert_to_device=e2d)
    with pytest.raises(SchemaError, match=r"bundle .*: layer 1: device 0 hosts 3 experts"):
        load_bundle_arrays(path)
    report = verify_bundle(path)
    assert not report["ok"]
    assert report["layers"][0]["ok"] and not report["layers"][1]["ok"]
    assert "device 0 hosts 3 experts" in report["layers"][1]["problems"][0]


def test_missing_and_extra_tensors(tmp_path, hand_bundle):
    path = save_bundle(hand_bundle, tmp_path / "b")
    rewrite_tables(path, extra_table=np.zeros(3, np.int16))
    with pytest.raises(SchemaError, match="unexpected tensor"):
        load_bundle_arrays(path)


def test_other_manifest_problems(tmp_path, hand_bundle):
    with pytest.raises(InputError, match="no such directory"):
        load_bundle_arrays(tmp_path / "nope")
    path = save_bundle(hand_bundle, tmp_path / "b")
    (path / "manifest.json").write_text("{not json")
    with pytest.raises(SchemaError, match="manifest.json is not valid JSON"):
        load_bundle_arrays(path)
    path = save_bundle(hand_bundle, tmp_path / "c")
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["model"]["vocab_size"] = 13  # the fingerprint no longer matches
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(SchemaError, match="fingerprint .* does not match"):
        load_bundle_arrays(path)
    path = save_bundle(hand_bundle, tmp_path / "d")
    (path / "tables.safetensors").unlink()
    with pytest.raises(
        SchemaError, match="tables.safetensors is listed in the manifest but missing"
    ):
        load_bundle_arrays(path)
    # a listed name the file system cannot take raised a bare OSError (ENAMETOOLONG)
    path = save_bundle(hand_bundle, tmp_path / "e")
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["files"]["a" * 5000] = {"sha256": "x"}
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(SchemaError, match=r"a{80}\.\.\. is listed in the manifest but missing"):
        load_bundle_arrays(path)
    assert not verify_bundle(path)["ok"]


def test_extra_file_names_are_checked(tmp_path, hand_bundle):
    with pytest.raises(InputError, match="reserved"):
        save_bundle(hand_bundle, tmp_path / "b", extra_files={"manifest.json": b"x"})
    with pytest.raises(InputError, match="reserved"):
        save_bundle(hand_bundle, tmp_path / "b", extra_files={"../x.json": b"x"})
    with pytest.raises(InputError, match="reserved"):  # was a raw IsADirectoryError
        save_bundle(hand_bundle, tmp_path / "b", extra_files={"": b"x"})


# ---------------------------------------------------------------------------------------
# verify / compatibility


def test_verify_report(tmp_path, hand_bundle):
    path = save_bundle(hand_bundle, tmp_path / "b", extra_files={"notes.txt": b"hello"})
    report = verify_bundle(path)
    json.dumps(report)  # serialisable as promised
    assert report["ok"] and report["error"] is None
    assert report["ep_size"] == 4 and report["ngram_order"] == 2
    assert report["model"]["vocab_size"] == 12
    assert report["sizes"]["tensors"]["token_to_device"] == 2 * 12 * 2
    assert report["sizes"]["files"]["notes.txt"] == 5
    assert report["sizes"]["total_bytes"] == sum(p.stat().st_size for p in path.iterdir())
    assert [entry["layer"] for entry in report["layers"]] == [0, 1]
    assert report["layers"][0]["ngram_rows_defined"] == 0.0  # l < n
    (path / "notes.txt").write_bytes(b"HELLO")
    report = verify_bundle(path)
    assert not report["ok"]
    assert report["error"].endswith("notes.txt sha256 mismatch (file changed or corrupt)")
    assert not verify_bundle(tmp_path / "nope")["ok"]


def test_check_compatible(hand_bundle):
    check_compatible(hand_bundle, HAND_META)
    hand_bundle.check_compatible(dataclasses.replace(HAND_META, source="another trace"))
    with pytest.raises(MismatchError, match="vocab_size=12, but the trace has vocab_size=13"):
        check_compatible(hand_bundle, dataclasses.replace(HAND_META, vocab_size=13))
    with pytest.raises(MismatchError, match="model 'test/hand'.*model 'other/model'"):
        check_compatible(hand_bundle, dataclasses.replace(HAND_META, model="other/model"))
    with pytest.raises(MismatchError, match="MoE layer 1 is model layer 3"):
        check_compatible(hand_bundle, dataclasses.replace(HAND_META, moe_layer_indices=(1, 2)))


def test_bundle_for_a_real_model_shape_round_trips(tmp_path):
    meta = TraceMeta(
        model="shape/v3ish", num_layers=3, num_experts=32, top_k=4, vocab_size=1000,
        moe_layer_indices=(3, 4, 5),
    )  # fmt: skip
    rng = np.random.default_rng(3)
    e2d = np.stack([rng.permutation(32) % 8 for _ in range(3)])
    bundle = make_bundle(meta, 8, e2d, ngram_order=2, seed=3)
    assert load_bundle_arrays(save_bundle(bundle, tmp_path / "b")) == bundle


def test_loading_refuses_what_is_not_a_path():
    # None was Path()'s raw TypeError "expected str, bytes or os.PathLike object, not NoneType"
    for read in (load_bundle_arrays, verify_bundle):
        for bad in (None, 3, b"/tmp"):
            with pytest.raises(InputError, match=f"bundle {bad!r}: not a path"):
                read(bad)
        with pytest.raises(InputError, match="bundle path is empty"):  # was read as "."
            read("")


@pytest.mark.parametrize(
    "changes, field",
    [
        ({"moe_layer_indices": [5, 9]}, "moe_layer_indices"),  # which model layer a row is
        ({"source": None}, "source"),  # a counts table's plan would pass the engine checks
        ({"source": "tests 2"}, "source"),
    ],
)
def test_an_edited_layout_in_the_manifest_is_refused(tmp_path, hand_bundle, changes, field):
    """The fingerprint covers the model fields only: a manifest whose moe_layer_indices were
    edited verified as ok, and a re-export put the engines' rows on the edited layers. The
    tables' header keeps a copy, under the tables' sha256."""
    path = save_bundle(hand_bundle, tmp_path / "b")
    edit_manifest(path, **changes)
    with pytest.raises(SchemaError, match=f"manifest {field} .* the manifest was edited"):
        load_bundle_arrays(path)
    report = verify_bundle(path)
    assert not report["ok"] and f"manifest {field} " in report["error"]
    # a bundle written before the copy (no layout in its header) is read as it is
    old = save_bundle(hand_bundle, tmp_path / "old")
    rewrite_tables(old, keep_layout=False)
    assert load_bundle_arrays(old) == hand_bundle and verify_bundle(old)["ok"]


def test_a_bundle_saved_again_names_its_new_writer(tmp_path, hand_bundle):
    """A bundle read from an older moeplan and exported again kept "created_by": "moeplan
    0.0.1" although this version wrote every file."""
    old = save_bundle(hand_bundle, tmp_path / "old")
    edit_manifest(old, created_by="moeplan 0.0.1")
    loaded = load_bundle_arrays(old)
    assert loaded.created_by == "moeplan 0.0.1"  # what wrote the bundle read
    new = save_bundle(loaded, tmp_path / "new")
    manifest = json.loads((new / "manifest.json").read_text())
    assert manifest["created_by"] == f"moeplan {planner.__version__}"

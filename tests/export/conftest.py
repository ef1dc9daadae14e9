"""Fixtures for bundle and engine-format tests: a tiny model and a hand-written placement."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import safetensors
import safetensors.numpy

from planner.export import Bundle
from planner.trace import TraceMeta

GOLDEN = Path(__file__).parent / "golden"

# 4 decoder layers; layers 0 and 2 are dense, MoE layers sit at model layers 1 and 3.
# N = 8 experts, E = 4 devices (2 experts each).
HAND_META = TraceMeta(
    model="test/hand", num_layers=2, num_experts=8, top_k=2, vocab_size=12,
    moe_layer_indices=(1, 3), source="tests",
)  # fmt: skip
HAND_EP = 4
HAND_NUM_MODEL_LAYERS = 4
HAND_EXPERT_TO_DEVICE = np.array(
    [
        [0, 1, 2, 3, 0, 1, 2, 3],  # expert e on device e % 4
        [3, 3, 2, 2, 1, 1, 0, 0],  # experts 2d, 2d+1 on device 3 - d
    ]
)
# Slots 2d, 2d+1 live on device d; ascending logical id within a device.
HAND_PERMUTATION = np.array(
    [
        [0, 4, 1, 5, 2, 6, 3, 7],
        [6, 7, 4, 5, 2, 3, 0, 1],
    ]
)


def make_bundle(
    meta: TraceMeta = HAND_META,
    ep_size: int = HAND_EP,
    expert_to_device: np.ndarray = HAND_EXPERT_TO_DEVICE,
    ngram_order: int = 2,
    seed: int = 0,
) -> Bundle:
    """A valid bundle with random token / n-gram tables around a given placement."""
    rng = np.random.default_rng(seed)
    big_l, v, cols = meta.num_layers, meta.vocab_size, ep_size**ngram_order
    ngram_conf = rng.random((big_l, cols))
    ngram_conf[:ngram_order] = 0  # undefined for l < n
    return Bundle.from_arrays(
        meta,
        ep_size=ep_size,
        expert_to_device=expert_to_device,
        token_to_device=rng.integers(0, ep_size, (big_l, v)),
        token_confidence=rng.random((big_l, v)),
        ngram_to_device=rng.integers(0, ep_size, (big_l, cols)),
        ngram_confidence=ngram_conf,
        ngram_order=ngram_order,
        method="test",
        seed=seed,
        metrics={"lar": 0.5, "lar_balanced": 0.25},
    )


@pytest.fixture
def hand_bundle() -> Bundle:
    return make_bundle()


def rewrite_tables(path: Path, *, keep_layout: bool = True, **replace: np.ndarray) -> None:
    """Replace tensors in a saved bundle and fix the manifest's sha256 and size (a 'valid'
    edit); ``keep_layout=False`` drops the header's copy of the manifest's layout fields,
    as in a bundle written before the copy was kept."""
    with safetensors.safe_open(path / "tables.safetensors", "np") as f:
        metadata = f.metadata() if keep_layout else None
    tables = safetensors.numpy.load_file(path / "tables.safetensors")
    tables = {k: np.array(v) for k, v in tables.items()} | replace
    safetensors.numpy.save_file(tables, path / "tables.safetensors", metadata=metadata)
    manifest = json.loads((path / "manifest.json").read_text())
    data = (path / "tables.safetensors").read_bytes()
    entry = manifest["files"]["tables.safetensors"]
    entry["sha256"], entry["bytes"] = hashlib.sha256(data).hexdigest(), len(data)
    (path / "manifest.json").write_text(json.dumps(manifest))


def edit_manifest(path: Path, **changes) -> None:
    manifest = json.loads((path / "manifest.json").read_text())
    manifest.update(changes)
    (path / "manifest.json").write_text(json.dumps(manifest))

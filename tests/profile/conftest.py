"""Tiny randomly initialised checkpoints of every supported architecture, saved to disk with a
tiny word-level tokenizer, shared by the profile tests (built once per session)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.profile.tiny_models import ARCH_CONFIGS, build_model, save_tokenizer


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    """model_type -> saved checkpoint directory (model + tokenizer) for all 8 architectures."""
    root = tmp_path_factory.mktemp("models")
    dirs = {}
    for model_type, overrides in ARCH_CONFIGS.items():
        dest = root / f"tiny-{model_type}"
        build_model(model_type, overrides).save_pretrained(dest)
        save_tokenizer(dest)
        dirs[model_type] = dest
    return dirs


@pytest.fixture(scope="session")
def dense_model_dir(tmp_path_factory) -> Path:
    """A tiny dense (non-MoE) Qwen3 checkpoint."""
    dest = tmp_path_factory.mktemp("dense") / "tiny-qwen3"
    build_model("qwen3", dict(head_dim=8)).save_pretrained(dest)
    save_tokenizer(dest)
    return dest

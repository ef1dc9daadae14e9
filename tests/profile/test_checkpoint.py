"""Checkpoint inspection before any weights load: names, errors, shapes from the config."""

from __future__ import annotations

import json

import pytest
from transformers import AutoConfig

from planner.errors import InputError, ModelError
from planner.profile.checkpoint import checkpoint_name, inspect_checkpoint
from tests.profile.tiny_models import save_tokenizer


def test_checkpoint_name(tmp_path):
    plain = tmp_path / "my-moe"
    assert checkpoint_name(plain, {}) == "my-moe"
    assert checkpoint_name(plain, {"_name_or_path": "Qwen/Qwen3-30B-A3B"}) == "Qwen/Qwen3-30B-A3B"
    assert checkpoint_name(plain, {"_name_or_path": "/abs/path/model"}) == "my-moe"
    snapshot = tmp_path / "hub" / "models--allenai--OLMoE-1B-7B-0924" / "snapshots" / "abc123"
    assert checkpoint_name(snapshot, {}) == "allenai/OLMoE-1B-7B-0924"


def test_inspect_reads_shapes_without_weights(tmp_path):
    path = tmp_path / "ds"
    AutoConfig.for_model(
        "deepseek_v3", num_hidden_layers=5, first_k_dense_replace=2, n_routed_experts=16,
        num_experts_per_tok=4, vocab_size=1000, n_group=4, topk_group=2,
    ).save_pretrained(path)  # fmt: skip
    save_tokenizer(path)
    info = inspect_checkpoint(path)
    assert (info.model_type, info.num_experts, info.top_k, info.vocab_size) == (
        "deepseek_v3", 16, 4, 1000,
    )  # fmt: skip
    assert info.moe_layer_indices == (2, 3, 4)
    assert info.name == "ds"


def test_inspect_errors(tmp_path):
    with pytest.raises(InputError, match="does not exist"):
        inspect_checkpoint(tmp_path / "missing")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text("{not json")
    with pytest.raises(InputError, match="not valid JSON"):
        inspect_checkpoint(bad)
    (bad / "config.json").write_text(json.dumps({"model_type": "mixtral", "num_local_experts": 8,
                                                 "num_experts_per_tok": 2}))  # fmt: skip
    with pytest.raises(ModelError, match="no tokenizer in the directory"):
        inspect_checkpoint(bad)

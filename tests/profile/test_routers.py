"""The architecture registry: which configs are supported, MoE, or neither."""

from __future__ import annotations

import pytest
from transformers import AutoConfig

from planner.errors import ModelError
from planner.profile.routers import ADAPTERS, adapter_for, check_moe_config

REQUIRED = {
    "mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v2", "deepseek_v3", "gpt_oss",
    "phimoe",
}  # fmt: skip


def test_registry_covers_required_architectures():
    assert set(ADAPTERS) >= REQUIRED
    for model_type, adapter in ADAPTERS.items():
        assert adapter.model_type == model_type


@pytest.mark.parametrize("model_type", sorted(REQUIRED))
def test_default_config_of_each_architecture_is_moe(model_type):
    # deepseek_v2's config class leaves num_experts_per_tok unset (checkpoints set it).
    extra = {"num_experts_per_tok": 6} if model_type == "deepseek_v2" else {}
    config = AutoConfig.for_model(model_type, **extra)
    adapter = adapter_for(config.to_dict(), "x")
    layers = check_moe_config(adapter, config, "x")
    assert layers and all(0 <= i < config.num_hidden_layers for i in layers)
    assert 0 < adapter.top_k(config) <= adapter.num_experts(config)


def test_unsupported_moe_architecture_lists_supported_ones():
    raw = {"model_type": "granitemoe", "num_local_experts": 8, "num_experts_per_tok": 2}
    with pytest.raises(ModelError, match="unsupported architecture 'granitemoe'; supported: ") as e:
        adapter_for(raw, "dir")
    assert all(name in str(e.value) for name in REQUIRED)


def test_nested_text_config_with_experts_is_unsupported_not_dense():
    raw = {"model_type": "some_vl_moe", "text_config": {"num_experts": 64}}
    with pytest.raises(ModelError, match="unsupported architecture"):
        adapter_for(raw, "dir")


@pytest.mark.parametrize(
    "raw",
    [
        {"model_type": "llama", "hidden_size": 64},
        {"model_type": "qwen3", "num_experts": 0},
        {"hidden_size": 64},
    ],
)
def test_dense_config_is_not_moe(raw):
    with pytest.raises(ModelError, match="is not an MoE model"):
        adapter_for(raw, "dir")


def test_supported_type_without_experts_is_not_moe():
    config = AutoConfig.for_model("qwen2_moe", num_experts=0)
    with pytest.raises(ModelError, match="not an MoE model"):
        check_moe_config(ADAPTERS["qwen2_moe"], config, "dir")
    config = AutoConfig.for_model("qwen3_moe", num_hidden_layers=2, mlp_only_layers=[0, 1])
    with pytest.raises(ModelError, match="not an MoE model"):
        check_moe_config(ADAPTERS["qwen3_moe"], config, "dir")


def test_moe_layer_rules():
    qwen = AutoConfig.for_model("qwen2_moe", num_hidden_layers=6, decoder_sparse_step=2,
                                mlp_only_layers=[3])  # fmt: skip
    assert check_moe_config(ADAPTERS["qwen2_moe"], qwen, "x") == [1, 5]
    ds = AutoConfig.for_model("deepseek_v3", num_hidden_layers=5, first_k_dense_replace=2)
    assert check_moe_config(ADAPTERS["deepseek_v3"], ds, "x") == [2, 3, 4]
    unset_k = AutoConfig.for_model("deepseek_v2")
    with pytest.raises(ModelError, match="top-k=0"):
        check_moe_config(ADAPTERS["deepseek_v2"], unset_k, "x")
    assert ADAPTERS["phimoe"].top_k(AutoConfig.for_model("phimoe", num_experts_per_tok=4)) == 2

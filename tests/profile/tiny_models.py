"""Builders of tiny randomly initialised MoE checkpoints, a tiny tokenizer and prompts files
for the profile tests."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

VOCAB_WORDS = [
    "the",
    "a",
    "of",
    "and",
    "to",
    "in",
    "is",
    "was",
    "for",
    "on",
    "with",
    "as",
    "by",
    "at",
    "from",
    "it",
    "that",
    "this",
    "be",
    "are",
    "or",
    "an",
    "model",
    "expert",
    "token",
    "layer",
    "route",
    "gate",
    "weight",
    "prompt",
    "code",
    "math",
    "story",
    "cat",
    "dog",
    "sun",
    "moon",
    "red",
    "blue",
    "green",
    "fast",
    "slow",
    "big",
    "small",
    "one",
    "two",
    "three",
    "four",
    "five",
    "six",
    "seven",
    "eight",
    "nine",
    "ten",
    "def",
    "return",
    "print",
    "if",
    "else",
    "while",
    "x",
    "y",
    "z",
]
SPECIALS = ["[PAD]", "[UNK]", "[BOS]"]
VOCAB_SIZE = 72

_COMMON = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    pad_token_id=0,
    bos_token_id=2,
    eos_token_id=1,
    tie_word_embeddings=False,
)
_MLA = dict(
    num_key_value_heads=4,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=8,
    v_head_dim=8,
    moe_intermediate_size=16,
    n_shared_experts=1,
    first_k_dense_replace=1,
    n_group=4,
    topk_group=2,
)

# model_type -> config overrides: 8 experts, top-2, settings that exercise each routing rule.
ARCH_CONFIGS: dict[str, dict] = {
    "mixtral": dict(num_local_experts=8, num_experts_per_tok=2),
    "qwen2_moe": dict(
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=32,
        norm_topk_prob=False,
    ),
    "qwen3_moe": dict(
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        norm_topk_prob=True,
        head_dim=8,
        num_hidden_layers=4,
        decoder_sparse_step=2,
    ),  # fmt: skip
    "olmoe": dict(num_experts=8, num_experts_per_tok=2, norm_topk_prob=False),
    "deepseek_v2": _MLA
    | dict(
        n_routed_experts=8,
        num_experts_per_tok=2,
        q_lora_rank=None,
        topk_method="group_limited_greedy",
        routed_scaling_factor=1.5,
    ),
    "deepseek_v3": _MLA
    | dict(
        n_routed_experts=8,
        num_experts_per_tok=2,
        q_lora_rank=16,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
    ),
    "gpt_oss": dict(num_local_experts=8, num_experts_per_tok=2, head_dim=8, sliding_window=16),
    "phimoe": dict(num_local_experts=8, num_experts_per_tok=2, router_jitter_noise=0.5),
}

# model_type -> model layer indices that hold an MoE block.
EXPECTED_MOE_LAYERS = {
    "qwen3_moe": (1, 3),
    "deepseek_v2": (1, 2),
    "deepseek_v3": (1, 2),
}


def save_tokenizer(dest: Path) -> None:
    """A word-level tokenizer (whitespace split, [BOS] prepended) over VOCAB_WORDS."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(SPECIALS + VOCAB_WORDS)}
    assert len(vocab) <= VOCAB_SIZE
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(
        single="[BOS] $A", special_tokens=[("[BOS]", vocab["[BOS]"])]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", bos_token="[BOS]"
    )
    fast.save_pretrained(dest)


def build_model(model_type: str, overrides: dict, seed: int = 0):
    """A randomly initialised causal LM whose routers make clear (not near-tied) choices."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, **(_COMMON | overrides))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    scale = 3.0 / math.sqrt(config.hidden_size)
    with torch.no_grad():
        for module in model.modules():
            if type(module).__name__.endswith(("TopKRouter", "TopkRouter")):
                module.weight.copy_(torch.randn(module.weight.shape, generator=gen) * scale)
                if getattr(module, "bias", None) is not None:
                    module.bias.copy_(torch.randn(module.bias.shape, generator=gen) * 0.5)
                if hasattr(module, "e_score_correction_bias"):
                    bias = torch.randn(module.e_score_correction_bias.shape, generator=gen)
                    module.e_score_correction_bias.copy_(bias * 0.3)
    return model


def write_prompts(path: Path, texts: list[str], domains: list[str] | None = None) -> Path:
    with path.open("w") as f:
        for i, text in enumerate(texts):
            row = {"text": text, "id": f"p{i}"}
            if domains is not None:
                row["domain"] = domains[i]
            f.write(json.dumps(row) + "\n")
    return path


def sample_texts(n: int, seed: int = 0) -> list[str]:
    """n prompts of varied length (1 to 40 words), some with out-of-vocabulary words."""
    gen = torch.Generator().manual_seed(seed)
    words = VOCAB_WORDS + ["zebra", "quux"]
    texts = []
    for _ in range(n):
        length = int(torch.randint(1, 41, (1,), generator=gen))
        picks = torch.randint(0, len(words), (length,), generator=gen).tolist()
        texts.append(" ".join(words[i] for i in picks))
    return texts

"""The bundled example: the committed tiny Qwen3-MoE model, its prompts, and train.py."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from planner.profile.prompts import read_prompts
from tests.conftest import child_env, load_script

REPO = Path(__file__).resolve().parents[2]
TRAIN_PY = REPO / "examples" / "tiny_moe" / "train.py"
MODEL_DIR = REPO / "examples" / "tiny_moe" / "model"
PROMPTS = REPO / "examples" / "prompts.jsonl"
FRESH_PROMPTS = REPO / "examples" / "prompts_fresh.jsonl"
MAX_SAFETENSORS_BYTES = 25 * 1000 * 1000


train_mod = load_script(TRAIN_PY, "tiny_moe_train")


def _prompt_objects(path: Path = PROMPTS) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


@pytest.fixture(scope="module")
def model_and_tokenizer():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(MODEL_DIR, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(MODEL_DIR, local_files_only=True)
    model.eval()
    # One thread: on cores shared with other processes, spinning OpenMP workers made these
    # small forward passes 20x slower (11.7 s vs 0.4 s measured).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield model, tokenizer
    torch.set_num_threads(threads)


# --- the committed model ---------------------------------------------------------------


def test_committed_model_files_and_size():
    for name in ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json"):
        assert (MODEL_DIR / name).is_file(), name
    assert (MODEL_DIR / "model.safetensors").stat().st_size <= MAX_SAFETENSORS_BYTES
    assert (MODEL_DIR / "TRAINING.md").is_file()


def test_committed_model_architecture(model_and_tokenizer):
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    model, tokenizer = model_and_tokenizer
    cfg = model.config
    assert cfg.model_type == "qwen3_moe"
    assert cfg.num_experts >= 16
    assert cfg.num_experts_per_tok >= 2
    moe_blocks = [m for m in model.modules() if isinstance(m, Qwen3MoeSparseMoeBlock)]
    assert len(moe_blocks) >= 4
    assert model.dtype == torch.float32
    assert cfg.vocab_size == len(tokenizer)
    for special in (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id):
        assert special is not None and 0 <= special < cfg.vocab_size


def test_committed_model_learned_and_routes_by_input(model_and_tokenizer):
    """Loss on held-out prompts is far below a uniform guess; routing uses many experts.

    An untrained model scores about ln(vocab) = 8.3 nats here; the committed one about 4-5.
    """
    model, tokenizer = model_and_tokenizer
    prompts = _prompt_objects()
    ln_vocab = math.log(model.config.vocab_size)
    k, n_exp = model.config.num_experts_per_tok, model.config.num_experts
    experts_seen = [set() for _ in range(model.config.num_hidden_layers)]
    with torch.no_grad():
        for domain in train_mod.DOMAINS:
            picked = [p for p in prompts if p["domain"] == domain][:5]
            nats, tokens = 0.0, 0
            for p in picked:
                ids = tokenizer(p["text"], return_tensors="pt")["input_ids"]
                # Byte-level BPE is lossless: the prompt decodes back to itself.
                assert tokenizer.decode(ids[0]) == p["text"]
                out = model(input_ids=ids, labels=ids, output_router_logits=True)
                nats += float(out.loss) * (ids.shape[1] - 1)
                tokens += ids.shape[1] - 1
                for layer, logits in enumerate(out.router_logits):
                    experts_seen[layer] |= set(logits.topk(k, dim=-1).indices.reshape(-1).tolist())
            assert nats / tokens < ln_vocab - 2.5, (domain, nats / tokens, ln_vocab)
    assert all(len(s) >= n_exp // 2 for s in experts_seen), [len(s) for s in experts_seen]


def test_training_log_matches_committed_model(model_and_tokenizer):
    model, _ = model_and_tokenizer
    log = json.loads((MODEL_DIR / "training_log.json").read_text())
    assert log["num_parameters"] == sum(p.numel() for p in model.parameters())
    assert log["config"]["num_experts"] == model.config.num_experts
    res = log["results"]
    assert res["final_train_lm_loss"] < 0.6 * res["ln_vocab"]
    routing = log["routing"]
    # Learned routing is more token-consistent than a uniform random router.
    assert routing["trained"]["topk_coverage_mean"] > routing["random"]["topk_coverage_mean"]


# --- prompts.jsonl ------------------------------------------------------------------------


@pytest.mark.parametrize("path", [PROMPTS, FRESH_PROMPTS], ids=["prompts", "fresh"])
def test_prompts_file_is_valid_and_balanced(path):
    objs = _prompt_objects(path)
    assert 200 <= len(objs) <= 400
    assert len({o["id"] for o in objs}) == len(objs)
    for o in objs:
        assert isinstance(o["text"], str) and o["text"].strip()
        assert 100 <= len(o["text"]) <= 600, o["id"]
        assert o["domain"] in train_mod.DOMAINS
    counts = {d: sum(o["domain"] == d for o in objs) for d in train_mod.DOMAINS}
    assert len(set(counts.values())) == 1, counts
    # The profiler's reader accepts it as is.
    assert len(read_prompts(path)) == len(objs)


@pytest.mark.parametrize("path", [PROMPTS, FRESH_PROMPTS], ids=["prompts", "fresh"])
def test_prompts_come_from_heldout_documents(path):
    objs = _prompt_objects(path)
    assert all(train_mod.is_heldout(o["source"]) for o in objs)


def test_fresh_prompts_share_no_prompt_with_the_first_set():
    """The second set is traffic no plan fitted on the first was shown: no text, no id."""
    first, fresh = _prompt_objects(PROMPTS), _prompt_objects(FRESH_PROMPTS)
    assert not {o["text"] for o in first} & {o["text"] for o in fresh}
    assert not {o["id"] for o in first} & {o["id"] for o in fresh}
    assert all(o["id"].startswith(f"{o['domain']}-fresh-") for o in fresh)


def test_fresh_prompts_are_drawn_from_the_chunks_the_first_set_left():
    # Twelve one-chunk documents per domain: the first set takes chunks 0, 4, 7 and 11.
    heldout = {
        d: [train_mod.Document(d, f"doc{i}", "word " * 40 + "\n") for i in range(12)]
        for d in train_mod.DOMAINS
    }
    text = dict.fromkeys(train_mod.DOMAINS, "")
    first = train_mod.make_prompts(heldout, text, 4, seed=0)
    fresh = train_mod.make_prompts(heldout, text, 4, seed=0, fresh=True)
    c_sources = [o["source"] for o in first if o["domain"] == "c"]
    assert c_sources == ["doc0", "doc4", "doc7", "doc11"]
    assert [o["source"] for o in fresh if o["domain"] == "c"] == ["doc1", "doc3", "doc8", "doc10"]
    with pytest.raises(RuntimeError, match="left for a fresh set"):
        train_mod.make_prompts(heldout, text, 7, seed=0, fresh=True)


# --- train.py helpers ----------------------------------------------------------------------


def test_topk_coverage_separates_fixed_from_random_routing():
    rng = np.random.default_rng(0)
    token_ids = rng.integers(0, 20, size=2000)
    fixed = np.stack([np.stack([(token_ids + r) % 16 for r in range(4)], axis=1)] * 3, axis=1)
    cov_fixed, n = train_mod.topk_coverage(token_ids, fixed, 16, min_occ=5)
    assert n == 20
    np.testing.assert_allclose(cov_fixed, 1.0)
    rand = train_mod.random_router(len(token_ids), 3, 16, 4, seed=0)
    assert (np.sort(rand, axis=-1)[..., 1:] != np.sort(rand, axis=-1)[..., :-1]).all()
    cov_rand, _ = train_mod.topk_coverage(token_ids, rand, 16, min_occ=5)
    assert (cov_rand < 0.5).all()


def test_split_documents_respects_caps_and_heldout_rule():
    docs = [
        train_mod.Document("c", f"doc{i}", "line\n" * (50 + i)) for i in range(200)
    ]  # fmt: skip
    train, heldout = train_mod.split_documents(docs, train_chars=3000, heldout_chars=800)
    assert sum(len(d.text) for d in train) <= 3000
    assert sum(len(d.text) for d in heldout) <= 800
    assert all(train_mod.is_heldout(d.name) for d in heldout)
    assert not any(train_mod.is_heldout(d.name) for d in train)


def test_lr_schedule_warms_up_then_decays_to_floor():
    cfg = train_mod.TrainConfig(steps=100, warmup_steps=10, peak_lr=1e-3, min_lr_ratio=0.1)
    lrs = [train_mod.lr_at(s, cfg) for s in range(cfg.steps)]
    assert lrs[0] == pytest.approx(1e-4)
    assert max(lrs) == pytest.approx(1e-3)
    assert lrs[-1] == pytest.approx(1e-4)
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:], strict=False))


# --- train.py end to end -------------------------------------------------------------------


@pytest.mark.slow
def test_quick_training_run_produces_a_loadable_model(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "model"
    prompts_out = tmp_path / "prompts.jsonl"
    cmd = [sys.executable, str(TRAIN_PY), "--quick", "--out", str(out)]
    cmd += ["--prompts-out", str(prompts_out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=child_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    model = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(out, local_files_only=True)
    assert model.config.num_experts >= 16 and len(tokenizer) == model.config.vocab_size
    log = json.loads((out / "training_log.json").read_text())
    # Even a few dozen steps move the loss well below a uniform guess.
    assert log["results"]["final_train_lm_loss"] < log["results"]["ln_vocab"] - 0.5
    assert len(read_prompts(prompts_out)) == 4 * log["config"]["prompts_per_domain"]
    assert not list(tmp_path.glob(".*.tmp"))  # atomic writes left nothing behind


@pytest.mark.slow
def test_prompts_regenerate_identically(tmp_path):
    """--prompts-only rebuilds the committed prompts byte for byte (same Python stdlib)."""
    log = json.loads((MODEL_DIR / "training_log.json").read_text())
    if log["versions"]["python"] != sys.version.split()[0]:
        pytest.skip(f"prompts were drawn from Python {log['versions']['python']}'s stdlib")
    out, fresh = tmp_path / "prompts.jsonl", tmp_path / "prompts_fresh.jsonl"
    cmd = [sys.executable, str(TRAIN_PY), "--prompts-only", "--prompts-out", str(out)]
    cmd += ["--fresh-prompts-out", str(fresh)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=child_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert out.read_bytes() == PROMPTS.read_bytes()
    assert fresh.read_bytes() == FRESH_PROMPTS.read_bytes()

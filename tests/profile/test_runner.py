"""profile_model on tiny random checkpoints of every supported architecture.

The recorded routing is compared with an independent re-implementation of each
architecture's routing math, applied to the hidden states each MoE block received when the
same prompt ran alone (no padding, no profiler hooks). The reference math is itself checked
against the model's own router module on the same inputs.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer

from planner.cli.main import main
from planner.errors import InputError
from planner.profile import ProfileConfig, profile_model
from planner.profile.runner import ProfileSession
from planner.trace.io import EMBEDDINGS_FILE, open_trace
from tests.profile.tiny_models import ARCH_CONFIGS, EXPECTED_MOE_LAYERS, sample_texts, write_prompts

NUM_PROMPTS = 12


# ---------------------------------------------------------------------------------------
# Reference routing, written from each architecture's definition. h: [T, H] float32.
# Each returns ids [T, k] and weights [T, k].


def _softmax_topk(h, router, config, renormalise):
    probs = F.softmax(h @ router.weight.float().T, dim=-1)
    w, i = probs.topk(config.num_experts_per_tok, dim=-1)
    return i, w / w.sum(-1, keepdim=True) if renormalise else w


def _deepseek_v2(h, router, config):
    scores = F.softmax(h @ router.weight.float().T, dim=-1)
    t, n = scores.shape
    if config.topk_method == "group_limited_greedy":
        groups = scores.view(t, config.n_group, n // config.n_group).max(-1).values
        keep = torch.zeros_like(groups).scatter(1, groups.topk(config.topk_group, -1)[1], 1.0)
        scores = scores * keep.repeat_interleave(n // config.n_group, dim=1)
    w, i = scores.topk(config.num_experts_per_tok, dim=-1)
    return i, w * config.routed_scaling_factor


def _deepseek_v3(h, router, config):
    scores = torch.sigmoid(h @ router.weight.float().T)
    t, n = scores.shape
    choice = scores + router.e_score_correction_bias.float()
    per_group = choice.view(t, config.n_group, n // config.n_group)
    group_score = per_group.topk(2, dim=-1).values.sum(-1)
    keep = torch.zeros_like(group_score).scatter(1, group_score.topk(config.topk_group, -1)[1], 1)
    choice = choice.masked_fill(keep.repeat_interleave(n // config.n_group, 1) == 0, -torch.inf)
    i = choice.topk(config.num_experts_per_tok, dim=-1).indices
    w = scores.gather(1, i)
    if config.norm_topk_prob:
        w = w / w.sum(-1, keepdim=True)
    return i, w * config.routed_scaling_factor


def _gpt_oss(h, router, config):
    logits = h @ router.weight.float().T + router.bias.float()
    top, i = logits.topk(config.num_experts_per_tok, dim=-1)
    return i, F.softmax(top, dim=-1)


def _phimoe(h, router, config):
    """sparsemixer at inference: two argmax picks, each weighted within a jitter window."""
    logits = h @ router.weight.float().T
    eps = config.router_jitter_noise
    picks, weights = [], []
    masked = logits
    for _ in range(2):
        best, pick = masked.max(-1, keepdim=True)
        far = (best - logits) / logits.abs().clamp(min=best) > 2 * eps
        window = F.softmax(masked.masked_fill(far, -torch.inf), dim=-1)
        picks.append(pick)
        weights.append(window.gather(1, pick))
        masked = masked.scatter(1, pick, -torch.inf)
    return torch.cat(picks, 1), torch.cat(weights, 1)


REFERENCE = {
    "mixtral": lambda h, r, c: _softmax_topk(h, r, c, True),
    "qwen2_moe": lambda h, r, c: _softmax_topk(h, r, c, c.norm_topk_prob),
    "qwen3_moe": lambda h, r, c: _softmax_topk(h, r, c, c.norm_topk_prob),
    "olmoe": lambda h, r, c: _softmax_topk(h, r, c, c.norm_topk_prob),
    "deepseek_v2": _deepseek_v2,
    "deepseek_v3": _deepseek_v3,
    "gpt_oss": _gpt_oss,
    "phimoe": _phimoe,
}


def _by_id(ids: np.ndarray, weights: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rows re-ordered by expert id, so routings compare regardless of tie order."""
    order = np.argsort(ids, axis=-1, kind="stable")
    return np.take_along_axis(ids, order, -1), np.take_along_axis(weights, order, -1)


def reference_routing(model_dir, model_type, texts):
    """Per prompt, alone: (token ids [S], ids [S, L, k], weights [S, L, k]) by reference math."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(model_dir)
    moe_blocks = [
        (i, layer.mlp)
        for i, layer in enumerate(model.model.layers)
        if hasattr(layer.mlp, "gate" if model_type not in ("gpt_oss", "phimoe") else "router")
        and "Router"
        in type(getattr(layer.mlp, "router", getattr(layer.mlp, "gate", None))).__name__
    ]
    captured: dict[int, torch.Tensor] = {}
    hooks = [
        block.register_forward_pre_hook(
            lambda m, args, i=i: captured.__setitem__(i, args[0].detach())
        )
        for i, block in moe_blocks
    ]
    out = []
    try:
        for text in texts:
            ids = tok(text)["input_ids"]
            with torch.no_grad():
                model(input_ids=torch.tensor([ids]))
                per_layer = []
                for i, block in moe_blocks:
                    h = captured[i].reshape(-1, model.config.hidden_size).float()
                    router = getattr(block, "router", None) or block.gate
                    ref_ids, ref_w = REFERENCE[model_type](h, router, model.config)
                    # The reference must agree with the model's own router on the same input.
                    _, own_w, own_ids = router(captured[i].reshape(-1, h.shape[-1]))
                    a, b = (
                        _by_id(ref_ids.numpy(), ref_w.numpy()),
                        _by_id(own_ids.numpy(), own_w.float().numpy()),
                    )
                    np.testing.assert_array_equal(a[0], b[0])
                    np.testing.assert_allclose(a[1], b[1], rtol=1e-5, atol=1e-6)
                    per_layer.append((ref_ids.numpy(), ref_w.numpy()))
            out.append(
                (
                    np.asarray(ids),
                    np.stack([p[0] for p in per_layer], 1),
                    np.stack([p[1] for p in per_layer], 1),
                )
            )
    finally:
        for h in hooks:
            h.remove()
    return [i for i, _ in moe_blocks], out


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    texts = sample_texts(NUM_PROMPTS)
    return write_prompts(path, texts, ["code", "math", "chat"] * (NUM_PROMPTS // 3))


@pytest.mark.parametrize("model_type", list(ARCH_CONFIGS))
def test_recorded_routing_equals_the_models_routing(model_type, model_dirs, prompts_file, tmp_path):
    model_dir = model_dirs[model_type]
    out = tmp_path / "trace"
    # Small parts and batches so that padding, length sorting and several parts all occur.
    config = ProfileConfig(batch_size=5, prompts_per_part=7, device="cpu")
    result = profile_model(model_dir, prompts_file, out, config, progress=False)

    trace = open_trace(out)
    meta = trace.meta
    moe_layers, reference = reference_routing(
        model_dir, model_type, [json.loads(line)["text"] for line in prompts_file.open()]
    )
    assert meta.model == model_dir.name
    assert meta.moe_layer_indices == tuple(moe_layers)
    assert meta.moe_layer_indices == EXPECTED_MOE_LAYERS.get(model_type, (0, 1, 2))
    assert (meta.num_layers, meta.num_experts, meta.top_k, meta.vocab_size) == (
        len(moe_layers), 8, 2, 72,
    )  # fmt: skip
    assert len(trace.parts) == 2 and result.parts_written == 2
    assert trace.extra_columns() == ["domain"]

    rows = trace.read_all(extras=("domain",))
    assert result.tokens == result.trace_tokens == len(rows) == sum(len(r[0]) for r in reference)
    order = np.lexsort((rows.position, rows.request_id))
    np.testing.assert_array_equal(order, np.arange(len(rows)))  # rows sorted
    assert np.all(np.diff(rows.weights.astype(np.float32), axis=-1) <= 0)  # descending
    for request, (token_ids, ref_ids, ref_w) in enumerate(reference):
        mine = rows.select(rows.request_id == request)
        np.testing.assert_array_equal(mine.position, np.arange(len(token_ids)))
        np.testing.assert_array_equal(mine.token_id, token_ids)
        assert set(mine.extras["domain"]) == {["code", "math", "chat"][request % 3]}
        got_ids, got_w = _by_id(mine.experts.astype(np.int64), mine.weights.astype(np.float32))
        want_ids, want_w = _by_id(ref_ids, ref_w)
        np.testing.assert_array_equal(got_ids, want_ids)
        np.testing.assert_allclose(got_w, want_w, rtol=1e-3, atol=1e-3)


def test_scaling_factor_is_included_and_documented(model_dirs, prompts_file, tmp_path):
    out = tmp_path / "t"
    profile_model(model_dirs["deepseek_v3"], prompts_file, out, ProfileConfig(), progress=False)
    trace = open_trace(out)
    assert "routed_scaling_factor=2.5" in trace.meta.source
    sums = trace.read_all().weights.astype(np.float32).sum(-1)
    np.testing.assert_allclose(sums, 2.5, rtol=2e-3)  # norm_topk_prob, then scaled


def test_unnormalised_weights_sum_below_one(model_dirs, prompts_file, tmp_path):
    out = tmp_path / "t"
    profile_model(model_dirs["olmoe"], prompts_file, out, ProfileConfig(), progress=False)
    sums = open_trace(out).read_all().weights.astype(np.float32).sum(-1)
    # No renormalisation: sums below 1 (up to fp16 rounding), well below on average.
    assert np.all(sums <= 1.0 + 1e-3) and np.all(sums > 2 / 8 - 1e-3) and sums.mean() < 0.95


def test_truncation_and_embeddings(model_dirs, prompts_file, tmp_path):
    from safetensors.numpy import load_file

    out = tmp_path / "t"
    config = ProfileConfig(max_length=6, max_prompts=5, save_embeddings=True)
    result = profile_model(model_dirs["mixtral"], prompts_file, out, config, progress=False)
    rows = open_trace(out).read_all()
    assert rows.position.max() == 5 and set(rows.request_id.tolist()) == set(range(5))
    assert result.prompts_selected == 5
    emb = load_file(out / EMBEDDINGS_FILE)["embeddings"]
    model = AutoModelForCausalLM.from_pretrained(model_dirs["mixtral"])
    want = model.get_input_embeddings().weight.detach().numpy()
    assert emb.shape == (72, 32) and emb.dtype == np.float32
    np.testing.assert_array_equal(emb, want)


def test_bfloat16_run_is_a_valid_trace(model_dirs, prompts_file, tmp_path):
    out = tmp_path / "t"
    config = ProfileConfig(dtype="bfloat16", max_prompts=4)
    profile_model(model_dirs["qwen3_moe"], prompts_file, out, config, progress=False)
    trace = open_trace(out)
    assert "bfloat16" in trace.meta.source
    rows = trace.read_all()
    assert len(rows) > 0 and np.isfinite(rows.weights.astype(np.float32)).all()


def test_bfloat16_run_keeps_embeddings_beyond_the_float16_range(model_dirs, prompts_file, tmp_path):
    """A bfloat16 run saved float16 embeddings: a value beyond 65504 became inf, and
    `moeplan fit` then refused the file as not finite."""
    from planner.predict.affinity import load_embeddings
    from tests.profile.tiny_models import save_tokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dirs["qwen3_moe"])
    with torch.no_grad():
        model.get_input_embeddings().weight[3, 0] = 1.0e6
    model_dir = tmp_path / "big"
    model.save_pretrained(model_dir)
    save_tokenizer(model_dir)
    out = tmp_path / "t"
    config = ProfileConfig(dtype="bfloat16", max_prompts=2, save_embeddings=True)
    profile_model(model_dir, prompts_file, out, config, progress=False)
    meta = open_trace(out).meta
    emb = load_embeddings(out / EMBEDDINGS_FILE, meta.vocab_size, meta.fingerprint())
    assert emb is not None and np.isfinite(emb).all()
    want = model.get_input_embeddings().weight.detach().to(torch.bfloat16).float().numpy()
    np.testing.assert_array_equal(emb, want)


def test_resume_after_interruption_equals_a_clean_run(
    model_dirs, prompts_file, tmp_path, monkeypatch
):
    model_dir = model_dirs["qwen3_moe"]
    config = ProfileConfig(batch_size=3, prompts_per_part=3)
    clean = tmp_path / "clean"
    profile_model(model_dir, prompts_file, clean, config, progress=False)

    out = tmp_path / "resumed"
    # 1) a run stopped by --max-prompts; 2) a run killed while profiling its third part.
    profile_model(model_dir, prompts_file, out, ProfileConfig(max_prompts=4, prompts_per_part=3),
                  progress=False)  # fmt: skip
    calls = {"n": 0}
    real = ProfileSession.profile

    def interrupted(self, prompts):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real(self, prompts)

    monkeypatch.setattr(ProfileSession, "profile", interrupted)
    with pytest.raises(KeyboardInterrupt):
        profile_model(model_dir, prompts_file, out, ProfileConfig(resume=True, prompts_per_part=3),
                      progress=False)  # fmt: skip
    monkeypatch.setattr(ProfileSession, "profile", real)
    partial = open_trace(out, unfinished=True).request_ids().tolist()
    assert partial == list(range(4 + 2 * 3))  # 4 first, then two finished parts of 3
    # Until it is resumed to the end, no other command takes the stopped run's parts.
    with pytest.raises(InputError, match="profile run writing this trace has not finished"):
        open_trace(out)
    assert main(["trace", "info", str(out)]) == 2
    # nor one of its parts named on its own
    with pytest.raises(InputError, match="writing this trace part has not finished"):
        open_trace(next(out.glob("part-*.parquet")))

    result = profile_model(model_dir, prompts_file, out, ProfileConfig(resume=True), progress=False)
    assert result.prompts_resumed == 10 and result.prompts_profiled == NUM_PROMPTS - 10
    got, want = open_trace(out).read_all(), open_trace(clean).read_all()
    key = np.lexsort((got.position, got.request_id))
    got = got.select(key)
    assert len(got) == len(want) == result.trace_tokens
    np.testing.assert_array_equal(got.request_id, want.request_id)
    np.testing.assert_array_equal(got.position, want.position)
    np.testing.assert_array_equal(got.token_id, want.token_id)
    np.testing.assert_array_equal(got.experts, want.experts)
    np.testing.assert_allclose(got.weights.astype(np.float32), want.weights.astype(np.float32),
                               atol=1e-3)  # fmt: skip
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # no temp leftovers

    # Resuming a finished run does nothing.
    again = profile_model(model_dir, prompts_file, out, ProfileConfig(resume=True), progress=False)
    assert again.prompts_profiled == 0 and again.parts_written == 0


def test_non_empty_out_dir_needs_resume(model_dirs, prompts_file, tmp_path):
    out = tmp_path / "t"
    out.mkdir()
    (out / "something").write_text("x")
    # no profile.json: no run --resume could continue, so it is not suggested (it was, and
    # --resume then said "not a moeplan profile run")
    with pytest.raises(InputError, match="not empty and holds no profile run; choose another"):
        profile_model(model_dirs["olmoe"], prompts_file, out, ProfileConfig(), progress=False)
    (out / "profile.json").write_text("{}")
    with pytest.raises(InputError, match="not empty; pass --resume"):
        profile_model(model_dirs["olmoe"], prompts_file, out, ProfileConfig(), progress=False)


def test_resume_with_other_settings_is_refused(model_dirs, prompts_file, tmp_path):
    out = tmp_path / "t"
    config = ProfileConfig(max_prompts=2)
    profile_model(model_dirs["olmoe"], prompts_file, out, config, progress=False)
    # the tiny models hold 256 positions: the default 512 runs (and is recorded) as 256
    with pytest.raises(InputError, match="max_length: 256 -> 16"):
        profile_model(model_dirs["olmoe"], prompts_file, out,
                      ProfileConfig(resume=True, max_length=16), progress=False)  # fmt: skip


def test_resume_with_fewer_prompts_than_recorded_is_refused(model_dirs, prompts_file, tmp_path):
    """A resume with a smaller --max-prompts reported success while the trace kept every
    prompt it held."""
    out = tmp_path / "t"
    profile_model(model_dirs["olmoe"], prompts_file, out, ProfileConfig(max_prompts=3),
                  progress=False)  # fmt: skip
    before = sorted(p.read_bytes() for p in out.glob("part-*.parquet"))
    with pytest.raises(InputError, match="already holds 1 prompt.s. beyond the 2 that"):
        profile_model(model_dirs["olmoe"], prompts_file, out,
                      ProfileConfig(max_prompts=2, resume=True), progress=False)  # fmt: skip
    assert sorted(p.read_bytes() for p in out.glob("part-*.parquet")) == before
    assert json.loads((out / "profile.json").read_text())["finished"]


def test_the_run_records_the_length_it_truncated_to(model_dirs, prompts_file, tmp_path):
    """A --max-length beyond the model's positions is recorded as the positions it ran with,
    and a resume asking for another length beyond them continues the same run."""
    out = tmp_path / "t"
    config = ProfileConfig(max_prompts=2, max_length=100_000)
    profile_model(model_dirs["olmoe"], prompts_file, out, config, progress=False)
    assert json.loads((out / "profile.json").read_text())["max_length"] == 256
    again = ProfileConfig(max_prompts=3, max_length=4096, resume=True)
    profile_model(model_dirs["olmoe"], prompts_file, out, again, progress=False)
    assert len(set(open_trace(out).read_all().request_id.tolist())) == 3


@pytest.mark.parametrize(
    "kwargs, message",
    [({"batch_size": 0}, "batch-size=0 must be a positive integer"),
     ({"max_length": -1}, "max-length=-1 must be a positive integer"),
     ({"max_prompts": 0}, "max-prompts=0 must be a positive integer"),
     ({"device": "tpu"}, "device 'tpu' is not one of cpu, cuda"),
     ({"dtype": "int8"}, "dtype 'int8' is not one of")],
)  # fmt: skip
def test_bad_config_values(kwargs, message):
    with pytest.raises(InputError, match=message):
        ProfileConfig(**kwargs)


def test_resume_with_another_prompts_file_is_refused(model_dirs, prompts_file, tmp_path):
    first = tmp_path / "p3.jsonl"
    first.write_text("".join(prompts_file.read_text().splitlines(keepends=True)[:3]))
    other = tmp_path / "other.jsonl"
    other.write_text("".join(prompts_file.read_text().splitlines(keepends=True)[3:8]))
    out = tmp_path / "t"
    profile_model(model_dirs["olmoe"], first, out, ProfileConfig(), progress=False)
    with pytest.raises(InputError, match="cannot resume with a different prompts file"):
        profile_model(model_dirs["olmoe"], other, out, ProfileConfig(resume=True), progress=False)
    # The same file edited in place is refused too; an identical copy is the same prompts.
    copy = tmp_path / "copy.jsonl"
    copy.write_text(first.read_text())
    result = profile_model(model_dirs["olmoe"], copy, out, ProfileConfig(resume=True),
                           progress=False)  # fmt: skip
    assert result.prompts_resumed == 3 and result.prompts_profiled == 0
    first.write_text(first.read_text() + '{"text": "one more"}\n')
    with pytest.raises(InputError, match="cannot resume with a different prompts file"):
        profile_model(model_dirs["olmoe"], first, out, ProfileConfig(resume=True), progress=False)


def test_resume_of_a_run_without_prompts_hash_still_works(model_dirs, prompts_file, tmp_path):
    out = tmp_path / "t"
    profile_model(model_dirs["olmoe"], prompts_file, out, ProfileConfig(max_prompts=2),
                  progress=False)  # fmt: skip
    settings = json.loads((out / "profile.json").read_text())
    del settings["prompts_sha256"]  # as written by an older moeplan
    (out / "profile.json").write_text(json.dumps(settings))
    result = profile_model(model_dirs["olmoe"], prompts_file, out, ProfileConfig(resume=True),
                           progress=False)  # fmt: skip
    assert result.prompts_resumed == 2 and result.prompts_profiled == NUM_PROMPTS - 2


def test_domain_column_is_decided_by_the_whole_prompts_file(model_dirs, tmp_path):
    import pyarrow.parquet as pq

    path = write_prompts(tmp_path / "p.jsonl", sample_texts(5))
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    for i, row in enumerate(rows):
        if i >= 2:
            row["domain"] = "code"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    model = model_dirs["olmoe"]
    clean, out = tmp_path / "clean", tmp_path / "resumed"
    profile_model(model, path, clean, ProfileConfig(), progress=False)
    profile_model(model, path, out, ProfileConfig(max_prompts=2), progress=False)
    profile_model(model, path, out, ProfileConfig(resume=True), progress=False)
    parts = sorted(out.glob("part-*.parquet"))
    assert len(parts) == 2
    assert all("domain" in pq.read_schema(p).names for p in parts)
    got = open_trace(out).read_all(extras=("domain",))
    want = open_trace(clean).read_all(extras=("domain",))
    np.testing.assert_array_equal(got.request_id, want.request_id)
    assert got.extras["domain"].tolist() == want.extras["domain"].tolist()
    assert set(want.extras["domain"][want.request_id < 2]) == {""}


@pytest.mark.parametrize("content", ["predictor", "profile_json_of_something_else"])
def test_resume_into_a_directory_that_is_not_a_profile_run(model_dirs, prompts_file, tmp_path,
                                                           content):  # fmt: skip
    out = tmp_path / "not-a-run"
    out.mkdir()
    if content == "predictor":
        (out / "manifest.json").write_text("{}")
    else:
        (out / "profile.json").write_text('{"name": "another tool"}')
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(InputError, match="is not a moeplan profile run"):
        profile_model(model_dirs["olmoe"], prompts_file, out, ProfileConfig(resume=True),
                      progress=False)  # fmt: skip
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_resume_into_the_model_directory_is_refused(model_dirs, prompts_file):
    model = model_dirs["olmoe"]
    before = sorted(p.name for p in model.iterdir())
    # refused as the run's own input, before it could be taken for an earlier run
    with pytest.raises(InputError, match="reads its input"):
        profile_model(model, prompts_file, model, ProfileConfig(resume=True), progress=False)
    assert sorted(p.name for p in model.iterdir()) == before


def test_resume_into_a_missing_directory_starts_fresh(model_dirs, prompts_file, tmp_path):
    out = tmp_path / "new"
    result = profile_model(model_dirs["olmoe"], prompts_file, out,
                           ProfileConfig(resume=True, max_prompts=2), progress=False)  # fmt: skip
    assert result.prompts_resumed == 0 and result.prompts_profiled == 2

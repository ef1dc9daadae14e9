"""Edge cases of ``moeplan profile``: malformed inputs are one line, never a traceback, and
nothing silently wrong reaches a trace."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from planner.cli.main import main
from planner.errors import InputError, ModelError
from planner.profile import ProfileConfig, profile_model, read_prompts
from planner.trace.io import open_trace
from tests.profile.tiny_models import (
    ARCH_CONFIGS,
    build_model,
    sample_texts,
    save_tokenizer,
    write_prompts,
)


@pytest.fixture
def prompts(tmp_path):
    return write_prompts(tmp_path / "prompts.jsonl", sample_texts(5, seed=3))


def _error_line(capsys, args) -> str:
    """The one error line of a failed command (after a progress bar, if one was drawn)."""
    code = main(args)
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err, err
    line = err.strip().splitlines()[-1]
    assert line.startswith("moeplan: error: "), err
    return line


def _copy_with_config(src, dest, **changes):
    shutil.copytree(src, dest)
    config = json.loads((dest / "config.json").read_text())
    config.update(changes)
    (dest / "config.json").write_text(json.dumps(config))
    return dest


def _copy_with_router_weights(src, dest, edit):
    """A copy of a checkpoint whose layer-1 router weight is ``edit(weight)``."""
    shutil.copytree(src, dest)
    tensors = load_file(dest / "model.safetensors")
    (key,) = [k for k in tensors if k.startswith("model.layers.1.") and k.endswith("gate.weight")]
    tensors[key] = edit(tensors[key].clone())
    save_file(tensors, dest / "model.safetensors", metadata={"format": "pt"})
    return dest


# ---------------------------------------------------------------------------------------
# Prompts and paths


def test_deeply_nested_json_line_is_one_error(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"text": "ok"}\n{"text": "a", "x": ' + "[" * 100_000 + "]" * 100_000 + "}\n")
    with pytest.raises(InputError, match=r"p\.jsonl:2: invalid JSON \(nested too deeply\)"):
        read_prompts(path)


def test_directories_and_files_in_the_wrong_place_are_named(model_dirs, prompts, tmp_path, capsys):
    line = _error_line(capsys, ["profile", "--model", str(model_dirs["olmoe"]), "--prompts",
                                str(tmp_path), "--out", str(tmp_path / "t")])  # fmt: skip
    assert "is not a file" in line
    line = _error_line(capsys, ["profile", "--model", str(prompts), "--prompts", str(prompts),
                                "--out", str(tmp_path / "t")])  # fmt: skip
    assert "is not a directory" in line


def test_out_under_a_file_is_refused_before_loading(model_dirs, prompts, tmp_path, capsys):
    line = _error_line(capsys, ["profile", "--model", str(model_dirs["olmoe"]), "--prompts",
                                str(prompts), "--out", str(prompts / "trace")])  # fmt: skip
    assert "the command reads its input" in line  # the prompts file, a path under it
    assert prompts.is_file()


def test_out_inside_the_model_or_another_artifact_is_refused(model_dirs, prompts, tmp_path, capsys):
    model = model_dirs["olmoe"]
    line = _error_line(capsys, ["profile", "--model", str(model), "--prompts", str(prompts),
                                "--out", str(model / "trace")])  # fmt: skip
    assert "reads its input" in line and not (model / "trace").exists()
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    (bundle / "manifest.json").write_text('{"format": "moeplan-bundle"}')
    line = _error_line(capsys, ["profile", "--model", str(model), "--prompts", str(prompts),
                                "--out", str(bundle / "trace")])  # fmt: skip
    assert "inside the moeplan bundle" in line and not (bundle / "trace").exists()


def test_out_that_is_a_dangling_symlink_is_refused(model_dirs, prompts, tmp_path, capsys):
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "gone")
    line = _error_line(capsys, ["profile", "--model", str(model_dirs["olmoe"]), "--prompts",
                                str(prompts), "--out", str(link)])  # fmt: skip
    assert "symbolic link" in line and "does not exist" in line
    assert link.is_symlink() and not (tmp_path / "gone").exists()


@pytest.mark.parametrize("name", ["batch_size", "max_length", "prompts_per_part", "max_prompts"])
def test_bool_is_not_a_count(name):
    with pytest.raises(InputError, match="must be a positive integer"):
        ProfileConfig(**{name: True})
    # a numpy integer is one, stored as a Python int (it was refused)
    assert type(getattr(ProfileConfig(**{name: np.int64(8)}), name)) is int


def test_flags_are_bools_and_numpy_bools_become_bools():
    """A numpy add_special_tokens reached profile.json as it was (a JSON TypeError after the
    model was loaded); resume=1 was kept as 1."""
    assert ProfileConfig(add_special_tokens=np.bool_(False)).add_special_tokens is False
    with pytest.raises(InputError, match="resume=1 must be true or false"):
        ProfileConfig(resume=1)


# ---------------------------------------------------------------------------------------
# Damaged checkpoints


@pytest.mark.parametrize("case", ["tokenizer_json", "tokenizer_config_list"])
def test_damaged_tokenizer_is_one_line(case, model_dirs, prompts, tmp_path, capsys):
    model = tmp_path / "m"
    shutil.copytree(model_dirs["mixtral"], model)
    if case == "tokenizer_json":  # valid JSON the Rust tokenizers library cannot read
        tok = json.loads((model / "tokenizer.json").read_text())
        tok["model"]["type"] = "NoSuchModel"
        (model / "tokenizer.json").write_text(json.dumps(tok))
    else:
        (model / "tokenizer_config.json").write_text("[1]")
    out = tmp_path / "t"
    line = _error_line(capsys, ["profile", "--model", str(model), "--prompts", str(prompts),
                                "--out", str(out)])  # fmt: skip
    assert f"{model}: cannot load tokenizer (" in line
    assert not out.exists()


def test_config_field_of_the_wrong_type_is_one_line(model_dirs, prompts, tmp_path, capsys):
    model = _copy_with_config(model_dirs["mixtral"], tmp_path / "m", num_local_experts="8")
    line = _error_line(capsys, ["profile", "--model", str(model), "--prompts", str(prompts),
                                "--out", str(tmp_path / "t")])  # fmt: skip
    assert "cannot read config" in line and "num_local_experts" in line and "expected int" in line


@pytest.mark.parametrize(
    "arch, changes, message",
    [
        # topk_group > n_group: the checkpoint loads, its router failed in the forward pass
        ("deepseek_v3", {"topk_group": 9}, "n_group=4 and topk_group=9 must be"),
        # ZeroDivisionError in the router: a traceback
        ("deepseek_v3", {"n_group": 0}, "n_group=0 and topk_group=2 must be"),
        # 8 experts in 3 groups: the router's view mixed neighbouring tokens' scores whenever
        # T N divided evenly, and the run recorded them
        ("deepseek_v2", {"n_group": 3, "topk_group": 1}, "n_group=3 and topk_group=1 must be"),
        # an unknown method: UnboundLocalError in the router, a traceback
        ("deepseek_v2", {"topk_method": "noaux_tc"}, "topk_method='noaux_tc'; DeepSeek-V2's"),
        # groups of one expert: V3 scores a group by its top 2, a cryptic forward error
        ("deepseek_v3", {"n_group": 8, "topk_group": 2}, "into groups of at least 2"),
        # read as step 1 here, a ZeroDivisionError traceback in transformers
        ("qwen3_moe", {"decoder_sparse_step": 0}, "decoder_sparse_step=0 must be a positive"),
    ],
)
def test_router_config_the_model_cannot_run_is_one_line(
    model_dirs, prompts, tmp_path, capsys, arch, changes, message
):
    model = _copy_with_config(model_dirs[arch], tmp_path / "m", **changes)
    out = tmp_path / "t"
    line = _error_line(capsys, ["profile", "--model", str(model), "--prompts", str(prompts),
                                "--out", str(out), "--max-prompts", "3"])  # fmt: skip
    assert message in line
    assert not out.exists()


def test_any_failure_of_the_forward_pass_is_one_line(model_dirs, prompts, tmp_path, monkeypatch):
    # only RuntimeError, IndexError and ValueError were caught; the models' own code raises
    # others on configs it cannot run
    from transformers.models.mixtral import modeling_mixtral

    def broken(self, hidden_states):
        raise ZeroDivisionError("integer division or modulo by zero")

    monkeypatch.setattr(modeling_mixtral.MixtralTopKRouter, "forward", broken)
    out = tmp_path / "new" / "t"
    config = ProfileConfig(save_embeddings=True)
    with pytest.raises(ModelError, match=r"forward pass failed \(integer division or modulo"):
        profile_model(model_dirs["mixtral"], prompts, out, config, progress=False)
    # the run's profile.json and embeddings went with the folders it made: they had been
    # left as an unfinished run, and a plain retry was refused ("not empty; pass --resume")
    assert not (tmp_path / "new").exists()
    monkeypatch.undo()
    assert profile_model(model_dirs["mixtral"], prompts, out, progress=False).parts_written


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"pad_token_id": 500}, "Padding_idx must be within"),
        ({"vocab_size": 0}, ""),
        ({"num_attention_heads": 0}, ""),  # ZeroDivisionError building the attention
    ],
)
def test_a_config_the_modules_cannot_be_built_from_is_one_line(
    model_dirs, prompts, tmp_path, capsys, changes, message
):
    # nn.Embedding asserts on a pad_token_id past the vocabulary (AssertionError) and the
    # initialisation fails on an empty one (IndexError): both were tracebacks
    model = _copy_with_config(model_dirs["mixtral"], tmp_path / "m", **changes)
    line = _error_line(capsys, ["profile", "--model", str(model), "--prompts", str(prompts),
                                "--out", str(tmp_path / "t")])  # fmt: skip
    assert str(model) in line and message in line


def test_prompts_that_tokenise_to_nothing_are_refused(model_dirs, tmp_path, capsys):
    # every prompt tokenised to no token: the run exited 0 and marked a trace with no part
    # finished, which every later command refused as "not a trace"
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from tests.profile.tiny_models import SPECIALS, VOCAB_WORDS

    model = tmp_path / "m"
    shutil.copytree(model_dirs["mixtral"], model)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (model / name).unlink(missing_ok=True)
    vocab = {w: i for i, w in enumerate(SPECIALS + VOCAB_WORDS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.Sequence([normalizers.NFD(), normalizers.StripAccents()])
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]")
    fast.save_pretrained(model)
    accents = tmp_path / "accents.txt"
    accents.write_text("\u0301\n\u0301\u0300\n")  # combining marks alone: stripped away
    out = tmp_path / "t"
    line = _error_line(capsys, ["profile", "--model", str(model), "--prompts", str(accents),
                                "--out", str(out)])  # fmt: skip
    assert "none of the 2 prompt(s) tokenised to any token" in line
    assert not out.exists()


def test_nan_router_weights_are_refused_not_recorded(model_dirs, prompts, tmp_path):
    def poison(weight):
        weight[0, 0] = float("nan")
        return weight

    model = _copy_with_router_weights(model_dirs["mixtral"], tmp_path / "m", poison)
    out = tmp_path / "t"
    with pytest.raises(ModelError, match="router of model layer 1 applied non-finite gate weights"):
        profile_model(model, prompts, out, ProfileConfig(), progress=False)
    assert not list(out.glob("part-*"))


# ---------------------------------------------------------------------------------------
# Padding


@pytest.fixture(scope="module")
def added_pad_model_dir(tmp_path_factory):
    """A checkpoint whose tokenizer's pad token was added after the model: id == vocab_size."""
    from transformers import AutoTokenizer

    dest = tmp_path_factory.mktemp("pad") / "tiny-added-pad"
    build_model("mixtral", ARCH_CONFIGS["mixtral"] | dict(vocab_size=66, pad_token_id=None)
                ).save_pretrained(dest)  # fmt: skip
    save_tokenizer(dest)
    tok = AutoTokenizer.from_pretrained(dest)
    tok.pad_token = None
    tok.add_special_tokens({"pad_token": "<pad>"})
    assert tok.pad_token_id == 66
    tok.save_pretrained(dest)
    return dest


def test_pad_token_outside_the_vocabulary_is_not_fed_to_the_model(added_pad_model_dir, prompts,
                                                                   tmp_path):  # fmt: skip
    batched, alone = tmp_path / "batched", tmp_path / "alone"
    profile_model(added_pad_model_dir, prompts, batched, ProfileConfig(batch_size=5),
                  progress=False)  # fmt: skip
    profile_model(added_pad_model_dir, prompts, alone, ProfileConfig(batch_size=1),
                  progress=False)  # fmt: skip
    got, want = open_trace(batched).read_all(), open_trace(alone).read_all()
    assert len(got) == len(want) > 0
    np.testing.assert_array_equal(got.token_id, want.token_id)
    np.testing.assert_array_equal(got.experts, want.experts)


# ---------------------------------------------------------------------------------------
# Resume


def test_resume_with_another_checkpoint_of_the_same_name_is_refused(model_dirs, prompts,
                                                                    tmp_path):  # fmt: skip
    first = tmp_path / "a" / "model"
    shutil.copytree(model_dirs["mixtral"], first)
    other = _copy_with_router_weights(model_dirs["mixtral"], tmp_path / "b" / "model",
                                      lambda w: torch.flip(w, dims=[0]))  # fmt: skip
    moved = tmp_path / "c" / "model"
    shutil.copytree(first, moved)
    out = tmp_path / "t"
    profile_model(first, prompts, out, ProfileConfig(max_prompts=2), progress=False)
    before = sorted(p.name for p in out.iterdir())
    with pytest.raises(InputError, match="cannot resume with another checkpoint"):
        profile_model(other, prompts, out, ProfileConfig(resume=True), progress=False)
    assert sorted(p.name for p in out.iterdir()) == before
    # The same checkpoint at another path resumes.
    result = profile_model(moved, prompts, out, ProfileConfig(resume=True), progress=False)
    assert result.prompts_resumed == 2 and result.prompts_profiled == 3
    assert open_trace(out).request_ids().tolist() == [0, 1, 2, 3, 4]


def test_resume_under_another_transformers_is_refused(model_dirs, prompts, tmp_path, monkeypatch):
    """transformers' model code defines the router weights recorded: a resume under another
    version mixed parts of both in one trace, whose metadata named the first only."""
    import planner.profile.runner as runner

    out = tmp_path / "t"
    profile_model(model_dirs["mixtral"], prompts, out, ProfileConfig(max_prompts=2), progress=False)
    monkeypatch.setattr(runner, "_transformers_version", lambda: "0.0.1")
    with pytest.raises(InputError, match=r"other settings .*transformers: '[^']+' -> '0.0.1'"):
        profile_model(model_dirs["mixtral"], prompts, out, ProfileConfig(resume=True),
                      progress=False)  # fmt: skip


def test_model_that_does_not_fit_the_device_is_one_line(model_dirs, prompts, tmp_path,
                                                        monkeypatch):  # fmt: skip
    from planner.profile.checkpoint import inspect_checkpoint, load_model

    info = inspect_checkpoint(model_dirs["olmoe"])

    def out_of_memory(self, *args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(torch.nn.Module, "to", out_of_memory)
    with pytest.raises(ModelError, match="cannot move the model to cpu \\(CUDA out of memory"):
        load_model(info, "cpu", "float32", progress=False)


def test_a_second_run_into_the_same_out_at_once_is_refused(model_dirs, prompts, tmp_path, capsys):
    import fcntl
    import os

    out = tmp_path / "trace"
    out.mkdir()
    fd = os.open(out, os.O_RDONLY)  # another run holds the directory
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        line = _error_line(capsys, ["profile", "--model", str(model_dirs["olmoe"]), "--prompts",
                                    str(prompts), "--out", str(out)])  # fmt: skip
    finally:
        os.close(fd)
    assert "another moeplan profile run is writing there" in line
    assert list(out.iterdir()) == []
    # Once it has ended, the directory is free.
    result = profile_model(model_dirs["olmoe"], prompts, out, progress=False)
    assert result.prompts_profiled == 5


def test_a_failed_run_removes_the_directory_it_made(model_dirs, prompts, tmp_path, monkeypatch):
    import planner.profile.runner as runner

    def fail(*args, **kwargs):
        raise ModelError("cannot load the model")

    monkeypatch.setattr(runner, "load_model", fail)
    made, kept = tmp_path / "new" / "trace", tmp_path / "kept"
    kept.mkdir()
    for out in (made, kept):
        with pytest.raises(ModelError, match="cannot load the model"):
            profile_model(model_dirs["olmoe"], prompts, out, progress=False)
    assert not made.exists() and kept.is_dir()


def test_a_config_naming_flash_attention_profiles_with_eager_attention(
    model_dirs, prompts, tmp_path
):
    """A checkpoint saved from a GPU run names flash_attention_2; without the flash-attn
    package, loading it was an ImportError traceback. Routing does not depend on the
    attention kernel: eager attention records the same trace."""
    model = _copy_with_config(
        model_dirs["mixtral"], tmp_path / "m", _attn_implementation="flash_attention_2"
    )
    config = ProfileConfig(max_prompts=3)
    flash = profile_model(model, prompts, tmp_path / "a", config, progress=False)
    plain = profile_model(model_dirs["mixtral"], prompts, tmp_path / "b", config, progress=False)
    a, b = (next(open_trace(r.out_dir).iter_batches()) for r in (flash, plain))
    np.testing.assert_array_equal(a.experts, b.experts)

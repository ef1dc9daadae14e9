"""``moeplan profile`` end to end: a run, and user errors as one line with exit code 2."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig

from planner.cli.main import main
from planner.trace.io import open_trace
from tests.profile.tiny_models import sample_texts, save_tokenizer, write_prompts


@pytest.fixture
def prompts(tmp_path):
    return write_prompts(tmp_path / "prompts.jsonl", sample_texts(5, seed=3))


def test_profile_command_writes_a_trace_and_prints_a_summary(model_dirs, prompts, tmp_path, capsys):
    out = tmp_path / "trace"
    args = ["profile", "--model", str(model_dirs["deepseek_v3"]), "--prompts", str(prompts),
            "--out", str(out), "--max-prompts", "4", "--batch-size", "2", "--max-length", "16",
            "--device", "cpu", "--dtype", "float32", "--save-embeddings"]  # fmt: skip
    assert main(args) == 0
    stdout = capsys.readouterr().out
    for field in ("tokens_per_s", "skewness (max/mean)", "L1:", "L2:", "embeddings"):
        assert field in stdout
    trace = open_trace(out)
    assert trace.meta.moe_layer_indices == (1, 2)
    assert trace.request_ids().tolist() == [0, 1, 2, 3]
    assert trace.extra_columns() == []  # no prompt has a domain
    assert (out / "embeddings.safetensors").is_file()

    # The same command again refuses to mix runs, and --resume finishes the rest.
    assert main(args) == 2
    assert "pass --resume" in capsys.readouterr().err
    assert main([*args[:7], "--resume", "--max-length", "16"]) == 0
    assert open_trace(out).request_ids().tolist() == [0, 1, 2, 3, 4]


@pytest.fixture(scope="module")
def broken_dirs(tmp_path_factory, model_dirs):
    """Checkpoint directories that cannot be profiled, by the reason they fail."""
    root = tmp_path_factory.mktemp("broken")
    unsupported = root / "tiny-granitemoe"
    AutoConfig.for_model("granitemoe", num_local_experts=8, num_experts_per_tok=2).save_pretrained(
        unsupported
    )
    save_tokenizer(unsupported)
    no_tokenizer = root / "no-tokenizer"
    shutil.copytree(model_dirs["mixtral"], no_tokenizer, ignore=shutil.ignore_patterns("tok*"))
    not_a_checkpoint = root / "empty"
    not_a_checkpoint.mkdir()
    return {"unsupported": unsupported, "no_tokenizer": no_tokenizer, "empty": not_a_checkpoint}


def _run_error(capsys, args) -> str:
    code = main(args)
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("moeplan: error: "), err
    assert "Traceback" not in err
    return lines[0]


@pytest.mark.parametrize(
    ("case", "needle"),
    [
        ("missing", "does not exist"),
        ("empty", "no config.json"),
        ("dense", "is not an MoE model"),
        ("unsupported", "unsupported architecture 'granitemoe'; supported: deepseek_v2"),
        ("no_tokenizer", "no tokenizer in the directory"),
    ],
)
def test_model_errors(case, needle, model_dirs, dense_model_dir, broken_dirs, prompts, tmp_path,
                      capsys):  # fmt: skip
    model = {
        "missing": tmp_path / "nope",
        "dense": dense_model_dir,
        **broken_dirs,
    }[case]
    line = _run_error(capsys, ["profile", "--model", str(model), "--prompts", str(prompts),
                               "--out", str(tmp_path / "t")])  # fmt: skip
    assert needle in line
    assert not (tmp_path / "t").exists()


@pytest.mark.parametrize(
    ("content", "needle"),
    [("", "no prompts"), ('{"text": "a b"}\n{"text": 3}\n', ':2: "text" must be a string')],
)
def test_prompt_errors(content, needle, model_dirs, tmp_path, capsys):
    path = tmp_path / "p.jsonl"
    path.write_text(content)
    line = _run_error(capsys, ["profile", "--model", str(model_dirs["olmoe"]), "--prompts",
                               str(path), "--out", str(tmp_path / "t")])  # fmt: skip
    assert needle in line


@pytest.mark.parametrize(
    ("option", "value", "needle"),
    [("--dtype", "int8", "dtype 'int8'"), ("--batch-size", "0", "batch-size=0"),
     ("--device", "tpu", "device 'tpu'")],
)  # fmt: skip
def test_option_errors(option, value, needle, model_dirs, prompts, tmp_path, capsys):
    line = _run_error(capsys, ["profile", "--model", str(model_dirs["olmoe"]), "--prompts",
                               str(prompts), "--out", str(tmp_path / "t"), option, value])  # fmt: skip
    assert needle in line


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_cuda(model_dirs, prompts, tmp_path, capsys):
    line = _run_error(capsys, ["profile", "--model", str(model_dirs["olmoe"]), "--prompts",
                               str(prompts), "--out", str(tmp_path / "t"), "--device", "cuda"])  # fmt: skip
    assert "CUDA is not available" in line


def test_unpaired_surrogate_prompt_is_refused_before_writing(model_dirs, tmp_path, capsys):
    path = tmp_path / "s.jsonl"
    path.write_text('{"text": "\\ud800"}\n')
    out = tmp_path / "o"
    line = _run_error(capsys, ["profile", "--model", str(model_dirs["olmoe"]), "--prompts",
                               str(path), "--out", str(out)])  # fmt: skip
    assert 's.jsonl:1: "text" holds an unpaired surrogate' in line
    assert not out.exists()


@pytest.fixture(scope="module")
def corrupt_dirs(tmp_path_factory, model_dirs):
    """Copies of a tiny checkpoint with a damaged weights file or an edited config."""
    root = tmp_path_factory.mktemp("corrupt")
    dirs = {}
    for case in ("truncated", "empty", "vocab", "missing"):
        dest = root / f"tiny-{case}"
        shutil.copytree(model_dirs["mixtral"], dest)
        weights = dest / "model.safetensors"
        if case == "truncated":
            weights.write_bytes(weights.read_bytes()[:1000])
        elif case == "empty":
            weights.write_bytes(b"")
        elif case == "missing":  # a tensor dropped from the file: it would load at random
            tensors = load_file(weights)
            dropped = "model.layers.0.self_attn.q_proj.weight"
            save_file({k: v for k, v in tensors.items() if k != dropped}, weights)
        else:
            config = json.loads((dest / "config.json").read_text())
            config["vocab_size"] = 1000
            (dest / "config.json").write_text(json.dumps(config))
        dirs[case] = dest
    return dirs


@pytest.mark.parametrize(
    ("case", "needle"),
    [
        ("truncated", "cannot load model weights: a .safetensors file is truncated or damaged"),
        ("empty", "cannot load model weights: a .safetensors file is truncated or damaged"),
        ("vocab", "is [72, 32] in the weights file but [1000, 32] by the config and 1 more"),
        ("missing", "the weights file lacks model.layers.0.self_attn.q_proj.weight of the"),
    ],
)
def test_corrupt_checkpoint_is_one_line(case, needle, corrupt_dirs, prompts, tmp_path, capsys):
    model = corrupt_dirs[case]
    out = tmp_path / "t"
    code = main(["profile", "--model", str(model), "--prompts", str(prompts), "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err
    line = err.strip().splitlines()[-1]  # after the weights-loading progress bar, if any
    assert line.startswith(f"moeplan: error: {model}: ") and needle in line, err
    assert not out.exists()

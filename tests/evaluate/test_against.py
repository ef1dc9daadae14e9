"""``moeplan evaluate --against``: a new plan against the deployed one on the same traffic."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from planner.cli.main import main
from planner.errors import InputError, MismatchError
from planner.evaluate.compare import against_deployed
from planner.export import Bundle, save_bundle
from planner.trace import TraceBatch, TraceMeta, open_trace, write_trace

# Tokens 0-4 route to experts {0, 1}, tokens 5-9 to {2, 3}, at both layers.
META = TraceMeta("test/against", num_layers=2, num_experts=4, top_k=2, vocab_size=10)


def _bundle(expert_to_device, token_to_device, meta: TraceMeta = META, ep: int = 2) -> Bundle:
    big_l, v = meta.num_layers, meta.vocab_size
    return Bundle.from_arrays(
        meta, ep_size=ep, ngram_order=1,
        expert_to_device=[expert_to_device] * big_l,
        token_to_device=[token_to_device] * big_l, token_confidence=np.ones((big_l, v)),
        ngram_to_device=np.zeros((big_l, ep), int), ngram_confidence=np.zeros((big_l, ep)),
    )  # fmt: skip


SPLIT = [0] * 5 + [1] * 5
GOOD = _bundle([0, 0, 1, 1], SPLIT)  # every activation local, tokens half and half
RENAMED = _bundle([1, 1, 0, 0], [1 - d for d in SPLIT])  # the same plan, devices renamed
CROWDED = _bundle([0, 0, 1, 1], [0] * 10)  # every token to device 0: the cap moves half


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    rng = np.random.default_rng(0)
    requests, length = 40, 20
    tokens = rng.integers(0, 10, requests * length)
    pair = np.where(tokens[:, None] < 5, [0, 1], [2, 3])
    experts = np.stack([pair] * META.num_layers, 1)
    batch = TraceBatch.from_arrays(
        np.repeat(np.arange(requests), length), np.tile(np.arange(length), requests), tokens,
        experts, np.full(experts.shape, 0.5),
    )  # fmt: skip
    path = tmp_path_factory.mktemp("against") / "held.parquet"
    write_trace(path, META, batch)
    return open_trace(path)


def test_a_better_plan_is_better_beyond_the_interval(trace):
    v = against_deployed(GOOD, CROWDED, trace)
    assert v["report"]["overall"]["lar_balanced"] == pytest.approx(1.0)
    assert v["ratio"] > 1.5 and v["ratio_ci90"][0] > 1 and v["verdict"] == "better"
    assert "per_request" not in v["report"] and v["requests"] == 40
    assert v["experts_moved"] == v["experts_moved_aligned"] == 0
    assert against_deployed(CROWDED, GOOD, trace)["verdict"] == "worse"


def test_the_same_plan_renamed_is_level_and_moves_nothing_once_aligned(trace):
    v = against_deployed(RENAMED, GOOD, trace)
    assert v["ratio"] == 1.0 and v["ratio_ci90"] == [1.0, 1.0] and v["verdict"] == "level"
    assert v["experts_moved"] == 8 and v["experts_moved_aligned"] == 0 and v["experts"] == 8


def test_plans_of_another_model_or_ep_size_are_refused(trace):
    other = TraceMeta("test/other", num_layers=2, num_experts=4, top_k=2, vocab_size=10)
    with pytest.raises(MismatchError, match="fingerprints differ: model 'test/other' against"):
        against_deployed(GOOD, _bundle([0, 0, 1, 1], SPLIT, other), trace)
    # one name, other shapes: the message says which (it said only "fingerprints differ")
    wider = dataclasses.replace(GOOD.meta, vocab_size=GOOD.meta.vocab_size + 5)
    with pytest.raises(MismatchError, match=r"differ: vocab_size \d+ against \d+\)$"):
        against_deployed(GOOD, _bundle([0, 0, 1, 1], SPLIT + [0] * 5, wider), trace)
    with pytest.raises(InputError, match="EP 4, the new one for EP 2"):
        against_deployed(GOOD, _bundle([0, 1, 2, 3], [0] * 10, ep=4), trace)


def test_cli_evaluate_against(trace, tmp_path, capsys):
    new, old = tmp_path / "new", tmp_path / "old"
    save_bundle(RENAMED, new)
    save_bundle(CROWDED, old)
    held = str(trace.path)
    assert main(["evaluate", str(new), held, "--against", str(old)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "better beyond the noise of which requests were held out" in out
    assert "moves 8 of 8 experts to another device (0 aligned: moeplan solve --align-to" in out
    assert main(["evaluate", str(new), held, "--against", str(old), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["against"]["verdict"] == "better" and "report" not in report["against"]
    assert report["overall"]["lar_balanced"] == pytest.approx(1.0)
    assert main(["evaluate", str(new), held, "--against", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("moeplan: error:") and "neither a plan" in err and err.count("\n") == 1


def test_cli_require_better_gates_the_rollout(trace, tmp_path, capsys):
    good, same, crowded = tmp_path / "good", tmp_path / "same", tmp_path / "crowded"
    save_bundle(GOOD, good)
    save_bundle(RENAMED, same)
    save_bundle(CROWDED, crowded)
    held = str(trace.path)
    gate = ["--require-better"]
    assert main(["evaluate", str(good), held, "--against", str(crowded), *gate]) == 0
    capsys.readouterr()
    for deployed in (same, good):  # level, then worse: keep the deployed plan
        assert main(["evaluate", str(crowded if deployed == good else good), held,
                     "--against", str(deployed), *gate, "--json"]) == 1  # fmt: skip
        captured = capsys.readouterr()
        json.loads(captured.out)  # the report is printed whatever the verdict
        assert captured.err.startswith("moeplan: not better than the deployed plan")
    assert main(["evaluate", str(good), held, *gate]) == 2
    assert "--require-better needs --against" in capsys.readouterr().err

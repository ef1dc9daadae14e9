"""Edge cases and bad input of ``moeplan evaluate`` / ``compare``: correct metrics on odd but
valid traces, and one-line errors (never a traceback) before any work."""

from __future__ import annotations

import numpy as np
import pytest

from planner.cli.main import main
from planner.evaluate import EvalConfig, evaluate_bundle
from planner.export import Bundle, save_bundle
from planner.trace import TraceBatch, TraceMeta, open_trace, write_trace
from planner.trace.synth import SynthConfig
from tests.conftest import random_batch, synth_predictor

# N = 4 experts, E = 2 devices: the contiguous placement puts experts 0, 1 on device 0.
META = TraceMeta("test/edge", num_layers=2, num_experts=4, top_k=2, vocab_size=10)


def _bundle(meta: TraceMeta = META) -> Bundle:
    big_l, v = meta.num_layers, meta.vocab_size
    return Bundle.from_arrays(
        meta, ep_size=2, ngram_order=1,
        expert_to_device=[[0, 0, 1, 1]] * big_l,
        token_to_device=np.zeros((big_l, v), int), token_confidence=np.ones((big_l, v)),
        ngram_to_device=np.zeros((big_l, 2), int), ngram_confidence=np.zeros((big_l, 2)),
    )  # fmt: skip


def _first_half_then_second(first_position: int, tokens: int = 8) -> TraceBatch:
    """One request whose first half routes to experts {0, 1} (device 0 of the contiguous
    placement) and second half to {2, 3}: its E = 2 contiguous chunks are all local."""
    half = np.arange(tokens) >= tokens // 2
    pair = np.stack([2 * half, 2 * half + 1], -1)  # [T, k]
    experts = np.stack([pair] * META.num_layers, 1)  # [T, L, k]
    return TraceBatch.from_arrays(
        np.zeros(tokens), first_position + np.arange(tokens), np.arange(tokens) % 10,
        experts, np.full(experts.shape, 0.5),
    )  # fmt: skip


@pytest.mark.parametrize("first_position", [0, 100])
def test_vanilla_splits_a_request_whose_positions_do_not_start_at_zero(tmp_path, first_position):
    """An ingested chunked-prefill continuation starts at its recorded position: its tokens
    are still split into E contiguous chunks, not all sent to the last device."""
    path = write_trace(tmp_path / "t.parquet", META, _first_half_then_second(first_position))
    ov = evaluate_bundle(_bundle(), open_trace(path), EvalConfig(batch_tokens=8))["overall"]
    assert ov["lar_vanilla"] == 1.0
    assert ov["remote_fraction_vanilla"] == 0.0


def test_vanilla_splits_a_sampled_request_with_gaps_in_its_positions(tmp_path):
    """Every other position of a 16-token request: chunks follow its span of positions."""
    batch = _first_half_then_second(0)
    sampled = TraceBatch.from_arrays(
        batch.request_id, 2 * batch.position, batch.token_id, batch.experts, batch.weights
    )
    path = write_trace(tmp_path / "t.parquet", META, sampled)
    ov = evaluate_bundle(_bundle(), open_trace(path), EvalConfig(batch_tokens=8))["overall"]
    assert ov["lar_vanilla"] == 1.0


@pytest.fixture
def bundle_and_trace(tmp_path):
    meta = TraceMeta("test/edge", num_layers=2, num_experts=4, top_k=2, vocab_size=10)
    plan = save_bundle(_bundle(meta), tmp_path / "bundle")
    held = write_trace(tmp_path / "held" / "part-00000.parquet", meta, random_batch(meta, 40))
    return plan, held.parent


def _one_line_error(capsys, rc: int, match: str) -> None:
    err = capsys.readouterr().err.strip()
    assert rc == 2, err
    assert err.startswith("moeplan: error:") and len(err.splitlines()) == 1, err
    assert match in err, err


def test_plot_under_a_file_is_refused_in_one_line(tmp_path, bundle_and_trace, capsys):
    plan, held = bundle_and_trace
    (tmp_path / "afile").write_text("keep me")
    rc = main(["evaluate", str(plan), str(held), "--plot", str(tmp_path / "afile" / "x.png")])
    _one_line_error(capsys, rc, "is a file, not a directory")
    assert (tmp_path / "afile").read_text() == "keep me"


def test_plot_onto_a_directory_is_refused_before_the_work(
    tmp_path, bundle_and_trace, capsys, monkeypatch
):
    plan, held = bundle_and_trace
    (tmp_path / "dir.png").mkdir()

    def no_work(*args, **kwargs):
        raise AssertionError("evaluated before the plot path was checked")

    monkeypatch.setattr("planner.cli.export.evaluate_bundle", no_work)
    rc = main(["evaluate", str(plan), str(held), "--plot", str(tmp_path / "dir.png")])
    _one_line_error(capsys, rc, "is a directory")


def test_plot_inside_an_input_is_refused(bundle_and_trace, capsys):
    plan, held = bundle_and_trace
    rc = main(["evaluate", str(plan), str(held), "--plot", str(held / "lar.png")])
    _one_line_error(capsys, rc, "reads its input")
    assert sorted(p.name for p in held.iterdir()) == ["part-00000.parquet"]


def test_compare_on_an_empty_heldout_trace_is_one_line(tmp_path, capsys):
    synth = SynthConfig(
        num_layers=2, num_experts=4, top_k=2, vocab_size=50, num_tokens=400, num_requests=8,
        seed=1,
    )  # fmt: skip
    trace = synth_predictor(tmp_path, synth)
    empty = open_trace(trace).read_all().select(slice(0, 0))
    held = write_trace(tmp_path / "empty.parquet", open_trace(trace).meta, empty)
    rc = main(
        ["compare", str(tmp_path / "pred"), str(held), "--ep", "2", "--methods", "kmeans,metis"]
    )
    _one_line_error(capsys, rc, "holds no tokens")
    # an empty --fitting trace alike (its column was null, exit 0)
    rc = main(["compare", str(tmp_path / "pred"), str(trace), "--ep", "2", "--methods",
               "kmeans", "--fitting", str(held)])  # fmt: skip
    _one_line_error(capsys, rc, "holds no tokens; nothing to score on")
    # evaluate alike (it printed a table of "-" and exited 0)
    plan = tmp_path / "plan"
    assert main(["solve", str(tmp_path / "pred"), "--ep", "2", "--method", "vanilla",
                 "--out", str(plan)]) == 0  # fmt: skip
    capsys.readouterr()
    _one_line_error(capsys, main(["evaluate", str(plan), str(held)]), "holds no tokens")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"slack": True}, "slack=True must be a number >= 1"),
        ({"batch_tokens": True}, "batch_tokens=True must be an integer"),
        ({"hidden_size": 1.0}, "hidden_size=1.0 must be an integer"),
        # a 300-digit size: the table's byte column overflowed a float (a traceback)
        ({"hidden_size": 10**310}, r"hidden_size=1000.* must be an integer in \[0, 2\*\*31\]"),
        ({"dtype_bytes": 65}, r"dtype_bytes=65 must be an integer in \[1, 64\]"),
    ],
)
def test_eval_config_refuses_bools_and_floats_for_its_numbers(kwargs, message):
    """EvalConfig(slack=True) was taken as a slack of 1 (a bool is an int to Python)."""
    from planner.errors import InputError

    with pytest.raises(InputError, match=message):
        EvalConfig(**kwargs)
    assert EvalConfig(slack=np.float32(1.5)).slack == 1.5


def test_eval_config_numpy_numbers_reach_the_json_report(tmp_path):
    """Numpy numbers passed the checks, then the report (its ``config``) failed with json's
    'Object of type int64 is not JSON serializable' traceback; per_request=1 was kept as 1."""
    import json

    from planner.errors import InputError

    path = write_trace(tmp_path / "t.parquet", META, _first_half_then_second(0))
    config = EvalConfig(
        batch_tokens=np.int64(4), slack=np.float32(1.5), hidden_size=np.int32(8),
        dtype_bytes=np.uint8(2), per_request=np.bool_(True),
    )  # fmt: skip
    report = json.loads(json.dumps(evaluate_bundle(_bundle(), open_trace(path), config)))
    assert report["config"]["batch_tokens"] == 4 and report["config"]["per_request"] is True
    with pytest.raises(InputError, match="per_request=1 must be true or false"):
        EvalConfig(per_request=1)

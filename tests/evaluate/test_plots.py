"""``--plot``: the figures are written (atomically) from the reports, in each format."""

from __future__ import annotations

import pytest

from planner.errors import InputError
from planner.evaluate import evaluate_bundle
from planner.evaluate.plots import (
    check_plot_path,
    plot_comparison,
    plot_evaluation,
    plot_replan,
)
from planner.trace import TraceMeta, open_trace, write_trace
from tests.conftest import random_batch
from tests.evaluate.test_metrics import _random_bundle

MAGIC = {".png": b"\x89PNG", ".svg": b"<?xml", ".pdf": b"%PDF"}


@pytest.mark.parametrize("suffix", sorted(MAGIC))
def test_evaluation_figure(tmp_path, suffix):
    meta = TraceMeta("test/m", num_layers=3, num_experts=8, top_k=2, vocab_size=30)
    path = write_trace(tmp_path / "t.parquet", meta, random_batch(meta, 200, seed=1))
    report = evaluate_bundle(_random_bundle(meta, 4, 1, seed=0), open_trace(path))
    out = plot_evaluation(report, tmp_path / f"sub/eval{suffix}")
    assert out.read_bytes().startswith(MAGIC[suffix])
    assert [p.name for p in out.parent.iterdir()] == [out.name]  # no temporary left
    assert plot_evaluation(report, out) == out  # its own figure it replaces
    # a user's file of that name is never replaced (it was, silently)
    mine = tmp_path / f"paper{suffix}"
    mine.write_bytes(MAGIC[suffix] + b" a user's document")
    with pytest.raises(InputError, match="not a figure moeplan drew"):
        plot_evaluation(report, mine)
    assert mine.read_bytes() == MAGIC[suffix] + b" a user's document"


@pytest.mark.parametrize("bound", [0.85, None])  # None: no held-out token id is known
def test_comparison_figure(tmp_path, bound):
    rows = [
        {"method": "ceo", "lar_balanced": 0.45, "lar": 0.51, "ratio_to_best_baseline": 1.02},
        {"method": "kmeans", "lar_balanced": 0.44, "lar": 0.53, "ratio_to_best_baseline": 1.0},
        {"method": "vanilla", "lar_balanced": 0.29, "lar": 0.36, "ratio_to_best_baseline": None},
    ]
    result = {"rows": rows, "oracle_bound": bound, "lar_vanilla": 0.25, "ep_size": 4}
    out = plot_comparison(result, tmp_path / "cmp.png")
    assert out.read_bytes().startswith(MAGIC[".png"]) and out.stat().st_size > 10_000


def test_a_name_without_a_figure_suffix_is_refused_before_any_work(tmp_path):
    with pytest.raises(InputError, match=r"--plot .*cmp.txt: the file name must end in .png"):
        check_plot_path(tmp_path / "cmp.txt")


def test_expert_load_figure_from_the_trace_summary(tmp_path):
    from planner.evaluate.plots import plot_expert_load
    from planner.trace.info import trace_summary

    meta = TraceMeta("test/m", num_layers=3, num_experts=8, top_k=2, vocab_size=30)
    batch = random_batch(meta, 200, seed=2)
    summary = trace_summary(write_trace(tmp_path / "t.parquet", meta, batch))
    load = summary["expert_load"]
    assert len(load) == 3 and sum(map(sum, load)) == 200 * 3 * 2
    out = plot_expert_load(summary, tmp_path / "load.svg")
    assert out.read_bytes().startswith(MAGIC[".svg"])


def test_evaluation_figure_of_a_trace_without_occurrences(tmp_path):
    """A report with no occurrences (every figure None) crashed formatting its title and
    taking the highest bar; the library is public even where the CLI refuses empty traces."""
    import numpy as np

    from planner.trace import TraceBatch

    meta = TraceMeta("test/m", num_layers=2, num_experts=4, top_k=2, vocab_size=5)
    z = np.zeros((0, 2, 2))
    empty = TraceBatch.from_arrays(np.zeros(0), np.zeros(0), np.zeros(0), z, z)
    path = write_trace(tmp_path / "t.parquet", meta, empty)
    report = evaluate_bundle(_random_bundle(meta, 2, 1, seed=0), open_trace(path))
    assert report["overall"]["lar_balanced"] is None
    for title in ("", "given"):
        out = plot_evaluation(report, tmp_path / f"e{title}.png")
        assert out.read_bytes().startswith(MAGIC[".png"])


def test_replan_figure(tmp_path):
    cases = [
        {"source": src, "ep": ep, "move_cost": cost, "experts": 96 if ep == 4 else 512,
         "experts_moved": moved,
         "ratio": ratio, "ratio_ci90": [ratio - 0.01, ratio + 0.01]}
        for src, ep, cost, moved, ratio in (
            ("example", 4, 0.0, 28, 1.021), ("example", 4, 0.002, 12, 1.013),
            ("flame", 8, 0.0, 186, 1.005), ("flame", 8, 0.005, 0, 0.987),
        )
    ]  # fmt: skip
    out = plot_replan(cases, tmp_path / "replan.png")
    assert out.read_bytes().startswith(MAGIC[".png"])

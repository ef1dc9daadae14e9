"""Figures of ``moeplan compare|evaluate|trace info --plot`` (PNG, SVG or PDF).

- :func:`plot_comparison`: one bar per method, its balanced LAR held out (the figure plans
  are judged by), a tick for its LAR before the per-batch cap, and the per-token oracle
  bound and positional vanilla LAR as lines: how far each plan is from what any token table
  could give (the n-gram table, choosing per occurrence, can pass it), and from the default
  deployment.
- :func:`plot_evaluation`: per MoE layer, the LAR of the token table, the n-gram table, the
  online choice and after the cap, with vanilla and the oracle bound (top); the token and
  expert-load imbalance (bottom): which layers lose locality and which are unbalanced.
- :func:`plot_expert_load`: a trace's routed load of every expert of every layer over the
  layer's mean, as a heat map: the hot experts a placement has to spread.

Both take the JSON reports the commands print with ``--json`` and write the file atomically.
matplotlib is imported here only, with the non-interactive Agg backend.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from planner._io import atomic_path, check_output
from planner.errors import InputError

FORMATS = (".png", ".svg", ".pdf")
# Written into each figure's metadata (PNG "Software", SVG and PDF "Creator", all stored
# as plain text): a file that does not carry it is a user's, which --plot never replaces.
PLOT_TAG = "moeplan plot"
_TAG_KEY = {".png": "Software", ".svg": "Creator", ".pdf": "Creator"}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, dest: str | os.PathLike) -> Path:
    check_plot_path(dest)
    path = Path(dest)
    with atomic_path(path) as tmp:
        suffix = path.suffix.lower()
        fig.savefig(tmp, format=suffix[1:], dpi=120, bbox_inches="tight",
                    metadata={_TAG_KEY[suffix]: PLOT_TAG})  # fmt: skip
    _pyplot().close(fig)
    return path


def check_plot_path(dest: str | os.PathLike, inputs: tuple = ()) -> None:
    """Fail before the work, not after it, on a name matplotlib cannot write, or a path a
    file cannot be written to (a directory, under a file, inside one of the ``inputs``)."""
    if Path(dest).suffix.lower() not in FORMATS:
        raise InputError(f"--plot {dest}: the file name must end in {', '.join(FORMATS)}")
    path = check_output(dest, marker=None, what="plot", inputs=inputs)
    if path.is_file() and path.stat().st_size and not _is_our_plot(path):
        raise InputError(
            f"--plot {dest}: exists and is not a figure moeplan drew; choose another name "
            "(or remove it first)"
        )


def _is_our_plot(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return PLOT_TAG.encode() in f.read(1 << 26)
    except OSError:
        return False


def plot_comparison(result: dict, dest: str | os.PathLike, title: str = "") -> Path:
    """Bar chart of ``moeplan compare``'s result (``compare_methods``) -> the file written."""
    plt = _pyplot()
    rows = result["rows"]
    names = [r["method"] for r in rows]
    fig, ax = plt.subplots(figsize=(1.2 * len(rows) + 3, 4))
    bars = ax.bar(names, [r["lar_balanced"] for r in rows], color="#4c72b0", label="balanced LAR")
    ax.scatter(names, [r["lar"] for r in rows], marker="_", s=400, color="black", zorder=3,
               label="LAR before the cap")  # fmt: skip
    for bar, r in zip(bars, rows, strict=True):
        ratio = r.get("ratio_to_best_baseline")
        if ratio is not None:
            # above the bar and its tick (the LAR before the cap), whichever is higher
            top = max(bar.get_height(), r["lar"])
            ax.annotate(f"{ratio:.3f}x", (bar.get_x() + bar.get_width() / 2, top),
                        ha="center", va="bottom", fontsize=8, xytext=(0, 4),
                        textcoords="offset points")  # fmt: skip
    # either line is None where nothing defines it (the bound: no held-out token id is known)
    lines = [(result.get("oracle_bound"), "#55a868", "--", "per-token oracle bound"),
             (result.get("lar_vanilla"), "#c44e52", ":", "positional vanilla")]  # fmt: skip
    for value, color, ls, label in lines:
        if value is not None:
            ax.axhline(value, color=color, ls=ls, label=label)
    ax.set_ylabel("local activation rate (held out)")
    top = max([r["lar"] for r in rows] + [v for v, *_ in lines if v is not None], default=0.0)
    ax.set_ylim(0, 1.3 * top if top > 0 else 1.0)  # legend room
    ax.set_title(title or f"EP {result['ep_size']}: ratio to the best baseline above each bar")
    ax.legend(fontsize=8, loc="upper right")
    return _save(fig, dest)


def plot_evaluation(report: dict, dest: str | os.PathLike, title: str = "") -> Path:
    """Per-layer figure of ``moeplan evaluate``'s report (``evaluate_bundle``)."""
    plt = _pyplot()
    layers = report["per_layer"]
    x = [r["model_layer"] for r in layers]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(max(6, 0.35 * len(x) + 4), 6), sharex=True,
                                      height_ratios=(2, 1))  # fmt: skip
    # online first and wide: the token table's line (often the same) stays visible on it
    series = [("oracle_bound", "oracle bound", "#55a868", "--", 1.5),
              ("lar", "online", "#4c72b0", "-", 3.0), ("lar_token", "token table", "#8172b2",
              (0, (4, 2)), 1.5), ("lar_ngram", "n-gram table", "#937860", "-", 1.5),
              ("lar_balanced", "balanced (cap)", "#dd8452", "-", 1.5),
              ("lar_vanilla", "vanilla", "#c44e52", ":", 1.5)]  # fmt: skip
    for key, label, color, ls, lw in series:
        ys = [r.get(key) for r in layers]
        if all(v is None for v in ys):
            continue
        top.plot(x, [float("nan") if v is None else v for v in ys], marker="o", ms=3,
                 color=color, ls=ls, lw=lw, label=label)  # fmt: skip
    top.set_ylabel("local activation rate")
    top.set_ylim(0, 1)
    if top.get_legend_handles_labels()[0]:  # none where no layer saw an occurrence
        top.legend(fontsize=8, ncol=3, loc="lower right")
    ov = report["overall"]
    balanced = ov.get("lar_balanced")
    top.set_title(title or ("no occurrences" if balanced is None
                            else f"balanced LAR {balanced:.3f} over all layers"))  # fmt: skip
    width = 0.4
    # an imbalance is None where a layer saw no tokens: no bar there
    nan = float("nan")
    tok = [nan if r["token_imbalance_balanced"] is None else r["token_imbalance_balanced"]
           for r in layers]  # fmt: skip
    exp = [nan if r["expert_load_imbalance"] is None else r["expert_load_imbalance"]
           for r in layers]  # fmt: skip
    bottom.bar([v - width / 2 for v in x], tok, width, label="token imbalance (after the cap)",
               color="#dd8452")  # fmt: skip
    bottom.bar([v + width / 2 for v in x], exp, width, label="expert-load imbalance",
               color="#8172b2")  # fmt: skip
    bottom.axhline(1.0, color="black", lw=0.8)
    highest = max((v for v in tok + exp if v == v), default=1.0)  # v == v: not NaN
    bottom.set_ylim(0, 1.45 * highest)  # room for the legend above the bars
    bottom.set_ylabel("max / mean")
    bottom.set_xlabel("model layer (its MoE layers)")
    bottom.legend(fontsize=8, ncol=2, loc="upper left")
    return _save(fig, dest)


def plot_expert_load(summary: dict, dest: str | os.PathLike, title: str = "") -> Path:
    """Heat map of ``trace_summary``'s ``expert_load`` [L, N] over each layer's mean."""
    import numpy as np
    from matplotlib.colors import LogNorm
    from matplotlib.ticker import NullFormatter

    plt = _pyplot()
    load = np.asarray(summary["expert_load"], np.float64)
    mean = load.mean(axis=1, keepdims=True)
    ratio = np.divide(load, mean, out=np.full(load.shape, np.nan), where=mean > 0)
    big_l, n = ratio.shape
    fig, ax = plt.subplots(figsize=(min(16, 3 + 0.12 * n), min(12, 1.5 + 0.3 * big_l)))
    positive = ratio[np.isfinite(ratio) & (ratio > 0)]
    low = max(float(positive.min()), 1e-2) if positive.size else 0.1
    high = max(float(np.nanmax(ratio)) if positive.size else 10.0, 1.0 / low, 1.01)
    image = ax.imshow(np.where(ratio > 0, ratio, low), aspect="auto", cmap="RdBu_r",
                      norm=LogNorm(vmin=min(low, 1 / high), vmax=high),
                      interpolation="nearest")  # fmt: skip
    bar = fig.colorbar(image, ax=ax, label="expert load / layer mean")
    lo, hi = image.norm.vmin, image.norm.vmax
    ticks = [t for t in (0.125, 0.25, 0.5, 1, 2, 4, 8, 16) if lo <= t <= hi]
    bar.set_ticks(ticks, labels=[f"{t:g}" for t in ticks])
    bar.ax.yaxis.set_minor_formatter(NullFormatter())
    layers = summary.get("moe_layer_indices") or list(range(big_l))
    step = max(1, big_l // 16)
    ax.set_yticks(range(0, big_l, step), [str(layers[i]) for i in range(0, big_l, step)])
    ax.set_xlabel("expert")
    ax.set_ylabel("model layer (its MoE layers)")
    skew = summary.get("skewness_mean")
    ax.set_title(title or f"{summary.get('model', '')}: mean skewness (max/mean) {skew}")
    return _save(fig, dest)


def plot_replan(cases: list[dict], dest: str | os.PathLike, title: str = "") -> Path:
    """Experts moved against the ratio to the deployed plan, one line per (source, EP size)
    over the move costs (``benchmarks/replan_moves.py``'s cases) -> the file written.

    Each point is a new plan: its balanced LAR over the deployed plan's on the same held-out
    traffic with the 90% interval as an error bar, labelled with its move cost.
    """
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    series: dict[tuple, list[dict]] = {}
    for case in cases:
        series.setdefault((case["source"], case["ep"]), []).append(case)
    for (source, ep), points in series.items():
        points = sorted(points, key=lambda c: c["move_cost"])
        x = [c["experts_moved"] / c["experts"] for c in points]
        y = [c["ratio"] for c in points]
        err = [
            [c["ratio"] - c["ratio_ci90"][0] for c in points],
            [c["ratio_ci90"][1] - c["ratio"] for c in points],
        ]
        ax.errorbar(x, y, yerr=err, marker="o", capsize=3, label=f"{source}, EP {ep}")
        for c, xi, yi in zip(points, x, y, strict=True):
            ax.annotate(f"{c['move_cost']:g}", (xi, yi), fontsize=7, xytext=(4, 4),
                        textcoords="offset points")  # fmt: skip
    ax.axhline(1.0, color="gray", ls=":", label="the deployed plan")
    ax.set_xlabel("share of experts the rollout moves")
    ax.set_ylabel("balanced LAR / deployed plan's (held out)")
    ax.set_title(title or "Re-planning: experts moved against LAR gained, by move cost")
    ax.legend(fontsize=8)
    return _save(fig, dest)

"""Readable rendering of the held-out report (:mod:`planner.predict.metrics` computes it)."""

from __future__ import annotations

from rich import box
from rich.console import Group
from rich.table import Table
from rich.text import Text

from planner.predict.batches import ORDER_NOTE_RATIO
from planner.trace.info import missing_parts_note


def _fmt(x, pct: bool = True) -> str:
    if x is None:
        return "-"
    return f"{100 * x:.1f}" if pct else f"{x:.2f}"


def _us(x) -> str:
    """A prediction cost in µs; "-" when none was measured (no held-out tokens)."""
    return "-" if x is None else f"{x:.3g}"


def _col(d: dict | None, metric: str, i: int | None):
    if d is None or d.get(metric) is None:
        return None
    block = d[metric]
    return block["overall"] if i is None else block["per_layer"][i]


def _layer_table(title: str, columns: list[str], rows: list[list[str]], last_layer: int) -> Table:
    t = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, padding=(0, 1))
    for name in columns:
        t.add_column(name, justify="right")
    for i, row in enumerate(rows):
        t.add_row(*row, end_section=(i == last_layer))
    return t


def render_report(report: dict) -> Group:
    """Two per-layer tables (prediction; data and neural) and the summary lines of a report.

    Columns of the first table, in %: unseen = held-out occurrences of tokens absent from
    fitting; P = top-k precision (= recall = F1) on all / seen / unseen tokens; exact =
    exact-set accuracy; top1 = top-1 accuracy; cP / cR = confident-set precision / recall.
    Second table: NN = the neural predictor (precision on all and seen tokens, top-1);
    kurt = median Pearson kurtosis of per-token counts (fitting data); dist err =
    distribution-only error rate in %; skew = held-out expert-load max/mean.
    """
    layers = report["layers"]
    table = report["table"]
    neural = report.get("neural")
    conf = report["table_confident"]
    n = len(layers)
    index = [*range(n), None]
    names = [str(x) for x in layers] + ["all"]
    rows_a = []
    for name, i in zip(names, index, strict=True):
        unseen = report["unseen_share"]["overall" if i is None else "per_layer"]
        rows_a.append([
            name,
            _fmt(unseen if i is None else unseen[i]),
            _fmt(_col(table["all"], "precision", i)),
            _fmt(_col(table["seen"], "precision", i)),
            _fmt(_col(table["unseen"], "precision", i)),
            _fmt(_col(table["all"], "exact_set", i)),
            _fmt(_col(table["all"], "top1", i)),
            _fmt(_col(conf, "precision", i)),
            _fmt(_col(conf, "recall", i)),
        ])  # fmt: skip
    t = _layer_table(
        f"held-out token->expert prediction, % ({_split_line(report['split'])})",
        ["layer", "unseen", "P", "P seen", "P unseen", "exact", "top1", "cP", "cR"],
        rows_a,
        n - 1,
    )
    rows_b = []
    for name, i in zip(names, index, strict=True):
        row = [name]
        if neural:
            row += [
                _fmt(_col(neural["all"], "precision", i)),
                _fmt(_col(neural["seen"], "precision", i)),
                _fmt(_col(neural["all"], "top1", i)),
            ]
        row += [
            _fmt(_col(report["kurtosis"], "median", i), pct=False),
            _fmt(_col(report["distribution"], "error_rate", i)),
            _fmt(_col(report["distribution"], "skewness_heldout", i), pct=False),
        ]
        rows_b.append(row)
    cols_b = ["layer"] + (["NN P", "NN P seen", "NN top1"] if neural else [])
    t2 = _layer_table(
        "neural predictor and routing statistics" if neural else "routing statistics",
        cols_b + ["kurt", "dist err", "skew"],
        rows_b,
        n - 1,
    )
    lines: list[Table | Text] = [t, t2]
    g = report.get("unseen_with_global_fallback")
    un = _col(table["unseen"], "precision", None)
    if un is None:
        lines.append(Text("unseen tokens: none in the held-out data"))
    elif g is not None:
        lines.append(Text(
            f"unseen tokens: precision {_fmt(un)}% with the nearest-embedding fallback, "
            f"{_fmt(_col(g, 'precision', None))}% with the global top-k fallback"
        ))  # fmt: skip
    else:
        lines.append(Text(f"unseen tokens: precision {_fmt(un)}% with the global top-k fallback"))
    cost = report["cost"]
    cost_line = f"prediction cost (all layers): table {_us(cost['table_us_per_token'])} µs/token"
    if neural:
        cost_line += f", neural {_us(cost['neural_us_per_token'])} µs/token"
        tr = neural["train"]
        cost_line += (
            f" (trained {tr['steps']} steps in {tr['seconds']:.1f} s on {tr['input']}, "
            f"loss {tr['first_loss']} -> {tr['final_loss']}"
        )
        if tr.get("stopped_by") == "time":
            cost_line += "; stopped by --neural-budget: the seed alone does not reproduce it"
        cost_line += ")"
    lines.append(Text(cost_line))
    ng = report["ngram"]
    if ng.get("available", True):
        lines.append(Text(
            f"n-gram (order {ng['order']}, contiguous placement on {ng['ep_size']} devices): "
            f"top-1 device accuracy {_fmt(ng['top1_device_accuracy']['overall'])}%, "
            f"local activation rate {_fmt(ng['local_activation_rate']['overall'])}%"
        ))  # fmt: skip
    else:
        lines.append(Text(f"n-gram predictor unavailable: {ng['reason']}"))
    if report.get("exact_set_and_top1"):
        lines.append(Text(f"exact-set and top-1 accuracy: {report['exact_set_and_top1']}"))
    return Group(*lines)


def _split_line(split: dict) -> str:
    kind = split.get("kind")
    if kind == "request":
        return (
            f"request split, {split['heldout_requests']} of {split['requests']} requests held "
            f"out, seed {split['seed']}"
        )
    if kind == "thinning":
        return (
            f"binomial thinning, {split['fraction']} of activations held out, seed {split['seed']}"
        )
    if kind == "domain":
        return f"fit on {','.join(split['fit_domains'])}, evaluated on {','.join(split['eval_domains'])}"
    return str(kind)


def render_fit_summary(fit_info: dict, out: str) -> Text:
    """One paragraph on what was fitted and where it was saved."""
    parts = [f"predictor saved to {out}"]
    if fit_info.get("kind") == "trace":
        parts.append(
            f"fitted on {fit_info['fit_tokens']} tokens ({fit_info['distinct_tokens']} distinct), "
            f"{fit_info['activations_per_second'] / 1e6:.1f}M routed activations/s"
        )
    else:
        parts.append(
            f"fitted on {fit_info['fit_activations']} activations of "
            f"{fit_info['distinct_tokens']} distinct tokens, domains {','.join(fit_info['domains']) or '-'}"
        )
    if fit_info.get("embeddings"):
        parts.append(f"embeddings {fit_info['embeddings']}")
    shrinkage = fit_info.get("token_shrinkage")
    if shrinkage:
        parts.append(f"token shrinkage m per layer {' '.join(f'{m:g}' for m in shrinkage)}")
    text = "; ".join(parts)
    if missing := fit_info.get("missing_parts"):
        text += f"\nnote: {missing_parts_note(missing)}"
    if note := batch_order_note(fit_info.get("batches") or {}):
        text += f"\nnote: {note}"
    return Text(text)


def batch_order_note(batches: dict) -> str | None:
    """What to say when the fitting batches in trace order spread far more than the same
    requests' batches in a random order (:func:`planner.predict.batches.batch_spread`)."""
    spread = batches.get("spread") or {}
    in_order, mixed = spread.get("trace"), spread.get("mixed")
    if batches.get("order") != "trace" or not in_order or not mixed:
        return None
    ratio = in_order / mixed
    if ratio < ORDER_NOTE_RATIO:
        return None
    return (
        f"the fitting trace's runtime batches differ from one another {ratio:.1f}x as much as "
        "its requests in a random order would make them (a trace profiled one prompt file or "
        "domain after another?). The plans follow the batches they are fitted on: if your "
        "engine batches requests mixed, fit with --mixed-batches "
        "(`moeplan compare --mixed` shows what it changes)"
    )

"""``moeplan export`` and ``moeplan evaluate``: bundles, engine files and held-out metrics."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.table import Table
from rich.text import Text

from planner._io import check_output
from planner.cli.app import (
    app,
    comma_names,
    console,
    err_console,
    print_json,
    refuse_empty_paths,
    typed,
)
from planner.errors import InputError, SchemaError
from planner.evaluate import EvalConfig, evaluate_bundle
from planner.evaluate.compare import against_deployed
from planner.evaluate.plots import check_plot_path, plot_evaluation
from planner.export import FORMATS, export_plan, load_tables, verify_bundle
from planner.export.bundle import check_bundle_output
from planner.export.engines import check_engine_file_replaceable, get_format
from planner.trace import open_trace

ALL_FORMATS = ("moeplan", *FORMATS)


def _parse_formats(text: str) -> list[str]:
    # each once: "sglang,sglang" counted as two engine formats and wrote a bundle directory
    # where one sglang file was asked for
    names = comma_names(text)
    bad = [n for n in names if n not in ALL_FORMATS]
    if bad or not names:
        raise InputError(
            f"unknown --format {','.join(bad) or text!r}; choose from {', '.join(ALL_FORMATS)}"
        )
    return names


def _verify_table(report: dict) -> Table:
    table = Table(title=f"bundle {report['path']}", show_header=False, title_justify="left")
    table.add_column("field", style="bold")
    table.add_column("value")
    verdict = Text("ok", style="green") if report["ok"] else Text("FAILED", style="red")
    if not report["ok"]:
        verdict.append(f" {report['error'] or ''}")
    table.add_row("verified", verdict)
    if report.get("model"):
        m = report["model"]
        table.add_row(
            "model",
            f"{m['model']} (L={m['num_layers']}, N={m['num_experts']}, k={m['top_k']}, V={m['vocab_size']})",
        )
        table.add_row("ep_size / ngram_order", f"{report['ep_size']} / {report['ngram_order']}")
        table.add_row("method", str(report.get("method")))
        for name, size in report["sizes"]["files"].items():
            table.add_row(f"  {name}", f"{size / 1e6:.3f} MB")
        bad = [row for row in report["layers"] if not row["ok"]]
        table.add_row("layers", f"{len(report['layers'])} checked, {len(bad)} with problems")
    return table


@app.command("export")
def export(
    ctx: typer.Context,
    plan: str = typer.Argument(
        ..., help="Plan directory (from `moeplan solve`) or bundle to export or verify."
    ),
    out: str = typer.Option(
        None, "--out", help="Bundle directory to write (or a single engine file)."
    ),
    formats: str = typer.Option(
        "moeplan", "--format", help=f"Comma-separated formats: {', '.join(ALL_FORMATS)}."
    ),
    num_model_layers: int | None = typer.Option(
        None,
        "--num-model-layers",
        help="Decoder layers incl. dense ones (engine files indexed by model layer).",
    ),
    verify: bool = typer.Option(
        False, "--verify", help="Only verify PLAN as a bundle and describe it."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON."),
) -> None:
    """Write a plan as a moeplan bundle (int16 tables) and/or serving-engine placement files.

    With `moeplan` among the formats, or with several engine formats, OUT is a bundle
    directory that also holds each engine file. With a single engine format alone, OUT is
    that one file.
    """
    refuse_empty_paths({"plan": plan})
    if verify:
        # (values from a --config file's [export] table stand down; typed ones are refused)
        if out and typed(ctx, "out"):
            raise InputError("--verify checks PLAN where it is and writes nothing; drop --out")
        options = (("--format", "formats"), ("--num-model-layers", "num_model_layers"))
        ignored = [flag for flag, name in options if typed(ctx, name)]
        if ignored:
            raise InputError(f"--verify checks PLAN as a bundle; drop {' and '.join(ignored)}")
        report = verify_bundle(plan)
        print_json(report) if as_json else console.print(_verify_table(report))
        if not report["ok"]:
            raise SchemaError(
                report["error"] or "bundle failed verification (see the layers above)"
            )
        return
    refuse_empty_paths(out=out)
    if not out:
        raise InputError("--out is required (or pass --verify to check a bundle)")
    names = _parse_formats(formats)
    engines = [n for n in names if n != "moeplan"]
    if num_model_layers is not None and not engines and not typed(ctx, "num_model_layers"):
        num_model_layers = None  # a --config file's, for the engine formats it sizes
    if num_model_layers is not None and not engines:
        raise InputError(
            "--num-model-layers sizes the engine files; the moeplan bundle does not use it "
            "(add an engine --format, or drop it)"
        )
    bundle = load_tables(plan)
    if "moeplan" not in names and len(engines) == 1:
        from planner._io import write_bytes_atomic
        from planner.export.engines import EnginePlacement

        fmt = get_format(engines[0])
        check_output(
            out, marker=None, what=f"{fmt.name} file", inputs=(plan,), suffixes=fmt.suffixes
        )
        # the engine reads its format by the ending, case and all (SGLang: endswith(".json"))
        if Path(out).suffix not in fmt.suffixes:
            raise InputError(
                f"--out {out}: a {fmt.name} file is named *{' or *'.join(fmt.suffixes)} "
                "(lower case: the engine tells its format by the ending)"
            )
        text = fmt.render(EnginePlacement.from_bundle(bundle, num_model_layers))
        check_engine_file_replaceable(out, fmt, text)
        write_bytes_atomic(out, text.encode())
        usage = fmt.usage.replace(fmt.filename, str(Path(out).resolve()))
        result = {"path": out, "format": fmt.name, "usage": usage}
        print_json(result) if as_json else console.print(
            f"wrote {fmt.name} placement to {out}\n  use it with: {usage}"
        )
        return
    check_bundle_output(out, inputs=(plan,))
    result = export_plan(bundle, out, engines=engines, num_model_layers=num_model_layers)
    if as_json:
        print_json(result)
        return
    console.print(_verify_table(result["verify"]))
    for name, info in result["engines"].items():
        console.print(f"{name}: {info['file']}\n  use it with: {info['usage']}")
    if not result["verify"]["ok"]:
        raise SchemaError(result["verify"]["error"] or "written bundle failed verification")


def metrics_table(report: dict, title: str) -> Table:
    """Per-layer and overall LAR table of :func:`planner.evaluate.evaluate_bundle`."""
    cols = [
        ("lar_balanced", "LAR bal."), ("lar", "LAR"), ("lar_token", "token"), ("lar_ngram", "n-gram"),
        ("lar_vanilla", "vanilla"), ("oracle_bound", "bound"), ("token_imbalance_balanced", "tok.imb."),
        ("expert_load_imbalance", "exp.imb."), ("remote_fraction", "remote"),
    ]  # fmt: skip
    table = Table(title=title, title_justify="left")
    table.add_column("layer", justify="right")
    for _, head in cols:
        table.add_column(head, justify="right")
    fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
    for row in report["per_layer"]:
        table.add_row(str(row["model_layer"]), *(fmt(row[c]) for c, _ in cols))
    table.add_row("all", *(fmt(report["overall"][c]) for c, _ in cols), style="bold")
    return table


def _against_line(v: dict, lar_balanced: float, against: str) -> str:
    """What ``evaluate --against`` concludes (``v``: :func:`against_deployed`'s result)."""
    ci = v["ratio_ci90"]
    ratio = "-" if v["ratio"] is None else f"{v['ratio']:.3f}"
    if ci is not None:
        ratio += f" (90% interval {ci[0]:.3f}-{ci[1]:.3f} over {v['requests']} requests)"
    noise = "the noise of which requests were held out"
    verdict = {
        "better": f"better beyond {noise}",
        "worse": f"worse beyond {noise}",
        "level": f"level with it, within {noise}",
    }[v["verdict"]]
    moved = f"rolling it out moves {v['experts_moved']} of {v['experts']} experts to another device"
    if v["experts_moved_aligned"] < v["experts_moved"]:
        moved += f" ({v['experts_moved_aligned']} aligned: moeplan solve --align-to {against})"
    return (
        f"against {against}: balanced LAR {lar_balanced:.4f} vs "
        f"{v['deployed']['lar_balanced']:.4f}, ratio {ratio}: {verdict}; {moved}"
    )


def _gate(versus: dict | None, require_better: bool) -> int:
    """Exit status of ``evaluate --require-better``: 1, with a line on stderr, unless better."""
    if not require_better or versus is None or versus["verdict"] == "better":
        return 0
    err_console.print(
        f"moeplan: not better than the deployed plan ({versus['verdict']}); keep it",
        markup=False,
    )
    return 1


@app.command("evaluate")
def evaluate(
    plan: str = typer.Argument(..., help="Plan or bundle directory."),
    heldout: str = typer.Argument(..., help="Held-out v1 trace (file or directory)."),
    batch_tokens: int = typer.Option(
        4096, "--batch-tokens", help="Tokens per runtime batch for the balanced LAR."
    ),
    slack: float = typer.Option(
        1.1, "--slack", help="Per-batch cap: ceil(slack*B/E) tokens per device."
    ),
    hidden_size: int = typer.Option(
        0, "--hidden-size", help="Hidden size for all-to-all bytes (0: skip)."
    ),
    dtype_bytes: int = typer.Option(
        2, "--dtype-bytes", help="Bytes per hidden element on the wire."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the metrics as JSON."),
    plot: str = typer.Option(
        None, "--plot", help="Also draw the per-layer LAR and imbalance to this .png/.svg/.pdf."
    ),
    against: str = typer.Option(
        None,
        "--against",
        help="The plan or bundle deployed now: score it on the same traffic and say whether "
        "this plan beats it beyond the noise of which requests were held out (90% paired "
        "bootstrap), and how many experts rolling this plan out moves.",
    ),
    require_better: bool = typer.Option(
        False,
        "--require-better",
        help="With --against: exit 1 after the report unless the verdict is better (a "
        "nightly job rolls the plan out on exit 0 only).",
    ),
) -> int:
    """LAR (token, n-gram, online, balanced, vanilla), imbalance, remote traffic and the oracle bound."""
    config = EvalConfig(batch_tokens, slack, hidden_size, dtype_bytes)  # checks the values
    if require_better and against is None:
        raise InputError("--require-better needs --against: the deployed plan to beat")
    refuse_empty_paths({"plan": plan, "heldout": heldout}, plot=plot, against=against)
    if plot:
        check_plot_path(plot, inputs=tuple(filter(None, (plan, heldout, against))))
    bundle = load_tables(plan)
    deployed = None if against is None else load_tables(against)
    trace = open_trace(heldout)
    if not trace.num_rows:  # as compare: every figure would be empty
        raise InputError(f"held-out trace {heldout} holds no tokens; nothing to evaluate on")
    versus = None
    if deployed is not None:
        versus = against_deployed(bundle, deployed, trace, config, progress=not as_json)
        report = versus.pop("report")
    else:
        report = evaluate_bundle(bundle, trace, config, progress=not as_json)
    if plot:
        balanced = report["overall"]["lar_balanced"]
        title = f"{bundle.method}, EP {bundle.ep_size}: balanced LAR {balanced:.3f}"
        err_console.print(f"plot: {plot_evaluation(report, plot, title)}", markup=False)
    if as_json:
        print_json(report if versus is None else {**report, "against": versus})
        return _gate(versus, require_better)
    console.print(
        metrics_table(report, f"{plan} on {heldout} (EP {bundle.ep_size}, method {bundle.method})")
    )
    if versus is not None:
        console.print(
            _against_line(versus, report["overall"]["lar_balanced"], against), soft_wrap=True
        )
    ov = report["overall"]
    if ov.get("all_to_all_bytes") is not None:
        console.print(
            f"all-to-all: {ov['all_to_all_bytes'] / 1e6:.1f} MB vs vanilla {ov['all_to_all_bytes_vanilla'] / 1e6:.1f} MB"
        )
    return _gate(versus, require_better)

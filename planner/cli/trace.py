"""``moeplan trace info|synth|ingest sglang``."""

from __future__ import annotations

import typer

from planner.cli.app import (
    console,
    err_console,
    print_json,
    refuse_empty_paths,
    trace_app,
    typed,
)
from planner.evaluate.plots import check_plot_path, plot_expert_load
from planner.trace.info import trace_summary


@trace_app.command("info")
def info(
    path: str = typer.Argument(..., help="Trace file or directory of part-*.parquet files."),
    as_json: bool = typer.Option(False, "--json", help="Print the summary as JSON."),
    plot: str = typer.Option(
        None, "--plot", help="Also draw every layer's expert load as a heat map (.png/.svg/.pdf)."
    ),
) -> None:
    """Model, layers, experts, top-k, tokens, requests and per-layer load skewness of a trace."""
    refuse_empty_paths({"path": path}, plot=plot)
    if plot:
        check_plot_path(plot, inputs=(path,))
    summary = trace_summary(path)
    if plot:
        err_console.print(f"plot: {plot_expert_load(summary, plot)}")
    if as_json:
        print_json(summary)
        return
    from planner.trace.info import render_summary

    console.print(render_summary(summary))


@trace_app.command("synth")
def synth(
    out: str = typer.Option(
        ...,
        "--out",
        help="Trace to write: a directory of parts, or one file if it ends in .parquet.",
    ),
    preset: str = typer.Option("default", "--preset", help="Start from: default or deepseek-v3."),
    layers: int | None = typer.Option(None, "--layers", help="MoE layers L."),
    experts: int | None = typer.Option(None, "--experts", help="Routed experts per layer N."),
    top_k: int | None = typer.Option(None, "--top-k", help="Experts per token and layer k."),
    vocab: int | None = typer.Option(None, "--vocab", help="Vocabulary size V."),
    tokens: int | None = typer.Option(None, "--tokens", help="Token occurrences T."),
    requests: int | None = typer.Option(
        None, "--requests", help="Requests the tokens are split over."
    ),
    token_zipf: float | None = typer.Option(None, "--token-zipf", help="Zipf exponent of tokens."),
    expert_zipf: float | None = typer.Option(
        None, "--expert-zipf", help="Zipf exponent of expert popularity (0 = even load)."
    ),
    affinity: float | None = typer.Option(
        None, "--affinity", help="Probability in [0, 1] a slot is the token's preferred expert."
    ),
    layer_correlation: float | None = typer.Option(
        None, "--layer-correlation", help="Probability in [0, 1] routing follows layer l-1's top-1."
    ),
    domains: int | None = typer.Option(None, "--domains", help="Request domains D."),
    seed: int | None = typer.Option(None, "--seed", help="Seed of every random choice."),
    model: str | None = typer.Option(None, "--model", help="Model name in the trace metadata."),
    first_moe_layer: int | None = typer.Option(
        None,
        "--first-moe-layer",
        help="Model layer index of the first MoE layer (dense layers before it, as "
        "DeepSeek-V2-Lite's one or DeepSeek-V3's three).",
    ),
    rows_per_part: int = typer.Option(1_000_000, "--rows-per-part", help="Rows per part file."),
    force: bool = typer.Option(False, "--force", help="Replace --out if it exists."),
    as_json: bool = typer.Option(False, "--json", help="Print the summary as JSON."),
) -> None:
    """Write a synthetic trace with known token->expert and layer->layer affinity."""
    from planner.trace.synth import preset_config, timed_synthesize

    refuse_empty_paths(out=out)
    config = preset_config(
        preset,
        num_layers=layers,
        num_experts=experts,
        top_k=top_k,
        vocab_size=vocab,
        num_tokens=tokens,
        num_requests=requests,
        token_zipf=token_zipf,
        expert_zipf=expert_zipf,
        affinity=affinity,
        layer_correlation=layer_correlation,
        num_domains=domains,
        seed=seed,
        model=model,
        first_moe_layer=first_moe_layer,
    )
    summary = timed_synthesize(
        config, out, rows_per_part=rows_per_part, progress=True, overwrite=force
    )
    if as_json:
        print_json(summary)
        return
    console.print(
        f"wrote {summary['path']}: {summary['tokens']} tokens, L={summary['num_layers']} "
        f"N={summary['num_experts']} k={summary['top_k']} V={summary['vocab_size']}, "
        f"{summary['parts']} part(s), {summary['bytes'] / 1e6:.1f} MB in {summary['seconds']:.1f} s"
    )


ingest_app = typer.Typer(
    help="Convert routing dumps of serving engines into v1 traces.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
trace_app.add_typer(ingest_app, name="ingest")


@ingest_app.command("sglang")
def ingest_sglang(
    dumps: list[str] = typer.Argument(
        ..., help="expert_distribution_recorder_*.pt files (per_token mode) or directories of them."
    ),
    out: str = typer.Option(
        ...,
        "--out",
        help="Trace to write: a directory of parts, or one file if it ends in .parquet.",
    ),
    vocab_size: int | None = typer.Option(
        None, "--vocab-size", help="The model's vocabulary size (default: largest token id + 1)."
    ),
    model: str = typer.Option(
        "sglang", "--model", help="Model name for the trace (use the same name as other traces)."
    ),
    skip_decode: bool = typer.Option(False, "--skip-decode", help="Leave out decode passes."),
    force: bool = typer.Option(False, "--force", help="Replace --out if it exists."),
    as_json: bool = typer.Option(False, "--json", help="Print the summary as JSON."),
) -> None:
    """Convert SGLang expert-distribution per_token dumps (physical ids -> logical experts)."""
    from planner.trace.ingest_sglang import ingest_sglang as run_ingest

    refuse_empty_paths({"dumps": dumps}, out=out)
    stats = run_ingest(
        dumps, out, model=model, vocab_size=vocab_size, skip_decode=skip_decode, overwrite=force
    )
    s = stats.summary()
    if as_json:
        print_json(s)
        return
    console.print(
        f"wrote {s['path']}: {s['tokens']} tokens in {s['requests']} requests from {s['records']} "
        f"records in {s['files']} file(s); L={s['num_layers']} (model layers "
        f"{s['moe_layer_indices'][0]}..{s['moe_layer_indices'][-1]}) N={s['num_experts']} "
        f"({s['num_physical_experts']} physical slots) k={s['top_k']} V={s['vocab_size']}"
        + (" (inferred)" if s["vocab_inferred"] else "")
    )
    console.print(
        f"dropped {s['dropped_tokens']} padded tokens and {s['duplicate_records']} replica records; "
        "weights are uniform 1/k (SGLang records ids only)"
    )
    if s["unknown_tokens"] and s["vocab_inferred"]:
        console.print(
            f"{s['unknown_tokens']} tokens had negative ids and are written as -1 (unknown)"
        )
    elif s["unknown_tokens"]:
        console.print(
            f"{s['unknown_tokens']} tokens had ids outside [0, {s['vocab_size']}) and are written "
            "as -1 (unknown): is --vocab-size the model's?"
        )


@trace_app.command("split")
def split(
    ctx: typer.Context,
    path: str = typer.Argument(..., help="Trace to split."),
    fit_out: str = typer.Option(..., "--fit-out", help="Trace directory for the fitting side."),
    heldout_out: str = typer.Option(
        ..., "--heldout-out", help="Trace directory for the held-out side."
    ),
    holdout: float | None = typer.Option(
        None, "--holdout", help="Share of requests held out, in (0, 1) (default 0.5)."
    ),
    seed: int = typer.Option(0, "--seed", help="Seed of the split (same as `fit --seed`)."),
    heldout_domain: str | None = typer.Option(
        None,
        "--heldout-domain",
        help="Hold out every request of these domains (comma-separated; the trace's "
        "'domain' column) instead of a random share of requests.",
    ),
    force: bool = typer.Option(
        False, "--force", help="Replace --fit-out / --heldout-out if they are earlier traces."
    ),
) -> None:
    """Split a trace by request (a random share, or whole domains) into fitting and held-out traces."""
    from planner.errors import InputError
    from planner.predict.split import format_domains, split_trace, split_trace_by_domain

    refuse_empty_paths({"path": path}, fit_out=fit_out, heldout_out=heldout_out)
    if (
        heldout_domain is not None
        and not typed(ctx, "heldout_domain")
        and (typed(ctx, "holdout") or typed(ctx, "seed"))
    ):
        heldout_domain = None  # a --config file's domain stands down for a typed random split
    if heldout_domain is not None:
        # typed options that only the random split uses are refused; values a --config
        # file's [trace.split] table gives (e.g. the example's holdout and seed) stand down
        given = [f"--{name}" for name in ("holdout", "seed") if typed(ctx, name)]
        if given:
            raise InputError(
                f"{' and '.join(given)} {'are' if len(given) > 1 else 'is'} for a random "
                "split; --heldout-domain holds out whole domains: give one or the other"
            )
        s = split_trace_by_domain(
            path, fit_out, heldout_out, heldout_domain.split(","), overwrite=force
        )
        console.print(
            f"held out domain(s) {format_domains(s['heldout_domains'])} of "
            f"{format_domains(s['domains'])}: "
            f"{s['fit_requests']} requests ({s['fit_tokens']} tokens) -> {fit_out}, "
            f"{s['heldout_requests']} ({s['heldout_tokens']} tokens) -> {heldout_out}"
        )
        return
    s = split_trace(
        path, fit_out, heldout_out, 0.5 if holdout is None else holdout, seed, overwrite=force
    )
    console.print(
        f"{s['requests']} requests: {s['requests'] - s['heldout_requests']} ({s['fit_tokens']} tokens) -> "
        f"{fit_out}, {s['heldout_requests']} ({s['heldout_tokens']} tokens) -> {heldout_out}"
    )


@trace_app.command("shuffle")
def shuffle(
    path: str = typer.Argument(..., help="Trace whose requests to shuffle."),
    out: str = typer.Option(..., "--out", help="Trace directory to write."),
    seed: int = typer.Option(0, "--seed", help="Seed of the request order."),
    force: bool = typer.Option(False, "--force", help="Replace --out if it is an earlier trace."),
) -> None:
    """Write a trace with its requests in a random order, each request's rows together: its
    runtime batches then mix requests a trace profiled domain by domain serves apart."""
    from planner.predict.split import shuffle_requests

    refuse_empty_paths({"path": path}, out=out)
    s = shuffle_requests(path, out, seed, overwrite=force)
    console.print(f"{s['requests']} requests ({s['tokens']} tokens) in a random order -> {out}")

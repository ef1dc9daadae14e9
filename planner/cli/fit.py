"""``moeplan fit``: fit the routing predictors on a trace or counts table, report held-out."""

from __future__ import annotations

from pathlib import Path

import typer

from planner.cli.app import app, comma_names, console, print_json, refuse_empty_paths, typed
from planner.errors import InputError


def _domains(value: str | None, option: str) -> tuple[str, ...]:
    """The domains a counts option names (none given: every domain); a value naming none
    (",") is refused, not read as every domain."""
    if value is None:
        return ()
    names = comma_names(value)
    if not names:
        raise InputError(f"{option} {value!r} names no domain; give comma-separated domains")
    return tuple(names)


@app.command("fit")
def fit(
    ctx: typer.Context,
    trace: str = typer.Argument(
        ..., help="v1 trace (file or directory of part-*.parquet) or a token-expert counts table."
    ),
    out: str = typer.Option(..., "--out", "-o", help="Predictor directory to write."),
    holdout: float | None = typer.Option(
        None,
        "--holdout",
        help="Hold out this fraction (requests of a trace; activations of a counts table, by "
        "binomial thinning) and report on it. The papers fit on 20% and test on 80%: 0.8.",
    ),
    embeddings: str | None = typer.Option(
        None,
        "--embeddings",
        help="Input embeddings [V, d] (.npy or .safetensors) for the nearest-token fallback of "
        "unseen tokens. Default: the trace directory's embeddings.safetensors if present.",
    ),
    no_embeddings: bool = typer.Option(
        False,
        "--no-embeddings",
        help="Do not use embeddings found next to the trace (an --embeddings file is still used).",
    ),
    neural: bool = typer.Option(False, "--neural", help="Also train the small neural predictor."),
    neural_steps: int = typer.Option(
        3000,
        "--neural-steps",
        help="Neural predictor training steps (the budget: the same seed gives the same predictor).",
    ),
    neural_budget: float | None = typer.Option(
        None,
        "--neural-budget",
        help="Also stop neural training after this many seconds (then the predictor depends on "
        "the machine's speed; the report says when the clock stopped it). Default: no clock.",
    ),
    seed: int = typer.Option(
        0,
        "--seed",
        help="Seed of the split and the neural predictor (same seed, same result).",
    ),
    model: str | None = typer.Option(
        None, "--model", help="Counts tables: model to read (substring match)."
    ),
    domain: str | None = typer.Option(
        None, "--domain", help="Counts tables: comma-separated domains to fit on (default all)."
    ),
    eval_domain: str | None = typer.Option(
        None, "--eval-domain", help="Counts tables: comma-separated domains to report on."
    ),
    num_experts: int | None = typer.Option(None, "--num-experts", help="Counts tables: N."),
    top_k: int | None = typer.Option(None, "--top-k", help="Counts tables: k."),
    vocab_size: int | None = typer.Option(None, "--vocab-size", help="Counts tables: V."),
    ep_size: int = typer.Option(
        8, "--ep-size", help="Devices of the contiguous placement used for the n-gram figure."
    ),
    ngram_order: int = typer.Option(2, "--ngram-order", help="n of the n-gram figure (1-3)."),
    ngram_routed: bool = typer.Option(
        False,
        "--ngram-routed",
        help="Keep every routed expert in the n-gram statistics (better n-gram tables, slower fit).",
    ),
    batch_rows: int | None = typer.Option(
        None,
        "--batch-rows",
        help="Trace rows per chunk (default: 65536, fewer for a wide model); memory only, "
        "the predictor does not depend on it.",
    ),
    batch_tokens: int = typer.Option(
        4096, "--batch-tokens", help="Tokens per runtime batch, for the fitting batches' mix."
    ),
    mixed_batches: bool = typer.Option(
        False,
        "--mixed-batches",
        help="Record the fitting batches as the requests would make them served in a random "
        "order (each request's rows together), not in trace order: for a trace profiled one "
        "domain or prompt file at a time that will be served mixed with other traffic.",
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the figures as JSON."),
) -> None:
    """Fit token->expert, distribution-only (and neural) predictors; report held-out figures.

    With --holdout the saved predictor is the one evaluated (fitted on the rest); fit again
    without --holdout to use all the data.
    """
    from planner.predict.counts import CountsSelection
    from planner.predict.fit import FitConfig, fit_predictor
    from planner.predict.neural import NeuralConfig
    from planner.predict.predictor import check_destination
    from planner.predict.report import render_fit_summary, render_report

    refuse_empty_paths({"trace": trace}, out=out, embeddings=embeddings)
    if model is not None and not model.strip():  # matched every model as a substring
        raise InputError("--model is empty; name the model to read")
    if not Path(trace).exists():
        raise InputError(f"{trace}: no such trace or counts file")
    check_destination(out, inputs=(trace, *([embeddings] if embeddings else [])))
    # The command line wins over a --config file: of --holdout and --eval-domain, a value the
    # file gives stands down for the other one typed.
    if eval_domain and not typed(ctx, "holdout"):
        holdout = None
    elif eval_domain and not typed(ctx, "eval_domain"):
        eval_domain = None
    given = [f"--{n.replace('_', '-')}" for n in ("neural_steps", "neural_budget") if typed(ctx, n)]
    if given and not neural:
        raise InputError(f"{' and '.join(given)} set the neural predictor's training; add --neural")
    given = [f"--{n.replace('_', '-')}" for n in ("ep_size", "ngram_order") if typed(ctx, n)]
    if given and holdout is None and not eval_domain:  # they change nothing else
        raise InputError(
            f"{' and '.join(given)} set the held-out report's n-gram figure; add --holdout "
            "(or --eval-domain for a counts table)"
        )
    config = FitConfig(
        holdout=holdout,
        seed=seed,
        embeddings=embeddings,
        auto_embeddings=not no_embeddings,
        neural=neural,
        neural_config=NeuralConfig(max_steps=neural_steps, time_budget_s=neural_budget),
        ep_size=ep_size,
        ngram_order=ngram_order,
        ngram_routed=ngram_routed,
        batch_rows=batch_rows,
        batch_tokens=batch_tokens,
        mixed_batches=mixed_batches,
        counts=CountsSelection(model, _domains(domain, "--domain"), num_experts, top_k, vocab_size),
        eval_domains=_domains(eval_domain, "--eval-domain"),
        progress=not as_json,
    )
    result = fit_predictor(trace, config)
    result.predictor.save(out)
    fit_info = result.predictor.fit_info
    if as_json:
        print_json({"predictor": out, "fit": fit_info, "report": result.report})
        return
    console.print(render_fit_summary(fit_info, out))
    if result.report is not None:
        console.print(render_report(result.report))

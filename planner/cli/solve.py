"""``moeplan solve`` and ``moeplan compare``."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import tempfile
from pathlib import Path
from typing import Any

import typer
from rich.table import Table

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
from planner.errors import InputError, MismatchError
from planner.evaluate import EvalConfig
from planner.evaluate.compare import compare_methods
from planner.evaluate.plots import check_plot_path, plot_comparison
from planner.export import load_tables
from planner.predict.predictor import load_predictor
from planner.solve.align import align_plan
from planner.solve.expert_balance import cap_unreached
from planner.solve.ilp import layer_lp_path, lp_files_together, lp_path_option
from planner.solve.ngram_term import DEFAULT_WEIGHT
from planner.solve.pipeline import PlanConfig, make_plan
from planner.solve.plan import check_plan_output
from planner.solve.registry import SOLVERS
from planner.solve.settle import check_move_cost
from planner.trace import open_trace


def _options(text: str | None) -> dict:
    if not text:
        return {}
    try:
        opts = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as e:
        why = "nested too deeply" if isinstance(e, RecursionError) else str(e)
        raise InputError(
            f'--options is not JSON ({why}); e.g. \'{{"ceo": {{"variant": "paper"}}}}\''
        ) from None
    if not isinstance(opts, dict):
        raise InputError("--options must be a JSON object of per-method options")
    unknown = sorted(set(opts) - set(SOLVERS))
    if unknown:
        raise InputError(
            f"--options names no solver {', '.join(map(repr, unknown))}; "
            f"its keys are methods: {', '.join(SOLVERS)}"
        )
    return opts


def _not_for_vanilla(ctx: typer.Context, method: str, name: str, value: Any, off: Any) -> Any:
    """``value`` of option ``name``, or ``off`` (its unset value) where it is set and
    ``method`` is vanilla, the contiguous layout it does not apply to: an InputError where
    it was typed, while a --config file's value stands down for the methods it applies to."""
    if value == off or method != "vanilla":
        return value
    if typed(ctx, name):
        flag = "--" + name.replace("_", "-")
        raise InputError(f"{flag} does not apply to --method vanilla (the contiguous layout)")
    return off


def _check_lp_path(opts: dict, layers: int, inputs: tuple, outputs: tuple = ()) -> None:
    """The ILP's LP files (one a layer, :func:`planner.solve.ilp.layer_lp_path`) may not
    replace one of the command's inputs (a file of the predictor directory) nor lie in or on
    one of its outputs (the plan directory, which the plan then replaces), and each must be
    writable: checked before the work, not when the layer's program is written."""
    lp_path = lp_path_option(opts)
    if lp_path is None:
        return
    written = [(out, Path(out).resolve()) for out in filter(None, outputs)]
    for layer in range(layers):
        path = layer_lp_path(lp_path, layer)
        here = path.resolve()
        for out, there in written:
            if here == there or there in here.parents:
                raise InputError(
                    f"ilp lp_path {lp_path}: the command writes {out} there; choose another path"
                )
        check_output(
            path,
            marker=None,
            what="LP file (ilp lp_path)",
            inputs=tuple(filter(None, inputs)),
        )


@app.command("solve")
def solve(
    ctx: typer.Context,
    predictor: str = typer.Argument(..., help="Predictor directory from `moeplan fit`."),
    out: str = typer.Option(..., "--out", help="Plan directory to write."),
    method: str = typer.Option("ceo", "--method", help=f"Solver: {', '.join(SOLVERS)}."),
    ep: int = typer.Option(..., "--ep", help="EP size E (devices sharing a layer's experts)."),
    beta: float = typer.Option(1.1, "--beta", help="Token load factor of the per-device cap."),
    seed: int = typer.Option(0, "--seed", help="Seed of every random choice."),
    jobs: int = typer.Option(
        1,
        "--jobs",
        help="Worker processes solving layers in parallel. With the n-gram term (the default) "
        "layers are solved in order within runs of up to 16, so a model of 16 layers or fewer "
        "gains nothing from more than one.",
    ),
    time_limit: float = typer.Option(
        None,
        "--time-limit",
        help="Wall-clock seconds per layer: iterative solvers stop soon after it; the ILP (default 60 s a layer) keeps its "
        "best placement at it, and its solver process is killed at most 5 s + 10% later. CEO's own "
        "budget counts work, not time, so "
        "the same inputs and seed give the same plan on any machine; a time limit that cuts "
        "a solve makes it depend on the machine's speed.",
    ),
    ngram_order: int = typer.Option(
        2, "--ngram-order", help="n of the n-gram device tables (1-3)."
    ),
    ngram_weight: float = typer.Option(
        DEFAULT_WEIGHT,
        "--ngram-weight",
        help="Weight of the n-gram term: layers solved in order, each placement also chosen "
        "for its n-gram table (0 = layers independent). Layers whose tokens do not carry "
        "over to new requests (the fitted token shrinkage) weigh it up to 2x (2x sqrt(k) for "
        "the top-1 statistic).",
    ),
    chain_passes: int = typer.Option(
        0,
        "--chain-passes",
        help="Sweeps of the chain polish after the solver: each layer revisited with the "
        "layers after it placed, for their n-gram tables (0 = off). Raised the baselines' "
        "held-out LAR by 3-5% on FLAME-MoE and left CEO's unchanged on average.",
    ),
    ngram_defer: bool = typer.Option(
        True,
        "--ngram-defer/--no-ngram-defer",
        help="Weigh each layer's n-gram confidences by the share of token occurrences its "
        "fitted token shrinkage discounts, so that the n-gram table overrides only tokens "
        "the token table knows little of (--no-ngram-defer: the paper's table).",
    ),
    expert_beta: float | None = typer.Option(
        None,
        "--expert-beta",
        help="Cap each device's expert load (the routed activations its experts process) at "
        "this multiple of the mean (e.g. 1.25; default: unbounded): CEO searches under it, "
        "the other methods are brought under it by expert swaps after they solve (not "
        "vanilla, the contiguous layout); where swaps cannot reach it, the lowest peak they "
        "find, with a note. Co-activated hot experts grouped for locality load their device.",
    ),
    polish: bool = typer.Option(
        False,
        "--polish",
        help="End the method with the local search CEO ends with (exact expert moves, then "
        "priced swaps; CEO has it already, vanilla stays as it is).",
    ),
    batch_prices: bool = typer.Option(
        False,
        "--batch-prices",
        help="End the method (not vanilla) with its tokens re-assigned priced per fitting "
        "batch, so that the runtime's per-batch cap takes back less. Only where the served "
        "batches will be made up as the fitting trace's are (requests in the same order): "
        "served mixed, such a plan loses (docs/solvers.md).",
    ),
    options: str = typer.Option(None, "--options", help="Per-method solver options as JSON."),
    align_to: str = typer.Option(
        None,
        "--align-to",
        help="The plan or bundle deployed now (same model and EP size): number this plan's "
        "devices, layer by layer, so that the most experts stay where it has them (nothing "
        "else changes unless --move-cost is given); the experts that change device are "
        "reported.",
    ),
    move_cost: float = typer.Option(
        0.0,
        "--move-cost",
        help="With --align-to: the LAR a layer must gain per expert it moves off its "
        "deployed device (e.g. 0.002); every solver weighs the moves in its own search "
        "(0: move freely).",
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the per-layer reports as JSON."),
) -> None:
    """Place every layer's experts on E devices and give every token a device."""
    refuse_empty_paths({"predictor": predictor}, out=out, align_to=align_to)
    # the deployed plan is read first: a path that is none is named as such
    deployed = None if align_to is None else load_tables(align_to)
    inputs = tuple(filter(None, (predictor, align_to)))
    check_plan_output(out, inputs=inputs)  # before the work, not after it
    expert_beta = _not_for_vanilla(ctx, method, "expert_beta", expert_beta, None)
    opts = _options(options)
    others = sorted(set(opts) - {method})
    if others and typed(ctx, "options"):  # (compare takes options for many methods)
        raise InputError(
            f"--options sets {', '.join(map(repr, others))} but solve runs --method {method}; "
            f"give options for {method!r} only"
        )
    # a --config file's options for other methods are not this plan's (plan.json recorded
    # them as if they had run)
    opts = {m: o for m, o in opts.items() if m == method}
    chain_passes = _not_for_vanilla(ctx, method, "chain_passes", chain_passes, 0)
    batch_prices = _not_for_vanilla(ctx, method, "batch_prices", batch_prices, False)
    check_move_cost(move_cost, "--move-cost")
    if move_cost and (deployed is None or method == "vanilla"):
        if typed(ctx, "move_cost"):
            raise InputError(
                "--move-cost needs --align-to: the deployed plan to count moves from"
                if deployed is None
                else "--move-cost does not apply to --method vanilla (the contiguous layout)"
            )
        move_cost = 0.0  # a --config file's, for the re-plans it applies to
    pred = load_predictor(predictor)
    _check_lp_path(opts, pred.meta.num_layers, inputs, (out,))
    if deployed is not None:  # checked before the work
        if deployed.ep_size != ep:
            raise InputError(f"--align-to {align_to} is a plan of EP {deployed.ep_size}, not {ep}")
        if deployed.meta.fingerprint() != pred.fingerprint:
            raise MismatchError(
                f"--align-to {align_to} was made for model {deployed.meta.model!r}, "
                f"the predictor for {pred.meta.model!r} (fingerprints differ: "
                f"{deployed.meta.fingerprint_difference(pred.meta)})"
            )
    reference = None if deployed is None else deployed.expert_to_device
    # the ILP's LP files, if asked for, are staged and move into place with the plan
    with lp_files_together(opts, pred.meta.num_layers) as solver_opts:
        config = PlanConfig(
            method, ep, beta, seed, jobs, time_limit, ngram_order, solver_opts, ngram_weight,
            chain_passes, ngram_defer, expert_beta, polish, move_cost, batch_prices,
        )  # fmt: skip
        plan = make_plan(pred, config, progress=not as_json, reference=reference)
        if deployed is not None:
            plan = align_plan(plan, deployed.expert_to_device, deployed.meta.fingerprint())
        # the options as given: the staging folder's LP path is gone after the block
        plan = dataclasses.replace(plan, config=plan.config | {"options": opts})
        plan.save(out)
    _note_unreached_cap(cap_unreached(plan.reports), len(plan.reports), expert_beta)
    if as_json:
        print_json({"plan": out, "reports": plan.reports, "aligned": plan.config.get("aligned")})
        return
    table = Table(
        title=f"plan {out}: {method}, EP {ep}, beta {beta}, seed {seed}", title_justify="left"
    )
    for head in (
        "layer",
        "local rate (fit)",
        "token imbalance",
        "expert imbalance",
        "seconds",
        "info",
    ):
        table.add_column(head, justify="right" if head != "info" else "left")
    for layer, r in enumerate(plan.reports):
        info = ", ".join(f"{k}={v}" for k, v in r["info"].items() if not isinstance(v, list | dict))
        table.add_row(
            str(pred.meta.moe_layer_indices[layer]),
            f"{r['local_rate']:.3f}",
            f"{r['token_imbalance']:.3f}",
            f"{r['expert_imbalance']:.3f}",
            f"{r['seconds']:.2f}",
            info[:60],
        )
    console.print(table)
    if deployed is not None:
        a = plan.config["aligned"]
        console.print(
            f"aligned to {align_to}: {a['experts_moved']} of {a['experts']} experts change "
            f"device ({a['experts_moved_unaligned']} without aligning)"
        )


def _note_unreached_cap(
    short: list[float], layers: int, expert_beta: float | None, whose: str = "the plan"
) -> None:
    """One line on stderr where the expert-load cap was out of reach of the swaps on the
    ``short`` layers (their imbalances, :func:`planner.solve.expert_balance.cap_unreached`)."""
    if expert_beta is not None and short:
        low, high = f"{min(short):.3f}", f"{max(short):.3f}"
        err_console.print(
            f"note: the expert-load cap {expert_beta:g} is out of reach on {len(short)} of "
            f"{layers} layers; {whose} keeps the lowest peak found there "
            f"({low if low == high else f'{low}-{high}'} of the mean)",
            soft_wrap=True,
        )


@app.command("compare")
def compare(
    ctx: typer.Context,
    predictor: str = typer.Argument(..., help="Predictor directory from `moeplan fit`."),
    heldout: str = typer.Argument(..., help="Held-out v1 trace."),
    methods: str = typer.Option(
        "ceo,metis,kmeans,alternating,vanilla", "--methods", help="Comma-separated solvers."
    ),
    ep: int = typer.Option(..., "--ep", help="EP size E."),
    beta: float = typer.Option(1.1, "--beta"),
    seed: int = typer.Option(0, "--seed"),
    jobs: int = typer.Option(1, "--jobs"),
    time_limit: float = typer.Option(
        None,
        "--time-limit",
        help="Seconds per layer (the ILP's default: 60; it needs one on big problems).",
    ),
    ngram_order: int = typer.Option(2, "--ngram-order"),
    ngram_weight: float = typer.Option(
        DEFAULT_WEIGHT, "--ngram-weight", help="As in `moeplan solve`."
    ),
    batch_tokens: int = typer.Option(
        4096, "--batch-tokens", help="Tokens per runtime batch for the balanced LAR."
    ),
    chain_passes: int = typer.Option(
        0, "--chain-passes", help="As in `moeplan solve`; given to every method but vanilla."
    ),
    ngram_defer: bool = typer.Option(
        True, "--ngram-defer/--no-ngram-defer", help="As in `moeplan solve`."
    ),
    expert_beta: float = typer.Option(
        None, "--expert-beta", help="As in `moeplan solve`; given to every method but vanilla."
    ),
    polish: bool = typer.Option(
        False,
        "--polish",
        help="End every method but CEO (which has it) and vanilla with CEO's local search: "
        "CEO's search against baselines given the same local search.",
    ),
    batch_prices: bool = typer.Option(
        False, "--batch-prices", help="As in `moeplan solve`; given to every method but vanilla."
    ),
    options: str = typer.Option(None, "--options", help="Per-method solver options as JSON."),
    fitting: str = typer.Option(
        None,
        "--fitting",
        help="Also score each plan on this trace, the one the predictor was fitted on "
        "(column 'fit. bal.'): a method that loses there too loses by its search, one that "
        "loses only held out by how its plan carries over to new requests.",
    ),
    mixed: bool = typer.Option(
        False,
        "--mixed",
        help="Also score each plan on the held-out requests in a random order, each "
        "request's rows together (drawn with --seed; column 'bal. mixed'): the traffic "
        "served in batches that mix its requests, as an engine batching many users' does, "
        "where a trace profiled domain by domain serves each domain in batches of its own.",
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the comparison as JSON."),
    plot: str = typer.Option(
        None, "--plot", help="Also draw each method's LAR against the bound to this .png/.svg/.pdf."
    ),
) -> None:
    """Solve with each method and compare held-out LAR, balance and time, with the oracle bound."""
    refuse_empty_paths({"predictor": predictor, "heldout": heldout}, plot=plot, fitting=fitting)
    if plot:
        check_plot_path(plot, inputs=tuple(filter(None, (predictor, heldout, fitting))))
    names = comma_names(methods)
    if not names:
        raise InputError(f"--methods {methods!r} names no method; choose from {', '.join(SOLVERS)}")
    unknown = [m for m in names if m not in SOLVERS]
    if unknown:
        raise InputError(
            f"unknown method(s) {', '.join(unknown)}; choose from {', '.join(SOLVERS)}"
        )
    opts = _options(options)
    unused = [m for m in opts if m not in names]
    if unused and typed(ctx, "options"):  # (a --config file's options may cover more methods)
        raise InputError(
            f"--options sets {', '.join(map(repr, unused))}, not among --methods "
            f"{','.join(names)}; add the method or drop its options"
        )
    pred = load_predictor(predictor)
    _check_lp_path(opts, pred.meta.num_layers, (predictor, heldout, fitting), (plot,))
    trace = open_trace(heldout)
    fitting_trace = None if fitting is None else open_trace(fitting)
    with contextlib.ExitStack() as stack:
        also = {}
        if mixed:
            from planner.predict.split import shuffle_requests

            pred.check_compatible(trace.meta, "held-out trace")  # before the copy
            tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="moeplan-mixed-")))
            shuffle_requests(heldout, tmp / "heldout", seed)
            also["mixed"] = open_trace(tmp / "heldout")
        solver_opts = stack.enter_context(lp_files_together(opts, pred.meta.num_layers))
        config = PlanConfig(
            names[0], ep, beta, seed, jobs, time_limit, ngram_order, solver_opts, ngram_weight,
            chain_passes, ngram_defer, expert_beta, polish, batch_prices=batch_prices,
        )  # fmt: skip
        result = compare_methods(
            pred,
            trace,
            names,
            config,
            EvalConfig(batch_tokens=batch_tokens),
            progress=not as_json,
            fitting=fitting_trace,
            also=also,
        )
    if plot:
        title = f"{heldout}, EP {ep}: ratio to the best baseline above each bar"
        err_console.print(f"plot: {plot_comparison(result, plot, title)}")
    for row in result["rows"]:
        short, layers = row["expert_cap_unreached"], pred.meta.num_layers
        _note_unreached_cap(short, layers, expert_beta, whose=f"{row['method']}'s plan")
    if as_json:
        print_json(result)
        return
    note = None
    if ep == pred.meta.num_experts:
        note = (
            "with one expert a device every placement is a relabelling of every other: the "
            "methods differ only in their token tables"
        )
    console.print(comparison_table(result, f"held-out {heldout}, EP {ep}", note))
    unseen = result["unseen_tokens"]
    if unseen["shifted"]:
        err_console.print(
            f"note: {unseen['heldout']:.1%} of the held-out token occurrences are tokens the "
            f"predictor never saw, where traffic like its fitting trace would have about "
            f"{unseen['expected']:.1%}: this trace is unlike the one the plans were fitted on "
            "(another domain?), and plans carry over worse to such traffic, CEO's most "
            "(benchmarks/RESULTS.md, 'Domain shift'). Profile on traffic like what you will "
            "serve; failing that, compare the methods on it and deploy the one that holds up",
            soft_wrap=True,
        )
    if mixed:
        _note_mixed_winner(result["rows"])


# How far another plan must lead the trace-order winner served mixed for compare to say so
# (a share of the winner's balanced LAR served mixed): less is within the noise of which
# requests were held out (benchmarks/RESULTS.md, session 52: a ratio's noise is about 0.4% on
# the example, 1.1% on FLAME-MoE).
MIXED_NOTE_MARGIN = 0.005


def _note_mixed_winner(rows: list[dict]) -> None:
    """Say so when the held-out requests served mixed make another plan the best by more
    than :data:`MIXED_NOTE_MARGIN`."""
    solved = [r for r in rows if r["method"] != "vanilla"]
    if len(solved) < 2:
        return
    in_order = max(solved, key=lambda r: r["lar_balanced"])
    served_mixed = max(solved, key=lambda r: r["lar_balanced_mixed"])
    lead = served_mixed["lar_balanced_mixed"] / max(in_order["lar_balanced_mixed"], 1e-300)
    if lead > 1 + MIXED_NOTE_MARGIN:
        err_console.print(
            f"note: served mixed the best plan is {served_mixed['method']}'s "
            f"({served_mixed['lar_balanced_mixed']:.3f} against {in_order['method']}'s "
            f"{in_order['lar_balanced_mixed']:.3f}), in trace order {in_order['method']}'s: "
            "the plans were fitted on batches in the fitting trace's order. If your engine "
            "batches requests mixed, fit with `moeplan fit --mixed-batches` "
            "(docs/solvers.md, on the runtime's per-batch cap)",
            soft_wrap=True,
        )


def comparison_table(result: dict, title: str, note: str | None = None) -> Table:
    table = Table(title=title, title_justify="left")
    cols = [("method", "method"), ("lar_balanced", "LAR bal."), ("lar", "LAR"), ("lar_token", "token"),
            ("lar_ngram", "n-gram"), ("token_imbalance_balanced", "tok.imb."), ("expert_load_imbalance", "exp.imb."),
            ("gap_to_bound", "gap to bound"), ("ratio_to_best_baseline", "vs best base."), ("ratio_ci90", "90% CI"),
            ("ratio_to_vanilla", "vs vanilla"), ("seconds", "seconds")]  # fmt: skip
    if any("lar_balanced_mixed" in r for r in result["rows"]):
        cols.insert(2, ("lar_balanced_mixed", "bal. mixed"))
    if any("lar_balanced_fitting" in r for r in result["rows"]):
        cols.insert(2, ("lar_balanced_fitting", "fit. bal."))
    for _, head in cols:
        table.add_column(head, justify="left" if head == "method" else "right")

    def fmt(v) -> str:
        if isinstance(v, list):  # an interval
            return f"{v[0]:.3f}-{v[1]:.3f}"
        return "-" if v is None else (f"{v:.3f}" if isinstance(v, float) else str(v))

    for r in result["rows"]:
        table.add_row(*(fmt(r.get(c)) for c, _ in cols))
    bound, van = result["oracle_bound"], result["lar_vanilla"]
    table.caption = (
        f"per-token oracle bound {fmt(bound)}; positional vanilla LAR {fmt(van)}; "
        + (
            f"best baseline {best}; 90% CI: paired bootstrap of the ratio over the "
            f"{result['requests']} held-out requests"
            if (best := result["best_baseline"]) is not None
            else "no baseline among the methods, so no ratio"
        )
        + (
            f"; held-out occurrences of tokens unseen in fitting {u['heldout']:.1%} "
            f"({u['expected']:.1%} expected)"
            if (u := result.get("unseen_tokens")) and None not in (u["heldout"], u["expected"])
            else ""
        )
        + (
            "; a negative gap: the n-gram table (which chooses by context) or the runtime cap "
            "(which moves single occurrences) passed the best any token table could do (the "
            "bound is per token id, DESIGN.md)"
            if any((g := r.get("gap_to_bound")) is not None and g < 0 for r in result["rows"])
            else ""
        )
        + (f"; {note}" if note else "")
    )
    return table

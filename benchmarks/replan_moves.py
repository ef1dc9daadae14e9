"""Re-planning a deployed model: experts moved against balanced LAR, by move cost; JSON.

The nightly job's situation (docs/serving.md, "Re-planning a deployed model"): a plan is serving,
fresh traces arrive, and a plan solved again from them is rolled out only if it is better,
moving as few experts as that needs. Each source trace is cut by request into thirds A, B
and C (``moeplan trace split``, seed ``--seed``). The deployed plan is CEO's, fitted on A
(``--shift DOMAIN``: on A without that prompt domain, so that the traffic the plan now sees
has drifted from what it was fitted on). The new plans are CEO's, fitted on B and solved
with ``--align-to`` the deployed plan at each move cost (``moeplan solve --move-cost C``; 0:
aligned only, experts move freely). Each is scored against the deployed plan on C
(``moeplan evaluate --against``): the ratio of balanced LARs with its 90% paired-bootstrap
interval over C's requests, the verdict, and the experts the rollout moves.

Sources (``--sources``, those of ``compare_traces.py``): ``example``, the example model's
trace (16 experts, 6 layers; profiled here from the committed model, about a minute);
``flame``, the real FLAME-MoE trace in ``../shared/realdata/`` (64 experts, 9 layers); and
the synthetic shape checks ``synth-mixtral``, ``synth-gptoss``, ``synth-qwen3`` and
``synth-deepseek`` (not real routing; their shapes are in ``compare_traces.py``'s doc). About
30 s per plan on the example, 60-90 s on FLAME-MoE (2 cores).

    python benchmarks/replan_moves.py [--sources example,flame] [--ep 4,8]
        [--costs 0,0.0005,0.001,0.002,0.005] [--shift numeric] [--seed 7] [--out FILE]
        [--plot FILE.png] [--replot REPORT.json ...] [--chain-passes 0]

``--chain-passes N`` gives every plan (the deployed one and the new ones) the chain polish
(:mod:`planner.solve.chain`), which counts the moves at the same cost.

``--plot`` draws experts moved against the ratio to the deployed plan, one line per source
and EP size, each point labelled with its move cost; ``--replot`` draws it from earlier
reports (their cases pooled) without solving anything.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from _common import (  # noqa: E402  (benchmarks/ is on sys.path when run as a script)
    ArgumentParser,
    add_out_option,
    choice_list,
    emit_json,
    float_list,
    int_list,
    nonnegative_int,
    run,
)
from compare_traces import SOURCES, source_trace  # noqa: E402

from planner.errors import InputError  # noqa: E402
from planner.evaluate.compare import against_deployed  # noqa: E402
from planner.evaluate.plots import check_plot_path, plot_replan  # noqa: E402
from planner.export.api import bundle_from_plan  # noqa: E402
from planner.predict.fit import FitConfig, fit_predictor  # noqa: E402
from planner.predict.split import split_trace, split_trace_by_domain  # noqa: E402
from planner.solve.align import align_plan  # noqa: E402
from planner.solve.pipeline import PlanConfig, make_plan  # noqa: E402
from planner.trace import open_trace  # noqa: E402


def thirds(trace: Path, work: Path, seed: int) -> tuple[Path, Path, Path]:
    """A, B and C: the trace's requests in three parts (C a third, A and B halves of the rest)."""
    ab, a, b, c = (work / f"{trace.stem}_{name}" for name in ("ab", "a", "b", "c"))
    split_trace(trace, ab, c, 1 / 3, seed=seed)
    split_trace(ab, a, b, 0.5, seed=seed)
    return a, b, c


def run_source(
    name: str, work: Path, eps: list[int], costs: list[float], shift, seed, chain_passes: int = 0
) -> list:
    trace = source_trace(name, work)
    a, b, c = thirds(trace, work, seed)
    if shift:
        shifted = work / f"{trace.stem}_a_without_{shift}"
        split_trace_by_domain(a, shifted, work / f"{trace.stem}_a_{shift}", [shift])
        a = shifted
    fit = FitConfig(ngram_routed=True)
    deployed_predictor = fit_predictor(a, fit).predictor
    new_predictor = fit_predictor(b, fit).predictor
    held = open_trace(c)
    cases = []
    for ep in eps:
        deployed = make_plan(
            deployed_predictor, PlanConfig(ep_size=ep, chain_passes=chain_passes), progress=False
        )
        deployed_bundle = bundle_from_plan(deployed)
        for cost in costs:
            t0 = time.perf_counter()
            plan = make_plan(
                new_predictor,
                PlanConfig(ep_size=ep, move_cost=cost, chain_passes=chain_passes),
                progress=False,
                reference=deployed.expert_to_device,
            )  # fmt: skip
            plan = align_plan(plan, deployed.expert_to_device, deployed.fingerprint)
            seconds = time.perf_counter() - t0
            versus = against_deployed(bundle_from_plan(plan), deployed_bundle, held)
            cases.append(
                {
                    "source": name,
                    "ep": ep,
                    "move_cost": cost,
                    "experts": versus["experts"],
                    "experts_moved": versus["experts_moved"],
                    "ratio": versus["ratio"],
                    "ratio_ci90": versus["ratio_ci90"],
                    "verdict": versus["verdict"],
                    "lar_balanced": versus["report"]["overall"]["lar_balanced"],
                    "lar_balanced_deployed": versus["deployed"]["lar_balanced"],
                    "lar_fitting": round(
                        sum(r["local_rate"] for r in plan.reports) / len(plan.reports), 4
                    ),
                    "solve_s": round(seconds, 1),
                }
            )
            print(
                f"{name} EP {ep} cost {cost:g}: {versus['experts_moved']} of {versus['experts']} "
                f"moved, ratio {versus['ratio']:.4f} {versus['verdict']}",
                file=sys.stderr,
            )
    return cases


def read_cases(path: str) -> list:
    """The cases of an earlier report (``--replot``); InputError for a file that is none."""
    try:
        cases = json.loads(Path(path).read_text())["cases"]
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError):
        raise InputError(f"{path} is no replan_moves report (JSON with its cases)") from None
    if not isinstance(cases, list):
        raise InputError(f"{path}: its cases are not a list")
    return cases


def main(argv=None) -> dict:
    ap = ArgumentParser(__doc__)
    ap.add_argument(
        "--sources", type=choice_list(SOURCES), default=["example", "flame"],
        help=f"comma-separated traces, of {', '.join(SOURCES)} (default example,flame)",
    )  # fmt: skip
    ap.add_argument(
        "--ep", type=int_list(least=1), default=[4, 8],
        help="comma-separated EP sizes, each at least 1 (default 4,8)",
    )  # fmt: skip
    ap.add_argument(
        "--costs", type=float_list(least=0), default=[0, 0.0005, 0.001, 0.002, 0.005],
        help="comma-separated move costs, LAR shares in [0, 1] "
        "(default 0,0.0005,0.001,0.002,0.005)",
    )  # fmt: skip
    ap.add_argument(
        "--shift", default=None,
        help="a prompt domain the deployed plan never saw (default: none, no drift)",
    )  # fmt: skip
    ap.add_argument(
        "--seed", type=nonnegative_int, default=7, help="split seed, at least 0 (default 7)"
    )
    ap.add_argument(
        "--chain-passes", type=nonnegative_int, default=0,
        help="chain polish sweeps on every plan (default 0: none)",
    )  # fmt: skip
    add_out_option(ap)
    ap.add_argument(
        "--plot", default=None,
        help="draw the trade-off to this .png/.svg/.pdf (default: no plot)",
    )  # fmt: skip
    ap.add_argument(
        "--replot", nargs="+", default=None,
        help="earlier reports (JSON) to draw with --plot, solving nothing",
    )  # fmt: skip
    args = ap.parse_args(argv)
    if args.plot:
        check_plot_path(args.plot)  # before the work
    if args.replot:
        if not args.plot:
            ap.error("--replot draws earlier reports: give --plot FILE too")
        cases = [c for path in args.replot for c in read_cases(path)]
        print(plot_replan(cases, args.plot), file=sys.stderr)
        report = {"benchmark": "replan_moves", "plot": args.plot, "cases": cases}
        emit_json(report, args.out)
        return report
    eps, costs = args.ep, args.costs
    for ep in eps:  # the plan settings of every case, checked before any trace is made
        for cost in costs:
            PlanConfig(ep_size=ep, move_cost=cost, chain_passes=args.chain_passes)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="moeplan-replan-") as tmp:
        cases = [
            case
            for name in args.sources
            for case in run_source(
                name, Path(tmp), eps, costs, args.shift, args.seed, args.chain_passes
            )
        ]
    report = {
        "benchmark": "replan_moves",
        # as given on the command line: comma-separated lists as text
        "config": vars(args)
        | {
            "sources": ",".join(args.sources),
            "ep": ",".join(map(str, eps)),
            "costs": ",".join(f"{c:g}" for c in costs),
        },
        "cases": cases,
        "seconds": round(time.perf_counter() - t0, 1),
    }
    if args.plot:
        print(plot_replan(cases, args.plot), file=sys.stderr)
    emit_json(report, args.out)
    return report


if __name__ == "__main__":
    run(main)

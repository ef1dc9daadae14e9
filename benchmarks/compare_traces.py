"""CEO against the baselines on held-out halves of real traces, over splits and EP sizes; JSON.

Cases: the real FLAME-MoE trace in ``../shared/realdata/`` (64 experts: EP 4, 8, 16) and
the example model's trace (16 experts: EP 2, 4, 8; profiled here from the committed model
and prompts, about a minute on CPU). For every split seed the trace is split 50/50 by
request (``moeplan trace split``), the predictor fitted on the fitting half with the
same split (``moeplan fit --holdout 0.5 --seed S``, n-gram statistic top-1 or routed), and
``moeplan compare`` run on the held-out half. Each case reports every method's balanced
LAR and CEO's ratio to the best baseline (METIS, k-means, alternating) with its 90%
paired-bootstrap interval over the held-out requests
(:func:`planner.evaluate.compare.ratio_interval`); the summary gives the minimum and mean
ratio, the cases CEO loses, and those it loses beyond that interval, and how each method
(CEO and every baseline) fares against the best of the other three
(``each_over_best_of_the_rest``), and how far CEO's ratios spread from case to case against
the held-out requests' noise, with the losses each would bring at CEO's mean lead
(``what_every_case_asks``). The same plans are also
scored on the fitting half (``lar_balanced_fitting``, ``ceo_losses_fitting``): a case CEO
loses there too is lost by its search or objective; one lost only held out, by how the plan
carries over to new requests. About 40 s per case on 2 cores.

    python benchmarks/compare_traces.py [--seeds 0,1,2] [--sources flame,example]
        [--ngram top1,routed] [--ngram-weight 0.5] [--ceo-options JSON] [--chain-passes 0]
        [--split request|domain] [--holdout 0.5] [--polish-baselines] [--batch-prices]
        [--mixed-heldout] [--mixed-batches] [--out FILE]

``--holdout F`` holds out the share F of the requests instead of half (0.8: fitted on a
fifth; 0.2: on four fifths).

``--split domain --sources example`` holds out each of the example's four prompt domains in
turn (``moeplan trace split --heldout-domain``) and fits on the other three: how a plan
carries over to traffic unlike what it was fitted on.

Shape checks (not real routing): ``--sources synth-mixtral,synth-gptoss,synth-qwen3`` run
the same cases on synthetic traces (``moeplan trace synth``: 6 layers, 40k tokens, 200
requests, vocabulary 32k, seed 7) shaped like Mixtral (8 experts, top-2; EP 2, 4, 8),
GPT-OSS-20B (32, top-4; EP 4, 8) and Qwen3-30B-A3B (128, top-8; EP 8, 16), for what real
traces of other shapes may look like: ``--sources synth-mixtral,synth-gptoss,synth-qwen3
--seeds 0 --ngram routed``. ``synth-deepseek`` is ``moeplan trace synth --preset
deepseek-v3 --layers 8 --tokens 100000 --requests 400`` (256 experts, top-8, vocabulary
129k, planted token groups; EP 8, 32), about 80 s a case.

``--split fresh --sources example`` fits on the whole of the example's trace and holds out
a second trace, profiled here from ``examples/prompts_fresh.jsonl`` (320 more prompts of
the same four domains that share no chunk with the first: ``train.py --prompts-only
--fresh-prompts-out``), and then the other way round: the workflow of profiling once and
serving traffic nobody profiled, 12 cases.

``--no-embeddings`` fits without the input embeddings a profiled trace carries (``moeplan
fit --no-embeddings``), as for a trace profiled without ``--save-embeddings`` or ingested:
unseen tokens then have no neighbour to borrow a device from, and the n-gram table routes
them.

``--ceo-options '{"batch_aware": false}'`` measures a CEO switch's effect (the same cases,
with and without it). ``--chain-passes 2`` gives every method the chain polish
(:mod:`planner.solve.chain`), the strongest baselines we know how to build.
``--polish-baselines`` ends METIS, k-means and alternating with the local search CEO ends
with (``PlanConfig.polish``), so the ratio shows CEO's search against the baselines given the
same local search. ``--expert-beta 1.25`` caps every method's expert load (``moeplan solve --expert-beta``);
each case also records every method's held-out expert-load imbalance.
``--batch-prices`` ends every method with its tokens priced per fitting batch
(:mod:`planner.solve.batch_prices`). ``--mixed-heldout`` also scores every plan on the
held-out requests in a random order (``lar_balanced_mixed``, ``ceo_over_best_baseline_mixed``
and the summary's ``*_mixed`` figures): the example's trace serves one prompt domain after
another, so its runtime batches are each of one domain, which real serving, mixing many
users' requests in a batch, seldom is. ``--mixed-batches`` fits with the fitting batches
recorded as the fitting requests would make them in a random order (``moeplan fit
--mixed-batches``): plans made for mixed serving.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path
from statistics import NormalDist, median, stdev

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from _common import (  # noqa: E402  (benchmarks/ is on sys.path when run as a script)
    ArgumentParser,
    add_out_option,
    choice_list,
    emit_json,
    int_list,
    nonnegative_int,
    positive_int,
    run,
)

from planner.errors import InputError  # noqa: E402
from planner.evaluate.compare import compare_methods  # noqa: E402
from planner.predict.fit import FitConfig, fit_predictor  # noqa: E402
from planner.predict.split import (  # noqa: E402
    check_fraction,
    shuffle_requests,
    split_trace,
    split_trace_by_domain,
    trace_domains,
)
from planner.profile.runner import ProfileConfig, profile_model  # noqa: E402
from planner.solve.ngram_term import DEFAULT_WEIGHT  # noqa: E402
from planner.solve.pipeline import PlanConfig  # noqa: E402
from planner.trace import open_trace  # noqa: E402
from planner.trace.synth import SynthConfig, preset_config, synthesize  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
FLAME = REPO.parent / "shared" / "realdata" / "flame-moe-290m-prefill.parquet"
EP_SIZES = {"flame": (4, 8, 16), "example": (2, 4, 8)}
# Synthetic shape checks: (experts, top-k, EP sizes); see the module doc.
SHAPES = {
    "synth-mixtral": (8, 2, (2, 4, 8)),
    "synth-gptoss": (32, 4, (4, 8)),
    "synth-qwen3": (128, 8, (8, 16)),
}
EP_SIZES |= {name: eps for name, (_, _, eps) in SHAPES.items()} | {"synth-deepseek": (8, 32)}
SOURCES = tuple(EP_SIZES)  # every --sources name
NGRAMS = ("top1", "routed")  # the n-gram statistics fit can count (FitConfig.ngram_routed)
METHODS = ["ceo", "metis", "kmeans", "alternating", "vanilla"]
BASELINES = ("metis", "kmeans", "alternating")
# z of a two-sided 90% interval: its half-width over the standard error it implies.
_Z90 = NormalDist().inv_cdf(0.95)


def source_trace(name: str, work: Path) -> Path:
    if name == "flame":
        return FLAME
    if name in SHAPES:
        experts, top_k, _ = SHAPES[name]
        config = SynthConfig(
            num_layers=6, num_experts=experts, top_k=top_k, vocab_size=32000,
            num_tokens=40_000, num_requests=200, seed=7, model=name,
        )  # fmt: skip
        out = work / name
        return out if out.exists() else synthesize(config, out)
    if name == "synth-deepseek":
        config = preset_config("deepseek-v3", num_layers=8, num_tokens=100_000, num_requests=400)
        out = work / name
        return out if out.exists() else synthesize(config, out)
    if name not in ("example", "example-fresh"):
        raise InputError(f"unknown source {name!r}; choose from {', '.join(SOURCES)}")
    prompts = "prompts_fresh.jsonl" if name == "example-fresh" else "prompts.jsonl"
    out = work / f"{name.replace('-', '_')}_trace"
    if not out.exists():
        profile_model(
            REPO / "examples" / "tiny_moe" / "model",
            REPO / "examples" / prompts,
            out,
            ProfileConfig(save_embeddings=True),
            progress=False,
        )
    return out


def run_case(
    trace: Path,
    work: Path,
    seed: int,
    ngram: str,
    ep: int,
    jobs: int,
    ngram_weight: float,
    ceo_options: dict,
    chain_passes: int = 0,
    ngram_defer: bool = True,
    heldout_domain: str | None = None,
    expert_beta: float | None = None,
    embeddings: bool = True,
    holdout: float = 0.5,
    polish: bool = False,
    heldout_trace: Path | None = None,
    batch_prices: bool = False,
    mixed: bool = False,
    mixed_batches: bool = False,
) -> dict:
    """One case: split ``trace`` (the ``holdout`` share of its requests held out, drawn with
    ``seed``, or ``heldout_domain`` held out whole), fit on the fitting side, compare every
    method on the held-out side. With ``heldout_trace``, fit on the whole of ``trace`` and
    hold out that other trace. With ``mixed`` every plan is also scored on the held-out
    requests in a random order (:func:`planner.predict.split.shuffle_requests`)."""
    name = (
        f"{trace.stem}_{seed}_{holdout}"
        if heldout_domain is None
        else f"{trace.stem}_dom_{heldout_domain}"
    )
    held, fitting = work / f"{name}_held", work / f"{name}_fit"
    if heldout_trace is not None:
        held, fitting = heldout_trace, trace
        fit = FitConfig(
            ngram_routed=ngram == "routed", auto_embeddings=embeddings, mixed_batches=mixed_batches
        )
        predictor = fit_predictor(fitting, fit).predictor
    elif heldout_domain is None:
        if not held.exists():
            split_trace(trace, fitting, held, holdout, seed=seed)
        fit = FitConfig(
            holdout=holdout, seed=seed, ngram_routed=ngram == "routed", auto_embeddings=embeddings,
            mixed_batches=mixed_batches,
        )  # fmt: skip
        predictor = fit_predictor(trace, fit).predictor
    else:
        if not held.exists():
            split_trace_by_domain(trace, fitting, held, [heldout_domain])
        fit = FitConfig(
            ngram_routed=ngram == "routed", auto_embeddings=embeddings, mixed_batches=mixed_batches
        )
        predictor = fit_predictor(fitting, fit).predictor
    also = {}
    if mixed:
        shuffled = work / f"{Path(held).name}_mixed"
        if not shuffled.exists():
            shuffle_requests(held, shuffled, seed)
        also["mixed"] = open_trace(shuffled)
    result = compare_methods(
        predictor,
        open_trace(held),
        METHODS,
        PlanConfig(
            ep_size=ep,
            jobs=jobs,
            ngram_weight=ngram_weight,
            options={"ceo": ceo_options},
            chain_passes=chain_passes,
            ngram_defer=ngram_defer,
            expert_beta=expert_beta,
            polish=polish,
            batch_prices=batch_prices,
        ),  # fmt: skip
        fitting=open_trace(fitting),
        also=also,
    )
    rows = {r["method"]: r for r in result["rows"]}
    best = max(BASELINES, key=lambda m: rows[m]["lar_balanced"])
    fit_lar = {m: r["lar_balanced_fitting"] for m, r in rows.items()}
    if heldout_trace is not None:
        label = f"{trace.name.removesuffix('_trace')}->{heldout_trace.name.removesuffix('_trace')}"
    elif heldout_domain is not None:
        label = f"domain {heldout_domain}"
    else:
        label = seed
    return {
        "seed": label,
        "ngram": ngram,
        "ep": ep,
        "lar_balanced": {m: r["lar_balanced"] for m, r in rows.items()},
        "lar_balanced_fitting": fit_lar,
        "ceo_over_best_baseline_fitting": fit_lar["ceo"] / max(fit_lar[m] for m in BASELINES),
        "lar_token": {m: r["lar_token"] for m, r in rows.items()},
        "lar_ngram": {m: r["lar_ngram"] for m, r in rows.items()},
        "expert_load_imbalance": {m: r["expert_load_imbalance"] for m, r in rows.items()},
        "best_baseline": best,
        "ceo_over_best_baseline": rows["ceo"]["lar_balanced"] / rows[best]["lar_balanced"],
        "ceo_over_best_baseline_ci90": rows["ceo"]["ratio_ci90"],
        "heldout_requests": result["requests"],
        "unseen_tokens": result["unseen_tokens"],
        "oracle_bound": result["oracle_bound"],
        **(
            {
                "lar_balanced_mixed": (
                    mixed_lar := {m: r["lar_balanced_mixed"] for m, r in rows.items()}
                ),
                "ceo_over_best_baseline_mixed": mixed_lar["ceo"]
                / max(mixed_lar[m] for m in BASELINES),
            }
            if mixed
            else {}
        ),
    }


def case_label(case: dict) -> str:
    """How the summary names a case: ``"example seed 0 top1 EP4"``."""
    return f"{case['source']} seed {case['seed']} {case['ngram']} EP{case['ep']}"


def against_the_rest(cases: list[dict]) -> dict:
    """Each of CEO and the baselines against the best of the other three, case by case.

    The bar CEO is held to, at or above the best of three baselines in every case, is one
    a baseline can be held to as well: this says how often each method clears it (``wins``)
    and its mean ratio, so a reader can tell a shortfall of CEO's from the noise that
    picking the best of three plans on new traffic brings.
    """
    out = {}
    for m in ("ceo", *BASELINES):
        ratios = [
            c["lar_balanced"][m] / max(c["lar_balanced"][o] for o in ("ceo", *BASELINES) if o != m)
            for c in cases
        ]
        out[m] = {"mean": sum(ratios) / len(ratios), "wins": sum(r >= 1 for r in ratios)}
    return out


def what_every_case_asks(cases: list[dict]) -> dict:
    """CEO's ratios to the best baseline: how far they spread from case to case, against the
    noise of which requests were held out, and the losses each would bring at CEO's mean lead.

    ``heldout_noise_sd`` is the median over cases of the standard error a case's 90% interval
    implies (its width / (2 * 1.645)); ``losses_expected_from_noise`` sums, over cases, the
    chance that a normal of the mean ratio and that case's standard error falls below 1: the
    losses a method leading by its mean in every case would still have.
    ``losses_expected_from_spread`` is the count times that chance for the spread across
    cases, and ``lead_for_half_a_loss`` the mean lead the spread asks for fewer than half a
    loss to be expected over these cases. None where a figure needs more cases or intervals than given.
    """
    ratios = [c["ceo_over_best_baseline"] for c in cases]
    count, mean = len(ratios), sum(ratios) / len(ratios)
    errors = [
        (ci[1] - ci[0]) / (2 * _Z90) for c in cases if (ci := c["ceo_over_best_baseline_ci90"])
    ]
    below = NormalDist().cdf
    out: dict = dict.fromkeys(
        (
            "ratio_sd",
            "heldout_noise_sd",
            "losses_expected_from_noise",
            "losses_expected_from_spread",
            "lead_for_half_a_loss",
        )
    )
    if errors:
        out["heldout_noise_sd"] = median(errors)
        out["losses_expected_from_noise"] = sum(below((1 - mean) / e) for e in errors if e > 0)
    if count >= 2 and (sd := stdev(ratios)) > 0:
        out["ratio_sd"] = sd
        out["losses_expected_from_spread"] = count * below((1 - mean) / sd)
        out["lead_for_half_a_loss"] = -NormalDist().inv_cdf(0.5 / count) * sd
    return out


def main(argv=None) -> int:
    ap = ArgumentParser(__doc__)
    ap.add_argument(
        "--seeds", type=int_list(least=0), default=[0, 1, 2],
        help="comma-separated split seeds, each at least 0 (default 0,1,2)",
    )  # fmt: skip
    ap.add_argument(
        "--sources", type=choice_list(SOURCES), default=["flame", "example"],
        help=f"comma-separated traces, of {', '.join(SOURCES)} (default flame,example)",
    )  # fmt: skip
    ap.add_argument(
        "--ngram", type=choice_list(NGRAMS), default=list(NGRAMS),
        help="comma-separated n-gram statistics to fit with, of top1, routed (default both)",
    )  # fmt: skip
    ap.add_argument(
        "--ep", type=int_list(least=1), default=None,
        help="comma-separated EP sizes, each at least 1 (default: per source, "
        + "; ".join(f"{s} {','.join(map(str, e))}" for s, e in EP_SIZES.items())
        + ")",
    )  # fmt: skip
    ap.add_argument(
        "--jobs", type=positive_int, default=2, help="solver processes, at least 1 (default 2)"
    )
    ap.add_argument(
        "--ngram-weight", type=float, default=DEFAULT_WEIGHT,
        help=f"weight of the n-gram term (0: off; default {DEFAULT_WEIGHT:g})",
    )  # fmt: skip
    ap.add_argument(
        "--ceo-options", type=json.loads, default={},
        help='CEO options as a JSON object, e.g. \'{"batch_aware": false}\' (default {})',
    )  # fmt: skip
    ap.add_argument(
        "--chain-passes", type=nonnegative_int, default=0,
        help="chain polish sweeps of every method but vanilla (default 0: none)",
    )  # fmt: skip
    ap.add_argument(
        "--no-ngram-defer",
        action="store_true",
        help="keep the fitted n-gram confidences (PlanConfig.ngram_defer off; default: defer)",
    )
    ap.add_argument(
        "--expert-beta",
        type=float,
        default=None,
        help="cap every method's expert load (PlanConfig.expert_beta; default: none)",
    )
    ap.add_argument(
        "--split",
        choices=("request", "domain", "fresh"),
        default="request",
        help="request (default): 50/50 by request per seed; domain: hold out each domain in "
        "turn (traces with a domain column: example and the synthetic shapes; --seeds unused); "
        "fresh: fit on the example's whole trace, hold out one profiled from "
        "examples/prompts_fresh.jsonl, and the other way round (--sources example only)",
    )
    ap.add_argument(
        "--no-embeddings",
        action="store_true",
        help="fit without the trace's input embeddings (moeplan fit --no-embeddings; "
        "default: with them)",
    )
    ap.add_argument(
        "--holdout",
        type=float,
        default=0.5,
        help="share of the requests held out with --split request (default 0.5: halves)",
    )
    ap.add_argument(
        "--polish-baselines",
        action="store_true",
        help="end METIS, k-means and alternating with CEO's local search (PlanConfig.polish; "
        "default: off)",
    )
    ap.add_argument(
        "--batch-prices",
        action="store_true",
        help="end every method but vanilla with its tokens priced per fitting batch "
        "(PlanConfig.batch_prices; default: off)",
    )
    ap.add_argument(
        "--mixed-heldout",
        action="store_true",
        help="also score every plan on the held-out requests in a random order, whose "
        "batches mix what the trace serves one domain at a time (lar_balanced_mixed)",
    )
    ap.add_argument(
        "--mixed-batches",
        action="store_true",
        help="fit with the fitting batches recorded in a random request order (moeplan fit "
        "--mixed-batches; default: trace order)",
    )
    add_out_option(ap)
    args = ap.parse_args(argv)
    # the settings of every case, checked before any trace is made or split
    check_fraction(args.holdout)
    if args.split == "fresh" and args.sources != ["example"]:
        raise InputError("--split fresh needs --sources example (the one model profiled here)")
    for ep in args.ep or sorted({e for s in args.sources for e in EP_SIZES[s]}):
        PlanConfig(
            ep_size=ep, jobs=args.jobs, ngram_weight=args.ngram_weight,
            options={"ceo": args.ceo_options}, chain_passes=args.chain_passes,
            expert_beta=args.expert_beta, polish=args.polish_baselines,
            batch_prices=args.batch_prices,
        )  # fmt: skip
    started = time.perf_counter()
    cases = []
    with tempfile.TemporaryDirectory(prefix="moeplan-compare-") as tmp:
        work = Path(tmp)
        for source in args.sources:
            trace = source_trace(source, work)
            eps = args.ep or EP_SIZES[source]
            # (trace split or fitted on, held-out trace for --split fresh, seed, domain)
            if args.split == "fresh":
                fresh = source_trace("example-fresh", work)
                splits = [(trace, fresh, 0, None), (fresh, trace, 0, None)]
            elif args.split == "domain":
                splits = [(trace, None, 0, d) for d in trace_domains(open_trace(trace))]
            else:
                splits = [(trace, None, s, None) for s in args.seeds]
            for fitted, heldout_trace, seed, domain in splits:
                for ngram in args.ngram:
                    for ep in eps:
                        case = {
                            "source": source,
                            **run_case(
                                fitted,
                                work,
                                seed,
                                ngram,
                                ep,
                                args.jobs,
                                args.ngram_weight,
                                args.ceo_options,
                                args.chain_passes,
                                not args.no_ngram_defer,
                                domain,
                                args.expert_beta,
                                not args.no_embeddings,
                                args.holdout,
                                args.polish_baselines,
                                heldout_trace,
                                args.batch_prices,
                                args.mixed_heldout,
                                args.mixed_batches,
                            ),
                        }
                        cases.append(case)
                        print(
                            f"{source} seed {case['seed']} {ngram} EP{ep}: ceo "
                            f"{case['lar_balanced']['ceo']:.4f} / {case['best_baseline']} "
                            f"{case['lar_balanced'][case['best_baseline']]:.4f} = "
                            f"{case['ceo_over_best_baseline']:.3f} "
                            f"(90% CI {case['ceo_over_best_baseline_ci90']}; "
                            f"fitting half {case['ceo_over_best_baseline_fitting']:.3f})",
                            file=sys.stderr,
                            flush=True,
                        )
    ratios = [c["ceo_over_best_baseline"] for c in cases]
    report = {
        "benchmark": "compare_traces",
        "summary": {
            "cases": len(cases),
            "ngram_weight": args.ngram_weight,
            "ceo_options": args.ceo_options,
            "chain_passes": args.chain_passes,
            "ngram_defer": not args.no_ngram_defer,
            "split": args.split,
            "expert_beta": args.expert_beta,
            "embeddings": not args.no_embeddings,
            "holdout": args.holdout if args.split == "request" else None,
            "polish_baselines": args.polish_baselines,
            "batch_prices": args.batch_prices,
            "mixed_heldout": args.mixed_heldout,
            "mixed_batches": args.mixed_batches,
            "ceo_over_best_baseline_min": min(ratios),
            "ceo_over_best_baseline_mean": sum(ratios) / len(ratios),
            "ceo_losses": [case_label(c) for c in cases if c["ceo_over_best_baseline"] < 1],
            # Losses whose whole 90% interval lies below 1: more than which requests happened
            # to be held out can explain.
            "ceo_losses_beyond_ci90": [
                case_label(c)
                for c in cases
                if c["ceo_over_best_baseline_ci90"] and c["ceo_over_best_baseline_ci90"][1] < 1
            ],
            # The same plans on the requests they were fitted on: a loss here is the search's
            # or the objective's; a loss held out only is generalisation.
            "ceo_losses_fitting": [
                case_label(c) for c in cases if c["ceo_over_best_baseline_fitting"] < 1
            ],
            **(
                {
                    "ceo_over_best_baseline_mixed_min": min(mixed),
                    "ceo_over_best_baseline_mixed_mean": sum(mixed) / len(mixed),
                    "ceo_losses_mixed": [
                        case_label(c) for c in cases if c["ceo_over_best_baseline_mixed"] < 1
                    ],
                }
                if (
                    mixed := [
                        c["ceo_over_best_baseline_mixed"] for c in cases if args.mixed_heldout
                    ]
                )
                else {}
            ),
            "each_over_best_of_the_rest": against_the_rest(cases),
            "what_every_case_asks": what_every_case_asks(cases),
            "seconds": round(time.perf_counter() - started, 1),
        },
        "cases": cases,
    }
    emit_json(report, args.out)
    return 0


if __name__ == "__main__":
    run(main)

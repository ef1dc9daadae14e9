"""``moeplan compare``: solve with several methods and score each plan on one held-out trace."""

from __future__ import annotations

import dataclasses
import time

from planner.evaluate.metrics import EvalConfig, evaluate_bundle
from planner.export.api import bundle_from_plan
from planner.predict.predictor import Predictor
from planner.solve.pipeline import PlanConfig, make_plan
from planner.trace.io import Trace

BASELINES = ("metis", "kmeans", "alternating", "ilp", "vanilla")


def compare_methods(
    predictor: Predictor,
    heldout: Trace,
    methods: list[str],
    config: PlanConfig,
    eval_config: EvalConfig | None = None,
    *,
    progress: bool = False,
) -> dict:
    """One row per method: held-out LAR (balanced, online, token), imbalance, solve time.

    Returns ``{"rows": [...], "oracle_bound": float, "lar_vanilla": float,
    "best_baseline": name | None}``; each row carries ``gap_to_bound`` (bound - balanced
    LAR), and ``ratio_to_best_baseline`` when a baseline ran.
    """
    predictor.check_compatible(heldout.meta, "held-out trace")
    rows = []
    bound = vanilla = None
    for method in methods:
        cfg = dataclasses.replace(config, method=method)
        t0 = time.perf_counter()
        plan = make_plan(predictor, cfg, progress=progress)
        seconds = time.perf_counter() - t0
        report = evaluate_bundle(bundle_from_plan(plan), heldout, eval_config)
        ov = report["overall"]
        bound, vanilla = ov["oracle_bound"], ov["lar_vanilla"]
        rows.append(
            {
                "method": method,
                "lar_balanced": ov["lar_balanced"],
                "lar": ov["lar"],
                "lar_token": ov["lar_token"],
                "lar_ngram": ov["lar_ngram"],
                "token_imbalance": ov["token_imbalance"],
                "token_imbalance_balanced": ov["token_imbalance_balanced"],
                "expert_load_imbalance": ov["expert_load_imbalance"],
                "solver_local_rate": sum(r["local_rate"] for r in plan.reports) / len(plan.reports),
                "seconds": round(seconds, 3),
                "gap_to_bound": None if bound is None else round(bound - ov["lar_balanced"], 6),
            }
        )
    baselines = [r for r in rows if r["method"] in BASELINES and r["method"] != "vanilla"]
    best = max(baselines, key=lambda r: r["lar_balanced"], default=None)
    for r in rows:
        if best is not None and best["lar_balanced"]:
            r["ratio_to_best_baseline"] = round(r["lar_balanced"] / best["lar_balanced"], 4)
        if vanilla:
            r["ratio_to_vanilla"] = round(r["lar_balanced"] / vanilla, 4)
    return {
        "rows": rows,
        "oracle_bound": bound,
        "lar_vanilla": vanilla,
        "best_baseline": None if best is None else best["method"],
        "ep_size": config.ep_size,
    }

"""``moeplan compare``: solve with several methods and score each plan on one held-out trace;
``moeplan evaluate --against``: a new plan against the one deployed, on fresh traffic."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping

import numpy as np
from scipy import stats

from planner.errors import InputError, MismatchError
from planner.evaluate.metrics import EvalConfig, evaluate_bundle
from planner.export.api import bundle_from_plan
from planner.export.bundle import Bundle
from planner.predict.predictor import Predictor
from planner.predict.reliability import unseen_share
from planner.solve.align import device_maps, experts_moved, relabel
from planner.solve.expert_balance import cap_unreached
from planner.solve.pipeline import PlanConfig, make_plan
from planner.trace.io import Trace

BASELINES = ("metis", "kmeans", "alternating", "ilp", "vanilla")
# Resamples of the paired bootstrap behind ``ratio_ci90``; fixed seed, so reruns agree.
BOOTSTRAP_RESAMPLES = 2000
BOOTSTRAP_SEED = 0
# The held-out trace is flagged as unlike the fitting traffic (``unseen_tokens``) when its
# share of occurrences of tokens never seen in fitting is at least SHIFT_RATIO times the
# Good-Turing estimate from the fitting counts and SHIFT_MARGIN above it. Measured held out by
# request: the example 0.068 against 0.037-0.039 expected (1.8x), FLAME-MoE 0.38-0.40
# against 0.34, the synthetic DeepSeek-V3 and Qwen3 shapes 0.19-0.20 against 0.20; held out by
# domain: the example 0.097-0.265 against 0.021-0.025 (4-12x), the synthetic shapes 0.49-0.56
# against 0.15-0.17 (2.8-3.5x).
SHIFT_RATIO = 2.5
SHIFT_MARGIN = 0.05


def ratio_interval(
    local_a: np.ndarray, local_b: np.ndarray, level: float = 0.9
) -> tuple[float, float] | None:
    """Paired bootstrap interval of ``sum(local_a) / sum(local_b)`` over held-out requests.

    Two plans scored on the same held-out trace differ by how they place each request's
    tokens; resampling whole requests (with replacement, both plans alike) shows how much
    of their LAR ratio is the luck of which requests were held out. Requests are the unit
    because a request's tokens share a prompt and route alike. The runtime batches that cap
    device load are kept as evaluated, not re-formed per resample.

    A plain percentile bootstrap is too narrow with few requests. Simulated (lognormal
    request sizes, a small paired difference), a 90% interval covered 0.78 of cases at 6
    requests, 0.80 at 10 and 0.85 at 16. So this is the *expanded* percentile interval
    (Hesterberg, "What teachers should know about the bootstrap", 2015): the quantiles are
    taken at the tail ``Phi(-sqrt(n / (n - 1)) t_{n-1}(1 - tail))`` instead of ``tail``,
    which corrects the bootstrap's variance bias and uses Student's t. In the same
    simulation it covered 0.89 at 6 requests, 0.88 at 10 and 0.87 at 16 and 40 (the
    plain one 0.87 at 40); at 3 requests still only 0.75. Where the comparison is with the
    best baseline, that baseline is chosen once on the whole held-out set, not again in
    each resample.

    Args:
        local_a, local_b: [R] balanced local activations of each request under the two
            plans (``EvalConfig(per_request=True)``).
        level: central coverage of the interval.

    Returns:
        (low, high) quantiles of the resampled ratio, or None with fewer than 2 requests.
    """
    a, b = np.asarray(local_a, np.float64), np.asarray(local_b, np.float64)
    if a.size < 2:
        return None
    rng = np.random.default_rng(BOOTSTRAP_SEED)
    ratios = np.empty(BOOTSTRAP_RESAMPLES)
    step = max(1, 4_000_000 // a.size)  # resamples per block: bounded memory
    for start in range(0, BOOTSTRAP_RESAMPLES, step):
        stop = min(start + step, BOOTSTRAP_RESAMPLES)
        pick = rng.integers(0, a.size, (stop - start, a.size))
        num, den = a[pick].sum(axis=1), b[pick].sum(axis=1)
        ratios[start:stop] = num / np.maximum(den, 1e-12)
    n = a.size
    tail = float(stats.norm.cdf(-np.sqrt(n / (n - 1)) * stats.t.ppf(1 - (1 - level) / 2, n - 1)))
    low, high = np.quantile(ratios, [tail, 1 - tail])
    return float(low), float(high)


def unseen_tokens(predictor: Predictor, trace: Trace) -> dict:
    """How much of ``trace`` the predictor's token table has never seen, against what the
    fitting counts lead one to expect.

    Returns ``{"heldout": share, "expected": share, "shifted": bool}``: ``heldout`` is the
    share of the trace's token occurrences (known ids) whose token never occurred in fitting;
    ``expected`` the Good-Turing estimate of that share for new traffic like the fitting
    traffic (:func:`planner.predict.reliability.unseen_share`); ``shifted`` says the trace is
    unlike the fitting traffic (:data:`SHIFT_RATIO`, :data:`SHIFT_MARGIN`): plans then carry
    over worse for every method, CEO's most (benchmarks/RESULTS.md, "Domain shift").
    A share that cannot be measured is None (no known token id in the trace, or none in
    fitting), and then ``shifted`` is False.
    """
    aff = predictor.affinity
    unseen = known = 0
    for batch in trace.iter_batches(weights=False):
        ids = batch.token_id[batch.token_id >= 0]
        known += ids.size
        unseen += int(np.count_nonzero(~aff.seen_[ids]))
    heldout = round(unseen / known, 4) if known else None
    expected = round(unseen_share(aff.token_counts_[aff.seen_]), 4) if aff.seen_.any() else None
    shifted = (
        heldout is not None
        and expected is not None
        and heldout >= SHIFT_RATIO * expected
        and heldout >= expected + SHIFT_MARGIN
    )
    return {"heldout": heldout, "expected": expected, "shifted": shifted}


def compare_methods(
    predictor: Predictor,
    heldout: Trace,
    methods: list[str],
    config: PlanConfig,
    eval_config: EvalConfig | None = None,
    *,
    progress: bool = False,
    fitting: Trace | None = None,
    also: Mapping[str, Trace] | None = None,
) -> dict:
    """One row per method: held-out LAR (balanced, online, token), imbalance, solve time.

    With ``fitting`` (the trace the predictor was fitted on), each row also carries
    ``lar_balanced_fitting``, the plan's balanced LAR on that trace: where a method loses
    held out, this says whether it also lost on the data it was solved for (the search or
    the objective) or only on new requests (generalisation). Each trace of ``also``
    (name -> trace, a name other than ``fitting`` where that is given) scores every plan
    too, as ``lar_balanced_<name>``: the same requests served in other batches, say.

    Returns ``{"rows": [...], "oracle_bound": float, "lar_vanilla": float,
    "best_baseline": name | None, "requests": R, "unseen_tokens": {...}}`` (the last from
    :func:`unseen_tokens`); each row carries ``gap_to_bound``
    (bound - balanced LAR), and when a baseline ran ``ratio_to_best_baseline`` with
    ``ratio_ci90``, its 90% paired-bootstrap interval over the R held-out requests
    (:func:`ratio_interval`; None for the best baseline itself or with one request).
    """
    predictor.check_compatible(heldout.meta, "held-out trace")
    if fitting is not None:
        predictor.check_compatible(fitting.meta, "fitting trace")
    if not heldout.num_rows:
        raise InputError(f"held-out trace {heldout.path} holds no tokens; nothing to compare on")
    if fitting is not None and not fitting.num_rows:
        raise InputError(f"fitting trace {fitting.path} holds no tokens; nothing to score on")
    also = dict(also or {})
    if fitting is not None and "fitting" in also:
        raise InputError("also= names a trace 'fitting', the key of the fitting trace's scores")
    for name, other in also.items():
        predictor.check_compatible(other.meta, f"trace {name!r}")
    # every trace besides the held-out one that scores each plan, by its row key's suffix
    scored_on = ({} if fitting is None else {"fitting": fitting}) | also
    for checked in (heldout, *scored_on.values()):
        checked.request_ids()  # a repeated (request, position) is refused before solving
    eval_config = dataclasses.replace(eval_config or EvalConfig(), per_request=True)
    rows: list[dict] = []
    per_request = {}
    bound = vanilla = None
    for method in methods:
        cfg = dataclasses.replace(config, method=method)
        t0 = time.perf_counter()
        plan = make_plan(predictor, cfg, progress=progress)
        seconds = time.perf_counter() - t0
        bundle = bundle_from_plan(plan)
        # the oracle bound depends on the held-out trace alone: counted with the first plan
        report = evaluate_bundle(bundle, heldout, eval_config, progress=progress, oracle=not rows)
        ov = report["overall"]
        vanilla = ov["lar_vanilla"]
        if not rows:
            bound = ov["oracle_bound"]
        per_request[method] = np.asarray(report["per_request"]["local_balanced"], np.float64)
        in_sample = {}
        for name, other in scored_on.items():
            scored = evaluate_bundle(bundle, other, eval_config, progress=progress, oracle=False)
            in_sample[f"lar_balanced_{name}"] = scored["overall"]["lar_balanced"]
        rows.append(
            {
                "method": method,
                "lar_balanced": ov["lar_balanced"],
                **in_sample,
                "lar": ov["lar"],
                "lar_token": ov["lar_token"],
                "lar_ngram": ov["lar_ngram"],
                "token_imbalance": ov["token_imbalance"],
                "token_imbalance_balanced": ov["token_imbalance_balanced"],
                "expert_load_imbalance": ov["expert_load_imbalance"],
                "solver_local_rate": sum(r["local_rate"] for r in plan.reports) / len(plan.reports),
                # the expert-load imbalance of each layer where --expert-beta was out of reach
                "expert_cap_unreached": cap_unreached(plan.reports),
                "seconds": round(seconds, 3),
                "gap_to_bound": None if bound is None else round(bound - ov["lar_balanced"], 6),
            }
        )
    baselines = [r for r in rows if r["method"] in BASELINES and r["method"] != "vanilla"]
    best = max(baselines, key=lambda r: r["lar_balanced"], default=None)
    for r in rows:
        if best is not None and best["lar_balanced"]:
            r["ratio_to_best_baseline"] = round(r["lar_balanced"] / best["lar_balanced"], 4)
            ci = None
            if r is not best:
                ci = ratio_interval(per_request[r["method"]], per_request[best["method"]])
            r["ratio_ci90"] = None if ci is None else [round(ci[0], 4), round(ci[1], 4)]
        if vanilla:
            r["ratio_to_vanilla"] = round(r["lar_balanced"] / vanilla, 4)
    return {
        "rows": rows,
        "oracle_bound": bound,
        "lar_vanilla": vanilla,
        "best_baseline": None if best is None else best["method"],
        "ep_size": config.ep_size,
        "requests": len(next(iter(per_request.values()), ())),
        "unseen_tokens": unseen_tokens(predictor, heldout),
    }


def against_deployed(
    bundle: Bundle,
    deployed: Bundle,
    heldout: Trace,
    eval_config: EvalConfig | None = None,
    *,
    progress: bool = False,
) -> dict:
    """Whether ``bundle`` (a plan solved again, say from last night's traces) should replace
    ``deployed``: both scored on the same held-out traffic, and what rolling it out moves.

    The balanced LAR's ratio comes with its 90% paired-bootstrap interval over the held-out
    requests (:func:`ratio_interval`): a plan fitted on fresh traffic of the same kind is
    often level with the one it would replace, and the interval says whether a difference is
    more than the luck of which requests were held out.

    Returns:
        ``{"report": the new plan's evaluate_bundle report (without per-request figures),
        "deployed": the deployed plan's overall metrics, "ratio", "ratio_ci90",
        "verdict": "better" | "worse" | "level" (the interval above 1, below 1, or holding
        it; "level" too with fewer than 2 requests), "requests": R, "experts": L*N,
        "experts_moved": experts on another device than deployed, "experts_moved_aligned":
        the same had the new plan's devices been aligned (:mod:`planner.solve.align`)}``.

    Raises:
        MismatchError: the plans were made for different models.
        InputError: the plans differ in EP size, or the trace holds no tokens.
    """
    if bundle.meta.fingerprint() != deployed.meta.fingerprint():
        raise MismatchError(
            f"the deployed plan was made for model {deployed.meta.model!r}, the new one for "
            f"{bundle.meta.model!r} (fingerprints differ: "
            f"{deployed.meta.fingerprint_difference(bundle.meta)})"
        )
    if bundle.ep_size != deployed.ep_size:
        raise InputError(
            f"the deployed plan is for EP {deployed.ep_size}, the new one for EP "
            f"{bundle.ep_size}: compare plans of one deployment"
        )
    if not heldout.num_rows:
        raise InputError(f"held-out trace {heldout.path} holds no tokens; nothing to compare on")
    heldout.request_ids()  # a repeated (request, position) is refused before the work
    cfg = dataclasses.replace(eval_config or EvalConfig(), per_request=True)
    report = evaluate_bundle(bundle, heldout, cfg, progress=progress)
    old = evaluate_bundle(deployed, heldout, cfg, progress=progress, oracle=False)
    local_new = np.asarray(report.pop("per_request")["local_balanced"], np.float64)
    local_old = np.asarray(old.pop("per_request")["local_balanced"], np.float64)
    new_lar, old_lar = report["overall"]["lar_balanced"], old["overall"]["lar_balanced"]
    ci = ratio_interval(local_new, local_old)
    verdict = "level"
    if ci is not None and ci[0] > 1:
        verdict = "better"
    elif ci is not None and ci[1] < 1:
        verdict = "worse"
    x, ref = bundle.expert_to_device, deployed.expert_to_device
    aligned = relabel(x, device_maps(x, ref, bundle.ep_size))
    return {
        "report": report,
        "deployed": old["overall"],
        "ratio": round(new_lar / old_lar, 4) if old_lar else None,
        "ratio_ci90": None if ci is None else [round(ci[0], 4), round(ci[1], 4)],
        "verdict": verdict,
        "requests": int(local_new.size),
        "experts": int(x.size),
        "experts_moved": int(experts_moved(x, ref).sum()),
        "experts_moved_aligned": int(experts_moved(aligned, ref).sum()),
    }

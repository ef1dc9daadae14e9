"""Quality of every solver on held-out real routing counts; prints JSON (tables on stderr).

Data: ``../shared/realdata/olmoe-mixtral-token-expert-counts.parquet`` (OLMoE-1B-7B: 64
experts, top-8; Mixtral-8x7B: 8 experts, top-2; layers 0, 7, 15; 4-5 domains).

Per layer, ``W[j, k]`` = count of (token j, expert k) and ``a_j = sum_k W[j, k] / top_k``.
Held-out splits:

* ``thin20``: binomial thinning of every (token, expert) count, seeded: 20% to fit, 80% to
  evaluate (the papers' split); ``thin80``: 80% fit / 20% evaluate. All domains pooled.
* ``cross``: fit on one domain's counts, evaluate on another's (distribution shift); the
  report gives the loss against fitting on 20% of the evaluation domain itself.
* ``lodo`` (``--sections ...,lodo``, not run by default): leave one domain out, fit on the
  others pooled and evaluate on it. CEO is also run given one fitting batch per domain
  (``ceo[domain batches]``), as a trace whose runtime batches each hold one domain gives it:
  its batch-aware score then charges placements whose devices one domain would overload.

Each solver runs on the fit problem (EP 8 for OLMoE, EP 2 and 4 for Mixtral, beta 1.1);
its token table (ids unseen in fitting go to the device holding the most expert load,
confidence 0; see :mod:`planner.solve.metrics`) is evaluated on the held-out counts:
``lar`` (no cap) and ``lar_balanced`` (cap 1.1 x mean on the held-out load, most confident
tokens keep their device). ``lar_balanced_round_robin`` (table column ``balRR``) is the
same with unseen ids spread round-robin instead: across domains a third or more of the
held-out load can be unseen, and piling it on one device makes the cap, not the plan,
decide the figure. Also reported: vanilla (contiguous experts, positional tokens:
exactly 1/E), the per-token oracle bound on the held-out counts, ratios of CEO to the best
baseline (METIS, k-means, alternating; all with the same repair and token assignment) and
to vanilla, and an ablation of CEO's improvements over the paper's Algorithm 1. For
Mixtral, where the expert placements can be enumerated (35 for EP 2, 105 for EP 4), the
best enumerated placement (each with the shared token assignment) is the reference optimum
of the fit objective.

    python benchmarks/solve_quality.py [--quick] [--seed 0] [--sections thin,cross,ilp]
        [--counts FILE] [--out FILE]
"""

from __future__ import annotations

import itertools
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from _common import (  # (benchmarks/ is on sys.path when run as a script)
    ArgumentParser,
    add_out_option,
    choice_list,
    emit_json,
    nonnegative_int,
    run,
)
from scipy import sparse

from planner.errors import InputError, SchemaError
from planner.solve import common, metrics
from planner.solve.problem import LayerProblem, SolverConfig
from planner.solve.registry import solve_layer

REPO = Path(__file__).resolve().parents[1]
COUNTS = REPO.parent / "shared" / "realdata" / "olmoe-mixtral-token-expert-counts.parquet"
MODELS = {
    "OLMoE": {"match": "OLMoE", "experts": 64, "top_k": 8, "vocab": 50304, "ep": (8,)},
    "Mixtral": {"match": "Mixtral", "experts": 8, "top_k": 2, "vocab": 32000, "ep": (2, 4)},
}
BASELINES = ("metis", "kmeans", "alternating")
METHODS = ("ceo", *BASELINES, "vanilla")
ABLATION = {
    "paper": {"variant": "paper"},
    "+assign_tokens": {"local_search": False, "align_labels": False, "polish": False},
    "+align_labels": {"local_search": False, "polish": False},
    "+local_search": {"polish": False},
    # without the polish the screening stops at the search's best: k-means' clusterings are
    # screened only with it, so this row keeps them out and the next adds them
    "+polish": {"clusterings": 0},
    "+clusterings (default)": {},
}
COLUMNS = ("model", "domain", "layer", "token_id", "expert", "count")  # of the counts table
CROSS_PAIRS = (
    ("arxiv", "github"),
    ("github", "arxiv"),
    ("wikipedia", "book"),
    ("book", "wikipedia"),
)


def load_counts(path: Path) -> dict:
    """{(model, layer): {domain: (token_id [R], expert [R], count [R])}}; a one-line error
    for a file that is no Parquet table or lacks one of :data:`COLUMNS`."""
    try:
        names = set(pq.read_schema(path).names)
    except pa.ArrowException as e:
        raise InputError(f"{path} is no Parquet counts table: {e}") from None
    missing = [c for c in COLUMNS if c not in names]
    if missing:
        raise SchemaError(
            f"{path} lacks the counts table's column(s) {', '.join(missing)} "
            f"(it needs {', '.join(COLUMNS)})"
        )
    table = pq.read_table(path, columns=list(COLUMNS)).to_pandas()
    out: dict = {}
    for name, spec in MODELS.items():
        sub = table[table["model"].astype(str).str.contains(spec["match"])]
        for (layer, domain), g in sub.groupby(["layer", sub["domain"].astype(str)], observed=True):
            out.setdefault((name, int(layer)), {})[domain] = (
                g["token_id"].to_numpy(np.int64),
                g["expert"].to_numpy(np.int64),
                g["count"].to_numpy(np.int64),
            )
    return out


def to_matrix(tok, exp, cnt, n_experts) -> tuple[np.ndarray, sparse.csr_matrix]:
    """(token ids [J], W [J, N]) from count triples (duplicates summed, zero rows dropped)."""
    keep = cnt > 0
    tok, exp, cnt = tok[keep], exp[keep], cnt[keep]
    ids, rows = np.unique(tok, return_inverse=True)
    w = sparse.csr_matrix((cnt.astype(np.float64), (rows, exp)), shape=(ids.size, n_experts))
    w.sum_duplicates()
    return ids, w


def pooled(domains: dict, names=None):
    parts = [domains[d] for d in (names or sorted(domains))]
    return tuple(np.concatenate([p[i] for p in parts]) for i in range(3))


def thin(tok, exp, cnt, share, rng):
    fit = rng.binomial(cnt, share)
    return (tok, exp, fit), (tok, exp, cnt - fit)


def domain_batches(ids_fit: np.ndarray, parts: list, n_experts: int, top_k: int):
    """[J, D] occurrences of each fitting token in each of the D fitting domains.

    One fitting "batch" per domain, as a trace that records runtime batches of one domain
    each would give CEO's batch-aware score (:func:`planner.solve.common.batch_overflow`).
    """
    cols = []
    for part in parts:
        ids, w = to_matrix(*part, n_experts)
        col = np.zeros(ids_fit.size)
        col[np.searchsorted(ids_fit, ids)] = np.asarray(w.sum(axis=1)).ravel() / top_k
        cols.append(col)
    return sparse.csr_matrix(np.stack(cols, axis=1))


def evaluate_case(
    case: dict, fit, held, spec, ep, methods, seed, ceo_options=None, batch_parts=None
) -> dict:
    """Every method solved on ``fit`` and scored on ``held`` (count triples).

    ``batch_parts`` (the fitting counts split by domain) adds a run ``ceo[domain batches]``:
    CEO given one fitting batch per domain. The other methods do not read batches.
    """
    n, k = spec["experts"], spec["top_k"]
    ids_fit, w_fit = to_matrix(*fit, n)
    ids_eval, w_eval = to_matrix(*held, n)
    a_fit = np.asarray(w_fit.sum(axis=1)).ravel() / k
    a_eval = np.asarray(w_eval.sum(axis=1)).ravel() / k
    problem = LayerProblem(w_fit, a_fit, ep, token_ids=ids_fit)
    result = {
        **case,
        "ep": ep,
        "fit_tokens": int(ids_fit.size),
        "eval_tokens": int(ids_eval.size),
        "eval_unseen_share": float(a_eval[~np.isin(ids_eval, ids_fit)].sum() / a_eval.sum()),
        "oracle_bound": metrics.oracle_bound(w_eval, n // ep),
        "vanilla_expected": metrics.vanilla_local_rate(ep),
        "methods": {},
    }
    runs = [(m, {}, problem) for m in methods]
    if ceo_options:
        runs += [(f"ceo[{label}]", opts, problem) for label, opts in ceo_options.items()]
    if batch_parts:
        batches = domain_batches(ids_fit, batch_parts, n, k)
        batched = LayerProblem(w_fit, a_fit, ep, token_ids=ids_fit, batch_freq=batches)
        runs.append(("ceo[domain batches]", {}, batched))
    for label, opts, solved in runs:
        method = label.split("[")[0]
        config = SolverConfig(seed=seed, options={method: opts} if opts else {})
        placement = solve_layer(solved, method, config)
        table, conf = metrics.token_table(
            ids_fit, placement.token_to_device, placement.token_confidence,
            placement.expert_to_device, spec["vocab"], ep, expert_load=problem.expert_load,
        )  # fmt: skip
        held_out = metrics.balanced_local_rate(
            w_eval, a_eval, ids_eval, placement.expert_to_device, table, conf, ep, beta=1.1
        )
        table_rr, conf_rr = metrics.token_table(
            ids_fit, placement.token_to_device, placement.token_confidence,
            placement.expert_to_device, spec["vocab"], ep, fallback="round_robin",
        )  # fmt: skip
        held_out_rr = metrics.balanced_local_rate(
            w_eval, a_eval, ids_eval, placement.expert_to_device, table_rr, conf_rr, ep, beta=1.1
        )
        result["methods"][label] = {
            "fit_lar": placement.local_rate,
            "fit_imbalance": placement.token_imbalance,
            "seconds": placement.seconds,
            **held_out,
            "lar_balanced_round_robin": held_out_rr["lar_balanced"],
            "imbalance_round_robin": held_out_rr["imbalance"],
        }
    if spec["experts"] <= 16:
        result["enumerated_fit_optimum"] = enumerate_optimum(problem)
    base = [result["methods"][b]["lar_balanced"] for b in BASELINES if b in result["methods"]]
    if "ceo" in result["methods"] and base:
        ceo = result["methods"]["ceo"]["lar_balanced"]
        result["ceo_over_best_baseline"] = ceo / max(base)
        result["ceo_over_vanilla"] = ceo / result["vanilla_expected"]
    return result


def enumerate_optimum(problem: LayerProblem) -> dict:
    """Best fit objective over every expert placement (tokens by the shared assignment)."""
    n, e, per = problem.num_experts, problem.ep_size, problem.experts_per_device
    best, count = -1.0, 0
    for x in _partitions(list(range(n)), e, per):
        count += 1
        gain = common.device_gains(problem, x)
        t = common.assign_for_problem(problem, gain).token_to_device
        best = max(best, common.objective(problem, gain, t))
    return {"placements": count, "fit_lar": best / problem.total_activations}


def _partitions(items, e, per):
    """Every split of ``items`` into ``e`` unlabeled groups of ``per`` (as device labels)."""
    if not items:
        yield np.empty(0, dtype=np.int64)
        return
    n = len(items) + 0
    labels = np.full(n, -1, dtype=np.int64)

    def rec(remaining, group):
        if not remaining:
            yield labels.copy()
            return
        first, rest = remaining[0], remaining[1:]
        for others in itertools.combinations(rest, per - 1):
            labels[[first, *others]] = group
            left = [i for i in rest if i not in others]
            yield from rec(left, group + 1)

    yield from rec(list(items), 0)


def ilp_reference(data: dict, seed: int, quick: bool) -> dict:
    """Solvers against proven optima of the exact program on small instances.

    Instances: random ones (12-16 tokens, 8 experts, EP 2, 4 or 8, Zipf frequencies, top-2
    with noise) and real ones (the 24 most frequent tokens of a Mixtral layer, one domain;
    EP 2, 4 and 8).
    """
    rng = np.random.default_rng(seed)
    instances = []
    # EP 2 and 4 alternately, then a few at EP 8: one expert a device, where only the token
    # assignment counts (and tokens heavier than the cap need the slack rule)
    for i in range(8 if quick else 26):
        j, ep = int(rng.integers(12, 17)), ((2, 4)[i % 2] if i < (6 if quick else 20) else 8)
        freq = np.maximum(1, np.round(6 / np.arange(1, j + 1) ** 0.5))
        rows, cols = [], []
        for t in range(j):
            pref = rng.choice(8, 2, replace=False)
            for _ in range(int(freq[t])):
                chosen = np.where(rng.random(2) < 0.3, rng.integers(0, 8, 2), pref)
                rows += [t, t]
                cols += chosen.tolist()
        w = sparse.csr_matrix((np.ones(len(rows)), (rows, cols)), shape=(j, 8))
        instances.append((f"random{i} EP{ep}", LayerProblem(w, freq, ep)))
    for (model, layer), domains in sorted(data.items()):
        if model != "Mixtral" or (quick and layer != 7):
            continue
        for domain in sorted(domains)[:2]:
            ids, w = to_matrix(*domains[domain], 8)
            a = np.asarray(w.sum(axis=1)).ravel() / 2
            keep = np.sort(np.argsort(-a, kind="stable")[:24])
            for ep in (2, 4, 8):
                instances.append(
                    (f"Mixtral L{layer} {domain} top24 EP{ep}", LayerProblem(w[keep], a[keep], ep))
                )
    rows_out, ratios = [], {m: [] for m in ("ceo", *BASELINES)}
    for name, problem in instances:
        exact = solve_layer(problem, "ilp", SolverConfig(seed=seed, time_limit=120))
        row = {"instance": name, "ilp_status": exact.info["status"], "ilp_seconds": exact.seconds,
               "optimum": exact.objective}  # fmt: skip
        for m in ratios:
            p = solve_layer(problem, m, SolverConfig(seed=seed))
            row[m] = p.objective / exact.objective if exact.objective > 0 else 1.0
            if exact.info["status"] == "optimal":
                ratios[m].append(row[m])
        rows_out.append(row)
    return {
        "instances": rows_out,
        "proven_optimal": sum(r["ilp_status"] == "optimal" for r in rows_out),
        "ratio_to_optimum_min": {m: min(v) for m, v in ratios.items() if v},
        "ratio_to_optimum_mean": {m: float(np.mean(v)) for m, v in ratios.items() if v},
    }


def table_lines(results: list[dict]) -> list[str]:
    lines = []
    for r in results:
        head = f"{r['model']} layer {r['layer']} EP{r['ep']} {r['split']}"
        lines.append(
            f"{head}: oracle {r['oracle_bound']:.3f}, vanilla {r['vanilla_expected']:.3f}, "
            f"unseen {r['eval_unseen_share']:.1%}"
            + (f", enumerated fit optimum {r['enumerated_fit_optimum']['fit_lar']:.4f}" if "enumerated_fit_optimum" in r else "")
        )  # fmt: skip
        best_base = max(
            (r["methods"][b]["lar_balanced"] for b in BASELINES if b in r["methods"]),
            default=np.nan,
        )
        lines.append(
            f"  {'method':22s} {'fitLAR':>7s} {'LAR':>7s} {'balLAR':>7s} {'imb':>6s} {'sec':>6s} {'/base':>6s} {'/van':>6s} {'balRR':>7s}"
        )
        for m, v in r["methods"].items():
            lines.append(
                f"  {m:22s} {v['fit_lar']:7.4f} {v['lar']:7.4f} {v['lar_balanced']:7.4f} "
                f"{v['imbalance']:6.3f} {v['seconds']:6.2f} {v['lar_balanced'] / best_base:6.3f} "
                f"{v['lar_balanced'] / r['vanilla_expected']:6.2f} {v['lar_balanced_round_robin']:7.4f}"
            )  # fmt: skip
    return lines


SECTIONS = ("thin", "cross", "lodo", "ilp")


def main(argv=None) -> int:
    ap = ArgumentParser(__doc__)
    ap.add_argument(
        "--counts", type=Path, default=COUNTS,
        help="Parquet counts table with columns " + ", ".join(COLUMNS)
        + " (default ../shared/realdata/olmoe-mixtral-token-expert-counts.parquet)",
    )  # fmt: skip
    ap.add_argument(
        "--seed", type=nonnegative_int, default=0,
        help="seed of the splits and the solvers, at least 0 (default 0)",
    )  # fmt: skip
    ap.add_argument(
        "--quick", action="store_true",
        help="cut the run: layer 7 only, no ablation, one cross pair, one left-out domain "
        "(lodo), and 8 random ILP instances (not 26) plus layer 7's Mixtral ones only "
        "(default: everything)",
    )  # fmt: skip
    ap.add_argument(
        "--sections", type=choice_list(SECTIONS), default=["thin", "cross", "ilp"],
        help=f"comma-separated, of {', '.join(SECTIONS)} (lodo: leave one domain out; "
        "default thin,cross,ilp)",
    )  # fmt: skip
    add_out_option(ap)
    args = ap.parse_args(argv)
    sections = set(args.sections)
    started = time.perf_counter()
    data = load_counts(args.counts)

    def rng(model: str, layer: int, draw: int) -> np.random.Generator:
        # one generator a draw, from the case alone: a case's split does not depend on
        # which sections ran before it
        return np.random.default_rng([args.seed, sorted(MODELS).index(model), layer, draw])

    layers = (7,) if args.quick else (0, 7, 15)
    results = []

    def run(case, fit, held, spec, ep, methods, ablation=None, batch_parts=None) -> dict:
        r = evaluate_case(case, fit, held, spec, ep, methods, args.seed, ablation, batch_parts)
        results.append(r)
        print("\n".join(table_lines([r])), file=sys.stderr, flush=True)
        return r

    for (model, layer), domains in sorted(data.items()):
        if layer not in layers:
            continue
        spec = MODELS[model]
        all_counts = pooled(domains)
        for split, share in (("thin20", 0.2), ("thin80", 0.8)) if "thin" in sections else ():
            fit, held = thin(*all_counts, share, rng(model, layer, int(share * 100)))
            for ep in spec["ep"]:
                ablation = (
                    ABLATION
                    if (model == "OLMoE" and split == "thin20" and not args.quick)
                    else None
                )
                case = {"model": model, "layer": layer, "split": split}
                run(case, fit, held, spec, ep, METHODS, ablation)
        pairs = (CROSS_PAIRS[:1] if args.quick else CROSS_PAIRS) if "cross" in sections else ()
        for pair, (src, dst) in enumerate(pairs):
            if src not in domains or dst not in domains:
                continue
            # in-domain reference: fit on 20% of the destination domain itself (one draw a
            # pair, every EP size)
            fit, held = thin(*domains[dst], 0.2, rng(model, layer, 1000 + pair))
            for ep in spec["ep"]:
                case = {"model": model, "layer": layer, "split": f"cross {src}->{dst}"}
                r = run(case, domains[src], domains[dst], spec, ep, METHODS)
                ref = evaluate_case(
                    {**case, "split": f"in-domain {dst}"}, fit, held, spec, ep, ("ceo",), args.seed
                )
                r["in_domain_ceo_lar_balanced"] = ref["methods"]["ceo"]["lar_balanced"]
                r["cross_domain_loss"] = (
                    1 - r["methods"]["ceo"]["lar_balanced"] / r["in_domain_ceo_lar_balanced"]
                )
                print(
                    f"  cross-domain loss of ceo vs in-domain 20% fit: {r['cross_domain_loss']:.1%}",
                    file=sys.stderr,
                )
        # leave one domain out: fit on the other domains pooled, evaluate on the one left out
        left_out = sorted(domains)[:1] if args.quick else sorted(domains)
        for out in left_out if "lodo" in sections else ():
            others = [d for d in sorted(domains) if d != out]
            parts, fit = [domains[d] for d in others], pooled(domains, others)
            for ep in spec["ep"]:
                case = {"model": model, "layer": layer, "split": f"lodo {out}"}
                run(case, fit, domains[out], spec, ep, METHODS, batch_parts=parts)

    def ratios(kind: str, method: str = "ceo") -> list[float]:
        out = []
        for r in results:
            base = [r["methods"][b]["lar_balanced"] for b in BASELINES if b in r["methods"]]
            if r["split"].startswith(kind) and method in r["methods"] and base:
                out.append(r["methods"][method]["lar_balanced"] / max(base))
        return out

    def stats(values: list[float]) -> dict | None:
        if not values:
            return None
        return {"mean": float(np.mean(values)), "min": min(values), "cases": len(values),
                "wins": sum(v >= 1.0 for v in values)}  # fmt: skip

    def wins_against_each(kind: str) -> dict | None:
        cases = [r for r in results if r["split"].startswith(kind) and "ceo" in r["methods"]]
        if not cases:
            return None
        return {
            b: sum(
                r["methods"]["ceo"]["lar_balanced"] >= r["methods"][b]["lar_balanced"]
                for r in cases
            )
            for b in BASELINES
        }

    enumerated = [
        r["methods"]["ceo"]["fit_lar"] / r["enumerated_fit_optimum"]["fit_lar"]
        for r in results if "enumerated_fit_optimum" in r
    ]  # fmt: skip
    olmoe_thin = [
        r["ceo_over_vanilla"]
        for r in results
        if r["model"] == "OLMoE" and r["split"].startswith("thin") and "ceo_over_vanilla" in r
    ]
    summary = {
        "cases": len(results),
        "in_domain_ceo_over_best_baseline": stats(ratios("thin")),
        "cross_domain_ceo_over_best_baseline": stats(ratios("cross")),
        "cross_domain_ceo_at_least_each_baseline": wins_against_each("cross"),
        "lodo_ceo_over_best_baseline": stats(ratios("lodo")),
        "lodo_ceo_domain_batches_over_best_baseline": stats(ratios("lodo", "ceo[domain batches]")),
        "lodo_ceo_at_least_each_baseline": wins_against_each("lodo"),
        "ceo_fit_over_enumerated_optimum_min": min(enumerated) if enumerated else None,
        "ceo_imbalance_balanced_max": max(
            (r["methods"]["ceo"]["imbalance_balanced"] for r in results), default=None
        ),
        "olmoe_pooled_ceo_over_vanilla_min": min(olmoe_thin) if olmoe_thin else None,
        "cross_domain_loss": {
            f"{r['model']} L{r['layer']} EP{r['ep']} {r['split']}": r["cross_domain_loss"]
            for r in results
            if "cross_domain_loss" in r
        },  # fmt: skip
    }
    report = {"benchmark": "solve_quality", "seed": args.seed, "sections": sorted(sections)}
    if "ilp" in sections:
        small = ilp_reference(data, args.seed, args.quick)
        print(
            f"ILP reference: {small['proven_optimal']}/{len(small['instances'])} proven optimal; "
            f"min ratio to optimum {small['ratio_to_optimum_min']}",
            file=sys.stderr,
        )
        summary["ilp_small"] = {k: v for k, v in small.items() if k != "instances"}
        report["ilp_small_instances"] = small["instances"]
    summary["seconds"] = time.perf_counter() - started
    report.update(summary=summary, results=results)
    emit_json(report, args.out, default=float)
    return 0


if __name__ == "__main__":
    run(main)

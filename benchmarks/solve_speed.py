"""Solver speed on one DeepSeek-V3-shaped layer, and a whole 58-layer model; prints JSON.

Instance: ``planner.trace.synth``'s DeepSeek-V3 shape (256 experts, top-8, vocabulary
129280) for one layer, ``--occurrences`` token occurrences (default 350k, about 50k distinct
tokens with Zipf frequencies), W = (token, expert) routing counts, ``a_j`` = occurrences.
Solved at EP 8 and EP 32 with each method (``ceo`` in both variants), each in a fresh
child process that loads the instance and solves it, so that its peak RSS (VmHWM) is the
solve's own (``rss_before_solve_mib``: after loading); LAR and token imbalance are reported
alongside the seconds, and for CEO the work units its budget counted (``effort``,
:mod:`planner.solve.effort`: the default budget of 5M units per layer, a 58-layer model's
share (:func:`planner.solve.ceo.model_layer_effort`), is what bounds CEO's time;
units per second on a machine say how well the cost model tracks it there). EP 32 token
imbalance exceeds 1.1 because the most frequent tokens each carry more than 1.1/32 of all
occurrences (indivisible tokens, see :mod:`planner.solve.problem`).

Runtime batches: ``--batches trace`` (default) records the instance's fitting batches as
``moeplan fit`` does (4096-token batches in trace order, at most 64 kept;
:mod:`planner.predict.batches`), so CEO's batch-aware score pays its cost;
``--batches domain`` cuts them from the rows sorted by request domain (every batch one
domain: the most over-cap groups, the slowest case); ``--batches none`` leaves them out.

``--expert-beta B`` solves every method but vanilla under the expert-load cap
(:mod:`planner.solve.expert_balance`: CEO keeps to it in its search, the others are capped
after); every row reports its ``expert_imbalance``.

Whole model: ``--model-layers`` layers (default 58) of one synthetic DeepSeek-V3-shaped
model are solved with :func:`planner.solve.plan.solve_model` (``--jobs`` processes, default
2) and, as ``moeplan solve`` does, the n-gram term (layers in order within runs of 16,
:mod:`planner.solve.ngram_term`; ``--ngram-weight 0`` turns it off) when ``--full`` is given;
otherwise the 58-layer time is estimated from the per-layer time and the job count.

    python benchmarks/solve_speed.py [--occurrences 350000] [--methods ceo,metis,...] [--ep 8,32]
        [--batches trace|domain|none] [--full] [--model-layers 58] [--jobs 2]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import tempfile
import time
from pathlib import Path
from queue import Empty

import numpy as np
from _common import (  # (benchmarks/ is on sys.path when run as a script)
    ArgumentParser,
    comma_list,
    emit_json,
    int_list,
    nonnegative_int,
    peak_rss_mib,
    positive_int,
    run,
)
from scipy import sparse

from planner.errors import InputError
from planner.solve.ceo import DEFAULT_EFFORT, model_layer_effort
from planner.solve.ceo import VARIANTS as CEO_VARIANTS
from planner.solve.ngram_term import DEFAULT_WEIGHT
from planner.solve.problem import SolverConfig
from planner.solve.registry import SOLVERS, check_method_options, get_solver

TARGET_LAYER_S = 10.0
TARGET_MODEL_S = 300.0
METHODS = ("ceo", "ceo:paper", "metis", "kmeans", "alternating", "vanilla")


BATCH_ORDERS = ("trace", "domain", "none")


def method_name(text: str) -> str:
    """An argparse ``type``: one ``--methods`` entry, a registered solver or CEO with its
    variant (``ceo:paper``), checked here, before any child process solves with it."""
    name, colon, variant = text.partition(":")
    try:
        get_solver(name)
    except InputError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if colon and (name != "ceo" or variant not in CEO_VARIANTS):
        variants = ", ".join(f"ceo:{v}" for v in CEO_VARIANTS)
        raise argparse.ArgumentTypeError(f"{text!r}: the solver variants are {variants}")
    return text


def synth_layer(occurrences: int, seed: int, batches: str = "trace"):
    """(token ids [J], W [J, 256] routing counts, a [J], batch_freq [J, G] or None) of one
    DeepSeek-V3-shaped layer."""
    layers, _, mix = synth_model(1, occurrences, seed * 1000, transitions=False, batches=batches)
    ids, w, a = layers[0]
    return ids, w, a, None if mix is None else mix.token_batch_freq(ids)


def _csr_arrays(prefix: str, m) -> dict[str, np.ndarray]:
    """A CSR matrix as named arrays for ``np.savez`` (read back by :func:`_csr_load`)."""
    parts = {"data": m.data, "indices": m.indices, "indptr": m.indptr, "shape": np.array(m.shape)}
    return {prefix + k: v for k, v in parts.items()}


def _csr_load(data, prefix: str) -> sparse.csr_matrix | None:
    if prefix + "data" not in data:
        return None
    parts = (data[prefix + k] for k in ("data", "indices", "indptr"))
    return sparse.csr_matrix(tuple(parts), shape=tuple(data[prefix + "shape"]))


def _child(method: str, instance: str, ep: int, seed: int, expert_beta, ceo_options, queue):
    from planner.solve.expert_balance import expert_imbalance
    from planner.solve.problem import LayerProblem, SolverConfig
    from planner.solve.registry import solve_layer

    data = np.load(instance)
    w, batch_freq = _csr_load(data, ""), _csr_load(data, "b_")
    problem = LayerProblem(w, data["freq"], ep, token_ids=data["ids"], batch_freq=batch_freq)
    base = peak_rss_mib()
    name, _, variant = method.partition(":")
    options = {name: {"variant": variant}} if variant else {}
    if name == "ceo" and ceo_options:
        options["ceo"] = options.get("ceo", {}) | ceo_options
    started = time.perf_counter()
    config = SolverConfig(seed=seed, options=options, expert_beta=expert_beta)
    placement = solve_layer(problem, name, config)
    queue.put({
        "method": method, "ep": ep, "seconds": time.perf_counter() - started,
        "lar": placement.local_rate, "token_imbalance": placement.token_imbalance,
        "expert_imbalance": expert_imbalance(problem, placement.expert_to_device),
        "tokens": problem.num_tokens, "nnz": int(w.nnz),
        "peak_rss_mib": peak_rss_mib(), "rss_before_solve_mib": base,
        "batches": 0 if batch_freq is None else int(batch_freq.shape[1]),
        **{k: placement.info[k]
           for k in ("iterations", "restarts_used", "batch_overflow", "effort")
           if k in placement.info},
    })  # fmt: skip


def run_child(
    method: str, instance: str, ep: int, seed: int, expert_beta=None, ceo_options=None
) -> dict:
    """Solve in a fresh spawned process so that its peak RSS is the solve's own."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    args = (method, instance, ep, seed, expert_beta, ceo_options, queue)
    proc = ctx.Process(target=_child, args=args)
    proc.start()
    while True:  # a child that fails (an error, killed for memory) must not hang the run
        try:
            result = queue.get(timeout=2.0)
            break
        except Empty:
            if not proc.is_alive():
                died = f"{method} at EP {ep}: the solving process died (exit {proc.exitcode})"
                raise SystemExit(died) from None
    proc.join()
    return result


def _print_row(r: dict) -> None:
    print(
        f"EP{r['ep']:3d} {r['method']:12s} {r['seconds']:7.2f} s  LAR {r['lar']:.4f}  "
        f"imb {r['token_imbalance']:.3f}  exp.imb {r['expert_imbalance']:.3f}  peak {r['peak_rss_mib']:.0f} MiB "
        f"(before solve {r['rss_before_solve_mib']:.0f})  batches {r['batches']}"
        + (f"  iterations {r['iterations']}" if "iterations" in r else "")
        + (f"  effort {r['effort'] / 1e6:.2f}M units" if "effort" in r else "")
        + (f"  overflow {r['batch_overflow']:.0f}" if "batch_overflow" in r else ""),
        file=sys.stderr,
    )


def synth_model(
    layers: int, occurrences: int, seed: int, transitions: bool = True, batches: str = "none"
):
    """Per-layer (token ids, W, a), the top-1 transition statistic (None without
    ``transitions``; the n-gram term reads it) and the fitting batch mix (None for
    ``batches="none"``, see the module doc) of a DeepSeek-V3-shaped model of ``layers``
    layers."""
    from planner.predict.batches import BatchMixAccumulator
    from planner.predict.ngram import TransitionAccumulator
    from planner.trace.synth import SynthGenerator, preset_config

    config = preset_config(
        "deepseek-v3", num_layers=layers, num_tokens=occurrences,
        num_requests=max(1, occurrences // 2000), seed=seed,
    )  # fmt: skip
    k, n = config.top_k, config.num_experts
    acc = TransitionAccumulator(layers, n) if transitions else None
    tokens, experts, domains = [], [], []
    for batch in SynthGenerator(config).batches():
        if acc is not None:
            acc.add(batch.experts)
        tokens.append(batch.token_id.astype(np.int64))
        experts.append(batch.experts.astype(np.int16))
        domains.append(batch.extras["domain"])
    tok, exp = np.concatenate(tokens), np.concatenate(experts)
    mix = None
    if batches != "none":
        stream = BatchMixAccumulator(config.vocab_size)
        order = np.argsort(np.concatenate(domains), kind="stable") if batches == "domain" else None
        stream.add(tok if order is None else tok[order])
        mix = stream.result()
    ids, rows = np.unique(tok, return_inverse=True)
    layer_data = []
    for layer in range(layers):
        w = sparse.csr_matrix(
            (np.ones(tok.size * k), (np.repeat(rows, k), exp[:, layer].astype(np.int64).ravel())),
            shape=(ids.size, n),
        )
        w.sum_duplicates()
        layer_data.append((ids, w, np.asarray(w.sum(axis=1)).ravel() / k))
    return layer_data, None if acc is None else acc.result(), mix


def whole_model(
    layers: int,
    occurrences: int,
    eps: list[int],
    jobs: int,
    seed: int,
    ngram_weight: float,
    batches: str = "trace",
    ceo_options: dict | None = None,
    expert_beta: float | None = None,
) -> list[dict]:
    """Solve ``layers`` synthetic layers with ``solve_model(jobs=jobs)`` at each EP size,
    with the n-gram term (order 2) as ``moeplan solve`` runs it unless ``ngram_weight`` is 0,
    CEO given ``ceo_options`` and the expert-load cap ``expert_beta`` (as the layer runs;
    both were left out here)."""
    from planner.solve.ngram_term import NgramTerm
    from planner.solve.plan import solve_model
    from planner.solve.problem import LayerProblem, SolverConfig

    built = time.perf_counter()
    layer_data, transitions, mix = synth_model(layers, occurrences, seed, batches=batches)
    batch_freq = None if mix is None else mix.token_batch_freq(layer_data[0][0])
    build_s = time.perf_counter() - built
    term = NgramTerm(transitions, 2, ngram_weight) if ngram_weight > 0 else None
    out = []
    for ep in eps:
        problems = [
            LayerProblem(w, a, ep, token_ids=ids, layer=layer, batch_freq=batch_freq)
            for layer, (ids, w, a) in enumerate(layer_data)
        ]
        started = time.perf_counter()
        placements = solve_model(
            problems, "ceo",
            SolverConfig(seed=seed, options={"ceo": dict(ceo_options or {})}, expert_beta=expert_beta),
            jobs=jobs, progress=False, ngram_term=term,
        )  # fmt: skip
        elapsed = time.perf_counter() - started
        seconds = [p.seconds for p in placements]
        ngram = [p.info["ngram_term"]["local_rate"] for p in placements if "ngram_term" in p.info]
        out.append({
            "layers": layers, "ep": ep, "jobs": jobs, "ngram_weight": ngram_weight,
            "batches": batches, "ceo_options": ceo_options or {}, "expert_beta": expert_beta,
            "seconds": elapsed,
            "layer_seconds_max": max(seconds), "layer_seconds_mean": float(np.mean(seconds)),
            "build_seconds": build_s, "mean_lar": float(np.mean([p.local_rate for p in placements])),
            "mean_ngram_fit_rate": float(np.mean(ngram)) if ngram else None,
            "within_target": elapsed <= TARGET_MODEL_S,
        })  # fmt: skip
        print(f"model EP{ep}: {out[-1]['seconds']:.1f} s for {layers} layers with {jobs} jobs",
              file=sys.stderr)  # fmt: skip
    return out


def main(argv=None) -> int:
    ap = ArgumentParser(__doc__)
    ap.add_argument(
        "--occurrences", type=positive_int, default=350_000,
        help="token occurrences of the layer (and of the --full model), at least 1 "
        "(default 350000)",
    )  # fmt: skip
    ap.add_argument(
        "--methods", type=comma_list(method_name), default=list(METHODS),
        help=f"comma-separated solvers, of {', '.join(SOLVERS)}, CEO's variant after a colon "
        f"({', '.join('ceo:' + v for v in CEO_VARIANTS)}; default {','.join(METHODS)})",
    )  # fmt: skip
    ap.add_argument(
        "--ep", type=int_list(least=1), default=[8, 32],
        help="comma-separated EP sizes, each at least 1 (default 8,32)",
    )  # fmt: skip
    ap.add_argument(
        "--seed", type=nonnegative_int, default=0, help="instance and solver seed (default 0)"
    )
    ap.add_argument(
        "--jobs", type=positive_int, default=2,
        help="processes of the whole-model solve and of its estimate, at least 1 (default 2)",
    )  # fmt: skip
    ap.add_argument(
        "--model-layers", type=positive_int, default=58,
        help="layers of the whole model (solved with --full, else estimated), at least 1 "
        "(default 58)",
    )  # fmt: skip
    ap.add_argument(
        "--full", action="store_true", help="solve the whole model (slow; default: estimate it)"
    )
    ap.add_argument(
        "--ngram-weight", type=float, default=DEFAULT_WEIGHT,
        help="n-gram term of the whole-model solve (0: layers independent; default "
        f"{DEFAULT_WEIGHT:g})",
    )  # fmt: skip
    ap.add_argument(
        "--batches", choices=BATCH_ORDERS, default="trace",
        help="fitting batches: trace, domain or none (module doc; default trace)",
    )  # fmt: skip
    ap.add_argument(
        "--ceo-options", type=json.loads, default=None,
        help='CEO options as JSON for every CEO solve, e.g. \'{"expert_cap": "search"}\' '
        "(default: none)",
    )  # fmt: skip
    ap.add_argument(
        "--expert-beta", type=float, default=None,
        help="the expert-load cap of every solve but vanilla (SolverConfig.expert_beta; "
        "default: none)",
    )  # fmt: skip
    args = ap.parse_args(argv)
    eps = args.ep
    # the solvers' settings, checked here: a child that fails prints its traceback
    check_method_options({"ceo": args.ceo_options or {}})
    SolverConfig(seed=args.seed, expert_beta=args.expert_beta)
    if args.full:
        from planner.solve.pipeline import PlanConfig

        PlanConfig(ep_size=eps[0], jobs=args.jobs, ngram_weight=args.ngram_weight)
    ids, w, a, batch_freq = synth_layer(args.occurrences, args.seed, args.batches)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        instance = str(Path(tmp) / "layer.npz")
        extra = {} if batch_freq is None else _csr_arrays("b_", batch_freq)
        np.savez(instance, freq=a, ids=ids, **_csr_arrays("", w), **extra)
        for ep in eps:
            for method in args.methods:
                results.append(
                    run_child(method, instance, ep, args.seed, args.expert_beta, args.ceo_options)
                )
                _print_row(results[-1])
    report = {"benchmark": "solve_speed", "occurrences": args.occurrences,
              "batches": args.batches, "expert_beta": args.expert_beta,
              "tokens": int(ids.size), "nnz": int(w.nnz), "layer": results}  # fmt: skip
    ceo = {r["ep"]: r["seconds"] for r in results if r["method"] == "ceo"}
    if ceo:
        report["ceo_layer_target_s"] = TARGET_LAYER_S
        report["ceo_layer_within_target"] = {ep: s <= TARGET_LAYER_S for ep, s in ceo.items()}
        # jobs processes share the CPU cores; estimate assumes a perfect split over jobs,
        # and a time in proportion to the budget a model of that many layers gives a layer
        # (the single layer ran at DEFAULT_EFFORT; fewer than 58 layers get more each)
        scale = model_layer_effort(args.model_layers) / DEFAULT_EFFORT
        if "effort" in (args.ceo_options or {}):
            scale = 1.0  # the layer ran at the budget asked for
        report["model_estimate_s"] = {
            ep: s * scale * args.model_layers / max(1, args.jobs) for ep, s in ceo.items()
        }
    if args.full:
        report["model"] = whole_model(
            args.model_layers,
            args.occurrences,
            eps,
            args.jobs,
            args.seed,
            args.ngram_weight,
            args.batches,
            args.ceo_options,
            args.expert_beta,
        )
    emit_json(report)
    return 0


if __name__ == "__main__":
    run(main)

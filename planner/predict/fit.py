"""``moeplan fit`` as a library call: stream routing data, fit every predictor, report held-out.

Traces are read twice at most, in chunks: one pass accumulates the fitting statistics
(token-expert counts, top-1 transitions, unknown-token load, the token mix of the runtime
batches) over the fitting requests; with a hold-out, a second pass scores the held-out
requests. Memory is bounded by the distinct (layer, token, expert) triples and
transition tuples, not by the trace's length, plus the accumulators' raw-key buffers,
which fill up to a fixed limit (about 1.2 GiB in all at Qwen3-30B's shape, reached
after ~3M tokens) and are freed before the tables are built.

Counts tables are read whole (they are aggregates already) and split by binomial
thinning, or evaluated across domains (see :mod:`planner.predict.split`).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from planner._checks import is_integer
from planner._progress import progress_bar
from planner.errors import InputError
from planner.predict.affinity import TokenExpertAffinity, load_embeddings
from planner.predict.batches import (
    BATCH_TOKENS,
    BatchMixAccumulator,
    MixedBatchAccumulator,
    batch_spread,
)
from planner.predict.counts import (
    BUFFER_KEYS,
    CountsAccumulator,
    CountsSelection,
    TokenExpertCounts,
    check_vocab_fits,
    is_counts_table,
    read_counts_table,
)
from planner.predict.distribution import DistributionPredictor, RuntimeBatchLoads, batch_load
from planner.predict.metrics import HeldoutParts, TraceEvaluator, evaluate_counts
from planner.predict.neural import NeuralConfig, NeuralPredictor
from planner.predict.ngram import TransitionAccumulator
from planner.predict.predictor import Predictor
from planner.predict.reliability import (
    FOLD_SEED_OFFSET,
    estimate_shrinkage,
    sampled_layers,
    spread_to_layers,
)
from planner.predict.split import RequestSplit, check_fraction, check_seed, thin_counts
from planner.trace.io import EMBEDDINGS_FILE, open_trace

# The random stream of --mixed-batches' request order (beside the fit's seed).
MIXED_BATCHES_STREAM = 7


@dataclass(frozen=True)
class FitConfig:
    """Settings of one fit.

    Attributes:
        holdout: share of requests (traces) or of activations (counts, by thinning) held
            out for the report; None fits on everything and reports nothing.
        seed: seed of the split and of the neural predictor.
        embeddings: path of input embeddings [V, d] (.npy or .safetensors) for the
            nearest-token fallback (and the neural predictor's input).
        auto_embeddings: when ``embeddings`` is None and the trace directory holds the
            ``embeddings.safetensors`` that ``moeplan profile --save-embeddings`` writes, use it.
        distribution_momentum: None for the distribution-only predictor's exact MLE (the
            size-weighted running mean over batches); a float in (0, 1] for an exponential
            moving average over the fitting rows' runtime batches of ``batch_tokens``
            (counts tables have no batches: MLE).
        neural: also train the neural predictor.
        neural_config: its settings (its own seed is replaced by ``seed``).
        confident_threshold: share defining a token's confident expert set.
        ngram_routed: keep every routed expert in the n-gram statistics (the "routed"
            n-gram target of :mod:`planner.predict.ngram`; k times more tuples, slower fit),
            else the top-1 expert only (the paper's statistic).
        ep_size, ngram_order: the indicative n-gram figure of the report uses the
            contiguous placement on ``ep_size`` devices.
        batch_rows: trace rows per chunk (None: :func:`planner.trace.io.batch_rows_for`,
            65536 rows for a narrow model, fewer for a wide one, so that the reader's peak
            does not follow the model's width). The predictor does not depend on it.
        batch_tokens: tokens per runtime batch; the fitting rows in trace order are cut into
            batches of this size (:mod:`planner.predict.batches`).
        mixed_batches: record the fitting batches the fitting requests would make served in
            a random order (drawn with ``seed``; each request's rows kept together) instead
            of in trace order: for a trace profiled one domain (or prompt file) at a time
            that will be served mixed with other users' requests
            (:class:`planner.predict.batches.MixedBatchAccumulator`).
        token_reliability: traces only: estimate each layer's token shrinkage m from two
            folds of the fitting requests (:mod:`planner.predict.reliability`); costs one
            more counts accumulator over half the rows at 8 layers at most. False leaves
            token confidences uncalibrated.
        counts: model / domain / shape selection for counts tables.
        eval_domains: counts only: fit on ``counts.domains``, report on these domains.
        progress: show progress bars on stderr.
    """

    holdout: float | None = None
    seed: int = 0
    embeddings: str | None = None
    auto_embeddings: bool = True
    distribution_momentum: float | None = None
    neural: bool = False
    neural_config: NeuralConfig = field(default_factory=NeuralConfig)
    confident_threshold: float = 0.5
    ep_size: int = 8
    ngram_order: int = 2
    ngram_routed: bool = False
    batch_rows: int | None = None
    batch_tokens: int = BATCH_TOKENS
    mixed_batches: bool = False
    token_reliability: bool = True
    counts: CountsSelection = field(default_factory=CountsSelection)
    eval_domains: tuple[str, ...] = ()
    progress: bool = False


@dataclass(frozen=True)
class FitResult:
    predictor: Predictor
    report: dict | None


def fit_predictor(path: str | Path, config: FitConfig = FitConfig()) -> FitResult:
    """Fit a :class:`Predictor` on the trace or counts table at ``path``."""
    path = Path(path)
    holdout = None if config.holdout is None else check_fraction(config.holdout)
    # the folds of the token shrinkage are drawn with seed + FOLD_SEED_OFFSET
    if check_seed(config.seed) + FOLD_SEED_OFFSET >= 2**64:
        raise InputError(f"seed {config.seed!r} must be below 2**64 - {FOLD_SEED_OFFSET}")
    for name in ("batch_rows", "batch_tokens"):  # as evaluate's batch_tokens
        value = getattr(config, name)
        if name == "batch_rows" and value is None:
            continue
        if not is_integer(value) or not 1 <= value <= 2**40:
            raise InputError(f"{name}={value!r} must be an integer in [1, 2**40]")
    # as Python numbers: they go to the predictor's JSON as they are
    config = replace(
        config, holdout=holdout, seed=check_seed(config.seed),
        batch_rows=None if config.batch_rows is None else int(config.batch_rows),
        batch_tokens=int(config.batch_tokens),
    )  # fmt: skip
    if not is_integer(config.ep_size) or config.ep_size < 1:
        raise InputError(f"ep_size={config.ep_size!r} must be a positive integer")
    if not is_integer(config.ngram_order) or config.ngram_order not in (1, 2, 3):
        raise InputError(f"ngram_order={config.ngram_order!r} must be 1, 2 or 3")
    # as Python numbers too (a numpy integer failed the save, after the work); the counts
    # table's reader checks the shapes
    shapes: dict[str, Any] = {
        key: int(value)
        for key in ("num_experts", "top_k", "vocab_size")
        if is_integer(value := getattr(config.counts, key))
    }
    config = replace(
        config, ep_size=int(config.ep_size), ngram_order=int(config.ngram_order),
        counts=replace(config.counts, **shapes),
    )  # fmt: skip
    if is_counts_table(path):
        return _fit_counts(path, config)
    if config.eval_domains or config.counts != CountsSelection():
        raise InputError(
            f"{path}: --model, --domain, --eval-domain and shape flags apply to counts tables only"
        )
    if config.embeddings is None and config.auto_embeddings and (path / EMBEDDINGS_FILE).is_file():
        config = replace(config, embeddings=str(path / EMBEDDINGS_FILE))
    return _fit_trace(path, config)


def _fit_components(
    counts: TokenExpertCounts,
    config: FitConfig,
    fingerprint: str | None = None,
    unknown_load: np.ndarray | None = None,
    unknown_top1_load: np.ndarray | None = None,
) -> tuple[TokenExpertAffinity, NeuralPredictor | None, dict]:
    """``fingerprint``: refuse embeddings that record another model's (traces);
    ``unknown_load``, ``unknown_top1_load``: the unknown tokens' activations (all ranks,
    rank 0) [L, N] (traces)."""
    emb = (
        load_embeddings(config.embeddings, counts.meta.vocab_size, fingerprint)
        if config.embeddings
        else None
    )
    t0 = time.perf_counter()
    affinity = TokenExpertAffinity(confident_threshold=config.confident_threshold).fit(
        counts, emb, unknown_load, unknown_top1_load
    )
    timings = {
        "affinity_seconds": round(time.perf_counter() - t0, 3),
        "embeddings": None if config.embeddings is None else str(config.embeddings),
        "confident_threshold": affinity.confident_threshold,
    }
    neural = None
    if config.neural:
        ncfg = replace(config.neural_config, seed=config.seed)
        neural = NeuralPredictor(ncfg).fit(counts, emb)
        timings["neural_seconds"] = neural.train_log_["seconds"]
    return affinity, neural, timings


def _fit_trace(path: Path, config: FitConfig) -> FitResult:
    trace = open_trace(path)
    meta = trace.meta
    check_vocab_fits(meta, str(path))
    if config.embeddings:  # a wrong file is refused before the pass; read after it
        load_embeddings(config.embeddings, meta.vocab_size, meta.fingerprint(), header_only=True)
    split = None
    request_ids, request_rows = trace.request_rows()
    if config.holdout is not None:
        split = RequestSplit.make(request_ids, config.holdout, config.seed)
    acc = CountsAccumulator(meta)
    # Fold B of the fitting requests at a few layers, for the token shrinkage (fold A =
    # all fitting rows - B).
    fold = fold_acc = None
    fold_layers = sampled_layers(meta.num_layers)
    # the folds halve the fitting requests (drawn over all of them, a small fitting side
    # could fall in one fold whole, and every layer then got m = 0: full trust)
    fitting = slice(None) if split is None else ~split.heldout_mask(request_ids)
    fit_ids = request_ids[fitting]
    if config.token_reliability and fit_ids.size >= 2:
        fold = RequestSplit.make(fit_ids, 0.5, config.seed + FOLD_SEED_OFFSET)
        fold_meta = replace(meta, num_layers=fold_layers.size, moe_layer_indices=())
        # as many buffered keys a layer as the main accumulator (2**27 keys over the <= 8
        # sampled layers were L/8 times as many a layer: 576 MiB once full)
        fold_acc = CountsAccumulator(fold_meta, BUFFER_KEYS * fold_layers.size // meta.num_layers)
    transitions = TransitionAccumulator(meta.num_layers, meta.num_experts, config.ngram_routed)
    # the fitting batches in both orders: the one asked for is the plan's, and how much
    # more the trace order's spread than a random order's says whether that choice matters
    orders: dict[str, BatchMixAccumulator | MixedBatchAccumulator] = {
        "trace": BatchMixAccumulator(meta.vocab_size, config.batch_tokens),
        "mixed": MixedBatchAccumulator(
            meta.vocab_size, fit_ids, request_rows[fitting],
            np.random.SeedSequence([config.seed, MIXED_BATCHES_STREAM]), config.batch_tokens,
        ),
    }  # fmt: skip
    order = "mixed" if config.mixed_batches else "trace"
    unknown_load = np.zeros((meta.num_layers, meta.num_experts), np.int64)
    unknown_top1 = np.zeros((meta.num_layers, meta.num_experts), np.int64)
    # Per-batch loads only for a moving average, over runtime batches of the fitting rows
    # (not the reading chunks: the estimate moved with --batch-rows); the MLE is the counts'
    # column sums.
    ema = config.distribution_momentum is not None
    distribution = DistributionPredictor(config.distribution_momentum)
    ema_batches = RuntimeBatchLoads(config.batch_tokens, meta.num_experts)
    fit_tokens = 0
    t0 = time.perf_counter()
    with progress_bar(config.progress, "fitting", trace.num_rows, unit="tokens") as advance:
        for batch in trace.iter_batches(config.batch_rows, weights=False):
            advance(len(batch))
            if split is not None:
                batch = batch.select(~split.heldout_mask(batch.request_id))
            if len(batch) == 0:
                continue
            fit_tokens += len(batch)
            acc.add(batch.token_id, batch.experts)
            if fold is not None:
                assert fold_acc is not None  # created together with fold
                in_b = np.flatnonzero(fold.heldout_mask(batch.request_id))
                # one gather of fold B's rows at the sampled layers, not a copy of all layers
                fold_acc.add(batch.token_id[in_b], batch.experts[in_b[:, None], fold_layers])
            transitions.add(batch.experts)
            for batches in orders.values():
                batches.add(batch.token_id, batch.request_id)
            if ema:
                for load in ema_batches.add(batch.experts):
                    distribution.partial_fit(load)
            unknown = batch.token_id < 0
            if unknown.any():  # (the experts are ordered by gate weight: rank 0 first)
                unknown_load += batch_load(batch.experts[unknown], meta.num_experts)
                unknown_top1 += batch_load(batch.experts[unknown][:, :, :1], meta.num_experts)
    # Every accumulator's buffers freed before any result is built: they fill up with the
    # trace (to 2**27 keys for the counts, as many for the transitions), and each result
    # was built under the others' buffers.
    for accumulator in (acc, fold_acc, transitions):
        if accumulator is not None:
            accumulator.release_buffers()
    counts = acc.result()
    trans = transitions.result()
    pass_seconds = time.perf_counter() - t0
    if fit_tokens == 0:
        raise InputError(f"{path}: no token occurrences to fit on")
    if not ema:  # the exact MLE over the fitting rows, unknown tokens included
        distribution.partial_fit(counts.load() + unknown_load)
    for load in ema_batches.rest():
        distribution.partial_fit(load)
    affinity, neural, timings = _fit_components(
        counts, config, meta.fingerprint(), unknown_load, unknown_top1
    )
    shrinkage = None
    if fold_acc is not None:
        fold_b = fold_acc.result().by_layer
        fold_a = [counts.by_layer[layer] - b for layer, b in zip(fold_layers, fold_b, strict=True)]
        sampled = estimate_shrinkage(fold_a, fold_b, meta.top_k)
        shrinkage = spread_to_layers(sampled, fold_layers, meta.num_layers)
    fit_info = {
        "input": str(path),
        "kind": "trace",
        "token_shrinkage": None if shrinkage is None else shrinkage.tolist(),
        "seed": config.seed,
        "split": split.summary() if split else None,
        "fit_tokens": fit_tokens,
        "unknown_tokens": acc.unknown_tokens,
        "distinct_tokens": int(affinity.seen_.sum()),
        "activations": fit_tokens * meta.num_layers * meta.top_k,
        "pass_seconds": round(pass_seconds, 3),
        "activations_per_second": round(
            fit_tokens * meta.num_layers * meta.top_k / max(pass_seconds, 1e-9)
        ),
        **timings,
    }
    if missing := trace.missing_parts():  # recorded only then: other predictors unchanged
        fit_info["missing_parts"] = missing
    report = None
    if split is not None:
        parts = HeldoutParts(
            affinity, distribution, counts, trans, neural, config.ep_size, config.ngram_order
        )
        evaluator = TraceEvaluator(parts)
        with progress_bar(
            config.progress, "scoring held-out", trace.num_rows, unit="tokens"
        ) as advance:
            for batch in trace.iter_batches(config.batch_rows, weights=False):
                advance(len(batch))
                held = batch.select(split.heldout_mask(batch.request_id))
                if len(held):
                    evaluator.add(held)
        report = {"split": split.summary(), **evaluator.report()}
        # Scoring built every layer's lookup tables; saving needs none of them, and whoever
        # predicts next rebuilds the layers they use (on 1M DeepSeek-V3-shaped tokens, half
        # held out, they were 0.5 GB of the fit's peak memory, reached while saving).
        affinity.drop_tables()
    mixes = {name: batches.result() for name, batches in orders.items()}
    mix = mixes[order]
    fit_info["batches"] = {"kept": mix.num_batches, "batch_tokens": mix.batch_tokens,
                           "stride": mix.stride, "order": order,
                           "spread": {name: batch_spread(m) for name, m in mixes.items()}}  # fmt: skip
    predictor = Predictor(
        meta, affinity, distribution, trans, neural, fit_info, report, mix, shrinkage
    )
    return FitResult(predictor, report)


def _fit_counts(path: Path, config: FitConfig) -> FitResult:
    if config.mixed_batches:
        raise InputError(
            "--mixed-batches orders a trace's requests; a counts table has no batches to mix"
        )
    if config.eval_domains and config.holdout is not None:
        raise InputError(
            "choose either --holdout (thinning) or --eval-domain (cross-domain), not both"
        )
    counts = read_counts_table(path, config.counts)
    heldout = None
    split: dict[str, Any] | None = None
    if config.eval_domains:
        overlap = sorted(set(config.eval_domains) & set(counts.domains))
        if overlap:
            raise InputError(
                f"evaluation domain(s) {', '.join(overlap)} are also fitting domains; "
                "pass the fitting domains with --domain"
            )
        heldout = read_counts_table(
            path,
            replace(config.counts, domains=tuple(config.eval_domains), domain_flag="--eval-domain"),
        )
        split = {
            "kind": "domain",
            "fit_domains": list(counts.domains),
            "eval_domains": list(heldout.domains),
        }
        fit = counts
    elif config.holdout is not None:
        fit, heldout = thin_counts(counts, config.holdout, config.seed)
        split = {
            "kind": "thinning",
            "fraction": config.holdout,
            "seed": config.seed,
            "note": "each routed activation held out independently: a token-occurrence "
            "split, optimistic compared with a request split",
        }
    else:
        fit = counts
    if not fit.load().sum() > 0:
        raise InputError(f"{path}: no routed activations to fit on (every count is 0)")
    distribution = DistributionPredictor(config.distribution_momentum).partial_fit(fit.load())
    affinity, neural, timings = _fit_components(fit, config)
    fit_info = {
        "input": str(path),
        "kind": "counts",
        "seed": config.seed,
        "domains": list(fit.domains),
        "split": split,
        "fit_activations": fit.total_activations(),
        "distinct_tokens": int(affinity.seen_.sum()),
        "counts_selection": asdict(config.counts) | {"domains": list(config.counts.domains)},
        **timings,
    }
    report = None
    if heldout is not None:
        parts = HeldoutParts(
            affinity, distribution, fit, None, neural, config.ep_size, config.ngram_order
        )
        report = {"split": split, **evaluate_counts(parts, heldout)}
    predictor = Predictor(fit.meta, affinity, distribution, None, neural, fit_info, report)
    return FitResult(predictor, report)

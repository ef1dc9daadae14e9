"""The metrics of DESIGN.md ("Metrics"), computed by streaming a held-out trace.

Every figure is counted over (token occurrence, MoE layer) pairs and the token's k routed
experts, exactly as the runtime would see them:

- ``lar_token`` / ``lar_ngram`` / ``lar``: share of routed experts living on the device the
  token was sent to, with the token table, the n-gram table (layers l >= n only, where it
  predicts anything: not a counts-fitted plan's table of confidence 0), and the
  online choice of Algorithm 2 (paper 000) -- computed with the runtime shim's own
  functions, so the evaluator and the runtime cannot disagree.
- ``lar_balanced``: the online choice when each batch of B tokens (trace order) may send at
  most ceil(1.1 B / E) tokens to a device (most confident keep their device).
- ``lar_vanilla``: contiguous experts, each sequence split into E contiguous chunks.
- ``oracle_bound``: per (layer, token), the largest share of the token's held-out routed
  experts that one device holding N/E experts could host; no static token table beats it.
- imbalances, remote fraction and all-to-all bytes (dispatch + combine).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, cast

import numpy as np

from planner._checks import is_bool, is_finite_number, is_integer
from planner._progress import progress_bar
from planner.errors import InputError
from planner.export.bundle import Bundle, check_compatible
from planner.predict.counts import CountsAccumulator
from planner.runtime_shim.tables import (
    assign_with_capacity,
    balanced_capacity,
    ngram_row_index,
    online_candidates,
)
from planner.trace.io import Trace, TraceBatch
from planner.trace.schema import TraceMeta

# Raw keys the oracle's counter buffers before it sorts them in (4 bytes each: 128 MB).
_COUNT_BUFFER = 1 << 25


@dataclass(frozen=True)
class EvalConfig:
    """Settings of ``moeplan evaluate``.

    Attributes:
        batch_tokens: B, tokens per runtime batch for the balanced LAR (DESIGN.md: 4096).
        slack: cap factor, at most ceil(slack * B / E) tokens per device and batch.
        hidden_size: model hidden size for all-to-all bytes (0 = report activations only).
        dtype_bytes: bytes per hidden element on the wire (2 for bf16).
        per_request: also report each held-out request's balanced local activations
            (``"per_request"``), for paired comparisons of plans on the same trace
            (:func:`planner.evaluate.compare.ratio_interval`).
    """

    batch_tokens: int = 4096
    slack: float = 1.1
    hidden_size: int = 0
    dtype_bytes: int = 2
    per_request: bool = False

    def __post_init__(self) -> None:
        def whole(value, least: int) -> bool:
            return is_integer(value) and bool(value >= least)

        problems = []
        if not whole(self.batch_tokens, 1) or self.batch_tokens > 2**40:
            problems.append(f"batch_tokens={self.batch_tokens!r} must be an integer in [1, 2**40]")
        if not (is_finite_number(self.slack) and self.slack >= 1):
            problems.append(f"slack={self.slack!r} must be a number >= 1")
        # bounded far above any model's, so that the byte counts print as numbers (a
        # 300-digit hidden size overflowed the table's float and JSON's digit limit)
        if not whole(self.hidden_size, 0) or self.hidden_size > 2**31:
            problems.append(f"hidden_size={self.hidden_size!r} must be an integer in [0, 2**31]")
        if not whole(self.dtype_bytes, 1) or self.dtype_bytes > 64:
            problems.append(f"dtype_bytes={self.dtype_bytes!r} must be an integer in [1, 64]")
        if not is_bool(self.per_request):
            problems.append(f"per_request={self.per_request!r} must be true or false")
        if problems:
            raise InputError("; ".join(problems))
        # as Python numbers: the config goes to the JSON report as it is
        for name in ("batch_tokens", "hidden_size", "dtype_bytes"):
            object.__setattr__(self, name, int(getattr(self, name)))
        object.__setattr__(self, "slack", float(self.slack))
        object.__setattr__(self, "per_request", bool(self.per_request))


class _Acc:
    """Per-layer running sums over the held-out trace."""

    def __init__(
        self, meta: TraceMeta, ep_size: int, lengths: dict[int, int], *, count_oracle: bool = True
    ):
        z = lambda *s: np.zeros(s, np.float64)  # noqa: E731
        self.request_ids = np.fromiter(sorted(lengths), np.int64, len(lengths))
        self.request_tokens = [lengths[r] for r in self.request_ids.tolist()]
        self.request_local = z(self.request_ids.size)  # balanced local activations, all layers
        big_l, e = meta.num_layers, ep_size
        self.occurrences = z(big_l)
        self.local = {k: z(big_l) for k in ("token", "ngram", "online", "balanced", "vanilla")}
        self.ngram_occ = z(big_l)
        self.ngram_layers = np.arange(0)  # the layers whose n-gram table predicts (_ngram_layers)
        self.remote = {k: z(big_l) for k in ("online", "balanced", "vanilla")}
        self.touched = {k: z(big_l) for k in ("online", "balanced", "vanilla")}
        self.tokens_on = {k: z(big_l, e) for k in ("online", "balanced")}
        self.expert_load = z(big_l, e)
        self.ngram_used = z(big_l)
        # per batch, before the cap: what the runtime sees (the trace-wide figure lets over-
        # and under-loaded batches cancel), per layer: the heaviest device's tokens summed
        # over batches (over the batches' tokens, x E: the token-weighted mean of max/mean,
        # so that a last batch of a few tokens weighs a few tokens), and the worst max/mean
        # of a batch at least half full (a last batch of t < E tokens reads at least E/t; a
        # shorter one counts only where no batch is half full)
        self.batch_heaviest = z(big_l)
        self.batch_tokens = 0
        self.batch_imbalance_worst = z(big_l)
        self.half_full_batches = 0
        self.short_batch_worst = z(big_l)
        self.unknown = 0  # occurrences of id -1: the oracle bound counts each as its own token
        # each (layer, token, routed expert) of the oracle bound, as the fit counts them
        self.oracle_counts = (
            CountsAccumulator(meta, _COUNT_BUFFER, top1=False) if count_oracle else None
        )


def _local_and_remote(expert_device: np.ndarray, chosen: np.ndarray, ep_size: int):
    """Per (token, layer): routed experts on the chosen device, and distinct remote devices.

    Args:
        expert_device: [T, L, k] device of each routed expert.
        chosen: [T, L] device each token was sent to.

    Returns:
        local [T, L] (routed experts on the chosen device), remote [L] sums (distinct
        devices other than the chosen one that a token's experts live on -- one dispatch
        each), touched [L] sums (distinct devices).
    """
    local = (expert_device == chosen[..., None]).sum(axis=2)
    onehot = np.zeros(expert_device.shape[:2] + (ep_size,), bool)
    # numpy's stubs pick their 0-d overload for a shape of unknown length
    t_idx, l_idx, _ = cast(tuple[np.ndarray, ...], np.indices(expert_device.shape, sparse=True))
    onehot[t_idx, l_idx, expert_device] = True
    touched = onehot.sum(-1)
    here = np.take_along_axis(onehot, chosen[..., None], -1)[..., 0]
    return local, (touched - here).sum(0), touched.sum(0)


def _vanilla_device(batch: TraceBatch, spans: _RequestSpans, ep_size: int) -> np.ndarray:
    """[T] device of each token when each sequence is split into E contiguous chunks.

    Chunks are taken over the request's own positions (first to last in the trace), so a
    request whose positions do not start at 0 (an ingested chunked-prefill continuation, a
    sample) is split too, not all sent to the last device.
    """
    req = np.searchsorted(spans.request_ids, batch.request_id)
    offset = batch.position.astype(np.int64) - spans.first[req]
    return np.minimum(offset * ep_size // spans.span[req], ep_size - 1)


class _RequestSpans:
    """Per request (sorted ids): tokens in the trace, first position and position span."""

    def __init__(self, trace: Trace):
        ids, pos = trace.occurrences()
        self.request_ids, inverse, self.tokens = np.unique(
            ids, return_inverse=True, return_counts=True
        )
        pos = pos.astype(np.int64)
        self.first = np.full(self.request_ids.size, np.iinfo(np.int64).max, np.int64)
        last = np.full(self.request_ids.size, -1, np.int64)
        np.minimum.at(self.first, inverse, pos)
        np.maximum.at(last, inverse, pos)
        self.span = np.maximum(last - self.first + 1, 1)

    def lengths(self) -> dict[int, int]:
        """Tokens of each request in the trace (positions may not start at 0 in a sample)."""
        return dict(zip(self.request_ids.tolist(), self.tokens.tolist(), strict=True))


def _chunks(trace: Trace, size: int):
    """Consecutive trace-order blocks of exactly ``size`` rows (the last may be shorter)."""
    pending: list[TraceBatch] = []
    have = 0
    for batch in trace.iter_batches(batch_rows=max(size, 65536 // size * size), weights=False):
        pending.append(batch)
        have += len(batch)
        if have < size:
            continue
        whole = TraceBatch.concat(pending)
        cut = len(whole) // size * size
        for start in range(0, cut, size):
            yield whole.select(slice(start, start + size))
        pending = [whole.select(slice(cut, None))] if cut < len(whole) else []
        have = len(whole) - cut
    if have:
        yield TraceBatch.concat(pending)


def evaluate_bundle(
    bundle: Bundle,
    trace: Trace,
    config: EvalConfig | None = None,
    *,
    progress: bool = False,
    oracle: bool = True,
) -> dict:
    """All DESIGN.md metrics of ``bundle`` on the held-out ``trace`` (``progress``: a bar on
    stderr, one step per token; ``oracle=False`` skips the oracle bound, which depends on
    the trace alone, and reports it as None: ``compare`` counts it once, not per plan).

    Returns:
        ``{"overall": {...}, "per_layer": [{...} for each MoE layer], "config": {...}}``;
        rates are in [0, 1], imbalances are max/mean (1.0 = even).
    """
    cfg = config or EvalConfig()
    meta = trace.meta
    check_compatible(bundle, meta, "trace")
    n, k, e = meta.num_experts, meta.top_k, bundle.ep_size
    spans = _RequestSpans(trace)
    acc = _Acc(meta, e, spans.lengths(), count_oracle=oracle)
    acc.ngram_layers = _ngram_layers(bundle)
    with progress_bar(progress, "evaluating", trace.num_rows, unit="tokens") as advance:
        for chunk in _chunks(trace, cfg.batch_tokens):
            _evaluate_chunk(chunk, bundle, cfg, spans, acc)
            advance(len(chunk))
    return _report(acc, bundle, cfg, k, n // e)


def _ngram_layers(bundle: Bundle) -> np.ndarray:
    """The layers (from the n-gram order on) whose n-gram table predicts anything: a table of
    confidence 0 everywhere (a plan fitted from counts has no n-gram tables, and its bundle
    carries such a one) never decides, offers no second choice, and has no LAR."""
    order = bundle.ngram_order
    layers = np.arange(order, bundle.meta.num_layers)
    return layers[(np.asarray(bundle.ngram_confidence[order:]) > 0).any(axis=1)]


def _evaluate_chunk(
    chunk: TraceBatch, bundle: Bundle, cfg: EvalConfig, spans: _RequestSpans, acc: _Acc
) -> None:
    """Add one runtime batch of the held-out trace to ``acc``."""
    meta = bundle.meta
    big_l, n, e, order = meta.num_layers, meta.num_experts, bundle.ep_size, bundle.ngram_order
    layers = np.arange(big_l)
    vanilla_expert_device = np.arange(n) // (n // e)
    t = len(chunk)
    experts = chunk.experts.astype(np.int64)  # [T, L, k]
    expert_device = bundle.expert_to_device[layers[None, :, None], experts].astype(np.int64)
    known = chunk.token_id >= 0
    tok = np.where(known, chunk.token_id, 0)
    van = _vanilla_device(chunk, spans, e)  # [T]

    token_dev = np.where(known[:, None], bundle.token_to_device[:, tok].T, van[:, None])
    token_conf = np.where(known[:, None], bundle.token_confidence[:, tok].T, 0).astype(np.float32)
    ngram_dev = np.full((t, big_l), -1, np.int64)  # -1: no n-gram prediction
    ngram_conf = np.zeros((t, big_l), np.float32)
    if order > 0 and big_l > order:
        top1_dev = expert_device[:, :, 0]  # [T, L]
        for layer in acc.ngram_layers.tolist():
            row = ngram_row_index(top1_dev[:, layer - order : layer], e)
            ngram_dev[:, layer] = bundle.ngram_to_device[layer, row]
            ngram_conf[:, layer] = bundle.ngram_confidence[layer, row]
    chosen, conf, second, second_conf = online_candidates(
        token_dev, token_conf, ngram_dev, ngram_conf
    )
    cap = balanced_capacity(t, e, cfg.slack)
    balanced = assign_with_capacity(chosen.T, conf.T, cap, e, second.T, second_conf.T).T

    acc.occurrences += t
    acc.local["token"] += (expert_device == token_dev[..., None]).sum(axis=(0, 2))
    ng = (expert_device == ngram_dev[..., None]).sum(axis=(0, 2))
    acc.local["ngram"][acc.ngram_layers] += ng[acc.ngram_layers]
    acc.ngram_occ[acc.ngram_layers] += t
    acc.ngram_used += (ngram_conf > token_conf).sum(0)
    for name, dev, edev in (
        ("online", chosen, expert_device),
        ("balanced", balanced, expert_device),
        ("vanilla", np.broadcast_to(van[:, None], (t, big_l)), vanilla_expert_device[experts]),
    ):
        local, remote, touched = _local_and_remote(edev, np.ascontiguousarray(dev), e)
        acc.local[name] += local.sum(axis=0)
        if name == "balanced" and cfg.per_request:
            req = np.searchsorted(acc.request_ids, chunk.request_id)
            acc.request_local += np.bincount(
                req, weights=local.sum(axis=1), minlength=acc.request_ids.size
            )
        acc.remote[name] += remote
        acc.touched[name] += touched
        if name in acc.tokens_on:
            counts = np.stack([np.bincount(dev[:, i], minlength=e) for i in range(big_l)])
            acc.tokens_on[name] += counts
            if name == "online" and t:
                acc.batch_heaviest += counts.max(axis=1)
                acc.batch_tokens += t
                imb = counts.max(axis=1) * e / t  # max / mean, [L]
                if 2 * t >= cfg.batch_tokens:
                    acc.half_full_batches += 1
                    acc.batch_imbalance_worst = np.maximum(acc.batch_imbalance_worst, imb)
                else:
                    acc.short_batch_worst = np.maximum(acc.short_batch_worst, imb)
    acc.expert_load += np.stack(
        [np.bincount(expert_device[:, i].ravel(), minlength=e) for i in range(big_l)]
    )
    if acc.oracle_counts is not None:
        acc.oracle_counts.add(chunk.token_id[known], chunk.experts[known])
    acc.unknown += int(t - known.sum())


def _imbalance(load: np.ndarray) -> np.ndarray:
    mean = load.mean(axis=-1)
    return np.where(mean > 0, load.max(axis=-1) / np.maximum(mean, 1e-12), np.nan)


def _report(acc: _Acc, bundle: Bundle, cfg: EvalConfig, k: int, per_device: int) -> dict:
    occ = acc.occurrences * k
    e = bundle.ep_size
    worst = acc.batch_imbalance_worst if acc.half_full_batches else acc.short_batch_worst
    # [L, 2] (hosted, total): per token its top-(N/E) expert counts; NaN reports as None
    oracle = np.full((occ.shape[0], 2), np.nan)
    if acc.oracle_counts is not None:
        oracle = acc.oracle_counts.top_counts(per_device)
        # an unknown id's occurrence is a token of its own: at best min(k, N/E) of its k
        # experts share a device (left out, the bound was below what the tables reached)
        oracle += acc.unknown * np.array([min(k, per_device), k])
    # Every rate as (numerator, denominator) per layer: per-layer rows divide them, the
    # overall figure divides their sums (occurrence-weighted).
    ratios = {
        "lar_token": (acc.local["token"], occ),
        "lar_ngram": (acc.local["ngram"], acc.ngram_occ * k),
        "lar": (acc.local["online"], occ),
        "lar_balanced": (acc.local["balanced"], occ),
        "lar_vanilla": (acc.local["vanilla"], occ),
        "oracle_bound": (oracle[:, 0], oracle[:, 1]),
        "ngram_share": (acc.ngram_used, acc.occurrences),
        "remote_fraction": (acc.remote["balanced"], acc.touched["balanced"]),
        "remote_fraction_vanilla": (acc.remote["vanilla"], acc.touched["vanilla"]),
    }
    nan_l = np.full(len(acc.occurrences), np.nan)
    imbalances = {
        "token_imbalance": _imbalance(acc.tokens_on["online"]),
        "token_imbalance_balanced": _imbalance(acc.tokens_on["balanced"]),
        "expert_load_imbalance": _imbalance(acc.expert_load),
        "token_imbalance_batch": (
            acc.batch_heaviest * e / acc.batch_tokens if acc.batch_tokens else nan_l
        ),
    }
    cols = {
        name: np.where(den > 0, num / np.maximum(den, 1e-12), np.nan)
        for name, (num, den) in ratios.items()
    } | imbalances
    per_layer = []
    for layer in range(len(acc.occurrences)):
        row: dict[str, Any] = {
            "layer": layer,
            "model_layer": int(bundle.meta.moe_layer_indices[layer]),
        }
        row |= {name: _num(v[layer]) for name, v in cols.items()}
        per_layer.append(row)

    def pooled(num, den):
        d = float(np.sum(den))
        return _num(float(np.sum(num)) / d) if d > 0 else None

    bytes_per = cfg.hidden_size * cfg.dtype_bytes * 2  # dispatch + combine
    remote_b, remote_v = float(acc.remote["balanced"].sum()), float(acc.remote["vanilla"].sum())
    overall = {
        "tokens": int(acc.occurrences[0]) if len(acc.occurrences) else 0,
        **{name: pooled(num, den) for name, (num, den) in ratios.items()},
        **{name: _nanmean(v) for name, v in imbalances.items()},
        "token_imbalance_batch_worst": (
            _num(worst.max()) if acc.batch_tokens and worst.size else None
        ),
        "remote_activations": int(remote_b),
        "remote_activations_vanilla": int(remote_v),
        # whole activations times bytes in Python ints: exact for any trace
        "all_to_all_bytes": int(remote_b) * bytes_per if bytes_per else None,
        "all_to_all_bytes_vanilla": int(remote_v) * bytes_per if bytes_per else None,
    }
    report = {
        "overall": overall,
        "per_layer": per_layer,
        "config": asdict(cfg) | {"ep_size": bundle.ep_size},
    }
    if cfg.per_request:
        report["per_request"] = {
            "request_id": acc.request_ids.tolist(),
            "tokens": acc.request_tokens,
            "local_balanced": acc.request_local.astype(np.int64).tolist(),
        }
    return report


def _nanmean(values) -> float | None:
    """Mean of the non-NaN values, None when there are none (no warning)."""
    values = np.asarray(values, dtype=np.float64)
    return _num(values[~np.isnan(values)].mean()) if (~np.isnan(values)).any() else None


def _num(x) -> float | None:
    x = float(x)
    return None if np.isnan(x) else round(x, 6)

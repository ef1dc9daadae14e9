"""Attention-DP inter-request scheduling: send each request to the DP rank it has most
affinity with, round by round so ranks stay balanced.

Sem-MoE §3.3 ("Data scheduling: Attention-DP") and App. B Algorithm 2. With data-parallel
attention each request runs on one DP rank, and that rank is also an EP device hosting
N/E experts. A request is scored per device by aggregating its tokens' entries in the
token -> device table (each token adds its table confidence to the device the table
names), then requests, in arrival order, go to their best-scoring device that is not yet
*masked*. A device is masked once it receives a request, and the mask is reset once every
device has one, so each round of ``dp_size`` consecutive requests covers every rank once
-- the load stays balanced in request count while affinity decides who goes where.

:func:`evaluate_schedule` measures, on a trace or a list of token-id sequences, what the
schedule gains over round-robin: the predicted affinity (share of the requests' table
score that lands on their rank), on a trace also the realised local activation rate (LAR,
DESIGN.md "Metrics", with every token of a request on its request's rank at every layer),
and the token balance it keeps (tokens per DP rank, max / mean).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal, cast

import numpy as np

from planner._checks import is_integer
from planner.errors import InputError, MismatchError
from planner.runtime_shim._data import require_data
from planner.trace.io import Trace, open_trace
from planner.trace.schema import layer_indices_mismatch

Weighting = Literal["confidence", "count"]
LayerSpec = int | Sequence[int] | None


def _np(x: Any, name: str = "a request") -> np.ndarray:
    """A tensor or array as numpy (tables may live on an accelerator)."""
    if hasattr(x, "detach"):
        require_data(x, name)
        return x.detach().cpu().numpy()
    return np.asarray(x)


def _request_ids(requests: Iterable[Any], name: str = "requests") -> list[np.ndarray]:
    """Each request as a 1-D array of token ids (a bare id is not a request: ``[0, 1, 2]``
    is three requests only if each is a sequence); ``name`` is the argument's in errors."""
    if not isinstance(requests, Iterable):
        raise InputError(
            f"{name} must be an iterable of token-id sequences, got {type(requests).__name__}"
        )
    out = []
    for i, r in enumerate(requests):
        try:
            ids = _np(r)
        except ValueError:
            ids = None  # a ragged nested list
        if ids is None or ids.ndim != 1:
            shape = "ragged" if ids is None else f"shape {ids.shape}"
            raise InputError(
                f"{name}[{i}] must be a 1-D sequence of token ids, got {shape}; pass a "
                "list of requests, one sequence each"
            )
        out.append(ids)
    return out


def _layers(tables: Any, layer: LayerSpec) -> list[int]:
    big_l = int(tables.num_layers)
    layers: list[Any]
    if layer is None:
        layers = list(range(big_l))
    elif is_integer(layer):
        layers = [layer]
    elif hasattr(layer, "tolist"):  # an array or tensor: its elements as Python numbers
        values = layer.tolist()
        layers = values if isinstance(values, list) else [values]
    else:
        try:
            layers = [] if isinstance(layer, str) else list(cast(Iterable[Any], layer))
        except TypeError:  # not iterable, or a 0-d array / tensor
            layers = []
    if not layers or any(not is_integer(i) or not 0 <= i < big_l for i in layers):
        raise InputError(f"layer={layer!r} must be MoE layer(s) in [0, {big_l}), or None for all")
    out = [int(i) for i in layers]
    seen: set[int] = set()
    for i in out:  # [1, 1] summed layer 1's table twice: the schedule weighted it double
        if i in seen:
            raise InputError(f"layer={layer!r} names MoE layer {i} twice; pass each layer once")
        seen.add(i)
    return out


# What scheduling reads of the tables (a Bundle has ep_size but not the rest: it was an
# AttributeError a step later)
_TABLE_FIELDS = (
    "ep_size", "num_layers", "num_experts", "vocab_size",
    "expert_to_device", "token_to_device", "token_confidence",
)  # fmt: skip


def _check_tables(tables: Any) -> None:
    if not all(hasattr(tables, name) for name in _TABLE_FIELDS):
        raise InputError(f"tables must be PlanTables (load_bundle), got {type(tables).__name__}")


def _check_dp(tables: Any, dp_size: int) -> int:
    """``dp_size`` as a Python int (a numpy integer too: the report is written as JSON)."""
    _check_tables(tables)
    if not is_integer(dp_size) or dp_size < 1:
        raise InputError(f"dp_size must be a positive integer, got {dp_size!r}")
    dp_size = int(dp_size)
    if dp_size != tables.ep_size:
        raise MismatchError(
            f"dp_size={dp_size} but the tables were planned for ep_size={tables.ep_size}; "
            "Attention-DP scheduling maps DP rank d to EP device d, so they must be equal"
        )
    return dp_size


class _TokenScorer:
    """Per-token device scores from the token table: [T] token ids -> [T, E] scores."""

    def __init__(self, tables: Any, layers: list[int], weighting: Weighting):
        if weighting not in ("confidence", "count"):
            raise InputError(f"weighting must be 'confidence' or 'count', got {weighting!r}")
        self.ep = int(tables.ep_size)
        self.vocab = int(tables.vocab_size)
        self.layers = np.asarray(layers, dtype=np.int64)
        # the tables as they are (a view of CPU tensors): only the rows a request uses are
        # gathered and widened, not all L x V entries on every call
        self.device = _np(tables.token_to_device, "tables.token_to_device")
        self.weight = (
            _np(tables.token_confidence, "tables.token_confidence")
            if weighting == "confidence"
            else None
        )

    def __call__(self, token_ids: np.ndarray) -> np.ndarray:
        ids = np.asarray(_np(token_ids))
        if ids.size and ids.dtype.kind not in "iu":
            raise InputError(f"token ids must be integers, got dtype {ids.dtype}")
        ids = ids.reshape(-1)
        if ids.size:  # checked before the cast: a uint64 >= 2**63 wrapped (2**64 - 1 to -1)
            lo, hi = int(ids.min()), int(ids.max())
            if hi >= self.vocab or lo < -1:
                bad = hi if hi >= self.vocab else lo
                raise InputError(f"token id {bad} outside [-1, {self.vocab}) (vocab_size)")
        ids = ids.astype(np.int64)
        known = ids >= 0  # -1: unknown token, scores nothing
        rows = np.flatnonzero(known)
        at = np.ix_(self.layers, ids[known])
        dev = self.device[at].astype(np.int64)  # [L', T']
        w = np.ones(dev.shape) if self.weight is None else self.weight[at].astype(np.float64)
        flat = (rows[None, :] * self.ep + dev).ravel()
        scores = np.bincount(flat, weights=w.ravel(), minlength=ids.size * self.ep)
        return scores.reshape(ids.size, self.ep)


def request_device_scores(
    requests: Iterable[Any], tables: Any, layer: LayerSpec = 0, weighting: Weighting = "confidence"
) -> np.ndarray:
    """Score every request for every device from its tokens.

    Args:
        requests: R sequences of token ids (arrays, lists or tensors; -1 = unknown).
        tables: PlanTables (``token_to_device`` [L, V], ``token_confidence`` [L, V], ``ep_size``).
        layer: MoE layer(s) whose token table is used, each at most once; None for all
            layers (summed).
        weighting: "confidence" (each token adds its table confidence) or "count" (adds 1).

    Returns:
        [R, E] float64: ``scores[r, d]`` = sum over the request's tokens t and the layers l
        of weight(l, t) * [token_to_device[l, t] == d].
    """
    _check_tables(tables)  # (None was an AttributeError)
    scorer = _TokenScorer(tables, _layers(tables, layer), weighting)
    rows = [scorer(r).sum(axis=0) for r in _request_ids(requests)]
    return np.stack(rows) if rows else np.zeros((0, scorer.ep))


def schedule_by_scores(scores: np.ndarray) -> np.ndarray:
    """Algorithm 2's masked greedy assignment.

    Args:
        scores: [R, E] request-device scores, rows in arrival order.

    Returns:
        [R] int64 device of each request: its best-scoring device not yet used in the
        current round (ties: lowest device id); a round ends when every device was used.
    """
    try:
        scores = np.asarray(_np(scores))
    except ValueError:  # ragged rows
        raise InputError(
            "scores must be an [R, E] array of real numbers (rows are ragged)"
        ) from None
    if scores.dtype.kind not in "iuf":
        raise InputError(f"scores must hold real numbers, got dtype {scores.dtype}")
    scores = scores.astype(np.float64)
    if scores.ndim != 2 or scores.shape[1] < 1:
        raise InputError(f"scores must be [R, E] with E >= 1, got shape {scores.shape}")
    if not np.isfinite(scores).all():
        raise InputError("scores must be finite")
    r, e = scores.shape
    out = np.empty(r, dtype=np.int64)
    free = np.ones(e, dtype=bool)
    for i in range(r):
        d = int(np.argmax(np.where(free, scores[i], -np.inf)))
        out[i] = d
        free[d] = False
        if not free.any():
            free[:] = True
    return out


def schedule_requests(
    requests: Iterable[Any],
    tables: Any,
    dp_size: int,
    layer: LayerSpec = 0,
    weighting: Weighting = "confidence",
) -> np.ndarray:
    """Assign requests to Attention-DP ranks (Sem-MoE Algorithm 2).

    Args:
        requests: R token-id sequences in arrival order.
        tables: PlanTables of a plan with ``ep_size == dp_size``.
        dp_size: number of DP ranks (= EP devices).
        layer: MoE layer(s) whose token table scores requests; None for all.
        weighting: see :func:`request_device_scores`.

    Returns:
        [R] int64 DP rank of each request.
    """
    _check_dp(tables, dp_size)
    return schedule_by_scores(request_device_scores(requests, tables, layer, weighting))


def round_robin(num_requests: int, dp_size: int) -> np.ndarray:
    """[R] int64: request i on rank i mod dp_size, the baseline."""
    return np.arange(num_requests, dtype=np.int64) % dp_size


@dataclass(frozen=True)
class ScheduleReport:
    """Affinity scheduling vs round-robin on one workload.

    Attributes:
        num_requests, num_tokens, dp_size: the workload and ranks.
        layers: MoE layers whose token table scored the requests.
        affinity / affinity_round_robin: share of the requests' table score on their
            assigned rank (1.0 = every scored token predicted local).
        lar / lar_round_robin: realised local activation rate over all (token, layer)
            pairs, from the trace's routed experts and ``expert_to_device``; None when the
            workload is token ids only.
        token_imbalance / token_imbalance_round_robin: tokens per rank, max / mean.
    """

    num_requests: int
    num_tokens: int
    dp_size: int
    layers: tuple[int, ...]
    affinity: float
    affinity_round_robin: float
    lar: float | None
    lar_round_robin: float | None
    token_imbalance: float
    token_imbalance_round_robin: float

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["layers"] = list(self.layers)
        return d


@dataclass
class _Workload:
    """Per-request totals the report needs: scores [R, E], tokens [R], local hits [R, E]."""

    scores: np.ndarray
    tokens: np.ndarray
    local_hits: np.ndarray | None  # routed activations whose expert lives on device d
    activations: int  # T * L * k over the trace, the LAR denominator


def _workload_from_sequences(source: Iterable[Any], scorer: _TokenScorer) -> _Workload:
    seqs = _request_ids(source, "source")  # evaluate_schedule's argument
    scores = np.stack([scorer(s).sum(axis=0) for s in seqs]) if seqs else np.zeros((0, scorer.ep))
    tokens = np.array([s.size for s in seqs], dtype=np.int64)
    return _Workload(scores, tokens, None, 0)


def _workload_from_trace(
    trace: Trace, tables: Any, scorer: _TokenScorer, batch_rows: int
) -> _Workload:
    meta = trace.meta
    if meta.num_layers != tables.num_layers or meta.num_experts != tables.num_experts:
        raise MismatchError(
            f"trace has L={meta.num_layers}, N={meta.num_experts} but the tables have "
            f"L={tables.num_layers}, N={tables.num_experts}"
        )
    manifest = getattr(tables, "manifest", None)
    planned = manifest.get("fingerprint") if isinstance(manifest, dict) else None
    if isinstance(planned, str) and planned != meta.fingerprint():
        raise MismatchError(
            f"the tables were planned for another model (fingerprint {planned}) than the "
            f"trace's {meta.model!r} (fingerprint {meta.fingerprint()}: name, L, N, k, V)"
        )
    # the fingerprint leaves the model layers out (TraceMeta.layer_mismatch); a bundle's
    # manifest records them
    layers = manifest.get("moe_layer_indices") if isinstance(manifest, dict) else None
    if isinstance(layers, list) and (
        differ := layer_indices_mismatch(
            layers, meta.moe_layer_indices, ("the tables", "the trace")
        )
    ):
        raise MismatchError(f"{differ}; use tables planned for this model")
    e = scorer.ep
    expert_to_device = _np(tables.expert_to_device, "tables.expert_to_device").astype(
        np.int64
    )  # [L, N]
    layer_idx = np.arange(meta.num_layers)[None, :, None]
    index_of: dict[int, int] = {}  # request id -> arrival index (first appearance)
    parts = []  # per batch: (arrival index [U], tokens [U], scores [U, E], hits [U, E])
    for batch in trace.iter_batches(batch_rows=batch_rows):
        uniq, first, inv = np.unique(batch.request_id, return_index=True, return_inverse=True)
        for j in np.argsort(first, kind="stable"):
            index_of.setdefault(int(uniq[j]), len(index_of))
        arrival = np.array([index_of[int(u)] for u in uniq], dtype=np.int64)
        t, u = len(batch), uniq.size
        dev = expert_to_device[layer_idx, batch.experts.astype(np.int64)]  # [T, L, k]
        row_hits = np.bincount((np.arange(t)[:, None, None] * e + dev).ravel(), minlength=t * e)
        row_scores = scorer(batch.token_id)  # [T, E]
        per_request = (inv[:, None] * e + np.arange(e)[None, :]).ravel()  # [T * E]
        req_scores = np.bincount(per_request, weights=row_scores.ravel(), minlength=u * e)
        req_hits = np.bincount(per_request, weights=row_hits, minlength=u * e)
        parts.append((arrival, np.bincount(inv, minlength=u), req_scores, req_hits))
    r = len(index_of)
    tokens, scores, hits = np.zeros(r, np.int64), np.zeros((r, e)), np.zeros((r, e))
    for arrival, n, s, h in parts:  # a request may span batches: add, not assign
        np.add.at(tokens, arrival, n)
        np.add.at(scores, arrival, s.reshape(-1, e))
        np.add.at(hits, arrival, h.reshape(-1, e))
    return _Workload(scores, tokens, hits, trace.num_rows * meta.num_layers * meta.top_k)


def _affinity(scores: np.ndarray, assign: np.ndarray) -> float:
    total = scores.sum()
    return float(scores[np.arange(assign.size), assign].sum() / total) if total > 0 else 0.0


def _imbalance(tokens: np.ndarray, assign: np.ndarray, dp_size: int) -> float:
    per_rank = np.bincount(assign, weights=tokens, minlength=dp_size)
    mean = per_rank.mean()
    return float(per_rank.max() / mean) if mean > 0 else 1.0


def evaluate_schedule(
    source: str | os.PathLike | Trace | Sequence[Any],
    tables: Any,
    dp_size: int,
    layer: LayerSpec = 0,
    weighting: Weighting = "confidence",
    batch_rows: int = 65536,
) -> ScheduleReport:
    """Compare :func:`schedule_requests` with round-robin on a workload.

    Args:
        source: a trace (path or opened :class:`Trace`; requests in order of first
            appearance) or a sequence of token-id sequences.
        tables, dp_size, layer, weighting: as for :func:`schedule_requests`.
        batch_rows: trace rows read at a time.

    Returns:
        A :class:`ScheduleReport`; ``lar`` fields only for a trace.
    """
    dp_size = _check_dp(tables, dp_size)
    if not is_integer(batch_rows) or batch_rows < 1:
        raise InputError(f"batch_rows must be a positive integer, got {batch_rows!r}")
    layers = _layers(tables, layer)
    scorer = _TokenScorer(tables, layers, weighting)
    if isinstance(source, str | os.PathLike):
        source = open_trace(source)
    if isinstance(source, Trace):
        work = _workload_from_trace(source, tables, scorer, batch_rows)
    elif isinstance(source, Iterable):
        work = _workload_from_sequences(source, scorer)
    else:  # None, an int: was named 'requests', an argument evaluate_schedule does not have
        raise InputError(
            "source must be a trace (a path or an opened Trace) or an iterable of token-id "
            f"sequences, got {type(source).__name__}"
        )
    assign = schedule_by_scores(work.scores)
    rr = round_robin(assign.size, dp_size)

    def lar(a: np.ndarray) -> float | None:
        if work.local_hits is None or work.activations == 0:
            return None
        return float(work.local_hits[np.arange(a.size), a].sum() / work.activations)

    return ScheduleReport(
        num_requests=int(assign.size),
        num_tokens=int(work.tokens.sum()),
        dp_size=dp_size,
        layers=tuple(layers),
        affinity=_affinity(work.scores, assign),
        affinity_round_robin=_affinity(work.scores, rr),
        lar=lar(assign),
        lar_round_robin=lar(rr),
        token_imbalance=_imbalance(work.tokens, assign, dp_size),
        token_imbalance_round_robin=_imbalance(work.tokens, rr, dp_size),
    )

"""Intra-layer token->expert affinity: the table predictor of Speculative MoE (paper 000, §3.3).

From the counts ``T[l][j, e]`` (routed activations of token j to expert e at MoE layer l)
the confidence table is ``Cp[l][j, e] = T[l][j, e] / sum_e T[l][j, e]`` (rows sum to 1;
``k * Cp`` is the share of j's occurrences that were routed to e) and the predicted set of a
token is its k most confident experts. Ties are broken by how often the expert was the
occurrence's rank-0 (highest gate weight) expert, then towards the layer's more popular
expert, then the lower id. The predicted top-1 expert is the token's most frequent rank-0
expert (counted separately, ``top1_counts_``; counts tables do not record it, and then the
first of the predicted set stands in).

Unseen tokens (absent from the fitting data, or ``token_id == -1``):

- with input embeddings ([V, d], e.g. the model's ``embed_tokens`` saved by ``moeplan
  profile --save-embeddings``), a token of the vocabulary borrows the row of the nearest
  known token by cosine similarity (paper 000 §3.3), computed once at fit time and kept as
  ``nearest_known_`` [V];
- without embeddings (and always for ``token_id == -1``), it gets the layer's globally
  most popular k experts, ``global_topk_``.

``expected_activations(layer)`` is the affinity matrix W the solvers use
(:mod:`planner.solve.problem`): ``W[j, e] = T[l][j, e]``, routed activations summed over the
token's occurrences, so ``sum_e W[j, e] = top_k * a_j`` with ``a_j = token_counts_[j]``.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import numpy as np
from scipy import sparse

from planner._checks import is_integer, is_real
from planner._safetensors import Chunked, joined
from planner.errors import InputError, MismatchError, SchemaError
from planner.predict.counts import MAX_TOTAL_COUNT, TokenExpertCounts, csr_index_dtype
from planner.trace.schema import TraceMeta

# Unseen tokens are matched to known ones in blocks of this many rows (bounds the
# [block, known] similarity matrix).
_NEAREST_BLOCK = 2048


@dataclass(frozen=True)
class _LayerTables:
    """Lookup tables of one layer, derived from the counts (cached, never saved).

    Attributes:
        topk: [V, k] int16 predicted set of every vocabulary token (fallbacks applied).
        top1: [V] int16 predicted rank-0 expert of every vocabulary token.
        pair_keys: [nnz] int64 sorted ``j * N + e`` of the nonzero counts.
        pair_counts: [nnz] int64 the counts at those keys.
        confident_size: [V] int32 experts with share >= threshold for each token row
            (of the row the token borrows when unseen).
        occurrences: [V] float64 the layer's occurrences of each token (row sum / k).
        global_share: [N] float64 routed activations per token occurrence of each expert.
    """

    topk: np.ndarray
    top1: np.ndarray
    pair_keys: np.ndarray
    pair_counts: np.ndarray
    confident_size: np.ndarray
    occurrences: np.ndarray
    global_share: np.ndarray
    global_confident_size: int


class TokenExpertAffinity:
    """Token->expert confidence table per MoE layer, with a nearest-token fallback.

    Follows the estimator contract: the constructor stores settings, :meth:`fit` learns
    (attributes ending in ``_``) and returns ``self``.

    Args:
        confident_threshold: a token's *confident set* holds the experts that received at
            least this share of its occurrences (``k * Cp >= threshold``); used to report
            precision and recall of a variable-size prediction beside the top-k one.

    Fitted attributes:
        meta_: model and shapes (L, N, k, V).
        counts_: L canonical CSR arrays [V, N] int64, ``T[l]``.
        top1_counts_: L CSR arrays [V, N] int64 counting rank-0 experts only, or None.
        token_counts_: [V] int64 occurrences ``a_j`` of each token in the fitting data
            (row sums / k, averaged over layers and rounded, at least 1 for a seen token;
            exact for traces).
        seen_: [V] bool, token has counts at some layer.
        global_topk_: [L, k] int16 the layer's most popular experts, most popular first
            (by every routed activation, the unknown tokens' too).
        global_top1_: [L] int16 the layer's most frequent rank-0 expert (the same).
        load_: [L, N] int64 routed activations of each expert by known tokens.
        unknown_load_, unknown_top1_load_: [L, N] int64 activations (all ranks, rank 0) of
            the fitting data's unknown tokens (id -1), which have no counts row; zero for
            counts tables. The layer's ranking of experts counts them (a trace mostly of
            unknown tokens had its fallback follow the few known ones).
        nearest_known_: [V] int32 row each token's prediction is read from: itself when
            seen, the nearest seen token by cosine similarity of embeddings when unseen and
            embeddings were given, -1 (global fallback) otherwise.
        fallback_: "embedding" or "global", what unseen tokens fall back to.
    """

    def __init__(self, *, confident_threshold: float = 0.5):
        self.confident_threshold = confident_threshold

    # -- fitting --------------------------------------------------------------------------

    def fit(
        self,
        counts: TokenExpertCounts,
        embeddings: np.ndarray | None = None,
        unknown_load: np.ndarray | None = None,
        unknown_top1_load: np.ndarray | None = None,
    ) -> TokenExpertAffinity:
        """Learn the tables from ``counts``; ``embeddings`` [V, d] enables the cosine
        fallback; ``unknown_load`` and ``unknown_top1_load`` [L, N]: the unknown tokens'
        activations (all ranks, rank 0), which count in the layer's ranking of experts."""
        threshold = self.confident_threshold
        if not is_real(threshold):
            raise InputError(f"confident_threshold={threshold!r} is not a number")
        if not 0.0 < float(threshold) <= 1.0:
            raise InputError(f"confident_threshold={self.confident_threshold!r} must lie in (0, 1]")
        self.confident_threshold = float(threshold)  # a numpy float does not go to JSON
        m = counts.meta
        self.meta_ = m
        self.counts_ = tuple(counts.by_layer)
        self.top1_counts_ = tuple(counts.top1_by_layer) if counts.top1_by_layer else None
        # [V] each token's activations summed over the layers, a layer at a time (the
        # [L, V] int64 stack of counts.token_activations() and its layers were 116 MiB at
        # Qwen3-30B's shape, the largest part of a short trace's fit). Counts are whole
        # and >= 0: seen anywhere = a positive sum, and the mean is exact in float64.
        total = np.zeros(m.vocab_size, np.int64)
        for mat in counts.by_layer:
            total += np.asarray(mat.sum(axis=1)).ravel().astype(np.int64, copy=False)
        self.seen_ = cast(np.ndarray, total > 0)
        # Counts tables may count each layer on other samples (thinned counts: a token seen
        # once has about half an occurrence a layer), where rounding the mean gives 0: a
        # seen token still occurs, and a solver must not read it as weighing nothing.
        occurrences = np.rint(total / m.num_layers / m.top_k).astype(np.int64)
        self.token_counts_ = np.where(self.seen_, np.maximum(occurrences, 1), 0)
        self.load_ = counts.load()
        self.unknown_load_ = _layer_loads(unknown_load, m, "unknown_load")
        self.unknown_top1_load_ = _layer_loads(unknown_top1_load, m, "unknown_top1_load")
        self.global_topk_ = np.stack(
            [_rank_experts(load)[: m.top_k] for load in self.rank_load]
        ).astype(np.int16)
        if self.top1_counts_ is not None:
            top1_load = np.stack([np.asarray(c.sum(axis=0)).ravel() for c in self.top1_counts_])
            top1_load = top1_load + self.unknown_top1_load_
            self.global_top1_ = np.array([_rank_experts(x)[0] for x in top1_load], np.int16)
        else:
            self.global_top1_ = self.global_topk_[:, 0].copy()
        if embeddings is not None:
            check_embeddings(embeddings, m.vocab_size)
            self.nearest_known_ = nearest_known_tokens(embeddings, self.seen_)
            self.fallback_ = "embedding"
        else:
            self.nearest_known_ = np.where(self.seen_, np.arange(m.vocab_size), -1).astype(np.int32)
            self.fallback_ = "global"
        self._tables: dict[int, _LayerTables] = {}
        return self

    @property
    def rank_load(self) -> np.ndarray:
        """[L, N] every routed activation of each expert (known and unknown tokens'): what
        the layer's ranking of experts follows."""
        return self.load_ + self.unknown_load_

    @classmethod
    def from_fitted(
        cls,
        meta: TraceMeta,
        counts: tuple[sparse.csr_array, ...],
        top1_counts: tuple[sparse.csr_array, ...] | None,
        nearest_known: np.ndarray,
        fallback: str,
        confident_threshold: float,
        unknown_load: np.ndarray | None = None,
        unknown_top1_load: np.ndarray | None = None,
    ) -> TokenExpertAffinity:
        """Rebuild a fitted table from saved state (see :meth:`to_tensors`)."""
        fitted = TokenExpertCounts(meta, counts, top1_by_layer=top1_counts)
        self = cls(confident_threshold=confident_threshold).fit(
            fitted, unknown_load=unknown_load, unknown_top1_load=unknown_top1_load
        )
        nearest_known = np.asarray(nearest_known, np.int32)
        if nearest_known.shape != (meta.vocab_size,):
            raise SchemaError(
                f"nearest_known has shape {nearest_known.shape}, expected ({meta.vocab_size},)"
            )
        if nearest_known.min(initial=-1) < -1 or nearest_known.max(initial=-1) >= meta.vocab_size:
            raise SchemaError(f"nearest_known holds ids outside [-1, {meta.vocab_size})")
        seen = self.seen_
        bad = (nearest_known >= 0) & ~seen[np.maximum(nearest_known, 0)]
        if bad.any() or (nearest_known[seen] != np.flatnonzero(seen)).any():
            raise SchemaError(
                "nearest_known must map seen tokens to themselves, others to seen ones"
            )
        if fallback not in ("embedding", "global"):
            raise SchemaError(f"affinity fallback {fallback!r} is not 'embedding' or 'global'")
        self.nearest_known_ = nearest_known
        self.fallback_ = fallback
        return self

    def without_embedding_fallback(self) -> TokenExpertAffinity:
        """A copy whose unseen tokens use the global fallback (to measure what embeddings add)."""
        self._check_fitted()
        other = TokenExpertAffinity(confident_threshold=self.confident_threshold)
        other.__dict__.update({k: v for k, v in self.__dict__.items() if k != "_tables"})
        other.nearest_known_ = np.where(self.seen_, np.arange(self.meta_.vocab_size), -1).astype(
            np.int32
        )
        other.fallback_ = "global"
        other._tables = {}
        return other

    def _check_fitted(self) -> None:
        if not hasattr(self, "counts_"):
            raise InputError("TokenExpertAffinity is not fitted; call fit() first")

    def _check_layer(self, layer: int) -> None:
        self._check_fitted()
        if not is_integer(layer) or not 0 <= layer < self.meta_.num_layers:
            raise InputError(f"layer {layer!r} outside [0, {self.meta_.num_layers})")

    # -- queries ---------------------------------------------------------------------------

    def confidence(self, layer: int) -> sparse.csr_array:
        """Cp [V, N] float64: ``Pr(expert | token)`` at ``layer``; rows of unseen tokens are empty."""
        self._check_layer(layer)
        t = self.counts_[layer]
        rows = np.asarray(t.sum(axis=1)).ravel().astype(np.float64)
        scale = np.divide(1.0, rows, out=np.zeros_like(rows), where=rows > 0)
        return sparse.csr_array(sparse.diags_array(scale) @ t.astype(np.float64))

    def expected_activations(self, layer: int) -> sparse.csr_array:
        """W [V, N] float64: routed activations of expert e by token j over its occurrences.

        ``W[j, e] = T[l][j, e]``, so ``W.sum(axis=1) == top_k * token_counts_``; it is the
        ``affinity`` of :class:`planner.solve.problem.LayerProblem` (restrict it to
        ``seen_`` rows for a compact problem).
        """
        self._check_layer(layer)
        return sparse.csr_array(self.counts_[layer].astype(np.float64))

    def layer_problem_inputs(self, layer: int) -> tuple[np.ndarray, sparse.csr_array, np.ndarray]:
        """(token_ids [J], W [J, N] float64, a [J] float64) over the J tokens seen in fitting.

        The compact inputs of :class:`planner.solve.problem.LayerProblem` (``token_ids``,
        ``affinity``, ``token_freq``); unseen tokens are placed later from
        ``nearest_known_``.
        """
        self._check_layer(layer)
        ids = np.flatnonzero(self.seen_)
        return (
            ids,
            sparse.csr_array(self.counts_[layer][ids].astype(np.float64)),
            self.token_counts_[ids].astype(np.float64),
        )

    def token_frequency(self) -> np.ndarray:
        """a [V] float64 occurrences of each token in the fitting data."""
        self._check_fitted()
        return self.token_counts_.astype(np.float64)

    def _token_ids(self, token_ids: np.ndarray) -> np.ndarray:
        return token_id_array(token_ids, self.meta_.vocab_size)

    def source_rows(self, token_ids: np.ndarray) -> np.ndarray:
        """[T] int64 counts row each token's prediction is read from (-1 = global fallback)."""
        self._check_fitted()
        ids = self._token_ids(token_ids)
        return np.where(ids >= 0, self.nearest_known_[np.maximum(ids, 0)], -1).astype(np.int64)

    def predict_topk(self, token_ids: np.ndarray, layer: int) -> np.ndarray:
        """[T, k] int16 predicted experts of ``token_ids`` [T] at ``layer``, most confident first."""
        self._check_layer(layer)
        ids = self._token_ids(token_ids)
        out = self.layer_tables(layer).topk[np.maximum(ids, 0)]
        out[ids < 0] = self.global_topk_[layer]
        return out

    def predict_top1(self, token_ids: np.ndarray, layer: int) -> np.ndarray:
        """[T] int16 predicted rank-0 expert of ``token_ids`` [T] at ``layer``."""
        self._check_layer(layer)
        ids = self._token_ids(token_ids)
        t = self.layer_tables(layer)
        return np.where(ids >= 0, t.top1[np.maximum(ids, 0)], self.global_top1_[layer]).astype(
            np.int16
        )

    def topk_table(self, layer: int) -> np.ndarray:
        """[V, k] int16 predicted set of every vocabulary token at ``layer`` (fallbacks applied)."""
        self._check_layer(layer)
        return self.layer_tables(layer).topk

    def routed_share(self, token_ids: np.ndarray, experts: np.ndarray, layer: int) -> np.ndarray:
        """[T, k] float64 share of the predicting row's occurrences routed to ``experts`` [T, k].

        For a seen token it is ``k * Cp[j, e]``; unseen tokens read their fallback row
        (nearest known token, or the layer-wide share ``load / occurrences``).
        """
        self._check_layer(layer)
        t = self.layer_tables(layer)
        rows = self.source_rows(token_ids)
        n = self.meta_.num_experts
        e = np.asarray(experts, np.int64)
        if e.size and (e.min() < 0 or e.max() >= n):  # a key past n is another token's
            raise InputError(f"expert ids must lie in [0, {n}), got {int(e.min())}-{int(e.max())}")
        keys = np.maximum(rows, 0)[:, None] * n + e
        counts = np.zeros(keys.shape, np.int64)
        if t.pair_keys.shape[0]:
            pos = np.minimum(np.searchsorted(t.pair_keys, keys), t.pair_keys.shape[0] - 1)
            found = t.pair_keys[pos] == keys
            counts[found] = t.pair_counts[pos[found]]
        occ = t.occurrences[np.maximum(rows, 0)]
        share = np.divide(counts, occ[:, None], out=np.zeros(keys.shape), where=occ[:, None] > 0)
        # at most 1: a counts table's thinned row may count an expert more often than the
        # layer's occurrences estimated from it (exact, and so never above 1, for a trace)
        np.minimum(share, 1.0, out=share)
        glob = rows < 0
        share[glob] = t.global_share[e[glob]]
        return share

    def confident_size(self, token_ids: np.ndarray, layer: int) -> np.ndarray:
        """[T] int32 size of each token's confident set at ``layer`` (see ``confident_threshold``)."""
        self._check_layer(layer)
        t = self.layer_tables(layer)
        rows = self.source_rows(token_ids)
        return np.where(
            rows >= 0, t.confident_size[np.maximum(rows, 0)], t.global_confident_size
        ).astype(np.int32)

    # -- derived tables ----------------------------------------------------------------------

    def drop_tables(self) -> None:
        """Forget the derived lookup tables (about as large as the counts); each layer's
        are built again on its next use."""
        self._tables.clear()

    def layer_tables(self, layer: int) -> _LayerTables:
        """The lookup tables of ``layer``, built on first use."""
        self._check_layer(layer)
        if layer not in self._tables:
            self._tables[layer] = self._build_tables(layer)
        return self._tables[layer]

    def _build_tables(self, layer: int) -> _LayerTables:
        m = self.meta_
        v, n, k = m.vocab_size, m.num_experts, m.top_k
        t = self.counts_[layer]
        load = self.load_[layer]
        ranked = _rank_experts(self.rank_load[layer])
        rank_of_expert = np.empty(n, np.int64)
        rank_of_expert[ranked] = np.arange(n)

        rows = np.repeat(np.arange(v, dtype=np.int64), np.diff(t.indptr))
        cols = t.indices.astype(np.int64)
        data = t.data
        pair_keys = rows * n + cols
        rank0 = np.zeros_like(data)
        if self.top1_counts_ is not None:
            rank0 = _values_at(self.top1_counts_[layer], pair_keys, n)
        # Within each row: larger count first, then more often rank 0, then more popular.
        order = np.lexsort((rank_of_expert[cols], -rank0, -data, rows))
        rows_s, cols_s = rows[order], cols[order]
        slot = np.arange(rows_s.shape[0]) - t.indptr[rows_s]
        keep = slot < k
        own = np.full((v, k), -1, np.int64)
        own[rows_s[keep], slot[keep]] = cols_s[keep]
        own = _fill_from_global(own, ranked, self.seen_)
        # Rank-0 prediction: the most frequent rank-0 expert, else the set's first.
        own_top1 = own[:, 0].copy()
        if self.top1_counts_ is not None:
            t1 = self.top1_counts_[layer]
            r1 = np.repeat(np.arange(v, dtype=np.int64), np.diff(t1.indptr))
            o1 = np.lexsort((rank_of_expert[t1.indices], -t1.data, r1))
            first = np.ones(o1.shape[0], bool)
            first[1:] = r1[o1][1:] != r1[o1][:-1]
            own_top1[r1[o1][first]] = t1.indices[o1][first]
        src = np.maximum(self.nearest_known_, 0)
        fallback = self.nearest_known_ < 0
        topk, top1 = own[src], own_top1[src]
        topk[fallback] = self.global_topk_[layer]
        top1[fallback] = self.global_top1_[layer]

        # the layer's own occurrences (row sum / k): a_j for a trace, and the right base for
        # counts tables that count each layer on other samples
        occ = np.bincount(rows, weights=data, minlength=v) / k
        share = data / np.maximum(occ[rows], 1e-300)
        confident = rows[share >= self.confident_threshold]
        # the fallback's share follows every routed activation, the unknown tokens' too, as
        # the fallback's ranking of experts does (each unknown occurrence routes k)
        unknown = self.unknown_load_[layer]
        global_share = (load + unknown) / max(float(occ.sum() + unknown.sum() / k), 1.0)
        return _LayerTables(
            topk=topk.astype(np.int16),
            top1=top1.astype(np.int16),
            pair_keys=pair_keys,
            pair_counts=data.astype(np.int64, copy=False),  # the counts' own array
            confident_size=np.bincount(confident, minlength=v).astype(np.int32),
            occurrences=occ,
            global_share=global_share,
            global_confident_size=int((global_share >= self.confident_threshold).sum()),
        )

    # -- persistence -------------------------------------------------------------------------

    def to_tensors(self) -> dict[str, np.ndarray]:
        """Fitted state as named arrays (for safetensors); inverse of :meth:`from_tensors`.

        ``indptr`` [L, V+1], ``indices`` [nnz] int16 and ``data`` [nnz] hold the L CSR
        count arrays end to end (``indptr`` and ``data`` int32 where their values fit it,
        else int64; any integer dtype is read back); ``top1_*`` the same for rank-0 counts (when
        known); ``nearest_known`` [V] int32.
        """
        return {name: joined(t) for name, t in self.file_tensors().items()}

    def file_tensors(self) -> dict[str, np.ndarray | Chunked]:
        """:meth:`to_tensors` with ``indices`` and ``data`` left as their layers' arrays
        (:class:`Chunked`): the largest arrays of a predictor, written end to end by
        :func:`planner._safetensors.save_tensors` without joining them in memory."""
        self._check_fitted()
        out = _pack_csr(self.counts_, "")
        if self.top1_counts_ is not None:
            out |= _pack_csr(self.top1_counts_, "top1_")
        out["nearest_known"] = self.nearest_known_.astype(np.int32)
        if self.unknown_load_.any():  # (written only where there were unknown tokens)
            out["unknown_load"] = self.unknown_load_
            out["unknown_top1_load"] = self.unknown_top1_load_
        return out

    @classmethod
    def from_tensors(
        cls,
        meta: TraceMeta,
        tensors: dict[str, np.ndarray],
        *,
        fallback: str,
        confident_threshold: float,
    ) -> TokenExpertAffinity:
        if "nearest_known" not in tensors:
            raise SchemaError("affinity tensors lack 'nearest_known'")
        if tensors["nearest_known"].dtype.kind not in "iu":
            raise SchemaError(
                f"affinity nearest_known holds {tensors['nearest_known'].dtype}, expected integers"
            )
        counts = _unpack_csr(tensors, "", meta)
        top1 = _unpack_csr(tensors, "top1_", meta) if "top1_indptr" in tensors else None
        return cls.from_fitted(
            meta, counts, top1, tensors["nearest_known"], fallback, confident_threshold,
            unknown_load=tensors.get("unknown_load"),
            unknown_top1_load=tensors.get("unknown_top1_load"),
        )  # fmt: skip


def _layer_loads(loads: np.ndarray | None, meta: TraceMeta, name: str) -> np.ndarray:
    """``loads`` as [L, N] int64 of non-negative counts (zeros for None), else SchemaError."""
    shape = (meta.num_layers, meta.num_experts)
    if loads is None:
        return np.zeros(shape, np.int64)
    arr = np.asarray(loads)
    if arr.shape != shape or arr.dtype.kind not in "iu" or (arr < 0).any():
        raise SchemaError(
            f"affinity {name} must be [L, N] = {list(shape)} non-negative integers, got "
            f"{arr.dtype} {list(arr.shape)}"
        )
    return arr.astype(np.int64)


def token_id_array(token_ids, vocab_size: int) -> np.ndarray:
    """``token_ids`` as int64, each in [-1, vocab_size) (-1: unknown), else InputError."""
    given = np.asarray(token_ids)
    # a float id was truncated (1.7 read token 1), a uint64 past int64 wrapped to -1
    if given.size and (given.dtype.kind not in "iu" or given.max() > np.iinfo(np.int64).max):
        raise InputError(f"token ids must be integers in [-1, {vocab_size})")
    ids = given.astype(np.int64)
    bad = (ids < -1) | (ids >= vocab_size)
    if bad.any():
        raise InputError(f"token id {int(ids[bad][0])} outside [-1, {vocab_size})")
    return ids


def _values_at(mat: sparse.csr_array, keys: np.ndarray, n: int) -> np.ndarray:
    """Values of canonical ``mat`` [V, N] at flat ``keys`` = row * N + col (0 where absent)."""
    mk = np.repeat(np.arange(mat.shape[0], dtype=np.int64), np.diff(mat.indptr)) * n + mat.indices
    out = np.zeros(keys.shape, np.int64)
    if mk.size:
        pos = np.minimum(np.searchsorted(mk, keys), mk.size - 1)
        hit = mk[pos] == keys
        out[hit] = mat.data[pos[hit]]
    return out


def _smallest_int(most: int) -> type:
    """int32 where every value up to ``most`` fits it, else int64."""
    return np.int32 if most <= np.iinfo(np.int32).max else np.int64


def _pack_csr(mats: tuple[sparse.csr_array, ...], prefix: str) -> dict[str, np.ndarray | Chunked]:
    # indptr is [L, V+1] whatever the data: int64 made it most of a predictor fitted on a
    # short trace of a large vocabulary (GPT-OSS-shaped, 36 layers x 201k ids, two of them:
    # 116 MB of 202). int32 where the offsets and counts fit; any integer dtype reads back.
    offsets = np.cumsum([0] + [c.nnz for c in mats])
    most = max((int(c.data.max()) for c in mats if c.nnz), default=0)
    # written layer by layer into the final dtype (an int64 copy of every layer, their
    # stack and its cast were 145 MiB at Qwen3-30B's shape, the save's peak)
    indptr = np.empty((len(mats), mats[0].indptr.shape[0]), _smallest_int(int(offsets[-1])))
    for row, c, o in zip(indptr, mats, offsets, strict=False):
        # int64 sums (numpy 1.x would add an int32 indptr and the offset in int32 and wrap)
        np.add(c.indptr, o, out=row, dtype=np.int64, casting="unsafe")
    out: dict[str, np.ndarray | Chunked] = {f"{prefix}indptr": indptr}
    for name, dtype in (("indices", np.int16), ("data", _smallest_int(most))):
        # one layer cast at a time (a copy only where its dtype differs)
        def parts(name: str = name, dtype: type = dtype) -> Iterator[np.ndarray]:
            return (getattr(c, name).astype(dtype, copy=False) for c in mats)

        out[prefix + name] = Chunked(np.dtype(dtype), (int(offsets[-1]),), parts)
    return out


def _unpack_csr(
    tensors: dict[str, np.ndarray], prefix: str, meta: TraceMeta
) -> tuple[sparse.csr_array, ...]:
    v, n, big_l = meta.vocab_size, meta.num_experts, meta.num_layers
    try:
        indptr, indices, data = (tensors[f"{prefix}{x}"] for x in ("indptr", "indices", "data"))
    except KeyError as e:
        raise SchemaError(f"affinity tensors lack {e.args[0]!r}") from None
    for name, arr in (("indptr", indptr), ("indices", indices), ("data", data)):
        if arr.dtype.kind not in "iu":
            raise SchemaError(f"affinity {prefix}{name} holds {arr.dtype}, expected integers")
    if indptr.shape != (big_l, v + 1):
        raise SchemaError(
            f"affinity {prefix}indptr has shape {indptr.shape}, expected ({big_l}, {v + 1})"
        )
    if indices.shape != data.shape or indices.ndim != 1:
        raise SchemaError(f"affinity {prefix}indices and {prefix}data must be 1-D of equal length")
    if (
        int(indptr[0, 0]) != 0
        or int(indptr[-1, -1]) != indices.shape[0]
        or (np.diff(indptr, axis=1) < 0).any()
    ):
        raise SchemaError(f"affinity {prefix}indptr is inconsistent with its indices")
    if indices.size and (int(indices.min()) < 0 or int(indices.max()) >= n):
        raise SchemaError(f"affinity {prefix}indices hold expert ids outside [0, {n})")
    if data.size and int(data.min()) <= 0:
        raise SchemaError(f"affinity {prefix}data must hold positive counts")
    if float(data.sum(dtype=np.float64)) >= MAX_TOTAL_COUNT:
        raise SchemaError(
            f"affinity {prefix}data sum to more than 2**62 (int64 sums would overflow)"
        )
    mats = []
    index = csr_index_dtype(v, n)  # as the fit builds them
    for layer in range(big_l):
        lo, hi = int(indptr[layer, 0]), int(indptr[layer, -1])
        mat = sparse.csr_array(
            (
                data[lo:hi].astype(np.int64, copy=False),
                indices[lo:hi].astype(index),
                (indptr[layer] - lo).astype(index),
            ),
            shape=(v, n),
        )
        if not mat.has_sorted_indices:
            raise SchemaError(f"affinity {prefix}layer {layer}: expert ids not sorted within rows")
        mats.append(mat)
    return tuple(mats)


def _rank_experts(load: np.ndarray) -> np.ndarray:
    """[N] expert ids by decreasing load, ties to the lower id."""
    return np.lexsort((np.arange(load.shape[0]), -np.asarray(load)))


def _fill_from_global(own: np.ndarray, global_order: np.ndarray, seen: np.ndarray) -> np.ndarray:
    """Complete seen rows of ``own`` [V, k] (left-packed, -1 = empty slot) in place.

    A seen row shorter than k happens only for thinned counts (or a layer where the
    token has no counts); it is completed with the layer's most popular experts not
    already in it (``global_order`` [N], most popular first). Unseen rows stay -1.
    """
    short = np.flatnonzero(seen & (own < 0).any(axis=1))
    if short.size == 0:
        return own
    k, n = own.shape[1], global_order.shape[0]
    rank = np.empty(n, np.int64)
    rank[global_order] = np.arange(n)
    sub = own[short]
    have = sub >= 0
    taken = np.zeros((short.size, n), bool)
    r, c = np.nonzero(have)
    taken[r, rank[sub[r, c]]] = True
    free = ~taken
    position = np.cumsum(free, axis=1)  # 1-based position among the row's free ranks
    need = k - have.sum(axis=1)
    pr, pc = np.nonzero(free & (position <= need[:, None]))
    sub[pr, have.sum(axis=1)[pr] + position[pr, pc] - 1] = global_order[pc]
    own[short] = sub
    return own


# ---------------------------------------------------------------------------------------
# Embeddings.


def check_embeddings(embeddings: np.ndarray, vocab_size: int, where: str = "embeddings") -> None:
    """Raise :class:`InputError` unless ``embeddings`` is a finite [V, d] float matrix."""
    _check_embeddings_shape(
        tuple(embeddings.shape), np.issubdtype(embeddings.dtype, np.floating),
        str(embeddings.dtype), vocab_size, where,
    )  # fmt: skip
    # in float32, as they are used; in blocks, so a memory-mapped file is not read whole
    for start in range(0, vocab_size, _NEAREST_BLOCK):
        with np.errstate(over="ignore"):
            block = np.asarray(embeddings[start : start + _NEAREST_BLOCK], np.float32)
        bad = ~np.isfinite(block).all(axis=1)
        if bad.any():
            raise InputError(
                f"{where}: row {start + int(np.argmax(bad))} holds a NaN or infinite value "
                "(in float32); nearest-token search needs finite embeddings"
            )


def _check_embeddings_shape(
    shape: tuple, floating: bool, dtype: str, vocab_size: int, where: str
) -> None:
    """The checks of :func:`check_embeddings` that need no values: from an array, or from a
    file's header (:func:`load_embeddings` with ``header_only``)."""
    if len(shape) != 2 or shape[0] != vocab_size:
        raise InputError(
            f"{where}: shape {tuple(shape)} disagrees with the vocabulary; "
            f"expected ({vocab_size}, d) rows for vocab_size={vocab_size}"
        )
    if not floating:
        raise InputError(f"{where}: dtype {dtype} is not floating point")
    if shape[1] == 0:
        raise InputError(f"{where}: the embeddings have no columns (shape {tuple(shape)})")


def load_embeddings(
    path: str | Path, vocab_size: int, fingerprint: str | None = None, *, header_only: bool = False
) -> np.ndarray | None:
    """Input embeddings [V, d] float32 from a ``.npy`` file or a ``.safetensors`` file.

    In a safetensors file with several tensors, the one whose name contains ``embed`` and
    which has V rows is used (``model.embed_tokens.weight``, ``embeddings``, ...); bfloat16
    (a model checkpoint's usual dtype) is read through torch. With ``fingerprint`` (the
    trace's model fingerprint), a file that records another model's fingerprint in its
    metadata (``moeplan profile --save-embeddings`` writes one) is refused. ``header_only``
    checks the file, the tensor's shape and dtype and the fingerprint without reading the
    values (finiteness is not checked) and returns None: ``moeplan fit`` refuses a wrong
    file before its pass over the trace, and holds the matrix in memory only after it.
    """
    path = Path(path)
    if not path.is_file():
        raise InputError(f"{path}: no such embeddings file")
    if path.suffix == ".npy":
        try:
            emb = np.load(path, mmap_mode="r", allow_pickle=False)
        except (ValueError, EOFError) as e:  # EOFError: an empty file
            raise InputError(f"{path}: not a .npy array ({e})") from None
        if not isinstance(emb, np.ndarray):  # np.load reads a zip archive whatever its name
            emb.close()
            raise InputError(f"{path}: is an .npz archive, not a .npy array; save one array")
        if header_only:
            _check_embeddings_shape(
                emb.shape, np.issubdtype(emb.dtype, np.floating), str(emb.dtype), vocab_size,
                str(path),
            )  # fmt: skip
            return None
    elif path.suffix == ".safetensors":
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(str(path), framework="numpy") as f:
                names = list(f.keys())
                shapes = {name: f.get_slice(name).get_shape() for name in names}
                candidates = [n for n in names if len(shapes[n]) == 2]
                if len(candidates) > 1:
                    candidates = [n for n in candidates if "embed" in n.lower()] or candidates
                    candidates = [n for n in candidates if shapes[n][0] == vocab_size] or candidates
                if len(candidates) != 1:
                    raise InputError(
                        f"{path}: cannot tell which tensor holds the input embeddings "
                        f"(2-D tensors: {', '.join(n for n in names if len(shapes[n]) == 2) or 'none'})"
                    )
                recorded = (f.metadata() or {}).get("fingerprint")
                if fingerprint is not None and recorded is not None and recorded != fingerprint:
                    model = (f.metadata() or {}).get("model")
                    raise MismatchError(
                        f"{path}: embeddings of model {model!r} (fingerprint {recorded}), not "
                        f"of the trace's model (fingerprint {fingerprint})"
                    )
                if header_only:
                    dtype = f.get_slice(candidates[0]).get_dtype()  # "F32", "BF16", "I64", ...
                    _check_embeddings_shape(
                        tuple(shapes[candidates[0]]), dtype.startswith(("F", "BF")), dtype,
                        vocab_size, str(path),
                    )  # fmt: skip
                    return None
                try:
                    emb = f.get_tensor(candidates[0])
                except (TypeError, AttributeError):  # a dtype numpy lacks, e.g. bfloat16
                    emb = _float32_through_torch(path, candidates[0])
        except SafetensorError as e:
            raise InputError(f"{path}: not a safetensors file ({e})") from None
    else:
        raise InputError(f"{path}: embeddings must be a .npy or .safetensors file")
    check_embeddings(emb, vocab_size, where=str(path))
    return np.asarray(emb, np.float32)


def _float32_through_torch(path: Path, name: str) -> np.ndarray:
    """Tensor ``name`` of a safetensors file as float32, read by torch (bfloat16 and the like)."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            tensor = f.get_tensor(name)
        if not tensor.is_floating_point():
            raise InputError(f"{path}: dtype {tensor.dtype} is not floating point")
        return tensor.float().numpy()
    except (ImportError, TypeError, RuntimeError) as e:
        raise InputError(f"{path}: tensor {name!r} cannot be read as floats ({e})") from None


def nearest_known_tokens(embeddings: np.ndarray, seen: np.ndarray) -> np.ndarray:
    """[V] int32: each seen token itself; each unseen token its nearest seen token by cosine.

    Tokens whose embedding is all zeros (or no seen token exists) get -1.
    Cost: (unseen x seen x d) multiply-adds, in blocks of rows.
    """
    v = embeddings.shape[0]
    out = np.where(seen, np.arange(v), -1).astype(np.int32)
    known = np.flatnonzero(seen)
    unseen = np.flatnonzero(~seen)
    if known.size == 0 or unseen.size == 0:
        return out
    # Norms in float64, a block of rows at a time: squares of float32 values beyond ~1e19
    # overflow float32 (the norm became inf and every unit vector 0, a silent wrong match).
    norms = np.concatenate([
        np.linalg.norm(np.asarray(embeddings[s : s + _NEAREST_BLOCK], np.float64), axis=1)
        for s in range(0, v, _NEAREST_BLOCK)
    ])  # fmt: skip

    # Both sides scaled to unit length in float64 (a known row below a fixed floor was not
    # scaled up, and a query of subnormal values made every product 0), then compared in
    # float32.
    def unit(rows: np.ndarray) -> np.ndarray:
        scale = np.where(norms[rows] > 0, norms[rows], 1.0)[:, None]
        return (np.asarray(embeddings[rows], np.float64) / scale).astype(np.float32)

    unit_known = np.concatenate([
        unit(rows) for rows in np.array_split(known, max(1, -(-known.size // _NEAREST_BLOCK)))
    ])  # fmt: skip
    valid_known = norms[known] > 0
    for start in range(0, unseen.size, _NEAREST_BLOCK):
        block = unseen[start : start + _NEAREST_BLOCK]
        sims = unit(block) @ unit_known.T
        sims[:, ~valid_known] = -np.inf
        best = np.argmax(sims, axis=1)
        ok = (norms[block] > 0) & valid_known.any()
        out[block[ok]] = known[best[ok]]
    return out

"""Which tokens came together: the token mix of the fitting trace's runtime batches.

At serving time every batch of B tokens (4096 in DESIGN.md's bounded-imbalance metric) is
capped per device, the most confident tokens keeping their device. A plan balanced over the
whole fitting trace can still overload the same device in every batch when batches are not
a random mix of the traffic, e.g. a trace profiled prompt file by prompt file, one domain
after another: each domain's tokens crowd onto the devices of its experts and the cap sends
the overflow elsewhere. The fit therefore records the fitting rows in trace order, cut into
batches of B tokens, as a sparse [G, V] count matrix; a solver can charge a placement for
the activations the runtime cap would take back on these batches
(:func:`planner.solve.common.batch_overflow`).

Long traces keep at most ``MAX_BATCHES`` batches, evenly spaced over the trace (a stride
that doubles whenever twice that many are held), so memory stays bounded.

Trace order is how the fitting traffic was served only if it was recorded as served. A
trace profiled from a prompt file one domain after another serves each domain in batches of
its own, while a serving engine batching many users' requests together mixes them; a plan
fitted on the first kind of batch and served the second gave up 1.7% of its balanced LAR
on average, up to 4.4%, on the example (CEO, 18 cases by request; ``benchmarks/RESULTS.md``,
session 56). :class:`MixedBatchAccumulator` (``moeplan fit
--mixed-batches``) records the batches the fitting requests would make in a random order
instead (drawn with the fit's seed), each request's rows kept together in trace order.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy import sparse

from planner.errors import InputError, SchemaError

BATCH_TOKENS = 4096  # DESIGN.md: the runtime batch of the bounded-imbalance metric
MAX_BATCHES = 64
# batch_spread: full batches a spread needs, and how much more the trace order's batches must
# spread than a random order's before `moeplan fit` says so (the example's trace: 1.72, its
# held-out half 1.68; a random order against another random order: about 1)
MIN_SPREAD_BATCHES = 4
ORDER_NOTE_RATIO = 1.25


@dataclass(frozen=True)
class BatchMix:
    """Token counts per fitting batch.

    Attributes:
        counts: [G, V] sparse int64, occurrences of each token in each kept batch.
        batch_tokens: B, the trace rows per batch (the last batch may be shorter).
        stride: every ``stride``-th batch of the trace was kept.
    """

    counts: sparse.csr_array
    batch_tokens: int
    stride: int = 1

    @property
    def num_batches(self) -> int:
        return int(self.counts.shape[0])

    def token_batch_freq(self, token_ids: np.ndarray) -> sparse.csr_array:
        """[J, G] float64 occurrences of tokens ``token_ids`` [J] in each kept batch."""
        ids = np.asarray(token_ids, dtype=np.int64)
        return sparse.csr_array(self.counts.T.tocsr()[ids].astype(np.float64))

    def to_tensors(self) -> dict[str, np.ndarray]:
        c = self.counts
        return {
            "indptr": c.indptr.astype(np.int64),
            "indices": c.indices.astype(np.int64),
            "data": c.data.astype(np.int64),
            "shape": np.array(c.shape, np.int64),
            "settings": np.array([self.batch_tokens, self.stride], np.int64),
        }

    @classmethod
    def from_tensors(cls, tensors: dict[str, np.ndarray], vocab_size: int) -> BatchMix:
        try:
            shape = tuple(int(s) for s in tensors["shape"])
            batch_tokens, stride = (int(s) for s in tensors["settings"])
            parts = [tensors[name] for name in ("data", "indices", "indptr")]
            if any(a.dtype.kind not in "iu" for a in parts):
                raise TypeError("data, indices and indptr must hold integers")
            counts = sparse.csr_array(tuple(parts), shape=shape)
            # Out-of-range indices would crash scipy's routines later: check them now.
            counts.check_format(full_check=True)
        except (KeyError, ValueError, TypeError) as e:
            raise SchemaError(f"batch mix tensors are malformed ({e})") from None
        if shape[1] != vocab_size or batch_tokens < 1 or stride < 1:
            raise SchemaError(
                f"batch mix has shape {shape}, batch_tokens {batch_tokens}, stride {stride}; "
                f"expected [G, {vocab_size}] and positive settings"
            )
        if counts.data.size and counts.data.min() < 0:
            raise SchemaError("batch mix holds negative counts")
        return cls(counts, batch_tokens, stride)


def batch_spread(mix: BatchMix) -> float | None:
    """How unlike one another the batches of ``mix`` are: the mean total-variation distance
    between each full batch's token distribution and that of all its full batches, weighted
    by their tokens (None with fewer than :data:`MIN_SPREAD_BATCHES` full batches).

    Even batches drawn at random spread (a batch of 4096 tokens samples a large vocabulary
    thinly), so the figure says something only against the same requests' batches in a
    random order: `moeplan fit` records both (``fit_info["batches"]["spread"]``).
    """
    counts = mix.counts.tocsr().astype(np.float64)
    tokens = np.asarray(counts.sum(axis=1)).ravel()
    full = tokens == mix.batch_tokens
    if full.sum() < MIN_SPREAD_BATCHES:
        return None
    counts, tokens = counts[full], tokens[full]
    whole = np.asarray(counts.sum(axis=0)).ravel() / tokens.sum()
    # |p - q| summed over the tokens: over those a batch holds, plus q's mass it lacks
    p = sparse.csr_array(counts.multiply(1.0 / tokens[:, None]))
    rows = np.repeat(np.arange(p.shape[0]), np.diff(p.indptr))
    held = np.abs(p.data - whole[p.indices])
    lacking = 1.0 - np.bincount(rows, weights=whole[p.indices], minlength=p.shape[0])
    distance = 0.5 * (np.bincount(rows, weights=held, minlength=p.shape[0]) + lacking)
    return float(np.average(distance, weights=tokens))


def _batch_tokens(value) -> int:
    if not isinstance(value, int | np.integer) or value < 1:
        raise InputError(f"batch_tokens={value!r} must be a positive integer")
    return int(value)


class BatchMixAccumulator:
    """Cuts token ids arriving in trace order into batches of ``batch_tokens`` and counts them."""

    def __init__(
        self, vocab_size: int, batch_tokens: int = BATCH_TOKENS, max_batches: int = MAX_BATCHES
    ):
        self.vocab_size = int(vocab_size)
        self.batch_tokens = _batch_tokens(batch_tokens)
        self.max_batches = int(max_batches)
        self.stride = 1
        self.index = 0  # batches of the trace seen so far
        self.kept: list[tuple[int, np.ndarray, np.ndarray]] = []  # (index, ids, counts)
        self.pending: list[np.ndarray] = []
        self.pending_rows = 0

    def add(self, token_ids: np.ndarray, request_ids: np.ndarray | None = None) -> None:
        """The next fitting rows' token ids, in trace order (-1, unknown, is skipped); their
        request ids are not needed (as :meth:`MixedBatchAccumulator.add` needs them)."""
        ids = np.asarray(token_ids, dtype=np.int64)
        while ids.size:
            take = self.batch_tokens - self.pending_rows
            self.pending.append(ids[:take])
            self.pending_rows += min(take, ids.size)
            ids = ids[take:]
            if self.pending_rows == self.batch_tokens:
                self._close()

    def _close(self) -> None:
        ids = np.concatenate(self.pending)
        self.pending, self.pending_rows = [], 0
        if self.index % self.stride == 0:
            uniq, counts = np.unique(ids[ids >= 0], return_counts=True)
            self.kept.append((self.index, uniq, counts))
            if len(self.kept) >= 2 * self.max_batches:
                self.stride *= 2
                self.kept = [b for b in self.kept if b[0] % self.stride == 0]
        self.index += 1

    def result(self) -> BatchMix:
        if self.pending_rows and (self.index % self.stride == 0 or not self.kept):
            self._close()
        return _assemble(
            self.kept, self.vocab_size, self.batch_tokens, self.stride, self.max_batches
        )


def _assemble(
    kept: list[tuple[int, np.ndarray, np.ndarray]],
    vocab_size: int,
    batch_tokens: int,
    stride: int,
    max_batches: int,
) -> BatchMix:
    """The :class:`BatchMix` of the kept batches ``(index, token ids, counts)``, in index
    order, thinned to ``max_batches`` evenly spaced ones."""
    if len(kept) > max_batches:  # evenly spaced subset
        pick = np.linspace(0, len(kept) - 1, max_batches).round().astype(int)
        kept = [kept[i] for i in np.unique(pick)]
    rows = np.concatenate(
        [np.full(ids.size, g) for g, (_, ids, _) in enumerate(kept)] or [np.zeros(0)]
    )
    cols = np.concatenate([ids for _, ids, _ in kept] or [np.zeros(0)])
    data = np.concatenate([c for _, _, c in kept] or [np.zeros(0)])
    counts = sparse.csr_array(
        (data.astype(np.int64), (rows.astype(np.int64), cols.astype(np.int64))),
        shape=(len(kept), vocab_size),
    )
    return BatchMix(counts, batch_tokens, stride)


class MixedBatchAccumulator:
    """The batches the fitting requests make when served in a random order.

    The requests (``request_ids`` [R] distinct, with ``lengths`` [R] fitting rows each) are
    put in an order drawn with ``seed``, each request's rows kept together in the order they
    arrive; row i of that order falls in batch ``i // batch_tokens``. Rows may then arrive
    in any order (:meth:`add` places each by its request). As in trace order, at most
    ``max_batches`` batches are kept, evenly spaced, every ``stride``-th one (the stride
    fixed up front: the number of batches is known).
    """

    def __init__(
        self,
        vocab_size: int,
        request_ids: np.ndarray,
        lengths: np.ndarray,
        seed: int | np.random.SeedSequence,
        batch_tokens: int = BATCH_TOKENS,
        max_batches: int = MAX_BATCHES,
    ):
        self.vocab_size, self.batch_tokens = int(vocab_size), _batch_tokens(batch_tokens)
        self.max_batches = int(max_batches)
        self.request_ids = np.asarray(request_ids, dtype=np.int64)
        lengths = np.asarray(lengths, dtype=np.int64)
        order = np.random.default_rng(seed).permutation(self.request_ids.size)
        self.start = np.zeros(self.request_ids.size, np.int64)  # first row of each request
        self.start[order] = np.cumsum(lengths[order]) - lengths[order]
        self.seen = np.zeros(self.request_ids.size, np.int64)  # its rows placed so far
        total = int(lengths.sum())
        num_batches = -(-total // self.batch_tokens)
        self.stride = 1
        while -(-num_batches // self.stride) >= 2 * self.max_batches:
            self.stride *= 2
        self.batches: list[np.ndarray] = []
        self.tokens: list[np.ndarray] = []

    def add(self, token_ids: np.ndarray, request_ids: np.ndarray) -> None:
        """The next fitting rows: token ids [T] (-1, unknown, is skipped) and their requests [T]."""
        ids = np.asarray(token_ids, dtype=np.int64)
        r = np.searchsorted(self.request_ids, np.asarray(request_ids, dtype=np.int64))
        if ids.size == 0:
            return
        if r.max() >= self.request_ids.size or np.any(self.request_ids[r] != request_ids):
            raise InputError("a fitting row's request is none of the requests counted up front")
        # each row's rank among its request's rows: those placed before, then its place
        # among this block's rows of the same request (stable, so in arrival order)
        by_request = np.argsort(r, kind="stable")
        sorted_r = r[by_request]
        first = np.searchsorted(sorted_r, sorted_r)  # first row of each request's run
        rank = np.empty_like(r)
        rank[by_request] = np.arange(r.size) - first
        batch = (self.start[r] + self.seen[r] + rank) // self.batch_tokens
        np.add.at(self.seen, r, 1)
        keep = (batch % self.stride == 0) & (ids >= 0)
        self.batches.append(batch[keep])
        self.tokens.append(ids[keep])

    def result(self) -> BatchMix:
        batch = np.concatenate(self.batches or [np.zeros(0, np.int64)])
        tokens = np.concatenate(self.tokens or [np.zeros(0, np.int64)])
        kept = []
        for index in np.unique(batch):
            uniq, counts = np.unique(tokens[batch == index], return_counts=True)
            kept.append((int(index), uniq, counts))
        return _assemble(kept, self.vocab_size, self.batch_tokens, self.stride, self.max_batches)

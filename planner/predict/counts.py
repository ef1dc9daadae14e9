"""Token-expert counts: accumulated from traces, or read from a counts table.

The counts ``T[l][j, e]`` = how many times token ``j`` was routed to expert ``e`` at MoE
layer ``l`` are the raw material of the intra-layer affinity model of Speculative MoE
(paper 000, §3.3: ``Pr(E_k | x_j) = T_jk / sum_k T_jk``). They are held per layer as a
``scipy.sparse.csr_array`` of shape [V, N] (int64, canonical: sorted, no duplicates), so
memory is bounded by the distinct (token, expert) pairs, never by the trace's length.

Two sources:

- :class:`CountsAccumulator` streams trace batches. Its hot path packs (layer, token,
  expert) into one unsigned integer key, sorts each chunk (numpy's SIMD sort) and
  run-length reduces it; reduced chunks are merged into the running total with a linear
  sorted merge.
- :func:`read_counts_table` reads a counts table: DESIGN.md's schema (``layer`` int16,
  ``token_id`` int32, ``expert`` int16, ``count`` int64, metadata ``{"schema": "counts"}``),
  or the OLMoE routing-analysis export in ``../shared/realdata`` (extra ``model`` and
  ``domain`` columns, ``layer`` = model layer index, no moeplan metadata), filtered by
  model and domain. The counts must be those of top-k routing: no expert counted more
  often than its token occurred (a ``--top-k`` larger than the model's is refused).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from scipy import sparse

from planner._checks import is_integer
from planner._io import atomic_path
from planner.errors import InputError, SchemaError
from planner.trace.io import read_columns
from planner.trace.schema import (
    COUNTS_COLUMNS,
    COUNTS_SOURCE,
    META_KEY,
    CountsMeta,
    TraceMeta,
    counts_arrow_schema,
)

# Counts summing to this much or more are refused: int64 sums (loads, row sums) would overflow.
MAX_TOTAL_COUNT = 2.0**62

# Raw keys a CountsAccumulator buffers before sorting them into its totals, shared out
# over the layers (4 bytes a key below 2**32 cells a layer: 512 MiB in all).
BUFFER_KEYS = 1 << 27

# Shapes of models whose counts tables carry no moeplan metadata (the OLMoE export).
# Matched by substring of the ``model`` column; flags override them.
KNOWN_MODEL_SHAPES: dict[str, dict[str, int]] = {
    "OLMoE-1B-7B": {"num_experts": 64, "top_k": 8, "vocab_size": 50304},
    "Mixtral-8x7B": {"num_experts": 8, "top_k": 2, "vocab_size": 32000},
}


@dataclass(frozen=True)
class TokenExpertCounts:
    """Per-layer token-expert routing counts.

    Attributes:
        meta: model and shapes (L layers, N experts, top-k, V vocab; ``moe_layer_indices``
            are the model layer indices of the L layers).
        by_layer: L sparse arrays [V, N] int64; ``by_layer[l][j, e]`` = routed activations
            of token j to expert e at MoE layer l. Rows sum to k x (occurrences of j).
        domains: the domains pooled into these counts (counts tables only).
        top1_by_layer: L sparse arrays [V, N] int64 counting only each occurrence's rank-0
            (highest gate weight) expert; None when unknown (counts tables).
    """

    meta: TraceMeta
    by_layer: tuple[sparse.csr_array, ...]
    domains: tuple[str, ...] = ()
    top1_by_layer: tuple[sparse.csr_array, ...] | None = None

    def __post_init__(self) -> None:
        m = self.meta
        if (
            len(self.by_layer) != m.num_layers
            or len(self.top1_by_layer or self.by_layer) != m.num_layers
        ):
            raise SchemaError(
                f"counts hold {len(self.by_layer)} layers, metadata says {m.num_layers}"
            )
        for layer, mat in enumerate(self.by_layer + (self.top1_by_layer or ())):
            if mat.shape != (m.vocab_size, m.num_experts):
                raise SchemaError(
                    f"counts of layer {layer % m.num_layers} have shape {mat.shape}, expected "
                    f"(vocab_size, num_experts) = ({m.vocab_size}, {m.num_experts})"
                )

    def load(self) -> np.ndarray:
        """[L, N] int64 routed activations of each expert (column sums)."""
        return np.stack([np.asarray(c.sum(axis=0)).ravel() for c in self.by_layer]).astype(np.int64)

    def token_activations(self) -> np.ndarray:
        """[L, V] int64 routed activations of each token per layer (row sums = k x occurrences)."""
        return np.stack([np.asarray(c.sum(axis=1)).ravel() for c in self.by_layer]).astype(np.int64)

    def total_activations(self) -> int:
        return int(sum(int(c.sum()) for c in self.by_layer))


def _key_dtype(max_key: int) -> type:
    return np.uint32 if max_key < 2**32 else np.uint64


def _run_length(sorted_keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Distinct values of a sorted array and how often each occurs."""
    n = sorted_keys.shape[0]
    if n == 0:
        return sorted_keys, np.zeros(0, np.int64)
    starts = np.empty(n, bool)
    starts[0] = True
    np.not_equal(sorted_keys[1:], sorted_keys[:-1], out=starts[1:])
    idx = np.flatnonzero(starts)
    counts = np.empty(idx.shape[0], np.int64)
    np.subtract(idx[1:], idx[:-1], out=counts[:-1])
    counts[-1] = n - idx[-1]
    return sorted_keys[idx], counts


def merge_sorted_counts(
    keys_a: np.ndarray,
    counts_a: np.ndarray,
    keys_b: np.ndarray,
    counts_b: np.ndarray,
    *,
    overwrite_a: bool = False,
) -> tuple[np.ndarray, np.ndarray]:
    """Sum two (sorted distinct keys, counts) multisets in linear time (no re-sort).

    Assumes validated input: both key arrays sorted, distinct, of the same dtype, and counts
    of a dtype that holds the sums. ``overwrite_a`` lets ``counts_a`` be updated in place
    (the caller gives it up): a running total then costs no copy of itself. Besides the
    result, the merge allocates a byte per output key and one position per key of b.
    """
    if keys_a.shape[0] == 0:
        return keys_b, counts_b
    if keys_b.shape[0] == 0:
        return keys_a, counts_a
    pos = np.searchsorted(keys_a, keys_b)
    hit = pos < keys_a.shape[0]
    hit[hit] = keys_a[pos[hit]] == keys_b[hit]
    if not overwrite_a:
        counts_a = counts_a.copy()
    counts_a[pos[hit]] += counts_b[hit]  # keys_b distinct, so positions are distinct
    miss = ~hit
    if not miss.any():
        return keys_a, counts_a
    # b's new keys go to pos + (new keys of b before them); a's keys fill the other slots.
    pos_b = pos[miss]
    del pos, hit
    pos_b += np.arange(pos_b.shape[0], dtype=pos_b.dtype)
    from_b = np.zeros(keys_a.shape[0] + pos_b.shape[0], bool)
    from_b[pos_b] = True
    keys = np.empty(from_b.shape[0], keys_a.dtype)
    counts = np.empty(from_b.shape[0], counts_a.dtype)
    keys[pos_b] = keys_b[miss]
    counts[pos_b] = counts_b[miss]
    del pos_b
    np.logical_not(from_b, out=from_b)  # now: the slots of a's keys
    keys[from_b] = keys_a
    counts[from_b] = counts_a
    return keys, counts


class SortedKeyCounter:
    """A multiset of unsigned integer keys, counted by sorting a buffer of raw keys.

    Keys are written into a flat buffer (grown geometrically up to ``capacity``); when it
    is full, it is sorted in place (numpy's SIMD sort), run-length reduced and merged into
    the running (sorted distinct keys, counts) total. Memory is the total plus the buffer,
    whatever the number of keys fed. Counts are int32 while no count can pass 2**31 - 1 (at
    most that many keys fed), int64 from then on: with 4-byte keys the total then costs 8
    bytes a distinct key instead of 12.
    """

    NARROW_MAX = int(np.iinfo(np.int32).max)  # the most keys counted in int32

    def __init__(self, dtype: type, capacity: int = 1 << 27):
        self.dtype = dtype
        self.capacity = capacity
        self.keys: np.ndarray = np.zeros(0, dtype)
        self.counts: np.ndarray = np.zeros(0, np.int32)
        self._buffer: np.ndarray = np.zeros(0, dtype)
        self._used = 0
        self._fed = 0  # keys counted so far: no count can exceed it

    def reserve(self, n: int) -> np.ndarray:
        """A writable [n] view of the buffer; every key written there is counted."""
        if self._used + n > self.capacity:
            self._flush()
        need = self._used + n
        if need > self._buffer.shape[0]:
            size = min(max(need, 2 * self._buffer.shape[0], 1 << 16), max(self.capacity, need))
            grown: np.ndarray = np.empty(size, self.dtype)
            grown[: self._used] = self._buffer[: self._used]
            self._buffer = grown
        view = self._buffer[self._used : need]
        self._used = need
        return view

    def add_keys(self, keys: np.ndarray) -> None:
        """Count every element of ``keys`` (1-D)."""
        self.reserve(keys.shape[0])[:] = keys

    def _flush(self, release: bool = False) -> None:
        """Fold the buffer into the total; ``release`` frees the buffer before the merge."""
        if self._used == 0:
            return
        raw = self._buffer[: self._used]
        raw.sort()
        keys, counts = _run_length(raw)  # copies: the buffer is free to reuse
        del raw
        self._fed += self._used
        self._used = 0
        if release:
            self._buffer = np.zeros(0, self.dtype)
        wide = self._fed > self.NARROW_MAX
        dtype = np.int64 if wide else np.int32
        counts = counts.astype(dtype, copy=False)
        if self.counts.dtype != dtype:
            self.counts = self.counts.astype(dtype)
        self.keys, self.counts = merge_sorted_counts(
            self.keys, self.counts, keys, counts, overwrite_a=True
        )

    def size(self) -> int:
        """Distinct keys counted so far (the buffer folded in first)."""
        self._flush()
        return int(self.keys.shape[0])

    def release_buffer(self) -> None:
        """Fold the buffer into the total and free it (counting may go on: the buffer is
        allocated again on the next key). Once every key is in, the buffers of all the
        counters are worth freeing before any total is converted: each layer's buffer had
        been kept until its own turn, under every result built before it."""
        self._flush(release=True)
        self._buffer = np.zeros(0, self.dtype)

    def result(self) -> tuple[np.ndarray, np.ndarray]:
        """(sorted distinct keys, counts: int32 or int64, see the class doc), handed over:
        the counter lets go of them and of its buffer, and is empty afterwards."""
        self.release_buffer()
        keys, counts = self.keys, self.counts
        self.keys, self.counts, self._fed = np.zeros(0, self.dtype), np.zeros(0, np.int32), 0
        return keys, counts


class CountsAccumulator:
    """Accumulates :class:`TokenExpertCounts` from trace batches, in bounded memory.

    Token occurrences with ``token_id == -1`` (unknown) are skipped. Each layer has its own
    :class:`SortedKeyCounter` of keys ``j * N + e`` (4 bytes when V * N < 2**32, else 8),
    so merging a buffer into the running total copies one layer's total, not the model's.
    Memory is the distinct (layer, token, expert) triples seen (8 bytes each with 4-byte
    keys) plus ``buffer_keys`` raw keys shared out over the layers (the buffers fill as the
    trace goes: T occurrences use min(T x L x k, buffer_keys) of them; 512 MiB in all once
    full; :meth:`release_buffers` frees them). With ``top1`` the rank-0 expert of each
    occurrence is also counted on its own (``top1_by_layer``), at 1/k of the cost.
    """

    def __init__(self, meta: TraceMeta, buffer_keys: int = BUFFER_KEYS, *, top1: bool = True):
        self.meta = meta
        m = meta
        self._dtype = _key_dtype(m.vocab_size * m.num_experts)
        per_layer = max(buffer_keys // m.num_layers, 1)
        self._counters = [SortedKeyCounter(self._dtype, per_layer) for _ in range(m.num_layers)]
        self._top1 = (
            [
                SortedKeyCounter(self._dtype, max(per_layer // m.top_k, 1))
                for _ in range(m.num_layers)
            ]
            if top1
            else None
        )
        self.tokens = 0
        self.unknown_tokens = 0

    def add(self, token_id: np.ndarray, experts: np.ndarray) -> None:
        """Count one chunk: ``token_id`` [T] int32, ``experts`` [T, L, k] int16 (validated)."""
        known = token_id >= 0
        self.tokens += int(token_id.shape[0])
        if not known.all():
            self.unknown_tokens += int((~known).sum())
            token_id, experts = token_id[known], experts[known]
        t = token_id.shape[0]
        if t == 0:
            return
        m, dt = self.meta, self._dtype
        row = token_id.astype(dt) * dt(m.num_experts)  # [T] key of (token, expert 0)
        for layer, counter in enumerate(self._counters):
            slot = counter.reserve(t * m.top_k).reshape(t, m.top_k)
            np.add(row[:, None], experts[:, layer], out=slot, casting="unsafe")
            if self._top1 is not None:
                np.add(row, experts[:, layer, 0], out=self._top1[layer].reserve(t),
                       casting="unsafe")  # fmt: skip

    def release_buffers(self) -> None:
        """Fold every layer's buffer into its total and free it (see
        :meth:`SortedKeyCounter.release_buffer`); :meth:`result` starts with it."""
        for counter in self._counters + (self._top1 or []):
            counter.release_buffer()

    def result(self) -> TokenExpertCounts:
        """The counts as L CSR arrays (the accumulator is empty afterwards)."""
        # every buffer freed first: layer l's CSR arrays then take the place of buffers, not
        # come on top of the buffers of the layers after it
        self.release_buffers()
        top1 = None
        if self._top1 is not None:
            top1 = tuple(_to_csr(*c.result(), self.meta) for c in self._top1)
        return TokenExpertCounts(
            self.meta,
            tuple(_to_csr(*c.result(), self.meta) for c in self._counters),
            top1_by_layer=top1,
        )

    def top_counts(self, take: int) -> np.ndarray:
        """[L, 2] float64 per layer: the sum over tokens of each token's ``take`` largest
        expert counts, and the sum of all counts (the accumulator is empty afterwards).

        Read from each layer's sorted keys, without the CSR arrays of :meth:`result` (the
        oracle bound of :mod:`planner.evaluate.metrics`).
        """
        out = np.zeros((self.meta.num_layers, 2))
        for layer, counter in enumerate(self._counters):
            keys, c = counter.result()
            if keys.shape[0] == 0:
                continue
            rows = keys // keys.dtype.type(self.meta.num_experts)  # sorted: a token's together
            order = np.lexsort((-c.astype(np.int64), rows))  # each token's largest first
            first = np.flatnonzero(np.r_[True, rows[1:] != rows[:-1]])
            starts = np.repeat(first, np.diff(np.r_[first, rows.shape[0]]))
            kept = np.arange(rows.shape[0]) - starts < take
            out[layer] = c[order][kept].sum(dtype=np.int64), c.sum(dtype=np.int64)
        return out


def csr_index_dtype(vocab_size: int, num_experts: int) -> type[np.signedinteger]:
    """The index dtype of a [V, N] counts array: scipy keeps indices and indptr in one
    dtype, and int32 (half of int64) holds them wherever V x N fits."""
    return np.int32 if vocab_size * num_experts < 2**31 else np.int64


def _to_csr(keys: np.ndarray, counts: np.ndarray, meta: TraceMeta) -> sparse.csr_array:
    """One layer's sorted distinct ``j * N + e`` keys -> canonical CSR array [V, N] int64."""
    v, n = meta.vocab_size, meta.num_experts
    index = csr_index_dtype(v, n)
    width = keys.dtype.type(n)
    rows = keys // width
    cols: np.ndarray = (keys % width).astype(index)
    indptr = np.zeros(v + 1, index)
    np.cumsum(np.bincount(rows, minlength=v), out=indptr[1:])
    mat = sparse.csr_array((counts.astype(np.int64, copy=False), cols, indptr), shape=(v, n))
    mat.has_canonical_format = True
    return mat


def counts_from_triples(
    meta: TraceMeta, layer: np.ndarray, token_id: np.ndarray, expert: np.ndarray, count: np.ndarray
) -> TokenExpertCounts:
    """Counts from (MoE layer index, token, expert, count) rows; duplicates are summed,
    rows of count 0 dropped.

    Assumes validated ids: ``0 <= layer < L``, ``0 <= token_id < V``, ``0 <= expert < N``.
    """
    v, n = meta.vocab_size, meta.num_experts
    mats = []
    for index in range(meta.num_layers):
        sel = layer == index
        mat = sparse.coo_array(
            (
                count[sel].astype(np.int64),
                (token_id[sel].astype(np.int64), expert[sel].astype(np.int64)),
            ),
            shape=(v, n),
        ).tocsr()
        mat.sum_duplicates()
        mat.eliminate_zeros()  # a row of count 0 is no activation (and saved, no predictor)
        mat.sort_indices()
        mats.append(sparse.csr_array(mat))
    return TokenExpertCounts(meta, tuple(mats))


# ---------------------------------------------------------------------------------------
# Counts tables on disk.


def is_counts_table(path: str | Path) -> bool:
    """True when ``path`` is a Parquet file with counts columns (layer, token_id, expert, count)."""
    p = Path(path)
    if not p.is_file():
        return False
    try:
        names = set(pq.ParquetFile(p).schema_arrow.names)
    except (pa.ArrowInvalid, OSError):
        return False
    return set(COUNTS_COLUMNS) <= names


@dataclass(frozen=True)
class CountsSelection:
    """Which part of a counts table to read and the shapes to assume where it has none.

    Attributes:
        model: substring of the ``model`` column value to keep (needed when several).
        domains: ``domain`` values to pool (empty = all).
        num_experts, top_k, vocab_size: shapes when neither metadata nor
            :data:`KNOWN_MODEL_SHAPES` give them.
        domain_flag: the CLI flag ``domains`` came from, for errors.
    """

    model: str | None = None
    domains: tuple[str, ...] = ()
    num_experts: int | None = None
    top_k: int | None = None
    vocab_size: int | None = None
    domain_flag: str = "--domain"


def _dictionary_values(table: pa.Table, column: str, path: Path) -> list[str]:
    """The distinct values of a name column (``model``, ``domain``) as strings; SchemaError
    for a column of another kind (a list cast to strings was a traceback) or with nulls
    (which became a domain named "None" that no selection could pick)."""
    values = table.column(column)
    kind = values.type.value_type if pa.types.is_dictionary(values.type) else values.type
    if not (
        pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_integer(kind)
    ):
        raise SchemaError(f"{path}: column {column} is {values.type}, expected names (strings)")
    if values.null_count:
        raise SchemaError(f"{path}: column {column} holds {values.null_count} null value(s)")
    return sorted(str(v) for v in pc.unique(values.cast(pa.string())).to_pylist())


def _pick_model(table: pa.Table, wanted: str | None, path: Path) -> str | None:
    if "model" not in table.column_names:
        return None
    models = _dictionary_values(table, "model", path)
    if wanted is None:
        if len(models) == 1:
            return models[0]
        raise InputError(
            f"{path}: holds counts of several models ({', '.join(models)}); choose one with --model"
        )
    exact = [m for m in models if m == wanted]
    matches = exact or [m for m in models if wanted.lower() in m.lower()]
    if len(matches) != 1:
        what = "matches several" if matches else "matches none"
        raise InputError(
            f"{path}: --model {wanted!r} {what} of the models in the table ({', '.join(models)})"
        )
    return matches[0]


def read_counts_table(
    path: str | Path, selection: CountsSelection = CountsSelection()
) -> TokenExpertCounts:
    """Read a counts table (either layout, see the module docstring) as :class:`TokenExpertCounts`.

    Layers are renumbered in sorted order of the model's ``layer`` values in the table
    (whatever the domains selected), which are kept as ``moe_layer_indices``. Rows of the
    selected domains are pooled.
    """
    path = Path(path)
    if not is_counts_table(path):
        raise InputError(
            f"{path}: not a token-expert counts table (a Parquet file with columns "
            f"{', '.join(COUNTS_COLUMNS)})"
        )
    pf = pq.ParquetFile(path)
    md = pf.schema_arrow.metadata or {}
    declared: dict = {}
    if META_KEY in md:
        try:
            declared = json.loads(md[META_KEY])
        except ValueError as e:
            raise SchemaError(f"{path}: 'moeplan' metadata is not valid JSON ({e})") from None
        _check_declared(path, declared)
        if declared.get("schema") != "counts":
            raise SchemaError(f"{path}: 'moeplan' metadata does not declare schema 'counts'")
        if declared.get("schema_version", 1) != 1:
            raise SchemaError(
                f"{path}: counts schema_version {declared.get('schema_version')} is not supported (expected 1)"
            )
    table = read_columns(path)
    if not table.num_rows:  # (it was said to hold several models, none named)
        raise InputError(f"{path}: the counts table holds no rows")
    model = _pick_model(table, selection.model, path)
    if model is None and selection.model is not None:
        # no model column: --model must name the model the metadata records
        named = declared.get("model") or ""
        if not named or selection.model.lower() not in named.lower():
            raise InputError(
                f"{path}: --model {selection.model!r} does not match the table, which records "
                + (f"model {named!r}" if named else "no model; drop --model")
            )
    if model is not None:
        table = table.filter(pc.equal(table.column("model").cast(pa.string()), model))
    # The model's layers, before any domain filter: every domain maps a model layer to
    # the same MoE layer index.
    layer_values = np.unique(_int_column(table, "layer", path))
    domains: tuple[str, ...] = ()
    if "domain" in table.column_names:
        available = _dictionary_values(table, "domain", path)
        if selection.domains:
            unknown = [d for d in selection.domains if d not in available]
            if unknown:
                raise InputError(
                    f"{path}: domain(s) {', '.join(unknown)} not in the table for "
                    f"{model or 'this model'} (available: {', '.join(available)})"
                )
            domains = tuple(selection.domains)
            table = table.filter(
                pc.is_in(table.column("domain").cast(pa.string()), pa.array(domains))
            )
        else:
            domains = tuple(available)
    elif selection.domains:
        raise InputError(f"{path}: has no 'domain' column; drop {selection.domain_flag}")
    if table.num_rows == 0:
        raise InputError(
            f"{path}: no rows left after selecting model {model!r} and domains {domains}"
        )

    layer, token, expert, count = (
        _int_column(table, name, path) for name in ("layer", "token_id", "expert", "count")
    )
    if (count < 0).any():
        raise SchemaError(f"{path}: negative count {int(count.min())}")
    if float(count.sum(dtype=np.float64)) >= MAX_TOTAL_COUNT:
        raise SchemaError(f"{path}: the counts sum to more than 2**62 (int64 sums would overflow)")

    shape = _resolve_shape(path, model, declared, selection)
    if declared and "num_layers" in declared:
        layer_values = np.arange(int(declared["num_layers"]))
        if layer.min() < 0 or layer.max() >= len(layer_values):
            bad = int(layer.min()) if layer.min() < 0 else int(layer.max())
            raise SchemaError(f"{path}: layer {bad} outside [0, {len(layer_values)}) (num_layers)")
    elif layer_values[0] < 0:  # sorted: the model's layer indices
        raise SchemaError(f"{path}: layer {int(layer_values[0])} is negative (a model layer index)")
    _check_range(path, "token_id", token, shape["vocab_size"], "vocab_size")
    _check_range(path, "expert", expert, shape["num_experts"], "num_experts")
    moe_index = np.searchsorted(layer_values, layer)
    if "moe_layer_indices" in declared:  # the model layer of each MoE layer numbered
        layer_values = np.asarray(declared["moe_layer_indices"], np.int64)
    meta = TraceMeta(
        model=model or str(declared.get("model") or path.stem),
        num_layers=len(layer_values),
        num_experts=shape["num_experts"],
        top_k=shape["top_k"],
        vocab_size=shape["vocab_size"],
        moe_layer_indices=tuple(int(x) for x in layer_values),
        source=f"{COUNTS_SOURCE} {path.name}"
        + (f" domains={','.join(domains)}" if domains else ""),
    )
    check_vocab_fits(meta, str(path))
    out = counts_from_triples(meta, moe_index, token, expert, count)
    _check_top_k(path, out, selection)
    return TokenExpertCounts(out.meta, out.by_layer, domains)


def _check_top_k(path: Path, counts: TokenExpertCounts, sel: CountsSelection) -> None:
    """InputError when the counts cannot be of top-k routing with this k.

    Each occurrence of a token activates k distinct experts, so its counts sum to k x its
    occurrences and no expert is counted more often than the token occurred:
    ``k x max_e count <= sum_e count``. A k too large (8 for Mixtral's top-2) breaks that
    on every token seen once; it had gone through, every token's occurrences divided by
    the wrong k and the predictor's top-k lists filled with experts the model never chose.
    (A k too small cannot be seen in the counts.)
    """
    k = counts.meta.top_k
    for index, mat in enumerate(counts.by_layer):
        if mat.nnz == 0:
            continue
        rows = np.flatnonzero(np.diff(mat.indptr))
        total = np.add.reduceat(mat.data, mat.indptr[rows])
        most = np.maximum.reduceat(mat.data, mat.indptr[rows])
        bad = np.flatnonzero(k * most > total)
        if bad.size:
            j = bad[0]
            given = "--top-k" if sel.top_k is not None else "top_k"
            raise InputError(
                f"{path}: token {int(rows[j])} at MoE layer {index} has an expert counted "
                f"{int(most[j])} times in {int(total[j])} activations, more than the "
                f"{total[j] / k:g} occurrences {given}={k} gives it (each occurrence "
                f"activates {k} distinct experts); is {given} {k} the model's? "
                f"({bad.size} of {rows.size} tokens break this there)"
            )


def check_vocab_fits(meta: TraceMeta, where: str) -> None:
    """InputError if the predictor's vocabulary-sized tables cannot fit in this machine's
    memory: a trace or counts table whose ``vocab_size`` is wrong (the schema allows up to
    2**31) had ``fit`` killed for memory, without a word, after its pass over the data (a
    trace's) or while it read the rows (a counts table's). The estimate is a lower
    bound: each layer's counts row pointers (int64) and top-k table (int16 [V, k]), and the
    token's id, nearest known token and seen flag (13 bytes)."""
    need = meta.num_layers * (meta.vocab_size + 1) * (8 + 2 * meta.top_k) + 13 * meta.vocab_size
    have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if need > have:
        raise InputError(
            f"{where}: vocab_size={meta.vocab_size} needs at least {need / 2**30:.0f} GiB of "
            f"tables for {meta.num_layers} layers, more than this machine's "
            f"{have / 2**30:.0f} GiB; is that vocab_size the model's?"
        )


def _int_column(table: pa.Table, name: str, path: Path) -> np.ndarray:
    """Column ``name`` as int64; SchemaError for nulls, non-numeric types or non-integer values."""
    column = table.column(name)
    kind = column.type
    if pa.types.is_dictionary(kind):
        kind = kind.value_type
    if not (pa.types.is_integer(kind) or pa.types.is_floating(kind)):
        raise SchemaError(f"{path}: column {name} is {column.type}, expected integers")
    if column.null_count:
        raise SchemaError(f"{path}: column {name} holds {column.null_count} null value(s)")
    values = column.to_numpy()
    if values.dtype.kind == "f":
        with np.errstate(invalid="ignore"):
            bad = ~np.isfinite(values) | (values != np.round(values)) | (np.abs(values) >= 2.0**63)
        if bad.any():
            raise SchemaError(
                f"{path}: column {name} holds {float(values[bad][0])}, not an integer"
            )
    elif values.dtype == np.uint64 and values.size and int(values.max()) >= 2**63:
        raise SchemaError(f"{path}: column {name} holds {int(values.max())}, beyond int64")
    return values.astype(np.int64)


def _check_declared(path: Path, declared: object) -> None:
    """SchemaError unless the table's 'moeplan' metadata is an object of well-typed fields."""
    if not isinstance(declared, dict):
        raise SchemaError(
            f"{path}: 'moeplan' metadata must be a JSON object, not {type(declared).__name__}"
        )
    for key in ("num_layers", "num_experts", "top_k", "vocab_size"):
        if key not in declared:
            continue
        value = declared[key]
        if not (is_integer(value) and value > 0):
            raise SchemaError(
                f"{path}: 'moeplan' metadata {key}={value!r} must be a positive integer"
            )
    if declared.get("model") is not None and not isinstance(declared["model"], str):
        raise SchemaError(
            f"{path}: 'moeplan' metadata model={declared['model']!r} must be a string"
        )
    if "moe_layer_indices" in declared:
        idx = declared["moe_layer_indices"]
        ok = isinstance(idx, list) and all(is_integer(i) and i >= 0 for i in idx)
        if not ok or list(idx) != sorted(set(idx)) or len(idx) != declared.get("num_layers"):
            raise SchemaError(
                f"{path}: 'moeplan' metadata moe_layer_indices must be num_layers increasing "
                "model layer indices"
            )


def _check_range(path: Path, name: str, values: np.ndarray, bound: int, what: str) -> None:
    lo, hi = int(values.min()), int(values.max())
    if lo < 0 or hi >= bound:
        bad = lo if lo < 0 else hi
        raise SchemaError(
            f"{path}: {name} {bad} outside [0, {bound}) ({what}); pass the right --{what.replace('_', '-')}"
        )


def _resolve_shape(
    path: Path, model: str | None, declared: dict, sel: CountsSelection
) -> dict[str, int]:
    known: dict[str, int] = {}
    if model is not None:
        for name, shape in KNOWN_MODEL_SHAPES.items():
            if name.lower() in model.lower():
                known = shape
    out = {}
    for key in ("num_experts", "top_k", "vocab_size"):
        value = getattr(sel, key)
        if value is None:
            value = declared.get(key, known.get(key))
        if value is None:
            raise InputError(
                f"{path}: the table does not say {key} for {model or 'its model'}; "
                f"pass --{key.replace('_', '-')}"
            )
        if not is_integer(value) or value <= 0:
            raise InputError(f"{path}: {key}={value!r} must be a positive integer")
        out[key] = int(value)
    return out


def write_counts_table(path: str | Path, counts: TokenExpertCounts) -> Path:
    """Write ``counts`` in DESIGN.md's counts schema (atomically); ``layer`` = MoE layer
    index, with the model layer of each in the metadata's ``moe_layer_indices``."""
    m = counts.meta
    cols: dict[str, list[np.ndarray]] = {c: [] for c in COUNTS_COLUMNS}
    for layer, mat in enumerate(counts.by_layer):
        coo = mat.tocoo()
        cols["layer"].append(np.full(coo.nnz, layer, np.int16))
        cols["token_id"].append(coo.row.astype(np.int32))
        cols["expert"].append(coo.col.astype(np.int16))
        cols["count"].append(coo.data.astype(np.int64))
    schema = counts_arrow_schema(
        CountsMeta(
            m.num_layers,
            m.num_experts,
            m.top_k,
            m.vocab_size,
            model=m.model,
            moe_layer_indices=m.moe_layer_indices,
        )  # fmt: skip
    )
    table = pa.Table.from_arrays(
        [pa.array(np.concatenate(cols[c]), schema.field(c).type) for c in COUNTS_COLUMNS],
        schema=schema,
    )
    with atomic_path(path) as tmp:
        pq.write_table(table, tmp, compression="zstd")
    return Path(path)

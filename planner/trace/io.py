"""Read and write v1 traces: one Parquet file, or a directory of ``part-*.parquet`` files.

Reading streams fixed-size batches so a trace may be far larger than memory. Every part's
metadata must agree (same model and shapes) and every batch is range-checked against it.
Writes are atomic: a part appears under its final name only once it is complete.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from planner._checks import is_integer
from planner._io import atomic_path, check_output
from planner.errors import InputError, MismatchError, SchemaError
from planner.trace.schema import (
    COUNTS_COLUMNS,
    META_KEY,
    REQUIRED_COLUMNS,
    TraceMeta,
    arrow_schema,
    check_arrow_schema,
)

PART_GLOB = "part-*.parquet"
# Settings of the moeplan profile run that wrote a trace directory (planner.profile.runner).
PROFILE_SETTINGS_FILE = "profile.json"
# The model's input embeddings [V, d] that ``moeplan profile --save-embeddings`` writes next
# to the parts (a property of the model, not of the traffic: a split carries it to both sides).
EMBEDDINGS_FILE = "embeddings.safetensors"
# What a trace directory is made of: an existing directory holding anything else is not
# replaced (a user's files beside the parts would be deleted with it).
TRACE_MEMBERS = (PART_GLOB, PROFILE_SETTINGS_FILE, EMBEDDINGS_FILE)
_PART_RE = re.compile(r"^part-(\d+)\.parquet$")
DEFAULT_BATCH_ROWS = 65536
# Routed-expert cells (rows x L x k) per batch when a reader does not say
# (Trace.iter_batches): pyarrow's decoding of the list columns holds several copies of a
# batch, so a fixed row count made the peak follow the model's width (65536 rows of a
# 48-layer top-8 trace: 0.7 GB in `trace info`'s reader, 1.0 GB through a split, 1.53 GB
# in a fit of 60k tokens).
WIDE_BATCH_CELLS = 2**22


def batch_rows_for(meta: TraceMeta, cells: int = WIDE_BATCH_CELLS) -> int:
    """Rows per batch holding about ``cells`` routed experts: DEFAULT_BATCH_ROWS for a
    narrow model, fewer for a wide one (at least 1024)."""
    return min(DEFAULT_BATCH_ROWS, max(1024, cells // max(1, meta.num_layers * meta.top_k)))


_INT32 = np.iinfo(np.int32)


def _fit_int(values: np.ndarray, name: str, dtype: type = np.int32) -> np.ndarray:
    """``values`` as ``dtype``; SchemaError if one is not a whole number or does not fit
    (floats were truncated, 1.9 to 1, and integers wrapped, expert 65539 to 3)."""
    info = np.iinfo(dtype)
    if values.dtype == dtype or not values.size:
        return values.astype(dtype, copy=False)
    if values.dtype.kind == "f":
        whole = np.isfinite(values) & (values == np.round(values))
        if not whole.all():
            bad = float(values[~whole][0])
            raise SchemaError(f"{name} {bad!r} is not a whole number")
    elif values.dtype.kind not in "iu":
        raise SchemaError(f"{name} must be integers, got dtype {values.dtype}")
    lo, hi = values.min(), values.max()
    if lo < info.min or hi > info.max:
        bad = lo if lo < info.min else hi
        shown = int(bad) if values.dtype.kind in "iu" else float(bad)
        raise SchemaError(
            f"{name} {shown} does not fit the trace's {np.dtype(dtype).name} column "
            f"[{info.min}, {info.max}]"
        )
    return values.astype(dtype, copy=False)


def _repeated_expert(experts: np.ndarray) -> tuple[int, int] | None:
    """(row, layer) of the first token whose k experts at one layer repeat one, else None."""
    k = experts.shape[2]
    if k < 2 or experts.shape[0] == 0:
        return None
    if k <= 16:
        # k(k-1)/2 comparisons of contiguous rank columns: about 10x faster than a sort
        # along the short last axis (80 ms per million rows at L=8, k=6).
        ranks = np.ascontiguousarray(experts.reshape(-1, k).T)  # [k, T*L]
        same = np.zeros(ranks.shape[1], bool)
        equal = np.empty_like(same)
        for r in range(k - 1):
            for q in range(r + 1, k):
                np.equal(ranks[r], ranks[q], out=equal)
                same |= equal
    else:
        srt = np.sort(experts.reshape(-1, k), axis=1)
        same = (srt[:, 1:] == srt[:, :-1]).any(axis=1)
    if not same.any():
        return None
    first = int(np.argmax(same))
    return divmod(first, experts.shape[1])


# Rows of each part whose gate weights a stage that skips them still checks (iter_batches).
WEIGHT_SAMPLE_ROWS = 4096


def _bad_weight(weights: np.ndarray) -> tuple[int, int, str] | None:
    """(row, layer, what is wrong) of the first token whose gate weights at one layer are
    not finite or not descending (the schema's order: rank 0 is the largest), else None."""
    if weights.size == 0:
        return None
    weights = np.asarray(weights, np.float16)
    bits = weights.view(np.int16)
    # On float16 bits: all exponent bits set is inf or NaN; and without a sign bit the bits
    # order as the values do. 0.04 s per 65536 rows of 58 layers x 8 experts, against 0.16 s
    # in float16 arithmetic.
    finite = (bits & 0x7C00) != 0x7C00
    if (bits >= 0).all():
        descending = bits[..., 1:] <= bits[..., :-1]
    else:  # negative weights: compare the values
        descending = weights[..., 1:] <= weights[..., :-1]  # False wherever NaN
    if finite.all() and descending.all():
        return None
    finite_at, descending_at = finite.all(axis=2), descending.all(axis=2)  # [T, L]
    if not finite_at.all():
        row, layer = np.unravel_index(int(np.argmin(finite_at)), finite_at.shape)
        return int(row), int(layer), "are not all finite"
    row, layer = np.unravel_index(int(np.argmin(descending_at)), descending_at.shape)
    return int(row), int(layer), "are not in descending order, as a v1 trace's are"


def check_distinct_occurrences(rid: np.ndarray, pos: np.ndarray, where: str) -> None:
    """SchemaError if two rows share a (request, position) pair: a trace holds one row per
    token occurrence, and a repeated one would be counted twice."""
    repeated = _repeated_occurrence(rid, pos)
    if repeated is not None:
        r, q = repeated
        raise SchemaError(
            f"{where}: request {r} has more than one row at position {q}; a trace holds one "
            "row per token occurrence (parts of two traces put together need distinct request "
            "ids)"
        )


def _repeated_occurrence(rid: np.ndarray, pos: np.ndarray) -> tuple[int, int] | None:
    """The smallest (request, position) pair that two rows share, else None."""
    if rid.size < 2:
        return None
    lo, hi = int(rid.min()), int(rid.max())
    width = int(pos.max()) - int(pos.min()) + 1
    if (hi - lo + 1) * width < 2**62:  # one int64 key a row: a sort of 8 bytes a row
        key = (rid - lo) * width + (pos.astype(np.int64) - int(pos.min()))
        key.sort()
        same = key[1:] == key[:-1]
        if not same.any():
            return None
        r, q = divmod(int(key[int(np.argmax(same))]), width)
        return r + lo, q + int(pos.min())
    order = np.lexsort((pos, rid))
    rid, pos = rid[order], pos[order]
    same = (rid[1:] == rid[:-1]) & (pos[1:] == pos[:-1])
    if not same.any():
        return None
    first = int(np.argmax(same))
    return int(rid[first]), int(pos[first])


@dataclass
class TraceBatch:
    """A block of trace rows as numpy arrays (T rows, L MoE layers, k routed experts).

    Attributes:
        request_id: [T] int64.
        position: [T] int32.
        token_id: [T] int32, -1 when unknown.
        experts: [T, L, k] int16, rank-r expert of layer l at ``experts[t, l, r]``.
        weights: [T, L, k] float16, descending along the last axis; None when the
            reader was asked to skip them (``iter_batches(weights=False)``).
        extras: other columns that were asked for by name, each [T].
    """

    request_id: np.ndarray
    position: np.ndarray
    token_id: np.ndarray
    experts: np.ndarray
    weights: np.ndarray | None
    extras: dict[str, np.ndarray] = field(default_factory=dict)

    def __len__(self) -> int:
        return int(self.request_id.shape[0])

    @classmethod
    def from_arrays(
        cls,
        request_id,
        position,
        token_id,
        experts,
        weights,
        extras: dict[str, np.ndarray] | None = None,
    ) -> TraceBatch:
        """Build a batch, casting to the schema's dtypes (``experts`` is [T, L, k])."""
        experts = np.asarray(experts)
        if experts.ndim != 3:
            raise SchemaError(f"experts must be [T, L, k], got shape {experts.shape}")
        weights = np.asarray(weights)
        if weights.shape != experts.shape:
            raise SchemaError(f"weights shape {weights.shape} != experts shape {experts.shape}")
        t = experts.shape[0]
        cols = [np.asarray(request_id), np.asarray(position), np.asarray(token_id)]
        for name, col in zip(("request_id", "position", "token_id"), cols, strict=True):
            if col.shape != (t,):
                raise SchemaError(f"{name} must have shape ({t},), got {col.shape}")
        return cls(
            _fit_int(cols[0], "request id", np.int64),
            _fit_int(cols[1], "position"),
            _fit_int(cols[2], "token id"),
            _fit_int(experts, "expert id", np.int16),
            weights.astype(np.float16, copy=False),
            dict(extras or {}),
        )

    @classmethod
    def concat(cls, batches: list[TraceBatch]) -> TraceBatch:
        if not batches:
            raise ValueError("concat needs at least one batch")
        keys = set(batches[0].extras)
        return cls(
            np.concatenate([b.request_id for b in batches]),
            np.concatenate([b.position for b in batches]),
            np.concatenate([b.token_id for b in batches]),
            np.concatenate([b.experts for b in batches]),
            None if batches[0].weights is None else np.concatenate([b.weights for b in batches]),
            {k: np.concatenate([b.extras[k] for b in batches]) for k in keys},
        )

    def select(self, mask_or_index: np.ndarray | slice) -> TraceBatch:
        """Rows picked by a boolean mask, an index array or a slice."""
        m = mask_or_index
        return TraceBatch(
            self.request_id[m],
            self.position[m],
            self.token_id[m],
            self.experts[m],
            None if self.weights is None else self.weights[m],
            {k: v[m] for k, v in self.extras.items()},
        )

    def validate(self, meta: TraceMeta, where: str = "trace") -> None:
        """Raise :class:`SchemaError` if shapes or ids disagree with ``meta``."""
        t = len(self)
        want = (t, meta.num_layers, meta.top_k)
        if self.experts.shape != want:
            raise SchemaError(f"{where}: experts shape {self.experts.shape}, metadata says {want}")
        if self.weights is not None and self.weights.shape != want:
            raise SchemaError(f"{where}: weights shape {self.weights.shape}, metadata says {want}")
        if t == 0:
            return
        lo, hi = int(self.experts.min()), int(self.experts.max())
        if lo < 0 or hi >= meta.num_experts:
            bad = lo if lo < 0 else hi
            raise SchemaError(
                f"{where}: expert id {bad} outside [0, {meta.num_experts}) declared by num_experts"
            )
        lo, hi = int(self.token_id.min()), int(self.token_id.max())
        if lo < -1 or hi >= meta.vocab_size:
            bad = lo if lo < -1 else hi
            raise SchemaError(
                f"{where}: token id {bad} outside [-1, {meta.vocab_size}) (vocab_size)"
            )
        lo = int(self.position.min())
        if lo < 0:
            row = int(np.argmax(self.position < 0))
            raise SchemaError(
                f"{where}: request {int(self.request_id[row])} has negative position {lo}"
            )
        if self.weights is not None and (bad_weight := _bad_weight(self.weights)) is not None:
            row, layer, why = bad_weight
            raise SchemaError(
                f"{where}: the gate weights of request {int(self.request_id[row])} at position "
                f"{int(self.position[row])}, MoE layer {layer} "
                f"({[float(w) for w in self.weights[row, layer]]}) {why}"
            )
        repeated = _repeated_expert(self.experts)
        if repeated is not None:
            row, layer = repeated
            raise SchemaError(
                f"{where}: the token of request {int(self.request_id[row])} at position "
                f"{int(self.position[row])} routes twice to one expert at MoE layer {layer} "
                f"({self.experts[row, layer].tolist()}); a token's k experts must be distinct"
            )

    def to_table(
        self, meta: TraceMeta, extra_types: Mapping[str, pa.DataType] | None = None
    ) -> pa.Table:
        if self.weights is None:
            raise SchemaError("cannot write a batch read without its weights column")
        schema = arrow_schema(meta)
        width = meta.row_width
        t = len(self)
        experts = pa.FixedSizeListArray.from_arrays(
            pa.array(np.ascontiguousarray(self.experts).reshape(t * width), pa.int16()), width
        )
        weights = pa.FixedSizeListArray.from_arrays(
            pa.array(np.ascontiguousarray(self.weights).reshape(t * width), pa.float16()), width
        )
        arrays = [
            pa.array(self.request_id, pa.int64()),
            pa.array(self.position, pa.int32()),
            pa.array(self.token_id, pa.int32()),
            experts.cast(schema.field("experts").type),
            weights.cast(schema.field("weights").type),
        ]
        table = pa.Table.from_arrays(arrays, schema=schema)
        for name, values in self.extras.items():
            table = table.append_column(name, _extra_array(values, (extra_types or {}).get(name)))
        return table.replace_schema_metadata(schema.metadata)


def _extra_array(values: np.ndarray, dtype: pa.DataType | None) -> pa.Array:
    """An extra column as Arrow, of ``dtype`` where given (the type it was read with: numpy
    holds an integer column with nulls as floats with NaN, and a guess wrote it back as
    doubles), else of the type Arrow infers."""
    if dtype is None:
        return pa.array(values)
    try:  # NaN is a null again, except in a floating column, where it is a value
        return pa.array(values, type=dtype, from_pandas=not pa.types.is_floating(dtype))
    except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError):
        return pa.array(values)


def _list_values(arr: pa.Array, rows: int, meta: TraceMeta, dtype) -> np.ndarray:
    values = arr.flatten().to_numpy(zero_copy_only=False)
    return values.astype(dtype, copy=False).reshape(rows, meta.num_layers, meta.top_k)


def _null_column(rb: pa.RecordBatch) -> str | None:
    """The first required column of ``rb`` holding a null (a list's elements included)."""
    names = rb.schema.names
    for name in REQUIRED_COLUMNS:
        if name in names:
            arr = rb.column(names.index(name))
            if arr.null_count or (pa.types.is_fixed_size_list(arr.type) and arr.values.null_count):
                return name
    return None


def _batch_from_record_batch(
    rb: pa.RecordBatch, meta: TraceMeta, extras: tuple[str, ...], where: str = "trace"
) -> TraceBatch:
    t = rb.num_rows
    names = rb.schema.names
    null = _null_column(rb)
    if null is not None:
        raise SchemaError(f"{where}: column {null} holds nulls; a v1 trace has none")

    def col(name: str) -> np.ndarray:
        return rb.column(names.index(name)).to_numpy(zero_copy_only=False)

    weights = None
    if "weights" in names:
        weights = _list_values(rb.column(names.index("weights")), t, meta, np.float16)
    return TraceBatch(
        col("request_id").astype(np.int64, copy=False),
        col("position").astype(np.int32, copy=False),
        col("token_id").astype(np.int32, copy=False),
        _list_values(rb.column(names.index("experts")), t, meta, np.int16),
        weights,
        {e: col(e) for e in extras},
    )


def _unreadable(part: Path, e: BaseException) -> SchemaError:
    detail = str(e).splitlines()[0] if str(e) else type(e).__name__
    return SchemaError(f"{part}: unreadable Parquet data ({detail}); the file is damaged")


def read_columns(part: Path, columns: list[str] | None = None) -> pa.Table:
    """``columns`` (None: all) of one Parquet file; SchemaError naming it if its data cannot
    be decoded."""
    try:
        return pq.read_table(part, columns=columns)
    except (OSError, pa.ArrowException) as e:
        raise _unreadable(part, e) from None


def _part_batches(part: Path, batch_rows: int, columns: list[str]) -> Iterator[pa.RecordBatch]:
    """The record batches of one part; SchemaError naming the part if a page cannot be
    decoded (pyarrow raised ArrowInvalid, a traceback, or an OSError without the file name)."""
    batches = pq.ParquetFile(part).iter_batches(batch_size=batch_rows, columns=columns)
    while True:
        try:
            rb = next(batches, None)
        except (OSError, pa.ArrowException) as e:
            raise _unreadable(part, e) from None
        if rb is None:
            return
        yield rb


def _part_order(part: Path) -> tuple[int, str]:
    """Numbered parts by their number (part-9 before part-10), others after them by name."""
    number = _part_number(part)
    return (number, "") if number is not None else (1 << 62, part.name)


def _part_number(part: Path) -> int | None:
    """N of a part named ``part-N.parquet``; None for a part named otherwise."""
    m = _PART_RE.match(part.name)
    return int(m.group(1)) if m else None


def trace_parts(path: str | Path) -> list[Path]:
    """The Parquet files that make up the trace at ``path`` (a file or a directory)."""
    p = Path(path)
    if p.is_file():
        return [p]
    if p.is_dir():
        parts = sorted((q for q in p.glob(PART_GLOB) if q.is_file()), key=_part_order)
        if not parts:
            raise InputError(f"{p}: directory holds no {PART_GLOB} files; it is not a trace")
        return parts
    raise InputError(f"{p}: no such trace file or directory")


def _names_counts_schema(raw: bytes) -> bool:
    """Whether 'moeplan' metadata is a counts table's (``"schema": "counts"``), however its
    JSON is spaced (a byte match missed compact JSON, which then 'lacked model'); metadata
    that is not JSON is left to :meth:`TraceMeta.from_json` to refuse."""
    try:
        d = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return False
    return isinstance(d, dict) and d.get("schema") == "counts"


def _read_part_meta(part: Path) -> tuple[TraceMeta, pa.Schema, int]:
    try:
        pf = pq.ParquetFile(part)
    except (pa.ArrowInvalid, OSError) as e:
        raise SchemaError(f"{part}: not a Parquet file ({str(e).splitlines()[0]})") from None
    schema = pf.schema_arrow
    md = schema.metadata or {}
    if META_KEY not in md:
        # columns no trace has: a counts table, whole or with a column missing (which was
        # then called a trace without metadata)
        if {"layer", "expert", "count"} & set(schema.names):
            missing = [c for c in COUNTS_COLUMNS if c not in schema.names]
            if missing:
                raise SchemaError(
                    f"{part}: a token-expert counts table lacks column(s) "
                    f"{', '.join(missing)} (it needs {', '.join(COUNTS_COLUMNS)})"
                )
            raise SchemaError(f"{part}: this is a token-expert counts table, not a v1 trace")
        raise SchemaError(f"{part}: not a v1 trace (no 'moeplan' metadata in the Parquet schema)")
    raw = md[META_KEY]
    if _names_counts_schema(raw):
        raise SchemaError(f"{part}: this is a token-expert counts table, not a v1 trace")
    meta = TraceMeta.from_json(raw, where=str(part))
    check_arrow_schema(schema, meta, str(part))
    _check_null_statistics(pf.metadata, part)
    return meta, schema, pf.metadata.num_rows


def check_trace_output(out: Path, *, inputs: tuple = ()) -> bool:
    """Check that a trace may be written at ``out`` (``overwrite`` given); True for one file.

    ``out`` ending in ``.parquet`` is one file, anything else a directory of parts. Either
    replaces only an earlier trace (:func:`planner._io.check_output`); a file must also read
    as one, so ``--force`` never replaces another Parquet file (a counts table, a user's data).
    """
    single = out.suffix == ".parquet"
    check_output(
        out,
        marker=None if single else PART_GLOB,
        what="trace",
        inputs=inputs,
        members=TRACE_MEMBERS,
    )
    if single and out.is_file() and out.stat().st_size > 0:
        try:
            _read_part_meta(out)
        except (SchemaError, InputError):
            raise InputError(
                f"{out}: exists and is not a trace (--force replaces only an earlier trace); "
                "choose another output path"
            ) from None
    return single


def _required_column_of(path: str) -> str | None:
    """The required column a Parquet leaf path belongs to, or None: the column itself, or a
    list column's element ("experts.list.element"); not the first dotted word, which made an
    extra column "token_id.orig" the token_id column."""
    for name in REQUIRED_COLUMNS:
        if path == name or path.startswith(name + ".list."):
            return name
    return None


def _check_null_statistics(md: pq.FileMetaData, part: Path) -> None:
    """SchemaError if the footer's statistics count a null in a required column.

    Free (the footer is already read); parts written without statistics are checked batch
    by batch instead (:func:`_null_column`).
    """
    for g in range(md.num_row_groups):
        rg = md.row_group(g)
        for c in range(rg.num_columns):
            chunk = rg.column(c)
            name = _required_column_of(chunk.path_in_schema)
            if name is None:
                continue
            stats = chunk.statistics
            if stats is not None and stats.has_null_count and stats.null_count > 0:
                raise SchemaError(
                    f"{part}: column {name} holds {stats.null_count} null(s) in row group {g}; "
                    "a v1 trace has none"
                )


class Trace:
    """A v1 trace on disk, opened lazily: metadata is read now, rows when iterated.

    Attributes:
        path: the file or directory given.
        parts: its Parquet files, in order.
        meta: the shared :class:`TraceMeta`.
        num_rows: token occurrences over all parts.
    """

    def __init__(self, path: str | os.PathLike[str], *, unfinished: bool = False):
        self.path = Path(path)
        if not unfinished:
            _check_finished(self.path)
        self.parts = trace_parts(self.path)
        metas = [_read_part_meta(p) for p in self.parts]
        self.meta = metas[0][0]
        for part, (meta, _, _) in zip(self.parts[1:], metas[1:], strict=True):
            if meta.fingerprint() != self.meta.fingerprint():
                raise MismatchError(
                    f"{part}: part from a different model or shape "
                    f"({meta.model!r}, L={meta.num_layers}, N={meta.num_experts}, k={meta.top_k}, "
                    f"V={meta.vocab_size}) than {self.parts[0].name} ({self.meta.model!r}, "
                    f"L={self.meta.num_layers}, N={self.meta.num_experts}, k={self.meta.top_k}, "
                    f"V={self.meta.vocab_size})"
                )
            if differ := meta.layer_mismatch(self.meta, (part.name, self.parts[0].name)):
                raise MismatchError(f"{part}: part of other MoE layers: {differ}")
        self._schemas = [s for _, s, _ in metas]
        self.part_rows = [n for _, _, n in metas]
        self.num_rows = sum(self.part_rows)

    def __repr__(self) -> str:
        return f"Trace({str(self.path)!r}, rows={self.num_rows}, meta={self.meta})"

    def extra_columns(self, *, in_any_part: bool = False) -> list[str]:
        """Non-required columns every part has (``in_any_part``: some part has), in the
        order the parts first name them."""
        names = dict.fromkeys(
            n for s in self._schemas for n in s.names if n not in REQUIRED_COLUMNS
        )
        if in_any_part:
            return list(names)
        return [n for n in names if all(n in s.names for s in self._schemas)]

    def extra_types(self) -> dict[str, pa.DataType]:
        """Arrow type of every extra column some part has, as the first such part stores it."""
        types: dict[str, pa.DataType] = {}
        for schema in self._schemas:
            for n in schema.names:
                if n not in REQUIRED_COLUMNS:
                    types.setdefault(n, schema.field(n).type)
        return types

    def missing_parts(self) -> list[str]:
        """The numbered parts a directory's numbering skips, a gap an entry
        (``part-00001.parquet`` where parts 0 and 2 are there; ``part-00003.parquet to
        part-00005.parquet``): :class:`TraceWriter` numbers parts from 0 without gaps, so a
        gap is most likely a part lost or removed. Parts named otherwise say nothing; a
        single-file trace has none."""
        if not self.path.is_dir():
            return []
        numbers = sorted({n for p in self.parts if (n := _part_number(p)) is not None})
        gaps = []
        for before, after in zip([-1, *numbers], numbers, strict=False):
            first, last = f"part-{before + 1:05d}.parquet", f"part-{after - 1:05d}.parquet"
            if after - before == 2:
                gaps.append(first)
            elif after - before > 2:
                gaps.append(f"{first} to {last}")
        return gaps

    def parts_without(self, column: str) -> list[Path]:
        """The parts that lack ``column``."""
        return [p for p, s in zip(self.parts, self._schemas, strict=True) if column not in s.names]

    def iter_batches(
        self,
        batch_rows: int | None = None,
        *,
        extras: tuple[str, ...] = (),
        weights: bool = True,
        validate: bool = True,
        fill_missing: bool = False,
    ) -> Iterator[TraceBatch]:
        """Stream the trace as :class:`TraceBatch` blocks of at most ``batch_rows`` rows
        (None: :func:`batch_rows_for` the trace's model, fewer rows for a wide model).

        ``weights=False`` skips the gate-weight column (``batch.weights`` is None): pyarrow
        decodes float16 lists several times slower than all other columns together (reading
        them would slow ``fit`` by half), and most stages (fit, evaluate) never read the
        weights. With ``validate`` the weights of each part's first
        ``WEIGHT_SAMPLE_ROWS`` rows are still checked, so that a trace whose experts are not
        in descending gate-weight order (rank 0, the top-1 expert the n-gram statistics
        read, would be another) is refused by every stage; ``moeplan trace info`` and
        ``trace split`` check every row. ``extras`` a part lacks are refused, or with
        ``fill_missing`` read as nulls (object arrays of None) there.
        """
        if batch_rows is None:
            batch_rows = batch_rows_for(self.meta)
        if not is_integer(batch_rows) or not 1 <= batch_rows <= 2**40:
            raise InputError(f"batch_rows={batch_rows!r} must be an integer in [1, 2**40]")
        for part, schema in zip(self.parts, self._schemas, strict=True):
            missing = [e for e in extras if e not in schema.names]
            if missing and not fill_missing:
                raise SchemaError(f"{part}: has no column(s) {', '.join(missing)}")
            present = tuple(e for e in extras if e in schema.names)
            columns = [c for c in REQUIRED_COLUMNS if weights or c != "weights"] + list(present)
            if validate and not weights:
                for rb in _part_batches(part, WEIGHT_SAMPLE_ROWS, list(REQUIRED_COLUMNS)):
                    _batch_from_record_batch(rb, self.meta, (), str(part)).validate(
                        self.meta, where=str(part)
                    )
                    break
            for rb in _part_batches(part, batch_rows, columns):
                batch = _batch_from_record_batch(rb, self.meta, present, str(part))
                for e in missing:  # fill_missing: nulls where the part has no such column
                    batch.extras[e] = np.full(rb.num_rows, None, dtype=object)
                if missing:
                    batch.extras = {e: batch.extras[e] for e in extras}  # the order asked
                if validate:
                    batch.validate(self.meta, where=str(part))
                yield batch

    def read_all(self, *, extras: tuple[str, ...] = ()) -> TraceBatch:
        """Every row in memory at once (for small traces and tests)."""
        batches = list(self.iter_batches(extras=extras))
        if not batches:
            return TraceBatch.from_arrays(
                np.zeros(0), np.zeros(0), np.zeros(0),
                np.zeros((0, self.meta.num_layers, self.meta.top_k)),
                np.zeros((0, self.meta.num_layers, self.meta.top_k)),
            )  # fmt: skip
        return TraceBatch.concat(batches)

    def request_ids(self) -> np.ndarray:
        """Sorted distinct request ids; SchemaError if two rows share a (request, position)
        pair, since a trace holds one row per token occurrence (:meth:`request_rows`)."""
        return self.request_rows()[0]

    def request_rows(self) -> tuple[np.ndarray, np.ndarray]:
        """(sorted distinct request ids [R], each one's rows [R]); SchemaError if two rows
        share a (request, position) pair, since a trace holds one row per token occurrence.

        Reads two columns only (about 20 bytes a row at its peak). ``trace info``, ``trace
        split``, ``fit`` and ``compare`` call it first (``evaluate`` and ``trace shuffle``
        read the same columns through :meth:`occurrences`), so a repeated occurrence is
        refused before the work rather than counted twice.
        """
        return np.unique(self.occurrences()[0], return_counts=True)

    def occurrences(self) -> tuple[np.ndarray, np.ndarray]:
        """(request_id [T], position [T]) of every row, in trace order; SchemaError if two
        rows share a (request, position) pair or a part's column holds nulls."""
        columns = [read_columns(p, ["request_id", "position"]) for p in self.parts]
        if not columns:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        for part, c in zip(self.parts, columns, strict=True):
            # a part written without statistics escapes the footer's null check, and
            # to_numpy() would turn a null into NaN
            null = _null_column(c)
            if null is not None:
                raise SchemaError(f"{part}: column {null} holds nulls; a v1 trace has none")
        rid = np.concatenate([c.column(0).to_numpy() for c in columns])
        pos = np.concatenate([c.column(1).to_numpy() for c in columns])
        del columns
        check_distinct_occurrences(rid, pos, str(self.path))
        return rid, pos


def open_trace(path: str | os.PathLike[str], *, unfinished: bool = False) -> Trace:
    """Open the v1 trace at ``path``; raise a one-line error if it is not one.

    A trace directory a ``moeplan profile`` run started and has not finished (stopped, or
    still running) is refused unless ``unfinished`` (the run's own resume reads it).
    """
    return Trace(path, unfinished=unfinished)


def _check_finished(path: Path) -> None:
    """InputError if ``path`` is a profile run's directory whose settings say it is unfinished.

    The profile writes ``"finished": false`` into its settings file before its first part and
    true after its last; a settings file without the key (older runs) counts as finished. A
    part file named on its own is checked against its directory's settings.
    """
    run = path if path.is_dir() else path.parent
    settings = run / PROFILE_SETTINGS_FILE
    if not settings.is_file():
        return
    try:
        finished = json.loads(settings.read_text()).get("finished", True)
    except (ValueError, OSError, AttributeError, RecursionError):
        return  # not a profile's settings file: the trace's own checks decide
    if finished is False:
        raise InputError(
            f"{path}: the moeplan profile run writing this trace{'' if run == path else ' part'}"
            " has not finished (stopped or still running); finish it with moeplan profile "
            "--resume and the same arguments"
        )


def write_trace(
    path: str | Path,
    meta: TraceMeta,
    batch: TraceBatch,
    extra_types: Mapping[str, pa.DataType] | None = None,
) -> Path:
    """Write ``batch`` as a single-file trace at ``path`` (atomically); ``extra_types``:
    the Arrow type of each extra column (default: inferred from its values)."""
    batch.validate(meta, where=str(path))
    table = batch.to_table(meta, extra_types)
    with atomic_path(path) as tmp:
        pq.write_table(table, tmp, compression="zstd")
    return Path(path)


class TraceWriter:
    """Append parts to a trace directory, each part written atomically.

    Existing parts must belong to the same model; new parts are numbered after them, so a
    writer can continue an interrupted run.
    """

    def __init__(
        self,
        directory: str | Path,
        meta: TraceMeta,
        extra_types: Mapping[str, pa.DataType] | None = None,
    ):
        self.directory = Path(directory)
        self.meta = meta
        self.extra_types = dict(extra_types or {})
        if self.directory.exists() and not self.directory.is_dir():
            raise InputError(f"{self.directory}: exists and is not a directory")
        self.directory.mkdir(parents=True, exist_ok=True)
        existing = sorted(self.directory.glob(PART_GLOB))
        if existing:
            other = Trace(self.directory, unfinished=True).meta
            if other.fingerprint() != meta.fingerprint():
                raise MismatchError(
                    f"{self.directory}: already holds a trace of {other.model!r}; "
                    f"refusing to add parts of {meta.model!r}"
                )
            if differ := other.layer_mismatch(meta, ("its parts", "the new ones")):
                raise MismatchError(
                    f"{self.directory}: already holds a trace of other MoE layers ({differ}); "
                    "refusing to add parts"
                )
        indices = [n for q in existing if (n := _part_number(q)) is not None]
        self._next = max(indices, default=-1) + 1

    def write(self, batch: TraceBatch) -> Path:
        """Write ``batch`` as the next ``part-NNNNN.parquet`` and return its path."""
        dest = self.directory / f"part-{self._next:05d}.parquet"
        write_trace(dest, self.meta, batch, self.extra_types)
        self._next += 1
        return dest

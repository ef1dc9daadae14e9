"""Turn SGLang expert-distribution ``per_token`` dumps into v1 traces.

SGLang records routing when started with ``--expert-distribution-recorder-mode per_token``
and dumped through ``/dump_expert_distribution_record``. The format below was read from
``sgl-project/sglang``, file ``python/sglang/srt/eplb/expert_distribution.py`` at commit
``02295fe5ac5ccff3e8829800d50450351c56fb53`` (classes ``_DetailSinglePassGatherer`` and
``_DetailAccumulator``). The older ``python/sglang/srt/managers/expert_distribution.py``
(commit ``001c034f915dfd41fade2553f36245f5169d6f3d``) wrote only per-expert counts to CSV,
which hold no per-token routing and cannot be ingested.

Each rank writes ``expert_distribution_recorder_{time}_{rank}.pt`` with ``torch.save``::

    {
      "records": [                       # one per forward pass on that rank
        {
          "forward_pass_id": int,
          "rank": int,
          "gatherer_key": "primary",
          "input_ids": list[int],        # [T] tokens of the pass (all sequences concatenated)
          "positions": list[int],        # [T] position of each token in its sequence
          "extend_seq_lens": list[int] | None,   # tokens per sequence; None for decode
          "forward_mode": int,           # ForwardMode: 1 EXTEND, 2 DECODE, 3 MIXED, 4 IDLE, ...
          "topk_ids_of_layer": int32 tensor [num_layers, T, 8],  # PHYSICAL expert ids, -1 unset
          "misc_objects": list[dict],
          "global_physical_count": tensor [num_layers, num_physical_experts],
        }, ...
      ],
      "last_physical_to_logical_map": int tensor [num_layers, num_physical_experts],
    }

``num_layers`` counts every decoder layer (``config.num_hidden_layers``): dense layers never
call the recorder and stay -1, and the top-k width is fixed at 8 with unused columns -1.

Conversion rules:

- MoE layers are the layers holding any expert id; their model indices become
  ``moe_layer_indices``. k is the number of leading top-k columns that hold ids.
- Physical ids map to logical experts with ``last_physical_to_logical_map`` (several
  physical slots may hold replicas of one logical expert). N = the map's largest id + 1.
  The map is the one in force at dump time: if EPLB rebalanced while recording, earlier
  passes map wrongly; a logical expert repeated within a token's layer is reported.
- A token whose ids are -1 at any used (MoE layer, column) was padding and is dropped.
- SGLang records expert ids, not gate weights: every weight is 1/k (equal, so
  "descending" holds), and the trace's ``source`` says so.
- Request ids: the dump has none (``rids`` is a TODO upstream), so each *segment* of a
  forward pass gets a new id, in (forward_pass_id, rank) order. Segments come from
  ``extend_seq_lens`` when it sums to the pass's token count; in a decode pass every
  token is its own segment; otherwise a segment starts wherever the position is not the
  previous position + 1. A chunked-prefill continuation or a decode step is therefore not
  linked to its prompt's id; positions are kept as recorded.
- With tensor parallelism every rank records the same pass: records of one forward pass
  with identical tokens, positions and ids are kept once (the lowest rank); the same
  rank's copies (separate recordings of the same traffic) are all kept.
- Token ids outside [0, vocab_size) become -1 (unknown) when ``vocab_size`` is given;
  otherwise vocab_size is the largest id + 1 (pass the model's real size so the trace
  combines with other traces of the model).

Dumps hold only tensors, lists, ints, strings and None, so they load with
``torch.load(..., weights_only=True)``; nothing is unpickled beyond that.
"""

from __future__ import annotations

import dataclasses
import hashlib
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from planner._checks import is_integer
from planner._io import atomic_path, refuse_existing
from planner.errors import InputError, MismatchError, SchemaError
from planner.trace.io import (
    TraceBatch,
    TraceWriter,
    check_distinct_occurrences,
    check_trace_output,
    write_trace,
)
from planner.trace.schema import TraceMeta

DUMP_GLOB = "expert_distribution_recorder_*.pt"
FORWARD_MODE_DECODE = 2  # sglang ForwardMode.DECODE (EXTEND=1, DECODE=2, MIXED=3, IDLE=4)
_MAP_KEY = "last_physical_to_logical_map"
_INT32 = np.iinfo(np.int32)


@dataclass(frozen=True)
class SglangIngestStats:
    """What an ingest read and wrote.

    Attributes:
        path: the trace written (None when only converted).
        files: dump files read.
        records: forward-pass records read, over all files.
        duplicate_records: records dropped as tensor-parallel replicas.
        tokens: rows in the trace.
        dropped_tokens: rows dropped because an id was -1 (padding).
        unknown_tokens: token ids outside [0, vocab_size), written as -1.
        requests: request ids assigned (segments, see the module docstring).
        num_physical_experts: physical slots per layer in the dump's map.
        vocab_inferred: True when vocab_size was taken from the largest token id.
        meta: metadata of the trace.
    """

    path: Path | None
    files: tuple[str, ...]
    records: int
    duplicate_records: int
    tokens: int
    dropped_tokens: int
    unknown_tokens: int
    requests: int
    num_physical_experts: int
    vocab_inferred: bool
    meta: TraceMeta

    def summary(self) -> dict:
        """JSON-ready summary for the CLI."""
        m = self.meta
        return {
            "path": None if self.path is None else str(self.path),
            "model": m.model,
            "files": len(self.files),
            "records": self.records,
            "duplicate_records": self.duplicate_records,
            "tokens": self.tokens,
            "dropped_tokens": self.dropped_tokens,
            "unknown_tokens": self.unknown_tokens,
            "requests": self.requests,
            "num_layers": m.num_layers,
            "moe_layer_indices": list(m.moe_layer_indices),
            "num_experts": m.num_experts,
            "num_physical_experts": self.num_physical_experts,
            "top_k": m.top_k,
            "vocab_size": m.vocab_size,
            "vocab_inferred": self.vocab_inferred,
        }


# ---------------------------------------------------------------------------------------
# Reading and validating dumps.


def dump_files(paths: Sequence[str | Path]) -> list[Path]:
    """The dump files named by ``paths``: files as given, directories expanded by glob;
    a file named twice (a directory and one of its files) is read once, since a rank's
    repeated records are all kept (:func:`_drop_replicas`)."""
    if not paths:
        raise InputError("sglang: no dump file or directory given")
    out: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            found = sorted(p.glob(DUMP_GLOB))
            if not found:
                raise InputError(f"{p}: directory holds no {DUMP_GLOB} files")
            out.extend(found)
        elif p.is_file():
            out.append(p)
        else:
            raise InputError(f"{p}: no such SGLang dump file or directory")
    unique: dict[Path, Path] = {}
    for p in out:
        unique.setdefault(p.resolve(), p)
    return list(unique.values())


def _to_numpy(value, what: str, where: Path, ndim: int) -> np.ndarray:
    import torch

    def not_integers(shape: tuple, dtype: object) -> SchemaError:
        return SchemaError(
            f"{where}: {what} has shape {shape} and dtype {dtype}, expected a {ndim}-d integer array"
        )

    if isinstance(value, torch.Tensor):
        if value.is_floating_point() or value.is_complex() or value.dtype == torch.bool:
            raise not_integers(tuple(value.shape), value.dtype)  # before .numpy(): no bfloat16
        arr = value.detach().cpu().numpy()
    elif isinstance(value, list | tuple):
        try:
            arr = np.asarray(value)
        except ValueError:  # rows of different lengths
            raise SchemaError(
                f"{where}: {what} is a ragged list (rows of different lengths), expected a "
                f"{ndim}-d integer array"
            ) from None
        if arr.size == 0:
            arr = arr.reshape((0,) * ndim).astype(np.int64)
    else:
        raise SchemaError(f"{where}: {what} is a {type(value).__name__}, expected a tensor or list")
    if arr.ndim != ndim or not (np.issubdtype(arr.dtype, np.integer)):
        raise not_integers(arr.shape, arr.dtype)
    if arr.dtype == np.uint64 and arr.size and arr.max() > np.iinfo(np.int64).max:
        # astype(int64) would wrap it to a negative id (-1: padding, an unknown token)
        raise SchemaError(f"{where}: {what} value {int(arr.max())} does not fit int64")
    return arr.astype(np.int64, copy=False)


def _int_field(rec: dict, key: str, default: int, where: str) -> int:
    """``rec[key]`` as an int (``default`` when absent); SchemaError if it is not one."""
    value = rec.get(key, default)
    if not is_integer(value):
        raise SchemaError(f"{where}: {key} is {value!r}, expected an integer")
    return int(value)


def _check_int32(values: np.ndarray, what: str, where: str) -> None:
    """SchemaError unless every value fits the trace's int32 column."""
    if values.size and (values.min() < _INT32.min or values.max() > _INT32.max):
        bad = int(values.min()) if values.min() < _INT32.min else int(values.max())
        raise SchemaError(
            f"{where}: {what} value {bad} does not fit the trace's int32 column "
            f"[{_INT32.min}, {_INT32.max}]"
        )


def load_dump(path: str | Path) -> tuple[list[dict], np.ndarray]:
    """Read one ``per_token`` dump: (records with numpy arrays, physical_to_logical [L, P]).

    Raises :class:`SchemaError` with one line if the file is not such a dump.
    """
    import torch

    path = Path(path)
    if not path.is_file():
        raise InputError(f"{path}: no such SGLang dump file")
    with path.open("rb") as fh:
        magic = fh.read(2)
    # torch.save writes a zip archive (PK..) or, in the legacy format, a pickle (0x80 ..).
    if not (zipfile.is_zipfile(path) or magic[:1] == b"\x80"):
        raise SchemaError(f"{path}: not a torch.save file (expected an SGLang per_token dump)")
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - torch.load raises many unrelated types
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        detail = next((ln for ln in lines if "Unsupported" in ln), lines[0] if lines else "")
        raise SchemaError(
            f"{path}: cannot be loaded with torch.load(weights_only=True), so it is not an "
            f"SGLang per_token dump ({detail[:200] or type(e).__name__})"
        ) from None
    if not isinstance(obj, dict):
        raise SchemaError(f"{path}: holds a {type(obj).__name__}, not an SGLang dump dict")
    if "records" not in obj:
        if "logical_count" in obj:
            raise SchemaError(
                f"{path}: a 'stat' mode dump (expert counts only); record with "
                "--expert-distribution-recorder-mode per_token to get per-token routing"
            )
        raise SchemaError(
            f"{path}: not an SGLang per_token dump (keys {sorted(map(str, obj))[:6]}; "
            "expected 'records' and 'last_physical_to_logical_map')"
        )
    if _MAP_KEY not in obj:
        raise SchemaError(f"{path}: lacks '{_MAP_KEY}' needed to map physical to logical experts")
    p2l = _to_numpy(obj[_MAP_KEY], _MAP_KEY, path, 2)
    if 0 in p2l.shape:
        raise SchemaError(
            f"{path}: '{_MAP_KEY}' has shape {tuple(p2l.shape)}; expected [layers, physical "
            "experts] with at least one of each"
        )
    records = obj["records"]
    if not isinstance(records, list):
        raise SchemaError(f"{path}: 'records' is a {type(records).__name__}, expected a list")
    out: list[dict] = []
    for i, rec in enumerate(records):
        where = f"{path} record {i}"
        if not isinstance(rec, dict):
            raise SchemaError(f"{where}: is a {type(rec).__name__}, expected a dict")
        if "topk_ids_of_layer" not in rec:
            if "global_physical_count" in rec:
                raise SchemaError(
                    f"{path}: a 'per_pass' mode dump (counts per pass only); record with "
                    "--expert-distribution-recorder-mode per_token"
                )
            raise SchemaError(f"{where}: lacks 'topk_ids_of_layer'")
        for key in ("input_ids", "positions"):
            if key not in rec:
                raise SchemaError(f"{where}: lacks '{key}'")
        topk = _to_numpy(rec["topk_ids_of_layer"], "topk_ids_of_layer", path, 3)
        input_ids = _to_numpy(rec["input_ids"], "input_ids", path, 1)
        positions = _to_numpy(rec["positions"], "positions", path, 1)
        t = input_ids.shape[0]
        if topk.shape[0] != p2l.shape[0] or topk.shape[1] != t or positions.shape[0] != t:
            raise SchemaError(
                f"{where}: topk_ids_of_layer {topk.shape}, {t} input_ids and "
                f"{positions.shape[0]} positions disagree with the map's {p2l.shape[0]} layers"
            )
        if out and topk.shape[2] != out[0]["topk"].shape[2]:
            raise SchemaError(
                f"{where}: topk_ids_of_layer has {topk.shape[2]} columns per token, record 0 "
                f"has {out[0]['topk'].shape[2]}; every record of a dump has the same width"
            )
        for key, arr in (("input_ids", input_ids), ("positions", positions)):
            _check_int32(arr, key, where)
        esl = rec.get("extend_seq_lens")
        out.append(
            {
                "forward_pass_id": _int_field(rec, "forward_pass_id", i, where),
                "rank": _int_field(rec, "rank", 0, where),
                "forward_mode": rec.get("forward_mode"),
                "input_ids": input_ids,
                "positions": positions,
                "extend_seq_lens": None
                if esl is None
                else _to_numpy(esl, "extend_seq_lens", path, 1),
                "topk": topk,
            }
        )
    return out, p2l


# ---------------------------------------------------------------------------------------
# Conversion.


def segment_starts(positions: np.ndarray, extend_seq_lens, forward_mode) -> np.ndarray:
    """[T] bool, True where a new sequence (request id) starts in one forward pass.

    ``extend_seq_lens`` wins when it sums to T and its segments' positions increase; a
    decode pass has one token per sequence; otherwise a sequence starts wherever the
    position is not the previous one + 1.
    """
    t = positions.shape[0]
    starts = np.zeros(t, bool)
    if t == 0:
        return starts
    if (
        extend_seq_lens is not None
        and ((extend_seq_lens >= 0) & (extend_seq_lens <= t)).all()  # no int64 wrap in the sum
        and extend_seq_lens.sum() == t
    ):
        offsets = np.cumsum(extend_seq_lens)[:-1]
        starts[0] = True
        starts[offsets[offsets < t]] = True
        inside = ~starts[1:]
        if (positions[1:][inside] > positions[:-1][inside]).all():
            return starts
        # lengths that contradict the positions (a segment whose positions restart) could
        # give one request two rows at a position: the positions decide
        starts[:] = False
    if forward_mode == FORWARD_MODE_DECODE:
        starts[:] = True
        return starts
    starts[0] = True
    starts[1:] = positions[1:] != positions[:-1] + 1
    return starts


def _record_digest(rec: dict) -> bytes:
    h = hashlib.sha256()
    for key in ("input_ids", "positions", "topk"):
        arr = np.ascontiguousarray(rec[key])
        h.update(str(arr.shape).encode())
        h.update(arr.tobytes())
    return h.digest()


def _read_dumps(files: list[Path]) -> tuple[list[dict], np.ndarray]:
    """Every record of ``files`` and their shared physical_to_logical map [L, P]."""
    records: list[dict] = []
    p2l: np.ndarray | None = None
    p2l_file: Path | None = None
    width_file: Path | None = None
    for f in files:
        recs, m = load_dump(f)
        if p2l is None:
            p2l, p2l_file = m, f
        elif m.shape != p2l.shape or not np.array_equal(m, p2l):
            raise MismatchError(
                f"{f}: physical_to_logical map {m.shape} differs from {p2l_file}'s {p2l.shape}; "
                "ingest dumps recorded under one expert placement together"
            )
        if recs and width_file is None:
            width_file = f
        elif recs and recs[0]["topk"].shape[2] != records[0]["topk"].shape[2]:
            raise MismatchError(
                f"{f}: topk_ids_of_layer has {recs[0]['topk'].shape[2]} columns per token, "
                f"{width_file}'s records have {records[0]['topk'].shape[2]}; ingest dumps of "
                "one recorder together"
            )
        records.extend(recs)
    assert p2l is not None  # dump_files never returns an empty list
    return records, p2l


def _drop_replicas(records: list[dict]) -> list[dict]:
    """Records in (forward_pass_id, rank) order, each pass's identical copies kept once.

    Under tensor parallelism every rank records the same tokens and ids for a pass: a copy
    from another rank than the one kept is a replica. One rank records a pass once, so a
    copy from the same rank is another recording (the same traffic replayed after a
    restart, which resets ``forward_pass_id``) and is kept; it had been dropped as a
    replica, which skewed token frequencies.
    """
    ranks_kept: dict[tuple[int, bytes], set[int]] = {}
    kept = []
    for rec in sorted(records, key=lambda r: (r["forward_pass_id"], r["rank"])):
        ranks = ranks_kept.setdefault((rec["forward_pass_id"], _record_digest(rec)), set())
        if not ranks or rec["rank"] in ranks:
            ranks.add(rec["rank"])
            kept.append(rec)
    return kept


def _routing_shape(records: list[dict], p2l: np.ndarray, where: Path) -> tuple[np.ndarray, int]:
    """(model indices of the MoE layers [L], k): the layers and leading columns holding ids."""
    layer_used = np.zeros(p2l.shape[0], bool)
    col_used = np.zeros(records[0]["topk"].shape[2], bool)
    for rec in records:
        valid = rec["topk"] >= 0
        layer_used |= valid.any(axis=(1, 2))
        col_used |= valid.any(axis=(0, 1))
    moe_layers = np.flatnonzero(layer_used)
    if moe_layers.size == 0:
        raise SchemaError(f"{where}: every expert id is -1; no MoE layer was recorded")
    k = int(col_used.sum())
    if not col_used[:k].all():
        raise SchemaError(
            f"{where}: top-k columns {np.flatnonzero(col_used).tolist()} hold ids; "
            "expected the leading columns"
        )
    return moe_layers, k


def convert_sglang(
    dumps: Sequence[str | Path],
    *,
    model: str = "sglang",
    vocab_size: int | None = None,
    skip_decode: bool = False,
) -> tuple[TraceMeta, TraceBatch, SglangIngestStats]:
    """Read ``per_token`` dumps and build the trace rows in memory (rules: module docstring).

    Returns (meta, batch, stats); ``batch.experts`` holds LOGICAL expert ids [T, L, k].
    """
    if vocab_size is not None and (not is_integer(vocab_size) or vocab_size < 1):
        raise InputError(f"sglang: vocab_size={vocab_size!r} must be a positive integer")
    vocab_size = None if vocab_size is None else int(vocab_size)
    files = dump_files(dumps)
    records, p2l = _read_dumps(files)
    num_records = len(records)
    kept = _drop_replicas(records)
    duplicates = num_records - len(kept)
    if skip_decode:
        kept = [r for r in kept if r["forward_mode"] != FORWARD_MODE_DECODE]
    kept = [r for r in kept if r["input_ids"].shape[0] > 0]
    if not kept:
        raise SchemaError(f"{files[0]}: the dump holds no recorded tokens")
    moe_layers, k = _routing_shape(kept, p2l, files[0])
    num_physical = p2l.shape[1]
    layer_map = p2l[moe_layers]  # [L, P]
    num_experts = int(layer_map.max()) + 1
    if layer_map.min() < 0:
        raise SchemaError(f"{files[0]}: physical_to_logical map holds negative logical ids")

    rows_expert, rows_token, rows_pos, rows_req = [], [], [], []
    dropped = 0
    next_request = 0
    big_l = moe_layers.size
    for rec in kept:
        phys = rec["topk"][moe_layers][:, :, :k].transpose(1, 0, 2)  # [T, L, k]
        if phys.max() >= num_physical or phys.min() < -1:  # -1 alone marks padding
            bad = int(phys.max()) if phys.max() >= num_physical else int(phys.min())
            raise SchemaError(
                f"sglang record (pass {rec['forward_pass_id']}, rank {rec['rank']}): physical "
                f"expert id {bad} outside the map's {num_physical} slots (-1 marks padding)"
            )
        starts = segment_starts(rec["positions"], rec["extend_seq_lens"], rec["forward_mode"])
        request = next_request + np.cumsum(starts) - 1
        next_request += int(starts.sum())
        ok = (phys >= 0).all(axis=(1, 2))
        dropped += int((~ok).sum())
        phys = phys[ok]
        logical = layer_map[np.arange(big_l)[None, :, None], phys]  # [T, L, k]
        rows_expert.append(logical)
        rows_token.append(rec["input_ids"][ok])
        rows_pos.append(rec["positions"][ok])
        rows_req.append(request[ok])

    # after the ids' own check: ids the map cannot read say more than a count of experts
    if k > num_experts:
        raise SchemaError(f"{files[0]}: {k} ids per token but only {num_experts} logical experts")
    experts = np.concatenate(rows_expert)
    if experts.shape[0] == 0:
        raise SchemaError(f"{files[0]}: every recorded token has a -1 (padding) expert id")
    srt = np.sort(experts, axis=2)
    repeated = (srt[:, :, 1:] == srt[:, :, :-1]).any(axis=2)
    if repeated.any():
        t, layer = np.argwhere(repeated)[0]
        raise SchemaError(
            f"sglang: token row {t} routes twice to one logical expert at MoE layer "
            f"{int(moe_layers[layer])} after mapping; the physical_to_logical map does not match "
            "the recording (did EPLB rebalance while recording?)"
        )
    token_id = np.concatenate(rows_token)
    vocab_inferred = vocab_size is None
    if vocab_size is None:
        vocab_size = max(int(token_id.max()) + 1, 1)
    unknown = (token_id < 0) | (token_id >= vocab_size)
    token_id = np.where(unknown, -1, token_id)
    requests = np.concatenate(rows_req)

    names = ", ".join(f.name for f in files[:3]) + (
        f" (+{len(files) - 3} more)" if len(files) > 3 else ""
    )
    try:
        meta = TraceMeta(
            model=model,
            num_layers=int(big_l),
            num_experts=num_experts,
            top_k=k,
            vocab_size=int(vocab_size),
            moe_layer_indices=tuple(int(i) for i in moe_layers),
            source=(
                f"sglang per_token dump ({names}); physical ids mapped to logical with "
                f"last_physical_to_logical_map ({num_physical} physical slots); weights are "
                f"uniform 1/k because SGLang records expert ids only; request ids are per-pass "
                f"segments"
            ),
        )
    except SchemaError as e:  # e.g. a map whose logical ids go past int16's
        raise SchemaError(f"{names}: {e}") from None
    weights = np.full(experts.shape, 1.0 / k, np.float16)
    batch = TraceBatch.from_arrays(requests, np.concatenate(rows_pos), token_id, experts, weights)
    batch.validate(meta, where="sglang ingest")
    check_distinct_occurrences(batch.request_id, batch.position, "sglang ingest")
    stats = SglangIngestStats(
        path=None,
        files=tuple(str(f) for f in files),
        records=num_records,
        duplicate_records=duplicates,
        tokens=len(batch),
        dropped_tokens=dropped,
        unknown_tokens=int(unknown.sum()),  # negative ids only, where the vocabulary is inferred
        requests=int(np.unique(requests).size),
        num_physical_experts=num_physical,
        vocab_inferred=vocab_inferred,
        meta=meta,
    )
    return meta, batch, stats


def ingest_sglang(
    dumps: Sequence[str | Path],
    out: str | Path,
    *,
    model: str = "sglang",
    vocab_size: int | None = None,
    skip_decode: bool = False,
    rows_per_part: int = 1_000_000,
    overwrite: bool = False,
) -> SglangIngestStats:
    """Convert SGLang ``per_token`` dumps (files or directories) into a v1 trace at ``out``.

    ``out`` ending in ``.parquet`` gives one file, otherwise a directory of parts. The
    result appears only once complete; an existing ``out`` is replaced only with
    ``overwrite=True``, and only if it is an earlier trace (never an input dump, a directory
    holding one, or a directory of another kind).
    """
    out = Path(out)
    refuse_existing(out, overwrite)
    if not is_integer(rows_per_part) or rows_per_part < 1:
        raise InputError(f"sglang: rows_per_part={rows_per_part!r} must be a positive integer")
    rows_per_part = int(rows_per_part)
    if not isinstance(model, str) or not model.strip():
        raise InputError(f"sglang: model={model!r} must be a non-empty name (--model)")
    # Never replace an input dump, a directory holding one, or a directory of another kind.
    # the directories given count as inputs too: an output inside one would be read back
    # as a dump by a later ingest of that directory
    given = tuple(Path(d) for d in ([dumps] if isinstance(dumps, str | Path) else dumps))
    single = check_trace_output(out, inputs=tuple(dump_files(dumps)) + given)
    meta, batch, stats = convert_sglang(
        dumps, model=model, vocab_size=vocab_size, skip_decode=skip_decode
    )
    with atomic_path(out) as tmp:
        if single:
            write_trace(tmp, meta, batch)
        else:
            writer = TraceWriter(tmp, meta)
            for start in range(0, len(batch), rows_per_part):
                writer.write(batch.select(slice(start, start + rows_per_part)))
    return dataclasses.replace(stats, path=out)

"""Bundle format v1: the int16 tables a runtime needs to apply a plan (``DESIGN.md``).

A bundle is a directory written atomically::

    tables.safetensors   six tensors (below), int16 / float16 exactly
    manifest.json        format, version, model, EP size, n-gram order, method, seed,
                         metrics, sha256 of every file, "created_by", and (optional,
                         since 2026-11-24) "source", where the model's layers came from

With L MoE layers, N experts per layer, E = EP size, V = vocab size, n = n-gram order:

================== ======= ========= ===============================================
tensor             dtype   shape     meaning
================== ======= ========= ===============================================
expert_to_device   int16   [L, N]    device hosting each logical expert (N/E each)
expert_permutation int16   [L, N]    physical slot s (on device s // (N/E)) holds
                                     logical expert ``expert_permutation[l, s]``
token_to_device    int16   [L, V]    device a token is sent to before layer l's gate
token_confidence   float16 [L, V]    confidence in [0, 1] of that choice
ngram_to_device    int16   [L, E**n] device predicted from the devices of the token's
                                     top-1 experts at layers l-n..l-1 (base-E row
                                     index, most recent layer = least significant)
ngram_confidence   float16 [L, E**n] its confidence (0 where undefined, e.g. l < n)
================== ======= ========= ===============================================

These are the tables T, T_p, A, A_p and E of Speculative MoE (paper 000, §3.3, §B.1-B.2):
the runtime looks them up instead of deciding anything online.

Everything a reader may be handed is validated: dtypes, shapes, id ranges, confidences in
[0, 1], exactly N/E experts per device and layer, the permutation consistent with the
placement, and the sha256 of every file listed in the manifest. Any problem is one
:class:`~planner.errors.SchemaError` line saying what is wrong.
"""

from __future__ import annotations

import glob
import hashlib
import json
import operator
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import safetensors
import safetensors.numpy

from planner import __version__
from planner._checks import is_integer, is_plain_int
from planner._io import atomic_path, check_output, read_json_object, sha256_file
from planner._safetensors import write_errors_as_oserror
from planner.errors import InputError, MismatchError, SchemaError
from planner.trace.schema import TraceMeta

FORMAT = "moeplan-bundle"
FORMAT_VERSION = 1
TABLES_FILE = "tables.safetensors"
MANIFEST_FILE = "manifest.json"
MODEL_KEYS = ("model", "num_layers", "num_experts", "top_k", "vocab_size")
# Guard against absurd n-gram tables (E**n columns per layer).
MAX_NGRAM_COLUMNS = 1 << 24

_INT16_MAX = np.iinfo(np.int16).max

# name -> (dtype, kind of second axis); shapes are [L, N], [L, V] or [L, E**n].
TENSORS: dict[str, tuple[np.dtype, str]] = {
    "expert_to_device": (np.dtype(np.int16), "experts"),
    "expert_permutation": (np.dtype(np.int16), "experts"),
    "token_to_device": (np.dtype(np.int16), "vocab"),
    "token_confidence": (np.dtype(np.float16), "vocab"),
    "ngram_to_device": (np.dtype(np.int16), "ngram"),
    "ngram_confidence": (np.dtype(np.float16), "ngram"),
}


def _created_by() -> str:
    return f"moeplan {__version__}"


# ---------------------------------------------------------------------------------------
# Placement helpers


def ngram_row_index(prev_devices, ep_size: int):
    """Row of the n-gram table for the devices of the previous n layers' top-1 experts.

    Args:
        prev_devices: [..., n] device ids in [0, E) (numpy array or torch tensor), layer
            order, most recent layer last.
        ep_size: E.

    Returns:
        [...] int64 (same array type) base-E number with the most recent layer as the least
        significant digit: ``sum_j prev_devices[..., j] * E**(n-1-j)``.
    """
    wide = (
        prev_devices.astype(np.int64)
        if isinstance(prev_devices, np.ndarray)
        else prev_devices.long()
    )
    rows = wide[..., 0]
    for j in range(1, wide.shape[-1]):
        rows = rows * ep_size + wide[..., j]
    return rows


def permutation_from_placement(expert_to_device: np.ndarray, ep_size: int) -> np.ndarray:
    """Physical slot order for a placement: device 0's experts first, ascending id within.

    Args:
        expert_to_device: [L, N] device of each logical expert; each device must host
            exactly N / ep_size experts per layer.
        ep_size: E.

    Returns:
        expert_permutation: [L, N] int16, ``expert_permutation[l, s]`` is the logical
        expert in physical slot s (which lives on device ``s // (N / E)``).

    Example: ``expert_to_device = [[1, 0, 1, 0]]``, E = 2 -> ``[[1, 3, 0, 2]]``.
    """
    e2d = np.asarray(expert_to_device)
    if e2d.ndim != 2:
        raise SchemaError(f"expert_to_device must be [L, N], got shape {e2d.shape}")
    ep_size = operator.index(ep_size)
    if ep_size <= 0 or e2d.shape[1] % ep_size:
        raise SchemaError(
            f"num_experts={e2d.shape[1]} is not divisible by ep_size={ep_size}; every device "
            "must host the same number of experts"
        )
    for layer in range(e2d.shape[0]):
        problems = _placement_problems(layer, ep_size, e2d[layer])
        if problems:
            raise SchemaError(f"expert_to_device: {problems[0]}")
    # A stable sort by device keeps ascending logical ids within each device.
    return np.argsort(e2d, axis=1, kind="stable").astype(np.int16)


# ---------------------------------------------------------------------------------------
# The artifact


@dataclass(frozen=True, eq=False)
class Bundle:
    """A validated v1 bundle in memory (tables as read-only numpy arrays).

    Attributes:
        meta: the model the plan was made for (name, L, N, k, V, MoE layer indices);
            ``meta.fingerprint()`` is written to the manifest.
        ep_size: E, devices sharing one MoE layer's experts.
        ngram_order: n >= 1, number of preceding layers the n-gram table looks back.
        expert_to_device: [L, N] int16.
        expert_permutation: [L, N] int16.
        token_to_device: [L, V] int16.
        token_confidence: [L, V] float16.
        ngram_to_device: [L, E**n] int16.
        ngram_confidence: [L, E**n] float16.
        method: solver that made the plan (free text, e.g. "ceo").
        seed: the seed it ran with, or None.
        metrics: JSON-serialisable numbers measured when the plan was made.
        created_by: "moeplan <version>" of the writer (of the bundle it was read from;
            :func:`save_bundle` writes its own).

    Use :meth:`from_arrays` to build one from arrays of any integer / float dtype; the
    constructor itself insists on the exact on-disk dtypes.
    """

    meta: TraceMeta
    ep_size: int
    ngram_order: int
    expert_to_device: np.ndarray
    expert_permutation: np.ndarray
    token_to_device: np.ndarray
    token_confidence: np.ndarray
    ngram_to_device: np.ndarray
    ngram_confidence: np.ndarray
    method: str = ""
    seed: int | None = None
    metrics: dict[str, Any] = field(default_factory=dict)
    created_by: str = field(default_factory=_created_by)

    def __post_init__(self) -> None:
        if not isinstance(self.meta, TraceMeta):
            raise SchemaError(f"bundle: meta must be a TraceMeta, got {type(self.meta).__name__}")
        problems = _table_problems(self.meta, self.ep_size, self.ngram_order, self.tables())
        if problems:
            raise SchemaError(f"bundle: {problems[0]}")
        if self.seed is not None and not is_plain_int(self.seed):
            raise SchemaError(f"bundle: seed={self.seed!r} must be an integer or None")
        try:
            json.dumps(self.metrics, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise SchemaError(f"bundle: metrics are not plain JSON ({e})") from None
        for name in TENSORS:
            arr = getattr(self, name)
            if arr.flags.writeable:
                arr = arr.copy()
                arr.flags.writeable = False
                object.__setattr__(self, name, arr)

    # -- construction ---------------------------------------------------------------

    @classmethod
    def from_arrays(
        cls,
        meta: TraceMeta,
        *,
        ep_size: int,
        expert_to_device,
        token_to_device,
        token_confidence,
        ngram_to_device,
        ngram_confidence,
        ngram_order: int,
        expert_permutation=None,
        method: str = "",
        seed: int | None = None,
        metrics: Mapping[str, Any] | None = None,
    ) -> Bundle:
        """Build a bundle from plan arrays, casting to int16 / float16 after range checks.

        ``expert_permutation`` defaults to :func:`permutation_from_placement`.
        """
        e2d = _to_int16("expert_to_device", expert_to_device)
        ep_size, ngram_order, seed = map(_int_if_integer, (ep_size, ngram_order, seed))
        if expert_permutation is None:
            # A malformed placement is reported by the constructor's checks below.
            try:
                perm = permutation_from_placement(e2d, ep_size)
            except (SchemaError, TypeError):
                perm = np.zeros_like(e2d)
        else:
            perm = _to_int16("expert_permutation", expert_permutation)
        return cls(
            meta=meta,
            ep_size=ep_size,
            ngram_order=ngram_order,
            expert_to_device=e2d,
            expert_permutation=perm,
            token_to_device=_to_int16("token_to_device", token_to_device),
            token_confidence=_to_float16("token_confidence", token_confidence),
            ngram_to_device=_to_int16("ngram_to_device", ngram_to_device),
            ngram_confidence=_to_float16("ngram_confidence", ngram_confidence),
            method=method,
            seed=seed,
            metrics=dict(metrics or {}),
        )

    # -- views ----------------------------------------------------------------------

    def tables(self) -> dict[str, np.ndarray]:
        """The six tensors by name, in the order of :data:`TENSORS`."""
        return {name: getattr(self, name) for name in TENSORS}

    @property
    def experts_per_device(self) -> int:
        return self.meta.num_experts // self.ep_size

    @property
    def ngram_columns(self) -> int:
        return self.ep_size**self.ngram_order

    def manifest(self, files: Mapping[str, Mapping[str, Any]] | None = None) -> dict[str, Any]:
        """The manifest.json object (``files`` maps file name -> {"sha256", "bytes"})."""
        m = self.meta
        return {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "model": {k: getattr(m, k) for k in MODEL_KEYS},
            "fingerprint": m.fingerprint(),
            "moe_layer_indices": list(m.moe_layer_indices),
            # where the model's layers came from (a profiled trace, a counts table of some
            # layers); optional, read back into TraceMeta.source (planner.export.engines)
            "source": m.source,
            "ep_size": self.ep_size,
            "ngram_order": self.ngram_order,
            "method": self.method,
            "seed": self.seed,
            "metrics": self.metrics,
            "files": {k: dict(v) for k, v in (files or {}).items()},
            "created_by": self.created_by,
        }

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Bundle):
            return NotImplemented
        same_arrays = all(
            a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)
            for a, b in zip(self.tables().values(), other.tables().values(), strict=True)
        )
        return same_arrays and self.manifest() == other.manifest()

    __hash__ = None  # type: ignore[assignment]

    def check_compatible(self, meta: TraceMeta, where: str = "trace") -> None:
        """Raise :class:`MismatchError` unless ``meta`` describes the bundle's model."""
        check_compatible(self, meta, where)


def _int_if_integer(value: Any) -> Any:
    """``value`` as an int if it is a Python or numpy integer, else as it is for the
    constructor's checks to refuse (through int(), True was E = 1 and 2.7 was 2)."""
    return int(value) if is_integer(value) else value


def _to_int16(name: str, values) -> np.ndarray:
    arr = np.asarray(values)
    if arr.dtype == np.int16:
        return arr
    if arr.dtype.kind not in "iub":
        raise SchemaError(f"bundle: {name} must hold integers, got dtype {arr.dtype}")
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) > _INT16_MAX):
        raise SchemaError(
            f"bundle: {name} values span [{int(arr.min())}, {int(arr.max())}], "
            "outside [0, 32767] (int16)"
        )
    return arr.astype(np.int16)


def _to_float16(name: str, values) -> np.ndarray:
    arr = np.asarray(values)
    if arr.dtype == np.float16:
        return arr
    if arr.dtype.kind not in "fiub":
        raise SchemaError(f"bundle: {name} must hold numbers, got dtype {arr.dtype}")
    if arr.size and not np.isfinite(arr).all():
        raise SchemaError(f"bundle: {name} holds NaN or infinite values")
    return arr.astype(np.float16)


# ---------------------------------------------------------------------------------------
# Validation shared by the constructor, the loader and verify_bundle


class TableSizes(Protocol):
    """What the table checks read of a model: a :class:`TraceMeta`, or the runtime shim's
    ``PlanTables``, which carries the same three sizes."""

    @property
    def num_layers(self) -> int: ...
    @property
    def num_experts(self) -> int: ...
    @property
    def vocab_size(self) -> int: ...


def expected_shapes(meta: TableSizes, ep_size: int, ngram_order: int) -> dict[str, tuple]:
    """[L, N], [L, V] or [L, E**n] of each table; after :func:`header_problems` passed."""
    cols = {
        "experts": meta.num_experts,
        "vocab": meta.vocab_size,
        "ngram": ep_size**ngram_order,
    }
    return {name: (meta.num_layers, cols[kind]) for name, (_, kind) in TENSORS.items()}


def header_problems(meta: TableSizes, ep_size: int, ngram_order: int) -> list[str]:
    """Problems of E and n for ``meta`` (empty list when all is well)."""
    if not is_plain_int(ep_size) or ep_size <= 0:
        return [f"ep_size={ep_size!r} must be a positive integer"]
    if not is_plain_int(ngram_order) or ngram_order < 1:
        return [f"ngram_order={ngram_order!r} must be an integer >= 1"]
    if meta.num_experts % ep_size:
        return [
            f"num_experts={meta.num_experts} is not divisible by ep_size={ep_size}; every "
            "device must host the same number of experts"
        ]
    most = MAX_NGRAM_COLUMNS.bit_length() - 1  # the largest n with 2**n columns allowed
    # n first: E**n of a corrupt manifest's n (10**12) would not finish; E = 1 is one column
    if ep_size > 1 and (ngram_order > most or ep_size**ngram_order > MAX_NGRAM_COLUMNS):
        return [
            f"ep_size**ngram_order = {ep_size}**{ngram_order} n-gram columns is too many "
            f"(limit {MAX_NGRAM_COLUMNS}); use a smaller ngram_order"
        ]
    return []


def _array_problems(
    meta: TraceMeta, ep_size: int, ngram_order: int, tables: Mapping[str, np.ndarray]
) -> list[str]:
    """Dtype, shape and whole-table range problems (empty list when all is well)."""
    problems = header_problems(meta, ep_size, ngram_order)
    if problems:
        return problems
    missing = [name for name in TENSORS if name not in tables]
    if missing:
        return [f"tensor(s) missing: {', '.join(missing)}"]
    extra = sorted(set(tables) - set(TENSORS))
    if extra:
        return [f"unexpected tensor(s): {', '.join(extra)}"]
    shapes = expected_shapes(meta, ep_size, ngram_order)
    for name, (dtype, _) in TENSORS.items():
        arr = tables[name]
        if not isinstance(arr, np.ndarray):
            return [f"tensor {name} is a {type(arr).__name__}, expected a numpy array"]
        if arr.dtype != dtype:
            return [f"tensor {name} is {arr.dtype}, expected {dtype}"]
        if arr.shape != shapes[name]:
            return [
                f"tensor {name} has shape {list(arr.shape)}, expected {list(shapes[name])} "
                f"for L={meta.num_layers}, N={meta.num_experts}, V={meta.vocab_size}, "
                f"E={ep_size}, n={ngram_order}"
            ]
    for name in ("token_to_device", "ngram_to_device"):
        arr = tables[name]
        lo, hi = int(arr.min(initial=0)), int(arr.max(initial=0))
        if lo < 0 or hi >= ep_size:
            bad = lo if lo < 0 else hi
            return [f"tensor {name} holds device id {bad}, outside [0, {ep_size}) (ep_size)"]
    for name in ("token_confidence", "ngram_confidence"):
        arr = tables[name]
        if not np.isfinite(arr).all():
            return [f"tensor {name} holds NaN or infinite values"]
        lo_conf, hi_conf = float(arr.min(initial=0)), float(arr.max(initial=0))
        if lo_conf < 0 or hi_conf > 1:
            bad_conf = lo_conf if lo_conf < 0 else hi_conf
            return [f"tensor {name} holds confidence {bad_conf:g}, outside [0, 1]"]
    return []


def _placement_problems(layer: int, ep_size: int, expert_to_device: np.ndarray) -> list[str]:
    """Problems of one layer's placement [N]: device ids in [0, E), exactly N/E per device."""
    e2d = expert_to_device.astype(np.int64)
    n = e2d.shape[0]
    per = n // ep_size
    lo, hi = int(e2d.min(initial=0)), int(e2d.max(initial=0))
    if lo < 0 or hi >= ep_size:
        bad = lo if lo < 0 else hi
        return [f"layer {layer}: expert_to_device holds device {bad}, outside [0, {ep_size})"]
    counts = np.bincount(e2d, minlength=ep_size)
    wrong = np.flatnonzero(counts != per)
    if wrong.size:
        d = int(wrong[0])
        return [
            f"layer {layer}: device {d} hosts {int(counts[d])} experts, expected N/E = "
            f"{n}/{ep_size} = {per}"
        ]
    return []


def _layer_problems(
    layer: int, ep_size: int, expert_to_device: np.ndarray, expert_permutation: np.ndarray
) -> list[str]:
    """Placement problems of one layer: capacity, permutation, their consistency.

    Args:
        expert_to_device, expert_permutation: [L, N] tables (only row ``layer`` is read).
    """
    problems = _placement_problems(layer, ep_size, expert_to_device[layer])
    if problems:
        return problems
    e2d = expert_to_device[layer].astype(np.int64)
    perm = expert_permutation[layer].astype(np.int64)
    n = e2d.shape[0]
    in_range = bool(((perm >= 0) & (perm < n)).all())
    if not in_range or np.bincount(perm, minlength=n).max(initial=0) != 1:
        return [f"layer {layer}: expert_permutation is not a permutation of 0..{n - 1}"]
    slot_device = np.arange(n) // (n // ep_size)
    bad = np.flatnonzero(e2d[perm] != slot_device)
    if bad.size:
        s = int(bad[0])
        return [
            f"layer {layer}: slot {s} (device {int(slot_device[s])}) holds expert "
            f"{int(perm[s])}, but expert_to_device puts it on device {int(e2d[perm[s]])}"
        ]
    return []


def _table_problems(
    meta: TraceMeta, ep_size: int, ngram_order: int, tables: Mapping[str, np.ndarray]
) -> list[str]:
    """Every problem with a set of tables, array-level first, then the first bad layer."""
    problems = _array_problems(meta, ep_size, ngram_order, tables)
    if problems:
        return problems
    for layer in range(meta.num_layers):
        problems = _layer_problems(
            layer, ep_size, tables["expert_to_device"], tables["expert_permutation"]
        )
        if problems:
            return problems
    return []


# ---------------------------------------------------------------------------------------
# Save / load


def check_bundle_output(path: str | Path, inputs: tuple = ()) -> Path:
    """``path`` as a Path if a bundle may be written there (:func:`planner._io.check_output`):
    nothing, an empty directory, or an earlier bundle holding only the files its manifest
    lists (and the manifest)."""
    path = Path(path)
    members = [MANIFEST_FILE, TABLES_FILE]
    if (path / MANIFEST_FILE).is_file():
        try:
            manifest = json.loads((path / MANIFEST_FILE).read_text())
        except (ValueError, RecursionError, OSError):
            manifest = None
        if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
            # a web app's or an extension's manifest.json: not a bundle to replace
            raise InputError(
                f"{path}: holds a {MANIFEST_FILE} that is not a moeplan bundle's; choose "
                "another output path"
            )
        listed = manifest.get("files")
        if isinstance(listed, dict):
            # the names as they are (escaped: a listed "*" must not match every file)
            members += [glob.escape(name) for name in listed if isinstance(name, str)]
    return check_output(
        path, marker=MANIFEST_FILE, what="moeplan bundle", inputs=inputs, members=tuple(members)
    )


def save_bundle(
    bundle: Bundle,
    path: str | os.PathLike,
    extra_files: Mapping[str, bytes] | None = None,
) -> Path:
    """Write ``bundle`` as a directory at ``path``, atomically (replacing an old one).

    ``extra_files`` (name -> bytes, e.g. engine-format files) are written beside the
    tables and listed with their sha256 in the manifest. Returns the directory.
    """
    dest = Path(path)
    reserved = {TABLES_FILE, MANIFEST_FILE}
    for name in extra_files or {}:
        if not name or name in reserved or Path(name).name != name or name.startswith("."):
            raise InputError(f"extra bundle file name {name!r} is reserved or not a plain name")
    check_bundle_output(dest)
    with atomic_path(dest) as tmp:
        tmp.mkdir()
        tables_path = tmp / TABLES_FILE
        with write_errors_as_oserror(dest):
            safetensors.numpy.save_file(
                {k: np.ascontiguousarray(v) for k, v in bundle.tables().items()},
                tables_path,
                metadata={LAYOUT_KEY: json.dumps(_layout(bundle.manifest()))},
            )
        files = {
            TABLES_FILE: {"sha256": sha256_file(tables_path), "bytes": tables_path.stat().st_size}
        }
        for name, data in sorted((extra_files or {}).items()):
            (tmp / name).write_bytes(data)
            files[name] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
        # the writer is this moeplan, also where the bundle was read from an older one's
        manifest = bundle.manifest(files) | {"created_by": _created_by()}
        (tmp / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2) + "\n")
    return dest


# The manifest fields that say which model layer and device each table row and column
# belong to, copied into the tables file's safetensors header (``__metadata__``), which its
# sha256 covers: a manifest edited there (other layers, another source) is then refused
# like a changed table, where the fingerprint, of the model fields only, let it through.
LAYOUT_KEY = "moeplan_layout"
_LAYOUT_FIELDS = ("moe_layer_indices", "ep_size", "ngram_order", "source")


def _layout(manifest: Mapping[str, Any]) -> dict[str, Any]:
    return {k: manifest.get(k) for k in _LAYOUT_FIELDS}


def _check_layout(path: Path, manifest: Mapping[str, Any]) -> None:
    """SchemaError if the manifest's layout fields differ from the copy in the tables'
    header (after the tables' sha256 was checked). Bundles written before the copy have
    none and are taken as they are."""
    stored = _safetensors_metadata(path / TABLES_FILE).get(LAYOUT_KEY)
    if stored is None:
        return
    try:
        header = json.loads(stored)
    except ValueError:
        header = None
    if not isinstance(header, dict):
        raise SchemaError(f"bundle {path}: {TABLES_FILE} header {LAYOUT_KEY} is not a JSON object")
    for key in _LAYOUT_FIELDS:
        if header.get(key) != manifest.get(key):
            raise SchemaError(
                f"bundle {path}: manifest {key} {_short(manifest.get(key))} differs from the "
                f"tables' ({_short(header.get(key))}); the manifest was edited"
            )


def _short(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 60 else f"{text[:60]}..."


def _read_manifest(path: Path) -> dict[str, Any]:
    if not path.exists():
        raise InputError(f"bundle {path}: no such directory")
    if not path.is_dir():
        raise InputError(f"bundle {path}: not a directory (a bundle is a directory)")
    mpath = path / MANIFEST_FILE
    if not mpath.is_file():
        raise SchemaError(f"bundle {path}: {MANIFEST_FILE} is missing; not a moeplan bundle")
    manifest = read_json_object(mpath, f"bundle {path}: {MANIFEST_FILE}", SchemaError)
    if manifest.get("format") != FORMAT:
        raise SchemaError(
            f"bundle {path}: manifest format is {manifest.get('format')!r}, expected {FORMAT!r}"
        )
    version = manifest.get("format_version")
    if version != FORMAT_VERSION or type(version) is not int:
        raise SchemaError(
            f"bundle {path}: format_version {version!r} is not supported; this moeplan "
            f"reads version {FORMAT_VERSION} (re-export the plan with this moeplan)"
        )
    expected_types = {"model": dict, "files": dict, "ep_size": int, "ngram_order": int}
    wrong = [
        k
        for k, t in expected_types.items()
        if not isinstance(manifest.get(k), t) or isinstance(manifest.get(k), bool)
    ]
    if wrong:
        raise SchemaError(f"bundle {path}: manifest lacks or mistypes {', '.join(wrong)}")
    # what a Bundle checks of its seed and metrics, here too so that verify agrees with load
    seed = manifest.get("seed")
    if seed is not None and (type(seed) is not int):
        raise SchemaError(f"bundle {path}: manifest seed={seed!r} must be an integer or null")
    if not isinstance(manifest.get("metrics") or {}, dict):
        raise SchemaError(f"bundle {path}: manifest metrics must be a JSON object")
    method = manifest.get("method", "")
    if method is not None and not isinstance(method, str):
        raise SchemaError(f"bundle {path}: manifest method={method!r} must be a string")
    try:
        json.dumps(manifest.get("metrics") or {}, allow_nan=False)
    except (ValueError, RecursionError) as e:  # NaN or Infinity, which json.loads accepts
        raise SchemaError(f"bundle {path}: manifest metrics are not plain JSON ({e})") from None
    return manifest


def _meta_from_manifest(path: Path, manifest: Mapping[str, Any]) -> TraceMeta:
    model = manifest["model"]
    missing = [k for k in MODEL_KEYS if k not in model]
    if missing:
        raise SchemaError(f"bundle {path}: manifest model lacks {', '.join(missing)}")
    try:
        meta = TraceMeta(
            **{k: model[k] for k in MODEL_KEYS},
            moe_layer_indices=tuple(manifest.get("moe_layer_indices") or ()),
            source=str(manifest["source"]) if "source" in manifest else f"bundle {path.name}",
        )
    except (SchemaError, TypeError, ValueError) as e:
        raise SchemaError(f"bundle {path}: manifest model is invalid ({e})") from None
    stored = manifest.get("fingerprint")
    if stored is not None and stored != meta.fingerprint():
        raise SchemaError(
            f"bundle {path}: manifest fingerprint {stored} does not match its model fields "
            f"({meta.fingerprint()}); the manifest was edited"
        )
    return meta


def _check_files(path: Path, manifest: Mapping[str, Any]) -> None:
    files = manifest["files"]
    if TABLES_FILE not in files:
        raise SchemaError(f"bundle {path}: manifest files do not list {TABLES_FILE}")
    for name, entry in files.items():
        fpath = path / name
        try:
            missing = Path(name).name != name or not fpath.is_file()
        except (OSError, ValueError):  # a name too long, or holding a NUL
            missing = True
        if missing:
            shown = name if len(name) <= 80 else f"{name[:80]}..."
            raise SchemaError(f"bundle {path}: {shown} is listed in the manifest but missing")
        want = entry.get("sha256") if isinstance(entry, dict) else None
        if not isinstance(want, str):
            raise SchemaError(f"bundle {path}: manifest gives no sha256 for {name}")
        if sha256_file(fpath) != want:
            raise SchemaError(f"bundle {path}: {name} sha256 mismatch (file changed or corrupt)")
        size = entry.get("bytes")
        if size is not None and size != fpath.stat().st_size:
            raise SchemaError(
                f"bundle {path}: manifest gives {name} {size!r} bytes but it holds "
                f"{fpath.stat().st_size}; the manifest was edited"
            )


def _read_tables(path: Path) -> dict[str, np.ndarray]:
    try:
        raw = safetensors.numpy.load_file(path / TABLES_FILE)
    except (safetensors.SafetensorError, OSError, ValueError) as e:
        raise SchemaError(
            f"bundle {path}: {TABLES_FILE} is not a readable safetensors file ({e})"
        ) from None
    except (TypeError, AttributeError):  # a dtype numpy has no type for (bfloat16, float8)
        odd = {
            k: v
            for k, v in _safetensors_dtypes(path / TABLES_FILE).items()
            if v not in _NUMPY_DTYPES
        }
        raise SchemaError(
            f"bundle {path}: {TABLES_FILE} holds tensors of dtypes numpy cannot read "
            f"({', '.join(f'{k} is {v}' for k, v in odd.items()) or 'unknown'}); bundle "
            "tables are int16 and float16"
        ) from None
    # Own the memory: the loader may hand out views of a memory-mapped file.
    return {k: np.array(v, copy=True) for k, v in raw.items()}


# safetensors dtype names numpy reads
_NUMPY_DTYPES = {"BOOL", "U8", "I8", "U16", "I16", "F16", "U32", "I32", "F32", "U64", "I64", "F64"}


def _safetensors_header(file: Path) -> dict[str, Any]:
    """A safetensors file's JSON header ({} if unreadable)."""
    try:
        with open(file, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(min(size, 1 << 24)))
    except (OSError, ValueError, RecursionError):
        return {}
    return header if isinstance(header, dict) else {}


def _safetensors_dtypes(file: Path) -> dict[str, str]:
    """Tensor name -> dtype name from a safetensors header ({} if unreadable)."""
    header = _safetensors_header(file)
    try:
        return {k: str(v.get("dtype")) for k, v in header.items() if k != "__metadata__"}
    except AttributeError:
        return {}


def _safetensors_metadata(file: Path) -> dict[str, Any]:
    """A safetensors header's ``__metadata__`` ({} if none)."""
    metadata = _safetensors_header(file).get("__metadata__")
    return metadata if isinstance(metadata, dict) else {}


def _read_bundle_dir(path: Path) -> tuple[dict[str, Any], TraceMeta, dict[str, np.ndarray]]:
    """Manifest, model and tables of a bundle, with files, dtypes and shapes checked."""
    manifest = _read_manifest(path)
    meta = _meta_from_manifest(path, manifest)
    _check_files(path, manifest)
    tables = _read_tables(path)
    problems = _array_problems(meta, manifest["ep_size"], manifest["ngram_order"], tables)
    if problems:
        raise SchemaError(f"bundle {path}: {problems[0]}")
    _check_layout(path, manifest)
    return manifest, meta, tables


def bundle_path(path: Any) -> Path:
    """``path`` as a Path; InputError for what is not a path at all (None, an int, bytes),
    which ``Path()`` refuses with a raw TypeError, and for "" (which it reads as ".")."""
    if not isinstance(path, str | os.PathLike):
        raise InputError(
            f"bundle {path!r}: not a path (a bundle is a directory; pass a str or os.PathLike)"
        )
    if os.fspath(path) in ("", b""):  # Path("") is the working directory
        raise InputError("bundle path is empty; pass the bundle's directory")
    return Path(path)


def load_bundle_arrays(path: str | os.PathLike) -> Bundle:
    """Read and fully validate the bundle directory at ``path``.

    Raises:
        InputError: ``path`` is not a directory (or not a path).
        SchemaError: anything about its content is wrong (one line saying what).
    """
    p = bundle_path(path)
    manifest, meta, tables = _read_bundle_dir(p)
    try:
        return Bundle(
            meta=meta,
            ep_size=manifest["ep_size"],
            ngram_order=manifest["ngram_order"],
            **tables,
            method=str(manifest.get("method") or ""),
            seed=manifest.get("seed"),
            metrics=manifest.get("metrics") or {},
            created_by=str(manifest.get("created_by") or ""),
        )
    except SchemaError as e:
        msg = str(e).removeprefix("bundle: ")
        raise SchemaError(f"bundle {p}: {msg}") from None


def verify_bundle(path: str | os.PathLike) -> dict[str, Any]:
    """Check a bundle directory and describe it; never raises for a bad bundle.

    Returns a JSON-serialisable report::

        {"ok": bool, "path": str, "error": str | None,
         "model": {...}, "fingerprint": str, "ep_size": E, "ngram_order": n,
         "method": str, "created_by": str,
         "sizes": {"files": {name: bytes}, "tensors": {name: bytes}, "total_bytes": int},
         "layers": [{"layer": l, "ok": bool, "problems": [...],
                     "token_share_max": float,  # largest share of the vocabulary on one device
                     "token_confidence_mean": float,
                     "ngram_rows_defined": float}]}   # share of n-gram rows with confidence > 0

    ``ok`` is False with ``error`` set when the bundle cannot be read (missing files,
    sha256, dtype, shape or range problems); per-layer placement problems are listed in
    ``layers`` and also make ``ok`` False. A ``path`` that is not a path at all (None, an
    int) is the caller's mistake, not a bad bundle: InputError.
    """
    p = bundle_path(path)
    report: dict[str, Any] = {"ok": False, "path": str(p), "error": None}
    try:
        manifest, meta, tables = _read_bundle_dir(p)
    except (SchemaError, InputError) as e:
        report["error"] = str(e)
        return report
    ep_size, order = manifest["ep_size"], manifest["ngram_order"]
    report.update(
        model=manifest["model"],
        fingerprint=meta.fingerprint(),
        moe_layer_indices=list(meta.moe_layer_indices),
        ep_size=ep_size,
        ngram_order=order,
        method=manifest.get("method", ""),
        created_by=manifest.get("created_by", ""),
    )
    file_sizes = {name: (p / name).stat().st_size for name in [*manifest["files"], MANIFEST_FILE]}
    report["sizes"] = {
        "files": file_sizes,
        "tensors": {k: int(v.nbytes) for k, v in tables.items()},
        "total_bytes": int(sum(file_sizes.values())),
    }
    layers: list[dict[str, Any]] = []
    for layer in range(meta.num_layers):
        problems = _layer_problems(
            layer, ep_size, tables["expert_to_device"], tables["expert_permutation"]
        )
        token_counts = np.bincount(tables["token_to_device"][layer], minlength=ep_size)
        ngram_conf = tables["ngram_confidence"][layer]
        layers.append(
            {
                "layer": layer,
                "ok": not problems,
                "problems": problems,
                "token_share_max": float(token_counts.max() / max(1, meta.vocab_size)),
                "token_confidence_mean": float(
                    tables["token_confidence"][layer].astype(np.float64).mean()
                ),
                "ngram_rows_defined": float((ngram_conf > 0).mean()),
            }
        )
    report["layers"] = layers
    bad = [entry for entry in layers if not entry["ok"]]
    if bad:
        report["error"] = f"bundle {p}: {bad[0]['problems'][0]}"
    elif engine_problems := _engine_file_problems(p, manifest, meta, tables):
        report["error"] = f"bundle {p}: {engine_problems[0]}"
    report["ok"] = report["error"] is None
    return report


def _engine_file_problems(
    path: Path, manifest: Mapping[str, Any], meta: TraceMeta, tables: Mapping[str, np.ndarray]
) -> list[str]:
    """Problems of the engine files in a bundle: each must be listed in the manifest (the
    sha256 then covers it) and be what the tables render to (a file and its manifest entry
    edited together pass the checksum; SGLang's row count is the file's own, set by
    ``--num-model-layers``)."""
    from planner.export.engines import FORMATS, EnginePlacement

    problems = []
    for fmt in FORMATS.values():
        file = path / fmt.filename
        if not file.is_file():
            continue
        if fmt.filename not in manifest["files"]:
            problems.append(
                f"{fmt.filename} is not listed in the manifest, so nothing checks it; export "
                "the plan again"
            )
            continue
        rows = None
        if fmt.name == "sglang":
            try:
                rows = len(json.loads(file.read_text())["physical_to_logical_map"])
            except (ValueError, KeyError, TypeError, RecursionError):
                problems.append(f"{fmt.filename} is not an SGLang expert-location file")
                continue
        try:
            placement = EnginePlacement.from_tables(
                tables["expert_permutation"], manifest["ep_size"], meta, rows
            )
            same = fmt.render(placement).encode() == file.read_bytes()
        except (InputError, SchemaError) as e:
            problems.append(f"{fmt.filename} cannot be rendered from the tables ({e})")
            continue
        if not same:
            problems.append(
                f"{fmt.filename} is not what the bundle's tables give (it was edited with its "
                "manifest entry, or written by another moeplan version); export the plan again"
            )
    return problems


# ---------------------------------------------------------------------------------------
# Compatibility with a trace / model


def check_compatible(bundle: Bundle, meta: TraceMeta, where: str = "trace") -> None:
    """Raise :class:`MismatchError` unless ``meta`` describes the model ``bundle`` is for."""
    b = bundle.meta
    for name in ("num_layers", "num_experts", "top_k", "vocab_size"):
        if getattr(b, name) != getattr(meta, name):
            raise MismatchError(
                f"bundle was planned for {name}={getattr(b, name)}, but the {where} has "
                f"{name}={getattr(meta, name)} (model {meta.model!r}); use a bundle made "
                "for this model"
            )
    if b.fingerprint() != meta.fingerprint():
        raise MismatchError(
            f"bundle was planned for model {b.model!r} (fingerprint {b.fingerprint()}), the "
            f"{where} is model {meta.model!r} (fingerprint {meta.fingerprint()})"
        )
    if (differ := b.layer_mismatch(meta, ("the bundle", f"the {where}"))) is not None:
        raise MismatchError(f"{differ}; use a bundle made for this model")

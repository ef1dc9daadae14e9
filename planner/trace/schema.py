"""Trace schema v1 and token-expert counts schema (``../shared/DESIGN.md``).

A trace has one row per token occurrence::

    request_id  int64
    position    int32
    token_id    int32                      (-1 when unknown)
    experts     fixed_size_list<int16>[L*k]   layer-major: experts[l*k + r] = rank-r expert of MoE layer l
    weights     fixed_size_list<float16>[L*k] gate weights, descending within each layer

and the Parquet schema metadata key ``moeplan`` holds :class:`TraceMeta` as JSON.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
from collections.abc import Sequence
from dataclasses import dataclass

import pyarrow as pa

from planner._checks import is_integer
from planner.errors import SchemaError

SCHEMA_VERSION = 1
# No model has nearly this many MoE layers; a corrupt count would build huge defaults.
MAX_LAYERS = 65535
META_KEY = b"moeplan"
REQUIRED_COLUMNS = ("request_id", "position", "token_id", "experts", "weights")


# How a model fitted from a counts table names its source (TraceMeta.source): its layers
# are those the table counted, perhaps not all the model's MoE layers (planner.export.engines).
COUNTS_SOURCE = "counts table"


def layer_indices_mismatch(
    mine: Sequence[int], theirs: Sequence[int], names: tuple[str, str] = ("one", "the other")
) -> str | None:
    """Where two artifacts' ``moe_layer_indices`` differ, in words; else None.

    ``names`` name the artifacts of ``mine`` and ``theirs`` in the words.
    """
    mine, theirs = [int(i) for i in mine], [int(i) for i in theirs]
    if mine == theirs:
        return None
    first = next(
        (i for i, (x, y) in enumerate(zip(mine, theirs, strict=False)) if x != y),
        min(len(mine), len(theirs)),
    )
    return (
        f"MoE layer {first} is model layer "
        f"{mine[first] if first < len(mine) else 'none'} in {names[0]} and "
        f"{theirs[first] if first < len(theirs) else 'none'} in {names[1]}"
    )


@dataclass(frozen=True)
class TraceMeta:
    """What a trace records: which model, and the shape of its routing.

    Attributes:
        model: model name or path it was recorded from.
        num_layers: L, MoE layers only (dense layers are skipped).
        num_experts: N, routed experts per MoE layer.
        top_k: k, experts each token is routed to per layer.
        vocab_size: V; token ids lie in [0, V) (or -1 when unknown).
        moe_layer_indices: model layer index of each MoE layer, length L.
        source: free text saying how the trace was made.
    """

    model: str
    num_layers: int
    num_experts: int
    top_k: int
    vocab_size: int
    moe_layer_indices: tuple[int, ...] = ()
    source: str = ""
    schema_version: int = SCHEMA_VERSION

    def __post_init__(self) -> None:
        # the scalars first: the default layer indices are built from num_layers
        if not isinstance(self.model, str):
            raise SchemaError(f"trace metadata model={self.model!r} must be a string")
        if not isinstance(self.source, str):
            raise SchemaError(f"trace metadata source={self.source!r} must be a string")
        if self.schema_version != SCHEMA_VERSION or not is_integer(self.schema_version):
            raise SchemaError(
                f"trace schema_version {self.schema_version!r} is not supported (expected "
                f"{SCHEMA_VERSION})"
            )
        for name in ("num_layers", "num_experts", "top_k", "vocab_size"):
            value = getattr(self, name)
            if not is_integer(value) or value <= 0:
                raise SchemaError(f"trace metadata {name}={value!r} must be a positive integer")
            object.__setattr__(self, name, int(value))  # a numpy integer does not go to JSON
        if self.num_layers > MAX_LAYERS:
            raise SchemaError(
                f"trace metadata num_layers={self.num_layers} is more than {MAX_LAYERS} MoE layers"
            )
        if not self.moe_layer_indices:
            object.__setattr__(self, "moe_layer_indices", tuple(range(self.num_layers)))
        indices = self.moe_layer_indices
        if isinstance(indices, str) or not all(is_integer(i) and i >= 0 for i in indices):
            raise SchemaError(f"moe_layer_indices {indices!r} must be non-negative integers")
        object.__setattr__(self, "moe_layer_indices", tuple(int(i) for i in indices))
        if any(b <= a for a, b in itertools.pairwise(self.moe_layer_indices)):
            raise SchemaError(
                f"moe_layer_indices {list(self.moe_layer_indices)} must increase (the model's "
                "MoE layers in order)"
            )
        if self.top_k > self.num_experts:
            raise SchemaError(
                f"trace metadata top_k={self.top_k} exceeds num_experts={self.num_experts}"
            )
        if self.vocab_size > 2**31:
            raise SchemaError(
                f"trace metadata vocab_size={self.vocab_size} exceeds 2**31 (token ids are int32)"
            )
        if self.num_experts > 32767:
            raise SchemaError(f"num_experts={self.num_experts} does not fit int16 expert ids")
        if len(self.moe_layer_indices) != self.num_layers:
            raise SchemaError(
                f"moe_layer_indices has {len(self.moe_layer_indices)} entries, "
                f"num_layers is {self.num_layers}"
            )

    @property
    def row_width(self) -> int:
        """Length L*k of the ``experts`` and ``weights`` lists."""
        return self.num_layers * self.top_k

    def fingerprint(self) -> str:
        """Short hash of what makes routing data comparable: model name and shapes.

        Artifacts derived from a trace (predictor, plan, bundle) carry it so that they
        refuse to be combined with data from another model.
        """
        key = json.dumps(
            [self.model, self.num_layers, self.num_experts, self.top_k, self.vocab_size],
            separators=(",", ":"),
        )
        return hashlib.sha256(key.encode()).hexdigest()[:16]

    def fingerprint_difference(self, other: TraceMeta) -> str:
        """The fields of :meth:`fingerprint` in which ``other`` differs, in words
        (``"num_experts 8 against 16"``); empty where the fingerprints agree. Two models of
        one name told a user nothing more than "fingerprints differ"."""
        fields = ("model", "num_layers", "num_experts", "top_k", "vocab_size")
        return ", ".join(
            f"{name} {getattr(self, name)!r} against {getattr(other, name)!r}"
            for name in fields
            if getattr(self, name) != getattr(other, name)
        )

    def layer_mismatch(
        self, other: TraceMeta, names: tuple[str, str] = ("one", "the other")
    ) -> str | None:
        """Where ``other`` records other model layers than this metadata, in words; else None.

        ``names`` name this metadata's artifact and the other's in the words.

        The fingerprint leaves ``moe_layer_indices`` out (artifacts made before it was
        checked keep theirs), so data of the same shapes from other layers is caught here.
        """
        return layer_indices_mismatch(self.moe_layer_indices, other.moe_layer_indices, names)

    def to_json(self) -> str:
        d = dataclasses.asdict(self)
        d["moe_layer_indices"] = list(self.moe_layer_indices)
        order = ["schema_version", "model", "num_layers", "num_experts", "top_k", "vocab_size"]
        ordered = {k: d[k] for k in order} | {k: v for k, v in d.items() if k not in order}
        return json.dumps(ordered)

    @classmethod
    def from_json(cls, text: str | bytes, *, where: str = "trace") -> TraceMeta:
        try:
            d = json.loads(text)
        except (ValueError, UnicodeDecodeError, RecursionError) as e:
            raise SchemaError(f"{where}: 'moeplan' metadata is not valid JSON ({e})") from None
        if not isinstance(d, dict):
            raise SchemaError(f"{where}: 'moeplan' metadata must be a JSON object")
        missing = [
            k for k in ("model", "num_layers", "num_experts", "top_k", "vocab_size") if k not in d
        ]
        if missing:
            raise SchemaError(f"{where}: 'moeplan' metadata lacks {', '.join(missing)}")
        fields = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in d.items() if k in fields}
        kwargs.setdefault("schema_version", d.get("schema_version", SCHEMA_VERSION))
        indices = kwargs.get("moe_layer_indices") or ()
        if not isinstance(indices, list | tuple):
            raise SchemaError(
                f"{where}: 'moeplan' metadata moe_layer_indices={indices!r} must be a list of "
                "model layer indices"
            )
        kwargs["moe_layer_indices"] = tuple(indices)
        try:
            return cls(**kwargs)
        except SchemaError as e:  # name the file: the checks above do not know it
            raise SchemaError(f"{where}: {e}") from None


def arrow_schema(meta: TraceMeta) -> pa.Schema:
    """The exact Arrow schema of a v1 trace with this metadata."""
    width = meta.row_width
    return pa.schema(
        [
            pa.field("request_id", pa.int64(), nullable=False),
            pa.field("position", pa.int32(), nullable=False),
            pa.field("token_id", pa.int32(), nullable=False),
            pa.field("experts", pa.list_(pa.field("element", pa.int16()), width), nullable=False),
            pa.field("weights", pa.list_(pa.field("element", pa.float16()), width), nullable=False),
        ],
        metadata={META_KEY: meta.to_json().encode()},
    )


def check_arrow_schema(schema: pa.Schema, meta: TraceMeta, where: str) -> None:
    """Raise :class:`SchemaError` unless ``schema`` holds v1 trace columns matching ``meta``."""
    names = set(schema.names)
    missing = [c for c in REQUIRED_COLUMNS if c not in names]
    if missing:
        raise SchemaError(f"{where}: not a v1 trace, missing column(s) {', '.join(missing)}")
    twice = [c for c in REQUIRED_COLUMNS if len(schema.get_all_field_indices(c)) > 1]
    if twice:
        raise SchemaError(f"{where}: not a v1 trace, column(s) {', '.join(twice)} appear twice")
    want = arrow_schema(meta)
    for col in REQUIRED_COLUMNS:
        got_t, want_t = schema.field(col).type, want.field(col).type
        if col in ("experts", "weights"):
            if not pa.types.is_fixed_size_list(got_t):
                raise SchemaError(f"{where}: column {col} is {got_t}, expected {want_t}")
            if got_t.list_size != meta.row_width:
                raise SchemaError(
                    f"{where}: column {col} has {got_t.list_size} entries per row, but "
                    f"num_layers*top_k = {meta.num_layers}*{meta.top_k} = {meta.row_width}"
                )
            if got_t.value_type != want_t.value_type:
                raise SchemaError(
                    f"{where}: column {col} holds {got_t.value_type}, expected {want_t.value_type}"
                )
        elif got_t != want_t:
            raise SchemaError(f"{where}: column {col} is {got_t}, expected {want_t}")


# ---------------------------------------------------------------------------------------
# Token-expert counts table: affinity aggregated elsewhere.

COUNTS_COLUMNS = ("layer", "token_id", "expert", "count")


@dataclass(frozen=True)
class CountsMeta:
    """Metadata of a token-expert counts table (``{"schema": "counts", ...}``).

    ``moe_layer_indices`` (optional, beyond DESIGN.md's keys; written when known): the
    model layer of each MoE layer the ``layer`` column numbers, as in a trace's metadata.
    """

    num_layers: int
    num_experts: int
    top_k: int
    vocab_size: int
    model: str = ""
    schema_version: int = SCHEMA_VERSION
    moe_layer_indices: tuple[int, ...] = ()

    def to_json(self) -> str:
        fields = dataclasses.asdict(self)
        if not self.moe_layer_indices:
            del fields["moe_layer_indices"]
        else:
            fields["moe_layer_indices"] = [int(i) for i in self.moe_layer_indices]
        return json.dumps({"schema": "counts"} | fields)


def counts_arrow_schema(meta: CountsMeta) -> pa.Schema:
    return pa.schema(
        [
            pa.field("layer", pa.int16()),
            pa.field("token_id", pa.int32()),
            pa.field("expert", pa.int16()),
            pa.field("count", pa.int64()),
        ],
        metadata={META_KEY: meta.to_json().encode()},
    )

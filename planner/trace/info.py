"""Summaries of a trace: shapes, token and request counts, per-layer expert-load skewness."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from rich.table import Table
from rich.text import Text

from planner.trace.io import TraceBatch, open_trace
from planner.trace.schema import TraceMeta


def load_skewness(load: np.ndarray) -> np.ndarray:
    """[L] max / mean routed activations per expert of ``load`` [L, N] (MoE-GPS's skewness;
    1.0 = even, NaN for a layer with no load)."""
    load = np.asarray(load, np.float64)
    mean = load.mean(axis=1)
    return np.divide(load.max(axis=1), mean, out=np.full(mean.shape, np.nan), where=mean > 0)


class LoadAccumulator:
    """Streams trace batches and accumulates what a summary needs.

    Attributes:
        load: [L, N] int64, routed activations of each expert of each MoE layer.
        tokens: token occurrences seen.
    """

    def __init__(self, meta: TraceMeta):
        self.meta = meta
        self.load = np.zeros((meta.num_layers, meta.num_experts), np.int64)
        self.tokens = 0
        self._requests: set[int] = set()
        # distinct ids seen, sorted: memory follows the trace, not vocab_size
        self._seen_tokens = np.zeros(0, np.int64)

    def add(self, batch: TraceBatch) -> None:
        n = self.meta.num_experts
        # One layer at a time: an int64 copy of the whole [T, L, k] block (the flat ids of
        # one bincount) took 400 MB beside a 65536-row batch of a 48-layer top-8 model.
        for layer in range(self.meta.num_layers):
            self.load[layer] += np.bincount(batch.experts[:, layer, :].ravel(), minlength=n)
        self.tokens += len(batch)
        self._requests.update(np.unique(batch.request_id).tolist())
        known = batch.token_id[batch.token_id >= 0]
        self._seen_tokens = np.union1d(self._seen_tokens, known.astype(np.int64))

    @property
    def skewness(self) -> np.ndarray:
        """[L] max/mean expert load per layer (1.0 = perfectly even)."""
        return load_skewness(self.load)

    def summary(self) -> dict:
        skew = self.skewness
        return {
            "tokens": int(self.tokens),
            "requests": len(self._requests),
            "distinct_tokens": int(self._seen_tokens.size),
            # null for a layer with no load (a zero-row trace): strict JSON has no NaN.
            "skewness_per_layer": [None if np.isnan(s) else round(float(s), 4) for s in skew],
            "skewness_mean": round(float(np.nanmean(skew)), 4) if self.tokens else None,
            "expert_load": self.load.tolist(),  # [L, N] routed activations
        }


def trace_summary(path: str | Path) -> dict:
    """Everything ``moeplan trace info`` prints, as a JSON-ready dict."""
    trace = open_trace(path)
    trace.request_ids()  # refuses a repeated (request, position) occurrence
    acc = LoadAccumulator(trace.meta)
    for batch in trace.iter_batches():
        acc.add(batch)
    m = trace.meta
    size = sum(p.stat().st_size for p in trace.parts)
    return {
        "path": str(path),
        "model": m.model,
        "source": m.source,
        "fingerprint": m.fingerprint(),
        "num_layers": m.num_layers,
        "num_experts": m.num_experts,
        "top_k": m.top_k,
        "vocab_size": m.vocab_size,
        "moe_layer_indices": list(m.moe_layer_indices),
        "parts": len(trace.parts),
        "missing_parts": trace.missing_parts(),
        "bytes": size,
        "bytes_per_token": round(size / acc.tokens, 2) if acc.tokens else None,
    } | acc.summary()


def render_summary(s: dict) -> Table:
    """A rich table of :func:`trace_summary`'s output, for a person to read."""
    # Paths, model names and sources are the user's text: plain Text, never parsed as rich
    # markup (whatever the console's markup setting), so "[...]" in them prints as it is.
    table = Table(title=Text(f"trace {s['path']}"), show_header=False, title_justify="left")
    table.add_column("field", style="bold")
    table.add_column("value")
    for key in ("model", "source", "fingerprint", "num_layers", "num_experts", "top_k",
                "vocab_size", "tokens", "requests", "distinct_tokens", "parts", "bytes",
                "bytes_per_token", "skewness_mean"):  # fmt: skip
        table.add_row(key, Text(str(s.get(key))))
    layers = s["moe_layer_indices"]
    skew = ", ".join(
        f"L{i}:" + ("n/a" if v is None else f"{v:.2f}")
        for i, v in zip(layers, s["skewness_per_layer"], strict=True)
    )
    table.add_row("skewness (max/mean)", Text(skew))
    if missing := s.get("missing_parts"):
        table.add_row("missing parts", Text(missing_parts_note(missing), style="yellow"))
    return table


def missing_parts_note(missing: list[str]) -> str:
    """What to say of a trace directory whose part numbering skips ``missing``."""
    shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
    return (
        f"the numbering of the trace's parts skips {shown}: a part lost or removed? Every "
        "command reads the parts that are there"
    )

"""Fixtures of the predict stage: small synthetic traces whose true affinity is known."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from planner.predict.counts import TokenExpertCounts, counts_from_triples
from planner.trace import TraceBatch, TraceMeta
from planner.trace.io import write_trace
from planner.trace.synth import SynthConfig, SynthGenerator, synthesize

# Small enough to fit in a fraction of a second, large enough for stable figures.
SMALL = dict(
    num_layers=4, num_experts=16, top_k=2, vocab_size=400, num_tokens=12_000,
    num_requests=120, token_zipf=1.0, expert_zipf=0.0, num_domains=2, seed=3,
)  # fmt: skip


def synth_trace(tmp: Path, name: str, **overrides) -> tuple[Path, SynthGenerator]:
    config = SynthConfig(**(SMALL | overrides))
    path = tmp / f"{name}.parquet"
    if not path.exists():
        synthesize(config, path)
    return path, SynthGenerator(config)


@pytest.fixture(scope="session")
def synth_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("predict-synth")


@pytest.fixture(scope="session")
def exact_trace(synth_dir) -> tuple[Path, SynthGenerator]:
    """Every occurrence of a token routes exactly to its preferred set (affinity 1)."""
    return synth_trace(synth_dir, "exact", affinity=1.0, layer_correlation=0.0)


@pytest.fixture(scope="session")
def random_trace(synth_dir) -> tuple[Path, SynthGenerator]:
    """Routing independent of the token, uniform over experts (affinity 0, no skew)."""
    return synth_trace(synth_dir, "random", affinity=0.0, layer_correlation=0.0)


def chain_batch(meta: TraceMeta, tokens: np.ndarray, request_id: np.ndarray) -> TraceBatch:
    """Rows whose experts follow a deterministic chain: top-1 at layer l = (token + l) % N.

    Rank r of layer l is expert ``(token + l + r) % N`` (k consecutive, distinct experts).
    """
    big_l, n, k = meta.num_layers, meta.num_experts, meta.top_k
    t = tokens.shape[0]
    experts = (
        tokens[:, None, None] + np.arange(big_l)[None, :, None] + np.arange(k)[None, None, :]
    ) % n
    w = np.broadcast_to(np.linspace(1.0, 0.5, k), (t, big_l, k))
    position = np.zeros(t, np.int32)
    for r in np.unique(request_id):
        idx = np.flatnonzero(request_id == r)
        position[idx] = np.arange(idx.size)
    return TraceBatch.from_arrays(request_id, position, tokens, experts, w)


def write_batch(path: Path, meta: TraceMeta, batch: TraceBatch) -> Path:
    return write_trace(path, meta, batch)


TWIN_META = TraceMeta("test/twins", num_layers=3, num_experts=16, top_k=2, vocab_size=100)


def twin_trace(directory: Path, seed: int = 0) -> Path:
    """A trace directory whose held-out tokens have known twins, plus their embeddings.

    Tokens j and j + 50 route identically (rank r of layer l: ``(3 * (j % 50) + l + 5 r) % 16``).
    Fitting requests use tokens 0..49 only; held-out requests (a 0.5 request split with
    ``seed``) use 50..99 only, so every held-out token is unseen. The embeddings
    (``embeddings.safetensors``, tensor ``embeddings``) make j the nearest known token of
    j + 50 by cosine similarity, while tokens' embeddings are otherwise unrelated.
    """
    from safetensors.numpy import save_file

    from planner.predict.split import RequestSplit
    from planner.trace.io import TraceWriter

    rng = np.random.default_rng(seed)
    rid = np.repeat(np.arange(20), 30)
    held = RequestSplit.make(np.arange(20), 0.5, seed).heldout_mask(rid)
    tokens = rng.integers(0, 50, rid.size) + np.where(held, 50, 0)
    base = tokens % 50
    m = TWIN_META
    experts = (
        3 * base[:, None, None] + np.arange(m.num_layers)[None, :, None] + 5 * np.arange(m.top_k)
    ) % 16
    w = np.broadcast_to(np.array([0.6, 0.4]), experts.shape)
    position = np.tile(np.arange(30), 20)
    TraceWriter(directory, m).write(TraceBatch.from_arrays(rid, position, tokens, experts, w))
    emb = rng.normal(size=(50, 32)).astype(np.float32)
    emb = np.concatenate([emb, emb + rng.normal(0, 0.05, emb.shape).astype(np.float32)])
    save_file({"embeddings": emb}, str(directory / "embeddings.safetensors"))
    return directory


def random_counts(meta: TraceMeta, n: int, seed: int, max_count: int = 5) -> TokenExpertCounts:
    """A counts table of ``n`` random routed (layer, token) draws of ``meta``, each seen
    1 to ``max_count - 1`` times and routed to top-k distinct experts, so every token's
    counts are those of real top-k routing (``k x max <= sum``)."""
    rng = np.random.default_rng(seed)
    k = meta.top_k
    experts = np.argsort(rng.random((n, meta.num_experts)), axis=1)[:, :k]
    times = rng.integers(1, max_count, n)
    return counts_from_triples(
        meta,
        np.repeat(rng.integers(0, meta.num_layers, n), k),
        np.repeat(rng.integers(0, meta.vocab_size, n), k),
        experts.ravel(),
        np.repeat(times, k),
    )

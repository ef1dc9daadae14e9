"""Fixtures shared by every stage's tests."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

from planner.trace import TraceBatch, TraceMeta

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("MOEPLAN_SHARED", REPO.parent / "shared"))
REALDATA = SHARED / "realdata"
FLAME_TRACE = REALDATA / "flame-moe-290m-prefill.parquet"
OLMOE_COUNTS = REALDATA / "olmoe-mixtral-token-expert-counts.parquet"

# Idle OpenMP threads busy-wait by default, which makes small torch ops many times slower on
# a 2-core machine shared with other processes.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Tests must never reach a model hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def child_env(**extra: str) -> dict[str, str]:
    """The environment for a test's Python subprocess: this checkout's ``planner`` first on
    its path (pytest's ``pythonpath`` setting reaches only pytest's own process, so a child
    would otherwise import whatever ``planner`` is installed, or none), plus ``extra``."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    return dict(os.environ, PYTHONPATH=path, **extra)


def load_script(path: Path, name: str) -> ModuleType:
    """The Python file at ``path`` (a benchmark or example script, not a package module),
    imported as ``name`` and registered in ``sys.modules`` (dataclasses look their module up
    there), with its own folder on ``sys.path`` while it runs, for the helpers it imports from
    beside it (``benchmarks/_common.py``)."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    folder = str(Path(path).parent)
    sys.path.insert(0, folder)
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(folder)
    return module


def synth_predictor(directory: Path, config) -> Path:
    """A synthetic trace from ``config`` (a SynthConfig) at ``directory/trace`` and the
    predictor fitted on it (default FitConfig) at ``directory/pred``; returns the trace."""
    from planner.predict.fit import FitConfig, fit_predictor
    from planner.trace.synth import synthesize

    trace = synthesize(config, directory / "trace")
    fit_predictor(trace, FitConfig()).predictor.save(directory / "pred")
    return trace


def random_batch(meta: TraceMeta, rows: int, seed: int = 0, requests: int = 4) -> TraceBatch:
    """A valid random batch: distinct experts per layer, descending weights summing to 1."""
    rng = np.random.default_rng(seed)
    big_l, n, k = meta.num_layers, meta.num_experts, meta.top_k
    experts = np.argsort(rng.random((rows, big_l, n)), axis=-1)[..., :k]
    w = np.sort(rng.random((rows, big_l, k)), axis=-1)[..., ::-1]
    w = w / w.sum(-1, keepdims=True)
    request_id = np.sort(rng.integers(0, requests, rows))
    position = np.zeros(rows, np.int32)
    for r in np.unique(request_id):
        idx = np.flatnonzero(request_id == r)
        position[idx] = np.arange(idx.size)
    token_id = rng.integers(0, meta.vocab_size, rows)
    return TraceBatch.from_arrays(request_id, position, token_id, experts, w)


@pytest.fixture
def small_meta() -> TraceMeta:
    return TraceMeta(
        model="test/tiny", num_layers=3, num_experts=8, top_k=2, vocab_size=50,
        moe_layer_indices=(1, 2, 3), source="tests",
    )  # fmt: skip


def require(path: Path) -> Path:
    if not path.exists():
        pytest.skip(f"{path} not found (shared/ is not beside the checkout)")
    return path


@pytest.fixture
def batch_rows_asked(monkeypatch) -> list:
    """The ``batch_rows`` every ``Trace.iter_batches`` call asks for, in call order (the
    readers' chunk sizes, whose peak memory follows them)."""
    from planner.trace.io import Trace, batch_rows_for

    asked: list = []
    original = Trace.iter_batches

    def spy(self, batch_rows=None, **kw):
        asked.append(batch_rows_for(self.meta) if batch_rows is None else batch_rows)
        return original(self, batch_rows, **kw)

    monkeypatch.setattr(Trace, "iter_batches", spy)
    return asked

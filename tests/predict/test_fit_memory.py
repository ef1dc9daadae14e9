"""What fit holds in memory while it counts: buffers bounded whatever the trace's length,
freed before the results are built, and the same predictor whatever their size."""

from __future__ import annotations

import tracemalloc
from collections import Counter

import numpy as np
import pytest

from planner.predict import counts as counts_module
from planner.predict.affinity import TokenExpertAffinity
from planner.predict.counts import SortedKeyCounter
from planner.predict.fit import FitConfig, fit_predictor
from planner.predict.ngram import MAX_ORDER, TransitionAccumulator
from planner.trace import TraceMeta
from tests.conftest import random_batch
from tests.predict.conftest import random_counts, synth_trace


@pytest.fixture
def counters(monkeypatch) -> list[SortedKeyCounter]:
    """Every SortedKeyCounter made while the test runs."""
    made: list[SortedKeyCounter] = []
    init = SortedKeyCounter.__init__

    def spy(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(SortedKeyCounter, "__init__", spy)
    return made


def naive_transitions(experts: np.ndarray, routed: bool) -> list[Counter]:
    """Per layer: (top-1 of layers l-3..l-1 or -1, routed expert, rank) -> occurrences."""
    t, big_l, k = experts.shape
    out = [Counter() for _ in range(big_l)]
    for row in range(t):
        for layer in range(big_l):
            ctx = tuple(
                int(experts[row, layer - i, 0]) if layer - i >= 0 else -1
                for i in range(MAX_ORDER, 0, -1)
            )
            for rank in range(k if routed else 1):
                out[layer][ctx + (int(experts[row, layer, rank]), rank)] += 1
    return out


@pytest.mark.parametrize(
    ("num_experts", "routed", "dtype"),
    [(256, False, np.uint32), (128, True, np.uint32), (256, True, np.uint64), (257, False, np.uint64)],
)  # fmt: skip
def test_transition_keys_take_four_bytes_where_they_fit(num_experts, routed, dtype):
    # Keys are base-N digits (the slots before layer 0 implied by the layer) and the rank:
    # N**4 * k of them. With (N + 1)**4 * k they were 8 bytes for every model, twice the
    # buffer; top-1 statistics of 256 experts use the very last 4-byte key.
    meta = TraceMeta("test/keys", 5, num_experts, 2, 50)
    batch = random_batch(meta, 300, seed=num_experts)
    experts = batch.experts.copy()
    experts[:40] = np.array([num_experts - 1, num_experts - 2])  # the largest keys
    acc = TransitionAccumulator(meta.num_layers, num_experts, routed=routed)
    acc.add(experts[:170])
    acc.add(experts[170:])
    assert all(c.dtype == dtype for c in acc._counters)
    result = acc.result()
    want = naive_transitions(experts, routed)
    for layer in range(meta.num_layers):
        keys, counts = result.layer(layer)
        got = {tuple(int(x) for x in key): int(c) for key, c in zip(keys, counts, strict=True)}
        assert got == dict(want[layer]), layer
        assert [tuple(x) for x in keys.tolist()] == sorted(want[layer])  # in key order


def test_fit_frees_every_counting_buffer_before_it_builds_the_results(
    synth_dir, counters, monkeypatch
):
    # The counts, the shrinkage fold and the transitions each buffer raw keys, up to 2**27
    # and 2**22 a layer; each result was built while the others' buffers (and its own
    # later layers') were still held.
    trace, _ = synth_trace(synth_dir, "fit-memory")
    held = []
    to_csr = counts_module._to_csr

    def spy(*args, **kwargs):
        held.append(sum(c._buffer.nbytes for c in counters))
        return to_csr(*args, **kwargs)

    monkeypatch.setattr(counts_module, "_to_csr", spy)
    fit_predictor(trace, FitConfig(holdout=0.25))
    assert len(counters) > 3 * 4  # counts, top-1 counts, fold, transitions: 4 layers each
    assert held and held == [0] * len(held)


def test_fit_counting_buffers_are_bounded_by_a_fixed_budget(tmp_path, counters):
    # Qwen3-30B's routing shape: 48 layers, 128 experts, top-8. The buffers fill as the
    # trace goes; their limits were 2.7 GiB in all (the transitions' 2**22 8-byte keys a
    # layer, 1.5 GiB, and 2**27 keys for the 8-layer fold), reached on a trace of 4M tokens.
    trace, _ = synth_trace(
        tmp_path, "wide", num_layers=48, num_experts=128, top_k=8, vocab_size=1000,
        num_tokens=300, num_requests=6,
    )  # fmt: skip
    fit_predictor(trace, FitConfig())
    limit = sum(c.capacity * np.dtype(c.dtype).itemsize for c in counters)
    assert len(counters) == 48 * 3 + 8 * 2
    assert limit <= 1.2 * 2**30, limit / 2**30


def test_the_buffers_size_does_not_change_the_predictor(synth_dir, counters, monkeypatch):
    trace, _ = synth_trace(synth_dir, "fit-memory")
    config = FitConfig(holdout=0.25, ngram_routed=True)
    want = fit_predictor(trace, config)
    init = SortedKeyCounter.__init__

    def tiny(self, dtype, capacity=1 << 27):
        init(self, dtype, min(capacity, 97))  # a merge every few hundred keys

    monkeypatch.setattr(SortedKeyCounter, "__init__", tiny)
    got = fit_predictor(trace, config)
    a, b = want.predictor, got.predictor
    assert a.transitions is not None and b.transitions is not None
    assert a.batches is not None and b.batches is not None
    for x, y in (
        (a.affinity.to_tensors(), b.affinity.to_tensors()),
        (a.transitions.to_tensors(), b.transitions.to_tensors()),
        (a.batches.to_tensors(), b.batches.to_tensors()),
    ):
        assert x.keys() == y.keys()
        for name in x:
            np.testing.assert_array_equal(x[name], y[name], err_msg=name)
            assert x[name].dtype == y[name].dtype, name
    np.testing.assert_array_equal(a.token_shrinkage, b.token_shrinkage)
    np.testing.assert_array_equal(a.distribution.predict(), b.distribution.predict())
    assert want.report is not None and got.report is not None
    timed = ("cost",)  # prediction time per token
    assert {k: v for k, v in want.report.items() if k not in timed} == {
        k: v for k, v in got.report.items() if k not in timed
    }


def test_the_table_fit_and_its_save_hold_no_layers_by_vocabulary_int64_array():
    # Per-token sums over the layers and the save's [L, V + 1] row pointers were built from
    # an int64 [L, V] stack and its copies (116 and 145 MiB at Qwen3-30B's 48 layers x
    # 151936 ids: a short trace's peak); now a layer at a time, into the final arrays.
    meta = TraceMeta("test/vocab", 8, 16, 2, 300_000)
    counts = random_counts(meta, 500, seed=1)
    stack = meta.num_layers * meta.vocab_size * 8
    tracemalloc.start()
    try:
        affinity = TokenExpertAffinity().fit(counts)
        fit_peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.reset_peak()
        tensors = affinity.file_tensors()
        save_peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert fit_peak < stack, fit_peak / stack
    assert save_peak < stack, save_peak / stack
    # the same values as the stack gave
    offsets = np.cumsum([0] + [c.nnz for c in counts.by_layer])
    layers = zip(counts.by_layer, offsets[:-1], strict=True)
    want = np.stack([c.indptr.astype(np.int64) + o for c, o in layers])
    indptr = tensors["indptr"]
    assert isinstance(indptr, np.ndarray) and indptr.dtype == np.int32
    np.testing.assert_array_equal(indptr, want)
    acts = counts.token_activations()
    np.testing.assert_array_equal(affinity.seen_, (acts > 0).any(axis=0))
    occurrences = np.rint(acts.mean(axis=0) / meta.top_k).astype(np.int64)
    np.testing.assert_array_equal(
        affinity.token_counts_, np.where(affinity.seen_, np.maximum(occurrences, 1), 0)
    )


def test_row_pointers_past_int32_are_summed_in_int64():
    # A layer's int32 indptr plus an offset just under 2**31 passes 2**31: numpy 1.x (which
    # pyproject allows) added them in int32 and wrapped. Layers stand in for CSR arrays of
    # that many nonzeros (only nnz, indptr and data are read for the row pointers).
    from types import SimpleNamespace

    from planner.predict.affinity import _pack_csr

    big = 2**31 - 50
    first = SimpleNamespace(nnz=big, indptr=np.array([0, big], np.int64), data=np.ones(1))
    second = SimpleNamespace(nnz=100, indptr=np.array([0, 100], np.int32), data=np.ones(1))
    indptr = _pack_csr((first, second), "")["indptr"]
    assert indptr.dtype == np.int64
    np.testing.assert_array_equal(indptr, [[0, big], [big, big + 100]])

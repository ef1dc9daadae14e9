"""n-gram device tables fitted from top-1 transition counts."""

from __future__ import annotations

import numpy as np
import pytest

from planner.errors import InputError, MismatchError
from planner.export.bundle import ngram_row_index
from planner.predict.ngram import (
    TransitionAccumulator,
    contiguous_placement,
    evaluate_ngram_device_table,
    fit_ngram_device_table,
    ngram_context_affinity,
    predict_devices,
)
from planner.trace import TraceBatch, TraceMeta
from tests.predict.conftest import chain_batch

META = TraceMeta("test/ngram", num_layers=5, num_experts=8, top_k=2, vocab_size=20)


def transitions_of(batch):
    acc = TransitionAccumulator(META.num_layers, META.num_experts)
    acc.add(batch.experts[:7])
    acc.add(batch.experts[7:])  # chunked: same result
    return acc.result()


def test_transition_tuples_on_a_hand_case():
    batch = chain_batch(META, np.array([3, 3, 5]), np.array([0, 0, 1]))
    t = transitions_of(batch)
    keys, counts = t.layer(0)  # rank r of layer l is expert (token + l + r) % 8
    assert keys.tolist() == [
        [-1, -1, -1, 3, 0], [-1, -1, -1, 4, 1], [-1, -1, -1, 5, 0], [-1, -1, -1, 6, 1]
    ]  # fmt: skip
    assert counts.tolist() == [2, 2, 1, 1]
    keys, counts = t.layer(4)  # context: top-1 experts of layers 1..3
    assert keys.tolist() == [[4, 5, 6, 0, 1], [4, 5, 6, 7, 0], [6, 7, 0, 1, 0], [6, 7, 0, 2, 1]]
    assert counts.tolist() == [2, 2, 1, 1]
    for bad in (-1, 5):  # -1 read the last layer, 5 an IndexError
        with pytest.raises(InputError, match=r"layer .* outside \[0, 5\)"):
            t.layer(bad)


def test_routed_target_counts_every_routed_expert():
    """Context -> devices of all k routed experts: confidence is the expected local share."""
    batch = chain_batch(META, np.array([0, 0, 0, 0]), np.arange(4))
    t = transitions_of(batch)
    # Layer 1 routes to experts (1, 2): put expert 1 on device 0, expert 2 on device 1.
    e2d = np.array([[e % 2 for e in range(8)]] * 5, np.int16)
    routed = fit_ngram_device_table(t, e2d, 2, order=1)
    top1 = fit_ngram_device_table(t, e2d, 2, order=1, target="top1")
    row = e2d[0, 0]  # layer 0's top-1 expert is 0
    assert top1.to_device[1, row] == 1 and top1.confidence[1, row] == 1.0
    # One of the two routed experts sits on each device: the tie goes to the top-1's device.
    assert routed.to_device[1, row] == 1 and routed.confidence[1, row] == 0.5
    with pytest.raises(InputError, match="target"):
        fit_ngram_device_table(t, e2d, 2, target="all")
    # Top-1-only statistics (the paper's, a faster fit) give the paper's table either way.
    acc = TransitionAccumulator(META.num_layers, META.num_experts, routed=False)
    acc.add(batch.experts)
    lean = acc.result()
    assert (lean.keys[:, 4] == 0).all()
    for target in ("routed", "top1"):
        table = fit_ngram_device_table(lean, e2d, 2, order=1, target=target)
        np.testing.assert_array_equal(table.to_device, top1.to_device)
        np.testing.assert_array_equal(table.confidence, top1.confidence)


def test_row_layout_is_base_e_with_the_most_recent_layer_last():
    assert ngram_row_index(np.array([[1, 2], [3, 0]]), 4).tolist() == [1 * 4 + 2, 3 * 4 + 0]


def test_deterministic_chain_gives_confidence_one_and_the_right_device():
    """The paper's table (no backoff): raw frequencies, unseen contexts undefined."""
    tokens = np.repeat(np.arange(20), 3)
    batch = chain_batch(META, tokens, np.arange(tokens.size) // 6)
    t = transitions_of(batch)
    ep = 4
    # A scrambled placement: device of expert e at layer l = (e + l) % 4 ... any valid map works.
    e2d = np.array([[(e * 3 + layer) % ep for e in range(8)] for layer in range(5)], np.int16)
    table = fit_ngram_device_table(t, e2d, ep, order=2, target="top1", backoff=0)
    assert table.to_device.shape == (5, ep**2) and table.to_device.dtype == np.int16
    assert table.confidence.dtype == np.float16
    assert (table.confidence[:2] == 0).all()  # l < n: undefined
    checked = 0
    for layer in range(2, 5):
        seen_rows = set()
        for tok in range(20):
            e = [(tok + x) % 8 for x in (layer - 2, layer - 1, layer)]
            row = e2d[layer - 2, e[0]] * ep + e2d[layer - 1, e[1]]
            seen_rows.add(row)
            want = e2d[layer, e[2]]
            # Several tokens may share a device context; confidence is 1 only if they agree.
            devices = {
                e2d[layer, (t2 + layer) % 8]
                for t2 in range(20)
                if e2d[layer - 2, (t2 + layer - 2) % 8] * ep + e2d[layer - 1, (t2 + layer - 1) % 8]
                == row
            }
            if len(devices) == 1:
                assert table.to_device[layer, row] == want
                assert table.confidence[layer, row] == 1.0
                checked += 1
        unseen = [r for r in range(ep**2) if r not in seen_rows]
        assert all(table.confidence[layer, r] == 0 for r in unseen)
    assert checked >= 20
    ev = evaluate_ngram_device_table(table, [batch.experts], e2d, META.top_k).summary()
    assert ev["top1_device_accuracy"]["per_layer"][:2] == [None, None]


def test_identity_chain_with_contiguous_placement_is_perfectly_predictable():
    tokens = np.arange(8).repeat(4)
    batch = chain_batch(META, tokens, np.arange(tokens.size) // 4)
    e2d = contiguous_placement(META.num_layers, META.num_experts, 8)  # one expert per device
    table = fit_ngram_device_table(transitions_of(batch), e2d, 8, order=1, target="top1", backoff=0)
    ev = evaluate_ngram_device_table(table, [batch.experts], e2d, META.top_k).summary()
    assert ev["top1_device_accuracy"]["overall"] == 1.0
    device, conf = predict_devices(table, batch.experts, e2d)
    assert (conf[:, 1:] == 1.0).all() and (conf[:, 0] == 0).all()
    np.testing.assert_array_equal(device[:, 1:], batch.experts[:, 1:, 0])


def test_orders_one_to_three_and_bad_arguments():
    batch = chain_batch(META, np.arange(10), np.zeros(10, np.int64))
    t = transitions_of(batch)
    e2d = contiguous_placement(5, 8, 2)
    for n in (1, 2, 3):
        table = fit_ngram_device_table(t, e2d, 2, order=n)
        assert table.to_device.shape == (5, 2**n)
        assert (table.confidence[:n] == 0).all() and (table.confidence[n:].max(axis=1) > 0).all()
    with pytest.raises(InputError, match="ngram order 4 must be 1, 2 or 3"):
        fit_ngram_device_table(t, e2d, 2, order=4)
    with pytest.raises(InputError, match="ep_size=3 must be a positive divisor of num_experts=8"):
        fit_ngram_device_table(t, e2d, 3)
    with pytest.raises(MismatchError, match=r"expert_to_device has shape \(4, 8\)"):
        fit_ngram_device_table(t, e2d[:4], 2)


def test_backoff_fills_unseen_contexts_and_tempers_rare_ones():
    """Hand case: 3 layers, experts 0..3 on devices 0, 0, 1, 1, k = 1, EP 2, order 2, m = 2.
    Layer 2's table interpolates each context's counts with the next lower order's."""
    paths = [(0, 0, 0)] * 2 + [(0, 2, 3)] + [(2, 0, 0)] * 3
    experts = np.array([[[a], [b], [c]] for a, b, c in paths], np.int16)
    batch = TraceBatch.from_arrays(
        np.zeros(len(paths)), np.arange(len(paths)), np.zeros(len(paths), np.int64), experts,
        np.ones(experts.shape),
    )  # fmt: skip
    acc = TransitionAccumulator(3, 4)
    acc.add(batch.experts)
    t = acc.result()
    e2d = np.array([[0, 0, 1, 1]] * 3, np.int16)
    raw = fit_ngram_device_table(t, e2d, 2, order=2, target="top1", backoff=0)
    table = fit_ngram_device_table(t, e2d, 2, order=2, target="top1", backoff=2.0)
    # layer 2: order 0 shares d0 5/6, d1 1/6 (5 tokens end on d0, 1 on d1)
    p0 = np.array([5 / 6, 1 / 6])
    # order 1 (device at l-1): ctx 0 -> 5 tokens, all d0; ctx 1 -> 1 token, d1
    p1 = {0: (np.array([5, 0]) + 2 * p0) / 7, 1: (np.array([0, 1]) + 2 * p0) / 3}
    # order 2, row = D_{l-2} * 2 + D_{l-1}: row 0 = (0, 0) 2 tokens d0; row 1 = (0, 1) 1 token
    # d1; row 2 = (1, 0) 3 tokens d0; row 3 = (1, 1) never seen -> backs off to p1[1]
    p2 = {
        0: (np.array([2, 0]) + 2 * p1[0]) / 4,
        1: (np.array([0, 1]) + 2 * p1[1]) / 3,
        2: (np.array([3, 0]) + 2 * p1[0]) / 5,
        3: p1[1],
    }
    for row, p in p2.items():
        assert table.to_device[2, row] == np.argmax(p), row
        assert table.confidence[2, row] == pytest.approx(p.max(), abs=1e-3), row
    # the raw table: the rare context (0, 1) is certain, the unseen (1, 1) undefined
    assert raw.confidence[2, 1] == 1.0 and raw.to_device[2, 1] == 1
    assert raw.confidence[2, 3] == 0 and raw.to_device[2, 3] == 0
    assert table.confidence[2, 1] < 1.0
    assert (table.confidence[:2] == 0).all()
    with pytest.raises(InputError, match="backoff"):
        fit_ngram_device_table(t, e2d, 2, backoff=-1.0)


def test_backoff_pseudo_counts_are_tokens_under_routed_statistics():
    """k = 2, EP 2, order 1: experts 0, 1 on device 0 and 2, 3 on device 1. Three tokens
    route (0, 1) -> (0, 1), one (2, 3) -> (2, 0). Layer 1's shares are 7/8 and 1/8; context
    device 1, seen once, holds half a token on each device, so with m = 2 tokens
    P = ([0.5, 0.5] + 2 [7/8, 1/8]) / 3 = [0.75, 0.25]. Counting m in routed tuples (2/k of
    a token) gave ([1, 1] + 2 [7/8, 1/8]) / 4 = [0.6875, 0.3125]."""
    experts = np.array([[[0, 1], [0, 1]]] * 3 + [[[2, 3], [2, 0]]], np.int16)
    weights = np.broadcast_to(np.array([0.6, 0.4]), experts.shape)
    batch = TraceBatch.from_arrays(np.arange(4), np.zeros(4), np.zeros(4, np.int64), experts,
                                   weights)  # fmt: skip
    acc = TransitionAccumulator(2, 4)
    acc.add(batch.experts)
    e2d = np.array([[0, 0, 1, 1]] * 2, np.int16)
    table = fit_ngram_device_table(acc.result(), e2d, 2, order=1, backoff=2.0)
    assert table.to_device[1, 1] == 0
    assert table.confidence[1, 1] == pytest.approx(0.75, abs=1e-3)
    assert table.confidence[1, 0] == pytest.approx((3 + 2 * 7 / 8) / 5, abs=1e-3)


@pytest.mark.parametrize("target", ["routed", "top1"])
@pytest.mark.parametrize("order", [1, 2])
def test_context_affinity_summed_per_device_is_the_tables_joint_count(target, order):
    """Row c of the context affinity, summed over each device's experts, is what the table
    fit counts for context c: its argmax is the table's device, max / sum its confidence."""
    rng = np.random.default_rng(3)
    experts = np.stack([rng.permutation(8)[:2] for _ in range(300 * 5)]).reshape(300, 5, 2)
    batch = TraceBatch.from_arrays(
        np.repeat(np.arange(30), 10), np.tile(np.arange(10), 30), rng.integers(0, 20, 300),
        experts, np.ones((300, 5, 2)),
    )  # fmt: skip
    t = transitions_of(batch)
    e2d = np.stack([rng.permutation(np.arange(8) % 4) for _ in range(5)])
    table = fit_ngram_device_table(t, e2d, 4, order=order, target=target, backoff=0)
    for layer in range(5):
        rows = ngram_context_affinity(t, e2d, layer, 4, order=order, target=target).toarray()
        assert rows.shape == (4**order, 8)
        if layer < order:
            assert not rows.any()
            continue
        # every tuple counted once: all k routed experts (routed) or the top-1 (top1)
        assert rows.sum() == 300 * (2 if target == "routed" else 1)
        per_device = rows @ np.eye(4)[e2d[layer]]
        seen = per_device.sum(axis=1) > 0
        best = per_device[seen].max(axis=1)
        np.testing.assert_allclose(
            table.confidence[layer, seen], best / per_device[seen].sum(axis=1), atol=1e-3
        )
        got = per_device[seen, table.to_device[layer, seen]]
        np.testing.assert_array_equal(got, best)  # the table's device is an argmax
    with pytest.raises(InputError, match="order"):
        ngram_context_affinity(t, e2d, 2, 4, order=4)

"""Runtime tables: load a bundle into torch, Algorithm 2's online choice, the capacity rule.

The vectorised code is checked against golden hand cases and against plain Python loops
that follow DESIGN.md word for word.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from planner.errors import InfeasibleError, InputError
from planner.export import Bundle, save_bundle
from planner.runtime_shim import PlanTables, load_bundle
from planner.runtime_shim.tables import (
    assign_with_capacity,
    balanced_capacity,
    ngram_row_index,
    online_candidates,
    online_choice,
)
from planner.trace import TraceMeta

META = TraceMeta(model="test/rt", num_layers=4, num_experts=8, top_k=2, vocab_size=20)


def random_bundle(seed: int = 0, ep_size: int = 4, order: int = 2, meta: TraceMeta = META):
    rng = np.random.default_rng(seed)
    big_l, n, v = meta.num_layers, meta.num_experts, meta.vocab_size
    cols = ep_size**order
    ngram_conf = rng.random((big_l, cols))
    ngram_conf[:order] = 0
    return Bundle.from_arrays(
        meta,
        ep_size=ep_size,
        expert_to_device=np.stack([rng.permutation(n) % ep_size for _ in range(big_l)]),
        token_to_device=rng.integers(0, ep_size, (big_l, v)),
        # Coarse values so that ties between the two tables happen.
        token_confidence=rng.integers(0, 5, (big_l, v)) / 4,
        ngram_to_device=rng.integers(0, ep_size, (big_l, cols)),
        ngram_confidence=rng.integers(0, 5, (big_l, cols)) / 4 * (ngram_conf > 0),
        ngram_order=order,
    )


@pytest.fixture
def tables(tmp_path) -> PlanTables:
    return load_bundle(save_bundle(random_bundle(), tmp_path / "b"))


# ---------------------------------------------------------------------------------------
# Reference implementations (loops over tokens)


def reference_choice(b: Bundle, token_ids, layer, prev, *, second=False):
    e, n = b.ep_size, b.ngram_order
    devices, confs, seconds, second_confs = [], [], [], []
    for t, tok in enumerate(token_ids):
        dev, conf = int(b.token_to_device[layer, tok]), float(b.token_confidence[layer, tok])
        alt, alt_conf = -1, 0.0
        if prev is not None and layer >= n:
            row = 0
            for j in range(n):  # layer l-n+j, most recent (j = n-1) least significant
                row = row * e + int(b.expert_to_device[layer - n + j, prev[t][j]])
            ndev, nconf = int(b.ngram_to_device[layer, row]), float(b.ngram_confidence[layer, row])
            if nconf > conf:
                dev, conf, alt, alt_conf = ndev, nconf, dev, conf
            elif nconf > 0:  # an n-gram entry of confidence 0 predicts nothing
                alt, alt_conf = ndev, nconf
            if alt == dev:
                alt = -1
        devices.append(dev)
        confs.append(conf)
        seconds.append(alt)
        second_confs.append(alt_conf)
    if second:
        return devices, confs, seconds, second_confs
    return devices, confs


def reference_capacity(devices, confs, capacity, num_devices, seconds=None, second_confs=None):
    t = len(devices)
    out = list(devices)
    load = [0] * num_devices
    order = sorted(range(t), key=lambda i: (-confs[i], i))  # most confident first
    overflow = []
    for i in order:
        if load[devices[i]] < capacity:
            load[devices[i]] += 1
        else:
            overflow.append(i)
    if seconds is not None:  # second choices, most confident (in them) first, where room
        placed = set()
        for i in sorted(overflow, key=lambda i: (-second_confs[i], i)):
            d = seconds[i]
            if d >= 0 and load[d] < capacity:
                out[i] = d
                load[d] += 1
                placed.add(i)
        overflow = [i for i in overflow if i not in placed]
    for i in overflow:  # least-loaded device with room, lowest id on ties
        d = min((d for d in range(num_devices) if load[d] < capacity), key=lambda d: (load[d], d))
        out[i] = d
        load[d] += 1
    return out


# ---------------------------------------------------------------------------------------
# Loading


def test_load_bundle_keeps_tables_exact(tmp_path):
    bundle = random_bundle(seed=4)
    tables = load_bundle(save_bundle(bundle, tmp_path / "b"), device="cpu")
    for name, arr in bundle.tables().items():
        tensor = getattr(tables, name)
        assert tensor.dtype == {"int16": torch.int16, "float16": torch.float16}[str(arr.dtype)]
        np.testing.assert_array_equal(tensor.numpy(), arr)
    assert (tables.ep_size, tables.ngram_order, tables.num_layers) == (4, 2, 4)
    assert (tables.num_experts, tables.vocab_size) == (8, 20)
    assert tables.manifest["fingerprint"] == META.fingerprint()
    assert "sha256" in tables.manifest["files"]["tables.safetensors"]  # the one on disk
    assert tables.device == torch.device("cpu")
    with pytest.raises(InputError, match="cannot put the plan tables on device 'nonsense'"):
        load_bundle(tmp_path / "b", device="nonsense")
    if not torch.cuda.is_available():  # a CPU build: torch's own AssertionError before
        with pytest.raises(InputError, match="cannot put the plan tables on device 'cuda'"):
            load_bundle(tmp_path / "b", device="cuda")


def test_hand_built_tables_are_checked_as_they_are_built():
    import dataclasses

    tables = hand_tables()
    bad = [
        ({"token_to_device": tables.token_to_device.long()}, "token_to_device is torch.int64"),
        (
            {"token_confidence": tables.token_confidence[:, :3]},
            r"shape \[2, 3\], expected \[2, 4\]",
        ),
        ({"ngram_to_device": tables.ngram_to_device.numpy()}, "must be a torch.Tensor"),
        ({"ngram_order": 2}, r"ngram_to_device has shape \[2, 2\], expected \[2, 4\]"),
        ({"ep_size": 3}, "not divisible by ep_size=3"),
        ({"vocab_size": 0}, "vocab_size=0 must be a positive integer"),
        ({"ngram_order": 10**12}, "n-gram columns is too many"),  # refused before 2**(1e12)
        ({"ngram_order": 10**400}, "n-gram columns is too many"),  # no float overflow
        ({"expert_to_device": tables.expert_to_device.to("meta")}, "on the meta device"),
    ]
    for change, message in bad:
        with pytest.raises(InputError, match=message):
            dataclasses.replace(tables, **change)
    assert dataclasses.replace(tables, manifest={"note": 1}).route(
        torch.tensor([1]), 0
    ).tolist() == [1]
    # one device: 1**n is one column whatever n, as the bundle's own validation accepts
    one = dataclasses.replace(
        tables,
        ep_size=1,
        ngram_order=25,
        expert_to_device=torch.zeros_like(tables.expert_to_device),
        token_to_device=torch.zeros_like(tables.token_to_device),
        ngram_to_device=torch.zeros((2, 1), dtype=torch.int16),
        ngram_confidence=torch.zeros((2, 1), dtype=torch.float16),
    )
    assert one.route(torch.tensor([1, 2]), 1).tolist() == [0, 0]


# ---------------------------------------------------------------------------------------
# Golden cases


def hand_tables() -> PlanTables:
    """E = 2, n = 1, L = 2, N = 4, V = 4, small enough to check by hand."""
    meta = TraceMeta(model="test/hand-rt", num_layers=2, num_experts=4, top_k=1, vocab_size=4)
    bundle = Bundle.from_arrays(
        meta,
        ep_size=2,
        expert_to_device=[[0, 0, 1, 1], [0, 1, 0, 1]],
        token_to_device=[[0, 1, 0, 1], [1, 1, 0, 0]],
        token_confidence=[[0.5, 0.5, 0.5, 0.5], [0.25, 0.5, 0.75, 1.0]],
        ngram_to_device=[[0, 0], [0, 1]],  # layer 1: device of prev expert kept
        ngram_confidence=[[0, 0], [0.5, 0.5]],
        ngram_order=1,
    )
    return PlanTables.from_bundle(bundle)


def test_route_golden():
    t = hand_tables()
    ids = torch.tensor([0, 1, 2, 3])
    # Layer 0 < n: the token table alone, even when previous experts are given.
    assert t.route(ids, 0).tolist() == [0, 1, 0, 1]
    assert t.route(ids, 0, torch.tensor([[2], [2], [2], [2]])).tolist() == [0, 1, 0, 1]
    # Layer 1 without history: token table.
    assert t.route(ids, 1).tolist() == [1, 1, 0, 0]
    # Layer 1 with history: previous top-1 experts 0, 3, 3, 0 at layer 0 -> devices
    # 0, 1, 1, 0 -> n-gram rows 0, 1, 1, 0 -> n-gram devices 0, 1, 1, 0, confidence 0.5.
    # Token confidences 0.25, 0.5, 0.75, 1.0: only token 0 is strictly less confident.
    prev = torch.tensor([[0], [3], [3], [0]])
    assert t.route(ids, 1, prev).tolist() == [0, 1, 0, 0]
    dev, conf = t.choose(ids, 1, prev)
    assert conf.tolist() == [0.5, 0.5, 0.75, 1.0]


def test_ngram_row_most_recent_layer_is_least_significant():
    assert ngram_row_index(torch.tensor([[1, 2], [2, 1]]), 4).tolist() == [1 * 4 + 2, 2 * 4 + 1]
    assert ngram_row_index(np.array([[1, 0, 3]]), 2).tolist() == [1 * 4 + 0 * 2 + 3]


def test_route_with_two_layers_of_history():
    meta = TraceMeta(model="test/n2", num_layers=3, num_experts=4, top_k=1, vocab_size=2)
    ngram_dev = np.zeros((3, 4), int)
    ngram_conf = np.zeros((3, 4))
    ngram_dev[2] = [0, 1, 0, 1]  # row = 2 * d(l-2) + d(l-1): predicts d(l-1)
    ngram_conf[2] = 1.0
    bundle = Bundle.from_arrays(
        meta, ep_size=2, expert_to_device=[[0, 0, 1, 1], [0, 1, 0, 1], [0, 0, 1, 1]],
        token_to_device=np.zeros((3, 2), int), token_confidence=np.full((3, 2), 0.5),
        ngram_to_device=ngram_dev, ngram_confidence=ngram_conf, ngram_order=2,
    )  # fmt: skip
    t = PlanTables.from_bundle(bundle)
    # Layer 2 looks at layers 0 and 1. prev experts [2, 1]: devices [1, 1] -> row 3 -> dev 1.
    # prev [3, 2]: devices [1, 0] -> row 2 -> dev 0.
    prev = torch.tensor([[2, 1], [3, 2]])
    assert t.route(torch.tensor([0, 1]), 2, prev).tolist() == [1, 0]
    assert t.route(torch.tensor([0, 1]), 1, prev).tolist() == [0, 0]  # l < n


def test_capacity_golden():
    # 6 tokens, 3 devices, capacity 2. Device 0 wants 5 tokens.
    device = [0, 0, 0, 0, 0, 2]
    conf = [0.1, 0.9, 0.5, 0.9, 0.3, 1.0]
    # Keep the two most confident on device 0: tokens 1 and 3 (tie at 0.9, order kept).
    # Overflow, most confident first: 2 (0.5), 4 (0.3), 0 (0.1). Loads: d0=2, d1=0, d2=1.
    # Token 2 -> d1 (load 0); token 4 -> d1 or d2 both at 1 -> d1 (lower id); token 0 -> d2.
    out = assign_with_capacity(np.array(device), np.array(conf), 2, 3)
    assert isinstance(out, np.ndarray)
    assert out.tolist() == [2, 0, 1, 0, 1, 2]
    assert out.tolist() == reference_capacity(device, conf, 2, 3)
    # Nothing overflows: unchanged.
    assert assign_with_capacity(torch.tensor([0, 1, 2]), torch.ones(3), 1, 3).tolist() == [0, 1, 2]


def test_capacity_second_choice_golden():
    # As above, and overflow tokens 2 and 4 name device 2 as their second choice.
    device = [0, 0, 0, 0, 0, 2]
    conf = [0.1, 0.9, 0.5, 0.9, 0.3, 1.0]
    second = [-1, 1, 2, -1, 2, -1]
    second_conf = [0.0, 0.8, 0.2, 0.0, 0.4, 0.0]
    # Device 2 has one free slot: token 4 (second confidence 0.4) beats token 2 (0.2).
    # Then the rest by confidence to the least loaded: token 2 -> d1, token 0 -> d1.
    out = assign_with_capacity(
        np.array(device), np.array(conf), 2, 3, np.array(second), np.array(second_conf)
    )
    assert out.tolist() == [1, 0, 1, 0, 2, 2]
    assert out.tolist() == reference_capacity(device, conf, 2, 3, second, second_conf)
    # Nothing overflows: second choices are ignored.
    same = assign_with_capacity(torch.tensor([0, 1]), torch.ones(2), 1, 2, torch.tensor([1, 0]),
                                torch.ones(2))  # fmt: skip
    assert same.tolist() == [0, 1]


def test_route_overflow_goes_to_the_ngram_device():
    # 4 tokens, all on token-table device 0 (confidence 1); the n-gram says device 1 (0.5).
    meta = TraceMeta(model="test/rt2", num_layers=2, num_experts=4, top_k=1, vocab_size=4)
    bundle = Bundle.from_arrays(
        meta, ep_size=4, expert_to_device=np.tile(np.arange(4), (2, 1)),
        token_to_device=np.zeros((2, 4), int), token_confidence=np.ones((2, 4)),
        ngram_to_device=np.ones((2, 4), int), ngram_confidence=np.full((2, 4), 0.5),
        ngram_order=1,
    )  # fmt: skip
    t = PlanTables.from_bundle(bundle)
    ids, prev = torch.arange(4), torch.zeros(4, 1, dtype=torch.int64)
    # Capacity 2: tokens 0, 1 keep device 0; 2, 3 overflow to their n-gram device 1.
    assert t.route(ids, 1, prev, max_tokens_per_device=2).tolist() == [0, 0, 1, 1]
    # Layer 0 has no n-gram prediction: the overflow goes to the least-loaded devices.
    assert t.route(ids, 0, prev, max_tokens_per_device=2).tolist() == [0, 0, 1, 2]


def test_route_with_capacity_keeps_most_confident():
    t = hand_tables()
    ids = torch.tensor([3, 2, 1, 0])  # layer 1 token table: devices 0, 0, 1, 1
    # confidences 1.0, 0.75, 0.5, 0.25; capacity 1 per device... with 2 devices only 2 fit.
    with pytest.raises(InfeasibleError, match="raise the capacity to at least 2"):
        t.route(ids, 1, max_tokens_per_device=1)
    ids = torch.tensor([3, 2, 0])  # devices 0, 0, 1, conf 1.0, 0.75, 0.25
    assert t.route(ids, 1, max_tokens_per_device=2).tolist() == [0, 0, 1]
    ids = torch.tensor([2, 3, 2])  # all on device 0, conf 0.75, 1.0, 0.75
    assert t.route(ids, 1, max_tokens_per_device=2).tolist() == [0, 0, 1]


def test_capacity_refuses_bad_arguments():
    # a 0-d numpy device went through as [0] (np.ascontiguousarray made it 1-D); torch's
    # 0-d was refused
    for zero_d in (np.array(0), torch.tensor(0)):
        with pytest.raises(InputError):
            assign_with_capacity(zero_d, np.array(1.0), 1, 2)
    with pytest.raises(InputError, match="device id 3 outside"):
        assign_with_capacity(np.array([0, 3]), np.zeros(2), 2, 3)
    with pytest.raises(InputError, match="must both be"):
        assign_with_capacity(np.array([0, 1]), np.zeros(3), 2, 3)
    with pytest.raises(InputError, match="must be integers"):
        assign_with_capacity(np.array([0.0]), np.zeros(1), 2, 3)
    with pytest.raises(InputError, match="go together"):
        assign_with_capacity(np.array([0, 1]), np.zeros(2), 2, 3, np.array([1, 0]))
    with pytest.raises(InputError, match="second id 3 outside"):
        assign_with_capacity(np.array([0, 1]), np.zeros(2), 2, 3, np.array([3, 0]), np.zeros(2))
    with pytest.raises(InputError, match="shape of device"):
        assign_with_capacity(np.array([0, 1]), np.zeros(2), 2, 3, np.array([1]), np.zeros(1))
    for capacity in (2.9, "3", True):  # not truncated or parsed
        with pytest.raises(InputError, match="need integers 0 < num_devices <= 32767 and capacity"):
            assign_with_capacity(np.array([0, 1]), np.zeros(2), capacity, 3)
    # device ids are int16: a huge device count allocated num_devices slots (8 TB at 10**12)
    with pytest.raises(InputError, match="num_devices <= 32767"):
        assign_with_capacity(np.array([0, 0]), np.zeros(2), 1, 10**12)
    for bad in (None, "ab", [[0, 1], [0]]):  # raw RuntimeError / TypeError / ValueError before
        with pytest.raises(InputError, match="^device must be a tensor or array of numbers"):
            assign_with_capacity(bad, np.zeros(2), 1, 2)
    # a capacity beyond the row never binds, however large (2**63 - 1 overflowed int64)
    out = assign_with_capacity(np.array([0, 0, 1]), np.zeros(3), 2**63 - 1, 3)
    assert out.tolist() == [0, 0, 1]


def test_capacity_refuses_nan_confidence():
    # A NaN sorted after every number: its token silently lost its device first ([1, 0, 0, 1]).
    dev = np.array([0, 0, 0, 1])
    with pytest.raises(InputError, match=r"^confidence holds 1 NaN value\(s\) of 4;"):
        assign_with_capacity(dev, np.array([np.nan, 0.5, 0.9, 0.1]), 2, 2)
    with pytest.raises(InputError, match=r"^confidence holds"):
        assign_with_capacity(torch.tensor(dev), torch.tensor([0.5, float("nan")] * 2).half(), 2, 2)
    second, second_conf = np.array([1, 1, 1, -1]), np.array([np.nan, 0.0, 0.0, 0.0])
    with pytest.raises(InputError, match=r"^second_confidence holds 1 NaN"):
        assign_with_capacity(dev, np.full(4, 0.5), 2, 2, second, second_conf)
    with pytest.raises(InputError, match=r"^confidence must hold real numbers, got torch.compl"):
        assign_with_capacity(dev, np.full(4, 0.5, complex), 2, 2)
    # +-inf keep the order: +inf above every number, -inf below (ties by position)
    conf = np.array([-np.inf, np.inf, 0.9, 0.1])
    assert assign_with_capacity(dev, conf, 2, 2).tolist() == [1, 0, 0, 1]
    conf = np.array([np.inf, 0.5, np.inf, 0.1])
    assert assign_with_capacity(dev, conf, 2, 2).tolist() == [0, 1, 0, 1]


def test_balanced_capacity_is_exact():
    assert balanced_capacity(4096, 8) == 564  # ceil(563.2)
    assert balanced_capacity(80, 8) == 11  # 1.1 * 80 / 8 is exactly 11
    assert balanced_capacity(4096, 32) == 141
    assert balanced_capacity(0, 8) == 0
    with pytest.raises(InputError):
        balanced_capacity(10, 0)
    for slack in (float("nan"), float("inf")):
        with pytest.raises(InputError, match="finite slack"):
            balanced_capacity(10, 2, slack)


# ---------------------------------------------------------------------------------------
# Vectorised == loops


@pytest.mark.parametrize("seed", range(6))
def test_route_equals_reference_loop(seed, tmp_path):
    bundle = random_bundle(seed=seed, ep_size=4 if seed % 2 else 2, order=1 + seed % 2)
    tables = PlanTables.from_bundle(bundle)
    rng = np.random.default_rng(100 + seed)
    t = 50
    ids = rng.integers(0, META.vocab_size, t)
    prev = rng.integers(0, META.num_experts, (t, bundle.ngram_order))
    for layer in range(META.num_layers):
        for history in (None, prev):
            want_dev, want_conf = reference_choice(bundle, ids, layer, history)
            h = None if history is None else torch.from_numpy(history)
            dev, conf = tables.choose(torch.from_numpy(ids), layer, h)
            assert dev.dtype == torch.int64
            assert dev.tolist() == want_dev
            np.testing.assert_allclose(conf.numpy(), want_conf)
            _, _, want_second, want_second_conf = reference_choice(
                bundle, ids, layer, history, second=True
            )
            got = tables.candidates(torch.from_numpy(ids), layer, h)
            assert got[2].tolist() == want_second
            np.testing.assert_allclose(got[3].numpy(), want_second_conf)
            cap = balanced_capacity(t, bundle.ep_size)
            got = tables.route(torch.from_numpy(ids), layer, h, max_tokens_per_device=cap)
            assert got.tolist() == reference_capacity(
                want_dev, want_conf, cap, bundle.ep_size, want_second, want_second_conf
            )


@pytest.mark.parametrize("seed", range(5))
def test_capacity_rows_equal_reference_loop(seed):
    rng = np.random.default_rng(seed)
    rows, t, e = 7, 40, 5
    device = rng.integers(0, e, (rows, t))
    device[0] = 0  # one row with everything on one device
    conf = rng.integers(0, 4, (rows, t)) / 3  # many ties
    cap = int(rng.integers(8, 12))
    out = assign_with_capacity(device, conf, cap, e)
    assert out.shape == (rows, t)
    for r in range(rows):
        assert out[r].tolist() == reference_capacity(device[r].tolist(), conf[r].tolist(), cap, e)
    second = rng.integers(-1, e, (rows, t))
    second_conf = rng.integers(0, 4, (rows, t)) / 3
    out = assign_with_capacity(device, conf, cap, e, second, second_conf)
    for r in range(rows):
        want = reference_capacity(
            device[r].tolist(), conf[r].tolist(), cap, e, second[r].tolist(),
            second_conf[r].tolist(),
        )  # fmt: skip
        assert out[r].tolist() == want


@settings(max_examples=60, deadline=None)
@given(
    st.integers(1, 6).flatmap(
        lambda e: st.tuples(
            st.just(e),
            st.lists(st.tuples(st.integers(0, e - 1), st.floats(0, 1)), min_size=1, max_size=60),
            st.integers(0, 5),
        )
    )
)
def test_capacity_invariants(case):
    e, tokens, extra = case
    device = np.array([d for d, _ in tokens])
    conf = np.array([c for _, c in tokens], np.float32)
    cap = -(-len(tokens) // e) + extra  # feasible
    second = (device + 1 + np.arange(len(tokens)) % 2) % (e + 1) - 1  # some -1
    second_conf = conf[::-1].copy()
    with_second = assign_with_capacity(device, conf, cap, e, second, second_conf)
    assert np.bincount(with_second, minlength=e).max() <= cap
    out = assign_with_capacity(device, conf, cap, e)
    # The same tokens keep their own device either way; only the overflow's targets differ.
    assert ((out == device) == (with_second == device)).all()
    counts = np.bincount(out, minlength=e)
    assert counts.max() <= cap
    wanted = np.bincount(device, minlength=e)
    for d in range(e):  # devices within capacity lose nobody
        if wanted[d] <= cap:
            assert (out[device == d] == d).all()
        else:  # a full device keeps exactly cap of its own, the most confident ones
            mine = np.flatnonzero(device == d)
            kept = mine[out[mine] == d]
            assert kept.size == cap
            assert conf[kept].min() >= conf[np.setdiff1d(mine, kept)].max()


def test_online_choice_numpy_and_ties():
    dev, conf = online_choice(
        np.array([0, 1, 2]), np.array([0.5, 0.5, 0.5], np.float16),
        np.array([3, 3, 3]), np.array([0.25, 0.5, 0.75], np.float16),
    )  # fmt: skip
    assert isinstance(dev, np.ndarray)
    assert dev.tolist() == [0, 1, 3]  # the n-gram table only where strictly more confident
    assert conf.tolist() == [0.5, 0.5, 0.75]


# ---------------------------------------------------------------------------------------
# Argument checks


def test_route_refuses_bad_arguments(tables):
    ids = torch.tensor([0, 1])
    with pytest.raises(InputError, match="layer=4 outside"):
        tables.route(ids, 4)
    for layer in (True, False, 1.0):  # bools are ints to Python, floats are not layers
        with pytest.raises(InputError, match=f"layer={layer!r} outside"):
            tables.route(ids, layer)
    with pytest.raises(InputError, match="token id 20 outside"):
        tables.route(torch.tensor([0, 20]), 0)
    with pytest.raises(InputError, match="token id -1 outside"):
        tables.route(torch.tensor([-1]), 0)
    with pytest.raises(InputError, match=r"prev_top1_experts must be \[T, n\] = \[2, 2\]"):
        tables.route(ids, 2, torch.zeros((2, 1), dtype=torch.long))
    with pytest.raises(InputError, match="expert 8, outside"):
        tables.route(ids, 2, torch.full((2, 2), 8))
    with pytest.raises(InputError, match="must hold integers"):
        tables.route(torch.tensor([0.0]), 0)
    assert tables.route(torch.empty(0, dtype=torch.long), 3).shape == (0,)


@pytest.mark.gpu
def test_route_on_cuda_matches_cpu(tables):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    gpu = tables.to("cuda")
    rng = np.random.default_rng(0)
    ids = torch.from_numpy(rng.integers(0, META.vocab_size, 4096))
    prev = torch.from_numpy(rng.integers(0, META.num_experts, (4096, 2)))
    cap = balanced_capacity(4096, 4)
    for layer in range(META.num_layers):
        want = tables.route(ids, layer, prev, cap)
        got = gpu.route(ids.cuda(), layer, prev.cuda(), cap)
        assert got.device.type == "cuda"
        assert got.cpu().tolist() == want.tolist()


def test_route_refuses_complex_ids(tables):
    # A complex tensor was cast to int64 with only torch's UserWarning (imaginary part dropped).
    ids = torch.tensor([1, 2])
    with pytest.raises(InputError, match="token_ids must hold integers, got torch.complex64"):
        tables.route(ids.to(torch.complex64), 0)
    prev = torch.tensor([[0, 1], [2, 3]], dtype=torch.complex64)
    with pytest.raises(InputError, match="prev_top1_experts must hold integers, got torch.compl"):
        tables.route(ids, 3, prev)
    with pytest.raises(InputError, match="device ids must be integers, got torch.complex128"):
        assign_with_capacity(np.array([0, 1], complex), np.zeros(2), 2, 2)  # NotImplementedError


def test_route_refuses_meta_tensors(tables):
    # torch's NotImplementedError / RuntimeError (Tensor.item() on meta) before
    ids = torch.tensor([1, 2])
    with pytest.raises(InputError, match="token_ids is on the meta device"):
        tables.route(ids.to("meta"), 0)
    prev = torch.zeros((2, 2), dtype=torch.long, device="meta")
    with pytest.raises(InputError, match="prev_top1_experts is on the meta device"):
        tables.route(ids, 3, prev)
    with pytest.raises(InputError, match="device is on the meta device"):
        assign_with_capacity(ids.to("meta"), torch.ones(2, device="meta"), 2, 4)


def test_route_reports_uint64_token_ids_with_their_true_value(tables):
    # The cast to int64 wrapped them: 2**63 + 5 was reported as -9223372036854775803
    for ids in ([2**63 + 5], [3, 2**63 + 5], [2**64 - 1]):
        bad = max(ids)
        with pytest.raises(InputError, match=rf"^token id {bad} outside \[0, 20\)"):
            tables.route(torch.tensor(ids, dtype=torch.uint64), 0)
    assert tables.route(torch.tensor([3, 5], dtype=torch.uint64), 0).tolist() == (
        tables.route(torch.tensor([3, 5]), 0).tolist()
    )


def test_uint64_device_and_expert_ids_are_checked_with_their_true_value(tables):
    # torch has no min / max for uint64: valid ids were torch's NotImplementedError 'min_all'
    dev, conf = torch.tensor([1, 0], dtype=torch.uint64), torch.ones(2)
    assert assign_with_capacity(dev, conf, 2, 4).tolist() == [1, 0]
    with pytest.raises(InputError, match=rf"^device id {2**63 + 1} outside \[0, 4\)"):
        assign_with_capacity(torch.tensor([2**63 + 1, 0], dtype=torch.uint64), conf, 2, 4)
    n, e = tables.ngram_order, tables.num_experts
    prev = torch.zeros((2, n), dtype=torch.uint64)
    ids, layer = torch.tensor([3, 5]), tables.num_layers - 1
    assert tables.route(ids, layer, prev).tolist() == tables.route(ids, layer, prev.long()).tolist()
    prev = torch.tensor([[0] * n, [2**64 - 1] + [0] * (n - 1)], dtype=torch.uint64)
    with pytest.raises(InputError, match=rf"expert {2**64 - 1}, outside \[0, {e}\)"):
        tables.route(ids, layer, prev)


def test_online_choice_refuses_arguments_of_different_shapes():
    # A [T] token table against a [T, 1] n-gram table broadcast silently to [T, T].
    dev, conf = np.array([0, 1, 2]), np.full(3, 0.5)
    with pytest.raises(InputError, match=r"same shape.*\[3\], \[3\], \[3, 1\], \[3, 1\]"):
        online_choice(dev, conf, dev[:, None], conf[:, None])
    with pytest.raises(InputError, match="same shape"):
        online_choice(dev, conf, dev[:1], conf)


def test_balanced_capacity_refuses_non_integer_sizes():
    assert balanced_capacity(np.int64(80), np.int32(8), np.float32(1.5)) == 15
    # 10.5 tokens gave 6 and True tokens 1; a string slack or None tokens a raw TypeError
    for args in ((10.5, 2), (True, 2), (10, True), (10, 2.0), (None, 2), (10, 2, "1.1")):
        with pytest.raises(InputError, match="balanced_capacity needs"):
            balanced_capacity(*args)


def test_tables_cannot_live_on_the_meta_device(tmp_path):
    # They loaded, and every route was then torch's RuntimeError (Tensor.item() on meta).
    path = save_bundle(random_bundle(), tmp_path / "b")
    with pytest.raises(InputError, match="cannot put the plan tables on device 'meta'"):
        load_bundle(path, device="meta")
    with pytest.raises(InputError, match="cannot put the plan tables on device"):
        load_bundle(path).to(torch.device("meta"))


def test_load_bundle_refuses_a_path_that_is_not_a_path(tmp_path):
    # None was Python's TypeError "expected str, bytes or os.PathLike object, not NoneType"
    with pytest.raises(InputError, match="bundle None: not a path"):
        load_bundle(None)
    for bad in (3, b"/tmp"):
        with pytest.raises(InputError, match=f"bundle {bad!r}: not a path"):
            load_bundle(bad)
    with pytest.raises(InputError, match="no such directory"):  # as other bad paths
        load_bundle(tmp_path / "missing")


def test_confidences_rank_at_their_own_precision():
    # float64 (numpy's default) or wide integer confidences closer than float32 resolves
    # were ties, broken by position instead of by confidence
    dev = np.array([0, 0])
    for conf in (np.array([0.5, 0.5 + 1e-9]), np.array([2**40, 2**40 + 1], np.int64)):
        assert assign_with_capacity(dev, conf, capacity=1, num_devices=2).tolist() == [1, 0]
    device, _ = online_choice(np.array([0]), np.array([0.9]), np.array([1]), np.array([0.9 + 1e-9]))
    assert device.tolist() == [1]


def test_loose_capacity_moves_only_the_overflow():
    """The overflow's free slots were listed for every device up to the capacity: all of
    65536 tokens on device 0 of 1024 with capacity 65535 took 34 s and 5.6 GB to move one.
    Now each device offers a row at most its overflow; the result is the reference's."""
    dev = np.zeros(3000, dtype=np.int64)
    conf = np.linspace(1.0, 0.0, 3000)
    out = assign_with_capacity(dev, conf, 2998, 4000)
    assert out[:2998].tolist() == [0] * 2998 and out[2998:].tolist() == [1, 2]
    rng = np.random.default_rng(0)
    for _ in range(50):  # every capacity, few and many devices: the reference loop agrees
        e = int(rng.integers(1, 9))
        t = int(rng.integers(1, 40))
        c = int(rng.integers(-(-t // e), t + 2))
        d, w = rng.integers(0, e, t).tolist(), rng.integers(0, 4, t).astype(float).tolist()
        assert assign_with_capacity(np.array(d), np.array(w), c, e).tolist() == reference_capacity(
            d, w, c, e
        )


def test_online_choice_checks_its_inputs():
    """Float ids were truncated, out-of-range ids passed through and a NaN confidence was
    chosen; online_choice is public and evaluate calls it."""
    ones = np.ones(2)
    with pytest.raises(InputError, match="token_device ids must be integers"):
        online_choice(np.array([1.7, 0.2]), ones, np.array([0, 0]), ones)
    with pytest.raises(InputError, match="device id -5 is negative"):
        online_choice(np.array([0, 1]), ones, np.array([1, -5]), ones)
    # a uint64 id past int64 was called negative
    huge = torch.tensor([2**63 + 1], dtype=torch.uint64)
    with pytest.raises(InputError, match=f"device id {2**63 + 1} is past int64"):
        online_choice(huge, torch.ones(1), torch.tensor([0]), torch.ones(1))
    with pytest.raises(InputError, match="ngram_confidence holds 1 NaN"):
        online_choice(np.array([0, 1]), ones, np.array([1, 0]), np.array([np.nan, 0.5]))
    dev, conf = online_choice(np.array([0, 1]), ones * 0.5, np.array([1, -1]), np.array([0.9, 0.9]))
    assert dev.tolist() == [1, 1] and conf.tolist() == pytest.approx([0.9, 0.5])


def test_an_ngram_entry_of_confidence_zero_predicts_nothing():
    """Even against a (never validated) negative token confidence, as the docstring says."""
    device, conf, second, _ = online_candidates([0], [-0.5], [1], [0.0])
    assert device.tolist() == [0] and second.tolist() == [-1]

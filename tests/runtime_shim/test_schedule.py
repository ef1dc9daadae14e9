"""Attention-DP request scheduling (Sem-MoE Algorithm 2) on cases with known answers."""

from __future__ import annotations

import numpy as np
import pytest

from planner.errors import InputError, MismatchError
from planner.runtime_shim.schedule import (
    evaluate_schedule,
    request_device_scores,
    round_robin,
    schedule_by_scores,
    schedule_requests,
)
from planner.trace import TraceBatch, TraceMeta, write_trace
from tests.runtime_shim.conftest import make_tables

V = 10


def split_tables(ep_size: int = 2, num_layers: int = 1, confidence: float = 1.0):
    """Tokens 0-4 -> device 0, tokens 5-9 -> device 1 (every layer); experts 0-3 on device
    0 and 4-7 on device 1 (identity permutation, N = 8)."""
    t2d = np.tile((np.arange(V) >= 5).astype(np.int64), (num_layers, 1))
    conf = np.full((num_layers, V), confidence)
    perm = np.tile(np.arange(8), (num_layers, 1))
    return make_tables(perm, ep_size, token_to_device=t2d, token_confidence=conf)


def test_requests_go_to_their_device_and_rounds_cover_every_rank():
    tables = split_tables()
    requests = [[0, 1, 2], [5, 6], [7, 8, 9], [3, 4]]
    scores = request_device_scores(requests, tables)
    assert scores.tolist() == [[3, 0], [0, 2], [0, 3], [2, 0]]
    assert schedule_requests(requests, tables, dp_size=2).tolist() == [0, 1, 1, 0]
    assert round_robin(4, 2).tolist() == [0, 1, 0, 1]


def test_mask_forces_balance_when_every_request_prefers_one_device():
    # All prefer device 0: each round of 2 still uses both ranks.
    requests = [[0, 1], [2], [0, 3, 4], [1]]
    assert schedule_requests(requests, split_tables(), 2).tolist() == [0, 1, 0, 1]


def test_mask_resets_only_after_all_devices_are_used():
    scores = np.array(
        [
            [5, 1, 0],  # -> 0
            [5, 1, 0],  # 0 masked -> 1
            [9, 0, 0],  # 0, 1 masked -> 2, then reset
            [0, 0, 7],  # -> 2
            [0, 3, 1],  # -> 1
            [0, 9, 0],  # 1, 2 masked -> 0
        ]
    )
    assert schedule_by_scores(scores).tolist() == [0, 1, 2, 2, 1, 0]
    # Ties go to the lowest free device id.
    assert schedule_by_scores(np.zeros((4, 3))).tolist() == [0, 1, 2, 0]


def test_weighting_by_confidence_or_count_and_unknown_tokens():
    t2d = np.array([[0, 0, 1]])
    conf = np.array([[0.5, 0.25, 0.9]])
    tables = make_tables(np.arange(4)[None], 2, token_to_device=t2d, token_confidence=conf)
    req = [np.array([0, 1, 2, -1, 2])]
    np.testing.assert_allclose(request_device_scores(req, tables), [[0.75, 1.8]], rtol=1e-3)
    assert request_device_scores(req, tables, weighting="count").tolist() == [[2, 2]]


def test_layers_are_summed_when_asked():
    tables = split_tables(num_layers=3)
    assert request_device_scores([[0, 9]], tables, layer=None).tolist() == [[3, 3]]
    assert request_device_scores([[0, 9]], tables, layer=[0, 2]).tolist() == [[2, 2]]


def test_report_on_token_sequences():
    tables = split_tables()
    requests = [[0, 1, 2], [5, 6], [7, 8, 9], [3, 4]]
    rep = evaluate_schedule(requests, tables, dp_size=2)
    assert rep.affinity == 1.0
    assert rep.affinity_round_robin == 0.5  # 3 + 2 of 10 scored tokens land on their device
    assert rep.lar is None and rep.lar_round_robin is None
    assert rep.token_imbalance == 1.0  # 5 and 5 tokens
    assert rep.token_imbalance_round_robin == pytest.approx(6 / 5)  # 6 and 4 tokens
    assert rep.to_dict()["num_tokens"] == 10


def test_report_on_a_trace_measures_realised_lar(tmp_path):
    # 4 requests; each token is routed (top-2, 1 layer) to experts of "its" device:
    # low tokens to experts {0, 1} (device 0), high tokens to {4, 5} (device 1), except
    # the last token of request 2, routed to {0, 4} (one expert local on either device).
    meta = TraceMeta(
        model="test/sched", num_layers=1, num_experts=8, top_k=2, vocab_size=V,
        moe_layer_indices=(0,), source="tests",
    )  # fmt: skip
    requests = [[0, 1, 2], [5, 6], [7, 8, 9], [3, 4]]
    rid, pos, tok, experts = [], [], [], []
    for r, seq in enumerate(requests):
        for p, t in enumerate(seq):
            rid.append(r * 10 + 7)  # arbitrary ids: order of first appearance matters
            pos.append(p)
            tok.append(t)
            experts.append([[0, 1]] if t < 5 else [[4, 5]])
    experts[7] = [[0, 4]]
    # Interleave requests 0 and 1 to check per-request accumulation.
    order = [0, 3, 1, 4, 2, 5, 6, 7, 8, 9]
    batch = TraceBatch.from_arrays(
        np.array(rid)[order], np.array(pos)[order], np.array(tok)[order],
        np.array(experts)[order], np.full((10, 1, 2), 0.5),
    )  # fmt: skip
    path = write_trace(tmp_path / "t.parquet", meta, batch)
    rep = evaluate_schedule(path, split_tables(), dp_size=2, batch_rows=3)
    assert rep.num_requests == 4 and rep.num_tokens == 10
    assert rep.affinity == 1.0 and rep.affinity_round_robin == 0.5
    # Scheduled [0, 1, 1, 0]: all 20 activations local but one -> 19/20.
    assert rep.lar == pytest.approx(19 / 20)
    # Round-robin [0, 1, 0, 1]: requests 0, 1 local (10), request 2 on device 0 gets 1 of
    # 6, request 3 on device 1 gets 0 of 4 -> 11/20.
    assert rep.lar_round_robin == pytest.approx(11 / 20)
    # Tables planned for another model (here: another top-k) are refused, though L and N fit.
    import dataclasses

    other = dataclasses.replace(meta, top_k=3).fingerprint()
    tables = dataclasses.replace(split_tables(), manifest={"fingerprint": other})
    with pytest.raises(MismatchError, match="planned for another model"):
        evaluate_schedule(path, tables, dp_size=2, batch_rows=3)
    # The same model's tables from other model layers (the fingerprint leaves them out).
    manifest = {"fingerprint": meta.fingerprint(), "moe_layer_indices": [3]}
    tables = dataclasses.replace(split_tables(), manifest=manifest)
    with pytest.raises(MismatchError, match="MoE layer 0 is model layer 3 in the tables and 0"):
        evaluate_schedule(path, tables, dp_size=2, batch_rows=3)
    manifest["moe_layer_indices"] = [0]
    assert evaluate_schedule(path, tables, dp_size=2, batch_rows=3).lar == pytest.approx(0.95)


def test_errors():
    tables = split_tables()
    with pytest.raises(MismatchError, match="dp_size=3"):
        schedule_requests([[0]], tables, dp_size=3)
    with pytest.raises(InputError, match="tables must be PlanTables .load_bundle., got str"):
        schedule_requests([[0]], "runs/example/bundle", dp_size=2)
    with pytest.raises(InputError, match="tables must be PlanTables .load_bundle., got NoneType"):
        request_device_scores([[1]], None)  # was an AttributeError
    # a Bundle (load_bundle_arrays) has ep_size, not the rest: an AttributeError a step later
    from types import SimpleNamespace

    bundle_like = SimpleNamespace(ep_size=2, token_to_device=tables.token_to_device)
    with pytest.raises(InputError, match="tables must be PlanTables .load_bundle., got Simple"):
        schedule_requests([[0]], bundle_like, dp_size=2)
    with pytest.raises(InputError, match="layer=5"):
        schedule_requests([[0]], tables, dp_size=2, layer=5)
    with pytest.raises(InputError, match="token id 10 outside"):
        schedule_requests([[10]], tables, dp_size=2)
    with pytest.raises(InputError, match="weighting"):
        request_device_scores([[0]], tables, weighting="tf-idf")
    with pytest.raises(InputError, match="token ids must be integers, got dtype float64"):
        schedule_requests([np.array([1.7, 2.2])], tables, dp_size=2)
    with pytest.raises(InputError, match="layer=True"):
        schedule_requests([[0]], tables, dp_size=2, layer=True)
    with pytest.raises(InputError, match="batch_rows must be a positive integer"):
        evaluate_schedule([[0]], tables, dp_size=2, batch_rows=0)
    assert schedule_requests([], tables, dp_size=2).shape == (0,)


def test_dp_size_may_be_a_numpy_integer():
    # e.g. read from a config array; it was refused as "must be a positive integer"
    tables = split_tables()
    requests = [[0, 1, 2], [5, 6]]
    assert schedule_requests(requests, tables, dp_size=np.int64(2)).tolist() == [0, 1]
    rep = evaluate_schedule(requests, tables, dp_size=np.int32(2))
    assert rep.dp_size == 2 and type(rep.dp_size) is int  # to_dict() is written as JSON
    for bad in (True, 2.0, np.float64(2), "2"):
        with pytest.raises(InputError, match="dp_size must be a positive integer"):
            schedule_requests(requests, tables, dp_size=bad)


def test_each_request_must_be_one_sequence_of_token_ids():
    tables = split_tables()
    # One request's ids passed without the outer list were three one-token requests.
    with pytest.raises(InputError, match=r"requests\[0\] must be a 1-D sequence of token ids"):
        schedule_requests([0, 1, 2], tables, dp_size=2)
    with pytest.raises(InputError, match=r"requests\[1\] must be a 1-D sequence.*\(2, 2\)"):
        schedule_requests([[0], [[5, 6], [7, 8]]], tables, dp_size=2)
    with pytest.raises(InputError, match=r"requests\[0\] must be a 1-D sequence.*ragged"):
        schedule_requests([[[0, 1], [2]]], tables, dp_size=2)  # numpy's ValueError before
    with pytest.raises(InputError, match=r"source\[0\] must be a 1-D sequence"):
        evaluate_schedule([3, 4], tables, dp_size=2)  # its argument is source
    # Iterating a [R, S] array or tensor gives R one-dimensional requests: fine.
    assert schedule_requests(np.array([[0, 1], [5, 6]]), tables, dp_size=2).tolist() == [0, 1]
    assert schedule_requests([[], [5]], tables, dp_size=2).tolist() == [0, 1]


def test_meta_request_is_refused():
    import torch

    with pytest.raises(InputError, match="a request is on the meta device"):
        schedule_requests([torch.zeros(2, dtype=torch.long, device="meta")], split_tables(), 2)


def test_layer_that_cannot_be_iterated_is_an_input_error():
    import torch

    tables = split_tables()
    # 0-d arrays and tensors were TypeErrors "iteration over a 0-d array / tensor"; an
    # integer one is the layer it holds, a float one is refused
    for layer in (np.array(0), torch.tensor(0)):
        assert schedule_requests([[0]], tables, dp_size=2, layer=layer).tolist() == [0]
    for layer in (np.array(0.0), torch.tensor(0.0)):
        with pytest.raises(InputError, match="must be MoE layer.s. in"):
            schedule_requests([[0]], tables, dp_size=2, layer=layer)


def test_requests_must_be_iterable():
    # TypeError "'NoneType' object is not iterable" (naming no argument) before
    for requests in (None, 5):
        with pytest.raises(InputError, match="requests must be an iterable of token-id seq"):
            schedule_requests(requests, split_tables(), dp_size=2)


def test_evaluate_schedule_names_its_source_argument():
    # 'requests must be an iterable ...' before: evaluate_schedule has no such argument
    for source in (None, 5):
        with pytest.raises(InputError, match=r"^source must be a trace \(a path or an opened Tr"):
            evaluate_schedule(source, split_tables(), dp_size=2)


def test_a_layer_named_twice_is_refused():
    # [0, 0, 1] summed layer 0's table twice (and reported layers=(0, 0, 1)): the schedule
    # weighted one layer double without saying so
    tables = split_tables(num_layers=2)
    for call in (
        lambda layer: evaluate_schedule([[0, 1], [5]], tables, dp_size=2, layer=layer),
        lambda layer: schedule_requests([[0, 1], [5]], tables, dp_size=2, layer=layer),
        lambda layer: request_device_scores([[0, 1], [5]], tables, layer=layer),
    ):
        for layer in ([0, 0, 1], (1, np.int64(1)), np.array([1, 1])):
            with pytest.raises(InputError, match=r"names MoE layer [01] twice; pass each layer"):
                call(layer)
    assert evaluate_schedule([[0, 1], [5]], tables, dp_size=2, layer=[1, 0]).layers == (1, 0)


def test_uint64_token_ids_are_reported_with_their_true_value():
    # The cast to int64 wrapped them: 2**63 + 5 was reported as -9223372036854775803, and
    # 2**64 - 1 became -1, the unknown token, and was scheduled without a word
    tables = split_tables()
    for ids in ([2**63 + 5], [3, 2**63 + 5], [2**64 - 1]):
        bad = max(ids)
        with pytest.raises(InputError, match=rf"^token id {bad} outside \[-1, 10\)"):
            schedule_requests([np.array(ids, np.uint64)], tables, dp_size=2)
        with pytest.raises(InputError, match=rf"^token id {bad} outside"):
            evaluate_schedule([np.array(ids, np.uint64)], tables, dp_size=2)
    assert schedule_requests([np.array([7], np.uint64)], tables, dp_size=2).tolist() == [1]


def test_meta_tables_are_named_in_the_error():
    import dataclasses

    tables = split_tables()
    # refused as the tables are built (it was 'a request is on the meta device' in the schedule)
    with pytest.raises(InputError, match="PlanTables.token_to_device is on the meta device"):
        dataclasses.replace(tables, token_to_device=tables.token_to_device.to("meta"))


def test_layers_may_be_a_tensor_or_array():
    """A 1-D tensor of layers was refused while the same numpy array was accepted."""
    import torch

    tables = split_tables(num_layers=3)
    for layer in (torch.tensor([0, 2]), np.array([0, 2]), torch.tensor(1)):
        want = [[2, 2]] if getattr(layer, "ndim", 0) else [[1, 1]]
        assert request_device_scores([[0, 9]], tables, layer=layer).tolist() == want
    with pytest.raises(InputError, match="must be MoE layer"):
        request_device_scores([[0]], tables, layer=torch.tensor([0.5]))


def test_scores_must_be_a_real_matrix():
    """Ragged scores were a raw ValueError; complex ones silently lost their imaginary part."""
    with pytest.raises(InputError, match="rows are ragged"):
        schedule_by_scores([[1, 2], [3]])
    with pytest.raises(InputError, match="must hold real numbers, got dtype complex128"):
        schedule_by_scores(np.array([[1 + 1j, 2]]))

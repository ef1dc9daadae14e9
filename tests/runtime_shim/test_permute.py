"""apply_expert_placement on tiny random models of all 8 supported architectures."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn

from planner.errors import InputError, MismatchError, ModelError
from planner.export.bundle import Bundle, save_bundle
from planner.profile.routers import ADAPTERS
from planner.runtime_shim import PlanTables, load_bundle
from planner.runtime_shim.permute import (
    EXPERT_TENSORS,
    _reorder_module_list,
    apply_expert_placement,
    check_group_preserving,
    find_moe_layers,
    permute_expert_axis,
    physical_to_logical,
)
from planner.trace.schema import TraceMeta
from tests.profile.tiny_models import ARCH_CONFIGS, build_model
from tests.runtime_shim.conftest import make_tables

EP_SIZE = 4
N_EXPERTS = 8


def group_preserving_perm(rng: np.random.Generator, n: int, n_group: int) -> np.ndarray:
    """Shuffle the groups, then the experts inside each group."""
    size = n // n_group
    groups = rng.permutation(n_group)
    return np.concatenate([g * size + rng.permutation(size) for g in groups])


def run(model: nn.Module, input_ids: torch.Tensor):
    """Logits [B, S, V] and, per MoE layer, (router logits [T, N], ids [T, k], weights [T, k])."""
    _, handles = find_moe_layers(model)
    seen: list = []
    hooks = [
        # Every supported router returns (router_logits, weights, ids).
        h.router.register_forward_hook(
            lambda m, a, out: seen.append((out[0].detach(), out[2], out[1].detach()))
        )
        for h in handles
    ]
    try:
        with torch.no_grad():
            logits = model(input_ids=input_ids).logits
    finally:
        for hook in hooks:
            hook.remove()
    assert len(seen) == len(handles)
    return logits, seen


def test_registry_covers_every_profiled_architecture():
    assert set(EXPERT_TENSORS) == set(ADAPTERS) == set(ARCH_CONFIGS)


@pytest.mark.parametrize("model_type", sorted(ARCH_CONFIGS))
def test_permuted_model_computes_the_same_function(model_type):
    model = build_model(model_type, ARCH_CONFIGS[model_type])
    rng = np.random.default_rng(1)
    input_ids = torch.from_numpy(rng.integers(3, 72, (2, 11)))
    before_logits, before = run(model, input_ids)

    _, handles = find_moe_layers(model)
    groups = EXPERT_TENSORS[model_type].routing_groups(model.config)
    n_group = groups[0] if groups else 1
    perm = np.stack([group_preserving_perm(rng, N_EXPERTS, n_group) for _ in handles])
    assert (perm != np.arange(N_EXPERTS)).any(axis=1).all()
    tables = make_tables(perm, EP_SIZE)
    assert apply_expert_placement(model, tables) is model

    after_logits, after = run(model, input_ids)
    torch.testing.assert_close(after_logits, before_logits, atol=1e-5, rtol=0)
    changed = False
    for layer, ((lb, ib, wb), (la, ia, wa)) in enumerate(zip(before, after, strict=True)):
        p = torch.from_numpy(perm[layer])
        # Router column s now scores logical expert perm[s].
        torch.testing.assert_close(la.float(), lb.float()[:, p], atol=1e-5, rtol=1e-6)
        # Routed physical ids map back to the same logical experts with the same weights.
        logical = p[ia]
        ob, oa = ib.argsort(-1), logical.argsort(-1)
        assert torch.equal(ib.gather(-1, ob), logical.gather(-1, oa)), f"layer {layer}"
        torch.testing.assert_close(wa.gather(-1, oa), wb.gather(-1, ob), atol=1e-5, rtol=1e-6)
        changed |= not torch.equal(ia, ib)
    assert changed, "the permutation did not change any routed id: the test checks nothing"
    assert torch.equal(model.moeplan_expert_permutation, torch.from_numpy(perm))


def test_physical_to_logical_matches_the_table():
    perm = np.array([[2, 0, 1], [1, 2, 0]])
    ids = torch.tensor([[[0, 2], [1, 0]]])  # [T=1, L=2, k=2]
    assert physical_to_logical(ids, torch.from_numpy(perm)).tolist() == [[[2, 1], [2, 1]]]


def test_physical_to_logical_refuses_ids_that_are_not_slots():
    perm = torch.tensor([[2, 0, 1], [1, 2, 0]])
    # -1 wrapped to the last slot, 1.5 was truncated to slot 1, 3 an IndexError from torch
    for bad, match in (
        (-1, r"expert id -1 outside \[0, 3\)"),
        (3, r"expert id 3 outside \[0, 3\)"),
    ):
        with pytest.raises(InputError, match=match):
            physical_to_logical(torch.full((1, 2, 2), bad), perm)
    for ids in (torch.full((1, 2, 2), 1.5), torch.ones((1, 2, 2), dtype=torch.bool)):
        with pytest.raises(InputError, match="expert_ids must hold integers"):
            physical_to_logical(ids, perm)
    with pytest.raises(InputError, match="expert_permutation must be an integer"):
        physical_to_logical(torch.zeros((1, 2, 2), dtype=torch.long), perm.float())
    with pytest.raises(InputError, match="expert_ids is on the meta device"):
        physical_to_logical(torch.zeros((1, 2, 2), dtype=torch.long, device="meta"), perm)
    # not numbers: raw torch errors (RuntimeError, TypeError, ValueError)
    for ids in (None, "abc", [[[0]], [[0, 1]]]):
        with pytest.raises(InputError, match="expert_ids must be a tensor or array of numbers"):
            physical_to_logical(ids, perm)
    with pytest.raises(InputError, match="expert_permutation must be a tensor or array"):
        physical_to_logical(torch.zeros((1, 2, 2), dtype=torch.long), None)
    # a table that names no expert gave its values back as expert ids
    for table, bad in ((torch.full((2, 3), -3), -3), (torch.full((2, 3), 99), 99)):
        with pytest.raises(InputError, match=rf"expert_permutation holds expert {bad}, outside"):
            physical_to_logical(torch.zeros((1, 2, 2), dtype=torch.long), table)
    ragged = SimpleNamespace(expert_permutation=[[0, 1], [2]])
    with pytest.raises(InputError, match="tables.expert_permutation must be a tensor or array"):
        apply_expert_placement(nn.Linear(2, 2), ragged)
    empty = physical_to_logical(torch.zeros((0, 2, 2), dtype=torch.int32), perm)
    meta = SimpleNamespace(expert_permutation=torch.zeros((2, 3), dtype=torch.long, device="meta"))
    with pytest.raises(InputError, match="tables.expert_permutation is on the meta device"):
        apply_expert_placement(nn.Linear(2, 2), meta)
    assert empty.shape == (0, 2, 2) and empty.dtype == torch.int64


def deepseek(model_type: str, **overrides):
    return build_model(model_type, ARCH_CONFIGS[model_type] | overrides)


# Group-limited settings that constrain the choice (n_group=4 groups of 2 experts, top-2):
# V2 ranks groups by their best expert, so only topk_group < k constrains it.
CONSTRAINED = {"deepseek_v2": dict(topk_group=1), "deepseek_v3": dict()}


@pytest.mark.parametrize("model_type", ["deepseek_v2", "deepseek_v3"])
def test_permutation_across_routing_groups_is_refused(model_type):
    model = deepseek(model_type, **CONSTRAINED[model_type])
    weight = model.base_model.layers[1].mlp.gate.weight.clone()
    perm = np.tile(np.arange(N_EXPERTS), (2, 1))
    perm[1, [1, 2]] = perm[1, [2, 1]]  # experts 1 and 2 sit in different groups
    with pytest.raises(InputError, match="physical group 0 .* groups \\[0, 1\\]"):
        apply_expert_placement(model, make_tables(perm, EP_SIZE))
    # Nothing was changed by the refused call.
    assert torch.equal(model.base_model.layers[1].mlp.gate.weight, weight)
    assert getattr(model, "moeplan_expert_permutation", None) is None


@pytest.mark.parametrize("model_type", ["deepseek_v2", "deepseek_v3"])
def test_cross_group_permutation_would_change_the_output(model_type):
    """Why the check exists: forcing a cross-group move changes what the model computes."""
    model = deepseek(model_type, **CONSTRAINED[model_type])
    input_ids = torch.arange(3, 43).reshape(2, 20)
    before, _ = run(model, input_ids)
    _, handles = find_moe_layers(model)
    spec = EXPERT_TENSORS[model_type]
    perm = torch.tensor([0, 2, 1, 3, 4, 6, 5, 7])
    for h in handles:
        router = [t for n, t in list(h.router.named_parameters()) + list(h.router.named_buffers())]
        permute_expert_axis(router + [getattr(h.experts, n) for n in spec.experts], perm)
    after, _ = run(model, input_ids)
    assert not torch.allclose(after, before, atol=1e-5)


def test_any_permutation_when_grouping_does_not_constrain():
    # All groups eligible (topk_group == n_group), plain greedy top-k, or V2 with
    # topk_group >= k: grouping cannot change the choice, so any permutation is accepted.
    for model_type, overrides in [
        ("deepseek_v3", dict(topk_group=4)),
        ("deepseek_v2", dict(topk_method="greedy", topk_group=1)),
        ("deepseek_v2", dict(topk_group=2)),
    ]:
        model = deepseek(model_type, **overrides)
        input_ids = torch.arange(3, 25).reshape(2, 11)
        before, before_layers = run(model, input_ids)
        perm = np.stack([np.random.default_rng(s).permutation(N_EXPERTS) for s in (0, 1)])
        apply_expert_placement(model, make_tables(perm, EP_SIZE))
        after, after_layers = run(model, input_ids)
        torch.testing.assert_close(after, before, atol=1e-5, rtol=0)
        # the experts did move (a placement skipped here kept the logits too)
        assert torch.equal(model.moeplan_expert_permutation, torch.from_numpy(perm))
        for layer, ((lb, _, _), (la, _, _)) in enumerate(
            zip(before_layers, after_layers, strict=True)
        ):
            p = torch.from_numpy(perm[layer])
            torch.testing.assert_close(la.float(), lb.float()[:, p], atol=1e-5, rtol=1e-6)


def test_check_group_preserving_accepts_group_moves():
    check_group_preserving(np.array([[6, 7, 1, 0, 2, 3, 5, 4]]), n_group=4)
    with pytest.raises(InputError, match="not divisible"):
        check_group_preserving(np.array([[0, 1, 2]]), n_group=2)
    # a ZeroDivisionError and a ValueError from unpacking the shape, before
    for perm, groups, message in (
        ([[0, 1]], 0, "n_group=0 must be a positive integer"),
        ([0, 1], 2, r"integer \[L, N\] array, got int64 \[2\]"),
        ([[0.5, 1]], 2, "integer"),
    ):
        with pytest.raises(InputError, match=message):
            check_group_preserving(np.array(perm), n_group=groups)


@pytest.fixture(scope="module")
def qwen3():
    # decoder_sparse_step=2 over 4 layers: MoE layers are model layers 1 and 3.
    return build_model("qwen3_moe", ARCH_CONFIGS["qwen3_moe"])


def fresh_qwen3():
    return build_model("qwen3_moe", ARCH_CONFIGS["qwen3_moe"])


def test_moe_layers_inferred_given_or_from_the_manifest():
    perm = np.stack([np.roll(np.arange(N_EXPERTS), 1), np.arange(N_EXPERTS)])
    # Given explicitly: the first table row goes to model layer 3.
    model = fresh_qwen3()
    w3 = model.base_model.layers[3].mlp.gate.weight.clone()
    apply_expert_placement(model, make_tables(perm, EP_SIZE), moe_layer_indices=[3, 1])
    assert torch.equal(model.base_model.layers[3].mlp.gate.weight, w3[torch.from_numpy(perm[0])])
    # From the manifest.
    model = fresh_qwen3()
    w3 = model.base_model.layers[3].mlp.gate.weight.clone()
    manifest = {"moe_layer_indices": [3, 1]}
    apply_expert_placement(model, make_tables(perm, EP_SIZE, manifest=manifest))
    assert torch.equal(model.base_model.layers[3].mlp.gate.weight, w3[torch.from_numpy(perm[0])])
    with pytest.raises(InputError, match="list of integers"):
        apply_expert_placement(fresh_qwen3(), make_tables(perm, EP_SIZE), ["3", "1"])


def saved_bundle_tables(tmp_path, perm: np.ndarray, moe_layer_indices) -> PlanTables:
    """load_bundle of a bundle saved to disk, its manifest exactly as export writes it."""
    big_l, n = perm.shape
    meta = TraceMeta(
        model="qwen3-tiny", num_layers=big_l, num_experts=n, top_k=2, vocab_size=72,
        moe_layer_indices=moe_layer_indices,
    )  # fmt: skip
    expert_to_device = np.empty_like(perm)
    for layer in range(big_l):
        expert_to_device[layer, perm[layer]] = np.arange(n) // (n // EP_SIZE)
    bundle = Bundle.from_arrays(
        meta, ep_size=EP_SIZE, expert_to_device=expert_to_device,
        token_to_device=np.zeros((big_l, 72), int), token_confidence=np.zeros((big_l, 72)),
        ngram_to_device=np.zeros((big_l, EP_SIZE), int),
        ngram_confidence=np.zeros((big_l, EP_SIZE)), ngram_order=1,
    )  # fmt: skip
    path = tmp_path / f"bundle-{'-'.join(map(str, moe_layer_indices))}"
    save_bundle(bundle, path)
    return load_bundle(path)


def test_a_saved_bundles_moe_layer_indices_are_used(tmp_path):
    # A real bundle keeps moe_layer_indices at the top of manifest.json: its rows go to those
    # model layers, and a bundle planned for other layers is refused.
    perm = np.stack([np.roll(np.arange(N_EXPERTS), 1), np.arange(N_EXPERTS)])
    tables = saved_bundle_tables(tmp_path, perm, (1, 3))
    assert (
        tables.manifest["moe_layer_indices"] == [1, 3]
        and "moe_layer_indices" not in (tables.manifest["model"])
    )
    model = fresh_qwen3()
    w1 = model.base_model.layers[1].mlp.gate.weight.clone()
    apply_expert_placement(model, tables)
    expected = w1[tables.expert_permutation[0].long()]
    assert torch.equal(model.base_model.layers[1].mlp.gate.weight, expected)
    with pytest.raises(InputError, match="not MoE layers: \\[2\\]"):
        apply_expert_placement(fresh_qwen3(), saved_bundle_tables(tmp_path, perm, (1, 2)))


def test_errors():
    ident = np.tile(np.arange(N_EXPERTS), (2, 1))
    with pytest.raises(MismatchError, match="3 MoE layers"):
        apply_expert_placement(fresh_qwen3(), make_tables(np.tile(np.arange(8), (3, 1)), 4))
    with pytest.raises(MismatchError, match="4 experts per layer"):
        apply_expert_placement(fresh_qwen3(), make_tables(np.tile(np.arange(4), (2, 1)), 2))
    with pytest.raises(InputError, match="not MoE layers: \\[0\\]"):
        apply_expert_placement(fresh_qwen3(), make_tables(ident, 4), moe_layer_indices=[0, 1])
    bad = ident.copy()
    bad[1, 0] = 1
    with pytest.raises(InputError, match="row 1 is not a permutation"):
        apply_expert_placement(fresh_qwen3(), make_tables(bad, 4))
    with pytest.raises(InputError, match="tables must be PlanTables .load_bundle. or hold"):
        apply_expert_placement(fresh_qwen3(), None)
    with pytest.raises(InputError, match="must hold integers, got torch.float64"):
        apply_expert_placement(fresh_qwen3(), SimpleNamespace(expert_permutation=ident + 0.5))
    # L and N that happen to fit do not make it the same model: another top-k or vocabulary
    model = fresh_qwen3()
    vocab, k = model.config.vocab_size, model.config.num_experts_per_tok
    with pytest.raises(MismatchError, match=f"planned for vocab_size={vocab + 1} but"):
        apply_expert_placement(model, make_tables(ident, 4, vocab_size=vocab + 1))
    other_k = make_tables(ident, 4, vocab_size=vocab, manifest={"model": {"top_k": k + 1}})
    with pytest.raises(MismatchError, match=f"planned for top_k={k + 1} but"):
        apply_expert_placement(model, other_k)
    apply_expert_placement(model, make_tables(ident, 4))
    with pytest.raises(InputError, match="already applied"):
        apply_expert_placement(model, make_tables(ident, 4))


def test_unsupported_or_unknown_layouts_raise_model_error():
    dense = build_model("qwen3", dict(head_dim=8))
    with pytest.raises(ModelError, match="unsupported architecture 'qwen3'"):
        apply_expert_placement(dense, make_tables(np.tile(np.arange(8), (2, 1)), 4))
    model = fresh_qwen3()
    experts = model.base_model.layers[1].mlp.experts
    experts.register_buffer("scale", torch.ones(N_EXPERTS))  # a tensor the table lacks
    with pytest.raises(ModelError, match="'scale'"):
        apply_expert_placement(model, make_tables(np.tile(np.arange(8), (2, 1)), 4))


def test_module_list_experts_are_reordered():
    experts = nn.ModuleList([nn.Linear(2, 2) for _ in range(4)])
    ids = [id(m) for m in experts]
    _reorder_module_list(experts, [2, 0, 3, 1])
    assert [id(m) for m in experts] == [ids[2], ids[0], ids[3], ids[1]]


def test_moe_layer_indices_may_be_an_array_or_tensor():
    # both were refused as "moe_layer_indices must be a list of integers, got array([3, 1])"
    perm = np.stack([np.roll(np.arange(N_EXPERTS), 1), np.arange(N_EXPERTS)])
    for indices in (np.array([3, 1]), torch.tensor([3, 1])):
        model = fresh_qwen3()
        w3 = model.base_model.layers[3].mlp.gate.weight.clone()
        apply_expert_placement(model, make_tables(perm, EP_SIZE), moe_layer_indices=indices)
        want = w3[torch.from_numpy(perm[0])]
        assert torch.equal(model.base_model.layers[3].mlp.gate.weight, want)
    for bad in (np.array([3.0, 1.0]), np.array([[3, 1]]), torch.tensor([True, False])):
        with pytest.raises(InputError, match="moe_layer_indices must be a list of integers"):
            apply_expert_placement(fresh_qwen3(), make_tables(perm, EP_SIZE), bad)


def test_physical_to_logical_names_a_uint64_id_by_its_true_value():
    perm = torch.tensor([[2, 0, 1], [1, 2, 0]])
    ids = torch.full((1, 2, 2), 2**63 + 2, dtype=torch.uint64)  # was reported as -2**63 + 2
    with pytest.raises(InputError, match=rf"expert id {2**63 + 2} outside \[0, 3\)"):
        physical_to_logical(ids, perm)


def test_a_permutation_that_contradicts_the_placement_is_refused():
    """Slot 0 (device 0) holding expert 0 while expert_to_device put expert 0 on device 3
    was applied; route then predicted devices the experts were not on."""
    import dataclasses

    ident = np.tile(np.arange(N_EXPERTS), (2, 1))
    good = make_tables(ident, 4)
    e2d = good.expert_to_device.clone()
    e2d[1, [0, N_EXPERTS - 1]] = e2d[1, [N_EXPERTS - 1, 0]]  # swap experts 0 and 7 in layer 1
    bad = dataclasses.replace(good, expert_to_device=e2d)
    model = fresh_qwen3()
    with pytest.raises(InputError, match="layer 1's slot 0 .device 0. holds expert 0, which"):
        apply_expert_placement(model, bad)
    assert getattr(model, "moeplan_expert_permutation", None) is None  # left untouched
    apply_expert_placement(model, good)

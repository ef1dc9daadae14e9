"""Apply a plan's expert placement to a loaded Hugging Face MoE model, in place.

Speculative MoE App. B (s-EG: "the experts at each layer need to be rearranged according
to the scheduling table ... [and] the gating module" with them) and Sem-MoE §3.3 "Model
scheduling". A bundle's ``expert_permutation[l, s]`` names the logical expert that
physical slot ``s`` of MoE layer ``l`` holds; with the default EP sharding (slot ``s`` on
device ``s // (N/E)``) that puts every expert on the device the plan chose. Reordering a
layer's expert weights *and* its router's rows by the same permutation leaves the model's
function unchanged: the router scores slot ``s`` exactly as it scored logical expert
``perm[s]`` before, and slot ``s`` computes what that expert computed. Only the ids the
router emits change: physical id ``s`` now means logical expert ``perm[s]``
(:func:`physical_to_logical` maps them back).

Group-limited routing (DeepSeek ``n_group`` / ``topk_group``) first ranks *contiguous*
groups of experts and keeps the best ``topk_group`` groups; moving an expert into another
group changes which experts a token may reach. A permutation is accepted for such a model
only if every physical group holds exactly the experts of one logical group (groups may
be reordered and experts reordered within a group); otherwise :class:`InputError`. The
constraint is waived where grouping cannot change the choice: ``topk_group >= n_group``,
DeepSeek-V2 ``greedy``, and DeepSeek-V2 ``group_limited_greedy`` with ``topk_group >= k``
(V2 scores a group by its best expert, so the k best experts' groups always qualify).

Where to find the tensors: MoE layers and routers come from the profile stage's registry
(:mod:`planner.profile.routers`); which tensors of a layer carry a leading expert axis is
the one table :data:`EXPERT_TENSORS` below (transformers 5.x fused 3-D expert weights). A
tensor the table does not list makes the call fail rather than leave it unpermuted.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import torch
from torch import nn

from planner._checks import is_integer
from planner.errors import InputError, MismatchError, ModelError
from planner.profile.routers import ADAPTERS, find_routers
from planner.runtime_shim._data import as_tensor, holds_integers, out_of_range

EXPERTS_ATTR = "experts"  # attribute of every supported MoE block holding the experts
APPLIED_ATTR = "moeplan_expert_permutation"  # set on the model once a placement is applied


def _no_groups(config: Any) -> tuple[int, int] | None:
    return None


def _deepseek_v2_groups(config: Any) -> tuple[int, int] | None:
    if getattr(config, "topk_method", "greedy") != "group_limited_greedy":
        return None
    # V2 ranks a group by its best expert, so the groups of the k best experts are always
    # among the best k groups: with topk_group >= k the result is plain top-k.
    if (getattr(config, "topk_group", None) or 0) >= (config.num_experts_per_tok or 0):
        return None
    return _deepseek_v3_groups(config)


def _deepseek_v3_groups(config: Any) -> tuple[int, int] | None:
    n_group, topk_group = getattr(config, "n_group", None), getattr(config, "topk_group", None)
    if not n_group or n_group <= 1 or not topk_group or topk_group >= n_group:
        return None  # every group is always eligible: grouping does not constrain routing
    return int(n_group), int(topk_group)


@dataclass(frozen=True)
class ExpertTensors:
    """The tensors of one MoE layer whose leading axis is the expert axis.

    Attributes:
        experts: parameter names of the block's ``experts`` module (fused [N, ...] tensors).
        router: parameter / buffer names of the router ([N, H] weight, [N] biases); a name
            may be absent (e.g. a router without bias).
        routing_groups: config -> (n_group, topk_group) when routing is group-limited in a
            way that constrains the permutation, else None.
    """

    experts: tuple[str, ...]
    router: tuple[str, ...]
    routing_groups: Callable[[Any], tuple[int, int] | None] = _no_groups


_SWIGLU = ("gate_up_proj", "down_proj")

# model_type -> expert-indexed tensors, read off transformers 5.23's modeling_<arch>.py.
EXPERT_TENSORS: dict[str, ExpertTensors] = {
    "mixtral": ExpertTensors(_SWIGLU, ("weight",)),
    "qwen2_moe": ExpertTensors(_SWIGLU, ("weight",)),
    "qwen3_moe": ExpertTensors(_SWIGLU, ("weight",)),
    "olmoe": ExpertTensors(_SWIGLU, ("weight",)),
    "deepseek_v2": ExpertTensors(_SWIGLU, ("weight",), _deepseek_v2_groups),
    "deepseek_v3": ExpertTensors(
        _SWIGLU, ("weight", "e_score_correction_bias"), _deepseek_v3_groups
    ),
    "gpt_oss": ExpertTensors(
        ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"), ("weight", "bias")
    ),
    "phimoe": ExpertTensors(_SWIGLU, ("weight", "bias")),
}


@dataclass(frozen=True)
class MoeLayerHandles:
    """One MoE layer of a loaded model: its router and its experts module."""

    layer_index: int
    router: nn.Module
    experts: nn.Module


def find_moe_layers(model: nn.Module) -> tuple[str, list[MoeLayerHandles]]:
    """The model's architecture name and its MoE layers in model order.

    Raises:
        ModelError: unsupported architecture, or a layout this module does not know.
    """
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    adapter = ADAPTERS.get(str(model_type))
    if adapter is None or model_type not in EXPERT_TENSORS:
        raise ModelError(
            f"expert placement: unsupported architecture {model_type!r}; supported: "
            f"{', '.join(sorted(EXPERT_TENSORS))}"
        )
    where = f"expert placement ({model_type})"
    moe_layers = adapter.moe_layers(config)
    num_experts = adapter.num_experts(config)
    routers = find_routers(model, adapter, moe_layers, num_experts, where)
    handles = []
    for index, router in zip(moe_layers, routers, strict=True):
        base_model: Any = model.base_model  # a transformers model; nn.Module types it loosely
        block = base_model.layers[index].mlp
        experts = getattr(block, EXPERTS_ATTR, None)
        if experts is None:
            raise ModelError(f"{where}: layer {index}'s MoE block has no .{EXPERTS_ATTR}")
        handles.append(MoeLayerHandles(index, router, experts))
    return model_type, handles


def check_group_preserving(
    expert_permutation: np.ndarray, n_group: int, layers: Sequence[int] | None = None
) -> None:
    """Raise :class:`InputError` unless every physical group holds one logical group.

    Args:
        expert_permutation: [L, N] slot -> logical expert.
        n_group: number of contiguous expert groups of the router (N divisible by it).
        layers: model layer index of each row, for the message.
    """
    perm = np.asarray(expert_permutation)
    if perm.ndim != 2 or perm.dtype.kind not in "iu":
        raise InputError(
            f"expert_permutation must be an integer [L, N] array, got {perm.dtype} "
            f"{list(perm.shape)}"
        )
    perm = perm.astype(np.int64)
    if not is_integer(n_group) or n_group < 1:
        raise InputError(f"n_group={n_group!r} must be a positive integer")
    big_l, n = perm.shape
    if n % n_group:
        raise InputError(f"num_experts={n} is not divisible by n_group={n_group}")
    size = n // n_group
    groups = (perm // size).reshape(big_l, n_group, size)  # logical group of each slot
    bad = (groups != groups[:, :, :1]).any(axis=2)  # [L, n_group]
    if bad.any():
        row, g = (int(v) for v in np.argwhere(bad)[0])
        where = f"MoE layer {row}" + ("" if layers is None else f" (model layer {layers[row]})")
        slots = list(range(g * size, (g + 1) * size))
        raise InputError(
            f"{where}: physical group {g} (slots {slots[0]}..{slots[-1]}) would hold logical "
            f"experts {perm[row, slots].tolist()} from groups "
            f"{sorted(set(groups[row, g].tolist()))}; this model routes within {n_group} "
            f"groups of {size} experts, so a placement may only move whole groups and "
            "reorder experts inside a group. Re-solve with the groups kept intact."
        )


def _check_permutation_rows(perm: np.ndarray) -> None:
    n = perm.shape[1]
    want = np.arange(n)
    for row in range(perm.shape[0]):
        if not np.array_equal(np.sort(perm[row]), want):
            raise InputError(
                f"expert_permutation row {row} is not a permutation of 0..{n - 1}: "
                f"{perm[row].tolist()}"
            )


def _expert_axis_tensors(
    module: nn.Module, allowed: tuple[str, ...], num_experts: int, what: str
) -> list[torch.Tensor]:
    """Every parameter and buffer of ``module``, checked to be listed and [N, ...]."""
    found = list(module.named_parameters()) + list(module.named_buffers())
    tensors = []
    for name, tensor in found:
        if name not in allowed:
            raise ModelError(
                f"{what} has a tensor {name!r} that moeplan does not know how to permute "
                f"(known: {list(allowed)}); this transformers version differs from 5.x"
            )
        if tensor.ndim == 0 or tensor.shape[0] != num_experts:
            raise ModelError(
                f"{what}.{name} has shape {tuple(tensor.shape)}, expected a leading axis of "
                f"{num_experts} experts"
            )
        if tensor.device.type == "meta":
            raise ModelError(f"{what}.{name} is on the meta device; load the weights first")
        tensors.append(tensor)
    return tensors


@torch.no_grad()
def permute_expert_axis(tensors: Sequence[torch.Tensor], slot_to_expert: torch.Tensor) -> None:
    """In place: ``t[s] = t_old[slot_to_expert[s]]`` for every tensor (leading axis N).

    Storage and Parameter identity are kept (optimizers, tied views stay valid); the
    temporary is one tensor's size.
    """
    for t in tensors:
        t.copy_(t.index_select(0, slot_to_expert.to(t.device)))


def _reorder_module_list(experts: nn.ModuleList, slot_to_expert: list[int]) -> None:
    old = list(experts)
    for slot, expert in enumerate(slot_to_expert):
        experts[slot] = old[expert]


def _check_model_shape(tables: Any, config: Any, top_k: int) -> None:
    """MismatchError when the tables were planned for another top-k or vocabulary than the
    model's (an L and N that happen to fit do not make it the same model)."""
    manifest = getattr(tables, "manifest", None)
    planned = manifest.get("model") if isinstance(manifest, dict) else None
    planned = planned if isinstance(planned, dict) else {}
    vocab = getattr(tables, "vocab_size", planned.get("vocab_size"))
    model_vocab = getattr(config, "vocab_size", None)
    for what, theirs, ours in (
        ("top_k", planned.get("top_k"), top_k),
        ("vocab_size", vocab, model_vocab),
    ):
        if is_integer(theirs) and is_integer(ours) and theirs != ours:
            raise MismatchError(
                f"the tables were planned for {what}={theirs} but the model has {what}={ours}; "
                "plan on a trace of this model"
            )


def _check_matches_placement(tables: Any, perm: np.ndarray) -> None:
    """InputError unless slot s of every layer holds an expert the tables place on device
    s // (N/E), where they say (``expert_to_device`` and ``ep_size``): a hand-made table
    whose permutation contradicted its placement was applied, and ``route`` then predicted
    devices the model's experts were not on."""
    placement, ep_size = getattr(tables, "expert_to_device", None), getattr(tables, "ep_size", 0)
    if placement is None or not is_integer(ep_size) or ep_size < 1:
        return
    ep = int(ep_size)
    if perm.shape[1] % ep:
        return
    e2d = torch.as_tensor(placement).to(torch.int64).cpu().numpy()
    if e2d.shape != perm.shape:
        raise MismatchError(
            f"tables.expert_to_device is {list(e2d.shape)} but the permutation {list(perm.shape)}"
        )
    slot_device = np.arange(perm.shape[1]) // (perm.shape[1] // ep)
    wrong = np.take_along_axis(e2d, perm, axis=1) != slot_device[None, :]
    if wrong.any():
        layer, slot = (int(i) for i in np.argwhere(wrong)[0])
        raise InputError(
            f"the tables contradict themselves: layer {layer}'s slot {slot} (device "
            f"{slot_device[slot]}) holds expert {perm[layer, slot]}, which expert_to_device "
            f"puts on device {e2d[layer, perm[layer, slot]]}"
        )


def apply_expert_placement(
    model: nn.Module, tables: Any, moe_layer_indices: Sequence[int] | None = None
) -> nn.Module:
    """Reorder every MoE layer's experts and router rows so slot s holds ``perm[l, s]``.

    Args:
        model: a loaded transformers MoE causal LM (mixtral, qwen2_moe, qwen3_moe, olmoe,
            deepseek_v2, deepseek_v3, gpt_oss, phimoe), weights materialised.
        tables: a :class:`~planner.runtime_shim.tables.PlanTables` (anything with an
            ``expert_permutation`` [L, N] tensor and, optionally, a ``manifest`` dict).
        moe_layer_indices: model layer index of each of the L table rows. Default: the
            bundle manifest's ``moe_layer_indices`` when present, else every MoE
            layer of the model; either way each index must be an MoE layer of the model.

    Returns:
        The same model, modified in place; ``model.moeplan_expert_permutation`` holds the
        [L, N] permutation applied (a second call raises instead of permuting twice).

    Raises:
        ModelError: unsupported architecture or unknown layer layout.
        MismatchError: the tables' L or N do not match the model.
        InputError: a row is not a permutation, moe_layer_indices is wrong, the placement
            was already applied, or it splits a routing group (DeepSeek ``n_group``).
    """
    if getattr(model, APPLIED_ATTR, None) is not None:
        raise InputError(
            "an expert placement was already applied to this model; reload it before "
            "applying another (permutations compose, they do not replace)"
        )
    source = getattr(tables, "expert_permutation", None)
    if source is None:
        raise InputError(
            "tables must be PlanTables (load_bundle) or hold an expert_permutation [L, N]; "
            f"got {type(tables).__name__}"
        )
    perm_t = as_tensor(source, "tables.expert_permutation")
    if not holds_integers(perm_t):
        raise InputError(f"tables.expert_permutation must hold integers, got {perm_t.dtype}")
    perm_t = perm_t.to(torch.int64).cpu()
    if perm_t.ndim != 2:
        raise InputError(f"tables.expert_permutation must be [L, N], got {tuple(perm_t.shape)}")
    perm = perm_t.numpy()
    model_type, handles = find_moe_layers(model)
    by_index = {h.layer_index: h for h in handles}
    big_l, n = perm.shape

    if moe_layer_indices is None:
        manifest = getattr(tables, "manifest", None)
        # a bundle's manifest.json keeps them at its top level (next to "model")
        moe_layer_indices = (manifest if isinstance(manifest, dict) else {}).get(
            "moe_layer_indices"
        ) or sorted(by_index)
    if isinstance(moe_layer_indices, np.ndarray | torch.Tensor) and moe_layer_indices.ndim == 1:
        moe_layer_indices = moe_layer_indices.tolist()  # floats and bools are refused below
    if (
        not isinstance(moe_layer_indices, Sequence)
        or isinstance(moe_layer_indices, str)
        or not all(is_integer(i) for i in moe_layer_indices)
    ):
        raise InputError(f"moe_layer_indices must be a list of integers, got {moe_layer_indices!r}")
    layers = [int(i) for i in moe_layer_indices]
    if len(layers) != big_l:
        raise MismatchError(
            f"the tables have {big_l} MoE layers but moe_layer_indices has {len(layers)} "
            f"({layers}); the model's MoE layers are {sorted(by_index)}"
        )
    missing = [i for i in layers if i not in by_index]
    if missing or len(set(layers)) != len(layers):
        raise InputError(
            f"moe_layer_indices {layers} must be distinct MoE layers of the model "
            f"({sorted(by_index)}); not MoE layers: {missing}"
        )
    num_experts = ADAPTERS[model_type].num_experts(model.config)
    if n != num_experts:
        raise MismatchError(
            f"the tables place {n} experts per layer but the model has {num_experts}"
        )
    _check_model_shape(tables, model.config, ADAPTERS[model_type].top_k(model.config))
    _check_permutation_rows(perm)
    _check_matches_placement(tables, perm)
    spec = EXPERT_TENSORS[model_type]
    groups = spec.routing_groups(model.config)
    if groups is not None:
        check_group_preserving(perm, groups[0], layers)

    # Check every layer before changing any, so a failure leaves the model untouched.
    work = []
    for row, index in enumerate(layers):
        h = by_index[index]
        what = f"model layer {index}"
        router_tensors = _expert_axis_tensors(h.router, spec.router, n, f"{what} router")
        if isinstance(h.experts, nn.ModuleList):
            if len(h.experts) != n:
                raise ModelError(f"{what} has {len(h.experts)} experts, expected {n}")
            expert_tensors: list[torch.Tensor] | None = None
        else:
            expert_tensors = _expert_axis_tensors(h.experts, spec.experts, n, f"{what} experts")
        work.append((row, h, router_tensors, expert_tensors))
    for row, h, router_tensors, expert_tensors in work:
        slot_to_expert = perm_t[row]
        permute_expert_axis(router_tensors, slot_to_expert)
        if expert_tensors is None:
            # no expert tensors: the experts are an nn.ModuleList (checked above)
            _reorder_module_list(cast(nn.ModuleList, h.experts), slot_to_expert.tolist())
        else:
            permute_expert_axis(expert_tensors, slot_to_expert)
    setattr(model, APPLIED_ATTR, perm_t.clone())
    return model


def physical_to_logical(expert_ids: torch.Tensor, expert_permutation: torch.Tensor) -> torch.Tensor:
    """Map expert ids emitted by a permuted model back to logical ids.

    Args:
        expert_ids: [T, L, k] physical slots chosen at each of the L table layers.
        expert_permutation: [L, N] slot -> logical expert.

    Returns:
        [T, L, k] int64 logical expert ids.

    Raises:
        InputError: ids that are not integers in [0, N), or a table that is not [L, N].
    """
    perm = as_tensor(expert_permutation, "expert_permutation")
    if perm.ndim != 2 or not holds_integers(perm):
        raise InputError(
            f"expert_permutation must be an integer [L, N] tensor, got {tuple(perm.shape)} "
            f"{perm.dtype}"
        )
    bad = out_of_range(perm, 0, perm.shape[1])  # a table of -3s gave back -3 as an expert id
    if bad is not None:
        raise InputError(f"expert_permutation holds expert {bad}, outside [0, {perm.shape[1]})")
    perm = perm.to(torch.int64)
    ids = as_tensor(expert_ids, "expert_ids")
    if not holds_integers(ids):
        raise InputError(f"expert_ids must hold integers, got {ids.dtype}")
    dtype, ids = ids.dtype, ids.to(device=perm.device, dtype=torch.int64)
    if ids.ndim != 3 or ids.shape[1] != perm.shape[0]:
        raise InputError(
            f"expert_ids must be [T, L, k] with L={perm.shape[0]}, got {tuple(ids.shape)}"
        )
    n = perm.shape[1]
    bad = out_of_range(ids, 0, n, dtype)  # -1 would wrap to the last slot, n be an IndexError
    if bad is not None:
        raise InputError(f"expert id {bad} outside [0, {n}) (physical slots)")
    layer = torch.arange(perm.shape[0], device=perm.device)[None, :, None]
    return perm[layer, ids]

"""Serving-engine placement files: the expert placement of a plan in each engine's format.

A plan's expert placement (s-EG of Speculative MoE, paper 000 §B: "the experts at each
layer need to be rearranged according to the scheduling table during deployment") is
handed to an engine as a static physical-slot -> logical-expert map. Every engine below
puts physical slot s of a layer on EP rank ``s // (N / E)``, the same convention as the
bundle's ``expert_permutation``, so each file is that table re-indexed and re-spelled.
moeplan never adds redundant experts: there are N physical slots for N logical experts.

Glossary: logical expert = expert as the model defines it; physical slot = a place on a
device holding one expert's weights; model layer = index among all decoder layers (dense
ones included); MoE layer = index among MoE layers only (what bundles and traces count).

Formats (one builder each, listed in :data:`FORMATS`), read from the engines' sources:

``sglang``
    JSON ``{"physical_to_logical_map": [[...N ints...] x num_model_layers]}`` for
    ``--init-expert-location FILE.json``. Read in sgl-project/sglang
    ``python/sglang/srt/eplb/expert_location.py`` (commit 01fec5c2e61f9568c41a6e1d4fd5ac46c88504f1),
    ``compute_initial_expert_location_metadata``: the value is "trivial", a ``.pt`` file
    (``torch.load``), a ``.json`` file, or a JSON string; a dict holding
    ``physical_to_logical_map`` goes to ``ExpertLocationMetadata.init_by_mapping(server_args,
    model_config, **data)`` -- so the JSON must hold that key and nothing else (any
    other key is an unexpected keyword argument); one holding ``logical_count`` instead
    makes SGLang run its own EPLB, which is not what a plan wants. Rows are indexed by
    *model* layer id: ``ModelConfigForExpertLocation.num_layers`` is
    ``config.num_hidden_layers`` (``python/sglang/srt/models/deepseek_v2.py``,
    ``get_model_config_for_expert_location``, commit 00114aef19bbb7431b9cfc5a77dce64b9c53ed95)
    and ``ExpertLocationDispatchInfo.init_new(layer_id)`` indexes the maps with the decoder
    layer id. Rows of dense layers are never read; we write the identity there, as
    SGLang's own ``init_trivial`` does. A non-trivial ``init_expert_location`` makes
    ``server_args._handle_eplb_and_dispatch`` default ``ep_dispatch_algorithm`` to
    "static". Physical expert p lives on GPU ``p // num_local_physical_experts``.

``vllm-ascend``
    JSON ``{"moe_layer_count": L, "layer_list": [{"layer_id", "device_count",
    "device_list": [{"device_id", "device_expert": [logical ids by local slot]}]}]}`` for
    ``--additional-config '{"eplb_config": {"expert_map_path": FILE}}'`` (older releases:
    top-level ``"expert_map_path"``). Read in vllm-project/vllm-ascend
    ``vllm_ascend/ops/expert_load_balancer.py`` (commit 8df40d4d036100509d489de9f387ac3617b3634e),
    ``ExpertLoadBalancer._expert_file_to_tensor``: it reads ``moe_layer_count``,
    ``layer_list[0]["device_count"]`` and every ``device_expert`` list in order, into a
    [layers, ranks, local] int32 tensor; layer i of that list serves the i-th MoE layer
    (``moe_instance_id``, a counter over MoE layers only, so dense layers are skipped),
    and the global physical id of a local slot is ``rank * len(device_expert) + slot``.
    vllm-ascend's own writer (``vllm_ascend/eplb/utils.py``, ``export_tensor_to_file``)
    emits the same keys with ``layer_id`` = MoE layer index.

``trtllm``
    YAML ``{num_slots: N, layer_updates_per_iter: 0, initial_global_assignments:
    {model_layer: [logical id by slot] x num_slots}}`` for TensorRT-LLM's
    ``moe_config: {load_balancer: FILE.yaml}`` (in the ``--extra_llm_api_options`` /
    ``--config`` YAML of ``trtllm-serve`` / ``trtllm-bench``). Read in NVIDIA/TensorRT-LLM
    ``tensorrt_llm/llmapi/llm_args.py`` (``MoeLoadBalancerConfig``: ``num_slots``,
    ``initial_global_assignments: Dict[int, List[int]]``, ``layer_updates_per_iter``;
    strict, so no other keys; a str ``load_balancer`` is ``yaml.safe_load``-ed into it by
    ``validate_load_balancer``; ``get_layer_initial_global_assignments`` insists on
    ``len == num_slots``), and ``examples/wide_ep/ep_load_balancer/README.md`` +
    ``generate_eplb_config.py`` (commit 76a646e90c8e863629009ea5d365697da147348f): keys are
    model layer indices (DeepSeek-R1: 3..60), "every successive num_slots/ep_size slots
    are assigned to a rank", and ``layer_updates_per_iter: 0`` means a static placement.

The files are written with a few lines of code rather than a JSON/YAML library's pretty
printer so that their bytes do not depend on library versions (they are golden-tested).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from planner._checks import is_integer
from planner._io import write_bytes_atomic
from planner.errors import InputError, SchemaError
from planner.export.bundle import Bundle, permutation_from_placement
from planner.trace.schema import COUNTS_SOURCE, TraceMeta

# Guard against absurd model depths (SGLang's file has a row of N ids per model layer).
MAX_MODEL_LAYERS = 4096


@dataclass(frozen=True, eq=False)
class EnginePlacement:
    """What an engine file needs from a plan.

    Attributes:
        expert_permutation: [L, N] int64, logical expert in each physical slot of each MoE
            layer; slot s lives on EP rank ``s // (N / ep_size)``.
        ep_size: E.
        moe_layer_indices: model layer index of each MoE layer, length L, increasing.
        num_model_layers: decoder layers of the model, dense ones included (SGLang needs
            a row for each). Defaults to ``max(moe_layer_indices) + 1``.
        unplanned_gaps: the model layers missing from ``moe_layer_indices`` may be MoE
            layers left unplanned, not dense ones (a plan fitted from counts of some layers,
            :func:`planner.predict.counts`): the formats that list MoE layers only
            (vllm-ascend, TensorRT-LLM) then refuse the plan, since they would give a layer's
            plan to another layer or lack one, and SGLang's, which needs a row for every
            model layer, needs ``num_model_layers`` given (``model_layers_given``): the
            model may have MoE layers after the last one counted.
        model_layers_given: ``num_model_layers`` was given, not defaulted.

    Example: a 3-layer model whose layer 0 is dense, N = 4, E = 2::

        EnginePlacement(np.array([[1, 3, 0, 2], [0, 1, 2, 3]]), 2, (1, 2), 3)
    """

    expert_permutation: np.ndarray
    ep_size: int
    moe_layer_indices: tuple[int, ...]
    num_model_layers: int
    unplanned_gaps: bool = False
    model_layers_given: bool = True

    def __post_init__(self) -> None:
        perm = np.asarray(self.expert_permutation)
        if perm.ndim != 2 or perm.dtype.kind not in "iu":
            raise SchemaError(
                f"expert_permutation must be an integer [L, N] array, got {perm.dtype} "
                f"{list(perm.shape)}"
            )
        big_l, n = perm.shape
        e = self.ep_size
        if not is_integer(e) or e <= 0 or n % e:
            raise SchemaError(f"num_experts={n} is not divisible by ep_size={e!r}")
        # Each row must be a permutation; the placement it implies is then consistent.
        not_perm = np.flatnonzero((np.sort(perm, axis=1) != np.arange(n)).any(axis=1))
        if not_perm.size:
            raise SchemaError(
                f"engine placement: layer {int(not_perm[0])} of expert_permutation is not a "
                f"permutation of 0..{n - 1}"
            )
        idx = tuple(int(i) for i in self.moe_layer_indices)
        if len(idx) != big_l:
            raise SchemaError(
                f"moe_layer_indices has {len(idx)} entries for {big_l} MoE layers in the placement"
            )
        if idx and (idx[0] < 0 or any(b <= a for a, b in zip(idx, idx[1:], strict=False))):
            raise SchemaError(f"moe_layer_indices {list(idx)} must be increasing and >= 0")
        if not is_integer(self.num_model_layers):
            raise InputError(f"num_model_layers={self.num_model_layers!r} must be an integer")
        if idx and self.num_model_layers <= idx[-1]:
            raise InputError(
                f"num_model_layers={self.num_model_layers} is too small: MoE layer "
                f"{big_l - 1} is model layer {idx[-1]}"
            )
        if self.num_model_layers > MAX_MODEL_LAYERS:
            # SGLang's map has a row per model layer: refuse before building billions of them
            last = f" (the last MoE layer is model layer {idx[-1]})" if idx else ""
            raise InputError(
                f"num_model_layers={self.num_model_layers} is more than {MAX_MODEL_LAYERS} "
                f"decoder layers{last}"
            )
        perm = perm.astype(np.int64)
        perm.flags.writeable = False
        object.__setattr__(self, "expert_permutation", perm)
        object.__setattr__(self, "moe_layer_indices", idx)

    @property
    def num_experts(self) -> int:
        return int(self.expert_permutation.shape[1])

    @property
    def experts_per_device(self) -> int:
        return self.num_experts // self.ep_size

    @classmethod
    def from_bundle(cls, bundle: Bundle, num_model_layers: int | None = None) -> EnginePlacement:
        return cls.from_tables(
            bundle.expert_permutation, bundle.ep_size, bundle.meta, num_model_layers
        )

    @classmethod
    def from_tables(
        cls,
        expert_permutation: np.ndarray,
        ep_size: int,
        meta: TraceMeta,
        num_model_layers: int | None = None,
    ) -> EnginePlacement:
        """A bundle's placement from its permutation table and model (``meta``)."""
        idx = meta.moe_layer_indices
        return cls(
            expert_permutation,
            ep_size,
            idx,
            num_model_layers if num_model_layers is not None else max(idx) + 1,
            # a profiled trace names every MoE layer of the model; a counts table some
            unplanned_gaps=meta.source.startswith(COUNTS_SOURCE),
            model_layers_given=num_model_layers is not None,
        )

    @classmethod
    def from_expert_to_device(
        cls,
        expert_to_device: np.ndarray,
        ep_size: int,
        moe_layer_indices: Sequence[int],
        num_model_layers: int | None = None,
    ) -> EnginePlacement:
        """From a placement [L, N] (slots ordered by ascending logical id per device)."""
        perm = permutation_from_placement(np.asarray(expert_to_device), ep_size)
        idx = tuple(moe_layer_indices)
        return cls(
            perm, ep_size, idx, num_model_layers if num_model_layers is not None else max(idx) + 1
        )


# ---------------------------------------------------------------------------------------
# Builders: placement -> the engine's object


def sglang_expert_location(placement: EnginePlacement) -> dict[str, Any]:
    """``{"physical_to_logical_map": [num_model_layers][N]}``; dense layers get identity."""
    if placement.unplanned_gaps and not placement.model_layers_given:
        # SGLang indexes this map by decoder layer: a map that stops at the last counted
        # layer is an IndexError at the model's first MoE layer after it
        raise InputError(
            f"sglang: the plan was fitted from counts of model layers "
            f"{list(placement.moe_layer_indices)} only, so the model may have more layers "
            "after them and SGLang needs a row for each: pass --num-model-layers (the "
            "model's num_hidden_layers)"
        )
    n = placement.num_experts
    rows = [list(range(n)) for _ in range(placement.num_model_layers)]
    for moe_layer, model_layer in enumerate(placement.moe_layer_indices):
        rows[model_layer] = placement.expert_permutation[moe_layer].tolist()
    return {"physical_to_logical_map": rows}


def _every_moe_layer(placement: EnginePlacement, engine: str) -> None:
    """InputError if the plan may leave MoE layers out (``unplanned_gaps`` with layers
    missing before or between its own): the formats that list MoE layers only would
    misplace it. (Layers after the last counted one cannot be told from the plan.)"""
    idx = placement.moe_layer_indices
    if placement.unplanned_gaps and idx and list(idx) != list(range(idx[-1] + 1)):
        raise InputError(
            f"{engine}: the plan was fitted from counts of model layers {list(idx)} only; the "
            f"{engine} file lists every MoE layer in order, so the layers before or between "
            "would get the wrong plan or none (profile every MoE layer, or export sglang with "
            "--num-model-layers, whose rows keep the default layout where no layer was planned)"
        )


def vllm_ascend_expert_map(placement: EnginePlacement) -> dict[str, Any]:
    """vllm-ascend expert map: per MoE layer, per device, the logical ids by local slot."""
    _every_moe_layer(placement, "vllm-ascend")
    per, e = placement.experts_per_device, placement.ep_size
    layers = []
    for moe_layer, slots in enumerate(placement.expert_permutation.tolist()):
        devices = [
            {"device_id": d, "device_expert": slots[d * per : (d + 1) * per]} for d in range(e)
        ]
        layers.append({"layer_id": moe_layer, "device_count": e, "device_list": devices})
    return {"moe_layer_count": len(layers), "layer_list": layers}


def trtllm_load_balancer(placement: EnginePlacement) -> dict[str, Any]:
    """TensorRT-LLM ``MoeLoadBalancerConfig`` fields, keyed by model layer index."""
    _every_moe_layer(placement, "trtllm")
    return {
        "num_slots": placement.num_experts,
        "layer_updates_per_iter": 0,
        "initial_global_assignments": {
            model_layer: placement.expert_permutation[moe_layer].tolist()
            for moe_layer, model_layer in enumerate(placement.moe_layer_indices)
        },
    }


# ---------------------------------------------------------------------------------------
# Writers: object -> text, byte-stable


def _is_scalar(x: object) -> bool:
    return x is None or isinstance(x, bool | int | float | str)


def dump_json(obj: Any, indent: int = 0) -> str:
    """JSON with nested containers indented and lists of scalars on one line."""
    pad = "  " * indent
    if isinstance(obj, dict):
        if not obj:
            return "{}"
        items = [f"{pad}  {json.dumps(str(k))}: {dump_json(v, indent + 1)}" for k, v in obj.items()]
        return "{\n" + ",\n".join(items) + f"\n{pad}}}"
    if isinstance(obj, list):
        if all(_is_scalar(v) for v in obj):
            return "[" + ", ".join(json.dumps(v) for v in obj) + "]"
        items = [f"{pad}  {dump_json(v, indent + 1)}" for v in obj]
        return "[\n" + ",\n".join(items) + f"\n{pad}]"
    return json.dumps(obj)


def _dump_trtllm_yaml(cfg: dict[str, Any]) -> str:
    """The load-balancer mapping as YAML: scalars, then one flow list per layer."""
    lines = [
        "# TensorRT-LLM moe_config.load_balancer file written by moeplan: a static expert",
        "# placement (layer_updates_per_iter: 0); slot j of a layer is on EP rank",
        "# j // (num_slots / ep_size). Keys of initial_global_assignments are model layers.",
        f"num_slots: {int(cfg['num_slots'])}",
        f"layer_updates_per_iter: {int(cfg['layer_updates_per_iter'])}",
        "initial_global_assignments:",
    ]
    for layer, slots in cfg["initial_global_assignments"].items():
        lines.append(f"  {int(layer)}: [{', '.join(str(int(x)) for x in slots)}]")
    return "\n".join(lines) + "\n"


def _dump_json_file(obj: Any) -> str:
    return dump_json(obj) + "\n"


# ---------------------------------------------------------------------------------------
# Registry


@dataclass(frozen=True)
class EngineFormat:
    """One engine's placement file: how to build it, spell it, name it and use it."""

    name: str
    filename: str
    build: Callable[[EnginePlacement], Any]
    dump: Callable[[Any], str]
    usage: str

    def render(self, placement: EnginePlacement) -> str:
        return self.dump(self.build(placement))

    @property
    def suffixes(self) -> tuple[str, ...]:
        """File name endings of this format: an existing file is replaced only if it has one."""
        suffix = Path(self.filename).suffix
        return (".yaml", ".yml") if suffix == ".yaml" else (suffix,)


def _top_level_keys(text: str) -> frozenset[str] | None:
    """Top-level keys of an engine file's text (JSON, or this module's YAML); None if neither."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        keys = re.findall(r"^([A-Za-z_][A-Za-z0-9_]*):", text, flags=re.MULTILINE)
        return frozenset(keys) or None
    return frozenset(value) if isinstance(value, dict) else None


def check_engine_file_replaceable(path: str | Path, fmt: EngineFormat, text: str) -> None:
    """InputError unless ``path`` is absent, empty, or an earlier file of ``fmt``: one whose
    top-level keys are those of ``text``, the file about to be written (so that ``--out
    config.json`` never overwrites a model's config with a placement)."""
    path = Path(path)
    if not path.is_file() or path.stat().st_size == 0:
        return
    try:
        old = path.read_bytes()[: 1 << 26].decode("utf-8")
    except UnicodeDecodeError:
        old = ""
    keys = _top_level_keys(old)
    if keys is None or keys != _top_level_keys(text):
        raise InputError(
            f"{path}: exists and is not an earlier {fmt.name} file; choose another output path"
        )


FORMATS: dict[str, EngineFormat] = {
    f.name: f
    for f in (
        EngineFormat(
            "sglang",
            "sglang_expert_location.json",
            sglang_expert_location,
            _dump_json_file,
            "python -m sglang.launch_server --model-path MODEL --ep-size E "
            "--init-expert-location sglang_expert_location.json",
        ),
        EngineFormat(
            "vllm-ascend",
            "vllm_ascend_expert_map.json",
            vllm_ascend_expert_map,
            _dump_json_file,
            "vllm serve MODEL --enable-expert-parallel --additional-config "
            '\'{"eplb_config": {"expert_map_path": "vllm_ascend_expert_map.json"}}\'',
        ),
        EngineFormat(
            "trtllm",
            "trtllm_moe_load_balancer.yaml",
            trtllm_load_balancer,
            _dump_trtllm_yaml,
            "trtllm-serve MODEL --tp_size E --ep_size E --extra_llm_api_options opts.yaml "
            "with opts.yaml holding 'moe_config: {load_balancer: "
            "trtllm_moe_load_balancer.yaml}'",
        ),
    )
}


def get_format(name: str) -> EngineFormat:
    try:
        return FORMATS[name]
    except KeyError:
        raise InputError(
            f"unknown engine format {name!r}; choose from {', '.join(FORMATS)}"
        ) from None


def render_engine_file(name: str, placement: EnginePlacement | Bundle) -> str:
    """The text of engine format ``name`` for a placement (or a bundle's placement)."""
    if isinstance(placement, Bundle):
        placement = EnginePlacement.from_bundle(placement)
    return get_format(name).render(placement)


def write_engine_file(
    name: str, placement: EnginePlacement | Bundle, path: str | os.PathLike
) -> Path:
    """Write engine format ``name`` to ``path`` atomically; returns the path."""
    dest = Path(path)
    write_bytes_atomic(dest, render_engine_file(name, placement).encode())
    return dest

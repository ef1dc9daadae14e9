"""Where a Hugging Face MoE model routes tokens, and how to record what it decided.

One registry, :data:`ADAPTERS`, maps a config's ``model_type`` to a :class:`RouterAdapter`:
which decoder layers hold an MoE block, which attribute of that block is the router, and
how many experts / experts per token it uses. :class:`RoutingRecorder` puts a forward hook
on every router and returns, per forward pass, the ``(ids, weights)`` each token was sent
with.

What is recorded (transformers 5.x): every supported MoE block calls its router module,
which returns ``(router_logits, weights [T, k], ids [T, k])``, and passes exactly those
``weights`` and ``ids`` to its experts. The hook keeps them, sorted by weight (descending),
so the trace holds the gate weights the experts' outputs were multiplied by:

=============  =============================================================================
model_type     weights as applied by transformers 5.23
=============  =============================================================================
mixtral        softmax over all experts, top-k, renormalised to sum 1
qwen2_moe,     softmax over all experts, top-k; renormalised only when ``norm_topk_prob``
qwen3_moe,     (qwen2_moe/olmoe checkpoints usually have it false: weights then sum < 1)
olmoe
deepseek_v2    softmax; ``greedy`` or ``group_limited_greedy`` top-k (groups ranked by their
               best expert); times ``routed_scaling_factor`` (5.23 ignores norm_topk_prob)
deepseek_v3    sigmoid scores; experts chosen on scores + ``e_score_correction_bias`` among
               the ``topk_group`` best of ``n_group`` groups (group score = sum of its two
               best); weights are the *unbiased* sigmoid scores of the chosen experts,
               renormalised when ``norm_topk_prob``, times ``routed_scaling_factor``
gpt_oss        top-k of the logits (router has a bias), softmax over those k
phimoe         sparsemixer, eval mode: k = 2 always; rank 0 is the argmax, weighted by a
               softmax over the experts within the jitter window of it; rank 1 the argmax of
               the rest, weighted likewise with rank 0 masked out
=============  =============================================================================

Decision: the stored weights *include* ``routed_scaling_factor`` (DeepSeek), because that
is what the model multiplies expert outputs by. The profiler writes the factor into the
trace's ``source`` text; divide by it to get weights that sum to 1 (with norm_topk_prob).
Ranks are ordered by weight; ties keep the router's order.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from planner.errors import ModelError

# Config keys that, when positive, say a config describes a mixture of experts. Used to tell
# "unsupported MoE architecture" from "not an MoE model" for model types not in the registry.
_EXPERT_COUNT_KEYS = (
    "num_experts",
    "num_local_experts",
    "n_routed_experts",
    "moe_num_experts",
    "num_experts_per_tok",
    "moe_topk",
    "ffn_config",
)


def _all_layers(config: Any) -> list[int]:
    return list(range(config.num_hidden_layers))


def _qwen_sparse_layers(config: Any) -> list[int]:
    """Qwen2/3-MoE: MoE unless in ``mlp_only_layers`` or off the ``decoder_sparse_step`` grid."""
    if not (config.num_experts or 0) > 0:
        return []
    mlp_only = set(config.mlp_only_layers or ())
    step = config.decoder_sparse_step or 1
    return [i for i in range(config.num_hidden_layers) if i not in mlp_only and (i + 1) % step == 0]


def _after_dense_layers(config: Any) -> list[int]:
    """DeepSeek: the first ``first_k_dense_replace`` layers have a dense MLP."""
    first = config.first_k_dense_replace or 0
    return list(range(first, config.num_hidden_layers))


def _num_experts_per_tok(config: Any) -> int:
    return int(config.num_experts_per_tok or 0)


def _sparsemixer_k(config: Any) -> int:
    # sparsemixer picks exactly two experts whatever num_experts_per_tok says.
    return 2


@dataclass(frozen=True)
class RouterAdapter:
    """How to find and read the routers of one Hugging Face MoE architecture.

    Attributes:
        model_type: the config's ``model_type``.
        num_experts_key: config attribute holding N, the routed experts per MoE layer.
        router_attr: attribute of a decoder layer's ``mlp`` that is the router module.
        router_class: class name that module must have (guards against another
            transformers version laying the model out differently).
        moe_layers: config -> model layer index of every MoE layer, ascending.
        top_k: config -> k, experts each token is sent to.
        scaling_key: config attribute scaling the applied weights, recorded in the trace's
            ``source`` (None when weights are not scaled).
    """

    model_type: str
    num_experts_key: str
    router_attr: str
    router_class: str
    moe_layers: Callable[[Any], list[int]] = _all_layers
    top_k: Callable[[Any], int] = _num_experts_per_tok
    scaling_key: str | None = None

    def num_experts(self, config: Any) -> int:
        return int(getattr(config, self.num_experts_key, 0) or 0)

    def weights_note(self, config: Any) -> str:
        """How the stored weights relate to the router, for the trace's ``source``."""
        if self.scaling_key is None:
            return "weights as applied"
        factor = getattr(config, self.scaling_key, 1.0)
        return f"weights as applied, incl. {self.scaling_key}={factor:g}"


ADAPTERS: dict[str, RouterAdapter] = {
    a.model_type: a
    for a in (
        RouterAdapter("mixtral", "num_local_experts", "gate", "MixtralTopKRouter"),
        RouterAdapter(
            "qwen2_moe", "num_experts", "gate", "Qwen2MoeTopKRouter", _qwen_sparse_layers
        ),
        RouterAdapter(
            "qwen3_moe", "num_experts", "gate", "Qwen3MoeTopKRouter", _qwen_sparse_layers
        ),
        RouterAdapter("olmoe", "num_experts", "gate", "OlmoeTopKRouter"),
        RouterAdapter(
            "deepseek_v2",
            "n_routed_experts",
            "gate",
            "DeepseekV2TopkRouter",
            _after_dense_layers,
            scaling_key="routed_scaling_factor",
        ),
        RouterAdapter(
            "deepseek_v3",
            "n_routed_experts",
            "gate",
            "DeepseekV3TopkRouter",
            _after_dense_layers,
            scaling_key="routed_scaling_factor",
        ),
        RouterAdapter("gpt_oss", "num_local_experts", "router", "GptOssTopKRouter"),
        RouterAdapter(
            "phimoe", "num_local_experts", "router", "PhimoeTopKRouter", top_k=_sparsemixer_k
        ),
    )
}


def supported_architectures() -> list[str]:
    return sorted(ADAPTERS)


def adapter_for(raw_config: Mapping[str, Any], where: str) -> RouterAdapter:
    """The adapter for a checkpoint's ``config.json`` contents.

    Raises:
        ModelError: the config is not an MoE model, or its architecture is not supported.
    """
    model_type = raw_config.get("model_type")
    adapter = ADAPTERS.get(str(model_type))
    if adapter is not None:
        return adapter
    if not _looks_moe(raw_config):
        raise ModelError(
            f"{where}: model_type {model_type!r} is not an MoE model (its config has no "
            f"routed experts); moeplan profiles MoE models only"
        )
    raise ModelError(
        f"{where}: unsupported architecture {model_type!r}; supported: "
        f"{', '.join(supported_architectures())}"
    )


def _looks_moe(raw: Mapping[str, Any]) -> bool:
    for key in _EXPERT_COUNT_KEYS:
        value = raw.get(key)
        if isinstance(value, dict) or (isinstance(value, int | float) and value > 0):
            return True
    # Multimodal and composite configs nest the language model's config.
    return any(
        isinstance(v, dict) and _looks_moe(v) for k, v in raw.items() if k.endswith("config")
    )


def check_moe_config(adapter: RouterAdapter, config: Any, where: str) -> list[int]:
    """Validate N, k and the MoE layers of a loaded config; return ``moe_layer_indices``.

    Raises:
        ModelError: no routed experts or no MoE layer ("not an MoE model"), or k > N.
    """
    n, k = adapter.num_experts(config), adapter.top_k(config)
    layers = adapter.moe_layers(config) if n > 0 else []
    if n <= 0 or not layers:
        raise ModelError(
            f"{where}: this {adapter.model_type} config is not an MoE model "
            f"({adapter.num_experts_key}={n}, MoE layers: {len(layers)})"
        )
    if not 0 < k <= n:
        raise ModelError(f"{where}: top-k={k} is not in [1, {n}] (num_experts={n})")
    method = getattr(config, "topk_method", None)
    if adapter.model_type == "deepseek_v2" and method not in ("greedy", "group_limited_greedy"):
        # transformers' router knows these two; any other fails inside its forward pass
        raise ModelError(
            f"{where}: topk_method={method!r}; DeepSeek-V2's router takes 'greedy' or "
            "'group_limited_greedy'"
        )
    step = getattr(config, "decoder_sparse_step", None)
    step_ok = step is None or (isinstance(step, int) and not isinstance(step, bool) and step >= 1)
    if adapter.moe_layers is _qwen_sparse_layers and not step_ok:
        # transformers builds layer i as MoE where (i + 1) % step == 0: 0 divides by zero
        raise ModelError(f"{where}: decoder_sparse_step={step!r} must be a positive integer")
    grouped = adapter.model_type == "deepseek_v3" or method == "group_limited_greedy"
    if grouped:
        # transformers views the scores as [T, n_group, N / n_group]: where n_group does not
        # divide N the view mixes neighbouring tokens' scores whenever T N happens to divide
        groups, chosen = getattr(config, "n_group", None), getattr(config, "topk_group", None)
        # DeepSeek-V3 scores a group by its top 2 experts: groups of one expert fail there
        least = 2 if adapter.model_type == "deepseek_v3" else 1
        if not (
            isinstance(groups, int)
            and isinstance(chosen, int)
            and groups >= 1
            and n % groups == 0
            and n // groups >= least
            and 1 <= chosen <= groups
        ):
            raise ModelError(
                f"{where}: n_group={groups!r} and topk_group={chosen!r} must be integers with "
                f"n_group dividing the {n} routed experts"
                + (" into groups of at least 2" if least > 1 else "")
                + " and 1 <= topk_group <= n_group"
            )
    return layers


def find_routers(
    model: nn.Module, adapter: RouterAdapter, moe_layers: list[int], num_experts: int, where: str
) -> list[nn.Module]:
    """The router module of each MoE layer of a loaded model, in ``moe_layers`` order.

    Raises:
        ModelError: the model is not laid out as ``adapter`` expects.
    """
    layers = getattr(model.base_model, "layers", None)
    if layers is None:
        raise ModelError(f"{where}: {type(model).__name__} has no decoder .layers to hook")
    routers: list[nn.Module] = []
    for i, layer in enumerate(layers):
        router = getattr(getattr(layer, "mlp", None), adapter.router_attr, None)
        is_router = type(router).__name__ == adapter.router_class
        if is_router != (i in moe_layers):
            found = type(router).__name__ if router is not None else "none"
            raise ModelError(
                f"{where}: layer {i} router is {found}, expected "
                f"{adapter.router_class if i in moe_layers else 'none (dense layer)'}; "
                f"this transformers version lays out {adapter.model_type} differently"
            )
        if is_router:
            assert router is not None  # its class name is adapter.router_class
            rows = router.weight.shape[0]
            if rows != num_experts:
                raise ModelError(
                    f"{where}: layer {i} router scores {rows} experts, config says {num_experts}"
                )
            routers.append(router)
    return routers


class RoutingRecorder:
    """Forward hooks on every MoE router; collects one forward pass's routing at a time.

    Use as a context manager around the forward passes; after each, :meth:`take` returns the
    routing of the T flattened (batch-major) token positions the routers saw.
    """

    def __init__(self, routers: list[nn.Module], num_experts: int, top_k: int, where: str):
        self.routers = routers
        self.num_experts = num_experts
        self.top_k = top_k
        self.where = where
        self._seen: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in routers]
        self._handles: list[Any] = []

    def __enter__(self) -> RoutingRecorder:
        for layer, router in enumerate(self.routers):
            self._handles.append(router.register_forward_hook(self._hook(layer)))
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _hook(self, layer: int) -> Callable[..., None]:
        def record(module: nn.Module, args: tuple, output: Any) -> None:
            weights, ids = output[1], output[2]
            weights, order = torch.sort(weights.float(), dim=-1, descending=True, stable=True)
            self._seen[layer].append((ids.gather(-1, order), weights))

        return record

    def take(self, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Routing of the last forward pass and reset.

        Returns:
            ids: [T, L, k] int64 expert ids, rank 0 = largest weight.
            weights: [T, L, k] float32 weights as applied, descending along k.

        Raises:
            ModelError: a router did not run exactly once on T tokens, or returned other
                shapes or ids than the config declares.
        """
        ids_per_layer, weights_per_layer = [], []
        for layer, seen in enumerate(self._seen):
            if len(seen) != 1:
                raise ModelError(
                    f"{self.where}: MoE layer {layer}'s router ran {len(seen)} times in one "
                    f"forward pass (expected once; a fused kernel may bypass it)"
                )
            ids, weights = seen[0]
            if ids.shape != (num_tokens, self.top_k):
                raise ModelError(
                    f"{self.where}: MoE layer {layer}'s router returned ids of shape "
                    f"{tuple(ids.shape)}, expected ({num_tokens}, {self.top_k})"
                )
            ids_per_layer.append(ids)
            weights_per_layer.append(weights)
        self._seen = [[] for _ in self.routers]
        ids = torch.stack(ids_per_layer, dim=1)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.num_experts):
            raise ModelError(
                f"{self.where}: router returned expert id outside [0, {self.num_experts})"
            )
        return ids, torch.stack(weights_per_layer, dim=1)

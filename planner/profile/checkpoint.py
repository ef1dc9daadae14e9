"""Open a local Hugging Face checkpoint directory for profiling; never contacts the hub.

:func:`inspect_checkpoint` reads ``config.json`` and checks everything that can be checked
without loading weights (an MoE model, a supported architecture, a tokenizer present), so a
wrong directory fails in a second with one line. :func:`load_tokenizer` and
:func:`load_model` then load from that directory only (``local_files_only=True`` and
``HF_HUB_OFFLINE=1``).
"""

from __future__ import annotations

import copy
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from planner._io import read_json_object
from planner.errors import InputError, ModelError
from planner.profile.routers import RouterAdapter, adapter_for, check_moe_config

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
DTYPES = ("float32", "bfloat16", "float16")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def _offline() -> None:
    # Read by huggingface_hub when transformers is first imported; local_files_only covers
    # the case where it was imported already.
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


@dataclass(frozen=True)
class CheckpointInfo:
    """What profiling needs to know about a checkpoint before loading its weights.

    Attributes:
        path: the checkpoint directory.
        name: model name recorded in the trace (see :func:`checkpoint_name`).
        model_type: the config's ``model_type``.
        adapter: how to find and read its routers.
        config: the transformers config object.
        moe_layer_indices: model layer index of each MoE layer, length L.
        num_experts: N routed experts per MoE layer.
        top_k: k experts per token.
        vocab_size: V, from the config.
    """

    path: Path
    name: str
    model_type: str
    adapter: RouterAdapter
    config: Any
    moe_layer_indices: tuple[int, ...]
    num_experts: int
    top_k: int
    vocab_size: int


def checkpoint_name(path: Path, raw_config: dict[str, Any]) -> str:
    """A stable name for the model: a hub-style ``_name_or_path`` from the config, else the
    ``org/name`` of a Hugging Face cache snapshot path, else the directory's name."""
    name = raw_config.get("_name_or_path")
    if isinstance(name, str) and _HUB_ID.match(name):
        return name
    resolved = path.resolve()
    for part in resolved.parts:
        if part.startswith("models--"):
            return part.removeprefix("models--").replace("--", "/")
    return resolved.name


def inspect_checkpoint(model_dir: str | Path) -> CheckpointInfo:
    """Read and check a checkpoint directory's config and tokenizer files (no weights).

    Raises:
        InputError: the directory or its ``config.json`` is missing or unreadable.
        ModelError: not an MoE model, an unsupported architecture, or no tokenizer.
    """
    path = Path(model_dir)
    if not path.is_dir():
        what = "is not a directory" if path.exists() else "does not exist"
        raise InputError(
            f"model directory {str(path)!r} {what} (pass a local Hugging Face "
            f"checkpoint directory to --model)"
        )
    config_file = path / "config.json"
    if not config_file.is_file():
        raise InputError(f"{path}: no config.json; not a Hugging Face checkpoint directory")
    raw = read_json_object(config_file, str(config_file))
    adapter = adapter_for(raw, str(path))
    _offline()
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ModelError(f"{path}: cannot read config ({first_line(e)})") from None
    except _config_validation_errors() as e:
        # A config field of the wrong type (e.g. "num_local_experts": "8"); the first line
        # of the message names the field, the next one the problem.
        raise ModelError(f"{path}: cannot read config ({_joined_lines(e)})") from None
    layers = check_moe_config(adapter, config, str(path))
    if not any((path / f).is_file() for f in TOKENIZER_FILES):
        raise ModelError(
            f"{path}: no tokenizer in the directory (expected one of "
            f"{', '.join(TOKENIZER_FILES)}); save the tokenizer next to the model"
        )
    return CheckpointInfo(
        path=path,
        name=checkpoint_name(path, raw),
        model_type=adapter.model_type,
        adapter=adapter,
        config=config,
        moe_layer_indices=tuple(layers),
        num_experts=adapter.num_experts(config),
        top_k=adapter.top_k(config),
        vocab_size=int(config.vocab_size),
    )


def load_tokenizer(info: CheckpointInfo) -> Any:
    """The checkpoint's tokenizer, from its directory only."""
    _offline()
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(info.path, local_files_only=True)
    except Exception as e:
        # Any: the Rust tokenizers library reports a damaged tokenizer.json as a bare
        # Exception, and transformers a malformed tokenizer_config.json as AttributeError.
        raise ModelError(f"{info.path}: cannot load tokenizer ({first_line(e)})") from None


def _attention_override(config: Any) -> dict[str, Any]:
    """``attn_implementation="eager"`` where the config names another kernel than eager or
    sdpa (``"_attn_implementation": "flash_attention_2"``, saved from a GPU run): the
    routing does not depend on it, and the kernel's package is often not installed where
    profiling runs (it was an ImportError traceback). Eager attention works for every
    supported model. (transformers lets the config file's choice win over the argument
    unless the config object is passed too: a copy, so ``config`` is left as read.)"""
    requested = getattr(config, "_attn_implementation", None)
    if requested in (None, "eager", "sdpa"):
        return {}
    return {"config": copy.deepcopy(config), "attn_implementation": "eager"}


def load_model(info: CheckpointInfo, device: str, dtype: str, progress: bool = True) -> Any:
    """The checkpoint's causal LM in eval mode on ``device``, weights in ``dtype``."""
    _offline()
    import torch
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    bars_were_on = hf_logging.is_progress_bar_enabled()
    if not progress:
        hf_logging.disable_progress_bar()
    # The loading report (a multi-line warning) would repeat what the error below says.
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity(max(verbosity, hf_logging.ERROR))
    try:
        # Any: transformers wraps PreTrainedModel.to with functools.wraps, which mypy
        # cannot bind as a method. Mismatched shapes are let through and refused below, so
        # the error can name the tensor instead of pointing at a suppressed report.
        loaded: Any = AutoModelForCausalLM.from_pretrained(
            info.path,
            local_files_only=True,
            dtype=getattr(torch, dtype),
            ignore_mismatched_sizes=True,
            output_loading_info=True,
            **_attention_override(info.config),
        )
        model: Any = loaded[0]
        loading: dict[str, Any] = loaded[1]
    except SafetensorError as e:
        raise ModelError(
            f"{info.path}: cannot load model weights: a .safetensors file is truncated or "
            f"damaged ({first_line(e)})"
        ) from None
    except (
        OSError,
        ValueError,
        KeyError,
        TypeError,
        RuntimeError,
        AssertionError,
        IndexError,
        ArithmeticError,
        ImportError,
    ) as e:
        # RuntimeError: the state-dict errors of transformers; AssertionError, IndexError and
        # ArithmeticError: modules built from a bad config (a pad_token_id past the
        # vocabulary, vocab_size 0, num_attention_heads 0); ImportError: a kernel package
        # the config names is not installed
        raise ModelError(f"{info.path}: cannot load model weights ({first_line(e)})") from None
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars_were_on:
            hf_logging.enable_progress_bar()
    mismatched = sorted(loading.get("mismatched_keys") or (), key=str)
    if mismatched:
        raise ModelError(
            f"{info.path}: the weights do not match config.json "
            f"({_describe_mismatch(mismatched[0])}"
            f"{f' and {len(mismatched) - 1} more' if len(mismatched) > 1 else ''}); "
            f"the config or the weights file was changed"
        )
    missing = sorted(loading.get("missing_keys") or ())
    if missing:  # transformers would leave them at their random initial values
        raise ModelError(
            f"{info.path}: the weights file lacks {missing[0]}"
            f"{f' and {len(missing) - 1} more' if len(missing) > 1 else ''} of the "
            f"tensors config.json describes; the weights file is incomplete"
        )
    try:
        return model.to(device).eval()
    except RuntimeError as e:  # torch.OutOfMemoryError included
        raise ModelError(
            f"{info.path}: cannot move the model to {device} ({first_line(e)})"
        ) from None


def _describe_mismatch(item: Any) -> str:
    """One mismatched tensor as transformers reports it: (name, checkpoint shape, model shape)."""
    if isinstance(item, tuple) and len(item) == 3:
        name, in_file, in_config = item
        return f"{name} is {list(in_file)} in the weights file but {list(in_config)} by the config"
    return str(item)


def _config_validation_errors() -> tuple[type[BaseException], ...]:
    """huggingface_hub's strict-dataclass validation error, which transformers 5 raises for a
    config field of the wrong type; it derives from Exception only."""
    try:
        from huggingface_hub.errors import StrictDataclassError
    except ImportError:  # an older huggingface_hub: configs are not validated
        return ()
    return (StrictDataclassError,)


def _joined_lines(e: BaseException) -> str:
    """All of an exception's message on one line (whitespace collapsed)."""
    return " ".join(str(e).split()) or type(e).__name__


def first_line(e: BaseException) -> str:
    """An exception's message, first line only (its type's name when the message is empty)."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__

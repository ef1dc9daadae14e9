"""Checks shared by the shim's entry points: tensors must be tensors and hold data."""

from __future__ import annotations

from typing import Any

import torch

from planner.errors import InputError


def require_data(x: Any, name: str) -> None:
    """InputError unless ``x`` holds values: a tensor on the 'meta' device has only a shape,
    and every shim function reads values (ids, ranges, counts), which torch reports as a
    raw NotImplementedError or RuntimeError deep inside."""
    device = getattr(x, "device", None)
    if getattr(device, "type", None) == "meta":
        raise InputError(
            f"{name} is on the meta device (a shape without data); move it to a real device"
        )


def require_tensor(x: Any, name: str) -> None:
    """InputError unless ``x`` is a torch tensor with data (numpy arrays and lists are not
    converted: the result's dtype and device follow the input's)."""
    if not isinstance(x, torch.Tensor):
        raise InputError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    require_data(x, name)

"""Checks shared by the shim's entry points: tensors must be tensors and hold data."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from planner.errors import InputError

MAX_EP_SIZE = 32767  # device ids are int16 in a bundle (DESIGN.md), so E <= N <= 32767


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


def as_tensor(x: Any, name: str) -> torch.Tensor:
    """``x`` as a torch tensor (tensors as they are; numpy arrays and lists converted), or an
    InputError naming ``name`` when it is not numbers (None, strings, ragged lists, objects)."""
    if isinstance(x, torch.Tensor):
        require_data(x, name)
        return x
    try:
        # (np.ascontiguousarray makes a 0-d array 1-D: a scalar passed the [T] checks)
        return torch.as_tensor(np.asarray(x, order="C"))
    except (TypeError, ValueError, RuntimeError):
        raise InputError(
            f"{name} must be a tensor or array of numbers, got {type(x).__name__} "
            "(not numbers, or ragged)"
        ) from None


def holds_integers(t: torch.Tensor) -> bool:
    """Whether ``t``'s dtype is an integer one (bool is not: True would be id 1)."""
    return not (t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool)


def out_of_range(t: torch.Tensor, lo: int, hi: int, dtype: torch.dtype | None = None) -> int | None:
    """An id of the integer tensor ``t`` outside [lo, hi) to name in an error, by its true
    value, or None. ``dtype``: the caller's original dtype where ``t`` is already a cast."""
    if not t.numel():
        return None
    least, most = (int(v) for v in t.to(torch.int64).aminmax())  # torch: no uint64 min / max
    if least < lo or most >= hi:
        return unwrap_id(least if least < lo else most, t.dtype if dtype is None else dtype)
    return None


def unwrap_id(value: int, dtype: torch.dtype) -> int:
    """The true value of an id of a ``dtype`` tensor read back after its cast to int64: a
    uint64 id >= 2**63 wraps to a negative int64 (and torch has no min / max for uint64),
    so an error would otherwise name a negative id the caller never passed."""
    return value + 2**64 if dtype == torch.uint64 and value < 0 else value


def overlaps_itself(t: torch.Tensor) -> bool:
    """Whether two elements of ``t`` may share memory (an expanded buffer, stride 0).

    Exact when the dimensions, taken by stride, each step past everything before them; a
    layout that does not (elements may interleave) counts as overlapping.
    """
    if t.numel() <= 1 or t.is_contiguous():
        return False
    span = 0  # elements reached by the dimensions taken so far, beyond the first
    for stride, size in sorted(
        (abs(st), sz) for st, sz in zip(t.stride(), t.shape, strict=True) if sz > 1
    ):
        if stride <= span:
            return True
        span += stride * (size - 1)
    return False


def overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` may share memory (an out= buffer and the gather's input).

    Exact for two [R, H] matrices with unit column stride and the same row stride (column
    slices of one wider matrix do not overlap); otherwise any intersection of their address
    ranges counts. Addresses, not storage objects, are compared: two views of one buffer
    can have storages of their own (``torch.from_dlpack``, two ``torch.from_numpy`` views
    of one array), and a shortcut on distinct storages let such an ``out=`` overwrite rows
    the gather had still to read.
    """
    if a.numel() == 0 or b.numel() == 0 or a.device != b.device:
        return False

    def span(t: torch.Tensor) -> tuple[int, int]:
        last = sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))
        return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()

    (a_lo, a_hi), (b_lo, b_hi) = span(a), span(b)
    if a_hi <= b_lo or b_hi <= a_lo:
        return False
    size = a.element_size()
    if a.ndim == b.ndim == 2 and b.element_size() == size:
        row = a.stride(0) * size
        unit = all(t.shape[1] <= 1 or t.stride(1) == 1 for t in (a, b))
        width_a, width_b = a.shape[1] * size, b.shape[1] * size
        if unit and row > 0 and b.stride(0) * size == row and max(width_a, width_b) <= row:
            # each row's bytes are a window of the row stride; b's starts `shift` after a's
            shift = (b_lo - a_lo) % row
            return shift < width_a or shift + width_b > row
    return True


# Integer dtypes of each element size: rows are moved as bits, whatever the float format.
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
# Unsigned integers wider than a byte, which CPU torch cannot index_fill either.
_UNSIGNED_WIDE = (torch.uint16, torch.uint32, torch.uint64)


def bit_view(x: torch.Tensor) -> torch.Tensor:
    """``x`` viewed as same-size integers (shape and strides kept) when it is floating (or
    unsigned and wider than a byte).

    A gather copies bits, so moving a float tensor's rows as integers is exact (NaN payloads
    and -0.0 included) and works for every float format: fp8, which CPU torch cannot
    index_fill or index_select and Triton's interpreter cannot load, as much as fp32.
    Padding rows are zero bits: +0.0 in the IEEE formats and fp8 e4m3 / e5m2 (in e8m0, a
    scale format with no zero, they read 2**-127).
    """
    if x.is_floating_point() or x.dtype in _UNSIGNED_WIDE:
        return x.view(_BITS[x.element_size()])
    return x

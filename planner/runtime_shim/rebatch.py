"""Rebatch tokens by destination device and resume them to their original order.

Speculative MoE App. B.2 Algorithm 2 (and Sem-MoE App. B, Attention-TP): before an MoE
layer each token is sent to the device predicted to host its experts. ``rebatch`` groups
the rows of a ``[T, H]`` hidden-state matrix by destination device and pads every group to
the same number of rows, so that the result splits into ``E`` equal chunks, chunk ``d``
holding device ``d``'s tokens -- the layout a reduce-scatter or all-gather moves. ``resume``
inverts it exactly.

Layout of the shuffled matrix (``E`` devices, chunk size ``C``)::

    rows [d*C, d*C + counts[d])      device d's tokens, in their original (stable) order
    rows [d*C + counts[d], (d+1)*C)  zero padding

``C`` is the largest group (``max(counts)``) unless the caller fixes ``chunk_rows``, e.g.
to keep shapes static across steps (CUDA graphs) at the cost of more padding; a fixed
``chunk_rows`` smaller than the largest group is an error (the runtime must cap per-device
load before rebatching, see ``PlanTables.route(max_tokens_per_device=...)``).

Both directions are one row gather: ``shuffled = hidden[slot_to_token]`` (padding slots
write zeros) and ``hidden = shuffled[token_to_slot]``. On CUDA tensors with triton
importable the gather runs on the Triton kernel in :mod:`planner.runtime_shim.kernels`;
elsewhere on ``torch.index_select``.

Glossary: *slot* -- a row of the shuffled matrix; ``slot_to_token`` / ``token_to_slot`` --
the two index maps between slots and original rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

from planner._checks import is_integer
from planner.errors import InputError
from planner.runtime_shim import kernels
from planner.runtime_shim._data import (
    MAX_EP_SIZE,
    as_tensor,
    bit_view,
    holds_integers,
    out_of_range,
    overlaps,
    overlaps_itself,
    require_data,
    require_tensor,
    unwrap_id,
)

Backend = Literal["auto", "triton", "torch"]
BACKENDS: tuple[str, ...] = ("auto", "triton", "torch")


@dataclass(frozen=True, eq=False)
class RebatchInfo:
    """Where every token went: the inverse of a rebatch, usable by the collectives.

    Attributes:
        slot_to_token: [E * C] int64, original row held by each shuffled row, -1 for padding.
            Example (E=2, C=2, devices=[1, 0, 1]): ``[1, -1, 0, 2]``.
        token_to_slot: [T] int64, shuffled row of each original row. Example: ``[2, 0, 3]``.
        counts: [E] int64, tokens sent to each device. Example: ``[1, 2]``.
        chunk_rows: C, rows per device chunk (padding included).
        planned: made by :func:`plan_rebatch` (its index values are valid by construction).
            The gathers check the values of any other info once (a device sync): a
            hand-made one with an index out of range had the Triton kernel read past the
            end of the tensor.
    """

    slot_to_token: torch.Tensor
    token_to_slot: torch.Tensor
    counts: torch.Tensor
    chunk_rows: int
    planned: bool = field(default=False, repr=False)

    def __post_init__(self) -> None:
        # Shapes only (values would cost a device sync on every call; plan_rebatch makes
        # valid ones): a hand-made info of the wrong size filled rows with uninitialised
        # memory.
        for name in ("slot_to_token", "token_to_slot", "counts"):
            t = getattr(self, name)
            if not isinstance(t, torch.Tensor) or t.ndim != 1 or t.dtype != torch.int64:
                raise InputError(f"RebatchInfo.{name} must be a 1-D int64 tensor")
        if not is_integer(self.chunk_rows) or self.chunk_rows < 0:
            raise InputError(
                f"RebatchInfo.chunk_rows must be an integer >= 0, got {self.chunk_rows!r}"
            )
        if self.slot_to_token.shape[0] != self.counts.shape[0] * self.chunk_rows:
            raise InputError(
                f"RebatchInfo.slot_to_token has {self.slot_to_token.shape[0]} slots, not "
                f"ep_size x chunk_rows = {self.counts.shape[0]} x {self.chunk_rows}"
            )
        if self.token_to_slot.shape[0] > self.slot_to_token.shape[0]:
            raise InputError(
                f"RebatchInfo has {self.token_to_slot.shape[0]} tokens for "
                f"{self.slot_to_token.shape[0]} slots"
            )

    @property
    def ep_size(self) -> int:
        return int(self.counts.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.token_to_slot.shape[0])

    @property
    def padded_rows(self) -> int:
        """E * C, rows of the shuffled matrix."""
        return self.ep_size * self.chunk_rows

    def chunk_tokens(self, device: int) -> torch.Tensor:
        """[C] int64: original rows in device ``device``'s chunk, -1 for padding."""
        if not is_integer(device) or not 0 <= device < self.ep_size:
            raise InputError(f"device {device!r} outside [0, {self.ep_size}) (integer device ids)")
        c, d = self.chunk_rows, int(device)
        return self.slot_to_token[d * c : (d + 1) * c]

    def to(self, device: torch.device | str) -> RebatchInfo:
        """The same plan with its index tensors on ``device``."""
        return RebatchInfo(
            self.slot_to_token.to(device),
            self.token_to_slot.to(device),
            self.counts.to(device),
            self.chunk_rows,
            self.planned,
        )

    def checked_index(self, name: str, device: torch.device) -> torch.Tensor:
        """``slot_to_token`` or ``token_to_slot`` on ``device``; InputError when an info not
        made by :func:`plan_rebatch` is not a valid one (see :meth:`check_values`)."""
        index = getattr(self, name).to(device)
        if not self.planned:
            self.check_values()
        return index

    def check_values(self) -> None:
        """InputError unless the maps hold a layout :func:`plan_rebatch` could have made:
        both in range, ``token_to_slot`` the inverse of ``slot_to_token``, and chunk ``d``
        holding ``counts[d]`` tokens before its padding. A few host syncs: the gathers run it
        on hand-made infos only (one whose maps disagreed moved rows silently wrong)."""
        slots, tokens, counts = self.slot_to_token, self.token_to_slot, self.counts.cpu()
        for name, index, least, rows in (
            ("slot_to_token", slots, -1, self.num_tokens),  # -1: a padding slot
            ("token_to_slot", tokens, 0, self.padded_rows),
        ):
            bad = out_of_range(index, least, rows)
            if bad is not None:
                raise InputError(f"RebatchInfo.{name} holds {bad}, outside [{least}, {rows})")
        if (counts < 0).any() or int(counts.sum()) != self.num_tokens:
            raise InputError(
                f"RebatchInfo.counts {counts.tolist()} must be >= 0 and sum to the "
                f"{self.num_tokens} tokens"
            )
        if (counts > self.chunk_rows).any():
            raise InputError(
                f"RebatchInfo.counts {counts.tolist()} exceed chunk_rows={self.chunk_rows}"
            )
        tokens_first = (
            (torch.arange(self.chunk_rows).unsqueeze(0) < counts.unsqueeze(1))
            .flatten()
            .to(slots.device)
        )
        if not torch.equal(slots >= 0, tokens_first):
            raise InputError(
                "RebatchInfo.slot_to_token must hold chunk d's counts[d] tokens first, "
                "then padding (-1)"
            )
        inverse = slots.index_select(0, tokens.to(slots.device))
        if not torch.equal(inverse, torch.arange(self.num_tokens, device=slots.device)):
            raise InputError(
                "RebatchInfo.token_to_slot is not the inverse of slot_to_token "
                "(slot_to_token[token_to_slot[t]] != t for some token t)"
            )


def plan_rebatch(devices: torch.Tensor, ep_size: int, chunk_rows: int | None = None) -> RebatchInfo:
    """Compute the shuffle of Algorithm 2 (argsort, group, align, concat) without moving rows.

    Args:
        devices: [T] integer tensor, destination device of each token, in [0, ep_size).
        ep_size: E, number of devices.
        chunk_rows: rows per device chunk; default: the largest group. Must be at least
            the largest group.

    Returns:
        RebatchInfo with tensors on ``devices``' device.
    """
    if not is_integer(ep_size) or not 1 <= ep_size <= MAX_EP_SIZE:
        raise InputError(f"ep_size must be an integer in 1..{MAX_EP_SIZE}, got {ep_size!r}")
    ep_size = int(ep_size)
    devices = as_tensor(devices, "devices")
    if devices.ndim != 1:
        raise InputError(f"devices must be a 1-D tensor [T], got shape {tuple(devices.shape)}")
    if not holds_integers(devices):
        raise InputError(f"devices must hold integers, got dtype {devices.dtype}")
    dtype, devices = devices.dtype, devices.to(torch.int64)
    num_tokens = devices.shape[0]
    counts = torch.zeros(ep_size, dtype=torch.int64, device=devices.device)
    largest = 0
    if num_tokens:
        # Range check and the largest group in one host sync (this is the GPU hot path);
        # clamping first keeps an out-of-range id from indexing out of bounds.
        lo, hi = devices.aminmax()
        counts.scatter_add_(0, devices.clamp(0, ep_size - 1), torch.ones_like(devices))
        lo, hi, largest = torch.stack([lo, hi, counts.max()]).tolist()
        if lo < 0 or hi >= ep_size:
            bad = unwrap_id(lo if lo < 0 else hi, dtype)
            raise InputError(f"device id {bad} outside [0, {ep_size}) (ep_size={ep_size})")
    if chunk_rows is None:
        chunk_rows = largest
    elif not is_integer(chunk_rows):
        raise InputError(f"chunk_rows must be an integer or None, got {chunk_rows!r}")
    elif chunk_rows < largest:
        raise InputError(
            f"chunk_rows={chunk_rows!r} is smaller than the largest device group ({largest} "
            "tokens); pass chunk_rows >= that, or None to use it"
        )
    chunk_rows = int(chunk_rows)
    if ep_size * chunk_rows > torch.iinfo(torch.int64).max:
        raise InputError(
            f"chunk_rows={chunk_rows} is too large: {ep_size} x chunk_rows rows overflow int64"
        )

    # Stable sort keeps each device's tokens in their original order. index_select and
    # scatter_ rather than t[idx] indexing: on CPU the latter starts a parallel region even
    # for a few thousand elements, which costs milliseconds on a busy machine.
    order = torch.sort(devices, stable=True).indices
    sorted_devices = devices.index_select(0, order)
    group_start = torch.cumsum(counts, 0) - counts
    rank_in_group = torch.arange(num_tokens, device=devices.device) - group_start.index_select(
        0, sorted_devices
    )
    slot_of_sorted = sorted_devices * chunk_rows + rank_in_group

    token_to_slot = torch.empty_like(devices).scatter_(0, order, slot_of_sorted)
    try:
        slot_to_token = torch.full(
            (ep_size * chunk_rows,), -1, dtype=torch.int64, device=devices.device
        )
    except RuntimeError as e:  # torch.OutOfMemoryError on CUDA, the allocator's on CPU
        if "memory" not in str(e).lower():
            raise
        raise InputError(
            f"chunk_rows={chunk_rows} is too large: the {ep_size} x {chunk_rows} slot map "
            f"({8 * ep_size * chunk_rows} bytes) does not fit in {devices.device} memory"
        ) from None
    slot_to_token.scatter_(0, slot_of_sorted, order)
    return RebatchInfo(slot_to_token, token_to_slot, counts, chunk_rows, planned=True)


def check_info(info: RebatchInfo) -> None:
    """InputError unless ``info`` is a :class:`RebatchInfo` (None or another object was an
    AttributeError deep inside apply_rebatch / resume / shuffled_all_gather)."""
    if not isinstance(info, RebatchInfo):
        raise InputError(
            f"info must be the RebatchInfo rebatch returned, got {type(info).__name__}"
        )
    for name in ("slot_to_token", "token_to_slot", "counts"):  # (a meta-device info)
        require_data(getattr(info, name), f"info.{name}")


def _use_triton(x: torch.Tensor, backend: str, out: torch.Tensor | None = None) -> bool:
    if backend not in BACKENDS:
        raise InputError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":  # the kernel moves floating rows; integer ones take torch's gather
        # and writes rows of unit column stride: another out= layout takes torch's too (it
        # worked on CPU and was refused on a GPU)
        unit = out is None or out.shape[1] <= 1 or out.stride(1) == 1
        return kernels.HAS_TRITON and x.is_cuda and x.is_floating_point() and unit
    return backend == "triton"


def _differentiable(x: torch.Tensor, out: torch.Tensor | None) -> bool:
    """Whether autograd records ops on ``x`` (then the gathers take torch's differentiable
    path whatever the backend: the Triton kernel and ``out=`` have no backward)."""
    if not (x.requires_grad and torch.is_grad_enabled()):
        return False
    if out is not None:
        raise InputError(
            "out= cannot be used with a tensor that requires grad (no backward writes into "
            "a preallocated buffer); drop out=, or run under torch.no_grad()"
        )
    return True


def _check_out(
    out: torch.Tensor | None, shape: tuple[int, int], like: torch.Tensor, like_name: str
) -> None:
    if out is None:
        return
    require_tensor(out, "out")
    if out.requires_grad and torch.is_grad_enabled():
        raise InputError(
            "out= cannot be used with a tensor that requires grad (no backward writes into "
            "a preallocated buffer); pass a buffer without requires_grad"
        )
    if tuple(out.shape) != shape or out.dtype != like.dtype or out.device != like.device:
        raise InputError(
            f"out must be {shape} {like.dtype} on {like.device}, "
            f"got {tuple(out.shape)} {out.dtype} on {out.device}"
        )
    if overlaps_itself(out):  # torch refuses it; under Triton which write lands is undefined
        raise InputError("out rows share memory (an expanded buffer?); pass a separate buffer")
    if overlaps(out, like):  # torch refuses it; the Triton kernel would read rows it wrote
        raise InputError(
            f"out overlaps {like_name} in memory; the gather cannot run in place, pass a "
            "separate buffer"
        )


def apply_rebatch(
    hidden: torch.Tensor,
    info: RebatchInfo,
    *,
    backend: Backend = "auto",
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Move rows as ``info`` says: [T, H] -> [E * C, H], zero rows for padding.

    Use it to rebatch several tensors with one plan (e.g. hidden states and residuals).
    ``out`` is an optional preallocated [E * C, H] buffer of hidden's dtype and device.
    A ``hidden`` that requires grad (grad mode on) takes torch's differentiable gather
    whatever the backend, and refuses ``out``.
    """
    require_tensor(hidden, "hidden")
    check_info(info)
    if hidden.ndim != 2 or hidden.shape[0] != info.num_tokens:
        raise InputError(
            f"hidden must be [T, H] with T={info.num_tokens} (the plan's tokens), "
            f"got shape {tuple(hidden.shape)}"
        )
    shape = (info.padded_rows, hidden.shape[1])
    _check_out(out, shape, hidden, "hidden")
    index = info.checked_index("slot_to_token", hidden.device)
    triton_path = _use_triton(hidden, backend, out)  # checks the name on every path
    if _differentiable(hidden, out):
        if info.num_tokens == 0:  # no row 0 to read for the padding: zeros, still linked
            return hidden.sum() * 0 + hidden.new_zeros(shape)
        padding = (index < 0).unsqueeze(1)
        return hidden.index_select(0, index.clamp(min=0)).masked_fill(padding, 0)
    if triton_path:
        return kernels.gather_rows(hidden.contiguous(), index, out, check_index=False)

    if out is None:
        out = torch.empty(shape, dtype=hidden.dtype, device=hidden.device)
    if info.num_tokens == 0:
        bit_view(out).zero_()
        return out
    # One gather for every slot (padding slots read row 0), then one fill of the padding
    # rows: far cheaper than zero-filling all of out first, and a single parallel op
    # rather than one per device (each costs a thread wake-up on a busy machine).
    # Rows move as bits (bit_view): exact, and fp8 too, which CPU torch cannot index.
    padding, bits = index < 0, bit_view(out)
    torch.index_select(bit_view(hidden), 0, index.masked_fill(padding, 0), out=bits)
    if info.padded_rows > info.num_tokens:
        bits.index_fill_(0, padding.nonzero().squeeze(1), 0)
    return out


def rebatch(
    hidden: torch.Tensor,
    devices: torch.Tensor,
    ep_size: int,
    *,
    chunk_rows: int | None = None,
    backend: Backend = "auto",
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, RebatchInfo]:
    """Group the rows of ``hidden`` by destination device, padded to equal chunks.

    Args:
        hidden: [T, H] rows in their original order.
        devices: [T] integer destination device of each row, in [0, ep_size).
        ep_size: E.
        chunk_rows: rows per device chunk, default the largest group (see module docstring).
        backend: "auto" (Triton kernel on floating CUDA tensors when triton imports, else torch),
            "triton" or "torch".
        out: optional preallocated [E * C, H] output.

    Returns:
        shuffled: [E * C, H]; chunk d = rows ``[d*C, (d+1)*C)`` holds device d's rows in
            original order followed by zero padding.
        info: the :class:`RebatchInfo` that :func:`resume` needs.
    """
    require_tensor(hidden, "hidden")
    if hidden.ndim != 2:
        raise InputError(f"hidden must be [T, H], got shape {tuple(hidden.shape)}")
    devices = as_tensor(devices, "devices")
    if devices.ndim != 1 or devices.shape[0] != hidden.shape[0]:
        raise InputError(
            f"devices must be [T] with T={hidden.shape[0]} (rows of hidden), "
            f"got shape {tuple(devices.shape)}"
        )
    info = plan_rebatch(devices.to(hidden.device), ep_size, chunk_rows)
    return apply_rebatch(hidden, info, backend=backend, out=out), info


def resume(
    shuffled: torch.Tensor,
    info: RebatchInfo,
    *,
    backend: Backend = "auto",
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Invert :func:`rebatch`: [E * C, H] -> [T, H] in the original row order.

    ``out`` is an optional preallocated [T, H] buffer of shuffled's dtype and device.
    Tensors that require grad are handled as in :func:`apply_rebatch`.
    """
    require_tensor(shuffled, "shuffled")
    check_info(info)
    if shuffled.ndim != 2 or shuffled.shape[0] != info.padded_rows:
        raise InputError(
            f"shuffled must be [E*C, H] with E*C={info.padded_rows} "
            f"(E={info.ep_size}, C={info.chunk_rows}), got shape {tuple(shuffled.shape)}"
        )
    shape = (info.num_tokens, shuffled.shape[1])
    _check_out(out, shape, shuffled, "shuffled")
    index = info.checked_index("token_to_slot", shuffled.device)
    differentiable = _differentiable(shuffled, out)  # refuses out= with grad, either path
    if _use_triton(shuffled, backend, out) and not differentiable:
        return kernels.gather_rows(shuffled.contiguous(), index, out, check_index=False)
    if differentiable:
        return shuffled.index_select(0, index)
    if out is None:
        out = torch.empty(shape, dtype=shuffled.dtype, device=shuffled.device)
    torch.index_select(bit_view(shuffled), 0, index, out=bit_view(out))  # as in apply_rebatch
    return out

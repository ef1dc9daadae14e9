"""A bundle's tables on a torch device, and the online device choice of Algorithm 2.

Speculative MoE (paper 000, §B.2, Algorithm 2 line 36) decides online, per token, which
device a token is shuffled to before a layer's gate, by table look-up only::

    devids = cond(T_p[B] > A_p[B], T[B], A[B])

with T / T_p the token -> device table and its confidence, and A / A_p the n-gram table
indexed by the devices of the token's top-1 experts at the n previous layers. DESIGN.md
fixes the tie rule: the n-gram table is used only where its confidence is *strictly*
higher than the token table's. Optionally a per-batch capacity bounds how many tokens a
device receives (``lar_balanced`` in DESIGN.md "Metrics"): the most confident tokens keep
their device, and the overflow fills the devices with room -- first the device the other
table predicted for the token (its second choice, when it has room), then the least-loaded.

The three steps are public functions that take numpy arrays or torch tensors alike, so
the evaluator scores plans with exactly the code the runtime runs:

- :func:`ngram_row_index`   devices of the previous layers' top-1 experts -> n-gram row
  (defined with the bundle format, :mod:`planner.export.bundle`)
- :func:`online_choice`     token vs n-gram table, whichever is more confident
  (:func:`online_candidates` also returns the other table's prediction, the second choice)
- :func:`assign_with_capacity` and :func:`balanced_capacity`   the capacity rule

Memory: tables stay int16 / float16 on the device (indexing an int16 table with an int64
index is fine in torch); only per-call results are widened to int64. DeepSeek-V3's shape
(58 layers, V = 129280, E = 32, n = 2) takes 58 * (129280 + 1024) * 4 B + 2 * 58 * 256 * 2 B
~= 30.3 MB of device memory.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
import torch

from planner._checks import is_integer, is_real
from planner.errors import InfeasibleError, InputError
from planner.export.bundle import (
    MANIFEST_FILE,
    TENSORS,
    Bundle,
    expected_shapes,
    header_problems,
    load_bundle_arrays,
    ngram_row_index,
)
from planner.runtime_shim._data import (
    MAX_EP_SIZE,
    as_tensor,
    holds_integers,
    out_of_range,
    require_data,
)

DEFAULT_SLACK = 1.1  # DESIGN.md balanced LAR: at most ceil(1.1 * B / E) tokens per device


# ---------------------------------------------------------------------------------------
# Numpy-or-torch helpers: numpy inputs run through torch on the CPU (zero-copy) and come
# back as numpy, so there is one implementation of each rule.


def _as_tensor(x: Any, name: str) -> tuple[torch.Tensor, bool]:
    """(``x`` as a tensor, whether the result goes back as numpy: it came as an array)."""
    return as_tensor(x, name), not isinstance(x, torch.Tensor)


def _back(x: torch.Tensor, to_numpy: bool) -> Any:
    return x.numpy() if to_numpy else x


def balanced_capacity(batch_tokens: int, ep_size: int, slack: float = DEFAULT_SLACK) -> int:
    """Most tokens one device may receive from a batch: ``ceil(slack * B / E)``.

    Computed in exact rational arithmetic (``1.1 * 80 / 8`` is 11, not 12).
    """
    if (
        not (is_integer(batch_tokens) and is_integer(ep_size) and is_real(slack))
        or batch_tokens < 0
        or ep_size <= 0
        or not 1 <= slack < math.inf
    ):
        raise InputError(
            "balanced_capacity needs integers batch_tokens >= 0 and ep_size > 0 and a finite "
            f"slack >= 1; got {batch_tokens!r}, {ep_size!r}, {slack!r}"
        )
    return math.ceil(Fraction(str(slack)) * int(batch_tokens) / int(ep_size))


def online_choice(
    token_device: Any, token_confidence: Any, ngram_device: Any, ngram_confidence: Any
) -> tuple[Any, Any]:
    """Algorithm 2's choice: the n-gram prediction where strictly more confident.

    All arguments have the same shape [...]. Returns (device [...] int64, confidence
    [...] float32 of the chosen table).
    """
    return online_candidates(token_device, token_confidence, ngram_device, ngram_confidence)[:2]


def online_candidates(
    token_device: Any, token_confidence: Any, ngram_device: Any, ngram_confidence: Any
) -> tuple[Any, Any, Any, Any]:
    """:func:`online_choice` plus the table not chosen: the token's second choice.

    Returns (device, confidence, second_device, second_confidence); the second choice is
    the other table's device and confidence, or -1 where it names the same device (or no
    device: an n-gram device < 0 marks layers without an n-gram prediction, and an n-gram
    entry of confidence 0 predicts nothing, as in the table a plan without n-gram tables
    exports).
    """
    td, to_np = _as_tensor(token_device, "token_device")
    tc, _ = _as_tensor(token_confidence, "token_confidence")
    nd, _ = _as_tensor(ngram_device, "ngram_device")
    nc, _ = _as_tensor(ngram_confidence, "ngram_confidence")
    if not td.shape == tc.shape == nd.shape == nc.shape:  # no broadcasting: [T] vs [T, 1]
        shapes = ", ".join(str(list(x.shape)) for x in (td, tc, nd, nc))
        raise InputError(
            "token_device, token_confidence, ngram_device and ngram_confidence must have "
            f"the same shape, got {shapes}"
        )
    for ids, name in ((td, "token_device"), (nd, "ngram_device")):  # (as_tensor: data held)
        if not holds_integers(ids):
            raise InputError(f"{name} ids must be integers, got {ids.dtype}")
    bad = out_of_range(td, 0, 2**63 - 1)
    if bad is None:
        bad = out_of_range(nd, -1, 2**63 - 1)
    if bad is not None:
        why = "is negative (only an n-gram device may be -1: none)" if bad < 0 else "is past int64"
        raise InputError(f"device id {bad} {why}")
    _check_confidence(tc, "token_confidence")
    _check_confidence(nc, "ngram_confidence")
    td, nd, tc, nc = td.to(torch.int64), nd.to(torch.int64), _ranked(tc), _ranked(nc)
    use_ngram = (nc > tc) & (nd >= 0) & (nc > 0)  # confidence 0 predicts nothing
    device = torch.where(use_ngram, nd, td)
    confidence = torch.where(use_ngram, nc, tc).float()
    second = torch.where(use_ngram, td, torch.where(nc > 0, nd, -1))
    second = torch.where(second == device, -1, second)
    second_conf = torch.where(use_ngram, tc, nc).float()
    return tuple(_back(x, to_np) for x in (device, confidence, second, second_conf))


def assign_with_capacity(
    device: Any,
    confidence: Any,
    capacity: int,
    num_devices: int,
    second: Any = None,
    second_confidence: Any = None,
) -> Any:
    """Bound each device's tokens per row; the most confident keep their device.

    Each row of ``device`` is one batch. Within a row, a device's tokens are ranked by
    confidence (descending; ties by position, earlier first) and the first ``capacity``
    keep their device. The overflow then fills the devices with room:

    1. with ``second`` given, each overflowing token whose second choice (>= 0) still has
       room goes there; a device's free slots go to the tokens naming it with the highest
       ``second_confidence`` (ties by position);
    2. the rest, most confident first, each go to the device with the fewest tokens so far
       that still has room (ties: lower device id), which is the same as handing out the
       free slots in order of (load, device).

    Args:
        device: [T] or [R, T] int device ids in [0, num_devices).
        confidence: same shape, numbers; NaN is refused (it has no place in the order),
            +inf / -inf rank above / below every finite confidence.
        capacity: C, most tokens per device and row; needs T <= C * num_devices.
        num_devices: E.
        second: optional, same shape: each token's second-choice device, -1 for none
            (:func:`online_candidates` gives it).
        second_confidence: same shape as ``second`` (required with it).

    Returns:
        [T] or [R, T] int64 devices (numpy in, numpy out), each device holding <= C
        tokens per row; unchanged where no device overflows.
    """
    dev, to_np = _as_tensor(device, "device")  # (as_tensor refuses meta tensors)
    conf, _ = _as_tensor(confidence, "confidence")
    if dev.shape != conf.shape or dev.dim() not in (1, 2):
        raise InputError(
            f"device and confidence must both be [T] or [R, T]; got {list(dev.shape)} and "
            f"{list(conf.shape)}"
        )
    if (
        not (is_integer(num_devices) and is_integer(capacity))
        or not 0 < num_devices <= MAX_EP_SIZE
        or capacity < 0
    ):
        raise InputError(
            f"need integers 0 < num_devices <= {MAX_EP_SIZE} and capacity >= 0, got "
            f"{num_devices!r} and {capacity!r}"
        )
    # a capacity of a whole row never binds (and a huge one would overflow int64 below)
    e, c = int(num_devices), min(int(capacity), int(dev.shape[-1]))
    _check_device_ids(dev, e, "device")
    _check_confidence(conf, "confidence")
    alt = alt_conf = None
    if (second is None) != (second_confidence is None):
        raise InputError("second and second_confidence go together")
    if second is not None:
        alt, _ = _as_tensor(second, "second")
        alt_conf, _ = _as_tensor(second_confidence, "second_confidence")
        if alt.shape != dev.shape or alt_conf.shape != dev.shape:
            raise InputError(
                f"second and second_confidence must have the shape of device "
                f"{list(dev.shape)}; got {list(alt.shape)} and {list(alt_conf.shape)}"
            )
        _check_device_ids(alt, e, "second", allow_none=True)
        _check_confidence(alt_conf, "second_confidence")
        alt, alt_conf = alt.to(torch.int64), _ranked(alt_conf)
    squeeze = dev.dim() == 1
    if squeeze:
        dev, conf = dev[None], conf[None]
        if alt is not None:
            assert alt_conf is not None  # checked above: they go together
            alt, alt_conf = alt[None], alt_conf[None]
    t = dev.shape[1]
    if t > c * e:
        raise InfeasibleError(
            f"{t} tokens cannot fit {e} devices x capacity {c}; raise the capacity to at "
            f"least {math.ceil(t / e)}"
        )
    out = _assign_rows(dev.to(torch.int64), _ranked(conf), c, e, alt, alt_conf)
    return _back(out[0] if squeeze else out, to_np)


def _ranked(confidence: torch.Tensor) -> torch.Tensor:
    """Confidences to rank and compare: float64 and integers of 4 bytes or more as float64
    (float32 would make ties of values closer than its precision, and ties go by
    position), the narrower types as float32, which holds them exactly."""
    wide = confidence.dtype == torch.float64 or (
        not confidence.dtype.is_floating_point and confidence.element_size() >= 4
    )
    return confidence.double() if wide else confidence.float()


def _check_device_ids(dev: torch.Tensor, e: int, name: str, allow_none: bool = False) -> None:
    if not holds_integers(dev):
        raise InputError(f"{name} ids must be integers, got {dev.dtype}")
    lo_ok = -1 if allow_none else 0
    bad = out_of_range(dev, lo_ok, e)
    if bad is not None:
        raise InputError(f"{name} id {bad} outside [{lo_ok}, {e})")


def _check_confidence(conf: torch.Tensor, name: str) -> None:
    """InputError if ``conf`` holds a NaN: the descending sort put it after every number
    (a NaN-confident token silently lost its device first). +-inf order as numbers do."""
    if conf.dtype.is_complex:
        raise InputError(f"{name} must hold real numbers, got {conf.dtype}")
    count = int(torch.isnan(conf).sum()) if conf.dtype.is_floating_point else 0
    if count:
        raise InputError(
            f"{name} holds {count} NaN value(s) of {conf.numel()}; confidences must be "
            "numbers (a NaN has no rank; +-inf are allowed)"
        )


def _rank_in_groups(group: torch.Tensor, by_conf: torch.Tensor, num_groups: int) -> torch.Tensor:
    """Rank of each element within its group in the order ``by_conf`` (a permutation:
    confidence descending, ties by position)."""
    order = by_conf[torch.argsort(group[by_conf], stable=True)]  # by group, then confidence
    counts = torch.bincount(group, minlength=num_groups)
    starts = torch.cumsum(counts, 0) - counts
    rank = torch.empty_like(group)
    rank[order] = torch.arange(group.numel(), device=group.device) - starts[group[order]]
    return rank


def _assign_rows(
    dev: torch.Tensor,
    conf: torch.Tensor,
    c: int,
    e: int,
    alt: torch.Tensor | None = None,
    alt_conf: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`assign_with_capacity` on validated [R, T] int64 / float tensors."""
    rows, t = dev.shape
    torch_dev = dev.device
    row = torch.arange(rows, device=torch_dev).repeat_interleave(t)
    group = row * e + dev.reshape(-1)  # (row, device) pair of every token, [R*T]
    # Tokens by confidence, descending; a stable sort keeps row-major order on ties.
    by_conf = torch.argsort(-conf.reshape(-1), stable=True)
    keep = _rank_in_groups(group, by_conf, rows * e) < c
    out = dev.reshape(-1).clone()
    if bool(keep.all()):
        return out.reshape(rows, t)
    kept = torch.bincount(group[keep], minlength=rows * e)

    # 1. Overflow tokens to their second choice where it has room.
    if alt is not None:
        assert alt_conf is not None  # the caller passes both or neither
        alt_flat = alt.reshape(-1)
        cand = torch.nonzero(~keep & (alt_flat >= 0)).flatten()
        if cand.numel():
            alt_group = row[cand] * e + alt_flat[cand]
            by_alt_conf = torch.argsort(-alt_conf.reshape(-1)[cand], stable=True)
            rank = _rank_in_groups(alt_group, by_alt_conf, rows * e)
            taken = cand[rank < (c - kept)[alt_group]]
            out[taken] = alt_flat[taken]
            keep[taken] = True
            kept += torch.bincount(row[taken] * e + alt_flat[taken], minlength=rows * e)
        if bool(keep.all()):
            return out.reshape(rows, t)

    # 2. The rest of each row, most confident first, to the least-loaded devices.
    over = by_conf[~keep[by_conf]]
    over = over[torch.argsort(row[over], stable=True)]
    over_counts = torch.bincount(row[over], minlength=rows)
    over_rank = torch.arange(over.numel(), device=torch_dev) - (
        torch.cumsum(over_counts, 0) - over_counts
    ).repeat_interleave(over_counts)

    # Free slots (row, device, load level) in order of (row, load, device). A row takes its
    # first m (its overflow) of them, so no device offers it more than m: the slots past
    # those lie behind m of the same device's already, and capping keeps the work to the
    # overflow, not capacity x devices (a loose capacity with one token over was gigabytes).
    free = torch.minimum(c - kept, over_counts.repeat_interleave(e))
    slot_group = torch.arange(rows * e, device=torch_dev).repeat_interleave(free)
    slot_starts = torch.cumsum(free, 0) - free
    within = torch.arange(slot_group.numel(), device=torch_dev) - slot_starts[slot_group]
    level = kept[slot_group] + within  # tokens already on that device when the slot is used
    slot_row, slot_dev = slot_group // e, slot_group % e
    slot_order = torch.argsort((slot_row * c + level) * e + slot_dev)
    row_free = free.reshape(rows, e).sum(1)
    row_slot_start = torch.cumsum(row_free, 0) - row_free
    chosen = slot_order[row_slot_start[row[over]] + over_rank]
    out[over] = slot_dev[chosen]
    return out.reshape(rows, t)


# ---------------------------------------------------------------------------------------
# The runtime view of a bundle


@dataclass(frozen=True, eq=False)
class PlanTables:
    """A bundle's tables as torch tensors on one device (int16 / float16, as stored).

    Attributes:
        expert_to_device: [L, N] int16.
        expert_permutation: [L, N] int16, slot s (on device s // (N/E)) -> logical expert.
        token_to_device: [L, V] int16.
        token_confidence: [L, V] float16.
        ngram_to_device: [L, E**n] int16.
        ngram_confidence: [L, E**n] float16.
        ep_size: E.
        ngram_order: n.
        num_layers: L (MoE layers).
        num_experts: N.
        vocab_size: V.
        manifest: the bundle's manifest.json as a dict.
    """

    expert_to_device: torch.Tensor
    expert_permutation: torch.Tensor
    token_to_device: torch.Tensor
    token_confidence: torch.Tensor
    ngram_to_device: torch.Tensor
    ngram_confidence: torch.Tensor
    ep_size: int
    ngram_order: int
    num_layers: int
    num_experts: int
    vocab_size: int
    manifest: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        """Shapes, dtypes and devices of tables built by hand (:func:`load_bundle` and
        :meth:`from_bundle` pass validated bundles). Only metadata is read, so no host sync;
        the tables' values are checked by :func:`planner.export.bundle.verify_bundle`."""
        for name in ("ep_size", "ngram_order", "num_layers", "num_experts", "vocab_size"):
            value = getattr(self, name)
            if not is_integer(value) or int(value) < 1:
                raise InputError(f"PlanTables: {name}={value!r} must be a positive integer")
        e, n = int(self.ep_size), int(self.ngram_order)  # numpy integers as Python ints
        problems = header_problems(self, e, n)  # E divides N; E**n columns within the limit
        if problems:
            raise InputError(f"PlanTables: {problems[0]}")
        shapes = expected_shapes(self, e, n)
        device = None
        for name, (dtype, _) in TENSORS.items():
            t = getattr(self, name)
            if not isinstance(t, torch.Tensor):
                raise InputError(
                    f"PlanTables: {name} must be a torch.Tensor, got {type(t).__name__}"
                )
            require_data(t, f"PlanTables.{name}")
            want_dtype = torch.int16 if dtype.kind == "i" else torch.float16
            if t.dtype != want_dtype:
                raise InputError(f"PlanTables: {name} is {t.dtype}, expected {want_dtype}")
            want = shapes[name]
            if tuple(t.shape) != want:
                raise InputError(
                    f"PlanTables: {name} has shape {list(t.shape)}, expected {list(want)}"
                )
            if device is not None and t.device != device:
                raise InputError(f"PlanTables: {name} is on {t.device}, the others on {device}")
            device = t.device

    @classmethod
    def from_bundle(
        cls,
        bundle: Bundle,
        device: torch.device | str | None = None,
        manifest: dict[str, Any] | None = None,
    ) -> PlanTables:
        """Tables of an in-memory bundle on ``device`` (``manifest`` defaults to its own)."""
        tensors = {
            name: _to_device(torch.from_numpy(np.array(arr, copy=True)), device)
            for name, arr in bundle.tables().items()
        }
        return cls(
            **tensors,
            ep_size=bundle.ep_size,
            ngram_order=bundle.ngram_order,
            num_layers=bundle.meta.num_layers,
            num_experts=bundle.meta.num_experts,
            vocab_size=bundle.meta.vocab_size,
            manifest=manifest if manifest is not None else bundle.manifest(),
        )

    @property
    def device(self) -> torch.device:
        return self.token_to_device.device

    def to(self, device: torch.device | str) -> PlanTables:
        """The same tables on another device."""
        moved = {name: _to_device(getattr(self, name), device) for name in TENSORS}
        return PlanTables(
            **moved,
            ep_size=self.ep_size,
            ngram_order=self.ngram_order,
            num_layers=self.num_layers,
            num_experts=self.num_experts,
            vocab_size=self.vocab_size,
            manifest=self.manifest,
        )

    def route(
        self,
        token_ids: torch.Tensor,
        layer: int,
        prev_top1_experts: torch.Tensor | None = None,
        max_tokens_per_device: int | None = None,
        *,
        validate: bool = True,
    ) -> torch.Tensor:
        """Device each token is sent to before MoE layer ``layer``'s gate (Algorithm 2).

        Args:
            token_ids: [T] int token ids in [0, V). Id -1 is refused, unlike in the
                evaluator: a trace marks an unknown token id with -1 (DESIGN.md, trace
                schema v1), and :func:`planner.evaluate.metrics.evaluate_bundle` sends such
                a token to its vanilla device (its request's contiguous chunk, from its
                position) with token confidence 0, the n-gram table still able to overrule.
                DESIGN.md says nothing of -1 at run time, and ``route`` does not know a
                token's position in its request, so a caller with unknown ids places them
                itself (route the known ones, and put the rest where the evaluator does).
            layer: MoE layer index in [0, L).
            prev_top1_experts: [T, n] logical top-1 experts of each token at MoE layers
                l-n .. l-1 (most recent last), or None. Used only when ``layer >= n``;
                otherwise (or when None) the token table alone decides.
            max_tokens_per_device: optional capacity C over these T tokens (see
                :func:`assign_with_capacity`; :func:`balanced_capacity` gives DESIGN.md's).
            validate: check id ranges (costs a host sync on an accelerator). With
                ``validate=False`` ids are used as torch indices, unchecked: an id of -1
                reads the last row (token V-1) on the CPU, and an id past the table is an
                index error there or undefined behaviour in a CUDA kernel; pass it only for
                ids already known to lie in range.

        Returns:
            [T] int64 device ids in [0, E), on the tables' device.
        """
        dev, conf, second, second_conf = self.candidates(
            token_ids, layer, prev_top1_experts, validate=validate
        )
        if max_tokens_per_device is None:
            return dev
        return assign_with_capacity(
            dev, conf, max_tokens_per_device, self.ep_size, second, second_conf
        )

    def choose(
        self,
        token_ids: torch.Tensor,
        layer: int,
        prev_top1_experts: torch.Tensor | None = None,
        *,
        validate: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`route` without capacity: (device [T] int64, confidence [T] float32)."""
        return self.candidates(token_ids, layer, prev_top1_experts, validate=validate)[:2]

    def candidates(
        self,
        token_ids: torch.Tensor,
        layer: int,
        prev_top1_experts: torch.Tensor | None = None,
        *,
        validate: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """:meth:`choose` plus each token's second choice (see :func:`online_candidates`).

        Returns (device, confidence, second_device, second_confidence), all [T]; the
        second device is -1 where there is none (no n-gram prediction, or the same device).
        """
        ids = self._check_route_args(token_ids, layer, prev_top1_experts, validate)
        token_dev = self.token_to_device[layer][ids].to(torch.int64)
        token_conf = self.token_confidence[layer][ids].float()
        n = self.ngram_order
        if prev_top1_experts is None or layer < n:
            none = torch.full_like(token_dev, -1)
            return token_dev, token_conf, none, torch.zeros_like(token_conf)
        prev = prev_top1_experts.to(device=self.device, dtype=torch.int64)
        # Device of each previous layer's top-1 expert: expert_to_device[l-n+j, prev[:, j]].
        prev_layers = torch.arange(layer - n, layer, device=self.device)
        prev_dev = self.expert_to_device[prev_layers[None, :], prev]
        row = ngram_row_index(prev_dev, self.ep_size)
        return online_candidates(
            token_dev,
            token_conf,
            self.ngram_to_device[layer][row],
            self.ngram_confidence[layer][row],
        )

    def _check_route_args(
        self,
        token_ids: torch.Tensor,
        layer: int,
        prev: torch.Tensor | None,
        validate: bool,
    ) -> torch.Tensor:
        if not is_integer(layer) or not 0 <= layer < self.num_layers:
            raise InputError(f"layer={layer!r} outside [0, {self.num_layers}) MoE layers")
        if not isinstance(token_ids, torch.Tensor) or token_ids.dim() != 1:
            raise InputError("token_ids must be a 1-D integer tensor [T]")
        if not holds_integers(token_ids):
            raise InputError(f"token_ids must hold integers, got {token_ids.dtype}")
        require_data(token_ids, "token_ids")
        ids = token_ids.to(device=self.device, dtype=torch.int64)
        if prev is not None:
            want = (token_ids.shape[0], self.ngram_order)
            if not isinstance(prev, torch.Tensor) or tuple(prev.shape) != want:
                got = list(prev.shape) if isinstance(prev, torch.Tensor) else type(prev).__name__
                raise InputError(f"prev_top1_experts must be [T, n] = {list(want)}, got {got}")
            if not holds_integers(prev):
                raise InputError(f"prev_top1_experts must hold integers, got {prev.dtype}")
            require_data(prev, "prev_top1_experts")
        if validate and ids.numel():
            bad = out_of_range(ids, 0, self.vocab_size, token_ids.dtype)
            if bad is not None:
                raise InputError(f"token id {bad} outside [0, {self.vocab_size}) (vocab_size)")
            bad = None if prev is None else out_of_range(prev, 0, self.num_experts)
            if bad is not None:
                raise InputError(
                    f"prev_top1_experts holds expert {bad}, outside [0, {self.num_experts})"
                )
        return ids


def _to_device(x: torch.Tensor, device: torch.device | str | None) -> torch.Tensor:
    """``x.to(device)``; a device this torch cannot use (no CUDA build, a bad name, 'meta')
    is one InputError line rather than torch's AssertionError or RuntimeError."""
    try:
        moved = x.to(device)
    except (AssertionError, RuntimeError) as e:
        raise InputError(f"cannot put the plan tables on device {device!r}: {e}") from None
    if moved.device.type == "meta":  # a shape without values: every look-up would fail
        raise InputError(f"cannot put the plan tables on device {device!r}: it holds no data")
    return moved


def load_bundle(path: str | os.PathLike, device: torch.device | str | None = None) -> PlanTables:
    """Read and validate the bundle at ``path`` (see :func:`load_bundle_arrays`) onto ``device``."""
    bundle = load_bundle_arrays(path)  # InputError for None or an int, not Path()'s TypeError
    manifest = json.loads((Path(path) / MANIFEST_FILE).read_text())  # as validated above
    return PlanTables.from_bundle(bundle, device, manifest)

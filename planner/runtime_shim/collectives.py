"""Shuffled reduce-scatter (SRS) and shuffled all-gather (SAG) over torch.distributed.

Speculative MoE §3.1 / §4 (a) and Sem-MoE §3.4 (Attention-TP): after a tensor-parallel
attention block every rank holds a partial sum ``x_r`` [T, H] of the same T tokens, which
the default deployment all-reduces. SRS replaces that all-reduce: it rebatches the rows by
predicted device (see :mod:`planner.runtime_shim.rebatch`) and reduce-scatters, so rank
``d`` receives the *full sum* of exactly the tokens routed to device ``d`` -- the tokens
then start the MoE layer where most of their experts live. SAG is the inverse after the
MoE layer: every rank contributes its chunk, all ranks all-gather, and the rows are put
back into the original token order.

Ranks and devices: device ``d`` of the plan is rank ``d`` of ``group``; the group's size
must equal the EP size. Every rank must pass the same ``devices`` (the tables are the same
everywhere, so the lookup agrees); ``verify_devices=True`` checks it with two 3-element
all-reduces.

Which collective runs (``method="auto"``):

=========  ============================================  ==================================
backend    SRS                                            SAG
=========  ============================================  ==================================
nccl       reduce_scatter_single (reduce_scatter_tensor)  all_gather_single (into_tensor)
gloo       reduce_scatter_single -- present in torch      all_gather_single
           2.13's gloo; where a gloo build lacks it, the
           all-reduce fallback below is used
other      native when supported, else fallback          native, else list all_gather
=========  ============================================  ==================================

Fallback ("all_reduce"): all-reduce the whole shuffled matrix and keep this rank's chunk --
correct everywhere, but a ring all-reduce moves twice the data of a reduce-scatter
(Speculative MoE §3.2: 2(G-1)BS/G vs (G-1)BS/G), which is the saving SRS exists for.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.distributed as dist

from planner.errors import InputError, MismatchError
from planner.runtime_shim._data import as_tensor, require_tensor
from planner.runtime_shim.rebatch import (
    Backend,
    RebatchInfo,
    apply_rebatch,
    check_info,
    plan_rebatch,
    resume,
)

Method = Literal["auto", "reduce_scatter", "all_reduce"]

# Newer torch renamed the tensor-in/tensor-out collectives (*_single); accept both names.
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

# Backend names (e.g. "gloo") on which the native reduce-scatter raised "unsupported".
_NO_NATIVE_REDUCE_SCATTER: set[str] = set()
_NO_NATIVE_ALL_GATHER: set[str] = set()


def _unsupported(err: Exception) -> bool:
    text = str(err).lower()
    return isinstance(err, NotImplementedError) or "not support" in text or "unsupported" in text


def _refuse_grad(x: torch.Tensor, name: str, what: str) -> None:
    """The collectives write into buffers and have no backward: with autograd recording,
    SRS gave each rank only its own chunk's gradient and SAG failed inside torch."""
    if x.requires_grad and torch.is_grad_enabled():
        raise InputError(
            f"{name} requires grad but {what} has no backward; call it under "
            f"torch.no_grad() or torch.inference_mode(), or pass {name}.detach()"
        )


def _group_shape(group) -> tuple[int, int]:
    if not dist.is_available() or not dist.is_initialized():
        raise InputError("torch.distributed is not initialized; call init_process_group first")
    return dist.get_world_size(group), dist.get_rank(group)


# A prime below 2**31: products of a residue and a small device id fit in int64.
_HASH_PRIME = 2**31 - 1


def _verify_same_devices(devices: torch.Tensor, group) -> None:
    """Raise MismatchError unless every rank passed the same ``devices``.

    Compares the length and two hashes ``sum_i (d_i + 1) r_i mod P`` with pseudo-random
    weights ``r`` drawn from one fixed seed (the same on every rank): two different device
    lists agree on both with probability about 1/P**2 (plain or position-weighted sums miss
    swaps such as [0, 1, 1, 0] against [1, 0, 0, 1]).
    """
    d = devices.to(torch.int64).reshape(-1)
    generator = torch.Generator().manual_seed(0x5EED)
    weights = torch.randint(1, _HASH_PRIME, (2, d.numel()), generator=generator)
    hashes = ((d + 1) * weights.to(d.device) % _HASH_PRIME).sum(dim=1) % _HASH_PRIME
    probe = torch.cat([torch.tensor([d.numel()], device=d.device), hashes])
    lo, hi = probe.clone(), probe.clone()
    dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=group)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=group)
    if not torch.equal(lo, hi):
        raise MismatchError(
            "ranks passed different `devices` to shuffled_reduce_scatter "
            f"(length/hashes range from {lo.tolist()} to {hi.tolist()}); every rank must "
            "route the same token ids with the same tables"
        )


def shuffled_reduce_scatter(
    x: torch.Tensor,
    devices: torch.Tensor,
    group=None,
    *,
    chunk_rows: int | None = None,
    method: Method = "auto",
    backend: Backend = "auto",
    verify_devices: bool = False,
) -> tuple[torch.Tensor, RebatchInfo]:
    """Sum the ranks' partial ``x`` and give rank d the rows of the tokens routed to device d.

    Args:
        x: [T, H] this rank's partial sum of the T tokens' hidden states (no autograd:
            a tensor that requires grad is refused while grad mode is on).
        devices: [T] integer device of each token, in [0, world size), same on every rank.
        group: process group (default: the world); its size is the EP size E.
        chunk_rows: rows per chunk C, default the largest device group (see rebatch).
        method: "auto", "reduce_scatter" (native only) or "all_reduce" (fallback).
        backend: row-movement backend passed to the rebatch ("auto", "triton", "torch").
        verify_devices: check (two tiny all-reduces) that all ranks passed the same devices.

    Returns:
        local_rows: [C, H]; rows ``[0, info.counts[rank])`` are the summed rows of this
            rank's tokens in original order (``info.chunk_tokens(rank)`` names them), the
            rest zero padding.
        info: the plan, needed by :func:`shuffled_all_gather`.
    """
    if method not in ("auto", "reduce_scatter", "all_reduce"):
        raise InputError(f"method must be auto, reduce_scatter or all_reduce, got {method!r}")
    require_tensor(x, "x")
    _refuse_grad(x, "x", "shuffled_reduce_scatter")
    world, rank = _group_shape(group)
    if x.ndim != 2:
        raise InputError(f"x must be [T, H], got shape {tuple(x.shape)}")
    devices = as_tensor(devices, "devices").to(x.device)
    if devices.ndim != 1 or devices.shape[0] != x.shape[0]:
        raise InputError(
            f"devices must be [T] with T={x.shape[0]}, got shape {tuple(devices.shape)}"
        )
    if verify_devices:
        _verify_same_devices(devices, group)
    if x.dtype not in _GLOO_DTYPES and _backend_for(x, group) == "gloo":
        raise InputError(
            f"gloo cannot sum {x.dtype} rows; reduce the partial sums in bf16 or fp32 (or "
            "int32, int64) and cast after"
        )
    info = plan_rebatch(devices, world, chunk_rows)
    c = info.chunk_rows
    local = torch.empty((c, x.shape[1]), dtype=x.dtype, device=x.device)
    if c == 0:  # no tokens on any rank (devices agree): nothing to reduce
        return local, info
    shuffled = apply_rebatch(x, info, backend=backend)

    name = str(dist.get_backend(group))
    native = method == "reduce_scatter" or (
        method == "auto" and name not in _NO_NATIVE_REDUCE_SCATTER
    )
    if native:
        try:
            _reduce_scatter_single(local, shuffled, group=group)
            return local, info
        except (RuntimeError, NotImplementedError) as err:
            # Support is a property of the backend, so every rank takes this branch alike.
            if method == "reduce_scatter" or not _unsupported(err):
                raise
            _NO_NATIVE_REDUCE_SCATTER.add(name)
    dist.all_reduce(shuffled, group=group)
    local.copy_(shuffled[rank * c : (rank + 1) * c])
    return local, info


def _backend_for(x: torch.Tensor, group) -> str:
    """The backend that carries ``x``'s device type in ``group``: a group may name one
    ("gloo"), one per device type ("cpu:gloo,cuda:nccl", the default on a CUDA build), or
    none ("undefined", when ``init_process_group`` was given no backend: gloo for CPU
    tensors, nccl for CUDA ones)."""
    name = str(dist.get_backend(group))
    if ":" in name:
        pairs = dict(part.split(":", 1) for part in name.split(",") if ":" in part)
        return pairs.get(x.device.type, name)
    if name == "undefined":
        return "gloo" if x.device.type == "cpu" else "nccl"
    return name


# The dtypes gloo sums and sends; it has no fp8, int16, uint16, uint32 or uint64.
_GLOO_DTYPES = frozenset(
    {torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8,
     torch.int32, torch.int64, torch.bool}
)  # fmt: skip


def _wire(x: torch.Tensor) -> torch.Tensor:
    """``x`` (contiguous rows) as the all-gather sends it: a dtype gloo has as it is, any
    other (fp8, int16, the wide unsigned) as its bytes, [R, H * size] uint8 (the gather
    moves rows, not sums, so that is exact on every backend)."""
    return x if x.dtype in _GLOO_DTYPES else x.view(torch.uint8)


def shuffled_all_gather(
    local_rows: torch.Tensor,
    info: RebatchInfo,
    group=None,
    *,
    backend: Backend = "auto",
) -> torch.Tensor:
    """Inverse of :func:`shuffled_reduce_scatter`: every rank gets all T rows in original order.

    Args:
        local_rows: [C, H] this rank's chunk (its tokens' rows, then padding; padding rows
            are dropped whatever they hold); no autograd, as for SRS.
        info: the plan returned by :func:`shuffled_reduce_scatter` (same on every rank).
        group: the same process group.
        backend: row-movement backend for the resume.

    Returns:
        x: [T, H], row t the chunk row of token t from the rank it was sent to.
    """
    require_tensor(local_rows, "local_rows")
    check_info(info)
    _refuse_grad(local_rows, "local_rows", "shuffled_all_gather")
    world, _ = _group_shape(group)
    if world != info.ep_size:
        raise MismatchError(f"group has {world} ranks but the plan has ep_size {info.ep_size}")
    if local_rows.ndim != 2 or local_rows.shape[0] != info.chunk_rows:
        raise InputError(
            f"local_rows must be [C, H] with C={info.chunk_rows}, "
            f"got shape {tuple(local_rows.shape)}"
        )
    local_rows = local_rows.contiguous()
    if info.chunk_rows == 0:
        return local_rows.new_empty((info.num_tokens, local_rows.shape[1]))
    gathered = torch.empty(
        (info.padded_rows, local_rows.shape[1]), dtype=local_rows.dtype, device=local_rows.device
    )
    name = str(dist.get_backend(group))
    done = False
    bits_out, bits_in = _wire(gathered), _wire(local_rows)
    if name not in _NO_NATIVE_ALL_GATHER:
        try:
            _all_gather_single(bits_out, bits_in, group=group)
            done = True
        except (RuntimeError, NotImplementedError) as err:
            if not _unsupported(err):
                raise
            _NO_NATIVE_ALL_GATHER.add(name)
    if not done:
        dist.all_gather(list(bits_out.chunk(world)), bits_in, group=group)
    return resume(gathered, info.to(local_rows.device), backend=backend)

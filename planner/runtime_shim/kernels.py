"""Triton row-gather kernel behind one validating wrapper (GPU data movement of the shim).

Rebatching tokens by destination device and resuming them to their original order are both
the same operation, a row gather ``out[i] = src[index[i]]``, with ``index[i] = -1`` meaning
"padding: write a zero row" (Speculative MoE §4 (a), App. B.2 Algorithm 2 lines 37-41 and
45-46). One kernel therefore serves both directions; :mod:`planner.runtime_shim.rebatch`
computes the indices.

The kernel is private; :func:`gather_rows` checks shape, dtype, device and contiguity,
allocates the output and launches. Under ``TRITON_INTERPRET=1`` (set before triton is
imported) the kernel runs on CPU tensors in Triton's interpreter, which the tests use.
"""

from __future__ import annotations

import os

import torch

from planner._checks import is_integer
from planner.errors import InputError
from planner.runtime_shim._data import (
    bit_view,
    overlaps,
    overlaps_itself,
    require_tensor,
)

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU-only install: the torch path in rebatch.py is used instead
    triton = None
    tl = None

HAS_TRITON = triton is not None


def _interpreting() -> bool:
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


# Whether the kernel below was built for Triton's CPU interpreter. Triton decides this when
# the @triton.jit decorator runs, i.e. when this module is imported.
INTERPRETED = HAS_TRITON and _interpreting()

# Elements moved by one program. Large blocks keep the launch grid small (and the
# interpreter, which runs programs one by one, fast enough for tests).
DEFAULT_BLOCK_COLS = 1024
DEFAULT_BLOCK_ELEMS = 8192

if HAS_TRITON:

    @triton.jit
    def _gather_rows_kernel(
        src_ptr,  # [S, H] rows to read; row stride src_row_stride, column stride 1
        index_ptr,  # [R] int64: source row of each output row, -1 for a zero (padding) row
        out_ptr,  # [R, H] output; row stride out_row_stride, column stride 1
        num_out_rows,  # R
        hidden,  # H
        src_row_stride,  # elements between consecutive rows of src
        out_row_stride,  # elements between consecutive rows of out
        BLOCK_ROWS: tl.constexpr,  # output rows per program (grid axis 0)
        BLOCK_COLS: tl.constexpr,  # columns per program (grid axis 1), a power of two
    ):
        rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        cols = tl.program_id(1) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
        row_ok = rows < num_out_rows
        col_ok = cols < hidden
        # 64-bit offsets: S * H can exceed 2**31 elements for long batches with wide rows.
        src_rows = tl.load(index_ptr + rows, mask=row_ok, other=-1).to(tl.int64)
        read_ok = (row_ok & (src_rows >= 0))[:, None] & col_ok[None, :]
        values = tl.load(
            src_ptr + src_rows[:, None] * src_row_stride + cols[None, :], mask=read_ok, other=0
        )
        out_offsets = rows.to(tl.int64)[:, None] * out_row_stride + cols[None, :]
        tl.store(out_ptr + out_offsets, values, mask=row_ok[:, None] & col_ok[None, :])


def _power_of_two(n: object) -> bool:
    return is_integer(n) and n > 0 and not n & (n - 1)  # type: ignore[operator]


def launch_tile(
    hidden: int, block_rows: int | None = None, block_cols: int | None = None
) -> tuple[int, int]:
    """(rows, columns) per program of :func:`gather_rows` for rows of ``hidden`` >= 1
    elements: the given ones, checked to be powers of two, or the defaults (columns up to
    :data:`DEFAULT_BLOCK_COLS`, :data:`DEFAULT_BLOCK_ELEMS` elements a program)."""
    if block_cols is None:
        block_cols = min(DEFAULT_BLOCK_COLS, 1 << (hidden - 1).bit_length())  # next power of 2
    if not _power_of_two(block_cols):
        raise InputError(f"block_cols must be a power of two, got {block_cols!r}")
    if block_rows is None:
        block_rows = max(1, DEFAULT_BLOCK_ELEMS // block_cols)
    if not _power_of_two(block_rows):
        raise InputError(f"block_rows must be a power of two, got {block_rows!r}")
    return block_rows, block_cols


def launch_grid(num_rows: int, hidden: int, block_rows: int, block_cols: int) -> tuple[int, int]:
    """The kernel's launch grid: programs along the rows, then along the columns.

    Plain integer ceilings: ``triton.cdiv`` on the host costs microseconds a call, a sizeable
    share of a 90 us gather (benchmarks/RESULTS.md, the GPU paragraph).
    """
    return -(-num_rows // block_rows), -(-hidden // block_cols)


def gather_rows(
    src: torch.Tensor,
    index: torch.Tensor,
    out: torch.Tensor | None = None,
    *,
    check_index: bool = True,
    block_rows: int | None = None,
    block_cols: int | None = None,
) -> torch.Tensor:
    """Row gather on the Triton kernel: ``out[i] = src[index[i]]``, zeros where ``index[i] < 0``.

    Args:
        src: [S, H] floating tensor (fp8 to fp64; the kernel moves each element's bits),
            rows contiguous (column stride 1).
        index: [R] int64 on the same device; entries in [-1, S), -1 marks padding.
        out: optional [R, H] tensor of src's dtype and device, rows contiguous, to write into.
        check_index: verify the index range (one device sync). Callers that built the
            index themselves (the rebatch plan) pass False: a GPU out-of-range read would
            otherwise be silent.
        block_rows, block_cols: override the launch tiling (tests use large blocks so the
            interpreter runs few programs); ``block_cols`` must be a power of two.

    Returns:
        out: [R, H].

    Raises:
        InputError: triton is missing, a tensor has the wrong shape, dtype, device or layout,
            ``out`` overlaps ``src``, or ``src`` requires grad (grad mode on).
    """
    if not HAS_TRITON:
        raise InputError("gather_rows needs triton, which is not importable; use backend='torch'")
    require_tensor(src, "src")
    require_tensor(index, "index")
    if src.ndim != 2:
        raise InputError(f"src must be [S, H], got shape {tuple(src.shape)}")
    if src.requires_grad and torch.is_grad_enabled():
        raise InputError(
            "src requires grad but the Triton gather has no backward; use rebatch / resume "
            "(they take torch's differentiable gather), or call it under torch.no_grad()"
        )
    if index.ndim != 1 or index.dtype != torch.int64:
        raise InputError(
            f"index must be a 1-D int64 tensor, got shape {tuple(index.shape)} dtype {index.dtype}"
        )
    if not src.is_floating_point():
        raise InputError(f"src must be a floating tensor, got dtype {src.dtype}")
    if index.device != src.device:
        raise InputError(f"index is on {index.device} but src is on {src.device}")
    if src.device.type != "cuda" and not INTERPRETED:
        raise InputError(
            f"the Triton kernel needs CUDA tensors (got {src.device}); "
            "use backend='torch', or set TRITON_INTERPRET=1 before importing triton"
        )
    if src.shape[1] > 1 and src.stride(1) != 1:
        raise InputError("src rows must be contiguous (column stride 1); call .contiguous()")
    if not index.is_contiguous():
        raise InputError("index must be contiguous; call .contiguous()")
    num_rows, hidden = index.shape[0], src.shape[1]
    if check_index and num_rows > 0:
        lo, hi = (int(v) for v in index.aminmax())
        if lo < -1 or hi >= src.shape[0]:
            bad = lo if lo < -1 else hi
            raise InputError(f"index value {bad} outside [-1, {src.shape[0]}) (rows of src)")
    if out is None:
        out = torch.empty((num_rows, hidden), dtype=src.dtype, device=src.device)
    elif out.shape != (num_rows, hidden) or out.dtype != src.dtype or out.device != src.device:
        raise InputError(
            f"out must be {(num_rows, hidden)} {src.dtype} on {src.device}, "
            f"got {tuple(out.shape)} {out.dtype} on {out.device}"
        )
    elif hidden > 1 and out.stride(1) != 1:
        raise InputError("out rows must be contiguous (column stride 1)")
    elif overlaps_itself(out):  # rows aliasing one another: which write lands is undefined
        raise InputError("out rows share memory (an expanded buffer?); pass a separate buffer")
    elif overlaps(out, src):  # programs would read rows that others already overwrote
        raise InputError("out overlaps src in memory; pass a separate buffer")
    if num_rows == 0 or hidden == 0:
        return out

    block_rows, block_cols = launch_tile(hidden, block_rows, block_cols)
    grid = launch_grid(num_rows, hidden, block_rows, block_cols)
    _gather_rows_kernel[grid](
        bit_view(src),  # bits, not floats: fp8 as well as fp32 (see bit_view)
        index,
        bit_view(out),
        num_rows,
        hidden,
        src.stride(0),
        out.stride(0),
        BLOCK_ROWS=block_rows,
        BLOCK_COLS=block_cols,
    )
    return out

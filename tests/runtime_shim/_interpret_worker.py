"""Check the Triton row-gather kernel in Triton's CPU interpreter; run by test_kernels.py.

Usage: ``python tests/runtime_shim/_interpret_worker.py OUT.json``. TRITON_INTERPRET must
be set before triton is imported (triton decides interpreted vs compiled when ``@triton.jit``
runs), so this runs in its own process rather than inside pytest, where another test may
already have imported the kernel module. Writes {case name: "ok" or a failure message}.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import json  # noqa: E402
import sys  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

from planner.runtime_shim import kernels  # noqa: E402
from planner.runtime_shim.rebatch import rebatch, resume  # noqa: E402

# Large blocks: the interpreter runs one program at a time, so few programs keep it fast;
# still smaller than the sizes below so row and column masks are exercised.
BLOCK_ROWS, BLOCK_COLS = 16, 8
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def devices_for(kind: str, tokens: int, ep: int, g: torch.Generator) -> torch.Tensor:
    if kind == "random":
        return torch.randint(0, ep, (tokens,), generator=g)
    if kind == "empty_groups":  # devices 1 and ep-1 get nothing
        return torch.randint(0, 2, (tokens,), generator=g) * 2
    if kind == "one_device_all":
        return torch.full((tokens,), ep - 1)
    raise ValueError(kind)


def check_rebatch(dtype_name: str, kind: str, tokens: int, hidden: int, ep: int) -> None:
    dtype = DTYPES[dtype_name]
    g = torch.Generator().manual_seed(tokens * 31 + hidden)
    x = torch.randn((tokens, hidden), generator=g).to(dtype)
    devices = devices_for(kind, tokens, ep, g)
    want, info = rebatch(x, devices, ep, backend="torch")
    got, info_t = rebatch(x, devices, ep, backend="triton")
    assert got.dtype == dtype and got.shape == want.shape
    assert torch.equal(got, want), "triton rebatch differs from torch rebatch"
    assert torch.equal(info_t.slot_to_token, info.slot_to_token)
    back = resume(got, info_t, backend="triton")
    assert torch.equal(back, x), "triton resume(rebatch(x)) != x"


def check_gather_direct(dtype_name: str) -> None:
    """Direct wrapper call with explicit small blocks: masks on both axes, -1 rows, out=."""
    dtype = DTYPES[dtype_name]
    g = torch.Generator().manual_seed(7)
    src = torch.randn((37, 13), generator=g).to(dtype)
    index = torch.randint(-1, 37, (45,), generator=g)
    want = torch.where((index >= 0)[:, None], src[index.clamp(min=0)], torch.zeros((), dtype=dtype))
    got = kernels.gather_rows(src, index, block_rows=BLOCK_ROWS, block_cols=BLOCK_COLS)
    assert torch.equal(got, want), "gather_rows differs from torch indexing"
    out = torch.full((45, 13), 5.0, dtype=dtype)
    kernels.gather_rows(src, index, out, block_rows=BLOCK_ROWS, block_cols=BLOCK_COLS)
    assert torch.equal(out, want), "gather_rows(out=...) differs"
    # A source with padded row stride (a column slice of a wider matrix).
    wide = torch.randn((37, 20), generator=g).to(dtype)
    got = kernels.gather_rows(wide[:, :13], index, block_rows=BLOCK_ROWS, block_cols=BLOCK_COLS)
    sliced = wide[:, :13]
    want = torch.where(
        (index >= 0)[:, None], sliced[index.clamp(min=0)], torch.zeros((), dtype=dtype)
    )
    assert torch.equal(got, want), "gather_rows with a row stride != H differs"


CASES = {}
for _dt in DTYPES:
    CASES[f"direct_{_dt}"] = (check_gather_direct, (_dt,))
    # T not a multiple of any block, H odd and wider than one column block of the default.
    CASES[f"random_{_dt}"] = (check_rebatch, (_dt, "random", 203, 1029, 4))
    CASES[f"empty_groups_{_dt}"] = (check_rebatch, (_dt, "empty_groups", 301, 7, 4))
    CASES[f"one_device_all_{_dt}"] = (check_rebatch, (_dt, "one_device_all", 97, 5, 8))
CASES["single_row_fp32"] = (check_rebatch, ("fp32", "random", 1, 3, 2))


def check_fp8(dtype: torch.dtype) -> None:
    """fp8 rows (fp8 dispatch, as DeepSeek-V3 serving uses): the interpreter cannot load fp8
    as floats, so the kernel moves bits; compared bit for bit (CPU torch has no fp8 equal)."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn((203, 37), generator=g).to(dtype)
    devices = torch.randint(0, 4, (203,), generator=g)
    want, info = rebatch(x, devices, 4, backend="torch")
    got, info_t = rebatch(x, devices, 4, backend="triton")
    assert got.dtype == dtype and torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    back = resume(got, info_t, backend="triton")
    assert back.dtype == dtype and torch.equal(back.view(torch.uint8), x.view(torch.uint8))
    index = torch.randint(-1, 203, (45,), generator=g)
    got = kernels.gather_rows(x, index, block_rows=BLOCK_ROWS, block_cols=BLOCK_COLS)
    bits = x.view(torch.uint8)
    zero = torch.zeros((), dtype=torch.uint8)
    assert torch.equal(
        got.view(torch.uint8), torch.where((index >= 0)[:, None], bits[index.clamp(min=0)], zero)
    )


CASES["fp8_e4m3"] = (check_fp8, (torch.float8_e4m3fn,))
CASES["fp8_e5m2"] = (check_fp8, (torch.float8_e5m2,))


def check_validation() -> None:
    from planner.errors import InputError

    src = torch.zeros((4, 3))
    # what -> (call, a fragment of the message it must give: any InputError passed before,
    # so an earlier check firing for another reason went unnoticed)
    bad_calls = {
        "index out of range": (
            lambda: kernels.gather_rows(src, torch.tensor([0, 4])),
            "index value 4 outside [-1, 4)",
        ),
        "index below -1": (
            lambda: kernels.gather_rows(src, torch.tensor([-2])),
            "index value -2 outside [-1, 4)",
        ),
        "int32 index": (
            lambda: kernels.gather_rows(src, torch.tensor([0], dtype=torch.int32)),
            "index must be a 1-D int64 tensor",
        ),
        "strided columns": (
            lambda: kernels.gather_rows(src.t(), torch.tensor([0])),
            "src rows must be contiguous",
        ),
        "wrong out shape": (
            lambda: kernels.gather_rows(src, torch.tensor([0]), torch.zeros(2, 3)),
            "out must be (1, 3)",
        ),
        "block not power of two": (
            lambda: kernels.gather_rows(src, torch.tensor([0]), block_cols=6),
            "block_cols must be a power of two",
        ),
        # out overlapping src: programs read rows others already overwrote (silently wrong
        # with several programs; on a GPU they run in parallel)
        "out is src": (
            lambda: kernels.gather_rows(src, torch.tensor([3, 2, 1, 0]), src),
            "out overlaps src in memory",
        ),
        "out inside src": (
            lambda: kernels.gather_rows(src, torch.tensor([3, 2]), src[1:3]),
            "out overlaps src in memory",
        ),
        "rebatch into hidden": (
            lambda: rebatch(src, torch.tensor([1, 0, 1, 0]), 2, out=src),
            "out overlaps hidden in memory",
        ),
        # rows of out aliasing one another (expanded): every row held the last one written
        "expanded out": (
            lambda: kernels.gather_rows(
                src, torch.tensor([0, 1, 2]), torch.zeros(1, 3).expand(3, 3)
            ),
            "out rows share memory",
        ),
        # not tensors: AttributeError ('requires_grad', 'ndim') before
        "numpy src": (
            lambda: kernels.gather_rows(src.numpy(), torch.tensor([0])),
            "src must be a torch.Tensor, got ndarray",
        ),
        "list index": (
            lambda: kernels.gather_rows(src, [0]),
            "index must be a torch.Tensor, got list",
        ),
        # the kernel has no backward: the result silently had no grad_fn
        "src requires grad": (
            lambda: kernels.gather_rows(torch.zeros((4, 3), requires_grad=True), torch.tensor([0])),
            "src requires grad but the Triton gather has no backward",
        ),
    }
    for what, (call, fragment) in bad_calls.items():
        try:
            call()
        except InputError as e:
            if fragment not in str(e):
                raise AssertionError(f"{what}: {e!s} (expected {fragment!r})") from None
            continue
        raise AssertionError(f"{what}: no InputError")


CASES["validation"] = (check_validation, ())


def main(out_path: str) -> None:
    assert kernels.INTERPRETED, "TRITON_INTERPRET did not take effect"
    results = {}
    for name, (fn, args) in CASES.items():
        try:
            fn(*args)
            results[name] = "ok"
        except Exception:
            results[name] = traceback.format_exc(limit=4)
    with open(out_path, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    import planner

    repo = Path(__file__).resolve().parents[2]  # this checkout, not another installed copy
    if not Path(planner.__file__).resolve().is_relative_to(repo):
        sys.exit(f"worker imported planner from {planner.__file__}, not from {repo}")
    main(sys.argv[1])

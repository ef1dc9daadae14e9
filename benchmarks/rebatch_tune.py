"""Tile sizes and warps of the Triton row gather on a CUDA GPU; JSON out.

Times ``planner.runtime_shim.kernels`` ``_gather_rows_kernel`` on the rebatch's own index
(16384 tokens x 4096 hidden, EP 8, bf16 and fp32 by default) for each (rows per program,
columns per program, warps), and reports each one's GB/s (bytes read plus written, the
index reads included, as ``rebatch_speed.py`` counts them) beside a device-to-device
``copy_`` of the same tensor: the kernel alone, where
``benchmarks/rebatch_speed.py`` times the public wrapper, whose host-side checks count at
this size. On an H200 (2026-11-28, four runs; nominal memory bandwidth 4.81 TB/s, ``copy_``
3.60-3.78 TB/s in bf16 and 3.88-4.02 in fp32) the default tile (8 x 1024, 4 warps) moved
2.75-3.11 TB/s in bf16 and 3.15-3.52 in fp32; the best tile of each run 3.16-3.20 and
3.54-3.62 (no one tile best in every run). Moving bf16 rows as int64 words instead of
2-byte elements gained under 3% at the best tiles, so the kernel moves elements. (Those
figures left the index reads out: at most 0.05% fewer bytes at this shape.)

    python benchmarks/rebatch_tune.py [--tokens 16384] [--hidden 4096] [--ep 8] [--dtypes bf16,fp32]
"""

from __future__ import annotations

import itertools

import torch
from _common import (  # (benchmarks/ is on sys.path when run as a script)
    ArgumentParser,
    add_gather_shape,
    choice_list,
    emit_json,
    gather_bytes,
    run,
    time_cuda,
)

from planner.runtime_shim import kernels
from planner.runtime_shim.rebatch import plan_rebatch

REPEATS = 50  # timed calls per configuration (median)
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}


def main(argv=None) -> int:
    ap = ArgumentParser(__doc__)
    add_gather_shape(ap)
    ap.add_argument(
        "--dtypes", type=choice_list(DTYPES), default=["bf16", "fp32"],
        help=f"comma-separated, of {', '.join(DTYPES)} (default bf16,fp32)",
    )  # fmt: skip
    args = ap.parse_args(argv)
    if not (torch.cuda.is_available() and kernels.HAS_TRITON) or kernels.INTERPRETED:
        raise SystemExit("rebatch_tune needs a CUDA GPU and Triton (not the interpreter)")
    g = torch.Generator(device="cuda").manual_seed(0)
    devices = torch.randint(0, args.ep, (args.tokens,), device="cuda", generator=g)
    report: dict = {"tokens": args.tokens, "hidden": args.hidden, "ep_size": args.ep,
                    "device": torch.cuda.get_device_name(0), "results": {}}  # fmt: skip
    for name in args.dtypes:
        x = torch.randn((args.tokens, args.hidden), device="cuda", generator=g).to(DTYPES[name])
        report["results"][name] = sweep(x, plan_rebatch(devices, args.ep))
    emit_json(report, None)
    return 0


def sweep(x: torch.Tensor, info) -> dict:
    """Every configuration's GB/s gathering ``x`` [T, H] by ``info``'s index, best first."""
    tokens, hidden = x.shape
    index = info.slot_to_token
    out = torch.empty((info.padded_rows, hidden), device="cuda", dtype=x.dtype)
    # as rebatch_speed counts it: rows read (padding is not), rows written, the index read
    moved = gather_bytes(tokens, info.padded_rows, hidden, x.element_size())
    copy_dst = torch.empty_like(x)
    copy_ms = time_cuda(lambda: copy_dst.copy_(x), REPEATS)
    rows: dict = {"copy_gbs": round(2 * x.numel() * x.element_size() / copy_ms / 1e6, 1)}
    src, dst = kernels.bit_view(x), kernels.bit_view(out)
    configs = []
    for block_rows, block_cols, warps in itertools.product(
        (1, 2, 4, 8, 16), (512, 1024, 2048, 4096), (4, 8, 16)
    ):
        if block_rows * block_cols > 65536 or block_cols > 2 * hidden:
            continue
        grid = kernels.launch_grid(info.padded_rows, hidden, block_rows, block_cols)

        def launch(br=block_rows, bc=block_cols, w=warps, grid=grid):
            kernels._gather_rows_kernel[grid](
                src, index, dst, info.padded_rows, hidden, x.stride(0), out.stride(0),
                BLOCK_ROWS=br, BLOCK_COLS=bc, num_warps=w,
            )  # fmt: skip

        ms = time_cuda(launch, REPEATS)
        configs.append({"block_rows": block_rows, "block_cols": block_cols, "warps": warps,
                        "ms": round(ms, 4), "gbs": round(moved / ms / 1e6, 1)})  # fmt: skip
    configs.sort(key=lambda c: -c["gbs"])
    rows["best"] = configs[:8]
    rows["all"] = configs
    tile = kernels.launch_tile(hidden)
    # gather_rows launches with Triton's default of 4 warps
    rows["default"] = [
        c for c in configs if (c["block_rows"], c["block_cols"]) == tile and c["warps"] == 4
    ]
    return rows


if __name__ == "__main__":
    run(main)

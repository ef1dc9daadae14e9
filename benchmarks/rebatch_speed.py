"""Rebatch / resume speed: CPU torch path vs one index_select, and the Triton kernel's GB/s.

Usage: ``python benchmarks/rebatch_speed.py [--tokens 16384] [--hidden 4096] [--ep 8]
[--repeats 7] [--dtypes bf16,fp32] [--threads N]``.
Prints one JSON object. CPU numbers are medians over ``--repeats`` runs after a warm-up,
timed two ways: allocating outputs on every call (what a plain ``x.index_select`` does),
and writing into preallocated buffers (what a runtime that reuses buffers does). The
reference is one ``index_select`` of the same [T, H] tensor with a random permutation, in
the same allocation mode. ``rebatch`` includes computing the plan (sort, index maps).

On CUDA the Triton row gather is timed with CUDA events; its bandwidth counts the bytes
read plus the bytes written, and is printed beside the device's peak memory bandwidth
(from its memory clock and bus width when torch reports them) and a measured
device-to-device ``copy_`` bandwidth.
"""

from __future__ import annotations

import os
import platform
import statistics
import time

import torch
from _common import (  # (benchmarks/ is on sys.path when run as a script)
    ArgumentParser,
    add_gather_shape,
    choice_list,
    emit_json,
    gather_bytes,
    positive_int,
    run,
    time_cuda,
)

from planner.runtime_shim import kernels
from planner.runtime_shim.rebatch import apply_rebatch, plan_rebatch, rebatch, resume

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def median_ms(fn, repeats: int, sync=lambda: None) -> float:
    fn()
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def cpu_case(tokens: int, hidden: int, ep: int, dtype: torch.dtype, repeats: int) -> dict:
    g = torch.Generator().manual_seed(0)
    x = torch.randn((tokens, hidden), generator=g).to(dtype)
    devices = torch.randint(0, ep, (tokens,), generator=g)
    perm = torch.randperm(tokens, generator=g)
    info = plan_rebatch(devices, ep)
    shuffled = apply_rebatch(x, info)
    buf_sel = torch.empty_like(x)
    buf_rebatch = torch.empty_like(shuffled)
    buf_resume = torch.empty_like(x)

    r = {
        "plan_ms": median_ms(lambda: plan_rebatch(devices, ep), repeats),
        "index_select_ms": median_ms(lambda: x.index_select(0, perm), repeats),
        "rebatch_ms": median_ms(lambda: rebatch(x, devices, ep), repeats),
        "resume_ms": median_ms(lambda: resume(shuffled, info), repeats),
        "index_select_prealloc_ms": median_ms(
            lambda: torch.index_select(x, 0, perm, out=buf_sel), repeats
        ),
        "rebatch_prealloc_ms": median_ms(lambda: rebatch(x, devices, ep, out=buf_rebatch), repeats),
        "resume_prealloc_ms": median_ms(lambda: resume(shuffled, info, out=buf_resume), repeats),
        "padded_rows": info.padded_rows,
    }
    for mode in ("", "_prealloc"):
        ref = r[f"index_select{mode}_ms"]
        r[f"rebatch_ratio{mode}"] = r[f"rebatch{mode}_ms"] / ref
        r[f"resume_ratio{mode}"] = r[f"resume{mode}_ms"] / ref
        r[f"rebatch_plus_resume_ratio{mode}"] = (
            r[f"rebatch{mode}_ms"] + r[f"resume{mode}_ms"]
        ) / ref
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()}


def peak_bandwidth_gbs() -> float | None:
    props = torch.cuda.get_device_properties(0)
    clock_khz = getattr(props, "memory_clock_rate", None)
    bus_bits = getattr(props, "memory_bus_width", None)
    if not clock_khz or not bus_bits:
        return None
    return 2 * clock_khz * 1e3 * bus_bits / 8 / 1e9  # double data rate


def gpu_case(tokens: int, hidden: int, ep: int, dtype: torch.dtype, repeats: int) -> dict:
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn((tokens, hidden), device="cuda", generator=g).to(dtype)
    devices = torch.randint(0, ep, (tokens,), device="cuda", generator=g)
    info = plan_rebatch(devices, ep)
    shuffled = torch.empty((info.padded_rows, hidden), device="cuda", dtype=dtype)
    back = torch.empty_like(x)

    def timed(fn) -> float:
        return time_cuda(fn, repeats)

    elem = x.element_size()
    perm = torch.randperm(tokens, device="cuda")
    rebatch_ms = timed(
        lambda: kernels.gather_rows(x, info.slot_to_token, shuffled, check_index=False)
    )
    resume_ms = timed(
        lambda: kernels.gather_rows(shuffled, info.token_to_slot, back, check_index=False)
    )
    full_ms = timed(lambda: rebatch(x, devices, ep))  # plan + kernel, host syncs included
    torch_ms = timed(lambda: torch.index_select(x, 0, perm, out=back))
    copy_dst = torch.empty_like(x)
    copy_ms = timed(lambda: copy_dst.copy_(x))
    # Padding rows are written but not read; index reads are 8 bytes per written row.
    rebatch_bytes = gather_bytes(tokens, info.padded_rows, hidden, elem)
    resume_bytes = gather_bytes(tokens, tokens, hidden, elem)
    return {
        "rebatch_ms": round(rebatch_ms, 4),
        "resume_ms": round(resume_ms, 4),
        "rebatch_gbs": round(rebatch_bytes / rebatch_ms / 1e6, 1),
        "resume_gbs": round(resume_bytes / resume_ms / 1e6, 1),
        "rebatch_with_plan_ms": round(full_ms, 4),
        "torch_index_select_ms": round(torch_ms, 4),
        "torch_index_select_gbs": round(resume_bytes / torch_ms / 1e6, 1),
        "copy_gbs": round(2 * tokens * hidden * elem / copy_ms / 1e6, 1),
    }


def main() -> None:
    p = ArgumentParser(__doc__)
    add_gather_shape(p)
    p.add_argument(
        "--repeats", type=positive_int, default=7,
        help="timed runs a measurement (median; 3x on CUDA), at least 1 (default 7)",
    )  # fmt: skip
    p.add_argument(
        "--dtypes", type=choice_list(DTYPES), default=list(DTYPES),
        help=f"comma-separated, of {', '.join(DTYPES)} (default {','.join(DTYPES)})",
    )  # fmt: skip
    p.add_argument(
        "--threads", type=positive_int, default=None,
        help="torch CPU threads, at least 1 (default: torch's)",
    )  # fmt: skip
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtypes = args.dtypes

    result: dict = {
        "tokens": args.tokens,
        "hidden": args.hidden,
        "ep_size": args.ep,
        "torch": torch.__version__,
        "cpu": platform.processor() or platform.machine(),
        "cpu_threads": torch.get_num_threads(),
        # Other processes' load skews CPU timings (each parallel op waits for its threads).
        "load_average_1min": round(os.getloadavg()[0], 2),
        "target_ratio": 1.5,
        "cpu_results": {
            d: cpu_case(args.tokens, args.hidden, args.ep, DTYPES[d], args.repeats) for d in dtypes
        },
    }
    if torch.cuda.is_available() and kernels.HAS_TRITON:
        peak = peak_bandwidth_gbs()
        result["gpu"] = {
            "device": torch.cuda.get_device_name(0),
            "peak_memory_bandwidth_gbs": None if peak is None else round(peak, 1),
            "results": {
                d: gpu_case(args.tokens, args.hidden, args.ep, DTYPES[d], args.repeats * 3)
                for d in dtypes
            },
        }
    else:
        result["gpu"] = "skipped: no CUDA device (or triton missing); Triton GB/s not measured"
    emit_json(result)


if __name__ == "__main__":
    run(main)

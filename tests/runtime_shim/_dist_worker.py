"""Run SRS/SAG checks on a 4-rank gloo group; test_collectives.py starts this in a subprocess.

Usage: ``python tests/runtime_shim/_dist_worker.py OUT_DIR``. Each rank writes
``OUT_DIR/rank<r>.json`` mapping case name -> "ok" or a failure message. Inputs are
integer-valued floats so every sum is exact whatever order a collective adds in, and the
references are built independently of planner.runtime_shim.rebatch (a Python loop).
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 4
TIMEOUT_S = 30


def reference_chunks(total: torch.Tensor, devices: list[int], world: int, chunk_rows: int):
    """[world, C, H]: chunk d = rows of the tokens on device d in order, zero padded."""
    out = torch.zeros((world, chunk_rows, total.shape[1]), dtype=total.dtype)
    for d in range(world):
        rows = [t for t, dev in enumerate(devices) if dev == d]
        for i, t in enumerate(rows):
            out[d, i] = total[t]
    return out


def make_case(seed: int, tokens: int, hidden: int, devices: list[int] | None, dtype, rank: int):
    """Same devices on every rank (seeded); a different partial sum per rank."""
    g = torch.Generator().manual_seed(seed)
    if devices is None:
        devices = torch.randint(0, WORLD, (tokens,), generator=g).tolist()
    gr = torch.Generator().manual_seed(seed * 100 + rank)
    x = torch.randint(-8, 9, (tokens, hidden), generator=gr).to(dtype)
    return x, devices


CASES = {
    # name: (seed, T, H, devices or None for random, dtype, chunk_rows, method)
    "random_fp32": (1, 37, 5, None, torch.float32, None, "auto"),
    "empty_device_fp32": (2, 23, 7, [0, 1, 3] * 7 + [3, 0], torch.float32, None, "auto"),
    "one_device_gets_all": (3, 11, 4, [2] * 11, torch.float32, None, "auto"),
    "fixed_chunk_rows": (4, 19, 3, None, torch.float32, 16, "auto"),
    "bf16": (5, 29, 6, None, torch.bfloat16, None, "auto"),
    "all_reduce_fallback": (6, 31, 5, None, torch.float32, None, "all_reduce"),
    # Native only (raises if the backend lacks it): gloo in torch 2.13 has reduce_scatter.
    "native_reduce_scatter": (8, 17, 3, None, torch.float32, None, "reduce_scatter"),
    "single_token": (7, 1, 8, [1], torch.float32, None, "auto"),
}


def check_case(name: str, rank: int) -> None:
    from planner.runtime_shim.collectives import shuffled_all_gather, shuffled_reduce_scatter

    seed, tokens, hidden, devices, dtype, chunk_rows, method = CASES[name]
    x, devices = make_case(seed, tokens, hidden, devices, dtype, rank)
    total = x.clone()
    dist.all_reduce(total)  # the reference: plain all-reduce, then shuffle and chunk
    largest = max(devices.count(d) for d in range(WORLD))
    c = largest if chunk_rows is None else chunk_rows
    ref = reference_chunks(total, devices, WORLD, c)

    local, info = shuffled_reduce_scatter(
        x, torch.tensor(devices), chunk_rows=chunk_rows, method=method
    )
    assert local.shape == (c, hidden), f"SRS shape {tuple(local.shape)} != {(c, hidden)}"
    assert local.dtype == dtype
    assert torch.equal(local, ref[rank]), f"SRS rows differ on rank {rank}"
    assert info.counts.tolist() == [devices.count(d) for d in range(WORLD)]

    # SAG reference: all_gather the chunks, then undo the shuffle by a Python loop.
    contrib = local * (rank + 1)  # distinct per rank so a wrong source rank is caught
    parts = [torch.empty_like(contrib) for _ in range(WORLD)]
    dist.all_gather(parts, contrib)
    seen = [0] * WORLD
    want = torch.empty_like(x)
    for t, d in enumerate(devices):
        want[t] = parts[d][seen[d]]
        seen[d] += 1
    got = shuffled_all_gather(contrib, info)
    assert torch.equal(got, want), f"SAG rows differ on rank {rank}"
    # Round trip: SAG(SRS(x)) is the all-reduce.
    assert torch.equal(shuffled_all_gather(local, info), total), "SAG(SRS(x)) != all_reduce(x)"


def check_mismatch(rank: int) -> None:
    from planner.errors import MismatchError
    from planner.runtime_shim.collectives import shuffled_reduce_scatter

    # differs across ranks: in one token, then by a swap that keeps the length, the sum
    # and the position-weighted sum (0*a + 1*b + 2*b + 3*a is 3(a + b) either way)
    a, b = (0, 1) if rank % 2 == 0 else (1, 0)
    for devices in (torch.tensor([0, 1, 2, 3, rank % WORLD]), torch.tensor([a, b, b, a])):
        try:
            shuffled_reduce_scatter(torch.zeros(devices.numel(), 2), devices, verify_devices=True)
        except MismatchError:
            continue
        raise AssertionError(f"verify_devices=True did not raise MismatchError for {devices}")


def check_sag_as_bytes(rank: int) -> None:
    """SAG is pure data movement, so chunks of a dtype gloo lacks (fp8 combine, int16, the
    wide unsigned) gather bit for bit, as bytes; SRS, which sums, refuses them on gloo."""
    from planner.errors import InputError
    from planner.runtime_shim.collectives import shuffled_all_gather, shuffled_reduce_scatter
    from planner.runtime_shim.rebatch import plan_rebatch

    devices = [0, 2, 2, 1, 3, 0, 2, 1, 1, 0, 3]
    info = plan_rebatch(torch.tensor(devices), WORLD)
    for dtype in (torch.float8_e4m3fn, torch.int16, torch.uint16, torch.uint32, torch.uint64):
        g = torch.Generator().manual_seed(40 + rank)
        local = (torch.randn((info.chunk_rows, 5), generator=g) * 100).to(dtype)
        bits = local.view(torch.uint8)  # [C, 5 * size]
        parts = [torch.empty_like(bits) for _ in range(WORLD)]
        dist.all_gather(parts, bits)
        seen = [0] * WORLD
        want = torch.empty((len(devices), bits.shape[1]), dtype=torch.uint8)
        for t, d in enumerate(devices):
            want[t] = parts[d][seen[d]]
            seen[d] += 1
        got = shuffled_all_gather(local, info)
        assert got.dtype == dtype, (got.dtype, dtype)
        assert torch.equal(got.view(torch.uint8), want), f"{dtype} SAG rows differ on rank {rank}"
        # the reduce-scatter sums, which gloo cannot do in these: one line, before any
        # collective
        try:
            shuffled_reduce_scatter(local[:3], torch.tensor([0, 1, 2]))
        except InputError as e:
            assert f"gloo cannot sum {dtype} rows" in str(e), e
        else:
            raise AssertionError(f"{dtype} reduce-scatter on gloo: no InputError")


def run_rank(rank: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=WORLD,
        timeout=datetime.timedelta(seconds=TIMEOUT_S),
    )
    results: dict[str, str] = {}
    checks = [(name, lambda n=name: check_case(n, rank)) for name in CASES]
    checks.append(("verify_devices_mismatch", lambda: check_mismatch(rank)))
    checks.append(("sag_as_bytes", lambda: check_sag_as_bytes(rank)))
    for name, fn in checks:
        try:
            fn()
            results[name] = "ok"
        except Exception:
            results[name] = traceback.format_exc(limit=3)
        dist.barrier()
    dist.destroy_process_group()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    import planner

    repo = Path(__file__).resolve().parents[2]  # this checkout, not another installed copy
    if not Path(planner.__file__).resolve().is_relative_to(repo):
        sys.exit(f"worker imported planner from {planner.__file__}, not from {repo}")
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    # fork where available: the children reuse this fresh interpreter's torch import (no
    # torch work ran yet, so no thread pool is forked); spawn imports torch 4 more times
    # (about 3x slower on a 2-core machine).
    method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
    mp.start_processes(
        run_rank, args=(free_port(), sys.argv[1]), nprocs=WORLD, join=True, start_method=method
    )

"""Bundle size and I/O time at real model shapes; prints one JSON object.

Shapes (random tables of the right dtypes; sizes do not depend on the values):

- DeepSeek-V2: V = 102400, 60 layers (the paper's figure: 102400 * 60 * 2 B = 11.72 MiB
  for the int16 token table; the model itself has 59 MoE layers after its one dense
  layer), N = 160 routed experts, EP 8, n-gram order 2 -> 64 columns.
- DeepSeek-V3: V = 129280, 58 MoE layers (model layers 3..60), N = 256, EP 32, n = 2 ->
  1024 columns.

Times: ``save_s`` (save_bundle, incl. sha256 and atomic rename), ``load_verify_s``
(load_bundle_arrays: sha256, dtypes, shapes, ranges, capacities), ``verify_report_s``
(verify_bundle), ``load_torch_s`` (runtime_shim.load_bundle onto the CPU), and
``route_4096_us`` (PlanTables.route of 4096 tokens with n-gram history and the balanced
capacity, median of 20). Run: ``python benchmarks/bundle_size.py [--repeats 3] [--out FILE]``.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from _common import (  # (benchmarks/ is on sys.path when run as a script)
    ArgumentParser,
    add_out_option,
    emit_json,
    positive_int,
    run,
)

from planner.export import Bundle, load_bundle_arrays, save_bundle, verify_bundle
from planner.runtime_shim.tables import balanced_capacity, load_bundle
from planner.trace import TraceMeta

MIB = 1 << 20

SHAPES = {
    "deepseek-v2": dict(
        model="deepseek-ai/DeepSeek-V2", layers=60, experts=160, top_k=6, vocab=102400,
        ep=8, order=2, first_moe_layer=0,
    ),
    "deepseek-v3": dict(
        model="deepseek-ai/DeepSeek-V3", layers=58, experts=256, top_k=8, vocab=129280,
        ep=32, order=2, first_moe_layer=3,
    ),
}  # fmt: skip


def random_bundle(shape: dict, seed: int = 0) -> Bundle:
    rng = np.random.default_rng(seed)
    big_l, n, v, e, order = (shape[k] for k in ("layers", "experts", "vocab", "ep", "order"))
    meta = TraceMeta(
        model=shape["model"], num_layers=big_l, num_experts=n, top_k=shape["top_k"],
        vocab_size=v, moe_layer_indices=tuple(range(shape["first_moe_layer"],
                                                    shape["first_moe_layer"] + big_l)),
    )  # fmt: skip
    cols = e**order
    return Bundle.from_arrays(
        meta,
        ep_size=e,
        expert_to_device=np.stack([rng.permutation(n) % e for _ in range(big_l)]),
        token_to_device=rng.integers(0, e, (big_l, v), dtype=np.int16),
        token_confidence=rng.random((big_l, v), dtype=np.float32).astype(np.float16),
        ngram_to_device=rng.integers(0, e, (big_l, cols), dtype=np.int16),
        ngram_confidence=rng.random((big_l, cols), dtype=np.float32).astype(np.float16),
        ngram_order=order,
        method="random",
        seed=seed,
    )


def _best(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def measure(name: str, shape: dict, repeats: int, workdir: Path) -> dict:
    bundle = random_bundle(shape)
    path = workdir / name
    save_s = _best(lambda: save_bundle(bundle, path), repeats)
    load_verify_s = _best(lambda: load_bundle_arrays(path), repeats)
    verify_s = _best(lambda: verify_bundle(path), repeats)
    load_torch_s = _best(lambda: load_bundle(path, device="cpu"), repeats)

    tables = load_bundle(path)
    rng = np.random.default_rng(1)
    t = 4096
    ids = torch.from_numpy(rng.integers(0, shape["vocab"], t))
    prev = torch.from_numpy(rng.integers(0, shape["experts"], (t, shape["order"])))
    cap = balanced_capacity(t, shape["ep"])
    layer = shape["layers"] - 1
    route_times = []
    for _ in range(20):
        t0 = time.perf_counter()
        tables.route(ids, layer, prev, cap)
        route_times.append(time.perf_counter() - t0)

    files = {p.name: p.stat().st_size for p in path.iterdir()}
    tensors = {k: int(v.nbytes) for k, v in bundle.tables().items()}
    return {
        "shape": {k: shape[k] for k in ("layers", "experts", "vocab", "ep", "order")},
        "ngram_columns": shape["ep"] ** shape["order"],
        "token_table_bytes": tensors["token_to_device"],
        "token_table_mib": round(tensors["token_to_device"] / MIB, 3),
        "tensor_bytes": tensors,
        "bundle_bytes": sum(files.values()),
        "bundle_mib": round(sum(files.values()) / MIB, 3),
        "file_bytes": files,
        "save_s": round(save_s, 4),
        "load_verify_s": round(load_verify_s, 4),
        "verify_report_s": round(verify_s, 4),
        "load_torch_s": round(load_torch_s, 4),
        "route_4096_us": round(statistics.median(route_times) * 1e6, 1),
    }


def main() -> None:
    parser = ArgumentParser(__doc__)
    parser.add_argument(
        "--repeats", type=positive_int, default=3,
        help="time each step this many times and report the best, at least 1 (default 3)",
    )  # fmt: skip
    add_out_option(parser)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        results = {
            name: measure(name, shape, args.repeats, Path(tmp)) for name, shape in SHAPES.items()
        }
    results["_env"] = {"torch": torch.__version__, "numpy": np.__version__, "threads": 1}
    emit_json(results, args.out)


if __name__ == "__main__":
    run(main)

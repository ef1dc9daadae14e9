"""Time and peak memory of ``moeplan evaluate`` against held-out length; prints JSON.

Shape: DeepSeek-V3's routing (``planner.trace.synth``'s ``DEEPSEEK_V3`` preset: 58 MoE
layers, 256 experts, top-8, vocabulary 129280), one synthetic trace of the largest
``--tokens`` count, and a random EP 32 bundle with order-2 n-gram tables for it. Each length
is the trace's first ``T`` tokens, written as a trace of its own and evaluated in a fresh
child process, so that its peak RSS (VmHWM) is the evaluation's (``baseline_rss_mib``: the
child's peak before it, imports and the bundle).

Evaluation streams the trace in batches of 4096 tokens, so its time should grow linearly
with the held-out length: ``seconds_per_million_tokens`` says whether it does. ``compare``
evaluates every method's plan on the same trace, so it pays this once per method.

    python benchmarks/evaluate_speed.py [--tokens 250000,1000000] [--out FILE]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import (  # (benchmarks/ is on sys.path when run as a script)
    ArgumentParser,
    add_out_option,
    emit_json,
    int_list,
    peak_rss_mib,
    run,
)


def write_prefix(trace: Path, tokens: int, out: Path) -> None:
    """The first ``tokens`` tokens of ``trace`` as a trace of their own."""
    from planner.trace.io import TraceBatch, open_trace, write_trace

    full = open_trace(trace)
    batches, have = [], 0
    for batch in full.iter_batches(batch_rows=65536):
        batches.append(batch.select(slice(0, tokens - have)))
        have += len(batches[-1])
        if have >= tokens:
            break
    write_trace(out, full.meta, TraceBatch.concat(batches))


def child(held_out: str, bundle: str) -> dict:
    """Evaluate ``bundle`` on ``held_out`` (in this process)."""
    from planner.evaluate import evaluate_bundle
    from planner.export.bundle import load_bundle_arrays
    from planner.trace.io import open_trace

    loaded = load_bundle_arrays(bundle)
    held = open_trace(held_out)
    before = peak_rss_mib()
    t0 = time.perf_counter()
    report = evaluate_bundle(loaded, held)
    seconds = time.perf_counter() - t0
    return {
        "tokens": report["overall"]["tokens"],
        "seconds": round(seconds, 2),
        "seconds_per_million_tokens": round(seconds / report["overall"]["tokens"] * 1e6, 2),
        "peak_rss_mib": peak_rss_mib(),
        "baseline_rss_mib": before,
        "oracle_bound": report["overall"]["oracle_bound"],
    }


def main() -> None:
    ap = ArgumentParser(__doc__)
    ap.add_argument(
        "--tokens", type=int_list(least=1), default=[250_000, 1_000_000],
        help="comma-separated held-out lengths in tokens, each at least 1, measured in "
        "ascending order (default 250000,1000000)",
    )  # fmt: skip
    add_out_option(ap)
    ap.add_argument("--child", nargs=2, metavar=("HELD_OUT", "BUNDLE"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(*args.child)))
        return

    import numpy as np

    from planner.export.bundle import Bundle, save_bundle
    from planner.trace.io import open_trace
    from planner.trace.synth import DEEPSEEK_V3, synthesize

    lengths = sorted(args.tokens)
    with tempfile.TemporaryDirectory(prefix="evaluate-bench-") as tmp:
        trace = Path(tmp) / "trace"
        config = dataclasses.replace(
            DEEPSEEK_V3, num_tokens=lengths[-1], num_requests=max(lengths[-1] // 500, 2)
        )
        synthesize(config, trace)
        meta = open_trace(trace).meta
        rng = np.random.default_rng(0)
        big_l, n, v, e, order = meta.num_layers, meta.num_experts, meta.vocab_size, 32, 2
        bundle = Path(tmp) / "bundle"
        save_bundle(
            Bundle.from_arrays(
                meta,
                ep_size=e,
                ngram_order=order,
                expert_to_device=np.stack([rng.permutation(n) % e for _ in range(big_l)]),
                token_to_device=rng.integers(0, e, (big_l, v), dtype=np.int16),
                token_confidence=rng.random((big_l, v), dtype=np.float32).astype(np.float16),
                ngram_to_device=rng.integers(0, e, (big_l, e**order), dtype=np.int16),
                ngram_confidence=rng.random((big_l, e**order), dtype=np.float32).astype(np.float16),
            ),  # fmt: skip
            bundle,
        )
        runs = []
        for tokens in lengths:
            held_out = Path(tmp) / f"first-{tokens}"
            write_prefix(trace, tokens, held_out)
            out = subprocess.run(
                [sys.executable, __file__, "--child", str(held_out), str(bundle)],
                capture_output=True, text=True,
            )  # fmt: skip
            if out.returncode:
                sys.exit(f"evaluation of {tokens} tokens failed:\n{out.stderr}")
            runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    emit_json(
        {
            "shape": {"layers": big_l, "experts": n, "top_k": meta.top_k, "vocab": v, "ep": e},
            "runs": runs,
            "load_average": [round(x, 2) for x in os.getloadavg()],
        },
        args.out,
    )


if __name__ == "__main__":
    run(main)

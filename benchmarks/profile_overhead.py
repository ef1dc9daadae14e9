"""Cost of ``moeplan profile``'s routing hooks and trace writing over plain forward passes.

Loads a checkpoint once, then times, over the same prompts and batches (repeated, median):

* plain: forward passes of the decoder, no hooks;
* hooks: the same with router hooks and trace rows built (``ProfileSession.profile``);
* profiled: hooks plus writing the parts with ``TraceWriter`` (what ``moeplan profile`` does).

Prints JSON: tokens/s each way (``tokens_per_s_plain``, ``_hooks``, ``_profiled``, from
medians), overhead % of hooks (``overhead_hooks_pct``) and of hooks + writing
(``overhead_pct``) from medians, and the same from minimums, the least disturbed by other
processes (``overhead_hooks_pct_min``, ``overhead_pct_min``), and trace bytes per token.
Default model: ``examples/tiny_moe/model`` when it exists, else a tiny random qwen3_moe built
in a temporary directory. Default prompts: ``examples/prompts.jsonl`` when it exists, else
synthetic ones.

    python benchmarks/profile_overhead.py [--model DIR] [--prompts FILE] [--max-prompts N]
        [--max-length N] [--batch-size N] [--repeats N] [--threads N]
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from _common import (  # noqa: E402  (benchmarks/ is on sys.path when run as a script)
    ArgumentParser,
    emit_json,
    positive_int,
    run,
)

from planner.profile.checkpoint import (  # noqa: E402
    inspect_checkpoint,
    load_model,
    load_tokenizer,
)
from planner.profile.prompts import Prompt, read_prompts  # noqa: E402
from planner.profile.runner import ProfileConfig, ProfileSession, trace_meta  # noqa: E402
from planner.trace.io import TraceWriter  # noqa: E402

DEFAULT_MODEL = REPO / "examples" / "tiny_moe" / "model"
DEFAULT_PROMPTS = REPO / "examples" / "prompts.jsonl"


def _tiny_qwen3_moe(dest: Path) -> Path:
    """A random 4-layer, 8-expert, top-2 qwen3_moe with the tests' word-level tokenizer."""
    from tests.profile.tiny_models import build_model, save_tokenizer

    overrides = dict(
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True,
        head_dim=16, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
    )  # fmt: skip
    build_model("qwen3_moe", overrides).save_pretrained(dest)
    save_tokenizer(dest)
    return dest


def _synthetic_prompts(n: int) -> list[Prompt]:
    from tests.profile.tiny_models import sample_texts

    return [Prompt(i, str(i), t) for i, t in enumerate(sample_texts(n, seed=7))]


def _timed(fn) -> tuple[float, object]:
    t0 = time.perf_counter()
    value = fn()
    return time.perf_counter() - t0, value


def main(argv: list[str] | None = None) -> dict:
    ap = ArgumentParser(__doc__)
    ap.add_argument(
        "--model", type=Path, default=None,
        help="checkpoint folder (default: examples/tiny_moe/model, else a tiny random qwen3_moe)",
    )  # fmt: skip
    ap.add_argument(
        "--prompts", type=Path, default=None,
        help="prompts JSONL file (default: examples/prompts.jsonl, else synthetic prompts)",
    )  # fmt: skip
    ap.add_argument(
        "--max-prompts", type=positive_int, default=64,
        help="prompts to run, the first ones of the file, at least 1 (default 64)",
    )  # fmt: skip
    ap.add_argument(
        "--max-length", type=positive_int, default=256,
        help="tokens a prompt is truncated to, at least 1 (default 256)",
    )  # fmt: skip
    ap.add_argument(
        "--batch-size", type=positive_int, default=8,
        help="prompts a forward pass, at least 1 (default 8)",
    )  # fmt: skip
    ap.add_argument(
        "--prompts-per-part", type=positive_int, default=64,
        help="prompts a trace part (and a profiling chunk), at least 1 (default 64)",
    )  # fmt: skip
    ap.add_argument(
        "--device", default=None,
        help="torch device, e.g. cpu or cuda (default: cuda when available, else cpu)",
    )  # fmt: skip
    ap.add_argument(
        "--dtype", default=None,
        help="model dtype, e.g. float32 or bfloat16 (default: bfloat16 on cuda, else float32)",
    )  # fmt: skip
    ap.add_argument(
        "--repeats", type=positive_int, default=5,
        help="timed runs of each of the three, interleaved, at least 1 (default 5)",
    )  # fmt: skip
    ap.add_argument(
        "--threads", type=positive_int, default=None,
        help="torch CPU threads, at least 1 (default: torch's)",
    )  # fmt: skip
    args = ap.parse_args(argv)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model_dir = args.model or (
            DEFAULT_MODEL if DEFAULT_MODEL.is_dir() else _tiny_qwen3_moe(tmp / "tiny-qwen3_moe")
        )
        prompts_path = args.prompts or (DEFAULT_PROMPTS if DEFAULT_PROMPTS.is_file() else None)
        prompts = (
            read_prompts(prompts_path)[: args.max_prompts]
            if prompts_path
            else _synthetic_prompts(args.max_prompts)
        )
        config = ProfileConfig(
            max_length=args.max_length,
            batch_size=args.batch_size,
            prompts_per_part=args.prompts_per_part,
            device=args.device,
            dtype=args.dtype,
        )
        device = config.resolved_device()
        dtype = config.resolved_dtype(device)
        info = inspect_checkpoint(model_dir)
        model = load_model(info, device, dtype, progress=False)
        session = ProfileSession(info, model, load_tokenizer(info), config, device)
        meta = trace_meta(info, dtype)
        chunks = [
            prompts[i : i + config.prompts_per_part]
            for i in range(0, len(prompts), config.prompts_per_part)
        ]

        def sync() -> None:
            if device == "cuda":
                import torch

                torch.cuda.synchronize()

        def plain() -> int:
            tokens = sum(session.run_plain(c) for c in chunks)
            sync()
            return tokens

        def hooks() -> int:
            tokens = sum(len(b) for c in chunks if (b := session.profile(c)) is not None)
            sync()
            return tokens

        def profiled(out: Path) -> int:
            writer = TraceWriter(out, meta)
            tokens = 0
            for chunk in chunks:
                batch = session.profile(chunk)
                if batch is not None:
                    writer.write(batch)
                    tokens += len(batch)
            return tokens

        # warm-up of all three: first-call allocations, lazy initialisation, the hooks'
        # first run and the first Parquet write (hooks and profiled were not warmed: at
        # --repeats 1 their first run's setup was reported as a 1370% overhead)
        plain()
        hooks()
        profiled(tmp / "warm-up")
        times: dict[str, list[float]] = {"plain": [], "hooks": [], "profiled": []}
        trace_bytes = tokens = 0
        for r in range(args.repeats):  # interleaved, so drift hits all three alike
            t, tokens = _timed(plain)
            times["plain"].append(t)
            t, hooked_tokens = _timed(hooks)
            times["hooks"].append(t)
            out = tmp / f"trace-{r}"
            t, written = _timed(lambda out=out: profiled(out))
            times["profiled"].append(t)
            assert tokens == hooked_tokens == written, (tokens, hooked_tokens, written)
            trace_bytes = sum(p.stat().st_size for p in out.glob("part-*.parquet"))

    # Medians describe a typical run; minimums are the least disturbed by other processes.
    med = {k: statistics.median(v) for k, v in times.items()}
    best = {k: min(v) for k, v in times.items()}
    report = {
        "model": info.name,
        "model_type": info.model_type,
        "moe_layers": len(info.moe_layer_indices),
        "num_experts": info.num_experts,
        "top_k": info.top_k,
        "device": device,
        "dtype": dtype,
        "prompts": len(prompts),
        "tokens": tokens,
        "batch_size": config.batch_size,
        "repeats": args.repeats,
        "seconds_plain": round(med["plain"], 4),
        "seconds_hooks": round(med["hooks"], 4),
        "seconds_profiled": round(med["profiled"], 4),
        "tokens_per_s_plain": round(tokens / med["plain"], 1),
        "tokens_per_s_hooks": round(tokens / med["hooks"], 1),
        "tokens_per_s_profiled": round(tokens / med["profiled"], 1),
        "overhead_hooks_pct": round(100 * (med["hooks"] / med["plain"] - 1), 1),
        "overhead_hooks_pct_min": round(100 * (best["hooks"] / best["plain"] - 1), 1),
        "overhead_pct": round(100 * (med["profiled"] / med["plain"] - 1), 1),
        "overhead_pct_min": round(100 * (best["profiled"] / best["plain"] - 1), 1),
        "trace_bytes": trace_bytes,
        "trace_bytes_per_token": round(trace_bytes / tokens, 2) if tokens else None,
    }
    emit_json(report)
    return report


if __name__ == "__main__":
    run(main)

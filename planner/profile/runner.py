"""``moeplan profile``: run a local MoE checkpoint over prompts and record its routing.

This is the offline profiling step both planners start from: Speculative MoE §3.1 (step 1 of
its Fig. 3: token ids and token-expert activations) and Sem-MoE's workflow step 1. The
optional embedding matrix serves the nearest-token fallback for tokens the profile never saw
(Speculative MoE §3.3).

For every prompt token and every MoE layer the trace holds the top-k expert ids and the gate
weights the model applied (see :mod:`planner.profile.routers` for what "applied" means per
architecture), written as a v1 trace directory of ``part-*.parquet`` files.

How a run proceeds: the prompts (after ``max_prompts``) are cut into chunks of
``prompts_per_part`` in file order; each chunk is tokenised (truncated to ``max_length``),
sorted by length into batches of ``batch_size`` (right padding + attention mask, so padding
never changes a real token's routing under causal attention), run through the decoder with
forward hooks on the routers, and written as one part with rows ordered by (request_id,
position). ``request_id`` is the prompt's index in the file, so ``resume`` can skip the
prompts whose part was finished (parts are written atomically) and a resumed trace equals
a clean one. ``profile.json`` next to the parts records the settings a resume must match.
``batch_size`` is not one of them, so that a run stopped for memory can go on with smaller
batches. Other batches round the batched matmuls differently, so router weights move in
their last bits (at most 5e-4 on the example model) and, rarely, a near tie between two
experts falls the other way: resume with the same batch size for a trace equal bit for bit.
The same holds for a run stopped by its ``max_prompts`` and resumed with a larger one: the
resumed chunks start where it stopped, not at multiples of ``prompts_per_part``, so their
batches hold other prompts than a clean run's.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from rich.table import Table

from planner._checks import is_bool, is_integer
from planner._io import (
    atomic_path,
    check_place,
    read_json_object,
    sha256_file,
    write_json_atomic,
)
from planner._progress import progress_bar
from planner._safetensors import write_errors_as_oserror
from planner.errors import InputError, ModelError, MoeplanError
from planner.profile.checkpoint import (
    DTYPES,
    CheckpointInfo,
    first_line,
    inspect_checkpoint,
    load_model,
    load_tokenizer,
)
from planner.profile.prompts import Prompt, read_prompts
from planner.profile.routers import RoutingRecorder, find_routers
from planner.trace.info import LoadAccumulator
from planner.trace.io import (
    EMBEDDINGS_FILE,
    PART_GLOB,
    PROFILE_SETTINGS_FILE,
    TraceBatch,
    TraceWriter,
    open_trace,
)
from planner.trace.schema import TraceMeta

EMBEDDINGS_TENSOR = "embeddings"
SETTINGS_FILE = PROFILE_SETTINGS_FILE
DEVICES = ("cpu", "cuda")
# Settings that change the recorded trace: a resumed run must use the same. A key missing
# from an older profile.json is not checked. ``routers_sha256`` (the loaded routers' weights,
# which tell apart two checkpoints of the same name and shapes) is checked too, once the
# model is loaded.
_RESUME_KEYS = (
    "model", "model_type", "max_length", "dtype", "add_special_tokens", "prompts_sha256",
    "transformers",  # its model code defines the router weights recorded (routers.py)
)  # fmt: skip


def _transformers_version() -> str:
    import transformers

    return str(transformers.__version__)


@dataclass(frozen=True)
class ProfileConfig:
    """Settings of one profiling run.

    Attributes:
        max_prompts: profile only the first N prompts of the file (None: all).
        max_length: tokens kept per prompt (longer prompts are truncated).
        batch_size: prompts per forward pass.
        device: "cpu" or "cuda"; None picks cuda when available.
        dtype: weights dtype, "float32" | "bfloat16" | "float16"; None picks bfloat16 on
            cuda and float32 on cpu.
        resume: continue an interrupted run in a non-empty output directory.
        save_embeddings: also write the input-embedding matrix [V, H] as
            ``embeddings.safetensors`` (tensor ``embeddings``).
        prompts_per_part: prompts per trace part (the unit of resume).
        add_special_tokens: let the tokenizer add BOS/EOS as it does when serving.
    """

    max_prompts: int | None = None
    max_length: int = 512
    batch_size: int = 8
    device: str | None = None
    dtype: str | None = None
    resume: bool = False
    save_embeddings: bool = False
    prompts_per_part: int = 64
    add_special_tokens: bool = True

    def __post_init__(self) -> None:
        for name in ("max_length", "batch_size", "prompts_per_part"):
            value = getattr(self, name)
            if not is_integer(value) or value < 1:
                raise InputError(f"{name.replace('_', '-')}={value!r} must be a positive integer")
            object.__setattr__(self, name, int(value))  # profile.json holds it: not numpy's
        if self.max_prompts is not None:
            if not is_integer(self.max_prompts) or self.max_prompts < 1:
                raise InputError(f"max-prompts={self.max_prompts!r} must be a positive integer")
            object.__setattr__(self, "max_prompts", int(self.max_prompts))
        for name in ("resume", "save_embeddings", "add_special_tokens"):
            value = getattr(self, name)
            if not is_bool(value):
                raise InputError(f"{name.replace('_', '-')}={value!r} must be true or false")
            object.__setattr__(self, name, bool(value))  # profile.json holds it: not numpy's
        if self.device is not None and self.device not in DEVICES:
            raise InputError(f"device {self.device!r} is not one of {', '.join(DEVICES)}")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise InputError(f"dtype {self.dtype!r} is not one of {', '.join(DTYPES)}")

    def resolved_device(self) -> str:
        import torch

        if self.device == "cuda" and not torch.cuda.is_available():
            raise InputError("device 'cuda' requested but CUDA is not available; use --device cpu")
        if self.device is None:
            return "cuda" if torch.cuda.is_available() else "cpu"
        return self.device

    def resolved_dtype(self, device: str) -> str:
        if self.dtype is not None:
            return self.dtype
        return "bfloat16" if device == "cuda" else "float32"


@dataclass(frozen=True)
class ProfileResult:
    """What a run did, for the summary.

    Attributes:
        out_dir: the trace directory.
        meta: the trace's metadata.
        prompts_selected: prompts in the file after ``max_prompts``.
        prompts_resumed: of those, already in the trace before this run (skipped).
        prompts_profiled: profiled by this run.
        tokens: token rows written by this run.
        trace_tokens: token rows in the whole trace now.
        parts_written: parts written by this run.
        seconds: wall time of the forward passes and writes (model loading excluded).
        load_seconds: wall time spent loading the tokenizer and model.
        skewness: [L] per-layer expert load max/mean over the whole trace.
        embeddings_path: the saved embedding matrix, or None.
    """

    out_dir: Path
    meta: TraceMeta
    prompts_selected: int
    prompts_resumed: int
    prompts_profiled: int
    tokens: int
    trace_tokens: int
    parts_written: int
    seconds: float
    load_seconds: float
    skewness: tuple[float, ...]
    embeddings_path: Path | None = None

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        skew = [round(s, 4) for s in self.skewness]
        finite = [s for s in skew if np.isfinite(s)]
        return {
            "out": str(self.out_dir),
            "model": self.meta.model,
            "num_layers": self.meta.num_layers,
            "moe_layer_indices": list(self.meta.moe_layer_indices),
            "num_experts": self.meta.num_experts,
            "top_k": self.meta.top_k,
            "prompts_selected": self.prompts_selected,
            "prompts_resumed": self.prompts_resumed,
            "prompts_profiled": self.prompts_profiled,
            "tokens": self.tokens,
            "trace_tokens": self.trace_tokens,
            "parts_written": self.parts_written,
            "seconds": round(self.seconds, 3),
            "load_seconds": round(self.load_seconds, 3),
            "tokens_per_s": round(self.tokens_per_s, 1),
            "skewness_per_layer": skew,
            "skewness_mean": round(float(np.mean(finite)), 4) if finite else None,
            "embeddings": str(self.embeddings_path) if self.embeddings_path else None,
        }


def render_profile_summary(result: ProfileResult) -> Table:
    """A rich table of a run's summary, for a person to read."""
    d = result.to_dict()
    table = Table(title=f"profile -> {d['out']}", show_header=False, title_justify="left")
    table.add_column("field", style="bold")
    table.add_column("value")
    for key in ("model", "num_layers", "num_experts", "top_k", "prompts_selected",
                "prompts_resumed", "prompts_profiled", "tokens", "trace_tokens",
                "parts_written", "seconds", "load_seconds", "tokens_per_s", "skewness_mean",
                "embeddings"):  # fmt: skip
        if key != "embeddings" or d[key]:
            table.add_row(key, str(d[key]))
    skew = ", ".join(
        f"L{i}:{v:.2f}"
        for i, v in zip(d["moe_layer_indices"], d["skewness_per_layer"], strict=True)
    )
    table.add_row("skewness (max/mean)", skew)
    return table


def trace_meta(info: CheckpointInfo, dtype: str) -> TraceMeta:
    """Trace metadata for a checkpoint profiled in ``dtype``."""
    import transformers

    from planner import __version__

    return TraceMeta(
        model=info.name,
        num_layers=len(info.moe_layer_indices),
        num_experts=info.num_experts,
        top_k=info.top_k,
        vocab_size=info.vocab_size,
        moe_layer_indices=info.moe_layer_indices,
        source=(
            f"moeplan profile {__version__} ({info.model_type}, transformers "
            f"{transformers.__version__}, {dtype}; {info.adapter.weights_note(info.config)})"
        ),
    )


@dataclass
class ProfileSession:
    """A loaded model and tokenizer, ready to run chunks of prompts with or without hooks.

    Attributes:
        info: the checkpoint.
        model: the causal LM (eval mode, on ``device``).
        tokenizer: its tokenizer.
        config: run settings (batch size, max length).
        device: torch device string.
        with_domain: add a ``domain`` column to every batch.
    """

    info: CheckpointInfo
    model: Any
    tokenizer: Any
    config: ProfileConfig
    device: str
    with_domain: bool = False
    routers: list[Any] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        self.routers = find_routers(
            self.model,
            self.info.adapter,
            list(self.info.moe_layer_indices),
            self.info.num_experts,
            str(self.info.path),
        )
        pad = getattr(self.tokenizer, "pad_token_id", None)
        # Padded positions are masked and never recorded, but they are still embedded: a pad
        # token added to the tokenizer after the model (id >= vocab_size) would index past
        # the embedding matrix. Any id the model has will do.
        pad_id = int(pad) if pad is not None else 0
        self._pad_id = pad_id if 0 <= pad_id < self.info.vocab_size else 0
        self._max_length = effective_max_length(self.info, self.config)

    def encode(self, prompts: list[Prompt]) -> list[list[int]]:
        """Token ids of each prompt, truncated to ``max_length`` (and to the model's
        ``max_position_embeddings``)."""
        enc = self.tokenizer(
            [p.text for p in prompts],
            truncation=True,
            max_length=self._max_length,
            add_special_tokens=self.config.add_special_tokens,
        )["input_ids"]
        too_big = max((max(ids) for ids in enc if ids), default=-1)
        if too_big >= self.info.vocab_size:
            raise ModelError(
                f"{self.info.path}: the tokenizer produced token id {too_big} >= vocab_size "
                f"{self.info.vocab_size}; tokenizer and model do not match"
            )
        return [list(ids) for ids in enc]

    def batches(
        self, prompts: list[Prompt]
    ) -> Iterator[tuple[list[Prompt], list[list[int]], Any, Any]]:
        """Length-sorted batches: (prompts, token ids, input_ids [B, S], attention_mask [B, S]).

        Prompts that tokenise to nothing are dropped (they have no token to record).
        """
        import torch

        encoded = self.encode(prompts)
        order = sorted(
            (i for i in range(len(prompts)) if encoded[i]), key=lambda i: -len(encoded[i])
        )
        for start in range(0, len(order), self.config.batch_size):
            pick = order[start : start + self.config.batch_size]
            seqs = [encoded[i] for i in pick]
            width = max(len(s) for s in seqs)
            input_ids = torch.full((len(seqs), width), self._pad_id, dtype=torch.long)
            mask = torch.zeros((len(seqs), width), dtype=torch.long)
            for row, seq in enumerate(seqs):
                input_ids[row, : len(seq)] = torch.tensor(seq)
                mask[row, : len(seq)] = 1
            yield [prompts[i] for i in pick], seqs, input_ids, mask

    def forward(self, input_ids: Any, mask: Any) -> None:
        """One forward pass of the decoder (no LM head, no KV cache)."""
        import torch

        try:
            with torch.inference_mode():
                self.model.base_model(
                    input_ids=input_ids.to(self.device),
                    attention_mask=mask.to(self.device),
                    use_cache=False,
                )
        except MoeplanError:
            raise  # the hooks' own word on the routing
        except Exception as e:  # noqa: BLE001 - any failure of the model's own code
            # A config the model cannot run (topk_group > n_group: RuntimeError; an unknown
            # topk_method: UnboundLocalError; n_group 0: ZeroDivisionError), or out of memory.
            hint = (
                "; lower --batch-size or --max-length"
                if isinstance(e, torch.OutOfMemoryError)
                else ""
            )
            raise ModelError(
                f"{self.info.path}: the model's forward pass failed ({first_line(e)}){hint}"
            ) from None

    def run_plain(self, prompts: list[Prompt]) -> int:
        """Forward passes without hooks (the baseline a benchmark compares to); returns tokens."""
        tokens = 0
        for _, seqs, input_ids, mask in self.batches(prompts):
            self.forward(input_ids, mask)
            tokens += sum(len(s) for s in seqs)
        return tokens

    def profile(self, prompts: list[Prompt]) -> TraceBatch | None:
        """The routing of every token of ``prompts``, rows ordered by (request_id, position)."""
        info = self.info
        recorder = RoutingRecorder(self.routers, info.num_experts, info.top_k, str(info.path))
        pieces: list[TraceBatch] = []
        with recorder:
            for batch_prompts, seqs, input_ids, mask in self.batches(prompts):
                self.forward(input_ids, mask)
                ids, weights = recorder.take(input_ids.numel())
                keep = mask.reshape(-1).bool().to(ids.device)
                ids, weights = ids[keep], weights[keep]
                self._check_finite(weights)
                lengths = [len(s) for s in seqs]
                extras = {}
                if self.with_domain:
                    extras["domain"] = np.repeat(
                        np.array([p.domain or "" for p in batch_prompts], dtype=object), lengths
                    )
                pieces.append(
                    TraceBatch.from_arrays(
                        request_id=np.repeat([p.index for p in batch_prompts], lengths),
                        position=np.concatenate([np.arange(n) for n in lengths]),
                        token_id=np.concatenate([np.asarray(s) for s in seqs]),
                        experts=ids.cpu().numpy(),
                        weights=weights.cpu().numpy(),
                        extras=extras,
                    )
                )
        if not pieces:
            return None
        batch = TraceBatch.concat(pieces)
        return batch.select(np.lexsort((batch.position, batch.request_id)))

    def _check_finite(self, weights: Any) -> None:
        """Refuse gate weights [T, L, k] that are NaN or infinite (a trace would keep them)."""
        import torch

        bad = ~torch.isfinite(weights)
        if bool(bad.any()):
            layer = int(bad.any(dim=-1).any(dim=0).nonzero()[0])
            raise ModelError(
                f"{self.info.path}: the router of model layer {self.info.moe_layer_indices[layer]} "
                f"applied non-finite gate weights (NaN or inf) to {int(bad.any(-1).any(-1).sum())} "
                f"tokens; the checkpoint's weights hold NaN/inf, or the model overflows in its "
                f"dtype (try --dtype float32)"
            )

    def routers_sha256(self) -> str:
        """sha256 of every router's parameters and buffers as loaded: tells one checkpoint's
        routing from another's of the same name and shapes."""
        import torch

        h = hashlib.sha256()
        for router in self.routers:
            for name, tensor in sorted(router.state_dict().items()):
                h.update(name.encode())
                data = tensor.detach().to(device="cpu", dtype=torch.float32).contiguous()
                h.update(data.numpy().tobytes())
        return h.hexdigest()


def profile_model(
    model_dir: str | Path,
    prompts_path: str | Path,
    out_dir: str | Path,
    config: ProfileConfig | None = None,
    progress: bool = True,
) -> ProfileResult:
    """Profile a local Hugging Face MoE checkpoint on a prompts file into a v1 trace directory.

    Raises:
        InputError: missing model directory or prompts file, no prompts, a bad prompts line,
            a non-empty ``out_dir`` without ``resume``, a resume into a directory that is not
            a profile run, a resume with other settings, another prompts file (compared by
            sha256) or another checkpoint's routers, or cuda requested without CUDA.
        ModelError: not an MoE model, unsupported architecture, no tokenizer, damaged weights
            or weights that do not match the config, or a model that does not route as its
            architecture's adapter expects.
    """
    config = config or ProfileConfig()
    info = inspect_checkpoint(model_dir)
    all_prompts = read_prompts(prompts_path)
    prompts = all_prompts[: config.max_prompts]
    # Decided from the whole file, not from this run's prompts, so that every part of a
    # trace (and a resumed trace) has the same columns as a clean run of the file.
    with_domain = any(p.domain for p in all_prompts)
    device = config.resolved_device()
    dtype = config.resolved_dtype(device)
    out = Path(out_dir)
    settings = {
        "model": info.name,
        "model_type": info.model_type,
        "max_length": effective_max_length(info, config),
        "dtype": dtype,
        "add_special_tokens": config.add_special_tokens,
        "prompts": str(Path(prompts_path).resolve()),
        "prompts_sha256": sha256_file(prompts_path),
        "transformers": _transformers_version(),
    }
    with _claim_out_dir(out, inputs=(model_dir, prompts_path)):
        done, before = _prepare_out_dir(out, config.resume, settings)
        beyond = len(set(done) - {p.index for p in prompts})
        if beyond:  # a resume adds prompts; it cannot take recorded ones out of the trace
            raise InputError(
                f"{out}: the trace already holds {beyond} prompt(s) beyond the "
                f"{len(prompts)} that --max-prompts selects; resume with at least as many, "
                "or profile into a new --out"
            )
        todo = [p for p in prompts if p.index not in done]

        t0 = time.perf_counter()
        tokenizer = load_tokenizer(info)
        model = load_model(info, device, dtype, progress)
        meta = trace_meta(info, dtype)
        session = ProfileSession(info, model, tokenizer, config, device, with_domain=with_domain)
        settings["routers_sha256"] = session.routers_sha256()
        if before.get("routers_sha256", settings["routers_sha256"]) != settings["routers_sha256"]:
            raise InputError(
                f"{out}: cannot resume with another checkpoint: the routers of {str(model_dir)!r} "
                f"differ from those of the run that started it (both named {info.name!r})"
            )
        writer = TraceWriter(out, meta)
        tokens, parts = 0, 0

        def take_back() -> None:
            """No part written by a fresh run: remove what it wrote (a directory it made
            is removed by _claim_out_dir), so that a plain retry is not refused as a
            directory holding an unfinished run."""
            if parts == 0 and not done:
                for name in (SETTINGS_FILE, EMBEDDINGS_FILE):
                    (out / name).unlink(missing_ok=True)

        try:
            # unfinished until the last part is written: a stopped run's parts are refused
            # by every command but a resume (planner.trace.io.open_trace)
            write_json_atomic(out / SETTINGS_FILE, settings | {"finished": False})
            embeddings_path = None
            if config.save_embeddings:
                embeddings_path = save_embeddings(model, out / EMBEDDINGS_FILE, dtype, meta)
            load_seconds = time.perf_counter() - t0

            acc = LoadAccumulator(meta)
            if done:
                for done_batch in open_trace(out, unfinished=True).iter_batches():
                    acc.add(done_batch)
            t0 = time.perf_counter()
            with progress_bar(
                progress and bool(todo), "profiling", len(todo), unit="prompts"
            ) as advance:
                for start in range(0, len(todo), config.prompts_per_part):
                    chunk = todo[start : start + config.prompts_per_part]
                    batch = session.profile(chunk)
                    if batch is not None:
                        writer.write(batch)
                        acc.add(batch)
                        tokens += len(batch)
                        parts += 1
                    rate = tokens / max(time.perf_counter() - t0, 1e-9)
                    advance(len(chunk), f"{tokens} tokens  {rate:.0f} tok/s")
        except BaseException:  # a failed first forward pass (out of memory, a bad config)
            take_back()
            raise
        seconds = time.perf_counter() - t0
        if parts == 0 and not done:
            take_back()
            raise InputError(
                f"{prompts_path}: none of the {len(todo)} prompt(s) tokenised to any token, so "
                "there is nothing to record (check the prompts and the tokenizer)"
            )
        write_json_atomic(out / SETTINGS_FILE, settings | {"finished": True})
        return ProfileResult(
            out_dir=out,
            meta=meta,
            prompts_selected=len(prompts),
            prompts_resumed=len(prompts) - len(todo),
            prompts_profiled=len(todo),
            tokens=tokens,
            trace_tokens=acc.tokens,
            parts_written=parts,
            seconds=seconds,
            load_seconds=load_seconds,
            skewness=tuple(float(s) for s in acc.skewness),
            embeddings_path=embeddings_path,
        )


@contextlib.contextmanager
def _claim_out_dir(out: Path, inputs: tuple = ()) -> Iterator[None]:
    """Hold ``out`` while this run writes it: an exclusive lock (``flock``) on the directory,
    made if missing, so that a second ``profile`` into it at the same time is refused
    instead of mixing two runs' parts and settings. The lock ends with the process, so a
    killed run leaves none behind. A directory this run made (and its parents it made) is
    removed if the run fails before writing anything into it. An ``out`` inside one of the run's ``inputs`` (the
    model, the prompts), holding one, or inside another moeplan artifact is refused.
    """
    # Refused before any work: the directory could not be made once the model is loaded.
    check_place(out, inputs)
    if out.is_symlink() and not out.exists():
        raise InputError(
            f"output {str(out)!r} is a symbolic link to {os.readlink(out)!r}, which does not "
            f"exist; choose another --out"
        )
    if out.exists() and not out.is_dir():
        raise InputError(f"output {str(out)!r} exists and is not a directory")
    made = [p for p in (out, *out.parents) if not p.exists()]  # deepest first
    out.mkdir(parents=True, exist_ok=True)
    fd = os.open(out, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise InputError(
                f"output {str(out)!r}: another moeplan profile run is writing there; wait for "
                f"it to end or choose another --out"
            ) from None
        try:
            yield
        except BaseException:
            for made_dir in made:  # the folders this run made, while they stay empty
                if any(made_dir.iterdir()):
                    break
                made_dir.rmdir()
            raise
    finally:
        os.close(fd)


def effective_max_length(info: CheckpointInfo, config: ProfileConfig) -> int:
    """Tokens kept per prompt: ``config.max_length``, but never more positions than the
    model was built for (its ``max_position_embeddings``). This is what the run records."""
    limit = getattr(info.config, "max_position_embeddings", None)
    return min(config.max_length, limit or config.max_length)


def _prepare_out_dir(
    out: Path, resume: bool, settings: dict[str, Any]
) -> tuple[set[int], dict[str, Any]]:
    """Check ``out`` may receive this run; return the request ids its finished parts hold
    and the settings of the run that started it (empty for a fresh run).

    A resume continues only a directory an earlier ``profile`` run started (it holds that
    run's ``profile.json``) with the same settings and the same prompts file.
    """
    if not any(out.iterdir()):
        return set(), {}
    if not resume:
        if not (out / SETTINGS_FILE).is_file():  # --resume would refuse it: no run to continue
            raise InputError(
                f"output directory {str(out)!r} is not empty and holds no profile run; choose "
                f"another --out directory"
            )
        raise InputError(
            f"output directory {str(out)!r} is not empty; pass --resume to continue that run "
            f"or choose another --out directory"
        )
    before = _read_settings(out)
    if before.get("prompts_sha256", settings["prompts_sha256"]) != settings["prompts_sha256"]:
        raise InputError(
            f"{out}: cannot resume with a different prompts file: {settings['prompts']!r} "
            f"(sha256 {settings['prompts_sha256'][:12]}...) is not the file the run started "
            f"with ({before.get('prompts', '?')!r}, sha256 {str(before['prompts_sha256'])[:12]}...)"
        )
    changed = [k for k in _RESUME_KEYS if k in before and before[k] != settings[k]]
    if changed:
        diffs = ", ".join(f"{k}: {before[k]!r} -> {settings[k]!r}" for k in changed)
        raise InputError(
            f"{out}: cannot resume with other settings than the run that started it ({diffs})"
        )
    if not any(out.glob(PART_GLOB)):
        return set(), before
    return {int(r) for r in open_trace(out, unfinished=True).request_ids()}, before


def _read_settings(out: Path) -> dict[str, Any]:
    """The ``profile.json`` of the run that started ``out``; refuse a directory without one."""
    settings_file = out / SETTINGS_FILE
    not_a_run = (
        f"cannot --resume into {str(out)!r}: it is not empty and is not a moeplan profile run"
    )
    if not settings_file.is_file():
        raise InputError(f"{not_a_run} (no {SETTINGS_FILE}); choose another --out directory")
    before = read_json_object(settings_file, f"{settings_file} (the settings of that run)")
    if not {"model", "model_type"} <= before.keys():
        raise InputError(
            f"{not_a_run} ({SETTINGS_FILE} is not a profile settings file); "
            f"choose another --out directory"
        )
    return before


def save_embeddings(model: Any, dest: Path, dtype: str, meta: TraceMeta) -> Path:
    """Write the input-embedding matrix [V, H] to ``dest`` in the dtype the model runs in
    (``dtype``; bfloat16 stays bfloat16: as float16 a value beyond 65504 became inf, which
    ``fit`` then refused), tensor name ``embeddings``."""
    import torch
    from safetensors.torch import save_file

    weight = model.get_input_embeddings().weight.detach()
    tensor = weight.to(device="cpu", dtype=getattr(torch, dtype)).contiguous()
    metadata = {"model": meta.model, "fingerprint": meta.fingerprint()}
    with atomic_path(dest) as tmp, write_errors_as_oserror(dest):
        save_file({EMBEDDINGS_TENSOR: tensor}, str(tmp), metadata=metadata)
    return dest

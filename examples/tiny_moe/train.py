"""Train the tiny Qwen3-MoE model that moeplan's README profiles, from text this machine has.

The model is small enough to commit (fp32 safetensors under 25 MB) and to train on two
shared CPU cores in about a quarter of an hour, yet it is a real Hugging Face
``Qwen3MoeForCausalLM`` with learned, input-dependent routing, so ``moeplan profile``
records the same kind of trace it would from a production MoE. Four distinct text domains
are used so that routing differs by domain, the property Sem-MoE and Speculative MoE
exploit:

    python   CPython standard-library modules (*.py, tests and codec tables excluded)
    prose    English documentation: pydoc topics, docstrings, LICENSE and IDLE text files
    c        CPython's C headers (include/**/*.h)
    numeric  decimal / math test vectors from the stdlib test suite (*.decTest, *testcases.txt)

Every source document is split once into train or held-out by a hash of its name, so the
held-out loss, the routing figures and ``examples/prompts.jsonl`` never see training text.

Run (from the repository root)::

    python examples/tiny_moe/train.py                  # full run -> examples/tiny_moe/model
    python examples/tiny_moe/train.py --quick --out D  # about a minute, for smoke tests
    python examples/tiny_moe/train.py --prompts-only   # only rewrite examples/prompts.jsonl
    python examples/tiny_moe/train.py --prompts-only \
        --fresh-prompts-out examples/prompts_fresh.jsonl  # and the second, disjoint set

Everything is seeded (``--seed``); the same machine and library versions give the same model.
"""

from __future__ import annotations

import os

# Idle OpenMP workers spin by default; on cores shared with other processes that made a
# 2-thread training step about 3.5x slower than with passive waiting (measured here).
# Must be set before torch loads its OpenMP runtime.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse
import ast
import dataclasses
import hashlib
import json
import math
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import tokenizers
import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen3MoeConfig, Qwen3MoeForCausalLM

from planner._io import atomic_path

DOMAINS = ("python", "prose", "c", "numeric")
HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE / "model"
DEFAULT_PROMPTS = HERE.parent / "prompts.jsonl"
# A second set drawn from the chunks the first left out: traffic no plan was fitted on.
DEFAULT_FRESH_PROMPTS = HERE.parent / "prompts_fresh.jsonl"
BOS, EOS, PAD = "<s>", "</s>", "<pad>"
HELDOUT_ONE_IN = 8  # one document in eight is held out
PROMPT_MIN_CHARS, PROMPT_MAX_CHARS = 100, 600


@dataclass(frozen=True)
class TrainConfig:
    """Every knob of a run; recorded verbatim in ``training_log.json``."""

    seed: int = 0
    # corpus
    train_chars_per_domain: int = 2_000_000
    heldout_chars_per_domain: int = 200_000
    # tokenizer
    vocab_size: int = 4096
    # model (Qwen3-MoE, every decoder layer sparse)
    hidden_size: int = 128
    num_hidden_layers: int = 6
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    num_experts: int = 16
    num_experts_per_tok: int = 4
    moe_intermediate_size: int = 128
    router_aux_loss_coef: float = 0.01
    max_position_embeddings: int = 512
    # optimisation
    steps: int = 600
    seq_len: int = 128
    seqs_per_domain: int = 8  # batch = seqs_per_domain * len(DOMAINS) sequences
    peak_lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 30
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    num_threads: int = 2
    # evaluation
    eval_windows_per_domain: int = 24
    prompts_per_domain: int = 80
    min_token_occurrences: int = 5

    @classmethod
    def quick(cls, seed: int = 0) -> TrainConfig:
        """A smoke-test configuration: same architecture, tiny corpus, a few dozen steps."""
        return cls(
            seed=seed,
            train_chars_per_domain=60_000,
            heldout_chars_per_domain=30_000,
            steps=20,
            seqs_per_domain=2,
            warmup_steps=4,
            eval_windows_per_domain=4,
            prompts_per_domain=8,
        )


@dataclass(frozen=True)
class Document:
    domain: str
    name: str  # stable identifier, e.g. a path relative to the stdlib
    text: str


# ---------------------------------------------------------------------------------------
# Corpus
# ---------------------------------------------------------------------------------------


def _stable_hash(name: str) -> int:
    return int.from_bytes(hashlib.sha1(name.encode()).digest()[:8], "big")


def is_heldout(name: str) -> bool:
    """Whether a document is held out of training (decided by its name alone)."""
    return _stable_hash(name) % HELDOUT_ONE_IN == 0


def _read(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


def _stdlib_modules(stdlib: Path) -> list[Path]:
    """Library modules, sorted: no tests, no third-party packages, no generated tables."""
    skip_parts = {"site-packages", "test", "tests", "idle_test", "__pycache__", "encodings"}
    skip_parts |= {"pydoc_data", "turtledemo"}
    out = []
    for path in sorted(stdlib.rglob("*.py")):
        rel = path.relative_to(stdlib)
        if skip_parts & set(rel.parts[:-1]) or rel.name.startswith("_sysconfigdata"):
            continue
        out.append(path)
    return out


def _docstrings(source: str, min_chars: int = 200) -> str:
    """A module's module, class and function docstrings of at least ``min_chars``."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return ""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            doc = ast.get_docstring(node)
            if doc and len(doc) >= min_chars:
                found.append(doc.strip())
    return "\n\n".join(found)


def _strip_dectest_banner(text: str) -> str:
    """Drop the 19-line IBM copyright banner every .decTest file repeats."""
    lines = text.splitlines(keepends=True)
    i = 0
    while i < len(lines) and lines[i].startswith("--"):
        i += 1
    return "".join(lines[i:])


def collect_documents(domain: str) -> list[Document]:
    """Every candidate document of one domain, sorted by name."""
    paths = sysconfig.get_paths()
    stdlib = Path(paths["stdlib"])
    docs: list[Document] = []
    if domain == "python":
        for path in _stdlib_modules(stdlib):
            docs.append(Document(domain, str(path.relative_to(stdlib)), _read(path)))
    elif domain == "prose":
        import pydoc_data.topics

        for key in sorted(pydoc_data.topics.topics):
            docs.append(Document(domain, f"topics/{key}", pydoc_data.topics.topics[key]))
        text_files = [stdlib / "LICENSE.txt", *sorted((stdlib / "idlelib").glob("*.txt"))]
        for path in text_files:
            if path.is_file():
                docs.append(Document(domain, str(path.relative_to(stdlib)), _read(path)))
        for path in _stdlib_modules(stdlib):
            # Named after the module so a module's code and docstrings share one split.
            doc = _docstrings(_read(path))
            if doc:
                docs.append(Document(domain, str(path.relative_to(stdlib)), doc))
    elif domain == "c":
        include = Path(paths["include"])
        for path in sorted(include.rglob("*.h")):
            docs.append(Document(domain, f"include/{path.relative_to(include)}", _read(path)))
    elif domain == "numeric":
        test = stdlib / "test"
        files = sorted((test / "decimaltestdata").glob("*.decTest"))
        files += sorted(test.glob("*testcases.txt")) + [test / "floating_points.txt"]
        for path in files:
            if path.is_file():
                text = _read(path)
                if path.suffix == ".decTest":
                    text = _strip_dectest_banner(text)
                docs.append(Document(domain, str(path.relative_to(stdlib)), text))
    else:
        raise ValueError(f"unknown domain {domain!r}; expected one of {DOMAINS}")
    return sorted((d for d in docs if d.text.strip()), key=lambda d: d.name)


def split_documents(
    docs: list[Document], train_chars: int, heldout_chars: int
) -> tuple[list[Document], list[Document]]:
    """Split by name hash, then cap each side, visiting documents in a seed-free hash order.

    The hash order spreads the capped selection over the whole stdlib rather than its
    alphabetical head. A document that would overflow a cap is truncated at a line break.
    """
    order = sorted(docs, key=lambda d: (_stable_hash("order:" + d.name), d.name))
    train: list[Document] = []
    heldout: list[Document] = []
    budget = {True: heldout_chars, False: train_chars}
    for doc in order:
        side = is_heldout(doc.name)
        left = budget[side]
        if left <= 0:
            continue
        text = doc.text
        if len(text) > left:
            cut = text.rfind("\n", 0, left)
            text = text[: cut if cut > 0 else left]
        budget[side] -= len(text)
        (heldout if side else train).append(dataclasses.replace(doc, text=text))
    return train, heldout


# ---------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------


def train_tokenizer(texts: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer (GPT-2 style pre-tokenisation) with <s>, </s>, <pad>."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[BOS, EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD, model_max_length=512
    )


def encode_stream(tokenizer: PreTrainedTokenizerFast, docs: list[Document]) -> np.ndarray:
    """All documents' tokens, each followed by </s>: int64 [tokens]."""
    # The backend tokenizer: whole documents are longer than the model's context on purpose.
    encodings = tokenizer.backend_tokenizer.encode_batch([d.text for d in docs])
    eos = tokenizer.eos_token_id
    return np.fromiter((t for enc in encodings for t in [*enc.ids, eos]), dtype=np.int64)


# ---------------------------------------------------------------------------------------
# Model and training
# ---------------------------------------------------------------------------------------


def make_model(cfg: TrainConfig, tokenizer: PreTrainedTokenizerFast) -> Qwen3MoeForCausalLM:
    config = Qwen3MoeConfig(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        intermediate_size=2 * cfg.hidden_size,  # unused: every layer is sparse
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        num_experts=cfg.num_experts,
        num_experts_per_tok=cfg.num_experts_per_tok,
        moe_intermediate_size=cfg.moe_intermediate_size,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        norm_topk_prob=True,
        output_router_logits=True,
        router_aux_loss_coef=cfg.router_aux_loss_coef,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(cfg.seed)
    return Qwen3MoeForCausalLM(config)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup, then cosine decay to ``min_lr_ratio * peak_lr`` at the last step."""
    if step < cfg.warmup_steps:
        return cfg.peak_lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps - 1)
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return cfg.peak_lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cosine)


def sample_batch(
    domain_to_stream: dict[str, np.ndarray], rng: np.random.Generator, per_domain: int, seq_len: int
) -> torch.Tensor:
    """``per_domain`` random windows from each domain's stream: int64 [per_domain*D, seq_len]."""
    rows = []
    for domain in DOMAINS:
        stream = domain_to_stream[domain]
        starts = rng.integers(0, len(stream) - seq_len, size=per_domain)
        rows.extend(stream[s : s + seq_len] for s in starts)
    return torch.from_numpy(np.stack(rows))


def eval_windows(stream: np.ndarray, n: int, seq_len: int) -> torch.Tensor:
    """``n`` evenly spaced, non-overlapping windows of a stream: int64 [n', seq_len], n' <= n."""
    n = min(n, len(stream) // seq_len)
    starts = np.linspace(0, len(stream) - seq_len, n).astype(np.int64)
    return torch.from_numpy(np.stack([stream[s : s + seq_len] for s in starts]))


@torch.no_grad()
def lm_loss(model: Qwen3MoeForCausalLM, windows: torch.Tensor, batch: int = 8) -> float:
    """Mean next-token cross-entropy (nats, no router loss) over windows [n, seq_len]."""
    total, count = 0.0, 0
    for i in range(0, len(windows), batch):
        x = windows[i : i + batch]
        logits = model(input_ids=x, output_router_logits=False).logits[:, :-1]
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), reduction="sum"
        )
        total += float(loss)
        count += x[:, 1:].numel()
    return total / count


@torch.no_grad()
def route(model: Qwen3MoeForCausalLM, windows: torch.Tensor, batch: int = 8) -> np.ndarray:
    """Top-k experts the model picks for every token: int64 [n*seq_len, L, k]."""
    k = model.config.num_experts_per_tok
    out = []
    for i in range(0, len(windows), batch):
        result = model(input_ids=windows[i : i + batch], output_router_logits=True)
        per_layer = [lg.topk(k, dim=-1).indices for lg in result.router_logits]
        out.append(torch.stack(per_layer, dim=1).numpy())
    return np.concatenate(out)


def train(
    model: Qwen3MoeForCausalLM,
    domain_to_stream: dict[str, np.ndarray],
    cfg: TrainConfig,
    log_every: int = 25,
) -> list[dict]:
    """AdamW with warmup + cosine LR on domain-balanced batches; returns the loss history."""
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "gate.weight" not in n]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2 or "gate.weight" in n]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay}],
        lr=cfg.peak_lr,
        betas=(0.9, 0.95),
        weight_decay=0.0,
    )
    rng = np.random.default_rng(cfg.seed)
    history = []
    model.train()
    t0 = time.monotonic()
    for step in range(cfg.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg)
        x = sample_batch(domain_to_stream, rng, cfg.seqs_per_domain, cfg.seq_len)
        out = model(input_ids=x, labels=x, output_router_logits=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        aux = float(out.aux_loss.detach())
        lm = float(out.loss.detach()) - cfg.router_aux_loss_coef * aux
        history.append({"step": step + 1, "lm_loss": lm, "aux_loss": aux})
        if (step + 1) % log_every == 0 or step + 1 == cfg.steps:
            recent = history[-log_every:]
            mean_lm = sum(h["lm_loss"] for h in recent) / len(recent)
            print(
                f"step {step + 1:5d}/{cfg.steps}  lm_loss {mean_lm:.3f}  aux {aux:.3f}  "
                f"lr {lr_at(step, cfg):.2e}  {time.monotonic() - t0:6.0f}s",
                file=sys.stderr,
                flush=True,
            )
    model.eval()
    return history


# ---------------------------------------------------------------------------------------
# Routing sanity figures
# ---------------------------------------------------------------------------------------


def topk_coverage(token_ids: np.ndarray, experts: np.ndarray, num_experts: int, min_occ: int):
    """Per layer: how much of a token's routing its own k favourite experts cover.

    For each (layer, token id) seen at least ``min_occ`` times, count how often each expert is
    in its top-k; the k most frequent experts' counts over (occurrences * k) is 1.0 when a
    token always goes to the same experts. Averaged over occurrences.

    token_ids: [T]; experts: [T, L, k]. Returns (coverage [L], number of tokens counted).
    """
    _, num_layers, k = experts.shape
    ids, inverse, counts = np.unique(token_ids, return_inverse=True, return_counts=True)
    keep = counts >= min_occ
    coverage = np.zeros(num_layers)
    for layer in range(num_layers):
        table = np.zeros((len(ids), num_experts), dtype=np.int64)
        np.add.at(table, (np.repeat(inverse, k), experts[:, layer, :].reshape(-1)), 1)
        top = np.sort(table[keep], axis=1)[:, -k:].sum(axis=1)
        coverage[layer] = top.sum() / (counts[keep].sum() * k)
    return coverage, int(keep.sum())


def random_router(num_tokens: int, num_layers: int, num_experts: int, k: int, seed: int):
    """k distinct uniformly random experts per (token, layer): int64 [T, L, k]."""
    rng = np.random.default_rng(seed)
    scores = rng.random((num_tokens, num_layers, num_experts))
    return np.argsort(scores, axis=-1)[..., :k]


def expert_load(experts: np.ndarray, num_experts: int) -> np.ndarray:
    """Share of routed activations per expert: float [L, N], rows sum to 1."""
    _, num_layers, _ = experts.shape
    load = np.stack(
        [np.bincount(experts[:, i].reshape(-1), minlength=num_experts) for i in range(num_layers)]
    ).astype(np.float64)
    return load / load.sum(axis=1, keepdims=True)


def _js_divergence(p: np.ndarray, q: np.ndarray) -> float:
    """Jensen-Shannon divergence in bits, in [0, 1]."""
    m = (p + q) / 2

    def kl(a: np.ndarray, b: np.ndarray) -> float:
        nz = a > 0
        return float(np.sum(a[nz] * np.log2(a[nz] / b[nz])))

    return 0.5 * kl(p, m) + 0.5 * kl(q, m)


def domain_divergence(domain_to_experts: dict[str, np.ndarray], num_experts: int) -> np.ndarray:
    """Per layer: mean pairwise JS divergence between the domains' expert loads. [L]."""
    loads = {d: expert_load(e, num_experts) for d, e in domain_to_experts.items()}
    names = list(loads)
    num_layers = next(iter(loads.values())).shape[0]
    out = np.zeros(num_layers)
    pairs = [(a, b) for i, a in enumerate(names) for b in names[i + 1 :]]
    for layer in range(num_layers):
        out[layer] = np.mean([_js_divergence(loads[a][layer], loads[b][layer]) for a, b in pairs])
    return out


def next_layer_predictability(experts: np.ndarray) -> tuple[float, float]:
    """How well layer l's top-1 expert predicts layer l+1's, in-sample, vs no information.

    Returns (accuracy of the majority next expert given the current one, accuracy of always
    guessing the most common next expert), both averaged over adjacent layer pairs.
    """
    top1 = experts[:, :, 0]
    num_experts = int(experts.max()) + 1
    cond, base = [], []
    for layer in range(top1.shape[1] - 1):
        table = np.zeros((num_experts, num_experts), dtype=np.int64)
        np.add.at(table, (top1[:, layer], top1[:, layer + 1]), 1)
        cond.append(table.max(axis=1).sum() / len(top1))
        base.append(table.sum(axis=0).max() / len(top1))
    return float(np.mean(cond)), float(np.mean(base))


def routing_figures(
    token_ids: np.ndarray, experts: np.ndarray, domain_sizes: list[int], cfg: TrainConfig
) -> dict:
    """The routing sanity figures of one router on the held-out tokens.

    token_ids: [T]; experts: [T, L, k], the tokens of ``DOMAINS`` in order, ``domain_sizes``
    of them each.
    """
    n_exp = cfg.num_experts
    bounds = np.cumsum([0, *domain_sizes])
    domain_to_experts = {d: experts[bounds[i] : bounds[i + 1]] for i, d in enumerate(DOMAINS)}
    coverage, n_tokens = topk_coverage(token_ids, experts, n_exp, cfg.min_token_occurrences)
    load = expert_load(experts, n_exp)
    divergence = domain_divergence(domain_to_experts, n_exp)
    cond, base = next_layer_predictability(experts)
    return {
        "tokens_routed": int(len(token_ids)),
        "token_ids_with_min_occurrences": n_tokens,
        "topk_coverage_per_layer": [round(float(c), 4) for c in coverage],
        "topk_coverage_mean": round(float(coverage.mean()), 4),
        "domain_js_divergence_per_layer": [round(float(x), 4) for x in divergence],
        "domain_js_divergence_mean": round(float(divergence.mean()), 4),
        "load_max_over_mean_per_layer": [round(float(x), 3) for x in load.max(axis=1) * n_exp],
        "next_layer_top1_accuracy": round(cond, 4),
        "next_layer_top1_baseline": round(base, 4),
        "domain_load_layer0": {
            d: [round(float(x), 3) for x in expert_load(e, n_exp)[0]]
            for d, e in domain_to_experts.items()
        },
    }


# ---------------------------------------------------------------------------------------
# Prompts
# ---------------------------------------------------------------------------------------


def _chunks(text: str, rng: np.random.Generator) -> list[str]:
    """Consecutive runs of whole lines, each aiming at a random 150-480 characters."""
    lines = text.splitlines(keepends=True)
    out, i = [], 0
    while i < len(lines):
        target = int(rng.integers(150, 480))
        buf, size = [], 0
        while i < len(lines) and size < target and size + len(lines[i]) <= PROMPT_MAX_CHARS:
            buf.append(lines[i])
            size += len(lines[i])
            i += 1
        if not buf:  # one line longer than any prompt may be
            i += 1
            continue
        chunk = "".join(buf).strip("\n")
        if PROMPT_MIN_CHARS <= len(chunk) <= PROMPT_MAX_CHARS and len(chunk.split()) >= 8:
            out.append(chunk)
    return out


def make_prompts(
    domain_to_heldout: dict[str, list[Document]],
    domain_to_train_text: dict[str, str],
    per_domain: int,
    seed: int,
    fresh: bool = False,
) -> list[dict]:
    """``per_domain`` prompts per domain from held-out documents, spread evenly over them.

    A chunk that also occurs verbatim in the domain's training text (licence boilerplate,
    include guards) is skipped, so every prompt is unseen text. ``fresh`` draws the same
    number, spread evenly too, from the chunks the default set did not pick: a second set
    of requests sharing no chunk with the first (ids ``<domain>-fresh-NNN``).
    """
    rng = np.random.default_rng(seed)
    prompts = []
    for domain in DOMAINS:
        candidates = []
        for doc in domain_to_heldout[domain]:
            for chunk in _chunks(doc.text, rng):
                if chunk not in domain_to_train_text[domain]:
                    candidates.append((doc.name, chunk))
        if len(candidates) < per_domain:
            raise RuntimeError(
                f"domain {domain!r} has only {len(candidates)} held-out prompt candidates, "
                f"fewer than the {per_domain} asked for; raise heldout_chars_per_domain"
            )
        picks = np.linspace(0, len(candidates) - 1, per_domain).round().astype(int)
        if fresh:
            taken = set(picks.tolist())
            candidates = [c for i, c in enumerate(candidates) if i not in taken]
            if len(candidates) < per_domain:
                raise RuntimeError(
                    f"domain {domain!r} has only {len(candidates)} held-out chunks left for a "
                    f"fresh set of {per_domain}; raise heldout_chars_per_domain"
                )
            picks = np.linspace(0, len(candidates) - 1, per_domain).round().astype(int)
        tag = f"{domain}-fresh" if fresh else domain
        for j, idx in enumerate(picks):
            source, text = candidates[idx]
            prompts.append(
                {"id": f"{tag}-{j:03d}", "domain": domain, "source": source, "text": text}
            )
    return prompts


def write_prompts(path: Path, prompts: list[dict]) -> None:
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        for p in prompts:
            f.write(json.dumps(p, ensure_ascii=False) + "\n")


# ---------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------


def render_training_md(log: dict) -> str:
    cfg, res = log["config"], log["results"]
    lines = [
        "# tiny_moe — how this model was trained",
        "",
        "Written by `examples/tiny_moe/train.py`; regenerate with",
        "`python examples/tiny_moe/train.py` (deterministic for a given machine and library",
        "versions). Machine-readable copy: `training_log.json`.",
        "",
        "## Model",
        "",
        f"`Qwen3MoeForCausalLM`: {cfg['num_hidden_layers']} decoder layers, all MoE; "
        f"{cfg['num_experts']} experts, top-{cfg['num_experts_per_tok']} (normalised gate "
        f"weights); hidden {cfg['hidden_size']}, expert FFN {cfg['moe_intermediate_size']}, "
        f"{cfg['num_attention_heads']} heads / {cfg['num_key_value_heads']} KV heads; "
        f"vocab {log['vocab_size']} (byte-level BPE, tied embeddings); "
        f"{log['num_parameters']:,} parameters, float32, "
        f"`model.safetensors` {log['safetensors_bytes'] / 1e6:.1f} MB.",
        "",
        "## Corpus (text shipped with CPython; one document in eight held out by name hash)",
        "",
        "| domain | source | train docs | train chars | train tokens "
        "| held-out docs | held-out chars | held-out tokens |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for d in DOMAINS:
        c = log["corpus"][d]
        lines.append(
            f"| {d} | {c['source']} | {c['train_docs']} | {c['train_chars']:,} | "
            f"{c['train_tokens']:,} | {c['heldout_docs']} | {c['heldout_chars']:,} | "
            f"{c['heldout_tokens']:,} |"
        )
    batch = cfg["seqs_per_domain"] * len(DOMAINS)
    lines += [
        "",
        "## Training",
        "",
        f"{cfg['steps']} steps of {batch} x {cfg['seq_len']} tokens "
        f"({cfg['seqs_per_domain']} random windows per domain per step, "
        f"{log['tokens_seen']:,} tokens in all); AdamW (betas 0.9/0.95, weight decay "
        f"{cfg['weight_decay']}), peak LR {cfg['peak_lr']}, {cfg['warmup_steps']} warmup steps, "
        f"cosine to {cfg['min_lr_ratio']} x peak; grad clip {cfg['grad_clip']}; router aux "
        f"loss coefficient {cfg['router_aux_loss_coef']}; seed {cfg['seed']}; "
        f"{cfg['num_threads']} CPU threads. Wall time {log['wall_seconds']['total']:.0f} s "
        f"(training {log['wall_seconds']['train']:.0f} s).",
        "",
        f"Final train LM loss (mean of the last 25 steps): {res['final_train_lm_loss']:.3f} nats"
        f" (ln vocab = {math.log(log['vocab_size']):.3f}).",
        "",
        "| domain | held-out loss at init | held-out loss | train-window loss |",
        "|---|---|---|---|",
    ]
    for d in DOMAINS:
        lines.append(
            f"| {d} | {res['heldout_loss_init'][d]:.3f} | {res['heldout_loss'][d]:.3f} | "
            f"{res['train_loss'][d]:.3f} |"
        )
    r, i0, rr = log["routing"]["trained"], log["routing"]["init"], log["routing"]["random"]
    lines += [
        "",
        "## Routing sanity (held-out windows)",
        "",
        f"{r['tokens_routed']:,} held-out tokens; {r['token_ids_with_min_occurrences']} token ids "
        f"occur at least {cfg['min_token_occurrences']} times.",
        "",
        "- top-k coverage: for a token id, the share of its routed (token, expert) picks that "
        "its own k most frequent experts account for (1.0 = always the same experts).",
        "- domain JS divergence: mean pairwise Jensen-Shannon divergence (bits) between the "
        "four domains' expert-load distributions.",
        "- next-layer top-1 accuracy: predicting layer l+1's top-1 expert from layer l's with "
        "a majority table, vs always guessing layer l+1's most common expert.",
        "",
        "| router | top-k coverage | domain JS divergence | next-layer top-1 acc. | baseline |",
        "|---|---|---|---|---|",
    ]
    for name, x in (("trained", r), ("untrained init", i0), ("uniform random", rr)):
        lines.append(
            f"| {name} | {x['topk_coverage_mean']:.3f} | {x['domain_js_divergence_mean']:.3f} | "
            f"{x['next_layer_top1_accuracy']:.3f} | {x['next_layer_top1_baseline']:.3f} |"
        )
    lines += [
        "",
        "Trained, per layer: top-k coverage "
        f"{r['topk_coverage_per_layer']}; domain JS divergence "
        f"{r['domain_js_divergence_per_layer']}; expert load max/mean "
        f"{r['load_max_over_mean_per_layer']}.",
        "",
        "## Domain expert loads (trained, held-out, share of activations per expert)",
        "",
    ]
    for d in DOMAINS:
        lines.append(f"- {d}, layer 0: {r['domain_load_layer0'][d]}")
    lines.append("")
    return "\n".join(lines)


SOURCES = {
    "python": "stdlib *.py (no tests, encodings, pydoc_data)",
    "prose": "pydoc topics, stdlib docstrings, LICENSE, idlelib *.txt",
    "c": "include/python3.x/**/*.h",
    "numeric": "test/decimaltestdata/*.decTest, test/*testcases.txt, floating_points.txt",
}


def build_corpus(cfg: TrainConfig) -> tuple[dict[str, list[Document]], dict[str, list[Document]]]:
    domain_to_train, domain_to_heldout = {}, {}
    for domain in DOMAINS:
        docs = collect_documents(domain)
        train_docs, heldout_docs = split_documents(
            docs, cfg.train_chars_per_domain, cfg.heldout_chars_per_domain
        )
        domain_to_train[domain] = sorted(train_docs, key=lambda d: d.name)
        domain_to_heldout[domain] = sorted(heldout_docs, key=lambda d: d.name)
    return domain_to_train, domain_to_heldout


def run(
    cfg: TrainConfig,
    out: Path,
    prompts_out: Path | None,
    prompts_only: bool,
    fresh_prompts_out: Path | None = None,
) -> dict:
    t_start = time.monotonic()
    domain_to_train, domain_to_heldout = build_corpus(cfg)
    train_text = {d: "\n".join(doc.text for doc in domain_to_train[d]) for d in DOMAINS}
    for path, fresh in ((prompts_out, False), (fresh_prompts_out, True)):
        if path is not None:
            prompts = make_prompts(
                domain_to_heldout, train_text, cfg.prompts_per_domain, cfg.seed, fresh=fresh
            )
            write_prompts(path, prompts)
            print(f"wrote {len(prompts)} prompts to {path}", file=sys.stderr)
    if prompts_only:
        return {}

    all_train = [doc.text for d in DOMAINS for doc in domain_to_train[d]]
    tokenizer = train_tokenizer(all_train, cfg.vocab_size)
    t_tok = time.monotonic()
    domain_to_stream = {d: encode_stream(tokenizer, domain_to_train[d]) for d in DOMAINS}
    domain_to_heldout_stream = {d: encode_stream(tokenizer, domain_to_heldout[d]) for d in DOMAINS}
    print(f"corpus + tokenizer: {t_tok - t_start:.0f}s", file=sys.stderr)

    model = make_model(cfg, tokenizer)
    model.eval()
    n = cfg.eval_windows_per_domain
    heldout_windows = {
        d: eval_windows(domain_to_heldout_stream[d], n, cfg.seq_len) for d in DOMAINS
    }
    train_windows = {d: eval_windows(domain_to_stream[d], n, cfg.seq_len) for d in DOMAINS}
    token_ids = torch.cat([heldout_windows[d].reshape(-1) for d in DOMAINS]).numpy()
    domain_sizes = [heldout_windows[d].numel() for d in DOMAINS]
    heldout_loss_init = {d: lm_loss(model, w) for d, w in heldout_windows.items()}
    init_experts = np.concatenate([route(model, heldout_windows[d]) for d in DOMAINS])

    t_train = time.monotonic()
    history = train(model, domain_to_stream, cfg)
    train_seconds = time.monotonic() - t_train

    heldout_loss = {d: lm_loss(model, w) for d, w in heldout_windows.items()}
    train_loss = {d: lm_loss(model, w) for d, w in train_windows.items()}
    trained_experts = np.concatenate([route(model, heldout_windows[d]) for d in DOMAINS])
    random_experts = random_router(
        len(token_ids), cfg.num_hidden_layers, cfg.num_experts, cfg.num_experts_per_tok, cfg.seed
    )
    routing = {
        name: routing_figures(token_ids, experts, domain_sizes, cfg)
        for name, experts in (
            ("trained", trained_experts),
            ("init", init_experts),
            ("random", random_experts),
        )
    }
    tail = history[-25:]
    log = {
        "config": dataclasses.asdict(cfg),
        "vocab_size": len(tokenizer),
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "tokens_seen": cfg.steps * cfg.seqs_per_domain * len(DOMAINS) * cfg.seq_len,
        "corpus": {
            d: {
                "source": SOURCES[d],
                "train_docs": len(domain_to_train[d]),
                "train_chars": sum(len(doc.text) for doc in domain_to_train[d]),
                "train_tokens": int(len(domain_to_stream[d])),
                "heldout_docs": len(domain_to_heldout[d]),
                "heldout_chars": sum(len(doc.text) for doc in domain_to_heldout[d]),
                "heldout_tokens": int(len(domain_to_heldout_stream[d])),
            }
            for d in DOMAINS
        },
        "results": {
            "final_train_lm_loss": round(sum(h["lm_loss"] for h in tail) / len(tail), 4),
            "final_aux_loss": round(sum(h["aux_loss"] for h in tail) / len(tail), 4),
            "heldout_loss_init": {d: round(v, 4) for d, v in heldout_loss_init.items()},
            "heldout_loss": {d: round(v, 4) for d, v in heldout_loss.items()},
            "train_loss": {d: round(v, 4) for d, v in train_loss.items()},
            "ln_vocab": round(math.log(len(tokenizer)), 4),
        },
        "routing": routing,
        "loss_history": [
            {k: round(v, 4) if isinstance(v, float) else v for k, v in h.items()}
            for h in history[::10]
        ],
        "versions": {
            "python": sys.version.split()[0],
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "tokenizers": tokenizers.__version__,
        },
    }
    # Router logits were needed for the aux loss in training; inference should not pay for them
    # (nor add the aux loss to ``loss``) unless a caller asks.
    model.config.output_router_logits = False
    with atomic_path(out) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        name_checkpoint(tmp / "config.json")
        log["safetensors_bytes"] = (tmp / "model.safetensors").stat().st_size
        log["wall_seconds"] = {
            "total": round(time.monotonic() - t_start, 1),
            "train": round(train_seconds, 1),
        }
        (tmp / "training_log.json").write_text(json.dumps(log, indent=2) + "\n")
        (tmp / "TRAINING.md").write_text(render_training_md(log))
    return log


MODEL_NAME = "moeplan/tiny-moe"


def name_checkpoint(config_path: Path) -> None:
    """Record a hub-style name, so traces and plans say ``moeplan/tiny-moe``, not the
    folder's name (``save_pretrained`` writes no ``_name_or_path``)."""
    config = json.loads(config_path.read_text())
    config["_name_or_path"] = MODEL_NAME
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None, help=f"default {DEFAULT_OUT}")
    parser.add_argument("--prompts-out", type=Path, default=None, help=f"default {DEFAULT_PROMPTS}")
    parser.add_argument("--quick", action="store_true", help="a one-minute smoke run")
    parser.add_argument("--prompts-only", action="store_true", help="only write the prompts")
    parser.add_argument(
        "--fresh-prompts-out",
        type=Path,
        default=None,
        help="also write a second, disjoint set of prompts (the committed one: "
        f"{DEFAULT_FRESH_PROMPTS})",
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    cfg = TrainConfig.quick(args.seed) if args.quick else TrainConfig(seed=args.seed)
    if args.quick:
        out = args.out or Path(tempfile.gettempdir()) / "tiny_moe_quick"
        if out.resolve() == DEFAULT_OUT:
            parser.error(f"--quick must not overwrite the committed model in {DEFAULT_OUT}")
        prompts_out = args.prompts_out or out.with_name(out.name + "_prompts.jsonl")
    else:
        out = args.out or DEFAULT_OUT
        prompts_out = args.prompts_out or DEFAULT_PROMPTS
    torch.set_num_threads(cfg.num_threads)
    torch.use_deterministic_algorithms(True)  # bit-identical reruns on the same machine
    log = run(cfg, out, prompts_out, args.prompts_only, args.fresh_prompts_out)
    if log:
        res = log["results"]
        print(
            f"saved {out}: train loss {res['final_train_lm_loss']:.3f}, held-out "
            + ", ".join(f"{d} {v:.3f}" for d, v in res["heldout_loss"].items())
            + f"; {log['wall_seconds']['total']:.0f}s",
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

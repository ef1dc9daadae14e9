"""A small neural token->expert predictor (MoE-GPS, paper 004 App. B, the FFN variant).

token embedding -> Linear(d, 128) -> ReLU -> Linear(128, 128) -> ReLU -> per-layer heads
Linear(128, N), one head per MoE layer (stacked as one Linear(128, L*N)). The embedding is
either the predictor's own ``nn.Embedding`` over the vocabulary (trained) or the model's
input embeddings (frozen, given as [V, d]).

Training uses the aggregated counts, not the trace: sampling token j with probability
proportional to its occurrences ``a_j`` and minimising the cross-entropy between the
softmax of each head and ``Cp[l][j]`` (the token's empirical routing distribution) is, in
expectation, the paper's per-occurrence cross-entropy on routed experts, at the cost of
one row per distinct token. It runs on CPU for ``max_steps`` steps, seeded, so that the same
seed gives the same predictor on any machine; an optional wall-clock budget stops it earlier
(and then the result depends on the machine's speed, which the training log records).

At inference the first layer is folded into a [V, 128] feature table (its input is fixed
per token), so a prediction is a gather, one 128x128 layer and the heads. A token the
predictor never trained on reads a zero input (the unknown token's row), and so gets the
network's answer for no token in particular; with model embeddings it gets the network's
genuine guess.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass

import numpy as np

from planner._checks import is_finite_number, is_integer
from planner.errors import InputError, SchemaError
from planner.predict.affinity import token_id_array
from planner.predict.counts import TokenExpertCounts

# Dense training targets are built once when they fit in this many floats, else per step.
_DENSE_TARGET_LIMIT = 50_000_000


@dataclass(frozen=True)
class NeuralConfig:
    """Settings of :class:`NeuralPredictor`.

    Attributes:
        embed_dim: width of the predictor's own token embedding (unused with model embeddings).
        hidden: width of the two hidden layers (128 in MoE-GPS).
        max_steps: optimisation steps (the budget: work, so the same seed gives the same
            predictor on any machine).
        time_budget_s: optional wall-clock budget in seconds besides (None: none); when it
            stops training before ``max_steps`` the result depends on the machine's speed
            and ``train_log_['stopped_by']`` says ``"time"``.
        batch_size: tokens per step (sampled with probability proportional to frequency).
        lr: Adam learning rate.
        seed: seed of initialisation and sampling.
        threads: torch CPU threads while training and predicting (1 is fastest on a
            small, shared machine: thread synchronisation dominates such small layers).
    """

    embed_dim: int = 64
    hidden: int = 128
    max_steps: int = 3000
    time_budget_s: float | None = None
    batch_size: int = 512
    lr: float = 1e-2
    seed: int = 0
    threads: int = 1

    def __post_init__(self) -> None:
        for name in ("embed_dim", "hidden", "max_steps", "batch_size", "threads"):
            value = getattr(self, name)
            most = 4096 if name == "threads" else 2**31 - 1  # torch takes int32
            if not is_integer(value) or not 1 <= value <= most:
                raise InputError(f"neural {name}={value!r} must be an integer in [1, {most}]")
            object.__setattr__(self, name, int(value))  # a numpy integer does not go to JSON
        if not is_integer(self.seed) or not 0 <= self.seed < 2**64:
            raise InputError(f"neural seed={self.seed!r} must be an integer in [0, 2**64)")
        object.__setattr__(self, "seed", int(self.seed))
        numbers = (self.lr,) if self.time_budget_s is None else (self.time_budget_s, self.lr)
        if not all(is_finite_number(x) for x in numbers):  # 10**400 too
            raise InputError("neural time_budget_s and lr must be finite numbers")
        if not all(x > 0 for x in numbers):
            raise InputError("neural time_budget_s and lr must be positive")
        object.__setattr__(self, "lr", float(self.lr))
        if self.time_budget_s is not None:
            object.__setattr__(self, "time_budget_s", float(self.time_budget_s))


def _torch():
    import torch

    return torch


@contextmanager
def _threads(n: int) -> Iterator[None]:
    """Run torch with ``n`` CPU threads, restoring the previous setting afterwards."""
    torch = _torch()
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class NeuralPredictor:
    """Token embedding -> MLP -> per-layer expert heads, trained on token-expert counts.

    Fitted attributes:
        features_: torch [V+1, hidden] float32 first hidden layer (pre-activation) per
            token; row V is the zero input (unknown tokens).
        body_: torch module mapping features to [*, L*N] logits.
        input_: "own-embedding" or "model-embedding".
        train_log_: dict with steps, seconds, first and final loss.
        num_layers_, num_experts_, top_k_: shapes.
    """

    def __init__(self, config: NeuralConfig = NeuralConfig()):
        self.config = config

    def _body(self, big_l: int, n: int):
        torch = _torch()
        h = self.config.hidden
        return torch.nn.Sequential(
            torch.nn.ReLU(), torch.nn.Linear(h, h), torch.nn.ReLU(), torch.nn.Linear(h, big_l * n)
        )

    def fit(
        self, counts: TokenExpertCounts, embeddings: np.ndarray | None = None
    ) -> NeuralPredictor:
        """Train on ``counts``; ``embeddings`` [V, d] (frozen) replaces the own embedding."""
        with _threads(self.config.threads):
            return self._fit(counts, embeddings)

    def _fit(self, counts: TokenExpertCounts, embeddings: np.ndarray | None) -> NeuralPredictor:
        torch = _torch()
        cfg = self.config
        m = counts.meta
        big_l, n, v = m.num_layers, m.num_experts, m.vocab_size
        activations = counts.token_activations()  # [L, V]
        freq = activations.sum(axis=0).astype(np.float64)
        seen = np.flatnonzero(freq > 0)
        if seen.size == 0:
            raise InputError(
                "neural predictor: no occurrence of a known token to train on (every token id "
                "is -1, unknown, or the fitting side is empty)"
            )
        gen = torch.Generator().manual_seed(cfg.seed)
        torch.manual_seed(cfg.seed)

        if embeddings is not None:
            # Rows scaled to unit RMS, in float64 a block at a time (squares of large float32
            # values overflow; a whole [V, d] float64 copy would not fit beside the model's).
            x = np.empty((len(embeddings), embeddings.shape[1]), np.float32)
            for s in range(0, x.shape[0], 8192):
                rows = np.asarray(embeddings[s : s + 8192], np.float64)
                rms = np.sqrt((rows**2).mean(axis=1, keepdims=True))
                x[s : s + 8192] = rows / np.maximum(rms, 1e-12)
            inputs = torch.from_numpy(np.ascontiguousarray(x))
            embed = None
            first = torch.nn.Linear(inputs.shape[1], cfg.hidden)
            self.input_ = "model-embedding"
        else:
            inputs = None
            # One row per trained token; every other token reads a zero input.
            embed = torch.nn.Embedding(seen.size, cfg.embed_dim)
            torch.nn.init.normal_(embed.weight, std=0.01, generator=gen)
            first = torch.nn.Linear(cfg.embed_dim, cfg.hidden)
            self.input_ = "own-embedding"
        body = self._body(big_l, n)
        params = list(first.parameters()) + list(body.parameters())
        if embed is not None:
            params += list(embed.parameters())
        opt = torch.optim.Adam(params, lr=cfg.lr)

        targets = _TargetRows(counts, seen)
        weights = torch.from_numpy(freq[seen] / freq[seen].sum())
        t0 = time.perf_counter()
        losses: list[float] = []
        step = 0
        clock = math.inf if cfg.time_budget_s is None else cfg.time_budget_s
        while step < cfg.max_steps and time.perf_counter() - t0 < clock:
            pick = torch.multinomial(
                weights, cfg.batch_size, replacement=True, generator=gen
            ).numpy()
            idx = torch.from_numpy(pick)
            if inputs is not None:
                feats = first(inputs[torch.from_numpy(seen[pick])])
            else:
                assert embed is not None  # set whenever inputs is None
                feats = first(embed(idx))
            logits = body(feats).view(-1, big_l, n)
            target = torch.from_numpy(targets.rows(pick))
            loss = -(target * torch.log_softmax(logits, dim=-1)).sum(-1).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
            step += 1
        seconds = time.perf_counter() - t0

        with torch.no_grad():
            # Row V: a zero input (token_id -1, and with an own embedding every untrained token).
            features = first.bias.expand(v + 1, -1).clone()
            if inputs is not None:
                for s in range(0, v, 8192):
                    features[s : min(s + 8192, v)] = first(inputs[s : s + 8192])
            else:
                assert embed is not None  # set whenever inputs is None
                features[torch.from_numpy(seen)] = first(embed.weight)
            self.features_ = features
        self.body_ = body.eval()
        self.num_layers_, self.num_experts_, self.top_k_ = big_l, n, m.top_k
        tail = losses[-20:]
        self.train_log_ = {
            "steps": step,
            "stopped_by": "steps" if step >= cfg.max_steps else "time",
            "seconds": round(seconds, 3),
            "first_loss": round(losses[0], 5) if losses else None,
            "final_loss": round(float(np.mean(tail)), 5) if tail else None,
            "trained_tokens": int(seen.size),
            "input": self.input_,
        }
        return self

    def _check_fitted(self) -> None:
        if not hasattr(self, "features_"):
            raise InputError("NeuralPredictor is not fitted; call fit() first")

    def predict_logits(self, token_ids: np.ndarray):
        """torch [T, L, N] logits of ``token_ids`` [T]; ``-1`` (unknown) reads a zero input."""
        torch = _torch()
        self._check_fitted()
        v = self.features_.shape[0] - 1
        ids = token_id_array(token_ids, v)  # a float id (1.7) was read as token 1
        rows = torch.from_numpy(np.where(ids < 0, v, ids))
        with _threads(self.config.threads), torch.no_grad():
            return self.body_(self.features_[rows]).view(-1, self.num_layers_, self.num_experts_)

    def predict_topk(self, token_ids: np.ndarray) -> np.ndarray:
        """[T, L, k] int16 predicted experts at every layer, most likely first."""
        torch = _torch()
        logits = self.predict_logits(token_ids)
        return torch.topk(logits, self.top_k_, dim=-1).indices.numpy().astype(np.int16)

    # -- persistence ---------------------------------------------------------------------------

    def settings(self) -> dict:
        self._check_fitted()
        return {"config": asdict(self.config), "train_log": self.train_log_, "input": self.input_,
                "num_layers": self.num_layers_, "num_experts": self.num_experts_, "top_k": self.top_k_}  # fmt: skip

    def to_tensors(self) -> dict[str, np.ndarray]:
        self._check_fitted()
        out = {"features": self.features_.detach().numpy().astype(np.float32)}
        for name, value in self.body_.state_dict().items():
            out[f"body.{name}"] = value.detach().numpy().astype(np.float32)
        return out

    @classmethod
    def from_tensors(
        cls, tensors: dict[str, np.ndarray], settings: dict, vocab_size: int
    ) -> NeuralPredictor:
        torch = _torch()
        for name, value in tensors.items():
            if value.dtype != np.float32 or not np.isfinite(value).all():
                raise SchemaError(
                    f"neural tensor {name!r} must hold finite float32 values (it is {value.dtype})"
                )
        try:
            self = cls(NeuralConfig(**settings["config"]))
            big_l, n, k = settings["num_layers"], settings["num_experts"], settings["top_k"]
            h, features = self.config.hidden, tensors["features"]
            if tuple(features.shape) != (vocab_size + 1, h):
                raise SchemaError(
                    f"neural features have shape {tuple(features.shape)}, "
                    f"expected ({vocab_size + 1}, {h})"
                )
            # the shapes the settings imply, checked before the body allocates them (an
            # edited manifest could ask for any size)
            shapes = {"1.weight": (h, h), "1.bias": (h,), "3.weight": (big_l * n, h)}
            shapes["3.bias"] = (big_l * n,)
            given = {k2[5:]: v for k2, v in tensors.items() if k2.startswith("body.")}
            if {name: tuple(v.shape) for name, v in given.items()} != shapes:
                raise SchemaError(
                    "neural predictor body tensors do not match its settings "
                    f"(hidden {h}, {big_l} layers x {n} experts)"
                )
            body = self._body(big_l, n)
            body.load_state_dict(
                {name: torch.from_numpy(np.ascontiguousarray(v)) for name, v in given.items()}
            )
            features = torch.from_numpy(np.ascontiguousarray(features))
        except (KeyError, TypeError, RuntimeError) as e:
            raise SchemaError(f"neural predictor tensors or settings are malformed ({e})") from None
        self.features_, self.body_ = features, body.eval()
        self.num_layers_, self.num_experts_, self.top_k_ = int(big_l), int(n), int(k)
        self.train_log_, self.input_ = (
            settings.get("train_log", {}),
            settings.get("input", "own-embedding"),
        )
        return self


class _TargetRows:
    """Soft targets ``Cp[l][j]`` [B, L, N] float32 for rows ``seen[pick]`` of the counts."""

    def __init__(self, counts: TokenExpertCounts, seen: np.ndarray):
        m = counts.meta
        self._layers = [c[seen] for c in counts.by_layer]  # [U, N] each
        self._dense = None
        if seen.size * m.num_layers * m.num_experts <= _DENSE_TARGET_LIMIT:
            self._dense = self._build(np.arange(seen.size))

    def _build(self, rows: np.ndarray) -> np.ndarray:
        out = np.stack([c[rows].toarray() for c in self._layers], axis=1).astype(np.float32)
        total = out.sum(axis=2, keepdims=True)
        return np.divide(out, total, out=np.zeros_like(out), where=total > 0)

    def rows(self, pick: np.ndarray) -> np.ndarray:
        return self._dense[pick] if self._dense is not None else self._build(pick)

"""Synthetic routing traces whose ground truth is known.

Predictors and solvers are tested against traces where we know what there is to learn. The
generator reproduces the structure the papers exploit (Speculative MoE §3, Sem-MoE §2,
SP-MoE §3): tokens follow a Zipf law with a long tail of rare ids; each token prefers a
fixed set of experts at each layer (token->expert affinity); a token's top-1 expert at one
layer hints at its top-1 at the next (inter-layer affinity); experts differ in popularity;
requests come from a few domains with their own vocabularies.

How one row is drawn (T rows, L layers, N experts, k routed per layer):

1. Request r has ``lengths[r]`` tokens (a Dirichlet split of ``num_tokens``) and a domain.
2. Each token is drawn from a mixture: with probability ``_SHARED_TOKEN_SHARE`` from a Zipf
   law over the whole vocabulary, otherwise from a Zipf law over the tokens whose *home
   domain* is the request's domain.
3. At layer l the token has a *target set* of k distinct experts: its preferred set
   ``preferred[l, token]`` or, with probability ``layer_correlation`` (l > 0), the set
   ``successors[l, e]`` that follows the expert e it was sent to first at layer l-1.
4. Each of the k slots keeps the target's expert with probability ``affinity``; the other
   slots are drawn from the layer's expert popularity, then any duplicate is redrawn, so
   the k experts of a layer are always distinct.
5. Gate weights are a softmax of descending logits (random positive gaps), so they are
   positive, descending and sum to 1 within a layer; they are independent of the experts.

Preferred sets are drawn from the layer popularity tilted towards the token's home domain,
so ``expert_zipf`` skews the load whatever the affinity. With ``affinity=1`` and
``layer_correlation=0`` every occurrence of a token routes to exactly its preferred set;
with ``affinity=0`` routing ignores the token.

Glossary: *preferred set* [L, V, k], the ground truth a token->expert predictor should
recover; *successor set* [L, N, k], what layer l's routing follows when it follows layer
l-1's top-1 expert.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from planner._checks import is_finite_number, is_integer
from planner._io import atomic_path, refuse_existing
from planner._progress import progress_bar
from planner.errors import InputError
from planner.trace.io import TraceBatch, check_trace_output, open_trace
from planner.trace.schema import TraceMeta

# Share of token draws that come from the vocabulary-wide Zipf law rather than the
# request's domain (function words, punctuation and the like are shared across domains).
_SHARED_TOKEN_SHARE = 0.5
# Standard deviation of the log-normal tilt a domain puts on expert popularity when its
# tokens' preferred sets are drawn.
_DOMAIN_EXPERT_TILT = 0.5
# Mean gap between consecutive gate logits (larger: a more dominant top-1 weight).
_WEIGHT_LOGIT_GAP = 0.5
# Gate-weight vectors are drawn from a bank of this many pre-drawn vectors: weights carry
# no routing signal, so this saves k exponentials per (token, layer).
_WEIGHT_BANK = 4096
# Rows are generated in fixed chunks, each from its own seeded stream, so the content does
# not depend on the batch size asked for.
_CHUNK_ROWS = 32768
# Forward steps after a guide-table lookup before falling back to bisection.
_GUIDE_WALK = 8
# Rounds of redrawing duplicates before the rest are filled exactly (Gumbel top-k).
_REDRAW_ROUNDS = 3

# Stream tags for np.random.default_rng([seed, tag, ...]).
_TAG_STRUCTURE, _TAG_PREFERRED, _TAG_SUCCESSORS, _TAG_CHUNK = 0, 1, 2, 3


@dataclass(frozen=True)
class SynthConfig:
    """Every knob of the synthetic generator (validated when built).

    Attributes:
        num_layers: L MoE layers.
        num_experts: N routed experts per layer.
        top_k: k experts per token and layer.
        vocab_size: V token ids.
        num_tokens: T token occurrences, split over ``num_requests`` requests of varying length.
        num_requests: R requests (each at least one token).
        token_zipf: Zipf exponent of token frequencies (0 = uniform).
        expert_zipf: Zipf exponent of expert popularity per layer (0 = uniform load).
        affinity: probability in [0, 1] that a routed slot is the target set's expert rather
            than a draw from the layer's expert popularity.
        layer_correlation: probability in [0, 1] that a token's target set at layer l > 0
            follows its top-1 expert at layer l-1 instead of the token itself.
        num_domains: D request domains, each with its own vocabulary and expert tilt.
        seed: seed of every random choice.
        model: model name recorded in the trace metadata.
        first_moe_layer: model layer index of the first MoE layer (dense layers before it).
    """

    num_layers: int = 8
    num_experts: int = 64
    top_k: int = 6
    vocab_size: int = 32000
    num_tokens: int = 200_000
    num_requests: int = 400
    token_zipf: float = 1.1
    expert_zipf: float = 0.6
    affinity: float = 0.8
    layer_correlation: float = 0.5
    num_domains: int = 4
    seed: int = 0
    model: str = "synthetic"
    first_moe_layer: int = 0

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_experts", "top_k", "vocab_size", "num_tokens",
                     "num_requests", "num_domains"):  # fmt: skip
            value = getattr(self, name)
            if not is_integer(value) or value < 1:
                raise InputError(f"synth: {name}={value!r} must be a positive integer")
            object.__setattr__(self, name, int(value))  # a numpy integer does not go to JSON
        for name in ("seed", "first_moe_layer"):
            value = getattr(self, name)
            if not is_integer(value) or value < 0:
                raise InputError(f"synth: {name}={value!r} must be a non-negative integer")
            object.__setattr__(self, name, int(value))
        if self.top_k > self.num_experts:
            raise InputError(
                f"synth: top_k={self.top_k} exceeds num_experts={self.num_experts}; "
                "choose top_k <= num_experts"
            )
        if self.num_experts > 32767:
            raise InputError(f"synth: num_experts={self.num_experts} does not fit int16 ids")
        for name, most in (("num_tokens", 2**40), ("num_layers", 4096), ("first_moe_layer", 2**20)):
            if getattr(self, name) > most:
                raise InputError(f"synth: {name}={getattr(self, name)} exceeds {most}")
        if self.vocab_size > 2**31 - 1:
            raise InputError(f"synth: vocab_size={self.vocab_size} does not fit int32 ids")
        if self.num_requests > self.num_tokens:
            raise InputError(
                f"synth: num_requests={self.num_requests} exceeds num_tokens={self.num_tokens}; "
                "every request needs at least one token"
            )
        if self.num_domains > self.vocab_size:
            raise InputError(
                f"synth: num_domains={self.num_domains} exceeds vocab_size={self.vocab_size}"
            )
        for name in ("token_zipf", "expert_zipf"):
            value = getattr(self, name)
            if not is_finite_number(value) or value < 0:
                raise InputError(f"synth: {name}={value!r} must be a finite number >= 0")
            object.__setattr__(self, name, float(value))
        for name in ("affinity", "layer_correlation"):
            value = getattr(self, name)
            if not is_finite_number(value) or not 0.0 <= value <= 1.0:
                raise InputError(f"synth: {name}={value!r} must lie in [0, 1]")
            object.__setattr__(self, name, float(value))
        if not isinstance(self.model, str) or not self.model:
            raise InputError(f"synth: model={self.model!r} must be a non-empty string")

    def to_json(self) -> str:
        """The config as a JSON object (what a synthetic trace's ``source`` holds)."""
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> SynthConfig:
        """Inverse of :meth:`to_json`, e.g. ``SynthConfig.from_json(trace.meta.source)``."""
        try:
            d = json.loads(text)
        except ValueError as e:
            raise InputError(f"synth: config is not valid JSON ({e})") from None
        if not isinstance(d, dict):
            raise InputError("synth: config JSON must be an object")
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - fields)
        if unknown:
            raise InputError(f"synth: unknown config field(s) {', '.join(unknown)}")
        return cls(**d)


DEEPSEEK_V3 = SynthConfig(
    num_layers=58,
    num_experts=256,
    top_k=8,
    vocab_size=129280,
    model="synthetic-deepseek-v3",
    first_moe_layer=3,
)
"""DeepSeek-V3's routing shape: 61 layers of which the last 58 are MoE, 256 experts, top-8."""

PRESETS: dict[str, SynthConfig] = {"default": SynthConfig(), "deepseek-v3": DEEPSEEK_V3}


def preset_config(preset: str = "default", **overrides) -> SynthConfig:
    """The named preset with ``overrides`` (field name -> value; None means keep) applied."""
    if preset not in PRESETS:
        raise InputError(f"synth: unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    changes = {name: value for name, value in overrides.items() if value is not None}
    fields = {f.name for f in dataclasses.fields(SynthConfig)}
    unknown = sorted(set(changes) - fields)
    if unknown:
        raise InputError(f"synth: unknown config field(s) {', '.join(unknown)}")
    return dataclasses.replace(PRESETS[preset], **changes)


# ---------------------------------------------------------------------------------------
# Sampling helpers (private: they assume validated input).


def _zipf_probs(n: int, exponent: float) -> np.ndarray:
    """[n] probabilities of ranks 0..n-1 under a Zipf law, p(r) ∝ (r + 1) ** -exponent."""
    p = np.arange(1, n + 1, dtype=np.float64) ** -float(exponent)
    return p / p.sum()


class _GroupedCdf:
    """Inverse-CDF sampling from G categorical distributions stored end to end.

    Group g's cumulative probabilities are shifted by g, so one table serves every group:
    a uniform u in group g is looked up as x = g + u. A guide table (Chen's method) gives,
    for each of ``m`` equal buckets per group, the first outcome whose cdf exceeds the
    bucket's lower edge; a short forward walk finishes the search, O(1) expected per draw.
    """

    def __init__(self, probs: list[np.ndarray]):
        self.offsets = np.zeros(len(probs) + 1, np.int64)
        self.offsets[1:] = np.cumsum([p.size for p in probs])
        shifted = []
        for g, p in enumerate(probs):
            cdf = np.cumsum(p / p.sum())
            cdf[-1] = 1.0
            shifted.append(cdf + g)
        self._cdf = np.concatenate(shifted)
        self._m = 2 * max(p.size for p in probs)
        edges = np.arange(len(probs) * self._m, dtype=np.float64) / self._m
        self._guide = np.searchsorted(self._cdf, edges, side="right")

    def sample(self, u: np.ndarray, group: np.ndarray | int = 0) -> np.ndarray:
        """Index into the concatenated outcomes for uniforms ``u`` [...] in ``group`` [...]."""
        x = u + group
        shape = x.shape
        x = x.ravel()
        group = np.broadcast_to(group, shape).ravel()
        bucket = np.minimum((x * self._m).astype(np.int64), (group + 1) * self._m - 1)
        j = self._guide[bucket]
        # x = g + u may round up to g + 1 for u just below 1: never walk past the group.
        last = self.offsets[group + 1] - 1
        active = np.flatnonzero((self._cdf[j] <= x) & (j < last))
        for _ in range(_GUIDE_WALK):
            if not active.size:
                break
            j[active] += 1
            ja = j[active]
            active = active[(self._cdf[ja] <= x[active]) & (ja < last[active])]
        if active.size:  # a bucket crowded with tiny outcomes (a steep Zipf tail): bisect
            hit = np.searchsorted(self._cdf, x[active], side="right")
            j[active] = np.minimum(hit, last[active])
        return j.reshape(shape)


def _distinct_rows(
    rows: np.ndarray,
    free: np.ndarray,
    cdf: _GroupedCdf,
    log_probs: np.ndarray,
    group: np.ndarray | None,
    rng: np.random.Generator,
) -> None:
    """Make the k entries of every row distinct, in place, changing only ``free`` slots.

    Args:
        rows: [R, k] int expert ids; the non-free entries of a row must be distinct.
        free: [R, k] bool, slots that were drawn at random and may be redrawn.
        cdf: the distributions redraws come from (group g's experts at g * N ...).
        log_probs: [G, N] log popularity of each group's experts.
        group: [R] group of each row, or None for group 0.

    A free slot is redrawn while it repeats a fixed slot or an earlier slot, so each row
    ends as a draw without replacement. After a few rounds the remaining rows are filled
    exactly from the experts not yet in the row (Gumbel top-k), which always terminates.
    """
    n = log_probs.shape[1]
    todo = np.arange(rows.shape[0])
    for round_ in range(_REDRAW_ROUNDS + 1):
        bad = _clashes(rows[todo], free[todo])
        hit = bad.any(axis=1)
        todo, bad = todo[hit], bad[hit]
        if todo.size == 0:
            return
        sub = rows[todo]
        if round_ < _REDRAW_ROUNDS:
            r = np.nonzero(bad)[0]
            g = 0 if group is None else group[todo[r]]
            sub[bad] = cdf.sample(rng.random(r.size), g) - (0 if group is None else g * n)
        else:
            _fill_exactly(sub, bad, log_probs[0 if group is None else group[todo]], rng)
        rows[todo] = sub


def _clashes(rows: np.ndarray, free: np.ndarray) -> np.ndarray:
    """[R, k] bool: free slots equal to a fixed slot or to an earlier slot of their row."""
    k = rows.shape[1]
    cols, free_cols = np.ascontiguousarray(rows.T), np.ascontiguousarray(free.T)
    bad = np.zeros_like(free_cols)
    for j in range(k):
        if not free_cols[j].any():
            continue
        for i in range(k):
            if i == j:
                continue
            same = cols[j] == cols[i]
            if i > j:  # a later slot only wins when it is fixed
                same &= ~free_cols[i]
            bad[j] |= same
        bad[j] &= free_cols[j]
    return bad.T


def _fill_exactly(
    rows: np.ndarray, bad: np.ndarray, log_probs: np.ndarray, rng: np.random.Generator
) -> None:
    """Refill the ``bad`` slots of ``rows`` [R, k] from experts not in the row, in place.

    Gumbel top-k over ``log_probs`` [R, N] (or [N]) with the row's other experts masked
    out: a draw without replacement that always succeeds since k <= N.
    """
    num, k = rows.shape
    # probabilities that underflowed to 0 (a steep expert_zipf) floored to a finite log, so
    # that the row's own experts, masked with -inf below, still rank last
    keys = np.maximum(log_probs, -1e300) + rng.gumbel(size=(num, log_probs.shape[-1]))
    kept_r, kept_j = np.nonzero(~bad)
    keys[kept_r, rows[kept_r, kept_j]] = -np.inf
    best = np.argsort(-keys, axis=1, kind="stable")[:, :k]
    order = np.cumsum(bad, axis=1) - 1  # the j-th bad slot of a row takes its j-th best
    rows[bad] = best[np.nonzero(bad)[0], order[bad]]


# ---------------------------------------------------------------------------------------


class SynthGenerator:
    """Deterministic generator of synthetic trace rows and their ground truth.

    Attributes:
        config: the :class:`SynthConfig`.
        meta: :class:`TraceMeta` of the traces it makes; ``source`` is the config as JSON.
        expert_popularity: [L, N] float64, each row sums to 1.
        token_home_domain: [V] int64, the domain whose vocabulary holds each token.
        request_lengths: [R] int64 tokens per request (sums to T).
        request_domain: [R] int64 domain of each request.
    """

    def __init__(self, config: SynthConfig):
        if not isinstance(config, SynthConfig):
            raise InputError(f"synth: expected a SynthConfig, got {type(config).__name__}")
        c = self.config = config
        self.meta = TraceMeta(
            model=c.model,
            num_layers=c.num_layers,
            num_experts=c.num_experts,
            top_k=c.top_k,
            vocab_size=c.vocab_size,
            moe_layer_indices=tuple(range(c.first_moe_layer, c.first_moe_layer + c.num_layers)),
            source=c.to_json(),
        )
        big_l, n, v, d = c.num_layers, c.num_experts, c.vocab_size, c.num_domains
        rng = np.random.default_rng([c.seed, _TAG_STRUCTURE])

        # Expert popularity: a Zipf law over a random ranking of each layer's experts.
        ranks = np.argsort(rng.random((big_l, n)), axis=1)
        self.expert_popularity = _zipf_probs(n, c.expert_zipf)[ranks]
        tilt = np.exp(_DOMAIN_EXPERT_TILT * rng.standard_normal((d, big_l, n)))
        domain_pop = self.expert_popularity[None] * tilt
        domain_pop /= domain_pop.sum(axis=2, keepdims=True)
        with np.errstate(divide="ignore"):  # log 0 = -inf: a steep expert_zipf's tail
            self._layer_log_pop = np.log(self.expert_popularity)  # [L, N]
            self._domain_log_pop = np.log(domain_pop)  # [D, L, N]
        self._layer_cdf = [_GroupedCdf([pop]) for pop in self.expert_popularity]
        self._domain_cdf = [_GroupedCdf(list(domain_pop[:, i])) for i in range(big_l)]

        # Vocabulary: each token has a home domain; a global and a per-domain Zipf ranking.
        self.token_home_domain = rng.permutation(v) % d
        self._global_rank_to_token = rng.permutation(v)
        by_domain = [np.flatnonzero(self.token_home_domain == g) for g in range(d)]
        by_domain = [rng.permutation(t) for t in by_domain]
        self._domain_rank_to_token = np.concatenate(by_domain)  # grouped by domain
        self._global_token_cdf = _GroupedCdf([_zipf_probs(v, c.token_zipf)])
        self._domain_token_cdf = _GroupedCdf([_zipf_probs(t.size, c.token_zipf) for t in by_domain])

        # Requests: lengths vary (Dirichlet split), each at least one token.
        share = rng.dirichlet(np.ones(c.num_requests))
        self.request_lengths = 1 + rng.multinomial(c.num_tokens - c.num_requests, share)
        self._request_offsets = np.concatenate([[0], np.cumsum(self.request_lengths)])
        self.request_domain = rng.integers(0, d, c.num_requests)

        # Gate weights: softmax of descending logits, minus a cumulative sum of positive gaps.
        gaps = rng.standard_exponential((_WEIGHT_BANK, c.top_k)) * _WEIGHT_LOGIT_GAP
        logits = -np.cumsum(gaps, axis=1)
        w = np.exp(logits - logits[:, :1])
        self._weight_bank = (w / w.sum(axis=1, keepdims=True)).astype(np.float16)  # [W, k]

        self._successors = self._draw_successors()
        self._preferred: np.ndarray | None = None

    # -- ground truth -------------------------------------------------------------------

    @property
    def preferred_table(self) -> np.ndarray:
        """[L, V, k] int16 preferred expert set of every token at every layer (built once)."""
        if self._preferred is None:
            c = self.config
            table = np.empty((c.num_layers, c.vocab_size, c.top_k), np.int16)
            for layer in range(c.num_layers):
                table[layer] = self._draw_preferred(layer)
            self._preferred = table
        return self._preferred

    def preferred_experts(self, token_ids: np.ndarray, layer: int) -> np.ndarray:
        """[T, k] int16 ground-truth preferred experts of ``token_ids`` [T] at ``layer``.

        This is the token-only component of routing: with ``affinity=1`` and
        ``layer_correlation=0`` every occurrence of a token routes to exactly this set.
        """
        c = self.config
        if not is_integer(layer) or not 0 <= layer < c.num_layers:
            raise InputError(f"synth: layer {layer!r} outside [0, {c.num_layers})")
        token_ids = np.asarray(token_ids)
        if token_ids.size and (token_ids.min() < 0 or token_ids.max() >= c.vocab_size):
            bad = token_ids.min() if token_ids.min() < 0 else token_ids.max()
            raise InputError(f"synth: token id {int(bad)} outside [0, {c.vocab_size})")
        return self.preferred_table[layer][token_ids]

    @property
    def successor_table(self) -> np.ndarray:
        """[L, N, k] int16 target set at layer l of a token whose top-1 at l-1 was e (row 0 unused)."""
        return self._successors

    def _draw_preferred(self, layer: int) -> np.ndarray:
        """[V, k] preferred sets at ``layer``, drawn from the home domain's tilted popularity."""
        c = self.config
        rng = np.random.default_rng([c.seed, _TAG_PREFERRED, layer])
        home = self.token_home_domain
        cdf = self._domain_cdf[layer]
        u = rng.random((c.vocab_size, c.top_k))
        rows = cdf.sample(u, home[:, None]) - (home[:, None] * c.num_experts)
        free = np.ones(rows.shape, bool)
        _distinct_rows(rows, free, cdf, self._domain_log_pop[:, layer], home, rng)
        return rows.astype(np.int16)

    def _draw_successors(self) -> np.ndarray:
        c = self.config
        rng = np.random.default_rng([c.seed, _TAG_SUCCESSORS])
        out = np.empty((c.num_layers, c.num_experts, c.top_k), np.int16)
        for layer in range(c.num_layers):
            cdf = self._layer_cdf[layer]
            rows = cdf.sample(rng.random((c.num_experts, c.top_k)))
            free = np.ones(rows.shape, bool)
            _distinct_rows(rows, free, cdf, self._layer_log_pop[layer][None], None, rng)
            out[layer] = rows
        return out

    # -- rows ---------------------------------------------------------------------------

    def _chunk(self, index: int) -> TraceBatch:
        """Rows [index * _CHUNK_ROWS, ...) of the trace, from their own seeded stream."""
        c = self.config
        big_l, k = c.num_layers, c.top_k
        start = index * _CHUNK_ROWS
        rows = np.arange(start, min(start + _CHUNK_ROWS, c.num_tokens), dtype=np.int64)
        t = rows.size
        rng = np.random.default_rng([c.seed, _TAG_CHUNK, index])

        request_id = np.searchsorted(self._request_offsets, rows, side="right") - 1
        position = rows - self._request_offsets[request_id]
        domain = self.request_domain[request_id]

        shared = rng.random(t) < _SHARED_TOKEN_SHARE
        u = rng.random(t)
        from_global = self._global_rank_to_token[self._global_token_cdf.sample(u)]
        from_domain = self._domain_rank_to_token[self._domain_token_cdf.sample(u, domain)]
        token_id = np.where(shared, from_global, from_domain)

        preferred = self.preferred_table
        experts = np.empty((t, big_l, k), np.int16)
        top1: np.ndarray | None = None
        for layer in range(big_l):
            target = preferred[layer][token_id].astype(np.int32)
            follow = rng.random(t) < c.layer_correlation
            if layer > 0 and c.layer_correlation > 0:
                assert top1 is not None  # set by the previous layer
                target[follow] = self._successors[layer][top1[follow]]
            free = rng.random((t, k)) >= c.affinity
            cdf = self._layer_cdf[layer]
            target[free] = cdf.sample(rng.random(int(free.sum())))
            _distinct_rows(target, free, cdf, self._layer_log_pop[layer][None], None, rng)
            experts[:, layer] = target
            top1 = target[:, 0]

        w = self._weight_bank[rng.integers(0, _WEIGHT_BANK, (t, big_l))]

        return TraceBatch.from_arrays(
            request_id, position, token_id, experts, w, extras={"domain": domain.astype(np.int32)}
        )

    def batches(self, batch_rows: int = 65536) -> Iterator[TraceBatch]:
        """Stream the whole trace in request-major order, ``batch_rows`` rows at a time.

        Rows are deterministic given the config (whatever ``batch_rows``); each batch carries
        ``extras["domain"]`` [T] int32, the domain of each row's request.
        """
        if not is_integer(batch_rows) or batch_rows < 1:
            raise InputError(f"synth: batch_rows={batch_rows!r} must be a positive integer")
        num_chunks = -(-self.config.num_tokens // _CHUNK_ROWS)
        pending: TraceBatch | None = None
        for index in range(num_chunks):
            chunk = self._chunk(index)
            pending = chunk if pending is None else TraceBatch.concat([pending, chunk])
            while len(pending) >= batch_rows:
                yield pending.select(slice(0, batch_rows))
                pending = pending.select(slice(batch_rows, None))
        if pending is not None and len(pending):
            yield pending


# ---------------------------------------------------------------------------------------


def synthesize(
    config: SynthConfig,
    out: str | Path,
    *,
    rows_per_part: int = 1_000_000,
    progress: bool = False,
    overwrite: bool = False,
) -> Path:
    """Write the synthetic trace of ``config`` to ``out`` and return its path.

    ``out`` ending in ``.parquet`` gives a single file, anything else a directory of
    ``part-NNNNN.parquet`` files of at most ``rows_per_part`` rows. Rows are streamed (one
    row group per 65536 rows), so memory stays bounded whatever ``num_tokens``. The file or
    directory appears only once complete; an existing one is replaced only with
    ``overwrite=True``, and only if it is an earlier trace (or an empty directory).
    """
    out = Path(out)
    if not is_integer(rows_per_part) or rows_per_part < 1:
        raise InputError(f"synth: rows_per_part={rows_per_part!r} must be a positive integer")
    refuse_existing(out, overwrite)
    # --force replaces an earlier trace only: never another file, nor a non-empty directory
    # of another kind.
    single = check_trace_output(out)
    gen = SynthGenerator(config)
    batch_rows = min(65536, rows_per_part)
    with (
        progress_bar(progress, "synthesising", config.num_tokens, unit="tokens") as advance,
        atomic_path(out) as tmp,
    ):
        if not single:
            tmp.mkdir()
        writer: pq.ParquetWriter | None = None
        part, part_rows = 0, 0
        try:
            for batch in gen.batches(batch_rows):
                if writer is not None and not single and part_rows + len(batch) > rows_per_part:
                    writer.close()
                    writer, part, part_rows = None, part + 1, 0
                table = batch.to_table(gen.meta)
                if writer is None:
                    dest = tmp if single else tmp / f"part-{part:05d}.parquet"
                    writer = pq.ParquetWriter(dest, table.schema, compression="zstd")
                writer.write_table(table)
                part_rows += len(batch)
                advance(len(batch))
        finally:
            if writer is not None:
                writer.close()
    open_trace(out)  # the result must read back as a v1 trace
    return out


def synth_summary(path: str | Path, seconds: float | None = None) -> dict:
    """Short JSON-ready summary of a written synthetic trace (for the CLI)."""
    trace = open_trace(path)
    m = trace.meta
    size = sum(p.stat().st_size for p in trace.parts)
    out = {
        "path": str(path),
        "model": m.model,
        "tokens": trace.num_rows,
        "num_layers": m.num_layers,
        "num_experts": m.num_experts,
        "top_k": m.top_k,
        "vocab_size": m.vocab_size,
        "parts": len(trace.parts),
        "bytes": size,
    }
    if seconds is not None:
        out["seconds"] = round(seconds, 2)
    return out


def timed_synthesize(config: SynthConfig, out: str | Path, **kwargs) -> dict:
    """:func:`synthesize`, then :func:`synth_summary` with the wall time it took."""
    t0 = time.perf_counter()
    path = synthesize(config, out, **kwargs)
    return synth_summary(path, time.perf_counter() - t0)

"""Cross-entropy optimisation (CEO) of the co-placement (paper 000 App. B, Algorithm 1).

The Rubinstein cross-entropy method: keep a categorical distribution over devices for every
item, draw placements from it, keep the best ``elite`` fraction, move the distribution
towards them, repeat.

``variant="paper"`` is Algorithm 1 as written:

- distributions ``P_ep`` [N, E] for experts and ``P_tk`` [J, E] for tokens, uniform at first;
- balanced sampling (``sample`` in Algorithm 1): items are drawn in index order from their
  row of P restricted to the devices not yet masked; a device is masked once it holds N/E
  experts, or (tokens) once its token load (sum of ``a_j``, proportional to the tokens'
  activations) reaches ``beta x S / E``. One departure, for speed: tokens are drawn in
  blocks of ``token_block`` (256) with the masks updated between blocks, so a device may
  overshoot by one block's share. It is small only where J >> 256: the worst sample's load
  over the cap was 1.24 against 1.17 token by token at J = 2000, E = 8 (1.36 against 1.16
  with a peaked P), 1.03 against 1.00 at J = 20000; the final repair brings the tokens
  within the cap either way. ``token_block=1`` is the paper's sampling exactly;
- each (expert sample, token sample) pair is scored by its local activations; the top
  ``elite`` (ρ = 0.2) fraction updates both distributions, smoothed:
  ``P <- smoothing x elite frequencies + (1 - smoothing) x P``. Algorithm 1 says only
  "update" and gives no constant (nor the sample count K or the number of rounds): the
  smoothing 0.7, 32 samples and 40 rounds are our choice (``smoothing=1`` is the
  unsmoothed update);
- after ``iterations`` rounds: experts = argmax of ``P_ep`` and tokens = argmax of
  ``P_tk``, then the shared repairs (exactly N/E experts per device, token loads within the
  cap, keeping the most probable tokens in place). It runs all its ``iterations`` (only
  the time limit stops it sooner): the ``effort`` budget below is the improved variant's,
  and by its cost table the paper's 32 joint samples a round would spend it in about 4
  rounds on a DeepSeek-V3-sized layer at EP 8 and 2 at EP 32 (of 40): no longer the
  algorithm as written.

``variant="improved"`` (the default) keeps the cross-entropy loop over expert placements
(balanced sampling, elite fraction, smoothing) and changes what is sampled and scored; each
change has a switch, and ``benchmarks/solve_quality.py`` shows its effect. Beside the
switches below it draws 8 samples a round for 30 rounds (``samples``, ``iterations``),
draws each sample's experts in a random order rather than index order, mixes ``explore``
(0.02) of the uniform distribution into P every round so that no device's probability
reaches 0, and adds the repaired mode of the final distribution to the candidates the
polish considers:

- ``assign_tokens``: only expert placements are sampled (N/E per device by construction);
  each is scored with its best tokens, the shared capacity assignment
  (:func:`planner.solve.assign.assign_tokens`), instead of an independent token sample.
  Scoring uses the ``score_tokens`` most frequent tokens (capacity scaled to their load;
  about 16k gain entries by default) and as many of the heaviest load-free rows (n-gram
  contexts, :mod:`planner.solve.ngram_term`), with dual prices warm-started between samples;
- ``align_labels``: device labels are arbitrary, so elite samples are relabelled (linear
  assignment on their overlap with the best placement so far) before they are averaged;
- ``local_search``: every sample is first improved by the shared local search
  (:func:`planner.solve.polish.polish` on the scoring tokens, at most ``search_rounds``
  rounds; ``search_swaps`` adds priced expert swaps), so the distribution learns from local
  optima (a memetic cross-entropy method). This is the change that matters most. The
  loop stops after ``iterations`` rounds, or restarts from the uniform distribution after
  ``patience`` rounds without a better sample (``restarts`` times at most);
- ``polish``: the ``screen`` best distinct placements found are re-scored on all tokens and
  the best ``candidates`` are polished on all tokens (exact expert moves, then swaps);
- ``batch_aware``: when the predictor recorded the fitting trace's runtime batches
  (:mod:`planner.predict.batches`), every score is the objective net of what the runtime's
  per-batch cap would take back (:func:`planner.solve.common.batch_overflow`). A placement
  that puts each batch's experts on few devices is local on paper and loses at serving time
  when batches are not a random mix (e.g. one domain at a time); the search then prefers
  placements that let every batch use all devices. A candidate keeps its unpolished form
  when the polish lowers this score. Without batches, or in penalty mode, it changes nothing.
- ``clusterings``: the ``clusterings`` (3) lowest-inertia balanced k-means clusterings of
  the experts, as the ``kmeans`` baseline finds them (its defaults, the same seed), are
  screened beside the search's best placements and polished with them if they score best:
  a start the search did not reach still competes (a multi-start from a heuristic). On the
  36 held-out cases of ``benchmarks/compare_traces.py`` (session 41, with the baselines
  choosing among their own candidates as CEO does): 34 wins instead of 33, mean ratio to the
  best baseline 1.027 instead of 1.025, worst 0.993 instead of 0.990; 0.25-0.5 s more a
  DeepSeek-V3-shaped layer (3.8 s at EP 8, 3.2 s at EP 32). Not under an expert-load cap;
- ``enumerate``: where the balanced placements are few enough to screen every one within
  the search's budget (:func:`enumerable`: at most :data:`SCORE_ALL`, so 8 experts on 2
  or 4 devices; on two devices up to :data:`MAX_SCREENED` placements under the token cap,
  so 16 experts), the search is replaced by the screen: each placement is bounded by the
  fractional optimum of its token assignment (:func:`two_device_bound`, on the heaviest
  rows), the best :data:`ENUMERATE_KEEP` by the bound are scored as the samples are, and
  the best of those go to the screening and polish below. On the example model's 16
  experts at EP 2 the cross-entropy search, local search and all, had stopped short of the
  best placement in 2 of 6 layers (by 0.3% and 1.7% of the layer's score) and now reaches
  it; held out by request its balanced LAR with the routed n-gram statistic rose by
  0.6-0.9% (`benchmarks/RESULTS.md`, session 55);
- with one expert a device (EP = N) or one device the search is skipped: every placement
  is then a relabelling of every other and scores the same, so the contiguous placement
  goes straight to the polish (FLAME-MoE's 64 experts at EP 64: the same plan quality,
  0.7 s instead of 21 s);
- ``expert_cap``: with an expert-load cap (``SolverConfig.expert_beta``,
  :mod:`planner.solve.expert_balance`) the search chooses among capped placements by its
  whole score (n-gram term and batch take-back included) instead of being capped after.
  ``"repair"`` (default): every sample is brought under the cap
  (:meth:`~planner.solve.expert_balance.ExpertLimit.repair`) before and again after its
  local search, which itself runs free; the final polish only moves within the cap.
  ``"search"`` keeps the samples' local search within the cap too; ``"after"`` searches
  as without a cap and leaves it to the post-step, as for the other methods. On the
  DeepSeek-V3-shaped layer of ``benchmarks/solve_speed.py`` at cap 1.25 (LAR; uncapped
  0.4332 at EP 8): EP 8 repair 0.4323, search 0.4234, after 0.4303; EP 32 0.2821, 0.2769,
  0.2742 (the best baseline, k-means capped after, 0.2767): the constrained local search
  moves less per unit of work. On the 36 held-out cases of
  ``benchmarks/compare_traces.py --expert-beta 1.25`` repair and search both win all 36
  (mean ratio to the best baseline 1.033 and 1.035).

Budget: ``effort`` work units per layer (default :data:`DEFAULT_EFFORT`, about 5 s on the
reference machine), counted by the shared kernels (:mod:`planner.solve.effort`), not timed:
the search stops after ``search_share`` of it; of the rest, the last full token assignment
keeps what it needs (about 2.5 times a screening assignment), the screening gets half of
what remains and the polish the other half. So the result depends on the inputs and the
seed only, not on the machine's speed or load, nor on ``--jobs``
(``info["search_cut_by_budget"]`` says whether the budget cut the search; ``info["effort"]``
is the work spent, ``info["effort_budget"]`` the budget). A whole model solved by
:func:`planner.solve.plan.solve_model` gets a default budget for the model, shared over its
layers (:func:`model_layer_effort`: 7.5M per layer up to 38 layers, 5M from 58 on).
``time_budget`` (soft seconds, off by default) adds a wall-clock budget split the same way;
with it the result depends on the machine again.
``SolverConfig.time_limit`` is a hard wall-clock limit on all of it.
``warm_start`` (off by default) starts the distribution around a balanced k-means
clustering of the experts instead of uniform. Measured at the edges of
``benchmarks/compare_traces.py`` (``--ep 2,32 --sources flame --seeds 0,1 --ceo-options
'{"warm_start": 0.3}'``): the mean ratio to the best baseline rose from 1.009 to 1.015
(EP 32 up to +2.6%), but every EP 2 case but one fell (down to -0.5%) and 4 of the 8
cases were lost instead of 3, so it stays off.

Token confidence is the share of the token's predicted activations local on its device, as
for every solver (the paper's probability ``P_tk`` is reported in ``info`` for the paper
variant as its mean).
"""

from __future__ import annotations

import itertools
import math
import time

import numpy as np
from scipy.optimize import linear_sum_assignment

from planner.errors import InputError
from planner.solve.common import (
    assign_for_problem,
    batch_overflow,
    canonical_labels,
    check_options,
    device_gains,
    finish,
    improves,
    net_objective,
    objective,
    rebalance_tokens,
    repair_expert_counts,
)
from planner.solve.effort import COSTS, Effort, charge
from planner.solve.expert_balance import ExpertLimit
from planner.solve.kmeans import DEFAULTS as KMEANS_DEFAULTS
from planner.solve.kmeans import balanced_kmeans, clusterings, expert_profiles
from planner.solve.polish import polish
from planner.solve.problem import LayerPlacement, LayerProblem, SolverConfig

VARIANTS = ("improved", "paper")
# Default work budget per layer (``effort`` option, units of planner.solve.effort): 5.5-6 s
# for a DeepSeek-V3-sized layer on the reference machine, about 8 s with two solving
# processes sharing its two cores, so that 58 such layers solve within 5 minutes with
# --jobs 2 (benchmarks/solve_speed.py --full).
DEFAULT_EFFORT = 5.0e6
# A whole model's default budget (planner.solve.plan.solve_model): what DEFAULT_EFFORT per
# layer gives a 58-layer DeepSeek-V3, shared out over a smaller model's layers, each layer
# getting between DEFAULT_EFFORT and MAX_LAYER_EFFORT (model_layer_effort). More search is
# not better without end on held-out data (benchmarks/compare_traces.py: 5M -> 7.5M per layer
# won the example's one lost case and cost FLAME-MoE 0.7% of its lead), hence the cap.
MODEL_EFFORT = 58 * DEFAULT_EFFORT
MAX_LAYER_EFFORT = 1.5 * DEFAULT_EFFORT
# Most labels the samples of one round may hold: each is a float64 draw and an int64 label
# (16 bytes), so 2**26 of them take 1 GiB; the defaults draw at most 32 x (N + J), 1.6M for a
# DeepSeek-V3 layer. More was asked only by mistake, and died of memory part way through.
MAX_SAMPLE_CELLS = 2**26

EXPERT_CAP_MODES = ("repair", "search", "after")

DEFAULTS: dict[str, object] = {
    "variant": "improved",
    "samples": None,  # K samples per iteration (None: 32 paper, 8 improved)
    "iterations": None,  # rounds at most (None: 40 paper, 30 improved)
    "patience": 5,  # improved: rounds without a better sample before a restart (0: never)
    "restarts": 2,  # improved: restarts from the uniform distribution before stopping
    "elite": 0.2,  # ρ, elite fraction
    "smoothing": 0.7,  # weight of the elite frequencies in the update
    "token_block": 256,  # paper: tokens drawn per block between mask updates
    # improved-variant switches (ignored by the paper variant)
    "assign_tokens": True,  # sample experts only; tokens by the shared assignment
    "local_search": True,  # polish every sample on the scoring tokens (search over local optima)
    "align_labels": True,  # relabel elite samples onto the best before averaging
    "search_swaps": True,  # the samples' local search also tries expert swaps
    "search_rounds": 8,  # local-search rounds per sample at most
    "polish": True,  # polish the best candidates on all tokens
    # score placements net of what the runtime's per-batch cap takes back on the fitting
    # batches (when the predictor recorded them; planner.solve.common.batch_overflow)
    "batch_aware": True,
    # start P as (1 - w) onehot(balanced k-means of the expert profiles) + w uniform
    # (0 or None: uniform start, as in the paper)
    "warm_start": None,
    # improved: the balanced k-means baseline's lowest-inertia clusterings (its defaults, the
    # same seed) screened beside the search's candidates (0: none; module doc)
    "clusterings": 3,
    # improved: where every balanced expert placement can be screened within the search's
    # budget (8 experts on 2 or 4 devices, 16 on 2: module doc), screen them all instead of
    # searching
    "enumerate": True,
    "explore": 0.02,  # mixed into P each round so no device probability reaches 0
    "screen": 9,  # best distinct placements of the search re-scored on all tokens
    "candidates": 3,  # of those, the best polished on all tokens
    # tokens used to score samples, most frequent first (None: max(1024, 16384 // E), so
    # the scoring gain matrix has about 16k entries whatever E is)
    "score_tokens": None,
    "price_sweeps": 4,  # dual-price sweeps per token assignment while searching
    # work per layer, in the deterministic units of planner.solve.effort (about a
    # microsecond each on the reference machine; None: unlimited)
    "effort": DEFAULT_EFFORT,
    "time_budget": None,  # soft seconds per layer besides (None: none); the time limit is hard
    "search_share": 0.6,  # share of the budget for the search, the rest for the final polish
    # with SolverConfig.expert_beta (module doc): "repair" brings every sample under the
    # cap after its local search, "search" keeps the local search within it too, "after"
    # searches without it and leaves it to the post-step (as for the other methods)
    "expert_cap": "repair",
}
# kinds of the options whose default does not say it (planner.solve.common.check_options)
KINDS = {  # 0 samples, rounds or scoring tokens is no search: at least 1, or null
    "samples": "count+?",
    "iterations": "count+?",
    "token_block": "count+",
    "warm_start": "number?",
    "score_tokens": "count+?",
    "effort": "number?",
    "time_budget": "number?",
}


def model_layer_effort(num_layers: int) -> float:
    """The default ``effort`` of each layer when a model of ``num_layers`` MoE layers is solved.

    MODEL_EFFORT / num_layers, clipped to [DEFAULT_EFFORT, MAX_LAYER_EFFORT]: a model of up
    to 38 layers gets 7.5M units per layer, a 58-layer one 5M, and larger ones 5M as well
    (their solve time grows with the layer count, as before).
    """
    share = MODEL_EFFORT / max(int(num_layers), 1)
    return float(min(MAX_LAYER_EFFORT, max(DEFAULT_EFFORT, share)))


def solve(problem: LayerProblem, config: SolverConfig) -> LayerPlacement:
    started = time.perf_counter()
    opts = check_options("ceo", config.for_method("ceo"), DEFAULTS, KINDS)
    if opts["variant"] not in VARIANTS:
        raise InputError(f"ceo: variant={opts['variant']!r} is not one of {', '.join(VARIANTS)}")
    # shares and probabilities: (0, 1] where 0 would leave nothing, else [0, 1]
    for name, zero_ok in (("elite", False), ("smoothing", False), ("search_share", False),
                          ("explore", True), ("warm_start", True)):  # fmt: skip
        value = opts[name]
        if value is not None and not (0.0 <= float(value) <= 1.0 and (zero_ok or value > 0)):
            raise InputError(
                f"ceo: {name}={value!r} must lie in {'[0, 1]' if zero_ok else '(0, 1]'}"
            )
    if opts["variant"] == "paper" and problem.balance != "cap":
        raise InputError(
            "ceo: the paper variant scores samples by local activations under the token cap; "
            "penalty mode (theta) needs the improved variant"
        )
    if opts["expert_cap"] not in EXPERT_CAP_MODES:
        modes = ", ".join(EXPERT_CAP_MODES)
        raise InputError(f"ceo: expert_cap={opts['expert_cap']!r} is not one of {modes}")
    _check_samples(problem, opts)
    deadline = config.deadline(started)
    if opts["variant"] == "paper":  # the paper's search knows no expert cap: capped after
        x, t, info = _solve_paper(problem, opts, config.seed, deadline)
    else:
        after = opts["expert_cap"] == "after"
        cap = None if after else ExpertLimit.of(problem, config.expert_beta)
        x, t, info = _solve_improved(problem, opts, config.seed, started, deadline, cap)
    return finish(
        problem, "ceo", x, seed=config.seed, started=started, token_to_device=t, info=info
    )


def _num_samples(opts: dict) -> int:
    """K, the samples a round: the ``samples`` option, else 32 (paper) or 8 (improved)."""
    return int(opts["samples"] or (32 if opts["variant"] == "paper" else 8))


def _check_samples(problem: LayerProblem, opts: dict) -> None:
    """InputError if one round's samples would not fit in MAX_SAMPLE_CELLS labels: every
    sample labels each expert, and each token too unless tokens are assigned, not drawn."""
    paper = opts["variant"] == "paper"
    samples = _num_samples(opts)
    drawn = problem.num_experts + (problem.num_tokens if paper or not opts["assign_tokens"] else 0)
    if samples * drawn > MAX_SAMPLE_CELLS:
        raise InputError(
            f"ceo: samples={samples} draws {samples} x {drawn} labels a round, more than "
            f"{MAX_SAMPLE_CELLS}; use at most {max(1, MAX_SAMPLE_CELLS // drawn)} samples"
        )


# Sampling -----------------------------------------------------------------------------------


def sample_balanced(
    rng: np.random.Generator,
    prob: np.ndarray,
    num_samples: int,
    weight: np.ndarray,
    capacity: float,
    *,
    block: int = 1,
    order: np.ndarray | None = None,
) -> np.ndarray:
    """Draw ``num_samples`` labelings of M items from their categorical rows, balanced.

    Args:
        prob: [M, E] each item's distribution over devices.
        weight: [M] load each item puts on its device.
        capacity: a device is masked once its load reaches ``capacity``.
        block: items drawn between mask updates (1 = exactly Algorithm 1's ``sample``).
        order: [K, M] per-sample item order (None: index order, as in Algorithm 1).

    Returns:
        [K, M] int64 labels. Items are drawn from their row restricted to unmasked devices
        (uniformly over them when the row puts no mass there). With unit weights and
        ``capacity = M / E`` every device ends with exactly M / E items.
    """
    m, e = prob.shape
    k = num_samples
    labels = np.empty((k, m), dtype=np.int64)
    load = np.zeros((k, e))
    open_ = np.ones((k, e), dtype=bool)
    rows = np.arange(k)[:, None]
    for start in range(0, m, block):
        stop = min(start + block, m)
        items = (
            np.arange(start, stop)[None, :].repeat(k, 0) if order is None else order[:, start:stop]
        )
        p = prob[items] * open_[:, None, :]  # [K, b, E]
        mass = p.sum(axis=-1, keepdims=True)
        uniform = np.broadcast_to(open_[:, None, :], p.shape).astype(float)
        p = np.where(
            mass > 0, p / np.where(mass > 0, mass, 1.0), uniform / uniform.sum(-1, keepdims=True)
        )
        u = rng.random((k, stop - start, 1))
        lab = np.minimum((np.cumsum(p, axis=-1) < u).sum(axis=-1), e - 1)
        # a rounding step past the last open device must not land on a masked one
        bad = ~open_[rows, lab]
        if bad.any():
            lab[bad] = np.argmax(np.broadcast_to(open_[:, None, :], p.shape)[bad], axis=-1)
        labels[rows, items] = lab
        np.add.at(load, (np.broadcast_to(rows, lab.shape), lab), weight[items])
        open_ &= load < capacity * (1 - 1e-9)  # relative: loads below 1 balance too
        if not open_.any(axis=1).all():  # every device full (only possible at the very end)
            open_ |= ~open_.any(axis=1, keepdims=True)
    return labels


def _onehot_mean(labels: np.ndarray, e: int) -> np.ndarray:
    """[M, E] frequency of each label per item over the K rows of ``labels`` [K, M]."""
    k, m = labels.shape
    counts = np.zeros((m, e))
    np.add.at(counts, (np.broadcast_to(np.arange(m), labels.shape), labels), 1.0)
    return counts / k


def relabel_map(labels: np.ndarray, reference: np.ndarray, e: int) -> np.ndarray:
    """[E] device map sending ``labels`` [M] onto ``reference`` [M] with most overlap (LSA)."""
    overlap = np.zeros((e, e))
    np.add.at(overlap, (reference, labels), 1.0)
    ref_dev, lab_dev = linear_sum_assignment(overlap, maximize=True)
    mapping = np.empty(e, dtype=np.int64)
    mapping[lab_dev] = ref_dev
    return mapping


def align(labels: np.ndarray, reference: np.ndarray, e: int) -> np.ndarray:
    """``labels`` [M] relabelled to overlap ``reference`` [M] the most."""
    return relabel_map(labels, reference, e)[labels]


# Paper variant ------------------------------------------------------------------------------


def _solve_paper(problem: LayerProblem, opts: dict, seed: int, deadline: float | None):
    rng = np.random.default_rng(seed)
    num_samples = _num_samples(opts)
    iterations = int(opts["iterations"] or 40)
    p_ep, p_tk, done, cut = _cross_entropy_joint(
        problem,
        opts,
        rng,
        num_samples,
        iterations,
        _Stops(deadline, None),
        align_labels=False,
        random_order=False,
    )
    x = repair_expert_counts(p_ep.argmax(axis=1), p_ep.T, problem.experts_per_device)
    gain = device_gains(problem, x)
    t = rebalance_tokens(problem, p_tk.argmax(axis=1), gain, priority=p_tk.max(axis=1))
    info = {
        "variant": "paper",
        "iterations": done,
        "samples": num_samples,
        "cut_by_time_limit": cut,
        "mean_token_probability": float(p_tk.max(axis=1).mean()) if problem.num_tokens else 0.0,
    }
    return x, t, info


def _cross_entropy_joint(
    problem,
    opts,
    rng,
    num_samples,
    iterations,
    stop,
    *,
    align_labels,
    random_order,
    effort=None,
):
    """Algorithm 1's loop: sample experts and tokens, score, update. -> (P_ep, P_tk, iters, cut).

    ``random_order`` draws the experts of each sample in a random order (index order in the
    paper); ``align_labels`` relabels elite pairs onto the best sample so far. The loop
    stops at ``stop`` (a :class:`_Stops`: time and/or the work charged to ``effort``).
    """
    n, e, per = problem.num_experts, problem.ep_size, problem.experts_per_device
    n_elite = max(1, math.ceil(float(opts["elite"]) * num_samples))
    alpha = float(opts["smoothing"])
    load = problem.token_freq
    token_cap = problem.capacity
    p_ep = np.full((n, e), 1.0 / e)
    p_tk = np.full((problem.num_tokens, e), 1.0 / e)
    w = problem.affinity
    rows, cols, vals = problem.nnz_rows, w.indices, w.data
    best_score, best_ep = -np.inf, None
    done, cut = 0, False
    for _ in range(iterations):
        if stop.reached(effort):
            cut = True
            break
        charge(effort, "ce_joint", entries=w.nnz + (n + problem.num_tokens) * e, calls=num_samples)
        order = np.argsort(rng.random((num_samples, n)), axis=1) if random_order else None
        ep = sample_balanced(rng, p_ep, num_samples, np.ones(n), per, order=order)
        tk = sample_balanced(
            rng, p_tk, num_samples, load, token_cap, block=int(opts["token_block"])
        )
        # score: local activations of each (expert sample, token sample) pair
        scores = np.array([vals[ep[s, cols] == tk[s, rows]].sum() for s in range(num_samples)])
        ranked = np.argsort(-scores, kind="stable")
        if scores[ranked[0]] > best_score:
            best_score, best_ep = float(scores[ranked[0]]), ep[ranked[0]].copy()
        ep_elite, tk_elite = ep[ranked[:n_elite]], tk[ranked[:n_elite]]
        if align_labels:
            maps = [relabel_map(s, best_ep, e) for s in ep_elite]
            ep_elite = np.stack([m[s] for m, s in zip(maps, ep_elite, strict=True)])
            tk_elite = np.stack([m[s] for m, s in zip(maps, tk_elite, strict=True)])
        p_ep = alpha * _onehot_mean(ep_elite, e) + (1 - alpha) * p_ep
        p_tk = alpha * _onehot_mean(tk_elite, e) + (1 - alpha) * p_tk
        done += 1
    return p_ep, p_tk, done, cut


# Improved variant ---------------------------------------------------------------------------


class _Scorer:
    """Scores expert placements on the most frequent tokens (capacity scaled to their load).

    ``__call__(x)`` -> (x', score): with ``local_search`` the placement is first polished
    (:func:`planner.solve.polish.polish` on the scoring tokens), so the search runs over
    local optima; otherwise x' = x and the score is that of the capacity assignment. The
    score is the objective, net of the batch cap's take-back with ``batch_aware`` (then
    x' is whichever of x and its polished form scores higher).
    """

    def __init__(
        self,
        problem: LayerProblem,
        num_tokens: int,
        sweeps: int,
        local_search: bool,
        swaps: bool,
        rounds: int,
        batch_aware: bool,
        effort: Effort,
        limit: ExpertLimit | None = None,
        repair_after: bool = False,
        deadline: float | None = None,
    ):
        self.deadline = deadline  # the samples' polish stops there (a time limit is hard)
        self.problem = heaviest_part(problem, max(1, num_tokens))  # the scoring set
        self.sweeps = sweeps
        self.local_search = local_search
        self.swaps = swaps
        self.rounds = rounds
        self.batch_aware = batch_aware
        self.effort = effort
        self.limit = limit
        self.repair_after = repair_after
        self.prices: np.ndarray | None = None

    def __call__(self, x: np.ndarray) -> tuple[np.ndarray, float]:
        sub, effort = self.problem, self.effort
        gain = device_gains(sub, x, effort)
        result = assign_for_problem(
            sub, gain, prices=self.prices, sweeps=self.sweeps, exact=False, effort=effort
        )
        if self.prices is None:
            self.prices = result.prices
        t = result.token_to_device
        if self.limit is not None and not self.limit.allows(x):
            # a sample over the expert cap is brought under it before it is scored (or to
            # the lowest peak the swaps reach), so the search learns from placements it may
            # return
            x, t = self._repair(x, t)
            gain = device_gains(sub, x, effort)
        if not self.local_search:
            return x, _score(sub, gain, t, self.batch_aware, effort)
        before = _score(sub, gain, t, self.batch_aware, effort) if self.batch_aware else -np.inf
        y, t, _ = polish(
            sub, x, t, sweeps=self.sweeps, max_rounds=self.rounds, swaps=self.swaps,
            exact=False, effort=effort, limit=None if self.repair_after else self.limit,
            deadline=self.deadline,
        )  # fmt: skip
        if self.repair_after and self.limit is not None and not self.limit.allows(y):
            y, t = self._repair(y, t)
        after = _score(sub, device_gains(sub, y, effort), t, self.batch_aware, effort)
        # the polish raises the objective; net of the batch cap it may not
        return (y, after) if after >= before else (x, before)

    def _repair(self, x: np.ndarray, t: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``x`` under the expert cap (:meth:`ExpertLimit.repair`), its tokens assigned again."""
        sub, effort = self.problem, self.effort
        assert self.limit is not None  # only called with a cap
        charge(effort, "place_experts", entries=sub.affinity.nnz, steps=x.size * x.size)
        x = self.limit.repair(sub, x, t)
        gain = device_gains(sub, x, effort)
        result = assign_for_problem(
            sub, gain, prices=self.prices, sweeps=self.sweeps, exact=False, effort=effort
        )
        return x, result.token_to_device


def heaviest_part(problem: LayerProblem, count: int) -> LayerProblem:
    """``problem`` on its ``count`` heaviest token rows and as many heaviest load-free rows
    (n-gram contexts), so that neither kind crowds the other out (itself if that is all)."""
    free = problem.token_freq == 0
    keep = np.union1d(problem.heaviest_rows(count, ~free), problem.heaviest_rows(count, free))
    return problem if keep.size == problem.num_tokens else problem.select_tokens(keep)


def _scoring_tokens(problem: LayerProblem, opts: dict) -> int:
    """The ``score_tokens`` option, else max(1024, 16384 // E): about 16k gain entries."""
    return int(opts["score_tokens"] or max(1024, 16384 // problem.ep_size))


def _score(
    problem: LayerProblem, gain: np.ndarray, t: np.ndarray, batch_aware: bool, effort=None
) -> float:
    """The objective, net of the runtime cap's take-back on the fitting batches if asked."""
    return net_objective(problem, gain, t, effort) if batch_aware else objective(problem, gain, t)


def _earliest(a: float | None, b: float | None) -> float | None:
    return b if a is None else (a if b is None else min(a, b))


def _solve_improved(
    problem: LayerProblem,
    opts: dict,
    seed: int,
    started: float,
    deadline: float | None,
    cap: ExpertLimit | None = None,
):
    rng = np.random.default_rng(seed)
    num_samples = _num_samples(opts)
    iterations = int(opts["iterations"] or 30)
    share = float(opts["search_share"])
    # The budget: ``effort`` work units (deterministic) and/or ``time_budget`` soft seconds.
    # The search gets ``search_share`` of it; of the rest, the last full token assignment
    # keeps what it needs (about 2.5 screening assignments, 30 sweeps against 10), the
    # screening gets half of what is left before it and the polish the other half.
    limit = None if opts["effort"] is None else float(opts["effort"])
    budget = opts["time_budget"]
    search_end, polish_end = deadline, deadline
    if budget is not None:
        search_end = _earliest(deadline, started + share * float(budget))
        polish_end = _earliest(deadline, started + float(budget))
    effort = Effort()  # the search checks its share itself: samples are not cut short
    search_stop = _Stops(search_end, None if limit is None else share * limit)
    # One expert a device (or one device): every placement is a relabelling of every other,
    # and the score (n-gram term, batch take-back and expert cap included) does not see
    # labels, so there is nothing to search; the candidate is the contiguous placement.
    skipped = problem.experts_per_device == 1 or problem.ep_size == 1
    clustered = 0
    enumerated = (
        not skipped
        and bool(opts["assign_tokens"])
        and bool(opts["enumerate"])
        and enumerable(problem, None if limit is None else share * limit)
    )
    if skipped:
        candidates = [np.arange(problem.num_experts) // problem.experts_per_device]
        tokens, its, cut = [None], (0, 0), False
    elif enumerated:
        candidates, cut = _enumerate_experts(problem, opts, search_stop, effort, cap)
        tokens, its = [None] * len(candidates), (0, 0)
    elif opts["assign_tokens"]:
        candidates, its, cut = _cross_entropy_experts(
            problem, opts, rng, num_samples, iterations, search_stop, effort,
            cap, repair_after=opts["expert_cap"] == "repair",
        )  # fmt: skip
        if opts["clusterings"] and cap is None:  # (they know no expert-load cap)
            # screened right after the search's best, before the screening budget runs out
            runs, _, _ = clusterings(
                problem, seed, KMEANS_DEFAULTS | {"evaluate": int(opts["clusterings"])}, search_end
            )
            seen = {canonical_labels(x, problem.ep_size).tobytes() for x in candidates}
            extra = [
                labels
                for _, labels, _ in runs
                if canonical_labels(labels, problem.ep_size).tobytes() not in seen
            ]
            candidates = candidates[:1] + extra + candidates[1:]
            clustered = len(extra)
        tokens = [None] * len(candidates)
    else:
        p_ep, p_tk, its, cut = _cross_entropy_joint(
            problem, opts, rng, num_samples, iterations, search_stop,
            align_labels=bool(opts["align_labels"]), random_order=True, effort=effort,
        )  # fmt: skip
        x = repair_expert_counts(p_ep.argmax(axis=1), p_ep.T, problem.experts_per_device)
        candidates, tokens = [x], [p_tk.argmax(axis=1)]
    aware = bool(opts["batch_aware"])
    screened = []
    polish_stop, screen_stop = _Stops(polish_end, limit), _Stops(polish_end, limit)
    for x, t in zip(candidates, tokens, strict=True):
        tick, units = time.perf_counter(), effort.spent
        gain = device_gains(problem, x, effort)
        if t is None:
            t = assign_for_problem(problem, gain, sweeps=10, effort=effort).token_to_device
        else:
            t = rebalance_tokens(problem, t, gain, priority=gain[np.arange(t.size), t])
        screened.append((_score(problem, gain, t, aware, effort), x, t))
        if len(screened) == 1:
            polish_stop = polish_stop.reserve(
                2.5 * (time.perf_counter() - tick), 2.5 * (effort.spent - units)
            )
            screen_stop = polish_stop.halfway(time.perf_counter(), effort.spent)
        if not opts["polish"] or screen_stop.reached(effort):
            break
    # the clusterings sit right after the search's best: those the screening reached
    clustered = min(clustered, max(0, len(screened) - 1))
    screened.sort(key=lambda item: -item[0])
    best, log = None, []
    effort.stop = polish_stop.units  # polish() checks the meter between moves
    for score_ce, x, t in screened[: max(1, int(opts["candidates"]))]:
        rounds, score = 0, score_ce
        if opts["polish"] and not polish_stop.reached(effort):
            # cheap exact-expert rounds first, then rounds with swaps while budget remains
            y, u, rounds = polish(
                problem, x, t, deadline=polish_stop.seconds, sweeps=10, swaps=False,
                effort=effort, limit=cap,
            )  # fmt: skip
            y, u, more = polish(
                problem, y, u, deadline=polish_stop.seconds, sweeps=10, swaps=True,
                effort=effort, limit=cap,
            )  # fmt: skip
            rounds += more
            polished = _score(problem, device_gains(problem, y, effort), u, aware, effort)
            # the polish raises the objective; net of the batch cap it may not
            if polished >= score_ce:
                x, t, score = y, u, polished
        log.append({"score_search": score_ce, "score_final": score, "polish_rounds": rounds})
        if best is None or score > best[0]:
            best = (score, x, t)
        if polish_stop.reached(effort):
            break
    assert best is not None  # both searches give at least one candidate (CE: its mode)
    _, x, t = best
    # A last, fully converged token assignment for the final experts.
    gain = device_gains(problem, x, effort)
    t_final = assign_for_problem(problem, gain, effort=effort).token_to_device
    if _score(problem, gain, t_final, aware) >= _score(problem, gain, t, aware):
        t = t_final
    flags = {
        k: opts[k]
        for k in ("assign_tokens", "local_search", "align_labels", "polish", "batch_aware")
    }
    info = {
        "variant": "improved",
        **flags,
        "samples": num_samples,
        "iterations": its[0] if isinstance(its, tuple) else its,
        "restarts_used": its[1] if isinstance(its, tuple) else 0,
        "search_cut_by_budget": cut,
        "search_skipped": skipped,
        "enumerated": enumerated,
        "clusterings_screened": clustered,
        "effort": round(effort.spent),
        "effort_budget": None if limit is None else round(limit),
        "candidates": log,
    }
    if cap is not None:  # the search kept to the expert-load cap
        info["expert_bound"] = round(cap.bound, 3)
    if aware and problem.batch_freq is not None:
        info["batch_overflow"] = batch_overflow(problem, device_gains(problem, x), t)
    return x, t, info


# Enumeration --------------------------------------------------------------------------------

# Placements scored whole whatever the device count (8 experts on 4 devices: 105).
SCORE_ALL = 256
# On two devices, placements screened by their bound (16 experts: 6435; 20: 92378), and the
# token rows the bound counts (the heaviest, and as many heaviest load-free rows): the best
# ENUMERATE_KEEP by the bound are then scored as the search scores its samples, best bound
# first, and the best ENUMERATE_SCREEN of those (at least ``screen``) re-scored on all tokens.
# The bound leaves out the batch cap's take-back: on the example's six layers at EP 2 the
# five placements that score best net of it were within the bound's best 231.
MAX_SCREENED = 2**17
SCREEN_ROWS = 256
ENUMERATE_KEEP = 512
ENUMERATE_SCREEN = 64


def placement_count(num_experts: int, ep_size: int) -> int:
    """Balanced expert placements up to relabelling: N! / ((N/E)!^E E!)."""
    per = num_experts // ep_size
    return math.factorial(num_experts) // (math.factorial(per) ** ep_size * math.factorial(ep_size))


def balanced_placements(num_experts: int, ep_size: int) -> np.ndarray:
    """[P, N] every balanced placement once up to relabelling (each device's lowest expert
    below the next device's), in lexicographic order."""
    per = num_experts // ep_size
    out = np.empty((placement_count(num_experts, ep_size), num_experts), dtype=np.int64)
    labels = np.full(num_experts, -1, dtype=np.int64)
    row = 0

    def fill(device: int) -> None:
        nonlocal row
        if device == ep_size:
            out[row] = labels
            row += 1
            return
        free = np.flatnonzero(labels < 0)
        labels[free[0]] = device
        for group in itertools.combinations(free[1:].tolist(), per - 1):
            labels[list(group)] = device
            fill(device + 1)
            labels[list(group)] = -1
        labels[free[0]] = -1

    fill(0)
    return out


def enumerable(problem: LayerProblem, units: float | None) -> bool:
    """Whether :func:`_enumerate_experts` screens every placement of ``problem`` within
    ``units`` of work (None: no budget): at most :data:`SCORE_ALL` of them, or on two
    devices under the token cap at most :data:`MAX_SCREENED` whose bounds cost at most half
    the budget (the rest is the kept placements' scoring)."""
    count = placement_count(problem.num_experts, problem.ep_size)
    if count <= SCORE_ALL:
        return True
    if problem.ep_size != 2 or problem.balance != "cap" or count > MAX_SCREENED:
        return False
    per_entry = COSTS["two_device_bound"][1]
    return units is None or count * 2 * SCREEN_ROWS * per_entry <= 0.5 * units


def two_device_bound(
    problem: LayerProblem, placements: np.ndarray, effort: Effort | None = None
) -> np.ndarray:
    """[P] an upper bound on the objective of each two-device placement ([P, N], labels 0
    and 1) under the token cap: the fractional optimum of its token assignment.

    With g_d the device gains, a token's move to device 0 gains d_j = g0_j - g1_j for a load
    a_j; the best fractional assignment takes tokens by d_j / a_j, best first, until device
    0 carries what the positive ones would put there, clipped to [S - cap, cap] (both
    devices within the cap); load-free rows go to their better device. Whole tokens lose at
    most one split token's gain to it.
    """
    charge(effort, "two_device_bound", entries=placements.shape[0] * problem.num_tokens)
    freq, act = problem.token_freq, problem.token_activations
    on_zero = (placements == 0).T.astype(np.float64)  # [N, P]
    g0 = np.asarray(problem.affinity @ on_zero)  # [J, P]
    gain = 2.0 * g0 - act[:, None]  # g0 - g1
    loaded = freq > 0
    value = (act[:, None] - g0).sum(axis=0) + gain[~loaded].clip(min=0.0).sum(axis=0)
    gain, load = gain[loaded], freq[loaded]
    if not load.size:
        return value
    order = np.argsort(-(gain / load[:, None]), axis=0, kind="stable")
    gain_sorted = np.take_along_axis(gain, order, axis=0)
    load_sorted = load[order]
    total = float(load.sum())
    cap = problem.capacity
    positive = (load_sorted * (gain_sorted > 0)).sum(axis=0)
    target = np.clip(positive, total - cap, cap)
    cum_load = np.cumsum(load_sorted, axis=0)
    cum_gain = np.cumsum(gain_sorted, axis=0)
    whole = (cum_load <= target * (1 + 1e-12)).sum(axis=0)  # tokens taken whole
    cols = np.arange(placements.shape[0])
    last = np.maximum(whole - 1, 0)
    taken = np.where(whole > 0, cum_gain[last, cols], 0.0)
    room = target - np.where(whole > 0, cum_load[last, cols], 0.0)
    nxt = np.minimum(whole, load.size - 1)
    split = np.where(
        whole < load.size, room.clip(min=0.0) / load_sorted[nxt, cols] * gain_sorted[nxt, cols], 0.0
    )
    return value + taken + split


def _enumerate_experts(
    problem: LayerProblem,
    opts: dict,
    stop: _Stops,
    effort: Effort,
    cap: ExpertLimit | None = None,
) -> tuple[list[np.ndarray], bool]:
    """Every balanced placement screened (see :func:`enumerable`) -> (the best
    max(``screen``, :data:`ENUMERATE_SCREEN`), best first; whether the budget or the clock
    cut the screening short).

    Up to :data:`SCORE_ALL` placements are scored as the search scores its samples, without
    their local search (every move leads to another placement scored here). More, on two
    devices, are ranked by :func:`two_device_bound` on the heaviest rows, and the best
    :data:`ENUMERATE_KEEP` of them scored so. Under an expert-load cap only placements
    within it are screened (none within it: the search's sample repair decides).
    """
    placements = balanced_placements(problem.num_experts, problem.ep_size)
    if cap is not None:
        within = np.array([cap.allows(x) for x in placements])
        placements = placements[within] if within.any() else placements
    cut = False
    if placements.shape[0] > SCORE_ALL:
        sub = heaviest_part(problem, SCREEN_ROWS)
        chunk = max(1, 2**21 // max(1, sub.num_tokens))
        bounds: list[np.ndarray] = []
        for start in range(0, placements.shape[0], chunk):
            if bounds and stop.reached(effort):
                cut = True
                break
            bounds.append(two_device_bound(sub, placements[start : start + chunk], effort))
        bound = np.concatenate(bounds)
        placements = placements[np.argsort(-bound, kind="stable")[:ENUMERATE_KEEP]]
    scorer = _Scorer(
        problem,
        _scoring_tokens(problem, opts),
        int(opts["price_sweeps"]),
        False,
        False,
        0,
        bool(opts["batch_aware"]),
        effort,
        cap,
        deadline=stop.seconds,
    )
    found: dict[bytes, tuple[float, np.ndarray]] = {}
    for x in placements:
        if found and stop.reached(effort):
            cut = True
            break
        y, score = scorer(x)
        found.setdefault(canonical_labels(y, problem.ep_size).tobytes(), (score, y))
    ranked = sorted(found.values(), key=lambda item: -item[0])
    return [x for _, x in ranked[: max(1, int(opts["screen"]), ENUMERATE_SCREEN)]], cut


class _Stops:
    """Where a phase of the search stops: a time (``perf_counter``) and/or a work total."""

    def __init__(self, seconds: float | None, units: float | None):
        self.seconds, self.units = seconds, units

    def reserve(self, seconds: float, units: float) -> _Stops:
        """The stop moved earlier by ``seconds`` and ``units`` (kept for what follows)."""
        return _Stops(
            None if self.seconds is None else self.seconds - seconds,
            None if self.units is None else self.units - units,
        )

    def halfway(self, now: float, spent: float) -> _Stops:
        """Halfway from (``now``, ``spent``) to this stop."""
        return _Stops(
            None if self.seconds is None else now + 0.5 * max(0.0, self.seconds - now),
            None if self.units is None else spent + 0.5 * max(0.0, self.units - spent),
        )

    def reached(self, effort: Effort | None) -> bool:
        if self.seconds is not None and time.perf_counter() >= self.seconds:
            return True
        return self.units is not None and effort is not None and effort.spent >= self.units


def _cross_entropy_experts(
    problem: LayerProblem,
    opts: dict,
    rng: np.random.Generator,
    num_samples: int,
    iterations: int,
    stop: _Stops,
    effort: Effort,
    cap: ExpertLimit | None = None,
    repair_after: bool = False,
) -> tuple[list[np.ndarray], tuple[int, int], bool]:
    """CE over expert placements, each scored with its best tokens. -> (candidates, iters).

    Candidates are the best distinct placements found (best first), at most ``screen``.
    The loop stops at ``stop`` (a :class:`_Stops`: time and/or the work charged to ``effort``).
    """
    n, e, per = problem.num_experts, problem.ep_size, problem.experts_per_device
    n_elite = max(1, math.ceil(float(opts["elite"]) * num_samples))
    alpha = float(opts["smoothing"])
    explore = float(opts["explore"])
    scorer = _Scorer(
        problem,
        _scoring_tokens(problem, opts),
        int(opts["price_sweeps"]),
        bool(opts["local_search"]),
        bool(opts["search_swaps"]),
        int(opts["search_rounds"]),
        bool(opts["batch_aware"]),
        effort,
        cap,
        repair_after,
        deadline=stop.seconds,
    )
    p_ep = np.full((n, e), 1.0 / e)
    if opts["warm_start"]:
        # start the distribution around a balanced clustering of the experts' profiles
        labels, _, _ = balanced_kmeans(expert_profiles(problem), e, rng)
        p_ep = (1.0 - float(opts["warm_start"])) * np.eye(e)[labels] + float(
            opts["warm_start"]
        ) * p_ep
    found: dict[bytes, tuple[float, np.ndarray]] = {}
    best_x, best_score = None, -np.inf
    done, cut, stale, restarts = 0, False, 0, 0
    patience = int(opts["patience"])
    for _ in range(iterations):
        if stop.reached(effort):
            cut = True
            break
        if patience and stale >= patience:
            # converged without progress: start again from the uniform distribution (the
            # best placements found so far stay candidates)
            if restarts >= int(opts["restarts"]):
                break
            restarts, stale = restarts + 1, 0
            p_ep = np.full((n, e), 1.0 / e)
        order = np.argsort(rng.random((num_samples, n)), axis=1)
        samples = sample_balanced(rng, p_ep, num_samples, np.ones(n), per, order=order)
        scored = [scorer(s) for s in samples]
        samples = np.stack([sx for sx, _ in scored])
        scores = np.array([sc for _, sc in scored])
        for s, sc in zip(samples, scores, strict=True):
            found.setdefault(canonical_labels(s, e).tobytes(), (float(sc), s))
        ranked = np.argsort(-scores, kind="stable")
        stale += 1
        if best_x is None or improves(float(scores[ranked[0]]), best_score):
            best_score, best_x, stale = float(scores[ranked[0]]), samples[ranked[0]].copy(), 0
        elite = samples[ranked[:n_elite]]
        if opts["align_labels"]:
            assert best_x is not None  # the first (finite) scores always beat -inf
            elite = np.stack([align(s, best_x, e) for s in elite])
        p_ep = alpha * _onehot_mean(elite, e) + (1 - alpha) * p_ep
        done += 1
        p_ep = (1 - explore) * p_ep + explore / e
    out_of_time = stop.seconds is not None and time.perf_counter() >= stop.seconds
    if not found or not out_of_time:  # the distribution's mode, unless the clock ran out
        mode = repair_expert_counts(p_ep.argmax(axis=1), p_ep.T, per)
        mode_x, mode_score = scorer(mode)
        found.setdefault(canonical_labels(mode_x, e).tobytes(), (mode_score, mode_x))
    ranked_found = sorted(found.values(), key=lambda item: -item[0])
    return [x for _, x in ranked_found[: max(1, int(opts["screen"]))]], (done, restarts), cut

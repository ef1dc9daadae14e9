"""What every solver shares: gains, token balance, expert repair, the objective, finish.

Every solver produces an expert placement its own way and then hands it to the functions
here, so that the token assignment, the repair to exactly N/E experts per device and the
token-balance handling are the same code for all of them: that is what makes the baselines
comparable (paper 000 §3.4, paper 001 §3.3). Two parts live in modules of their own: the
token assignment under capacities (:mod:`planner.solve.assign`) and the local search
(:mod:`planner.solve.polish`).

Shapes: J tokens, N experts, E devices, P = N/E experts per device.

- :func:`device_gains` ``G [J, E]``: ``G[j, d]`` = activations of token j that are local if
  j is sent to device d, given an expert placement (``W @ onehot(expert_to_device)``).
- :func:`expert_scores` ``M [E, N]``: ``M[d, k]`` = activations of expert k by the tokens sent
  to device d, given a token placement (``onehot(token_to_device).T @ W``).
- :func:`assign_for_problem`: the token assignment every solver uses,
  :func:`planner.solve.assign.assign_tokens` under the problem's balance rule.
- :func:`rebalance_tokens`: evict the least-valuable tokens from over-full devices.
- :func:`place_experts`: the exact best expert placement for a score ``M`` with P experts per
  device (a linear assignment on the [N, N] matrix of experts x device slots).
- :func:`repair_expert_counts`: the smallest change that gives every device exactly P experts.
- :func:`canonical_labels`: one labelling per partition (devices are interchangeable).
- :func:`objective`, :func:`evaluate`, :func:`batch_overflow`, :func:`net_objective`: what a placement is worth,
  and what the runtime's per-batch cap would take back from it.
- :func:`finish`: assignment + metrics + validation -> :class:`LayerPlacement` (a layer of
  a few tokens a device left over the cap is packed within it by the exact program,
  :func:`planner.solve.assign.within_cap`).
- :func:`check_options`: every solver's option validation.

The search kernels take an optional ``effort`` meter (:mod:`planner.solve.effort`) and charge
their work to it, so that a search can stop after a fixed amount of work instead of time.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
from scipy.optimize import linear_sum_assignment

from planner.solve.assign import (
    Assignment,
    assign_penalised_exact,
    assign_tokens,
    descending_within_groups,
    within_cap,
)
from planner.solve.effort import Effort, charge
from planner.solve.problem import LOAD_RTOL, LayerPlacement, LayerProblem

# Caps tried in penalty mode (multiples of the mean load); the best penalised objective wins.
_PENALTY_BETAS = (1.0, 1.05, 1.1, 1.25, 1.5, float("inf"))


# Gains and scores ---------------------------------------------------------------------------


def device_gains(
    problem: LayerProblem, expert_to_device: np.ndarray, effort: Effort | None = None
) -> np.ndarray:
    """G [J, E] float64: local activations of each token on each device.

    ``G[j, d] = sum_{k: expert_to_device[k] == d} W[j, k]``; one bincount over W's nonzeros.
    The work is charged to ``effort`` when given.
    """
    w, e = problem.affinity, problem.ep_size
    charge(effort, "device_gains", entries=w.nnz + problem.num_tokens * e)
    key = problem.nnz_rows * e + expert_to_device[w.indices]
    # float64 even when W has no nonzeros (bincount of nothing returns int64)
    gains = np.bincount(key, weights=w.data, minlength=problem.num_tokens * e)
    return gains.astype(np.float64, copy=False).reshape(-1, e)


def expert_scores(problem: LayerProblem, token_to_device: np.ndarray) -> np.ndarray:
    """M [E, N] float64: activations of each expert by the tokens sent to each device."""
    w, n = problem.affinity, problem.num_experts
    key = token_to_device[problem.nnz_rows] * n + w.indices
    scores = np.bincount(key, weights=w.data, minlength=problem.ep_size * n)
    return scores.astype(np.float64, copy=False).reshape(-1, n)  # float64 when W is empty


# Token assignment ---------------------------------------------------------------------------


def assign_for_problem(
    problem: LayerProblem,
    gain: np.ndarray,
    *,
    prices: np.ndarray | None = None,
    sweeps: int = 30,
    exact: bool = True,
    effort: Effort | None = None,
) -> Assignment:
    """The token assignment every solver uses, under the problem's balance rule.

    "cap": :func:`assign_tokens` with capacity ``beta * S / E``. "penalty": the paper's
    θ-weighted objective has no cap; :func:`assign_tokens` runs under a ladder of caps
    (1.0 ... 1.5 times the mean load, and none) and the best penalised objective wins.
    """
    freq = problem.token_freq
    if problem.balance == "cap":
        return assign_tokens(
            gain, freq, problem.capacity, prices=prices, sweeps=sweeps, exact=exact,
            effort=effort,
        )  # fmt: skip
    mean = problem.total_freq / problem.ep_size
    best, best_obj = None, -np.inf
    for b in _PENALTY_BETAS:
        if np.isfinite(b):
            result = assign_tokens(gain, freq, b * mean, sweeps=sweeps, exact=exact, effort=effort)
        else:
            result = Assignment(gain.argmax(axis=1), np.zeros(problem.ep_size))
        obj = objective(problem, gain, result.token_to_device)
        if obj > best_obj:
            best, best_obj = result, obj
    assert best is not None  # the objectives are finite: the first cap always wins over -inf
    if exact:  # a few tokens: the penalised objective itself, where it scores higher
        solved = assign_penalised_exact(gain, freq, problem.theta)
        if solved is not None and objective(problem, gain, solved) > best_obj:
            best = Assignment(solved, best.prices)
    return best


def rebalance_tokens(
    problem: LayerProblem, token_to_device: np.ndarray, gain: np.ndarray, priority: np.ndarray
) -> np.ndarray:
    """Token-balance repair: over-full devices keep their highest-priority tokens.

    Args:
        token_to_device: [J] a placement that may exceed the cap.
        gain: [J, E] device gains under the final expert placement.
        priority: [J] which tokens keep their device first (e.g. a confidence).

    Returns:
        [J] a placement within the cap (penalty mode: returned unchanged). Evicted tokens are
        placed by :func:`assign_tokens` in the room left; where they do not fit it, every
        token is placed afresh by :func:`assign_tokens` if that loads devices less.
    """
    if problem.balance != "cap":
        return token_to_device
    t = np.asarray(token_to_device, dtype=np.int64).copy()
    freq, e = problem.token_freq, problem.ep_size
    loads = np.bincount(t, weights=freq, minlength=e)
    cap = problem.capacity
    if loads.max() <= cap * (1 + LOAD_RTOL):
        return t
    order = np.lexsort((-priority, t))
    dev = t[order]
    csum = np.cumsum(freq[order])
    before = np.concatenate(([0.0], csum))[np.searchsorted(dev, np.arange(e))]
    evict = order[csum - before[dev] > cap * (1 + LOAD_RTOL)]
    keep_loads = loads - np.bincount(t[evict], weights=freq[evict], minlength=e)
    t[evict] = assign_tokens(
        gain[evict], freq[evict], np.maximum(cap - keep_loads, 0.0)
    ).token_to_device
    repaired = _overload(np.bincount(t, weights=freq, minlength=e), cap)
    if repaired[0] > cap * (1 + LOAD_RTOL):
        # The evicted tokens did not fit the room the kept ones left: a token heavier than
        # the cap (it must fill a device alone, not join kept tokens) or a tight beta. Every
        # token placed afresh by the shared assignment, where that is better balanced: a
        # lower peak, or the same peak with less load over the cap (frequencies 4, 3 and 1
        # on three devices: 4, 3, 1 rather than 0, 4, 4, where the 4 had filled the room
        # the kept 1 left)
        fresh = assign_tokens(gain, freq, cap).token_to_device
        if _overload(np.bincount(fresh, weights=freq, minlength=e), cap) < repaired:
            return fresh
    return t


def _overload(loads: np.ndarray, cap: float) -> tuple[float, float]:
    """(peak load, total load over the cap): the order in which token repairs compare."""
    return float(loads.max()), float(np.clip(loads - cap, 0.0, None).sum())


# Experts ------------------------------------------------------------------------------------


def place_experts(score: np.ndarray, per_device: int) -> np.ndarray:
    """The expert placement maximising ``sum_k score[x_k, k]`` with ``per_device`` per device.

    Args:
        score: [E, N] value of putting expert k on device d.
    Returns:
        expert_to_device [N] int64 (exact: linear assignment of experts to the N slots).
    """
    slots = np.repeat(
        np.asarray(score, dtype=np.float64), per_device, axis=0
    )  # [N, N] slot x expert
    expert, slot = linear_sum_assignment(slots.T, maximize=True)
    out = np.empty(score.shape[1], dtype=np.int64)
    out[expert] = slot // per_device
    return out


def repair_expert_counts(
    expert_to_device: np.ndarray, score: np.ndarray, per_device: int
) -> np.ndarray:
    """Give every device exactly ``per_device`` experts, moving as few experts as possible.

    Over-full devices keep the experts with the highest ``score[d, k]`` (``score`` [E, N]);
    the displaced experts go to the free slots by an exact linear assignment on ``score``,
    i.e. each to the device where it gains most without overfilling it.
    """
    x = np.asarray(expert_to_device, dtype=np.int64).copy()
    e, n = score.shape
    counts = np.bincount(x, minlength=e)
    if (counts == per_device).all():
        return x
    own = score[x, np.arange(n)]
    order = np.lexsort((np.arange(n), -own, x))  # by device, best first, ties by expert id
    dev = x[order]
    rank = np.arange(n) - np.searchsorted(dev, dev)
    displaced = np.sort(order[rank >= per_device])
    kept = np.bincount(x[order[rank < per_device]], minlength=e)
    slot_device = np.repeat(np.arange(e), per_device - kept)
    rows, cols = linear_sum_assignment(score[slot_device][:, displaced].T, maximize=True)
    x[displaced[rows]] = slot_device[cols]
    return x


def canonical_labels(expert_to_device: np.ndarray, e: int) -> np.ndarray:
    """Relabel devices in order of their lowest-numbered expert: one labelling per partition."""
    x = np.asarray(expert_to_device, dtype=np.int64)
    first = np.full(e, x.size, dtype=np.int64)
    np.minimum.at(first, x, np.arange(x.size))
    rank = np.empty(e, dtype=np.int64)
    rank[np.argsort(first, kind="stable")] = np.arange(e)
    return rank[x]


# Objective ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Evaluation:
    """Objective terms of one placement on its problem's W."""

    local: float  # local activations
    objective: float
    local_rate: float
    token_imbalance: float


def improves(new: float, best: float, rel: float = 1e-12) -> bool:
    """Whether objective ``new`` beats ``best`` by more than rounding: a margin relative to
    ``|best|`` (at least ``rel``), so that it holds for the penalty mode's negative objectives
    too (``best * (1 + rel)`` lies *below* a negative best, and accepted a worse value);
    anything finite beats ``-inf``, the searches' start."""
    if best == -math.inf:
        return new > best
    return new > best + rel * max(1.0, abs(best))


def objective(problem: LayerProblem, gain: np.ndarray, token_to_device: np.ndarray) -> float:
    """The maximised objective (see :class:`LayerProblem`) for device gains ``gain`` [J, E]."""
    local = float(gain[np.arange(token_to_device.size), token_to_device].sum())
    if problem.balance == "cap":
        return local
    loads = np.bincount(token_to_device, weights=problem.token_freq, minlength=problem.ep_size)
    dev = float(np.abs(loads - problem.total_freq / problem.ep_size).sum())
    return (1.0 - problem.theta) * local - problem.theta * dev


def evaluate(
    problem: LayerProblem, expert_to_device: np.ndarray, token_to_device: np.ndarray
) -> Evaluation:
    gain = device_gains(problem, expert_to_device)
    local = float(gain[np.arange(token_to_device.size), token_to_device].sum())
    return Evaluation(
        local=local,
        objective=objective(problem, gain, token_to_device),
        local_rate=local / max(problem.total_activations, 1e-300),
        token_imbalance=token_imbalance(problem.token_freq, token_to_device, problem.ep_size),
    )


def token_imbalance(freq: np.ndarray, token_to_device: np.ndarray, ep_size: int) -> float:
    """max device token load / mean device token load (1.0 when there is no load)."""
    loads = np.bincount(token_to_device, weights=freq, minlength=ep_size)
    mean = loads.sum() / ep_size
    return float(loads.max() / mean) if mean > 0 else 1.0


def net_objective(
    problem: LayerProblem,
    gain: np.ndarray,
    token_to_device: np.ndarray,
    effort: Effort | None = None,
) -> float:
    """The objective net of what the runtime's per-batch cap takes back on the fitting
    batches (:func:`batch_overflow`; the objective itself without batches): what the
    balanced LAR, by which plans are judged, credits. Every method that chooses among
    candidate placements chooses by it, CEO's search and the baselines' restarts alike."""
    return objective(problem, gain, token_to_device) - batch_overflow(
        problem, gain, token_to_device, effort
    )


def batch_overflow(
    problem: LayerProblem,
    gain: np.ndarray,
    token_to_device: np.ndarray,
    effort: Effort | None = None,
) -> float:
    """Local activations the runtime's per-batch cap would take back (0 without batches).

    In each fitting batch g (``problem.batch_freq``, :mod:`planner.predict.batches`) a device
    keeps at most ``beta * S_g / E`` of the batch's occurrences (S_g over the problem's
    rows), the most confident tokens (largest local share, :func:`token_confidence`) first,
    as the runtime does. An evicted occurrence is counted as local at its row's mean rate
    over the other devices (per occurrence: ``problem.occurrences``, which for the n-gram
    term's load-free context rows are the fitting tokens seen in the context). Penalty mode
    (no cap) and E = 1 lose nothing. The work is charged to ``effort`` when given.
    """
    entries, e = problem.batch_entries, problem.ep_size
    charge(
        effort, "batch_overflow", entries=(0 if entries is None else entries[0].size) + gain.size
    )
    if entries is None or entries[0].size == 0 or problem.balance != "cap" or e == 1:
        return 0.0
    rows, batch, occ, cap = entries
    t = np.asarray(token_to_device, dtype=np.int64)
    key = batch * e + t[rows]  # (batch, device) of each entry
    load = np.bincount(key, weights=occ, minlength=cap.size * e)
    over = np.flatnonzero(load[key] > cap[batch] * (1 + 1e-12))
    if over.size == 0:
        return 0.0
    # only the (batch, device) groups over their cap: rank by confidence, evict the tail
    rows, batch, occ, key = rows[over], batch[over], occ[over], key[over]
    act, freq = problem.token_activations, problem.occurrences
    own = gain[np.arange(t.size), t]
    conf = token_confidence(problem, gain, t)
    loss_each = np.divide(
        own - (act - own) / (e - 1), freq, out=np.zeros_like(own), where=freq > 0
    ).clip(min=0.0)
    order = descending_within_groups(key, conf[rows], cap.size * e)  # np.lexsort((-conf, key))
    key, rows, occ, batch = key[order], rows[order], occ[order], batch[order]
    csum = np.cumsum(occ)
    start = np.searchsorted(key, key)  # first entry of each (batch, device) group
    within = csum - (csum[start] - occ[start])
    evicted = np.clip(within - cap[batch], 0.0, occ)
    return float(evicted @ loss_each[rows])


def token_confidence(
    problem: LayerProblem, gain: np.ndarray, token_to_device: np.ndarray
) -> np.ndarray:
    """[J] share of each token's activations that are local on its device, in [0, 1]."""
    total = problem.token_activations
    local = gain[np.arange(token_to_device.size), token_to_device].astype(np.float64)
    return np.divide(local, total, out=np.zeros_like(local), where=total > 0).clip(0.0, 1.0)


# Finish -------------------------------------------------------------------------------------


def finish(
    problem: LayerProblem,
    method: str,
    expert_to_device: np.ndarray,
    *,
    seed: int,
    started: float,
    token_to_device: np.ndarray | None = None,
    info: dict[str, Any] | None = None,
) -> LayerPlacement:
    """Build the validated :class:`LayerPlacement` of a solver.

    ``expert_to_device`` must already hold exactly N/E experts per device (use
    :func:`repair_expert_counts`). Without ``token_to_device`` the shared assignment
    (:func:`assign_for_problem`) places the tokens. ``started`` is the solver's
    ``time.perf_counter()`` at entry.
    """
    x = np.asarray(expert_to_device, dtype=np.int64)
    gain = device_gains(problem, x)
    if token_to_device is None:
        t = assign_for_problem(problem, gain).token_to_device
    else:
        t = np.asarray(token_to_device, dtype=np.int64)
    info = dict(info or {})
    if problem.balance == "cap" and method != "ilp":
        # a few tokens a device left over the cap: the exact program's assignment within it,
        # once (the ILP's plan is its own program's)
        packed = within_cap(gain, problem.token_freq, problem.capacity, t)
        if packed is not t:
            t, info["tokens_packed_within_cap"] = packed, True
    local = float(gain[np.arange(t.size), t].sum())
    placement = LayerPlacement(
        expert_to_device=x,
        token_to_device=t,
        token_confidence=token_confidence(problem, gain, t),
        objective=objective(problem, gain, t),
        local_rate=local / problem.total_activations if problem.total_activations > 0 else 0.0,
        token_imbalance=token_imbalance(problem.token_freq, t, problem.ep_size),
        seconds=time.perf_counter() - started,
        seed=int(seed),
        method=method,
        info=info,
    )
    placement.validate(problem)
    return placement


# Option kinds (check_options): "flag" bool; "text" str; "count" int in [0, MAX_COUNT];
# "count+" int in [1, MAX_COUNT];
# "number" finite real >= 0; "numbers" one such number or a non-empty list of them. A
# trailing "?" also allows null. Options not named in ``kinds`` take their default's kind.
_KIND_OF_DEFAULT = {bool: "flag", str: "text", int: "count", float: "number", tuple: "numbers"}
# Largest count an option takes: a 32-bit int. A count is rounds, restarts or rows, and 1e11
# k-means restarts would run for days (1e308 for ever); --time-limit stops the solvers sooner.
MAX_COUNT = 2**31 - 1


def _is_number(value: Any) -> bool:
    return (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(value)
        and value >= 0
    )


def _option_problem(value: Any, kind: str) -> str | None:
    """What is wrong with ``value`` for an option of ``kind`` (None: nothing)."""
    nullable, kind = kind.endswith("?"), kind.rstrip("?")
    if value is None:
        return None if nullable else "must not be null"
    if kind == "flag":
        ok, want = isinstance(value, bool), "true or false"
    elif kind == "text":
        ok, want = isinstance(value, str), "a string"
    elif kind in ("count", "count+"):
        least = 1 if kind == "count+" else 0
        ok = _is_number(value) and value == int(value) and least <= value <= MAX_COUNT
        want = f"an integer in [{least}, 2**31 - 1]"
    elif kind == "number":
        ok, want = _is_number(value), "a number >= 0"
    elif kind == "number+":
        ok, want = _is_number(value) and value > 0, "a number > 0"
    elif kind == "share":
        ok, want = _is_number(value) and value <= 1, "a number in [0, 1]"
    else:  # numbers
        items = value if isinstance(value, list | tuple) else [value]
        ok = bool(items) and all(_is_number(v) for v in items)
        want = "a number >= 0 or a non-empty list of them"
    return None if ok else f"must be {want}" + (" or null" if nullable else "")


def check_options(
    method: str,
    given: dict[str, Any],
    defaults: dict[str, Any],
    kinds: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Merge a solver's option dict with its defaults, each value checked for its kind.

    Unknown keys and values of the wrong kind (see ``_KIND_OF_DEFAULT``) are an InputError
    that names the option, so a bad ``--options`` is one line, not a traceback.
    """
    from planner.errors import InputError

    unknown = sorted(set(given) - set(defaults))
    if unknown:
        known = f"known: {', '.join(sorted(defaults))}" if defaults else f"{method} takes none"
        raise InputError(f"{method}: unknown option(s) {', '.join(unknown)}; {known}")
    kinds = kinds or {}
    for key, value in given.items():
        kind = kinds.get(key) or _KIND_OF_DEFAULT.get(type(defaults[key]))
        problem = None if kind is None else _option_problem(value, kind)
        if problem:
            raise InputError(f"{method}: {key}={value!r} {problem}")
    return {**defaults, **given}

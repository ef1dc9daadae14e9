"""What every solver shares: token assignment, expert repair, polish, and the objective.

Every solver produces an expert placement its own way and then hands it to the functions
here, so that the token assignment, the repair to exactly N/E experts per device and the
token-balance handling are the same code for all of them: that is what makes the baselines
comparable (paper 000 §3.4, paper 001 §3.3).

Shapes: J tokens, N experts, E devices, P = N/E experts per device.

- :func:`device_gains` ``G [J, E]``: ``G[j, d]`` = activations of token j that are local if
  j is sent to device d, given an expert placement (``W @ onehot(expert_to_device)``).
- :func:`expert_scores` ``M [E, N]``: ``M[d, k]`` = activations of expert k by the tokens sent
  to device d, given a token placement (``onehot(token_to_device).T @ W``).
- :func:`assign_tokens`: tokens -> devices under per-device load capacities (dual prices,
  heavy tokens first, a regret greedy, exchanges; within ~0.05% of the LP bound on real
  layers, see its doc); :func:`assign_for_problem` applies the problem's balance rule.
- :func:`place_experts`: the exact best expert placement for a score ``M`` with P experts per
  device (a linear assignment on the [N, N] matrix of experts x device slots).
- :func:`repair_expert_counts`: the smallest change that gives every device exactly P experts.
- :func:`rebalance_tokens`: evict the least-valuable tokens from over-full devices.
- :func:`polish`: local search (exact expert moves for the tokens, priced expert swaps from
  :func:`swap_candidates`), each move followed by the token assignment, until no gain.
- :func:`canonical_labels`: one labelling per partition (devices are interchangeable).
- :func:`finish`: assignment + metrics + validation -> :class:`LayerPlacement`.

The search kernels take an optional ``effort`` meter (:mod:`planner.solve.effort`) and charge
their work to it, so that a search can stop after a fixed amount of work instead of time.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
from scipy.optimize import linear_sum_assignment

from planner.solve.effort import Effort, charge, exhausted
from planner.solve.problem import LOAD_RTOL, LayerPlacement, LayerProblem

# Rounds of vectorised proposals in assign_tokens before the (rare) sequential finish.
_MAX_PROPOSAL_ROUNDS = 64
# Relative gap under which two gains count as tied (ties are broken by room, not by index).
_TIE_EPS = 1e-9
# Problems with at most this many token x device entries are assigned exactly (0-1 program).
_EXACT_ENTRIES = 256
# Tokens considered by the pairwise exchange pass (the heaviest; all when J is at most this).
_EXCHANGE_TOKENS = 256
# Tokens heavier than this share of the mean device capacity are placed one by one first.
_HEAVY_SHARE = 0.01
# Single swaps verified per polish round when the batch of swaps fails.
_SWAP_TRIALS = 3
# Swap neighbourhoods at most this large are tried in full (e.g. 8 experts).
_ALL_SWAPS = 32
# Experts per device tried in swaps (all when N/E is at most this).
_SWAP_EXPERTS = 4
# Partner devices tried per device in swaps (all pairs when E - 1 is at most this).
_SWAP_PARTNERS = 6
# Max elements of one [tokens, m, m] block when scoring swaps.
_SWAP_BLOCK = 1 << 21
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


class Assignment(NamedTuple):
    """Result of :func:`assign_tokens`.

    Attributes:
        token_to_device: [J] int64.
        prices: [E] float64 dual prices per unit of load (warm start for the next call on a
            similar gain matrix).
    """

    token_to_device: np.ndarray
    prices: np.ndarray


def assign_tokens(
    gain: np.ndarray,
    freq: np.ndarray,
    capacity: float | np.ndarray,
    *,
    prices: np.ndarray | None = None,
    sweeps: int = 30,
    exact: bool = True,
    effort: Effort | None = None,
) -> Assignment:
    """Send tokens to devices, maximising ``sum_j gain[j, t_j]`` within load capacities.

    Args:
        gain: [J, E] value of each token on each device (e.g. :func:`device_gains`).
        freq: [J] load of each token (its occurrences), >= 0.
        capacity: scalar or [E] load each device may take.
        prices: [E] warm-start dual prices (from a previous call on similar gains).
        sweeps: price-update sweeps (fewer when warm-started; 0 = plain regret greedy).
        exact: solve tiny problems exactly (see below); off inside fast search loops.
        effort: a work meter to charge (:mod:`planner.solve.effort`).

    Returns:
        :class:`Assignment` (token_to_device [J] int64, prices [E]).

    This is a generalised-assignment problem (tokens are items of weight ``a_j``, devices are
    bins). Its LP relaxation is a transportation problem whose dual has one price per device
    and unit of load; three steps:

    1. :func:`dual_prices` approximately minimises the LP dual; with the prices, a token's
       *adjusted gain* ``gain[j, d] - a_j * price[d]`` charges it for the capacity it uses.
    2. Heavy tokens (``a_j`` above 1% of the mean capacity) are placed first, heaviest first,
       each on its best adjusted device with room: integrality matters only for them (one
       heavy token tied between two devices by the LP must not be turned away by both).
    3. Light tokens: prices are re-fitted to the room left, then a vectorised regret greedy
       (a deferred-acceptance auction) places them: each proposes to its best adjusted device
       among those it fits on; a device keeps the proposals with the largest regret (best
       minus second-best adjusted gain) per unit load while they fit; the others propose
       again. A token that fits nowhere goes to the device with the most room, so a device's
       final load stays below ``max(capacity, mean load) + a_j`` (the slack rule of
       :mod:`planner.solve.problem`). A last pass moves tokens to a better device (by the
       original gain) that still has room.

    On real OLMoE layers this lands within ~0.05-0.6% of the LP bound (the regret greedy
    alone loses 2-3%). Zero-frequency tokens take their best device. Tiny problems (at most
    ``_EXACT_ENTRIES`` token x device entries, where heavy tokens make the greedy's
    integrality losses large) are solved exactly by a 0-1 program instead; if no assignment
    fits the capacities, the steps above apply (with the overflow rule).
    """
    gain = np.asarray(gain, dtype=np.float64)
    freq = np.asarray(freq, dtype=np.float64)
    num_tokens, e = gain.shape
    room = np.broadcast_to(np.asarray(capacity, dtype=np.float64), (e,)).copy()
    tol = LOAD_RTOL * max(float(np.abs(room[np.isfinite(room)]).max(initial=1.0)), 1.0)
    token_to_device = np.full(num_tokens, -1, dtype=np.int64)
    price = np.zeros(e) if prices is None else np.asarray(prices, dtype=np.float64).copy()
    if num_tokens == 0:
        return Assignment(token_to_device, price)
    free = freq <= 0
    token_to_device[free] = gain[free].argmax(axis=1)
    busy = np.flatnonzero(~free)
    charge(effort, "assign", entries=num_tokens * e)
    if exact and 0 < busy.size * e <= _EXACT_ENTRIES and np.isfinite(room).all():
        charge(effort, "assign_exact")
        solved = _assign_exact(gain[busy], freq[busy], room)
        if solved is not None:
            token_to_device[busy] = solved
            return Assignment(token_to_device, price)
    if sweeps > 0:
        price = dual_prices(
            gain[busy], freq[busy], room, prices=price, sweeps=sweeps, effort=effort
        )
    heavy_cut = _HEAVY_SHARE * float(np.mean(room)) if np.isfinite(room).all() else np.inf
    heavy = busy[freq[busy] > heavy_cut]
    light = busy[freq[busy] <= heavy_cut]
    # a heavy token tied between devices takes the one whose room the light tokens contest least
    light_demand = np.bincount(
        (gain[light] - freq[light, None] * price[None, :]).argmax(axis=1),
        weights=freq[light], minlength=e,
    )  # fmt: skip
    charge(effort, "assign", steps=heavy.size, calls=0)
    heavy = heavy[np.argsort(-freq[heavy], kind="stable")]
    token_to_device[heavy] = _place_heavy(gain[heavy], freq[heavy], price, room, light_demand, tol)
    light_price = price
    if heavy.size and sweeps > 0:
        light_price = dual_prices(
            gain[light],
            freq[light],
            np.maximum(room, 0.0),
            prices=price,
            sweeps=max(sweeps // 3, 1),
            effort=effort,
        )
    adjusted = gain[light] - freq[light, None] * light_price[None, :]
    token_to_device[light] = _regret_fill(adjusted, freq[light], room, tol, effort)
    _move_to_room(gain, freq, room, token_to_device, tol, effort=effort)
    # integrality matters for heavy tokens: pairwise exchanges among them (all tokens when
    # there are few)
    cand = heavy if num_tokens > _EXCHANGE_TOKENS else busy
    if cand.size > 1:
        cand = cand[np.argsort(-freq[cand], kind="stable")[:_EXCHANGE_TOKENS]]
        _exchange(gain, freq, room, token_to_device, cand, tol, effort=effort)
        _move_to_room(gain, freq, room, token_to_device, tol, effort=effort)
    return Assignment(token_to_device, price)


def _assign_exact(gain: np.ndarray, freq: np.ndarray, room: np.ndarray) -> np.ndarray | None:
    """Optimal assignment of a few tokens by a 0-1 program (HiGHS via scipy); None if none fits."""
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import eye, kron

    num_tokens, e = gain.shape
    one_device = LinearConstraint(kron(eye(num_tokens), np.ones((1, e))), 1, 1)
    capacity = LinearConstraint(kron(freq[None, :], eye(e)), -np.inf, room)
    result = milp(
        -gain.ravel(), constraints=[one_device, capacity], integrality=np.ones(gain.size),
        bounds=Bounds(0, 1), options={"time_limit": 2.0},
    )  # fmt: skip
    if result.x is None:
        return None
    return result.x.reshape(num_tokens, e).argmax(axis=1).astype(np.int64)


def dual_prices(
    gain: np.ndarray,
    freq: np.ndarray,
    room: np.ndarray,
    *,
    prices: np.ndarray | None = None,
    sweeps: int = 30,
    damping: float = 0.5,
    effort: Effort | None = None,
) -> np.ndarray:
    """[E] prices per unit load that approximately minimise the transportation LP's dual.

    ``D(p) = sum_j max_d (gain[j, d] - a_j p_d) + sum_d room_d p_d``, p >= 0 (all ``a_j`` >
    0). Damped Jacobi sweeps: each device's new price is the lowest that keeps the tokens
    preferring it (given the other prices) within its room; the step is averaged with the
    old price. Stops early once the prices stop moving.
    """
    num_tokens, e = gain.shape
    price = np.zeros(e) if prices is None else np.asarray(prices, dtype=np.float64).copy()
    if num_tokens == 0 or not np.isfinite(room).any():
        return np.where(np.isfinite(room), price, 0.0)
    devices, cols = np.arange(e), np.arange(num_tokens)
    scale = float(np.max(gain / freq[:, None], initial=1.0))
    # Device-major [E, J]: each sweep reduces over the few devices of many tokens, which
    # numpy does row against row, faster than token by token along a short last axis (a
    # 50k x 8 call: 160 ms instead of 240). The arithmetic is elementwise the same, and so
    # are the prices, bit for bit.
    gain_t = np.ascontiguousarray(gain.T)
    # two [E, J] buffers reused by every sweep (fresh temporaries cost page faults)
    adjusted, threshold = np.empty_like(gain_t), np.empty_like(gain_t)
    for _ in range(sweeps):
        charge(effort, "dual_prices", entries=num_tokens * e, steps=num_tokens)
        np.subtract(gain_t, np.multiply.outer(price, freq, out=adjusted), out=adjusted)
        first, best, second = _best_two(adjusted)
        # token j prefers d while p_d < threshold: its gain there over its best elsewhere
        np.divide(np.subtract(gain_t, best, out=threshold), freq, out=threshold)
        threshold[first, cols] = (gain_t[first, cols] - second) / freq
        td, tj = np.nonzero(threshold > 0)
        tv = threshold[td, tj]
        order = _by_device_then_descending(td, tv, e)
        td, tv, load = td[order], tv[order], freq[tj[order]]
        csum = np.cumsum(load)
        before = np.concatenate(([0.0], csum))[np.searchsorted(td, devices)]
        over = np.flatnonzero(csum - before[td] > room[td])
        new = np.zeros(e)
        if over.size:
            dev, first_over = np.unique(td[over], return_index=True)
            new[dev] = tv[over[first_over]]
        new = np.where(np.isfinite(room), new, 0.0)
        step = new - price
        price = price + damping * step
        if np.abs(step).max() <= 1e-7 * scale:
            break
    return price


def _by_device_then_descending(td: np.ndarray, tv: np.ndarray, e: int) -> np.ndarray:
    """``np.lexsort((-tv, td))`` for ``td`` already sorted (as ``np.nonzero`` gives rows).

    The same permutation, ties in the original order, from one stable sort per device's
    segment: about twice as fast as the two-key sort on 80k-175k entries.
    """
    bounds = np.searchsorted(td, np.arange(e + 1))
    descending = -tv
    order = np.empty(td.size, dtype=np.intp)
    for d in range(e):
        lo, hi = bounds[d], bounds[d + 1]
        order[lo:hi] = lo + np.argsort(descending[lo:hi], kind="stable")
    return order


def _best_two(values: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per column of ``values`` [E, J]: (first [J], best [J], second [J]).

    ``first`` is the row of the column's maximum ``best`` (the lowest row on ties, as
    ``argmax``), ``second`` the largest value in the other rows (-inf when E = 1).
    ``values`` is left as it was.
    """
    e, num = values.shape
    best = values.max(axis=0)
    first = np.zeros(num, dtype=np.int64)
    for d in range(e - 1, -1, -1):
        first[values[d] == best] = d
    cols = np.arange(num)
    kept = values[first, cols]
    values[first, cols] = -np.inf
    second = values.max(axis=0)
    values[first, cols] = kept
    return first, best, second


def _regret_fill(
    gain: np.ndarray, freq: np.ndarray, room: np.ndarray, tol: float, effort: Effort | None
) -> np.ndarray:
    """The regret greedy of :func:`assign_tokens` (all ``freq`` > 0); updates ``room``."""
    num_tokens, e = gain.shape
    out = np.full(num_tokens, -1, dtype=np.int64)
    pending = np.arange(num_tokens)
    for _ in range(_MAX_PROPOSAL_ROUNDS):
        if pending.size == 0:
            break
        charge(effort, "regret_fill", entries=pending.size * e)
        f = freq[pending]
        fits = f[:, None] <= room[None, :] + tol
        stuck = ~fits.any(axis=1)
        if stuck.any():
            _place_overflow(pending[stuck], freq, room, out)
            pending, f, fits = pending[~stuck], f[~stuck], fits[~stuck]
            if pending.size == 0:
                break
        # ties go to the device with more room (not the lowest index: labels are arbitrary)
        tie_break = _TIE_EPS * max(float(np.abs(gain[pending]).max(initial=0.0)), 1e-300)
        g = np.where(fits, gain[pending] + tie_break * _room_rank(room)[None, :], -np.inf)
        best, best_value, second = _best_two(np.ascontiguousarray(g.T))
        regret = np.where(np.isfinite(second), best_value - second, np.inf)
        order = np.lexsort((-(regret / f), best))
        dev, load = best[order], f[order]
        csum = np.cumsum(load)
        before = np.concatenate(([0.0], csum))[np.searchsorted(dev, np.arange(e))]
        accept = csum - before[dev] <= room[dev] + tol
        out[pending[order[accept]]] = dev[accept]
        room -= np.bincount(dev[accept], weights=load[accept], minlength=e)
        pending = pending[order[~accept]]
    charge(effort, "regret_fill", steps=pending.size, calls=0)
    for j in pending[np.argsort(-freq[pending], kind="stable")]:  # pathological tails
        fits = freq[j] <= room + tol
        if fits.any():
            d = int(np.where(fits, gain[j], -np.inf).argmax())
            out[j] = d
            room[d] -= freq[j]
        else:
            _place_overflow(np.array([j]), freq, room, out)
    return out


def _place_heavy(
    gain: np.ndarray, freq: np.ndarray, price: np.ndarray, room: np.ndarray, demand, tol
) -> np.ndarray:
    """Heavy tokens one by one, in the given order (step 2 of :func:`assign_tokens`).

    Each goes to its best adjusted device (``gain - freq * price``) among those it fits on;
    among (near-)ties the device with the most room beyond the light tokens' ``demand``; a
    token that fits nowhere takes the device with the most room. Updates ``room``. Plain
    Python floats (the same IEEE arithmetic as numpy's): per token, numpy's call overhead
    on E values cost several times the work.
    """
    adjusted = (gain - freq[:, None] * price[None, :]).tolist()
    left, demand = room.tolist(), np.asarray(demand).tolist()
    devices = range(len(left))
    out = []
    for f, values in zip(freq.tolist(), adjusted, strict=True):
        fits = [d for d in devices if f <= left[d] + tol]
        if fits:
            best = max(values[d] for d in fits)
            cut = best - _TIE_EPS * max(abs(best), 1e-300)
            # the first device of the highest preference among the ties (argmax's order)
            d = max((d for d in fits if values[d] >= cut), key=lambda d: (left[d] - demand[d], -d))
        else:
            d = left.index(max(left))
        out.append(d)
        left[d] -= f
    room[:] = left
    return np.asarray(out, dtype=np.int64)


def _room_rank(room: np.ndarray) -> np.ndarray:
    """[E] in [0, 1): rank of each device's room (more room, higher), for tie-breaking."""
    order = np.argsort(np.argsort(room, kind="stable"), kind="stable")
    return order / max(room.size, 1)


def _place_overflow(
    tokens: np.ndarray, freq: np.ndarray, room: np.ndarray, out: np.ndarray
) -> None:
    """Tokens that fit nowhere: heaviest first, each to the device with the most room."""
    for j in tokens[np.argsort(-freq[tokens], kind="stable")]:
        d = int(room.argmax())
        out[j] = d
        room[d] -= freq[j]


def _exchange(
    gain, freq, room, token_to_device, cand, tol, max_steps: int = 200, effort=None
) -> None:
    """Best-improvement pairwise exchanges of devices between tokens ``cand`` (in place).

    Tokens j (on p) and i (on q) trade devices when that raises the gain and both devices
    stay within their room.
    """
    f = freq[cand]
    g = gain[cand]  # [C, E]
    for _ in range(max_steps):
        charge(effort, "exchange", entries=cand.size**2)
        dev = token_to_device[cand]
        own = g[np.arange(cand.size), dev]
        # delta[a, b]: a takes b's device and b takes a's
        delta = g[:, dev] + g[:, dev].T - own[:, None] - own[None, :]
        fits = (room[dev][None, :] + f[None, :] - f[:, None] >= -tol) & (
            room[dev][:, None] + f[:, None] - f[None, :] >= -tol
        )
        delta = np.where(fits & (dev[:, None] != dev[None, :]), delta, -np.inf)
        a, b = np.unravel_index(int(delta.argmax()), delta.shape)
        if not delta[a, b] > 1e-9 * max(abs(own[a]) + abs(own[b]), 1.0):
            return
        p, q = dev[a], dev[b]
        room[p] += f[a] - f[b]
        room[q] += f[b] - f[a]
        token_to_device[cand[a]], token_to_device[cand[b]] = q, p


def _move_to_room(gain, freq, room, token_to_device, tol, passes: int = 3, effort=None) -> None:
    """Move tokens to a strictly better device that still has room (in place)."""
    rows = np.arange(token_to_device.size)
    for _ in range(passes):
        charge(effort, "move_to_room", entries=gain.size)
        current = gain[rows, token_to_device]
        g = np.where(freq[:, None] <= room[None, :] + tol, gain, -np.inf)
        best = g.argmax(axis=1)
        delta = g[rows, best] - current
        cand = np.flatnonzero(delta > 1e-12)
        if cand.size == 0:
            return
        cand = cand[np.argsort(-(delta[cand] / np.maximum(freq[cand], 1e-300)), kind="stable")]
        charge(effort, "move_to_room", steps=cand.size, calls=0)
        moved = False
        for j in cand:  # few tokens; one at a time so that the room stays exact
            d = best[j]
            if freq[j] <= room[d] + tol:
                room[token_to_device[j]] += freq[j]
                room[d] -= freq[j]
                token_to_device[j] = d
                moved = True
        if not moved:
            return


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
    (1.0 ... 2.0 times the mean load, and none) and the best penalised objective wins.
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
        placed by :func:`assign_tokens` in the room left.
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
    return t


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
    order = np.lexsort((-conf[rows], key))
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


# Polish and finish --------------------------------------------------------------------------


def polish(
    problem: LayerProblem,
    expert_to_device: np.ndarray,
    token_to_device: np.ndarray,
    *,
    max_rounds: int = 20,
    deadline: float | None = None,
    sweeps: int = 30,
    swaps: bool = True,
    exact: bool = True,
    effort: Effort | None = None,
) -> tuple[np.ndarray, np.ndarray, int]:
    """Local search from a placement; never lowers the objective.

    Two moves, each followed by the capacity token assignment for the new experts (kept
    only if it beats the old tokens under the new experts):

    1. the exact best experts for the current tokens (:func:`place_experts`);
    2. when 1 gains nothing and ``swaps``: expert swaps proposed by
       :func:`swap_candidates` (tokens free to move, capacity priced by the assignment's
       duals): first all non-overlapping proposals at once, then the best few alone.

    Stops when neither move gains, after ``max_rounds``, at ``deadline``
    (``time.perf_counter()`` value), or once ``effort`` is exhausted (every step is charged
    to it). Returns (expert_to_device, token_to_device, rounds).
    """
    x = np.asarray(expert_to_device, dtype=np.int64)
    gain = device_gains(problem, x, effort)
    result = assign_for_problem(problem, gain, sweeps=sweeps, exact=exact, effort=effort)
    prices = result.prices
    t, best = token_to_device, objective(problem, gain, token_to_device)
    if objective(problem, gain, result.token_to_device) > best:
        t, best = result.token_to_device, objective(problem, gain, result.token_to_device)
    rounds = 0
    for rounds in range(1, max_rounds + 1):  # noqa: B007
        if _out_of_time(deadline) or exhausted(effort):
            break
        improved = False
        for x_new in _moves(problem, x, t, gain, prices, swaps, deadline, effort):
            gain_new = device_gains(problem, x_new, effort)
            result = assign_for_problem(
                problem, gain_new, prices=prices, sweeps=sweeps, exact=exact, effort=effort
            )
            t_new, obj_new = (
                result.token_to_device,
                objective(problem, gain_new, result.token_to_device),
            )
            obj_keep = objective(problem, gain_new, t)
            if obj_keep > obj_new:
                t_new, obj_new = t, obj_keep
            if obj_new > best * (1 + 1e-12) + 1e-12:
                x, t, gain, best, prices = x_new, t_new, gain_new, obj_new, result.prices
                improved = True
                break
        if not improved:
            break
    return x, t, rounds


def swap_candidates(
    problem: LayerProblem,
    expert_to_device: np.ndarray,
    gain: np.ndarray,
    prices: np.ndarray,
    effort: Effort | None = None,
) -> list[tuple[float, int, int, int, int]]:
    """The most promising expert swap of every device pair, by a priced estimate.

    With capacity priced by the assignment's duals (``prices`` [E]), a token's value is
    ``max_d gain[j, d] - a_j prices[d]``, free to move. Swapping expert e (device p) with
    f (device q) changes only columns p and q of the gains of the tokens that route to e or
    f, so the change of the total value is computed exactly for every tried pair (vectorised
    over the [m, m] expert pairs of a device pair). Tried: for each device its
    ``_SWAP_PARTNERS`` most related devices, and per device pair the ``_SWAP_EXPERTS``
    experts of each side most drawn to the other side.

    The estimate ignores that moving tokens shifts the prices, so it is optimistic: callers
    verify candidates with the real assignment (:func:`polish`). Returns [(estimated gain,
    device p, device q, expert on p, expert on q)], best first, estimated gain > 0 only.
    The work is charged to ``effort`` when given.
    """
    x = np.asarray(expert_to_device, dtype=np.int64)
    e, per = problem.ep_size, problem.experts_per_device
    if e < 2:
        return []
    wc = problem.affinity_csc
    charge(effort, "swap_candidates", entries=gain.size, steps=e)
    adjusted = gain - problem.token_freq[:, None] * np.asarray(prices)[None, :]
    top = np.argsort(-adjusted, axis=1, kind="stable")[:, :3]
    top_values = np.take_along_axis(adjusted, top, axis=1)
    current = top_values[:, 0]
    members = [np.flatnonzero(x == d) for d in range(e)]
    # pull[d, k]: activations of expert k by the tokens whose priced best device is d
    pull = expert_scores(problem, adjusted.argmax(axis=1))
    # Device pairs: with many devices, only each device's strongest partners (by the pull
    # of its experts towards them). Experts: the m of each device most drawn to the other.
    cross = np.stack([pull[:, members[d]].sum(axis=1) for d in range(e)])  # [E, E]
    cross = cross + cross.T
    np.fill_diagonal(cross, -np.inf)
    partners = np.argsort(-cross, axis=1, kind="stable")[:, : min(e - 1, _SWAP_PARTNERS)]
    pairs = sorted({(min(p, q), max(p, q)) for p in range(e) for q in partners[p]})
    m = min(per, _SWAP_EXPERTS)
    chunk = max(1, _SWAP_BLOCK // (m * m))
    candidates = []
    for p, q in pairs:
        mem_p = members[p][np.argsort(pull[p, members[p]] - pull[q, members[p]], kind="stable")[:m]]
        mem_q = members[q][np.argsort(pull[q, members[q]] - pull[p, members[q]], kind="stable")[:m]]
        cols = np.concatenate((mem_p, mem_q))
        # only tokens that route to one of the tried experts change value
        rows, block_all = _column_block(wc, cols)
        charge(effort, "swap_pair", entries=rows.size * (m * m + 2))
        if rows.size == 0:
            continue
        # best adjusted value of each token outside devices p and q
        outside = best_outside(top[rows], top_values[rows], p, q)
        delta = np.zeros((m, m))
        for lo in range(0, rows.size, chunk):
            sel, block = rows[lo : lo + chunk], block_all[lo : lo + chunk]
            diff = block[:, None, m:] - block[:, :m, None]  # W[j, f] - W[j, e]
            # value on p, on q, or outside, less the current value (in place: temporaries
            # of [rows, m, m] cost more than the arithmetic)
            best = adjusted[sel, p][:, None, None] + diff
            on_q = np.subtract(adjusted[sel, q][:, None, None], diff, out=diff)
            np.maximum(best, on_q, out=best)
            np.maximum(best, outside[lo : lo + chunk, None, None], out=best)
            best -= current[sel][:, None, None]
            delta += best.sum(axis=0)
        i, j = np.unravel_index(int(delta.argmax()), delta.shape)
        candidates.append((float(delta[i, j]), p, q, mem_p[i], mem_q[j]))
    scale = max(float(np.abs(current).sum()), 1.0) * 1e-12
    return sorted((c for c in candidates if c[0] > scale), key=lambda c: -c[0])


def _column_block(wc, cols: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(rows [R], block [R, C]): the rows of W (CSC ``wc``) with a nonzero in ``cols``, in
    increasing order, and W[rows][:, cols] dense (copied from the columns' nonzeros)."""
    spans = [slice(wc.indptr[c], wc.indptr[c + 1]) for c in cols]
    touched = np.zeros(wc.shape[0], dtype=bool)
    for span in spans:
        touched[wc.indices[span]] = True
    rows = np.flatnonzero(touched)
    position = np.zeros(wc.shape[0], dtype=np.intp)
    position[rows] = np.arange(rows.size)
    block = np.zeros((rows.size, len(spans)))
    for i, span in enumerate(spans):
        block[position[wc.indices[span]], i] = wc.data[span]
    return rows, block


def best_outside(top: np.ndarray, values: np.ndarray, p, q) -> np.ndarray:
    """Each row's largest value on a device other than ``p`` and ``q``.

    ``top`` [R, D] holds each row's D >= 3 best devices (fewer when E < 3), best first, and
    ``values`` [R, D] their values. ``p`` and ``q`` are device ids (scalars: [R]) or one
    pair per column ([P] arrays: [R, P]); -inf where no such device is listed.
    """
    pair = np.ndim(p) > 0
    outside = np.full((top.shape[0], np.size(p)) if pair else top.shape[0], -np.inf)
    for r in range(top.shape[1] - 1, -1, -1):
        dev, val = (top[:, r, None], values[:, r, None]) if pair else (top[:, r], values[:, r])
        outside = np.where((dev != p) & (dev != q), val, outside)
    return outside


def _moves(problem, x, t, gain, prices, swaps: bool, deadline: float | None, effort=None):
    """Candidate expert placements for :func:`polish`, most promising first (lazy)."""
    n = problem.num_experts
    charge(effort, "place_experts", entries=problem.affinity.nnz, steps=n * n)
    best = place_experts(expert_scores(problem, t), problem.experts_per_device)
    if not (best == x).all():
        yield best
    if not swaps or _out_of_time(deadline) or exhausted(effort):
        return
    candidates = swap_candidates(problem, x, gain, prices, effort)
    # all non-overlapping candidates at once, then the best few alone
    batch = x.copy()
    used: set[int] = set()
    for _, p, q, a, b in candidates:
        if p not in used and q not in used:
            batch[a], batch[b] = q, p
            used.update((p, q))
    if len(used) > 2:
        yield batch
    for _, p, q, a, b in candidates[:_SWAP_TRIALS]:
        if _out_of_time(deadline) or exhausted(effort):
            return
        single = x.copy()
        single[a], single[b] = q, p
        yield single
    # few experts: the whole swap neighbourhood is cheap, so try every swap
    e = problem.ep_size
    if n * n * (e - 1) // (2 * e) <= _ALL_SWAPS:
        for a in range(n):
            for b in range(a + 1, n):
                if x[a] != x[b]:
                    single = x.copy()
                    single[a], single[b] = x[b], x[a]
                    yield single


def _out_of_time(deadline: float | None) -> bool:
    return deadline is not None and time.perf_counter() > deadline


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
        info=dict(info or {}),
    )
    placement.validate(problem)
    return placement


# Option kinds (check_options): "flag" bool; "text" str; "count" int >= 0; "count+" int >= 1;
# "number" finite real >= 0; "numbers" one such number or a non-empty list of them. A
# trailing "?" also allows null. Options not named in ``kinds`` take their default's kind.
_KIND_OF_DEFAULT = {bool: "flag", str: "text", int: "count", float: "number", tuple: "numbers"}


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
        ok = _is_number(value) and value == int(value) and value >= least
        want = f"an integer >= {least}"
    elif kind == "number":
        ok, want = _is_number(value), "a number >= 0"
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
        raise InputError(
            f"{method}: unknown option(s) {', '.join(unknown)}; known: {', '.join(sorted(defaults))}"
        )
    kinds = kinds or {}
    for key, value in given.items():
        kind = kinds.get(key) or _KIND_OF_DEFAULT.get(type(defaults[key]))
        problem = None if kind is None else _option_problem(value, kind)
        if problem:
            raise InputError(f"{method}: {key}={value!r} {problem}")
    return {**defaults, **given}

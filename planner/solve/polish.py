"""Local search on a placement: exact expert moves and priced expert swaps.

:func:`polish` improves any solver's placement without lowering its objective: the exact
best experts for the current tokens (:func:`planner.solve.common.place_experts`), then
expert swaps that :func:`swap_candidates` proposes from the assignment's dual prices, each
move followed by the shared token assignment. CEO polishes its sampled placements with it
(an improvement on paper 000 App. B), and the chain polish (:mod:`planner.solve.chain`)
borrows :func:`best_outside`. :func:`polish_placement` runs it on any other method's answer
(``SolverConfig.polish``): the baselines given the same local search as CEO, to show how
much of CEO's lead is its search and how much this shared machinery.

The search charges its work to an optional ``effort`` meter (:mod:`planner.solve.effort`).
"""

from __future__ import annotations

import math
import time

import numpy as np

from planner.solve.common import (
    assign_for_problem,
    device_gains,
    expert_scores,
    finish,
    improves,
    net_objective,
    objective,
    place_experts,
)
from planner.solve.effort import Effort, charge, exhausted
from planner.solve.expert_balance import ExpertLimit
from planner.solve.problem import LayerPlacement, LayerProblem, SolverConfig

# Work the polish of another method's answer may spend (SolverConfig.polish), in units of
# planner.solve.effort: what CEO's default budget leaves its screening and final polish
# (the 40% of 5M its search does not take).
POLISH_EFFORT = 2.0e6

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
# Problems with at most this many tokens (CEO's scoring tokens from E = 8 on) score many
# device pairs' swaps at once, over all their tokens: per-pair numpy calls cost more than
# the arithmetic there (timed on the DeepSeek-V3-shaped layer; beyond it, pair by pair wins).
_SWAP_ALL_ROWS = 2048
# Max elements of one [m, m, tokens, pairs] block when scoring device pairs together.
_SWAP_GROUP = 1 << 18


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
    limit: ExpertLimit | None = None,
) -> tuple[np.ndarray, np.ndarray, int]:
    """Local search from a placement; never lowers the objective.

    Two moves, each followed by the capacity token assignment for the new experts (kept
    only if it beats the old tokens under the new experts):

    1. the exact best experts for the current tokens (:func:`place_experts`);
    2. when 1 gains nothing and ``swaps``: expert swaps proposed by
       :func:`swap_candidates` (tokens free to move, capacity priced by the assignment's
       duals): first all non-overlapping proposals at once, then the best few alone.

    With ``limit`` (the expert-load cap, :class:`ExpertLimit`) only moves that keep every
    device's expert load within it, or within the start's peak where that is higher, are
    made.

    Stops when neither move gains, after ``max_rounds``, at ``deadline``
    (``time.perf_counter()`` value), or once ``effort`` is exhausted (every step is charged
    to it). Returns (expert_to_device, token_to_device, rounds).
    """
    x = np.asarray(expert_to_device, dtype=np.int64)
    if limit is not None:
        limit = limit.for_placement(x)
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
        for x_new in _moves(problem, x, t, gain, prices, swaps, deadline, effort, limit):
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
            if improves(obj_new, best):
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
    limit: ExpertLimit | None = None,
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
    device p, device q, expert on p, expert on q)], best first, estimated gain > 0 only;
    with ``limit``, only swaps that keep both devices' expert loads within it.
    The work is charged to ``effort`` when given.
    """
    x = np.asarray(expert_to_device, dtype=np.int64)
    e, per = problem.ep_size, problem.experts_per_device
    if e < 2:
        return []
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
    tried = _drawn_experts(members, pull, pairs, m)
    values = (adjusted, top, top_values, current)
    full = all(a.size == m and b.size == m for a, b in tried)  # m experts on each side
    if full and m > 1 and problem.num_tokens <= min(chunk, _SWAP_ALL_ROWS):
        scored = _score_pairs_together(problem, values, pairs, tried, m)
    else:
        scored = _score_pairs(problem, values, pairs, tried, m, chunk)
    candidates = []
    for (p, q), (mem_p, mem_q), (rows, delta) in zip(pairs, tried, scored, strict=True):
        charge(effort, "swap_pair", entries=rows * (m * m + 2))
        if rows == 0:
            continue
        if limit is not None:
            delta = np.where(limit.swaps_fit(x, mem_p[:, None], mem_q[None, :]), delta, -np.inf)
        i, j = np.unravel_index(int(delta.argmax()), delta.shape)
        candidates.append((float(delta[i, j]), p, q, mem_p[i], mem_q[j]))
    scale = max(float(np.abs(current).sum()), 1.0) * 1e-12
    return sorted((c for c in candidates if c[0] > scale), key=lambda c: -c[0])


def _drawn_experts(members: list[np.ndarray], pull: np.ndarray, pairs, m: int):
    """[(mem_p, mem_q)] per device pair (p, q): the ``m`` experts of p most drawn to q, and
    those of q most drawn to p (by increasing ``pull[own] - pull[other]``, ties by expert
    id: a stable sort). With as many experts on every device, one sort for all pairs."""
    if len({d.size for d in members}) != 1:
        return [
            tuple(
                members[a][np.argsort(pull[a, members[a]] - pull[b, members[a]], kind="stable")[:m]]
                for a, b in ((p, q), (q, p))
            )
            for p, q in pairs
        ]
    table = np.stack(members)  # [E, per]
    p, q = np.array(pairs, dtype=np.int64).reshape(-1, 2).T
    sides = []
    for own, other in ((p, q), (q, p)):
        experts = table[own]  # [P, per]
        drawn = pull[own[:, None], experts] - pull[other[:, None], experts]
        order = np.argsort(drawn, axis=1, kind="stable")[:, :m]
        sides.append(np.take_along_axis(experts, order, axis=1))
    return list(zip(*sides, strict=True))


def _score_pairs(problem, values, pairs, tried, m: int, chunk: int):
    """[(rows, delta [m, m])] per device pair: the tokens that route to one of its tried
    experts (rows: how many), and the summed value change of each swap over them."""
    adjusted, top, top_values, current = values
    wc = problem.affinity_csc
    out = []
    for (p, q), (mem_p, mem_q) in zip(pairs, tried, strict=True):
        # only tokens that route to one of the tried experts change value
        rows, block_all = _column_block(wc, np.concatenate((mem_p, mem_q)))
        if rows.size == 0:  # no swap changes a value (the caller skips the pair)
            out.append((0, np.zeros((m, m))))
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
        out.append((rows.size, delta))
    return out


def _score_pairs_together(problem, values, pairs, tried, m: int):
    """:func:`_score_pairs` for few tokens: many device pairs at once, over all the tokens.

    With few tokens the per-pair numpy calls cost more than the arithmetic, so the pairs
    are scored in groups of G, each over every token, in [m, m, tokens, G] blocks (numpy's
    inner loops then run over tokens x pairs). The results are the same bit for bit: the
    arithmetic of each entry is that of :func:`_score_pairs`; a token that routes to none
    of a pair's tried experts adds exactly +0.0 (its value on p, on q or outside is its
    current value, and no partial sum is -0.0); and numpy sums the tokens axis of a
    C-ordered block one token after the other when the axes after it hold more than one
    element (G > 1: a lone pair is scored twice), as it does for the [rows, m, m] block
    (m > 1; within ``_SWAP_BLOCK``, one chunk) of :func:`_score_pairs`.
    """
    adjusted, top, top_values, current = values
    num_tokens = problem.num_tokens
    wc = problem.affinity_csc
    mem = np.array([np.concatenate(t) for t in tried])  # [P, 2m] tried experts per pair
    group = max(2, _SWAP_GROUP // (num_tokens * m * m))
    # buffers for the [m, m, J, G] and [2m, J, G] blocks; each group's are C-ordered views
    most = num_tokens * max(2, min(group, len(pairs)))  # J x G of the largest group
    diff_buffer, best_buffer = np.empty(m * m * most), np.empty(m * m * most)
    block_buffer = np.empty(2 * m * most)
    out = []
    for lo in range(0, len(pairs), group):
        chosen = np.arange(lo, min(lo + group, len(pairs)))
        if chosen.size == 1:  # G > 1, see above
            chosen = np.repeat(chosen, 2)
        p, q = np.array([pairs[k] for k in chosen], dtype=np.int64).T
        g = chosen.size
        block = block_buffer[: 2 * m * num_tokens * g].reshape(2 * m, num_tokens, g)
        _fill_columns(block, wc, mem[chosen].T)  # block[c, j, k]: W[j, mem[k, c]]
        rows = np.count_nonzero(block.any(axis=0), axis=0).tolist()
        shape = (m, m, num_tokens, g)
        diff = diff_buffer[: math.prod(shape)].reshape(shape)
        best = best_buffer[: math.prod(shape)].reshape(shape)
        np.subtract(block[None, m:], block[:m, None], out=diff)  # W[j, f] - W[j, e]
        # value on p, on q, or outside, less the current value (as in _score_pairs); the
        # [J, G] terms go in as rows of [m * m, J * G] views (long inner loops)
        flat_diff, flat_best = diff.reshape(m * m, -1), best.reshape(m * m, -1)
        np.add(adjusted[:, p].reshape(1, -1), flat_diff, out=flat_best)
        on_q = np.subtract(adjusted[:, q].reshape(1, -1), flat_diff, out=flat_diff)
        np.maximum(flat_best, on_q, out=flat_best)
        np.maximum(flat_best, best_outside(top, top_values, p, q).reshape(1, -1), out=flat_best)
        flat_best -= np.repeat(current, g)[None, :]
        summed = best.sum(axis=2)  # [m, m, G]
        for k in range(min(group, len(pairs) - lo)):
            delta = np.zeros((m, m))
            delta += summed[:, :, k]  # from zeros, as _score_pairs sums (-0.0 becomes 0.0)
            out.append((rows[k], delta))
    return out


def _fill_columns(out: np.ndarray, wc, cols: np.ndarray) -> None:
    """``out[c, j, k] = W[j, cols[c, k]]`` for ``out`` [C, J, K] and ``cols`` [C, K], from
    W's CSC ``wc``: one scatter of the columns' nonzeros into zeros."""
    c, j, k = out.shape
    starts, ends = wc.indptr[cols.ravel()], wc.indptr[cols.ravel() + 1]
    lengths = ends - starts
    # per nonzero: its position in wc.indices / wc.data, and out's flat index of its row 0
    at = np.arange(lengths.sum()) + np.repeat(starts - (np.cumsum(lengths) - lengths), lengths)
    corner = np.repeat((np.arange(c)[:, None] * (j * k) + np.arange(k)).ravel(), lengths)
    out.fill(0.0)
    out.reshape(-1)[corner + wc.indices[at] * k] = wc.data[at]


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


def _moves(
    problem, x, t, gain, prices, swaps: bool, deadline: float | None, effort=None, limit=None
):
    """Candidate expert placements for :func:`polish`, most promising first (lazy); with
    ``limit``, only those within it."""
    n = problem.num_experts
    charge(effort, "place_experts", entries=problem.affinity.nnz, steps=n * n)
    best = place_experts(expert_scores(problem, t), problem.experts_per_device)
    if not (best == x).all() and (limit is None or limit.allows(best)):
        yield best
    if not swaps or _out_of_time(deadline) or exhausted(effort):
        return
    candidates = swap_candidates(problem, x, gain, prices, effort, limit)
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
        first, second = np.triu_indices(n, 1)
        fits = None if limit is None else limit.swaps_fit(x, first, second)
        for i, (u, v) in enumerate(zip(first.tolist(), second.tolist(), strict=True)):
            if x[u] != x[v] and (fits is None or fits[i]):
                single = x.copy()
                single[u], single[v] = x[v], x[u]
                yield single


def _out_of_time(deadline: float | None) -> bool:
    return deadline is not None and time.perf_counter() > deadline


def polish_placement(
    problem: LayerProblem, placement: LayerPlacement, config: SolverConfig
) -> LayerPlacement:
    """``placement`` (any method's answer) improved by the local search CEO ends with:
    exact expert moves, then priced swaps (:func:`polish`), within :data:`POLISH_EFFORT`
    work units and what the method left of the config's time limit. As in CEO, the moves
    keep to the expert-load cap (``config.expert_beta``; the placement is already under it,
    or at the lowest peak reached: :func:`planner.solve.registry.solve_layer`), and the
    polished placement is kept only when it scores higher net of the runtime cap's
    take-back on the fitting batches (:func:`planner.solve.common.net_objective`).
    ``info["polished"]`` reports the rounds, the work and whether the polish was kept."""
    started = time.perf_counter()
    effort = Effort(stop=POLISH_EFFORT)
    deadline = config.deadline(started - placement.seconds)  # one time limit for both
    limit = ExpertLimit.of(problem, config.expert_beta)
    x, t = placement.expert_to_device, placement.token_to_device
    y, u, rounds = polish(
        problem, x, t, deadline=deadline, sweeps=10, swaps=False, effort=effort, limit=limit
    )
    y, u, more = polish(
        problem, y, u, deadline=deadline, sweeps=10, swaps=True, effort=effort, limit=limit
    )
    kept = net_objective(problem, device_gains(problem, y), u) > net_objective(
        problem, device_gains(problem, x), t
    )
    info = placement.info | {
        "polished": {"rounds": rounds + more, "effort": round(effort.spent), "kept": kept}
    }
    if not kept:
        y, u = x, t
    return finish(
        problem, placement.method, y, seed=placement.seed,
        started=started - placement.seconds, token_to_device=u, info=info,
    )  # fmt: skip

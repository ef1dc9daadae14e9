"""Token assignment: tokens to devices within per-device load capacities.

Every solver's expert placement ends here: given device gains ``G [J, E]`` (``G[j, d]`` the
activations of token j that are local on device d) and token loads ``a [J]``,
:func:`assign_tokens` maximises ``sum_j G[j, t_j]`` with each device's load within its
capacity, a generalised-assignment problem (paper 000 §3.4's token step, paper 001
App. B's token placement). Its steps, each one function here: :func:`dual_prices` for the
LP relaxation's dual, heavy tokens placed one by one, a regret greedy for the rest,
exchanges among the heaviest, and devices left over their capacity relieved.
:func:`planner.solve.common.assign_for_problem` applies a problem's balance rule on top of
it.

The kernels charge their work to an optional ``effort`` meter (:mod:`planner.solve.effort`).
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import numpy as np

from planner._io import native_stdout
from planner.solve.effort import Effort, charge
from planner.solve.problem import LOAD_RTOL

# Rounds of vectorised proposals in assign_tokens before the (rare) sequential finish.
_MAX_PROPOSAL_ROUNDS = 64
# Relative gap under which two gains count as tied (ties are broken by room, not by index).
_TIE_EPS = 1e-9
# Problems with at most this many token x device entries are assigned exactly (0-1 program).
_EXACT_ENTRIES = 256
# A layer above _EXACT_ENTRIES and at most this many entries whose greedy assignment leaves a
# device over the cap where a packing within it may exist is assigned by the same program
# once, when its plan is built (:func:`within_cap`): a few tokens a device, where the greedy
# packs worst (100 tokens on 32 devices: 0.85 s).
_REPAIR_ENTRIES = 4096
# The exact program's bound: branch-and-bound nodes, so that where it gives up does not
# depend on the machine's speed (a 2-second clock did; 200 nodes took 1.7 s on the reference
# machine, on a 30-token, 6-device program at beta 1.0 whose cap no assignment meets and
# HiGHS cannot prove so), and a clock far above it in case a node is slow.
_EXACT_NODES = 200
_EXACT_SECONDS = 30.0
# Tokens considered by the pairwise exchange pass (the heaviest; all when J is at most this).
_EXCHANGE_TOKENS = 256
# Tokens heavier than this share of the mean device capacity are placed one by one first.
_HEAVY_SHARE = 0.01


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
    and unit of load; four steps:

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
    4. Devices left over their capacity (beyond a token heavier than it, which may fill a
       device alone) are relieved by moves and trades, the devices furthest over first
       (:func:`_relieve_overflow`).

    On real OLMoE layers this lands within ~0.05-0.6% of the LP bound (the regret greedy
    alone loses 2-3%). Zero-frequency tokens take their best device. Tiny problems (at most
    ``_EXACT_ENTRIES`` token x device entries, where heavy tokens make the greedy's
    integrality losses large) are solved exactly by a 0-1 program instead; if no assignment
    fits the capacities, by the same program with each token heavier than a device's room
    allowed to fill that device alone (:func:`heavy_fill_loads`), then under the heaviest load
    the steps above reach, then with one maximal token of slack on every device (the ILP
    solver falls back alike), and if none fits that either, the steps above apply (with the
    overflow rule).
    """
    gain = np.asarray(gain, dtype=np.float64)
    freq = np.asarray(freq, dtype=np.float64)
    room = np.broadcast_to(np.asarray(capacity, dtype=np.float64), (gain.shape[1],))
    # Loads below 1 (frequencies given as shares, say) are scaled up by a power of two, and
    # gains below 1 by their own, which is exact, so that the absolute tolerances below and
    # HiGHS's stay small against them: with loads of 1e-9, every token fitted anywhere
    # within them; with gains of 1e-8 against loads of 1-10, the exchanges took every gain
    # for noise (CEO's LAR 0.377 where it was 0.497 unscaled). Values of 1 and more stay as
    # they are. The prices (gain per unit of load) are returned in the caller's units.
    load_shift = shift_to_one(np.concatenate((room, freq)))
    gain_shift = shift_to_one(gain.ravel())
    if load_shift == gain_shift == 0:
        return _assign_tokens(gain, freq, room, prices, sweeps, exact, effort)
    price_shift = gain_shift - load_shift
    if prices is not None:
        prices = np.ldexp(np.asarray(prices, dtype=np.float64), price_shift)
    result = _assign_tokens(
        np.ldexp(gain, gain_shift), np.ldexp(freq, load_shift), np.ldexp(room, load_shift),
        prices, sweeps, exact, effort,
    )  # fmt: skip
    return Assignment(result.token_to_device, np.ldexp(result.prices, -price_shift))


def shift_to_one(values: np.ndarray) -> int:
    """k > 0 such that the largest finite ``|values|`` times 2**k lies in [1, 2), when it is
    below 1 (else 0)."""
    top = float(np.abs(values[np.isfinite(values)]).max(initial=0.0))
    return -math.floor(math.log2(top)) if 0.0 < top < 1.0 else 0


def _assign_tokens(
    gain: np.ndarray,
    freq: np.ndarray,
    capacity: np.ndarray,
    prices: np.ndarray | None,
    sweeps: int,
    exact: bool,
    effort: Effort | None,
) -> Assignment:
    """:func:`assign_tokens` on loads as they are (float64 ``gain`` and ``freq``)."""
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
        if solved is None and freq[busy].max() > room.min():
            # a token heavier than a device's room may fill that device alone (the ILP's
            # fallback too, planner.solve.ilp)
            solved = _assign_exact(gain[busy], freq[busy], room, heavy_fill=True)
        if solved is None:
            # none fits still: every device's room raised by the least amount some
            # assignment of these loads needs (the same whatever the experts, so every
            # placement is scored under one rule; the ILP's start_load, whose start is
            # this assignment), else by what the steps below reach (the slack rule's alone
            # had let a device go to 86 where the greedy kept every device within 52, cap
            # 50.5); where the program finds no assignment within the greedy's in its
            # node limit, the greedy's own (the slack rule's program had taken a 30-token
            # layer at beta 1 from the greedy's peak of 29.5 to 42.2, cap 29.2)
            greedy = _assign_tokens(gain, freq, capacity, prices, sweeps, False, effort)
            reached = np.bincount(greedy.token_to_device[busy], weights=freq[busy], minlength=e)
            reached_lift = float((reached - room).max())
            packing = least_packing(freq[busy], room)
            heaviest = float(freq[busy].max())
            if packing is not None and packing[0] < min(reached_lift - tol, heaviest):
                lift, packed = packing
                solved = _assign_exact(gain[busy], freq[busy], room + lift)
                if solved is None:
                    # the program finds none within its node limit under the least lift: the
                    # packing that needs no more, its tokens moved and traded within it
                    # (where a placement's own greedy peak was used instead, CEO's and
                    # METIS' plans went to 157 and 164 where every other method kept 154)
                    solved = _improved_within(gain[busy], freq[busy], room + lift, packed, tol)
            elif reached_lift < heaviest:
                solved = _assign_exact(gain[busy], freq[busy], room + reached_lift)
            if solved is None and reached_lift >= heaviest:
                # then one maximal token above the cap, the slack rule of
                # planner.solve.problem and the ILP's last fallback
                solved = _assign_exact(gain[busy], freq[busy], room + heaviest)
            if solved is None:  # none found within those: the steps below, already taken
                return greedy
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
    # integrality matters for heavy tokens: pairwise exchanges among them (all tokens when
    # there are few)
    cand = heavy if num_tokens > _EXCHANGE_TOKENS else busy
    cand = cand[np.argsort(-freq[cand], kind="stable")[:_EXCHANGE_TOKENS]]
    _move_and_trade(gain, freq, room, token_to_device, cand, tol, effort)
    # tokens that fit nowhere went to the emptiest device: moved and traded back towards
    # the cap (30 tokens at beta 1 on 16 devices, two heavier than the cap: METIS', k-means'
    # and alternating's plans had a device at 1.107 of the cap, now 1.04; a packing within
    # 1.02 exists)
    if (
        (room < -tol).any()
        and np.isfinite(room).all()
        and _relieve_overflow(
            gain, freq, np.broadcast_to(capacity, (e,)), token_to_device, busy, tol, effort
        )
    ):
        room = capacity - np.bincount(token_to_device[busy], weights=freq[busy], minlength=e)
        _move_and_trade(gain, freq, room, token_to_device, cand, tol, effort)
    if 0 < busy.size * e <= _EXACT_ENTRIES and np.isfinite(capacity).all():
        # a few tokens assigned without the exact path (a search scoring its samples):
        # where they fit nowhere by packing, the exact path's rule, every device's room
        # raised by the least amount any assignment needs, and tokens move and trade
        # within it (kept within the cap, the greedy had scored placements up to 15% below
        # the exact path at the same peak, and CEO's search passed the ILP's placement by)
        lift = -float(room.min())  # the most a device went over its cap
        if lift > tol and freq[busy].max() <= capacity.min():
            least = least_lift(freq[busy], capacity)
            room += lift if least is None else min(lift, least)
            _move_and_trade(gain, freq, room, token_to_device, cand, tol, effort)
    return Assignment(token_to_device, price)


def assign_penalised_exact(gain: np.ndarray, freq: np.ndarray, theta: float) -> np.ndarray | None:
    """The token assignment of a few tokens (at most ``_EXACT_ENTRIES`` loaded token x device
    entries) that maximises penalty mode's objective, ``(1 - theta) * sum_j gain[j, t_j] -
    theta * sum_d |load_d - S / E|``, exactly (a 0-1 program); None for more tokens or where
    the program finds none. The ladder of caps penalty mode otherwise tries scores gains
    only under each cap: with every gain tied, five unit tokens on four devices came out
    2, 2, 0, 1 (objective 1.0) on every rung instead of 2, 1, 1, 1 (1.75)."""
    gain = np.asarray(gain, dtype=np.float64)
    freq = np.asarray(freq, dtype=np.float64)
    e = gain.shape[1]
    t = gain.argmax(axis=1).astype(np.int64)  # load-free rows: their best device
    busy = np.flatnonzero(freq > 0)
    if busy.size * e > _EXACT_ENTRIES or not np.isfinite(gain).all():
        return None
    if busy.size == 0:
        return t
    # one power of two for gains and loads alike: the objective mixes them
    shift = shift_to_one(np.concatenate((gain[busy].ravel(), freq[busy])))
    g, a = np.ldexp(gain[busy], shift), np.ldexp(freq[busy], shift)
    mean = float(a.sum()) / e
    # the continuous variables dev_d >= |load_d - mean|
    y = _solve_assignment(
        np.r_[-(1.0 - theta) * g.ravel(), np.full(e, theta)],
        np.broadcast_to(a[:, None], g.shape),
        [(1.0, mean), (-1.0, -mean)],
        extra=e,
    )
    if y is None:
        return None
    t[busy] = y
    return t


def least_lift(freq: np.ndarray, room: np.ndarray) -> float | None:
    """The least s >= 0 such that some assignment of tokens of loads ``freq`` puts at most
    ``room + s`` on every device (a makespan problem; it does not depend on the gains): the
    best the 0-1 program finds within its node limit (the least wherever it proves it), None
    where it finds none. For a few tokens, as on the exact path; cached by its inputs."""
    packing = least_packing(freq, room)
    return None if packing is None else packing[0]


def least_packing(freq: np.ndarray, room: np.ndarray) -> tuple[float, np.ndarray] | None:
    """(:func:`least_lift`, an assignment [J] that needs no more), None where none is found."""
    freq = np.ascontiguousarray(freq, dtype=np.float64)
    room = np.ascontiguousarray(room, dtype=np.float64)
    found = _least_packing(freq.tobytes(), room.tobytes())
    return None if found is None else (found[0], np.frombuffer(found[1], dtype=np.int64).copy())


@functools.lru_cache(maxsize=1024)
def _least_packing(freq_bytes: bytes, room_bytes: bytes) -> tuple[float, bytes] | None:
    freq, room = np.frombuffer(freq_bytes), np.frombuffer(room_bytes)
    cost = np.zeros(freq.size * room.size + 1)
    cost[-1] = 1.0  # minimise the one continuous variable s: load_d - s <= room_d
    load = np.broadcast_to(freq[:, None], (freq.size, room.size))
    t = _solve_assignment(cost, load, [(1.0, room)], extra=1)
    if t is None:
        return None
    lift = max(float((np.bincount(t, weights=freq, minlength=room.size) - room).max()), 0.0)
    return lift, t.tobytes()


def _assign_exact(
    gain: np.ndarray, freq: np.ndarray, room: np.ndarray, heavy_fill: bool = False
) -> np.ndarray | None:
    """Optimal assignment of a few tokens by a 0-1 program (HiGHS via scipy); None if none fits.

    ``heavy_fill``: a token heavier than a device's room counts as that room there, so it
    may sit on the device alone (:func:`heavy_fill_loads`)."""
    load = (
        heavy_fill_loads(freq, room) if heavy_fill else np.broadcast_to(freq[:, None], gain.shape)
    )
    return _solve_assignment(-gain.ravel(), load, [(1.0, room)])


def _improved_within(
    gain: np.ndarray, freq: np.ndarray, room: np.ndarray, start: np.ndarray, tol: float
) -> np.ndarray:
    """``start`` (within ``room``) with tokens moved and traded to better devices within it."""
    t = start.copy()
    left = room - np.bincount(t, weights=freq, minlength=room.size)
    _move_and_trade(gain, freq, left, t, np.argsort(-freq, kind="stable"), tol, None)
    return t


def _move_and_trade(gain, freq, room, token_to_device, cand, tol, effort) -> None:
    """Tokens moved to better devices with room, then pairwise exchanges among ``cand``
    (when there are two or more) and moves again (in place; ``room`` updated)."""
    _move_to_room(gain, freq, room, token_to_device, tol, effort=effort)
    if cand.size > 1:
        _exchange(gain, freq, room, token_to_device, cand, tol, effort=effort)
        _move_to_room(gain, freq, room, token_to_device, tol, effort=effort)


def _relieve_overflow(
    gain: np.ndarray,
    freq: np.ndarray,
    capacity: np.ndarray,
    token_to_device: np.ndarray,
    busy: np.ndarray,
    tol: float,
    effort: Effort | None,
    max_steps: int = 500,
) -> bool:
    """Devices over their capacity relieved by moving tokens to devices with room, or by
    trading one for a lighter token of a device that then stays within its capacity: the
    devices furthest over first, and of the moves and trades that relieve them the one that
    loses the least gain per unit of load relieved (tokens ``busy``). Kept where every
    device ends within its capacity (``token_to_device`` in place; True then); elsewhere
    the plan stays as it was: chasing a lower peak under the slack rule cost gain out of
    all proportion (on 30 tokens at beta 1 on six devices, 35% of the local activations
    for a peak 0.1% lower).

    A token heavier than a device's capacity may fill that device alone (the heavy-fill
    rule, :func:`heavy_fill_loads`): such a device may hold its heaviest token, and what
    else it holds is its excess. Devices that receive load stay within what they may hold.
    """
    e = capacity.size
    f = freq[busy]
    plan = token_to_device.copy()
    for _ in range(max_steps):
        t = plan[busy]
        excess = heavy_fill_excess(f, t, capacity)
        over = excess > tol
        if not over.any():
            break
        charge(effort, "relieve_overflow", entries=busy.size * e)
        room = -excess  # what each device may still take (negative where over)
        # the devices furthest over first (the cheapest relief anywhere first had taken a
        # device from 11 to 10 and left another at 12, where 11, 11, 10 was there to find)
        on_over = np.flatnonzero(excess[t] >= excess.max() - tol)
        on_over = on_over[np.argsort(-f[on_over], kind="stable")[:_EXCHANGE_TOKENS]]
        src = t[on_over]
        own = gain[busy[on_over], src]
        best_rate, best_step = -np.inf, None  # best_step: (token in on_over, device, other)
        # moves: a token of an over-full device to a device with room for it
        fits = (f[on_over, None] <= room[None, :] + tol) & ~over[None, :]
        if fits.any():
            relief = np.minimum(f[on_over], excess[src])
            rate = np.where(fits, (gain[busy[on_over]] - own[:, None]) / relief[:, None], -np.inf)
            i, q = (int(k) for k in np.unravel_index(int(rate.argmax()), rate.shape))
            if np.isfinite(rate[i, q]):
                best_rate, best_step = float(rate[i, q]), (i, q, -1)
        # trades: with a lighter token of a device within its capacity, which stays so
        others = np.flatnonzero(~over[t] & (f < f[on_over].max()))
        others = others[np.argsort(-f[others], kind="stable")[:_EXCHANGE_TOKENS]]
        if others.size:
            dst = t[others]
            gap = f[on_over, None] - f[None, others]
            relief = np.minimum(gap, excess[src][:, None])
            ok = (relief > tol) & (gap <= room[dst][None, :] + tol)
            if ok.any():
                delta = (
                    gain[busy[on_over][:, None], dst[None, :]]
                    + gain[busy[others][None, :], src[:, None]]
                    - own[:, None]
                    - gain[busy[others], dst][None, :]
                )
                rate = np.where(ok, delta / np.where(ok, relief, 1.0), -np.inf)
                i, k = (int(v) for v in np.unravel_index(int(rate.argmax()), rate.shape))
                if rate[i, k] > best_rate:
                    best_step = (i, int(dst[k]), int(others[k]))
        if best_step is None:
            break
        i, q, other = best_step
        if other >= 0:  # a trade: the other token takes this one's device
            plan[busy[other]] = src[i]
        plan[busy[on_over[i]]] = q
    if heavy_fill_excess(f, plan[busy], capacity).max() > tol or (plan == token_to_device).all():
        return False
    token_to_device[:] = plan
    return True


def heavy_fill_excess(freq: np.ndarray, token_to_device: np.ndarray, capacity) -> np.ndarray:
    """[E] each device's load beyond what it may hold: its capacity, or its heaviest token
    where that is heavier (the heavy-fill rule, :func:`heavy_fill_loads`); negative where it
    has room."""
    capacity = np.asarray(capacity, dtype=np.float64)
    e = capacity.size
    heaviest = np.zeros(e)
    np.maximum.at(heaviest, token_to_device, freq)
    load = np.bincount(token_to_device, weights=freq, minlength=e)
    return load - np.maximum(capacity, heaviest)


def within_cap(
    gain: np.ndarray, freq: np.ndarray, capacity: float, token_to_device: np.ndarray
) -> np.ndarray:
    """``token_to_device``, or where it leaves a device over the cap (beyond a token heavier
    than the cap filling a device alone) on a layer of at most ``_REPAIR_ENTRIES`` loaded
    token x device entries where a packing within the cap is found (:func:`packing_within`,
    else :func:`least_packing`), an assignment within it: the exact program's, else that
    packing with its tokens moved and traded within it. Layers of at most
    ``_EXACT_ENTRIES`` entries are left as they are (their assignment was the exact
    path's already).

    The greedy packs a few tokens a device worst: on 100 tokens at beta 1.1 on 32 devices
    it left a device at 1.026 of the cap (token imbalance 1.13) with 1861 local
    activations, where the program finds 0.993 and 1954."""
    freq = np.asarray(freq, dtype=np.float64)
    busy = np.flatnonzero(freq > 0)
    e = gain.shape[1]
    if not _EXACT_ENTRIES < busy.size * e <= _REPAIR_ENTRIES or not np.isfinite(capacity):
        return token_to_device
    load_shift = shift_to_one(np.r_[freq[busy], capacity])
    a = np.ldexp(freq[busy], load_shift)
    room = np.full(e, np.ldexp(float(capacity), load_shift))
    tol = LOAD_RTOL * max(float(room[0]), 1.0)
    if heavy_fill_excess(a, token_to_device[busy], room).max() <= tol:
        return token_to_device
    clipped = np.minimum(a, room[0])
    packed = packing_within(clipped, room)
    if packed is None:
        # the makespan program finds some packings the one without an objective does not
        # (60 tokens on 8 devices at beta 1: 91 against a cap of 88 where it found 88)
        least = least_packing(clipped, room)
        if least is None or least[0] > tol:  # none found: the slack rule stands
            return token_to_device
        packed = least[1]
    g = np.ldexp(np.asarray(gain, dtype=np.float64)[busy], shift_to_one(gain[busy].ravel()))
    solved = _assign_exact(g, a, room, heavy_fill=bool(a.max() > room[0]))
    if solved is None:
        solved = _improved_within(g, clipped, room, packed, tol)
    out = np.asarray(token_to_device, dtype=np.int64).copy()
    out[busy] = solved
    return out


def packing_within(freq: np.ndarray, room: np.ndarray) -> np.ndarray | None:
    """An assignment [J] of tokens of loads ``freq`` that puts at most ``room`` on every
    device, the first the 0-1 program finds (no objective), None where it finds none within
    its node limit. It does not depend on the gains, so it is cached by its inputs: a layer
    costs one program whatever the placements tried (at most 3.6 s on 100 tokens on 32
    devices; the program with the gains in its objective took 27 s there and found none)."""
    freq = np.ascontiguousarray(freq, dtype=np.float64)
    room = np.ascontiguousarray(room, dtype=np.float64)
    found = _packing_within(freq.tobytes(), room.tobytes())
    return None if found is None else np.frombuffer(found, dtype=np.int64).copy()


@functools.lru_cache(maxsize=256)
def _packing_within(freq_bytes: bytes, room_bytes: bytes) -> bytes | None:
    freq, room = np.frombuffer(freq_bytes), np.frombuffer(room_bytes)
    load = np.broadcast_to(freq[:, None], (freq.size, room.size))
    t = _solve_assignment(np.zeros(freq.size * room.size), load, [(1.0, room)])
    return None if t is None else t.tobytes()


def _solve_assignment(
    cost: np.ndarray, load: np.ndarray, bounds: list[tuple[float, Any]], extra: int = 0
) -> np.ndarray | None:
    """The tokens' devices in the optimum of a 0-1 program over ``y[j, d]`` (each token on
    one device; HiGHS via scipy, within ``_EXACT_NODES`` nodes), None where it finds none.

    Args:
        cost: [J * E + extra] minimised; y row-major, then ``extra`` continuous variables
            ``v >= 0``: one (``extra`` 1) or one per device (``extra`` E).
        load: [J, E] what token j adds to device d's load.
        bounds: (sign, upper) pairs, each E constraints ``sign * load_d - v_d <= upper``
            (``v`` the one extra variable when there is one; no ``v`` without them).

    Programs are cached by their inputs: a search scores the same placement again and
    again (a polish's moves on 14 tokens on four devices: 293 programs, 115 distinct).
    """
    upper = tuple((float(sign), _bytes(np.broadcast_to(u, load.shape[1]))) for sign, u in bounds)
    found = _solved(_bytes(cost), _bytes(load), load.shape, upper, extra)
    return None if found is None else np.frombuffer(found, dtype=np.int64).copy()


def _bytes(values: Any) -> bytes:
    return np.ascontiguousarray(values, dtype=np.float64).tobytes()


@functools.lru_cache(maxsize=4096)
def _solved(
    cost_bytes: bytes, load_bytes: bytes, shape: tuple[int, int], bounds: tuple, extra: int
) -> bytes | None:
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import coo_matrix, eye, hstack, kron

    cost = np.frombuffer(cost_bytes)
    load = np.frombuffer(load_bytes).reshape(shape)
    num_tokens, e = shape
    n = num_tokens * e
    one_device = kron(eye(num_tokens), np.ones((1, e)))
    rows = np.tile(np.arange(e), num_tokens)
    loads = coo_matrix((np.ravel(load), (rows, np.arange(n))), shape=(e, n))
    if extra:
        one_device = hstack([one_device, coo_matrix((num_tokens, extra))])
        coupling = -eye(e) if extra == e else -np.ones((e, 1))
    constraints = [LinearConstraint(one_device, 1, 1)]
    for sign, upper in bounds:
        block = sign * loads
        if extra:
            block = hstack([block, coupling])
        constraints.append(LinearConstraint(block, -np.inf, np.frombuffer(upper)))
    with native_stdout():  # HiGHS' debug lines, which no option silences
        result = milp(
            cost, constraints=constraints, integrality=np.r_[np.ones(n), np.zeros(extra)],
            bounds=Bounds(np.zeros(n + extra), np.r_[np.ones(n), np.full(extra, np.inf)]),
            options={"node_limit": _EXACT_NODES, "time_limit": _EXACT_SECONDS},
        )  # fmt: skip
    if result.x is None:
        return None
    return result.x[:n].reshape(num_tokens, e).argmax(axis=1).astype(np.int64).tobytes()


def heavy_fill_loads(freq: np.ndarray, room: np.ndarray | float) -> np.ndarray:
    """[J, E] (or [J, 1] for one ``room`` shared by every device) the load token j counts
    for on device d when a token heavier than a device's
    room may fill it alone: ``min(a_j, room_d)`` (``a_j`` where the room is not positive, so
    a full device stays full). Under ``sum_j load[j, d] y[j, d] <= room_d`` such a token
    takes its device to its cap and shares it with load-free tokens only: the tightest rule
    under which an instance whose heaviest token outweighs a device's cap has a solution
    (when several tokens near the cap leave none, the slack rule of
    :mod:`planner.solve.problem` is what is left)."""
    freq = np.asarray(freq, dtype=np.float64)[:, None]
    room = np.atleast_1d(np.asarray(room, dtype=np.float64))[None, :]
    return np.where(room > 0, np.minimum(freq, room), freq)


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
    if e == 1:  # nothing to choose: an over-full device's price would run to infinity
        return np.zeros(1)
    devices, cols = np.arange(e), np.arange(num_tokens)
    # Device-major [E, J]: each sweep reduces over the few devices of many tokens, which
    # numpy does row against row, faster than token by token along a short last axis (a
    # 50k x 8 call: 160 ms instead of 240). The arithmetic is elementwise the same, and so
    # are the prices, bit for bit.
    gain_t = np.ascontiguousarray(gain.T)
    # two [E, J] buffers reused by every sweep (fresh temporaries cost page faults), and
    # their flat views: 1-D indexing is several times faster than (row, column) pairs
    adjusted, threshold = np.empty_like(gain_t), np.empty_like(gain_t)
    positive = np.empty(gain_t.shape, dtype=bool)
    flat_gain, flat_threshold = gain_t.reshape(-1), threshold.reshape(-1)
    row_starts = np.arange(e + 1) * num_tokens  # flat index of each device's first entry
    scale = float(np.max(np.divide(gain_t, freq, out=threshold), initial=1.0))
    for _ in range(sweeps):
        charge(effort, "dual_prices", entries=num_tokens * e, steps=num_tokens)
        np.subtract(gain_t, np.multiply.outer(price, freq, out=adjusted), out=adjusted)
        first, best, second = _best_two(adjusted)
        # token j prefers d while p_d < threshold: its gain there over its best elsewhere
        np.divide(np.subtract(gain_t, best, out=threshold), freq, out=threshold)
        at_first = first * num_tokens + cols  # flat index of (first[j], j)
        flat_threshold[at_first] = (flat_gain[at_first] - second) / freq
        # the positive thresholds device by device, as np.nonzero lists them (td sorted)
        flat = np.flatnonzero(np.greater(threshold, 0.0, out=positive))
        bounds = np.searchsorted(flat, row_starts)  # each device's entries in flat: [E + 1]
        td = np.repeat(devices, bounds[1:] - bounds[:-1])
        tj, tv = flat - td * num_tokens, flat_threshold[flat]
        # the order permutes within each device's segment, so td stays as it is
        order = descending_within_groups(td, tv, e)
        tv, load = tv[order], freq[tj[order]]
        csum = np.cumsum(load)
        before = np.concatenate(([0.0], csum))[bounds[:-1]]
        over = np.flatnonzero(csum - before[td] > room[td])
        new = np.zeros(e)
        if over.size:
            # the first over-full position of each device (over is sorted, and so is td)
            head = np.searchsorted(over, bounds[:-1])
            found = head < over.size
            found[found] &= over[head[found]] < bounds[1:][found]
            new[found] = tv[over[head[found]]]
        new = np.where(np.isfinite(room), new, 0.0)
        step = new - price
        price = price + damping * step
        if np.abs(step).max() <= 1e-7 * scale:
            break
    return price


def descending_within_groups(group: np.ndarray, value: np.ndarray, groups: int) -> np.ndarray:
    """``np.lexsort((-value, group))``: by group, then by decreasing value, ties in order.

    ``group`` [M] ints in [0, groups), ``value`` [M] floats. The same permutation, mostly
    from one sort of integer keys (:func:`_keyed_order`): 2-4 times faster from 1k entries.
    """
    order = _keyed_order(group, value, groups)
    return np.lexsort((-value, group)) if order is None else order


# Mask of the magnitude bits of a float64 seen as an int64.
_MAGNITUDE = np.int64(0x7FFF_FFFF_FFFF_FFFF)


def _keyed_order(group: np.ndarray, value: np.ndarray, groups: int) -> np.ndarray | None:
    """``np.lexsort((-value, group))`` from one unstable sort of distinct int64 keys, or None.

    ``group`` [M] ints in [0, groups), ``value`` [M] floats. Each key packs the group, the
    top bits of ``-value`` as an order-preserving integer, and the entry's index, so the
    sorted keys list the entries by group, then by ``-value``, then by index, except that
    values agreeing in those top bits (equal, or nearly: the sweeps' thresholds often
    differ in the last bits only) come by index. Each run of such entries that holds
    different values is then put in order by one stable sort of those runs' entries. A
    SIMD integer sort thus replaces most of a stable float sort: 2-3 times faster on
    30k-120k entries. None (call lexsort) when there is a NaN or too few bits for values.
    """
    m = value.size
    index_bits = max(m - 1, 1).bit_length()
    value_bits = 63 - index_bits - max(groups - 1, 1).bit_length()
    if value_bits < 24 or np.isnan(value).any():
        return None
    negated = np.negative(value)
    negated += 0.0  # -0.0 -> 0.0: lexsort ranks them equal
    bits = negated.view(np.int64)
    bits ^= (bits >> 63) & _MAGNITUDE  # now ascending with the float (negatives reversed)
    bits >>= 64 - value_bits  # the top bits: [-2^(value_bits-1), 2^(value_bits-1))
    bits += 1 << (value_bits - 1)
    bits <<= index_bits
    bits += np.asarray(group, dtype=np.int64) << (value_bits + index_bits)
    bits += np.arange(m)
    bits.sort()
    order = bits & ((1 << index_bits) - 1)
    if m < 2:
        return order
    bits >>= index_bits  # (group, top bits of -value) of each sorted entry
    tied = bits[1:] == bits[:-1]
    ranked = value[order]
    mixed = np.flatnonzero(tied & (ranked[1:] != ranked[:-1]))
    if mixed.size:
        run = np.concatenate(([0], np.cumsum(~tied)))  # run number of each sorted entry
        is_mixed = np.zeros(int(run[-1]) + 1, dtype=bool)
        is_mixed[run[mixed]] = True
        redo = np.flatnonzero(is_mixed[run])  # the entries of those runs, run by run
        # within a run the entries are in index order, which the stable sort keeps on ties
        order[redo] = order[redo[np.lexsort((-ranked[redo], run[redo]))]]
    return order


def _best_two(values: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per column of ``values`` [E, J]: (first [J], best [J], second [J]).

    ``first`` is the row of the column's maximum ``best`` (the lowest row on ties, as
    ``argmax``), ``second`` the largest value in the other rows (-inf when E = 1).
    ``values`` is left as it was.

    One pass over the rows keeps the running best two: ``best`` is the same running
    ``np.maximum`` that ``values.max(axis=0)`` reduces with, and a row takes over ``first``
    only when strictly larger, so ties keep the lowest row. Three times faster than finding
    ``first`` by masks and ``second`` by fancy indexing (row numbers as uint8: a quarter of
    the memory traffic).
    """
    e, num = values.shape
    best = values[0].copy()
    second = np.full(num, -np.inf)
    small = np.uint8 if e <= 256 else np.intp
    first = np.zeros(num, dtype=small)
    larger, row, smaller = np.empty(num, dtype=bool), np.empty(num, dtype=small), np.empty(num)
    for d in range(1, e):
        v = values[d]
        np.greater(v, best, out=larger)
        # rows come in increasing order: max(first, d * larger) sets first to d where larger
        np.multiply(larger.view(np.uint8), d, out=row, dtype=small)
        np.maximum(first, row, out=first)
        np.maximum(second, np.minimum(best, v, out=smaller), out=second)
        np.maximum(best, v, out=best)
    return first.astype(np.int64), best, second


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
            _place_overflow(pending[stuck], gain, freq, room, out, tol)
            pending, f, fits = pending[~stuck], f[~stuck], fits[~stuck]
            if pending.size == 0:
                break
        # ties go to the device with more room (not the lowest index: labels are arbitrary)
        tie_break = _TIE_EPS * max(float(np.abs(gain[pending]).max(initial=0.0)), 1e-300)
        g = np.where(fits, gain[pending] + tie_break * _room_rank(room)[None, :], -np.inf)
        best, best_value, second = _best_two(np.ascontiguousarray(g.T))
        regret = np.where(np.isfinite(second), best_value - second, np.inf)
        order = descending_within_groups(best, regret / f, e)
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
            _place_overflow(np.array([j]), gain, freq, room, out, tol)
    return out


def _place_heavy(
    gain: np.ndarray, freq: np.ndarray, price: np.ndarray, room: np.ndarray, demand, tol
) -> np.ndarray:
    """Heavy tokens one by one, in the given order (step 2 of :func:`assign_tokens`).

    Each goes to its best adjusted device (``gain - freq * price``) among those it fits on;
    among (near-)ties the device with the most room beyond the light tokens' ``demand``; a
    token that fits nowhere takes the device with the most room (:func:`_emptiest`). Updates
    ``room``. Plain Python floats (the same IEEE arithmetic as numpy's): per token, numpy's
    call overhead on E values cost several times the work.

    Most tokens have one clear best device (no other within the tie margin) and fit on it;
    the rule then picks that device whatever the other devices' room, so the scan over the
    devices is skipped for them (the margins are found for all tokens at once beforehand).
    """
    adjusted_array = gain - freq[:, None] * price[None, :]
    adjusted = adjusted_array.tolist()
    left, demand = room.tolist(), np.asarray(demand).tolist()
    devices = range(len(left))
    # each token's best device, and whether it is clear: the runner-up (the best value
    # again on a tie) below the tie cut (-inf, inf and NaN are never clear)
    if freq.size and len(left) > 1:
        top = adjusted_array.argmax(axis=1)
        best = adjusted_array.max(axis=1)
        runner_up = np.partition(adjusted_array, -2, axis=1)[:, -2]
        cut = best - _TIE_EPS * np.maximum(np.abs(best), 1e-300)
        clear = (runner_up < cut).tolist()
    else:
        top, clear = np.zeros(freq.size, dtype=np.int64), [False] * freq.size
    out = []
    for f, values, d, alone in zip(freq.tolist(), adjusted, top.tolist(), clear, strict=True):
        if not (alone and f <= left[d] + tol):
            fits = [d for d in devices if f <= left[d] + tol]
            if fits:
                best = max(values[d] for d in fits)
                cut = best - _TIE_EPS * max(abs(best), 1e-300)
                # the first device of the highest preference among the ties (argmax's order)
                d = max(
                    (d for d in fits if values[d] >= cut), key=lambda d: (left[d] - demand[d], -d)
                )
            else:
                d = _emptiest(np.asarray(left), np.asarray(values), tol)
        out.append(d)
        left[d] -= f
    room[:] = left
    return np.asarray(out, dtype=np.int64)


def _room_rank(room: np.ndarray) -> np.ndarray:
    """[E] in [0, 1): rank of each device's room (more room, higher), for tie-breaking."""
    order = np.argsort(np.argsort(room, kind="stable"), kind="stable")
    return order / max(room.size, 1)


def _place_overflow(
    tokens: np.ndarray,
    gain: np.ndarray,
    freq: np.ndarray,
    room: np.ndarray,
    out: np.ndarray,
    tol: float,
) -> None:
    """Tokens that fit nowhere: heaviest first, each to :func:`_emptiest`."""
    for j in tokens[np.argsort(-freq[tokens], kind="stable")]:
        d = _emptiest(room, gain[j], tol)
        out[j] = d
        room[d] -= freq[j]


def _emptiest(room: np.ndarray, values: np.ndarray, tol: float) -> int:
    """Where a token that fits nowhere goes: a device with the most room (within ``tol``),
    of those the one with the highest ``values`` (its gain there; the first on a tie). The
    first by index alone would make the result depend on the devices' labels: at the start
    all are level, and a Zipf head heavier than any device's capacity went to device 0, 1,
    ... whatever their experts."""
    level = np.flatnonzero(room >= room.max() - tol)
    return int(level[values[level].argmax()])


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

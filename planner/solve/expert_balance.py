"""An optional cap on each device's expert load: searched within, or applied after a solver.

The solvers balance the *tokens* each device receives (β, :mod:`planner.solve.problem`),
which is the attention side's work. The MoE side's work on a device is the routed
activations its experts process, from every token wherever it sits: the *expert load*,
``sum_{k on d} sum_j W[j, k]``. Grouping experts that the same tokens use keeps activations
local, and where those experts are also the hot ones it loads their device: on synthetic
DeepSeek-V3-shaped traces CEO's plans reach an expert-load imbalance (max device / mean) of
2.0 at EP 8 (``benchmarks/RESULTS.md``). Hot experts that are co-activated are a real
pattern, and a device doing twice the mean expert work is the MoE layer's straggler.

:func:`cap_expert_load` bounds it: while some device's expert load is above ``expert_beta``
times the mean, it swaps one of that device's experts for a lighter one elsewhere, choosing
among the swaps that bring the device's load down without taking the other device above
the cap the one that loses the fewest local activations per unit of load moved (tokens held
where they are, so each swap's cost is exact: ``M[d', p] - M[d, p] + M[d, q] - M[d', q]``
with ``M`` = :func:`planner.solve.common.expert_scores`). Where no swap can bring the most
loaded device under the cap (one expert per device, or one expert hotter than the cap by
itself), it stops at the lowest maximum it reached and says so in the report. Then a polish
wins back locality: the tokens are assigned again to the new placement (the shared
assignment), and best-improvement swaps that keep every device under the cap (or that
lowest maximum) follow, twice. Expert loads do not depend on where tokens go, so the cap
holds whatever the assignment does.

Only token rows count towards the load (``token_freq > 0``; the n-gram term's load-free
context rows stand for the same occurrences again), but the swaps' costs count every row
of the problem, so with the n-gram term (:mod:`planner.solve.ngram_term`) they weigh the
layer's n-gram table too, as the solvers did (pricing them on the token rows alone is level
with this on the real held-out traces, ``benchmarks/RESULTS.md``).
``SolverConfig.expert_beta`` (``PlanConfig.expert_beta``, ``--expert-beta``) applies it to
every method but vanilla, as the token balance is, so the comparison stays fair:
:func:`planner.solve.registry.solve_layer` caps each layer's result as it is solved, so the
layers after it take their n-gram contexts from the capped placement. Searching under the
cap does better than capping afterwards, and the searches that can do so keep to an
:class:`ExpertLimit`:

- CEO (:mod:`planner.solve.ceo`, improved variant, its ``expert_cap`` option) brings every
  sampled placement under it (:meth:`ExpertLimit.repair`, the peak-lowering swaps above)
  before scoring it, and its final polish (:func:`planner.solve.polish.polish`) only makes
  moves within it, so its score (n-gram term and per-batch cap included) chooses among
  capped placements; the post-step then finds nothing to do. On the hot-cluster instances
  of ``tests/solve/test_expert_balance.py`` it keeps more locality than CEO's free plan
  capped afterwards in 8 of 9 cases and as much in the ninth; with ``--expert-beta 1.25``
  on the 36 held-out cases of ``benchmarks/compare_traces.py`` it wins all 36 against the
  baselines under the same cap (mean 1.033), where capping its free plan after, as the
  first version of this module did, won 32 (mean 1.027);
- the chain polish (:mod:`planner.solve.chain`) only swaps within it.

The other solvers' searches do not see it and are capped afterwards. MoE-GPS's other
remedy, duplicating hot experts, changes the deployment's shape and is not done here.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import numpy as np

from planner.solve.common import (
    assign_for_problem,
    device_gains,
    expert_scores,
    finish,
    token_imbalance,
)
from planner.solve.problem import LayerPlacement, LayerProblem, check_expert_beta

# Relative tolerance on the cap (float sums of activations).
_RTOL = 1e-9
# Rounds of the polish under the cap (expert swaps, then the tokens assigned again).
_POLISH_ROUNDS = 2


def expert_loads(problem: LayerProblem) -> np.ndarray:
    """[N] float64 routed activations of each expert by the problem's token rows."""
    w = problem.affinity
    loaded = problem.token_freq > 0
    if loaded.all():
        return problem.expert_load
    return np.asarray(w[loaded].sum(axis=0)).ravel()


def device_expert_loads(problem: LayerProblem, expert_to_device: np.ndarray) -> np.ndarray:
    """[E] float64 expert load of each device under ``expert_to_device``."""
    return np.bincount(expert_to_device, weights=expert_loads(problem), minlength=problem.ep_size)


def expert_imbalance(problem: LayerProblem, expert_to_device: np.ndarray) -> float:
    """max device expert load / mean (1.0 when no expert is used)."""
    return token_imbalance(expert_loads(problem), expert_to_device, problem.ep_size)


@dataclass(frozen=True)
class ExpertLimit:
    """A bound on every device's expert load, for a search that must keep to the cap.

    ``loads`` [N] are the experts' loads (:func:`expert_loads` of the whole problem, also
    when the search scores a subset of its tokens) and ``bound`` the most any device may
    carry: the cap, or where no placement can reach it the least peak any could have (the
    hottest expert with the N/E - 1 coolest beside it). :meth:`for_placement` raises the
    bound to a placement's own peak where that is higher, so a search from a placement
    above the bound never raises its peak.
    """

    loads: np.ndarray
    bound: float

    @classmethod
    def of(cls, problem: LayerProblem, expert_beta: float | None) -> ExpertLimit | None:
        """The cap ``expert_beta`` x the mean device load (None: no cap)."""
        if expert_beta is None:
            return None
        check_expert_beta(expert_beta)
        f = expert_loads(problem)
        least = np.sort(f)
        floor = float(least[-1] + least[: problem.experts_per_device - 1].sum())
        return cls(f, max(expert_beta * float(f.sum()) / problem.ep_size, floor))

    def device_loads(self, x: np.ndarray) -> np.ndarray:
        return np.bincount(x, weights=self.loads, minlength=int(x.max()) + 1)

    def for_placement(self, x: np.ndarray) -> ExpertLimit:
        """This limit, or ``x``'s peak where it is higher."""
        return dataclasses.replace(self, bound=max(self.bound, float(self.device_loads(x).max())))

    def allows(self, x: np.ndarray) -> bool:
        return bool(self.device_loads(x).max() <= self.bound * (1 + _RTOL))

    def swaps_fit(self, x: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """[...] bool: swapping experts ``a`` and ``b`` (arrays, broadcast) keeps both
        devices within the bound."""
        dev = self.device_loads(x)
        shift = self.loads[a] - self.loads[b]  # load leaving a's device, reaching b's
        top = self.bound * (1 + _RTOL)
        return (dev[x[a]] - shift <= top) & (dev[x[b]] + shift <= top)

    def repair(self, problem: LayerProblem, x: np.ndarray, t: np.ndarray) -> np.ndarray:
        """``x`` brought under the bound by the swaps of :func:`cap_expert_load` (tokens
        ``t`` held to price them), or to the lowest peak they reach; ``x`` if it fits."""
        if self.allows(x):
            return x
        dev = self.device_loads(x)
        m = expert_scores(problem, t)
        return _lower_the_peak(m, self.loads, x, dev, self.bound, 4 * x.size)[0]


def cap_unreached(reports: list[dict]) -> list[float]:
    """The expert-load imbalance of each layer of a plan's ``reports`` whose expert-load cap
    was out of reach (:func:`cap_expert_load`'s ``reached``); empty without a cap."""
    return [
        r["expert_imbalance"]
        for r in reports
        if not r["info"].get("expert_balance", {}).get("reached", True)
    ]


def cap_expert_load(
    problem: LayerProblem,
    placement: LayerPlacement,
    expert_beta: float,
    max_swaps: int | None = None,
    polish: bool = True,
) -> LayerPlacement:
    """``placement`` with every device's expert load at most ``expert_beta`` times the mean
    where swaps can reach it (module doc); unchanged when it already is.

    ``polish`` (default on) then wins back locality with swaps that stay under the cap.
    ``max_swaps`` bounds the swaps that lower the peak (default 4 N).

    The report's ``info["expert_balance"]`` says the imbalance before and after, the swaps
    that lowered the peak and the local activations they cost on the problem's W (tokens
    held), what the polish won back, and whether the cap was reached.
    """
    check_expert_beta(expert_beta)
    started = time.perf_counter()
    f = expert_loads(problem)
    e, n = problem.ep_size, problem.num_experts
    x = placement.expert_to_device.copy()
    loads = np.bincount(x, weights=f, minlength=e)
    mean = loads.sum() / e
    before = float(loads.max() / mean) if mean > 0 else 1.0
    cap = expert_beta * float(mean)  # a Python float: 1e308 x the mean is inf, no warning
    if mean <= 0 or loads.max() <= cap * (1 + _RTOL):
        return placement
    m = expert_scores(problem, placement.token_to_device)  # [E, N], fixed while tokens are
    x, swaps, cost = _lower_the_peak(m, f, x, loads, cap, max_swaps or 4 * n)
    peak = float(np.bincount(x, weights=f, minlength=e).max())
    # the cap, or the lowest peak reached where it cannot be
    limit = ExpertLimit(f, max(cap, peak))
    # Win back locality under the cap, the tokens assigned again between rounds.
    gained, settled = 0.0, None  # settled: the tokens' assignment to x, once x stops moving
    for _ in range(_POLISH_ROUNDS if polish else 0):
        t = assign_for_problem(problem, device_gains(problem, x)).token_to_device
        x, won = _polish_under(expert_scores(problem, t), limit, x, 2 * n)
        gained += won
        if won <= 0:
            settled = t  # x is what t was assigned to: finish need not assign again
            break
    after = float(np.bincount(x, weights=f, minlength=e).max()) / mean
    info = dict(placement.info)
    info["expert_balance"] = {
        "expert_beta": float(expert_beta),
        "imbalance_before": round(before, 4),
        "imbalance_after": round(float(after), 4),
        "swaps": swaps,
        "local_cost": round(cost, 3),
        "polish_gain": round(gained, 3),
        "reached": bool(after <= expert_beta * (1 + 1e-6)),
    }
    capped = finish(
        problem, placement.method, x, seed=placement.seed, started=started,
        token_to_device=settled, info=info,
    )  # fmt: skip
    return dataclasses.replace(capped, seconds=placement.seconds + capped.seconds)


def _lower_the_peak(
    m: np.ndarray, f: np.ndarray, x: np.ndarray, loads: np.ndarray, cap: float, limit: int
) -> tuple[np.ndarray, int, float]:
    """Swap experts off the most loaded device until every device is under ``cap`` or no
    swap lowers the peak (module doc). Returns (placement with the lowest peak, swaps made
    to reach it, local activations they cost with the tokens held)."""
    x, loads = x.copy(), loads.copy()
    swaps, cost = 0, 0.0
    best = (x.copy(), 0, 0.0)
    peak = float(loads.max())
    while loads.max() > cap * (1 + _RTOL) and swaps < limit:
        d = int(loads.argmax())
        mine = np.flatnonzero(x == d)  # p: experts leaving d
        others = np.flatnonzero(x != d)  # q: experts coming to d
        dq = x[others]
        moved = f[mine][:, None] - f[others][None, :]  # load leaving d, [P, N - P]
        new_other = loads[dq][None, :] + moved
        # the swap must lower d and keep the other device below d's present load
        ok = (moved > 0) & (new_other < loads[d] * (1 - _RTOL))
        if not ok.any():
            break
        # local activations gained by the swap (negative: lost), tokens where they are
        delta = m[dq][:, mine].T - m[d, mine][:, None] + m[d, others][None, :] - m[dq, others]
        under = ok & (new_other <= cap * (1 + _RTOL))
        if under.any():  # the fewest activations lost per unit of the reduction still needed
            need = np.minimum(moved, loads[d] - cap).clip(min=1e-300)
            score = np.where(under, -delta / need, np.inf)
        else:  # none keeps the other device under the cap: the most even pair of loads
            score = np.where(ok, np.maximum(loads[d] - moved, new_other), np.inf)
        i, j = np.unravel_index(int(np.argmin(score)), score.shape)
        p, q = int(mine[i]), int(others[j])
        x[p], x[q] = x[q], d
        loads[d] -= moved[i, j]
        loads[x[p]] += moved[i, j]
        cost -= float(delta[i, j])
        swaps += 1
        if loads.max() < peak * (1 - _RTOL):
            peak = float(loads.max())
            best = (x.copy(), int(swaps), cost)
    return best


def _polish_under(m: np.ndarray, limit: ExpertLimit, x: np.ndarray, moves: int):
    """Best-improvement expert swaps with the tokens held (gain ``M[x_q, p] - M[x_p, p] +
    M[x_p, q] - M[x_q, q]``) that keep every device within ``limit``.
    Returns (placement, local activations gained)."""
    x = x.copy()
    n = x.size
    tol = 1e-9 * max(float(m.sum()), 1e-300)
    gained = 0.0
    cols = np.arange(n)
    for _ in range(moves):
        a = m[x]  # a[q, p] = M[x_q, p]
        own = a[cols, cols]  # M[x_p, p]
        delta = a.T - own[:, None] + a - own[None, :]
        fits = limit.swaps_fit(x, cols[:, None], cols[None, :])
        delta = np.where(fits & (x[:, None] != x[None, :]), delta, -np.inf)
        p, q = np.unravel_index(int(np.argmax(delta)), delta.shape)
        if delta[p, q] <= tol:
            break
        gained += float(delta[p, q])
        x[p], x[q] = x[q], x[p]
    return x, gained

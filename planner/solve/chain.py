"""The chain polish: revisit each layer with the layers before and after it placed.

With the n-gram term (:mod:`planner.solve.ngram_term`) layers are solved in order, and
layer l's problem scores what its placement is worth to its own n-gram table (context rows
from layers l-n .. l-1). Layer l's placement is also the context of layers l+1 .. l+n:
how it splits experts decides which fitting tokens share an n-gram context there, and so
how well those tables predict. When layer l is solved, the later layers are not placed yet,
so no per-layer objective can see that (the "chain effect" of the module doc of
:mod:`planner.solve.ngram_term`).

Once every layer of a run is placed, this polish goes over the run's layers in order (up to
``passes`` times) and, with every other layer fixed, improves layer l's expert placement
for the *chain objective*, the sum over the run's layers of

    token rows' local activations + factor_m x n-gram table's local activations (fitting data)

which is what each extended problem scores, with the factors of
:meth:`planner.solve.ngram_term.NgramTerm.layer_weight`. The terms that layer l's placement
touches:

- layer l's token rows. With the tokens' devices held fixed, swapping expert a (device p)
  with b (device q) changes them by ``S[p, b] - S[p, a] + S[q, a] - S[q, b]``, S [E, N]
  the activations of each expert by the tokens sent to each device;
- layer l's own context rows R [C, N] (load-free; each goes to its best device):
  ``sum_c max_d (R x)[c, d]``, x the one-hot placement;
- for each later layer m = l + i (i = 1..n, in the run): its contexts hold layer l's device
  at one position. With the other positions and layer m's placement fixed, the counts
  ``K[o, e, d]`` (fitting tokens whose other context devices are o, whose top-1 expert at
  layer l is e, and whose routed expert at layer m sits on device d) give layer m's table
  ``sum_o sum_b max_d sum_{e on b} K[o, e, d]``.

Every expert swap's change of all three is computed exactly and vectorised over all swap
pairs; the best swap is applied until none gains. The layer's tokens are then re-assigned
(the shared capacity assignment, :func:`planner.solve.common.assign_for_problem`), and the
new placement is kept only if the chain objective (with the runtime cap's take-back on the
fitting batches subtracted when ``batch_aware``, as CEO scores) went up. The polish never
lowers the chain objective on the fitting data.

Off by default (``--chain-passes 0``); any method can ask for it. Measured with
``benchmarks/compare_traces.py --chain-passes 2`` (the 36 held-out cases of
:mod:`planner.solve.ngram_term`, every method polished) against the same sweep without it:

- the baselines gain on FLAME-MoE: METIS +3.2%, k-means +3.6%, alternating +4.5% balanced
  LAR on average (+0.4% to +8.6%); on the example model, where tokens carry over, they
  move by -1% to +1.4% (mean +0.1%);
- CEO does not: mean -0.2% on FLAME-MoE (-4.1% to +0.9%: the polish raises the fitting
  objective, and at EP 16 the sparse contexts' gains do not carry over), +0.1% on the
  example. CEO's own search already weighs each layer as context for the next; the
  baselines' placements do not, and that is what the polish adds;
- so with every method polished CEO's lead over the best baseline shrinks from a mean
  1.029 (34 of 36 wins) to 1.012 (26 of 36 wins, min 0.990; one loss beyond its 90%
  interval, FLAME-MoE split 2, routed, EP 8: 0.991);
- at the edges (FLAME-MoE, EP 2 and 32, split seeds 0 and 1, both statistics), every method
  polished: CEO's mean ratio 1.009 (without the polish: 1.008), one loss beyond its
  interval (split 1, top-1, EP 2: 0.991). At EP 2, whose 4 contexts are dense, the polish
  raises CEO too (+0.2% to +1.7%) and the baselines as much; at EP 32 it moves CEO by
  -2.8% to +0.7%.

Cost: k-means plus the polish on FLAME-MoE takes 0.2 s (EP 4) to 1.2 s (EP 16) for the
8 layers; on the DeepSeek-V3-shaped layers of ``benchmarks/solve_speed.py`` about 1.1 s
(EP 8) and 3.8 s (EP 32) per layer and pass in one process. Runs are independent, so
:func:`planner.solve.plan.solve_model` polishes them in its worker processes with
``jobs > 1``: 32 such layers (two runs, 30k token occurrences, EP 8, k-means, 2 passes)
took 70 s with one job and 43 s with two. ``layer_effort`` bounds the swap search of a
layer in each pass (not the token assignment), in the work units of
:mod:`planner.solve.effort` (each round of swap scoring is charged for the swap pairs
times the terms each reads): :data:`DEFAULT_LAYER_EFFORT` is about 2 s on the reference
machine, so the same inputs give the same placements on any machine and with any
``jobs``. (It was 2 s of the clock before, and then the result depended on the machine's
speed: in the 32-layer case above, 699 swaps with one job, 653 with two.)
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np
from scipy import sparse

from planner.predict.ngram import MAX_ORDER, target_tuples
from planner.solve.common import (
    assign_for_problem,
    device_gains,
    expert_scores,
    finish,
    improves,
    net_objective,
    objective,
)
from planner.solve.effort import Effort, charge, exhausted
from planner.solve.expert_balance import ExpertLimit
from planner.solve.ngram_term import NgramTerm
from planner.solve.polish import best_outside
from planner.solve.problem import LayerPlacement, LayerProblem
from planner.solve.settle import deployed_rows, experts_kept

# Entries of the [pairs, rows] blocks the swap deltas are computed in.
_BLOCK = 1 << 22
# Forward counts K larger than this (entries) are left out of a layer's polish.
_MAX_FORWARD = 1 << 24
# Work units (planner.solve.effort) of one layer's swap search per pass, about 2 s on the
# reference machine.
DEFAULT_LAYER_EFFORT = 2.0e6


def chain_polish(
    problems: Sequence[LayerProblem],
    placements: Sequence[LayerPlacement],
    term: NgramTerm,
    run: Sequence[int],
    *,
    passes: int = 2,
    batch_aware: bool = True,
    layer_effort: float | None = DEFAULT_LAYER_EFFORT,
    expert_beta: float | None = None,
    reference: np.ndarray | None = None,
    move_cost: float = 0.0,
) -> dict[int, LayerPlacement]:
    """Polish the layers of one run; returns the placements that changed, by layer.

    Args:
        problems: every layer's problem (token rows only).
        placements: every layer's placement (of those problems), all layers placed.
        term: the n-gram term the layers were solved with.
        run: consecutive layer ids (one of ``term.runs(L)``); only their placements change
            and only their terms count.
        passes: sweeps over the run at most (stops early when a sweep changes nothing).
        batch_aware: score token rows net of :func:`batch_overflow` (CEO's scoring).
        layer_effort: work units (:mod:`planner.solve.effort`) for one layer's swap search
            in each pass (None: until no swap gains). Counted, not timed, so the polish
            gives the same placements on any machine and with any ``jobs``.
        expert_beta: the expert-load cap (:mod:`planner.solve.expert_balance`): only swaps
            that keep every device within it (or within the layer's peak where that is
            higher) are made.
        reference, move_cost: re-planning a deployed model (:mod:`planner.solve.settle`):
            with ``move_cost`` > 0 each layer's terms include the deployed groups of
            ``reference`` [L, N] as load-free rows worth ``move_cost`` times the layer's
            routed activations for each expert kept with its group, as the layers were
            solved; a swap that moves experts must pay for the moves.
    """
    x_all = np.stack([p.expert_to_device for p in placements]).astype(np.int64)
    t_all = {layer: placements[layer].token_to_device for layer in run}
    changed: dict[int, LayerPlacement] = {}
    for _ in range(passes):
        moved = False
        for layer in run:
            started = time.perf_counter()
            deployed = None
            if reference is not None and move_cost > 0:
                bonus = move_cost * problems[layer].total_activations
                deployed = deployed_rows(reference[layer], problems[layer].ep_size, bonus)
            parts = LayerTerms(problems, term, x_all, layer, run, batch_aware, deployed)
            x_old, t_old = x_all[layer], t_all[layer]
            meter = Effort(stop=layer_effort)
            limit = ExpertLimit.of(parts.problem, expert_beta)
            limit = None if limit is None else limit.for_placement(x_old)
            x_new, swaps = parts.swap_search(x_old, t_old, meter, limit)
            if swaps == 0:
                continue
            problem = problems[layer]
            t_new = assign_for_problem(problem, device_gains(problem, x_new)).token_to_device
            token_new, token_kept = parts.token_score(x_new, t_new), parts.token_score(x_new, t_old)
            if token_kept > token_new:
                t_new, token_new = t_old, token_kept
            before = parts.total(x_old, t_old)
            after = token_new + parts.context_value(x_new) + parts.forward_value(x_new)
            if not improves(after, before):
                continue
            moved = True
            x_all[layer], t_all[layer] = x_new, t_new
            old = changed.get(layer, placements[layer])
            info = dict(old.info)
            prior = info.get("chain_polish", {"swaps": 0, "gain": 0.0})
            info["chain_polish"] = {
                "swaps": prior["swaps"] + swaps,
                "gain": prior["gain"] + (after - before),
            }
            if parts.ngram_rows and "ngram_term" in info:
                info["ngram_term"] = dict(
                    info["ngram_term"], local_rate=parts.ngram_value(x_new) / parts.rows_total
                )
            if deployed is not None:
                assert reference is not None  # deployed rows come from it
                info["deployed_rows"] = {"experts_kept": experts_kept(reference[layer], x_new)}
            changed[layer] = finish(  # seconds: the solver's and the polish's
                problem, old.method, x_new, seed=old.seed, started=started - old.seconds,
                token_to_device=t_new, info=info,
            )  # fmt: skip
        if not moved:
            break
    return changed


class LayerTerms:
    """The chain objective's terms that layer ``layer``'s expert placement touches.

    Attributes:
        rows: [C, N] the layer's own n-gram context rows times its factor, then (with
            ``deployed``) the deployed groups' E rows of :func:`planner.solve.settle.
            deployed_rows`; None when there are none (the context reaches before the run).
        ngram_rows: C, how many of ``rows`` are n-gram context rows.
        forward: per later layer m of the run whose context holds this layer, the weighted
            counts K [O, N, E] of the module doc (O: the other positions' seen contexts).
    """

    def __init__(
        self,
        problems: Sequence[LayerProblem],
        term: NgramTerm,
        x_all: np.ndarray,
        layer: int,
        run: Sequence[int],
        batch_aware: bool,
        deployed: sparse.csr_matrix | None = None,
    ):
        self.problem = problem = problems[layer]
        self.batch_aware = batch_aware
        e, n, order = problem.ep_size, problem.num_experts, term.order
        self.e = e
        # layer l's own context rows (placed layers l-n .. l-1 of the run)
        rows = term.context_rows(problem, layer, x_all, run[0])
        context = None if rows is None else rows.toarray()
        self.ngram_rows = 0 if context is None else context.shape[0]
        self.rows_total = 0.0 if context is None else float(context.sum())
        # the deployed groups are load-free rows too: each goes to its best device
        self.rows: np.ndarray | None = context
        if deployed is not None:
            groups = deployed.toarray()
            self.rows = groups if context is None else np.vstack([context, groups])
        # later layers m = l + i whose contexts hold layer l at position i
        self.forward: list[np.ndarray] = []
        last = run[-1]
        for i in range(1, order + 1):
            m = layer + i
            if m > last or m - order < run[0]:
                continue
            tuples, counts = target_tuples(term.transitions, m, term.target)
            if tuples.shape[0] == 0 or counts.sum() <= 0:
                continue
            factor = term.layer_weight(
                m, problems[m].total_activations, float(counts.sum(dtype=np.float64))
            )
            other = np.zeros(tuples.shape[0], np.int64)
            for j in range(order, 0, -1):  # oldest first, as the table's rows
                if j != i:
                    other = other * e + x_all[m - j][tuples[:, MAX_ORDER - j].astype(np.int64)]
            seen, other = np.unique(other, return_inverse=True)
            if seen.size * n * e > _MAX_FORWARD:
                continue
            expert = tuples[:, MAX_ORDER - i].astype(np.int64)
            device = x_all[m][tuples[:, MAX_ORDER].astype(np.int64)]
            k = np.bincount(
                (other * n + expert) * e + device,
                weights=counts.astype(np.float64) * factor,
                minlength=seen.size * n * e,
            )
            self.forward.append(k.reshape(seen.size, n, e))
        # what scoring one swap reads: its token part, its change on each context row and
        # on each (other context, device) group of each later layer (charged per swap)
        self.width = 1 + (0 if self.rows is None else self.rows.shape[0])
        self.width += sum(k.shape[0] * e for k in self.forward)

    # values ------------------------------------------------------------------------------

    def token_score(self, x: np.ndarray, t: np.ndarray) -> float:
        gain = device_gains(self.problem, x)
        if self.batch_aware:
            return net_objective(self.problem, gain, t)
        return objective(self.problem, gain, t)

    def context_value(self, x: np.ndarray) -> float:
        if self.rows is None:
            return 0.0
        return float(self._grouped_rows(x).max(axis=1).sum())

    def ngram_value(self, x: np.ndarray) -> float:
        """The n-gram context rows' part of :meth:`context_value`."""
        if not self.ngram_rows:
            return 0.0
        return float(self._grouped_rows(x)[: self.ngram_rows].max(axis=1).sum())

    def forward_value(self, x: np.ndarray) -> float:
        return float(sum(self._grouped_forward(k, x).max(axis=2).sum() for k in self.forward))

    def total(self, x: np.ndarray, t: np.ndarray) -> float:
        return self.token_score(x, t) + self.context_value(x) + self.forward_value(x)

    def _grouped_rows(self, x: np.ndarray) -> np.ndarray:
        assert self.rows is not None  # only asked for when the layer has context rows
        return self.rows @ np.eye(self.e)[x]  # [C, E]

    def _grouped_forward(self, k: np.ndarray, x: np.ndarray) -> np.ndarray:
        return np.einsum("oed,eb->obd", k, np.eye(self.e)[x], optimize=True)

    # search ------------------------------------------------------------------------------

    def swap_search(
        self,
        x: np.ndarray,
        t: np.ndarray,
        effort: Effort | None = None,
        limit: ExpertLimit | None = None,
    ) -> tuple[np.ndarray, int]:
        """Best-improvement expert swaps with the tokens fixed; (placement, swaps made).

        Each round's scoring of every swap is charged to ``effort``; the search stops once
        it is exhausted (after the round that exhausted it). With ``limit`` only swaps
        within the expert-load bound are made.
        """
        x = x.copy()
        if self.e < 2:
            return x, 0
        s = expert_scores(self.problem, t)  # [E, N], fixed with the tokens
        swaps = 0
        scale = max(float(np.abs(s).sum()), 1.0) * 1e-12
        for _ in range(x.size):
            if exhausted(effort):
                break
            a, b, delta = self.swap_deltas(x, t, scores=s)
            charge(effort, "chain_swaps", entries=a.size * self.width)
            if limit is not None:
                delta = np.where(limit.swaps_fit(x, a, b), delta, -np.inf)
            if not a.size:
                break
            best = int(np.argmax(delta))
            if not delta[best] > scale:
                break
            x[a[best]], x[b[best]] = x[b[best]], x[a[best]]
            swaps += 1
        return x, swaps

    def swap_deltas(
        self, x: np.ndarray, t: np.ndarray, scores: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Every swap of two experts on different devices: (a, b, change of :meth:`total`).

        The change is exact for fixed tokens ``t`` without the batch take-back.
        """
        s = expert_scores(self.problem, t) if scores is None else scores
        a, b = np.triu_indices(x.size, 1)
        keep = x[a] != x[b]
        a, b = a[keep], b[keep]
        p, q = x[a], x[b]
        delta = s[p, b] - s[p, a] + s[q, a] - s[q, b]
        if self.rows is not None:
            delta += self._rows_delta(x, a, b, p, q)
        for k in self.forward:
            delta += self._forward_delta(k, x, a, b, p, q)
        return a, b, delta

    def _rows_delta(self, x, a, b, p, q) -> np.ndarray:
        rows = self.rows
        assert rows is not None  # only called when the layer has context rows
        g = self._grouped_rows(x)  # [C, E]
        current = g.max(axis=1)
        depth = min(3, self.e)
        top = np.argsort(-g, axis=1, kind="stable")[:, :depth]
        values = np.take_along_axis(g, top, axis=1)
        out = np.empty(a.size)
        step = max(1, _BLOCK // g.shape[0])
        for lo in range(0, a.size, step):
            sl = slice(lo, lo + step)
            diff = rows[:, b[sl]] - rows[:, a[sl]]  # [C, P]
            on_p = g[:, p[sl]] + diff
            on_q = g[:, q[sl]] - diff
            new = np.maximum(np.maximum(on_p, on_q), best_outside(top, values, p[sl], q[sl]))
            out[sl] = (new - current[:, None]).sum(axis=0)
        return out

    def _forward_delta(self, k, x, a, b, p, q) -> np.ndarray:
        g = self._grouped_forward(k, x)  # [O, E(context device), E(target device)]
        best = g.max(axis=2)  # [O, E]
        out = np.empty(a.size)
        step = max(1, _BLOCK // (k.shape[0] * self.e))
        for lo in range(0, a.size, step):
            sl = slice(lo, lo + step)
            diff = k[:, b[sl], :] - k[:, a[sl], :]  # [O, P, E]
            on_p = (g[:, p[sl], :] + diff).max(axis=2)
            on_q = (g[:, q[sl], :] - diff).max(axis=2)
            out[sl] = (on_p + on_q - best[:, p[sl]] - best[:, q[sl]]).sum(axis=0)
        return out

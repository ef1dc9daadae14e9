"""The n-gram term: solve layers in order so that each placement also serves the n-gram table.

At serving time Algorithm 2 (paper 000 §4) reads two tables per layer: the token table (a
token's device, what every solver optimises) and the n-gram table (the device predicted
from the devices of the token's top-1 experts at layers l-n .. l-1). Where tokens are rare,
the n-gram table makes most of the choices. FLAME-MoE's held-out tokens are mostly unseen
in fitting: at EP 16 the token table gets 1/16 of activations local and the n-gram table
decides. How well the n-gram table predicts depends on how layer l's experts are split
relative to the placements of layers l-n .. l-1. A solver that sees only layer l's token
rows never sees that.

The term: once layers l-n .. l-1 are placed, layer l's problem gets one extra *load-free*
row per n-gram context c (a_c = 0, see :mod:`planner.solve.problem`). Row c holds the
activations of layer l's experts by the fitting tokens in context c
(:func:`planner.predict.ngram.ngram_context_affinity`), times the layer's factor (below).
For a routed statistic each fitting token's k activations count once in the context rows as
in the token rows, so at factor 1 both weigh the same (a top-1 statistic counts the top-1
activation only, 1/k of the weight). A load-free row goes to the device where most of its
activations are local, which is exactly the n-gram table's prediction for c. So the
extended problem's objective is the token table's local activations plus the factor times
the n-gram table's, both on the fitting data. Every solver gets the same extended problem.
:func:`restrict` drops the rows from the answer and reports on the token rows.

Solving in order takes away the parallelism over layers. The layers are therefore split into
fixed runs of at most :data:`RUN_LAYERS` consecutive layers. Runs are solved in parallel
with each other, and the layers of a run in order. The first n layers of every run but the
first have no placed predecessors, so they are solved without the term. Runs depend on the
layer count only, not on ``--jobs``, so neither does the plan.

How much the n-gram table is worth against the token table depends on whether a token's
fitted routing carries over to new requests. The predictor's token shrinkage m says so per
layer (:mod:`planner.predict.reliability`), and u, the share of token occurrences it
discounts (:func:`planner.predict.reliability.discounted_share`), sets each layer's factor
(:meth:`NgramTerm.layer_weight`): ``weight`` where tokens are reliable (u near 0: the
example model, u = 0.03-0.09, factor 0.52-0.63), twice that where they are not (u near 1:
FLAME-MoE, u = 0.97-1.0, factor about 1 for the routed statistic), and a further sqrt(k)
for the top-1 statistic, whose rows hold 1/k of the activations (factor about 2.4 on
FLAME-MoE, k = 6).

Measured by ``benchmarks/compare_traces.py`` (36 held-out cases: FLAME-MoE and the example
model, 3 split seeds, 3 EP sizes, 2 n-gram statistics; CEO's balanced LAR over the best
baseline's; every method solves the same extended problems):

- weight 0 (layers independent): CEO wins 23 cases, mean ratio 1.014, min 0.955;
- weight 0.5 everywhere: wins 24, mean 1.012, min 0.973 (later, with n-gram backoff and
  calibrated token confidences: wins 32, mean 1.021, min 0.992);
- weight 1 everywhere: wins 18, mean 1.013, min 0.969. FLAME alone does best here (17 of 18
  cases, mean 1.040). On the example CEO loses 17 of 18 by up to 3%: there every method
  concentrates tokens harder, and the runtime cap on the example's single-domain batches
  takes more of it back from CEO than from the others;
- the per-layer factor above (the default): wins **34**, mean **1.029**, min 0.996; all 18
  FLAME cases won (1.019-1.081), the two losses (example, top-1, 0.996 and 0.997) inside
  their 90% intervals. At the edges (``--ep 2,32 --sources flame --seeds 0,1``) the mean
  ratio went from 0.996 (weight 0.5: two losses beyond the interval, EP 32 top-1 0.961 and
  EP 2 routed 0.991) to 1.008 (four losses of at most 1%, none beyond it). For the top-1
  statistic at the edges, FLAME-MoE factor 1 / 2.4 (the default) / 6 (the top-1
  activation counted for all k): EP 2 1.004 and 1.002 / 0.994 and 0.996 / 0.992 and 0.991;
  EP 32 0.998 and 0.976 / 1.041 and 0.990 / 1.059 and 1.001 (split seeds 0 and 1). On
  split seeds 3 and 4, not used to choose the factor (24 cases): wins 23, mean 1.026, min
  0.994 (FLAME-MoE EP 4 top-1, inside its interval).

The runtime cap on the n-gram table's choices. The context rows put no load on the
capacity, yet at run time the tokens of a context go where the table says, and each
batch's cap takes back what crowds a device. On FLAME-MoE (u near 1) the table makes
nearly every choice, so a token table balanced over the fitting data says little about the
runtime's load, and at EP 2 CEO's plans lost about 0.5% of the fitting data's LAR to the
cap against 0.1% for the alternating baseline's. :meth:`NgramTerm.extend` therefore gives
the rows their occurrences and, where u >= :data:`BATCH_SHARE_FROM`, u of the fitting
batches (the token rows keep 1 - u), so that CEO's batch-aware score charges for it. On the
36 cases FLAME-MoE's mean ratio went from 1.046 to 1.052 (18 of 18 wins, min 1.016); at the
edges the mean went from 1.005 to 1.009, losses from 5 to 3 (CEO behind on the fitting
half in 3 of 8 instead of 6). Given to every layer (the example's u = 0.03-0.09 too) it
cost the example 0.25% on average and two more losses (EP 8, routed: 0.994 and 0.996), as
the contexts' batch mix is only estimated (in proportion to the batches' sizes) while the
token rows' is recorded; below 1/2 the example's plans are as before.

Tokens the token table cannot place. A token never seen in fitting takes a known
neighbour's device (its nearest token by input embedding,
:func:`planner.solve.pipeline.vocabulary_table`); without embeddings it has none, and the
n-gram table routes all of its occurrences whatever u says. On a synthetic
DeepSeek-V3-shaped trace (``benchmarks/compare_traces.py --sources synth-deepseek``: no
embeddings, u about 0.3) a fifth of the held-out occurrences are such tokens, and with
u < 1/2 the context rows had no share of the batches: CEO's score never saw the load the
n-gram table sends them. At EP 8 (split seed 0, top-1) the runtime cap moved 81% of those
tokens off their device under CEO's plan against 72% under METIS', and their balanced LAR
(0.105 against 0.122) ate most of CEO's lead on the seen tokens (0.329 against 0.323).
Twice CEO's search did not help (0.2830 against 0.2832). So the batch share is at least
the :attr:`NgramTerm.unplaced` share (:func:`planner.solve.pipeline.unplaced_share`: the
Good-Turing estimate of unseen occurrences, N1/N, 0.201 there against 0.204 measured on
the held-out half, times the share of the unseen vocabulary with no neighbour), where that
is at least :data:`UNPLACED_FROM`. On the 12 DeepSeek-shaped cases (split seeds 0-2, EP 8
and 32, both statistics) CEO's ratio to the best baseline went from mean 1.043 (worst
1.006) to 1.048 (worst 1.018), 11 up, one down (1.080 -> 1.078), and on split seeds 3-4,
measured after the change, from 1.040 to 1.046 (7 of 8 up, one level); held out by domain
(16 cases, where new tokens are more common) from 0.999 to 1.008, losses 8 -> 3; on the synthetic
Mixtral, GPT-OSS and Qwen3 shapes (unplaced 0.19-0.20) from mean 1.0157 to 1.0160 (Qwen3
EP 16 1.044 -> 1.037, the rest level or up). The baselines' figures do not move: only CEO
(and the chain polish) reads the batches. Given to the example fitted without embeddings
(unplaced 0.037, 18 cases) it cost 0.1% of the mean ratio (1.0158 -> 1.0146) and one loss
inside its interval (0.998): a small share's batch mix is only estimated, as for u above,
hence the threshold. Near it (DeepSeek-shaped traces with fewer singletons, 4 cases each) the
share gained CEO 0.65% at 0.13, 0.47% at 0.10 and 0.18% at 0.07 on average, mixed case by
case at 0.07 (benchmarks/RESULTS.md).
With embeddings (the example: unplaced 0) and on FLAME-MoE (u >= 0.99 above its unplaced
0.34) plans are as before.

CEO gains the most from the term because its global search uses the combined objective. A
local polish of an independently solved placement under the extended objective helped the
baselines more than CEO.

Tried and not kept (measured with n-gram backoff and calibrated token confidences, at
weight 0.5 everywhere):

- *the weight scaled up by k for the top-1 statistic on both sources* (3 on FLAME-MoE, 2
  on the example): on the example CEO fell behind k-means in all 9 cases (0.971-0.998);
- *forward rows*, scoring layer l's placement also as layer l+1's context
  (one load-free row per expert of layer l+1, its activations counted against the tokens'
  top-1 expert at layer l; weighted by u). On the 36-case sweep CEO's mean balanced LAR on
  FLAME stayed at 0.3059 (EP 16 +1-3% but one case -6%, EP 4 -0.5%), and at EP 32 it did
  not close the gap to k-means (top-1 statistic 0.971 and 0.963 of it). Forward rows at
  weight 1 on only the first n layers of each run (the ones without context rows),
  FLAME-MoE split seed 1, routed, EP 2: CEO 0.6515 -> 0.6572, but k-means, given the same
  rows, 0.6576 -> 0.6619;
- *token rows scaled by the token shrinkage a / (a + m)*: every method lost 2-18% on
  FLAME-MoE.

Tried later (default per-layer factor), not kept: *context rows smoothed as the runtime's
table sees them*: each seen row replaced by its count times the interpolated backoff
distribution over experts (:data:`planner.predict.ngram.BACKOFF_COUNTS` pseudo-counts,
order n backing off to n-1 down to the layer's expert shares), so that a row's best device
and value are exactly the backed-off table's prediction and expected hits. The idea: sparse
contexts (FLAME-MoE at EP 16, 256 contexts for about 1000 fitting tokens) would stop
rewarding placements that fit single tokens' noise. On the 36-case sweep CEO's held-out
balanced LAR moved -0.4% on FLAME-MoE on average (-3.1% to +1.2%) and +0.1% on the
example; k-means +0.4%, METIS -3.0%, alternating -0.1% on FLAME-MoE. CEO's mean ratio to
the best baseline went from 1.029 to 1.027 (35 of 36 wins, min 0.996): no gain, and the
rows become dense.

What remains at the edges is a chain effect. At weight 0.5, each layer's extended problem
solved with every method (CEO's placements of the earlier layers as context): at EP 2
(seed 1, routed) CEO's objective is the best or tied at every layer, yet k-means' own
placements of layers l-n .. l-1 make contexts that predict layer l better (n-gram LAR on
the *fitting* data 0.710 against CEO's 0.698). A per-layer objective cannot see what a
placement will be worth as context for the layers after it.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
from scipy import sparse

from planner.errors import InputError
from planner.predict.ngram import TARGETS, TopOneTransitions, ngram_context_affinity
from planner.solve.common import device_gains, finish
from planner.solve.problem import LayerPlacement, LayerProblem

# Consecutive layers solved in order; runs of this length are solved in parallel.
RUN_LAYERS = 16
# Default weight of the context rows (``--ngram-weight``); chosen on the held-out sweep of
# benchmarks/compare_traces.py (see the module doc).
DEFAULT_WEIGHT = 0.5
# Largest weight accepted: beyond it the token rows no longer count against the context
# rows, and near 1e308 the weighted rows overflow float64.
MAX_WEIGHT = 1e6
# Layers whose n-gram table makes at least this share u of the runtime's choices give the
# context rows u of the fitting batches (NgramTerm.extend); measured in the module doc.
BATCH_SHARE_FROM = 0.5
# ... and at least the share of occurrences the token table cannot place (NgramTerm.unplaced),
# where that share is at least this; measured in the module doc.
UNPLACED_FROM = 0.1


@dataclass(frozen=True, eq=False)
class NgramTerm:
    """The cross-layer n-gram term of :func:`planner.solve.plan.solve_model`.

    Attributes:
        transitions: the predictor's top-1 transition statistic.
        order: n of the n-gram tables the plan will hold.
        weight: base factor on the context rows' activations (``--ngram-weight``); each
            layer's factor is :meth:`layer_weight`, which is ``weight`` itself where
            tokens carry over. 1.0 weighs a context row like the token rows it stands for
            (routed statistic).
        target: the n-gram table's target (:data:`planner.predict.ngram.TARGETS`).
        unreliable: per layer, the share u of token occurrences the predictor's token
            shrinkage discounts (:func:`planner.predict.reliability.discounted_share`);
            None weighs every layer by ``weight`` alone (see :meth:`layer_weight`).
        unplaced: per layer, the share of serving occurrences expected from tokens the
            plan's token table cannot place (never seen in fitting, and no known neighbour
            to borrow a device from), which the n-gram table routes; None: none expected.
            Only :meth:`extend`'s batch shares read it.
    """

    transitions: TopOneTransitions
    order: int
    weight: float = DEFAULT_WEIGHT
    target: str = "routed"
    unreliable: tuple[float, ...] | None = None
    unplaced: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if not (0 < self.weight <= MAX_WEIGHT):
            raise InputError(
                f"n-gram weight {self.weight!r} must be a positive number, at most {MAX_WEIGHT:g}"
            )
        for name, shares in (("unreliable", self.unreliable), ("unplaced", self.unplaced)):
            if shares is not None and not all(0 <= x <= 1 for x in shares):
                raise InputError(f"{name} shares {shares!r} must lie in [0, 1]")
        if self.target not in TARGETS:
            raise InputError(f"n-gram target {self.target!r} must be one of {', '.join(TARGETS)}")

    def layer_weight(
        self, layer: int, token_activations: float, context_activations: float
    ) -> float:
        """The factor on layer ``layer``'s context rows: ``weight * (1 + u (2 sqrt(r) - 1))``.

        u is the layer's :attr:`unreliable` share and r = token rows' activations / context
        rows' activations (about 1 for the routed statistic, about k for top-1, whose
        rows count only the top-1 activation). Where the token table carries over to new
        requests (u near 0: the example model) the factor is ``weight``. Where it does not
        (u near 1: FLAME-MoE, whose held-out tokens are mostly unseen, so that the n-gram
        table makes most choices) it is ``2 weight`` for the routed statistic, and
        ``2 weight sqrt(k)`` for top-1: between counting the top-1 activation for itself
        alone and for all k (both measured worse; see the module doc).
        """
        u = self._unreliable(layer)
        if u <= 0 or context_activations <= 0 or token_activations <= 0:
            return self.weight
        ratio = token_activations / context_activations
        return self.weight * (1.0 + u * (2.0 * math.sqrt(ratio) - 1.0))

    def batch_share(self, layer: int) -> float:
        """The share of layer ``layer``'s fitting batches :meth:`extend` gives its context
        rows: the occurrences the n-gram table will route at serving time. That is u where
        the table makes most of the choices (u >= :data:`BATCH_SHARE_FROM`), and at least
        the :attr:`unplaced` share, whose tokens nothing else routes, where that is at least
        :data:`UNPLACED_FROM`; else 0."""
        u = self._unreliable(layer)
        unplaced = 0.0 if self.unplaced is None else float(self.unplaced[layer])
        return max(
            u if u >= BATCH_SHARE_FROM else 0.0, unplaced if unplaced >= UNPLACED_FROM else 0.0
        )

    def _unreliable(self, layer: int) -> float:
        """Layer ``layer``'s share u of :attr:`unreliable` (0 when none is known)."""
        return 0.0 if self.unreliable is None else float(self.unreliable[layer])

    def runs(self, num_layers: int) -> list[list[int]]:
        """Layer ids split into ceil(L / RUN_LAYERS) runs of consecutive layers, near-equal."""
        count = max(1, math.ceil(num_layers / RUN_LAYERS))
        return [run.tolist() for run in np.array_split(np.arange(num_layers), count) if run.size]

    def context_rows(
        self, problem: LayerProblem, layer: int, expert_to_device: np.ndarray, run_start: int
    ) -> sparse.csr_array | None:
        """Layer ``layer``'s seen n-gram context rows [C, N] times :meth:`layer_weight`.

        None when the layer's context reaches before ``run_start`` or no context was seen;
        ``expert_to_device`` [L, N] must hold the placements of layers l-n .. l-1.
        """
        seen = self._seen_rows(problem, layer, expert_to_device, run_start)
        if seen is None:
            return None
        rows = seen[0]
        return rows * self.layer_weight(layer, problem.total_activations, float(rows.sum()))

    def _seen_rows(self, problem, layer, expert_to_device, run_start):
        """(rows before the factor, their context ids) of :meth:`context_rows`, or None."""
        if layer - self.order < run_start:
            return None
        rows = ngram_context_affinity(
            self.transitions, expert_to_device, layer, problem.ep_size, self.order, self.target
        )
        seen = np.flatnonzero(rows.sum(axis=1) > 0)
        return (rows[seen], seen) if seen.size else None

    def extend(
        self, problem: LayerProblem, layer: int, expert_to_device: np.ndarray, run_start: int
    ) -> LayerProblem:
        """Layer ``layer``'s problem with the context rows appended (itself when it has none).

        ``expert_to_device`` [L, N] must hold the final placements of layers l-n .. l-1;
        layers whose context reaches before ``run_start`` get no rows.

        The rows put no load on the capacity, but they stand for occurrences
        (``row_occurrences``: the fitting tokens seen in each context), and when the
        problem has fitting batches they take their share of them: at run time the online
        choice follows the n-gram table for a share u of the occurrences
        (:meth:`batch_share`: the occurrences whose tokens the predictor discounts, where
        they are most, and at least those of tokens the token table cannot place), so each
        batch's token rows keep (1 - u) of their occurrences and the context rows get u of
        theirs, spread over the batches in proportion to the batches' sizes (the per-batch
        mix of contexts is not recorded). :func:`planner.solve.common.batch_overflow` then
        charges a placement for what the runtime cap takes back from the n-gram table's
        choices too. Where u is 0 the batches are the token rows' alone, whose per-batch mix
        is recorded exactly.
        """
        found = self._seen_rows(problem, layer, expert_to_device, run_start)
        if found is None:
            return problem
        raw, seen = found
        rows = raw * self.layer_weight(layer, problem.total_activations, float(raw.sum()))
        # occurrences per context: its tokens' top-1 activations (one per token), which are
        # the rows themselves for the top-1 target
        top1 = raw
        if self.target != "top1":
            top1 = ngram_context_affinity(
                self.transitions, expert_to_device, layer, problem.ep_size, self.order, "top1"
            )[seen]
        occurrences = np.asarray(top1.sum(axis=1)).ravel()
        batch_freq = problem.batch_freq
        u = self.batch_share(layer)
        if batch_freq is not None and u > 0:
            share = np.asarray(batch_freq.sum(axis=0)).ravel() / max(problem.total_freq, 1e-300)
            batch_freq = sparse.vstack(
                [batch_freq * (1.0 - u), sparse.csr_matrix(u * np.outer(occurrences, share))],
                format="csr",
            )
        else:  # empty batch rows (or no batches)
            batch_freq = None
        return problem.with_load_free_rows(rows, occurrences, batch_freq)


def restrict(
    problem: LayerProblem, extended: LayerProblem, placement: LayerPlacement
) -> LayerPlacement:
    """A placement of ``extended`` as a placement of ``problem`` (its first J rows).

    The report (objective, LAR, imbalance) is recomputed on the token rows; ``info``
    gains ``ngram_term``: the context rows and their local rate on the fitting data.
    """
    if extended is problem:
        return placement
    j, t = problem.num_tokens, placement.token_to_device
    ctx = slice(j, extended.num_tokens)
    gain = device_gains(extended.select_tokens(np.arange(j, extended.num_tokens)),
                        placement.expert_to_device)  # fmt: skip
    ctx_total = float(extended.token_activations[ctx].sum())
    local = float(gain[np.arange(gain.shape[0]), t[ctx]].sum())
    info = dict(placement.info)
    info["ngram_term"] = {
        "contexts": int(extended.num_tokens - j),
        "local_rate": local / ctx_total if ctx_total > 0 else 0.0,
    }
    return finish(
        problem, placement.method, placement.expert_to_device, seed=placement.seed,
        started=time.perf_counter() - placement.seconds, token_to_device=t[:j], info=info,
    )  # fmt: skip

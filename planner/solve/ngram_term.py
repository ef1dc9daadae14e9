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
(:func:`planner.predict.ngram.ngram_context_affinity`), times ``weight``. For a routed
statistic each fitting token's k activations count once in the context rows as in the token
rows, so at weight 1 both weigh the same (a top-1 statistic counts the top-1 activation
only, 1/k of the weight; scaling it up by k did not pay, see the end of this doc). A
load-free row goes to the device where most of its activations are local, which is exactly
the n-gram table's prediction for c. So the extended problem's objective is the token
table's local activations plus ``weight`` times the n-gram table's, both on the fitting
data. Every solver gets the same extended problem.
:func:`restrict` drops the rows from the answer and reports on the token rows.

Solving in order takes away the parallelism over layers. The layers are therefore split into
fixed runs of at most :data:`RUN_LAYERS` consecutive layers. Runs are solved in parallel
with each other, and the layers of a run in order. The first n layers of every run but the
first have no placed predecessors, so they are solved without the term. Runs depend on the
layer count only, not on ``--jobs``, so neither does the plan.

Measured by ``benchmarks/compare_traces.py`` (36 held-out cases: FLAME-MoE and the example
model, 3 split seeds, 3 EP sizes, 2 n-gram statistics; CEO's balanced LAR over the best
baseline's):

- weight 0 (layers independent): CEO wins 23 cases, mean ratio 1.014, min 0.955;
- weight 0.5 (the default): wins 24, mean 1.012, min 0.973; mean CEO balanced LAR
  0.4576 on the example and 0.2865 on FLAME;
- weight 1: wins 18, mean 1.013, min 0.969. FLAME alone does best here (17 of 18 cases,
  mean 1.040, CEO 0.2905). On the example CEO loses 17 of 18 by up to 3%: there every
  method concentrates tokens harder, and the runtime cap on the example's single-domain
  batches takes more of it back from CEO than from the others.

CEO gains the most from the term because its global search uses the combined objective. A
local polish of an independently solved placement under the extended objective helped the
baselines more than CEO.

Tried and not kept (measured with n-gram backoff and calibrated token confidences):

- *the weight scaled up by k for the top-1 statistic* (3 on FLAME-MoE, 2 on the example):
  CEO's own balanced LAR on FLAME-MoE rose 1.6-6% at EP 4, fell 2-4% at EP 8, moved -3.5%
  to +0.7% at EP 16 and 0 to +2% at EP 32 (mean +1%); the baselines lost more (k-means -2%
  to -8% at EP 16), and on the example CEO fell behind k-means in all 9 cases
  (0.971-0.998). So the weight stays 0.5 for both statistics;
- *forward rows*, scoring layer l's placement also as layer l+1's context
  (one load-free row per expert of layer l+1, its activations counted against the tokens'
  top-1 expert at layer l; weighted by the share of token occurrences the predictor's token
  shrinkage discounts, so near 0 on the example and near 1 on FLAME-MoE). On the 36-case
  sweep CEO's mean balanced LAR on FLAME stayed at 0.3059 (EP 16 +1-3% but one case -6%,
  EP 4 -0.5%), and at EP 32 it did not close the gap to k-means (top-1 statistic 0.971 and
  0.963 of it). Forward rows at weight 1 on only the first n layers of each run (the ones
  without context rows), FLAME-MoE split seed 1, routed, EP 2: CEO 0.6515 -> 0.6572, but
  k-means, given the same rows, 0.6576 -> 0.6619.

Where CEO still loses (FLAME-MoE, EP 2 and EP 32; ``compare_traces.py --ep 2,32``), the
search is not the main cause. Each layer's extended problem was solved with every method,
with CEO's placements of the earlier layers as context. At EP 2 (seed 1, routed) CEO's
objective is the best or tied at every layer; at EP 32 (seed 1, top-1) it trails k-means'
raw objective at 3 of 8 layers by at most 0.8% (CEO scores net of the batch cap), and adding
k-means' placement to CEO's candidates left the held-out balanced LAR at 0.1026. The loss
comes from the chain. k-means' own placements of layers l-n .. l-1 make contexts that
predict layer l better (EP 2: n-gram LAR on the *fitting* data 0.710 against CEO's 0.698),
and a per-layer objective cannot see what a placement will be worth as context for the
layers after it.
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


@dataclass(frozen=True, eq=False)
class NgramTerm:
    """The cross-layer n-gram term of :func:`planner.solve.plan.solve_model`.

    Attributes:
        transitions: the predictor's top-1 transition statistic.
        order: n of the n-gram tables the plan will hold.
        weight: factor on the context rows' activations; 1.0 weighs a context row like
            the token rows it stands for (routed statistic).
        target: the n-gram table's target (:data:`planner.predict.ngram.TARGETS`).
    """

    transitions: TopOneTransitions
    order: int
    weight: float = DEFAULT_WEIGHT
    target: str = "routed"

    def __post_init__(self) -> None:
        if not (math.isfinite(self.weight) and self.weight > 0):
            raise InputError(f"n-gram weight {self.weight!r} must be a positive number")
        if self.target not in TARGETS:
            raise InputError(f"n-gram target {self.target!r} must be one of {', '.join(TARGETS)}")

    def runs(self, num_layers: int) -> list[list[int]]:
        """Layer ids split into ceil(L / RUN_LAYERS) runs of consecutive layers, near-equal."""
        count = max(1, math.ceil(num_layers / RUN_LAYERS))
        return [run.tolist() for run in np.array_split(np.arange(num_layers), count) if run.size]

    def extend(
        self, problem: LayerProblem, layer: int, expert_to_device: np.ndarray, run_start: int
    ) -> LayerProblem:
        """Layer ``layer``'s problem with the context rows appended (itself when it has none).

        ``expert_to_device`` [L, N] must hold the final placements of layers l-n .. l-1;
        layers whose context reaches before ``run_start`` get no rows.
        """
        if layer - self.order < run_start:
            return problem
        rows = ngram_context_affinity(
            self.transitions, expert_to_device, layer, problem.ep_size, self.order, self.target
        )
        rows = rows[np.flatnonzero(rows.sum(axis=1) > 0)] * self.weight
        if not rows.shape[0]:
            return problem
        batch_freq = problem.batch_freq
        if batch_freq is not None:
            empty = sparse.csr_matrix((rows.shape[0], batch_freq.shape[1]))
            batch_freq = sparse.vstack([batch_freq, empty], format="csr")
        return LayerProblem(
            sparse.vstack([problem.affinity, sparse.csr_matrix(rows)], format="csr"),
            np.concatenate([problem.token_freq, np.zeros(rows.shape[0])]),
            problem.ep_size,
            beta=problem.beta,
            balance=problem.balance,
            theta=problem.theta,
            layer=problem.layer,
            batch_freq=batch_freq,
        )


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

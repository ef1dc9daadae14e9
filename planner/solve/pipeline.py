"""From a fitted predictor to a plan: what ``moeplan solve`` and ``moeplan compare`` run.

1. one :class:`LayerProblem` per MoE layer from the predictor's affinity (tokens seen in
   fitting, W = their routed activations, a = their frequencies);
2. :func:`planner.solve.plan.solve_model` with the chosen method; when the predictor has
   transition statistics, with the n-gram term (:mod:`planner.solve.ngram_term`): layers
   in order, each placement also chosen for the n-gram table it will get, the term weighed
   up where the predictor's token shrinkage says tokens do not carry over to new requests;
   with ``chain_passes`` (any method but vanilla), the chain polish
   (:mod:`planner.solve.chain`) then revisits each layer with the layers after it placed;
3. a vocabulary-wide token table per layer: solved tokens keep the solver's device, and
   their confidence (the share of their fitting activations local there) is calibrated by
   the predictor's token shrinkage (:mod:`planner.predict.reliability`: a token seen a
   times keeps ``a / (a + m)`` of its lead over the device's average share); an unseen
   token borrows the device of the known token the predictor maps it to (nearest input
   embedding, paper 000 §3.3) at half that token's confidence; a token with no neighbour
   goes to the device carrying most of the layer's expert load, with confidence 0;
4. n-gram device tables fitted under the new placement from the predictor's top-1
   transition statistics (paper 000 App. B.1); a predictor fitted on a counts table has no
   transitions, and its plan has no n-gram tables.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from planner.errors import InputError
from planner.predict.ngram import fit_ngram_device_table
from planner.predict.predictor import Predictor
from planner.predict.reliability import discounted_share, shrink_confidence
from planner.solve.metrics import token_table
from planner.solve.ngram_term import DEFAULT_WEIGHT, NgramTerm
from planner.solve.plan import Plan, solve_model
from planner.solve.problem import LayerPlacement, LayerProblem, SolverConfig
from planner.solve.registry import get_solver
from planner.trace.schema import TraceMeta

# Sweeps of the chain polish a plan may ask for.
MAX_CHAIN_PASSES = 10
# An unseen token's borrowed device is less certain than a solved token's own choice.
BORROWED_CONFIDENCE = 0.5


@dataclass(frozen=True)
class PlanConfig:
    """Settings of ``moeplan solve``.

    Attributes:
        method: solver registry name (``ceo``, ``ilp``, ``metis``, ``kmeans``,
            ``alternating``, ``vanilla``).
        ep_size: E, devices sharing a layer's experts.
        beta: token load factor of the per-device cap (1.1 in both papers).
        seed: seed of every random choice; layer l runs with ``layer_seed(seed, l)``.
        jobs: worker processes solving layers in parallel.
        time_limit: seconds per layer a solver may spend (None = its default).
        ngram_order: n of the n-gram device tables (1..3).
        options: per-method solver options, ``{"ceo": {"variant": "paper"}}``.
        ngram_weight: weight of the n-gram term against the token rows
            (:mod:`planner.solve.ngram_term`); 0 solves every layer on its own.
        chain_passes: sweeps of the chain polish (:mod:`planner.solve.chain`) after the
            solver, for any method but ``vanilla`` (the default deployment stays what it
            is); 0 (the default) skips it. Needs the n-gram term.
    """

    method: str = "ceo"
    ep_size: int = 8
    beta: float = 1.1
    seed: int = 0
    jobs: int = 1
    time_limit: float | None = None
    ngram_order: int = 2
    options: dict[str, dict[str, Any]] = field(default_factory=dict)
    ngram_weight: float = DEFAULT_WEIGHT
    chain_passes: int = 0

    def __post_init__(self) -> None:
        get_solver(self.method)
        if not 1 <= self.ngram_order <= 3:
            raise InputError(f"ngram_order={self.ngram_order} must be 1, 2 or 3")
        if self.jobs < 1:
            raise InputError(f"jobs={self.jobs} must be at least 1")
        if self.beta < 1:
            raise InputError(f"beta={self.beta} must be >= 1")
        if not (math.isfinite(self.ngram_weight) and self.ngram_weight >= 0):
            raise InputError(f"ngram_weight={self.ngram_weight} must be a number >= 0")
        if not 0 <= self.chain_passes <= MAX_CHAIN_PASSES:
            raise InputError(
                f"chain_passes={self.chain_passes} must be between 0 and {MAX_CHAIN_PASSES}"
            )
        if self.chain_passes and self.ngram_weight == 0:
            raise InputError("chain_passes needs the n-gram term: ngram_weight must be > 0")

    def solver_config(self) -> SolverConfig:
        return SolverConfig(seed=self.seed, time_limit=self.time_limit, options=self.options)


def layer_problems(predictor: Predictor, ep_size: int, beta: float = 1.1) -> list[LayerProblem]:
    """One problem per MoE layer over the tokens seen in fitting."""
    problems = []
    mix = predictor.batches
    batch_ids = batch_freq = None  # every layer has the same seen tokens: one shared matrix
    for layer in range(predictor.meta.num_layers):
        ids, w, a = predictor.affinity.layer_problem_inputs(layer)
        if mix is not None and (batch_ids is None or not np.array_equal(ids, batch_ids)):
            batch_ids, batch_freq = ids, mix.token_batch_freq(ids)
        problems.append(
            LayerProblem(
                w, a, ep_size, beta=beta, token_ids=ids, layer=layer, batch_freq=batch_freq
            )
        )
    return problems


def vocabulary_table(
    predictor: Predictor, problem: LayerProblem, placement: LayerPlacement
) -> tuple[np.ndarray, np.ndarray]:
    """(token_to_device [V], token_confidence [V]) of one layer, unseen tokens filled."""
    aff = predictor.affinity
    v = predictor.meta.vocab_size
    table, conf = token_table(
        problem.token_ids, placement.token_to_device, placement.token_confidence,
        placement.expert_to_device, v, problem.ep_size, expert_load=problem.expert_load,
    )  # fmt: skip
    if predictor.token_shrinkage is not None and problem.layer is not None:
        load = problem.expert_load
        share = np.bincount(placement.expert_to_device, weights=load, minlength=problem.ep_size)
        share = share / max(float(load.sum()), 1e-300)  # each device's share of the layer
        seen = aff.seen_
        conf[seen] = shrink_confidence(
            conf[seen], share[table[seen]], aff.token_counts_[seen],
            float(predictor.token_shrinkage[problem.layer]),
        )  # fmt: skip
    source = aff.source_rows(np.arange(v))
    borrowed = (source >= 0) & ~aff.seen_
    table[borrowed] = table[source[borrowed]]
    conf[borrowed] = conf[source[borrowed]] * BORROWED_CONFIDENCE
    return table, conf


def make_plan(predictor: Predictor, config: PlanConfig, *, progress: bool = True) -> Plan:
    """Solve every layer with ``config.method`` and assemble the :class:`Plan`."""
    meta = predictor.meta
    n, e = meta.num_experts, config.ep_size
    if e < 1 or e > n or n % e:
        raise InputError(
            f"--ep {e} must divide the {n} experts of {meta.model!r} (and be at most {n}); "
            f"valid: {', '.join(str(d) for d in range(1, n + 1) if n % d == 0)}"
        )
    if config.chain_passes and predictor.transitions is None:
        raise InputError(
            "chain_passes needs n-gram transitions, and this predictor has none "
            "(it was fitted on a counts table); solve without it"
        )
    t0 = time.perf_counter()
    problems = layer_problems(predictor, e, config.beta)
    term = None
    if predictor.transitions is not None and config.ngram_weight > 0:
        unreliable = None
        if predictor.token_shrinkage is not None:
            unreliable = tuple(
                discounted_share(p.token_freq, float(m))
                for p, m in zip(problems, predictor.token_shrinkage, strict=True)
            )
        term = NgramTerm(
            predictor.transitions, config.ngram_order, config.ngram_weight,
            unreliable=unreliable,
        )  # fmt: skip
    placements = solve_model(
        problems, config.method, config.solver_config(), jobs=config.jobs, progress=progress,
        ngram_term=term, chain_passes=0 if config.method == "vanilla" else config.chain_passes,
    )  # fmt: skip
    tables = [vocabulary_table(predictor, p, q) for p, q in zip(problems, placements, strict=True)]
    expert_to_device = np.stack([q.expert_to_device for q in placements])
    ngram_dev = ngram_conf = None
    order = 0
    if predictor.transitions is not None:
        order = config.ngram_order
        ngram = fit_ngram_device_table(predictor.transitions, expert_to_device, e, order)
        ngram_dev, ngram_conf = ngram.to_device, ngram.confidence
    reports = [q.report() for q in placements]
    shrinkage = predictor.token_shrinkage
    config_json = asdict(config) | {
        "seconds": round(time.perf_counter() - t0, 3),
        "token_shrinkage": None if shrinkage is None else shrinkage.tolist(),
        "ngram_unreliable": None
        if term is None or term.unreliable is None
        else [round(u, 4) for u in term.unreliable],
    }
    return Plan(
        model=json.loads(meta.to_json()),
        fingerprint=meta.fingerprint(),
        ep_size=e,
        method=config.method,
        seed=config.seed,
        config=config_json,
        expert_to_device=expert_to_device,
        token_to_device=np.stack([t for t, _ in tables]),
        token_confidence=np.stack([c for _, c in tables]),
        ngram_order=order,
        ngram_to_device=ngram_dev,
        ngram_confidence=ngram_conf,
        reports=reports,
    )


def plan_meta(plan: Plan) -> TraceMeta:
    """The model metadata a plan was made for."""
    return TraceMeta.from_json(json.dumps(plan.model), where="plan")

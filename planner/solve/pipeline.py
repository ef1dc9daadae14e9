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
   transitions, and its plan has no n-gram tables. With ``ngram_defer`` (the default) each
   layer's n-gram confidences are weighed by u, the share of its token occurrences the
   token shrinkage discounts (below): the n-gram table defers to token rows that carry
   over to new requests and still decides for the tokens the token table knows little of.

Why the n-gram table defers. The token table is solved under the per-device token cap; the
n-gram table is not: its contexts go wherever their experts are, which is the devices
holding the hot experts. Wherever Algorithm 2 lets an n-gram prediction override a token's
own device, load moves off the balanced token table, and the runtime's per-batch cap then
evicts confident tokens from the crowded devices. On the example model (tokens route
consistently, u = 0.03-0.09) the n-gram table raises the held-out LAR without the cap
(CEO, EP 4: 0.514 token table alone, 0.585 with it) and lowers it under the cap (0.453 ->
0.447); with the top-1 statistic, whose confidence (the top-1 expert's hit rate) runs
higher, more so (EP 8: 0.283 -> 0.264). Weighing by u gives 0.453 and 0.283. Where tokens
do not carry over (FLAME-MoE, u = 0.97-1.0) it changes nothing, and there the n-gram table
makes the plan (EP 16, top-1, CEO: balanced LAR 0.181 with it, 0.100 without). On the 36
held-out cases of ``benchmarks/compare_traces.py`` (against the same sweep with
``--no-ngram-defer``): on the example every solver's balanced LAR rises 2.4-3.1% on average
(CEO: +0.9% with the routed statistic, +5.3% with top-1, up to +7.1%); on FLAME-MoE the
baselines are unchanged and CEO moves by its time budget's noise (-0.1% on average). The
rule is not tuned: u is the number the token shrinkage already gives. Tried on four cases
(example EP 4 and 8, Mixtral-shaped synthetic EP 2, Qwen3-shaped EP 8; four solvers): a
hard gate (n-gram confidences near 0 where u < 0.5) and sqrt(u) came within 0.3% of u on
the example and up to 0.7% below it on the synthetic traces (u = 0.1-0.3). ``vanilla``
keeps the fitted confidences: its token table is dealt out by frequency, not solved, and
deferring to it cost its balanced LAR 7.5% on the example.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from planner._checks import is_bool, is_integer, is_real
from planner.errors import InputError
from planner.predict.ngram import check_table_size, fit_ngram_device_table
from planner.predict.predictor import Predictor
from planner.predict.reliability import discounted_share, shrink_confidence, unseen_share
from planner.solve.expert_balance import expert_imbalance
from planner.solve.metrics import token_table
from planner.solve.ngram_term import DEFAULT_WEIGHT, MAX_WEIGHT, NgramTerm
from planner.solve.plan import Plan, solve_model
from planner.solve.problem import LayerPlacement, LayerProblem, SolverConfig, check_expert_beta
from planner.solve.registry import check_method_options, get_solver
from planner.solve.settle import check_move_cost, check_replan
from planner.trace.schema import TraceMeta

# Sweeps of the chain polish a plan may ask for.
MAX_CHAIN_PASSES = 10
# An unseen token's borrowed device is less certain than a solved token's own choice.
BORROWED_CONFIDENCE = 0.5
# Least weight of a deferring n-gram table's confidences (``PlanConfig.ngram_defer``): even
# where every token is trusted, the n-gram table still decides for tokens of confidence 0.
MIN_NGRAM_SCALE = 0.01


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
        ngram_defer: weigh each layer's n-gram confidences by the share u of its token
            occurrences the predictor's token shrinkage discounts (at least
            :data:`MIN_NGRAM_SCALE`), so that the n-gram table overrides only tokens the
            token table knows little of (module doc). False keeps the fitted confidences
            (the paper's table); no effect when the predictor has no token shrinkage, nor
            for ``vanilla``, whose token table is dealt out, not solved.
        expert_beta: cap on each device's expert load (routed activations its experts
            process) as a multiple of the mean (:mod:`planner.solve.expert_balance`), for
            any method but ``vanilla``: each layer's result is brought under it by expert
            swaps as it is solved (so the layers after it take their n-gram contexts from
            the capped placement), CEO's search keeps to it, and the chain polish does
            too. None (the default) leaves it unbounded.
        polish: end every method but ``ceo`` (which ends with it) and ``vanilla`` with
            CEO's local search (:func:`planner.solve.polish.polish_placement`): how much of
            CEO's lead is its search shows against the baselines polished alike.
        move_cost: re-planning a deployed model (``make_plan``'s ``reference``): the LAR a
            layer must gain per expert that leaves its deployed group
            (:mod:`planner.solve.settle`), e.g. 0.002; 0 (the default) moves experts
            freely. Needs a reference; not with ``vanilla``. The chain polish counts the
            moves too.
        batch_prices: end every method but ``vanilla`` with its tokens re-assigned priced
            per fitting batch (:mod:`planner.solve.batch_prices`), so that the runtime's
            per-batch cap takes back less where the served batches are made up as the
            fitting batches were (off by default: where they are mixed it loses).
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
    ngram_defer: bool = True
    expert_beta: float | None = None
    polish: bool = False
    move_cost: float = 0.0
    batch_prices: bool = False

    def __post_init__(self) -> None:
        check_expert_beta(self.expert_beta)
        get_solver(self.method)
        check_method_options(self.options)  # before any layer is solved
        # Stored as Python numbers: the config goes to plan.json as it is (a numpy number is
        # not JSON), and a bool is no count or number (True was taken as 1).
        for name in ("ep_size", "seed", "jobs", "ngram_order", "chain_passes"):
            value = getattr(self, name)
            if not is_integer(value):
                raise InputError(f"{name}={value!r} must be an integer")
            object.__setattr__(self, name, int(value))
        for name in ("beta", "time_limit", "ngram_weight", "expert_beta", "move_cost"):
            value = getattr(self, name)
            if value is not None and not is_real(value):
                raise InputError(f"{name}={value!r} must be a number")
            object.__setattr__(self, name, None if value is None else float(value))
        for name in ("ngram_defer", "polish", "batch_prices"):
            value = getattr(self, name)
            if not is_bool(value):
                raise InputError(f"{name}={value!r} must be true or false")
            object.__setattr__(self, name, bool(value))
        if not 1 <= self.ngram_order <= 3:
            raise InputError(f"ngram_order={self.ngram_order} must be 1, 2 or 3")
        if self.jobs < 1:
            raise InputError(f"jobs={self.jobs} must be at least 1")
        if not (math.isfinite(self.beta) and self.beta >= 1):
            raise InputError(f"beta={self.beta} must be a finite number >= 1")
        if not 0 <= self.ngram_weight <= MAX_WEIGHT:
            raise InputError(
                f"ngram_weight={self.ngram_weight} must be a number >= 0, at most {MAX_WEIGHT:g}"
            )
        if not 0 <= self.chain_passes <= MAX_CHAIN_PASSES:
            raise InputError(
                f"chain_passes={self.chain_passes} must be between 0 and {MAX_CHAIN_PASSES}"
            )
        if self.chain_passes and self.ngram_weight == 0:
            raise InputError("chain_passes needs the n-gram term: ngram_weight must be > 0")
        check_move_cost(self.move_cost)
        if self.move_cost and self.method == "vanilla":
            raise InputError("move_cost does not apply to vanilla (the contiguous layout)")

    def solver_config(self) -> SolverConfig:
        return SolverConfig(
            seed=self.seed,
            time_limit=self.time_limit,
            options=self.options,
            expert_beta=self.expert_beta,  # solve_layer leaves vanilla uncapped
            polish=self.polish,
            batch_prices=self.batch_prices,
        )


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
    assert problem.token_ids is not None  # layer_problems() always sets them
    table, conf = token_table(
        problem.token_ids, placement.token_to_device, placement.token_confidence,
        placement.expert_to_device, v, problem.ep_size, expert_load=problem.expert_load,
    )  # fmt: skip
    if predictor.token_shrinkage is not None and problem.layer is not None:
        load = problem.expert_load
        share: np.ndarray = np.bincount(
            placement.expert_to_device, weights=load, minlength=problem.ep_size
        )
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


def unplaced_share(predictor: Predictor, problems: list[LayerProblem]) -> tuple[float, ...]:
    """Per layer, the share of serving occurrences the token table cannot place, so that
    the n-gram table routes them (:attr:`planner.solve.ngram_term.NgramTerm.unplaced`).

    Tokens never seen in fitting (their share estimated by
    :func:`planner.predict.reliability.unseen_share`) times the share of the vocabulary's
    unseen tokens with no known neighbour (:func:`vocabulary_table` lends the others a
    neighbour's device): about 0 with input embeddings, the whole unseen share without.
    """
    aff = predictor.affinity
    unseen = np.flatnonzero(~aff.seen_)
    alone = float((aff.source_rows(unseen) < 0).mean()) if unseen.size else 0.0
    return tuple(alone * unseen_share(p.token_freq) for p in problems)


def make_plan(
    predictor: Predictor,
    config: PlanConfig,
    *,
    progress: bool = True,
    reference: np.ndarray | None = None,
) -> Plan:
    """Solve every layer with ``config.method`` and assemble the :class:`Plan`.

    ``reference`` ([L, N], the deployed plan's ``expert_to_device``) with
    ``config.move_cost`` > 0: each layer is solved with the deployed groups as load-free
    rows (:mod:`planner.solve.settle`), so that experts leave them only where that pays.
    Align the plan afterwards (:func:`planner.solve.align.align_plan`): it renames the
    devices and counts the moves.
    """
    meta = predictor.meta
    n, e = meta.num_experts, config.ep_size
    if e < 1 or e > n or n % e:
        raise InputError(
            f"--ep {e} must divide the {n} experts of {meta.model!r} (and be at most {n}); "
            f"valid: {', '.join(str(d) for d in range(1, n + 1) if n % d == 0)}"
        )
    check_table_size(e, config.ngram_order)  # after the divisor check: its message comes first
    if config.chain_passes and predictor.transitions is None:
        raise InputError(
            "chain_passes needs n-gram transitions, and this predictor has none "
            "(it was fitted on a counts table); solve without it"
        )
    reference = check_replan(reference, config.move_cost, meta.num_layers, n, e)
    t0 = time.perf_counter()
    problems = layer_problems(predictor, e, config.beta)
    # vanilla is the default deployment as it is: no chain polish, fitted n-gram confidences
    # (its token table is dealt out, not solved, so nothing to defer to)
    solved = config.method != "vanilla"
    unreliable = None
    if predictor.token_shrinkage is not None:
        unreliable = tuple(
            discounted_share(p.token_freq, float(m))
            for p, m in zip(problems, predictor.token_shrinkage, strict=True)
        )
    term = unplaced = None
    if predictor.transitions is not None and config.ngram_weight > 0:
        unplaced = unplaced_share(predictor, problems)
        term = NgramTerm(
            predictor.transitions, config.ngram_order, config.ngram_weight,
            unreliable=unreliable, unplaced=unplaced,
        )  # fmt: skip
    placements = solve_model(
        problems, config.method, config.solver_config(), jobs=config.jobs, progress=progress,
        ngram_term=term, chain_passes=config.chain_passes if solved else 0,
        reference=reference, move_cost=config.move_cost,
    )  # fmt: skip
    tables = [vocabulary_table(predictor, p, q) for p, q in zip(problems, placements, strict=True)]
    expert_to_device = np.stack([q.expert_to_device for q in placements])
    ngram_dev = ngram_conf = None
    order = 0
    if predictor.transitions is not None:
        order = config.ngram_order
        ngram = fit_ngram_device_table(predictor.transitions, expert_to_device, e, order)
        ngram_dev, ngram_conf = ngram.to_device, ngram.confidence
        if config.ngram_defer and unreliable is not None and solved:
            ngram_conf = defer_ngram_confidence(ngram_conf, unreliable)
    reports = [
        q.report() | {"expert_imbalance": expert_imbalance(p, q.expert_to_device)}
        for p, q in zip(problems, placements, strict=True)
    ]
    shrinkage = predictor.token_shrinkage
    config_json = asdict(config) | {
        "seconds": round(time.perf_counter() - t0, 3),
        "token_shrinkage": None if shrinkage is None else shrinkage.tolist(),
        "ngram_unreliable": None if unreliable is None else [round(u, 4) for u in unreliable],
        "ngram_unplaced": None if unplaced is None else [round(u, 4) for u in unplaced],
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


def defer_ngram_confidence(confidence: np.ndarray, unreliable) -> np.ndarray:
    """[L, E**n] n-gram confidences weighed per layer by u (at least MIN_NGRAM_SCALE); float16.

    ``unreliable[l]`` is layer l's share of token occurrences the token shrinkage discounts
    (:func:`planner.predict.reliability.discounted_share`); see the module doc.
    """
    scale = np.maximum(np.asarray(unreliable, np.float64), MIN_NGRAM_SCALE)
    if scale.shape != (confidence.shape[0],):
        raise InputError(f"{scale.size} layer weights for {confidence.shape[0]} n-gram layers")
    return (confidence.astype(np.float64) * scale[:, None]).astype(np.float16)


def plan_meta(plan: Plan) -> TraceMeta:
    """The model metadata a plan was made for."""
    return TraceMeta.from_json(json.dumps(plan.model), where="plan")

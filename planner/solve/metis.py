"""METIS baseline: partition the bipartite token-expert graph, then the shared repair.

The graph partitioner the Speculative MoE paper compares against (paper 000 §3.4). Nodes
are the N experts and the J tokens; edge (token j, expert k) has weight W[j, k] (scaled to
integers). METIS cuts the graph into E parts of balanced vertex weight while minimising the
cut weight, i.e. the activations whose token and expert land on different parts.

Vertex weights: a token weighs its frequency ``a_j``; an expert weighs
``expert_weight x S / N`` (S = total frequency): with ``expert_weight=1`` experts and tokens
carry equal total weight, with 0 only the token load is balanced. (pymetis 2025.2 does not
pass multi-constraint weights through, so two separate balance constraints are not
available.) No single setting is best on the real OLMoE/Mixtral counts (the best expert
weight and imbalance tolerance ``ufactor`` change from layer to layer, by up to 4% LAR), so
to keep the baseline strong METIS is run on a small grid of settings
(``expert_weights`` x ``ufactors`` x ``ncuts`` seeds) and the best final result is kept.

METIS's parts are then handled exactly like every other solver's output
(:mod:`planner.solve.common`): experts are repaired to exactly N/E per device, scoring each
expert by the activations it receives from the tokens METIS put in each part; tokens are
then placed by the shared capacity assignment on the repaired expert placement.
"""

from __future__ import annotations

import time

import numpy as np
import pymetis

from planner._io import native_stdout
from planner.errors import InputError
from planner.solve.common import (
    assign_for_problem,
    check_options,
    device_gains,
    expert_scores,
    finish,
    net_objective,
    repair_expert_counts,
)
from planner.solve.problem import LayerPlacement, LayerProblem, SolverConfig

DEFAULTS: dict[str, object] = {
    # total expert vertex weight / total token vertex weight; one partition per value
    "expert_weights": (0.0, 0.3, 1.0),
    # METIS imbalance tolerances in 1/1000 (30 = 3%); one partition per value
    "ufactors": (30, 100, 300),
    "ncuts": 1,  # METIS seeds per setting (seed, seed+1, ...)
    "edge_scale": None,  # multiply W by this before rounding (None: median nonzero -> 100)
}
KINDS = {"ncuts": "count+", "edge_scale": "number+?"}  # see common.check_options
# METIS sums integer weights in 32 bits; keep totals well inside.
_MAX_TOTAL_WEIGHT = 2**30
# Largest option values taken: METIS's integers are 64-bit (a larger ufactor or seed is a
# TypeError in pymetis, a larger expert weight overflows the vertex weights), and far below
# these the balance constraint already binds nothing.
_MAX_UFACTOR = 10**9
_MAX_EXPERT_WEIGHT = 1e6
_SEED_MODULUS = 2**63


def solve(problem: LayerProblem, config: SolverConfig) -> LayerPlacement:
    started = time.perf_counter()
    opts = check_options("metis", config.for_method("metis"), DEFAULTS, KINDS)
    ufactors = _as_tuple(opts["ufactors"])
    if not all(1 <= u <= _MAX_UFACTOR and u == int(u) for u in ufactors):
        # METIS refuses a zero tolerance, and takes integers only
        raise InputError(
            f"metis: ufactors={opts['ufactors']!r} must each be >= 1, whole, and at most "
            f"{_MAX_UFACTOR:g}"
        )
    if max(_as_tuple(opts["expert_weights"])) > _MAX_EXPERT_WEIGHT:
        raise InputError(
            f"metis: expert_weights={opts['expert_weights']!r} must each be at most "
            f"{_MAX_EXPERT_WEIGHT:g}"
        )
    adjacency, eweights, token_w = _bipartite_graph(problem, opts)
    # one at a time (a huge ncuts never builds a list), until the time limit if one is set
    settings = (
        (float(ew), int(uf), cut)
        for ew in _as_tuple(opts["expert_weights"])
        for uf in _as_tuple(opts["ufactors"])
        for cut in range(int(opts["ncuts"]))
    )
    deadline = config.deadline(started)
    best, tried = None, 0
    for setting in settings:
        if best is not None and deadline is not None and time.perf_counter() > deadline:
            break
        tried += 1
        expert_weight, ufactor, cut = setting
        expert_w = max(int(round(expert_weight * token_w.sum() / problem.num_experts)), 0)
        vweights = np.concatenate((np.full(problem.num_experts, expert_w, dtype=np.int64), token_w))
        seed = (int(config.seed) + cut) % _SEED_MODULUS  # any seed: METIS's are 64-bit
        options = pymetis.Options(seed=seed, ufactor=ufactor)
        with native_stdout():  # METIS' printf complaints about small graphs
            _, membership = pymetis.part_graph(
                problem.ep_size, adjacency, vweights=vweights, eweights=eweights, options=options
            )
        parts = np.asarray(membership, dtype=np.int64)
        expert_part, token_part = parts[: problem.num_experts], parts[problem.num_experts :]
        x = repair_expert_counts(
            expert_part, expert_scores(problem, token_part), problem.experts_per_device
        )
        gain = device_gains(problem, x)
        t = assign_for_problem(problem, gain).token_to_device
        obj = net_objective(problem, gain, t)  # as CEO chooses (the batch cap netted)
        if best is None or obj > best[0]:
            moved = int((x != expert_part).sum())
            best = (obj, x, t, setting, moved)
    assert best is not None, "metis: the options give no partition to try"
    _, x, t, setting, moved = best
    info = {
        "partitions": tried,
        "best_setting": {
            "expert_weight": setting[0],
            "ufactor": setting[1],
            "seed_offset": setting[2],
        },
        "experts_moved_by_repair": moved,
    }
    return finish(
        problem, "metis", x, seed=config.seed, started=started, token_to_device=t, info=info
    )


def _as_tuple(value) -> tuple:
    return tuple(value) if isinstance(value, list | tuple) else (value,)


def _bipartite_graph(
    problem: LayerProblem, opts: dict
) -> tuple[pymetis.CSRAdjacency, np.ndarray, np.ndarray]:
    """CSR adjacency over N + J vertices (experts first), integer edge and vertex weights."""
    n = problem.num_experts
    w = problem.affinity
    scale = opts["edge_scale"]
    if scale is None:
        scale = 100.0 / float(np.median(w.data)) if w.nnz else 1.0
    # (a floor of 1 on the sum capped tiny affinities scale, every edge weight became 1)
    scale = min(float(scale), _MAX_TOTAL_WEIGHT / max(2.0 * w.data.sum(), 1e-300))
    ew = np.maximum(np.rint(w.data * scale), 1).astype(np.int64)
    # Token rows point at experts (vertex ids 0..N-1); expert rows point at tokens (N..N+J-1).
    wt = w.tocsc()
    ewt = np.maximum(np.rint(wt.data * scale), 1).astype(np.int64)
    xadj = np.concatenate(([0], wt.indptr[1:], wt.indptr[-1] + w.indptr[1:])).astype(np.int64)
    adjncy = np.concatenate((wt.indices.astype(np.int64) + n, w.indices.astype(np.int64)))
    eweights = np.concatenate((ewt, ew))
    freq = problem.token_freq
    positive = freq[freq > 0]
    fscale = 1000.0 / float(np.median(positive)) if positive.size else 1.0
    fscale = min(fscale, _MAX_TOTAL_WEIGHT / 2 / max(freq.sum(), 1e-12))
    token_w = np.maximum(np.rint(freq * fscale), 1).astype(np.int64)
    return pymetis.CSRAdjacency(xadj, adjncy), eweights, token_w

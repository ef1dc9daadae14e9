"""The default deployment, the baseline every plan is compared with (DESIGN.md, "lar_vanilla").

Experts are contiguous: expert e lives on device ``e // (N/E)``. A serving engine without a
plan does not route tokens by identity at all: each sequence's tokens are cut into E
contiguous chunks, so a token's device depends on its position, not on the token. A
per-token table cannot express that; here every token gets a device that spreads the load
evenly (tokens in decreasing frequency dealt out in snake order 0..E-1, E-1..0, ...), which
gives the same expected local rate, about 1/E. The trace evaluator computes the positional
vanilla exactly; this module exists so that "vanilla" is a method like the others.
"""

from __future__ import annotations

import time

import numpy as np

from planner.solve.common import check_options, device_gains, finish, rebalance_tokens
from planner.solve.problem import LayerPlacement, LayerProblem, SolverConfig

DEFAULTS: dict[str, object] = {}


def solve(problem: LayerProblem, config: SolverConfig) -> LayerPlacement:
    """Contiguous experts; tokens dealt out by frequency in snake order (seed unused)."""
    started = time.perf_counter()
    check_options("vanilla", config.for_method("vanilla"), DEFAULTS)
    e, per = problem.ep_size, problem.experts_per_device
    expert_to_device = np.arange(problem.num_experts, dtype=np.int64) // per
    rank = np.empty(problem.num_tokens, dtype=np.int64)
    rank[np.argsort(-problem.token_freq, kind="stable")] = np.arange(problem.num_tokens)
    lap, pos = np.divmod(rank, e)
    token_to_device = np.where(lap % 2 == 0, pos, e - 1 - pos)
    gain = device_gains(problem, expert_to_device)
    token_to_device = rebalance_tokens(problem, token_to_device, gain, priority=-rank.astype(float))
    free = problem.token_freq == 0  # load-free rows (n-gram contexts) go where they are local
    token_to_device[free] = gain[free].argmax(axis=1)
    return finish(
        problem, "vanilla", expert_to_device, seed=config.seed, started=started,
        token_to_device=token_to_device,
        info={"tokens": "snake round-robin by frequency (runtime vanilla is positional)"},
    )  # fmt: skip

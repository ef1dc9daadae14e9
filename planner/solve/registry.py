"""The one list of solvers: registry name -> ``solve(problem, config) -> LayerPlacement``.

Every solver module exposes ``solve`` with that signature and a ``DEFAULTS`` dict of its
options (``SolverConfig.options[name]``); the shared test suite runs over this registry.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from planner.errors import InputError
from planner.solve import alternating, ceo, ilp, kmeans, metis, vanilla
from planner.solve.problem import LayerPlacement, LayerProblem, SolverConfig

Solver = Callable[[LayerProblem, SolverConfig], LayerPlacement]

SOLVERS: dict[str, Solver] = {
    "ceo": ceo.solve,
    "ilp": ilp.solve,
    "metis": metis.solve,
    "kmeans": kmeans.solve,
    "alternating": alternating.solve,
    "vanilla": vanilla.solve,
}

# Each solver's option names and defaults, for help texts and config validation.
OPTION_DEFAULTS: dict[str, dict[str, object]] = {
    "ceo": ceo.DEFAULTS,
    "ilp": ilp.DEFAULTS,
    "metis": metis.DEFAULTS,
    "kmeans": kmeans.DEFAULTS,
    "alternating": alternating.DEFAULTS,
    "vanilla": vanilla.DEFAULTS,
}


def get_solver(method: str) -> Solver:
    """The solver registered as ``method``; InputError listing the names otherwise."""
    try:
        return SOLVERS[method]
    except KeyError:
        raise InputError(
            f"unknown solver method {method!r}; choose one of: {', '.join(SOLVERS)}"
        ) from None


def solve_layer(
    problem: LayerProblem, method: str, config: SolverConfig | None = None
) -> LayerPlacement:
    """Solve one layer with the named method (validated result).

    A layer with no token load to place (e.g. a trace whose tokens are all unknown: only
    load-free n-gram context rows, or none) gets the default deployment whatever the
    method: there is nothing to balance, and the solvers' searches need some load.
    """
    solver = get_solver(method)
    config = config if config is not None else SolverConfig()
    if problem.total_freq <= 0:
        placement = SOLVERS["vanilla"](problem, config)
        note = "no token load in this layer: the default deployment"
        return dataclasses.replace(placement, method=method, info={"degenerate": note})
    return solver(problem, config)

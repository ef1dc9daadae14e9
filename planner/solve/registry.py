"""The one list of solvers: registry name -> ``solve(problem, config) -> LayerPlacement``.

Every solver module exposes ``solve`` with that signature and a ``DEFAULTS`` dict of its
options (``SolverConfig.options[name]``); the shared test suite runs over this registry.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from planner.errors import InputError
from planner.solve import alternating, ceo, ilp, kmeans, metis, vanilla
from planner.solve.batch_prices import batch_priced
from planner.solve.common import check_options
from planner.solve.expert_balance import cap_expert_load
from planner.solve.polish import polish_placement
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


# Each solver's option kinds beyond what its defaults say (planner.solve.common.check_options).
OPTION_KINDS: dict[str, dict[str, str]] = {
    "ceo": ceo.KINDS,
    "ilp": ilp.KINDS,
    "metis": metis.KINDS,
    "kmeans": kmeans.KINDS,
    "alternating": alternating.KINDS,
    "vanilla": {},
}


def check_method_options(options: dict[str, Any]) -> None:
    """Check every method's option dict in ``options`` (``SolverConfig.options``): method
    names, option names and kinds; :class:`InputError` on the first problem.

    The solvers check their own options again when they run (with the value checks that
    need their logic); this catches a typo before any layer is solved, also in the options
    of a method that is not run (``moeplan compare`` gives one dict to several methods).
    """
    if not isinstance(options, dict):
        raise InputError(f"options must be a dict of per-method dicts, got {options!r}")
    unknown = sorted(set(options) - set(SOLVERS))
    if unknown:
        raise InputError(
            f"options name no solver {', '.join(map(repr, unknown))}; "
            f"its keys are methods: {', '.join(SOLVERS)}"
        )
    for method, given in options.items():
        if not isinstance(given, dict):
            raise InputError(f"options[{method!r}] must be a dict, got {type(given).__name__}")
        check_options(method, given, OPTION_DEFAULTS[method], OPTION_KINDS[method])


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

    With ``config.expert_beta`` the result is brought under the expert-load cap
    (:func:`planner.solve.expert_balance.cap_expert_load`; not for ``vanilla``, the default
    deployment as it is). With ``config.polish`` the result of a method other than CEO
    (which ends with it) and ``vanilla`` is then improved by the shared local search
    (:func:`planner.solve.polish.polish_placement`), which keeps to the cap as CEO's does.
    With ``config.batch_prices`` every method but ``vanilla`` ends with its tokens
    re-assigned priced per fitting batch (:mod:`planner.solve.batch_prices`), so that less
    is taken back by the runtime's per-batch cap; the placement stays its own.

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
    placement = solver(problem, config)
    if config.expert_beta is not None and method != "vanilla":
        placement = cap_expert_load(problem, placement, config.expert_beta)
    if config.polish and method not in ("ceo", "vanilla"):  # (CEO ends with it already)
        placement = polish_placement(problem, placement, config)  # within the cap, as CEO's
    if config.batch_prices and method != "vanilla":
        placement = batch_priced(problem, placement)
    return placement

"""Solvers of the balanced token-expert co-placement (paper 000 §3.4, paper 001 §3.3).

Modules, in the order a plan is made:

- :mod:`~planner.solve.problem`     ``LayerProblem``, ``SolverConfig``, ``LayerPlacement``
- :mod:`~planner.solve.common`      what every solver shares: gains, expert repair, objective
- :mod:`~planner.solve.assign`      token assignment within device capacities
- :mod:`~planner.solve.polish`      local search: expert moves and priced swaps
- :mod:`~planner.solve.registry`    ``SOLVERS`` and ``solve_layer``: one module per solver
  (``ceo``, ``ilp``, ``metis``, ``kmeans``, ``alternating``, ``vanilla``)
- :mod:`~planner.solve.plan`        ``solve_model`` over all layers, the ``Plan`` artifact
- :mod:`~planner.solve.metrics`     W-based held-out metrics (LAR, balanced LAR, bounds)
- :mod:`~planner.solve.pipeline`    predictor -> problems -> ``Plan`` (what ``moeplan solve`` runs)
- :mod:`~planner.solve.align`       a new plan's device labels matched to a deployed plan's
"""

from planner.solve.plan import Plan, layer_seed, solve_model
from planner.solve.problem import LayerPlacement, LayerProblem, SolverConfig
from planner.solve.registry import SOLVERS, get_solver, solve_layer

__all__ = [
    "SOLVERS",
    "LayerPlacement",
    "LayerProblem",
    "Plan",
    "SolverConfig",
    "get_solver",
    "layer_seed",
    "solve_layer",
    "solve_model",
]

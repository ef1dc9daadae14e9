"""Fixtures shared by the solver tests."""

from __future__ import annotations

import pytest

from planner.solve.problem import LayerProblem
from tests.solve.instances import random_problem


@pytest.fixture
def small_problem() -> LayerProblem:
    return random_problem(200, 16, 4, top_k=4, seed=1)

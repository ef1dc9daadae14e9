"""Local search on a placement (planner.solve.polish)."""

from __future__ import annotations

import numpy as np

from planner.solve import common
from planner.solve.polish import polish
from tests.solve.instances import random_problem


def test_polish_never_lowers_the_objective() -> None:
    problem = random_problem(300, 16, 4, top_k=4, seed=5, noise=0.2)
    rng = np.random.default_rng(1)
    for _ in range(3):
        x = rng.permutation(np.arange(16) // 4)
        t = common.assign_for_problem(problem, common.device_gains(problem, x)).token_to_device
        before = common.evaluate(problem, x, t).objective
        x2, t2, _ = polish(problem, x, t)
        assert np.bincount(x2, minlength=4).tolist() == [4] * 4
        assert common.evaluate(problem, x2, t2).objective >= before - 1e-9

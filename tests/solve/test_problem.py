"""LayerProblem validation and the LayerPlacement checks."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import sparse

from planner.errors import InfeasibleError, InputError, MismatchError
from planner.solve.common import finish
from planner.solve.problem import LayerPlacement, LayerProblem, SolverConfig

# The worked example of LayerProblem's docstring.
W = np.array([[2, 2, 0, 0], [0, 0, 1, 1], [1, 0, 1, 0]], dtype=float)
A = np.array([2.0, 1.0, 1.0])


def test_worked_example() -> None:
    problem = LayerProblem(W, A, 2)
    p = finish(problem, "test", np.array([0, 0, 1, 1]), seed=0, started=0.0,
               token_to_device=np.array([0, 1, 0]))  # fmt: skip
    assert p.objective == 7.0
    assert p.local_rate == pytest.approx(0.875)
    assert p.token_imbalance == pytest.approx(1.5)
    np.testing.assert_allclose(p.token_confidence, [1.0, 1.0, 0.5])
    assert problem.capacity == pytest.approx(1.1 * 4 / 2)


def test_accepts_any_sparse_or_dense_input() -> None:
    for w in (W, sparse.csr_array(W), sparse.coo_matrix(W), W.tolist()):
        problem = LayerProblem(w, A, 2)
        assert isinstance(problem.affinity, sparse.csr_matrix)
        assert problem.affinity.nnz == 6


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        ({"ep_size": 3}, InfeasibleError, "N=4.*E=3"),
        ({"ep_size": 8}, InfeasibleError, "E=8 exceeds.*N=4"),
        ({"ep_size": 0}, InputError, "ep_size"),
        ({"beta": 0.9}, InfeasibleError, "beta"),
        ({"balance": "soft"}, InputError, "balance"),
        ({"theta": 1.5}, InputError, "theta"),
        # a bool was taken as 1.0, an array of one a raw TypeError
        ({"beta": True}, InputError, "beta=True must be a number"),
        ({"theta": True}, InputError, "theta=True must be a number"),
        ({"beta": np.array([1.2])}, InputError, r"beta=array\(\[1.2\]\) must be a number"),
        ({"token_freq": np.array([1.0, 2.0])}, InputError, "token_freq"),
        ({"token_freq": np.array([1.0, -2.0, 1.0])}, InputError, "negative"),
        ({"affinity": -W}, InputError, "negative"),
        (
            {"affinity": np.array([np.nan, 1.0])[None, :].repeat(3, 0)},
            InputError,
            "non-finite|shape",
        ),
        ({"token_ids": np.array([1, 2])}, InputError, "token_ids"),
        # finite entries whose sum overflows: every solver divided by an infinite total
        ({"affinity": W * 5e307}, InputError, "affinity sums to more than a float64"),
        ({"token_freq": A * 5e307}, InputError, "token_freq sums to more than a float64"),
    ],
)
def test_invalid_problems(kwargs, error, match) -> None:
    args = {"affinity": W, "token_freq": A, "ep_size": 2, **kwargs}
    with pytest.raises(error, match=match):
        LayerProblem(**args)


def _placement(**changes) -> LayerPlacement:
    base = {
        "expert_to_device": np.array([0, 0, 1, 1]),
        "token_to_device": np.array([0, 1, 0]),
        "token_confidence": np.array([1.0, 1.0, 0.5]),
        "objective": 7.0, "local_rate": 0.875, "token_imbalance": 1.5,
        "seconds": 0.0, "seed": 0, "method": "test",
    }  # fmt: skip
    return LayerPlacement(**{**base, **changes})


def test_validate_catches_broken_placements() -> None:
    problem = LayerProblem(W, A, 2)
    _placement().validate(problem)
    with pytest.raises(InfeasibleError, match="experts per device"):
        _placement(expert_to_device=np.array([0, 0, 0, 1])).validate(problem)
    with pytest.raises(InfeasibleError, match="outside"):
        _placement(token_to_device=np.array([0, 2, 0])).validate(problem)
    with pytest.raises(MismatchError):
        _placement(token_to_device=np.array([0, 1])).validate(problem)
    with pytest.raises(InfeasibleError, match="confidence"):
        _placement(token_confidence=np.array([1.0, 2.0, 0.5])).validate(problem)
    with pytest.raises(InputError, match="integer device ids"):  # not truncated to [0, 0, 1, 1]
        _placement(expert_to_device=np.array([0.9, 0.2, 1.7, 1.99]))
    with pytest.raises(InputError, match="integer device ids"):
        _placement(token_to_device=np.array([0.5, 1.0, 0.0]))
    # all tokens on one device: load 4 <= capacity 2.2 + slack 2 is tolerated ...
    _placement(token_to_device=np.array([0, 0, 0])).validate(problem)
    # ... but with unit frequencies, 3 > 1.65 + 1 is not
    unit = LayerProblem(W, np.ones(3), 2)
    with pytest.raises(InfeasibleError, match="token load"):
        _placement(token_to_device=np.array([0, 0, 0])).validate(unit)


def test_select_tokens_scales_the_capacity() -> None:
    problem = LayerProblem(W, A, 2, token_ids=np.array([10, 11, 12]))
    sub = problem.select_tokens(problem.heaviest_rows(2))
    assert sub.num_tokens == 2 and sub.token_ids.tolist() == [10, 11]
    assert sub.capacity == pytest.approx(1.1 * 3 / 2)


def test_solver_config_validation() -> None:
    # one range for every command's --seed: solve took 2**64 and more, fit and split refused it
    for seed in (-1, 2**64, 2**100, True, 1.0):
        with pytest.raises(InputError, match=r"must be an integer in \[0, 2\*\*64\)"):
            SolverConfig(seed=seed)  # type: ignore[arg-type]
    assert SolverConfig(seed=2**64 - 1).seed == 2**64 - 1
    with pytest.raises(InputError):
        SolverConfig(time_limit=0)
    assert SolverConfig(options={"ceo": {"samples": 4}}).for_method("ceo") == {"samples": 4}

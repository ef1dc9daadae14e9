"""The shared argument checks: what counts as an integer or a real number."""

from __future__ import annotations

import numpy as np
import pytest

from planner._checks import is_finite_number, is_integer, is_real

NOT_NUMBERS = (True, np.bool_(True), "1", None, [1], 1j, np.complex64(1), np.complex128(1.5))


@pytest.mark.parametrize("value", (0, -3, np.int8(2), np.uint64(7)))
def test_integers(value):
    assert is_integer(value) and is_real(value)


@pytest.mark.parametrize("value", (0.5, float("nan"), np.float16(1), np.float64(-2.5)))
def test_reals_that_are_not_integers(value):
    assert is_real(value) and not is_integer(value)


@pytest.mark.parametrize("value", NOT_NUMBERS)
def test_bools_complex_and_others_are_neither(value):
    assert not is_integer(value) and not is_real(value) and not is_finite_number(value)


def test_finite_number_is_a_finite_real():
    assert is_finite_number(3) and is_finite_number(0.25)
    assert is_finite_number(np.float32(2.5)) and is_finite_number(np.uint64(7))
    assert not is_finite_number(np.float64("inf")) and not is_finite_number(np.float16("nan"))
    assert not is_finite_number(float("inf")) and not is_finite_number(float("nan"))


def test_sizes_given_as_bools_are_refused_by_the_apis(tmp_path):
    """A bool is an int to Python: batch_rows=True, vocab_size=True and embed_dim=True were
    each taken as 1."""
    from planner.errors import InputError
    from planner.predict.fit import FitConfig, fit_predictor
    from planner.predict.neural import NeuralConfig
    from planner.trace.ingest_sglang import convert_sglang

    with pytest.raises(InputError, match=r"batch_rows=True must be an integer in \[1, 2\*\*40\]"):
        fit_predictor(tmp_path / "none.parquet", FitConfig(batch_rows=True))
    with pytest.raises(InputError, match=r"batch_tokens=True must be an integer in \[1, 2\*\*40\]"):
        fit_predictor(tmp_path / "none.parquet", FitConfig(batch_tokens=True))
    with pytest.raises(InputError, match=r"neural embed_dim=True must be an integer in \[1, "):
        NeuralConfig(embed_dim=True)
    with pytest.raises(InputError, match="vocab_size=True must be a positive integer"):
        convert_sglang([tmp_path], vocab_size=True)

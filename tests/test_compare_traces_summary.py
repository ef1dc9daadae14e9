"""benchmarks/compare_traces.py: the summary's ``what_every_case_asks`` against figures worked
out by hand."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import load_script

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(scope="module")
def compare_traces():
    return load_script(BENCHMARKS / "compare_traces.py", "compare_traces")


def _case(ratio, ci):
    return {"ceo_over_best_baseline": ratio, "ceo_over_best_baseline_ci90": ci}


def test_two_cases_worked_by_hand(compare_traces):
    """Ratios 1.00 and 1.02 (mean 1.01, sd 0.01 sqrt 2), each interval implying a standard
    error of 0.01: the noise alone loses Phi(-1) a case, the spread 2 Phi(-1/sqrt 2), and
    fewer than half a loss over two cases needs a lead of z(3/4) = 0.6745 standard deviations."""
    half = 0.01 * compare_traces._Z90
    cases = [_case(1.00, [1.00 - half, 1.00 + half]), _case(1.02, [1.02 - half, 1.02 + half])]
    got = compare_traces.what_every_case_asks(cases)
    assert got["heldout_noise_sd"] == pytest.approx(0.01)
    assert got["losses_expected_from_noise"] == pytest.approx(2 * 0.158655, abs=1e-5)
    assert got["ratio_sd"] == pytest.approx(0.0141421, abs=1e-6)
    assert got["losses_expected_from_spread"] == pytest.approx(2 * 0.239750, abs=1e-5)
    assert got["lead_for_half_a_loss"] == pytest.approx(0.67449 * 0.0141421, abs=1e-6)


def test_one_case_or_no_interval_gives_none(compare_traces):
    """One case has no spread, and a case without an interval (its best baseline tied, or
    too few requests) adds no noise figure."""
    got = compare_traces.what_every_case_asks([_case(1.01, None)])
    assert got == {
        "ratio_sd": None,
        "heldout_noise_sd": None,
        "losses_expected_from_noise": None,
        "losses_expected_from_spread": None,
        "lead_for_half_a_loss": None,
    }
    got = compare_traces.what_every_case_asks([_case(1.01, None), _case(1.03, [1.0, 1.06])])
    assert got["heldout_noise_sd"] == pytest.approx(0.06 / (2 * compare_traces._Z90))
    assert got["ratio_sd"] == pytest.approx(0.0141421, abs=1e-6)


def test_a_fresh_split_needs_the_example_and_says_so_before_any_work(compare_traces):
    """Only the example's model can be profiled on the fresh prompts: any other source is
    one error before a trace is made."""
    from planner.errors import InputError

    with pytest.raises(InputError, match="--split fresh needs --sources example"):
        compare_traces.main(["--split", "fresh", "--sources", "flame,example"])

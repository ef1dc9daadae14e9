"""The chain polish: each layer revisited with the layers before and after it placed."""

from __future__ import annotations

import numpy as np
import pytest

from planner.cli.main import main
from planner.errors import InputError
from planner.predict.fit import FitConfig, fit_predictor
from planner.solve import plan as plan_module
from planner.solve.chain import LayerTerms, chain_polish
from planner.solve.effort import Effort
from planner.solve.expert_balance import expert_imbalance
from planner.solve.ngram_term import NgramTerm
from planner.solve.pipeline import PlanConfig, layer_problems, make_plan
from planner.solve.plan import solve_model
from planner.solve.problem import SolverConfig
from planner.solve.settle import deployed_rows, experts_kept
from planner.trace.synth import SynthConfig, synthesize

# Routing that follows the previous layer's experts, which an n-gram table can learn.
SYNTH = SynthConfig(
    num_layers=5, num_experts=8, top_k=2, vocab_size=300, num_tokens=3000, num_requests=30,
    affinity=0.5, layer_correlation=0.6, expert_zipf=0.0, num_domains=2, seed=5,
)  # fmt: skip


@pytest.fixture(scope="module")
def predictor(tmp_path_factory):
    d = tmp_path_factory.mktemp("chain")
    return fit_predictor(synthesize(SYNTH, d / "trace"), FitConfig()).predictor


@pytest.fixture(scope="module")
def solved(predictor):
    problems = layer_problems(predictor, 4)
    term = NgramTerm(predictor.transitions, order=2, weight=0.5)
    placements = solve_model(problems, "kmeans", SolverConfig(seed=0), progress=False,
                             ngram_term=term)  # fmt: skip
    return problems, term, placements


@pytest.fixture(scope="module")
def contiguous(solved):
    """(problems, term, the default deployment's placements, the run): chain gains left."""
    problems, term, _ = solved
    placements = solve_model(problems, "vanilla", SolverConfig(seed=0), progress=False,
                             ngram_term=term)  # fmt: skip
    return problems, term, placements, term.runs(len(problems))[0]


def chain_objective(problems, term, placements, run) -> float:
    x = np.stack([p.expert_to_device for p in placements]).astype(np.int64)
    total = 0.0
    for layer in run:
        parts = LayerTerms(problems, term, x, layer, run, batch_aware=False)
        total += parts.token_score(x[layer], placements[layer].token_to_device)
        total += parts.context_value(x[layer])
    return total


def swap_deltas_checked(parts: LayerTerms, x: np.ndarray, t: np.ndarray) -> int:
    """Asserts that every swap's delta is the change of the layer's chain terms; -> swaps."""
    a, b, delta = parts.swap_deltas(x, t)
    base = parts.total(x, t)
    for i in range(a.size):
        y = x.copy()
        y[a[i]], y[b[i]] = y[b[i]], y[a[i]]
        assert parts.total(y, t) - base == pytest.approx(delta[i], abs=1e-9)
    return a.size


@pytest.mark.parametrize("layer", [0, 2, 4])
def test_swap_deltas_are_exact(solved, layer):
    problems, term, placements = solved
    run = term.runs(len(problems))[0]
    x = np.stack([p.expert_to_device for p in placements]).astype(np.int64)
    parts = LayerTerms(problems, term, x, layer, run, batch_aware=False)
    # layer 0 has no context of its own and feeds layer 2; layer 4 the reverse
    assert (parts.rows is None) == (layer < 2)
    assert len(parts.forward) == {0: 1, 2: 2, 4: 0}[layer]
    # pairs of experts on different devices (2 per device)
    assert swap_deltas_checked(parts, x[layer], placements[layer].token_to_device) == 8 * 6 // 2


def test_polish_raises_the_chain_objective_and_keeps_placements_valid(contiguous):
    problems, term, placements, run = contiguous
    changed = chain_polish(problems, placements, term, run, batch_aware=False)
    assert changed, "contiguous placements leave chain gains on this routing"
    after = [changed.get(i, p) for i, p in enumerate(placements)]
    assert chain_objective(problems, term, after, run) > chain_objective(
        problems, term, placements, run
    )
    for layer, placement in changed.items():
        placement.validate(problems[layer])  # N/E experts per device, token cap
        assert placement.info["chain_polish"]["swaps"] >= 1
        assert placement.info["chain_polish"]["gain"] > 0
        assert placement.seconds >= placements[layer].seconds  # solver time kept
    # polishing the polished result again finds little or nothing more
    again = chain_polish(problems, after, term, run, batch_aware=False)
    gain = sum(p.info["chain_polish"]["gain"] for p in changed.values())
    regain = sum(p.info["chain_polish"]["gain"] - after[i].info["chain_polish"]["gain"]
                 for i, p in again.items())  # fmt: skip
    assert regain < 0.5 * gain


@pytest.mark.parametrize("layer", [0, 3])
def test_swap_deltas_count_the_deployed_groups_exactly(solved, layer):
    problems, term, placements = solved
    run = term.runs(len(problems))[0]
    x = np.stack([p.expert_to_device for p in placements]).astype(np.int64)
    reference = np.arange(8) % 4  # round-robin: unlike the solved placements
    rows = deployed_rows(reference, 4, 7.0)
    parts = LayerTerms(problems, term, x, layer, run, batch_aware=False, deployed=rows)
    plain = LayerTerms(problems, term, x, layer, run, batch_aware=False)
    assert parts.ngram_rows == plain.ngram_rows  # the n-gram rows first, the groups after
    # the groups' rows are worth 7 for each expert kept with its group
    kept = experts_kept(reference, x[layer])
    assert parts.context_value(x[layer]) - plain.context_value(x[layer]) == pytest.approx(7 * kept)
    assert parts.ngram_value(x[layer]) == pytest.approx(plain.context_value(x[layer]))
    swap_deltas_checked(parts, x[layer], placements[layer].token_to_device)


def test_polish_with_a_move_cost_pays_for_the_moves(contiguous):
    problems, term, placements, run = contiguous
    x = np.stack([p.expert_to_device for p in placements]).astype(np.int64)
    free = chain_polish(problems, placements, term, run, batch_aware=False)
    moved_free = sum(8 - experts_kept(x[i], p.expert_to_device) for i, p in free.items())
    assert moved_free > 0  # otherwise the test shows nothing
    # the deployed plan is the one polished: at cost 1 (a layer's whole LAR a move) nothing
    # moves; at a small cost fewer experts move than for free, and each kept count is reported
    held = chain_polish(problems, placements, term, run, batch_aware=False, reference=x,
                        move_cost=1.0)  # fmt: skip
    assert held == {}
    some = chain_polish(problems, placements, term, run, batch_aware=False, reference=x,
                        move_cost=0.002)  # fmt: skip
    moved = 0
    for layer, placement in some.items():
        kept = experts_kept(x[layer], placement.expert_to_device)
        assert placement.info["deployed_rows"] == {"experts_kept": kept}
        moved += 8 - kept
    assert moved <= moved_free


def test_plan_with_a_move_cost_and_the_chain_polish(predictor):
    ref = np.tile(np.arange(8) % 4, (SYNTH.num_layers, 1))
    moved = []
    for cost in (0.0, 1.0):
        config = PlanConfig("kmeans", ep_size=4, chain_passes=2, move_cost=cost)
        plan = make_plan(predictor, config, progress=False, reference=ref)
        moved.append(
            sum(8 - experts_kept(r, x) for r, x in zip(ref, plan.expert_to_device, strict=True))
        )
    assert moved[0] > 0
    assert moved[1] == 0


def test_polish_under_an_expert_cap_never_raises_a_layers_peak_above_it(contiguous):
    problems, term, placements, run = contiguous
    free = chain_polish(problems, placements, term, run, batch_aware=False)
    capped = chain_polish(problems, placements, term, run, batch_aware=False, expert_beta=1.1)
    assert capped
    before = {
        i: expert_imbalance(problems[i], p.expert_to_device) for i, p in enumerate(placements)
    }
    after = {i: expert_imbalance(problems[i], p.expert_to_device) for i, p in capped.items()}
    # unbounded, the polish loads some device beyond both the cap and where it started
    assert any(
        expert_imbalance(problems[i], p.expert_to_device) > max(1.1, before[i]) + 1e-6
        for i, p in free.items()
    )
    for i, imbalance in after.items():
        assert imbalance <= max(1.1, before[i]) + 1e-9
        assert capped[i].info["chain_polish"]["gain"] > 0


def test_swap_search_stops_when_its_work_budget_is_spent(contiguous):
    problems, term, placements, run = contiguous
    x = np.stack([p.expert_to_device for p in placements]).astype(np.int64)
    parts = LayerTerms(problems, term, x, 2, run, batch_aware=False)
    t = placements[2].token_to_device
    _, free = parts.swap_search(x[2], t)  # until no swap gains
    assert free >= 2
    meter = Effort(stop=1.0)  # spent by the first round: one swap, then stop
    _, cut = parts.swap_search(x[2], t, meter)
    assert cut == 1 and meter.spent > 1.0
    # the polish's own budget is counted the same way: a tiny one gives one swap per pass
    capped = chain_polish(problems, placements, term, run, batch_aware=False, passes=1,
                          layer_effort=1.0)  # fmt: skip
    assert capped and all(p.info["chain_polish"]["swaps"] == 1 for p in capped.values())


def test_runs_are_polished_in_worker_processes_with_the_same_result(predictor, monkeypatch):
    from planner.solve import ngram_term as term_module

    monkeypatch.setattr(term_module, "RUN_LAYERS", 3)  # two runs: layers 0-2 and 3-4
    problems = layer_problems(predictor, 4)
    term = NgramTerm(predictor.transitions, order=2, weight=0.5)
    assert term.runs(len(problems)) == [[0, 1, 2], [3, 4]]
    solved = {
        # contiguous placements (vanilla) leave chain gains in both runs
        jobs: solve_model(
            problems,
            "vanilla",
            SolverConfig(seed=0),
            progress=False,
            ngram_term=term,
            jobs=jobs,
            chain_passes=2,
        )  # fmt: skip
        for jobs in (1, 2)
    }
    assert {i for i, p in enumerate(solved[1]) if "chain_polish" in p.info} & {0, 1, 2}
    assert {i for i, p in enumerate(solved[1]) if "chain_polish" in p.info} & {3, 4}
    for one, two in zip(solved[1], solved[2], strict=True):
        np.testing.assert_array_equal(one.expert_to_device, two.expert_to_device)
        np.testing.assert_array_equal(one.token_to_device, two.token_to_device)
        assert one.info.get("chain_polish") == two.info.get("chain_polish")


def test_plan_runs_the_polish_when_asked_and_records_it(predictor, monkeypatch):
    calls = []

    def spy(problems, placements, term, run, *, passes, **kwargs):
        calls.append((tuple(run), passes))
        return chain_polish(problems, placements, term, run, passes=passes, **kwargs)

    monkeypatch.setattr(plan_module, "chain_polish", spy)
    plain = make_plan(predictor, PlanConfig(method="kmeans", ep_size=4), progress=False)
    assert calls == [] and plain.config["chain_passes"] == 0
    polished = make_plan(predictor, PlanConfig(method="kmeans", ep_size=4, chain_passes=2),
                         progress=False)  # fmt: skip
    assert calls == [((0, 1, 2, 3, 4), 2)] and polished.config["chain_passes"] == 2
    # the default deployment is not polished, even when compare gives every method passes
    make_plan(predictor, PlanConfig(method="vanilla", ep_size=4, chain_passes=2), progress=False)
    assert len(calls) == 1


def test_bad_passes_are_one_line_errors(predictor, tmp_path, capsys):
    with pytest.raises(InputError, match="chain_passes"):
        PlanConfig(chain_passes=-1)
    with pytest.raises(InputError, match="n-gram term"):
        PlanConfig(chain_passes=2, ngram_weight=0.0)
    predictor.save(tmp_path / "pred")
    args = ["solve", str(tmp_path / "pred"), "--ep", "4", "--out", str(tmp_path / "plan")]
    assert main([*args, "--chain-passes", "11"]) == 2
    err = capsys.readouterr().err
    assert "chain_passes" in err and "Traceback" not in err
    assert not (tmp_path / "plan").exists()
    assert main([*args, "--method", "kmeans", "--chain-passes", "1", "--json"]) == 0
    assert "chain_passes" in (tmp_path / "plan" / "plan.json").read_text()

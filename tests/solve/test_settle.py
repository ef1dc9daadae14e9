"""Re-planning with a move cost: the deployed plan's groups as load-free rows (planner.solve.settle)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from planner.cli.main import main
from planner.errors import InputError, MismatchError
from planner.predict.fit import FitConfig, fit_predictor
from planner.solve.align import align_plan, experts_moved
from planner.solve.common import device_gains, finish, net_objective
from planner.solve.expert_balance import expert_imbalance
from planner.solve.pipeline import PlanConfig, make_plan
from planner.solve.plan import solve_model
from planner.solve.problem import SolverConfig
from planner.solve.settle import with_deployed, without_deployed
from planner.trace.synth import SynthConfig, synthesize
from tests.solve.instances import random_problem

SYNTH = SynthConfig(
    num_layers=3, num_experts=8, top_k=2, vocab_size=300, num_tokens=4000, num_requests=40,
    affinity=0.8, layer_correlation=0.5, num_domains=2, seed=5,
)  # fmt: skip


FAST = {"ceo": {"effort": 3e5}}  # CEO's work budget per layer (default 7.5M): a test's


def test_rows_are_load_free_and_worth_the_experts_kept_with_their_group():
    problem = random_problem(60, 8, 4, seed=1, clusters=4)
    reference = np.array([3, 3, 0, 0, 1, 1, 2, 2])
    extended = with_deployed(problem, reference, 10.0)
    assert extended.num_tokens == problem.num_tokens + 4
    assert extended.capacity == problem.capacity  # no load
    assert (extended.occurrences[-4:] == 0).all()  # no run-time occurrences either
    # the deployed groups, renamed (a rotation of the labels), keep all 8 experts
    renamed = (reference + 1) % 4
    gain = device_gains(extended, renamed)
    assert gain[-4:].max(axis=1).sum() == pytest.approx(80.0)
    # one swap across groups: 6 experts kept
    swapped = renamed.copy()
    swapped[[0, 2]] = swapped[[2, 0]]
    assert device_gains(extended, swapped)[-4:].max(axis=1).sum() == pytest.approx(60.0)


def test_without_deployed_reports_on_the_token_rows():
    problem = random_problem(60, 8, 4, seed=2, clusters=4)
    reference = np.repeat(np.arange(4), 2)
    extended = with_deployed(problem, reference, 5.0)
    placement = finish(extended, "test", reference, seed=0, started=0.0)
    plain = without_deployed(problem, placement, reference)
    direct = finish(problem, "test", reference, seed=0, started=0.0,
                    token_to_device=placement.token_to_device[: problem.num_tokens])  # fmt: skip
    assert plain.objective == pytest.approx(direct.objective)
    assert plain.local_rate == pytest.approx(direct.local_rate)
    assert plain.info["deployed_rows"] == {"experts_kept": 8}
    assert plain.token_to_device.shape == (problem.num_tokens,)


@pytest.mark.parametrize("method, seed", [("metis", 4), ("alternating", 1)])
def test_no_layer_moves_experts_for_less_than_they_cost(method, seed):
    """METIS' partitions and alternating's iterations regroup by their own rules: they
    returned layers that moved experts for less LAR than the move cost asked, scoring below
    the deployed placement on the very objective they were given (both fail on these
    instances without the check). A layer now moves only where that pays."""
    problems = [
        random_problem(120, 16, 4, seed=10 * seed + s, clusters=4, noise=0.3) for s in (0, 1)
    ]
    rng = np.random.default_rng(seed)
    reference = np.stack([rng.permutation(np.arange(16) % 4) for _ in range(2)])
    cost = 0.03
    config = SolverConfig(seed=0)
    placed = solve_model(problems, method, config, progress=False, reference=reference,
                         move_cost=cost)  # fmt: skip
    kept = []
    for problem, placement, ref in zip(problems, placed, reference, strict=True):
        extended = with_deployed(problem, ref, cost * problem.total_activations)
        score = {}
        for name, x in (("plan", placement.expert_to_device), ("deployed", ref)):
            t = finish(extended, "x", x, seed=0, started=0.0).token_to_device
            score[name] = net_objective(extended, device_gains(extended, x), t)
        assert score["plan"] >= score["deployed"] - 1e-9 * abs(score["deployed"])
        kept.append(placement.info["kept_deployed"])
    assert any(kept)  # the check decided somewhere: the test shows something


@pytest.mark.parametrize("method", ["ceo", "metis", "kmeans", "alternating", "ilp"])
def test_a_high_move_cost_keeps_every_group_and_none_changes_nothing(method):
    problems = [random_problem(24, 8, 4, seed=s, clusters=4, noise=0.2) for s in range(2)]
    config = SolverConfig(seed=0, time_limit=20, options={"ceo": {"effort": 2e5}})
    free = solve_model(problems, method, config, progress=False)
    # a deployed plan unlike what the solver finds: experts dealt round-robin
    reference = np.tile(np.arange(8) % 4, (2, 1))
    moved_free = experts_moved(np.stack([p.expert_to_device for p in free]), reference)
    assert moved_free.sum() > 0  # otherwise the test shows nothing
    kept = solve_model(problems, method, config, progress=False, reference=reference, move_cost=1.0)
    for p, ref in zip(kept, reference, strict=True):
        # the same grouping as deployed: a relabelling of the reference
        pairs = set(zip(p.expert_to_device.tolist(), ref.tolist(), strict=True))
        assert len(pairs) == 4, (method, p.expert_to_device, ref)
        assert p.token_to_device.shape == (24,)
        assert p.info["deployed_rows"]["experts_kept"] == 8
    # move cost 0: the reference is not used at all
    zero = solve_model(problems, method, config, progress=False, reference=reference)
    for a, b in zip(free, zero, strict=True):
        np.testing.assert_array_equal(a.expert_to_device, b.expert_to_device)


@pytest.fixture(scope="module")
def predictor(tmp_path_factory):
    d = tmp_path_factory.mktemp("settle")
    return fit_predictor(synthesize(SYNTH, d / "trace"), FitConfig()).predictor


def test_plan_moves_fewer_experts_as_the_cost_rises(predictor):
    deployed = make_plan(predictor, PlanConfig("kmeans", ep_size=4, seed=1), progress=False)
    # deployed: experts dealt round-robin, unlike what the solvers find
    ref = np.tile(np.arange(8) % 4, (3, 1))
    moved = []
    for cost in (0.0, 0.01, 1.0):
        plan = make_plan(
            predictor, PlanConfig("ceo", ep_size=4, seed=2, move_cost=cost, options=FAST),
            progress=False, reference=ref,
        )  # fmt: skip
        plan = align_plan(plan, ref, deployed.fingerprint)
        moved.append(plan.config["aligned"]["experts_moved"])
        assert plan.config["move_cost"] == cost
        # the n-gram tables are fitted on the final placement, as in any plan
        assert plan.ngram_to_device is not None
    assert moved[2] == 0
    assert moved[0] >= moved[1] >= moved[2]
    assert moved[0] > 0


def test_move_cost_is_refused_where_it_cannot_apply(predictor):
    ref = np.zeros((3, 8), np.int64)
    with pytest.raises(InputError, match="needs the deployed plan"):
        make_plan(predictor, PlanConfig(ep_size=4, move_cost=0.01), progress=False)
    with pytest.raises(MismatchError, match="shape"):
        make_plan(predictor, PlanConfig(ep_size=4, move_cost=0.01), progress=False,
                  reference=ref[:2])  # fmt: skip
    with pytest.raises(MismatchError, match="not one of EP 4"):
        make_plan(predictor, PlanConfig(ep_size=4, move_cost=0.01), progress=False,
                  reference=ref + 7)  # fmt: skip
    with pytest.raises(InputError, match="vanilla"):
        PlanConfig("vanilla", ep_size=4, move_cost=0.01)
    for bad in (-0.1, 2.0, float("nan")):
        with pytest.raises(InputError, match="move_cost"):
            PlanConfig(ep_size=4, move_cost=bad)


def test_cli_move_cost(tmp_path, capsys):
    trace = synthesize(SYNTH, tmp_path / "trace")
    pred, old, new = tmp_path / "pred", tmp_path / "old", tmp_path / "new"
    assert main(["fit", str(trace), "--out", str(pred), "--json"]) == 0
    solve = ["solve", str(pred), "--ep", "4", "--json", "--method", "kmeans"]
    assert main([*solve, "--out", str(old), "--seed", "3"]) == 0
    capsys.readouterr()
    assert main([*solve, "--out", str(new), "--move-cost", "0.01"]) == 2
    assert "needs --align-to" in capsys.readouterr().err
    assert not new.exists()
    args = [*solve, "--out", str(new), "--align-to", str(old), "--move-cost", "1"]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["aligned"]["experts_moved"] == 0
    saved = json.loads((new / "plan.json").read_text())
    assert saved["config"]["move_cost"] == 1.0


def test_solve_model_checks_the_reference_and_the_cost():
    problems = [random_problem(24, 8, 4, seed=s) for s in range(2)]
    ref = np.tile(np.arange(8) % 4, (2, 1))
    with pytest.raises(InputError, match="needs the deployed plan"):
        solve_model(problems, "kmeans", progress=False, move_cost=0.5)
    with pytest.raises(InputError, match="move_cost"):
        solve_model(problems, "kmeans", progress=False, reference=ref, move_cost=-1.0)
    for bad in (ref[:1], ref[:, :6]):
        with pytest.raises(MismatchError, match="shape"):
            solve_model(problems, "kmeans", progress=False, reference=bad, move_cost=0.5)
    with pytest.raises(MismatchError, match="not one of EP 4"):
        solve_model(problems, "kmeans", progress=False, reference=ref + 4, move_cost=0.5)


def test_a_layer_without_token_load_keeps_the_deployed_placement():
    loaded = random_problem(24, 8, 4, seed=0)
    empty = loaded.with_options(token_freq=np.zeros(24))
    ref = np.tile(np.arange(8) % 4, (2, 1))
    placed = solve_model([loaded, empty], "kmeans", progress=False, reference=ref, move_cost=0.5)
    np.testing.assert_array_equal(placed[1].expert_to_device, ref[1])
    assert placed[1].info["deployed_rows"] == {"experts_kept": 8}


def test_a_config_files_move_cost_stands_down_where_it_cannot_apply(tmp_path, capsys):
    trace = synthesize(SYNTH, tmp_path / "trace")
    pred, old = tmp_path / "pred", tmp_path / "old"
    assert main(["fit", str(trace), "--out", str(pred), "--json"]) == 0
    solve = ["solve", str(pred), "--ep", "4", "--json"]
    assert main([*solve, "--method", "vanilla", "--out", str(old)]) == 0
    config = tmp_path / "nightly.toml"
    config.write_text(f'[solve]\nalign-to = "{old}"\nmove-cost = 0.01\n')
    # vanilla: the contiguous layout, whatever the file says
    assert main(["--config", str(config), *solve, "--method", "vanilla",
                 "--out", str(tmp_path / "v")]) == 0  # fmt: skip
    assert json.loads((tmp_path / "v" / "plan.json").read_text())["config"]["move_cost"] == 0
    config.write_text("[solve]\nmove-cost = 0.01\n")  # no deployed plan named: a plain solve
    assert main(["--config", str(config), *solve, "--method", "kmeans",
                 "--out", str(tmp_path / "k")]) == 0  # fmt: skip
    capsys.readouterr()
    assert main([*solve, "--out", str(tmp_path / "x"), "--move-cost", "-1"]) == 2
    assert "[0, 1]" in capsys.readouterr().err
    assert main([*solve, "--method", "vanilla", "--out", str(tmp_path / "x"),
                 "--align-to", str(old), "--move-cost", "0.01"]) == 2  # fmt: skip
    assert "does not apply to --method vanilla" in capsys.readouterr().err


def test_the_deployed_placement_is_not_kept_where_it_breaks_the_expert_load_cap():
    """Keeping the deployed placement where the method's answer scores no higher must not
    undo --expert-beta: a deployed layer that crowds its hot experts on one device stays
    moved, however high the move cost."""
    problems = [random_problem(120, 16, 4, seed=s, zipf=1.5) for s in (0, 1)]
    # the deployed plan: the four hottest experts of each layer together on device 0
    reference = np.stack([np.argsort(np.argsort(-p.expert_load)) // 4 for p in problems])
    config = SolverConfig(seed=0, expert_beta=1.2)
    placed = solve_model(problems, "kmeans", config, progress=False, reference=reference,
                         move_cost=1.0)  # fmt: skip
    for problem, placement, ref in zip(problems, placed, reference, strict=True):
        assert expert_imbalance(problem, ref) > 1.5
        assert expert_imbalance(problem, placement.expert_to_device) <= max(
            1.2 * (1 + 1e-6), placement.info["expert_balance"]["imbalance_after"] + 1e-9
        )
        assert not placement.info["kept_deployed"]

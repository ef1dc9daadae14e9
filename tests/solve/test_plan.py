"""Whole-model solving and the Plan artifact."""

from __future__ import annotations

import json
import os
import re
import signal
import time

import numpy as np
import pytest

from planner.errors import InputError, MismatchError, SchemaError
from planner.solve.ceo import DEFAULT_EFFORT, MAX_LAYER_EFFORT, model_layer_effort
from planner.solve.plan import Plan, _worker_pool, layer_seed, solve_model
from planner.solve.problem import SolverConfig
from tests.solve.instances import random_problem


def test_layers_get_distinct_reproducible_seeds() -> None:
    seeds = [layer_seed(7, layer) for layer in range(5)]
    assert len(set(seeds)) == 5
    assert seeds == [layer_seed(7, layer) for layer in range(5)]
    assert layer_seed(8, 0) != seeds[0]


def test_parallel_solve_matches_serial() -> None:
    # CEO's budget counts work, not seconds: where it cuts the search (here, every layer),
    # processes sharing the cores cut it at the same point
    problems = [random_problem(300, 16, 4, seed=s, layer=s) for s in range(3)]
    config = SolverConfig(seed=3, options={"ceo": {"effort": 2e5}})
    serial = solve_model(problems, "ceo", config, jobs=1, progress=False)
    parallel = solve_model(problems, "ceo", config, jobs=2, progress=False)
    assert all(p.info["search_cut_by_budget"] for p in serial)
    for a, b in zip(serial, parallel, strict=True):
        np.testing.assert_array_equal(a.expert_to_device, b.expert_to_device)
        np.testing.assert_array_equal(a.token_to_device, b.token_to_device)
        assert a.seed == b.seed
    assert len({p.seed for p in serial}) == 3


def test_workers_get_their_share_of_blas_threads(monkeypatch) -> None:
    # idle OpenBLAS threads spin: workers sharing the cores must not each start one per core
    monkeypatch.delenv("OPENBLAS_NUM_THREADS", raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # the user's choice is kept
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    with _worker_pool(2) as pool:
        seen = pool.submit(os.getenv, "OPENBLAS_NUM_THREADS").result()
        user = pool.submit(os.getenv, "OMP_NUM_THREADS").result()
    assert (seen, user) == ("1", "3")
    assert "OPENBLAS_NUM_THREADS" not in os.environ  # only the workers saw it
    assert os.environ["OMP_NUM_THREADS"] == "3"


def test_workers_ignore_ctrl_c_and_are_stopped_with_the_pool() -> None:
    # Ctrl-C reaches the whole process group: the workers leave it to this process (their
    # own KeyboardInterrupts printed tracebacks), which stops them at once on its way out
    # (leaving the block normally would first solve every queued layer)
    started = time.perf_counter()
    with pytest.raises(KeyboardInterrupt), _worker_pool(2) as pool:
        assert pool.submit(signal.getsignal, signal.SIGINT).result() == signal.SIG_IGN
        for _ in range(4):
            pool.submit(time.sleep, 60)
        workers = list(pool._processes.values())
        raise KeyboardInterrupt
    assert time.perf_counter() - started < 30
    # the pool's own thread may reap a worker while this one looks: allow it a moment
    while any(w.is_alive() for w in workers) and time.perf_counter() - started < 30:
        time.sleep(0.1)
    assert workers and not any(w.is_alive() for w in workers)


def test_model_budget_is_shared_over_layers() -> None:
    # a whole model's default CEO budget: 58 x 5M units, at most 7.5M and at least 5M a layer
    assert model_layer_effort(6) == MAX_LAYER_EFFORT == 1.5 * DEFAULT_EFFORT
    assert model_layer_effort(58) == DEFAULT_EFFORT == model_layer_effort(94)
    assert model_layer_effort(48) == pytest.approx(58 * DEFAULT_EFFORT / 48)
    problems = [random_problem(60, 8, 2, seed=s, layer=s) for s in range(2)]
    default = solve_model(problems, "ceo", SolverConfig(seed=1), progress=False)
    assert [p.info["effort_budget"] for p in default] == [round(MAX_LAYER_EFFORT)] * 2
    given = SolverConfig(seed=1, options={"ceo": {"effort": 1e5, "screen": 3}})
    chosen = solve_model(problems, "ceo", given, progress=False)
    assert [p.info["effort_budget"] for p in chosen] == [100000] * 2
    assert given.options == {"ceo": {"effort": 1e5, "screen": 3}}  # the caller's is untouched


def test_solve_model_rejects_unknown_method_and_jobs() -> None:
    with pytest.raises(InputError, match="unknown solver"):
        solve_model([random_problem(10, 4, 2)], "nope", progress=False)
    with pytest.raises(InputError, match="jobs"):
        solve_model([random_problem(10, 4, 2)], "vanilla", jobs=0, progress=False)


def _plan(**changes) -> Plan:
    rng = np.random.default_rng(0)
    layers, n, v, e = 2, 8, 20, 4
    base = {
        "model": {"model": "test/tiny", "num_layers": layers, "num_experts": n, "top_k": 2, "vocab_size": v},
        "fingerprint": "0123456789abcdef",
        "ep_size": e, "method": "ceo", "seed": 0, "config": {"seed": 0},
        "expert_to_device": np.stack([rng.permutation(np.arange(n) // 2) for _ in range(layers)]),
        "token_to_device": rng.integers(0, e, (layers, v)),
        "token_confidence": rng.random((layers, v)),
        "reports": [{"method": "ceo"}, {"method": "ceo"}],
    }  # fmt: skip
    return Plan(**{**base, **changes})


def test_plan_round_trip(tmp_path) -> None:
    plan = _plan(
        ngram_order=2, ngram_to_device=np.zeros((2, 16), int), ngram_confidence=np.zeros((2, 16))
    )
    path = plan.save(tmp_path / "plan")
    loaded = Plan.load(path)
    for name in ("expert_to_device", "token_to_device", "token_confidence", "ngram_to_device"):
        np.testing.assert_array_equal(getattr(loaded, name), getattr(plan, name))
    assert loaded.token_to_device.dtype == np.int16 and loaded.token_confidence.dtype == np.float16
    assert loaded.model == plan.model and loaded.reports == plan.reports
    meta = json.loads((path / "plan.json").read_text())
    assert meta["format"] == "moeplan-plan" and meta["format_version"] == 1
    loaded.check_model("0123456789abcdef")
    with pytest.raises(MismatchError):
        loaded.check_model("ffffffffffffffff")


def test_plan_rejects_bad_tables(tmp_path) -> None:
    with pytest.raises(SchemaError, match="experts per device"):
        _plan(expert_to_device=np.zeros((2, 8), int))
    with pytest.raises(SchemaError, match="shape"):
        _plan(token_to_device=np.zeros((2, 19), int))
    path = _plan().save(tmp_path / "plan")
    meta = json.loads((path / "plan.json").read_text())
    meta["format_version"] = 2
    (path / "plan.json").write_text(json.dumps(meta))
    with pytest.raises(SchemaError, match="format_version"):
        Plan.load(path)
    with pytest.raises(InputError, match="not a plan"):
        Plan.load(tmp_path)


def test_plan_refuses_tables_a_runtime_would_misread() -> None:
    # a float device table was truncated to int16 and accepted
    x = _plan().expert_to_device.astype(np.float64)
    with pytest.raises(SchemaError, match="dtype float64, expected integers"):
        _plan(expert_to_device=x + 0.5)
    with pytest.raises(SchemaError, match="ngram_order=-1"):
        _plan(ngram_order=-1)
    with pytest.raises(SchemaError, match="ngram_to_device holds devices outside"):
        _plan(ngram_order=1, ngram_to_device=np.full((2, 4), 4), ngram_confidence=np.zeros((2, 4)))
    with pytest.raises(SchemaError, match="ngram_confidence outside"):
        _plan(
            ngram_order=1,
            ngram_to_device=np.zeros((2, 4), int),
            ngram_confidence=np.full((2, 4), 2.0),
        )
    with pytest.raises(SchemaError, match="layer report must be a JSON object"):
        _plan(reports=[1, 2])
    # complex confidences were cast to float16 with a ComplexWarning, the plan accepted
    c = _plan().token_confidence.astype(np.complex128)
    with pytest.raises(SchemaError, match="token_confidence outside"):
        _plan(token_confidence=c + 0.5j)
    with pytest.raises(SchemaError, match="token_confidence outside"):
        _plan(token_confidence=c)
    with pytest.raises(SchemaError, match="ngram_confidence outside"):
        _plan(
            ngram_order=1,
            ngram_to_device=np.zeros((2, 4), int),
            ngram_confidence=np.zeros((2, 4), np.complex64),
        )


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda m: m.pop("fingerprint"), "fingerprint must be a string (missing)"),
        (lambda m: m.update(ep_size="4"), "ep_size must be an integer ('4')"),
        (lambda m: m.update(seed=True), "seed must be an integer >= 0 (True)"),
        (lambda m: m.update(config=[]), "config must be a JSON object"),
    ],
)
def test_plan_load_checks_plan_json_fields(tmp_path, edit, message) -> None:
    path = _plan().save(tmp_path / "plan")
    meta = json.loads((path / "plan.json").read_text())
    edit(meta)
    (path / "plan.json").write_text(json.dumps(meta))
    with pytest.raises(SchemaError, match=re.escape(message)):
        Plan.load(path)


def test_plan_load_refuses_a_garbled_table_archive(tmp_path) -> None:
    path = _plan().save(tmp_path / "plan")
    (path / "tables.npz").write_bytes(b"not a zip archive")
    with pytest.raises(SchemaError, match="not a readable table archive"):
        Plan.load(path)


def test_plan_load_refuses_damaged_compressed_tables_and_a_bare_npy(tmp_path) -> None:
    """Bytes flipped inside the compressed tables were a zlib.error traceback; a .npy saved
    as tables.npz a TypeError."""
    path = _plan().save(tmp_path / "plan")
    data = bytearray((path / "tables.npz").read_bytes())
    for i in range(100, min(140, len(data) - 40)):
        data[i] ^= 0x5A
    (path / "tables.npz").write_bytes(bytes(data))
    with pytest.raises(SchemaError, match="not a readable table archive"):
        Plan.load(path)
    with open(path / "tables.npz", "wb") as f:
        np.save(f, np.zeros(3))
    with pytest.raises(SchemaError, match=r"not a readable table archive \(not an .npz file\)"):
        Plan.load(path)


def test_plan_load_refuses_a_negative_seed(tmp_path) -> None:
    path = _plan().save(tmp_path / "plan")
    meta = json.loads((path / "plan.json").read_text())
    meta["seed"] = -5  # solve --seed -1 is refused; so is a plan claiming one
    (path / "plan.json").write_text(json.dumps(meta))
    with pytest.raises(SchemaError, match="seed must be an integer >= 0"):
        Plan.load(path)

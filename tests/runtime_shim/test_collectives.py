"""SRS / SAG on a real 4-process gloo group against all_reduce / all_gather references."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from planner.errors import InputError
from planner.runtime_shim.collectives import shuffled_reduce_scatter
from tests.conftest import child_env

WORKER = Path(__file__).with_name("_dist_worker.py")
CASE_NAMES = [
    "random_fp32",
    "empty_device_fp32",
    "one_device_gets_all",
    "fixed_chunk_rows",
    "bf16",
    "all_reduce_fallback",
    "native_reduce_scatter",
    "single_token",
    "verify_devices_mismatch",
    "sag_as_bytes",
]
HANG_TIMEOUT_S = 120  # generous for a loaded 2-core machine; the worker takes ~10 s


@pytest.fixture(scope="module")
def rank_results(tmp_path_factory) -> list[dict[str, str]]:
    out = tmp_path_factory.mktemp("dist")
    env = child_env(MASTER_ADDR="127.0.0.1", OMP_NUM_THREADS="1")
    proc = subprocess.Popen(
        [sys.executable, str(WORKER), str(out)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # so a hang can be killed with all four ranks
    )
    try:
        log, _ = proc.communicate(timeout=HANG_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"distributed worker hung for more than {HANG_TIMEOUT_S} s")
    assert proc.returncode == 0, f"worker failed (rc={proc.returncode}):\n{log[-4000:]}"
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]


@pytest.mark.parametrize("case", CASE_NAMES)
def test_srs_sag_match_reference_on_every_rank(rank_results, case):
    for rank, results in enumerate(rank_results):
        assert results.get(case) == "ok", f"rank {rank}, case {case}:\n{results.get(case)}"


def test_every_case_ran(rank_results):
    assert all(set(r) == set(CASE_NAMES) for r in rank_results)


def test_needs_initialized_process_group():
    with pytest.raises(InputError, match="not initialized"):
        shuffled_reduce_scatter(torch.zeros(2, 2), torch.tensor([0, 1]))


def test_meta_tensors_are_refused_before_any_collective():
    from planner.runtime_shim.collectives import shuffled_all_gather
    from planner.runtime_shim.rebatch import plan_rebatch

    with pytest.raises(InputError, match="x is on the meta device"):
        shuffled_reduce_scatter(torch.empty((2, 3), device="meta"), torch.tensor([0, 0]))
    info = plan_rebatch(torch.tensor([0, 0]), 1)
    with pytest.raises(InputError, match="local_rows is on the meta device"):
        shuffled_all_gather(torch.empty((2, 3), device="meta"), info)


def test_arguments_of_the_wrong_type_are_one_line_errors():
    from planner.runtime_shim.collectives import shuffled_all_gather

    # both were AttributeErrors ('NoneType' object has no attribute 'ep_size', ...)
    with pytest.raises(InputError, match="info must be the RebatchInfo"):
        shuffled_all_gather(torch.zeros((2, 3)), None)
    with pytest.raises(InputError, match="x must be a torch.Tensor, got ndarray"):
        shuffled_reduce_scatter(torch.zeros((2, 3)).numpy(), torch.tensor([0, 0]))


def test_tensors_that_require_grad_are_refused_before_any_collective():
    # SRS's output carried a CopyBackwards graph that gave each rank only its own chunk's
    # gradient (a silently wrong x.grad on 2 gloo ranks); SAG raised torch's RuntimeError
    # "A view was created in no_grad mode ...". Neither has a backward.
    from planner.runtime_shim.collectives import shuffled_all_gather
    from planner.runtime_shim.rebatch import plan_rebatch

    x = torch.zeros((2, 3), requires_grad=True)
    with pytest.raises(InputError, match="x requires grad but shuffled_reduce_scatter has no"):
        shuffled_reduce_scatter(x, torch.tensor([0, 0]))
    info = plan_rebatch(torch.tensor([0, 0]), 1)
    with pytest.raises(InputError, match="local_rows requires grad but shuffled_all_gather"):
        shuffled_all_gather(x * 2, info)
    with torch.no_grad():  # no graph recorded: allowed (here: no process group)
        with pytest.raises(InputError, match="not initialized"):
            shuffled_reduce_scatter(x, torch.tensor([0, 0]))
        with pytest.raises(InputError, match="not initialized"):
            shuffled_all_gather(x, info)


@pytest.mark.parametrize(
    ("name", "device", "want"),
    [
        ("gloo", "cpu", "gloo"),
        ("cpu:gloo", "cpu", "gloo"),
        ("cpu:gloo,cuda:nccl", "cpu", "gloo"),  # the default on a CUDA build
        ("cpu:gloo,cuda:nccl", "cuda", "nccl"),
        ("undefined", "cpu", "gloo"),  # init_process_group() without a backend
        ("nccl", "cuda", "nccl"),
    ],
)
def test_fp8_refusal_finds_gloo_under_every_backend_name(monkeypatch, name, device, want):
    # the fp8 refusal tested the name "gloo" alone, so 'cpu:gloo' and 'undefined' groups
    # reached gloo's own 'Invalid scalar type'
    from planner.runtime_shim import collectives

    monkeypatch.setattr(collectives.dist, "get_backend", lambda group=None: name)
    on = type("OnDevice", (), {"device": torch.device(device)})()  # no CUDA needed
    assert collectives._backend_for(on, None) == want

"""The Triton row-gather kernel: interpreter checks on CPU, compiled checks on a GPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from planner.errors import InputError
from planner.runtime_shim import kernels
from planner.runtime_shim.rebatch import _use_triton, rebatch, resume
from tests.conftest import child_env

WORKER = Path(__file__).with_name("_interpret_worker.py")
INTERPRETER_CASES = [
    f"{kind}_{dt}"
    for dt in ("fp32", "bf16", "fp16")
    for kind in ("direct", "random", "empty_groups", "one_device_all")
] + ["single_row_fp32", "fp8_e4m3", "fp8_e5m2", "validation"]

needs_triton = pytest.mark.skipif(not kernels.HAS_TRITON, reason="triton is not installed")


@pytest.fixture(scope="module")
def interpreter_results(tmp_path_factory) -> dict[str, str]:
    out = tmp_path_factory.mktemp("interp") / "results.json"
    env = child_env(TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, str(WORKER), str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, f"interpreter worker failed:\n{proc.stderr[-4000:]}"
    return json.loads(out.read_text())


@needs_triton
@pytest.mark.parametrize("case", INTERPRETER_CASES)
def test_kernel_in_interpreter(interpreter_results, case):
    assert interpreter_results.get(case) == "ok", f"{case}:\n{interpreter_results.get(case)}"


@needs_triton
def test_interpreter_ran_every_case(interpreter_results):
    assert set(interpreter_results) == set(INTERPRETER_CASES)


@pytest.mark.skipif(kernels.INTERPRETED, reason="CPU tensors are allowed under the interpreter")
def test_kernel_refuses_cpu_tensors_when_compiled():
    with pytest.raises(InputError, match="CUDA|triton"):
        kernels.gather_rows(torch.zeros(3, 2), torch.tensor([0, 1]))


@pytest.mark.parametrize(
    ("rows", "cols", "bad"),
    [(None, 6, "block_cols"), (None, 2.0, "block_cols"), (2.0, None, "block_rows"),
     (True, None, "block_rows"), (0, None, "block_rows")],
)  # fmt: skip
def test_launch_tile_refuses_what_is_not_a_power_of_two(rows, cols, bad):
    with pytest.raises(InputError, match=f"^{bad} must be a power of two, got "):
        kernels.launch_tile(100, block_rows=rows, block_cols=cols)
    assert kernels.launch_tile(100) == (kernels.DEFAULT_BLOCK_ELEMS // 128, 128)
    assert kernels.launch_tile(100, 4, 8) == (4, 8)


def test_explicit_triton_backend_on_cpu_is_an_input_error():
    if kernels.INTERPRETED:
        pytest.skip("CPU tensors are allowed under the interpreter")
    with pytest.raises(InputError, match="needs CUDA tensors"):
        rebatch(torch.zeros(3, 2), torch.tensor([0, 1, 0]), 2, backend="triton")


@needs_triton
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize(("tokens", "hidden"), [(1, 7), (1037, 1029), (4099, 4096)])
def test_kernel_matches_torch_on_gpu(dtype, tokens, hidden):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn((tokens, hidden), device="cuda", generator=g).to(dtype)
    devices = torch.randint(0, 8, (tokens,), device="cuda", generator=g)
    devices[devices == 3] = 5  # one empty device group
    want, info = rebatch(x, devices, 8, backend="torch")
    # the kernel itself (auto fell back to torch's gather silently, and both sides were torch)
    got, info_t = rebatch(x, devices, 8, backend="triton")
    assert _use_triton(x, "auto")  # and auto takes it for these rows
    bits = torch.uint8  # fp8 has no equal; bits are what the kernel moves
    assert torch.equal(got.view(bits), want.view(bits))
    assert torch.equal(resume(got, info_t, backend="triton").view(bits), x.view(bits))

"""rebatch / resume on the torch path: worked example, invariants, errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from planner.errors import InputError
from planner.runtime_shim.rebatch import RebatchInfo, apply_rebatch, plan_rebatch, rebatch, resume


def test_worked_example_from_the_docstring():
    x = torch.arange(12.0).reshape(3, 4)
    shuffled, info = rebatch(x, torch.tensor([1, 0, 1]), 2)
    assert info.slot_to_token.tolist() == [1, -1, 0, 2]
    assert info.token_to_slot.tolist() == [2, 0, 3]
    assert info.counts.tolist() == [1, 2]
    assert (info.chunk_rows, info.padded_rows, info.ep_size, info.num_tokens) == (2, 4, 2, 3)
    want = torch.stack([x[1], torch.zeros(4), x[0], x[2]])
    assert torch.equal(shuffled, want)
    assert torch.equal(resume(shuffled, info), x)
    assert info.chunk_tokens(1).tolist() == [0, 2]


def expected_layout(x: torch.Tensor, devices: list[int], ep: int, chunk: int) -> torch.Tensor:
    """Independent reference: Python loop over devices, stable order, zero padding."""
    out = torch.zeros((ep * chunk, x.shape[1]), dtype=x.dtype)
    for d in range(ep):
        rows = [t for t, dev in enumerate(devices) if dev == d]
        for i, t in enumerate(rows):
            out[d * chunk + i] = x[t]
    return out


@st.composite
def rebatch_inputs(draw):
    ep = draw(st.integers(1, 6))
    tokens = draw(st.integers(0, 40))
    hidden = draw(st.integers(1, 5))
    devices = draw(st.lists(st.integers(0, ep - 1), min_size=tokens, max_size=tokens))
    extra = draw(st.one_of(st.none(), st.integers(0, 3)))
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float64]))
    return ep, hidden, devices, extra, dtype


@settings(max_examples=60, deadline=None)
@given(rebatch_inputs())
def test_resume_inverts_rebatch_and_layout_is_grouped_stable_and_zero_padded(case):
    ep, hidden, devices, extra, dtype = case
    tokens = len(devices)
    # Nonzero, distinct rows so padding and misplaced rows are both visible.
    x = (torch.arange(tokens * hidden, dtype=torch.float64).reshape(tokens, hidden) + 1).to(dtype)
    largest = max((devices.count(d) for d in range(ep)), default=0)
    chunk = None if extra is None else largest + extra
    shuffled, info = rebatch(x, torch.tensor(devices, dtype=torch.int64), ep, chunk_rows=chunk)
    c = largest if chunk is None else chunk
    assert info.chunk_rows == c
    assert shuffled.shape == (ep * c, hidden)
    assert torch.equal(shuffled, expected_layout(x, devices, ep, c))
    back = resume(shuffled, info)
    assert back.dtype == dtype
    assert torch.equal(back, x)
    # The two index maps are inverse to each other on the real slots.
    real = info.slot_to_token >= 0
    assert int(real.sum()) == tokens
    assert torch.equal(info.token_to_slot[info.slot_to_token[real]], torch.nonzero(real)[:, 0])


def test_one_plan_moves_several_tensors_and_out_buffers_are_used():
    g = torch.Generator().manual_seed(0)
    devices = torch.randint(0, 4, (50,), generator=g)
    info = plan_rebatch(devices, 4)
    a = torch.randn((50, 6), generator=g)
    b = torch.randn((50, 3), generator=g).to(torch.bfloat16)
    buf = torch.full((info.padded_rows, 6), 9.0)
    got = apply_rebatch(a, info, out=buf)
    assert got.data_ptr() == buf.data_ptr()
    assert torch.equal(buf, rebatch(a, devices, 4)[0])
    back = torch.empty_like(a)
    resume(buf, info, out=back)
    assert torch.equal(back, a)
    assert torch.equal(resume(apply_rebatch(b, info), info), b)


def test_numpy_devices_and_int16_are_accepted():
    x = torch.randn(5, 2)
    devices = np.array([3, 0, 3, 1, 0], dtype=np.int16)
    shuffled, info = rebatch(x, torch.from_numpy(devices), 4)
    assert info.counts.tolist() == [2, 1, 0, 2]
    assert torch.equal(resume(shuffled, info), x)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.float32])
def test_rows_move_bit_for_bit_fp8_included(dtype):
    # fp8 hidden states (fp8 dispatch) failed in torch's index_fill / index_select on the CPU
    bits = {1: torch.uint8, 4: torch.int32}[torch.empty((), dtype=dtype).element_size()]
    x = torch.randn(9, 5).to(dtype)
    raw = x.view(bits)
    raw[0, 0] = raw[0, 0] | (1 << (torch.iinfo(bits).bits - 1))  # a sign bit set: -x or -0.0
    if dtype == torch.float32:
        raw[1, 1] = 0x7FC0_1234  # a NaN with a payload
    devices = torch.tensor([2, 0, 2, 1, 1, 0, 2, 0, 1])
    out = torch.empty(3 * 4, 5, dtype=dtype)
    shuffled, info = rebatch(x, devices, 3, chunk_rows=4, out=out)
    assert shuffled is out and shuffled.dtype == dtype
    assert torch.equal(shuffled.view(bits)[info.slot_to_token < 0], torch.zeros(3, 5, dtype=bits))
    assert torch.equal(resume(shuffled, info).view(bits), raw)
    back = torch.empty_like(x)
    assert resume(shuffled, info, out=back) is back and torch.equal(back.view(bits), raw)
    empty, _ = rebatch(x[:0], devices[:0], 3, chunk_rows=2)
    assert torch.equal(empty.view(bits), torch.zeros(6, 5, dtype=bits))


def test_empty_batch():
    shuffled, info = rebatch(torch.zeros(0, 3), torch.zeros(0, dtype=torch.int64), 4)
    assert shuffled.shape == (0, 3)
    assert resume(shuffled, info).shape == (0, 3)
    padded, info = rebatch(torch.zeros(0, 3), torch.zeros(0, dtype=torch.int64), 2, chunk_rows=2)
    assert torch.equal(padded, torch.zeros(4, 3))
    assert resume(padded, info).shape == (0, 3)


def test_empty_batch_with_grad_and_a_fixed_chunk():
    # a fixed chunk (CUDA graphs) in training mode: the differentiable gather read row 0
    # of a tensor without rows for the padding slots
    x = torch.empty(0, 3, requires_grad=True)
    padded, info = rebatch(x, torch.zeros(0, dtype=torch.int64), 2, chunk_rows=2)
    assert torch.equal(padded, torch.zeros(4, 3)) and padded.requires_grad
    padded.sum().backward()
    assert x.grad is not None and x.grad.shape == (0, 3)


@pytest.mark.parametrize("dtype", [torch.uint16, torch.uint32, torch.uint64])
def test_wide_unsigned_rows_are_padded(dtype):
    # CPU torch has no index_fill for them: they failed only when a device had padding
    x = torch.arange(8).reshape(4, 2).to(dtype)
    shuffled, info = rebatch(x, torch.tensor([1, 0, 1, 1]), 2, backend="torch")
    assert shuffled.to(torch.int64).tolist() == [[2, 3], [0, 0], [0, 0], [0, 1], [4, 5], [6, 7]]
    assert torch.equal(resume(shuffled, info), x)


def test_an_unknown_backend_is_refused_with_grad_on_too():
    x = torch.randn(4, 2, requires_grad=True)
    with pytest.raises(InputError, match="backend"):
        rebatch(x, torch.tensor([1, 0, 1, 1]), 2, backend="bogus")


def test_an_out_whose_rows_alias_is_refused():
    out = torch.zeros(1, 2).expand(6, 2)
    with pytest.raises(InputError, match="share memory"):
        rebatch(torch.arange(8.0).reshape(4, 2), torch.tensor([1, 0, 1, 1]), 2, out=out)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_gradients_flow_through_rebatch_and_resume(backend):
    # inside a model's forward with grad on: the torch path's out= gather has no backward
    # and the kernel none at all, so both take the differentiable gather
    weight, x = torch.randn(3, 3, requires_grad=True), torch.randn(6, 3)
    hidden = x @ weight
    devices = torch.tensor([1, 0, 1, 3, 3, 3])
    shuffled, info = rebatch(hidden, devices, 4, backend=backend)
    assert shuffled.requires_grad
    assert torch.equal(shuffled.detach(), rebatch(hidden.detach(), devices, 4)[0])
    scale = torch.arange(shuffled.shape[0], dtype=torch.float32)[:, None]
    back = resume(shuffled * scale, info, backend=backend)
    back.sum().backward()
    # the sum weighs hidden[t] by the scale of the shuffled row token t went to
    expected = x.T @ scale[info.token_to_slot].expand(6, 3)
    torch.testing.assert_close(weight.grad, expected)
    with pytest.raises(InputError, match="out= cannot be used with a tensor that requires grad"):
        rebatch(hidden, devices, 4, out=torch.empty(12, 3))
    with pytest.raises(InputError, match="out= cannot be used with a tensor that requires grad"):
        resume(shuffled, info, backend=backend, out=torch.empty(6, 3))  # torch's raw error before
    with torch.no_grad():  # no grad recorded: the out= path as before
        out = torch.empty(12, 3)
        assert rebatch(hidden, devices, 4, backend="torch", out=out)[0] is out


@pytest.mark.parametrize(
    ("devices", "ep", "chunk_rows", "match"),
    [
        ([0, 2], 2, None, "device id 2 outside"),
        ([0, -1], 2, None, "device id -1 outside"),
        ([0.0, 1.0], 2, None, "integers"),
        ([0, 0, 1], 2, 1, "chunk_rows=1 is smaller than the largest device group"),
        ([0, 1], 0, None, "ep_size must be an integer in 1..32767"),
        ([0, 1], True, None, "ep_size must be an integer in 1..32767"),
        ([0, 1], 10**12, None, "ep_size must be an integer in 1..32767"),  # no 8 TB allocation
        ([0, 0, 1], 2, 2.0, "chunk_rows must be an integer or None"),
    ],
)
def test_bad_plans_raise_input_error(devices, ep, chunk_rows, match):
    x = torch.zeros(len(devices), 2)
    with pytest.raises(InputError, match=match):
        rebatch(x, torch.tensor(devices), ep, chunk_rows=chunk_rows)


def test_shape_mismatches_raise_input_error():
    x = torch.zeros(3, 2)
    with pytest.raises(InputError, match="devices must be"):
        rebatch(x, torch.tensor([0, 1]), 2)
    with pytest.raises(InputError, match="hidden must be"):
        rebatch(torch.zeros(3), torch.tensor([0, 1, 0]), 2)
    shuffled, info = rebatch(x, torch.tensor([0, 1, 0]), 2)
    with pytest.raises(InputError, match="shuffled must be"):
        resume(shuffled[:-1], info)
    with pytest.raises(InputError, match="info must be the RebatchInfo rebatch returned"):
        resume(shuffled, None)
    with pytest.raises(InputError, match="out must be"):
        resume(shuffled, info, out=torch.zeros(3, 2, dtype=torch.float64))
    with pytest.raises(InputError, match="backend must be"):
        rebatch(x, torch.tensor([0, 1, 0]), 2, backend="cuda")
    with pytest.raises(InputError, match="device 5 outside"):
        info.chunk_tokens(5)


@pytest.mark.gpu
def test_auto_backend_moves_integer_rows_on_cuda():
    # the Triton kernel moves floating rows only: "auto" sends integer ones to torch's gather
    x = torch.arange(12, device="cuda").reshape(6, 2)
    devices = torch.tensor([1, 0, 1, 3, 3, 3], device="cuda")
    shuffled, info = rebatch(x, devices, 4)
    assert torch.equal(resume(shuffled, info), x)


@pytest.mark.gpu
def test_auto_backend_takes_a_column_strided_out_on_cuda():
    # the kernel writes rows of unit column stride; such an out= worked on CPU and was
    # refused on a GPU under "auto"
    x = torch.randn(6, 9, device="cuda")
    devices = torch.tensor([1, 0, 1, 3, 3, 3], device="cuda")
    out = torch.empty(9, 12, device="cuda").t()  # [12, 9], column stride 12
    shuffled, info = rebatch(x, devices, 4, out=out)
    assert shuffled.data_ptr() == out.data_ptr()
    torch.testing.assert_close(resume(shuffled, info), x)


def test_meta_tensors_are_refused_with_one_line():
    # torch's NotImplementedError "Cannot copy out of meta tensor; no data!" before
    meta_x = torch.empty((3, 2), device="meta")
    devices = torch.tensor([0, 1, 0])
    with pytest.raises(InputError, match="hidden is on the meta device"):
        rebatch(meta_x, devices, 2)
    with pytest.raises(InputError, match="devices is on the meta device"):
        rebatch(torch.zeros(3, 2), devices.to("meta"), 2)
    shuffled, info = rebatch(torch.zeros(3, 2), devices, 2)
    with pytest.raises(InputError, match="shuffled is on the meta device"):
        resume(shuffled.to("meta"), info)
    with pytest.raises(InputError, match="hidden is on the meta device"):
        apply_rebatch(meta_x, info)
    # an info moved to the meta device was the same NotImplementedError, deep inside
    with pytest.raises(InputError, match="info.slot_to_token is on the meta device"):
        resume(shuffled, info.to("meta"))
    with pytest.raises(InputError, match="info.slot_to_token is on the meta device"):
        apply_rebatch(torch.zeros(3, 2), info.to("meta"))


def test_arguments_of_the_wrong_type_are_one_line_errors():
    x, devices = np.zeros((3, 2), np.float32), torch.tensor([0, 1, 0])
    # a numpy hidden was an AttributeError ('numpy.ndarray' object has no attribute ...)
    with pytest.raises(InputError, match="hidden must be a torch.Tensor, got ndarray"):
        rebatch(x, devices, 2)
    shuffled, info = rebatch(torch.from_numpy(x), devices, 2)
    with pytest.raises(InputError, match="shuffled must be a torch.Tensor, got ndarray"):
        resume(shuffled.numpy(), info)
    with pytest.raises(InputError, match="hidden must be a torch.Tensor, got list"):
        apply_rebatch([[0.0, 0.0]] * 3, info)
    with pytest.raises(InputError, match="info must be the RebatchInfo"):
        apply_rebatch(torch.from_numpy(x), None)


def test_chunk_tokens_takes_a_device_id_only():
    _, info = rebatch(torch.zeros(3, 1), torch.tensor([1, 0, 1]), 2)
    assert info.chunk_tokens(np.int64(1)).tolist() == [0, 2]
    # True was device 1; 1.5 a TypeError from slicing
    for bad in (True, 1.5, "1"):
        with pytest.raises(InputError, match=rf"device {bad!r} outside \[0, 2\)"):
            info.chunk_tokens(bad)


def test_chunk_rows_beyond_int64_is_an_input_error():
    # E * C past int64 was torch's TypeError "Overflow when unpacking long long" or an
    # OverflowError "int too big to convert"
    for chunk in (2**62, 2**70):
        with pytest.raises(InputError, match="chunk_rows=.* is too large"):
            plan_rebatch(torch.tensor([0]), 4, chunk)
    # within int64 but past any memory (1.6 TB of slot map): the allocator's RuntimeError
    with pytest.raises(InputError, match=r"chunk_rows=10+ is too large: .* does not fit in cpu"):
        plan_rebatch(torch.tensor([0, 1]), 2, 10**11)


def test_out_must_be_a_tensor():
    shuffled, info = rebatch(torch.zeros(2, 2), torch.tensor([0, 1]), 2)
    with pytest.raises(InputError, match="out must be a torch.Tensor, got list"):
        rebatch(torch.zeros(2, 2), torch.tensor([0, 1]), 2, out=[[0.0] * 2] * 2)
    with pytest.raises(InputError, match="out must be a torch.Tensor, got list"):
        resume(shuffled, info, out=[[0.0] * 2] * 2)  # AttributeError before
    # an out buffer that requires grad was torch's RuntimeError "index_select(): functions
    # with out=... arguments don't support automatic differentiation"
    with pytest.raises(InputError, match="out= cannot be used with a tensor that requires grad"):
        rebatch(
            torch.zeros(2, 2), torch.tensor([0, 1]), 2, out=torch.zeros(2, 2, requires_grad=True)
        )
    with pytest.raises(InputError, match="out= cannot be used with a tensor that requires grad"):
        resume(shuffled, info, out=torch.zeros(2, 2, requires_grad=True))


def test_out_overlapping_the_input_is_refused():
    # torch's RuntimeError "unsupported operation: some elements of the input tensor and the
    # written-to tensor refer to a single memory location" before (the Triton path wrote
    # rows that other programs still had to read: a silently wrong answer)
    x = torch.arange(8.0).reshape(4, 2)
    devices = torch.tensor([1, 0, 1, 0])  # E * C == T: out can have x's shape
    with pytest.raises(InputError, match="out overlaps hidden in memory"):
        rebatch(x, devices, 2, out=x)
    shuffled, info = rebatch(x, devices, 2)
    with pytest.raises(InputError, match="out overlaps shuffled in memory"):
        resume(shuffled, info, out=shuffled)
    wide = torch.cat([x, torch.zeros(4, 2)], 1)  # disjoint halves of one storage are fine
    rebatch(wide[:, :2], devices, 2, out=wide[:, 2:])
    assert torch.equal(wide[:, 2:], shuffled)
    # a view of the same memory with a storage object of its own (from_dlpack): a shortcut
    # on distinct storages let out= overwrite rows the gather had still to read
    buf = torch.arange(40.0).reshape(10, 4)
    six = torch.tensor([1, 1, 0, 0, 0, 1])
    with pytest.raises(InputError, match="out overlaps hidden in memory"):
        rebatch(buf[0:6], six, 2, out=torch.from_dlpack(buf[1:7]))
    shuffled, info = rebatch(buf[0:6].clone(), six, 2)
    with pytest.raises(InputError, match="out overlaps shuffled in memory"):
        resume(buf[0:6], info, out=torch.from_dlpack(buf[1:7]))
    apart = torch.from_dlpack(buf[6:10])  # its own storage object, memory apart: fine
    rebatch(buf[0:4], devices, 2, out=apart)
    assert torch.equal(buf[6:10], rebatch(buf[0:4].clone(), devices, 2)[0])


def test_plan_rebatch_names_a_uint64_device_id_by_its_true_value():
    devices = torch.tensor([0, 2**63 + 1], dtype=torch.uint64)  # was reported as -2**63 + 1
    with pytest.raises(InputError, match=rf"device id {2**63 + 1} outside \[0, 2\)"):
        plan_rebatch(devices, 2)
    assert plan_rebatch(torch.tensor([1, 0], dtype=torch.uint64), 2).counts.tolist() == [1, 1]


def test_rebatch_info_refuses_wrong_shapes():
    """An info of 3 slots for E=2, C=2 gave a result with a row of uninitialised memory."""
    good = plan_rebatch(torch.tensor([1, 0, 1]), 2)
    t = torch.tensor
    with pytest.raises(InputError, match="has 3 slots, not ep_size x chunk_rows = 2 x 2"):
        RebatchInfo(t([1, -1, 0]), good.token_to_slot, good.counts, 2)
    with pytest.raises(InputError, match="token_to_slot must be a 1-D int64"):
        RebatchInfo(good.slot_to_token, good.token_to_slot.int(), good.counts, 2)
    with pytest.raises(InputError, match="chunk_rows must be an integer >= 0"):
        RebatchInfo(good.slot_to_token, good.token_to_slot, good.counts, 2.0)
    with pytest.raises(InputError, match="5 tokens for 4 slots"):
        RebatchInfo(good.slot_to_token, t([0, 1, 2, 3, 0]), good.counts, 2)
    assert RebatchInfo(good.slot_to_token, good.token_to_slot, good.counts, 2).num_tokens == 3


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_hand_made_info_with_an_index_out_of_range_is_refused(backend):
    """Row 5 of a 2-row tensor: the Triton kernel (told the index was checked) read memory
    past the end, the torch path raised a raw IndexError; both now give one line, before any
    row moves. An info plan_rebatch made, or its copy on another device, is not re-checked."""
    t = torch.tensor
    hidden = torch.ones(2, 2)
    bad = RebatchInfo(t([0, 5, -1]), t([0, 1]), t([3]), 3)
    with pytest.raises(InputError, match=r"slot_to_token holds 5, outside \[-1, 2\)$"):
        apply_rebatch(hidden, bad, backend=backend)
    lost = RebatchInfo(t([0, 1, -1]), t([0, -1]), t([2]), 3)
    with pytest.raises(InputError, match=r"token_to_slot holds -1, outside \[0, 3\)$"):
        resume(torch.ones(3, 2), lost, backend=backend)
    good = plan_rebatch(t([1, 0, 1]), 2)
    assert good.planned and good.to("cpu").planned
    copy = RebatchInfo(good.slot_to_token, good.token_to_slot, good.counts, 2)
    x = torch.arange(6.0).reshape(3, 2)
    torch.testing.assert_close(resume(apply_rebatch(x, copy, backend="torch"), copy), x)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_hand_made_info_whose_maps_disagree_is_refused(backend):
    """Maps in range but not a rebatch layout moved rows silently wrong (a token_to_slot not
    the inverse of slot_to_token gave row 0 back where row 1 was; counts that disagreed with
    the chunks told the collectives to sum padding)."""
    t = torch.tensor
    x = torch.arange(6.0).reshape(3, 2)
    good = plan_rebatch(t([1, 0, 1]), 2)  # slots [1, -1, 0, 2], tokens [2, 0, 3], counts [1, 2]
    cases = {
        "not the inverse": (good.slot_to_token, t([2, 2, 3]), good.counts),
        "sum to the 3 tokens": (good.slot_to_token, good.token_to_slot, t([1, 1])),
        "must be >= 0": (good.slot_to_token, good.token_to_slot, t([-1, 4])),
        "exceed chunk_rows=2": (t([1, -1, 0, 2]), good.token_to_slot, t([0, 3])),
        "tokens first, then padding": (t([-1, 1, 0, 2]), t([2, 1, 3]), good.counts),
    }
    for message, (slots, tokens, counts) in cases.items():
        info = RebatchInfo(slots, tokens, counts, 2)
        with pytest.raises(InputError, match=message):
            apply_rebatch(x, info, backend=backend)
        with pytest.raises(InputError, match=message):
            resume(torch.ones(4, 2), info, backend=backend)

"""The streaming safetensors writer writes the bytes the safetensors library writes."""

from __future__ import annotations

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from planner._safetensors import Chunked, joined, save_tensors

DTYPES = [
    np.int8, np.uint8, np.int16, np.uint16, np.float16, np.int32, np.uint32,
    np.float32, np.int64, np.uint64, np.float64, np.bool_,
]  # fmt: skip


def _tensors(rng: np.random.Generator) -> dict[str, np.ndarray]:
    out = {}
    for i, dtype in enumerate(DTYPES):
        shape = [(7,), (3, 5), (0,), (2, 0, 3), ()][i % 5]
        out[f"t{(i * 7) % 12:02d}_{np.dtype(dtype).name}"] = np.asarray(
            rng.random(shape) * 100
        ).astype(dtype)
    out["é"] = np.arange(
        3, dtype=np.int16
    )  # a non-ASCII name: written as UTF-8, as the library does
    return out


def test_bytes_match_the_library(tmp_path):
    tensors = _tensors(np.random.default_rng(0))
    save_file(tensors, str(tmp_path / "lib.safetensors"))
    save_tensors(tmp_path / "ours.safetensors", tensors)
    assert (tmp_path / "ours.safetensors").read_bytes() == (
        tmp_path / "lib.safetensors"
    ).read_bytes()


def test_chunked_parts_are_written_end_to_end(tmp_path):
    parts = [
        np.arange(5, dtype=np.int32),
        np.arange(0, dtype=np.int32),
        np.arange(4, dtype=np.int64),
    ]
    whole = np.concatenate(parts).astype(np.int64)
    chunked = Chunked(np.dtype(np.int64), (9,), lambda: iter(parts))
    save_tensors(tmp_path / "c.safetensors", {"x": chunked, "y": np.ones(2, np.float16)})
    save_file({"x": whole, "y": np.ones(2, np.float16)}, str(tmp_path / "w.safetensors"))
    assert (tmp_path / "c.safetensors").read_bytes() == (tmp_path / "w.safetensors").read_bytes()
    np.testing.assert_array_equal(joined(chunked), whole)
    assert joined(chunked).dtype == np.int64


def test_big_endian_and_strided_input_are_written_little_endian(tmp_path):
    a = np.arange(12, dtype=">i4").reshape(3, 4)[:, ::2]
    save_tensors(tmp_path / "b.safetensors", {"a": a})
    back = load_file(str(tmp_path / "b.safetensors"))["a"]
    np.testing.assert_array_equal(back, a)
    assert back.dtype == np.int32


def test_parts_that_do_not_fill_the_shape_are_refused(tmp_path):
    short = Chunked(np.dtype(np.int64), (4,), lambda: iter([np.arange(3)]))
    with pytest.raises(ValueError, match="parts hold 24 bytes"):
        save_tensors(tmp_path / "s.safetensors", {"s": short})


def test_unknown_dtype_is_refused(tmp_path):
    with pytest.raises(TypeError, match="no safetensors name"):
        save_tensors(tmp_path / "u.safetensors", {"z": np.zeros(2, np.complex64)})

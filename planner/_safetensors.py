"""A streaming safetensors writer: tensors written from their parts, never joined in memory.

``safetensors.numpy.save_file`` takes whole arrays and copies each into a ``bytes`` object
before writing. A predictor's count arrays are held per layer and stored end to end in one
tensor, so saving them that way needs the joined array and its bytes copy beside the counts
(at a million DeepSeek-V3-shaped tokens, 1.3 GB each). :func:`save_tensors` writes the same
file from the parts: a :class:`Chunked` tensor declares its dtype and shape and yields its
parts in order when written.

The bytes are those ``save_file`` writes (no metadata): an 8-byte little-endian header
length, the JSON header padded with spaces to a multiple of 8, then the tensors' data in
the library's order (dtype, widest first, then name); ``tests/test_safetensors.py`` checks
that against the library.
"""

from __future__ import annotations

import contextlib
import json
import math
import struct
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# safetensors' dtype names, in the order its serializer lays tensors out (first first).
_DTYPES = {
    "U64": np.uint64, "I64": np.int64, "F64": np.float64,
    "F32": np.float32, "U32": np.uint32, "I32": np.int32,
    "F16": np.float16, "U16": np.uint16, "I16": np.int16,
    "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
}  # fmt: skip
_NAMES = {np.dtype(t): name for name, t in _DTYPES.items()}
_RANK = {name: i for i, name in enumerate(_DTYPES)}


@contextlib.contextmanager
def write_errors_as_oserror(dest: str | Path) -> Iterator[None]:
    """The safetensors library's write failures (a full disk) as an OSError naming ``dest``:
    it raises its own SafetensorError, no OSError, and names no file."""
    from safetensors import SafetensorError

    try:
        yield
    except SafetensorError as e:
        raise OSError(f"{dest}: cannot be written ({e})") from None


@dataclass(frozen=True)
class Chunked:
    """A tensor of ``shape`` and ``dtype`` whose data is ``parts()``'s arrays end to end."""

    dtype: np.dtype
    shape: tuple[int, ...]
    parts: Callable[[], Iterable[np.ndarray]]


def joined(tensor: np.ndarray | Chunked) -> np.ndarray:
    """``tensor`` as one array (a :class:`Chunked` one's parts joined)."""
    if not isinstance(tensor, Chunked):
        return tensor
    data = np.concatenate([np.empty(0, tensor.dtype), *tensor.parts()])
    return data.astype(tensor.dtype, copy=False).reshape(tensor.shape)


def save_tensors(path: str | Path, tensors: Mapping[str, np.ndarray | Chunked]) -> None:
    """Write ``tensors`` to the safetensors file ``path`` (callers make it atomic)."""
    entries = []  # (name, safetensors dtype, shape, numpy dtype) in the file's order
    for name, t in tensors.items():
        dtype = np.dtype(t.dtype).newbyteorder("=")  # written little-endian whatever it is
        if dtype not in _NAMES:
            raise TypeError(f"tensor {name!r}: dtype {dtype} has no safetensors name")
        entries.append((name, _NAMES[dtype], [int(s) for s in t.shape], dtype))
    entries.sort(key=lambda e: (_RANK[e[1]], e[0]))
    header, sizes, offset = {}, [], 0
    for name, dtype_name, shape, dtype in entries:
        sizes.append(math.prod(shape) * dtype.itemsize)
        span = [offset, offset + sizes[-1]]
        header[name] = {"dtype": dtype_name, "shape": shape, "data_offsets": span}
        offset += sizes[-1]
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for (name, _, _, dtype), size in zip(entries, sizes, strict=True):
            t = tensors[name]
            written = 0
            for part in t.parts() if isinstance(t, Chunked) else (t,):
                # little-endian and contiguous; a copy only where the part is neither
                data = np.ascontiguousarray(part, dtype=dtype.newbyteorder("<"))
                f.write(data.reshape(-1).view(np.uint8).data)
                written += data.nbytes
            if written != size:
                raise ValueError(
                    f"tensor {name!r}: its parts hold {written} bytes, its shape {size}"
                )

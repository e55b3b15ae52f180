"""Writing a safetensors file one tensor at a time. ``safetensors.torch.save_file`` needs every tensor of the file in
memory at once (and copies each into bytes); an export of a sharded model gathers one tensor at a time, so it writes
the header first, from the names, shapes and dtypes it knows before any gather, then each tensor's bytes as it comes.
The layout is safetensors' own: an 8-byte little-endian header length, the JSON header (tensors in data order with
their ``data_offsets``, and ``__metadata__``), padded with spaces to 8 bytes, then the raw data; the tests read every
file back with safetensors itself."""

import json
import struct
from pathlib import Path
from typing import BinaryIO, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

_DTYPE_NAMES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}

Entry = Tuple[str, Tuple[int, ...], torch.dtype]
"""A tensor's name, shape and dtype, as the file will hold it."""


class SafetensorsStream:
    """``with SafetensorsStream(path, entries, metadata) as stream: stream.write(name, tensor)`` for each entry, in
    the order given; the file is complete when the block ends."""

    def __init__(self, path: Path, entries: Sequence[Entry], metadata: Optional[Dict[str, str]] = None) -> None:
        self._path = path
        self._expected: List[Entry] = list(entries)
        header: Dict[str, object] = {"__metadata__": dict(metadata or {})}
        offset = 0
        for name, shape, dtype in self._expected:
            nbytes = _numel(shape) * dtype.itemsize
            header[name] = {
                "dtype": _DTYPE_NAMES[dtype],
                "shape": list(shape),
                "data_offsets": [offset, offset + nbytes],
            }
            offset += nbytes
        encoded = json.dumps(header, separators=(",", ":")).encode()
        self._header = encoded + b" " * (-len(encoded) % 8)
        self._file: Optional[BinaryIO] = None
        self._next = 0

    def __enter__(self) -> "SafetensorsStream":
        self._file = open(self._path, "wb")  # noqa: SIM115 - closed in __exit__
        self._file.write(struct.pack("<Q", len(self._header)))
        self._file.write(self._header)
        return self

    def write(self, name: str, tensor: Tensor) -> None:
        expected_name, shape, dtype = self._expected[self._next]
        if (name, tuple(tensor.shape), tensor.dtype) != (expected_name, shape, dtype):
            raise ValueError(
                f"SafetensorsStream: expected {expected_name} {shape} {dtype} next, got {name} {tuple(tensor.shape)}"
                f" {tensor.dtype}"
            )
        assert self._file is not None, "write inside the with block"
        data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
        data.numpy().tofile(self._file)  # no copy: numpy writes the buffer through the file's descriptor
        self._next += 1

    def __exit__(self, *exc: object) -> None:
        assert self._file is not None
        self._file.close()
        if exc[0] is None and self._next != len(self._expected):
            missing = [name for name, _, _ in self._expected[self._next :]]
            raise ValueError(f"SafetensorsStream: {self._path} closed before {missing[:3]} were written")


def _numel(shape: Tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count

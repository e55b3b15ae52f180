"""Writing a safetensors file one tensor at a time. ``safetensors.torch.save_file`` needs every tensor of the file in
memory at once (and copies each into bytes); an export of a sharded model gathers one tensor at a time, so it writes
the header first, from the names, shapes and dtypes it knows before any gather, then each tensor's bytes as it comes.
The layout is safetensors' own: an 8-byte little-endian header length, the JSON header (tensors in data order with
their ``data_offsets``, and ``__metadata__``), padded with spaces to 8 bytes, then the raw data; the tests read every
file back with safetensors itself."""

import json
import os
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

_DTYPES = {name: dtype for dtype, name in _DTYPE_NAMES.items()}

Entry = Tuple[str, Tuple[int, ...], torch.dtype]
"""A tensor's name, shape and dtype, as the file will hold it."""


class SafetensorsStream:
    """``with SafetensorsStream(path, entries, metadata) as stream: stream.write(name, tensor)`` for each entry, in
    the order given; the file is complete when the block ends. A large tensor may come in regions instead
    (``write_region``, the export's slices): consecutive rows, or slices along a later dimension."""

    def __init__(self, path: Path, entries: Sequence[Entry], metadata: Optional[Dict[str, str]] = None) -> None:
        self._path = path
        self._expected: List[Entry] = list(entries)
        self._offsets: List[int] = []
        header: Dict[str, object] = {"__metadata__": dict(metadata or {})}
        offset = 0
        for name, shape, dtype in self._expected:
            nbytes = _numel(shape) * dtype.itemsize
            header[name] = {
                "dtype": _DTYPE_NAMES[dtype],
                "shape": list(shape),
                "data_offsets": [offset, offset + nbytes],
            }
            self._offsets.append(offset)
            offset += nbytes
        encoded = json.dumps(header, separators=(",", ":")).encode()
        self._header = encoded + b" " * (-len(encoded) % 8)
        self._data_start = 8 + len(self._header)
        self._file: Optional[BinaryIO] = None
        self._next = 0
        self._written = 0
        """Bytes of the current tensor written so far."""

    def __enter__(self) -> "SafetensorsStream":
        self._file = open(self._path, "wb")  # noqa: SIM115 - closed in __exit__
        self._file.write(struct.pack("<Q", len(self._header)))
        self._file.write(self._header)
        self._file.flush()
        return self

    def write(self, name: str, tensor: Tensor) -> None:
        """The next tensor, whole."""
        expected_name, shape, dtype = self._current()
        if (name, tuple(tensor.shape), tensor.dtype) != (expected_name, shape, dtype) or self._written:
            raise ValueError(
                f"SafetensorsStream: expected {expected_name} {shape} {dtype} next, got {name} {tuple(tensor.shape)}"
                f" {tensor.dtype}"
            )
        self.write_region(name, 0, 0, shape[0] if shape else 1, tensor)

    def write_region(self, name: str, dim: int, start: int, stop: int, region: Tensor) -> None:
        """Part of the next tensor: the indices ``start:stop`` of dimension ``dim`` (all of the others), in the
        tensor's dtype. Rows (``dim`` 0) are one contiguous write; a slice along a later dimension is one write per
        index of the dimensions before it."""
        expected_name, shape, dtype = self._current()
        region_shape = tuple(shape[:dim]) + ((stop - start),) + tuple(shape[dim + 1 :]) if shape else ()
        if name != expected_name or tuple(region.shape) != region_shape or region.dtype != dtype:
            raise ValueError(
                f"SafetensorsStream: expected part of {expected_name} {shape} {dtype} next, got {name}"
                f" {tuple(region.shape)} {region.dtype}"
            )
        assert self._file is not None, "write inside the with block"
        data = region.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
        base = self._data_start + self._offsets[self._next]
        inner = _numel(tuple(shape[dim + 1 :])) * dtype.itemsize if shape else dtype.itemsize
        leading = _numel(tuple(shape[:dim])) if shape else 1
        runs = data.reshape(leading, -1)
        descriptor = self._file.fileno()
        size = shape[dim] if shape else 1
        for index in range(leading):  # one run per index of the leading dims; rows (dim 0) are one run
            os.pwrite(descriptor, runs[index], base + (index * size + start) * inner)
        self._written += data.size
        if self._written == _numel(shape) * dtype.itemsize:
            self._next += 1
            self._written = 0

    def _current(self) -> Entry:
        if self._next >= len(self._expected):
            raise ValueError(f"SafetensorsStream: every tensor of {self._path} is written already")
        return self._expected[self._next]

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


def read_header(path: Path) -> Dict[str, Tuple[Tuple[int, ...], torch.dtype]]:
    """Every tensor's shape and dtype from a safetensors file's header, after checking that the file is whole (it
    holds every byte its header describes): a truncated or damaged file is refused here, by name, before any tensor
    is read."""
    size = path.stat().st_size
    with open(path, "rb") as handle:
        prefix = handle.read(8)
        if len(prefix) < 8:
            raise ValueError(f"{str(path)!r} is not a safetensors file: it holds {size} bytes, too few for a header.")
        (length,) = struct.unpack("<Q", prefix)
        if length > size - 8:
            raise ValueError(
                f"{str(path)!r} is truncated or not a safetensors file: its header claims {length} bytes, the file"
                f" holds {size}. Copy or export it again."
            )
        try:
            header = json.loads(handle.read(length))
        except ValueError as error:
            raise ValueError(
                f"{str(path)!r} has a damaged safetensors header ({error}); copy or export it again."
            ) from error
    tensors: Dict[str, Tuple[Tuple[int, ...], torch.dtype]] = {}
    end = 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if entry.get("dtype") not in _DTYPES:
            raise ValueError(
                f"{str(path)!r}: tensor {name!r} has dtype {entry.get('dtype')!r}, which is not supported."
            )
        tensors[name] = (tuple(entry["shape"]), _DTYPES[entry["dtype"]])
        end = max(end, int(entry["data_offsets"][1]))
    if 8 + length + end > size:
        raise ValueError(
            f"{str(path)!r} is truncated: its header describes {8 + length + end} bytes, the file holds {size}. Copy"
            " or export it again."
        )
    return tensors

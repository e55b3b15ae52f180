"""The streaming safetensors writer: files safetensors itself reads back bit for bit, and the two ways to misuse it
refused with what was expected."""

from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from lightning_mixedfsdp.checkpoint.safetensors_stream import SafetensorsStream


def _entries(tensors: dict) -> list:
    return [(name, tuple(t.shape), t.dtype) for name, t in tensors.items()]


def test_a_streamed_file_reads_back_with_safetensors_bit_for_bit(tmp_path: Path) -> None:
    torch.manual_seed(0)
    tensors = {
        "model.embed.weight": torch.randn(5, 3, dtype=torch.bfloat16),
        "model.norm.weight": torch.randn(3),
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "positions": torch.arange(4),
        "mask": torch.tensor([True, False]),
    }
    path = tmp_path / "model.safetensors"
    with SafetensorsStream(path, _entries(tensors), {"format": "pt"}) as stream:
        for name, tensor in tensors.items():
            stream.write(name, tensor)
    loaded = load_file(str(path))
    assert loaded.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor), name
    with safe_open(str(path), framework="pt") as handle:
        assert handle.metadata() == {"format": "pt"}


def test_a_tensor_out_of_order_is_refused_with_what_was_expected(tmp_path: Path) -> None:
    tensors = {"a": torch.zeros(2), "b": torch.ones(3)}
    with pytest.raises(ValueError, match=r"expected a \(2,\) torch.float32 next, got b \(3,\) torch.float32"):
        with SafetensorsStream(tmp_path / "x.safetensors", _entries(tensors)) as stream:
            stream.write("b", tensors["b"])


def test_a_file_closed_before_every_tensor_was_written_is_refused(tmp_path: Path) -> None:
    tensors = {"a": torch.zeros(2), "b": torch.ones(3)}
    with pytest.raises(ValueError, match=r"x.safetensors closed before \['b'\] were written"):
        with SafetensorsStream(tmp_path / "x.safetensors", _entries(tensors)) as stream:
            stream.write("a", tensors["a"])

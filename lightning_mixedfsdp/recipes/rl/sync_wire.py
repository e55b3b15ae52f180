"""What travels between the trainers' rank 0 and the generator ranks over their own process group (sync rank 0: the
trainer, 1..N: the generators), each message with the group object's own collectives (``compat/torch.py``).

- A command, broadcast by the trainer: ``[kind, version, index, count]`` (int64): ``STOP``, ``LAYOUT`` (then the
  streamed tensors' names, shapes and dtypes, once), ``WEIGHTS`` (then every tensor whole, in the layout's order, as
  each bucket completes), ``REQUEST`` (then the rollout's prompts: each trainer rank's prompt indices and seed).
- An object (a request, a rollout): its byte count, then its bytes (``torch.save``), broadcast by the trainer or sent
  by a generator to the trainer.

Tensors travel on the CPU (gloo): a CUDA tensor is copied to the host for the send."""

import io
from typing import Any, List, Optional, Tuple

import torch
from torch import Tensor

from lightning_mixedfsdp.compat.torch import broadcast_options

STOP, LAYOUT, WEIGHTS, REQUEST = 0, 1, 2, 3
ROLLOUT_TAG = 11
Layout = List[Tuple[str, Tuple[int, ...], str]]
"""The streamed tensors in order: name, shape, dtype (``str(torch.dtype)``)."""


def broadcast(group: Any, tensor: Tensor) -> None:
    group.broadcast([tensor], broadcast_options(0)).wait()


def send_command(group: Any, kind: int, version: int = 0, index: int = 0, count: int = 0) -> None:
    broadcast(group, torch.tensor([kind, version, index, count], dtype=torch.int64))


def receive_command(group: Any) -> List[int]:
    command = torch.zeros(4, dtype=torch.int64)
    broadcast(group, command)
    return [int(value) for value in command]


def _as_bytes(value: Any) -> Tensor:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)


def _from_bytes(data: Tensor) -> Any:
    return torch.load(io.BytesIO(data.numpy().tobytes()), weights_only=False)


def broadcast_object(group: Any, value: Any = None, sending: bool = True) -> Any:
    """``value`` from the trainer to every generator (``sending`` on the trainer); the value on every rank."""
    data = _as_bytes(value) if sending else torch.empty(0, dtype=torch.uint8)
    size = torch.tensor([data.numel()], dtype=torch.int64)
    broadcast(group, size)
    if not sending:
        data = torch.empty(int(size), dtype=torch.uint8)
    broadcast(group, data)
    return value if sending else _from_bytes(data)


def send_object(group: Any, value: Any, to: int) -> None:
    data = _as_bytes(value)
    group.send([torch.tensor([data.numel()], dtype=torch.int64)], to, ROLLOUT_TAG).wait()
    group.send([data], to, ROLLOUT_TAG).wait()


def receive_object(group: Any, source: int) -> Any:
    size = torch.zeros(1, dtype=torch.int64)
    group.recv([size], source, ROLLOUT_TAG).wait()
    data = torch.empty(int(size), dtype=torch.uint8)
    group.recv([data], source, ROLLOUT_TAG).wait()
    return _from_bytes(data)


def send_tensor(group: Any, tensor: Tensor) -> None:
    """A whole tensor from the trainer (its bytes as they are: the generator holds the same dtype)."""
    broadcast(group, tensor.detach().contiguous().cpu())


def receive_tensor_into(group: Any, target: Tensor, dtype: Optional[torch.dtype] = None) -> None:
    """A whole tensor, sent in ``dtype`` (None: the target's), into ``target`` (a generator's param or buffer, whole),
    in place."""
    dtype = dtype or target.dtype
    if target.device.type == "cpu" and target.is_contiguous() and target.dtype == dtype:
        broadcast(group, target)
        return
    staging = torch.empty(target.shape, dtype=dtype)
    broadcast(group, staging)
    target.copy_(staging)


def tensor_bytes(tensor: Tensor) -> bytes:
    """A tensor's bytes as stored (for a digest)."""
    return tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()

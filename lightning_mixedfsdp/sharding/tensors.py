"""Walking and casting the tensors inside nested inputs and outputs (tuples, lists, dicts, HF ModelOutputs)."""

from typing import Any, Iterable

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor


def tensors_in(obj: Any) -> Iterable[Tensor]:
    """Every tensor inside ``obj``, depth first."""
    if isinstance(obj, Tensor):
        yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from tensors_in(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from tensors_in(value)


def cast_floating(data: Any, dtype: torch.dtype) -> Any:
    """``data`` with every floating tensor cast to ``dtype``; other tensors and values unchanged."""
    return apply_to_collection(data, Tensor, lambda t: t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t)

"""Walking and casting the tensors inside nested inputs and outputs (tuples, lists, dicts, HF ModelOutputs), the
local part of a DTensor, and the label value losses skip."""

from typing import Any, Callable, Iterable

import torch
from torch import Tensor

from lightning_mixedfsdp.compat.torch import tree_flatten, tree_unflatten

IGNORE_INDEX = -100
"""The label of a token no loss trains on: ``torch.nn.functional.cross_entropy``'s ``ignore_index`` default, which
Hugging Face models use too."""


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


def map_tensors(data: Any, fn: Callable[[Tensor], Tensor]) -> Any:
    """``data`` with ``fn`` applied to every tensor inside it (torch's pytree: tuples, lists, dicts, named tuples and
    registered containers such as HF ``ModelOutput``), the rest unchanged."""
    leaves, spec = tree_flatten(data)
    return tree_unflatten([fn(leaf) if isinstance(leaf, Tensor) else leaf for leaf in leaves], spec)


def cast_floating(data: Any, dtype: torch.dtype) -> Any:
    """``data`` with every floating tensor cast to ``dtype``; other tensors and values unchanged."""
    return map_tensors(data, lambda t: t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t)


def local_tensor(tensor: Tensor) -> Tensor:
    """This rank's part of a DTensor; any other tensor as it is."""
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor

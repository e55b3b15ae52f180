"""Buffers kept equal on every data-parallel rank. FSDP2 shards params and leaves buffers alone, so a buffer that
training updates from each rank's own data (BatchNorm statistics, an aux-loss-free router bias) drifts apart.

- ``"broadcast"``: data-parallel rank 0's buffers, before each forward of the model (DDP's ``broadcast_buffers``);
- ``"average"``: the mean over the data-parallel ranks of the floating buffers, after each optimizer step (what an
  aux-loss-free balancing bias updated from each rank's expert load needs);
- ``"none"``: each rank keeps its own.

Only persistent buffers (those a state dict holds) by default: a non-persistent one (RoPE's ``inv_freq``, a causal
mask) is derived from the config and equal everywhere already, so a model with none (Llama) pays nothing. ``names``
(regexes searched in canonical buffer names) picks the buffers instead, non-persistent ones included. One bucketed
collective per dtype.
"""

import re
from typing import TYPE_CHECKING, Any, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from lightning_mixedfsdp.apply.bucketed import average_over_ranks, broadcast_from_first_rank
from lightning_mixedfsdp.compat.torch import non_persistent_buffer_names, own_buffers
from lightning_mixedfsdp.config import BufferSyncMode
from lightning_mixedfsdp.model.names import canonical_name
from lightning_mixedfsdp.model.tensors import local_tensor

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


class BufferSync:
    """The buffers of one model to keep in step, and the collective that does it."""

    def __init__(
        self, model: nn.Module, mode: BufferSyncMode, names: Optional[Sequence[str]], group: "ProcessGroup"
    ) -> None:
        patterns = [re.compile(pattern) for pattern in names or []]
        self.mode = mode
        self._group = group
        self._owners: List[Tuple[nn.Module, str]] = []
        for module_name, module in model.named_modules():
            derived = non_persistent_buffer_names(module)
            for attribute, buffer in own_buffers(module).items():
                name = canonical_name(f"{module_name}.{attribute}" if module_name else attribute)
                if buffer is None:
                    continue
                if patterns and not any(p.search(name) for p in patterns):
                    continue
                if not patterns and attribute in derived:
                    continue
                if mode == "average" and not buffer.is_floating_point():
                    continue
                self._owners.append((module, attribute))

    @property
    def count(self) -> int:
        return len(self._owners)

    def attach(self, root: nn.Module) -> List[RemovableHandle]:
        """``broadcast``: before every forward of ``root`` (first, before FSDP's own pre-forward)."""
        if self.mode != "broadcast" or not self._owners:
            return []
        return [root.register_forward_pre_hook(self._before_forward, prepend=True)]

    @torch.compiler.disable
    def _before_forward(self, *_: Any) -> None:
        self.broadcast()

    def broadcast(self) -> None:
        broadcast_from_first_rank(self._buffers(), self._group)

    def average(self) -> None:
        average_over_ranks(self._buffers(), self._group)

    def _buffers(self) -> List[Tensor]:
        # read at each sync: module code may assign a new tensor to a buffer instead of updating it in place
        buffers = [own_buffers(module)[attribute] for module, attribute in self._owners]
        return [local_tensor(b) for b in buffers if b is not None]

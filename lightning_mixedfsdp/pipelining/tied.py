"""Tied embeddings across pipeline stages (Megatron-LM's embedding group): the first stage holds the embedding, the
last stage the head, one Parameter in the uncut model and a copy on each of the two ranks once cut. The copies start
equal (the first stage's sent to the last) and stay equal: after each step's backward their grads are summed over
the two ranks (what one process accumulates into the one Parameter), so both ranks take the same optimizer step.
The last stage's copy is counted once in the gradient norm (not at all on its rank) and not exported."""

import zlib
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from lightning_mixedfsdp.model.tensors import local_tensor


class TiedAcrossStages:
    """This rank's side of each tie: the copies it holds and the group it shares them over (None on a rank holding
    neither the first nor the last stage)."""

    def __init__(self, params: List[Tensor], group: Optional[Any], copies: List[str]) -> None:
        self.params, self.group = params, group
        self._held: List[Optional[Tensor]] = [None] * len(params)
        self.copies = copies
        """Names of the last stage's copies on this rank (counted on the first stage's rank, exported from it)."""

    @classmethod
    def build(
        cls, module: nn.Module, pairs: Sequence[Tuple[str, str]], ranks: Tensor, first: bool, last: bool
    ) -> "TiedAcrossStages":
        """``pairs``: ``(name in the last stage, name in the first)``; ``ranks``: the global ranks of the mesh,
        pipeline dim first. Every rank calls it (the groups are made by all), before any step."""
        import torch.distributed as dist

        if not pairs:  # the same on every rank (the same model): no rank makes a group
            return cls([], None, [])
        group = None
        me = dist.get_rank()
        flat = ranks.reshape(ranks.shape[0], -1)
        for first_rank, last_rank in zip(flat[0].tolist(), flat[-1].tolist(), strict=True):
            made = dist.new_group([first_rank, last_rank])  # every rank makes every group, in the same order
            if me in (first_rank, last_rank):
                group = made
        if first == last:  # a middle stage, or both stages on this rank: the one Parameter still
            return cls([], None, [])
        named: Dict[str, Tensor] = dict(module.named_parameters(remove_duplicate=False))
        names = [first_name if first else last_name for last_name, first_name in pairs]
        copies = [last_name for last_name, _ in pairs] if last else []
        return cls([named[name] for name in names], group, copies)

    @torch.no_grad()
    def start_equal(self, first_rank: int) -> None:
        """The last stage's copies take the first stage's values (a model built with another seed per rank, or
        initialised on the meta device, would otherwise start apart); shapes and dtypes must agree."""
        import torch.distributed as dist

        if self.group is None:
            return
        for param in self.params:
            local = local_tensor(param)
            dtype_code = zlib.crc32(str(local.dtype).encode())  # any dtype, the same code in every process
            description = torch.tensor([local.numel(), dtype_code], device=local.device)
            both = [torch.empty_like(description) for _ in range(2)]
            dist.all_gather(both, description, group=self.group)  # both ranks compare, both raise alike
            if not torch.equal(both[0], both[1]):
                raise RuntimeError(
                    "mixed_fsdp2: a tied embedding's two copies differ in size or dtype between the first and the"
                    f" last pipeline stage ({both[0].tolist()} against {both[1].tolist()}: elements, dtype code);"
                    " give the head and the embedding the same dtype rules, or untie them."
                )
            dist.broadcast(local, src=first_rank, group=self.group)

    @torch.no_grad()
    def hold_grads(self) -> None:
        """Before a step's backward: the grads the copies hold already (steps accumulating before one optimizer
        step), which the other stage has counted in them at the last sum."""
        self._held = [None if p.grad is None else local_tensor(p.grad).clone() for p in self.params]

    @torch.no_grad()
    def sum_grads(self) -> None:
        """What each copy's grad gained in this step's backward summed with what the other stage's gained (after the
        step's reduction within each stage)."""
        import torch.distributed as dist

        if self.group is None:
            return
        for param, before in zip(self.params, self._held, strict=True):
            if not param.requires_grad:  # frozen on both ranks alike (the same model): no grad, no step
                continue
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            grad = local_tensor(param.grad)
            if before is not None:
                grad.sub_(before)
            dist.all_reduce(grad, group=self.group)
            if before is not None:
                grad.add_(before)
        self._held = [None] * len(self.params)

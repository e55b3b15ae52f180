"""Modules that run for some inputs only, on ranks that see different inputs: the trainable params of such a module
(a projector) that did not run on a rank reduce zeros there, so every rank issues the same reduce-scatter; after a
step in which no rank ran the module they get no grad at all, as one process that never ran it would give them.

The planner keeps such modules out of FSDP units of their own (``planning/conditional.py``), so no all-gather depends
on the inputs; this is the gradient side."""

from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from lightning_mixedfsdp.compat.torch import can_reduce_unused_params, reduce_unused_params
from lightning_mixedfsdp.model.names import ModuleIndex, canonical_name, join_name
from lightning_mixedfsdp.planning.conditional import conditional_trainable
from lightning_mixedfsdp.planning.types import ShardPlan

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


def conditional_problems(plan: ShardPlan, context_parallel: int, fault_tolerant: bool) -> List[str]:
    """What cannot run a model with modules that run for some inputs only, each with its fix."""
    modules = plan.conditional_modules
    if not modules:
        return []
    named = ", ".join(modules)
    problems = []
    if context_parallel > 1:
        problems.append(
            f"context_parallel_size={context_parallel} splits every sequence across ranks, and {named} run for some"
            " inputs only (images, audio): their features land in one rank's part of a sequence, which ring attention"
            " does not place. Set context_parallel_size=1 for this model."
        )
    if fault_tolerant:
        problems.append(
            f"fault_tolerance with modules that run for some inputs only ({named}) is untested: a group that heals"
            " mid-step would have to agree on which of them ran. Set fault_tolerance=None for this model."
        )
    if plan.experts is not None:
        problems.append(
            f"expert_parallel_size={plan.experts.size} with modules that run for some inputs only ({named}) is"
            " untested. Set expert_parallel_size=1 for this model."
        )
    trainable = list(conditional_trainable(plan))
    if trainable and not can_reduce_unused_params():
        problems.append(
            f"{', '.join(trainable)} run for some inputs only and train: a rank whose inputs skip them must reduce"
            f" zeros for their grads, which needs FSDPModule.set_reduce_scatter_unused_params (torch >= 2.13; this is"
            f" torch {torch.__version__}). Upgrade torch, or freeze them."
        )
    return problems


class ConditionalRuns:
    """Which conditional modules with trainable sharded params ran on this rank since the last synced backward.

    At the end of a synced backward the ranks take the maximum of their flags (one all-reduce of a flag per module)
    and clear the grads of the modules no rank ran: FSDP reduced zeros for them, which an optimizer would take as a
    gradient (AdamW's decay and moments would move), where one process that never ran them leaves them untouched.
    """

    def __init__(
        self, modules: Dict[str, List[nn.Parameter]], group: "ProcessGroup", synced: Callable[[], bool]
    ) -> None:
        self._params = list(modules.values())
        self._names = list(modules)
        self._ran = [False] * len(self._names)
        self._group, self._synced = group, synced

    def attach(self, index: ModuleIndex) -> List[RemovableHandle]:
        return [
            index.inner[name].register_forward_pre_hook(self._marker(position))
            for position, name in enumerate(self._names)
        ]

    def _marker(self, position: int) -> Callable[..., None]:
        def mark(*_: Any) -> None:
            self._ran[position] = True

        return mark

    def reset(self) -> None:
        self._ran = [False] * len(self._names)

    @torch.no_grad()
    def on_backward_end(self) -> None:
        import torch.distributed as dist

        if not self._synced():
            return
        device = next(p.device for params in self._params for p in params)
        flags = torch.tensor(self._ran, dtype=torch.float32, device=device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self._group)
        for params, ran in zip(self._params, flags.tolist(), strict=True):
            if not ran:
                for param in params:
                    param.grad = None
        self.reset()


def apply_conditional_reduction(
    plan: ShardPlan, index: ModuleIndex, group: "ProcessGroup", synced: Callable[[], bool]
) -> Optional[ConditionalRuns]:
    """After ``fully_shard``: the FSDP groups that hold trainable conditional params reduce zeros for them where they
    did not run, and a :class:`ConditionalRuns` (returned, to attach) clears their grads after a step no rank ran
    them. None when the plan has no trainable conditional param."""
    trainable = conditional_trainable(plan)
    if not trainable:
        return None
    holders = {plan.params[name].group for names in trainable.values() for name in names}
    by_name = {group.name: group for group in plan.sharded_groups}
    for holder in sorted(holders):
        reduce_unused_params(index.outer[by_name[holder].modules[0]])
    modules = {name: _params_of(index.inner[name], name, names) for name, names in trainable.items()}
    return ConditionalRuns({name: params for name, params in modules.items() if params}, group, synced)


def _params_of(module: nn.Module, prefix: str, names: Sequence[str]) -> List[nn.Parameter]:
    wanted = set(names)
    return [p for n, p in module.named_parameters() if canonical_name(join_name(prefix, n)) in wanted]

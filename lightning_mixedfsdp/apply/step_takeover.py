"""An optimizer instance's ``step`` replaced by the library's own (bf16 write-back, Muon's whole-matrix step), in the
form torch's LR schedulers expect: a method whose function a scheduler built later binds to the optimizer again, or,
where a scheduler built earlier wrapped the step already, a wrapper that tells it the step ran (as its own did)."""

import types
from typing import Any, Callable, Optional

from torch.optim import Optimizer

Step = Callable[[Optional[Callable[[], Any]]], Any]
"""``step(closure)``: what the optimizer's ``step`` does from now on."""


def take_over_step(optimizer: Optimizer, step: Step) -> None:
    """``optimizer.step`` (this instance's alone) becomes ``step``."""
    optimizer._mixed_fsdp_step = step  # type: ignore[attr-defined]
    if not getattr(optimizer.step, "_wrapped_by_lr_sched", False):
        optimizer.step = types.MethodType(_taken_step, optimizer)  # type: ignore[method-assign]
        return

    def tracked(*args: Any, **kwargs: Any) -> Any:
        optimizer._opt_called = True  # type: ignore[attr-defined]  # what the scheduler's own wrapper records
        return step(*args, **kwargs)

    tracked._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    optimizer.step = tracked  # type: ignore[method-assign]


def _taken_step(optimizer: Optimizer, closure: Optional[Callable[[], Any]] = None) -> Any:
    return optimizer._mixed_fsdp_step(closure)  # type: ignore[attr-defined]

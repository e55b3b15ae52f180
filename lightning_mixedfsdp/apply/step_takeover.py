"""An optimizer instance's ``step`` replaced by the library's own (bf16 write-back, Muon's whole-matrix step), in the
form torch's LR schedulers expect: a method whose function a scheduler built later binds to the optimizer again, or,
where a scheduler built earlier wrapped the step already, a wrapper that tells it the step ran (as its own did).
:class:`StepAround` is the shape both take: the closure, the class's own step over the params it keeps, the library's
work in the first post hook."""

import types
from typing import Any, Callable, List, Optional

import torch
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


class StepAround:
    """A step taken over around the optimizer class's own: the closure first (forward, backward, Lightning's
    ``zero_grad`` and clipping see every param), then the class's step over the params ``keep`` leaves in each group
    (its step hooks run as always), then, as the optimizer's first post hook, ``after`` with every group whole again.
    ``before()`` runs first in each step (a writer taking groups added since)."""

    def __init__(
        self,
        optimizer: Optimizer,
        keep: Callable[[Any], bool],
        after: Callable[[Optimizer], None],
        before: Callable[[], None] = lambda: None,
    ) -> None:
        self.optimizer, self.keep, self.after, self.before = optimizer, keep, after, before
        self._own_step = type(optimizer).step  # the class's, wrapped by its step hooks
        self._held: List[List[Any]] = []
        take_over_step(optimizer, self)
        optimizer.register_step_post_hook(self._after_step)

    def __call__(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.before()
        self._held = [group["params"] for group in self.optimizer.param_groups]
        for group in self.optimizer.param_groups:
            group["params"] = [p for p in group["params"] if self.keep(p)]
        try:
            self._own_step(self.optimizer)
        finally:
            self._restore()
        return loss

    def _restore(self) -> bool:
        if not self._held:
            return False
        for group, params in zip(self.optimizer.param_groups, self._held, strict=True):
            group["params"] = params
        self._held = []
        return True

    def _after_step(self, optimizer: Optimizer, *_: Any) -> None:
        if self._restore():  # else the class's step was called around this one: nothing was held back
            with torch.no_grad():
                self.after(optimizer)

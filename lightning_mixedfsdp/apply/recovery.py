"""The life cycle of a step on a sharded root: the callback when a backward finishes, and recovery when a forward or
backward raised (an OOM caught by the training loop, a NaN guard) before the next forward."""

from contextlib import contextmanager
from typing import Any, Callable, Iterator, List

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from lightning_mixedfsdp.compat.torch import inside_backward, queue_after_backward, reset_fsdp_iter_state
from lightning_mixedfsdp.model.tensors import tensors_in


class StepTracker:
    """Tracks a root module's forwards and the backwards through their outputs.

    ``on_backward_end`` callbacks run once at the end of every backward (two forwards before one backward still make
    one backward). If a forward or a backward raised, its end never came: the next root forward runs the
    ``on_reset`` callbacks first (FSDP's ``reset_iter_state``) and forgets the queued state, so the step after a
    caught failure behaves like a step after a skipped one.
    """

    def __init__(self) -> None:
        self._end_callbacks: List[Callable[[], None]] = []
        self._reset_callbacks: List[Callable[[], None]] = []
        self._forward_running = False
        self._backward_pending = False
        self._as_one = self._ended_inside = False
        self.resets = 0

    def on_backward_end(self, callback: Callable[[], None]) -> None:
        self._end_callbacks.append(callback)

    def on_reset(self, callback: Callable[[], None]) -> None:
        self._reset_callbacks.append(callback)

    def attach(self, root: nn.Module) -> List[RemovableHandle]:
        # before FSDP's own pre-forward (which unshards); the post-hook is not always_call: it runs only when the
        # forward returned
        return [
            root.register_forward_pre_hook(self._before_forward, prepend=True),
            root.register_forward_hook(self._after_forward),
        ]

    @torch.compiler.disable
    def _before_forward(self, *_: Any) -> None:
        if (self._forward_running or self._backward_pending) and not inside_backward():
            self._forward_running = self._backward_pending = False
            self.resets += 1
            for reset in self._reset_callbacks:
                reset()
        self._forward_running = True

    @torch.compiler.disable
    def _after_forward(self, _module: nn.Module, _args: Any, output: Any) -> None:
        self._forward_running = False
        for tensor in tensors_in(output):
            if tensor.requires_grad:
                tensor.register_hook(self._on_backward_start)

    def _on_backward_start(self, _grad: Tensor) -> None:
        if not self._backward_pending:
            self._backward_pending = True
            queue_after_backward(self._on_backward_end)

    def _on_backward_end(self) -> None:
        self._backward_pending = False
        if self._as_one:
            self._ended_inside = True
            return
        for callback in self._end_callbacks:
            callback()

    @contextmanager
    def as_one_backward(self) -> Iterator[None]:
        """The backwards inside (a pipeline step's micro-batches) count as one: the end callbacks run once, when the
        block exits without an error, if any backward ended inside."""
        self._as_one, self._ended_inside = True, False
        try:
            yield
        finally:
            self._as_one = False
        if self._ended_inside:
            for callback in self._end_callbacks:
                callback()


def reset_fsdp_step(root: nn.Module) -> None:
    """FSDP's own recovery for ``root`` (a root FSDPModule), plus the grads the failed backward left on the unsharded
    params, which would otherwise be added to the next step's."""
    reset_fsdp_iter_state(root)

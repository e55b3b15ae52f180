"""One pipeline step (and one evaluation) of a set-up model's stages, on torch's schedules.

The stages of one rank live in one module, the user's model cut down (``stage_forward.py``), whose root is an FSDP
unit sharded by the dtype plan over the stage's data-parallel ranks. torch's ``PipelineStage`` gets a thin caller per
stage, not the FSDP root itself, so the strategy, not the schedule, decides when gradients are reduced: the
micro-batches' backwards accumulate unsharded grads with gradient sync off, then every FSDP group reduce-scatters
once and the replicated params' grads are all-reduced once (the step tracker counts the step's backwards as one).
That holds with several stages sharing one root, where torch's per-stage reduction would reduce a stage's grads
before the other stage's backwards are done.

Losses are normalised before backward (``scale_grads=False``): a ``"mean"`` loss is divided by the number of
micro-batches, so gradients equal one process's on the whole batch and accumulate correctly over several steps.

Stage boundaries are static: before the first step of a micro-batch shape each stage runs micro-batch 0 forward
(no grad) and sends what it emits on, so every send and receive buffer has the shape and dtype its stage emits (a
bf16 hidden state, or fp32 where the plan's stage ends in fp32). Each step checks the emitted tensors against them.
"""

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Literal, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from lightning_mixedfsdp.apply.applier import AppliedPlan
from lightning_mixedfsdp.compat.torch import (
    finish_fsdp_backward,
    pipeline_schedule_class,
    reshard_fsdp_tree,
    schedule_step_without_outputs,
)
from lightning_mixedfsdp.planning.stages import Stage

LossFn = Callable[[Any, Any], Tensor]
LossReduction = Literal["mean", "sum"]
LOSS_REDUCTIONS = ("mean", "sum")

_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.float8_e4m3fn)
_HEADER = 8  # dtype, ndim, up to 6 sizes


@dataclass(frozen=True)
class Boundary:
    """What one stage receives and emits for a micro-batch of a given shape."""

    received: Tensor
    """A meta tensor: the stage's input (token ids on the first stage)."""
    emitted: Tensor
    """A meta tensor: the stage's output."""


class _StageCall(nn.Module):
    """What torch's ``PipelineStage`` runs for one stage: the shared root's forward for stage ``index``. The root is
    held, not registered, so torch sees a module with no FSDP in it and leaves gradient reduction to the runner."""

    _root: Any

    def __init__(self, root: nn.Module, index: int, emitted: Tensor, is_last: bool) -> None:
        super().__init__()
        object.__setattr__(self, "_root", root)
        self.index, self._emitted, self._is_last = index, emitted, is_last

    def forward(self, *args: Any, **kwargs: Any) -> Tensor:
        output = self._root(*args, pipeline_stage=self.index, **kwargs)
        if not self._is_last and (output.dtype != self._emitted.dtype or output.shape != self._emitted.shape):
            raise RuntimeError(
                f"mixed_fsdp2: pipeline stage {self.index} emitted {tuple(output.shape)} {output.dtype}, and its"
                f" send buffer holds {tuple(self._emitted.shape)} {self._emitted.dtype} (what it emitted for the first"
                " micro-batch of this shape); a stage must emit the same shape and dtype for every micro-batch."
            )
        return output


def _nothing_more() -> None:
    return None


class PipelineRunner:
    """The schedule of one set-up model's stages on this rank, and its step and evaluation."""

    def __init__(
        self,
        root: nn.Module,
        applied: AppliedPlan,
        stages: Sequence[Stage],
        num_stages: int,
        pipeline_group: Any,
        schedule: str,
        microbatches: int,
        device: torch.device,
        wrap_output: Callable[[Any], Any],
    ) -> None:
        import torch.distributed as dist

        self.root, self.applied, self.stages = root, applied, list(stages)
        self.num_stages, self.group, self.schedule_name = num_stages, pipeline_group, schedule
        self.microbatches, self.device, self._wrap_output = microbatches, device, wrap_output
        self.pipeline_size = dist.get_world_size(pipeline_group)
        self.pipeline_rank = dist.get_rank(pipeline_group)
        self.running = False
        # around each step's backward and reduction: the tied embeddings' grads held, then summed across stages
        self.before_backward: Callable[[], None] = _nothing_more
        self.after_backward: Callable[[], None] = _nothing_more
        self._schedules: Dict[Any, Tuple[Any, Dict[int, Boundary]]] = {}
        self._loss_fn: Optional[LossFn] = None
        self._loss_divisor = 1.0

    # ---- the step ----------------------------------------------------------------------------------------------

    def step(self, inputs: Any, target: Any, loss_fn: LossFn, reduction: LossReduction = "mean") -> Tensor:
        """Forward and backward of every micro-batch of ``inputs``; grads reduced once; the step's loss on every
        rank (the mean of the micro-batches' losses, or their sum for ``reduction="sum"``)."""
        args, kwargs = split_inputs(inputs, self.microbatches, self.pipeline_size)
        schedule, _ = self._schedule(args, kwargs)
        self._loss_fn, self._loss_divisor = loss_fn, float(self.microbatches if reduction == "mean" else 1)
        root = self.root
        root.set_requires_gradient_sync(False)  # type: ignore[operator]
        root.set_is_last_backward(False)  # type: ignore[operator]
        root.set_reshard_after_backward(False)  # type: ignore[operator]
        self.applied.reducer.requires_gradient_sync = False
        losses: List[Tensor] = []
        self.before_backward()
        try:
            with self._running(), self.applied.tracker.as_one_backward():
                schedule.step(
                    *(args if self._holds(0) else ()),
                    target=target if self._holds(self.num_stages - 1) else None,
                    losses=losses,
                    **schedule_step_without_outputs(schedule),  # the losses are all the step returns
                    **kwargs,
                )
                finish_fsdp_backward(root)
                self.applied.reducer.requires_gradient_sync = True
            self.after_backward()
        finally:
            self.applied.reducer.requires_gradient_sync = True
            root.set_requires_gradient_sync(True)  # type: ignore[operator]
        total = torch.stack([loss.detach().float() for loss in losses]).sum() if losses else None
        return self._from_last_stage(total)

    def _scaled_loss(self, output: Tensor, target: Any) -> Tensor:
        assert self._loss_fn is not None
        return self._loss_fn(self._wrap_output(output), target) / self._loss_divisor

    # ---- evaluation --------------------------------------------------------------------------------------------

    @torch.no_grad()
    def evaluate(self, inputs: Any, target: Any, loss_fn: LossFn, reduction: LossReduction = "mean") -> Tensor:
        """Forward of every micro-batch, stage after stage, no grad; the loss on every rank. The model is in eval
        mode meanwhile and back in its mode after."""
        args, kwargs = split_inputs(inputs, self.microbatches, self.pipeline_size)
        _, boundaries = self._schedule(args, kwargs)
        training = self.root.training
        self.root.eval()
        total: Optional[Tensor] = None
        try:
            with self._running():
                for index in range(self.microbatches):
                    micro_args, micro_kwargs = _microbatch(args, kwargs, index, self.microbatches)
                    output = self._forward_through(micro_args[0] if micro_args else None, micro_kwargs, boundaries)
                    if output is not None:
                        micro_target = _microbatch((target,), {}, index, self.microbatches)[0][0]
                        loss = loss_fn(self._wrap_output(output), micro_target).detach().float()
                        total = loss if total is None else total + loss
        finally:
            self.root.train(training)
            reshard_fsdp_tree(self.root)  # an optimizer step may come next: no stale gathered copy may stay
        if total is not None and reduction == "mean":
            total = total / self.microbatches
        return self._from_last_stage(total)

    # ---- schedules and boundaries ------------------------------------------------------------------------------

    def _holds(self, stage: int) -> bool:
        return stage % self.pipeline_size == self.pipeline_rank

    def _schedule(self, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Tuple[Any, Dict[int, Boundary]]:
        """torch's schedule for micro-batches of this shape (built once per shape)."""
        key = tuple((tuple(t.shape), t.dtype) for t in (*args, *kwargs.values()) if isinstance(t, Tensor))
        if key not in self._schedules:
            micro_args, micro_kwargs = _microbatch(args, kwargs, 0, self.microbatches)
            boundaries = self._boundaries(micro_args[0] if micro_args else None, micro_kwargs)
            torch_stages = [
                torch_stage(self.root, stage, boundaries[stage.index], self.num_stages, self.device, self.group)
                for stage in self.stages
            ]
            cls = pipeline_schedule_class(self.schedule_name)
            schedule = cls(
                torch_stages if len(torch_stages) > 1 else torch_stages[0],
                n_microbatches=self.microbatches,
                loss_fn=self._scaled_loss,
                scale_grads=False,
            )
            if len(self._schedules) >= 8:  # a few shapes (training, evaluation) stay built
                self._schedules.pop(next(iter(self._schedules)))
            self._schedules[key] = (schedule, boundaries)
        return self._schedules[key]

    @torch.no_grad()
    def _boundaries(self, first_input: Optional[Tensor], kwargs: Dict[str, Any]) -> Dict[int, Boundary]:
        """Every stage of this rank runs micro-batch 0 forward, in stage order across the ranks, and sends what it
        emits to the next stage's rank: the shapes and dtypes its buffers must have."""
        boundaries: Dict[int, Boundary] = {}
        try:
            with self._running():
                self._forward_through(first_input, kwargs, None, boundaries)
        finally:
            reshard_fsdp_tree(self.root)  # as torch's own shape inference does
        return boundaries

    def _forward_through(
        self,
        first_input: Optional[Tensor],
        kwargs: Dict[str, Any],
        known: Optional[Dict[int, Boundary]],
        record: Optional[Dict[int, Boundary]] = None,
    ) -> Optional[Tensor]:
        """One micro-batch through every stage in order (each rank runs its own): the last stage's output on its
        rank, None elsewhere. With ``known`` boundaries received buffers are allocated from them; without, each
        stage sends a header with the shape and dtype first (``record`` collects them)."""
        carried: Optional[Tensor] = first_input
        for stage in range(self.num_stages):
            if not self._holds(stage):
                continue
            if stage > 0 and not self._holds(stage - 1):
                carried = self._receive(stage, known)
            assert carried is not None
            received = carried
            carried = self.root(received, pipeline_stage=stage, **kwargs)
            if record is not None:
                record[stage] = Boundary(_meta(received), _meta(carried))
            if stage < self.num_stages - 1 and not self._holds(stage + 1):
                self._send(carried, stage + 1, header=known is None)
        return carried if self._holds(self.num_stages - 1) else None

    def _peer(self, stage: int) -> int:
        import torch.distributed as dist

        return dist.get_global_rank(self.group, stage % self.pipeline_size)

    def _send(self, tensor: Tensor, to_stage: int, header: bool) -> None:
        send(tensor, self._peer(to_stage), self.group, self.device, header)

    def _receive(self, stage: int, known: Optional[Dict[int, Boundary]]) -> Tensor:
        like = None if known is None else known[stage].received
        return receive(self._peer(stage - 1), self.group, self.device, like)

    def _from_last_stage(self, value: Optional[Tensor]) -> Tensor:
        return from_stage(value, self._peer(self.num_stages - 1), self.group, self.device)

    @contextmanager
    def _running(self) -> Iterator[None]:
        self.running = True
        try:
            yield
        finally:
            self.running = False


def torch_stage(
    root: nn.Module, stage: Stage, boundary: Boundary, num_stages: int, device: torch.device, group: Any
) -> Any:
    """torch's ``PipelineStage`` for ``stage``: a thin caller of the shared ``root``, its buffers as ``boundary``."""
    from torch.distributed.pipelining import PipelineStage

    return PipelineStage(
        _StageCall(root, stage.index, boundary.emitted, bool(stage.last)),
        stage.index,
        num_stages,
        device,
        input_args=(_example(boundary.received, requires_grad=stage.index > 0),),
        output_args=(_example(boundary.emitted, requires_grad=True),),
        group=group,
    )


def split_inputs(inputs: Any, microbatches: int, pipeline_size: int) -> Tuple[Tuple[Any, ...], Dict[str, Any]]:
    """``inputs`` as the first stage's positional input and the keyword inputs every stage gets (a dict's first
    entry, or ``input_ids``, is the first stage's); size-1 leading dims broadcast to the batch."""
    if isinstance(inputs, dict):
        kwargs = dict(inputs)
        key = "input_ids" if "input_ids" in kwargs else next(iter(kwargs))
        first = kwargs.pop(key)
    else:
        first, kwargs = inputs, {}
    if not isinstance(first, Tensor) or first.dim() == 0:
        raise TypeError(
            f"mixed_fsdp2: pipeline_step takes a batch tensor (or a dict of them) as `inputs`, got"
            f" {type(first).__name__}; pass the token ids (batch first), or a dict with `input_ids`."
        )
    batch = first.shape[0]
    if batch % microbatches:
        raise ValueError(
            f"mixed_fsdp2: a batch of {batch} does not split into pipeline_microbatches={microbatches}; use"
            f" a batch size that divides by {microbatches}, or set pipeline_microbatches to a divisor of"
            f" {batch} (at least pipeline_parallel_size={pipeline_size} for 1F1B and Interleaved1F1B)."
        )
    for name, value in kwargs.items():
        if isinstance(value, Tensor) and value.dim() > 0 and value.shape[0] == 1 and batch > 1:
            kwargs[name] = value.expand(batch, *value.shape[1:])
    return (first,), kwargs


def from_stage(value: Optional[Tensor], holder: int, group: Any, device: torch.device) -> Tensor:
    """``value`` (a scalar held by global rank ``holder``; None elsewhere) on every rank of ``group``, in fp32."""
    import torch.distributed as dist

    if value is None:
        value = torch.zeros((), dtype=torch.float32, device=device)
    value = value.to(device, torch.float32).reshape(())
    dist.broadcast(value, src=holder, group=group)
    return value


def send(tensor: Tensor, peer: int, group: Any, device: torch.device, header: bool) -> None:
    """``tensor`` to global rank ``peer``, after a header with its shape and dtype when the receiver does not know
    them yet."""
    import torch.distributed as dist

    if header:
        dist.send(_header(tensor, device), peer, group=group)
    dist.send(tensor.contiguous(), peer, group=group)


def receive(peer: int, group: Any, device: torch.device, like: Optional[Tensor]) -> Tensor:
    """A tensor from global rank ``peer``: shaped as the meta tensor ``like``, or as the header it sends first."""
    import torch.distributed as dist

    if like is None:
        header = torch.empty(_HEADER, dtype=torch.int64, device=device)
        dist.recv(header, peer, group=group)
        values = header.tolist()
        shape, dtype = tuple(values[2 : 2 + values[1]]), _DTYPES[values[0]]
    else:
        shape, dtype = tuple(like.shape), like.dtype
    buffer = torch.empty(shape, dtype=dtype, device=device)
    dist.recv(buffer, peer, group=group)
    return buffer


def _microbatch(
    args: Tuple[Any, ...], kwargs: Dict[str, Any], index: int, count: int
) -> Tuple[Tuple[Any, ...], Dict[str, Any]]:
    """Micro-batch ``index`` of ``count`` (tensors split along dim 0 as torch's schedules split them)."""

    def part(value: Any) -> Any:
        if isinstance(value, Tensor) and value.dim() > 0:
            return value.tensor_split(count)[index]
        return value

    return tuple(part(a) for a in args), {k: part(v) for k, v in kwargs.items()}


def _meta(tensor: Tensor) -> Tensor:
    return torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")


def _example(meta: Tensor, requires_grad: bool) -> Tensor:
    trains = requires_grad and meta.is_floating_point()
    return torch.empty(meta.shape, dtype=meta.dtype, device="meta", requires_grad=trains)


def _header(tensor: Tensor, device: torch.device) -> Tensor:
    if tensor.dim() > _HEADER - 2 or tensor.dtype not in _DTYPES:
        raise RuntimeError(
            f"mixed_fsdp2: a pipeline stage emitted {tuple(tensor.shape)} {tensor.dtype}; stages send tensors of"
            f" at most {_HEADER - 2} dims in one of {[str(d) for d in _DTYPES]}."
        )
    values = [_DTYPES.index(tensor.dtype), tensor.dim(), *tensor.shape]
    return torch.tensor(values + [0] * (_HEADER - len(values)), dtype=torch.int64, device=device)

"""Pipeline parallelism's face on both strategies: the model split into stages at setup, and the one call that
trains it, ``strategy.pipeline_step(model, inputs, target=..., loss_fn=...)`` (Lightning's contract has none: a
forward and a backward cannot be separate calls when micro-batches interleave them across ranks)."""

from typing import Any, Callable, List, Mapping, Optional
from weakref import WeakKeyDictionary

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from torch import Tensor, nn

from lightning_mixedfsdp.checkpoint.export import PipelineStages
from lightning_mixedfsdp.config import MixedFSDPConfig
from lightning_mixedfsdp.mesh import TENSOR_PARALLEL, ParallelMeshes
from lightning_mixedfsdp.model.names import unwrap_model, user_class_name
from lightning_mixedfsdp.model.pipeline_stages import mark_pipeline_stage, mark_tied_copies
from lightning_mixedfsdp.model_setup import ShardedModel
from lightning_mixedfsdp.pipelining.runner import LOSS_REDUCTIONS, LossFn, LossReduction, PipelineRunner
from lightning_mixedfsdp.pipelining.stage_forward import (
    PROBE_TOLERANCE,
    composed_stage_gap,
    cut_to_stages,
    output_wrapper,
)
from lightning_mixedfsdp.pipelining.tied import TiedAcrossStages
from lightning_mixedfsdp.planning.stages import (
    CHECKED_DECODERS,
    HF_DECODER,
    BlockLayout,
    Stage,
    block_layout,
    plan_stages,
    stages_of_rank,
    tied_to_head,
)


class PipelineMixin:
    """Splits a model into this rank's stages before the dtype plan shards them, and runs their steps."""

    _config: MixedFSDPConfig
    root_device: torch.device

    @property
    def meshes(self) -> ParallelMeshes:  # the strategy's (``mixin.py``)
        raise NotImplementedError

    def _init_pipelines(self) -> None:
        self._pipelines: "WeakKeyDictionary[nn.Module, PipelineRunner]" = WeakKeyDictionary()
        self._ties: "WeakKeyDictionary[nn.Module, TiedAcrossStages]" = WeakKeyDictionary()

    def _counted_elsewhere(self) -> List[Tensor]:
        """Params whose grad another rank's norm counts (the last stage's tied copies)."""
        return [param for tie in self._ties.values() if tie.copies for param in tie.params]

    @property
    def pipelined(self) -> bool:
        """Whether models are split into pipeline stages (``pipeline_parallel_size > 1``)."""
        return self._config.parallelism.pipeline_parallel_size > 1

    def _cut_to_stages(self, module: nn.Module, parallelize: Optional[Callable[..., Any]]) -> Callable[..., Any]:
        """Cut ``module`` down to this rank's stages (every rank plans the same, so every rank raises the same
        problems, before any collective); returns what completes the setup once the stage is sharded."""
        parallelism = self._config.parallelism
        owner = f"{type(self).__name__} ({user_class_name(module)})"
        size, per_rank = parallelism.pipeline_parallel_size, parallelism.stages_per_rank
        num_stages, split = size * per_rank, parallelism.pipeline_split
        stages, problems = plan_stages(module, num_stages, split)
        if parallelize is not None:
            problems.append(
                "pipeline_parallel_size > 1 with a `parallelize_fn` is not supported: the stages are sharded by the"
                " dtype plan; remove `parallelize_fn` (or `configure_model`'s own sharding)."
            )
        layout = block_layout(module, split)
        problems += _tied_rounding_problems(module, layout, self._config.dtypes.bf16_updates)
        if problems or stages is None or layout is None:
            raise ValueError(f"{owner}: " + " ".join(problems))
        block_outputs = _check_composed_stages(module, layout, stages, owner, self.root_device)
        mesh = self.meshes.pipeline
        assert mesh is not None
        mine = [stages[index] for index in stages_of_rank(mesh.get_local_rank(), size, per_rank)]
        tied = tied_to_head(module, layout)
        cut_to_stages(module, layout, mine, block_outputs)

        def complete(sharded: ShardedModel) -> None:
            import torch.distributed as dist
            from torch.distributed.fsdp import FSDPModule

            if sharded.applied is None or not isinstance(sharded.module, FSDPModule):
                raise ValueError(f"{owner}: a pipeline stage's root must be sharded by the dtype plan.")
            runner = PipelineRunner(
                sharded.module,
                sharded.applied,
                mine,
                num_stages,
                mesh.get_group(),
                parallelism.pipeline_schedule,
                parallelism.microbatches,
                self.root_device,
                output_wrapper(layout),
            )
            holds = {stage.index for stage in mine}
            tie = TiedAcrossStages.build(
                sharded.module, tied, self.meshes.root.mesh, 0 in holds, num_stages - 1 in holds
            )
            tie.start_equal(first_rank=dist.get_global_rank(mesh.get_group(), 0))
            runner.before_backward, runner.after_backward = tie.hold_grads, tie.sum_grads
            self._pipelines[sharded.module] = runner
            self._ties[sharded.module] = tie
            mark_tied_copies(sharded.module, {last: first for last, first in tied if last in tie.copies})
            mark_pipeline_stage(sharded.module, self.meshes.data_parallel.get_group())
            guard = _direct_call_guard(runner, type(self).__name__, [stage.index for stage in mine], num_stages)
            sharded.applied.handles.append(sharded.module.register_forward_pre_hook(guard, prepend=True))

        return complete

    def pipeline_step(
        self,
        model: nn.Module,
        inputs: Any,
        *,
        target: Any,
        loss_fn: LossFn,
        loss_reduction: LossReduction = "mean",
    ) -> Tensor:
        """One training step's forward and backward under pipeline parallelism; returns the step's loss on every
        rank. Call ``optimizer.step()`` after it as usual.

        ``model`` is what setup returned (this rank's stages). Every pipeline rank of one data-parallel replica
        passes that replica's ``inputs`` (token ids, batch first, or a dict of tensors whose ``input_ids`` go to
        the first stage and whose other entries, such as ``position_ids`` or ``attention_mask``, reach every stage)
        and ``target``; both are split into ``pipeline_microbatches`` along dim 0. ``loss_fn(output, target)``
        gets the last stage's output as the model returns it (an HF causal LM's output object, or a tensor) and a
        micro-batch's target. ``loss_reduction="mean"``: it returns the micro-batch's mean, and each is divided by
        the number of micro-batches before backward (gradients equal one process's on the whole batch with equal
        micro-batches); ``"sum"``: it is normalised over the whole batch already (e.g. divided by the batch's token
        count), and the micro-batches' losses add up. Calling it twice before ``optimizer.step()`` accumulates."""
        self._check_reduction("pipeline_step", loss_reduction)
        return self._runner_of(model, "pipeline_step").step(inputs, target, loss_fn, loss_reduction)

    def pipeline_eval(
        self,
        model: nn.Module,
        inputs: Any,
        *,
        target: Any,
        loss_fn: LossFn,
        loss_reduction: LossReduction = "mean",
    ) -> Tensor:
        """:meth:`pipeline_step`'s forward alone, under no grad, with the model in eval mode and back in its mode
        after; the loss on every rank."""
        self._check_reduction("pipeline_eval", loss_reduction)
        return self._runner_of(model, "pipeline_eval").evaluate(inputs, target, loss_fn, loss_reduction)

    def _check_reduction(self, method: str, reduction: str) -> None:
        if reduction not in LOSS_REDUCTIONS:
            raise ValueError(
                f"{type(self).__name__}.{method}: loss_reduction={reduction!r}; use 'mean' (loss_fn returns each"
                " micro-batch's mean) or 'sum' (loss_fn returns its share of a loss normalised over the whole batch)."
            )

    def _runner_of(self, model: nn.Module, method: str) -> PipelineRunner:
        module = unwrap_model(model)
        runner = self._pipelines.get(module) if self.pipelined else None
        if runner is None:
            reason = (
                "pipeline_parallel_size is 1"
                if not self.pipelined
                else f"this {user_class_name(module)} was not set up by it"
            )
            raise RuntimeError(
                f"{type(self).__name__}.{method}: {reason}; set pipeline_parallel_size > 1 and pass the model"
                " `setup` returned (or call the model directly without pipeline parallelism)."
            )
        return runner

    def _same_params_group(self) -> Optional[Any]:
        """The ranks that hold the same params: this stage's data-parallel ranks under pipeline parallelism; None
        (every rank) without."""
        return self.meshes.replicas.get_group() if self.pipelined else None

    def _export_stages(self, module: nn.Module) -> Optional[PipelineStages]:
        """How an export reaches across the stages (each stage's first data-parallel and tensor-parallel rank, in
        rank 0's pipeline group, sends to rank 0), or None without pipeline parallelism."""
        group = self._pipeline_group()
        if group is None:
            return None
        first_of_stage = self.meshes.data_parallel.get_local_rank() == 0 and self._tensor_parallel_rank() == 0
        tie = self._ties.get(unwrap_model(module))
        return PipelineStages(group, sends=first_of_stage, copies=tie.copies if tie is not None else ())

    def _tensor_parallel_rank(self) -> int:
        """This rank's place among its tensor-parallel ranks (0 without tensor parallelism)."""
        root = self.meshes.root
        return root[TENSOR_PARALLEL].get_local_rank() if TENSOR_PARALLEL in (root.mesh_dim_names or ()) else 0

    def _pipeline_group(self) -> Optional[Any]:
        """The pipeline ranks' group (gradient norms add up over it), or None."""
        return self.meshes.pipeline.get_group() if self.pipelined and self.meshes.pipeline is not None else None


def _check_composed_stages(
    module: nn.Module, layout: BlockLayout, stages: List[Stage], owner: str, device: torch.device
) -> Mapping[int, int]:
    """The stages run in order must compute what ``module``'s own forward computes, on a probe (the model still
    whole on every rank): refused on every rank where they do not (the largest gap over the ranks decides).
    Returns what each block of an HF decoder returns, as the probe saw."""
    import torch.distributed as dist

    probe = composed_stage_gap(module, layout, stages)
    worst = torch.tensor(-1.0 if probe.gap is None else probe.gap, device=device)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)  # inf stays inf; every rank decides alike
    name = user_class_name(module)
    if float(worst) < 0:
        checked = layout.family == HF_DECODER and getattr(module.config, "model_type", None) in CHECKED_DECODERS
        if not checked:  # a checked decoder's stages equal its forward to the bit (the suite)
            rank_zero_warn(
                f"{owner}: the pipeline stages of {name} were not checked against its forward ({probe.reason}):"
                " make sure its forward runs the modules before its block list, the blocks and the modules"
                " after, in order, and nothing else."
            )
    elif float(worst) > PROBE_TOLERANCE:
        raised = f" ({probe.reason})" if probe.reason else ""
        raise ValueError(
            f"{owner}: {name}'s pipeline stages, run in order, do not compute what {name}.forward computes (on a"
            f" probe their output is {float(worst):.3g} of its largest magnitude away from the forward's{raised}):"
            f" {_what_a_stage_runs(layout)} Make the forward only call the modules before the block list, the"
            " blocks and the modules after, moving the rest into those modules, or set pipeline_parallel_size=1."
        )
    return probe.block_outputs


def _tied_rounding_problems(module: nn.Module, layout: Optional[BlockLayout], rounding: str) -> List[str]:
    """A tied weight's two copies stay equal only if their updates round alike: random rounding draws per copy."""
    if layout is None or rounding == "nearest" or not tied_to_head(module, layout):
        return []
    return [
        f"bf16_updates={rounding!r} with a head tied to the embedding under pipeline stages: each stage's copy of"
        " the tied weight would round its updates with its own random stream and the two would drift apart; use"
        " bf16_updates='nearest', untie the head, or set pipeline_parallel_size=1."
    ]


def _what_a_stage_runs(layout: BlockLayout) -> str:
    if layout.family == HF_DECODER:
        return (
            "each stage runs the model's forward with the other stages' layers passed over, and a stage after the"
            " first receives hidden states as `inputs_embeds`; the forward does something to them that the first"
            " stage's embedding does not (a scale, a skip connection around the layers)."
        )
    return (
        "its forward does more than run its children in order (a scaled embedding, residual or logits, a soft-cap, a"
        " skip connection), and each stage runs only its own modules."
    )


def _direct_call_guard(runner: PipelineRunner, owner: str, held: Any, num_stages: int) -> Callable[..., None]:
    def refuse(_module: nn.Module, _args: Any) -> None:
        if not runner.running:
            raise RuntimeError(
                f"{owner}: under pipeline parallelism this model holds stages {held} of {num_stages}, and a forward"
                " runs across every stage's rank; call `strategy.pipeline_step(model, inputs, target=...,"
                " loss_fn=...)` (or `pipeline_eval`) instead of the model (in a LightningModule:"
                " `self.trainer.strategy.pipeline_step(self, ...)`)."
            )

    return refuse

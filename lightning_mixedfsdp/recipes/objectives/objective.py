"""The interface every objective implements, and what they share.

An objective is a LightningModule that says what a batch holds (:meth:`Objective.data`, checked before launch by
:meth:`Objective.data_problems`), the loss and its normalisation (:meth:`Objective.training_loss`), and what is
evaluated and logged (:meth:`Objective.evaluate`, ``evaluated``, :meth:`Objective.summary`). The base holds the rest
of a recipe's training: the model (the reference model, or an HF model built on the meta device in
``configure_model``, LoRA-wrapped if asked), loading a pretrained directory, AdamW with warm-up and a decay
(``optimizer.schedule``), and the ``train_loss`` and ``lr`` logs. A new objective is a subclass in its own file and
one line in ``registry.py``."""

import math
from abc import ABC, abstractmethod
from typing import Any, Callable, ClassVar, Dict, List, NamedTuple, Optional, Tuple

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor, nn
from typing_extensions import override

from lightning_mixedfsdp.apply.context_parallel import ContextParallel
from lightning_mixedfsdp.apply.muon import MUON_KEY, muon_with_adamw, split_summary
from lightning_mixedfsdp.checkpoint.load import load_full_weights
from lightning_mixedfsdp.config import MixedFSDPConfig
from lightning_mixedfsdp.recipes.data.text import TextCorpus
from lightning_mixedfsdp.recipes.models.hf import build_hf_model, freeze_matching, freeze_patterns, frozen_summary
from lightning_mixedfsdp.recipes.models.tiny_llama import TinyLlama
from lightning_mixedfsdp.recipes.settings.inputs import load_hf_config, reference_model_config
from lightning_mixedfsdp.recipes.settings.schema import ModelSection, PeftSection, Recipe

UNTRAINED_PPL = "untrained_ppl"
"""The logged name of the held-out evaluation before training (the sanity check's, which Lightning keeps from the
loggers, logged at step 0 by hand): the run's plot and a resumed launch's summary read it back."""


def warmup_cosine(step: int, warmup_steps: int, max_steps: int) -> float:
    """Learning-rate factor: linear warm-up, then cosine decay to 10%."""
    return lr_factor("cosine", step, warmup_steps, max_steps)


def lr_factor(shape: str, step: int, warmup_steps: int, max_steps: int) -> float:
    """The learning rate at ``step`` over its peak (``optimizer.schedule``): a linear warm-up over ``warmup_steps``,
    then ``cosine`` or ``linear`` decay to 10 % at ``max_steps``, or ``constant`` (the peak until the end)."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
    if shape == "constant":
        return 1.0
    if shape == "linear":
        return 1.0 - 0.9 * progress
    return 0.1 + 0.45 * (1 + math.cos(math.pi * progress))


def build_model(model: ModelSection, peft: PeftSection) -> nn.Module:
    """The recipe's model: the reference model (or its export) on the current device, an HF model on the meta device
    (the strategy initialises or loads it shard by shard), its ``model.freeze`` params frozen, LoRA-wrapped if
    asked."""
    reference = reference_model_config(model)
    if reference is not None:
        built = TinyLlama(reference)
        freeze_matching(built, model.freeze or [])
        return built
    trust = model.trust_remote_code
    config = load_hf_config(model.hf_source(), trust)
    return build_hf_model(config, peft.lora_arguments(), model.freeze, trust_remote_code=trust)


def before_after(evaluated: str, untrained: Optional[float], trained: Optional[float], steps: int) -> str:
    """A run's last line for a score: ``<evaluated>: A before -> B after N steps``."""
    first = f"{untrained:.3f} before" if untrained is not None else "not evaluated before"
    finish = f"{trained:.3f}" if trained is not None else "not evaluated"
    return f"{evaluated}: {first} -> {finish} after {steps} steps"


class Schedule(NamedTuple):
    """AdamW's settings and the learning rate's plan: linear warm-up, then ``shape`` (:func:`lr_factor`)."""

    lr: float
    weight_decay: float
    betas: Tuple[float, float]
    warmup_steps: int
    max_steps: int
    optimizer: str = "adamw"
    """``adamw``, or ``muon``: Muon for the blocks' matrices beside AdamW (``muon_with_adamw``)."""
    muon_lr: float = 0.02
    adjust_lr_fn: str = "original"
    pipelined: bool = False
    """Pipeline parallelism: each step runs ``strategy.pipeline_step`` under manual optimization."""
    gradient_clip: Optional[float] = None
    """The norm a pipelined step clips to (the Trainer's ``gradient_clip_val`` otherwise)."""
    shape: str = "cosine"
    """``optimizer.schedule``: ``cosine``, ``linear`` or ``constant`` after the warm-up."""

    @classmethod
    def of(cls, recipe: Recipe) -> "Schedule":
        optim = recipe.optimizer
        betas = (optim.betas[0], optim.betas[1])
        pipelined = recipe.strategy.parallelism.pipeline_parallel_size > 1
        return cls(
            optim.lr, optim.weight_decay, betas, optim.warmup_steps, recipe.trainer.max_steps, optim.name,
            optim.muon_lr, optim.adjust_lr_fn, pipelined, recipe.trainer.gradient_clip_val or None, optim.schedule,
        )  # fmt: skip


class PipelineBatch(NamedTuple):
    """What one pipelined step takes of a batch (``strategy.pipeline_step``'s arguments)."""

    inputs: Any
    target: Tensor
    loss_fn: Callable[[Any, Any], Tensor]
    reduction: str = "mean"
    """``mean``: ``loss_fn`` is a micro-batch's mean; ``sum``: it is normalised over the whole step already."""


class TrainingLoss(NamedTuple):
    loss: Tensor
    """What backward runs on: normalised so that the step's gradient is the objective's (over micro-batches and
    data-parallel ranks)."""
    logged: Tensor
    """``train_loss`` as logged: this micro-batch's own mean, comparable between steps."""


class Objective(pl.LightningModule, ABC):
    """One thing a recipe trains (see the module's docstring)."""

    formats: ClassVar[Tuple[str, ...]]
    """The data formats it trains on (``text``, ``chat``, ``instruction``): the recipe's data resolves to one."""
    evaluated: ClassVar[str]
    """What the held-out evaluation measures, as the console says it."""
    untrained_key: ClassVar[str] = UNTRAINED_PPL
    """The logged name of the held-out evaluation before training (logged at step 0 by hand): a resumed launch's
    summary reads it back."""
    pipelines: ClassVar[bool] = False
    """Whether it trains under pipeline parallelism (it implements :meth:`pipeline_batch`)."""

    def __init__(self, model: ModelSection, schedule: Schedule, peft: Optional[PeftSection] = None) -> None:
        super().__init__()
        self.model_section, self.schedule, self.peft = model, schedule, peft or PeftSection()
        # the reference model (or its export) is built here; an HF model in configure_model, on the meta device
        self.model: Optional[nn.Module] = build_model(model, self.peft) if reference_model_config(model) else None
        self.evaluations: Dict[str, float] = {}
        """The held-out evaluations of this launch: ``untrained`` (the sanity check), ``step N``."""
        self.automatic_optimization = not schedule.pipelined

    # -- what a batch holds

    @classmethod
    @abstractmethod
    def data(cls, recipe: Recipe) -> TextCorpus:
        """The recipe's data as this objective's batches (every recipe data module is a :class:`TextCorpus`: its
        tokenizer goes into the export)."""

    @classmethod
    @abstractmethod
    def data_problems(cls, recipe: Recipe, ranks: int) -> List[str]:
        """Why the recipe's data would not train on ``ranks`` data-parallel ranks, each with its fix (before launch)."""

    @classmethod
    def asked_for(cls, recipe: Recipe) -> Optional[str]:
        """The recipe key that asks for this objective without naming it (``teacher.pretrained``), or None."""
        return None

    @classmethod
    def recipe_problems(cls, recipe: Recipe) -> List[str]:
        """What else this objective needs of the recipe, each with its fix (before launch; its files exist)."""
        return []

    @classmethod
    def other_models(cls, recipe: Recipe) -> Dict[str, nn.Module]:
        """The models besides the recipe's ``model`` this objective trains with, by attribute (a frozen teacher),
        built on the current device (the dry run: meta)."""
        return {}

    @classmethod
    def strategy_needs(cls, recipe: Recipe, config: MixedFSDPConfig) -> None:
        """Set in the strategy's ``config`` what this objective's models need (a second model's keep-fp32 rules, its
        4-bit weights)."""

    @classmethod
    def from_recipe(cls, recipe: Recipe) -> "Objective":
        return cls(recipe.model, Schedule.of(recipe), recipe.peft, **cls.recipe_settings(recipe))

    @classmethod
    def recipe_settings(cls, recipe: Recipe) -> Dict[str, Any]:
        """What else this objective's constructor takes from the recipe, by keyword (its own sections)."""
        return {}

    # -- the loss and its normalisation

    @abstractmethod
    def training_loss(self, batch: Any) -> TrainingLoss:
        """This micro-batch's loss."""

    def pipeline_batch(self, batch: Any) -> PipelineBatch:
        """``batch`` as one pipelined step's inputs, target and loss (objectives with ``pipelines = True``)."""
        raise NotImplementedError(f"{type(self).__name__} does not train under pipeline parallelism yet.")

    # -- what is evaluated and logged

    @abstractmethod
    def evaluate(self, batch: Any) -> None:
        """Add a held-out batch to the evaluation (reported at the epoch's end)."""

    @classmethod
    @abstractmethod
    def summary(cls, untrained: Optional[float], trained: Optional[float], steps: int, pretrained: bool) -> str:
        """The run's last line, from the evaluations before (``untrained``) and after (``trained``) training."""

    def evaluation(self, step: Optional[int]) -> Optional[float]:
        """The held-out evaluation at optimizer step ``step``, or before training (``None``); None when there was
        none (before training: this launch resumed a run)."""
        return self.evaluations.get("untrained" if step is None else f"step {step}")

    # -- what every objective shares

    @override
    def configure_model(self) -> None:
        if self.model is None:
            self.model = build_model(self.model_section, self.peft)
        section = self.model_section
        patterns = section.freeze or []
        if reference_model_config(section) is None:
            patterns = freeze_patterns(load_hf_config(section.hf_source(), section.trust_remote_code), section.freeze)
        said = frozen_summary(self.model, patterns)
        if said is not None:
            rank_zero_info(said)

    @override
    def on_fit_start(self) -> None:
        # a resumed run restores its own weights; only a fresh run starts from the pretrained directory
        if self.model_section.pretrained is not None and self.trainer.ckpt_path is None:
            assert self.model is not None  # configure_model built it
            load_full_weights(self.model, self.model_section.pretrained)

    @override
    def on_train_start(self) -> None:
        """The learning rate is a pure function of the step and this command's ``lr``, ``warmup_steps`` and
        ``max_steps``, as the data order is of the step: a resumed run restores the scheduler's step, and a run
        extended with a larger ``max_steps`` continues on the cosine planned to the new end (the LR rises from
        where the shorter schedule left it to the new curve's value at this step). The checkpoint's optimizer and
        scheduler hold the old run's rates; set them from the plan: each group's own peak (Muon's groups
        ``muon_lr``, the rest ``lr``)."""
        optimizer = self.trainer.optimizers[0]
        scheduler = self.trainer.lr_scheduler_configs[0].scheduler
        plan = self.schedule
        factor = lr_factor(plan.shape, self.global_step, plan.warmup_steps, plan.max_steps)
        scheduler.base_lrs = [plan.muon_lr if group.get(MUON_KEY) else plan.lr for group in optimizer.param_groups]
        for group, peak in zip(optimizer.param_groups, scheduler.base_lrs, strict=True):
            group["lr"] = peak * factor

    @override
    def training_step(self, batch: Any, _: int) -> Tensor:
        if self.schedule.pipelined:
            return self.pipelined_step(batch)
        loss, logged = self.training_loss(batch)
        self.log("train_loss", logged, prog_bar=True)
        self.log("lr", self.trainer.optimizers[0].param_groups[0]["lr"])  # the rate this step's update uses
        return loss

    def pipelined_step(self, batch: Any) -> Tensor:
        """One optimizer step under pipeline parallelism (manual optimization; :func:`pipelined_step`)."""
        return pipelined_step(self, batch)

    @override
    def validation_step(self, batch: Any, _: int) -> None:
        self.evaluate(batch)

    @override
    def configure_optimizers(self) -> Any:
        trainable = [p for p in self.parameters() if p.requires_grad]  # LoRA: the adapters only
        plan = self.schedule
        optimizer: torch.optim.Optimizer
        if plan.optimizer == "muon":
            assert self.model is not None  # configure_model built it
            optimizer = muon_with_adamw(
                self.model, lr=plan.muon_lr, adamw_lr=plan.lr, weight_decay=plan.weight_decay,
                adjust_lr_fn=plan.adjust_lr_fn, adamw_betas=plan.betas,
            )  # fmt: skip
            rank_zero_info(f"optimizer: {split_summary(optimizer)}")
        else:
            optimizer = torch.optim.AdamW(trainable, lr=plan.lr, weight_decay=plan.weight_decay, betas=plan.betas)
        schedule = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: lr_factor(plan.shape, step, plan.warmup_steps, plan.max_steps)
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    def context_parallel(self) -> Optional[ContextParallel]:
        """The strategy's context parallelism when it splits sequences (None otherwise)."""
        context = getattr(self.trainer.strategy, "context_parallel", None)
        return context if isinstance(context, ContextParallel) and context.enabled else None

    def data_parallel_ranks(self) -> int:
        """The ranks whose gradients FSDP averages (context-parallel ranks share their rows)."""
        return int(self.trainer.strategy.distributed_sampler_kwargs["num_replicas"])  # type: ignore[attr-defined]

    def data_parallel_group(self) -> Any:
        """The process group of the ranks that see different batches, one of each tensor-parallel group (a count
        summed over it counts each batch once); None: every rank does."""
        meshes = getattr(self.trainer.strategy, "meshes", None)
        return meshes.data_parallel.get_group() if meshes is not None else None


def pipelined_step(objective: Objective, batch: Any) -> Tensor:
    """Every micro-batch's forward and backward through the stages, the clip (its norm over every stage), the
    optimizer's step and the scheduler's: what Lightning's automatic optimization does around a step."""
    optimizer: Any = objective.optimizers()  # one optimizer, one scheduler: configure_optimizers'
    scheduler: Any = objective.lr_schedulers()
    objective.log("lr", objective.trainer.optimizers[0].param_groups[0]["lr"])
    inputs, target, loss_fn, reduction = objective.pipeline_batch(batch)
    strategy: Any = objective.trainer.strategy
    loss = strategy.pipeline_step(objective.model, inputs, target=target, loss_fn=loss_fn, loss_reduction=reduction)
    clip = objective.schedule.gradient_clip
    if clip:
        objective.clip_gradients(optimizer, gradient_clip_val=clip, gradient_clip_algorithm="norm")
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    scheduler.step()
    objective.log("train_loss", loss, prog_bar=True)
    return loss

"""``PrecisionMonitor``: the bf16 params whose updates round away, named while training, with the keep-fp32 rule that
would keep them (``diagnostics/stalled_updates.py`` measures, ``diagnostics/stall_watch.py`` decides).

A Lightning callback for the Trainer, in the style of ``LearningRateMonitor``: every ``every_n_steps`` optimizer
steps it measures each trainable bf16 param's stalled share around the step, logs it to the Trainer's loggers
(``stalled_share/<param>``) and warns (the ``lightning_mixedfsdp`` logger, rank 0) about a param above ``threshold``
for ``patience`` samples in a row. Through Fabric, the same object wraps the optimizer step::

    monitor = PrecisionMonitor(every_n_steps=50)
    with monitor.around_step(model, optimizer, step):
        optimizer.step()
    fabric.log_dict(monitor.metrics, step=step)  # the latest sample's shares

Off the sampled steps it does nothing (no hooks on the model); a sampled step copies the local shards of the bf16
params once and runs one all-reduce."""

import logging
import weakref
from contextlib import contextmanager
from typing import Any, Dict, Iterator, List, Optional, Tuple

from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_mixedfsdp.diagnostics.stall_watch import StallWatch
from lightning_mixedfsdp.diagnostics.stalled_updates import LOW_PRECISION, StalledShare, StalledUpdates
from lightning_mixedfsdp.model.names import canonical_name, unwrap_model
from lightning_mixedfsdp.planning.report import format_plan
from lightning_mixedfsdp.planning.types import ShardPlan

log = logging.getLogger("lightning_mixedfsdp")
METRIC_PREFIX = "stalled_share/"


class PrecisionMonitor(Callback):
    """Names the trainable bf16 (or fp16) params whose updates round away.

    Args:
        every_n_steps: measure every this many optimizer steps (the first step included).
        threshold: a param is stalled on a sample when more than this share of its elements with a non-zero gradient
            did not change.
        patience: samples in a row a param must be stalled before it is named (once).
        log_shares: log each param's share to the Trainer's loggers on each sample.
    """

    def __init__(
        self, every_n_steps: int = 50, threshold: float = 0.5, patience: int = 3, log_shares: bool = True
    ) -> None:
        problems = []
        if not (isinstance(every_n_steps, int) and every_n_steps >= 1):
            problems.append(f"every_n_steps={every_n_steps!r} must be an int >= 1")
        if not 0 <= threshold < 1:
            problems.append(f"threshold={threshold!r} must be in [0, 1), e.g. 0.5")
        if not (isinstance(patience, int) and patience >= 1):
            problems.append(f"patience={patience!r} must be an int >= 1")
        if problems:
            raise ValueError(f"{type(self).__name__}: {'; '.join(problems)}.")
        self.every_n_steps, self.log_shares = every_n_steps, log_shares
        self.watch = StallWatch(threshold, patience)
        self.samples = 0
        self.kept_fp32: List[str] = []
        """The trainable params not in a low-precision dtype (kept fp32): not measured, nothing rounds away."""
        self._measure: Optional[StalledUpdates] = None
        self._hooked: "weakref.WeakSet[Optimizer]" = weakref.WeakSet()
        self._trainer: Any = None

    @property
    def metrics(self) -> Dict[str, float]:
        """The latest sample's stalled share of each measured param, by ``stalled_share/<name>``."""
        return {METRIC_PREFIX + name: share for name, share in self.shares.items()}

    @property
    def shares(self) -> Dict[str, float]:
        """The latest sample's stalled share of each measured param, by name."""
        return {name: share.share for name, share in self.watch.latest.items()}

    def report(self, plan: ShardPlan, prefix: str = "") -> str:
        """The dtype report of ``plan`` with a column of the latest shares (``prefix``: the name of the planned
        module in the monitored one, e.g. ``"model."`` for a LightningModule's ``self.model``)."""
        shares = {name[len(prefix) :]: share for name, share in self.shares.items() if name.startswith(prefix)}
        return format_plan(plan, stalled=shares)

    @property
    def named(self) -> Dict[str, str]:
        """The params named so far, with the ``keep_fp32_params`` rule suggested for each."""
        return dict(self.watch.named)

    def sampled(self, step: int) -> bool:
        return step % self.every_n_steps == 0

    def watch_model(self, model: nn.Module) -> None:
        """The params to measure: ``model``'s trainable ones, by canonical name."""
        inner = unwrap_model(model)  # Fabric's wrapper: the names of the user's model

        def named() -> List[Tuple[str, nn.Parameter]]:
            return [(canonical_name(name), p) for name, p in inner.named_parameters() if p.requires_grad]

        self._measure = StalledUpdates(named)
        self.kept_fp32 = [name for name, p in named() if p.dtype not in LOW_PRECISION]

    @contextmanager
    def around_step(self, model: nn.Module, optimizer: Optimizer, step: int) -> Iterator[None]:
        """Fabric: wrap ``optimizer.step()``; on a sampled ``step`` measure it, warn and update :attr:`metrics`."""
        if self._measure is None:
            self.watch_model(model)
        assert self._measure is not None
        if self.sampled(step):
            self._measure.before_step(optimizer)
        yield
        if self._measure.pending:
            self._take(self._measure.after_step(optimizer))

    def _take(self, shares: List[StalledShare]) -> None:
        self.samples += 1
        import torch.distributed as dist

        first = not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
        for warning in self.watch.add(shares):
            if first:
                log.warning(f"{type(self).__name__}: {warning}")

    def summary(self) -> str:
        """One line: how many samples, how many params measured and kept fp32, which were named."""
        measured = f"{len(self.watch.latest)} bf16 params measured, {len(self.kept_fp32)} kept fp32"
        if not self.watch.named:
            return f"precision monitor: {self.samples} samples, {measured}; none stalled"
        return f"precision monitor: {self.samples} samples, {measured}; stalled: " + ", ".join(
            f"{name} (keep_fp32_params=[{rule!r}])" for name, rule in self.watch.named.items()
        )

    # the Trainer's hooks
    @override
    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self._trainer = trainer
        self.watch_model(pl_module)

    @override
    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Optimizer) -> None:
        optimizer = getattr(optimizer, "_optimizer", optimizer)  # a LightningOptimizer
        if optimizer not in self._hooked:
            optimizer.register_step_post_hook(self._after_trainer_step)
            self._hooked.add(optimizer)
        if self._measure is not None and self.sampled(trainer.global_step):
            self._measure.before_step(optimizer)

    def _after_trainer_step(self, optimizer: Optimizer, *_: Any) -> None:
        if self._measure is None or not self._measure.pending:
            return
        self._take(self._measure.after_step(optimizer))
        trainer = self._trainer
        if self.log_shares and trainer is not None and trainer.is_global_zero and self.watch.latest:
            metrics = {**self.metrics, METRIC_PREFIX + "max": max(self.metrics.values())}
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step)

    @override
    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if trainer.is_global_zero:
            log.info(self.summary())

    @override
    def state_dict(self) -> Dict[str, Any]:
        return {"streaks": dict(self.watch.streaks), "named": dict(self.watch.named), "samples": self.samples}

    @override
    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        self.watch.streaks = dict(state_dict.get("streaks", {}))
        self.watch.named = dict(state_dict.get("named", {}))
        self.samples = int(state_dict.get("samples", 0))

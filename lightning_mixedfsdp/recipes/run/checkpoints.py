"""The runner's checkpoints: ``step=N.ckpt`` every ``trainer.checkpoint_every_n_steps`` optimizer steps (the newest
``trainer.keep_checkpoints`` kept), and ``last.ckpt`` when the fit ends, at ``max_steps`` or when a stop was asked
for (:class:`~lightning_mixedfsdp.recipes.run.stopping.StopRequest`); plus one held-out evaluation at the final step.

Lightning's ``ModelCheckpoint`` is not used: it writes ``last.ckpt`` only along with another save (or at the end when
nothing was saved before), and keeping "the newest k" needs a monitored metric. Saves go through the strategy
(``trainer.save_checkpoint``: every rank writes its shards, committed by rename), at optimizer-step boundaries.
"""

from pathlib import Path
from typing import Any, Optional

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from lightning_mixedfsdp.recipes.run.run_folder import RunFolder, saved_at
from lightning_mixedfsdp.recipes.run.stopping import StopRequest
from lightning_mixedfsdp.strategies.trainer import MixedFSDP2Strategy


class RunCheckpoints(Callback):
    def __init__(self, folder: RunFolder, every_n_steps: int, keep: int, stop: StopRequest) -> None:
        self.folder, self.every_n_steps, self.keep, self.stop = folder, every_n_steps, keep, stop
        self.stopped_at: Optional[int] = None
        """The step a stop request ended the fit at; None when it ran to ``max_steps``."""
        self._seen_step = -1

    @override
    def on_sanity_check_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.stop.install()  # after Lightning's own handlers, which it registers just before running the stage

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.stop.install()  # a resumed run has no sanity check
        self._seen_step = trainer.global_step

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        if step == self._seen_step:
            return  # inside a gradient accumulation: no optimizer step yet
        self._seen_step = step
        stop = self.stop.agreed(trainer.strategy)  # every rank, every step: one all-reduce of a flag
        final = step >= trainer.max_steps
        if self.every_n_steps and step % self.every_n_steps == 0 and not final:  # the final state goes to last.ckpt
            self._save(trainer, self.folder.numbered(step))
            self._remove_old(trainer)
        if final or stop:
            # saved here, inside the epoch, like every checkpoint of the run: a larger max_steps then continues the
            # same epoch (after on_train_end Lightning would count the epoch done, and max_epochs=1 reached)
            self._save(trainer, self.folder.last)
            trainer.should_stop = True
        if final:
            return  # Lightning validates before it honours should_stop: the final perplexity at any max_steps
        if stop:
            self.stopped_at = step
            trainer.limit_val_batches = 0  # ... but a preempted job may have seconds left: no validation now

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.stop.restore()  # before Lightning's teardown restores what was there before its own handlers

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self.stop.restore()

    def _save(self, trainer: pl.Trainer, path: Path) -> None:
        trainer.save_checkpoint(path, weights_only=False)
        strategy = trainer.strategy
        writes = strategy.writes_checkpoints() if isinstance(strategy, MixedFSDP2Strategy) else True
        by = "" if writes else ", written by another replica group"  # fault tolerance: one group writes each
        rank_zero_info(f"checkpoint: {path} (step {trainer.global_step}{by})")

    def _remove_old(self, trainer: pl.Trainer) -> None:
        """Keep the ``keep`` numbered checkpoints saved last (by save time, so an earlier branch of the run goes
        first), never the one this run resumed from."""
        if not trainer.is_global_zero:
            return
        numbered = sorted(self.folder.numbered_checkpoints(), key=saved_at)
        resumed = Path(trainer.ckpt_path).resolve() if trainer.ckpt_path is not None else None
        for path in numbered[: -self.keep]:
            if path.resolve() != resumed:
                trainer.strategy.remove_checkpoint(path)

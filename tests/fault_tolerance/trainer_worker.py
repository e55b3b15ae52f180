"""One replica group (one rank) of a fault-tolerant Trainer run: a small model on a resumable stream of numbered
samples, SGD with a per-step LR schedule and gradient accumulation of 2, a checkpoint every 2 steps into a folder the
groups share. Each rank appends JSON lines to ``g{replica}_r0.jsonl``: every micro-batch's sample numbers and the
Trainer's step, and every optimizer step's end (step, LR, vote, torchft's step). ``--discard-at K``: while the
Trainer's step is K, the group reports an error to torchft before the vote, which then discards that step.

python -m tests.fault_tolerance.trainer_worker --folder F --replica-id R --lighthouse URL --max-steps N
    [--resume CKPT] [--discard-at K]
"""

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any, Dict, Iterator, Optional

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, Sampler

WORKER = "tests.fault_tolerance.trainer_worker"
ACCUMULATE = 2
BATCH = 2
SAMPLES = 256
BASE_LR = 0.1


def lr_factor(step: int) -> float:
    return 1.0 / (1.0 + step)


def stream_ids(position: int, replica_id: int, groups: int = 2) -> list:
    """The sample numbers of micro-batch ``position`` of group ``replica_id``'s own stream."""
    first = (position * groups + replica_id) * BATCH
    return [(first + i) % SAMPLES for i in range(BATCH)]


class Numbered(Dataset):
    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.tensor(index)


class GroupStream(Sampler[int]):
    """This group's samples, from the micro-batches the Trainer consumed (read when the iteration begins: a heal
    before the first batch moves it)."""

    def __init__(self, trainer: Any, replica_id: int, micro_batches: int) -> None:
        self.trainer, self.replica_id, self.micro_batches = trainer, replica_id, micro_batches

    def __len__(self) -> int:
        return self.micro_batches * BATCH

    def __iter__(self) -> Iterator[int]:
        from lightning_mixedfsdp.strategies.lightning_compat import micro_batches_consumed

        for position in range(micro_batches_consumed(self.trainer), self.micro_batches):
            yield from stream_ids(position, self.replica_id)


def main() -> None:
    import lightning.pytorch as pl

    from lightning_mixedfsdp.pytorch import MixedFSDP2Strategy

    parser = argparse.ArgumentParser()
    parser.add_argument("--folder", type=Path, required=True)
    parser.add_argument("--replica-id", type=int, required=True)
    parser.add_argument("--lighthouse", required=True)
    parser.add_argument("--max-steps", type=int, required=True)
    parser.add_argument("--resume", default=None)
    parser.add_argument("--discard-at", type=int, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    log = (args.folder / f"g{args.replica_id}_r0.jsonl").open("a")

    def write(record: Dict[str, Any]) -> None:
        log.write(json.dumps({**record, "pid": os.getpid(), "time": time.time()}) + "\n")
        log.flush()

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.model = nn.Sequential(nn.Embedding(SAMPLES, 8), nn.LayerNorm(8), nn.Linear(8, 1))
            self.reported_at: Optional[int] = None

        def training_step(self, batch: torch.Tensor, _: int) -> torch.Tensor:
            total = self.trainer.fit_loop.epoch_loop.batch_progress.total
            write(
                {
                    "event": "batch",
                    "step": self.trainer.global_step,
                    "ids": batch.tolist(),
                    "progress": [total.ready, total.started, total.processed, total.completed],
                }
            )
            return (self.model(batch).squeeze(-1) - batch.float() / SAMPLES).pow(2).mean()

        def on_after_backward(self) -> None:
            step = self.trainer.global_step
            if step == args.discard_at and self.reported_at != step:
                self.reported_at = step
                self.trainer.strategy.torchft_manager.report_error(RuntimeError("injected by the test"))

        def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
            strategy = self.trainer.strategy
            if strategy.fault_tolerance.session.last_decision is None:
                return  # inside an accumulation: no vote yet
            write(
                {
                    "event": "step",
                    "step": self.trainer.global_step,
                    "lr": self.trainer.optimizers[0].param_groups[0]["lr"],
                    "committed": strategy.fault_tolerance.session.last_decision,
                    "torchft_step": strategy.torchft_manager.current_step(),
                    "digest": float(sum(p.double().sum() for p in self.parameters())),
                }
            )
            if self.trainer.global_step % 2 == 0 and strategy.fault_tolerance.session.last_decision:
                self.trainer.save_checkpoint(args.folder / "checkpoints" / f"step={self.trainer.global_step}.ckpt")

        def configure_optimizers(self) -> Any:
            optimizer = torch.optim.SGD(self.parameters(), lr=BASE_LR)
            schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    class Data(pl.LightningDataModule):
        def train_dataloader(self) -> DataLoader:
            micro_batches = args.max_steps * ACCUMULATE * 2
            sampler = GroupStream(self.trainer, args.replica_id, micro_batches)
            return DataLoader(Numbered(), batch_size=BATCH, sampler=sampler)

    fault_tolerance = dict(
        replica_id=args.replica_id,
        num_replica_groups=2,
        lighthouse=args.lighthouse,
        min_replicas=2,
        timeout_s=30,
        quorum_timeout_s=60,
        connect_timeout_s=5,
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=MixedFSDP2Strategy(fault_tolerance=fault_tolerance),
        max_steps=args.max_steps,
        max_epochs=1,
        accumulate_grad_batches=ACCUMULATE,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
    )
    trainer.fit(Module(), datamodule=Data(), ckpt_path=args.resume)
    write({"event": "end", "step": trainer.global_step})
    log.close()


if __name__ == "__main__":
    main()

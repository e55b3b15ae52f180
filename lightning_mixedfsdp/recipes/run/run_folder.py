"""The run folder (``output.dir``): where a run keeps its checkpoints, logs, plot, console log and export, and which
checkpoint a run continues from. Decided in the launching process, before any training process starts; every refusal
is one line naming the folder and the fix."""

import re
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional

from lightning_mixedfsdp.checkpoint.atomic import is_sharded_checkpoint, recover

LAST = "last.ckpt"
_NUMBERED = re.compile(r"^step=(\d+)\.ckpt$")
_LIGHTNING_HPC = re.compile(r"^hpc_ckpt_\d+\.ckpt$")
"""Lightning's SLURM auto-requeue saves ``hpc_ckpt_N.ckpt`` in the Trainer's ``default_root_dir`` (the run folder)."""
_LOG_VERSION = re.compile(r"^version_(\d+)$")
_META = "meta.pt"
"""What Lightning's ``ModelParallelStrategy`` writes beside a DCP checkpoint's shards: the loop state, global step
included (its ``_METADATA_FILENAME``)."""


class RunFolderError(RuntimeError):
    """A run folder and a command that do not fit together (nothing to resume, a finished run, an earlier run's
    checkpoints in the way); the message is one line with the fix."""


@dataclass(frozen=True)
class RunFolder:
    root: Path
    shared_checkpoints: Optional[Path] = None
    """Under fault tolerance, the checkpoints folder every replica group's run folder shares (each checkpoint is
    written by one group); None: ``root/checkpoints``."""

    @classmethod
    def of(cls, output_dir: str, replica_id: Optional[int] = None) -> "RunFolder":
        """The run folder of ``output.dir``; for a fault-tolerant replica group, ``output.dir/replica_<id>`` (console
        log, metrics, plot, export) with the job's one ``output.dir/checkpoints``."""
        if replica_id is None:
            return cls(Path(output_dir))
        return cls(Path(output_dir) / f"replica_{replica_id}", Path(output_dir) / "checkpoints")

    @property
    def checkpoints(self) -> Path:
        return self.shared_checkpoints if self.shared_checkpoints is not None else self.root / "checkpoints"

    @property
    def last(self) -> Path:
        return self.checkpoints / LAST

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    def next_log_version(self) -> int:
        """The ``logs/version_N`` this launch writes: one past the highest a launch left there. Every logger of the
        launch takes this one number, so the CSV log and TensorBoard's events land in the same folder."""
        taken = [int(m.group(1)) for p in self.logs.glob("version_*") if (m := _LOG_VERSION.match(p.name))]
        return max(taken, default=-1) + 1

    @property
    def export(self) -> Path:
        return self.root / "export"

    @property
    def adapter(self) -> Path:
        return self.root / "adapter"

    @property
    def plot(self) -> Path:
        return self.root / "metrics.png"

    @property
    def console(self) -> Path:
        return self.root / "console.log"

    def numbered(self, step: int) -> Path:
        return self.checkpoints / f"step={step}.ckpt"

    def numbered_checkpoints(self) -> List[Path]:
        """``step=N.ckpt`` checkpoints, oldest step first."""
        if not self.checkpoints.is_dir():
            return []
        found = [(int(m.group(1)), p) for p in self.checkpoints.iterdir() if (m := _NUMBERED.match(p.name))]
        return [path for _, path in sorted(found)]

    def saved_checkpoints(self) -> List[Path]:
        """Every complete checkpoint of the run: ``last.ckpt``, the numbered ones and Lightning's SLURM ``hpc_ckpt_N``.
        A commit that a kill interrupted is finished first (the previous checkpoint put back)."""
        for folder in (self.checkpoints, self.root):
            for aside in folder.glob(".*.old-*") if folder.is_dir() else []:
                recover(folder / aside.name[1:].rsplit(".old-", 1)[0])
        candidates = [self.last, *self.numbered_checkpoints()]
        if self.root.is_dir():
            candidates += [p for p in self.root.iterdir() if _LIGHTNING_HPC.match(p.name)]
        return [p for p in candidates if is_sharded_checkpoint(p) or p.is_file()]

    def latest_checkpoint(self) -> Optional[Path]:
        """The checkpoint saved most recently (by the time its metadata was written): what the run's last command
        left, whichever way it stopped."""
        saved = self.saved_checkpoints()
        return max(saved, key=saved_at) if saved else None


def checkpoint_step(path: Path) -> int:
    """The optimizer steps a checkpoint holds, read from its metadata (tensors are not loaded)."""
    import torch

    state = torch.load(_metadata_file(path), map_location="cpu", weights_only=False, mmap=path.is_file())
    return int(state["global_step"])


def saved_at(path: Path) -> int:
    """When a checkpoint was saved (ns): the time its metadata, written last, was written."""
    return _metadata_file(path).stat().st_mtime_ns


def _metadata_file(path: Path) -> Path:
    return path / _META if path.is_dir() else path


def resume_from(folder: RunFolder, resume: Optional[str], max_steps: int, under_slurm: bool) -> Optional[Path]:
    """The checkpoint this command continues from, or None for a fresh start.

    ``--resume last`` takes the newest checkpoint in the run folder, ``--resume PATH`` that one. Without
    ``--resume``, a folder that holds checkpoints is refused (a fresh run would mix its checkpoints with the earlier
    run's), except under SLURM, where a requeued job reruns its command unchanged and continues, as Lightning's own
    requeue does, and for a fault-tolerant replica group (``under_slurm=True`` for both), restarted with its command
    unchanged. A checkpoint already at ``max_steps`` is refused too: there is nothing to train.
    """
    latest = folder.latest_checkpoint()
    if resume is None:
        if latest is None:
            return None
        if not under_slurm:
            raise RunFolderError(
                f"{folder.root} holds the checkpoints of an earlier run (newest: {latest.name}, step"
                f" {checkpoint_step(latest)}); continue it with --resume last (add trainer.max_steps=N to train"
                " longer), or set output.dir to a new folder"
            )
        checkpoint = latest
    elif resume == "last":
        if latest is None:
            raise RunFolderError(
                f"--resume last: {folder.checkpoints} holds no checkpoint (no run saved one there); start without"
                " --resume, or set output.dir to the folder of the run to continue"
            )
        checkpoint = latest
    else:
        checkpoint = Path(resume)
        if not (is_sharded_checkpoint(checkpoint) or checkpoint.is_file()):
            raise RunFolderError(
                f"--resume {resume}: no checkpoint there; pass a checkpoint (e.g. {folder.numbered(50)}) or 'last'"
            )
    step = checkpoint_step(checkpoint)
    if step >= max_steps:
        raise RunFolderError(
            f"{checkpoint} is at step {step} and trainer.max_steps={max_steps}: the run is done; pass"
            f" trainer.max_steps=N with N > {step} to train on"
        )
    return checkpoint

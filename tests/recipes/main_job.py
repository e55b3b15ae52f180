"""The main job at tiny sizes through the runner as a user runs it (``python -m lightning_mixedfsdp.train`` in a
subprocess, 2 CPU processes): one uninterrupted run, one stopped by SIGTERM to its process group under ``timeout``
and one under torchrun, their resumes, and the finished run extended; and the main job with Muon (on forked ranks:
``runner_ranks.py``).
``tests/recipes/conftest.py`` runs them once for the session (``main_job``): ``test_runner.py`` and
``test_muon_recipe.py`` check what they left behind, ``test_sft_runner.py`` fine-tunes their export."""

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Dict, List

import torch

from lightning_mixedfsdp.recipes.run.plot import read_metrics
from tests.launch_together import run_together
from tests.recipes.runner_ranks import run_recipe

ROOT = Path(__file__).resolve().parents[2]
STEPS, EXTENDED, EVERY, KEEP, VALIDATE_EVERY = 24, 30, 4, 2, 12
RECIPE = str(ROOT / "conf" / "stdlib_llama.yaml")
OVERRIDES = [
    f"trainer.max_steps={STEPS}", f"trainer.val_check_interval={VALIDATE_EVERY}",
    f"trainer.checkpoint_every_n_steps={EVERY}", f"trainer.keep_checkpoints={KEEP}", "trainer.log_every_n_steps=1",
    "model.dim=32", "model.hidden_dim=64", "model.n_layers=2", "data.seq_len=64", "data.val_windows=17",
    "data.max_bytes=300000", "optimizer.lr=0.01",
]  # fmt: skip
"""17 held-out windows on 2 ranks of batch 8: split 9/8, rank 0 would run a second FSDP forward rank 1 never joins
(a hang); each rank evaluates 8."""
TINY = ["--config", RECIPE, *OVERRIDES]
MUON = ["optimizer.name=muon", "optimizer.muon_lr=0.05", "trainer.max_steps=20", "trainer.checkpoint_every_n_steps=0"]
"""The main job with Muon for the blocks' matrices beside AdamW (``test_muon_recipe.py``), at a Muon lr of its own."""
PROBE = Path(re.__file__).read_bytes()[:64]


def command(*args: str) -> List[str]:
    return [sys.executable, "-m", "lightning_mixedfsdp.train", *args]


def train(*args: str) -> str:
    completed = subprocess.run(command(*args), cwd=ROOT, capture_output=True, text=True, timeout=300)
    out = completed.stdout + completed.stderr
    assert completed.returncode == 0, out[-5000:]
    return out


UNDER_TIMEOUT = ["timeout", "-s", "TERM", "600"]
"""A batch script's or CI's wrapper: signalled, ``timeout`` sends the signal to its child and then to its whole
process group again, so the first rank gets the request three times and the others twice, within milliseconds."""
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
"""torchrun forwards each signal it gets to its workers (in a session of their own, which a group signal misses)."""


REQUESTED = "SIGTERM: stopping at the next step boundary"
"""What rank 0 says once its handler has seen the request."""


def train_until_sigterm(output: Path, launcher: List[str]) -> Dict[str, Any]:
    """Start the run under ``launcher`` in its own process group (as a shell starts a job), wait for its first
    numbered checkpoint, then SIGTERM the group, as Ctrl-C or a scheduler signals every process of the job. Once
    rank 0 says it has the request, SIGTERM the group again, as a forwarding launcher does (``srun`` passing on
    ``scancel``'s signal): sent after the first was delivered, the copy cannot merge with it into one pending
    signal."""
    run = command(*TINY, f"output.dir={output}")
    if TORCHRUN[-1] in launcher:
        run = [*launcher, "-m", *run[2:]]  # torchrun -m lightning_mixedfsdp.train ...
    else:
        run = [*launcher, *run]
    process = subprocess.Popen(
        run,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    lines: List[str] = []
    requested = threading.Event()

    def read() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            lines.append(line)
            if REQUESTED in line:
                requested.set()
        requested.set()  # the output ended: nothing more will come

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    first = output / "checkpoints" / f"step={EVERY}.ckpt"
    deadline = time.monotonic() + 240  # bounds a hang only: the loop ends when the checkpoint appears
    while not first.is_dir() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    os.killpg(process.pid, signal.SIGTERM)
    requested.wait(timeout=240)  # bounds a hang only
    with contextlib.suppress(ProcessLookupError):  # a group that is gone already: the output says why
        os.killpg(process.pid, signal.SIGTERM)
    process.wait(timeout=240)
    reader.join(timeout=240)  # the workers of torchrun hold the output after torchrun ended
    assert not reader.is_alive(), "".join(lines)[-3000:]
    return {"out": "".join(lines), "returncode": process.returncode}


def losses(output: Path) -> Dict[int, float]:
    return read_metrics(output / "logs")["train_loss"]


def main_job_runs(root: Path) -> Dict[str, Any]:
    """The uninterrupted run (its export kept before it is extended), the interrupted ones (under ``timeout`` and
    under torchrun) and their resumes, and the extension of the uninterrupted one, in ``root``: the first three
    launched together, then the last three."""
    whole, stopped, torchrun = root / "whole", root / "stopped", root / "torchrun"
    out: Dict[str, Any] = {"whole": whole, "stopped": stopped, "torchrun": torchrun, "export": root / "export"}
    first = run_together(
        {
            "whole_out": lambda: train(*TINY, f"output.dir={whole}"),
            "interrupted": lambda: train_until_sigterm(stopped, UNDER_TIMEOUT),
            "torchrun_interrupted": lambda: train_until_sigterm(torchrun, [*UNDER_TIMEOUT, *TORCHRUN]),
            "muon_out": lambda: run_recipe(*TINY, *MUON, f"output.dir={root / 'muon'}", output=root / "muon"),
        }
    )
    out.update(first)
    out["whole_losses"] = losses(whole)
    out["whole_metrics"] = read_metrics(whole / "logs")
    out["numbered_after_whole"] = sorted(p.name for p in (whole / "checkpoints").glob("step=*.ckpt"))
    out["whole_step"] = checkpoint_step(whole / "checkpoints" / "last.ckpt")
    os.rename(whole / "export", out["export"])
    out["trained"] = dcp_model_state(whole / "checkpoints" / "last.ckpt", root)
    out["stopped_step"] = checkpoint_step(stopped / "checkpoints" / "last.ckpt")
    out["stopped_exported"] = (stopped / "export").exists()
    out["torchrun_step"] = checkpoint_step(torchrun / "checkpoints" / "last.ckpt")
    second = run_together(
        {
            "resumed_out": lambda: train(*TINY, f"output.dir={stopped}", "--resume", "last"),
            "torchrun_resumed_out": lambda: train(*TINY, f"output.dir={torchrun}", "--resume", "last"),
            "extended_out": lambda: train(
                *TINY, f"output.dir={whole}", "--resume", "last", f"trainer.max_steps={EXTENDED}"
            ),
        }
    )
    out.update(second)
    return out


def checkpoint_step(path: Path) -> int:
    from lightning_mixedfsdp.recipes.run.run_folder import checkpoint_step

    return checkpoint_step(path)


def dcp_model_state(checkpoint: Path, tmp: Path) -> Dict[str, torch.Tensor]:
    """The model weights of a Trainer DCP checkpoint, every tensor in the dtype training kept it in."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(checkpoint), str(tmp / "checkpoint.pt"))
    state = torch.load(tmp / "checkpoint.pt", weights_only=False)["state_dict"]
    return {name[len("model.") :]: value for name, value in state.items()}

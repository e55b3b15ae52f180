"""The recipe runner under fault tolerance, as README runs it: a lighthouse, then replica groups, each its own
``python -m lightning_mixedfsdp.train ... strategy.fault_tolerance.replica_id=N`` launch of 2 CPU ranks through the
Trainer. Group 0 first trains alone to step 6 and stops (checkpoints at 3 and 6). Then both groups launch, every
quorum waiting for both (``min_replicas=2`` at the lighthouse and in the groups): group 0 continues from the newest
checkpoint, group 1 from step 3, and heals from group 0 inside the Trainer's loop (its step count, model, optimizer
and data position come from the live group); both stop at ``max_steps`` and export the same weights to the bit. The
order of events is fixed by the exits and the quorums, never by which process is faster."""

import re
import subprocess
import sys
from typing import Any, Dict, List

import pytest
import torch
from safetensors.torch import load_file

from lightning_mixedfsdp.recipes.run.plot import read_metrics
from lightning_mixedfsdp.testing.replica_groups import start_lighthouse
from tests.recipes.main_job import RECIPE, ROOT

pytest.importorskip("torchft")

STEPS, ALONE, EVERY = 12, 6, 3
OVERRIDES = [
    f"trainer.val_check_interval={STEPS}", f"trainer.checkpoint_every_n_steps={EVERY}", "trainer.keep_checkpoints=20",
    "trainer.log_every_n_steps=1", "model.dim=32", "model.hidden_dim=64", "model.n_layers=2", "data.seq_len=64",
    "data.val_windows=16", "data.max_bytes=300000", "optimizer.lr=0.01", "strategy.print_report=false",
    "strategy.fault_tolerance.num_replica_groups=2",
]  # fmt: skip


@pytest.fixture(scope="module")
def groups(folder: Any) -> Dict[str, Any]:
    root = folder

    def launch(replica_id: int, url: str, extra: List[str]) -> subprocess.Popen:
        command = [sys.executable, "-m", "lightning_mixedfsdp.train", "--config", RECIPE, *OVERRIDES, *extra]
        command += [f"output.dir={root}", f"strategy.fault_tolerance.replica_id={replica_id}"]
        command += [f"strategy.fault_tolerance.lighthouse={url}"]
        out = (root / f"group{replica_id}.out").open("a")
        return subprocess.Popen(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    def finish(processes: List[subprocess.Popen]) -> List[int]:
        try:
            return [process.wait(timeout=240) for process in processes]
        finally:
            for process in processes:
                if process.poll() is None:
                    process.kill()

    alone = start_lighthouse()
    try:
        assert finish([launch(0, alone.address(), [f"trainer.max_steps={ALONE}"])]) == [0], _tails(root)
    finally:
        alone.shutdown()
    together = start_lighthouse(min_replicas=2)
    try:
        both = [f"trainer.max_steps={STEPS}", "strategy.fault_tolerance.min_replicas=2"]
        first = launch(0, together.address(), both)
        second = launch(1, together.address(), [*both, "--resume", str(root / "checkpoints" / f"step={EVERY}.ckpt")])
        assert finish([first, second]) == [0, 0], _tails(root)
    finally:
        together.shutdown()
    outputs = [(root / f"group{g}.out").read_text() for g in (0, 1)]
    return {"root": root, "outputs": outputs}


def _tails(root: Any) -> str:
    return "\n".join((root / f"group{g}.out").read_text()[-3000:] for g in (0, 1) if (root / f"group{g}.out").exists())


def test_both_groups_stop_at_max_steps_and_export_the_same_weights_to_the_bit(groups: Dict[str, Any]) -> None:
    root = groups["root"]
    finals = [re.search(rf"-> ([0-9.]+) after {STEPS} steps", output) for output in groups["outputs"]]
    assert all(finals), groups["outputs"][0][-2000:]
    # each group evaluates the whole held-out set with its own ranks: equal weights, equal perplexity
    assert finals[0].group(1) == finals[1].group(1)  # type: ignore[union-attr]
    exports = [load_file(root / f"replica_{g}" / "export" / "model.safetensors") for g in (0, 1)]
    assert exports[0].keys() == exports[1].keys()
    for name, tensor in exports[0].items():
        assert torch.equal(tensor.view(-1).view(torch.uint8), exports[1][name].view(-1).view(torch.uint8)), name
    assert exports[0]["norm.weight"].dtype == torch.float32  # fp32 norms stay fp32 across groups too


def test_the_late_group_healed_from_the_live_one_and_drew_its_own_data(groups: Dict[str, Any]) -> None:
    root = groups["root"]
    losses = [read_metrics(root / f"replica_{g}" / "logs")["train_loss"] for g in (0, 1)]
    assert min(losses[1]) == ALONE  # it resumed at step EVERY and healed to group 0's step ALONE before its first batch
    common = [step for step in losses[1] if step in losses[0] and step >= ALONE]
    assert len(common) == STEPS - ALONE
    assert all(losses[0][step] != losses[1][step] for step in common)  # each group its own data


def test_the_groups_share_one_checkpoints_folder_and_one_group_writes_each_checkpoint(groups: Dict[str, Any]) -> None:
    root = groups["root"]
    assert (root / "checkpoints" / "last.ckpt").is_dir()
    assert not any((root / f"replica_{g}" / "checkpoints").exists() for g in (0, 1))
    said = [output.count(f"(step {STEPS}, written by another replica group)") for output in groups["outputs"]]
    assert sorted(said) == [0, 1]

"""The recipe runner under fault tolerance, as README runs it: a lighthouse, then two replica groups, each its own
``python -m lightning_mixedfsdp.train ... strategy.fault_tolerance.replica_id=N`` launch of 2 CPU ranks through the
Trainer. Group 1 starts once group 0 has trained (and checkpointed) alone: it continues from that checkpoint, then
heals from group 0 inside the Trainer's loop (its step count, model and optimizer come from the live group); both stop
at ``max_steps`` and export the same weights to the bit."""

import re
import subprocess
import sys
import time
from typing import Any, Dict

import pytest
import torch
from safetensors.torch import load_file

from lightning_mixedfsdp.recipes.plot import read_metrics
from lightning_mixedfsdp.testing.replica_groups import start_lighthouse
from tests.recipes.test_runner import RECIPE, ROOT

pytest.importorskip("torchft")

STEPS = 70
OVERRIDES = [
    f"trainer.max_steps={STEPS}", "trainer.val_check_interval=70", "trainer.checkpoint_every_n_steps=5",
    "trainer.keep_checkpoints=20",  # the late group loads step=5 while group 0 trains on: never pruned under it
    "trainer.log_every_n_steps=1", "model.dim=32", "model.hidden_dim=64", "model.n_layers=2", "data.seq_len=64",
    "data.val_windows=16", "data.max_bytes=300000", "optimizer.lr=0.01", "strategy.print_report=false",
    "strategy.fault_tolerance.num_replica_groups=2",
]  # fmt: skip


@pytest.fixture(scope="module")
def groups(tmp_path_factory: pytest.TempPathFactory) -> Dict[str, Any]:
    root = tmp_path_factory.mktemp("ft_runner")
    lighthouse = start_lighthouse()
    url = lighthouse.address()

    def launch(replica_id: int) -> subprocess.Popen:
        command = [sys.executable, "-m", "lightning_mixedfsdp.train", "--config", RECIPE, *OVERRIDES]
        command += [f"output.dir={root}", f"strategy.fault_tolerance.replica_id={replica_id}"]
        command += [f"strategy.fault_tolerance.lighthouse={url}"]
        out = (root / f"group{replica_id}.out").open("w")
        return subprocess.Popen(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    first = launch(0)
    second = None
    try:
        deadline = time.monotonic() + 120
        while not (root / "checkpoints" / "step=5.ckpt").exists():
            assert first.poll() is None and time.monotonic() < deadline, (root / "group0.out").read_text()[-3000:]
            time.sleep(0.1)
        second = launch(1)
        codes = [first.wait(timeout=240), second.wait(timeout=240)]
    finally:
        for process in (first, second):
            if process is not None and process.poll() is None:
                process.kill()
        lighthouse.shutdown()
    outputs = [(root / f"group{g}.out").read_text() for g in (0, 1)]
    assert codes == [0, 0], "\n".join(o[-3000:] for o in outputs)
    return {"root": root, "outputs": outputs}


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
    healed_at = min(losses[1])
    assert healed_at >= 5  # it joined after group 0's step-5 checkpoint and took group 0's step count
    common = [step for step in losses[1] if step in losses[0]]
    assert len(common) >= 10
    assert any(losses[0][step] != losses[1][step] for step in common)


def test_the_groups_share_one_checkpoints_folder_and_one_group_writes_each_checkpoint(groups: Dict[str, Any]) -> None:
    root = groups["root"]
    assert (root / "checkpoints" / "last.ckpt").is_dir()
    assert not any((root / f"replica_{g}" / "checkpoints").exists() for g in (0, 1))
    said = [output.count(f"(step {STEPS}, written by another replica group)") for output in groups["outputs"]]
    assert sorted(said) == [0, 1]

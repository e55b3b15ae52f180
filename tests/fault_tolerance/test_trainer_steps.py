"""The Trainer under fault tolerance, two replica groups of one rank each (``trainer_worker.py``), every quorum waiting
for both (the lighthouse's and the groups' ``min_replicas=2``), so the order of events is fixed by the quorum, not by
which process is faster.

Run 1: both groups train 6 steps; while the Trainer's step is 3 both report an error, and torchft discards that step:
``global_step`` and the LR stay, the step's batches stay consumed (the next step trains on the next ones), and every
counter equals a run that never had the step. Run 2: group 0 resumes from step 6, group 1 from its step-2 checkpoint;
group 1 heals from group 0 before its first batch, and draws the batch its own stream holds there, as if it had never
stopped."""

from pathlib import Path
from typing import Any, Dict, List

import pytest

from lightning_mixedfsdp.testing.replica_groups import Group, records, start_lighthouse, stderr_tails
from tests.fault_tolerance.trainer_worker import ACCUMULATE, BASE_LR, WORKER, lr_factor, stream_ids

pytest.importorskip("torchft")

DISCARD_AT = 3


def _run(lighthouse: Any, folder: Path, commands: Dict[int, List[str]]) -> None:
    groups = [Group(g, lighthouse.address(), folder, WORKER, world=1, extra=extra) for g, extra in commands.items()]
    try:
        for group in groups:
            assert group.wait(180) == [0], stderr_tails(folder)
    finally:
        for group in groups:
            group.kill()


@pytest.fixture(scope="module")
def runs(folder: Path) -> Dict[str, Any]:
    lighthouse = start_lighthouse(min_replicas=2)  # every quorum waits for both groups
    try:
        (folder / "checkpoints").mkdir()
        first = ["--max-steps", "6", "--discard-at", str(DISCARD_AT)]
        _run(lighthouse, folder, {0: first, 1: first})
        before = {g: records(folder, g, 0).__len__() for g in (0, 1)}
        checkpoints = folder / "checkpoints"
        _run(
            lighthouse,
            folder,
            {
                0: ["--max-steps", "8", "--resume", str(checkpoints / "step=6.ckpt")],
                1: ["--max-steps", "8", "--resume", str(checkpoints / "step=2.ckpt")],
            },
        )
    finally:
        lighthouse.shutdown()
    logs = {g: [{**r, "group": g} for r in records(folder, g, 0)] for g in (0, 1)}
    return {"first": {g: logs[g][: before[g]] for g in (0, 1)}, "second": {g: logs[g][before[g] :] for g in (0, 1)}}


def _events(log: List[Dict[str, Any]], event: str) -> List[Dict[str, Any]]:
    return [r for r in log if r["event"] == event]


def test_a_discarded_step_advances_neither_the_step_nor_the_lr(runs: Dict[str, Any]) -> None:
    for group in (0, 1):
        steps = _events(runs["first"][group], "step")
        assert [s["committed"] for s in steps] == [True, True, True, False, True, True, True]
        # global_step and the LR after each step equal a run that never had the discarded one
        assert [s["step"] for s in steps] == [1, 2, 3, 3, 4, 5, 6]
        for record in steps:
            assert record["lr"] == pytest.approx(BASE_LR * lr_factor(record["step"])), record
        assert [s["torchft_step"] for s in steps] == [s["step"] for s in steps]


def test_a_discarded_steps_batches_are_consumed_not_retried(runs: Dict[str, Any]) -> None:
    for group in (0, 1):
        batches = _events(runs["first"][group], "batch")
        assert [b["ids"] for b in batches] == [stream_ids(p, group) for p in range(len(batches))]
        assert len(batches) == 7 * ACCUMULATE  # 6 committed steps and the discarded one


def test_a_healed_group_draws_the_batch_its_own_stream_holds_at_the_healed_step(runs: Dict[str, Any]) -> None:
    consumed = 7 * ACCUMULATE  # where the live group is: 6 steps and the discarded one
    for group in (0, 1):
        batches = _events(runs["second"][group], "batch")
        assert batches[0]["step"] == 6  # group 1 resumed at step 2 and healed to 6 before its first batch
        assert [b["ids"] for b in batches] == [stream_ids(consumed + i, group) for i in range(len(batches))]
        steps = _events(runs["second"][group], "step")
        assert [s["step"] for s in steps] == [7, 8] and all(s["committed"] for s in steps)
    finals = [_events(runs["second"][g], "step")[-1]["digest"] for g in (0, 1)]
    assert finals[0] == finals[1]  # equal weights after the heal and two shared steps

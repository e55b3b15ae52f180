"""Fault tolerance composes with expert parallelism and compile: two replica groups of 2 ranks each train an HF
Qwen3-MoE with its experts split over each group's 2 ranks (the experts' FSDP groups reduce across groups through
their own all-reduce hook) and every block compiled; the groups stay equal to the bit after every step while drawing
different data."""

from pathlib import Path
from typing import List

import pytest

from lightning_mixedfsdp.testing.replica_groups import Group, start_lighthouse, stderr_tails, steps
from tests.fault_tolerance.worker import WORKER

pytest.importorskip("torchft")

STEPS = 3


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    lighthouse = start_lighthouse()
    folder = tmp_path_factory.mktemp("experts_compiled")
    (folder / "stop").write_text(str(STEPS))
    extra = ["--model", "qwen3_moe", "--expert-parallel", "2", "--compile"]
    groups: List[Group] = [Group(g, lighthouse.address(), folder, WORKER, extra=extra) for g in (0, 1)]
    try:
        for group in groups:
            assert group.wait(300) == [0, 0], stderr_tails(folder)
    finally:
        for group in groups:
            group.kill()
        lighthouse.shutdown()
    return folder


def test_expert_parallel_compiled_groups_stay_equal_to_the_bit_after_every_step(folder: Path) -> None:
    for rank in (0, 1):
        records = [steps(folder, g, rank) for g in (0, 1)]
        assert [[r["step"] for r in group] for group in records] == [list(range(1, STEPS + 1))] * 2
        assert all(r["committed"] and r["participants"] == 2 for group in records for r in group)
        assert [r["digest"] for r in records[0]] == [r["digest"] for r in records[1]]
        assert [r["loss"] for r in records[0]] != [r["loss"] for r in records[1]]

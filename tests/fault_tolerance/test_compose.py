"""Fault tolerance composes with expert parallelism and compile, and with context parallelism: two replica groups of 2
ranks each train an HF Qwen3-MoE with its experts split over each group's 2 ranks (the experts' FSDP groups reduce
across groups through their own all-reduce hook) and every block compiled, or an HF Llama with every sequence split
over each group's 2 ranks; the groups stay equal to the bit after every step while drawing different data. The
lighthouse forms no quorum without both groups, so they meet in every one whatever their start-up times."""

from pathlib import Path
from typing import List

import pytest

from lightning_mixedfsdp.testing.replica_groups import Group, start_lighthouse, stderr_tails, steps
from tests.fault_tolerance.worker import WORKER

pytest.importorskip("torchft")

STEPS = 3


def _groups(folder: Path, steps_to_take: int, extra: List[str]) -> Path:
    lighthouse = start_lighthouse(min_replicas=2)
    (folder / "stop").write_text(str(steps_to_take))
    (folder / "go").write_text("1")
    groups: List[Group] = [Group(g, lighthouse.address(), folder, WORKER, extra=extra) for g in (0, 1)]
    try:
        for group in groups:
            assert group.wait(300) == [0, 0], stderr_tails(folder)
    finally:
        for group in groups:
            group.kill()
        lighthouse.shutdown()
    return folder


@pytest.fixture(scope="module")
def experts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    extra = ["--model", "qwen3_moe", "--expert-parallel", "2", "--compile"]
    return _groups(tmp_path_factory.mktemp("experts_compiled"), STEPS, extra)


@pytest.fixture(scope="module")
def context(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _groups(tmp_path_factory.mktemp("context_parallel"), 1, ["--context-parallel", "2"])


def _assert_equal_groups(folder: Path, steps_taken: int) -> None:
    for rank in (0, 1):
        records = [steps(folder, g, rank) for g in (0, 1)]
        assert [[r["step"] for r in group] for group in records] == [list(range(1, steps_taken + 1))] * 2
        assert all(r["committed"] and r["participants"] == 2 for group in records for r in group)
        assert [r["digest"] for r in records[0]] == [r["digest"] for r in records[1]]
        assert [r["loss"] for r in records[0]] != [r["loss"] for r in records[1]]


def test_expert_parallel_compiled_groups_stay_equal_to_the_bit_after_every_step(experts: Path) -> None:
    _assert_equal_groups(experts, STEPS)


def test_context_parallel_groups_stay_equal_to_the_bit(context: Path) -> None:
    _assert_equal_groups(context, 1)

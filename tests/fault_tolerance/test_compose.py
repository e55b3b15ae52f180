"""Fault tolerance composes with expert parallelism and compile: two replica groups of 2 ranks each train a few
steps and stay equal to the bit after every step while drawing different data. An HF Qwen3-MoE with its experts
split over each group's 2 ranks (the experts' FSDP groups reduce across groups through their own all-reduce hook),
and an HF Llama with every block compiled."""

from pathlib import Path
from typing import Dict, List

import pytest

from tests.fault_tolerance.groups import Group, start_lighthouse, stderr_tails, steps

pytest.importorskip("torchft")

STEPS = 3


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> Dict[str, Path]:
    lighthouse = start_lighthouse()
    url = lighthouse.address()
    setups = {"experts": ["--model", "qwen3_moe", "--expert-parallel", "2"], "compile": ["--compile"]}
    out: Dict[str, Path] = {}
    try:
        for name, extra in setups.items():  # one after the other: at once, 8 processes on 2 cores take longer
            folder = out[name] = tmp_path_factory.mktemp(name)
            (folder / "stop").write_text(str(STEPS))
            groups: List[Group] = [Group(g, url, folder, extra=extra) for g in (0, 1)]
            try:
                for group in groups:
                    assert group.wait(300) == [0, 0], stderr_tails(folder)
            finally:
                for group in groups:
                    group.kill()
    finally:
        lighthouse.shutdown()
    return out


@pytest.mark.parametrize("setup", ["experts", "compile"])
def test_both_groups_equal_to_the_bit_after_every_step(folders: Dict[str, Path], setup: str) -> None:
    folder = folders[setup]
    for rank in (0, 1):
        records = [steps(folder, g, rank) for g in (0, 1)]
        assert [[r["step"] for r in group] for group in records] == [list(range(1, STEPS + 1))] * 2
        assert all(r["committed"] and r["participants"] == 2 for group in records for r in group)
        assert [r["digest"] for r in records[0]] == [r["digest"] for r in records[1]]
        assert [r["loss"] for r in records[0]] != [r["loss"] for r in records[1]]

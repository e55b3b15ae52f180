"""Two replica groups of two ranks running DiLoCo across the groups under fault tolerance (torchft 0.2.0, gloo, a
lighthouse that forms a quorum only with both groups), ``semi_sync_worker.py``. One run:

1. both groups meet before their first step (one takes the other's initial params), train, each on its own data,
   and meet at steps 3 and 6: equal to the bit after each sync, apart between;
2. group 1 SIGKILLs itself after step 7, mid-cycle; group 0 trains on to step 9 and waits in the sync's quorum;
3. group 1 restarts from scratch and, before its first step, meets group 0 in that quorum: it heals from group 0
   (params, optimizer and outer state), takes part in the sync, and its first step is 10; both groups are equal to
   the bit again at 12;
4. both save at step 11, mid-cycle: the save syncs them first (equal to the bit), one group writes the checkpoint.

What the kill cost: group 1's local steps of that cycle (step 7), nothing of group 0's.
"""

from pathlib import Path
from typing import Any, Dict, List

import pytest

from lightning_mixedfsdp.testing.replica_groups import Group, records, start_lighthouse, steps, wait_until
from tests.fault_tolerance.semi_sync_worker import SEMI_SYNC_WORKER

pytest.importorskip("torchft")

DIE_AFTER, SAVE_AT, STEPS = 7, 11, 12
pytestmark = pytest.mark.timeout(900)
"""A hang bound, not a speed bound: each wait in ``run`` has its own."""


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("semi_sync_groups")
    lighthouse = start_lighthouse(min_replicas=2)
    url = lighthouse.address()
    common = ["--steps", str(STEPS), "--save-at", str(SAVE_AT)]
    survivor = Group(0, url, folder, SEMI_SYNC_WORKER, extra=common)
    victim = Group(1, url, folder, SEMI_SYNC_WORKER, extra=[*common, "--die-after", str(DIE_AFTER)])
    groups = [survivor, victim]
    try:
        wait_until(lambda: victim.exit_codes() == [-9, -9], "group 1 to die after its step 7", 240, [survivor], folder)
        restarted = Group(1, url, folder, SEMI_SYNC_WORKER, extra=common)
        groups = [survivor, restarted]
        assert survivor.wait(300) == [0, 0]
        assert restarted.wait(60) == [0, 0]
    except BaseException:
        for group in groups:
            group.kill()
        raise
    finally:
        lighthouse.shutdown()
    return folder


def test_a_save_mid_cycle_syncs_the_groups_and_one_writes_it(run: Path) -> None:
    for rank in (0, 1):
        saves = [[r for r in records(run, group, rank) if r["event"] == "save"] for group in (0, 1)]
        assert [len(s) for s in saves] == [1, 1]
        assert saves[0][0]["synced"] and saves[1][0]["synced"]
        assert saves[0][0]["digest"] == saves[1][0]["digest"]
    assert (run / "checkpoint").is_dir()


def _by_step(records: List[Dict[str, Any]]) -> Dict[int, Dict[str, Any]]:
    return {r["step"]: r for r in records}


def test_groups_are_equal_after_each_sync_and_apart_between(run: Path) -> None:
    for rank in (0, 1):
        first, second = _by_step(steps(run, 0, rank)), _by_step(steps(run, 1, rank))
        for step in (3, 6, 12):
            assert first[step]["synced"] and second[step]["synced"], step
            assert first[step]["participants"] == second[step]["participants"] == 2
            assert first[step]["digest"] == second[step]["digest"], step
        for step in (4, 5, 7):
            assert first[step]["digest"] != second[step]["digest"], step


def test_the_survivor_never_lost_a_step(run: Path) -> None:
    for rank in (0, 1):
        records = steps(run, 0, rank)
        assert [r["step"] for r in records] == list(range(1, STEPS + 1))
        assert all(r["heal"] is None or r["heal"]["step"] == 0 for r in records)  # at most the start's, never later


def test_the_restarted_group_heals_at_its_first_sync_and_goes_on(run: Path) -> None:
    for rank in (0, 1):
        records = steps(run, 1, rank)
        restart = records[DIE_AFTER]["pid"]
        assert all(r["pid"] != restart for r in records[:DIE_AFTER])
        after = [r for r in records if r["pid"] == restart]
        # healed before its first step, in group 0's sync at 9: it goes on from there
        assert [r["step"] for r in after] == [10, 11, 12]
        assert after[0]["heal"] is not None and after[0]["heal"]["bytes"] > 0 and after[0]["heal"]["step"] > 0

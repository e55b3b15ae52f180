"""Two replica groups of two ranks under fault tolerance (torchft 0.2.0, gloo), an HF Llama with fp32 norms in
bf16-true, trained by a Fabric script with gradient accumulation, activation checkpointing and clipping
(``worker.py``). One run, in the order a user meets it:

1. both groups train; their params and optimizer states are equal to the bit after every step, while each draws its
   own data (the cross-group reduction);
2. group 1 SIGKILLs itself inside a cross-group all-reduce: group 0 discards that step (its state unchanged) and goes
   on alone, its step count never going back;
3. group 1 restarts, heals from group 0 to group 0's step (never from 0), and both are equal to the bit again;
4. the test SIGKILLs group 1 at an arbitrary point; group 0 goes on alone again and saves a checkpoint;
5. that checkpoint resumes a plain (no fault tolerance) run, and both groups restarted from it (every group died) go
   on from its step, equal to the bit. (Two live groups saving at once, one writing: ``test_runner_groups.py``.)
"""

import time
from itertools import pairwise
from pathlib import Path
from typing import Any, Dict

import pytest

from lightning_mixedfsdp.testing import run_distributed
from lightning_mixedfsdp.testing.replica_groups import Group, records, start_lighthouse, steps, wait_until
from tests.fault_tolerance.worker import WORKER

pytest.importorskip("torchft")

FAULT_STEP = 6
pytestmark = pytest.mark.timeout(1200)
"""A hang bound, not a speed bound: the first test waits for ``run``, whose every wait has its own bound, and on a
loaded machine their sum can pass pytest's default of 300 s."""


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Dict[str, Any]:
    folder = tmp_path_factory.mktemp("fault_tolerance")
    lighthouse = start_lighthouse()
    url = lighthouse.address()
    timeline: Dict[str, Any] = {"folder": folder}
    survivor = Group(0, url, folder, WORKER)
    victim = Group(1, url, folder, WORKER, extra=["--die-in-reduce-at", str(FAULT_STEP)])
    groups = [survivor, victim]
    try:
        started = lambda: all(any(r["event"] == "start" for r in records(folder, g, 0)) for g in (0, 1))  # noqa: E731
        wait_until(started, "both groups to start", 120, groups, folder)
        (folder / "go").write_text("1")
        # 1-2: group 1 dies inside the reduction of step FAULT_STEP
        deadline = time.monotonic() + 120
        while victim.exit_codes() != [-9, -9]:
            assert time.monotonic() < deadline, f"group 1 did not die: {victim.exit_codes()}"
            assert all(code in (None, -9) for code in victim.exit_codes()), victim.exit_codes()
            time.sleep(0.1)
        groups = [survivor]
        wait_until(lambda: _alone_commits(folder) >= 3, "group 0 to commit alone", 60, groups, folder)
        # 3: restart, heal
        restarted = Group(1, url, folder, WORKER)
        groups = [survivor, restarted]
        timeline["first_restart_pid"] = restarted.processes[0].pid
        wait_until(
            lambda: len(steps(folder, 1, since_pid=restarted.processes[0].pid)) >= 4,
            "group 1 to heal",
            90,
            groups,
            folder,
        )
        # 4: a kill at an arbitrary point; group 0 alone again, then it saves and stops
        restarted.kill()  # returns once group 1 is dead
        # the steps group 0 had logged by then: each later one was logged with group 1 gone (the log only grows)
        timeline["steps_before_second_kill"] = [len(steps(folder, 0, rank)) for rank in (0, 1)]
        groups = [survivor]
        before = _alone_commits(folder)
        wait_until(lambda: _alone_commits(folder) >= before + 3, "group 0 to go on alone again", 60, groups, folder)
        final = max(r["step"] for r in steps(folder, 0)) + 2
        (folder / "save").write_text(str(final))
        (folder / "stop").write_text(str(final))
        timeline["final"] = final
        assert survivor.wait(90) == [0, 0]
        # every group died; both restart from the checkpoint and run two more steps
        (folder / "stop").write_text(str(final + 2))
        (folder / "save").unlink()
        resumed = [Group(g, url, folder, WORKER, extra=["--resume", str(folder / "checkpoint")]) for g in (0, 1)]
        groups = resumed
        timeline["resumed_pids"] = [g.processes[0].pid for g in resumed]
        for group in resumed:
            assert group.wait(120) == [0, 0]
    except BaseException:
        for group in groups:
            group.kill()
        raise
    finally:
        lighthouse.shutdown()
    return timeline


def _alone_commits(folder: Path) -> int:
    return sum(1 for r in steps(folder, 0) if r["committed"] and r["participants"] == 1)


def _digests(folder: Path, group: int, rank: int, pid: Any = None) -> Dict[int, str]:
    return {r["step"]: r["digest"] for r in steps(folder, group, rank, since_pid=pid) if r["committed"]}


def test_both_groups_equal_to_the_bit_after_every_step_before_the_kill(run: Dict[str, Any]) -> None:
    folder = run["folder"]
    for rank in (0, 1):
        first = [r for r in steps(folder, 0, rank) if r["step"] <= FAULT_STEP and r["committed"]]
        second = [r for r in steps(folder, 1, rank) if r["step"] <= FAULT_STEP and r["committed"]]
        assert [r["step"] for r in first] == list(range(1, FAULT_STEP + 1)) == [r["step"] for r in second]
        assert all(r["participants"] == 2 for r in first + second)
        assert [r["digest"] for r in first] == [r["digest"] for r in second]
        # each group drew its own data: a sampler over all four ranks, and different losses
        assert {r["sampler"]["rank"] for r in first} == {rank} and {r["sampler"]["rank"] for r in second} == {2 + rank}
        assert all(r["sampler"]["num_replicas"] == 4 for r in first + second)
        assert [r["loss"] for r in first] != [r["loss"] for r in second]


def test_the_step_whose_reduction_a_dying_peer_broke_is_discarded_on_the_survivor(run: Dict[str, Any]) -> None:
    for rank in (0, 1):
        records = steps(run["folder"], 0, rank)
        faulty = [i for i, r in enumerate(records) if r["committed"] is False]
        assert faulty, "no step was discarded"
        index = faulty[0]
        # group 1 died in the step after its FAULT_STEP-th commit
        assert records[index]["step"] == records[index - 1]["step"] == FAULT_STEP
        # nothing of the discarded step was applied: params and optimizer states as the step before
        assert records[index]["digest"] == records[index - 1]["digest"]


def test_the_survivor_goes_on_alone_and_its_step_count_never_goes_back(run: Dict[str, Any]) -> None:
    for rank in (0, 1):
        records = steps(run["folder"], 0, rank)
        counts = [r["step"] for r in records]
        assert counts == sorted(counts)
        for previous, record in pairwise(records):
            assert record["step"] == previous["step"] + (1 if record["committed"] else 0)
        alone = [r for r in records if r["participants"] == 1 and r["committed"]]
        assert len(alone) >= 6  # after each of the two kills
        survivor = records[0]["pid"]  # not the launch resumed from the checkpoint at the end
        logged_after = records[run["steps_before_second_kill"][rank] :]
        after_second_kill = [r for r in logged_after if r["pid"] == survivor]
        in_flight, *later = after_second_kill
        # the step the kill interrupted, when group 1 had joined it, is discarded; every later one is group 0's alone
        assert in_flight["participants"] == 1 or in_flight["committed"] is False
        assert later and all(r["participants"] == 1 for r in later)


def test_a_restarted_group_heals_to_the_survivors_step_and_then_equals_it_to_the_bit(run: Dict[str, Any]) -> None:
    folder = run["folder"]
    pid = run["first_restart_pid"]
    records = steps(folder, 1, 0, since_pid=pid)
    first = records[0]
    assert first["heal"] is not None and first["heal"]["bytes"] > 0
    healed_at = first["heal"]["step"]
    assert healed_at > FAULT_STEP  # never from 0
    assert first["step"] == healed_at + 1
    for rank in (0, 1):
        healed = _digests(folder, 1, rank, pid=None if rank else pid)
        live = _digests(folder, 0, rank)
        common = [s for s in healed if s in live and s > healed_at]
        assert len(common) >= 3
        assert [healed[s] for s in common] == [live[s] for s in common]


def test_the_checkpoint_resumes_both_groups_at_its_step_equal_to_the_bit(run: Dict[str, Any]) -> None:
    from lightning_mixedfsdp.testing.replica_groups import records

    folder, final = run["folder"], run["final"]
    saves = [r for r in records(folder, 0, 0) if r["event"] == "save"]
    assert [(r["step"], r["wrote"]) for r in saves] == [(final, True)]  # group 0, the only participant, wrote it
    saved = {rank: _digests(folder, 0, rank)[final] for rank in (0, 1)}
    for group in (0, 1):
        for rank in (0, 1):
            start = [r for r in records(folder, group, rank) if r["event"] == "start"][-1]
            # torchft's step comes back from the checkpoint; the digest is taken after the load
            assert (start["step"], start["digest"]) == (final, saved[rank])
    for rank in (0, 1):
        after = [_digests(folder, g, rank) for g in (0, 1)]
        assert after[0][final + 1] == after[1][final + 1] and after[0][final + 2] == after[1][final + 2]


def test_the_checkpoint_resumes_a_plain_run(run: Dict[str, Any]) -> None:
    folder, final = run["folder"], run["final"]
    results = run_distributed(_resume_plainly, 2, str(folder / "checkpoint"), timeout=120)
    for rank, (digest, loss) in enumerate(results):
        assert digest == _digests(folder, 0, rank)[final]
        assert loss == loss and loss < 10


def _resume_plainly(rank: int, world_size: int, checkpoint: str) -> Any:
    import torch

    from tests.fault_tolerance.worker import build, digest

    fabric, model, optimizer = build(None, None)
    remainder = fabric.load(checkpoint, {"model": model, "optimizer": optimizer})
    assert "torchft" not in remainder
    loaded = digest(model, optimizer)
    tokens = torch.arange(16).reshape(1, 16) % 64
    loss = model(input_ids=tokens, labels=tokens).loss
    fabric.backward(loss)
    optimizer.step()
    return loaded, loss.item()

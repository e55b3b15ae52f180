"""GRPO's generator ranks and sampling at their edges, through the recipe runner on 2 trainer ranks: a generator
process that exits as it starts (its reward module exits while loading), one killed mid-run, and one whose reward
fails on one trainer rank's rollout make every trainer rank raise, naming it, and leave no generator process; the
policy runs without dropout in every RL forward (LoRA dropout and attention dropout 0.1, fp32: every step's
``logprob_mismatch`` below 1e-5); PEFT trains on generator ranks under 32-true, bf16-mixed and bf16-true, each sync
verified by hash. Its own launch, out of the compat subsets: no private torch or transformers API of its own."""

import tempfile
from pathlib import Path
from typing import Any, Dict, List

from tests.conftest import Launch
from tests.recipes.test_grpo import WORLD, _runner, inputs  # noqa: F401  # the shared inputs fixture


def _generator_processes(started_in: Path) -> List[str]:
    """The command lines of the generator processes running now whose recipe lies in ``started_in`` (Linux's
    /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            line = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:  # not a process, or gone
            continue
        if "lightning_mixedfsdp.recipes.run.generator_process" in line and str(started_in) in line:
            found.append(line)
    return found


def _generator_faults(rank: int, folder: str, policy: str, prompts: str) -> Dict[str, Any]:
    """A generator that exits as it starts (its reward module exits while loading: exit code 7, its traceback) and
    one killed mid-run (SIGKILL as it scores its first rollout): every trainer rank raises, naming it."""
    where, out = Path(folder), {}
    # this launch's own temporary folders (its generators' recipes among them), apart from the launch beside it
    tempfile.tempdir = str(where / f"temporary_rank{rank}")
    Path(tempfile.tempdir).mkdir()
    ranks = ["rl.generation=ranks", "rl.generator_ranks=1"]
    for case in ("at_start", "killed", "first_call"):
        reward = f"{Path(prompts).parent / f'dying_reward_{case}.py'}:length"
        try:
            _runner(where, policy, prompts, 2, f"fault_{case}", extra=[*ranks, f"rl.reward={reward}"])
            out[case] = "no error"
        except Exception as error:  # noqa: BLE001  # the test reads what was raised
            out[case] = f"{type(error).__name__}: {error}"
    out["left_running"] = _generator_processes(Path(tempfile.tempdir))
    out["folders_left"] = sorted(str(p) for p in Path(tempfile.tempdir).glob("generator_ranks_*"))
    return out


def _dropout_and_peft(rank: int, folder: str, policy: str, prompts: str) -> Dict[str, Any]:
    """LoRA with dropout 0.1 (and attention dropout 0.1), fp32: with rl.disable_dropout (the default) mu, pi_old and
    pi_theta see no dropout mask; PEFT on generator ranks under each precision."""
    where = Path(folder)
    dropout = ["peft.enabled=true", "peft.dropout=0.1", "trainer.precision=32-true",
               f"model.pretrained={Path(policy).parent / 'dropout_policy'}"]  # fmt: skip
    ranks = ["rl.generation=ranks", "rl.generator_ranks=1", "rl.verify_sync=true"]
    out = {"off": _runner(where, policy, prompts, 3, "dropout_off", extra=dropout)}
    for precision in ("32-true", "bf16-mixed", "bf16-true"):
        out[precision] = _runner(where, policy, prompts, 2, f"peft_ranks_{precision}", extra=[
            *ranks, "peft.enabled=true", f"trainer.precision={precision}"])  # fmt: skip
    return out


def _faults(rank: int, world: int, folder: str, shared: str) -> Dict[str, Any]:
    policy, prompts = str(Path(shared) / "policy"), str(Path(shared) / "prompts.jsonl")
    return {"faults": _generator_faults(rank, folder, policy, prompts)}


def _dropout(rank: int, world: int, folder: str, shared: str) -> Dict[str, Any]:
    policy, prompts = str(Path(shared) / "policy"), str(Path(shared) / "prompts.jsonl")
    return {"dropout": _dropout_and_peft(rank, folder, policy, prompts)}


LAUNCH = Launch((_faults, _dropout), WORLD, timeout=600, fixtures=("inputs",))
"""Two launches side by side: while one's trainers wait on a generator process importing, the other's compute."""


def test_a_generator_that_exits_is_killed_or_fails_a_rollout_makes_every_trainer_rank_raise(results: list) -> None:
    for rank in range(WORLD):
        faults = results[rank]["faults"]
        at_start, killed = faults["at_start"], faults["killed"]
        assert at_start.startswith("GeneratorDied: GroupRelativePolicyOptimization: starting: generator rank 1"), (
            at_start
        )
        assert "with exit code 7" in at_start and "SystemExit: 7" in at_start  # its traceback
        assert killed.startswith("GeneratorDied: GroupRelativePolicyOptimization: "), killed
        assert "generator rank 1" in killed and "exit code -9 (SIGKILL)" in killed and "no traceback" in killed
        once = faults["first_call"]  # one trainer rank's rollout failed: every trainer rank raises it
        assert once.startswith("RuntimeError: GroupRelativePolicyOptimization: a generator rank failed on trainer"), (
            once
        )
        assert "ValueError: the reward failed once" in once
    assert results[0]["faults"]["left_running"] == []
    assert results[0]["faults"]["folders_left"] == []  # each run's temporary folder removed on its fault


def test_dropout_is_off_in_every_rl_forward_and_peft_trains_on_generator_ranks_in_each_precision(
    results: list,
) -> None:
    for rank in range(WORLD):
        off = results[rank]["dropout"]["off"]
        assert len(off["logprob_mismatch"]) == 3 and max(off["logprob_mismatch"]) < 1e-5, off["logprob_mismatch"]
        for precision in ("32-true", "bf16-mixed", "bf16-true"):
            got = results[rank]["dropout"][precision]
            assert got["rollout_version"] == [0.0, 1.0], precision  # each sync verified by its hash
            limit = 1e-5 if precision == "32-true" else 1e-2
            assert max(got["logprob_mismatch"]) < limit, (precision, got["logprob_mismatch"])

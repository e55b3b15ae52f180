"""``Agreement`` and ``on_rank_zero`` on 2 ranks: whatever fails where, every rank raises and none is left waiting in a
collective. Each case ends with a barrier that a rank left behind would never reach; the launch's timeout fails a
case that hangs."""

from typing import Any, Callable, Dict, Tuple

import pytest

from lightning_mixedfsdp.distributed.agreement import Agreement, on_rank_zero
from tests.conftest import Launch

Outcome = Tuple[str, str]


def _outcome(action: Callable[[], Any]) -> Outcome:
    import torch.distributed as dist

    try:
        result = action()
        outcome = ("returned", repr(result))
    except BaseException as error:  # noqa: B036  the case reports what it raised, CheckpointException included
        outcome = (type(error).__name__, str(error))
    dist.barrier()  # a rank left in a collective would never get here
    return outcome


def _section(failures: Dict[int, list]) -> Callable[[], None]:
    """A section of three local steps; ``failures[rank]`` lists the errors this rank raises, one per step."""
    import torch.distributed as dist

    def run() -> None:
        agreement = Agreement("writing the shards")
        for step in range(3):
            with agreement.local():
                errors = failures.get(dist.get_rank(), [])
                if step < len(errors):
                    raise errors[step]
        agreement.agree()

    return run


def _scenarios(rank: int, world: int, folder: str) -> Dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.checkpoint.api import CheckpointException

    dist.init_process_group("gloo")
    out = {
        "twice_on_one_rank": _outcome(_section({1: [OSError("disk full"), ValueError("close after a failed write")]})),
        "on_different_ranks": _outcome(_section({0: [ValueError("a")], 1: [FileNotFoundError("b")]})),
        "on_rank_zero_only": _outcome(_section({0: [ValueError("bad header")]})),
        "checkpoint_exception": _outcome(_section({1: [CheckpointException("read", {})]})),
        "none": _outcome(_section({})),
        "zero_computes": _outcome(lambda: on_rank_zero("survey", lambda: {"files": 2})),
        "zero_fails": _outcome(lambda: on_rank_zero("survey", lambda: int("not a number"))),
    }
    dist.destroy_process_group()
    return out


LAUNCH = Launch(_scenarios, 2, timeout=120)


def test_two_failures_on_one_rank_raise_the_first_on_every_rank(results: list) -> None:
    assert results[1]["twice_on_one_rank"] == ("OSError", "disk full")
    assert results[0]["twice_on_one_rank"] == ("OSError", "writing the shards: rank 1 failed: disk full")


def test_failures_on_different_ranks_raise_on_both(results: list) -> None:
    assert results[0]["on_different_ranks"] == ("ValueError", "a")
    assert results[1]["on_different_ranks"] == ("FileNotFoundError", "b")


def test_a_failure_on_rank_zero_only_raises_on_every_rank(results: list) -> None:
    assert results[0]["on_rank_zero_only"] == ("ValueError", "bad header")
    assert results[1]["on_rank_zero_only"] == ("ValueError", "writing the shards: rank 0 failed: bad header")


def test_a_checkpoint_exception_is_kept_and_agreed(results: list) -> None:
    assert results[1]["checkpoint_exception"][0] == "CheckpointException"
    kind, message = results[0]["checkpoint_exception"]
    assert kind == "RuntimeError" and message.startswith("writing the shards: rank 1 failed:")


def test_no_failure_raises_nothing(results: list) -> None:
    assert [result["none"] for result in results] == [("returned", "None")] * 2


def test_on_rank_zero_hands_its_result_or_its_error_to_every_rank(results: list) -> None:
    assert [result["zero_computes"] for result in results] == [("returned", "{'files': 2}")] * 2
    assert results[0]["zero_fails"] == ("ValueError", "invalid literal for int() with base 10: 'not a number'")
    assert results[1]["zero_fails"] == (
        "ValueError",
        "survey: rank 0 failed: invalid literal for int() with base 10: 'not a number'",
    )


def test_one_process_raises_its_own_first_error() -> None:
    agreement = Agreement("a section")
    for error in (ValueError("first"), KeyError("second")):
        with agreement.local():
            raise error
    assert [str(e) for e in agreement.later] == ["'second'"]
    with pytest.raises(ValueError, match="first"):
        agreement.agree()

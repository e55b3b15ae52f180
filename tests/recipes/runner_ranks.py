"""The recipe runner's command line on ranks forked from the tests' fork server (started as torchrun starts ranks:
``RANK``, ``WORLD_SIZE`` and the rendezvous in the environment), for a test that checks what a run leaves behind,
not how it was launched: a run costs its training, not two fresh interpreters' imports. The launches a user types
(``python -m lightning_mixedfsdp.train``, relaunching itself for rank 1; under ``timeout`` or torchrun; signalled)
stay commands in ``main_job.py``, ``test_runner.py`` and the fine-tuning of a local folder."""

from pathlib import Path
from typing import List

from lightning_mixedfsdp.testing import run_distributed


def runner_on_ranks(rank: int, world_size: int, argv: List[str], output: str) -> str:
    """``runner.main(argv)`` on this rank; rank 0's console as the run folder ``output`` keeps it."""
    from lightning.fabric.utilities.rank_zero import rank_zero_only

    from lightning_mixedfsdp.recipes.run import runner

    rank_zero_only.rank = rank  # what a fresh interpreter reads from RANK at import: the fork server's says 0
    runner.main(argv)
    return (Path(output) / "console.log").read_text() if rank == 0 else ""


def run_recipe(*argv: str, output: Path, world_size: int = 2, timeout: float = 420) -> str:
    """The runner with ``argv`` (which names ``output.dir=output``) on ``world_size`` forked ranks: rank 0's console."""
    assert f"output.dir={output}" in argv, argv
    return run_distributed(runner_on_ranks, world_size, list(argv), str(output), timeout=timeout)[0]

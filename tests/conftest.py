"""The fixtures every test module shares: its temporary ``folder`` and its one multi-process launch, ``results``.

A module that trains on several ranks declares ``LAUNCH = Launch(scenarios, world_size, ...)``: ``results`` runs
``scenarios(rank, world_size, *args)`` once for the whole module (many checks per launch: a launch costs seconds) and
hands every test the per-rank return values. ``args`` are the module's folder (``with_folder``) and the values of
the fixtures named in ``fixtures``, as strings where they are paths."""

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, List, Sequence

import pytest

from lightning_mixedfsdp.testing import run_distributed


@dataclass(frozen=True)
class Launch:
    """A test module's one launch."""

    scenarios: Callable[..., Any]
    """``scenarios(rank, world_size, *args)``, run on every rank."""
    world_size: int
    timeout: float = 300
    """Seconds before a rank that has not reported fails the module's tests."""
    with_folder: bool = True
    """Pass the module's ``folder`` (as a string) first."""
    fixtures: Sequence[str] = ()
    """Fixtures whose values follow (paths as strings)."""


@pytest.fixture(scope="module")
def folder(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A temporary folder for the whole test module, named after it."""
    return tmp_path_factory.mktemp(request.module.__name__.rpartition(".")[2])


@pytest.fixture(scope="module")
def results(request: pytest.FixtureRequest, folder: Path) -> List[Any]:
    """Every rank's return value of the module's ``LAUNCH``."""
    launch: Launch = request.module.LAUNCH
    args: List[Any] = [str(folder)] if launch.with_folder else []
    for name in launch.fixtures:
        value = request.getfixturevalue(name)
        args.append(str(value) if isinstance(value, Path) else value)
    return run_distributed(launch.scenarios, launch.world_size, *args, timeout=launch.timeout)

"""The fixtures every test module shares: its temporary ``folder`` and its one multi-process launch, ``results``.

A module that trains on several ranks declares ``LAUNCH = Launch(scenarios, world_size, ...)``: ``results`` runs
``scenarios(rank, world_size, *args)`` once for the whole module (many checks per launch: a launch costs seconds) and
hands every test the per-rank return values; with several scenario functions, each is a launch of its own, all side
by side, and each rank's dicts are merged. ``args`` are the module's folder (``with_folder``) and the values of
the fixtures named in ``fixtures``, as strings where they are paths."""

from collections import defaultdict
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Callable, Dict, List, Sequence, Tuple, Union

import pytest

from lightning_mixedfsdp.testing import run_distributed
from tests.launch_together import run_together

SLOW_MODULES = frozenset(
    {
        "tests/test_benchmarks.py",
        "tests/test_examples.py",
        "tests/recipes/test_runner.py",
        "tests/recipes/test_muon_recipe.py",
        "tests/recipes/test_sft_runner.py",
        "tests/recipes/test_hf_recipes.py",
        "tests/recipes/test_vision_recipes.py",
        "tests/recipes/test_distillation.py",
        "tests/recipes/test_preference.py",
        "tests/recipes/test_grpo.py",
        "tests/recipes/test_generator_edges.py",
        "tests/recipes/test_rollouts.py",
        "tests/recipes/test_objectives.py",
        "tests/recipes/test_sft_data.py",
        "tests/recipes/test_recipes.py",
        "tests/recipes/test_dry_run.py",
        "tests/fault_tolerance/test_runner_groups.py",
        "tests/fault_tolerance/test_kill_and_heal.py",
        "tests/fault_tolerance/test_compose.py",
        "tests/fault_tolerance/test_semi_sync_groups.py",
        "tests/fault_tolerance/test_trainer_steps.py",
        "tests/composed/test_compose.py",
        "tests/composed/test_qlora.py",
        "tests/apply/test_bf16_updates.py",
        "tests/apply/test_expert_parallel.py",
        "tests/apply/test_context_parallel.py",
        "tests/apply/test_compile_and_memory.py",
        "tests/apply/test_float8.py",
        "tests/checkpoint/test_checkpoint.py",
        "tests/checkpoint/test_faults.py",
        "tests/strategies/test_fabric.py",
        "tests/diagnostics/test_precision_monitor.py",
        "tests/planning/test_dtype_rules.py",
        "tests/lightning_contract/tests_fabric/strategies/test_model_parallel_integration.py",
    }
)
"""The modules of 12 s or more in a full run on 2 cores (``--durations`` prints them): ``pytest -m "not slow"`` leaves
them out for work in progress (about 3 minutes); README's test command runs everything."""


MODULE_SECONDS: Dict[str, float] = defaultdict(float)
"""Each test module's seconds in this run (set-up, calls and teardowns: a module's launch is in its first set-up)."""
MODULE_TABLE_FLOOR_S = 10.0


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    MODULE_SECONDS[report.nodeid.split("::", 1)[0]] += report.duration


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """The time table by module (those of 10 s or more), so each change sees what its tests cost."""
    slow = sorted(((s, m) for m, s in MODULE_SECONDS.items() if s >= MODULE_TABLE_FLOOR_S), reverse=True)
    if not slow:
        return
    terminalreporter.section(f"modules of {MODULE_TABLE_FLOOR_S:.0f} s or more")
    for seconds, module in slow:
        terminalreporter.write_line(f"{seconds:8.1f}s  {module}")
    terminalreporter.write_line(f"{sum(MODULE_SECONDS.values()):8.1f}s  all {len(MODULE_SECONDS)} modules")


def pytest_collection_modifyitems(config: pytest.Config, items: List[pytest.Item]) -> None:
    root = Path(str(config.rootpath))
    for item in items:
        if Path(str(item.path)).relative_to(root).as_posix() in SLOW_MODULES:
            item.add_marker(pytest.mark.slow)


@dataclass(frozen=True)
class Launch:
    """A test module's one launch."""

    scenarios: Union[Callable[..., Any], Tuple[Callable[..., Dict[str, Any]], ...]]
    """``scenarios(rank, world_size, *args)``, run on every rank; a tuple of them: launches side by side (one's ranks
    compute while another's wait, e.g. on a process starting), each returning a dict; a rank's dicts are merged."""
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
    if callable(launch.scenarios):
        return run_distributed(launch.scenarios, launch.world_size, *args, timeout=launch.timeout)
    world, timeout = launch.world_size, launch.timeout
    side_by_side = {fn.__name__: partial(run_distributed, fn, world, *args, timeout=timeout) for fn in launch.scenarios}
    each = run_together(side_by_side)
    return [{key: value for ranks in each.values() for key, value in ranks[rank].items()} for rank in range(world)]

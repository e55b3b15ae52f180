"""Fixtures of the Lightning contract port.

``distributed``: in Lightning's integration tests a fixture that destroys the process group after the test; here the
handle to the test's body result from its shared CPU launch (see ``_harness.py``). The autouse fixtures are the
parts of Lightning's own ``tests_fabric``/``tests_pytorch`` conftests that keep in-process tests from leaking state
into the next one (environment, rank globals, process group, fabric backward flag).
"""

import os
from typing import List

import pytest

from tests.lightning_contract._harness import MARKER, BodyResult, Launches, side_of
from tests.lightning_contract.differences import difference_of

# Lightning's own class runs the port too when this is set (for the counts in a report); CI runs ours only
PARENT_ENV = "MIXED_FSDP_CONTRACT_PARENT"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", f"{MARKER}(world_size): a Lightning standalone test run on CPU processes")


def pytest_collection_modifyitems(config: pytest.Config, items: List[pytest.Item]) -> None:
    """Our classes skip the tests where we differ by design (each names its replacement); Lightning's class runs only
    with ``MIXED_FSDP_CONTRACT_PARENT=1``."""
    parent = os.environ.get(PARENT_ENV) == "1"
    kept, deselected = [], []
    for item in items:
        params = item.callspec.params if hasattr(item, "callspec") else {}
        strategy_class = params.get("ModelParallelStrategy")
        if strategy_class is None or "lightning_contract" not in item.nodeid or "test_differences" in item.nodeid:
            kept.append(item)
            continue
        if side_of(strategy_class) == "lightning":
            (kept if parent else deselected).append(item)
            continue
        entry = difference_of(item.name)
        if entry is not None:
            reason, replacement = entry
            item.add_marker(pytest.mark.skip(reason=f"mixed_fsdp2 differs: {reason}; asserted by {replacement}"))
        kept.append(item)
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = kept


@pytest.fixture(scope="session")
def contract_launches(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Launches:
    launches = Launches(request.session, tmp_path_factory.mktemp("lightning_contract"))
    request.config._contract_launches = launches
    return launches


def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:
    launches = getattr(config, "_contract_launches", None)
    if launches is not None and launches.timings:
        terminalreporter.write_sep("-", "lightning_contract launches (wall seconds, bodies)")
        for (side, world_size), seconds in sorted(launches.timings.items()):
            terminalreporter.write_line(f"{side} world_size={world_size}: {seconds:.1f}s")


@pytest.fixture
def distributed(request: pytest.FixtureRequest, contract_launches: Launches) -> BodyResult:
    return BodyResult(contract_launches, request.node)


@pytest.fixture(autouse=True)
def preserve_global_rank_variable():
    from lightning.fabric.utilities.rank_zero import rank_zero_only as rank_zero_only_fabric
    from lightning.pytorch.utilities.rank_zero import rank_zero_only as rank_zero_only_pytorch
    from lightning_utilities.core.rank_zero import rank_zero_only as rank_zero_only_utilities

    functions = (rank_zero_only_pytorch, rank_zero_only_fabric, rank_zero_only_utilities)
    ranks = [getattr(fn, "rank", None) for fn in functions]
    yield
    for fn, rank in zip(functions, ranks, strict=True):
        if rank is not None:
            fn.rank = rank


@pytest.fixture(autouse=True)
def restore_env_variables():
    backup = os.environ.copy()
    yield
    os.environ.clear()
    os.environ.update(backup)


@pytest.fixture(autouse=True)
def teardown_process_group():
    from lightning.fabric.utilities.distributed import _destroy_dist_connection

    yield
    _destroy_dist_connection()


@pytest.fixture(autouse=True)
def reset_in_fabric_backward():
    import lightning.fabric.wrappers as wrappers

    yield
    wrappers._in_fabric_backward = False

"""The recipes' shared launches."""

from typing import Any, Dict

import pytest

from tests.recipes.main_job import main_job_runs


@pytest.fixture(scope="session")
def main_job(tmp_path_factory: pytest.TempPathFactory) -> Dict[str, Any]:
    """The main job's runs (``main_job.py``), launched once for the session."""
    return main_job_runs(tmp_path_factory.mktemp("runs"))

"""The objective interface: a new objective is its own file and one registration (``throwaway_objective.py``, run
through the runner as a user runs it), and a recipe naming an objective is checked before launch: an unknown name and
one that does not train the data's format each refused with the fix."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_mixedfsdp.recipes.objectives.language_modeling import CausalLM
from lightning_mixedfsdp.recipes.objectives.registry import OBJECTIVES, objective_class
from lightning_mixedfsdp.recipes.objectives.sft import ChatLM
from lightning_mixedfsdp.recipes.run.loader import load_recipe
from lightning_mixedfsdp.recipes.run.plot import read_metrics
from lightning_mixedfsdp.recipes.settings.schema import RecipeError

ROOT = Path(__file__).resolve().parents[2]
TINY = [
    "trainer.accelerator=cpu", "trainer.devices=1", "trainer.max_steps=30", "trainer.val_check_interval=30",
    "trainer.log_every_n_steps=1", "model.dim=32", "model.hidden_dim=64", "model.n_layers=2", "data.seq_len=64",
    "data.val_windows=8", "data.max_bytes=200000", "optimizer.lr=0.01", "optimizer.warmup_steps=5",
]  # fmt: skip


def test_a_throwaway_objective_trains_through_the_runner_from_its_own_file_and_one_registration(
    tmp_path: Path,
) -> None:
    script = ROOT / "tests" / "recipes" / "throwaway_objective.py"
    args = [sys.executable, str(script), *TINY, "objective=smoothed_next_token", f"output.dir={tmp_path}"]
    completed = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=600)
    out = completed.stdout + completed.stderr
    assert completed.returncode == 0, out[-5000:]
    found = re.search(r"held-out next-token accuracy: ([0-9.]+) -> ([0-9.]+) after 30 steps", out)
    assert found is not None, out[-3000:]
    untrained, trained = map(float, found.groups())
    assert trained > untrained + 0.05  # it learned, under its own loss and its own evaluation
    metrics = read_metrics(tmp_path / "logs")
    assert len(metrics["train_loss"]) == 30  # the shared training step logged its loss every step
    assert (tmp_path / "export" / "model.safetensors").is_file()  # and the run's export, as for every objective


def test_a_recipe_without_an_objective_trains_its_data_formats_default() -> None:
    assert objective_class(load_recipe(None, TINY, launching=False)) is CausalLM
    chat = load_recipe(None, [*TINY, "data.format=chat"], launching=False)
    assert objective_class(chat) is ChatLM
    assert list(OBJECTIVES) == ["language_modeling", "sft", "distillation", "preference", "vision_sft", "grpo"]


def test_an_unknown_objective_is_refused_with_the_close_name() -> None:
    with pytest.raises(RecipeError) as error:
        load_recipe(None, [*TINY, "objective=language_modelling"], launching=False)
    assert (
        "objective='language_modelling' is not one of ['distillation', 'grpo', 'language_modeling', 'preference',"
        " 'sft', 'vision_sft']; did you mean"
        " 'language_modeling'? leave it unset to train the data's format"
    ) in str(error.value)


def test_an_objective_that_does_not_train_the_datas_format_is_refused() -> None:
    with pytest.raises(RecipeError) as error:
        load_recipe(None, [*TINY, "objective=sft"], launching=False)
    assert (
        "objective='sft' trains on chat or instruction data, and data.format resolves to 'text'; point data.files"
        " at chat or instruction records, or set objective to one of ['language_modeling', 'distillation']"
    ) in str(error.value)

"""Recipe files: merge precedence, typos rejected, every problem at once; the main job end to end (tiny sizes)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from lightning_mixedfsdp.recipes.loader import load_recipe
from lightning_mixedfsdp.recipes.schema import Recipe, RecipeError

ROOT = Path(__file__).resolve().parents[2]
RECIPES = sorted((ROOT / "conf").glob("*.yaml"))


def test_schema_defaults_then_file_then_overrides(tmp_path: Path) -> None:
    recipe_file = tmp_path / "r.yaml"
    recipe_file.write_text("trainer:\n  max_steps: 40\n  devices: 1\nmodel:\n  dim: 64\n")
    recipe = load_recipe(str(recipe_file), ["trainer.max_steps=7", "strategy.keep_fp32_params=[A_log$]"])
    assert recipe.trainer.max_steps == 7  # the override wins over the file
    assert recipe.trainer.devices == 1  # the file wins over the schema
    assert recipe.model.dim == 64
    assert recipe.trainer.precision == Recipe().trainer.precision  # the schema default stays
    assert recipe.strategy.keep_fp32_params == ["A_log$"]


def test_a_typo_key_is_rejected_with_a_suggestion(tmp_path: Path) -> None:
    recipe_file = tmp_path / "r.yaml"
    recipe_file.write_text("trainer:\n  max_step: 40\n")
    with pytest.raises(RecipeError, match=r"r.yaml: unknown key 'trainer.max_step'; did you mean 'max_steps'\?"):
        load_recipe(str(recipe_file))


def test_a_mistyped_value_is_rejected() -> None:
    with pytest.raises(RecipeError, match=r"trainer.devices='two': Value 'two' of type 'str' could not be converted"):
        load_recipe(None, ["trainer.devices=two"])


def test_every_problem_is_listed_together(tmp_path: Path) -> None:
    recipe_file = tmp_path / "r.yaml"
    recipe_file.write_text("trainr:\n  devices: 2\nmodel:\n  dim: 130\n")
    overrides = ["strategy.storage=fp64", "data.batch_size=many", "nonsense"]
    with pytest.raises(RecipeError) as error:
        load_recipe(str(recipe_file), overrides)
    message = str(error.value)
    assert message.startswith("Recipe has 5 problem(s):")
    assert "unknown key 'trainr'; did you mean 'trainer'?" in message
    assert "data.batch_size='many'" in message
    assert "override 'nonsense' is not key=value" in message
    assert "strategy.storage='fp64': Invalid value 'fp64', expected one of ['auto', 'keep', 'bf16', 'fp32']" in message
    assert "model.dim=130 is not divisible by model.n_heads=4" in message


def test_a_missing_recipe_file_names_the_fix() -> None:
    with pytest.raises(RecipeError, match=r"Recipe file 'nope.yaml' does not exist; pass --config conf/<recipe>.yaml"):
        load_recipe("nope.yaml")


@pytest.mark.parametrize("recipe_file", RECIPES, ids=lambda p: p.name)
def test_each_shipped_recipe_loads_and_starts_with_its_launch_command(recipe_file: Path) -> None:
    first_line = recipe_file.read_text().splitlines()[0]
    assert first_line.startswith(f"# python -m lightning_mixedfsdp.train --config conf/{recipe_file.name}")
    if recipe_file.name == "finetune_local_dir.yaml":  # a template: its placeholder paths are refused with the fix
        with pytest.raises(RecipeError, match=r"model.pretrained='/path/to/your/model' is not a directory holding"):
            load_recipe(str(recipe_file))
    else:
        load_recipe(str(recipe_file))


def test_main_job_trains_reports_perplexity_and_writes_checkpoint_and_export(tmp_path: Path) -> None:
    command = [
        sys.executable, "-m", "lightning_mixedfsdp.train", "--config", "conf/stdlib_llama.yaml",
        "trainer.max_steps=30", "trainer.val_check_interval=30", "model.dim=32", "model.hidden_dim=64",
        "model.n_layers=2", "data.seq_len=64", "data.val_windows=16", "data.max_bytes=300000",
        "optimizer.lr=0.01", f"output.dir={tmp_path}",
    ]  # fmt: skip
    completed = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    out = completed.stdout + completed.stderr
    assert completed.returncode == 0, out[-4000:]
    assert "mixed_fsdp2 dtype plan" in out and "replicated" in out
    before, after = map(float, re.search(r"held-out perplexity: ([\d.]+) untrained -> ([\d.]+)", out).groups())
    assert after < before / 4, out[-2000:]
    assert (tmp_path / "checkpoints" / "last.ckpt" / ".metadata").is_file()
    exported = load_file(str(tmp_path / "export" / "model.safetensors"))
    assert str(exported["layers.1.attention.A_log"].dtype) == "torch.float32"
    assert str(exported["layers.0.attention_norm.weight"].dtype) == "torch.float32"
    assert str(exported["output.weight"].dtype) == "torch.bfloat16"
    assert (tmp_path / "logs").is_dir()

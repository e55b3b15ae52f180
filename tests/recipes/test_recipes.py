"""Recipe files: merge precedence, typos rejected, every problem at once, each with its fix: the recipe file, the data
and the machine, all checked before any process starts. (The main job end to end: ``test_runner.py``.)"""

import json
import re
import sys
from pathlib import Path
from typing import List

import pytest
import torch

from lightning_mixedfsdp.recipes.run.loader import load_recipe
from lightning_mixedfsdp.recipes.settings.inputs import data_files
from lightning_mixedfsdp.recipes.settings.schema import Recipe, RecipeError

ROOT = Path(__file__).resolve().parents[2]
RECIPES = sorted((ROOT / "conf").glob("*.yaml"))
FAULT_TOLERANT = ["strategy.fault_tolerance.num_replica_groups=2", "strategy.fault_tolerance.replica_id=0"]


def test_schema_defaults_then_file_then_overrides(tmp_path: Path) -> None:
    recipe_file = tmp_path / "r.yaml"
    recipe_file.write_text("trainer:\n  max_steps: 40\n  devices: 1\nmodel:\n  dim: 64\n")
    recipe = load_recipe(str(recipe_file), ["trainer.max_steps=7", "strategy.keep_fp32_params=[A_log$]"])
    assert recipe.trainer.max_steps == 7  # the override wins over the file
    assert recipe.trainer.devices == 1  # the file wins over the schema
    assert recipe.model.dim == 64
    assert recipe.trainer.precision == Recipe().trainer.precision  # the schema default stays
    assert recipe.strategy.dtypes.keep_fp32_params == ["A_log$"]


def test_expert_parallel_size_is_a_strategy_key_handed_to_the_strategy() -> None:
    recipe = load_recipe(None, ["trainer.devices=4", "strategy.expert_parallel_size=2"])
    assert recipe.strategy_kwargs()["config"].parallelism.expert_parallel_size == 2
    with pytest.raises(
        RecipeError, match=r"strategy\.parallelism\.expert_parallel_size=3 must divide the data-parallel shard ranks"
    ):
        load_recipe(None, ["trainer.devices=4", "strategy.expert_parallel_size=3"])


def test_a_recipe_trains_in_the_precision_it_names(capsys: pytest.CaptureFixture) -> None:
    from lightning_mixedfsdp.config import resolve_bulk_dtypes
    from lightning_mixedfsdp.recipes.run.runner import main

    def bulk(*overrides: str) -> tuple:
        recipe = load_recipe(None, list(overrides), launching=False)
        dtypes = recipe.strategy_kwargs()["config"].dtypes
        return resolve_bulk_dtypes(dtypes.storage, dtypes.compute, dtypes.reduce, recipe.trainer.precision)[:2]

    assert bulk("trainer.precision=32-true") == (torch.float32, None)  # fp32 storage, computed in its own dtype
    assert bulk("trainer.precision=bf16-true") == (torch.bfloat16, torch.bfloat16)
    assert bulk("trainer.precision=bf16-mixed") == (torch.float32, torch.bfloat16)
    assert bulk("trainer.precision=32-true", "strategy.dtypes.storage=keep") == (None, None)  # the checkpoint's
    # Fabric and the Trainer keep Lightning's 32-true: the model as it arrives
    assert resolve_bulk_dtypes("auto", "auto", "auto", "32-true")[:2] == (None, None)
    main(["--config", "conf/stdlib_llama.yaml", "--dry-run", "trainer.precision=32-true"])
    out = capsys.readouterr().out
    assert "trainer.precision=32-true: the bulk is stored and trained in fp32 (strategy.dtypes.storage=auto)" in out
    assert "bulk: storage fp32," in out
    assert re.search(r"\nlayers\.\*\.attention\.wq\.weight x3 +128x128 +fp32 +fp32 +fp32 +sharded", out)


def test_every_runner_command_in_readme_names_a_shipped_recipe_with_keys_it_takes() -> None:
    import shlex

    from lightning_mixedfsdp.recipes.settings.schema import merge_recipe

    readme = (ROOT / "README.md").read_text()
    commands = re.findall(r"python -m lightning_mixedfsdp\.train ([^`&\n]*)", readme)
    assert len(commands) >= 8
    for command in commands:
        args = shlex.split(command)
        recipe_file = args[args.index("--config") + 1]
        assert (ROOT / recipe_file).is_file(), command
        overrides = [arg for arg in args if "=" in arg]
        _, problems = merge_recipe(str(ROOT / recipe_file), overrides)
        assert not problems, (command, problems)


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
    assert message.startswith("Recipe has 5 problems:\n")
    assert "unknown key 'trainr'; did you mean 'trainer'?" in message
    assert "data.batch_size='many'" in message
    assert "override 'nonsense' is not key=value" in message
    assert (
        "strategy.dtypes.storage='fp64': Invalid value 'fp64', expected one of ['auto', 'keep', 'bf16', 'fp32']"
        in message
    )
    assert "model.dim=130 is not divisible by model.n_heads=4" in message


def test_a_missing_recipe_file_names_the_closest_recipe_and_lists_conf() -> None:
    with pytest.raises(RecipeError) as error:
        load_recipe("conf/stdlib_lama.yaml")
    message = str(error.value)
    assert message.startswith("Recipe file 'conf/stdlib_lama.yaml' does not exist; pass --config conf/<recipe>.yaml")
    assert "did you mean 'conf/stdlib_llama.yaml'?" in message
    assert "Recipes in conf/: " + ", ".join(p.name for p in RECIPES) + "." in message


def test_a_bare_recipe_path_asks_for_config() -> None:
    with pytest.raises(RecipeError, match=r"is not key=value; did you mean `--config conf/stdlib_llama.yaml`"):
        load_recipe(None, ["conf/stdlib_llama.yaml"])


def test_an_accelerator_this_machine_lacks_is_one_line_before_launch() -> None:
    if torch.cuda.is_available():
        overrides, expected = [f"trainer.devices={torch.cuda.device_count() + 1}"], "but this machine has"
    else:
        overrides, expected = [], "this machine has no cuda/mps device; use trainer.accelerator=cpu"
    with pytest.raises(RecipeError) as error:
        load_recipe(None, ["trainer.accelerator=gpu", *overrides])
    assert str(error.value).startswith("Recipe has 1 problem: trainer.accelerator='gpu'")
    assert expected in str(error.value) and "\n" not in str(error.value)
    load_recipe(None, ["trainer.accelerator=gpu"], launching=False)  # a dry run plans for other machines


def test_data_files_takes_one_path_and_any_text_file(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    notes = _write(tmp_path / "docs" / "notes.md", "# notes\n" + "text " * 100)
    _write(tmp_path / "docs" / "script.py", "print('hello')\n" * 30)
    _write(tmp_path / "docs" / ".hidden.txt", "not walked into")
    train = _write(tmp_path / "train.jsonl", "\n".join(f'{{"text": "line {i} {"x" * 200}"}}' for i in range(20)))
    assert load_recipe(None, [f"data.files={train}"]).data.files == [str(train)]  # one path, not a list
    recipe = load_recipe(None, [f"data.files=[{tmp_path / 'docs'}, {notes}]", "data.seq_len=16"])
    files, problems = data_files(recipe.data)
    assert not problems
    assert [p.name for p in files] == ["notes.md", "script.py", "notes.md"]  # a directory: its files, sorted


def test_binary_data_files_are_refused_naming_the_file(tmp_path: Path) -> None:
    blob = tmp_path / "weights.bin"
    blob.write_bytes(bytes(range(256)))
    latin = tmp_path / "latin1.txt"
    latin.write_bytes("café".encode("latin-1"))
    with pytest.raises(RecipeError) as error:
        load_recipe(None, [f"data.files=[{blob}, {latin}]"])
    message = str(error.value)
    assert f"data.files: '{blob}' is binary (it holds NUL bytes); leave it out or convert it to text" in message
    assert f"data.files: '{latin}' is not UTF-8 text (byte 3)" in message


def test_a_jsonl_line_that_is_not_json_is_refused_with_json_s_whole_message(tmp_path: Path) -> None:
    lines = _write(tmp_path / "train.jsonl", '{"text": "fine"}\n{"text": "a\tb"}\n')
    with pytest.raises(RecipeError) as error:
        load_recipe(None, [f"data.files={lines}"])
    assert (
        f"data.files: {lines}:2 is not JSON (Invalid control character at: line 1 column 12 (char 11)); fix the line"
    ) in str(error.value)


def test_too_little_data_is_refused_before_launch_with_the_fix(tmp_path: Path) -> None:
    one = _write(tmp_path / "one.txt", "a single document " * 50)
    with pytest.raises(RecipeError) as error:
        load_recipe(None, [f"data.files={one}"])
    message = str(error.value)
    assert "data: too little text: 0 training tokens (one window needs 128)" in message
    assert "data.files gives 1 document" in message and "the first document is held out" in message
    docs = [_write(tmp_path / f"d{i}.txt", "x" * 300) for i in range(4)]
    with pytest.raises(RecipeError) as error:
        load_recipe(None, [f"data.files=[{', '.join(map(str, docs))}]", "data.seq_len=200"])
    message = str(error.value)
    assert "302 held-out tokens (2 data-parallel ranks need 400, a window each)" in message
    assert "lower data.held_out_every=10" in message
    load_recipe(None, [f"data.files=[{', '.join(map(str, docs))}]", "data.seq_len=150"])  # enough: 906 and 302


MAIN_JOB_EXPORT_READERS = (
    "stdlib_llama_sft.yaml", "stdlib_llama_distill.yaml", "stdlib_llama_dpo.yaml", "comparison_grpo.yaml",
)  # fmt: skip
"""Recipes that start from a run's export (the main job's, fine-tuned or the teacher; the fine-tuning job's; the
GRPO job's warm start)."""


@pytest.mark.parametrize("recipe_file", RECIPES, ids=lambda p: p.name)
def test_each_shipped_recipe_loads_and_starts_with_its_launch_command(recipe_file: Path) -> None:
    first_line = recipe_file.read_text().splitlines()[0]
    assert first_line.startswith(f"# python -m lightning_mixedfsdp.train --config conf/{recipe_file.name}")
    if "/path/to/your/model" in recipe_file.read_text():  # a template: its placeholder paths are refused with the fix
        with pytest.raises(RecipeError, match=r"model.pretrained='/path/to/your/model' is not a directory holding"):
            load_recipe(str(recipe_file))
    elif recipe_file.name in MAIN_JOB_EXPORT_READERS and not _read_export(recipe_file).is_dir():
        with pytest.raises(RecipeError, match=r"names a run's export.*run it first \(the recipe whose output.dir is"):
            load_recipe(str(recipe_file))  # (tests run from the checkout; the recipe's path is relative to it)
    else:
        load_recipe(str(recipe_file))


def _read_export(recipe_file: Path) -> Path:
    """The run export a recipe starts from (its teacher or its model), relative to the checkout."""
    import yaml

    recipe = yaml.safe_load(recipe_file.read_text())
    return ROOT / (recipe.get("teacher", {}).get("pretrained") or recipe["model"]["pretrained"])


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_an_unknown_logger_is_refused_with_the_choices() -> None:
    with pytest.raises(RecipeError, match=r"trainer.logger='mlflow': use one of csv, tensorboard, wandb"):
        load_recipe(None, ["trainer.logger=mlflow"], launching=False)


@pytest.mark.parametrize(
    ("overrides", "packages", "message"),
    [
        (
            ["trainer.logger=wandb"],
            ["wandb"],
            r"trainer.logger='wandb' needs wandb, which is not installed: pip install wandb$",
        ),
        (
            ["trainer.logger=tensorboard"],
            ["tensorboard", "tensorboardX"],
            r"trainer.logger='tensorboard' needs tensorboard, which is not installed: pip install tensorboard$",
        ),
        (
            [*FAULT_TOLERANT, "strategy.fault_tolerance.lighthouse=http://127.0.0.1:29510"],
            ["torchft"],
            r"strategy.fault_tolerance needs torchft, which is not installed: pip install 'lightning-mixedfsdp\[ft\]'",
        ),
        (
            ["peft.enabled=true", f"model.hf_config={ROOT / 'benchmarks' / 'configs' / 'llama3_8b.json'}"],
            ["peft"],
            r"peft.enabled=true needs peft, which is not installed: pip install 'lightning-mixedfsdp\[peft\]'",
        ),
    ],
    ids=["wandb", "tensorboard", "torchft", "peft"],
)
def test_a_package_the_recipe_needs_is_refused_before_launch_with_the_install_line(
    monkeypatch: pytest.MonkeyPatch, overrides: List[str], packages: List[str], message: str
) -> None:
    for package in packages:
        monkeypatch.setitem(sys.modules, package, None)  # as if not installed
    with pytest.raises(RecipeError, match=message):
        load_recipe(None, overrides)


def test_a_context_parallel_sequence_length_must_split_into_its_chunks() -> None:
    with pytest.raises(RecipeError, match=r"data.seq_len=102 must divide into 2 x .*context_parallel_size = 4 chunks"):
        load_recipe(None, ["strategy.parallelism.context_parallel_size=2", "data.seq_len=102"], launching=False)


WORLD = "(trainer.devices=2 x trainer.num_nodes=1 = 2)"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["strategy.data_parallel_size=4"],
            "the sizes `strategy.parallelism.data_parallel_replicate_size=1`,"
            " `strategy.parallelism.data_parallel_size=4` and `strategy.parallelism.tensor_parallel_size=1` multiplied"
            f" should equal the world size {WORLD}; change the sizes or the number of"
            " trainer.devices/trainer.num_nodes",
        ),
        (
            ["strategy.parallelism.context_parallel_size=3", "data.seq_len=96", "model.mixer_layers=[]"],
            f"strategy.parallelism.context_parallel_size=3 must divide the world size {WORLD}; use a divisor of it",
        ),
        (
            [
                "trainer.devices=4",
                "strategy.parallelism.context_parallel_size=2",
                "strategy.parallelism.expert_parallel_size=2",
                "model.mixer_layers=[]",
            ],
            "strategy.parallelism.context_parallel_size=2 with strategy.parallelism.expert_parallel_size=2 is not"
            " supported",
        ),
        (
            ["strategy.data_parallel_replicate_size=0"],  # the flat key reaches the group, whose check names it
            "strategy.parallelism.data_parallel_replicate_size=0 must be an int >= 1; use 1 for plain FSDP",
        ),
    ],
    ids=["sizes_multiply_to_the_world", "cp_divides_the_world", "cp_with_ep", "replicate_positive"],
)
def test_mesh_sizes_the_strategy_refuses_at_setup_are_refused_before_launch_in_recipe_keys(
    overrides: list, message: str
) -> None:
    """ParallelDims' own problems (what the strategy raises once its processes run), named by the recipe keys."""
    with pytest.raises(RecipeError) as error:
        load_recipe(None, overrides)
    assert f"- {message}" in str(error.value) or f"1 problem: {message}" in str(error.value)


def test_the_reference_models_mixer_layers_under_context_parallelism_are_refused_with_the_fix() -> None:
    main_job, context = str(ROOT / "conf" / "stdlib_llama.yaml"), "strategy.parallelism.context_parallel_size=2"
    with pytest.raises(RecipeError) as error:
        load_recipe(main_job, [context])
    assert str(error.value) == (
        "Recipe has 1 problem: model.mixer_layers=[1]: a Mamba-style mixer runs along the whole sequence, and"
        " strategy.parallelism.context_parallel_size=2 splits every sequence across ranks (only attention runs on"
        " split sequences, as ring attention); set model.mixer_layers=[] (attention in every layer, as"
        " conf/stdlib_llama_long.yaml) or strategy.parallelism.context_parallel_size=1"
    )
    load_recipe(main_job, [context, "model.mixer_layers=[]"], launching=False)  # the fix


def test_a_reference_export_with_mixer_layers_under_context_parallelism_is_refused(tmp_path: Path) -> None:
    config = {"model_type": "mixedfsdp_tinyllama", "vocab_size": 256, "dim": 32, "n_layers": 2, "mixer_layers": [1]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(RecipeError) as error:
        load_recipe(None, [f"model.pretrained={tmp_path}", "strategy.parallelism.context_parallel_size=2"])
    assert str(error.value) == (
        f"Recipe has 1 problem: model.pretrained={str(tmp_path)!r}: this export of the reference model has mixer"
        " layers [1] (its config.json), which run along the whole sequence, and"
        " strategy.parallelism.context_parallel_size=2 splits every sequence across ranks; set"
        " strategy.parallelism.context_parallel_size=1, or fine-tune an export trained with model.mixer_layers=[]"
    )


def test_an_hf_models_sequence_mixers_under_context_parallelism_are_refused_naming_the_modules() -> None:
    """Asked of the model built on the meta device, as the model setup asks it at setup; an attention-only HF model
    passes."""
    context = "strategy.parallelism.context_parallel_size=2"
    with pytest.raises(RecipeError) as error:
        load_recipe(str(ROOT / "conf" / "hf_qwen3_next_tiny.yaml"), [context], launching=False)
    message = str(error.value)
    assert message.startswith("Recipe has 1 problem: model.hf_config: strategy.parallelism.context_parallel_size=2")
    assert (
        "model.layers.0.linear_attn (Qwen3NextGatedDeltaNet)" in message
        and "strategy.parallelism.context_parallel_size=1" in message
    )
    load_recipe(str(ROOT / "conf" / "hf_llama_qlora_tiny.yaml"), [context], launching=False)


def test_a_strategy_problem_in_a_recipe_gives_its_fix_in_recipe_keys() -> None:
    with pytest.raises(RecipeError) as error:
        load_recipe(
            None,
            ["strategy.parallelism.context_parallel_size=2", "strategy.sharding.compile=true", "model.mixer_layers=[]"],
        )
    assert str(error.value) == (
        "Recipe has 1 problem: strategy.parallelism.context_parallel_size=2 with strategy.sharding.compile=true is not"
        " supported: the ring attention's routing runs outside compiled code; set strategy.sharding.compile=false (or"
        " strategy.parallelism.context_parallel_size=1)."
    )


def test_fault_tolerance_without_a_lighthouse_is_refused_before_launch_in_recipe_keys(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    with pytest.raises(RecipeError) as error:
        load_recipe(None, FAULT_TOLERANT)
    assert (
        "strategy.fault_tolerance has no lighthouse: set strategy.fault_tolerance.lighthouse='http://host:29510' or"
        " $TORCHFT_LIGHTHOUSE, after starting one with `torchft_lighthouse"
    ) in str(error.value)

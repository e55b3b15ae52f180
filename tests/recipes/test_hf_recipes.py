"""Recipes that train Hugging Face models through the runner: every shipped recipe for a few steps (``runner.main``
on 2 ranks started as torchrun starts them, forked from the tests' fork server), fine-tuning, as a user launches it
(``python -m lightning_mixedfsdp.train``), a local save_pretrained() directory that ships its own modelling code
with jsonl data and a locally built tokenizer, the exports loaded back, and one test per input error, each reported
before any process starts (resume: ``test_runner.py``)."""

import functools
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict

import pytest
import torch
from safetensors.torch import load_file

from lightning_mixedfsdp.recipes.run.loader import load_recipe
from lightning_mixedfsdp.recipes.settings.schema import RecipeError
from tests.hf_models import tiny_config
from tests.launch_together import run_together
from tests.recipes.exports import assert_the_export_states_its_dtype
from tests.recipes.runner_ranks import run_recipe

pytestmark = pytest.mark.compat  # a private torch or transformers API: .ci/compat runs it on both ends

ROOT = Path(__file__).resolve().parents[2]
TEXT = (Path(json.__file__).read_text(encoding="utf-8") * 3).split("\n\n")
FP32_IN_CHECKPOINT = (
    "model.layers.0.mlp.gate_proj.weight",
    "model.norm.weight",
    "model.layers.1.input_layernorm.weight",
)
MODELLING_CODE = """from transformers import LlamaConfig, LlamaForCausalLM


class TinyCustomConfig(LlamaConfig):
    model_type = "tiny_custom"


class TinyCustomForCausalLM(LlamaForCausalLM):
    config_class = TinyCustomConfig
"""
"""A model type transformers does not know, defined by the folder's own code (as a remote-code model on the hub)."""
AUTO_MAP = {
    "AutoConfig": "modeling_tiny_custom.TinyCustomConfig",
    "AutoModelForCausalLM": "modeling_tiny_custom.TinyCustomForCausalLM",
}
TINY = ["trainer.val_check_interval=3", "data.val_windows=4", "data.max_bytes=200000", "trainer.log_every_n_steps=1"]


def train(*args: str, cwd: Path = ROOT) -> str:
    command = [sys.executable, "-m", "lightning_mixedfsdp.train", *args]
    completed = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=420)
    out = completed.stdout + completed.stderr
    assert completed.returncode == 0, out[-5000:]
    return out


def dcp_state(checkpoint: Path, tmp: Path) -> Dict[str, torch.Tensor]:
    """The model weights of a Trainer DCP checkpoint, by HF name."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(checkpoint), str(tmp / "checkpoint.pt"))
    state = torch.load(tmp / "checkpoint.pt", weights_only=False)["state_dict"]
    return {name[len("model.") :]: value for name, value in state.items()}


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A BPE tokenizer trained and saved here: no download."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "</s>"])
    tokenizer.train_from_iterator(TEXT, trainer)
    directory = tmp_path_factory.mktemp("tokenizer")
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", eos_token="</s>").save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def pretrained_dir(tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model folder as a user has it: bf16 weights, some tensors deliberately fp32, its tokenizer, and its own
    modelling code (a Llama under a model type of its own, named by ``auto_map``)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(11)
    model = AutoModelForCausalLM.from_config(tiny_config("llama", vocab_size=320)).to(torch.bfloat16)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name in FP32_IN_CHECKPOINT:
                param.data = param.data.float() + torch.randn_like(param.data.float()) * 1e-3  # not bf16-exact
    directory = tmp_path_factory.mktemp("pretrained")
    model.save_pretrained(directory)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(directory)
    config = json.loads((directory / "config.json").read_text())
    config.update(model_type="tiny_custom", architectures=["TinyCustomForCausalLM"], auto_map=AUTO_MAP)
    (directory / "config.json").write_text(json.dumps(config))
    (directory / "modeling_tiny_custom.py").write_text(MODELLING_CODE)
    return directory


@pytest.fixture(scope="module")
def jsonl_files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("jsonl")
    for part in range(2):
        lines = [json.dumps({"content": text, "id": i}) for i, text in enumerate(TEXT[part::2]) if text.strip()]
        (folder / f"part{part}.jsonl").write_text("\n".join(lines) + "\n")
    return folder


SHIPPED = ["hf_qwen3_next_tiny", "hf_gpt_oss_lora", "hf_llama_qlora_tiny"]


def _finetune(pretrained_dir: Path, jsonl_files: Path, output: Path) -> Dict[str, Any]:
    """conf/finetune_local_dir.yaml on the local directory, jsonl data and its tokenizer; lr 0, so the export must
    equal what was loaded."""
    out = train(
        "--config", "conf/finetune_local_dir.yaml", *TINY, "trainer.max_steps=3", "optimizer.lr=0",
        f"model.pretrained={pretrained_dir}", "model.trust_remote_code=true", f"data.tokenizer={pretrained_dir}",
        "data.text_field=content",
        f"data.files=[{jsonl_files}/*.jsonl]", "data.seq_len=32", "data.batch_size=2", f"output.dir={output}",
    )  # fmt: skip
    return {"out": out, "output": output}


@pytest.fixture(scope="module")
def launches(pretrained_dir: Path, jsonl_files: Path, tmp_path_factory: pytest.TempPathFactory) -> Dict[str, Any]:
    """The local directory's fine-tuning beside every shipped HF recipe for 3 steps, launched together."""
    root = tmp_path_factory.mktemp("launches")

    def shipped(recipe: str) -> Dict[str, Any]:
        recipe_file, output = str(ROOT / "conf" / f"{recipe}.yaml"), root / recipe
        return {"out": run_recipe("--config", recipe_file, *TINY, "trainer.max_steps=3", f"output.dir={output}",
                                  output=output)}  # fmt: skip

    jobs: Dict[str, Any] = {"finetuned": lambda: _finetune(pretrained_dir, jsonl_files, root / "finetune")}
    jobs.update({recipe: functools.partial(shipped, recipe) for recipe in SHIPPED})
    out = run_together(jobs)
    for recipe in SHIPPED:
        out[recipe]["folder"] = root / recipe
    return out


@pytest.fixture(scope="module")
def finetuned(launches: Dict[str, Any]) -> Dict[str, Any]:
    return launches["finetuned"]


def test_finetuning_a_local_directory_loads_its_fp32_tensors_exactly(
    finetuned: Dict[str, Any], pretrained_dir: Path
) -> None:
    checkpoint = load_file(str(pretrained_dir / "model.safetensors"))
    exported = load_file(str(finetuned["output"] / "export" / "model.safetensors"))
    for name in FP32_IN_CHECKPOINT:
        assert checkpoint[name].dtype == exported[name].dtype == torch.float32, name
        assert torch.equal(exported[name], checkpoint[name]), name
    for name, tensor in checkpoint.items():
        assert torch.equal(exported[name].to(tensor.dtype), tensor), name  # bf16 ones too (lr 0: nothing moved)
    assert (
        "keep-fp32 rule" in finetuned["out"]
        and r"param:^model\.layers\.\d+\.mlp\.gate_proj\.weight$" in (finetuned["out"])
    )


def test_jsonl_data_with_a_local_hf_tokenizer_trains_and_the_export_carries_the_tokenizer(
    finetuned: Dict[str, Any],
) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    export = finetuned["output"] / "export"
    assert "held-out perplexity" in finetuned["out"]
    tokenizer = AutoTokenizer.from_pretrained(export)
    assert len(tokenizer) == 300 and tokenizer.eos_token == "</s>"
    trained = dcp_state(finetuned["output"] / "checkpoints" / "last.ckpt", finetuned["output"])
    # the export carries the folder's modelling code, as the folder did
    assert (export / "modeling_tiny_custom.py").read_text() == MODELLING_CODE
    loaded_model = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32, trust_remote_code=True)
    assert type(loaded_model).__name__ == "TinyCustomForCausalLM"
    loaded = loaded_model.state_dict()
    for name, value in trained.items():
        assert torch.equal(loaded[name], value.float()), name


def test_a_fine_tuned_bf16_folders_export_says_bfloat16_as_its_input_did(
    finetuned: Dict[str, Any], pretrained_dir: Path
) -> None:
    assert json.loads((pretrained_dir / "config.json").read_text())["dtype"] == "bfloat16"
    export = finetuned["output"] / "export"
    assert_the_export_states_its_dtype(export, torch.bfloat16, trust_remote_code=True)


@pytest.mark.parametrize("recipe", SHIPPED)
def test_shipped_hf_recipe_trains_and_exports_what_it_trained(launches: Dict[str, Any], recipe: str) -> None:
    from transformers import AutoModelForCausalLM

    out, tmp_path = launches[recipe]["out"], launches[recipe]["folder"]
    assert "held-out perplexity" in out and "mixed_fsdp2 dtype plan" in out
    exported = load_file(str(tmp_path / "export" / "model.safetensors"))
    assert exported["model.norm.weight"].dtype == torch.float32
    # config.json says what the bulk is stored in (bf16), merged LoRA included; an fp32 load keeps every value
    assert_the_export_states_its_dtype(tmp_path / "export", torch.bfloat16)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "export", dtype=torch.float32).state_dict()
    if recipe == "hf_qwen3_next_tiny":
        from lightning_mixedfsdp.recipes.run.hf_export import load_export

        assert exported["model.layers.0.linear_attn.A_log"].dtype == torch.float32
        trained = dcp_state(tmp_path / "checkpoints" / "last.ckpt", tmp_path)
        for name, value in trained.items():
            assert loaded[name].dtype == torch.float32 and torch.equal(loaded[name], value.float()), name
        # load_export: each tensor in the dtype the export holds it in (bf16 bulk, fp32 norms and A_log), as trained
        mixed = load_export(tmp_path / "export", torch.bfloat16)
        state = mixed.state_dict()
        for name, value in trained.items():
            assert state[name].dtype == value.dtype and torch.equal(state[name], value), name
        tokens = torch.tensor([list(TEXT[0].encode()[:32])])
        with torch.no_grad():
            assert mixed(input_ids=tokens).logits.dtype == torch.bfloat16  # boundaries: fp32 norms return bf16
    else:
        from peft import PeftModel
        from transformers import AutoConfig

        trained = dcp_state(tmp_path / "checkpoints" / "last.ckpt", tmp_path)
        base = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tmp_path / "export"))
        adapters = {n: p for n, p in PeftModel.from_pretrained(base, tmp_path / "adapter").named_parameters()}
        lora = [n for n in trained if "lora_" in n]
        assert lora and all(torch.equal(adapters[n], trained[n]) for n in lora)
        if recipe == "hf_llama_qlora_tiny":  # the 4-bit base is no part of a checkpoint; the export holds it in bf16
            assert not any("base_layer" in n for n in trained)
            assert exported["model.layers.0.mlp.down_proj.weight"].dtype == torch.bfloat16


def test_dry_run_prints_the_plan_and_the_memory_per_rank_and_trains_nothing(capsys: Any, tmp_path: Path) -> None:
    from lightning_mixedfsdp.recipes.run.runner import main

    main(["--config", "conf/hf_qwen3_next_tiny.yaml", "--dry-run", f"output.dir={tmp_path}"])
    out = capsys.readouterr().out
    assert "mixed_fsdp2 dtype plan" in out and "training state per rank" in out and "world size 2" in out
    assert not any(tmp_path.iterdir())


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_a_missing_pretrained_directory_is_refused_before_launch(tmp_path: Path) -> None:
    with pytest.raises(RecipeError, match=r"model.pretrained='.*nowhere' is not a directory holding a config.json"):
        load_recipe(None, [f"model.pretrained={tmp_path / 'nowhere'}"])


def test_an_hf_config_without_model_type_is_refused_with_the_fix(tmp_path: Path) -> None:
    config = _write(tmp_path / "config.json", '{"hidden_size": 32}')
    with pytest.raises(RecipeError, match=r"config.json has no 'model_type'; add it \(e.g. model_type: llama\)"):
        load_recipe(None, [f"model.hf_config={config}"])


def test_a_jsonl_line_without_the_text_field_is_refused_naming_file_and_line(tmp_path: Path) -> None:
    data = _write(tmp_path / "d.jsonl", '{"text": "fine"}\n{"body": "no text here"}\n')
    with pytest.raises(RecipeError, match=r"d.jsonl:2 has no text field 'text' \(it has \['body'\]\); set data.text"):
        load_recipe(None, [f"data.files=[{data}]"])


def test_a_tokenizer_larger_than_the_embedding_is_refused(tokenizer_dir: Path) -> None:
    with pytest.raises(RecipeError, match=r"has 300 tokens, more than the model's embedding \(256\); use a model"):
        load_recipe(None, [f"data.tokenizer={tokenizer_dir}"])


def test_hf_config_and_pretrained_together_are_refused(pretrained_dir: Path) -> None:
    with pytest.raises(RecipeError, match=r"model.hf_config and model.pretrained are both set; keep hf_config"):
        load_recipe(None, [f"model.hf_config={pretrained_dir}", f"model.pretrained={pretrained_dir}"])


def test_a_folder_with_its_own_modelling_code_is_refused_before_launch_without_trust_remote_code(
    pretrained_dir: Path,
) -> None:
    with pytest.raises(
        RecipeError,
        match=r"model.pretrained='.*' ships Python code that transformers would run to build the model \(config.json's"
        r" auto_map .*modeling_tiny_custom.TinyCustomForCausalLM.*\); set model.trust_remote_code=true if you trust",
    ):
        load_recipe(None, [f"model.pretrained={pretrained_dir}", f"data.tokenizer={pretrained_dir}"])


def _broken_copy(folder: Path, name: str, tmp_path: Path) -> Path:
    """A copy of ``folder`` whose ``name`` lost a closing brace, as a hand edit leaves it."""
    import shutil

    copy = tmp_path / folder.name
    shutil.copytree(folder, copy)
    text = (copy / name).read_text()
    (copy / name).write_text(text[: text.rindex("}")])
    return copy


@pytest.mark.parametrize("name", ["config.json", "tokenizer_config.json"])
def test_a_model_folder_json_file_that_is_not_json_is_refused_before_launch_in_one_line(
    pretrained_dir: Path, tmp_path: Path, name: str
) -> None:
    broken = _broken_copy(pretrained_dir, name, tmp_path)
    overrides = [f"model.pretrained={broken}", "model.trust_remote_code=true", f"data.tokenizer={broken}"]
    with pytest.raises(RecipeError) as raised:
        load_recipe(None, overrides)
    (line,) = [line for line in str(raised.value).splitlines() if name in line]
    assert f"model.pretrained={str(broken)!r}: {broken / name} is not valid JSON: Expecting" in line
    assert re.search(r"at line \d+, column \d+; fix the file", line), line
    assert "Traceback" not in str(raised.value)


def test_a_tokenizer_folder_json_file_that_is_not_json_is_refused_before_launch(
    tokenizer_dir: Path, tmp_path: Path
) -> None:
    broken = _broken_copy(tokenizer_dir, "tokenizer_config.json", tmp_path)
    with pytest.raises(RecipeError, match=r"data.tokenizer='.*': .*tokenizer_config.json is not valid JSON: Expecting"):
        load_recipe(None, [f"data.tokenizer={broken}"])

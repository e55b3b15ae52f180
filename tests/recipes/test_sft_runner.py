"""Supervised fine-tuning through the runner, as a user runs it (``python -m lightning_mixedfsdp.train``, 2 CPU
processes), at tiny sizes: the main job's export fine-tuned on the generated chat data by
``conf/stdlib_llama_sft.yaml`` (the held-out loss on the trained tokens falls, an answer is generated from the
export, the export's tokenizer renders chats as training did, and a run resumed from its middle checkpoint repeats
the uninterrupted losses bit for bit; the precision monitor's recipe key logs its shares); and the HF recipes
(``sft_local_dir*.yaml``) on a local model with a ChatML tokenizer: chat with LoRA, chat with QLoRA,
prompt/completion pairs in full, one per row."""

import functools
import importlib.util
import json
import re
import shutil
from pathlib import Path
from typing import Any, Dict

import pytest
import torch

from lightning_mixedfsdp.recipes.run.plot import read_metrics
from tests.launch_together import run_together
from tests.recipes.runner_ranks import run_recipe
from tests.recipes.sft_tokenizers import save_tokenizer
from tests.recipes.test_hf_recipes import ROOT, train

SFT = [
    "--config", "conf/stdlib_llama_sft.yaml", "trainer.max_steps=8", "trainer.val_check_interval=8",
    "trainer.checkpoint_every_n_steps=4", "trainer.log_every_n_steps=1", "data.val_windows=2", "data.seq_len=256",
]  # fmt: skip
LOSS = r"held-out loss on the trained tokens: ([\d.]+) before -> ([\d.]+) after 8 steps"


HF_RUNS = [("sft_local_dir_lora", "chat"), ("sft_local_dir_qlora", "chat"), ("sft_local_dir", "pairs")]
"""The HF recipes, each on the local model with the data it fine-tunes."""


def _fine_tune_and_resume(export: Path, root: Path) -> Dict[str, Any]:
    """The SFT recipe on the main job's export, then the same run resumed from its step-4 checkpoint."""
    whole, resumed = root / "whole", root / "resumed"
    out: Dict[str, Any] = {"whole": whole, "export": export}
    out["whole_out"] = train(*SFT, f"model.pretrained={export}", f"output.dir={whole}", "monitor.every_n_steps=2")
    # the run as it stood at step 4, resumed from there
    shutil.copytree(whole, resumed, ignore=shutil.ignore_patterns("last.ckpt", "step=8.ckpt", "export"))
    shutil.rmtree(resumed / "logs")
    out["resumed_out"] = train(*SFT, f"model.pretrained={export}", f"output.dir={resumed}", "--resume", "last")
    out["whole_metrics"] = read_metrics(whole / "logs")
    out["whole_losses"] = out["whole_metrics"]["train_loss"]
    out["resumed_losses"] = read_metrics(resumed / "logs")["train_loss"]
    return out


def _hf_recipe(recipe: str, data: str, local_model: Dict[str, Path], folder: Path) -> Dict[str, Any]:
    model = local_model["model"]
    out = run_recipe(
        "--config", str(ROOT / "conf" / f"{recipe}.yaml"), f"model.pretrained={model}", f"data.tokenizer={model}",
        f"data.files={local_model[data]}", "data.seq_len=128", "data.held_out_every=4", "data.val_windows=2",
        "trainer.max_steps=3", "trainer.val_check_interval=3", f"output.dir={folder}",
        *(["data.packing=false"] if data == "pairs" else []),  # one pair per row: the unpacked rows
        output=folder)  # fmt: skip
    return {"out": out, "folder": folder}


@pytest.fixture(scope="module")
def launches(
    main_job: Dict[str, Any], local_model: Dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Dict[str, Any]:
    """The SFT recipe on the main job's export and its resume, beside each HF recipe on the local model (QLoRA's
    only with torchao), launched together."""
    root = tmp_path_factory.mktemp("sft")
    recipes = {
        recipe: functools.partial(_hf_recipe, recipe, data, local_model, root / recipe)
        for recipe, data in HF_RUNS
        if not (recipe.endswith("qlora") and importlib.util.find_spec("torchao") is None)
    }

    def one_after_the_other(*names: str) -> Dict[str, Any]:
        return {name: recipes[name]() for name in names if name in recipes}

    # three chains side by side: the SFT run then its resume, LoRA then QLoRA, the pairs
    chains = run_together({
        "sft": lambda: {"sft": _fine_tune_and_resume(main_job["export"], root)},
        "adapters": lambda: one_after_the_other("sft_local_dir_lora", "sft_local_dir_qlora"),
        "pairs": lambda: one_after_the_other("sft_local_dir"),
    })  # fmt: skip
    return {name: result for chain in chains.values() for name, result in chain.items()}


@pytest.fixture(scope="module")
def runs(launches: Dict[str, Any]) -> Dict[str, Any]:
    return launches["sft"]


def test_fine_tuning_the_main_jobs_export_lowers_the_held_out_loss_and_answers(runs: Dict[str, Any]) -> None:
    out = runs["whole_out"]
    before, after = map(float, re.search(LOSS, out).groups())  # type: ignore[union-attr]
    assert after < before
    assert re.search(r"data: chat, \d+ training and \d+ held-out examples in \d+ and \d+ rows of 256 tokens", out)
    assert "held-out question: " in out and "export's answer: " in out and "the data's answer: " in out
    assert "param:" in out  # the export's fp32 tensors are keep-fp32 rules of the plan


def test_the_exports_tokenizer_renders_chats_as_training_did(runs: Dict[str, Any]) -> None:
    from transformers import AutoTokenizer

    from lightning_mixedfsdp.recipes.data.chat import byte_chat_format

    tokenizer = AutoTokenizer.from_pretrained(runs["whole"] / "export")
    messages = [{"role": "user", "content": "What does `math.fabs` do?"}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == byte_chat_format(lambda t: list(t.encode())).render(messages, True)
    assert tokenizer(rendered)["input_ids"] == list(rendered.encode())


def test_a_run_resumed_from_its_middle_checkpoint_repeats_the_losses(runs: Dict[str, Any]) -> None:
    whole, resumed = runs["whole_losses"], runs["resumed_losses"]
    assert sorted(resumed) == [4, 5, 6, 7] and sorted(whole) == list(range(8))  # steps 5 to 8, logged 0-based
    assert all(resumed[step] == whole[step] for step in resumed), (whole, resumed)


@pytest.fixture(scope="module")
def local_model(tmp_path_factory: pytest.TempPathFactory) -> Dict[str, Path]:
    """An HF Llama saved with a ChatML tokenizer, and chat and prompt/completion data."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.hf_models import tiny_config

    root = tmp_path_factory.mktemp("local")
    tokenizer = AutoTokenizer.from_pretrained(str(save_tokenizer(root / "tokenizer", "chatml")))
    torch.manual_seed(5)
    model = AutoModelForCausalLM.from_config(tiny_config("llama", vocab_size=len(tokenizer))).to(torch.bfloat16)
    model.save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    pairs = [(f"What is {a} plus {b}?", f"It is {a + b}.") for a in range(6) for b in range(4)]
    with (root / "chat.jsonl").open("w") as chat, (root / "pairs.jsonl").open("w") as completions:
        for question, answer in pairs:
            messages = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
            chat.write(json.dumps({"messages": messages}) + "\n")
            completions.write(json.dumps({"prompt": f"Q: {question}\nA:", "completion": f" {answer}"}) + "\n")
    return {"model": root / "model", "chat": root / "chat.jsonl", "pairs": root / "pairs.jsonl"}


@pytest.mark.parametrize("recipe, data", HF_RUNS)
def test_the_hf_fine_tuning_recipes_train_on_a_local_model(launches: Dict[str, Any], recipe: str, data: str) -> None:
    if recipe.endswith("qlora"):
        pytest.importorskip("torchao", reason="QLoRA needs torchao (pip install 'lightning-mixedfsdp[qlora]')")
    out, tmp_path = launches[recipe]["out"], launches[recipe]["folder"]
    fine_tuning = "chat" if data == "chat" else "instruction"
    assert f"data: {fine_tuning}, 18 training and 6 held-out examples" in out
    before, after = map(float, re.search(r"trained tokens: ([\d.]+) before -> ([\d.]+)", out).groups())  # type: ignore[union-attr]
    assert after < before
    assert "export's answer: " in out
    assert (tmp_path / "export" / "model.safetensors").is_file()
    assert (tmp_path / "adapter").is_dir() == ("lora" in recipe)


def test_the_precision_monitor_recipe_key_logs_shares_and_a_summary_line(runs: Dict[str, Any]) -> None:
    shares = runs["whole_metrics"]["stalled_share/model.output.weight"]
    assert sorted(shares) == [0, 2, 4, 6] and all(0 <= share <= 1 for share in shares.values())
    assert "stalled_share/model.layers.0.attention_norm.weight" not in runs["whole_metrics"]  # kept fp32: not measured
    assert re.search(r"precision monitor: 4 samples, \d+ bf16 params measured, \d+ kept fp32", runs["whole_out"])

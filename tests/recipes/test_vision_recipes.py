"""Image-text fine-tuning through the recipes, as a user runs it: a local Llava folder (saved here from config, with
its processor) fine-tuned on a jsonl of image chats and text-only chats (2 CPU processes), its tower frozen; the
same with LoRA on the language model; the masks; every refusal before launch; the planner on Llava, Qwen2-VL and
Gemma 3 configs."""

import json
import re
from pathlib import Path
from typing import Any, Dict, List

import pytest
import torch

from lightning_mixedfsdp.model.tensors import IGNORE_INDEX
from lightning_mixedfsdp.recipes.data.shapes import IMAGE_TOKEN_ID, shapes_processor, shapes_records
from lightning_mixedfsdp.recipes.data.vision import VisionExampleMaker
from lightning_mixedfsdp.recipes.run.loader import load_recipe
from lightning_mixedfsdp.recipes.settings.schema import RecipeError
from tests.hf_models import COMMON
from tests.launch_together import run_together
from tests.recipes.exports import assert_the_export_states_its_dtype
from tests.recipes.runner_ranks import run_recipe
from tests.scenarios import NEEDS_UNUSED_REDUCTION

pytestmark = pytest.mark.compat  # a private torch or transformers API: .ci/compat runs it on both ends

ROWS = 48
TOWER = "model.vision_tower."


def llava_config(**overrides: Any) -> Any:
    from transformers import AutoConfig

    vision = dict(
        model_type="siglip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, image_size=32, patch_size=8,
    )  # fmt: skip
    fields = dict(
        text_config=dict(COMMON, model_type="llama", max_position_embeddings=64),
        vision_config=vision,
        image_token_id=IMAGE_TOKEN_ID,
        vision_feature_layer=-1,
        vision_feature_select_strategy="full",
    )
    return AutoConfig.for_model("llava", **{**fields, **overrides})


def write_rows(folder: Path, rows: List[Dict[str, Any]]) -> Path:
    """``rows`` as a jsonl in ``folder``, each row's PIL images saved under ``img/`` beside it."""
    (folder / "img").mkdir(parents=True, exist_ok=True)
    lines = []
    for index, row in enumerate(rows):
        line = {"messages": row["messages"]}
        if row.get("images"):
            line["images"] = []
            for number, image in enumerate(row["images"]):
                image.save(folder / "img" / f"{index}_{number}.png")
                line["images"].append(f"img/{index}_{number}.png")
        lines.append(json.dumps(line))
    (folder / "chats.jsonl").write_text("\n".join(lines) + "\n")
    return folder / "chats.jsonl"


@pytest.fixture(scope="module")
def llava_folder(tmp_path_factory: pytest.TempPathFactory) -> Dict[str, Path]:
    from transformers import AutoModelForImageTextToText

    root = tmp_path_factory.mktemp("vlm")
    torch.manual_seed(0)
    AutoModelForImageTextToText.from_config(llava_config()).save_pretrained(root / "llava")
    shapes_processor().save_pretrained(root / "llava")
    data = write_rows(root / "data", [record for _, record in shapes_records(ROWS)])
    return {"model": root / "llava", "data": data, "root": root}


def recipe_args(folder: Dict[str, Path], out: Path, *extra: str) -> List[str]:
    return [
        "trainer.devices=2", "trainer.precision=bf16-true", "trainer.max_steps=4", "trainer.val_check_interval=4",
        "trainer.log_every_n_steps=1", f"model.pretrained={folder['model']}", f"data.files=[{folder['data']}]",
        "data.seq_len=32", "data.batch_size=2", "data.val_windows=4", "data.held_out_every=6",
        f"output.dir={out}", *extra,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def runs(llava_folder: Dict[str, Path]) -> Dict[str, Any]:
    """The full fine-tuning (activation checkpointing, the precision monitor) and the LoRA one, launched together."""
    root = llava_folder["root"]
    full = recipe_args(
        llava_folder, root / "full", "strategy.sharding.activation_checkpointing=full", "monitor.every_n_steps=2"
    )
    lora = recipe_args(llava_folder, root / "lora", "peft.enabled=true", "peft.target_modules=[q_proj,v_proj]")
    launches = {
        "full": lambda: run_recipe(*full, output=root / "full"),
        "lora": lambda: run_recipe(*lora, output=root / "lora"),
    }
    return {**run_together(launches), "root": root}


def pretrained(folder: Path) -> Dict[str, torch.Tensor]:
    """The folder's weights by the model's names (transformers 5 saves Llava in its legacy layout, and renames it at
    load, as ``load_full_weights`` does)."""
    from transformers import AutoModelForImageTextToText

    return dict(AutoModelForImageTextToText.from_pretrained(folder).state_dict())


def tensors(folder: Path) -> Dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k: v for file in sorted(folder.glob("*.safetensors")) for k, v in load_file(file).items()}


@NEEDS_UNUSED_REDUCTION
def test_a_llava_folder_fine_tunes_with_its_tower_frozen_and_exports_with_its_processor(
    runs: Dict[str, Any], llava_folder: Dict[str, Path]
) -> None:
    from transformers import AutoModelForImageTextToText, AutoProcessor

    out = runs["full"]
    assert re.search(r"data: image-text chat, \d+ training examples \(\d+ with images\)", out)
    assert "model.freeze froze 48 tensors" in out and ": model.vision_tower" in out
    assert re.search(r"held-out answer accuracy: [\d.]+% before -> [\d.]+% after 4 steps", out)
    export = runs["root"] / "full" / "export"
    before, after = pretrained(llava_folder["model"]), tensors(export)
    tower = [n for n in before if n.startswith(TOWER)]
    assert tower and all(torch.equal(after[n], before[n].to(after[n].dtype)) for n in tower)  # unchanged
    norms = [n for n in tower if "norm" in n]
    assert norms and all(after[n].dtype == torch.float32 for n in norms)
    projector = [n for n in before if "multi_modal_projector" in n]
    assert any(not torch.equal(after[n], before[n].to(after[n].dtype)) for n in projector)  # trained
    model = AutoModelForImageTextToText.from_pretrained(export)
    processor = AutoProcessor.from_pretrained(export)
    assert type(model).__name__ == "LlavaForConditionalGeneration" and type(processor).__name__ == "LlavaProcessor"
    # config.json and its text_config and vision_config say bfloat16, the bulk's storage, tower included
    image = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    ids = torch.tensor([[IMAGE_TOKEN_ID] * 16 + list(range(3, 11))])
    inputs = {"input_ids": ids, "pixel_values": image}
    assert_the_export_states_its_dtype(export, torch.bfloat16, inputs, AutoModelForImageTextToText)


@NEEDS_UNUSED_REDUCTION
def test_lora_adapts_the_language_model_and_never_the_tower(
    runs: Dict[str, Any], llava_folder: Dict[str, Path]
) -> None:
    adapter = tensors(runs["root"] / "lora" / "adapter")
    assert adapter and all(".lora_" in n for n in adapter)
    assert not any("vision_tower" in n for n in adapter)
    assert any("language_model" in n for n in adapter)
    before, after = pretrained(llava_folder["model"]), tensors(runs["root"] / "lora" / "export")
    tower = [n for n in before if n.startswith(TOWER)]
    assert all(torch.equal(after[n], before[n].to(after[n].dtype)) for n in tower)


def test_image_tokens_and_prompts_are_untrained() -> None:
    maker = VisionExampleMaker(shapes_processor())
    (_, with_image), (_, text_only) = [(w, r) for w, r in shapes_records(5) if w.endswith(("row 0", "row 4"))]
    example = maker(with_image)
    tokenizer = maker.processor.tokenizer
    assert example.ids.count(IMAGE_TOKEN_ID) == 16  # the 32x32 image in 8x8 patches
    trained = [
        tokenizer.convert_ids_to_tokens(t)
        for t, label in zip(example.ids, example.labels, strict=True)
        if label != -100
    ]
    answer = with_image["messages"][1]["content"][0]["text"]
    assert trained == [answer, "<|end|>"]  # the answer and its end of turn; no image token, no prompt
    assert all(
        label == IGNORE_INDEX for t, label in zip(example.ids, example.labels, strict=True) if t == IMAGE_TOKEN_ID
    )
    assert set(example.per_image) == {"pixel_values"} and example.per_image["pixel_values"].shape == (1, 3, 32, 32)
    words = maker(text_only)
    assert not words.per_image
    assert [
        tokenizer.convert_ids_to_tokens(t) for t, lab in zip(words.ids, words.labels, strict=True) if lab != -100
    ] == [
        *text_only["messages"][1]["content"][0]["text"].split(),
        "<|end|>",
    ]


def refusal(folder: Dict[str, Path], tmp_path: Path, *extra: str) -> str:
    with pytest.raises(RecipeError) as raised:
        load_recipe(None, recipe_args(folder, tmp_path / "out", *extra))
    return str(raised.value)


def broken_rows(tmp_path: Path, change: Any) -> Path:
    rows = [record for _, record in shapes_records(12)]
    path = write_rows(tmp_path / "data", rows)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    change(lines, tmp_path / "data")
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    return path


def test_a_missing_image_is_refused_naming_file_and_line(llava_folder: Dict[str, Path], tmp_path: Path) -> None:
    path = broken_rows(tmp_path, lambda lines, _: lines[2].update(images=["img/nowhere.png"]))
    message = refusal(llava_folder, tmp_path, f"data.files=[{path}]")
    assert f"{path}:3 lists the image" in message and "nowhere.png', which does not exist" in message


def test_an_unreadable_image_is_refused(llava_folder: Dict[str, Path], tmp_path: Path) -> None:
    def corrupt(lines: List[Dict[str, Any]], folder: Path) -> None:
        (folder / lines[0]["images"][0]).write_bytes(b"not a png")

    path = broken_rows(tmp_path, corrupt)
    message = refusal(llava_folder, tmp_path, f"data.files=[{path}]")
    assert f"{path}:1 lists the image" in message and "cannot be read as an image" in message


def test_image_parts_that_differ_from_the_images_listed_are_refused(
    llava_folder: Dict[str, Path], tmp_path: Path
) -> None:
    path = broken_rows(tmp_path, lambda lines, _: lines[1]["images"].append(lines[1]["images"][0]))
    message = refusal(llava_folder, tmp_path, f"data.files=[{path}]")
    assert f"{path}:2 has 1 image parts in its messages and 2 images listed; make them equal" in message


def test_an_image_in_an_assistant_turn_is_refused(llava_folder: Dict[str, Path], tmp_path: Path) -> None:
    path = broken_rows(tmp_path, lambda lines, _: lines[0]["messages"][1]["content"].insert(0, {"type": "image"}))
    message = refusal(llava_folder, tmp_path, f"data.files=[{path}]")
    assert f"{path}:1 message 1 is an assistant turn with an image part" in message


def test_every_bad_line_is_listed_at_once(llava_folder: Dict[str, Path], tmp_path: Path) -> None:
    def two(lines: List[Dict[str, Any]], _: Path) -> None:
        lines[0].update(images=["img/gone.png"])
        lines[5]["messages"][1]["content"].insert(0, {"type": "image"})

    path = broken_rows(tmp_path, two)
    message = refusal(llava_folder, tmp_path, f"data.files=[{path}]")
    assert "Recipe has 2 problems" in message and f"{path}:1 " in message and f"{path}:6 " in message


def test_image_rows_for_a_causal_lm_are_refused(llava_folder: Dict[str, Path], tmp_path: Path) -> None:
    config = tmp_path / "llama.json"
    config.write_text(json.dumps(dict(COMMON, model_type="llama")))
    message = refusal(llava_folder, tmp_path, "model.pretrained=null", f"model.hf_config={config}",
                      f"data.tokenizer={llava_folder['model']}")  # fmt: skip
    assert "the rows hold images, and the model is not an image-text model" in message


def test_context_parallelism_with_an_image_text_model_is_refused(llava_folder: Dict[str, Path], tmp_path: Path) -> None:
    message = refusal(llava_folder, tmp_path, "strategy.parallelism.context_parallel_size=2")
    assert "context_parallel_size=2 splits every sequence across ranks, and an image's features" in message


def test_image_rows_without_a_processor_are_refused(llava_folder: Dict[str, Path], tmp_path: Path) -> None:
    config = tmp_path / "config.json"
    config.write_text(llava_config().to_json_string())
    message = refusal(llava_folder, tmp_path, "model.pretrained=null", f"model.hf_config={config}")
    assert "image-text rows need the model's processor" in message and "set data.tokenizer" in message


def test_a_processor_whose_image_token_is_not_the_models_is_refused(
    llava_folder: Dict[str, Path], tmp_path: Path
) -> None:
    config = tmp_path / "config.json"
    config.write_text(llava_config(image_token_id=5).to_json_string())
    message = refusal(llava_folder, tmp_path, "model.pretrained=null", f"model.hf_config={config}",
                      f"data.tokenizer={llava_folder['model']}")  # fmt: skip
    assert f"the processor writes images as token {IMAGE_TOKEN_ID} ('<image>')" in message
    assert "expects image_token_id=5" in message


def test_a_processor_larger_than_the_models_vocabulary_is_refused(
    llava_folder: Dict[str, Path], tmp_path: Path
) -> None:
    config = tmp_path / "config.json"
    config.write_text(llava_config(text_config=dict(COMMON, model_type="llama", vocab_size=16)).to_json_string())
    message = refusal(llava_folder, tmp_path, "model.pretrained=null", f"model.hf_config={config}",
                      f"data.tokenizer={llava_folder['model']}")  # fmt: skip
    assert "data.tokenizer=" in message and "more than the model's embedding (16)" in message


def test_distilling_an_image_text_model_is_refused(llava_folder: Dict[str, Path], tmp_path: Path) -> None:
    message = refusal(llava_folder, tmp_path, "objective=distillation", f"teacher.pretrained={llava_folder['model']}")
    assert "names an image-text model, which trains with objective 'vision_sft'" in message


@NEEDS_UNUSED_REDUCTION
@pytest.mark.parametrize(
    ("model_type", "tower", "projector"),
    [
        ("llava", "model.vision_tower", "model.multi_modal_projector"),
        ("qwen2_vl", "model.visual", None),
        ("gemma3", "model.vision_tower", "model.multi_modal_projector"),
    ],
)
def test_the_planner_shows_the_tower_frozen_and_the_projector_trainable(
    tmp_path: Path, capsys: pytest.CaptureFixture, model_type: str, tower: str, projector: Any
) -> None:
    from lightning_mixedfsdp.recipes.run.dry_run import main
    from tests.hf_models import tiny_vlm_config

    if model_type == "gemma3":
        from transformers import AutoConfig

        text = dict(COMMON, vocab_size=300, sliding_window=16)
        vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      image_size=32, patch_size=8)  # fmt: skip
        config = AutoConfig.for_model("gemma3", text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                      image_token_index=260, boi_token_index=258, eoi_token_index=259)  # fmt: skip
    else:
        config = tiny_vlm_config(model_type)
    config.save_pretrained(tmp_path)
    result = main(["--hf-config", str(tmp_path), "--world-size", "4"])
    out = capsys.readouterr().out
    plan = result["plan"]
    assert tower in plan.conditional_modules and not any(u.startswith(tower) for u in plan.units)
    if projector is not None:
        assert re.search(rf"  {re.escape(tower)}: frozen, [\d.]+ \w?i?B, [\d.]+ \w?i?B per rank, in <root>", out)
        assert re.search(rf"  {re.escape(projector)}: trainable", out)
    else:  # Qwen2-VL's merger (its projector) sits inside the tower and trains; the rest is frozen
        assert re.search(rf"  {re.escape(tower)}: trainable \([\d.]+K? of [\d.]+K params\)", out)
        assert all(p.requires_grad == (".merger." in n) for n, p in plan.params.items() if n.startswith(tower))
    everything = main(["--hf-config", str(tmp_path), "--world-size", "4", "--freeze"])["plan"]
    assert all(p.requires_grad for p in everything.params.values())  # --freeze with no pattern freezes nothing

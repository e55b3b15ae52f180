"""Fine-tuning data in one process: exactly the assistant tokens are trained (two real template styles, the byte
template, and agreement with transformers' own ``{% generation %}`` mask), the instruction format (prompt and
completion tokenized apart, as inference sees them), templates that cannot give correct masks refused with the
reason, packed and padded rows, each step's trained-token count, packing that keeps an HF Llama's logits for each
conversation as they are alone, every bad input refused before launch, all at once, and the project's own exports
as tokenizers (no question asked, the byte-level one tokenizing as the byte tokenizer), a tokenizer of its own code
only under ``data.trust_remote_code``."""

import json
import os
import re
from pathlib import Path
from typing import Dict, List

import pytest
import torch

from lightning_mixedfsdp.recipes.data.chat import (
    BYTE_END_OF_TURN,
    IGNORE_INDEX,
    ChatTemplateError,
    byte_chat_format,
    chat_example,
    hf_chat_format,
    instruction_example,
)
from lightning_mixedfsdp.recipes.data.sft import Rows, StepRows, packed_rows, padded_rows
from lightning_mixedfsdp.recipes.settings.schema import Recipe, RecipeError
from tests.recipes.sft_tokenizers import CHATML_GENERATION, QWEN3_THINKING, save_tokenizer

ROOT = Path(__file__).resolve().parents[2]
CONVERSATION = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Hello, how are you?"},
    {"role": "assistant", "content": "I am fine, thank you."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "The capital of France is Paris."},
]


def trained_spans(labels: List[int]) -> List[List[int]]:
    spans, current = [], []
    for label in [*labels, IGNORE_INDEX]:
        if label != IGNORE_INDEX:
            current.append(label)
        elif current:
            spans.append(current)
            current = []
    return spans


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory: pytest.TempPathFactory) -> Dict[str, Path]:
    root = tmp_path_factory.mktemp("tokenizers")
    return {family: save_tokenizer(root / family, family) for family in ("chatml", "llama3")}


def _load(path: Path):  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


@pytest.mark.parametrize("family", ["chatml", "llama3"])
@pytest.mark.parametrize("messages", [CONVERSATION, CONVERSATION[1:3]], ids=["with-system", "one-turn"])
def test_exactly_the_assistant_turns_and_their_end_of_turn_are_trained(
    tokenizers: Dict[str, Path], family: str, messages: List[Dict[str, str]]
) -> None:
    tokenizer = _load(tokenizers[family])
    example = chat_example(messages, hf_chat_format(tokenizer))
    decoded = [tokenizer.decode(span) for span in trained_spans(example.labels)]
    assert decoded == [m["content"] + tokenizer.eos_token for m in messages if m["role"] == "assistant"]
    assert all(label in (IGNORE_INDEX, token) for token, label in zip(example.ids, example.labels, strict=True))
    full = tokenizer.apply_chat_template(messages, tokenize=False)
    assert tokenizer.decode(example.ids) == full  # the whole conversation, as the template writes it


def test_the_prefix_masks_equal_transformers_generation_mask(tokenizers: Dict[str, Path]) -> None:
    tokenizer = _load(tokenizers["chatml"])
    tokenizer.chat_template = CHATML_GENERATION
    theirs = tokenizer.apply_chat_template(
        CONVERSATION, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    ours = chat_example(CONVERSATION, hf_chat_format(tokenizer))
    assert ours.ids == list(theirs["input_ids"])
    assert [int(label != IGNORE_INDEX) for label in ours.labels] == list(theirs["assistant_masks"])


def test_the_byte_template_trains_each_assistant_turn_and_its_end_marker() -> None:
    example = chat_example(CONVERSATION, byte_chat_format(lambda text: list(text.encode())))
    assert [bytes(span).decode() for span in trained_spans(example.labels)] == [
        "I am fine, thank you." + BYTE_END_OF_TURN,
        "The capital of France is Paris." + BYTE_END_OF_TURN,
    ]
    assert bytes(example.ids).decode().startswith("<|system|>\nYou are a helpful assistant.<|end|>\n<|user|>\n")


def test_a_template_that_rewrites_earlier_turns_is_refused_with_the_reason(tokenizers: Dict[str, Path]) -> None:
    tokenizer = _load(tokenizers["chatml"])
    thinking = [dict(m) for m in CONVERSATION]
    thinking[2]["content"] = "<think>\nGreeting.\n</think>\n\nI am fine, thank you."
    chat = hf_chat_format(tokenizer, QWEN3_THINKING)
    with pytest.raises(ChatTemplateError, match=r"rewrites earlier turns.*Set data.chat_template"):
        chat_example(thinking, chat)
    chat_example(thinking[:3], chat)  # one assistant turn: nothing rewritten, accepted


def test_instruction_pairs_train_the_completion_and_eos_only(tokenizers: Dict[str, Path]) -> None:
    tokenizer = _load(tokenizers["chatml"])

    def encode(text: str) -> List[int]:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    example = instruction_example("The capital of France is", " Paris.", encode, [tokenizer.eos_token_id])
    assert tokenizer.decode([t for t in example.labels if t != IGNORE_INDEX]) == " Paris.<|im_end|>"
    assert example.labels[: len(encode("The capital of France is"))] == [IGNORE_INDEX] * 5


def test_a_pair_whose_tokens_merge_across_the_boundary_trains_as_inference_sees_it(
    tmp_path: Path, tokenizers: Dict[str, Path]
) -> None:
    """300 pairs, one of them a prompt ending in a space before its completion's first word (BPE merges the two
    when they are tokenized together): accepted before launch, and every pair is its prompt's tokens alone (as
    inference encodes it), then its completion's and EOS, exactly those two trained."""
    from lightning_mixedfsdp.recipes.data.sft import ExampleMaker, fine_tuning_examples
    from lightning_mixedfsdp.recipes.data.text import make_tokenizer

    tokenizer = _load(tokenizers["chatml"])

    def encode(text: str) -> List[int]:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    merging = {"prompt": "Repeat after me: tunnel garden bridge ", "completion": "tunnel garden bridge"}
    assert encode(merging["prompt"] + merging["completion"]) != encode(merging["prompt"]) + encode(
        "tunnel garden bridge"
    )
    pairs = [
        {"prompt": f"What is {a} plus {b}?", "completion": f" It is {a + b}."} for a in range(20) for b in range(15)
    ]
    pairs[7] = merging
    recipe = _recipe(tmp_path, pairs, f"data.tokenizer={tokenizers['chatml']}", "model.vocab_size=512")
    maker = ExampleMaker(recipe.data, "instruction", make_tokenizer(recipe.data.tokenizer))
    splits = fine_tuning_examples(recipe.data, maker)
    made = {tuple(example.ids): example.labels for example in splits.train + splits.held_out}
    assert len(made) == len(pairs) and not splits.problems
    for pair in pairs:
        prompt, completion = encode(pair["prompt"]), encode(pair["completion"]) + [tokenizer.eos_token_id]
        assert made[tuple(prompt + completion)] == [IGNORE_INDEX] * len(prompt) + completion


def _rows_of(lengths: List[int]) -> List:  # type: ignore[type-arg]
    from lightning_mixedfsdp.recipes.data.chat import Example

    return [Example(list(range(1, n + 1)), [IGNORE_INDEX] + list(range(2, n + 1))) for n in lengths]


def test_packed_rows_restart_positions_and_never_train_across_a_boundary() -> None:
    rows = packed_rows(_rows_of([5, 4, 6, 3]), 10, pad=0)
    assert len(rows) == 2
    assert rows.position_ids[0].tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3, 0]  # the tail's padding has its own positions
    assert rows.labels[0].tolist() == [-100, 2, 3, 4, 5, -100, 2, 3, 4, -100]
    assert rows.input_ids[1].tolist() == [1, 2, 3, 4, 5, 6, 1, 2, 3, 0]
    assert rows.trained.tolist() == [4 + 3, 5 + 2] and rows.lengths.tolist() == [9, 9]
    padded = padded_rows(_rows_of([5, 4]), 8, pad=0)
    assert padded.position_ids[1].tolist() == list(range(8)) and padded.labels[1, 4:].tolist() == [-100] * 4
    assert padded.padding == pytest.approx(7 / 16)


def test_each_items_step_count_is_every_rank_and_micro_batch_of_its_step() -> None:
    rows = packed_rows(_rows_of([3, 7, 2, 9, 5, 4, 8, 6, 10, 3]), 12, pad=0)
    stream = StepRows(rows, seed=3, batch=2, ranks=2, accumulate=2)  # 8 rows a step
    trained = rows.trained.tolist()
    for step in range(3):  # epochs wrap
        positions = range(step * 8, step * 8 + 8)
        assert stream.step_tokens(step) == sum(trained[stream.order(p)] for p in positions)
        item = stream[(step * 2 + 1, 0)]
        assert int(item["step_tokens"]) == stream.step_tokens(step) and item["input_ids"].shape == (12,)


def test_a_conversation_packed_between_two_others_gives_the_logits_it_gives_alone(tokenizers: Dict[str, Path]) -> None:
    """An HF Llama as the fine-tuning step calls it (``position_ids``, no attention mask, no cache), bf16."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = _load(tokenizers["chatml"])
    chat = hf_chat_format(tokenizer)
    examples = [chat_example(m, chat) for m in (CONVERSATION, CONVERSATION[1:3], CONVERSATION[:1] + CONVERSATION[3:])]
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, attn_implementation="sdpa",
    )  # fmt: skip
    model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    rows: Rows = packed_rows(examples, sum(len(e.ids) for e in examples) + 5, pad=tokenizer.pad_token_id)
    assert len(rows) == 1
    start, length = len(examples[0].ids), len(examples[1].ids)
    with torch.no_grad():
        packed = model(input_ids=rows.input_ids, position_ids=rows.position_ids, use_cache=False).logits
        alone = model(input_ids=torch.tensor([examples[1].ids]), use_cache=False).logits
        seen = model(input_ids=rows.input_ids, use_cache=False).logits  # positions running on: attends across
    middle = packed[0, start : start + length].float()
    spread = alone.float().abs().max()
    assert (middle - alone[0].float()).abs().max() <= 0.02 * spread  # bf16 rounding of the different sums
    assert (seen[0, start : start + length].float() - alone[0].float()).abs().max() > 0.1 * spread


def _recipe(tmp_path: Path, lines: List[object], *overrides: str) -> Recipe:
    from lightning_mixedfsdp.recipes.run.loader import load_recipe

    data = tmp_path / "data.jsonl"
    data.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return load_recipe(
        str(ROOT / "conf" / "stdlib_llama.yaml"),
        [f"data.files={data}", "data.seq_len=64", "data.held_out_every=2", "data.val_windows=2", *overrides],
    )


def _chat(user: str = "Hi?", answer: str = "Hello.") -> Dict[str, object]:
    return {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]}


BAD_INPUTS = {
    "not JSON": (
        [_chat(), '{"messages": "a\tb"}'],
        [],
        r"data\.jsonl:2 is not JSON \(Invalid control character at: line 1 column 16 \(char 15\)\); fix the line",
    ),
    "no assistant turn": (
        [_chat(), {"messages": [{"role": "user", "content": "Hi?"}]}],
        [],
        r"data\.jsonl:2 the conversation has no assistant turn, so nothing in it would be trained; add one or drop it",
    ),
    "unknown role": (
        [_chat(), {"messages": [{"role": "bot", "content": "Hi"}, {"role": "assistant", "content": "x"}]}],
        [],
        r"data\.jsonl:2 message 0 has role 'bot'; use one of system, user, assistant",
    ),
    "fields not matching the format": (
        [_chat(), {"prompt": "a", "completion": "b"}],
        [],
        r"data\.jsonl:2 has the fields \['completion', 'prompt'\], not 'messages' as data.format='chat' needs",
    ),
    "every conversation too long": (
        [_chat(answer="x" * 80), _chat(answer="y" * 90)],
        ["data.too_long=drop"],
        r"0 training and 0 held-out examples \(2 too long for data.seq_len=64 left out\)",
    ),
    "too long under error": (
        [_chat(), _chat(answer="x" * 80), _chat()],
        ["data.too_long=error"],
        r"1 examples are longer than data.seq_len=64 tokens; raise data.seq_len, or set data.too_long=truncate or drop",
    ),
    "an unknown format": ([_chat(), _chat()], ["data.format=dialogue"], r"data.format='dialogue': use one of text"),
}


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_bad_fine_tuning_data_is_refused_before_launch_with_the_fix(tmp_path: Path, case: str) -> None:
    lines, overrides, message = BAD_INPUTS[case]
    with pytest.raises(RecipeError, match=message):
        _recipe(tmp_path, lines, *overrides)


def test_a_tokenizer_without_a_chat_template_names_the_option(tmp_path: Path, tokenizers: Dict[str, Path]) -> None:
    plain = _load(tokenizers["llama3"])
    plain.chat_template = None
    plain.save_pretrained(str(tmp_path / "plain"))
    (tmp_path / "plain" / "chat_template.jinja").unlink(missing_ok=True)
    overrides = [f"data.tokenizer={tmp_path / 'plain'}", "model.vocab_size=512"]
    with pytest.raises(RecipeError, match=r"has no chat template; set data.chat_template to a Jinja template"):
        _recipe(tmp_path, [_chat(), _chat()], *overrides)


def test_every_bad_record_is_reported_at_once(tmp_path: Path) -> None:
    lines = [_chat(), "nope", {"messages": []}, {"messages": [{"role": "user", "content": "no answer"}]}, _chat()]
    with pytest.raises(RecipeError) as error:
        _recipe(tmp_path, lines)
    assert [int(n) for n in re.findall(r"data\.jsonl:(\d+)", str(error.value))] == [2, 3, 4]


def test_the_generated_conversations_are_the_same_each_time_and_all_trainable() -> None:
    from lightning_mixedfsdp.recipes.data.chat import conversation_problem
    from lightning_mixedfsdp.recipes.data.stdlib_chat import stdlib_conversations

    first, again = list(stdlib_conversations()), list(stdlib_conversations())
    assert first == again and len(first) > 200
    assert all(conversation_problem(messages) is None for messages in first)
    assert any(len(messages) == 5 for messages in first) and any(m[0]["role"] == "system" for m in first)


def _write_export(directory: Path, vocab_size: int) -> Path:
    """A reference model's export as the runner writes it (safetensors, then ``config.json`` and the modelling
    code), without a tokenizer."""
    from safetensors.torch import save_file

    from lightning_mixedfsdp.recipes.models.tiny_llama import TinyLlama, TinyLlamaConfig
    from lightning_mixedfsdp.recipes.run.hf_export import write_reference_config

    config = TinyLlamaConfig(vocab_size=vocab_size, dim=32, n_layers=2, n_heads=4, hidden_dim=64, mixer_layers=[1])
    directory.mkdir(parents=True)
    save_file(
        {k: v.contiguous() for k, v in TinyLlama(config).state_dict().items()}, str(directory / "model.safetensors")
    )
    write_reference_config(directory, config, torch.bfloat16)
    return directory


@pytest.fixture(scope="module")
def exports(tmp_path_factory: pytest.TempPathFactory, tokenizers: Dict[str, Path]) -> Dict[str, Path]:
    """The main job's export (byte tokenizer, no chat template); a reference model's export holding an HF tokenizer
    without a chat template; an HF tokenizer whose class is its own code (``auto_map``)."""
    from lightning_mixedfsdp.recipes.run.hf_export import write_byte_tokenizer

    root = tmp_path_factory.mktemp("exports")
    byte_level = _write_export(root / "bytes" / "export", 256)
    write_byte_tokenizer(byte_level)
    plain = _load(tokenizers["llama3"])
    plain.chat_template = None
    plain.save_pretrained(str(_write_export(root / "plain" / "export", 512)))
    (root / "plain" / "export" / "chat_template.jinja").unlink(missing_ok=True)
    custom = root / "custom"
    _load(tokenizers["llama3"]).save_pretrained(str(custom))
    (custom / "my_tokenizer.py").write_text(
        "from transformers import PreTrainedTokenizerFast\n\n\nclass MyTokenizerFast(PreTrainedTokenizerFast):\n"
        "    pass\n"
    )
    config = json.loads((custom / "tokenizer_config.json").read_text())
    config["auto_map"] = {"AutoTokenizer": [None, "my_tokenizer.MyTokenizerFast"]}
    (custom / "tokenizer_config.json").write_text(json.dumps(config))
    return {"bytes": byte_level, "plain": root / "plain" / "export", "custom": custom}


LAUNCHES = """
import sys
from lightning_mixedfsdp.recipes.data.text import make_tokenizer
from lightning_mixedfsdp.recipes.run.runner import main
for export in sys.argv[1:3]:
    print("=== " + export, flush=True)
    try:
        main(["--config", "conf/stdlib_llama_sft.yaml", "model.pretrained=" + export, "data.tokenizer=" + export,
              "data.files=" + sys.argv[4]])
    except SystemExit as exit:
        print("exit", exit.code, flush=True)
print("=== custom:", type(make_tokenizer(sys.argv[3], trust_remote_code=True).tokenizer).__name__, flush=True)
"""


def test_the_projects_exports_load_as_tokenizers_without_a_question_and_every_problem_is_listed(
    tmp_path: Path, exports: Dict[str, Path]
) -> None:
    """``python -m lightning_mixedfsdp.train`` with standard input closed, as a scheduler runs it: the SFT recipe on
    each export as model and tokenizer, on data with a line that is not JSON and a conversation without an
    assistant turn. No prompt to run the export's code, no warning about its model type: the byte-level export
    trains with the byte template (only the data's problems are listed), the other lists its missing template with
    them. A tokenizer of its own code loads under data.trust_remote_code, unasked."""
    import subprocess
    import sys

    data = tmp_path / "chat.jsonl"
    lines = [_chat(), "nope", {"messages": [{"role": "user", "content": "no answer"}]}, _chat()]
    data.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    environment = {**os.environ, "HF_MODULES_CACHE": str(tmp_path / "modules")}  # the custom code's copy
    command = [sys.executable, "-c", LAUNCHES, str(exports["bytes"]), str(exports["plain"]), str(exports["custom"])]
    completed = subprocess.run(
        [*command, str(data)], cwd=ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, timeout=300, env=environment,
    )  # fmt: skip
    out = completed.stdout
    assert completed.returncode == 0, out[-3000:]
    for question in ("[y/N]", "custom code", "model of type", "hf.co"):
        assert question not in out, out
    byte_level = out.split(f"=== {exports['plain']}")[0]
    assert "Recipe has 2 problems:" in byte_level and "chat template" not in byte_level
    plain = out.split(f"=== {exports['plain']}")[1]
    assert re.search(r"Recipe has 3 problems:\n  - data: .*has no chat template; set data.chat_template", plain)
    for launch in (byte_level, plain):
        assert "chat.jsonl:2 is not JSON" in launch and "chat.jsonl:3 the conversation has no assistant turn" in launch
        assert "exit 2" in launch
    assert "=== custom: MyTokenizerFast" in out


def test_the_byte_level_export_as_tokenizer_trains_as_the_byte_tokenizer(exports: Dict[str, Path]) -> None:
    from lightning_mixedfsdp.recipes.data.sft import ExampleMaker
    from lightning_mixedfsdp.recipes.data.text import ByteTokenizer, make_tokenizer
    from lightning_mixedfsdp.recipes.settings.schema import DataSection

    made = []
    for spec in ("bytes", str(exports["bytes"])):
        tokenizer = make_tokenizer(spec)
        assert isinstance(tokenizer, ByteTokenizer)
        made.append(ExampleMaker(DataSection(tokenizer=spec), "chat", tokenizer)({"messages": CONVERSATION}))
    assert made[0] == made[1]
    assert bytes(trained_spans(made[1].labels)[0]).decode() == "I am fine, thank you." + BYTE_END_OF_TURN


def test_a_tokenizer_of_its_own_code_is_refused_without_the_key(tmp_path: Path, exports: Dict[str, Path]) -> None:
    overrides = [f"data.tokenizer={exports['custom']}", "model.vocab_size=512"]
    with pytest.raises(RecipeError, match=r"ships Python code .*auto_map.*set data.trust_remote_code=true if you"):
        _recipe(tmp_path, [_chat(), _chat()], *overrides)

"""One answer from a fine-tuned run's export, as its user would get it: the export loaded by transformers
(``load_export``: every tensor in the dtype the export holds it in), the first held-out question rendered by the
run's chat template (or its prompt), and the answer decoded greedily until the end-of-turn marker."""

from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch

from lightning_mixedfsdp.recipes.data.chat import BYTE_END_OF_TURN, cut_at_end_of_turn
from lightning_mixedfsdp.recipes.data.sft import ExampleMaker, read_records
from lightning_mixedfsdp.recipes.run.hf_export import load_export
from lightning_mixedfsdp.recipes.settings.schema import DataSection


def held_out_question(data: DataSection, fine_tuning_format: str) -> Optional[Tuple[Any, str]]:
    """The first held-out example (the first record) as ``(prompt, reference answer)``: the messages up to its last
    assistant turn, or the instruction's prompt."""
    for _, record in read_records(data, fine_tuning_format):
        if not isinstance(record, dict):
            return None
        if fine_tuning_format == "instruction":
            return record["prompt"], record["completion"]
        messages: List[Dict[str, str]] = record["messages"]
        last = max(i for i, message in enumerate(messages) if message["role"] == "assistant")
        return messages[:last], messages[last]["content"]
    return None


@torch.no_grad()
def generate_answer(
    export: Path, prompt: Any, maker: ExampleMaker, trust_remote_code: bool, max_new_tokens: int = 96
) -> str:
    """Greedy decoding of ``prompt`` (messages or text) by the export until its end-of-turn marker (or EOS)."""
    model = load_export(export, torch.bfloat16, trust_remote_code=trust_remote_code)
    text = maker.chat_format().render(prompt, True) if isinstance(prompt, list) else prompt
    ids = torch.tensor([maker.encode(text)])
    start, stop = ids.shape[1], set(maker.end) if len(maker.end) == 1 else set()
    for _ in range(max_new_tokens):
        step = model(input_ids=ids, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
        ids = torch.cat([ids, step], dim=1)
        answer = maker.decode(ids[0, start:].tolist())
        if int(step) in stop or BYTE_END_OF_TURN in answer:
            break
    return cut_at_end_of_turn(maker.decode(ids[0, start:].tolist(), skip_special_tokens=True))

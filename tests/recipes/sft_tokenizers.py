"""Small HF tokenizers with the chat templates of two real families, trained here (nothing downloaded): a byte-level
BPE whose EOS is the template's end-of-turn token, as instruct tokenizers have it."""

from pathlib import Path
from typing import Dict

CHATML = (
    "{%- if messages[0].role != 'system' %}{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}{%- for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)
"""Qwen2.5's ChatML: a default system turn, ``<|im_end|>`` and a newline after each turn."""

CHATML_GENERATION = CHATML.replace(
    "{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}",
    "{%- if m.role == 'assistant' %}{{ '<|im_start|>assistant\\n' }}{% generation %}{{ m.content + '<|im_end|>' }}"
    "{% endgeneration %}{{ '\\n' }}{%- else %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- endif %}",
)
"""The same with ``{% generation %}`` markers around what an assistant says, for transformers' own mask."""

LLAMA3 = (
    "{{ bos_token }}{%- for m in messages %}{{ '<|start_header_id|>' + m.role + '<|end_header_id|>\\n\\n'"
    " + m.content | trim + '<|eot_id|>' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
"""Llama 3's: BOS, a header per turn, ``<|eot_id|>`` after each, nothing between turns."""

QWEN3_THINKING = (
    "{%- set ns = namespace(last_user=-1) %}{%- for m in messages %}{%- if m.role == 'user' %}"
    "{%- set ns.last_user = loop.index0 %}{%- endif %}{%- endfor %}{%- for m in messages %}{%- set c = m.content %}"
    "{%- if m.role == 'assistant' and loop.index0 < ns.last_user and '</think>' in c %}"
    "{%- set c = c.split('</think>')[-1].lstrip('\\n') %}{%- endif %}"
    "{{ '<|im_start|>' + m.role + '\\n' + c + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)
"""Qwen3's habit: reasoning of assistant turns before the last user turn is dropped, which rewrites earlier turns."""

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>"]
SPECIALS += ["<|end_header_id|>", "<|eot_id|>"]
CORPUS = [
    "Hello, how are you? I am fine, thank you.",
    "The capital of France is Paris.",
    "What is two plus two? It is four.",
    "system user assistant You are a helpful assistant.",
    "Return the absolute value of the float x.",
] * 40

FAMILIES: Dict[str, Dict[str, str]] = {
    "chatml": {"template": CHATML, "eos": "<|im_end|>"},
    "llama3": {"template": LLAMA3, "eos": "<|eot_id|>"},
}


def save_tokenizer(directory: Path, family: str) -> Path:
    """A BPE tokenizer of about 400 tokens with ``family``'s chat template and EOS, saved to ``directory``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    bpe.train_from_iterator(
        CORPUS, trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS, initial_alphabet=alphabet)
    )
    settings = FAMILIES[family]
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe, bos_token="<|begin_of_text|>", eos_token=settings["eos"], pad_token="<|endoftext|>"
    )
    tokenizer.chat_template = settings["template"]
    tokenizer.save_pretrained(str(directory))
    return directory

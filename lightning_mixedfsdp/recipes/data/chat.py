"""Supervised fine-tuning examples: a conversation or a prompt/completion pair turned into token ids and labels,
the labels ``-100`` everywhere except on what the model should learn to say.

A chat's loss covers its assistant turns: each turn's content and the marker that ends it (the tokenizer's EOS
token where the template writes it, so the model learns to stop), never the system or user turns, nor the
template's role headers. The spans come from rendering the conversation prefix by prefix (as trl does), so templates
without ``{% generation %}`` markers get correct masks too: turn ``k`` spans from the end of the first ``k`` messages
rendered with the generation prompt to the end of the first ``k + 1``. Every prefix must be a token prefix of the
whole conversation's rendering; a template that rewrites earlier turns (some drop past reasoning blocks) fails that
check and is refused with the reason. A prompt/completion pair is tokenized in two parts, as inference sees it.

The reference byte-level model has no tokenizer of its own: its chat template is :data:`BYTE_CHAT_TEMPLATE`, a role
header line per message and ``<|end|>`` after each."""

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence

from lightning_mixedfsdp.model.tensors import IGNORE_INDEX

ROLES = ("system", "user", "assistant")

BYTE_END_OF_TURN = "<|end|>"
BYTE_CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
"""The byte-level model's chat template (Jinja, as HF tokenizers carry theirs): ``<|role|>\\n{content}<|end|>\\n``
per message, ``<|assistant|>\\n`` as the generation prompt."""


class ChatTemplateError(ValueError):
    """A conversation the template or tokenizer cannot turn into correct masks."""


@dataclass
class Example:
    """One conversation or pair as the model sees it: ``labels[t]`` is ``ids[t]`` where it is trained, else -100
    (unshifted, as HF models take them: the logits at ``t - 1`` predict ``labels[t]``)."""

    ids: List[int]
    labels: List[int]

    @property
    def trained(self) -> int:
        """The tokens this example trains (its first token is never a target)."""
        return sum(1 for label in self.labels[1:] if label != IGNORE_INDEX)


Render = Callable[[Sequence[Dict[str, str]], bool], str]
"""``render(messages, add_generation_prompt) -> text``."""
Encode = Callable[[str], List[int]]


@dataclass
class ChatFormat:
    """How a tokenizer writes conversations: its template rendering, its encoding (special tokens as the template
    writes them, none added), and the text that ends an assistant turn."""

    render: Render
    encode: Encode
    end_of_turn: Optional[str]
    """Trained spans end after this text's last occurrence (None: the whole span the turn adds is trained)."""


def byte_chat_format(encode: Encode, template: Optional[str] = None) -> ChatFormat:
    """The reference model's: :data:`BYTE_CHAT_TEMPLATE` (or another ``template``, whose turns' end marker is then
    unknown: the whole span a turn adds is trained) rendered by Jinja's sandbox, as transformers renders templates."""
    if template is not None and template != BYTE_CHAT_TEMPLATE:
        return ChatFormat(_jinja_renderer(template), encode, None)
    return ChatFormat(_jinja_renderer(BYTE_CHAT_TEMPLATE), encode, BYTE_END_OF_TURN)


def hf_chat_format(tokenizer: Any, template: Optional[str] = None) -> ChatFormat:
    """A transformers tokenizer's, with ``template`` in place of its own when given (Jinja text)."""
    source = template if template is not None else tokenizer.chat_template
    if not source:
        raise ChatTemplateError(
            f"the tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no chat template; set data.chat_template to"
            " a Jinja template (its text, or a file holding it), or use data.format=instruction"
        )

    def render(messages: Sequence[Dict[str, str]], add_generation_prompt: bool) -> str:
        text = tokenizer.apply_chat_template(
            list(messages), chat_template=source, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        return str(text)

    def encode(text: str) -> List[int]:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])  # the template writes BOS itself

    return ChatFormat(render, encode, tokenizer.eos_token)


def _jinja_renderer(template: str) -> Render:
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    compiled = ImmutableSandboxedEnvironment(trim_blocks=False, lstrip_blocks=False).from_string(template)

    def render(messages: Sequence[Dict[str, str]], add_generation_prompt: bool) -> str:
        return compiled.render(messages=list(messages), add_generation_prompt=add_generation_prompt)

    return render


def chat_example(messages: Sequence[Dict[str, str]], chat: ChatFormat, last_turn_only: bool = False) -> Example:
    """Token ids of the whole conversation; labels on each assistant turn's content and end-of-turn marker (with
    ``last_turn_only``, on the last turn's alone: a preference pair's answer after its prompt)."""
    full = chat.encode(chat.render(messages, False))
    labels = [IGNORE_INDEX] * len(full)
    end_of_turn = chat.encode(chat.end_of_turn) if chat.end_of_turn else []
    for turn, message in enumerate(messages):
        if message["role"] != "assistant" or (last_turn_only and turn != len(messages) - 1):
            continue
        start = len(_prefix(chat, messages, turn, True, full))
        end = len(_prefix(chat, messages, turn + 1, False, full))
        cut = _last(full[start:end], end_of_turn) if end_of_turn else -1
        if cut >= 0:
            end = start + cut + len(end_of_turn)
        labels[start:end] = full[start:end]
    return Example(full, labels)


def _prefix(
    chat: ChatFormat, messages: Sequence[Dict[str, str]], count: int, generation_prompt: bool, full: List[int]
) -> List[int]:
    part = chat.encode(chat.render(messages[:count], generation_prompt))
    if full[: len(part)] != part:
        differ = next(
            (i for i, (a, b) in enumerate(zip(part, full, strict=False)) if a != b), min(len(part), len(full))
        )
        raise ChatTemplateError(
            f"the chat template renders the first {count} messages (add_generation_prompt={generation_prompt}) as"
            f" something that is not the start of the whole conversation's rendering (they differ from token"
            f" {differ}): it rewrites earlier turns (some templates drop past assistant turns' reasoning), so the"
            " assistant tokens cannot be found by rendering prefix by prefix. Set data.chat_template to a template"
            " that renders each turn the same in every conversation, or split such conversations into one"
            " conversation per assistant turn"
        )
    return part


def _last(sequence: List[int], part: List[int]) -> int:
    for start in range(len(sequence) - len(part), -1, -1):
        if sequence[start : start + len(part)] == part:
            return start
    return -1


def instruction_example(prompt: str, completion: str, encode: Encode, end: Sequence[int] = ()) -> Example:
    """The prompt's tokens untrained, then the completion's and ``end`` (the EOS ids) trained: prompt and completion
    tokenized apart, as inference sees them (the prompt encoded alone, the completion generated token by token after
    it), so a token BPE would merge across the boundary (a prompt ending in a space) is never half of each."""
    prompt_ids, answer = encode(prompt), encode(completion) + list(end)
    return Example(prompt_ids + answer, [IGNORE_INDEX] * len(prompt_ids) + answer)


def conversation_problem(messages: Any) -> Optional[str]:
    """Why ``messages`` is not a conversation this trains on (None when it is): a list of ``{role, content}`` with
    known roles and at least one assistant turn."""
    if not isinstance(messages, list) or not messages:
        return "'messages' must be a non-empty list of {role, content} objects"
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("content"), str):
            return f"message {index} must be an object with a string 'content'"
        if message.get("role") not in ROLES:
            return f"message {index} has role {message.get('role')!r}; use one of {', '.join(ROLES)}"
    if not any(message["role"] == "assistant" for message in messages):
        return "the conversation has no assistant turn, so nothing in it would be trained; add one or drop it"
    return None


def cut_at_end_of_turn(answer: str, marker: str = BYTE_END_OF_TURN) -> str:
    """``answer`` up to its end-of-turn marker; an answer that ran out of new tokens inside the marker ends in a
    start of it (``<|``, ``<|en``), which is cut too."""
    answer = answer.split(marker)[0]
    for size in range(min(len(marker), len(answer) + 1) - 1, 0, -1):
        if answer.endswith(marker[:size]):
            return answer[:-size].strip()
    return answer.strip()

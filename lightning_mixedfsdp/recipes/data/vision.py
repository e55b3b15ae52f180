"""Image-text fine-tuning data: conversations in trl's vision format, rendered and tokenized by the model's processor
(its chat template, tokenizer and image processor), the loss on the assistant turns only, one example per row.

A ``.jsonl`` line is ``{"messages": [...], "images": ["img/0001.png"]}``: each message's ``content`` is a string or a
list of parts, ``{"type": "image"}`` or ``{"type": "text", "text": ...}``, one image part per listed image, none in an
assistant turn. Image paths are relative to the jsonl file. Lines without ``images`` are text-only rows. Without
``data.files`` the rows are the generated shapes task (``shapes.py``).

Masks come from the conversation rendered prefix by prefix (``chat.py``) with each image a single placeholder; the
processor then expands each placeholder into the model's image tokens, which stay untrained. Rows are never packed:
image features are placed by the positions of image tokens, and the models' packed-sequence masks do not cover them.
A row longer than ``data.seq_len`` is cut only after its last image token (else left out)."""

import itertools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor
from typing_extensions import override

from lightning_mixedfsdp.model.tensors import IGNORE_INDEX
from lightning_mixedfsdp.recipes.data.chat import ROLES, ChatFormat, ChatTemplateError, chat_example
from lightning_mixedfsdp.recipes.data.sft import RowSet, Splits, StepRows, split_records, too_long_problems
from lightning_mixedfsdp.recipes.data.shapes import shapes_processor, shapes_records
from lightning_mixedfsdp.recipes.data.text import SizedDataset, TextCorpus
from lightning_mixedfsdp.recipes.settings.inputs import data_files
from lightning_mixedfsdp.recipes.settings.schema import DataSection

TEXT_KEYS = ("input_ids", "labels")
"""What every row holds; the processor's other per-token outputs (Qwen2-VL's ``mm_token_type_ids``) too, padded
with 0, and its per-image outputs (``pixel_values``, ``image_grid_thw``) only in rows with images."""
NOT_MODEL_INPUTS = ("labels", "step_tokens", "has_image")
IMAGE_OR_TEXT = ("image", "text")
GENERATED_CHECKED = 200
"""Rows of the generated task made before launch (each rank makes all of them at setup)."""


@dataclass
class VisionExample:
    """One conversation as the model sees it: ids with each image expanded into its image tokens, unshifted labels
    (-100 but on the assistant turns), the processor's per-token outputs and per-image outputs."""

    ids: List[int]
    labels: List[int]
    per_token: Dict[str, List[int]] = field(default_factory=dict)
    per_image: Dict[str, Tensor] = field(default_factory=dict)

    @property
    def trained(self) -> int:
        return sum(1 for label in self.labels[1:] if label != IGNORE_INDEX)

    @property
    def has_image(self) -> bool:
        return bool(self.per_image)


def vision_records(data: DataSection) -> Iterator[Tuple[str, Any]]:
    """``(where, record)`` per line of the ``.jsonl`` files (a line that is not JSON as its error), each record's
    ``images`` resolved against its file's folder; without files, the generated shapes task."""
    if not data.files:
        yield from shapes_records()
        return
    files, _ = data_files(data)
    for path in files:
        with path.open(encoding="utf-8") as lines:
            for number, line in enumerate(lines, start=1):
                if not line.strip():
                    continue
                where = f"{path}:{number}"
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as error:
                    yield where, error
                    continue
                if isinstance(record, dict) and isinstance(record.get("images"), list):
                    images = record["images"]
                    record = {**record, "images": [path.parent / i if isinstance(i, str) else i for i in images]}
                yield where, record


def record_problem(record: Any) -> Optional[str]:
    """Why ``record`` is not an image-text conversation this trains on (None when it is), as a line's problem."""
    if not isinstance(record, dict) or "messages" not in record:
        return 'has no \'messages\'; each line is {"messages": [...], "images": [...]}'
    messages, images = record["messages"], record.get("images", [])
    if not isinstance(messages, list) or not messages:
        return "'messages' must be a non-empty list of {role, content} objects"
    if not isinstance(images, list):
        return "'images' must be a list of image paths"
    image_parts = 0
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            return f"message {index} must be an object with a role in {', '.join(ROLES)}"
        content = message.get("content")
        parts: List[Any] = [{"type": "text", "text": content}] if isinstance(content, str) else content or []
        if not isinstance(content, (str, list)) or not all(_known_part(p) for p in parts):
            return f"message {index}'s content must be a string or a list of {{type: image|text}} parts"
        count = sum(1 for p in parts if p["type"] == "image")
        if count and message["role"] == "assistant":
            return f"message {index} is an assistant turn with an image part; images go in user (or system) turns"
        image_parts += count
    if not any(m["role"] == "assistant" for m in messages):
        return "the conversation has no assistant turn, so nothing in it would be trained; add one or drop it"
    if image_parts != len(images):
        return f"has {image_parts} image parts in its messages and {len(images)} images listed; make them equal"
    for image in images:
        problem = _image_problem(image)
        if problem is not None:
            return problem
    return None


def _known_part(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") in IMAGE_OR_TEXT


def _image_problem(image: Any) -> Optional[str]:
    if not isinstance(image, Path):
        return None  # generated, in memory
    if not image.is_file():
        return f"lists the image {str(image)!r}, which does not exist (paths are relative to the jsonl file)"
    from PIL import Image

    try:
        with Image.open(image) as opened:
            opened.verify()
    except Exception as error:  # PIL raises many types for a bad file
        return f"lists the image {str(image)!r}, which cannot be read as an image ({type(error).__name__}: {error})"
    return None


def _load_image(image: Any) -> Any:
    from PIL import Image

    if isinstance(image, Path):
        with Image.open(image) as opened:
            return opened.convert("RGB")
    return image


class VisionExampleMaker:
    """Records to :class:`VisionExample` s with one processor."""

    def __init__(self, processor: Any) -> None:
        self.processor = processor
        tokenizer = processor.tokenizer
        self.image_token_id = int(tokenizer.convert_tokens_to_ids(processor.image_token))
        self.pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)

        def render(messages: Sequence[Dict[str, Any]], add_generation_prompt: bool) -> str:
            text = processor.apply_chat_template(
                list(messages), tokenize=False, add_generation_prompt=add_generation_prompt
            )
            return str(text)

        def encode(text: str) -> List[int]:
            return list(tokenizer(text, add_special_tokens=False)["input_ids"])  # the template writes BOS itself

        self.chat = ChatFormat(render, encode, tokenizer.eos_token)

    def __call__(self, record: Any) -> VisionExample:
        """The example of ``record``; :class:`ValueError` (with the reason and fix) when it is not one."""
        problem = record_problem(record)
        if problem is not None:
            raise ValueError(problem)
        messages = record["messages"]
        short = chat_example(messages, self.chat)
        images = [_load_image(image) for image in record.get("images", [])]
        text = self.chat.render(messages, False)
        outputs = self.processor(text=[text], images=images or None, return_tensors="pt", add_special_tokens=False)
        ids = outputs["input_ids"][0].tolist()
        labels = expand_labels(short.ids, short.labels, ids, self.image_token_id)
        per_token, per_image = {}, {}
        for key, value in outputs.items():
            if key in ("input_ids", "attention_mask") or not isinstance(value, Tensor):
                continue
            if value.dim() == 2 and value.shape == (1, len(ids)):
                per_token[key] = value[0].tolist()
            else:
                per_image[key] = value
        return VisionExample(ids, labels, per_token, per_image)


def expand_labels(short_ids: List[int], short_labels: List[int], ids: List[int], image_token: int) -> List[int]:
    """``short_labels`` (one image placeholder per image) carried over to ``ids`` (each placeholder expanded into a
    run of image tokens, untrained)."""
    labels: List[int] = []
    position = 0
    index = 0
    while index < len(short_ids):
        if short_ids[index] == image_token:
            while index < len(short_ids) and short_ids[index] == image_token:
                index += 1
            if position >= len(ids) or ids[position] != image_token:
                raise ChatTemplateError("the processor wrote no image tokens where the template put an image")
            while position < len(ids) and ids[position] == image_token:
                labels.append(IGNORE_INDEX)
                position += 1
            continue
        if position >= len(ids) or ids[position] != short_ids[index]:
            raise ChatTemplateError(
                "the processor tokenized the conversation otherwise than its tokenizer did (beyond expanding the"
                " images); use a processor whose tokenizer and chat template are the model's"
            )
        labels.append(short_labels[index])
        index += 1
        position += 1
    if position != len(ids):
        raise ChatTemplateError("the processor added tokens beyond the template's; check its chat template")
    return labels


def vision_examples(data: DataSection, maker: VisionExampleMaker, limit: Optional[int] = None) -> Splits[VisionExample]:
    """Every record made an example and fitted to ``data.seq_len`` (see :func:`split_records`); the first ``limit``
    records only, when given."""
    records = vision_records(data)
    return split_records(
        data,
        records if limit is None else itertools.islice(records, limit),
        maker,
        lambda example, splits: _fit(example, data.seq_len, data.too_long, maker.image_token_id, splits),
        lambda example: len(example.ids),
    )


def _fit(
    example: VisionExample, seq_len: int, too_long: str, image_token: int, splits: Splits[VisionExample]
) -> Optional[VisionExample]:
    if len(example.ids) <= seq_len:
        return example
    splits.too_long += 1
    last_image = max((i for i, t in enumerate(example.ids) if t == image_token), default=-1)
    cut = VisionExample(
        example.ids[:seq_len],
        example.labels[:seq_len],
        {k: v[:seq_len] for k, v in example.per_token.items()},
        example.per_image,
    )
    if too_long == "drop" or last_image >= seq_len or cut.trained == 0:
        splits.dropped += 1
        return None
    return cut


class VisionRows:
    """Examples padded to ``seq_len``, one per row, as dicts (the rows' interface of ``sft.py``: ``trained``,
    ``row``, ``padding``)."""

    def __init__(self, examples: List[VisionExample], seq_len: int, pad: int) -> None:
        self.examples, self.seq_len, self.pad = examples, seq_len, pad
        self.trained = torch.tensor([e.trained for e in examples], dtype=torch.long)
        self.image_keys = sorted({k for e in examples for k in e.per_image})

    def __len__(self) -> int:
        return len(self.examples)

    def row(self, index: int) -> Dict[str, Tensor]:
        example = self.examples[index]
        extra = self.seq_len - len(example.ids)
        row = {
            "input_ids": torch.tensor(example.ids + [self.pad] * extra),
            # the first token is never a target; padding is untrained
            "labels": torch.tensor([IGNORE_INDEX] + example.labels[1:] + [IGNORE_INDEX] * extra),
            "has_image": torch.tensor(example.has_image),
            **{k: torch.tensor(v + [0] * extra) for k, v in example.per_token.items()},
        }
        return {**row, **example.per_image}

    @property
    def padding(self) -> float:
        used = sum(len(e.ids) for e in self.examples)
        return 1.0 - used / max(len(self.examples) * self.seq_len, 1)

    def collate(self, rows: List[Dict[str, Tensor]]) -> Dict[str, Tensor]:
        """A micro-batch: the rows' per-token tensors stacked, their images' outputs concatenated (none: left out)."""
        batch = {k: torch.stack([r[k] for r in rows]) for k in rows[0] if k not in self.image_keys}
        for key in self.image_keys:
            present = [r[key] for r in rows if key in r]
            if present:
                batch[key] = torch.cat(present)
        return batch


def model_inputs(batch: Dict[str, Tensor]) -> Dict[str, Tensor]:
    """The batch's tensors the model takes (not its labels, step count or image flags)."""
    return {k: v for k, v in batch.items() if k not in NOT_MODEL_INPUTS}


def load_processor(data: DataSection, pretrained: Optional[str]) -> Any:
    """The processor that prepares the rows: ``data.tokenizer``'s folder, else ``model.pretrained``'s, else (the
    generated shapes task) its own."""
    from transformers import AutoProcessor

    if data.tokenizer != "bytes":
        return AutoProcessor.from_pretrained(data.tokenizer, trust_remote_code=data.trust_remote_code)
    if pretrained is not None:
        return AutoProcessor.from_pretrained(pretrained, trust_remote_code=data.trust_remote_code)
    return shapes_processor()


def checked_processor(data: DataSection, pretrained: Optional[str]) -> Tuple[Any, Optional[str]]:
    """The processor that prepares the data, or None and why there is none (with the fix)."""
    if data.tokenizer == "bytes" and pretrained is None and data.files:
        return None, (
            "data: image-text rows need the model's processor (image processor, tokenizer, chat template); set"
            " data.tokenizer to a folder holding it (AutoProcessor.from_pretrained reads it), or fine-tune a"
            " model.pretrained folder that has one"
        )
    source = data.tokenizer if data.tokenizer != "bytes" else pretrained
    try:
        processor = load_processor(data, pretrained)
    except Exception as error:  # transformers raises many types for a folder it cannot read
        return None, f"data: {source!r} has no processor AutoProcessor can load ({type(error).__name__}: {error})"
    if not hasattr(processor, "image_token") or not hasattr(processor, "tokenizer"):
        kind = type(processor).__name__
        return None, f"data: the processor of {source!r} ({kind}) takes no images; use the VLM's folder"
    return processor, None


class VisionCorpus(TextCorpus):
    """Rows of image-text conversations (and text-only ones), one per row; the training stream carries each step's
    trained-token count, as the chat recipes' does."""

    keyed_stream = True

    def __init__(
        self, data: DataSection, pretrained: Optional[str], seed: int, micro_batches: int, accumulate: int
    ) -> None:
        super().__init__(data, seed, micro_batches)
        self.accumulate = accumulate
        self.processor = load_processor(data, pretrained)
        self.maker = VisionExampleMaker(self.processor)
        self.train_rows: Optional[VisionRows] = None
        self.held_out_rows: Optional[VisionRows] = None

    @override
    def setup(self, stage: str) -> None:
        data = self.data
        splits = vision_examples(data, self.maker)
        if splits.problems or not splits.train or not splits.held_out:  # the launcher checked the same before
            raise ValueError("; ".join(splits.problems) or "data: no examples to train or evaluate on")
        self.train_rows = VisionRows(splits.train, data.seq_len, self.maker.pad)
        self.held_out_rows = VisionRows(splits.held_out, data.seq_len, self.maker.pad)
        self.val_set = RowSet(self.held_out_rows, data.val_windows)  # type: ignore[arg-type]  # the rows' interface
        self.collate = self.train_rows.collate
        with_images = sum(e.has_image for e in splits.train)
        longer = ""
        if splits.too_long:
            longer = (
                f"; {splits.too_long} longer than {data.seq_len} tokens ({splits.dropped} left out: cut only after"
                " the last image token)"
            )
        packing = " (data.packing does not pack image rows)" if data.packing else ""
        rank_zero_info(
            f"data: image-text chat, {len(splits.train)} training examples ({with_images} with images) and"
            f" {len(splits.held_out)} held-out ones, one per row of {data.seq_len} tokens{packing},"
            f" {self.train_rows.padding:.0%} padding{longer}"
        )

    @override
    def _training_set(self, ranks: int) -> SizedDataset:
        assert self.train_rows is not None
        return StepRows(self.train_rows, self.seed, self.data.batch_size, ranks, self.accumulate)  # type: ignore[arg-type]


def vision_data_problems(
    data: DataSection, pretrained: Optional[str], ranks: int, vocab: Optional[int], image_token: Optional[int]
) -> List[str]:
    """What keeps the image-text data from training, before launch, all at once: no processor, one whose tokenizer
    outgrows the model's ``vocab`` or whose image token is not the model's ``image_token``, bad lines (each named
    with its file and line: not JSON, a missing or unreadable image, image parts that do not match ``images``, an
    image in an assistant turn), too-long rows under ``data.too_long=error``, too few rows per rank."""
    processor, problem = checked_processor(data, pretrained)
    if problem is not None:
        return [problem]
    maker = VisionExampleMaker(processor)
    problems = []
    tokens = len(maker.processor.tokenizer)
    if vocab is not None and tokens > vocab:
        problems.append(
            f"data: the processor's tokenizer has {tokens} tokens, more than the model's embedding ({vocab}); use the"
            " model's own processor, or a model with vocab_size >= the tokenizer's"
        )
    if image_token is not None and image_token != maker.image_token_id:
        problems.append(
            f"data: the processor writes images as token {maker.image_token_id} ({maker.processor.image_token!r}),"
            f" and the model's config expects image_token_id={image_token}; use the model's own processor, or set"
            " the config's image_token_id to the processor's"
        )
    # the generated task's rows are alike and known good: its first rows say whether they fit data.seq_len
    splits = vision_examples(data, maker, limit=None if data.files else GENERATED_CHECKED)
    problems += [*splits.problems, *too_long_problems(splits, data)]
    if problems:
        return problems
    held_out = min(len(splits.held_out), data.val_windows)
    if not splits.train or held_out < ranks:
        problems.append(
            f"data: {len(splits.train)} training and {len(splits.held_out)} held-out examples ({splits.dropped} left"
            f" out as too long); training needs an example and evaluation one per data-parallel rank ({ranks}):"
            f" add examples, lower data.held_out_every={data.held_out_every}, or raise data.seq_len"
        )
    return problems

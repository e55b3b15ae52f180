"""Fine-tuning data: conversations (``chat``) and prompt/completion pairs (``instruction``) from ``.jsonl`` files, or
the generated standard-library conversations without files; every bad input found before launch; examples packed
into rows (or one per row, padded); and the training stream, each item carrying its optimizer step's trained-token
count.

Packed rows hold several examples back to back, each with positions restarting at 0: HF models build their
block-causal mask from those positions (no attention mask is passed), the reference model segments its attention and
its mixer the same way. The first token of each packed example is never a target (after the model's shift it would
be the previous example's next token). The tail of a row is padding, labelled -100, with positions of its own.

The step's trained-token count is a pure function of the stream (seed, global micro-batch index) and the rows, so
every rank knows it for every step without a collective: the loss of a micro-batch is its token losses' sum over
that count, scaled back for Lightning's division by ``accumulate_grad_batches`` and the data-parallel average, and
``accumulate_grad_batches=4`` with 1 row per micro-batch trains as 1 step of 4 rows does."""

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Generic, Iterator, List, Optional, Tuple, TypeVar, Union

import torch
from torch import Tensor

from lightning_mixedfsdp.recipes.data.chat import (
    BYTE_END_OF_TURN,
    IGNORE_INDEX,
    ChatFormat,
    ChatTemplateError,
    Example,
    byte_chat_format,
    chat_example,
    conversation_problem,
    hf_chat_format,
    instruction_example,
)
from lightning_mixedfsdp.recipes.data.stdlib_chat import stdlib_conversations
from lightning_mixedfsdp.recipes.data.text import ByteTokenizer, HFTokenizer, SizedDataset, StreamOrder, make_tokenizer
from lightning_mixedfsdp.recipes.settings.inputs import data_files, detected_format, resolved_format
from lightning_mixedfsdp.recipes.settings.schema import DataSection

FINE_TUNING = ("chat", "instruction")
MAX_LISTED = 6
"""Problems listed one by one before the rest are counted."""


def read_records(data: DataSection, fine_tuning_format: str) -> Iterator[Tuple[str, Any]]:
    """``(where, record)`` for each example, in a stable order; a line that is not JSON comes as its
    :class:`json.JSONDecodeError`. Without files, the generated standard-library conversations (as prompt and
    completion pairs for the instruction format)."""
    if not data.files:
        for index, messages in enumerate(stdlib_conversations()):
            where = f"generated conversation {index}"
            if fine_tuning_format == "chat":
                yield where, {"messages": messages}
            else:
                question = next(m["content"] for m in messages if m["role"] == "user")
                answer = next(m["content"] for m in messages if m["role"] == "assistant")
                yield where, {"prompt": f"Question: {question}\nAnswer:", "completion": f" {answer}"}
        return
    files, _ = data_files(data)
    for path in files:
        with path.open(encoding="utf-8") as lines:
            for number, line in enumerate(lines, start=1):
                if line.strip():
                    try:
                        yield f"{path}:{number}", json.loads(line.rstrip("\r\n"))  # json's line 1: this line
                    except json.JSONDecodeError as error:
                        yield f"{path}:{number}", error


class ExampleMaker:
    """Records to :class:`Example` s for one format and tokenizer."""

    def __init__(self, data: DataSection, fine_tuning_format: str, tokenizer: Union[ByteTokenizer, HFTokenizer]):
        self.format = fine_tuning_format
        template = template_text(data.chat_template)
        if isinstance(tokenizer, HFTokenizer):
            hf = tokenizer.tokenizer
            self.encode = lambda text: list(hf(text, add_special_tokens=False)["input_ids"])
            self.decode = lambda ids, skip_special_tokens=False: str(
                hf.decode(ids, skip_special_tokens=skip_special_tokens)
            )
            self.end = [hf.eos_token_id] if hf.eos_token_id is not None else []
            self.pad = hf.pad_token_id if hf.pad_token_id is not None else (hf.eos_token_id or 0)
            self._chat = lambda: hf_chat_format(hf, template)
        else:
            self.encode = lambda text: list(text.encode("utf-8"))
            self.decode = lambda ids, skip_special_tokens=False: bytes(ids).decode("utf-8", errors="replace")
            self.end, self.pad = self.encode(BYTE_END_OF_TURN), 0
            own = tokenizer.chat_template  # a byte-level export's, unless the recipe names another
            self._chat = lambda: byte_chat_format(self.encode, template if template is not None else own)
        self.chat: Optional[ChatFormat] = None

    def __call__(self, record: Any) -> Example:
        """The example of ``record``; :class:`ValueError` (with the reason and fix) when it is not one."""
        if isinstance(record, json.JSONDecodeError):
            raise ValueError(f"is not JSON ({record}); fix the line")
        found = detected_format(record, "\0")
        if found != self.format:
            keys = sorted(record) if isinstance(record, dict) else type(record).__name__
            wanted = "'messages'" if self.format == "chat" else "'prompt' and 'completion'"
            raise ValueError(
                f"has the fields {keys}, not {wanted} as data.format={self.format!r} needs; fix the line or set"
                " data.format to the format of the file"
            )
        if self.format == "instruction":
            prompt, completion = record["prompt"], record["completion"]
            if not (isinstance(prompt, str) and isinstance(completion, str) and completion):
                raise ValueError("needs 'prompt' and a non-empty 'completion', both strings")
            return instruction_example(prompt, completion, self.encode, self.end)
        problem = conversation_problem(record["messages"])
        if problem is not None:
            raise ValueError(problem)
        return chat_example(record["messages"], self.chat_format())

    def chat_format(self) -> ChatFormat:
        """The tokenizer's chat format (:class:`ChatTemplateError` for a tokenizer without a template)."""
        if self.chat is None:
            self.chat = self._chat()
        return self.chat


def template_text(value: Optional[str]) -> Optional[str]:
    if value is not None and "{" not in value and Path(value).is_file():
        return Path(value).read_text(encoding="utf-8")
    return value


Item = TypeVar("Item")


@dataclass
class Splits(Generic[Item]):
    """The items (examples, pairs) of both splits, and what was found on the way."""

    train: List[Item]
    held_out: List[Item]
    problems: List[str]
    too_long: int = 0
    """Items longer than ``seq_len`` (truncated, dropped or refused by ``data.too_long``)."""
    dropped: int = 0
    """Items left out: too long under ``drop``, or with no trained token left after truncation."""


ExampleSplits = Splits[Example]


def split_records(
    data: DataSection,
    records: Iterator[Tuple[str, Any]],
    make: Callable[[Any], Item],
    fit: Callable[[Item, "Splits[Item]"], Optional[Item]],
    size: Callable[[Item], int],
) -> "Splits[Item]":
    """Every record made an item (``make``) and fitted to ``seq_len`` (``fit``, by ``data.too_long``); every
    ``held_out_every``-th held out, starting with the first; each split read until it holds ``max_bytes`` of token
    ids (``size``). Every bad record is a problem (the first :data:`MAX_LISTED` listed, the rest counted)."""
    splits: Splits[Item] = Splits([], [], [])
    sizes, bad, template_failed = [0, 0], 0, False
    for index, (where, record) in enumerate(records):
        split = 1 if index % data.held_out_every == 0 else 0
        if sizes[split] >= data.max_bytes:
            if min(sizes) >= data.max_bytes:
                break
            continue
        try:
            if isinstance(record, Exception):
                raise ValueError(f"is not JSON ({record}); fix the line")
            item = make(record)
        except ChatTemplateError as error:  # the template's: said once, the other records still checked
            if not template_failed:
                splits.problems.append(f"data: {where}: {error}")
            template_failed = True
            continue
        except ValueError as error:
            bad += 1
            if bad <= MAX_LISTED:
                splits.problems.append(f"data: {where} {error}")
            continue
        fitted = fit(item, splits)
        if fitted is not None:
            (splits.held_out if split else splits.train).append(fitted)
            sizes[split] += size(fitted)
    if bad > MAX_LISTED:
        splits.problems.append(f"data: {bad - MAX_LISTED} more bad records like these")
    return splits


def too_long_problems(splits: "Splits[Any]", data: DataSection, items: str = "examples") -> List[str]:
    """Under ``data.too_long=error``, the problem of ``splits``' items longer than ``data.seq_len`` (none otherwise)."""
    if not (splits.too_long and data.too_long == "error"):
        return []
    return [
        f"data: {splits.too_long} {items} are longer than data.seq_len={data.seq_len} tokens; raise data.seq_len, or"
        " set data.too_long=truncate or drop"
    ]


def split_size_problems(train: int, held_out: int, data: DataSection, ranks: int, item: str) -> List[str]:
    """Too few ``item`` s (``pair``, ``prompt``) for one to train and one to evaluate on each data-parallel rank (at
    most ``data.val_windows`` held-out ones are evaluated)."""
    if train >= ranks and min(held_out, data.val_windows) >= ranks:
        return []
    return [
        f"data: {train} training and {held_out} held-out {item}s (at most data.val_windows={data.val_windows}"
        f" evaluated); training and evaluation need a {item} per data-parallel rank ({ranks}): add {item}s, lower"
        f" data.held_out_every={data.held_out_every}, or raise data.val_windows"
    ]


def fine_tuning_examples(data: DataSection, maker: ExampleMaker) -> ExampleSplits:
    """Every record made an example (see :func:`split_records`)."""
    return split_records(
        data,
        read_records(data, maker.format),
        maker,
        lambda example, splits: _fit(example, data.seq_len, data.too_long, splits),
        lambda example: len(example.ids),
    )


def _fit(example: Example, seq_len: int, too_long: str, splits: ExampleSplits) -> Optional[Example]:
    if len(example.ids) <= seq_len:
        return example
    splits.too_long += 1
    if too_long == "drop":
        splits.dropped += 1
        return None
    cut = Example(example.ids[:seq_len], example.labels[:seq_len])
    if cut.trained == 0:
        splits.dropped += 1
        return None
    return cut


def fine_tuning_problems(data: DataSection, ranks: int, packed: bool) -> List[str]:
    """What keeps the fine-tuning data from training, before launch, all at once: bad records, a template that cannot
    give masks, too-long examples under ``data.too_long=error``, too few examples for a training row and a held-out
    row per data-parallel rank (``packed``: as the run packs them)."""
    tokenizer = make_tokenizer(data.tokenizer, data.trust_remote_code)
    splits = fine_tuning_examples(data, ExampleMaker(data, resolved_format(data), tokenizer))
    problems = [*splits.problems, *too_long_problems(splits, data)]
    if problems:
        return problems
    make = packed_rows if packed else padded_rows
    held_out = min(len(make(splits.held_out, data.seq_len, 0)), data.val_windows)
    if not splits.train or held_out < ranks:
        left = f" ({splits.dropped} too long for data.seq_len={data.seq_len} left out)" if splits.dropped else ""
        problems.append(
            f"data: {len(splits.train)} training and {len(splits.held_out)} held-out examples{left}, the held-out"
            f" ones in {held_out} rows of {data.seq_len} tokens (at most data.val_windows={data.val_windows});"
            f" training needs an example and evaluation a row per data-parallel rank ({ranks}): add examples, lower"
            f" data.held_out_every={data.held_out_every} or data.seq_len, or raise data.val_windows"
        )
    return problems


@dataclass
class Rows:
    """Rows of ``seq_len`` tokens: ids, unshifted labels, positions, and each row's tokens before its padding."""

    input_ids: Tensor
    labels: Tensor
    position_ids: Tensor
    lengths: Tensor

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def trained(self) -> Tensor:
        """Each row's trained tokens (its labels after the first that are not -100)."""
        return (self.labels[:, 1:] != IGNORE_INDEX).sum(dim=1)

    def row(self, index: int) -> Dict[str, Tensor]:
        return {
            "input_ids": self.input_ids[index],
            "labels": self.labels[index],
            "position_ids": self.position_ids[index],
        }

    @property
    def padding(self) -> float:
        """The share of the rows' tokens that are padding."""
        return 1.0 - float(self.lengths.sum()) / max(self.input_ids.numel(), 1)


Row = Tuple[List[int], List[int], List[int], int]


def _rows(rows: List[Row], seq_len: int) -> Rows:
    def tensor(part: int) -> Tensor:
        return torch.tensor([row[part] for row in rows], dtype=torch.long).reshape(len(rows), seq_len)

    lengths = torch.tensor([row[3] for row in rows], dtype=torch.long)
    return Rows(tensor(0), tensor(1), tensor(2), lengths)


def packed_rows(examples: List[Example], seq_len: int, pad: int) -> Rows:
    """The examples back to back, in order, a new row when the next does not fit; positions restart at each."""
    rows: List[Row] = []
    ids: List[int] = []
    labels: List[int] = []
    positions: List[int] = []
    for example in examples:
        if len(ids) + len(example.ids) > seq_len:
            rows.append(_padded(ids, labels, positions, seq_len, pad))
            ids, labels, positions = [], [], []
        ids += example.ids
        labels += [IGNORE_INDEX] + example.labels[1:]  # never the target of the previous example's last token
        positions += list(range(len(example.ids)))
    if ids:
        rows.append(_padded(ids, labels, positions, seq_len, pad))
    return _rows(rows, seq_len)


def padded_rows(examples: List[Example], seq_len: int, pad: int) -> Rows:
    """One example per row, padded on the right; positions run on through the padding (causal attention keeps the
    example's tokens from it, so no mask is needed)."""
    rows: List[Row] = []
    for example in examples:
        extra = seq_len - len(example.ids)
        labels = [IGNORE_INDEX] + example.labels[1:] + [IGNORE_INDEX] * extra
        rows.append((example.ids + [pad] * extra, labels, list(range(seq_len)), len(example.ids)))
    return _rows(rows, seq_len)


def _padded(ids: List[int], labels: List[int], positions: List[int], seq_len: int, pad: int) -> Row:
    extra = seq_len - len(ids)
    return ids + [pad] * extra, labels + [IGNORE_INDEX] * extra, positions + list(range(extra)), len(ids)


class RowSet(SizedDataset):
    """Rows as a dataset of dicts (evaluation)."""

    def __init__(self, rows: Rows, count: Optional[int] = None) -> None:
        self.rows, self.count = rows, len(rows) if count is None else min(count, len(rows))

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> Dict[str, Tensor]:
        return self.rows.row(index)


class StepRows(SizedDataset):
    """The training rows, keyed by ``(micro-batch, row)`` (a keyed ``StreamSampler``): each item also carries
    ``step_tokens``, the trained tokens of its whole optimizer step (every micro-batch, every rank)."""

    def __init__(self, rows: Rows, seed: int, batch: int, ranks: int, accumulate: int) -> None:
        self.rows, self.trained = rows, rows.trained.tolist()
        self.order = StreamOrder(len(rows), seed)
        self.per_step = batch * ranks * accumulate
        self.accumulate = accumulate
        self._counted: Dict[int, int] = {}

    def __len__(self) -> int:
        return len(self.rows)

    def step_tokens(self, step: int) -> int:
        if step not in self._counted:
            first = step * self.per_step
            self._counted[step] = sum(self.trained[self.order(p)] for p in range(first, first + self.per_step))
        return self._counted[step]

    def __getitem__(self, key: Tuple[int, int]) -> Dict[str, Tensor]:
        micro_batch, index = key
        count = self.step_tokens(micro_batch // self.accumulate)
        return {**self.rows.row(index), "step_tokens": torch.tensor(count, dtype=torch.long)}

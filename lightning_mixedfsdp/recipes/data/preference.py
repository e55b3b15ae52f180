"""Preference data: pairs of a chosen and a rejected answer to one prompt, from ``.jsonl`` files (``prompt``,
``chosen``, ``rejected``) or the generated standard-library pairs without files; every bad record found before
launch.

A text pair is two instruction examples (the prompt and each answer tokenized apart, the tokenizer's EOS after the
answer; the byte tokenizer's end-of-turn marker); a conversational pair (``prompt`` a list of messages ending with a
user turn, ``chosen`` and ``rejected`` one assistant message each, as trl reads them) is two conversations rendered
by the chat template, each with its last assistant turn trained (its end-of-turn marker included), the prompt not.
Each pair is one item of two padded rows, chosen first: one forward runs both (concatenated along the batch), and
``data.batch_size`` counts pairs. Pairs are never packed. A pair longer than ``data.seq_len`` follows
``data.too_long``: ``truncate`` cuts the prompt from its start, keeping the answer whole where it fits (else its end
is cut), ``drop`` leaves the pair out, ``error`` refuses it before launch."""

from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor
from typing_extensions import override

from lightning_mixedfsdp.recipes.data.chat import (
    IGNORE_INDEX,
    Example,
    chat_example,
    instruction_example,
)
from lightning_mixedfsdp.recipes.data.sft import (
    ExampleMaker,
    Splits,
    padded_rows,
    read_records,
    split_records,
    split_size_problems,
    too_long_problems,
)
from lightning_mixedfsdp.recipes.data.stdlib_chat import stdlib_preference_pairs
from lightning_mixedfsdp.recipes.data.text import SizedDataset, TextCorpus
from lightning_mixedfsdp.recipes.settings.schema import DataSection

PREFERENCE = "preference"


@dataclass
class Pair:
    chosen: Example
    rejected: Example


def preference_records(data: DataSection) -> Iterator[Tuple[str, Any]]:
    """``(where, record)`` for each pair: the files' lines, or the generated standard-library pairs."""
    if not data.files:
        for index, pair in enumerate(stdlib_preference_pairs()):
            yield f"generated pair {index}", pair
        return
    yield from read_records(data, PREFERENCE)


def preference_pair(record: Any, maker: ExampleMaker) -> Pair:
    """The pair of ``record``; :class:`ValueError` (the reason and the fix) when it is not one."""
    if not isinstance(record, dict) or not {"prompt", "chosen", "rejected"} <= set(record):
        keys = sorted(record) if isinstance(record, dict) else type(record).__name__
        raise ValueError(
            f"has the fields {keys}, not 'prompt', 'chosen' and 'rejected' as data.format='preference' needs; fix the"
            " line or set data.format to the format of the file"
        )
    prompt, chosen, rejected = record["prompt"], record["chosen"], record["rejected"]
    if isinstance(prompt, str):
        if not (isinstance(chosen, str) and isinstance(rejected, str)):
            raise ValueError("has a text 'prompt', so 'chosen' and 'rejected' must be text too")
        if not chosen or not rejected:
            raise ValueError("has an empty answer; every pair needs a non-empty 'chosen' and 'rejected'")
        if chosen == rejected:
            raise ValueError("has 'chosen' equal to 'rejected', which teaches no preference; fix or drop the pair")
        return Pair(*(instruction_example(prompt, answer, maker.encode, maker.end) for answer in (chosen, rejected)))
    problem = _conversation_problem(prompt, chosen, rejected)
    if problem is not None:
        raise ValueError(problem)
    chat = maker.chat_format()
    answers = (_answer(chosen), _answer(rejected))
    return Pair(*(chat_example([*prompt, answer], chat, last_turn_only=True) for answer in answers))


def _answer(value: Any) -> Dict[str, str]:
    return value[0] if isinstance(value, list) else value


def _conversation_problem(prompt: Any, chosen: Any, rejected: Any) -> Optional[str]:
    if not isinstance(prompt, list) or not prompt:
        return "'prompt' must be text or a non-empty list of {role, content} messages"
    for index, message in enumerate(prompt):
        if not isinstance(message, dict) or not isinstance(message.get("content"), str):
            return f"prompt message {index} must be an object with a string 'content'"
        if message.get("role") not in ("system", "user", "assistant"):
            return f"prompt message {index} has role {message.get('role')!r}; use system, user or assistant"
    if prompt[-1]["role"] != "user":
        return "'prompt' must end with a user turn, which the answers reply to"
    answers = []
    for name, value in (("chosen", chosen), ("rejected", rejected)):
        answer = _answer(value) if isinstance(value, (list, dict)) and value else None
        if isinstance(value, list) and len(value) != 1:
            answer = None
        if not isinstance(answer, dict) or answer.get("role") != "assistant" or not answer.get("content"):
            return f"'{name}' must be one assistant message with a non-empty 'content' (a list of one, as trl reads it)"
        answers.append(answer["content"])
    if answers[0] == answers[1]:
        return "has 'chosen' equal to 'rejected', which teaches no preference; fix or drop the pair"
    return None


PairSplits = Splits[Pair]


def preference_pairs(data: DataSection, maker: ExampleMaker) -> PairSplits:
    """Every record made a pair (see :func:`split_records`)."""
    return split_records(
        data,
        preference_records(data),
        lambda record: preference_pair(record, maker),
        lambda pair, splits: _fit(pair, data.seq_len, data.too_long, splits),
        lambda pair: len(pair.chosen.ids) + len(pair.rejected.ids),
    )


def _fit(pair: Pair, seq_len: int, too_long: str, splits: PairSplits) -> Optional[Pair]:
    if max(len(pair.chosen.ids), len(pair.rejected.ids)) <= seq_len:
        return pair
    splits.too_long += 1
    if too_long == "drop":
        splits.dropped += 1
        return None
    return Pair(_cut(pair.chosen, seq_len), _cut(pair.rejected, seq_len))


def _cut(example: Example, seq_len: int) -> Example:
    """The prompt cut from its start, the answer whole, where the answer fits; else the example's end cut."""
    if len(example.ids) <= seq_len:
        return example
    answer_start = next(i for i, label in enumerate(example.labels) if label != IGNORE_INDEX)
    start = len(example.ids) - seq_len
    if start <= answer_start - 1:  # the answer and at least one prompt token (the first target needs one before it)
        return Example(example.ids[start:], example.labels[start:])
    return Example(example.ids[:seq_len], example.labels[:seq_len])


def pair_rows(pairs: List[Pair], seq_len: int, pad: int) -> Dict[str, Tensor]:
    """The pairs as ``[pairs, 2, seq_len]`` ids, unshifted labels and positions, chosen first, and each pair's index."""
    examples = [example for pair in pairs for example in (pair.chosen, pair.rejected)]
    rows = padded_rows(examples, seq_len, pad)
    return {
        "input_ids": rows.input_ids.reshape(len(pairs), 2, seq_len),
        "labels": rows.labels.reshape(len(pairs), 2, seq_len),
        "position_ids": rows.position_ids.reshape(len(pairs), 2, seq_len),
        "pair_index": torch.arange(len(pairs)),  # where a precomputed reference stored the pair's scores
    }


class PairSet(SizedDataset):
    """Pairs as a dataset: each item the pair's two rows."""

    def __init__(self, rows: Dict[str, Tensor], count: Optional[int] = None) -> None:
        self.rows = rows
        total = len(rows["input_ids"])
        self.count = total if count is None else min(count, total)

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> Dict[str, Tensor]:
        return {name: tensor[index] for name, tensor in self.rows.items()}


def preference_problems(data: DataSection, ranks: int) -> List[str]:
    """What keeps the preference data from training, before launch, all at once: bad records, a template that cannot
    give masks, too-long pairs under ``data.too_long=error``, too few pairs for a training pair and a held-out pair
    per data-parallel rank."""
    from lightning_mixedfsdp.recipes.data.text import make_tokenizer

    maker = ExampleMaker(data, PREFERENCE, make_tokenizer(data.tokenizer, data.trust_remote_code))
    splits = preference_pairs(data, maker)
    problems = [*splits.problems, *too_long_problems(splits, data, "pairs")]
    if problems:
        return problems
    return split_size_problems(len(splits.train), len(splits.held_out), data, ranks, "pair")


class PreferenceCorpus(TextCorpus):
    """The recipe's preference pairs: the training stream of pairs (``data.batch_size`` pairs a micro-batch) and the
    held-out pairs sharded over the data-parallel ranks."""

    def __init__(self, data: DataSection, seed: int, micro_batches: int) -> None:
        super().__init__(data, seed, micro_batches)
        self.format = PREFERENCE
        self.maker = ExampleMaker(data, PREFERENCE, self.tokenizer)

    @override
    def setup(self, stage: str) -> None:
        data = self.data
        splits = preference_pairs(data, self.maker)
        if splits.problems or not splits.train or not splits.held_out:  # the launcher checked the same before
            raise ValueError("; ".join(splits.problems) or "data: no pairs to train or evaluate on")
        pad = self.maker.pad
        self.train_set = PairSet(pair_rows(splits.train, data.seq_len, pad))
        self.val_set = PairSet(pair_rows(splits.held_out, data.seq_len, pad), data.val_windows)
        longer = ""
        if splits.too_long:
            verb = "left out" if data.too_long == "drop" else "truncated"
            longer = f"; {splits.too_long} longer than {data.seq_len} tokens {verb}"
        rank_zero_info(
            f"data: preference, {len(splits.train)} training and {len(splits.held_out)} held-out pairs, each answer"
            f" one row of {data.seq_len} tokens{longer}"
        )


def pair_batch(batch: Dict[str, Tensor]) -> Tuple[Tensor, Tensor, Tensor]:
    """A micro-batch of ``[pairs, 2, seq_len]`` as ``[2 x pairs, seq_len]`` rows: every pair's chosen row, then every
    pair's rejected row."""

    def rows(name: str) -> Tensor:
        return batch[name].transpose(0, 1).reshape(-1, batch[name].shape[-1])

    return rows("input_ids"), rows("labels"), rows("position_ids")

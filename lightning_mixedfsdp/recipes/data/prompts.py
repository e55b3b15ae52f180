"""Prompts for reinforcement learning (``data.format: prompts``): each ``.jsonl`` line holds ``prompt`` (text, or a
list of messages ending with a user turn, rendered by the chat template with its generation prompt) and any other
fields, which are handed to the reward (``answer`` for ``exact_match``). Every bad line is found before launch,
named by file and line.

The training stream gives each rank ``rl.prompts_per_step`` prompts of its own per optimizer step (``text.py``'s
``StreamSampler``: seeded, resumable); the held-out prompts (every ``data.held_out_every``-th line) are split over the
ranks, ``data.val_windows`` of them at most, for greedy completions."""

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from lightning_mixedfsdp.recipes.data.chat import ROLES
from lightning_mixedfsdp.recipes.data.sft import MAX_LISTED, ExampleMaker, read_records, split_size_problems
from lightning_mixedfsdp.recipes.data.text import SizedDataset, StreamOrder, TextCorpus, make_tokenizer
from lightning_mixedfsdp.recipes.settings.schema import DataSection

PROMPTS = "prompts"


@dataclass
class Prompt:
    ids: List[int]
    """The rendered prompt's tokens (the generation prompt of a chat included)."""
    text: str
    """The rendered prompt, as the reward sees it."""
    record: Dict[str, Any]
    """The line's fields."""


@dataclass
class PromptSplits:
    train: List[Prompt] = field(default_factory=list)
    held_out: List[Prompt] = field(default_factory=list)
    problems: List[str] = field(default_factory=list)


def prompt_problem(record: Any, needed: Sequence[str]) -> Optional[str]:
    """Why a line is not a prompt to train on (None when it is); ``needed``: the fields the reward reads."""
    if not isinstance(record, dict) or "prompt" not in record:
        keys = sorted(record) if isinstance(record, dict) else type(record).__name__
        return f"has the fields {keys}, and a prompts line needs 'prompt' (text, or messages ending with a user turn)"
    if "images" in record:
        return (
            "holds 'images': reinforcement learning takes text prompts only (image prompts are not supported yet);"
            " drop the line or its images"
        )
    prompt = record["prompt"]
    if isinstance(prompt, list):
        if not prompt:
            return "'prompt' is an empty list of messages"
        for index, message in enumerate(prompt):
            if not isinstance(message, dict) or not isinstance(message.get("content"), str):
                return (
                    f"prompt message {index} must be an object with a string 'content' (image parts are not"
                    " supported yet)"
                )
            if message.get("role") not in ROLES:
                return f"prompt message {index} has role {message.get('role')!r}; use one of {', '.join(ROLES)}"
        if prompt[-1]["role"] != "user":
            return (
                f"'prompt' ends with a {prompt[-1]['role']} turn; the policy writes the next assistant turn, so the"
                " prompt must end with a user turn: drop its last turn"
            )
    elif not isinstance(prompt, str) or not prompt:
        return "'prompt' must be a non-empty string or a list of messages"
    missing = [name for name in needed if name not in record]
    if missing:
        return f"has no {', '.join(repr(m) for m in missing)} field, which the reward (rl.reward) reads; add it"
    return None


def make_prompt(record: Dict[str, Any], maker: ExampleMaker) -> Prompt:
    prompt = record["prompt"]
    text = maker.chat_format().render(prompt, True) if isinstance(prompt, list) else prompt
    return Prompt(maker.encode(text), text, record)


def read_prompts(data: DataSection, maker: ExampleMaker, needed: Sequence[str]) -> PromptSplits:
    """Every line of the files made a prompt, every ``held_out_every``-th held out (the first included); every bad
    line a problem (the first few listed, the rest counted)."""
    splits = PromptSplits()
    bad = 0
    for index, (where, record) in enumerate(read_records(data, PROMPTS)):
        problem = f"is not JSON ({record}); fix the line" if isinstance(record, Exception) else None
        problem = problem or prompt_problem(record, needed)
        if problem is None:
            try:
                made = make_prompt(record, maker)
            except ValueError as error:  # a template that cannot render
                problem = str(error)
        if problem is not None:
            bad += 1
            if bad <= MAX_LISTED:
                splits.problems.append(f"data: {where} {problem}")
            continue
        (splits.held_out if index % data.held_out_every == 0 else splits.train).append(made)
    if bad > MAX_LISTED:
        splits.problems.append(f"data: {bad - MAX_LISTED} more bad lines like these")
    return splits


def prompts_problems(data: DataSection, ranks: int, needed: Sequence[str], max_len: int) -> List[str]:
    """Before launch, all at once: bad lines, no files, too few prompts for a training and a held-out prompt per
    rank, a prompt and its completion longer than ``data.seq_len``."""
    if not data.files:
        return ["data.format=prompts reads prompts from data.files (.jsonl, a 'prompt' per line); set data.files"]
    maker = ExampleMaker(data, PROMPTS, make_tokenizer(data.tokenizer, data.trust_remote_code))
    splits = read_prompts(data, maker, needed)
    problems = list(splits.problems)
    if problems:
        return problems
    problems += split_size_problems(len(splits.train), len(splits.held_out), data, ranks, "prompt")
    longest = max((len(p.ids) for p in splits.train + splits.held_out), default=0)
    if longest + max_len > data.seq_len:
        problems.append(
            f"data: the longest prompt has {longest} tokens, and with rl.max_new_tokens={max_len} a rollout is"
            f" longer than data.seq_len={data.seq_len}; raise data.seq_len to {longest + max_len} or shorten prompts"
        )
    return problems


class PromptSet(SizedDataset):
    """Prompts as a dataset: each item a prompt's index (the objective reads the prompt from the corpus)."""

    def __init__(self, prompts: List[Prompt], count: Optional[int] = None) -> None:
        self.prompts = prompts
        self.count = len(prompts) if count is None else min(count, len(prompts))

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> Prompt:
        return self.prompts[index]


def prompt_batch(items: List[Prompt]) -> List[Prompt]:
    """A micro-batch: the prompts as they are (lengths differ; the rollout pads them)."""
    return list(items)


class PromptCorpus(TextCorpus):
    """The recipe's prompts: ``prompts_per_step`` a micro-batch per rank (``data`` carries it as ``batch_size``),
    and the held-out prompts split over the ranks."""

    def __init__(self, data: DataSection, seed: int, micro_batches: int, needed: Sequence[str]) -> None:
        super().__init__(data, seed, micro_batches)
        self.format = PROMPTS
        self.maker = ExampleMaker(data, PROMPTS, self.tokenizer)
        self.needed = tuple(needed)
        self.collate = prompt_batch

    @override
    def setup(self, stage: str) -> None:
        if not self.data.files:  # the launcher refused it before (the generated defaults are other formats')
            raise ValueError("data.format=prompts reads prompts from data.files; set data.files")
        splits = read_prompts(self.data, self.maker, self.needed)
        if splits.problems or not splits.train or not splits.held_out:  # the launcher checked the same before
            raise ValueError("; ".join(splits.problems) or "data: no prompts to train or evaluate on")
        self.train_set = PromptSet(splits.train)
        self.val_set = PromptSet(splits.held_out, self.data.val_windows)
        rank_zero_info(f"data: prompts, {len(splits.train)} training and {len(splits.held_out)} held-out prompts")

    def step_indices(self, micro_batch: int) -> List[int]:
        """This rank's training prompts of ``micro_batch`` (one a step), as indices into the training set: what the
        training stream hands it (``StreamSampler``), known ahead of the step (the next rollout, sampled early)."""
        assert self.train_set is not None
        ranks, rank = self._data_parallel()
        order = StreamOrder(len(self.train_set), self.seed)
        first = (micro_batch * ranks + rank) * self.data.batch_size
        return [order(position) for position in range(first, first + self.data.batch_size)]

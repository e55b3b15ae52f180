"""Training text: the embedded corpus (the Python standard library's own source files, on every machine with Python)
or the user's ``.txt``/``.jsonl`` files, tokenized to bytes or by a local HF tokenizer, packed into windows.

Documents are split by position: every ``held_out_every``-th document is held out for evaluation, so no held-out
token is ever trained on. The training order is a pure function of the seed and the global micro-batch index, and a
resumed run starts where the checkpoint's optimizer step left off: it sees exactly the stream the uninterrupted run
saw (no dependence on Lightning's sampler epochs or on batches prefetched before a save).
"""

import json
import sysconfig
from functools import lru_cache, partial
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple, Union

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import ParallelStrategy
from torch.utils.data import DataLoader, Dataset, Sampler, Subset
from typing_extensions import override

from lightning_mixedfsdp.recipes.settings.inputs import (
    JSONL_SUFFIX,
    data_files,
    is_byte_tokenizer,
    load_hf_tokenizer,
    saved_chat_template,
)
from lightning_mixedfsdp.recipes.settings.schema import DataSection
from lightning_mixedfsdp.strategies.lightning_compat import micro_batches_consumed
from lightning_mixedfsdp.strategies.mixin import MixedFSDP2Mixin

Document = Union[str, bytes]


def stdlib_files() -> List[Path]:
    """The standard library's ``.py`` files in a stable order (installed packages excluded)."""
    return list(_stdlib_files())


@lru_cache(maxsize=1)
def _stdlib_files() -> Tuple[Path, ...]:
    """Walked once per process: the walk over ~1,800 files takes a quarter of a second, and a recipe's data and its
    checks each ask."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return tuple(
        sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and "dist-packages" not in p.parts)
    )


def split_corpus(files: List[Path], held_out_every: int, max_bytes: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Concatenated bytes of the training files and of the held-out files, each capped at ``max_bytes``."""
    documents = (path.read_bytes() for path in files)
    return split_documents(documents, ByteTokenizer(), held_out_every, max_bytes)


class ByteTokenizer:
    """Bytes as tokens (vocabulary 256); documents are separated by a blank line. ``chat_template``: the one a
    byte-level export's tokenizer carries, when it was read from one."""

    vocab_size = 256

    def __init__(self, chat_template: Optional[str] = None) -> None:
        self.chat_template = chat_template

    def encode(self, document: Document) -> List[int]:
        data = document if isinstance(document, bytes) else document.encode("utf-8")
        return list(data + b"\n\n")


class HFTokenizer:
    """A local Hugging Face tokenizer; each document ends with its EOS token when it has one."""

    def __init__(self, directory: str, trust_remote_code: bool = False) -> None:
        self.tokenizer = load_hf_tokenizer(directory, trust_remote_code)
        self.vocab_size = len(self.tokenizer)

    def encode(self, document: Document) -> List[int]:
        text = document.decode("utf-8", errors="replace") if isinstance(document, bytes) else document
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        eos = self.tokenizer.eos_token_id
        return ids + ([eos] if eos is not None else [])

    def save_pretrained(self, directory: Union[str, Path]) -> None:
        self.tokenizer.save_pretrained(str(directory))


def make_tokenizer(spec: str, trust_remote_code: bool = False) -> Union[ByteTokenizer, HFTokenizer]:
    """The byte tokenizer for ``bytes`` and for a directory holding the one a byte-level run exports (with the chat
    template it carries), so fine-tuning a run's export tokenizes as that run did; else the directory's HF
    tokenizer."""
    if spec == "bytes":
        return ByteTokenizer()
    if is_byte_tokenizer(spec):
        return ByteTokenizer(saved_chat_template(spec))
    return HFTokenizer(spec, trust_remote_code)


def read_documents(data: DataSection) -> Iterator[Document]:
    """The stdlib files, or each text file and each ``.jsonl`` line's text field, in a stable order. Files are read as
    bytes: the byte tokenizer takes them as they are, an HF tokenizer decodes them."""
    if not data.files:
        yield from (path.read_bytes() for path in stdlib_files())
        return
    files, _ = data_files(data)
    for path in files:
        if path.suffix == JSONL_SUFFIX:
            with path.open(encoding="utf-8") as lines:
                yield from (json.loads(line)[data.text_field] for line in lines if line.strip())
        else:
            yield path.read_bytes()


def assign_splits(documents: Iterator[Document], held_out_every: int, max_bytes: int) -> Iterator[Tuple[int, Document]]:
    """``(split, document)`` in reading order: split 1 (held out) for every ``held_out_every``-th document, starting
    with the first, 0 (training) for the others; a split takes no more documents once it holds ``max_bytes``."""
    sizes = [0, 0]
    for index, document in enumerate(documents):
        split = 1 if index % held_out_every == 0 else 0
        if sizes[split] >= max_bytes:
            if min(sizes) >= max_bytes:
                return
            continue
        sizes[split] += len(document)
        yield split, document


def split_documents(
    documents: Iterator[Document], tokenizer: Any, held_out_every: int, max_bytes: int
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Token ids of the training documents and of the held-out ones (every ``held_out_every``-th), each split capped
    at ``max_bytes`` of text."""
    splits: Tuple[List[int], List[int]] = ([], [])
    for split, document in assign_splits(documents, held_out_every, max_bytes):
        splits[split].extend(tokenizer.encode(document))
    return torch.tensor(splits[0], dtype=torch.long), torch.tensor(splits[1], dtype=torch.long)


def window_problem(
    train_tokens: int, held_out_tokens: int, data: DataSection, ranks: int, documents: Optional[int] = None
) -> Optional[str]:
    """Too little text: training needs one window of ``seq_len`` tokens, the held-out split one per data-parallel
    rank (each rank evaluates its own share). None when there is enough. ``documents``: how many were read, when
    known, to say that a single document is all held out."""
    short = []
    if train_tokens < data.seq_len:
        short.append(f"{train_tokens} training tokens (one window needs {data.seq_len})")
    if held_out_tokens < data.seq_len * ranks:
        short.append(
            f"{held_out_tokens} held-out tokens ({ranks} data-parallel ranks need {data.seq_len * ranks}, a window"
            " each)"
        )
    if not short:
        return None
    if train_tokens == 0 and documents is not None and documents <= 1:
        fixes = (
            f"data.files gives {documents} document (a text file is one document, a .jsonl line one) and the first"
            " document is held out for evaluation; give two or more files, or a .jsonl with a document per line"
        )
    elif train_tokens < data.seq_len <= held_out_tokens:
        fixes = f"add text, lower data.seq_len, or raise data.held_out_every={data.held_out_every}"
    elif held_out_tokens < data.seq_len * ranks <= train_tokens:
        fixes = f"add text, lower data.seq_len, or lower data.held_out_every={data.held_out_every}"
    else:
        fixes = "add text or lower data.seq_len"
    return (
        f"data: too little text: {' and '.join(short)}; every data.held_out_every-th document is held out, starting"
        f" with the first; {fixes}"
    )


def data_problems(data: DataSection, ranks: int) -> List[str]:
    """:func:`window_problem` before launch: the documents are read and tokenized only until both splits have
    enough, so a large corpus costs one window's worth of work."""
    if data.val_windows < ranks:
        return [f"data.val_windows={data.val_windows} must be >= the {ranks} data-parallel ranks (a window each)"]
    tokenizer = make_tokenizer(data.tokenizer, data.trust_remote_code)
    counts, documents = [0, 0], 0
    for split, document in assign_splits(read_documents(data), data.held_out_every, data.max_bytes):
        counts[split] += len(tokenizer.encode(document))
        documents += 1
        if counts[0] >= data.seq_len and counts[1] >= data.seq_len * ranks:
            return []
    problem = window_problem(counts[0], counts[1], data, ranks, documents)
    return [problem] if problem is not None else []


class SizedDataset(Dataset):
    """A map-style dataset with a length: what the training stream and evaluation draw from."""

    def __len__(self) -> int:
        raise NotImplementedError


class PackedWindows(SizedDataset):
    """Consecutive non-overlapping windows of ``seq_len`` tokens."""

    def __init__(self, tokens: torch.Tensor, seq_len: int, count: Optional[int] = None) -> None:
        available = len(tokens) // seq_len
        count = available if count is None else min(count, available)
        self.windows = tokens[: count * seq_len].view(count, seq_len)

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.windows[index]


class RandomWindows(SizedDataset):
    """``length`` windows of ``seq_len`` tokens at offsets drawn once from a seeded generator."""

    def __init__(self, corpus: torch.Tensor, seq_len: int, length: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.corpus, self.seq_len = corpus, seq_len
        self.offsets = torch.randint(0, len(corpus) - seq_len, (length,), generator=generator)

    def __len__(self) -> int:
        return len(self.offsets)

    def __getitem__(self, index: int) -> torch.Tensor:
        start = int(self.offsets[index])
        return self.corpus[start : start + self.seq_len]


ConsecutiveWindows = PackedWindows


class StreamOrder:
    """The global stream's window at each position: epoch after epoch, each a seeded permutation of the windows."""

    def __init__(self, windows: int, seed: int) -> None:
        self.windows, self.seed = windows, seed
        self._epoch, self._order = -1, torch.empty(0, dtype=torch.long)

    def __call__(self, position: int) -> int:
        epoch = position // self.windows
        if epoch != self._epoch:
            generator = torch.Generator().manual_seed(self.seed + epoch)
            self._epoch, self._order = epoch, torch.randperm(self.windows, generator=generator)
        return int(self._order[position % self.windows])


class StreamSampler(Sampler[Any]):
    """This rank's share of the global stream (:class:`StreamOrder`): global micro-batch ``b`` takes positions
    ``b * batch * ranks`` onwards, this rank its own ``batch`` of them. Yields micro-batches ``start()`` to
    ``stop - 1``; ``start`` is read when the iteration begins (a heal before the first batch moves it). ``keyed``:
    each window comes as ``(micro-batch, window)``, for a dataset whose items depend on their step.

    Its length is the whole stream's, ``stop`` micro-batches, from the first: a run is one Lightning epoch however
    often it was resumed (every checkpoint is saved inside it), and a resumed Lightning counts the epoch's batches
    from where its checkpoint left off, so that epoch ends with the stream, at ``max_steps``."""

    def __init__(
        self,
        windows: int,
        batch: int,
        ranks: int,
        rank: int,
        seed: int,
        start: Callable[[], int],
        stop: int,
        keyed: bool = False,
    ) -> None:
        self.batch, self.ranks, self.rank = batch, ranks, rank
        self.order, self.start, self.stop, self.keyed = StreamOrder(windows, seed), start, stop, keyed

    def __len__(self) -> int:
        return self.stop * self.batch

    def __iter__(self) -> Iterator[Any]:
        for micro_batch in range(self.start(), self.stop):
            first = (micro_batch * self.ranks + self.rank) * self.batch
            for position in range(first, first + self.batch):
                window = self.order(position)
                yield (micro_batch, window) if self.keyed else window


class StreamLoader(DataLoader):
    """The training loader, resumable: its position is the restored step (``StreamSampler``'s start), so its own
    state is empty. Declaring it (Lightning's ``state_dict``/``load_state_dict`` protocol) tells Lightning that a
    checkpoint saved inside the epoch resumes exactly; it would warn otherwise."""

    def state_dict(self) -> Dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        pass


class TextCorpus(pl.LightningDataModule):
    """Packed windows of the recipe's text: the training stream for ``micro_batches`` micro-batches, and a fixed
    held-out set (sharded over the data-parallel ranks)."""

    def __init__(self, data: DataSection, seed: int, micro_batches: int) -> None:
        super().__init__()
        self.data, self.seed, self.micro_batches = data, seed, micro_batches
        self.tokenizer = make_tokenizer(data.tokenizer, data.trust_remote_code)
        self.train_set: Optional[SizedDataset] = None
        self.val_set: Optional[SizedDataset] = None
        self.collate: Optional[Callable[[List[Any]], Any]] = None
        """How items become a micro-batch (None: torch's default collate, every item's tensors stacked)."""

    @override
    def setup(self, stage: str) -> None:
        data = self.data
        train, held_out = split_documents(read_documents(data), self.tokenizer, data.held_out_every, data.max_bytes)
        problem = window_problem(len(train), len(held_out), data, self._data_parallel()[0])
        if problem is not None:  # the launcher checked the same before any process started
            raise ValueError(problem)
        self.train_set = PackedWindows(train, data.seq_len)
        self.val_set = PackedWindows(held_out, data.seq_len, data.val_windows)

    def _launched(self) -> pl.Trainer:
        assert self.trainer is not None, "the data module is used by a Trainer"
        return self.trainer

    def _data_parallel(self, evaluation: bool = False) -> Tuple[int, int]:
        """The ranks the training stream splits over (under fault tolerance every replica group's), or with
        ``evaluation`` this replica group's own: each group evaluates the whole held-out set."""
        strategy = self._launched().strategy
        assert isinstance(strategy, ParallelStrategy)
        kwargs = strategy.group_sampler_kwargs if evaluation and isinstance(strategy, MixedFSDP2Mixin) else None
        kwargs = kwargs or strategy.distributed_sampler_kwargs
        return kwargs["num_replicas"], kwargs["rank"]

    @override
    def train_dataloader(self) -> DataLoader:
        ranks, rank = self._data_parallel()
        # restored before this hook runs: a resumed run starts after the micro-batches its checkpoint consumed
        # (discarded fault-tolerant steps' included), a healed one after the live group's
        trainer = self._launched()
        if micro_batches_consumed(trainer) < self.micro_batches:
            # a run extended from its final checkpoint: that checkpoint's batch was the last of the shorter stream,
            # and Lightning, restoring that mark, would end the epoch and the fit before training; the stream goes on
            trainer.fit_loop.epoch_loop.batch_progress.is_last_batch = False
        batch = self.data.batch_size
        start = partial(micro_batches_consumed, trainer)
        dataset = self._training_set(ranks)
        sampler = StreamSampler(
            len(dataset), batch, ranks, rank, self.seed, start, self.micro_batches, keyed=self.keyed_stream
        )
        return StreamLoader(dataset, batch_size=batch, sampler=sampler, drop_last=True, collate_fn=self.collate)

    keyed_stream = False
    """Whether the training set takes ``(micro-batch, window)`` keys (``StreamSampler``'s ``keyed``)."""

    def _training_set(self, ranks: int) -> "SizedDataset":
        """What the training stream draws from, split over ``ranks`` data-parallel ranks."""
        assert self.train_set is not None
        return self.train_set

    @override
    def val_dataloader(self) -> DataLoader:
        ranks, rank = self._data_parallel(evaluation=True)
        assert self.val_set is not None
        # an equal share per rank: each forward all-gathers, so a rank with one more batch would wait forever
        windows = len(self.val_set) - len(self.val_set) % ranks
        subset = Subset(self.val_set, range(rank, windows, ranks))
        return DataLoader(subset, batch_size=self.data.batch_size, collate_fn=self.collate)

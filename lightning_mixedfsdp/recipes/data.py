"""Training text: the embedded corpus (the Python standard library's own source files, on every machine with Python)
or the user's ``.txt``/``.jsonl`` files, tokenized to bytes or by a local HF tokenizer, packed into windows.

Documents are split by position: every ``held_out_every``-th document is held out for evaluation, so no held-out
token is ever trained on. The training order is a pure function of the seed and the global micro-batch index, and a
resumed run starts where the checkpoint's optimizer step left off: it sees exactly the stream the uninterrupted run
saw (no dependence on Lightning's sampler epochs or on batches prefetched before a save).
"""

import json
import sysconfig
from pathlib import Path
from typing import Any, Iterator, List, Optional, Tuple, Union

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import ParallelStrategy
from torch.utils.data import DataLoader, Dataset, Sampler, Subset

from lightning_mixedfsdp.recipes.inputs import data_files
from lightning_mixedfsdp.recipes.schema import DataSection

Document = Union[str, bytes]


def stdlib_files() -> List[Path]:
    """The standard library's ``.py`` files in a stable order (installed packages excluded)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and "dist-packages" not in p.parts)


def split_corpus(files: List[Path], held_out_every: int, max_bytes: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Concatenated bytes of the training files and of the held-out files, each capped at ``max_bytes``."""
    documents = (path.read_bytes() for path in files)
    return split_documents(documents, ByteTokenizer(), held_out_every, max_bytes)


class ByteTokenizer:
    """Bytes as tokens (vocabulary 256); documents are separated by a blank line."""

    vocab_size = 256

    def encode(self, document: Document) -> List[int]:
        data = document if isinstance(document, bytes) else document.encode("utf-8")
        return list(data + b"\n\n")


class HFTokenizer:
    """A local Hugging Face tokenizer; each document ends with its EOS token when it has one."""

    def __init__(self, directory: str) -> None:
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(directory)
        self.vocab_size = len(self.tokenizer)

    def encode(self, document: Document) -> List[int]:
        text = document.decode("utf-8", errors="replace") if isinstance(document, bytes) else document
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        eos = self.tokenizer.eos_token_id
        return ids + ([eos] if eos is not None else [])

    def save_pretrained(self, directory: Union[str, Path]) -> None:
        self.tokenizer.save_pretrained(str(directory))


def make_tokenizer(spec: str) -> Union[ByteTokenizer, HFTokenizer]:
    return ByteTokenizer() if spec == "bytes" else HFTokenizer(spec)


def read_documents(data: DataSection) -> Iterator[Document]:
    """The stdlib files as bytes, or each ``.txt`` file and each ``.jsonl`` line's text field, in a stable order."""
    files, _ = data_files(data)
    if not data.files:
        yield from (path.read_bytes() for path in stdlib_files())
        return
    for path in files:
        if path.suffix == ".txt":
            yield path.read_text(encoding="utf-8")
        else:
            with path.open(encoding="utf-8") as lines:
                yield from (json.loads(line)[data.text_field] for line in lines if line.strip())


def split_documents(
    documents: Iterator[Document], tokenizer: Any, held_out_every: int, max_bytes: int
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Token ids of the training documents and of the held-out ones (every ``held_out_every``-th), each split capped
    at ``max_bytes`` of text."""
    splits: Tuple[List[int], List[int]] = ([], [])
    sizes = [0, 0]
    for index, document in enumerate(documents):
        split = 1 if index % held_out_every == 0 else 0
        if sizes[split] >= max_bytes:
            if min(sizes) >= max_bytes:
                break
            continue
        sizes[split] += len(document)
        splits[split].extend(tokenizer.encode(document))
    return torch.tensor(splits[0], dtype=torch.long), torch.tensor(splits[1], dtype=torch.long)


class PackedWindows(Dataset):
    """Consecutive non-overlapping windows of ``seq_len`` tokens."""

    def __init__(self, tokens: torch.Tensor, seq_len: int, count: Optional[int] = None) -> None:
        available = len(tokens) // seq_len
        count = available if count is None else min(count, available)
        self.windows = tokens[: count * seq_len].view(count, seq_len)

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.windows[index]


class RandomWindows(Dataset):
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


class StreamSampler(Sampler[int]):
    """This rank's share of a global stream of window indices: epoch after epoch, each a seeded permutation of the
    windows; global micro-batch ``b`` takes positions ``b * batch * ranks`` onwards, this rank its own ``batch``
    of them. Starts at micro-batch ``start`` and stops before ``stop``."""

    def __init__(self, windows: int, batch: int, ranks: int, rank: int, seed: int, start: int, stop: int) -> None:
        self.windows, self.batch, self.ranks, self.rank = windows, batch, ranks, rank
        self.seed, self.start, self.stop = seed, start, stop

    def __len__(self) -> int:
        return max(self.stop - self.start, 0) * self.batch

    def __iter__(self) -> Iterator[int]:
        epoch, order = -1, torch.empty(0, dtype=torch.long)
        for micro_batch in range(self.start, self.stop):
            first = (micro_batch * self.ranks + self.rank) * self.batch
            for position in range(first, first + self.batch):
                if position // self.windows != epoch:
                    epoch = position // self.windows
                    order = torch.randperm(self.windows, generator=torch.Generator().manual_seed(self.seed + epoch))
                yield int(order[position % self.windows])


class TextCorpus(pl.LightningDataModule):
    """Packed windows of the recipe's text: the training stream for ``micro_batches`` micro-batches, and a fixed
    held-out set (sharded over the data-parallel ranks)."""

    def __init__(self, data: DataSection, seed: int, micro_batches: int) -> None:
        super().__init__()
        self.data, self.seed, self.micro_batches = data, seed, micro_batches
        self.tokenizer = make_tokenizer(data.tokenizer)
        self.train_set: Optional[PackedWindows] = None
        self.val_set: Optional[PackedWindows] = None

    def setup(self, stage: str) -> None:
        data = self.data
        train, held_out = split_documents(read_documents(data), self.tokenizer, data.held_out_every, data.max_bytes)
        self.train_set = PackedWindows(train, data.seq_len)
        self.val_set = PackedWindows(held_out, data.seq_len, data.val_windows)
        if len(self.train_set) == 0 or len(self.val_set) == 0:
            raise ValueError(
                f"TextCorpus: {len(train)} training and {len(held_out)} held-out tokens give no full window of"
                f" data.seq_len={data.seq_len}; add text, lower data.seq_len or data.held_out_every."
            )

    def _launched(self) -> pl.Trainer:
        assert self.trainer is not None, "the data module is used by a Trainer"
        return self.trainer

    def _data_parallel(self) -> Tuple[int, int]:
        strategy = self._launched().strategy
        assert isinstance(strategy, ParallelStrategy)
        kwargs = strategy.distributed_sampler_kwargs
        return kwargs["num_replicas"], kwargs["rank"]

    def train_dataloader(self) -> DataLoader:
        ranks, rank = self._data_parallel()
        # restored before this hook runs: a resumed run starts after the micro-batches its checkpoint consumed
        trainer = self._launched()
        start = trainer.global_step * trainer.accumulate_grad_batches
        assert self.train_set is not None
        batch = self.data.batch_size
        sampler = StreamSampler(len(self.train_set), batch, ranks, rank, self.seed, start, self.micro_batches)
        return DataLoader(self.train_set, batch_size=batch, sampler=sampler, drop_last=True)

    def val_dataloader(self) -> DataLoader:
        ranks, rank = self._data_parallel()
        assert self.val_set is not None
        return DataLoader(Subset(self.val_set, range(rank, len(self.val_set), ranks)), batch_size=self.data.batch_size)

"""The embedded corpus: the Python standard library's own source files, read as bytes.

Every machine with Python has it, so the main job needs no download. Files are split by position in the sorted
list: every ``held_out_every``-th file is held out for evaluation, so no held-out byte is ever trained on.
"""

import sysconfig
from pathlib import Path
from typing import List, Optional, Tuple

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset


def stdlib_files() -> List[Path]:
    """The standard library's ``.py`` files in a stable order (installed packages excluded)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and "dist-packages" not in p.parts)


def split_corpus(files: List[Path], held_out_every: int, max_bytes: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Concatenated bytes of the training files and of the held-out files, each capped at ``max_bytes``."""
    parts: Tuple[List[bytes], List[bytes]] = ([], [])
    sizes = [0, 0]
    for index, path in enumerate(files):
        split = 1 if index % held_out_every == 0 else 0
        if sizes[split] >= max_bytes:
            continue
        data = path.read_bytes() + b"\n\n"
        parts[split].append(data)
        sizes[split] += len(data)
    train, held_out = (torch.frombuffer(bytearray(b"".join(p)[:max_bytes]), dtype=torch.uint8) for p in parts)
    return train.long(), held_out.long()


class RandomWindows(Dataset):
    """``length`` windows of ``seq_len`` bytes at offsets drawn once from a seeded generator."""

    def __init__(self, corpus: torch.Tensor, seq_len: int, length: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.corpus, self.seq_len = corpus, seq_len
        self.offsets = torch.randint(0, len(corpus) - seq_len, (length,), generator=generator)

    def __len__(self) -> int:
        return len(self.offsets)

    def __getitem__(self, index: int) -> torch.Tensor:
        start = int(self.offsets[index])
        return self.corpus[start : start + self.seq_len]


class ConsecutiveWindows(Dataset):
    """Non-overlapping windows from the start of the corpus: a fixed evaluation set."""

    def __init__(self, corpus: torch.Tensor, seq_len: int, count: int) -> None:
        count = min(count, len(corpus) // seq_len)
        self.windows = corpus[: count * seq_len].view(count, seq_len)

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.windows[index]


class StdlibCorpus(pl.LightningDataModule):
    def __init__(
        self,
        seq_len: int,
        batch_size: int,
        train_samples: int,
        val_windows: int,
        held_out_every: int = 10,
        max_bytes: int = 4_000_000,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.seq_len, self.batch_size = seq_len, batch_size
        self.train_samples, self.val_windows = train_samples, val_windows
        self.held_out_every, self.max_bytes, self.seed = held_out_every, max_bytes, seed
        self.train_set: Optional[Dataset] = None
        self.val_set: Optional[Dataset] = None

    def setup(self, stage: str) -> None:
        train, held_out = split_corpus(stdlib_files(), self.held_out_every, self.max_bytes)
        self.train_set = RandomWindows(train, self.seq_len, self.train_samples, self.seed)
        self.val_set = ConsecutiveWindows(held_out, self.seq_len, self.val_windows)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=False, drop_last=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.batch_size, shuffle=False)

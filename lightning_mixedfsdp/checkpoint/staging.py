"""Exports committed as a whole: every file of an export (weights, index, config, tokenizer, adapter) is written into a
hidden folder beside the target and moved into place by rename once all of it is written. A failed export removes
its staging folder and leaves the previous export as it was; a killed one leaves the previous export as it was and
its staging folder, which the next export into the same place removes. Files of the user's in the previous export
folder (anything that is not an export's weights or index and that the new export does not write) are carried into
the new one; stale weight shards of the previous export are not."""

import os
import shutil
import uuid
from pathlib import Path
from typing import List, Optional

_WEIGHT_SUFFIXES = (".safetensors",)
_WEIGHT_NAMES = ("model.safetensors.index.json",)


class StagedFolder:
    """One export's staging folder; only the writing rank acts (``writer``), the other ranks' calls do nothing."""

    def __init__(self, target: Path, writer: bool) -> None:
        self.target = target
        self.writer = writer
        self.token = uuid.uuid4().hex[:12]
        self.path: Optional[Path] = None

    def open(self) -> Optional[Path]:
        """Finish a commit a kill interrupted, remove the staging folders killed exports left, and make this one.
        Returns the staging folder on the writer."""
        if not self.writer:
            return None
        parent = self.target.parent
        parent.mkdir(parents=True, exist_ok=True)
        self._recover()
        for stale in parent.glob(f".{self.target.name}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        self.path = parent / f".{self.target.name}.tmp-{self.token}"
        self.path.mkdir()
        return self.path

    def commit(self) -> List[Path]:
        """Move the finished export into place (the previous one set aside first, then removed, the user's files in
        it carried over); returns what the export wrote, at its final paths."""
        if not self.writer or self.path is None:
            return []
        written = sorted(entry.name for entry in self.path.iterdir())
        old: Optional[Path] = None
        if self.target.exists() or self.target.is_symlink():
            old = self.target.with_name(f".{self.target.name}.old-{self.token}")
            os.rename(self.target, old)
        try:
            os.rename(self.path, self.target)
        except OSError:
            if old is not None:
                os.rename(old, self.target)
            raise
        self.path = None
        if old is not None:
            _retire(old, self.target, set(written))
        return [self.target / name for name in written]

    def discard(self) -> None:
        """Remove the staging folder of an export that failed (the previous export stays as it was)."""
        if self.writer and self.path is not None:
            shutil.rmtree(self.path, ignore_errors=True)
            self.path = None

    def _recover(self) -> None:
        """A kill between a commit's two renames left the previous export aside and nothing in place: put it back."""
        previous = sorted(self.target.parent.glob(f".{self.target.name}.old-*"), key=lambda p: p.stat().st_mtime)
        if previous and not self.target.exists():
            os.rename(previous.pop(), self.target)
        for old in previous:
            _retire(old, self.target, set())


def _retire(old: Path, target: Path, written: set) -> None:
    """Carry the user's files from the previous export folder into the new one, then remove the rest of it."""
    if old.is_dir() and target.is_dir():
        for entry in old.iterdir():
            is_weights = entry.name in _WEIGHT_NAMES or entry.suffix in _WEIGHT_SUFFIXES
            if not is_weights and entry.name not in written and not (target / entry.name).exists():
                os.rename(entry, target / entry.name)
        shutil.rmtree(old, ignore_errors=True)
    elif old.exists() or old.is_symlink():
        old.unlink()

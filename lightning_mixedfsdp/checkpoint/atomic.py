"""Atomic commits of Lightning's saves: written beside the target, moved into place by rename."""

import os
import shutil
from pathlib import Path
from typing import Union


def is_sharded_checkpoint(path: Path) -> bool:
    """A torch DCP folder: its ``.metadata`` file is written last, so its presence means the save completed."""
    return path.is_dir() and (path / ".metadata").is_file()


def temp_sibling(path: Path, token: str) -> Path:
    """Where a save is written before it is committed: beside ``path``, hidden, unique per save."""
    return path.with_name(f".{path.name}.tmp-{token}")


def commit(temp: Path, path: Path, token: str) -> None:
    """Move a finished save into place. A file replaces a file atomically; otherwise the old checkpoint is renamed
    aside first and removed only after the new one is in place, so a kill at any moment leaves a complete one."""
    if path.is_file() and temp.is_file():
        os.replace(temp, path)
    elif path.exists():
        old = path.with_name(f".{path.name}.old-{token}")
        os.rename(path, old)
        os.rename(temp, path)
        remove_path(old)
    else:
        os.rename(temp, path)
    for stale in path.parent.glob(f".{path.name}.tmp-*"):
        remove_path(stale)


def recover(path: Path) -> None:
    """If a kill fell between the two renames of :func:`commit`, put the previous checkpoint back at ``path``."""
    if path.exists():
        return
    previous = sorted(path.parent.glob(f".{path.name}.old-*"), key=lambda p: p.stat().st_mtime)
    if previous:
        os.rename(previous[-1], path)


def remove_path(path: Union[str, Path]) -> None:
    """Delete a checkpoint file or folder, if present."""
    path = Path(path)
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()

"""Atomic commits of Lightning's saves: written beside the target, moved into place by rename.

A save never deletes a file it did not write. Saving into an existing folder keeps every file in it that is not part
of a checkpoint (a checkpoint's files: torch DCP's ``.metadata`` and ``*.distcp``, Lightning's ``meta.pt``), as
Lightning's own ``save_checkpoint`` does; and a kill at any moment leaves the previous checkpoint loadable.
"""

import os
import uuid
from pathlib import Path
from typing import Any, Callable, List, Union

from lightning_mixedfsdp.distributed.agreement import Agreement

PathLike = Union[str, Path]
"""What Lightning's own checkpoint paths accept (``lightning.fabric.utilities.types._PATH``)."""

DCP_METADATA = ".metadata"
LIGHTNING_METADATA_FILENAME = "meta.pt"
"""The file of a Lightning sharded checkpoint beside DCP's own: everything but the model and optimizers (Lightning
2.6's ``_METADATA_FILENAME``; ``strategies/lightning_compat.py`` reads Lightning's, a test checks they agree)."""
_CHECKPOINT_FILE_NAMES = (DCP_METADATA, LIGHTNING_METADATA_FILENAME)
_CHECKPOINT_FILE_SUFFIXES = (".distcp",)


def save_atomically(
    path: PathLike,
    write: Callable[[Path], None],
    single_file: bool,
    broadcast: Callable[[Any], Any],
    barrier: Callable[[], None],
    is_rank_zero: bool,
    owner: str,
) -> None:
    """Write a save with ``write`` beside ``path`` on every rank, then commit it by rename on rank 0: a kill leaves a
    whole checkpoint, and the user's files in an existing folder stay. ``broadcast`` and ``barrier`` are the
    strategy's collectives; ``single_file`` is a save that replaces ``path`` with one file (not a sharded folder)."""
    path = Path(broadcast(path))
    if path.is_dir() and single_file:
        if not is_sharded_checkpoint(path):
            raise IsADirectoryError(f"The checkpoint path exists and is a directory: {path}")
        foreign = foreign_entries(path)
        if foreign:
            raise IsADirectoryError(
                f"{owner}: replacing the sharded checkpoint {str(path)!r} with a single file would remove files it"
                f" did not write: {[e.name for e in foreign[:5]]}. Move them out, or save to another path."
            )
    token = broadcast(uuid.uuid4().hex[:12])
    temp = temp_sibling(path, token)
    write(temp)
    barrier()
    # a commit that fails on rank 0 (no permission to rename) reaches every rank: none waits in a barrier for it
    agreement = Agreement(f"{owner}: committing the checkpoint {str(path)!r}")
    with agreement.local():
        if is_rank_zero:
            commit(temp, path, token)
    agreement.agree()


def recovered(path: PathLike, broadcast: Callable[[Any], Any], barrier: Callable[[], None], is_rank_zero: bool) -> Path:
    """``path`` (rank 0's), with an interrupted commit finished first (the previous checkpoint put back if needed)."""
    path = Path(broadcast(path))
    agreement = Agreement(f"recovering the checkpoint {str(path)!r}")
    with agreement.local():
        if is_rank_zero:
            recover(path)
    agreement.agree()
    return path


def is_sharded_checkpoint(path: Path) -> bool:
    """A sharded checkpoint folder: torch DCP's ``.metadata`` or Lightning's ``meta.pt`` (Lightning's own test of a
    sharded checkpoint) is in it."""
    return path.is_dir() and any((path / name).is_file() for name in _CHECKPOINT_FILE_NAMES)


def is_checkpoint_file(path: Path) -> bool:
    """A file a sharded save writes (and so may replace or remove)."""
    return path.is_file() and (path.name in _CHECKPOINT_FILE_NAMES or path.suffix in _CHECKPOINT_FILE_SUFFIXES)


def foreign_entries(folder: Path) -> List[Path]:
    """What a folder holds besides a checkpoint's files: the user's, never removed by a save."""
    if not folder.is_dir():
        return []
    return sorted(entry for entry in folder.iterdir() if not is_checkpoint_file(entry))


def temp_sibling(path: Path, token: str) -> Path:
    """Where a save is written before it is committed: beside ``path``, hidden, unique per save."""
    return path.with_name(f".{path.name}.tmp-{token}")


def commit(temp: Path, path: Path, token: str) -> None:
    """Move a finished save into place. A file replaces a file atomically; otherwise the old checkpoint is renamed
    aside first, the new one renamed into place, the user's files carried over from the old folder, and only the old
    checkpoint's own files removed, so a kill at any moment leaves a complete checkpoint and every user file."""
    if not path.exists() or (path.is_file() and temp.is_file()):
        os.replace(temp, path)
    else:
        old = path.with_name(f".{path.name}.old-{token}")
        os.rename(path, old)
        os.rename(temp, path)
        _retire(old, path)
    for stale in path.parent.glob(f".{path.name}.tmp-*"):
        remove_path(stale)


def recover(path: Path) -> None:
    """Finish a commit a kill interrupted: put the previous checkpoint back at ``path`` if the kill fell between the
    two renames, else carry the user's files out of the folder set aside and remove its checkpoint files."""
    previous = sorted(path.parent.glob(f".{path.name}.old-*"), key=lambda p: p.stat().st_mtime)
    if previous and not path.exists():
        os.rename(previous.pop(), path)
    for old in previous:
        _retire(old, path)


def remove_path(path: PathLike) -> None:
    """Delete a checkpoint file, or a checkpoint folder's own files (the folder too, once nothing else is in it)."""
    path = Path(path)
    if path.is_dir() and not path.is_symlink():
        for entry in path.iterdir():
            if is_checkpoint_file(entry):
                entry.unlink()
        if not any(path.iterdir()):
            path.rmdir()
    elif path.exists() or path.is_symlink():
        path.unlink()


def _retire(old: Path, path: Path) -> None:
    """Remove a replaced checkpoint, first moving the user's files in it into the new checkpoint folder at ``path``
    (a full-file save over a folder holding user files is refused before anything is written)."""
    if old.is_dir() and path.is_dir():
        for entry in foreign_entries(old):
            if not (path / entry.name).exists():
                os.rename(entry, path / entry.name)
    remove_path(old)

"""The run's console output, kept in the run folder: what the launching process prints (the dtype report, Lightning's
messages, perplexities, checkpoints, warnings, a traceback) is also appended to ``console.log``, launch after launch;
another rank that prints anything writes ``console.rank{N}.log``.

Python-level: ``sys.stdout``, ``sys.stderr`` and the logging handlers that wrote to them are teed (output that C++
code writes to the file descriptors directly is not). The terminal gets exactly what it got before; the file gets
no progress-bar redraws (writes that move the cursor) and no colour codes.
"""

import logging
import re
import sys
import time
from pathlib import Path
from typing import Any, Dict, Optional, TextIO, Union

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ProgressBar, RichProgressBar, TQDMProgressBar
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from lightning_mixedfsdp.strategies.lightning_compat import rich_available

_REDRAW = re.compile(r"\x1b\[[0-9;?]*[A-HJKSTfhl]|\r(?!\n)")
"""Cursor movement, erasing, showing or hiding the cursor, a carriage return that rewrites the line."""
_STYLE = re.compile(r"\x1b\[[0-9;]*m|\x1b\]8;[^\x1b\x07]*(?:\x07|\x1b\\)")
"""Colours and hyperlinks."""


class LogFile:
    """Appends what is written to it, opened on the first text worth keeping."""

    def __init__(self, path: Path, header: str) -> None:
        self.path, self.header = path, header
        self._file: Optional[TextIO] = None

    def write(self, text: str) -> None:
        if _REDRAW.search(text):
            return  # a progress bar redrawing itself; its final state is printed without redraws when not a TTY
        text = _STYLE.sub("", text)
        if not text:
            return
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.path.open("a", encoding="utf-8", buffering=1)
            self._file.write(self.header)
        self._file.write(text)


class Tee:
    """A text stream that writes to ``stream`` and to a :class:`LogFile`; everything else is ``stream``'s (a
    progress bar still sees the terminal it draws on)."""

    def __init__(self, stream: TextIO, log: LogFile) -> None:
        self._stream, self._log = stream, log

    def write(self, text: str) -> int:
        written = self._stream.write(text)
        self._log.write(text)
        return written

    def flush(self) -> None:
        self._stream.flush()

    def isatty(self) -> bool:
        return self._stream.isatty()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def process_rank() -> int:
    """This process's global rank as Lightning reads it from the environment at import (0 in the launching process,
    the rank its launcher gave it in the others)."""
    return int(getattr(rank_zero_only, "rank", 0))


def keep_console(run_folder: Path, rank: int) -> Path:
    """Tee this process's console into the run folder; returns the log file's path."""
    name = "console.log" if rank == 0 else f"console.rank{rank}.log"
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    log = LogFile(run_folder / name, f"===== {started}: {' '.join(sys.orig_argv)} =====\n")
    originals = {id(sys.stdout): sys.stdout, id(sys.stderr): sys.stderr}
    tees = {key: Tee(stream, log) for key, stream in originals.items()}
    sys.stdout, sys.stderr = tees[id(sys.stdout)], tees[id(sys.stderr)]
    # handlers made before this (Lightning's, at import) hold the original streams themselves
    loggers = [logging.getLogger(), *(lg for lg in logging.Logger.manager.loggerDict.values())]
    for logger in loggers:
        for handler in getattr(logger, "handlers", []):
            if isinstance(handler, logging.StreamHandler) and id(handler.stream) in tees:
                handler.setStream(tees[id(handler.stream)])
    return log.path


class _WithoutVersion(ProgressBar):
    """A progress bar without the logger's version (Lightning's ``v_num``): the run folder's ``logs/version_N``
    already says which launch it is, and Rich's bar prints the number as a float (``v_num: 0.000``)."""

    def get_metrics(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule"
    ) -> Dict[str, Union[int, str, float, Dict[str, float]]]:
        items = super().get_metrics(trainer, pl_module)
        items.pop("v_num", None)
        return items


class RichBar(_WithoutVersion, RichProgressBar):
    """Rich's progress bar without ``v_num``."""


class TQDMBar(_WithoutVersion, TQDMProgressBar):
    """tqdm's progress bar without ``v_num``."""


def progress_bar() -> ProgressBar:
    """The bar the Trainer would pick by itself (Rich's where rich is installed, else tqdm's), without ``v_num``."""
    return RichBar() if rich_available() else TQDMBar()

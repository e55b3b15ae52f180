"""The optional packages the library and the app import only when a setting needs them (peft, torchao, torchft,
transformers, matplotlib, tensorboard, wandb): the one install line every message about a missing one gives, whether
one is installed, and their lazy imports turned into that message. Nothing here imports any of them."""

import importlib.util
from contextlib import contextmanager
from typing import Iterator, Optional

EXTRAS = {"peft": "peft", "torchao": "qlora", "torchft": "ft", "transformers": "hf", "matplotlib": "recipes"}
"""The ``lightning-mixedfsdp`` extra that installs each package (``pyproject.toml``); tensorboard and wandb are no
extra's."""
PINNED = {"torchft": "torchft==0.2.0"}
"""The packages the extras pin, as pip installs them alone (the ``ft`` extra's torchft release)."""


def install_line(package: str, extra: Optional[str] = None) -> str:
    """How to install ``package``: through its extra (``extra``, else the package's own) and on its own, e.g.
    ``pip install 'lightning-mixedfsdp[peft]'  (or: pip install peft)``; ``pip install wandb`` without an extra."""
    extra = extra or EXTRAS.get(package)
    alone = f"pip install {PINNED.get(package, package)}"
    return f"pip install 'lightning-mixedfsdp[{extra}]'  (or: {alone})" if extra else alone


def installed(package: str) -> bool:
    """Whether ``package`` can be imported (found on the path, without importing it)."""
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):  # blocked as None in sys.modules, or a broken package
        return False


def missing_message(package: str, needed_for: str, extra: Optional[str] = None) -> str:
    """``<needed_for> needs <package>, which is not installed: <install line>``."""
    return f"{needed_for} needs {package}, which is not installed: {install_line(package, extra)}"


class MissingPackage(ModuleNotFoundError):
    """An optional package a setting needs is not installed; the message names the setting and the install line."""


@contextmanager
def optional_import(package: str, needed_for: str, extra: Optional[str] = None) -> Iterator[None]:
    """Around a lazy import of ``package`` (or one of its modules): when the package is not installed, raise
    :class:`MissingPackage` naming ``needed_for`` (the setting, flag or function that needs it) and the install line.
    An import error of an installed package (a broken install, a module a release moved) is raised as it is."""
    try:
        yield
    except ImportError as err:
        if installed(package):
            raise
        raise MissingPackage(missing_message(package, needed_for, extra), name=package) from err

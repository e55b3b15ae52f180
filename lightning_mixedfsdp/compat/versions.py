"""What the absence of a private API says: the installed release is outside the range the compat modules were
checked on. Every private attribute or module they read goes through :func:`private` (or raises
:func:`gone` itself) instead of falling back to a default, so an upstream removal is an error naming the attribute
and the version, never a silent change of behaviour."""

import importlib.metadata
from typing import Any

TESTED = {"torch": "2.11 to 2.15", "transformers": "5.23 to 5.25"}
"""The ranges pyproject.toml declares and CI tests at both ends."""


class UnsupportedVersion(RuntimeError):
    """A private API this library reads is gone from the installed release."""


def installed_version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def gone(package: str, what: str) -> UnsupportedVersion:
    """The error for ``what`` (``ClassName._attribute``, ``module.function``) missing from ``package``."""
    return UnsupportedVersion(
        f"lightning_mixedfsdp reads {what}, which {package} {installed_version(package)} does not have: this release"
        f" is outside the tested range ({package} {TESTED.get(package, 'see pyproject.toml')}); install a release in"
        " that range, or report the version so the compat module can follow it."
    )


def private(obj: Any, name: str, package: str) -> Any:
    """``obj.name``, a private attribute of ``package``'s; :class:`UnsupportedVersion` when it is gone."""
    try:
        return getattr(obj, name)
    except AttributeError:
        owner = obj.__name__ if isinstance(obj, type) else type(obj).__name__
        raise gone(package, f"{owner}.{name}") from None

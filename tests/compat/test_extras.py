"""The install line of a missing optional package, and an installed package's own import errors left as they are."""

import sys

import pytest

from lightning_mixedfsdp.compat.extras import MissingPackage, optional_import


def test_a_missing_package_names_the_setting_and_the_install_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torchft", None)  # as if not installed
    with pytest.raises(MissingPackage) as missing:
        with optional_import("torchft", "fault_tolerance"):
            import torchft.coordination  # noqa: F401
    assert str(missing.value) == (
        "fault_tolerance needs torchft, which is not installed: pip install 'lightning-mixedfsdp[ft]'  (or: pip"
        " install torchft==0.2.0)"
    )
    assert isinstance(missing.value, ModuleNotFoundError) and missing.value.name == "torchft"


def test_an_import_error_of_an_installed_package_is_raised_as_it_is() -> None:
    with pytest.raises(ModuleNotFoundError, match=r"No module named 'json.no_such_module'") as error:
        with optional_import("json", "reading"):
            import json.no_such_module  # noqa: F401
    assert not isinstance(error.value, MissingPackage)

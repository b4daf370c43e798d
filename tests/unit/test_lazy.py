"""A package's names imported on first use (`eventbus.ops.lazy`), and eventbus's own."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest

from eventbus.ops.lazy import lazy_names


def test_a_name_is_imported_on_first_lookup_and_kept() -> None:
    namespace: dict[str, Any] = {"__name__": "pkg", "__all__": ["dumps"], "here": 1}
    getattr_, dir_ = lazy_names(namespace, {"dumps": "json"})
    import json

    assert getattr_("dumps") is json.dumps
    assert namespace["dumps"] is json.dumps
    assert dir_() == ["__all__", "__name__", "dumps", "here"]


def test_an_unlisted_name_raises_attribute_error_naming_the_package() -> None:
    getattr_, _ = lazy_names({"__name__": "pkg", "__all__": []}, {"dumps": "json"})
    with pytest.raises(AttributeError, match=r"module 'pkg' has no attribute 'loads'"):
        getattr_("loads")


def test_importing_eventbus_imports_no_bus_and_every_public_name_resolves() -> None:
    code = (
        "import sys, eventbus\n"
        "assert 'eventbus.app' not in sys.modules, 'eventbus.app imported'\n"
        "missing = [n for n in eventbus.__all__ if getattr(eventbus, n, None) is None]\n"
        "assert not missing, missing\n"
        "assert set(eventbus.__all__) <= set(dir(eventbus))\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)

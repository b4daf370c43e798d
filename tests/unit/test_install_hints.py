"""Importing an integration whose extra is not installed says which extra to install
(`eventbus.errors.extra_missing`): FastAPI, OpenTelemetry, SQLAlchemy for the outbox."""

from __future__ import annotations

import importlib
import sys

import pytest

from eventbus.errors import extra_missing


@pytest.mark.parametrize(
    ("module", "package", "extra"),
    [
        ("eventbus.fastapi", "fastapi", "fastapi"),
        ("eventbus.otel", "opentelemetry", "otel"),
        ("eventbus.outbox", "sqlalchemy", "outbox"),
    ],
)
def test_an_integration_without_its_extra_names_the_extra(
    module: str, package: str, extra: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in [m for m in sys.modules if m == package or m.startswith(f"{package}.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, package, None)  # `import package` raises ImportError
    monkeypatch.delitem(sys.modules, module, raising=False)

    with pytest.raises(ModuleNotFoundError) as caught:
        importlib.import_module(module)

    assert f"pip install 'eventbus[{extra}]'" in str(caught.value)
    assert caught.value.name == package
    monkeypatch.delitem(sys.modules, module, raising=False)  # a later import starts afresh


def test_the_hint_keeps_the_missing_module_name() -> None:
    error = extra_missing("eventbus.x", "x", ModuleNotFoundError("no", name="lib"))
    assert isinstance(error, ImportError) and error.name == "lib"
    assert "lib is not installed" in str(error)

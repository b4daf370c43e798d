"""A model spec (`eventbus.tier.typed.load_models`: the Spark source's ``model`` option and the
offloader's typed models): a module that raises at import, or a name that is no model, is a
`ConfigError` with a bounded message (not an untyped error, and an 11,738-character
message)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("pyarrow")
pytest.importorskip("obstore")

from eventbus.errors import ConfigError
from eventbus.tier.typed import load_models


def test_a_model_module_that_raises_at_import_is_a_config_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "broken_models_mod.py").write_text("raise RuntimeError('no database here')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match=r"cannot import model .*RuntimeError: no database here"):
        load_models("broken_models_mod:Event")
    sys.modules.pop("broken_models_mod", None)


def test_a_model_naming_an_odd_object_is_shown_cut_short() -> None:
    with pytest.raises(ConfigError, match="must name pydantic models") as caught:
        load_models("os:environ")  # a mapping whose repr is the whole environment
    assert len(str(caught.value)) < 200

"""``eventbus settings``: every setting with its value and source, passwords redacted; invalid
settings are one error line (no Redis needed)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from eventbus.cli import app
from eventbus.config import Settings

RUNNER = CliRunner()


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No EVENTBUS_* or REDIS_URL from outside; and the passwords these tests show the CLI
    (which scrubs them from all later output, `remember_url`) are forgotten afterwards."""
    import os

    import eventbus.ops.terminal

    for name in list(os.environ):
        if name.startswith("EVENTBUS_") or name == "REDIS_URL":
            monkeypatch.delenv(name)
    monkeypatch.setattr(eventbus.ops.terminal, "_URLS", set())


def _rows(output: str) -> dict[str, dict[str, object]]:
    return {row["setting"]: row for row in map(json.loads, output.splitlines())}


def test_values_and_sources_of_every_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EVENTBUS_SHARDS", "32")
    monkeypatch.setenv("REDIS_URL", "redis://app:s3cret@db.internal:6380/2")
    monkeypatch.setenv("EVENTBUS_SENTINEL_PASSWORD", "hunter2")
    result = RUNNER.invoke(app, ["settings", "--json"])
    assert result.exit_code == 0, result.output
    rows = _rows(result.output)
    assert list(rows) == list(Settings.model_fields)
    assert rows["shards"] | {"description": ""} == {
        "setting": "shards",
        "env": "EVENTBUS_SHARDS",
        "value": 32,
        "source": "environment",
        "description": "",
    }
    assert rows["redis_url"]["value"] == "redis://app:***@db.internal:6380/2"
    assert rows["sentinel_password"]["value"] == "***"
    assert rows["lock_interval_ms"]["value"] == 100
    assert rows["lock_interval_ms"]["source"] == "default"
    assert "s3cret" not in result.output and "hunter2" not in result.output
    assert all(row["description"] for row in rows.values())  # every setting says what it is


def test_the_option_overrides_the_environment_and_the_table_redacts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("REDIS_URL", "redis://:env-secret@a:6379/0")
    as_json = RUNNER.invoke(app, ["settings", "--json", "--redis-url", "redis://:opt@b:1/0"])
    assert _rows(as_json.output)["redis_url"] | {"description": ""} == {
        "setting": "redis_url",
        "env": "EVENTBUS_REDIS_URL or REDIS_URL",
        "value": "redis://:***@b:1/0",
        "source": "--redis-url",
        "description": "",
    }
    table = RUNNER.invoke(app, ["settings"], env={"COLUMNS": "200"})
    assert table.exit_code == 0 and "redis://:***@a:6379/0" in table.output
    assert "env-secret" not in table.output


def test_an_invalid_setting_is_one_error_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EVENTBUS_SHARDS", "0")
    result = RUNNER.invoke(app, ["settings"])
    assert result.exit_code == 1
    assert "shards" in result.output and "Traceback" not in result.output

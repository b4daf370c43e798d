"""``eventbus settings``: every setting with its value and source, passwords redacted; invalid
settings are one error line (no Redis needed)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from eventbus.cli import app
from eventbus.config import Settings
from eventbus.tier.settings import TierSettings

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
    assert "EVENTBUS_SHARDS" in result.output and "Traceback" not in result.output


def test_errors_name_the_variable_the_user_set(monkeypatch: pytest.MonkeyPatch) -> None:
    """``REDIS_URL`` was reported as ``EVENTBUS_REDIS_URL``, ``EVENTBUS_SHARDS`` as
    ``shards``: the error names the environment variable that holds the bad value."""
    monkeypatch.setenv("EVENTBUS_SHARDS", "0")
    monkeypatch.setenv("REDIS_URL", "http://somewhere:1/0")
    result = RUNNER.invoke(app, ["settings"])
    assert result.exit_code == 1
    text = " ".join(result.output.split())
    assert "REDIS_URL: Value error, invalid Redis URL" in text
    assert "EVENTBUS_REDIS_URL" not in text
    assert "EVENTBUS_SHARDS: Input should be greater than or equal to 1" in text


def test_a_misspelt_variable_is_warned_with_the_setting_it_resembles(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """``EVENTBUS_SHRADS=4`` was ignored without a word, ``eventbus settings`` included."""
    import eventbus.config.settings

    monkeypatch.setattr(eventbus.config.settings, "_warned", set())
    monkeypatch.setenv("EVENTBUS_SHRADS", "4")
    monkeypatch.setenv("EVENTBUS_UVLOOP", "0")  # read elsewhere: no warning
    monkeypatch.setenv("EVENTBUS_TIER_STORE_URL", "/tmp/x")  # the tier's settings
    monkeypatch.setenv("EVENTBUS_TIER_SEGMNT_MAX_AGE_S", "5")  # misspelt: the tier's family
    result = RUNNER.invoke(app, ["settings"])
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert text.count("EVENTBUS_SHRADS is not an eventbus setting") == 1
    assert "did you mean EVENTBUS_SHARDS?" in text
    assert "UVLOOP" not in text.replace("EVENTBUS_UVLOOP", "") and "is ignored" in text
    assert "EVENTBUS_TIER_STORE_URL is not" not in text and "EVENTBUS_UVLOOP is not" not in text
    assert (
        "EVENTBUS_TIER_SEGMNT_MAX_AGE_S is not an eventbus setting "
        "(did you mean EVENTBUS_TIER_SEGMENT_MAX_AGE_S?)" in text
    )
    monkeypatch.setattr(eventbus.config.settings, "_warned", set())
    with caplog.at_level("WARNING", logger="eventbus.config"):
        assert Settings().shards == 16  # the library logs it, once per process
        Settings()
        assert TierSettings().segment_max_age_s == 60.0  # the tier's family, warned by the tier
    assert [r.getMessage() for r in caplog.records] == [
        "EVENTBUS_SHRADS is not an eventbus setting (did you mean EVENTBUS_SHARDS?); it is ignored",
        "EVENTBUS_TIER_SEGMNT_MAX_AGE_S is not an eventbus setting "
        "(did you mean EVENTBUS_TIER_SEGMENT_MAX_AGE_S?); it is ignored",
    ]

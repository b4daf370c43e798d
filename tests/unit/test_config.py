"""Settings validation and the environment."""

from __future__ import annotations

import os

import pytest
from pydantic import ValidationError

from eventbus.config import Settings
from eventbus.config.environment import environment_settings


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("REDIS_URL", raising=False)
    for name in list(os.environ):
        if name.startswith("EVENTBUS_"):
            monkeypatch.delenv(name)


def test_defaults() -> None:
    s = Settings()
    assert s.redis_url == "redis://127.0.0.1:6379/0"
    assert (s.shards, s.start, s.cluster) == (16, "beginning", False)
    assert s.lease_s < s.liveness_ttl_s


def test_redis_url_alias(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REDIS_URL", "redis://example:1/2")
    assert Settings().redis_url == "redis://example:1/2"


def test_prefixed_redis_url_wins_over_plain(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REDIS_URL", "redis://plain:1/0")
    monkeypatch.setenv("EVENTBUS_REDIS_URL", "redis://prefixed:1/0")
    assert Settings().redis_url == "redis://prefixed:1/0"


def test_keyword_overrides_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REDIS_URL", "redis://env:1/0")
    assert Settings(redis_url="redis://kw:1/0").redis_url == "redis://kw:1/0"


def test_fields_from_prefixed_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EVENTBUS_SHARDS", "64")
    monkeypatch.setenv("EVENTBUS_LIVENESS_TTL_S", "2.5")
    monkeypatch.setenv("EVENTBUS_START", "now")
    monkeypatch.setenv("EVENTBUS_CLUSTER", "true")
    s = Settings()
    assert (s.shards, s.liveness_ttl_s, s.start, s.cluster) == (64, 2.5, "now", True)


@pytest.mark.parametrize(
    "bad",
    [
        {"shards": 0},
        {"shards": 1025},
        {"shards": "many"},
        {"maxlen": 0},
        {"max_payload_bytes": 10},
        {"compress_threshold_bytes": -1},
        {"liveness_ttl_s": 0},
        {"liveness_ttl_s": 0.1},
        {"read_count": 0},
        {"max_attempts": 0},
        {"retry_base_s": 0},
        {"start": "middle"},
        {"key_prefix": "a:b"},
        {"hashtag": "{x}"},
        {"block_min_ms": 500, "block_max_ms": 100},
        {"no_such_setting": 1},
    ],
)
def test_bad_values_raise_validation_error(bad: dict[str, object]) -> None:
    with pytest.raises(ValidationError) as info:
        Settings(**bad)
    # the error names the offending field (or the rule, for the cross-field check)
    text = str(info.value)
    assert any(name in text for name in bad) or "block_min_ms" in text


def test_bad_environment_value_raises_validation_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EVENTBUS_SHARDS", "0")
    with pytest.raises(ValidationError, match="shards"):
        Settings()


@pytest.mark.parametrize("name", ["EVENTBUS_SHARDS", "eventbus_shards"])
def test_environment_settings_follow_every_change_of_the_variables(
    monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    assert environment_settings().shards == Settings().shards == 16
    monkeypatch.setenv(name, "4")
    assert environment_settings().shards == Settings().shards == 4
    monkeypatch.setenv("REDIS_URL", "redis://plain:1/0")
    assert environment_settings().redis_url == "redis://plain:1/0"
    monkeypatch.delenv(name)
    assert environment_settings().shards == 16


def test_environment_settings_are_a_copy_per_call() -> None:
    first = environment_settings()
    first.shards = 3
    assert environment_settings().shards == 16


def test_environment_settings_raise_what_settings_raise(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EVENTBUS_SHARDS", "0")
    with pytest.raises(ValidationError, match="shards"):
        environment_settings()
    monkeypatch.setenv("EVENTBUS_SHARDS", "2")
    assert environment_settings().shards == 2

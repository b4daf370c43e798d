"""The Redis settings: redaction, URL validation, deadlines."""

from __future__ import annotations

import os

import pytest
from pydantic import ValidationError

from eventbus.config import DECOMPRESSION_FACTOR, Settings
from eventbus.config.addresses import check_redis_url, redact_url, scrub


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("REDIS_URL", raising=False)
    for name in list(os.environ):
        if name.startswith("EVENTBUS_"):
            monkeypatch.delenv(name)


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://:s3cret@h:1/0", "redis://:***@h:1/0"),
        ("redis://alice:s3cret@h:1/0", "redis://alice:***@h:1/0"),
        ("rediss://s3cret@h", "rediss://***@h"),
        ("redis://h:1/0?password=s3cret&db=1", "redis://h:1/0?password=***&db=1"),
        ("redis://:pa/ss@h:1/0", "redis://:***@h:1/0"),  # malformed: still redacted
        ("redis://h:1/0", "redis://h:1/0"),
    ],
)
def test_redact_url(url: str, shown: str) -> None:
    assert redact_url(url) == shown


def test_scrub_removes_raw_and_decoded_passwords() -> None:
    url = "redis://:p%2Fss-word@h/0"
    assert scrub(f"failed at {url}, password p/ss-word", url) == (
        "failed at redis://:***@h/0, password ***"
    )


@pytest.mark.parametrize(
    "url",
    [
        "redis://:pa/ss@example:6379/0",  # silently meant localhost:6379 before
        "redis://:pa#ss@example:6379/0",
        "redis://:pa?ss@example:6379/0",
        "redis://example:6379/zero",
        "http://example:6379/0",
        "garbage",
        "redis://",
    ],
)
def test_malformed_redis_urls_are_refused_without_the_password(url: str) -> None:
    with pytest.raises(ValidationError) as info:
        Settings(redis_url=url)
    text = str(info.value)
    assert "invalid Redis URL" in text
    assert "pa/ss" not in text and "pa#ss" not in text and "pa?ss" not in text
    if "pa" in url:
        assert "percent-encode" in text


@pytest.mark.parametrize(
    "url",
    [
        "redis://127.0.0.1:6379/0",
        "redis://:p%2Fss%23@example:6379/3",
        "rediss://user:pw@example",
        "redis://localhost",
        "unix:///run/redis.sock?db=1",
        "redis://[::1]:6379/0",
    ],
)
def test_valid_redis_urls_pass(url: str) -> None:
    assert check_redis_url(url) == url
    assert Settings(redis_url=url).redis_url == url


def test_settings_repr_redacts_the_password() -> None:
    s = Settings(redis_url="redis://:s3cret@h:1/0")
    assert "s3cret" not in repr(s) and "s3cret" not in str(s)
    assert s.redacted_url == "redis://:***@h:1/0"


def test_read_timeout_covers_the_longest_blocking_wait() -> None:
    s = Settings(block_max_ms=2000, publish_replicas_timeout_ms=500, redis_timeout_margin_s=3)
    assert s.redis_read_timeout_s == pytest.approx(5.0)
    s = Settings(block_max_ms=100, publish_replicas_timeout_ms=4000, redis_timeout_margin_s=1)
    assert s.redis_read_timeout_s == pytest.approx(5.0)
    assert Settings().redis_connect_timeout_s > 0


@pytest.mark.parametrize(
    "bad",
    [{"redis_connect_timeout_s": 0}, {"redis_timeout_margin_s": 0}, {"publish_timeout_s": 0}],
)
def test_deadlines_must_be_positive(bad: dict[str, float]) -> None:
    with pytest.raises(ValidationError):
        Settings(**bad)


def test_one_decompression_cap_for_both_sides() -> None:
    s = Settings(max_payload_bytes=1000)
    assert s.max_decompressed_bytes == 1000 * DECOMPRESSION_FACTOR


def test_redis_unavailable_with_sentinels_names_the_sentinels_not_the_url() -> None:
    """With Sentinel, the URL's host and port are not used (eventbus asks the sentinels for the
    primary): the error names what was tried."""
    from eventbus.errors import RedisUnavailable

    settings = Settings(
        redis_url="redis://:s3cret@unused-host:6379/0",
        sentinels="10.0.0.1:26379,10.0.0.2:26379",
        sentinel_service="orders",
    )

    message = str(RedisUnavailable.of(settings, ConnectionError("No master found for 'orders'")))

    assert "10.0.0.1:26379,10.0.0.2:26379" in message and "'orders'" in message
    assert "unused-host" not in message and "s3cret" not in message


@pytest.mark.parametrize(
    "sentinels",
    [
        "user:s3cret-pw@h:26379",
        "redis://:s3cret-pw@h:26379",
        "h1:26379,:s3cret-pw@h2:26379",
        "h1:26379,:s3c,ret-pw@h2:26379",  # a ',' in the password splits the list
        ["h1:26379", "user:s3cret-pw@h2:26379"],
        ["h1:26379", "user:s3cret-pw@h2"],  # no port after the host
    ],
)
def test_a_sentinel_address_with_credentials_is_refused_without_them(sentinels: object) -> None:
    """The settings error says where the sentinels' credentials go and quotes
    no part of the password (the whole string when it is one: a password may hold ',')."""
    with pytest.raises(ValidationError) as info:
        Settings(sentinels=sentinels, sentinel_service="m")
    text = str(info.value)
    for secret in ("s3cret", "s3c", "ret-pw"):
        assert secret not in text
    assert "sentinel_username / sentinel_password" in text

"""`eventbus.client.retry`: one backoff value, one retry call around Redis operations."""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable

import anyio
import pytest
from redis.asyncio.retry import Retry
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError

from eventbus.client import retry


def flaky(
    failures: list[Exception], result: str = "ok"
) -> tuple[Callable[[], Awaitable[str]], list[float]]:
    """An operation that raises `failures` in turn, then returns `result`; counts its calls."""
    calls: list[float] = []

    async def do() -> str:
        calls.append(time.monotonic())
        if len(calls) <= len(failures):
            raise failures[len(calls) - 1]
        return result

    return do, calls


@pytest.mark.anyio
async def test_retries_then_succeeds_and_logs_each_reason(caplog: pytest.LogCaptureFixture) -> None:
    do, calls = flaky([RedisConnectionError("refused"), OSError("reset"), ResponseError("LOADING")])

    with caplog.at_level(logging.WARNING, logger="eventbus.retry"):
        assert await retry.call(retry.forever(0.001, 0.002), "lock round", do) == "ok"

    assert len(calls) == 4
    messages = [r.getMessage() for r in caplog.records]
    assert messages == [
        "lock round failed (ConnectionError: refused); retrying",
        "lock round failed (OSError: reset); retrying",
        "lock round failed (ResponseError: LOADING); retrying",
    ]


@pytest.mark.anyio
async def test_logs_to_the_given_logger(caplog: pytest.LogCaptureFixture) -> None:
    do, _ = flaky([RedisConnectionError("refused")])
    mine = logging.getLogger("eventbus.tier")

    with caplog.at_level(logging.WARNING, logger="eventbus.tier"):
        await retry.call(retry.forever(0.001, 0.002), "offload", do, logger=mine)

    assert [(r.name, r.levelno) for r in caplog.records] == [("eventbus.tier", logging.WARNING)]


@pytest.mark.anyio
async def test_a_bounded_retry_gives_up_with_the_last_error() -> None:
    errors: list[Exception] = [RedisConnectionError(f"attempt {n}") for n in range(1, 5)]
    do, calls = flaky(errors)
    bounded = Retry(retry.backoff(0.001, 0.002), retries=2, supported_errors=retry.REDIS_ERRORS)  # type: ignore[arg-type]

    with pytest.raises(RedisConnectionError, match="attempt 3"):
        await retry.call(bounded, "xack", do)

    assert len(calls) == 3  # the first try and two retries


@pytest.mark.anyio
async def test_other_errors_are_not_retried() -> None:
    do, calls = flaky([ValueError("a bug")])

    with pytest.raises(ValueError, match="a bug"):
        await retry.call(retry.forever(0.001, 0.002), "decode", do)

    assert len(calls) == 1


@pytest.mark.anyio
async def test_the_wait_is_backoff_and_cancellation_ends_it() -> None:
    do, calls = flaky([RedisConnectionError("down")] * 100)

    with anyio.move_on_after(0.3) as scope:
        await retry.call(retry.forever(0.2, 0.4), "read", do)

    assert scope.cancelled_caught
    # two tries: the first wait lasts 0.2..0.4 s (failure 1: t = min(0.4, 0.2 * 2) = 0.4)
    assert 1 <= len(calls) <= 2
    if len(calls) == 2:
        assert calls[1] - calls[0] >= 0.2


@pytest.mark.parametrize("failures", [0, 1, 2, 5, 30])
def test_backoff_is_equal_jitter_capped(failures: int) -> None:
    base, cap = 0.05, 2.0
    b = retry.backoff(base, cap)
    t = min(cap, base * 2**failures)

    delays = [b.compute(failures) for _ in range(200)]

    assert all(t / 2 <= d <= t for d in delays)
    assert max(delays) - min(delays) > 0  # jittered


@pytest.mark.parametrize("failures", [1023, 1024, 10_000, 10**9])
def test_backoff_stays_at_the_cap_after_a_thousand_failures(failures: int) -> None:
    """A retry that never gives up (`retry.forever`) counts failures without limit; redis-py's
    formula ``base * 2**failures`` overflows a float at failure 1024 (OverflowError, found when
    a consumer's Redis retries ran for a minute with a 50 ms cap)."""
    b = retry.backoff(0.01, 0.05)

    delays = [b.compute(failures) for _ in range(50)]

    assert all(0.025 <= d <= 0.05 for d in delays)


@pytest.mark.anyio
async def test_waits_count_log_and_end_at_the_stop(caplog: pytest.LogCaptureFixture) -> None:
    waits = retry.Waits(retry.backoff(0.001, 0.002))
    with caplog.at_level(logging.WARNING, logger="eventbus.retry"):
        assert await waits.wait(None, "XACK failed", RedisConnectionError("refused")) <= 0.002
        assert waits.failures == 1
        stop = anyio.Event()
        stop.set()
        long = retry.Waits(retry.backoff(3600, 3600))
        with anyio.fail_after(5):  # a set stop ends an hour's wait at once
            assert await long.wait(stop, "read", OSError("reset"), level=logging.ERROR) > 1000
    waits.ok()
    assert waits.failures == 0
    assert [(r.levelno, r.getMessage().partition(";")[0]) for r in caplog.records] == [
        (logging.WARNING, "XACK failed (ConnectionError: refused)"),
        (logging.ERROR, "read (OSError: reset)"),
    ]

"""`eventbus.consumer.supervision.start_when_reachable`: a consumer's start retries a lost
connection until Redis answers or the stop, and raises what waiting would not fix at once."""

from __future__ import annotations

import logging

import anyio
import pytest
from redis.exceptions import AuthenticationError, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError

from eventbus.client.retry import Waits, backoff
from eventbus.consumer.supervision import start_when_reachable

pytestmark = pytest.mark.anyio


def starting(*failures: Exception) -> tuple[list[int], object]:
    calls: list[int] = []

    async def start() -> None:
        calls.append(1)
        if len(calls) <= len(failures):
            raise failures[len(calls) - 1]

    return calls, start


async def test_a_lost_connection_is_retried_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    calls, start = starting(RedisConnectionError("refused"), TimeoutError("slow"))
    with caplog.at_level(logging.WARNING, logger="eventbus.consumer"):
        started = await start_when_reachable(
            start,  # type: ignore[arg-type]
            anyio.Event(),
            Waits(backoff(0.001, 0.002), logging.getLogger("eventbus.consumer")),
            "consumer c1",
        )
    assert started and len(calls) == 3
    assert [r.getMessage().partition(";")[0] for r in caplog.records] == [
        "consumer c1 cannot start: Redis unavailable (ConnectionError: refused)",
        "consumer c1 cannot start: Redis unavailable (TimeoutError: slow)",
    ]


@pytest.mark.parametrize(
    "error", [ResponseError("NOPERM no XGROUP"), AuthenticationError("invalid password")]
)
async def test_what_waiting_would_not_fix_is_raised_at_once(error: Exception) -> None:
    calls, start = starting(error)
    with pytest.raises(type(error)):
        await start_when_reachable(start, anyio.Event(), Waits(backoff(0.001, 0.002)), "c")  # type: ignore[arg-type]
    assert len(calls) == 1


async def test_the_stop_ends_the_retries_without_an_error() -> None:
    stop = anyio.Event()
    calls: list[int] = []

    async def start() -> None:  # Redis goes on being down; the app stops meanwhile
        calls.append(1)
        stop.set()
        raise RedisConnectionError("down")

    with anyio.fail_after(5):  # an hour's backoff ends at the stop
        started = await start_when_reachable(start, stop, Waits(backoff(3600, 3600)), "c")
    assert not started and len(calls) == 1

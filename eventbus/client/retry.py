"""Retrying Redis operations: one backoff value, one retry function.

Backoff is redis-py's `EqualJitterBackoff` (the delay after failure n is uniform in
[t/2, t] with t = min(cap, base * 2**n)), and retrying is redis-py's asyncio `Retry`: no
hand-written retry loops around Redis calls. The handler's own retries are a different thing
(a timer driven by the subscriber's `RetryPolicy`, so the resource's queue does not hold a worker).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

import anyio
from redis.asyncio.retry import Retry
from redis.backoff import AbstractBackoff, EqualJitterBackoff
from redis.exceptions import ClusterError, RedisError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

T = TypeVar("T")

REDIS_ERRORS: tuple[type[Exception], ...] = (RedisError, OSError)
"""What a Redis call can raise: connection errors and error replies (OOM, READONLY, LOADING...)."""

LOST_REPLY: tuple[type[Exception], ...] = (
    RedisConnectionError,
    RedisTimeoutError,
    ClusterError,
    OSError,  # builtin TimeoutError included
)
"""Errors after which a command's reply is unknown: it may or may not have run. `ClusterError`
is redis-py's Cluster client giving up ("TTL exhausted") after too many redirections (MOVED,
ASK, TRYAGAIN while slots migrate) or connection errors."""

log = logging.getLogger("eventbus.retry")


class _Backoff(EqualJitterBackoff):
    """redis-py's `EqualJitterBackoff` without its overflow: it computes ``base * 2**failures``,
    which raises `OverflowError` once ``2**failures`` exceeds a float (failure 1024 of a retry
    that never gives up, under a minute with a 50 ms cap). Past 64 failures the cap rules
    anyway."""

    def compute(self, failures: int) -> float:
        return float(super().compute(min(failures, 64)))


def backoff(base_s: float, cap_s: float) -> EqualJitterBackoff:
    """Equal-jitter exponential backoff; `base_s` and `cap_s` in seconds."""
    return _Backoff(cap=cap_s, base=base_s)


class Waits:
    """The waits between the attempts of one operation retried until a stop: counts the failures
    in a row, computes each delay with `backoff` (a value of `backoff(base_s, cap_s)`), logs
    it to `logger` and sleeps until the delay ran out or the stop is set. The one way a
    consumer's loops wait after a failed Redis call (its start, its rounds, its acks, broadcast
    reads)."""

    def __init__(self, backoff: AbstractBackoff, logger: logging.Logger = log) -> None:
        self.backoff = backoff
        self.logger = logger
        self.failures = 0  # in a row: reset by `ok`

    def ok(self) -> None:
        """The operation succeeded: the next failure waits the first delay again."""
        self.failures = 0

    async def wait(
        self,
        stop: anyio.Event | None,
        what: str,
        error: BaseException,
        *,
        level: int = logging.WARNING,
    ) -> float:
        """Count a failure, log ``"<what> (<error type>: <error>); retry in <delay> s"`` at
        `level` (the type names the server's reason inside pipelines: ``NoPermissionError``) and
        sleep the delay, or less when `stop` is set (None: the whole delay). Returns the delay
        in seconds."""
        self.failures += 1
        delay = float(self.backoff.compute(self.failures))
        name = type(error).__name__
        self.logger.log(level, "%s (%s: %s); retry in %.2f s", what, name, error, delay)
        with anyio.move_on_after(delay):
            if stop is None:
                await anyio.sleep_forever()
            else:
                await stop.wait()
        return delay


def forever(base_s: float, cap_s: float) -> Retry:
    """A `Retry` that retries every Redis error (and `OSError`) without limit."""
    return Retry(backoff(base_s, cap_s), retries=-1, supported_errors=REDIS_ERRORS)  # type: ignore[arg-type]


async def call(
    retry: Retry,
    what: str,
    do: Callable[[], Awaitable[T]],
    *,
    logger: logging.Logger = log,
) -> T:
    """``await do()`` until it succeeds or `retry` gives up (then its last error is raised),
    logging each failure at WARNING with `what` and the server's reason. Cancellation (shutdown,
    a timeout scope) ends the wait at once."""

    async def fail(error: Exception) -> None:
        logger.warning("%s failed (%s: %s); retrying", what, type(error).__name__, error)

    return await retry.call_with_retry(do, fail)

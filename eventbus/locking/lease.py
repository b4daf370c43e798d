"""The consumer's lease: how long it may trust its locks, kept alive by heartbeats.

The lease runs `lease_s` (0.8 x the liveness TTL) from the *send* time of the last confirmed
liveness refresh (a lock round, or a heartbeat that found the member live with no lock round in
flight); Redis counts the TTL from a later instant, so the lease ends before the locks can be
taken. Without a lease the consumer starts no handler, sends no XACK and no XREADGROUP
(docs/semantics.md).

`heartbeat_loop` is the one heartbeat of every lock member: the consumer's (which renews its
lease) and the offloader's (one per topic; it has no lease, its writes are fenced by token).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import anyio

from eventbus.client.retry import REDIS_ERRORS
from eventbus.locking.locks import ShardLocks

log = logging.getLogger("eventbus.locking")


class Lease:
    """`until` is a `time.monotonic()` instant; `changed` wakes whoever waits for the lease or
    for a change of the held shards."""

    def __init__(self, lease_s: float) -> None:
        self.lease_s = lease_s
        self.until = 0.0
        self._changed = anyio.Event()

    def ok(self) -> bool:
        return time.monotonic() < self.until

    def remaining_ms(self) -> int:
        return int((self.until - time.monotonic()) * 1000)

    def renew(self, sent_at: float) -> None:
        """Extend the lease from `sent_at` (monotonic seconds), the send time of a confirmed
        liveness refresh."""
        self.until = max(self.until, sent_at + self.lease_s)
        self.wake()

    def wake(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()

    async def changed(self) -> None:
        await self._changed.wait()


FAILURE_LOG_EVERY_S = 60.0
"""During a run of failed heartbeats (a Redis outage), at most one WARNING per this many
seconds after the first (seconds)."""


class FailureLog:
    """Logs a run of failed heartbeats of member `member_id` on logger ``eventbus.locking``
    without flooding it (a heartbeat is retried every TTL/10 during an outage): the first
    failure at WARNING; then at most one WARNING per `every_s` seconds (`clock` seconds,
    default `time.monotonic`), giving the time since the first failure and how many failures
    were not logged since the previous message; the first success after failures once at INFO,
    with the run's failures and length."""

    def __init__(
        self,
        member_id: str,
        every_s: float = FAILURE_LOG_EVERY_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if every_s < 0:
            raise ValueError(f"every_s must be >= 0 seconds, got {every_s}")
        self.member_id, self.every_s, self.clock = member_id, every_s, clock
        self.failures = 0  # in the current run
        self.suppressed = 0  # failures not logged since the last message
        self._first = self._logged = 0.0

    def failed(self, exc: BaseException) -> None:
        """Count a failed heartbeat (`exc`: its error); log it if due."""
        now = self.clock()
        self.failures += 1
        if self.failures == 1:
            self._first = self._logged = now
            log.warning(
                "%s: heartbeat failed: %s (retried; further failures logged at most every %g s)",
                self.member_id,
                exc,
                self.every_s,
            )
        elif now - self._logged >= self.every_s:
            log.warning(
                "%s: heartbeat failed again: %s (failing for %.1f s, %d failures; %d not logged "
                "since the last message)",
                self.member_id,
                exc,
                now - self._first,
                self.failures,
                self.suppressed,
            )
            self._logged, self.suppressed = now, 0
        else:
            self.suppressed += 1

    def succeeded(self) -> None:
        """A heartbeat was answered: log the recovery once, if it follows failures."""
        if self.failures:
            log.info(
                "%s: heartbeat answered again after %d failed in %.1f s",
                self.member_id,
                self.failures,
                self.clock() - self._first,
            )
            self.failures = self.suppressed = 0


async def heartbeat_loop(
    locks: ShardLocks,
    ttl_s: float,
    joined: anyio.Event,
    on_live: Callable[[float], None] | None,
    on_expired: Callable[[], None],
    *,
    log_every_s: float = FAILURE_LOG_EVERY_S,
) -> None:
    """Refresh the liveness of `locks`' member every `ttl_s` / 3 seconds (`ttl_s`: its liveness
    TTL in seconds) until cancelled; the one heartbeat of the consumer and of the offloader.

    A failed heartbeat (a Redis or connection error) is retried after `ttl_s` / 10, so a short
    outage leaves several tries before the liveness lapses; it never ends the loop. Failures are
    logged by `FailureLog` (logger ``eventbus.locking``): the first at WARNING, then at most one
    WARNING per `log_every_s` seconds with the number of failures not logged, and the recovery
    once at INFO. When the member was still live and no
    lock round is in flight, `on_live(sent_at)` is called with the `time.monotonic()` send time
    of the heartbeat (the consumer renews its `Lease`; None: nothing to renew). When its
    liveness had expired before the heartbeat, `on_expired()` is called: the locks may be
    someone else's now, the caller drops them until its next lock round says what it still
    holds. Starts once `joined` is set: a heartbeat before the first lock round would find no
    entry and take a joining member for one whose liveness expired.

    `on_live` is not called while a lock round is in flight. After a lapse, the lock round that
    makes the member live again may run before a heartbeat that is answered first: that
    heartbeat finds the member live, while the shards the caller holds are still those from
    before the lapse until the round's reply is applied (found by the chaos harness,
    stress/FINDINGS.md 10). The round renews the lease itself."""
    failures = FailureLog(locks.member_id, log_every_s)
    await joined.wait()
    while True:
        sent_at = time.monotonic()
        try:
            was_live = await locks.heartbeat()
        except REDIS_ERRORS as exc:
            failures.failed(exc)
            await anyio.sleep(ttl_s / 10)
            continue
        failures.succeeded()
        if not was_live:
            on_expired()  # lapsed until the next lock round, which says what is still held
        elif on_live is not None and not locks.acquiring:
            on_live(sent_at)
        await anyio.sleep(ttl_s / 3)

"""When the consumer asks the durable tier to catch a newly locked shard up (`CatchUpHook`).

A shard is checked for a gap behind the archive when its lock is taken, at most every
`CATCH_UP_CHECK_S` seconds. A check that fails (archive unreachable, a damaged segment) leaves
the shard unread, since reading it would skip the missing entries, and the shard is not taken
again before a backoff that starts at the check interval: ``max(CATCH_UP_CHECK_S,
retry.backoff(retry_base_s, retry_max_s).compute(n))`` seconds after its n-th failure in a row
(equal jitter, as for Redis errors), reset by a success. Without it, each lock round (about 1.5
per second) would send the archive a request per shard: a request storm on an S3 that is
already failing (and a corrupt archive re-read 6-7 times in 12 s with the Redis backoff alone).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable

from redis.backoff import AbstractBackoff

from eventbus.client.retry import LOST_REPLY
from eventbus.consumer.shards import ShardTable

log = logging.getLogger("eventbus.consumer")

CATCH_UP_CHECK_S = 10.0
"""A shard is checked for a gap behind the archive at most this often (seconds)."""


CatchUpHook = Callable[[int, int], Awaitable[object]]
"""``await hook(shard, fencing_token)``: bring the group up to Redis's first entry of a shard this
consumer has just locked, from the durable tier's segments
(`eventbus.consumer.catchup.shard_hook`)."""


class CatchUpSchedule:
    """Per shard: when it was last caught up, and its failures in a row with the time before
    which it is not tried (nor locked) again. `clock` gives monotonic seconds."""

    def __init__(
        self,
        backoff: AbstractBackoff,
        *,
        check_s: float = CATCH_UP_CHECK_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.backoff = backoff
        self.check_s = check_s
        self.clock = clock
        self._checked_at: dict[int, float] = {}
        self._failures: dict[int, int] = {}
        self._not_before: dict[int, float] = {}

    def due(self, shard: int) -> bool:
        """Whether `shard` is to be checked now: not checked in the last `check_s` seconds and
        not backing off after a failure."""
        now = self.clock()
        if now < self._not_before.get(shard, now):
            return False
        return now - self._checked_at.get(shard, -self.check_s) >= self.check_s

    def backing_off(self, shard: int) -> bool:
        """Whether `shard`'s last check failed and its backoff has not run out: do not lock it."""
        return self.clock() < self._not_before.get(shard, 0.0)

    def succeeded(self, shard: int) -> None:
        self._checked_at[shard] = self.clock()
        self._failures.pop(shard, None)
        self._not_before.pop(shard, None)

    def failed(self, shard: int) -> float:
        """Record a failed check of `shard`; returns the backoff in seconds (at least
        `check_s`: a failed check is not retried sooner than a good one is repeated)."""
        n = self._failures[shard] = self._failures.get(shard, 0) + 1
        delay = max(self.check_s, float(self.backoff.compute(n)))
        self._not_before[shard] = self.clock() + delay
        return delay

    async def run(
        self,
        hook: CatchUpHook,
        shards: list[int],
        table: ShardTable,
        release: Callable[[list[int]], Awaitable[None]],
    ) -> list[int]:
        """Call `hook` on the newly locked `shards` of `table` that are due. A shard whose
        catch-up fails, or that is backing off after a failure, is given to `release` unread
        rather than read past its gap; returns the shards still held. Connection errors to
        Redis propagate (the round is retried)."""
        kept = []
        for s in shards:
            held = table.held.get(s)
            if held is None:
                continue
            if self.backing_off(s):
                await release([s])
                continue
            if not self.due(s):
                kept.append(s)
                continue
            try:
                await hook(s, held.token)
            except LOST_REPLY:  # the consumer's round handles them
                raise
            except Exception as exc:
                delay = self.failed(s)
                log.error(
                    "catch-up of shard %d failed (%s: %s); shard released unread, next try in "
                    "%.1f s",
                    s,
                    type(exc).__name__,
                    exc,
                    delay,
                )
                await release([s])
                continue
            self.succeeded(s)
            kept.append(s)
        return kept

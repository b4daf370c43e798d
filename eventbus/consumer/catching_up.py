"""When the consumer asks the durable tier to catch a newly locked shard up (`CatchUpHook`).

A shard is checked for a gap behind the archive every time its lock is taken (a few Redis
commands; the archive is read only when the group is behind it): a shard released and taken
again seconds later may have had its unread entries archived and trimmed meanwhile, and a check
skipped then read past them. A check that fails (archive unreachable, a damaged
segment) leaves the shard unread, since reading it would skip the missing entries, and the shard
is not taken again before a backoff that starts at the check interval: ``max(CATCH_UP_CHECK_S,
retry.backoff(retry_base_s, retry_max_s).compute(n))`` seconds after its n-th failure in a row
(equal jitter, as for Redis errors), reset by a success. Without it, each lock round (about 1.5
per second) would send the archive a request per shard: a request storm on an S3 that is
already failing (and a corrupt archive re-read 6-7 times in 12 s with the Redis backoff alone).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import KW_ONLY, dataclass, field

from redis.backoff import AbstractBackoff

from eventbus.client.retry import LOST_REPLY
from eventbus.consumer.shards import ShardTable
from eventbus.locking.locks import Fenced

log = logging.getLogger("eventbus.consumer")

CATCH_UP_CHECK_S = 10.0
"""The least time (seconds) before a shard whose catch-up failed is locked and tried again."""


CatchUpHook = Callable[[int, int], Awaitable[object]]
"""``await hook(shard, fencing_token)``: bring the group up to Redis's first entry of a shard this
consumer has just locked, from the durable tier's segments
(`eventbus.consumer.catchup.shard_hook`)."""


@dataclass
class CatchUpSchedule:
    """Per shard: its failed catch-ups in a row, and the time before which it is not tried
    (nor locked) again. `clock` gives monotonic seconds."""

    backoff: AbstractBackoff
    _: KW_ONLY
    check_s: float = CATCH_UP_CHECK_S
    clock: Callable[[], float] = time.monotonic
    _failures: dict[int, int] = field(default_factory=dict, init=False, repr=False)
    _not_before: dict[int, float] = field(default_factory=dict, init=False, repr=False)

    def backing_off(self, shard: int) -> bool:
        """Whether `shard`'s last check failed and its backoff has not run out: do not lock it."""
        return self.clock() < self._not_before.get(shard, 0.0)

    def succeeded(self, shard: int) -> None:
        self._failures.pop(shard, None)
        self._not_before.pop(shard, None)

    def failed(self, shard: int) -> float:
        """Record a failed check of `shard`; returns the backoff in seconds (at least
        `check_s`)."""
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
        """Call `hook` on `shards` of `table`, newly locked or found behind the archive by the
        trim check: each must be caught up before it is read. A shard whose catch-up fails, or
        that is backing off after a failure, is given to `release` unread rather than read past
        its gap; one whose lock was lost meanwhile (`Fenced`) is forgotten, neither recovered
        nor read: its new owner has it. Returns the shards still held. Connection errors to
        Redis propagate (the round is retried)."""
        kept = []
        for s in shards:
            held = table.held.get(s)
            if held is None:
                continue
            if self.backing_off(s):
                await release([s])
                continue
            try:
                await hook(s, held.token)
            except LOST_REPLY:  # the consumer's round handles them
                raise
            except Fenced:
                table.forget([s])
                continue
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
            if table.held.get(s) is held:  # not dropped (a lapse) while the hook ran
                kept.append(s)
        return kept

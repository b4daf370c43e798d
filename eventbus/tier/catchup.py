"""Catch-up: a consumer group whose next entries were trimmed from Redis reads them from segments.

`eventbus.consumer.catchup.catch_up` (typed, with the bus's registered handler) and
`catch_up_group` (raw entries) run,
for each shard of a topic, under the *group's own* shard lock, taken with ``lock_shards.lua``
like a consumer (so no consumer of the group reads the shard meanwhile):

1. **Pending entries** of the group (delivered, never acked), in entry-ID order: from Redis when
   still there, from segments when trimmed. Each is handled, then ``XACK``-ed. They come first
   because they precede everything after the group's last-delivered ID (per-resource order).
2. **After the last-delivered ID** ``D``: when the stream's first entry lies after ``D`` (so
   entries after ``D`` may be missing from Redis), every archived entry after ``D`` is handled in
   entry-ID order, reading segments (several at a time), and ``XGROUP SETID`` moves ``D`` past
   them, segment by segment. Reading on to the end of the archive, past what Redis still holds,
   leaves the group near the offloader's checkpoint: the entries after it stay in Redis for
   about ``hot_window_s``.
3. If segments hold nothing after ``D`` while Redis lacks entries after ``D``, those entries were
   lost before archiving (see the shard's gap records): logged at ERROR level and counted.

Sweeps over the shards repeat until one finds no shard behind (`CatchUp.run`).

Before every ``XACK`` / ``XGROUP SETID`` the lock is re-taken (refreshing liveness) and its
fencing token compared: a catch-up that lost its lock stops that shard at once. As on the live
path this is at-least-once: an entry handled right before a crash is handled again.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Sequence

import anyio
import anyio.to_thread

from eventbus.client import retry
from eventbus.config import Settings
from eventbus.locking.locks import Fenced, LockClient, new_member_id
from eventbus.locking.member import AsyncRedis, Member
from eventbus.protocol.keys import Keys
from eventbus.tier.catchup_shard import CatchUpStats as CatchUpStats  # re-exported
from eventbus.tier.catchup_shard import Handle, ShardCatchUp
from eventbus.tier.errors import LockUnavailable, TierError
from eventbus.tier.layout import SegmentRef
from eventbus.tier.replay import ArchivedEntry
from eventbus.tier.store import Store

log = logging.getLogger("eventbus.tier")

_LOCK_POLL = retry.backoff(0.05, 1.0)
"""Waits between attempts to lock shards that live consumers hold (seconds)."""

RawHandler = Callable[[ArchivedEntry, int], Awaitable[None]]
"""``await handle(entry, fencing_token)``: process one entry; raising stops the catch-up."""


class CatchUp:
    """Catch-up of `member`'s group from `store` (a topic of `shards` shards); see the module
    docstring. The member's ID names the catch-up in the group's locks."""

    def __init__(self, member: Member, store: Store, *, shards: int) -> None:
        self.redis, self.keys, self.settings = member.redis, member.keys, member.settings
        self.topic, self.group, self.consumer_id = member.topic, member.group, member.consumer_id
        self.store = store
        self.shards = shards
        self.locks = LockClient(member, shards=shards)
        self.consumed: dict[int, SegmentRef] = {}  # last segment handled, per shard

    async def lock(self, shards: Sequence[int]) -> dict[int, int]:
        """Take (or keep) the locks of `shards` that are free; returns shard -> token held."""
        grants = (await self.locks.acquire(shards)).grants
        return {s: g.token for s, g in grants.items() if s in set(shards)}

    async def _pass(
        self,
        handle: Handle,
        chosen: list[int],
        first_pass: bool,
        stats: CatchUpStats,
        deadline: float,
    ) -> bool:
        """One sweep over `chosen` shards, each under its lock. Returns whether any was behind."""
        todo = list(chosen)
        behind = False
        waits = 0
        while todo:
            held = await self.lock(todo)
            for s, token in held.items():
                try:
                    behind |= await ShardCatchUp(self, s, token, handle, stats).run(first_pass)
                    stats.shards += first_pass
                except Fenced:
                    log.warning("catch-up %s lost the lock of shard %d", self.consumer_id, s)
                    continue
                finally:
                    await self.locks.release([s])
                todo.remove(s)
            if todo and not held:
                if time.monotonic() > deadline:
                    raise LockUnavailable(
                        f"catch-up of {self.topic}/{self.group}: shards {todo} stayed locked "
                        f"by live consumers past the timeout"
                    )
                waits += 1
                await anyio.sleep(_LOCK_POLL.compute(waits))
        return behind

    async def run(
        self,
        handle: Handle,
        *,
        shards: Sequence[int] | None = None,
        lock_timeout_s: float = 30.0,
        max_sweeps: int = 50,
    ) -> CatchUpStats:
        """Catch up `shards` (default: all), calling `handle` on each entry in entry-ID order
        per shard. Shards locked by live consumers are retried until `lock_timeout_s` seconds
        pass, then `LockUnavailable` is raised naming them. Exceptions from `handle` propagate
        (the shard's position stays at the last entry handled before).

        Sweeps over the shards repeat until a sweep finds none behind Redis's first entry: a
        shard finished early may fall behind again (the offloader keeps trimming) while later
        shards are caught up. Every sweep after the first also moves each shard up to the end
        of the archive, so when this returns every shard's group position is at most one sweep
        behind the offloader's checkpoint, and the entries after it stay in Redis for about
        ``hot_window_s``: start the group's consumers right away. A catch-up slower than the
        trimming (a sweep longer than the hot window, every time) raises `TierError` after
        `max_sweeps` sweeps instead of running forever.
        """
        stats = CatchUpStats()
        started = time.monotonic()
        chosen = list(range(self.shards)) if shards is None else list(shards)
        try:
            sweeps = 1
            while await self._pass(handle, chosen, sweeps == 1, stats, started + lock_timeout_s):
                sweeps += 1  # some shard was behind: sweep again until none is
                if sweeps > max_sweeps:
                    raise TierError(
                        f"catch-up of {self.topic}/{self.group} does not converge: after "
                        f"{max_sweeps} sweeps the offloader still trims entries before this "
                        "catch-up reaches them (raise hot_window_s, or speed up the handler)"
                    )
        finally:
            with anyio.CancelScope(shield=True):
                await self.locks.release([], leave=True)
        stats.seconds = time.monotonic() - started
        return stats


async def catch_up_group(
    redis: AsyncRedis,
    store: Store,
    topic: str,
    group: str,
    handle: RawHandler,
    *,
    shards: int,
    settings: Settings | None = None,
    only: Sequence[int] | None = None,
    lock_timeout_s: float = 30.0,
) -> CatchUpStats:
    """Catch up consumer group `group` of `topic` (`shards` shards) from `store`, calling
    ``await handle(entry, fencing_token)`` on raw `ArchivedEntry`s. See `CatchUp.run`."""
    runner = CatchUp(_member(redis, settings, topic, group), store, shards=shards)
    return await runner.run(_raw(handle), shards=only, lock_timeout_s=lock_timeout_s)


def _member(redis: AsyncRedis, settings: Settings | None, topic: str, group: str) -> Member:
    """A catch-up's own member of `group` (a fresh ``catchup-`` ID), settings from the
    environment when none are given."""
    settings = settings or Settings()  # type: ignore[call-arg,unused-ignore]  # fields from env
    keys = Keys(settings.key_prefix, settings.hashtag)
    return Member(redis, keys, settings, topic, group, f"catchup-{new_member_id()}")


def _raw(handle: RawHandler) -> Handle:
    async def each(entry: ArchivedEntry, sc: ShardCatchUp) -> None:
        await handle(entry, sc.token)

    return each

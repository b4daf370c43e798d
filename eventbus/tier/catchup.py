"""Catch-up: a consumer group whose next entries were trimmed from Redis reads them from segments.

`catch_up` (typed, with the bus's registered handler) and `catch_up_group` (raw entries) run,
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
from typing import Any

import anyio
import anyio.to_thread

from eventbus.client import retry
from eventbus.config import Settings
from eventbus.consumer.delivery import Delivery, Outcome
from eventbus.consumer.handling import Handling
from eventbus.errors import ConfigError
from eventbus.locking.locks import LockClient, new_member_id
from eventbus.locking.member import AsyncRedis, Member
from eventbus.protocol.ids import parse_id
from eventbus.protocol.keys import Keys
from eventbus.tier.catchup_shard import CatchUpStats as CatchUpStats  # re-exported
from eventbus.tier.catchup_shard import Fenced, Handle, ShardCatchUp
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
        handle: RawHandler | _Typed,
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
        each = handle if isinstance(handle, _Typed) else _raw(handle)
        try:
            sweeps = 1
            while await self._pass(each, chosen, sweeps == 1, stats, started + lock_timeout_s):
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
    return await runner.run(handle, shards=only, lock_timeout_s=lock_timeout_s)


async def catch_up(
    bus: Any,
    store: Store,
    topic: str,
    group: str,
    *,
    only: Sequence[int] | None = None,
    lock_timeout_s: float = 30.0,
) -> CatchUpStats:
    """Catch up the group's subscriber registered on `bus` (an `EventBus`) with
    ``@bus.subscriber(topic, group=group)`` through the live consumer's handling path
    (`eventbus.consumer.handling`): typed events and a `Context`, the subscriber's retry policy,
    de-duplication, dead letters, parking and the operator's control entries, and no handler
    started without a confirmed lock. Run it before starting the group's consumers (it needs
    their shard locks). Raises `ConfigError` if no such subscriber is registered,
    `LockUnavailable`.
    """
    sub = next((s for s in bus.subscriptions if s.topic.name == topic and s.group == group), None)
    if sub is None:
        raise ConfigError(f"no subscriber registered for topic {topic!r} group {group!r}")
    settings: Settings = bus.settings
    shards = int((await bus.registry.stored()).get(topic, sub.topic.shards))
    member = _member(bus.redis, settings, topic, group)
    runner = CatchUp(member, store, shards=shards)
    handling = Handling(member, sub, retry.forever(settings.retry_base_s, settings.retry_max_s))
    async with anyio.create_task_group() as tg:
        tg.start_soon(handling.watchdog.run)  # the subscription's handler_timeout_s
        stats = await runner.run(_Typed(handling), shards=only, lock_timeout_s=lock_timeout_s)
        tg.cancel_scope.cancel()
    return stats


def _member(redis: AsyncRedis, settings: Settings | None, topic: str, group: str) -> Member:
    """A catch-up's own member of `group` (a fresh ``catchup-`` ID), settings from the
    environment when none are given."""
    settings = settings or Settings()  # type: ignore[call-arg,unused-ignore]  # fields from env
    keys = Keys(settings.key_prefix, settings.hashtag)
    return Member(redis, keys, settings, topic, group, f"catchup-{new_member_id()}")


def shard_hook(store: Store, handling: Handling) -> Callable[[int, int], Awaitable[bool]]:
    """The live consumer's catch-up hook (`Consumer.catch_up`): ``await hook(shard, token)``
    catches one shard the consumer has just locked up to Redis's first entry, under that same
    lock (re-taken with the consumer's ID, so the token must stay `token`), through the
    consumer's own `handling` (same parked set, counters and policy), before the consumer reads
    the shard. Returns whether the shard was behind. A lost lock ends it quietly (the new owner
    catches up)."""
    sub, redis, consumer_id = handling.sub, handling.redis, handling.consumer_id
    runner = CatchUp(handling.member, store, shards=sub.topic.shards)
    typed = _Typed(handling)

    async def hook(shard: int, token: int) -> bool:
        stats = CatchUpStats()
        sc = ShardCatchUp(runner, shard, token, typed, stats)
        try:
            delivered = await sc.last_delivered()
            if delivered is None:
                return False
            head = await sc.head()
            summary = await redis.xpending(sc.stream, sub.group)
            lowest = summary.get("min") if summary.get("pending") else None
            trimmed_pending = lowest is not None and parse_id(lowest) < head
            if not trimmed_pending and head <= delivered.next():
                # nothing the group needs is missing from Redis: the consumer's own recovery
                # (with its park, control-entry and retry handling) takes it from here
                return False
            if trimmed_pending:
                await sc.pending()
            behind = await sc.after(delivered, chase=False)
        except Fenced:
            log.warning("catch-up of shard %d by %s lost its lock", shard, consumer_id)
            return False
        if behind or stats.pending_acked:
            log.info(
                "consumer %s caught shard %d of %s/%s up: %d entries from segments, %d from Redis",
                consumer_id,
                shard,
                sub.topic.name,
                sub.group,
                stats.from_segments,
                stats.from_redis,
            )
        return behind

    return hook


def _raw(handle: RawHandler) -> Handle:
    async def each(entry: ArchivedEntry, sc: ShardCatchUp) -> None:
        await handle(entry, sc.token)

    return each


class _Typed:
    """Catch-up through a subscription's `Handling`: each entry is stepped until it is finished
    (handled, skipped, dead-lettered, control executed), waiting out retry delays in place; a
    lost lock (`Outcome.LET_GO`) stops the shard with `Fenced`."""

    def __init__(self, handling: Handling) -> None:
        self.handling = handling
        self._parked_for: ShardCatchUp | None = None

    async def __call__(self, entry: ArchivedEntry, sc: ShardCatchUp) -> None:
        if self._parked_for is not sc and self.handling.sub.on_failure == "park":
            # as a new lock owner does: the shard's resources may have been parked before
            await self.handling.failures.load_parked()
            self._parked_for = sc
        d = Delivery(
            entry.shard,
            sc.token,
            str(entry.entry_id).encode(),
            entry.fields(),
            segment=entry.segment or None,
        )
        while True:
            step = await self.handling.step(d, sc)
            if step is Outcome.ACK:
                self.handling.flush_metrics()  # catch-up is no hot path: one event at a time
                return
            if step is Outcome.LET_GO:
                raise Fenced
            await anyio.sleep(step)

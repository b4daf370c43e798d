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
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.to_thread
from redis.exceptions import ResponseError

from eventbus import retry
from eventbus.codec import F_DATA, F_RESOURCE, F_TYPE
from eventbus.config import Settings
from eventbus.consumer.delivery import Delivery, Outcome
from eventbus.consumer.handling import Handling
from eventbus.errors import ConfigError
from eventbus.keys import Keys
from eventbus.locks import LockClient, new_member_id
from eventbus.tier.errors import LockUnavailable, TierError
from eventbus.tier.ids import EntryId, parse_id
from eventbus.tier.layout import SegmentRef
from eventbus.tier.metrics import TIER_METRICS
from eventbus.tier.replay import ArchivedEntry, ReplayFilter, read_segment
from eventbus.tier.store import Store, list_segments

log = logging.getLogger("eventbus.tier")

READ_AHEAD = 8  # segments fetched concurrently by catch-up

RawHandler = Callable[[ArchivedEntry, int], Awaitable[None]]
"""``await handle(entry, fencing_token)``: process one entry; raising stops the catch-up."""

_Handle = Callable[[ArchivedEntry, "_ShardCatchUp"], Awaitable[None]]
"""How a shard's catch-up handles one entry: a raw handler, or the subscription's handling path
(`_Typed`), which needs the shard's fence."""


@dataclass
class CatchUpStats:
    """What a catch-up did: entries handled from segments and from Redis (pending entries still
    there), pending entries acked, entries known lost, shards done; seconds of wall time."""

    from_segments: int = 0
    from_redis: int = 0
    pending_acked: int = 0
    lost_ranges: int = 0
    shards: int = 0
    seconds: float = 0.0


class _Fenced(Exception):
    pass


def _entry(topic: str, shard: int, entry_id: EntryId, fields: dict[bytes, bytes]) -> ArchivedEntry:
    def text(name: bytes) -> str | None:
        value = fields.get(name)
        return None if value is None else value.decode("utf-8", "replace")

    return ArchivedEntry(
        topic,
        shard,
        entry_id,
        text(F_RESOURCE),
        text(F_TYPE),
        None,
        None,
        None,
        fields.get(F_DATA, b""),
        "",
    )


class _ShardCatchUp:
    """The catch-up of one shard under the group's lock (token `token`); it is the `Fence` of
    the entries it handles: its lease runs `lease_s` from the send time of the last lock
    confirmation, as the live consumer's does."""

    def __init__(
        self, owner: CatchUp, shard: int, token: int, handle: _Handle, stats: CatchUpStats
    ) -> None:
        self.o = owner
        self.shard = shard
        self.token = token
        self.handle = handle
        self.stats = stats
        self.stream = owner.keys.stream(owner.topic, shard)
        self._lease_until = 0.0

    async def confirm(self) -> None:
        """Re-take (refresh) the lock; raise `_Fenced` unless the token is unchanged."""
        grants = await self.o.locks.acquire([self.shard])
        grant = grants.grants.get(self.shard)
        if grant is None or grant.token != self.token:
            self._lease_until = 0.0
            raise _Fenced
        self._lease_until = grants.sent_at + self.o.settings.lease_s

    def holds(self, d: Delivery) -> bool:
        return time.monotonic() < self._lease_until

    async def wait(self, d: Delivery) -> bool:
        if self.holds(d):
            return True
        try:
            await self.confirm()
        except _Fenced:
            return False
        return True

    async def head(self) -> EntryId:
        """The first entry ID in Redis (the next ID to be generated when the stream is empty)."""
        info = await self.o.redis.xinfo_stream(self.stream)
        first = info.get("first-entry")
        if first is not None:
            return parse_id(first[0])
        return parse_id(info.get("last-generated-id") or b"0-0").next()

    async def last_delivered(self) -> EntryId | None:
        try:
            groups = await self.o.redis.xinfo_groups(self.stream)
        except ResponseError:  # no such key
            return None
        for g in groups:
            name = g["name"].decode() if isinstance(g["name"], bytes) else g["name"]
            if name == self.o.group:
                return parse_id(g["last-delivered-id"])
        return None

    async def segments_after(self, after: EntryId, *, resume: bool = False) -> list[SegmentRef]:
        """Segments holding entries after `after`; with `resume`, listing only the keys after
        the last segment this catch-up consumed on the shard (cheap on later sweeps)."""
        since = self.o.consumed.get(self.shard) if resume else None
        refs = await list_segments(self.o.store, self.o.topic, self.shard, after=since)
        return [r for r in refs if r.last > after]

    async def read(self, ref: SegmentRef, flt: ReplayFilter) -> list[ArchivedEntry]:
        return await anyio.to_thread.run_sync(read_segment, self.o.store, ref, flt)

    async def read_many(
        self, refs: Sequence[SegmentRef], flt: ReplayFilter
    ) -> list[list[ArchivedEntry]]:
        """Read `refs` concurrently (per-segment latency dominates on S3); results in order.
        Raises the first error (e.g. `CorruptSegment`) unwrapped."""
        results: list[list[ArchivedEntry]] = [[] for _ in refs]
        errors: list[BaseException] = []

        async def one(i: int, ref: SegmentRef) -> None:
            try:
                results[i] = await self.read(ref, flt)
            except Exception as exc:
                errors.append(exc)

        async with anyio.create_task_group() as tg:
            for i, ref in enumerate(refs):
                tg.start_soon(one, i, ref)
        if errors:
            raise errors[0]
        return results

    async def run(self, first_pass: bool) -> bool:
        """Catch the shard up; returns whether it was behind Redis's first entry."""
        delivered = await self.last_delivered()
        if delivered is None:
            log.info(
                "catch-up: group %s has no stream %s yet; nothing to do", self.o.group, self.stream
            )
            return False
        if first_pass:
            await self.pending()
        return await self.after(delivered, chase=not first_pass)

    async def pending(self) -> None:
        """Handle and ack the group's pending entries, oldest first."""
        redis, group = self.o.redis, self.o.group
        ids: list[EntryId] = []
        start = "-"
        while True:
            page = await redis.xpending_range(self.stream, group, start, "+", 1000)
            ids += [parse_id(p["message_id"]) for p in page]
            if len(page) < 1000:
                break
            start = f"({ids[-1]}"
        if not ids:
            return
        head = await self.head()
        trimmed = [i for i in ids if i < head]
        entries: list[ArchivedEntry] = []
        if trimmed:
            wanted = set(trimmed)
            flt = ReplayFilter(start_id=trimmed[0], end_id=trimmed[-1])
            for ref in await self.segments_after(
                trimmed[0].prev() if trimmed[0].ms else trimmed[0]
            ):
                if ref.first > trimmed[-1]:
                    break
                entries += [e for e in await self.read(ref, flt) if e.entry_id in wanted]
            found = {e.entry_id for e in entries}
            missing = [i for i in trimmed if i not in found]
            if missing:
                self.stats.lost_ranges += 1
                log.error(
                    "catch-up %s/%s shard %d: %d pending entries are neither in Redis nor in "
                    "segments (lost before archiving): %s",
                    self.o.topic,
                    group,
                    self.shard,
                    len(missing),
                    [str(m) for m in missing[:5]],
                )
                await self.confirm()
                await redis.xack(self.stream, group, *map(str, missing))
        n_segment = len(entries)
        for i in ids:
            if i >= head:
                rows = await redis.xrange(self.stream, str(i), str(i), count=1)
                if rows:
                    entries.append(_entry(self.o.topic, self.shard, i, rows[0][1]))
        for entry in entries:
            await self.handle(entry, self)
            await self.confirm()
            await redis.xack(self.stream, group, str(entry.entry_id))
            self.stats.pending_acked += 1
        self.stats.from_segments += n_segment
        self.stats.from_redis += len(entries) - n_segment
        TIER_METRICS.caught_up.labels(self.o.topic).inc(n_segment)

    async def after(self, delivered: EntryId, chase: bool) -> bool:
        """If Redis lacks entries after `delivered` (or `chase` is set), handle every archived
        entry after it, to the end of the archive. Returns whether Redis lacked entries after
        `delivered` and segments held them; False when Redis held everything after it, or the
        missing entries are in no segment (lost: logged and counted)."""
        redis, group = self.o.redis, self.o.group
        head = await self.head()
        behind = head > delivered.next()
        if not behind and not chase:
            return False  # Redis holds every entry after the last-delivered ID
        handled = 0
        refs = await self.segments_after(delivered, resume=True)
        flt = ReplayFilter(start_id=delivered.next())
        for i in range(0, len(refs), READ_AHEAD):
            chunk = refs[i : i + READ_AHEAD]
            for ref, entries in zip(chunk, await self.read_many(chunk, flt), strict=True):
                for entry in entries:
                    await self.handle(entry, self)
                handled += len(entries)
                if entries:
                    await self.confirm()
                    delivered = entries[-1].entry_id
                    await redis.xgroup_setid(self.stream, group, str(delivered))
                    self.stats.from_segments += len(entries)
                    TIER_METRICS.caught_up.labels(self.o.topic).inc(len(entries))
                self.o.consumed[self.shard] = ref
        if behind and handled == 0:
            self.stats.lost_ranges += 1
            log.error(
                "catch-up %s/%s shard %d: entries after %s up to %s were trimmed from Redis "
                "and are not in any segment: lost before archiving (see the gap records)",
                self.o.topic,
                group,
                self.shard,
                delivered,
                head,
            )
            return False
        return behind


class CatchUp:
    """Catch-up of one (topic, group) from `store`; see the module docstring.

    `consumer_id` names the catch-up in the group's locks (default: a fresh ID).
    """

    def __init__(
        self,
        redis: Any,
        store: Store,
        topic: str,
        group: str,
        *,
        shards: int,
        settings: Settings | None = None,
        consumer_id: str | None = None,
    ) -> None:
        self.redis = redis
        self.store = store
        self.topic = topic
        self.group = group
        self.shards = shards
        self.settings = settings or Settings()  # type: ignore[call-arg,unused-ignore]  # fields from env
        self.keys = Keys(self.settings.key_prefix, self.settings.hashtag)
        self.consumer_id = consumer_id or f"catchup-{new_member_id()}"
        self.locks = LockClient.for_settings(
            redis, self.settings, topic, group, self.consumer_id, shards=shards
        )
        self.consumed: dict[int, SegmentRef] = {}  # last segment handled, per shard

    async def lock(self, shards: Sequence[int]) -> dict[int, int]:
        """Take (or keep) the locks of `shards` that are free; returns shard -> token held."""
        grants = (await self.locks.acquire(shards)).grants
        return {s: g.token for s, g in grants.items() if s in set(shards)}

    async def _pass(
        self,
        handle: _Handle,
        chosen: list[int],
        first_pass: bool,
        stats: CatchUpStats,
        deadline: float,
    ) -> bool:
        """One sweep over `chosen` shards, each under its lock. Returns whether any was behind."""
        todo = list(chosen)
        behind = False
        delay = 0.05
        while todo:
            held = await self.lock(todo)
            for s, token in held.items():
                try:
                    behind |= await _ShardCatchUp(self, s, token, handle, stats).run(first_pass)
                    stats.shards += first_pass
                except _Fenced:
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
                await anyio.sleep(delay)
                delay = min(delay * 2, 1.0)
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
    redis: Any,
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
    runner = CatchUp(redis, store, topic, group, shards=shards, settings=settings)
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
    runner = CatchUp(bus.redis, store, topic, group, shards=shards, settings=settings)
    redis_retry = retry.forever(settings.retry_base_s, settings.retry_max_s)
    handling = Handling(bus.redis, runner.keys, settings, sub, runner.consumer_id, redis_retry)
    return await runner.run(_Typed(handling), shards=only, lock_timeout_s=lock_timeout_s)


def shard_hook(
    redis: Any, store: Store, handling: Handling, settings: Settings
) -> Callable[[int, int], Awaitable[bool]]:
    """The live consumer's catch-up hook (`Consumer.catch_up`): ``await hook(shard, token)``
    catches one shard the consumer has just locked up to Redis's first entry, under that same
    lock (re-taken with the consumer's ID, so the token must stay `token`), through the
    consumer's own `handling` (same parked set, counters and policy), before the consumer reads
    the shard. Returns whether the shard was behind. A lost lock ends it quietly (the new owner
    catches up)."""
    sub = handling.sub
    consumer_id = handling.consumer_id
    runner = CatchUp(
        redis,
        store,
        sub.topic.name,
        sub.group,
        shards=sub.topic.shards,
        settings=settings,
        consumer_id=consumer_id,
    )
    typed = _Typed(handling)

    async def hook(shard: int, token: int) -> bool:
        stats = CatchUpStats()
        sc = _ShardCatchUp(runner, shard, token, typed, stats)
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
        except _Fenced:
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


def _raw(handle: RawHandler) -> _Handle:
    async def each(entry: ArchivedEntry, sc: _ShardCatchUp) -> None:
        await handle(entry, sc.token)

    return each


class _Typed:
    """Catch-up through a subscription's `Handling`: each entry is stepped until it is finished
    (handled, skipped, dead-lettered, control executed), waiting out retry delays in place; a
    lost lock (`Outcome.LET_GO`) stops the shard with `_Fenced`."""

    def __init__(self, handling: Handling) -> None:
        self.handling = handling
        self._parked_for: _ShardCatchUp | None = None

    async def __call__(self, entry: ArchivedEntry, sc: _ShardCatchUp) -> None:
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
                return
            if step is Outcome.LET_GO:
                raise _Fenced
            await anyio.sleep(step)

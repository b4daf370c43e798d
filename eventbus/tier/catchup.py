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

import inspect
import logging
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import anyio
import anyio.to_thread
from redis.exceptions import ResponseError

from eventbus.codec import F_DATA, F_RESOURCE, F_TYPE
from eventbus.config import Settings
from eventbus.consumer import Context, Subscription, new_consumer_id
from eventbus.dlq import dead_letter_fields
from eventbus.errors import ConfigError, DecodeError
from eventbus.keys import Keys
from eventbus.scripts import Scripts
from eventbus.tier.errors import LockUnavailable, TierError
from eventbus.tier.ids import EntryId, parse_id
from eventbus.tier.layout import SegmentRef
from eventbus.tier.metrics import TIER_METRICS
from eventbus.tier.replay import ArchivedEntry, ReplayFilter, decode_event, read_segment
from eventbus.tier.store import Store, list_segments

log = logging.getLogger("eventbus.tier")

READ_AHEAD = 8  # segments fetched concurrently by catch-up

RawHandler = Callable[[ArchivedEntry, int], Awaitable[None]]
"""``await handle(entry, fencing_token)``: process one entry; raising stops the catch-up."""


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
    def __init__(
        self, owner: CatchUp, shard: int, token: int, handle: RawHandler, stats: CatchUpStats
    ) -> None:
        self.o = owner
        self.shard = shard
        self.token = token
        self.handle = handle
        self.stats = stats
        self.stream = owner.keys.stream(owner.topic, shard)

    async def confirm(self) -> None:
        """Re-take (refresh) the lock; raise `_Fenced` unless the token is unchanged."""
        if await self.o.lock([self.shard]) != {self.shard: self.token}:
            raise _Fenced

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
            await self.handle(entry, self.token)
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
                    await self.handle(entry, self.token)
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
        self.scripts = Scripts.register(redis)
        self.consumer_id = consumer_id or f"catchup-{new_consumer_id()}"
        self.consumed: dict[int, SegmentRef] = {}  # last segment handled, per shard
        self._members = self.keys.members(topic, group)
        self._locks = self.keys.locks(topic, group)

    async def lock(self, shards: Sequence[int]) -> dict[int, int]:
        """Take (or keep) the locks of `shards` that are free; returns shard -> token held."""
        reply = await self.scripts.lock_shards(
            keys=[self._members, self._locks],
            args=[self.consumer_id, int(self.settings.liveness_ttl_s * 1000), self.shards, *shards],
        )
        wanted = set(shards)
        return {int(s): int(tok) for s, tok, _ in reply[1:] if int(s) in wanted}

    async def unlock(self, shards: Sequence[int], leave: bool = False) -> None:
        await self.scripts.unlock_shards(
            keys=[self._members, self._locks], args=[self.consumer_id, int(leave), *shards]
        )

    async def _pass(
        self,
        handle: RawHandler,
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
                    await self.unlock([s])
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
        handle: RawHandler,
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
                await self.unlock([], leave=True)
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
    ``@bus.subscriber(topic, group=group)``: its handler gets typed events and a `Context`, as on
    the live path, with the same retries; entries that do not decode or keep failing go to the
    group's dead-letter stream. Run it before starting the group's consumers (it needs their
    shard locks). Raises `ConfigError` if no such subscriber is registered, `LockUnavailable`.
    """
    sub = next((s for s in bus.subscriptions if s.topic.name == topic and s.group == group), None)
    if sub is None:
        raise ConfigError(f"no subscriber registered for topic {topic!r} group {group!r}")
    settings: Settings = bus.settings
    shards = int((await bus.registry.stored()).get(topic, sub.topic.shards))
    runner = CatchUp(bus.redis, store, topic, group, shards=shards, settings=settings)
    typed = _TypedHandler(runner, sub, settings)
    return await runner.run(typed, shards=only, lock_timeout_s=lock_timeout_s)


def shard_hook(
    redis: Any, store: Store, sub: Subscription, settings: Settings, consumer_id: str
) -> Callable[[int, int], Awaitable[bool]]:
    """The live consumer's catch-up hook (`Consumer.catch_up`): ``await hook(shard, token)``
    catches one shard the consumer has just locked up to Redis's first entry, under that same
    lock (re-taken with the consumer's ID, so the token must stay `token`), with the
    subscriber's handler, before the consumer reads the shard. Returns whether the shard was
    behind. A lost lock ends it quietly (the new owner catches up)."""
    runner = CatchUp(
        redis,
        store,
        sub.topic.name,
        sub.group,
        shards=sub.topic.shards,
        settings=settings,
        consumer_id=consumer_id,
    )
    typed = _TypedHandler(runner, sub, settings)

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


class _TypedHandler:
    """Decode, validate, call the subscriber's handler with retries; dead-letter on failure."""

    def __init__(self, runner: CatchUp, sub: Subscription, settings: Settings) -> None:
        self.runner = runner
        self.sub = sub
        self.settings = settings
        self.max_attempts = sub.max_attempts or settings.max_attempts

    async def __call__(self, entry: ArchivedEntry, token: int) -> None:
        try:
            replayed = decode_event(entry, self.sub.models)
        except DecodeError as exc:
            await self.dead_letter(entry, exc, 0)
            return
        env = replayed.envelope
        for attempt in range(1, self.max_attempts + 1):
            ctx = Context(
                topic=entry.topic,
                group=self.sub.group,
                shard=entry.shard,
                entry_id=str(entry.entry_id),
                resource_id=env.resource_id,
                event_id_bytes=env.event_id,
                event_type=env.event_type,
                published_at_ms=env.time_ms,
                headers=env.headers,
                attempt=attempt,
                fencing_token=token,
                consumer_id=self.runner.consumer_id,
            )
            args = (replayed.event, ctx) if self.sub.takes_context else (replayed.event,)
            try:
                if inspect.iscoroutinefunction(self.sub.handler):
                    await self.sub.handler(*args)
                else:
                    await anyio.to_thread.run_sync(partial(self.sub.handler, *args))
                return
            except Exception as exc:
                if attempt == self.max_attempts:
                    await self.dead_letter(entry, exc, attempt)
                    return
                delay = min(
                    self.settings.retry_max_s, self.settings.retry_base_s * 2 ** (attempt - 1)
                )
                await anyio.sleep(delay * random.uniform(0.5, 1.0))

    async def dead_letter(self, entry: ArchivedEntry, exc: BaseException, attempts: int) -> None:
        log.error(
            "catch-up: %s entry %s of shard %d dead-lettered: %r",
            entry.topic,
            entry.entry_id,
            entry.shard,
            exc,
        )
        fields = dead_letter_fields(
            topic=entry.topic,
            group=self.sub.group,
            shard=entry.shard,
            entry_id=str(entry.entry_id),
            reason="undecodable" if isinstance(exc, DecodeError) else "failed",
            exc=exc,
            attempts=attempts,
            original=entry.fields(),
        )
        fields[b"segment"] = entry.segment.encode()
        await self.runner.redis.xadd(
            self.runner.keys.dead_letter(entry.topic, self.sub.group),
            fields,
            maxlen=self.sub.topic.maxlen,
            approximate=True,
        )

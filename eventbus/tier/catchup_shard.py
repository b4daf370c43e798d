"""Catching one shard up under the group's lock: its pending entries, then what was trimmed after
the group's last-delivered ID (`eventbus.tier.catchup` describes the steps and runs the shards).

`ShardCatchUp` is also the `Fence` of the entries it hands to the handling path: its lease runs
`lease_s` from the send time of the last lock confirmation, as the live consumer's does.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import anyio
import anyio.to_thread
from redis.exceptions import ResponseError

from eventbus.locking.locks import Fenced
from eventbus.protocol.ids import EntryId, parse_id
from eventbus.tier.archived import ArchivedEntry, ReplayFilter, read_segment
from eventbus.tier.catchup_handles import BatchHandle as BatchHandle
from eventbus.tier.catchup_handles import CatchUpStats as CatchUpStats
from eventbus.tier.catchup_handles import Handle as Handle
from eventbus.tier.catchup_handles import RowsHandle as RowsHandle
from eventbus.tier.catchup_handles import redis_entry
from eventbus.tier.catchup_read import archive_pass
from eventbus.tier.errors import CatchUpOutpaced
from eventbus.tier.layout import SegmentRef
from eventbus.tier.metrics import TIER_METRICS
from eventbus.tier.store import list_segments

if TYPE_CHECKING:
    from eventbus.tier.catchup import CatchUp

log = logging.getLogger("eventbus.tier")

TAIL_COUNT = 500  # entries per XRANGE when catch-up reads Redis after the archive
MAX_ROUNDS = 10
"""Default bound on a shard's rounds in one catch-up: passes over the archive (then Redis)
begun because the group's position lay before the stream's first entry. The first is the
catch-up itself; each other means the offloader trimmed past the group again while it caught
up (a handler slower than the publishers for longer than ``hot_window_s``)."""


def _head(info: dict[str, Any]) -> EntryId:
    """The first entry ID of an ``XINFO STREAM`` reply (the next ID when the stream is empty)."""
    first = info.get("first-entry")
    if first is not None:
        return parse_id(first[0])
    return parse_id(info.get("last-generated-id") or b"0-0").next()


class ShardCatchUp:
    """The catch-up of one shard under the group's lock (token `token`); it is the `Fence` of
    the entries it handles: its lease runs `lease_s` from the send time of the last lock
    confirmation, as the live consumer's does, and it lets every entry go once `stopping` is
    set (the live consumer's graceful stop: no handler starts after it, a retry is not tried
    again). `sync` makes at most `max_rounds` passes over the archive (`MAX_ROUNDS`)."""

    def __init__(
        self,
        owner: CatchUp,
        shard: int,
        token: int,
        handle: Handle,
        stats: CatchUpStats,
        *,
        max_rounds: int = MAX_ROUNDS,
        stopping: anyio.Event | None = None,
    ) -> None:
        if max_rounds < 1:
            raise ValueError(f"max_rounds must be >= 1, got {max_rounds}")
        self.o = owner
        self.max_rounds = max_rounds
        self.rounds = 0  # passes over the archive begun by `sync`
        self.shard = shard
        self.token = token
        self.handle = handle
        self.stats = stats
        self.stream = owner.keys.stream(owner.topic, shard)
        self.delivered: EntryId | None = None  # the group's position once this moved it
        self._lease_until = 0.0
        self._stopping = stopping

    def stopped(self) -> bool:
        """Whether the consumer this catch-up runs for is stopping (see the class docstring)."""
        return self._stopping is not None and self._stopping.is_set()

    async def _ack_unhandled(self, ids: list[EntryId], why: str) -> None:
        """Log at ERROR that pending entries `ids` cannot be handled (`why`), then ack them under
        the lock: left pending they would be claimed for ever and hold acked retention back."""
        log.error(
            "catch-up %s/%s shard %d: %d pending entries %s: %s",
            self.o.topic,
            self.o.group,
            self.shard,
            len(ids),
            why,
            [str(i) for i in ids[:5]],
        )
        await self.confirm()
        await self.o.redis.xack(self.stream, self.o.group, *map(str, ids))

    async def confirm(self) -> None:
        """Re-take (refresh) the lock, or with the owner's `revive` False only confirm it
        (`LockClient.confirm`); raise `Fenced` unless it is held with the same token."""
        if self.o.revive:
            grants = await self.o.locks.acquire([self.shard])
            grant = grants.grants.get(self.shard)
            held, sent_at = grant is not None and grant.token == self.token, grants.sent_at
        else:
            sent_at = time.monotonic()
            held = await self.o.locks.confirm(self.shard, self.token)
        if not held:
            self._lease_until = 0.0
            raise Fenced
        self._lease_until = sent_at + self.o.settings.lease_s

    def holds(self, d: object) -> bool:
        return time.monotonic() < self._lease_until and not self.stopped()

    async def wait(self, d: object) -> bool:
        if self.stopped():
            return False
        if self.holds(d):
            return True
        try:
            await self.confirm()
        except Fenced:
            return False
        return True

    async def head(self) -> EntryId:
        """The first entry ID in Redis (the next ID to be generated when the stream is empty)."""
        return _head(await self.o.redis.xinfo_stream(self.stream))

    async def behind(self, delivered: EntryId) -> bool:
        """Whether Redis may lack entries right after the group's position `delivered`: its
        first entry lies after `delivered`'s successor, and entries after `delivered` were
        removed. Entry IDs are times, so a first entry after the successor alone proves
        nothing; the offloader trims only what it archived, so when its checkpoint is at or
        before `delivered`, or there is none, the stream's accounting decides (as the
        offloader's own gap check, `eventbus.tier.gaps.find_gap`): entries ever added, less those
        in Redis, less those the checkpoint accounts for (all at or before `delivered`) were
        removed otherwise (``MAXLEN``, ``XDEL``)."""
        checkpoint = await self.o.checkpoints.read_all(self.shard)  # first: it only grows
        info = await self.o.redis.xinfo_stream(self.stream)
        if _head(info) <= delivered.next():
            return False
        if checkpoint.last is not None and checkpoint.last > delivered:
            return True  # archived entries after the group's position
        # nothing archived after it (or nothing archived yet: a new group at ``0`` on a stream
        # nothing ever left is not behind)
        archived = checkpoint.count if checkpoint.last is not None else 0
        removed = int(info.get("entries-added") or 0) - int(info.get("length") or 0)
        deleted = parse_id(info.get("max-deleted-entry-id") or b"0-0")
        return removed > archived or deleted > delivered

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
        the last segment this catch-up consumed on the shard (cheap on later rounds)."""
        since = self.o.consumed.get(self.shard) if resume else None
        refs = await list_segments(self.o.store, self.o.topic, self.shard, after=since)
        return [r for r in refs if r.last > after]

    async def read(self, ref: SegmentRef, flt: ReplayFilter) -> list[ArchivedEntry]:
        return (await anyio.to_thread.run_sync(read_segment, self.o.store, ref, flt)).entries

    def takes_rows(self) -> bool:
        """Whether the handle takes a segment's rows as read (`RowsHandle`)."""
        return getattr(self.handle, "rows", None) is not None

    async def handle_many(self, entries: Sequence[ArchivedEntry]) -> int:
        """Handle `entries` in order, at once when the handle takes batches (`BatchHandle`),
        else one by one. Returns how many were finished before the rest were let go (a lost
        lock or a stopping consumer: `Fenced` from a per-entry handle), ``len(entries)`` when
        all were. Raises what the handle raises otherwise."""
        batch = getattr(self.handle, "batch", None)
        if batch is not None:
            return int(await batch(entries, self))
        done = 0
        try:
            for entry in entries:
                await self.handle(entry, self)
                done += 1
        except Fenced:
            return done
        return done

    async def start(self) -> EntryId | None:
        """Handle the group's pending entries (`pending`); returns the group's last-delivered ID,
        None when the group has no stream on this shard yet (nothing to do)."""
        delivered = await self.last_delivered()
        if delivered is None:
            log.info(
                "catch-up: group %s has no stream %s yet; nothing to do", self.o.group, self.stream
            )
            return None
        await self.pending()
        return delivered

    async def sync(self, delivered: EntryId) -> EntryId:
        """Bring the group from `delivered` to the stream's last entry: while Redis lacks entries
        after the group's position, every archived entry after it (`after`), then the entries
        Redis holds, up to the last one when called (`tail`). Returns the group's new
        last-delivered ID. Entries trimmed and in no segment are logged and counted as lost
        once; the group then goes on from what Redis holds. Raises `CatchUpOutpaced` instead
        of beginning a pass over the archive past `max_rounds` (counted over this object's
        life): the offloader keeps trimming past the group faster than it catches up."""
        gap_accepted = False
        while True:
            if not gap_accepted and await self.behind(delivered):
                if self.rounds >= self.max_rounds:
                    raise await self.outpaced(delivered)
                self.rounds += 1
                if not await self.after(delivered):
                    gap_accepted = True  # lost before archiving (logged): Redis from its head
                delivered = self.delivered or delivered
                continue
            done = await self.tail(delivered, gap_accepted)
            delivered = self.delivered or delivered
            if done:
                return delivered
            gap_accepted = False  # trimmed while reading Redis: the archive again

    async def outpaced(self, delivered: EntryId) -> CatchUpOutpaced:
        """The error of a shard still behind the stream's first entry after `max_rounds`."""
        first, last = await self.head(), await self.last_entry()
        behind_s = max(0, (last or first).ms - delivered.ms) / 1000
        o = self.o
        return CatchUpOutpaced(
            o.topic, o.group, self.shard, self.rounds, delivered, first, last, behind_s
        )

    async def tail(self, delivered: EntryId, gap_accepted: bool) -> bool:
        """Handle the entries Redis holds after `delivered`, in entry-ID order, up to the
        stream's last entry when called, ``XGROUP SETID`` after each page (`TAIL_COUNT`
        entries) under a confirmed lock. Returns whether the group is caught up: False, leaving
        a page unhandled, when the stream's first entry lies after the group's position once
        the page is read, or after the last page (entries may have been trimmed before it: read
        the archive first), unless `gap_accepted` and no page was handled yet."""
        redis, group = self.o.redis, self.o.group
        last = await self.last_entry()
        while last is not None and delivered < last:
            rows = await redis.xrange(self.stream, f"({delivered}", str(last), count=TAIL_COUNT)
            if not gap_accepted and await self.behind(delivered):
                # checked after the read (trimming only moves the head forward), before an
                # empty page ends the tail: the rest may have been trimmed, not handled
                return False
            if not rows:
                break
            gap_accepted = False
            entries = [redis_entry(self.o.topic, self.shard, parse_id(i), f) for i, f in rows]
            if await self.handle_many(entries) < len(entries):
                raise Fenced  # let go: the position stays before the page
            await self.confirm()
            delivered = parse_id(rows[-1][0])
            await redis.xgroup_setid(self.stream, group, str(delivered))
            self.delivered = delivered
            self.stats.from_redis += len(rows)
        # done unless the offloader trimmed past the group meanwhile (entries added after the
        # last one read, archived and trimmed): then the archive again
        return gap_accepted or not await self.behind(delivered)

    async def last_entry(self) -> EntryId | None:
        """The ID of the stream's last entry, None when it is empty."""
        rows = await self.o.redis.xrevrange(self.stream, count=1)
        return parse_id(rows[0][0]) if rows else None

    async def wait_entries(self, delivered: EntryId, block_ms: int) -> None:
        """Return once the stream holds an entry after `delivered`, or after `block_ms`
        milliseconds (``XREAD BLOCK``: a caught-up shard waits for new entries)."""
        await self.o.redis.xread({self.stream: str(delivered)}, count=1, block=block_ms)

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
                await self._ack_unhandled(
                    missing, "are neither in Redis nor in segments (lost before archiving)"
                )
        n_segment = len(entries)
        deleted = []  # pending but deleted (XDEL) after the stream's head: nothing to handle
        for i in ids:
            if i >= head:
                rows = await redis.xrange(self.stream, str(i), str(i), count=1)
                if rows:
                    entries.append(redis_entry(self.o.topic, self.shard, i, rows[0][1]))
                else:
                    deleted.append(i)
        if deleted:  # acked, so that they do not stay pending (and hold acked retention) for ever
            await self._ack_unhandled(deleted, "were deleted from the stream")
        for entry in entries:
            await self.handle(entry, self)
            await self.confirm()
            await redis.xack(self.stream, group, str(entry.entry_id))
            self.stats.pending_acked += 1
        self.stats.from_segments += n_segment
        self.stats.from_redis += len(entries) - n_segment
        TIER_METRICS.caught_up.labels(self.o.topic).inc(n_segment)

    async def after(self, delivered: EntryId) -> bool:
        """If Redis lacks entries after `delivered`, handle every archived entry after it, to
        the end of the archive (`eventbus.tier.catchup_read.archive_pass`). Returns whether
        Redis lacked entries after `delivered` and segments held them; False when Redis held
        everything after it, or the missing entries are in no segment (lost: logged and
        counted)."""
        return await archive_pass(self, delivered)

"""Reading a consumer's shards: consumer groups, pending-entry recovery, ``XREADGROUP``.

Recovery: a new owner of a shard lock claims the shard's pending entries list (PEL) with
``XAUTOCLAIM <stream> <group> <me> 0 0-0`` (min idle 0: holding the lock makes it the rightful
owner; Redis docs, XAUTOCLAIM) and queues them before reading anything new, so per-resource order
holds across a crash, a pause, or a graceful leave (which leaves read-but-unstarted entries).

Reads: one ``XREADGROUP ... BLOCK`` over the held shards on a single node. A Redis Cluster refuses
a multi-slot XREADGROUP, so there every held stream is read with BLOCK at once, each on a
connection of its own to its node, the first to return entries ending the others
(`cluster_reads`): no polling.

Fenced delivery: Redis does not fence XREADGROUP, so a stale consumer's read that lands late (a
process paused between its lease check and the send, a request delayed in the network past the
TTL) delivers entries into *its* pending entries list while this consumer holds the shard. Every
read that returns entries of a shard is therefore followed (after the read on the server) by an
``XPENDING`` summary of that shard (packed once per shard; a summary with nothing pending, or
only ours, is passed over with two tests): entries pending for any other consumer are claimed
(``XCLAIM ... 0``) and merged, by entry ID, with what was read, before anything is dispatched.
A late read that lands after that summary took entries newer than those just read; the next
read that returns entries of the shard claims them with its summary, and they are still older
than that read's entries. So no later entry of a resource is dispatched before an earlier one,
on a single node and on a Cluster (the summary follows the read on the stream's own node). A
read that returns nothing of a shard has nothing to order: on a single node its summary is skipped,
but for a sweep (every `SWEEP_EVERY` reads and `SWEEP_S` at the most often), so that a late read
into a shard that gets nothing more is still handled. The summaries of shards that gave entries
to each of the last `AHEAD_AFTER` reads go in the read's round trip, the others that got entries
in a second one (`Streaks`).
(On a Cluster each blocking read carries its shard's summary.) See docs/protocol.md, "Fenced
delivery".

Redelivery: entries read with ``>`` are first deliveries (count 1); claimed entries carry the
PEL's delivery count (``XPENDING`` times-delivered), so a handler can tell a redelivery.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from redis.exceptions import ConnectionError as RedisConnectionError

from eventbus.client.pipelines import HeldConnection, Packed, execute
from eventbus.consumer.cluster_reads import BlockingReads
from eventbus.consumer.raw_replies import name_of, others_of, parse_xread, strays
from eventbus.consumer.read_summaries import Streaks
from eventbus.consumer.shards import HeldShard
from eventbus.locking.member import Member
from eventbus.ops.metrics import METRICS
from eventbus.protocol.ids import parse_id as id_key

log = logging.getLogger("eventbus.consumer")

Entries = list[tuple[bytes, dict[bytes, bytes] | None]]
Counts = Mapping[bytes, int]
"""Delivery counts by entry ID, for entries delivered more than once."""
Dispatch = Callable[[HeldShard, Entries, Counts], None]

_STRAYS_PAGE = 1000

SWEEP_EVERY = 8
SWEEP_S = 1.0
"""A single node's read round summarizes the PEL of every stream read, not only of those that
returned entries, once at least `SWEEP_EVERY` reads and `SWEEP_S` seconds passed since the last
such sweep: a late read into a stream that gets nothing more is claimed within that many reads,
and a busy consumer's sweeps cost a few commands a second (`Reader._read_round`)."""


@dataclass(slots=True)
class Read:
    """What one read got from one shard stream, in entry-ID order."""

    stream: bytes
    entries: Entries
    counts: dict[bytes, int] = field(default_factory=dict)


class Reader:
    """Reads for `member` over its topic's shard `streams` (``NOACK`` reads with `noack`)."""

    command = "XREADGROUP"  # what a refusal names (`supervision.refused`)

    def __init__(self, member: Member, streams: list[str], *, noack: bool, count: int) -> None:
        """`count`: XREADGROUP's COUNT, entries per shard stream per read (`read_count`, or a
        batch subscriber's `max_batch` when larger, so that its batches can fill)."""
        self.redis, self.group, self.consumer_id = member.redis, member.group, member.consumer_id
        self.streams = streams
        self.noack = noack
        settings = member.settings
        self.count = count
        self.cluster = settings.cluster
        self.start_id = "0" if settings.start == "beginning" else "$"
        self._m_lost = METRICS.lost.labels(member.topic, member.group)
        self.blocking = BlockingReads(member, self.count, noack)
        self._conn = HeldConnection(self.redis)  # a single node's read rounds, one at a time
        # XREADGROUP's arguments up to BLOCK's value, and NOACK's, packed once
        self._xreadgroup: tuple[Any, ...] = (
            *("XREADGROUP", "GROUP", self.group, self.consumer_id),
            *("COUNT", self.count, "BLOCK"),
        )
        self._noack = ("NOACK",) if noack else ()
        self._me = self.consumer_id.encode()
        # a single node's XPENDING summaries, packed once per shard stream
        self._summaries = {s: Packed.of("XPENDING", s, self.group) for s in streams}
        # the streams whose summaries go with their next read (`Streaks`); `_rounds` counts the
        # reads toward the sweep that summarizes every stream read (`SWEEP_EVERY`, `SWEEP_S`),
        # due at monotonic time `_sweep_at`
        self._streaks = Streaks()
        self._rounds = 0
        self._sweep_at = 0.0

    async def aclose(self) -> None:
        """Close the connections of blocking reads on a Cluster (`cluster_reads`), and give a
        single node's read connection back to the pool."""
        await self.blocking.aclose()
        await self._conn.aclose()

    async def ensure_groups(self, streams: list[str] | None = None, start: str = "") -> None:
        """``XGROUP CREATE ... MKSTREAM`` on every shard stream, or on `streams`, at `start`
        (default: `Settings.start`'s); BUSYGROUP: it exists."""
        pipe = self.redis.pipeline(transaction=False)
        for stream in self.streams if streams is None else streams:
            pipe.xgroup_create(stream, self.group, id=start or self.start_id, mkstream=True)
        for result in await pipe.execute(raise_on_error=False):
            if isinstance(result, Exception) and "BUSYGROUP" not in str(result):
                raise result

    async def regroup(self) -> list[str]:
        """After NOGROUP: create the group again on every shard stream. A stream that no
        longer exists (Redis lost its data: FLUSHALL, a restart without persistence, a failover
        to an empty replica) gets it from its start, ``0``, so that nothing published since is
        skipped; a stream that still exists (the group alone was deleted) from `Settings.start`,
        as at first. Returns the streams that had vanished."""
        pipe = self.redis.pipeline(transaction=False)
        for stream in self.streams:
            pipe.exists(stream)
        there = await execute(pipe)
        vanished = [s for s, n in zip(self.streams, there, strict=True) if not n]
        await self.ensure_groups(vanished, start="0")
        await self.ensure_groups([s for s in self.streams if s not in vanished])
        return vanished

    async def recover(
        self, shards: list[HeldShard], dispatch: Dispatch, held: Callable[[HeldShard], bool]
    ) -> None:
        """Claim and dispatch the PEL of `shards`, in entry-ID order, page by page; the first
        page of every shard goes in one pipeline (most PELs are empty), and so do the delivery
        counts of the first pages that claimed entries (a takeover of many shards: one round
        trip, not one per shard). A shard for which `held` turns False is left (the next owner
        claims its entries again). Raises what the client raises: the caller must not read a
        shard whose recovery failed."""
        pipe = self.redis.pipeline(transaction=False)
        for h in shards:
            pipe.xautoclaim(h.stream, self.group, self.consumer_id, 0, "0-0", count=self.count)
        pages = await execute(pipe)
        first_counts = await self._first_counts(shards, pages)
        for i, (h, page) in enumerate(zip(shards, pages, strict=True)):
            cursor, entries, deleted = page
            counts: dict[bytes, int] | None = first_counts.get(i, {})
            while True:
                if counts is None:
                    counts = await self._counts(h.stream, entries) if entries else {}
                if not held(h):
                    break
                if entries:
                    log.info(
                        "consumer %s recovers %d pending entries of shard %d",
                        self.consumer_id,
                        len(entries),
                        h.shard,
                    )
                    dispatch(h, entries, counts)
                if deleted:
                    self._m_lost.inc(len(deleted))
                    log.error(
                        "shard %s: %d pending entries were trimmed before being processed "
                        "(stream cap too small?): %s",
                        h.stream,
                        len(deleted),
                        deleted[:5],
                    )
                if cursor in (b"0-0", "0-0"):
                    break
                cursor, entries, deleted = await self.redis.xautoclaim(
                    h.stream, self.group, self.consumer_id, 0, cursor, count=self.count
                )
                counts = None

    async def read(self, shards: list[HeldShard], block_ms: int) -> list[Read]:
        """New entries (``>``) of `shards`, blocking at most `block_ms` ms when there are none,
        merged with the entries stale reads of other consumers left pending (see the module
        docstring). `shards` must be held, and recovered, by this consumer."""
        check = not self.noack  # NOACK reads leave no pending entries
        streams = [h.stream for h in shards]
        if not self.cluster:  # one round trip, packed by hiredis, parsed in raw_replies
            replies, strays = await self._read_round(streams, block_ms, check)
        else:  # a Cluster: one blocking read per stream at once (`cluster_reads`)
            replies, summaries = await self.blocking.read(streams, block_ms)
            strays = {i: others_of(s, self._me) for i, s in enumerate(summaries)}
        reads = {stream: Read(stream, entries) for stream, entries in replies if entries}
        for i, names in strays.items():
            if names:
                await self._claim_strays(shards[i], names, reads)
        return list(reads.values())

    async def _read_round(
        self, streams: list[str], block_ms: int, check: bool
    ) -> tuple[list[tuple[bytes, Any]], dict[int, list[bytes]]]:
        """A single node's read round: ``XREADGROUP`` then, with `check`, the ``XPENDING`` summaries
        the fenced delivery needs (docs/protocol.md): of each stream the read returned entries of,
        and of every stream read on a sweep (`SWEEP_EVERY`, `SWEEP_S`: so that a late read into a
        stream that gets nothing more is not stranded). The summaries of the streams that gave
        entries to each of their last `AHEAD_AFTER` reads are sent with the read, in its round
        trip; those of the others that got entries follow in a second one (still after the read on
        the server, which is all the check needs). Returns the read's reply (`parse_xread`'s
        shape) and, by index in `streams`, the names of the other consumers with entries pending
        there. An error reply to the read is raised; one to a summary too, or, when the read
        delivered entries, a `redis.exceptions.ConnectionError` (the read loop then forgets the
        shards and claims their PELs again, as after a lost reply: the entries read cannot be
        checked, so they are not dispatched)."""
        read = (*self._xreadgroup, block_ms, *self._noack, "STREAMS", *streams)
        commands: list[Any] = [(*read, *(">",) * len(streams))]
        ahead: list[int] = []  # indexes in `streams` of the summaries sent with the read
        if check:
            self._rounds += 1
            if self._rounds >= SWEEP_EVERY and time.monotonic() >= self._sweep_at:
                self._rounds, self._sweep_at = 0, time.monotonic() + SWEEP_S
                ahead = list(range(len(streams)))
            else:
                ahead = self._streaks.ahead(streams)
            summaries = self._summaries
            commands += [summaries[streams[i]] for i in ahead]
        got, *rest = await self._conn.execute(commands, raise_on_error=False)
        if isinstance(got, Exception):
            raise got
        replies = parse_xread(got)
        if not check:
            return replies, {}
        read_from = {name_of(stream) for stream, rows in replies if rows}
        self._streaks.update(streams, read_from)
        sent = set(ahead)
        after = [i for i, s in enumerate(streams) if s in read_from and i not in sent]
        if after:  # entries of streams not summarized with the read: summarize them now
            summaries = self._summaries
            rest += await self._conn.execute(
                [summaries[streams[i]] for i in after], raise_on_error=False
            )
            ahead += after
        bad = next((r for r in rest if isinstance(r, Exception)), None)
        if bad is not None:
            if read_from:
                raise RedisConnectionError(
                    f"entries read, then an XPENDING summary failed ({type(bad).__name__}: "
                    f"{bad}): the PELs are claimed again"
                ) from bad
            raise bad
        return replies, {ahead[i]: names for i, names in strays(rest, self._me).items()}

    async def _claim_strays(
        self, h: HeldShard, others: list[bytes], reads: dict[bytes, Read]
    ) -> None:
        """Claim the entries of `h`'s stream pending for the consumers `others` and merge them
        into `reads` by entry ID."""
        for name in others:
            rows = await self._pending_of(h.stream, name)
            if not rows:
                continue
            ids = [row["message_id"] for row in rows]
            claimed = await self.redis.xclaim(h.stream, self.group, self.consumer_id, 0, ids)
            if not claimed:
                continue
            log.warning(
                "consumer %s claims %d entries of shard %d left pending for %s by a late read",
                self.consumer_id,
                len(claimed),
                h.shard,
                name.decode("utf-8", "replace"),
            )
            stream = h.stream.encode()
            read = reads.setdefault(stream, Read(stream, []))
            read.entries = sorted([*read.entries, *claimed], key=lambda e: id_key(e[0]))
            read.counts.update((row["message_id"], int(row["times_delivered"]) + 1) for row in rows)

    async def _pending_of(self, stream: str, consumer: bytes) -> list[Any]:
        """Every entry of `stream` pending for `consumer`, page by page (all of them must be
        merged before this read's entries are dispatched)."""
        rows: list[Any] = []
        start: bytes | str = "-"
        while True:
            page = await self.redis.xpending_range(
                stream, self.group, start, "+", _STRAYS_PAGE, consumername=consumer
            )
            rows += page
            if len(page) < _STRAYS_PAGE:
                return rows
            start = b"(" + page[-1]["message_id"]

    async def _first_counts(
        self, shards: list[HeldShard], pages: list[Any]
    ) -> dict[int, dict[bytes, int]]:
        """Delivery counts of the entries claimed by the first ``XAUTOCLAIM`` page of each of
        `shards` (`pages`, in the same order), by index, in one pipeline; only the indexes whose
        page claimed entries."""
        claimed = [
            (i, h.stream, page[1])
            for i, (h, page) in enumerate(zip(shards, pages, strict=True))
            if page[1]
        ]
        if not claimed:
            return {}
        pipe = self.redis.pipeline(transaction=False)
        for _, stream, entries in claimed:
            pipe.xpending_range(
                stream, self.group, entries[0][0], entries[-1][0], len(entries), self.consumer_id
            )
        rows = await execute(pipe)
        return {
            i: {row["message_id"]: int(row["times_delivered"]) for row in page}
            for (i, _, _), page in zip(claimed, rows, strict=True)
        }

    async def _counts(self, stream: str, entries: Entries) -> dict[bytes, int]:
        """Delivery counts of claimed `entries` (first to last) from the PEL."""
        rows = await self.redis.xpending_range(
            stream, self.group, entries[0][0], entries[-1][0], len(entries), self.consumer_id
        )
        return {row["message_id"]: int(row["times_delivered"]) for row in rows}

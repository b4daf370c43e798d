"""The offloader's steps on one held shard: recover, detect gaps, read, write, commit, trim.

`OffloadShard` (`eventbus.tier.offload_state`) is the offload state of a shard whose
``_offloader`` lock this offloader holds (dropped with the lock); `ShardOffload` runs the steps of
docs/tier.md on it for one topic:
`recover` (finish a pending intent, adopt segments stored past the checkpoint), then each round
`work` (gap detection, `fill` by ``XRANGE``, `write` as intent → put create-only → commit, `trim`).
Gaps are accounted and recorded by its `ShardGaps` (`eventbus.tier.shard_gaps`). The
`eventbus.tier.offloader` module docstring describes the life of a shard.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from itertools import accumulate
from typing import TYPE_CHECKING

import anyio
import anyio.to_thread
from redis.exceptions import ResponseError

from eventbus.client.pipelines import execute_packed
from eventbus.protocol.ids import EntryId, parse_id
from eventbus.protocol.retention import acked_point
from eventbus.tier.checkpoint import Checkpoints, Intent
from eventbus.tier.dictionaries import archive_dictionaries
from eventbus.tier.gaps import Gap, find_gap, gap_json
from eventbus.tier.layout import SegmentRef, segment_key
from eventbus.tier.metrics import TIER_METRICS
from eventbus.tier.offload_state import (
    OffloadShard,
    Row,
    dictionary_rows,
    row_bytes,
    rows_bytes,
)
from eventbus.tier.segment import SegmentInfo
from eventbus.tier.segment_columns import entry_columns
from eventbus.tier.segment_read import decode_segment
from eventbus.tier.segment_write import encode_columns
from eventbus.tier.shard_gaps import ShardGaps
from eventbus.tier.store import get_bytes, list_segments, put_create

if TYPE_CHECKING:
    from eventbus.tier.offloader import Offloader

log = logging.getLogger("eventbus.tier")

_MAX_SEGMENTS_PER_ROUND = 8  # per shard, so one backlog does not starve the other shards


class ShardOffload:
    """The steps of offloading a held shard of `topic`, for `owner` (its Redis client, store,
    tier settings, stats and test hook)."""

    def __init__(self, owner: Offloader, topic: str) -> None:
        self.o = owner
        self.topic = topic
        self.checkpoints = Checkpoints(owner.redis, owner.keys, topic)
        self.gaps = ShardGaps(owner, topic, self.checkpoints)

    # -- recovery -------------------------------------------------------------------------------
    async def recover(self, sh: OffloadShard) -> None:
        """Store the record of a gap accounted but not yet recorded (its owner stopped in
        between), finish a pending intent, then adopt segments stored past the checkpoint."""
        cp = await self.checkpoints.read(sh.shard)
        sh.reset_to(cp.last, cp.count)
        if cp.gap is not None:
            await self.gaps.record(sh, cp.gap)
        if cp.pending is not None:
            await self.finish(sh, cp.pending)
        after = None if sh.checkpoint is None else SegmentRef(sh.checkpoint, sh.checkpoint, "")
        for ref in await list_segments(self.o.store, self.topic, sh.shard, after=after):
            if sh.checkpoint is not None and ref.first <= sh.checkpoint:
                continue
            rows = await self.verify_existing(ref.key, sh.shard, ref.first, ref.last)
            log.warning(
                "offloader %s adopts %s, stored past the checkpoint of %s shard %d",
                self.o.consumer_id,
                ref.key,
                self.topic,
                sh.shard,
            )
            await self.commit(sh, ref.last, rows, adopted=True)
        sh.recovered = True

    async def verify_existing(self, key: str, shard: int, first: EntryId, last: EntryId) -> int:
        """Read and verify an existing segment; returns its row count. Raises `CorruptSegment`
        (an object under our key that is not a whole, valid segment is never adopted)."""
        data = await get_bytes(self.o.store, key)
        _, info = await anyio.to_thread.run_sync(
            lambda: decode_segment(
                data, key, expect=(self.topic, shard, first, last), columns=["entry_id"]
            )
        )
        return info.entries

    async def finish(self, sh: OffloadShard, intent: Intent) -> None:
        """Complete a pending intent: same range, same key; adopt the object if it exists."""
        rows = await self.xrange(sh.stream, str(intent.first), str(intent.last), None)
        key = segment_key(self.topic, sh.shard, intent.first, intent.last)
        log.warning(
            "offloader %s finishes pending segment %s (%d of %d entries still in Redis)",
            self.o.consumer_id,
            key,
            len(rows),
            intent.entries,
        )
        stored: int | None = None
        if rows:
            stored = await self.put(sh, intent, rows, key)
        else:
            try:
                stored = await self.verify_existing(key, sh.shard, intent.first, intent.last)
                self._count_adopted()
            except FileNotFoundError:
                stored = None
        if stored is None or stored < intent.entries:
            lost = intent.entries - (stored or 0)
            after = intent.first.prev() if intent.first > EntryId(0, 0) else intent.first
            reason = "trimmed from Redis while its segment was being written"
            gap = self.gaps.new_gap(after, intent.last.next(), lost, reason, sh)
            # accounted with the commit, in one step: a crash after it leaves the unrecorded
            # gap (not the intent) to the next owner, so the loss is counted once
            await self.commit(sh, intent.last, intent.entries, gap=gap)
        else:
            await self.commit(sh, intent.last, stored or 0)

    # -- steady state ---------------------------------------------------------------------------
    async def work(self, sh: OffloadShard, now_ms: int, flush: bool) -> bool:
        """One round on `sh`: record a gap if one opened, read, write the segments that are
        due (all buffered entries with `flush`), trim. Returns True if a segment was written or
        there is more to read right away."""
        tier = self.o.tier
        if sh.unrecorded is not None:  # its record failed to store last round
            await self.gaps.record(sh, sh.unrecorded)
        try:
            info = await self.o.redis.xinfo_stream(sh.stream)
        except ResponseError:  # no such key: nothing published on this shard yet
            return False
        found = find_gap(info, sh.read_to, sh.count, len(sh.buffer))
        if found is not None:
            after, before, lost, reason = found
            if not await self.gaps.account(sh, after, before, lost, reason):
                return True  # the state moved: resynced, the next round checks again
        written = 0
        more = False
        while written < _MAX_SEGMENTS_PER_ROUND:
            more = await self.fill(sh)
            if not sh.buffer:
                break
            age_ms = now_ms - parse_id(sh.buffer[0][0]).ms
            full = (
                len(sh.buffer) >= tier.segment_max_entries
                or sh.buffer_bytes >= tier.segment_max_bytes
            )
            if not (full or flush or age_ms >= tier.segment_max_age_s * 1000):
                break
            await self.write(sh)
            written += 1
        await self.trim(sh, now_ms)
        return written > 0 or more

    async def fill(self, sh: OffloadShard) -> bool:
        """Read entries after `read_to` until the buffer is full. Returns True when the buffer
        filled up before the stream ran out (there is more to read)."""
        tier = self.o.tier
        while (
            len(sh.buffer) < tier.segment_max_entries and sh.buffer_bytes < tier.segment_max_bytes
        ):
            want = min(tier.read_count, tier.segment_max_entries - len(sh.buffer))
            start = "-" if sh.read_to is None else f"({sh.read_to}"
            rows = await self.xrange(sh.stream, start, "+", want)
            if rows:
                sh.buffer += rows
                sh.buffer_bytes += rows_bytes(rows)
                sh.read_to = parse_id(rows[-1][0])
            if len(rows) < want:
                return False
        return True

    async def xrange(self, stream: str, start: str, end: str, count: int | None) -> list[Row]:
        """XRANGE `stream` `start` `end` (all of it, paged, when `count` is None), as `Row`s:
        on a single node the raw reply (no per-entry parsing)."""
        page = self.o.tier.read_count if count is None else count
        out: list[Row] = []
        while True:
            command = ("XRANGE", stream, start, end, "COUNT", page)
            (rows,) = await execute_packed(self.o.redis, [command])
            out += rows
            if count is not None or len(rows) < page:
                return out
            start = f"({parse_id(rows[-1][0])}"

    async def write(self, sh: OffloadShard) -> None:
        """Archive a prefix of the buffer as one segment: intent, put, commit."""
        tier = self.o.tier
        batch = sh.buffer[: tier.segment_max_entries]
        if sh.buffer_bytes >= tier.segment_max_bytes:  # up to the entry that reaches the size
            sizes = accumulate(row_bytes(batch))
            n = next((i + 1 for i, size in enumerate(sizes) if size >= tier.segment_max_bytes), 0)
            batch = batch[: n or len(batch)]
        n = len(batch)
        intent = Intent(parse_id(batch[0][0]), parse_id(batch[-1][0]), n)
        if not await self.checkpoints.begin(sh.shard, self.o.consumer_id, sh.token, intent):
            # another intent pending, or our buffer is stale: resync
            cp = await self.checkpoints.read(sh.shard)
            sh.reset_to(cp.last, cp.count)
            if cp.pending is not None:
                await self.finish(sh, cp.pending)
            return
        key = segment_key(self.topic, sh.shard, intent.first, intent.last)
        await self.put(sh, intent, batch, key)
        await self.commit(sh, intent.last, n)

    async def put(self, sh: OffloadShard, intent: Intent, rows: Sequence[Row], key: str) -> int:
        """Encode and put `rows` under `key` create-only; returns the rows the stored object
        holds (ours, or those of an identical-range object already there). The columns are
        built and encoded in a worker thread: Parquet encoding and zstd run without the GIL,
        while the event loop reads the next pages of the other shards."""
        o = self.o
        used = dictionary_rows(rows)
        if used:
            await archive_dictionaries(o.redis, o.keys, o.store, self.topic, used)
        typed = o.typed.get(self.topic)

        def encode() -> tuple[bytes, SegmentInfo]:
            ids, fields = [r[0] for r in rows], [r[1] for r in rows]
            cols = entry_columns(self.topic, sh.shard, ids, fields, typed)
            tier = o.tier
            return encode_columns(
                *(self.topic, sh.shard, intent.first, intent.last, cols),
                zstd_level=tier.zstd_level,
                typed=typed,
                rebuild_data=tier.rebuild_data,
            )

        data, info = await anyio.to_thread.run_sync(encode)
        if info.typed_invalid:
            log.warning(
                "segment %s: %d of %d entries did not validate against the topic's models "
                "(typed columns null, typed_error says why; data keeps them)",
                key,
                info.typed_invalid,
                info.entries,
            )
        await o.hook("before_put", sh.shard, key)
        started = time.monotonic()
        created = await put_create(o.store, key, data)
        TIER_METRICS.put_seconds.labels(self.topic).observe(time.monotonic() - started)
        await o.hook("after_put", sh.shard, key)
        if not created:
            stored = await self.verify_existing(key, sh.shard, intent.first, intent.last)
            log.warning("segment %s already stored (retry or rival offloader): adopted", key)
            self._count_adopted()
            return stored
        labels = TIER_METRICS
        labels.segments.labels(self.topic).inc()
        labels.entries.labels(self.topic).inc(info.entries)
        labels.raw_bytes.labels(self.topic).inc(info.raw_bytes)
        labels.stored_bytes.labels(self.topic).inc(len(data))
        o.stats.segments += 1
        o.stats.entries += info.entries
        o.stats.raw_bytes += info.raw_bytes
        o.stats.stored_bytes += len(data)
        return info.entries

    async def commit(
        self,
        sh: OffloadShard,
        last: EntryId,
        entries: int,
        adopted: bool = False,
        gap: Gap | None = None,
    ) -> None:
        """Commit the checkpoint to `last`, `entries` accounted (fenced); with `gap` (entries of
        the range lost, counted in `entries`), account it in the same step, then record it."""
        body = None if gap is None else gap_json(gap)
        me = self.o.consumer_id
        if not await self.checkpoints.commit(sh.shard, me, sh.token, last, entries, body):
            # another gap is unrecorded (not expected: recover and work record it first)
            await self.gaps.record_unrecorded(sh)
            if not await self.checkpoints.commit(sh.shard, me, sh.token, last, entries, body):
                raise RuntimeError(f"{self.checkpoints.key} {sh.shard}:gap is set again")
        if adopted:
            self._count_adopted()
        cp = await self.checkpoints.read(sh.shard)
        sh.reset_to(cp.last, cp.count)
        if gap is not None and body is not None and cp.gap == body:
            sh.unrecorded = body
            await self.o.hook("gap_accounted", sh.shard, gap.key)
            await self.gaps.record(sh, body)
        await self.o.hook("after_commit", sh.shard, str(last))

    def _count_adopted(self) -> None:
        TIER_METRICS.adopted.labels(self.topic).inc()
        self.o.stats.adopted += 1

    async def trim(self, sh: OffloadShard, now_ms: int) -> None:
        """``XTRIM MINID`` to the smaller of just after the checkpoint and now minus the hot
        window (`now_ms`: Redis server time, Unix ms), and, for a topic with retention "acked"
        (`eventbus.protocol.retention`), not past what a consumer group still needs."""
        if sh.checkpoint is None:
            return
        hot_edge = EntryId(max(0, now_ms - int(self.o.tier.hot_window_s * 1000)), 0)
        minid = min(sh.checkpoint.next(), hot_edge)
        if self.topic in self.o.acked_topics:  # retention "acked": keep what a group needs
            needed = await acked_point(self.o.redis, sh.stream)
            if needed is not None:
                minid = min(minid, needed)
        approximate = not self.o.tier.trim_exact
        # An approximate trim evicts at most LIMIT entries per call (Redis's default: 100 x
        # stream-node-max-entries, 10,000): repeat until a call evicts nothing, so a long
        # backlog leaves Redis in one round while each call stays short. An exact trim has no
        # such limit.
        while await self.o.redis.xtrim(sh.stream, minid=str(minid), approximate=approximate):
            if not approximate:
                break

"""How many entries a stream query has waiting in a shard: its lag, by which
``maxOffsetsPerTrigger`` is split over shards as Kafka's source splits it over partitions
(`eventbus.spark.offsets.share`).

Kafka offsets are numbers, so a partition's lag is a subtraction; entry IDs are not, so the
entries of a shard in (``after``, ``head``] are counted: the archived ones from segment footers
(the row count in each segment's Parquet metadata, read once per segment and remembered:
segments never change) and, for a segment only partly in the range, from its entry-ID columns;
the ones in Redis after the archive's end with `stream_count`, whose cost is the shorter of the
range and the rest of the stream. The counts are exact while nothing is added, archived or
trimmed during the count, else close: they only weigh the split, which never exceeds the limit.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pyarrow.parquet as pq

from eventbus.protocol.ids import ZERO, EntryId, parse_id
from eventbus.spark.objects import Objects
from eventbus.spark.reading import parquet_footer
from eventbus.tier.layout import SegmentRef

PAGE = 1000
"""Entries per ``XRANGE`` page when counting a stream's entries."""


def segment_ids(objects: Objects, ref: SegmentRef, after: EntryId) -> list[EntryId]:
    """The entry IDs of segment `ref` after `after`, in order (reads its two ID columns)."""
    table = pq.read_table(io.BytesIO(objects.get(ref.key)), columns=["entry_ms", "entry_seq"])
    pairs = zip(
        table.column("entry_ms").to_pylist(), table.column("entry_seq").to_pylist(), strict=True
    )
    return [e for e in (EntryId(ms, seq) for ms, seq in pairs) if e > after]


def stream_count(redis: Any, stream: str, after: EntryId, upto: EntryId, page: int = PAGE) -> int:
    """The number of entries of `stream` in (`after`, `upto`] (`after` ZERO: from the start).

    Pages through the range with ``XRANGE ... COUNT page`` and, in the same round trips, through
    the entries outside it (up to `after`, and after `upto`); whichever finishes first gives the
    count (the range's entries, or ``XLEN`` less those outside), so a shard far behind costs the
    pages of the short rest of its stream, not of its backlog. Raises redis-py's errors."""
    if upto <= after:
        return 0
    inside = _Pager(f"({after}" if after > ZERO else "-", str(upto))
    below = _Pager("-", str(after), done=after == ZERO)
    above = _Pager(f"({upto}", "+")
    while True:
        pipe = redis.pipeline(transaction=False)
        pipe.xlen(stream)
        pagers = [p for p in (inside, below, above) if not p.done]
        for p in pagers:
            pipe.xrange(stream, p.low, p.high, count=page)
        length, *replies = pipe.execute()
        for p, reply in zip(pagers, replies, strict=True):
            p.take(reply, page)
        if inside.done:
            return inside.count
        if below.done and above.done:
            return max(0, int(length) - below.count - above.count)


class _Pager:
    """One ``XRANGE`` walk: the next page's bounds, the entries counted so far."""

    def __init__(self, low: str, high: str, done: bool = False) -> None:
        self.low, self.high, self.done, self.count = low, high, done, 0

    def take(self, reply: Sequence[Any], page: int) -> None:
        self.count += len(reply)
        if len(reply) < page:
            self.done = True
        else:
            self.low = f"({parse_id(reply[-1][0])}"


class Backlog:
    """Counts a stream query's waiting entries per shard; remembers each segment's entry count
    (segments are immutable), so a segment's footer is read once per query run."""

    def __init__(self) -> None:
        self._entries: dict[str, int] = {}

    def __getstate__(self) -> dict[str, Any]:  # tasks get the reader without the cache
        return {"_entries": {}}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._entries = dict(state["_entries"])

    def entries(self, objects: Objects, refs: Sequence[SegmentRef]) -> list[int]:
        """The number of entries in each of `refs` (footers read, eight at a time, only for
        segments not counted before). Raises `StoreError`."""
        new = [r for r in refs if r.key not in self._entries]
        if len(new) > 1:
            with ThreadPoolExecutor(8) as pool:
                counts = list(pool.map(lambda r: parquet_footer(objects, r).num_rows, new))
        else:
            counts = [parquet_footer(objects, r).num_rows for r in new]
        self._entries.update((r.key, int(n)) for r, n in zip(new, counts, strict=True))
        return [self._entries[r.key] for r in refs]

    def lag(
        self,
        objects: Objects,
        redis: Any,
        stream: str,
        refs: Sequence[SegmentRef],
        after: EntryId,
        head: EntryId,
        cp: EntryId | None,
    ) -> int:
        """A shard's entries in (`after`, `head`]: those of its segments `refs` (the listing,
        in key order) up to the archive's end `cp`, then, with `redis`, those of `stream` after
        `cp`. Without `redis` the archive is all there is. Raises `StoreError`, redis-py's
        errors."""
        archived = [
            r
            for r in refs
            if r.last > after
            and r.first <= head
            and (redis is None or (cp is not None and r.last <= cp))
        ]
        whole = [r for r in archived if r.first > after and r.last <= head]
        count = sum(self.entries(objects, whole))
        for ref in archived:
            if ref.first <= after or ref.last > head:  # partly in the range
                count += sum(1 for e in segment_ids(objects, ref, after) if e <= head)
        if redis is None:
            return count
        low = max(after, cp) if cp is not None else after
        return count + stream_count(redis, stream, low, head)

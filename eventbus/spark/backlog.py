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

A segment's entry IDs, needed when a query's offset lies inside it, are read once per process
(`segment_ids`: segments are immutable, so they are cached by store, key and size, least
recently used evicted past `IDS_CACHED` IDs) and searched by bisection, not re-read at every
trigger. ``XRANGE`` pages start at `FIRST_PAGE` entries and double up to `PAGE`: a shard nearly
caught up (the usual case) is counted from a few entries, not from pages of a thousand.
"""

from __future__ import annotations

import io
import threading
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple, overload

from eventbus.protocol.ids import ZERO, EntryId, parse_id
from eventbus.spark.objects import Objects, parquet_footer
from eventbus.tier.layout import SegmentRef
from eventbus.tier.store import describe

PAGE = 1000
"""Entries per ``XRANGE`` page when counting a stream's entries, at most."""
FIRST_PAGE = 32
"""Entries of the first ``XRANGE`` page of each range counted (then doubled up to `PAGE`)."""
IDS_CACHED = 2_000_000
"""Segment entry IDs kept per process (16 bytes each: 32 MB), least recently used evicted."""


class SegmentIds:
    """The entry IDs of one segment, in order, as two compact arrays (ms, seq)."""

    __slots__ = ("ms", "seq")

    def __init__(self, ms: array[int], seq: array[int]) -> None:
        self.ms, self.seq = ms, seq

    def __len__(self) -> int:
        return len(self.ms)

    def at(self, i: int) -> EntryId:
        return EntryId(self.ms[i], self.seq[i])

    def index_after(self, e: EntryId) -> int:
        """The index of the first ID after `e` (the length when none is), by bisection."""
        lo, hi = 0, len(self.ms)
        while lo < hi:
            mid = (lo + hi) // 2
            if (self.ms[mid], self.seq[mid]) <= e:
                lo = mid + 1
            else:
                hi = mid
        return lo


class IdsAfter(Sequence[EntryId]):
    """The entry IDs of a segment after a given one, in order: a view of its `SegmentIds`."""

    def __init__(self, ids: SegmentIds, start: int) -> None:
        self.ids, self.start = ids, start

    def __len__(self) -> int:
        return len(self.ids) - self.start

    @overload
    def __getitem__(self, i: int) -> EntryId: ...
    @overload
    def __getitem__(self, i: slice) -> list[EntryId]: ...
    def __getitem__(self, i: int | slice) -> EntryId | list[EntryId]:
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"index {i} out of range for {n} entry IDs")
        return self.ids.at(self.start + (i % n))

    def count_upto(self, head: EntryId) -> int:
        """How many of these IDs are at or before `head`."""
        return max(0, self.ids.index_after(head) - self.start)


class _IdsCache:
    """Segments' `SegmentIds` by (store, key, size), at most `limit` IDs in all (LRU)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._lock = threading.Lock()
        # each entry keeps the store named by its id (a memory store) alive: no id reuse
        self._ids: OrderedDict[tuple[str, str, int], tuple[SegmentIds, Any]] = OrderedDict()
        self._size = 0

    def get(self, objects: Objects, ref: SegmentRef) -> SegmentIds:
        """The IDs of segment `ref`, its two ID columns read on a miss. Raises `StoreError`,
        pyarrow's errors for a damaged segment."""
        key = (_store_name(objects.store), ref.key, ref.size)
        with self._lock:
            cached = self._ids.get(key)
            if cached is not None:
                self._ids.move_to_end(key)
                return cached[0]
        ids = _read_ids(objects, ref)
        with self._lock:
            if key not in self._ids:
                self._ids[key] = (ids, objects.store)
                self._size += len(ids)
            while self._size > self.limit and len(self._ids) > 1:
                _, (old, _store) = self._ids.popitem(last=False)
                self._size -= len(old)
        return ids


_CACHE = _IdsCache(IDS_CACHED)


def _store_name(store: Any) -> str:
    """Names `store` for the cache: its location (folder, bucket and endpoint), or the object's
    id for another kind (a memory store; the cache keeps it alive, so the id is not reused)."""
    name = describe(store)
    if name.startswith("s3://"):
        return f"{name} at {store.config.get('endpoint', '')}"
    if name.startswith("file://"):
        return name
    return f"{name}@{id(store):x}"


def _read_ids(objects: Objects, ref: SegmentRef) -> SegmentIds:
    import pyarrow.parquet as pq  # here: a stream without maxOffsetsPerTrigger never counts

    table = pq.read_table(io.BytesIO(objects.get(ref.key)), columns=["entry_ms", "entry_seq"])
    return SegmentIds(
        array("q", table.column("entry_ms").to_pylist()),
        array("q", table.column("entry_seq").to_pylist()),
    )


def segment_ids(objects: Objects, ref: SegmentRef, after: EntryId) -> IdsAfter:
    """The entry IDs of segment `ref` after `after`, in order (a `Sequence`). The segment's two
    ID columns are read once per process (segments are immutable: cached by store, key and
    size). Raises `StoreError`, pyarrow's errors for a damaged segment."""
    ids = _CACHE.get(objects, ref)
    return IdsAfter(ids, ids.index_after(after))


def stream_count(redis: Any, stream: str, after: EntryId, upto: EntryId, page: int = PAGE) -> int:
    """The number of entries of `stream` in (`after`, `upto`] (`after` ZERO: from the start).

    Pages through the range with ``XRANGE ... COUNT`` (`FIRST_PAGE`, doubled each round up to
    `page`) and, in the same round trips, through the entries outside it (up to `after`, and
    after `upto`); whichever finishes first gives the count (the range's entries, or ``XLEN``
    less those outside), so a shard far behind costs the pages of the short rest of its
    stream, not of its backlog, and a shard nearly caught up a page of a few entries per
    walk. Raises redis-py's errors."""
    if upto <= after:
        return 0
    first = min(FIRST_PAGE, page)
    inside = _Pager(f"({after}" if after > ZERO else "-", str(upto), first)
    below = _Pager("-", str(after), first, done=after == ZERO)
    above = _Pager(f"({upto}", "+", first)
    while True:
        pipe = redis.pipeline(transaction=False)
        pipe.xlen(stream)
        pagers = [p for p in (inside, below, above) if not p.done]
        for p in pagers:
            pipe.xrange(stream, p.low, p.high, count=p.count_next)
        length, *replies = pipe.execute()
        for p, reply in zip(pagers, replies, strict=True):
            p.take(reply, page)
        if inside.done:
            return inside.count
        if below.done and above.done:
            return max(0, int(length) - below.count - above.count)


def stream_nth(
    redis: Any, stream: str, after: EntryId, upto: EntryId, n: int, page: int = PAGE
) -> EntryId | None:
    """The ID of the `n`-th entry (``n >= 1``) of `stream` in (`after`, `upto`] (`after` ZERO:
    from the start), the range's last entry when it holds fewer, None when it holds none.

    ``XRANGE ... COUNT`` pages of at most `page` entries, each starting after the last one's
    ID, so a trigger limit of millions never holds more than a page of entries in memory
    (Redis has no ID-only range read: the entries come with their fields). Entries trimmed
    between two pages are not seen, so the ID found is then past the `n`-th of the range as it
    was: the offloader trims only what it archived, and those entries are read from its
    segments, so a micro-batch cut here holds them too (docs/spark.md, ``maxOffsetsPerTrigger``).
    Raises `ValueError` for `n` or `page` below 1, and redis-py's errors."""
    if n < 1 or page < 1:
        raise ValueError(f"stream_nth: n and page must be at least 1, got n={n}, page={page}")
    found = None
    low = f"({after}" if after > ZERO else "-"
    left = n
    while left > 0:
        count = min(left, page)
        reply = redis.xrange(stream, low, str(upto), count=count)
        if not reply:
            break
        found = parse_id(reply[-1][0])
        left -= len(reply)
        if len(reply) < count:
            break
        low = f"({found}"
    return found


class _Pager:
    """One ``XRANGE`` walk: the next page's bounds and COUNT, the entries counted so far."""

    def __init__(self, low: str, high: str, first: int, done: bool = False) -> None:
        self.low, self.high, self.done, self.count = low, high, done, 0
        self.count_next = first

    def take(self, reply: Sequence[Any], page: int) -> None:
        """Count `reply`, the page asked for; the next is twice as long, up to `page`."""
        self.count += len(reply)
        if len(reply) < self.count_next:
            self.done = True
        else:
            self.low = f"({parse_id(reply[-1][0])}"
            self.count_next = min(page, 2 * self.count_next)


class Span(NamedTuple):
    """One shard's entries in (`after`, `head`] as a stream query sees them: its segments
    `refs` (the listing, in key order) up to the archive's end `cp`, then, with `redis` (None:
    the archive is all there is), those of `stream` after `cp`. `Backlog.lag`'s arguments."""

    objects: Objects
    redis: Any
    stream: str
    refs: Sequence[SegmentRef]
    after: EntryId
    head: EntryId
    cp: EntryId | None


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
                count += segment_ids(objects, ref, after).count_upto(head)
        if redis is None:
            return count
        low = max(after, cp) if cp is not None else after
        return count + stream_count(redis, stream, low, head)

    def nth(self, span: Span, n: int) -> EntryId:
        """The `n`-th entry ID of `span`'s shard after its ``after`` (or its ``head`` if there
        are fewer): in its segments up to the archive's end, then, with Redis, in its stream
        after that end. Raises `StoreError`, redis-py's errors."""
        objects, redis, stream, refs, after, head, cp = span
        left = n
        last = after
        for ref in refs:
            if ref.last <= after or (redis is not None and (cp is None or ref.last > cp)):
                continue
            if ref.first > after:
                (count,) = self.entries(objects, [ref])
                if count <= left:
                    left -= count
                    last = ref.last
                    if left == 0:
                        return last
                    continue
            ids = segment_ids(objects, ref, after)
            if len(ids) >= left:
                return ids[left - 1]
            left -= len(ids)
            last = ref.last
        if redis is None:
            return min(last, head) if left < n else head
        start = max(after, cp) if cp is not None else after
        found = stream_nth(redis, stream, start, head, left)
        return found if found is not None else max(last, start)

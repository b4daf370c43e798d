"""Archived entries: what replay yields (`ArchivedEntry`), how it is narrowed (`ReplayFilter`),
and reading the matching entries of one segment (`read_segment`, `read_batch`).

Every segment read is verified (`decode_segment`): a corrupt or truncated one raises
`CorruptSegment` naming its key, never yields wrong data. A segment is filtered on its Arrow
columns (the ID range by bisecting the ordered ID columns, resource IDs and event types with
``is_in``) and its matching rows become `ArchivedEntry`s column by column, not row by row.
"""

from __future__ import annotations

import bisect
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import repeat
from typing import Any, NamedTuple

import msgspec
import pyarrow as pa
import pyarrow.compute as pc

from eventbus.errors import DecodeError
from eventbus.protocol.codec import F_DATA, F_RESOURCE, F_TYPE, Envelope, decode_entry
from eventbus.protocol.ids import EntryId
from eventbus.tier.errors import CorruptSegment
from eventbus.tier.gc_pause import paused_gc
from eventbus.tier.layout import SegmentRef
from eventbus.tier.segment_read import decode_segment, decode_segment_batches
from eventbus.tier.store import Store, get_bytes_sync

_MAX_ID = EntryId((1 << 64) - 1, (1 << 64) - 1)
_MIN_ID = EntryId(0, 0)


class ArchivedEntry(msgspec.Struct, frozen=True, gc=False):
    """One archived stream entry. `segment` is the key of the object it came from.

    Times are Unix milliseconds: `entry_id.ms` is Redis's clock when the entry was added,
    `published_at_ms` the publisher's (the segment column ``event_time_ms``). `event_id` is the
    event's UUID, as `Context.event_id`. Envelope-derived fields are None when the entry's
    envelope did not decode when it was archived.

    Immutable, compared field by field. A `msgspec.Struct`, not a dataclass: replay builds
    one per entry, several times faster (``gc=False``: nothing it holds refers back to it).
    """

    topic: str
    shard: int
    entry_id: EntryId
    resource_id: str | None
    event_type: str | None
    published_at_ms: int | None
    event_id: uuid.UUID | None
    headers: dict[str, str] | None
    data: bytes
    segment: str

    def fields(self) -> dict[bytes, bytes]:
        """The entry's field map as it was in the stream (``rid``, ``type``, ``data``)."""
        out = {F_DATA: self.data}
        if self.resource_id is not None:
            out[F_RESOURCE] = self.resource_id.encode()
        if self.event_type is not None:
            out[F_TYPE] = self.event_type.encode()
        return out

    def envelope(self) -> Envelope:
        """The decoded envelope. Raises `DecodeError` naming the segment and entry."""
        try:
            return decode_entry(self.fields())
        except DecodeError as exc:
            raise DecodeError(f"{self.segment} entry {self.entry_id}: {exc}") from None


@dataclass(frozen=True, slots=True)
class ReplayFilter:
    """Which entries to replay; every condition set must hold.

    `start_id` / `end_id`: entry-ID range, both inclusive. `since_ms` (inclusive) / `until_ms`
    (exclusive): entry time range in Unix ms. `resource_ids`, `event_types`: allowed values.
    """

    start_id: EntryId | None = None
    end_id: EntryId | None = None
    since_ms: int | None = None
    until_ms: int | None = None
    resource_ids: frozenset[str] | None = None
    event_types: frozenset[str] | None = None

    @property
    def lower(self) -> EntryId:
        """The smallest entry ID that can match."""
        low = self.start_id or EntryId(0, 0)
        if self.since_ms is not None:
            low = max(low, EntryId(self.since_ms, 0))
        return low

    @property
    def upper(self) -> EntryId:
        """The largest entry ID that can match."""
        high = self.end_id or _MAX_ID
        if self.until_ms is not None:  # (an entry of 0-0 cannot exist: XADD refuses that ID)
            high = min(high, EntryId(self.until_ms, 0).prev() if self.until_ms > 0 else _MIN_ID)
        return high

    def overlaps(self, ref: SegmentRef) -> bool:
        """Whether segment `ref` may hold matching entries (from its key's range alone)."""
        return ref.last >= self.lower and ref.first <= self.upper


class SegmentEntries(NamedTuple):
    """What `read_segment` gives: the matching entries, and how many the segment holds."""

    entries: list[ArchivedEntry]
    """The entries that match the filter, in entry-ID order."""
    held: int
    """The entries the segment holds, matching or not (for `check_complete`)."""


class EntryBatch:
    """Consecutive matching rows of one segment (`read_batch`), in entry-ID order: the Arrow
    rows (segment columns), their ID columns (``ms``, ``seq``: what a merge across shards
    orders them by), and what names them. `entries` makes them `ArchivedEntry`s, only when
    they are handed on (a merge holds Arrow rows, not Python objects, for the shards it
    waits on)."""

    __slots__ = ("last", "ms", "n", "rows", "segment", "seq", "shard", "topic")

    def __init__(self, rows: pa.Table, topic: str, shard: int, segment: str) -> None:
        self.rows, self.topic, self.shard, self.segment = rows, topic, shard, segment
        self.n = rows.num_rows
        empty = pa.array([], pa.int64())
        self.ms = rows.column("entry_ms").chunk(0) if self.n else empty
        self.seq = rows.column("entry_seq").chunk(0) if self.n else empty
        self.last = self.id_at(self.n - 1) if self.n else _MIN_ID  # (0-0: no entry has it)

    def id_at(self, i: int) -> EntryId:
        """The entry ID of row `i`."""
        return EntryId(self.ms[i].as_py(), self.seq[i].as_py())

    def after(self, entry_id: EntryId, lo: int = 0) -> int:
        """The first row from `lo` whose ID is after `entry_id` (bisecting: rows are ordered)."""
        return bisect.bisect_right(range(self.n), entry_id, lo=lo, key=self.id_at)

    def slice(self, start: int, stop: int) -> EntryBatch:
        """Rows ``start:stop`` (no copy)."""
        return EntryBatch(
            self.rows.slice(start, stop - start), self.topic, self.shard, self.segment
        )

    def stream_entries(self) -> tuple[list[bytes], list[dict[bytes, bytes]]]:
        """The rows as their stream held them: each entry's ID (``b"<ms>-<seq>"``) and field
        map (what `ArchivedEntry.fields` gives), made column by column without the
        `ArchivedEntry`s (no UUIDs, headers, ID tuples): what catch-up hands the handling
        path, which decodes the entry from its fields as a live read's. Raises
        `CorruptSegment` for an ``event_id`` that is not a UUID, as `entries` does."""
        rows = self.rows
        if not self.n:
            return [], []
        event_ids = rows.column("event_id")
        if not pc.all(pc.match_substring_regex(event_ids, _UUID_TEXT)).as_py():
            _uuids(event_ids, self.segment)  # another spelling, or not a UUID: its error
        ids = pc.binary_join_element_wise(
            rows.column("entry_ms").cast(pa.string()),
            rows.column("entry_seq").cast(pa.string()),
            "-",
        )
        rid, kind = rows.column("resource_id"), rows.column("event_type")
        with paused_gc():  # a dict per row: no cycles
            datas = rows.column("data").to_pylist()
            rids = rid.cast(pa.binary()).to_pylist()
            kinds = kind.cast(pa.binary()).to_pylist()
            if rid.null_count or kind.null_count:
                fields = list(map(_fields, datas, rids, kinds))
            else:
                fields = [
                    {F_DATA: d, F_RESOURCE: r, F_TYPE: t}
                    for d, r, t in zip(datas, rids, kinds, strict=True)
                ]
            return ids.cast(pa.binary()).to_pylist(), fields

    def entries(self, start: int = 0, stop: int | None = None) -> list[ArchivedEntry]:
        """Rows ``start:stop`` as `ArchivedEntry`s, built column by column. Raises
        `CorruptSegment` for an ``event_id`` that is not a UUID."""
        stop = self.n if stop is None else stop
        rows = self.rows if (start, stop) == (0, self.n) else self.rows.slice(start, stop - start)
        with paused_gc():
            return _entries(rows, self.topic, self.shard, self.segment)


_UUID_TEXT = "^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$"
"""A UUID's usual spelling (`stream_entries` checks the column against it in Arrow; a value
that does not match is checked as `entries` converts it)."""


def _fields(data: bytes, rid: bytes | None, kind: bytes | None) -> dict[bytes, bytes]:
    """An entry's field map, as `ArchivedEntry.fields` (the fields the stream entry had)."""
    out = {F_DATA: data}
    if rid is not None:
        out[F_RESOURCE] = rid
    if kind is not None:
        out[F_TYPE] = kind
    return out


_NEW_ID = tuple.__new__  # EntryId(ms, seq) without its Python-level __new__: in C, via map


def _ids(ms: list[int], seq: list[int]) -> list[EntryId]:
    return list(map(_NEW_ID, repeat(EntryId), zip(ms, seq, strict=True)))


def _bounds(table: pa.Table, low: EntryId, high: EntryId, ref: SegmentRef) -> tuple[int, int]:
    """The rows ``start:stop`` of `table` (ordered by entry ID, `decode_segment` checked it)
    whose IDs lie within `low`..`high`, found by bisecting the ID columns."""
    n = table.num_rows
    if n == 0 or (ref.first >= low and ref.last <= high):
        return 0, n
    ms = table.column("entry_ms")
    seq = table.column("entry_seq")

    def key(i: int) -> EntryId:
        return EntryId(ms[i].as_py(), seq[i].as_py())

    start = bisect.bisect_left(range(n), low, key=key) if ref.first < low else 0
    stop = bisect.bisect_right(range(start, n), high, key=key) + start if ref.last > high else n
    return start, stop


def _uuids(column: Any, key: str) -> list[uuid.UUID | None]:
    """The ``event_id`` column (UUID text, null where the envelope did not decode) as UUIDs:
    converted in one call (msgspec, in C), entry by entry only for nulls or odd spellings.
    Raises `CorruptSegment` for a value that is not a UUID."""
    texts = column.to_pylist()
    if not column.null_count:
        try:
            return msgspec.convert(texts, list[uuid.UUID])  # type: ignore[no-any-return]
        except msgspec.ValidationError:
            pass  # a spelling msgspec refuses (braces, urn:): uuid.UUID's rules, below
    try:
        return [None if t is None else uuid.UUID(t) for t in texts]
    except ValueError as exc:
        raise CorruptSegment(
            key, f"column event_id holds a value that is not a UUID: {exc}"
        ) from None


def _headers(maps: pa.MapArray) -> list[dict[str, str] | None]:
    """The ``headers`` column as dicts (None where null); without a Python list per row when
    no row has a header (the common case)."""
    offsets = maps.offsets
    if not maps.null_count and offsets[0].as_py() == offsets[len(maps)].as_py():
        return list(map(dict, repeat((), len(maps))))
    return [None if m is None else dict(m) for m in maps.to_pylist()]


def _entries(table: pa.Table, topic: str, shard: int, key: str) -> list[ArchivedEntry]:
    """The rows of `table` (segment columns) as `ArchivedEntry`s, built column by column."""
    n = table.num_rows
    if n == 0:
        return []
    return list(
        map(
            ArchivedEntry,
            repeat(topic, n),
            repeat(shard, n),
            _ids(table.column("entry_ms").to_pylist(), table.column("entry_seq").to_pylist()),
            table.column("resource_id").to_pylist(),
            table.column("event_type").to_pylist(),
            table.column("event_time_ms").to_pylist(),
            _uuids(table.column("event_id"), key),
            _headers(table.column("headers").combine_chunks()),
            table.column("data").to_pylist(),
            repeat(key, n),
        )
    )


def read_batch(
    store: Store, ref: SegmentRef, flt: ReplayFilter | None = None
) -> tuple[EntryBatch, int]:
    """The rows of segment `ref` that match `flt`, as one `EntryBatch`, and the segment's entry
    count (matching or not). The object is verified against its key (`decode_segment`); the
    rows are filtered on their Arrow columns. Raises as `read_segment`."""
    data = get_bytes_sync(store, ref.key)
    table, info = decode_segment(data, ref.key, expect=ref.span)
    table = _filtered(table, flt or ReplayFilter(), ref)
    return EntryBatch(table.combine_chunks(), info.topic, info.shard, ref.key), info.entries


def open_batches(
    data: bytes, ref: SegmentRef, flt: ReplayFilter | None, rows: int
) -> tuple[int, Iterator[EntryBatch]]:
    """Segment `ref`'s bytes `data` opened as `EntryBatch`es of its rows that match `flt`,
    each cut from a record batch of at most `rows` rows as it is decoded and verified
    (`decode_segment_batches`), none empty; and the segment's entry count (matching or not).
    Raises `CorruptSegment`: here for the file's checks, from the iterator for a batch's."""
    info, tables = decode_segment_batches(data, ref.key, expect=ref.span, batch_rows=rows)
    return info.entries, _matching(tables, info.topic, info.shard, ref, flt or ReplayFilter())


def _matching(
    tables: Iterator[pa.Table], topic: str, shard: int, ref: SegmentRef, flt: ReplayFilter
) -> Iterator[EntryBatch]:
    for table in tables:
        table = _filtered(table, flt, ref)
        if table.num_rows:
            yield EntryBatch(table.combine_chunks(), topic, shard, ref.key)


def _filtered(table: pa.Table, flt: ReplayFilter, ref: SegmentRef) -> pa.Table:
    """The rows of `table` (of segment `ref`, in entry-ID order) that match `flt`."""
    start, stop = _bounds(table, flt.lower, flt.upper, ref)
    if (start, stop) != (0, table.num_rows):
        table = table.slice(start, stop - start)
    mask = None
    if flt.resource_ids is not None:
        mask = pc.is_in(table["resource_id"], pa.array(sorted(flt.resource_ids), pa.string()))
    if flt.event_types is not None:
        m = pc.is_in(table["event_type"], pa.array(sorted(flt.event_types), pa.string()))
        mask = m if mask is None else pc.and_(mask, m)
    return table if mask is None else table.filter(mask)


def read_segment(store: Store, ref: SegmentRef, flt: ReplayFilter | None = None) -> SegmentEntries:
    """The entries of segment `ref` that match `flt`, as `ArchivedEntry`s in entry-ID order, and
    the segment's entry count. The object is verified against its key (`decode_segment`).

    Raises `CorruptSegment` (naming the key) when the object is damaged, `FileNotFoundError`
    when it vanished, `StoreError` on other store failures.
    """
    batch, held = read_batch(store, ref, flt)
    return SegmentEntries(batch.entries(), held)

"""Archived entries: what replay yields (`ArchivedEntry`), how it is narrowed (`ReplayFilter`),
and reading the matching entries of one segment (`read_segment`).

Every segment read is verified (`decode_segment`): a corrupt or truncated one raises
`CorruptSegment` naming its key, never yields wrong data.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import NamedTuple

import pyarrow as pa
import pyarrow.compute as pc

from eventbus.errors import DecodeError
from eventbus.protocol.codec import F_DATA, F_RESOURCE, F_TYPE, Envelope, decode_entry
from eventbus.protocol.ids import EntryId
from eventbus.tier.errors import CorruptSegment
from eventbus.tier.layout import SegmentRef
from eventbus.tier.segment import decode_segment
from eventbus.tier.store import Store, get_bytes_sync

_MAX_ID = EntryId((1 << 64) - 1, (1 << 64) - 1)
_MIN_ID = EntryId(0, 0)


@dataclass(frozen=True, slots=True)
class ArchivedEntry:
    """One archived stream entry. `segment` is the key of the object it came from.

    Times are Unix milliseconds: `entry_id.ms` is Redis's clock when the entry was added,
    `published_at_ms` the publisher's (the segment column ``event_time_ms``). `event_id` is the
    event's UUID, as `Context.event_id`. Envelope-derived fields are None when the entry's
    envelope did not decode when it was archived.
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


def read_segment(store: Store, ref: SegmentRef, flt: ReplayFilter | None = None) -> SegmentEntries:
    """The entries of segment `ref` that match `flt`, as `ArchivedEntry`s in entry-ID order, and
    the segment's entry count. The object is verified against its key (`decode_segment`).

    Raises `CorruptSegment` (naming the key) when the object is damaged or holds what the
    offloader never writes (an event ID that is not a UUID), `FileNotFoundError`
    when it vanished, `StoreError` on other store failures.
    """
    data = get_bytes_sync(store, ref.key)
    table, info = decode_segment(data, ref.key, expect=ref.span)
    flt = flt or ReplayFilter()
    mask = None
    if flt.resource_ids is not None:
        mask = pc.is_in(table["resource_id"], pa.array(sorted(flt.resource_ids), pa.string()))
    if flt.event_types is not None:
        m = pc.is_in(table["event_type"], pa.array(sorted(flt.event_types), pa.string()))
        mask = m if mask is None else pc.and_(mask, m)
    if mask is not None:
        table = table.filter(mask)
    cols = {name: table[name].to_pylist() for name in table.column_names}
    low, high = flt.lower, flt.upper
    check_range = ref.first < low or ref.last > high
    out = []
    for ms, seq, rid, etype, etime, eid, headers, payload in zip(
        cols["entry_ms"],
        cols["entry_seq"],
        cols["resource_id"],
        cols["event_type"],
        cols["event_time_ms"],
        cols["event_id"],
        cols["headers"],
        cols["data"],
        strict=True,
    ):
        entry_id = EntryId(ms, seq)
        if check_range and not low <= entry_id <= high:
            continue
        try:  # written by the offloader from a decoded envelope: anything else is tampering
            event_id = None if eid is None else uuid.UUID(eid)
        except ValueError:
            raise CorruptSegment(
                ref.key, f"entry {entry_id}: event_id {eid!r:.60} is not a UUID"
            ) from None
        out.append(
            ArchivedEntry(
                topic=info.topic,
                shard=info.shard,
                entry_id=entry_id,
                resource_id=rid,
                event_type=etype,
                published_at_ms=etime,
                event_id=event_id,
                headers=None if headers is None else dict(headers),
                data=payload,
                segment=ref.key,
            )
        )
    return SegmentEntries(out, info.entries)

"""Replay: read a topic's archived entries back from segments, in entry-ID order.

* `iter_shard` yields one shard's entries in entry-ID order;
* `iter_topic` yields every shard's, either merged into one entry-ID order across shards
  (``merge=True``, a k-way `heapq.merge`; ties between shards broken by shard index) or shard
  after shard;
* `iter_events` decodes them into the same pydantic events live consumers get.

`ReplayFilter` narrows by entry-ID range, entry time (the ID's millisecond part: when Redis
accepted the entry, Unix ms), resource IDs and event types. Segments outside the ID or time range
are skipped by their key alone, without being fetched. Every segment read is verified
(`decode_segment`): a corrupt or truncated one raises `CorruptSegment` naming its key, never
yields wrong data. The iterators are synchronous (threads prefetch the next segments); async code
runs them with ``anyio.to_thread``.
"""

from __future__ import annotations

import heapq
import json
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

import pyarrow as pa
import pyarrow.compute as pc
from pydantic import BaseModel, ValidationError

from eventbus.codec import F_DATA, F_RESOURCE, F_TYPE, Envelope, decode_entry, event_type_of
from eventbus.errors import DecodeError
from eventbus.keys import check_name
from eventbus.tier.errors import TierError
from eventbus.tier.ids import EntryId
from eventbus.tier.layout import GAP_FOLDER, SegmentRef
from eventbus.tier.segment import decode_segment
from eventbus.tier.store import (
    Store,
    get_bytes_sync,
    list_keys_sync,
    list_segments_sync,
    list_shards_sync,
)

_MAX_ID = EntryId((1 << 64) - 1, (1 << 64) - 1)
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class ArchivedEntry:
    """One archived stream entry. `segment` is the key of the object it came from.

    Times are Unix milliseconds: `entry_id.ms` is Redis's clock when the entry was added,
    `event_time_ms` the publisher's. Envelope-derived fields are None when the entry's envelope
    did not decode when it was archived.
    """

    topic: str
    shard: int
    entry_id: EntryId
    resource_id: str | None
    event_type: str | None
    event_time_ms: int | None
    event_id: str | None
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
        if self.until_ms is not None:
            high = min(high, EntryId(self.until_ms, 0).prev() if self.until_ms > 0 else high)
        return high

    def overlaps(self, ref: SegmentRef) -> bool:
        """Whether segment `ref` may hold matching entries (from its key's range alone)."""
        return ref.last >= self.lower and ref.first <= self.upper


def plan(
    store: Store,
    topic: str,
    flt: ReplayFilter | None = None,
    shards: Sequence[int] | None = None,
) -> dict[int, list[SegmentRef]]:
    """The segments a replay of `topic` will read, per shard, in entry-ID order (listed once;
    use it to size a progress bar: `SegmentRef.size` is in bytes). Raises `InvalidName` for a
    topic name that cannot exist (``..``), `StoreError`."""
    check_name("topic", topic)
    flt = flt or ReplayFilter()
    chosen = list(shards) if shards is not None else list_shards_sync(store, topic)
    return {
        s: [ref for ref in list_segments_sync(store, topic, s) if flt.overlaps(ref)] for s in chosen
    }


def read_segment(
    store: Store, ref: SegmentRef, flt: ReplayFilter | None = None
) -> list[ArchivedEntry]:
    """The entries of one segment that match `flt`, as `ArchivedEntry`s in entry-ID order.

    Raises `CorruptSegment` (naming the key) when the object is damaged, `FileNotFoundError`
    when it vanished, `StoreError` on other store failures.
    """
    return _read_segment(store, ref, flt)[0]


def _read_segment(
    store: Store, ref: SegmentRef, flt: ReplayFilter | None = None
) -> tuple[list[ArchivedEntry], int]:
    """`read_segment`, and the number of entries the segment holds (before filtering)."""
    data = get_bytes_sync(store, ref.key)
    table, info = decode_segment(data, ref.key, expect=(ref.topic, ref.shard, ref.first, ref.last))
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
        out.append(
            ArchivedEntry(
                info.topic,
                info.shard,
                entry_id,
                rid,
                etype,
                etime,
                eid,
                None if headers is None else dict(headers),
                payload,
                ref.key,
            )
        )
    return out, info.entries


def _prefetched(
    pool: ThreadPoolExecutor,
    refs: Iterable[SegmentRef],
    load: Callable[[SegmentRef], T],
    depth: int,
) -> Iterator[T]:
    pending: deque[Future[T]] = deque()
    it = iter(refs)
    try:
        for ref in it:
            pending.append(pool.submit(load, ref))
            if len(pending) > depth:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    finally:
        for fut in pending:
            fut.cancel()


def iter_shard(
    store: Store,
    topic: str,
    shard: int,
    flt: ReplayFilter | None = None,
    *,
    refs: Sequence[SegmentRef] | None = None,
    on_segment: Callable[[SegmentRef], None] | None = None,
    prefetch: int = 1,
    pool: ThreadPoolExecutor | None = None,
    counts: dict[int, int] | None = None,
) -> Iterator[ArchivedEntry]:
    """One shard's matching entries in entry-ID order. `refs` (from `plan`) skips the listing;
    `on_segment` is called after each segment is consumed (progress); `counts[shard]` is
    increased by the entries each segment read holds, matching or not (for
    `check_complete`). Raises `CorruptSegment`, `StoreError`."""
    flt = flt or ReplayFilter()
    if refs is None:
        refs = [r for r in list_segments_sync(store, topic, shard) if flt.overlaps(r)]
    own = pool is None
    executor = pool or ThreadPoolExecutor(max(1, prefetch), thread_name_prefix="eventbus-replay")
    try:
        last: EntryId | None = None
        for ref, (entries, held) in zip(
            refs,
            _prefetched(executor, refs, lambda r: _read_segment(store, r, flt), prefetch),
            strict=True,
        ):
            if counts is not None:
                counts[shard] = counts.get(shard, 0) + held
            for entry in entries:
                if last is not None and entry.entry_id <= last:  # overlapping segments
                    continue
                last = entry.entry_id
                yield entry
            if on_segment is not None:
                on_segment(ref)
    finally:
        if own:
            executor.shutdown(wait=True, cancel_futures=True)


def iter_topic(
    store: Store,
    topic: str,
    flt: ReplayFilter | None = None,
    *,
    shards: Sequence[int] | None = None,
    merge: bool = True,
    segments: Mapping[int, Sequence[SegmentRef]] | None = None,
    on_segment: Callable[[SegmentRef], None] | None = None,
    counts: dict[int, int] | None = None,
) -> Iterator[ArchivedEntry]:
    """Every matching entry of `topic`: merged across shards by entry ID (`merge`, ties by
    shard index) or shard after shard. `segments` is a `plan` to reuse; `counts` is filled as
    in `iter_shard`. Raises `CorruptSegment`, `StoreError`."""
    flt = flt or ReplayFilter()
    planned = segments if segments is not None else plan(store, topic, flt, shards)
    with ThreadPoolExecutor(4, thread_name_prefix="eventbus-replay") as pool:
        per_shard = [
            iter_shard(
                store, topic, s, flt, refs=refs, on_segment=on_segment, pool=pool, counts=counts
            )
            for s, refs in sorted(planned.items())
        ]
        if merge:
            yield from heapq.merge(*per_shard, key=lambda e: (e.entry_id, e.shard))
        else:
            for it in per_shard:
                yield from it


class ArchiveGap(TierError):
    """A shard's segments hold fewer entries than its offloader checkpoint accounts for: a
    segment was deleted (or never readable) in the shard's range, so a replay has a hole.
    Carries `topic`, `shard` and the counts."""

    def __init__(self, topic: str, shard: int, accounted: int, archived: int, lost: int) -> None:
        missing = accounted - archived - lost
        super().__init__(
            f"topic {topic!r} shard {shard}: the offloader checkpoint accounts for {accounted} "
            f"entries but the segments hold {archived} (and gap records {lost}): {missing} "
            "entries are missing from the archive (a deleted segment?); restore it, or replay "
            "with --allow-gaps to accept the hole"
        )
        self.topic, self.shard = topic, shard
        self.accounted, self.archived, self.lost = accounted, archived, lost


def recorded_lost(store: Store, topic: str, shard: int) -> int | None:
    """Entries recorded as lost in `shard`'s gap records (None if a record has no count)."""
    total = 0
    for key, _size in list_keys_sync(store, f"{topic}/{shard}/{GAP_FOLDER}/"):
        if not key.endswith(".json"):
            continue
        lost = json.loads(get_bytes_sync(store, key)).get("lost_entries")
        if not isinstance(lost, int):
            return None
        total += lost
    return total


def check_complete(
    store: Store, topic: str, archived: Mapping[int, int], accounted: Mapping[int, int]
) -> list[ArchiveGap]:
    """Compare, per shard, the entries read from its segments (`archived`, from a replay that
    read every segment: `iter_topic(counts=...)` with no ID or time range) plus those recorded
    lost in gap records with what its checkpoint accounts for (`accounted`, the checkpoint
    hash's ``<shard>:count``). Returns one `ArchiveGap` per shard that falls short.

    The segment keys name ranges, not counts, so a missing segment in the middle of a shard
    can only be seen against the checkpoint. Entries the offloader archived after the replay
    listed the store only make the archive look longer, never shorter."""
    gaps = []
    for shard, count in sorted(accounted.items()):
        held = archived.get(shard, 0)
        if held >= count:
            continue
        lost = recorded_lost(store, topic, shard)
        if lost is None or held + lost >= count:
            continue
        gaps.append(ArchiveGap(topic, shard, count, held, lost))
    return gaps


@dataclass(frozen=True, slots=True)
class ReplayedEvent:
    """A decoded event and the archived entry it came from."""

    event: BaseModel
    envelope: Envelope
    entry: ArchivedEntry


def models_by_type(
    models: Iterable[type[BaseModel]] | Mapping[str, type[BaseModel]],
) -> dict[str, type[BaseModel]]:
    """Event type name -> model, named as publishers name them (`event_type_of`)."""
    if isinstance(models, Mapping):
        return dict(models)
    return {event_type_of(m): m for m in models}


def decode_event(entry: ArchivedEntry, models: Mapping[str, type[BaseModel]]) -> ReplayedEvent:
    """Decode `entry` into its model. Raises `DecodeError` naming the segment and entry when the
    envelope is corrupt, the type unknown, or the payload does not validate."""
    env = entry.envelope()
    model = models.get(env.event_type)
    if model is None:
        raise DecodeError(
            f"{entry.segment} entry {entry.entry_id}: no model for event type {env.event_type!r}"
        )
    try:
        return ReplayedEvent(model.model_validate(env.payload), env, entry)
    except ValidationError as exc:
        raise DecodeError(
            f"{entry.segment} entry {entry.entry_id}: payload does not validate as "
            f"{model.__name__}: {exc}"
        ) from None


def iter_events(
    store: Store,
    topic: str,
    models: Iterable[type[BaseModel]] | Mapping[str, type[BaseModel]],
    flt: ReplayFilter | None = None,
    *,
    shards: Sequence[int] | None = None,
    merge: bool = True,
) -> Iterator[ReplayedEvent]:
    """Typed replay: entries whose event type has a model in `models` (others are skipped),
    decoded and validated like a live consumer does. Raises `DecodeError` on an entry that does
    not decode or validate, `CorruptSegment`, `StoreError`."""
    by_type = models_by_type(models)
    types = frozenset(by_type)
    flt = flt or ReplayFilter()
    wanted = types if flt.event_types is None else types & flt.event_types
    narrowed = ReplayFilter(
        flt.start_id, flt.end_id, flt.since_ms, flt.until_ms, flt.resource_ids, frozenset(wanted)
    )
    for entry in iter_topic(store, topic, narrowed, shards=shards, merge=merge):
        yield decode_event(entry, by_type)

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

`ArchivedEntry`, `ReplayFilter` and `read_segment` live in `eventbus.tier.archived`, the
completeness check (`check_complete`, `ArchiveGap`) in `eventbus.tier.completeness`; both are
re-exported here.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

from pydantic import BaseModel, ValidationError

from eventbus.errors import DecodeError
from eventbus.protocol.codec import Envelope, event_type_of
from eventbus.protocol.ids import EntryId
from eventbus.protocol.keys import check_name
from eventbus.tier.archived import ArchivedEntry, ReplayFilter, read_segment
from eventbus.tier.completeness import ArchiveGap, check_complete, recorded_lost
from eventbus.tier.dictionaries import read_from
from eventbus.tier.layout import SegmentRef
from eventbus.tier.store import Store, list_segments_sync, list_shards_sync

T = TypeVar("T")


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
    read_from(store, topic)  # entries compressed with a dictionary: its archived copy
    flt = flt or ReplayFilter()
    chosen = list(shards) if shards is not None else list_shards_sync(store, topic)
    return {
        s: [ref for ref in list_segments_sync(store, topic, s) if flt.overlaps(ref)] for s in chosen
    }


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
            _prefetched(executor, refs, lambda r: read_segment(store, r, flt), prefetch),
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


__all__ = [
    "ArchiveGap",
    "ArchivedEntry",
    "ReplayFilter",
    "ReplayedEvent",
    "check_complete",
    "decode_event",
    "iter_events",
    "iter_shard",
    "iter_topic",
    "models_by_type",
    "plan",
    "read_segment",
    "recorded_lost",
]

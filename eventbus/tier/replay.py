"""Replay: read a topic's archived entries back from segments, in entry-ID order.

* `iter_shard` yields one shard's entries in entry-ID order;
* `iter_topic` yields every shard's, either merged into one entry-ID order across shards
  (``merge=True``, by batch cursors: `merge_batches`; ties between shards broken by shard
  index) or shard after shard;
* `iter_events` decodes them into the same pydantic events live consumers get.

`ReplayFilter` narrows by entry-ID range, entry time (the ID's millisecond part: when Redis
accepted the entry, Unix ms), resource IDs and event types. Segments outside the ID or time range
are skipped by their key alone, without being fetched. Every segment read is verified
(`decode_segment`): a corrupt or truncated one raises `CorruptSegment` naming its key, never
yields wrong data. The iterators are synchronous (threads prefetch the next segments); async code
runs them with ``anyio.to_thread``.

`ArchivedEntry`, `ReplayFilter` and `read_segment` live in `eventbus.tier.archived`, the
completeness check (`check_complete`, `ArchiveGap`) in `eventbus.tier.completeness`, the merge
across shards (`merge_batches`) in `eventbus.tier.merge`, typed decoding (`ReplayedEvent`,
`decode_event`, `models_by_type`) in `eventbus.tier.replay_events`; all are re-exported here.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

from pydantic import BaseModel

from eventbus.protocol.ids import EntryId
from eventbus.protocol.keys import check_name
from eventbus.tier.archived import (
    ArchivedEntry,
    EntryBatch,
    ReplayFilter,
    open_batches,
    read_segment,
)
from eventbus.tier.completeness import ArchiveGap, check_complete, recorded_lost
from eventbus.tier.dictionaries import read_from
from eventbus.tier.layout import SegmentRef
from eventbus.tier.merge import merge_batches
from eventbus.tier.replay_columns import ColumnReplay
from eventbus.tier.replay_events import ReplayedEvent, _Decoder, decode_event, models_by_type
from eventbus.tier.store import Store, get_bytes_sync, list_segments_sync, list_shards_sync

T = TypeVar("T")

BATCH_ROWS = 8192
"""Entries per batch a shard hands to the merge (a segment's matching entries, cut)."""


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


def _segment_reads(
    fetched: Iterator[tuple[SegmentRef, bytes]],
    flt: ReplayFilter,
    typed: ColumnReplay | None = None,
) -> Iterator[tuple[SegmentRef, int, EntryBatch | None]]:
    """Each fetched segment's matching batches as ``(ref, held, batch)``, then ``(ref, held,
    None)`` at its end (`held`: the entries it holds); run a step at a time in a worker
    thread (`_stepped`): decoding, verifying and rebuilding a batch release the GIL. With
    `typed` (a typed replay), batches of `TypedBatch` where the typed columns serve."""
    for ref, data in fetched:
        if typed is None:
            held, batches = open_batches(data, ref, flt, BATCH_ROWS)
        else:
            held, batches = typed.open_batches(data, ref, flt, BATCH_ROWS)
        for batch in batches:
            yield ref, held, batch
        yield ref, held, None


def _stepped(pool: ThreadPoolExecutor, it: Iterator[T]) -> Iterator[T]:
    """The items of `it`, each made in `pool` while the one before is handed on (one ahead)."""
    fut = pool.submit(next, it, None)
    try:
        while (item := fut.result()) is not None:
            fut = pool.submit(next, it, None)
            yield item
    finally:
        if not fut.cancel():
            with contextlib.suppress(Exception):
                fut.result()  # a step under way: `it` cannot be closed while it runs
        it.close()  # type: ignore[attr-defined]


def _shard_batches(
    store: Store,
    refs: Sequence[SegmentRef],
    shard: int,
    flt: ReplayFilter,
    *,
    on_segment: Callable[[SegmentRef], None] | None,
    prefetch: int,
    pool: ThreadPoolExecutor,
    fetch_pool: ThreadPoolExecutor,
    counts: dict[int, int] | None,
    typed: ColumnReplay | None = None,
) -> Iterator[EntryBatch]:
    """One shard's matching rows in entry-ID order, as batches of at most `BATCH_ROWS` (none
    empty). Segments are fetched in `fetch_pool`, `prefetch` ahead, and decoded, verified and
    filtered by record batches in `pool`, a batch ahead of the one handed on; a segment's rows
    start after the previous one's last (overlapping segments give each entry once)."""
    last: EntryId | None = None
    fetched = _prefetched(fetch_pool, refs, lambda r: (r, get_bytes_sync(store, r.key)), prefetch)
    for ref, held, batch in _stepped(pool, _segment_reads(fetched, flt, typed)):
        if batch is None:  # the segment's end
            if counts is not None:
                counts[shard] = counts.get(shard, 0) + held
            if on_segment is not None:
                on_segment(ref)
            continue
        n = batch.n
        start = 0
        if last is not None and batch.id_at(0) <= last:  # overlapping segments
            start = batch.after(last)
        if start < n:
            last = batch.last
            yield batch if start == 0 else batch.slice(start, n)


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
    executor = pool or ThreadPoolExecutor(1, thread_name_prefix="eventbus-replay")
    fetcher = ThreadPoolExecutor(max(1, prefetch), thread_name_prefix="eventbus-fetch")
    try:
        for batch in _shard_batches(
            store,
            refs,
            shard,
            flt,
            on_segment=on_segment,
            prefetch=prefetch,
            pool=executor,
            fetch_pool=fetcher,
            counts=counts,
        ):
            yield from batch.entries()
    finally:
        fetcher.shutdown(wait=True, cancel_futures=True)
        if own:
            executor.shutdown(wait=True, cancel_futures=True)


def _topic_batches(
    store: Store,
    topic: str,
    flt: ReplayFilter,
    *,
    shards: Sequence[int] | None,
    merge: bool,
    segments: Mapping[int, Sequence[SegmentRef]] | None = None,
    on_segment: Callable[[SegmentRef], None] | None = None,
    counts: dict[int, int] | None = None,
    typed: ColumnReplay | None = None,
) -> Iterator[list[Any]]:
    """`iter_topic`'s entries as lists (batches), in the same order; with `typed`, some of
    them already `ReplayedEvent`s (`TypedBatch`)."""
    planned = segments if segments is not None else plan(store, topic, flt, shards)
    with (
        ThreadPoolExecutor(4, thread_name_prefix="eventbus-replay") as pool,
        ThreadPoolExecutor(4, thread_name_prefix="eventbus-fetch") as fetch_pool,
    ):
        per_shard = [
            _shard_batches(
                store,
                refs,
                s,
                flt,
                on_segment=on_segment,
                prefetch=1,
                pool=pool,
                fetch_pool=fetch_pool,
                counts=counts,
                typed=typed,
            )
            for s, refs in sorted(planned.items())
        ]
        if merge:
            yield from merge_batches(per_shard)
        else:
            for it in per_shard:
                for batch in it:
                    yield batch.entries()


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
    shard index; `merge_batches`) or shard after shard. `segments` is a `plan` to reuse;
    `counts` is filled as in `iter_shard`; `on_segment` is called once a segment's entries are
    all handed on (to the merge: a progress bar). Raises `CorruptSegment`, `StoreError`."""
    for batch in _topic_batches(
        store,
        topic,
        flt or ReplayFilter(),
        shards=shards,
        merge=merge,
        segments=segments,
        on_segment=on_segment,
        counts=counts,
    ):
        yield from batch


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
    decoded and validated like a live consumer does (per batch: `_Decoder`), or, where that
    provably gives the same event, built from the segment's typed columns without decoding
    nor validating (`eventbus.tier.replay_columns`). Raises `DecodeError` on an entry that
    does not decode or validate, `CorruptSegment`, `StoreError`."""
    by_type = models_by_type(models)
    types = frozenset(by_type)
    flt = flt or ReplayFilter()
    wanted = types if flt.event_types is None else types & flt.event_types
    narrowed = ReplayFilter(
        flt.start_id, flt.end_id, flt.since_ms, flt.until_ms, flt.resource_ids, frozenset(wanted)
    )
    decoder = _Decoder(by_type)
    typed = ColumnReplay(by_type)
    for batch in _topic_batches(store, topic, narrowed, shards=shards, merge=merge, typed=typed):
        yield from _decoded(decoder, batch)


def _decoded(decoder: _Decoder, batch: list[Any]) -> Iterator[ReplayedEvent]:
    """The events of `batch` in its order: its `ReplayedEvent`s as they are, its
    `ArchivedEntry`s decoded (`_Decoder.decode`); from the first of those that does not
    decode or validate on, entry by entry (`decode_event` raises its `DecodeError`)."""
    plain = [i for i, x in enumerate(batch) if type(x) is not ReplayedEvent]
    if not plain:
        yield from batch
        return
    if len(plain) == len(batch):
        events, ok = decoder.decode(batch)
        yield from events
        if ok < len(batch):
            yield from decoder.decode_each(batch[ok:])
        return
    events, ok = decoder.decode([batch[i] for i in plain])
    out = batch.copy()
    for i, event in zip(plain, events, strict=False):
        out[i] = event
    bad = plain[ok] if ok < len(plain) else len(out)
    yield from out[:bad]
    for x in out[bad:]:
        yield x if type(x) is ReplayedEvent else decode_event(x, decoder.models)


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
    "merge_batches",
    "models_by_type",
    "plan",
    "read_segment",
    "recorded_lost",
]

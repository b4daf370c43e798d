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

import contextlib
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from itertools import compress, count, repeat
from operator import is_, itemgetter
from typing import Any, TypeVar

import msgspec
import pyarrow as pa
import pyarrow.compute as pc
from pydantic import BaseModel, TypeAdapter, ValidationError

from eventbus.errors import DecodeError
from eventbus.protocol.budget import MIN_CONTAINERS
from eventbus.protocol.codec import FORMAT_MSGPACK, Envelope, _Body, event_type_of
from eventbus.protocol.ids import EntryId
from eventbus.protocol.keys import check_name
from eventbus.tier.archived import (
    ArchivedEntry,
    EntryBatch,
    ReplayFilter,
    open_batches,
    paused_gc,
    read_segment,
)
from eventbus.tier.completeness import ArchiveGap, check_complete, recorded_lost
from eventbus.tier.dictionaries import read_from
from eventbus.tier.layout import SegmentRef
from eventbus.tier.store import Store, get_bytes_sync, list_segments_sync, list_shards_sync

T = TypeVar("T")

_FIRST = itemgetter(0)

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
    fetched: Iterator[tuple[SegmentRef, bytes]], flt: ReplayFilter
) -> Iterator[tuple[SegmentRef, int, EntryBatch | None]]:
    """Each fetched segment's matching batches as ``(ref, held, batch)``, then ``(ref, held,
    None)`` at its end (`held`: the entries it holds); run a step at a time in a worker
    thread (`_stepped`): decoding, verifying and rebuilding a batch release the GIL."""
    for ref, data in fetched:
        held, batches = open_batches(data, ref, flt, BATCH_ROWS)
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
) -> Iterator[EntryBatch]:
    """One shard's matching rows in entry-ID order, as batches of at most `BATCH_ROWS` (none
    empty). Segments are fetched in `fetch_pool`, `prefetch` ahead, and decoded, verified and
    filtered by record batches in `pool`, a batch ahead of the one handed on; a segment's rows
    start after the previous one's last (overlapping segments give each entry once)."""
    last: EntryId | None = None
    fetched = _prefetched(fetch_pool, refs, lambda r: (r, get_bytes_sync(store, r.key)), prefetch)
    for ref, held, batch in _stepped(pool, _segment_reads(fetched, flt)):
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


def merge_batches(
    shards: Sequence[Iterator[EntryBatch]], *, chunk: int | None = None
) -> Iterator[list[ArchivedEntry]]:
    """Merge the batch streams of `shards` (each in entry-ID order, no batch empty) into one
    entry-ID order, ties between shards broken by their place in `shards` (shard index, as
    `iter_topic` lists them), as lists of entries.

    By batch cursors, never entry by entry: each round takes the smallest last entry ID of the
    shards' current batches (the *horizon*: no entry after it can come before an entry up to it
    in any shard), and hands on every current row up to it (found by bisecting each batch's ID
    columns), made entries and ordered by an Arrow ``sort_indices`` on the ID columns; a shard
    whose rows up to the horizon are the only ones goes on whole, unsorted (a shard behind the
    others, or the last one left). A shard whose batch is consumed moves on to its next.

    Rows become Python objects when first handed on, a chunk of a batch at a time (`_Cursor.
    take`: made once per chunk, not per round, which cut a chunk into several pieces and made
    each apart, twice the merge's cost), so a merge holds at most about ``16 * BATCH_ROWS``
    made entries across shards, whatever their number (`chunk` rows: by default 1,024 to
    `BATCH_ROWS`, less the more shards)."""
    cursors: list[_Cursor] = []
    if chunk is None:
        chunk = max(1024, min(BATCH_ROWS, BATCH_ROWS * 16 // max(1, len(shards))))
    for rank, it in enumerate(shards):
        batch = next(it, None)
        if batch is not None:
            cursors.append(_Cursor(rank, it, batch, chunk))
    while cursors:
        if len(cursors) == 1:
            (c,) = cursors
            yield c.take(c.pos, c.batch.n)
            for batch in c.rest:
                yield batch.entries()
            return
        horizon = min(c.batch.last for c in cursors)
        parts = []
        for c in cursors:
            cut = c.batch.after(horizon, c.pos)
            if cut > c.pos:
                parts.append((c, c.pos, cut))
        if len(parts) == 1:
            c, start, cut = parts[0]
            yield c.take(start, cut)
        else:
            yield _sorted(parts)
        for c, _, cut in parts:
            c.pos = cut
        cursors = [c for c in cursors if c.pos < c.batch.n or c.advance()]


class _Cursor:
    """A shard's place in `merge_batches`: its current batch, the next entry in it, and the
    entries made of its rows ``made_at:made_at + len(made)`` (`take`; `chunk` rows at most)."""

    __slots__ = ("batch", "chunk", "made", "made_at", "pos", "rank", "rest")

    def __init__(
        self, rank: int, rest: Iterator[EntryBatch], batch: EntryBatch, chunk: int
    ) -> None:
        self.rank, self.rest, self.batch, self.pos, self.chunk = rank, rest, batch, 0, chunk
        self.made: list[ArchivedEntry] = []
        self.made_at = 0

    def take(self, start: int, cut: int) -> list[ArchivedEntry]:
        """The entries of rows ``start:cut`` of the batch, made `chunk` rows at a time, each
        chunk once (rows are taken in order)."""
        out: list[ArchivedEntry] = []
        while start < cut:
            if not self.made_at <= start < self.made_at + len(self.made):
                self.made_at = start
                self.made = self.batch.entries(start, min(self.batch.n, start + self.chunk))
            end = min(cut, self.made_at + len(self.made))
            out += self.made[start - self.made_at : end - self.made_at]
            start = end
        return out

    def advance(self) -> bool:
        """Move on to the shard's next batch; False when it has none."""
        batch = next(self.rest, None)
        if batch is None:
            return False
        self.batch, self.pos, self.made, self.made_at = batch, 0, [], 0
        return True


def _sorted(parts: list[tuple[_Cursor, int, int]]) -> list[ArchivedEntry]:
    """The entries ``start:cut`` of each cursor's batch in entry-ID order, ties by rank."""
    entries: list[ArchivedEntry] = []
    ms, seq, rank = [], [], []
    for c, start, cut in parts:
        n = cut - start
        entries += c.take(start, cut)
        ms.append(c.batch.ms.slice(start, n))
        seq.append(c.batch.seq.slice(start, n))
        rank.append(pa.repeat(c.rank, n).cast(pa.int32()))
    keys = pa.table(
        {"ms": pa.concat_arrays(ms), "seq": pa.concat_arrays(seq), "rank": pa.concat_arrays(rank)}
    )
    order = pc.sort_indices(
        keys, sort_keys=[("ms", "ascending"), ("seq", "ascending"), ("rank", "ascending")]
    )
    return list(map(entries.__getitem__, order.to_pylist()))


def _topic_batches(
    store: Store,
    topic: str,
    flt: ReplayFilter,
    *,
    shards: Sequence[int] | None,
    merge: bool,
    segments: Mapping[int, Sequence[SegmentRef]] | None,
    on_segment: Callable[[SegmentRef], None] | None,
    counts: dict[int, int] | None,
) -> Iterator[list[ArchivedEntry]]:
    """`iter_topic`'s entries as lists (batches), in the same order."""
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


class ReplayedEvent(msgspec.Struct, frozen=True, gc=False):
    """A decoded event and the archived entry it came from (immutable; a `msgspec.Struct`:
    one is built per event replayed)."""

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


class _Decoder:
    """Decodes batches of entries into `ReplayedEvent`s: the envelopes of a batch, then the
    payloads of each model in one ``TypeAdapter(list[Model])`` call (entry by entry, with
    `decode_event`, only when that list does not validate: the first bad entry's error)."""

    def __init__(self, models: Mapping[str, type[BaseModel]]) -> None:
        self.models = models
        self.adapters: dict[type[BaseModel], TypeAdapter[Any]] = {}

    def decode(self, batch: list[ArchivedEntry]) -> tuple[list[ReplayedEvent], int]:
        """The events of `batch` in its order up to the first entry that does not decode or
        validate, and that entry's place (``len(batch)`` when there is none): from there on,
        `decode_each` gives the events and raises its `DecodeError`."""
        with paused_gc():  # payload dicts and models: tracked objects, no cycles
            envelopes, events = self._validated(batch)
            ok = next(compress(count(), map(is_, events, repeat(None))), len(events))
            return list(map(ReplayedEvent, events[:ok], envelopes[:ok], batch[:ok])), ok

    def _validated(self, batch: list[ArchivedEntry]) -> tuple[list[Envelope], list[Any]]:
        """The envelopes of `batch` up to the first that does not decode, and their events
        (None where the list of its model did not validate, or from an unknown type on)."""
        envelopes = _envelopes_at_once(batch)
        if envelopes is None:
            envelopes = []
            for entry in batch:
                try:
                    envelopes.append(entry.envelope())
                except DecodeError:
                    break  # its error comes in its turn (`decode_each`)
        events: list[Any] = [None] * len(envelopes)
        groups: dict[type[BaseModel], list[int]] = {}
        models = self.models
        for i, env in enumerate(envelopes):
            model = models.get(env.event_type)
            if model is None:
                break  # its error comes in its turn
            groups.setdefault(model, []).append(i)
        for model, idx in groups.items():
            adapter = self.adapters.get(model)
            if adapter is None:
                adapter = self.adapters[model] = TypeAdapter(list[model])  # type: ignore[valid-type]
            try:
                valid = adapter.validate_python([envelopes[i].payload for i in idx])
            except Exception:  # (a validator may raise anything): each entry on its own
                continue  # in its turn, its error (or exception) in entry order
            for i, event in zip(idx, valid, strict=True):
                events[i] = event
        return envelopes, events

    def decode_each(self, entries: list[ArchivedEntry]) -> Iterator[ReplayedEvent]:
        """`decode_event` on each of `entries`: the path of a batch holding a bad entry."""
        for entry in entries:
            yield decode_event(entry, self.models)


_BODIES = msgspec.msgpack.Decoder(list[_Body])
_ARRAY32 = b"\xdd"


def _envelopes_at_once(batch: list[ArchivedEntry]) -> list[Envelope] | None:
    """The envelopes of `batch` from one MessagePack decode of all their bodies (an array's
    elements are its values' encodings one after another: the bodies joined under an array
    header), the same as `ArchivedEntry.envelope` gives each. None, for the entry by entry
    path, unless every entry is of the short plain form `decode_entry` decodes in one typed
    pass and decoded when it was archived (its envelope columns are set), and the array
    decodes with each body's time where the archive has it (no body took another's bytes)."""
    datas = [e.data for e in batch]
    sizes = list(map(len, datas))
    if (
        not datas
        or min(sizes) == 0
        or max(sizes) > MIN_CONTAINERS
        or set(map(_FIRST, datas)) != {FORMAT_MSGPACK}
        or None in [e.event_id for e in batch]
    ):
        return None
    joined = b"".join([_ARRAY32, len(datas).to_bytes(4, "big"), *(d[1:] for d in datas)])
    try:
        bodies = _BODIES.decode(joined)
    except Exception:  # (any failure: entry by entry, each with its own error)
        return None
    if [b.ts for b in bodies] != [e.published_at_ms for e in batch]:
        return None
    return list(
        map(
            Envelope,
            [e.resource_id for e in batch],
            [e.event_type for e in batch],
            [b.id for b in bodies],
            [b.ts for b in bodies],
            [b.h for b in bodies],
            [b.p for b in bodies],
        )
    )


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
    decoded and validated like a live consumer does (per batch: `_Decoder`). Raises
    `DecodeError` on an entry that does not decode or validate, `CorruptSegment`,
    `StoreError`."""
    by_type = models_by_type(models)
    types = frozenset(by_type)
    flt = flt or ReplayFilter()
    wanted = types if flt.event_types is None else types & flt.event_types
    narrowed = ReplayFilter(
        flt.start_id, flt.end_id, flt.since_ms, flt.until_ms, flt.resource_ids, frozenset(wanted)
    )
    decoder = _Decoder(by_type)
    for batch in _topic_batches(
        store,
        topic,
        narrowed,
        shards=shards,
        merge=merge,
        segments=None,
        on_segment=None,
        counts=None,
    ):
        events, ok = decoder.decode(batch)
        yield from events
        if ok < len(batch):
            yield from decoder.decode_each(batch[ok:])


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

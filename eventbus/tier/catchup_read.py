"""Catch-up's pass over one shard's archive (`archive_pass`, `ShardCatchUp.after`) and its
reading (`read_ahead`): segments fetched ahead, decoded and verified a record batch at a time
in a worker thread while the batch before is handled, so handling starts on a segment's first
batch and never waits for a read the thread could have done meanwhile."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Generator, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, NamedTuple

import anyio
import anyio.to_thread
from anyio.streams.memory import MemoryObjectSendStream

from eventbus.locking.locks import Fenced
from eventbus.protocol.ids import EntryId
from eventbus.tier.archived import ArchivedEntry, EntryBatch, ReplayFilter
from eventbus.tier.layout import SegmentRef
from eventbus.tier.metrics import TIER_METRICS
from eventbus.tier.replay import _prefetched, _segment_reads
from eventbus.tier.store import Store, get_bytes_sync

if TYPE_CHECKING:
    from eventbus.tier.catchup_shard import ShardCatchUp

log = logging.getLogger("eventbus.tier")

READ_AHEAD = 8
"""Segments fetched ahead of the one being decoded (concurrently: per-segment latency
dominates on S3); with that one, the batch being decoded and the one being handled, what a
shard's catch-up holds at most."""

DECODE_THREADS = 2
"""Worker threads decoding segments for all the shards of one catch-up at once (`CatchUp.
decoding`). Their batches are handled on the one event loop thread, one at a time: a thread a
shard (16 on flights) only made the decoding threads contend with that thread for the GIL
(stress/results/catchup-profile-s9.md)."""


class ReadBatch(NamedTuple):
    """One step of `read_ahead`: a batch of segment `ref`'s matching rows (`rows`, in entry-ID
    order, at most `eventbus.tier.replay.BATCH_ROWS`, never empty) and, when asked for, the
    same rows as `ArchivedEntry`s (`entries`, made in the reading thread); ``rows`` None marks
    the end of segment `ref` (every batch of it was given)."""

    ref: SegmentRef
    rows: EntryBatch | None
    entries: list[ArchivedEntry] | None


def _steps(
    store: Store,
    refs: Sequence[SegmentRef],
    flt: ReplayFilter,
    pool: ThreadPoolExecutor,
    *,
    entries: bool,
    depth: int,
) -> Generator[ReadBatch, None, None]:
    """The batches of `refs` in order, run a step at a time in a worker thread: fetches in
    `pool` (`depth` ahead), decoding, verifying and filtering (`open_batches`), and with
    `entries` the rows made `ArchivedEntry`s."""
    fetched = _prefetched(pool, refs, lambda r: (r, get_bytes_sync(store, r.key)), depth)
    for ref, _held, batch in _segment_reads(fetched, flt):
        if batch is None:
            yield ReadBatch(ref, None, None)
        elif entries:
            yield ReadBatch(ref, batch, batch.entries())
        else:
            yield ReadBatch(ref, batch, None)


async def _reader(
    steps: Iterator[ReadBatch],
    send: MemoryObjectSendStream[object],
    limiter: anyio.CapacityLimiter | None,
) -> None:
    """Send each step of `steps` as it is made (in a worker thread of `limiter`), then close
    `send`; an error of a step is sent in its place (raised where it comes, after the batches
    before)."""
    async with send:
        try:
            while (
                step := await anyio.to_thread.run_sync(next, steps, None, limiter=limiter)
            ) is not None:
                await send.send(step)
        except Exception as exc:
            await send.send(exc)


@contextlib.asynccontextmanager
async def read_ahead(
    store: Store,
    refs: Sequence[SegmentRef],
    flt: ReplayFilter,
    *,
    entries: bool,
    depth: int = READ_AHEAD,
    limiter: anyio.CapacityLimiter | None = None,
) -> AsyncIterator[AsyncIterator[ReadBatch]]:
    """The matching rows of segments `refs` (one shard's, in entry-ID order), as `ReadBatch`es
    in order: each segment's batches, then its end. A task reads them a step ahead of the one
    handed on (decoding and verifying release the GIL), the next `depth` segments fetched
    meanwhile: bounded memory (the bytes of the `depth` segments fetched ahead and of the one
    being decoded, two batches). `entries`: the rows also as `ArchivedEntry`s. `limiter`: the
    worker threads the steps run in (default anyio's); the shards of one catch-up share theirs
    (`DECODE_THREADS`). Iterating raises `CorruptSegment`, `FileNotFoundError`, `StoreError`
    at the segment that has it; leaving the block stops the reading."""
    send, receive = anyio.create_memory_object_stream[object](0)
    pool = ThreadPoolExecutor(max(1, depth), thread_name_prefix="eventbus-catchup-fetch")
    steps = _steps(store, refs, flt, pool, entries=entries, depth=depth)

    async def batches() -> AsyncIterator[ReadBatch]:
        async with receive:
            async for item in receive:
                if isinstance(item, Exception):
                    raise item
                yield item  # type: ignore[misc]

    failure: Exception | None = None
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(_reader, steps, send, limiter)
            try:
                yield batches()
            except Exception as exc:  # raised here, not as a task group's ExceptionGroup
                failure = exc
            tg.cancel_scope.cancel()  # the block is left: no more reading
    finally:
        steps.close()  # (no step runs: a thread's step is awaited to its end)
        pool.shutdown(wait=False, cancel_futures=True)
    if failure is not None:
        raise failure


async def archive_pass(sc: ShardCatchUp, delivered: EntryId) -> bool:
    """`ShardCatchUp.after` for `sc`: if Redis lacks entries after `delivered`, handle every
    archived entry after it, to the end of the archive, a batch at a time as `read_ahead`
    gives them (rows before the last one handled skipped: overlapping segments give each
    entry once), ``XGROUP SETID`` after each batch under a confirmed lock; a batch let go
    (the lock lost, or the consumer stopping: then what was handled is kept) raises `Fenced`.
    Returns whether Redis lacked entries after `delivered` and segments held them; False when
    Redis held everything after it, or the missing entries are in no segment (lost: logged
    and counted)."""
    redis, group = sc.o.redis, sc.o.group
    if not await sc.behind(delivered):
        return False  # Redis holds every entry after the last-delivered ID
    head = await sc.head()
    handled = 0
    refs = await sc.segments_after(delivered, resume=True)
    flt = ReplayFilter(start_id=delivered.next())
    rows = sc.takes_rows()
    reading = read_ahead(sc.o.store, refs, flt, entries=not rows, limiter=sc.o.decoding)
    async with reading as batches:
        async for ref, batch, entries in batches:
            if batch is None:  # the segment's end: every entry of it handled
                sc.o.consumed[sc.shard] = ref
                continue
            if batch.id_at(0) <= delivered:  # overlapping segments: each entry once
                start = batch.after(delivered)
                if start == batch.n:
                    continue
                batch = batch.slice(start, batch.n)
                entries = None if entries is None else entries[start:]
            n = batch.n
            if rows:
                done = int(await sc.handle.rows(batch, sc))  # type: ignore[attr-defined]
            else:
                done = await sc.handle_many(entries or [])
            if done < n:  # let go: the lock lost, or the consumer stopping
                if done and sc.stopped():  # keep what was handled: the lock is still ours
                    await sc.confirm()
                    last = batch.id_at(done - 1)
                    await redis.xgroup_setid(sc.stream, group, str(last))
                    sc.delivered = last
                raise Fenced
            handled += n
            await sc.confirm()
            delivered = batch.last
            await redis.xgroup_setid(sc.stream, group, str(delivered))
            sc.delivered = delivered
            sc.stats.from_segments += n
            TIER_METRICS.caught_up.labels(sc.o.topic).inc(n)
    if handled == 0:
        sc.stats.lost_ranges += 1
        log.error(
            "catch-up %s/%s shard %d: entries after %s up to %s were trimmed from Redis "
            "and are not in any segment: lost before archiving (see the gap records)",
            sc.o.topic,
            group,
            sc.shard,
            delivered,
            head,
        )
        return False
    return True


__all__ = ["DECODE_THREADS", "READ_AHEAD", "ReadBatch", "archive_pass", "read_ahead"]

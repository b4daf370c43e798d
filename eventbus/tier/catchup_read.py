"""Catch-up's reading of one shard's segments (`read_ahead`): fetched ahead, decoded and
verified a record batch at a time in a worker thread while the batch before is handled, so
handling starts on a segment's first batch and never waits for a read the thread could have
done meanwhile. Used by `eventbus.tier.catchup_shard.ShardCatchUp.after`."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Generator, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import anyio
import anyio.to_thread
from anyio.streams.memory import MemoryObjectSendStream

from eventbus.tier.archived import ArchivedEntry, EntryBatch, ReplayFilter
from eventbus.tier.layout import SegmentRef
from eventbus.tier.replay import _prefetched, _segment_reads
from eventbus.tier.store import Store, get_bytes_sync

READ_AHEAD = 8
"""Segments fetched ahead of the one being decoded (concurrently: per-segment latency
dominates on S3); with the batch being decoded and the one being handled, what a shard's
catch-up holds at most."""


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


async def _reader(steps: Iterator[ReadBatch], send: MemoryObjectSendStream[object]) -> None:
    """Send each step of `steps` as it is made (in a worker thread), then close `send`; an
    error of a step is sent in its place (raised where it comes, after the batches before)."""
    async with send:
        try:
            while (step := await anyio.to_thread.run_sync(next, steps, None)) is not None:
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
) -> AsyncIterator[AsyncIterator[ReadBatch]]:
    """The matching rows of segments `refs` (one shard's, in entry-ID order), as `ReadBatch`es
    in order: each segment's batches, then its end. A task reads them a step ahead of the one
    handed on (decoding and verifying release the GIL), the next `depth` segments fetched
    meanwhile: bounded memory (`depth` segments' bytes and two batches). `entries`: the rows
    also as `ArchivedEntry`s. Iterating raises `CorruptSegment`, `FileNotFoundError`,
    `StoreError` at the segment that has it; leaving the block stops the reading."""
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
            tg.start_soon(_reader, steps, send)
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


__all__ = ["READ_AHEAD", "ReadBatch", "read_ahead"]

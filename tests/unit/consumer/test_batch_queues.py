"""A batch subscription's per-shard queues (`eventbus.consumer.batching.BatchQueues`): how a
worker cuts a shard's queue into batches. No Redis; the batch step records what it was given."""

from __future__ import annotations

import anyio
import anyio.lowlevel
import pytest

from eventbus.consumer.batching import BatchQueues
from eventbus.consumer.shards import HeldShard, Item, read_items
from eventbus.consumer.watchdog import Watchdog
from eventbus.protocol.codec import F_RESOURCE

pytestmark = pytest.mark.anyio


def items(held: HeldShard, first: int, n: int) -> list[Item]:
    entries = [(f"{i}-0".encode(), {F_RESOURCE: b"r"}) for i in range(first, first + n)]
    return read_items(held, entries, None)  # type: ignore[arg-type]


async def test_batches_are_cut_at_max_batch_and_at_a_new_acquisition_and_keep_late_items() -> None:
    """Up to `max_batch` entries of one acquisition (generation) each; entries queued while a
    batch runs are run next, not dropped with it."""
    old = HeldShard(shard=0, stream="s:0", token=1, generation=1)
    new = HeldShard(shard=0, stream="s:0", token=2, generation=2)  # re-taken: a new generation
    queues = BatchQueues(lambda held, n: None, max_batch=4)
    calls: list[tuple[int, list[int]]] = []
    done = anyio.Event()

    async def run(batch: list[Item], slot: object) -> None:
        calls.append((batch[0].generation, [int(i.entry_id.split(b"-")[0]) for i in batch]))
        if len(calls) == 1:  # while the first batch runs, the next read lands
            queues.dispatch(new, items(new, 10, 2))
        await anyio.lowlevel.checkpoint()
        if sum(len(ids) for _, ids in calls) == 12:
            done.set()

    queues.dispatch(old, items(old, 0, 6))
    queues.dispatch(new, items(new, 6, 4))  # same shard, later acquisition, same queue
    watchdog = Watchdog(None)
    async with anyio.create_task_group() as tg:
        tg.start_soon(queues.worker, run, watchdog.slot(), tg, anyio.Event())
        with anyio.fail_after(10):
            await done.wait()
        tg.cancel_scope.cancel()
    assert calls == [
        (1, [0, 1, 2, 3]),
        (1, [4, 5]),  # cut at the acquisition, though max_batch allows 4
        (2, [6, 7, 8, 9]),
        (2, [10, 11]),
    ]

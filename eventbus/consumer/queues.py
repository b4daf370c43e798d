"""Per-resource FIFO queues and the pool of workers that run them.

Entries of a shard go to the queue of their resource (``(shard, resource ID)``); a fixed pool of
`concurrency` workers takes resources with work and runs each resource's entries one after
another, in entry-ID order, while different resources run concurrently. A resource is in exactly
one place while it has work: owned by a worker, waiting in the ready stream, or waiting for a
retry timer, so two workers never run the same resource. A retry's backoff does not hold a
worker: the resource goes back to the ready stream when its timer fires.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from types import MappingProxyType

import anyio
import anyio.abc

from eventbus.consumer.shards import HeldShard, Item, read_items
from eventbus.protocol.codec import F_RESOURCE

Key = tuple[int, bytes]
_FIRST: Mapping[bytes, int] = MappingProxyType({})
Process = Callable[[Item], Awaitable[float | None]]
"""``await process(item)``: one step for the head of a queue; the delay (s) before trying it
again, or None once it is finished (acked or let go)."""


class ResourceQueues:
    def __init__(self, started: Callable[[HeldShard], None]) -> None:
        self._started = started
        self._queues: dict[Key, deque[Item]] = {}
        # A memory stream hands each key to exactly one waiting worker (one shared Event
        # re-created by each waiter woke only the last one).
        self._ready, self._ready_out = anyio.create_memory_object_stream[Key](math.inf)

    def dispatch(
        self,
        held: HeldShard,
        entries: list[tuple[bytes, dict[bytes, bytes] | None]],
        counts: Mapping[bytes, int] = _FIRST,
    ) -> None:
        """Queue entries read from `held`'s stream, in order, behind their resources' earlier
        entries; `counts` gives the delivery count of those delivered before (default 1). An
        entry without fields (deleted between read and claim) is skipped."""
        for item in read_items(held, entries, counts):
            self._started(held)
            key = (held.shard, item.fields.get(F_RESOURCE, b"\x00" + item.entry_id))
            queue = self._queues.get(key)
            if queue is None:
                self._queues[key] = deque([item])
                self._ready.send_nowait(key)
            else:
                queue.append(item)

    async def worker(
        self, process: Process, timers: anyio.abc.TaskGroup, stopped: anyio.Event
    ) -> None:
        """Run resources from the ready stream until cancelled; retry timers go in `timers` and
        fire at once when `stopped` is set (so that a waiting entry is let go on shutdown)."""
        while True:
            key = await self._ready_out.receive()
            queue = self._queues[key]
            retry_in: float | None = None
            try:
                while queue:
                    retry_in = await process(queue[0])
                    if retry_in is not None:
                        break
                    queue.popleft()
            finally:
                if retry_in is None:
                    del self._queues[key]
                else:
                    timers.start_soon(self._retry_later, key, retry_in, stopped)

    async def _retry_later(self, key: Key, delay: float, stopped: anyio.Event) -> None:
        with anyio.move_on_after(delay):
            await stopped.wait()  # on shutdown, come back at once to be let go
        self._ready.send_nowait(key)

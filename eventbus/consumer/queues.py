"""Per-resource FIFO queues and the pool of workers that run them.

Entries of a shard go to the queue of their resource (``(shard, resource ID)``); a fixed pool of
`concurrency` workers takes resources with work and runs each resource's entries one after
another, in entry-ID order, while different resources run concurrently. A resource is in exactly
one place while it has work: owned by a worker, waiting in the ready queue, or waiting for a
retry timer, so two workers never run the same resource. A retry's backoff does not hold a
worker: the resource goes back to the ready queue when its timer fires.

No task and no hand-over per event: a worker runs a resource's entries with plain awaits (a
handler that does not suspend does not leave the worker), takes the next ready resource from a
plain deque, and waits only when there is none. So that a busy worker does not starve the
other tasks of the event loop (heartbeats, reads, acks), it yields to the loop every
`eventbus.consumer.runner.YIELD_EVERY` entries.

An idle worker waits on a future of its own: resources that become ready wake as many idle
workers as there are ready resources, not every idle worker (with one shared event, a read of
one entry woke all `concurrency` idle workers, 64 task steps where one does the work: at a
trickle of events, rounds of one or two entries, that was most of a consumer's CPU per event).

The workers are started on demand (`ResourceQueues.start_workers`): a resource that becomes
ready with no idle worker to take it starts one more, up to `concurrency`, which then stays. The
pool is the fixed one's as soon as that many resources ran at once; a consumer that never needed
64 does not start and cancel 64 tasks (the test bus's 5 subscribers started and stopped 320 in
every test, a fifth of its CPU).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable, Sequence

import anyio
import anyio.abc

from eventbus.consumer.delivery import wait_retry
from eventbus.consumer.shards import HeldShard, Item
from eventbus.consumer.watchdog import Slot
from eventbus.protocol.codec import F_RESOURCE

Key = tuple[int, bytes]
Run = Callable[[deque[Item], Slot], Awaitable[float | None]]
"""``await run(queue, slot)``: run a resource's queue from its head, by the worker whose
watchdog slot is `slot`, finishing (acking or letting go) and popping entries, until it is
empty (None) or its head must wait (the delay in s before it is tried again). It yields to the
event loop every `eventbus.consumer.runner.YIELD_EVERY` entries."""


class ResourceQueues:
    """The queues of one consumer; `started(held, n)` counts `n` entries of `held` in flight."""

    prepared_on_read = True
    """Entries are decoded with their read (`Handling.prepare`), which finds their resource."""

    def __init__(self, started: Callable[[HeldShard, int], None]) -> None:
        self._started = started
        self._queues: dict[Key, deque[Item]] = {}
        self._ready: deque[Key] = deque()
        self._idle: deque[asyncio.Future[None]] = deque()  # one future per idle worker
        self._spawn: Callable[[], object] | None = None  # starts one more worker
        self._room = 0  # workers that may still be started

    def start_workers(self, spawn: Callable[[], object], most: int) -> None:
        """Have `spawn()` start a worker (a task running `worker`) whenever a resource becomes
        ready and no idle worker takes it, `most` times at most (none is started before)."""
        self._spawn, self._room = spawn, most

    def dispatch(self, held: HeldShard, items: Sequence[Item]) -> None:
        """Queue `items` read from `held`'s stream, in order, behind their resources' earlier
        entries."""
        if not items:
            return
        self._started(held, len(items))
        queues, ready, shard = self._queues, self._ready, held.shard
        before = len(ready)
        for item in items:
            key = (shard, item.fields.get(F_RESOURCE) or b"\x00" + item.entry_id)
            queue = queues.get(key)
            if queue is None:
                queues[key] = deque((item,))
                ready.append(key)
            else:
                queue.append(item)
        if self._idle or self._room:
            self._wake(len(ready) - before)

    def _wake(self, n: int) -> None:
        """Wake one idle worker for each of `n` resources that became ready (fewer when fewer
        are idle; then start new ones while there is room), not one per resource in the ready
        queue: those already there had theirs. A
        busy worker takes the next ready resource itself when it finishes its own, and a worker
        waits only when the ready queue is empty, so no ready resource is left unattended."""
        idle = self._idle
        while n > 0 and idle:
            waiter = idle.popleft()
            if not waiter.done():  # (cancelled meanwhile)
                waiter.set_result(None)
                n -= 1
        while n > 0 and self._room:  # none idle: one more worker (`start_workers`)
            self._room -= 1
            self._spawn()  # type: ignore[misc]  # (room only once `start_workers` set it)
            n -= 1

    async def _next(self) -> Key:
        """The next ready resource, waiting as an idle worker while there is none."""
        while not self._ready:
            waiter = asyncio.get_running_loop().create_future()
            self._idle.append(waiter)
            try:
                await waiter
            except BaseException:  # cancelled: a wake-up it took goes to another idle worker
                if waiter.done() and not waiter.cancelled():
                    self._wake(1)
                elif waiter in self._idle:
                    self._idle.remove(waiter)
                raise
        return self._ready.popleft()

    async def worker(
        self, run: Run, slot: Slot, timers: anyio.abc.TaskGroup, stopped: anyio.Event
    ) -> None:
        """Run resources from the ready queue until cancelled, with watchdog slot `slot`; retry
        timers go in `timers` and fire at once when `stopped` is set (so that a waiting entry is
        let go on shutdown)."""
        ready, queues = self._ready, self._queues
        while True:
            key = ready.popleft() if ready else await self._next()
            retry_in: float | None = None
            try:
                retry_in = await run(queues[key], slot)
            finally:
                if retry_in is None:
                    del queues[key]
                else:
                    timers.start_soon(self._retry_later, key, retry_in, stopped)

    async def _retry_later(self, key: Key, delay: float, stopped: anyio.Event) -> None:
        await wait_retry(delay, stopped)
        self._ready.append(key)
        self._wake(1)

"""Batch handlers: ``@bus.subscriber(topic, group=..., batch=True, max_batch=N)``.

The handler is ``async def h(events: list[Model], ctxs: list[Context])`` (``ctxs`` optional; a
plain ``def`` runs in a worker thread). docs/semantics.md states the guarantees; in short:

* **One queue per shard.** A batch holds consecutive entries of one shard, in stream order, read
  under one lock acquisition: at most `max_batch`, and no more than are queued when a worker
  takes them (no waiting to fill a batch). Batches of a shard run one after another, so
  per-resource order holds inside a batch and across batches; shards run concurrently.
* **Acked after the handler returns**, every entry of the batch (one XACK pipeline per wake-up,
  as for single events).
* **Failures.** A failing batch is retried in place by the subscription's retry policy
  (`max_attempts` calls in all). Then it is split in two halves, the first settled before the
  second, each called once and split again while it fails; a single failing entry goes through
  the per-event policy (`Handling.step`: its own retries, then dead letter and ``continue`` or
  ``park``). Entries of a resource parked meanwhile are dead-lettered as ``parked``, in order.
* **Fencing**: the lease and the shard's lock acquisition are checked right before each call,
  with no await in between, as for single events.
* Entries that need the per-event path (control entries, parked resources, entries that do not
  decode or validate, entries large enough to decode in a thread) break a batch: they are taken
  one by one, in their place, by `Handling.step`. Catch-up from the durable tier runs a
  `BatchRunner` of its own on a segment's entries (`eventbus.consumer.catchup.TypedCatchUp`);
  replays of parked letters call the handler with batches of one.
"""

from __future__ import annotations

import logging
import time
import typing
from collections import deque
from collections.abc import Awaitable, Callable
from itertools import islice, repeat
from operator import is_
from typing import Any, cast

import anyio
import anyio.abc
import anyio.to_thread

from eventbus.consumer.acks import Acks
from eventbus.consumer.batch_call import BatchHandlerCall as BatchHandlerCall  # re-exported
from eventbus.consumer.batch_call import batch_handler_models as batch_handler_models
from eventbus.consumer.batch_call import is_batch as is_batch
from eventbus.consumer.delivery import NOT_STARTED, Fence, NotStarted, wait_retry
from eventbus.consumer.handling import Handling
from eventbus.consumer.queues import ResourceQueues
from eventbus.consumer.runner import QueueRunner
from eventbus.consumer.scope import around
from eventbus.consumer.shards import HeldShard, Item
from eventbus.consumer.watchdog import Slot
from eventbus.errors import InvalidReply
from eventbus.protocol.replies import REPLY_TO, send_reply

log = logging.getLogger("eventbus.consumer")

Step = Callable[[Item, Slot], Awaitable[float | None]]
"""The consumer's per-event step (`QueueRunner.process`) with the worker's watchdog slot."""
_ONE_QUEUE = b""  # the resource part of a shard's one queue key


class BatchQueues(ResourceQueues):
    """One queue per shard (not per resource); a worker takes up to `max_batch` entries of one
    lock acquisition from its head and runs them as a batch."""

    prepared_on_read = False
    """A worker decodes a batch's entries when it takes them (`BatchRunner.run`): the read loop
    sends its next read meanwhile, instead of after."""

    def __init__(self, started: Callable[[HeldShard, int], None], max_batch: int) -> None:
        super().__init__(started)
        self.max_batch = max_batch

    def dispatch(self, held: HeldShard, items: typing.Sequence[Item]) -> None:
        if not items:
            return
        self._started(held, len(items))
        key = (held.shard, _ONE_QUEUE)
        queue = self._queues.get(key)
        if queue is None:
            self._queues[key] = deque(items)
            self._ready.append(key)
            self._wake(1)
        else:
            queue.extend(items)

    async def worker(  # type: ignore[override]
        self,
        run: Callable[[list[Item], Slot], Awaitable[None]],
        slot: Slot,
        timers: anyio.abc.TaskGroup,
        stopped: anyio.Event,
    ) -> None:
        """Run shards' batches from the ready queue until cancelled (`run` finishes each)."""
        while True:
            key = await self._next()
            queue = self._queues[key]
            try:
                while queue:
                    batch = list(islice(queue, self.max_batch))
                    generation = batch[0].generation
                    if batch[-1].generation != generation:  # up to the next acquisition's
                        # (a queue's generations never decrease: it is filled in read order)
                        batch = [item for item in batch if item.generation == generation]
                    await run(batch, slot)
                    if len(batch) == len(queue):  # nothing queued meanwhile
                        queue.clear()
                    else:
                        for _ in range(len(batch)):
                            queue.popleft()
            finally:
                del self._queues[key]


class BatchRunner:
    """Handles the batches of one batch subscription (see the module docstring). `process`
    is the consumer's per-event step (acks or lets go what it finishes); a retry's wait ends at
    once on shutdown (`wait_retry`), then the fence lets the entries go."""

    def __init__(
        self,
        handling: Handling,
        fence: Fence,
        process: Step,
        acks: Acks,
    ) -> None:
        self.handling = handling
        self.sub = handling.sub
        self.call = cast(BatchHandlerCall, handling.sub.call)
        self.fence = fence
        self.process = process
        self.acks = acks
        self.stopping = handling.stopping

    async def run(self, items: list[Item], slot: Slot) -> None:
        """Finish `items` (consecutive entries of one shard, one acquisition, queued as read:
        decoded and validated here, in one pass, `Handling.prepare`), in order; `slot` is the
        calling worker's watchdog slot. A lost shard's batch, or any once the consumer stops,
        is let go undecoded (the fence would let it go after the decode)."""
        if items[0].held.lost or self.stopping.is_set():
            for item in items:
                self.acks.finish(item)
            return
        self.handling.prepare(items)
        if not self.handling.failures.parked:  # the common case: the whole batch in one call
            events = [item.event for item in items]
            # every entry decoded and validated (by identity: `None in events` would call each
            # model's __eq__, pydantic's, in Python)
            if not any(map(is_, events, repeat(None))):
                if not await self.fence.wait(items[0]):
                    for item in items:
                        self.acks.finish(item)
                    return
                await self._settle(items, self.sub.options.retry.max_attempts, slot, events)
                return
        i = 0
        while i < len(items):
            if not await self.fence.wait(items[i]):
                for item in items[i:]:
                    self.acks.finish(item)
                return
            run = self._run_of(items, i)
            if not run:
                await self._single(items[i], slot)
                i += 1
                continue
            await self._settle(run, self.sub.options.retry.max_attempts, slot)
            i += len(run)

    def _run_of(self, items: list[Item], start: int) -> list[Item]:
        """The longest run of `items` from `start` that can go to the handler as one batch:
        decoded and validated by `run`'s `Handling.prepare`, of no parked resource."""
        is_parked, parked = self.handling.failures.is_parked, self.handling.failures.parked
        run = []
        for item in items[start:]:
            if item.event is None or (parked and is_parked(item.env.resource_id)):  # type: ignore[union-attr]
                break
            run.append(item)
        return run

    async def _single(self, item: Item, slot: Slot) -> None:
        """The per-event path for `item`, its retries waited in place."""
        while (delay := await self.process(item, slot)) is not None:
            await wait_retry(delay, self.stopping)

    async def _settle(
        self, entries: list[Item], attempts: int, slot: Slot, events: list[Any] | None = None
    ) -> None:
        """Call the handler on `entries` (their `events`, when the caller has them) up to
        `attempts` times; then split them."""
        attempt = 0
        while True:
            head = entries[0]
            if not await self.fence.wait(head):
                for e in entries:
                    self.acks.finish(e)
                return
            attempt += 1
            error = await self._call(entries, attempt, slot, events)
            if error is NOT_STARTED:
                attempt -= 1
                continue
            if error is None:
                self.acks.ack_many(entries)
                return
            if attempt >= attempts:
                break
            delay = self.sub.options.retry.delay_s(attempt)
            log.warning(
                "batch handler %s failed on %d entries of shard %d from %s (attempt %d/%d): %r; "
                "retry in %.2f s",
                self.sub.name,
                len(entries),
                head.shard,
                head.entry_id.decode(),
                attempt,
                attempts,
                error,
                delay,
            )
            await wait_retry(delay, self.stopping)
        if len(entries) == 1:
            await self._single(entries[0], slot)
            return
        mid = len(entries) // 2
        await self._settle(entries[:mid], 1, slot)
        await self._resume(entries[mid:], slot)

    async def _resume(self, entries: list[Item], slot: Slot) -> None:
        """Settle the rest of a split batch, after its first half: entries of resources parked
        by that half go through the per-event path (dead-lettered as ``parked``)."""
        run: list[Item] = []
        for e in entries:
            if self.handling.failures.is_parked(e.env.resource_id):  # type: ignore[union-attr]
                if run:
                    await self._settle(run, 1, slot)
                    run = []
                await self._single(e, slot)
            else:
                run.append(e)
        if run:
            await self._settle(run, 1, slot)

    async def _call(
        self, entries: list[Item], attempt: int, slot: Slot, events: list[Any] | None = None
    ) -> Exception | NotStarted | None:
        """One call of the batch handler (on `entries`' `events`, made here when None); its
        exception, None, or `NOT_STARTED` (fence lost)."""
        h = self.handling
        ctxs = [
            h.context(e, e.env, e.entry_id, attempt)  # type: ignore[arg-type]
            for e in entries
            # none built for a handler of events alone, unless a middleware reads them
            if self.call.takes_context or h.middlewares
        ]
        if events is None:
            events = [e.event for e in entries]
        if not self.fence.holds(entries[0]):  # no await between this check and the call
            return NOT_STARTED
        call = self.call.call_batch
        batch = around(h.middlewares, call, events, ctxs) if h.middlewares else call(events, ctxs)
        result, error = await h.watched(slot, batch)
        if error is None and result is not None:
            error = await self._answer(entries, result)
        if error is not None:
            return error
        h.tally.handled += len(entries)
        last = entries[-1].env.published_at_ms  # type: ignore[union-attr]
        h.latencies.values.append(max(0.0, time.time() - last / 1000))
        return None

    async def _answer(self, entries: list[Item], result: Any) -> Exception | None:
        """Send the requests among `entries` (`eventbus.request`) their answers: `result`, the
        batch handler's return value (not None), is a list of one answer per entry, in order
        (None answers nothing). Returns the attempt's failure (logged, retried, dead-lettered
        as any), as the per-event path does: a Redis error of the send, or `InvalidReply` for
        an answer to a request that is not a model, or a `result` of another shape while the
        batch holds a request (before, it was dropped: the caller waited for nothing)."""
        h = self.handling
        if not isinstance(result, list) or len(result) != len(entries):
            requests = [e for e in entries if REPLY_TO in e.env.headers]  # type: ignore[union-attr]
            if not requests:
                return None  # a return value no request waits for: ignored, as before
            shape = (
                f"a list of {len(result)}" if isinstance(result, list) else type(result).__name__
            )
            return InvalidReply(
                f"batch handler {self.sub.name} got {len(requests)} request(s) (the first: "
                f"entry {requests[0].entry_id.decode()}) and returned {shape}: a batch handler "
                f"answers requests with a list of one answer per event ({len(entries)}), in order"
            )
        for e, answer in zip(entries, result, strict=True):
            if answer is not None:
                try:
                    await send_reply(
                        h.redis,
                        h.keys,
                        self.sub.topic.name,
                        e.shard,
                        e.entry_id.decode(),
                        e.env,  # type: ignore[arg-type]
                        answer,
                    )
                except Exception as exc:
                    return exc
        return None


def batch_queues(
    handling: Handling, fence: Fence, runner: QueueRunner, acks: Acks
) -> tuple[BatchQueues, Callable[[list[Item], Slot], Awaitable[None]]]:
    """The queues and the workers' step of a batch subscription, from its pipeline's parts
    (`eventbus.consumer.pipeline.Queues`): one queue per shard, run in batches, an entry that
    breaks a batch stepped by `runner`."""
    call = cast(BatchHandlerCall, handling.sub.call)
    batches = BatchRunner(handling, fence, runner.process, acks)
    return BatchQueues(acks.started, call.max_batch), batches.run

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
  one by one, in their place, by `Handling.step`. Catch-up from the durable tier and replays of
  parked letters call the handler with batches of one.
"""

from __future__ import annotations

import asyncio
import logging
import time
import typing
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, cast

import anyio
import anyio.abc
import anyio.to_thread
from pydantic import BaseModel, TypeAdapter

from eventbus.consumer.acks import Acks
from eventbus.consumer.batch_call import BatchHandlerCall as BatchHandlerCall  # re-exported
from eventbus.consumer.batch_call import batch_handler_models as batch_handler_models
from eventbus.consumer.batch_call import is_batch as is_batch
from eventbus.consumer.delivery import NOT_STARTED, Fence, NotStarted
from eventbus.consumer.handling import Handling, _large
from eventbus.consumer.queues import ResourceQueues
from eventbus.consumer.shards import HeldShard, Item
from eventbus.consumer.watchdog import Slot
from eventbus.dlq import is_control
from eventbus.errors import DecodeError, HandlerTimeout
from eventbus.ops.metrics import METRICS
from eventbus.protocol.codec import F_DATA, FORMAT_MSGPACK, THREAD_DECODE_BYTES, Envelope

log = logging.getLogger("eventbus.consumer")

Step = Callable[[Item, Slot], Awaitable[float | None]]
"""The consumer's per-event step (`Consumer._process`) with the worker's watchdog slot."""
_ONE_QUEUE = b""  # the resource part of a shard's one queue key
_PLAIN = bytes([FORMAT_MSGPACK])


class BatchQueues(ResourceQueues):
    """One queue per shard (not per resource); a worker takes up to `max_batch` entries of one
    lock acquisition from its head and runs them as a batch."""

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
            self._wake.set()
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
                    generation = queue[0].generation
                    batch: list[Item] = []
                    for item in queue:
                        if item.generation != generation or len(batch) == self.max_batch:
                            break
                        batch.append(item)
                    await run(batch, slot)
                    for _ in batch:
                        queue.popleft()
            finally:
                del self._queues[key]


@dataclass(slots=True)
class _Entry:
    item: Item
    env: Envelope
    event: Any


class BatchRunner:
    """Handles the batches of one batch subscription (see the module docstring). `process`
    is the consumer's per-event step (acks or lets go what it finishes), `stopped` is set on
    shutdown (a retry's wait ends at once, then the fence lets the entries go)."""

    def __init__(
        self,
        handling: Handling,
        fence: Fence,
        process: Step,
        acks: Acks,
        stopped: anyio.Event,
    ) -> None:
        self.handling = handling
        self.sub = handling.sub
        self.call = cast(BatchHandlerCall, handling.sub.call)
        self.fence = fence
        self.process = process
        self.acks = acks
        self.stopped = stopped
        self._adapters = {m: TypeAdapter(list[m]) for m in set(self.sub.models.values())}  # type: ignore[valid-type]
        labels = (self.sub.topic.name, self.sub.group)
        self._m_failures = METRICS.failures.labels(*labels)
        self._m_timeouts = METRICS.handler_timeouts.labels(*labels)

    async def run(self, items: list[Item], slot: Slot) -> None:
        """Finish `items` (consecutive entries of one shard, one acquisition), in order; `slot`
        is the calling worker's watchdog slot."""
        i = 0
        while i < len(items):
            if not await self.fence.wait(items[i]):
                for item in items[i:]:
                    self.acks.finish(item)
                return
            entries = self._decoded_run(items, i)
            if not entries:
                await self._single(items[i], slot)
                i += 1
                continue
            await self._settle(entries, self.sub.retry.max_attempts, slot)
            i += len(entries)

    def _decoded_run(self, items: list[Item], start: int) -> list[_Entry]:
        """The longest run of `items` from `start` that can be handled as a batch, decoded and
        validated (the whole run at once when it holds one model)."""
        envs: list[tuple[Item, Envelope, type[BaseModel]]] = []
        envelope, is_parked = self.handling._envelope, self.handling.failures.is_parked
        models = self.sub.models
        for item in items[start:]:
            fields = item.fields
            data = fields.get(F_DATA, b"")
            if is_control(fields) or (
                (len(data) >= THREAD_DECODE_BYTES or data[:1] != _PLAIN) and _large(fields)
            ):
                break
            try:
                env = envelope(fields)  # (an rid that is not UTF-8 fails here)
            except DecodeError:
                break
            model = models.get(env.event_type)
            if model is None or is_parked(env.resource_id):
                break
            envs.append((item, env, model))
        if not envs:
            return []
        if len({m for _, _, m in envs}) == 1:
            try:
                events = self._adapters[envs[0][2]].validate_python([e.payload for _, e, _ in envs])
                return [
                    _Entry(item, env, ev) for (item, env, _), ev in zip(envs, events, strict=True)
                ]
            except Exception:  # find the first entry that does not validate, one by one
                pass
        out = []
        for item, env, model in envs:
            try:
                out.append(_Entry(item, env, model.model_validate(env.payload)))
            except Exception:
                break
        return out

    async def _single(self, item: Item, slot: Slot) -> None:
        """The per-event path for `item`, its retries waited in place."""
        while (delay := await self.process(item, slot)) is not None:
            with anyio.move_on_after(delay):
                await self.stopped.wait()

    async def _settle(self, entries: list[_Entry], attempts: int, slot: Slot) -> None:
        """Call the handler on `entries` up to `attempts` times; then split them."""
        attempt = 0
        while True:
            head = entries[0].item
            if not await self.fence.wait(head):
                for e in entries:
                    self.acks.finish(e.item)
                return
            attempt += 1
            error = await self._call(entries, attempt, slot)
            if error is NOT_STARTED:
                attempt -= 1
                continue
            if error is None:
                for e in entries:
                    self.acks.ack(e.item)
                return
            if attempt >= attempts:
                break
            delay = self.sub.retry.delay_s(attempt)
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
            with anyio.move_on_after(delay):
                await self.stopped.wait()
        if len(entries) == 1:
            await self._single(entries[0].item, slot)
            return
        mid = len(entries) // 2
        await self._settle(entries[:mid], 1, slot)
        await self._resume(entries[mid:], slot)

    async def _resume(self, entries: list[_Entry], slot: Slot) -> None:
        """Settle the rest of a split batch, after its first half: entries of resources parked
        by that half go through the per-event path (dead-lettered as ``parked``)."""
        run: list[_Entry] = []
        for e in entries:
            if self.handling.failures.is_parked(e.env.resource_id):
                if run:
                    await self._settle(run, 1, slot)
                    run = []
                await self._single(e.item, slot)
            else:
                run.append(e)
        if run:
            await self._settle(run, 1, slot)

    async def _call(
        self, entries: list[_Entry], attempt: int, slot: Slot
    ) -> Exception | NotStarted | None:
        """One call of the batch handler; its exception, None, or `NOT_STARTED` (fence lost)."""
        ctxs = [
            self.handling.context(e.item, e.env, entry_id=e.item.entry_id, attempt=attempt)
            for e in entries
            if self.call.takes_context  # none built for a handler of events alone
        ]
        events = [e.event for e in entries]
        if not self.fence.holds(entries[0].item):  # no await between this check and the call
            return NOT_STARTED
        slot.started = time.monotonic()  # no cancel scope per call: see Handling.attempt
        error: Exception | None = None
        try:
            await self.call.call_batch(events, ctxs)
        except asyncio.CancelledError:
            if not slot.timed_out():
                raise
            error = self.handling.timeout_error()
        except Exception as exc:
            error = self.handling.timeout_error() if slot.timed_out() else exc
        else:
            slot.timed_out()
        finally:
            slot.started = 0.0
        if error is not None:
            self._m_failures.inc()
            if isinstance(error, HandlerTimeout):
                self._m_timeouts.inc()
            return error
        self.handling.tally.handled += len(entries)
        self.handling.latencies.values.append(
            max(0.0, time.time() - entries[-1].env.published_at_ms / 1000)
        )
        return None


def batch_queues(
    handling: Handling, fence: Fence, process: Step, acks: Acks, stopped: anyio.Event
) -> tuple[BatchQueues, Callable[[list[Item], Slot], Awaitable[None]]]:
    """The queues and the worker's step of a batch subscription (`Consumer` uses them in place
    of `ResourceQueues` and its per-event step)."""
    call = cast(BatchHandlerCall, handling.sub.call)
    runner = BatchRunner(handling, fence, process, acks, stopped)
    return BatchQueues(acks.started, call.max_batch), runner.run

"""Sending publishes in call order: one ordered queue, one connection, pipelines sent in order.

Every `publish()` takes a `Slot` in the queue (`eventbus.publishing.slots`) the moment it is
called and marks it ready once its entry is encoded. The flusher (`Sender.run`) sends the
longest ready prefix of the queue as one pipeline, so entries leave in call order. On a single
node all pipelines go over *one* connection, up to `publish_pipelines` of them written ahead of
their replies: Redis runs one connection's commands in the order received, so what it applied is
always a prefix of what was sent. After a connection error the unconfirmed batches go back to
the front of the queue, in order, and are sent again ahead of anything later: the first copy of
every event lands in call order. (A batch whose reply was lost may have been applied: its second
copy, with the same event ID, lands later; `dedup_window_s` drops it.)
Concurrent calls for one resource therefore land as Kafka's producer lands them in a partition.

On a Redis Cluster (and fakeredis) one batch is in flight at a time, sent as redis-py's pipeline,
one per primary on a Cluster (`eventbus.publishing.wire`), which keeps the same order per stream.

How a batch is packed, sent and answered (hiredis's packer, redis-py's pipeline, WAIT) is
`eventbus.publishing.wire`.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

import anyio
import anyio.abc
from redis.asyncio import Redis
from redis.asyncio.connection import Connection, SSLConnection, UnixDomainSocketConnection

from eventbus.client import retry
from eventbus.client.retry import LOST_REPLY
from eventbus.config import Settings
from eventbus.errors import PublishError
from eventbus.publishing.slots import Slot, SlotQueue
from eventbus.publishing.wire import Wire

log = logging.getLogger("eventbus.publisher")

_FAST_CONNECTIONS = (Connection, SSLConnection, UnixDomainSocketConnection)


class Sender:
    """Sends the ordered queue of one publisher (`queue`): the flusher (`run`), or each caller
    its own slots while no flusher runs (`submit`, `send_now`)."""

    def __init__(self, redis: Any, settings: Settings) -> None:
        self._redis = redis
        self._settings = settings
        self.queue = SlotQueue(settings)
        self._sent = anyio.Event()  # a batch was written: the reader has replies to read
        self._written = 0
        pool = getattr(redis, "connection_pool", None)
        self._packed = type(redis) is Redis and issubclass(
            getattr(pool, "connection_class", object), _FAST_CONNECTIONS
        )
        self._depth = settings.publish_pipelines if self._packed else 1
        # of pipelines (and the topic check); capped at a quarter of the deadline, so that a
        # publish made while the flusher backs off is tried again in time once Redis is back
        self.backoff = retry.backoff(0.05, min(2.0, settings.publish_timeout_s / 4))
        self._wire = Wire(redis, settings)

    # -- without the flusher --------------------------------------------------------------------
    def sends(self, slot: Slot) -> bool:
        """Whether the flusher sends `slot` (else its caller must: `submit`)."""
        return self.queue.running and slot.queued

    async def submit(self, slot: Slot) -> str:
        """Wait for a ready slot's entry ID. Without a running flusher the slot is sent at once,
        on its own (then concurrent calls are not ordered among themselves)."""
        if not self.sends(slot):
            await self.send_now([slot])
        return await slot.future

    async def send_now(self, slots: list[Slot]) -> None:
        """Send ready `slots` now, in order, in batches of `publish_batch_max` (no flusher
        running: bus not entered, or stopping)."""
        self.queue.remove(slots)
        step = self._settings.publish_batch_max
        for i in range(0, len(slots), step):
            await self._send_alone(slots[i : i + step])

    async def _back_off(self, delay: float, error: Exception) -> None:
        """Wait `delay` seconds before the next try, failing each queued slot at its deadline
        meanwhile, not at the end of the wait (a whole backoff overshot `publish_timeout_s`)."""
        end = time.monotonic() + delay
        while True:  # a timer over the deadlines, not a poll
            earliest = self.queue.expire(error)
            now = time.monotonic()
            if now >= end:
                return
            await anyio.sleep(max(0.0, min(end, earliest) - now))

    # -- the flusher ----------------------------------------------------------------------------
    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Send the queue until cancelled (run by the bus); then, shielded, read the replies of
        what is on the wire and send what is still queued (each bounded by its deadline)."""
        self.queue.loop = asyncio.get_running_loop()  # reserve's loop while the flusher runs
        self.queue.running = True
        task_status.started()
        inflight: deque[list[Slot]] = deque()
        try:
            await self._loop(inflight)
        finally:
            self.queue.running = False
            with anyio.CancelScope(shield=True):
                self.queue.put_back(inflight, PublishError("publisher stopped"))
                await self.flush()

    async def flush(self) -> None:
        """Send every ready slot now, in order, one pipeline at a time (the flusher stopped).
        A slot still being prepared does not hold back the ones behind it: its caller sends it
        on its own once ready (`submit`)."""
        await self.send_now(self.queue.ready_slots())

    async def _loop(self, inflight: deque[list[Slot]]) -> None:
        """Send the queue, retrying failed sessions: what was on the wire goes back to the front
        of the queue. A batch leaves `inflight` only once its replies are read."""
        failures = 0
        conn = None
        try:
            while True:
                try:
                    if self._packed and conn is None:
                        conn = await self._redis.connection_pool.get_connection()
                        # every write and read here is bounded by the slots' deadlines: no
                        # socket timeout (redis-py would enter a timeout context per reply)
                        socket_timeout, conn.socket_timeout = conn.socket_timeout, None
                    await self._session(conn, inflight)
                except LOST_REPLY as exc:
                    if conn is not None:
                        await conn.disconnect()  # replies may be half read: never reuse it
                    self.queue.put_back(inflight, exc)
                    inflight.clear()
                    failures += 1
                    delay = self.backoff.compute(failures)
                    log.warning("XADD pipeline failed (%s); retry in %.2f s", exc, delay)
                    await self._back_off(delay, exc)
                except Exception as exc:  # never leave a caller waiting on an unsettled future
                    if conn is not None:
                        await conn.disconnect()
                    err = PublishError(f"XADD pipeline failed: {type(exc).__name__}: {exc}")
                    for slot in (s for batch in inflight for s in batch):
                        slot.settle(err)
                    inflight.clear()
                else:
                    failures = 0
        finally:
            if conn is not None:
                with anyio.CancelScope(shield=True):
                    if inflight:  # cancelled with batches on the wire: read their replies
                        try:
                            with anyio.fail_after(
                                max(0.0, inflight[-1][0].deadline - time.monotonic())
                            ):
                                while inflight:
                                    await self._wire.read(conn, inflight[0])
                                    inflight.popleft()
                        except Exception:
                            await conn.disconnect()
                    conn.socket_timeout = socket_timeout
                    await self._redis.connection_pool.release(conn)

    async def _session(self, conn: Any, inflight: deque[list[Slot]]) -> None:
        """Write batches and read their replies on `conn` until an error, which is raised.

        On a single node a writer and a reader share the connection: the writer sends each ready
        batch as soon as fewer than `publish_pipelines` are unanswered, while the reader reads
        replies in order, so encoding and sending overlap the round trips. Elsewhere one
        pipeline at a time (redis-py's cluster pipeline)."""
        if conn is None:
            while True:
                batch = await self._next_batch(inflight)
                with anyio.fail_after(max(0.0, batch[0].deadline - time.monotonic())):
                    await self._wire.pipeline(batch)
                inflight.popleft()
        errors: list[Exception] = []
        self._written = 0  # batches of `inflight` written and not read yet
        async with anyio.create_task_group() as tg:

            async def guarded(task: Callable[[], Awaitable[None]]) -> None:
                try:
                    await task()
                except Exception as exc:  # ends the session: the other task stops too
                    errors.append(exc)
                    tg.cancel_scope.cancel()

            tg.start_soon(guarded, partial(self._read_all, conn, inflight))
            await guarded(partial(self._write_all, conn, inflight))
        raise errors[0]

    async def _next_batch(self, inflight: deque[list[Slot]]) -> list[Slot]:
        """Wait for room on the wire and a ready batch; it is appended to `inflight`."""
        while True:
            if len(inflight) < self._depth and (batch := self.queue.take()):
                inflight.append(batch)
                return batch
            wake = self.queue.wake = anyio.Event()  # set by ready(), withdraw() and the reader
            # `ready` wakes it only when a ready slot can be sent: not while the wire is full
            # (the reader wakes it when a batch is answered)
            self.queue.idle = len(inflight) < self._depth
            try:
                await wake.wait()
            finally:
                self.queue.idle = False

    async def _write_all(self, conn: Any, inflight: deque[list[Slot]]) -> None:
        while True:
            batch = await self._next_batch(inflight)
            with anyio.fail_after(max(0.0, batch[0].deadline - time.monotonic())):
                await conn.send_packed_command(self._wire.pack(batch))  # (re)connects if needed
            self._written += 1
            self._sent.set()

    async def _read_all(self, conn: Any, inflight: deque[list[Slot]]) -> None:
        while True:
            # only what was written: a batch joins `inflight` before its write, which may be
            # (re)connecting, and the handshake's replies are the connection's own to read
            while not self._written:
                self._sent = anyio.Event()
                await self._sent.wait()
            with anyio.fail_after(max(0.0, inflight[0][0].deadline - time.monotonic())):
                await self._wire.read(conn, inflight[0])
            inflight.popleft()
            self._written -= 1
            self.queue.wake.set()  # room for the writer

    def _start(self, batch: list[Slot]) -> None:
        deadline = time.monotonic() + self._settings.publish_timeout_s
        for slot in batch:
            if slot.deadline == math.inf:
                slot.deadline = deadline

    async def _send_alone(self, batch: list[Slot]) -> None:
        """Send one batch, retrying connection errors until its deadline (outside the loop)."""
        self._start(batch)
        failures = 0
        while pending := [s for s in batch if not s.future.done()]:
            try:
                with anyio.fail_after(max(0.0, pending[0].deadline - time.monotonic())):
                    if self._packed:
                        await self._wire.send_packed_once(pending)
                    else:
                        await self._wire.pipeline(pending)
                return
            except LOST_REPLY as exc:
                failures += 1
                delay = self.backoff.compute(failures)
                if time.monotonic() + delay >= pending[0].deadline:
                    for slot in pending:
                        slot.deadline = 0.0
                    self.queue.put_back([pending], exc)  # every slot is past its deadline: failed
                    return
                log.warning(
                    "XADD of %d entries failed (%s); retry in %.2f s", len(pending), exc, delay
                )
                await anyio.sleep(delay)
            except Exception as exc:
                err = PublishError(f"XADD pipeline failed: {type(exc).__name__}: {exc}")
                for slot in pending:
                    slot.settle(err)
                return

"""Sending publishes in call order: one ordered queue, one connection, pipelines sent in order.

Every `publish()` takes a `Slot` in the queue the moment it is called, before anything that
can wait (the topic's shard-count check), and marks it ready once its entry is encoded. The
flusher sends the longest ready prefix of the queue as one pipeline, so entries leave in call
order. On a single node all pipelines go over *one* connection, up to `publish_pipelines` of
them written ahead of their replies: Redis runs one connection's commands in the order received,
so what it applied is always a prefix of what was sent. After a connection error the unconfirmed
batches go back to the front of the queue, in order, and are sent again ahead of anything later:
the first copy of every event lands in call order. (A batch whose reply was lost may have been
applied: its second copy, with the same event ID, lands later; `dedup_window_s` drops it.)
Concurrent calls for one resource therefore land as Kafka's producer lands them in a partition.

On a Redis Cluster (and fakeredis) one batch is in flight at a time, sent as redis-py's pipeline,
one per primary on a Cluster (`eventbus.publishing.wire`), which keeps the same order per stream.

How a batch is packed, sent and answered (hiredis's packer, redis-py's pipeline, WAIT) is
`eventbus.publishing.wire`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable
from functools import partial
from typing import Any

import anyio
import anyio.abc
import msgspec
from redis.asyncio import Redis
from redis.asyncio.connection import Connection, SSLConnection, UnixDomainSocketConnection

from eventbus.client import retry
from eventbus.client.retry import LOST_REPLY
from eventbus.config import Settings
from eventbus.errors import PublishError
from eventbus.ops.metrics import METRICS
from eventbus.publishing.wire import Wire

log = logging.getLogger("eventbus.publisher")

_FAST_CONNECTIONS = (Connection, SSLConnection, UnixDomainSocketConnection)


class Slot(msgspec.Struct, eq=False):
    """One publish's place in the queue; `stream` is None until its entry is encoded (ready).
    `deadline` (monotonic seconds) is set when the slot is first sent: it fails with
    `PublishError` if not confirmed by then. `queued`: taken while the flusher ran (it sends
    the slot); else its caller sends it (`submit`), also if the flusher started meanwhile.
    A `msgspec.Struct` (one per call): its constructor runs in C, a dataclass's in Python."""

    future: asyncio.Future[str]
    stream: str | None = None
    fields: dict[bytes, bytes] | None = None
    maxlen: int = 0
    deadline: float = math.inf
    queued: bool = False

    def settle(self, result: Any) -> None:
        if self.future.done():  # the caller was cancelled (its deadline passed)
            return
        if isinstance(result, Exception):
            METRICS.publish_errors.inc()
            if not isinstance(result, PublishError):
                result = PublishError(f"XADD {self.stream} failed: {result}")
            self.future.set_exception(result)
        else:
            self.future.set_result(result.decode() if isinstance(result, bytes) else result)


class Sender:
    """The ordered queue of one publisher and the flusher that sends it (`run`)."""

    def __init__(self, redis: Any, settings: Settings) -> None:
        self._redis = redis
        self._settings = settings
        self._queue: deque[Slot] = deque()
        self._wake = anyio.Event()
        self._idle = False  # the flusher waits on `_wake` (`ready` wakes it only then)
        self._sent = anyio.Event()  # a batch was written: the reader has replies to read
        self._written = 0
        self.running = False
        self._running_loop: asyncio.AbstractEventLoop | None = None
        pool = getattr(redis, "connection_pool", None)
        self._packed = type(redis) is Redis and issubclass(
            getattr(pool, "connection_class", object), _FAST_CONNECTIONS
        )
        self._depth = settings.publish_pipelines if self._packed else 1
        # of pipelines (and the topic check); capped at a quarter of the deadline, so that a
        # publish made while the flusher backs off is tried again in time once Redis is back
        self.backoff = retry.backoff(0.05, min(2.0, settings.publish_timeout_s / 4))
        self._wire = Wire(redis, settings)

    # -- the queue ------------------------------------------------------------------------------
    def reserve(self, timeout_s: float | None = None) -> Slot:
        """A new slot at the end of the queue: call it before the caller's first await. With
        `timeout_s` its deadline runs from now (`publish()`: a deadline on the caller), else from
        when it is first sent (`publish_many`: one pipeline's worth of time per batch)."""
        loop = self._running_loop if self.running else None
        slot = Slot((loop or asyncio.get_running_loop()).create_future())
        if timeout_s is not None:
            slot.deadline = time.monotonic() + timeout_s
        if self.running:  # without a flusher each call is sent on its own (`submit`)
            slot.queued = True
            self._queue.append(slot)
        return slot

    def reserve_many(self, count: int) -> list[Slot]:
        """`count` new slots at the end of the queue, in order, their deadlines running from
        when each is first sent (`publish_many`); as `reserve()` `count` times, in one pass."""
        loop = (self._running_loop if self.running else None) or asyncio.get_running_loop()
        slots = [Slot(loop.create_future()) for _ in range(count)]
        if self.running:
            for slot in slots:
                slot.queued = True
            self._queue.extend(slots)
        return slots

    def ready(self, slot: Slot, stream: str, fields: dict[bytes, bytes], maxlen: int) -> None:
        slot.stream, slot.fields, slot.maxlen = stream, fields, maxlen
        if self._idle:  # the flusher waits for work (else its next batch takes this slot)
            self._idle = False  # woken once: the calls ready before it runs need not set it
            self._wake.set()

    def withdraw(self, slot: Slot) -> None:
        """Take a slot that was never made ready out of the queue (its caller failed first)."""
        if slot.stream is None:
            with contextlib.suppress(ValueError):
                self._queue.remove(slot)
            self._wake.set()  # the slot may have held back the ones behind it

    def sends(self, slot: Slot) -> bool:
        """Whether the flusher sends `slot` (else its caller must: `submit`)."""
        return self.running and slot.queued

    async def submit(self, slot: Slot) -> str:
        """Wait for a ready slot's entry ID. Without a running flusher the slot is sent at once,
        on its own (then concurrent calls are not ordered among themselves)."""
        if not self.sends(slot):
            await self.send_now([slot])
        return await slot.future

    async def send_now(self, slots: list[Slot]) -> None:
        """Send ready `slots` now, in order, in batches of `publish_batch_max` (no flusher
        running: bus not entered, or stopping)."""
        for slot in slots:
            with contextlib.suppress(ValueError):
                self._queue.remove(slot)
        step = self._settings.publish_batch_max
        for i in range(0, len(slots), step):
            await self._send_alone(slots[i : i + step])

    def _take(self) -> list[Slot]:
        """The ready prefix of the queue, up to `publish_batch_max` slots, started (`_start`,
        in the same pass); cancelled callers' slots are dropped."""
        batch: list[Slot] = []
        queue = self._queue
        now = time.monotonic()
        start_deadline = now + self._settings.publish_timeout_s
        room = self._settings.publish_batch_max
        while queue and room:
            head = queue[0]
            if head.future.done():
                queue.popleft()
            elif head.stream is None:
                break
            elif head.deadline <= now:  # waited its whole deadline in the queue
                queue.popleft().settle(self._timed_out(TimeoutError("not sent in time")))
            else:
                if head.deadline == math.inf:
                    head.deadline = start_deadline
                batch.append(queue.popleft())
                room -= 1
        return batch

    def _timed_out(self, error: BaseException) -> PublishError:
        return PublishError(
            f"XADD not confirmed within {self._settings.publish_timeout_s:g} s "
            f"(EVENTBUS_PUBLISH_TIMEOUT_S): {type(error).__name__}: {error}; the event may or "
            "may not be stored (its event ID tells duplicates apart)"
        )

    def _put_back(self, batches: Iterable[list[Slot]], error: Exception) -> None:
        """Return unconfirmed slots to the front of the queue in their order; fail those whose
        deadline passed."""
        now = time.monotonic()
        back = []
        for slot in (s for batch in batches for s in batch if not s.future.done()):
            if now >= slot.deadline:
                slot.settle(self._timed_out(error))
            else:
                back.append(slot)
        self._queue.extendleft(reversed(back))

    async def _back_off(self, delay: float, error: Exception) -> None:
        """Wait `delay` seconds before the next try, failing each queued slot at its deadline
        meanwhile, not at the end of the wait (a whole backoff overshot `publish_timeout_s`)."""
        end = time.monotonic() + delay
        while True:  # a timer over the deadlines, not a poll
            earliest = self._expire(error)
            now = time.monotonic()
            if now >= end:
                return
            await anyio.sleep(max(0.0, min(end, earliest) - now))

    def _expire(self, error: Exception) -> float:
        """Fail the queued slots whose deadline passed (Redis unreachable: nothing is sent);
        return the earliest deadline of the others (monotonic seconds, inf if none)."""
        now = time.monotonic()
        earliest = math.inf
        waiting = [s for s in self._queue if not s.future.done()]
        self._queue.clear()
        for slot in waiting:
            if slot.deadline <= now:
                slot.settle(self._timed_out(error))
            else:
                earliest = min(earliest, slot.deadline)
                self._queue.append(slot)
        return earliest

    # -- the flusher ----------------------------------------------------------------------------
    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Send the queue until cancelled (run by the bus); then, shielded, read the replies of
        what is on the wire and send what is still queued (each bounded by its deadline)."""
        self._running_loop = asyncio.get_running_loop()  # reserve's loop while the flusher runs
        self.running = True
        task_status.started()
        inflight: deque[list[Slot]] = deque()
        try:
            await self._loop(inflight)
        finally:
            self.running = False
            with anyio.CancelScope(shield=True):
                self._put_back(inflight, PublishError("publisher stopped"))
                await self.flush()

    async def flush(self) -> None:
        """Send every ready slot now, in order, one pipeline at a time (the flusher stopped).
        A slot still being prepared does not hold back the ones behind it: its caller sends it
        on its own once ready (`submit`)."""
        ready = [s for s in self._queue if s.stream is not None and not s.future.done()]
        await self.send_now(ready)

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
                    self._put_back(inflight, exc)
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
            if len(inflight) < self._depth and (batch := self._take()):
                inflight.append(batch)
                return batch
            self._wake = anyio.Event()  # set by ready(), withdraw() and the reader
            # `ready` wakes it only when a ready slot can be sent: not while the wire is full
            # (the reader wakes it when a batch is answered)
            self._idle = len(inflight) < self._depth
            try:
                await self._wake.wait()
            finally:
                self._idle = False

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
            self._wake.set()  # room for the writer

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
                    self._put_back([pending], exc)  # every slot is past its deadline: failed
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

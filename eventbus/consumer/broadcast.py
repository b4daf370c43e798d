"""Broadcast subscribers: ``@bus.subscriber(topic, broadcast=True)``.

Every running instance gets every event of the topic published while it runs (cache
invalidation, configuration reloads, local read models). A `BroadcastConsumer` reads the
topic's shard streams with plain ``XREAD`` from where they ended when it started: no consumer
group, no lock, no lease, no ack, so nothing to clean up in Redis on shutdown and nothing left
behind by a crashed instance. Its guarantees are those of a plain read:

* **At most once per instance**: an event published while the instance was not reading (before
  it started, during a crash or a restart) is not delivered to it, and a handler that keeps
  failing after its retries (the subscriber's `RetryPolicy`, in place) is logged at ERROR and
  dropped: there is no dead-letter stream (an undecodable entry or an unknown type is logged
  and dropped too, or skipped with ``on_unknown="skip"``).
* **Order per resource within an instance**: a resource's events run one after another, in
  stream order; different resources run concurrently (at most `Settings.concurrency`). There
  is no order *across* instances: each runs at its own pace.
* **No fencing**: the `Context.fencing_token` is 0 (nothing is locked).

The handlers run through the same decode and attempt path as group subscribers
(`eventbus.consumer.handling`), with a fence that always holds.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from typing import Any

import anyio
from redis.exceptions import ResponseError
from redis.typing import KeyT, StreamIdT

from eventbus.client import retry
from eventbus.client.retry import LOST_REPLY
from eventbus.consumer.context import Subscription
from eventbus.consumer.delivery import NOT_STARTED, Delivery
from eventbus.consumer.handling import Handling
from eventbus.errors import DecodeError, UnknownEventType
from eventbus.locking.member import Member
from eventbus.protocol.codec import F_RESOURCE
from eventbus.protocol.topics import TopicRegistry

log = logging.getLogger("eventbus.consumer")

_BATCH = 500  # entries per stream per XREAD
_RETRIED: tuple[type[Exception], ...] = (*LOST_REPLY, ResponseError)  # reads start over


class _Open:
    """The fence of a broadcast consumer: nothing is locked, so it always holds."""

    def holds(self, d: Delivery) -> bool:
        return True

    async def wait(self, d: Delivery) -> bool:
        return True


class _Started:
    """What stands for a lease in readiness checks (`eventbus.ops.health`): ready once reading."""

    def __init__(self, started: anyio.Event) -> None:
        self._started = started

    def ok(self) -> bool:
        return self._started.is_set()


class BroadcastConsumer:
    """Runs one broadcast `Subscription` until stopped; see the module docstring."""

    def __init__(self, member: Member, registry: TopicRegistry, sub: Subscription) -> None:
        """`member` names this instance (its topic and group are `sub`'s); `registry` checks the
        topic's shard count."""
        settings = self.settings = member.settings
        self.redis, self.consumer_id, self.group = member.redis, member.consumer_id, member.group
        self.registry, self.sub, self.topic = registry, sub, sub.topic
        self.streams = [member.keys.stream(sub.topic.name, s) for s in range(sub.topic.shards)]
        self.positions: dict[KeyT, StreamIdT] = {}  # stream -> last entry ID read
        redis_retry = retry.forever(settings.retry_base_s, settings.retry_max_s)
        self.handling = Handling(member, sub, redis_retry)
        self.tally = self.handling.tally  # dead_lettered stays 0: no dead-letter stream here
        self._backoff = retry.backoff(settings.retry_base_s, settings.retry_max_s)
        self._limit = anyio.CapacityLimiter(settings.concurrency)
        self.in_flight = 0
        self.dropped = 0  # entries not handled: failed after retries, undecodable, unknown
        self.started = anyio.Event()  # set once the start positions are taken
        self.lease = _Started(self.started)

    async def behind(self) -> list[str]:
        """The streams this consumer has not read to their end, and entries in flight (for
        `eventbus.testing.TestBus.drain`)."""
        out = [f"{self.group}: {self.in_flight} in flight"] if self.in_flight else []
        for stream in self.streams:
            last = await self.redis.xrevrange(stream, count=1)
            if last and last[0][0] != self.positions.get(stream):
                out.append(f"{stream} broadcast {self.consumer_id}")
        return out

    async def run(self, stop: anyio.Event) -> None:
        """Read and handle until `stop` is set; the entries of the current read are finished
        (at most `shutdown_grace_s` seconds), the rest is not this instance's any more."""
        await self.registry.ensure(self.topic)
        await self._start_positions()
        log.info(
            "broadcast consumer %s starts on topic %s (%d shards)",
            self.consumer_id,
            self.topic.name,
            self.topic.shards,
        )
        # One XREAD of every shard stream on a single node; on a Cluster one per stream, each
        # on its own connection: the keys of one XREAD must share a hash slot there.
        reads = [[s] for s in self.streams] if self.settings.cluster else [self.streams]
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._cancel_reads_on, stop, tg.cancel_scope)
            tg.start_soon(self.handling.watchdog.run)
            for streams in reads:
                tg.start_soon(self._read_loop, streams, stop)

    async def _read_loop(self, streams: list[str], stop: anyio.Event) -> None:
        """Read `streams` from their positions and handle each read before the next, until
        `stop` is set (then the task group's cancellation ends a blocked read)."""
        failures = 0
        while not stop.is_set():
            try:
                positions: dict[KeyT, StreamIdT] = {s: self.positions[s] for s in streams}
                reply = await self.redis.xread(
                    positions,
                    count=_BATCH,
                    block=self.settings.block_max_ms,
                )
                failures = 0
            except _RETRIED as exc:
                failures += 1
                delay = self._backoff.compute(failures)
                log.warning(
                    "broadcast consumer %s: %s; retry in %.2f s", self.consumer_id, exc, delay
                )
                with anyio.move_on_after(delay):
                    await stop.wait()
                continue
            with (
                anyio.CancelScope(shield=True),
                anyio.move_on_after(self.settings.shutdown_grace_s),
            ):
                await self._handle(reply or [])
            self.handling.flush_metrics()

    async def _cancel_reads_on(self, stop: anyio.Event, scope: anyio.CancelScope) -> None:
        """A blocking XREAD does not wait for its block time once `stop` is set (the handling
        of a read is shielded: it finishes first)."""
        await stop.wait()
        scope.cancel()

    async def _start_positions(self) -> None:
        pipe = self.redis.pipeline(transaction=False)
        for stream in self.streams:
            pipe.xrevrange(stream, count=1)
        for stream, last in zip(self.streams, await pipe.execute(), strict=True):
            self.positions[stream] = last[0][0] if last else b"0-0"
        self.started.set()

    async def _handle(self, reply: list[Any]) -> None:
        """The entries of one XREAD: per resource in order, resources concurrently."""
        queues: dict[tuple[int, bytes], list[Delivery]] = defaultdict(list)
        for stream, entries in reply:
            key = stream.decode() if isinstance(stream, bytes) else stream
            shard = self.streams.index(key)
            for entry_id, fields in entries:
                queues[(shard, fields.get(F_RESOURCE, b""))].append(
                    Delivery(shard=shard, token=0, entry_id=entry_id, fields=fields)
                )
                self.positions[key] = entry_id
        self.in_flight += sum(len(q) for q in queues.values())
        async with anyio.create_task_group() as tg:
            for queue in queues.values():
                tg.start_soon(self._resource, queue)

    async def _resource(self, queue: list[Delivery]) -> None:
        async with self._limit:
            for d in queue:
                try:
                    await self._one(d)
                finally:
                    self.in_flight -= 1

    async def _one(self, d: Delivery) -> None:
        h = self.handling
        try:
            env, event = await h.decoded(d.fields)
        except DecodeError as exc:
            if isinstance(exc, UnknownEventType) and self.sub.routes.on_unknown == "skip":
                h._skip(exc.event_type)
                return
            self.dropped += 1
            log.warning(
                "broadcast: entry %s of shard %d is undecodable, dropped: %s",
                d.entry_id.decode(),
                d.shard,
                exc,
            )
            return
        while True:
            d.attempt += 1
            error = await h.attempt(d, env, event, _Open(), entry_id=d.entry_id, attempt=d.attempt)
            if error is None or error is NOT_STARTED:
                return
            delay = h.retry_delay(d, env, error, "broadcast handler")
            if delay is None:
                self.dropped += 1
                h.gave_up(d, env, error, "dropped", what="broadcast handler")
                return
            await anyio.sleep(delay)

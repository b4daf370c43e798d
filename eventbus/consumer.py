"""One consumer of one (topic, group): lock -> recover -> read -> process in order -> ack -> unlock.

The life of a round (`Consumer._round`):

1. ``lock_shards.lua`` refreshes this consumer's liveness and takes shard locks up to the fair share
   ``ceil(shards / live consumers)``. A lock taken over from a dead consumer comes back marked
   *dirty*: its pending entries list (PEL) is claimed with ``XAUTOCLAIM ... 0`` (min idle 0:
   holding the lock makes this consumer the rightful owner) and processed before anything new.
2. ``XREADGROUP ... BLOCK`` reads new entries of the held shards only.
3. Each entry goes to the FIFO queue of its resource; one task per busy resource runs the handler
   on its events one after another (entry-ID order), while different resources run concurrently.
   A failing handler is retried in place with exponential backoff, so later events of that
   resource wait; after `max_attempts` the entry goes to the group's dead-letter stream.
4. ``XACK`` runs after the handler succeeded (at-least-once), batched per stream. With
   ``ack="before"`` entries are read with NOACK instead (at-most-once).
5. Shards that returned nothing and have nothing in flight are released at once
   (``unlock_shards.lua``), and shards above the fair share stop being read and are released as
   soon as their in-flight entries are acked, so a newcomer gets work within a round.

Fencing: the consumer trusts its locks only until its *lease* runs out, ``lease_s`` after the
send time of the last confirmed liveness refresh (0.8 x the liveness TTL, which Redis counts from
a later instant). Without a lease it starts no handler and sends no XACK. Each lock acquisition
has a fencing token, given to handlers in `Context`. docs/semantics.md states the guarantee.
"""

from __future__ import annotations

import inspect
import itertools
import logging
import math
import os
import random
import socket
import time
import uuid
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Literal, cast

import anyio
from pydantic import BaseModel, ValidationError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from eventbus.codec import F_DATA, F_RESOURCE, F_TYPE, Envelope, decode_entry
from eventbus.config import Settings
from eventbus.errors import DecodeError, UnknownEventType
from eventbus.keys import Keys
from eventbus.metrics import METRICS
from eventbus.scripts import Scripts
from eventbus.topics import TopicConfig, TopicRegistry

log = logging.getLogger("eventbus.consumer")

_TRANSIENT = (RedisConnectionError, RedisTimeoutError, OSError)

# lock_shards.lua: state of each returned lock
_HELD, _TAKEN_FREE, _TAKEN_FROM_DEAD = 0, 1, 2


@dataclass(frozen=True, slots=True)
class Context:
    """What a handler knows about the entry it is processing.

    `fencing_token` grows on every change of the shard lock's owner: pass it to downstream stores
    that can reject writes carrying an older token (Kleppmann, "How to do distributed locking").
    `published_at_ms` is the publisher's wall clock (Unix ms) when the event was created.
    `attempt` counts from 1.
    """

    topic: str
    group: str
    shard: int
    entry_id: str
    resource_id: str
    event_id_bytes: bytes
    event_type: str
    published_at_ms: int
    headers: dict[str, str]
    attempt: int
    fencing_token: int
    consumer_id: str

    @property
    def event_id(self) -> uuid.UUID:
        """The event's ID (UUID), set by the publisher: the key for idempotent handling."""
        return uuid.UUID(bytes=self.event_id_bytes)


Handler = Callable[..., Awaitable[None] | None]


@dataclass(slots=True)
class Subscription:
    """A handler registered for (topic, group). `models` maps event type name -> model."""

    topic: TopicConfig
    group: str
    handler: Handler
    models: dict[str, type[BaseModel]]
    ack: Literal["after", "before"] = "after"
    max_attempts: int | None = None
    takes_context: bool = True

    @property
    def name(self) -> str:
        return getattr(self.handler, "__qualname__", repr(self.handler))


def new_consumer_id() -> str:
    """A consumer ID unique across machines and restarts: ``<host>-<pid>-<random>``."""
    return f"{socket.gethostname()[:40]}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


@dataclass(slots=True)
class _Shard:
    """Local state of a held shard lock. `generation` is unique per acquisition in this process:
    items and acks of an older generation are dropped (their entries stay pending for the owner)."""

    shard: int
    stream: str
    token: int
    generation: int
    in_flight: int = 0
    draining: bool = False  # above the fair share: no more reads, release when in_flight == 0


@dataclass(slots=True)
class _Item:
    shard: _Shard
    generation: int
    entry_id: bytes
    fields: dict[bytes, bytes]


@dataclass(slots=True)
class _Acks:
    shard: _Shard
    generation: int
    ids: list[bytes] = field(default_factory=list)


class Consumer:
    """Runs one `Subscription` until stopped. Created by `EventBus.run`; one per subscription."""

    def __init__(
        self,
        redis: Any,
        scripts: Scripts,
        keys: Keys,
        settings: Settings,
        registry: TopicRegistry,
        sub: Subscription,
        consumer_id: str | None = None,
    ) -> None:
        self.redis = redis
        self.scripts = scripts
        self.keys = keys
        self.settings = settings
        self.registry = registry
        self.sub = sub
        self.topic = sub.topic
        self.group = sub.group
        self.consumer_id = consumer_id or new_consumer_id()
        self.max_attempts = sub.max_attempts or settings.max_attempts
        self.noack = sub.ack == "before"
        self.handled = 0  # entries whose handler succeeded
        self.dead_lettered = 0

        self._members = keys.members(self.topic.name, self.group)
        self._locks = keys.locks(self.topic.name, self.group)
        self._dlq = keys.dead_letter(self.topic.name, self.group)
        self._streams = [keys.stream(self.topic.name, s) for s in range(self.topic.shards)]
        self._stream_shard = {s.encode(): i for i, s in enumerate(self._streams)}
        self._held: dict[int, _Shard] = {}
        self._generations = itertools.count(1)
        self._rotation = random.randrange(self.topic.shards)
        self._queues: dict[tuple[int, bytes], deque[_Item]] = {}
        self._acks: dict[int, _Acks] = {}
        self._ack_wake = anyio.Event()
        self._in_flight = 0
        self._capacity = anyio.Event()
        self._idle = anyio.Event()
        self._lease_until = 0.0
        self._lease_changed = anyio.Event()
        self._stopping = False
        # Resources with work and no worker. A memory stream hands each key to exactly one
        # waiting worker (one shared Event re-created by each waiter woke only the last one).
        self._ready, self._ready_out = anyio.create_memory_object_stream[tuple[int, bytes]](
            math.inf
        )
        labels = (self.topic.name, self.group)
        self._m_handled = METRICS.handled.labels(*labels)
        self._m_failures = METRICS.failures.labels(*labels)
        self._m_dead = METRICS.dead_lettered.labels(*labels)
        self._m_lost = METRICS.lost.labels(*labels)
        self._m_lease = METRICS.lease_lost.labels(*labels)
        self._m_latency = METRICS.latency.labels(*labels)
        self._is_async = inspect.iscoroutinefunction(sub.handler)

    # -- lifecycle ------------------------------------------------------------------------------
    async def run(self, stop: anyio.Event) -> None:
        """Consume until `stop` is set, then shut down gracefully.

        Graceful shutdown: stop reading, let running handlers finish, flush their acks, release
        every lock and leave the group's live members, so another consumer takes the shards over
        at its next round rather than after the liveness TTL. Events queued but not started stay
        pending and are recovered, in order, by the next owner.

        Raises `ShardCountMismatch` at start if the topic's stored shard count differs.
        """
        await self.registry.ensure(self.topic)
        await self._ensure_groups()
        log.info(
            "consumer %s starts on topic %s group %s (%d shards)",
            self.consumer_id,
            self.topic.name,
            self.group,
            self.topic.shards,
        )
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._heartbeat_loop)
                tg.start_soon(self._ack_loop)
                for _ in range(self.settings.concurrency):
                    tg.start_soon(self._worker)
                tg.start_soon(self._stop_starting, stop)
                await self._read_loop(stop)
                while self._in_flight:
                    await self._wait_idle()
                tg.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await self._leave()

    async def _stop_starting(self, stop: anyio.Event) -> None:
        """Once `stop` is set, start no more handlers, at once: the read loop may still be in a
        blocking read (or waiting for capacity) for a while, and queued entries must not keep
        running meanwhile, or a large backlog would delay the hand-over."""
        await stop.wait()
        self._stopping = True
        self._wake_all()

    async def _leave(self) -> None:
        try:
            await self.scripts.unlock_shards(
                keys=[self._members, self._locks],
                args=[self.consumer_id, 1, *self._held.keys()],
            )
            log.info("consumer %s left; released shards %s", self.consumer_id, sorted(self._held))
        except _TRANSIENT as exc:
            log.error(
                "consumer %s could not release its locks (%s); they free up after the liveness "
                "TTL of %.1f s",
                self.consumer_id,
                exc,
                self.settings.liveness_ttl_s,
            )
        self._held.clear()

    async def _ensure_groups(self) -> None:
        """XGROUP CREATE ... MKSTREAM on every shard stream (BUSYGROUP means it exists)."""
        start = "0" if self.settings.start == "beginning" else "$"
        pipe = self.redis.pipeline(transaction=False)
        for stream in self._streams:
            pipe.xgroup_create(stream, self.group, id=start, mkstream=True)
        for result in await pipe.execute(raise_on_error=False):
            if isinstance(result, Exception) and "BUSYGROUP" not in str(result):
                raise result

    # -- lease ----------------------------------------------------------------------------------
    def _lease_ok(self) -> bool:
        return time.monotonic() < self._lease_until

    def _renew_lease(self, sent_at: float) -> None:
        self._lease_until = max(self._lease_until, sent_at + self.settings.lease_s)
        self._lease_changed.set()
        self._lease_changed = anyio.Event()

    def _drop_all(self, reason: str) -> None:
        """Forget every held shard: queued items and unsent acks of them are dropped and their
        entries stay pending, to be recovered by whoever holds the lock next (maybe us)."""
        if self._held:
            log.warning(
                "consumer %s drops shards %s: %s", self.consumer_id, sorted(self._held), reason
            )
            self._m_lease.inc()
        self._held.clear()
        self._wake_all()

    async def _heartbeat_loop(self) -> None:
        ttl = self.settings.liveness_ttl_s
        while True:
            sent_at = time.monotonic()
            try:
                was_live = await self.scripts.heartbeat(
                    keys=[self._members], args=[self.consumer_id, int(ttl * 1000)]
                )
            except _TRANSIENT as exc:
                log.warning("consumer %s heartbeat failed: %s", self.consumer_id, exc)
                await anyio.sleep(ttl / 10)
                continue
            if not was_live:
                self._drop_all("liveness had expired before this heartbeat")
            self._renew_lease(sent_at)
            await anyio.sleep(ttl / 3)

    # -- reading --------------------------------------------------------------------------------
    async def _read_loop(self, stop: anyio.Event) -> None:
        block = self.settings.block_min_ms
        failures = 0
        while not stop.is_set():
            while self._in_flight >= self.settings.max_in_flight and not stop.is_set():
                await self._capacity.wait()
            if stop.is_set():
                break
            try:
                got = await self._round(block)
                failures = 0
            except _TRANSIENT as exc:
                failures += 1
                delay = min(self.settings.retry_max_s, 0.05 * 2**failures)
                log.warning(
                    "consumer %s: Redis unavailable (%s); retry in %.2f s",
                    self.consumer_id,
                    exc,
                    delay,
                )
                with anyio.move_on_after(delay):
                    await stop.wait()
                continue
            except ResponseError as exc:
                if "NOGROUP" not in str(exc):
                    raise
                log.warning("consumer %s: group missing (%s); creating it", self.consumer_id, exc)
                await self._ensure_groups()
                continue
            block = (
                self.settings.block_min_ms if got else min(block * 2, self.settings.block_max_ms)
            )

    async def _round(self, block_ms: int) -> bool:
        """One lock/recover/read/release round. Returns whether any entry was read."""
        n = self.topic.shards
        order = [(self._rotation + i) % n for i in range(n)]
        self._rotation = (self._rotation + 1) % n
        sent_at = time.monotonic()
        reply = await self.scripts.lock_shards(
            keys=[self._members, self._locks],
            args=[self.consumer_id, int(self.settings.liveness_ttl_s * 1000), n, *order],
        )
        self._renew_lease(sent_at)
        share = int(reply[0])
        now_held = {int(s): (int(tok), int(state)) for s, tok, state in reply[1:]}
        for s in [s for s in self._held if s not in now_held]:
            log.warning("consumer %s lost shard %d to another consumer", self.consumer_id, s)
            del self._held[s]
        recover = []
        for s, (token, state) in now_held.items():
            local = self._held.get(s)
            if local is None or state != _HELD or local.token != token:
                self._held[s] = _Shard(s, self._streams[s], token, next(self._generations))
                # Whatever state the lock was in, a new owner claims the shard's pending entries
                # first: a free lock is not a clean shard, since a consumer that left gracefully
                # leaves the entries it had read but not started pending.
                if not self.noack:
                    recover.append(s)
        if recover:
            await self._recover(recover)
        self._mark_surplus(share)

        readable = [sh for sh in self._held.values() if not sh.draining]
        got: set[int] = set()
        if readable:
            got = await self._read(readable, block_ms)
        else:  # nothing to read (all held shards draining, or none held): wait a poll
            await anyio.sleep(block_ms / 1000)
        idle = [
            sh.shard
            for sh in self._held.values()
            if sh.in_flight == 0 and (sh.draining or sh.shard not in got)
        ]
        if idle:
            await self._release(idle)
        return bool(got)

    def _mark_surplus(self, share: int) -> None:
        active = [sh for sh in self._held.values() if not sh.draining]
        surplus = len(active) - share
        if surplus > 0:
            for sh in sorted(active, key=lambda sh: sh.in_flight)[:surplus]:
                sh.draining = True

    async def _read(self, shards: list[_Shard], block_ms: int) -> set[int]:
        streams = {sh.stream: ">" for sh in shards}
        if self.settings.cluster:
            # RedisCluster refuses multi-slot XREADGROUP: one non-blocking read per stream,
            # pipelined (grouped per node by redis-py), then an adaptive pause if all were empty.
            pipe = self.redis.pipeline()
            for stream in streams:
                pipe.xreadgroup(
                    self.group,
                    self.consumer_id,
                    {stream: ">"},
                    count=self.settings.read_count,
                    noack=self.noack,
                )
            replies = [r for res in await pipe.execute() for r in (res or [])]
            if not any(entries for _, entries in replies):
                await anyio.sleep(block_ms / 1000)
        else:
            replies = (
                await self.redis.xreadgroup(
                    self.group,
                    self.consumer_id,
                    streams,
                    count=self.settings.read_count,
                    block=block_ms,
                    noack=self.noack,
                )
                or []
            )
        got = set()
        for stream, entries in replies:
            if entries:
                shard = self._held.get(self._stream_shard[stream])
                if shard is not None:
                    got.add(shard.shard)
                    self._dispatch(shard, entries)
        return got

    async def _recover(self, shards: list[int]) -> None:
        """Claim and enqueue the PEL of newly taken shards, in entry-ID order, before new reads.

        The first XAUTOCLAIM of every shard goes in one pipeline (most PELs are empty)."""
        pipe = self.redis.pipeline(transaction=False)
        for s in shards:
            pipe.xautoclaim(
                self._held[s].stream,
                self.group,
                self.consumer_id,
                0,
                "0-0",
                count=self.settings.read_count,
            )
        first_pages = await pipe.execute()
        for s, page in zip(shards, first_pages, strict=True):
            sh = self._held[s]
            cursor, entries, deleted = page
            while True:
                if entries:
                    log.info(
                        "consumer %s recovers %d pending entries of shard %d",
                        self.consumer_id,
                        len(entries),
                        s,
                    )
                    self._dispatch(sh, entries)
                if deleted:
                    self._m_lost.inc(len(deleted))
                    log.error(
                        "shard %s: %d pending entries were trimmed before being processed "
                        "(stream cap too small?): %s",
                        sh.stream,
                        len(deleted),
                        deleted[:5],
                    )
                if cursor in (b"0-0", "0-0"):
                    break
                cursor, entries, deleted = await self.redis.xautoclaim(
                    sh.stream,
                    self.group,
                    self.consumer_id,
                    0,
                    cursor,
                    count=self.settings.read_count,
                )

    async def _release(self, shards: list[int]) -> None:
        await self.scripts.unlock_shards(
            keys=[self._members, self._locks], args=[self.consumer_id, 0, *shards]
        )
        for s in shards:
            self._held.pop(s, None)

    # -- processing -----------------------------------------------------------------------------
    def _dispatch(
        self, shard: _Shard, entries: list[tuple[bytes, dict[bytes, bytes] | None]]
    ) -> None:
        for entry_id, fields in entries:
            if fields is None:  # deleted between read and claim: nothing to process
                continue
            item = _Item(shard, shard.generation, entry_id, fields)
            shard.in_flight += 1
            self._in_flight += 1
            key = (shard.shard, fields.get(F_RESOURCE, b"\x00" + entry_id))
            queue = self._queues.get(key)
            if queue is None:
                self._queues[key] = deque([item])
                self._ready.send_nowait(key)
            else:
                queue.append(item)

    async def _worker(self) -> None:
        """One of `concurrency` workers: takes a resource with queued entries and runs them in
        order. A resource is in `_queues` while a worker owns it or it waits in `_ready`, so two
        workers never run the same resource."""
        while True:
            key = await self._ready_out.receive()
            queue = self._queues[key]
            try:
                while queue:
                    await self._process(queue[0])
                    queue.popleft()
            finally:
                del self._queues[key]

    def _current(self, item: _Item) -> bool:
        sh = self._held.get(item.shard.shard)
        return sh is not None and sh.generation == item.generation and not self._stopping

    async def _await_lease(self, item: _Item) -> bool:
        """Wait until the lease is valid; False if the item's shard was lost meanwhile."""
        while not self._lease_ok():
            if not self._current(item):
                return False
            await self._lease_changed.wait()
        return self._current(item)

    async def _process(self, item: _Item) -> None:
        if not await self._await_lease(item):
            self._finish(item)
            return
        try:
            env, event = self._decode(item)
        except DecodeError as exc:
            await self._dead_letter(item, exc, attempts=0)
            return
        entry_id = item.entry_id.decode()
        for attempt in range(1, self.max_attempts + 1):
            ctx = Context(
                topic=self.topic.name,
                group=self.group,
                shard=item.shard.shard,
                entry_id=entry_id,
                resource_id=env.resource_id,
                event_id_bytes=env.event_id,
                event_type=env.event_type,
                published_at_ms=env.time_ms,
                headers=env.headers,
                attempt=attempt,
                fencing_token=item.shard.token,
                consumer_id=self.consumer_id,
            )
            try:
                await self._call(event, ctx)
            except Exception as exc:
                self._m_failures.inc()
                if attempt == self.max_attempts:
                    log.error(
                        "handler %s failed %d times on %s %s: %r; dead-lettering",
                        self.sub.name,
                        attempt,
                        item.shard.stream,
                        entry_id,
                        exc,
                    )
                    await self._dead_letter(item, exc, attempts=attempt)
                    return
                delay = min(
                    self.settings.retry_max_s, self.settings.retry_base_s * 2 ** (attempt - 1)
                )
                delay *= random.uniform(0.5, 1.0)  # "equal jitter"
                log.warning(
                    "handler %s failed on %s %s (attempt %d/%d): %r; retry in %.2f s",
                    self.sub.name,
                    item.shard.stream,
                    entry_id,
                    attempt,
                    self.max_attempts,
                    exc,
                    delay,
                )
                await anyio.sleep(delay)
                if not await self._await_lease(item):
                    self._finish(item)
                    return
                continue
            self.handled += 1
            self._m_handled.inc()
            self._m_latency.observe(max(0.0, time.time() - env.time_ms / 1000))
            self._ack(item)
            return

    def _decode(self, item: _Item) -> tuple[Envelope, Any]:
        env = decode_entry(item.fields, max_bytes=self.settings.max_payload_bytes * 64)
        model = self.sub.models.get(env.event_type)
        if model is None:
            raise UnknownEventType(
                f"event type {env.event_type!r} is not handled by {self.sub.name} "
                f"(expects {sorted(self.sub.models)})"
            )
        try:
            return env, model.model_validate(env.payload)
        except ValidationError as exc:
            raise DecodeError(f"payload does not validate as {model.__name__}: {exc}") from None

    async def _call(self, event: Any, ctx: Context) -> None:
        args = (event, ctx) if self.sub.takes_context else (event,)
        if self._is_async:
            await cast("Awaitable[None]", self.sub.handler(*args))
        else:
            await anyio.to_thread.run_sync(partial(self.sub.handler, *args))

    async def _dead_letter(self, item: _Item, exc: BaseException, *, attempts: int) -> None:
        """XADD the original entry and the error to the group's dead-letter stream, then ack.

        The write is retried until it succeeds or the shard is lost: an entry is never acked
        before its dead-letter record exists.
        """
        fields = {
            b"topic": self.topic.name.encode(),
            b"group": self.group.encode(),
            b"shard": str(item.shard.shard).encode(),
            b"entry_id": item.entry_id,
            b"error_type": type(exc).__name__.encode(),
            b"error": str(exc).encode()[:4096],
            b"attempts": str(attempts).encode(),
            b"failed_at_ms": str(time.time_ns() // 1_000_000).encode(),
        }
        for name in (F_RESOURCE, F_TYPE, F_DATA):
            if name in item.fields:
                fields[b"orig_" + name] = item.fields[name]
        delay = self.settings.retry_base_s
        while True:
            if not await self._await_lease(item):
                self._finish(item)
                return
            try:
                await self.redis.xadd(self._dlq, fields, maxlen=self.topic.maxlen, approximate=True)
                break
            except _TRANSIENT as exc2:
                log.warning("dead-letter write to %s failed (%s); retrying", self._dlq, exc2)
                await anyio.sleep(delay)
                delay = min(delay * 2, self.settings.retry_max_s)
        self.dead_lettered += 1
        self._m_dead.inc()
        self._ack(item)

    # -- acking ---------------------------------------------------------------------------------
    def _ack(self, item: _Item) -> None:
        if self.noack:
            self._finish(item)
            return
        acks = self._acks.get(item.shard.shard)
        if acks is None or acks.generation != item.generation:
            if acks is not None:  # an older generation's acks: that shard was lost, drop them
                self._settle(acks)
            acks = self._acks[item.shard.shard] = _Acks(item.shard, item.generation)
        acks.ids.append(item.entry_id)
        self._ack_wake.set()

    async def _ack_loop(self) -> None:
        delay = self.settings.retry_base_s
        while True:
            await self._ack_wake.wait()
            self._ack_wake = anyio.Event()
            batch, self._acks = self._acks, {}
            while not self._lease_ok() and self._held:
                await self._lease_changed.wait()
            current = [
                a
                for a in batch.values()
                if self._held.get(a.shard.shard) is not None
                and self._held[a.shard.shard].generation == a.generation
            ]
            try:
                if current:
                    pipe = self.redis.pipeline(transaction=False)
                    for acks in current:
                        pipe.xack(acks.shard.stream, self.group, *acks.ids)
                    await pipe.execute()
            except _TRANSIENT as exc:
                log.warning("XACK failed (%s); retrying", exc)
                for s, acks in batch.items():  # put back, ahead of newer acks
                    newer = self._acks.get(s)
                    if newer is not None and newer.generation == acks.generation:
                        acks.ids.extend(newer.ids)
                    self._acks[s] = acks
                self._ack_wake.set()
                await anyio.sleep(delay)
                delay = min(delay * 2, self.settings.retry_max_s)
                continue
            delay = self.settings.retry_base_s
            for acks in batch.values():
                self._settle(acks)

    def _settle(self, acks: _Acks) -> None:
        for _ in acks.ids:
            self._finish_shard(acks.shard)

    def _finish(self, item: _Item) -> None:
        self._finish_shard(item.shard)

    def _finish_shard(self, shard: _Shard) -> None:
        shard.in_flight -= 1
        self._in_flight -= 1
        if self._in_flight == self.settings.max_in_flight - 1:  # crossed back under the cap
            self._capacity.set()
            self._capacity = anyio.Event()
        if self._in_flight == 0:
            self._idle.set()
            self._idle = anyio.Event()

    async def _wait_idle(self) -> None:
        await self._idle.wait()

    def _wake_all(self) -> None:
        self._lease_changed.set()
        self._lease_changed = anyio.Event()
        self._capacity.set()
        self._capacity = anyio.Event()

"""One consumer of one (topic, group): lock -> recover -> read -> process in order -> ack -> unlock.

The life of a round (`Consumer._round`):

1. ``lock_shards.lua`` refreshes this consumer's liveness and takes shard locks up to the fair share
   ``ceil(shards / live consumers)``. For every lock it has just taken, the consumer first claims
   the shard's pending entries list (PEL) with ``XAUTOCLAIM ... 0`` (min idle 0: holding the lock
   makes it the rightful owner) and queues them before anything new: a dead owner's PEL, and also
   what a gracefully departed owner had read but not started.
2. ``XREADGROUP ... BLOCK`` reads new entries of the held shards only.
3. Each entry goes to the FIFO queue of its resource; a fixed pool of `concurrency` workers takes
   resources with work and runs each resource's events one after another (entry-ID order), while
   different resources run concurrently. A failing handler is retried with exponential backoff
   and jitter while the resource's later events wait (its queue is put aside until a timer
   fires, so other resources go on); after `max_attempts` the entry goes to the group's
   dead-letter stream, and with ``on_failure="park"`` the resource is parked (see `eventbus.dlq`).
4. ``XACK`` runs after the handler succeeded (at-least-once), batched per stream. With
   ``ack="before"`` entries are read with NOACK instead (at-most-once).
5. Shards that have been idle (nothing read, nothing in flight) for `idle_release_ms` are
   released (``unlock_shards.lua``), and shards above the fair share stop being read and are
   released as soon as their in-flight entries are acked, so a newcomer gets work within a round.

Fencing: the consumer trusts its locks only until its *lease* runs out, ``lease_s`` after the
send time of the last confirmed liveness refresh (0.8 x the liveness TTL, which Redis counts from
a later instant). Without a lease it starts no handler and sends no XACK. Each lock acquisition
has a fencing token, given to handlers in `Context`. docs/semantics.md states the guarantee.
"""

from __future__ import annotations

import contextlib
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
from redis.exceptions import RedisError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from eventbus.codec import F_DATA, F_RESOURCE, F_TYPE, Envelope, decode_entry
from eventbus.config import Settings
from eventbus.dlq import DROP, DeadLetter, dead_letter_fields, is_control
from eventbus.errors import DecodeError, UnknownEventType
from eventbus.keys import Keys
from eventbus.metrics import METRICS
from eventbus.scripts import Scripts
from eventbus.topics import TopicConfig, TopicRegistry

log = logging.getLogger("eventbus.consumer")

_TRANSIENT = (RedisConnectionError, RedisTimeoutError, OSError)  # the reply may be lost
_RETRYABLE = (RedisError, OSError)  # includes error replies (OOM, READONLY, LOADING, ...)

CATCH_UP_CHECK_S = 10.0  # a shard is checked for a gap behind the archive at most this often

CatchUpHook = Callable[[int, int], Awaitable[object]]
"""``await hook(shard, fencing_token)``: bring the group up to Redis's first entry of a shard this
consumer has just locked, from the durable tier's segments (`eventbus.tier.catchup.shard_hook`)."""

_NOT_STARTED = Exception("handler not started: lease or shard lost")  # a sentinel

# lock_shards.lua: state of each returned lock
_HELD, _TAKEN_FREE, _TAKEN_FROM_DEAD = 0, 1, 2


@dataclass(slots=True)  # not frozen: a frozen init costs a setattr call per field, per event
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
    on_failure: Literal["continue", "park"] = "continue"
    retry_base_s: float | None = None
    retry_max_s: float | None = None
    dedup_window_s: float | None = None

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
    idle_since: float | None = None  # monotonic time of the first empty read in a row


@dataclass(slots=True)
class _Item:
    shard: _Shard
    generation: int
    entry_id: bytes
    fields: dict[bytes, bytes]
    attempt: int = 0  # handler attempts made so far


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
        self.retry_base_s: float = sub.retry_base_s or settings.retry_base_s
        self.retry_max_s: float = sub.retry_max_s or settings.retry_max_s
        self._dedup_s = math.ceil(sub.dedup_window_s) if sub.dedup_window_s else 0
        self.duplicates_skipped = 0  # entries skipped as already handled (dedup window)
        self.noack = sub.ack == "before"
        self.handled = 0  # entries whose handler succeeded
        self._handled_reported = 0  # of those, already added to the Prometheus counter
        self.dead_lettered = 0

        self._members = keys.members(self.topic.name, self.group)
        self._locks = keys.locks(self.topic.name, self.group)
        self._dlq = keys.dead_letter(self.topic.name, self.group)
        self._parked_key = keys.parked(self.topic.name, self.group)
        self._parked: dict[str, str] = {}  # resource -> first parked letter (shards we hold)
        self._parked_changes = 0  # local parks and unparks, to detect a reload racing them
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
        self._stopped = anyio.Event()
        self._joined = anyio.Event()  # set by the first lock round: then heartbeats start
        self._retry_timers: anyio.abc.TaskGroup | None = None
        self.catch_up: CatchUpHook | None = None  # set by EventBus.run when it has an archive
        self._caught_up_at: dict[int, float] = {}
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
                self._retry_timers = tg
                tg.start_soon(self._heartbeat_loop)
                tg.start_soon(self._ack_loop)
                for _ in range(self.settings.concurrency):
                    tg.start_soon(self._worker)
                tg.start_soon(self._stop_starting, stop)
                await self._read_loop(stop)
                with anyio.move_on_after(self.settings.shutdown_grace_s) as grace:
                    while self._in_flight:
                        await self._wait_idle()
                if grace.cancelled_caught:
                    log.error(
                        "consumer %s: %d entries still unacked after %.0f s of shutdown (Redis "
                        "unreachable?); they stay pending and will be delivered again",
                        self.consumer_id,
                        self._in_flight,
                        self.settings.shutdown_grace_s,
                    )
                tg.cancel_scope.cancel()
        finally:
            self._report_handled()
            with anyio.CancelScope(shield=True):
                await self._leave()

    async def _stop_starting(self, stop: anyio.Event) -> None:
        """Once `stop` is set, start no more handlers, at once: the read loop may still be in a
        blocking read (or waiting for capacity) for a while, and queued entries must not keep
        running meanwhile, or a large backlog would delay the hand-over."""
        await stop.wait()
        self._stopping = True
        self._stopped.set()
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

    def _drop_all(self, reason: str, *, lease: bool = True) -> None:
        """Forget every held shard: queued items and unsent acks of them are dropped and their
        entries stay pending, to be recovered by whoever holds the lock next (maybe us)."""
        if self._held:
            log.warning(
                "consumer %s drops shards %s: %s", self.consumer_id, sorted(self._held), reason
            )
            if lease:
                self._m_lease.inc()
        self._held.clear()
        self._wake_all()

    async def _heartbeat_loop(self) -> None:
        ttl = self.settings.liveness_ttl_s
        # The first lock round adds this consumer to the members; a heartbeat before that would
        # find no entry and take a consumer that is just joining for one whose liveness expired.
        await self._joined.wait()
        while True:
            sent_at = time.monotonic()
            try:
                was_live = await self.scripts.heartbeat(
                    keys=[self._members], args=[self.consumer_id, int(ttl * 1000)]
                )
            except _RETRYABLE as exc:
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
                # A reply lost with the connection may have delivered entries into our PEL:
                # forget the shards, so the next round re-claims their PEL in order first.
                self._drop_all(f"connection error during a round: {exc}", lease=False)
                failures += 1
                await self._back_off(stop, failures, "Redis unavailable", exc, logging.WARNING)
                continue
            except ResponseError as exc:
                failures += 1
                if "NOGROUP" in str(exc):
                    log.warning(
                        "consumer %s: group missing (%s); creating it", self.consumer_id, exc
                    )
                    with contextlib.suppress(*_RETRYABLE):
                        await self._ensure_groups()
                    continue
                await self._back_off(stop, failures, "Redis refused a command", exc, logging.ERROR)
                continue
            block = (
                self.settings.block_min_ms if got else min(block * 2, self.settings.block_max_ms)
            )

    async def _back_off(
        self, stop: anyio.Event, failures: int, what: str, exc: Exception, level: int
    ) -> None:
        """Log a failed round and wait 0.05 s x 2^failures (at most `retry_max_s`), or until
        `stop` is set."""
        delay = min(self.settings.retry_max_s, 0.05 * 2**failures)
        log.log(level, "consumer %s: %s (%s); retry in %.2f s", self.consumer_id, what, exc, delay)
        with anyio.move_on_after(delay):
            await stop.wait()

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
        self._joined.set()
        share = int(reply[0])
        now_held = {int(s): (int(tok), int(state)) for s, tok, state in reply[1:]}
        for s in [s for s in self._held if s not in now_held]:
            log.warning("consumer %s lost shard %d to another consumer", self.consumer_id, s)
            del self._held[s]
        newly = []
        for s, (token, state) in now_held.items():
            local = self._held.get(s)
            if local is None or state != _HELD or local.token != token:
                self._held[s] = _Shard(s, self._streams[s], token, next(self._generations))
                newly.append(s)
        if newly and self.sub.on_failure == "park":
            await self._load_parked()  # a new shard's resources may have been parked elsewhere
        # Whatever state the lock was in, a new owner claims the shard's pending entries first:
        # a free lock is not a clean shard, since a consumer that left gracefully leaves the
        # entries it had read but not started pending. (NOACK reads leave no pending entries.)
        recover = [] if self.noack else newly
        if recover and self.catch_up is not None:
            recover = await self._catch_up(recover)
        if recover:
            await self._recover(recover)
        self._mark_surplus(share)

        readable = [sh for sh in self._held.values() if not sh.draining]
        got: set[int] = set()
        # XREADGROUP is not fenced by Redis: a read sent after the lease ran out (a process
        # paused past its TTL) would pull entries of shards now owned by others into our PEL,
        # and their owner would read past them. So read only with a lease, blocking no longer
        # than it lasts; without one, skip the read and re-lock in the next round.
        lease_ms = int((self._lease_until - time.monotonic()) * 1000) - 5
        if readable and lease_ms < 1:
            return False
        if readable:
            got = await self._read(readable, min(block_ms, lease_ms))
        else:  # nothing to read (all held shards draining, or none held): wait a poll
            await anyio.sleep(block_ms / 1000)
        # A shard is released once it has been idle (no entry read, none in flight) for
        # `idle_release_ms`, or as soon as it is drained above the fair share. Releasing after a
        # single empty read made locks change owner about once per 1.5 events at 2,000
        # events/s (a lock, an unlock, a token and an XAUTOCLAIM each time).
        now = time.monotonic()
        idle_s = self.settings.idle_release_ms / 1000
        idle = []
        for sh in self._held.values():
            if sh.shard in got or sh.in_flight:
                sh.idle_since = None
                continue
            if sh.idle_since is None:
                sh.idle_since = now
            if sh.draining or now - sh.idle_since >= idle_s:
                idle.append(sh.shard)
        if idle:
            await self._release(idle)
        self._report_handled()
        return bool(got)

    def _report_handled(self) -> None:
        """Add the handler successes since the last call to the Prometheus counter (once a
        round rather than once an event: a labelled increment costs a few microseconds)."""
        self._m_handled.inc(self.handled - self._handled_reported)
        self._handled_reported = self.handled

    async def _catch_up(self, shards: list[int]) -> list[int]:
        """Before reading newly locked shards, let the catch-up hook handle what the group missed
        while those entries were trimmed from Redis (at most every `CATCH_UP_CHECK_S` per shard).
        A shard whose catch-up fails (archive unreachable) is released unread rather than read
        past the gap; returns the shards still held."""
        kept = []
        for s in shards:
            sh = self._held.get(s)
            if sh is None:
                continue
            if time.monotonic() - self._caught_up_at.get(s, -CATCH_UP_CHECK_S) < CATCH_UP_CHECK_S:
                kept.append(s)
                continue
            try:
                await self.catch_up(s, sh.token)  # type: ignore[misc]  # checked by the caller
            except _TRANSIENT:
                raise
            except Exception as exc:
                log.error(
                    "consumer %s: catch-up of shard %d failed (%r); shard released unread",
                    self.consumer_id,
                    s,
                    exc,
                )
                await self._release([s])
                continue
            self._caught_up_at[s] = time.monotonic()
            kept.append(s)
        return kept

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
        held = [self._held[s] for s in shards]
        pipe = self.redis.pipeline(transaction=False)
        for sh in held:
            pipe.xautoclaim(
                sh.stream,
                self.group,
                self.consumer_id,
                0,
                "0-0",
                count=self.settings.read_count,
            )
        first_pages = await pipe.execute()
        for sh, page in zip(held, first_pages, strict=True):
            s = sh.shard
            cursor, entries, deleted = page
            while True:
                if self._held.get(s) is not sh:
                    break  # dropped meanwhile (lease lapsed): the next owner claims them again
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
        order. A resource is in `_queues` while a worker owns it, waits in `_ready`, or waits for
        a retry timer, so two workers never run the same resource. A retry's backoff does not
        hold a worker: the resource goes back to `_ready` when its timer fires."""
        while True:
            key = await self._ready_out.receive()
            queue = self._queues[key]
            retry_in: float | None = None
            try:
                while queue:
                    try:
                        retry_in = await self._process(queue[0])
                    except Exception as exc:  # a bug of ours: keep the entry, keep consuming
                        log.exception("consumer %s: internal error on an entry", self.consumer_id)
                        await self._dead_letter_and_ack(
                            queue[0], exc, reason="failed", attempts=queue[0].attempt
                        )
                        retry_in = None
                    if retry_in is not None:
                        break
                    queue.popleft()
            finally:
                if retry_in is None:
                    del self._queues[key]
                else:
                    assert self._retry_timers is not None
                    self._retry_timers.start_soon(self._retry_later, key, retry_in)

    async def _retry_later(self, key: tuple[int, bytes], delay: float) -> None:
        with anyio.move_on_after(delay):
            await self._stopped.wait()  # on shutdown, come back at once to be let go
        self._ready.send_nowait(key)

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

    async def _process(self, item: _Item) -> float | None:
        """One step for the entry at the head of its resource's queue.

        Returns the delay (s) after which to try it again (a handler attempt failed and attempts
        remain), or None once it is finished: acked, dead-lettered then acked, or let go
        unacked because its shard was lost (it stays pending for the next owner).
        """
        if not await self._await_lease(item):
            self._finish(item)
            return None
        if is_control(item.fields):
            await self._control(item)
            return None
        rid = item.fields.get(F_RESOURCE)
        if rid is not None and rid.decode("utf-8", "replace") in self._parked:
            await self._dead_letter_and_ack(item, None, reason="parked", attempts=0)
            return None
        try:
            env, event = self._decode(item.fields)
        except DecodeError as exc:
            await self._dead_letter_and_ack(item, exc, reason="undecodable", attempts=0)
            return None
        if self._dedup_s and await self._seen(env.event_id):
            self.duplicates_skipped += 1
            self._ack(item)
            return None
        item.attempt += 1
        error = await self._attempt(item, env, event, item.entry_id, item.attempt)
        if error is _NOT_STARTED:  # the lease ran out while decoding: wait for it again
            item.attempt -= 1
            return 0.0
        if error is None:
            if self._dedup_s:
                await self._mark_seen(env.event_id)
            self._ack(item)
            return None
        if item.attempt < self.max_attempts:
            delay = min(self.retry_max_s, self.retry_base_s * 2.0 ** (item.attempt - 1))
            delay *= random.uniform(0.5, 1.0)  # "equal jitter"
            log.warning(
                "handler %s failed on %s %s (attempt %d/%d): %r; retry in %.2f s",
                self.sub.name,
                item.shard.stream,
                item.entry_id.decode(),
                item.attempt,
                self.max_attempts,
                error,
                delay,
            )
            return delay
        log.error(
            "handler %s failed %d times on %s %s: %r; dead-lettering%s",
            self.sub.name,
            item.attempt,
            item.shard.stream,
            item.entry_id.decode(),
            error,
            " and parking the resource" if self.sub.on_failure == "park" else "",
        )
        dlq_id = await self._dead_letter(item, error, reason="failed", attempts=item.attempt)
        if dlq_id is None:
            return None
        if self.sub.on_failure == "park":
            await self._park(env.resource_id, dlq_id)
        self._ack(item)
        return None

    async def _attempt(
        self, item: _Item, env: Envelope, event: Any, entry_id: bytes, attempt: int
    ) -> Exception | None:
        """Run the handler once; returns its exception, None on success, or `_NOT_STARTED` when
        the lease or the shard was lost since the caller checked it (then nothing ran)."""
        ctx = Context(
            topic=self.topic.name,
            group=self.group,
            shard=item.shard.shard,
            entry_id=entry_id.decode(),
            resource_id=env.resource_id,
            event_id_bytes=env.event_id,
            event_type=env.event_type,
            published_at_ms=env.time_ms,
            headers=env.headers,
            attempt=attempt,
            fencing_token=item.shard.token,
            consumer_id=self.consumer_id,
        )
        # Checked again right before the call, with no await in between: decoding and
        # validation take a while, and a process paused during them must not start a handler
        # with a superseded token when it wakes (found by the chaos harness).
        if not (self._lease_ok() and self._current(item)):
            return _NOT_STARTED
        try:
            await self._call(event, ctx)
        except Exception as exc:
            self._m_failures.inc()
            return exc
        self.handled += 1
        self._m_latency.observe(max(0.0, time.time() - env.time_ms / 1000))
        return None

    def _decode(self, fields: dict[bytes, bytes]) -> tuple[Envelope, Any]:
        env = decode_entry(fields, max_bytes=self.settings.max_payload_bytes * 64)
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
        except Exception as exc:  # a validator of the model raised something else
            raise DecodeError(
                f"payload does not validate as {model.__name__}: {type(exc).__name__}: {exc}"
            ) from None

    async def _call(self, event: Any, ctx: Context) -> None:
        args = (event, ctx) if self.sub.takes_context else (event,)
        if self._is_async:
            await cast("Awaitable[None]", self.sub.handler(*args))
        else:
            await anyio.to_thread.run_sync(partial(self.sub.handler, *args))

    # -- de-duplication (optional) ----------------------------------------------------------------
    async def _seen(self, event_id: bytes) -> bool:
        key = self.keys.dedup(self.topic.name, self.group, event_id)
        return bool(await self._retrying("dedup check", self.redis.exists, key))

    async def _mark_seen(self, event_id: bytes) -> None:
        key = self.keys.dedup(self.topic.name, self.group, event_id)
        await self._retrying("dedup mark", self.redis.set, key, b"1", ex=self._dedup_s)

    async def _retrying(self, what: str, fn: Any, *args: Any, **kw: Any) -> Any:
        """Await ``fn(*args, **kw)``, retrying Redis errors with backoff until it succeeds."""
        delay = self.settings.retry_base_s
        while True:
            try:
                return await fn(*args, **kw)
            except _RETRYABLE as exc:
                log.warning("%s failed (%s); retry in %.2f s", what, exc, delay)
                await anyio.sleep(delay)
                delay = min(delay * 2, self.settings.retry_max_s)

    # -- dead letters and parking ---------------------------------------------------------------
    async def _dead_letter(
        self, item: _Item, exc: BaseException | None, *, reason: str, attempts: int
    ) -> bytes | None:
        """XADD the original entry and why to the group's dead-letter stream (see `eventbus.dlq`).

        Redis errors are retried until the write succeeds; returns its dead-letter entry ID, or
        None (item let go, unacked) if the shard was lost meanwhile. Does not ack: an entry is
        acked only after its dead-letter record exists.
        """
        original = {n: item.fields[n] for n in (F_RESOURCE, F_TYPE, F_DATA) if n in item.fields}
        fields = dead_letter_fields(
            topic=self.topic.name,
            group=self.group,
            shard=item.shard.shard,
            entry_id=item.entry_id,
            reason=reason,
            exc=exc,
            attempts=attempts,
            original=original,
        )
        delay = self.settings.retry_base_s
        while True:
            if not await self._await_lease(item):
                self._finish(item)
                return None
            try:
                dlq_id: bytes = await self.redis.xadd(
                    self._dlq, fields, maxlen=self.topic.maxlen, approximate=True
                )
                break
            except _RETRYABLE as exc2:
                log.warning("dead-letter write to %s failed (%s); retrying", self._dlq, exc2)
                await anyio.sleep(delay)
                delay = min(delay * 2, self.settings.retry_max_s)
        self.dead_lettered += 1
        self._m_dead.inc()
        return dlq_id

    async def _dead_letter_and_ack(
        self, item: _Item, exc: BaseException | None, *, reason: str, attempts: int
    ) -> None:
        if await self._dead_letter(item, exc, reason=reason, attempts=attempts) is not None:
            self._ack(item)

    async def _park(self, resource_id: str, dlq_id: bytes) -> None:
        """Mark `resource_id` parked (first parked letter `dlq_id`) before its entry is acked."""
        await self._retrying("park", self.redis.hsetnx, self._parked_key, resource_id, dlq_id)
        self._parked.setdefault(resource_id, dlq_id.decode())
        self._parked_changes += 1

    async def _load_parked(self) -> None:
        while True:  # a park or unpark made while the reply was on its way wins: read again
            changes = self._parked_changes
            raw = await self.redis.hgetall(self._parked_key)
            if changes == self._parked_changes:
                self._parked = {k.decode(): v.decode() for k, v in raw.items()}
                return

    async def _control(self, item: _Item) -> None:
        """Handle a control entry (`eventbus.dlq`): replay or drop a parked resource's letters,
        in order, then unpark it. Runs in the resource's queue, so the resource's later events
        wait until it is done. Control entries for other groups are acked and ignored."""
        try:
            env = decode_entry(item.fields)
        except DecodeError as exc:
            await self._dead_letter_and_ack(item, exc, reason="undecodable", attempts=0)
            return
        payload = env.payload if isinstance(env.payload, dict) else {}
        rid = env.resource_id
        first = await self._retrying("parked lookup", self.redis.hget, self._parked_key, rid)
        if payload.get("group") != self.group or first is None:
            self._ack(item)
            return
        letters = await self._parked_letters(rid, first.decode())
        if env.event_type == DROP:
            if letters:
                await self._retrying(
                    "drop", self.redis.xdel, self._dlq, *[d.dlq_id for d in letters]
                )
            log.warning("resource %r unparked; %d parked events dropped", rid, len(letters))
        else:
            for letter in letters:
                if not await self._replay_letter(item, letter):
                    if not self._current(item):  # stopped or shard lost: the control entry
                        self._finish(item)  # stays pending and the next owner resumes it
                        return
                    await self._retrying(
                        "re-park", self.redis.hset, self._parked_key, rid, letter.dlq_id
                    )
                    self._parked[rid] = letter.dlq_id
                    self._parked_changes += 1
                    self._ack(item)
                    return
            log.info("resource %r unparked after replaying %d events", rid, len(letters))
        if not self._current(item):
            self._finish(item)
            return
        await self._retrying("unpark", self.redis.hdel, self._parked_key, rid)
        self._parked.pop(rid, None)
        self._parked_changes += 1
        self._ack(item)

    async def _parked_letters(self, rid: str, first_id: str) -> list[DeadLetter]:
        """The resource's parked letters (failed or parked, not undecodable), in order."""
        letters: list[DeadLetter] = []
        start = first_id
        while True:
            rows = await self._retrying(
                "dead-letter scan", self.redis.xrange, self._dlq, min=start, count=500
            )
            for dlq_id, fields in rows:
                d = DeadLetter.parse(dlq_id, fields)
                if d.resource_id == rid and d.reason in ("failed", "parked"):
                    letters.append(d)
            if len(rows) < 500:
                return letters
            start = "(" + rows[-1][0].decode()

    async def _replay_letter(self, control: _Item, letter: DeadLetter) -> bool:
        """Run the handler on a parked letter (with retries in place) and delete the letter on
        success. False when it still fails (or the shard was lost): the resource stays parked."""
        try:
            env, event = self._decode(letter.original())
        except DecodeError as exc:
            log.error("parked letter %s is undecodable (%s); left in place", letter.dlq_id, exc)
            return False
        attempt = 1
        while attempt <= self.max_attempts:
            if not await self._await_lease(control):
                return False
            error = await self._attempt(control, env, event, letter.entry_id.encode(), attempt)
            if error is _NOT_STARTED:
                continue  # nothing ran: wait for the lease again, same attempt
            if error is None:
                await self._retrying(
                    "delete replayed letter", self.redis.xdel, self._dlq, letter.dlq_id
                )
                return True
            if attempt < self.max_attempts:
                await anyio.sleep(min(self.retry_max_s, self.retry_base_s * 2.0 ** (attempt - 1)))
            attempt += 1
        log.error("parked letter %s still fails after %d attempts", letter.dlq_id, attempt - 1)
        return False

    # -- acking ---------------------------------------------------------------------------------
    def _ack(self, item: _Item) -> None:
        if self.noack:
            self._finish(item)
            return
        held = self._held.get(item.shard.shard)
        if held is None or held.generation != item.generation:
            # the shard was lost or re-taken since this entry was read: it stays pending for the
            # current owner (maybe us, in a later generation), whose acks must not be touched
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
            except _RETRYABLE as exc:
                log.warning("XACK failed (%s); retrying", exc)
                for s, acks in batch.items():  # put back, ahead of newer acks
                    newer = self._acks.get(s)
                    if newer is None:
                        self._acks[s] = acks
                    elif newer.generation == acks.generation:
                        acks.ids.extend(newer.ids)
                        self._acks[s] = acks
                    else:  # newer acks belong to a later generation: this batch is stale
                        self._settle(acks)
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

"""Publishing: event -> envelope -> ``XADD <shard stream> MAXLEN ~ <cap> * rid .. type .. data ..``.

Concurrent `publish()` calls are coalesced into pipelines: while one pipeline is on the wire,
new calls queue up, and the next pipeline carries all of them (up to `publish_batch_max`). No
caller has to batch by hand, and a lone call is sent at once. This needs the bus to be running
(its flusher task lives in the bus's task group); outside a running bus each call is sent on its
own. XADD with ``MAXLEN ~`` trims whole macro nodes only, so the cap is approximate
(https://redis.io/docs/latest/commands/xadd/#capped-streams).

On a single node, a pipeline is packed with hiredis's C packer and written on one redis-py
connection: redis-py's asyncio client packs commands in pure Python (its sync client uses
hiredis), which measured 3.5x slower here (42k vs 148k XADD/s). Cluster and fakeredis clients
use redis-py's own pipeline, which routes commands per node.

With ``publish_replicas = N`` every pipeline ends with ``WAIT N timeout``
(https://redis.io/docs/latest/commands/wait/) on the same connection; when fewer than N replicas
confirm in time, every publish of that pipeline raises `PublishError` (the events are on the
primary, but a failover could lose them).

Connection errors are retried with exponential backoff until `publish_timeout_s`; after that the
call raises `PublishError`. `publish_timeout_s` is a deadline on the caller: `publish()` returns or
raises within it even when Redis stops answering mid-call (a stopped process, a partition without
RST), and each pipeline is abandoned at that deadline too (its connection closed), so neither the
flusher nor `publish_many` waits on a silent server for longer. An XADD whose reply was lost may
have been applied, so a retry can store an event twice: both copies carry the same event ID, for
consumers to de-duplicate.

What every consumer would refuse is refused here, before anything is sent: reserved event types
(``__eventbus.``, `ReservedEventType`), headers that are not str -> str and resource IDs that are
not valid UTF-8 (`InvalidEvent`), entries over `max_payload_bytes` (`PayloadTooLarge`) and
envelopes that decompress to more than `Settings.max_decompressed_bytes`
(`DecompressedTooLarge`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, cast

import anyio
import hiredis
from pydantic import BaseModel
from redis.asyncio import Redis
from redis.asyncio.connection import Connection, SSLConnection, UnixDomainSocketConnection
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from eventbus.codec import (
    F_DATA,
    MIN_CONTAINERS,
    RESERVED_TYPE_PREFIX,
    Envelope,
    decode_entry,
    decompressed_size,
    encode_entry,
    encoded_size,
    envelope_of,
)
from eventbus.config import Settings
from eventbus.errors import (
    ConfigError,
    DecodeError,
    DecompressedTooLarge,
    InvalidEvent,
    PayloadTooLarge,
    PublishError,
    ReservedEventType,
)
from eventbus.keys import Keys
from eventbus.sharding import shard_of
from eventbus.topics import TopicConfig, TopicRegistry

log = logging.getLogger("eventbus.publisher")

_TRANSIENT = (RedisConnectionError, RedisTimeoutError, OSError)
_FAST_CONNECTIONS = (Connection, SSLConnection, UnixDomainSocketConnection)


@dataclass(slots=True)
class _Pending:
    stream: str
    fields: dict[bytes, bytes]
    maxlen: int
    future: asyncio.Future[str]


class Publisher:
    """Encodes events and appends them to their shard streams. Created by `EventBus`."""

    def __init__(self, redis: Any, settings: Settings, keys: Keys, registry: TopicRegistry) -> None:
        self._redis = redis
        self._settings = settings
        self._keys = keys
        self._registry = registry
        self._streams: dict[str, list[str]] = {}
        self._buffer: list[_Pending] = []
        self._wake: anyio.Event | None = None  # set while the flusher runs
        self._topic_locks: dict[str, anyio.Lock] = {}
        if settings.cluster and settings.publish_replicas:
            # redis-py sends WAIT to one default node, not to those that stored the XADDs, so
            # the count it returns would not mean what the setting promises.
            raise ConfigError("publish_replicas (WAIT) is not supported with cluster=True")
        pool = getattr(redis, "connection_pool", None)
        self._packed = type(redis) is Redis and issubclass(
            getattr(pool, "connection_class", object), _FAST_CONNECTIONS
        )

    def _stream(self, topic: TopicConfig, resource_id: str) -> str:
        streams = self._streams.get(topic.name)
        if streams is None:
            streams = [self._keys.stream(topic.name, s) for s in range(topic.shards)]
            self._streams[topic.name] = streams
        return streams[shard_of(resource_id, topic.shards)]

    def prepare(
        self,
        topic: TopicConfig,
        event: BaseModel,
        resource_id: str,
        headers: dict[str, str] | None = None,
    ) -> tuple[str, dict[bytes, bytes]]:
        """Encode `event` for `topic`: returns (shard stream key, entry fields).

        Raises `ConfigError` for an empty resource ID or a non-model event, and `PayloadTooLarge`
        when the entry is over `max_payload_bytes`.
        """
        if not isinstance(event, BaseModel):
            raise ConfigError(f"event must be a pydantic model, got {type(event).__name__}")
        return self.prepare_envelope(topic, envelope_of(resource_id, event, headers))

    def prepare_envelope(
        self, topic: TopicConfig, envelope: Envelope
    ) -> tuple[str, dict[bytes, bytes]]:
        """Encode a ready envelope (e.g. a raw payload from the CLI); see `prepare`.

        Refuses what every consumer would refuse: raises `ReservedEventType`, `InvalidEvent`
        (headers not str -> str, text that is not valid UTF-8, a body over the decoders'
        structural budget), `PayloadTooLarge`, `DecompressedTooLarge`.
        """
        rid, etype = envelope.resource_id, envelope.event_type
        if not isinstance(rid, str) or not rid:
            raise ConfigError(f"resource_id must be a non-empty string, got {rid!r}")
        if not isinstance(etype, str) or not etype:
            raise InvalidEvent(topic.name, "event type", f"must be a non-empty string: {etype!r}")
        if etype.startswith(RESERVED_TYPE_PREFIX):
            raise ReservedEventType(etype, f"publish to topic {topic.name!r}")
        _check_text(topic, "resource_id", rid)
        _check_text(topic, "event type", etype)
        _check_headers(topic, envelope.headers)
        fields = encode_entry(envelope, compress_threshold=self._settings.compress_threshold_bytes)
        size = encoded_size(fields)
        if size > self._settings.max_payload_bytes:
            raise PayloadTooLarge(topic.name, size, self._settings.max_payload_bytes)
        self._check_decodable(topic, fields)
        return self._stream(topic, envelope.resource_id), fields

    def _check_decodable(self, topic: TopicConfig, fields: dict[bytes, bytes]) -> None:
        """Refuse an entry consumers could not decode: over `max_decompressed_bytes` once
        decompressed, or (bodies over `MIN_CONTAINERS` bytes only: smaller ones always fit)
        over the structural budget. The latter decodes the entry once, like a consumer."""
        limit = self._settings.max_decompressed_bytes
        body_size = decompressed_size(fields[F_DATA])
        if body_size > limit:
            raise DecompressedTooLarge(topic.name, body_size, limit)
        if body_size < 0 or body_size > MIN_CONTAINERS:
            try:
                decode_entry(fields, max_bytes=limit)
            except DecodeError as exc:
                raise InvalidEvent(topic.name, "payload", f"would not decode: {exc}") from None

    async def publish(
        self,
        topic: TopicConfig,
        event: BaseModel,
        resource_id: str,
        headers: dict[str, str] | None = None,
    ) -> str:
        """Append one event; returns its entry ID (``<ms>-<seq>``) once Redis has accepted it.

        Raises `ShardCountMismatch`, `PayloadTooLarge`, `ConfigError` (`ReservedEventType`,
        `InvalidEvent`), or `PublishError` when Redis did not confirm the XADD within
        `publish_timeout_s` seconds of the call (it may still have stored it).
        """
        with self._deadline(topic):
            if not self._registry.checked(topic.name):
                await self._check_topic(topic)
            stream, fields = self.prepare(topic, event, resource_id, headers)
            return await self._submit(stream, fields, topic.maxlen)
        raise AssertionError("unreachable: _deadline raises when it cancels")  # pragma: no cover

    async def publish_envelope(self, topic: TopicConfig, envelope: Envelope) -> str:
        """Append a ready envelope (no model needed); returns its entry ID. Same errors and
        deadline as `publish`."""
        with self._deadline(topic):
            await self._check_topic(topic)
            stream, fields = self.prepare_envelope(topic, envelope)
            return await self._submit(stream, fields, topic.maxlen)
        raise AssertionError("unreachable: _deadline raises when it cancels")  # pragma: no cover

    @contextlib.contextmanager
    def _deadline(self, topic: TopicConfig) -> Iterator[None]:
        """Cancel the body after `publish_timeout_s` seconds and raise `PublishError` then."""
        timeout = self._settings.publish_timeout_s
        with anyio.move_on_after(timeout) as scope:
            yield
        if scope.cancelled_caught:
            raise PublishError(
                f"publish to topic {topic.name!r} not confirmed within {timeout:g} s "
                "(EVENTBUS_PUBLISH_TIMEOUT_S): Redis did not answer in time; the event may or "
                "may not be stored (its event ID tells duplicates apart)"
            )

    async def _check_topic(self, topic: TopicConfig) -> None:
        """`TopicRegistry.ensure` under the publish retry policy: connection errors (a Redis
        restart) are retried until `publish_timeout_s`, then raised as `PublishError`, like those
        of the XADDs. Concurrent first publishes of a topic share one check."""
        if self._registry.checked(topic.name):
            return
        async with self._topic_locks.setdefault(topic.name, anyio.Lock()):
            deadline = time.monotonic() + self._settings.publish_timeout_s
            delay = 0.05
            while not self._registry.checked(topic.name):
                try:
                    await self._registry.ensure(topic)
                except _TRANSIENT as exc:
                    if time.monotonic() + delay > deadline:
                        raise PublishError(
                            f"shard count of topic {topic.name!r} not checked within "
                            f"{self._settings.publish_timeout_s} s: {exc}"
                        ) from exc
                    log.warning(
                        "shard count check of topic %s failed (%s); retry in %.2f s",
                        topic.name,
                        exc,
                        delay,
                    )
                    await anyio.sleep(delay)
                    delay = min(delay * 2, 2.0)
                except ResponseError as exc:  # READONLY (a replica), OOM, ...: not retried
                    raise PublishError(
                        f"shard count of topic {topic.name!r} could not be checked: {exc}"
                    ) from exc

    async def _submit(self, stream: str, fields: dict[bytes, bytes], maxlen: int) -> str:
        item = _Pending(stream, fields, maxlen, asyncio.get_running_loop().create_future())
        if self._wake is None:
            await self._send([item])
        else:
            self._buffer.append(item)
            self._wake.set()
        return await item.future

    async def publish_many(
        self,
        topic: TopicConfig,
        events: Iterable[tuple[str, BaseModel]],
        headers: dict[str, str] | None = None,
    ) -> list[str]:
        """Append `(resource_id, event)` pairs in order, in pipelines of `publish_batch_max`.

        Returns the entry IDs in input order. Every event is encoded (and size-checked) before the
        first is sent, so a bad event fails the call with nothing published. A `PublishError` of
        one pipeline is raised after the others were sent: the events of the pipelines that
        succeeded stay published (their IDs are in the error's ``entry_ids``, None where failed).
        """
        with self._deadline(topic):
            await self._check_topic(topic)
        loop = asyncio.get_running_loop()
        items = [
            _Pending(*self.prepare(topic, ev, rid, headers), topic.maxlen, loop.create_future())
            for rid, ev in events
        ]
        step = self._settings.publish_batch_max
        for i in range(0, len(items), step):
            await self._send(items[i : i + step])
        errors = [item.future.exception() for item in items]
        if any(errors):
            first = next(e for e in errors if e is not None)
            exc = PublishError(f"{sum(map(bool, errors))} of {len(items)} events failed: {first}")
            exc.entry_ids = [
                None if e else item.future.result() for item, e in zip(items, errors, strict=True)
            ]
            raise exc
        return [item.future.result() for item in items]

    async def _send(self, batch: list[_Pending]) -> None:
        """Send `batch`, retrying connection errors until `publish_timeout_s`; settles every
        future in it (result or `PublishError`) and never raises. The whole attempt, retries
        and a silent server included, ends at that deadline."""
        timeout = self._settings.publish_timeout_s
        deadline = time.monotonic() + timeout
        delay = 0.05
        # shielded: a cancelled caller must not strand the others; bounded: a server that
        # stopped answering must not hold the batch (and a pipeline slot) for ever
        scope = anyio.CancelScope(shield=True, deadline=anyio.current_time() + timeout)
        with scope:
            while True:
                try:
                    if self._packed:
                        await self._send_packed(batch)
                    else:
                        await self._send_pipeline(batch)
                    return
                except _TRANSIENT as exc:
                    batch = [item for item in batch if not item.future.done()]
                    if not batch:  # every caller of the batch was cancelled
                        return
                    if time.monotonic() + delay > deadline:
                        err = PublishError(
                            f"{len(batch)} XADD not confirmed within "
                            f"{self._settings.publish_timeout_s} s: {exc}"
                        )
                        for item in batch:
                            item.future.set_exception(err)
                        return
                    log.warning(
                        "XADD of %d entries failed (%s); retry in %.2f s", len(batch), exc, delay
                    )
                    await anyio.sleep(delay)
                    delay = min(delay * 2, 2.0)
                except Exception as exc:  # never leave a caller waiting on an unsettled future
                    err = PublishError(f"XADD pipeline failed: {type(exc).__name__}: {exc}")
                    for item in batch:
                        if not item.future.done():
                            item.future.set_exception(err)
                    return
        if scope.cancelled_caught:
            err = PublishError(
                f"{len(batch)} XADD not confirmed within {timeout:g} s "
                "(EVENTBUS_PUBLISH_TIMEOUT_S): Redis did not answer in time"
            )
            for item in batch:
                if not item.future.done():
                    item.future.set_exception(err)

    def _replicas_short(self, confirmed: Any) -> PublishError | None:
        """The error for a WAIT reply of `confirmed` replicas, or None if enough confirmed."""
        want = self._settings.publish_replicas
        if isinstance(confirmed, int) and confirmed >= want:
            return None
        return PublishError(
            f"only {confirmed} of {want} replicas confirmed within "
            f"{self._settings.publish_replicas_timeout_ms} ms (WAIT); the event is on the primary"
        )

    async def _send_pipeline(self, batch: list[_Pending]) -> None:
        pipe = self._redis.pipeline(transaction=False)
        for item in batch:
            pipe.xadd(item.stream, item.fields, maxlen=item.maxlen, approximate=True)
        if self._settings.publish_replicas:
            pipe.execute_command(
                "WAIT",
                self._settings.publish_replicas,
                self._settings.publish_replicas_timeout_ms,
            )
        results = await pipe.execute(raise_on_error=False)
        short = None
        if self._settings.publish_replicas:
            confirmed = results.pop()
            short = (
                PublishError(f"WAIT failed: {confirmed}; the events are on the primary")
                if isinstance(confirmed, Exception)
                else self._replicas_short(confirmed)
            )
        for item, result in zip(batch, results, strict=True):
            if isinstance(result, _TRANSIENT):
                raise result
            _settle(item, short or result)

    async def _send_packed(self, batch: list[_Pending]) -> None:
        # hiredis's stub types the argument as a 1-tuple; any tuple of str/bytes/int is packed
        pack = cast("Callable[[tuple[Any, ...]], bytes]", hiredis.pack_command)
        payload = b"".join(
            [
                pack(
                    (
                        b"XADD",
                        item.stream,
                        b"MAXLEN",
                        b"~",
                        item.maxlen,
                        b"*",
                        *[x for kv in item.fields.items() for x in kv],
                    )
                )
                for item in batch
            ]
        )
        replicas = self._settings.publish_replicas
        if replicas:
            payload += pack((b"WAIT", replicas, self._settings.publish_replicas_timeout_ms))
        pool = self._redis.connection_pool
        conn = await pool.get_connection()
        try:
            await conn.send_packed_command(payload)
            results: list[Any] = []
            for _ in batch:
                try:
                    results.append(await conn.read_response())
                except ResponseError as exc:  # this XADD failed; the rest of the replies follow
                    results.append(exc)
            short = None
            if replicas:
                try:
                    short = self._replicas_short(await conn.read_response())
                except ResponseError as exc:  # e.g. WAIT sent to a replica after a failover
                    short = PublishError(f"WAIT failed: {exc}; the events are on the primary")
            for item, result in zip(batch, results, strict=True):
                _settle(item, short or result)
        except BaseException:
            await conn.disconnect()  # replies may be half read: never reuse this connection
            raise
        finally:
            await pool.release(conn)

    async def run_flusher(self, *, task_status: anyio.abc.TaskStatus[None]) -> None:
        """Coalesce queued publishes into pipelines until cancelled (run by the bus).

        Up to `publish_pipelines` pipelines are in flight at once, each on its own connection,
        so encoding the next batch overlaps the round trip of the last. Order is unaffected: a
        caller's next publish starts only after its previous one returned.
        """
        self._wake = anyio.Event()
        slots = anyio.Semaphore(self._settings.publish_pipelines)

        async def send(batch: list[_Pending]) -> None:
            try:
                await self._send(batch)
            finally:
                slots.release()

        task_status.started()
        try:
            async with anyio.create_task_group() as tg:
                while True:
                    if not self._buffer:
                        self._wake = anyio.Event()
                        await self._wake.wait()
                    await slots.acquire()
                    step = self._settings.publish_batch_max
                    batch, self._buffer = self._buffer[:step], self._buffer[step:]
                    tg.start_soon(send, batch)
        finally:
            self._wake = None
            batch, self._buffer = self._buffer, []
            if batch:  # queued before the bus stopped: sent rather than dropped
                await self._send(batch)


def _check_text(topic: TopicConfig, what: str, text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidEvent(
            topic.name, what, f"{text!r} is not valid UTF-8 text ({exc.reason})"
        ) from None


def _check_headers(topic: TopicConfig, headers: Any) -> None:
    if not isinstance(headers, dict):
        raise InvalidEvent(topic.name, "headers", f"must be a dict of str -> str, not {headers!r}")
    for key, value in headers.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise InvalidEvent(
                topic.name,
                "headers",
                f"must map str to str: {key!r}: {value!r} (convert it with str())",
            )
        _check_text(topic, f"header {key!r}", key + value)


def _settle(item: _Pending, result: Any) -> None:
    if item.future.done():  # the caller was cancelled
        return
    if isinstance(result, PublishError):
        item.future.set_exception(result)
    elif isinstance(result, Exception):
        item.future.set_exception(PublishError(f"XADD {item.stream} failed: {result}"))
    else:
        item.future.set_result(result.decode() if isinstance(result, bytes) else result)

"""Publishing: event -> envelope -> ``XADD <shard stream> MAXLEN ~ <cap> * rid .. type .. data ..``.

Concurrent `publish()` calls are coalesced into pipelines: while one pipeline is on the wire,
new calls queue up, and the next pipeline carries all of them (up to `publish_batch_max`). No
caller has to batch by hand, and a lone call is sent at once. This needs the bus to be running
(its flusher task lives in the bus's task group); outside a running bus each call is sent on its
own. XADD with ``MAXLEN ~`` trims whole macro nodes only, so the cap is approximate
(https://redis.io/docs/latest/commands/xadd/#capped-streams).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream
from pydantic import BaseModel
from redis.exceptions import RedisError

from eventbus.codec import Envelope, encode_entry, encoded_size, envelope_of
from eventbus.config import Settings
from eventbus.errors import ConfigError, PayloadTooLarge, PublishError
from eventbus.keys import Keys
from eventbus.sharding import shard_of
from eventbus.topics import TopicConfig, TopicRegistry


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
        self._queue: MemoryObjectSendStream[_Pending] | None = None

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
        if not isinstance(resource_id, str) or not resource_id:
            raise ConfigError(f"resource_id must be a non-empty string, got {resource_id!r}")
        if not isinstance(event, BaseModel):
            raise ConfigError(f"event must be a pydantic model, got {type(event).__name__}")
        return self.prepare_envelope(topic, envelope_of(resource_id, event, headers))

    def prepare_envelope(
        self, topic: TopicConfig, envelope: Envelope
    ) -> tuple[str, dict[bytes, bytes]]:
        """Encode a ready envelope (e.g. a raw payload from the CLI); see `prepare`."""
        fields = encode_entry(envelope, compress_threshold=self._settings.compress_threshold_bytes)
        size = encoded_size(fields)
        if size > self._settings.max_payload_bytes:
            raise PayloadTooLarge(topic.name, size, self._settings.max_payload_bytes)
        return self._keys.stream(topic.name, shard_of(envelope.resource_id, topic.shards)), fields

    async def publish(
        self,
        topic: TopicConfig,
        event: BaseModel,
        resource_id: str,
        headers: dict[str, str] | None = None,
    ) -> str:
        """Append one event; returns its entry ID (``<ms>-<seq>``) once Redis has accepted it.

        Raises `ShardCountMismatch`, `PayloadTooLarge`, `ConfigError`, or `PublishError` when
        Redis did not confirm the XADD (the event may then still have been stored).
        """
        await self._registry.ensure(topic)
        stream, fields = self.prepare(topic, event, resource_id, headers)
        item = _Pending(stream, fields, topic.maxlen, asyncio.get_running_loop().create_future())
        if self._queue is None:
            await self._send([item])
        else:
            self._queue.send_nowait(item)
        return await item.future

    async def publish_envelope(self, topic: TopicConfig, envelope: Envelope) -> str:
        """Append a ready envelope (no model needed); returns its entry ID."""
        await self._registry.ensure(topic)
        stream, fields = self.prepare_envelope(topic, envelope)
        item = _Pending(stream, fields, topic.maxlen, asyncio.get_running_loop().create_future())
        await self._send([item])
        return await item.future

    async def publish_many(
        self,
        topic: TopicConfig,
        events: Iterable[tuple[str, BaseModel]],
        headers: dict[str, str] | None = None,
    ) -> list[str]:
        """Append `(resource_id, event)` pairs in order, in pipelines of `publish_batch_max`.

        Returns the entry IDs in input order. Every event is encoded (and size-checked) before the
        first is sent, so a bad event fails the call with nothing published.
        """
        await self._registry.ensure(topic)
        loop = asyncio.get_running_loop()
        items = [
            _Pending(*self.prepare(topic, ev, rid, headers), topic.maxlen, loop.create_future())
            for rid, ev in events
        ]
        step = self._settings.publish_batch_max
        for i in range(0, len(items), step):
            await self._send(items[i : i + step])
        return [item.future.result() for item in items]

    async def _send(self, batch: list[_Pending]) -> None:
        """One pipeline of XADDs; settles every future in `batch`, never raises."""
        pipe = self._redis.pipeline(transaction=False)
        for item in batch:
            pipe.xadd(item.stream, item.fields, maxlen=item.maxlen, approximate=True)
        try:
            with anyio.CancelScope(shield=True):  # a cancelled caller must not strand the others
                results = await pipe.execute(raise_on_error=False)
        except (RedisError, OSError) as exc:
            err = PublishError(f"pipeline of {len(batch)} XADD failed: {exc}")
            for item in batch:
                if not item.future.done():
                    item.future.set_exception(err)
            return
        for item, result in zip(batch, results, strict=True):
            if item.future.done():
                continue
            if isinstance(result, Exception):
                item.future.set_exception(PublishError(f"XADD {item.stream} failed: {result}"))
            else:
                item.future.set_result(result.decode() if isinstance(result, bytes) else result)

    async def run_flusher(self, *, task_status: anyio.abc.TaskStatus[None]) -> None:
        """Coalesce queued publishes into pipelines until cancelled (run by the bus)."""
        send: MemoryObjectSendStream[_Pending]
        receive: MemoryObjectReceiveStream[_Pending]
        send, receive = anyio.create_memory_object_stream(math.inf)
        self._queue = send
        task_status.started()
        try:
            async for first in receive:
                batch = [first]
                while len(batch) < self._settings.publish_batch_max:
                    try:
                        batch.append(receive.receive_nowait())
                    except anyio.WouldBlock:
                        break
                await self._send(batch)
        finally:
            self._queue = None
            send.close()
            # Anything still queued is sent rather than dropped.
            leftover = []
            while True:
                try:
                    leftover.append(receive.receive_nowait())
                except (anyio.WouldBlock, anyio.EndOfStream):
                    break
            receive.close()
            if leftover:
                with anyio.CancelScope(shield=True):
                    await self._send(leftover)

"""Request/reply over streams: ``await bus.request(topic, event, resource_id=..., timeout_s=...)``.

The request is an ordinary event (same shard, order and failure policy as any other) carrying
two headers: `REPLY_TO`, the caller's reply stream (`Keys.reply`: one per bus and event loop),
and `CORRELATION_ID`. A subscriber answers by *returning* a pydantic model, which the handling
path writes to that stream (`eventbus.protocol.replies`: the headers, the reply, its expiry).

The caller reads its reply stream with ``XREAD BLOCK`` from where it last read; concurrent requests
of one bus share it: one of them reads at a time and hands every reply to the request it
answers (by correlation ID); replies nobody waits for any more (a timed-out request) are dropped.
Every group subscribed to the topic handles the request; the first reply wins.

Timeouts: after `timeout_s` the request raises `RequestTimeout`, which names the consumer groups
that read the topic's shard stream (none: nobody subscribes). The request event itself stays in
the stream, and a late reply is dropped. Replying is part of the handler's attempt: if the reply
cannot be written (Redis down) the attempt fails and is retried like any other.
"""

from __future__ import annotations

import asyncio
import uuid
import weakref
from collections.abc import Awaitable, Callable
from typing import Any, cast

import anyio
from pydantic import BaseModel
from typing_extensions import TypeVar

from eventbus.errors import DecodeError, RequestTimeout
from eventbus.protocol.codec import Envelope, decode_entry
from eventbus.protocol.keys import Keys
from eventbus.protocol.replies import (
    CORRELATION_ID,
    REPLY_MAXLEN,
    REPLY_TO,
    REPLY_TTL_S,
    reply_stream,
    send_reply,
)
from eventbus.protocol.sharding import shard_of
from eventbus.protocol.topics import TopicConfig

# without a reply_model the reply is its JSON-mode fields (a dict): M is left unsolved, so Any
M = TypeVar("M", bound=BaseModel, default=Any)
Publish = Callable[..., Awaitable[str]]
"""``EventBus.publish``: ``await publish(topic, event, resource_id=..., headers=...)``."""
_READ_COUNT = 100


class Requester:
    """The reply stream of one caller (a bus's session) and the requests waiting on it."""

    def __init__(self, redis: Any, keys: Keys) -> None:
        self.redis = redis
        self.keys = keys
        self.stream = keys.reply(uuid.uuid4().hex)
        self._cursor = "0-0"  # the stream is new and ours alone: every entry is for us
        self._waiting: dict[str, asyncio.Future[Envelope]] = {}
        self._reading = anyio.Lock()

    async def request(
        self,
        publish: Publish,
        topic: TopicConfig,
        event: BaseModel,
        resource_id: str,
        timeout_s: float,
        headers: dict[str, str] | None,
    ) -> Envelope:
        """Publish `event` with the reply headers and wait for its reply's envelope; raises
        `RequestTimeout` after `timeout_s` seconds."""
        cid = uuid.uuid4().hex
        future: asyncio.Future[Envelope] = asyncio.get_running_loop().create_future()
        self._waiting[cid] = future
        entry_id: str | None = None
        try:
            with anyio.move_on_after(timeout_s) as scope:
                entry_id = await publish(
                    topic.name,
                    event,
                    resource_id=resource_id,
                    headers={**(headers or {}), REPLY_TO: self.stream, CORRELATION_ID: cid},
                )
                while not future.done():
                    async with self._reading:  # one reader; the others wait for it
                        if not future.done():
                            await self._read()
        finally:
            del self._waiting[cid]
        if scope.cancelled_caught and not future.done():
            stream = self.keys.stream(topic.name, shard_of(resource_id, topic.shards))
            groups = await _groups(self.redis, stream)
            raise RequestTimeout(topic.name, resource_id, timeout_s, entry_id, groups)
        return future.result()

    async def _read(self) -> None:
        """Read the replies that arrive within a second and hand each to its request."""
        reply = await self.redis.xread({self.stream: self._cursor}, count=_READ_COUNT, block=1000)
        for _stream, entries in reply or ():
            for entry_id, fields in entries:
                self._cursor = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
                try:
                    env = decode_entry(fields)
                except DecodeError:
                    continue  # not a reply of ours (nothing else writes here)
                future = self._waiting.get(env.headers.get(CORRELATION_ID, ""))
                if future is not None and not future.done():
                    future.set_result(env)


_requesters: weakref.WeakKeyDictionary[Any, Requester] = weakref.WeakKeyDictionary()


def requester(redis: Any, keys: Keys) -> Requester:
    """The `Requester` of the Redis client `redis` (one per bus session: process, event loop)."""
    found = _requesters.get(redis)
    if found is None:
        found = _requesters[redis] = Requester(redis, keys)
    return found


def reply_of(env: Envelope, reply_model: type[M] | None) -> M:
    """The reply in `env`: validated as `reply_model`, or its JSON-mode fields (a dict)."""
    if reply_model is None:
        return cast("M", env.payload)  # M is Any here: no reply_model to solve it
    return reply_model.model_validate(env.payload)


async def _groups(redis: Any, stream: str) -> list[str]:
    """The consumer groups reading `stream`."""
    try:
        groups = await redis.xinfo_groups(stream)
    except Exception:  # no stream (nothing published), or Redis gone: say what we know
        return []
    names = [g["name"] for g in groups]
    return sorted(n.decode() if isinstance(n, bytes) else n for n in names)


__all__ = [
    "CORRELATION_ID",
    "REPLY_MAXLEN",
    "REPLY_TO",
    "REPLY_TTL_S",
    "Requester",
    "reply_of",
    "reply_stream",
    "requester",
    "send_reply",
]

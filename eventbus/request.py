"""Request/reply over streams: ``await bus.request(topic, event, resource_id=..., timeout_s=...)``.

The request is an ordinary event (same shard, order and failure policy as any other) carrying
two headers: `REPLY_TO`, the caller's reply stream (`Keys.reply`: one per bus and event loop,
``<prefix>:reply:<32 hex digits>``), and `CORRELATION_ID`. A subscriber answers by *returning* a
pydantic model: the handling path (`eventbus.consumer.handling`) calls `send_reply`, which appends
the encoded reply (an ordinary envelope, its `CORRELATION_ID` header copied) to the reply stream
with ``MAXLEN ~`` `REPLY_MAXLEN` and sets the stream to expire `REPLY_TTL_S` seconds later, so
that the streams of callers gone away vanish. A handler that returns None sends nothing.

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
import re
import uuid
import weakref
from typing import TYPE_CHECKING, Any, cast

import anyio
from pydantic import BaseModel
from typing_extensions import TypeVar

from eventbus.errors import DecodeError, InvalidReply, RequestTimeout
from eventbus.protocol.codec import Envelope, decode_entry, encode_entry, envelope_of
from eventbus.protocol.keys import Keys

if TYPE_CHECKING:
    from eventbus.app import EventBus

# without a reply_model the reply is its JSON-mode fields (a dict): M is left unsolved, so Any
M = TypeVar("M", bound=BaseModel, default=Any)

REPLY_TO = "eventbus-reply-to"
CORRELATION_ID = "eventbus-correlation-id"
REPLY_MAXLEN = 1000
"""Entries a reply stream keeps (approximately, ``MAXLEN ~``)."""
REPLY_TTL_S = 300
"""Seconds a reply stream lives after its last reply."""
_READ_COUNT = 100


class Requester:
    """The reply stream of one caller (a bus's session) and the requests waiting on it."""

    def __init__(self, redis: Any, keys: Keys) -> None:
        self.redis = redis
        self.stream = keys.reply(uuid.uuid4().hex)
        self._cursor = "0-0"  # the stream is new and ours alone: every entry is for us
        self._waiting: dict[str, asyncio.Future[Envelope]] = {}
        self._reading = anyio.Lock()

    async def request(
        self,
        bus: EventBus,
        topic: str,
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
                entry_id = await bus.publish(
                    topic,
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
            raise RequestTimeout(
                topic, resource_id, timeout_s, entry_id, await _groups(bus, topic, resource_id)
            )
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


def requester(bus: EventBus) -> Requester:
    """The `Requester` of `bus`'s current Redis client (one per session: process, event loop)."""
    redis = bus.redis
    found = _requesters.get(redis)
    if found is None:
        found = _requesters[redis] = Requester(redis, bus.keys)
    return found


async def request(
    bus: EventBus,
    topic: str,
    event: BaseModel,
    *,
    resource_id: str,
    timeout_s: float = 30.0,
    reply_model: type[M] | None = None,
    headers: dict[str, str] | None = None,
) -> M:
    """Publish `event` as a request and return the reply: the pydantic model a subscriber's
    handler returned, validated as `reply_model`, or its JSON-mode
    fields (a dict) without one. The bus must be entered (``async with bus:``).

    :param resource_id: the request's resource (its shard and order, as for `publish`)
    :param timeout_s: seconds to wait for the reply, publishing included
    :raises RequestTimeout: no reply within `timeout_s`; it names the groups that read the
        topic (none: nobody subscribes to it)
    :raises PublishError, PayloadTooLarge, ConfigError: as `publish`

    Bound as the method `EventBus.request` (``await bus.request(...)``).
    """
    env = await requester(bus).request(bus, topic, event, resource_id, timeout_s, headers)
    if reply_model is None:
        return cast("M", env.payload)  # M is Any here: no reply_model to solve it
    return reply_model.model_validate(env.payload)


async def _groups(bus: EventBus, topic: str, resource_id: str) -> list[str]:
    """The consumer groups reading the shard stream of `resource_id` on `topic`."""
    from eventbus.protocol.sharding import shard_of

    stream = bus.keys.stream(topic, shard_of(resource_id, bus.topic(topic).shards))
    try:
        groups = await bus.redis.xinfo_groups(stream)
    except Exception:  # no stream (nothing published), or Redis gone: say what we know
        return []
    names = [g["name"] for g in groups]
    return sorted(n.decode() if isinstance(n, bytes) else n for n in names)


def reply_stream(keys: Keys, headers: dict[str, str]) -> str | None:
    """The reply stream a request's `headers` name, or None for an event that is no request.
    Raises `InvalidReply` for a name that is not a reply stream of `keys` (a publisher must not
    make consumers write to other keys)."""
    target = headers.get(REPLY_TO)
    if target is None:
        return None
    prefix = keys.reply("")
    if not target.startswith(prefix) or not re.fullmatch(r"[0-9a-f]{32}", target[len(prefix) :]):
        raise InvalidReply(f"reply stream {target!r} is not an eventbus reply stream ({prefix}…)")
    return target


async def send_reply(redis: Any, keys: Keys, request: Envelope, result: object) -> None:
    """Append `result`, a handler's return value, to the reply stream of `request` (if it is a
    request). Raises `InvalidReply` for a result that is not a pydantic model or a bad reply
    stream, and Redis errors."""
    stream = reply_stream(keys, request.headers)
    if stream is None:
        return
    if not isinstance(result, BaseModel):
        raise InvalidReply(
            f"a handler answering a request returned {type(result).__name__}, not a pydantic "
            "model (return None to send no reply)"
        )
    cid = request.headers.get(CORRELATION_ID, "")
    fields = encode_entry(envelope_of(request.resource_id, result, {CORRELATION_ID: cid}))
    pipe = redis.pipeline(transaction=False)
    pipe.xadd(stream, fields, maxlen=REPLY_MAXLEN, approximate=True)
    pipe.expire(stream, REPLY_TTL_S)
    await pipe.execute()

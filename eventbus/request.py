"""Request/reply over streams: ``await bus.request(topic, event, resource_id=..., timeout_s=...)``.

The request is an ordinary event (same shard, order and failure policy as any other) carrying
three headers: `REPLY_TO`, the caller's reply stream (`Keys.reply`: one per bus and event loop),
`CORRELATION_ID`, and `REPLY_KEY`, a secret made for this request alone. A subscriber answers by
*returning* a pydantic model, which the handling path writes to that stream with an HMAC keyed by
the secret (`eventbus.protocol.replies`: the headers, the reply, its MAC, its expiry).

The caller reads its reply stream with ``XREAD BLOCK`` from where it last read; concurrent requests
of one bus share it: one of them reads at a time and hands every reply to the request it
answers (by correlation ID) once its MAC verifies with that request's secret. A reply that does
not verify (forged by someone who can write the reply stream but never saw the request, or
altered) is logged at WARNING and ignored: the request goes on waiting for the real reply or
times out. Replies nobody waits for any more (a timed-out request) are dropped.
Every group subscribed to the topic handles the request; the first authentic reply wins.

Timeouts: after `timeout_s` the request raises `RequestTimeout`, which names the consumer groups
that read the topic's shard stream (none: nobody subscribes), or says why they could not be listed
(the server's reason, e.g. NOPERM). The request event itself stays in the stream, and a late reply
is dropped. Replying is part of the handler's attempt: if the reply cannot be written (Redis
down) the attempt fails and is retried like any other.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
import weakref
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, NotRequired, cast

import anyio
from pydantic import BaseModel
from redis.exceptions import NoPermissionError, ResponseError
from typing_extensions import TypeVar

from eventbus.errors import DecodeError, RequestTimeout, cut
from eventbus.protocol.codec import Envelope, decode_entry
from eventbus.protocol.keys import Keys
from eventbus.protocol.replies import (
    CORRELATION_ID,
    REPLY_KEY,
    REPLY_MAXLEN,
    REPLY_TO,
    REPLY_TTL_S,
    new_reply_key,
    reply_stream,
    send_reply,
    verify_reply,
)
from eventbus.protocol.sharding import shard_of
from eventbus.protocol.topics import TopicConfig
from eventbus.publishing.publisher import PublishOptions

log = logging.getLogger("eventbus")

# without a reply_model the reply is its JSON-mode fields (a dict): M is left unsolved, so Any
M = TypeVar("M", bound=BaseModel, default=Any)
Publish = Callable[..., Awaitable[str]]
"""``EventBus.publish``: ``await publish(topic, event, resource_id=..., headers=...)``."""


class RequestOptions(PublishOptions):
    """The keyword arguments of ``EventBus.request`` but `reply_model` (which fixes the return
    type), for ``SyncBus.request`` to pass on; a unit test checks that they agree.

    :param timeout_s: seconds to wait for the reply, publishing included (default 30)
    """

    timeout_s: NotRequired[float]


_READ_COUNT = 100


@dataclass(slots=True)
class _Waiting:
    """A request waiting for its reply: the secret its reply's MAC is keyed by, and the future
    that gets the reply's envelope."""

    key: bytes
    future: asyncio.Future[Envelope]


class Requester:
    """The reply stream of one caller (a bus's session) and the requests waiting on it."""

    def __init__(self, redis: Any, keys: Keys) -> None:
        self.redis = redis
        self.keys = keys
        self.stream = keys.reply(uuid.uuid4().hex)
        self._cursor = "0-0"  # the stream is new and ours alone: every entry is for us
        self._waiting: dict[str, _Waiting] = {}
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
        """Publish `event` with the reply headers and wait for its authentic reply's envelope;
        raises `RequestTimeout` after `timeout_s` seconds."""
        cid = uuid.uuid4().hex
        key = new_reply_key()
        future: asyncio.Future[Envelope] = asyncio.get_running_loop().create_future()
        self._waiting[cid] = _Waiting(key, future)
        entry_id: str | None = None
        ours = {REPLY_TO: self.stream, CORRELATION_ID: cid, REPLY_KEY: key.hex()}
        try:
            with anyio.move_on_after(timeout_s) as scope:
                entry_id = await publish(
                    topic.name, event, resource_id=resource_id, headers={**(headers or {}), **ours}
                )
                while not future.done():
                    async with self._reading:  # one reader; the others wait for it
                        if not future.done():
                            await self._read()
        finally:
            del self._waiting[cid]
        if scope.cancelled_caught and not future.done():
            stream = self.keys.stream(topic.name, shard_of(resource_id, topic.shards))
            groups, unknown = await _groups(self.redis, stream)
            raise RequestTimeout(topic.name, resource_id, timeout_s, entry_id, groups, unknown)
        return future.result()

    async def _read(self) -> None:
        """Read the replies that arrive within a second and hand each authentic one to its
        request (`_accept`)."""
        reply = await self.redis.xread({self.stream: self._cursor}, count=_READ_COUNT, block=1000)
        for _stream, entries in reply or ():
            for entry_id, fields in entries:
                self._cursor = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
                self._accept(self._cursor, fields)

    def _accept(self, entry_id: str, fields: dict[bytes, bytes]) -> None:
        """Hand reply entry `entry_id` to the request it answers if its MAC verifies with that
        request's secret; log at WARNING and drop it if it does not (or is undecodable)."""
        try:
            env = decode_entry(fields)
        except DecodeError as exc:  # nothing of eventbus writes such an entry here
            log.warning("reply stream %s: entry %s ignored: %s", self.stream, entry_id, exc)
            return
        cid = env.headers.get(CORRELATION_ID, "")
        waiting = self._waiting.get(cid)
        if waiting is None or waiting.future.done():
            return  # a late reply (its request timed out) or a second one: nobody waits for it
        why = verify_reply(waiting.key, cid, fields)
        if why is not None:
            log.warning(
                "reply stream %s: entry %s claims to answer request %s but %s: not a reply of "
                "a handler of the request (forged or altered), ignored",
                self.stream,
                entry_id,
                cid,
                why,
            )
            return
        waiting.future.set_result(env)


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


async def _groups(redis: Any, stream: str) -> tuple[list[str], str | None]:
    """The consumer groups reading `stream` (none when it does not exist: nothing published),
    and None; or no groups and why they could not be listed: the server's reason for refusing
    ``XINFO GROUPS`` (NOPERM under an ACL) or the error that prevented it (Redis gone)."""
    try:
        groups = await redis.xinfo_groups(stream)
    except NoPermissionError as exc:  # redis-py takes the error code off the server's message
        return [], f"Redis refused XINFO GROUPS on {stream!r}: NOPERM {cut(str(exc))}"
    except ResponseError as exc:
        if "no such key" in str(exc).lower():
            return [], None
        return [], f"Redis refused XINFO GROUPS on {stream!r}: {cut(str(exc))}"
    except Exception as exc:  # Redis gone: say that instead of guessing
        return [], f"XINFO GROUPS on {stream!r} failed: {type(exc).__name__}: {cut(str(exc))}"
    names = [g["name"] for g in groups]
    return sorted(n.decode() if isinstance(n, bytes) else n for n in names), None


__all__ = [
    "CORRELATION_ID",
    "REPLY_KEY",
    "REPLY_MAXLEN",
    "REPLY_TO",
    "REPLY_TTL_S",
    "RequestOptions",
    "Requester",
    "reply_of",
    "reply_stream",
    "requester",
    "send_reply",
]

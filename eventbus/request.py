"""Request/reply over streams: ``await bus.request(topic, event, resource_id=..., timeout_s=...)``.

The request is an ordinary event (same shard, order and failure policy as any other) carrying
two headers: `REPLY_TO`, the caller's reply stream for the topic (`Keys.reply`: one per bus,
event loop and topic) and `CORRELATION_ID`. A subscriber answers by *returning* a pydantic model,
which the handling path writes to that stream naming the request's shard and entry ID
(`eventbus.protocol.replies`). Only the roles answering the topic may write its reply streams
(docs/security.md, "Responder"): a consumer of another topic is refused.

The caller reads its reply stream with ``XREAD BLOCK`` from where it last read; concurrent requests
of one bus on one topic share it: one of them reads at a time and hands every reply to the request
it answers (by correlation ID) once it names that request's entry (`answers`). A reply that names
another entry (an answer to a request that copied this one's reply headers) or none is logged at
WARNING and ignored: the request goes on waiting for the real reply or times out. A reply read
before its request's publish returned waits for the entry ID to be checked. Replies nobody waits
for any more (a timed-out request) are dropped. Every group subscribed to the topic handles the
request; the first reply that answers it wins.

Timeouts: after `timeout_s` the request raises `RequestTimeout`, which names the consumer groups
that read the topic's shard stream (none: nobody subscribes), or says why they could not be listed
(the server's reason, e.g. NOPERM). The request event itself stays in the stream, and a late reply
is dropped. Replying is part of the handler's attempt: if the reply cannot be written (Redis
down, or NOPERM for a role that may not answer the topic) the attempt fails and is retried like
any other.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
import weakref
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
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
    REPLY_MAXLEN,
    REPLY_TO,
    REPLY_TTL_S,
    answers,
    reply_stream,
    send_reply,
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
EARLY_MAX = 1000
"""Replies kept per request while its publish is on its way (its entry ID, which a reply must
answer, is not known yet): past that, a flood of entries claiming its correlation ID (only a
writer of the reply stream can add them) is dropped with a warning instead of held in memory."""


@dataclass(slots=True)
class _Waiting:
    """A request waiting for its reply: its shard, its entry ID once its publish returned (until
    then the replies read for it wait in `early`), and the future that gets the reply's
    envelope."""

    shard: int
    future: asyncio.Future[Envelope]
    entry_id: str | None = None
    early: list[tuple[str, Envelope]] = field(default_factory=list)


class Requester:
    """The reply stream of one caller (a bus's session) on one topic and the requests waiting
    on it."""

    def __init__(self, redis: Any, keys: Keys, topic: str) -> None:
        self.redis = redis
        self.keys = keys
        self.stream = keys.reply(topic, uuid.uuid4().hex)
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
        """Publish `event` with the reply headers and wait for the reply that answers its entry;
        returns the reply's envelope; raises `RequestTimeout` after `timeout_s` seconds."""
        cid = uuid.uuid4().hex
        shard = shard_of(resource_id, topic.shards)
        future: asyncio.Future[Envelope] = asyncio.get_running_loop().create_future()
        waiting = self._waiting[cid] = _Waiting(shard, future)
        entry_id: str | None = None
        ours = {REPLY_TO: self.stream, CORRELATION_ID: cid}
        try:
            with anyio.move_on_after(timeout_s) as scope:
                entry_id = await publish(
                    topic.name, event, resource_id=resource_id, headers={**(headers or {}), **ours}
                )
                waiting.entry_id = entry_id
                for reply_id, env in waiting.early:  # read while the publish was on its way
                    self._check(reply_id, cid, waiting, env)
                while not future.done():
                    async with self._reading:  # one reader; the others wait for it
                        if not future.done():
                            await self._read()
        finally:
            del self._waiting[cid]
        if scope.cancelled_caught and not future.done():
            stream = self.keys.stream(topic.name, shard)
            groups, unknown = await _groups(self.redis, stream)
            raise RequestTimeout(topic.name, resource_id, timeout_s, entry_id, groups, unknown)
        return future.result()

    async def _read(self) -> None:
        """Read the replies that arrive within a second and hand each to its request
        (`_accept`)."""
        reply = await self.redis.xread({self.stream: self._cursor}, count=_READ_COUNT, block=1000)
        for _stream, entries in reply or ():
            for entry_id, fields in entries:
                self._cursor = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
                self._accept(self._cursor, fields)

    def _accept(self, reply_id: str, fields: dict[bytes, bytes]) -> None:
        """Hand reply entry `reply_id` to the request it answers (`_check`), or keep it until
        that request's entry ID is known; drop it when nobody waits for it, log at WARNING and
        drop it when it is undecodable."""
        try:
            env = decode_entry(fields)
        except DecodeError as exc:  # nothing of eventbus writes such an entry here
            log.warning("reply stream %s: entry %s ignored: %s", self.stream, reply_id, exc)
            return
        cid = env.headers.get(CORRELATION_ID, "")
        waiting = self._waiting.get(cid)
        if waiting is None or waiting.future.done():
            return  # a late reply (its request timed out) or a second one: nobody waits for it
        if waiting.entry_id is None:
            if len(waiting.early) >= EARLY_MAX:
                log.warning(
                    "reply stream %s: entry %s dropped: %d replies to request %s already wait "
                    "for its publish to return",
                    self.stream,
                    reply_id,
                    EARLY_MAX,
                    cid,
                )
                return
            waiting.early.append((reply_id, env))
        else:
            self._check(reply_id, cid, waiting, env)

    def _check(self, reply_id: str, cid: str, waiting: _Waiting, env: Envelope) -> None:
        """Resolve `waiting` with reply `env` if it answers the request's own entry; log at
        WARNING and drop it if not."""
        if waiting.future.done():
            return
        why = answers(env, waiting.shard, cast(str, waiting.entry_id))
        if why is not None:
            log.warning(
                "reply stream %s: entry %s claims to answer request %s but %s: not a reply to "
                "this request (one that copied its reply headers, or forged), ignored",
                self.stream,
                reply_id,
                cid,
                why,
            )
            return
        waiting.future.set_result(env)


_requesters: weakref.WeakKeyDictionary[Any, dict[str, Requester]] = weakref.WeakKeyDictionary()


def requester(redis: Any, keys: Keys, topic: str) -> Requester:
    """The `Requester` of the Redis client `redis` (one per bus session: process, event loop)
    on `topic`."""
    per_topic = _requesters.setdefault(redis, {})
    found = per_topic.get(topic)
    if found is None:
        found = per_topic[topic] = Requester(redis, keys, topic)
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

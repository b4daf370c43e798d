"""Replies to requests (`eventbus.request`): the headers a request carries and the reply written
to the stream it names; who may write that stream is Redis's ACL, per topic.

A request is an ordinary event with two headers: `REPLY_TO`, the caller's reply stream for that
topic (`Keys.reply`: ``<prefix>:reply:<topic>:<32 hex digits>``), and `CORRELATION_ID`. A
subscriber answers by *returning* a pydantic model: the handling path calls `send_reply`, which
appends the encoded reply (an ordinary envelope, its `CORRELATION_ID` header copied and
`REQUEST_ENTRY` naming the request's shard and entry ID) to the reply stream, only if that
stream belongs to the request's topic. The caller accepts a reply only if it names its own
request's entry (`answers`): a request that copied another caller's reply headers gets answers
that caller ignores. Who can write a topic's reply streams is the ACL's to say
(docs/security.md, "Responder": only the roles answering the topic); there is no secret in the
request, which every reader of shard streams could read. The stream is capped (``MAXLEN ~``
`REPLY_MAXLEN`) and set to expire `REPLY_TTL_S` seconds after the reply, so that the streams of
callers gone away vanish. A handler that returns None sends nothing.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel

from eventbus.client.pipelines import execute
from eventbus.errors import InvalidReply
from eventbus.protocol.codec import Envelope, encode_entry, envelope_of
from eventbus.protocol.keys import Keys

REPLY_TO = "eventbus-reply-to"
CORRELATION_ID = "eventbus-correlation-id"
REQUEST_ENTRY = "eventbus-request-entry"
"""Header of a reply: the request it answers, ``<shard>/<entry ID>`` (``3/1700000000000-0``)."""
REPLY_KEY = "eventbus-reply-key"
"""Header of requests of eventbus versions before per-topic reply streams (a per-request MAC
secret); no longer sent, and shown as ``***`` by the CLI (`redacted`)."""
SECRET_HEADERS = frozenset({REPLY_KEY})
"""Headers whose values tools never print (`redacted`)."""
REPLY_MAXLEN = 1000
"""Entries a reply stream keeps (approximately, ``MAXLEN ~``)."""
REPLY_TTL_S = 300
"""Seconds a reply stream lives after its last reply."""


def _topic_of(keys: Keys, stream: str) -> str | None:
    """The topic of reply stream `stream` of `keys`, or None for a name of another form."""
    prefix = keys.reply("", "")[:-1]  # "<prefix>:reply:"
    found = re.fullmatch(r"([A-Za-z0-9_.\-]{1,100}):[0-9a-f]{32}", stream.removeprefix(prefix))
    if not stream.startswith(prefix) or found is None or found[1] in (".", ".."):
        return None
    return found[1]


def reply_stream(keys: Keys, headers: Mapping[str, str]) -> str | None:
    """The reply stream a request's `headers` name, or None for an event that is no request.
    Raises `InvalidReply` for a name that is not a reply stream of `keys`
    (``<prefix>:reply:<topic>:<32 lowercase hex digits>``: a publisher must not make consumers
    write to other keys; an eventbus from before per-topic reply streams named
    ``<prefix>:reply:<32 hex digits>``)."""
    target = headers.get(REPLY_TO)
    if target is None:
        return None
    if not isinstance(target, str) or _topic_of(keys, target) is None:
        raise InvalidReply(
            f"reply stream {target!r} is not an eventbus reply stream "
            f"({keys.reply('<topic>', '<32 hex digits>')})"
        )
    return target


def request_entry(shard: int, entry_id: str) -> str:
    """The `REQUEST_ENTRY` value naming entry `entry_id` of shard `shard`."""
    return f"{shard}/{entry_id}"


def answers(reply: Envelope, shard: int, entry_id: str) -> str | None:
    """Why `reply` is not an answer to the request entry `entry_id` of shard `shard` (another
    request's, or none named), or None when it is."""
    named = reply.headers.get(REQUEST_ENTRY)
    if named is None:
        return f"it names no request entry ({REQUEST_ENTRY})"
    if named != request_entry(shard, entry_id):
        return f"it answers request entry {named!r}, not {request_entry(shard, entry_id)!r}"
    return None


def redacted(headers: Mapping[str, str]) -> dict[str, str]:
    """`headers` with the values of `SECRET_HEADERS` replaced by ``***``, for display."""
    return {k: "***" if k in SECRET_HEADERS else v for k, v in headers.items()}


async def send_reply(
    redis: Any, keys: Keys, topic: str, shard: int, entry_id: str, request: Envelope, result: object
) -> None:
    """Append `result`, a handler's return value, to the reply stream of `request` (entry
    `entry_id` of shard `shard` of `topic`), if it is a request. Raises `InvalidReply` for a
    result that is not a pydantic model or a reply stream that is not one of `topic`'s (a
    responder answers only into the reply streams of the topics it serves), and Redis errors
    (NOPERM for a role without the responder rule of `topic`)."""
    stream = reply_stream(keys, request.headers)
    if stream is None:
        return
    if _topic_of(keys, stream) != topic:
        raise InvalidReply(
            f"request entry {entry_id} of topic {topic!r} names reply stream {stream!r}, which "
            f"is not one of {topic!r}'s ({keys.reply(topic, '<32 hex digits>')})"
        )
    if not isinstance(result, BaseModel):
        raise InvalidReply(
            f"a handler answering a request returned {type(result).__name__}, not a pydantic "
            "model (return None to send no reply)"
        )
    headers = {
        CORRELATION_ID: request.headers.get(CORRELATION_ID, ""),
        REQUEST_ENTRY: request_entry(shard, entry_id),
    }
    fields = encode_entry(envelope_of(request.resource_id, result, headers))
    pipe = redis.pipeline(transaction=False)
    pipe.xadd(stream, fields, maxlen=REPLY_MAXLEN, approximate=True)
    pipe.expire(stream, REPLY_TTL_S)
    await execute(pipe)  # an error reply raised with the server's reason (NOPERM, OOM)

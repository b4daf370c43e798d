"""Replies to requests (`eventbus.request`): the two headers a request carries and the reply
written to the stream it names.

A request is an ordinary event with two headers: `REPLY_TO`, the caller's reply stream
(`Keys.reply`: ``<prefix>:reply:<32 hex digits>``), and `CORRELATION_ID`. A subscriber answers by
*returning* a pydantic model: the handling path calls `send_reply`, which appends the encoded
reply (an ordinary envelope, its `CORRELATION_ID` header copied) to the reply stream with
``MAXLEN ~`` `REPLY_MAXLEN` and sets the stream to expire `REPLY_TTL_S` seconds later, so that the
streams of callers gone away vanish. A handler that returns None sends nothing.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel

from eventbus.client.pipelines import execute
from eventbus.errors import InvalidReply
from eventbus.protocol.codec import Envelope, encode_entry, envelope_of
from eventbus.protocol.keys import Keys

REPLY_TO = "eventbus-reply-to"
CORRELATION_ID = "eventbus-correlation-id"
REPLY_MAXLEN = 1000
"""Entries a reply stream keeps (approximately, ``MAXLEN ~``)."""
REPLY_TTL_S = 300
"""Seconds a reply stream lives after its last reply."""


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
    await execute(pipe)  # an error reply raised with the server's reason (NOPERM, OOM)

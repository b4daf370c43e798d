"""Replies to requests (`eventbus.request`): the headers a request carries and the reply written
to the stream it names, authenticated so that only a handler of the request can answer it.

A request is an ordinary event with three headers: `REPLY_TO`, the caller's reply stream
(`Keys.reply`: ``<prefix>:reply:<32 hex digits>``), `CORRELATION_ID`, and `REPLY_KEY`, a secret
made for this request alone (32 random bytes as 64 lowercase hex digits). A subscriber answers by
*returning* a pydantic model: the handling path calls `send_reply`, which appends the encoded
reply (an ordinary envelope, its `CORRELATION_ID` header copied, the key never) to the reply
stream with one more entry field, `F_MAC`: `reply_mac`, an HMAC-SHA256 keyed by the request's
secret over the correlation ID and the reply entry's fields. The caller accepts a reply only if
that MAC verifies (`verify_reply`): whoever can append to its reply stream but never read the
request cannot forge or alter a reply (docs/semantics.md, "Who can answer a request", gives
the threat model). The stream is capped (``MAXLEN ~`` `REPLY_MAXLEN`) and set to expire
`REPLY_TTL_S` seconds after the reply, so that the streams of callers gone away vanish. A
handler that returns None sends nothing.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel

from eventbus.client.pipelines import execute
from eventbus.errors import InvalidReply
from eventbus.protocol.codec import F_DATA, F_RESOURCE, F_TYPE, Envelope, encode_entry, envelope_of
from eventbus.protocol.keys import Keys

REPLY_TO = "eventbus-reply-to"
CORRELATION_ID = "eventbus-correlation-id"
REPLY_KEY = "eventbus-reply-key"
"""Header of a request: the secret keying its reply's MAC, 64 lowercase hex digits (32 bytes)."""
F_MAC = b"mac"
"""Entry field of a reply: `reply_mac` as 64 lowercase hex digits (ASCII)."""
KEY_BYTES = 32
MAC_CONTEXT = b"eventbus-reply-v1"
"""The first bytes of every MAC'd message: a MAC of this scheme is never valid for another."""
REPLY_MAXLEN = 1000
"""Entries a reply stream keeps (approximately, ``MAXLEN ~``)."""
REPLY_TTL_S = 300
"""Seconds a reply stream lives after its last reply."""

_HEX_KEY = re.compile(rf"[0-9a-f]{{{2 * KEY_BYTES}}}")


def reply_stream(keys: Keys, headers: dict[str, str]) -> str | None:
    """The reply stream a request's `headers` name, or None for an event that is no request.
    Raises `InvalidReply` for a name that is not a reply stream of `keys` (a publisher must not
    make consumers write to other keys) or a `REPLY_KEY` header that is not 64 lowercase hex
    digits."""
    target = headers.get(REPLY_TO)
    if target is None:
        return None
    prefix = keys.reply("")
    if not target.startswith(prefix) or not re.fullmatch(r"[0-9a-f]{32}", target[len(prefix) :]):
        raise InvalidReply(f"reply stream {target!r} is not an eventbus reply stream ({prefix}…)")
    reply_key(headers)
    return target


def new_reply_key() -> bytes:
    """A fresh request secret: `KEY_BYTES` bytes from `secrets.token_bytes` (send it hex-encoded
    as the `REPLY_KEY` header)."""
    return secrets.token_bytes(KEY_BYTES)


def reply_key(headers: dict[str, str]) -> bytes | None:
    """The secret a request's `headers` carry (`REPLY_KEY`), or None for a request without one
    (sent by an eventbus before replies were authenticated). Raises `InvalidReply` for a value
    that is not 64 lowercase hex digits."""
    text = headers.get(REPLY_KEY)
    if text is None:
        return None
    if not _HEX_KEY.fullmatch(text):
        raise InvalidReply(
            f"request header {REPLY_KEY} is not {2 * KEY_BYTES} lowercase hex digits "
            f"({len(text)} characters)"
        )
    return bytes.fromhex(text)


def reply_mac(key: bytes, correlation_id: str, fields: Mapping[bytes, bytes]) -> bytes:
    """The MAC of reply entry `fields` (``rid``, ``type``, ``data``; others are ignored) to the
    request `correlation_id`: HMAC-SHA256 keyed by `key` over `MAC_CONTEXT` then, each preceded
    by its length as 4 bytes big endian, the correlation ID (UTF-8) and the three fields' values
    in that order. 32 bytes. Raises `KeyError` for a missing field."""
    mac = hmac.new(key, MAC_CONTEXT, hashlib.sha256)
    for part in (correlation_id.encode(), fields[F_RESOURCE], fields[F_TYPE], fields[F_DATA]):
        mac.update(len(part).to_bytes(4, "big"))
        mac.update(part)
    return mac.digest()


def verify_reply(key: bytes, correlation_id: str, fields: Mapping[bytes, bytes]) -> str | None:
    """Why reply entry `fields` is not an authentic answer to the request `correlation_id` keyed
    by `key` (no ``mac`` field, or one that does not match the entry), or None when it is. The
    comparison takes the same time wherever the MACs differ (`hmac.compare_digest`)."""
    given = fields.get(F_MAC)
    if given is None:
        return "it has no mac field"
    try:
        expected = reply_mac(key, correlation_id, fields)
    except KeyError as exc:
        return f"it lacks field {exc.args[0]!r}"
    if not hmac.compare_digest(given, expected.hex().encode()):
        return "its mac does not match its content"
    return None


async def send_reply(redis: Any, keys: Keys, request: Envelope, result: object) -> None:
    """Append `result`, a handler's return value, to the reply stream of `request` (if it is a
    request), with its MAC when the request carries a `REPLY_KEY`. Raises `InvalidReply` for a
    result that is not a pydantic model, a bad reply stream or key, and Redis errors."""
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
    key = reply_key(request.headers)
    if key is not None:
        fields[F_MAC] = reply_mac(key, cid, fields).hex().encode()
    pipe = redis.pipeline(transaction=False)
    pipe.xadd(stream, fields, maxlen=REPLY_MAXLEN, approximate=True)
    pipe.expire(stream, REPLY_TTL_S)
    await execute(pipe)  # an error reply raised with the server's reason (NOPERM, OOM)

"""Verse's stream entry: one field ``msg`` = zlib(MessagePack map ``{i, c, h, r}``).

What Verse writes (verse-redis ``Stream::Message#pack``; ``publish_resource_event`` puts the
event type first in the headers, ``{ event: }.merge(headers)``):

* ``i`` - the message ID, a base-36 string (Verse draws a random integer below 2**49);
* ``c`` - the content: any MessagePack value (a map for a resource event's payload);
* ``h`` - the headers, a map; ``event`` holds the event type;
* ``r`` - the reply-to channel, or nil.

The map is packed in that key order and compressed by zlib at its default level (RFC 1950, as
Ruby's ``Zlib::Deflate.deflate``), so the bytes eventbus writes equal Verse's for the same values
(tests/fixtures/verse holds entries packed by Verse's own code).

Mapping to eventbus's `Envelope`: the event ID's 16 bytes are written as the base-36 digits of
their big-endian integer, and a Verse ID is read back as that integer (so its 16 bytes start with
zeros); the event type is the ``event`` header (the empty string when absent: a Verse
``publish(channel, ...)``, which only a catch-all ``dict``/``bytes`` handler takes); the resource
ID travels in the ``resource_id`` header (Verse hashes the resource ID but does not send it: an
entry from Verse has the empty resource ID); ``r`` is the header `REPLY_TO_HEADER`; a header
value that is not a string is read as its JSON text. Verse sends no event time: a decoded
envelope takes it from the entry ID (Redis's clock at XADD).
"""

from __future__ import annotations

import json
import re
import zlib
from typing import Any

import msgpack

from eventbus.config import DECOMPRESSION_FACTOR
from eventbus.errors import DecodeError
from eventbus.protocol.budget import MIN_CONTAINERS, unpack_body
from eventbus.protocol.codec import Envelope
from eventbus.protocol.framing import DEFAULT_MAX_BYTES

F_MSG = b"msg"
EVENT_HEADER = "event"
RESOURCE_HEADER = "resource_id"
REPLY_TO_HEADER = "verse-reply-to"
"""The header a decoded envelope carries Verse's ``r`` (reply-to channel) in, and from which an
encoded one takes it. eventbus does not answer it (Verse replies go over pub/sub)."""
RESERVED_HEADERS = frozenset({EVENT_HEADER, RESOURCE_HEADER})
_DIGITS = "0123456789abcdefghijklmnopqrstuvwxyz"
_BASE36 = re.compile(r"[0-9a-zA-Z]{1,25}")


def base36(n: int) -> str:
    """`n` (>= 0) in base 36, lowercase, as Ruby's ``Integer#to_s(36)``."""
    digits = []
    while True:
        n, d = divmod(n, 36)
        digits.append(_DIGITS[d])
        if not n:
            return "".join(reversed(digits))


def encode_verse(envelope: Envelope) -> dict[bytes, bytes]:
    """The field map of the Verse entry of `envelope` (module docstring). Raises `ValueError`
    when its headers use a name the envelope writes itself (`RESERVED_HEADERS`)."""
    headers = envelope.headers
    clash = RESERVED_HEADERS.intersection(headers)
    if clash:
        raise ValueError(f"header {sorted(clash)[0]!r} is written by the verse profile itself")
    reply_to = headers.get(REPLY_TO_HEADER)
    h = {EVENT_HEADER: envelope.event_type, RESOURCE_HEADER: envelope.resource_id}
    h.update((k, v) for k, v in headers.items() if k != REPLY_TO_HEADER)
    body = {
        "i": base36(int.from_bytes(envelope.event_id_bytes, "big")),
        "c": envelope.payload,
        "h": h,
        "r": reply_to,
    }
    return {F_MSG: zlib.compress(msgpack.packb(body, use_bin_type=True))}


def decode_verse(
    fields: dict[bytes, bytes], *, entry_id: str | None = None, max_bytes: int = DEFAULT_MAX_BYTES
) -> Envelope:
    """Decode a Verse entry's field map; `entry_id` (``<ms>-<seq>``) gives the event time.

    :param max_bytes: largest decompressed body accepted, in bytes (consumers pass
        `Settings.max_decompressed_bytes`); the body's containers are bounded as in
        `eventbus.protocol.codec.decode_entry`.
    :raises DecodeError: (never anything else) the ``msg`` field is missing, not a zlib stream,
        inflates to more than `max_bytes`, is not a map with a base-36 ``i`` and map ``h`` (or
        nil), ``r`` is neither a string nor nil, or a header value has no JSON text (nested
        too deep): whatever the bytes (tests/unit/test_decoders_fuzz.py).
    """
    try:
        data = fields[F_MSG]
    except KeyError:
        raise DecodeError("entry lacks field 'msg' (not a Verse entry)") from None
    try:
        return _decode(data, entry_id, max_bytes)
    except DecodeError:
        raise
    except Exception as exc:  # never anything else, whatever the bytes
        raise DecodeError(f"Verse entry does not decode: {type(exc).__name__}: {exc}") from None


def _decode(data: bytes, entry_id: str | None, max_bytes: int) -> Envelope:
    body = _inflate(data, max_bytes)
    budget = max(MIN_CONTAINERS, max_bytes // DECOMPRESSION_FACTOR)
    value = unpack_body(body, max_containers=budget)
    if not isinstance(value, dict):
        raise DecodeError(f"Verse message is a {type(value).__name__}, not a map")
    message_id, headers, reply_to = value.get("i"), value.get("h") or {}, value.get("r")
    if not isinstance(message_id, str) or not _BASE36.fullmatch(message_id):
        raise DecodeError(f"Verse message ID is not base-36 text: {message_id!r:.80}")
    number = int(message_id, 36)
    if number >= 1 << 128:
        raise DecodeError(f"Verse message ID {message_id!r} is over 128 bits")
    if not isinstance(headers, dict) or not all(isinstance(k, str) for k in headers):
        raise DecodeError(f"Verse headers are not a map of text keys: {headers!r:.200}")
    if reply_to is not None and not isinstance(reply_to, str):
        raise DecodeError(f"Verse reply-to is a {type(reply_to).__name__}, not text")
    text = {k: v if isinstance(v, str) else _json(k, v) for k, v in headers.items()}
    event_type = text.pop(EVENT_HEADER, "")
    resource_id = text.pop(RESOURCE_HEADER, "")
    if reply_to:
        text[REPLY_TO_HEADER] = reply_to
    published_at_ms = int(entry_id.partition("-")[0]) if entry_id else 0
    return Envelope(
        resource_id,
        event_type,
        number.to_bytes(16, "big"),
        published_at_ms,
        text,
        value.get("c"),
    )


def _inflate(data: bytes, max_bytes: int) -> bytes:
    """Undo zlib, refusing more than `max_bytes` of output (a small entry can inflate a lot)."""
    inflater = zlib.decompressobj()
    try:
        body = inflater.decompress(data, max_bytes + 1)
    except zlib.error as exc:
        raise DecodeError(f"Verse msg field is not a zlib stream: {exc}") from None
    if len(body) > max_bytes:
        raise DecodeError(f"Verse message inflates to more than {max_bytes} bytes")
    if not inflater.eof:
        raise DecodeError("Verse msg field is a truncated zlib stream")
    return body


def _json(name: str, value: Any) -> str:
    """Header `name`'s value as JSON text. Raises `DecodeError` for a value JSON cannot write:
    nested deeper than the encoder goes (``RecursionError`` near 1,000 levels, which a 1 KB
    entry can be)."""
    try:
        return json.dumps(value, separators=(",", ":"), default=_plain)
    except (RecursionError, ValueError, TypeError) as exc:
        raise DecodeError(
            f"Verse header {name!r:.80} cannot be read as JSON text: {type(exc).__name__}: {exc}"
        ) from None


def _plain(value: Any) -> Any:
    return value.hex() if isinstance(value, bytes) else repr(value)

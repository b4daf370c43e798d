"""Stream entries <-> events.

A stream entry has three fields (docs/protocol.md gives the bytes):

* ``rid``  - the resource ID, UTF-8 (plain, so tools can read it without decoding);
* ``type`` - the event type name, UTF-8 (plain);
* ``data`` - the envelope: one format byte, then the body.
  ``0x01``: body is a MessagePack map; ``0x02``: body is a zstd frame holding that map.
  Map keys: ``v`` envelope version (1), ``id`` event ID (16 bytes), ``ts`` event time (Unix ms),
  ``h`` headers (map str -> str), ``p`` payload (the event's JSON-mode fields as MessagePack).
  ``0x05`` (with a topic's zstd dictionary, `eventbus.protocol.dictionaries`): the dictionary ID
  (8 bytes, big endian: the fingerprint of the dictionary's bytes), the event ID (16 bytes), then
  a zstd frame without magic number (RFC 8878 section 3.1.1 less its first 4 bytes) of the map
  ``ts``, ``p`` and ``h`` (only when not empty), compressed with that dictionary. ``0x03`` and
  ``0x04`` (earlier dictionary formats of unreleased versions; no release wrote them) are
  refused.

Decoding is bounded twice, because a small entry can expand a lot: by bytes (the decompressed
body is at most `max_bytes`) and by structure (`eventbus.protocol.budget`).

`decode_entry` is synchronous and releases no lock: an event loop should run it in a worker
thread (``anyio.to_thread.run_sync``) for entries whose data field is over
`THREAD_DECODE_BYTES`, since a large compressed body can take tens of milliseconds to decode.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Final, Literal

import msgspec
from pydantic import BaseModel

from eventbus.config import DECOMPRESSION_FACTOR
from eventbus.errors import DecodeError
from eventbus.protocol.budget import MIN_CONTAINERS, unpack_body
from eventbus.protocol.compression import compressor as _compressor
from eventbus.protocol.dictionaries import FORMAT_DICT_COMPACT, ID_BYTES
from eventbus.protocol.event_ids import new_event_id as new_event_id  # (re-exported)
from eventbus.protocol.framing import (
    COMPACT_HEAD,
    DEFAULT_MAX_BYTES,
    EVENT_ID_BYTES,
    decompressed_body,
)
from eventbus.protocol.framing import FORMAT_MSGPACK as FORMAT_MSGPACK  # (re-exported)
from eventbus.protocol.framing import FORMAT_MSGPACK_ZSTD as FORMAT_MSGPACK_ZSTD  # (re-exported)

ENVELOPE_VERSION: Final = 1

RESERVED_TYPE_PREFIX = "__eventbus."
"""Event types starting with this belong to eventbus's control entries (`eventbus.dlq`): refused
at publish and at subscriber registration, never handed to handlers."""

F_RESOURCE = b"rid"
F_TYPE = b"type"
F_DATA = b"data"


THREAD_DECODE_BYTES = 64 * 1024
"""Callers on an event loop should decode entries whose ``data`` field is larger than this
(bytes) in a worker thread: below it, `decode_entry` takes well under a millisecond."""


def event_type_of(model: type[BaseModel]) -> str:
    """The type name written for events of `model`: its ``__event_type__`` or its class name.
    Remembered per class: pydantic's metaclass makes a missing class attribute slow to look up
    (a tenth of a publish's CPU time when asked per event)."""
    name = _TYPE_NAMES.get(model)
    if name is None:
        declared = getattr(model, "__event_type__", None)
        name = _TYPE_NAMES[model] = declared if isinstance(declared, str) else model.__name__
    return name


_TYPE_NAMES: dict[type[BaseModel], str] = {}


class Envelope(msgspec.Struct, gc=False):
    """A decoded entry. `event_id_bytes` is the event ID's 16 bytes (`event_id` the same as a
    UUID, as `Context.event_id` and `ArchivedEntry.event_id`); `published_at_ms` the publisher's
    wall clock when the event was made (Unix ms); `payload` the plain MessagePack value (a dict
    for pydantic events).

    A `msgspec.Struct`, not a dataclass: one is built per entry read, in a third of the time
    (`stress/perf.py core`). Untracked by the garbage collector (``gc=False``): it refers only
    to strings, bytes and plain MessagePack values, never back to itself."""

    resource_id: str
    event_type: str
    event_id_bytes: bytes
    published_at_ms: int
    headers: dict[str, str] = {}
    payload: Any = None

    @property
    def event_id(self) -> uuid.UUID:
        """The event ID (UUID v4, set by the publisher): the key for idempotent handling."""
        return uuid.UUID(bytes=self.event_id_bytes)


class _Body(msgspec.Struct, gc=False):
    """The envelope's MessagePack map as typed on the wire (module docstring): decoding checks
    every key's type in one pass (msgspec), e.g. a header value that is not a string."""

    v: Literal[1]
    id: Annotated[bytes, msgspec.Meta(min_length=16, max_length=16)]
    ts: int
    h: dict[str, str]
    p: Any


_BODY = msgspec.msgpack.Decoder(_Body)


class _DictBody(msgspec.Struct, gc=False, omit_defaults=True):
    """The map of format ``0x05``: `_Body` less what the format says outside the frame (the
    version is the format byte, the event ID precedes the frame), headers only when some
    (`omit_defaults`). Decoding accepts any key order and ignores unknown keys."""

    ts: int
    p: Any
    h: dict[str, str] = {}


_DICT_BODY = msgspec.msgpack.Decoder(_DictBody)


_ENCODER = msgspec.msgpack.Encoder()
"""The envelope's MessagePack encoder: for the map of `encode_entry` (str, bytes, int, str ->
str map, and a payload of JSON-mode values) it writes the same bytes as ``msgpack.packb(...,
use_bin_type=True)`` (tests/unit/test_codec.py checks it), in a fifth of the time."""


def encode_entry(
    envelope: Envelope, *, compress_threshold: int = 1024, dictionary: int | None = None
) -> dict[bytes, bytes]:
    """Encode `envelope` as the field map of one stream entry (see the module docstring).
    With `dictionary` (an ID in `eventbus.protocol.dictionaries.CACHE`), the body is compressed with
    that dictionary whatever its size (format ``0x05``); otherwise it is compressed (format
    ``0x02``) when its MessagePack map is at least `compress_threshold` bytes long.

    :raises ValueError: with `dictionary`, for an event ID that is not 16 bytes (format
        ``0x05`` has no room for another length; the other formats carry it in the map, and
        readers refuse it)
    :raises UnicodeEncodeError: for a resource ID or event type that is not valid Unicode text
    :raises UnknownDictionary: for a `dictionary` not in the cache"""
    if dictionary is not None:
        if len(envelope.event_id_bytes) != EVENT_ID_BYTES:
            raise ValueError(f"event ID is {len(envelope.event_id_bytes)} bytes, not 16")
        data = _DICT_PREFIX.get(dictionary) or _dict_prefix(dictionary)
        data += envelope.event_id_bytes
        data += _compressor(dictionary).compress(dictionary_body(envelope))
        return {
            F_RESOURCE: envelope.resource_id.encode(),
            F_TYPE: envelope.event_type.encode(),
            F_DATA: data,
        }
    # the wire map through its Struct (encoded as a map in field order, the bytes a dict gives)
    body = _ENCODER.encode(
        _Body(
            ENVELOPE_VERSION,
            envelope.event_id_bytes,
            envelope.published_at_ms,
            envelope.headers,
            envelope.payload,
        )
    )
    if len(body) >= compress_threshold:
        data = _ZSTD_PREFIX + _compressor(None).compress(body)
    else:
        data = _PLAIN_PREFIX + body
    return {
        F_RESOURCE: envelope.resource_id.encode(),
        F_TYPE: envelope.event_type.encode(),
        F_DATA: data,
    }


def dictionary_body(envelope: Envelope) -> bytes:
    """The MessagePack map that format ``0x05`` compresses with a dictionary for `envelope`
    (``ts``, ``p``, and ``h`` when not empty): what a topic's dictionary is trained on."""
    return _ENCODER.encode(_DictBody(envelope.published_at_ms, envelope.payload, envelope.headers))


_DICT_PREFIX: dict[int, bytes] = {}
_ZSTD_PREFIX = bytes([FORMAT_MSGPACK_ZSTD])
_PLAIN_PREFIX = bytes([FORMAT_MSGPACK])


def _dict_prefix(dict_id: int) -> bytes:
    prefix = bytes([FORMAT_DICT_COMPACT]) + dict_id.to_bytes(ID_BYTES, "big")
    _DICT_PREFIX[dict_id] = prefix
    return prefix


def envelope_of(
    resource_id: str, event: BaseModel, headers: dict[str, str] | None = None
) -> Envelope:
    """A new envelope for `event` with a fresh event ID and the current time. The payload is
    ``event.model_dump(mode="json")``, through the model's serializer directly (a third of the
    cost: model_dump's keyword handling is Python)."""
    model = type(event)
    return Envelope(
        resource_id,
        event_type_of(model),
        new_event_id(),
        time.time_ns() // 1_000_000,
        dict(headers) if headers else {},
        model.__pydantic_serializer__.to_python(event, mode="json"),
    )


def encoded_size(fields: dict[bytes, bytes]) -> int:
    """Bytes of field names and values of an entry: what counts against `max_payload_bytes`."""
    return sum(len(k) + len(v) for k, v in fields.items())


def decode_entry(
    fields: dict[bytes, bytes],
    *,
    max_bytes: int = DEFAULT_MAX_BYTES,
    max_containers: int | None = None,
) -> Envelope:
    """Decode the field map of one stream entry.

    :param max_bytes: largest decompressed body accepted, in bytes (consumers pass
        `Settings.max_decompressed_bytes`).
    :param max_containers: most arrays, maps and extensions in a body, whatever its size;
        default ``max_bytes // DECOMPRESSION_FACTOR`` (= `max_payload_bytes` for consumers).
        The budget of a body is ``len(body) // CONTAINER_BYTES`` (at least `MIN_CONTAINERS`),
        capped by this.
    :raises DecodeError: (never anything else, whatever the bytes: tests/unit/
        test_decoders_fuzz.py) when a field is missing, the format byte is unknown, the zstd
        frame or MessagePack body is corrupt, decompresses to more than `max_bytes`, holds more
        containers than its budget, is nested deeper than the decoder goes (about 1,000
        levels), or the envelope lacks a key.

    Synchronous and CPU-bound: call it in a worker thread for entries over
    `THREAD_DECODE_BYTES` (see the module docstring).
    """
    try:
        rid = fields[F_RESOURCE].decode("utf-8")
        etype = fields[F_TYPE].decode("utf-8")
        data = fields[F_DATA]
    except KeyError as exc:
        raise DecodeError(f"entry lacks field {exc.args[0]!r}") from None
    except UnicodeDecodeError as exc:
        raise DecodeError(f"entry field is not UTF-8: {exc}") from None
    if not data:
        raise DecodeError("entry has an empty data field")
    fmt = data[0]
    if fmt == FORMAT_MSGPACK and len(data) <= MIN_CONTAINERS:
        # The common case, in one typed pass: a body this short cannot exceed its container
        # budget (a container takes at least a byte), nor claim more elements than it has bytes.
        try:
            b = _BODY.decode(memoryview(data)[1:])
        except msgspec.MsgspecError as exc:
            raise DecodeError(f"corrupt envelope: {exc}") from None
        except Exception as exc:  # e.g. RecursionError: msgspec goes about 1,000 levels deep
            raise DecodeError(f"corrupt envelope: {type(exc).__name__}: {exc}") from None
        return Envelope(rid, etype, b.id, b.ts, b.h, b.p)
    if max_containers is None:
        max_containers = max(MIN_CONTAINERS, max_bytes // DECOMPRESSION_FACTOR)
    body = decompressed_body(data, max_bytes=max_bytes)
    try:
        if fmt != FORMAT_DICT_COMPACT:
            b = msgspec.convert(unpack_body(body, max_containers=max_containers), _Body)
            return Envelope(rid, etype, b.id, b.ts, b.h, b.p)
        # typed in one pass when short, as above; else under the budget first
        d = (
            _DICT_BODY.decode(body)
            if len(body) <= MIN_CONTAINERS
            else msgspec.convert(unpack_body(body, max_containers=max_containers), _DictBody)
        )
        return Envelope(rid, etype, data[1 + ID_BYTES : COMPACT_HEAD], d.ts, d.h, d.p)
    except msgspec.MsgspecError as exc:
        raise DecodeError(f"corrupt envelope: {exc}") from None
    except DecodeError:
        raise
    except Exception as exc:  # as above
        raise DecodeError(f"corrupt envelope: {type(exc).__name__}: {exc}") from None

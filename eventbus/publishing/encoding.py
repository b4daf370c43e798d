"""Encoding an event for its shard stream: `Encoder` turns an event (or a ready envelope) into
the shard stream key and the entry fields of its ``XADD``, refusing what every consumer would
refuse, before anything is sent: reserved event types (``__eventbus.``, `ReservedEventType`),
headers that are not str -> str and resource IDs that are not valid UTF-8 (`InvalidEvent`),
entries over `max_payload_bytes` (`PayloadTooLarge`) and envelopes that decompress to more than
`Settings.max_decompressed_bytes` (`DecompressedTooLarge`). `eventbus.publishing.publisher`
sends what it encodes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pydantic import BaseModel

from eventbus.config import Settings
from eventbus.errors import (
    ConfigError,
    DecodeError,
    DecompressedTooLarge,
    InvalidEvent,
    PayloadTooLarge,
    ReservedEventType,
)
from eventbus.profiles import EVENTBUS, Codec, WireProfile
from eventbus.protocol.budget import MIN_CONTAINERS
from eventbus.protocol.codec import (
    F_DATA,
    F_RESOURCE,
    F_TYPE,
    FORMAT_MSGPACK,
    RESERVED_TYPE_PREFIX,
    Envelope,
    decode_entry,
    encode_entry,
    envelope_of,
)
from eventbus.protocol.dictionaries import Dictionaries
from eventbus.protocol.framing import decompressed_size
from eventbus.protocol.keys import Keys, check_event_type
from eventbus.protocol.topics import TopicConfig
from eventbus.publishing.foreign import encode_foreign

_TYPES_KEPT = 10_000  # event type names an encoder remembers as checked
_FIELD_NAME_BYTES = len(F_RESOURCE) + len(F_TYPE) + len(F_DATA)  # `encoded_size`'s share of names


class Encoder:
    """Encodes events for their shard streams (one per `Publisher`)."""

    def __init__(
        self,
        settings: Settings,
        keys: Keys,
        dictionaries: Dictionaries,
        profile: WireProfile = EVENTBUS,
    ) -> None:
        """`keys` names the shard streams (the profile's key layout, `WireProfile.keys`);
        `dictionaries` gives each topic's current zstd dictionary; `profile` gives the shard
        hash and the entry format, both picked here, once."""
        self._settings = settings
        self._keys = keys
        self._shard_of = profile.shard_of
        self.dictionaries = dictionaries
        self.prepare_envelope: Callable[[TopicConfig, Envelope], tuple[str, dict[bytes, bytes]]]
        """Encode a ready envelope (e.g. a raw payload from the CLI); see `prepare`: the path
        of the profile's format (`Codec.publishes`: `prepare_native` for eventbus's own)."""
        self.prepare_envelope = profile.codec.publishes(self)
        self._streams: dict[str, list[str]] = {}
        self._types_ok: set[str] = set()  # event type names `_check_type` passed

    def _streams_of(self, topic: TopicConfig) -> list[str]:
        """The shard stream keys of `topic`, by shard (made once per topic)."""
        streams = self._streams[topic.name] = [
            self._keys.stream(topic.name, s) for s in range(topic.shards)
        ]
        return streams

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
        if not isinstance(event, BaseModel):
            raise ConfigError(f"event must be a pydantic model, got {type(event).__name__}")
        return self.prepare_envelope(topic, envelope_of(resource_id, event, headers))

    def prepare_native(
        self, topic: TopicConfig, envelope: Envelope
    ) -> tuple[str, dict[bytes, bytes]]:
        """`prepare_envelope` in eventbus's own format (`NativeCodec`).

        Refuses what every consumer would refuse: raises `ReservedEventType`, `InvalidEvent`
        (headers not str -> str, text that is not valid UTF-8, a body over the decoders'
        structural budget), `PayloadTooLarge`, `DecompressedTooLarge`, and `ConfigError` for an
        empty resource ID.

        One function (the common case, once per `publish()`): the encoding and the stream key
        inline, no call per step but the envelope's checks (`_check`).
        """
        rid, etype = envelope.resource_id, envelope.event_type
        self._check(topic, rid, etype, envelope.headers)
        settings = self._settings
        try:  # first: it says which text is not UTF-8
            fields = encode_entry(
                envelope,
                compress_threshold=settings.compress_threshold_bytes,
                dictionary=self.dictionaries.cached_current(topic.name),
            )
        except UnicodeEncodeError:  # which text: checked again, one by one, to say it
            _check_text(topic, "resource_id", rid)
            _check_text(topic, "event type", etype)
            raise
        data = fields[F_DATA]
        size = len(data) + len(fields[F_RESOURCE]) + len(fields[F_TYPE]) + _FIELD_NAME_BYTES
        if size > settings.max_payload_bytes:
            raise PayloadTooLarge(topic.name, size, settings.max_payload_bytes)
        if data[0] != FORMAT_MSGPACK or len(data) > MIN_CONTAINERS:  # (else: always decodes)
            self._check_decodable(topic, fields)
        streams = self._streams.get(topic.name) or self._streams_of(topic)
        return streams[self._shard_of(rid, topic.shards)], fields

    def prepare_foreign(
        self, codec: Codec, topic: TopicConfig, envelope: Envelope
    ) -> tuple[str, dict[bytes, bytes]]:
        """`prepare_envelope` in `codec`'s format, another than eventbus's
        (`eventbus.publishing.foreign`): the same checks and refusals as `prepare_native`."""
        rid = envelope.resource_id
        self._check(topic, rid, envelope.event_type, envelope.headers)
        fields = encode_foreign(codec, self._settings, topic, envelope)
        streams = self._streams.get(topic.name) or self._streams_of(topic)
        return streams[self._shard_of(rid, topic.shards)], fields

    def _check(self, topic: TopicConfig, rid: Any, etype: Any, headers: Any) -> None:
        """Refuse an envelope no format may carry: raises `ConfigError` for an empty resource
        ID, `InvalidEvent` for an empty event type or bad headers, `ReservedEventType`."""
        if not isinstance(rid, str) or not rid:
            raise ConfigError(f"resource_id must be a non-empty string, got {rid!r}")
        if not isinstance(etype, str) or not etype:
            raise InvalidEvent(topic.name, "event type", f"must be a non-empty string: {etype!r}")
        if etype not in self._types_ok:  # checked once per name
            self._check_type(topic, etype)
        if headers:
            _check_headers(topic, headers)

    def _check_type(self, topic: TopicConfig, etype: str) -> None:
        """Raise `ReservedEventType` or `InvalidEventType` for event type `etype`; remember a
        valid one (up to `_TYPES_KEPT` names: a producer of random names is checked each time)."""
        where = f"publish to topic {topic.name!r}"
        if etype.startswith(RESERVED_TYPE_PREFIX):
            raise ReservedEventType(etype, where)
        check_event_type(etype, where)
        if len(self._types_ok) < _TYPES_KEPT:
            self._types_ok.add(etype)

    def _check_decodable(self, topic: TopicConfig, fields: dict[bytes, bytes]) -> None:
        """Refuse an entry consumers could not decode: over `max_decompressed_bytes` once
        decompressed, or (bodies over `MIN_CONTAINERS` bytes only: smaller ones always fit)
        over the structural budget. The latter decodes the entry once, like a consumer."""
        limit = self._settings.max_decompressed_bytes
        body_size = decompressed_size(fields[F_DATA])
        if body_size > limit:
            raise DecompressedTooLarge(topic.name, body_size, limit)
        if body_size < 0 or body_size > MIN_CONTAINERS:
            try:
                decode_entry(fields, max_bytes=limit)
            except DecodeError as exc:
                raise InvalidEvent(topic.name, "payload", f"would not decode: {exc}") from None


def _check_text(topic: TopicConfig, what: str, text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidEvent(
            topic.name, what, f"{text!r} is not valid UTF-8 text ({exc.reason})"
        ) from None


def _check_headers(topic: TopicConfig, headers: Any) -> None:
    if not isinstance(headers, dict):
        raise InvalidEvent(topic.name, "headers", f"must be a dict of str -> str, not {headers!r}")
    for key, value in headers.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise InvalidEvent(
                topic.name,
                "headers",
                f"must map str to str: {key!r}: {value!r} (convert it with str())",
            )
        _check_text(topic, f"header {key!r}", key + value)

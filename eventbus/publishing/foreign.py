"""Encoding an event in a wire profile's own entry format (`eventbus.profiles.Codec` that is not
native, e.g. Verse's ``msg``), with the refusals `Encoder.prepare_envelope` makes for
eventbus's format: what every consumer would refuse is not sent.

Eventbus's format is checked by the publisher's fast path; a foreign format is decoded once by
its own codec before it is sent (a few microseconds for a small event), so that an entry the
consumers could not decode (over `Settings.max_decompressed_bytes`, or over the structural
budget of a body) is refused here rather than dead-lettered there.
"""

from __future__ import annotations

from eventbus.config import Settings
from eventbus.errors import DecodeError, InvalidEvent, PayloadTooLarge
from eventbus.profiles import Codec
from eventbus.protocol.codec import Envelope, encoded_size
from eventbus.protocol.topics import TopicConfig


def encode_foreign(
    codec: Codec, settings: Settings, topic: TopicConfig, envelope: Envelope
) -> dict[bytes, bytes]:
    """The fields of `envelope` in `codec`'s format, for `topic`.

    :raises InvalidEvent: the format cannot carry the envelope (e.g. a header the format
        writes itself), or its consumers could not decode the entry
    :raises PayloadTooLarge: the entry (field names and values) is over `max_payload_bytes`
    """
    try:
        fields = codec.encode(envelope)
    except ValueError as exc:
        raise InvalidEvent(topic.name, "envelope", f"cannot be written: {exc}") from None
    size = encoded_size(fields)
    if size > settings.max_payload_bytes:
        raise PayloadTooLarge(topic.name, size, settings.max_payload_bytes)
    try:
        codec.decode(fields, max_bytes=settings.max_decompressed_bytes, entry_id=None)
    except DecodeError as exc:
        raise InvalidEvent(topic.name, "payload", f"would not decode: {exc}") from None
    return fields

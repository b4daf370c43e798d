"""Which envelope format a publisher writes for entries with a topic's zstd dictionary
(`Settings.entry_format`): ``0x05`` (`eventbus.protocol.codec.encode_entry`, the newest and the
default) or ``0x04`` (`encode_entry_0x04`, the format of releases before ``0x05``), so that
publishers can keep writing what every reader of a rolling upgrade reads (docs/operations.md,
"Upgrading the entry format"). Entries without a dictionary (``0x01``, ``0x02``) are the same
with both.

A publisher picks its encoder once, when it is made (`entry_encoder`): no per-event choice.
"""

from __future__ import annotations

from typing import Protocol

from eventbus.errors import ConfigError
from eventbus.protocol.codec import F_DATA, Envelope, encode_entry
from eventbus.protocol.compression import framed_compressor
from eventbus.protocol.dictionaries import FORMAT_DICT_COMPACT, FORMAT_MSGPACK_ZSTD_DICT, ID_BYTES

_NEVER = 1 << 62
"""A `compress_threshold` no body reaches: `encode_entry` then writes format ``0x01``."""


def encode_entry_0x04(
    envelope: Envelope, *, compress_threshold: int = 1024, dictionary: int | None = None
) -> dict[bytes, bytes]:
    """`encode_entry` as releases before format ``0x05`` wrote entries (add925e's encoder,
    byte for byte): with `dictionary` (an ID in `eventbus.protocol.dictionaries.CACHE`),
    format ``0x04``: the dictionary ID (8 bytes, big endian), then a whole zstd frame (magic
    number included; no dictionary ID or checksum in it, content size written) of the map of
    format ``0x01`` (``v``, ``id``, ``ts``, ``h``, ``p``) compressed with that dictionary,
    whatever its size. Without, what `encode_entry` writes (``0x01``, or ``0x02`` from
    `compress_threshold` bytes).

    :raises UnicodeEncodeError: for a resource ID or event type that is not valid Unicode text
    :raises UnknownDictionary: for a `dictionary` not in the cache"""
    if dictionary is None:
        return encode_entry(envelope, compress_threshold=compress_threshold)
    fields = encode_entry(envelope, compress_threshold=_NEVER)
    frame = framed_compressor(dictionary).compress(memoryview(fields[F_DATA])[1:])
    head = bytes([FORMAT_MSGPACK_ZSTD_DICT]) + dictionary.to_bytes(ID_BYTES, "big")
    fields[F_DATA] = head + frame
    return fields


class EntryEncoder(Protocol):
    """The signature of `encode_entry` and `encode_entry_0x04`."""

    def __call__(
        self, envelope: Envelope, *, compress_threshold: int = ..., dictionary: int | None = ...
    ) -> dict[bytes, bytes]: ...


ENTRY_ENCODERS: dict[int, EntryEncoder] = {
    FORMAT_DICT_COMPACT: encode_entry,
    FORMAT_MSGPACK_ZSTD_DICT: encode_entry_0x04,
}
"""Encoders of eventbus's format, by the format (5, 4) of the entries they write with a
dictionary."""


def entry_encoder(entry_format: int) -> EntryEncoder:
    """The encoder whose entries with a dictionary have format `entry_format`
    (`Settings.entry_format`): 5 `encode_entry`, 4 `encode_entry_0x04`.

    :raises ConfigError: for another value, naming the setting and the known formats (the
        settings refuse it already; this catches settings made without validation, e.g.
        ``Settings.model_construct`` or an attribute set after validation)"""
    encoder = ENTRY_ENCODERS.get(entry_format) if type(entry_format) is int else None
    if encoder is None:
        known = " or ".join(f"{f} (0x{f:02x})" for f in sorted(ENTRY_ENCODERS, reverse=True))
        raise ConfigError(
            f"unknown entry_format {entry_format!r} (EVENTBUS_ENTRY_FORMAT): publishers write "
            f"format {known} for entries with a zstd dictionary (docs/operations.md)"
        )
    return encoder

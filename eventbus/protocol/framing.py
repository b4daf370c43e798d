"""The ``data`` field of a stream entry: its format byte and, for the zstd formats, its frame
(docs/protocol.md gives the bytes; `eventbus.protocol.codec` the map inside).

* ``0x01`` (`FORMAT_MSGPACK`): the MessagePack body follows as is;
* ``0x02`` (`FORMAT_MSGPACK_ZSTD`): a whole zstd frame (RFC 8878) holding the body;
* ``0x05`` (`FORMAT_DICT_COMPACT`): the dictionary ID (8 bytes, big endian), the event ID (16
  bytes), then a zstd frame without its magic number, compressed with that dictionary;
* ``0x03``, ``0x04``: retired (no release wrote them): refused.

`decompressed_size` reads a frame's header only (the size check before a decode);
`decompressed_body` undoes the compression, bounded by ``max_bytes``.
"""

from __future__ import annotations

import zstandard

from eventbus.errors import DecodeError
from eventbus.protocol.compression import decompressor as _decompressor
from eventbus.protocol.dictionaries import (
    FORMAT_DICT_COMPACT,
    ID_BYTES,
    RETIRED_DICT_FORMATS,
    dictionary_id,
)

FORMAT_MSGPACK = 0x01
FORMAT_MSGPACK_ZSTD = 0x02
DEFAULT_MAX_BYTES = 64 << 20
"""`decode_entry`'s default decompression cap (64 MiB = 64 x the default max_payload_bytes)."""
EVENT_ID_BYTES = 16
COMPACT_HEAD = 1 + ID_BYTES + EVENT_ID_BYTES
"""Bytes of a format ``0x05`` field before its zstd frame: format, dictionary ID, event ID."""
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
"""A zstd frame's first 4 bytes, which format 0x05 leaves out: readers put them back in front
of its frame, which is then a whole zstd frame (the magicless format is exactly that)."""


def decompressed_size(data: bytes) -> int:
    """Size in bytes of the MessagePack body of an entry's ``data`` field once decompressed
    (-1 when a zstd frame does not declare it or is unreadable). Cheap: reads the frame header
    only."""
    if not data:
        return 0
    fmt = data[0]
    if fmt == FORMAT_MSGPACK:
        return len(data) - 1
    try:
        if fmt == FORMAT_DICT_COMPACT:  # the magic number back in front, for zstd to parse
            return int(zstandard.frame_content_size(ZSTD_MAGIC + data[COMPACT_HEAD:]))
        if fmt == FORMAT_MSGPACK_ZSTD:
            return int(zstandard.frame_content_size(data[1:]))
    except zstandard.ZstdError:
        return -1
    return len(data) - 1


def decompressed_body(data: bytes, *, max_bytes: int = DEFAULT_MAX_BYTES) -> bytes:
    """The MessagePack body of an entry's ``data`` field (format byte read, zstd undone): for
    format ``0x05``, the map its frame holds (no ``v`` nor ``id``: module docstring). Raises
    `DecodeError` for an unknown format, a corrupt or truncated frame, more than `max_bytes`,
    or a dictionary that is not loaded or not valid (`UnknownDictionary`, `BadDictionary`)."""
    fmt, body = data[0], data[1:]
    if fmt == FORMAT_MSGPACK:
        return body
    dict_id = None
    if fmt == FORMAT_DICT_COMPACT:
        if len(data) <= COMPACT_HEAD:
            raise DecodeError(f"truncated envelope: {len(data)} bytes of format 0x05")
        dict_id = dictionary_id(data)
        body = ZSTD_MAGIC + data[COMPACT_HEAD:]  # parsed as a whole frame, declared size first
    elif fmt in RETIRED_DICT_FORMATS:
        raise DecodeError(
            f"envelope format 0x{fmt:02x} is retired (a dictionary format of unreleased "
            "versions, replaced by 0x05; docs/protocol.md): not read"
        )
    elif fmt != FORMAT_MSGPACK_ZSTD:
        raise DecodeError(f"unknown envelope format byte 0x{fmt:02x}")
    try:
        decompressor = None if dict_id is None else _decompressor(dict_id)
        # `max_output_size` only bounds frames that do not declare their size; a frame that
        # declares one is decompressed into a buffer of that size, so check it first.
        declared = zstandard.frame_content_size(body)
        if declared > max_bytes:
            raise DecodeError(f"envelope decompresses to {declared} bytes, over {max_bytes}")
        decompressor = decompressor or zstandard.ZstdDecompressor()
        return decompressor.decompress(body, max_output_size=max_bytes)
    except DecodeError:
        raise
    except Exception as exc:  # zstd raises several exception types
        raise DecodeError(f"corrupt envelope: {type(exc).__name__}: {exc}") from None

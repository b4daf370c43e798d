"""zstd compressors and decompressors for entry bodies, cached per (dictionary, thread).

zstandard's (de)compressor objects are not thread-safe, and making one per entry costs more
than compressing a small body, so each thread keeps its own per dictionary. With a topic's
dictionary (`eventbus.protocol.dictionaries`) frames are written without magic number and
dictionary ID (format ``0x05``, `eventbus.protocol.codec`).
"""

from __future__ import annotations

import threading

import zstandard

from eventbus.protocol.dictionaries import CACHE

ZSTD_LEVEL = 3
"""zstd's compression level for entry bodies (its default)."""

_COMPRESSORS: dict[tuple[int, int], zstandard.ZstdCompressor] = {}  # (id(dict), thread)


def compressor(dict_id: int | None) -> zstandard.ZstdCompressor:
    """A compressor for dictionary `dict_id` (None: none; with one, its frames have no magic
    number and no dictionary ID), one per thread (they are not thread-safe; making one per
    event cost more than compressing a small body)."""
    d = None if dict_id is None else CACHE.get(dict_id)
    key = (id(d), threading.get_ident())
    c = _COMPRESSORS.get(key)
    if c is None:
        c = _COMPRESSORS[key] = (
            zstandard.ZstdCompressor(level=ZSTD_LEVEL)
            if d is None
            else zstandard.ZstdCompressor(
                dict_data=d,
                compression_params=zstandard.ZstdCompressionParameters.from_level(
                    ZSTD_LEVEL,
                    format=zstandard.FORMAT_ZSTD1_MAGICLESS,
                    write_dict_id=False,
                    write_content_size=True,
                ),
            )
        )
    return c


_DECOMPRESSORS: dict[tuple[int, int], zstandard.ZstdDecompressor] = {}


def decompressor(dict_id: int) -> zstandard.ZstdDecompressor:
    """A decompressor for dictionary `dict_id`, one per thread. Raises `UnknownDictionary` or
    `BadDictionary` (the cache holds only dictionaries zstd accepted)."""
    d = CACHE.get(dict_id)
    key = (id(d), threading.get_ident())
    z = _DECOMPRESSORS.get(key)
    if z is None:
        z = _DECOMPRESSORS[key] = zstandard.ZstdDecompressor(dict_data=d)
    return z


def clear() -> None:
    """Forget every cached compressor and decompressor (they hold their dictionary): after
    dictionaries were dropped from `CACHE`, and between tests."""
    _COMPRESSORS.clear()
    _DECOMPRESSORS.clear()

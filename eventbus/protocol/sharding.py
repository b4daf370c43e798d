"""Resource ID -> shard: ``xxh64(utf8(resource_id), seed=0) mod shards``.

xxHash64 (https://github.com/Cyan4973/xxHash/blob/dev/doc/xxhash_spec.md) has implementations in
every mainstream language, so a producer written in Go or Java can publish to the right shard.
Python's `hash()` is randomised per process and is never used. Test vectors: docs/protocol.md.
"""

from __future__ import annotations

import xxhash

from eventbus.config import MAX_SHARDS
from eventbus.errors import ConfigError


def check_shards(shards: int) -> int:
    """Return `shards` if it is a valid shard count (1..1024); raise `ConfigError` otherwise."""
    if isinstance(shards, bool) or not isinstance(shards, int) or not 1 <= shards <= MAX_SHARDS:
        raise ConfigError(f"shard count must be an integer in 1..{MAX_SHARDS}, got {shards!r}")
    return shards


def shard_of(resource_id: str, shards: int) -> int:
    """The shard (0..shards-1) that `resource_id` belongs to."""
    return xxhash.xxh64_intdigest(resource_id.encode("utf-8")) % shards

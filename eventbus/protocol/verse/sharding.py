"""Verse's shard function: a 32-bit linear-congruential fold over the key's bytes.

Verse (verse-redis, ``EventManager#find_partition``) reduces the UTF-8 bytes ``b`` of the
resource ID from ``a = 0`` as ``a = (b + a * 498975571 + 548897941) mod 2**32`` and takes
``a mod partitions``. Vectors at 16 shards: ``""`` -> 0, ``"1"`` -> 6, ``"123"`` -> 3, ``"abc"``
-> 3, ``"user-42"`` -> 13, ``"550e8400-e29b-41d4-a716-446655440000"`` -> 9 (tests/fixtures/verse
holds more, computed by Verse's own Ruby code).
"""

from __future__ import annotations

from eventbus.errors import ConfigError

_MULTIPLIER = 498_975_571
_INCREMENT = 548_897_941
_MASK = 0xFFFF_FFFF

MAX_VERSE_SHARDS = 32
"""Verse's lock script reports the shards it took as bits of a 32-bit flag (Lua's ``bit``
library), so a Verse fleet works with at most 32 partitions."""


def check_verse_shards(shards: int) -> int:
    """Return `shards` if a Verse peer can share a topic of that many shards (1..32); raise
    `ConfigError` otherwise."""
    valid = isinstance(shards, int) and not isinstance(shards, bool)
    if not (valid and 1 <= shards <= MAX_VERSE_SHARDS):
        raise ConfigError(
            f"the verse profile needs 1..{MAX_VERSE_SHARDS} shards (Verse's lock script reports "
            f"shards as bits of a 32-bit flag), got {shards!r}"
        )
    return shards


def verse_hash(resource_id: str) -> int:
    """The 32-bit fold of `resource_id`'s UTF-8 bytes (the module docstring's formula)."""
    a = 0
    for b in resource_id.encode("utf-8"):
        a = (b + a * _MULTIPLIER + _INCREMENT) & _MASK
    return a


def verse_shard_of(resource_id: str, shards: int) -> int:
    """The shard (0..shards-1) Verse puts `resource_id`'s events on."""
    return verse_hash(resource_id) % shards

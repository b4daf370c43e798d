"""Wire profiles: which protocol a bus speaks on Redis, chosen once, when the bus is made.

A `WireProfile` is four parts, each picked at construction and then called without a test per
event: the **stream naming** (a `Keys` whose ``stream(topic, shard)`` names the shard streams),
the **envelope codec** (`Codec`: entry fields <-> `Envelope`), the **shard hash** (resource ID
-> shard) and the **lock client** of the consumers (whose lock keys exclude whom).

* `EVENTBUS` (``EventBus(profile="eventbus")``, the default): docs/protocol.md.
* `VERSE` (``EventBus(profile="verse")``): the wire protocol of Verse (verse-rb/verse-redis),
  so that a Python service publishes to, and consumes beside, Ruby services: streams
  ``VERSE:STREAM:RESOURCE:<topic>$<shard>``, the ``msg`` envelope, Verse's 32-bit shard hash,
  Verse's shard locks (`eventbus.protocol.verse`, `eventbus.locking.verse`). docs/verse.md says
  which of eventbus's guarantees hold in a fleet shared with Verse's consumers.

A profile is a bus's, not a topic's: every topic of the bus, its consumers, publisher and
tools use it. A service that also uses eventbus's own topics makes a second bus for them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from eventbus.errors import ConfigError
from eventbus.locking.locks import LockClient, ShardLocks
from eventbus.locking.verse import VerseLockClient
from eventbus.protocol.codec import F_DATA, F_RESOURCE, F_TYPE, Envelope, decode_entry, encode_entry
from eventbus.protocol.keys import Keys
from eventbus.protocol.sharding import check_shards, shard_of
from eventbus.protocol.verse.envelope import F_MSG, decode_verse, encode_verse
from eventbus.protocol.verse.keys import VerseKeys, VerseStreamKeys
from eventbus.protocol.verse.sharding import check_verse_shards, verse_shard_of

if TYPE_CHECKING:
    from eventbus.locking.member import Member
    from eventbus.locking.scripts import Scripts


@dataclass(frozen=True, slots=True)
class Codec:
    """A profile's entry format.

    :param native: eventbus's own format, which the publisher and the consumers encode and
        decode on their own fast paths (zstd dictionaries, decoding in threads, validation of a
        read in one pass); a codec that is not native goes through `encode` and `decode`
    :param encode: ``encode(envelope) -> fields``, the entry's field map; raises `ValueError`
        for an envelope the format cannot carry
    :param decode: ``decode(fields, *, max_bytes, entry_id) -> Envelope``; `max_bytes` bounds
        the decompressed body (bytes), `entry_id` (``<ms>-<seq>``) gives the event time when
        the format carries none; raises `DecodeError`, never anything else
    :param fields: the names of the fields an entry of this format carries, which a dead
        letter keeps
    """

    native: bool
    encode: Callable[[Envelope], dict[bytes, bytes]]
    decode: Callable[..., Envelope]
    fields: tuple[bytes, ...]


@dataclass(frozen=True, slots=True)
class WireProfile:
    """The four parts of a wire protocol (module docstring), and its name.

    :param keys: ``keys(prefix, hashtag) -> Keys``: the key layout, whose ``stream`` names the
        shard streams
    :param shard_of: ``shard_of(resource_id, shards) -> shard`` (0 <= shard < shards)
    :param check_shards: returns a shard count the protocol supports, raises `ConfigError`
    :param codec: the entry format
    :param lock_client: ``lock_client(member, shards, scripts) -> ShardLocks``: the shard
        locks of one consumer (`scripts`: eventbus's registered lock scripts, to share)
    :param shard_rule: `shard_of` in words, ``{shards}`` standing for the shard count (for
        the contract's documents)
    """

    name: str
    keys: Callable[[str, str], Keys]
    shard_of: Callable[[str, int], int]
    check_shards: Callable[[int], int]
    codec: Codec
    lock_client: Callable[[Member, int, Scripts | None], ShardLocks]
    shard_rule: str


def _decode_entry(
    fields: dict[bytes, bytes], *, max_bytes: int, entry_id: str | None = None
) -> Envelope:
    return decode_entry(fields, max_bytes=max_bytes)


def _eventbus_locks(member: Member, shards: int, scripts: Scripts | None) -> ShardLocks:
    return LockClient(member, shards=shards, scripts=scripts)


def _verse_locks(member: Member, shards: int, scripts: Scripts | None) -> ShardLocks:
    keys = VerseKeys()
    return VerseLockClient(
        member.redis,
        keys=keys,
        channel=keys.channel(member.topic),
        group=member.group,
        member_id=member.consumer_id,
        shards=shards,
        liveness_ttl_s=member.settings.liveness_ttl_s,
    )


EVENTBUS = WireProfile(
    name="eventbus",
    keys=Keys,
    shard_of=shard_of,
    check_shards=check_shards,
    codec=Codec(True, encode_entry, _decode_entry, (F_RESOURCE, F_TYPE, F_DATA)),
    lock_client=_eventbus_locks,
    shard_rule="xxh64(utf8(resource_id)) mod {shards} (docs/protocol.md)",
)
"""eventbus's own protocol (docs/protocol.md)."""

VERSE = WireProfile(
    name="verse",
    keys=VerseStreamKeys,
    shard_of=verse_shard_of,
    check_shards=check_verse_shards,
    codec=Codec(False, encode_verse, decode_verse, (F_MSG,)),
    lock_client=_verse_locks,
    shard_rule="Verse's 32-bit linear-congruential fold of utf8(resource_id) mod {shards} "
    "(docs/verse.md)",
)
"""Verse's protocol (docs/verse.md)."""

PROFILES = {p.name: p for p in (EVENTBUS, VERSE)}


def profile_named(profile: str | WireProfile) -> WireProfile:
    """The profile named `profile` (``"eventbus"`` or ``"verse"``), or `profile` itself if it
    is one. Raises `ConfigError` for another name."""
    if isinstance(profile, WireProfile):
        return profile
    try:
        return PROFILES[profile]
    except (KeyError, TypeError):
        raise ConfigError(
            f"unknown wire profile {profile!r}: choose one of {', '.join(map(repr, PROFILES))}"
        ) from None

"""Wire profiles: which protocol a bus speaks on Redis, chosen once, when the bus is made.

A `WireProfile` is four parts, each picked at construction and then called without a test per
event: the **stream naming** (a `Keys` whose ``stream(topic, shard)`` names the shard streams),
the **envelope codec** (`Codec`: entry fields <-> `Envelope`, and which path of the publisher and
the consumers handles them: `NativeCodec` is eventbus's own), the **shard hash** (resource ID
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

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, ClassVar

from eventbus.errors import ConfigError
from eventbus.locking.locks import LockClient, ShardLocks
from eventbus.locking.verse import VerseLockClient
from eventbus.protocol.codec import F_DATA, F_RESOURCE, F_TYPE, Envelope, decode_entry, encode_entry
from eventbus.protocol.keys import CoordinationSlots, Keys
from eventbus.protocol.sharding import check_shards, shard_of
from eventbus.protocol.verse.envelope import F_MSG, decode_verse, encode_verse
from eventbus.protocol.verse.keys import VerseKeys, VerseStreamKeys
from eventbus.protocol.verse.sharding import check_verse_shards, verse_shard_of

if TYPE_CHECKING:
    from eventbus.consumer.decoding import Decoding
    from eventbus.consumer.delivery import Delivery
    from eventbus.locking.member import Member
    from eventbus.locking.scripts import Scripts
    from eventbus.protocol.topics import TopicConfig
    from eventbus.publishing.encoding import Encoder

    Prepared = tuple[str, dict[bytes, bytes]]
    """(shard stream key, entry fields): what the publisher sends."""


@dataclass(frozen=True, slots=True)
class Codec:
    """A profile's entry format, one entry at a time through its own functions (a format other
    than eventbus's, e.g. Verse's ``msg``); `NativeCodec` is eventbus's own. The publisher and the
    consumers ask the codec for their path (`publishes`, `reads`) once, when they are made:
    each kind of codec is its own implementation, not a test per event.

    :param encode: ``encode(envelope) -> fields``, the entry's field map; raises `ValueError`
        for an envelope the format cannot carry
    :param decode: ``decode(fields, *, max_bytes, entry_id) -> Envelope``; `max_bytes` bounds
        the decompressed body (bytes), `entry_id` (``<ms>-<seq>``) gives the event time when
        the format carries none; raises `DecodeError`, never anything else
    :param fields: the names of the fields an entry of this format carries, which a dead
        letter keeps
    """

    encode: Callable[[Envelope], dict[bytes, bytes]]
    decode: Callable[..., Envelope]
    fields: tuple[bytes, ...]

    orders_by_resource: ClassVar[bool] = False
    """Whether a consumer queues an entry behind its resource's earlier ones (and so can park a
    resource); a format that need not carry the resource ID is ordered per shard
    (`eventbus.consumer.foreign`)."""
    archived: ClassVar[bool] = False
    """Whether the durable tier (offloader, catch-up, replay) reads entries of this format."""

    def reads(self, decoding: Decoding) -> Callable[[Sequence[Delivery]], None]:
        """How `decoding` decodes one read ahead of the entries' turn: entry by entry through
        `decode`, in shard order (`Decoding.prepare_foreign`)."""
        return partial(decoding.prepare_foreign, self)

    def publishes(self, encoder: Encoder) -> Callable[[TopicConfig, Envelope], Prepared]:
        """How `encoder` encodes an envelope: through `encode`, checked by `decode`
        (`Encoder.prepare_foreign`)."""
        return partial(encoder.prepare_foreign, self)


@dataclass(frozen=True, slots=True)
class NativeCodec(Codec):
    """eventbus's own format (docs/protocol.md), which the publisher and the consumers encode and
    decode on their own fast paths: zstd dictionaries, large entries decoded in threads, a read
    validated in one pass, ordered per resource, archived by the durable tier."""

    orders_by_resource: ClassVar[bool] = True
    archived: ClassVar[bool] = True

    def reads(self, decoding: Decoding) -> Callable[[Sequence[Delivery]], None]:
        """`Decoding.prepare`: the consumers' own path for eventbus's format."""
        return decoding.prepare

    def publishes(self, encoder: Encoder) -> Callable[[TopicConfig, Envelope], Prepared]:
        """`Encoder.prepare_native`: the publisher's own path for eventbus's format."""
        return encoder.prepare_native


@dataclass(frozen=True, slots=True)
class WireProfile:
    """The four parts of a wire protocol (module docstring), and its name.

    :param keys: ``keys(prefix, hashtag, slots) -> Keys``: the key layout, whose ``stream``
        names the shard streams (`slots`: the ``coordination_slots`` setting)
    :param shard_of: ``shard_of(resource_id, shards) -> shard`` (0 <= shard < shards)
    :param check_shards: returns a shard count the protocol supports, raises `ConfigError`
    :param codec: the entry format
    :param lock_client: ``lock_client(member, shards, scripts) -> ShardLocks``: the shard
        locks of one consumer (`scripts`: eventbus's registered lock scripts, to share)
    :param shard_rule: `shard_of` in words, ``{shards}`` standing for the shard count (for
        the contract's documents)
    """

    name: str
    keys: Callable[[str, str, CoordinationSlots], Keys]
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
    codec=NativeCodec(encode_entry, _decode_entry, (F_RESOURCE, F_TYPE, F_DATA)),
    lock_client=_eventbus_locks,
    shard_rule="xxh64(utf8(resource_id)) mod {shards} (docs/protocol.md)",
)
"""eventbus's own protocol (docs/protocol.md)."""

VERSE = WireProfile(
    name="verse",
    keys=VerseStreamKeys,
    shard_of=verse_shard_of,
    check_shards=check_verse_shards,
    codec=Codec(encode_verse, decode_verse, (F_MSG,)),
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

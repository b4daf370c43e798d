"""Every Redis key of the Verse profile, built in this one module (Verse's names, verbatim).

Verse (verse-redis, ``Stream::EventManager`` and ``Subscriber::Stream``) names:

* a **resource channel** ``VERSE:STREAM:RESOURCE:<resource type>``: an eventbus topic is a
  Verse resource type, its event types are Verse's ``event`` header;
* the **shard streams** ``<channel>$<shard>`` (one per partition), and the unsharded stream
  ``<channel>`` that Verse's consumers also read (what Verse publishes without a key);
* a **shard lock** per (channel, shard, consumer group), the string
  ``{VERSE:STREAM:SHARDLOCK}:<channel>:<shard>:<group>`` (the owner's service ID, ``EX 3200``),
  where Verse's group is its service name;
* a **liveness key** per consumer ``{VERSE:STREAM:SHARDLOCK}:SERVICE_LIVENESS:<service id>``
  (``EX 30``, refreshed every 15 s): a lock whose owner has no liveness key is free to take;
* the pub/sub channel ``VERSE:RESOURCE:<resource type>:<event>`` of Verse's fire-and-forget copy.

eventbus adds two keys under the same hashtag (so one script touches them all on a Cluster),
which Verse never reads: the live eventbus members of a group (for the fair share among them) and
the fencing tokens it keeps per shard.
"""

from __future__ import annotations

from dataclasses import dataclass

from eventbus.protocol.keys import Keys, check_name

LOCK_TAG = "{VERSE:STREAM:SHARDLOCK}"
RESOURCE_STREAM = "VERSE:STREAM:RESOURCE"
RESOURCE_PUBSUB = "VERSE:RESOURCE"


@dataclass(frozen=True, slots=True)
class VerseKeys:
    """Key builder of the Verse profile (no prefix: Verse's names are fixed)."""

    def channel(self, topic: str) -> str:
        """The Verse resource channel of `topic`: ``VERSE:STREAM:RESOURCE:<topic>``."""
        return f"{RESOURCE_STREAM}:{check_name('topic', topic)}"

    def stream(self, channel: str, shard: int) -> str:
        """Shard `shard`'s stream of `channel`: ``<channel>$<shard>``."""
        return f"{channel}${shard}"

    def lock(self, channel: str, shard: int, group: str) -> str:
        """The lock of `group` on shard `shard` of `channel` (value: the owner's service ID)."""
        return f"{LOCK_TAG}:{channel}:{shard}:{group}"

    def liveness(self, member_id: str) -> str:
        """The liveness key of a consumer (Verse's service ID; eventbus's consumer ID)."""
        return f"{LOCK_TAG}:SERVICE_LIVENESS:{member_id}"

    def pubsub(self, topic: str, event_type: str) -> str:
        """Verse's pub/sub channel of one event type of a resource type."""
        return f"{RESOURCE_PUBSUB}:{topic}:{event_type}"

    # -- eventbus's own keys, under Verse's hashtag (Verse ignores them) --------------------
    def members(self, channel: str, group: str) -> str:
        """Sorted set of the group's live eventbus consumers (score: liveness deadline, Redis
        server time in ms), for the fair share among them."""
        return f"{LOCK_TAG}:EVENTBUS:MEMBERS:{channel}:{group}"

    def tokens(self, channel: str, group: str) -> str:
        """Hash: shard -> fencing token, incremented whenever an eventbus consumer takes the
        lock (Verse's own consumers take it without one)."""
        return f"{LOCK_TAG}:EVENTBUS:TOKENS:{channel}:{group}"


@dataclass(frozen=True, slots=True)
class VerseStreamKeys(Keys):
    """eventbus's key layout (`Keys`) with Verse's shard streams: `stream` names
    ``VERSE:STREAM:RESOURCE:<topic>$<shard>``, where Verse's publishers and consumers of
    resource type `<topic>` write and read. Every other key (dead letters, parked resources,
    the topic registry, de-duplication, trim records) stays eventbus's, under `prefix` and
    `hashtag`: Verse has no such keys."""

    def stream(self, topic: str, shard: int) -> str:
        """Shard `shard`'s stream of `topic`: ``VERSE:STREAM:RESOURCE:<topic>$<shard>``."""
        return f"{RESOURCE_STREAM}:{topic}${shard}"

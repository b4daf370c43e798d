"""One member of a consumer group, as the parts that work for it see it: `Member`.

A consumer's lock client, reader, acks, trim watch and handling path, the offloader's lock client
and catch-up all need the same five things: the Redis client, the key layout, the settings, and
who the member is (topic, group, member ID). They take one `Member` instead of five arguments.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeAlias

if TYPE_CHECKING:
    import redis.asyncio
    import redis.asyncio.cluster

    from eventbus.config import Settings
    from eventbus.profiles import WireProfile
    from eventbus.protocol.keys import Keys

AsyncRedis: TypeAlias = "redis.asyncio.Redis | redis.asyncio.cluster.RedisCluster"
"""The Redis clients eventbus works with: redis-py's asyncio client (a single node, or the
primary a Sentinel names) or its Cluster client; `eventbus.client.connection.connect` makes
either."""


@dataclass(frozen=True, slots=True)
class Member:
    """Member `consumer_id` of consumer group `group` on topic `topic` (a topic name), talking
    to Redis through `redis` with the key layout `keys` and the deployment's `settings`.

    The offloader is a member of the reserved group ``_offloader``; catch-up takes the locks of
    the group it catches up, under its own member ID. `profile` is the wire profile the member
    speaks (`eventbus.profiles`: the bus's; the durable tier's members ``EVENTBUS``, the only
    format it reads), whose lock client and codec it uses.
    """

    redis: AsyncRedis
    keys: Keys
    settings: Settings
    topic: str
    group: str
    consumer_id: str
    profile: WireProfile

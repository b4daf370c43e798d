"""Topic metadata: the shard count of each topic, stored once in Redis and checked by everyone.

The registry hash (`Keys.topics`) maps topic -> shard count. The first publisher or consumer of a
topic writes it (HSETNX); everyone after compares, and refuses a different count with
`ShardCountMismatch`, since a resource must hash to the same shard on every side.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from eventbus.errors import ConfigError, ShardCountMismatch
from eventbus.protocol.keys import Keys, check_name
from eventbus.protocol.retention import RETENTIONS, Retention
from eventbus.protocol.sharding import check_shards


@dataclass(frozen=True, slots=True)
class TopicConfig:
    """Per-topic settings: shard count, approximate length cap of each shard stream, and
    retention (`eventbus.protocol.retention`: ``"maxlen"`` or ``"acked"``)."""

    name: str
    shards: int
    maxlen: int
    retention: Retention = "maxlen"
    shards_from_settings: bool = field(default=False, compare=False, repr=False)
    """Whether `shards` is the settings' default (the topic was declared without a count):
    the in-memory test bus runs such topics on fewer shards (`eventbus.testing.MEMORY_SHARDS`)."""

    def __post_init__(self) -> None:
        check_name("topic", self.name)
        check_shards(self.shards)
        if isinstance(self.maxlen, bool) or not isinstance(self.maxlen, int) or self.maxlen < 1:
            raise ConfigError(f"topic {self.name!r}: maxlen must be a positive integer")
        if self.retention not in RETENTIONS:
            raise ConfigError(
                f"topic {self.name!r}: retention must be one of {RETENTIONS}, "
                f"not {self.retention!r}"
            )


class TopicRegistry:
    """Checks each topic's shard count against Redis once per process."""

    def __init__(self, redis: Any, keys: Keys) -> None:
        self._redis = redis
        self._keys = keys
        self._checked: set[str] = set()

    def checked(self, name: str) -> bool:
        """Whether `ensure` already succeeded for topic `name` in this process."""
        return name in self._checked

    async def ensure(self, topic: TopicConfig) -> None:
        """Register `topic`'s shard count, or check it against the stored one.

        Raises `ShardCountMismatch` when Redis holds another count for the topic, and
        `ConfigError` when a ``retention="acked"`` topic's field in the retention hash holds
        anything but ``acked``.
        """
        if topic.name in self._checked:
            return
        await self.verify(topic)
        self._checked.add(topic.name)

    async def verify(self, topic: TopicConfig) -> None:
        """`ensure`, asking Redis even when this process checked the topic before: Redis may
        have lost its data since (FLUSHALL, a restart without persistence), registry included,
        and this writes it again. Raises as `ensure`."""
        key = self._keys.topics()
        await self._redis.hsetnx(key, topic.name, topic.shards)
        stored = int(await self._redis.hget(key, topic.name))
        if stored != topic.shards:
            raise ShardCountMismatch(topic.name, stored, topic.shards)
        if topic.retention == "acked":  # the offloader reads it: never trim past the groups
            await self._record_acked(topic.name)

    async def _record_acked(self, name: str) -> None:
        """Record topic `name` as ``acked`` in the retention hash, once (``HSETNX``: no role
        needs ``HSET`` there, so none can turn a recorded topic back); raises `ConfigError`
        when the field holds something else (written by something other than eventbus)."""
        key = self._keys.retention()
        if await self._redis.hsetnx(key, name, "acked"):
            return
        stored = await self._redis.hget(key, name)
        if stored not in (b"acked", "acked"):
            raise ConfigError(
                f"topic {name!r} has retention 'acked' but {key} holds {stored!r} for it; "
                "delete the field (HDEL) to record it again"
            )

    async def stored(self) -> dict[str, int]:
        """Every registered topic with its shard count."""
        raw = await self._redis.hgetall(self._keys.topics())
        return {k.decode(): int(v) for k, v in raw.items()}

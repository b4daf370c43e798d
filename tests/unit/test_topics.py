"""The topic registry (`eventbus.protocol.topics`) on fakeredis: shard counts registered once, and a
``retention="acked"`` topic recorded once (``HSETNX``), never rewritten (no role needs ``HSET`` on
the retention hash)."""

from __future__ import annotations

from typing import Any

import pytest

from eventbus.errors import ConfigError, ShardCountMismatch
from eventbus.protocol.keys import Keys
from eventbus.protocol.topics import TopicConfig, TopicRegistry

pytestmark = pytest.mark.anyio
KEYS = Keys()


def _topic(shards: int = 2, retention: Any = "maxlen") -> TopicConfig:
    return TopicConfig("orders", shards=shards, maxlen=100, retention=retention)


async def test_a_shard_count_is_registered_once_and_checked(fake_redis: Any) -> None:
    await TopicRegistry(fake_redis, KEYS).ensure(_topic(2))
    with pytest.raises(ShardCountMismatch):
        await TopicRegistry(fake_redis, KEYS).ensure(_topic(3))
    assert await TopicRegistry(fake_redis, KEYS).stored() == {"orders": 2}


async def test_an_acked_topic_is_recorded_once(fake_redis: Any) -> None:
    await TopicRegistry(fake_redis, KEYS).ensure(_topic(retention="acked"))
    await TopicRegistry(fake_redis, KEYS).ensure(_topic(retention="acked"))  # again: no error
    assert await fake_redis.hgetall(KEYS.retention()) == {b"orders": b"acked"}
    await TopicRegistry(fake_redis, KEYS).ensure(_topic())  # maxlen: the record stays
    assert await fake_redis.hget(KEYS.retention(), "orders") == b"acked"


async def test_a_retention_field_written_by_something_else_is_refused_not_overwritten(
    fake_redis: Any,
) -> None:
    await fake_redis.hset(KEYS.retention(), "orders", "maxlen")
    with pytest.raises(ConfigError, match=r"holds b'maxlen' for it; delete the field"):
        await TopicRegistry(fake_redis, KEYS).ensure(_topic(retention="acked"))
    assert await fake_redis.hget(KEYS.retention(), "orders") == b"maxlen"

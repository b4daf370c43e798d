"""The Verse profile's lock client beside a Verse consumer, on redis-server and on a 3-primary
Redis Cluster (Verse's lock keys share one hashtag); see `tests/unit/verse_lock_cases.py`."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
import redis.asyncio
from redis.asyncio.cluster import RedisCluster as ClusterClient
from unit.verse_lock_cases import VerseLockCases

from localredis.cluster import ReplicatedCluster

pytestmark = pytest.mark.anyio


class TestVerseLocksOnRedis(VerseLockCases):
    @pytest.fixture
    def client(self, r: redis.asyncio.Redis) -> Any:
        return r


class TestVerseLocksOnCluster(VerseLockCases):
    @pytest.fixture
    async def client(self, redis_cluster: ReplicatedCluster) -> AsyncIterator[Any]:
        client = ClusterClient.from_url(redis_cluster.url)
        await client.flushall()
        yield client
        await client.aclose()

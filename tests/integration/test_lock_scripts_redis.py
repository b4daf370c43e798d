"""The lock scripts and `LockClient` on a real redis-server and on a 3-node Redis Cluster; see
`tests/unit/lock_script_cases.py` for the cases."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
import redis.asyncio
from redis.asyncio.cluster import RedisCluster as ClusterClient
from unit.lock_script_cases import LockClientCases, LockScriptCases

from localredis.cluster import ReplicatedCluster


class TestLockScriptsOnRedis(LockScriptCases):
    @pytest.fixture
    def client(self, r: redis.asyncio.Redis) -> Any:
        return r


class TestLockScriptsOnCluster(LockScriptCases):
    @pytest.fixture
    async def client(self, redis_cluster: ReplicatedCluster) -> AsyncIterator[Any]:
        client = ClusterClient.from_url(redis_cluster.url)
        await client.flushall()
        yield client
        await client.aclose()


class TestLockClientOnRedis(LockClientCases):
    @pytest.fixture
    def client(self, r: redis.asyncio.Redis) -> Any:
        return r


class TestLockClientOnCluster(LockClientCases):
    @pytest.fixture
    async def client(self, redis_cluster: ReplicatedCluster) -> AsyncIterator[Any]:
        client = ClusterClient.from_url(redis_cluster.url)
        await client.flushall()
        yield client
        await client.aclose()

"""Shared fixtures: a real Redis for integration tests, a fakeredis for fast unit tests.

Redis for integration tests, in order of preference:

1. ``REDIS_URL`` from the environment: an existing server. Tests FLUSHDB it, so point it at a
   throw-away database.
2. testcontainers' ``redis:7`` image, when a Docker engine answers.
3. A private ``redis-server`` on a free loopback port (`eventbus.testing.server.RedisServer`).

The server is started once per session; each test gets a flushed database. The 3-node Redis
Cluster (`redis_cluster`) is started only by the tests that ask for it.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest
import redis
import redis.asyncio

from eventbus.config import Settings
from eventbus.testing.server import RedisCluster, RedisServer

pytest_plugins = ["pytester"]  # tests of eventbus.testing.pytest_plugin


@pytest.fixture(scope="session")
def anyio_backend() -> str:
    return "asyncio"


def _docker_redis() -> Iterator[str] | None:
    """A redis container's URL generator, or None when no Docker engine answers."""
    try:
        import docker

        docker.from_env(timeout=2).ping()
        from testcontainers.community.redis import RedisContainer
    except Exception:  # no Docker SDK, no engine, or no testcontainers: use the local binary
        return None

    def gen() -> Iterator[str]:
        with RedisContainer("redis:7") as container:
            host = container.get_container_host_ip()
            yield f"redis://{host}:{container.get_exposed_port(6379)}/0"

    return gen()


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """URL of the session's Redis server (see the module docstring)."""
    if url := os.environ.get("REDIS_URL"):
        yield url
        return
    container = _docker_redis()
    if container is not None:
        yield from container
        return
    with RedisServer() as server:
        yield server.url


@pytest.fixture
def redis_db(redis_url: str) -> str:
    """The session's Redis URL, its database flushed for this test."""
    with redis.Redis.from_url(redis_url) as client:
        client.flushdb()
    return redis_url


@pytest.fixture
async def r(redis_db: str) -> AsyncIterator[redis.asyncio.Redis]:
    """A binary-safe asyncio client of the session's Redis, on a freshly flushed database."""
    client = redis.asyncio.Redis.from_url(redis_db)
    yield client
    await client.aclose()


@pytest.fixture
def settings(redis_db: str) -> Callable[..., Settings]:
    """Factory of `Settings` for the session's Redis (database flushed), with small defaults
    that keep tests fast: 4 shards, short polls and retries. Keyword arguments override."""

    def make(**overrides: Any) -> Settings:
        values: dict[str, Any] = {
            "redis_url": redis_db,
            "shards": 4,
            "block_max_ms": 100,
            "retry_base_s": 0.01,
            "retry_max_s": 0.05,
        }
        values.update(overrides)
        return Settings(**values)

    return make


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[RedisCluster]:
    """A 3-primary Redis Cluster on loopback (about 2 s to start), shared by the session."""
    with RedisCluster(3) as cluster:
        yield cluster


@pytest.fixture
async def fake_redis() -> AsyncIterator[Any]:
    """An in-memory fakeredis with Lua (lupa): for unit tests of script logic only."""
    import fakeredis

    client = fakeredis.aioredis.FakeRedis()
    yield client
    await client.aclose()

"""Where the shared consume and failure-policy cases run, as FastStream runs its broker cases on
its in-memory test client and on a real broker.

A case class takes a `backend` fixture; a runner subclasses it with `MemoryBackend`
(`eventbus.testing.memory_redis`, fakeredis with Lua: `tests/unit/test_consume_memory.py`) or
`RedisBackend` (the session's redis-server, see `tests/conftest.py`:
`tests/integration/test_consume_redis.py`). Cases that need a real server (several processes,
restarts, CLIENT PAUSE, timing of real sockets) stay in `tests/integration`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import pytest

from eventbus import EventBus, Settings
from eventbus.testing import memory_redis

# the defaults of `tests/conftest.py`'s `settings` fixture: 4 shards, short polls and retries
DEFAULTS: dict[str, Any] = {
    "shards": 4,
    "block_max_ms": 100,
    "retry_base_s": 0.01,
    "retry_max_s": 0.05,
}


@dataclass
class Backend:
    """A Redis for one test: `bus(...)` makes a bus on it (keyword arguments override the
    settings), `redis` is a client to inspect it, `url` its address (None in memory)."""

    name: str
    redis: Any
    url: str | None

    def settings(self, **overrides: Any) -> Settings:
        return Settings(**{"redis_url": self.url or "redis://in-memory", **DEFAULTS, **overrides})

    def bus(self, **overrides: Any) -> EventBus:
        # in memory, every bus shares the one fakeredis client (closing it only drops its
        # connections: the data stays); on a server, each bus connects on its own
        return EventBus(self.settings(**overrides), redis=self.redis if self.url is None else None)


class MemoryBackend:
    """The cases on fakeredis (`eventbus.testing.memory_redis`): the bus users test with."""

    @pytest.fixture
    async def backend(self) -> AsyncIterator[Backend]:
        client = memory_redis()
        yield Backend("memory", client, None)
        await client.aclose()


class RedisBackend:
    """The cases on the session's redis-server, its database flushed for each test."""

    @pytest.fixture
    def backend(self, r: Any, redis_db: str) -> Backend:
        return Backend("redis", r, redis_db)

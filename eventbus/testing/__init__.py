"""An in-memory bus for users' own tests: the real subscriber path on fakeredis (with Lua).

Only the Redis connection is swapped; publishing, the lock scripts, ordering, retries and
dead-lettering are the production code::

    from eventbus.testing import running

    async def test_billing() -> None:
        async with running(bus) as tb:
            await tb.publish("orders", OrderPlaced(order_id="o1", total_cents=5), resource_id="o1")
            await tb.drain()
        assert ...   # what your handler did

fakeredis is a Python reimplementation of Redis: it proves your handlers' logic, not Redis's
behaviour under load or failure (run those tests against a real ``redis-server``).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import anyio
from pydantic import BaseModel

from eventbus.app import EventBus


def memory_redis() -> Any:
    """A fresh fakeredis asyncio client with Lua scripting (needs the `lupa` package)."""
    import fakeredis

    return fakeredis.FakeAsyncRedis(server=fakeredis.FakeServer(version=(7, 0)))


class TestBus:
    """A running bus on fakeredis; made by `running`."""

    __test__ = False  # not a pytest test class

    def __init__(self, bus: EventBus) -> None:
        self.bus = bus

    @property
    def redis(self) -> Any:
        return self.bus.redis

    async def publish(
        self, topic: str, event: BaseModel, *, resource_id: str, **kw: Any
    ) -> str:
        """`EventBus.publish` on the in-memory Redis."""
        return await self.bus.publish(topic, event, resource_id=resource_id, **kw)

    async def drain(self, within_s: float = 10.0) -> None:
        """Wait until every subscriber has handled (or dead-lettered) every published entry.

        Raises `TimeoutError` after `within_s` seconds, naming the streams still behind.
        """
        try:
            with anyio.fail_after(within_s):
                while await self._behind():  # noqa: ASYNC110 - state held in Redis is polled
                    await anyio.sleep(0.002)
        except TimeoutError:
            raise TimeoutError(f"not drained after {within_s} s: {await self._behind()}") from None

    async def _behind(self) -> list[str]:
        behind = []
        for consumer in self.bus.consumers:
            if consumer.in_flight:
                behind.append(f"{consumer.group}: {consumer.in_flight} in flight")
        for sub in self.bus.subscriptions:
            for shard in range(sub.topic.shards):
                stream = self.bus.keys.stream(sub.topic.name, shard)
                if not await self.redis.exists(stream):
                    continue
                last = (await self.redis.xinfo_stream(stream))["last-generated-id"]
                for group in await self.redis.xinfo_groups(stream):
                    if group["name"].decode() != sub.group:
                        continue
                    if group["pending"] or group["last-delivered-id"] != last:
                        behind.append(f"{stream} group {sub.group}")
        return behind


@contextlib.asynccontextmanager
async def running(bus: EventBus, *, redis: Any | None = None) -> AsyncIterator[TestBus]:
    """Run `bus` and all its subscribers on an in-memory Redis (or `redis`) for a test.

    On exit the subscribers shut down gracefully, as in production.
    """
    if bus.running:
        raise RuntimeError("the bus is already running")
    bus._redis = redis if redis is not None else memory_redis()
    bus._registry = bus._publisher = None
    bus.settings = bus.settings.model_copy(update={"block_max_ms": 50})
    stop = anyio.Event()
    async with bus, anyio.create_task_group() as tg:
        if bus.subscriptions:
            tg.start_soon(lambda: bus.run(stop=stop))
        try:
            yield TestBus(bus)
        finally:
            stop.set()

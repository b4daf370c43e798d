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
behaviour under load or failure. The same test runs against a real ``redis-server`` when given
its URL: ``running(bus, redis="redis://localhost:6379/15")`` (a throw-away database).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import anyio
from pydantic import BaseModel

from eventbus.app import EventBus
from eventbus.errors import ConfigError


def memory_redis() -> Any:
    """A fresh fakeredis asyncio client with Lua scripting. Raises `ConfigError` saying what to
    install when the ``testing`` extra (fakeredis with lupa) is missing."""
    try:
        import fakeredis
        import lupa  # noqa: F401  # fakeredis runs the Lua scripts with it
    except ImportError as exc:
        raise ConfigError(
            f"the in-memory bus needs fakeredis with Lua ({exc.name} is missing): "
            "pip install 'eventbus[testing]'"
        ) from None

    return fakeredis.FakeAsyncRedis(server=fakeredis.FakeServer(version=(7, 0)))


class TestBus:
    """A running bus; made by `running`. `done` is set once its subscribers have stopped."""

    __test__ = False  # not a pytest test class

    def __init__(self, bus: EventBus, stop: anyio.Event) -> None:
        self.bus = bus
        self.done = anyio.Event()
        self._stop = stop
        self.redis = bus._current().redis

    redis: Any
    """The Redis this run used (still usable after the block, e.g. the in-memory one)."""

    @property
    def consumer_ids(self) -> list[str]:
        """The member IDs of the bus's consumers (`Context.consumer_id`), one per subscriber."""
        return [c.consumer_id for c in self.bus.consumers]

    def stop(self) -> None:
        """Ask the subscribers to shut down gracefully (as on SIGTERM) before the end of the
        `running` block; await `done` to wait for them."""
        self._stop.set()

    async def publish(self, topic: str, event: BaseModel, *, resource_id: str, **kw: Any) -> str:
        """`EventBus.publish` on the bus's Redis."""
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
                groups = {g["name"].decode(): g for g in await self.redis.xinfo_groups(stream)}
                group = groups.get(sub.group)
                # no group yet: its consumer is starting, and the entries wait for it
                if group is None or group["pending"] or group["last-delivered-id"] != last:
                    behind.append(f"{stream} group {sub.group}")
        return behind


@contextlib.asynccontextmanager
async def running(bus: EventBus, *, redis: Any | str | None = None) -> AsyncIterator[TestBus]:
    """Run `bus` and all its subscribers for a test; the block starts once their consumers
    exist. On exit the subscribers shut down gracefully, as in production, and the block waits
    for them.

    :param redis: where to run: nothing for a fresh in-memory Redis (`memory_redis`; blocking
        reads are then capped at 50 ms so that the subscribers stop quickly), a Redis URL (a
        real server: it is connected like `EventBus` connects, and closed at the end), or a
        client (e.g. ``bus.redis``: the bus's own connection, left open). Afterwards the bus is
        as it was (its own connection and settings): it can be run again, or entered.
    """
    if bus.running:
        raise RuntimeError("the bus is already running")
    saved = (bus._session, bus.settings)
    if redis is None:
        bus.settings = bus.settings.model_copy(update={"block_max_ms": 50})
        bus._open_session(memory_redis(), owned=False)  # nothing to close: kept for `tb.redis`
    elif isinstance(redis, str):
        bus.settings = bus.settings.model_copy(update={"redis_url": redis})
        bus._open_session(None, owned=True)
    else:
        bus._open_session(redis, owned=False)
    bus.consumers = []  # those of an earlier run are not the ones to wait for
    stop = anyio.Event()
    tb = TestBus(bus, stop)

    async def run() -> None:
        try:
            await bus.run(stop=stop)
        finally:
            tb.done.set()

    try:
        async with bus, anyio.create_task_group() as tg:
            if bus.subscriptions:
                tg.start_soon(run)
                # `EventBus.run` creates its consumers once connected (or fails: then the task
                # group raises its error here)
                while len(bus.consumers) < len(bus.subscriptions):  # noqa: ASYNC110
                    await anyio.sleep(0.002)
            else:
                tb.done.set()
            try:
                yield tb
            finally:
                stop.set()
    finally:
        # the bus as it was: its own connection and settings (the consumers of this run stay
        # in `bus.consumers`, for inspection)
        bus._session, bus.settings = saved[0], saved[1]

"""Helpers of the integration tests: an event model, a handler that records, running buses
(`eventbus.testing.running` on each bus's own Redis), and waiting on conditions (never a fixed
sleep). Also imported by the shared cases of `tests/cases`, which run on fakeredis too."""

from __future__ import annotations

import inspect
from collections import defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import anyio
from pydantic import BaseModel

from eventbus import Context, EventBus, testing
from eventbus.testing import TestBus


class Tick(BaseModel):
    """A test event: the `seq`-th event of resource `resource`."""

    resource: str
    seq: int
    pad: str = ""


@dataclass
class Handled:
    resource: str
    seq: int
    ctx: Context


@dataclass
class Recorder:
    """Collects what handlers saw, in the order they saw it."""

    log: list[Handled] = field(default_factory=list)
    changed: anyio.Event = field(default_factory=anyio.Event)

    def add(self, event: Tick, ctx: Context) -> None:
        self.log.append(Handled(event.resource, event.seq, ctx))
        self.changed.set()
        self.changed = anyio.Event()

    def by_resource(self) -> dict[str, list[int]]:
        out: dict[str, list[int]] = defaultdict(list)
        for h in self.log:
            out[h.resource].append(h.seq)
        return dict(out)

    async def wait_for(self, count: int, within_s: float = 20) -> None:
        """Wait until at least `count` events were recorded; fail after `within_s` seconds."""
        with anyio.fail_after(within_s):
            while len(self.log) < count:
                await self.changed.wait()


async def wait_until(
    predicate: Callable[[], bool | Awaitable[bool]], within_s: float = 20, interval: float = 0.01
) -> None:
    """Poll `predicate` (sync or async) until it is true; fail after `within_s` seconds. For
    external state (Redis) that cannot be awaited directly."""
    with anyio.fail_after(within_s):
        while True:
            result = predicate()
            if inspect.isawaitable(result):
                result = await result
            if result:
                return
            await anyio.sleep(interval)


Running = TestBus
"""A bus running in the background (`eventbus.testing.TestBus`): `stop` it, wait for `done`."""


@asynccontextmanager
async def running(*buses: EventBus) -> AsyncIterator[list[Running]]:
    """Run `buses` on their own Redis (`eventbus.testing.running`), from when their consumers
    exist; on exit stop them all at once, wait for them, and close their connections."""
    try:
        async with AsyncExitStack() as stack:
            runs = [
                await stack.enter_async_context(testing.running(bus, redis=bus.redis))
                for bus in buses
            ]
            yield runs
            for run in runs:  # all at once, not one after the other as the stack unwinds
                run.stop()
    finally:
        for bus in buses:
            await bus.aclose()


async def pending_count(redis: Any, stream: str, group: str) -> int:
    """Entries of `group` on `stream` delivered but not acked (0 when the group is missing)."""
    try:
        info = await redis.xpending(stream, group)
    except Exception:
        return 0
    return int(info["pending"])


async def total_pending(bus: EventBus, topic: str, group: str, redis: Any) -> int:
    shards = bus.topic(topic).shards
    streams = [bus.keys.stream(topic, s) for s in range(shards)]
    return sum([await pending_count(redis, stream, group) for stream in streams])


async def group_lag(redis: Any, stream: str, group: str) -> int:
    """Entries of `stream` not yet delivered to `group` (XINFO GROUPS ``lag``, Redis 7)."""
    for info in await redis.xinfo_groups(stream):
        if info["name"] in (group, group.encode()):
            return int(info["lag"] or 0)
    raise AssertionError(f"group {group} missing on {stream}")


def resources_per_shard(shards: int, per_shard: int = 1, prefix: str = "res") -> list[str]:
    """Resource IDs covering every shard of a topic with `shards` shards, `per_shard` each."""
    from eventbus import shard_of

    found: dict[int, list[str]] = defaultdict(list)
    i = 0
    while any(len(found[s]) < per_shard for s in range(shards)):
        rid = f"{prefix}-{i}"
        s = shard_of(rid, shards)
        if len(found[s]) < per_shard:
            found[s].append(rid)
        i += 1
    return [rid for s in range(shards) for rid in found[s]]


def on_cluster() -> bool:
    """Whether this test runs on the Redis Cluster topology (`tests/conftest.py`)."""
    import os

    return os.environ.get("EVENTBUS_CLUSTER", "").lower() in ("1", "true", "yes")


def sync_client(url: str) -> Any:
    """A binary-safe sync client of `url`, a `redis.RedisCluster` on the cluster topology."""
    import redis

    return redis.RedisCluster.from_url(url) if on_cluster() else redis.Redis.from_url(url)


def async_client(url: str) -> Any:
    """A binary-safe asyncio client of `url`, a `RedisCluster` on the cluster topology."""
    import redis.asyncio

    if on_cluster():
        return redis.asyncio.RedisCluster.from_url(url)
    return redis.asyncio.Redis.from_url(url)

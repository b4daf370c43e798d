"""Helpers of the durable-tier integration tests."""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
from pydantic import BaseModel

from eventbus import EventBus, Settings
from eventbus.protocol.ids import EntryId, parse_id
from eventbus.tier.layout import SegmentRef
from eventbus.tier.settings import TierSettings
from eventbus.tier.store import Store, list_segments_sync, list_shards_sync


class Tick(BaseModel):
    """The `seq`-th event of resource `resource`."""

    resource: str
    seq: int
    pad: str = "x" * 100


class Tock(BaseModel):
    resource: str
    n: int


def make_bus(redis_url: str, shards: int = 4, **settings: Any) -> EventBus:
    return EventBus(Settings(redis_url=redis_url, shards=shards, **settings))


def fast_tier(**overrides: Any) -> TierSettings:
    """Small segments, no hot window, exact trims: behaviour a test can observe at once."""
    values: dict[str, Any] = {
        "segment_max_entries": 300,
        "segment_max_age_s": 0.0,
        "hot_window_s": 0.0,
        "trim_exact": True,
        "poll_interval_s": 0.02,
    }
    values.update(overrides)
    return TierSettings(**values)


async def publish_ticks(
    bus: EventBus, topic: str, count: int, resources: int = 13, start: int = 0
) -> list[str]:
    """Publish `count` Tick events over `resources` resources; returns their entry IDs."""
    events = [
        (f"res-{i % resources}", Tick(resource=f"res-{i % resources}", seq=i))
        for i in range(start, start + count)
    ]
    return await bus.publish_many(topic, events)


def all_segments(store: Store, topic: str) -> dict[int, list[SegmentRef]]:
    return {s: list_segments_sync(store, topic, s) for s in list_shards_sync(store, topic)}


def assert_no_overlap(store: Store, topic: str) -> None:
    """Segments of each shard are disjoint and in order."""
    for shard, refs in all_segments(store, topic).items():
        for a, b in itertools.pairwise(refs):
            assert a.last < b.first, f"shard {shard}: {a.key} overlaps {b.key}"


def ids(values: list[str]) -> list[EntryId]:
    return sorted(parse_id(v) for v in values)


async def wait_until(
    predicate: Callable[[], bool | Awaitable[bool]], within_s: float = 20, interval: float = 0.01
) -> None:
    """Poll `predicate` (sync or async) until true; fail after `within_s` seconds."""
    with anyio.fail_after(within_s):
        while True:
            result = predicate()
            if inspect.isawaitable(result):
                result = await result
            if result:
                return
            await anyio.sleep(interval)


class PacedPublisher:
    """Publishes `Tick` events to `topic` while a test runs: batches of `batch` events over
    `resources` resources (``res-<i mod resources>``, ``seq`` counting up from 0), `pause_s`
    seconds after each batch (pacing, not synchronisation), until `stop`. `published` holds
    (resource, seq) of every event published, in order (a test may add its own first)."""

    def __init__(
        self, bus: EventBus, topic: str, *, batch: int, resources: int, pause_s: float = 0.02
    ) -> None:
        self.bus, self.topic = bus, topic
        self.batch, self.resources, self.pause_s = batch, resources, pause_s
        self.published: list[tuple[str, int]] = []
        self._stopping, self._done = anyio.Event(), anyio.Event()

    async def run(self) -> None:
        n = 0
        try:
            while not self._stopping.is_set():
                names = [f"res-{i % self.resources}" for i in range(n, n + self.batch)]
                batch = [(r, Tick(resource=r, seq=n + k)) for k, r in enumerate(names)]
                await self.bus.publish_many(self.topic, batch)
                self.published.extend((r, ev.seq) for r, ev in batch)
                n += self.batch
                await anyio.sleep(self.pause_s)
        finally:
            self._done.set()

    async def stop(self) -> None:
        """Stop publishing; returns once the batch in flight is published."""
        self._stopping.set()
        await self._done.wait()

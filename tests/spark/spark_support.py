"""Helpers of the Spark tests: event models (importable by Spark's Python workers, which get
this folder on PYTHONPATH), publishing, offloading, and a store that counts its reads."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import anyio
from pydantic import BaseModel

from eventbus import EventBus, Settings
from eventbus.spark.objects import Objects
from eventbus.tier import TierSettings, offload_until_caught_up, open_store


class Tick(BaseModel):
    """The `seq`-th event of resource `resource`."""

    resource: str
    seq: int
    price: float = 1.5
    tags: list[str] = []


class TickV2(BaseModel):
    """`Tick` evolved: a field added with a default (another typed version of the segments)."""

    __event_type__ = "Tick"
    resource: str
    seq: int
    price: float = 1.5
    tags: list[str] = []
    venue: str | None = None


class TickPriceText(BaseModel):
    """`Tick` with ``price`` changed to a text: a column of another type in its segments."""

    __event_type__ = "Tick"
    resource: str
    seq: int
    price: str = "1.5"


class Tock(BaseModel):
    resource: str
    n: int


class Nested(BaseModel):
    name: str
    tick: Tick


def make_bus(redis_url: str, shards: int = 4, **settings: Any) -> EventBus:
    return EventBus(Settings(redis_url=redis_url, shards=shards, **settings))


def fast_tier(**overrides: Any) -> TierSettings:
    values: dict[str, Any] = {
        "segment_max_entries": 100,
        "segment_max_age_s": 0.0,
        "hot_window_s": 0.0,
        "trim_exact": True,
        "poll_interval_s": 0.02,
    }
    values.update(overrides)
    return TierSettings(**values)


def ticks(count: int, resources: int = 7, start: int = 0) -> list[tuple[str, Tick]]:
    return [
        (f"res-{i % resources}", Tick(resource=f"res-{i % resources}", seq=i))
        for i in range(start, start + count)
    ]


def publish(
    redis_url: str, topic: str, events: list[tuple[str, BaseModel]], shards: int = 4
) -> list[str]:
    """Publish `events` in order; returns their entry IDs."""

    async def go() -> list[str]:
        bus = make_bus(redis_url, shards)
        try:
            async with bus:
                return await bus.publish_many(topic, events)
        finally:
            await bus.aclose()

    return anyio.run(go)


def offload(redis_url: str, store_url: str, topic: str, shards: int = 4, **tier: Any) -> None:
    """Archive everything now in Redis (and trim it: no hot window)."""

    async def go() -> None:
        bus = make_bus(redis_url, shards)
        try:
            await offload_until_caught_up(
                bus.redis,
                open_store(store_url),
                topics=[topic],
                settings=bus.settings,
                tier=fast_tier(**tier),
                timeout_s=60,
            )
        finally:
            await bus.aclose()

    anyio.run(go)


class CountingObjects(Objects):
    """Appends the key of every object read (``get``/``get_range``) to ``<store>/../reads.log``:
    Spark tasks run in other processes, so the count goes through a file."""

    def __init__(self, url: str) -> None:
        super().__init__(open_store(url))
        self.log = Path(url).parent / "reads.log"

    def _note(self, key: str) -> None:
        with self.log.open("a") as f:
            f.write(key + "\n")
            f.flush()
            os.fsync(f.fileno())

    def get(self, key: str) -> bytes:
        self._note(key)
        return super().get(key)

    def get_range(self, key: str, start: int, end: int) -> bytes:
        self._note(key)
        return super().get_range(key, start, end)


def counting_store(url: str) -> CountingObjects:
    return CountingObjects(url)


def reads(store_url: str) -> list[str]:
    log = Path(store_url).parent / "reads.log"
    return log.read_text().split() if log.exists() else []


MOTO_ENDPOINT = Path(tempfile.gettempdir()) / f"eventbus-spark-tests-moto-{os.getuid()}"


def moto_store(url: str) -> Any:
    """An S3 store of the tests' moto server, whose endpoint the S3 test writes to a file
    (Spark's workers do not see environment variables set after the session started)."""
    from obstore.store import S3Store

    config = {
        "endpoint": MOTO_ENDPOINT.read_text().strip(),
        "region": "us-east-1",
        "access_key_id": "test",
        "secret_access_key": "test",
    }
    return S3Store.from_url(url, config=config, client_options={"allow_http": True})


class ListingObjects(CountingObjects):
    """Also notes each segment listing, ``list <shard> <after key or ->``."""

    def segments(self, topic: str, shard: int, after: Any = None) -> list[Any]:
        self._note(f"list:{shard}:{after.key if after is not None else '-'}")
        return super().segments(topic, shard, after)


def listing_store(url: str) -> ListingObjects:
    return ListingObjects(url)

"""Publishing against a real redis-server: entry IDs, shard streams, caps, limits, sync facade."""

from __future__ import annotations

import base64
import os
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any

import anyio
import pytest
import redis
import redis.asyncio
from support import Tick, on_cluster, running, sync_client, wait_until

from eventbus import (
    ConfigError,
    EventBus,
    PayloadTooLarge,
    PublishError,
    Settings,
    ShardCountMismatch,
    shard_of,
)
from eventbus.protocol.codec import F_RESOURCE, F_TYPE, decode_entry
from localredis.server import RedisServer

pytestmark = pytest.mark.anyio

SettingsFactory = Callable[..., Settings]


def _id_key(entry_id: str | bytes) -> tuple[int, int]:
    text = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    ms, seq = text.split("-")
    return int(ms), int(seq)


async def test_publish_returns_entry_id_and_writes_to_the_resource_shard(
    settings: SettingsFactory, r: redis.asyncio.Redis
) -> None:
    bus = EventBus(settings(shards=8))
    try:
        entry_id = await bus.publish(
            "orders", Tick(resource="plane-7", seq=1), resource_id="plane-7", headers={"k": "v"}
        )
        shard = shard_of("plane-7", 8)

        assert isinstance(entry_id, str)
        _id_key(entry_id)  # "<ms>-<seq>"
        for s in range(8):
            assert await r.xlen(bus.keys.stream("orders", s)) == (1 if s == shard else 0)
        [(got_id, fields)] = await r.xrange(bus.keys.stream("orders", shard))
        assert got_id.decode() == entry_id
        assert fields[F_RESOURCE] == b"plane-7" and fields[F_TYPE] == b"Tick"
        env = decode_entry(fields)
        assert env.payload == {"resource": "plane-7", "seq": 1, "pad": ""}
        assert env.headers == {"k": "v"}
        assert await r.hget(bus.keys.topics(), "orders") == b"8"
    finally:
        await bus.aclose()


async def test_publish_many_keeps_input_order_per_shard(
    settings: SettingsFactory, r: redis.asyncio.Redis
) -> None:
    bus = EventBus(settings(shards=4, publish_batch_max=7))  # several pipelines
    events = [(f"r{i % 5}", Tick(resource=f"r{i % 5}", seq=i)) for i in range(50)]
    try:
        ids = await bus.publish_many("orders", events)
    finally:
        await bus.aclose()

    assert len(ids) == 50  # entry IDs are unique per stream, not per topic
    for s in range(4):
        stored = await r.xrange(bus.keys.stream("orders", s))
        expected = [ids[i] for i, (rid, _) in enumerate(events) if shard_of(rid, 4) == s]
        assert [eid.decode() for eid, _ in stored] == expected


async def test_concurrent_publishes_on_a_running_bus_all_land(
    settings: SettingsFactory, r: redis.asyncio.Redis
) -> None:
    bus = EventBus(settings(shards=4, publish_batch_max=50))
    ids: list[str] = []

    async def one(i: int) -> None:
        ids.append(await bus.publish("orders", Tick(resource=f"r{i}", seq=i), resource_id=f"r{i}"))

    async with bus, anyio.create_task_group() as tg:
        for i in range(300):
            tg.start_soon(one, i)
    await bus.aclose()

    assert len(ids) == 300
    stored = []
    for s in range(4):
        stored += [eid.decode() for eid, _ in await r.xrange(bus.keys.stream("orders", s))]
    assert sorted(stored) == sorted(ids)


async def test_maxlen_caps_each_shard_stream_approximately(
    settings: SettingsFactory, r: redis.asyncio.Redis
) -> None:
    bus = EventBus(settings(shards=2))
    bus.topic("capped", maxlen=50)
    try:
        events = [("one", Tick(resource="one", seq=i)) for i in range(2000)]
        await bus.publish_many("capped", events)
    finally:
        await bus.aclose()

    stream = bus.keys.stream("capped", shard_of("one", 2))
    length = await r.xlen(stream)
    # MAXLEN ~ trims whole macro nodes (100 entries by default): at least the cap remains,
    # far fewer than were written
    assert 50 <= length <= 300
    info = await r.xinfo_stream(stream)
    assert info["entries-added"] == 2000
    # the newest entries are the ones kept
    last = await r.xrevrange(stream, count=1)
    assert decode_entry(last[0][1]).payload["seq"] == 1999


async def test_shard_count_mismatch_refused_by_publisher(settings: SettingsFactory) -> None:
    first, second = EventBus(settings(shards=4)), EventBus(settings(shards=8))
    try:
        await first.publish("orders", Tick(resource="a", seq=0), resource_id="a")
        with pytest.raises(ShardCountMismatch) as info:
            await second.publish("orders", Tick(resource="a", seq=1), resource_id="a")
        assert (info.value.topic, info.value.stored, info.value.configured) == ("orders", 4, 8)
        with pytest.raises(ShardCountMismatch):
            await second.publish_many("orders", [("a", Tick(resource="a", seq=2))])
        # another topic is independent
        await second.publish("other", Tick(resource="a", seq=0), resource_id="a")
    finally:
        await first.aclose()
        await second.aclose()


async def test_shard_count_mismatch_refused_by_consumer(settings: SettingsFactory) -> None:
    publisher = EventBus(settings(shards=4))
    consumer = EventBus(settings(shards=16))

    @consumer.subscriber("orders", group="g")
    async def handle(event: Tick) -> None:
        raise AssertionError("must not run")

    try:
        await publisher.publish("orders", Tick(resource="a", seq=0), resource_id="a")
        with anyio.fail_after(10), pytest.raises(ShardCountMismatch):
            await consumer.run()
    finally:
        await publisher.aclose()
        await consumer.aclose()


async def test_oversized_event_is_refused_and_nothing_is_written(
    settings: SettingsFactory, r: redis.asyncio.Redis
) -> None:
    bus = EventBus(settings(shards=2, max_payload_bytes=2000))
    noise = base64.b64encode(os.urandom(3000)).decode()  # does not compress below the limit
    try:
        with pytest.raises(PayloadTooLarge) as info:
            await bus.publish("orders", Tick(resource="a", seq=0, pad=noise), resource_id="a")
        assert info.value.size > 2000 and info.value.limit == 2000
        with pytest.raises(PayloadTooLarge):
            await bus.publish_many(
                "orders",
                [("a", Tick(resource="a", seq=1)), ("a", Tick(resource="a", seq=2, pad=noise))],
            )
        for s in range(2):
            assert await r.xlen(bus.keys.stream("orders", s)) == 0
        # a large but compressible event is fine: the limit applies to the encoded size
        await bus.publish("orders", Tick(resource="a", seq=3, pad="x" * 10_000), resource_id="a")
    finally:
        await bus.aclose()


@pytest.mark.parametrize("resource_id", ["", None, 5])
async def test_bad_resource_id_or_event_refused(
    settings: SettingsFactory, resource_id: object
) -> None:
    bus = EventBus(settings())
    try:
        with pytest.raises(ConfigError):
            await bus.publish("orders", Tick(resource="a", seq=0), resource_id=resource_id)  # type: ignore[arg-type]
        with pytest.raises(ConfigError):
            await bus.publish("orders", {"resource": "a"}, resource_id="a")  # type: ignore[arg-type]
    finally:
        await bus.aclose()


def test_sync_facade_publishes_from_threads(redis_db: str, settings: SettingsFactory) -> None:
    bus = EventBus(settings(shards=4))
    client = sync_client(redis_db)
    per_thread = 25

    with bus.sync() as sb:

        def worker(t: int) -> list[str]:
            assert threading.current_thread() is not threading.main_thread()
            rid = f"thread-{t}"
            return [
                sb.publish("web", Tick(resource=rid, seq=i), resource_id=rid)
                for i in range(per_thread)
            ]

        with ThreadPoolExecutor(4) as pool:
            results = list(pool.map(worker, range(4)))

    for t, ids in enumerate(results):
        rid = f"thread-{t}"
        stream = bus.keys.stream("web", shard_of(rid, 4))
        stored = [
            (eid.decode(), decode_entry(f).payload["seq"])
            for eid, f in client.xrange(stream)
            if f[F_RESOURCE] == rid.encode()
        ]
        # each thread's calls are sequential, so its events are stored in call order
        assert stored == list(zip(ids, range(per_thread), strict=True))
    client.close()


async def test_running_bus_sends_queued_publishes_before_closing(
    settings: SettingsFactory, r: redis.asyncio.Redis
) -> None:
    bus = EventBus(settings(shards=1))

    @bus.subscriber("t", group="g")
    async def handle(event: Tick) -> None: ...

    async with running(bus) as [run]:
        ids = await bus.publish_many("t", [("a", Tick(resource="a", seq=i)) for i in range(3)])
        run.stop()
        await run.done.wait()
    assert [e.decode() for e, _ in await r.xrange(bus.keys.stream("t", 0))] == ids


class CountingRedis(redis.asyncio.Redis):
    """A real client that counts the commands it sends."""

    calls: Counter[str]

    async def execute_command(self, *args: Any, **options: Any) -> Any:
        self.calls[str(args[0]).upper()] += 1
        return await super().execute_command(*args, **options)


class CountingCluster(redis.asyncio.RedisCluster):
    """The same on the cluster topology."""

    calls: Counter[str]

    async def execute_command(self, *args: Any, **options: Any) -> Any:
        self.calls[str(args[0]).upper()] += 1
        return await super().execute_command(*args, **options)


async def test_concurrent_first_publishes_share_one_topic_check(
    settings: SettingsFactory, redis_db: str
) -> None:
    client = (CountingCluster if on_cluster() else CountingRedis).from_url(redis_db)
    client.calls = Counter()
    bus = EventBus(settings(shards=4), redis=client)
    async with bus, anyio.create_task_group() as tg:
        for i in range(50):
            tg.start_soon(partial(bus.publish, "t", Tick(resource="a", seq=i), resource_id="a"))
    await bus.aclose()
    assert client.calls["HSETNX"] == 1


async def test_publish_while_redis_is_down_fails_with_publish_error() -> None:
    with RedisServer() as server:
        bus = EventBus(Settings(redis_url=server.url, publish_timeout_s=0.5))
        server.stop()
        started = time.monotonic()
        with pytest.raises(PublishError):  # the topic check, then the XADD, both retried
            await bus.publish("t", Tick(resource="a", seq=0), resource_id="a")
        assert time.monotonic() - started < 5
        await bus.aclose()


async def test_publish_rides_through_a_redis_restart(caplog: pytest.LogCaptureFixture) -> None:
    """The first publish of a topic finds Redis down; it retries (topic check and XADD) and
    succeeds once Redis is back, within `publish_timeout_s`."""
    with RedisServer(appendonly="always") as server:
        bus = EventBus(Settings(redis_url=server.url, publish_timeout_s=30))
        server.stop()
        async with anyio.create_task_group() as tg:
            result: list[str] = []

            async def publish() -> None:
                result.append(await bus.publish("t", Tick(resource="a", seq=0), resource_id="a"))

            tg.start_soon(publish)
            await wait_until(lambda: "retry in" in caplog.text)  # it has met the outage
            await anyio.to_thread.run_sync(server.start)
        await bus.aclose()
        with redis.Redis.from_url(server.url) as client:
            [(entry_id, _)] = client.xrange(bus.keys.stream("t", shard_of("a", 16)))
        assert result == [entry_id.decode()]

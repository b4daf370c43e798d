"""A live consumer with an archive catches its group up by itself: entries trimmed from Redis
before the group read them are handled from segments, in order, before anything newer."""

from __future__ import annotations

from collections import defaultdict

import anyio
import pytest
from tier_support import Tick, fast_tier, make_bus, wait_until

from eventbus import Context, EventBus
from eventbus.tier.offloader import Offloader
from eventbus.tier.store import open_store

pytestmark = [pytest.mark.anyio, pytest.mark.integration]

SHARDS = 4


async def test_consumer_with_archive_catches_up_then_reads_redis(
    redis_db: str, store_url: str
) -> None:
    store = open_store(store_url)
    publisher = make_bus(redis_db, shards=SHARDS)
    seen: list[tuple[str, int]] = []

    def consumer_bus(archive: object | None) -> EventBus:
        bus = EventBus(publisher.settings, archive=archive)

        @bus.subscriber("flow", group="late")
        async def on_tick(event: Tick, ctx: Context) -> None:
            seen.append((event.resource, event.seq))

        return bus

    old = [(f"res-{i % 13}", Tick(resource=f"res-{i % 13}", seq=i)) for i in range(1500)]
    async with publisher:
        for s in range(SHARDS):  # the group exists from the start but nobody reads
            await publisher.redis.xgroup_create(
                publisher.keys.stream("flow", s), "late", id="0", mkstream=True
            )
        await publisher.publish_many("flow", old)
        offloader = Offloader(publisher.redis, store, settings=publisher.settings, tier=fast_tier())
        await offloader.run_until_caught_up(timeout_s=60)
        lengths = [await publisher.redis.xlen(publisher.keys.stream("flow", s)) for s in range(4)]
        assert sum(lengths) < len(old)  # most of the group's entries now live only in segments

        bus = consumer_bus(store)
        stop = anyio.Event()
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: bus.run(stop=stop))
            await wait_until(lambda: len(seen) >= len(old), within_s=60)
            new = [
                (f"res-{i % 13}", Tick(resource=f"res-{i % 13}", seq=i)) for i in range(1500, 1600)
            ]
            await publisher.publish_many("flow", new)
            await wait_until(lambda: len(seen) >= len(old) + len(new), within_s=30)
            stop.set()
    await bus.aclose()
    await publisher.aclose()

    assert len(seen) == len(set(seen)) == 1600, "an event was lost or handled twice"
    order: dict[str, list[int]] = defaultdict(list)
    for rid, seq in seen:
        order[rid].append(seq)
    assert all(seqs == sorted(seqs) for seqs in order.values()), "per-resource order broken"


async def test_without_archive_trimmed_entries_are_skipped(redis_db: str, tmp_path) -> None:
    """The contrast that makes the test above meaningful: the same setup without an archive
    handles only what is still in Redis."""
    store = open_store(str(tmp_path / "segments"))
    bus = make_bus(redis_db, shards=SHARDS)
    seen: list[int] = []

    @bus.subscriber("flow", group="late")
    async def on_tick(event: Tick) -> None:
        seen.append(event.seq)

    async with bus:
        for s in range(SHARDS):
            await bus.redis.xgroup_create(bus.keys.stream("flow", s), "late", id="0", mkstream=True)
        await bus.publish_many(
            "flow", [(f"r{i}", Tick(resource=f"r{i}", seq=i)) for i in range(600)]
        )
        await Offloader(
            bus.redis, store, settings=bus.settings, tier=fast_tier()
        ).run_until_caught_up(timeout_s=60)
        in_redis = sum([await bus.redis.xlen(bus.keys.stream("flow", s)) for s in range(SHARDS)])
        stop = anyio.Event()
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: bus.run(stop=stop))
            await wait_until(lambda: len(seen) >= in_redis, within_s=30)
            stop.set()
    await bus.aclose()
    assert len(seen) == in_redis < 600

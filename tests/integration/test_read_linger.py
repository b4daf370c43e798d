"""`read_linger_ms`: after a read that got entries but filled no shard's `read_count`, the
consumer waits before its next read (Kafka's ``fetch.max.wait.ms`` trade), never after a full
read, and never past a stop."""

from __future__ import annotations

import time
from collections.abc import Callable

import anyio
import pytest
from support import Tick, running, wait_until

from eventbus import EventBus, Settings

pytestmark = pytest.mark.anyio
SettingsFactory = Callable[..., Settings]


async def test_after_a_short_read_the_next_read_waits_the_linger(
    settings: SettingsFactory,
) -> None:
    s = settings(shards=1, read_linger_ms=2000, block_min_ms=10, block_max_ms=50)
    bus, publisher = EventBus(s), EventBus(s)
    handled: dict[int, float] = {}

    @bus.subscriber("lingering", group="g")
    async def handle(event: Tick) -> None:
        handled[event.seq] = time.monotonic()

    async with publisher, running(bus):
        await publisher.publish("lingering", Tick(resource="a", seq=0), resource_id="a")
        await wait_until(lambda: 0 in handled)
        await publisher.publish("lingering", Tick(resource="a", seq=1), resource_id="a")
        await wait_until(lambda: 1 in handled, within_s=30)
    # the read that got seq 0 was short: the next one starts 2 s after it (seq 0's handler ran
    # after that read, so at most its scheduling delay after the linger began)
    assert handled[1] - handled[0] >= 1.0


async def test_a_full_read_is_followed_by_the_next_read_at_once(settings: SettingsFactory) -> None:
    s = settings(shards=1, read_count=2, read_linger_ms=60_000)
    bus, publisher = EventBus(s), EventBus(s)
    handled: list[int] = []

    @bus.subscriber("full", group="g")
    async def handle(event: Tick) -> None:
        handled.append(event.seq)

    async with publisher:
        await publisher.publish_many("full", [("a", Tick(resource="a", seq=i)) for i in range(6)])
    async with running(bus):
        # three full reads of 2: no linger between them (one would hold the rest for 60 s)
        with anyio.fail_after(20):
            await wait_until(lambda: len(handled) == 6, within_s=20)
    assert handled == list(range(6))


async def test_a_stop_ends_the_linger(settings: SettingsFactory) -> None:
    s = settings(shards=1, read_linger_ms=60_000)
    bus, publisher = EventBus(s), EventBus(s)
    handled: list[int] = []

    @bus.subscriber("stopping", group="g")
    async def handle(event: Tick) -> None:
        handled.append(event.seq)

    stop = anyio.Event()
    async with publisher:
        with anyio.fail_after(30):  # the consumer stops long before its 60 s linger ends
            async with anyio.create_task_group() as tg:
                tg.start_soon(lambda: bus.run(stop=stop))
                await publisher.publish("stopping", Tick(resource="a", seq=0), resource_id="a")
                await wait_until(lambda: handled == [0], within_s=20)
                stop.set()  # the consumer is in its linger now

"""How far a consumer reads ahead of its handlers (real Redis): one shard's read-ahead is bounded
by its reads, not by the consumer-wide `max_in_flight` (review30 F3)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from support import Tick, pending_count, running, wait_until

from eventbus import EventBus, Settings

pytestmark = pytest.mark.anyio
SettingsFactory = Callable[..., Settings]


async def test_a_hot_shard_reads_at_most_two_reads_ahead(settings: SettingsFactory, r: Any) -> None:
    # every event of one resource: one shard gets all of them, handled one after the other,
    # each handler reading the shards' PELs (read and not acked: what a hand-over waits for)
    s = settings(read_count=50, max_in_flight=100_000, block_max_ms=20)
    bus, publisher = EventBus(s), EventBus(s)
    streams = [bus.keys.stream("hot", i) for i in range(s.shards)]
    most = 0
    handled = 0

    @bus.subscriber("hot", group="g")
    async def handle(event: Tick) -> None:
        nonlocal most, handled
        for stream in streams:
            most = max(most, await pending_count(r, stream, "g"))
        handled += 1

    async with publisher:
        events = [("plane-1", Tick(resource="plane-1", seq=i)) for i in range(1000)]
        await publisher.publish_many("hot", events)
    async with running(bus):
        await wait_until(lambda: handled == 1000, within_s=60)
    # read while at most one read (50) is in flight: at most two reads' worth pending; the
    # consumer-wide cap alone let the reads run ~1,000 ahead
    assert 0 < most <= 2 * 50

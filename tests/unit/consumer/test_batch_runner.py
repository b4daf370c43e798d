"""A batch subscription's worker step (`eventbus.consumer.batching.BatchRunner.run`) on a lost
shard's batch: let go (finished, not acked) without decoding it. No Redis (in-memory)."""

from __future__ import annotations

import pytest
from pydantic import BaseModel

from eventbus import Context, EventBus, Settings
from eventbus.consumer import Consumer
from eventbus.consumer.running import make_consumers
from eventbus.consumer.shards import HeldShard, read_items
from eventbus.consumer.watchdog import Watchdog
from eventbus.protocol.codec import encode_entry, envelope_of
from eventbus.protocol.topics import TopicRegistry
from eventbus.testing import memory_redis

pytestmark = pytest.mark.anyio


class Tick(BaseModel):
    resource: str
    seq: int


def batch_consumer(calls: list[int]) -> Consumer:
    bus = EventBus(Settings(redis_url="redis://in-memory", shards=1))

    @bus.subscriber("orders", group="billing", batch=True, max_batch=10)
    async def handle(events: list[Tick], ctxs: list[Context]) -> None:
        calls.append(len(events))

    redis = memory_redis()
    [c] = make_consumers(
        bus.subscriptions, redis, bus.keys, bus.settings, TopicRegistry(redis, bus.keys)
    )
    assert isinstance(c, Consumer)
    return c


async def test_a_lost_shards_batch_is_let_go_undecoded() -> None:
    calls: list[int] = []
    c = batch_consumer(calls)
    held = HeldShard(shard=0, stream=c.ownership.table.streams[0], token=1, generation=1)
    entries = [
        (f"{i}-0".encode(), encode_entry(envelope_of("r", Tick(resource="r", seq=i))))
        for i in range(3)
    ]
    items = read_items(held, entries, None)
    c.pipeline.acks.started(held, len(items))
    held.lost = True  # the shard went to another consumer while its batch was queued
    await c.pipeline._work(items, Watchdog(None).slot())
    assert calls == []
    assert [item.event for item in items] == [None, None, None]  # never decoded
    assert (c.pipeline.acks.in_flight, held.in_flight) == (0, 0)  # finished: let go, not acked

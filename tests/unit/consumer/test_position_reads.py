"""The broadcast's reader (`position_reads.PositionReader`): plain ``XREAD`` after the open
ownership's positions, which move on with what it read; on a Cluster each stream is read on its
own (here on the in-memory server, whose single node serves per-stream reads alike)."""

from __future__ import annotations

import anyio
import pytest

from eventbus import EventBus, Settings
from eventbus.consumer.broadcast import BroadcastConsumer
from eventbus.consumer.position_reads import PositionReader
from eventbus.locking.member import Member
from eventbus.profiles import EVENTBUS
from eventbus.protocol.topics import TopicRegistry
from eventbus.testing import memory_redis

pytestmark = pytest.mark.anyio


async def started(**settings: int) -> tuple[BroadcastConsumer, PositionReader]:
    """A broadcast consumer of topic "config" (2 shards, in memory) that took its start
    positions (the streams do not exist yet: both at 0-0), and its reader."""
    bus = EventBus(Settings(redis_url="redis://in-memory", shards=2, **settings))

    @bus.subscriber("config", broadcast=True)
    async def handle(event: dict) -> None:  # type: ignore[type-arg]
        pass

    [sub] = bus.subscriptions
    redis = memory_redis()
    member = Member(redis, bus.keys, bus.settings, "config", sub.group, "c-1", EVENTBUS)
    c = BroadcastConsumer(member, TopicRegistry(redis, bus.keys), sub)
    await c.ownership.start()
    reader = c.pipeline.reader
    assert isinstance(reader, PositionReader)
    return c, reader


@pytest.mark.parametrize("cluster", [False, True], ids=["one XREAD", "one per stream"])
async def test_a_read_takes_what_follows_the_positions_and_moves_them_on(cluster: bool) -> None:
    c, reader = await started(read_count=2)
    reader.cluster = cluster
    own = c.ownership
    first, second = own.table.streams
    for i in range(3):
        await reader.redis.xadd(first, {"n": str(i)}, id=f"{i + 1}-0")
    shards = list(own.table.held.values())

    reads = await reader.read(shards, block_ms=1)
    assert [(r.stream, [e[0] for e in r.entries]) for r in reads] == [
        (first.encode(), [b"1-0", b"2-0"])  # `count` at most; nothing of the empty stream
    ]
    assert own.positions[first] == b"2-0" and own.positions[second] == b"0-0"
    assert own.gaps.read[first] == 2

    [read] = await reader.read(shards, block_ms=1)
    assert [e[0] for e in read.entries] == [b"3-0"] and own.positions[first] == b"3-0"
    assert await reader.read(shards, block_ms=1) == []


async def test_on_a_cluster_the_first_stream_with_entries_ends_the_blocked_reads() -> None:
    """Every stream blocks on its own; an entry added to one ends the round, the others'
    reads cancelled with their positions unmoved."""
    c, reader = await started()
    reader.cluster = True
    own = c.ownership
    first, second = own.table.streams
    shards = list(own.table.held.values())
    got = []

    async def read() -> None:
        got.extend(await reader.read(shards, block_ms=600_000))

    with anyio.fail_after(30):  # (a round that waited for every block would not end here)
        async with anyio.create_task_group() as tg:
            tg.start_soon(read)
            await anyio.wait_all_tasks_blocked()
            await reader.redis.xadd(second, {"n": "0"}, id="5-0")
    assert [(r.stream, len(r.entries)) for r in got] == [(second.encode(), 1)]
    assert own.positions == {first: b"0-0", second: b"5-0"}

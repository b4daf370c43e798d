"""`eventbus.testing.drain`: the in-memory server's stream state read without a command equals
what Redis answers to XINFO, and a bus counts as drained only once every group and broadcast
reader has read and acked every entry, whoever added it."""

from __future__ import annotations

import pytest
from pydantic import BaseModel

from eventbus import EventBus
from eventbus.testing import memory_redis, running
from eventbus.testing.drain import StreamState, Watch, behind, memory_streams, redis_streams

pytestmark = pytest.mark.anyio


class Ping(BaseModel):
    n: int


async def test_the_memory_reader_sees_what_xinfo_answers() -> None:
    r = memory_redis()
    for s in ("s0", "s1"):
        for n in range(3):
            await r.xadd(s, {"n": n})
    await r.xgroup_create("s0", "g", id="0")
    await r.xgroup_create("s1", "g", id="$")
    await r.xgroup_create("s1", "h", id="0")
    await r.xreadgroup("g", "c", {"s0": ">"}, count=2)
    first = (await r.xrange("s0", count=1))[0][0]
    await r.xack("s0", "g", first)
    await r.xreadgroup("h", "c", {"s1": ">"})
    await r.xdel("s1", (await r.xrevrange("s1", count=1))[0][0])
    at_end = [("reader", lambda: b"0-0")]  # a broadcast reader: the last entry is read too
    watches = [Watch("s0", ["g"]), Watch("s1", ["g", "h"], at_end), Watch("missing", ["g"])]

    read = memory_streams(r)

    assert read is not None
    assert read(watches) == await redis_streams(r, watches)
    assert read(watches)["s0"].groups["g"][1] == 1  # one entry read, not acked
    assert read(watches)["missing"] == StreamState(None)
    assert read(watches)["s1"].last > read(watches)["s1"].last_entry  # the last one deleted


def test_a_real_client_has_no_memory_reader() -> None:
    import redis.asyncio

    assert memory_streams(redis.asyncio.Redis()) is None


def test_behind_names_each_reader_not_done() -> None:
    state = StreamState((5, 0), (5, 0), {"done": ((5, 0), 0), "pending": ((5, 0), 1)})
    state.groups["late"] = ((4, 0), 0)
    watches = [
        Watch(
            "s",
            ["done", "pending", "late", "absent"],
            [("b1", lambda: b"5-0"), ("b2", lambda: b"4-1")],
        ),
        Watch("empty", ["absent"]),
    ]

    reasons = behind(watches, {"s": state, "empty": StreamState(None)})

    assert reasons == [
        "s group pending",
        "s group late",
        "s group absent",
        "s broadcast b2",
    ]


def _many_topics(topics: int, seen: list[int]) -> EventBus:
    bus = EventBus()
    for t in range(topics):
        bus.topic(f"t{t}", shards=16)

        @bus.subscriber(f"t{t}", group="g")
        async def handle(event: Ping) -> None:
            seen.append(event.n)

    return bus


async def test_drain_waits_for_entries_of_any_client_on_every_topic() -> None:
    seen: list[int] = []
    bus = _many_topics(8, seen)
    async with running(bus, fail_fast=True) as tb:
        await tb.drain()  # nothing published: drained at once
        for t in range(8):
            await tb.publish(f"t{t}", Ping(n=t), resource_id=f"r{t}")
        await tb.drain()
        assert sorted(seen) == list(range(8))
        # an entry added by another client than the bus is waited for too
        foreign = EventBus(bus.settings, redis=tb.redis)
        foreign.topic("t3", shards=16)
        await foreign.publish("t3", Ping(n=99), resource_id="x")
        await tb.drain()
        assert 99 in seen

"""No silent trim: entries that ``MAXLEN`` trimmed before the group read them are
detected by the consumer, logged, counted and recorded, both when they are still ahead of the
group and after it read past them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import anyio
import pytest
import redis.asyncio
from redis.asyncio.cluster import RedisCluster
from support import Recorder, Tick, running, wait_until
from typer.testing import CliRunner

from eventbus import EventBus, Settings
from eventbus.cli import app
from eventbus.ops.metrics import METRICS

pytestmark = pytest.mark.anyio


async def _records(r: redis.asyncio.Redis, bus: EventBus) -> list[dict[bytes, bytes]]:
    return [f for _, f in await r.xrange(bus.keys.trimmed("t", "g"))]


def _metric() -> float:
    return METRICS.trimmed_unread.labels("t", "g")._value.get()


async def _calls(r: Any, command: str) -> int:
    """Calls of `command` so far on the server (every node of a Cluster): INFO commandstats."""
    if isinstance(r, RedisCluster):
        nodes = list((await r.info("commandstats", target_nodes=RedisCluster.ALL_NODES)).values())
    else:
        nodes = [await r.info("commandstats")]
    return sum(int(n.get(f"cmdstat_{command}", {}).get("calls", 0)) for n in nodes)


async def _publish(bus: EventBus, rid: str, seqs: range) -> None:
    for i in seqs:
        await bus.publish("t", Tick(resource=rid, seq=i), resource_id=rid)


async def _backlog_while_down(
    settings: Callable[..., Settings], shards: int, *backlog: tuple[str, range]
) -> EventBus:
    """Group g of topic t (`shards` shards) exists, its consumer handled event ("a", 0) and
    stopped; then `backlog` (resource, seqs) is published while no consumer of g runs. Returns
    the (closed) bus that published it."""
    rec = Recorder()
    bus = EventBus(settings(shards=shards))
    bus.subscriber("t", group="g")(rec.add)
    async with running(bus):
        await _publish(bus, "a", range(1))
        await rec.wait_for(1)
    async with bus:
        for rid, seqs in backlog:
            await _publish(bus, rid, seqs)
    return bus


async def test_entries_trimmed_while_no_consumer_ran_are_reported_before_reading_past_them(
    settings: Callable[..., Settings], r: redis.asyncio.Redis
) -> None:
    before = _metric()
    bus = await _backlog_while_down(settings, 1, ("a", range(1, 21)))
    # trimmed exactly: 15 of the 20 entries the group never read
    await r.xtrim(bus.keys.stream("t", 0), maxlen=5, approximate=False)
    rec2 = Recorder()
    bus2 = EventBus(settings(shards=1))
    bus2.subscriber("t", group="g")(rec2.add)
    async with running(bus2):
        await rec2.wait_for(5)
        await wait_until(lambda: _records(r, bus2))
    [record] = await _records(r, bus2)
    assert int(record[b"count"]) == 15 and record[b"ahead"] == b"1"
    assert _metric() - before == 15
    assert [h.seq for h in rec2.log] == list(range(16, 21))
    runner = CliRunner(env={"COLUMNS": "200"})
    args = ["stats", "--redis-url", bus2.settings.redis_url]
    stats = await anyio.to_thread.run_sync(lambda: runner.invoke(app, args))
    assert stats.exit_code == 0, stats.output
    row = next(line for line in stats.output.splitlines() if "│ g " in line)
    assert row.rstrip(" │").split()[-1] == "15"  # the trimmed column


async def test_entries_trimmed_under_a_running_consumer_are_reported(
    settings: Callable[..., Settings], r: redis.asyncio.Redis
) -> None:
    """The consumer falls behind (its handler blocks, its in-flight cap stops its reads), the
    stream is trimmed past what it read: it reports what it lost before or after reading on."""
    before = _metric()
    gate = anyio.Event()
    seen: list[int] = []

    bus = EventBus(settings(shards=1, max_in_flight=2, read_count=1, trim_check_s=0.05))

    @bus.subscriber("t", group="g")
    async def handle(event: Tick) -> None:
        seen.append(event.seq)
        await gate.wait()

    async with running(bus):
        await _publish(bus, "b", range(30))
        await wait_until(lambda: len(seen) == 1)
        await r.xtrim(bus.keys.stream("t", 0), maxlen=5, approximate=False)
        gate.set()
        await wait_until(lambda: len(seen) >= 7)
        await wait_until(lambda: _metric() - before > 0)
    # read: 0 and 1 (the in-flight cap); trimmed unread: 2..24; handled after: 25..29
    assert _metric() - before == 23
    assert sum(int(f[b"count"]) for f in await _records(r, bus)) == 23
    assert seen == [0, 1, *range(25, 30)]


async def test_a_backlog_nothing_was_trimmed_from_is_not_fetched_to_be_counted(
    settings: Callable[..., Settings], r: redis.asyncio.Redis
) -> None:
    """A consumer taking shards with a backlog checks them for trims without ``XRANGE`` when
    nothing ever left the streams (``entries-added`` equals ``length``): it used to fetch and
    parse the whole backlog, one round trip per shard, at every check (the bench's 60k-entry
    backlog: a second read of every entry)."""
    before = _metric()
    await _backlog_while_down(settings, 2, ("a", range(1, 31)), ("b", range(30)))
    ranges = await _calls(r, "xrange")
    rec2 = Recorder()
    bus2 = EventBus(settings(shards=2, trim_check_s=0.01))  # checked while it reads, too
    bus2.subscriber("t", group="g")(rec2.add)
    async with running(bus2):
        await rec2.wait_for(60)
    assert await _calls(r, "xinfo|groups") >= 2  # the shards were checked
    assert await _calls(r, "xrange") == ranges
    assert _metric() == before
    assert not await r.exists(bus2.keys.trimmed("t", "g"))
    assert sorted((h.resource, h.seq) for h in rec2.log) == sorted(
        [("a", i) for i in range(1, 31)] + [("b", i) for i in range(30)]
    )


async def test_the_lag_gauge_is_nan_while_redis_cannot_compute_the_lag(
    settings: Callable[..., Settings], r: redis.asyncio.Redis
) -> None:
    # fix33's note: a lag Redis reports as null (an XDEL of an entry the group has not read)
    # left the gauge at its last value, which looked current
    import math

    from eventbus.consumer.shards import HeldShard
    from eventbus.consumer.trims import TrimWatch
    from eventbus.locking.member import Member
    from eventbus.profiles import EVENTBUS

    s = settings(shards=1)
    bus = EventBus(s)
    stream = bus.keys.stream("t", 0)
    gauge = METRICS.lag.labels("t", "g", 0)
    async with bus:
        await _publish(bus, "a", range(3))
        await r.xgroup_create(stream, "g", id="0")
        watch = TrimWatch(Member(bus.redis, bus.keys, s, "t", "g", "c", EVENTBUS))
        held = HeldShard(0, stream, token=1, generation=1)
        await watch.check([held])
        assert gauge._value.get() == 3  # Redis knows it: nothing read
        middle = (await r.xrange(stream))[1][0]
        await r.xdel(stream, middle)  # unread, deleted: Redis reports no lag
        assert (await r.xinfo_groups(stream))[0]["lag"] is None
        await watch.check([held])
    await bus.aclose()
    assert math.isnan(gauge._value.get())


async def test_a_caught_up_shard_whose_stream_did_not_change_is_not_asked_its_groups(
    settings: Callable[..., Settings], r: Any
) -> None:
    """``XINFO GROUPS`` lists every group of the stream: with many idle groups on a topic each
    check paid for all of them. A group that had read everything (lag 0) on a stream nothing was
    added to, trimmed from or deleted from since has lost nothing: only ``XINFO STREAM``."""
    rec = Recorder()
    bus = EventBus(settings(shards=1, trim_check_s=0.02))
    bus.subscriber("t", group="g")(rec.add)

    async def checks_later(n: int) -> None:
        target = await _calls(r, "xinfo|stream") + n
        with anyio.fail_after(30):
            while await _calls(r, "xinfo|stream") < target:  # noqa: ASYNC110
                await anyio.sleep(0.01)

    async with running(bus):
        await _publish(bus, "a", range(3))
        await rec.wait_for(3)
        await checks_later(5)  # (the acks are in, a check saw lag 0)
        asked = await _calls(r, "xinfo|groups")
        await checks_later(5)
        assert await _calls(r, "xinfo|groups") == asked
        await r.xtrim(bus.keys.stream("t", 0), maxlen=1, approximate=False)
        await checks_later(2)
        assert await _calls(r, "xinfo|groups") > asked  # the stream changed: asked again

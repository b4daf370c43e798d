"""Consuming against a real redis-server only: per-resource order while shards change hands
between several consumers under load, the fair share with a newcomer, 64 shards over two
consumers, the idle backoff counted on a real connection. The other consume cases run on
fakeredis and on redis-server alike: `tests/cases/consume_cases.py`."""

from __future__ import annotations

import contextlib
import random
from collections import Counter
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
import pytest
import redis.asyncio
from support import (
    Recorder,
    Tick,
    resources_per_shard,
    running,
    total_pending,
    wait_until,
)

from eventbus import Context, EventBus, Settings

pytestmark = pytest.mark.anyio

SettingsFactory = Callable[..., Settings]


async def _no_pending(bus: EventBus, topic: str, group: str, r: redis.asyncio.Redis) -> bool:
    return await total_pending(bus, topic, group, r) == 0


async def test_order_per_resource_with_three_consumers(
    settings: SettingsFactory, r: redis.asyncio.Redis
) -> None:
    """Three buses of one group; events published while they run, with handlers of uneven
    speed, so shards change hands between consumers. Every resource's events must be handled
    exactly once each, in publish order."""
    resources, per_resource = 40, 25
    s = settings(shards=8, block_max_ms=50, read_count=20)
    buses = [EventBus(s) for _ in range(3)]
    rec = Recorder()
    rng = random.Random(7)
    running_now: set[str] = set()
    overlaps: list[str] = []

    for bus in buses:

        @bus.subscriber("flights", group="ordered")
        async def handle(event: Tick, ctx: Context) -> None:
            if event.resource in running_now:  # another handler of this resource is running
                overlaps.append(event.resource)
            running_now.add(event.resource)
            try:
                if rng.random() < 0.2:
                    await anyio.sleep(rng.uniform(0, 0.003))  # uneven handler time
                rec.add(event, ctx)
            finally:
                running_now.discard(event.resource)

    publisher = EventBus(s)
    members = buses[0].keys.members("flights", "ordered")
    async with publisher, running(*buses):
        await wait_until(lambda: _zcard_is(r, members, 3))
        # and their lock rounds (every lock_interval_ms) have shared the shards out
        await wait_until(lambda: _owners_are(r, buses[0].keys.locks("flights", "ordered"), 3))
        events = [
            (f"plane-{res}", Tick(resource=f"plane-{res}", seq=seq))
            for seq in range(per_resource)
            for res in range(resources)
        ]
        for i in range(0, len(events), 100):  # in bursts, while the consumers run
            await publisher.publish_many("flights", events[i : i + 100])
            await rec.wait_for(i // 2)
        await rec.wait_for(len(events), within_s=60)
        await wait_until(lambda: _no_pending(buses[0], "flights", "ordered", r))
    await publisher.aclose()

    assert overlaps == []
    assert rec.by_resource() == {
        f"plane-{res}": list(range(per_resource)) for res in range(resources)
    }
    handled_by = Counter(h.ctx.consumer_id for h in rec.log)
    assert len(handled_by) >= 2, handled_by  # the work was shared


async def _zcard_is(r: redis.asyncio.Redis, key: str, n: int) -> bool:
    return await r.zcard(key) == n


async def _lock_owners(r: redis.asyncio.Redis, locks: str) -> Counter[str]:
    """Consumer ID -> shard locks it holds, from the lock hash `locks` (``<shard>`` fields)."""
    return Counter(v.decode() for k, v in (await r.hgetall(locks)).items() if b":" not in k)


async def _owners_are(r: redis.asyncio.Redis, locks: str, n: int) -> bool:
    """Whether `n` consumers hold the shard locks of the lock hash `locks`."""
    return len(await _lock_owners(r, locks)) == n


async def test_busy_consumer_yields_its_surplus_to_a_newcomer(
    settings: SettingsFactory, r: redis.asyncio.Redis
) -> None:
    """A consumer holding every shard of a busy topic releases those above its fair share once
    a second consumer joins; they end up with ceil(4 / 2) = 2 shards each, order intact."""
    # a backlog larger than the first consumer may read ahead (max_in_flight), as in production:
    # what it has read of a surplus shard it handles before releasing it
    s = settings(shards=4, read_count=5, block_max_ms=50, max_in_flight=20)
    resources = resources_per_shard(4, per_shard=2)
    per_resource = 60
    first, second = EventBus(s), EventBus(s)
    rec = Recorder()
    for bus in (first, second):

        @bus.subscriber("busy", group="g")
        async def handle(event: Tick, ctx: Context) -> None:
            await anyio.sleep(0.002)  # a handler that takes a little time: keeps shards busy
            rec.add(event, ctx)

    await first.publish_many(
        "busy",
        [(rid, Tick(resource=rid, seq=seq)) for seq in range(per_resource) for rid in resources],
    )
    locks = first.keys.locks("busy", "g")
    async with running(first) as [run_first]:
        first_id = run_first.consumer_ids[0]
        await wait_until(lambda: _owner_counts_are(r, locks, {first_id: 4}))
        async with running(second) as [run_second]:
            second_id = run_second.consumer_ids[0]
            await wait_until(lambda: _owner_counts_are(r, locks, {first_id: 2, second_id: 2}))
            await rec.wait_for(len(resources) * per_resource, within_s=60)

    assert rec.by_resource() == {rid: list(range(per_resource)) for rid in resources}
    by_consumer = Counter(h.ctx.consumer_id for h in rec.log)
    assert by_consumer[second_id] > 0 and by_consumer[first_id] > 0


async def _owner_counts_are(r: redis.asyncio.Redis, locks: str, want: dict[str, int]) -> bool:
    return dict(await _lock_owners(r, locks)) == want


async def test_sixty_four_shards(settings: SettingsFactory, r: redis.asyncio.Redis) -> None:
    """More shards than a 32-bit mask could hold: every shard is locked, read and acked."""
    s = settings(shards=64)
    buses = [EventBus(s) for _ in range(2)]
    rec = Recorder()
    for bus in buses:

        @bus.subscriber("wide", group="g")
        async def handle(event: Tick, ctx: Context) -> None:
            rec.add(event, ctx)

    resources = resources_per_shard(64, per_shard=1)
    await buses[0].publish_many(
        "wide", [(rid, Tick(resource=rid, seq=seq)) for seq in range(3) for rid in resources]
    )
    async with running(*buses):
        await rec.wait_for(64 * 3)
        await wait_until(lambda: _no_pending(buses[0], "wide", "g", r))
    assert rec.by_resource() == {rid: [0, 1, 2] for rid in resources}
    assert {h.ctx.shard for h in rec.log} == set(range(64))


class CountingRedis(redis.asyncio.Redis):
    """A real client that counts the commands it sends (the server's own statistics are
    shared with whatever else uses the test server)."""

    calls: Counter[str]

    async def execute_command(self, *args: Any, **options: Any) -> Any:
        self.calls[str(args[0]).upper()] += 1
        return await super().execute_command(*args, **options)

    def pipeline(self, transaction: bool = True, shard_hint: Any = None) -> Any:
        pipe = super().pipeline(transaction, shard_hint)
        sent = pipe.execute

        async def execute(raise_on_error: bool = True) -> Any:
            for args, _ in pipe.command_stack:
                self.calls[str(args[0]).upper()] += 1
            return await sent(raise_on_error)

        pipe.execute = execute  # type: ignore[method-assign]
        return pipe


def _lock_rounds(calls: Counter[str]) -> int:
    """Lock rounds (and heartbeats) among `calls`: a script call, or a poll's two ``HMGET``s
    (`LockClient.poll`)."""
    return calls["EVALSHA"] + calls["HMGET"] // 2


@pytest.mark.single_node(
    "counts XREADGROUP through a client subclass; on a cluster reads go over the consumer's own "
    "connections (cluster_reads): test_cluster.py checks idle reads there with INFO commandstats"
)
async def test_idle_consumer_backs_off_instead_of_spinning(
    settings: SettingsFactory, redis_db: str
) -> None:
    client = CountingRedis.from_url(redis_db)
    client.calls = Counter()
    bus = EventBus(settings(shards=4, block_min_ms=10, block_max_ms=400), redis=client)

    @bus.subscriber("quiet", group="g")
    async def handle(event: Tick) -> None: ...

    async with running(bus):
        # the blocking read grows 10, 20, ... 320, 400 ms while nothing arrives
        await wait_until(lambda: client.calls["XREADGROUP"] >= 7)
        before = client.calls.copy()
        await anyio.sleep(1.2)  # a measurement window, not a synchronisation
        during = client.calls - before
    # at most one read per 400 ms (plus the one in progress), a lock and an unlock per read
    assert 1 <= during["XREADGROUP"] <= 4, during
    assert _lock_rounds(during) <= 2 * during["XREADGROUP"] + 4, during  # + heartbeats


@contextlib.asynccontextmanager
async def _trickle(bus: EventBus, s: Settings) -> AsyncIterator[tuple[EventBus, Recorder]]:
    """`bus` running, its consumer of topic "trickle" (group "g") recording what it handles and
    holding every shard, and a publisher on `s`: yields (the publisher, the recorder)."""
    rec = Recorder()
    bus.subscriber("trickle", group="g")(rec.add)
    publisher = EventBus(s)
    async with publisher, running(bus):
        await wait_until(lambda: _owners_are(bus.redis, bus.keys.locks("trickle", "g"), 1))
        yield publisher, rec


@pytest.mark.single_node(
    "counts commands through a client subclass; on a cluster reads go over the consumer's own "
    "connections (cluster_reads)"
)
async def test_a_busy_consumer_locks_at_most_every_lock_interval(
    settings: SettingsFactory, redis_db: str
) -> None:
    """A consumer fed a trickle of events runs a read round per few events, but a lock round
    (``lock_shards.lua`` on the hashtag's node) at most every `lock_interval_ms`: in between it
    reads the shards it holds under its lease."""
    client = CountingRedis.from_url(redis_db)
    client.calls = Counter()
    s = settings(shards=4, lock_interval_ms=200, idle_release_ms=60_000)
    bus = EventBus(s, redis=client)
    async with _trickle(bus, s) as (publisher, rec):
        before, start = client.calls.copy(), anyio.current_time()
        for seq in range(300):
            await publisher.publish(
                "trickle", Tick(resource=f"r{seq % 7}", seq=seq), resource_id=f"r{seq % 7}"
            )
            await anyio.sleep(0.002)  # a trickle: the consumer finds a few entries per read
        await rec.wait_for(300)
        during, elapsed = client.calls - before, anyio.current_time() - start
    # lock rounds: one per 200 ms, the one in progress, and a heartbeat or an unlock at most
    assert _lock_rounds(during) <= elapsed / 0.2 + 3, (during, elapsed)
    assert during["XREADGROUP"] > 2 * _lock_rounds(during), during  # rounds without a lock round


@pytest.mark.single_node("counts lock rounds through a client subclass (see above)")
async def test_a_consumer_alone_in_its_group_keeps_its_idle_shards(
    settings: SettingsFactory, redis_db: str
) -> None:
    """A consumer alone in its group let its idle shards go every
    `idle_release_ms` and took them back at its next lock round (a lock round, an unlock and a
    PEL claim per shard, twice a second, for every idle group of a process). Alone, nobody can
    use them: it keeps them, under the same fencing tokens, over many lock rounds."""
    client = CountingRedis.from_url(redis_db)
    client.calls = Counter()
    bus = EventBus(settings(shards=4, lock_interval_ms=50, idle_release_ms=50), redis=client)

    @bus.subscriber("quiet", group="g")
    async def handle(event: Tick) -> None: ...

    locks = bus.keys.locks("quiet", "g")
    async with running(bus):
        await wait_until(lambda: _owners_are(client, locks, 1))
        first = await client.hgetall(locks)
        rounds = _lock_rounds(client.calls)
        await wait_until(lambda: _lock_rounds(client.calls) >= rounds + 20)  # 20 lock rounds on
        later = await client.hgetall(locks)
    assert later == first  # the same owner and token for each of the 4 shards


@pytest.mark.single_node(
    "a single node's read rounds and XACK pipelines; on a Cluster reads go over the consumer's "
    "own connections (cluster_reads)"
)
async def test_read_and_ack_rounds_take_no_pool_connection_each(
    settings: SettingsFactory, redis_db: str
) -> None:
    """A read round and an XACK pipeline each ran on a connection taken from the
    pool, whose checkout health check (a zero-timeout socket read, cancelled) cost more than
    the round's own Python work at a few entries per round. The reader and the ack loop each
    hold one connection now: 50 events handled one by one (50 read rounds and ~50 XACK
    pipelines) take a handful of checkouts (lock rounds, heartbeats), not 100."""
    s = settings(shards=4, lock_interval_ms=1000, idle_release_ms=60_000)
    bus = EventBus(s)
    pool = bus.redis.connection_pool
    checkouts = Counter[str]()
    take = pool.get_connection

    async def counted(*args: Any, **kwargs: Any) -> Any:
        checkouts["n"] += 1
        return await take(*args, **kwargs)

    pool.get_connection = counted  # type: ignore[method-assign]
    async with _trickle(bus, s) as (publisher, rec):
        await publisher.publish("trickle", Tick(resource="r", seq=0), resource_id="r")
        await rec.wait_for(1)
        before = checkouts["n"]
        for seq in range(1, 51):
            await publisher.publish("trickle", Tick(resource="r", seq=seq), resource_id="r")
            await rec.wait_for(seq + 1)  # a read round (and an XACK pipeline) per event
        during = checkouts["n"] - before
    assert rec.by_resource() == {"r": list(range(51))}
    assert during < 25, during

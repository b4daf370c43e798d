"""Consuming against a real redis-server: delivery, per-resource order across several consumers,
dead letters, retries, ack modes, start positions."""

from __future__ import annotations

import random
import threading
import uuid
from collections import Counter
from collections.abc import Callable
from typing import Any

import anyio
import pytest
import redis.asyncio
from pydantic import BaseModel
from support import (
    Recorder,
    Tick,
    group_lag,
    resources_per_shard,
    running,
    total_pending,
    wait_until,
)

from eventbus import Context, EventBus, Settings, shard_of
from eventbus.codec import F_DATA, F_RESOURCE, F_TYPE

pytestmark = pytest.mark.anyio

SettingsFactory = Callable[..., Settings]


class Other(BaseModel):
    name: str


class BadTick(BaseModel):
    __event_type__ = "Tick"  # claims to be a Tick, but lacks `seq`
    resource: str


async def test_handler_gets_every_event_with_its_context_and_acks(
    settings: SettingsFactory, r: redis.asyncio.Redis
) -> None:
    bus = EventBus(settings(shards=4))
    rec = Recorder()

    @bus.subscriber("orders", group="billing")
    async def handle(event: Tick, ctx: Context) -> None:
        rec.add(event, ctx)

    published = {}
    for i in range(20):
        rid = f"r{i % 6}"
        published[(rid, i)] = await bus.publish(
            "orders", Tick(resource=rid, seq=i), resource_id=rid, headers={"n": str(i)}
        )

    async with running(bus) as [run]:
        await rec.wait_for(20)
        await wait_until(lambda: _no_pending(bus, "orders", "billing", r))

    assert Counter((h.resource, h.seq) for h in rec.log) == Counter(published.keys())
    for h in rec.log:
        ctx = h.ctx
        assert (ctx.topic, ctx.group, ctx.resource_id) == ("orders", "billing", h.resource)
        assert ctx.shard == shard_of(h.resource, 4)
        assert ctx.entry_id == published[(h.resource, h.seq)]
        assert ctx.headers == {"n": str(h.seq)}
        assert ctx.event_type == "Tick" and isinstance(ctx.event_id, uuid.UUID)
        assert ctx.attempt == 1 and ctx.fencing_token >= 1
        assert ctx.consumer_id == run.consumer_ids[0]
    assert len({h.ctx.event_id for h in rec.log}) == 20
    assert bus.consumers[0].handled == 20


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


async def test_undecodable_entries_are_dead_lettered_and_the_shard_goes_on(
    settings: SettingsFactory, r: redis.asyncio.Redis
) -> None:
    bus = EventBus(settings(shards=2))
    rec = Recorder()

    @bus.subscriber("orders", group="billing")
    async def handle(event: Tick, ctx: Context) -> None:
        rec.add(event, ctx)

    rid = "victim"
    stream = bus.keys.stream("orders", shard_of(rid, 2))
    await bus.publish("orders", Tick(resource=rid, seq=0), resource_id=rid)
    junk = await r.xadd(stream, {b"junk": b"\xff\x00"})  # no fields of ours at all
    bad_msgpack = await r.xadd(
        stream, {F_RESOURCE: rid.encode(), F_TYPE: b"Tick", F_DATA: b"\x01\xc1"}
    )
    bad_zstd = await r.xadd(stream, {F_RESOURCE: rid.encode(), F_TYPE: b"Tick", F_DATA: b"\x02zz"})
    await bus.publish("orders", Tick(resource=rid, seq=1), resource_id=rid)
    other = await bus.publish("orders", Other(name="x"), resource_id=rid)  # not a type it takes
    invalid = await bus.publish("orders", BadTick(resource=rid), resource_id=rid)  # lacks seq
    await bus.publish("orders", Tick(resource=rid, seq=2), resource_id=rid)

    dlq = bus.keys.dead_letter("orders", "billing")
    async with running(bus):
        await rec.wait_for(3)
        await wait_until(lambda: _xlen_is(r, dlq, 5))
        await wait_until(lambda: _no_pending(bus, "orders", "billing", r))

    assert rec.by_resource() == {rid: [0, 1, 2]}
    letters = {f[b"entry_id"]: f for _, f in await r.xrange(dlq)}
    assert set(letters) == {junk, bad_msgpack, bad_zstd, other.encode(), invalid.encode()}
    errors = {eid: (f[b"error_type"], f[b"error"]) for eid, f in letters.items()}
    assert errors[junk][0] == b"DecodeError" and b"lacks field" in errors[junk][1]
    assert errors[bad_msgpack][0] == b"DecodeError" and b"corrupt" in errors[bad_msgpack][1]
    assert errors[bad_zstd][0] == b"DecodeError"
    assert errors[other.encode()][0] == b"UnknownEventType"
    assert b"Other" in errors[other.encode()][1]
    assert errors[invalid.encode()][0] == b"DecodeError" and b"seq" in errors[invalid.encode()][1]
    for f in letters.values():
        assert (f[b"topic"], f[b"group"], f[b"attempts"]) == (b"orders", b"billing", b"0")
        assert int(f[b"shard"]) == shard_of(rid, 2)
    # the original fields are kept, for inspection and replay
    assert letters[bad_msgpack][b"orig_data"] == b"\x01\xc1"
    assert letters[bad_msgpack][b"orig_rid"] == rid.encode()
    assert b"orig_data" not in letters[junk]
    assert bus.consumers[0].dead_lettered == 5


async def _xlen_is(r: redis.asyncio.Redis, key: str, n: int) -> bool:
    return await r.xlen(key) == n


async def test_failing_handler_is_retried_in_place_then_dead_lettered(
    settings: SettingsFactory, r: redis.asyncio.Redis
) -> None:
    """Resource "x": seq 1 fails twice then succeeds, seq 3 always fails (dead-lettered after
    max_attempts). Later events of "x" wait for each; resource "y" is not held up meanwhile."""
    bus = EventBus(settings(shards=1, max_attempts=3))
    calls: list[tuple[str, int, int]] = []  # (resource, seq, attempt), in call order
    y_done = anyio.Event()

    @bus.subscriber("jobs", group="workers")
    async def handle(event: Tick, ctx: Context) -> None:
        calls.append((event.resource, event.seq, ctx.attempt))
        if event.resource == "y" and event.seq == 2:
            y_done.set()
        if event.resource == "x" and event.seq == 1 and ctx.attempt == 1:
            # "y" must make progress while "x" is stuck: it is on the same shard
            with anyio.fail_after(10):
                await y_done.wait()
        if event.resource == "x" and ((event.seq == 1 and ctx.attempt < 3) or event.seq == 3):
            raise RuntimeError(f"boom {event.seq}/{ctx.attempt}")

    events = [("x", Tick(resource="x", seq=i)) for i in range(5)]
    events[2:2] = [("y", Tick(resource="y", seq=i)) for i in range(3)]
    await bus.publish_many("jobs", events)

    dlq = bus.keys.dead_letter("jobs", "workers")
    async with running(bus):
        await wait_until(lambda: _xlen_is(r, dlq, 1))
        await wait_until(lambda: ("x", 4, 1) in calls)
        await wait_until(lambda: _no_pending(bus, "jobs", "workers", r))

    x_calls = [(seq, attempt) for res, seq, attempt in calls if res == "x"]
    assert x_calls == [(0, 1), (1, 1), (1, 2), (1, 3), (2, 1), (3, 1), (3, 2), (3, 3), (4, 1)]
    assert [(seq, a) for res, seq, a in calls if res == "y"] == [(0, 1), (1, 1), (2, 1)]
    # "y" finished while "x" seq 1 was still on its first attempt
    assert calls.index(("y", 2, 1)) < calls.index(("x", 1, 2))
    [(_, letter)] = await r.xrange(dlq)
    assert letter[b"error_type"] == b"RuntimeError"
    assert letter[b"error"] == b"boom 3/3"
    assert letter[b"attempts"] == b"3"
    assert bus.consumers[0].handled == 7


async def test_per_subscriber_max_attempts(
    settings: SettingsFactory, r: redis.asyncio.Redis
) -> None:
    bus = EventBus(settings(shards=1, max_attempts=5))
    attempts: list[int] = []

    @bus.subscriber("jobs", group="g", max_attempts=1)
    async def handle(event: Tick, ctx: Context) -> None:
        attempts.append(ctx.attempt)
        raise ValueError("never works")

    await bus.publish("jobs", Tick(resource="a", seq=0), resource_id="a")
    dlq = bus.keys.dead_letter("jobs", "g")
    async with running(bus):
        await wait_until(lambda: _xlen_is(r, dlq, 1))
    assert attempts == [1]


async def test_ack_before_reads_with_noack(
    settings: SettingsFactory, r: redis.asyncio.Redis
) -> None:
    """At-most-once: entries are never pending, even while their handler runs."""
    bus = EventBus(settings(shards=2))
    started, release = anyio.Event(), anyio.Event()
    rec = Recorder()

    @bus.subscriber("audit", group="fast", ack="before")
    async def handle(event: Tick, ctx: Context) -> None:
        if event.seq == 0:
            started.set()
            await release.wait()
        rec.add(event, ctx)

    await bus.publish_many("audit", [("a", Tick(resource="a", seq=i)) for i in range(5)])
    stream = bus.keys.stream("audit", shard_of("a", 2))
    async with running(bus):
        with anyio.fail_after(10):
            await started.wait()
        # the handler holds seq 0 and seq 1..4 are queued behind it: all were delivered
        await wait_until(lambda: _lag_is(r, stream, "fast", 0))
        assert await total_pending(bus, "audit", "fast", r) == 0
        release.set()
        await rec.wait_for(5)

    assert rec.by_resource() == {"a": [0, 1, 2, 3, 4]}
    assert await total_pending(bus, "audit", "fast", r) == 0


async def test_ack_after_keeps_entries_pending_until_handled(
    settings: SettingsFactory, r: redis.asyncio.Redis
) -> None:
    """The counterpart of the NOACK test: with the default mode, a running handler's entry
    is pending, and it is acked once the handler returns."""
    bus = EventBus(settings(shards=2))
    started, release = anyio.Event(), anyio.Event()

    @bus.subscriber("audit", group="safe")
    async def handle(event: Tick) -> None:
        started.set()
        await release.wait()

    await bus.publish("audit", Tick(resource="a", seq=0), resource_id="a")
    async with running(bus):
        with anyio.fail_after(10):
            await started.wait()
        assert await total_pending(bus, "audit", "safe", r) == 1
        release.set()
        await wait_until(lambda: _no_pending(bus, "audit", "safe", r))


async def _lag_is(r: redis.asyncio.Redis, stream: str, group: str, n: int) -> bool:
    return await group_lag(r, stream, group) == n


@pytest.mark.parametrize("start", ["beginning", "now"])
async def test_new_group_starts_at_beginning_or_now(
    settings: SettingsFactory, r: redis.asyncio.Redis, start: str
) -> None:
    s = settings(shards=2, start=start)
    publisher = EventBus(s)
    bus = EventBus(s)
    rec = Recorder()

    @bus.subscriber("news", group=f"from-{start}")
    async def handle(event: Tick, ctx: Context) -> None:
        rec.add(event, ctx)

    old = [(f"r{i}", Tick(resource=f"r{i}", seq=i)) for i in range(6)]
    new = [(f"r{i}", Tick(resource=f"r{i}", seq=100 + i)) for i in range(6)]
    await publisher.publish_many("news", old)
    streams = [bus.keys.stream("news", i) for i in range(2)]
    async with running(bus):
        # the group exists on every shard before the new events are published
        await wait_until(lambda: _groups_exist(r, streams, f"from-{start}"))
        await publisher.publish_many("news", new)
        expected = [e.seq for _, e in (old + new if start == "beginning" else new)]
        await rec.wait_for(len(expected))
        for stream in streams:  # everything delivered, so nothing else can still come
            await wait_until(lambda stream=stream: _lag_is(r, stream, f"from-{start}", 0))
    await publisher.aclose()

    assert sorted(h.seq for h in rec.log) == sorted(expected)


async def _groups_exist(r: redis.asyncio.Redis, streams: list[str], group: str) -> bool:
    for stream in streams:
        if not await r.exists(stream):
            return False
        names = [g["name"] for g in await r.xinfo_groups(stream)]
        if group.encode() not in names:
            return False
    return True


async def test_sync_handler_runs_in_a_worker_thread(
    settings: SettingsFactory, r: redis.asyncio.Redis
) -> None:
    bus = EventBus(settings(shards=2))
    seen: list[tuple[int, bool]] = []
    lock = threading.Lock()

    @bus.subscriber("orders", group="legacy")
    def handle(event: Tick) -> None:  # plain def, no context
        with lock:
            seen.append((event.seq, threading.current_thread() is threading.main_thread()))

    await bus.publish_many("orders", [("a", Tick(resource="a", seq=i)) for i in range(4)])
    async with running(bus):
        await wait_until(lambda: len(seen) == 4)
        await wait_until(lambda: _no_pending(bus, "orders", "legacy", r))
    assert seen == [(0, False), (1, False), (2, False), (3, False)]


async def test_two_groups_each_get_every_event(
    settings: SettingsFactory, r: redis.asyncio.Redis
) -> None:
    bus = EventBus(settings(shards=2))
    recs = {"billing": Recorder(), "audit": Recorder()}

    @bus.subscriber("orders", group="billing")
    async def billing(event: Tick, ctx: Context) -> None:
        recs["billing"].add(event, ctx)

    @bus.subscriber("orders", group="audit")
    async def audit(event: Tick, ctx: Context) -> None:
        recs["audit"].add(event, ctx)

    await bus.publish_many(
        "orders", [(f"r{i % 3}", Tick(resource=f"r{i % 3}", seq=i)) for i in range(9)]
    )
    async with running(bus):
        for rec in recs.values():
            await rec.wait_for(9)
    for rec in recs.values():
        assert rec.by_resource() == {"r0": [0, 3, 6], "r1": [1, 4, 7], "r2": [2, 5, 8]}


async def test_busy_consumer_yields_its_surplus_to_a_newcomer(
    settings: SettingsFactory, r: redis.asyncio.Redis
) -> None:
    """A consumer holding every shard of a busy topic releases those above its fair share once
    a second consumer joins; they end up with ceil(4 / 2) = 2 shards each, order intact."""
    s = settings(shards=4, read_count=5, block_max_ms=50)
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
    owners = [v.decode() for k, v in (await r.hgetall(locks)).items() if b":" not in k]
    return dict(Counter(owners)) == want


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
    assert during["EVALSHA"] <= 2 * during["XREADGROUP"] + 4, during  # + heartbeats


async def test_in_flight_cap_and_concurrency_limit(
    settings: SettingsFactory, r: redis.asyncio.Redis
) -> None:
    """With `max_in_flight` 6 the consumer stops reading once 6 entries are unfinished; with
    `concurrency` 2 at most two handlers run at once."""
    s = settings(shards=1, max_in_flight=6, read_count=3, concurrency=2)
    bus = EventBus(s)
    gate = anyio.Event()
    running_now = 0
    most = 0
    handled: list[int] = []

    @bus.subscriber("capped", group="g")
    async def handle(event: Tick) -> None:
        nonlocal running_now, most
        running_now += 1
        most = max(most, running_now)
        try:
            await gate.wait()
            handled.append(event.seq)
        finally:
            running_now -= 1

    await bus.publish_many("capped", [(f"r{i}", Tick(resource=f"r{i}", seq=i)) for i in range(30)])
    stream = bus.keys.stream("capped", 0)
    async with running(bus):
        await wait_until(lambda: _pending_is(r, stream, 6))
        await wait_until(lambda: running_now == 2)
        assert await group_lag(r, stream, "g") == 24  # no more read while 6 are unfinished
        gate.set()
        await wait_until(lambda: len(handled) == 30)
        await wait_until(lambda: _no_pending(bus, "capped", "g", r))
    assert most == 2
    assert sorted(handled) == list(range(30))


async def _pending_is(r: redis.asyncio.Redis, stream: str, n: int) -> bool:
    return int((await r.xpending(stream, "g"))["pending"]) == n

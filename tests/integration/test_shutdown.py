"""Graceful shutdown in one process: a stopped consumer finishes its running handlers, releases
its locks and leaves, and another consumer of the group takes over within a poll, not after the
liveness TTL (30 s here)."""

from __future__ import annotations

import time
from collections.abc import Callable

import anyio
import pytest
import redis.asyncio
from support import Recorder, Tick, resources_per_shard, running, total_pending, wait_until

from eventbus import Context, EventBus, Settings

pytestmark = pytest.mark.anyio

SettingsFactory = Callable[..., Settings]
TOPIC, GROUP, SHARDS = "orders", "billing", 4


async def test_stopped_consumer_hands_over_within_a_poll(
    settings: SettingsFactory, r: redis.asyncio.Redis
) -> None:
    s = settings(shards=SHARDS, liveness_ttl_s=30.0, block_max_ms=250)
    resources = resources_per_shard(SHARDS, per_shard=2)
    per_resource = 10
    publisher = EventBus(s)
    await publisher.publish_many(
        TOPIC,
        [(rid, Tick(resource=rid, seq=seq)) for seq in range(per_resource) for rid in resources],
    )
    await publisher.aclose()

    first, second = EventBus(s), EventBus(s)
    rec_first, rec_second = Recorder(), Recorder()
    gate = anyio.Event()
    blocked: set[str] = set()

    @first.subscriber(TOPIC, group=GROUP)
    async def slow(event: Tick, ctx: Context) -> None:
        blocked.add(event.resource)
        await gate.wait()
        rec_first.add(event, ctx)

    @second.subscriber(TOPIC, group=GROUP)
    async def fast(event: Tick, ctx: Context) -> None:
        rec_second.add(event, ctx)

    keys = first.keys
    members, locks = keys.members(TOPIC, GROUP), keys.locks(TOPIC, GROUP)
    async with running(first) as [run_first]:
        # the first consumer holds every shard, one handler running per resource
        await wait_until(lambda: blocked == set(resources))
        first_id = run_first.consumer_ids[0]
        assert await _owners(r, locks) == {str(i): first_id for i in range(SHARDS)}

        async with running(second) as [run_second]:
            await wait_until(lambda: _zcard_is(r, members, 2))
            assert rec_second.log == []  # nothing to take from a live consumer

            run_first.stop()
            gate.set()  # the running handlers may finish; queued events must not start
            with anyio.fail_after(10):
                await run_first.done.wait()
            stopped_at = time.monotonic()
            second_id = run_second.consumer_ids[0]
            assert first_id not in (await _owners(r, locks)).values()
            assert await r.zscore(members, first_id) is None

            remaining = len(resources) * (per_resource - 1)
            await rec_second.wait_for(remaining, within_s=10)
            took = time.monotonic() - stopped_at
            await wait_until(lambda: _no_pending(second, r))

    # the first consumer finished what it had started (and acked it); the second took the rest,
    # its queued-but-unstarted entries included, in order
    assert rec_first.by_resource() == {rid: [0] for rid in resources}
    assert rec_second.by_resource() == {rid: list(range(1, per_resource)) for rid in resources}
    assert {h.ctx.consumer_id for h in rec_second.log} == {second_id}
    assert took < 3, f"hand-over took {took:.2f} s"


async def test_idle_consumer_leaves_no_trace(
    settings: SettingsFactory, r: redis.asyncio.Redis
) -> None:
    bus = EventBus(settings(shards=SHARDS, liveness_ttl_s=30.0))

    @bus.subscriber(TOPIC, group=GROUP)
    async def handle(event: Tick) -> None: ...

    members = bus.keys.members(TOPIC, GROUP)
    async with running(bus) as [run]:
        await wait_until(lambda: _zcard_is(r, members, 1))
        run.stop()
        with anyio.fail_after(10):
            await run.done.wait()
        assert await r.zcard(members) == 0
        assert await _owners(r, bus.keys.locks(TOPIC, GROUP)) == {}


async def _owners(r: redis.asyncio.Redis, locks: str) -> dict[str, str]:
    raw = await r.hgetall(locks)
    return {k.decode(): v.decode() for k, v in raw.items() if b":" not in k}


async def _zcard_is(r: redis.asyncio.Redis, key: str, n: int) -> bool:
    return await r.zcard(key) == n


async def _no_pending(bus: EventBus, r: redis.asyncio.Redis) -> bool:
    return await total_pending(bus, TOPIC, GROUP, r) == 0


async def test_the_grace_report_tells_running_handlers_from_queued_entries(
    settings: Callable[..., Settings], caplog: pytest.LogCaptureFixture
) -> None:
    """An at-most-once consumer stopped with one handler call stuck and three entries of the
    same resource queued behind it: the report called all four "still in their handlers"
    (and said they stay pending: NOACK entries never are). It counts them as not handled yet,
    the one running handler call apart, and says they are lost."""
    bus = EventBus(settings(shards=1, shutdown_grace_s=0.2, concurrency=1))
    stuck = anyio.Event()

    @bus.subscriber("t", group="g", ack="before")
    async def handle(event: Tick) -> None:
        stuck.set()
        await anyio.sleep_forever()

    async with bus:  # read in one read once the consumer starts
        for seq in range(4):
            await bus.publish("t", Tick(resource="a", seq=seq), resource_id="a")
    async with running(bus) as [run]:
        await stuck.wait()
        await wait_until(lambda: bus.consumers[0].in_flight == 4)
        with caplog.at_level("ERROR", logger="eventbus.consumer"):
            run.stop()
            await run.done.wait()
    (record,) = [r for r in caplog.records if "of shutdown" in r.getMessage()]
    message = record.getMessage()
    assert "4 entries unfinished" in message and "4 not handled yet" in message
    assert "(1 handler calls still running); they are lost" in message
    assert "still in their handlers" not in message

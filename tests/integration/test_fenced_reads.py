"""Fenced delivery and redelivery counts against a real redis-server.

A stale consumer's ``XREADGROUP`` that lands late (a process paused between its lease check and
the send, ``CLIENT PAUSE``, a request delayed in the network past the TTL) delivers entries into
*its* pending entries list although another consumer holds the shard now. Reproduced
deterministically: ``MULTI; XADD e2; XREADGROUP ... stale >; EXEC`` hands e2 to a consumer name
that holds no lock before the shard's owner can read it. The owner must handle e2 before the
resource's later e3, not leave it stranded and run e3 first.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import anyio
import pytest
import redis.asyncio
from support import Recorder, Tick, on_cluster, running, wait_until

from eventbus import EventBus, Settings

pytestmark = pytest.mark.anyio


async def _stale_read(r: Any, bus: EventBus, event: Tick) -> bytes:
    """Publish `event` and, atomically with it, read it as consumer "stale" of group "g"."""
    stream, fields = bus.publisher.encoder.prepare(bus.topic("t"), event, event.resource)
    if on_cluster():
        await r.initialize()
    node = r.get_node_from_key(stream) if on_cluster() else None
    direct = redis.asyncio.Redis(host=node.host, port=node.port) if node else r
    async with direct.pipeline(transaction=True) as tx:  # on a cluster: on the stream's node
        tx.xadd(stream, fields)
        tx.xreadgroup("g", "stale", {stream: ">"}, count=10)
        entry_id, reply = await tx.execute()
    if node:
        await direct.aclose()
    assert reply and reply[0][1][0][0] == entry_id  # the stale consumer got it
    return bytes(entry_id)


async def test_a_stale_consumers_late_read_is_claimed_and_handled_in_order(
    settings: Callable[..., Settings], r: redis.asyncio.Redis
) -> None:
    rec = Recorder()
    bus = EventBus(settings(shards=1))
    bus.subscriber("t", group="g")(rec.add)
    async with running(bus):
        await bus.publish("t", Tick(resource="x", seq=1), resource_id="x")
        await rec.wait_for(1)
        await _stale_read(r, bus, Tick(resource="x", seq=2))
        await bus.publish("t", Tick(resource="x", seq=3), resource_id="x")
        await rec.wait_for(3)
        stream = bus.keys.stream("t", 0)
        await wait_until(lambda: _pel_empty(r, stream))
    assert rec.by_resource() == {"x": [1, 2, 3]}
    redelivered = rec.log[1].ctx
    assert redelivered.delivery_count == 2 and redelivered.redelivered
    assert rec.log[0].ctx.delivery_count == 1 and not rec.log[0].ctx.redelivered


async def test_a_late_read_with_nothing_after_it_is_not_stranded(
    settings: Callable[..., Settings], r: redis.asyncio.Redis
) -> None:
    """No later entry of the resource arrives: the stale read's entry is still handled (it is
    claimed at the owner's next read, not left pending until the next takeover)."""
    rec = Recorder()
    bus = EventBus(settings(shards=1, block_max_ms=50))
    bus.subscriber("t", group="g")(rec.add)
    async with running(bus):
        await bus.publish("t", Tick(resource="y", seq=1), resource_id="y")
        await rec.wait_for(1)
        await _stale_read(r, bus, Tick(resource="y", seq=2))
        with anyio.fail_after(20):
            await rec.wait_for(2)
    assert rec.by_resource() == {"y": [1, 2]}


async def _pel_empty(r: redis.asyncio.Redis, stream: str) -> bool:
    summary = await r.xpending(stream, "g")
    return not summary["pending"]


async def _calls(r: redis.asyncio.Redis, command: str) -> int:
    stats = await r.info("commandstats")
    return int(stats.get(f"cmdstat_{command}", {}).get("calls", 0))


@pytest.mark.single_node("a Cluster's blocking reads each carry their summary")
async def test_reads_that_return_nothing_summarize_the_pels_only_on_the_sweep(
    settings: Callable[..., Settings], r: redis.asyncio.Redis
) -> None:
    """An idle consumer's read rounds send no XPENDING summary but every `SWEEP_EVERY`-th
    (which summarizes every shard read): a read that returns nothing of a shard has nothing to
    order."""
    from eventbus.consumer.reading import SWEEP_EVERY

    shards = 8
    bus = EventBus(settings(shards=shards, block_max_ms=20, block_min_ms=5))
    bus.subscriber("t", group="g")(Recorder().add)
    async with running(bus):
        await wait_until(lambda: _holds_all(bus, shards))
        await r.config_resetstat()
        await wait_until(lambda: _reads_at_least(r, 4 * SWEEP_EVERY))
        stats = await r.info("commandstats")
    reads = int(stats["cmdstat_xreadgroup"]["calls"])
    summaries = int(stats.get("cmdstat_xpending", {}).get("calls", 0))
    # every SWEEP_EVERY-th read summarizes the shards (the count started mid-cycle)
    assert summaries <= (reads // SWEEP_EVERY + 2) * shards
    assert summaries < reads * shards / 2  # (each read summarized every shard before)


def _holds_all(bus: EventBus, shards: int) -> bool:
    return sum(len(c.ownership.table.held) for c in bus.consumers) == shards


async def _reads_at_least(r: redis.asyncio.Redis, n: int) -> bool:
    return await _calls(r, "xreadgroup") >= n

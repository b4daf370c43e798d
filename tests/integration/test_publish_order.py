"""Call-order publishing: concurrent `publish()` calls of one process land in each
resource's shard stream in the order they were made, across the pipelines in flight and across
the retries after a connection error (Kafka's producer guarantees the same per partition)."""

from __future__ import annotations

import asyncio
import itertools
from collections import defaultdict
from collections.abc import Callable
from functools import partial
from typing import Any

import anyio
import pytest
import redis.asyncio
from support import Tick, wait_until

from eventbus import EventBus, Settings
from eventbus.protocol.codec import decode_entry

pytestmark = pytest.mark.anyio

RESOURCES = [f"r{i}" for i in range(6)]

PATIENT_S = 240.0
"""`publish_timeout_s` of the tests that send thousands of calls at once: what they check is
the order the calls land in, not how fast. Each call's deadline starts when it is made, so with
the default 10 s the last of 12,000 queued calls failed with `PublishError` whenever the machine
was busy (two CPU hogs on two cores); the deadline is kept only as an overall bound on a hung
publisher, under pytest's 300 s timeout."""


async def _first_copies(r: redis.asyncio.Redis, bus: EventBus, topic: str) -> dict[str, list[int]]:
    """Per resource, the seqs in stream order (first copy of each seq only: a retry may append
    a second copy of an event whose reply was lost; it carries the same event ID)."""
    out: dict[str, list[int]] = defaultdict(list)
    seen: set[tuple[str, int]] = set()
    for shard in range(bus.topic(topic).shards):
        for _, fields in await r.xrange(bus.keys.stream(topic, shard)):
            payload = decode_entry(fields).payload
            key = (payload["resource"], payload["seq"])
            if key not in seen:
                seen.add(key)
                out[payload["resource"]].append(payload["seq"])
    return dict(out)


async def _entries(r: Any, bus: EventBus, topic: str) -> dict[tuple[str, str], int]:
    """(resource, entry ID) -> seq of every entry of the topic's shard streams (an entry ID is
    unique within a stream only; a resource's events are all in one shard stream)."""
    out: dict[tuple[str, str], int] = {}
    for shard in range(bus.topic(topic).shards):
        for entry_id, fields in await r.xrange(bus.keys.stream(topic, shard)):
            payload = decode_entry(fields).payload
            out[payload["resource"], entry_id.decode()] = payload["seq"]
    return out


def _out_of_order(seqs: dict[str, list[int]]) -> int:
    return sum(1 for s in seqs.values() for a, b in itertools.pairwise(s) if b < a)


async def test_concurrent_publishes_land_in_call_order(
    settings: Callable[..., Settings], r: redis.asyncio.Redis
) -> None:
    """Many concurrent calls over few resources, with several pipelines in flight: every
    resource's events are in its stream in call order."""
    bus = EventBus(
        settings(shards=4, publish_batch_max=50, publish_pipelines=4, publish_timeout_s=PATIENT_S)
    )
    calls = 12_000
    async with bus:
        await asyncio.gather(
            *(
                bus.publish("order", Tick(resource=rid, seq=i), resource_id=rid)
                for i in range(calls)
                for rid in [RESOURCES[i % len(RESOURCES)]]
            )
        )
    seqs = await _first_copies(r, bus, "order")
    assert sum(map(len, seqs.values())) == calls
    assert _out_of_order(seqs) == 0


async def _primaries(r: Any) -> list[Any]:
    """A client per primary: `r` on a single node; on the cluster one per primary node."""
    if not isinstance(r, redis.asyncio.RedisCluster):
        return [r]
    await r.initialize()  # learns the nodes
    return [redis.asyncio.Redis(host=n.host, port=n.port) for n in r.get_primaries()]


async def _waiting_on_the_pause(nodes: list[Any]) -> bool:
    """A client other than ours is blocked on a node: a command of the publisher's waits there
    for the write pause to end (Redis postpones it, its connection flagged ``b``)."""
    for node in nodes:
        ours = await node.client_id()
        for client in await node.client_list():
            if int(client["id"]) != ours and "b" in client["flags"]:
                return True
    return False


async def test_call_order_holds_across_retries_after_connection_errors(
    settings: Callable[..., Settings], r: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """In each of three waves of concurrent calls, the publisher's pipelines are held unanswered
    on Redis (CLIENT PAUSE WRITE) and its connections are killed under them: the flusher sends
    the lost batches again ahead of the wave's later ones, so the first copy of every event is
    in call order, and every call returns the entry ID of its own event."""
    bus = EventBus(
        settings(shards=4, publish_batch_max=20, publish_pipelines=4, publish_timeout_s=PATIENT_S)
    )
    waves, per_wave = 3, 2_000
    nodes = await _primaries(r)
    ids: list[str] = []
    try:
        async with bus:
            await bus.publish("retry", Tick(resource="setup", seq=0), resource_id="setup")
            for wave in range(waves):
                for node in nodes:
                    await node.client_pause(int(PATIENT_S * 1000), all=False)  # writes only
                try:
                    calls = asyncio.gather(
                        *(
                            bus.publish("retry", Tick(resource=rid, seq=i), resource_id=rid)
                            for i in range(wave * per_wave, (wave + 1) * per_wave)
                            for rid in [RESOURCES[i % len(RESOURCES)]]
                        )
                    )
                    await wait_until(partial(_waiting_on_the_pause, nodes), within_s=60)
                    killed = 0
                    for node in nodes:
                        killed += await node.client_kill_filter(_type="normal", skipme=True)
                    assert killed >= 1
                finally:
                    for node in nodes:
                        await node.client_unpause()
                ids += await calls
    finally:
        for node in nodes:
            if node is not r:
                await node.aclose()
    entries = await _entries(r, bus, "retry")
    # every call's ID names its own event (a batch whose reply was lost may have landed twice:
    # the ID is the copy the call was answered for)
    rids = [RESOURCES[i % len(RESOURCES)] for i in range(waves * per_wave)]
    assert [entries.get(key) for key in zip(rids, ids, strict=True)] == list(range(len(rids)))
    seqs = await _first_copies(r, bus, "retry")
    seqs.pop("setup")
    assert sum(map(len, seqs.values())) == waves * per_wave
    assert _out_of_order(seqs) == 0
    # the fault hit pipelines in flight, once per wave at least, and they were sent again
    retried = [m for m in caplog.messages if m.startswith("XADD pipeline failed")]
    assert len(retried) >= waves, caplog.messages


async def test_without_a_running_bus_concurrent_publish_and_publish_many_do_not_wait_on_each_other(
    settings: Callable[..., Settings], r: redis.asyncio.Redis
) -> None:
    """Outside a running bus each call is sent on its own: a publish_many is not held back by a
    publish() still checking the topic (it once waited for ever)."""
    bus = EventBus(settings(shards=2))
    try:
        with anyio.fail_after(20):
            ids = await asyncio.gather(
                bus.publish("solo", Tick(resource="a", seq=0), resource_id="a"),
                bus.publish_many("solo", [("b", Tick(resource="b", seq=i)) for i in range(5)]),
            )
    finally:
        await bus.aclose()
    assert isinstance(ids[0], str) and len(ids[1]) == 5
    assert sum([await r.xlen(bus.keys.stream("solo", s)) for s in range(2)]) == 6

"""Call-order publishing (issue 9 item 2): concurrent `publish()` calls of one process land in each
resource's shard stream in the order they were made, across the pipelines in flight and across
the retries after a connection error (Kafka's producer guarantees the same per partition)."""

from __future__ import annotations

import asyncio
import itertools
from collections import defaultdict
from collections.abc import Callable

import anyio
import pytest
import redis.asyncio
from support import Tick

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


async def test_call_order_holds_across_retries_after_connection_errors(
    settings: Callable[..., Settings], r: redis.asyncio.Redis
) -> None:
    """The publisher's connections are killed while calls are in flight: the batches that
    failed are sent again ahead of later ones, so the first copy of every event is still in
    call order, and every call returns its entry ID."""
    bus = EventBus(
        settings(shards=4, publish_batch_max=20, publish_pipelines=4, publish_timeout_s=PATIENT_S)
    )
    calls = 6_000
    killed = 0
    async with bus:

        async def kill_publisher_connections() -> None:
            nonlocal killed
            for _ in range(5):
                await anyio.sleep(0.01)  # let a few batches go out between kills
                killed += await r.client_kill_filter(_type="normal", skipme=True)

        async with anyio.create_task_group() as tg:
            tg.start_soon(kill_publisher_connections)
            ids = await asyncio.gather(
                *(
                    bus.publish("retry", Tick(resource=rid, seq=i), resource_id=rid)
                    for i in range(calls)
                    for rid in [RESOURCES[i % len(RESOURCES)]]
                )
            )
    assert all(isinstance(i, str) for i in ids)
    seqs = await _first_copies(r, bus, "retry")
    assert sum(map(len, seqs.values())) == calls
    assert _out_of_order(seqs) == 0
    assert killed > 0  # the fault really happened


async def test_without_a_running_bus_concurrent_publish_and_publish_many_do_not_wait_on_each_other(
    settings: Callable[..., Settings], r: redis.asyncio.Redis
) -> None:
    """Outside a running bus each call is sent on its own: a publish_many is not held back by a
    publish() still checking the topic (a review found it waiting for ever)."""
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

"""Broadcast on a real redis-server: every running instance gets every event published while it
runs; one behind the stream's cap is told what it missed, and a de-duplication window does not
keep an instance from handling an event another instance handled."""

from __future__ import annotations

from typing import Any

import anyio
import pytest
from support import Tick

from eventbus import EventBus

pytestmark = pytest.mark.integration


@pytest.mark.anyio
async def test_a_broadcast_instance_behind_the_cap_is_told_what_it_missed(
    settings: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Every running instance gets every event published while it runs (broadcast.py's
    docstring); when the cap trims events an instance had not read yet, that loss must at least
    be logged, as consumer groups log and count theirs (`eventbus.consumer.trims`)."""
    import logging

    from support import running, wait_until

    from eventbus.consumer.broadcast import BroadcastConsumer

    s = settings(shards=1, max_in_flight=1)
    bus, publisher = EventBus(s), EventBus(s)
    for b in (bus, publisher):
        b.topic("bc", maxlen=100)
    gate = anyio.Event()
    seen: list[int] = []

    @bus.subscriber("bc", broadcast=True)
    async def handle(event: Tick) -> None:
        seen.append(event.seq)
        await gate.wait()

    caplog.set_level(logging.INFO)
    async with publisher, running(bus):
        (consumer,) = bus.consumers
        assert isinstance(consumer, BroadcastConsumer)
        await publisher.publish("bc", Tick(resource="r", seq=0), resource_id="r")
        await wait_until(lambda: seen == [0])  # read, held by the gate: the instance is behind
        events = [("r", Tick(resource="r", seq=i)) for i in range(1, 1001)]
        await publisher.publish_many("bc", events)  # MAXLEN ~ 100 trims most of them
        gate.set()
        await wait_until(lambda: seen[-1:] == [1000], within_s=60)
    missed = 1001 - len(seen)
    told = [r.getMessage() for r in caplog.records if "trim" in r.getMessage().lower()]
    assert missed == 0 or told, f"{missed} events never reached the instance, no log line"


@pytest.mark.anyio
async def test_broadcast_with_a_dedup_window_still_reaches_every_instance(
    settings: Any, r: Any
) -> None:
    """The second instance's de-duplication check is held until the first instance has
    handled the event and written its mark (else both may check before either marks)."""
    from support import running, wait_until

    from eventbus.consumer.broadcast import BroadcastConsumer

    s = settings(shards=1)
    instances = [EventBus(s), EventBus(s)]
    handled: list[list[int]] = [[], []]

    def subscribe(b: EventBus, seen: list[int]) -> None:
        @b.subscriber("cache", broadcast=True, dedup_window_s=60)
        async def invalidate(event: Tick) -> None:
            seen.append(event.seq)

    for b, seen in zip(instances, handled, strict=True):
        subscribe(b, seen)
    publisher = EventBus(s)
    async with publisher, running(*instances) as runs:
        consumers = [b.consumers[0] for b in instances]
        assert all(isinstance(c, BroadcastConsumer) for c in consumers)
        first_marked = anyio.Event()
        second = consumers[1].handling
        seen = second.dedup.seen

        async def after_the_first(event_id: bytes) -> bool:
            await first_marked.wait()
            return await seen(event_id)

        second.dedup.seen = after_the_first  # type: ignore[method-assign]
        await publisher.publish("cache", Tick(resource="r", seq=1), resource_id="r")
        await wait_until(lambda: handled[0] == [1])

        async def marked() -> bool:
            return bool([k async for k in r.scan_iter(match="*dedup*")])

        await wait_until(marked)
        first_marked.set()

        for run in runs:  # read to the stream's end, nothing in flight
            await run.drain()
    assert handled == [[1], [1]]

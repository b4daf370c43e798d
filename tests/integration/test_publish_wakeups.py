"""What the publisher schedules per call: concurrent `publish()` calls wake the flusher once per
wait, not once each, and `publish_many` waits for its pipelines' replies, not with a done-callback
per event. Same entries, same order (test_publish_order checks order)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import anyio
import pytest
import redis.asyncio
from support import Tick

from eventbus import EventBus, Settings

pytestmark = pytest.mark.anyio


class _CountingEvent:
    """An anyio event that counts its `set` calls (shared count in `sets`)."""

    sets = 0

    def __init__(self) -> None:
        self._event = asyncio.Event()

    def set(self) -> None:
        _CountingEvent.sets += 1
        self._event.set()

    def is_set(self) -> bool:
        return self._event.is_set()

    async def wait(self) -> None:
        await self._event.wait()


async def test_concurrent_calls_wake_the_flusher_once_per_wait(
    settings: Callable[..., Settings], r: redis.asyncio.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """1,000 calls made ready in one pass of the event loop set the flusher's wake-up event a
    few times (once per wait of the flusher, and per batch answered), not once per call."""
    bus = EventBus(settings(shards=4, publish_timeout_s=120))
    calls = 1_000
    async with bus:
        await bus.publish("w", Tick(resource="a", seq=-1), resource_id="a")  # topic checked
        monkeypatch.setattr(anyio, "Event", _CountingEvent)
        _CountingEvent.sets = 0
        ids = await asyncio.gather(
            *(bus.publish("w", Tick(resource="a", seq=i), resource_id="a") for i in range(calls))
        )
        sets = _CountingEvent.sets
        monkeypatch.undo()
    assert len(set(ids)) == calls
    shards = range(bus.topic("w").shards)
    assert sum([await r.xlen(bus.keys.stream("w", s)) for s in shards]) == calls + 1
    # the flusher sleeps on anyio events: some were set (the count measures the wake-ups)
    assert 1 <= sets <= calls // 10, f"{sets} wake-ups for {calls} calls"


async def test_publish_many_schedules_no_callback_per_event(
    settings: Callable[..., Settings], r: redis.asyncio.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A `publish_many` of 500 events waits for its pipeline's replies with a handful of
    callbacks scheduled on the event loop, not one per event (``asyncio.wait`` over 500
    futures added a done-callback to each), and returns the IDs in order."""
    bus = EventBus(settings(shards=4, publish_timeout_s=120))
    events = [(f"r{i % 7}", Tick(resource=f"r{i % 7}", seq=i)) for i in range(500)]
    async with bus:
        await bus.publish_many("m", events[:1])  # topic checked, connection made
        loop = asyncio.get_running_loop()
        scheduled = 0
        call_soon = loop.call_soon

        def counting(*args: Any, **kwargs: Any) -> Any:
            nonlocal scheduled
            scheduled += 1
            return call_soon(*args, **kwargs)

        monkeypatch.setattr(loop, "call_soon", counting)
        ids = await bus.publish_many("m", events)
        monkeypatch.undo()
    stored = [  # (entry IDs are per shard stream: two shards may give the same one)
        (shard, entry_id.decode())
        for shard in range(bus.topic("m").shards)
        for entry_id, _ in await r.xrange(bus.keys.stream("m", shard))
    ]
    assert len(ids) == 500 and len(stored) == 501
    assert set(ids) <= {i for _, i in stored}
    # the replies' wake-ups pass through call_soon (the count measures them)
    assert 1 <= scheduled < 100, f"{scheduled} callbacks scheduled for 500 events"

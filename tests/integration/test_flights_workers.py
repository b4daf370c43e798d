"""The flights workers' handlers (`examples.flights.workers`) in a real bus on a real redis-server,
with the real Lua scripts: a failed script call makes the consumer retry (a per-event handler) or
retry then split the batch (a batch handler, whose halves start again at ``ctx.attempt`` 1), and
the worker's report still counts each event once."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import anyio
import pytest
from redis.exceptions import ResponseError
from support import running, wait_until

from eventbus import EventBus
from eventbus.config import Settings
from examples.flights.flightdata import Flight
from examples.flights.workers import (
    AGGREGATE_GROUP,
    AGGREGATE_LUA,
    ORDER_GROUP,
    ORDER_LUA,
    Batcher,
    Deliveries,
    DemoKeys,
    Report,
    aggregate_handler,
    order_check_handler,
)

pytestmark = [pytest.mark.integration, pytest.mark.anyio]

TOPIC = "flights-t"
EVENTS = 8


class FailFirst:
    """A registered script whose first `n` calls fail (as a Redis error would), then the real
    script's results."""

    def __init__(self, script: Any, n: int) -> None:
        self.script, self.n, self.calls = script, n, 0

    async def __call__(self, **kwargs: Any) -> Any:
        self.calls += 1
        if self.calls <= self.n:
            raise ResponseError("injected failure")
        return await self.script(**kwargs)


def flight(i: int) -> Flight:
    return Flight(
        position=i,
        seq=i + 1,
        plane="N1",  # one plane: one shard, the events in one batch
        year=2013,
        month=1,
        day=1,
        time_hour="2013-01-01T05:00:00Z",
        sched_dep_time=515,
        dep_time=517,
        dep_delay=i,
        arr_delay=0,
        carrier="UA",
        flight=1545,
        tailnum="N1",
        origin="EWR",
        dest="IAH",
        air_time=227,
        distance=1400,
    )


async def publish_all(bus: EventBus) -> None:
    for i in range(EVENTS):
        await bus.publish(TOPIC, flight(i), resource_id="N1")


async def all_handled(r: Any, keys: DemoKeys, group: str) -> bool:
    """Whether `group`'s script recorded every event (its ``handled`` counter)."""
    return int(await r.hget(keys.counters(group), "handled") or 0) == EVENTS


async def test_a_split_batch_counts_each_event_once(
    settings: Callable[..., Settings], r: Any
) -> None:
    # max_attempts 2: the whole batch fails twice, then the handler gets its halves (attempt 1)
    bus = EventBus(settings(max_attempts=2, retry_base_s=0.001, retry_max_s=0.002))
    keys = DemoKeys(bus.settings.key_prefix, TOPIC)
    report = Report("aggregate-1", AGGREGATE_GROUP, 0)
    script = FailFirst(bus.redis.register_script(AGGREGATE_LUA), 2)
    script_keys = [keys.seen(AGGREGATE_GROUP), keys.aggregates, keys.counters(AGGREGATE_GROUP)]
    bus.subscriber(TOPIC, group=AGGREGATE_GROUP, batch=True, max_batch=500)(
        aggregate_handler(script, script_keys, report, Deliveries(report))
    )
    await publish_all(bus)  # before the consumer starts: its first batch holds all of them
    async with running(bus):
        await wait_until(lambda: all_handled(r, keys, AGGREGATE_GROUP))
    assert script.calls == 4  # 2 failed calls of all 8, then the two halves
    assert report.batches == 4
    assert report.calls == EVENTS  # was 24: every attempt and both halves counted
    assert len(report.latencies_ms) == EVENTS  # was 16: the halves' attempt 1 again
    assert report.duplicates == 0
    assert int(await r.hget(keys.counters(AGGREGATE_GROUP), "handled")) == EVENTS


async def test_a_retried_event_counts_once(settings: Callable[..., Settings], r: Any) -> None:
    bus = EventBus(settings(max_attempts=3, retry_base_s=0.001, retry_max_s=0.002))
    keys = DemoKeys(bus.settings.key_prefix, TOPIC)
    report = Report("order-check-1", ORDER_GROUP, 0)
    script = FailFirst(bus.redis.register_script(ORDER_LUA), 1)
    batcher = Batcher(
        script, [keys.last_seq, keys.seen(ORDER_GROUP), keys.counters(ORDER_GROUP)], report=report
    )
    bus.subscriber(TOPIC, group=ORDER_GROUP)(
        order_check_handler(batcher, report, Deliveries(report))
    )
    await publish_all(bus)
    async with anyio.create_task_group() as tg:
        await tg.start(batcher.run)
        async with running(bus):
            await wait_until(lambda: all_handled(r, keys, ORDER_GROUP))
        tg.cancel_scope.cancel()
    assert script.calls >= 2  # the first EVALSHA failed: its events were retried
    assert report.calls == EVENTS  # each event once, not once per attempt
    assert len(report.latencies_ms) == EVENTS
    assert report.violations == 0 and report.duplicates == 0

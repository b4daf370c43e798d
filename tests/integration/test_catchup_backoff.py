"""Catch-up from a corrupt archive is not retried sooner than the catch-up check
interval (`CATCH_UP_CHECK_S`). With the Redis backoff alone (`retry_base_s` 0.1 s) the store was
re-read 6-7 times in 12 s."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio
from support import Tick

from eventbus import EventBus
from eventbus.client.retry import backoff
from eventbus.config import Settings
from eventbus.consumer.catching_up import CATCH_UP_CHECK_S, CatchUpSchedule
from eventbus.tier import open_store


def test_a_failed_catch_up_waits_the_check_interval() -> None:
    defaults = Settings()
    now = [0.0]
    schedule = CatchUpSchedule(
        backoff(defaults.retry_base_s, defaults.retry_max_s), clock=lambda: now[0]
    )
    tries = []
    while now[0] < 12.0:  # 12 s of lock rounds, 20 per second
        if not schedule.backing_off(0):
            tries.append(now[0])
            schedule.failed(0)
        now[0] = round(now[0] + 0.05, 2)
    assert tries == [0.0, CATCH_UP_CHECK_S]


@pytest.mark.anyio
async def test_catch_up_from_a_corrupt_archive_is_not_retried_at_once(
    settings: Any, r: redis.asyncio.Redis, tmp_path: Path
) -> None:
    from eventbus.consumer import Consumer
    from eventbus.consumer.catchup import shard_hook
    from eventbus.locking.member import Member
    from eventbus.profiles import EVENTBUS

    s = settings(shards=1, retry_base_s=0.1, retry_max_s=10.0)  # the defaults
    segment = tmp_path / "orders" / "0" / f"{'0' * 19}1-{'0' * 20}-{'0' * 19}9-{'0' * 20}.parquet"
    segment.parent.mkdir(parents=True)
    segment.write_bytes(b"PAR1 garbage")  # a damaged segment where the group's entries are
    store = open_store(str(tmp_path))
    bus = EventBus(s, archive=store)

    @bus.subscriber("orders", group="billing")
    async def handle(event: Tick) -> None: ...

    stream = bus.keys.stream("orders", 0)
    for seq in range(3):
        await bus.publish("orders", Tick(resource="a", seq=seq), resource_id="a")
    await r.xgroup_create(stream, "billing", id="0")
    await r.xtrim(stream, maxlen=0)  # the group's next entries are only in the archive now
    await bus.registry.ensure(bus.subscriptions[0].topic)
    member = Member(bus.redis, bus.keys, s, "orders", "billing", "c-1", EVENTBUS)
    consumer = Consumer(member, bus.registry, bus.subscriptions[0])
    hook = shard_hook(store, consumer.handling)
    attempts: list[BaseException | None] = []

    async def counting(shard: int, token: int) -> object:
        try:
            result = await hook(shard, token)
        except Exception as exc:
            attempts.append(exc)
            raise
        attempts.append(None)
        return result

    consumer.pipeline.catch_up = counting
    await consumer.pipeline.reader.ensure_groups()
    started = time.monotonic()
    try:
        while time.monotonic() - started < 1.5:  # the Redis backoff would retry 3-5 times
            await consumer.pipeline.round(1)
            assert consumer.ownership.table.held == {}  # never read past the gap
    finally:
        await consumer.ownership.leave()
        await bus.aclose()
    assert len(attempts) == 1, attempts
    assert "corrupt" in str(attempts[0]).lower(), attempts

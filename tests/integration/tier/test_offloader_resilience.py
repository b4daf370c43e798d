"""The offloader keeps going: past topics it cannot archive, and through Redis errors."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import anyio
import pytest
from redis.exceptions import ConnectionError as RedisConnectionError
from support import async_client
from tier_support import fast_tier, make_bus, publish_ticks, wait_until

from eventbus.tier.offloader import Offloader, offload_until_caught_up
from eventbus.tier.store import open_store
from eventbus.tier.verify import verify_archive

pytestmark = [pytest.mark.anyio, pytest.mark.integration]

# registered by a foreign or older client that did not validate names
BAD_TOPICS = {"..": b"2", ".": b"2", "with space": b"2", "bad-count": b"zero"}


async def test_a_topic_that_cannot_be_archived_is_skipped_not_fatal(
    redis_db: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    bus = make_bus(redis_db, shards=2)
    client = async_client(redis_db)
    store = open_store(str(tmp_path))
    async with bus:
        published = await publish_ticks(bus, "good", 60)
        [(_, fields)] = await client.xrange(bus.keys.stream("good", 0), count=1)
        for name, shards in BAD_TOPICS.items():
            await client.hset(bus.keys.topics(), name, shards)
            await client.xadd(bus.keys.stream(name, 0), fields)

        with caplog.at_level(logging.ERROR, logger="eventbus.tier"):
            stats = await offload_until_caught_up(
                bus.redis, store, settings=bus.settings, tier=fast_tier(), timeout_s=30
            )

        assert stats.entries == 60
        assert stats.skipped_topics == len(BAD_TOPICS)
        assert verify_archive(store, "good", expected_entry_ids=published).exactly_once
        errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
        for name in BAD_TOPICS:
            assert sum(f"skips topic {name!r}" in m for m in errors) == 1, errors
            # never archived, so never trimmed: the entries wait in Redis
            assert await client.xlen(bus.keys.stream(name, 0)) == 1
    await bus.aclose()
    await client.aclose()


async def test_run_retries_failed_rounds_and_goes_on(
    redis_db: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    bus = make_bus(redis_db, shards=2, retry_base_s=0.01)
    store = open_store(str(tmp_path))
    async with bus:
        published = await publish_ticks(bus, "ticks", 100)
        off = Offloader(bus.redis, store, settings=bus.settings, tier=fast_tier())
        failures = 3
        real_now_ms = off._now_ms

        async def flaky_now_ms() -> int:  # the first Redis call of every round
            nonlocal failures
            if failures:
                failures -= 1
                raise RedisConnectionError("connection refused")
            return await real_now_ms()

        off._now_ms = flaky_now_ms  # type: ignore[method-assign]
        stop = anyio.Event()
        checkpoints = bus.keys.checkpoints("ticks")

        async def archived() -> bool:
            counts = [await bus.redis.hget(checkpoints, f"{s}:count") for s in (0, 1)]
            return sum(int(c or 0) for c in counts) == 100

        with caplog.at_level(logging.WARNING, logger="eventbus.tier"):
            async with anyio.create_task_group() as tg:
                tg.start_soon(off.run, stop)
                await wait_until(archived)
                stop.set()

        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert sum("round failed (ConnectionError: connection refused)" in m for m in warnings) == 3
        assert verify_archive(store, "ticks", expected_entry_ids=published).exactly_once
        locks = await bus.redis.hgetall(bus.keys.locks("ticks", "_offloader"))
        assert not [k for k in locks if not k.endswith(b":token")]  # released at the stop
    await bus.aclose()


async def test_a_stop_during_an_outage_ends_run_within_a_poll_interval(
    redis_db: str, tmp_path: Path
) -> None:
    bus = make_bus(redis_db, shards=2, retry_base_s=0.05)
    async with bus:
        await publish_ticks(bus, "ticks", 10)
        off = Offloader(
            bus.redis,
            open_store(str(tmp_path)),
            settings=bus.settings,
            tier=fast_tier(poll_interval_s=0.5),
        )

        async def down() -> int:
            raise RedisConnectionError("connection refused")

        off._now_ms = down  # type: ignore[method-assign]
        stop = anyio.Event()
        async with anyio.create_task_group() as tg:
            tg.start_soon(off.run, stop)
            await anyio.sleep(1.0)  # several failed rounds: the backoff reached its cap
            stopped_at = time.monotonic()
            stop.set()
        assert time.monotonic() - stopped_at < 0.5 + 0.3
    await bus.aclose()

"""The offloader's liveness between lock rounds: its heartbeats (`heartbeat_loop`, the same loop
as the consumer's) keep a long round live, retry a failed refresh, and drop the shards when the
liveness had lapsed."""

from __future__ import annotations

import logging
from pathlib import Path

import anyio
import pytest
from redis.exceptions import ConnectionError as RedisConnectionError
from tier_support import fast_tier, make_bus, publish_ticks, wait_until

from eventbus.locking.locks import LockClient
from eventbus.tier.offloader import Offloader
from eventbus.tier.settings import OFFLOADER_GROUP
from eventbus.tier.store import open_store
from eventbus.tier.verify import verify_archive

pytestmark = [pytest.mark.anyio, pytest.mark.integration]

TTL_S = 1.0  # liveness TTL: heartbeats every 1/3 s, a failed one retried after 0.1 s


class PausedRound:
    """A hook that holds the offloader's first round before its first put until `resume`, so
    no lock round refreshes the liveness meanwhile: only heartbeats do."""

    def __init__(self) -> None:
        self.reached, self.resume = anyio.Event(), anyio.Event()

    async def __call__(self, point: str, shard: int, key: str) -> None:
        if point == "before_put" and not self.reached.is_set():
            self.reached.set()
            await self.resume.wait()


async def test_heartbeats_keep_a_long_round_live_through_a_failed_one(
    redis_db: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The first heartbeat fails (a lost connection): it is logged at WARNING, not swallowed,
    and retried; heartbeats alone then keep the member live for more than a TTL after its
    last lock round, so it keeps its shard and finishes the round."""
    replies: list[bool | str] = []
    enough = anyio.Event()
    heartbeat = LockClient.heartbeat

    async def flaky_heartbeat(self: LockClient) -> bool:
        if not replies:
            replies.append("failed")
            raise RedisConnectionError("connection reset (injected)")
        was_live = await heartbeat(self)
        replies.append(was_live)
        if replies.count(True) >= 4 or not was_live:  # 4 x TTL/3 > TTL after the lock round
            enough.set()
        return was_live

    monkeypatch.setattr(LockClient, "heartbeat", flaky_heartbeat)
    bus = make_bus(redis_db, shards=1, liveness_ttl_s=TTL_S)
    store = open_store(str(tmp_path))
    paused, stop = PausedRound(), anyio.Event()
    async with bus:
        published = await publish_ticks(bus, "beat", 100)
        off = Offloader(bus.redis, store, settings=bus.settings, tier=fast_tier(), hook=paused)
        with caplog.at_level(logging.WARNING):
            async with anyio.create_task_group() as tg:
                tg.start_soon(off.run, stop)
                with anyio.fail_after(30):
                    await paused.reached.wait()
                    await enough.wait()
                assert replies[0] == "failed" and all(r is True for r in replies[1:]), replies
                assert list(off._topics["beat"].held) == [0]  # never dropped
                paused.resume.set()
                await wait_until(lambda: off.stats.entries == 100, within_s=30)
                stop.set()
        failed = [r for r in caplog.records if "heartbeat failed" in r.getMessage()]
        assert [r.levelno for r in failed] == [logging.WARNING]
        assert "connection reset (injected)" in failed[0].getMessage()
        assert not [r for r in caplog.records if "liveness had expired" in r.getMessage()]
        assert verify_archive(store, "beat", expected_entry_ids=published).exactly_once
    await bus.aclose()


async def test_a_heartbeat_that_finds_the_liveness_lapsed_drops_the_shards(
    redis_db: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A paused round's liveness lapses (its member entry is gone): the next heartbeat drops
    the held shards with a warning, and the next round takes them again and archives
    everything exactly once."""
    bus = make_bus(redis_db, shards=1, liveness_ttl_s=TTL_S)
    store = open_store(str(tmp_path))
    paused, stop = PausedRound(), anyio.Event()
    async with bus:
        published = await publish_ticks(bus, "lapse", 100)
        off = Offloader(
            bus.redis, store, settings=bus.settings, tier=fast_tier(), hook=paused, consumer_id="o"
        )
        with caplog.at_level(logging.WARNING, logger="eventbus.tier"):
            async with anyio.create_task_group() as tg:
                tg.start_soon(off.run, stop)
                with anyio.fail_after(30):
                    await paused.reached.wait()
                topic = off._topics["lapse"]
                assert list(topic.held) == [0]
                await bus.redis.zrem(bus.keys.members("lapse", OFFLOADER_GROUP), "o")
                await wait_until(lambda: not topic.held, within_s=30)
                paused.resume.set()
                await wait_until(lambda: off.stats.entries == 100 and bool(topic.held))
                stop.set()
        dropped = [r.getMessage() for r in caplog.records if "liveness had expired" in r.msg]
        assert len(dropped) == 1 and "lapse shards [0]" in dropped[0], dropped
        assert verify_archive(store, "lapse", expected_entry_ids=published).exactly_once
    await bus.aclose()

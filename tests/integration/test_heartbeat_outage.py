"""A Redis outage under a running heartbeat (`eventbus.locking.lease.heartbeat_loop`), on a real
redis-server stopped and started again: a failed heartbeat is retried every TTL/10, and the log
gets one WARNING for the outage (not one per retry) and one INFO once Redis answers again."""

from __future__ import annotations

import logging

import anyio
import pytest

from eventbus import Settings
from eventbus.client.connection import connect
from eventbus.locking.lease import heartbeat_loop
from eventbus.locking.locks import LockClient
from eventbus.locking.member import Member
from eventbus.profiles import EVENTBUS
from eventbus.protocol.keys import Keys
from localredis.server import RedisServer

pytestmark = [pytest.mark.anyio, pytest.mark.integration]

TTL_S = 0.5  # heartbeats every 1/6 s; a failed one retried after 0.05 s
FAILURES = 20  # failed heartbeats awaited while Redis is down (about 1 s of outage)


class CountedLocks:
    """A real `LockClient` whose heartbeats are counted: `answered` is set by a heartbeat Redis
    answered, `down` once `FAILURES` have failed, `recovered` by the first answered after them."""

    def __init__(self, locks: LockClient) -> None:
        self.locks = locks
        self.member_id = locks.member_id
        self.failures = 0
        self.answered, self.down, self.recovered = anyio.Event(), anyio.Event(), anyio.Event()

    @property
    def acquiring(self) -> bool:
        return self.locks.acquiring

    async def heartbeat(self) -> bool:
        try:
            was_live = await self.locks.heartbeat()
        except Exception:
            self.failures += 1
            if self.failures >= FAILURES:
                self.down.set()
            raise
        self.answered.set()
        if self.failures:
            self.recovered.set()
        return was_live


async def test_a_redis_outage_logs_one_warning_then_the_recovery_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    expired: list[str] = []
    with RedisServer() as server:
        settings = Settings(redis_url=server.url, liveness_ttl_s=TTL_S)
        redis = connect(settings)
        keys = Keys(settings.key_prefix, settings.hashtag)
        locks = CountedLocks(
            LockClient(Member(redis, keys, settings, "t", "g", "c-1", EVENTBUS), shards=1)
        )
        await locks.locks.acquire([0])  # joined: the heartbeats find the member live
        joined = anyio.Event()
        joined.set()
        try:
            with caplog.at_level(logging.INFO, logger="eventbus.locking"):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(
                        heartbeat_loop, locks, TTL_S, joined, None, lambda: expired.append("x")
                    )
                    with anyio.fail_after(30):
                        await locks.answered.wait()
                        await anyio.to_thread.run_sync(server.stop)
                        await locks.down.wait()
                        await anyio.to_thread.run_sync(server.start)  # empty: no AOF
                        await locks.recovered.wait()
                    tg.cancel_scope.cancel()
        finally:
            await redis.aclose()
    records = [r for r in caplog.records if r.name == "eventbus.locking"]
    warnings = [r.getMessage() for r in records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings  # not one per failed heartbeat
    assert warnings[0].startswith("c-1: heartbeat failed: ")
    [recovered] = [r.getMessage() for r in records if r.levelno == logging.INFO]
    assert recovered.startswith(f"c-1: heartbeat answered again after {locks.failures} failed")
    assert locks.failures >= FAILURES
    assert expired == ["x"]  # the restarted Redis had forgotten the member: locks dropped

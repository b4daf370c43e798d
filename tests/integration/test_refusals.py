"""Persistent error replies mid-run (issue 10 item 9): a consumer whose commands Redis refuses
(here NOPERM under an ACL) keeps backing off, logs the refused command and the server's reason
at ERROR, counts it in ``eventbus_redis_refusals_total``, and goes on once the operator fixes it;
it never reads a shard past pending entries whose recovery was refused."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

import anyio
import pytest
import redis
import redis.asyncio
from support import Recorder, Tick, wait_until

from eventbus import EventBus, Settings
from eventbus.ops.metrics import METRICS

pytestmark = pytest.mark.anyio


@pytest.fixture
def restricted(redis_db: str) -> Iterator[Callable[[str], str]]:
    """`restricted("-xack")`: a URL of a user allowed everything but the given commands."""
    base = redis_db.removeprefix("redis://")
    admin = redis.Redis.from_url(redis_db)

    def make(*denied: str) -> str:
        admin.execute_command(
            "ACL", "SETUSER", "limited", "reset", "on", ">pw", "~*", "&*", "+@all", *denied
        )
        return f"redis://limited:pw@{base}"

    yield make
    admin.acl_deluser("limited")
    admin.close()


def _refusals(command: str) -> float:
    return METRICS.redis_refusals.labels("t", "g", command)._value.get()


async def test_a_refused_xack_is_reported_and_retried_until_allowed(
    settings: Callable[..., Settings],
    restricted: Callable[..., str],
    redis_db: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    url = restricted("-xack")
    before = _refusals("XACK")
    rec = Recorder()
    bus = EventBus(settings(redis_url=url, shards=1, retry_max_s=0.2))
    bus.subscriber("t", group="g")(rec.add)
    admin = redis.asyncio.Redis.from_url(redis_db)
    stop = anyio.Event()
    with caplog.at_level(logging.ERROR, logger="eventbus.consumer"):
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: bus.run(stop=stop))
            await wait_until(lambda: bus.consumers and bus.running)
            await bus.publish("t", Tick(resource="a", seq=1), resource_id="a")
            await rec.wait_for(1)
            await wait_until(lambda: _refusals("XACK") - before >= 2)  # retried, loudly
            stream = bus.keys.stream("t", 0)
            assert (await admin.xpending(stream, "g"))["pending"] == 1
            await admin.execute_command("ACL", "SETUSER", "limited", "+xack")  # the fix
            await wait_until(lambda: _pending_zero(admin, stream))
            stop.set()
    await admin.aclose()
    # the server's reason: redis-py names it by the exception type inside pipelines
    assert any(
        "XACK" in m and ("NOPERM" in m or "NoPermissionError" in m)
        for m in (r.getMessage() for r in caplog.records)
    )


async def test_a_refused_recovery_is_reported_and_the_shard_not_read_past(
    settings: Callable[..., Settings],
    restricted: Callable[..., str],
    redis_db: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Entry A is pending (delivered to a consumer that died); XAUTOCLAIM is refused: B, a later
    entry of the same resource, must not be handled before A."""
    admin = redis.asyncio.Redis.from_url(redis_db)
    seed = EventBus(settings(shards=1))
    async with seed:
        stream = seed.keys.stream("t", 0)
        await admin.xgroup_create(stream, "g", id="0", mkstream=True)
        await seed.publish("t", Tick(resource="a", seq=1), resource_id="a")
        await admin.xreadgroup("g", "dead", {stream: ">"}, count=1)  # A pending for "dead"
        await seed.publish("t", Tick(resource="a", seq=2), resource_id="a")
    url = restricted("-xautoclaim")
    before = _refusals("XAUTOCLAIM")
    rec = Recorder()
    bus = EventBus(settings(redis_url=url, shards=1, retry_max_s=0.2))
    bus.subscriber("t", group="g")(rec.add)
    stop = anyio.Event()
    with caplog.at_level(logging.ERROR, logger="eventbus.consumer"):
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: bus.run(stop=stop))
            await wait_until(lambda: _refusals("XAUTOCLAIM") - before >= 2)
            assert rec.log == []  # B was not read past A
            await admin.execute_command("ACL", "SETUSER", "limited", "+xautoclaim")
            await rec.wait_for(2)
            stop.set()
    await admin.aclose()
    assert rec.by_resource() == {"a": [1, 2]}
    assert any(
        "XAUTOCLAIM" in m and ("NOPERM" in m or "NoPermissionError" in m)
        for m in (r.getMessage() for r in caplog.records)
    )


async def test_entries_read_before_a_refused_summary_are_not_read_past(
    settings: Callable[..., Settings],
    restricted: Callable[..., str],
    redis_db: str,
) -> None:
    """Issue 18: the read round's XPENDING summary (fenced delivery) is refused after the
    XREADGROUP delivered A. A is not dispatched (it cannot be checked), and it must not stay
    stranded in the consumer's PEL while the next round reads B, a later entry of the same
    resource: the round fails like a lost reply, the shard's PEL is claimed again, and once the
    operator allows XPENDING, A is handled, then B. (Before, the summary's error was raised as
    a refusal and the next round read B past A.)"""
    url = restricted("-xpending")
    rec = Recorder()
    bus = EventBus(settings(redis_url=url, shards=1, retry_max_s=0.2))
    bus.subscriber("t", group="g")(rec.add)
    admin = redis.asyncio.Redis.from_url(redis_db)
    stop = anyio.Event()
    async with anyio.create_task_group() as tg:
        tg.start_soon(lambda: bus.run(stop=stop))
        await wait_until(lambda: bus.consumers and bus.running)
        stream = bus.keys.stream("t", 0)
        await bus.publish("t", Tick(resource="a", seq=1), resource_id="a")
        await wait_until(lambda: _pending_is(admin, stream, 1))  # A read, not handled
        await bus.publish("t", Tick(resource="a", seq=2), resource_id="a")
        assert rec.log == []
        await admin.execute_command("ACL", "SETUSER", "limited", "+xpending")  # the fix
        await rec.wait_for(2)
        await wait_until(lambda: _pending_zero(admin, stream))
        stop.set()
    await admin.aclose()
    assert rec.by_resource() == {"a": [1, 2]}


async def _pending_is(r: redis.asyncio.Redis, stream: str, n: int) -> bool:
    return bool((await r.xpending(stream, "g"))["pending"] == n)


async def _pending_zero(r: redis.asyncio.Redis, stream: str) -> bool:
    return not (await r.xpending(stream, "g"))["pending"]

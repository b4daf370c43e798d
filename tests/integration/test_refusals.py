"""Persistent error replies mid-run: a consumer whose commands Redis refuses (here NOPERM under an
ACL) keeps backing off, logs the refused command and the server's reason at ERROR, counts it in
``eventbus_redis_refusals_total``, and goes on once the operator fixes it; it never reads a shard
past pending entries whose recovery was refused."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Iterator

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


def _logged_with_its_reason(caplog: pytest.LogCaptureFixture, command: str) -> bool:
    """A record names the refused `command` and the server's reason (redis-py names it by the
    exception type inside pipelines)."""
    return any(
        command in m and ("NOPERM" in m or "NoPermissionError" in m) for m in caplog.messages
    )


@contextlib.asynccontextmanager
async def _consuming(
    settings: Callable[..., Settings], url: str, **subscriber: object
) -> AsyncIterator[tuple[EventBus, Recorder]]:
    """A bus on `url` (one shard, backing off 0.2 s at most) whose consumer of topic "t", group
    "g" (or as `subscriber` says) records what it handles, running until the block ends (then
    stopped gracefully)."""
    rec = Recorder()
    bus = EventBus(settings(redis_url=url, shards=1, retry_max_s=0.2))
    bus.subscriber("t", **(subscriber or {"group": "g"}))(rec.add)
    stop = anyio.Event()
    async with anyio.create_task_group() as tg:
        tg.start_soon(lambda: bus.run(stop=stop))
        yield bus, rec
        stop.set()


async def test_a_refused_xack_is_reported_and_retried_until_allowed(
    settings: Callable[..., Settings],
    restricted: Callable[..., str],
    r: redis.asyncio.Redis,
    caplog: pytest.LogCaptureFixture,
) -> None:
    url = restricted("-xack")
    before = _refusals("XACK")
    with caplog.at_level(logging.ERROR, logger="eventbus.consumer"):
        async with _consuming(settings, url) as (bus, rec):
            await wait_until(lambda: bus.consumers and bus.running)
            await bus.publish("t", Tick(resource="a", seq=1), resource_id="a")
            await rec.wait_for(1)
            await wait_until(lambda: _refusals("XACK") - before >= 2)  # retried, loudly
            stream = bus.keys.stream("t", 0)
            assert (await r.xpending(stream, "g"))["pending"] == 1
            await r.execute_command("ACL", "SETUSER", "limited", "+xack")  # the fix
            await wait_until(lambda: _pending_zero(r, stream))
    assert _logged_with_its_reason(caplog, "XACK")


async def test_a_refused_recovery_is_reported_and_the_shard_not_read_past(
    settings: Callable[..., Settings],
    restricted: Callable[..., str],
    r: redis.asyncio.Redis,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Entry A is pending (delivered to a consumer that died); XAUTOCLAIM is refused: B, a later
    entry of the same resource, must not be handled before A."""
    seed = EventBus(settings(shards=1))
    async with seed:
        stream = seed.keys.stream("t", 0)
        await r.xgroup_create(stream, "g", id="0", mkstream=True)
        await seed.publish("t", Tick(resource="a", seq=1), resource_id="a")
        await r.xreadgroup("g", "dead", {stream: ">"}, count=1)  # A pending for "dead"
        await seed.publish("t", Tick(resource="a", seq=2), resource_id="a")
    url = restricted("-xautoclaim")
    before = _refusals("XAUTOCLAIM")
    with caplog.at_level(logging.ERROR, logger="eventbus.consumer"):
        async with _consuming(settings, url) as (_, rec):
            await wait_until(lambda: _refusals("XAUTOCLAIM") - before >= 2)
            assert rec.log == []  # B was not read past A
            await r.execute_command("ACL", "SETUSER", "limited", "+xautoclaim")
            await rec.wait_for(2)
    assert rec.by_resource() == {"a": [1, 2]}
    assert _logged_with_its_reason(caplog, "XAUTOCLAIM")


async def test_entries_read_before_a_refused_summary_are_not_read_past(
    settings: Callable[..., Settings],
    restricted: Callable[..., str],
    r: redis.asyncio.Redis,
) -> None:
    """The read round's XPENDING summary (fenced delivery) is refused after the
    XREADGROUP delivered A. A is not dispatched (it cannot be checked), and it must not stay
    stranded in the consumer's PEL while the next round reads B, a later entry of the same
    resource: the round fails like a lost reply, the shard's PEL is claimed again, and once the
    operator allows XPENDING, A is handled, then B. (Before, the summary's error was raised as
    a refusal and the next round read B past A.)"""
    url = restricted("-xpending")
    async with _consuming(settings, url) as (bus, rec):
        await wait_until(lambda: bus.consumers and bus.running)
        stream = bus.keys.stream("t", 0)
        await bus.publish("t", Tick(resource="a", seq=1), resource_id="a")
        await wait_until(lambda: _pending_is(r, stream, 1))  # A read, not handled
        await bus.publish("t", Tick(resource="a", seq=2), resource_id="a")
        assert rec.log == []
        await r.execute_command("ACL", "SETUSER", "limited", "+xpending")  # the fix
        await rec.wait_for(2)
        await wait_until(lambda: _pending_zero(r, stream))
    assert rec.by_resource() == {"a": [1, 2]}


async def _pending_is(r: redis.asyncio.Redis, stream: str, n: int) -> bool:
    return bool((await r.xpending(stream, "g"))["pending"] == n)


async def _pending_zero(r: redis.asyncio.Redis, stream: str) -> bool:
    return not (await r.xpending(stream, "g"))["pending"]


async def test_an_error_reply_of_the_parked_set_read_is_a_refusal_not_a_missing_group(
    settings: Callable[..., Settings], r: redis.asyncio.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    """The read loop took every error reply that no `refused` named for NOGROUP. The
    parked set's ``HGETALL`` (a new lock of a ``park`` subscriber) answered WRONGTYPE: the loop
    said "group missing ... created again", dropped every shard and went on without backing
    off. Now it is a refusal like the others: named with the server's reason, counted, retried,
    and the shard is not read while its parked set is unknown; once fixed, the event runs."""
    rec = Recorder()
    bus = EventBus(settings(shards=1, retry_max_s=0.2))
    bus.subscriber("t", group="g", on_failure="park")(rec.add)
    parked = bus.keys.parked("t", "g")
    await r.set(parked, b"not a hash")  # an operator's mistake, say
    before = _refusals("HGETALL")
    stop = anyio.Event()
    with caplog.at_level(logging.WARNING, logger="eventbus.consumer"):
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: bus.run(stop=stop))
            await bus.publish("t", Tick(resource="a", seq=1), resource_id="a")
            await wait_until(lambda: _refusals("HGETALL") - before >= 2)
            assert rec.log == []  # its parked set unknown: the shard was not read
            await r.delete(parked)  # the fix
            await rec.wait_for(1)
            stop.set()
    assert not [m for m in caplog.messages if "group missing" in m]
    assert [m for m in caplog.messages if "HGETALL" in m and "WRONGTYPE" in m]


async def test_a_refused_acked_trim_is_reported_and_the_shards_are_read_on(
    settings: Callable[..., Settings],
    restricted: Callable[..., str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A ``retention="acked"`` consumer whose user may not XTRIM (the trimming rules
    of docs/security.md left out). The trim failed the round every time it was due, before the
    read, so the shard stayed unread while the error lasted (earlier as a hot
    "group missing" loop). Now the refused trim is named, counted and logged, and the events
    are handled all the same."""
    url = restricted("-xtrim")
    rec = Recorder()
    s = settings(redis_url=url, shards=1, retention="acked", trim_check_s=0.01, retry_max_s=0.2)
    bus = EventBus(s)
    bus.subscriber("t", group="g")(rec.add)
    command = "XTRIM (retention=acked)"
    before = _refusals(command)
    stop = anyio.Event()
    with caplog.at_level(logging.ERROR, logger="eventbus.consumer"):
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: bus.run(stop=stop))
            for seq in range(5):
                await bus.publish("t", Tick(resource="a", seq=seq), resource_id="a")
            await rec.wait_for(5)
            await wait_until(lambda: _refusals(command) - before >= 2)
            stop.set()
    assert rec.by_resource() == {"a": [0, 1, 2, 3, 4]}
    assert _logged_with_its_reason(caplog, "XTRIM")


async def test_a_refused_trim_check_is_reported_and_nothing_read_unchecked(
    settings: Callable[..., Settings],
    restricted: Callable[..., str],
    r: redis.asyncio.Redis,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A consumer user without ``+xinfo|stream``: the group's trim check was skipped without a
    word (no log, no metric), so entries trimmed before the group read them went unnoticed.
    Now the refusal fails the round like the broadcast check's: named, counted, logged with
    the server's reason, retried; nothing is read unchecked, and once the operator allows the
    command the events are handled."""
    url = restricted("-xinfo|stream")
    command = "XINFO / XADD (trim check)"
    before = _refusals(command)
    with caplog.at_level(logging.ERROR, logger="eventbus.consumer"):
        async with _consuming(settings, url) as (bus, rec):
            await bus.publish("t", Tick(resource="a", seq=1), resource_id="a")
            await wait_until(lambda: _refusals(command) - before >= 2)
            assert rec.log == []
            await r.execute_command("ACL", "SETUSER", "limited", "+xinfo|stream")
            await rec.wait_for(1)
    assert _logged_with_its_reason(caplog, "XINFO")


async def test_a_refused_broadcast_read_is_reported_like_a_groups_and_retried_until_allowed(
    settings: Callable[..., Settings],
    restricted: Callable[..., str],
    r: redis.asyncio.Redis,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A broadcast subscriber whose user may not ``XREAD``: its failed reads were logged at
    WARNING and counted nowhere. Now it reads through a group's read loop: the refusal is
    named, counted in ``eventbus_redis_refusals_total``, logged at ERROR with the server's
    reason, retried; once the operator allows the command the events are handled."""
    url = restricted("-xread")
    refusals = METRICS.redis_refusals.labels("t", "_broadcast", "XREAD")
    before = refusals._value.get()
    with caplog.at_level(logging.ERROR, logger="eventbus.consumer"):
        async with _consuming(settings, url, broadcast=True) as (bus, rec):
            await wait_until(lambda: refusals._value.get() - before >= 2)
            await bus.publish("t", Tick(resource="a", seq=1), resource_id="a")
            await r.execute_command("ACL", "SETUSER", "limited", "+xread")
            await rec.wait_for(1)
    assert _logged_with_its_reason(caplog, "XREAD")

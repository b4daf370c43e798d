"""Issue 10 item 17: the publisher and consumer ACLs of docs/security.md, on a real redis-server.

Each role runs its real code path under its ACL user, and is refused what it must not do.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest
import redis
import redis.asyncio
from redis.exceptions import NoPermissionError
from support import Recorder, Tick, wait_until

from eventbus import Context, EventBus, Settings

pytestmark = pytest.mark.anyio
DOC = Path(__file__).parents[2] / "docs" / "security.md"
ROLES = ("publisher", "consumer", "offloader", "operator")


def _acl(role: str) -> list[str]:
    """The ACL rules of `role` as written in docs/security.md (comments dropped)."""
    text = DOC.read_text()
    block = re.search(rf"```\nACL SETUSER {role} (.*?)```", text, re.S)
    assert block is not None, role
    rules = " ".join(line.split("#")[0] for line in block.group(1).splitlines())
    return [r.replace("PASSWORD", f"{role}-pw") for r in rules.split()]


@pytest.fixture
def users(redis_db: str) -> Iterator[dict[str, str]]:
    base = redis_db.removeprefix("redis://")
    with redis.Redis.from_url(redis_db) as r:
        for role in ROLES:
            r.execute_command("ACL", "SETUSER", role, *_acl(role))
    yield {role: f"redis://{role}:{role}-pw@{base}" for role in ROLES}
    with redis.Redis.from_url(redis_db) as r:
        r.acl_deluser(*ROLES)


async def test_publisher_role_publishes_and_nothing_else(users: dict[str, str]) -> None:
    bus = EventBus(Settings(redis_url=users["publisher"], shards=2))
    async with bus:
        assert await bus.publish("orders", Tick(resource="a", seq=0), resource_id="a")
        assert len(await bus.publish_many("orders", [("b", Tick(resource="b", seq=0))])) == 1
        r = bus.redis
        stream = bus.keys.stream("orders", 0)
        with pytest.raises(NoPermissionError):
            await r.xack(stream, "billing", "0-1")
        with pytest.raises(NoPermissionError):
            await r.xreadgroup("billing", "c", {stream: ">"})
        with pytest.raises(NoPermissionError):
            await r.hset(bus.keys.parked("orders", "billing"), "a", "1-0")
        with pytest.raises(NoPermissionError):
            await r.xadd(bus.keys.dead_letter("orders", "billing"), {"x": "y"})
    await bus.aclose()


async def test_consumer_role_handles_events(users: dict[str, str], redis_db: str) -> None:
    publisher = EventBus(Settings(redis_url=users["publisher"], shards=2))
    async with publisher:
        for i in range(5):
            await publisher.publish("orders", Tick(resource="a", seq=i), resource_id="a")
    await publisher.aclose()

    bus = EventBus(Settings(redis_url=users["consumer"], shards=2, block_max_ms=50))
    seen = Recorder()

    @bus.subscriber("orders", group="billing")
    async def handle(event: Tick, ctx: Context) -> None:
        seen.add(event, ctx)

    stop = anyio.Event()
    async with anyio.create_task_group() as tg:
        tg.start_soon(lambda: bus.run(stop=stop))
        await seen.wait_for(5)
        stop.set()
    assert seen.by_resource() == {"a": [0, 1, 2, 3, 4]}
    with pytest.raises(NoPermissionError):  # no administration
        await bus.redis.config_get("maxmemory")
    with pytest.raises(NoPermissionError):  # no keys outside eventbus's
        await bus.redis.set("other:key", "1")
    await bus.aclose()
    with redis.Redis.from_url(redis_db) as r:
        pending = r.xpending(bus.keys.stream("orders", 0), "billing")["pending"]
        pending += r.xpending(bus.keys.stream("orders", 1), "billing")["pending"]
    assert pending == 0


async def test_consumer_role_claims_a_stale_read_and_records_trims(
    users: dict[str, str], redis_db: str
) -> None:
    """The consumer's rarer paths run under its ACL too: fenced delivery claims what a stale
    read left pending (XPENDING, XCLAIM) and a trim check records entries trimmed unread."""
    admin = redis.asyncio.Redis.from_url(redis_db)
    bus = EventBus(
        Settings(redis_url=users["consumer"], shards=1, block_max_ms=50, trim_check_s=0.05)
    )
    seen = Recorder()
    bus.subscriber("acl", group="g")(seen.add)
    stream = bus.keys.stream("acl", 0)
    stop = anyio.Event()
    async with anyio.create_task_group() as tg:
        tg.start_soon(lambda: bus.run(stop=stop))
        await wait_until(lambda: bus.consumers and bus.consumers[0].table.held)
        fields = bus.publisher.prepare(bus.topic("acl"), Tick(resource="a", seq=1), "a")[1]
        async with admin.pipeline(transaction=True) as tx:  # a stale consumer's late read
            tx.xadd(stream, fields)
            tx.xreadgroup("g", "stale", {stream: ">"})
            await tx.execute()
        await seen.wait_for(1)
        async with admin.pipeline(transaction=True) as tx:  # trimmed before anyone reads
            for i in range(2, 12):
                tx.xadd(
                    stream,
                    bus.publisher.prepare(bus.topic("acl"), Tick(resource="a", seq=i), "a")[1],
                )
            tx.xtrim(stream, maxlen=0, approximate=False)
            await tx.execute()
        await wait_until(lambda: _exists(admin, bus.keys.trimmed("acl", "g")))
        stop.set()
    await bus.aclose()
    await admin.aclose()
    assert [h.seq for h in seen.log] == [1]


async def test_offloader_role_archives_and_nothing_else(
    users: dict[str, str], redis_db: str, tmp_path: Path
) -> None:
    from eventbus.tier import TierSettings, offload_until_caught_up, open_store

    publisher = EventBus(Settings(redis_url=redis_db, shards=2))
    async with publisher:
        for i in range(10):
            await publisher.publish("orders", Tick(resource=f"r{i}", seq=i), resource_id=f"r{i}")
    await publisher.aclose()
    settings = Settings(redis_url=users["offloader"], shards=2)
    r = redis.asyncio.Redis.from_url(users["offloader"])
    tier = TierSettings(hot_window_s=0, trim_exact=True)
    stats = await offload_until_caught_up(
        r, open_store(f"file://{tmp_path}"), settings=settings, tier=tier, timeout_s=60
    )
    assert stats.entries == 10
    with pytest.raises(NoPermissionError):  # it never publishes, reads a group or acks
        await r.xadd(publisher.keys.stream("orders", 0), {"x": "y"})
    with pytest.raises(NoPermissionError):
        await r.xack(publisher.keys.stream("orders", 0), "g", "0-1")
    await r.aclose()


def test_operator_role_inspects_and_nothing_else(users: dict[str, str], redis_db: str) -> None:
    from typer.testing import CliRunner

    from eventbus.cli import app

    with redis.Redis.from_url(redis_db) as admin:
        admin.hset("eventbus:{eventbus}:topics", "orders", 2)
    runner = CliRunner(env={"COLUMNS": "200"})
    for args in (["stats"], ["dlq", "list", "orders", "billing"], ["tail", "orders"]):
        result = runner.invoke(app, [*args, "--redis-url", users["operator"]])
        assert result.exit_code == 0, (args, result.output)
    with redis.Redis.from_url(users["operator"]) as r:
        with pytest.raises(NoPermissionError):  # it reads no group and acks nothing
            r.xreadgroup("billing", "op", {"eventbus:stream:orders:0": ">"})
        with pytest.raises(NoPermissionError):
            r.config_get("maxmemory")


async def _exists(r: redis.asyncio.Redis, key: str) -> bool:
    return bool(await r.exists(key))

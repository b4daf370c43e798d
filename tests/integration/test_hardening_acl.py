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
from redis.exceptions import NoPermissionError
from support import Recorder, Tick

from eventbus import Context, EventBus, Settings

pytestmark = pytest.mark.anyio
DOC = Path(__file__).parents[2] / "docs" / "security.md"


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
        for role in ("publisher", "consumer"):
            r.execute_command("ACL", "SETUSER", role, *_acl(role))
    yield {role: f"redis://{role}:{role}-pw@{base}" for role in ("publisher", "consumer")}
    with redis.Redis.from_url(redis_db) as r:
        r.acl_deluser("publisher", "consumer")


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

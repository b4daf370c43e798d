"""Issue 10 item 17: the publisher and consumer ACLs of docs/security.md, on a real redis-server
and on a Redis Cluster (with the Cluster additions of the same page, on every node).

Each role runs its real code path under its ACL user, and is refused what it must not do.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
import redis
import redis.asyncio
from redis.exceptions import NoPermissionError
from support import Recorder, Tick, async_client, sync_client, wait_until

from eventbus import Context, EventBus, RedisUnavailable, Settings

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


def _cluster_acl(role: str) -> list[str]:
    """The rules docs/security.md adds for `role` on a Redis Cluster."""
    line = re.search(rf"^ACL SETUSER {role} (\+cluster\|slots.*)$", DOC.read_text(), re.M)
    assert line is not None, role
    return line.group(1).split()


@pytest.fixture
def nodes(redis_db: str, topology: str, request: pytest.FixtureRequest) -> Iterator[list[Any]]:
    """An admin client of every Redis node (one, or every node of the Cluster)."""
    if topology == "cluster":
        ports = [n.port for n in request.getfixturevalue("redis_cluster").nodes]
        clients = [redis.Redis(port=p) for p in ports]
    else:
        clients = [redis.Redis.from_url(redis_db)]
    yield clients
    for c in clients:
        c.close()


@pytest.fixture
def users(redis_db: str, topology: str, nodes: list[Any]) -> Iterator[dict[str, str]]:
    """Role -> URL of its ACL user, created on every node (a Cluster keeps users per node);
    the ACL log starts empty."""
    base = redis_db.removeprefix("redis://")
    for r in nodes:
        for role in ROLES:
            extra = _cluster_acl(role) if topology == "cluster" else []
            r.execute_command("ACL", "SETUSER", role, *_acl(role), *extra)
        r.execute_command("ACL", "LOG", "RESET")
    yield {role: f"redis://{role}:{role}-pw@{base}" for role in ROLES}
    for r in nodes:
        r.acl_deluser(*ROLES)


def _refused(nodes: list[Any], role: str) -> list[str]:
    """What any node refused `role` so far (its ACL log): commands and keys."""
    out = []
    for r in nodes:
        for entry in r.execute_command("ACL", "LOG", "128"):
            fields = dict(zip(entry[::2], entry[1::2], strict=True))
            if fields[b"username"] == role.encode():
                out.append(fields[b"object"].decode())
    return out


def _blocked_reads(nodes: list[Any], role: str) -> int:
    """Connections of `role` waiting in a blocking command (CLIENT LIST flag b)."""
    return sum(c["user"] == role and "b" in c["flags"] for r in nodes for c in r.client_list())


async def test_publisher_role_publishes_and_nothing_else(
    users: dict[str, str], settings: Callable[..., Settings], nodes: list[Any]
) -> None:
    bus = EventBus(settings(redis_url=users["publisher"], shards=2))
    async with bus:
        assert await bus.publish("orders", Tick(resource="a", seq=0), resource_id="a")
        assert len(await bus.publish_many("orders", [("b", Tick(resource="b", seq=0))])) == 1
        assert _refused(nodes, "publisher") == []
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


async def test_consumer_role_handles_events(
    users: dict[str, str],
    redis_db: str,
    settings: Callable[..., Settings],
    nodes: list[Any],
    topology: str,
) -> None:
    publisher = EventBus(settings(redis_url=users["publisher"], shards=4))
    bus = EventBus(
        settings(redis_url=users["consumer"], shards=4, block_max_ms=500, idle_release_ms=60_000)
    )
    seen = Recorder()

    @bus.subscriber("orders", group="billing")
    async def handle(event: Tick, ctx: Context) -> None:
        seen.add(event, ctx)

    stop = anyio.Event()
    async with publisher, anyio.create_task_group() as tg:
        for i in range(5):
            await publisher.publish("orders", Tick(resource="a", seq=i), resource_id="a")
        tg.start_soon(lambda: bus.run(stop=stop))
        await seen.wait_for(5)
        # idle, it blocks on its streams (on a Cluster one connection each, told apart by
        # CLIENT ID); a new event ends one wait, and CLIENT UNBLOCK the others
        blocked = 4 if topology == "cluster" else 1
        await wait_until(lambda: _blocked_reads(nodes, "consumer") == blocked)
        await publisher.publish("orders", Tick(resource="a", seq=5), resource_id="a")
        await seen.wait_for(6)
        stop.set()
    await publisher.aclose()
    assert seen.by_resource() == {"a": [0, 1, 2, 3, 4, 5]}
    assert _refused(nodes, "consumer") == []
    with pytest.raises(NoPermissionError):  # no administration
        await bus.redis.config_get("maxmemory")
    with pytest.raises(NoPermissionError):  # no keys outside eventbus's
        await bus.redis.set("other:key", "1")
    await bus.aclose()
    with sync_client(redis_db) as r:
        pending = sum(
            r.xpending(bus.keys.stream("orders", s), "billing")["pending"] for s in range(4)
        )
    assert pending == 0


async def test_consumer_role_claims_a_stale_read_and_records_trims(
    users: dict[str, str],
    redis_db: str,
    settings: Callable[..., Settings],
    topology: str,
    request: pytest.FixtureRequest,
    nodes: list[Any],
) -> None:
    """The consumer's rarer paths run under its ACL too: fenced delivery claims what a stale
    read left pending (XPENDING, XCLAIM) and a trim check records entries trimmed unread."""
    bus = EventBus(
        settings(redis_url=users["consumer"], shards=1, block_max_ms=50, trim_check_s=0.05)
    )
    seen = Recorder()
    bus.subscriber("acl", group="g")(seen.add)
    stream = bus.keys.stream("acl", 0)
    admin = _node_client(redis_db, topology, request, stream)  # transactions on the stream
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
        async with async_client(redis_db) as any_node:
            await wait_until(lambda: _exists(any_node, bus.keys.trimmed("acl", "g")))
        stop.set()
    await bus.aclose()
    await admin.aclose()
    assert [h.seq for h in seen.log] == [1]
    assert _refused(nodes, "consumer") == []


async def test_offloader_role_archives_and_nothing_else(
    users: dict[str, str],
    redis_db: str,
    tmp_path: Path,
    settings: Callable[..., Settings],
    nodes: list[Any],
) -> None:
    from eventbus.tier import TierSettings, offload_until_caught_up, open_store

    publisher = EventBus(settings(redis_url=redis_db, shards=2))
    async with publisher:
        for i in range(10):
            await publisher.publish("orders", Tick(resource=f"r{i}", seq=i), resource_id=f"r{i}")
    await publisher.aclose()
    r = async_client(users["offloader"])
    tier = TierSettings(hot_window_s=0, trim_exact=True)
    stats = await offload_until_caught_up(
        r,
        open_store(f"file://{tmp_path}"),
        settings=settings(redis_url=users["offloader"], shards=2),
        tier=tier,
        timeout_s=60,
    )
    assert stats.entries == 10
    assert _refused(nodes, "offloader") == []
    with pytest.raises(NoPermissionError):  # it never publishes, reads a group or acks
        await r.xadd(publisher.keys.stream("orders", 0), {"x": "y"})
    with pytest.raises(NoPermissionError):
        await r.xack(publisher.keys.stream("orders", 0), "g", "0-1")
    await r.aclose()


def test_operator_role_inspects_and_nothing_else(
    users: dict[str, str], redis_db: str, topology: str, nodes: list[Any]
) -> None:
    from typer.testing import CliRunner

    from eventbus.cli import app

    with sync_client(redis_db) as admin:
        admin.hset("eventbus:{eventbus}:topics", "orders", 2)
    cluster = "true" if topology == "cluster" else "false"
    runner = CliRunner(env={"COLUMNS": "200", "EVENTBUS_CLUSTER": cluster})
    for args in (["stats"], ["dlq", "list", "orders", "billing"], ["tail", "orders"]):
        result = runner.invoke(app, [*args, "--redis-url", users["operator"]])
        assert result.exit_code == 0, (args, result.output)
    assert _refused(nodes, "operator") == []
    with sync_client(users["operator"]) as r:
        with pytest.raises(NoPermissionError):  # it reads no group and acks nothing
            r.xreadgroup("billing", "op", {"eventbus:stream:orders:0": ">"})
        with pytest.raises(NoPermissionError):
            r.config_get("maxmemory")


async def _exists(r: Any, key: str) -> bool:
    return bool(await r.exists(key))


def _node_client(
    redis_db: str, topology: str, request: pytest.FixtureRequest, key: str
) -> redis.asyncio.Redis:
    """An admin client of the node serving `key`: MULTI/EXEC on its keys, on a Cluster too."""
    if topology != "cluster":
        return redis.asyncio.Redis.from_url(redis_db)
    return redis.asyncio.Redis(port=request.getfixturevalue("redis_cluster").primary_of(key))


async def test_a_cluster_user_without_the_cluster_rules_is_told_what_it_lacks(
    redis_db: str, topology: str, nodes: list[Any], settings: Callable[..., Settings]
) -> None:
    """redis-py reports a refused ``CLUSTER SLOTS`` as "Cluster mode is not enabled on this
    node"; the error names the ACL rules the user lacks."""
    if topology != "cluster":
        pytest.skip("a Redis Cluster's connection step")
    for r in nodes:
        r.execute_command("ACL", "SETUSER", "bare", *_acl("publisher"))
    url = f"redis://bare:publisher-pw@{redis_db.removeprefix('redis://')}"
    bus = EventBus(settings(redis_url=url))
    try:
        with pytest.raises(RedisUnavailable, match=r"\+cluster\|slots \+command"):
            async with bus:
                pass
    finally:
        for r in nodes:
            r.acl_deluser("bare")

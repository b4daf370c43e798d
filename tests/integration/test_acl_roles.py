"""The ACL roles of docs/security.md, parsed from the page, on a real redis-server and on a Redis
Cluster (with the Cluster additions of the same page, on every node).

Each role runs its real code paths under its ACL user with the ACL log staying empty, and is
refused (NOPERM, one ACL log entry each) every command on a key family it must not touch.
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
from pydantic import BaseModel
from redis.exceptions import NoPermissionError
from support import Recorder, Tick, async_client, running, sync_client, wait_until
from typer.testing import CliRunner

from eventbus import Context, EventBus, RedisUnavailable, Settings
from eventbus.protocol.keys import Keys

pytestmark = pytest.mark.anyio
DOC = Path(__file__).parents[2] / "docs" / "security.md"
USERS: dict[str, tuple[str, ...]] = {
    "publisher": ("publisher",),
    "requester": ("publisher", "requester"),
    "retention": ("publisher", "retention"),
    "consumer": ("consumer",),
    "responder": ("consumer", "responder"),  # answers requests of orders
    "payments_responder": ("consumer", "responder:payments"),  # a consumer of another topic
    "acked_consumer": ("consumer", "retention", "trimming"),
    "offloader": ("offloader",),
    "operator": ("operator",),
    "trainer": ("operator", "trainer"),
}
"""ACL user -> the blocks of docs/security.md it is made of (a base role, then add-ons);
``block:topic`` fills the block's ``TOPIC`` (orders when not given)."""


def _acl(block: str) -> list[str]:
    """The ACL rules of `block` (``name`` or ``name:topic``) as written in docs/security.md
    (comments dropped; ``TOPIC`` replaced by the topic, default orders): one argument per rule,
    a selector ``(...)`` as one argument."""
    block, _, topic = block.partition(":")
    text = DOC.read_text().replace("TOPIC", topic or "orders")
    found = re.search(rf"```\nACL SETUSER {block}\b(.*?)```", text, re.S)
    assert found is not None, block
    rules = " ".join(line.split("#")[0] for line in found.group(1).splitlines())
    tokens = re.findall(r"\([^)]*\)|\S+", rules)
    return [" ".join(t.split()).replace("PASSWORD", f"{block}-pw") for t in tokens]


def _cluster_acl(role: str) -> list[str]:
    """The rules docs/security.md adds for `role` on a Redis Cluster."""
    line = re.search(rf"^ACL SETUSER {role} (\+cluster\|slots.*)$", DOC.read_text(), re.M)
    assert line is not None, role
    return line.group(1).split()


def _set_user(r: Any, user: str, blocks: tuple[str, ...], cluster: bool) -> None:
    """Create `user` from `blocks` on node `r` (password: its base role's)."""
    for block in blocks:
        rules = [x.replace(f"{block}-pw", f"{user}-pw") for x in _acl(block)]
        r.execute_command("ACL", "SETUSER", user, *rules)
    if cluster:
        r.execute_command("ACL", "SETUSER", user, *_cluster_acl(blocks[0]))


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
    """User -> URL of its ACL user (`USERS`), created on every node (a Cluster keeps users per
    node); the ACL log starts empty."""
    base = redis_db.removeprefix("redis://")
    for r in nodes:
        for user, blocks in USERS.items():
            _set_user(r, user, blocks, topology == "cluster")
        r.execute_command("ACL", "LOG", "RESET")
    yield {user: f"redis://{user}:{user}-pw@{base}" for user in USERS}
    for r in nodes:
        r.acl_deluser(*USERS)


def _refused(nodes: list[Any], role: str) -> list[str]:
    """What any node refused `role` so far (its ACL log): commands and keys, one per refusal
    (Redis merges repeated entries into one with a count)."""
    out = []
    for r in nodes:
        for entry in r.execute_command("ACL", "LOG", "128"):
            fields = dict(zip(entry[::2], entry[1::2], strict=True))
            if fields[b"username"] == role.encode():
                out += [fields[b"object"].decode()] * int(fields[b"count"])
    return out


def _blocked_reads(nodes: list[Any], role: str) -> int:
    """Connections of `role` waiting in a blocking command (CLIENT LIST flag b)."""
    return sum(c["user"] == role and "b" in c["flags"] for r in nodes for c in r.client_list())


async def test_publisher_role_publishes(
    users: dict[str, str], settings: Callable[..., Settings], nodes: list[Any]
) -> None:
    bus = EventBus(settings(redis_url=users["publisher"], shards=2))
    async with bus:
        assert await bus.publish("orders", Tick(resource="a", seq=0), resource_id="a")
        assert len(await bus.publish_many("orders", [("b", Tick(resource="b", seq=0))])) == 1
        assert _refused(nodes, "publisher") == []
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
        await wait_until(lambda: bus.consumers and bus.consumers[0].ownership.table.held)
        encode = bus.publisher.encoder.prepare
        fields = encode(bus.topic("acl"), Tick(resource="a", seq=1), "a")[1]
        async with admin.pipeline(transaction=True) as tx:  # a stale consumer's late read
            tx.xadd(stream, fields)
            tx.xreadgroup("g", "stale", {stream: ">"})
            await tx.execute()
        await seen.wait_for(1)
        async with admin.pipeline(transaction=True) as tx:  # trimmed before anyone reads
            for i in range(2, 12):
                tx.xadd(stream, encode(bus.topic("acl"), Tick(resource="a", seq=i), "a")[1])
            tx.xtrim(stream, maxlen=0, approximate=False)
            await tx.execute()
        async with async_client(redis_db) as any_node:
            await wait_until(lambda: _exists(any_node, bus.keys.trimmed("acl", "g")))
        stop.set()
    await bus.aclose()
    await admin.aclose()
    assert [h.seq for h in seen.log] == [1]
    assert _refused(nodes, "consumer") == []


async def test_offloader_role_archives(
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
    await r.aclose()


def test_operator_role_inspects_a_topic_with_entries(
    users: dict[str, str], settings: Callable[..., Settings], nodes: list[Any]
) -> None:
    """``eventbus stats`` (MEMORY USAGE of the shard streams), ``tail`` and ``dlq list``
    under the operator role, on a topic with entries and a group."""
    from eventbus.cli import app

    anyio.run(_seed_orders, settings)
    runner = CliRunner(env={"COLUMNS": "200"})
    outputs = {}
    for args in (["stats"], ["dlq", "list", "orders", "billing"], ["tail", "orders"]):
        result = runner.invoke(app, [*args, "--redis-url", users["operator"]])
        assert result.exit_code == 0, (args, result.output)
        outputs[args[0]] = result.output
    assert _refused(nodes, "operator") == []
    row = next(line for line in outputs["stats"].splitlines() if "│ orders" in line)
    assert row.split("│")[3].strip() == "3"  # entries
    assert row.split("│")[4].strip().isdigit()  # bytes per entry, from MEMORY USAGE
    assert outputs["tail"].count('"resource_id"') == 3


def test_a_command_refused_to_stats_is_reported_as_refused(
    users: dict[str, str], redis_db: str, topology: str, nodes: list[Any], settings: Any
) -> None:
    """An operator without MEMORY USAGE gets `RedisCommandRefused` naming the command,
    the streams and the server's reason, not redis-py's '{exception.args}' template."""
    from eventbus.cli import app

    anyio.run(_seed_orders, settings)
    rules = [x.replace(" +memory|usage", "") for x in _acl("operator")]
    for r in nodes:
        r.execute_command("ACL", "SETUSER", "nomem", *rules)
        if topology == "cluster":
            r.execute_command("ACL", "SETUSER", "nomem", *_cluster_acl("operator"))
    url = f"redis://nomem:operator-pw@{redis_db.removeprefix('redis://')}"
    try:
        result = CliRunner(env={"COLUMNS": "200"}).invoke(app, ["stats", "--redis-url", url])
    finally:
        for r in nodes:
            r.acl_deluser("nomem")
    assert result.exit_code == 1, result.output
    text = " ".join(result.output.split())
    assert "Redis refused MEMORY USAGE on 'eventbus:stream:orders:0,eventbus:stream:orders:1'" in (
        text
    )
    assert "NoPermissionError: this user has no permissions to run the 'memory|usage'" in text
    assert "{exception.args}" not in text


async def _seed_orders(settings: Callable[..., Settings]) -> None:
    """Topic orders (2 shards) with 3 entries and the group billing on both shard streams."""
    bus = EventBus(settings(shards=2))
    async with bus:
        for i, rid in enumerate(("a", "b", "c")):
            await bus.publish("orders", Tick(resource=rid, seq=i), resource_id=rid)
        for s in range(2):
            await bus.redis.xgroup_create(
                bus.keys.stream("orders", s), "billing", id="0", mkstream=True
            )
    await bus.aclose()


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


# -- what each role must be refused ----------------------------------
K = Keys()
STREAM, OTHER = K.stream("orders", 0), K.stream("payments", 0)
REG, RETENTION, DICT = K.topics(), K.retention(), K.dictionaries("orders")
CHECKPOINTS, DLQ, TRIMMED = (
    K.checkpoints("orders"),
    K.dead_letter("orders", "billing"),
    K.trimmed("orders", "billing"),
)
PARKED, CONTROL = K.parked("orders", "billing"), K.control("orders", "billing")
LOCKS, MEMBERS = K.locks("orders", "billing"), K.members("orders", "billing")
REPLY = K.reply("orders", "0" * 32)
OTHER_REPLY = K.reply("payments", "0" * 32)

# what none of the roles may do to the shared state: rewrite the registry, dictionaries and
# checkpoints, or destroy a shard stream
SHARED = [
    ("HSET", REG, "orders", "3"),  # a shard count changed: every client ShardCountMismatch
    ("HDEL", REG, "orders"),
    ("HSET", DICT, "current", "abc"),  # a planted dictionary
    ("HSETNX", DICT, "771003", "garbage"),
    ("XADD", DICT, "*", "x", "y"),  # the dictionary hash turned into a stream
    ("HSET", CHECKPOINTS, "0", "9999999999999-0"),
    ("HSET", RETENTION, "orders", "maxlen"),
    ("SET", STREAM, "x"),
    ("EXPIRE", STREAM, "1"),
    ("DEL", STREAM),
    ("DEL", REG),
    ("XDEL", STREAM, "1-0"),
]


class Answer(BaseModel):
    seq: int


REFUSED: dict[str, list[tuple[str, ...]]] = {
    "publisher": [
        *SHARED,
        ("XREAD", "STREAMS", STREAM, "0"),
        ("XRANGE", STREAM, "-", "+"),
        ("XREADGROUP", "GROUP", "billing", "c", "STREAMS", STREAM, ">"),
        ("XACK", STREAM, "billing", "1-0"),
        ("XTRIM", STREAM, "MAXLEN", "0"),
        ("HSET", PARKED, "a", "1-0"),
        ("XADD", DLQ, "*", "x", "y"),
        ("HSETNX", CONTROL, "n", "x"),  # forging an operator's request
        ("XADD", REPLY, "*", "x", "y"),
        ("HSETNX", RETENTION, "orders", "acked"),
    ],
    "requester": [
        *SHARED,
        ("XREAD", "STREAMS", STREAM, "0"),
        ("XRANGE", STREAM, "-", "+"),
        ("XADD", REPLY, "*", "x", "y"),  # a forged reply
        ("EXPIRE", REPLY, "1"),
        ("DEL", REPLY),
    ],
    "retention": [*SHARED, ("HDEL", RETENTION, "orders"), ("XTRIM", STREAM, "MAXLEN", "0")],
    "consumer": [
        *SHARED,
        ("XTRIM", OTHER, "MAXLEN", "0"),
        ("XADD", STREAM, "*", "x", "y"),
        ("HSETNX", CONTROL, "n", "x"),
        ("HSETNX", RETENTION, "orders", "acked"),
        ("XREAD", "STREAMS", REPLY, "0"),  # it writes replies, never reads them
        ("XRANGE", REPLY, "-", "+"),
        ("SET", "other:key", "1"),
        ("XADD", REPLY, "*", "x", "y"),  # answering is the responder's rule
        ("EXPIRE", REPLY, "1"),
    ],
    "responder": [
        *SHARED,
        ("XADD", STREAM, "*", "x", "y"),
        ("XREAD", "STREAMS", REPLY, "0"),
        ("XADD", OTHER_REPLY, "*", "x", "y"),  # only the replies of its topic
        ("DEL", REPLY),
    ],
    "acked_consumer": [*SHARED, ("HDEL", RETENTION, "orders"), ("XADD", STREAM, "*", "x", "y")],
    "offloader": [
        # it writes its checkpoints (the checkpoint script's HSET) and trims
        *[c for c in SHARED if c[1] != CHECKPOINTS and c[0] != "XDEL"],
        ("HSETNX", RETENTION, "orders", "acked"),
        ("XADD", STREAM, "*", "x", "y"),
        ("XACK", STREAM, "billing", "1-0"),
        ("XREADGROUP", "GROUP", "billing", "c", "STREAMS", STREAM, ">"),
        ("HSET", LOCKS, "0", "x"),  # the consumers' locks and liveness
        ("ZADD", MEMBERS, "1", "x"),
        ("XADD", DLQ, "*", "x", "y"),
        ("HSET", PARKED, "a", "1-0"),
    ],
    "operator": [
        *SHARED,  # XDEL of unconsumed entries among them
        ("XTRIM", STREAM, "MAXLEN", "0"),
        ("XREADGROUP", "GROUP", "billing", "c", "STREAMS", STREAM, ">"),
        ("XACK", STREAM, "billing", "1-0"),
        ("HSET", PARKED, "a", "1-0"),
        ("HSET", CONTROL, "n", "x"),  # only HSETNX: a recorded request is never rewritten
        ("HSET", LOCKS, "0", "x"),
        ("ZADD", MEMBERS, "1", "x"),
        ("XADD", TRIMMED, "*", "x", "y"),
    ],
    "trainer": [  # it writes dictionaries, nothing else of the shared state
        *[c for c in SHARED if not (c[1] == DICT and c[0] in ("HSET", "HSETNX"))],
        ("HSET", CONTROL, "n", "x"),
        ("XREADGROUP", "GROUP", "billing", "c", "STREAMS", STREAM, ">"),
    ],
}


@pytest.mark.parametrize("user", sorted(REFUSED))
async def test_each_role_is_refused_what_it_must_not_do(
    user: str, users: dict[str, str], nodes: list[Any]
) -> None:
    """Every command of the role's table is answered NOPERM, and every node's ACL log holds
    exactly one refusal per command (of this user)."""
    allowed = await _allowed_of(users[user], REFUSED[user])
    assert allowed == [], f"{user} may {allowed}"
    assert len(_refused(nodes, user)) == len(REFUSED[user])


async def test_requester_and_consumer_roles_request_and_reply(
    users: dict[str, str], settings: Callable[..., Settings], nodes: list[Any]
) -> None:
    """A request under the requester role, answered by a handler under the consumer role (it
    writes the reply stream and its expiry); a request nobody answers times out naming the
    groups (XINFO GROUPS)."""

    requester = EventBus(settings(redis_url=users["requester"], shards=2))
    bus = EventBus(settings(redis_url=users["responder"], shards=2, block_max_ms=100))

    @bus.subscriber("orders", group="billing")
    async def handle(event: Tick) -> Answer | None:
        return Answer(seq=event.seq) if event.resource != "mute" else None

    stop = anyio.Event()
    async with requester, anyio.create_task_group() as tg:
        tg.start_soon(lambda: bus.run(stop=stop))
        answer = await requester.request(
            "orders", Tick(resource="a", seq=7), resource_id="a", reply_model=Answer, timeout_s=20
        )
        from eventbus import RequestTimeout

        with pytest.raises(RequestTimeout, match="billing"):
            await requester.request(
                "orders", Tick(resource="mute", seq=8), resource_id="mute", timeout_s=0.5
            )
        stop.set()
    await requester.aclose()
    await bus.aclose()
    assert answer == Answer(seq=7)
    assert _refused(nodes, "requester") == []
    assert _refused(nodes, "responder") == []


async def test_a_consumer_of_another_topic_cannot_answer_a_request(
    users: dict[str, str], settings: Callable[..., Settings], nodes: list[Any]
) -> None:
    """A consumer of topic payments (its own responder rule included) reads a pending request
    of orders from the shard stream (its role may), takes everything the request carries
    (reply stream, correlation ID, and what an older eventbus sent: the reply key, from which
    it makes the documented MAC) and writes a cheaper answer: Redis refuses the write, and
    the caller gets the responder's answer."""
    from eventbus.protocol.codec import decode_entry, encode_entry, envelope_of

    requester = EventBus(settings(redis_url=users["requester"], shards=1))
    bus = EventBus(settings(redis_url=users["responder"], shards=1, block_max_ms=100))
    asked, release = anyio.Event(), anyio.Event()

    @bus.subscriber("orders", group="billing")
    async def handle(event: Tick, ctx: Context) -> Answer:
        asked.set()
        await release.wait()  # the forger moves while the request waits
        return Answer(seq=event.seq)

    answer: list[Answer] = []

    async def ask() -> None:
        answer.append(
            await requester.request(
                "orders", Tick(resource="a", seq=7), resource_id="a", reply_model=Answer
            )
        )

    stop = anyio.Event()
    async with (
        requester,
        async_client(users["payments_responder"]) as forger,
        anyio.create_task_group() as tg,
    ):
        tg.start_soon(lambda: bus.run(stop=stop))
        tg.start_soon(ask)
        await asked.wait()
        [(entry_id, fields)] = await forger.xrange(K.stream("orders", 0))
        headers = decode_entry(fields).headers
        forged = {
            "eventbus-correlation-id": headers["eventbus-correlation-id"],
            "eventbus-request-entry": f"0/{entry_id.decode()}",
        }
        reply = encode_entry(envelope_of("a", Answer(seq=1), forged))
        if "eventbus-reply-key" in headers:  # what the request carried before
            reply[b"mac"] = _documented_mac(headers, reply)
        with pytest.raises(NoPermissionError):
            await forger.xadd(headers["eventbus-reply-to"], reply)
        release.set()
        await wait_until(lambda: bool(answer))
        stop.set()
    await requester.aclose()
    await bus.aclose()
    assert answer == [Answer(seq=7)]
    assert _refused(nodes, "payments_responder") == [headers["eventbus-reply-to"]]
    assert _refused(nodes, "responder") == []


def _documented_mac(headers: dict[str, str], fields: dict[bytes, bytes]) -> bytes:
    """The reply MAC older eventbus versions checked (HMAC-SHA256 keyed by the request's
    ``eventbus-reply-key``)."""
    import hashlib
    import hmac

    msg = b"eventbus-reply-v1"
    parts = (headers["eventbus-correlation-id"].encode(), fields[b"rid"], fields[b"type"])
    for part in (*parts, fields[b"data"]):
        msg += len(part).to_bytes(4, "big") + part
    key = bytes.fromhex(headers["eventbus-reply-key"])
    return hmac.new(key, msg, hashlib.sha256).hexdigest().encode()


async def test_acked_retention_roles_record_and_trim(
    users: dict[str, str], redis_db: str, settings: Callable[..., Settings], nodes: list[Any]
) -> None:
    """A publisher and a consumer of a ``retention="acked"`` topic: both record it (HSETNX),
    the consumer trims what its group acked (checkpoints read, XTRIM)."""
    retain = {"shards": 1, "retention": "acked", "retention_trim_exact": True}
    publisher = EventBus(settings(redis_url=users["retention"], **retain))
    bus = EventBus(settings(redis_url=users["acked_consumer"], trim_check_s=0.05, **retain))
    seen = Recorder()
    bus.subscriber("orders", group="billing")(seen.add)
    stop = anyio.Event()
    async with publisher, async_client(redis_db) as admin, anyio.create_task_group() as tg:
        for i in range(5):
            await publisher.publish("orders", Tick(resource="a", seq=i), resource_id="a")
        assert await admin.hget(publisher.keys.retention(), "orders") == b"acked"
        tg.start_soon(lambda: bus.run(stop=stop))
        await seen.wait_for(5)
        await wait_until(lambda: _length_is(admin, STREAM, 0))
        stop.set()
    await publisher.aclose()
    await bus.aclose()
    assert _refused(nodes, "retention") == []
    assert _refused(nodes, "acked_consumer") == []


async def test_dead_letters_parking_and_an_operator_requeue_under_their_roles(
    users: dict[str, str], redis_db: str, settings: Callable[..., Settings], nodes: list[Any]
) -> None:
    """The consumer dead-letters and parks a resource (with the de-duplication window on); the
    operator lists the dead letters and requeues the resource (control request and entry); the
    consumer executes the request and handles the events."""
    from eventbus.dlq import DeadLetters

    failing = {"bad"}
    seen = Recorder()
    publisher = EventBus(settings(redis_url=users["publisher"], shards=2))
    bus = EventBus(settings(redis_url=users["consumer"], shards=2, block_max_ms=100))

    @bus.subscriber("orders", group="billing", max_attempts=1, on_failure="park", dedup_window_s=60)
    async def handle(event: Tick, ctx: Context) -> None:
        if event.resource in failing:
            raise RuntimeError("boom")
        seen.add(event, ctx)

    stop = anyio.Event()
    async with publisher, async_client(users["operator"]) as op, anyio.create_task_group() as tg:
        letters = DeadLetters(op, bus.keys, bus.topic("orders"), "billing")
        tg.start_soon(lambda: bus.run(stop=stop))
        await publisher.publish("orders", Tick(resource="bad", seq=0), resource_id="bad")
        await wait_until(lambda: _parked(letters))
        await publisher.publish("orders", Tick(resource="bad", seq=1), resource_id="bad")
        await publisher.publish("orders", Tick(resource="ok", seq=2), resource_id="ok")
        await wait_until(lambda: _letters(letters, 2))
        assert [d.reason for d in await letters.letters()] == ["failed", "parked"]
        failing.clear()
        await letters.requeue_resource("bad")
        await seen.wait_for(3)
        await wait_until(lambda: _unparked(letters))
        stop.set()
    await publisher.aclose()
    await bus.aclose()
    assert seen.by_resource() == {"ok": [2], "bad": [0, 1]}
    for user in ("publisher", "consumer", "operator"):
        assert _refused(nodes, user) == [], user


async def _parked(letters: Any) -> bool:
    return "bad" in await letters.parked()


async def _letters(letters: Any, n: int) -> bool:
    return len(await letters.letters()) == n


async def _unparked(letters: Any) -> bool:
    return not await letters.parked() and not await letters.letters()


async def _length_is(r: Any, stream: str, n: int) -> bool:
    return int(await r.xlen(stream)) == n


async def test_dictionaries_archive_catch_up_and_broadcast_under_their_roles(
    users: dict[str, str],
    redis_db: str,
    tmp_path: Path,
    settings: Callable[..., Settings],
    nodes: list[Any],
) -> None:
    """The rarer reads: the publisher compresses with the topic's zstd dictionary (HGET of
    ``current`` and of the dictionary), the offloader archives entries and the dictionary and
    trims, the consumer catches its group up from the archive (XGROUP SETID, XPENDING, XACK),
    decodes with the dictionary, and a broadcast subscriber reads new entries (XREVRANGE,
    XREAD)."""
    from eventbus.cli.topic import sample_bodies
    from eventbus.protocol import compression
    from eventbus.protocol.codec import F_DATA
    from eventbus.protocol.dictionaries import CACHE, Dictionaries, dictionary_id
    from eventbus.tier import TierSettings, offload_until_caught_up, open_store

    def forget_dictionaries() -> None:  # as a fresh process starts
        CACHE._dicts.clear()
        CACHE._missing.clear()
        compression.clear()

    def ticks(seqs: range) -> list[tuple[str, Tick]]:
        return [
            (f"r{i % 7}", Tick(resource=f"r{i % 7}", seq=i, pad=f"pad {i % 13} " * 4)) for i in seqs
        ]

    admin = EventBus(settings(shards=2))
    async with admin:  # the administrator: the group exists from the start, a dictionary
        for s in range(2):
            await admin.redis.xgroup_create(
                admin.keys.stream("flow", s), "late", id="0", mkstream=True
            )
        await admin.publish_many("flow", ticks(range(400)))
        d = Dictionaries(admin.redis, admin.keys)
        dict_id = await d.train(
            "flow", await sample_bodies(admin, d, "flow", 400, admin.settings), size=2048
        )
        forget_dictionaries()
        publisher = EventBus(settings(redis_url=users["publisher"], shards=2))
        async with publisher:
            await publisher.publish_many("flow", ticks(range(400, 500)))
        await publisher.aclose()
        [(_, last)] = await admin.redis.xrevrange(admin.keys.stream("flow", 0), count=1)
        assert dictionary_id(last[F_DATA]) == dict_id  # compressed with the dictionary
    await admin.aclose()

    forget_dictionaries()
    store = open_store(f"file://{tmp_path}")
    async with async_client(users["offloader"]) as r:
        stats = await offload_until_caught_up(
            r,
            store,
            settings=settings(redis_url=users["offloader"], shards=2),
            tier=TierSettings(hot_window_s=0, trim_exact=True, segment_max_age_s=0),
            timeout_s=60,
        )
    assert stats.entries == 500
    with sync_client(redis_db) as admin_sync:  # trimmed: the group catches up from the archive
        assert sum(admin_sync.xlen(K.stream("flow", s)) for s in range(2)) < 500

    forget_dictionaries()
    seen: list[int] = []
    heard: list[int] = []
    bus = EventBus(settings(redis_url=users["consumer"], shards=2), archive=store)

    @bus.subscriber("flow", group="late")
    async def late(event: Tick) -> None:
        seen.append(event.seq)

    @bus.subscriber("flow", broadcast=True)
    async def everyone(event: Tick) -> None:
        heard.append(event.seq)

    publisher = EventBus(settings(redis_url=users["publisher"], shards=2))
    async with publisher, running(bus):  # the broadcast subscriber has taken its start
        await wait_until(lambda: len(seen) >= 500, within_s=60)
        await publisher.publish_many("flow", ticks(range(500, 510)))
        await wait_until(lambda: len(seen) >= 510 and set(range(500, 510)) <= set(heard))
    await publisher.aclose()
    await bus.aclose()
    assert sorted(seen) == list(range(510))
    for user in ("publisher", "offloader", "consumer"):
        assert _refused(nodes, user) == [], user


def test_cli_publish_and_train_dict_under_their_roles(
    users: dict[str, str], settings: Callable[..., Settings], nodes: list[Any]
) -> None:
    """``eventbus publish`` under the publisher role, ``eventbus topic train-dict`` under the
    trainer's (the operator's reads and the dictionary hash)."""
    from eventbus.cli import app

    async def seed() -> None:
        bus = EventBus(settings(shards=2))
        async with bus:
            await bus.publish_many(
                "orders",
                [
                    (f"r{i % 7}", Tick(resource=f"r{i % 7}", seq=i, pad=f"p{i % 13} " * 4))
                    for i in range(300)
                ],
            )
        await bus.aclose()

    anyio.run(seed)
    runner = CliRunner(env={"COLUMNS": "200"})
    published = runner.invoke(
        app,
        [
            "publish",
            "orders",
            "--type",
            "Tick",
            "--resource-id",
            "r1",
            "--data",
            '{"resource": "r1", "seq": 300}',
            "--redis-url",
            users["publisher"],
        ],
    )
    assert published.exit_code == 0, published.output
    trained = runner.invoke(
        app, ["topic", "train-dict", "orders", "--size", "2048", "--redis-url", users["trainer"]]
    )
    assert trained.exit_code == 0, trained.output
    assert "is current" in trained.output
    assert _refused(nodes, "publisher") == []
    assert _refused(nodes, "trainer") == []


# -- the roles with per-topic coordination slots (docs/security.md) ----------------------------
PER_TOPIC_FAMILIES = ("locks", "members", "parked", "control", "checkpoints")
_SHARED_FAMILY = re.compile(rf"eventbus:\{{eventbus\}}:({'|'.join(PER_TOPIC_FAMILIES)})")
TOPIC_USERS = {f"t_{role}": role for role in ("publisher", "consumer", "offloader", "operator")}


def _per_topic(rule: str) -> str:
    """`rule` for ``coordination_slots=topic``, rewritten as docs/security.md says: the
    per-topic families' ``eventbus:{eventbus}:`` becomes ``eventbus:{eventbus:*}:``."""
    return _SHARED_FAMILY.sub(r"eventbus:{eventbus:*}:\1", rule)


def test_the_page_states_the_per_topic_rewrite_the_tests_apply() -> None:
    section = DOC.read_text().split("### With per-topic coordination slots")[1].split("\n## ")[0]
    assert "`eventbus:{eventbus:*}:` in place of `eventbus:{eventbus}:`" in section
    assert all(f"`{family}`" in section for family in PER_TOPIC_FAMILIES)


@pytest.fixture
def topic_users(redis_db: str, topology: str, nodes: list[Any]) -> Iterator[dict[str, str]]:
    """User -> URL of a base role's user (`TOPIC_USERS`) with the per-topic key patterns."""
    base = redis_db.removeprefix("redis://")
    for r in nodes:
        for user, role in TOPIC_USERS.items():
            rules = [_per_topic(x.replace(f"{role}-pw", f"{user}-pw")) for x in _acl(role)]
            r.execute_command("ACL", "SETUSER", user, *rules)
            if topology == "cluster":
                r.execute_command("ACL", "SETUSER", user, *_cluster_acl(role))
        r.execute_command("ACL", "LOG", "RESET")
    yield {user: f"redis://{user}:{user}-pw@{base}" for user in TOPIC_USERS}
    for r in nodes:
        r.acl_deluser(*TOPIC_USERS)


async def test_the_roles_consume_park_requeue_and_archive_with_per_topic_slots(
    topic_users: dict[str, str],
    settings: Callable[..., Settings],
    nodes: list[Any],
    tmp_path: Path,
) -> None:
    """Under the per-topic patterns: the consumer takes its locks, parks a resource and runs
    the operator's requeue (fenced scripts on the topic's slot); the offloader checkpoints
    under its locks; every ACL log stays empty."""
    from eventbus.dlq import DeadLetters
    from eventbus.tier import TierSettings, offload_until_caught_up, open_store

    def make(user: str, **kw: Any) -> Settings:
        return settings(redis_url=topic_users[user], shards=2, coordination_slots="topic", **kw)

    failing = {"bad"}
    seen = Recorder()
    publisher, bus = EventBus(make("t_publisher")), EventBus(make("t_consumer", block_max_ms=100))

    @bus.subscriber("orders", group="billing", max_attempts=1, on_failure="park")
    async def handle(event: Tick, ctx: Context) -> None:
        if event.resource in failing:
            raise RuntimeError("boom")
        seen.add(event, ctx)

    stop = anyio.Event()
    op_url = topic_users["t_operator"]
    async with publisher, async_client(op_url) as op, anyio.create_task_group() as tg:
        letters = DeadLetters(op, bus.keys, bus.topic("orders"), "billing")
        tg.start_soon(lambda: bus.run(stop=stop))
        await publisher.publish("orders", Tick(resource="bad", seq=0), resource_id="bad")
        await wait_until(lambda: _parked(letters))
        await publisher.publish("orders", Tick(resource="ok", seq=1), resource_id="ok")
        failing.clear()
        await letters.requeue_resource("bad")
        await seen.wait_for(2)
        await wait_until(lambda: _unparked(letters))
        stop.set()
    await publisher.aclose()
    await bus.aclose()
    assert bus.keys.slots == "topic" and seen.by_resource() == {"ok": [1], "bad": [0]}
    async with async_client(topic_users["t_offloader"]) as r:
        stats = await offload_until_caught_up(
            r,
            open_store(f"file://{tmp_path}"),
            settings=make("t_offloader"),
            tier=TierSettings(hot_window_s=0),
            timeout_s=60,
        )
    assert stats.entries == 3  # bad, ok, and bad's requeued copy
    for user in TOPIC_USERS:
        assert _refused(nodes, user) == [], user


KT, KS = Keys(slots="topic"), Keys()
REFUSED_PER_TOPIC: dict[str, list[tuple[str, ...]]] = {
    "t_publisher": [
        ("HSET", KT.parked("orders", "billing"), "a", "1-0"),
        ("HSETNX", KT.control("orders", "billing"), "n", "x"),
        ("ZADD", KT.members("orders", "billing"), "1", "x"),
        ("HSET", KT.checkpoints("orders"), "0", "9999999999999-0"),
    ],
    "t_consumer": [
        ("HSETNX", KT.control("orders", "billing"), "n", "x"),  # forging an operator's request
        ("HSET", KT.checkpoints("orders"), "0", "9999999999999-0"),
        ("HSET", KS.locks("orders", "billing"), "0", "x"),  # the shared layout's keys
        ("ZADD", KS.members("orders", "billing"), "1", "x"),
        ("HSET", KS.parked("orders", "billing"), "a", "1-0"),
        ("HSET", KT.topics(), "orders", "3"),
    ],
    "t_offloader": [
        ("HSET", KT.locks("orders", "billing"), "0", "x"),  # the consumers' locks and liveness
        ("ZADD", KT.members("orders", "billing"), "1", "x"),
        ("HSET", KT.parked("orders", "billing"), "a", "1-0"),
        ("HSET", KS.locks("orders", "_offloader"), "0", "x"),
        ("HSET", KS.checkpoints("orders"), "0", "9999999999999-0"),
    ],
    "t_operator": [
        ("HSET", KT.parked("orders", "billing"), "a", "1-0"),
        ("HSET", KT.control("orders", "billing"), "n", "x"),  # only HSETNX
        ("HSET", KT.locks("orders", "billing"), "0", "x"),
        ("ZADD", KT.members("orders", "billing"), "1", "x"),
        ("HSETNX", KS.control("orders", "billing"), "n", "x"),
    ],
}


@pytest.mark.parametrize("user", sorted(REFUSED_PER_TOPIC))
async def test_each_role_is_refused_what_it_must_not_do_with_per_topic_slots(
    user: str, topic_users: dict[str, str], nodes: list[Any]
) -> None:
    """As `test_each_role_is_refused_what_it_must_not_do`, for the per-topic patterns: the
    families a role must not write, in the per-topic layout, and the shared layout's keys."""
    allowed = await _allowed_of(topic_users[user], REFUSED_PER_TOPIC[user])
    assert allowed == [], f"{user} may {allowed}"
    assert len(_refused(nodes, user)) == len(REFUSED_PER_TOPIC[user])


async def _allowed_of(user: Any, commands: list[tuple[str, ...]]) -> list[str]:
    """The `commands` that `user` was not refused with NOPERM (another error reply, WRONGTYPE
    and the like, means the command was allowed), each with what it answered."""
    allowed = []
    async with async_client(user) as r:
        for command in commands:
            try:
                await r.execute_command(*command)
            except NoPermissionError:
                continue
            except Exception as exc:  # refused otherwise (WRONGTYPE...): it was allowed
                allowed.append(f"{' '.join(command)} -> {type(exc).__name__}: {exc}")
            else:
                allowed.append(" ".join(command))
    return allowed

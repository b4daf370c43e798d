"""`eventbus.client.pipelines` on both topologies: commands run in one round trip (packed with
hiredis on a single node, a redis-py pipeline on a Cluster), their replies in order, and the
first error reply raised with the server's own words (redis-py's pipeline replaced them with
an unfilled template, which hid NOGROUP from the consumer)."""

from __future__ import annotations

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError

from eventbus import Settings
from eventbus.client.connection import connect
from eventbus.client.pipelines import HeldConnection, Packed, execute, execute_packed, packable

pytestmark = [pytest.mark.anyio, pytest.mark.integration]


async def test_replies_in_order_and_the_servers_reason(settings: type[Settings]) -> None:
    redis = connect(settings())
    try:
        await redis.xadd("s{1}", {b"k": b"v"})
        await redis.xgroup_create("s{1}", "g", id="0")
        ok = await execute_packed(redis, [("XACK", "s{1}", "g", "0-1"), ("XLEN", "s{1}")])
        assert ok == [0, 1]
        with pytest.raises(ResponseError, match=r"^NOGROUP"):
            await execute_packed(redis, [("XLEN", "s{1}"), ("XAUTOCLAIM", "s{1}", "nope", "c",
                                                            0, "0-0")])  # fmt: skip
        assert await redis.xlen("s{1}") == 1  # the connection's replies were all read
        pipe = redis.pipeline(transaction=False)
        pipe.xautoclaim("s{1}", "nope", "c", 0, "0-0")
        with pytest.raises(ResponseError, match=r"^NOGROUP"):
            await execute(pipe)
    finally:
        await redis.aclose()


def test_only_single_node_clients_on_plain_connections_are_packed(
    settings: type[Settings], topology: str
) -> None:
    assert packable(connect(settings())) is (topology == "single")


@pytest.mark.single_node("packing (and the reply buffer) is a single-node client's path")
async def test_buffered_replies_are_taken_without_a_read_response_each(
    settings: type[Settings],
) -> None:
    """Replies already in the connection's buffer come straight from its hiredis reader (no
    ``read_response`` coroutine per reply: a read round's XPENDING summaries), in order, an
    error reply among them included, and the connection stays in step."""
    redis = connect(settings())
    calls = 0
    pool = redis.connection_pool
    base = pool.connection_class

    class Counting(base):  # type: ignore[misc, valid-type]
        async def read_response(self, *args: object, **kwargs: object) -> object:
            nonlocal calls
            calls += 1
            return await super().read_response(*args, **kwargs)

    pool.connection_class = Counting
    try:
        commands = [("PING", f"p{i}") for i in range(20)]
        assert await execute_packed(redis, commands) == [f"p{i}".encode() for i in range(20)]
        assert 1 <= calls < len(commands)
        commands[7] = ("XAUTOCLAIM", "s{1}", "nope", "c", 0, "0-0")  # NOGROUP (no stream)
        with pytest.raises(ResponseError, match=r"^NOGROUP"):
            await execute_packed(redis, commands)
        assert await execute_packed(redis, [("PING", "after")]) == [b"after"]  # in step
    finally:
        await redis.aclose()


async def test_a_held_connection_is_reused_and_connects_again_after_it_was_lost(
    settings: type[Settings], topology: str
) -> None:
    """`HeldConnection`: one pool connection for every round trip (no checkout each), error
    replies returned in place with ``raise_on_error=False``; a round trip on a connection the
    server closed raises a connection error, and the next one connects again."""
    redis = connect(settings())
    held = HeldConnection(redis)
    try:
        await redis.set("h{1}", "a")
        assert await held.execute([("GET", "h{1}"), Packed.of("STRLEN", "h{1}")]) == [b"a", 1]
        first = held.conn
        got = await held.execute([("GET", "h{1}"), ("XLEN", "h{1}")], raise_on_error=False)
        assert got[0] == b"a" and isinstance(got[1], ResponseError)  # WRONGTYPE, in place
        assert held.conn is first
        if topology == "single":
            assert first is not None
            await redis.client_kill_filter(_id=await _client_id(held))
            with pytest.raises(RedisConnectionError):
                await held.execute([("GET", "h{1}")])
            assert await held.execute([("GET", "h{1}")]) == [b"a"]  # connected again
            assert held.conn is first
    finally:
        await held.aclose()
        await redis.delete("h{1}")
        await redis.aclose()
    assert held.conn is None


async def _client_id(held: HeldConnection) -> int:
    [got] = await held.execute([("CLIENT", "ID")])
    return int(got)

"""Request/reply: a subscriber's return value answers ``bus.request`` through the caller's reply
stream; concurrent requests share it; timeouts say whether anybody subscribes, or why the groups
could not be listed; the reply stream is capped and expiring; a request cannot make a consumer write
to another key, nor send a malformed reply key. Forged and altered replies:
`cases.request_reply_cases`."""

from __future__ import annotations

from typing import Any

import anyio
import pytest
import redis.asyncio
from pydantic import BaseModel
from support import running, wait_until

from eventbus import Context, EventBus
from eventbus.config import Settings
from eventbus.errors import ConfigError, EventBusError, InvalidReply, RequestTimeout
from eventbus.protocol.codec import envelope_of
from eventbus.protocol.replies import CORRELATION_ID, REPLY_TO, REPLY_TTL_S, send_reply
from eventbus.protocol.sharding import shard_of
from eventbus.request import requester

pytestmark = [pytest.mark.anyio, pytest.mark.integration]


class Quote(BaseModel):
    sku: str
    quantity: int


class Price(BaseModel):
    sku: str
    total_cents: int


async def test_a_handler_return_value_answers_the_request(settings: type[Settings]) -> None:
    server = EventBus(settings())
    seen: list[Context] = []

    @server.subscriber("quotes", group="pricing")
    async def price(q: Quote, ctx: Context) -> Price:
        seen.append(ctx)
        return Price(sku=q.sku, total_cents=q.quantity * 250)

    client = EventBus(settings())
    async with running(server), client:
        reply = await client.request(
            "quotes",
            Quote(sku="a", quantity=4),
            resource_id="a",
            timeout_s=20,
            reply_model=Price,
        )
        assert reply == Price(sku="a", total_cents=1000)
        raw = await client.request(
            "quotes", Quote(sku="b", quantity=1), resource_id="b", timeout_s=20
        )
        assert raw == {"sku": "b", "total_cents": 250}
        # concurrent requests of one bus share its reply stream, each gets its own answer
        results: dict[int, Price] = {}

        async def ask(i: int) -> None:
            results[i] = await client.request(
                "quotes",
                Quote(sku=f"s{i}", quantity=i),
                resource_id=f"s{i}",
                timeout_s=20,
                reply_model=Price,
            )

        async with anyio.create_task_group() as tg:
            for i in range(20):
                tg.start_soon(ask, i)
        assert results == {i: Price(sku=f"s{i}", total_cents=i * 250) for i in range(20)}
        stream = requester(client.redis, client.keys, "quotes").stream
        assert seen[0].headers[REPLY_TO] == stream
        assert CORRELATION_ID in seen[0].headers
        ttl = await client.redis.ttl(stream)
        assert 0 < ttl <= REPLY_TTL_S
    await client.aclose()


async def test_the_sync_bus_requests_from_a_plain_thread(settings: type[Settings]) -> None:
    """`SyncBus.request` (a Flask view's call) blocks its thread until the reply, typed by
    `reply_model` as the async method is."""
    server = EventBus(settings())

    @server.subscriber("quotes", group="pricing")
    async def price(q: Quote) -> Price:
        return Price(sku=q.sku, total_cents=q.quantity * 250)

    client = EventBus(settings())

    def view() -> tuple[Price, object]:
        with client.sync() as sb:
            typed = sb.request(
                "quotes",
                Quote(sku="a", quantity=2),
                resource_id="a",
                timeout_s=20,
                reply_model=Price,
            )
            raw = sb.request("quotes", Quote(sku="b", quantity=3), resource_id="b", timeout_s=20)
        return typed, raw

    async with running(server):
        typed, raw = await anyio.to_thread.run_sync(view)
    assert typed == Price(sku="a", total_cents=500)
    assert raw == {"sku": "b", "total_cents": 750}
    assert not client.sync().running  # the last block's exit stopped its loop


async def test_timeout_says_nobody_subscribes(settings: type[Settings]) -> None:
    client = EventBus(settings())
    async with client:
        with anyio.fail_after(10):
            with pytest.raises(RequestTimeout, match="nobody subscribes") as info:
                await client.request(
                    "void", Quote(sku="x", quantity=1), resource_id="x", timeout_s=0.3
                )
    assert isinstance(info.value, EventBusError)
    assert info.value.groups == [] and info.value.entry_id is not None
    await client.aclose()


@pytest.mark.parametrize("timeout_s", [0, -1.0, float("nan"), "5", None, [1], b"1", True])
async def test_a_timeout_not_above_zero_is_refused_before_publishing(
    settings: type[Settings], r: redis.asyncio.Redis, timeout_s: float
) -> None:
    # 0 or a negative timed out at once with the request published, NaN
    # was taken as no timeout at all
    client = EventBus(settings())
    async with client:
        with pytest.raises(ConfigError, match="timeout_s must be a number of seconds > 0"):
            await client.request(
                "void", Quote(sku="x", quantity=1), resource_id="x", timeout_s=timeout_s
            )
    await client.aclose()
    for i in range(client.settings.shards):  # nothing published
        assert not await r.exists(client.keys.stream("void", i))


async def test_timeout_names_the_groups_that_did_not_answer(settings: type[Settings]) -> None:
    server = EventBus(settings())
    handled = anyio.Event()

    @server.subscriber("quotes", group="audit")
    async def audit(q: Quote) -> None:  # handles requests, answers nothing
        handled.set()

    client = EventBus(settings())
    async with running(server), client:
        with pytest.raises(RequestTimeout, match="groups audit read topic 'quotes'"):
            await client.request("quotes", Quote(sku="x", quantity=1), resource_id="x", timeout_s=1)
        assert handled.is_set()
    await client.aclose()


async def test_reply_goes_only_to_eventbus_reply_streams(settings: type[Settings]) -> None:
    bus = EventBus(settings())
    async with bus:

        async def send(env: Any, result: Any, topic: str = "quotes") -> None:
            await send_reply(bus.redis, bus.keys, topic, 0, "1-0", env, result)

        env = envelope_of(
            "r", Quote(sku="x", quantity=1), {REPLY_TO: "eventbus:{eventbus}:locks:t:g"}
        )
        with pytest.raises(InvalidReply, match="not an eventbus reply stream"):
            await send(env, Price(sku="x", total_cents=1))
        good = requester(bus.redis, bus.keys, "quotes").stream
        env = envelope_of("r", Quote(sku="x", quantity=1), {REPLY_TO: good, CORRELATION_ID: "c"})
        with pytest.raises(InvalidReply, match="returned dict, not a pydantic model"):
            await send(env, {"total_cents": 1})
        with pytest.raises(InvalidReply, match="which is not one of 'gossip'"):
            await send(env, Price(sku="x", total_cents=1), topic="gossip")
        plain = envelope_of("r", Quote(sku="x", quantity=1))
        await send(plain, Price(sku="x", total_cents=1))  # no request
        assert not await bus.redis.exists(good)
    await bus.aclose()


class Ping(BaseModel):
    n: int


async def test_a_routed_handler_answers_too(settings: type[Settings]) -> None:
    server = EventBus(settings())

    @server.subscriber("quotes", group="pricing")
    async def price(q: Quote) -> Price:
        return Price(sku=q.sku, total_cents=q.quantity)

    @server.subscriber("quotes", group="pricing")
    async def ping(p: Ping) -> Ping:
        return Ping(n=p.n + 1)

    client = EventBus(settings())
    async with running(server), client:
        assert await client.request("quotes", Ping(n=1), resource_id="p", timeout_s=20) == {"n": 2}
        reply = await client.request(
            "quotes", Quote(sku="q", quantity=3), resource_id="q", timeout_s=20, reply_model=Price
        )
        assert reply.total_cents == 3
    await client.aclose()


async def test_a_request_with_a_bad_reply_address_is_dead_lettered_before_the_handler(
    settings: type[Settings],
) -> None:
    """The reply address was checked after the handler ran, and `InvalidReply`
    counted as a failed attempt: the handler ran `max_attempts` times for nothing. It is
    checked when the entry is decoded; the request is dead-lettered at once, unhandled."""
    bus = EventBus(settings(max_attempts=3))
    calls: list[int] = []

    @bus.subscriber("quotes", group="pricing")
    async def price(event: Quote, ctx: Context) -> Price:
        calls.append(event.quantity)
        return Price(sku=event.sku, total_cents=100)

    headers = {REPLY_TO: "eventbus:{eventbus}:locks:quotes:pricing", CORRELATION_ID: "c"}
    async with running(bus):
        await bus.publish("quotes", Quote(sku="x", quantity=1), resource_id="r", headers=headers)
        await bus.publish("quotes", Quote(sku="x", quantity=2), resource_id="r")
        dlq = bus.keys.dead_letter("quotes", "pricing")

        async def settled() -> bool:
            return calls == [2] and await bus.redis.xlen(dlq) == 1

        await wait_until(settled)
    ((_, letter),) = await bus.redis.xrange(dlq)
    assert letter[b"reason"] == b"undecodable" and b"reply" in letter[b"error"]
    assert letter[b"attempts"] == b"0"
    assert calls == [2]


async def test_a_request_of_an_older_eventbus_is_dead_lettered_before_the_handler(
    settings: type[Settings],
) -> None:
    """A request naming a reply stream of the form before per-topic reply streams
    (``eventbus:reply:<32 hex>``, with its ``eventbus-reply-key``) cannot be answered under the
    responder ACL: it is dead-lettered at once, unhandled, saying why."""
    bus = EventBus(settings(max_attempts=3))
    calls: list[int] = []

    @bus.subscriber("quotes", group="pricing")
    async def price(event: Quote) -> Price:
        calls.append(event.quantity)
        return Price(sku=event.sku, total_cents=100)

    stream = "eventbus:reply:" + "ab" * 16
    headers = {REPLY_TO: stream, CORRELATION_ID: "c", "eventbus-reply-key": "00" * 32}
    async with running(bus):
        await bus.publish("quotes", Quote(sku="x", quantity=1), resource_id="r", headers=headers)
        await bus.publish("quotes", Quote(sku="x", quantity=2), resource_id="r")
        dlq = bus.keys.dead_letter("quotes", "pricing")

        async def settled() -> bool:
            return calls == [2] and await bus.redis.xlen(dlq) == 1

        await wait_until(settled)
        assert not await bus.redis.exists(stream)
    ((_, letter),) = await bus.redis.xrange(dlq)
    assert (
        letter[b"reason"] == b"undecodable"
        and b"not an eventbus reply stream" in (letter[b"error"])
    )
    assert calls == [2]


@pytest.mark.single_node("ACL users are made on the one node here")
async def test_timeout_says_why_the_groups_could_not_be_listed(
    settings: type[Settings], redis_db: str
) -> None:
    """A requester whose user may not run XINFO GROUPS (NOPERM) was told that
    nobody subscribes to the topic, though a group reads it; it is told that the groups could
    not be listed, and the server's reason."""
    admin = redis.asyncio.Redis.from_url(redis_db)
    await admin.execute_command(
        "ACL", "SETUSER", "requester", "reset", "on", ">pw", "~*", "&*", "+@all", "-xinfo"
    )
    client = EventBus(settings(redis_url=redis_db.replace("redis://", "redis://requester:pw@")))
    stream = client.keys.stream("quotes", shard_of("x", client.settings.shards))
    await admin.xgroup_create(stream, "pricing", id="0", mkstream=True)  # somebody subscribes
    try:
        async with client:
            with pytest.raises(RequestTimeout) as info:
                await client.request(
                    "quotes", Quote(sku="x", quantity=1), resource_id="x", timeout_s=0.3
                )
    finally:
        await client.aclose()
        await admin.acl_deluser("requester")
        await admin.aclose()
    message = str(info.value)
    assert "nobody subscribes" not in message
    assert "could not be listed" in message and "NOPERM" in message
    assert "xinfo|groups" in message and stream in message
    assert info.value.groups == [] and info.value.groups_unknown is not None


async def test_a_batch_handler_answers_each_request_with_its_item_of_the_list(
    settings: type[Settings],
) -> None:
    """A batch handler returns one answer per event, in order; before, its return value was
    dropped and the callers timed out."""
    server = EventBus(settings(shards=1))

    @server.subscriber("quotes", group="pricing", batch=True)
    async def price(quotes: list[Quote]) -> list[Price | None]:
        return [
            None if q.sku == "plain" else Price(sku=q.sku, total_cents=q.quantity) for q in quotes
        ]

    client = EventBus(settings(shards=1))
    results: dict[int, Price] = {}

    async def ask(i: int) -> None:
        results[i] = await client.request(
            "quotes",
            Quote(sku=f"s{i}", quantity=i),
            resource_id=f"r{i}",
            timeout_s=60,
            reply_model=Price,
        )

    async with running(server), client:
        await client.publish("quotes", Quote(sku="plain", quantity=0), resource_id="p")
        async with anyio.create_task_group() as tg:
            for i in range(5):
                tg.start_soon(ask, i)
    assert results == {i: Price(sku=f"s{i}", total_cents=i) for i in range(5)}
    await client.aclose()


async def test_a_batch_handler_that_does_not_answer_a_request_fails_loudly(
    settings: type[Settings],
) -> None:
    """A batch holding a request whose handler returns something else than one answer per
    event: the attempt fails with `InvalidReply` (logged, retried, then split and dead-lettered
    as any failure), as a single-event handler's non-model answer does. The same return
    without a request is ignored, as before."""
    bus = EventBus(settings(shards=1, max_attempts=1))
    calls: list[str] = []

    @bus.subscriber("quotes", group="pricing", batch=True)
    async def count(quotes: list[Quote]) -> int:
        calls.extend(q.sku for q in quotes)
        return len(quotes)

    headers = {REPLY_TO: requester(bus.redis, bus.keys, "quotes").stream, CORRELATION_ID: "c"}
    dlq = bus.keys.dead_letter("quotes", "pricing")
    async with running(bus):
        await bus.publish("quotes", Quote(sku="plain", quantity=1), resource_id="a")
        asks = await bus.publish(
            "quotes", Quote(sku="asks", quantity=1), resource_id="b", headers=headers
        )

        async def settled() -> bool:
            return await bus.redis.xlen(dlq) == 1 and "plain" in calls and "asks" in calls

        await wait_until(settled)
    ((_, letter),) = await bus.redis.xrange(dlq)
    # (the failed batch is split down to the per-event path, whose InvalidReply is stored)
    assert b"answering a request returned int" in letter[b"error"], letter
    assert letter[b"entry_id"].decode() == asks  # the plain event was acked, not dead-lettered
    await bus.aclose()

"""Replies bound to their request, as cases run on fakeredis and on a real
redis-server (`cases.backends`): a request carries no secret; a caller accepts a reply only if it
names the request's own shard and entry ID, so a reply written by someone who knows the reply
stream and correlation ID but not the entry, or the answer to a request that copied another
caller's reply headers, is logged at WARNING and ignored, and the request still gets the
handler's reply. Who may write a topic's reply streams at all is the ACL's
(`tests/integration/test_acl_roles.py`). The wire names are docs/protocol.md's, written here,
not taken from eventbus, so the cases also check the documented format."""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import anyio
from cases.backends import Backend
from pydantic import BaseModel
from support import running, wait_until

from eventbus import Context
from eventbus.protocol.codec import decode_entry, encode_entry, envelope_of
from eventbus.request import requester

# the wire names of docs/protocol.md, "Request/reply"
REPLY_TO = "eventbus-reply-to"
CORRELATION_ID = "eventbus-correlation-id"
REQUEST_ENTRY = "eventbus-request-entry"


class Quote(BaseModel):
    sku: str
    quantity: int


class Price(BaseModel):
    sku: str
    total_cents: int


class Progress:
    """WARNING records of the ``eventbus`` logger and the request's result, and an event set
    whenever either arrives (the requester logs on the event loop's thread)."""

    def __init__(self) -> None:
        self.warnings: list[str] = []
        self.result: dict[str, Any] = {}
        self.changed = anyio.Event()

    def note(self) -> None:
        self.changed.set()
        self.changed = anyio.Event()

    async def until(self, warnings: int) -> None:
        """Wait until `warnings` warnings were logged or the request returned."""
        with anyio.fail_after(20):
            while len(self.warnings) < warnings and not self.result:
                await self.changed.wait()

    @contextmanager
    def watching(self) -> Iterator[None]:
        progress = self

        class Catch(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                progress.warnings.append(record.getMessage())
                progress.note()

        handler = Catch(logging.WARNING)
        logger = logging.getLogger("eventbus")
        saved = logger.level, logger.disabled  # as another test's logging set-up left them
        logger.setLevel(min(logger.getEffectiveLevel(), logging.WARNING))
        logger.disabled = False
        logger.addHandler(handler)
        try:
            yield
        finally:
            logger.removeHandler(handler)
            logger.setLevel(saved[0])
            logger.disabled = saved[1]


class RequestReplyCases:
    async def _answered_after(
        self, backend: Backend, intrude: Any, warnings: int
    ) -> tuple[Progress, dict[str, str]]:
        """Request a price from a handler that waits, once it has the request, until
        ``await intrude(headers, server)`` (a forger's move, given the request's headers and
        the running server bus) has been followed by `warnings` warnings (or the request
        returned); then it answers."""
        server = backend.bus(shards=1)
        started, release = anyio.Event(), anyio.Event()
        headers: dict[str, str] = {}

        @server.subscriber("quotes", group="pricing")
        async def price(q: Quote, ctx: Context) -> Price:
            if q.sku == "a":  # the request under attack; others are answered at once
                headers.update(ctx.headers)
                headers["entry"] = f"{ctx.shard}/{ctx.entry_id}"
                started.set()
                await release.wait()
            return Price(sku=q.sku, total_cents=q.quantity * 250)

        client = backend.bus(shards=1)
        progress = Progress()

        async def ask() -> None:
            progress.result["reply"] = await client.request(
                "quotes",
                Quote(sku="a", quantity=4),
                resource_id="a",
                timeout_s=20,
                reply_model=Price,
            )
            progress.note()

        with progress.watching():
            async with running(server), client, anyio.create_task_group() as tg:
                tg.start_soon(ask)
                await started.wait()
                await intrude(headers, server)
                await progress.until(warnings)
                assert progress.result == {}, "a reply not from the handler was returned"
                release.set()
        await client.aclose()
        assert progress.result == {"reply": Price(sku="a", total_cents=1000)}
        return progress, headers

    async def test_a_forged_reply_is_ignored_and_the_real_one_returned(
        self, backend: Backend
    ) -> None:
        """A writer of the reply stream that knows the reply stream and correlation ID of a
        pending request (not its entry) appends replies with that correlation ID: one naming no
        request entry, one naming another entry. Neither is returned, each is logged at WARNING
        naming its entry; the handler's reply is returned."""
        forged_ids: list[str] = []

        async def forge(headers: dict[str, str], _server: Any) -> None:
            stream, cid = headers[REPLY_TO], headers[CORRELATION_ID]
            for extra in ({}, {REQUEST_ENTRY: "0/1-0"}):
                fields = encode_entry(
                    envelope_of("a", Price(sku="a", total_cents=1), {CORRELATION_ID: cid, **extra})
                )
                entry_id = await backend.redis.xadd(stream, fields)
                forged_ids.append(entry_id.decode() if isinstance(entry_id, bytes) else entry_id)

        progress, _ = await self._answered_after(backend, forge, warnings=2)
        assert len(progress.warnings) == 2
        for entry_id, message, why in zip(
            forged_ids,
            progress.warnings,
            ("names no request entry", "answers request entry '0/1-0'"),
            strict=True,
        ):
            assert entry_id in message and why in message and "ignored" in message

    async def test_a_request_naming_another_callers_reply_stream_gets_no_say(
        self, backend: Backend
    ) -> None:
        """A publisher sends its own request naming a pending request's reply stream and
        correlation ID: the handler answers it into that stream, naming the publisher's entry,
        which the waiting caller rejects; the caller gets its own reply."""
        hijacks: list[str] = []

        async def redirect(headers: dict[str, str], server: Any) -> None:
            hijack = {REPLY_TO: headers[REPLY_TO], CORRELATION_ID: headers[CORRELATION_ID]}
            hijacks.append(
                await server.publish(
                    "quotes", Quote(sku="evil", quantity=0), resource_id="evil", headers=hijack
                )
            )

        progress, headers = await self._answered_after(backend, redirect, warnings=1)
        assert len(progress.warnings) == 1
        assert (
            f"answers request entry '0/{hijacks[0]}', not '{headers['entry']}'"
            in (progress.warnings[0])
        )

    async def test_a_responder_answers_only_into_its_topics_reply_streams(
        self, backend: Backend
    ) -> None:
        """A request on another topic naming a pending request's reply stream (of `quotes`):
        its handler's answer is refused by the responder (`InvalidReply`, the attempt fails
        and is dead-lettered), nothing is written to the stream, and the caller gets its own
        reply."""
        failures: list[str] = []

        async def elsewhere(headers: dict[str, str], server: Any) -> None:
            other = backend.bus(shards=1)

            @other.subscriber("gossip", group="chatter", max_attempts=1)
            async def chat(q: Quote) -> Price:
                return Price(sku="evil", total_cents=1)

            hijack = {REPLY_TO: headers[REPLY_TO], CORRELATION_ID: headers[CORRELATION_ID]}
            async with running(other):
                await server.publish(
                    "gossip", Quote(sku="evil", quantity=0), resource_id="e", headers=hijack
                )
                dlq = other.keys.dead_letter("gossip", "chatter")
                await wait_until(lambda: _length(backend.redis, dlq, 1))
                [(_, letter)] = await backend.redis.xrange(dlq)
                failures.append(letter[b"error"].decode())
            await other.aclose()

        _, headers = await self._answered_after(backend, elsewhere, warnings=0)
        assert "which is not one of 'gossip'" in failures[0]
        entries = await backend.redis.xrange(headers[REPLY_TO])
        assert [decode_entry(f).payload for _, f in entries] == [{"sku": "a", "total_cents": 1000}]

    async def test_a_reply_made_by_the_documented_format_is_accepted(
        self, backend: Backend
    ) -> None:
        """The normal path, written by hand from docs/protocol.md (as another language would):
        a reply with the request's correlation ID and shard/entry is returned."""
        server = backend.bus(shards=1)
        headers: dict[str, str] = {}
        seen = anyio.Event()

        @server.subscriber("quotes", group="pricing")
        async def note(q: Quote, ctx: Context) -> None:  # answers nothing itself
            headers.update(ctx.headers)
            headers["entry"] = f"{ctx.shard}/{ctx.entry_id}"
            seen.set()

        client = backend.bus(shards=1)
        reply: dict[str, Price] = {}

        async def ask() -> None:
            reply["price"] = await client.request(
                "quotes",
                Quote(sku="a", quantity=4),
                resource_id="a",
                timeout_s=20,
                reply_model=Price,
            )

        async with running(server), client, anyio.create_task_group() as tg:
            tg.start_soon(ask)
            await seen.wait()
            answer = {CORRELATION_ID: headers[CORRELATION_ID], REQUEST_ENTRY: headers["entry"]}
            fields = encode_entry(envelope_of("a", Price(sku="a", total_cents=7), answer))
            await backend.redis.xadd(headers[REPLY_TO], fields)
        await client.aclose()
        assert reply == {"price": Price(sku="a", total_cents=7)}

    async def test_requests_carry_no_secret_and_replies_name_their_request(
        self, backend: Backend
    ) -> None:
        """The normal path through eventbus on both sides: a request carries only the reply
        stream (the topic's: ``eventbus:reply:quotes:<32 hex>``) and a correlation ID, and
        each reply names its request's shard and entry ID."""
        server = backend.bus(shards=2)
        requests: list[tuple[dict[str, str], str]] = []

        @server.subscriber("quotes", group="pricing")
        async def price(q: Quote, ctx: Context) -> Price:
            requests.append((ctx.headers, f"{ctx.shard}/{ctx.entry_id}"))
            return Price(sku=q.sku, total_cents=q.quantity * 250)

        client = backend.bus(shards=2)
        async with running(server), client:
            for i in (1, 2):
                reply = await client.request(
                    "quotes", Quote(sku=f"s{i}", quantity=i), resource_id=f"s{i}", timeout_s=20
                )
                assert reply == {"sku": f"s{i}", "total_cents": i * 250}
            entries = await backend.redis.xrange(requests[0][0][REPLY_TO])
        await client.aclose()
        for headers, _ in requests:
            assert set(headers) == {REPLY_TO, CORRELATION_ID}
            assert re.fullmatch("eventbus:reply:quotes:[0-9a-f]{32}", headers[REPLY_TO])
        named = {h[CORRELATION_ID]: entry for h, entry in requests}
        assert len(entries) == 2
        for _id, fields in entries:
            env = decode_entry(fields)
            assert env.headers[REQUEST_ENTRY] == named[env.headers[CORRELATION_ID]]

    async def test_a_reply_read_before_its_publish_returned_is_checked_then(
        self, backend: Backend
    ) -> None:
        """Two requests of one bus share a reader: a reply read by the other request while its
        own publish has not returned yet (its entry ID unknown) is kept, then checked and
        returned."""
        server = backend.bus(shards=1)
        release = anyio.Event()

        @server.subscriber("quotes", group="pricing")
        async def price(q: Quote) -> Price:
            if q.sku == "slow":  # the other request keeps reading until ours is answered
                await release.wait()
            return Price(sku=q.sku, total_cents=q.quantity)

        client = backend.bus(shards=1)
        reader = requester(client.redis, client.keys, "quotes")

        async def publish(topic: str, event: Any, *, resource_id: str, headers: Any) -> str:
            entry_id = await client.publish(topic, event, resource_id=resource_id, headers=headers)
            waiting = reader._waiting[headers[CORRELATION_ID]]
            await wait_until(lambda: waiting.early)  # read by the other request's reader
            release.set()
            return entry_id

        result: dict[str, Any] = {}

        async def slow() -> None:
            result["slow"] = await client.request(
                "quotes", Quote(sku="slow", quantity=1), resource_id="a", timeout_s=20
            )

        async with running(server), client, anyio.create_task_group() as tg:
            tg.start_soon(slow)
            await wait_until(lambda: reader._reading.locked())
            env = await reader.request(
                publish, client.topic("quotes"), Quote(sku="b", quantity=2), "b", 20, None
            )
        await client.aclose()
        assert env.payload == {"sku": "b", "total_cents": 2}
        assert result == {"slow": {"sku": "slow", "total_cents": 1}}


async def _length(r: Any, key: str, n: int) -> bool:
    return int(await r.xlen(key)) == n

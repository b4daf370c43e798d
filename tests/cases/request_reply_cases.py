"""Verifiable replies (issue 20 item 3), as cases run on fakeredis and on a real redis-server
(`cases.backends`): a reply is accepted only if its MAC, keyed by the request's secret, verifies;
a reply forged by someone who knows the reply stream and correlation ID but not the secret, or
an authentic one altered, is logged at WARNING and ignored, and the request still gets the
handler's reply. The MAC is computed here from docs/protocol.md, not with eventbus's function,
so the cases also check the documented wire format."""

from __future__ import annotations

import hashlib
import hmac
import logging
import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import anyio
from cases.backends import Backend
from pydantic import BaseModel
from support import running

from eventbus import Context
from eventbus.protocol.codec import decode_entry, encode_entry, envelope_of

# the wire names of docs/protocol.md, "Request/reply"
REPLY_TO = "eventbus-reply-to"
CORRELATION_ID = "eventbus-correlation-id"
REPLY_KEY = "eventbus-reply-key"
MAC = b"mac"


class Quote(BaseModel):
    sku: str
    quantity: int


class Price(BaseModel):
    sku: str
    total_cents: int


def documented_mac(key_hex: str, cid: str, fields: dict[bytes, bytes]) -> bytes:
    """A reply's ``mac`` field as docs/protocol.md specifies it: HMAC-SHA256 keyed by the
    request's secret over ``eventbus-reply-v1`` and the length-prefixed correlation ID, rid,
    type and data, as 64 lowercase hex digits."""
    msg = b"eventbus-reply-v1"
    for part in (cid.encode(), fields[b"rid"], fields[b"type"], fields[b"data"]):
        msg += len(part).to_bytes(4, "big") + part
    return hmac.new(bytes.fromhex(key_hex), msg, hashlib.sha256).hexdigest().encode()


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
        """Issue 20 item 3: a second requester that knows the reply stream and correlation ID
        of a pending request (not its secret) appends replies with that correlation ID: one
        without a MAC, one with a MAC under a key of its own. Neither is returned, each is
        logged at WARNING naming its entry; the handler's reply is returned."""
        forged_ids: list[str] = []

        async def forge(headers: dict[str, str], _server: Any) -> None:
            stream, cid = headers[REPLY_TO], headers[CORRELATION_ID]
            fields = encode_entry(
                envelope_of("a", Price(sku="a", total_cents=1), {CORRELATION_ID: cid})
            )
            guessed = {**fields, MAC: documented_mac("ab" * 32, cid, fields)}
            for entry in (fields, guessed):
                entry_id = await backend.redis.xadd(stream, entry)
                forged_ids.append(entry_id.decode() if isinstance(entry_id, bytes) else entry_id)

        progress, _ = await self._answered_after(backend, forge, warnings=2)
        assert len(progress.warnings) == 2
        for entry_id, message, why in zip(
            forged_ids, progress.warnings, ("has no mac field", "mac does not match"), strict=True
        ):
            assert entry_id in message and why in message and "ignored" in message

    async def test_a_request_naming_another_callers_reply_stream_gets_no_say(
        self, backend: Backend
    ) -> None:
        """A publisher sends its own request naming a pending request's reply stream and
        correlation ID, with a key of its own: the handler answers it into that stream, with a
        MAC the waiting caller rejects (another key); the caller gets its own reply."""

        async def redirect(headers: dict[str, str], server: Any) -> None:
            hijack = {
                REPLY_TO: headers[REPLY_TO],
                CORRELATION_ID: headers[CORRELATION_ID],
                REPLY_KEY: "cd" * 32,
            }
            await server.publish(
                "quotes", Quote(sku="evil", quantity=0), resource_id="evil", headers=hijack
            )

        progress, _ = await self._answered_after(backend, redirect, warnings=1)
        assert len(progress.warnings) == 1 and "mac does not match" in progress.warnings[0]

    async def test_a_tampered_reply_is_rejected(self, backend: Backend) -> None:
        """A reply with a valid MAC whose payload, resource ID or type was changed afterwards
        is rejected (the MAC covers all three and the correlation ID); the same reply unchanged
        would be accepted (`test_a_reply_made_by_the_documented_format_is_accepted`)."""

        async def tamper(headers: dict[str, str], _server: Any) -> None:
            stream, cid, key = headers[REPLY_TO], headers[CORRELATION_ID], headers[REPLY_KEY]
            fields = encode_entry(
                envelope_of("a", Price(sku="a", total_cents=1000), {CORRELATION_ID: cid})
            )
            mac = documented_mac(key, cid, fields)
            cheaper = encode_entry(
                envelope_of("a", Price(sku="a", total_cents=1), {CORRELATION_ID: cid})
            )
            for changed in (
                {b"data": cheaper[b"data"]},
                {b"rid": b"b"},
                {b"type": b"Quote"},
            ):
                await backend.redis.xadd(stream, {**fields, MAC: mac, **changed})

        progress, _ = await self._answered_after(backend, tamper, warnings=3)
        assert len(progress.warnings) == 3
        assert all("mac does not match" in m for m in progress.warnings)

    async def test_a_reply_made_by_the_documented_format_is_accepted(
        self, backend: Backend
    ) -> None:
        """The normal path, written by hand from docs/protocol.md (as another language would):
        a reply with the request's correlation ID and the documented MAC is returned."""
        server = backend.bus(shards=1)
        headers: dict[str, str] = {}
        seen = anyio.Event()

        @server.subscriber("quotes", group="pricing")
        async def note(q: Quote, ctx: Context) -> None:  # answers nothing itself
            headers.update(ctx.headers)
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
            cid, key = headers[CORRELATION_ID], headers[REPLY_KEY]
            fields = encode_entry(
                envelope_of("a", Price(sku="a", total_cents=7), {CORRELATION_ID: cid})
            )
            await backend.redis.xadd(
                headers[REPLY_TO], {**fields, MAC: documented_mac(key, cid, fields)}
            )
        await client.aclose()
        assert reply == {"price": Price(sku="a", total_cents=7)}

    async def test_replies_carry_a_mac_and_never_the_secret(self, backend: Backend) -> None:
        """The normal path through eventbus on both sides: every request carries its own
        secret (64 hex digits), the handler's reply carries the documented MAC, and nothing in
        the reply stream (which other requesters may be able to read) holds the secret."""
        server = backend.bus(shards=2)
        requests: list[dict[str, str]] = []

        @server.subscriber("quotes", group="pricing")
        async def price(q: Quote, ctx: Context) -> Price:
            requests.append(ctx.headers)
            return Price(sku=q.sku, total_cents=q.quantity * 250)

        client = backend.bus(shards=2)
        async with running(server), client:
            for i in (1, 2):
                reply = await client.request(
                    "quotes", Quote(sku=f"s{i}", quantity=i), resource_id=f"s{i}", timeout_s=20
                )
                assert reply == {"sku": f"s{i}", "total_cents": i * 250}
            entries = await backend.redis.xrange(requests[0][REPLY_TO])
        await client.aclose()
        keys = {h[CORRELATION_ID]: h[REPLY_KEY] for h in requests}
        assert len(set(keys.values())) == 2
        assert all(re.fullmatch("[0-9a-f]{64}", k) for k in keys.values())
        assert len(entries) == 2
        for _id, fields in entries:
            cid = decode_entry(fields).headers[CORRELATION_ID]
            assert fields[MAC] == documented_mac(keys[cid], cid, fields)
            for key in keys.values():
                secret = (key.encode(), bytes.fromhex(key))
                assert not any(k in v for k in secret for v in fields.values())

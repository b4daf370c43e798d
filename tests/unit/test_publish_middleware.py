"""Publish middlewares (`eventbus.publishing.middleware`): entered around `EventBus.publish`,
handlers' ``ctx.publish`` included, in registration order; they may add headers, see the entry
ID, see the error; and ``ctx.publish`` from a plain ``def`` handler publishes with the
handled event's causation and correlation IDs."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pytest
from pydantic import BaseModel

from eventbus import ConfigError, Context, EventBus
from eventbus.consumer.scope import CAUSATION_ID
from eventbus.protocol.replies import CORRELATION_ID
from eventbus.publishing.middleware import Outgoing
from eventbus.testing import running

pytestmark = pytest.mark.anyio


class OrderPlaced(BaseModel):
    order_id: str


class Invoiced(BaseModel):
    order_id: str


async def test_middlewares_nest_add_headers_and_see_the_entry_id() -> None:
    log: list[Any] = []
    bus = EventBus()

    @bus.publish_middleware
    @contextlib.asynccontextmanager
    async def outer(message: Outgoing) -> AsyncIterator[None]:
        log.append(("outer in", message.topic))
        message.headers["tenant"] = "acme"
        yield
        log.append(("outer out", message.entry_id))

    @bus.publish_middleware
    @contextlib.asynccontextmanager
    async def inner(message: Outgoing) -> AsyncIterator[None]:
        log.append(("inner in", dict(message.headers)))
        yield
        log.append(("inner out", message.entry_id))

    async with running(bus) as tb:
        entry_id = await tb.publish(
            "orders", OrderPlaced(order_id="o"), resource_id="o", headers={"a": "1"}
        )
        (stored,) = await tb.published("orders")
    assert log == [
        ("outer in", "orders"),
        ("inner in", {"a": "1", "tenant": "acme"}),
        ("inner out", entry_id),
        ("outer out", entry_id),
    ]
    assert stored.headers == {"a": "1", "tenant": "acme"}


async def test_a_middleware_raising_before_the_send_publishes_nothing() -> None:
    bus = EventBus()
    seen: list[BaseException] = []

    @bus.publish_middleware
    @contextlib.asynccontextmanager
    async def watch(message: Outgoing) -> AsyncIterator[None]:
        try:
            yield
        except BaseException as exc:
            seen.append(exc)
            raise

    @bus.publish_middleware
    @contextlib.asynccontextmanager
    async def refuse(message: Outgoing) -> AsyncIterator[None]:
        if message.resource_id == "bad":
            raise PermissionError("not this one")
        yield

    async with running(bus) as tb:
        with pytest.raises(PermissionError, match="not this one"):
            await tb.publish("orders", OrderPlaced(order_id="o"), resource_id="bad")
        assert await tb.published("orders") == []
    assert [type(e) for e in seen] == [PermissionError]


async def test_handlers_publish_through_the_middlewares() -> None:
    bus = EventBus()

    @bus.publish_middleware
    @contextlib.asynccontextmanager
    async def stamp(message: Outgoing) -> AsyncIterator[None]:
        message.headers["by"] = "billing"
        yield

    @bus.subscriber("orders", group="billing")
    async def bill(event: OrderPlaced, ctx: Context) -> None:
        await ctx.publish("invoices", Invoiced(order_id=event.order_id), resource_id="o")

    async with running(bus, fail_fast=True) as tb:
        await tb.publish("orders", OrderPlaced(order_id="o"), resource_id="o")
        await tb.drain()
        (invoice,) = await tb.published("invoices")
    assert invoice.headers["by"] == "billing"
    assert CAUSATION_ID in invoice.headers


def test_a_publish_middleware_must_be_callable() -> None:
    with pytest.raises(ConfigError, match="callable"):
        EventBus().publish_middleware("no")  # type: ignore[arg-type]


async def test_a_sync_handler_publishes_with_causation_kept() -> None:
    bus = EventBus()
    ids: list[tuple[str, str]] = []

    @bus.subscriber("orders", group="billing")
    def bill(event: OrderPlaced, ctx: Context) -> None:  # a plain def: in a worker thread
        entry_id = ctx.publish("invoices", Invoiced(order_id=event.order_id), resource_id="o")
        ids.append((entry_id, str(ctx.event_id)))

    async with running(bus, fail_fast=True) as tb:
        await tb.publish("orders", OrderPlaced(order_id="o"), resource_id="o")
        await tb.drain()
        (invoice,) = await tb.published("invoices")
    ((entry_id, order_event_id),) = ids
    assert entry_id == invoice.entry_id
    assert invoice.headers[CAUSATION_ID] == order_event_id
    assert invoice.headers[CORRELATION_ID] == order_event_id

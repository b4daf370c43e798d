"""`eventbus.router.Router`: handlers, topics and publications declared without the bus, then
included: prefixed topics, the router's default group, its middlewares around its handlers only
(inside the bus's), nested routers, and the contract ``eventbus describe`` prints."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pytest
from pydantic import BaseModel

from eventbus import ConfigError, Context, EventBus, Router
from eventbus.asyncapi import asyncapi_document
from eventbus.contract import contract_of
from eventbus.testing import running

pytestmark = pytest.mark.anyio


class OrderPlaced(BaseModel):
    order_id: str


class Invoiced(BaseModel):
    order_id: str


def _tracing(name: str, log: list[str]) -> Any:
    @contextlib.asynccontextmanager
    async def mw(event: Any, ctx: Any) -> AsyncIterator[None]:
        log.append(f"{name} in")
        yield
        log.append(f"{name} out")

    return mw


async def test_a_routers_handlers_run_on_its_prefixed_topics_in_its_group() -> None:
    seen: list[tuple[str, str, str]] = []
    router = Router(prefix="billing.", group="billing")

    @router.subscriber("orders")
    async def bill(event: OrderPlaced, ctx: Context) -> None:
        seen.append((ctx.topic, ctx.group, event.order_id))

    bus = EventBus()
    bus.include_router(router)

    assert [(s.topic.name, s.group) for s in bus.subscriptions] == [("billing.orders", "billing")]
    async with running(bus, fail_fast=True) as tb:
        await tb.publish("billing.orders", OrderPlaced(order_id="o-1"), resource_id="o-1")
        await tb.drain()
    assert seen == [("billing.orders", "billing", "o-1")]


async def test_router_middleware_wraps_its_handlers_only_inside_the_buses() -> None:
    log: list[str] = []
    router = Router(group="r", middleware=[_tracing("router", log)])

    @router.subscriber("a")
    async def routed(event: OrderPlaced) -> None:
        log.append("routed")

    bus = EventBus()
    bus.middleware(_tracing("bus", log))

    @bus.subscriber("b", group="plain")
    async def plain(event: OrderPlaced) -> None:
        log.append("plain")

    bus.include_router(router)
    bus.middleware(_tracing("late", log))  # registered after the include: still outside

    async with running(bus, fail_fast=True) as tb:
        await tb.publish("a", OrderPlaced(order_id="1"), resource_id="1")
        await tb.drain()
        assert log == [
            "bus in",
            "late in",
            "router in",
            "routed",
            "router out",
            "late out",
            "bus out",
        ]
        log.clear()
        await tb.publish("b", OrderPlaced(order_id="2"), resource_id="2")
        await tb.drain()
    assert log == ["bus in", "late in", "plain", "late out", "bus out"]


def test_nested_routers_join_prefixes_and_the_inner_group_wins() -> None:
    outer = Router(prefix="shop.", group="outer")
    inner = Router(prefix="billing.", group="inner")
    plain = Router(prefix="mail.")

    @inner.subscriber("orders")
    async def a(event: OrderPlaced) -> None: ...

    @plain.subscriber("orders")
    async def b(event: OrderPlaced) -> None: ...

    @outer.subscriber("orders", group="own")
    async def c(event: OrderPlaced) -> None: ...

    inner.publishes("invoices", Invoiced)
    inner.topic("invoices", shards=4)
    outer.include_router(inner)
    outer.include_router(plain)
    bus = EventBus()
    bus.include_router(outer)

    assert sorted((s.topic.name, s.group) for s in bus.subscriptions) == [
        ("shop.billing.orders", "inner"),
        ("shop.mail.orders", "outer"),
        ("shop.orders", "own"),
    ]
    assert bus.topic("shop.billing.invoices").shards == 4
    assert bus.publications == {"shop.billing.invoices": [Invoiced]}


def test_the_contract_and_asyncapi_document_see_included_handlers() -> None:
    router = Router(prefix="billing.", group="billing")

    @router.subscriber("orders")
    async def bill(event: OrderPlaced) -> None: ...

    router.publishes("invoices", Invoiced)
    bus = EventBus()
    bus.include_router(router)

    contract = contract_of(bus)
    doc = asyncapi_document(contract, keys=bus.keys, title="shop")

    assert [(g.topic.name, g.group) for g in contract.groups] == [("billing.orders", "billing")]
    assert contract.publishes == {"billing.invoices": [Invoiced]}
    assert {"billing.orders", "billing.invoices"} <= {
        c.get("title", name) for name, c in doc["channels"].items()
    } | set(doc["channels"])


def test_a_router_without_group_needs_one_on_its_subscriber() -> None:
    router = Router()

    @router.subscriber("orders")
    async def bill(event: OrderPlaced) -> None: ...

    with pytest.raises(ConfigError, match="give a group"):
        EventBus().include_router(router)


def test_a_router_with_middleware_cannot_join_a_group_declared_elsewhere() -> None:
    bus = EventBus()

    @bus.subscriber("orders", group="billing")
    async def on_bus(event: OrderPlaced) -> None: ...

    router = Router(group="billing", middleware=[_tracing("r", [])])

    @router.subscriber("orders")
    async def on_router(event: Invoiced) -> None: ...

    with pytest.raises(ConfigError, match="other middlewares"):
        bus.include_router(router)


def test_a_router_cannot_include_itself_and_refuses_a_bad_middleware() -> None:
    a, b = Router(), Router()
    a.include_router(b)
    with pytest.raises(ConfigError, match="itself"):
        b.include_router(a)
    with pytest.raises(ConfigError, match="callable"):
        Router(middleware=["not a function"])  # type: ignore[list-item]

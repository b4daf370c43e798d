"""The shop's events, bus and handlers (``eventbus run examples.shop.service:bus``).

An order's events carry its order ID as resource ID: they land in one shard and each group
handles them one after another, in publish order (a cancellation never before its placement).
Handlers run at least once: one interrupted before its ack (a crash, Redis restarting) runs again
with ``ctx.redelivered``; a real handler writes its effects keyed by ``ctx.event_id``.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated, ClassVar

from pydantic import BaseModel

from eventbus import Context, Depends, EventBus, Router
from eventbus.publishing.middleware import Outgoing

log = logging.getLogger("shop")

bus = EventBus.from_env()  # REDIS_URL, EVENTBUS_* settings


# Every event this service publishes (routes, handlers, the outbox) names it in a header.
@bus.publish_middleware
@asynccontextmanager
async def sent_by_shop(message: Outgoing) -> AsyncIterator[None]:
    message.headers.setdefault("sender", "shop")
    yield


# Events. A stable __event_type__: renaming or moving a class changes nothing on the wire.
class OrderPlaced(BaseModel):
    __event_type__: ClassVar[str] = "shop.order_placed"
    order_id: str
    sku: str
    quantity: int


class OrderCancelled(BaseModel):
    __event_type__: ClassVar[str] = "shop.order_cancelled"
    order_id: str


class ShipmentRequested(BaseModel):
    __event_type__: ClassVar[str] = "shop.shipment_requested"
    order_id: str
    sku: str
    quantity: int


class PriceChanged(BaseModel):
    __event_type__: ClassVar[str] = "shop.price_changed"
    sku: str
    cents: int


class QuoteRequested(BaseModel):
    __event_type__: ClassVar[str] = "shop.quote_requested"
    sku: str
    quantity: int


class Quote(BaseModel):
    """The reply to a `QuoteRequested`; `total_cents` is None for an unknown SKU."""

    sku: str
    quantity: int
    total_cents: int | None


# What this service publishes, for its contract (`eventbus describe examples.shop.service:bus`).
bus.publishes("orders", OrderPlaced, OrderCancelled)
bus.publishes("prices", PriceChanged)
bus.publishes("shipments", ShipmentRequested)
bus.publishes("quotes", QuoteRequested)


# Broadcast: every running instance gets every price change, and keeps its own price list.
prices: dict[str, int] = {}


@bus.subscriber("prices", broadcast=True)
async def price_changed(event: PriceChanged) -> None:
    prices[event.sku] = event.cents


# Request/reply: the handler's return value answers `bus.request` (app.py's quote route).
@bus.subscriber("quotes", group="pricing")
async def quote(request: QuoteRequested) -> Quote:
    cents = prices.get(request.sku)
    total = None if cents is None else cents * request.quantity
    return Quote(sku=request.sku, quantity=request.quantity, total_cents=total)


# One group, two handlers, declared on a router (they could live in a module of their own that
# imports no bus; `bus.include_router(fulfilment)` below adds them): each event type goes to
# its handler, and an order's events still run in publish order through the group's single
# consumer. An event ID handled in the last day is skipped (a redelivery after a lost ack, a
# second copy of a re-sent XADD).
fulfilment = Router(group="fulfilment")


@fulfilment.subscriber("orders", on_failure="park", dedup_window_s=24 * 3600)
async def order_placed(event: OrderPlaced, ctx: Context) -> None:
    shipment = ShipmentRequested(order_id=event.order_id, sku=event.sku, quantity=event.quantity)
    # a follow-up event, chained to this one (its causation and correlation headers)
    await ctx.publish("shipments", shipment, resource_id=event.order_id)


@fulfilment.subscriber("orders")
async def order_cancelled(event: OrderCancelled, ctx: Context) -> None:
    log.info("order %s cancelled (event %s)", event.order_id, ctx.event_id)


bus.include_router(fulfilment)


class Shipped(BaseModel):
    __event_type__: ClassVar[str] = "shop.shipped"
    order_id: str


bus.publishes("shipped", Shipped)

# At least once: a redelivered OrderPlaced publishes a second ShipmentRequested (another event
# ID), so shipping is idempotent by order ID (a real service: a unique key in its database).
shipped: dict[str, int] = {}  # order ID -> quantity


@bus.on_startup
async def open_ledger() -> None:
    bus.state.ledger = shipped  # app-scoped: a real service opens its database pool here


def ledger(ctx: Context) -> dict[str, int]:  # a dependency: the handler's ledger, per event
    book: dict[str, int] = ctx.state.ledger
    return book


@bus.subscriber("shipments", group="shipping")
def ship(  # a plain def runs in a worker thread
    event: ShipmentRequested, ctx: Context, done: Annotated[dict[str, int], Depends(ledger)]
) -> None:
    if event.order_id in done:  # shipped already
        return
    done[event.order_id] = event.quantity
    log.info("shipping %d x %s for %s", event.quantity, event.sku, event.order_id)
    # from a def handler: published at once (the causation and correlation headers kept)
    ctx.publish("shipped", Shipped(order_id=event.order_id), resource_id=event.order_id)

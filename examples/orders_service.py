"""A small order-processing microservice: two consumer groups on one topic.

Run it (Redis at REDIS_URL, default redis://127.0.0.1:6379/0)::

    eventbus run examples.orders_service:bus --processes 2

and publish from anywhere (see web_handler.py, or the CLI)::

    eventbus publish orders --type OrderPlaced --resource-id o-1 \
        --data '{"order_id": "o-1", "customer": "c-9", "total_cents": 4200}'

Its contract (topics, groups, handlers, event schemas, policies, what it publishes)::

    eventbus describe examples.orders_service:bus --asyncapi orders.asyncapi.json

Billing must never see an order's cancellation before its placement, so the order ID is the
resource ID: both events of an order land in one shard and run in publish order. A payment that
keeps failing parks the order (its later events wait in the dead-letter stream, in order) until
an operator runs ``eventbus dlq requeue orders billing --resource o-1``.
"""

from __future__ import annotations

import logging

from pydantic import BaseModel

from eventbus import Context, EventBus

log = logging.getLogger("orders_service")

bus = EventBus.from_env()


class OrderPlaced(BaseModel):
    order_id: str
    customer: str
    total_cents: int


class OrderCancelled(BaseModel):
    order_id: str
    reason: str = ""


class Invoiced(BaseModel):
    """An order was charged: billing's own event, for the services downstream."""

    order_id: str
    total_cents: int


# What this service publishes, for its contract (`eventbus describe`): the web handlers publish
# orders' events (web_handler.py, fastapi_app.py), billing publishes invoices.
bus.publishes("orders", OrderPlaced, OrderCancelled)
bus.publishes("invoices", Invoiced)


# What the handlers did, for the example's test; a real service writes to its database,
# keyed by ctx.event_id (idempotency) and guarded by ctx.fencing_token.
ledger: dict[str, list[str]] = {"billing": [], "shipping": []}


@bus.subscriber("orders", group="billing", on_failure="park", max_attempts=5)
async def bill(event: OrderPlaced | OrderCancelled, ctx: Context) -> None:
    if isinstance(event, OrderPlaced):
        ledger["billing"].append(f"charge {event.order_id} {event.total_cents}")
        invoice = Invoiced(order_id=event.order_id, total_cents=event.total_cents)
        await bus.publish("invoices", invoice, resource_id=event.order_id)
    else:
        ledger["billing"].append(f"refund {event.order_id}")
    log.info(
        "billing %s %s (entry %s, token %d)",
        ctx.event_type,
        event.order_id,
        ctx.entry_id,
        ctx.fencing_token,
    )


# shipping does not care about cancellations: skip them (acked, counted) rather than
# dead-letter every one as an unknown event type
@bus.subscriber("orders", group="shipping", on_unknown="skip")
def ship(event: OrderPlaced) -> None:  # a plain function runs in a worker thread
    ledger["shipping"].append(f"ship {event.order_id} to {event.customer}")

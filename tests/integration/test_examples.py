"""The examples run as documented: the service's handlers through the in-memory test bus users
get (`eventbus.testing`), and the Flask handler publishing to a real redis-server."""

from __future__ import annotations

import importlib
import sys
from typing import Any

import pytest
import redis

pytestmark = pytest.mark.anyio


async def test_orders_service_handlers_through_the_test_bus() -> None:
    from eventbus.testing import running
    from examples import orders_service as svc

    async with running(svc.bus) as tb:
        await tb.publish(
            "orders",
            svc.OrderPlaced(order_id="o-1", customer="c-9", total_cents=4200),
            resource_id="o-1",
        )
        await tb.publish("orders", svc.OrderCancelled(order_id="o-1"), resource_id="o-1")
        await tb.drain()
        [invoice] = await tb.published("invoices")  # billing's own event, as declared
        # shipping takes OrderPlaced only: a cancellation is skipped, not dead-lettered as an
        # UnknownEventType (what every cancellation did before, found walking the docs)
        assert await tb.dead_letters("orders", "shipping") == []
        assert await tb.dead_letters("orders", "billing") == []
    assert svc.ledger["billing"] == ["charge o-1 4200", "refund o-1"]
    assert svc.ledger["shipping"] == ["ship o-1 to c-9"]  # cancellation: not its event type
    assert invoice.as_(svc.Invoiced) == svc.Invoiced(order_id="o-1", total_cents=4200)


def test_web_handler_publishes_and_rejects_bad_input(
    redis_db: str, topology: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("REDIS_URL", redis_db)
    for name in ("examples.web_handler", "examples.orders_service"):
        sys.modules.pop(name, None)  # the bus reads REDIS_URL at import
    web = importlib.import_module("examples.web_handler")
    client = web.app.test_client()

    ok = client.post("/orders", json={"order_id": "o-7", "customer": "c", "total_cents": 1})
    bad = client.post("/orders", json={"order_id": "o-8"})
    web._running.close()

    assert ok.status_code == 202 and bad.status_code == 422
    entry_id = ok.get_json()["entry_id"]
    # on the cluster, a client of every node: the shard streams spread over the primaries
    client = redis.RedisCluster if topology == "cluster" else redis.Redis
    with client.from_url(redis_db) as r:
        stored = [
            eid.decode()
            for key in r.scan_iter("eventbus:stream:orders:*")
            for eid, _ in r.xrange(key)
        ]
    assert stored == [entry_id]


@pytest.fixture
def eventbus_app() -> Any:
    """The shop's bus, for the pytest plugin's ``running_bus`` (as a user's conftest.py has it)."""
    from examples.shop import service

    return service.bus


async def test_shop_handlers_through_the_pytest_plugin(running_bus: Any) -> None:
    """examples/shop's handlers as its own tests would check them, in memory: broadcast,
    request/reply, routing by type, the follow-up chained with ``ctx.publish``, shipping once
    per order although two requests arrive (as after a redelivered placement)."""
    from examples.shop import service as shop

    shop.prices.clear()
    shop.shipped.clear()
    await running_bus.publish("prices", shop.PriceChanged(sku="tea", cents=350), resource_id="tea")
    placed = shop.OrderPlaced(order_id="o-1", sku="tea", quantity=2)
    await running_bus.publish("orders", placed, resource_id="o-1")
    await running_bus.publish("orders", shop.OrderCancelled(order_id="o-1"), resource_id="o-1")
    await running_bus.drain()
    quote = await running_bus.bus.request(
        "quotes", shop.QuoteRequested(sku="tea", quantity=2), resource_id="tea", timeout_s=10
    )
    follow_up = shop.ShipmentRequested(order_id="o-1", sku="tea", quantity=2)
    await running_bus.publish("shipments", follow_up, resource_id="o-1")  # a second request
    await running_bus.drain()

    assert quote == {"sku": "tea", "quantity": 2, "total_cents": 700}
    assert running_bus.events("orders") == [placed, shop.OrderCancelled(order_id="o-1")]
    first, _ = await running_bus.published("shipments")
    assert first.as_(shop.ShipmentRequested) == follow_up
    order = next(h.ctx for h in running_bus.handled if h.ctx.topic == "orders")
    assert first.headers["eventbus-causation-id"] == str(order.event_id)
    assert shop.shipped == {"o-1": 2}  # shipped once

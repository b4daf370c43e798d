"""The examples run as documented: the service's handlers through the in-memory test bus users
get (`eventbus.testing`), and the Flask handler publishing to a real redis-server."""

from __future__ import annotations

import importlib
import sys

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

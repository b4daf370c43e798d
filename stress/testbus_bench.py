"""``stress/testbus_bench.py``: how long a service's test takes with eventbus's test bus and with
FastStream's ``TestRedisBroker``, and what an empty ``TestBus.drain()`` costs.

The same service is written twice: 8 topics declared without a shard count (16 on a server, the
test bus's `MEMORY_SHARDS` in memory), 5 subscribers, two of which publish on (orders -> invoices
-> emails; payments -> shipments -> stock -> audit). The same 4
test cases run against each, with the same assertions:

* eventbus: each case in ``eventbus.testing.running(bus, fail_fast=True)``, what the pytest
  plugin's ``running_bus`` fixture enters for a test (in memory: fakeredis with Lua, the real
  consumer path), publish, ``drain()``, assert;
* FastStream 0.7: each case in ``TestRedisBroker(broker)`` (its in-memory test client: a publish
  calls the subscribers directly), publish, assert.

A case's time covers its whole test: entering the test bus (or broker), the case, and leaving it.
Reported: the median seconds per test case over ``--rounds`` rounds of the 4 cases, for each,
their ratio, and the median of an empty ``drain()`` (nothing published, every consumer reading)
with 1, 4, 8 and 32 topics of 16 shards, one subscriber each.

Run: ``.venv/bin/python stress/testbus_bench.py [--rounds 10] [--json F]``. Timing goals are here,
not in tests; the machine is shared, so compare ratios of one run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
from pydantic import BaseModel

from eventbus import Context, EventBus
from eventbus.testing import running

TOPICS = ["orders", "payments", "invoices", "shipments", "stock", "emails", "audit", "refunds"]


class OrderPlaced(BaseModel):
    order_id: str
    total_cents: int


class InvoiceIssued(BaseModel):
    order_id: str
    amount_cents: int


class PaymentCaptured(BaseModel):
    order_id: str
    sku: str


class ShipmentRequested(BaseModel):
    order_id: str
    sku: str


class StockChanged(BaseModel):
    sku: str
    left: int


class World:
    """What the handlers did (one per test case)."""

    def __init__(self) -> None:
        self.invoices: list[InvoiceIssued] = []
        self.emails: list[str] = []
        self.stock: dict[str, int] = {"sku-1": 10}
        self.audit: list[StockChanged] = []


# -- the service on eventbus --------------------------------------------------------------------
def eventbus_service(world: World) -> EventBus:
    bus = EventBus()
    for name in TOPICS:
        bus.topic(name)

    @bus.subscriber("orders", group="billing")
    async def bill(event: OrderPlaced, ctx: Context) -> None:
        invoice = InvoiceIssued(order_id=event.order_id, amount_cents=event.total_cents)
        await ctx.publish("invoices", invoice, resource_id=event.order_id)

    @bus.subscriber("invoices", group="mailer")
    async def mail(event: InvoiceIssued) -> None:
        world.emails.append(event.order_id)

    @bus.subscriber("payments", group="shipping")
    async def ship(event: PaymentCaptured, ctx: Context) -> None:
        request = ShipmentRequested(order_id=event.order_id, sku=event.sku)
        await ctx.publish("shipments", request, resource_id=event.order_id)

    @bus.subscriber("shipments", group="stock")
    async def take(event: ShipmentRequested, ctx: Context) -> None:
        world.stock[event.sku] -= 1
        changed = StockChanged(sku=event.sku, left=world.stock[event.sku])
        await ctx.publish("stock", changed, resource_id=event.sku)

    @bus.subscriber("stock", group="audit")
    async def audit(event: StockChanged) -> None:
        world.audit.append(event)

    return bus


# -- the same service on FastStream --------------------------------------------------------------
def faststream_service(world: World) -> Any:
    from faststream.redis import RedisBroker, StreamSub

    broker = RedisBroker(logger=None)

    def sub(stream: str, group: str) -> StreamSub:
        return StreamSub(stream, group=group, consumer="c1")

    @broker.subscriber(stream=sub("orders", "billing"))
    async def bill(event: OrderPlaced) -> None:
        invoice = InvoiceIssued(order_id=event.order_id, amount_cents=event.total_cents)
        await broker.publish(invoice, stream="invoices")

    @broker.subscriber(stream=sub("invoices", "mailer"))
    async def mail(event: InvoiceIssued) -> None:
        world.emails.append(event.order_id)

    @broker.subscriber(stream=sub("payments", "shipping"))
    async def ship(event: PaymentCaptured) -> None:
        await broker.publish(
            ShipmentRequested(order_id=event.order_id, sku=event.sku), stream="shipments"
        )

    @broker.subscriber(stream=sub("shipments", "stock"))
    async def take(event: ShipmentRequested) -> None:
        world.stock[event.sku] -= 1
        await broker.publish(
            StockChanged(sku=event.sku, left=world.stock[event.sku]), stream="stock"
        )

    @broker.subscriber(stream=sub("stock", "audit"))
    async def audit(event: StockChanged) -> None:
        world.audit.append(event)

    return broker


# -- the cases: publish(topic, event, key) then settle(); the same assertions on both -------------
Publish = Callable[[str, BaseModel, str], Awaitable[None]]


async def case_order_is_invoiced_and_mailed(publish: Publish, settle: Any, world: World) -> None:
    await publish("orders", OrderPlaced(order_id="o-1", total_cents=500), "o-1")
    await settle()
    assert world.emails == ["o-1"]


async def case_payment_ships_and_audits(publish: Publish, settle: Any, world: World) -> None:
    await publish("payments", PaymentCaptured(order_id="o-1", sku="sku-1"), "o-1")
    await settle()
    assert world.stock == {"sku-1": 9}
    assert world.audit == [StockChanged(sku="sku-1", left=9)]


async def case_two_orders_two_mails(publish: Publish, settle: Any, world: World) -> None:
    for oid in ("o-1", "o-2"):
        await publish("orders", OrderPlaced(order_id=oid, total_cents=1), oid)
    await settle()
    assert sorted(world.emails) == ["o-1", "o-2"]


async def case_nothing_published(publish: Publish, settle: Any, world: World) -> None:
    await settle()
    assert world.emails == [] and world.audit == []


CASES = [
    case_order_is_invoiced_and_mailed,
    case_payment_ships_and_audits,
    case_two_orders_two_mails,
    case_nothing_published,
]


async def eventbus_case(case: Any) -> float:
    started = time.perf_counter()
    world = World()
    async with running(eventbus_service(world), fail_fast=True) as tb:

        async def publish(topic: str, event: BaseModel, key: str) -> None:
            await tb.publish(topic, event, resource_id=key)

        await case(publish, tb.drain, world)
    return time.perf_counter() - started


async def faststream_case(case: Any) -> float:
    from faststream.redis import TestRedisBroker

    started = time.perf_counter()
    world = World()
    async with TestRedisBroker(faststream_service(world)) as br:

        async def publish(topic: str, event: BaseModel, key: str) -> None:
            await br.publish(event, stream=topic)

        async def settle() -> None:  # the test client calls the subscribers within publish
            pass

        await case(publish, settle, world)
    return time.perf_counter() - started


async def empty_drain_s(topics: int, repeats: int) -> float:
    """Median seconds of ``drain()`` with nothing published, `topics` topics of 16 shards."""
    bus = EventBus()
    for t in range(topics):
        bus.topic(f"t{t}", shards=16)

        @bus.subscriber(f"t{t}", group="g")
        async def handle(event: OrderPlaced) -> None:
            pass

    times = []
    async with running(bus) as tb:
        for _ in range(repeats):
            started = time.perf_counter()
            await tb.drain(within_s=600)  # (seconds at 32 topics when it asked Redis per shard)
            times.append(time.perf_counter() - started)
    return statistics.median(times)


async def main(rounds: int, drain_repeats: int, drain_topics: list[int]) -> dict[str, Any]:
    eb: list[float] = []
    fs: list[float] = []
    for _ in range(rounds):  # alternated: the machine's load hits both alike
        for case in CASES:
            eb.append(await eventbus_case(case))
            fs.append(await faststream_case(case))
    out: dict[str, Any] = {
        "cases": len(CASES),
        "rounds": rounds,
        "eventbus_s_per_test": statistics.median(eb),
        "faststream_s_per_test": statistics.median(fs),
        "eventbus_s_per_test_max": max(eb),
        "faststream_s_per_test_max": max(fs),
    }
    out["ratio"] = out["eventbus_s_per_test"] / out["faststream_s_per_test"]
    out["empty_drain_s"] = {str(t): await empty_drain_s(t, drain_repeats) for t in drain_topics}
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10, help="rounds of the 4 cases (default 10)")
    parser.add_argument(
        "--drain-repeats", type=int, default=20, help="empty drains per topic count (default 20)"
    )
    parser.add_argument(
        "--drain-topics",
        default="1,4,8,32",
        help="topic counts of the empty-drain figure (default 1,4,8,32)",
    )
    parser.add_argument("--json", default=None, help="also write the JSON object to this file")
    args = parser.parse_args()
    result = anyio.run(
        main, args.rounds, args.drain_repeats, [int(t) for t in args.drain_topics.split(",")]
    )
    print(json.dumps(result, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)

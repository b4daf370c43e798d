"""Event-type routing, as test cases run on fakeredis and on a real redis-server (`cases.backends`):
several handlers of one (topic, group) share one consumer and one queue per resource, so order per
resource holds across types; unknown types skipped or dead-lettered as the group chose; raw ``dict``
/ ``bytes`` handlers; stable type names (``__event_type__``) and aliases (``type_name=``) across a
rename."""

from __future__ import annotations

import logging
from typing import Any, ClassVar

import anyio
import msgpack
import pytest
from cases.backends import Backend
from pydantic import BaseModel
from support import running, total_pending, wait_until

from eventbus import Context
from eventbus.ops.metrics import METRICS


class Opened(BaseModel):
    account: str
    seq: int


class Credited(BaseModel):
    account: str
    seq: int
    cents: int = 0


class Closed(BaseModel):
    account: str
    seq: int


class PlacedV1(BaseModel):
    """The producer's model, before the rename."""

    __event_type__: ClassVar[str] = "orders.placed"
    order_id: str


class OrderPlaced(BaseModel):
    """The consumer's model, renamed and grown by an optional field: same stable type name."""

    __event_type__: ClassVar[str] = "orders.placed"
    order_id: str
    coupon: str | None = None


class Legacy(BaseModel):
    """An old producer that never set ``__event_type__``: its type name is its class name."""

    order_id: str


class RoutingCases:
    async def test_handlers_of_one_group_share_order_per_resource(self, backend: Backend) -> None:
        """Opened, Credited x3, Closed per account, handled by three functions: one consumer,
        and each account's events in publish order although the first Credited is slow."""
        bus = backend.bus(shards=2)
        seen: list[tuple[str, str, int]] = []
        slow_started = anyio.Event()

        @bus.subscriber("accounts", group="ledger")
        async def on_opened(event: Opened, ctx: Context) -> None:
            seen.append((event.account, ctx.event_type, event.seq))

        @bus.subscriber("accounts", group="ledger")
        async def on_credited(event: Credited, ctx: Context) -> None:
            if event.account == "a" and event.seq == 1:
                slow_started.set()
                await anyio.sleep(0.05)  # its account's Closed must wait for it
            seen.append((event.account, ctx.event_type, event.seq))

        @bus.subscriber("accounts", group="ledger")
        def on_closed(event: Closed) -> None:  # a sync one among them
            seen.append((event.account, "Closed", event.seq))

        events: list[tuple[str, BaseModel]] = []
        for account in ("a", "b", "c"):
            events.append((account, Opened(account=account, seq=0)))
            events += [(account, Credited(account=account, seq=i)) for i in (1, 2, 3)]
            events.append((account, Closed(account=account, seq=4)))
        await bus.publish_many("accounts", events)
        async with running(bus):
            await wait_until(lambda: len(seen) == 15)
            await wait_until(lambda: _no_pending(bus, backend, "accounts", "ledger"))

        assert len(bus.subscriptions) == 1 and len(bus.consumers) == 1
        for account in ("a", "b", "c"):
            mine = [(t, s) for a, t, s in seen if a == account]
            assert mine == [("Opened", 0), *[("Credited", i) for i in (1, 2, 3)], ("Closed", 4)]
        assert bus.consumers[0].tally.handled == 15 and bus.consumers[0].tally.dead_lettered == 0

    async def test_unknown_types_skipped_with_a_warning_and_a_metric(
        self, backend: Backend, caplog: pytest.LogCaptureFixture
    ) -> None:
        bus = backend.bus(shards=1)
        seen: list[int] = []

        @bus.subscriber("accounts", group="audit", on_unknown="skip")
        async def on_opened(event: Opened) -> None:
            seen.append(event.seq)

        skipped = METRICS.skipped_unknown.labels("accounts", "audit")
        before = skipped._value.get()
        events: list[tuple[str, BaseModel]] = [
            ("a", Opened(account="a", seq=0)),
            ("a", Credited(account="a", seq=1)),
            ("a", Credited(account="a", seq=2)),
            ("a", Opened(account="a", seq=3)),
        ]
        await bus.publish_many("accounts", events)
        with caplog.at_level(logging.WARNING, logger="eventbus.consumer"):
            async with running(bus):
                await wait_until(lambda: seen == [0, 3])
                await wait_until(lambda: _no_pending(bus, backend, "accounts", "audit"))
        assert skipped._value.get() - before == 2
        skips = "skips events of type 'Credited'"
        warnings = [r for r in caplog.records if skips in r.getMessage()]
        assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING
        assert await backend.redis.xlen(bus.keys.dead_letter("accounts", "audit")) == 0

    async def test_unknown_types_dead_lettered_by_default(self, backend: Backend) -> None:
        bus = backend.bus(shards=1)
        seen: list[int] = []

        @bus.subscriber("accounts", group="audit")
        async def on_opened(event: Opened) -> None:
            seen.append(event.seq)

        @bus.subscriber("accounts", group="audit")
        async def on_closed(event: Closed) -> None:
            seen.append(event.seq)

        await bus.publish_many(
            "accounts",
            [
                ("a", Opened(account="a", seq=0)),
                ("a", Credited(account="a", seq=1)),
                ("a", Closed(account="a", seq=2)),
            ],
        )
        dlq = bus.keys.dead_letter("accounts", "audit")
        async with running(bus):
            await wait_until(lambda: seen == [0, 2])
            await wait_until(lambda: _no_pending(bus, backend, "accounts", "audit"))
        [(_, letter)] = await backend.redis.xrange(dlq)
        assert letter[b"error_type"] == b"UnknownEventType"
        assert b"['Closed', 'Opened']" in letter[b"error"]

    async def test_dict_and_bytes_handlers(self, backend: Backend) -> None:
        """A bytes handler for one type (MessagePack of the payload), a dict catch-all for every
        other, beside a typed one: each event to its handler, in order per resource."""
        bus = backend.bus(shards=1)
        seen: list[tuple[str, Any]] = []

        @bus.subscriber("accounts", group="raw")
        async def typed(event: Opened) -> None:
            seen.append(("typed", event))

        @bus.subscriber("accounts", group="raw", type_name="Credited")
        async def packed(event: bytes, ctx: Context) -> None:
            seen.append(("bytes", msgpack.unpackb(event)))

        @bus.subscriber("accounts", group="raw")
        def anything(event: dict, ctx: Context) -> None:  # type: ignore[type-arg]
            seen.append((ctx.event_type, event))

        await bus.publish_many(
            "accounts",
            [
                ("a", Opened(account="a", seq=0)),
                ("a", Credited(account="a", seq=1, cents=5)),
                ("a", Closed(account="a", seq=2)),
            ],
        )
        async with running(bus):
            await wait_until(lambda: len(seen) == 3)
        assert seen == [
            ("typed", Opened(account="a", seq=0)),
            ("bytes", {"account": "a", "seq": 1, "cents": 5}),
            ("Closed", {"account": "a", "seq": 2}),
        ]

    async def test_renamed_model_keeps_its_type_and_aliases_take_old_names(
        self, backend: Backend
    ) -> None:
        bus = backend.bus(shards=1)
        seen: list[tuple[str, OrderPlaced]] = []

        @bus.subscriber("orders", group="billing", type_name=["orders.placed", "Legacy"])
        async def on_placed(event: OrderPlaced, ctx: Context) -> None:
            seen.append((ctx.event_type, event))

        await bus.publish("orders", PlacedV1(order_id="o1"), resource_id="o1")
        await bus.publish("orders", Legacy(order_id="o2"), resource_id="o1")
        await bus.publish("orders", OrderPlaced(order_id="o3", coupon="x"), resource_id="o1")
        async with running(bus):
            await wait_until(lambda: len(seen) == 3)
        assert seen == [
            ("orders.placed", OrderPlaced(order_id="o1")),
            ("Legacy", OrderPlaced(order_id="o2")),
            ("orders.placed", OrderPlaced(order_id="o3", coupon="x")),
        ]


async def _no_pending(bus: Any, backend: Backend, topic: str, group: str) -> bool:
    return await total_pending(bus, topic, group, backend.redis) == 0

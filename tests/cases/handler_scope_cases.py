"""Handler ergonomics, as cases run on fakeredis and on a real redis-server (`cases.backends`):
`Context.publish` chains correlation and causation IDs; middlewares wrap every attempt of single,
batch and broadcast handlers (before, after, on error); `bus.state` reaches handlers as
``ctx.state``; `HandlerLogFilter` names the entry in user log records."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
from cases.backends import Backend
from pydantic import BaseModel
from support import running, wait_until

from eventbus import Context, HandlerLogFilter, log_context
from eventbus.consumer.scope import CAUSATION_ID
from eventbus.protocol.replies import CORRELATION_ID


class Placed(BaseModel):
    order: str


class Billed(BaseModel):
    order: str


class Shipped(BaseModel):
    order: str


class HandlerScopeCases:
    async def test_ctx_publish_chains_correlation_and_causation(self, backend: Backend) -> None:
        """placed -> billed -> shipped: every event of the chain carries the first one's ID as
        correlation ID, and its parent's ID as causation ID."""
        bus = backend.bus(shards=2)
        ids: dict[str, str] = {}
        headers: dict[str, dict[str, str]] = {}

        @bus.subscriber("orders", group="billing")
        async def bill(event: Placed, ctx: Context) -> None:
            ids["placed"] = str(ctx.event_id)
            await ctx.publish("billing", Billed(order=event.order), resource_id=event.order)

        @bus.subscriber("billing", group="shipping")
        async def ship(event: Billed, ctx: Context) -> None:
            ids["billed"], headers["billed"] = str(ctx.event_id), ctx.headers
            await ctx.publish(
                "shipping", Shipped(order=event.order), resource_id=event.order, headers={"x": "1"}
            )

        @bus.subscriber("shipping", group="audit")
        async def audit(event: Shipped, ctx: Context) -> None:
            headers["shipped"] = ctx.headers

        async with running(bus):
            await bus.publish("orders", Placed(order="o1"), resource_id="o1")
            await wait_until(lambda: "shipped" in headers)
        assert headers["billed"][CORRELATION_ID] == ids["placed"]
        assert headers["billed"][CAUSATION_ID] == ids["placed"]
        assert headers["shipped"][CORRELATION_ID] == ids["placed"]
        assert headers["shipped"][CAUSATION_ID] == ids["billed"]
        assert headers["shipped"]["x"] == "1"

    async def test_middlewares_wrap_every_attempt_in_order(self, backend: Backend) -> None:
        """Two middlewares around a handler that fails its first attempt: entered outermost
        first, left in reverse, the failure seen by both (and re-raised: retried), the second
        attempt a success; a handler without a Context gets one built for the middlewares."""
        bus = backend.bus(shards=1, max_attempts=3)
        log: list[str] = []

        def tracer(name: str) -> Any:
            @asynccontextmanager
            async def mw(event: Any, ctx: Context) -> AsyncIterator[None]:
                log.append(f"{name} before {event.order} attempt {ctx.attempt}")
                try:
                    yield
                except ValueError as exc:
                    log.append(f"{name} error {exc}")
                    raise
                log.append(f"{name} after")

            return mw

        bus.middleware(tracer("outer"))
        bus.middleware(tracer("inner"))

        @bus.subscriber("orders", group="billing")
        async def bill(event: Placed) -> None:
            log.append("handler")
            if log.count("handler") == 1:
                raise ValueError("flaky")

        async with running(bus):
            await bus.publish("orders", Placed(order="o1"), resource_id="o1")
            await wait_until(lambda: log.count("outer after") == 1)
        assert log == [
            "outer before o1 attempt 1",
            "inner before o1 attempt 1",
            "handler",
            "inner error flaky",
            "outer error flaky",
            "outer before o1 attempt 2",
            "inner before o1 attempt 2",
            "handler",
            "inner after",
            "outer after",
        ]

    async def test_a_failing_middleware_fails_the_attempt(self, backend: Backend) -> None:
        """A middleware that raises before the handler: the handler does not run, the attempt
        fails and is retried; the entry is dead-lettered once the attempts are spent."""
        bus = backend.bus(shards=1, max_attempts=2)
        ran: list[str] = []

        @bus.middleware
        @asynccontextmanager
        async def tenancy(event: Any, ctx: Context) -> AsyncIterator[None]:
            if "tenant" not in ctx.headers:
                raise PermissionError("no tenant header")
            yield

        @bus.subscriber("orders", group="billing")
        async def bill(event: Placed) -> None:
            ran.append(event.order)

        async with running(bus) as (run,):
            await bus.publish("orders", Placed(order="bad"), resource_id="a")
            await bus.publish(
                "orders", Placed(order="good"), resource_id="a", headers={"tenant": "t1"}
            )
            await wait_until(lambda: ran == ["good"])
            await run.drain()
        letters = await backend.redis.xrange(bus.keys.dead_letter("orders", "billing"))
        assert len(letters) == 1 and b"no tenant header" in letters[0][1][b"error"]

    async def test_batch_and_broadcast_handlers_get_the_same_middlewares(
        self, backend: Backend
    ) -> None:
        bus = backend.bus(shards=1)
        seen: list[tuple[str, int]] = []
        done: list[str] = []

        @bus.middleware
        @asynccontextmanager
        async def count(event: Any, ctx: Any) -> AsyncIterator[None]:
            if isinstance(event, list):
                assert len(event) == len(ctx) and all(isinstance(c, Context) for c in ctx)
                seen.append(("batch", len(event)))
            else:
                seen.append((ctx.group, 1))
            yield

        @bus.subscriber("orders", group="warehouse", batch=True, max_batch=100)
        async def stock(events: list[Placed]) -> None:  # no contexts: built for the middleware
            done.extend(e.order for e in events)

        @bus.subscriber("orders", broadcast=True)
        async def cache(event: Placed) -> None:
            done.append("cache")

        async with running(bus):
            await bus.publish_many("orders", [("a", Placed(order=f"o{i}")) for i in range(5)])
            await wait_until(lambda: len(done) == 10)
        assert sum(n for kind, n in seen if kind == "batch") == 5
        assert sum(n for kind, n in seen if kind != "batch") == 5  # one per broadcast event

    async def test_state_reaches_handlers(self, backend: Backend) -> None:
        """A pool set up in an on_startup hook, used through ``ctx.state``."""
        bus = backend.bus(shards=1)
        used: list[str] = []

        class Pool:
            async def execute(self, sql: str) -> None:
                used.append(sql)

        @bus.on_startup
        async def open_pool() -> None:
            bus.state.pool = Pool()

        @bus.subscriber("orders", group="billing")
        async def bill(event: Placed, ctx: Context) -> None:
            await ctx.state.pool.execute(f"insert {event.order}")

        async with running(bus):
            await bus.publish("orders", Placed(order="o1"), resource_id="o1")
            await wait_until(lambda: used == ["insert o1"])
        with pytest.raises(AttributeError, match=r"bus\.state has no attribute 'cache'"):
            _ = bus.state.cache

    async def test_log_filter_names_the_entry_in_user_records(
        self, backend: Backend, caplog: pytest.LogCaptureFixture
    ) -> None:
        """Records logged by an async and a sync handler (a worker thread) carry the entry's
        topic, resource ID and entry ID; a record outside any handler gets "-"."""
        bus = backend.bus(shards=2)
        bus.middleware(log_context)
        user = logging.getLogger("shop.handlers")
        caplog.handler.addFilter(HandlerLogFilter())
        entry_ids: list[str] = []

        @bus.subscriber("orders", group="billing")
        async def bill(event: Placed, ctx: Context) -> None:
            entry_ids.append(ctx.entry_id)
            user.info("billing %s", event.order)

        @bus.subscriber("orders", group="mail")
        def mail(event: Placed) -> None:  # run in a worker thread
            user.info("mailing %s", event.order)

        with caplog.at_level(logging.INFO, logger="shop.handlers"):
            async with running(bus):
                await bus.publish("orders", Placed(order="o1"), resource_id="r-7")
                await wait_until(lambda: len(_records(caplog)) == 2)
            user.info("after the run")
        records = {r.getMessage(): r for r in _records(caplog)}
        for message, group in (("billing o1", "billing"), ("mailing o1", "mail")):
            r: Any = records[message]
            assert (r.topic, r.group, r.resource_id, r.event_type) == (
                "orders",
                group,
                "r-7",
                "Placed",
            )
            assert r.entry_id == entry_ids[0]
        outside: Any = records["after the run"]
        assert outside.topic == outside.entry_id == "-"


def _records(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "shop.handlers"]

"""`eventbus.consumer.depends`: handler parameters resolved per event from providers (plain,
async, generators with cleanup after the handler, nested, cached per event), app state read
through the Context, sync handlers, and handlers without dependencies registered unchanged."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Annotated, Any

import pytest
from pydantic import BaseModel

from eventbus import ConfigError, Context, Depends, EventBus
from eventbus.consumer.depends import with_dependencies
from eventbus.contract import contract_of
from eventbus.testing import running

pytestmark = pytest.mark.anyio


class OrderPlaced(BaseModel):
    order_id: str


class Db:
    def __init__(self, log: list[str], name: str) -> None:
        self.log, self.name = log, name


def _bus(log: list[str]) -> EventBus:
    bus = EventBus()

    @bus.on_startup
    async def start() -> None:
        bus.state.dsn = "memory://"  # app-scoped: set once, read by providers

    return bus


LOG: list[str] = []


def settings(ctx: Context) -> str:
    LOG.append("settings")
    return str(ctx.state.dsn)


async def db(ctx: Context, dsn: Annotated[str, Depends(settings)]) -> AsyncIterator[Db]:
    LOG.append(f"open {dsn} for {ctx.resource_id}")
    yield Db(LOG, dsn)
    LOG.append("close")


def resource() -> Iterator[str]:
    try:
        yield "r"
    except ValueError as exc:
        LOG.append(f"saw {exc}")  # swallowed here: the attempt fails all the same
    finally:
        LOG.append("closed")


async def tenant() -> str:
    return "acme"


def counter() -> int:
    LOG.append("counted")
    return len(LOG)


async def test_providers_run_per_event_and_clean_up_after_the_handler() -> None:
    LOG.clear()
    log = LOG
    bus = _bus(log)

    @bus.subscriber("orders", group="billing")
    async def bill(
        event: OrderPlaced,
        ctx: Context,
        conn: Annotated[Db, Depends(db)],
        dsn: str = Depends(settings),  # type: ignore[assignment]
    ) -> None:
        log.append(f"handle {event.order_id} with {conn.name} ({dsn}) on {ctx.topic}")

    async with running(bus, fail_fast=True) as tb:
        for oid in ("o-1", "o-2"):
            await tb.publish("orders", OrderPlaced(order_id=oid), resource_id=oid)
            await tb.drain()
    assert log == [
        "settings",  # once per event: shared by `db` and `dsn`
        "open memory:// for o-1",
        "handle o-1 with memory:// (memory://) on orders",
        "close",
        "settings",
        "open memory:// for o-2",
        "handle o-2 with memory:// (memory://) on orders",
        "close",
    ]


async def test_a_failing_handler_still_closes_its_providers_and_fails() -> None:
    LOG.clear()
    log = LOG
    bus = EventBus()

    @bus.subscriber("orders", group="billing", max_attempts=1)
    async def bill(event: OrderPlaced, r: Annotated[str, Depends(resource)]) -> None:
        raise ValueError("boom")

    async with running(bus) as tb:
        await tb.publish("orders", OrderPlaced(order_id="o"), resource_id="o")
        await tb.drain()
        (letter,) = await tb.dead_letters("orders", "billing")
    assert log == ["saw boom", "closed"]
    assert "boom" in letter.error


async def test_a_sync_handler_gets_its_dependencies_and_can_publish() -> None:
    seen: list[Any] = []
    bus = EventBus()

    @bus.subscriber("orders", group="billing")
    def bill(event: OrderPlaced, ctx: Context, who: Annotated[str, Depends(tenant)]) -> None:
        seen.append(who)
        ctx.publish("audit", event, resource_id=event.order_id)

    async with running(bus, fail_fast=True) as tb:
        await tb.publish("orders", OrderPlaced(order_id="o"), resource_id="o")
        await tb.drain()
        assert len(await tb.published("audit")) == 1
    assert seen == ["acme"]


async def test_uncached_dependencies_run_each_time() -> None:
    LOG.clear()
    seen: list[tuple[int, int]] = []
    bus = EventBus()

    @bus.subscriber("orders", group="billing")
    async def h(
        event: OrderPlaced,
        a: Annotated[int, Depends(counter, use_cache=False)],
        b: Annotated[int, Depends(counter, use_cache=False)],
    ) -> None:
        seen.append((a, b))

    async with running(bus, fail_fast=True) as tb:
        await tb.publish("orders", OrderPlaced(order_id="o"), resource_id="o")
        await tb.drain()
    assert seen == [(1, 2)]


def test_dependencies_of_a_local_provider_in_string_annotations_are_refused() -> None:
    def local() -> int:
        return 1

    async def h(event: OrderPlaced, d: Annotated[int, Depends(local)]) -> None: ...

    with pytest.raises(ConfigError, match="define the providers and models at module level"):
        with_dependencies(h)


def test_a_handler_without_dependencies_is_registered_as_it_is() -> None:
    async def h(event: OrderPlaced, ctx: Context) -> None: ...

    assert with_dependencies(h) is h


def test_a_parameter_that_is_no_dependency_is_refused() -> None:
    async def h(event: OrderPlaced, d: Annotated[int, Depends(tenant)], other: int) -> None: ...

    with pytest.raises(ConfigError, match="'other' is neither a dependency"):
        with_dependencies(h)


def test_the_contract_names_the_handler_with_dependencies() -> None:
    bus = EventBus()

    @bus.subscriber("orders", group="billing")
    async def bill(event: OrderPlaced, d: Annotated[str, Depends(tenant)]) -> None: ...

    (group,) = contract_of(bus).groups
    (handler,) = group.handlers
    assert handler.name.endswith("bill") and list(handler.events) == ["OrderPlaced"]


def test_callables_without_annotations_of_their_own_are_registered_as_they_are() -> None:
    import functools

    async def h(prefix: str, event: OrderPlaced) -> None: ...

    class Handler:
        async def __call__(self, event: OrderPlaced) -> None: ...

    partial = functools.partial(h, "p")
    instance = Handler()
    assert with_dependencies(partial) is partial
    assert with_dependencies(instance) is instance

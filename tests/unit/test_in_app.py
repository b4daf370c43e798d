"""Testing a FastAPI app with the test bus, in memory.

``TestClient`` runs the app on an event loop of its own (a portal thread): with
`eventbus.testing.running_in_app` the app's lifespan starts the test bus on that loop and the
sync test waits for its handlers through it. An async test calling the app through
``httpx.ASGITransport`` runs `eventbus.testing.running` on its own loop, and the app's
`eventbus.fastapi.lifespan` uses that bus instead of entering it a second time (on the old code:
"not re-entrant"). A bus entered on the test's loop cannot serve ``TestClient``'s: a clear error
names the helper to use."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import AsyncIterator

import httpx
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from pydantic import BaseModel

from eventbus import Context, EventBus, EventBusError, Settings
from eventbus.fastapi import BusDep, lifespan
from eventbus.testing import HandlerFailed, running, running_in_app


class OrderPlaced(BaseModel):
    order_id: str
    total_cents: int


class Invoiced(BaseModel):
    order_id: str


def _service(
    *, subscribers: bool = False, failing: threading.Event | None = None
) -> tuple[EventBus, FastAPI]:
    """A bus whose billing handler publishes an invoice (or fails on a negative total, setting
    `failing` first), and an app whose route publishes the order."""
    bus = EventBus(Settings(shards=2, retry_base_s=0.001, retry_max_s=0.002, max_attempts=2))

    @bus.subscriber("orders", group="billing")
    async def bill(event: OrderPlaced, ctx: Context) -> None:
        if event.total_cents < 0:
            if failing is not None:
                failing.set()
            raise ValueError(f"negative total for {event.order_id}")
        invoice = Invoiced(order_id=event.order_id)
        await ctx.publish("invoices", invoice, resource_id=ctx.resource_id)

    app = FastAPI(lifespan=lifespan(bus, subscribers=subscribers))

    @app.post("/orders", status_code=202)
    async def place(order: OrderPlaced, bus: BusDep) -> dict[str, str]:
        return {"entry_id": await bus.publish("orders", order, resource_id=order.order_id)}

    return bus, app


def test_testclient_route_handler_assertion_in_a_sync_test() -> None:
    bus, app = _service()
    original = app.router.lifespan_context
    with running_in_app(bus, app, fail_fast=True) as tb:
        for order_id in ["o-1", "o-2"]:  # TestClient entered twice: two runs
            with TestClient(app) as client:
                posted = client.post("/orders", json={"order_id": order_id, "total_cents": 5})
                assert posted.status_code == 202, posted.text
                tb.drain()
                assert tb.events("orders") == [OrderPlaced(order_id=order_id, total_cents=5)]
                [invoice] = tb.published("invoices")
                assert invoice.as_(Invoiced) == Invoiced(order_id=order_id)
                assert invoice.resource_id == order_id
                [entry] = tb.published("orders")
                assert entry.entry_id == posted.json()["entry_id"]
                assert app.state.eventbus is bus and bus.running
            assert not bus.running  # left with the app
            assert [h.event.order_id for h in tb.handled] == [order_id]  # kept after the run
    assert app.router.lifespan_context is original  # the app as it was


def test_publish_from_the_test_thread_reaches_the_app_loop() -> None:
    bus, app = _service()
    with running_in_app(bus, app) as tb, TestClient(app):
        entry_id = tb.publish("orders", OrderPlaced(order_id="o-3", total_cents=1), resource_id="o")
        tb.drain()
        assert tb.handled[0].ctx.entry_id == entry_id
        assert tb.bus is bus and tb.test_bus.bus is bus


def test_a_handler_failure_is_raised_in_the_test_thread() -> None:
    bus, app = _service()
    with running_in_app(bus, app, fail_fast=True) as tb, TestClient(app) as client:
        client.post("/orders", json={"order_id": "o-4", "total_cents": -1})
        with pytest.raises(HandlerFailed) as caught:
            tb.drain()
        assert isinstance(caught.value.__cause__, ValueError)
        assert threading.current_thread() is threading.main_thread()


def test_a_failure_no_drain_saw_fails_when_testclient_exits() -> None:
    failing = threading.Event()
    bus, app = _service(failing=failing)
    with running_in_app(bus, app, fail_fast=True) as tb:
        with pytest.raises(HandlerFailed) as caught, TestClient(app) as client:
            client.post("/orders", json={"order_id": "o-5", "total_cents": -1})
            assert failing.wait(30)  # the handler is failing; no drain() raises it
        assert isinstance(caught.value.__cause__, ValueError)
        assert tb.handled[0].error is not None


def test_the_policy_on_request_dead_letters() -> None:
    bus, app = _service()
    with running_in_app(bus, app) as tb, TestClient(app) as client:
        client.post("/orders", json={"order_id": "o-6", "total_cents": -1})
        tb.drain()
        [letter] = tb.dead_letters("orders", "billing")
        assert letter.attempts == 2 and "negative total for o-6" in letter.traceback


def test_using_it_outside_testclient_says_so() -> None:
    bus, app = _service()
    with running_in_app(bus, app) as tb:
        with pytest.raises(RuntimeError, match="has not started"):
            tb.drain()
        with TestClient(app):
            pass
        with pytest.raises(RuntimeError, match=r"inside `with TestClient\(app\):`"):
            tb.drain()
        assert tb.handled == []


def test_a_composed_lifespan_and_its_start_up_failure() -> None:
    """The app's own lifespan entering ``lifespan(bus)(app)`` inside it (the documented way to
    compose) gets the test bus too; when it fails at start-up, TestClient raises its error and
    the test bus is shut down with it."""
    bus, _ = _service()
    broken = {"start": True}

    @contextlib.asynccontextmanager
    async def own(app: FastAPI) -> AsyncIterator[None]:
        async with lifespan(bus)(app):
            if broken["start"]:
                raise RuntimeError("the app's own start-up failed")
            yield

    app = FastAPI(lifespan=own)

    @app.post("/orders", status_code=202)
    async def place(order: OrderPlaced, bus: BusDep) -> dict[str, str]:
        return {"entry_id": await bus.publish("orders", order, resource_id=order.order_id)}

    with running_in_app(bus, app, fail_fast=True) as tb:
        with pytest.raises(RuntimeError, match="own start-up failed"), TestClient(app):
            pass
        assert not bus.running
        broken["start"] = False
        with TestClient(app) as client:
            client.post("/orders", json={"order_id": "o-8", "total_cents": 3})
            tb.drain()
            assert tb.events() == [OrderPlaced(order_id="o-8", total_cents=3)]


def test_an_app_without_a_router_is_refused() -> None:
    bus, _ = _service()
    with pytest.raises(TypeError, match="not a Starlette or FastAPI application"):  # noqa: SIM117
        with running_in_app(bus, object()):
            pass


@pytest.mark.anyio
@pytest.mark.parametrize("subscribers", [False, True])
async def test_asgi_transport_in_an_async_test_uses_the_running_test_bus(subscribers: bool) -> None:
    bus, app = _service(subscribers=subscribers)
    async with running(bus, fail_fast=True) as tb:
        async with (
            app.router.lifespan_context(app),  # what asgi-lifespan's LifespanManager does
            httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c,
        ):
            posted = await c.post("/orders", json={"order_id": "o-7", "total_cents": 5})
            assert posted.status_code == 202, posted.text
            await tb.drain()
            assert app.state.eventbus is bus
        assert bus.running  # the lifespan did not leave the bus it did not enter
        await tb.drain()
    # handled once: the lifespan started no second set of subscribers
    assert tb.events("orders") == [OrderPlaced(order_id="o-7", total_cents=5)]
    [invoice] = await tb.published("invoices")
    assert invoice.as_(Invoiced) == Invoiced(order_id="o-7")


@pytest.mark.anyio
async def test_testclient_inside_an_async_test_names_the_helper() -> None:
    bus, app = _service()
    async with running(bus):
        with pytest.raises(EventBusError, match="running_in_app"), TestClient(app):
            pass

"""eventbus.fastapi: the example app publishes through FastAPI's TestClient to a real redis-server;
a lifespan with subscribers runs them in the app's process."""

from __future__ import annotations

import importlib
import json
import sys
import time

import anyio
import pytest
import redis
from fastapi import FastAPI
from fastapi.testclient import TestClient
from pydantic import BaseModel

from eventbus import Context, EventBus
from eventbus.asyncapi import asyncapi_document
from eventbus.asyncapi_view import asyncapi_html
from eventbus.config import Settings
from eventbus.contract import contract_of
from eventbus.fastapi import BusDep, asyncapi_routes, lifespan
from eventbus.testing import running_in_app

pytestmark = pytest.mark.integration


def test_example_app_publishes_and_rejects_bad_input(
    redis_db: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("REDIS_URL", redis_db)
    for name in ("examples.fastapi_app", "examples.orders_service"):
        sys.modules.pop(name, None)  # the bus reads REDIS_URL at import
    web = importlib.import_module("examples.fastapi_app")
    for _ in range(2):  # the app (and its bus) started twice, as in two tests
        with TestClient(web.app) as client:
            ok = client.post("/orders", json={"order_id": "o-7", "customer": "c", "total_cents": 1})
            assert ok.status_code == 202, ok.text
            assert ok.json()["entry_id"]
            bad = client.post("/orders", json={"order_id": "o-8"})
            assert bad.status_code == 422
    with redis.Redis.from_url(redis_db) as r:
        streams = r.keys("eventbus:stream:orders:*")
        assert sum(r.xlen(s) for s in streams) == 2


class Echo(BaseModel):
    text: str


def test_lifespan_runs_subscribers_and_answers_requests(settings: type[Settings]) -> None:
    bus = EventBus(settings())

    @bus.subscriber("echo", group="echoer")
    async def echo(e: Echo) -> Echo:
        return Echo(text=e.text.upper())

    app = FastAPI(lifespan=lifespan(bus, subscribers=True))

    @app.get("/echo/{text}")
    async def route(text: str, bus: BusDep) -> dict[str, str]:
        reply = await bus.request("echo", Echo(text=text), resource_id=text, timeout_s=20)
        return dict(reply)

    with TestClient(app) as client:
        assert client.get("/echo/hi").json() == {"text": "HI"}
        assert app.state.eventbus is bus
    assert not bus.running  # shut down with the app


def test_lifespan_serves_once_broadcast_subscribers_read(settings: type[Settings]) -> None:
    """The lifespan with subscribers yielded (the app served) before its broadcast subscriber
    had taken its start positions: what the first request published was behind them, never
    delivered to that instance (the examples/shop test waited on internals for it)."""
    bus = EventBus(settings())
    seen: list[str] = []

    @bus.subscriber("prices", broadcast=True)
    async def cache(e: Echo) -> None:
        seen.append(e.text)

    app = FastAPI(lifespan=lifespan(bus, subscribers=True))

    @app.post("/prices/{text}")
    async def route(text: str, bus: BusDep) -> None:
        await bus.publish("prices", Echo(text=text), resource_id=text)

    with TestClient(app) as client:
        assert client.post("/prices/first").status_code == 200
        deadline = time.monotonic() + 20
        while not seen and time.monotonic() < deadline:
            client.portal.call(anyio.sleep, 0.01)  # on the app's loop, where the handler runs
        handled = list(seen)
    assert handled == ["first"]


def test_the_app_serves_the_buss_asyncapi_document_and_its_viewer() -> None:
    bus = EventBus(Settings())
    app = FastAPI()

    @bus.subscriber("echo", group="g")
    async def handle(event: Echo) -> None:
        pass

    app.include_router(asyncapi_routes(bus, path="/docs/events", title="echo service"))

    @bus.subscriber("later", group="g")  # registered after the routes: in the document too
    async def later(event: Echo) -> None:
        pass

    with TestClient(app) as client:
        doc = client.get("/docs/events.json").json()
        page = client.get("/docs/events")
    assert doc == asyncapi_document(
        contract_of(bus), keys=bus.keys, title="echo service", redis_url=bus.settings.redis_url
    )
    assert set(doc["channels"]) == {"echo", "later"}
    assert page.headers["content-type"].startswith("text/html")
    assert page.text == asyncapi_html(doc)
    assert "/docs/events" not in json.dumps(app.openapi())  # not part of the app's own API


def test_get_bus_without_lifespan_is_a_clear_error() -> None:
    app = FastAPI()

    @app.get("/")
    async def route(bus: BusDep) -> str:
        return "unreachable"

    with (
        TestClient(app, raise_server_exceptions=True) as client,
        pytest.raises(RuntimeError, match="lifespan=lifespan"),
    ):
        client.get("/")


def test_running_in_app_on_a_real_redis(redis_db: str) -> None:
    """The README's TestClient recipe with the test bus on redis-server: the route's publish
    and the handler's reply go through the app's loop (TestClient's portal thread)."""
    bus = EventBus(Settings(shards=2))

    @bus.subscriber("echo", group="echoer")
    async def echo(e: Echo, ctx: Context) -> None:
        await ctx.publish("echoed", Echo(text=e.text.upper()), resource_id=ctx.resource_id)

    app = FastAPI(lifespan=lifespan(bus))

    @app.post("/echo/{text}", status_code=202)
    async def route(text: str, bus: BusDep) -> dict[str, str]:
        return {"entry_id": await bus.publish("echo", Echo(text=text), resource_id=text)}

    with (
        running_in_app(bus, app, redis=redis_db, fail_fast=True, key_prefix="fa") as tb,
        TestClient(app) as client,
    ):
        assert client.post("/echo/hi").status_code == 202
        tb.drain()
        assert [e.as_(Echo) for e in tb.published("echoed")] == [Echo(text="HI")]
    with redis.Redis.from_url(redis_db) as r:
        assert [r.xlen(k) for k in r.keys("fa:stream:echoed:*")] == [1]  # on this server

"""FastAPI (and Starlette) integration: the bus lives as long as the application, and route
handlers receive it as a dependency (``pip install eventbus[fastapi]``)::

    from eventbus.fastapi import BusDep, lifespan

    app = FastAPI(lifespan=lifespan(bus))

    @app.post("/orders", status_code=202)
    async def place(order: OrderPlaced, bus: BusDep) -> dict[str, str]:
        return {"entry_id": await bus.publish("orders", order, resource_id=order.order_id)}

`lifespan` enters the bus (``async with bus:``: connected, publisher pipelines running) at
start-up and leaves it at shutdown; with ``subscribers=True`` it also runs the bus's subscribers
in the application's process until shutdown (graceful, as on SIGTERM). The bus is stored in
``app.state.eventbus``; `get_bus` / `BusDep` read it from there, so tests can put another bus in
its place. To compose with a lifespan of your own, enter ``lifespan(bus)(app)`` inside it.

A bus already entered on the lifespan's event loop (a test bus of `eventbus.testing.running`,
the ``running_bus`` fixture, `eventbus.testing.running_in_app`, or your own ``async with bus:``)
is used as it is: the lifespan neither enters nor leaves it, nor starts its subscribers (whoever
entered it runs them). A bus entered on another event loop is an `EventBusError` at start-up:
its connections belong to that loop (README "Testing a FastAPI app" says which helper to use).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from functools import partial
from typing import Annotated, Any

import anyio

from eventbus.app import EventBus
from eventbus.errors import EventBusError, extra_missing

try:
    from fastapi import APIRouter, Depends, Request
    from fastapi.responses import HTMLResponse
except ImportError as exc:
    raise extra_missing("eventbus.fastapi", "fastapi", exc) from exc

STATE_KEY = "eventbus"


def lifespan(
    bus: EventBus, *, subscribers: bool = False
) -> Callable[[Any], contextlib.AbstractAsyncContextManager[None]]:
    """A FastAPI ``lifespan`` running `bus` (and, with `subscribers`, its subscribers) for the
    application's lifetime; raises what ``async with bus:`` raises (`RedisUnavailable`) at
    start-up, and `EventBusError` when the bus is entered on another event loop. A bus entered
    on the lifespan's loop already is used as it is (see the module docstring)."""

    @contextlib.asynccontextmanager
    async def run(app: Any) -> AsyncIterator[None]:
        entered = bus.running
        if entered and bus.running_loop() is not asyncio.get_running_loop():
            raise EventBusError(
                "this bus is entered on another event loop than the app's lifespan (in a "
                "test: the test's, by eventbus.testing.running or the running_bus fixture, "
                "while TestClient runs the app on a loop of its own): in a sync test use "
                "`with eventbus.testing.running_in_app(bus, app), TestClient(app):`, in an "
                "async test call the app through httpx.ASGITransport"
            )
        setattr(app.state, STATE_KEY, bus)
        if entered:
            yield  # entered by its owner (a test bus, say), who leaves it and runs subscribers
            return
        async with bus:
            if not subscribers:
                yield
                return
            stop = anyio.Event()
            async with anyio.create_task_group() as tg:
                # serving starts once every subscriber reads: a broadcast subscriber must see
                # what the first requests publish
                await tg.start(partial(bus.run, stop=stop))
                try:
                    yield
                finally:
                    stop.set()

    return run


def get_bus(request: Request) -> EventBus:
    """The application's bus (set by `lifespan`); a FastAPI dependency."""
    bus = getattr(request.app.state, STATE_KEY, None)
    if not isinstance(bus, EventBus):
        raise RuntimeError(
            "no EventBus on this app: create it with FastAPI(lifespan=lifespan(bus))"
        )
    return bus


BusDep = Annotated[EventBus, Depends(get_bus)]
"""A route parameter typed ``bus: BusDep`` receives the application's bus."""


def asyncapi_routes(
    bus: EventBus, *, path: str = "/asyncapi", title: str = "eventbus", version: str = "0.0.0"
) -> APIRouter:
    """Routes serving `bus`'s AsyncAPI 3.0 document, as ``eventbus describe --asyncapi`` writes
    it: ``GET {path}`` the viewer page (`eventbus.asyncapi_view`), ``GET {path}.json`` the
    document; ``app.include_router(asyncapi_routes(bus))``. The document is made at the first
    request, when every router and subscriber is registered, then kept (the contract is the
    code's; Redis is not read). Both are left out of the app's OpenAPI schema.

    :param title: ``info.title``; `version`: ``info.version`` (the application's)
    """
    from eventbus.asyncapi import asyncapi_document
    from eventbus.asyncapi_view import asyncapi_html
    from eventbus.contract import contract_of

    router = APIRouter(include_in_schema=False)
    made: dict[str, Any] = {}

    def document() -> dict[str, Any]:
        if "doc" not in made:
            made["doc"] = asyncapi_document(
                contract_of(bus),
                keys=bus.keys,
                title=title,
                version=version,
                redis_url=bus.settings.redis_url,
                profile=bus.profile,
            )
        doc: dict[str, Any] = made["doc"]
        return doc

    @router.get(path, response_class=HTMLResponse)
    def page() -> str:
        return asyncapi_html(document())

    @router.get(f"{path}.json")
    def json_document() -> dict[str, Any]:
        return document()

    return router


__all__ = ["BusDep", "asyncapi_routes", "get_bus", "lifespan"]

"""A test bus inside a Starlette or FastAPI application's lifespan, for sync tests that call the
app through ``TestClient``.

``TestClient`` runs the app on an event loop of its own, in a portal thread: a test bus started
on the test's loop cannot serve the app's routes (its connections belong to that loop).
`running_in_app` makes the app's lifespan start the test bus (`eventbus.testing.running`) on the
app's loop, before the app's own lifespan, which then finds the bus entered
(`eventbus.fastapi.lifespan` uses it as it is). The `AppTestBus` it yields waits and inspects
from the test's thread, through that loop (``anyio.from_thread.run`` with the loop's token)::

    def test_an_order_is_billed() -> None:
        with running_in_app(bus, app, fail_fast=True) as tb, TestClient(app) as client:
            assert client.post("/orders", json={...}).status_code == 202
            tb.drain()                      # the subscribers handled what the route published
            assert tb.events("orders") == [...]

The bus runs while ``TestClient`` is entered (each ``with TestClient(app):`` is one run of the
test bus, with a fresh in-memory Redis); the app's lifespan is restored when the block ends.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

import anyio.from_thread
import anyio.lowlevel
from pydantic import BaseModel

if TYPE_CHECKING:
    from eventbus.app import EventBus
    from eventbus.dlq import DeadLetter
    from eventbus.locking.member import AsyncRedis
    from eventbus.testing import TestBus
    from eventbus.testing.recording import Handled, Published

T = TypeVar("T")


class AppTestBus:
    """The test bus of an app run by ``TestClient``, used from the test's thread; made by
    `running_in_app`. Its methods run on the app's event loop and raise `RuntimeError` while
    the app is not running (outside ``with TestClient(app):``), except `handled` and `events`,
    which also answer for the last run once it ended."""

    def __init__(self) -> None:
        self._tb: TestBus | None = None  # the current or last run's
        self._token: anyio.lowlevel.EventLoopToken | None = None  # set while the app runs

    @property
    def test_bus(self) -> TestBus:
        """The running (or last) `TestBus`: its coroutines must run on the app's loop
        (`call`). Raises `RuntimeError` when the app never started."""
        if self._tb is None:
            raise RuntimeError(
                "the app has not started: use the bus inside `with TestClient(app):` "
                "(its lifespan starts the test bus)"
            )
        return self._tb

    def call(self, func: Callable[..., Awaitable[T]], *args: Any) -> T:
        """``await func(*args)`` on the app's event loop, from the test's thread; its result,
        or its exception raised here. Raises `RuntimeError` when the app is not running."""
        if self._token is None:
            raise RuntimeError(
                "the app is not running: call this inside `with TestClient(app):` (TestClient "
                "runs the app, and the bus, on its own event loop only while entered)"
            )

        async def run() -> T:
            return await func(*args)

        return anyio.from_thread.run(run, token=self._token)

    def drain(self, within_s: float = 10.0) -> None:
        """Wait until every subscriber has handled (or dead-lettered) every published entry
        (`TestBus.drain`: `TimeoutError` after `within_s` seconds, `HandlerFailed` in fail-fast
        mode)."""
        self.call(self.test_bus.drain, within_s)

    def publish(self, topic: str, event: BaseModel, *, resource_id: str, **kw: Any) -> str:
        """`EventBus.publish` on the app's loop; the entry ID."""

        async def publish() -> str:
            return await self.test_bus.publish(topic, event, resource_id=resource_id, **kw)

        return self.call(publish)

    def published(self, topic: str) -> list[Published]:
        """Every entry of `topic`, in entry-ID order (`TestBus.published`)."""
        return self.call(self.test_bus.published, topic)

    def dead_letters(self, topic: str, group: str) -> list[DeadLetter]:
        """The dead letters of `group` on `topic`, oldest first (`TestBus.dead_letters`)."""
        return self.call(self.test_bus.dead_letters, topic, group)

    @property
    def handled(self) -> list[Handled]:
        """Every handler call of the run, in call order (a copy)."""
        return list(self.test_bus.handled)

    def events(self, topic: str | None = None) -> list[Any]:
        """The events handlers returned from without error (of `topic`, if given)."""
        return self.test_bus.events(topic)

    @property
    def bus(self) -> EventBus:
        """The application's bus."""
        return self.test_bus.bus

    def _attach(self, tb: TestBus) -> None:
        self._tb, self._token = tb, anyio.lowlevel.current_token()

    def _detach(self) -> None:
        self._token = None


@contextlib.contextmanager
def running_in_app(
    bus: EventBus,
    app: Any,
    *,
    redis: AsyncRedis | str | None = None,
    fail_fast: bool = False,
    key_prefix: str | None = None,
) -> Iterator[AppTestBus]:
    """Run `bus` as a test bus inside `app`'s lifespan whenever ``TestClient(app)`` is entered
    in this block: started on the app's event loop before the app's own lifespan (which, with
    `eventbus.fastapi.lifespan`, uses it as it is), shut down after it. The options are
    `eventbus.testing.running`'s (in memory by default; `fail_fast` re-raises a handler's error
    from `AppTestBus.drain` and when ``TestClient`` exits).

    :param app: a Starlette or FastAPI application (its ``router.lifespan_context`` is wrapped
        for the block, then restored).
    :raises TypeError: when `app` has no ``router.lifespan_context``.
    """
    router: Any = getattr(app, "router", None)
    original = getattr(router, "lifespan_context", None)
    if original is None:
        raise TypeError(
            f"{type(app).__name__} is not a Starlette or FastAPI application "
            "(no router.lifespan_context to start the test bus in)"
        )
    handle = AppTestBus()

    @contextlib.asynccontextmanager
    async def lifespan(app_: Any) -> AsyncIterator[Any]:
        from eventbus.testing import running  # not at import: the package imports this module

        async with running(bus, redis=redis, fail_fast=fail_fast, key_prefix=key_prefix) as tb:
            handle._attach(tb)
            try:
                async with original(app_) as state:
                    yield state
            finally:
                handle._detach()

    router.lifespan_context = lifespan
    try:
        yield handle
    finally:
        router.lifespan_context = original


__all__ = ["AppTestBus", "running_in_app"]

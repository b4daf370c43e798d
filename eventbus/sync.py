"""`SyncBus`: the bus for synchronous code (Flask, Django, threads), from `EventBus.sync()`.

One `SyncBus` per bus, shared by every thread of the process. It runs the bus (entered, with its
pipeline flusher) on an event loop in a daemon thread, started on first use; each method is the
`EventBus` coroutine of the same name, blocking the calling thread until it is done on that
loop. Calls from many threads at once are coalesced into pipelines like async ones.

When the bus is already entered on an event loop of this process (a FastAPI `lifespan`, a
running ``bus.run()``), no loop thread is started: calls are sent to that loop
(`EventBus.running_loop`), so a sync route's or a plain ``def`` handler's worker thread
publishes through the bus the application runs. Calling from that loop's own thread raises
`EventBusError`: it would block the loop it waits for (``await`` the `EventBus` method there).

When the loop stops:

* used outside any ``with`` block (``sb = bus.sync()`` at import, ``sb.publish(...)`` in a
  request), it runs until ``sb.close()`` or interpreter exit (an `atexit` hook closes it:
  queued publishes are sent, the connection closed);
* used only inside ``with bus.sync() as sb:`` blocks, it stops when the last block open in any
  thread exits.

Fork-safe: a forked child (gunicorn ``--preload``, multiprocessing's ``fork``) does not inherit
the parent's loop thread; its first call starts its own, on a new connection.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import logging
import os
import threading
import weakref
from collections.abc import Awaitable, Callable, Iterable
from functools import partial
from types import TracebackType
from typing import TYPE_CHECKING, TypeVar, Unpack

from anyio.from_thread import BlockingPortal
from pydantic import BaseModel

from eventbus.client import loops
from eventbus.errors import EventBusError
from eventbus.publishing.publisher import PublishOptions
from eventbus.request import M, RequestOptions
from eventbus.session import current_loop

if TYPE_CHECKING:  # a SyncBus wraps the EventBus that made it (`EventBus.sync`)
    from eventbus.app import EventBus

log = logging.getLogger("eventbus")

T = TypeVar("T")

_all: weakref.WeakSet[SyncBus] = weakref.WeakSet()


class _Loop:
    """An event loop on a daemon thread with `bus` entered, and a portal to call into it.
    Raises what entering the bus raised (`RedisUnavailable`, a startup hook's error)."""

    def __init__(self, bus: EventBus) -> None:
        self.portal: BlockingPortal | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self._error: BaseException | None = None
        self._ready = threading.Event()
        self.thread = threading.Thread(
            target=loops.run, args=(self._serve, bus), name="eventbus-sync", daemon=True
        )
        self.thread.start()
        self._ready.wait()
        if self._error is not None:
            raise self._error

    async def _serve(self, bus: EventBus) -> None:
        self.loop = asyncio.get_running_loop()
        try:
            async with bus, BlockingPortal() as portal:
                self.portal = portal
                self._ready.set()
                await portal.sleep_until_stopped()
                # leaving the portal waits for the calls in progress; then the bus is left
        except BaseException as exc:
            if not self._ready.is_set():
                self._error = exc
            else:
                log.exception("the sync bus's event loop ended with an error")
        finally:
            self._ready.set()

    def stop(self, timeout_s: float) -> None:
        """Stop taking calls, let those in progress end, leave the bus; wait `timeout_s`."""
        portal = self.portal
        if portal is not None:
            with contextlib.suppress(RuntimeError):  # already stopped
                portal.call(portal.stop)
        self.thread.join(timeout_s)


class SyncBus:
    """Blocking facade of an `EventBus`, thread-safe; see the module docstring.

    `publish`, `publish_many` and `request` are the `EventBus` methods of the same name, with
    the same arguments, blocking the calling thread until they are done (until Redis confirms,
    for publishing).
    """

    def __init__(self, bus: EventBus) -> None:
        self._bus = bus
        self._reset()
        _all.add(self)

    def _reset(self) -> None:
        self._lock = threading.Lock()
        self._loop: _Loop | None = None
        self._blocks = 0  # `with` blocks open, in all threads
        self._pinned = False  # used outside a `with` block: runs until close()
        self._local = threading.local()

    # -- the API: `EventBus`'s methods, blocking; the keyword arguments are passed on as given
    # (`PublishOptions`, `RequestOptions`: a unit test checks they match `EventBus`'s) -------
    def publish(self, topic: str, event: BaseModel, **options: Unpack[PublishOptions]) -> str:
        """`EventBus.publish` (``resource_id=``, ``headers=``), blocking the calling thread
        until done."""
        return self.call(partial(self._bus.publish, topic, event, **options))

    def publish_many(
        self,
        topic: str,
        events: Iterable[tuple[str, BaseModel]],
        *,
        headers: dict[str, str] | None = None,
    ) -> list[str]:
        """`EventBus.publish_many`, blocking the calling thread until done."""
        return self.call(partial(self._bus.publish_many, topic, events, headers=headers))

    def request(
        self,
        topic: str,
        event: BaseModel,
        *,
        reply_model: type[M] | None = None,
        **options: Unpack[RequestOptions],
    ) -> M:
        """`EventBus.request` (``resource_id=``, ``timeout_s=``, ``reply_model=``,
        ``headers=``), blocking the calling thread until done."""
        return self.call(
            partial(self._bus.request, topic, event, reply_model=reply_model, **options)
        )

    def call(self, fn: Callable[[], Awaitable[T]]) -> T:
        """Run ``await fn()`` on the bus's event loop and return its result (any coroutine
        that uses the bus: ``sb.call(lambda: bus.redis.xlen(key))``). Raises `EventBusError`
        when called on the event loop the bus is entered on."""
        home = self._bus.running_loop()
        if home is not None and (self._loop is None or home is not self._loop.loop):
            return _call_on(home, fn)  # entered elsewhere (FastAPI's lifespan, bus.run())
        loop = self._started(pin=not getattr(self._local, "depth", 0))
        assert loop.portal is not None
        try:
            return loop.portal.call(fn)
        except RuntimeError as exc:
            if self._loop is not loop:  # stopped under the call: close() meanwhile
                raise EventBusError("the sync bus was closed during the call") from exc
            raise

    # -- life -------------------------------------------------------------------------------
    def _started(self, *, pin: bool) -> _Loop:
        with self._lock:
            if pin:
                self._pinned = True
            if self._loop is None:
                self._loop = _Loop(self._bus)
            return self._loop

    @property
    def running(self) -> bool:
        """Whether the event loop thread is running."""
        return self._loop is not None

    def close(self) -> None:
        """Send queued publishes, leave the bus and stop the loop thread (a later call starts a
        new one). Idempotent."""
        with self._lock:
            loop, self._loop, self._pinned = self._loop, None, False
            if loop is not None:
                loop.stop(
                    self._bus.settings.shutdown_grace_s + self._bus.settings.publish_timeout_s
                )

    def __enter__(self) -> SyncBus:
        self._local.depth = getattr(self._local, "depth", 0) + 1
        with self._lock:
            self._blocks += 1
        try:
            if self._bus.running_loop() is None:  # else calls go to the loop it runs on
                self._started(pin=False)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._local.depth -= 1
        with self._lock:
            self._blocks -= 1
            if self._blocks or self._pinned or self._loop is None:
                return
            loop, self._loop = self._loop, None
            # stopped under the lock: a block entered meanwhile waits, then starts a new loop
            # (two loops must never hold the bus at once)
            loop.stop(self._bus.settings.shutdown_grace_s + self._bus.settings.publish_timeout_s)


def _call_on(loop: asyncio.AbstractEventLoop, fn: Callable[[], Awaitable[T]]) -> T:
    """Run ``await fn()`` on `loop` (running in another thread) and wait for its result."""
    if current_loop() is loop:
        raise EventBusError(
            "bus.sync() called on the event loop the bus runs on: it would block the loop it "
            "waits for; await the EventBus method there (or call it from a worker thread)"
        )

    async def call() -> T:
        return await fn()

    coro = call()
    try:
        future = asyncio.run_coroutine_threadsafe(coro, loop)
    except RuntimeError as exc:  # the loop closed meanwhile
        coro.close()
        raise EventBusError("the bus's event loop stopped before the call") from exc
    try:
        return future.result()
    except concurrent.futures.CancelledError as exc:
        raise EventBusError("the bus's event loop stopped during the call") from exc


def _after_fork_in_child() -> None:
    # the parent's loop thread does not exist here, and its lock may have been held at the fork
    for sb in list(_all):
        sb._reset()


def _close_all() -> None:
    for sb in list(_all):
        try:
            sb.close()
        except Exception:
            log.exception("closing a sync bus at exit")


os.register_at_fork(after_in_child=_after_fork_in_child)
atexit.register(_close_all)

__all__ = ["SyncBus"]

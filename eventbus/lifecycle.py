"""`Lifecycle`: how an `EventBus` connects, is entered and left, again and again.

The bus's connection state lives in a `eventbus.session.Session`, made on first use and dropped
on leaving ``async with bus:`` (the client the bus made itself is closed then), so that:

* the bus can be entered again after it was left, also from another event loop (a second
  ``anyio.run``, a test after a test);
* a bus used from another event loop than its session's, while not entered, gets a new session
  (the old connections belong to the old loop and are abandoned, not used);
* in a forked child (gunicorn ``--preload``, multiprocessing's ``fork``) the parent's session is
  abandoned and the bus reconnects; a client given to ``EventBus(redis=...)`` cannot be
  re-made, so using it after a fork raises `EventBusError`;
* a bus entered on one event loop and used from another raises `EventBusError` (it cannot
  serve two loops at once); synchronous code in other threads reaches it through
  ``bus.sync()``, which sends its calls to the loop the bus is entered on (`running_loop`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any, Self

import anyio
from redis.exceptions import RedisError

from eventbus.client.connection import connect
from eventbus.client.loops import young_gc_threshold
from eventbus.config import Settings
from eventbus.errors import EventBusError, RedisUnavailable
from eventbus.locking.member import AsyncRedis
from eventbus.profiles import WireProfile
from eventbus.protocol.keys import Keys
from eventbus.protocol.topics import TopicRegistry
from eventbus.publishing.publisher import Publisher
from eventbus.session import Session

Hook = Callable[[], Awaitable[None]]


class Lifecycle:
    """The connection and ``async with`` part of `EventBus` (see the module docstring)."""

    settings: Settings
    keys: Keys
    profile: WireProfile
    _given_redis: AsyncRedis | None
    _session: Session | None
    _on_startup: list[Hook]
    _on_shutdown: list[Hook]

    def _current(self) -> Session:
        """The session for the calling process and event loop, made if needed."""
        s = self._session
        if s is not None:
            if not s.forked and not s.other_loop():
                return s
            if s.stack is not None and not s.forked:
                raise EventBusError(
                    "this bus is running on another event loop (e.g. bus.sync()'s thread): use it "
                    "from that loop, or leave its `async with` first"
                )
            if s.forked and not s.owned:
                raise EventBusError(
                    f"the Redis client given to EventBus(redis=...) was made in process {s.pid}, "
                    "before a fork: give the bus a client made in this process"
                )
            self._session = None  # abandoned, not closed: its connections are not ours to use
        return self._open_session(self._given_redis, owned=self._given_redis is None)

    def _open_session(self, redis: AsyncRedis | None, *, owned: bool) -> Session:
        client = connect(self.settings) if redis is None else redis
        self._session = Session(client, owned, TopicRegistry(client, self.keys))
        return self._session

    @property
    def redis(self) -> Any:
        """The redis-py asyncio client of the calling event loop (created on first use)."""
        return self._current().redis

    @property
    def registry(self) -> TopicRegistry:
        return self._current().registry

    @property
    def publisher(self) -> Publisher:
        s = self._current()
        if s.publisher is None:
            s.publisher = Publisher(s.redis, self.settings, self.keys, s.registry, self.profile)
        publisher: Publisher = s.publisher
        return publisher

    def running_loop(self) -> asyncio.AbstractEventLoop | None:
        """The event loop the bus is entered on in this process (``async with bus:``, a FastAPI
        `lifespan`, `run()`), or None: where `SyncBus` sends the calls of other threads."""
        s = self._session
        return s.loop if s is not None and s.stack is not None and not s.forked else None

    @property
    def running(self) -> bool:
        """Whether the bus is entered (``async with bus:``) in this process."""
        s = self._session
        return s is not None and s.stack is not None and not s.forked

    async def __aenter__(self) -> Self:
        if self.running and not self._session.other_loop():  # type: ignore[union-attr]
            raise EventBusError("this bus is already entered (`async with bus:` is not re-entrant)")
        session = self._current()
        try:
            await session.redis.ping()
        except (RedisError, OSError) as exc:
            await self._end(session)
            raise RedisUnavailable.of(self.settings, exc) from exc
        failure: Exception | None = None
        async with contextlib.AsyncExitStack() as stack:
            stack.enter_context(young_gc_threshold(self.settings.gc_threshold))
            tg = await stack.enter_async_context(anyio.create_task_group())
            stack.callback(tg.cancel_scope.cancel)
            await tg.start(self.publisher.run_flusher)
            try:
                for hook in self._on_startup:
                    await hook()
            except Exception as exc:
                # raised below, once the flusher's task group is closed: raised inside it, the
                # hook's error would reach the caller wrapped in an ExceptionGroup
                failure = exc
            else:
                session.stack = stack.pop_all()
        if failure is not None:
            await self._end(session)
            raise failure
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        """Run the shutdown hooks, stop the flusher (queued publishes are sent first), close the
        client the bus made, and forget the session: the bus can be entered again."""
        session = self._session
        stack = session.stack if session is not None else None
        if session is not None:
            session.stack = None
        try:
            for hook in self._on_shutdown:
                await hook()
        finally:
            try:
                if stack is not None:
                    await stack.aclose()
            finally:
                if session is not None:
                    await self._end(session)

    async def _end(self, session: Session) -> None:
        """Forget `session`, closing its client if the bus made it."""
        if self._session is session:
            self._session = None
        if session.owned and not session.forked:
            await session.redis.aclose()

    async def aclose(self) -> None:
        """Close the Redis connection pool (also a client given to the bus) and forget it."""
        s, self._session = self._session, None
        if s is not None and not s.forked:
            await s.redis.aclose()

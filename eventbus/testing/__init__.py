"""An in-memory bus for users' own tests: the real subscriber path on fakeredis (with Lua).

Only the Redis connection is swapped; publishing, the lock scripts, ordering, retries and
dead-lettering are the production code::

    from eventbus.testing import running

    async def test_billing() -> None:
        async with running(bus) as tb:
            await tb.publish("orders", OrderPlaced(order_id="o1", total_cents=5), resource_id="o1")
            await tb.drain()
        assert ...   # what your handler did

fakeredis is a Python reimplementation of Redis: it proves your handlers' logic, not Redis's
behaviour under load or failure. The same test runs against a real ``redis-server`` when given
its URL: ``running(bus, redis="redis://localhost:6379/15")`` (with ``key_prefix=`` a test's
keys do not meet another's).

With ``fail_fast=True`` a handler's exception is not retried nor dead-lettered: it is
re-raised by `TestBus.drain` (and at the end of the block) as `HandlerFailed`, the handler's
exception as its cause. `TestBus.handled` lists the handler calls, `TestBus.published` the
events of a topic, `TestBus.dead_letters` a group's dead letters. The pytest plugin
(`eventbus.testing.pytest_plugin`) gives each test such a bus.

A FastAPI (or Starlette) app called through ``TestClient`` runs on an event loop of its own:
``with running_in_app(bus, app) as tb, TestClient(app) as client:`` starts the test bus in the
app's lifespan, on that loop, and ``tb`` (an `AppTestBus`) waits and inspects from the test's
thread (`eventbus.testing.in_app`). An async test calling the app through
``httpx.ASGITransport`` uses `running` (or the ``running_bus`` fixture) as it is: the app's
`eventbus.fastapi.lifespan` finds the bus entered on the test's loop and uses it.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import anyio
from anyio.abc import TaskStatus
from pydantic import BaseModel

from eventbus.app import EventBus
from eventbus.dlq import DeadLetter
from eventbus.locking.member import AsyncRedis
from eventbus.protocol.keys import Keys
from eventbus.testing.drain import Watch, behind, memory_streams, redis_streams
from eventbus.testing.in_app import AppTestBus, running_in_app
from eventbus.testing.memory import (
    MEMORY_SETTINGS,
    MEMORY_SHARDS,
    in_memory,
    load_lock_scripts,
    memory_redis,
    unblock_reads_at_stop,
    use_memory_shards,
)
from eventbus.testing.recording import (
    Handled,
    HandlerFailed,
    Published,
    Watched,
    dead_letters,
    failure_of,
    published,
)


class TestBus:
    """A running bus; made by `running`. `done` is set once its subscribers have stopped."""

    __test__ = False  # not a pytest test class

    def __init__(self, bus: EventBus, stop: anyio.Event) -> None:
        self.bus = bus
        self.done = anyio.Event()
        self._stop = stop
        self.redis = bus._current().redis
        self.keys = bus.keys
        self.handled: list[Handled] = []
        """Every handler call of this run, in call order (failed ones carry their `error`)."""
        self._reported = 0  # handler failures before this index were raised already
        self.fail_fast = False
        self._memory = memory_streams(self.redis)  # None: ask Redis
        self._watch_list: list[Watch] | None = None
        self._watched_consumers = 0
        self._last_behind: Watch | None = None  # the stream found behind by the last check

    def events(self, topic: str | None = None) -> list[Any]:
        """The events handlers returned from without error (of `topic`, if given)."""
        return [
            h.event
            for h in self.handled
            if h.error is None and (topic is None or h.ctx.topic == topic)
        ]

    async def published(self, topic: str) -> list[Published]:
        """Every entry of `topic` in Redis, in entry-ID order: what the test and the handlers
        published (`Published.as_(Model)` validates one)."""
        return await published(self.redis, self.keys, topic, self.bus.topic(topic).shards)

    async def dead_letters(self, topic: str, group: str) -> list[DeadLetter]:
        """The dead letters of `group` on `topic`, oldest first."""
        return await dead_letters(self.redis, self.keys, topic, group)

    def raise_failures(self) -> None:
        """Raise `HandlerFailed` for the first handler failure not raised yet (fail-fast)."""
        if not self.fail_fast:
            return
        failed = failure_of(self.handled, self._reported)
        self._reported = len(self.handled)
        if failed is not None:
            raise failed

    redis: AsyncRedis
    """The Redis this run used (still usable after the block, e.g. the in-memory one)."""

    @property
    def consumer_ids(self) -> list[str]:
        """The member IDs of the bus's consumers (`Context.consumer_id`), one per subscriber."""
        return [c.consumer_id for c in self.bus.consumers]

    def stop(self) -> None:
        """Ask the subscribers to shut down gracefully (as on SIGTERM) before the end of the
        `running` block; await `done` to wait for them."""
        self._stop.set()

    async def publish(self, topic: str, event: BaseModel, *, resource_id: str, **kw: Any) -> str:
        """`EventBus.publish` on the bus's Redis."""
        return await self.bus.publish(topic, event, resource_id=resource_id, **kw)

    async def drain(self, within_s: float = 10.0) -> None:
        """Wait until every subscriber has handled (or dead-lettered) every published entry.

        Each check costs no command while a consumer holds entries in flight, then reads the
        shard streams' state once: from the in-memory server's data without a command, or in
        one pipeline from a real server, whatever the number of topics and shards
        (`eventbus.testing.drain`). Entries added by any client count, not only the bus's.

        Raises `TimeoutError` after `within_s` seconds, naming the streams still behind, and
        in fail-fast mode `HandlerFailed` for a handler's exception (as soon as it happens).
        """
        try:
            with anyio.fail_after(within_s):
                while await self._behind(first=True):
                    self.raise_failures()
                    await anyio.sleep(0.002)
        except TimeoutError:
            raise TimeoutError(f"not drained after {within_s} s: {await self._behind()}") from None
        self.raise_failures()

    async def _behind(self, *, first: bool = False) -> list[str]:
        """Why the bus is not drained yet (empty: drained). With `first`, the stream found
        behind last time is read first, alone, and if it still is, that is the answer: a drain
        that waits reads one stream per check, not all of them."""
        if flying := self._flying():  # known in process: no need to ask Redis yet
            return flying
        watches = self._watches()
        last = self._last_behind
        if first and last is not None and last in watches:
            reasons = await self._read_behind([last])
            if reasons:
                return reasons
        reasons = await self._read_behind(watches)
        self._last_behind = next((w for w in watches if w.stream == _stream_of(reasons)), None)
        # a broadcast read that landed while the streams were read moved its position to their
        # end: its entries are in flight now, not handled
        return reasons or self._flying()

    def _flying(self) -> list[str]:
        return [f"{c.group}: {c.in_flight} in flight" for c in self.bus.consumers if c.in_flight]

    async def _read_behind(self, watches: list[Watch]) -> list[str]:
        if self._memory is not None:
            try:
                return behind(watches, self._memory(watches))
            except AttributeError:  # a fakeredis whose stream model is not 2.x's: ask it
                self._memory = None
        return behind(watches, await redis_streams(self.redis, watches))

    def _watches(self) -> list[Watch]:
        """Each shard stream of the subscriptions, with the groups and broadcast readers that
        must have read it (made once the consumers exist; they do not change during a run)."""
        if self._watch_list is not None and len(self.bus.consumers) == self._watched_consumers:
            return self._watch_list
        by_stream: dict[str, Watch] = {}

        def watch(stream: str) -> Watch:
            return by_stream.setdefault(stream, Watch(stream))

        for consumer in self.bus.consumers:
            consumer.mark_reads(watch)
        self._watch_list = list(by_stream.values())
        self._watched_consumers = len(self.bus.consumers)
        return self._watch_list


def _stream_of(reasons: list[str]) -> str | None:
    """The stream the first reason of `behind` names (``"<stream> group <g>"``...)."""
    return reasons[0].partition(" ")[0] if reasons else None


@contextlib.asynccontextmanager
async def running(
    bus: EventBus,
    *,
    redis: AsyncRedis | str | None = None,
    fail_fast: bool = False,
    key_prefix: str | None = None,
) -> AsyncIterator[TestBus]:
    """Run `bus` and all its subscribers for a test; the block starts once their consumers
    exist. On exit the subscribers shut down gracefully, as in production, and the block waits
    for them.

    :param redis: where to run: nothing for a fresh in-memory Redis (`memory_redis`, with the
        lock scripts loaded, the test bus's `MEMORY_SETTINGS` and `MEMORY_SHARDS`; at the stop
        the subscribers' blocking reads are ended at once: `unblock_reads_at_stop`), a Redis URL (a
        real server: it is connected like `EventBus` connects, and closed at the end), or a
        client (e.g. ``bus.redis``: the bus's own connection, left open). Afterwards the bus is
        as it was (its own connection and settings): it can be run again, or entered.
    :param fail_fast: a handler's exception is recorded and its entry acked (no retry, no
        backoff, no dead letter), then raised by `TestBus.drain` and at the end of the block
        as `HandlerFailed` (batch handlers keep their policy).
    :param key_prefix: the keys' prefix for this run (e.g. one per test on a shared server).
    """
    if bus.running:
        raise RuntimeError("the bus is already running")
    saved = (bus._session, bus.settings, bus.keys, dict(bus._topics))
    if key_prefix is not None:
        bus.settings = bus.settings.model_copy(update={"key_prefix": key_prefix})
        bus.keys = Keys.of(bus.settings)
    if redis is None:
        bus.settings = bus.settings.model_copy(update=MEMORY_SETTINGS)
        bus._open_session(memory_redis(), owned=False)  # nothing to close: kept for `tb.redis`
    elif isinstance(redis, str):
        bus.settings = bus.settings.model_copy(update={"redis_url": redis})
        bus._open_session(None, owned=True)
    else:
        bus._open_session(redis, owned=False)
    bus.consumers = []  # those of an earlier run are not the ones to wait for
    stop = anyio.Event()
    tb = TestBus(bus, stop)
    tb.fail_fast = fail_fast
    calls = [(s.call, s.topic) for s in bus.subscriptions]
    if in_memory(bus._current().redis) and "shards" not in bus.settings.model_fields_set:
        use_memory_shards(bus)  # also on a memory server passed in: the count it registered
    for sub in bus.subscriptions:
        if not hasattr(sub.call, "call_batch"):
            sub.call = Watched(sub.call, tb.handled, fail_fast=fail_fast)

    async def run(*, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        try:
            await bus.run(stop=stop, task_status=task_status)
        finally:
            tb.done.set()

    try:
        async with bus, anyio.create_task_group() as tg:
            if redis is None and bus.subscriptions:  # our own server: no one else's reads
                await load_lock_scripts(tb.redis)
                tg.start_soon(unblock_reads_at_stop, tb.redis, stop, tb.done)
            if bus.subscriptions:
                # returns once every subscriber reads: events published from now on reach them
                # (or raises what the run raised)
                await tg.start(run)
            else:
                tb.done.set()
            try:
                yield tb
            finally:
                stop.set()
        tb.raise_failures()  # those drain() has not raised: none goes unnoticed
    except BaseExceptionGroup as group:
        # the task group wraps what the block raised (an assertion, say): one error is raised
        # as itself, so that ``pytest.raises`` and ``except`` see what the test raised
        if len(group.exceptions) == 1 and not isinstance(group.exceptions[0], BaseExceptionGroup):
            raise group.exceptions[0] from group.exceptions[0].__cause__
        raise
    finally:
        # the bus as it was: its own connection, settings and handlers (the consumers of this
        # run stay in `bus.consumers`, for inspection)
        bus._session, bus.settings, bus.keys, bus._topics = saved
        for sub, (call, topic) in zip(bus.subscriptions, calls, strict=True):
            sub.call, sub.topic = call, topic


__all__ = [
    "MEMORY_SETTINGS",
    "MEMORY_SHARDS",
    "AppTestBus",
    "Handled",
    "HandlerFailed",
    "Published",
    "TestBus",
    "memory_redis",
    "running",
    "running_in_app",
]

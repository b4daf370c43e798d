"""A bus used as services and tests use it: entered again and again, from several event loops, from
many threads through its one `SyncBus`, after `fork`, and after `eventbus.testing.running`."""

from __future__ import annotations

import multiprocessing
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import anyio
import pytest
import redis
from flask import Flask
from support import Recorder, Tick

from eventbus import EventBus, EventBusError, Settings
from eventbus.testing import running

SettingsFactory = Callable[..., Settings]


def _count(url: str, bus: EventBus, topic: str) -> int:
    with redis.Redis.from_url(url) as client:
        return sum(client.xlen(bus.keys.stream(topic, s)) for s in range(bus.topic(topic).shards))


@pytest.mark.anyio
async def test_enter_leave_enter_in_one_test(settings: SettingsFactory, redis_db: str) -> None:
    bus = EventBus(settings())
    for i in range(3):
        async with bus:
            assert bus.running
            await bus.publish("orders", Tick(resource="a", seq=i), resource_id="a")
        assert not bus.running
    assert _count(redis_db, bus, "orders") == 3
    await bus.aclose()


def test_two_event_loops_one_after_the_other(settings: SettingsFactory, redis_db: str) -> None:
    """A module-level bus used by two `anyio.run` calls (two pytest tests, a CLI run after a
    script): each gets its own connection, and subscribers run in both."""
    bus = EventBus(settings())
    rec = Recorder()

    @bus.subscriber("orders", group="billing")
    async def handle(event: Tick) -> None:
        rec.log.append(event)  # type: ignore[arg-type]

    async def once(seq: int) -> None:
        async with bus:
            await bus.publish("orders", Tick(resource="a", seq=seq), resource_id="a")
        # not entered: publishes on its own, then runs the subscribers (entering it again)
        await bus.publish("orders", Tick(resource="a", seq=seq + 1), resource_id="a")
        stop = anyio.Event()
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: bus.run(stop=stop))
            with anyio.fail_after(20):
                while len(rec.log) < seq + 2:  # noqa: ASYNC110 - the handler appends
                    await anyio.sleep(0.01)
            stop.set()

    anyio.run(once, 0)
    anyio.run(once, 2)
    assert [e.seq for e in rec.log] == [0, 1, 2, 3]  # type: ignore[attr-defined]
    anyio.run(bus.aclose)


def test_entered_on_one_loop_is_refused_on_another(settings: SettingsFactory) -> None:
    bus = EventBus(settings())
    sb = bus.sync()
    try:
        sb.publish("orders", Tick(resource="a", seq=0), resource_id="a")  # runs in sb's thread

        async def elsewhere() -> None:
            with pytest.raises(EventBusError, match="another event loop"):
                await bus.publish("orders", Tick(resource="a", seq=1), resource_id="a")

        anyio.run(elsewhere)
    finally:
        sb.close()
    assert not sb.running and not bus.running


@pytest.mark.anyio
async def test_running_restores_the_bus(settings: SettingsFactory, redis_db: str) -> None:
    """After an in-memory run the bus is its old self: its own Redis, its own settings."""
    bus = EventBus(settings())
    rec = Recorder()

    @bus.subscriber("orders", group="billing")
    async def handle(event: Tick, ctx: Any) -> None:
        rec.add(event, ctx)

    before = bus.settings
    for seq in (0, 1):  # twice: the second run starts from a restored bus
        async with running(bus) as tb:
            await tb.publish("orders", Tick(resource="a", seq=seq), resource_id="a")
            await tb.drain()
        assert await tb.redis.exists(bus.keys.stream("orders", 0)) >= 0  # still inspectable
    assert rec.by_resource() == {"a": [0, 1]}
    assert bus.settings is before and not bus.running
    assert _count(redis_db, bus, "orders") == 0  # nothing reached the real server
    async with bus:
        await bus.publish("orders", Tick(resource="a", seq=9), resource_id="a")
    assert _count(redis_db, bus, "orders") == 1
    async with running(bus, redis=bus.redis) as tb:  # then on the real server
        await tb.drain()
    assert rec.by_resource() == {"a": [0, 1, 9]}
    await bus.aclose()


def _flask_app(bus: EventBus, shared: bool) -> Flask:
    app = Flask(__name__)
    sb = bus.sync()  # made at import; nothing starts before the first request

    @app.post("/orders/<rid>")
    def place(rid: str) -> dict[str, str]:
        event = Tick(resource=rid, seq=0)
        if shared:
            return {"entry_id": sb.publish("orders", event, resource_id=rid)}
        with bus.sync() as per_request:  # the README's former per-request pattern
            return {"entry_id": per_request.publish("orders", event, resource_id=rid)}

    return app


@pytest.mark.parametrize("shared", [True, False], ids=["module-level", "per-request-with"])
def test_threaded_web_server(settings: SettingsFactory, redis_db: str, shared: bool) -> None:
    """Sequential requests, then 8 threads x 10 concurrent requests, all answered 200."""
    bus = EventBus(settings())
    app = _flask_app(bus, shared)
    try:
        for i in range(3):
            assert app.test_client().post(f"/orders/seq-{i}").status_code == 200
        barrier = threading.Barrier(8)

        def worker(t: int) -> list[int]:
            client = app.test_client()
            barrier.wait()
            return [client.post(f"/orders/t{t}-{i}").status_code for i in range(10)]

        with ThreadPoolExecutor(8) as pool:
            codes = [c for cs in pool.map(worker, range(8)) for c in cs]
        assert codes == [200] * 80
        assert _count(redis_db, bus, "orders") == 83
        assert bus.sync().running is shared  # per-request blocks stop the loop at the last exit
    finally:
        bus.sync().close()
    assert not bus.sync().running and not bus.running


def _child(bus: EventBus, results: Any) -> None:
    """In a forked child: the inherited SyncBus and the async API both work (new connection)."""
    try:
        a = bus.sync().publish("orders", Tick(resource="child", seq=0), resource_id="child")
        bus.sync().close()  # the bus serves one event loop at a time

        async def go() -> str:
            return await bus.publish("orders", Tick(resource="child", seq=1), resource_id="child")

        results.put(("ok", a, anyio.run(go)))
    except BaseException as exc:
        results.put(("error", repr(exc)))


def test_fork_after_use_reconnects(settings: SettingsFactory, redis_db: str) -> None:
    """gunicorn --preload: the app published in the master (loop thread running, connection
    open) before forking its workers; a worker must neither hang nor share the connection."""
    bus = EventBus(settings())
    sb = bus.sync()
    sb.publish("orders", Tick(resource="parent", seq=0), resource_id="parent")
    ctx = multiprocessing.get_context("fork")
    results = ctx.Queue()
    procs = [ctx.Process(target=_child, args=(bus, results)) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(30)
        assert p.exitcode == 0, "the child hung or died"
    outcomes = [results.get(timeout=5) for _ in procs]
    assert all(o[0] == "ok" for o in outcomes), outcomes
    # the parent's loop and connection still work
    sb.publish("orders", Tick(resource="parent", seq=1), resource_id="parent")
    sb.close()
    assert _count(redis_db, bus, "orders") == 6


def _child_given(bus: EventBus, results: Any) -> None:
    async def go() -> None:
        await bus.publish("orders", Tick(resource="c", seq=0), resource_id="c")

    try:
        anyio.run(go)
        results.put("published")
    except EventBusError as exc:
        results.put(str(exc))


def test_fork_with_a_given_client_is_a_clear_error(settings: SettingsFactory) -> None:
    import redis.asyncio

    async def parent() -> EventBus:
        bus = EventBus(settings(), redis=redis.asyncio.Redis.from_url(settings().redis_url))
        await bus.publish("orders", Tick(resource="p", seq=0), resource_id="p")
        return bus

    bus = anyio.run(parent)
    ctx = multiprocessing.get_context("fork")
    results = ctx.Queue()
    p = ctx.Process(target=_child_given, args=(bus, results))
    p.start()
    p.join(30)
    assert p.exitcode == 0
    assert "before a fork" in results.get(timeout=5)

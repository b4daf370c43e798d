"""Issue 19 item 2: publish after commit on the documented paths, against a real redis-server,
SQLAlchemy on SQLite.

- Under `eventbus.fastapi.lifespan(bus)` (the bus entered on the server's loop) a sync route, in
  a worker thread, publishes through ``bus.sync()`` on that loop, and `AfterCommit` publishes
  the committed row's event.
- A plain ``def`` handler publishes with ``bus.sync()`` from its worker thread.
- An ``AsyncSession``'s commit starts the publish; ``AfterCommit.flush`` returns the entry IDs.
- `AfterCommit.publish` refuses, before the commit, what could not be published after it: the
  row is not committed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, ClassVar

import anyio
import pytest
import redis
from fastapi import FastAPI
from fastapi.testclient import TestClient
from pydantic import BaseModel
from sqlalchemy import String, create_engine, select
from sqlalchemy.ext.asyncio import async_sessionmaker, create_async_engine
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, sessionmaker
from support import running, wait_until

from eventbus import EventBus
from eventbus.config import Settings
from eventbus.errors import (
    ConfigError,
    EventBusError,
    InvalidEvent,
    PayloadTooLarge,
    ReservedEventType,
)
from eventbus.fastapi import lifespan
from eventbus.outbox import AfterCommit
from eventbus.protocol.codec import decode_entry

pytestmark = pytest.mark.integration


class Base(DeclarativeBase):
    pass


class Order(Base):
    __tablename__ = "orders"
    id: Mapped[str] = mapped_column(String, primary_key=True)


class OrderPlaced(BaseModel):
    order_id: str
    n: int = 0
    pad: str = ""


class Internal(BaseModel):
    __event_type__: ClassVar[str] = "__eventbus.mine"
    order_id: str


class OrdersSession(Session):
    """This module's session class: `AfterCommit.listen` hooks it, not every `Session`."""


@pytest.fixture
def db(tmp_path: Path) -> Iterator[sessionmaker[Session]]:
    engine = create_engine(f"sqlite:///{tmp_path / 'app.db'}")
    Base.metadata.create_all(engine)
    yield sessionmaker(engine, class_=OrdersSession)
    engine.dispose()


@pytest.fixture
def r(redis_db: str) -> Iterator[Any]:
    with redis.Redis.from_url(redis_db) as client:
        yield client


def published(r: Any, bus: EventBus, topic: str = "orders") -> list[str]:
    out = []
    for s in range(bus.topic(topic).shards):
        for _, fields in r.xrange(bus.keys.stream(topic, s)):
            payload = decode_entry(fields).payload
            out.append(f"{payload['order_id']}:{payload['n']}")
    return sorted(out)


def rows(factory: Callable[[], Session]) -> list[str]:
    with factory() as session:
        return sorted(session.scalars(select(Order.id)).all())


def test_sync_route_under_lifespan_publishes_after_commit(
    settings: type[Settings], db: sessionmaker[Session], r: Any
) -> None:
    bus = EventBus(settings(shards=2))
    outbox = AfterCommit(bus)
    outbox.listen(db)
    app = FastAPI(lifespan=lifespan(bus))

    @app.post("/orders/{order_id}")
    def place(order_id: str) -> dict[str, str]:  # a worker thread of the server's loop
        with db() as session, session.begin():
            session.add(Order(id=order_id))
            event = OrderPlaced(order_id=order_id)
            outbox.publish(session, "orders", event, resource_id=order_id)
        audit = bus.sync().publish("audit", OrderPlaced(order_id=order_id), resource_id=order_id)
        return {"audit": audit}

    with TestClient(app) as client:
        for order_id in ("o1", "o2"):
            response = client.post(f"/orders/{order_id}")
            assert response.status_code == 200, response.text
        assert not bus.sync().running  # no loop thread of its own: the app's loop was used
    assert rows(db) == ["o1", "o2"]
    assert published(r, bus) == ["o1:0", "o2:0"]
    assert published(r, bus, "audit") == ["o1:0", "o2:0"]


@pytest.mark.anyio
async def test_plain_def_handler_publishes_with_bus_sync(settings: type[Settings]) -> None:
    bus = EventBus(settings(shards=2))
    shipped: list[str] = []

    @bus.subscriber("orders", group="relay")
    def relay(event: OrderPlaced) -> None:  # runs in a worker thread
        shipment = OrderPlaced(order_id=event.order_id, n=1)
        bus.sync().publish("shipments", shipment, resource_id=event.order_id)

    @bus.subscriber("shipments", group="shipping")
    async def ship(event: OrderPlaced) -> None:
        shipped.append(event.order_id)

    async with running(bus):
        for order_id in ("o1", "o2", "o3"):
            await bus.publish("orders", OrderPlaced(order_id=order_id), resource_id=order_id)
        await wait_until(lambda: len(shipped) == 3, within_s=15)
    assert sorted(shipped) == ["o1", "o2", "o3"]


@pytest.mark.anyio
async def test_async_session_publishes_after_commit(
    settings: type[Settings], tmp_path: Path, r: Any
) -> None:
    engine = create_async_engine(f"sqlite+aiosqlite:///{tmp_path / 'app.db'}")
    async with engine.begin() as conn:
        await conn.run_sync(Base.metadata.create_all)
    factory = async_sessionmaker(engine, sync_session_class=OrdersSession)
    bus = EventBus(settings(shards=1))
    outbox = AfterCommit(bus)
    outbox.listen(factory)
    async with bus:
        async with factory() as session:
            async with session.begin():
                session.add(Order(id="a1"))
                for n in range(3):
                    event = OrderPlaced(order_id="a1", n=n)
                    outbox.publish(session, "orders", event, resource_id="a1")
            entry_ids = await outbox.flush(session)
            assert len(entry_ids) == 3 and entry_ids == sorted(entry_ids)  # in call order
            assert published(r, bus) == ["a1:0", "a1:1", "a1:2"]

            with pytest.raises(RuntimeError, match="boom"):
                async with session.begin():
                    session.add(Order(id="a2"))
                    event = OrderPlaced(order_id="a2")
                    outbox.publish(session, "orders", event, resource_id="a2")
                    raise RuntimeError("boom")
            assert await outbox.flush(session) == []
        assert published(r, bus) == ["a1:0", "a1:1", "a1:2"]

        # not flushed: the commit started the publish all the same
        async with factory() as session, session.begin():
            outbox.publish(session, "orders", OrderPlaced(order_id="a3"), resource_id="a3")
        await wait_until(lambda: "a3:0" in published(r, bus), within_s=10)
    await bus.aclose()
    await engine.dispose()


@pytest.mark.anyio
async def test_async_session_close_drops_and_a_savepoint_waits_for_the_commit(
    settings: type[Settings], tmp_path: Path, r: Any
) -> None:
    """An ``AsyncSession`` closed without commit publishes nothing of it, later either; a
    released savepoint's events are published by the outermost commit, not before."""
    engine = create_async_engine(f"sqlite+aiosqlite:///{tmp_path / 'app.db'}")
    async with engine.begin() as conn:
        await conn.run_sync(Base.metadata.create_all)
    factory = async_sessionmaker(engine, sync_session_class=OrdersSession)
    bus = EventBus(settings(shards=1))
    outbox = AfterCommit(bus)
    outbox.listen(factory)
    async with bus:
        session = factory()
        session.add(Order(id="gone"))
        outbox.publish(session, "orders", OrderPlaced(order_id="gone"), resource_id="gone")
        await session.close()  # discarded: "gone" is never committed
        async with session.begin():
            session.add(Order(id="k"))
            outbox.publish(session, "orders", OrderPlaced(order_id="k"), resource_id="k")
            async with session.begin_nested():
                outbox.publish(session, "orders", OrderPlaced(order_id="s"), resource_id="s")
            assert await outbox.flush(session) == []  # the savepoint's release started nothing
            assert published(r, bus) == []
        assert len(await outbox.flush(session)) == 2
        await session.close()
        assert published(r, bus) == ["k:0", "s:0"]
    await bus.aclose()
    await engine.dispose()


REFUSED: list[tuple[str, dict[str, Any], type[Exception], str]] = [
    ("reserved type", {"event": Internal(order_id="x")}, ReservedEventType, "__eventbus.mine"),
    ("headers", {"headers": {"attempt": 1}}, InvalidEvent, "str"),
    ("resource ID", {"resource_id": ""}, ConfigError, "resource_id"),
    ("size", {"event": OrderPlaced(order_id="x", pad="p" * 5000)}, PayloadTooLarge, "bytes"),
    ("topic name", {"topic": "no spaces"}, ConfigError, "no spaces"),
    ("not a model", {"event": {"order_id": "x"}}, ConfigError, "pydantic model"),
]


@pytest.mark.parametrize(("case", "change", "error", "match"), REFUSED, ids=[c[0] for c in REFUSED])
def test_bad_event_is_refused_before_the_commit(
    settings: type[Settings],
    db: sessionmaker[Session],
    r: Any,
    case: str,
    change: dict[str, Any],
    error: type[Exception],
    match: str,
) -> None:
    # compressed below 1,024 bytes, the padded event would fit: compression off for the size case
    bus = EventBus(settings(max_payload_bytes=1024, compress_threshold_bytes=1 << 20))
    outbox = AfterCommit(bus)
    outbox.listen(db)
    args: dict[str, Any] = {"topic": "orders", "event": OrderPlaced(order_id="x")}
    args |= {"resource_id": "x", "headers": None} | change
    with pytest.raises(error, match=match), db() as session, session.begin():
        session.add(Order(id="x"))
        outbox.publish(session, args.pop("topic"), args.pop("event"), **args)
    assert rows(db) == []  # rolled back: the row has no event, and there is no row
    assert published(r, bus) == []
    bus.sync().close()


@pytest.mark.anyio
async def test_sessions_it_cannot_serve_are_refused_before_the_commit(
    settings: type[Settings], tmp_path: Path, db: sessionmaker[Session], r: Any
) -> None:
    bus = EventBus(settings(shards=1))
    outbox = AfterCommit(bus)
    outbox.listen(db)
    unhooked = sessionmaker(db.kw["bind"])  # a plain Session class: listen() never saw it

    def place(factory: Callable[[], Session], order_id: str) -> None:
        with factory() as session, session.begin():
            session.add(Order(id=order_id))
            event = OrderPlaced(order_id=order_id)
            outbox.publish(session, "orders", event, resource_id=order_id)

    with pytest.raises(ConfigError, match=r"AfterCommit\.listen"):
        await anyio.to_thread.run_sync(place, unhooked, "u1")
    async with bus:
        # a sync session committing on the loop the bus runs on would block that loop
        with pytest.raises(ConfigError, match="worker thread"):
            place(db, "s1")
        await anyio.to_thread.run_sync(place, db, "s2")  # from a worker thread it works
    assert rows(db) == ["s2"]
    assert published(r, bus) == ["s2:0"]
    await bus.aclose()


@pytest.mark.anyio
async def test_bus_sync_on_the_loop_the_bus_runs_on_is_refused(settings: type[Settings]) -> None:
    bus = EventBus(settings(shards=1))
    async with bus:
        with pytest.raises(EventBusError, match="would block the loop it waits for"):
            bus.sync().publish("orders", OrderPlaced(order_id="x"), resource_id="x")
        assert not bus.sync().running
    await bus.aclose()

"""Publish after commit on the documented paths, against a real redis-server, SQLAlchemy on SQLite.

- Under `eventbus.fastapi.lifespan(bus)` (the bus entered on the server's loop) a sync route, in
  a worker thread, publishes through ``bus.sync()`` on that loop, and `AfterCommit` publishes
  the committed row's event.
- A plain ``def`` handler publishes with ``bus.sync()`` from its worker thread.
- An ``AsyncSession``'s commit starts the publish; ``AfterCommit.flush`` returns the entry IDs.
- `AfterCommit.publish` refuses, before the commit, what could not be published after it: the
  row is not committed.
- A session's own life: a savepoint whose flush fails keeps the outer transaction's events, a
  closed session publishes nothing it discarded, a session whose publish failed works again,
  two `AfterCommit`s on one sessionmaker publish through their own bus, and an event is
  published as it was when queued.
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
from sqlalchemy.exc import IntegrityError
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


@pytest.fixture
def outbox_setup(
    settings: type[Settings], tmp_path: Path
) -> Iterator[tuple[sessionmaker[Session], AfterCommit, Any, EventBus]]:
    engine = create_engine(f"sqlite:///{tmp_path / 'app.db'}")
    Base.metadata.create_all(engine)
    factory = sessionmaker(engine)
    bus = EventBus(settings(shards=1))
    outbox = AfterCommit(bus)
    outbox.listen(factory)
    client: Any = redis.Redis.from_url(bus.settings.redis_url)
    if bus.settings.cluster:
        client = redis.RedisCluster.from_url(bus.settings.redis_url)  # type: ignore[no-untyped-call]
    with client as r:
        yield factory, outbox, r, bus
    bus.sync().close()
    engine.dispose()


def _published(r: Any, bus: EventBus) -> list[str]:
    return [decode_entry(f).payload["order_id"] for _, f in r.xrange(bus.keys.stream("orders", 0))]


def test_a_savepoint_whose_flush_fails_keeps_the_outer_transactions_events(
    outbox_setup: tuple,  # type: ignore[type-arg]
) -> None:
    """The documented savepoint pattern (catch the IntegrityError of a savepoint, go on with the
    transaction): the outer transaction's change "a" commits, its event must be published; only
    the savepoint's event "dup" must be dropped."""
    factory, outbox, r, bus = outbox_setup
    with factory() as session, session.begin():
        session.add(Order(id="dup"))
        session.flush()
        session.add(Order(id="a"))
        outbox.publish(session, "orders", OrderPlaced(order_id="a"), resource_id="a")
        with pytest.raises(IntegrityError), session.begin_nested():
            outbox.publish(session, "orders", OrderPlaced(order_id="dup"), resource_id="dup")
            session.add(Order(id="dup"))  # the same primary key: the flush fails
    with factory() as session:
        assert sorted(session.scalars(select(Order.id)).all()) == ["a", "dup"]  # committed
    assert _published(r, bus) == ["a"]


def test_a_closed_session_does_not_publish_its_discarded_events_later(
    outbox_setup: tuple,  # type: ignore[type-arg]
) -> None:
    factory, outbox, r, bus = outbox_setup
    session = factory()
    session.add(Order(id="gone"))
    outbox.publish(session, "orders", OrderPlaced(order_id="gone"), resource_id="gone")
    session.close()  # the transaction is discarded: "gone" is never committed
    session.add(Order(id="kept"))  # a Session may be used again after close()
    outbox.publish(session, "orders", OrderPlaced(order_id="kept"), resource_id="kept")
    session.commit()
    session.close()
    with factory() as check:
        assert check.scalars(select(Order.id)).all() == ["kept"]
    assert _published(r, bus) == ["kept"]


def test_two_after_commits_on_one_sessionmaker_publish_through_their_own_bus(
    outbox_setup: tuple,  # type: ignore[type-arg]
    settings: type[Settings],
) -> None:
    """Two buses (two key prefixes here; two Redis deployments alike), each with its
    AfterCommit on the application's one sessionmaker: an event queued through one must be
    published by that one's bus."""
    factory, outbox, r, bus = outbox_setup
    audit_bus = EventBus(settings(shards=1, key_prefix="audit"))
    audit = AfterCommit(audit_bus)
    audit.listen(factory)
    try:
        with factory() as session, session.begin():
            session.add(Order(id="a"))
            outbox.publish(session, "orders", OrderPlaced(order_id="a"), resource_id="a")
            audit.publish(session, "orders", OrderPlaced(order_id="audit-a"), resource_id="a")
        audit_entries = r.xrange(audit_bus.keys.stream("orders", 0))
        audited = [decode_entry(f).payload["order_id"] for _, f in audit_entries]
        assert (_published(r, bus), audited) == (["a"], ["audit-a"])
    finally:
        audit_bus.sync().close()


def test_after_commit_publishes_the_event_as_it_was_when_queued(
    outbox_setup: tuple,  # type: ignore[type-arg]
) -> None:
    """One headers dict reused for each queued event (a loop): each event must carry the
    headers it was queued with, as `EventBus.publish` (encoded at the call) would."""
    factory, outbox, r, bus = outbox_setup
    headers: dict[str, str] = {}
    with factory() as session, session.begin():
        for tenant in ("t1", "t2"):
            headers["tenant"] = tenant
            session.add(Order(id=f"o-{tenant}"))
            event = OrderPlaced(order_id=f"o-{tenant}")
            outbox.publish(session, "orders", event, resource_id=tenant, headers=headers)
    entries = r.xrange(bus.keys.stream("orders", 0))
    tenants = [decode_entry(f).headers.get("tenant") for _, f in entries]
    assert tenants == ["t1", "t2"]


def test_a_session_whose_after_commit_publish_failed_can_be_used_again(
    outbox_setup: tuple,  # type: ignore[type-arg]
) -> None:
    """The PublishError is documented (raised from commit(), the database committed); the
    session that raised it must still work: its next transaction commits and publishes."""
    from eventbus.errors import PublishError

    factory, outbox, r, bus = outbox_setup
    stream = bus.keys.stream("orders", 0)
    r.set(stream, "not a stream")  # the XADD is refused: WRONGTYPE
    session = factory()
    session.add(Order(id="a"))
    outbox.publish(session, "orders", OrderPlaced(order_id="a"), resource_id="a")
    with pytest.raises(PublishError):
        session.commit()
    r.delete(stream)
    session.add(Order(id="b"))
    outbox.publish(session, "orders", OrderPlaced(order_id="b"), resource_id="b")
    session.commit()
    session.close()
    with factory() as check:
        assert sorted(check.scalars(select(Order.id)).all()) == ["a", "b"]
    assert _published(r, bus) == ["b"]

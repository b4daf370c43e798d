"""Publish after commit: SQLAlchemy on SQLite, events to a real redis-server (one node and a
Cluster). A committed transaction publishes its events in order, a rolled-back one nothing, a
rolled-back savepoint only what was queued before it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from pydantic import BaseModel
from sqlalchemy import String, create_engine, select
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, sessionmaker

from eventbus import EventBus
from eventbus.config import Settings
from eventbus.outbox import AfterCommit

pytestmark = pytest.mark.integration


class Base(DeclarativeBase):
    pass


class Order(Base):
    __tablename__ = "orders"
    id: Mapped[str] = mapped_column(String, primary_key=True)


class OrderPlaced(BaseModel):
    order_id: str
    n: int = 0


@pytest.fixture
def setup(
    settings: type[Settings], tmp_path: Path
) -> Iterator[tuple[sessionmaker[Session], AfterCommit, Any, EventBus]]:
    engine = create_engine(f"sqlite:///{tmp_path / 'app.db'}")
    Base.metadata.create_all(engine)
    factory = sessionmaker(engine)
    bus = EventBus(settings(shards=1))
    outbox = AfterCommit(bus)
    outbox.listen(factory)
    url = bus.settings.redis_url
    client: Any = redis.Redis.from_url(url)
    if bus.settings.cluster:
        client = redis.RedisCluster.from_url(url)  # type: ignore[no-untyped-call]
    with client as r:
        yield factory, outbox, r, bus
    bus.sync().close()
    engine.dispose()


def _published(r: Any, bus: EventBus) -> list[str]:
    from eventbus.protocol.codec import decode_entry

    entries = r.xrange(bus.keys.stream("orders", 0))
    return [
        f"{decode_entry(f).payload['order_id']}:{decode_entry(f).payload['n']}" for _, f in entries
    ]


def test_commit_publishes_in_order_and_rollback_publishes_nothing(setup: tuple) -> None:  # type: ignore[type-arg]
    factory, outbox, r, bus = setup
    with factory() as session, session.begin():
        session.add(Order(id="o1"))
        for n in range(3):
            outbox.publish(session, "orders", OrderPlaced(order_id="o1", n=n), resource_id="o1")
        assert not r.exists(bus.keys.stream("orders", 0))  # nothing before the commit
        assert len(outbox.pending(session)) == 3
    assert _published(r, bus) == ["o1:0", "o1:1", "o1:2"]

    with pytest.raises(RuntimeError, match="boom"), factory() as session, session.begin():
        session.add(Order(id="o2"))
        outbox.publish(session, "orders", OrderPlaced(order_id="o2"), resource_id="o2")
        raise RuntimeError("boom")
    with factory() as session:
        assert session.scalars(select(Order.id)).all() == ["o1"]
        session.rollback()  # nothing queued left behind: a later commit publishes nothing of it
        session.add(Order(id="o3"))
        session.commit()
    assert _published(r, bus) == ["o1:0", "o1:1", "o1:2"]


def test_rolled_back_savepoint_drops_only_its_events(setup: tuple) -> None:  # type: ignore[type-arg]
    factory, outbox, r, bus = setup
    with factory() as session, session.begin():
        outbox.publish(session, "orders", OrderPlaced(order_id="a"), resource_id="a")
        savepoint = session.begin_nested()
        session.add(Order(id="b"))
        outbox.publish(session, "orders", OrderPlaced(order_id="b"), resource_id="b")
        savepoint.rollback()
        with session.begin_nested():
            outbox.publish(session, "orders", OrderPlaced(order_id="c"), resource_id="c")
    assert _published(r, bus) == ["a:0", "c:0"]


def test_a_released_savepoint_publishes_nothing_before_the_outer_commit(setup: tuple) -> None:  # type: ignore[type-arg]
    """SQLAlchemy emits ``after_commit`` when a savepoint is released too: its events (and the
    outer transaction's) must wait for the outermost commit, and go with its rollback."""
    factory, outbox, r, bus = setup
    with pytest.raises(RuntimeError, match="boom"), factory() as session, session.begin():
        session.add(Order(id="a"))
        outbox.publish(session, "orders", OrderPlaced(order_id="a"), resource_id="a")
        with session.begin_nested():
            outbox.publish(session, "orders", OrderPlaced(order_id="b"), resource_id="b")
        assert not r.exists(bus.keys.stream("orders", 0))  # nothing before the outer commit
        assert len(outbox.pending(session)) == 2
        raise RuntimeError("boom")
    assert not r.exists(bus.keys.stream("orders", 0))
    with factory() as session, session.begin():
        session.add(Order(id="c"))
        outbox.publish(session, "orders", OrderPlaced(order_id="c"), resource_id="c")
        with session.begin_nested():
            outbox.publish(session, "orders", OrderPlaced(order_id="d"), resource_id="d")
    assert _published(r, bus) == ["c:0", "d:0"]


def test_bad_events_are_refused_when_queued(setup: tuple) -> None:  # type: ignore[type-arg]
    from eventbus.errors import ConfigError

    factory, outbox, _r, _bus = setup
    with factory() as session:
        with pytest.raises(ConfigError, match="pydantic model"):
            outbox.publish(session, "orders", {"order_id": "x"}, resource_id="x")  # type: ignore[arg-type]
        with pytest.raises(ConfigError, match="resource_id"):
            outbox.publish(session, "orders", OrderPlaced(order_id="x"), resource_id="")


def test_a_traced_bus_traces_the_publish_after_commit(setup: tuple) -> None:  # type: ignore[type-arg]
    """The events are encoded at `publish()` and sent as envelopes at the commit: with
    `eventbus.otel` on, each still gets a producer span and the trace context in its headers,
    next to the headers it was queued with."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from eventbus import otel
    from eventbus.protocol.codec import decode_entry

    factory, outbox, r, bus = setup
    spans = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(spans))
    otel.instrument(provider)
    try:
        with factory() as session, session.begin():
            session.add(Order(id="t"))
            event = OrderPlaced(order_id="t")
            outbox.publish(session, "orders", event, resource_id="t", headers={"tenant": "t1"})
    finally:
        otel.uninstrument()
    [(entry_id, fields)] = r.xrange(bus.keys.stream("orders", 0))
    headers = decode_entry(fields).headers
    assert headers["tenant"] == "t1" and "traceparent" in headers
    [span] = [s for s in spans.get_finished_spans() if s.name == "send orders"]
    assert (span.attributes or {})["messaging.message.id"] == entry_id.decode()

"""Hunt 33b: correctness bugs at the seams (stop, hand-over, outbox, request/reply,
publishing), each shown against a real redis-server and marked strict xfail until fixed.
Interleavings are forced with hooks, never with sleeps."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
import redis
from pydantic import BaseModel
from sqlalchemy import String, create_engine, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, sessionmaker

from eventbus import EventBus
from eventbus.config import Settings
from eventbus.consumer.engine import Consumer
from eventbus.outbox import AfterCommit
from eventbus.protocol.codec import decode_entry

pytestmark = pytest.mark.integration


# -- outbox (publish after commit) --------------------------------------------------------------
class Base(DeclarativeBase):
    pass


class Order(Base):
    __tablename__ = "orders"
    id: Mapped[str] = mapped_column(String, primary_key=True)


class OrderPlaced(BaseModel):
    order_id: str


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


# -- graceful stop of a group consumer ------------------------------------------------------------
class Tick(BaseModel):
    resource: str
    seq: int


async def _blocked_in_xreadgroup(r: Any) -> bool:
    return any(
        c.get("cmd") == "xreadgroup" and "b" in str(c.get("flags", ""))
        for c in await r.client_list()
    )


@pytest.mark.anyio
@pytest.mark.single_node("CLIENT LIST of one server")
async def test_an_at_most_once_read_blocked_at_the_stop_loses_nothing_published_after(
    settings: Any, r: Any
) -> None:
    """The read of the morning's CI failure, one step later: the stop comes while the read
    loop's XREADGROUP (NOACK) is blocked in Redis. The entry published after the stop must be
    handled within the grace, or left unread for the next consumer, not read and dropped.
    (The same with ack='after' leaves it pending: redelivered, no loss.)"""
    from support import wait_until

    s = settings(shards=1, block_min_ms=10_000, block_max_ms=10_000, lock_interval_ms=10_000)
    bus, publisher = EventBus(s), EventBus(s)
    stream = bus.keys.stream("late", 0)
    handled: list[int] = []

    @bus.subscriber("late", group="g", ack="before")
    async def handle(event: Tick) -> None:
        handled.append(event.seq)

    stop = anyio.Event()
    entry_id = ""
    async with publisher:
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: bus.run(stop=stop))
            await wait_until(lambda: bool(bus.consumers))
            consumer = bus.consumers[0]
            assert isinstance(consumer, Consumer)
            await wait_until(lambda: bool(consumer.table.held))
            await wait_until(lambda: _blocked_in_xreadgroup(r))  # the read is in Redis
            stop.set()
            await wait_until(lambda: consumer._stopping)  # the stop is taken: no more reads
            entry_id = await publisher.publish("late", Tick(resource="x", seq=1), resource_id="x")
        await bus.aclose()
    groups = {g["name"]: g for g in await r.xinfo_groups(stream)}
    last_delivered = groups[b"g"]["last-delivered-id"].decode()
    unread = last_delivered != entry_id  # left for the next consumer of the group
    assert handled == [1] or unread, (handled, last_delivered, entry_id)


# -- eventbus replay of a topic the offloader is archiving --------------------------------------
def test_replay_during_an_offload_reports_no_missing_segment(
    redis_db: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``eventbus replay`` lists the segments first (`plan`) and reads the checkpoint counts
    last (`_check_gaps`): a segment the offloader commits meanwhile is counted by the checkpoint
    and not read, and the complete archive is reported as holed (exit 1, "20 entries are
    missing from the archive (a deleted segment?)"). check_complete's docstring says such
    segments only make the archive look longer."""
    import subprocess
    import sys

    from typer.testing import CliRunner

    import eventbus.tier.replay as replay_module
    from eventbus.cli import app

    runner = CliRunner(env={"COLUMNS": "200"})
    env = {"EVENTBUS_TIER_HOT_WINDOW_S": "0", "EVENTBUS_TIER_TRIM_EXACT": "true"}
    store = tmp_path / "segs"
    args = ["--store", str(store), "--redis-url", redis_db]
    offload = [sys.executable, "-m", "eventbus.cli", "offload", "--once", *args]
    offload += ["--segment-max-entries", "20"]

    async def publish(first: int, n: int) -> None:
        bus = EventBus(Settings(redis_url=redis_db, shards=1))
        async with bus:
            await bus.publish_many(
                "live", [(f"r{i % 3}", Tick(resource=f"r{i % 3}", seq=i)) for i in range(first, n)]
            )
        await bus.aclose()

    anyio.run(publish, 0, 60)
    done = subprocess.run(offload, env={**os.environ, **env}, capture_output=True, timeout=120)
    assert done.returncode == 0, done.stderr
    anyio.run(publish, 60, 80)  # the offloader's next segment, archived during the replay

    planned = replay_module.plan

    def plan_then_offload(*a: Any, **kw: Any) -> Any:
        segments = planned(*a, **kw)
        again = subprocess.run(offload, env={**os.environ, **env}, capture_output=True, timeout=120)
        assert again.returncode == 0, again.stderr
        return segments

    monkeypatch.setattr(replay_module, "plan", plan_then_offload)
    result = runner.invoke(app, ["replay", "live", *args, "--no-progress"])
    events = [x for x in result.stdout.splitlines() if x.startswith("{")]
    assert len(events) == 60  # what the store held when the replay listed it
    assert len(list((store / "live" / "shard=0").glob("*.parquet"))) == 4  # nothing deleted
    assert result.exit_code == 0, result.output[-500:]


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


# -- broadcast: a running instance that falls behind the stream's cap ----------------------------
@pytest.mark.anyio
async def test_a_broadcast_instance_behind_the_cap_is_told_what_it_missed(
    settings: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Every running instance gets every event published while it runs (broadcast.py's
    docstring); when the cap trims events an instance had not read yet, that loss must at least
    be logged, as consumer groups log and count theirs (`eventbus.consumer.trims`)."""
    import logging

    from support import running, wait_until

    from eventbus.consumer.broadcast import BroadcastConsumer

    s = settings(shards=1, max_in_flight=1)
    bus, publisher = EventBus(s), EventBus(s)
    for b in (bus, publisher):
        b.topic("bc", maxlen=100)
    gate = anyio.Event()
    seen: list[int] = []

    @bus.subscriber("bc", broadcast=True)
    async def handle(event: Tick) -> None:
        seen.append(event.seq)
        await gate.wait()

    caplog.set_level(logging.INFO)
    async with publisher, running(bus):
        (consumer,) = bus.consumers
        assert isinstance(consumer, BroadcastConsumer)
        await publisher.publish("bc", Tick(resource="r", seq=0), resource_id="r")
        await wait_until(lambda: seen == [0])  # read, held by the gate: the instance is behind
        events = [("r", Tick(resource="r", seq=i)) for i in range(1, 1001)]
        await publisher.publish_many("bc", events)  # MAXLEN ~ 100 trims most of them
        gate.set()
        await wait_until(lambda: seen[-1:] == [1000], within_s=60)
    missed = 1001 - len(seen)
    told = [r.getMessage() for r in caplog.records if "trim" in r.getMessage().lower()]
    assert missed == 0 or told, f"{missed} events never reached the instance, no log line"


@pytest.mark.anyio
async def test_broadcast_with_a_dedup_window_still_reaches_every_instance(
    settings: Any, r: Any
) -> None:
    """The second instance's de-duplication check is held until the first instance has
    handled the event and written its mark (else both may check before either marks)."""
    from support import running, wait_until

    from eventbus.consumer.broadcast import BroadcastConsumer

    s = settings(shards=1)
    instances = [EventBus(s), EventBus(s)]
    handled: list[list[int]] = [[], []]

    def subscribe(b: EventBus, seen: list[int]) -> None:
        @b.subscriber("cache", broadcast=True, dedup_window_s=60)
        async def invalidate(event: Tick) -> None:
            seen.append(event.seq)

    for b, seen in zip(instances, handled, strict=True):
        subscribe(b, seen)
    publisher = EventBus(s)
    async with publisher, running(*instances):
        consumers = [b.consumers[0] for b in instances]
        assert all(isinstance(c, BroadcastConsumer) for c in consumers)
        first_marked = anyio.Event()
        second = consumers[1].handling
        seen = second._seen

        async def after_the_first(event_id: bytes) -> bool:
            await first_marked.wait()
            return await seen(event_id)

        second._seen = after_the_first  # type: ignore[method-assign]
        await publisher.publish("cache", Tick(resource="r", seq=1), resource_id="r")
        await wait_until(lambda: handled[0] == [1])

        async def marked() -> bool:
            return bool([k async for k in r.scan_iter(match="*dedup*")])

        await wait_until(marked)
        first_marked.set()

        async def both_done() -> bool:  # read to the stream's end, nothing in flight
            behind = [await c.behind() for c in consumers]  # type: ignore[union-attr]
            return not any(behind)

        await wait_until(both_done)
    assert handled == [[1], [1]]


# -- request/reply with a batch subscriber --------------------------------------------------------
class Quote(BaseModel):
    n: int


class Price(BaseModel):
    n: int


@pytest.mark.anyio
async def test_a_request_to_a_batch_subscriber_is_answered_or_refused_loudly(
    settings: Any, r: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """A request is an ordinary event and "a handler that returns a pydantic model" answers
    it (docs/semantics.md, Request/reply). A batch handler returning one model per event gets
    no reply through, and no log line names the cause. Checked once the batch is handled and
    acked: a reply in the caller's reply stream, or a WARNING of the consumer."""
    import logging

    from support import pending_count, running, wait_until

    from eventbus.request import requester

    s = settings(shards=1)
    bus, caller = EventBus(s), EventBus(s)
    called: list[int] = []

    @bus.subscriber("quotes", group="pricing", batch=True)
    async def price(quotes: list[Quote]) -> list[Price]:
        called.extend(q.n for q in quotes)
        return [Price(n=q.n) for q in quotes]

    caplog.set_level(logging.WARNING)
    stream = bus.keys.stream("quotes", 0)
    async with caller, running(bus), anyio.create_task_group() as tg:
        tg.start_soon(lambda: caller.request("quotes", Quote(n=1), resource_id="r", timeout_s=600))
        await wait_until(lambda: called == [1])

        async def acked() -> bool:
            return await pending_count(r, stream, "pricing") == 0

        await wait_until(acked)
        replies = await r.xlen(requester(caller.redis, caller.keys, "quotes").stream)
        tg.cancel_scope.cancel()
    told = [x for x in caplog.records if x.name.startswith("eventbus.consumer")]
    assert replies or told, "handled and acked: no reply, and no log line says why"


# -- eventbus run --processes: a SIGTERM to the whole process group --------------------------------
_BUSY_APP = """
import anyio, os
from pathlib import Path
from pydantic import BaseModel
from eventbus import EventBus

class Tick(BaseModel):
    resource: str
    seq: int

bus = EventBus.from_env()

@bus.subscriber("term", group="g")
async def handle(event: Tick) -> None:
    Path(f"started-{os.getpid()}").touch()
    while not Path("release").exists():  # the test lets the handler finish
        await anyio.sleep(0.02)
"""


@pytest.mark.single_node("one server's PEL")
@pytest.mark.skipif(
    not Path("/proc/self/task").is_dir(), reason="orders the signals with Linux's /proc"
)
def test_one_group_sigterm_on_run_processes_shuts_the_children_down_gracefully(
    redis_db: str, tmp_path: Path
) -> None:
    """The interleaving of one group-wide SIGTERM, forced: the busy child gets its SIGTERM and
    starts its graceful shutdown; then the parent gets its own and forwards it to every child.
    The busy child must still finish its handler, ack, release its shard and exit 0.

    Ordering without sleeps: the release comes once the parent's forwarding handler has run
    (`parent_forwarded_or_exited`); a forwarded SIGTERM with its default action kills at
    delivery, before the child runs any more of its code."""
    import json
    import signal
    import subprocess
    import sys
    import textwrap
    import time

    (tmp_path / "busy_app.py").write_text(textwrap.dedent(_BUSY_APP))
    env = {**os.environ, "REDIS_URL": redis_db, "EVENTBUS_SHARDS": "1"}
    env["EVENTBUS_BLOCK_MAX_MS"] = "100"
    cmd = [sys.executable, "-m", "eventbus.cli", "run", "busy_app:bus", "--processes", "2"]
    cmd += ["--log-format", "json"]
    log_path = tmp_path / "run.log"
    with log_path.open("w") as log_file:
        proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stderr=log_file, start_new_session=True)

    def records() -> list[dict[str, Any]]:
        text = log_path.read_text()
        return [json.loads(x) for x in text.splitlines() if x.startswith("{") and x.endswith("}")]

    def logged(pid: int, words: str) -> bool:
        return any(r.get("pid") == pid and words in r.get("message", "") for r in records())

    def wait_for(predicate: Any) -> Any:  # the state of other processes: polled
        deadline = time.monotonic() + 60
        while not (found := predicate()):
            assert time.monotonic() < deadline, (what(), log_path.read_text()[-3000:])
            time.sleep(0.02)
        return found

    def what() -> str:  # the parent's state, for a failed wait
        try:
            syscall = Path(f"/proc/{proc.pid}/syscall").read_text()
            status = Path(f"/proc/{proc.pid}/status").read_text()
        except OSError as exc:
            return f"parent gone: {exc}"
        pnd = [x for x in status.splitlines() if x.startswith(("SigPnd", "ShdPnd", "State"))]
        return f"parent syscall {syscall.strip()}; {pnd}"

    def parent_forwarded_or_exited() -> bool:
        """The parent took its SIGTERM (not pending) and is back in ``Popen.wait()``'s
        blocking ``wait4`` (/proc/<pid>/syscall: 61, options 0): its forwarding handler ran
        (PEP 475: the handler runs before the interrupted wait4 is retried)."""
        if proc.poll() is not None:
            return True
        try:
            status = Path(f"/proc/{proc.pid}/status").read_text()
            call = [*Path(f"/proc/{proc.pid}/syscall").read_text().split(), "", "", ""][:4]
        except OSError:
            return proc.poll() is not None
        pending = 0
        for line in status.splitlines():
            if line.startswith(("SigPnd:", "ShdPnd:")):
                pending |= int(line.split()[1], 16)
        term_pending = pending & (1 << (signal.SIGTERM - 1))
        return not term_pending and call[0] == "61" and call[3] == "0x0"

    try:
        children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children")
        pids = wait_for(lambda: len(found := children.read_text().split()) == 2 and found)
        wait_for(lambda: all(logged(int(p), "starts on topic") for p in pids))

        async def publish() -> None:
            bus = EventBus(Settings(redis_url=redis_db, shards=1))
            async with bus:
                await bus.publish("term", Tick(resource="r", seq=1), resource_id="r")
            await bus.aclose()

        anyio.run(publish)
        started = wait_for(lambda: list(tmp_path.glob("started-*")))
        busy = int(started[0].name.removeprefix("started-"))
        os.kill(busy, signal.SIGTERM)  # the group signal reaches the busy child first
        wait_for(lambda: logged(busy, "shutting down gracefully"))
        os.kill(proc.pid, signal.SIGTERM)  # ... then the parent, which forwards it
        wait_for(parent_forwarded_or_exited)
        (tmp_path / "release").touch()
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert logged(busy, "left; released shards"), log_path.read_text()[-3000:]
    assert proc.returncode == 0, log_path.read_text()[-3000:]

"""Consuming, as test cases run on fakeredis and on a real redis-server (`cases.backends`):
delivery with its context, dead letters of undecodable entries, retries in place, ack modes,
start positions, sync handlers, several groups, the in-flight cap and the concurrency limit.

Cases that need a real server (several consumers sharing shards under load, the idle backoff
measured on real sockets) are in `tests/integration/test_consume.py`.
"""

from __future__ import annotations

import functools
import threading
import uuid
from collections import Counter
from typing import Any

import anyio
import anyio.lowlevel
import msgpack
import pytest
from cases.backends import Backend
from pydantic import BaseModel
from redis.exceptions import ResponseError
from support import Recorder, Tick, group_lag, running, total_pending, wait_until

from eventbus import Context, EventBus, shard_of
from eventbus.protocol.codec import F_DATA, F_RESOURCE, F_TYPE


class Other(BaseModel):
    name: str


class BadTick(BaseModel):
    __event_type__ = "Tick"  # claims to be a Tick, but lacks `seq`
    resource: str


async def no_pending(bus: EventBus, topic: str, group: str, r: Any) -> bool:
    return await total_pending(bus, topic, group, r) == 0


async def xlen_is(r: Any, key: str, n: int) -> bool:
    return await r.xlen(key) == n


async def lag_is(r: Any, stream: str, group: str, n: int) -> bool:
    return await group_lag(r, stream, group) == n


async def pending_is(r: Any, stream: str, n: int) -> bool:
    try:
        summary = await r.xpending(stream, "g")
    except ResponseError as exc:
        if "NOGROUP" in str(exc):  # the consumer has not created its group yet
            return False
        raise
    return int(summary["pending"]) == n


async def groups_exist(r: Any, streams: list[str], group: str) -> bool:
    for stream in streams:
        if not await r.exists(stream):
            return False
        names = [g["name"] for g in await r.xinfo_groups(stream)]
        if group.encode() not in names:
            return False
    return True


class ConsumeCases:
    """Consuming on the `backend` a subclass provides (`cases.backends`)."""

    pytestmark = pytest.mark.anyio

    async def test_handler_gets_every_event_with_its_context_and_acks(
        self, backend: Backend
    ) -> None:
        r = backend.redis
        bus = backend.bus(shards=4)
        rec = Recorder()

        @bus.subscriber("orders", group="billing")
        async def handle(event: Tick, ctx: Context) -> None:
            rec.add(event, ctx)

        published = {}
        for i in range(20):
            rid = f"r{i % 6}"
            published[(rid, i)] = await bus.publish(
                "orders", Tick(resource=rid, seq=i), resource_id=rid, headers={"n": str(i)}
            )

        async with running(bus) as [run]:
            await rec.wait_for(20)
            await wait_until(lambda: no_pending(bus, "orders", "billing", r))

        assert Counter((h.resource, h.seq) for h in rec.log) == Counter(published.keys())
        for h in rec.log:
            ctx = h.ctx
            assert (ctx.topic, ctx.group, ctx.resource_id) == ("orders", "billing", h.resource)
            assert ctx.shard == shard_of(h.resource, 4)
            assert ctx.entry_id == published[(h.resource, h.seq)]
            assert ctx.headers == {"n": str(h.seq)}
            assert ctx.event_type == "Tick" and isinstance(ctx.event_id, uuid.UUID)
            assert ctx.attempt == 1 and ctx.fencing_token >= 1
            assert ctx.consumer_id == run.consumer_ids[0]
        assert len({h.ctx.event_id for h in rec.log}) == 20
        assert bus.consumers[0].tally.handled == 20

    async def test_undecodable_entries_are_dead_lettered_and_the_shard_goes_on(
        self, backend: Backend
    ) -> None:
        r = backend.redis
        bus = backend.bus(shards=2)
        rec = Recorder()

        @bus.subscriber("orders", group="billing")
        async def handle(event: Tick, ctx: Context) -> None:
            rec.add(event, ctx)

        rid = "victim"
        stream = bus.keys.stream("orders", shard_of(rid, 2))
        await bus.publish("orders", Tick(resource=rid, seq=0), resource_id=rid)
        junk = await r.xadd(stream, {b"junk": b"\xff\x00"})  # no fields of ours at all
        bad_msgpack = await r.xadd(
            stream, {F_RESOURCE: rid.encode(), F_TYPE: b"Tick", F_DATA: b"\x01\xc1"}
        )
        bad_zstd = await r.xadd(
            stream, {F_RESOURCE: rid.encode(), F_TYPE: b"Tick", F_DATA: b"\x02zz"}
        )
        await bus.publish("orders", Tick(resource=rid, seq=1), resource_id=rid)
        other = await bus.publish("orders", Other(name="x"), resource_id=rid)  # not a type it takes
        invalid = await bus.publish("orders", BadTick(resource=rid), resource_id=rid)  # lacks seq
        await bus.publish("orders", Tick(resource=rid, seq=2), resource_id=rid)

        dlq = bus.keys.dead_letter("orders", "billing")
        async with running(bus):
            await rec.wait_for(3)
            await wait_until(lambda: xlen_is(r, dlq, 5))
            await wait_until(lambda: no_pending(bus, "orders", "billing", r))

        assert rec.by_resource() == {rid: [0, 1, 2]}
        letters = {f[b"entry_id"]: f for _, f in await r.xrange(dlq)}
        assert set(letters) == {junk, bad_msgpack, bad_zstd, other.encode(), invalid.encode()}
        errors = {eid: (f[b"error_type"], f[b"error"]) for eid, f in letters.items()}
        assert errors[junk][0] == b"DecodeError" and b"lacks field" in errors[junk][1]
        assert errors[bad_msgpack][0] == b"DecodeError" and b"corrupt" in errors[bad_msgpack][1]
        assert errors[bad_zstd][0] == b"DecodeError"
        assert errors[other.encode()][0] == b"UnknownEventType"
        assert b"Other" in errors[other.encode()][1]
        assert (
            errors[invalid.encode()][0] == b"DecodeError" and b"seq" in errors[invalid.encode()][1]
        )
        for f in letters.values():
            assert (f[b"topic"], f[b"group"], f[b"attempts"]) == (b"orders", b"billing", b"0")
            assert int(f[b"shard"]) == shard_of(rid, 2)
        # the original fields are kept, for inspection and replay
        assert letters[bad_msgpack][b"orig_data"] == b"\x01\xc1"
        assert letters[bad_msgpack][b"orig_rid"] == rid.encode()
        assert b"orig_data" not in letters[junk]
        assert bus.consumers[0].tally.dead_lettered == 5

    async def test_failing_handler_is_retried_in_place_then_dead_lettered(
        self, backend: Backend
    ) -> None:
        r = backend.redis
        """Resource "x": seq 1 fails twice then succeeds, seq 3 always fails (dead-lettered after
        max_attempts). Later events of "x" wait for each; resource "y" is not held up meanwhile."""
        bus = backend.bus(shards=1, max_attempts=3)
        calls: list[tuple[str, int, int]] = []  # (resource, seq, attempt), in call order
        y_done = anyio.Event()

        @bus.subscriber("jobs", group="workers")
        async def handle(event: Tick, ctx: Context) -> None:
            calls.append((event.resource, event.seq, ctx.attempt))
            if event.resource == "y" and event.seq == 2:
                y_done.set()
            if event.resource == "x" and event.seq == 1 and ctx.attempt == 1:
                # "y" must make progress while "x" is stuck: it is on the same shard
                with anyio.fail_after(10):
                    await y_done.wait()
            if event.resource == "x" and ((event.seq == 1 and ctx.attempt < 3) or event.seq == 3):
                raise RuntimeError(f"boom {event.seq}/{ctx.attempt}")

        events = [("x", Tick(resource="x", seq=i)) for i in range(5)]
        events[2:2] = [("y", Tick(resource="y", seq=i)) for i in range(3)]
        await bus.publish_many("jobs", events)

        dlq = bus.keys.dead_letter("jobs", "workers")
        async with running(bus):
            await wait_until(lambda: xlen_is(r, dlq, 1))
            await wait_until(lambda: ("x", 4, 1) in calls)
            await wait_until(lambda: no_pending(bus, "jobs", "workers", r))

        x_calls = [(seq, attempt) for res, seq, attempt in calls if res == "x"]
        assert x_calls == [(0, 1), (1, 1), (1, 2), (1, 3), (2, 1), (3, 1), (3, 2), (3, 3), (4, 1)]
        assert [(seq, a) for res, seq, a in calls if res == "y"] == [(0, 1), (1, 1), (2, 1)]
        # "y" finished while "x" seq 1 was still on its first attempt
        assert calls.index(("y", 2, 1)) < calls.index(("x", 1, 2))
        [(_, letter)] = await r.xrange(dlq)
        assert letter[b"error_type"] == b"RuntimeError"
        assert letter[b"error"] == b"boom 3/3"
        assert letter[b"attempts"] == b"3"
        assert bus.consumers[0].tally.handled == 7

    async def test_per_subscriber_max_attempts(self, backend: Backend) -> None:
        r = backend.redis
        bus = backend.bus(shards=1, max_attempts=5)
        attempts: list[int] = []

        @bus.subscriber("jobs", group="g", max_attempts=1)
        async def handle(event: Tick, ctx: Context) -> None:
            attempts.append(ctx.attempt)
            raise ValueError("never works")

        await bus.publish("jobs", Tick(resource="a", seq=0), resource_id="a")
        dlq = bus.keys.dead_letter("jobs", "g")
        async with running(bus):
            await wait_until(lambda: xlen_is(r, dlq, 1))
        assert attempts == [1]

    async def test_ack_before_reads_with_noack(self, backend: Backend) -> None:
        r = backend.redis
        """At-most-once: entries are never pending, even while their handler runs."""
        bus = backend.bus(shards=2)
        started, release = anyio.Event(), anyio.Event()
        rec = Recorder()

        @bus.subscriber("audit", group="fast", ack="before")
        async def handle(event: Tick, ctx: Context) -> None:
            if event.seq == 0:
                started.set()
                await release.wait()
            rec.add(event, ctx)

        await bus.publish_many("audit", [("a", Tick(resource="a", seq=i)) for i in range(5)])
        stream = bus.keys.stream("audit", shard_of("a", 2))
        async with running(bus):
            with anyio.fail_after(10):
                await started.wait()
            # the handler holds seq 0 and seq 1..4 are queued behind it: all were delivered
            await wait_until(lambda: lag_is(r, stream, "fast", 0))
            assert await total_pending(bus, "audit", "fast", r) == 0
            release.set()
            await rec.wait_for(5)

        assert rec.by_resource() == {"a": [0, 1, 2, 3, 4]}
        assert await total_pending(bus, "audit", "fast", r) == 0

    async def test_ack_after_keeps_entries_pending_until_handled(self, backend: Backend) -> None:
        r = backend.redis
        """The counterpart of the NOACK test: with the default mode, a running handler's entry
        is pending, and it is acked once the handler returns."""
        bus = backend.bus(shards=2)
        started, release = anyio.Event(), anyio.Event()

        @bus.subscriber("audit", group="safe")
        async def handle(event: Tick) -> None:
            started.set()
            await release.wait()

        await bus.publish("audit", Tick(resource="a", seq=0), resource_id="a")
        async with running(bus):
            with anyio.fail_after(10):
                await started.wait()
            assert await total_pending(bus, "audit", "safe", r) == 1
            release.set()
            await wait_until(lambda: no_pending(bus, "audit", "safe", r))

    @pytest.mark.parametrize("start", ["beginning", "now"])
    async def test_new_group_starts_at_beginning_or_now(self, backend: Backend, start: str) -> None:
        r = backend.redis
        publisher = backend.bus(shards=2, start=start)
        bus = backend.bus(shards=2, start=start)
        rec = Recorder()

        @bus.subscriber("news", group=f"from-{start}")
        async def handle(event: Tick, ctx: Context) -> None:
            rec.add(event, ctx)

        old = [(f"r{i}", Tick(resource=f"r{i}", seq=i)) for i in range(6)]
        new = [(f"r{i}", Tick(resource=f"r{i}", seq=100 + i)) for i in range(6)]
        await publisher.publish_many("news", old)
        streams = [bus.keys.stream("news", i) for i in range(2)]
        async with running(bus):
            # the group exists on every shard before the new events are published
            await wait_until(lambda: groups_exist(r, streams, f"from-{start}"))
            await publisher.publish_many("news", new)
            expected = [e.seq for _, e in (old + new if start == "beginning" else new)]
            await rec.wait_for(len(expected))
            for stream in streams:  # everything delivered, so nothing else can still come
                await wait_until(lambda stream=stream: lag_is(r, stream, f"from-{start}", 0))
        await publisher.aclose()

        assert sorted(h.seq for h in rec.log) == sorted(expected)

    async def test_a_handler_behind_a_sync_decorator_runs_before_its_ack(
        self, backend: Backend
    ) -> None:
        """An ``async def`` handler wrapped by an ordinary sync decorator
        (``functools.wraps`` around ``def wrapper``) was run in a thread, its coroutine never
        awaited (RuntimeWarning), and the entry acked as handled."""
        r = backend.redis
        bus = backend.bus(shards=1)
        seen: list[int] = []

        def logged(func: Any) -> Any:
            @functools.wraps(func)
            def wrapper(*args: Any) -> Any:
                return func(*args)

            return wrapper

        @bus.subscriber("orders", group="billing")
        @logged
        async def handle(event: Tick, ctx: Context) -> None:
            await anyio.lowlevel.checkpoint()
            seen.append(event.seq)

        await bus.publish_many("orders", [("a", Tick(resource="a", seq=i)) for i in range(3)])
        async with running(bus):
            await wait_until(lambda: len(seen) == 3)
            await wait_until(lambda: no_pending(bus, "orders", "billing", r))
        assert seen == [0, 1, 2]
        assert bus.consumers[0].tally.handled == 3

    async def test_header_values_that_are_not_strings_are_undecodable(
        self, backend: Backend
    ) -> None:
        """An envelope whose headers map to non-strings (a raw XADD) reached
        the handler as ``ctx.headers == {"a": 1, "b": None}``, though `Context.headers` is
        ``dict[str, str]``: it is dead-lettered as undecodable."""
        r = backend.redis
        bus = backend.bus(shards=1)
        rec = Recorder()

        @bus.subscriber("orders", group="billing")
        async def handle(event: Tick, ctx: Context) -> None:
            rec.add(event, ctx)

        body = {"v": 1, "id": uuid.uuid4().bytes, "ts": 1, "h": {"a": 1, "b": None},
                "p": {"resource": "a", "seq": 0}}  # fmt: skip
        data = b"\x01" + msgpack.packb(body, use_bin_type=True)
        odd = await r.xadd(
            bus.keys.stream("orders", 0), {F_RESOURCE: b"a", F_TYPE: b"Tick", F_DATA: data}
        )
        await bus.publish("orders", Tick(resource="a", seq=1), resource_id="a")
        dlq = bus.keys.dead_letter("orders", "billing")
        async with running(bus):
            await rec.wait_for(1)
            await wait_until(lambda: xlen_is(r, dlq, 1))
        ((_, letter),) = await r.xrange(dlq)
        assert letter[b"entry_id"] == odd and letter[b"reason"] == b"undecodable"
        assert rec.by_resource() == {"a": [1]}

    async def test_a_handler_failing_while_stopping_is_left_pending_promptly(
        self, backend: Backend
    ) -> None:
        """An attempt that fails while the consumer stops is neither retried nor dead-lettered:
        its entry stays pending for the next owner, and the stop is prompt (a retry that found
        the fence fallen once spun in place without yielding, hanging the event loop)."""
        r = backend.redis
        bus = backend.bus(shards=1)
        started: list[int] = []
        gate = anyio.Event()

        @bus.subscriber("orders", group="billing")
        async def failing(event: Tick) -> None:
            started.append(event.seq)
            await gate.wait()
            raise RuntimeError("not today")

        await bus.publish("orders", Tick(resource="r", seq=0), resource_id="r")
        with anyio.fail_after(10):
            async with running(bus) as [run]:
                await wait_until(lambda: started == [0])
                run.stop()
                gate.set()  # fails while stopping
        assert started == [0]
        assert await total_pending(bus, "orders", "billing", r) == 1
        assert await r.xlen(bus.keys.dead_letter("orders", "billing")) == 0

    async def test_sync_handler_runs_in_a_worker_thread(self, backend: Backend) -> None:
        r = backend.redis
        bus = backend.bus(shards=2)
        seen: list[tuple[int, bool]] = []
        lock = threading.Lock()

        @bus.subscriber("orders", group="legacy")
        def handle(event: Tick) -> None:  # plain def, no context
            with lock:
                seen.append((event.seq, threading.current_thread() is threading.main_thread()))

        await bus.publish_many("orders", [("a", Tick(resource="a", seq=i)) for i in range(4)])
        async with running(bus):
            await wait_until(lambda: len(seen) == 4)
            await wait_until(lambda: no_pending(bus, "orders", "legacy", r))
        assert seen == [(0, False), (1, False), (2, False), (3, False)]

    async def test_two_groups_each_get_every_event(self, backend: Backend) -> None:
        bus = backend.bus(shards=2)
        recs = {"billing": Recorder(), "audit": Recorder()}

        @bus.subscriber("orders", group="billing")
        async def billing(event: Tick, ctx: Context) -> None:
            recs["billing"].add(event, ctx)

        @bus.subscriber("orders", group="audit")
        async def audit(event: Tick, ctx: Context) -> None:
            recs["audit"].add(event, ctx)

        await bus.publish_many(
            "orders", [(f"r{i % 3}", Tick(resource=f"r{i % 3}", seq=i)) for i in range(9)]
        )
        async with running(bus):
            for rec in recs.values():
                await rec.wait_for(9)
        for rec in recs.values():
            assert rec.by_resource() == {"r0": [0, 3, 6], "r1": [1, 4, 7], "r2": [2, 5, 8]}

    async def test_in_flight_cap_and_concurrency_limit(self, backend: Backend) -> None:
        r = backend.redis
        """With `max_in_flight` 6 the consumer stops reading once 6 entries are unfinished; with
        `concurrency` 2 at most two handlers run at once."""
        bus = backend.bus(shards=1, max_in_flight=6, read_count=3, concurrency=2)
        gate = anyio.Event()
        running_now = 0
        most = 0
        handled: list[int] = []

        @bus.subscriber("capped", group="g")
        async def handle(event: Tick) -> None:
            nonlocal running_now, most
            running_now += 1
            most = max(most, running_now)
            try:
                await gate.wait()
                handled.append(event.seq)
            finally:
                running_now -= 1

        await bus.publish_many(
            "capped", [(f"r{i}", Tick(resource=f"r{i}", seq=i)) for i in range(30)]
        )
        stream = bus.keys.stream("capped", 0)
        async with running(bus):
            await wait_until(lambda: pending_is(r, stream, 6))
            await wait_until(lambda: running_now == 2)
            assert await group_lag(r, stream, "g") == 24  # no more read while 6 are unfinished
            gate.set()
            await wait_until(lambda: len(handled) == 30)
            await wait_until(lambda: no_pending(bus, "capped", "g", r))
        assert most == 2
        assert sorted(handled) == list(range(30))

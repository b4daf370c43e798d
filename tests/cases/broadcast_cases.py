"""Broadcast subscribers, as test cases run on fakeredis and on a real redis-server
(`cases.backends`): every running instance gets every event, in order per resource within the
instance, beside a group subscriber whose events each go to one instance; nothing of a broadcast
subscriber stays in Redis (no group, no lock); an instance gets only what is published while it
runs; a failing handler is retried, then dropped (no dead-letter stream)."""

from __future__ import annotations

import logging
from collections import defaultdict
from typing import Any

import anyio
import pytest
from cases.backends import Backend
from redis.exceptions import ResponseError
from support import Tick, running, wait_until

from eventbus import Context, EventBus
from eventbus.consumer.broadcast_gaps import Gaps
from eventbus.dlq import DROP, UNPARK, control_entry
from eventbus.ops.metrics import METRICS


def _instance(backend: Backend, seen: dict[str, list[tuple[str, int]]], name: str) -> EventBus:
    bus = backend.bus(shards=4)

    @bus.subscriber("config", broadcast=True)
    async def reload(event: Tick, ctx: Context) -> None:
        assert ctx.fencing_token == 0 and ctx.group == "_broadcast"
        seen[name].append((event.resource, event.seq))

    @bus.subscriber("config", group="audit")
    async def audit(event: Tick) -> None:
        seen["audit"].append((event.resource, event.seq))

    return bus


class BroadcastCases:
    pytestmark = pytest.mark.anyio

    async def test_every_instance_gets_every_event(self, backend: Backend) -> None:
        seen: dict[str, list[tuple[str, int]]] = defaultdict(list)
        a, b = _instance(backend, seen, "a"), _instance(backend, seen, "b")
        events = [(f"r{i % 5}", Tick(resource=f"r{i % 5}", seq=i)) for i in range(40)]
        async with running(a, b) as [run_a, run_b]:
            await a.publish_many("config", events)
            await run_a.drain()
            await run_b.drain()
            await wait_until(lambda: len(seen["audit"]) == 40)
        expected = [(rid, e.seq) for rid, e in events]
        for name in ("a", "b"):
            assert sorted(seen[name]) == sorted(expected)  # each instance: all of them, once
            for rid in {r for r, _ in expected}:  # in publish order per resource
                mine = [s for r, s in seen[name] if r == rid]
                assert mine == sorted(mine)
        assert sorted(seen["audit"]) == sorted(expected)  # the group: each event once in all
        # nothing of the broadcast subscriber in Redis: its group name is not a Redis group
        for shard in range(4):
            stream = a.keys.stream("config", shard)
            groups = [g["name"] for g in await backend.redis.xinfo_groups(stream)]
            assert groups in ([b"audit"], ["audit"])
        assert not [k for k in await backend.redis.keys("*_broadcast*")]

    async def test_an_instance_gets_only_what_is_published_while_it_runs(
        self, backend: Backend
    ) -> None:
        seen: dict[str, list[tuple[str, int]]] = defaultdict(list)
        bus = _instance(backend, seen, "late")
        await bus.publish("config", Tick(resource="r", seq=0), resource_id="r")  # before it ran
        async with running(bus) as [run]:
            await bus.publish("config", Tick(resource="r", seq=1), resource_id="r")
            await run.drain()
        assert seen["late"] == [("r", 1)]
        assert sorted(seen["audit"]) == [("r", 0), ("r", 1)]  # a group starts at the beginning

    async def test_a_failing_handler_is_retried_then_dropped(
        self, backend: Backend, caplog: pytest.LogCaptureFixture
    ) -> None:
        bus = backend.bus(shards=1, max_attempts=3)
        attempts: list[tuple[int, int]] = []

        @bus.subscriber("config", broadcast=True)
        async def reload(event: Tick, ctx: Context) -> None:
            attempts.append((event.seq, ctx.attempt))
            if event.seq == 0:
                raise RuntimeError("cannot reload")

        with caplog.at_level(logging.WARNING, logger="eventbus.consumer"):
            async with running(bus) as [run]:
                await bus.publish("config", Tick(resource="r", seq=0), resource_id="r")
                await bus.publish("config", Tick(resource="r", seq=1), resource_id="r")
                await run.drain()
        assert attempts == [(0, 1), (0, 2), (0, 3), (1, 1)]  # its next event waited
        dropped = [r for r in caplog.records if r.getMessage().endswith("; dropped")]
        assert len(dropped) == 1 and dropped[0].levelno == logging.ERROR
        assert dropped[0].exc_info is not None
        assert bus.consumers[0].dropped == 1  # type: ignore[union-attr]
        assert await backend.redis.keys("*dlq*") == []

    async def test_a_long_read_is_handled_whole_however_slow_the_handler(
        self, backend: Backend
    ) -> None:
        """The handling of one read was bounded by `shutdown_grace_s` (with no
        shutdown under way) after the read position had moved: 40 events of one resource at
        20 ms each, grace 0.3 s, and about 25 of them were dropped without a word."""
        bus = backend.bus(shards=1, shutdown_grace_s=0.3)
        seen: list[int] = []

        @bus.subscriber("config", broadcast=True)
        async def reload(event: Tick) -> None:
            await anyio.sleep(0.02)
            seen.append(event.seq)

        async with running(bus) as [run]:
            await bus.publish_many("config", [("r", Tick(resource="r", seq=i)) for i in range(40)])
            await run.drain()
        assert seen == list(range(40))
        assert bus.consumers[0].dropped == 0  # type: ignore[union-attr]

    async def test_a_retry_waiting_at_shutdown_runs_at_once(self, backend: Backend) -> None:
        """A broadcast retry waited out its whole delay on shutdown (its wait
        did not wake on stop), so an event whose retry was due after `shutdown_grace_s` was
        dropped; now the wait ends on stop and the retry runs within the grace."""
        bus = backend.bus(
            shards=1, max_attempts=2, retry_base_s=3600, retry_max_s=3600, shutdown_grace_s=30
        )
        attempts: list[int] = []
        failed = anyio.Event()

        @bus.subscriber("config", broadcast=True)
        async def reload(event: Tick, ctx: Context) -> None:
            attempts.append(ctx.attempt)
            if ctx.attempt == 1:
                failed.set()
                raise RuntimeError("not yet")

        with anyio.fail_after(20):  # the old wait: an hour, cut by the 30 s grace
            async with running(bus):
                await bus.publish("config", Tick(resource="r", seq=0), resource_id="r")
                await failed.wait()
        assert attempts == [1, 2]
        assert bus.consumers[0].dropped == 0  # type: ignore[union-attr]

    async def test_control_entries_never_reach_a_catch_all_handler(self, backend: Backend) -> None:
        """A broadcast ``dict`` catch-all handler was handed the operator's
        control entries (``__eventbus.drop``/``unpark``), which no group handler ever sees."""
        bus = backend.bus(shards=1)
        seen: list[str] = []

        @bus.subscriber("config", broadcast=True)
        async def anything(event: dict[str, Any], ctx: Context) -> None:
            seen.append(ctx.event_type)

        async with running(bus) as [run]:
            stream = bus.keys.stream("config", 0)
            await backend.redis.xadd(stream, control_entry(DROP, "r", "g"))
            await backend.redis.xadd(stream, control_entry(UNPARK, "r", "g"))
            await bus.publish("config", Tick(resource="r", seq=1), resource_id="r")
            await run.drain()
        assert seen == ["Tick"]

    async def test_entries_trimmed_before_an_instance_read_them_are_told(
        self, backend: Backend, caplog: pytest.LogCaptureFixture
    ) -> None:
        """An instance behind the stream's cap read on from the new head, and the
        trimmed entries never reached it without a word. Now they are logged at ERROR with
        their count and counted in ``eventbus_trimmed_unread_total`` (group ``_broadcast``)."""
        bus = backend.bus(shards=1, max_in_flight=1)
        bus.topic("capped", maxlen=100)
        gate = anyio.Event()
        seen: list[int] = []

        @bus.subscriber("capped", broadcast=True)
        async def reload(event: Tick) -> None:
            seen.append(event.seq)
            await gate.wait()

        trimmed = METRICS.trimmed_unread.labels("capped", "_broadcast")
        before = trimmed._value.get()
        with caplog.at_level(logging.INFO, logger="eventbus.consumer"):
            async with running(bus) as [run]:
                await bus.publish("capped", Tick(resource="r", seq=0), resource_id="r")
                await wait_until(lambda: seen == [0])  # read, held: the instance is behind
                events = [("r", Tick(resource="r", seq=i)) for i in range(1, 1001)]
                await bus.publish_many("capped", events)  # the cap trims most of them
                gate.set()
                await run.drain()
        missed = 1001 - len(seen)
        assert missed >= 800 and seen[1:] == list(range(missed + 1, 1001))  # the newest ones
        told = [r for r in caplog.records if "trimmed before it read them" in r.getMessage()]
        assert [r.levelno for r in told] == [logging.ERROR]
        assert f": {missed} entries of topic capped shard 0 " in told[0].getMessage()
        assert trimmed._value.get() - before == missed

    async def test_a_caught_up_instance_is_told_of_no_trim(
        self, backend: Backend, caplog: pytest.LogCaptureFixture
    ) -> None:
        """The cap trims only entries the instance read: nothing is reported, however often
        it checks (at every read here, and once more at stop)."""
        bus = backend.bus(shards=1, trim_check_s=0.001)
        bus.topic("capped", maxlen=10)
        seen: list[int] = []

        @bus.subscriber("capped", broadcast=True)
        async def reload(event: Tick) -> None:
            seen.append(event.seq)

        with caplog.at_level(logging.INFO, logger="eventbus.consumer"):
            async with running(bus) as [run]:
                for i in range(0, 150, 5):  # past one stream node (100): read ones trimmed
                    events = [("r", Tick(resource="r", seq=n)) for n in range(i, i + 5)]
                    await bus.publish_many("capped", events)
                    await run.drain()
        assert seen == list(range(150))
        assert await backend.redis.xlen(bus.keys.stream("capped", 0)) < 150
        assert not [r for r in caplog.records if "trimmed" in r.getMessage()]
        assert bus.consumers[0].gaps.lost == {bus.keys.stream("capped", 0): 0}  # type: ignore[union-attr]

    async def test_gaps_count_what_was_trimmed_unread_ahead_or_read_past(
        self, backend: Backend
    ) -> None:
        """`Gaps.check` on a stream trimmed exactly: entries trimmed ahead of the position
        (the stream's first entry after it), then entries a read jumped over (the position
        inside the stream again: counted with XRANGE); each reported once."""
        r = backend.redis
        stream = "gaps-stream"
        gaps = Gaps("me", "t", "_broadcast", {stream: 0})
        ids = [await r.xadd(stream, {"n": str(n)}) for n in range(5)]
        gaps.start(stream, await r.xinfo_stream(stream))
        ids += [await r.xadd(stream, {"n": str(n)}) for n in range(5, 15)]
        gaps.count_read(stream, 3)  # read the 6th to 8th
        await r.xtrim(stream, maxlen=5, approximate=False)  # the 9th and 10th unread, gone
        assert await gaps.check(r, {stream: ids[7]}, [stream]) == 2  # ahead
        gaps.count_read(stream, 3)  # read on: the 11th to 13th
        assert await gaps.check(r, {stream: ids[12]}, [stream]) == 0  # told already
        ids += [await r.xadd(stream, {"n": str(n)}) for n in range(15, 25)]
        await r.xtrim(stream, maxlen=5, approximate=False)  # the 14th to 20th unread, gone
        gaps.count_read(stream, 2)  # a read from the 13th jumped to the 21st and 22nd
        assert await gaps.check(r, {stream: ids[21]}, [stream]) == 7  # read past them
        assert await gaps.check(r, {stream: ids[21]}, [stream]) == 0
        assert gaps.lost == {stream: 9}
        missing = "gaps-missing"
        gaps = Gaps("me", "t", "_broadcast", {missing: 1})
        gaps.start(missing, ResponseError("no such key"))  # created after the start
        await r.xadd(missing, {"n": "0"})
        assert await gaps.check(r, {missing: b"0-0"}, [missing]) == 0
        await r.set("gaps-wrong", "x")  # any other error reply is raised, not skipped
        with pytest.raises(ResponseError, match="WRONGTYPE"):
            await Gaps("me", "t", "_broadcast", {}).check(r, {"gaps-wrong": b"0-0"}, ["gaps-wrong"])

    async def test_a_dedup_window_is_each_instances_own(self, backend: Backend) -> None:
        """The de-duplication marks were keyed by the subscription's name
        (``_broadcast``), shared by every instance, so an instance could skip an event another
        had handled. Each instance keeps its own window: a re-published copy (same event ID, an
        ambiguous publish retried) is skipped by each instance once, and both handle the
        event."""
        handled: dict[str, list[int]] = defaultdict(list)
        instances = []
        for name in ("a", "b"):
            bus = backend.bus(shards=1)

            def subscribe(bus: EventBus, name: str) -> None:
                @bus.subscriber("config", broadcast=True, dedup_window_s=60)
                async def reload(event: Tick) -> None:
                    handled[name].append(event.seq)

            subscribe(bus, name)
            instances.append(bus)
        a, b = instances
        async with running(a, b) as runs:
            await a.publish("config", Tick(resource="r", seq=1), resource_id="r")
            stream = a.keys.stream("config", 0)
            ((_, fields),) = await backend.redis.xrange(stream)
            await backend.redis.xadd(stream, fields)  # the same event again: a retried publish
            for run in runs:
                await run.drain()
        assert handled == {"a": [1], "b": [1]}
        assert [bus.consumers[0].tally.duplicates_skipped for bus in instances] == [1, 1]
        owners = {c.handling.dedup.owner for bus in instances for c in bus.consumers}  # type: ignore[union-attr]
        assert len(owners) == 2 and all(o.startswith("_broadcast@") for o in owners)

    async def test_broadcast_takes_no_group_name_of_its_own(self, backend: Backend) -> None:
        bus = backend.bus()

        async def h(event: Tick) -> None: ...

        bus.subscriber("config", broadcast=True)(h)
        bus.subscriber("config", group="cache", broadcast=True)(h)  # a separate broadcast one
        assert [s.group for s in bus.subscriptions] == ["_broadcast", "_broadcast.cache"]
        with pytest.raises(Exception, match="give a group"):
            bus.subscriber("config")(h)

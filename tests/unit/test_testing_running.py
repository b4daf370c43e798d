"""`eventbus.testing.running` outside the pytest plugin: what the block raises is raised as itself,
not wrapped in an `ExceptionGroup` by the task group that runs the subscribers; the stop ends the
consumers' blocking reads at once and loses or repeats nothing; a drain right after the start
waits for a chain of handlers; topics declared without a shard count run on `MEMORY_SHARDS` in
memory."""

from __future__ import annotations

import hashlib

import anyio
import pytest
from pydantic import BaseModel

from eventbus import Context, EventBus
from eventbus.locking import scripts
from eventbus.testing import running
from eventbus.testing.memory import (
    LOCK_SCRIPTS,
    MEMORY_SHARDS,
    load_lock_scripts,
    memory_redis,
    unblock_reads_at_stop,
)

pytestmark = pytest.mark.anyio


class Ping(BaseModel):
    n: int


def _bus() -> EventBus:
    bus = EventBus()

    @bus.subscriber("pings", group="g")
    async def handle(event: Ping) -> None:
        pass

    return bus


async def test_an_assertion_in_the_block_is_raised_as_itself() -> None:
    with pytest.raises(AssertionError, match="the test's own check"):
        async with running(_bus()) as tb:
            await tb.bus.publish("pings", Ping(n=1), resource_id="a")
            await tb.drain()
            raise AssertionError("the test's own check")


async def test_an_error_in_the_block_keeps_its_type_and_cause() -> None:
    with pytest.raises(KeyError) as caught:
        async with running(_bus()):
            try:
                {}["missing"]
            except KeyError as exc:
                raise KeyError("looked up") from exc
    assert isinstance(caught.value.__cause__, KeyError)


async def test_the_block_ends_normally_without_an_error() -> None:
    async with running(_bus()) as tb:
        await tb.bus.publish("pings", Ping(n=1), resource_id="a")
        await tb.drain()
    assert [h.event for h in tb.handled] == [Ping(n=1)]


async def test_the_stop_ends_reads_that_would_block_for_ever() -> None:
    r = memory_redis()
    await r.xgroup_create("s", "g", id="0", mkstream=True)
    stop, done = anyio.Event(), anyio.Event()
    got: list[object] = []

    async def read() -> None:  # BLOCK 0: no entry will come, only the stop ends it
        got.append(await r.xreadgroup("g", "c", {"s": ">"}, count=10, block=0))
        done.set()

    with anyio.fail_after(10):  # (a hang guard, not a timing assertion)
        async with anyio.create_task_group() as tg:
            tg.start_soon(read)
            tg.start_soon(unblock_reads_at_stop, r, stop, done)
            await anyio.wait_all_tasks_blocked()
            stop.set()

    assert got == [[]]


async def test_a_drain_right_after_the_start_sees_a_chain_handled() -> None:
    bus = EventBus()

    @bus.subscriber("orders", group="billing")
    async def bill(event: Ping, ctx: Context) -> None:
        await ctx.publish("invoices", Ping(n=event.n + 1), resource_id=ctx.resource_id)

    @bus.subscriber("invoices", group="mailer")
    async def mail(event: Ping) -> None:
        pass

    async with running(bus, fail_fast=True) as tb:
        await tb.publish("orders", Ping(n=1), resource_id="o-1")
        await tb.drain()
        assert tb.events("orders") == [Ping(n=1)]
        assert tb.events("invoices") == [Ping(n=2)]


async def test_entries_left_at_the_stop_are_handled_once_by_the_next_run() -> None:
    seen: list[int] = []
    bus = EventBus()

    @bus.subscriber("pings", group="g")
    async def handle(event: Ping) -> None:
        seen.append(event.n)

    async with running(bus) as tb:
        for n in range(60):  # no drain: the stop comes while they are read and handled
            await tb.publish("pings", Ping(n=n), resource_id=f"r{n % 7}")
    async with running(bus, redis=tb.redis) as again:  # the same server: what was left
        await again.drain()

    assert sorted(seen) == list(range(60))  # none lost, none handled twice


async def test_the_lock_scripts_are_loaded_into_a_fresh_server_at_once() -> None:
    r = memory_redis()
    shas = [hashlib.sha1(scripts.source(n).encode()).hexdigest() for n in LOCK_SCRIPTS]
    assert await r.script_exists(*shas) == [False] * len(shas)

    await load_lock_scripts(r)

    assert await r.script_exists(*shas) == [True] * len(shas)


async def test_topics_declared_without_a_shard_count_run_on_memory_shards() -> None:
    bus = _bus()  # "pings": no shard count
    bus.topic("wide", shards=8)

    async with running(bus) as tb:
        assert bus.topic("pings").shards == MEMORY_SHARDS
        assert bus.topic("wide").shards == 8  # a count the code chose is kept
        for n in range(40):
            await tb.publish("pings", Ping(n=n), resource_id=f"r{n}")
        await tb.drain()
        streams = {key.decode() async for key in tb.redis.scan_iter(match="*pings*")}
        shard_streams = {bus.keys.stream("pings", s) for s in range(16)} & streams
        assert shard_streams == {bus.keys.stream("pings", s) for s in range(MEMORY_SHARDS)}
    # the run ends, and the bus declares what it declared
    assert bus.topic("pings").shards == 16


async def test_a_memory_server_run_again_keeps_the_shard_count_it_registered() -> None:
    bus = _bus()
    async with running(bus) as tb:
        await tb.publish("pings", Ping(n=1), resource_id="a")
    async with running(bus, redis=tb.redis) as again:  # no ShardCountMismatch
        await again.publish("pings", Ping(n=2), resource_id="b")
        await again.drain()
        assert bus.topic("pings").shards == MEMORY_SHARDS


async def test_a_shard_count_the_settings_set_is_kept_in_memory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("EVENTBUS_SHARDS", "4")
    bus = _bus()
    async with running(bus) as tb:
        await tb.publish("pings", Ping(n=1), resource_id="a")
        await tb.drain()
        assert bus.topic("pings").shards == 4

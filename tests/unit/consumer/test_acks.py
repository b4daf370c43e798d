"""Acks and in-flight accounting (`eventbus.consumer.acks.Acks`) with a tiny fake pipeline that
records every XACK and can fail or hold a send: no Redis."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import anyio.lowlevel
import pytest
from redis.backoff import ConstantBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError

from eventbus.config import Settings
from eventbus.consumer.acks import Acks
from eventbus.consumer.shards import HeldShard, Item, ShardTable, read_item
from eventbus.locking.lease import Lease
from eventbus.locking.locks import Grant, LockState
from eventbus.locking.member import Member
from eventbus.profiles import EVENTBUS
from eventbus.protocol.keys import Keys

pytestmark = pytest.mark.anyio


class FakeRedis:
    """`pipeline().execute_command("XACK", ...)`/`execute()`: records each executed pipeline as
    a list of
    (stream, ids); `fail` errors fail the next sends; `gate`, when set, holds a send until it is
    set (to queue acks while a send is on its way)."""

    def __init__(self) -> None:
        self.sent: list[list[tuple[str, list[bytes]]]] = []
        self.attempts: list[list[tuple[str, list[bytes]]]] = []
        self.fail: list[Exception] = []
        self.gate: anyio.Event | None = None
        self.sending = anyio.Event()
        self.changed = anyio.Event()

    def pipeline(self, transaction: bool = True) -> FakePipeline:
        return FakePipeline(self)

    def _note(self) -> None:
        self.changed.set()
        self.changed = anyio.Event()


class FakePipeline:
    def __init__(self, redis: FakeRedis) -> None:
        self.redis = redis
        self.calls: list[tuple[str, list[bytes]]] = []

    def execute_command(self, name: str, stream: str, group: str, *ids: bytes) -> None:
        assert (name, group) == ("XACK", "g")
        self.calls.append((stream, list(ids)))

    async def execute(self, raise_on_error: bool = True) -> list[Any]:
        self.redis.attempts.append(self.calls)
        self.redis.sending.set()
        if self.redis.gate is not None:
            await self.redis.gate.wait()
        try:
            if self.redis.fail:
                exc = self.redis.fail.pop(0)
                if isinstance(exc, ResponseError) and not raise_on_error:  # as redis-py does
                    return [exc for _ in self.calls]
                raise exc
            self.redis.sent.append(self.calls)
            return [len(ids) for _, ids in self.calls]
        finally:
            self.redis._note()


def setup(
    *, noack: bool = False, max_in_flight: int = 100, lease_ok: bool = True
) -> tuple[Acks, FakeRedis, ShardTable, Lease]:
    redis = FakeRedis()
    table = ShardTable(["s:0", "s:1"])
    table.apply({0: Grant(0, 1, LockState.TAKEN_FREE), 1: Grant(1, 1, LockState.TAKEN_FREE)})
    lease = Lease(lease_s=60.0)
    if lease_ok:
        lease.renew(time.monotonic())
    member = Member(redis, Keys(), Settings(max_in_flight=max_in_flight), "t", "g", "c", EVENTBUS)
    acks = Acks(member, table, lease, noack=noack, backoff=ConstantBackoff(0))
    return acks, redis, table, lease


def read(acks: Acks, held: HeldShard, *ids: int) -> list[Item]:
    """Items as the queues make them, each counted as started."""
    items = []
    for n in ids:
        items.append(read_item(held, f"{n}-0".encode(), {}))
        acks.started(held)
    return items


@asynccontextmanager
async def ack_loop(acks: Acks) -> AsyncIterator[None]:
    async with anyio.create_task_group() as tg:
        tg.start_soon(acks.loop)
        yield
        tg.cancel_scope.cancel()


async def until(redis: FakeRedis, predicate: Any) -> None:
    with anyio.fail_after(5):
        while not predicate():
            await redis.changed.wait()


async def test_in_flight_counts_per_shard_and_in_all() -> None:
    acks, _, table, _ = setup()
    h0, h1 = table.held[0], table.held[1]
    items = read(acks, h0, 1, 2) + read(acks, h1, 3)
    assert (acks.in_flight, h0.in_flight, h1.in_flight) == (3, 2, 1)
    acks.finish(items[0])
    assert (acks.in_flight, h0.in_flight, h1.in_flight) == (2, 1, 1)


async def test_capacity_wakes_when_in_flight_falls_back_under_the_cap() -> None:
    acks, _, table, _ = setup(max_in_flight=2)
    items = read(acks, table.held[0], 1, 2)
    woke: list[int] = []

    async def waiter() -> None:
        await table.changed()
        woke.append(acks.in_flight)

    async with anyio.create_task_group() as tg:
        tg.start_soon(waiter)
        await anyio.lowlevel.checkpoint()
        assert woke == []
        acks.finish(items[0])
    assert woke == [1]


async def test_capacity_wakes_when_a_shard_falls_back_to_its_read_ahead_room() -> None:
    # the per-shard bound (`Pipeline.shard_room`): a shard with more than `shard_room` entries
    # in flight is not read; the read loop waits until one has room again
    acks, _, table, _ = setup(max_in_flight=100)
    acks.shard_room = 1
    held = table.held[0]
    items = read(acks, held, 1, 2, 3)
    woke: list[int] = []

    async def waiter() -> None:
        await table.changed()
        woke.append(held.in_flight)

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(waiter)
            await anyio.lowlevel.checkpoint()
            acks.finish(items[0])  # 2 in flight: still above the room
            await anyio.lowlevel.checkpoint()
            assert woke == []
            acks.finish(items[1])  # 1: readable again
    assert woke == [1]
    assert table.readable(acks.shard_room) == table.readable()


async def test_idle_wakes_when_nothing_is_in_flight() -> None:
    acks, _, table, _ = setup()
    items = read(acks, table.held[0], 1, 2)
    done = anyio.Event()

    async def waiter() -> None:
        await acks.wait_idle()
        done.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(waiter)
        acks.finish(items[0])
        await anyio.lowlevel.checkpoint()
        assert not done.is_set()
        acks.finish(items[1])
    assert acks.in_flight == 0


async def test_acks_are_batched_per_stream_in_one_pipeline() -> None:
    acks, redis, table, _ = setup()
    items = read(acks, table.held[0], 1, 2) + read(acks, table.held[1], 3)
    for item in items:
        acks.ack(item)
    async with ack_loop(acks):
        await until(redis, lambda: acks.in_flight == 0)
    assert redis.sent == [[("s:0", [b"1-0", b"2-0"]), ("s:1", [b"3-0"])]]
    assert table.held[0].in_flight == table.held[1].in_flight == 0


async def test_noack_finishes_at_once_without_xack() -> None:
    acks, redis, table, _ = setup(noack=True)
    (item,) = read(acks, table.held[0], 1)
    acks.ack(item)
    assert acks.in_flight == 0
    async with ack_loop(acks):
        await anyio.lowlevel.checkpoint()
    assert redis.attempts == []


async def test_ack_of_a_lost_or_re_taken_shard_is_dropped_unsent() -> None:
    acks, redis, table, _ = setup()
    (old,) = read(acks, table.held[0], 1)
    (gone,) = read(acks, table.held[1], 2)
    table.apply({0: Grant(0, 2, LockState.TAKEN_FROM_DEAD)})  # 0 re-taken, 1 lost
    acks.ack(old)
    acks.ack(gone)
    assert acks.in_flight == 0  # finished: the entries stay pending for the owner
    async with ack_loop(acks):
        await anyio.lowlevel.checkpoint()
    assert redis.attempts == []


async def test_acks_wait_for_the_lease() -> None:
    acks, redis, table, lease = setup(lease_ok=False)
    (item,) = read(acks, table.held[0], 1)
    acks.ack(item)
    async with ack_loop(acks):
        for _ in range(10):
            await anyio.lowlevel.checkpoint()
        assert redis.attempts == []  # no XACK without a lease
        lease.renew(time.monotonic())
        await until(redis, lambda: acks.in_flight == 0)
    assert redis.sent == [[("s:0", [b"1-0"])]]


async def test_failed_xack_is_put_back_ahead_of_newer_acks() -> None:
    acks, redis, table, _ = setup()
    h0 = table.held[0]
    first = read(acks, h0, 1, 2)
    later = read(acks, h0, 3)
    redis.fail = [RedisConnectionError("gone")]
    redis.gate = anyio.Event()
    for item in first:
        acks.ack(item)
    async with ack_loop(acks):
        with anyio.fail_after(5):
            await redis.sending.wait()
        acks.ack(later[0])  # queued while the failing send is on its way
        redis.gate.set()
        await until(redis, lambda: acks.in_flight == 0)
    assert redis.attempts == [[("s:0", [b"1-0", b"2-0"])], [("s:0", [b"1-0", b"2-0", b"3-0"])]]
    assert redis.sent == redis.attempts[1:]


async def test_failed_batch_of_a_shard_re_taken_meanwhile_is_dropped() -> None:
    acks, redis, table, _ = setup()
    (old,) = read(acks, table.held[0], 1)
    redis.fail = [RedisConnectionError("gone")]
    redis.gate = anyio.Event()
    acks.ack(old)
    async with ack_loop(acks):
        with anyio.fail_after(5):
            await redis.sending.wait()
        table.apply({0: Grant(0, 2, LockState.TAKEN_FROM_DEAD)})  # re-taken under a new token
        (new,) = read(acks, table.held[0], 2)
        acks.ack(new)
        redis.gate.set()
        await until(redis, lambda: acks.in_flight == 0)
    # the old generation's ack is never sent again; the new one is
    assert redis.sent == [[("s:0", [b"2-0"])]]


async def test_an_older_generation_batch_still_queued_is_settled_by_a_newer_ack() -> None:
    acks, redis, table, _ = setup()
    (old,) = read(acks, table.held[0], 1)
    acks.ack(old)  # queued, not sent yet (no loop)
    table.apply({0: Grant(0, 2, LockState.TAKEN_FROM_DEAD)})
    (new,) = read(acks, table.held[0], 2)
    acks.ack(new)
    assert acks.in_flight == 1  # the old one is finished, unsent
    async with ack_loop(acks):
        await until(redis, lambda: acks.in_flight == 0)
    assert redis.sent == [[("s:0", [b"2-0"])]]


async def test_shutdown_report_tells_running_handlers_from_unconfirmed_acks(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A slow handler at shutdown was reported as "Redis unreachable?". Of 5
    entries in flight, 2 are handled with their XACK on its way (held by the gate), 1 handled
    with its XACK queued, 2 not handled yet (of them, a handler call is running): the report
    counts each, and the handler calls running apart."""
    acks, redis, table, _ = setup()
    items = read(acks, table.held[0], 1, 2, 3, 4, 5)
    redis.gate = anyio.Event()  # the first XACK pipeline never gets its reply
    acks.ack(items[0])
    acks.ack(items[1])
    async with ack_loop(acks):
        with anyio.fail_after(5):
            await redis.sending.wait()
        acks.ack(items[2])
        await acks.drain(0.05, running=lambda: 1)
    (record,) = [r for r in caplog.records if "shutdown" in r.getMessage()]
    assert "5 entries unfinished" in record.getMessage()
    assert (
        "2 not handled yet, 3 handled but their XACKs not confirmed by Redis (1 handler calls "
        "still running); they stay pending"
    ) in record.getMessage()
    assert "still in their handlers" not in record.getMessage()

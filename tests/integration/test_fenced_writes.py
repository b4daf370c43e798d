"""A consumer's fenced writes to the parked hash (``lua/fenced_hash.lua``), on a real
redis-server: consumers driven round by round by the test (no read loop, no heartbeats), the
lock moved on in Redis as after a pause past the liveness TTL; and a consumer stopped between
its dead letter and its park, which parks nothing once another consumer took the shard."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import anyio
import pytest
import redis.asyncio
from support import Tick, running, wait_until

from eventbus import EventBus, Settings
from eventbus.consumer.engine import Consumer
from eventbus.errors import ConfigError
from eventbus.locking.member import Member
from eventbus.profiles import EVENTBUS, VERSE

pytestmark = [pytest.mark.anyio, pytest.mark.integration]


def _failing_bus(s: Settings, **bus: Any) -> EventBus:
    """A bus whose subscriber of topic "t", group "g" fails every event once and parks."""
    b = EventBus(s, **bus)

    @b.subscriber("t", group="g", on_failure="park", max_attempts=1)
    async def fails(event: Tick) -> None:
        raise RuntimeError(f"cannot handle {event.resource}:{event.seq}")

    return b


async def _driven(bus: EventBus, s: Settings, member_id: str) -> Consumer:
    """A `Consumer` of `bus`'s subscription under `member_id`, with the bus's profile."""
    await bus.registry.ensure(bus.subscriptions[0].topic)
    member = Member(bus.redis, bus.keys, s, "t", "g", member_id, bus.profile)
    return Consumer(member, bus.registry, bus.subscriptions[0])


async def _work(c: Consumer) -> None:
    """Run one worker and the acks of `c` until every entry it read is finished (acked or
    let go)."""
    async with anyio.create_task_group() as tg:
        tg.start_soon(c.pipeline.acks.loop)
        tg.start_soon(c.pipeline.worker, tg)
        while c.in_flight:
            await c.pipeline.acks.wait_idle()
        tg.cancel_scope.cancel()


async def _park_after_the_lock_moved_on(bus: EventBus, s: Settings, r: Any) -> Consumer:
    """Consumer C locks shard 0 and reads x:1; then C's liveness lapses in Redis (a pause past
    the TTL; C's own lease still looks valid) and consumer D takes the shard. C's handler fails
    x:1 and C parks x. Returns C, its shard table as the park left it."""
    c = await _driven(bus, s, "consumer-c")
    d = await _driven(bus, s, "consumer-d")
    await r.xgroup_create(bus.keys.stream("t", 0), "g", id="0", mkstream=True)
    await bus.publish("t", Tick(resource="x", seq=1), resource_id="x")
    assert await c.pipeline.round(1) and c.in_flight == 1  # shard 0 locked, x:1 read
    await r.zrem(bus.keys.members("t", "g"), "consumer-c")
    await d.ownership.lock_round(d.pipeline)
    assert list(d.ownership.table.held) == [0]
    await _work(c)  # x:1 fails; C dead-letters it and parks x
    return c


@pytest.mark.single_node("one shard; the interleaving is the same")
async def test_a_refused_park_drops_the_shard_at_once(
    settings: Callable[..., Settings], r: redis.asyncio.Redis
) -> None:
    """Redis refused C's park (the lock moved on). C used to keep the shard until
    its next lock round (here a minute away) and read the shard's next entries into its PEL.
    Now the refusal drops the shard: nothing more of it is read by C."""
    s = settings(shards=1, lock_interval_ms=60_000)
    bus = _failing_bus(s)
    stream = bus.keys.stream("t", 0)
    try:
        c = await _park_after_the_lock_moved_on(bus, s, r)
        assert await r.hget(bus.keys.parked("t", "g"), "x") is None  # refused
        held = c.ownership.table.held
        assert held == {}, f"still held after the refusal: {sorted(held)}"
        await bus.publish("t", Tick(resource="x", seq=2), resource_id="x")
        await bus.publish("t", Tick(resource="y", seq=1), resource_id="y")
        assert not await c.pipeline.round(1)
        mine = await r.xpending_range(stream, "g", "-", "+", 10, "consumer-c")
        assert mine == [], f"C read the shard after its park was refused: {mine}"
        assert c.ownership.table.held == {}  # D holds it, live: C's lock round took nothing
    finally:
        await bus.aclose()


@pytest.mark.single_node("one shard; the interleaving is the same")
async def test_a_custom_profile_with_eventbus_locks_parks_fenced(
    settings: Callable[..., Settings], r: redis.asyncio.Redis
) -> None:
    """A profile of its own (here eventbus's, renamed) keeps its shard locks in
    eventbus's lock hash, so its parks are fenced like eventbus's. `Failures` decided by the
    profile's identity (``is EVENTBUS``) and sent a plain HSETNX: x was parked by a consumer
    whose lock had moved on."""
    s = settings(shards=1, lock_interval_ms=60_000)
    bus = _failing_bus(s, profile=replace(EVENTBUS, name="mine"))
    try:
        await _park_after_the_lock_moved_on(bus, s, r)
        parked = await r.hget(bus.keys.parked("t", "g"), "x")
        assert parked is None, f"parked, unfenced, after the lock moved on: {parked!r}"
    finally:
        await bus.aclose()


async def test_park_is_refused_for_a_profile_whose_locks_cannot_fence(
    settings: Callable[..., Settings],
) -> None:
    """A profile with eventbus's entries and Verse's shard locks (no lock hash that
    ``fenced_hash.lua`` can check) would park and unpark unfenced: its consumer refuses
    ``on_failure="park"`` with a `ConfigError` naming what is missing (it used to start, its
    writes silently unfenced)."""
    s = settings(shards=1)
    bus = _failing_bus(s, profile=replace(EVENTBUS, name="mixed", lock_client=VERSE.lock_client))
    try:
        with pytest.raises(ConfigError, match=r"on_failure='park'.*mixed profile's lock client"):
            await _driven(bus, s, "consumer-c")
    finally:
        await bus.aclose()


class _FreezeBeforePark:
    """Stands in for a consumer's Redis client in its `Failures` (every command passes through)
    but freezes the consumer's whole event loop, synchronously, right before the park's write
    (an ``HSETNX``, or the fenced script that makes it: the first of them sent): a process
    stopped (SIGSTOP, a VM freeze) between its dead-letter write and its park, as one process of
    its own would be. `resume` lets it go on; `parked` is set once the write has been
    answered."""

    def __init__(self, real: Any) -> None:
        self.real = real
        self.frozen = threading.Event()
        self.resume = threading.Event()
        self.parked = threading.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)

    def _frozen_then(self, send: Callable[[], Any]) -> Any:
        self.frozen.set()
        self.resume.wait(60)  # blocks the consumer's event loop: the whole "process" stops

        async def sent() -> Any:
            try:
                return await send()
            finally:
                self.parked.set()

        return sent()

    def hsetnx(self, *args: Any) -> Any:
        return self._frozen_then(lambda: self.real.hsetnx(*args))

    def register_script(self, text: str) -> Any:
        script = self.real.register_script(text)
        return lambda *a, **kw: self._frozen_then(lambda: script(*a, **kw))


@pytest.mark.single_node("a second event loop in a thread; the interleaving is the same")
async def test_a_consumer_that_lost_its_shard_does_not_park_the_resource(
    settings: Callable[..., Settings], r: redis.asyncio.Redis
) -> None:
    """Park (semantics.md "Park"; failures.py `dead_letter_and_park`): the HSETNX of the parked
    hash is sent, and retried, without any check of the lease or the lock acquisition (only the
    dead-letter XADD before it waits for the fence). Consumer A fails x:1 for good, writes its
    dead letter and stops (a pause past the TTL) before the HSETNX. B takes the shard, recovers
    x:1, handles it successfully, and handles x:2. A wakes: its HSETNX parks resource x in
    Redis, naming a letter of an event that was handled. B's own copy of the parked set was
    loaded when it took the lock, so B goes on; but every later owner of the shard (B after a
    restart, a scale-out, a takeover) dead-letters x's events as ``parked``, and an operator's
    requeue replays x:1 after x:2: order broken, by a consumer that held no lock any more.
    """
    s = settings(shards=1, liveness_ttl_s=1.0)  # a short TTL: A's pause outlasts it quickly
    frozen: dict[str, Any] = {}
    started_a = threading.Event()
    stop_a = threading.Event()

    async def run_a() -> None:  # consumer A, in an event loop of its own (its own "process")
        bus_a = EventBus(s)

        @bus_a.subscriber("t", group="g", on_failure="park", max_attempts=1)
        async def fails(event: Tick) -> None:
            raise RuntimeError(f"A cannot handle {event.resource}:{event.seq}")

        async with running(bus_a):
            consumer = next(c for c in bus_a.consumers if isinstance(c, Consumer))
            hook = _FreezeBeforePark(consumer.handling.failures.redis)
            consumer.handling.failures.redis = hook  # type: ignore[attr-defined]
            frozen.update(consumer=consumer, hook=hook)
            started_a.set()
            await anyio.to_thread.run_sync(stop_a.wait)

    thread = threading.Thread(target=lambda: asyncio.run(run_a()), daemon=True)
    thread.start()
    bus_b = EventBus(s)
    parked_key, stream = bus_b.keys.parked("t", "g"), bus_b.keys.stream("t", 0)
    handled_b: list[int] = []

    @bus_b.subscriber("t", group="g", on_failure="park", max_attempts=1)
    async def works(event: Tick) -> None:
        handled_b.append(event.seq)

    try:
        assert await anyio.to_thread.run_sync(started_a.wait, 20)
        hook: _FreezeBeforePark = frozen["hook"]
        await bus_b.publish("t", Tick(resource="x", seq=1), resource_id="x")
        assert await anyio.to_thread.run_sync(hook.frozen.wait, 20)  # A: letter written, frozen
        assert await r.xlen(bus_b.keys.dead_letter("t", "g")) == 1
        # A stays stopped past its lease (and Redis's TTL), as after a long pause
        await wait_until(lambda: not frozen["consumer"].lease.ok())
        async with running(bus_b):
            await wait_until(lambda: handled_b == [1])  # B took the shard, recovered x:1
            await bus_b.publish("t", Tick(resource="x", seq=2), resource_id="x")
            await wait_until(lambda: handled_b == [1, 2])
            await wait_until(lambda: _pending(r, stream, 0))
            hook.resume.set()  # A wakes up
            assert await anyio.to_thread.run_sync(hook.parked.wait, 20)
            parked = await r.hget(parked_key, "x")
    finally:
        if "hook" in frozen:
            frozen["hook"].resume.set()
        stop_a.set()
        await anyio.to_thread.run_sync(thread.join, 30)
    assert parked is None, (
        "resource x was parked (by the consumer that had lost the shard) after the shard's new "
        f"owner handled x:1 and x:2: {parked!r}"
    )


async def _pending(r: Any, stream: str, n: int) -> bool:
    return int((await r.xpending(stream, "g"))["pending"]) == n

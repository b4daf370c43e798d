"""A live consumer's catch-up from the archive, at its seams with the lock round, the trim check,
the offloader and a graceful stop: nothing the group never handled is read past, the group moves
only past entries handled, and a stop lets the next entry go.

Each test drives, against a real redis-server with events and hooks (never sleeps), a sequence
of ordinary operations that once broke a promise of docs/semantics.md or docs/tier.md; each
docstring names the promise and how it was broken.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import pytest
import redis.asyncio
from support import Tick
from tier_support import fast_tier

from eventbus import EventBus, Settings
from eventbus.consumer.engine import Consumer
from eventbus.tier.offloader import Offloader
from eventbus.tier.store import open_store

pytestmark = [pytest.mark.anyio, pytest.mark.integration]


def _recording(s: Settings, archive: Any = None, **options: Any) -> tuple[EventBus, list[int]]:
    """A bus whose subscriber of topic "t", group "g" (subscriber `options`) records the seq of
    each event handled."""
    bus = EventBus(s, archive=archive)
    seen: list[int] = []

    @bus.subscriber("t", group="g", **options)
    async def handle(event: Tick) -> None:
        seen.append(event.seq)

    return bus, seen


async def _driven(bus: EventBus, s: Settings, member_id: str = "consumer-c") -> Consumer:
    """A `Consumer` of `bus`'s subscription, its topic registered, driven round by round by
    the test (no read loop, no workers, no heartbeats)."""
    from eventbus.locking.member import Member
    from eventbus.profiles import EVENTBUS

    await bus.registry.ensure(bus.subscriptions[0].topic)
    member = Member(bus.redis, bus.keys, s, "t", "g", member_id, EVENTBUS)
    return Consumer(member, bus.registry, bus.subscriptions[0])


async def _offload(bus: EventBus, s: Settings, store: Any) -> None:
    """Archive everything in Redis and trim it (no hot window): what the offloader does to
    entries older than `hot_window_s`."""
    await Offloader(bus.redis, store, settings=s, tier=fast_tier()).run_until_caught_up(30)


def _recording_dispatch(c: Consumer) -> list[bytes]:
    """Make `c` record the entry IDs its reads queue for the workers; returns that list."""
    dispatched: list[bytes] = []
    dispatch = c.pipeline._dispatch

    def recording(held: Any, entries: Any, counts: Any) -> None:
        dispatched.extend(entry_id for entry_id, _ in entries)
        dispatch(held, entries, counts)

    c.pipeline._dispatch = recording  # type: ignore[method-assign]
    return dispatched


@pytest.mark.single_node("one shard, a consumer driven round by round; the same on a cluster")
async def test_a_held_shard_trimmed_past_a_group_the_catch_up_moved_is_caught_up(
    settings: Callable[..., Settings], r: redis.asyncio.Redis, tmp_path: Path
) -> None:
    """No loss with an archive, loss never silent (semantics.md "Stream caps"; tier.md "While a
    consumer holds a shard, its trim check ... also finds the group trimmed past its position").

    The trim check (consumer/trims.py `TrimWatch._lost`) computes the entries a group lost as
    its ``lag`` minus the entries after its last-delivered ID. The catch-up moves the group with
    ``XGROUP SETID`` without ``ENTRIESREAD`` (catchup_shard.py `tail` and `after`), so Redis
    forgets the group's ``entries-read``; once the group's position lies before the stream's
    first entry, Redis then *estimates* it as ``entries-added - length``, so ``lag`` equals the
    stream's length and the check computes 0 lost, whatever was trimmed. Scenario: consumer C
    (archive) takes shard 0, whose first entries were archived and trimmed unread: its catch-up
    handles x:0..x:4 (the group now at x:4, moved by XGROUP SETID). C holds the shard; x:5..x:7
    are published and, before C reads them (a consumer slower than the publishers for longer
    than `hot_window_s`), archived and trimmed. x:8 is published. C's next round checks the
    shard (its trim check is due), finds nothing, and reads x:8: x:5..x:7, only in the
    archive, are never handled, and no ERROR or trim record says so.
    """
    from eventbus.consumer.catchup import shard_hook

    store = open_store(str(tmp_path / "segments"))
    s = settings(shards=1, trim_check_s=0.001)  # every round checks the held shard
    bus, seen = _recording(s, store)
    stream = bus.keys.stream("t", 0)
    c = await _driven(bus, s)
    c.pipeline.catch_up = shard_hook(store, c.handling)
    await c.pipeline.reader.ensure_groups()
    try:
        for seq in range(3):  # archived and trimmed before the group read them
            await bus.publish("t", Tick(resource="x", seq=seq), resource_id="x")
        await _offload(bus, s, store)
        await c.pipeline.round(1)  # takes shard 0; its catch-up handles x:0..x:2 (SETID to x:2)
        assert list(c.ownership.table.held) == [0] and seen == [0, 1, 2]
        for seq in range(3, 8):  # C holds the shard; these leave Redis before C reads them
            await bus.publish("t", Tick(resource="x", seq=seq), resource_id="x")
        await _offload(bus, s, store)
        assert await r.xlen(stream) == 0
        x8 = await bus.publish("t", Tick(resource="x", seq=8), resource_id="x")
        dispatched = _recording_dispatch(c)
        await c.pipeline.round(1)  # trim check (due), then the read
        assert list(c.ownership.table.held) == [0]
        records = await r.xlen(bus.keys.trimmed("t", "g"))
    finally:
        await c.ownership.leave()
        await bus.aclose()
    assert x8.encode() in dispatched  # the read went on to x:8
    assert seen == [0, 1, 2, 3, 4, 5, 6, 7], (
        f"x:8 was read although x:3..x:7, in the archive, were never handled (handled {seen}; "
        f"trim records: {records})"
    )


async def _new_shard_behind_the_archive(
    settings: Callable[..., Settings], r: redis.asyncio.Redis, tmp_path: Path, ack: str
) -> tuple[list[int], list[bytes], bytes]:
    """Group g is created at ``0`` (its consumers' start); x:0..x:2 are published and, before
    any consumer of g read them, archived and trimmed; x:3 is published. Consumer C (subscriber
    `ack`, with the archive) then takes shard 0 in one round. Returns what C handled, what its
    read queued, and x:3's entry ID."""
    from eventbus.consumer.catchup import shard_hook

    store = open_store(str(tmp_path / "segments"))
    s = settings(shards=1)
    bus, seen = _recording(s, store, ack=ack)
    c = await _driven(bus, s)
    c.pipeline.catch_up = shard_hook(store, c.handling)
    await c.pipeline.reader.ensure_groups()
    try:
        for seq in range(3):
            await bus.publish("t", Tick(resource="x", seq=seq), resource_id="x")
        await _offload(bus, s, store)
        assert await r.xlen(bus.keys.stream("t", 0)) == 0
        x3 = await bus.publish("t", Tick(resource="x", seq=3), resource_id="x")
        dispatched = _recording_dispatch(c)
        await c.pipeline.round(1)  # takes shard 0: catch-up (with an archive), trim check, read
        assert list(c.ownership.table.held) == [0]
    finally:
        await c.ownership.leave()
        await bus.aclose()
    return seen, dispatched, x3.encode()


@pytest.mark.single_node("one shard, a consumer driven round by round; the same on a cluster")
async def test_an_at_most_once_consumer_catches_a_new_shard_up_from_the_archive(
    settings: Callable[..., Settings], r: redis.asyncio.Redis, tmp_path: Path
) -> None:
    """No loss with an archive (tier.md "Inside the live consumer": "Every consumer then runs
    the shard catch-up ... on each shard it has just locked ... before its first XREADGROUP
    there"; semantics.md "Stream caps"). At-most-once only allows losing what was read and not
    handled (semantics.md "At-most-once"), not entries the group never read.

    `Ownership.lock_round` computes ``recover = [] if self.noack else new`` (NOACK reads leave
    no PEL to recover) and runs the catch-up hook only ``if recover``: so an ``ack="before"``
    consumer never catches a newly locked shard up. The trim check of the same round does not
    make up for it here: the group never read, so Redis has no ``entries-read`` for it and
    estimates its lag as the stream's length (0 lost). The read then delivers x:3 from Redis's
    head; x:0..x:2, only in the archive, are never handled, silently. The same scenario with
    ``ack="after"`` (the control below) handles x:0..x:2 from the archive first.
    """
    seen, dispatched, x3 = await _new_shard_behind_the_archive(settings, r, tmp_path, "before")
    assert x3 in dispatched  # the read went on to x:3
    assert seen == [0, 1, 2], f"x:3 was read but archived x:0..x:2 were not handled: {seen}"


@pytest.mark.single_node("one shard, a consumer driven round by round; the same on a cluster")
async def test_an_at_least_once_consumer_catches_a_new_shard_up_from_the_archive(
    settings: Callable[..., Settings], r: redis.asyncio.Redis, tmp_path: Path
) -> None:
    """The control of the test above: with ``ack="after"`` the same round catches the shard up
    (x:0..x:2 from the archive) before its read queues x:3."""
    seen, dispatched, x3 = await _new_shard_behind_the_archive(settings, r, tmp_path, "after")
    assert x3 in dispatched
    assert seen == [0, 1, 2]


@pytest.mark.single_node("one shard, one consumer; the same on a cluster")
async def test_a_stop_during_a_catch_up_retry_lets_the_entry_go(
    settings: Callable[..., Settings], r: redis.asyncio.Redis, tmp_path: Path
) -> None:
    """Graceful stop (engine.py `Consumer.run`: "stop reading, let running handlers finish";
    batching.py/delivery.py: "a retry's wait ends at once on shutdown, then the fence lets the
    entries go"; semantics.md "Retries": the consumer sleeps the backoff before each attempt).

    A consumer with an archive takes shard 0, whose entries x:0..x:2 only the archive holds:
    its lock round runs the catch-up hook (consumer/catchup.py `shard_hook`), which steps each
    entry through `Handling.step` with the `ShardCatchUp` as fence. x:0's handler fails (its
    downstream is down) and SIGTERM arrives meanwhile (`stop` is set). `wait_retry` ends the
    60 s backoff at once, as it should, but `ShardCatchUp.holds` checks only the lease, not the
    stop, so `TypedCatchUp` calls the handler again right away: the remaining attempts are spent
    back to back, x:0 is dead-lettered, and x:1, x:2 are handled after the stop. On the
    consumer's own path the fence lets x:0 go instead (it stays pending for the next owner).
    """
    from eventbus.consumer.catchup import shard_hook

    store = open_store(str(tmp_path / "segments"))
    s = settings(shards=1)
    bus = EventBus(s, archive=store)
    attempts: list[int] = []
    stop = anyio.Event()

    @bus.subscriber("t", group="g", max_attempts=3, retry_base_s=60.0, retry_max_s=60.0)
    async def handle(event: Tick) -> None:
        attempts.append(event.seq)
        if event.seq == 0:
            stop.set()  # SIGTERM arrives while x:0 fails
            raise RuntimeError("downstream down")

    c = await _driven(bus, s)
    c.pipeline.catch_up = shard_hook(store, c.handling)
    await c.pipeline.reader.ensure_groups()
    try:
        for seq in range(3):  # archived and trimmed before the group read them
            await bus.publish("t", Tick(resource="x", seq=seq), resource_id="x")
        await _offload(bus, s, store)
        assert await r.xlen(bus.keys.stream("t", 0)) == 0
        with anyio.fail_after(30):
            await c.run(stop)  # its first lock round catches the shard up; stop set meanwhile
        dead = await r.xlen(bus.keys.dead_letter("t", "g"))
    finally:
        await bus.aclose()
    assert (attempts, dead) == ([0], 0), (
        f"after the stop the catch-up made attempts {attempts} (seq of each handler call) and "
        f"wrote {dead} dead letters"
    )


@pytest.mark.single_node("one shard, a consumer driven round by round; the same on a cluster")
async def test_entries_archived_and_trimmed_during_a_live_catch_up_are_handled(
    settings: Callable[..., Settings], r: redis.asyncio.Redis, tmp_path: Path
) -> None:
    """No loss with an archive (tier.md "Inside the live consumer": "Then it reads Redis as
    usual: no gap"; the standalone catch-up's step 4: "if the offloader trimmed past D
    meanwhile ... step 2 again").

    consumer/catchup.py `shard_hook` calls `ShardCatchUp.after` once: it lists the segments
    after the group's position, handles them and moves the group (XGROUP SETID) to the last
    entry handled. `CatchUp.sync`, the standalone catch-up, then checks `behind` again and
    reads the archive again if the offloader trimmed past the group meanwhile; the hook does
    not. While C's lock round catches shard 0 up from the segment x:0..x:2 (a long backlog
    takes a while), the offloader archives x:3..x:5 in a new segment and trims them, and x:6
    is published. The hook returns; the trim check of the same round is blind to the gap (the
    group was just moved by XGROUP SETID: see the first test), and the read queues x:6.
    x:3..x:5 are never handled.
    """
    from eventbus.consumer.catchup import shard_hook

    store = open_store(str(tmp_path / "segments"))
    s = settings(shards=1)
    bus = EventBus(s, archive=store)
    seen: list[int] = []
    stream = bus.keys.stream("t", 0)

    @bus.subscriber("t", group="g")
    async def handle(event: Tick) -> None:
        seen.append(event.seq)
        if event.seq == 0 and seen == [0]:  # meanwhile, the offloader goes on
            for seq in (3, 4, 5):
                await bus.publish("t", Tick(resource="x", seq=seq), resource_id="x")
            await _offload(bus, s, store)
            assert await r.xlen(stream) == 0
            await bus.publish("t", Tick(resource="x", seq=6), resource_id="x")

    c = await _driven(bus, s)
    c.pipeline.catch_up = shard_hook(store, c.handling)
    await c.pipeline.reader.ensure_groups()
    try:
        for seq in range(3):  # archived and trimmed before the group read them
            await bus.publish("t", Tick(resource="x", seq=seq), resource_id="x")
        await _offload(bus, s, store)
        dispatched = _recording_dispatch(c)
        await c.pipeline.round(1)  # takes shard 0: catch-up, recovery, trim check, read
        assert list(c.ownership.table.held) == [0]
        x6 = (await r.xrange(stream))[-1][0]
    finally:
        await c.ownership.leave()
        await bus.aclose()
    assert x6 in dispatched  # the read went on to x:6
    assert seen == [0, 1, 2, 3, 4, 5], (
        f"x:6 was read although x:3..x:5, archived during the catch-up, were never handled: "
        f"handled {seen}"
    )


async def _stopped_then_taken_over(
    bus: EventBus,
    s: Settings,
    r: redis.asyncio.Redis,
    store: Any,
    stop: anyio.Event,
    seen: list[int],
) -> tuple[list[int], list[int]]:
    """One segment x:0..x:4 of topic ``t`` archived and trimmed before group g read it;
    consumer-1 catches it up until `stop`, then consumer-2 takes shard 0 and catches up what is
    left. Returns (`seen` when consumer-1 stopped, the shards consumer-2 held after its round)."""
    from eventbus.consumer.catchup import shard_hook

    c1 = await _driven(bus, s, "consumer-1")
    c1.pipeline.catch_up = shard_hook(store, c1.handling)
    await c1.pipeline.reader.ensure_groups()
    try:
        for seq in range(5):
            await bus.publish("t", Tick(resource="x", seq=seq), resource_id="x")
        await _offload(bus, s, store)
        assert await r.xlen(bus.keys.stream("t", 0)) == 0
        with anyio.fail_after(30):
            await c1.run(stop)
        first = list(seen)
        c2 = await _driven(bus, s, "consumer-2")
        c2.pipeline.catch_up = shard_hook(store, c2.handling)
        with anyio.fail_after(30):
            await c2.pipeline.round(1)  # takes shard 0: its catch-up handles the rest
        held = list(c2.ownership.table.held)
        await c2.ownership.leave()
    finally:
        await bus.aclose()
    return first, held


@pytest.mark.single_node("one shard, consumers driven round by round")
@pytest.mark.parametrize("ack", ["before", "after"])
async def test_a_stop_mid_segment_hands_handled_entries_to_the_next_owner(
    settings: Callable[..., Settings], r: redis.asyncio.Redis, tmp_path: Path, ack: str
) -> None:
    """The stop-aware catch-up fence let the next entry go mid-segment, and the
    group moved only after a whole segment: the next owner handled x:0..x:2 again (at-most-once
    subscribers too)."""
    store = open_store(str(tmp_path / "segments"))
    s = settings(shards=1)
    bus = EventBus(s, archive=store)
    seen: list[int] = []
    stop = anyio.Event()

    @bus.subscriber("t", group="g", ack=ack)
    async def handle(event: Tick) -> None:
        seen.append(event.seq)
        if event.seq == 2:
            stop.set()  # SIGTERM while x:2 runs: x:2 finishes, x:3 is let go
            await anyio.lowlevel.checkpoint()  # a handler doing I/O: the stop task runs

    first, held = await _stopped_then_taken_over(bus, s, r, store, stop, seen)
    assert held == [0]
    assert first == [0, 1, 2]  # x:3 is let go at the stop, left in the archive
    assert seen == [0, 1, 2, 3, 4], f"handled {seen}: x:0..x:2 twice after a graceful stop"


@pytest.mark.single_node("one shard, consumers driven round by round")
async def test_a_stop_in_a_later_handler_batch_of_a_segment_keeps_the_batches_handled(
    settings: Callable[..., Settings], r: redis.asyncio.Redis, tmp_path: Path
) -> None:
    """A segment's batch is handed to a batch subscriber `max_batch` entries at a time; a stop
    during its second handler batch lets the rest go, and the group moves past the two handler
    batches handled, not past the first alone nor the whole segment: the next owner handles
    x:4 only."""
    store = open_store(str(tmp_path / "segments"))
    s = settings(shards=1)
    bus = EventBus(s, archive=store)
    seen: list[int] = []
    stop = anyio.Event()

    @bus.subscriber("t", group="g", batch=True, max_batch=2)
    async def handle(events: list[Tick]) -> None:
        seen.extend(e.seq for e in events)
        if 3 in seen:
            stop.set()  # SIGTERM while x:2, x:3 run: they finish, x:4 is let go
            await anyio.lowlevel.checkpoint()

    first, _ = await _stopped_then_taken_over(bus, s, r, store, stop, seen)
    assert first == [0, 1, 2, 3]  # two handler batches, then the stop
    assert seen == [0, 1, 2, 3, 4], f"handled {seen}: not each entry once across the stop"

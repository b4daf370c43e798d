"""The fence of a group consumer (lock round, lease, held-shard table, catch-up scheduling, PEL
recovery) under interleavings the chaos harness does not produce: a consumer that lost or may
have lost its shards claims nothing, renews no lease over them and starts no handler on them, and
a held shard is caught up before it is read and without overtaking entries in flight.

Each test drives an interleaving that once violated a promise of docs/semantics.md against a
real redis-server, with events and hooks, never with sleeps; each failed on the code before its
fix.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import pytest
import redis.asyncio
from support import Tick, resources_per_shard, running, wait_until

from eventbus import Context, EventBus, Settings
from eventbus.consumer.engine import Consumer
from eventbus.tier.offloader import Offloader
from eventbus.tier.settings import TierSettings
from eventbus.tier.store import open_store

pytestmark = [pytest.mark.anyio, pytest.mark.integration]


def _fast_tier() -> TierSettings:
    """Small segments, no hot window, exact trims (as tests/integration/tier/tier_support.py)."""
    return TierSettings(
        segment_max_entries=300,
        segment_max_age_s=0.0,
        hot_window_s=0.0,
        trim_exact=True,
        poll_interval_s=0.02,
    )


def _recording(s: Settings, archive: Any = None) -> tuple[EventBus, list[int]]:
    """A bus whose subscriber of topic "t", group "g" records the seq of each event handled."""
    bus = EventBus(s, archive=archive)
    seen: list[int] = []

    @bus.subscriber("t", group="g")
    async def handle(event: Tick) -> None:
        seen.append(event.seq)

    return bus, seen


async def _driven(bus: EventBus, s: Settings, member_id: str = "consumer-c") -> Consumer:
    """A `Consumer` of `bus`'s subscription, its topic registered, driven round by round by
    the test (no read loop, no heartbeats)."""
    from eventbus.locking.member import Member
    from eventbus.profiles import EVENTBUS

    await bus.registry.ensure(bus.subscriptions[0].topic)
    member = Member(bus.redis, bus.keys, s, "t", "g", member_id, EVENTBUS)
    return Consumer(member, bus.registry, bus.subscriptions[0])


@pytest.mark.single_node("one shard stream read with COUNT 1; the interleaving is the same")
async def test_catch_up_of_a_held_shard_waits_for_its_entries_in_flight(
    settings: Callable[..., Settings], r: redis.asyncio.Redis, tmp_path: Path
) -> None:
    """Per-resource order (semantics.md: "sees event n+1 only after event n has finished").

    A consumer with an archive holds shard 0 and is handling x:0 (its handler is slow); x:1 is
    queued behind it (read ahead). The offloader archives and trims the shard past the group's
    last-delivered ID, as it does in normal operation once entries are older than
    `hot_window_s`. The consumer's periodic trim check (`Ownership.check_trims`) then finds the
    shard "ahead" and runs the catch-up hook on it right away (engine.py `_check_trims` ->
    `_catch_up`), although the shard has entries in flight: the hook handles the group's pending
    entries (x:0 again, x:1) and the archived x:2..x:5 through `Handling.step` directly, beside
    the resource queues. So x:0 runs twice at once and x:1..x:5 run before x:0 has finished.
    """
    store = open_store(str(tmp_path / "segments"))
    s = settings(shards=1, read_count=1, trim_check_s=0.05, block_max_ms=50)
    bus = EventBus(s, archive=store)
    gate = anyio.Event()
    starts: list[int] = []
    done: list[int] = []
    first_x0 = anyio.Event()

    @bus.subscriber("t", group="g")
    async def handle(event: Tick, ctx: Context) -> None:
        starts.append(event.seq)
        if event.seq == 0 and not first_x0.is_set():
            first_x0.set()
            await gate.wait()  # the slow handler of x:0
        done.append(event.seq)

    stream = bus.keys.stream("t", 0)
    records = bus.keys.trimmed("t", "g")
    async with running(bus):
        consumer = next(c for c in bus.consumers if isinstance(c, Consumer))
        # the shard was just locked and checked: compress the 10 s catch-up check interval
        # (`CATCH_UP_CHECK_S`) so the test need not wait it out; the bug does not depend on it
        consumer.ownership.catching_up.check_s = 0.0
        checks = [0]
        check_trims = consumer.ownership.check_trims

        async def counted(claimer: Any) -> None:
            await check_trims(claimer)
            checks[0] += 1

        consumer.ownership.check_trims = counted  # type: ignore[method-assign]
        for seq in range(6):
            await bus.publish("t", Tick(resource="x", seq=seq), resource_id="x")
        with anyio.fail_after(20):
            await first_x0.wait()
        # x:0 running, x:1 read ahead and queued: two entries pending, no more reads
        await wait_until(lambda: _pending(r, stream, 2))
        offloader = Offloader(bus.redis, store, settings=s, tier=_fast_tier())
        await offloader.run_until_caught_up(timeout_s=30)
        assert await r.xlen(stream) == 0  # every entry now lives only in the archive
        # the consumer's trim check finds the shard trimmed ahead of the group; then let one
        # whole `_check_trims` call finish after that record (the one that found it, or later)
        await wait_until(lambda: _has_entries(r, records))
        seen = checks[0]
        await wait_until(lambda: checks[0] > seen)
        # x:0's handler is still running: nothing else of x may have started
        in_flight_view = list(starts)
        gate.set()
        await wait_until(lambda: set(done) >= set(range(6)))
    assert in_flight_view == [0], (
        f"while x:0 was still being handled, the consumer started x:{in_flight_view[1:]}"
    )
    firsts = list(dict.fromkeys(done))
    assert firsts == list(range(6)), f"x handled out of order: {done}"


async def _pause_in_catch_up(
    settings: Callable[..., Settings], r: redis.asyncio.Redis, tmp_path: Path
) -> dict[str, Any]:
    """Consumer C (archive, its own event loop, member ID ``consumer-c``) takes shards 0 and 1;
    shard 1 was trimmed past the group, so its first lock round runs the catch-up hook on it.
    C stops (a pause past the 1 s liveness TTL) while handling an archived entry. B (another
    bus, this loop) takes both shards and reads y:1 of shard 1; its handler is slow, so y:1
    stays pending for B. Then C wakes up.

    Hooks (interleavings, no behaviour changed): C's heartbeats are held from the pause until
    that lock round is over (a heartbeat answered late, so that one finding C lapsed does not
    run first); C's next lock round is held until a heartbeat after it was answered (the
    heartbeat answered between two lock rounds). Returns what C's paused lock round queued of
    each shard (``claimed``), y:1's entry ID, shard 1's lock owner then, and C's fence as the
    next lock round starts (``lease_ok``, ``held``) with the lock owners of shards 0 and 1."""
    from eventbus.consumer.catchup import shard_hook
    from eventbus.locking.member import Member
    from eventbus.profiles import EVENTBUS

    store = open_store(str(tmp_path / "segments"))
    s = settings(shards=2, liveness_ttl_s=1.0)
    x, y = resources_per_shard(2, 2)[2:]  # two resources of shard 1
    bus_b = EventBus(s)
    s1 = bus_b.keys.stream("t", 1)
    locks_key = bus_b.keys.locks("t", "g")
    # shard 1: the group's first entries were archived and trimmed before anyone read them
    for seq in range(3):
        await bus_b.publish("t", Tick(resource=x, seq=seq), resource_id=x)
    for shard in range(2):
        await r.xgroup_create(bus_b.keys.stream("t", shard), "g", id="0", mkstream=True)
    offloader = Offloader(bus_b.redis, store, settings=s, tier=_fast_tier())
    await offloader.run_until_caught_up(timeout_s=30)
    assert await r.xlen(s1) == 0

    frozen, resume, round_done, viewed, stop_c = (threading.Event() for _ in range(5))
    claimed: list[tuple[int, bytes]] = []  # what C's first lock round recovered and queued
    view: dict[str, Any] = {}

    async def run_c() -> None:  # consumer C, in an event loop of its own (its own "process")
        bus_c = EventBus(s, archive=store)

        @bus_c.subscriber("t", group="g")
        async def on_c(event: Tick) -> None:
            if not frozen.is_set():
                frozen.set()
                resume.wait(60)  # blocks C's event loop: the whole "process" stops

        await bus_c.registry.ensure(bus_c.subscriptions[0].topic)
        member = Member(bus_c.redis, bus_c.keys, s, "t", "g", "consumer-c", EVENTBUS)
        c = Consumer(member, bus_c.registry, bus_c.subscriptions[0])
        c.pipeline.catch_up = shard_hook(store, c.handling)
        rounds, answered = anyio.Event(), anyio.Event()
        own = c.ownership
        lock_round, heartbeat, acquire = own.lock_round, own.locks.heartbeat, own.locks.acquire

        async def first_lock_round(claimer: Any) -> None:
            try:
                await lock_round(claimer)
            finally:
                if not rounds.is_set():
                    rounds.set()
                    round_done.set()

        async def late_heartbeat() -> bool:
            if frozen.is_set():
                await rounds.wait()  # answered after the lock round of the pause
            try:
                return await heartbeat()
            finally:
                if rounds.is_set():
                    answered.set()

        async def next_acquire(candidates: Any) -> Any:
            if rounds.is_set() and not viewed.is_set():
                await answered.wait()  # (the heartbeat loop has applied its answer by now)
                view.update(lease_ok=c.lease.ok(), held=sorted(c.ownership.table.held))
                viewed.set()
            return await acquire(candidates)

        dispatch = c.pipeline._dispatch

        def recording(held: Any, entries: Any, counts: Any) -> None:
            if not round_done.is_set():
                claimed.extend((held.shard, entry_id) for entry_id, _ in entries)
            dispatch(held, entries, counts)

        c.pipeline._dispatch = recording  # type: ignore[method-assign]
        c.ownership.lock_round = first_lock_round  # type: ignore[method-assign]
        c.ownership.locks.heartbeat = late_heartbeat  # type: ignore[method-assign]
        c.ownership.locks.acquire = next_acquire  # type: ignore[method-assign]
        stop = anyio.Event()
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: c.run(stop))
            await anyio.to_thread.run_sync(stop_c.wait)
            stop.set()
        await bus_c.aclose()

    thread = threading.Thread(target=lambda: asyncio.run(run_c()), daemon=True)
    thread.start()
    gate = anyio.Event()
    handled_b: list[tuple[str, int]] = []

    @bus_b.subscriber("t", group="g")
    async def on_b(event: Tick) -> None:
        handled_b.append((event.resource, event.seq))
        await gate.wait()  # slow: y:1 stays pending for B

    try:
        assert await anyio.to_thread.run_sync(frozen.wait, 30)  # C stopped in the catch-up
        async with running(bus_b):
            await wait_until(lambda: _owner(r, locks_key, 1, b"consumer-c", negate=True))
            y1 = await bus_b.publish("t", Tick(resource=y, seq=1), resource_id=y)
            await wait_until(lambda: handled_b == [(y, 1)])
            resume.set()  # C wakes up
            assert await anyio.to_thread.run_sync(round_done.wait, 30)
            lock_owner = await r.hget(locks_key, "1")
            assert await anyio.to_thread.run_sync(viewed.wait, 30)
            owners = [await r.hget(locks_key, str(shard)) for shard in range(2)]
            gate.set()
    finally:
        resume.set()
        stop_c.set()
        await anyio.to_thread.run_sync(thread.join, 30)
    return {"claimed": claimed, "y1": y1, "lock_owner": lock_owner, "owners": owners, **view}


@pytest.mark.single_node("a second event loop in a thread; the interleaving is the same")
async def test_a_catch_up_that_lost_its_lock_does_not_claim_the_shard(
    settings: Callable[..., Settings], r: redis.asyncio.Redis, tmp_path: Path
) -> None:
    """One lock owner per shard (semantics.md "Why it holds" 2 and 6; protocol.md rules 1 and
    3: only the lock's new owner claims a shard's PEL). Scenario: `_pause_in_catch_up`.

    When C wakes, the catch-up's next `confirm` re-takes nothing (B holds shard 1) and raises
    `Fenced`, which `shard_hook` turns into a quiet False (consumer/catchup.py);
    `CatchUpSchedule.run` counts that as a success and keeps the shard, and
    `Ownership.lock_round` goes on to `_recover` it: XAUTOCLAIM ... 0 0-0, sent without any
    lease or lock check, moves y:1 into C's PEL and C queues it, while B holds the lock.
    """
    seen = await _pause_in_catch_up(settings, r, tmp_path)
    assert seen["lock_owner"] != b"consumer-c"
    # (B's next read claims y:1 back, by its fenced-delivery check, and queues it a second
    # time: so what C's round claimed is recorded as C queued it, not read from the PEL later)
    assert (1, seen["y1"].encode()) not in seen["claimed"], (
        f"C claimed (XAUTOCLAIM) and queued y:1 of shard 1 while {seen['lock_owner']!r} held it"
    )


@pytest.mark.single_node("a second event loop in a thread; the interleaving is the same")
async def test_a_lapsed_consumer_revived_by_its_catch_up_gets_no_lease_on_lost_shards(
    settings: Callable[..., Settings], r: redis.asyncio.Redis, tmp_path: Path
) -> None:
    """The lease (semantics.md "The lease"; protocol.md rule 2: "a heartbeat succeeds only when
    ... no lock_shards call of the consumer was awaiting its reply meanwhile"; FINDINGS 10).
    Scenario: `_pause_in_catch_up`.

    The catch-up runs ``lock_shards`` through a lock client of its own (`CatchUp.locks`, for
    the one shard it catches up); its `confirm` after the pause makes C live again, and its
    reply (nothing held) never reaches the consumer's shard table. FINDINGS 10's rule, "only
    the next lock round revives a lapsed member, and its reply says which locks it still
    holds", is broken: the next heartbeat finds C live and renews its lease (its guard only
    knows the consumer's own lock client, and no lock round is in flight anyway), while C's
    table still holds shards 0 and 1 from before the lapse, both B's now. C's fence
    (`Ownership.holds`) then admits handlers, and acks, on B's shards (y:1, which C claimed,
    or anything queued) until C's next lock round.
    """
    seen = await _pause_in_catch_up(settings, r, tmp_path)
    theirs = [
        shard
        for shard in seen["held"]
        if seen["owners"][shard] is not None and seen["owners"][shard] != b"consumer-c"
    ]
    assert not (seen["lease_ok"] and theirs), (
        f"C's lease was renewed while its table holds shards {theirs} that "
        f"{[seen['owners'][s] for s in theirs]} hold"
    )


async def test_a_shard_retaken_soon_after_its_check_is_caught_up_before_it_is_read(
    settings: Callable[..., Settings], r: redis.asyncio.Redis, tmp_path: Path
) -> None:
    """No loss with an archive (semantics.md "Stream caps": "with an archive, catches the
    shard up from the segments before reading past the gap"; tier.md).

    `CatchUpSchedule.due` skips a shard checked less than `CATCH_UP_CHECK_S` (10 s) ago, and
    `CatchUpSchedule.run` then keeps it as if it had been caught up. But the schedule is per
    shard, not per lock acquisition: C takes shard 0 (checked: nothing missing), releases it
    when idle, and takes it again a few seconds later, after the group's next entries were
    archived and trimmed meanwhile (a backlog older than `hot_window_s`, while nobody held the
    shard). The new acquisition is not caught up; the trim check of the same round finds the
    shard trimmed ahead and logs it, but `_catch_up` again finds it "not due"; the read then
    goes on from the stream's first entry, past x:0..x:4, which only the archive holds. They
    are never handled by the group.
    """
    from eventbus.consumer.catchup import shard_hook

    store = open_store(str(tmp_path / "segments"))
    s = settings(shards=1)
    bus, seen = _recording(s, store)
    stream = bus.keys.stream("t", 0)
    c = await _driven(bus, s)
    c.pipeline.catch_up = shard_hook(store, c.handling)
    await c.pipeline.reader.ensure_groups()
    try:
        await c.pipeline.round(1)  # takes shard 0, checks it: nothing behind
        assert list(c.ownership.table.held) == [0]
        await c.ownership.release([0])  # idle: released (as `round` does after idle_release_ms)
        for seq in range(5):  # the group's next entries, archived and trimmed unread
            await bus.publish("t", Tick(resource="x", seq=seq), resource_id="x")
        offloader = Offloader(bus.redis, store, settings=s, tier=_fast_tier())
        await offloader.run_until_caught_up(timeout_s=30)
        assert await r.xlen(stream) == 0
        x5 = await bus.publish("t", Tick(resource="x", seq=5), resource_id="x")
        dispatched: list[bytes] = []
        dispatch = c.pipeline._dispatch

        def recording(held: Any, entries: Any, counts: Any) -> None:
            dispatched.extend(entry_id for entry_id, _ in entries)
            dispatch(held, entries, counts)

        c.pipeline._dispatch = recording  # type: ignore[method-assign]
        await c.pipeline.round(1)  # takes shard 0 again (a few seconds at most after its check)
        assert list(c.ownership.table.held) == [0]
    finally:
        await c.ownership.leave()
        await bus.aclose()
    assert x5.encode() in dispatched  # the read went on to x:5, after the catch-up
    assert seen == [0, 1, 2, 3, 4], (
        f"x:5 was read (queued for its handler) although x:0..x:4, in the archive, were never "
        f"handled: handled {seen}"
    )


async def _owner(r: Any, key: str, shard: int, who: bytes, *, negate: bool = False) -> bool:
    owner = await r.hget(key, str(shard))
    return (owner is not None and owner != who) if negate else owner == who


async def _pending(r: Any, stream: str, n: int) -> bool:
    return int((await r.xpending(stream, "g"))["pending"]) == n


async def _has_entries(r: Any, key: str) -> bool:
    return bool(await r.xlen(key))


async def test_a_lock_round_answered_after_its_lease_claims_no_pending_entries(
    settings: Callable[..., Settings], r: redis.asyncio.Redis
) -> None:
    """`_recover` sent ``XAUTOCLAIM ... 0 0-0`` without looking at the
    lease. A lock round whose reply arrives after the lease it grants has run out (a reply
    delayed past the TTL: another consumer may hold the shard by then) must claim nothing; the
    next round, answered in time, recovers the pending entry."""
    from eventbus.locking.locks import LockRound

    s = settings(shards=1)
    bus, _ = _recording(s)
    stream = bus.keys.stream("t", 0)
    c = await _driven(bus, s)
    await r.xgroup_create(stream, "g", id="0", mkstream=True)
    await bus.publish("t", Tick(resource="x", seq=0), resource_id="x")
    await r.xreadgroup("g", "gone", {stream: ">"}, count=1)  # pending for a consumer that died
    acquire = c.ownership.locks.acquire
    late = [True]

    async def answered(candidates: Any) -> LockRound:
        got = await acquire(candidates)
        if late[0]:  # the reply arrived a whole lease after it was sent
            return LockRound(got.share, got.grants, got.sent_at - 2 * s.lease_s)
        return got

    c.ownership.locks.acquire = answered  # type: ignore[method-assign]
    try:
        await c.pipeline.round(1)
        owners = [row["consumer"] for row in await r.xpending_range(stream, "g", "-", "+", 10)]
        assert owners == [b"gone"], f"claimed without a lease: {owners}"
        assert c.ownership.table.held == {}  # not read either
        late[0] = False
        await c.pipeline.round(1)
        owners = [row["consumer"] for row in await r.xpending_range(stream, "g", "-", "+", 10)]
        assert owners == [b"consumer-c"]
    finally:
        await c.ownership.leave()
        await bus.aclose()


async def test_a_lapse_during_the_catch_up_of_shards_behind_leaves_the_round_standing(
    settings: Callable[..., Settings], r: redis.asyncio.Redis
) -> None:
    """Two held shards behind the archive; while the second one's catch-up runs,
    the heartbeat finds the consumer lapsed and drops every shard. `_catch_up_behind` then
    cleared the `behind` flag of shards no longer in the table (KeyError: the read loop does
    not catch it, so `bus.run` failed). Now the round ends with nothing held."""
    s = settings(shards=2)
    bus, _ = _recording(s)
    c = await _driven(bus, s)
    caught: list[int] = []

    async def hook(shard: int, token: int) -> bool:
        caught.append(shard)
        if len(caught) == 2:  # the heartbeat found the member lapsed meanwhile
            c.ownership.drop_all("liveness had expired before this heartbeat")
        return False

    for shard in range(2):
        await r.xgroup_create(bus.keys.stream("t", shard), "g", id="0", mkstream=True)
    try:
        await c.ownership.lock_round(c.pipeline)
        c.pipeline.catch_up = hook
        assert sorted(c.ownership.table.held) == [0, 1]
        for h in c.ownership.table.held.values():
            h.behind = True
        await c.ownership._catch_up_behind(hook)
        assert sorted(caught) == [0, 1] and c.ownership.table.held == {}
    finally:
        await c.ownership.leave()
        await bus.aclose()

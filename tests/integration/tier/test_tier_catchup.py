"""Catch-up of a consumer group that fell behind the hot window, while events keep coming."""

from __future__ import annotations

import logging
from collections import defaultdict

import anyio
import obstore
import pytest
from tier_support import PacedPublisher, Tick, fast_tier, make_bus, publish_ticks, wait_until

from eventbus import Context
from eventbus.consumer.catchup import catch_up
from eventbus.protocol.ids import parse_id
from eventbus.tier.catchup import catch_up_group
from eventbus.tier.layout import segment_key
from eventbus.tier.offloader import Offloader
from eventbus.tier.replay import ArchivedEntry, read_segment
from eventbus.tier.segment_write import encode_segment
from eventbus.tier.store import list_segments_sync, open_store

pytestmark = [pytest.mark.anyio, pytest.mark.integration]

SHARDS = 4


async def _head_past_group(bus, topic: str, group: str) -> bool:
    """True when every shard's first entry in Redis lies after the group's last-delivered ID
    (so the group's next entries exist only in segments)."""
    for s in range(SHARDS):
        stream = bus.keys.stream(topic, s)
        info = await bus.redis.xinfo_stream(stream)
        first = info["first-entry"]
        delivered = next(
            parse_id(g["last-delivered-id"])
            for g in await bus.redis.xinfo_groups(stream)
            if g["name"] == group.encode()
        )
        if first is None or parse_id(first[0]) <= delivered.next():
            return False
    return True


async def test_catch_up_then_consume_with_no_gap_and_no_duplicate(
    redis_db: str, store_url: str
) -> None:
    bus = make_bus(redis_db, shards=SHARDS)
    store = open_store(store_url)
    seen: list[tuple[str, int, int, str]] = []  # resource, seq, shard, entry ID

    @bus.subscriber("flow", group="billing")
    async def on_tick(event: Tick, ctx: Context) -> None:
        seen.append((event.resource, event.seq, ctx.shard, ctx.entry_id))

    publisher = PacedPublisher(bus, "flow", batch=50, resources=17)  # about 2,500 events/s
    published = publisher.published
    stop_offloading, stop_consuming = anyio.Event(), anyio.Event()

    tier = fast_tier(segment_max_entries=200, segment_max_age_s=0.05, hot_window_s=1.0)
    offloader = Offloader(bus.redis, store, settings=bus.settings, tier=tier)
    async with bus:
        await bus.publish_many("flow", [("res-0", Tick(resource="res-0", seq=-1))])
        published.append(("res-0", -1))
        for s in range(SHARDS):
            await bus.redis.xgroup_create(
                bus.keys.stream("flow", s), "billing", id="0", mkstream=True
            )
        # a consumer of the group read entries of shard 0 and died before acking them
        stream0 = bus.keys.stream("flow", 0)
        await bus.publish_many(
            "flow",
            [(f"res-{i % 17}", Tick(resource=f"res-{i % 17}", seq=-100 - i)) for i in range(60)],
        )
        published.extend((f"res-{i % 17}", -100 - i) for i in range(60))
        crashed = await bus.redis.xreadgroup("billing", "crashed", {stream0: ">"}, count=5)
        assert len(crashed[0][1]) == 5

        async with anyio.create_task_group() as tg:
            tg.start_soon(publisher.run)
            tg.start_soon(offloader.run, stop_offloading)
            # the group falls behind: its next entries are trimmed from Redis
            await wait_until(lambda: _head_past_group(bus, "flow", "billing"), within_s=30)
            with anyio.fail_after(60):
                stats = await catch_up(bus, store, "flow", "billing")
            assert stats.shards == SHARDS and stats.pending_acked == 5
            assert stats.from_segments > 0 and stats.lost_ranges == 0
            tg.start_soon(lambda: bus.run(stop=stop_consuming))
            live_target = len(published) + 500  # the consumer handles events published live
            await wait_until(lambda: len(seen) >= live_target, within_s=30)
            await publisher.stop()
            await wait_until(lambda: len(seen) >= len(published), within_s=30)
            stop_consuming.set()
            stop_offloading.set()

    await bus.aclose()
    keys = [(rid, seq) for rid, seq, _, _ in seen]
    assert len(keys) == len(set(keys)), "an event was handled twice"
    assert sorted(keys) == sorted(published), "an event was never handled"
    order: dict[str, list[int]] = defaultdict(list)
    for rid, seq, _, _ in seen:
        order[rid].append(seq)
    for rid, seqs in order.items():  # per-resource order: the crashed reads, then publish order
        negatives = [s for s in seqs if s < -1]
        assert negatives == sorted(negatives, reverse=True), rid
        positives = [s for s in seqs if s >= 0]
        assert positives == sorted(positives), rid


async def test_catch_up_group_raw_and_lost_range(redis_db: str, tmp_path) -> None:
    """The raw API hands over archived entries in order; a range trimmed before archiving is
    reported as lost, and the catch-up then goes on with what Redis holds."""
    bus = make_bus(redis_db, shards=1)
    bus.topic("raw", shards=1, maxlen=100)
    store = open_store(str(tmp_path))
    async with bus:
        first = await bus.publish_many("raw", [("r", Tick(resource="r", seq=i)) for i in range(50)])
        stream = bus.keys.stream("raw", 0)
        await bus.redis.xgroup_create(stream, "g", id="0")
        await Offloader(
            bus.redis, store, settings=bus.settings, tier=fast_tier()
        ).run_until_caught_up(20)
        got: list[ArchivedEntry] = []

        async def handle(entry: ArchivedEntry, token: int) -> None:
            assert token >= 1
            got.append(entry)

        stats = await catch_up_group(bus.redis, store, "raw", "g", handle, shards=1)
        assert [str(e.entry_id) for e in got] == first and stats.from_segments == 50
        assert [e.envelope().payload["seq"] for e in got] == list(range(50))
        groups = await bus.redis.xinfo_groups(stream)
        assert groups[0]["last-delivered-id"] == first[-1].encode()
        # now 1000 more with nobody archiving: MAXLEN ~ 100 drops most of them
        await bus.publish_many("raw", [("r", Tick(resource="r", seq=i)) for i in range(50, 1050)])
        got.clear()
        kept = [row[0].decode() for row in await bus.redis.xrange(stream)]
        stats = await catch_up_group(bus.redis, store, "raw", "g", handle, shards=1)
        # the lost range is reported, and the group goes on with what Redis holds
        assert stats.lost_ranges == 1 and stats.from_segments == 0
        assert [str(e.entry_id) for e in got] == kept and stats.from_redis == len(kept)
        groups = await bus.redis.xinfo_groups(stream)
        assert groups[0]["last-delivered-id"] == kept[-1].encode()
    await bus.aclose()


async def test_overlapping_segments_are_caught_up_each_entry_once(redis_db: str, tmp_path) -> None:
    """A segment whose range overlaps the ones before it (entries archived twice) hands each
    entry on once, in order: catch-up reads on from the last entry it handled, as replay."""
    bus = make_bus(redis_db, shards=1)
    store = open_store(str(tmp_path))
    async with bus:
        ids = await bus.publish_many("dup", [("r", Tick(resource="r", seq=i)) for i in range(30)])
        stream = bus.keys.stream("dup", 0)
        await bus.redis.xgroup_create(stream, "g", id="0")
        await Offloader(
            bus.redis, store, settings=bus.settings, tier=fast_tier(segment_max_entries=10)
        ).run_until_caught_up(20)
        refs = list_segments_sync(store, "dup", 0)
        assert len(refs) == 3
        twice = [e for ref in refs[:2] for e in read_segment(store, ref).entries][5:15]
        first, last = twice[0].entry_id, twice[-1].entry_id
        data, _ = encode_segment("dup", 0, first, last, [(e.entry_id, e.fields()) for e in twice])
        obstore.put(store, segment_key("dup", 0, first, last), data)
        assert len(list_segments_sync(store, "dup", 0)) == 4
        got: list[str] = []

        async def handle(entry: ArchivedEntry, token: int) -> None:
            got.append(str(entry.entry_id))

        stats = await catch_up_group(bus.redis, store, "dup", "g", handle, shards=1)
        assert got == ids and stats.from_segments == 30
    await bus.aclose()


async def test_catch_up_waits_for_live_consumers_locks(redis_db: str, tmp_path) -> None:
    """Catch-up needs the group's shard locks: held by a live consumer, it gives up clearly."""
    from eventbus.tier.errors import LockUnavailable

    bus = make_bus(redis_db, shards=1)
    store = open_store(str(tmp_path))
    async with bus:
        await bus.publish_many("busy", [("r", Tick(resource="r", seq=0))])
        await bus.redis.xgroup_create(bus.keys.stream("busy", 0), "g", id="0")
        from eventbus.locking.scripts import Scripts

        scripts = Scripts.register(bus.redis)
        held = await scripts.lock_shards(
            keys=[
                bus.keys.members("busy", "g"),
                bus.keys.locks("busy", "g"),
                bus.keys.lock_epoch("busy", "g"),
            ],
            args=["live-consumer", 30_000, 1, "", 0, "", 0],
        )
        assert held[2][0] == 0  # a live consumer holds shard 0

        async def handle(entry: ArchivedEntry, token: int) -> None:
            raise AssertionError("must not run")

        with pytest.raises(LockUnavailable, match=r"shards \[0\]"):
            await catch_up_group(
                bus.redis, store, "busy", "g", handle, shards=1, lock_timeout_s=0.3
            )
    await bus.aclose()


async def test_a_shard_lost_before_it_caught_up_fails_the_catch_up(redis_db: str, tmp_path) -> None:
    """A catch-up whose lock of a shard is taken by a live consumer before that shard caught up
    raises `LockUnavailable` naming it, rather than returning as if the group were caught up
    (its group would stay behind the stream, the archived entries unhandled)."""
    from eventbus.locking.scripts import Scripts
    from eventbus.tier.errors import LockUnavailable

    bus = make_bus(redis_db, shards=1)
    bus.topic("raw", shards=1, maxlen=100)
    store = open_store(str(tmp_path))
    async with bus:
        await bus.publish_many("raw", [("r", Tick(resource="r", seq=i)) for i in range(50)])
        stream = bus.keys.stream("raw", 0)
        await bus.redis.xgroup_create(stream, "g", id="0")
        await Offloader(
            bus.redis, store, settings=bus.settings, tier=fast_tier()
        ).run_until_caught_up(20)
        await bus.publish_many("raw", [("r", Tick(resource="r", seq=i)) for i in range(50, 1050)])
        scripts = Scripts.register(bus.redis)
        keys = [bus.keys.members("raw", "g"), bus.keys.locks("raw", "g")]
        keys.append(bus.keys.lock_epoch("raw", "g"))
        handled: list[ArchivedEntry] = []

        async def handle(entry: ArchivedEntry, token: int) -> None:
            if not handled:  # the catch-up's liveness lapses; a live consumer takes shard 0
                await bus.redis.delete(*keys)
                held = await scripts.lock_shards(
                    keys=keys, args=["live-consumer", 30_000, 1, "", 0, "", 0]
                )
                assert held[2][0] == 0
            handled.append(entry)

        with pytest.raises(LockUnavailable, match=r"shard 0 before it caught up"):
            await catch_up_group(bus.redis, store, "raw", "g", handle, shards=1, lock_timeout_s=0.5)
    await bus.aclose()


async def test_catch_up_ends_when_a_sweep_over_the_shards_outlasts_the_hot_window(
    redis_db: str, tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Listing a shard's segments takes 3 s (a slow store), so going over 2 shards one after
    the other takes longer than the 2 s hot window while events keep coming: a catch-up that
    waits for one pass over the shards to find none behind never ends. It must end, and the
    group's consumer then sees every event once, in order per resource."""
    from eventbus.tier import catchup_shard

    real_list = catchup_shard.list_segments

    async def slow_list(*args, **kwargs):  # type: ignore[no-untyped-def]
        await anyio.sleep(3.0)  # the slow store under test, not a wait for a condition
        return await real_list(*args, **kwargs)

    monkeypatch.setattr(catchup_shard, "list_segments", slow_list)
    shards = 2
    bus = make_bus(redis_db, shards=shards)
    store = open_store(str(tmp_path / "segments"))
    seen: list[tuple[str, int]] = []

    @bus.subscriber("slow", group="billing")
    async def on_tick(event: Tick, ctx: Context) -> None:
        seen.append((event.resource, event.seq))

    publisher = PacedPublisher(bus, "slow", batch=20, resources=7)  # about 1,000 events/s
    published = publisher.published
    stop_offloading, stop_consuming = anyio.Event(), anyio.Event()

    async def trimmed() -> bool:  # the offloader trimmed entries of every shard
        infos = [await bus.redis.xinfo_stream(bus.keys.stream("slow", s)) for s in range(shards)]
        return all(i["entries-added"] > i["length"] for i in infos)

    tier = fast_tier(segment_max_entries=100, segment_max_age_s=0.05, hot_window_s=2.0)
    offloader = Offloader(bus.redis, store, settings=bus.settings, tier=tier)
    async with bus:
        for s in range(shards):
            await bus.redis.xgroup_create(
                bus.keys.stream("slow", s), "billing", id="0", mkstream=True
            )
        async with anyio.create_task_group() as tg:
            tg.start_soon(publisher.run)
            tg.start_soon(offloader.run, stop_offloading)
            await wait_until(trimmed, within_s=60)  # the group's next entries: segments only
            with anyio.fail_after(60):  # generous for a loaded machine: it ends in seconds
                stats = await catch_up(bus, store, "slow", "billing")
            assert stats.shards == shards and stats.from_segments > 0, stats
            tg.start_soon(lambda: bus.run(stop=stop_consuming))
            live_target = len(published) + 200  # the consumer handles events published live
            await wait_until(lambda: len(seen) >= live_target, within_s=60)
            await publisher.stop()
            await wait_until(lambda: len(seen) >= len(published), within_s=60)
            stop_consuming.set()
            stop_offloading.set()
    await bus.aclose()
    assert len(seen) == len(set(seen)), "an event was handled twice"
    assert sorted(seen) == sorted(published), "an event was never handled"
    order: dict[str, list[int]] = defaultdict(list)
    for rid, seq in seen:
        order[rid].append(seq)
    assert all(seqs == sorted(seqs) for seqs in order.values()), "out of order for a resource"


class Growing:
    """A raw catch-up handler under a stream that grows while the offloader trims behind it:
    each of the first `feeds` entries it gets from Redis (not from a segment) publishes 10
    entries, archives and trims everything (hot window 0), then publishes 10 more, which
    Redis holds; `got` lists the entry IDs handled, `published` those published."""

    def __init__(self, bus, offloader: Offloader, published: list[str], feeds: int) -> None:
        self.bus, self.offloader, self.published, self.feeds = bus, offloader, published, feeds
        self.got: list[str] = []

    async def feed(self, then: int = 10) -> None:
        self.published += await publish_ticks(self.bus, "grow", 10, start=len(self.published))
        await self.offloader.run_until_caught_up(30)  # archived, then trimmed from Redis
        self.published += await publish_ticks(self.bus, "grow", then, start=len(self.published))

    async def __call__(self, entry: ArchivedEntry, token: int) -> None:
        self.got.append(str(entry.entry_id))
        if not entry.segment and self.feeds > 0:
            self.feeds -= 1
            await self.feed()


async def _growing(bus, tmp_path, feeds: int) -> Growing:
    """Group g of topic grow (1 shard) at 0-0; 10 entries archived and trimmed, 10 in Redis."""
    await bus.redis.xgroup_create(bus.keys.stream("grow", 0), "g", id="0", mkstream=True)
    store = open_store(str(tmp_path))
    offloader = Offloader(bus.redis, store, settings=bus.settings, tier=fast_tier())
    growing = Growing(bus, offloader, [], feeds)
    await growing.feed()
    return growing


async def _delivered(bus, topic: str, group: str) -> str:
    groups = await bus.redis.xinfo_groups(bus.keys.stream(topic, 0))
    return next(g["last-delivered-id"].decode() for g in groups if g["name"] == group.encode())


async def test_a_group_at_the_archives_end_is_not_behind_a_later_first_entry(
    redis_db: str, tmp_path, caplog: pytest.LogCaptureFixture
) -> None:
    """The offloader archived and trimmed everything up to C; the group reaches C from the
    archive while Redis's first entry lies after C's successor (entry IDs are times, so there
    is a gap in IDs, not in entries): nothing is lost. Catch-up used to take the ID gap for
    trimmed entries and log them at ERROR as lost before archiving (lost_ranges 1)."""
    bus = make_bus(redis_db, shards=1)
    async with bus:
        growing = await _growing(bus, tmp_path, feeds=0)
        store = growing.offloader.store
        stats = await catch_up_group(bus.redis, store, "grow", "g", growing, shards=1)
        assert growing.got == growing.published
        assert stats.lost_ranges == 0 and (stats.from_segments, stats.from_redis) == (10, 10)
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
        assert await _delivered(bus, "grow", "g") == growing.published[-1]
    await bus.aclose()


async def test_entries_trimmed_while_catch_up_reads_redis_are_not_left_behind(
    redis_db: str, tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While catch-up handles a page of Redis entries (pages of 2 here), the offloader archives
    and trims the rest of what it was reading: the next page comes back empty. That is not
    the end of the stream: catch-up goes back to the archive, and hands every entry over once,
    in order. It used to stop there, the group left behind the stream's first entry."""
    from eventbus.tier import catchup_shard

    monkeypatch.setattr(catchup_shard, "TAIL_COUNT", 2)
    bus = make_bus(redis_db, shards=1)
    async with bus:
        growing = await _growing(bus, tmp_path, feeds=1)
        store = growing.offloader.store
        stats = await catch_up_group(bus.redis, store, "grow", "g", growing, shards=1)
        assert growing.got == growing.published and len(growing.got) == 40
        assert stats.lost_ranges == 0
        assert await _delivered(bus, "grow", "g") == growing.published[-1]
    await bus.aclose()


async def test_a_catch_up_the_offloader_keeps_trimming_past_stops_after_max_rounds(
    redis_db: str, tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The stream grows faster than catch-up handles it and the offloader trims behind it: each
    entry handled from Redis brings 20 more, and every pass over the archive then Redis ends
    behind the stream's first entry again. Catch-up must stop after `MAX_ROUNDS` passes with
    `CatchUpOutpaced` naming the shard and how far behind it is, not run on for ever; the
    group keeps the progress it made."""
    from eventbus.tier import catchup_shard
    from eventbus.tier.catchup_shard import MAX_ROUNDS
    from eventbus.tier.errors import CatchUpOutpaced

    monkeypatch.setattr(catchup_shard, "TAIL_COUNT", 2)
    bus = make_bus(redis_db, shards=1)
    async with bus:
        # 3 x MAX_ROUNDS feeds: an unbounded catch-up would end (wrongly) after them
        growing = await _growing(bus, tmp_path, feeds=3 * MAX_ROUNDS)
        store = growing.offloader.store
        with pytest.raises(CatchUpOutpaced) as caught:
            await catch_up_group(bus.redis, store, "grow", "g", growing, shards=1)
        err = caught.value
        assert (err.topic, err.group, err.shard, err.rounds) == ("grow", "g", 0, MAX_ROUNDS)
        assert f"shard 0 is still behind its stream's first entry after {MAX_ROUNDS}" in str(err)
        assert str(err.delivered) == await _delivered(bus, "grow", "g") == growing.got[-1]
        assert err.first > err.delivered.next() and err.last == parse_id(growing.published[-1])
        assert err.behind_s == (err.last.ms - err.delivered.ms) / 1000
        assert growing.got == growing.published[: len(growing.got)]  # in order, none twice
        assert growing.feeds > 0  # stopped by the bound, not by the stream
        with pytest.raises(ValueError, match="max_rounds must be >= 1"):
            await catch_up_group(bus.redis, store, "grow", "g", growing, shards=1, max_rounds=0)
    await bus.aclose()

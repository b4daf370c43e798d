"""Crash safety, racing offloaders, gap detection and corrupt segments."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import obstore
import pytest
import redis.asyncio
from prometheus_client import REGISTRY
from support import Tick, running
from tier_support import assert_no_overlap, fast_tier, make_bus, publish_ticks, wait_until

from eventbus import EventBus, Settings
from eventbus.tier.errors import CorruptSegment, StoreError
from eventbus.tier.layout import gap_prefix, parse_segment_key
from eventbus.tier.offloader import Offloader
from eventbus.tier.replay import iter_topic
from eventbus.tier.settings import OFFLOADER_GROUP
from eventbus.tier.store import list_keys_sync, open_store
from eventbus.tier.verify import verify_archive

pytestmark = [pytest.mark.anyio, pytest.mark.integration]


class Crash(Exception):
    """Stands for the process dying at a hook point."""


def segment_keys(store, topic: str) -> list[str]:
    return [k for k, _ in list_keys_sync(store, f"{topic}/") if parse_segment_key(k)]


@pytest.mark.parametrize(
    "point", ["before_put", "after_put", "after_put_intent_lost", "after_commit"]
)
async def test_crash_at_any_point_loses_and_duplicates_nothing(
    redis_db: str, store_url: str, point: str
) -> None:
    bus = make_bus(redis_db, shards=1)
    store = open_store(store_url)
    hook_point = point.removesuffix("_intent_lost")

    async def crash(at: str, shard: int, key: str) -> None:
        if at == hook_point:
            raise Crash(at)

    async with bus:
        published = await publish_ticks(bus, "orders", 700)
        first = Offloader(
            bus.redis,
            store,
            settings=bus.settings,
            tier=fast_tier(segment_max_entries=500),
            consumer_id="offloader-a",
            hook=crash,
        )
        with pytest.raises(Crash):
            await first.run_until_caught_up(timeout_s=20)
        cps = bus.keys.checkpoints("orders")
        stream = bus.keys.stream("orders", 0)
        keys_after_crash = segment_keys(store, "orders")
        etags = {k: obstore.head(store, k)["e_tag"] for k in keys_after_crash}
        if hook_point == "before_put":
            assert keys_after_crash == [] and await bus.redis.hget(cps, "0:pending")
        elif hook_point == "after_put":
            assert len(keys_after_crash) == 1 and await bus.redis.hget(cps, "0") is None
            assert await bus.redis.xlen(stream) == 700  # nothing trimmed before the checkpoint
        else:
            assert len(keys_after_crash) == 1 and await bus.redis.hget(cps, "0") is not None
        if point == "after_put_intent_lost":  # e.g. Redis lost the intent: listing finds it
            await bus.redis.hdel(cps, "0:pending")

        second = Offloader(
            bus.redis, store, settings=bus.settings, tier=fast_tier(segment_max_entries=500)
        )
        stats = await second.run_until_caught_up(timeout_s=20)
        report = verify_archive(store, "orders", expected_entry_ids=published)
        assert report.exactly_once and report.entries == 700, report
        assert_no_overlap(store, "orders")
        assert stats.adopted == (1 if hook_point == "after_put" else 0)
        for key, etag in etags.items():  # the object written before the crash was not rewritten
            assert obstore.head(store, key)["e_tag"] == etag
        assert await bus.redis.hget(cps, "0:pending") is None
        assert int(await bus.redis.hget(cps, "0:count")) == 700
        assert await bus.redis.xlen(stream) == 0
    await bus.aclose()


async def test_two_offloaders_share_shards_without_overlap(redis_db: str, store_url: str) -> None:
    bus = make_bus(redis_db, shards=8)
    store = open_store(store_url)
    tier = fast_tier(segment_max_entries=200, segment_max_age_s=0.05)
    async with bus:
        a = Offloader(bus.redis, store, settings=bus.settings, tier=tier, consumer_id="off-a")
        b = Offloader(bus.redis, store, settings=bus.settings, tier=tier, consumer_id="off-b")
        stop = anyio.Event()
        published: list[str] = []
        async with anyio.create_task_group() as tg:
            tg.start_soon(a.run, stop)
            tg.start_soon(b.run, stop)
            for i in range(10):
                published += await publish_ticks(bus, "shared", 300, start=i * 300)
            await wait_until(lambda: a.stats.entries + b.stats.entries >= 3000)
            stop.set()
        assert a.stats.entries > 0 and b.stats.entries > 0  # fair share: both did work
        report = verify_archive(store, "shared", expected_entry_ids=published)
        assert report.exactly_once and report.entries == 3000, report
        assert_no_overlap(store, "shared")
    await bus.aclose()


async def test_paused_owner_is_fenced_and_its_late_put_changes_nothing(
    redis_db: str, store_url: str
) -> None:
    """Offloader A pauses between recording its segment and putting it; its liveness lapses; B
    takes the shard over, finishes A's segment under the same key and goes on. When A wakes up
    its put finds the object (create-only) and its checkpoint commit is refused (fencing)."""
    bus = make_bus(redis_db, shards=1)
    store = open_store(store_url)
    reached, resume = anyio.Event(), anyio.Event()

    async def pause_once(at: str, shard: int, key: str) -> None:
        if at == "before_put" and not reached.is_set():
            reached.set()
            await resume.wait()

    async with bus:
        published = await publish_ticks(bus, "race", 600)
        tier = fast_tier(segment_max_entries=250)
        a = Offloader(
            bus.redis, store, settings=bus.settings, tier=tier, consumer_id="off-a", hook=pause_once
        )
        b = Offloader(bus.redis, store, settings=bus.settings, tier=tier, consumer_id="off-b")
        async with anyio.create_task_group() as tg:
            tg.start_soon(partial(a.round, flush=True))
            await reached.wait()
            # A's liveness expires (a paused process stops heartbeating)
            await bus.redis.zrem(bus.keys.members("race", OFFLOADER_GROUP), "off-a")
            await b.run_until_caught_up(timeout_s=20)
            resume.set()
        assert a.stats.segments == 0 and a.stats.adopted == 1  # A found its key already stored
        assert b.stats.entries == 600
        report = verify_archive(store, "race", expected_entry_ids=published)
        assert report.exactly_once and report.segments == 3, report
        assert_no_overlap(store, "race")
        cp = await bus.redis.hget(bus.keys.checkpoints("race"), "0")
        assert cp == published[-1].encode()  # A's refused commit did not move it back
    await bus.aclose()


def _gauge(name: str, topic: str) -> float:
    return REGISTRY.get_sample_value(name, {"topic": topic}) or 0.0


async def test_gap_detected_recorded_counted_and_logged(
    redis_db: str, store_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    bus = make_bus(redis_db, shards=1)
    bus.topic("lossy", shards=1, maxlen=100)
    store = open_store(store_url)
    before_gaps = _gauge("eventbus_tier_gaps_total", "lossy")
    before_lost = _gauge("eventbus_tier_lost_entries_total", "lossy")
    async with bus:
        published = await publish_ticks(bus, "lossy", 50)
        await Offloader(
            bus.redis, store, settings=bus.settings, tier=fast_tier()
        ).run_until_caught_up(20)
        # the offloader is down while 1000 more arrive: MAXLEN ~ 100 trims most of them
        published += await publish_ticks(bus, "lossy", 1000, start=50)
        remaining = await bus.redis.xlen(bus.keys.stream("lossy", 0))
        assert remaining < 1000
        caplog.set_level(logging.ERROR, logger="eventbus.tier")
        stats = await Offloader(
            bus.redis, store, settings=bus.settings, tier=fast_tier()
        ).run_until_caught_up(20)
        lost = 1000 - remaining
        assert (stats.gaps, stats.lost, stats.entries) == (1, lost, remaining)
        gap_keys = [k for k, _ in list_keys_sync(store, gap_prefix("lossy", 0))]
        assert len(gap_keys) == 1
        record = json.loads(bytes(obstore.get(store, gap_keys[0]).bytes()))
        assert record["lost_entries"] == lost and record["topic"] == "lossy"
        assert record["after"] == published[49]  # the last archived entry
        assert record["before"] == published[50 + lost]  # the first entry that survived
        assert _gauge("eventbus_tier_gaps_total", "lossy") == before_gaps + 1
        assert _gauge("eventbus_tier_lost_entries_total", "lossy") == before_lost + lost
        assert any("LOST" in r.getMessage() and str(lost) in r.getMessage() for r in caplog.records)
        report = verify_archive(store, "lossy")
        assert report.entries == 50 + remaining and report.gap_records == 1
        # nothing new: no second gap
        again = await Offloader(
            bus.redis, store, settings=bus.settings, tier=fast_tier()
        ).run_until_caught_up(20)
        assert again.gaps == 0
        # an XDEL of an unarchived entry is a gap of unknown size
        more = await publish_ticks(bus, "lossy", 20, start=2000)
        await bus.redis.xdel(bus.keys.stream("lossy", 0), more[5])
        third = await Offloader(
            bus.redis, store, settings=bus.settings, tier=fast_tier()
        ).run_until_caught_up(20)
        assert third.gaps == 1 and third.entries == 19
        assert len(list_keys_sync(store, gap_prefix("lossy", 0))) == 2
    await bus.aclose()


async def test_corrupt_segment_is_reported_never_replayed(redis_db: str, store_url: str) -> None:
    bus = make_bus(redis_db, shards=1)
    store = open_store(store_url)
    async with bus:
        await publish_ticks(bus, "fragile", 900)
        await Offloader(
            bus.redis, store, settings=bus.settings, tier=fast_tier()
        ).run_until_caught_up(20)
    await bus.aclose()
    keys = segment_keys(store, "fragile")
    assert len(keys) == 3
    good = list(iter_topic(store, "fragile"))
    victim = keys[1]
    data = bytes(obstore.get(store, victim).bytes())
    mid = len(data) // 2  # inside the data pages (CRC-checked)
    flipped = data[:mid] + bytes([data[mid] ^ 0xFF]) + data[mid + 1 :]
    for damaged in (flipped, data[: len(data) // 2]):
        obstore.put(store, victim, damaged)
        seen = []
        with pytest.raises(CorruptSegment, match=re.escape(victim)):
            for entry in iter_topic(store, "fragile"):
                seen.append(entry)
        assert seen == good[: len(seen)] and len(seen) <= 300  # only the intact first segment
        with pytest.raises(CorruptSegment, match=re.escape(victim)):
            verify_archive(store, "fragile")


async def test_offloader_refuses_to_adopt_a_corrupt_object(redis_db: str, tmp_path) -> None:
    bus = make_bus(redis_db, shards=1)
    store = open_store(str(tmp_path))

    async def crash(at: str, shard: int, key: str) -> None:
        if at == "after_put":
            raise Crash(key)

    async with bus:
        await publish_ticks(bus, "bad", 100)
        with pytest.raises(Crash) as crashed:
            await Offloader(
                bus.redis, store, settings=bus.settings, tier=fast_tier(), hook=crash
            ).run_until_caught_up(20)
        key = str(crashed.value)
        obstore.put(store, key, b"PAR1 not really")
        with pytest.raises(CorruptSegment, match=re.escape(key)):
            await Offloader(
                bus.redis, store, settings=bus.settings, tier=fast_tier()
            ).run_until_caught_up(20)
        assert await bus.redis.hget(bus.keys.checkpoints("bad"), "0") is None  # not advanced
    await bus.aclose()


@pytest.mark.parametrize("failure", [Crash, StoreError], ids=["crash", "store error"])
async def test_a_gap_accounted_but_not_yet_recorded_is_recorded_once(
    redis_db: str, store_url: str, failure: type[Exception]
) -> None:
    """The offloader accounts a gap in Redis (fenced, ``<shard>:gap`` kept), then stores its
    record. Stopped in between, the next owner's recovery stores it (a crash), or its own next
    round does (a failed put): one record, the loss counted once."""
    bus = make_bus(redis_db, shards=1)
    bus.topic("lossy", shards=1, maxlen=100)
    store = open_store(store_url)
    failed: list[str] = []

    async def fail_once(at: str, shard: int, key: str) -> None:
        if at == "gap_accounted" and not failed:
            failed.append(key)
            raise failure(key)

    async with bus:
        await publish_ticks(bus, "lossy", 50)
        await Offloader(
            bus.redis, store, settings=bus.settings, tier=fast_tier()
        ).run_until_caught_up(20)
        await publish_ticks(bus, "lossy", 1000, start=50)  # MAXLEN ~ 100 trims most
        remaining = await bus.redis.xlen(bus.keys.stream("lossy", 0))
        lost = 1000 - remaining
        cps = bus.keys.checkpoints("lossy")
        first = Offloader(bus.redis, store, settings=bus.settings, tier=fast_tier(), hook=fail_once)
        if failure is Crash:
            with pytest.raises(Crash):
                await first.run_until_caught_up(20)
            # accounted, not recorded: the next owner must record it
            assert list_keys_sync(store, gap_prefix("lossy", 0)) == []
            assert int(await bus.redis.hget(cps, "0:count")) == 50 + lost
            assert json.loads(await bus.redis.hget(cps, "0:gap"))["lost_entries"] == lost
            stats = await Offloader(
                bus.redis, store, settings=bus.settings, tier=fast_tier()
            ).run_until_caught_up(20)
        else:
            stats = await first.run_until_caught_up(20)
        assert (stats.gaps, stats.lost, stats.entries) == (1, lost, remaining)
        gap_keys = [k for k, _ in list_keys_sync(store, gap_prefix("lossy", 0))]
        assert gap_keys == failed
        record = json.loads(bytes(obstore.get(store, gap_keys[0]).bytes()))
        assert record["lost_entries"] == lost
        assert int(await bus.redis.hget(cps, "0:count")) == 1050
        assert await bus.redis.hget(cps, "0:gap") is None
        report = verify_archive(store, "lossy")
        assert report.entries == 50 + remaining and report.gap_records == 1
    await bus.aclose()


async def test_a_pending_segment_that_lost_entries_is_recorded_once_across_a_crash(
    redis_db: str, store_url: str
) -> None:
    """A pending intent whose range lost entries before it was re-written: the next owner
    commits the segment and accounts the gap in one step; a crash before its record is stored
    leaves the record to the owner after it, and the loss is counted once."""
    bus = make_bus(redis_db, shards=1)
    store = open_store(store_url)

    def crash_at(point: str) -> Any:
        async def crash(at: str, shard: int, key: str) -> None:
            if at == point:
                raise Crash(key)

        return crash

    async with bus:
        published = await publish_ticks(bus, "pending", 200)
        tier = fast_tier(segment_max_entries=500)
        with pytest.raises(Crash):  # the intent of 200 entries is recorded, nothing stored
            await Offloader(
                bus.redis, store, settings=bus.settings, tier=tier, hook=crash_at("before_put")
            ).run_until_caught_up(20)
        stream, cps = bus.keys.stream("pending", 0), bus.keys.checkpoints("pending")
        await bus.redis.xtrim(
            stream, minid=published[30], approximate=False
        )  # 30 of them leave Redis unarchived
        with pytest.raises(Crash) as crashed:
            await Offloader(
                bus.redis, store, settings=bus.settings, tier=tier, hook=crash_at("gap_accounted")
            ).run_until_caught_up(20)
        assert await bus.redis.hget(cps, "0:pending") is None
        assert int(await bus.redis.hget(cps, "0:count")) == 200  # 170 archived + 30 lost
        assert list_keys_sync(store, gap_prefix("pending", 0)) == []
        stats = await Offloader(
            bus.redis, store, settings=bus.settings, tier=tier
        ).run_until_caught_up(20)
        assert (stats.gaps, stats.lost) == (1, 30)
        assert [k for k, _ in list_keys_sync(store, gap_prefix("pending", 0))] == [
            str(crashed.value)
        ]
        assert int(await bus.redis.hget(cps, "0:count")) == 200
        assert await bus.redis.hget(cps, "0:gap") is None
        report = verify_archive(store, "pending")
        assert report.entries == 170 and report.gap_records == 1
    await bus.aclose()


async def test_no_loss_is_reported_for_a_new_group_when_nothing_was_trimmed(
    settings: Callable[..., Settings], caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    """Loss is never silent, and never invented (semantics.md "Stream caps"; tier.md gaps).

    `ShardCatchUp.behind` returns True whenever the stream's first entry lies after the
    successor of the group's last-delivered ID and the offloader has no checkpoint for the
    shard (catchup_shard.py: ``if checkpoint.last is None ...: return True``). A group created
    at ``0`` (``start="beginning"``, the default) has last-delivered ``0-0``, and any entry ID
    lies after ``0-1``; so the first consumer with an archive that takes the shard before the
    offloader archived anything logs at ERROR that the entries up to the stream's first one
    "were trimmed from Redis and are not in any segment: lost before archiving", although
    nothing ever left the stream (``entries-added`` equals its length).
    """
    store = open_store(str(tmp_path / "segments"))
    bus = EventBus(settings(shards=1), archive=store)
    seen: list[int] = []

    @bus.subscriber("t", group="g")
    async def handle(event: Tick) -> None:
        seen.append(event.seq)

    for seq in range(3):  # published before the group's consumers start; nothing trimmed
        await bus.publish("t", Tick(resource="x", seq=seq), resource_id="x")
    caplog.set_level("ERROR", logger="eventbus")
    async with running(bus):
        await wait_until(lambda: seen == [0, 1, 2])
    false_alarms = [r.getMessage() for r in caplog.records if "lost before" in r.getMessage()]
    assert not false_alarms, false_alarms


class _PausedBeforeGapCheck:
    """Stands in for an offloader's Redis client (every command passes through), but once
    `armed`, its next ``XINFO STREAM`` (the gap check that opens `ShardOffload.work`) waits
    for `resume`, setting `paused` first: a process stopped (GC, SIGSTOP) between its lock round
    and its gap check."""

    def __init__(self, real: Any) -> None:
        self.real = real
        self.armed = False
        self.paused = anyio.Event()
        self.resume = anyio.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)

    async def xinfo_stream(self, *args: Any, **kwargs: Any) -> Any:
        if self.armed:
            self.armed = False
            self.paused.set()
            await self.resume.wait()
        return await self.real.xinfo_stream(*args, **kwargs)


@pytest.mark.single_node("two offloaders of one shard; the same on a cluster")
async def test_an_offloader_that_lost_its_shard_records_no_gap(
    settings: Callable[..., Settings],
    r: redis.asyncio.Redis,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Loss is never silent, and never invented (tier.md "Gaps", "Racing offloaders": a paused
    offloader's late steps are fenced off; `ArchiveReport.exactly_once`).

    `ShardOffload.work` starts with the gap check: ``XINFO STREAM``, then `find_gap` with the
    offloader's own `count` and read position, then `gap` writes the gap record to the store
    (create-only, unfenced), counts and logs it, and only then `account_lost` runs the fenced
    script, which refuses. Offloader A archives x:0..x:2 and takes its next round's lock; it
    pauses before that round's gap check, past its liveness. B takes the shard, archives
    x:3..x:5 and trims them. A resumes: the stream's first entry lies after A's position and
    3 entries left it that A's count does not know, so A records "LOST 3 entries" between x:2
    and the end, logs it at ERROR, and only then is fenced off. The archive is complete, but
    its gap record says otherwise for ever (`verify_archive` reports it, `eventbus replay`'s
    completeness check counts it as accounted: it would excuse a missing segment of 3).
    """
    from eventbus.tier.gaps import gap_records
    from eventbus.tier.settings import OFFLOADER_GROUP

    store = open_store(str(tmp_path / "segments"))
    s = settings(shards=1)
    bus = EventBus(s)
    paused = _PausedBeforeGapCheck(bus.redis)
    a = Offloader(paused, store, settings=s, tier=fast_tier(), consumer_id="offloader-a")
    b = Offloader(bus.redis, store, settings=s, tier=fast_tier(), consumer_id="offloader-b")
    try:
        for seq in range(3):
            await bus.publish("t", Tick(resource="x", seq=seq), resource_id="x")
        await a.round(flush=True)  # A: takes shard 0, archives x:0..x:2, trims
        for seq in (3, 4, 5):
            await bus.publish("t", Tick(resource="x", seq=seq), resource_id="x")
        paused.armed = True
        caplog.set_level("ERROR", logger="eventbus.tier")
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: a.round(flush=True))
            with anyio.fail_after(20):
                await paused.paused.wait()  # A holds the lock, before its gap check
            # A's liveness lapses (its deadline passes while it is stopped)
            await r.zadd(bus.keys.members("t", OFFLOADER_GROUP), {"offloader-a": 0})
            await b.round(flush=True)  # B: takes shard 0, archives x:3..x:5, trims
            assert await r.hget(bus.keys.locks("t", OFFLOADER_GROUP), "0") == b"offloader-b"
            assert await r.xlen(bus.keys.stream("t", 0)) == 0
            paused.resume.set()  # A wakes up
        gaps = gap_records(store, "t", 0)
    finally:
        await a.close()
        await b.close()
        await bus.aclose()
    lost = [rec.getMessage() for rec in caplog.records if "LOST" in rec.getMessage()]
    assert (gaps, lost) == ([], []), (
        f"every entry is archived, but the lapsed offloader recorded gaps {gaps} and logged {lost}"
    )

"""Offloader against a real redis-server and a real store (local folder, S3 on moto)."""

from __future__ import annotations

import pytest
from support import async_client
from tier_support import (
    Tick,
    Tock,
    assert_no_overlap,
    fast_tier,
    ids,
    make_bus,
    publish_ticks,
    wait_until,
)

from eventbus.protocol.ids import EntryId
from eventbus.tier.offloader import Offloader, offload_until_caught_up
from eventbus.tier.replay import ReplayFilter, iter_events, iter_shard, iter_topic
from eventbus.tier.store import open_store
from eventbus.tier.verify import verify_archive

pytestmark = [pytest.mark.anyio, pytest.mark.integration]


async def test_offload_archives_everything_once_then_trims(redis_db: str, store_url: str) -> None:
    bus = make_bus(redis_db, shards=4)
    store = open_store(store_url)
    async with bus:
        published = await publish_ticks(bus, "ticks", 2000)
        stats = await offload_until_caught_up(
            bus.redis, store, settings=bus.settings, tier=fast_tier(), timeout_s=30
        )
        assert stats.entries == 2000 and stats.segments >= 8  # 300 entries per segment at most
        assert stats.stored_bytes < stats.raw_bytes  # zstd did something
        report = verify_archive(store, "ticks", expected_entry_ids=published)
        assert report.exactly_once and report.entries == 2000, report
        assert_no_overlap(store, "ticks")
        # checkpoints at each shard's last entry; streams trimmed (hot window 0, exact trim)
        cps = await bus.redis.hgetall(bus.keys.checkpoints("ticks"))
        for shard in range(4):
            last = (await bus.redis.xinfo_stream(bus.keys.stream("ticks", shard)))[
                "last-generated-id"
            ]
            assert cps[str(shard).encode()] == last
            assert await bus.redis.xlen(bus.keys.stream("ticks", shard)) == 0
            assert int(cps[f"{shard}:count".encode()]) == report.per_shard[shard]
        # a second pass finds nothing new
        again = await offload_until_caught_up(
            bus.redis, store, settings=bus.settings, tier=fast_tier(), timeout_s=30
        )
        assert again.segments == 0 and again.adopted == 0
    await bus.aclose()


async def test_hot_window_keeps_recent_entries_in_redis(redis_db: str, tmp_path) -> None:
    bus = make_bus(redis_db, shards=2)
    store = open_store(str(tmp_path))
    async with bus:
        await publish_ticks(bus, "ticks", 500)
        await offload_until_caught_up(
            bus.redis, store, settings=bus.settings, tier=fast_tier(hot_window_s=3600), timeout_s=30
        )
        assert verify_archive(store, "ticks").entries == 500
        lengths = [await bus.redis.xlen(bus.keys.stream("ticks", s)) for s in range(2)]
        assert sum(lengths) == 500  # archived, but younger than the hot window: kept
    await bus.aclose()


async def test_size_and_age_triggers(redis_db: str, tmp_path) -> None:
    """Without flushing, a round writes only full segments; the age trigger writes the rest."""
    bus = make_bus(redis_db, shards=1)
    store = open_store(str(tmp_path))
    async with bus:
        await publish_ticks(bus, "ticks", 250)
        off = Offloader(
            bus.redis,
            store,
            settings=bus.settings,
            tier=fast_tier(segment_max_entries=100, segment_max_age_s=3600),
        )
        await off.round()
        assert (off.stats.segments, off.stats.entries) == (2, 200)  # 50 wait for size or age
        off.tier = fast_tier(segment_max_entries=100, segment_max_age_s=0)
        await off.round()
        assert (off.stats.segments, off.stats.entries) == (3, 250)
        await off.close()
    await bus.aclose()


async def test_replay_order_and_filters(redis_db: str, store_url: str) -> None:
    bus = make_bus(redis_db, shards=4)
    store = open_store(store_url)
    async with bus:
        published = await publish_ticks(bus, "mixed", 1200, resources=10)
        published += await bus.publish_many(
            "mixed", [(f"res-{i % 10}", Tock(resource=f"res-{i % 10}", n=i)) for i in range(300)]
        )
        await offload_until_caught_up(
            bus.redis, store, settings=bus.settings, tier=fast_tier(), timeout_s=30
        )
    await bus.aclose()

    merged = list(iter_topic(store, "mixed"))
    assert [e.entry_id for e in merged] == ids(published)  # one entry-ID order across shards
    per_shard = list(iter_topic(store, "mixed", merge=False))
    assert [e.shard for e in per_shard] == sorted(e.shard for e in per_shard)
    for shard in range(4):
        got = [e.entry_id for e in iter_shard(store, "mixed", shard)]
        assert got == sorted(got) and got == [e.entry_id for e in per_shard if e.shard == shard]

    # resource and type filters
    only = list(iter_topic(store, "mixed", ReplayFilter(resource_ids=frozenset({"res-3"}))))
    assert {e.resource_id for e in only} == {"res-3"} and len(only) == 150
    tocks = list(iter_topic(store, "mixed", ReplayFilter(event_types=frozenset({"Tock"}))))
    assert len(tocks) == 300 and {e.event_type for e in tocks} == {"Tock"}
    # entry-ID range (inclusive) and time range (since inclusive, until exclusive)
    all_ids = ids(published)
    lo, hi = all_ids[100], all_ids[700]
    ranged = [e.entry_id for e in iter_topic(store, "mixed", ReplayFilter(start_id=lo, end_id=hi))]
    assert ranged == [i for i in all_ids if lo <= i <= hi]  # IDs may repeat across shards
    since, until = all_ids[200].ms, all_ids[900].ms
    timed = [
        e.entry_id for e in iter_topic(store, "mixed", ReplayFilter(since_ms=since, until_ms=until))
    ]
    assert timed == [i for i in all_ids if since <= i.ms < until]
    # until the epoch (exclusive): nothing is before it (0 once set no upper bound at all)
    assert list(iter_topic(store, "mixed", ReplayFilter(until_ms=0))) == []

    # typed replay: same models as live consumers, unknown types skipped
    ticks = list(
        iter_events(store, "mixed", [Tick], ReplayFilter(resource_ids=frozenset({"res-1"})))
    )
    assert [r.event.seq for r in ticks] == list(range(1, 1200, 10))  # type: ignore[attr-defined]
    assert all(isinstance(r.event, Tick) and r.entry.resource_id == "res-1" for r in ticks)


async def test_offloader_in_background_with_size_age_and_stop(redis_db: str, tmp_path) -> None:
    """`run` keeps archiving as events arrive and releases its locks on stop."""
    import anyio

    bus = make_bus(redis_db, shards=2)
    store = open_store(str(tmp_path))
    async with bus:
        off = Offloader(
            bus.redis, store, settings=bus.settings, tier=fast_tier(segment_max_age_s=0.05)
        )
        stop = anyio.Event()
        async with anyio.create_task_group() as tg:
            tg.start_soon(off.run, stop)
            published = await publish_ticks(bus, "live", 300)
            await wait_until(lambda: off.stats.entries >= 300)
            published += await publish_ticks(bus, "live", 200, start=300)
            await wait_until(lambda: off.stats.entries >= 500)
            stop.set()
        assert verify_archive(store, "live", expected_entry_ids=published).exactly_once
        locks = await bus.redis.hgetall(bus.keys.locks("live", "_offloader"))
        assert not [k for k in locks if not k.endswith(b":token")]  # released
    await bus.aclose()


async def test_offload_all_registered_topics(redis_db: str, tmp_path) -> None:
    bus = make_bus(redis_db, shards=2)
    store = open_store(str(tmp_path))
    async with bus:
        a = await publish_ticks(bus, "alpha", 100)
        b = await publish_ticks(bus, "beta", 50)
        stats = await offload_until_caught_up(
            bus.redis, store, settings=bus.settings, tier=fast_tier(), timeout_s=30
        )
    await bus.aclose()
    assert stats.entries == 150
    assert verify_archive(store, "alpha", expected_entry_ids=a).exactly_once
    assert verify_archive(store, "beta", expected_entry_ids=b).exactly_once


async def test_entry_id_bounds_cover_64_bit_ids(redis_db: str, tmp_path) -> None:
    """Explicit huge entry IDs (beyond float precision) keep exact order in keys and Lua."""
    client = async_client(redis_db)
    bus = make_bus(redis_db, shards=1)
    async with bus:
        await publish_ticks(bus, "big", 1)  # registers the topic
        stream = bus.keys.stream("big", 0)
        first = await client.xrange(stream)
        huge = [f"{2**53 + 1}-{i}" for i in range(3)] + [f"{2**60}-{2**62}"]
        for entry_id in huge:
            await client.xadd(stream, first[0][1], id=entry_id)
        store = open_store(str(tmp_path))
        await offload_until_caught_up(
            bus.redis,
            store,
            settings=bus.settings,
            tier=fast_tier(segment_max_entries=2),
            timeout_s=30,
        )
        got = [e.entry_id for e in iter_topic(store, "big")]
        assert got[1:] == [EntryId(2**53 + 1, i) for i in range(3)] + [EntryId(2**60, 2**62)]
        cp = await client.hget(bus.keys.checkpoints("big"), "0")
        assert cp == f"{2**60}-{2**62}".encode()
    await bus.aclose()
    await client.aclose()


async def test_typed_replay_names_segment_and_entry_of_a_bad_payload(
    redis_db: str, tmp_path
) -> None:
    from eventbus.errors import DecodeError
    from eventbus.protocol.codec import Envelope, new_event_id

    bus = make_bus(redis_db, shards=1)
    store = open_store(str(tmp_path))
    async with bus:
        await publish_ticks(bus, "typed", 3)
        bad = Envelope("res-0", "Tick", new_event_id(), 1, {}, {"resource": "res-0", "seq": "x"})
        bad_id = await bus.publisher.publish_envelope(bus.topic("typed"), bad)
        await offload_until_caught_up(
            bus.redis, store, settings=bus.settings, tier=fast_tier(), timeout_s=30
        )
    await bus.aclose()
    got = []
    with pytest.raises(DecodeError, match=rf"typed/shard=0/.*\.parquet entry {bad_id}: payload"):
        for replayed in iter_events(store, "typed", [Tick]):
            got.append(replayed.event.seq)  # type: ignore[attr-defined]
    assert got == [0, 1, 2]
    assert len(list(iter_events(store, "typed", [Tock]))) == 0  # other types are skipped


async def test_a_segment_ends_at_the_entry_that_reaches_segment_max_bytes(
    redis_db: str, tmp_path
) -> None:
    """With `segment_max_bytes` the buffer is cut after the entry whose bytes (field names and
    values, counted from the raw replies) reach it: every segment but a shard's last reaches
    the size, and without its last entry it would not."""
    import pyarrow.parquet as pq

    bus = make_bus(redis_db, shards=2)
    store = open_store(str(tmp_path))
    async with bus:
        published = await publish_ticks(bus, "ticks", 400)
        tier = fast_tier(segment_max_entries=100_000, segment_max_bytes=4096)
        await offload_until_caught_up(bus.redis, store, settings=bus.settings, tier=tier)
        assert verify_archive(store, "ticks", expected_entry_ids=published).exactly_once
    await bus.aclose()
    for shard in (0, 1):
        files = sorted((tmp_path / "ticks" / f"shard={shard}").glob("*.parquet"))
        assert len(files) > 2
        for i, f in enumerate(files):
            table = pq.read_table(f, columns=["resource_id", "event_type", "data"])
            sizes = [
                len(b"rid")
                + len(r["resource_id"])
                + len(b"type")
                + len(r["event_type"])
                + len(b"data")
                + len(r["data"])
                for r in table.to_pylist()
            ]
            assert int(pq.read_metadata(f).metadata[b"eventbus.raw_bytes"]) == sum(sizes)
            assert sum(sizes[:-1]) < 4096  # no entry was held back past the size
            if i < len(files) - 1:  # a shard's last segment: what was left when it ran out
                assert sum(sizes) >= 4096

"""Entries compressed with a topic's zstd dictionary, through the durable tier: the offloader
copies the dictionary beside the segments, and a replay in a process that never saw it (cache
emptied, Redis flushed) decodes every entry from the archive alone."""

from __future__ import annotations

from pathlib import Path

import pytest
from tier_support import Tick, fast_tier, make_bus, publish_ticks

from eventbus import EventBus, Settings
from eventbus.cli.topic import sample_bodies
from eventbus.protocol import compression
from eventbus.protocol.dictionaries import CACHE, Dictionaries, dictionary_id
from eventbus.tier.layout import dictionary_key
from eventbus.tier.offloader import offload_until_caught_up
from eventbus.tier.replay import iter_events
from eventbus.tier.store import get_bytes_sync, open_store

pytestmark = [pytest.mark.anyio, pytest.mark.integration]


def forget_dictionaries() -> None:
    CACHE._dicts.clear()
    CACHE._missing.clear()
    compression.clear()


async def test_offloaded_dictionary_entries_replay_without_redis(redis_db: str, tmp_path) -> None:
    forget_dictionaries()
    bus = make_bus(redis_db, shards=2)
    store = open_store(str(tmp_path))
    async with bus:
        await publish_ticks(bus, "ticks", 400)
        dicts = Dictionaries(bus.redis, bus.keys)
        dict_id = await dicts.train(
            "ticks", await sample_bodies(bus, dicts, "ticks", 400, bus.settings), 2048
        )
        bus.publisher.dictionaries._current.clear()
        for i in range(400, 500):
            await bus.publish(
                "ticks", Tick(resource=f"res-{i % 13}", seq=i), resource_id=f"res-{i % 13}"
            )
        streams = [bus.keys.stream("ticks", s) for s in range(2)]
        stored = [f for st in streams for _, f in await bus.redis.xrange(st)]
        assert sum(dictionary_id(f[b"data"]) == dict_id for f in stored) == 100
        forget_dictionaries()  # the offloader loads it from Redis
        await offload_until_caught_up(
            bus.redis, store, settings=bus.settings, tier=fast_tier(), timeout_s=30
        )
        assert get_bytes_sync(store, dictionary_key("ticks", dict_id))
        await bus.redis.flushdb()  # Redis forgets everything: the archive must be enough
    await bus.aclose()
    forget_dictionaries()
    seqs = sorted(e.event.seq for e in iter_events(store, "ticks", [Tick]))
    assert seqs == list(range(500))


async def test_a_store_s_copied_dictionaries_are_forgotten_with_it(redis_db: str, tmp_path) -> None:
    # the offloader remembers the dictionaries it copied by id(store); a
    # store made later at a freed store's address (another folder or bucket) was taken for it,
    # and got no copy: its entries read back undecodable
    import gc

    from eventbus.tier import dictionaries as archived_dicts

    forget_dictionaries()
    bus = make_bus(redis_db, shards=1)
    async with bus:
        await publish_ticks(bus, "ticks", 200)
        dicts = Dictionaries(bus.redis, bus.keys)
        dict_id = await dicts.train(
            "ticks", await sample_bodies(bus, dicts, "ticks", 200, bus.settings), 2048
        )
        bus.publisher.dictionaries._current.clear()
        await bus.publish("ticks", Tick(resource="r", seq=1), resource_id="r")
        rows = await bus.redis.xrange(bus.keys.stream("ticks", 0))
        first = open_store(str(tmp_path / "a"))
        await archived_dicts.archive_dictionaries(bus.redis, bus.keys, first, "ticks", rows)
        sid = id(first)
        assert (sid, "ticks", dict_id) in archived_dicts._archived
        del first
        gc.collect()
        assert not any(key[0] == sid for key in archived_dicts._archived)
        second = open_store(str(tmp_path / "b"))  # copied again, whatever its address
        await archived_dicts.archive_dictionaries(bus.redis, bus.keys, second, "ticks", rows)
        assert get_bytes_sync(second, dictionary_key("ticks", dict_id))
    await bus.aclose()
    forget_dictionaries()


async def test_entries_compressed_with_a_dictionary_get_their_envelope_columns(
    redis_db: str, tmp_path
) -> None:
    """The offloader loads a dictionary from Redis before it encodes the segment whose entries
    use it: an offloader that never saw the dictionary still fills their envelope columns."""
    import pyarrow.parquet as pq

    forget_dictionaries()
    bus = make_bus(redis_db, shards=2)
    store = open_store(str(tmp_path))
    async with bus:
        await publish_ticks(bus, "ticks", 200)
        dicts = Dictionaries(bus.redis, bus.keys)
        await dicts.train(
            "ticks", await sample_bodies(bus, dicts, "ticks", 200, bus.settings), 2048
        )
        bus.publisher.dictionaries._current.clear()
        for i in range(200, 300):
            await bus.publish(
                "ticks", Tick(resource=f"res-{i % 13}", seq=i), resource_id=f"res-{i % 13}"
            )
        forget_dictionaries()  # an offloader process that never published
        await offload_until_caught_up(
            bus.redis, store, settings=bus.settings, tier=fast_tier(), timeout_s=30
        )
    await bus.aclose()
    files = sorted((tmp_path / "ticks").glob("*/*.parquet"))
    rows = [r for f in files for r in pq.read_table(f, columns=["event_id", "data"]).to_pylist()]
    assert len(rows) == 300
    compressed = [r for r in rows if dictionary_id(r["data"]) is not None]
    assert len(compressed) == 100
    assert all(r["event_id"] is not None for r in rows)


@pytest.mark.single_node("one shard stream; the same on a cluster")
async def test_a_dictionary_missing_from_redis_is_not_skipped_silently(
    redis_db: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Never swallow an error silently (tier/dictionaries.py `archive_dictionaries`: "One
    missing in Redis, refused by it ... or not valid ... is skipped with a WARNING and never
    copied: its entries are archived as they are and read back as undecodable").

    The code does ``if data is None: continue`` before the ``try`` whose ``except`` logs the
    WARNING: a dictionary absent from the topic's dictionary hash (deleted by an operator, a
    Redis restored without it) is skipped without a word, and the 10 entries compressed with
    it go into a segment that nothing can decode, with no log line naming the dictionary.
    """
    from eventbus.cli.topic import sample_bodies
    from eventbus.protocol import compression
    from eventbus.protocol.dictionaries import CACHE, Dictionaries, dictionary_id
    from eventbus.tier.offloader import offload_until_caught_up

    def forget_dictionaries() -> None:  # as tests/integration/tier/test_tier_dictionaries.py
        CACHE._dicts.clear()
        CACHE._missing.clear()
        compression.clear()

    forget_dictionaries()
    bus = EventBus(Settings(redis_url=redis_db, shards=1))
    store = open_store(str(tmp_path / "segments"))
    pad = "abcdefgh" * 8

    async def publish(seqs: range) -> None:
        for i in seqs:
            rid = f"r{i % 7}"
            await bus.publish("ticks", Tick(resource=rid, seq=i, pad=pad), resource_id=rid)

    try:
        async with bus:
            await publish(range(300))
            dicts = Dictionaries(bus.redis, bus.keys)
            samples = await sample_bodies(bus, dicts, "ticks", 300, bus.settings)
            dict_id = await dicts.train("ticks", samples, 2048)
            bus.publisher.dictionaries._current.clear()
            await publish(range(300, 310))  # compressed with the new dictionary
            rows = await bus.redis.xrange(bus.keys.stream("ticks", 0))
            assert sum(dictionary_id(f[b"data"]) == dict_id for _, f in rows) == 10
            await bus.redis.hdel(bus.keys.dictionaries("ticks"), str(dict_id))  # gone
            forget_dictionaries()
            caplog.set_level("WARNING", logger="eventbus")
            await offload_until_caught_up(
                bus.redis, store, settings=bus.settings, tier=fast_tier(), timeout_s=30
            )
    finally:
        await bus.aclose()
        forget_dictionaries()
    said = [rec.getMessage() for rec in caplog.records if str(dict_id) in rec.getMessage()]
    assert said, (
        f"10 entries compressed with dictionary {dict_id}, missing from Redis, were archived "
        "without any log line naming it"
    )

"""Per-topic zstd dictionaries (`eventbus.protocol.dictionaries`) on a real redis-server: training
from a topic's entries (library and CLI), rotation with old entries still readable, entries of an
older encoder (formats 0x01 and 0x02) consumed beside new ones, an unknown dictionary ID
dead-lettered with its reason, and the durable tier's copies read back."""

from __future__ import annotations

import random
from types import SimpleNamespace
from typing import Any, ClassVar

import anyio
import pytest
import zstandard
from cases import add925e_entries
from obstore.store import MemoryStore
from pydantic import BaseModel
from support import Recorder, Tick, running, total_pending, wait_until
from typer.testing import CliRunner

from eventbus import Context, EventBus, Settings
from eventbus.cli import app
from eventbus.cli.topic import sample_bodies
from eventbus.dlq import DeadLetters
from eventbus.protocol import compression
from eventbus.protocol.codec import F_DATA, F_RESOURCE, F_TYPE, decode_entry
from eventbus.protocol.dictionaries import CACHE, FORMAT_DICT_COMPACT, Dictionaries, dictionary_id
from eventbus.protocol.sharding import shard_of
from eventbus.tier.dictionaries import archive_dictionaries
from eventbus.tier.replay import plan

pytestmark = pytest.mark.anyio
TOPIC = "orders"


@pytest.fixture(autouse=True)
def _fresh_cache() -> None:
    forget_dictionaries()  # IDs restart with each flushed database


def forget_dictionaries() -> None:
    """Drop this process's cached dictionaries, as a fresh process would start."""
    CACHE._dicts.clear()
    CACHE._missing.clear()
    compression.clear()


async def publish(bus: EventBus, seqs: range) -> None:
    for i in seqs:
        rid = f"r{i % 7}"
        await bus.publish(
            TOPIC, Tick(resource=rid, seq=i, pad=f"pad {i % 13} " * 4), resource_id=rid
        )


async def stored_data(r: Any, bus: EventBus) -> list[bytes]:
    out = []
    for s in range(bus.topic(TOPIC).shards):
        out += [f[F_DATA] for _, f in await r.xrange(bus.keys.stream(TOPIC, s))]
    return out


async def train(bus: EventBus) -> int:
    d = Dictionaries(bus.redis, bus.keys)
    bodies = await sample_bodies(bus, d, TOPIC, 1000, bus.settings)
    dict_id = await d.train(TOPIC, bodies, size=2048)
    bus.publisher.dictionaries._current.clear()  # publishers pick it up within REFRESH_S
    return dict_id


async def test_train_rotate_and_old_entries_stay_readable(r: Any, settings: Any) -> None:
    bus = EventBus(settings())
    rec = Recorder()

    @bus.subscriber(TOPIC, group="g")
    async def handle(event: Tick, ctx: Context) -> None:
        rec.add(event, ctx)

    async with bus:
        await publish(bus, range(300))
        first = await train(bus)
        await publish(bus, range(300, 400))
        second = await train(bus)
        await publish(bus, range(400, 500))
    assert second != first
    ids = [dictionary_id(d) for d in await stored_data(r, bus)]
    assert (ids.count(None), ids.count(first), ids.count(second)) == (300, 100, 100)
    sizes = {i: [] for i in (None, first, second)}
    for d in await stored_data(r, bus):
        sizes[dictionary_id(d)].append(len(d))
    assert max(sizes[second]) < min(sizes[None])  # the point of it
    _, versions = await Dictionaries(r, bus.keys).versions(TOPIC)
    assert sorted(versions) == sorted([first, second])
    forget_dictionaries()  # the consumer loads both from Redis
    async with running(bus):
        await rec.wait_for(500)
        await wait_until(lambda: _drained(bus, r))
    assert sorted(h.seq for h in rec.log) == list(range(500))


async def _drained(bus: EventBus, r: Any) -> bool:
    return await total_pending(bus, TOPIC, "g", r) == 0


class Flight(BaseModel):
    """The events of tests/fixtures/codec/entries.json."""

    __event_type__: ClassVar[str] = "flights.Flight"
    position: int
    plane: str
    dep_delay: int | None
    origin: str
    dest: str
    distance: int


async def test_entries_of_an_older_encoder_are_consumed_beside_new_ones(
    r: Any, settings: Any
) -> None:
    """Entries of add925e's encoder without a dictionary (0x01, 0x02) stay in the shard streams
    across an upgrade: a fresh consumer handles them with their own event IDs and times, beside
    entries of format 0x05 with a dictionary it loads from Redis. (Its 0x04 entries, a dictionary
    format no release wrote, are refused: tests/unit/test_codec_formats.py.)"""
    old = add925e_entries.load()
    old["entries"] = [e for e in old["entries"] if not e["case"].startswith("0x04")]
    bus = EventBus(settings())
    rec = Recorder()
    seen: dict[int, tuple[Flight, Context]] = {}

    @bus.subscriber(TOPIC, group="g")
    async def handle(event: Flight, ctx: Context) -> None:
        seen[event.position] = (event, ctx)
        rec.add(SimpleNamespace(resource=event.plane, seq=event.position), ctx)  # type: ignore[arg-type]

    shards = bus.topic(TOPIC).shards
    await bus.registry.ensure(bus.topic(TOPIC))
    for e in old["entries"]:  # as the old publisher wrote them
        rid = e["envelope"]["resource_id"]
        await r.xadd(bus.keys.stream(TOPIC, shard_of(rid, shards)), add925e_entries.fields(e))
    rng = random.Random(3)
    new = [
        Flight(
            position=i,
            plane=f"N{rng.randrange(100, 999)}",
            dep_delay=rng.choice([None, rng.randrange(300)]),
            origin=rng.choice(["EWR", "JFK"]),
            dest=rng.choice(["ATL", "BOS"]),
            distance=rng.randrange(100, 3000),
        )
        for i in range(500)
    ]
    async with bus:
        await bus.publish_many(TOPIC, [(f.plane, f) for f in new[:300]])
        dict_id = await train(bus)
        await bus.publish_many(TOPIC, [(f.plane, f) for f in new[300:]])
    data = await stored_data(r, bus)
    assert sum(d[0] == FORMAT_DICT_COMPACT and dictionary_id(d) == dict_id for d in data) == 200
    forget_dictionaries()  # the consumer loads the dictionary from Redis
    async with running(bus):
        await rec.wait_for(500 + len(old["entries"]))
    for e in old["entries"]:
        want = e["envelope"]
        event, ctx = seen[want["payload"]["position"]]
        assert event.model_dump() == want["payload"]
        assert ctx.event_id_bytes.hex() == want["event_id_hex"]
        assert ctx.published_at_ms == want["published_at_ms"]
        assert ctx.headers == want["headers"]
    assert [seen[f.position][0] for f in new] == new
    assert len(seen) == 500 + len(old["entries"])


async def test_unknown_dictionary_is_dead_lettered_with_its_reason(r: Any, settings: Any) -> None:
    bus = EventBus(settings())
    rec = Recorder()

    @bus.subscriber(TOPIC, group="g")
    async def handle(event: Tick, ctx: Context) -> None:
        rec.add(event, ctx)

    frame = zstandard.ZstdCompressor().compress(b"\x80")
    stream = bus.keys.stream(TOPIC, 0)
    await bus.registry.ensure(bus.topic(TOPIC))
    await r.xadd(
        stream,
        {
            F_RESOURCE: b"x",
            F_TYPE: b"Tick",
            F_DATA: b"\x05" + (999).to_bytes(8, "big") + bytes(16) + frame[4:],
        },
    )
    await bus.publish(TOPIC, Tick(resource="x", seq=1), resource_id="x")
    dl = DeadLetters(r, bus.keys, bus.topic(TOPIC), "g")
    async with running(bus):
        await rec.wait_for(1)
        await wait_until(lambda: _letters(dl, 1))
    (letter,) = await dl.letters()
    assert letter.reason == "undecodable"
    assert "dictionary 999" in letter.error and "not in Redis" in letter.error


async def _letters(dl: DeadLetters, n: int) -> bool:
    return len(await dl.letters()) == n


async def test_tier_copies_dictionaries_and_archive_readers_load_them(
    r: Any, settings: Any
) -> None:
    bus = EventBus(settings())
    async with bus:
        await publish(bus, range(300))
        dict_id = await train(bus)
        await publish(bus, range(300, 310))
    stream = bus.keys.stream(TOPIC, 0)
    rows = await r.xrange(stream)
    store = MemoryStore()
    await archive_dictionaries(r, bus.keys, store, TOPIC, rows)
    forget_dictionaries()
    compressed = [f for _, f in rows if dictionary_id(f[F_DATA]) == dict_id]
    assert compressed
    with pytest.raises(Exception, match=f"dictionary {dict_id}"):
        decode_entry(compressed[0])
    plan(store, TOPIC)  # replay's first step registers the store (the Spark reader does too)
    assert all(decode_entry(f).payload["seq"] >= 300 for f in compressed)
    await bus.aclose()


def test_cli_train_dict(redis_db: str) -> None:
    async def seed() -> None:
        bus = EventBus(Settings(redis_url=redis_db, shards=2))
        async with bus:
            await publish(bus, range(300))
        await bus.aclose()

    anyio.run(seed)
    out = CliRunner().invoke(
        app, ["topic", "train-dict", TOPIC, "--size", "2048", "--redis-url", redis_db]
    )
    assert out.exit_code == 0, out.output
    assert "is current" in out.output
    stats = CliRunner().invoke(app, ["stats", "--redis-url", redis_db], env={"COLUMNS": "200"})
    assert stats.exit_code == 0, stats.output
    lines = stats.output.splitlines()  # on a cluster a placement table follows
    header = next(line for line in lines if "B/entry" in line)
    row = next(line for line in lines if line.startswith(f"│ {TOPIC} "))
    per_entry = row.split("│")[header.split("┃").index(" B/entry ")].strip()
    assert 100 < int(per_entry) < 1000  # MEMORY USAGE of the shard streams / entries

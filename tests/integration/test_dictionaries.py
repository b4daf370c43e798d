"""Per-topic zstd dictionaries (`eventbus.protocol.dictionaries`) on a real redis-server: training
from a topic's entries (library and CLI), rotation with old entries still readable, entries of the
formats written before the upgrade (0x04) consumed beside new ones, publishers that keep writing
0x04 for a rolling upgrade (entry_format=4) read by add925e's decoder, an unknown dictionary ID
dead-lettered with its reason, and the durable tier's copies read back."""

from __future__ import annotations

import io
import json
import random
import subprocess
import sys
import tarfile
from pathlib import Path
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


async def test_entries_written_before_the_upgrade_are_consumed_beside_new_ones(
    r: Any, settings: Any
) -> None:
    """Entries of add925e's encoder (format 0x04 with its dictionary, 0x01, 0x02) stay in the
    shard streams across the upgrade: a fresh consumer loads their dictionary from Redis and
    handles them with their own event IDs and times, beside entries of the new format 0x05."""
    old = add925e_entries.load()
    bus = EventBus(settings())
    rec = Recorder()
    seen: dict[int, tuple[Flight, Context]] = {}

    @bus.subscriber(TOPIC, group="g")
    async def handle(event: Flight, ctx: Context) -> None:
        seen[event.position] = (event, ctx)
        rec.add(SimpleNamespace(resource=event.plane, seq=event.position), ctx)  # type: ignore[arg-type]

    shards = bus.topic(TOPIC).shards
    await bus.registry.ensure(bus.topic(TOPIC))
    await r.hsetnx(
        bus.keys.dictionaries(TOPIC), old["dictionary_id"], bytes.fromhex(old["dictionary_hex"])
    )
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
    assert sum(d[0] == 0x04 for d in data) == 2
    forget_dictionaries()  # the consumer loads both dictionaries from Redis
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


async def _published_in_both_formats(r: Any, settings: Any) -> tuple[dict[str, Any], list[Any]]:
    """(the fixture, the entries stored): the events of the fixture's 0x04 cases published
    with entry_format=4, then one event published with the default format, all with the
    fixture's dictionary current, stored in Redis as `train` stores it."""
    old = add925e_entries.load()
    bus4 = EventBus(settings(entry_format=4))
    await r.hset(
        bus4.keys.dictionaries(TOPIC),
        mapping={old["dictionary_id"]: bytes.fromhex(old["dictionary_hex"])},
    )
    await r.hset(bus4.keys.dictionaries(TOPIC), "current", old["dictionary_id"])
    async with bus4:
        for e in old["entries"]:
            if e["case"].startswith("0x04"):
                await bus4.publisher.publish_envelope(
                    bus4.topic(TOPIC), add925e_entries.envelope(e)
                )
    await bus4.aclose()
    bus5 = EventBus(settings())
    new = Flight(position=7, plane="N5", dep_delay=None, origin="JFK", dest="BOS", distance=187)
    async with bus5:
        await bus5.publish(TOPIC, new, resource_id=new.plane)
    await bus5.aclose()
    entries = []
    for s in range(bus5.topic(TOPIC).shards):
        entries += [f for _, f in await r.xrange(bus5.keys.stream(TOPIC, s))]
    return old, sorted(entries, key=lambda f: f[F_DATA][0])


async def test_publishers_with_entry_format_4_write_add925e_s_entries(
    r: Any, settings: Any
) -> None:
    """A rolling upgrade's first step (docs/operations.md): publishers with entry_format=4 write
    format 0x04 with the topic's current dictionary, every field byte for byte what add925e's
    encoder wrote for the same event (tests/fixtures/codec/entries.json); a publisher left at
    the default writes 0x05. Both are read by this release."""
    old, entries = await _published_in_both_formats(r, settings)
    want = [e for e in old["entries"] if e["case"].startswith("0x04")]

    assert [f[F_DATA][0] for f in entries] == [0x04, 0x04, 0x05]
    got = [{k.decode(): v.hex() for k, v in f.items()} for f in entries[:2]]
    assert sorted(got, key=str) == sorted((e["fields"] for e in want), key=str)
    assert {dictionary_id(f[F_DATA]) for f in entries} == {int(old["dictionary_id"])}
    assert sorted(decode_entry(f).payload["position"] for f in entries) == sorted(
        [7] + [e["envelope"]["payload"]["position"] for e in want]
    )


REPO = Path(__file__).resolve().parents[2]
OLD_RELEASE = "add925e"
"""The last commit before format 0x05: its readers know 0x01, 0x02 and 0x04."""
OLD_DECODER = """
import json, sys
import eventbus
from eventbus.protocol.codec import decode_entry
from eventbus.protocol.dictionaries import CACHE
given = json.load(sys.stdin)
CACHE.add(int(given["dictionary_id"]), bytes.fromhex(given["dictionary_hex"]))
out = {"eventbus": eventbus.__file__, "decoded": []}
for fields in given["entries"]:
    try:
        env = decode_entry({k.encode(): bytes.fromhex(v) for k, v in fields.items()})
        out["decoded"].append({"event_id_hex": env.event_id_bytes.hex(), "headers": env.headers,
                               "published_at_ms": env.published_at_ms, "payload": env.payload})
    except Exception as exc:
        out["decoded"].append(f"{type(exc).__name__}: {exc}")
json.dump(out, sys.stdout)
"""


@pytest.fixture(scope="module")
def old_release(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """add925e's eventbus package, from this clone's history (skipped without it)."""
    done = subprocess.run(
        ["git", "-C", str(REPO), "archive", OLD_RELEASE, "eventbus"], capture_output=True
    )
    if done.returncode:
        pytest.skip(f"{OLD_RELEASE} is not in this clone: {done.stderr.decode()[:200]}")
    out = tmp_path_factory.mktemp(OLD_RELEASE)
    with tarfile.open(fileobj=io.BytesIO(done.stdout)) as tar:
        tar.extractall(out, filter="data")
    return out


async def test_add925e_s_decoder_reads_format_4_and_refuses_0x05(
    r: Any, settings: Any, old_release: Path
) -> None:
    """The entries of publishers with entry_format=4, read from Redis, decoded by add925e's own
    code in a child process: every event as published. The default format 0x05 is an unknown
    format byte to it (a `DecodeError`: its consumers dead-letter such entries as undecodable,
    docs/operations.md)."""
    old, entries = await _published_in_both_formats(r, settings)
    given = {
        "dictionary_id": old["dictionary_id"],
        "dictionary_hex": old["dictionary_hex"],
        "entries": [{k.decode(): v.hex() for k, v in f.items()} for f in entries],
    }
    done = await anyio.run_process(  # in its folder: not this checkout's eventbus first
        [sys.executable, "-c", OLD_DECODER],
        input=json.dumps(given).encode(),
        cwd=old_release,
        env={"PYTHONPATH": str(old_release), "PATH": "/usr/bin:/bin"},
    )
    out = json.loads(done.stdout)

    assert Path(out["eventbus"]).is_relative_to(old_release)
    *old_reads, refused = out["decoded"]
    want = [e["envelope"] for e in old["entries"] if e["case"].startswith("0x04")]
    for w in want:
        del w["resource_id"], w["event_type"]
    assert sorted(old_reads, key=str) == sorted(want, key=str)
    assert refused == "DecodeError: unknown envelope format byte 0x05"


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
        {F_RESOURCE: b"x", F_TYPE: b"Tick", F_DATA: b"\x04" + (999).to_bytes(8, "big") + frame},
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

    import anyio

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

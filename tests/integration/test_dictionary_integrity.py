"""Planted zstd dictionaries on a real redis-server: a dictionary whose bytes were replaced by
another valid one, by garbage, or whose hash was turned into a stream, and a topic's ``current``
field set to garbage.

Whoever reads an entry (consumer, ``eventbus tail``, the offloader) gets a typed `DecodeError`
naming the dictionary (a consumer dead-letters the entry as ``undecodable`` and goes on), never a
zstd exception, a retry for ever, or a silently different payload; a publisher keeps the
dictionary it had; training never overwrites a stored version.
"""

from __future__ import annotations

import io
import json
import logging
from pathlib import Path
from typing import Any

import pytest
import zstandard
from pydantic import BaseModel
from support import running, wait_until
from typer.testing import CliRunner

from eventbus import Context, EventBus
from eventbus.cli import app
from eventbus.cli.topic import sample_bodies
from eventbus.dlq import DeadLetters
from eventbus.errors import ConfigError
from eventbus.protocol import compression, dictionaries
from eventbus.protocol.codec import F_DATA
from eventbus.protocol.dictionaries import CACHE, Dictionaries, dictionary_id
from eventbus.tier.replay import iter_events
from eventbus.tier.store import open_store

pytestmark = pytest.mark.anyio
TOPIC = "visits"
GARBAGE = b"\x37\xa4\x30\xec" + b"not a dictionary " * 20  # zstd's magic, then garbage


class Visit(BaseModel):
    city: str
    n: int


@pytest.fixture(autouse=True)
def _fresh_cache() -> None:
    forget_dictionaries()


def forget_dictionaries() -> None:
    """Drop this process's cached dictionaries, as a fresh process would start."""
    CACHE._dicts.clear()
    CACHE._missing.clear()
    compression.clear()


async def trained(bus: EventBus, plain: int = 200, compressed: int = 20) -> int:
    """Publish `plain` visits to Tokyo, train the topic's dictionary from them, publish
    `compressed` more (with it); the dictionary's ID."""
    for i in range(plain):
        await bus.publish(TOPIC, Visit(city="Tokyo", n=i), resource_id=f"r{i % 5}")
    d = Dictionaries(bus.redis, bus.keys)
    dict_id = await d.train(TOPIC, await sample_bodies(bus, d, TOPIC, 1000, bus.settings), 1024)
    bus.publisher.dictionaries._current.clear()  # publishers pick it up within REFRESH_S
    for i in range(plain, plain + compressed):
        await bus.publish(TOPIC, Visit(city="Tokyo", n=i), resource_id=f"r{i % 5}")
    return dict_id


async def plant(r: Any, bus: EventBus, dict_id: int, how: str) -> None:
    """Damage dictionary `dict_id` as a hostile or careless writer would."""
    key = bus.keys.dictionaries(TOPIC)
    if how == "swapped":  # another valid dictionary: Tokyo decodes as Kyoto
        data = await r.hget(key, str(dict_id))
        assert b"Tokyo" in data
        await r.hset(key, str(dict_id), data.replace(b"Tokyo", b"Kyoto"))
    elif how == "garbage":
        await r.hset(key, str(dict_id), GARBAGE)
    else:  # the hash turned into a stream: every HGET is a WRONGTYPE error reply
        assert how == "stream"
        await r.delete(key)
        await r.xadd(key, {"x": "y"})


async def compressed_count(r: Any, bus: EventBus, dict_id: int) -> int:
    data = []
    for s in range(bus.topic(TOPIC).shards):
        data += [f[F_DATA] for _, f in await r.xrange(bus.keys.stream(TOPIC, s))]
    return sum(dictionary_id(d) == dict_id for d in data)


@pytest.mark.parametrize("how", ["swapped", "garbage", "stream"])
async def test_consumer_dead_letters_entries_of_a_planted_dictionary(
    r: Any, settings: Any, how: str
) -> None:
    """Every entry of the damaged dictionary is dead-lettered as undecodable with the reason,
    the others are handled: no Kyoto, no retry for ever (a WRONGTYPE reply held a worker per
    entry until the group handled nothing), no `failed` after a zstd exception."""
    publisher = EventBus(settings())
    async with publisher:
        dict_id = await trained(publisher)
    await publisher.aclose()
    await plant(r, publisher, dict_id, how)
    forget_dictionaries()  # a fresh consumer process
    bus = EventBus(settings(concurrency=2))
    seen: list[Visit] = []

    @bus.subscriber(TOPIC, group="g", max_attempts=1)
    async def handle(event: Visit, ctx: Context) -> None:
        seen.append(event)

    dl = DeadLetters(r, bus.keys, bus.topic(TOPIC), "g")
    async with running(bus):
        await wait_until(lambda: _settled(dl, seen, 220), within_s=30)
    letters = await dl.letters()
    assert sorted(v.n for v in seen) == list(range(200))  # the plain ones, all of them
    assert all(v.city == "Tokyo" for v in seen)
    assert len(letters) == 20
    assert {x.reason for x in letters} == {"undecodable"}
    expected = {"swapped": "do not match", "garbage": "do not match", "stream": "WRONGTYPE"}[how]
    assert all(f"dictionary {dict_id}" in x.error and expected in x.error for x in letters)


async def _settled(dl: DeadLetters, seen: list[Visit], n: int) -> bool:
    return len(seen) + len(await dl.letters()) >= n


BAD_CURRENT = ["garbage", "abc", "-5", "0", "12345", "planted", "stream"]


@pytest.mark.parametrize("current", BAD_CURRENT)
async def test_publisher_keeps_its_dictionary_when_current_is_damaged(
    r: Any, settings: Any, current: str, monkeypatch: Any, caplog: Any
) -> None:
    """``current`` naming no valid dictionary (not an ID, no such version, a planted garbage
    version, the hash a stream): every publish() still works, with the dictionary it had, and
    the refresh says why at ERROR."""
    bus = EventBus(settings())
    key = bus.keys.dictionaries(TOPIC)
    async with bus:
        dict_id = await trained(bus, compressed=0)
        await bus.publish(TOPIC, Visit(city="Tokyo", n=1), resource_id="a")  # loads it
        if current == "planted":  # garbage stored under an ID of its own
            await r.hset(key, mapping={"777": GARBAGE, "current": "777"})
        elif current == "stream":
            await plant(r, bus, dict_id, "stream")
        else:
            await r.hset(key, "current", current)
        monkeypatch.setattr(dictionaries, "REFRESH_S", 0.0)  # every publish refreshes
        caplog.set_level(logging.ERROR, logger="eventbus")
        for i in range(3):
            await bus.publish(TOPIC, Visit(city="Tokyo", n=i), resource_id="a")
    await bus.aclose()
    assert await compressed_count(r, bus, dict_id) == 4
    refused = [x for x in caplog.records if x.levelno >= logging.ERROR]
    assert refused and all(f"keeping dictionary {dict_id}" in x.getMessage() for x in refused)


async def test_a_fresh_publisher_with_a_garbage_current_publishes_without_a_dictionary(
    r: Any, settings: Any
) -> None:
    bus = EventBus(settings())
    key = bus.keys.dictionaries(TOPIC)
    await r.hset(key, mapping={"777": GARBAGE, "current": "777"})
    async with bus:
        await bus.publish(TOPIC, Visit(city="Tokyo", n=1), resource_id="a")
    await bus.aclose()
    (data,) = [f[F_DATA] for s in range(4) for _, f in await r.xrange(bus.keys.stream(TOPIC, s))]
    assert dictionary_id(data) is None


async def test_training_never_overwrites_a_stored_version(
    r: Any, settings: Any, monkeypatch: Any
) -> None:
    """A version is written once: a value already under the trained dictionary's ID (here
    planted) is left as it is, and ``current`` is not moved to it."""
    bus = EventBus(settings())
    key = bus.keys.dictionaries(TOPIC)
    async with bus:
        for i in range(200):
            await bus.publish(TOPIC, Visit(city="Tokyo", n=i), resource_id=f"r{i % 5}")
        d = Dictionaries(bus.redis, bus.keys)
        samples = await sample_bodies(bus, d, TOPIC, 1000, bus.settings)
        fixed = zstandard.train_dictionary(1024, samples, dict_id=100_000, level=3)
        planted = {
            str(dictionaries.fingerprint(fixed.as_bytes()))  # where the version goes now
            if hasattr(dictionaries, "fingerprint")
            else "100000": GARBAGE,  # where a counter at 99,999 put it
        }
        await r.set(f"{key.rsplit(':', 2)[0]}:dict-seq", 99_999)
        await r.hset(key, mapping={**planted, "100000": GARBAGE})
        monkeypatch.setattr(zstandard, "train_dictionary", lambda *a, **k: fixed)
        with pytest.raises(ConfigError, match="holds other bytes"):
            await d.train(TOPIC, samples, 1024)
        stored = await r.hgetall(key)
    await bus.aclose()
    assert all(stored[k.encode()] == GARBAGE for k in [*planted, "100000"])
    assert b"current" not in stored


@pytest.mark.parametrize("how", ["swapped", "garbage", "stream"])
def test_tail_shows_a_planted_dictionary_as_an_entry_error(
    redis_db: str, how: str, tmp_path: Path
) -> None:
    dict_id = _seed(redis_db, how)
    result = CliRunner().invoke(app, ["tail", TOPIC, "--count", "500", "--redis-url", redis_db])
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    errors = [row["error"] for row in rows if "error" in row]
    assert len(rows) == 220 and len(errors) == 20
    assert all(f"dictionary {dict_id}" in e for e in errors)
    assert all(row["payload"]["city"] == "Tokyo" for row in rows if "payload" in row)


@pytest.mark.parametrize("how", ["swapped", "garbage", "stream"])
def test_offloader_archives_past_a_planted_dictionary(
    redis_db: str, how: str, tmp_path: Path
) -> None:
    """``eventbus offload --once`` archives every topic (one sorted after the damaged one
    too) and copies no damaged dictionary to the store; replay reads the damaged entries
    back as undecodable, never as Kyoto. Run after another command of the same process left
    its log handler on a stream now closed (as a test session does): offload's own handler
    prints the warning (it used to keep the old one: "--- Logging error ---" and a traceback)."""
    dict_id = _seed(redis_db, how, also="zz-after")
    store = tmp_path / "segs"
    env = {"EVENTBUS_TIER_HOT_WINDOW_S": "0", "EVENTBUS_TIER_TRIM_EXACT": "true"}
    args = ["--store", str(store), "--redis-url", redis_db]
    earlier = io.StringIO()
    logging.basicConfig(handlers=[logging.StreamHandler(earlier)], force=True)
    earlier.close()  # as CliRunner closes the streams of a finished invocation
    try:
        off = CliRunner().invoke(app, ["offload", "--once", *args], env=env)
    finally:
        logging.basicConfig(handlers=[logging.NullHandler()], force=True)
        logging.root.handlers.clear()
    assert off.exit_code == 0, off.output
    assert "Traceback" not in off.output and "Logging error" not in off.output
    assert f"dictionary {dict_id}" in off.output  # the skip, said where the user sees it
    assert not list(store.glob(f"{TOPIC}/_dictionaries/*"))
    forget_dictionaries()  # a replaying process: the archive alone
    archive = open_store(f"file://{store}")
    assert len(list(iter_events(archive, "zz-after", [Visit]))) == 5
    with pytest.raises(Exception, match=f"dictionary {dict_id}") as caught:
        list(iter_events(archive, TOPIC, [Visit]))
    assert type(caught.value).__module__.startswith("eventbus")  # a DecodeError, not zstd's


def _seed(redis_db: str, how: str, also: str | None = None) -> int:
    """200 plain and 20 compressed visits, the dictionary damaged `how` (and `also`, a
    topic of 5 plain visits); the dictionary's ID."""
    import anyio

    from eventbus import Settings

    async def go() -> int:
        bus = EventBus(Settings(redis_url=redis_db, shards=2))
        async with bus:
            dict_id = await trained(bus)
            for i in range(5 if also else 0):
                await bus.publish(also or "", Visit(city="Osaka", n=i), resource_id="x")
            await plant(bus.redis, bus, dict_id, how)
        await bus.aclose()
        forget_dictionaries()
        return dict_id

    return anyio.run(go)

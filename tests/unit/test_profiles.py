"""Wire profiles (`eventbus.profiles`): choosing one, what a bus of the Verse profile refuses,
and what its publisher writes, byte for byte against Verse's own output
(tests/fixtures/verse/entries.json); the default profile's parts are eventbus's own, picked
once (`publishing.foreign` is the Verse profile's encoding path)."""

from __future__ import annotations

import functools
import json
import random
from pathlib import Path

import jsonschema
import pytest
from pydantic import BaseModel
from unit.test_describe import SCHEMA_FILE, assert_valid

from eventbus import EventBus, Settings
from eventbus.asyncapi import asyncapi_document
from eventbus.consumer import Consumer
from eventbus.consumer.decoding import Decoding
from eventbus.consumer.running import make_consumers
from eventbus.contract import contract_of
from eventbus.errors import ConfigError, InvalidEvent, PayloadTooLarge
from eventbus.locking.locks import LockClient
from eventbus.locking.member import Member
from eventbus.locking.verse import VerseLockClient
from eventbus.profiles import EVENTBUS, PROFILES, VERSE, profile_named
from eventbus.protocol.codec import F_DATA, F_RESOURCE, F_TYPE, Envelope, encode_entry
from eventbus.protocol.keys import Keys
from eventbus.protocol.sharding import shard_of
from eventbus.protocol.topics import TopicRegistry
from eventbus.protocol.verse import verse_shard_of
from eventbus.protocol.verse.envelope import REPLY_TO_HEADER
from eventbus.publishing import foreign
from eventbus.testing import memory_redis

FIXTURES = json.loads(
    (Path(__file__).resolve().parents[1] / "fixtures" / "verse" / "entries.json").read_text()
)
MESSAGES = {m["name"]: m for m in FIXTURES["messages"]}


class Placed(BaseModel):
    __event_type__ = "placed"
    order_id: str


def test_profiles_by_name() -> None:
    assert profile_named("eventbus") is EVENTBUS and profile_named("verse") is VERSE
    assert profile_named(VERSE) is VERSE
    assert set(PROFILES) == {"eventbus", "verse"}
    for bad in ("Verse", "", None, 3):
        with pytest.raises(ConfigError, match="unknown wire profile"):
            profile_named(bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="'kafka'"):
        EventBus(profile="kafka")


def test_the_default_bus_keeps_eventbus_parts() -> None:
    bus = EventBus()
    assert bus.profile is EVENTBUS and type(bus.keys) is Keys
    assert bus.keys.stream("orders", 3) == "eventbus:stream:orders:3"
    publisher = bus.publisher
    # its own fast path, inline: no codec call
    assert publisher.encoder.prepare_envelope == publisher.encoder.prepare_native
    assert publisher.encoder._shard_of is shard_of
    stream, fields = publisher.encoder.prepare(bus.topic("orders"), Placed(order_id="a"), "user-42")
    assert stream == bus.keys.stream("orders", shard_of("user-42", 16))
    assert set(fields) == {F_RESOURCE, F_TYPE, F_DATA}


def test_verse_bus_names_verses_streams_and_keeps_eventbus_keys_for_the_rest() -> None:
    bus = EventBus(Settings(key_prefix="svc"), profile="verse")
    assert bus.keys.stream("orders", 13) == "VERSE:STREAM:RESOURCE:orders$13"
    assert bus.keys.dead_letter("orders", "billing") == "svc:dlq:orders:billing"
    assert bus.keys.parked("orders", "billing").startswith("svc:{eventbus}:")
    assert EventBus.from_env(profile="verse").profile is VERSE


def test_lock_clients_of_each_profile() -> None:
    member = Member(memory_redis(), Keys(), Settings(), "orders", "billing", "c-1", EVENTBUS)
    assert isinstance(EVENTBUS.lock_client(member, 16, None), LockClient)
    verse = VERSE.lock_client(member, 16, None)
    assert isinstance(verse, VerseLockClient)
    assert verse._locks[3] == "{VERSE:STREAM:SHARDLOCK}:VERSE:STREAM:RESOURCE:orders:3:billing"
    assert verse._liveness == "{VERSE:STREAM:SHARDLOCK}:SERVICE_LIVENESS:c-1"


@pytest.mark.parametrize("shards", [33, 64, 1024])
def test_a_verse_topic_over_32_shards_is_refused(shards: int) -> None:
    bus = EventBus(profile="verse")
    with pytest.raises(ConfigError, match=r"1\.\.32"):
        bus.topic("orders", shards=shards)
    with pytest.raises(ConfigError, match=r"1\.\.32"):
        EventBus(Settings(shards=shards), profile="verse").topic("orders")
    assert EventBus().topic("orders", shards=shards).shards == shards


def test_a_verse_bus_refuses_to_park() -> None:
    bus = EventBus(profile="verse")
    with pytest.raises(ConfigError, match="orders by shard"):
        bus.subscriber("orders", group="billing", on_failure="park")
    bus.subscriber("orders", group="billing", on_failure="continue")
    EventBus().subscriber("orders", group="billing", on_failure="park")


def test_a_verse_bus_has_no_archive() -> None:
    with pytest.raises(ConfigError, match="no durable tier"):
        EventBus(profile="verse", archive=object())


def test_the_publisher_writes_the_bytes_verse_writes() -> None:
    m = MESSAGES["eventbus_resource_event"]
    bus = EventBus(profile="verse")
    env = Envelope(
        "o-2",
        "created",
        int(m["id"], 36).to_bytes(16, "big"),
        0,
        {"tenant": "acme", REPLY_TO_HEADER: "REPLY_TO:abc"},
        {"order_id": "o-2", "total_cents": 99},
    )
    stream, fields = bus.publisher.encoder.prepare_envelope(bus.topic("orders"), env)
    assert fields == {b"msg": bytes.fromhex(m["msg_hex"])}
    assert stream == f"VERSE:STREAM:RESOURCE:orders${verse_shard_of('o-2', 16)}"


@pytest.mark.parametrize("header", ["event", "resource_id"])
def test_a_header_the_envelope_writes_itself_is_refused(header: str) -> None:
    bus = EventBus(profile="verse")
    with pytest.raises(InvalidEvent, match=header):
        bus.publisher.encoder.prepare(bus.topic("orders"), Placed(order_id="a"), "a", {header: "x"})


def test_an_entry_over_the_payload_limit_is_refused() -> None:
    bus = EventBus(Settings(max_payload_bytes=1024), profile="verse")
    noise = random.Random(0).randbytes(2048).hex()  # random: zlib cannot shrink it to 1 KiB
    with pytest.raises(PayloadTooLarge):
        bus.publisher.encoder.prepare(bus.topic("orders"), Placed(order_id=noise), "a")


def test_an_entry_consumers_could_not_decode_is_refused() -> None:
    settings = Settings(max_payload_bytes=64 * 1024)  # consumers inflate up to 4 MiB
    codec = VERSE.codec
    env = Envelope("a", "placed", bytes(16), 0, {}, {"blob": "x" * (5 << 20)})  # zlib: ~5 KiB
    with pytest.raises(InvalidEvent, match=r"would not decode: .*more than"):
        foreign.encode_foreign(codec, settings, EventBus().topic("orders"), env)
    assert EVENTBUS.codec.orders_by_resource and not VERSE.codec.orders_by_resource
    assert EVENTBUS.codec.archived and not VERSE.codec.archived
    assert EVENTBUS.codec.encode is encode_entry


def test_the_asyncapi_document_of_a_verse_bus_names_verses_streams() -> None:
    validator = jsonschema.Draft7Validator(json.loads(SCHEMA_FILE.read_text()))
    bus = EventBus(profile="verse")

    @bus.subscriber("orders", group="billing", on_unknown="skip")
    async def on_placed(event: Placed) -> None: ...

    doc = asyncapi_document(contract_of(bus), keys=bus.keys, title="t", profile=bus.profile)
    assert_valid(validator, doc)
    channel = doc["channels"]["orders"]
    assert channel["address"] == "VERSE:STREAM:RESOURCE:orders${shard}"
    assert "Verse's 32-bit" in channel["description"]
    assert channel["x-eventbus"]["profile"] == "verse"
    bus = EventBus()
    bus.publishes("orders", Placed)
    channel = asyncapi_document(contract_of(bus), keys=bus.keys, title="t")["channels"]["orders"]
    assert channel["address"] == "eventbus:stream:orders:{shard}"
    assert "xxh64" in channel["description"] and channel["x-eventbus"]["profile"] == "eventbus"


@pytest.mark.parametrize("profile", ["eventbus", "verse"])
def test_a_consumer_gets_its_profiles_parts_once(profile: str) -> None:
    bus = EventBus(profile=profile)

    @bus.subscriber("orders", group="billing")
    async def on_placed(event: Placed) -> None: ...

    redis = memory_redis()
    registry = TopicRegistry(redis, bus.keys)
    [consumer] = make_consumers(
        bus.subscriptions, redis, bus.keys, bus.settings, registry, profile=bus.profile
    )
    assert isinstance(consumer, Consumer)
    prepare = consumer.handling.prepare
    if profile == "eventbus":  # the code that ran before profiles existed
        assert isinstance(consumer.ownership.locks, LockClient)
        assert prepare.__func__ is Decoding.prepare  # type: ignore[attr-defined]
        assert consumer.ownership.table.streams[3] == "eventbus:stream:orders:3"
    else:
        assert isinstance(consumer.ownership.locks, VerseLockClient)
        assert isinstance(prepare, functools.partial)
        assert prepare.func.__func__ is Decoding.prepare_foreign  # type: ignore[attr-defined]
        assert consumer.ownership.table.streams[3] == "VERSE:STREAM:RESOURCE:orders$3"

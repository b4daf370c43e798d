"""A poison entry on every path, as test cases run on fakeredis and on a real redis-server
(`cases.backends`): an entry whose bytes make its decoder raise something other than
`DecodeError` (a value nested deeper than a decoder goes, see `DEPTH`; a codec's own bug)
is dead-lettered as ``undecodable`` with that error named (a broadcast subscriber drops and
counts it; replay raises `DecodeError` naming its segment), the consumer keeps running, and the
other entries of the same read are handled: the group consumer, a batch, a broadcast, catch-up
from the archive, replay, and the Verse profile (single and batch).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import time
import zlib
from pathlib import Path
from typing import Any

import msgpack
import pytest
from cases.backends import Backend
from cases.verse_peer import find_partition, pack, publish_resource_event
from cases.verse_profile_cases import CHANNEL, GROUP, TOPIC, Placed, create_groups, verse_bus
from support import Recorder, Tick, running, total_pending, wait_until

from eventbus import Context, EventBus, shard_of
from eventbus.dlq import DeadLetter, DeadLetters
from eventbus.errors import DecodeError
from eventbus.profiles import EVENTBUS, Codec
from eventbus.protocol.codec import F_DATA, F_RESOURCE, F_TYPE, decode_entry
from eventbus.tier import catch_up, offload_until_caught_up, open_store
from eventbus.tier.replay import iter_events, iter_topic
from eventbus.tier.settings import TierSettings

DEPTH = 1_000 if sys.version_info < (3, 12) else 100_000
"""How deep the poison entries nest. On Python 3.11, 1,000 levels: MessagePack's unpacker reads
them (its stack is 1,024 levels) and msgspec's decoder and json's encoder raise
``RecursionError``, since C code shares the interpreter's limit of 1,000 there. From 3.12 the C
recursion limit is separate and higher (gh-91079): 1,000 levels decode, and an entry nested
deeper than 1,024 is refused by MessagePack's unpacker (``StackError``) before anything recurses."""

POISON_ERROR = "RecursionError" if sys.version_info < (3, 12) else "StackError"
"""The error a poison entry's dead letter names on this interpreter (see `DEPTH`)."""


def deep(packed: bytes) -> bytes:
    """`packed` (MessagePack ending in a nil) with the nil replaced by arrays nested `DEPTH`
    deep: ``0x91`` is a one-element array, ``0x90`` an empty one (no packer nests that deep)."""
    assert packed.endswith(b"\xc0")
    return packed[:-1] + b"\x91" * DEPTH + b"\x90"


def deep_payload_entry(resource_id: str, event_type: str = "Tick") -> dict[bytes, bytes]:
    """An entry of eventbus's format (``0x01``) whose payload is nested `DEPTH` deep."""
    body = {"v": 1, "id": os.urandom(16), "ts": int(time.time() * 1000), "h": {}, "p": None}
    return {
        F_RESOURCE: resource_id.encode(),
        F_TYPE: event_type.encode(),
        F_DATA: b"\x01" + deep(msgpack.packb(body, use_bin_type=True)),
    }


def deep_header_verse_msg() -> bytes:
    """The Verse entry of the report: a header value nested `DEPTH` deep (zlib, ~50 bytes)."""
    body = {"i": "abc", "c": {"n": 7}, "r": None, "h": {"event": "placed", "x": None}}
    return zlib.compress(deep(msgpack.packb(body, use_bin_type=True)))


async def drained(bus: EventBus, topic: str, group: str, r: Any) -> bool:
    return await total_pending(bus, topic, group, r) == 0


async def letters(bus: EventBus, topic: str, group: str) -> list[DeadLetter]:
    return await DeadLetters(bus.redis, bus.keys, bus.topic(topic), group).letters()


async def letters_are(bus: EventBus, topic: str, group: str, n: int) -> bool:
    return len(await letters(bus, topic, group)) == n


def assert_poison_letter(letter: DeadLetter, entry_id: str, named: str) -> None:
    assert (letter.entry_id, letter.reason, letter.attempts) == (entry_id, "undecodable", 0)
    assert letter.error_type == "DecodeError" and named in letter.error, letter.error


def _tier() -> TierSettings:
    return TierSettings(
        segment_max_entries=300,
        segment_max_age_s=0.0,
        hot_window_s=0.0,
        trim_exact=True,
        poll_interval_s=0.02,
    )


class PoisonEntryCases:
    """A poison entry on every path, on the `backend` a subclass provides."""

    pytestmark = pytest.mark.anyio

    async def test_the_group_consumer_dead_letters_it_and_handles_the_rest_of_the_read(
        self, backend: Backend
    ) -> None:
        r = backend.redis
        bus = backend.bus(shards=2)
        rec = Recorder()

        @bus.subscriber("orders", group="billing")
        async def handle(event: Tick, ctx: Context) -> None:
            rec.add(event, ctx)

        rid = "victim"
        stream = bus.keys.stream("orders", shard_of(rid, 2))
        await bus.publish("orders", Tick(resource=rid, seq=0), resource_id=rid)
        poison = (await r.xadd(stream, deep_payload_entry(rid))).decode()
        await bus.publish("orders", Tick(resource=rid, seq=1), resource_id=rid)
        await bus.publish("orders", Tick(resource="other", seq=0), resource_id="other")
        async with running(bus):  # one read holds all four
            await rec.wait_for(3)
            await wait_until(lambda: letters_are(bus, "orders", "billing", 1))
            await wait_until(lambda: drained(bus, "orders", "billing", r))
        assert rec.by_resource() == {rid: [0, 1], "other": [0]}
        (letter,) = await letters(bus, "orders", "billing")
        assert_poison_letter(letter, poison, POISON_ERROR)

    async def test_a_batch_dead_letters_it_in_its_place(self, backend: Backend) -> None:
        r = backend.redis
        bus = backend.bus(shards=1)
        calls: list[list[int]] = []

        @bus.subscriber("orders", group="billing", batch=True)
        async def handle(events: list[Tick]) -> None:
            calls.append([e.seq for e in events])

        stream = bus.keys.stream("orders", 0)
        for seq in range(2):
            await bus.publish("orders", Tick(resource="a", seq=seq), resource_id="a")
        poison = (await r.xadd(stream, deep_payload_entry("a"))).decode()
        for seq in range(2, 4):
            await bus.publish("orders", Tick(resource="a", seq=seq), resource_id="a")
        async with running(bus):
            await wait_until(lambda: sum(map(len, calls)) == 4)
            await wait_until(lambda: drained(bus, "orders", "billing", r))
        assert calls == [[0, 1], [2, 3]]  # the poison breaks the batch in its place
        (letter,) = await letters(bus, "orders", "billing")
        assert_poison_letter(letter, poison, POISON_ERROR)

    async def test_a_broadcast_drops_and_counts_it(
        self, backend: Backend, caplog: pytest.LogCaptureFixture
    ) -> None:
        r = backend.redis
        bus = backend.bus(shards=1)
        seen: list[int] = []

        @bus.subscriber("config", broadcast=True)
        async def reload(event: Tick) -> None:
            seen.append(event.seq)

        stream = bus.keys.stream("config", 0)
        with caplog.at_level(logging.WARNING, logger="eventbus.consumer"):
            async with running(bus) as [run]:
                await run.drain()  # the broadcast reader starts at the stream's end
                await bus.publish("config", Tick(resource="a", seq=0), resource_id="a")
                poison = (await r.xadd(stream, deep_payload_entry("a"))).decode()
                await bus.publish("config", Tick(resource="a", seq=1), resource_id="a")
                await wait_until(lambda: len(seen) == 2)
                assert bus.consumers[0].dropped == 1  # type: ignore[union-attr]
        assert seen == [0, 1]
        (warning,) = [m for m in caplog.messages if poison in m]
        assert "undecodable, dropped" in warning and POISON_ERROR in warning

    async def test_any_exception_of_a_codec_is_a_dead_letter_naming_it(
        self, backend: Backend
    ) -> None:
        """Not only the known error classes: a codec (a wire profile's) that raises anything
        for an entry makes that entry a dead letter naming the exception's class."""
        r = backend.redis

        def decode(fields: dict[bytes, bytes], *, max_bytes: int, entry_id: str) -> Any:
            if fields[F_TYPE] == b"Boom":
                raise MemoryError("a decoder's own bug")
            return decode_entry(fields, max_bytes=max_bytes)

        codec = Codec(EVENTBUS.codec.encode, decode, EVENTBUS.codec.fields)
        profile = dataclasses.replace(EVENTBUS, name="buggy", codec=codec)
        bus = EventBus(
            backend.settings(shards=1),
            redis=backend.redis if backend.url is None else None,
            profile=profile,
        )
        seen: list[int] = []

        @bus.subscriber("orders", group="billing")
        async def handle(event: Tick) -> None:
            seen.append(event.seq)

        await bus.publish("orders", Tick(resource="a", seq=0), resource_id="a")
        fields = {F_RESOURCE: b"a", F_TYPE: b"Boom", F_DATA: b"\x01\x80"}
        poison = (await r.xadd(bus.keys.stream("orders", 0), fields)).decode()
        await bus.publish("orders", Tick(resource="a", seq=1), resource_id="a")
        async with running(bus):
            await wait_until(lambda: len(seen) == 2)
            await wait_until(lambda: drained(bus, "orders", "billing", r))
        assert seen == [0, 1]
        (letter,) = await letters(bus, "orders", "billing")
        assert_poison_letter(letter, poison, "MemoryError while decoding: a decoder's own bug")

    async def test_the_verse_profile_dead_letters_it_in_single_and_batch_groups(
        self, backend: Backend
    ) -> None:
        """A header nested 1,000 deep, which a Verse publisher can write. On 3.11 it killed
        `bus.run()` at every restart, leaving the entry pending and nothing handled."""
        r = backend.redis
        await create_groups(r)
        await create_groups(r, group="audit")
        bus = verse_bus(backend)
        single: list[int] = []
        batches: list[list[int]] = []

        @bus.subscriber(TOPIC, group=GROUP)
        async def handle(event: Placed) -> None:
            single.append(event.seq)

        @bus.subscriber(TOPIC, group="audit", batch=True)
        async def audit(events: list[Placed]) -> None:
            batches.append([e.seq for e in events])

        stream = f"{CHANNEL}${find_partition('o-1')}"
        await publish_resource_event(r, TOPIC, "o-1", "placed", {"order_id": "o-1", "seq": 0})
        poison = (await r.xadd(stream, {"msg": deep_header_verse_msg()})).decode()
        await publish_resource_event(r, TOPIC, "o-1", "placed", {"order_id": "o-1", "seq": 1})
        async with running(bus):
            await wait_until(lambda: len(single) == 2 and sum(map(len, batches)) == 2)
            for group in (GROUP, "audit"):
                await wait_until(lambda g=group: letters_are(bus, TOPIC, g, 1))  # type: ignore[misc]
        assert single == [0, 1] and [s for b in batches for s in b] == [0, 1]
        for group in (GROUP, "audit"):
            (letter,) = await letters(bus, TOPIC, group)
            assert_poison_letter(letter, poison, POISON_ERROR)
            if sys.version_info < (3, 12):
                assert "'x'" in letter.error  # the header is named (3.12+: its frame fails first)
            assert letter.original() == {b"msg": deep_header_verse_msg()}  # byte for byte

    async def test_a_verse_broadcast_drops_and_counts_it(self, backend: Backend) -> None:
        r = backend.redis
        await create_groups(r)
        bus = verse_bus(backend)
        seen: list[int] = []

        @bus.subscriber(TOPIC, broadcast=True)
        async def each(event: Placed) -> None:
            seen.append(event.seq)

        stream = f"{CHANNEL}${find_partition('o-1')}"
        async with running(bus) as [run]:
            await run.drain()
            await publish_resource_event(r, TOPIC, "o-1", "placed", {"order_id": "o-1", "seq": 0})
            await r.xadd(stream, {"msg": deep_header_verse_msg()})
            await r.xadd(stream, {"msg": pack({"order_id": "o-1", "seq": 1}, {"event": "placed"})})
            await wait_until(lambda: len(seen) == 2)
            assert bus.consumers[0].dropped == 1  # type: ignore[union-attr]
        assert seen == [0, 1]

    async def test_catch_up_and_replay_from_the_archive(
        self, backend: Backend, tmp_path: Path
    ) -> None:
        """Archived, the poison is still one entry: the offloader writes it (its envelope
        columns null), catch-up dead-letters it and handles the rest, replay raises
        `DecodeError` naming its segment (`iter_events`, documented) and reads it raw
        (`iter_topic`)."""
        r = backend.redis
        store = open_store(str(tmp_path / "segments"))
        bus = backend.bus(shards=1)
        seen: list[int] = []

        @bus.subscriber("orders", group="billing")
        async def handle(event: Tick) -> None:
            seen.append(event.seq)

        stream = bus.keys.stream("orders", 0)
        await r.xgroup_create(stream, "billing", id="0", mkstream=True)  # nobody reads yet
        await bus.publish("orders", Tick(resource="a", seq=0), resource_id="a")
        poison = (await r.xadd(stream, deep_payload_entry("a"))).decode()
        await bus.publish("orders", Tick(resource="a", seq=1), resource_id="a")
        await offload_until_caught_up(r, store, settings=bus.settings, tier=_tier(), timeout_s=60)
        assert await r.xlen(stream) < 3  # trimmed: the group's backlog lives in segments

        raw = list(iter_topic(store, "orders"))
        assert [str(e.entry_id) for e in raw][1] == poison and raw[1].event_id is None
        replayed: list[int] = []
        with pytest.raises(DecodeError, match=POISON_ERROR) as caught:
            for event in iter_events(store, "orders", [Tick]):
                replayed.append(event.event.seq)  # type: ignore[attr-defined]
        assert replayed == [0] and f"entry {poison}" in str(caught.value)

        async with bus:
            await catch_up(bus, store, "orders", "billing")
        assert seen == [0, 1]
        (letter,) = await letters(bus, "orders", "billing")
        assert_poison_letter(letter, poison, POISON_ERROR)

"""`Publisher.publish_envelopes` (the Spark writer's path, one call per chunk of rows): ready
envelopes land in list order with their entry IDs, a bad one fails the call with nothing of it
published; and `publish_envelope` checks the topic once, not once per call."""

from __future__ import annotations

import secrets
from collections.abc import Callable
from typing import Any

import pytest
import redis.asyncio

from eventbus import EventBus, Settings
from eventbus.errors import PayloadTooLarge, ReservedEventType
from eventbus.protocol.codec import Envelope, decode_entry
from eventbus.protocol.event_ids import new_event_id

pytestmark = pytest.mark.anyio

RESOURCES = [f"r{i}" for i in range(6)]


def _envelopes(n: int, etype: str = "Tick") -> list[Envelope]:
    return [
        Envelope(RESOURCES[i % len(RESOURCES)], etype, new_event_id(), 1, {"n": str(i)}, {"i": i})
        for i in range(n)
    ]


async def _stored(r: Any, bus: EventBus, topic: str) -> dict[str, list[tuple[str, Envelope]]]:
    """Per shard stream key, its (entry ID, envelope) pairs in stream order."""
    out = {}
    for shard in range(bus.topic(topic).shards):
        key = bus.keys.stream(topic, shard)
        out[key] = [(eid.decode(), decode_entry(f)) for eid, f in await r.xrange(key)]
    return out


@pytest.mark.parametrize("running", [True, False], ids=["running-bus", "no-flusher"])
async def test_envelopes_land_in_list_order_with_their_entry_ids(
    settings: Callable[..., Settings], r: redis.asyncio.Redis, running: bool
) -> None:
    """500 envelopes over 6 resources in pipelines of 50: each resource's envelopes are in its
    stream in list order, and the i-th returned entry ID is the i-th envelope's entry."""
    bus = EventBus(settings(shards=4, publish_batch_max=50, publish_pipelines=1))
    sent = _envelopes(500)
    try:
        if running:
            async with bus:
                ids = await bus.publisher.publish_envelopes(bus.topic("env"), sent)
        else:
            ids = await bus.publisher.publish_envelopes(bus.topic("env"), sent)
        stored = await _stored(r, bus, "env")
    finally:
        await bus.aclose()
    by_id = {(env.resource_id, eid): env for entries in stored.values() for eid, env in entries}
    assert len(ids) == 500 and len(by_id) == 500
    for i, (env, eid) in enumerate(zip(sent, ids, strict=True)):
        got = by_id[env.resource_id, eid]
        assert (got.payload, got.event_id_bytes, got.headers) == (
            {"i": i},
            env.event_id_bytes,
            {"n": str(i)},
        )
    for entries in stored.values():
        per_resource: dict[str, list[int]] = {}
        for _, env in entries:
            per_resource.setdefault(env.resource_id, []).append(env.payload["i"])
        assert all(seq == sorted(seq) for seq in per_resource.values())


async def test_a_bad_envelope_fails_the_call_with_nothing_of_it_published(
    settings: Callable[..., Settings], r: redis.asyncio.Redis
) -> None:
    """An envelope over `max_payload_bytes` (random text: compression does not bring it under)
    or of a reserved event type, in the middle of the list: the call raises its error and none
    of the list's envelopes is stored."""
    bus = EventBus(settings(shards=2, max_payload_bytes=4096))
    big = _envelopes(10)
    big[5].payload = {"blob": secrets.token_hex(8192)}
    reserved = _envelopes(10)
    reserved[5].event_type = "__eventbus.drop"
    try:
        async with bus:
            with pytest.raises(PayloadTooLarge):
                await bus.publisher.publish_envelopes(bus.topic("bad"), big)
            with pytest.raises(ReservedEventType):
                await bus.publisher.publish_envelopes(bus.topic("bad"), reserved)
            assert await bus.publisher.publish_envelopes(bus.topic("bad"), []) == []
            stored = await _stored(r, bus, "bad")
    finally:
        await bus.aclose()
    assert all(entries == [] for entries in stored.values())


async def test_publish_envelope_sets_the_topic_up_once_not_per_call(
    settings: Callable[..., Settings], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once the topic's shard count is checked (and its dictionary looked up), a further
    `publish_envelope` does not run the topic setup again: it ran per call before (with a
    cancel scope each, most of the Spark writer's time per row)."""
    bus = EventBus(settings(shards=2))
    runs: list[str] = []
    setup = bus.publisher._setup
    real = setup.run

    async def counted(topic: Any) -> None:
        runs.append(topic.name)
        await real(topic)

    monkeypatch.setattr(setup, "run", counted)
    try:
        async with bus:
            for env in _envelopes(20):
                await bus.publisher.publish_envelope(bus.topic("once"), env)
    finally:
        await bus.aclose()
    assert runs == ["once"]
